"""Test helpers shared by the Triton tier tests (test_gqa_triton.py, test_paged_triton.py):
a launch spy and the two-roundings comparison of two builds of one kernel."""

from __future__ import annotations

import torch


class KernelSpy:
    """``kernel[grid](**kw)`` that records ``kw`` in ``seen`` and launches ``kernel``."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch_(**kw):
            self.seen.append(kw)
            return self.kernel[grid](**kw)

        return launch_


def assert_within_two_roundings(got: torch.Tensor, base: torch.Tensor) -> None:
    """``got`` (one build's output) is within two output roundings of ``base`` (another's)."""
    tol = 2 * torch.finfo(got.dtype).eps * base.abs().max().item()
    assert (got.double() - base.double()).abs().max().item() <= tol

"""Test configuration shared by all tests.

- Without CUDA, ``TRITON_INTERPRET=1`` is set before anything imports triton, so the Triton
  kernels run on the CPU (tests marked ``interpret`` use tiny shapes and fp16/fp32 data: the
  triton 3.6 interpreter mishandles bf16).
- Tests marked ``gpu`` are skipped without CUDA; run them on the GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_env_settings():
    """Each test sees the environment as it is now (the cascade caches it per process)."""
    from longattn import _cascade

    _cascade.reload_env()
    yield
    _cascade.reload_env()


@pytest.fixture
def device():
    return torch.device("cuda" if _HAS_CUDA else "cpu")

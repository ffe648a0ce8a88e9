"""Host-side helpers shared by every op's Triton launcher (imports triton: load lazily)."""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from ._cascade import interpreter_active

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """(stride over KV heads, stride over channels) of an int8 cache's ``[1]`` or
    ``[KV, 1, H]`` scale; ``(0, 0)`` for a per-tensor scale or none."""
    if scale is None or scale.dim() == 1:
        return 0, 0
    return scale.stride(0), scale.stride(2)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints. ``triton.cdiv`` is a constexpr function in triton 3.6: a
    host call costs ~3 us (it re-imports and unwraps its arguments each time), and a decode
    step's launchers make a few dozen such calls."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for ``n <= 0``), as ``triton.next_power_of_2``
    but a plain host function (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def interpret() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels take their interpreter-safe loop forms)."""
    return interpreter_active()


@functools.cache
def num_sms(device_index: int) -> int:
    """Multiprocessor count of a CUDA device (4 under the interpreter / without CUDA)."""
    if interpret() or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    index = (t.device.index or 0) if t.device.type == "cuda" else 0
    return num_sms(index)

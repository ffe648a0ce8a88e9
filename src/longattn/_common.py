"""Validation and small helpers shared by every op (never backend-specific)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous_last: bool = False,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming ``name`` unless ``t`` matches the description.

    ``shape`` entries of ``None`` are free. ``contiguous_last`` asks for stride 1 in the last dim.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for got, want in zip(t.shape, shape):
            if want is not None and got != want:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name} must be on {device} (like the activations), got {t.device}")
    if contiguous_last and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def is_finite(x) -> bool:
    """``math.isfinite`` by comparisons only, so torch.compile(dynamic=True) traces it with a
    symbolic float (``math.isfinite`` of a SymFloat breaks the graph)."""
    return x == x and x != math.inf and x != -math.inf


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Device equality where an index-less ``cuda`` means the current CUDA device."""
    if a == b:  # the common case (two tensors' devices): no device construction
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is not None and b.index is not None):
        return a.index == b.index
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_rotary_caches(
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    device: torch.device,
    max_dim: int,
    bound: str,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    contiguous_last: bool = True,
) -> None:
    """cos_cache / sin_cache ``[max_pos, rotary_dim / 2]``: one float dtype, one shape, and
    ``2 <= rotary_dim <= max_dim`` (``bound`` spells that range in the error). cos_cache's width
    is checked before sin_cache is compared with it, so a wrong width names cos_cache."""
    check_tensor(
        "cos_cache", cos_cache, dtypes=dtypes, ndim=2, device=device,
        contiguous_last=contiguous_last,
    )  # fmt: skip
    rot = 2 * cos_cache.shape[1]
    if rot == 0 or rot > max_dim:
        raise ValueError(f"rotary_dim = 2 * cos_cache.shape[1] = {rot} must be in {bound}")
    check_tensor(
        "sin_cache", sin_cache, dtypes=(cos_cache.dtype,), shape=tuple(cos_cache.shape),
        device=device, contiguous_last=contiguous_last,
    )  # fmt: skip


def check_flag(name: str, value: object) -> bool:
    """A boolean attribute: a bool, or 0 / 1 as ONNX passes its int attributes. Anything else
    (a string, a float, a tensor, 2) is refused rather than read by its truthiness: ``"false"``
    would otherwise switch the feature on."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool (or 0 / 1, as an ONNX int attribute), got {value!r}")


def check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_nonneg_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def is_real(x) -> bool:
    """A host int or float (not a bool): what scalar attributes (scale, softcap, eps) take."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def resolve_scale(scale, default: float, default_name: str):
    """An attention op's logit ``scale``: None or 0 give ``default`` (named ``default_name`` in
    the error); else a finite host int/float >= 0 (a bool is refused: ``scale=True`` would run
    with 1.0, ``False`` with the default)."""
    if scale is None or (is_real(scale) and scale == 0):
        return default
    if not is_real(scale) or not is_finite(scale) or scale < 0:
        raise ValueError(
            f"scale must be a finite float > 0 (or None/0 for {default_name}), got {scale!r}"
        )
    return scale


def check_epsilon(name: str, eps) -> None:
    """A norm epsilon: a finite host int/float >= 0 (not a bool, NaN or inf)."""
    if not is_real(eps) or not eps >= 0.0 or not is_finite(eps):
        raise ValueError(f"{name} must be a finite float >= 0, got {eps!r}")


def check_out_dtype(out_dtype: torch.dtype | None, default: torch.dtype) -> torch.dtype:
    out = default if out_dtype is None else out_dtype
    if out not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be {_dtype_names(FLOAT_DTYPES)}, got {out}")
    return out


def data_checks_allowed(t: torch.Tensor) -> bool:
    """True when reading tensor *values* on the host is allowed (eager, not capturing a graph).

    Data-dependent validation (positions in range, ...) syncs with the device; it is skipped
    under torch.compile tracing and while a CUDA graph is being captured.
    """
    if torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return t.device.type != "meta"


def host_ranges(*tensors: torch.Tensor) -> list[tuple[int, int]]:
    """``[(min, max)]`` of each (non-empty, integer) tensor, read with ONE device-to-host copy.

    Eager-mode data checks use it so that a call syncs with the device once, not once per
    value (each ``int(t.min())`` is a launch plus a full sync).
    """
    # torch.stack promotes mixed integer dtypes (int32 seqlens, int64 positions)
    flat = torch.stack([v for t in tensors for v in (t.min(), t.max())]).tolist()
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(tensors))]


def check_position_range(lo: int, hi: int, rows: int) -> None:
    """Raise ValueError unless position_ids' range ``[lo, hi]`` lies in the ``rows`` rows of
    the cos/sin cache (``lo``, ``hi`` from ``host_ranges``)."""
    if lo < 0 or hi >= rows:
        raise ValueError(
            f"position_ids must lie in [0, {rows}) (cos_cache rows), got min {lo} max {hi}"
        )


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` once to ``dtype`` (round to nearest even) and return it in ``x``'s dtype."""
    return x.to(dtype).to(x.dtype)


def eager_fast_path(args) -> bool:
    """True when a public op may call its implementation directly instead of going through the
    ``torch.library`` dispatcher (which costs tens of microseconds of host time per call in
    eager mode: it dominates small decode steps).

    Only plain eager calls qualify: not while torch.compile traces (the custom op must appear in
    the graph), not under a torch_function / torch_dispatch mode (FakeTensorMode, tracing,
    profiling modes), not for tensor subclasses and not when an input requires grad (the op's
    autograd registration then raises its clear error).
    """
    if torch.compiler.is_compiling():
        return False
    if torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or a.requires_grad):
            return False
    return True


def call_op(op, impl, *args):
    """``impl(*args)`` on the plain-eager fast path, else the custom op ``op(*args)``."""
    return impl(*args) if eager_fast_path(args) else op(*args)

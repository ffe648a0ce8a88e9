"""Public RMSNormRotary op: per-head RMSNorm (QK-norm) fused with rotary embedding."""

from __future__ import annotations

import torch

from .. import _cascade
from .._common import (
    FLOAT_DTYPES,
    call_op,
    check_bool,
    check_epsilon,
    check_flag,
    check_nonneg_int,
    check_out_dtype,
    check_position_range,
    check_positive_int,
    check_rotary_caches,
    check_tensor,
    data_checks_allowed,
    host_ranges,
)
from .chunked import rms_norm_rotary_chunked
from .reference import rms_norm_rotary_reference

OP_NAME = "rms_norm_rotary"
_TRITON_MAX_HEAD = 1024


def _positions(
    position_ids: torch.Tensor | None, b: int, s: int, device, rows: int
) -> torch.Tensor:
    """int64 positions ``[B, S]``, clamped into the ``rows`` of cos/sin (as the Triton kernel
    does: unchecked out-of-range positions never index outside the cache)."""
    if position_ids is not None:
        return position_ids.to(torch.int64).clamp(0, max(rows - 1, 0))
    return torch.arange(s, device=device, dtype=torch.int64).expand(b, s)


def gates(x: torch.Tensor, cos_cache: torch.Tensor, num_heads: int, out_dtype: torch.dtype):
    """Tier gates for these inputs: {tier: gate(explicit) -> (ok, reason)}."""
    head = x.shape[-1] // num_heads

    def triton_gate(explicit: bool):
        if head > _TRITON_MAX_HEAD:
            return False, f"head_size {head} > {_TRITON_MAX_HEAD}"
        dtypes = (x.dtype, cos_cache.dtype, out_dtype)
        return _cascade.triton_device_gate(x.device, dtypes, explicit)

    return {"triton": triton_gate, "chunked": _cascade.always, "reference": _cascade.always}


def _run(
    x,
    weight,
    cos_cache,
    sin_cache,
    position_ids,
    num_heads,
    epsilon,
    interleaved,
    rotary_offset,
    out_dtype,
    exact,
    backend,
):
    tier = _cascade.select_backend(OP_NAME, backend, gates(x, cos_cache, num_heads, out_dtype))
    kw = dict(
        num_heads=num_heads,
        epsilon=epsilon,
        interleaved=interleaved,
        rotary_offset=rotary_offset,
        exact=exact,
    )
    if tier == "triton":
        from .triton.kernel import rms_norm_rotary_triton

        return rms_norm_rotary_triton(
            x, weight, cos_cache, sin_cache, position_ids, out_dtype=out_dtype, **kw
        )
    pos = _positions(position_ids, x.shape[0], x.shape[1], x.device, cos_cache.shape[0])
    if tier == "chunked":
        return rms_norm_rotary_chunked(
            x, weight, cos_cache, sin_cache, pos, out_dtype=out_dtype, **kw
        )
    return rms_norm_rotary_reference(
        x, weight, cos_cache, sin_cache, pos, out_dtype=out_dtype, **kw
    )


def _rms_norm_rotary_op_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None,
    num_heads: int,
    epsilon: float,
    interleaved: bool,
    rotary_offset: int,
    out_dtype: torch.dtype,
    exact: bool,
    backend: str,
) -> torch.Tensor:
    return _run(
        x,
        weight,
        cos_cache,
        sin_cache,
        position_ids,
        num_heads,
        epsilon,
        interleaved,
        rotary_offset,
        out_dtype,
        exact,
        backend,
    )


_rms_norm_rotary_op = torch.library.custom_op("longattn::rms_norm_rotary", mutates_args=())(
    _rms_norm_rotary_op_impl
)


@_rms_norm_rotary_op.register_fake
def _(
    x,
    weight,
    cos_cache,
    sin_cache,
    position_ids,
    num_heads,
    epsilon,
    interleaved,
    rotary_offset,
    out_dtype,
    exact,
    backend,
):
    return x.new_empty(x.shape, dtype=out_dtype)


def validate_args(
    x, weight, cos_cache, sin_cache, position_ids, num_heads, rotary_offset, out_dtype
):
    """Shape/dtype checks (no device sync); returns (head_size, out_dtype)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3, contiguous_last=True)
    check_positive_int("num_heads", num_heads)
    b, s, d = x.shape
    if d % num_heads:
        raise ValueError(f"x.shape[-1] = {d} must be num_heads * head_size (num_heads={num_heads})")
    head = d // num_heads
    check_tensor(
        "weight", weight, dtypes=FLOAT_DTYPES, shape=(head,), device=x.device, contiguous_last=True
    )
    check_nonneg_int("rotary_offset", rotary_offset)
    check_rotary_caches(
        cos_cache, sin_cache, device=x.device, max_dim=head - rotary_offset,
        bound=f"[2, head_size - rotary_offset] = [2, {head} - {rotary_offset}]",
    )  # fmt: skip
    if position_ids is not None:
        check_tensor(
            "position_ids",
            position_ids,
            dtypes=(torch.int64, torch.int32),
            shape=(b, s),
            device=x.device,
        )
    elif s > cos_cache.shape[0]:
        raise ValueError(
            f"positions 0..{s - 1} (no position_ids) exceed the cos_cache's {cos_cache.shape[0]} rows"
        )
    out_dtype = check_out_dtype(out_dtype, x.dtype)
    return head, out_dtype


def rms_norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    num_heads: int,
    epsilon: float = 1e-6,
    interleaved: bool = False,
    rotary_offset: int = 0,
    out_dtype: torch.dtype | None = None,
    exact: bool = True,
    validate: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-head RMSNorm (QK-norm) followed by rotary embedding, fused (ORT ``RMSNormRotary``).

    Args:
        x: ``[batch, seq, num_heads * head_size]``, bf16/fp16/fp32, last dim contiguous.
        weight: ``[head_size]`` RMSNorm weight (any float dtype; read in fp32).
        cos_cache, sin_cache: ``[max_pos, rotary_dim / 2]`` fp32 (recommended), bf16 or fp16.
        position_ids: optional ``[batch, seq]`` int64/int32 positions; default ``0 .. seq-1``.
            Values outside ``[0, max_pos)`` raise ``ValueError`` when ``validate`` (eager mode);
            otherwise (and under CUDA-graph capture or torch.compile) they are clamped into
            the cache instead of read out of bounds.
        num_heads: heads per token; ``head_size = x.shape[-1] // num_heads``.
        epsilon: RMSNorm epsilon.
        interleaved: rotate pairs ``(2i, 2i+1)`` instead of ``(i, i + rotary_dim/2)``.
        rotary_offset: first rotated channel (partial rotary: channels outside
            ``[rotary_offset, rotary_offset + rotary_dim)`` pass through normalized).
        out_dtype: bf16/fp16/fp32; default x's dtype.
        exact: True: fp32 math from the input values, one rounding at the end. False (legacy):
            the normalized value is rounded to x's dtype before the rotation.
        validate: ``True`` (default) checks position_ids' *values* on the host, which
            **synchronizes with the device** (one small read); skipped under torch.compile
            tracing and CUDA-graph capture. Pass ``False`` on hot eager paths so the host never
            waits for the GPU. Shape/dtype errors are always raised.
        backend: ``"auto"``, ``"triton"``, ``"chunked"`` or ``"reference"``.

    Returns:
        ``[batch, seq, num_heads * head_size]`` in ``out_dtype``.
    """
    _cascade.check_backend_name(backend)
    interleaved = check_flag("interleaved", interleaved)
    exact = check_flag("exact", exact)
    _, out_dtype = validate_args(
        x, weight, cos_cache, sin_cache, position_ids, num_heads, rotary_offset, out_dtype
    )
    check_bool("validate", validate)
    check_epsilon("epsilon", epsilon)
    if validate and position_ids is not None and position_ids.numel():
        if data_checks_allowed(position_ids):
            check_position_range(*host_ranges(position_ids)[0], cos_cache.shape[0])
    return call_op(
        _rms_norm_rotary_op,
        _rms_norm_rotary_op_impl,
        x,
        weight,
        cos_cache,
        sin_cache,
        position_ids,
        num_heads,
        float(epsilon),
        interleaved,
        rotary_offset,
        out_dtype,
        exact,
        backend,
    )

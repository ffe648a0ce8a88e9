"""Public GroupQueryAttention op (ONNX Runtime ``com.microsoft::GroupQueryAttention``)."""

from __future__ import annotations

import math
import operator

import torch

from .. import _cascade
from .._common import (
    FLOAT_DTYPES,
    call_op,
    check_bool,
    check_epsilon,
    check_flag,
    check_position_range,
    check_positive_int,
    check_rotary_caches,
    check_tensor,
    data_checks_allowed,
    host_ranges,
    is_finite,
    is_real,
    resolve_scale,
)
from ._params import GQAParams
from .chunked import gqa_chunked
from .reference import gqa_reference

OP_NAME = "group_query_attention"

# What the triton tier accepts (its launch.SUPPORTED_HEADS; it handles attention_bias); widen or
# narrow these as the kernel changes.
TRITON_HEAD_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)
TRITON_SUPPORTS_ATTENTION_BIAS = True


# ---------------------------------------------------------------------------------------------
# Gates.


def triton_gate_reason(
    device: torch.device,
    act_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_size: int,
    has_attention_bias: bool,
    explicit: bool,
) -> tuple[bool, str]:
    """(ok, reason) for the triton tier. Order: cheap feature checks, device, then import."""
    if head_size not in TRITON_HEAD_SIZES:
        return False, f"head_size {head_size} not in {TRITON_HEAD_SIZES}"
    if has_attention_bias and not TRITON_SUPPORTS_ATTENTION_BIAS:
        return False, "attention_bias is not supported by the triton tier"
    dtypes = (act_dtype,) + ((cache_dtype,) if cache_dtype.is_floating_point else ())
    ok, reason = _cascade.triton_device_gate(device, dtypes, explicit)
    if not ok:
        return ok, reason
    try:
        from .triton import gqa_triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the triton tier's state
        return False, f"the gqa triton tier failed to import ({type(exc).__name__}: {exc})"
    return True, reason


MAX_TRITON_ROW_STRIDE = 2**31 // 256  # the kernels' in-tile offsets (<= 256 rows) are int32


def gates(
    query: torch.Tensor, present_key: torch.Tensor, present_value: torch.Tensor, p: GQAParams
):
    """Tier gates for these inputs: {tier: gate(explicit) -> (ok, reason)}."""

    def triton_gate(explicit: bool):
        for name, cache in (("present_key", present_key), ("present_value", present_value)):
            if cache.stride(2) >= MAX_TRITON_ROW_STRIDE:
                return False, (
                    f"{name}.stride(2) = {cache.stride(2)} >= {MAX_TRITON_ROW_STRIDE} "
                    "(the triton kernels' in-tile row offsets are int32)"
                )
        return triton_gate_reason(
            query.device,
            query.dtype,
            present_key.dtype,
            p.head_size,
            p.attention_bias is not None,
            explicit,
        )

    return {"triton": triton_gate, "chunked": _cascade.always, "reference": _cascade.always}


# ---------------------------------------------------------------------------------------------
# Custom op: present_key / present_value are preallocated by the caller and mutated in place.


def _run(query, key, value, present_key, present_value, seqlens_k, p: GQAParams, backend: str):
    tier = _cascade.select_backend(OP_NAME, backend, gates(query, present_key, present_value, p))
    if tier == "triton":
        from .triton import gqa_triton

        return gqa_triton(query, key, value, present_key, present_value, seqlens_k, p)
    if tier == "chunked":
        return gqa_chunked(query, key, value, present_key, present_value, seqlens_k, p)
    return gqa_reference(query, key, value, present_key, present_value, seqlens_k, p)


def _head_size(query, key, num_heads, kv_num_heads) -> int:
    if key is None:
        return query.shape[-1] // (num_heads + 2 * kv_num_heads)
    return query.shape[-1] // num_heads


def _gqa_op_impl(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    attention_bias: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    total_sequence_length: int,
    scale: float,
    softcap: float,
    local_window_size: int,
    do_rotary: bool,
    rotary_interleaved: bool,
    smooth_softmax: bool,
    qk_norm_epsilon: float,
    backend: str,
) -> torch.Tensor:
    p = GQAParams(
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        head_size=_head_size(query, key, num_heads, kv_num_heads),
        scale=scale,
        softcap=softcap,
        local_window_size=local_window_size,
        do_rotary=do_rotary,
        rotary_interleaved=rotary_interleaved,
        smooth_softmax=smooth_softmax,
        qk_norm_epsilon=qk_norm_epsilon,
        is_first_prompt=query.shape[1] == total_sequence_length,
        total_sequence_length=total_sequence_length,
        cos_cache=cos_cache,
        sin_cache=sin_cache,
        position_ids=position_ids,
        attention_bias=attention_bias,
        head_sink=head_sink,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return _run(query, key, value, present_key, present_value, seqlens_k, p, backend)


_gqa_op = torch.library.custom_op(
    "longattn::group_query_attention", mutates_args=("present_key", "present_value")
)(_gqa_op_impl)


@_gqa_op.register_fake
def _(
    query,
    key,
    value,
    present_key,
    present_value,
    seqlens_k,
    cos_cache,
    sin_cache,
    position_ids,
    attention_bias,
    head_sink,
    q_norm_weight,
    k_norm_weight,
    k_scale,
    v_scale,
    num_heads,
    kv_num_heads,
    *_attributes,
):
    h = _head_size(query, key, num_heads, kv_num_heads)
    return query.new_empty((query.shape[0], query.shape[1], num_heads * h))


# ---------------------------------------------------------------------------------------------
# Validation (shapes / dtypes only: no device sync) and eager-only data checks.


def _cache_dtypes(act_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    extra = (torch.float16,) if act_dtype == torch.bfloat16 else ()
    return (act_dtype, *extra, torch.int8)


def _check_float_opt(name, t, shape, device):
    """An optional 1-D float parameter; unit stride (the Triton kernels read ptr + i)."""
    if t is not None:
        check_tensor(name, t, dtypes=FLOAT_DTYPES, shape=shape, device=device, contiguous_last=True)


def _check_scale(name: str, t, kv: int, h: int, device) -> None:
    if t is None:
        raise ValueError(f"{name} is required with an int8 cache (fp32 [1] or [{kv}, 1, {h}])")
    check_tensor(name, t, dtypes=(torch.float32,), device=device)
    if tuple(t.shape) not in ((1,), (kv, 1, h)):
        raise ValueError(
            f"{name} must have shape (1,) (per-tensor) or ({kv}, 1, {h}) (per-channel), "
            f"got {tuple(t.shape)}"
        )


def _validate_activations(query, key, value, num_heads, kv_num_heads) -> int:
    """Checks query/key/value; returns head_size."""
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=3, contiguous_last=True)
    check_positive_int("num_heads", num_heads)
    check_positive_int("kv_num_heads", kv_num_heads)
    if num_heads % kv_num_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of kv_num_heads ({kv_num_heads})"
        )
    b, s, d = query.shape
    if (key is None) != (value is None):
        raise ValueError(
            "key and value must both be given (separate Q/K/V) or both be None (packed QKV in "
            f"query); got key={'None' if key is None else 'tensor'}, "
            f"value={'None' if value is None else 'tensor'}"
        )
    packed = key is None
    heads = num_heads + 2 * kv_num_heads if packed else num_heads
    if d % heads or d == 0:
        what = "(num_heads + 2 * kv_num_heads) * head_size" if packed else "num_heads * head_size"
        raise ValueError(f"query.shape[-1] = {d} must be {what} with heads = {heads}")
    h = d // heads
    if not packed:
        for name, t in (("key", key), ("value", value)):
            check_tensor(
                name,
                t,
                dtypes=(query.dtype,),
                shape=(b, s, kv_num_heads * h),
                device=query.device,
                contiguous_last=True,
            )
    return h


def _validate_past(past_key, past_value, query, kv_num_heads, h):
    """Checks the past caches; returns the cache dtype."""
    if (past_key is None) != (past_value is None):
        raise ValueError("past_key and past_value must both be given or both be None")
    if past_key is None:
        return query.dtype
    if past_key is past_value:
        raise ValueError("past_key and past_value must be different tensors (got the same one)")
    b = query.shape[0]
    check_tensor(
        "past_key",
        past_key,
        dtypes=_cache_dtypes(query.dtype),
        shape=(b, kv_num_heads, None, h),
        device=query.device,
        contiguous_last=True,
    )
    check_tensor(
        "past_value",
        past_value,
        dtypes=(past_key.dtype,),
        shape=tuple(past_key.shape),
        device=query.device,
        contiguous_last=True,
    )
    return past_key.dtype


def _validate_rotary(cos_cache, sin_cache, position_ids, do_rotary, query, h, total):
    b, s = query.shape[:2]
    if not do_rotary:
        for name, t in (
            ("cos_cache", cos_cache),
            ("sin_cache", sin_cache),
            ("position_ids", position_ids),
        ):
            if t is not None:
                raise ValueError(f"{name} is given but do_rotary=False (set do_rotary=True)")
        return
    if cos_cache is None or sin_cache is None:
        raise ValueError("do_rotary=True needs both cos_cache and sin_cache")
    check_rotary_caches(
        cos_cache, sin_cache, device=query.device, max_dim=h, bound=f"[2, head_size = {h}]"
    )
    if position_ids is not None:
        check_tensor(
            "position_ids",
            position_ids,
            dtypes=(torch.int64, torch.int32),
            shape=(b, s),
            device=query.device,
        )
    elif total > cos_cache.shape[0]:
        raise ValueError(
            f"cos_cache has {cos_cache.shape[0]} rows but positions reach "
            f"total_sequence_length - 1 = {total - 1} (pass position_ids or a longer cache)"
        )


def _validate_attributes(scale, softcap, local_window_size, qk_norm_epsilon, h):
    scale = resolve_scale(scale, 1.0 / math.sqrt(h), "1/sqrt(H)")
    if not is_real(softcap) or not softcap >= 0.0 or not is_finite(softcap):
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    w = local_window_size
    if not isinstance(w, int) or isinstance(w, bool) or (w <= 0 and w != -1):
        raise ValueError(f"local_window_size must be -1 (off) or a positive int, got {w!r}")
    check_epsilon("qk_norm_epsilon", qk_norm_epsilon)
    return float(scale)


def _data_checks(seqlens_k, position_ids, cos_cache, s, total, capacity, first_prompt):
    """Eager-only checks of tensor values (one device sync for all of them)."""
    check_pos = position_ids is not None and position_ids.numel() > 0
    if not data_checks_allowed(seqlens_k) or not seqlens_k.numel():
        return
    ranges = host_ranges(seqlens_k, *((position_ids,) if check_pos else ()))
    lo, hi = ranges[0]
    need_lo = 0 if first_prompt else s - 1
    if lo < need_lo:
        what = (
            "0" if first_prompt else f"S - 1 = {s - 1} (the {s} new tokens are part of the total)"
        )
        raise ValueError(f"seqlens_k must be >= {what}, got min {lo}")
    if hi + 1 > total:
        raise ValueError(
            f"seqlens_k + 1 must be <= total_sequence_length = {total}, got max {hi + 1}"
        )
    if hi + 1 > capacity:
        raise ValueError(f"seqlens_k + 1 = {hi + 1} exceeds the present cache capacity {capacity}")
    if check_pos:
        check_position_range(*ranges[1], cos_cache.shape[0])


# ---------------------------------------------------------------------------------------------
# Public function.


def group_query_attention(
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    *,
    seqlens_k: torch.Tensor,
    total_sequence_length: int,
    num_heads: int,
    kv_num_heads: int,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    attention_bias: torch.Tensor | None = None,
    head_sink: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    local_window_size: int = -1,
    do_rotary: bool = False,
    rotary_interleaved: bool = False,
    smooth_softmax: bool = False,
    qk_norm_epsilon: float = 1e-6,
    validate: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped-query attention with a contiguous KV cache (ORT ``GroupQueryAttention``).

    Notation: B batch, S new tokens, N = num_heads, KV = kv_num_heads (N % KV == 0), H head size,
    C cache capacity, T = total_sequence_length.

    Args:
        query: ``[B, S, N*H]``, or packed QKV ``[B, S, (N + 2*KV)*H]`` with key/value None.
            fp32/fp16/bf16, last dim contiguous.
        key, value: ``[B, S, KV*H]`` in query's dtype, or both None (packed).
        past_key, past_value: optional BNSH caches ``[B, KV, C, H]`` (same shape and dtype),
            holding rows ``0 .. seqlens_k[b] - S`` of each sequence. Their dtype is the cache
            dtype: the activation dtype, fp16 with bf16 activations, or int8 (needs
            k_scale/v_scale).
            **Shared buffer (in place):** when ``C >= total_sequence_length`` the new K/V rows are
            written into ``past_key``/``past_value`` themselves, which are returned as the
            presents (ORT's ``past_present_share_buffer``). Otherwise the presents are new
            ``[B, KV, T, H]`` tensors holding the C past rows and zeros after them.
            A bf16 -> fp16 cache write overflows to inf beyond 65504 (as the dtype implies).
            **Cache dtype without a past:** pass an empty past ``[B, KV, 0, H]`` of the wanted
            dtype (e.g. fp16 for bf16 activations, or int8 with scales); with no past at all the
            presents have the activation dtype.
        seqlens_k: int32 ``[B]``: total length of each sequence minus one (past + new tokens).
        total_sequence_length: host int, the max total length over the batch. ``S == T`` means
            first prompt (rows ``s > seqlens_k[b]`` are right padding: output zero, K/V not
            written); otherwise query row s sits at position ``seqlens_k[b] + 1 - S + s``.
        num_heads, kv_num_heads: N and KV.
        cos_cache, sin_cache: ``[max_pos, rotary_dim/2]`` fp32 (recommended)/fp16/bf16; required
            with ``do_rotary`` (and rejected without it). ``rotary_dim <= H``: partial rotary
            rotates channels ``0 .. rotary_dim`` only.
        position_ids: optional int64/int32 ``[B, S]`` rotary positions (default: the query's
            cache position). Only with ``do_rotary``.
        attention_bias: optional ``[B|1, N|1, S, T' >= T]`` float, added to the logits after
            softcap.
        head_sink: optional ``[N]`` float sink logits (joins the softmax denominator; used
            whenever given, whatever ``smooth_softmax`` says, as ORT does);
            ``smooth_softmax=True`` without head_sink uses a zero sink logit.
        q_norm_weight, k_norm_weight: optional ``[H]`` per-head RMSNorm weights applied to Q /
            the new K before rotary (eps = ``qk_norm_epsilon``).
        k_scale, v_scale: fp32 ``[1]`` or ``[KV, 1, H]`` int8 scales (only with an int8 cache):
            ``q = round(x / scale)`` clamped to [-127, 127]; reads use ``q * scale``.
        scale: logit scale > 0; None or 0.0 means ``1/sqrt(H)``. (The kernels take each row's
            max before scaling, as FlashAttention does, which needs a positive scale.)
        softcap: ``c * tanh(x / c)`` on the scaled logits when > 0.
        local_window_size: -1 off, else W > 0: a query at p sees keys ``p-W+1 .. p``.
        do_rotary, rotary_interleaved: rotary on Q and the new K (half/split or interleaved).
        smooth_softmax: add a zero-logit sink (see head_sink).
        qk_norm_epsilon: RMSNorm epsilon of the QK-norm.
        validate: ``True`` (default) checks the *values* of ``seqlens_k`` (``S - 1 <=
            seqlens_k < min(T, C)``, ``>= 0`` for a first prompt) and ``position_ids`` (inside
            cos_cache) on the host, which **synchronizes with the device** (two to four small
            reads). Skipped automatically under torch.compile tracing and CUDA-graph capture;
            pass ``False`` on hot eager decode paths so the host never waits for the GPU.
            Without the checks, bad values never read or write outside the caches (writes to rows
            ``>= C`` are dropped, positions are clamped into cos_cache), but the result is
            undefined. Shape/dtype errors are always raised.
        backend: "auto", "triton", "chunked" or "reference".

    Returns:
        ``(output [B, S, N*H] in query's dtype, present_key, present_value)``; the presents are
        ``past_key``/``past_value`` themselves in shared-buffer mode.

    Precision: all math in fp32; Q stays fp32 after norm + rotary in the torch tiers (the triton
    tier rounds Q to the dot dtype); new K/V are rounded (or quantized) once into the cache and
    attention reads them back from it; the output is rounded once to query's dtype.

    Data checks (seqlens_k / position_ids ranges, see ``validate``) run in eager mode only;
    under torch.compile or CUDA-graph capture nothing syncs and out-of-range values give
    unspecified (but in-bounds) results.
    """
    _cascade.check_backend_name(backend)
    do_rotary = check_flag("do_rotary", do_rotary)
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    smooth_softmax = check_flag("smooth_softmax", smooth_softmax)
    h = _validate_activations(query, key, value, num_heads, kv_num_heads)
    b, s = query.shape[:2]
    if isinstance(total_sequence_length, bool | torch.Tensor):
        raise TypeError(
            "total_sequence_length must be a host int (not a tensor: reading one would sync), "
            f"got {type(total_sequence_length).__name__}"
        )
    try:
        # under torch.compile the traced int stays symbolic (operator.index would specialize
        # it: one recompile per decode step, then the recompile limit)
        if torch.compiler.is_compiling() and isinstance(total_sequence_length, int):
            total = total_sequence_length
        else:
            total = operator.index(total_sequence_length)
    except TypeError:
        raise TypeError(
            f"total_sequence_length must be a host int, got {type(total_sequence_length).__name__}"
        ) from None
    if total < 1:
        raise ValueError(f"total_sequence_length must be >= 1, got {total}")
    if s > total:
        raise ValueError(
            f"query has S = {s} new tokens but total_sequence_length = {total} (need S <= T)"
        )
    check_tensor(
        "seqlens_k",
        seqlens_k,
        dtypes=(torch.int32,),
        shape=(b,),
        device=query.device,
        contiguous_last=True,
    )
    cache_dtype = _validate_past(past_key, past_value, query, kv_num_heads, h)
    past_cap = 0 if past_key is None else past_key.shape[2]
    first_prompt = s == total
    if not first_prompt and past_cap < total - s:
        raise ValueError(
            f"past_key/past_value must hold the {total - s} past rows "
            f"(total_sequence_length - S) when S < total_sequence_length; got capacity "
            f"{past_cap if past_key is not None else 'None (no past)'}"
        )
    if cache_dtype == torch.int8:
        _check_scale("k_scale", k_scale, kv_num_heads, h, query.device)
        _check_scale("v_scale", v_scale, kv_num_heads, h, query.device)
    else:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is not None:
                raise ValueError(
                    f"{name} is only valid with an int8 cache (cache is {cache_dtype})"
                )
    _validate_rotary(cos_cache, sin_cache, position_ids, do_rotary, query, h, total)
    if attention_bias is not None:
        check_tensor("attention_bias", attention_bias, dtypes=FLOAT_DTYPES, ndim=4)
        ab = tuple(attention_bias.shape)
        if ab[0] not in (1, b) or ab[1] not in (1, num_heads) or ab[2] != s or ab[3] < total:
            raise ValueError(
                f"attention_bias must have shape ({b}|1, {num_heads}|1, {s}, >= {total}), got {ab}"
            )
        check_tensor("attention_bias", attention_bias, device=query.device)
    _check_float_opt("head_sink", head_sink, (num_heads,), query.device)
    _check_float_opt("q_norm_weight", q_norm_weight, (h,), query.device)
    _check_float_opt("k_norm_weight", k_norm_weight, (h,), query.device)
    scale = _validate_attributes(scale, softcap, local_window_size, qk_norm_epsilon, h)

    shared = past_key is not None and past_cap >= total
    check_bool("validate", validate)
    if validate:
        _data_checks(
            seqlens_k, position_ids, cos_cache, s, total, past_cap if shared else total,
            first_prompt,
        )  # fmt: skip
    if shared:
        present_key, present_value = past_key, past_value
    else:
        shape = (b, kv_num_heads, total, h)
        present_key = torch.zeros(shape, dtype=cache_dtype, device=query.device)
        present_value = torch.zeros(shape, dtype=cache_dtype, device=query.device)
        if past_cap:
            present_key[:, :, :past_cap].copy_(past_key)
            present_value[:, :, :past_cap].copy_(past_value)
    output = call_op(
        _gqa_op,
        _gqa_op_impl,
        query,
        key,
        value,
        present_key,
        present_value,
        seqlens_k,
        cos_cache,
        sin_cache,
        position_ids,
        attention_bias,
        head_sink,
        q_norm_weight,
        k_norm_weight,
        k_scale,
        v_scale,
        num_heads,
        kv_num_heads,
        total,
        scale,
        float(softcap),
        int(local_window_size),
        do_rotary,
        rotary_interleaved,
        smooth_softmax,
        float(qk_norm_epsilon),
        backend,
    )
    return output, present_key, present_value

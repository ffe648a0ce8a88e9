"""Public PagedAttention op (ORT ``com.microsoft.PagedAttention`` semantics)."""

from __future__ import annotations

import math

import torch

from .. import _cascade
from .._common import (
    FLOAT_DTYPES,
    call_op,
    check_bool,
    check_epsilon,
    check_flag,
    check_positive_int,
    check_rotary_caches,
    check_tensor,
    data_checks_allowed,
    is_finite,
    is_real,
    resolve_scale,
)
from . import _validate
from ._params import PagedParams
from .chunked import paged_attention_chunked
from .reference import paged_attention_reference

OP_NAME = "paged_attention"
TRITON_HEAD_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)


def triton_gate_reason(device, act_dtype, cache_dtype, head_size, block_size, explicit):
    """The triton tier's gate: head size, power-of-two block_size, device/dtype, importable."""
    if head_size not in TRITON_HEAD_SIZES:
        return False, f"head_size {head_size} not in {TRITON_HEAD_SIZES}"
    if block_size < 1 or block_size & (block_size - 1):
        return False, (
            f"block_size {block_size} is not a power of two (the triton paged kernels need one; "
            "the chunked tier takes any block_size)"
        )
    if act_dtype not in FLOAT_DTYPES:
        return False, f"activation dtype {act_dtype} not in {FLOAT_DTYPES}"
    dtypes = (act_dtype,) + ((cache_dtype,) if cache_dtype.is_floating_point else ())
    ok, reason = _cascade.triton_device_gate(device, dtypes, explicit)
    if not ok:
        return ok, reason
    try:
        from .triton import paged_attention_triton  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return False, f"the paged triton tier failed to import ({type(exc).__name__}: {exc})"
    return True, reason


def gates(query: torch.Tensor, key_cache: torch.Tensor, p: PagedParams):
    """Tier gates for these inputs: {tier: gate(explicit) -> (ok, reason)}."""

    def triton_gate(explicit: bool):
        return triton_gate_reason(query.device, query.dtype, key_cache.dtype, p.head_size,
                                  key_cache.shape[1], explicit)  # fmt: skip

    return {"triton": triton_gate, "chunked": _cascade.always, "reference": _cascade.always}


def _split_packed(query, key, value, p: PagedParams):
    if key is not None:
        return query, key, value
    n, kv, h = p.num_heads, p.kv_num_heads, p.head_size
    return query[:, : n * h], query[:, n * h : (n + kv) * h], query[:, (n + kv) * h :]


def _run(query, key, value, key_cache, value_cache, cu, past, table, p: PagedParams, backend):
    tier = _cascade.select_backend(OP_NAME, backend, gates(query, key_cache, p))
    q, k, v = _split_packed(query, key, value, p)
    args = (q, k, v, key_cache, value_cache, cu, past, table, p)
    if tier == "triton":
        from .triton import paged_attention_triton

        return paged_attention_triton(*args)
    if tier == "chunked":
        return paged_attention_chunked(*args)
    return paged_attention_reference(*args)


def _paged_attention_op_impl(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cumulative_sequence_length: torch.Tensor,
    past_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    softcap: float,
    local_window_size: int,
    do_rotary: bool,
    rotary_interleaved: bool,
    smooth_softmax: bool,
    qk_norm_epsilon: float,
    backend: str,
) -> torch.Tensor:
    p = PagedParams(
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        head_size=key_cache.shape[-1],
        scale=scale,
        softcap=softcap,
        local_window_size=local_window_size,
        do_rotary=do_rotary,
        rotary_interleaved=rotary_interleaved,
        smooth_softmax=smooth_softmax,
        qk_norm_epsilon=qk_norm_epsilon,
        cos_cache=cos_cache,
        sin_cache=sin_cache,
        head_sink=head_sink,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return _run(query, key, value, key_cache, value_cache, cumulative_sequence_length,
                past_seqlens, block_table, p, backend)  # fmt: skip


_paged_attention_op = torch.library.custom_op(
    "longattn::paged_attention", mutates_args=("key_cache", "value_cache")
)(_paged_attention_op_impl)


@_paged_attention_op.register_fake
def _(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
      block_table, cos_cache, sin_cache, head_sink, q_norm_weight, k_norm_weight, k_scale,
      v_scale, num_heads, kv_num_heads, scale, softcap, local_window_size, do_rotary,
      rotary_interleaved, smooth_softmax, qk_norm_epsilon, backend):  # fmt: skip
    return query.new_empty((query.shape[0], num_heads * key_cache.shape[-1]))


def validate_inputs(
    query, key, value, key_cache, value_cache, cu, past, table, *, num_heads, kv_num_heads,
    cos_cache, sin_cache, head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale, scale,
    softcap, local_window_size, do_rotary,
) -> float:  # fmt: skip
    """Shape/dtype/attribute checks (no device sync). Returns the resolved scale."""
    check_positive_int("num_heads", num_heads)
    check_positive_int("kv_num_heads", kv_num_heads)
    if num_heads % kv_num_heads:
        raise ValueError(
            f"num_heads = {num_heads} must be a multiple of kv_num_heads = {kv_num_heads}"
        )
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=2, contiguous_last=True)
    dev, act = query.device, query.dtype
    nb, bs, kv, h = _validate.check_cache_pair(key_cache, value_cache, dev)
    if kv != kv_num_heads:
        raise ValueError(
            f"key_cache.shape[2] = {kv} must equal kv_num_heads = {kv_num_heads} "
            f"(cache layout [num_blocks, block_size, KV, H])"
        )
    tokens = query.shape[0]
    if (key is None) != (value is None):
        raise ValueError("key and value must both be given or both be None (packed query)")
    if key is None:
        want = (num_heads + 2 * kv) * h
        if query.shape[1] != want:
            raise ValueError(
                f"packed query (key/value None) must have shape (tokens, (num_heads + "
                f"2 * kv_num_heads) * head_size) = ({tokens}, {want}), got {tuple(query.shape)}"
            )
    else:
        if query.shape[1] != num_heads * h:
            raise ValueError(
                f"query must have shape (tokens, num_heads * head_size) = ({tokens}, "
                f"{num_heads * h}) (head_size {h} from key_cache), got {tuple(query.shape)}"
            )
        for name, t in (("key", key), ("value", value)):
            check_tensor(name, t, dtypes=(act,), shape=(tokens, kv * h), device=dev,
                         contiguous_last=True)  # fmt: skip
    _validate.check_activation_cache_dtypes(act, key_cache.dtype)
    _validate.check_scales(k_scale, v_scale, key_cache.dtype, kv, h, dev)
    check_tensor("cumulative_sequence_length", cu, dtypes=(torch.int32,), ndim=1, device=dev,
                 contiguous_last=True)  # fmt: skip
    if cu.shape[0] < 2:
        raise ValueError(
            f"cumulative_sequence_length must be [batch + 1] with batch >= 1, got {tuple(cu.shape)}"
        )
    b = cu.shape[0] - 1
    _validate.check_index("past_seqlens", past, (b,), dev)
    _validate.check_index("block_table", table, (b, None), dev)
    if table.shape[1] == 0:
        raise ValueError(f"block_table must have max_blocks >= 1, got {tuple(table.shape)}")
    if do_rotary:
        if cos_cache is None or sin_cache is None:
            raise ValueError("do_rotary=True needs cos_cache and sin_cache")
        check_rotary_caches(
            cos_cache, sin_cache, device=dev, max_dim=h, bound=f"[2, head_size = {h}]"
        )
    elif cos_cache is not None or sin_cache is not None:
        raise ValueError("cos_cache/sin_cache given but do_rotary=False")
    if head_sink is not None:
        check_tensor("head_sink", head_sink, dtypes=FLOAT_DTYPES, shape=(num_heads,), device=dev,
                     contiguous_last=True)  # fmt: skip
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(name, w, dtypes=FLOAT_DTYPES, shape=(h,), device=dev,
                         contiguous_last=True)  # fmt: skip
    if (
        not isinstance(local_window_size, int)
        or isinstance(local_window_size, bool)
        or (local_window_size == 0 or local_window_size < -1)
    ):
        raise ValueError(f"local_window_size must be -1 (off) or > 0, got {local_window_size!r}")
    if not is_real(softcap) or not is_finite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap!r}")
    return float(resolve_scale(scale, 1.0 / math.sqrt(h), "1/sqrt(H)"))


def _check_data(cu, past, table, *, tokens, block_size, num_blocks, cos_cache, do_rotary):
    """Eager data checks (host sync): the batch description and the rotary positions."""
    _validate.check_batch_data(cu, past, table, num_tokens=tokens, block_size=block_size,
                               num_blocks=num_blocks)  # fmt: skip
    if do_rotary:
        last = int((past.to(torch.int64) + cu[1:] - cu[:-1]).max()) - 1
        if last >= cos_cache.shape[0]:
            raise ValueError(
                f"positions up to {last} (past_seqlens + new tokens - 1) exceed the cos_cache's "
                f"{cos_cache.shape[0]} rows"
            )


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cumulative_sequence_length: torch.Tensor,
    past_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_heads: int,
    kv_num_heads: int,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
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
) -> torch.Tensor:
    """Attention over a paged KV cache for a varlen batch (ORT ``PagedAttention``).

    The batch mixes prefill and decode sequences: sequence ``b`` brings ``S_b = cu[b+1] - cu[b]``
    new tokens (rows ``cu[b] .. cu[b+1]-1`` of ``query``) on top of ``past_seqlens[b]`` cached
    ones. New token ``s`` is at position ``past_seqlens[b] + s``; its K (after QK-norm and
    rotary) and V are written, converted once to the cache dtype, to block
    ``block_table[b, pos // block_size]``, row ``pos % block_size``, in place. It then attends,
    causal bottom-right aligned, to positions ``0 .. pos`` (or the last ``local_window_size``
    of them) of its sequence, read from the cache. No other cache slot is written or read, so
    ``block_table`` entries past a sequence's ``ceil((past + S_b) / block_size)`` blocks are
    padding (any value, e.g. ``-1``). Sequences may share read-only blocks (a common prefix),
    never a block both of them append to.

    Args:
        query: ``[tokens, num_heads * H]``, or packed ``[tokens, (num_heads + 2 * kv_num_heads)
            * H]`` (Q | K | V) with ``key``/``value`` None; fp32/fp16/bf16.
        key, value: ``[tokens, kv_num_heads * H]`` in query's dtype, or None (packed).
        key_cache, value_cache: ``[num_blocks, block_size, kv_num_heads, H]`` contiguous, any
            ``block_size >= 1``; dtype = query's, fp16 for bf16 query, or int8 (with scales).
            Updated in place.
        cumulative_sequence_length: int32 ``[B + 1]``, prefix sum of the new tokens (cu[0] = 0,
            cu[B] = tokens).
        past_seqlens: int32 ``[B]``, tokens already cached per sequence (**not** minus one).
        block_table: int32 ``[B, max_blocks]``, block indices into the caches.
        num_heads, kv_num_heads: N and KV (N % KV == 0; query head n reads KV head n // (N/KV)).
        cos_cache, sin_cache: ``[max_pos, rotary_dim / 2]`` (fp32 recommended) with
            ``do_rotary=True``; the rotary position is the token's position.
        head_sink: ``[num_heads]`` per-head sink logit (joins the softmax denominator).
        q_norm_weight, k_norm_weight: ``[H]`` per-head RMSNorm weights (before rotary).
        k_scale, v_scale: fp32 ``[1]`` or ``[kv_num_heads, 1, H]``; required iff int8 cache.
        scale: logit scale > 0, default (None or 0) ``1 / sqrt(H)``.
        softcap: ``x = softcap * tanh(x / softcap)`` when > 0.
        local_window_size: W > 0: a query sees its last W positions (itself included); -1 off.
        do_rotary, rotary_interleaved: rotary on Q and the new K (half or interleaved layout).
        smooth_softmax: add a zero sink logit per head (when ``head_sink`` is None).
        qk_norm_epsilon: RMSNorm epsilon.
        validate: ``True`` (default) checks the index tensors' *values* on the host, which
            **synchronizes with the device**: cu[0] == 0, cu non-decreasing, cu[-1] == tokens,
            past_seqlens >= 0, past + new <= max_blocks * block_size, the needed block_table
            entries in ``[0, num_blocks)``, no two new tokens writing one slot, rotary positions
            inside cos_cache. Skipped automatically under torch.compile tracing and CUDA-graph
            capture; pass ``False`` on hot decode paths. Without the checks bad indices do not
            read or write out of bounds, but the result is undefined. Shape/dtype errors are
            always raised.
        backend: ``"auto"``, ``"triton"``, ``"chunked"`` or ``"reference"``. The Triton tier
            (CUDA; H in 16..256 powers of two, power-of-two block_size) reads K/V through the
            block table with no gather and no host sync (CUDA-graph capturable). The torch tiers read ``cumulative_sequence_length``/``past_seqlens`` on the host once per
            call (a device sync: not CUDA-graph capturable) and loop over the sequences.

    Returns:
        ``[tokens, num_heads * H]`` in query's dtype.

    Precision: fp32 math (QK-norm and rotary from the input values, Q kept in fp32); the new K/V
    are rounded (or quantized) once into the cache and attention reads them back from it
    (int8 dequantized as ``q * scale``); the output is rounded once to query's dtype.
    """
    _cascade.check_backend_name(backend)
    do_rotary = check_flag("do_rotary", do_rotary)
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    smooth_softmax = check_flag("smooth_softmax", smooth_softmax)
    scale = validate_inputs(
        query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
        block_table, num_heads=num_heads, kv_num_heads=kv_num_heads, cos_cache=cos_cache,
        sin_cache=sin_cache, head_sink=head_sink, q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight, k_scale=k_scale, v_scale=v_scale, scale=scale,
        softcap=softcap, local_window_size=local_window_size, do_rotary=do_rotary,
    )  # fmt: skip
    check_bool("validate", validate)
    check_epsilon("qk_norm_epsilon", qk_norm_epsilon)
    if validate and data_checks_allowed(cumulative_sequence_length):
        _check_data(cumulative_sequence_length, past_seqlens, block_table,
                    tokens=query.shape[0], block_size=key_cache.shape[1],
                    num_blocks=key_cache.shape[0], cos_cache=cos_cache,
                    do_rotary=do_rotary)  # fmt: skip
    return call_op(_paged_attention_op, _paged_attention_op_impl,
        query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
        block_table, cos_cache if do_rotary else None, sin_cache if do_rotary else None,
        head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale, num_heads, kv_num_heads,
        scale, float(softcap), local_window_size, do_rotary, rotary_interleaved,
        smooth_softmax, float(qk_norm_epsilon), backend,
    )  # fmt: skip

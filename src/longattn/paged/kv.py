"""Paged KV-cache primitives: ``reshape_and_cache`` (append) and ``gather_paged_kv`` (read).

Both are pure torch (any device, no host synchronization when ``validate=False``) and
``torch.library`` custom ops.
"""

from __future__ import annotations

import torch

from .. import _attention_torch as at
from .._common import FLOAT_DTYPES, call_op, check_positive_int, check_tensor, data_checks_allowed
from . import _slots, _validate

# ---------------------------------------------------------------------------------------------
# Slot mapping.


def compute_slot_mapping(
    cumulative_sequence_length: torch.Tensor,
    past_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Slots of the new tokens of a varlen batch: int64 ``[tokens]``.

    Token ``t`` of sequence ``b`` (``cu[b] <= t < cu[b+1]``) sits at position ``pos =
    past_seqlens[b] + t - cu[b]`` and gets slot ``block_table[b, pos // block_size] * block_size
    + pos % block_size``; a token whose block entry is out of range (e.g. the ``-1`` padding of
    :class:`PagedKVCache`) gets ``-1`` (skipped by :func:`reshape_and_cache`).

    Args:
        cumulative_sequence_length: int32 ``[B + 1]`` prefix sum of the new tokens.
        past_seqlens: int32 ``[B]`` tokens already cached per sequence.
        block_table: int32 ``[B, max_blocks]``.
        block_size: rows per block.
        num_tokens: total new tokens; default ``cumulative_sequence_length[-1]`` (a host sync).
    """
    check_positive_int("block_size", block_size)
    check_tensor("cumulative_sequence_length", cumulative_sequence_length, dtypes=(torch.int32,),
                 ndim=1)  # fmt: skip
    b = cumulative_sequence_length.shape[0] - 1
    dev = cumulative_sequence_length.device
    _validate.check_index("past_seqlens", past_seqlens, (b,), dev)
    _validate.check_index("block_table", block_table, (b, None), dev)
    if num_tokens is None:
        num_tokens = int(cumulative_sequence_length[-1])
    _, _, slot, valid = _slots.new_token_slots(
        cumulative_sequence_length,
        past_seqlens,
        block_table,
        num_tokens=num_tokens,
        block_size=block_size,
        num_blocks=torch.iinfo(torch.int32).max,
    )
    return torch.where(valid, slot, torch.full_like(slot, -1))


# ---------------------------------------------------------------------------------------------
# reshape_and_cache.


def _reshape_and_cache_op_impl(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    nslots = key_cache.shape[0] * key_cache.shape[1]
    slot = slot_mapping.to(torch.int64)
    valid = (slot >= 0) & (slot < nslots)
    slot = torch.where(valid, slot, torch.zeros_like(slot))
    dt = at.compute_dtype_for(key, value)
    kv, h = key_cache.shape[2], key_cache.shape[3]
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        x = x.reshape(x.shape[0], kv, h).to(dt)  # [tokens, KV, H]
        rows = at.to_cache(x, cache.dtype, scale, kv_axis=-2)
        _slots.write_slots(_slots.flat_view(cache), slot, valid, rows)


_reshape_and_cache_op = torch.library.custom_op(
    "longattn::reshape_and_cache", mutates_args=("key_cache", "value_cache")
)(_reshape_and_cache_op_impl)


@_reshape_and_cache_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    return None


def _as_rows(name: str, x: object, kv: int, h: int, device) -> torch.Tensor:
    check_tensor(name, x, dtypes=FLOAT_DTYPES, device=device)
    if x.dim() == 2 and x.shape[1] == kv * h:
        return x.reshape(x.shape[0], kv, h)
    if x.dim() == 3 and tuple(x.shape[1:]) == (kv, h):
        return x
    raise ValueError(
        f"{name} must have shape (tokens, {kv * h}) or (tokens, {kv}, {h}) for the cache's "
        f"KV={kv}, H={h}, got {tuple(x.shape)}"
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    validate: bool = True,
) -> None:
    """Append K/V rows to a paged cache in place (no rotary, no norm: the rows as given).

    ``key_cache.view(-1, KV, H)[slot_mapping[t]] = key[t]`` (converted once to the cache dtype;
    int8: ``round(x / k_scale)`` clamped to [-127, 127], in fp32) for every token with
    ``slot_mapping[t] >= 0``; tokens with a negative slot are skipped (padding). No other slot
    changes. Build ``slot_mapping`` with :func:`compute_slot_mapping` from the ORT-style
    ``(cumulative_sequence_length, past_seqlens, block_table)`` or take it from
    :meth:`PagedKVCache.extend`.

    Args:
        key, value: ``[tokens, KV*H]`` or ``[tokens, KV, H]``, fp32/fp16/bf16.
        key_cache, value_cache: ``[num_blocks, block_size, KV, H]`` contiguous, fp32/fp16/bf16/
            int8 (any float cache dtype is accepted here), updated in place.
        slot_mapping: int64 or int32 ``[tokens]``, ``block * block_size + row`` or negative.
        k_scale, v_scale: fp32 ``[1]`` or ``[KV, 1, H]``; required iff the cache is int8.
        validate: check (eager mode only; this syncs with the device) that every slot is
            ``< num_blocks * block_size`` and the non-negative slots are distinct.
    """
    nb, bs, kv, h = _validate.check_cache_pair(key_cache, value_cache, None)
    dev = key_cache.device
    key = _as_rows("key", key, kv, h, dev)
    value = _as_rows("value", value, kv, h, dev)
    check_tensor("value", value, shape=tuple(key.shape))
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64, torch.int32),
                 shape=(key.shape[0],), device=dev)  # fmt: skip
    _validate.check_scales(k_scale, v_scale, key_cache.dtype, kv, h, dev)
    if validate and data_checks_allowed(slot_mapping):
        _validate.check_slot_mapping_data(slot_mapping, nb, bs)
    call_op(
        _reshape_and_cache_op,
        _reshape_and_cache_op_impl,
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
    )


# ---------------------------------------------------------------------------------------------
# gather_paged_kv.


def _gather_paged_kv_op_impl(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    total_tokens: int,
    num_heads: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    nb, bs, kv, _ = key_cache.shape
    cu = torch.zeros(seqlens.shape[0] + 1, dtype=torch.int64, device=seqlens.device)
    cu[1:] = torch.cumsum(seqlens.to(torch.int64), 0)
    seq = _slots.token_sequence(cu, total_tokens)
    t = torch.arange(total_tokens, device=seqlens.device, dtype=torch.int64)
    slot, _ = _slots.table_slots(block_table, seq, t - cu[seq], bs, nb)
    outs = []
    for cache, scale in ((key_cache, k_scale), (value_cache, v_scale)):
        rows = _slots.flat_view(cache)[slot]  # [total, KV, H] in the cache dtype
        if rows.dtype == torch.int8:
            rows = at.from_cache(rows, scale, dtype=torch.float32, kv_axis=-2)
        rows = rows.to(out_dtype)
        if num_heads != kv:
            rows = rows.repeat_interleave(num_heads // kv, dim=1)  # [total, N, H]
        outs.append(rows.contiguous())
    return outs[0], outs[1]


_gather_paged_kv_op = torch.library.custom_op("longattn::gather_paged_kv", mutates_args=())(
    _gather_paged_kv_op_impl
)


@_gather_paged_kv_op.register_fake
def _(key_cache, value_cache, block_table, seqlens, total_tokens, num_heads, k_scale, v_scale,
      out_dtype):  # fmt: skip
    h = key_cache.shape[-1]
    return (
        key_cache.new_empty((total_tokens, num_heads, h), dtype=out_dtype),
        key_cache.new_empty((total_tokens, num_heads, h), dtype=out_dtype),
    )


def gather_paged_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    *,
    num_heads: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    total_tokens: int | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged cache -> packed varlen K/V (the layout of ``cu_seqlens_k``-style attention).

    Row ``cu[b] + j`` of the result (``cu`` = exclusive prefix sum of ``seqlens``) is position
    ``j < seqlens[b]`` of sequence ``b``: ``cache[block_table[b, j // block_size],
    j % block_size]``.

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, KV, H]``, fp32/fp16/bf16/int8.
        block_table: int32 ``[B, max_blocks]``; entries past a sequence's blocks are not read.
        seqlens: int32 ``[B]`` tokens to gather per sequence (e.g. ``past_seqlens + new``).
        num_heads: expand the KV heads to ``num_heads`` query heads (GQA: query head ``n`` reads
            KV head ``n // (num_heads // KV)``); default KV (no expansion).
        k_scale, v_scale: fp32 ``[1]`` or ``[KV, 1, H]``, required iff the cache is int8.
        out_dtype: result dtype; default the cache dtype for float caches and **fp32 for int8**
            (dequantized ``q * scale`` in fp32, then rounded once if ``out_dtype`` is narrower).
        total_tokens: ``sum(seqlens)`` if the caller knows it; default computed (a host sync;
            pass it under torch.compile / CUDA-graph capture).
        validate: eager-mode data checks (sync): seqlens in ``[0, max_blocks * block_size]``,
            needed table entries in ``[0, num_blocks)``, ``total_tokens == sum(seqlens)``.

    Returns:
        ``(key, value)``, each ``[total_tokens, num_heads or KV, H]`` contiguous in ``out_dtype``.
    """
    nb, bs, kv, h = _validate.check_cache_pair(key_cache, value_cache, None)
    dev = key_cache.device
    check_tensor("seqlens", seqlens, dtypes=(torch.int32,), ndim=1, device=dev)
    _validate.check_index("block_table", block_table, (seqlens.shape[0], None), dev)
    num_heads = kv if num_heads is None else check_positive_int("num_heads", num_heads)
    if num_heads % kv:
        raise ValueError(f"num_heads = {num_heads} must be a multiple of the cache's KV = {kv}")
    _validate.check_scales(k_scale, v_scale, key_cache.dtype, kv, h, dev)
    if out_dtype is None:
        out_dtype = torch.float32 if key_cache.dtype == torch.int8 else key_cache.dtype
    if out_dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"out_dtype must be a float dtype, got {out_dtype}")
    checks = validate and data_checks_allowed(seqlens)
    if total_tokens is None:
        total_tokens = int(seqlens.to(torch.int64).sum())
    elif checks and total_tokens != int(seqlens.to(torch.int64).sum()):
        raise ValueError(
            f"total_tokens = {total_tokens} must equal sum(seqlens) = {int(seqlens.sum())}"
        )
    if checks:
        lens = seqlens.to(torch.int64).cpu()
        if (lens < 0).any():
            raise ValueError(f"seqlens must be >= 0, got {lens.tolist()}")
        _validate.check_table_data(lens, block_table.cpu(), block_size=bs, num_blocks=nb,
                                   lengths="seqlens[{b}]")  # fmt: skip
    return call_op(_gather_paged_kv_op, _gather_paged_kv_op_impl, key_cache, value_cache, block_table, seqlens, int(total_tokens),
                               num_heads, k_scale, v_scale, out_dtype)  # fmt: skip

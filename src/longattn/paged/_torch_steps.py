"""Steps shared by the pure-torch PagedAttention tiers (reference and chunked).

``prologue_and_append`` (QK-norm + rotary of the new tokens, quantize/round K/V once into the
cache, write their slots) is sync-free; the tiers then loop over the sequences on the host
(``cu_seqlens``/``past_seqlens`` are read once) and run a shared attention core per sequence.
"""

from __future__ import annotations

import torch

from .. import _attention_torch as at
from . import _slots
from ._params import PagedParams


def prologue_and_append(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    past_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    p: PagedParams,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Write the new K/V into the caches; return Q after the prologue: ``[1, tokens, N, H]``."""
    tokens = query.shape[0]
    n, kv, h = p.num_heads, p.kv_num_heads, p.head_size
    nb, bs = key_cache.shape[0], key_cache.shape[1]
    _, pos, slot, valid = _slots.new_token_slots(
        cu_seqlens, past_seqlens, block_table, num_tokens=tokens, block_size=bs, num_blocks=nb
    )
    cos = sin = None
    if p.do_rotary:
        cos, sin = at.rotary_tables(p.cos_cache, p.sin_cache, pos[None], dtype)  # [1, T, 1, R/2]
    common = dict(epsilon=p.qk_norm_epsilon, cos=cos, sin=sin, interleaved=p.rotary_interleaved,
                  dtype=dtype)  # fmt: skip
    q = at.qk_prologue(query.reshape(1, tokens, n, h), norm_weight=p.q_norm_weight, **common)
    k = at.qk_prologue(key.reshape(1, tokens, kv, h), norm_weight=p.k_norm_weight, **common)
    v = value.reshape(tokens, kv, h).to(dtype)
    k_rows = at.to_cache(k[0], key_cache.dtype, p.k_scale, kv_axis=-2)  # [T, KV, H]
    v_rows = at.to_cache(v, value_cache.dtype, p.v_scale, kv_axis=-2)
    _slots.write_slots(_slots.flat_view(key_cache), slot, valid, k_rows)
    _slots.write_slots(_slots.flat_view(value_cache), slot, valid, v_rows)
    return q


def sequences(cu_seqlens: torch.Tensor, past_seqlens: torch.Tensor):
    """Host loop data (one sync): ``(b, t0, t1, past)`` for every sequence with new tokens."""
    cu = cu_seqlens.tolist()
    past = past_seqlens.tolist()
    for b in range(len(past)):
        if cu[b + 1] > cu[b]:
            yield b, cu[b], cu[b + 1], past[b]

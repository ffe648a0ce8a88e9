"""Readable PagedAttention reference: per sequence, gather its keys token by token from the
paged cache into a contiguous ``[1, KV, T, H]`` and run the unfused attention core (fp32, or fp64
for the test oracle)."""

from __future__ import annotations

import torch

from .. import _attention_torch as at
from . import _slots, _torch_steps
from ._params import PagedParams


def paged_attention_reference(
    query, key, value, key_cache, value_cache, cu_seqlens, past_seqlens, block_table,
    p: PagedParams,
) -> torch.Tensor:  # fmt: skip
    """See ``_params`` for the contract; returns ``[tokens, N*H]`` in query's dtype."""
    dt = at.compute_dtype_for(query)
    q = _torch_steps.prologue_and_append(query, key, value, key_cache, value_cache, cu_seqlens,
                                         past_seqlens, block_table, p, dt)  # fmt: skip
    sink = at.sink_logits(p.head_sink, p.smooth_softmax, p.num_heads, query.device)
    nb, bs = key_cache.shape[0], key_cache.shape[1]
    flat_k, flat_v = _slots.flat_view(key_cache), _slots.flat_view(value_cache)
    out = torch.zeros(q.shape[1:], dtype=dt, device=query.device)  # [tokens, N, H]
    for b, t0, t1, past in _torch_steps.sequences(cu_seqlens, past_seqlens):
        total = past + t1 - t0
        pos = torch.arange(total, device=query.device, dtype=torch.int64)
        seq = torch.full_like(pos, b)
        slot, _ = _slots.table_slots(block_table, seq, pos, bs, nb)
        k = flat_k[slot].permute(1, 0, 2)[None]  # [1, KV, T, H] in the cache dtype
        v = flat_v[slot].permute(1, 0, 2)[None]
        o = at.attention_unfused(
            q[:, t0:t1],
            k,
            v,
            qpos=(pos[past:total])[None],
            total_len=torch.full((1,), total, device=query.device, dtype=torch.int64),
            scale=p.scale,
            k_scale=p.k_scale,
            v_scale=p.v_scale,
            window=p.local_window_size,
            softcap=p.softcap,
            sink=sink,
        )
        out[t0:t1] = o[0]
    return out.flatten(1).to(query.dtype)  # [tokens, N*H] (tokens may be 0)

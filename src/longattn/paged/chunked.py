"""Memory-efficient pure-torch PagedAttention: per sequence, gather only the blocks its queries
can see (whole blocks, skipping those left of the sliding window) and run the online-softmax
core over key chunks (fp32 math, K/V dequantized chunk by chunk)."""

from __future__ import annotations

import torch

from .. import _attention_torch as at
from . import _slots, _torch_steps
from ._params import PagedParams


def paged_attention_chunked(
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
    w = p.local_window_size
    out = torch.zeros(q.shape[1:], dtype=dt, device=query.device)  # [tokens, N, H]
    for b, t0, t1, past in _torch_steps.sequences(cu_seqlens, past_seqlens):
        s = t1 - t0
        total = past + s
        first = max(0, past - w + 1) // bs if w > 0 else 0  # first block any query can see
        used = (total + bs - 1) // bs - first
        off = first * bs  # position of the first gathered key
        slot = _slots.sequence_block_slots(block_table[b], first, used, bs, nb)
        k = flat_k[slot].permute(1, 0, 2)[None]  # [1, KV, used * bs, H] in the cache dtype
        v = flat_v[slot].permute(1, 0, 2)[None]
        qpos = torch.arange(past - off, total - off, device=query.device, dtype=torch.int64)
        o = at.attention_online(
            q[:, t0:t1],
            k,
            v,
            qpos=qpos[None],
            total_len=torch.full((1,), total - off, device=query.device, dtype=torch.int64),
            scale=p.scale,
            k_scale=p.k_scale,
            v_scale=p.v_scale,
            window=w,
            softcap=p.softcap,
            sink=sink,
            qpos_offsets=(past - off, past - off),
        )
        out[t0:t1] = o[0]
    return out.flatten(1).to(query.dtype)  # [tokens, N*H] (tokens may be 0)

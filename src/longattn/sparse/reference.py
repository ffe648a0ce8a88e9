"""Readable references of DynamicSparseAttention and SparseAttentionIndexer (unfused).

Compute dtype: fp32, or fp64 when the query is fp64 (tests build their fp64 truth by upcasting
every input). All candidates of all rows are gathered at once: ``[B*S, L, KV, H]`` with
``L = W + max_selected``; scores ``[B*S, N, L]``; one joint softmax with the sink.
"""

from __future__ import annotations

import torch

from .._attention_torch import compute_dtype_for, from_cache
from ._params import DSAParams
from ._shared import (
    dsa_sink,
    emit_selection,
    gather_rows,
    indexer_rows,
    prepare_dsa_candidates,
)


def dsa_reference(
    query,
    key,
    value,
    present_key,
    present_value,
    auxiliary_key,
    auxiliary_value,
    selected_indices,
    selected_counts,
    seqlens_k,
    p: DSAParams,
) -> torch.Tensor:
    """See ``_params.py`` for the contract. Returns ``[B, S, N*H]`` in ``query``'s dtype."""
    b, s = query.shape[:2]
    q, qpos, total_len, dtype, aux_v, segments = prepare_dsa_candidates(
        query, key, value, present_key, present_value, auxiliary_key, auxiliary_value,
        selected_indices, selected_counts, seqlens_k, p,
    )  # fmt: skip
    rows_b = torch.arange(b, device=query.device).repeat_interleave(s)
    ks, vs, oks = [], [], []
    for seg in segments:
        if seg.source == "main":
            k = from_cache(
                gather_rows(present_key, rows_b, seg.pos), p.k_scale, dtype=dtype, kv_axis=-2
            )
            v = from_cache(
                gather_rows(present_value, rows_b, seg.pos), p.v_scale, dtype=dtype, kv_axis=-2
            )
        else:
            k = gather_rows(auxiliary_key, rows_b, seg.pos).to(dtype)
            v = gather_rows(aux_v, rows_b, seg.pos).to(dtype)
        ks.append(k)
        vs.append(v)
        oks.append(seg.ok)
    k = torch.cat(ks, 1)  # [R, L, KV, H]
    v = torch.cat(vs, 1)
    ok = torch.cat(oks, 1)  # [R, L]
    # invalid candidates may hold garbage (even NaN): zero their values so 0 * NaN cannot leak
    v = torch.where(ok[:, :, None, None], v, torch.zeros((), dtype=dtype, device=v.device))
    x = torch.einsum("rkgh,rlkh->rkgl", q, k) * p.scale  # [R, KV, G, L]
    x = torch.where(ok[:, None, None, :], x, torch.full((), float("-inf"), dtype=dtype))
    # max over no candidate (L = 0: an empty selection without a window) is -inf, as over
    # candidates that are all invalid
    m = x.amax(-1) if x.shape[-1] else x.new_full(x.shape[:-1], float("-inf"))  # [R, KV, G]
    sink = dsa_sink(p, dtype, query.device)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m[..., None])
    denom = e.sum(-1)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    o = torch.einsum("rkgl,rlkh->rkgh", e, v)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    o = torch.where((denom > 0)[..., None], o / safe[..., None], torch.zeros_like(o))
    return o.reshape(b, s, p.num_heads * p.head_size).to(query.dtype)  # (B may be 0)


def indexer_scores_reference(index_query, index_block_keys, num_index_heads, scale):
    """``scale * sum_h relu(q_h . k_block)``: ``[B*S, num_blocks]`` in fp32 (fp64 for fp64)."""
    b, s, d = index_query.shape
    dtype = compute_dtype_for(index_query)
    q = index_query.reshape(b, s, num_index_heads, d // num_index_heads).to(dtype)
    kb = index_block_keys.to(dtype)  # [B, NB, DI]
    dots = torch.einsum("bshd,bkd->bshk", q, kb)  # [B, S, NI, NB]
    return (scale * torch.relu(dots).sum(2)).reshape(b * s, kb.shape[1])


def indexer_reference(
    index_query,
    index_block_keys,
    seqlens_k,
    *,
    num_index_heads: int,
    compress_ratio: int,
    token_budget: int,
    scale: float,
    is_first_prompt: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QSA selection: every score, a stable descending sort (ties: lower block index first),
    the first ``min(token_budget // r, complete)`` blocks, re-sorted ascending."""
    s = index_query.shape[1]
    nb = index_block_keys.shape[1]
    r = compress_ratio
    rows = indexer_rows(seqlens_k, s, is_first_prompt, r, nb)
    scores = indexer_scores_reference(index_query, index_block_keys, num_index_heads, scale)
    visible = torch.arange(nb, device=scores.device)[None, :] < rows.n_complete[:, None]
    scores = torch.where(visible, scores, torch.full((), float("-inf"), dtype=scores.dtype))
    kb = token_budget // r
    n_sel = torch.clamp(rows.n_complete, max=kb)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :kb]
    if order.shape[1] < kb:  # fewer blocks than the budget: pad with a sentinel
        pad = order.new_full((order.shape[0], kb - order.shape[1]), nb)
        order = torch.cat((order, pad), 1)
    slot_ok = torch.arange(kb, device=order.device)[None, :] < n_sel[:, None]
    blocks = torch.where(slot_ok, order, torch.full_like(order, nb)).sort(-1).values
    max_selected = token_budget + r - 1
    return emit_selection(blocks, n_sel, rows, compress_ratio=r, max_selected=max_selected)

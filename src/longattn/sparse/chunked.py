"""Memory-efficient pure-PyTorch tiers of DynamicSparseAttention and SparseAttentionIndexer.

DSA: same prologue/append as the reference; then, per block of query rows, candidates are
gathered by index in chunks (``[rows, chunk, KV, H]``, the query heads of a KV group share the
gather) and combined with an online softmax (running max / sum / accumulator in fp32), the sink
joining at the end. Temporaries stay within ``_ELEMS`` elements per step; nothing of size S x T.

Indexer: per sequence and block of query rows, the per-head dot products ``[rows, NI, blocks]``
(bounded by ``_ELEMS``), summed to ``[rows, blocks]`` scores; top-k by ``torch.topk`` with exact
tie handling (ties at the k-th score are resolved to the lower block indices), then a sync-free
compaction to ascending block order.
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

_ELEMS = 1 << 22  # elements of the largest temporary per step (16 MiB in fp32)
_CAND_CHUNK = 512  # candidates per online-softmax step


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def dsa_chunked(
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
    kv, g, h = p.kv_num_heads, p.group, p.head_size
    q, qpos, total_len, dtype, aux_v, segments = prepare_dsa_candidates(
        query, key, value, present_key, present_value, auxiliary_key, auxiliary_value,
        selected_indices, selected_counts, seqlens_k, p,
    )  # fmt: skip
    n_rows = b * s
    rows_b = torch.arange(b, device=query.device).repeat_interleave(s)
    sink = dsa_sink(p, dtype, query.device)
    longest = max(seg.pos.shape[1] for seg in segments)
    chunk = max(1, min(_CAND_CHUNK, longest))
    row_block = max(1, min(n_rows, _ELEMS // max(1, chunk * kv * max(g, h))))
    out = torch.empty((n_rows, kv, g, h), dtype=dtype, device=query.device)
    ninf = torch.full((), float("-inf"), dtype=dtype, device=query.device)
    zero = torch.zeros((), dtype=dtype, device=query.device)
    for r0 in range(0, n_rows, row_block):
        r1 = min(n_rows, r0 + row_block)
        qb = q[r0:r1]  # [Rb, KV, G, H]
        rb = rows_b[r0:r1]
        m = torch.full((r1 - r0, kv, g), float("-inf"), dtype=dtype, device=query.device)
        l = torch.zeros_like(m)
        acc = torch.zeros((r1 - r0, kv, g, h), dtype=dtype, device=query.device)
        for seg in segments:
            kc_src, vc_src = (
                (present_key, present_value) if seg.source == "main" else (auxiliary_key, aux_v)
            )
            ks, vs = (p.k_scale, p.v_scale) if seg.source == "main" else (None, None)
            for c0 in range(0, seg.pos.shape[1], chunk):
                c1 = min(seg.pos.shape[1], c0 + chunk)
                pos = seg.pos[r0:r1, c0:c1]  # [Rb, Lc]
                ok = seg.ok[r0:r1, c0:c1]
                k = from_cache(gather_rows(kc_src, rb, pos), ks, dtype=dtype, kv_axis=-2)
                v = from_cache(gather_rows(vc_src, rb, pos), vs, dtype=dtype, kv_axis=-2)
                v = torch.where(ok[:, :, None, None], v, zero)  # [Rb, Lc, KV, H]
                x = torch.einsum("rkgh,rlkh->rkgl", qb, k) * p.scale  # [Rb, KV, G, Lc]
                x = torch.where(ok[:, None, None, :], x, ninf)
                m_new = torch.maximum(m, x.amax(-1))
                m_safe = _finite_or_zero(m_new)
                alpha = torch.exp(m - m_safe)  # m = -inf -> 0
                e = torch.exp(x - m_safe[..., None])
                l = l * alpha + e.sum(-1)
                acc = acc * alpha[..., None] + torch.einsum("rkgl,rlkh->rkgh", e, v)
                m = m_new
        if sink is not None:
            m_new = torch.maximum(m, sink)
            m_safe = _finite_or_zero(m_new)
            alpha = torch.exp(m - m_safe)
            l = l * alpha + torch.exp(sink - m_safe)
            acc = acc * alpha[..., None]
        good = l > 0
        safe = torch.where(good, l, torch.ones_like(l))
        out[r0:r1] = torch.where(good[..., None], acc / safe[..., None], zero)
    return out.reshape(b, s, p.num_heads * p.head_size).to(query.dtype)  # (B may be 0)


def _select_topk(scores: torch.Tensor, n_sel: torch.Tensor, kb: int) -> torch.Tensor:
    """Ascending ids ``[R, kb]`` of each row's ``n_sel`` best blocks (ties: lower index).

    ``scores [R, NB]`` with ``-inf`` at invisible blocks (``n_sel`` <= visible count); NaN
    scores rank above +inf, as in the reference's sort.
    Slots past ``n_sel`` hold the sentinel NB. No host synchronization.
    """
    rows, nb = scores.shape
    dev = scores.device
    kk = min(kb, nb)
    blocks = torch.full((rows, kb + 1), nb, dtype=torch.int64, device=dev)
    if kk == 0:
        return blocks[:, :kb]
    top = scores.topk(kk, dim=-1).values  # [R, kk], descending
    kth = top.gather(1, (n_sel.clamp(1, kk) - 1)[:, None])  # [R, 1]
    # NaN ranks above every number (as torch.sort / topk order it): compare (is_nan, value)
    nan, kth_nan = scores.isnan(), kth.isnan()
    above = ~kth_nan & ((scores > kth) | nan)
    tied = torch.where(kth_nan, nan, scores == kth)
    need = n_sel[:, None] - above.sum(-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(-1) <= need))
    chosen = chosen & (n_sel > 0)[:, None]
    ids = torch.arange(nb, device=dev).expand(rows, nb)
    slot = torch.where(chosen, chosen.cumsum(-1) - 1, kb)  # unchosen -> spare column kb
    blocks.scatter_(1, slot, torch.where(chosen, ids, nb))
    return blocks[:, :kb]


def indexer_chunked(
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
    """Same selection as the reference with ``O(rows x blocks)`` score memory."""
    b, s, d = index_query.shape
    nb = index_block_keys.shape[1]
    r = compress_ratio
    ni = num_index_heads
    dtype = compute_dtype_for(index_query)
    rows = indexer_rows(seqlens_k, s, is_first_prompt, r, nb)
    kb = token_budget // r
    n_sel = torch.clamp(rows.n_complete, max=kb)
    blocks = torch.empty((b * s, kb), dtype=torch.int64, device=index_query.device)
    q_all = index_query.reshape(b, s, ni, d // ni)
    row_block = max(1, min(s, _ELEMS // max(1, ni * nb)))
    ids = torch.arange(nb, device=index_query.device)
    for bi in range(b):
        keys = index_block_keys[bi].to(dtype)  # [NB, DI]
        for s0 in range(0, s, row_block):
            s1 = min(s, s0 + row_block)
            r0, r1 = bi * s + s0, bi * s + s1
            q = q_all[bi, s0:s1].to(dtype)  # [Sb, NI, DI]
            dots = torch.matmul(q, keys.t())  # [Sb, NI, NB]
            sc = scale * torch.relu(dots).sum(1)  # [Sb, NB]
            visible = ids[None, :] < rows.n_complete[r0:r1, None]
            sc = torch.where(visible, sc, torch.full((), float("-inf"), dtype=dtype))
            blocks[r0:r1] = _select_topk(sc, n_sel[r0:r1], kb)
    return emit_selection(blocks, n_sel, rows, compress_ratio=r, max_selected=token_budget + r - 1)

"""Pieces shared by the sparse tiers (reference / chunked) of both ops; never backend-specific.

- DynamicSparseAttention: :func:`prepare_dsa` (QK-norm + rotary prologue, cache append, optional
  query rounding), :func:`dsa_candidates` (the candidate lists of every row with their validity,
  as the spec defines them) and :func:`gather_rows` (cache rows of candidates, by index).
- SparseAttentionIndexer: :func:`indexer_rows` (query positions, visible complete blocks,
  trailing tokens) and :func:`emit_selection` (chosen blocks -> token positions, -1 padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._attention_torch import (
    compute_dtype_for,
    contiguous_positions,
    prepare_from_params,
    sink_logits,
)
from ._params import DSAParams

# ---------------------------------------------------------------------------------------------
# DynamicSparseAttention.


def prepare_dsa(query, key, value, present_key, present_value, seqlens_k, p: DSAParams):
    """Prologue + append. Returns ``(q [B*S, KV, G, H] compute dtype, qpos [B, S] int64,
    total_len [B] int64, dtype)``.

    Q and the new K get QK-norm + rotary in the compute dtype (fp32; fp64 for fp64 inputs); the
    K is rounded/quantized once into the cache, V is appended raw (one conversion). With
    ``p.query_dtype`` the prepared Q is rounded once to that dtype (and read back exactly).
    """
    b, s = query.shape[:2]
    dtype = compute_dtype_for(query)
    qf, qpos, total_len = prepare_from_params(
        query, key, value, present_key, present_value, seqlens_k, p, dtype=dtype
    )
    if p.query_dtype is not None:
        qf = qf.to(p.query_dtype).to(dtype)
    q4 = qf.reshape(b * s, p.kv_num_heads, p.group, p.head_size)
    return q4, qpos, total_len, dtype


def dsa_sink(p: DSAParams, dtype: torch.dtype, device) -> torch.Tensor | None:
    """Sink logits ``[KV, G]`` in ``dtype`` (head_sink, or zeros with smooth_softmax) or None."""
    sink = sink_logits(p.head_sink, p.smooth_softmax, p.num_heads, device)
    return None if sink is None else sink.to(dtype).reshape(p.kv_num_heads, p.group)


@dataclass(frozen=True)
class Segment:
    """One group of candidates of every row: ``pos [R, L]`` int64 rows of ``source`` ("main" =
    present cache, "aux" = auxiliary K/V), clamped into it; ``ok [R, L]`` bool validity."""

    source: str
    pos: torch.Tensor
    ok: torch.Tensor


def dsa_candidates(
    qpos: torch.Tensor,
    total_len: torch.Tensor,
    selected_indices: torch.Tensor,
    selected_counts: torch.Tensor,
    *,
    local_window: int,
    source: str,
    capacity: int,
    aux_len: int,
) -> list[Segment]:
    """The candidates of each row ``r = b*S + s``, in the spec's order.

    - local window (``local_window > 0``): main keys ``qpos-W+1 .. qpos``, valid when ``>= 0``;
    - then the first ``selected_counts[r]`` selected entries: main entries valid iff
      ``0 <= idx <= qpos`` and ``idx < capacity`` and (local mode) outside the window; auxiliary
      entries valid iff ``0 <= idx < aux_len``. Entries past the count are ignored.

    Rows that are padding (first prompt, ``qpos >= total_len``) have no valid candidate.
    ``source`` is "main" or "aux"; works for any mode/source pair (the API admits two).
    """
    b, s = qpos.shape
    qp = qpos.reshape(b * s)
    real = qp < total_len.repeat_interleave(s)  # [R]
    real = real & (qp >= 0)
    segments = []
    lo = qp - local_window + 1 if local_window > 0 else None
    if local_window > 0:
        w = torch.arange(local_window, device=qp.device, dtype=torch.int64)
        pos = lo[:, None] + w  # [R, W]
        ok = (pos >= 0) & (pos < capacity) & real[:, None]
        segments.append(Segment("main", pos.clamp(0, capacity - 1), ok))
    m = selected_indices.shape[1]
    idx = selected_indices.to(torch.int64)
    j = torch.arange(m, device=qp.device, dtype=torch.int64)
    ok = (j[None, :] < selected_counts.to(torch.int64)[:, None]) & real[:, None] & (idx >= 0)
    if source == "main":
        ok = ok & (idx <= qp[:, None]) & (idx < capacity)
        if lo is not None:
            ok = ok & (idx < lo[:, None])  # inside the window: already a candidate
        segments.append(Segment("main", idx.clamp(0, capacity - 1), ok))
    else:
        ok = ok & (idx < aux_len)
        segments.append(Segment("aux", idx.clamp(0, max(aux_len - 1, 0)), ok))
    return segments


def gather_rows(cache: torch.Tensor, rows_b: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``cache [B, KV, C, H]``, batch of each row ``rows_b [R]``, positions ``pos [R, L]`` ->
    ``[R, L, KV, H]`` in the cache's dtype (one gather, group heads share it). An empty cache
    (an auxiliary cache of length 0: every entry is masked) gives zeros."""
    if cache.shape[2] == 0:
        return cache.new_zeros(pos.shape[0], pos.shape[1], cache.shape[1], cache.shape[3])
    return cache.permute(0, 2, 1, 3)[rows_b[:, None], pos]


# ---------------------------------------------------------------------------------------------
# SparseAttentionIndexer.


@dataclass(frozen=True)
class IndexerRows:
    """Per query row ``r = b*S + s``: ``qpos``, ``n_complete`` visible complete blocks (0 for
    padding rows), ``trail`` tokens of the trailing incomplete block (``0 .. r-1``)."""

    qpos: torch.Tensor  # [R] int64
    n_complete: torch.Tensor  # [R] int64
    trail: torch.Tensor  # [R] int64


def indexer_rows(
    seqlens_k: torch.Tensor,
    s: int,
    is_first_prompt: bool,
    compress_ratio: int,
    num_blocks: int,
) -> IndexerRows:
    qpos, total_len = contiguous_positions(seqlens_k, s, is_first_prompt)
    qp = qpos.reshape(-1)
    real = (qp >= 0) & (qp < total_len.repeat_interleave(s))
    visible = torch.where(real, qp + 1, torch.zeros_like(qp))  # tokens at positions <= qpos
    nc = torch.clamp(visible // compress_ratio, max=num_blocks)
    trail = torch.clamp(visible - nc * compress_ratio, max=compress_ratio - 1)
    return IndexerRows(qp, nc, trail)


def emit_selection(
    blocks: torch.Tensor,
    n_sel: torch.Tensor,
    rows: IndexerRows,
    *,
    compress_ratio: int,
    max_selected: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen blocks -> ``(selected_indices [R, max_selected] int32, selected_counts [R] int32)``.

    ``blocks [R, kb]`` holds each row's chosen block ids in ascending order in its first
    ``n_sel[r]`` slots (anything after). Output per row: the ``r`` positions of each chosen
    block, then the trailing block's ``trail`` positions, then -1 (ascending positions).
    """
    r = compress_ratio
    n, kb = blocks.shape
    dev = blocks.device
    out = torch.full((n, max_selected), -1, dtype=torch.int64, device=dev)
    if kb > 0:
        slot_ok = torch.arange(kb, device=dev)[None, :] < n_sel[:, None]  # [R, kb]
        tok = blocks.to(torch.int64)[:, :, None] * r + torch.arange(r, device=dev)  # [R, kb, r]
        tok = torch.where(slot_ok[:, :, None], tok, torch.full_like(tok, -1))
        out[:, : kb * r] = tok.reshape(n, kb * r)
    if r > 1:
        t = torch.arange(r - 1, device=dev, dtype=torch.int64)
        cols = n_sel[:, None] * r + t  # [R, r-1] < kb*r + r - 1 <= max_selected
        vals = torch.where(t < rows.trail[:, None], rows.n_complete[:, None] * r + t, -1)
        out.scatter_(1, cols, vals)
    counts = n_sel * r + rows.trail
    return out.to(torch.int32), counts.to(torch.int32)


def prepare_dsa_candidates(query, key, value, present_key, present_value, auxiliary_key,
                           auxiliary_value, selected_indices, selected_counts, seqlens_k,
                           p: DSAParams):  # fmt: skip
    """The torch tiers' common start: prologue + append (``prepare_dsa``), the V source of the
    auxiliary cache, and each row's candidate segments. Returns
    ``(q, qpos, total_len, dtype, aux_v, segments)``."""
    q, qpos, total_len, dtype = prepare_dsa(
        query, key, value, present_key, present_value, seqlens_k, p
    )
    aux_v = auxiliary_key if p.auxiliary_kv_shared else auxiliary_value
    segments = dsa_candidates(
        qpos,
        total_len,
        selected_indices,
        selected_counts,
        local_window=p.local_window_size if p.local else -1,
        source="main" if p.selected_kv_source == "main" else "aux",
        capacity=present_key.shape[2],
        aux_len=0 if auxiliary_key is None else auxiliary_key.shape[2],
    )
    return q, qpos, total_len, dtype, aux_v, segments

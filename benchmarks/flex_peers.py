"""FlexAttention peers for the benchmarks: the functions our ops compute, written the way a
FlexAttention user would (``score_mod`` for softcap, ``mask_mod`` / ``BlockMask`` for causality,
windows, paged and block-sparse layouts, the log-sum-exp for a sink), with the inputs in the
layout flex prefers (K/V ``[B|1, KV, T, H]`` contiguous, the query already normed and rotated).

Each peer is checked against longattn's reference on the CPU by ``tests/test_bench_peers.py``, so
a benchmark never compares functions that differ. ``compiled=True`` (the benchmarks) uses
``torch.compile(flex_attention)`` and compiled block masks; ``compiled=False`` runs flex's eager
(math) path, which is what the CPU tests use.

What a peer does not do (and our timed ops do): QK-norm, rotary and the cache append of the new
tokens. Sinks cost the peer one extra elementwise pass (``out * sigmoid(lse - sink)``) and one
extra rounding of its output; that is the FlexAttention way to express them.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    # Each score_mod / mask_mod closure is a new guard: a benchmark compiles a dozen variants.
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(64, getattr(cfg, name)))
    return torch.compile(flex_attention, dynamic=False)


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """out [B, N, S, H], lse [B, N, S] (natural log), sink [N] -> the softmax with the sink logit
    in the denominator: out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink)."""
    if sink is None:
        return out
    w = torch.sigmoid(lse.float() - sink.float()[None, :, None])  # [B, N, S]; 0 for empty rows
    return (out.float() * w[..., None]).to(out.dtype)


# ---------------------------------------------------------------------------------------------
# Dense GQA with the features SDPA lacks (softcap, local window, sink).


def gqa_block_mask(
    total_len: torch.Tensor, s: int, t: int, *, window: int = -1, compiled: bool = False
):
    """Causal (+ window) BlockMask for queries at the last ``s`` positions of each sequence.

    total_len: [B] int, valid keys of each sequence (query row i sits at ``total_len - s + i``);
    keys live in ``[B, KV, t, H]`` buffers. Keys ``j <= qpos`` and ``j > qpos - window``
    (``window > 0``) are visible, as in GroupQueryAttention.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    q_off = (total_len.to(torch.int64) - s).contiguous()  # [B]

    def mask_mod(b, h, q_idx, kv_idx):
        qpos = q_off[b] + q_idx
        ok = kv_idx <= qpos
        if window > 0:
            ok = ok & (kv_idx > qpos - window)
        return ok

    return create_block_mask(
        mask_mod, total_len.shape[0], None, s, t, device=total_len.device, _compile=compiled
    )


def flex_gqa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask,
    *,
    scale: float,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """q [B, N, S, H] (rotated), k/v [B, KV, T, H] caches -> out [B, N, S, H] in q's dtype.

    ``softcap > 0``: logits ``softcap * tanh(scale * q.k / softcap)``; ``sink`` [N] fp32: a
    per-head logit in the softmax denominator (``smooth_softmax`` is ``sink = 0``).
    """
    score_mod = None
    if softcap > 0:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    res = _flex(compiled)(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        return_lse=sink is not None,
    )
    if sink is None:
        return res
    out, lse = res
    return _apply_sink(out, lse, sink)


# ---------------------------------------------------------------------------------------------
# Paged decode: one query row per sequence over a shared physical cache.


def paged_physical_kv(cache: torch.Tensor) -> torch.Tensor:
    """Our paged cache [num_blocks, block_size, KV, H] -> flex's [1, KV, num_blocks*block_size, H]
    (a contiguous copy, made once outside the timed region: flex's preferred layout; the same
    slot numbering, so the block table indexes it directly)."""
    nb, bs, kv, h = cache.shape
    return cache.reshape(1, nb * bs, kv, h).transpose(1, 2).contiguous()


def paged_block_mask(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int, q_len=1
):
    """BlockMask over the physical slots for decode rows (query ``i`` of sequence ``b`` sees the
    first ``seq_lens[b]`` logical positions; causality is implied for q_len = 1).

    ``mask_mod`` alone defines the function (flex's eager path evaluates it everywhere): slot
    ``p`` is visible to sequence ``b`` iff its block is in ``b``'s table at logical block ``l``
    and ``l * block_size + p % block_size < seq_lens[b]`` (a physical -> logical block map, as
    torch's experimental PagedAttention keeps). The block structure is the compiled kernel's
    shortcut: each sequence's complete blocks are "full" (no mask_mod evaluated), its trailing
    incomplete block the one partial block. block_table [B, max_blocks] int32; seq_lens [B].
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, max_blocks = block_table.shape
    dev = block_table.device
    lens = seq_lens.to(device=dev, dtype=torch.int64).contiguous()
    n_used = (lens + block_size - 1) // block_size  # [B] blocks holding the sequence
    n_full = lens // block_size  # [B]
    table = block_table.to(torch.int64)
    logical = torch.arange(max_blocks, device=dev)[None, :].expand(b, -1)
    owned = logical < n_used[:, None]  # [B, max_blocks]
    phys_to_logical = torch.full((b, num_blocks + 1), -1, dtype=torch.int64, device=dev)
    phys_to_logical.scatter_(1, torch.where(owned, table, num_blocks), logical)
    phys_to_logical = phys_to_logical[:, :num_blocks].contiguous()  # [B, num_blocks]

    def mask_mod(bi, h, q_idx, kv_idx):
        blk = phys_to_logical[bi, kv_idx // block_size]
        return (blk >= 0) & (blk * block_size + kv_idx % block_size < lens[bi])

    # flex sizes its dense view of the mask by kv_indices' last dim: one column per physical
    # block (as torch's experimental PagedAttention does), the table in the first columns.
    full_idx = torch.zeros(b, 1, 1, num_blocks, dtype=torch.int32, device=dev)
    full_idx[:, 0, 0, :max_blocks] = block_table.to(torch.int32)
    full_cnt = n_full.to(torch.int32)[:, None, None].contiguous()  # [B, 1, 1]
    tail_idx = torch.zeros_like(full_idx)
    tail_col = n_full.clamp(max=max_blocks - 1)[:, None]
    tail_idx[:, 0, 0, 0] = block_table.to(torch.int32).gather(1, tail_col)[:, 0]
    tail_cnt = (n_used > n_full).to(torch.int32)[:, None, None].contiguous()
    return BlockMask.from_kv_blocks(
        tail_cnt,
        tail_idx,
        full_cnt,
        full_idx,
        BLOCK_SIZE=(128, block_size),
        mask_mod=mask_mod,
        seq_lengths=(q_len, num_blocks * block_size),
    )


def flex_paged_decode(
    q: torch.Tensor,
    k_phys: torch.Tensor,
    v_phys: torch.Tensor,
    block_mask,
    *,
    scale: float,
    compiled: bool = False,
    kernel_options: dict | None = None,
) -> torch.Tensor:
    """q [B, N, 1, H] (rotated), k_phys/v_phys [1, KV, P, H] -> out [B, N, 1, H]."""
    return _flex(compiled)(
        q,
        k_phys,
        v_phys,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_phys.shape[1],
        kernel_options=kernel_options,
    )


# ---------------------------------------------------------------------------------------------
# Block-sparse decode: the QSA selection expressed as a BlockMask, one query row per flex batch.


def flat_kv(cache: torch.Tensor) -> torch.Tensor:
    """[B, KV, C, H] -> [1, KV, B*C, H] (a view for B = 1, else a copy made outside the timing):
    each query row then picks its own sequence's blocks out of one shared K/V, as flex wants."""
    b, kv, c, h = cache.shape
    return cache if b == 1 else cache.transpose(0, 1).reshape(1, kv, b * c, h)


def sparse_block_mask(
    selected_indices: torch.Tensor,
    selected_counts: torch.Tensor,
    row_base: torch.Tensor,
    qpos: torch.Tensor,
    block: int,
    n_slots: int,
):
    """BlockMask equivalent to a QSA selection, for queries laid out one row per flex batch.

    selected_indices: [rows, M] int32 positions (``-1`` padding; entries past the count are
    ignored); selected_counts: [rows]; row_base: [rows] int, the row's sequence offset in the
    flattened K/V (``b * C``); qpos: [rows] the row's query position; block = r (a multiple of
    16, dividing C); n_slots = B * C. The mask is the selected blocks' positions ``<= qpos``: for
    whole-block selections (QSA) this is exactly the set DynamicSparseAttention attends.
    """
    from torch.nn.attention.flex_attention import BlockMask

    dev = selected_indices.device
    rows, m = selected_indices.shape
    n_blocks = n_slots // block
    base = row_base.to(device=dev, dtype=torch.int64).contiguous()
    qp = qpos.to(device=dev, dtype=torch.int64).contiguous()
    listed = torch.arange(m, device=dev)[None, :] < selected_counts.to(dev)[:, None]
    sel = selected_indices.to(torch.int64)
    ok = listed & (sel >= 0)
    blk = torch.where(ok, (base[:, None] + sel) // block, n_blocks)  # [rows, M] flat block ids
    chosen = torch.zeros(rows, n_blocks + 1, dtype=torch.bool, device=dev)
    chosen.scatter_(1, blk, True)
    chosen = chosen[:, :n_blocks].contiguous()  # [rows, n_blocks]
    cnt = chosen.sum(1, dtype=torch.int32)  # [rows]
    order = torch.sort(chosen.to(torch.int8), dim=1, descending=True, stable=True).indices
    idx = order.to(torch.int32)[:, None, None, :].contiguous()  # chosen block ids first

    def mask_mod(r, h, q_idx, kv_idx):  # the whole function (flex's eager path uses only it)
        return chosen[r, kv_idx // block] & (kv_idx - base[r] <= qp[r])

    return BlockMask.from_kv_blocks(
        cnt[:, None, None].contiguous(),
        idx,
        BLOCK_SIZE=(128, block),
        mask_mod=mask_mod,
        seq_lengths=(1, n_slots),
    )


def flex_sparse(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    block_mask,
    *,
    scale: float,
    sink: torch.Tensor | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """q [rows, N, 1, H] (normed, rotated; row = b * S + i), k/v [1, KV, B*C, H] -> [rows, N, 1, H]."""
    return flex_gqa(q, k_flat, v_flat, block_mask, scale=scale, sink=sink, compiled=compiled)

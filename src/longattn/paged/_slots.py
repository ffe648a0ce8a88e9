"""Paged-cache addressing shared by the paged ops (pure torch, sync-free, any device).

A cache is ``[num_blocks, block_size, KV, H]``; its *slot* ``block * block_size + row`` indexes
the flat view ``[num_blocks * block_size, KV, H]``. Token ``t`` of a varlen batch belongs to
sequence ``b`` with ``cu[b] <= t < cu[b + 1]`` and sits at position ``past[b] + t - cu[b]``,
stored in block ``block_table[b, pos // block_size]`` at row ``pos % block_size``.

Nothing here reads tensor values on the host: bad entries (out-of-range blocks, positions past
the table) are marked invalid and clamped so that no index goes out of bounds; the APIs validate
the data in eager mode before they get here.
"""

from __future__ import annotations

import torch


def flat_view(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, KV, H]`` -> ``[num_blocks * block_size, KV, H]`` (a view)."""
    return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])


def token_sequence(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 ``[num_tokens]``: the sequence each packed token belongs to (clamped to [0, B))."""
    t = torch.arange(num_tokens, device=cu_seqlens.device, dtype=torch.int64)
    ends = cu_seqlens[1:].to(torch.int64).contiguous()
    b = torch.searchsorted(ends, t, right=True)
    return b.clamp(0, max(ends.shape[0] - 1, 0))


def table_slots(
    block_table: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    num_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of positions ``pos`` of sequences ``seq`` (int64, same shape) and their validity.

    Invalid: a negative position, a position past the table (``pos // block_size >=
    max_blocks``), or a table entry outside ``[0, num_blocks)``. Invalid slots are clamped to 0.
    """
    max_blocks = block_table.shape[1]
    col = torch.div(pos, block_size, rounding_mode="floor")
    valid = (pos >= 0) & (col < max_blocks)
    blk = block_table[seq, col.clamp(0, max(max_blocks - 1, 0))].to(torch.int64)
    valid = valid & (blk >= 0) & (blk < num_blocks)
    slot = blk * block_size + pos.remainder(block_size)
    return torch.where(valid, slot, torch.zeros_like(slot)), valid


def new_token_slots(
    cu_seqlens: torch.Tensor,
    past_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    num_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(seq, pos, slot, valid), each ``[num_tokens]``, for the new tokens of a varlen batch."""
    seq = token_sequence(cu_seqlens, num_tokens)
    t = torch.arange(num_tokens, device=cu_seqlens.device, dtype=torch.int64)
    pos = past_seqlens.to(torch.int64)[seq] + t - cu_seqlens.to(torch.int64)[seq]
    slot, valid = table_slots(block_table, seq, pos, block_size, num_blocks)
    return seq, pos, slot, valid


def write_slots(
    flat: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor
) -> None:
    """``flat[slot[i]] = rows[i]`` where ``valid[i]``; every other slot keeps its bits.

    flat: ``[slots, KV, H]``; slot int64 / valid bool ``[tokens]``; rows ``[tokens, KV, H]`` in
    flat's dtype. Sync-free: an invalid row repeats the write of the first valid row (same slot,
    same bits) or, when no row is valid, writes slot 0's own bits back. Valid slots must be
    distinct (the APIs check it in eager mode).
    """
    if rows.shape[0] == 0:
        return
    first = torch.argmax(valid.to(torch.int32))
    any_valid = valid[first]
    fill_slot = torch.where(any_valid, slot[first], torch.zeros_like(slot[first]))
    fill_row = torch.where(any_valid, rows[first], flat[0])
    idx = torch.where(valid, slot, fill_slot)
    vals = torch.where(valid[:, None, None], rows, fill_row)
    flat.index_copy_(0, idx, vals)


def sequence_block_slots(
    block_table_row: torch.Tensor, first_block: int, num_blocks_used: int, block_size: int,
    num_blocks: int,
) -> torch.Tensor:  # fmt: skip
    """int64 slots of blocks ``first_block .. first_block + num_blocks_used - 1`` of one
    sequence's table row, block by block: ``[num_blocks_used * block_size]`` (clamped)."""
    blk = block_table_row[first_block : first_block + num_blocks_used].to(torch.int64)
    blk = blk.clamp(0, num_blocks - 1)
    rows = torch.arange(block_size, device=blk.device, dtype=torch.int64)
    return (blk[:, None] * block_size + rows[None, :]).reshape(-1)

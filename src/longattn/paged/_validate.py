"""Input checks shared by the paged ops: shapes/dtypes (always) and data (eager only).

Shape/dtype checks never read tensor values. The data checks (``check_batch_data``,
``check_slot_mapping_data``) read index tensors on the host, which synchronizes with the device;
the APIs call them only when ``validate=True`` and ``_common.data_checks_allowed`` (not under
torch.compile tracing or CUDA-graph capture).
"""

from __future__ import annotations

import torch

from .._common import FLOAT_DTYPES, check_tensor
from . import _slots

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


def check_cache_pair(key_cache: object, value_cache: object, device: torch.device | None):
    """Both caches ``[num_blocks, block_size, KV, H]``, same dtype/shape, contiguous.

    Returns ``(num_blocks, block_size, kv_num_heads, head_size)``.
    """
    check_tensor("key_cache", key_cache, dtypes=CACHE_DTYPES, ndim=4, device=device)
    check_tensor(
        "value_cache",
        value_cache,
        dtypes=(key_cache.dtype,),
        shape=tuple(key_cache.shape),
        device=key_cache.device,
    )
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not c.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous (it is updated in place), got strides {c.stride()}"
            )
        if c.shape[0] == 0 or c.shape[1] == 0:
            raise ValueError(
                f"{name} must have num_blocks >= 1 and block_size >= 1, got {tuple(c.shape)}"
            )
    if key_cache is value_cache:
        raise ValueError("key_cache and value_cache must be different tensors")
    return tuple(key_cache.shape)


def check_activation_cache_dtypes(act: torch.dtype, cache: torch.dtype) -> None:
    """Cache dtype: the activations' dtype, fp16 for bf16 activations, or int8."""
    allowed = {act, torch.int8}
    if act == torch.bfloat16:
        allowed.add(torch.float16)
    if cache not in allowed:
        names = "/".join(sorted(str(d).removeprefix("torch.") for d in allowed))
        raise TypeError(
            f"key_cache dtype must be {names} for {str(act).removeprefix('torch.')} "
            f"activations, got {cache}"
        )


def check_scales(k_scale, v_scale, cache_dtype: torch.dtype, kv: int, h: int, device) -> None:
    """``k_scale/v_scale`` fp32 ``[1]`` or ``[KV, 1, H]``, required iff the cache is int8."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if cache_dtype != torch.int8:
            if s is not None:
                raise ValueError(f"{name} is only used with an int8 cache (cache is {cache_dtype})")
            continue
        if s is None:
            raise ValueError(f"{name} is required with an int8 cache (fp32 [1] or [{kv}, 1, {h}])")
        check_tensor(name, s, dtypes=(torch.float32,), device=device)
        if tuple(s.shape) not in ((1,), (kv, 1, h)):
            raise ValueError(f"{name} must have shape (1,) or ({kv}, 1, {h}), got {tuple(s.shape)}")


def check_index(name: str, t: object, shape, device) -> torch.Tensor:
    """An int32 index tensor; unit stride in its last dim (the Triton kernels read ptr + i)."""
    return check_tensor(
        name, t, dtypes=(torch.int32,), shape=shape, device=device, contiguous_last=True
    )


def _first_true(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


def check_batch_data(
    cu_seqlens: torch.Tensor,
    past_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """Data checks of a varlen paged batch (host sync). Raises ValueError naming the argument."""
    cu = cu_seqlens.to(torch.int64).cpu()
    past = past_seqlens.to(torch.int64).cpu()
    table = block_table.cpu()
    if int(cu[0]) != 0:
        raise ValueError(f"cumulative_sequence_length[0] must be 0, got {int(cu[0])}")
    new = cu[1:] - cu[:-1]
    if (new < 0).any():
        (b,) = _first_true(new < 0)
        raise ValueError(
            "cumulative_sequence_length must be non-decreasing, got "
            f"cu[{b}] = {int(cu[b])} > cu[{b + 1}] = {int(cu[b + 1])}"
        )
    if int(cu[-1]) != num_tokens:
        raise ValueError(
            f"cumulative_sequence_length[-1] = {int(cu[-1])} must equal the number of query rows "
            f"(tokens) = {num_tokens}"
        )
    if (past < 0).any():
        (b,) = _first_true(past < 0)
        raise ValueError(f"past_seqlens must be >= 0, got past_seqlens[{b}] = {int(past[b])}")
    total = past + new
    used = check_table_data(total, table, block_size=block_size, num_blocks=num_blocks,
                            lengths="past_seqlens[{b}] + new tokens = {past} + {new}",
                            past=past, new=new)  # fmt: skip
    if num_tokens:
        seq, _, slot, _ = _slots.new_token_slots(
            cu, past, table, num_tokens=num_tokens, block_size=block_size, num_blocks=num_blocks
        )
        _check_distinct("block_table", slot, block_size)
        _check_written_blocks_private(seq, slot // block_size, table, used)


def _check_written_blocks_private(seq, blk, table, used) -> None:
    """A block that a sequence appends to (``blk [tokens]`` of sequence ``seq [tokens]``) is in
    no other sequence's used table entries (``used [B, max_blocks]``, ``check_table_data``):
    sharing is for read-only blocks (a common prefix), else the append overwrites the other
    sequence's history."""
    owner = torch.arange(table.shape[0])[:, None].expand_as(table)
    ids, seqs = table[used].to(torch.int64), owner[used]  # entries checked in [0, num_blocks)
    if ids.numel() == 0:
        return
    pairs = torch.unique(ids * table.shape[0] + seqs)  # distinct (block, sequence) pairs
    users = torch.bincount(pairs // table.shape[0], minlength=int(blk.max()) + 1)  # per block
    shared = users[blk] > 1  # [tokens]: the token appends to a block another sequence uses
    if shared.any():
        (t,) = _first_true(shared)
        b_blk, b_seq = int(blk[t]), int(seq[t])
        other = int(seqs[(ids == b_blk) & (seqs != b_seq)][0])
        raise ValueError(
            f"block_table: sequence {b_seq} appends to block {b_blk}, which sequence {other} "
            "also uses; sequences may share only blocks none of them appends to"
        )


def check_table_data(
    total: torch.Tensor,
    table: torch.Tensor,
    *,
    block_size: int,
    num_blocks: int,
    lengths: str,
    past: torch.Tensor | None = None,
    new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every sequence fits the table and its needed entries are blocks in [0, num_blocks).
    Returns the mask of those needed entries, ``[B, max_blocks]`` bool.

    total: int64 [B] tokens per sequence (host); table: int32 [B, max_blocks] (host);
    ``lengths`` names the lengths in messages (formatted with b, past, new, total).
    """

    def what(b: int) -> str:
        p = 0 if past is None else int(past[b])
        n = 0 if new is None else int(new[b])
        return lengths.format(b=b, past=p, new=n, total=int(total[b]))

    capacity = table.shape[1] * block_size
    if (total > capacity).any():
        (b,) = _first_true(total > capacity)
        raise ValueError(
            f"{what(b)} = {int(total[b])} tokens exceed the block_table's capacity "
            f"max_blocks * block_size = {table.shape[1]} * {block_size} = {capacity}"
        )
    needed = (total + block_size - 1) // block_size  # [B]
    cols = torch.arange(table.shape[1])
    used = cols[None, :] < needed[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, i = _first_true(bad)
        raise ValueError(
            f"block_table[{b}, {i}] = {int(table[b, i])} must be a block index in "
            f"[0, {num_blocks}) (sequence {b} has {int(total[b])} tokens, needs "
            f"{int(needed[b])} blocks); padding (e.g. -1) is allowed only past the needed blocks"
        )
    return used


def _check_distinct(name: str, slot: torch.Tensor, block_size: int) -> None:
    uniq, counts = torch.unique(slot, return_counts=True)
    if (counts > 1).any():
        s = int(uniq[counts > 1][0])
        raise ValueError(
            f"{name}: several new tokens write the same cache slot (block {s // block_size}, "
            f"row {s % block_size}); sequences that append must not share a block"
        )


def check_slot_mapping_data(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """slot < num_blocks * block_size (negative = skip), valid slots distinct (host sync)."""
    slot = slot_mapping.to(torch.int64).cpu()
    n = num_blocks * block_size
    if (slot >= n).any():
        (i,) = _first_true(slot >= n)
        raise ValueError(
            f"slot_mapping[{i}] = {int(slot[i])} must be < num_blocks * block_size = {n} "
            "(negative entries mean 'skip this token')"
        )
    _check_distinct("slot_mapping", slot[slot >= 0], block_size)


def check_float(name: str, t: object, **kw) -> torch.Tensor:
    return check_tensor(name, t, dtypes=FLOAT_DTYPES, **kw)

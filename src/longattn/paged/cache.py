"""``PagedKVCache``: block allocator + per-layer paged K/V caches for :func:`paged_attention`."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._common import check_positive_int
from ._validate import CACHE_DTYPES

PAD_BLOCK = -1  # block_table padding; the ops never read or write entries past a sequence's blocks


class OutOfBlocksError(RuntimeError):
    """Raised by :meth:`PagedKVCache.extend` when the free list cannot cover the request."""


class PagedStep(NamedTuple):
    """The batch description of one step, ready for :func:`paged_attention` (all int32 on the
    cache's device, except ``slot_mapping``: int64, for :func:`reshape_and_cache`)."""

    cu_seqlens: torch.Tensor  # [B + 1] prefix sum of the new tokens
    past_seqlens: torch.Tensor  # [B] lengths before this step
    block_table: torch.Tensor  # [B, max_blocks], padded with -1
    slot_mapping: torch.Tensor  # [tokens] int64 slot of every new token
    num_tokens: int  # total new tokens (host int)


def _as_list(x: int | Sequence[int]) -> list[int]:
    """Token counts as host ints: an int-like scalar (int, numpy integer, 0-d integer tensor)
    or a sequence of them; anything else (a float count) is a TypeError naming num_tokens."""

    def one(v) -> int:
        try:
            return operator.index(v)
        except TypeError:
            raise TypeError(f"num_tokens must hold ints, got {type(v).__name__}") from None

    if isinstance(x, torch.Tensor) and x.dim() > 0:
        return [one(v) for v in x.tolist()]
    if isinstance(x, Sequence):
        return [one(v) for v in x]
    return [one(x)]


class PagedKVCache:
    """A paged KV cache: ``num_layers`` pairs of ``[num_blocks, block_size, KV, H]`` tensors
    sharing one block allocator.

    Each sequence owns a list of blocks; position ``pos`` of a sequence lives in its block
    ``pos // block_size``, row ``pos % block_size``. :meth:`extend` reserves room for new tokens
    (allocating blocks as needed) and returns the step's batch description, whose
    ``past_seqlens`` are the lengths **before** the step - exactly what :func:`paged_attention`
    takes; the op then writes the new tokens into the reserved slots. :meth:`past_seqlens`
    always reports the current lengths (after the last ``extend``), i.e. the ``past`` of the
    next step.

    ``block_table`` rows are padded with ``-1`` past a sequence's blocks. The ops never read or
    write a padding entry (a padding entry where a block is needed is a ``ValueError`` when the
    op validates).

    Example (prefill two prompts, then decode one token per step)::

        cache = PagedKVCache(num_blocks=256, block_size=16, num_layers=L, kv_num_heads=KV,
                             head_size=H, dtype=torch.float16, device="cuda")
        cache.add_sequence("a"); cache.add_sequence("b")
        ids, new = ["a", "b"], [prompt_a_len, prompt_b_len]
        while generating:
            step = cache.extend(ids, new)          # reserve the slots, lengths before the step
            for layer in range(L):
                out = paged_attention(q[layer], k[layer], v[layer],
                                      cache.key_cache(layer), cache.value_cache(layer),
                                      step.cu_seqlens, step.past_seqlens, step.block_table,
                                      num_heads=N, kv_num_heads=KV)
            new = [1, 1]
        cache.free("a")                             # its blocks go back to the free list

    Args:
        num_blocks, block_size: blocks in the pool and rows per block.
        num_layers: number of (key, value) cache pairs.
        kv_num_heads, head_size: KV and H of the cache layout.
        dtype: cache dtype (fp32/fp16/bf16/int8; int8 needs ``k_scale/v_scale`` at the op).
        device: where the caches (and the tensors this class returns) live.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        kv_num_heads: int,
        head_size: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_layers", num_layers), ("kv_num_heads", kv_num_heads),
                        ("head_size", head_size)):  # fmt: skip
            check_positive_int(name, v)
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype must be one of {CACHE_DTYPES}, got {dtype}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_layers, self.kv_num_heads, self.head_size = num_layers, kv_num_heads, head_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_blocks, block_size, kv_num_heads, head_size)
        self._k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> lowest first
        self._blocks: dict[object, list[int]] = {}
        self._lens: dict[object, int] = {}

    # -- bookkeeping -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list:
        return list(self._blocks)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._blocks

    def _check_known(self, seq_id) -> None:
        if seq_id not in self._blocks:
            raise KeyError(f"unknown sequence {seq_id!r} (add_sequence it first)")

    def add_sequence(self, seq_id) -> None:
        """Register an empty sequence (no blocks until :meth:`extend`)."""
        if seq_id in self._blocks:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self._blocks[seq_id] = []
        self._lens[seq_id] = 0

    def seqlen(self, seq_id) -> int:
        self._check_known(seq_id)
        return self._lens[seq_id]

    def blocks(self, seq_id) -> list[int]:
        """A copy of the sequence's block list (block i holds positions i*bs .. (i+1)*bs-1)."""
        self._check_known(seq_id)
        return list(self._blocks[seq_id])

    def _blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def extend(self, seq_ids, num_tokens) -> PagedStep:
        """Reserve ``num_tokens[i]`` new positions for ``seq_ids[i]`` (ints or sequences) and
        return the step's :class:`PagedStep` (``past_seqlens`` = lengths before the step).

        All or nothing: if the free blocks cannot cover every sequence, raises
        :class:`OutOfBlocksError` and changes nothing.
        """
        ids = [seq_ids] if not isinstance(seq_ids, (list, tuple)) else list(seq_ids)
        counts = _as_list(num_tokens)
        if len(counts) == 1 and len(ids) > 1:
            counts = counts * len(ids)
        if len(counts) != len(ids):
            raise ValueError(f"num_tokens has {len(counts)} entries for {len(ids)} sequences")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be distinct, got {ids}")
        for s, n in zip(ids, counts):
            self._check_known(s)
            if n < 0:
                raise ValueError(f"num_tokens must be >= 0, got {n} for sequence {s!r}")
        past = [self._lens[s] for s in ids]
        extra = [
            self._blocks_for(p + n) - len(self._blocks[s]) for s, p, n in zip(ids, past, counts)
        ]
        need = sum(max(e, 0) for e in extra)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"extend needs {need} more blocks of {self.block_size} rows but only "
                f"{len(self._free)} of {self.num_blocks} are free; nothing was allocated "
                f"(free finished sequences or build the cache with more blocks)"
            )
        for s, p, n, e in zip(ids, past, counts, extra):
            for _ in range(max(e, 0)):
                self._blocks[s].append(self._free.pop())
            self._lens[s] = p + n
        table = self.block_table(ids)
        cu = torch.zeros(len(ids) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
        slots = [
            self._blocks[s][j // self.block_size] * self.block_size + j % self.block_size
            for s, p, n in zip(ids, past, counts)
            for j in range(p, p + n)
        ]
        return PagedStep(
            cu_seqlens=cu.to(self.device),
            past_seqlens=torch.tensor(past, dtype=torch.int32, device=self.device),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_tokens=sum(counts),
        )

    def free(self, seq_id) -> None:
        """Forget the sequence; its blocks return to the free list (reused by later extends)."""
        self._check_known(seq_id)
        self._free.extend(reversed(self._blocks.pop(seq_id)))
        del self._lens[seq_id]

    # -- tensors for the ops ---------------------------------------------------------------

    def block_table(self, seq_ids, max_blocks: int | None = None) -> torch.Tensor:
        """int32 ``[B, max_blocks]`` block table (rows padded with ``-1``) on the cache's device.

        ``max_blocks`` defaults to the longest block list of ``seq_ids`` (at least 1); give a
        fixed width (e.g. for CUDA graphs) that is at least that.
        """
        ids = [seq_ids] if not isinstance(seq_ids, (list, tuple)) else list(seq_ids)
        for s in ids:
            self._check_known(s)
        longest = max([len(self._blocks[s]) for s in ids] + [1])
        width = longest if max_blocks is None else int(max_blocks)
        if width < longest:
            raise ValueError(f"max_blocks = {width} < {longest} blocks held by a sequence")
        table = torch.full((len(ids), width), PAD_BLOCK, dtype=torch.int32)
        for i, s in enumerate(ids):
            blk = self._blocks[s]
            if blk:
                table[i, : len(blk)] = torch.tensor(blk, dtype=torch.int32)
        return table.to(self.device)

    def past_seqlens(self, seq_ids) -> torch.Tensor:
        """int32 ``[B]`` current lengths (tokens reserved so far) on the cache's device."""
        ids = [seq_ids] if not isinstance(seq_ids, (list, tuple)) else list(seq_ids)
        for s in ids:
            self._check_known(s)
        return torch.tensor([self._lens[s] for s in ids], dtype=torch.int32, device=self.device)

    def key_cache(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, KV, H]`` key cache of ``layer`` (updated in place)."""
        return self._k[layer]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self._v[layer]

"""SparseAttentionIndexer (QSA block selection) and the incremental indexer block-key cache.

Indexer keys are single-headed (one key ``[index_head_dim]`` per token, shared by all indexer
query heads). Block ``c`` covers positions ``c*r .. c*r + r - 1``; its key is
``rope(rms_norm(mean(raw keys of the block), norm_weight), position c*r)`` (split-half RoPE),
stored in fp32.
"""

from __future__ import annotations

import torch

from .. import _cascade
from .._common import (
    FLOAT_DTYPES,
    call_op,
    check_bool,
    check_nonneg_int,
    check_positive_int,
    check_rotary_caches,
    check_tensor,
    data_checks_allowed,
    host_ranges,
    resolve_scale,
)
from .._rotary import apply_rotary, rms_norm
from .chunked import indexer_chunked
from .reference import indexer_reference

OP_NAME = "sparse_attention_indexer"
_FLOATS = (*FLOAT_DTYPES, torch.float64)

__all__ = [
    "IndexBlockKeyCache",
    "index_block_keys_from_keys",
    "sparse_attention_indexer",
]


# ---------------------------------------------------------------------------------------------
# Block keys.


def _finalize_block_keys(
    block_sums: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    compress_ratio: int,
    norm_weight: torch.Tensor | None,
    epsilon: float,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    rotary_offset: int,
) -> torch.Tensor:
    """``block_sums [..., DI]`` (sum of a block's r raw keys) of blocks ``block_ids [...]`` ->
    block keys ``[..., DI]``: mean, RMSNorm, split-half RoPE at the block's first position."""
    y = block_sums / compress_ratio
    if norm_weight is not None:
        y = rms_norm(y, norm_weight, epsilon)
    if cos_cache is not None:
        pos = (block_ids.to(torch.int64) * compress_ratio).clamp(0, cos_cache.shape[0] - 1)
        cos = cos_cache[pos].to(y.dtype)
        sin = sin_cache[pos].to(y.dtype)
        y = apply_rotary(y, cos, sin, interleaved=False, rotary_offset=rotary_offset)
    return y


def _check_block_key_params(head_dim, norm_weight, cos_cache, sin_cache, rotary_offset, device):
    """Validate the block-key parameters (the cos/sin rows: ``_check_rotary_rows``)."""
    check_nonneg_int("rotary_offset", rotary_offset)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, dtypes=_FLOATS, shape=(head_dim,), device=device)
    if (cos_cache is None) != (sin_cache is None):
        raise ValueError("cos_cache and sin_cache must be given together (or neither)")
    if cos_cache is not None:
        check_rotary_caches(
            cos_cache, sin_cache, device=device, max_dim=head_dim - rotary_offset,
            dtypes=_FLOATS, contiguous_last=False,
            bound=f"[2, index_head_dim - rotary_offset] = [2, {head_dim} - {rotary_offset}]",
        )  # fmt: skip


def _check_rotary_rows(cos_cache, num_blocks: int, compress_ratio: int, what: str) -> None:
    """The cos/sin caches must hold the first position ``(num_blocks - 1) * r`` of the last
    complete block (incomplete blocks' keys are never read: their positions are clamped)."""
    need = (num_blocks - 1) * compress_ratio + 1
    if cos_cache is not None and num_blocks > 0 and cos_cache.shape[0] < need:
        raise ValueError(
            f"cos_cache/sin_cache have {cos_cache.shape[0]} rows; {what} needs {need} (block "
            f"{num_blocks - 1} starts at position {need - 1})"
        )


def index_block_keys_from_keys(
    index_keys: torch.Tensor,
    *,
    compress_ratio: int,
    norm_weight: torch.Tensor | None = None,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    rotary_offset: int = 0,
) -> torch.Tensor:
    """Block keys of every complete block, from scratch.

    Args:
        index_keys: ``[B, T, index_head_dim]`` raw indexer keys (any float dtype), token t at
            position t.
        compress_ratio: r, tokens per block.
        norm_weight: ``[index_head_dim]`` RMSNorm weight (None: no norm).
        cos_cache, sin_cache: ``[max_pos, rotary_dim/2]`` (None: no RoPE); split-half RoPE on
            channels ``rotary_offset .. rotary_offset + rotary_dim`` at position ``c * r`` (the
            caches must hold position ``(T // r - 1) * r``).
        epsilon: RMSNorm epsilon (with ``norm_weight``).
        rotary_offset: first rotated channel, ``>= 0``.

    Returns:
        ``[B, T // r, index_head_dim]`` fp32 (fp64 for fp64 keys).
    """
    check_tensor("index_keys", index_keys, dtypes=_FLOATS, ndim=3)
    r = check_positive_int("compress_ratio", compress_ratio)
    b, t, d = index_keys.shape
    _check_block_key_params(d, norm_weight, cos_cache, sin_cache, rotary_offset, index_keys.device)
    _check_rotary_rows(cos_cache, t // r, r, f"index_keys of {t} tokens")
    dtype = torch.float64 if index_keys.dtype == torch.float64 else torch.float32
    nb = t // r
    sums = index_keys[:, : nb * r].to(dtype).reshape(b, nb, r, d).sum(2)
    ids = torch.arange(nb, device=index_keys.device).expand(b, nb)
    return _finalize_block_keys(
        sums,
        ids,
        compress_ratio=r,
        norm_weight=norm_weight,
        epsilon=epsilon,
        cos_cache=cos_cache,
        sin_cache=sin_cache,
        rotary_offset=rotary_offset,
    )


class IndexBlockKeyCache:
    """Per-sequence indexer block keys, updated incrementally as raw indexer keys arrive.

    State (all on ``device``):

    - ``block_keys [B, max_blocks, index_head_dim]`` fp32: the keys of complete blocks (what
      :func:`sparse_attention_indexer` reads). Rows of incomplete blocks hold unspecified
      values (the indexer never reads them).
    - ``block_sums [B, max_blocks, index_head_dim]`` fp32: running sum of each block's raw keys.
    - ``lengths [B]`` int64: tokens appended so far per sequence.

    ``append`` is sync-free (scatter-add into the sums, then the touched blocks' keys are
    recomputed from their sums), so it can live inside a CUDA graph; a decode step touches one
    block. The indexer then reads ``O(T / r)`` block keys per query.

    Args (constructor):
        batch_size, max_tokens, index_head_dim: B, the most tokens a sequence may hold, DI.
            State is sized ``max_blocks = max_tokens // compress_ratio + 1`` blocks per
            sequence (the trailing partial block included).
        compress_ratio: r, tokens per block (keyword-only, required).
        norm_weight, cos_cache, sin_cache, epsilon, rotary_offset: as in
            :func:`index_block_keys_from_keys` (cos/sin must hold the last complete block's
            first position ``(max_tokens // r - 1) * r``).
        device: where the state lives (default: norm_weight's device, else CPU).
    """

    def __init__(
        self,
        batch_size: int,
        max_tokens: int,
        index_head_dim: int,
        *,
        compress_ratio: int,
        norm_weight: torch.Tensor | None = None,
        cos_cache: torch.Tensor | None = None,
        sin_cache: torch.Tensor | None = None,
        epsilon: float = 1e-6,
        rotary_offset: int = 0,
        device: torch.device | str | None = None,
    ):
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_tokens", max_tokens)
        check_positive_int("index_head_dim", index_head_dim)
        self.compress_ratio = check_positive_int("compress_ratio", compress_ratio)
        if device is None:
            device = norm_weight.device if norm_weight is not None else "cpu"
        device = torch.device(device)
        _check_block_key_params(
            index_head_dim, norm_weight, cos_cache, sin_cache, rotary_offset, device
        )
        _check_rotary_rows(cos_cache, max_tokens // compress_ratio, compress_ratio,
                           f"max_tokens={max_tokens}")  # fmt: skip
        self.max_blocks = max_tokens // compress_ratio + 1  # + the trailing partial block
        self.norm_weight = norm_weight
        self.cos_cache, self.sin_cache = cos_cache, sin_cache
        self.epsilon = float(epsilon)
        self.rotary_offset = rotary_offset
        self.max_tokens = max_tokens
        shape = (batch_size, self.max_blocks, index_head_dim)
        self.block_sums = torch.zeros(shape, dtype=torch.float32, device=device)
        self.block_keys = torch.zeros(shape, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self._appended_bound = 0  # host-side upper bound of max(lengths)

    def reset(self) -> None:
        self.block_sums.zero_()
        self.block_keys.zero_()
        self.lengths.zero_()
        self._appended_bound = 0

    def append(self, index_keys: torch.Tensor, num_new: torch.Tensor | None = None) -> None:
        """Append raw keys ``index_keys [B, S, index_head_dim]`` (any float dtype).

        Token s of sequence b goes to position ``lengths[b] + s``; with ``num_new [B]`` (int)
        only the first ``num_new[b]`` tokens of sequence b are real (the rest is padding);
        ``num_new`` is clamped to ``[0, S]`` on the device (checking it would sync).
        Raises ``ValueError`` (eager mode) when a sequence would exceed ``max_tokens``.
        """
        b, nb, d = self.block_sums.shape
        check_tensor(
            "index_keys", index_keys, dtypes=_FLOATS, shape=(b, None, d), device=self.lengths.device
        )
        s = index_keys.shape[1]
        r = self.compress_ratio
        ar = torch.arange(s, device=index_keys.device, dtype=torch.int64)
        if num_new is None:
            valid = torch.ones((b, s), dtype=torch.bool, device=index_keys.device)
            added = torch.full((b,), s, dtype=torch.int64, device=index_keys.device)
        else:
            check_tensor(
                "num_new",
                num_new,
                dtypes=(torch.int32, torch.int64),
                shape=(b,),
                device=self.lengths.device,
            )
            added = num_new.to(torch.int64).clamp(0, s)
            valid = ar[None, :] < added[:, None]
        self._appended_bound += s
        if self._appended_bound > self.max_tokens and data_checks_allowed(self.lengths):
            most = int((self.lengths + added).max())
            if most > self.max_tokens:
                raise ValueError(
                    f"IndexBlockKeyCache.append: a sequence would hold {most} tokens > "
                    f"max_tokens={self.max_tokens}"
                )
        pos = self.lengths[:, None] + ar  # [B, S]
        blk = (pos // r).clamp(max=nb - 1)
        idx = blk[..., None].expand(b, s, d)
        add = torch.where(valid[..., None], index_keys.to(torch.float32), 0.0)
        self.block_sums.scatter_add_(1, idx, add)
        keys = _finalize_block_keys(
            self.block_sums.gather(1, idx),
            blk,
            compress_ratio=r,
            norm_weight=self.norm_weight,
            epsilon=self.epsilon,
            cos_cache=self.cos_cache,
            sin_cache=self.sin_cache,
            rotary_offset=self.rotary_offset,
        )
        self.block_keys.scatter_(1, idx, keys)  # duplicates of a block carry equal values
        self.lengths += added

    def complete_blocks(self) -> torch.Tensor:
        """``[B]`` int64: complete blocks per sequence (``lengths // r``)."""
        return self.lengths // self.compress_ratio


# ---------------------------------------------------------------------------------------------
# The indexer op.


def gates(index_query: torch.Tensor, index_block_keys: torch.Tensor | None = None):
    def triton_gate(explicit: bool):
        if index_block_keys is None:
            return False, "triton gate needs the block keys"
        from .triton import indexer_unsupported

        why = indexer_unsupported(index_query, index_block_keys)
        if why:
            return False, why
        dtypes = (index_query.dtype, index_block_keys.dtype)
        ok, reason = _cascade.triton_device_gate(index_query.device, dtypes, explicit)
        if not ok:
            return ok, reason
        try:
            from .triton.indexer import indexer_triton  # noqa: F401
        except Exception as exc:  # pragma: no cover - depends on the install
            return False, f"the sparse triton tier failed to import ({type(exc).__name__}: {exc})"
        return True, reason

    return {"triton": triton_gate, "chunked": _cascade.always, "reference": _cascade.always}


def _run(
    index_query,
    index_block_keys,
    seqlens_k,
    num_index_heads,
    compress_ratio,
    token_budget,
    scale,
    is_first_prompt,
    backend,
    tier=None,
):
    """The tier ``backend`` selects (``tier``: one the caller already selected) on the inputs."""
    if tier is None:
        tier = _cascade.select_backend(OP_NAME, backend, gates(index_query, index_block_keys))
    kw = dict(
        num_index_heads=num_index_heads,
        compress_ratio=compress_ratio,
        token_budget=token_budget,
        scale=scale,
        is_first_prompt=is_first_prompt,
    )
    if tier == "triton":
        from .triton.indexer import indexer_triton

        return indexer_triton(index_query, index_block_keys, seqlens_k, **kw)
    if tier == "chunked":
        return indexer_chunked(index_query, index_block_keys, seqlens_k, **kw)
    return indexer_reference(index_query, index_block_keys, seqlens_k, **kw)


def _indexer_op_impl(
    index_query: torch.Tensor,
    index_block_keys: torch.Tensor,
    seqlens_k: torch.Tensor,
    num_index_heads: int,
    compress_ratio: int,
    token_budget: int,
    scale: float,
    is_first_prompt: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(
        index_query,
        index_block_keys,
        seqlens_k,
        num_index_heads,
        compress_ratio,
        token_budget,
        scale,
        is_first_prompt,
        backend,
    )


_indexer_op = torch.library.custom_op("longattn::sparse_attention_indexer", mutates_args=())(
    _indexer_op_impl
)


@_indexer_op.register_fake
def _(
    index_query,
    index_block_keys,
    seqlens_k,
    num_index_heads,
    compress_ratio,
    token_budget,
    scale,
    is_first_prompt,
    backend,
):
    rows = index_query.shape[0] * index_query.shape[1]
    m = token_budget + compress_ratio - 1
    return (
        index_query.new_empty((rows, m), dtype=torch.int32),
        index_query.new_empty((rows,), dtype=torch.int32),
    )


def sparse_attention_indexer(
    index_query: torch.Tensor,
    index_block_keys: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    compress_ratio: int,
    token_budget: int,
    scale: float | None = None,
    total_sequence_length: int | None = None,
    validate: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """QSA block selection (ORT ``SparseAttentionIndexer``) -> selected token positions.

    Query row ``(b, s)`` (row ``b*S + s``) sits at ``qpos = seqlens_k[b] + 1 - S + s``; with
    ``total_sequence_length == S`` (first prompt) ``qpos = s`` and rows ``s > seqlens_k[b]``
    are right padding (count 0). Block ``c`` is visible when complete (``c*r + r - 1 <= qpos``);
    its score is ``scale * sum_h relu(q_h . k_c)`` in fp32. The top
    ``min(token_budget // r, visible)`` blocks are chosen (ties: lower block index).

    Args:
        index_query: ``[B, S, num_index_heads * index_head_dim]`` bf16/fp16/fp32 (fp64 for test
            oracles), used as given (apply the indexer's own query norm/RoPE before).
        index_block_keys: ``[B, num_blocks, index_head_dim]`` block keys (fp32 recommended, as
            :class:`IndexBlockKeyCache` stores them; read in fp32); ``num_blocks`` must cover
            the complete blocks of the longest sequence. ``num_index_heads`` is
            ``index_query.shape[-1] // index_head_dim``.
        seqlens_k: ``[B]`` int32, total length minus one.
        compress_ratio: r, tokens per block.
        token_budget: selected tokens from complete blocks are at most ``token_budget``.
        scale: score scale; default ``index_head_dim ** -0.5``.
        total_sequence_length: max total length over the batch (host int): recognizes the first
            prompt (``== S``) and bounds the blocks that are scored (``total // r``: a cache
            sized for a longer context costs nothing extra). None: the subsequent-prompt rule
            for all rows, every block of ``index_block_keys`` scored.
        validate: ``True`` (default) checks seqlens_k's *values* on the host (one small read,
            which **synchronizes with the device**); skipped under torch.compile tracing and
            CUDA-graph capture. Pass ``False`` on hot eager decode paths. Unchecked values
            never read outside ``index_block_keys`` (blocks past its end are not visible), but
            the selection is then undefined. Shape/dtype errors are always raised.
        backend: "auto", "triton", "chunked" or "reference".

    Returns:
        ``selected_indices [B*S, token_budget + r - 1]`` int32: the chosen blocks' positions in
        ascending order, then the trailing incomplete block's positions
        ``(qpos+1)//r*r .. qpos``, then -1 padding (so the whole row is ascending); and
        ``selected_counts [B*S]`` int32.
    """
    return call_op(_indexer_op, _indexer_op_impl, *_prepare(**locals()))


def _prepare(
    index_query: torch.Tensor,
    index_block_keys: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    compress_ratio: int,
    token_budget: int,
    scale: float | None = None,
    total_sequence_length: int | None = None,
    validate: bool = True,
    backend: str = "auto",
) -> tuple:
    """``sparse_attention_indexer``'s checks: the op's arguments."""
    _cascade.check_backend_name(backend)
    check_tensor("index_query", index_query, dtypes=_FLOATS, ndim=3, contiguous_last=True)
    b, s, dq = index_query.shape
    dev = index_query.device
    check_tensor("index_block_keys", index_block_keys, dtypes=_FLOATS, ndim=3, device=dev)
    check_tensor("index_block_keys", index_block_keys, shape=(b, None, None), contiguous_last=True)
    di = index_block_keys.shape[2]
    if di == 0 or dq % di:
        raise ValueError(
            f"index_query.shape[-1] = {dq} must be num_index_heads * index_head_dim "
            f"(index_head_dim = index_block_keys.shape[-1] = {di})"
        )
    check_tensor(
        "seqlens_k", seqlens_k, dtypes=(torch.int32,), shape=(b,), device=dev, contiguous_last=True
    )
    r = check_positive_int("compress_ratio", compress_ratio)
    budget = check_positive_int("token_budget", token_budget)
    scale = resolve_scale(scale, di**-0.5, "index_head_dim ** -0.5")
    nb = index_block_keys.shape[1]
    if total_sequence_length is not None:
        check_positive_int("total_sequence_length", total_sequence_length)
        if s > total_sequence_length:
            raise ValueError(
                f"S = {s} new tokens exceed total_sequence_length = {total_sequence_length}"
            )
        if nb < total_sequence_length // r:
            raise ValueError(
                f"index_block_keys has {nb} blocks < total_sequence_length // compress_ratio = "
                f"{total_sequence_length // r}"
            )
    check_bool("validate", validate)
    if validate and b and data_checks_allowed(seqlens_k):
        ((lo, hi),) = host_ranges(seqlens_k)
        if lo < 0 or (hi + 1) // r > nb:
            raise ValueError(
                f"seqlens_k must lie in [0, {nb * r + r - 2}] (index_block_keys holds {nb} "
                f"blocks of {r}); got min {lo} max {hi}"
            )
        if total_sequence_length is not None and hi + 1 > total_sequence_length:
            raise ValueError(
                f"seqlens_k + 1 must be <= total_sequence_length = {total_sequence_length}, "
                f"got max {hi + 1}"
            )
    first = total_sequence_length is not None and s == total_sequence_length
    if total_sequence_length is not None:
        # No row sees a complete block at or past total // r: score and select only those
        # (a cache sized for the longest context holds many more, and one block more than
        # a power of two doubles the select kernel's register tile)
        index_block_keys = index_block_keys[:, : total_sequence_length // r]
    return (
        index_query,
        index_block_keys,
        seqlens_k,
        dq // di,
        r,
        budget,
        float(scale),
        first,
        backend,
    )

"""Public sparse attention layer: SparseAttentionIndexer + DynamicSparseAttention (QSA) in one
call, so the Triton tier can run the attention prologue beside the select kernel (one launch
fewer per decode step than the two ops, same results)."""

from __future__ import annotations

import inspect

import torch

from .. import _cascade
from .._common import call_op
from . import api as _dsa
from . import indexer as _indexer

OP_NAME = "sparse_attention_layer"

__all__ = ["sparse_attention_layer"]


def _layer_op_impl(
    index_query: torch.Tensor,
    index_block_keys: torch.Tensor,
    num_index_heads: int,
    compress_ratio: int,
    token_budget: int,
    index_scale: float,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    head_size: int,
    scale: float,
    local_window_size: int,
    attention_mode: str,
    selected_kv_source: str,
    do_rotary: bool,
    rotary_interleaved: bool,
    rotary_offset: int,
    smooth_softmax: bool,
    qk_norm_epsilon: float,
    auxiliary_kv_shared: bool,
    is_first_prompt: bool,
    total_sequence_length: int,
    query_dtype: torch.dtype | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = _dsa.dsa_params(locals())
    ig = _indexer.gates(index_query, index_block_keys)
    itier = _cascade.select_backend(_indexer.OP_NAME, backend, ig)
    dg = _dsa.gates(query, key, value, present_key, None, None, p)
    dtier = _cascade.select_backend(_dsa.OP_NAME, backend, dg)
    idx_kw = (num_index_heads, compress_ratio, token_budget, index_scale, is_first_prompt)
    if itier == dtier == "triton":
        from .triton.layer import layer_unfusable, sparse_layer_triton

        if layer_unfusable(p, index_block_keys.shape[1]) is None:
            return sparse_layer_triton(
                index_query, index_block_keys, query, key, value, present_key, present_value,
                seqlens_k, p, num_index_heads=num_index_heads, compress_ratio=compress_ratio,
                token_budget=token_budget, index_scale=index_scale,
            )  # fmt: skip
    sel, cnt = _indexer._run(index_query, index_block_keys, seqlens_k, *idx_kw, backend,
                             tier=itier)  # fmt: skip
    out = _dsa._run(query, key, value, present_key, present_value, None, None, sel, cnt,
                    seqlens_k, p, backend, tier=dtier)  # fmt: skip
    return out, sel, cnt


_LAYER_PARAMS = tuple(inspect.signature(_layer_op_impl).parameters)
_DSA_PARAMS = tuple(inspect.signature(_dsa._dsa_op_impl).parameters)
_INDEXER_PARAMS = tuple(inspect.signature(_indexer._indexer_op_impl).parameters)

_layer_op = torch.library.custom_op(
    "longattn::sparse_attention_layer", mutates_args=("present_key", "present_value")
)(_layer_op_impl)


@_layer_op.register_fake
def _(index_query, index_block_keys, num_index_heads, compress_ratio, token_budget, index_scale,
      query, *args):  # fmt: skip
    # args follow _layer_op_impl from key: num_heads = args[13], head_size = args[15]
    num_heads, head_size = args[13], args[15]
    b, s = query.shape[:2]
    m = token_budget + compress_ratio - 1
    return (
        query.new_empty((b, s, num_heads * head_size)),
        query.new_empty((b * s, m), dtype=torch.int32),
        query.new_empty((b * s,), dtype=torch.int32),
    )


def sparse_attention_layer(
    index_query: torch.Tensor,
    index_block_keys: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    *,
    seqlens_k: torch.Tensor,
    total_sequence_length: int,
    num_heads: int,
    kv_num_heads: int,
    compress_ratio: int,
    token_budget: int,
    index_scale: float | None = None,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    head_sink: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    do_rotary: bool = False,
    rotary_interleaved: bool = False,
    rotary_offset: int = 0,
    qk_norm_epsilon: float = 1e-6,
    smooth_softmax: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
    query_dtype: torch.dtype | None = None,
    validate: bool | str = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One QSA sparse attention layer: ``sparse_attention_indexer`` then
    ``dynamic_sparse_attention`` (selected_only mode over the main cache) on its selection, as
    one op. Results equal the two calls::

        sel, cnt = sparse_attention_indexer(index_query, index_block_keys, seqlens_k,
            compress_ratio=..., token_budget=..., scale=index_scale,
            total_sequence_length=total_sequence_length)
        out, pk, pv = dynamic_sparse_attention(query, key, value, past_key, past_value,
            selected_indices=sel, selected_counts=cnt, seqlens_k=seqlens_k, ...)

    The Triton tier runs them in four launches instead of five: the attention prologue
    (QK-norm + rotary of Q and the new K, K/V append) runs beside the select kernel instead
    of after it. Where that tier cannot (another tier, ``rotary_offset != 0``, more than
    ``select.MAX_BLOCKS`` blocks) the two ops' tiers run one after the other.

    Args:
        index_query, index_block_keys, compress_ratio, token_budget: as
            ``sparse_attention_indexer`` takes them (``index_query [B, S, NI*DI]``,
            ``index_block_keys [B, num_blocks, DI]``, ``num_blocks >= total_sequence_length //
            compress_ratio``); ``index_scale`` is its ``scale`` (None: ``DI ** -0.5``).
        query, key, value, past_key, past_value: as ``dynamic_sparse_attention`` takes them
            (``query [B, S, N*H]`` or packed QKV, the main cache ``[B, KV, C, H]``, written in
            place when ``C >= total_sequence_length``); ``query`` has the index query's B and S.
        seqlens_k ``[B]`` int32 (total length - 1), total_sequence_length (host int),
        num_heads, kv_num_heads and the prologue / softmax options (cos_cache ... query_dtype):
            as ``dynamic_sparse_attention``.
        validate: ``True`` / ``False`` (default): seqlens_k's range and position_ids are read
            on the host (one **device sync**; skipped under torch.compile tracing and CUDA-graph
            capture); the selection is the indexer's, never re-checked. ``"off"``: no value
            check, no sync (unchecked values never read or write outside the caches, the
            result is then undefined).
        backend: "auto", "triton", "chunked" or "reference", for both ops.

    Returns:
        ``(output [B, S, N*H] in query's dtype, present_key, present_value,
        selected_indices [B*S, token_budget + compress_ratio - 1] int32,
        selected_counts [B*S] int32)``.
    """
    _cascade.check_backend_name(backend)
    if not isinstance(validate, bool) and validate != "off":
        raise ValueError(f'validate must be True, False or "off", got {validate!r}')
    iargs = _indexer._prepare(
        index_query, index_block_keys, seqlens_k, compress_ratio=compress_ratio,
        token_budget=token_budget, scale=index_scale,
        total_sequence_length=total_sequence_length, validate=False, backend=backend,
    )  # fmt: skip
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be [B, S, N*H], got {got}")
    b, s = index_query.shape[:2]
    if tuple(query.shape[:2]) != (b, s):
        raise ValueError(
            f"query [B, S, ...] = {tuple(query.shape)} must have index_query's B and S ({b}, {s})"
        )
    # the selection's shapes for DSA's checks (the indexer fills it later): no allocation
    one = seqlens_k.new_empty(())
    dargs, present_key, present_value = _dsa._prepare(
        query, key, value, past_key, past_value,
        selected_indices=one.expand(b * s, token_budget + compress_ratio - 1),
        selected_counts=one.expand(b * s),
        seqlens_k=seqlens_k, total_sequence_length=total_sequence_length, num_heads=num_heads,
        kv_num_heads=kv_num_heads, cos_cache=cos_cache, sin_cache=sin_cache,
        position_ids=position_ids, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
        head_sink=head_sink, k_scale=k_scale, v_scale=v_scale, scale=scale, do_rotary=do_rotary,
        rotary_interleaved=rotary_interleaved, rotary_offset=rotary_offset,
        qk_norm_epsilon=qk_norm_epsilon, smooth_softmax=smooth_softmax,
        kv_cache_dtype=kv_cache_dtype, query_dtype=query_dtype,
        validate="off" if validate == "off" else False, backend=backend, check_selection=False,
    )  # fmt: skip
    named = dict(zip(_INDEXER_PARAMS, iargs, strict=True))  # the indexer's op arguments
    named["index_scale"] = named.pop("scale")
    named.update(zip(_DSA_PARAMS, dargs, strict=True))  # DSA's (shared: seqlens_k, backend)
    out, sel, cnt = call_op(_layer_op, _layer_op_impl, *(named[k] for k in _LAYER_PARAMS))
    return out, present_key, present_value, sel, cnt

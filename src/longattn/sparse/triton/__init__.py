"""Triton tier of DynamicSparseAttention (``decode.dsa_triton``: grouped split-candidate kernel +
log-sum-exp merge, any S) and of SparseAttentionIndexer (``indexer.indexer_triton``: block
scores kernel + torch top-k with the exact tie rule).

This module stays import-light (no triton import): the gates of ``sparse/api.py`` and
``sparse/indexer.py`` call the feature checks below before the device gate; the kernels are
imported only when the tier runs.
"""

from __future__ import annotations

import torch

DSA_HEAD_SIZES = (16, 256)  # inclusive range of head sizes (padded to a power of two in-kernel)
INDEXER_HEAD_DIMS = (16, 256)  # inclusive range of index_head_dim
_OK_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _float_ok(name: str, t: torch.Tensor | None) -> str | None:
    if t is not None and t.dtype not in _OK_FLOATS and t.dtype != torch.int8:
        return f"{name} dtype {t.dtype} is not implemented by the triton kernels (fp16/bf16/fp32)"
    return None


def dsa_unsupported(
    query, key, value, present_key, auxiliary_key, auxiliary_value, p
) -> str | None:
    """Why the Triton DSA tier cannot run these inputs (None: it can). Pure python, no sync."""
    lo, hi = DSA_HEAD_SIZES
    if not lo <= p.head_size <= hi:
        return f"head_size {p.head_size} is not implemented by the triton kernels ({lo}..{hi})"
    for name, t in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("present_key", present_key),
        ("auxiliary_key", auxiliary_key),
        ("auxiliary_value", auxiliary_value),
    ):
        why = _float_ok(name, t)
        if why:
            return why
    if query.dtype == torch.int8 or (
        auxiliary_key is not None and auxiliary_key.dtype == torch.int8
    ):
        return "int8 activations/auxiliary K/V are not implemented by the triton kernels"
    if p.query_dtype is not None and p.query_dtype not in _OK_FLOATS:
        return f"query_dtype {p.query_dtype} is not implemented by the triton kernels"
    return None


def dsa_dtypes(query, key, value, present_key, auxiliary_key, auxiliary_value, p) -> tuple:
    """Every float dtype the DSA kernels touch (for ``_cascade.triton_device_gate``)."""
    ts = (query, key, value, present_key, auxiliary_key, auxiliary_value)
    out = {t.dtype for t in ts if t is not None and t.dtype.is_floating_point}
    if p.query_dtype is not None:
        out.add(p.query_dtype)
    if query.dtype == torch.bfloat16 and present_key.dtype == torch.float16:
        out.add(torch.float16)
    return tuple(sorted(out, key=str))


def indexer_unsupported(index_query, index_block_keys) -> str | None:
    """Why the Triton indexer tier cannot run these inputs (None: it can)."""
    lo, hi = INDEXER_HEAD_DIMS
    di = index_block_keys.shape[2]
    if not lo <= di <= hi:
        return f"index_head_dim {di} is not implemented by the triton kernel ({lo}..{hi})"
    for name, t in (("index_query", index_query), ("index_block_keys", index_block_keys)):
        if t.dtype not in _OK_FLOATS:
            return f"{name} dtype {t.dtype} is not implemented by the triton kernel"
    return None


__all__ = ["dsa_dtypes", "dsa_unsupported", "indexer_unsupported"]

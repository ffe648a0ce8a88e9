"""Long-context sparse attention: SparseAttentionIndexer (QSA block selection), the indexer
block-key cache, and DynamicSparseAttention (sparse GQA over selected positions)."""

from .api import dynamic_sparse_attention, validate_selection
from .indexer import IndexBlockKeyCache, index_block_keys_from_keys, sparse_attention_indexer

__all__ = [
    "IndexBlockKeyCache",
    "dynamic_sparse_attention",
    "index_block_keys_from_keys",
    "sparse_attention_indexer",
    "validate_selection",
]

"""Long-context sparse attention: SparseAttentionIndexer (QSA block selection), the indexer
block-key cache, DynamicSparseAttention (sparse GQA over selected positions), and the two as
one layer op."""

from .api import dynamic_sparse_attention, validate_selection
from .indexer import IndexBlockKeyCache, index_block_keys_from_keys, sparse_attention_indexer
from .layer import sparse_attention_layer

__all__ = [
    "IndexBlockKeyCache",
    "dynamic_sparse_attention",
    "index_block_keys_from_keys",
    "sparse_attention_indexer",
    "sparse_attention_layer",
    "validate_selection",
]

"""longattn: attention operators for long-context LLM inference (PyTorch + Triton).

Semantics follow ONNX Runtime's ``com.microsoft`` contrib operators; every op has a
``triton -> chunked -> reference`` backend cascade (see ``longattn._cascade``).
"""

from ._rotary import rope_cache
from .gqa import group_query_attention
from .paged import (
    OutOfBlocksError,
    PagedKVCache,
    PagedStep,
    compute_slot_mapping,
    gather_paged_kv,
    paged_attention,
    reshape_and_cache,
)
from .rms_norm_rotary import rms_norm_rotary
from .sparse import (
    IndexBlockKeyCache,
    dynamic_sparse_attention,
    index_block_keys_from_keys,
    sparse_attention_indexer,
    sparse_attention_layer,
)

__version__ = "0.1.0"

__all__ = [
    "IndexBlockKeyCache",
    "OutOfBlocksError",
    "PagedKVCache",
    "PagedStep",
    "__version__",
    "compute_slot_mapping",
    "dynamic_sparse_attention",
    "gather_paged_kv",
    "group_query_attention",
    "index_block_keys_from_keys",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm_rotary",
    "rope_cache",
    "sparse_attention_indexer",
    "sparse_attention_layer",
]

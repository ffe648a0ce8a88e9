"""PagedAttention (ORT ``com.microsoft.PagedAttention``) and its paged KV-cache tools."""

from .api import paged_attention
from .cache import OutOfBlocksError, PagedKVCache, PagedStep
from .kv import compute_slot_mapping, gather_paged_kv, reshape_and_cache

__all__ = [
    "OutOfBlocksError",
    "PagedKVCache",
    "PagedStep",
    "compute_slot_mapping",
    "gather_paged_kv",
    "paged_attention",
    "reshape_and_cache",
]

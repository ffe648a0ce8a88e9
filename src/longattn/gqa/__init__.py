"""GroupQueryAttention (ORT ``com.microsoft::GroupQueryAttention``) with a contiguous KV cache."""

from .api import group_query_attention

__all__ = ["group_query_attention"]

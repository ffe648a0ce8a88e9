"""Triton tier of PagedAttention: paged prologue (QK-norm + rotary + append through the block
table), one attention kernel for varlen prefill and split-K decode reading K/V through the block
table, and the log-sum-exp merge. Entry point: ``paged_attention_triton`` (called like the
chunked tier; contract in ``paged/_params.py``)."""

from .launch import SUPPORTED_HEADS, paged_attention_triton, unsupported_reason

__all__ = ["SUPPORTED_HEADS", "paged_attention_triton", "unsupported_reason"]

"""Triton tier of GroupQueryAttention: prologue (QK-norm + rotary + cache append), prefill flash
kernel, split-K decode + merge. Entry point: ``gqa_triton`` (contract in ``gqa/_params.py``)."""

from .launch import gqa_triton

__all__ = ["gqa_triton"]

"""Readable, unfused GroupQueryAttention (the reference tier and, run on fp64 inputs, the oracle).

Follows the spec literally: new K/V (after QK-norm + rotary for K) are written into the present
caches at rows ``qpos``, then every query row attends over the first ``total_sequence_length``
cache rows with one materialized ``[B, N, S, T]`` score tensor.

Precision: the math runs in fp32 (fp64 when ``query`` is fp64: tests upcast every input to fp64
and keep the real cache dtype, so the only roundings left are the cache write, which the op
really does, and none else). Q stays in the compute dtype after norm + rotary; K is rounded (or
quantized) once into the cache and read back exactly (dequantized); the output is rounded once to
the activation dtype.
"""

from __future__ import annotations

import torch

from .._attention_torch import attention_unfused
from ._params import GQAParams
from ._torch_tier import run_torch_tier


def gqa_reference(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    p: GQAParams,
) -> torch.Tensor:
    """See ``_params.py`` for the contract. Returns ``[B, S, N*H]`` in ``query``'s dtype."""
    return run_torch_tier(
        query, key, value, present_key, present_value, seqlens_k, p, attention_unfused
    )

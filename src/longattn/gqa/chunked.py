"""Memory-efficient pure-PyTorch GroupQueryAttention (the chunked tier; CPU or GPU).

Same prologue as the reference (QK-norm + rotary of Q and the new K in fp32, K/V rounded or
quantized once into the present cache), then an online softmax over key chunks of
``_attention_torch.KV_CHUNK`` keys with query rows in blocks: the ``[S, T]`` scores are never
materialized, K/V chunks are dequantized on the fly, and key chunks that the causal / window
rule hides from a whole query block are skipped using host-known bounds (no device sync:
``qpos[b, s]`` lies in ``[s, s + total_sequence_length - S]``). Q stays fp32; the output is
rounded once to the activation dtype.
"""

from __future__ import annotations

import torch

from .._attention_torch import attention_online
from ._params import GQAParams
from ._torch_tier import run_torch_tier


def gqa_chunked(
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
        query,
        key,
        value,
        present_key,
        present_value,
        seqlens_k,
        p,
        attention_online,
        qpos_offsets=(0, p.total_sequence_length - query.shape[1]),
    )

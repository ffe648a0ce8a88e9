"""The pure-torch GQA pipeline both torch tiers share: prologue (QK-norm + rotary, cache append)
then an attention core. reference.py passes the unfused core, chunked.py the online-softmax one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._attention_torch import (
    compute_dtype_for,
    prepare_from_params,
    sink_logits,
)
from ._params import GQAParams


def run_torch_tier(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    p: GQAParams,
    attend: Callable[..., torch.Tensor],
    **attend_kw,
) -> torch.Tensor:
    """See ``_params.py`` for the contract. Returns ``[B, S, N*H]`` in ``query``'s dtype."""
    b, s = query.shape[:2]
    dtype = compute_dtype_for(query)
    qf, qpos, total_len = prepare_from_params(
        query, key, value, present_key, present_value, seqlens_k, p, dtype=dtype
    )
    t = p.total_sequence_length
    out = attend(
        qf,
        present_key[:, :, :t],
        present_value[:, :, :t],
        qpos=qpos,
        total_len=total_len,
        scale=p.scale,
        k_scale=p.k_scale,
        v_scale=p.v_scale,
        window=p.local_window_size,
        softcap=p.softcap,
        bias=p.attention_bias,
        sink=sink_logits(p.head_sink, p.smooth_softmax, p.num_heads, query.device),
        **attend_kw,
    )
    return out.reshape(b, s, p.num_heads * p.head_size).to(query.dtype)  # (B may be 0)

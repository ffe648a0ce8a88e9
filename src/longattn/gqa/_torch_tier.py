"""The pure-torch GQA pipeline both torch tiers share: prologue (QK-norm + rotary, cache append)
then an attention core. reference.py passes the unfused core, chunked.py the online-softmax one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._attention_torch import (
    compute_dtype_for,
    contiguous_positions,
    prepare_new_tokens,
    sink_logits,
    split_qkv,
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
    q, k, v = split_qkv(query, key, value, p.num_heads, p.kv_num_heads, p.head_size)
    qpos, total_len = contiguous_positions(seqlens_k, s, p.is_first_prompt)
    qf = prepare_new_tokens(
        q,
        k,
        v,
        present_key,
        present_value,
        qpos,
        total_len,
        dtype=dtype,
        cos_cache=p.cos_cache if p.do_rotary else None,
        sin_cache=p.sin_cache if p.do_rotary else None,
        position_ids=p.position_ids,
        interleaved=p.rotary_interleaved,
        q_norm_weight=p.q_norm_weight,
        k_norm_weight=p.k_norm_weight,
        epsilon=p.qk_norm_epsilon,
        k_scale=p.k_scale,
        v_scale=p.v_scale,
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
    return out.reshape(b, s, -1).to(query.dtype)

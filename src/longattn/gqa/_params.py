"""The contract between gqa/api.py and the GroupQueryAttention tiers.

api.py validates the user's inputs, allocates ``present_key/present_value`` (or reuses the shared
past buffer), copies the past rows into a new present when needed, and then calls one tier:

    output = run(query, key, value, present_key, present_value, seqlens_k, p)

- ``query``: [B, S, N*H], or packed [B, S, (N + 2*KV)*H] with ``key``/``value`` None.
- ``key``/``value``: [B, S, KV*H] or None (packed). Activation dtype fp32/fp16/bf16, last dim
  contiguous.
- ``present_key``/``present_value``: [B, KV, C, H] in the cache dtype (activation dtype, fp16 for
  bf16 activations, or int8), already holding rows ``0 .. past_len[b]-1``. The tier writes the new
  tokens' K (after QK-norm + rotary) and V, converted/quantized to the cache dtype, at rows
  ``qpos`` (see below), and never touches other rows.
- ``seqlens_k``: int32 [B] on the activations' device; total_len[b] = seqlens_k[b] + 1.
- Positions: first prompt (``p.is_first_prompt``, S == total_sequence_length): qpos = s, and rows
  s >= total_len[b] are right padding (their output is zero, their K/V are not written).
  Otherwise qpos = total_len[b] - S + s. Rotary position = position_ids[b, s] if given, else qpos.
- Returns ``output`` [B, S, N*H] in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GQAParams:
    num_heads: int
    kv_num_heads: int
    head_size: int
    scale: float  # resolved (1/sqrt(H) when the user gave None/0)
    softcap: float  # 0.0 = off
    local_window_size: int  # -1 = off, else W > 0 keys incl. the query's own
    do_rotary: bool
    rotary_interleaved: bool
    smooth_softmax: bool
    qk_norm_epsilon: float
    is_first_prompt: bool
    total_sequence_length: int
    cos_cache: torch.Tensor | None  # [max_pos, rotary_dim/2], fp32/fp16/bf16
    sin_cache: torch.Tensor | None
    position_ids: torch.Tensor | None  # [B, S] int64
    attention_bias: torch.Tensor | None  # [B|1, N|1, S, T>=total_sequence_length]
    head_sink: torch.Tensor | None  # [N], any float dtype (read in fp32)
    q_norm_weight: torch.Tensor | None  # [H]
    k_norm_weight: torch.Tensor | None  # [H]
    k_scale: torch.Tensor | None  # fp32 [1] or [KV, 1, H]; only with an int8 cache
    v_scale: torch.Tensor | None

    @property
    def group(self) -> int:
        return self.num_heads // self.kv_num_heads

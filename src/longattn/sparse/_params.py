"""The contract between sparse/api.py (DynamicSparseAttention) and its tiers.

api.py validates the user's inputs, allocates ``present_key/present_value`` (or reuses the past
buffer when its capacity suffices), copies the past rows into a new present when needed, and
then calls one tier:

    output = run(query, key, value, present_key, present_value, auxiliary_key, auxiliary_value,
                 selected_indices, selected_counts, seqlens_k, p)

- ``query`` [B, S, N*H] (or packed [B, S, (N + 2*KV)*H] with ``key``/``value`` None);
  ``key``/``value`` [B, S, KV*H], each in its own float dtype (e.g. fp16 V with bf16 Q).
- ``present_key/present_value`` [B, KV, C, H] in the cache dtype (float, or int8 with
  ``k_scale/v_scale``), holding rows ``0 .. past_len[b]-1``. The tier writes the new K (after
  QK-norm + rotary, rounded/quantized once) and raw V at rows ``qpos`` of real rows only.
- ``auxiliary_key`` [B, KV, A, H] float (any float dtype, read as is), ``auxiliary_value``
  the same shape (or None when ``p.auxiliary_kv_shared``: V = auxiliary_key); None in
  selected_only mode.
- ``selected_indices`` [B*S, M] int32/int64, ``selected_counts`` [B*S] int32/int64 (row
  ``b*S + s``); ``seqlens_k`` [B] int32 (total_len - 1).
- Returns ``output`` [B, S, N*H] in ``query``'s dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DSAParams:
    num_heads: int
    kv_num_heads: int
    head_size: int
    scale: float  # resolved (1/sqrt(H) when the user gave None/0)
    local_window_size: int  # -1 = off (selected_only), else W > 0 (local_plus_selected)
    attention_mode: str  # "selected_only" | "local_plus_selected"
    selected_kv_source: str  # "main" | "auxiliary"
    do_rotary: bool
    rotary_interleaved: bool
    rotary_offset: int
    smooth_softmax: bool
    qk_norm_epsilon: float
    auxiliary_kv_shared: bool
    is_first_prompt: bool
    total_sequence_length: int
    query_dtype: torch.dtype | None  # round Q once to this dtype after the prologue
    cos_cache: torch.Tensor | None  # [max_pos, rotary_dim/2]
    sin_cache: torch.Tensor | None
    position_ids: torch.Tensor | None  # [B, S] int64
    head_sink: torch.Tensor | None  # [N]
    q_norm_weight: torch.Tensor | None  # [H]
    k_norm_weight: torch.Tensor | None  # [H]
    k_scale: torch.Tensor | None  # fp32 [1] or [KV, 1, H]; only with an int8 cache
    v_scale: torch.Tensor | None

    @property
    def group(self) -> int:
        return self.num_heads // self.kv_num_heads

    @property
    def local(self) -> bool:
        return self.attention_mode == "local_plus_selected"

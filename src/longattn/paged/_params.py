"""The contract between paged/api.py and the PagedAttention tiers.

api.py validates the inputs, splits a packed query, and calls one tier:

    output = run(query, key, value, key_cache, value_cache, cu_seqlens, past_seqlens,
                 block_table, p)

- ``query`` [tokens, N*H]; ``key``/``value`` [tokens, KV*H] (views of a packed query allowed;
  last dim contiguous), activation dtype fp32/fp16/bf16 (fp64 for the test oracle).
- ``key_cache``/``value_cache`` [num_blocks, block_size, KV, H], contiguous, cache dtype (the
  activation dtype, fp16 for bf16 activations, or int8 with ``p.k_scale``/``p.v_scale``).
- ``cu_seqlens`` int32 [B+1], ``past_seqlens`` int32 [B], ``block_table`` int32 [B, max_blocks]
  on the activations' device.
- Token t of sequence b (s = t - cu[b]) is at position past[b] + s; its K (after QK-norm and
  rotary) and V are converted once to the cache dtype and written to block
  ``block_table[b, pos // block_size]``, row ``pos % block_size``; then every query attends
  (causal, bottom-right aligned, window/softcap/sink) to the cached keys ``0 .. past[b] + S_b``,
  the new ones read back from the cache. No other slot is read into the result or written.
- Returns ``output`` [tokens, N*H] in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedParams:
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
    cos_cache: torch.Tensor | None  # [max_pos, rotary_dim/2], fp32/fp16/bf16
    sin_cache: torch.Tensor | None
    head_sink: torch.Tensor | None  # [N], any float dtype (read in the compute dtype)
    q_norm_weight: torch.Tensor | None  # [H]
    k_norm_weight: torch.Tensor | None  # [H]
    k_scale: torch.Tensor | None  # fp32 [1] or [KV, 1, H]; only with an int8 cache
    v_scale: torch.Tensor | None

    @property
    def group(self) -> int:
        return self.num_heads // self.kv_num_heads

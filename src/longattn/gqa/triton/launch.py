"""Host side of the Triton GQA tier: prologue, then the prefill or the split-K decode kernels.

No host synchronization anywhere (decode is CUDA-graph capturable): every per-sequence quantity
is read on the device; the host uses only shapes and ``p.total_sequence_length``.

Dot dtype (the dtype of the rotated-Q scratch buffer and of the tensor-core operands): fp16 when
the cache is fp16 (bf16 activations with an fp16 cache: both operands then carry 11 significant
bits); fp16 for an int8 K cache with 16-bit activations, Q rows scaled by powers of two that the
kernels undo on the fp32 dot products (``prologue``; ``q_scale``); else the activation dtype.
fp32 activations use exact fp32 dots (``input_precision="ieee"``), never tf32.
"""

from __future__ import annotations

import torch

from ..._triton_merge import merge_splits
from ..._triton_prologue import (
    fuse_prologue,
    fused_prologue_args,
    pow2_q_rows,
    rope_norm_flags,
)
from ..._triton_utils import TL_DTYPES as _TL_DTYPES
from ..._triton_utils import (
    cdiv,
    cfg_flag,
    device_sms,
    gluon_hopper_enabled,
    int8_pairs_ok,
    next_pow2,
    pdl_kwargs,
    tma_ok,
    words_aligned,
)
from ..._triton_utils import interpret as _interpret
from ..._triton_utils import scale_strides as _scale_strides
from .._params import GQAParams
from ._core import LOG2E
from .decode import (
    decode_config,
    four_split_band,
    gqa_decode_split_kernel,
    pair_count_plan,
    wave_fill,
)
from .prefill import gqa_prefill_kernel, prefill_config
from .prologue import gqa_prologue_kernel, prologue_block_heads

DECODE_MAX_ROWS = 64  # S * group up to this runs on the split-K decode kernel
SUPPORTED_HEADS = (16, 32, 64, 128, 256)  # power-of-two head sizes (tests use 16/32)


_empty = torch.empty  # every buffer of this tier is allocated here (tests poison it with NaN)


def dot_dtype_for(act_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype of Q scratch and of the tensor-core operands (see the module docstring)."""
    return torch.float16 if cache_dtype == torch.float16 else act_dtype


def pv_dtype_for(dot_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """V operand dtype of the decode P.V dot: the dot dtype, except int8 V with a 16-bit dot,
    which enters as fp16. Its integers are exact in fp16 and reach it through an integer xor +
    one fp16 subtract (``_triton_utils.int8_to_fp16``: fewer instructions than the bf16
    conversion, and the decode loop of an int8 cache is instruction-issue bound); P rounded to
    fp16 carries 3 more mantissa bits than bf16."""
    if cache_dtype == torch.int8 and dot_dtype in (torch.float16, torch.bfloat16):
        return torch.float16
    return dot_dtype


SMEM_PER_SM = 227 * 1024  # shared memory one CTA may hold on sm_90 (H100/H200)


def resident_ctas(cfg: dict, head: int, cache_itemsize: int) -> int:
    """Split-kernel CTAs that fit one SM by shared memory: the K and V tile pipeline holds
    ``num_stages * BLOCK_N * head * itemsize * 2`` bytes (bf16 H=128, BLOCK_N 64, 4 stages:
    128 KB, one CTA; int8 BLOCK_N 128, 3 stages: 96 KB, two)."""
    smem = cfg["num_stages"] * cfg["BLOCK_N"] * head * cache_itemsize * 2
    return max(1, SMEM_PER_SM // max(smem, 1))


def _floor_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def choose_num_splits(batch: int, kv_heads: int, span: int, block_n: int, num_sms: int,
                      resident: int = 1, issue_bound: bool = False,
                      balance: bool = False) -> int:  # fmt: skip
    """Splits of the key range (a power of two but for ``balance``; each split at least 4 KV
    blocks long). Host-known sizes only.

    16-bit caches (bandwidth-bound tiles): about one wave of resident CTAs, ``num_sms *
    resident`` programs, rounded down. H200 sweep (``benchmarks/results/
    decode_splits_h200.json``, bf16, H=128, CUDA graph): B=1 T=32K 16 splits 41.1 us vs 47.6
    at 128 (the earlier target of 4 waves), cuDNN 40.2; B=8 T=4K 2 splits 41.0 vs 47.9 (16);
    B=32 T=4K 1 split 132.5 vs 140.1 (4); B=1 T=128K 130.0 vs 137.3. More waves of short
    splits spend their time filling the tile pipeline.

    int8 caches (``issue_bound``: the tile loop is instruction-issue bound): about 4 waves of
    CTAs (``4 * num_sms`` programs, rounded up), but no more splits than one wave or splits
    of 32 tiles need, whichever is more. H200, T=128K, B=1 / 8 / 32: 32 / 16 / 4 splits (95.4 /
    628.1 / 2438.8 us); one wave (32 / 4 / 1 splits) gave 95.4 / 640.5 / 2539.7 and 4 waves
    (128 / 16 / 4) 103.3 / 628.1 / 2438.8.

    ``balance`` (the 16-bit H <= 128 build, 2 stages in ``decode.four_split_band``): 4 splits
    there (not a power of two; the one-wave plan's 2 left SMs short)."""
    pairs = max(batch * kv_heads, 1)
    want = _floor_pow2(num_sms * resident // pairs)  # one wave
    if balance and not issue_bound and resident > 1 and four_split_band(pairs, num_sms):
        # H100, 2-stage build, us (cuDNN; the 4-stage 1-split plan): B=20 T=32K 4 splits
        # 898.8, 2: 1071.6 (933.0; 1003.7); B=20 T=4K 4 splits 127.7 (123.9; 136.1); B=24
        # T=4K 4 splits 143.1, 2: 150.2 (139.9; 148.3) (gqa_waves_b20_64_h100.json); H200 in
        # four_split_band.
        want = 4
    if issue_bound:
        four_waves = next_pow2(cdiv(4 * num_sms, pairs))
        want = min(four_waves, max(want, _floor_pow2(span // (32 * block_n))))
    cap = next_pow2(max(1, cdiv(span, 4 * block_n)))  # splits of >= 4 tiles
    return max(1, min(want, cap, 256))


MIN_PART_TILES = 4  # balanced grid: key tiles per program at least
INT8_BALANCED_BELOW_FILL = 0.75  # see int8_plan_unbalanced


def int8_plan_unbalanced(ctas: int, slots: int) -> bool:
    """Whether the int8 split plan's ``ctas`` programs (about 4 waves of ``slots`` resident
    CTAs) end in a mostly empty wave, so that the default int8 build takes the balanced grid:
    more than one wave, filled < INT8_BALANCED_BELOW_FILL. H100, same process, us (split plan;
    balanced grid, one wave): B=17 T=32K / 128K 469.6 / 1823.0; 413.3 / 1540.4 (fill 0.69);
    B=20 / 28 T=32K 472.9 / 654.4; 477.2 / 656.3 (0.81 / 0.85); B=1 / 8 T=128K (0.97) 104.9 /
    734.1; 111.1 / 741.8 (``gqa_balanced_int8_ab_h100.json``). A single part-empty wave
    (e.g. B=3) was not measured and keeps the plan."""
    return ctas > slots and wave_fill(ctas, slots) < INT8_BALANCED_BELOW_FILL


def balanced_grid(pairs: int, tiles: int, programs: int) -> tuple[int]:
    """Grid of the split kernel's ``BALANCED`` build: ``programs`` (one wave of resident
    CTAs), fewer where a program would get < ``MIN_PART_TILES`` of the ``pairs * tiles`` key
    tiles. Each program takes an equal share of the tiles laid end to end, across pair
    boundaries, so no SM idles in a partial last wave (the split plan's wave quantization:
    e.g. B=17 at KV=8 is 136 pairs on 132 SMs)."""
    return (max(1, min(programs, pairs * tiles // MIN_PART_TILES)),)


def _bias_strides(bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    if bias is None:
        return 0, 0, 0, 0
    return tuple(0 if bias.shape[i] == 1 else bias.stride(i) for i in range(4))


def _logit_scalars(p: GQAParams) -> tuple[float, float]:
    """(qk_scale, softcap_mult) of ``_core.scores``."""
    if p.softcap > 0:
        return p.scale / p.softcap, p.softcap * LOG2E
    return p.scale * LOG2E, 0.0


def run_prologue(query, key, value, present_key, present_value, seqlens_k, p, q_rot,
                 q_scale=None):  # fmt: skip
    """QK-norm + rotary of Q (-> q_rot [B, S, N, H]) and new K; K/V appended to the caches.
    ``q_scale [B, S, N]`` fp32 (int8 K, fp16 q_rot): receives each Q row's power-of-two factor
    (see ``prologue``); None: Q is rounded to q_rot's dtype unscaled."""
    grid, args = prologue_launch_args(
        query, key, value, present_key, present_value, seqlens_k, p, q_rot, q_scale
    )
    gqa_prologue_kernel[grid](**pdl_kwargs(query), **args)


def prologue_launch_args(query, key, value, present_key, present_value, seqlens_k, p, q_rot,
                         q_scale=None) -> tuple[tuple[int, int], dict]:  # fmt: skip
    """``(grid, kwargs)`` of ``gqa_prologue_kernel`` (all but ``PDL``) for ``run_prologue``'s
    arguments; the grid is ``(B * S, head blocks)``, ``kwargs`` hold ``num_warps``."""
    b, s, _ = query.shape
    n, kv, h = p.num_heads, p.kv_num_heads, p.head_size
    if key is None:  # packed QKV
        key = query[..., n * h : (n + kv) * h]
        value = query[..., (n + kv) * h :]
    block_h, num_warps = prologue_block_heads(n, kv, h)
    cos, sin = p.cos_cache, p.sin_cache
    has_rot = p.do_rotary and cos is not None
    pos = p.position_ids
    quant_k = present_key.dtype == torch.int8
    quant_v = present_value.dtype == torch.int8
    ks, vs = p.k_scale, p.v_scale
    ks_h, ks_d = _scale_strides(ks if quant_k else None)
    vs_h, vs_d = _scale_strides(vs if quant_v else None)
    grid = (b * s, cdiv(n, block_h) + cdiv(kv, block_h))
    args = dict(
        q_ptr=query,
        k_ptr=key,
        v_ptr=value,
        qn_w_ptr=p.q_norm_weight if p.q_norm_weight is not None else query,
        kn_w_ptr=p.k_norm_weight if p.k_norm_weight is not None else query,
        cos_ptr=cos if has_rot else query,
        sin_ptr=sin if has_rot else query,
        pos_ptr=pos if pos is not None else seqlens_k,
        seqlens_ptr=seqlens_k,
        qout_ptr=q_rot,
        kc_ptr=present_key,
        vc_ptr=present_value,
        ks_ptr=ks if quant_k else q_rot,
        vs_ptr=vs if quant_v else q_rot,
        qs_ptr=q_scale if q_scale is not None else q_rot,
        seq_len=s,
        max_pos=cos.shape[0] if has_rot else 1,
        cache_len=present_key.shape[2],
        stride_qb=query.stride(0),
        stride_qs=query.stride(1),
        stride_kb=key.stride(0),
        stride_ks=key.stride(1),
        stride_vb=value.stride(0),
        stride_vs=value.stride(1),
        stride_qob=q_rot.stride(0),
        stride_qos=q_rot.stride(1),
        stride_kcb=present_key.stride(0),
        stride_kch=present_key.stride(1),
        stride_kcc=present_key.stride(2),
        stride_vcb=present_value.stride(0),
        stride_vch=present_value.stride(1),
        stride_vcc=present_value.stride(2),
        stride_ks_h=ks_h,
        stride_ks_d=ks_d,
        stride_vs_h=vs_h,
        stride_vs_d=vs_d,
        stride_pb=pos.stride(0) if pos is not None else 0,
        stride_ps=pos.stride(1) if pos is not None else 0,
        stride_cos=cos.stride(0) if has_rot else 0,
        stride_sin=sin.stride(0) if has_rot else 0,
        eps=p.qk_norm_epsilon,
        NUM_HEADS=n,
        KV_HEADS=kv,
        GROUP=n // kv,
        HEAD=h,
        HEAD_PAD=next_pow2(h),
        BLOCK_H=block_h,
        **rope_norm_flags(p),
        IS_FIRST_PROMPT=p.is_first_prompt,
        K_QUANT=quant_k,
        V_QUANT=quant_v,
        Q_POW2=q_scale is not None,
        num_warps=num_warps,
    )
    return grid, args


def _common_flags(p: GQAParams, present_value, dot: torch.dtype, has_qscale: bool) -> dict:
    return dict(
        HAS_QSCALE=has_qscale,
        IS_FIRST_PROMPT=p.is_first_prompt,
        HAS_WINDOW=p.local_window_size > 0,
        HAS_SOFTCAP=p.softcap > 0,
        HAS_BIAS=p.attention_bias is not None,
        HAS_VSCALE=present_value.dtype == torch.int8,
        DOT_DTYPE=_TL_DTYPES[dot],
        DOT_PREC="ieee" if dot == torch.float32 else "tf32",
        INTERPRET=_interpret(),
    )


def prefill_use_tma(q_rot: torch.Tensor, present_key: torch.Tensor, present_value) -> bool:
    """Unmasked prefill K/V tiles by TMA: sm_90+ and caches in the dot dtype (bf16/fp16).

    H200, causal bf16 prefill, kernel alone (B*S = 16K; ``benchmarks/results/
    prefill_tma_h200.json``): H=256 S=2K/8K/32K 360/426/437 -> 450/543/581 TFLOP/s; H=128
    360/448/487 -> 378/478/515 TFLOP/s; identical outputs. The per-thread cp.async copies and
    their address math leave the loop (sm_90 SASS of the unmasked loop: 561 -> 481
    instructions at H=128, 495 -> 447 at H=256)."""
    return (
        q_rot.dtype in (torch.float16, torch.bfloat16)
        and present_key.dtype == q_rot.dtype
        and present_value.dtype == q_rot.dtype
        and tma_ok(present_key)
        and tma_ok(present_value)
    )


def _cache_descriptor(cache: torch.Tensor, block_n: int):
    """TMA descriptor of a ``[B, KV, C, H]`` cache, one ``[1, 1, block_n, H]`` tile per load."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(cache, list(cache.shape), list(cache.stride()),
                            [1, 1, block_n, cache.shape[3]])  # fmt: skip


def prefill_gluon_fits(p: GQAParams, q_rot, present_key, present_value, out, q_scale) -> bool:
    """The case the Gluon (sm_90, warp-specialized) prefill covers: 16-bit caches in the dot
    dtype, head size 64/128/256, no bias, no per-row Q scale, TMA-able operands."""
    h = q_rot.shape[-1]
    return (
        gluon_hopper_enabled(q_rot.device)
        and q_rot.dtype in (torch.float16, torch.bfloat16)
        and h in (64, 128, 256)
        and present_key.dtype == q_rot.dtype
        and present_value.dtype == q_rot.dtype
        and p.attention_bias is None
        and q_scale is None
        and q_rot.is_contiguous()
        and out.stride(-1) == 1
        and tma_ok(q_rot)
        and tma_ok(present_key)
        and tma_ok(present_value)
    )


# Up to this many keys per work item (``prefill_item_keys``), H > 128 prefill takes the short-
# item ring shape (``prefill_gluon_config``). H100, same process, two runs (5 and 9 interleaved
# rounds, ``benchmarks/results/prefill_gluon_rings{,_run2}_session38_h100.json``), causal bf16
# (32, 8), B*S = 16K, H=256: S=2K 1144.5 / 1142.5 -> 1100.1 / 1101.5 us (-3.9 / -3.6%), S=8K
# -1.1 / -0.3%, S=32K +1.3 / +2.5% (long items: the single V slot stalls).
GLUON_SHORT_TOTAL = 8192

# H=128: work items that read more than this many keys (``prefill_item_keys``; or unknown)
# take OVERLAP. H100, same process, three runs of 5 / 7 / 15 interleaved rounds
# (benchmarks/results/prefill_gluon_overlap{,_run2,_run3}_session39_h100.json), us, session-38
# build -> early K release -> early K release + OVERLAP: S=2K 575.5 / 576.3 / 574.8 -> 572.0 / 572.3 -> 590.0 /
# 594.1 / 593.0 (OVERLAP +3-4%: short items pay its unoverlapped first and last tiles); S=8K
# 1976.0 / 1994.6 / 1997.8 -> 1931.5 / 1950.9 -> 1899.5 / 1903.7 / 1922.0 (-3.8 to -4.6%); S=32K
# 14978.3 / 15371.4 / 14975.2 -> 15148.0 / 14780.2 -> 14546.5 / 14531.7 / 14761.5 (-1.4 to
# -5.5%). Session 40 (H100, ``prefill_gluon_cross_run2_session40_h100.json``, 7 rounds) at the
# bound, S=4K: the plain early-K build 1059.4 us, OVERLAP 1077.5 (+1.7%), CROSS_ITEM 1056.7.
# The same items past the bound also carry the overlap across items (CROSS_ITEM; H100, same
# process, OVERLAP + early K release -> + CROSS_ITEM, median us, five runs of 5 / 7 / 11 /
# 21 / 9 rounds, ``prefill_gluon_cross{,_run2,_run3,_run4,_default}_session40_h100.json``):
# S=8K 1962.4 -> 1895.8, 1962.7 -> 1950.8, 1938.3 -> 1946.1, 1958.0 -> 1915.9, 1932.0 -> 1908.2
# (-3.4 / -0.6 / +0.4 / -2.1 / -1.2%); S=16K 3834.3 -> 3776.6 (-1.5%); S=32K 15017.8 ->
# 15017.7, 15158.8 -> 14783.5, 15260.1 -> 14994.8, 14964.7 -> 14812.3 (0 / -2.5 / -1.7 / -1.0%);
# S=2K (not used there), the plain early-K default -> CROSS_ITEM: 580.9 -> 607.0 (+4.5%: the
# overlap's loss on short items is not at their ends).
# Session 41 (H100, same process, 7 / 11 / 11 rounds, ``prefill_gluon_mask_pp{,_run2}_session41_
# h100.json``, ``prefill_gluon_pp_run3_session41_h100.json``): with PINGPONG on both sides the
# bound still splits the two loops: at S=4K the plain loop 1000.9 / 1005.6 us vs CROSS_ITEM
# 1026.4 (run 3); at S=32K CROSS_ITEM 14542.0 / 14581.2 vs the plain loop 15003.5 / 14732.9.
GLUON_OVERLAP_MIN_TOTAL = 4096

# H=128 takes PINGPONG (FA3's inter-warpgroup schedule) at every length. H100, same process,
# median us, three runs (7 / 11 / 11 interleaved rounds; ``prefill_gluon_mask_pp{,_run2}_
# session41_h100.json``, ``prefill_gluon_pp_run3_session41_h100.json``): the plain early-K loop
# without -> with: S=2K 568.4 -> 554.3, 564.0 -> 560.4, 563.7 -> 563.6 (-2.5 / -0.6 / 0%), S=4K
# 1029.0 -> 1000.9, 1029.5 -> 1005.6 (-2.7 / -2.3%), S=8K 1926.2 -> 1896.7, 1945.4 -> 1914.5; the
# crossed loop without -> with: S=8K 1947.3 -> 1921.1, 1921.2 (the default) -> 1908.6 (-1.3 /
# -0.7%), S=16K 3703.8 -> 3668.8 (-0.9%), S=32K 14500.3 -> 14542.0, 14576.6 -> 14581.2 (+0.3 /
# 0%). H=256 (its plain short-item build, run 1): +8.3 / +7.8% at S=2K / 8K; H=64: +0.6 / +2.6%:
# both keep it off.

# H > 128 takes LAZY_RESCALE (FA4's conditional rescale, per warp; its plain loop is the only
# one H=256 runs). H100 80GB HBM3, session 43, same process, median us, default -> LAZY, three
# runs (7 / 7 / 11 interleaved rounds; ``prefill_gluon_lazy{,_run2,_run3}_session43_h100.json``),
# causal bf16 (32, 8), B*S = 16K: S=2K 1094.0 -> 1081.9, 1084.6 -> 1083.6, 1085.7 -> 1085.0
# (-1.1 / -0.1 / -0.1%); S=4K 1979.7 -> 1969.8, 1964.3 -> 1968.6 (-0.5 / +0.2%); S=8K 3788.6 ->
# 3645.1, 3847.9 -> 3742.7, 3766.5 -> 3712.4 (-3.8 / -2.7 / -1.4%); S=32K 28135.8 -> 28839.0,
# 28999.2 -> 28904.6, 28917.4 -> 28763.2 (+2.5 / -0.3 / -0.5%). The prediction was -2 to -6%
# at S=8K / 32K. H=128's plain loop (up to 4096 keys) keeps it off: S=2K +0.1%, S=4K +3.1%
# (one run, ``prefill_gluon_h128_defaults_session43_h100.json``); H=64 is untimed: off.


def prefill_item_keys(total: int, window: int, rows: int = 128) -> int:
    """The most keys one Gluon prefill work item (``rows`` query rows) reads: the sequence's
    ``total`` keys, or with a local window of ``window`` keys per row ``window + rows - 1``.
    ``prefill_gluon_config`` buckets on it: its short-item and overlap bounds were measured
    (causal, no window) as properties of the items' lengths, which a window caps."""
    if window > 0:
        return min(total, window + rows - 1)
    return total


def prefill_gluon_config(head: int, max_total: int = 0) -> dict:
    """Tile / pipeline shape of ``prefill_gluon`` for head size ``head`` and work items that
    read up to ``max_total`` keys (``prefill_item_keys``: the sequence length, or what a local
    window leaves of it; 0: unknown).

    - BLOCK_N: keys per K / V tile; STAGES / V_STAGES: K and V ring slots of [BLOCK_N, HEAD];
      EARLY_K_RELEASE: a K slot is refilled once both consumers' QK^T read it (else with its V
      slot, after P.V).
    - Q_SLOTS: 64-row Q tile pairs (2: the producer loads item k+1's Q and K/V during item k;
      ``fit_prefill_gluon_smem`` lowers it where shared memory is short).
    - CONSUMER_REGS / maxnreg: each consumer warpgroup's setmaxnreg budget and the launch cap
      that fits the three warpgroups (two consumers at 240, the producer's at 24) in the
      64K-register file, one CTA per SM.
    - Work schedule: PERSISTENT (one CTA per SM, else one per work item), DYNAMIC (each CTA
      claims its next item from a per-call counter, else CTA c takes c, c + G, ...), ORDER (0:
      every head's last row block first; 1: a head's row blocks heaviest first, then the next
      head's; 2: as 1 with the heads of one KV head interleaved; ``prefill_gluon._item_head``).
    - EPILOGUE_SMEM: output rows leave through the item's freed Q tile in shared memory as
      16-byte stores instead of the accumulator layout's 4-byte ones (H200, same process,
      ``benchmarks/results/prefill_gluon_ab9_h200.json``: +1 to +9% at every measured shape,
      H=128 and 256, S=2K..32K); EPILOGUE_TMA: from there by one TMA store per tile (where the
      output is TMA-able).
    - OVERLAP: FA3's intra-warpgroup overlap, tile j's softmax while tile j-1's P.V runs
      (``prefill_gluon._attend_overlapped``; sm_90 SASS: no spills in the H=128 tile loop,
      23-26 local loads per tile at H=256, where it ran 3-30% slower).
    - CROSS_ITEM (with OVERLAP and 2 Q pairs, else off): the overlapped loop carried across
      items, the next item's first softmax during this item's last P.V
      (``prefill_gluon._consumer_crossed``; the H=128 default with OVERLAP).
    - PINGPONG: FA3's inter-warpgroup schedule, the two consumers take turns to issue their
      wgmma groups (named barriers; ``prefill_gluon._turn_wait``), so one consumer's softmax
      runs while the other's wgmmas hold the tensor cores (the H=128 default, both loops).
    - LAZY_RESCALE (the plain loop only; the H > 128 default): a row's running max moves only
      when a tile raises it by more than 2^8, and a warp skips the accumulator's rescale where
      none of its rows moved (``prefill_gluon._rescale_acc``; FlashAttention-4's conditional
      rescale; measurements at the module's comment).

    H <= 128: 128-key tiles, 2 + 2 K / V slots, 2 Q pairs; H = 128 also releases K early and,
    for sequences of more than ``GLUON_OVERLAP_MIN_TOTAL`` keys (or unknown), overlaps the
    softmax with P.V, carried across items (CROSS_ITEM; see there for the measurements); its
    consumers take turns at every length (PINGPONG; measurements at the module's comment).
    H = 64 keeps the plain build (session 40, H100: OVERLAP + early K release 7-9% slower at
    S = 2K / 8K / 32K, CROSS_ITEM within -0.4 / +3.7%;
    ``prefill_gluon_overlap_h64_session40_h100.json``). H = 256: 64-key tiles; sequences of
    more than ``GLUON_SHORT_TOTAL`` keys (or unknown): 2 + 2 slots and 1 Q pair (224 KiB would
    not hold 2); shorter ones, whose items are a few tiles long, the short-item shape: 2 Q
    pairs, 2 K slots refilled early, 1 V slot, TMA output stores, so the next item's Q is
    resident when an item ends (see ``GLUON_SHORT_TOTAL`` for the measurements); both shapes
    skip the accumulator's rescale per warp where no row's max moved (LAZY_RESCALE)."""
    bn = 64 if head > 128 else 128
    cfg = dict(BLOCK_N=bn, STAGES=2, V_STAGES=2, EARLY_K_RELEASE=False, Q_SLOTS=2,
               CONSUMER_REGS=240, maxnreg=168,
               PERSISTENT=True, DYNAMIC=True, ORDER=2,
               EPILOGUE_SMEM=True, EPILOGUE_TMA=False, OVERLAP=False, CROSS_ITEM=False,
               PINGPONG=False, LAZY_RESCALE=head > 128)  # fmt: skip
    if head > 128 and 0 < max_total <= GLUON_SHORT_TOTAL:
        cfg.update(V_STAGES=1, EARLY_K_RELEASE=True, EPILOGUE_TMA=True)
    if head == 128:
        overlap = not 0 < max_total <= GLUON_OVERLAP_MIN_TOTAL
        cfg.update(EARLY_K_RELEASE=True, OVERLAP=overlap, CROSS_ITEM=overlap, PINGPONG=True)
    return cfg


# the Gluon prefill's on / off build options (``prefill_gluon_config``): each must be a bool
GLUON_FLAGS = ("EARLY_K_RELEASE", "PERSISTENT", "DYNAMIC", "EPILOGUE_SMEM", "EPILOGUE_TMA",
               "OVERLAP", "CROSS_ITEM", "PINGPONG", "LAZY_RESCALE")  # fmt: skip

GLUON_SMEM_BYTES = 232448 - 2048  # sm_90's 227 KiB per CTA, less room for barriers / scratch


def fit_prefill_gluon_smem(cfg: dict, head: int, elem_bytes: int) -> dict:
    """``cfg`` with Q_SLOTS, then STAGES and V_STAGES (together, each down to 1), lowered until
    the Q tile pairs and the K / V ring slots fit ``GLUON_SMEM_BYTES`` (H=256 at the default
    2 + 2 K/V slots: one Q pair of 64 KiB). Q pairs are 128 x head (2 * ``prefill_gluon.
    ROWS_PER_WG``, not imported here: the Gluon module loads with the first launch), ring slots
    BLOCK_N x head. CROSS_ITEM stays only with OVERLAP and 2 Q pairs: the crossed loop waits
    for the next item's Q before this item's epilogue frees its own Q pair, so with one pair
    the consumers would wait on themselves."""
    cfg = dict(cfg)
    q_bytes, tile_bytes = 128 * head * elem_bytes, cfg["BLOCK_N"] * head * elem_bytes

    def fits():
        return cfg["Q_SLOTS"] * q_bytes + (cfg["STAGES"] + cfg["V_STAGES"]) * tile_bytes <= (
            GLUON_SMEM_BYTES
        )

    while cfg["Q_SLOTS"] > 1 and not fits():
        cfg["Q_SLOTS"] -= 1
    while max(cfg["STAGES"], cfg["V_STAGES"]) > 1 and not fits():
        cfg["STAGES"], cfg["V_STAGES"] = max(cfg["STAGES"] - 1, 1), max(cfg["V_STAGES"] - 1, 1)
    cfg["CROSS_ITEM"] = bool(cfg.get("CROSS_ITEM") and cfg.get("OVERLAP")) and cfg["Q_SLOTS"] == 2
    return cfg


def run_prefill_gluon(q_rot, present_key, present_value, seqlens_k, p, out, cfg=None):
    """Warp-specialized Gluon prefill (``prefill_gluon.gqa_prefill_gluon_kernel``): work items of
    128 rows of one head, cdiv(S, 128) * B * N of them; grid: one CTA per SM (PERSISTENT) or
    one per item. Two consumer warpgroups and a TMA producer warp per CTA."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .prefill_gluon import ROWS_PER_WG, gqa_prefill_gluon_kernel

    b, s, n, h = q_rot.shape
    base = prefill_gluon_config(h, prefill_item_keys(p.total_sequence_length, p.local_window_size))
    cfg = dict(base, **(cfg or {}))
    for key in GLUON_FLAGS:  # a flag given as 1 would silently pick another build
        cfg_flag(cfg, key, what="prefill cfg")
    cfg = fit_prefill_gluon_smem(cfg, h, q_rot.element_size())
    rows, bn = int(ROWS_PER_WG), cfg["BLOCK_N"]
    gdt = gl.bfloat16 if q_rot.dtype == torch.bfloat16 else gl.float16
    q2 = q_rot.view(b * s, n * h)
    q_desc = GluonDescriptor(q2, list(q2.shape), list(q2.stride()), [rows, h],
                             gl.NVMMASharedLayout.get_default_for([rows, h], gdt))  # fmt: skip
    kv_layout = gl.NVMMASharedLayout.get_default_for([1, 1, bn, h], gdt)
    k_desc, v_desc = (GluonDescriptor(c, list(c.shape), list(c.stride()), [1, 1, bn, h],
                                      kv_layout) for c in (present_key, present_value))  # fmt: skip
    o_desc = q_desc  # a placeholder where the epilogue does not take a TMA store
    cfg["EPILOGUE_TMA"] = cfg["EPILOGUE_TMA"] and cfg["EPILOGUE_SMEM"] and tma_ok(out)
    if cfg["EPILOGUE_TMA"]:  # [B, S, N * HEAD]: rows past S clip per sequence
        odt = gl.bfloat16 if out.dtype == torch.bfloat16 else gl.float16
        o_desc = GluonDescriptor(out, list(out.shape), list(out.stride()), [1, rows, h],
                                 gl.NVMMASharedLayout.get_default_for([1, rows, h], odt))  # fmt: skip
    qk_scale, softcap_mult = _logit_scalars(p)
    items = cdiv(s, 2 * rows) * b * n
    grid = min(items, device_sms(q_rot)) if cfg.pop("PERSISTENT") else items
    # DYNAMIC: the work-item tickets, zero at launch (one per call: concurrent launches on
    # other streams never share it)
    counter = seqlens_k
    if cfg["DYNAMIC"]:
        counter = torch.zeros(1, dtype=torch.int32, device=q_rot.device)
    gqa_prefill_gluon_kernel[(grid,)](
        q_desc,
        k_desc,
        v_desc,
        out,
        o_desc,
        seqlens_k,
        p.head_sink if p.head_sink is not None else q_rot,
        counter,
        p.total_sequence_length,
        s,
        max(p.local_window_size, 0),
        b * n,
        out.stride(0),
        out.stride(1),
        qk_scale,
        softcap_mult,
        NUM_HEADS=n,
        GROUP=p.group,
        HEAD=h,
        IS_FIRST_PROMPT=p.is_first_prompt,
        HAS_WINDOW=p.local_window_size > 0,
        HAS_SOFTCAP=p.softcap > 0,
        HAS_SINK=p.head_sink is not None or p.smooth_softmax,
        SINK_FROM_PTR=p.head_sink is not None,
        num_warps=4,
        **cfg,
    )


def run_prefill(q_rot, present_key, present_value, seqlens_k, p, out, cfg=None, q_scale=None):
    """Flash attention of every new row: the Gluon warp-specialized kernel where it fits (sm_90,
    ``prefill_gluon_fits``, no explicit ``cfg``), else the Triton kernel with grid
    (cdiv(S, BLOCK_M), B * N)."""
    if cfg is None and prefill_gluon_fits(p, q_rot, present_key, present_value, out, q_scale):
        run_prefill_gluon(q_rot, present_key, present_value, seqlens_k, p, out)
        return
    b, s = q_rot.shape[:2]
    bias = p.attention_bias
    if cfg is None:
        extra = 0 if bias is None else 128 * 128 * bias.element_size()
        cfg = prefill_config(p.head_size, q_rot.dtype, _interpret(), extra)
    cfg = dict(cfg)
    bias_b, bias_n, bias_s, bias_t = _bias_strides(bias)
    quant_v = present_value.dtype == torch.int8
    vs_h, vs_d = _scale_strides(p.v_scale if quant_v else None)
    qk_scale, softcap_mult = _logit_scalars(p)
    grid = (cdiv(s, cfg["BLOCK_M"]), b * p.num_heads)
    k_desc, v_desc = present_key, present_value  # (unused without USE_DESC)
    if "USE_DESC" not in cfg:
        cfg["USE_DESC"] = prefill_use_tma(q_rot, present_key, present_value)
    if cfg["USE_DESC"]:
        k_desc = _cache_descriptor(present_key, cfg["BLOCK_N"])
        v_desc = _cache_descriptor(present_value, cfg["BLOCK_N"])
    gqa_prefill_kernel[grid](
        q_ptr=q_rot,
        k_ptr=present_key,
        v_ptr=present_value,
        k_desc=k_desc,
        v_desc=v_desc,
        o_ptr=out,
        seqlens_ptr=seqlens_k,
        max_total=p.total_sequence_length,
        bias_ptr=bias if bias is not None else q_rot,
        sink_ptr=p.head_sink if p.head_sink is not None else q_rot,
        vs_ptr=p.v_scale if quant_v else q_rot,
        qs_ptr=q_scale if q_scale is not None else q_rot,
        seq_len=s,
        window=max(p.local_window_size, 0),
        stride_qb=q_rot.stride(0),
        stride_qs=q_rot.stride(1),
        stride_qn=q_rot.stride(2),
        stride_kb=present_key.stride(0),
        stride_kh=present_key.stride(1),
        stride_kc=present_key.stride(2),
        stride_vb=present_value.stride(0),
        stride_vh=present_value.stride(1),
        stride_vc=present_value.stride(2),
        stride_ob=out.stride(0),
        stride_os=out.stride(1),
        stride_bias_b=bias_b,
        stride_bias_n=bias_n,
        stride_bias_s=bias_s,
        stride_bias_t=bias_t,
        stride_vs_h=vs_h,
        stride_vs_d=vs_d,
        qk_scale=qk_scale,
        softcap_mult=softcap_mult,
        NUM_HEADS=p.num_heads,
        GROUP=p.group,
        HEAD=p.head_size,
        HAS_SINK=p.head_sink is not None or p.smooth_softmax,
        SINK_FROM_PTR=p.head_sink is not None,
        **_common_flags(p, present_value, q_rot.dtype, q_scale is not None),
        **cfg,
    )


def k_shift_ok(present_key, dot, softcap: float, wide: bool) -> bool:
    """Whether the split kernel may take int8 K tiles as ``k + INT8_SHIFT`` (``K_SHIFT``: the
    conversion's fp16 subtract left out, ``_triton_utils.int8_to_fp16``): an int8 K cache,
    an fp16 Q.K dot, no softcap (its tanh is not shift-invariant; the per-row shift
    ``INT8_SHIFT * sum(Q row)`` cancels in the softmax otherwise), not ``WIDE_I8``."""
    return present_key.dtype == torch.int8 and dot == torch.float16 and softcap <= 0 and not wide


def run_decode(q_rot, present_key, present_value, seqlens_k, p, out, cfg=None, num_splits=None,
               q_scale=None, fused=None, dot=None, default_cfg=None):  # fmt: skip
    """Split-K decode for S * group <= DECODE_MAX_ROWS, then the log-sum-exp merge.
    ``fused``: the fused-prologue arguments (``_triton_prologue.fused_prologue_args``; S = 1,
    ``cfg["FUSE_PROLOGUE"]``): q_rot / q_scale are None and ``dot`` is Q's dtype.
    ``default_cfg``: ``cfg`` is ``decode_config``'s (default: ``cfg is None``); only then may
    the int8 plan switch to the balanced grid. ``cfg["WIDE_I8"]`` (bool, off): int8 tiles read
    as int32 words (``_core.load_kv_tile``), kept off for caches not 4-byte aligned.
    ``cfg["V_PAIRS"]`` (bool; ``decode_config`` turns it on for int8 caches): an int8 V cache
    (fp16 P.V dot) read as int16 channel pairs (``_core.load_int8_pairs``), kept off for a V
    cache not 2-byte aligned and under ``WIDE_I8`` (``int8_pairs_ok``); ``cfg["K_PAIRS"]``
    (bool, off): the int8 K cache too (fp16 Q.K dot), Q split into its even / odd channels,
    same conditions for K. ``cfg["K_SHIFT"]`` (bool, off): int8 K enters Q.K as ``k + 1152``
    (``k_shift_ok``); ``cfg["V_SHIFT"]`` (bool, off): int8 V as ``v + 1152`` in P.V, with
    ``V_PAIRS`` only (``_core.online_softmax_pairs``). ``cfg["DIRECT_OUT"]`` (bool, off): where
    the plan is one split of the split grid (B * KV >= the SMs in bf16, e.g. B=32 at KV=8),
    the kernel finishes its rows into ``out`` (sink, ``1 / l``, ``v_scale``, one rounding:
    ``_core.finish_rows``) and no partials are written nor merged (one launch fewer)."""
    b, s = out.shape[:2]
    n, kv, h = p.num_heads, p.kv_num_heads, p.head_size
    dot = q_rot.dtype if q_rot is not None else dot
    q_any = q_rot if q_rot is not None else out  # (a dummy pointer when fused)
    # power-of-two Q rows (int8 K in fp16): from the prologue (q_scale), or made in the kernel
    q_pow2 = q_scale is not None or (
        fused is not None and fused["K_QUANT"] and dot == torch.float16
    )
    sms = device_sms(out)
    default_cfg = cfg is None if default_cfg is None else default_cfg
    cfg = dict(cfg or decode_config(h, dot, present_key.dtype, _interpret(), b * kv, sms))
    span = p.total_sequence_length
    if p.local_window_size > 0:
        span = min(span, p.local_window_size + s - 1)
    span = max(span, 1)
    wide = cfg_flag(cfg, "WIDE_I8", False, what="decode cfg")
    cfg["WIDE_I8"] = wide and words_aligned(present_key, present_value)
    pv_fp16 = pv_dtype_for(dot, present_value.dtype) == torch.float16
    for key, cache, fp16_dot in (("V_PAIRS", present_value, pv_fp16),
                                 ("K_PAIRS", present_key, dot == torch.float16)):  # fmt: skip
        on = cfg_flag(cfg, key, False, what="decode cfg")
        cfg[key] = on and not cfg["WIDE_I8"] and int8_pairs_ok(cache, fp16_dot)
    on = cfg_flag(cfg, "K_SHIFT", False, what="decode cfg")
    cfg["K_SHIFT"] = on and k_shift_ok(present_key, dot, p.softcap, cfg["WIDE_I8"])
    cfg["V_SHIFT"] = cfg_flag(cfg, "V_SHIFT", False, what="decode cfg") and cfg["V_PAIRS"]
    resident = resident_ctas(cfg, h, present_key.element_size())
    int8 = present_key.dtype == torch.int8
    balance = pair_count_plan(h, dot, present_key.dtype)
    tiles = cdiv(span, cfg["BLOCK_N"])  # key tiles of each (sequence, KV head) pair
    if num_splits or not cfg_flag(cfg, "BALANCED"):  # the split grid
        cfg["BALANCED"] = False
        splits = num_splits or choose_num_splits(
            b, kv, span, cfg["BLOCK_N"], sms, resident, issue_bound=int8, balance=balance
        )
        chunk = cdiv(cdiv(span, splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
        splits = cdiv(span, chunk)
        grid = (kv, b, splits)
        if default_cfg and int8 and not num_splits:
            cfg["BALANCED"] = int8_plan_unbalanced(b * kv * splits, sms * resident)
    if cfg["BALANCED"]:
        grid = balanced_grid(b * kv, tiles, sms * resident)
        chunk = tiles * cfg["BLOCK_N"]  # (unused)
        splits = min(cdiv(grid[0], b * kv) + 1, tiles)  # o_part slots: parts per pair
    direct = cfg_flag(cfg, "DIRECT_OUT", False, what="decode cfg")
    cfg["DIRECT_OUT"] = direct = direct and not cfg["BALANCED"] and splits == 1
    if direct:  # no partials: the kernel finishes its rows into out (no merge launch)
        o_part = lse_part = out
    else:
        o_part = _empty((b, s, n, splits, h), dtype=torch.float32, device=out.device)
        lse_part = _empty((b, s, n, splits), dtype=torch.float32, device=out.device)
    bias = p.attention_bias
    bias_b, bias_n, bias_s, bias_t = _bias_strides(bias)
    quant_v = present_value.dtype == torch.int8
    vs_h, vs_d = _scale_strides(p.v_scale if quant_v else None)
    qk_scale, softcap_mult = _logit_scalars(p)
    gqa_decode_split_kernel[grid](
        **pdl_kwargs(q_any),
        q_ptr=q_any,
        k_ptr=present_key,
        v_ptr=present_value,
        seqlens_ptr=seqlens_k,
        max_total=p.total_sequence_length,
        bias_ptr=bias if bias is not None else q_any,
        vs_ptr=p.v_scale if quant_v else q_any,
        qs_ptr=q_scale if q_scale is not None else q_any,
        o_part_ptr=o_part,
        lse_part_ptr=lse_part,
        out_ptr=out,
        sink_ptr=p.head_sink if p.head_sink is not None else out,
        HAS_SINK=direct and (p.head_sink is not None or p.smooth_softmax),
        SINK_FROM_PTR=direct and p.head_sink is not None,
        seq_len=s,
        cap=present_key.shape[2],
        window=max(p.local_window_size, 0),
        chunk=chunk,
        num_splits=splits,
        tiles_per_pair=tiles,
        total_tiles=b * kv * tiles,
        stride_qb=q_any.stride(0) if q_rot is not None else 0,
        stride_qs=q_any.stride(1) if q_rot is not None else 0,
        stride_qn=q_any.stride(2) if q_rot is not None else 0,
        stride_kb=present_key.stride(0),
        stride_kh=present_key.stride(1),
        stride_kc=present_key.stride(2),
        stride_vb=present_value.stride(0),
        stride_vh=present_value.stride(1),
        stride_vc=present_value.stride(2),
        stride_bias_b=bias_b,
        stride_bias_n=bias_n,
        stride_bias_s=bias_s,
        stride_bias_t=bias_t,
        stride_vs_h=vs_h,
        stride_vs_d=vs_d,
        qk_scale=qk_scale,
        softcap_mult=softcap_mult,
        NUM_HEADS=n,
        KV_HEADS=kv,
        GROUP=p.group,
        HEAD=h,
        ROWS_PAD=max(16, next_pow2(s * p.group)),
        PV_DTYPE=_TL_DTYPES[pv_dtype_for(dot, present_value.dtype)],
        **_common_flags(p, present_value, dot, q_pow2),
        **(fused or fused_prologue_args(None, None, None, p, dot, present_key.dtype)),
        **cfg,
    )
    if not direct:
        merge_splits(o_part, lse_part, out, num_heads=n, head_sink=p.head_sink,
                     smooth_softmax=p.smooth_softmax)  # fmt: skip


def gqa_triton(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    p: GQAParams,
    *,
    prefill_cfg: dict | None = None,
    decode_cfg: dict | None = None,
    num_splits: int | None = None,
    force_path: str | None = None,
) -> torch.Tensor:
    """Triton GQA tier (contract in ``gqa/_params.py``).

    query: [B, S, N*H] or packed [B, S, (N + 2*KV)*H]; key/value: [B, S, KV*H] or None;
    present_key/present_value: [B, KV, C, H] cache (activation dtype, fp16, or int8), written in
    place at rows qpos; seqlens_k: int32 [B]. Returns output [B, S, N*H] (activation dtype).
    ``prefill_cfg``/``decode_cfg``/``num_splits``/``force_path`` ("prefill" | "decode") are
    tuning hooks for benchmarks and tests.
    """
    b, s, _ = query.shape
    n, h = p.num_heads, p.head_size
    if h not in SUPPORTED_HEADS:
        raise ValueError(f"gqa_triton: head_size must be one of {SUPPORTED_HEADS}, got {h}")
    out = _empty((b, s, n * h), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    q_pow2 = pow2_q_rows(query.dtype, present_key.dtype)
    dot = torch.float16 if q_pow2 else dot_dtype_for(query.dtype, present_key.dtype)
    path = force_path or ("decode" if s * p.group <= DECODE_MAX_ROWS else "prefill")
    fused = None
    if path == "decode":
        pairs, sms = b * p.kv_num_heads, device_sms(query)
        default_cfg = decode_cfg is None
        decode_cfg = dict(
            decode_cfg or decode_config(h, dot, present_key.dtype, _interpret(), pairs, sms)
        )
        if fuse_prologue(decode_cfg, s, True):  # the split kernel does the prologue's work
            fused = fused_prologue_args(query, key, value, p, dot, present_key.dtype)
    q_rot = q_scale = None
    if fused is None:
        q_rot = _empty((b, s, n, h), dtype=dot, device=query.device)
        q_scale = _empty((b, s, n), dtype=torch.float32, device=query.device) if q_pow2 else None
        run_prologue(query, key, value, present_key, present_value, seqlens_k, p, q_rot, q_scale)
    if path == "decode":
        run_decode(q_rot, present_key, present_value, seqlens_k, p, out, decode_cfg, num_splits,
                   q_scale, fused, dot, default_cfg)  # fmt: skip
    elif path == "prefill_gluon":
        run_prefill_gluon(q_rot, present_key, present_value, seqlens_k, p, out, prefill_cfg)
    else:
        run_prefill(q_rot, present_key, present_value, seqlens_k, p, out, prefill_cfg, q_scale)
    return out

"""Triton sparse attention layer: SparseAttentionIndexer + DynamicSparseAttention in 4 launches.

The two ops called one after the other launch five dependent kernels per decode step: block
scores, select (one program per query row), the DSA prologue (QK-norm + rotary of Q and the new
K, K/V append), the split kernel and the merge. The prologue does not depend on the selection,
so the layer runs its programs in the select launch, beside the select programs (which occupy
one SM per row and leave the rest idle): ``select_prologue_kernel``, grid ``(rows + prologue
programs,)``; programs ``pid < rows`` run ``select.select_row``, the others
``gqa.triton.prologue.prologue_program``. The split kernel then reads the prepared Q and the
appended rows as after the DSA op's own prologue (same kernels, same roundings: the outputs are
bitwise those of the two ops).

Predicted gain (H100, 4-layer CUDA-graph chains of the two ops with the prologue launch
removed, ``benchmarks/results/sparse_layer_noprologue_emulation_h100.json``): B=1 S=1 T=128K
19.2 -> 17.0 us per layer, 256K 21.7 -> 19.4, B=4 T=128K 30.5 -> 28.7.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_utils import interpret as _interpret
from ..._triton_utils import pdl_kwargs, release_dependents, wait_prior_grids
from ...gqa.triton.launch import prologue_launch_args
from ...gqa.triton.prologue import prologue_program
from .._params import DSAParams
from .decode import dsa_triton, q_buffers, triton_prologue_fits
from .indexer import scores_for_select, select_supported
from .select import select_launch_args, select_row

_empty = torch.empty  # buffers of this launcher (tests poison them with NaN)


@triton.jit
def select_prologue_kernel(
    # select (select_row)
    score_ptr, seqlens_ptr, scratch_ptr, idx_ptr, cnt_ptr, seq_len, num_blocks, stride_sr,
    compress_ratio, kb, scratch_stride, max_selected,
    # prologue (prologue_program; seqlens_ptr, seq_len and IS_FIRST_PROMPT shared)
    q_ptr, k_ptr, v_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, pos_ptr, qout_ptr, kc_ptr, vc_ptr,
    ks_ptr, vs_ptr, qs_ptr, max_pos, cache_len, stride_qb, stride_qs, stride_kb, stride_ks,
    stride_vb, stride_vs, stride_qob, stride_qos, stride_kcb, stride_kch, stride_kcc,
    stride_vcb, stride_vch, stride_vcc, stride_ks_h, stride_ks_d, stride_vs_h, stride_vs_d,
    stride_pb, stride_ps, stride_cos, stride_sin, eps,
    rows,  # B * S: programs below it select, the rest run the prologue
    NB_PAD: tl.constexpr, KB_PAD: tl.constexpr, BLOCK_O: tl.constexpr, TOPK: tl.constexpr,
    RADIX_BITS: tl.constexpr, IDS_IN_REGS: tl.constexpr, EMIT_R: tl.constexpr,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr, ROT_DIM: tl.constexpr,
    HAS_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_QNORM: tl.constexpr, HAS_KNORM: tl.constexpr, K_QUANT: tl.constexpr,
    V_QUANT: tl.constexpr, Q_POW2: tl.constexpr, IS_FIRST_PROMPT: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch
    EARLY_SCORES: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,  # the split grid may launch once this one runs
    ONE_SCAN: tl.constexpr = True,
    PACKED_SCATTER: tl.constexpr = True,
    RANK_G: tl.constexpr = 0,
    RANK_CAP: tl.constexpr = 0,
    RANK_CROSS: tl.constexpr = False,
    tmax_ptr=None, tmax_stride=0, n_tiles=0, RANK_TILES: tl.constexpr = 0,
):  # fmt: skip
    """Grid ``(rows + B * S * head blocks,)``: ``select_row`` for each query row, then the
    prologue programs (token-major, ``cdiv(N, BLOCK_H) + cdiv(KV, BLOCK_H)`` per token)."""
    wait_prior_grids(PDL)  # first: the previous grid's writes are visible
    release_dependents(TRIGGER)
    pid = tl.program_id(0)
    if pid < rows:
        select_row(
            pid.to(tl.int64), score_ptr, seqlens_ptr, scratch_ptr, idx_ptr, cnt_ptr, seq_len,
            num_blocks, stride_sr, compress_ratio, kb, scratch_stride, max_selected, NB_PAD,
            KB_PAD, BLOCK_O, TOPK, RADIX_BITS, IDS_IN_REGS, IS_FIRST_PROMPT, EMIT_R,
            EARLY_SCORES, ONE_SCAN=ONE_SCAN, PACKED_SCATTER=PACKED_SCATTER, RANK_G=RANK_G,
            RANK_CAP=RANK_CAP, RANK_CROSS=RANK_CROSS, tmax_ptr=tmax_ptr, tmax_stride=tmax_stride,
            n_tiles=n_tiles, RANK_TILES=RANK_TILES,
        )  # fmt: skip
    else:
        head_blocks = tl.cdiv(NUM_HEADS, BLOCK_H) + tl.cdiv(KV_HEADS, BLOCK_H)
        i = pid - rows
        prologue_program(
            i // head_blocks, i % head_blocks, q_ptr, k_ptr, v_ptr, qn_w_ptr, kn_w_ptr, cos_ptr,
            sin_ptr, pos_ptr, seqlens_ptr, qout_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, qs_ptr,
            seq_len, max_pos, cache_len, stride_qb, stride_qs, stride_kb, stride_ks, stride_vb,
            stride_vs, stride_qob, stride_qos, stride_kcb, stride_kch, stride_kcc, stride_vcb,
            stride_vch, stride_vcc, stride_ks_h, stride_ks_d, stride_vs_h, stride_vs_d,
            stride_pb, stride_ps, stride_cos, stride_sin, eps, NUM_HEADS, KV_HEADS, GROUP, HEAD,
            HEAD_PAD, BLOCK_H, ROT_DIM, HAS_ROTARY, INTERLEAVED, HAS_POS, HAS_QNORM, HAS_KNORM,
            IS_FIRST_PROMPT, K_QUANT, V_QUANT, Q_POW2,
        )  # fmt: skip


def layer_unfusable(p: DSAParams, num_blocks: int) -> str | None:
    """Why the layer cannot co-launch the select and the prologue (None: it can); the caller
    then runs the indexer and DSA tiers one after the other (same results)."""
    if (p.attention_mode, p.selected_kv_source) != ("selected_only", "main"):
        return "the layer selects main-cache positions (selected_only mode only)"
    if not triton_prologue_fits(p):
        return "the Triton prologue takes rotary_offset 0 only"
    if not select_supported(num_blocks):
        return f"{num_blocks} blocks exceed the select kernel's row"
    return None


def sparse_layer_triton(
    index_query: torch.Tensor,
    index_block_keys: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    p: DSAParams,
    *,
    num_index_heads: int,
    compress_ratio: int,
    token_budget: int,
    index_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indexer + DSA of one layer in 4 launches (``layer_unfusable`` must be None): scores,
    select + prologue, split, merge. Arguments as ``indexer.indexer_triton`` and
    ``decode.dsa_triton`` take them (DSA in selected_only mode over the main cache). Returns
    ``(output [B, S, N*H], selected_indices [B*S, token_budget + r - 1] int32,
    selected_counts [B*S] int32)``. No host synchronization."""
    s = query.shape[1]
    nb = index_block_keys.shape[1]
    r = compress_ratio
    first = p.is_first_prompt
    scores, tmax = scores_for_select(
        index_query, index_block_keys, seqlens_k, num_index_heads=num_index_heads,
        compress_ratio=r, token_budget=token_budget, scale=index_scale, is_first_prompt=first,
    )  # fmt: skip
    sel, cnt, sel_args = select_launch_args(
        scores, seqlens_k, seq_len=s, num_blocks=nb, compress_ratio=r, token_budget=token_budget,
        is_first_prompt=first, interpret=_interpret(), empty=_empty, tile_max=tmax,
    )  # fmt: skip
    q_rot, q_scale = q_buffers(query, present_key, p)
    rows = sel.shape[0]
    if rows:
        grid, pro_args = prologue_launch_args(query, key, value, present_key, present_value,
                                              seqlens_k, p, q_rot, q_scale)  # fmt: skip
        pro_args.pop("num_warps")  # the select's warps (its row tile needs them)
        for name in ("seqlens_ptr", "seq_len", "IS_FIRST_PROMPT"):  # both hold the same
            del pro_args[name]
        select_prologue_kernel[(rows + grid[0] * grid[1],)](
            **pdl_kwargs(query, trigger=True), **sel_args, **pro_args, rows=rows
        )
    out = dsa_triton(query, key, value, present_key, present_value, None, None, sel, cnt,
                     seqlens_k, p, prepared=(q_rot, q_scale))  # fmt: skip
    return out, sel, cnt

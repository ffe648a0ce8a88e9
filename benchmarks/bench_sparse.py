"""Sparse stack benchmark (H200): SparseAttentionIndexer + DynamicSparseAttention, Triton tier.

    PYTHONPATH=src python benchmarks/bench_sparse.py --out benchmarks/results

Qwen3.8 geometry: H = 256, (N, KV) = (24, 4) (group 6), r = 64, token budget 2048
(max_selected 2111), QSA mode (selected_only + main cache), bf16 activations; indexer with
NI = 16 heads of DI = 128 (an assumption: fp32 block keys, bf16 index query).

Sections (results are rewritten after each one, so a cut-short run keeps what it measured):
- ``layer``: T in {32K, 64K, 128K, 256K}, S in {1, 8}, B in {1, 4}, bf16 cache: indexer +
  DSA per layer, DSA alone, dense GQA decode over the same cache (``group_query_attention``,
  whose Triton tier is used when present, else torch SDPA), and DSA's achieved bandwidth on
  the bytes it must read: ``B*S*KV*count*H*2 (K+V) * itemsize`` (a gathered row is read once
  per KV group) + Q + output.
- ``cache``: FP16 vs BF16 main cache (T = 128K), INT8 vs BF16 at budget 8192 (T = 128K).
- ``memory``: peak GPU memory of one DSA decode over a 256K-token cache of one layer vs the
  bytes that cache needs.
- ``peers``: DSA (the whole op: QK-norm + rotary prologue, append, sparse attention) vs
  FlexAttention with the same selection as a BlockMask (``flex_peers.sparse_block_mask``: one
  query row per flex batch over the flattened cache, causality inside the blocks, the sink
  through the lse; its Q is pre-normed/rotated, so it does less work) and vs torch SDPA dense
  over all T keys (attention only). The flex output is checked against ours first.

Timing: CUDA-graph replay of the whole op call (the public API, validation skipped inside the
capture as in production decode), one graph per input set, rotating over sets of fresh
queries/selections so the gathered rows are not found in L2 (the caches are far larger than L2).
``eager_us`` (one config per section) adds the Python/validation overhead of an eager call.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import flex_peers  # noqa: E402
from _harness import (  # noqa: E402
    bench,
    copies_for_l2,
    gpu_meta,
    graph_bench_chains,
    measure_ceilings,
    peer_diff,
    write_results,
)  # noqa: E402
from longattn import rms_norm_rotary  # noqa: E402
from longattn._rotary import rope_cache  # noqa: E402
from longattn.sparse import (  # noqa: E402
    dynamic_sparse_attention,
    sparse_attention_indexer,
    sparse_attention_layer,
)
from longattn.testing import error_stats  # noqa: E402

H, N, KV, R, BUDGET, NI, DI = 256, 24, 4, 64, 2048, 16, 128
DEV = "cuda"
TS = (32768, 65536, 131072, 262144)
MIN_TIME = 0.1
CHAIN = 4  # layers per chained graph (layer section)


def _gqa():
    try:
        from longattn.gqa import group_query_attention

        return group_query_attention
    except Exception:  # pragma: no cover - depends on the checkout
        return None


class Layer:
    """One layer's state: main cache [B, KV, C, H], rotary tables, norms, indexer block keys."""

    def __init__(self, b, cap, cache_dtype):
        self.b, self.cap, self.dtype = b, cap, cache_dtype
        shape = (b, KV, cap, H)
        if cache_dtype == torch.int8:
            self.k = torch.randint(-127, 128, shape, device=DEV, dtype=torch.int8)
            self.v = torch.randint(-127, 128, shape, device=DEV, dtype=torch.int8)
            self.k_scale = torch.full((1,), 0.02, device=DEV)
            self.v_scale = torch.full((1,), 0.02, device=DEV)
        else:
            self.k = torch.randn(shape, device=DEV, dtype=cache_dtype)
            self.v = torch.randn(shape, device=DEV, dtype=cache_dtype)
            self.k_scale = self.v_scale = None
        self.cos, self.sin = rope_cache(cap + 8, H // 2, device=DEV)
        self.qn = 1 + 0.1 * torch.randn(H, device=DEV)
        self.kn = 1 + 0.1 * torch.randn(H, device=DEV)
        self.block_keys = torch.randn(b, cap // R + 1, DI, device=DEV)

    def cache_bytes(self, t):
        return 2 * self.b * KV * t * H * self.k.element_size()


def _inputs(layer, s, t, n_sets, budget):
    b = layer.b
    seqlens = torch.full((b,), t - 1, dtype=torch.int32, device=DEV)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(b, s, N * H, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(b, s, KV * H, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(b, s, KV * H, device=DEV, dtype=torch.bfloat16)
        iq = torch.randn(b, s, NI * DI, device=DEV, dtype=torch.bfloat16)
        sel, cnt = sparse_attention_indexer(
            iq, layer.block_keys, seqlens, compress_ratio=R, token_budget=budget,
            total_sequence_length=t,
        )  # fmt: skip
        sets.append(dict(q=q, k=k, v=v, iq=iq, sel=sel, cnt=cnt))
    return seqlens, sets


def _dsa(layer, x, seqlens, t, sel, cnt, validate=False):
    return dynamic_sparse_attention(
        x["q"], x["k"], x["v"], layer.k, layer.v, selected_indices=sel, selected_counts=cnt,
        seqlens_k=seqlens, total_sequence_length=t, num_heads=N, kv_num_heads=KV,
        cos_cache=layer.cos, sin_cache=layer.sin, do_rotary=True, q_norm_weight=layer.qn,
        k_norm_weight=layer.kn, k_scale=layer.k_scale, v_scale=layer.v_scale, validate=validate,
    )[0]  # fmt: skip


def _dsa_sel(layer, seqlens, t, x):
    return _dsa(layer, x, seqlens, t, x["sel"], x["cnt"])


def _layer_step(layer, x, seqlens, t, budget, validate=True):
    """Indexer + DSA of one layer; ``validate=False``: no host-side value checks (no sync:
    the indexer's validate=False, DSA's validate="off")."""
    sel, cnt = sparse_attention_indexer(
        x["iq"], layer.block_keys, seqlens, compress_ratio=R, token_budget=budget,
        total_sequence_length=t, validate=validate,
    )  # fmt: skip
    return _dsa(layer, x, seqlens, t, sel, cnt, validate=False if validate else "off")


def _layer_step_x(layer, seqlens, t, budget, x):
    return _layer_step(layer, x, seqlens, t, budget)


def _fused_step(layer, x, seqlens, t, budget, validate="off"):
    """``sparse_attention_layer``: the indexer + DSA as one op (the prologue in the select
    launch); ``validate="off"``: no host-side value check (no sync), as ``_layer_step``."""
    return sparse_attention_layer(
        x["iq"], layer.block_keys, x["q"], x["k"], x["v"], layer.k, layer.v, seqlens_k=seqlens,
        total_sequence_length=t, num_heads=N, kv_num_heads=KV, compress_ratio=R,
        token_budget=budget, cos_cache=layer.cos, sin_cache=layer.sin, do_rotary=True,
        q_norm_weight=layer.qn, k_norm_weight=layer.kn, k_scale=layer.k_scale,
        v_scale=layer.v_scale, validate=validate,
    )[0]  # fmt: skip


def _fused_step_b(layer, seqlens, t, x):
    """``_fused_step`` at the default budget, in ``_chain_us``'s argument order."""
    return _fused_step(layer, x, seqlens, t, BUDGET)


def _dense_x(layer, seqlens, t, x):
    return _dense(layer, x, seqlens, t)


def _dense(layer, x, seqlens, t):
    gqa = _gqa()
    if gqa is not None:
        return gqa(
            x["q"], x["k"], x["v"], layer.k, layer.v, seqlens_k=seqlens,
            total_sequence_length=t, num_heads=N, kv_num_heads=KV, cos_cache=layer.cos,
            sin_cache=layer.sin, do_rotary=True, q_norm_weight=layer.qn,
            k_norm_weight=layer.kn, k_scale=layer.k_scale, v_scale=layer.v_scale,
        )[0]  # fmt: skip
    return _sdpa_dense(layer, t, x)  # SDPA fallback: attention only (no prologue)


def _sdpa_dense(layer, t, x):
    """torch SDPA of the S new queries over all T cached keys (bf16 cache slice, no prologue)."""
    return sdpa_grouped(x["q"], layer.k[:, :, :t], layer.v[:, :, :t])


@functools.lru_cache(maxsize=4)
def _grouped_causal_mask(s, t, group, device):
    """[group * S, T] bool: row g*S + i sees keys j <= T - S + i (built once, outside timings)."""
    return torch.ones(s, t, dtype=torch.bool, device=device).tril(t - s).repeat(group, 1)


def sdpa_grouped(q, k, v):
    """SDPA of q ``[B, S, N*H]`` (the last S positions) over k/v ``[B, KV, T, H]`` -> ``[B, N, S,
    H]``, each KV head's query group folded into rows (``[B, KV, G*S, H]``): plain multi-head
    attention, no ``enable_gqa``, and no mask at S = 1, so SDPA may take its fused kernels
    (the former form, a bool mask with ``enable_gqa``, took 1.7-14 ms at S = 8, 25-50x its S = 1
    time: no fused kernel ran it)."""
    b, s, _ = q.shape
    kv, t, h = k.shape[1:]
    group = q.shape[2] // (kv * h)
    qg = q.view(b, s, kv, group, h).permute(0, 2, 3, 1, 4).reshape(b, kv, group * s, h)
    mask = _grouped_causal_mask(s, t, group, q.device) if s > 1 else None
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.view(b, kv * group, s, h)


def _graph_time(fn, sets):
    """Median us of CUDA-graph replays of ``fn(x)``, one graph per input set (rotated); if a
    capture fails, the eager median (printed), so one failing peer does not stop the run."""
    fn(sets[0])  # compile / warm up outside the capture
    torch.cuda.synchronize()
    try:
        return _graph_time_inner(fn, sets)
    except Exception as exc:  # pragma: no cover - depends on the peer's capturability
        print(f"graph capture failed ({type(exc).__name__}: {exc}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return bench(fn, [(x,) for x in sets], min_time_s=MIN_TIME)["median_us"]


def _graph_time_inner(fn, sets):
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in sets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                fn(x)
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(stream)
    t = bench(lambda g: g.replay(), [(g,) for g in graphs], min_time_s=MIN_TIME)
    del graphs
    return t["median_us"]


def _set_bytes(layer, s, budget):
    """K+V bytes one input set's selections read at most (``budget + r`` rows per query row)."""
    return layer.b * s * KV * (budget + R) * H * 2 * layer.k.element_size()


def _dsa_bytes(layer, s, sets):
    """Bytes DSA must read: valid candidate K/V rows (once per KV group) + Q + output + meta."""
    cnt = torch.stack([x["cnt"] for x in sets]).double().mean(0).sum().item()  # sum over rows
    rows = cnt * KV * H * 2 * layer.k.element_size()
    qo = 2 * layer.b * s * N * H * 2
    meta = layer.b * s * sets[0]["sel"].shape[1] * 4
    return rows + qo + meta


def _row(section, layer, s, t, budget, **vals):
    return dict(section=section, cache=str(layer.dtype).removeprefix("torch."), B=layer.b,
                S=s, T=t, budget=budget, **vals)  # fmt: skip


def _chain_us(step, chain, s, t, budget, min_time_s=MIN_TIME):
    """Per-layer us of one graph running ``step(layer, seqlens, t, x)`` once per layer of
    ``chain`` (each its own cache, block keys and inputs), back to back: a model's decode
    graph. Several such graphs, each over its own input sets (fresh selections), are rotated
    so that their gathered rows exceed 3x the L2 (one graph of 4 layers at B=1 S=1 reads ~35 MB:
    replayed alone, it would find them in L2)."""
    n = copies_for_l2(len(chain) * _set_bytes(chain[0], s, budget), min_sets=1, max_sets=8)
    inputs = [_inputs(ly, s, t, n, budget) for ly in chain]
    chains = [[functools.partial(step, ly, seqlens, t, xs[i]) for ly, (seqlens, xs) in
               zip(chain, inputs)] for i in range(n)]  # fmt: skip
    return graph_bench_chains(chains, min_time_s=min_time_s)["median_us"]


def _layer_step_b(layer, seqlens, t, x):
    """``_layer_step`` at the default budget, in ``_chain_us``'s argument order."""
    return _layer_step(layer, x, seqlens, t, BUDGET)


@contextlib.contextmanager
def _variant(dsa=None, select=None, merge_early_o=None, trigger=None, merge_one_warp_from=None):
    """The DSA tier's default config plus ``dsa`` keys, the select kernel's defaults plus
    ``select`` keys, the merge's ``MERGE_EARLY_O`` and ``MERGE_ONE_WARP_FROM`` and
    ``_triton_utils.PDL_EARLY_TRIGGER`` (None: unchanged) (options not yet a default)."""
    from longattn import _triton_merge, _triton_utils
    from longattn.sparse.triton import decode as dsa_decode
    from longattn.sparse.triton import select as sel_mod

    orig_cfg, orig_sel = dsa_decode.decode_config, sel_mod.SELECT_DEFAULTS
    orig_warps = sel_mod.select_num_warps
    orig_merge, orig_trigger = _triton_merge.MERGE_EARLY_O, _triton_utils.PDL_EARLY_TRIGGER
    orig_one_warp = _triton_merge.MERGE_ONE_WARP_FROM
    if merge_one_warp_from is not None:
        _triton_merge.MERGE_ONE_WARP_FROM = merge_one_warp_from
    if merge_early_o is not None:
        _triton_merge.MERGE_EARLY_O = merge_early_o
    if trigger is not None:
        _triton_utils.PDL_EARLY_TRIGGER = trigger
    select = dict(select or {})
    warps = select.pop("num_warps", None)  # the select launch's warps (select_num_warps)
    orig_rows = sel_mod.TILE_MAX_ROWS  # launches whose default floor takes tile maxima
    sel_mod.TILE_MAX_ROWS = select.pop("TILE_MAX_ROWS", orig_rows)
    dsa_decode.decode_config = lambda *a: dict(orig_cfg(*a), **(dsa or {}))
    sel_mod.SELECT_DEFAULTS = dict(orig_sel, **select)
    if warps:
        sel_mod.select_num_warps = lambda nb_pad: warps
    try:
        yield
    finally:
        dsa_decode.decode_config, sel_mod.SELECT_DEFAULTS = orig_cfg, orig_sel
        sel_mod.select_num_warps = orig_warps
        sel_mod.TILE_MAX_ROWS = orig_rows
        _triton_merge.MERGE_EARLY_O = orig_merge
        _triton_merge.MERGE_ONE_WARP_FROM = orig_one_warp
        _triton_utils.PDL_EARLY_TRIGGER = orig_trigger


# A/B variants of the layer section (the defaults' measured alternatives):
# - FUSE_PROLOGUE (S = 1, off: lost at B=4): the DSA split kernel does the prologue's work (one
#   launch fewer). Its sm_90 build takes 195 registers at H=256 bf16 (unfused 121; 42 KB of
#   shared memory at 2 stages): 2 programs per SM; a cap of 168 keeps 3 without spills, 128
#   keeps the unfused kernel's 4 with 56 bytes of spills outside the loop (benchmarks/sass.py
#   dsa-decode --set FUSE_PROLOGUE=True --stages 2 --maxnreg N);
# - the select launch's warps (default 8 for 1K-4K-block rows, select_num_warps): a radix step
#   is a block-wide reduction, fewer warps = fewer partial sums to combine per barrier;
# - late: session 28's latency defaults off (select EARLY_SCORES, DSA EARLY_CNT, MERGE_EARLY_O,
#   the score / select launches' early PDL trigger): the layer as before them (the options one
#   by one were variants of that session, sparse_early_trigger_ab_h100.json);
# - two_scan: the select's radix scatter masked by chosen & (slot < k), which triton 3.6 builds
#   with two cumsums (ONE_SCAN off: the default until session 29, which changed it on sm_90 SASS
#   evidence alone, 1880 vs 2456 instructions at 4096 blocks);
# - merge_4w: the 4-warp merge programs at every slot count (_triton_merge.MERGE_ONE_WARP_FROM
#   off; the default until session 30, which timed the one-warp programs from 64 slots on: the
#   DSA split plan writes 66 slots at B=1 S=1, 2 CTA barriers instead of 14 in sm_90 SASS);
# - unpacked: the radix scatter without PACKED_SCATTER (session 30's SASS-only default): its
#   64-bit pointers and mask change layout through shared memory (6 more CTA barriers at 4096
#   blocks);
# - radix_steps / rank: the select's rank method (RANK_SELECT: the candidates above the k-th
#   largest of 2 * KB_PAD group maxima, compacted and ranked by one [CAP, CAP] comparison; the
#   default at 4096 blocks, session 31) off / on at every row width (with the default floor:
#   the score launch's tile maxima where its tiling serves them); rank_cross: on, with the
#   floor from one [R, C] view of the row (RANK_FLOOR "cross", untimed); rank_groups: the
#   session-31 floor (the k-th of 2 * KB_PAD strided group maxima, reduced in the select)
#   instead of the tile maxima (RANK_FLOOR "tiles" by default since session 32);
#   tiles_any_rows: the tile maxima also for launches of more than select.TILE_MAX_ROWS rows
#   (B * S; the default there since session 34 is the groups floor);
# - prefetch: the DSA split loop's index entries loaded one step ahead (PREFETCH, launched
#   with >= 3 stages), so that triton 3.6's pipeliner double-buffers the K/V gathers (sm_90
#   ttgir: 2 x [32, 256] tiles, async_wait num 2; the default loop gets one buffer and waits
#   num 0: each tile's index load and K/V round trip exposed after the previous tile's
#   math); H=256 bf16: 117 registers (default 155), 73 KB of shared memory (3 per SM);
#   prefetch_w2: with the split plan capped at one wave of 2 programs per SM (SM_PROGRAMS=2);
# - again: the defaults re-timed (the run's noise).
# Entries: (DSA cfg keys, select cfg keys[, MERGE_EARLY_O[, PDL_EARLY_TRIGGER[,
# MERGE_ONE_WARP_FROM]]]).
MERGE_NEVER = 1 << 30  # a MERGE_ONE_WARP_FROM no slot count reaches (None keeps the default)
_VARIANTS = {
    "fused": (dict(FUSE_PROLOGUE=True), None),
    "fused168": (dict(FUSE_PROLOGUE=True, maxnreg=168), None),
    "fused128": (dict(FUSE_PROLOGUE=True, maxnreg=128), None),
    "sel_w2": (None, dict(num_warps=2)),
    "sel_w4": (None, dict(num_warps=4)),
    "sel_w16": (None, dict(num_warps=16)),
    "late": (dict(EARLY_CNT=False), dict(EARLY_SCORES=False), False, False),
    "two_scan": (None, dict(ONE_SCAN=False, PACKED_SCATTER=False)),
    "unpacked": (None, dict(PACKED_SCATTER=False)),
    "merge_4w": (None, None, None, None, MERGE_NEVER),
    "radix_steps": (None, dict(RANK_SELECT=False)),
    "rank": (None, dict(RANK_SELECT=True)),
    "rank_cross": (None, dict(RANK_SELECT=True, RANK_FLOOR="cross")),
    "rank_groups": (None, dict(RANK_FLOOR="groups")),
    "rank_groups_all": (None, dict(RANK_SELECT=True, RANK_FLOOR="groups")),
    "tiles_any_rows": (None, dict(TILE_MAX_ROWS=1 << 30)),  # (a row count no launch reaches)
    "prefetch": (dict(PREFETCH=True), None),
    "prefetch_w2": (dict(PREFETCH=True, SM_PROGRAMS=2), None),
    "again": (None, None),
}


# A/B variants of the cache section's int8 rows, over the int8 default (sm_90 builds at H=256,
# bf16 activations; BLOCK_N 32 capped at 168 registers: 3 programs per SM, the split plan at
# one wave of them; 1 stage, and for splits of >= 8 tiles 3 stages with the index entries one
# tile ahead, LONG_SPLIT_PREFETCH, since session 34):
# - long_plain: long splits at 3 stages without PREFETCH (the default of sessions 23-33);
# - wide: the rows read as int32 words (WIDE_I8; sm_90 SASS 1-stage loop 726 -> 571
#   instructions, 127 registers); H100 session 35 2-6% slower (there named "dsa_us" against
#   "bytes", sparse_cache_int8_wide_session35_h100.json, with s3 and four_per_sm: slower);
# - wide_four_per_sm: that build capped at 128 registers, 4 programs per SM;
# - v_bytes: V read one byte per element (V_PAIRS off; V_PAIRS, V as int16 channel pairs, is
#   the default since session 36: sm_90 SASS 1-stage loop 726 -> 662 instructions, 112
#   registers; H100 same process, budget 8192, B=1 S=1 / B=1 S=8 / B=4 S=1 / B=4 S=8 26.53 /
#   98.34 / 50.11 / 260.03 -> 25.22 / 73.34 / 43.49 / 199.68 us, run as "v_pairs" then,
#   sparse_cache_v_pairs_session36_h100.json), and v_pairs_four_per_sm: the default capped at
#   128 registers, 4 programs per SM (28.48 / 73.06 / 42.69 / 199.90 us there).
# (Older variants, "prev" (uncapped, 2 stages) and "s1" / "s2" / "s3": sparse_cache_h100.json,
# sparse_cache_prefetch_session34_h100.json.)
_CACHE_VARIANTS = {
    "long_plain": dict(LONG_SPLIT_PREFETCH=False),
    "wide": dict(WIDE_I8=True),
    "wide_four_per_sm": dict(WIDE_I8=True, maxnreg=128, SM_PROGRAMS=4),
    "v_bytes": dict(V_PAIRS=False),
    "v_pairs_four_per_sm": dict(V_PAIRS=True, maxnreg=128, SM_PROGRAMS=4),
}
# ... and of every cache dtype's rows: the split loop's PREFETCH (see the layer section's
# variants; budget 8192 gives splits of several tiles)
_CACHE_ALL_VARIANTS = {"prefetch": dict(PREFETCH=True)}


def layer_section(rows, layers, copy_tbs, chains, grid):
    for b in grid["B"]:
        layer = layers[(b, torch.bfloat16)]
        chain = chains[b]
        for t in grid["T"]:
            for s in grid["S"]:
                n_sets = copies_for_l2(_set_bytes(layer, s, BUDGET), max_sets=32)
                seqlens, sets = _inputs(layer, s, t, n_sets, BUDGET)
                t_dsa = _graph_time(functools.partial(_dsa_sel, layer, seqlens, t), sets)
                step = functools.partial(_layer_step_x, layer, seqlens, t, BUDGET)
                t_layer = _graph_time(step, sets)
                dense_sets = sets[:2]  # the dense read (>= 134 MB) exceeds L2 by itself
                dense = functools.partial(_dense_x, layer, seqlens, t)
                t_dense = _graph_time(dense, dense_sets)
                nbytes = _dsa_bytes(layer, s, sets)
                tbs = nbytes / (t_dsa * 1e-6) / 1e12
                c_layer = _chain_us(_layer_step_b, chain, s, t, BUDGET)
                c_fused = _chain_us(_fused_step_b, chain, s, t, BUDGET)
                t_fused = _graph_time(functools.partial(_fused_step_b, layer, seqlens, t), sets)
                c_dsa = _chain_us(_dsa_sel, chain, s, t, BUDGET)
                c_dense = _chain_us(_dense_x, chain, s, t, BUDGET)
                variants = {}
                for name, (dsa, sel, *merge) in _VARIANTS.items():
                    if grid["variants"] is not None and name not in grid["variants"]:
                        continue
                    if s != 1 and dsa and dsa.get("FUSE_PROLOGUE"):  # S = 1 only
                        continue
                    with _variant(dsa, sel, *merge):
                        variants[f"chain_layer_{name}_us"] = round(
                            _chain_us(_layer_step_b, chain, s, t, BUDGET), 2
                        )
                        variants[f"chain_layer_op_{name}_us"] = round(
                            _chain_us(_fused_step_b, chain, s, t, BUDGET), 2
                        )
                        if dsa or any(m is not None for m in merge):
                            variants[f"chain_dsa_{name}_us"] = round(
                                _chain_us(_dsa_sel, chain, s, t, BUDGET), 2
                            )
                r = _row("layer", layer, s, t, BUDGET, indexer_plus_dsa_us=round(t_layer, 2),
                         dsa_us=round(t_dsa, 2), indexer_us=round(t_layer - t_dsa, 2),
                         dense_gqa_us=round(t_dense, 2),
                         dense_over_sparse=round(t_dense / t_layer, 2),
                         dsa_MB=round(nbytes / 1e6, 2), dsa_TBps=round(tbs, 3),
                         dsa_vs_copy_BW=round(tbs / copy_tbs, 3),
                         chain_layer_us=round(c_layer, 2), chain_dsa_us=round(c_dsa, 2),
                         chain_dense_us=round(c_dense, 2),
                         chain_dense_over_sparse=round(c_dense / c_layer, 2),
                         layer_op_us=round(t_fused, 2), chain_layer_op_us=round(c_fused, 2),
                         chain_dense_over_layer_op=round(c_dense / c_fused, 2),
                         **variants)  # fmt: skip
                rows.append(r)
                print(r, flush=True)
                del sets


def cache_section(rows, layers, copy_tbs):
    t = 131072
    for b in (1, 4):
        for budget, dtypes in ((BUDGET, (torch.bfloat16, torch.float16)),
                               (8192, (torch.bfloat16, torch.int8))):  # fmt: skip
            base = None
            for dt in dtypes:
                layer = layers[(b, dt)]
                for s in (1, 8):
                    n_sets = copies_for_l2(_set_bytes(layer, s, budget), max_sets=32)
                    seqlens, sets = _inputs(layer, s, t, n_sets, budget)
                    us = _graph_time(functools.partial(_dsa_sel, layer, seqlens, t), sets)
                    nbytes = _dsa_bytes(layer, s, sets)
                    tbs = nbytes / (us * 1e-6) / 1e12
                    key = (b, budget, s)
                    if dt == torch.bfloat16:
                        base = {**(base or {}), key: us}
                    r = _row("cache", layer, s, t, budget, dsa_us=round(us, 2),
                             vs_bf16=round(us / base[key], 3), dsa_MB=round(nbytes / 1e6, 2),
                             dsa_TBps=round(tbs, 3), dsa_vs_copy_BW=round(tbs / copy_tbs, 3))  # fmt: skip
                    more = _CACHE_VARIANTS if dt == torch.int8 else {}
                    for name, dsa in {**more, **_CACHE_ALL_VARIANTS}.items():
                        with _variant(dsa):
                            v_us = _graph_time(functools.partial(_dsa_sel, layer, seqlens, t), sets)
                        r[f"dsa_{name}_us"] = round(v_us, 2)
                    rows.append(r)
                    print(r, flush=True)


def eager_section(rows, layers):
    layer = layers[(1, torch.bfloat16)]
    t = 131072
    seqlens, sets = _inputs(layer, 1, t, 4, BUDGET)
    t_eager = bench(
        lambda x: _layer_step(layer, x, seqlens, t, BUDGET), [(x,) for x in sets],
        min_time_s=MIN_TIME,
    )["median_us"]  # fmt: skip
    t_nosync = bench(
        lambda x: _layer_step(layer, x, seqlens, t, BUDGET, validate=False),
        [(x,) for x in sets], min_time_s=MIN_TIME,
    )["median_us"]  # fmt: skip
    # correctness at this shape: triton vs the chunked tier (fp32 math), same inputs
    x = sets[0]
    ours = _dsa(layer, x, seqlens, t, x["sel"], x["cnt"])
    want = dynamic_sparse_attention(
        x["q"], x["k"], x["v"], layer.k, layer.v, selected_indices=x["sel"],
        selected_counts=x["cnt"], seqlens_k=seqlens, total_sequence_length=t, num_heads=N,
        kv_num_heads=KV, cos_cache=layer.cos, sin_cache=layer.sin, do_rotary=True,
        q_norm_weight=layer.qn, k_norm_weight=layer.kn, backend="chunked",
    )[0]  # fmt: skip
    err = error_stats(ours, want.double()).rel_rms
    r = _row("eager", layer, 1, t, BUDGET, indexer_plus_dsa_eager_us=round(t_eager, 2),
             indexer_plus_dsa_eager_nosync_us=round(t_nosync, 2),
             rel_rms_vs_chunked=f"{err:.2e}")  # fmt: skip
    rows.append(r)
    print(r, flush=True)


def memory_section(rows, layers):
    t = 262144
    for dt in (torch.bfloat16, torch.int8):
        layer = layers[(1, dt)]
        seqlens, sets = _inputs(layer, 1, t, 1, BUDGET)
        x = sets[0]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _layer_step(layer, x, seqlens, t, BUDGET)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        need = layer.cache_bytes(t)
        r = _row("memory", layer, 1, t, BUDGET, cache_MB=round(need / 1e6, 1),
                 op_peak_extra_MB=round(extra / 1e6, 3),
                 peak_over_cache=round((need + extra) / need, 4))  # fmt: skip
        rows.append(r)
        print(r, flush=True)


def _flex_sets(layer, s, t, seqlens, sets, k_flat, v_flat):
    """Per input set: (q_rot [B*S, N, 1, H], k_flat, v_flat, block mask) for the flex peer."""
    b = layer.b
    row_b = torch.arange(b * s, device=DEV) // s
    qpos = (seqlens.long() + 1 - s)[row_b] + torch.arange(b * s, device=DEV) % s
    pos = qpos.view(b, s)
    out = []
    for x in sets:
        q_rot = rms_norm_rotary(x["q"], layer.qn, layer.cos, layer.sin, pos, num_heads=N)
        q_rot = q_rot.view(b * s, 1, N, H).transpose(1, 2).contiguous()
        bm = flex_peers.sparse_block_mask(x["sel"], x["cnt"], row_b * layer.cap, qpos, R,
                                          b * layer.cap)  # fmt: skip
        out.append((q_rot, k_flat, v_flat, bm))
    return out


def peers_section(rows, layers):
    scale = H**-0.5
    for b in (1, 4):
        layer = layers[(b, torch.bfloat16)]
        for t in (32768, 131072, 262144):
            for s in (1, 8):
                n_sets = copies_for_l2(_set_bytes(layer, s, BUDGET), min_sets=4, max_sets=32)
                seqlens, sets = _inputs(layer, s, t, n_sets, BUDGET)
                t_dsa = _graph_time(functools.partial(_dsa_sel, layer, seqlens, t), sets)
                ours = _dsa_sel(layer, seqlens, t, sets[0]).float()  # also appends K/V
                r = _row("peers", layer, s, t, BUDGET, dsa_us=round(t_dsa, 2))
                try:
                    k_flat, v_flat = flex_peers.flat_kv(layer.k), flex_peers.flat_kv(layer.v)
                    fsets = _flex_sets(layer, s, t, seqlens, sets, k_flat, v_flat)

                    def flex(q, k, v, bm):
                        return flex_peers.flex_sparse(q, k, v, bm, scale=scale, compiled=True)

                    got = flex(*fsets[0]).transpose(1, 2).reshape(b, s, N * H).float()
                    diff, rel = peer_diff(got, ours)
                    r["flex_maxdiff"], r["flex_maxdiff_rel"] = round(diff, 4), round(rel, 4)
                    t_flex = _graph_time(lambda a: flex(*a), fsets)
                    r["flex_us"] = round(t_flex, 2)
                    r["speedup_vs_flex"] = round(t_flex / t_dsa, 2)
                    del k_flat, v_flat, fsets
                except Exception as exc:
                    print(f"    flex n/a: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                t_sdpa = _graph_time(functools.partial(_sdpa_dense, layer, t), sets[:1])
                r["sdpa_dense_us"] = round(t_sdpa, 2)
                r["speedup_vs_sdpa_dense"] = round(t_sdpa / t_dsa, 2)
                rows.append(r)
                print(r, flush=True)
                torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--sections", default="layer,cache,eager,memory,peers")
    ap.add_argument("--B", default="1,4", help="layer section: batch sizes")
    ap.add_argument("--T", default=",".join(map(str, TS)), help="layer section: lengths")
    ap.add_argument("--S", default="1,8", help="layer section: new tokens per step")
    ap.add_argument("--variants", default=None, help="layer section: A/B variants (default all)")
    args = ap.parse_args(argv)
    grid = {k: [int(v) for v in getattr(args, k).split(",")] for k in ("B", "T", "S")}
    grid["variants"] = args.variants.split(",") if args.variants is not None else None
    torch.manual_seed(0)
    meta = gpu_meta()
    ceil = measure_ceilings(copy_bytes=1 << 30, gemm_n=4096)
    meta.update(ceil)
    meta["dense_peer"] = "group_query_attention (auto tier)" if _gqa() else "torch SDPA"
    print(meta, flush=True)
    notes = [
        f"geometry: H={H}, (N, KV)=({N}, {KV}), r={R}, budget {BUDGET} (max_selected "
        f"{BUDGET + R - 1}), indexer NI={NI} x DI={DI} (assumed), QSA mode, bf16 activations,"
        " rotary + QK-norm on, every sequence at length T (decode: the last S positions).",
        "times: CUDA-graph replay of the public op calls (indexer: triton kernel + torch top-k +"
        " emission; DSA: prologue + split kernel + merge), median over rotated input sets;"
        " indexer_us = (indexer + DSA) - DSA.",
        "dsa_TBps: bytes DSA must read (valid candidate K+V rows once per KV group, Q, output,"
        " indices) / time; dsa_vs_copy_BW against the measured copy bandwidth.",
        "dense_gqa_us: dense decode of the same S new tokens over all T cached keys.",
        "layer_op_us / chain_layer_op_us: sparse_attention_layer (the indexer + DSA as one "
        "op: the DSA prologue runs in the select launch, 4 launches instead of 5), one-step "
        "graph / chained; chain_dense_over_layer_op = chain_dense_us / chain_layer_op_us.",
        f"chain_*_us: per-layer time in ONE CUDA graph of {CHAIN} back-to-back steps over "
        f"{CHAIN} distinct layers (own cache, block keys, inputs), as a model's decode graph "
        "runs them, rotating over several such graphs (fresh selections each) so that their "
        "gathered rows exceed 3x the L2; the other columns replay a one-step graph per timing, "
        "which also counts the graph launch's latency.",
    ]
    rows: list[dict] = []
    layers = {}
    # caches hold the longest length asked for (--T up to 1M: 16384 blocks, select.MAX_BLOCKS);
    # a layer-only run builds just its batch sizes' bf16 layers (B=4 at 1M: 16 GiB per layer)
    cap = max(max(TS), *grid["T"]) + 64
    layer_only = args.sections == "layer"
    for b in grid["B"] if layer_only else (1, 4):
        for dt in (torch.bfloat16,) if layer_only else (torch.bfloat16, torch.float16, torch.int8):
            layers[(b, dt)] = Layer(b, cap, dt)
    # extra bf16 layers for the chained (model-like) graphs of the layer section
    need_chain = "layer" in args.sections.split(",")
    chains = {b: [layers[(b, torch.bfloat16)]] + [Layer(b, cap, torch.bfloat16)
                                                  for _ in range(CHAIN - 1) if need_chain]
              for b in grid["B"] if (b, torch.bfloat16) in layers}  # fmt: skip
    t0 = time.time()
    sections = {
        "layer": lambda: layer_section(rows, layers, ceil["copy_TBps"], chains, grid),
        "cache": lambda: cache_section(rows, layers, ceil["copy_TBps"]),
        "eager": lambda: eager_section(rows, layers),
        "memory": lambda: memory_section(rows, layers),
        "peers": lambda: peers_section(rows, layers),
    }
    for name in args.sections.split(","):
        sections[name]()
        print(f"== {name} done at {time.time() - t0:.1f}s", flush=True)
        write_results("sparse", meta, rows, notes=notes, out_dir=args.out)


if __name__ == "__main__":
    main()

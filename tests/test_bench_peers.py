"""The benchmarks' FlexAttention peers compute what our ops compute (CPU, flex's eager path).

A peer that computed a different function would make every speed ratio in benchmarks/results
meaningless, so each one is checked here against longattn's reference tier on random inputs.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

import longattn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import flex_peers  # noqa: E402

pytest.importorskip("torch.nn.attention.flex_attention")

B, N, KV, H = 3, 8, 2, 32
F32 = torch.float32


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's eager path warns that it is not compiled
        yield


def _gqa_case(g, s, past, cap):
    """New tokens on top of ``past`` cached rows (ragged), our reference op's output and caches."""
    q = torch.randn(B, s, N * H, generator=g)
    k = torch.randn(B, s, KV * H, generator=g)
    v = torch.randn(B, s, KV * H, generator=g)
    pk = torch.randn(B, KV, cap, H, generator=g)
    pv = torch.randn(B, KV, cap, H, generator=g)
    total = torch.tensor([p + s for p in past])
    return q, k, v, pk, pv, total


@pytest.mark.parametrize(
    "s,past,window,softcap,sink",
    [
        (1, (40, 17, 64), -1, 0.0, "none"),  # decode, ragged
        (1, (40, 17, 64), 9, 30.0, "head"),
        (5, (11, 0, 30), 4, 0.0, "smooth"),  # chunked prefill and a first prompt
        (7, (20, 3, 9), -1, 5.0, "head"),
    ],
)
def test_flex_gqa_matches_reference(s, past, window, softcap, sink):
    g = torch.Generator().manual_seed(11 + s)
    cap = max(past) + s
    q, k, v, pk, pv, total = _gqa_case(g, s, past, cap)
    head_sink = torch.randn(N, generator=g) if sink == "head" else None
    scale = 1 / math.sqrt(H)
    out, pres_k, pres_v = longattn.group_query_attention(
        q, k, v, pk.clone(), pv.clone(), seqlens_k=(total - 1).to(torch.int32),
        total_sequence_length=cap, num_heads=N, kv_num_heads=KV, local_window_size=window,
        softcap=softcap, head_sink=head_sink, smooth_softmax=sink == "smooth", scale=scale,
        backend="reference",
    )  # fmt: skip
    sink_t = head_sink if sink == "head" else (torch.zeros(N) if sink == "smooth" else None)
    mask = flex_peers.gqa_block_mask(total, s, cap, window=window)
    peer = flex_peers.flex_gqa(
        q.view(B, s, N, H).transpose(1, 2), pres_k, pres_v, mask, scale=scale,
        softcap=softcap, sink=sink_t,
    )  # fmt: skip
    peer = peer.transpose(1, 2).reshape(B, s, N * H)
    # Our first-prompt padding rows are zeros by contract; flex has no notion of them.
    real = torch.arange(s)[None, :] < total[:, None]
    torch.testing.assert_close(peer[real], out[real], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("block_size", [16, 32])
def test_flex_paged_decode_matches_paged_attention(block_size):
    g = torch.Generator().manual_seed(block_size)
    past = [37, 16, 70]  # a partial trailing block, an exactly full one, several blocks
    lens = torch.tensor([p + 1 for p in past])
    per_seq = [math.ceil(n / block_size) for n in lens.tolist()]
    max_blocks = max(per_seq) + 1
    num_blocks = 3 * sum(per_seq)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((B, max_blocks), 0, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    kc = torch.randn(num_blocks, block_size, KV, H, generator=g)
    vc = torch.randn(num_blocks, block_size, KV, H, generator=g)
    q = torch.randn(B, N * H, generator=g)
    k = torch.randn(B, KV * H, generator=g)
    v = torch.randn(B, KV * H, generator=g)
    scale = 1 / math.sqrt(H)
    out = longattn.paged_attention(
        q, k, v, kc, vc, torch.arange(B + 1, dtype=torch.int32),
        torch.tensor(past, dtype=torch.int32), table, num_heads=N, kv_num_heads=KV,
        scale=scale, backend="reference",
    )  # fmt: skip
    mask = flex_peers.paged_block_mask(table, lens, block_size, num_blocks)
    peer = flex_peers.flex_paged_decode(
        q.view(B, N, 1, H),
        flex_peers.paged_physical_kv(kc),
        flex_peers.paged_physical_kv(vc),
        mask,
        scale=scale,
    )
    torch.testing.assert_close(peer.reshape(B, N * H), out, rtol=2e-5, atol=2e-5)


def test_flex_sparse_matches_dynamic_sparse_attention():
    """Whole-block selections (QSA) + the trailing incomplete block, S = 2 rows, with a sink."""
    g = torch.Generator().manual_seed(5)
    r, s, cap = 16, 2, 112
    total = torch.tensor([100, 64, 37])
    q = torch.randn(B, s, N * H, generator=g)
    k = torch.randn(B, s, KV * H, generator=g)
    v = torch.randn(B, s, KV * H, generator=g)
    pk = torch.randn(B, KV, cap, H, generator=g)
    pv = torch.randn(B, KV, cap, H, generator=g)
    sink = torch.randn(N, generator=g)
    picks = [[0, 3, 6], [1, 3], [2]]  # complete blocks chosen per sequence
    sel = torch.full((B * s, 4 * r), -1, dtype=torch.int32)
    cnt = torch.zeros(B * s, dtype=torch.int32)
    for b in range(B):
        blocks = sorted(set(picks[b] + [(int(total[b]) - 1) // r]))  # + the last block
        rows = torch.cat([torch.arange(x * r, x * r + r) for x in blocks])
        rows = rows[rows < total[b]]
        for i in range(s):
            sel[b * s + i, : len(rows)] = rows.to(torch.int32)  # future rows are skipped
            cnt[b * s + i] = len(rows)
    scale = 1 / math.sqrt(H)
    out, pres_k, pres_v = longattn.dynamic_sparse_attention(
        q, k, v, pk.clone(), pv.clone(), selected_indices=sel, selected_counts=cnt,
        seqlens_k=(total - 1).to(torch.int32), total_sequence_length=cap, num_heads=N,
        kv_num_heads=KV, head_sink=sink, scale=scale, backend="reference",
    )  # fmt: skip
    row_b = torch.arange(B * s) // s
    qpos = total[row_b] - s + torch.arange(B * s) % s
    mask = flex_peers.sparse_block_mask(sel, cnt, row_b * cap, qpos, r, B * cap)
    peer = flex_peers.flex_sparse(
        q.reshape(B * s, 1, N, H).transpose(1, 2),
        flex_peers.flat_kv(pres_k),
        flex_peers.flat_kv(pres_v),
        mask,
        scale=scale,
        sink=sink,
    )
    torch.testing.assert_close(peer.reshape(B, s, N * H), out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("s", [1, 3])
def test_sdpa_grouped_is_gqa_sdpa_with_the_bottom_right_causal_mask(s):
    """bench_sparse's dense SDPA peer (query groups folded into rows) computes what SDPA with
    ``enable_gqa`` and the causal mask of the last S positions computes."""
    import bench_sparse

    g = torch.Generator().manual_seed(s)
    t = 50
    q = torch.randn(B, s, N * H, generator=g)
    k = torch.randn(B, KV, t, H, generator=g)
    v = torch.randn(B, KV, t, H, generator=g)
    mask = torch.ones(s, t, dtype=torch.bool).tril(t - s)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.view(B, s, N, H).transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(bench_sparse.sdpa_grouped(q, k, v), want, rtol=1e-5, atol=1e-5)


def test_peer_check_flags_a_wrong_decode_peer():
    """Decode outputs over thousands of random keys are O(0.01): a peer attending another
    window (half of T = 32K, the features section's decode shape) differs by less than the
    former absolute bound 0.05, but is flagged now."""
    import bench_gqa

    g = torch.Generator().manual_seed(0)
    t = 32768
    q = torch.randn(2, N, 1, H, generator=g)
    k = torch.randn(2, KV, t, H, generator=g)
    v = torch.randn(2, KV, t, H, generator=g)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ours = sdpa(q, k, v, enable_gqa=True)
    wrong = sdpa(q, k[:, :, t // 2 :], v[:, :, t // 2 :], enable_gqa=True)  # half window
    row = {}
    assert float((wrong - ours).abs().max()) < 0.05  # what the old check accepted
    assert not bench_gqa._peer_check("peer", wrong, ours, row)
    assert row["peer_maxdiff_rel"] > 0.1
    assert bench_gqa._peer_check("same", ours.bfloat16(), ours, row)  # bf16 rounding passes

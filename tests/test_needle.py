"""The planted-needle harness at CPU scale (T = 4K, small heads)."""

from __future__ import annotations

import pytest
import torch

from longattn.sparse.needle import build_needle_case, dense_attention_fp64, run_needle


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_needles_found_and_error_within_dense(dtype):
    case = build_needle_case(4096, token_budget=512, compress_ratio=64, dtype=dtype, seed=1)
    assert len(case.needles) == 5 and case.needles[0] == 0 and case.needles[-1] == 4094
    for dense in ("gqa", "sdpa"):
        rep = run_needle(case, dense=dense)
        print(rep)
        assert rep.recall == 1.0
        assert rep.selected == 512  # 8 blocks of 64, no trailing tokens at qpos 4095
        assert rep.ratio <= 2.0, str(rep)


def test_harness_detects_missed_needles():
    case = build_needle_case(4096, token_budget=128, compress_ratio=64, seed=2)  # 2 of 5 blocks
    rep = run_needle(case)
    assert rep.recall == pytest.approx(2 / 5)
    assert rep.ratio > 10, str(rep)


def test_dense_fp64_matches_softmax_definition():
    case = build_needle_case(
        256,
        compress_ratio=16,
        token_budget=64,
        num_heads=4,
        kv_num_heads=2,
        head_size=16,
        index_heads=2,
        index_head_dim=16,
        dtype=torch.float32,
    )
    pk = case.past_key.clone()
    pv = case.past_value.clone()
    pk[:, :, -1] = case.key.reshape(1, 2, 16)
    pv[:, :, -1] = case.value.reshape(1, 2, 16)
    got = dense_attention_fp64(case.query, pk, pv, 4).reshape(4, 16)
    q = case.query.reshape(4, 16).double()
    for n in range(4):
        p = torch.softmax(pk[0, n // 2].double() @ q[n] / 4.0, 0)
        torch.testing.assert_close(got[n], p @ pv[0, n // 2].double())

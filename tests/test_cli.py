"""The command line: info and a small precision report run and print what they promise."""

from __future__ import annotations

import subprocess
import sys

import torch

from longattn import _cascade, cli

OPS = ("rms_norm_rotary", "group_query_attention", "paged_attention",
       "sparse_attention_indexer", "dynamic_sparse_attention")  # fmt: skip


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "auto ->" in out
    for op in OPS:  # every public op's tiers
        assert f"\n{op} (" in out, op
    assert out.count("auto ->") == len(OPS)


def test_info_follows_the_backend_variable(capsys, monkeypatch):
    """``auto ->`` is what backend="auto" picks, LONGATTN_BACKEND included."""
    monkeypatch.setenv("LONGATTN_BACKEND", "reference")
    _cascade.reload_env()
    try:
        assert cli.main(["info"]) == 0
    finally:
        monkeypatch.delenv("LONGATTN_BACKEND")
        _cascade.reload_env()
    out = capsys.readouterr().out
    assert out.count("auto -> reference") == len(OPS)


def test_last_backend_is_the_tier_that_ran():
    from longattn import rms_norm_rotary, rope_cache

    cos, sin = rope_cache(8, 16)
    x, w = torch.randn(1, 2, 32), torch.ones(16)
    for backend in ("reference", "chunked"):
        rms_norm_rotary(x, w, cos, sin, num_heads=2, backend=backend)
        assert _cascade.last_backend("rms_norm_rotary") == backend


def test_python_dash_m_and_bad_arguments():
    run = lambda *a: subprocess.run([sys.executable, "-m", "longattn", *a], capture_output=True,
                                    text=True, timeout=300)  # fmt: skip
    assert run("--help").returncode == 0
    bad = run("precision", "--positions", "10", "--max-pos", "5")
    assert bad.returncode == 2 and "--positions (10) must be <= --max-pos (5)" in bad.stderr
    bad = run("demo", "--device", "nodevice")
    assert bad.returncode == 2 and "not a torch device" in bad.stderr


def test_precision_small(capsys):
    args = ["precision", "--positions", "512", "--max-pos", "4096", "--head-sizes", "64",
            "--num-heads", "2"]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "legacy bf16" in out and "exact fp32 -> fp16" in out and "at the floor" in out


def test_bench_without_gpu_says_why(capsys):
    import torch

    if not torch.cuda.is_available():
        assert cli.main(["bench"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out

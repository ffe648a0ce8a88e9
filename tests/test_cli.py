"""The command line: info and a small precision report run and print what they promise."""

from __future__ import annotations

from longattn import cli


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "rms_norm_rotary" in out and "auto ->" in out


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

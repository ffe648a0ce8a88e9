"""RMSNormRotary: every tier against an fp64 truth, onnxruntime's RotaryEmbedding, bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

import longattn
from longattn.rms_norm_rotary.reference import rms_norm_rotary_fp64
from longattn.testing import assert_close_to_fp64, error_stats

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def make_inputs(b, s, n, h, *, rot_dim=None, dtype=FP16, cache_dtype=FP32, max_pos=512,
                with_pos=True, device="cpu", seed=0):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, n * h, generator=g) * 2.0
    x[..., :: max(h // 8, 1)] *= 8.0  # a few large-magnitude outlier channels, as in Q/K
    w = 1.0 + 0.25 * torch.randn(h, generator=g)
    cos, sin = longattn.rope_cache(max_pos, rot_dim or h, dtype=torch.float64)
    pos = torch.randint(0, max_pos, (b, s), generator=g) if with_pos else None
    dev = torch.device(device)
    return (
        x.to(dtype).to(dev),
        w.to(dev),
        cos.to(cache_dtype).to(dev),
        sin.to(cache_dtype).to(dev),
        None if pos is None else pos.to(dev),
    )


def naive_fp32(
    x, w, cos, sin, pos, *, num_heads, eps, interleaved, rotary_offset, exact, out_dtype
):
    """An independent same-precision composition (the tolerance baseline): fp32 torch ops."""
    b, s, d = x.shape
    h = d // num_heads
    if pos is None:
        pos = torch.arange(s).expand(b, s)
    xf = x.float().view(b, s, num_heads, h)
    y = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps) * w.float()
    if not exact:
        y = y.to(x.dtype).float()
    r = 2 * cos.shape[1]
    c = cos.float()[pos.cpu()][:, :, None].to(x.device)
    sn = sin.float()[pos.cpu()][:, :, None].to(x.device)
    seg = y[..., rotary_offset : rotary_offset + r]
    if interleaved:
        a, bb = seg[..., 0::2], seg[..., 1::2]
        rot = torch.stack([a * c - bb * sn, a * sn + bb * c], -1).flatten(-2)
    else:
        a, bb = seg[..., : r // 2], seg[..., r // 2 :]
        rot = torch.cat([a * c - bb * sn, a * sn + bb * c], -1)
    y = y.clone()
    y[..., rotary_offset : rotary_offset + r] = rot
    return y.reshape(b, s, d).to(out_dtype)


def truth_fp64(x, w, cos, sin, pos, *, num_heads, eps, interleaved, rotary_offset, exact):
    b, s, _ = x.shape
    p = pos if pos is not None else torch.arange(s, device=x.device).expand(b, s)
    return rms_norm_rotary_fp64(x, w, cos, sin, p, num_heads=num_heads, epsilon=eps,
                                interleaved=interleaved, rotary_offset=rotary_offset, exact=exact)  # fmt: skip


def check_backend(backend, b, s, n, h, *, dtype, out_dtype, interleaved=False, rot_dim=None,
                  rotary_offset=0, exact=True, with_pos=True, cache_dtype=FP32, device="cpu", k=2.0,
                  seed=0):  # fmt: skip
    x, w, cos, sin, pos = make_inputs(b, s, n, h, rot_dim=rot_dim, dtype=dtype, with_pos=with_pos,
                                      cache_dtype=cache_dtype, device=device, seed=seed)  # fmt: skip
    kw = dict(
        num_heads=n, eps=1e-6, interleaved=interleaved, rotary_offset=rotary_offset, exact=exact
    )
    out = longattn.rms_norm_rotary(x, w, cos, sin, pos, num_heads=n, interleaved=interleaved,
                                   rotary_offset=rotary_offset, out_dtype=out_dtype, exact=exact,
                                   backend=backend)  # fmt: skip
    assert out.dtype == out_dtype and out.shape == x.shape
    truth = truth_fp64(x, w, cos, sin, pos, **kw)
    base = naive_fp32(x, w, cos, sin, pos, out_dtype=out_dtype, **kw)
    assert_close_to_fp64(out, truth, base, k=k, name=f"{backend} out", out_dtype=out_dtype)
    return out, truth


TORCH_CASES = [
    # (b, s, n, h, rot_dim, rotary_offset, interleaved, with_pos)
    (1, 1, 4, 64, None, 0, False, False),
    (2, 113, 3, 80, None, 0, True, True),
    (1, 239, 2, 128, 64, 32, False, True),
    (2, 17, 2, 256, None, 0, False, True),
    (1, 33, 5, 128, 96, 0, True, False),
]


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: "b{}s{}n{}h{}r{}o{}i{}p{}".format(*c))
@pytest.mark.parametrize(
    "dtype,out_dtype,exact",
    [(BF16, FP16, True), (BF16, BF16, False), (FP16, FP16, True), (FP32, FP32, True)],
)
def test_torch_tiers_vs_fp64(backend, case, dtype, out_dtype, exact):
    b, s, n, h, rot, off, inter, with_pos = case
    check_backend(backend, b, s, n, h, dtype=dtype, out_dtype=out_dtype, interleaved=inter,
                  rot_dim=rot, rotary_offset=off, exact=exact, with_pos=with_pos)  # fmt: skip


@pytest.mark.parametrize("cache_dtype", [BF16, FP16])
def test_low_precision_cos_sin_used_as_stored(cache_dtype):
    # The op reads bf16/fp16 cos/sin exactly as stored (legacy caches): the fp64 truth is built
    # from the same stored values.
    check_backend("chunked", 2, 9, 2, 64, dtype=BF16, out_dtype=BF16, cache_dtype=cache_dtype,
                  exact=False)  # fmt: skip


def test_exact_fp16_output_is_near_the_floor():
    # exact + fp32 cos/sin + fp16 output: one rounding, so the error is the rounding floor.
    x, w, cos, sin, pos = make_inputs(1, 256, 4, 128, dtype=BF16, max_pos=4096)
    out = longattn.rms_norm_rotary(x, w, cos, sin, pos, num_heads=4, out_dtype=FP16)
    t = truth_fp64(x, w, cos, sin, pos, num_heads=4, eps=1e-6, interleaved=False, rotary_offset=0,
                   exact=True)  # fmt: skip
    ours, floor = error_stats(out, t), error_stats(t.to(FP16), t)
    assert ours.rel_rms <= 1.05 * floor.rel_rms, (ours, floor)
    legacy = longattn.rms_norm_rotary(x, w, cos.to(BF16), sin.to(BF16), pos, num_heads=4,
                                      exact=False)  # fmt: skip
    assert error_stats(legacy, t).rel_rms > 4 * ours.rel_rms


@pytest.mark.interpret
@pytest.mark.parametrize(
    "b,s,n,h,rot,off,inter,with_pos,exact,dtype,out_dtype",
    [
        (1, 1, 2, 64, None, 0, False, False, True, FP16, FP16),
        (2, 5, 3, 80, None, 0, True, True, True, FP32, FP16),
        (1, 7, 2, 128, 64, 32, False, True, True, FP16, FP32),
        (1, 3, 2, 256, None, 0, False, True, False, FP16, FP16),
        (2, 4, 5, 64, 48, 8, True, True, False, FP32, FP32),
    ],
)
def test_triton_interpreter(b, s, n, h, rot, off, inter, with_pos, exact, dtype, out_dtype):
    out, _ = check_backend("triton", b, s, n, h, dtype=dtype, out_dtype=out_dtype,
                           interleaved=inter, rot_dim=rot, rotary_offset=off, exact=exact,
                           with_pos=with_pos)  # fmt: skip
    ref = longattn.rms_norm_rotary(*make_inputs(b, s, n, h, rot_dim=rot, dtype=dtype,
                                                with_pos=with_pos),
                                   num_heads=n, interleaved=inter, rotary_offset=off,
                                   out_dtype=out_dtype, exact=exact, backend="reference")  # fmt: skip
    # Both round the same value once; they may differ only where fp32 vs fp64 straddles a tie.
    assert (out.float() - ref.float()).abs().max() <= 2 * torch.finfo(
        out_dtype
    ).eps * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("h", [64, 80, 128, 256])
@pytest.mark.parametrize("s", [1, 113, 239, 4096])
@pytest.mark.parametrize("dtype,out_dtype,exact", [(BF16, FP16, True), (BF16, BF16, True),
                                                   (BF16, BF16, False), (FP16, FP16, True)])  # fmt: skip
@pytest.mark.parametrize("mode", ["half", "interleaved", "partial"])
def test_triton_gpu(h, s, dtype, out_dtype, exact, mode):
    rot, off = (h // 2, h // 4) if mode == "partial" else (None, 0)
    check_backend("triton", 2, s, 8, h, dtype=dtype, out_dtype=out_dtype,
                  interleaved=mode == "interleaved", rot_dim=rot, rotary_offset=off, exact=exact,
                  device="cuda", seed=s + h)  # fmt: skip


@pytest.mark.gpu
def test_auto_picks_triton_on_gpu(capsys, monkeypatch):
    monkeypatch.setenv("LONGATTN_DEBUG", "1")
    longattn._cascade.reload_env()
    x, w, cos, sin, pos = make_inputs(1, 8, 2, 64, dtype=BF16, device="cuda")
    longattn.rms_norm_rotary(x, w, cos, sin, pos, num_heads=2)
    assert "backend=triton" in capsys.readouterr().err


# --------------------------------------------------------------------------- onnxruntime oracle


def _ort_rotary(x_normed, cos, sin, pos, *, num_heads, rot_dim, interleaved, onnx_dtype):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    elem = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}[onnx_dtype]
    b, s, d = x_normed.shape
    node = helper.make_node(
        "RotaryEmbedding", ["input", "position_ids", "cos_cache", "sin_cache"], ["output"],
        domain="com.microsoft", interleaved=int(interleaved), num_heads=num_heads,
        rotary_embedding_dim=rot_dim,
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "rope",
        [helper.make_tensor_value_info("input", elem, [b, s, d]),
         helper.make_tensor_value_info("position_ids", TensorProto.INT64, [b, s]),
         helper.make_tensor_value_info("cos_cache", elem, list(cos.shape)),
         helper.make_tensor_value_info("sin_cache", elem, list(sin.shape))],
        [helper.make_tensor_value_info("output", elem, [b, s, d])],
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np_dtype = "float32" if onnx_dtype == "fp32" else "float16"
    (out,) = sess.run(None, {"input": x_normed.numpy().astype(np_dtype), "position_ids": pos.numpy(),
                             "cos_cache": cos.numpy().astype(np_dtype),
                             "sin_cache": sin.numpy().astype(np_dtype)})  # fmt: skip
    return torch.from_numpy(out)


@pytest.mark.parametrize(
    "h,rot,interleaved,dtype",
    [(64, None, False, FP32), (128, None, True, FP32), (128, 64, False, FP32), (64, None, False, FP16),
     (80, None, True, FP16)],
)  # fmt: skip
def test_rotary_matches_onnxruntime(h, rot, interleaved, dtype):
    """Our rotary == com.microsoft::RotaryEmbedding applied to the (fp64-exact) normalized x."""
    b, s, n = 2, 19, 3
    x, w, cos, sin, pos = make_inputs(b, s, n, h, rot_dim=rot, dtype=dtype, max_pos=256)
    # Feed both the same already-normalized rows (RMS 1 in fp64, then rounded to the op dtype):
    # our op's norm is then the identity up to rounding, and the rotary is what is compared.
    xn = longattn._rotary.rms_norm(x.reshape(b, s, n, h).double(), torch.ones(h), 0.0)
    xn = xn.reshape(b, s, n * h).to(dtype)
    c, sn = (cos, sin) if dtype == FP32 else (cos.to(dtype), sin.to(dtype))
    ours = longattn.rms_norm_rotary(xn, torch.ones(h), c, sn, pos, num_heads=n, epsilon=0.0,
                                    interleaved=interleaved, out_dtype=dtype, backend="chunked")  # fmt: skip
    ort = _ort_rotary(xn.float(), cos, sin, pos, num_heads=n, rot_dim=rot or h,
                      interleaved=interleaved, onnx_dtype="fp32" if dtype == FP32 else "fp16")  # fmt: skip
    cc, ss = c.double()[pos][:, :, None], sn.double()[pos][:, :, None]
    truth = longattn._rotary.apply_rotary(xn.double().reshape(b, s, n, h), cc, ss,
                                          interleaved=interleaved).reshape(b, s, n * h)  # fmt: skip
    # Each is judged against the fp64 rotary of the same input, with the other as the baseline.
    # k=4: our op also re-normalizes the (RMS 1 +- rounding) rows, a few extra roundings that ORT,
    # which only rotates, does not do (visible on pass-through channels of partial rotary).
    assert_close_to_fp64(ours, truth, ort.to(dtype), k=4.0, name="ours vs ort-judged truth")
    assert_close_to_fp64(ort.to(dtype), truth, ours, k=4.0, name="ort vs our-judged truth")


# --------------------------------------------------------------------------------- bad input


def _good():
    return make_inputs(1, 4, 2, 64, dtype=FP16)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(x=a["x"][0]), ValueError, "x must be 3-D"),
        (lambda a: a.update(x=a["x"].to(torch.int32)), TypeError, "x must have dtype"),
        (lambda a: a.update(num_heads=3), ValueError, "num_heads"),
        (lambda a: a.update(num_heads=0), ValueError, "num_heads must be a positive int"),
        (lambda a: a.update(weight=torch.ones(32)), ValueError, "weight must have shape"),
        (lambda a: a.update(sin=a["sin"][:, :16]), ValueError, "sin_cache must have shape"),
        (lambda a: a.update(cos=a["cos"].half(), sin=a["sin"].float()), TypeError, "sin_cache"),
        (lambda a: a.update(cos=torch.ones(512, 40), sin=torch.ones(512, 40)), ValueError,
         "rotary_dim"),
        (lambda a: a.update(rotary_offset=8), ValueError, "rotary_dim"),
        (lambda a: a.update(cos=torch.ones(512, 40)), ValueError, r"cos_cache.shape\[1\] = 80"),
        (lambda a: a.update(rotary_offset=-2), ValueError, "rotary_offset"),
        (lambda a: a.update(rotary_offset=True), ValueError, "rotary_offset must be a non-negative"),
        (lambda a: a.update(epsilon=-1e-6), ValueError, "epsilon must be a finite float >= 0"),
        (lambda a: a.update(epsilon=float("inf")), ValueError, "epsilon must be a finite float"),
        (lambda a: a.update(epsilon=float("nan")), ValueError, "epsilon must be a finite float"),
        (lambda a: a.update(epsilon=True), ValueError, "epsilon must be a finite float"),
        (lambda a: a.update(pos=torch.zeros(1, 5, dtype=torch.int64)), ValueError, "position_ids"),
        (lambda a: a.update(pos=a["pos"].float()), TypeError, "position_ids"),
        (lambda a: a.update(pos=a["pos"] + 1000), ValueError, r"position_ids must lie in \[0, 512\)"),
        (lambda a: a.update(pos=a["pos"] - 1000), ValueError, "position_ids must lie"),
        (lambda a: a.update(pos=None, cos=a["cos"][:3], sin=a["sin"][:3]), ValueError,
         "exceed the cos_cache"),
        (lambda a: a.update(x=a["x"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         "x must be contiguous in its last dim"),
        (lambda a: a.update(out_dtype=torch.int8), TypeError, "out_dtype"),
        (lambda a: a.update(backend="cuda"), ValueError, "backend must be one of"),
    ],
)  # fmt: skip
def test_bad_input(mutate, exc, match):
    x, w, cos, sin, pos = _good()
    a = dict(x=x, weight=w, cos=cos, sin=sin, pos=pos, num_heads=2, rotary_offset=0,
             out_dtype=None, backend="auto", epsilon=1e-6)  # fmt: skip
    mutate(a)
    with pytest.raises(exc, match=match):
        longattn.rms_norm_rotary(a["x"], a["weight"], a["cos"], a["sin"], a["pos"],
                                 num_heads=a["num_heads"], rotary_offset=a["rotary_offset"],
                                 out_dtype=a["out_dtype"], backend=a["backend"],
                                 epsilon=a["epsilon"])  # fmt: skip


@pytest.mark.parametrize("flag", ["interleaved", "exact"])
def test_string_flags_are_refused(flag):
    """A flag given as a string is refused, not read by its truthiness."""
    x, w, cos, sin, pos = _good()
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        longattn.rms_norm_rotary(x, w, cos, sin, pos, num_heads=2, **{flag: "false"})


def test_explicit_triton_bf16_on_cpu_names_the_gate():
    x, w, cos, sin, pos = make_inputs(1, 4, 2, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="rms_norm_rotary: backend 'triton' cannot run: .*bf16"):
        longattn.rms_norm_rotary(x, w, cos, sin, pos, num_heads=2, backend="triton")


def test_output_fully_written():
    # The op allocates its output; check no element is left unwritten (NaN from empty memory would
    # show) for every backend, incl. a pass-through region.
    x, w, cos, sin, pos = make_inputs(2, 3, 2, 64, rot_dim=32, dtype=FP16)
    for be in ["reference", "chunked", "triton"]:
        out = longattn.rms_norm_rotary(x, w, cos, sin, pos, num_heads=2, rotary_offset=16,
                                       backend=be)  # fmt: skip
        assert torch.isfinite(out).all(), be


# ---------------------------------------------------------------------------- torch-native


def test_opcheck():
    x, w, cos, sin, pos = make_inputs(1, 5, 2, 64, dtype=FP16)
    for args in [(x, w, cos, sin, pos), (x, w, cos, sin, None)]:
        torch.library.opcheck(
            torch.ops.longattn.rms_norm_rotary.default,
            (*args, 2, 1e-6, False, 0, FP16, True, "chunked"),
        )


def test_torch_compile_fullgraph():
    x, w, cos, sin, pos = make_inputs(2, 7, 2, 64, dtype=FP32)

    def f(x, pos):
        y = longattn.rms_norm_rotary(x, w, cos, sin, pos, num_heads=2, out_dtype=FP32)
        return y * 2 + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, pos), f(x, pos))


def test_all_positions_and_layouts_agree_between_tiers():
    # Cross-tier agreement on a spread of configurations (chunked vs reference, fp32 out).
    for h, inter, off in itertools.product([64, 128], [False, True], [0, 16]):
        x, w, cos, sin, pos = make_inputs(2, 6, 2, h, rot_dim=h // 2, dtype=FP32, seed=h + off)
        outs = [
            longattn.rms_norm_rotary(
                x, w, cos, sin, pos, num_heads=2, interleaved=inter, rotary_offset=off, backend=be
            )  # fmt: skip
            for be in ("reference", "chunked")
        ]
        assert (outs[0] - outs[1]).abs().max() <= 4 * torch.finfo(FP32).eps * outs[0].abs().max()


@pytest.mark.interpret
@pytest.mark.parametrize("h,rot,off,inter", [(64, None, 0, False), (128, 64, 32, True)])
@pytest.mark.parametrize("tile", [False, True])
def test_triton_table_layouts_agree(h, rot, off, inter, tile):
    """Both ways the kernel reads weight/cos/sin rows (TILE_TABLES) give the reference result."""
    from longattn.rms_norm_rotary.triton.kernel import rms_norm_rotary_triton

    x, w, cos, sin, pos = make_inputs(2, 5, 3, h, rot_dim=rot, dtype=FP16, with_pos=True)
    kw = dict(num_heads=3, epsilon=1e-6, interleaved=inter, rotary_offset=off, exact=True)
    out = rms_norm_rotary_triton(x, w, cos, sin, pos, out_dtype=FP16, block_n=2, num_warps=1,
                                 tile_tables=tile, **kw)  # fmt: skip
    ref = longattn.rms_norm_rotary(x, w, cos, sin, pos, out_dtype=FP16, backend="reference", **kw)
    assert (out.float() - ref.float()).abs().max() <= 2 * torch.finfo(FP16).eps * ref.abs().max()


@pytest.mark.parametrize("backend", ["reference", "chunked", "triton"])
def test_validate_false_skips_the_check_and_clamps(backend):
    """validate=False: no host read of position_ids; out-of-range ids are clamped into the
    cache by every tier (never read out of bounds), and validate=True still raises."""
    x, w, cos, sin, pos = make_inputs(1, 6, 2, 64, dtype=FP16)
    bad = pos.clone()
    bad[0, 1], bad[0, 4] = 700, -3  # cache rows: 512
    with pytest.raises(ValueError, match="position_ids must lie"):
        longattn.rms_norm_rotary(x, w, cos, sin, bad, num_heads=2, backend=backend)
    got = longattn.rms_norm_rotary(x, w, cos, sin, bad, num_heads=2, validate=False,
                                   backend=backend)  # fmt: skip
    want = longattn.rms_norm_rotary(x, w, cos, sin, bad.clamp(0, 511), num_heads=2,
                                    backend=backend)  # fmt: skip
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="validate must be a bool"):
        longattn.rms_norm_rotary(x, w, cos, sin, pos, num_heads=2, validate=1)

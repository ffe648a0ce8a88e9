"""The backend cascade: auto order, explicit requests, env overrides, debug log."""

from __future__ import annotations

import pytest
import torch

from longattn import _cascade


def gates(triton_ok=True, chunked_ok=True):
    def make(ok, why):
        return lambda explicit: (ok, why)

    return {
        "triton": make(triton_ok, "triton gate says no" if not triton_ok else "ok"),
        "chunked": make(chunked_ok, "chunked gate says no" if not chunked_ok else "ok"),
        "reference": make(True, "ok"),
    }


def test_auto_picks_first_passing_tier():
    assert _cascade.select_backend("op", "auto", gates()) == "triton"
    assert _cascade.select_backend("op", "auto", gates(triton_ok=False)) == "chunked"
    assert _cascade.select_backend("op", "auto", gates(False, False)) == "reference"


def test_explicit_backend_that_cannot_run_names_the_gate():
    with pytest.raises(RuntimeError, match="op: backend 'triton' cannot run: triton gate says no"):
        _cascade.select_backend("op", "triton", gates(triton_ok=False))
    assert _cascade.select_backend("op", "reference", gates()) == "reference"


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        _cascade.select_backend("op", "cuda", gates())


def test_env_disable_and_force(monkeypatch):
    monkeypatch.setenv("LONGATTN_DISABLE_TRITON", "1")
    _cascade.reload_env()
    assert _cascade.select_backend("op", "auto", gates()) == "chunked"
    with pytest.raises(RuntimeError, match="disabled by LONGATTN_DISABLE_TRITON=1"):
        _cascade.select_backend("op", "triton", gates())
    monkeypatch.setenv("LONGATTN_DISABLE_CHUNKED", "1")
    _cascade.reload_env()
    assert _cascade.select_backend("op", "auto", gates()) == "reference"
    monkeypatch.delenv("LONGATTN_DISABLE_TRITON")
    monkeypatch.delenv("LONGATTN_DISABLE_CHUNKED")
    monkeypatch.setenv("LONGATTN_BACKEND", "reference")
    _cascade.reload_env()
    assert _cascade.select_backend("op", "auto", gates()) == "reference"
    # An explicit request in code wins over the variable.
    assert _cascade.select_backend("op", "chunked", gates()) == "chunked"
    monkeypatch.setenv("LONGATTN_BACKEND", "triton")
    _cascade.reload_env()
    with pytest.raises(RuntimeError, match="'triton' cannot run"):
        _cascade.select_backend("op", "auto", gates(triton_ok=False))
    monkeypatch.setenv("LONGATTN_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LONGATTN_BACKEND"):
        _cascade.reload_env()


def test_env_is_read_once_per_process(monkeypatch):
    _cascade.reload_env()
    monkeypatch.setenv("LONGATTN_DISABLE_TRITON", "1")
    assert _cascade.select_backend("op", "auto", gates()) == "triton"  # cached settings


def test_debug_logs_choice_once(monkeypatch, capsys):
    monkeypatch.setenv("LONGATTN_DEBUG", "1")
    _cascade.reload_env()
    for _ in range(3):
        _cascade.select_backend("myop", "auto", gates(triton_ok=False))
    err = capsys.readouterr().err
    assert err.count("[longattn] myop: backend=chunked") == 1
    assert "triton gate says no" in err


def test_triton_device_gate_on_cpu():
    cpu = torch.device("cpu")
    ok, why = _cascade.triton_device_gate(cpu, (torch.float16,), explicit=False)
    assert not ok
    if _cascade.interpreter_active():
        assert _cascade.triton_device_gate(cpu, (torch.float16,), explicit=True)[0]
        ok, why = _cascade.triton_device_gate(cpu, (torch.bfloat16,), explicit=True)
        assert not ok and "bf16" in why


def test_describe_gates(monkeypatch):
    monkeypatch.setenv("LONGATTN_DISABLE_CHUNKED", "1")
    _cascade.reload_env()
    d = _cascade.describe_gates(gates(triton_ok=False))
    assert d["triton"] == (False, "triton gate says no")
    assert d["chunked"][0] is False and "LONGATTN_DISABLE_CHUNKED" in d["chunked"][1]
    assert d["reference"][0]


def test_eager_fast_path_only_for_plain_eager_calls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longattn._common import eager_fast_path

    x = torch.randn(3)
    assert eager_fast_path((x, 1, "a"))
    assert not eager_fast_path((torch.randn(3, requires_grad=True),))
    with FakeTensorMode() as mode:
        assert not eager_fast_path((mode.from_tensor(x),))
    seen = []

    def f(t):
        seen.append(eager_fast_path((t,)))
        return t + 1

    torch.compile(f, backend="eager", fullgraph=True)(x)
    assert seen == [False]


@pytest.mark.parametrize("capability, disabled, interp, want", [
    ((9, 0), False, False, True),
    ((10, 0), False, False, True),
    ((8, 0), False, False, False),  # griddepcontrol needs sm_90
    ((9, 0), True, False, False),  # LONGATTN_DISABLE_PDL=1
    ((9, 0), False, True, False),  # the interpreter has no grid dependency control
])  # fmt: skip
def test_pdl_gate(monkeypatch, capability, disabled, interp, want):
    """Programmatic dependent launch only where griddepcontrol exists, and it can be turned off;
    kernels then get PDL=False and no launch_pdl keyword."""
    from longattn import _triton_utils as tu

    monkeypatch.setattr(tu, "cuda_capability", lambda index: capability)
    monkeypatch.setattr(tu, "interpret", lambda: interp)
    monkeypatch.setenv("LONGATTN_DISABLE_PDL", "1" if disabled else "0")
    tu._sm90_compiled.cache_clear()
    try:
        assert tu.pdl_enabled(torch.device("cuda", 0)) is want
        assert tu.pdl_enabled(torch.device("cpu")) is False
        assert tu.pdl_kwargs(torch.zeros(1)) == {"PDL": False}
    finally:
        tu._sm90_compiled.cache_clear()


def _before_wait_is_program_ids(stmts) -> bool:
    """The statements a split kernel may run before its PDL wait: program ids (and casts of
    them)."""
    import ast

    for st in stmts:
        text = ast.unparse(st)
        if isinstance(st, ast.Assign) and (
            "tl.program_id(" in text or text.endswith(".to(tl.int64)")
        ):
            continue
        return False
    return True


def test_pdl_kernels_wait_for_the_previous_grid_first():
    """A kernel launched with programmatic dependent launch may start while the previous kernel
    still runs: its first statement must be the grid-dependency wait (no load before it); the
    split kernels may read their program ids first."""
    import ast
    import inspect

    from longattn._triton_merge import merge_splits_kernel
    from longattn.gqa.triton.decode import gqa_decode_split_kernel
    from longattn.gqa.triton.prologue import gqa_prologue_kernel
    from longattn.paged.triton.attention import paged_attn_kernel
    from longattn.paged.triton.prologue import paged_prologue_kernel
    from longattn.rms_norm_rotary.triton.kernel import _rms_norm_rotary_kernel
    from longattn.sparse.triton.decode import dsa_split_kernel
    from longattn.sparse.triton.indexer import indexer_score_kernel
    from longattn.sparse.triton.select import indexer_select_kernel

    kernels = [merge_splits_kernel, gqa_decode_split_kernel, gqa_prologue_kernel,
               paged_attn_kernel, paged_prologue_kernel, _rms_norm_rotary_kernel,
               dsa_split_kernel, indexer_score_kernel, indexer_select_kernel]  # fmt: skip
    for k in kernels:
        fn = k.fn if hasattr(k, "fn") else k
        tree = ast.parse(inspect.getsource(fn).lstrip())
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # docstring
        waits = [i for i, st in enumerate(body) if ast.unparse(st) == "wait_prior_grids(PDL)"]
        assert waits, f"{fn.__name__} has no wait_prior_grids(PDL) statement"
        before = body[: waits[0]]
        if fn.__name__ in ("gqa_decode_split_kernel", "dsa_split_kernel"):
            assert _before_wait_is_program_ids(before), fn.__name__
        else:
            assert not before, f"{fn.__name__} starts with {ast.unparse(body[0])!r}"
        assert "PDL" in fn.__code__.co_varnames[: fn.__code__.co_argcount], fn.__name__

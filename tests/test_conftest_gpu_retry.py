"""``tests/conftest.py``'s GPU-memory hooks, run without a GPU: a pytest subprocess loads them
with the CUDA flag forced on and runs GPU-marked tests that raise CUDA out-of-memory errors."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")

HOOKS = f"""
import importlib.util

spec = importlib.util.spec_from_file_location("gpu_hooks_under_test", {str(CONFTEST)!r})
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)
hooks._HAS_CUDA = True  # the GPU branch of the hooks, on the CPU
_gpu_memory_share = hooks._gpu_memory_share
pytest_runtest_call = hooks.pytest_runtest_call
"""

TESTS = """
import pytest
import torch

calls = {}


def _count(name):
    calls[name] = calls.get(name, 0) + 1
    return calls[name]


@pytest.mark.gpu
def test_out_of_memory_then_pass():
    if _count("pass") == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")


@pytest.mark.gpu
def test_wrapped_out_of_memory_then_real_failure():
    if _count("wrapped") == 1:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("Comparing ... resulted in the unexpected exception") from exc
    assert False, "the re-run's own failure"


@pytest.mark.gpu
def test_out_of_memory_then_skip():
    if _count("skip") == 1:
        raise torch.OutOfMemoryError("CUDA out of memory.")
    pytest.skip("skipped on the re-run")


@pytest.mark.gpu
def test_plain_failure_is_not_rerun():
    assert _count("plain") == 1
    assert False, "a failure that is not out of memory"
"""


def test_out_of_memory_gpu_tests_rerun_alone(pytester):
    pytester.makeconftest(HOOKS)
    pytester.makepyfile(test_sim=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "markers=gpu: x")
    result.assert_outcomes(passed=1, failed=2, skipped=1)
    result.stdout.fnmatch_lines(["*the re-run's own failure*"])
    result.stdout.fnmatch_lines(["*a failure that is not out of memory*"])

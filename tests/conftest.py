"""Test configuration shared by all tests.

- Without CUDA, ``TRITON_INTERPRET=1`` is set before anything imports triton, so the Triton
  kernels run on the CPU (tests marked ``interpret`` use tiny shapes and fp16/fp32 data: the
  triton 3.6 interpreter mishandles bf16).
- Tests marked ``gpu`` are skipped without CUDA; run them on the GPU machine with ``pytest -m gpu``.
- GPU memory under pytest-xdist: each GPU test holds a shared lock on one lock file and returns
  its cached blocks afterwards; a GPU test that runs out of memory is run once more alone (the
  exclusive lock, taken through a turnstile so that new tests wait). At ``-n 6`` on an 80 GB
  card 12 sparse tests ran out of memory in session 37 and passed when re-run.
"""

from __future__ import annotations

import gc
import os
import tempfile
import traceback

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX: no cross-worker lock)
    fcntl = None

_LOCKS = {}  # lock name -> this process's open lock file


def _flock(name: str, mode: int) -> None:
    if fcntl is None:
        return
    if name not in _LOCKS:
        path = os.path.join(tempfile.gettempdir(), f"longattn_gpu_tests_{name}.lock")
        _LOCKS[name] = open(path, "a+")  # noqa: SIM115 (held for the process's life)
    fcntl.flock(_LOCKS[name], mode)


def _on_gpu(item) -> bool:
    return _HAS_CUDA and "gpu" in item.keywords


def _release_gpu_memory() -> None:
    """Collect dropped tensors and return the caching allocator's free blocks to the GPU."""
    gc.collect()
    torch.cuda.empty_cache()


def _out_of_memory(exc) -> bool:
    """``exc`` or an exception it was raised from or during is a CUDA out-of-memory error
    (``assert_close`` re-raises one as a RuntimeError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.fixture(autouse=True)
def _gpu_memory_share(request):
    """A GPU test runs under the shared lock (new ones pass the turnstile first) and gives its
    cached GPU blocks back when it ends, so an idle xdist worker holds little GPU memory."""
    if not _on_gpu(request.node) or fcntl is None:
        yield
        return
    _flock("turnstile", fcntl.LOCK_EX)
    _flock("memory", fcntl.LOCK_SH)
    _flock("turnstile", fcntl.LOCK_UN)
    try:
        yield
    finally:
        _flock("memory", fcntl.LOCK_UN)
        _release_gpu_memory()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A GPU test that ran out of memory runs once more, alone: its shared lock is dropped,
    the turnstile stops new tests, and the exclusive lock waits for the running ones."""
    outcome = yield
    if not _on_gpu(item) or fcntl is None or outcome.excinfo is None:
        return
    if not _out_of_memory(outcome.excinfo[1]):
        return
    traceback.clear_frames(outcome.excinfo[2])  # the failed try's tensors, held by its frames
    _flock("memory", fcntl.LOCK_UN)
    _flock("turnstile", fcntl.LOCK_EX)
    _flock("memory", fcntl.LOCK_EX)
    _flock("turnstile", fcntl.LOCK_UN)
    try:
        _release_gpu_memory()
        item.runtest()
    except BaseException as exc:  # the re-run's own outcome (a failure, a skip) is reported
        if not hasattr(outcome, "force_exception"):  # pluggy < 1.1
            raise
        outcome.force_exception(exc)
    else:
        outcome.force_result(None)
    finally:
        _flock("memory", fcntl.LOCK_SH)


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_env_settings():
    """Each test sees the environment as it is now (the cascade caches it per process)."""
    from longattn import _cascade

    _cascade.reload_env()
    yield
    _cascade.reload_env()


@pytest.fixture
def device():
    return torch.device("cuda" if _HAS_CUDA else "cpu")

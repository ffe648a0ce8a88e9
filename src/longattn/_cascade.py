"""Backend cascade shared by every op: ``triton`` -> ``chunked`` -> ``reference``.

Each op describes, per tier, a gate: a callable ``gate(explicit: bool) -> (ok, reason)``.
``select_backend`` picks the first tier whose gate passes (``backend="auto"``), or checks the
one the caller asked for and raises ``RuntimeError`` naming every failed gate.

Environment variables (read once per process; ``reload_env()`` re-reads them, for tests):

- ``LONGATTN_DISABLE_TRITON=1`` / ``LONGATTN_DISABLE_CHUNKED=1``: auto never picks that tier,
  and an explicit request for it raises.
- ``LONGATTN_BACKEND=<tier>``: replaces ``backend="auto"`` by that tier (explicit requests in
  code win over the variable).
- ``LONGATTN_DEBUG=1``: log the chosen tier once per (op, tier) to stderr.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

TIERS: tuple[str, ...] = ("triton", "chunked", "reference")
BACKENDS: tuple[str, ...] = ("auto", *TIERS)

Gate = Callable[[bool], tuple[bool, str]]


@dataclass(frozen=True)
class EnvSettings:
    disabled: frozenset[str]
    backend: str | None
    debug: bool


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def env_settings() -> EnvSettings:
    disabled = set()
    if _truthy(os.environ.get("LONGATTN_DISABLE_TRITON")):
        disabled.add("triton")
    if _truthy(os.environ.get("LONGATTN_DISABLE_CHUNKED")):
        disabled.add("chunked")
    backend = os.environ.get("LONGATTN_BACKEND") or None
    if backend is not None:
        backend = backend.strip().lower()
        if backend not in BACKENDS:
            raise ValueError(f"LONGATTN_BACKEND must be one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            backend = None
    return EnvSettings(frozenset(disabled), backend, _truthy(os.environ.get("LONGATTN_DEBUG")))


def reload_env() -> EnvSettings:
    """Forget the cached environment settings and read them again."""
    env_settings.cache_clear()
    _logged.clear()
    return env_settings()


_logged: set[tuple[str, str]] = set()


def _log_choice(op: str, tier: str, why: str) -> None:
    if env_settings().debug and (op, tier) not in _logged:
        _logged.add((op, tier))
        print(f"[longattn] {op}: backend={tier} ({why})", file=sys.stderr)


def check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


_last: dict[str, str] = {}


def last_backend(op: str) -> str | None:
    """The tier ``select_backend`` last chose for ``op`` in this process (None before any call):
    what the demo and precision reports print as "the backend that ran"."""
    return _last.get(op)


def select_backend(op: str, backend: str, gates: Mapping[str, Gate]) -> str:
    """Resolve ``backend`` ("auto" or a tier) for ``op`` given each tier's gate."""
    tier = _select(op, backend, gates)
    _last[op] = tier
    return tier


def _select(op: str, backend: str, gates: Mapping[str, Gate]) -> str:
    check_backend_name(backend)
    env = env_settings()
    source = "requested"
    if backend == "auto" and env.backend is not None:
        backend, source = env.backend, "LONGATTN_BACKEND"
    if backend != "auto":
        if backend in env.disabled:
            raise RuntimeError(
                f"{op}: backend {backend!r} was {source} but is disabled by "
                f"LONGATTN_DISABLE_{backend.upper()}=1"
            )
        ok, reason = gates[backend](True)
        if not ok:
            raise RuntimeError(f"{op}: backend {backend!r} cannot run: {reason}")
        _log_choice(op, backend, source)
        return backend
    failures = []
    for tier in TIERS:
        if tier in env.disabled:
            failures.append(f"{tier}: disabled by LONGATTN_DISABLE_{tier.upper()}=1")
            continue
        ok, reason = gates[tier](False)
        if ok:
            _log_choice(op, tier, "auto" + (f"; skipped {'; '.join(failures)}" if failures else ""))
            return tier
        failures.append(f"{tier}: {reason}")
    raise RuntimeError(f"{op}: no backend can run: {'; '.join(failures)}")


def describe_gates(gates: Mapping[str, Gate]) -> dict[str, tuple[bool, str]]:
    """Gate results as auto-selection would see them (for ``longattn info``)."""
    env = env_settings()
    out = {}
    for tier in TIERS:
        if tier in env.disabled:
            out[tier] = (False, f"disabled by LONGATTN_DISABLE_{tier.upper()}=1")
        else:
            out[tier] = gates[tier](False)
    return out


# ---------------------------------------------------------------------------------------------
# Gate building blocks shared by the ops.


@functools.cache
def triton_importable() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    return True, "triton importable"


@functools.cache
def cuda_capability(index: int) -> tuple[int, int]:
    """(major, minor) of CUDA device ``index``, read once (the gates run on every call)."""
    return torch.cuda.get_device_capability(index)


@functools.cache
def interpreter_active() -> bool:
    """``TRITON_INTERPRET=1``, read once: triton itself fixes the mode when a kernel module is
    imported (``triton.jit`` then returns an interpreted function), and the launchers ask on
    every call."""
    return _truthy(os.environ.get("TRITON_INTERPRET"))


def triton_device_gate(
    device: torch.device, dtypes: tuple[torch.dtype, ...], explicit: bool
) -> tuple[bool, str]:
    """Device / dtype gate common to all Triton kernels.

    CUDA: sm >= 8.0 for bf16, sm >= 7.0 otherwise. CPU: only under ``TRITON_INTERPRET=1`` and only
    when ``backend="triton"`` is asked for explicitly (auto never picks the slow interpreter); the
    interpreter of triton 3.6 mishandles bf16 (garbage ``tl.dot``, truncating stores), so bf16 is
    refused there.
    """
    ok, reason = triton_importable()
    if not ok:
        return ok, reason
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = cuda_capability(index)
        need = (8, 0) if torch.bfloat16 in dtypes else (7, 0)
        if (major, minor) < need:
            return False, f"CUDA sm_{major}{minor} < sm_{need[0]}{need[1]} needed for {dtypes}"
        return True, f"CUDA sm_{major}{minor}"
    if device.type == "cpu" and interpreter_active():
        if not explicit:
            return False, "device is cpu (TRITON_INTERPRET=1 runs only when backend='triton')"
        if torch.bfloat16 in dtypes:
            return False, "bf16 under TRITON_INTERPRET=1 is unreliable in triton 3.6"
        return True, "cpu under TRITON_INTERPRET=1"
    return False, f"device is {device.type}; the triton kernels need CUDA"


def always(_explicit: bool) -> tuple[bool, str]:
    return True, "pure torch, any device"

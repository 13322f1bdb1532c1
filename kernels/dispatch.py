"""Which implementation serves an op call: environment switches, backend choice, loud fallback.

Switches (kernels/settings.py; read at every call, so tests can flip them with ``monkeypatch.setenv``):

* ``VIME_RL_KERNEL=1`` turns the kernels on. Off (default): every op runs the reference, and
  that is not a fallback (nothing is logged or counted).
* ``VIME_RL_KERNEL_OPS``: comma-separated allowlist (``logp,grpo_loss``); ``*`` or unset = all.
  An op not on the list runs the reference silently (it was not asked for).
* ``VIME_RL_KERNEL_BACKEND``: backend name (``rlk-triton`` default, ``reference``, a registered
  or entry-point name, or a dotted path ``pkg.module:factory``).
* ``VIME_RL_KERNEL_STRICT=1``: any fallback raises :class:`KernelFallbackError` instead.

A fallback happens when the op is enabled and allowed but the backend cannot be loaded or its
``supports(op, **call.case())`` returns a reason (no CUDA and no interpreter, dtype, TP layout, ...).
It logs ONE warning line per (op, reason) per process (``kernels: <op> falls back to reference:
<reason>``) and counts every such call in :func:`fallback_counts`. An exception raised *inside*
a backend is not a fallback: it propagates (no silent fallbacks).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from kernels import backends, settings
from kernels.contracts.checks import check_call_values

logger = logging.getLogger("kernels")

DEFAULT_BACKEND = settings.BACKEND.default
REFERENCE_BACKEND = "reference"
_KERNELS, _STRICT, _OPS, _BACKEND = settings.KERNELS.get, settings.STRICT.get, settings.OPS.get, settings.BACKEND.get

_fallback_counts: Counter[str] = Counter()
_fallback_reasons: dict[str, Counter[str]] = {}
_logged: set[tuple[str, str]] = set()


class KernelFallbackError(RuntimeError):
    """Raised instead of falling back when ``VIME_RL_KERNEL_STRICT=1``."""

    def __init__(self, op: str, reason: str) -> None:
        super().__init__(f"kernels: {op} cannot run on the kernel backend (strict mode): {reason}")
        self.op = op
        self.reason = reason


def kernels_enabled() -> bool:
    return _KERNELS()


def strict_mode() -> bool:
    return _STRICT()


def allowed_ops() -> frozenset[str] | None:
    """The allowlist, or None for all ops."""
    return _OPS()


def op_allowed(op: str) -> bool:
    allow = _OPS()
    return allow is None or op in allow


def configured_backend_name() -> str:
    return _BACKEND()


def _record_fallback(op: str, reason: str) -> None:
    if strict_mode():
        raise KernelFallbackError(op, reason)
    _fallback_counts[op] += 1
    _fallback_reasons.setdefault(op, Counter())[reason] += 1
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        logger.warning("kernels: %s falls back to reference: %s", op, reason)


def select(op: str, **case: Any) -> tuple[backends.Backend, Callable[..., Any]]:
    """The backend and implementation serving ``op`` for this ``case`` (see backends/base.py)."""
    if not _KERNELS() or not op_allowed(op):
        reference = backends.get_backend(REFERENCE_BACKEND)
        return reference, reference.get(op)
    name = _BACKEND()
    try:
        backend = backends.get_backend(name)
    except (backends.BackendLoadError, ImportError) as exc:
        _record_fallback(op, f"backend {name!r} unavailable: {exc}")
        reference = backends.get_backend(REFERENCE_BACKEND)
        return reference, reference.get(op)
    reason = backend.supports(op, **case)
    if reason is not None:
        _record_fallback(op, reason)
        reference = backends.get_backend(REFERENCE_BACKEND)
        return reference, reference.get(op)
    return backend, backend.get(op)


def run(op: str, call: Any) -> Any:
    """Run ``op``'s checked ``call`` (kernels/contracts/) on the implementation that serves it.

    The value checks the call left to the device (``call.deferred``) run on the host first unless
    the backend's kernels check them (``backend.checks_values``, kernels/device_errors.py)."""
    if not _KERNELS():  # the default: the reference, without building the case
        check_call_values(call)
        return backends.get_backend(REFERENCE_BACKEND).get(op)(call)
    backend, impl = select(op, **call.case())
    if op not in getattr(backend, "checks_values", ()):
        check_call_values(call)
    return impl(call)


def run_host_first(op: str, args: tuple, kwargs: dict) -> Any:
    """``op``'s result for the public call's raw ``args``/``kwargs`` from the host-first entry of the
    backend :func:`run` would ask, or None: the entry declines, or the lane is closed (compiling,
    kernels off, ``op`` not allowed, the backend not loaded yet or without such an entry).

    A backend's ``host_first(op)`` (kernels/backends/base.py) serves only calls its contract accepts
    and ``supports`` admits, with the checked call's bits, so no check and no fallback is skipped;
    a bad call is declined and then named by the contract. The backend is never loaded here: a load
    that fails is a fallback, which :func:`run` records."""
    if torch.compiler.is_compiling() or not _KERNELS() or not op_allowed(op):
        return None
    first = getattr(backends.loaded_backend(_BACKEND()), "host_first", None)
    entry = None if first is None else first(op)
    return None if entry is None else entry(*args, **kwargs)


def fallback_counts() -> dict[str, int]:
    """Fallbacks per op since the last reset (ops that never fell back are absent)."""
    return dict(_fallback_counts)


def fallback_reasons() -> dict[str, dict[str, int]]:
    """Fallbacks per op and reason since the last reset."""
    return {op: dict(reasons) for op, reasons in _fallback_reasons.items()}


def reset_fallback_counts() -> None:
    """Zero the counters and forget which (op, reason) lines were logged."""
    _fallback_counts.clear()
    _fallback_reasons.clear()
    _logged.clear()


def backend_id() -> str:
    """``id/version`` of the backend ops would use now: the reference when kernels are off or
    the configured backend cannot be loaded (per-case fallbacks are in fallback_counts())."""
    name = _BACKEND() if _KERNELS() else REFERENCE_BACKEND
    try:
        backend = backends.get_backend(name)
    except (backends.BackendLoadError, ImportError):
        backend = backends.get_backend(REFERENCE_BACKEND)
    return f"{backend.id}/{backend.version}"

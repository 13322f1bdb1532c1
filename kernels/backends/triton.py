"""The ``rlk-triton`` backend: our Triton operators (kernels.ops), one module per op.

Runs on CUDA tensors, and on CPU tensors only through the Triton interpreter, which must have been
switched on (``TRITON_INTERPRET=1``) before ``kernels.ops`` was first imported in this process:
``triton.jit`` picks compiled or interpreted when a kernel is defined; and which must work in this
environment (``interpreter_fails``: a probe kernel, run once).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from kernels import settings
from kernels.backends.base import OPS, BaseBackend, Capabilities, import_function

TRITON_BACKEND_VERSION = "0.1.0"
_UNKNOWN = object()
_OP_MODULES = {op: f"kernels.ops.{op}" for op in OPS}


@functools.cache
def _triton_missing() -> str | None:
    try:
        importlib.import_module("triton")
    except ImportError as exc:  # the package is optional at import time of kernels
        return f"triton not importable ({exc})"
    return None


@functools.cache
def interpreter_fails() -> str | None:
    """Why Triton's CPU interpreter cannot run our kernels in this environment, or None: a kernel of
    the constructs ours use (a loop over a runtime int, masked loads, a reduction, a store) run once
    on CPU tensors. The known case: numpy >= 2.4 under a Triton whose interpreter turns a loop bound
    into an int with ``int(one-element array)`` (triton-lang/triton issue 9171), where every such
    kernel raises an InterpreterError deep inside the op. Meaningful where the interpreter is on
    in this process (``TRITON_INTERPRET=1`` before triton's first kernel)."""
    if not _interpreter_active():
        return "Triton's interpreter is off in this process (TRITON_INTERPRET unset when it started)"
    import numpy
    import torch
    import triton

    # defined now, with the interpreter on (triton.jit reads it when a kernel is defined)
    probe = importlib.import_module("kernels.backends.interpreter_probe").probe
    out = torch.zeros(1)
    where = f"Triton {triton.__version__}'s interpreter with numpy {numpy.__version__}"
    try:
        probe[(1,)](torch.ones(10), out, 10, BLOCK=4)
    except Exception as exc:  # noqa: BLE001 (whatever the interpreter raises is the reason)
        return f"{where} fails on a probe kernel: {type(exc).__name__}: {exc}"
    if float(out[0]) != 10.0:
        return f"{where} sums ten ones to {float(out[0])} in a probe kernel"
    return None


def _interpreter_active() -> bool:
    """Whether kernels.ops runs (or will run, once imported) through the CPU interpreter."""
    ops = sys.modules.get("kernels.ops")
    if ops is not None:
        return bool(ops.INTERPRETED)
    return settings.TRITON_INTERPRET.get() == "1"


class TritonBackend(BaseBackend):
    id = "rlk-triton"
    version = TRITON_BACKEND_VERSION
    capabilities = Capabilities(ops=frozenset(OPS))
    # every op's kernels check the ids range and packed lengths on the device (kernels/device_errors.py)
    checks_values = frozenset(OPS)

    def __init__(self) -> None:
        self._supported: dict[tuple, str | None] = {}
        self._own_routes: dict[str, bool] = {}

    def serves_own_routes(self, op: str) -> bool:
        """Whether this backend computes ``op`` exactly as ``rlk-triton`` does, so the routes that
        bypass ``get`` (the op's C++ host-first entry, the operators' splits in kernels/library/)
        compute what ``get(op)`` computes. A subclass that overrides ``get`` for ``op`` (or
        ``supports``/``check_case``, which those routes do not consult) declines them: its
        override serves every call, on every path (one route per op per backend)."""
        found = self._own_routes.get(op)
        if found is None:
            cls = type(self)
            rules_own = all(getattr(cls, name) is getattr(TritonBackend, name)
                            for name in ("supports", "check_case", "host_first"))
            # an overridden ``get`` keeps the routes only for the ops it hands back unchanged
            found = rules_own and (cls.get is TritonBackend.get or self.get(op) is TritonBackend.get(self, op))
            self._own_routes[op] = found
        return found

    def supports(self, op: str, **case: Any) -> str | None:
        """BaseBackend's rules, memoized: for this backend the answer depends only on the op, the
        device type, the dtype and (on CPU) the interpreter's state (host time of every call)."""
        device = case.get("device")
        kind = getattr(device, "type", device)
        key = (op, kind, case.get("dtype"))
        if kind != "cuda":  # on CPU the interpreter's state decides too (check_case)
            key += (_interpreter_active(), "kernels.ops" in sys.modules, settings.TRITON_INTERPRET.get())
        found = self._supported.get(key, _UNKNOWN)
        if found is _UNKNOWN:
            found = self._supported[key] = super().supports(op, **case)
        return found

    def check_case(self, op: str, **case: Any) -> str | None:
        missing = _triton_missing()
        if missing is not None:
            return missing
        device = case.get("device")
        if device is not None and str(device).startswith("cpu"):
            if not _interpreter_active():
                if "kernels.ops" in sys.modules and settings.TRITON_INTERPRET.get() == "1":
                    return "no CUDA device; TRITON_INTERPRET=1 was set after kernels.ops was imported"
                return "no CUDA device and TRITON_INTERPRET unset"
            return interpreter_fails()
        return None

    def host_first(self, op: str) -> Callable[..., Any] | None:
        """The op module's ``host_first`` (its C++ host path on the public arguments: logp's, ratio_kl's),
        once the module is loaded: the first call through ``get`` loads it, and the host path holds
        no kernel before that call has run anyway. Never imports (which would fix Triton's
        interpreter state for the process). None for a backend whose ``op`` is not ours
        (:meth:`serves_own_routes`)."""
        entry = getattr(sys.modules.get(_OP_MODULES.get(op, "")), "host_first", None)
        if entry is None or not self.serves_own_routes(op):
            return None
        return entry

    def get(self, op: str) -> Callable[..., Any]:
        if op not in self.capabilities.ops:
            raise KeyError(f"{self.id} does not implement {op!r}")
        # kernels/ops/<op>.py defines ``<op>_call(call)``, a function of the op's checked call;
        # linear_logp's kernels take their ids check from kernels/ops/value_checks.py
        if op == "linear_logp":
            return import_function("kernels.ops.value_checks", "linear_logp_call")
        return import_function(_OP_MODULES[op], f"{op}_call")


def make_backend() -> TritonBackend:
    return TritonBackend()

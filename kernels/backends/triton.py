"""The ``rlk-triton`` backend: our Triton operators (kernels.ops).

Runs on CUDA tensors, and on CPU tensors only through the Triton interpreter, which must have been
switched on (``TRITON_INTERPRET=1``) before ``kernels.ops`` was first imported in this process.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from kernels.backends.base import BaseBackend, Capabilities

TRITON_BACKEND_VERSION = "0.1.0"
TRITON_OPS = frozenset({"logp", "ratio_kl", "grpo_loss"})
# linear_logp lives in kernels/ops/linear_logp.py (its own engineer); served once that file exists
OPTIONAL_OPS = frozenset({"linear_logp"})


def _available_ops() -> frozenset[str]:
    present = {op for op in OPTIONAL_OPS if importlib.util.find_spec(f"kernels.ops.{op}") is not None}
    return TRITON_OPS | present


def _interpreter_active() -> bool:
    """Whether kernels.ops runs (or will run, once imported) through the CPU interpreter."""
    ops = sys.modules.get("kernels.ops")
    if ops is not None:
        return bool(ops.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "") == "1"


class TritonBackend(BaseBackend):
    id = "rlk-triton"
    version = TRITON_BACKEND_VERSION

    def __init__(self) -> None:
        self.capabilities = Capabilities(ops=_available_ops())

    def check_case(self, op: str, **case: Any) -> str | None:
        try:
            importlib.import_module("triton")
        except ImportError as exc:  # the package is optional at import time of kernels
            return f"triton not importable ({exc})"
        device = case.get("device")
        if device is not None and str(device).startswith("cpu") and not _interpreter_active():
            if "kernels.ops" in sys.modules and os.environ.get("TRITON_INTERPRET", "") == "1":
                return "no CUDA device; TRITON_INTERPRET=1 was set after kernels.ops was imported"
            return "no CUDA device and TRITON_INTERPRET unset"
        return None

    def get(self, op: str) -> Callable[..., Any]:
        if op not in self.capabilities.ops:
            raise KeyError(f"{self.id} does not implement {op!r}")
        module = importlib.import_module(f"kernels.ops.{op}")
        return getattr(module, op)


def make_backend() -> TritonBackend:
    return TritonBackend()

"""The harness of the op tier over every backend (test_backends.py): the backends a run validates
(``--rlk-backend``, ``VIME_RL_KERNEL_BACKEND`` or every importable one), each loaded once per
process or skipped with the reason, one case on one backend (the supports-check, comparisons with
the fp32 reference under the tolerance table, GPU times, the recorded metrics) and the rows of the
run's parity table."""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from rlk_op_cases import DEVICE, record_error, tolerance_band

from kernels import backends, contracts, tolerances
from kernels.contracts import LinearGrpoLossCall


# test id -> backend name (built-in names: kernels/backends/__init__.py)
DEFAULT_BACKENDS = {"rlk-triton": "rlk-triton", "liger": "liger", "rl_engine": "rl_engine"}


ON_GPU = DEVICE == "cuda"


FULL_SHAPE_SKIP = "full shape: needs a CUDA GPU (the CPU interpreter would take hours)"


# op -> its call type: a backend's implementation is a function of one checked call
CALLS = {**contracts.CALLS, "linear_grpo_loss": LinearGrpoLossCall}


def op_function(backend: backends.Backend, op: str) -> Callable[..., Any]:
    """``backend``'s implementation of ``op`` as a function of the op's arguments (as the public API)."""
    return contracts.entry_point(CALLS[op], backend.get(op))


def reference_op(op: str) -> Callable[..., Any]:
    return op_function(backends.get_backend("reference"), op)


def configured_backend(config: pytest.Config) -> str | None:
    """``--rlk-backend`` (validated by the plugin), else ``VIME_RL_KERNEL_BACKEND``."""
    value = config.getoption("rlk_backend", default=None)
    return value or os.environ.get("VIME_RL_KERNEL_BACKEND", "").strip() or None


def backend_names(config: pytest.Config) -> dict[str, str]:
    """Test id -> backend name/path to validate in this run."""
    chosen = configured_backend(config)
    if chosen is not None:
        return {re.sub(r"[^A-Za-z0-9_.-]", "-", chosen): chosen}
    names = dict(DEFAULT_BACKENDS)
    for name in backends.available_backends():
        if name not in ("reference",) and name not in names:
            names[name] = name
    return names


LOADED: dict[str, tuple[Any, str | None]] = {}


def load_backend(name: str) -> tuple[Any, str | None]:
    """(backend, None) or (None, why it cannot be loaded); cached per process."""
    if name not in LOADED:
        try:
            LOADED[name] = (backends.get_backend(name), None)
        except (backends.BackendLoadError, ImportError) as exc:
            LOADED[name] = (None, f"backend {name!r} not available: {exc}")
    return LOADED[name]


@dataclass
class Row:
    backend: str
    op: str
    case: str
    status: str  # "ok", "FAIL", "skip: <reason>"
    errors: dict[str, float] = field(default_factory=dict)
    time_ms: float | None = None


ROWS: list[Row] = []


class CaseRun:
    """Supports-check, comparisons and recording of one (backend, op, case)."""

    def __init__(self, backend_name: str, op: str, case_id: str, rlk_metrics) -> None:
        backend, why = load_backend(backend_name)
        label = backend.id if backend is not None else backend_name
        self.row = Row(f"{label}/{backend.version}" if backend is not None else label, op, case_id, "ok")
        ROWS.append(self.row)
        if backend is None:
            self.skip(why)
        self.backend = backend
        self.op = op
        self.case_id = case_id
        self.metrics = rlk_metrics
        self.failures: list[str] = []
        rlk_metrics.set_case(case_name(f"backends.{op}.{case_id}.{backend.id}-{backend.version}"))
        rlk_metrics.record_backend(f"{backend.id}/{backend.version}")

    def skip(self, reason: str) -> None:
        self.row.status = f"skip: {reason}"
        pytest.skip(reason)

    def require_support(self, **case: Any) -> Callable[..., Any]:
        reason = self.backend.supports(self.op, **case)
        if reason is not None:
            self.skip(f"{self.backend.id}/{self.backend.version}: {reason}")
        return op_function(self.backend, self.op)

    def compare(
        self, what: str, actual: torch.Tensor, expected: torch.Tensor, check: str, dtype: torch.dtype,
        upstream: torch.Tensor | None = None, terms: int | None = None,
    ) -> None:
        tol = tolerances.get(check, dtype, upstream=upstream, terms=terms)
        result = tolerances.closeness(actual, expected, tol)
        tags = {
            "backend": self.backend.id, "backend_version": self.backend.version, "op": self.op,
            "dtype": tolerances.dtype_name(dtype), "case": self.case_id,
        }
        record_error(self.metrics, f"{what}_max_abs_err", result, tags,
                     band=tolerance_band(check, dtype, tol, expected))
        self.row.errors[what] = result.max_abs_err
        if not result.ok:
            idx = result.worst_index
            got = float(actual.detach().float()[idx]) if idx else float(actual.detach().float())
            ref = float(expected.detach().float()[idx]) if idx else float(expected.detach().float())
            self.failures.append(
                f"{self.backend.id}/{self.backend.version} disagrees with the fp32 reference: op {self.op}, "
                f"output {what}, shape {tuple(expected.shape)}, dtype {tolerances.dtype_name(dtype)}, case "
                f"{self.case_id}: max abs err {result.max_abs_err:.3e} at worst element index {idx} "
                f"(got {got:.9g}, reference {ref:.9g}); tolerance {tol.describe()} [{tol.source}]"
            )

    def time(self, fn: Callable[[], Any]) -> None:
        """Median wall time of ``fn`` on the GPU (recorded, not gated); nothing on CPU."""
        if not ON_GPU:
            return
        for _ in range(2):
            fn()
        samples = []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e3)
        self.row.time_ms = statistics.median(samples)
        self.metrics.record(
            "time_ms", samples, unit="ms", direction="lower_is_better", space="time", gate=False,
            tags={"backend": self.backend.id, "backend_version": self.backend.version, "op": self.op, "case": self.case_id},
        )

    def finish(self) -> None:
        if self.failures:
            self.row.status = "FAIL"
            pytest.fail("\n".join(self.failures), pytrace=False)


def case_name(raw: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", raw)[:200]


def full_case(case: Any) -> Any:
    return pytest.param(case, marks=pytest.mark.gpu, id=case.id)


def small_case(case: Any) -> Any:
    return pytest.param(case, id=case.id)


def skip_unless_gpu(full: bool) -> None:
    if full and not ON_GPU:
        pytest.skip(FULL_SHAPE_SKIP)

"""MetricRecorder: what the ``rlk_metrics`` fixture hands to a test."""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import ValidationError

from pytest_rlk.schema import DIRECTIONS, SPACES, Band, MetricRecord, Window
from pytest_rlk.stats import aggregate

_CASE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


class MetricError(ValueError):
    """A bad ``record(...)`` call; the message names the metric and the argument."""


def case_from_nodeid(nodeid: str) -> str:
    """``suites/op/test_logp.py::test_x[bf16-4096]`` -> ``test_logp.test_x-bf16-4096``."""
    path, _, rest = nodeid.partition("::")
    stem = Path(path).stem
    name = rest.replace("::", ".").replace("[", "-").rstrip("]")
    raw = f"{stem}.{name}" if name else stem
    safe = re.sub(r"[^A-Za-z0-9._=+-]", "_", raw).strip("._") or "case"
    return safe[:200]


def validate_case(case: str) -> str:
    if not isinstance(case, str) or not _CASE_RE.match(case) or len(case) > 200:
        raise MetricError(
            f"case {case!r}: use letters, digits and . _ = + - (it becomes a file name), "
            "at most 200 characters"
        )
    return case


def _as_value(name: str, value: object, allow_nonfinite: bool) -> float | list[float]:
    def one(v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            try:
                v = float(v)  # 0-dim tensors and numpy scalars
            except (TypeError, ValueError):
                raise MetricError(
                    f"metric {name!r}: value {v!r} is not a number"
                ) from None
        f = float(v)
        if not allow_nonfinite and not math.isfinite(f):
            raise MetricError(
                f"metric {name!r}: value {f} is not finite (pass allow_nonfinite=True to record it)"
            )
        return f

    if isinstance(value, (list, tuple)):
        if not value:
            raise MetricError(f"metric {name!r}: empty series")
        return [one(v) for v in value]
    return one(value)


class MetricRecorder:
    """Collects one test's metrics, seeds and fallback counts (see architecture.md)."""

    def __init__(self, nodeid: str, *, tier: str | None, artifact_root: Path | None,
                 case: str | None = None) -> None:
        self.nodeid = nodeid
        self.tier = tier
        self._artifact_root = artifact_root
        self._case = validate_case(case) if case else case_from_nodeid(nodeid)
        self.metrics: dict[str, MetricRecord] = {}
        self.seeds: dict[str, int] = {}
        self.fallback_counts: dict[str, int] = {}
        self.backends: list[str] = []
        self.gpus = 1
        self._artifact_dir: Path | None = None

    @property
    def case(self) -> str:
        return self._case

    def set_case(self, case: str) -> None:
        self._case = validate_case(case)

    def set_gpus(self, count: int) -> None:
        """The GPUs this test's figures came from, where the test decides it at run time (a TP=2
        side that runs over NCCL only where the machine has two GPUs): with ``count`` > 1 the
        test gates against ``<tag>x<count>`` baselines, as a ``gpus(count)`` marker's test does
        (pytest_rlk.platform.baseline_platform)."""
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"rlk_metrics.set_gpus: count must be a positive int, got {count!r}")
        self.gpus = count

    @property
    def artifact_dir(self) -> Path:
        """Per-test directory under the run (created on first use)."""
        if self._artifact_dir is None:
            if self._artifact_root is None:
                raise RuntimeError("rlk_metrics.artifact_dir: this run writes no artifacts")
            self._artifact_dir = self._artifact_root / self._case
            self._artifact_dir.mkdir(parents=True, exist_ok=True)
        return self._artifact_dir

    @property
    def artifact_dir_if_used(self) -> Path | None:
        return self._artifact_dir

    def record(
        self,
        name: str,
        value: float | Sequence[float],
        *,
        unit: str = "",
        direction: str,
        space: str = "none",
        tags: Mapping[str, object] | None = None,
        gate: bool = True,
        band: Band | Mapping[str, object] | None = None,
        window: Window | Mapping[str, object] | None = None,
        allow_nonfinite: bool = False,
    ) -> MetricRecord:
        if not isinstance(name, str) or not name:
            raise MetricError(f"metric name {name!r}: must be a non-empty string")
        if name in self.metrics:
            raise MetricError(f"metric {name!r}: recorded twice in {self.nodeid}")
        if direction not in DIRECTIONS:
            raise MetricError(f"metric {name!r}: direction {direction!r} not in {DIRECTIONS}")
        if space not in SPACES:
            raise MetricError(f"metric {name!r}: space {space!r} not in {SPACES}")
        val = _as_value(name, value, allow_nonfinite)
        try:
            metric = MetricRecord(
                name=name, value=val, unit=unit, direction=direction, space=space,
                tags={str(k): str(v) for k, v in (tags or {}).items()}, gate=gate,
                band=Band.model_validate(band) if band is not None else None,
                window=Window.model_validate(window) if window is not None else None,
                allow_nonfinite=allow_nonfinite,
            )
        except ValidationError as exc:
            raise MetricError(f"metric {name!r}: {exc}") from None
        if metric.window is not None:
            if not isinstance(val, list):
                raise MetricError(f"metric {name!r}: window given for a scalar value")
            try:
                aggregate(val, metric.window, name=name)  # the window must leave something
            except ValueError as exc:
                raise MetricError(str(exc)) from None
        self.metrics[name] = metric
        return metric

    def record_fallbacks(self, counts: Mapping[str, int]) -> None:
        for op, n in counts.items():
            self.fallback_counts[str(op)] = int(n)

    def record_backend(self, backend_id: str) -> None:
        """A kernel backend (``id/version``) this test exercised; the run's header names them.
        The plugin records the one switched on (``VIME_RL_KERNEL=1``) when the test body ends by
        itself; a test that calls backends directly, or in a subprocess, records them here."""
        if not isinstance(backend_id, str) or not backend_id.strip():
            raise MetricError(f"record_backend: {backend_id!r} is not a backend id (e.g. 'liger/0.8.5')")
        if backend_id not in self.backends:
            self.backends.append(backend_id)

    def set_seed(self, name: str, value: int) -> None:
        self.seeds[str(name)] = int(value)


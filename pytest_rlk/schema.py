"""Pydantic models of everything pytest-rlk writes to disk: run files and baselines.

Every model forbids unknown fields, so a misspelt or foreign field in a file is an error that
names the field instead of being silently ignored.
"""
from __future__ import annotations

import math
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMA_VERSION = 1  # run, part and test records
# baselines: 2 adds the case's history of trusted runs (``Baseline.history``) and a band's
# ``rests_on``; a version-1 file loads unchanged, as a one-run history (pytest_rlk.history)
BASELINE_SCHEMA_VERSION = 2
BASELINE_SCHEMA_VERSIONS_READ: tuple[int, ...] = (1, 2)

Direction = Literal["higher_is_better", "lower_is_better", "two_sided"]
DIRECTIONS: tuple[str, ...] = ("higher_is_better", "lower_is_better", "two_sided")
Space = Literal[
    "logprob", "prob", "time", "memory", "reward", "loss", "ratio", "count", "throughput",
    "error", "none",
]
SPACES: tuple[str, ...] = (
    "logprob", "prob", "time", "memory", "reward", "loss", "ratio", "count", "throughput",
    "error", "none",
)
Aggregation = Literal["mean", "median", "p90", "p99", "last", "min", "max"]
AGGREGATIONS: tuple[str, ...] = ("mean", "median", "p90", "p99", "last", "min", "max")
RunStatus = Literal["running", "complete", "interrupted", "crashed"]
Outcome = Literal["passed", "failed", "skipped", "error"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Band(_Strict):
    """Tolerance band around a reference value: width = max(rel * |ref|, abs_floor).

    ``rests_on``: None for a band stated in code (a tolerance, a default of pytest_rlk.bands),
    which gates from the first run; else the number of trusted runs whose spread the band was
    recommended from (pytest_rlk.history), and a case with such a band resting on fewer than
    ``bands.NOISE_RULE.min_runs`` runs gates in shadow mode."""

    rel: float = Field(default=0.0, ge=0.0)
    abs_floor: float = Field(default=0.0, ge=0.0)
    source: str = ""
    rests_on: int | None = Field(default=None, ge=0)

    def width(self, ref: float) -> float:
        return max(self.rel * abs(ref), self.abs_floor)

    def describe(self) -> str:
        parts = []
        if self.rel:
            parts.append(f"rel {self.rel:g}")
        if self.abs_floor:
            parts.append(f"abs {self.abs_floor:g}")
        return " / ".join(parts) if parts else "exact"


class Window(_Strict):
    """How a per-step series becomes one number: drop ``skip`` warmup steps, then aggregate."""

    skip: int = Field(default=0, ge=0)
    agg: Aggregation = "mean"


class MetricRecord(_Strict):
    name: str = Field(min_length=1)
    value: float | list[float]
    unit: str = ""
    direction: Direction
    space: Space = "none"
    tags: dict[str, str] = Field(default_factory=dict)
    gate: bool = True
    band: Band | None = None
    window: Window | None = None
    allow_nonfinite: bool = False

    @property
    def is_series(self) -> bool:
        return isinstance(self.value, list)


class Verdict(str, Enum):
    PASS = "pass"
    REGRESSION = "regression"
    IMPROVED = "improved"
    MISSING_BASELINE = "missing_baseline"
    MISSING_METRIC = "missing_metric"
    NEW_METRIC = "new_metric"
    # the baseline gates it; this run recorded it but its test no longer gates it (a deliberate
    # change of what gates, e.g. wall time -> CUDA-graph time): not a failure, and
    # --rlk-update-baselines=failed drops it from the baseline
    UNGATED = "ungated"
    # a tag diff (two backends of one run): the side's backend declares the case unsupported
    # (its test skipped with that backend's capability reason): named, never a failure
    UNSUPPORTED = "unsupported"

    @property
    def label(self) -> str:
        if self is Verdict.IMPROVED:
            return "improved (refresh the baseline)"
        if self is Verdict.UNGATED:
            return "no longer gated by its test (refresh the baseline)"
        return self.value


class MetricComparison(_Strict):
    name: str
    baseline: float | None = None
    new: float | None = None
    delta: float | None = None
    band_width: float | None = None
    band: Band | None = None
    direction: Direction | None = None
    verdict: Verdict
    detail: str = ""

    @field_validator("baseline", "new", "delta", "band_width")
    @classmethod
    def _json_safe(cls, v: float | None) -> float | None:
        # JSON has no NaN/inf; a non-finite value that was explicitly allowed is kept as None.
        return None if v is not None and not math.isfinite(v) else v


class GateResult(_Strict):
    case: str
    baseline_path: str | None = None
    comparisons: list[MetricComparison] = Field(default_factory=list)
    baseline_written: bool = False
    # why the case gates in shadow mode (its verdicts are reported, a regression does not fail),
    # None when it gates; a non-finite value fails in shadow mode too
    shadow: str | None = None

    def with_verdict(self, *verdicts: Verdict) -> list[MetricComparison]:
        return [c for c in self.comparisons if c.verdict in verdicts]

    @property
    def regressions(self) -> list[MetricComparison]:
        return self.with_verdict(Verdict.REGRESSION, Verdict.MISSING_METRIC)

    @property
    def improvements(self) -> list[MetricComparison]:
        return self.with_verdict(Verdict.IMPROVED)

    @property
    def missing_baseline(self) -> bool:
        return bool(self.with_verdict(Verdict.MISSING_BASELINE))

    @property
    def nonfinite(self) -> list[MetricComparison]:
        """Regressions on a value that is not finite: an error in shadow mode as well."""
        return [c for c in self.with_verdict(Verdict.REGRESSION)
                if c.new is None or c.detail.startswith("value is not finite")]

    @property
    def failing(self) -> list[MetricComparison]:
        """The comparisons that fail the case: its regressions, or in shadow mode the non-finite ones."""
        return self.nonfinite if self.shadow else self.regressions

    def failed(self, *, fail_on_improvement: bool = False) -> bool:
        if self.shadow:
            return bool(self.nonfinite)
        return bool(self.regressions) or (fail_on_improvement and bool(self.improvements))


class DeviceInfo(_Strict):
    index: int
    name: str
    memory_bytes: int
    capability: str


class PlatformInfo(_Strict):
    tag: str
    detected_tag: str
    device_name: str = "cpu"
    device_count: int = 0
    memory_bytes: int = 0  # per device (the smallest, when they differ)
    capability: str | None = None
    driver: str | None = None
    cuda: str | None = None
    devices: list[DeviceInfo] = Field(default_factory=list)

    def describe(self) -> str:
        if self.device_count == 0:
            return "cpu, 0 GPUs"
        plural = "GPU" if self.device_count == 1 else "GPUs"
        return f"{self.device_name}, {self.device_count} {plural}"


class RunManifest(_Strict):
    run_id: str
    created_utc: str
    argv: list[str]
    tiers: list[str]
    platform: PlatformInfo
    software: dict[str, str | None]
    suite_commit: str | None = None
    suite_dirty: bool | None = None
    vime_root: str | None = None
    vime_commit: str | None = None
    kernel_backend_ids: list[str] = Field(default_factory=list)
    kernel_backend_option: str | None = None
    seeds: dict[str, dict[str, int]] = Field(default_factory=dict)  # nodeid -> {name: seed}
    # --rlk-shard-gpus: xdist worker id (and "all-gpus") -> the CUDA_VISIBLE_DEVICES it ran with
    gpu_shards: dict[str, str] = Field(default_factory=dict)


class TestRecord(_Strict):
    __test__ = False  # not a pytest test class

    nodeid: str
    case: str
    tier: str | None = None
    outcome: Outcome
    duration_s: float = 0.0
    skip_reason: str | None = None
    # failed/error: pytest's crash line + the last lines of the long report (pytest_rlk.failures);
    # optional, so run files written before it still validate (schema_version stays 1)
    failure: str | None = None
    unserved: bool = False  # skipped because this machine cannot serve its markers
    worker: str = "main"
    metrics: list[MetricRecord] = Field(default_factory=list)
    gate: GateResult | None = None
    seeds: dict[str, int] = Field(default_factory=dict)
    fallback_counts: dict[str, int] = Field(default_factory=dict)
    artifact_dir: str | None = None
    # kernel backends ("id/version") this test exercised: recorded by the test
    # (rlk_metrics.record_backend) or seen switched on when its body ended
    backends: list[str] = Field(default_factory=list)
    # a baseline that could not be used (corrupt, wrong version, misplaced): "<file>: <what>"
    gate_error: str | None = None
    # the baselines directory when it is not the run's platform: <tag>x<k> for a test on k > 1
    # GPUs (pytest_rlk.platform.baseline_platform)
    baseline_platform: str | None = None
    # the test's ``injected_fault(what)`` marker: a deliberately wrong part whose metrics are
    # expected to fail their gate (the report keeps them apart from real cases)
    injected_fault: str | None = None

    def gated_platform(self, run_platform: str) -> str:
        """The platform whose baselines gate this test in a run on ``run_platform``."""
        return self.baseline_platform or run_platform


class PartFile(_Strict):
    """What one pytest process (xdist worker or the single process) has written so far."""

    worker: str
    tests: list[TestRecord] = Field(default_factory=list)
    deselected: dict[str, int] = Field(default_factory=dict)
    fallback_counts: dict[str, int] = Field(default_factory=dict)
    kernel_backend_ids: list[str] = Field(default_factory=list)
    collected: int | None = None  # tests selected to run (after -m, -k and tier deselection)
    files: dict[str, str] = Field(default_factory=dict)  # description -> path (rlk_files)


class RunRecord(_Strict):
    schema_version: int = SCHEMA_VERSION
    manifest: RunManifest
    status: RunStatus
    host: str | None = None  # where the controller ran, with its pid: tells running from crashed
    pid: int | None = None
    finished_utc: str | None = None
    exit_status: int | None = None
    tests: list[TestRecord] = Field(default_factory=list)
    deselected: dict[str, int] = Field(default_factory=dict)
    fallback_counts: dict[str, int] = Field(default_factory=dict)
    collected: int | None = None  # tests selected to run; more than len(tests) in a partial run
    # run-level files the tests wrote (tables, logs), description -> path: named in the summary
    files: dict[str, str] = Field(default_factory=dict)

    @property
    def partial(self) -> bool:
        """Stopped before its end (Ctrl-C, killed, still running): some selected tests have no record."""
        return self.status != "complete"

    def describe_status(self) -> str:
        """``complete`` or e.g. ``interrupted: partial, 2 of 4 tests recorded``."""
        if not self.partial:
            return self.status
        of = f" of {self.collected}" if self.collected is not None else ""
        return f"{self.status}: partial, {len(self.tests)}{of} tests recorded"


class BaselineMetric(_Strict):
    ref: float
    unit: str = ""
    direction: Direction
    space: Space = "none"
    band: Band
    window: Window | None = None

    @field_validator("ref")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reference value must be finite")
        return v


class HistoryRun(_Strict):
    """One run a case's history holds values of."""

    run_id: str = Field(min_length=1)
    created_utc: str = ""
    suite_commit: str | None = None

    def describe(self) -> str:
        commit = (self.suite_commit or "no commit")[:10]
        return f"{self.run_id} ({self.created_utc[:10] or 'no date'}, {commit})"


class MetricStats(_Strict):
    n: int = Field(ge=0)
    mean: float
    sd: float = Field(ge=0.0)  # sample standard deviation (n - 1); 0 for n < 2
    min: float
    max: float


class MetricHistory(_Strict):
    """The last ``bands.NOISE_RULE.keep`` trusted values of one metric (run id -> value, oldest
    first) and their statistics."""

    values: dict[str, float] = Field(default_factory=dict)
    stats: MetricStats | None = None
    # the band the test states (its tolerance: the recommended band's floor), kept to recommend
    # the band again when a run is distrusted
    stated: Band | None = None

    @field_validator("values")
    @classmethod
    def _finite_values(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {run: x for run, x in v.items() if not math.isfinite(x)}
        if bad:
            raise ValueError(f"non-finite values in the history: {bad}")
        return v


class CaseHistory(_Strict):
    """A case's trusted runs (oldest first), the runs marked untrusted, and per-metric values."""

    runs: list[HistoryRun] = Field(default_factory=list)
    distrusted: list[HistoryRun] = Field(default_factory=list)
    metrics: dict[str, MetricHistory] = Field(default_factory=dict)
    # loaded from a version-1 file: one run, the recording's, read from its provenance
    legacy: bool = False


class Baseline(_Strict):
    schema_version: int
    tier: str
    case: str
    platform: str
    provenance: dict[str, object] = Field(default_factory=dict)
    metrics: dict[str, BaselineMetric]
    history: CaseHistory | None = None

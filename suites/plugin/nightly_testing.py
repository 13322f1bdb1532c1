"""Helpers for the nightly/verdict tests: run files and baselines written directly (a plain
module: test files import it by name)."""
from __future__ import annotations

from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.schema import (
    SCHEMA_VERSION,
    Band,
    Baseline,
    BaselineMetric,
    MetricRecord,
    PlatformInfo,
    RunManifest,
    RunRecord,
    TestRecord,
)


def metric(name: str, value: float, *, direction: str = "lower_is_better") -> MetricRecord:
    return MetricRecord(name=name, value=value, direction=direction, band=Band(abs_floor=0.1, source="test"))


def result(nodeid: str, outcome: str = "passed", metrics: list[MetricRecord] | None = None,
                failure: str | None = None) -> TestRecord:
    case = nodeid.split("::")[-1]
    return TestRecord(nodeid=nodeid, case=case, tier="op", outcome=outcome, metrics=metrics or [],
                      failure=failure)


def write_run(run_dir: Path, platform: str, tests: list[TestRecord], *, status: str = "complete",
              exit_status: int = 0, host: str = "node-host") -> Path:
    manifest = RunManifest(run_id=run_dir.name, created_utc="2026-01-01T00:00:00.000000Z", argv=[],
                           tiers=["op"], platform=PlatformInfo(tag=platform, detected_tag=platform),
                           software={"python": "3.11"})
    storage.write_run(run_dir, RunRecord(manifest=manifest, status=status, exit_status=exit_status, host=host,
                                         tests=tests))
    return run_dir


def write_baseline(root: Path, platform: str, case: str, **refs: float) -> None:
    metrics = {name: BaselineMetric(ref=ref, direction="lower_is_better", band=Band(abs_floor=0.1, source="test"))
               for name, ref in refs.items()}
    storage.write_baseline(storage.baseline_path(root, "op", platform, case),
                           Baseline(schema_version=SCHEMA_VERSION, tier="op", case=case, platform=platform,
                                    metrics=metrics))

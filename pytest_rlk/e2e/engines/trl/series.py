"""What a TRL arm writes and how it is read back: one JSON line per optimizer step in
`metrics.jsonl` (canonical metric names, `pytest_rlk.e2e.metrics`), `run_info.json`, and the
same step line on stdout behind `PROGRESS_PREFIX` (progress while the arm runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.engine import StepProgress

METRICS_FILE = "metrics.jsonl"
RUN_INFO_FILE = "run_info.json"
ROLLOUTS_FILE = "rollouts.jsonl"  # the rollouts the replay lane's baseline arm records (rollout.py)
PROGRESS_PREFIX = "rlk-step "


def step_line(row: dict[str, float | int]) -> str:
    """The JSON line of one step (metrics.jsonl, and stdout behind `PROGRESS_PREFIX`)."""
    return json.dumps(row)


def read_series(arm_dir: Path) -> m.ArmSeries:
    """Per-step JSON lines -> metric name -> series; every line must carry the same names."""
    path = Path(arm_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics written (did the arm run?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no steps recorded")
    names = [k for k in rows[0] if k != "step"]
    series: m.ArmSeries = {name: [] for name in names}
    for i, row in enumerate(rows):
        if row.get("step") != i:
            raise ValueError(f"{path}: line {i + 1} has step {row.get('step')}, expected {i}")
        if set(row) - {"step"} != set(names):
            raise ValueError(f"{path}: line {i + 1} has metrics {sorted(row)}, expected {sorted(names)}")
        for name in names:
            series[name].append(float(row[name]))
    return series


def read_run_info(arm_dir: Path) -> dict[str, Any]:
    return json.loads((Path(arm_dir) / RUN_INFO_FILE).read_text())


def progress_from_line(line: str) -> StepProgress | None:
    if not line.startswith(PROGRESS_PREFIX):
        return None
    row = json.loads(line[len(PROGRESS_PREFIX):])
    return StepProgress(int(row.pop("step")), {k: float(v) for k, v in row.items()})

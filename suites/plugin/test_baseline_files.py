"""The committed baselines: every file validates where it lives, and what CPU baselines gate holds
on any CPU machine (errors and parity values with their tolerances, never a wall time)."""
from __future__ import annotations

from pathlib import Path

import pytest

from pytest_rlk import storage

BASELINES = Path(__file__).resolve().parents[2] / "baselines"
FILES = sorted(BASELINES.glob("*/*/*.json"))
CPU_FILES = [p for p in FILES if p.parent.name == "cpu"]
# shared CPU cores make times and rates noise: CPU baselines never gate them
MACHINE_BOUND_SPACES = ("time", "throughput")


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(BASELINES)))
def test_committed_baseline_validates_where_it_lives(path):
    tier, platform = path.parent.parent.name, path.parent.name
    storage.load_baseline(path, tier=tier, platform=platform, case=path.stem)


def test_cpu_baselines_exist_and_gate_no_machine_bound_metric():
    assert CPU_FILES, f"no CPU baselines under {BASELINES}: record them with `tox -e baselines`"
    bound = [f"{p.relative_to(BASELINES)}: {name} ({m.space})" for p in CPU_FILES
             for name, m in storage.load_baseline(p).metrics.items() if m.space in MACHINE_BOUND_SPACES]
    assert not bound, "CPU baselines gating times or rates (noise on shared cores):\n" + "\n".join(bound)

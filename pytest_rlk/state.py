"""The plugin's per-process state and the stash keys its hooks share (pytest objects, no hooks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_rlk import options
from pytest_rlk import session as rlk_session
from pytest_rlk.recorder import MetricRecorder
from pytest_rlk.schema import PlatformInfo, RunRecord
from pytest_rlk.signals import StopSignals


@dataclass
class RlkState:
    """What one pytest process (the controller, or an xdist worker) knows of its run."""

    opts: options.RlkOptions
    platform: PlatformInfo
    worker: str | None  # xdist worker id; None in the controller / single process
    run_dir: Path | None = None
    writer: rlk_session.PartWriter | None = None
    provenance: dict[str, object] | None = None
    run: RunRecord | None = None
    saved_backend_env: tuple[bool, str | None] = (False, None)
    deselected: dict[str, int] = field(default_factory=dict)
    gated_cases: dict[tuple[str | None, str], str] = field(default_factory=dict)  # -> nodeid
    not_collected: dict[str, str] = field(default_factory=dict)  # tier -> its suites/<tier> dir
    deselected_by_selection: int = 0  # tests of the selected tiers that -m / -k deselected
    current_test: str | None = None  # the test being set up or run (named by progress lines)
    gpu_shards: dict[str, str] = field(default_factory=dict)  # --rlk-shard-gpus: worker -> its GPUs
    signals: StopSignals = field(default_factory=StopSignals)
    collection_skips: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, why) skipped at collection


STATE = pytest.StashKey[RlkState]()
RECORDER = pytest.StashKey[MetricRecorder]()
TIER = pytest.StashKey[str | None]()
PHASES = pytest.StashKey[dict]()
GATE = pytest.StashKey[object]()
GATE_ERROR = pytest.StashKey[str]()
BACKEND_SEEN = pytest.StashKey[str]()
UNSERVED = pytest.StashKey[str]()
MARKER_ERROR = pytest.StashKey[str]()
NODE_PLATFORM = pytest.StashKey[PlatformInfo]()

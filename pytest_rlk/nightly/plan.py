"""The nightly plan (which tests on which node kinds) and the record of what each node did.

A plan is JSON validated by :class:`NightlyPlan`; unknown fields are errors that name the field.
Example (docs/nightly.md has the field reference)::

    {"schema_version": 1, "name": "nightly",
     "nodes": [
       {"name": "h100", "resources": {"h100": 1}, "platform": "h100", "tiers": ["op", "module"],
        "markers": "gpu or h100", "shard_gpus": true, "timeout_s": 5400},
       {"name": "h200", "resources": {"h200": 1}, "platform": "h200", "tiers": ["op", "module"],
        "markers": "gpu or h200", "shard_gpus": true, "timeout_s": 5400}]}
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pytest_rlk import storage
from pytest_rlk.markers import TIERS
from pytest_rlk.options import parse_platform
from pytest_rlk.schema import _Strict

PLAN_SCHEMA_VERSION = 1
NIGHTLY_FILE = "nightly.json"  # in the nightly directory: the plan and every node's outcome
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# set by the node job itself, or by a plan field that says it more plainly
_RESERVED_ARGS = {"--rlk-artifacts": "the node job sets it", "--rlk-tier": "use the node's 'tiers'",
                  "-m": "use the node's 'markers'", "-n": "use the node's 'shard_gpus'",
                  "--numprocesses": "use the node's 'shard_gpus'", "--rlk-shard-gpus": "use the node's 'shard_gpus'"}

NodeStatus = Literal[
    "completed",      # pytest ran to its end (its run says passed or failed)
    "timed_out",      # stopped by the node job after timeout_s; its partial run is kept
    "died",           # the node or its task process died; the files it had sent are kept
    "no_answer",      # nothing from the node for too long: cancelled; the files it had sent are kept
    "unschedulable",  # no node of the cluster has the resources asked for
    "not_started",    # pytest could not be started on the node
]


class NodeSpec(_Strict):
    """One pytest job on one node of a kind (the kind is the Ray resources it asks for)."""

    name: str = Field(description="names the node in the verdict and its directory")
    resources: dict[str, float] = Field(description="Ray resources of the node kind, e.g. {'h100': 1}")
    platform: str = Field(description="the platform tag the node's run must report, e.g. h100")
    tiers: list[str] = Field(default_factory=lambda: ["op"])
    markers: str | None = Field(default=None, description="pytest -m expression")
    pytest_args: list[str] = Field(default_factory=list, description="more pytest arguments (paths, options)")
    shard_gpus: bool = Field(default=False, description="-n auto --rlk-shard-gpus: one worker per GPU")
    timeout_s: float = Field(default=3600.0, gt=0, description="the node job stops pytest after this")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the pytest job")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r}: use letters, digits and . _ - (it names a directory)")
        return v

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("empty: name the node kind's Ray resource, e.g. {\"h100\": 1}")
        bad = [k for k, n in v.items() if not n > 0]
        if bad:
            raise ValueError(f"{bad[0]!r} must be > 0")
        return v

    @field_validator("platform")
    @classmethod
    def _platform(cls, v: str) -> str:
        parse_platform(v)
        return v

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v: list[str]) -> list[str]:
        bad = [t for t in v if t not in TIERS]
        if bad or not v:
            raise ValueError(f"unknown tier {bad[0]!r}; valid tiers: {', '.join(TIERS)}" if bad else "empty")
        return v

    @field_validator("pytest_args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        for arg in v:
            key = arg.split("=", 1)[0]
            if key in _RESERVED_ARGS or (key.startswith("-n") and key[2:].isdigit()):
                raise ValueError(f"{arg!r}: {_RESERVED_ARGS.get(key, _RESERVED_ARGS['-n'])}")
        return v

    def pytest_argv(self) -> list[str]:
        """The node job's pytest arguments (``--rlk-artifacts`` is added on the node)."""
        argv = ["-p", "no:cacheprovider", f"--rlk-tier={','.join(self.tiers)}"]
        if self.markers:
            argv += ["-m", self.markers]
        if self.shard_gpus:
            argv += ["-n", "auto", "--rlk-shard-gpus"]
        return argv + list(self.pytest_args)


class NightlyPlan(_Strict):
    schema_version: Literal[1]
    name: str = "nightly"
    nodes: list[NodeSpec] = Field(min_length=1)
    suite_root: str | None = Field(
        default=None, description="this checkout on every node; None: the driver's checkout is "
                                  "shipped to each node (Ray runtime_env working_dir)")
    baselines: str = Field(default="baselines", description="relative to the suite root, for the verdict")
    require_baselines: bool = Field(default=False, description="the verdict fails on a missing baseline")
    sync_interval_s: float = Field(default=30.0, gt=0, description="a node sends its new run files this often")
    stop_grace_s: float = Field(default=60.0, ge=0, description="after Ctrl-C at timeout, before SIGTERM/SIGKILL")
    schedule_timeout_s: float = Field(default=1800.0, gt=0, description="how long a node job may wait to start")

    @model_validator(mode="after")
    def _unique_names(self) -> NightlyPlan:
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"node names must be unique: {', '.join(dup)}")
        return self

    @property
    def expected_platforms(self) -> list[str]:
        return list(dict.fromkeys(n.platform for n in self.nodes))


class NodeOutcome(_Strict):
    """What became of one node's job (``nodes/<name>/node.json``)."""

    name: str
    platform: str  # expected
    status: NodeStatus
    detail: str = ""
    host: str | None = None
    exit_status: int | None = None
    run_dir: str | None = None  # relative to the nightly directory
    started_utc: str | None = None
    finished_utc: str | None = None


class NightlyRecord(_Strict):
    """``nightly.json``: the plan and each node's outcome (written as nodes finish)."""

    schema_version: Literal[1] = 1
    plan: NightlyPlan
    started_utc: str
    finished_utc: str | None = None
    address: str | None = None
    nodes: dict[str, NodeOutcome] = Field(default_factory=dict)


def load_plan(path: Path) -> NightlyPlan:
    """Load and validate a plan; errors name the file and the field."""
    return storage.load_model(path, NightlyPlan)


def load_nightly(nightly_dir: Path) -> NightlyRecord:
    return storage.load_model(nightly_dir / NIGHTLY_FILE, NightlyRecord)

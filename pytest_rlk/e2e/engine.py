"""The engine contract: what the one A/B runner (`pytest_rlk.e2e.runner`) asks of a framework.

The runner does everything engines share: it plans both arms of every lane, checks that they
differ only by the kernel switch, launches them (`launcher`), shows progress, gates the series
(`gates`), writes the report (`report`) and `ab_result.json`. An engine says only what is its own:

- `name`, `settings_model`: the spec's `engine` value and the pydantic model of its section;
- `scope`: the report's statement of what the kernels do in this engine (and do not);
- `options`: its `rlk e2e plan|run` options (`--vime-root` ...), given to `prepare`;
- `prepare`: usage checks of options and paths, how arms launch (`LaunchConfig`), commits;
- `arm_commands`: the (baseline, kernels) commands of a lane, in the directories it is given;
- `read_arm`: an arm's per-rollout series (canonical metric names) and what else it left;
- `progress`: one output line -> a finished rollout step with a few metrics, or None;
- `report_extras`: the report's hardware line, setup commands and notes.

An engine lives in `pytest_rlk/e2e/engines/<name>/` and exposes `ENGINE` (docs/e2e-engines.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.launcher import ArmResult, LaunchConfig
from pytest_rlk.e2e.spec import ABSpec, ArmRole, EngineSettings, Lane, SpecError


@dataclass(frozen=True)
class EngineOption:
    """A command-line option of `rlk e2e plan|run` that one engine takes (`--vime-root`)."""

    flag: str
    help: str
    default: Any = None
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class RunContext:
    """What `Engine.prepare` resolved for one run or plan. Engines subclass it for their own
    resolved options (a checkout, an interpreter)."""

    run_dir: str
    launch: LaunchConfig
    label: str  # the engine as the report names it, e.g. "vime (ray mode)"
    concurrent_arms: bool = False  # the arms of a live lane may run at the same time
    platform: str | None = None  # the verdict's platform tag (default: the spec's)
    commits: dict[str, str | None] = field(default_factory=dict)  # checkouts the run used
    plan_notes: tuple[str, ...] = ()  # comment lines a plan prints above the commands


@dataclass(frozen=True)
class ArmLayout:
    """Where the runner puts one lane's arms: the engine builds its commands around these."""

    run_dir: str
    lane: Lane
    dirs: dict[ArmRole, str]  # each arm's own directory (its log, outputs)
    spec_file: str  # the spec the arms read, written by the runner before they start


# The `ArmReading.info` key under which an engine that parses an arm's log records the lines it could
# not read: {"count": n, "first": [description, ...]} (ab_result.json repeats it per arm).
UNREADABLE_LINES = "unreadable_lines"


@dataclass
class ArmReading:
    """What an engine read back from one arm (also from a failed one: a partial series)."""

    series: m.ArmSeries = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # fail the lane's gate (named in it)
    notes: list[str] = field(default_factory=list)
    fallback_events: int = 0  # kernel fallbacks seen outside the series (log lines)
    info: dict[str, Any] = field(default_factory=dict)  # the engine's record of the arm, saved


@dataclass(frozen=True)
class StepProgress:
    """One finished rollout step as an arm reported it on its output."""

    index: int
    metrics: dict[str, float] = field(default_factory=dict)  # canonical names


@dataclass(frozen=True)
class ReportExtras:
    hardware: str
    setup_commands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commits: dict[str, str | None] = field(default_factory=dict)  # beside RunContext.commits
    versions: dict[str, str | None] = field(default_factory=dict)  # software the arms ran (torch, triton, ...)


class Engine(Protocol):
    name: str
    settings_model: type[EngineSettings]
    scope: str
    options: tuple[EngineOption, ...]

    def prepare(self, spec: ABSpec, options: Mapping[str, Any], *, run_dir: str, for_run: bool) -> RunContext:
        """Check the options (raise `SpecError`: a usage error). `for_run` False: a plan, where
        paths not given stay placeholders."""
        ...

    def arm_commands(self, spec: ABSpec, lane: Lane, ctx: RunContext, layout: ArmLayout) -> tuple[ArmCommand, ArmCommand]:
        ...

    def read_arm(self, spec: ABSpec, command: ArmCommand, result: ArmResult, arm_dir: Path) -> ArmReading:
        ...

    def progress(self, line: str) -> StepProgress | None:
        ...

    def report_extras(self, spec: ABSpec, ctx: RunContext, readings: Mapping[ArmRole, ArmReading],
                      wall_s: float) -> ReportExtras:
        ...


def resolve_options(engine: Engine, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The engine's options with their defaults; an option it does not take is a usage error."""
    known = {option.dest: option for option in engine.options}
    given = {dest: value for dest, value in (given or {}).items() if value is not None}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise SpecError(f"engine {engine.name!r} does not take the option(s) {unknown}")
    return {dest: given.get(dest, option.default) for dest, option in known.items()}

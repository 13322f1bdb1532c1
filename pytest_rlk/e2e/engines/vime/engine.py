"""The vime engine: `train.py` arms under a Ray head of their own, read back from their stdout.

Commands come from `commands` (flags per vime-facts.md), metrics from vime's stdout metric lines
(`log`), cross-checked against TensorBoard events where vime wrote them. `--vime-root` names the
checkout; a pinned `vime.commit` must match its HEAD. `--mode local` runs `train.py` as a plain
subprocess (the stand-in tests), `--entry` replaces the spec's script.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.engine import (
    ArmLayout,
    ArmReading,
    EngineOption,
    ReportExtras,
    RunContext,
    UNREADABLE_LINES,
    StepProgress,
)
from pytest_rlk.e2e.engines.vime import commands
from pytest_rlk.e2e.engines.vime.log import (
    VIME_KEY_MAP,
    VimeLogError,
    metric_line,
    parse_metric_dict,
    parse_vime_log,
)
from pytest_rlk.e2e.engines.vime.settings import VimeSettings
from pytest_rlk.e2e.launcher import ArmResult, LaunchConfig
from pytest_rlk.e2e.report import NO_MOE_CLAIM
from pytest_rlk.e2e.spec import ABSpec, ArmRole, Lane, SpecError
from pytest_rlk.e2e.tensorboard import TensorBoardError, cross_check, read_scalars
from pytest_rlk.manifest import git_state


@dataclass(frozen=True)
class VimeContext(RunContext):
    vime_root: str = commands.VIME_ROOT_PLACEHOLDER
    python: str = "python3"
    entry: str | None = None


def steps_per_rollout(spec: ABSpec) -> int:
    hp = spec.hyperparameters
    return hp.rollout_batch_size * hp.n_samples_per_prompt // hp.global_batch_size


def check_vime_root(spec: ABSpec, vime_root: Path, *, entry: str | None) -> str | None:
    """Validate the checkout; returns its commit. A pinned commit must match."""
    settings = spec.settings
    assert isinstance(settings, VimeSettings)
    if not vime_root.is_dir():
        raise SpecError(f"--vime-root {vime_root}: not a directory")
    script = Path(entry) if entry else vime_root / settings.entry
    if not script.is_file():
        raise SpecError(f"--vime-root {vime_root}: {script} not found (is this a vime checkout?)")
    commit = git_state(vime_root)[0]
    if settings.commit and commit and not commit.startswith(settings.commit):
        raise SpecError(f"{spec.case}: spec pins vime commit {settings.commit} but {vime_root} is at {commit}")
    return commit


def gap_findings(command: ArmCommand, gaps: Mapping[str, list[int]]) -> tuple[list[str], list[str]]:
    """(problems, notes) for metrics missing at some rollouts: a metric the lane gates is a problem
    naming metric, arm and rollouts; any other is kept as a gap and noted."""
    problems, notes = [], []
    for name, rollouts in gaps.items():
        policy = m.E2E_METRICS.get(name)
        gated = policy is not None and policy.gated and name not in m.NEVER_COMPARED and (
            policy.live if command.lane == "live" else policy.replay_per_step)
        if gated or name == m.FALLBACK_COUNT:
            problems.append(f"{command.label} ({command.lane} lane): gated metric {name!r} missing at rollouts {rollouts}")
        else:
            notes.append(f"{command.label}: {name!r} missing at rollouts {rollouts} (kept as gaps; not gated)")
    return problems, notes


class VimeEngine:
    name = "vime"
    settings_model = VimeSettings
    scope = (
        "Scope: the kernel arm differs from the baseline only by the kernel switch shown below; the "
        "kernels compute selected log-probs, ratio/KL and the GRPO policy loss (and linear_logp where "
        "enabled). " + NO_MOE_CLAIM + " Where rollout routing replay (R3) is on, both arms use vime's "
        "own R3: the comparison shows compatibility with R3, not a replacement of it."
    )
    options = (
        EngineOption("--vime-root", "vime checkout at the spec's pinned commit: required to run; a plan "
                     "shows ${VIME_ROOT} without it"),
        EngineOption("--mode", "ray: own Ray head + ray job submit (default); local: plain subprocess",
                     default="ray", choices=("ray", "local")),
        EngineOption("--entry", "script to run instead of the spec's train.py (tests: the stand-in)"),
        EngineOption("--python", "interpreter for train.py inside the job (default python3)", default="python3"),
        EngineOption("--ray-bin", "the `ray` executable (default ray; needs ray[default] for jobs)", default="ray"),
        EngineOption("--platform", "platform tag for the verdict (default: the spec's)"),
    )

    def prepare(self, spec: ABSpec, options: Mapping[str, Any], *, run_dir: str, for_run: bool) -> VimeContext:
        root, entry, commit = options["vime_root"], options["entry"], None
        notes = []
        if root is None:
            if for_run:
                raise SpecError(f"{spec.case}: engine 'vime' needs --vime-root (the vime checkout)")
            root = commands.VIME_ROOT_PLACEHOLDER
            notes.append(f"{root}: the vime checkout (give --vime-root to see its paths)")
        else:
            root_path = Path(root).resolve()
            commit = check_vime_root(spec, root_path, entry=entry)
            root = str(root_path)
        mode = options["mode"]
        if mode == "ray":
            notes.append("each arm gets a Ray head of its own on free loopback ports (chosen at run time)")
        launch = LaunchConfig(mode=mode, ray_bin=options["ray_bin"], head_gpus=spec.hardware.gpus,
                              head_start_s=spec.timeouts.head_start_s, poll_memory=spec.hardware.platform != "cpu")
        return VimeContext(run_dir=run_dir, launch=launch, label=f"vime ({mode} mode{', entry ' + entry if entry else ''})",
                           platform=options["platform"], commits={"vime": commit}, plan_notes=tuple(notes),
                           vime_root=root, python=options["python"], entry=entry)

    def arm_commands(self, spec: ABSpec, lane: Lane, ctx: VimeContext, layout: ArmLayout) -> tuple[ArmCommand, ArmCommand]:
        return commands.arm_commands(spec, lane, vime_root=ctx.vime_root, run_dir=layout.run_dir, dirs=layout.dirs,
                                     python=ctx.python, entry=ctx.entry)

    def read_arm(self, spec: ABSpec, command: ArmCommand, result: ArmResult, arm_dir: Path) -> ArmReading:
        """The arm's stdout metrics (also of a failed arm: what it printed), checked against its
        TensorBoard events where there are any."""
        reading = ArmReading()
        log = parse_vime_log(result.log_path)
        steps = steps_per_rollout(spec)
        try:
            reading.series = log.series(steps)
            gap_problems, gap_notes = gap_findings(command, log.gaps(steps))
            reading.problems += gap_problems
            reading.notes += gap_notes
            replays = "--load-debug-rollout-data" in command.lane_args
            reading.notes += [f"{command.label}: expected line never came: {line}"
                              for line in log.missing_lines(steps, replays_rollouts=replays)]
        except VimeLogError as exc:
            reading.problems.append(f"{command.label}: unusable metrics in {result.log_path}: {exc}")
        if log.malformed:
            reading.problems.append(f"{command.label}: {len(log.malformed)} unreadable metric lines in "
                                    f"{result.log_path} (first: {log.malformed[0].describe()})")
        tb_dir = Path(command.output_env.get("TENSORBOARD_DIR", arm_dir / "tensorboard"))
        try:
            tb = read_scalars(tb_dir) if tb_dir.is_dir() else None
        except TensorBoardError as exc:
            reading.problems.append(str(exc))
            tb = None
        if tb is None or not tb.files:
            reading.notes.append(f"{command.label}: no TensorBoard events under {tb_dir}: stdout is the only source")
        else:
            for kind in ("rollout", "step", "perf"):
                problems, notes = cross_check(log.records[kind], tb)
                reading.problems += [f"{command.label}: metric sources disagree: {p}" for p in problems]
                reading.notes += [f"{command.label}: {n}" for n in notes]
            reading.notes += tb.truncated
        reading.fallback_events = len(log.fallback_lines)
        reading.info = {UNREADABLE_LINES: log.unreadable(), "fallback_log_lines": log.fallback_lines,
                        "provider_active_lines": log.provider_active_lines}
        return reading

    def progress(self, line: str) -> StepProgress | None:
        parsed = metric_line(line)
        if parsed is None or parsed[0] != "rollout":
            return None
        try:
            values = parse_metric_dict(parsed[2])
        except ValueError:
            return None  # the log parser reports malformed lines; progress shows what it can read
        return StepProgress(parsed[1], {VIME_KEY_MAP.get(k, k): v for k, v in values.items()})

    def report_extras(self, spec: ABSpec, ctx: VimeContext, readings: Mapping[ArmRole, ArmReading],
                      wall_s: float) -> ReportExtras:
        hw = spec.hardware
        return ReportExtras(
            hardware=f"{hw.gpus}x {hw.platform}, {hw.nodes} node",
            setup_commands=[f"# {ctx.launch.mode} mode: each arm below lists its Ray head command (ray mode) and "
                            "the launch command; the arm log starts with the exact command it ran"],
            notes=[f"python: {ctx.python}", _unreadable_note(readings)],
        )


def _unreadable_note(readings: Mapping[ArmRole, ArmReading]) -> str:
    """One line: each arm's count of unreadable log lines and the first of them."""
    parts = []
    for role, reading in readings.items():
        unreadable = reading.info.get(UNREADABLE_LINES) or {"count": 0, "first": []}
        first = f" (first: {unreadable['first'][0]})" if unreadable["first"] else ""
        parts.append(f"{role} {unreadable['count']}{first}")
    return "Unreadable vime log lines: " + "; ".join(parts) + "."

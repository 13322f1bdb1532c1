"""The one A/B runner: arm commands -> launcher -> series -> gates -> report, for every engine.

For each lane of the spec (replay first: its baseline records the rollouts the kernel arm
replays) the engine builds the two arms' commands (`Engine.arm_commands`), the runner checks that
they differ only by the kernel switch (`arms.check_arms_differ_only_by_switch`), runs them through
the launcher (one after the other, or at the same time where the engine allows it in a live lane),
shows progress, has the engine read each arm back (`Engine.read_arm`), gates the pair
(`outcome.gate_arms`) and writes the report and `ab_result.json`, also when an arm failed. Then
`run_ab` raises `ABRunError` naming the failing arms, their logs and tails.

`plan_text` prints the same commands without running anything (`rlk e2e plan`).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytest_rlk.e2e.arms import ArmCommand, check_arms_differ_only_by_switch
from pytest_rlk.e2e.engine import ArmLayout, Engine, RunContext, resolve_options
from pytest_rlk.e2e.engines import get_engine
from pytest_rlk.e2e.gates import pair_verdict
from pytest_rlk.e2e.launcher import ARM_LOG, command_lines, launch_arm
from pytest_rlk.e2e.outcome import (
    SPEC_FILE, ABRun, ABRunError, ArmOutcome, ExtraArm, gate_arms, write_result, write_run_report,
)
from pytest_rlk.e2e.placeholders import (
    RUN_DIR_PLACEHOLDER, environment_value, expand_placeholders, placeholder_names,
)
from pytest_rlk.e2e.progress import Progress, SilentProgress
from pytest_rlk.e2e.spec import ARM_ROLES, ABSpec, Lane, SpecError

LANE_ORDER: tuple[Lane, ...] = ("replay", "live")


class OutputExistsError(SpecError):
    """The run directory holds something already and overwriting was not asked for."""


def lanes_in_order(spec: ABSpec) -> list[Lane]:
    return [lane for lane in LANE_ORDER if lane in spec.lanes]


def arm_dir(run_dir: str, lane: Lane, key: str) -> str:
    return f"{run_dir}/{lane}/{key}"


def _expand(cmd: ArmCommand, *, keep_unset: bool) -> ArmCommand:
    what = f"{cmd.label} ({cmd.lane})"

    def ex(text: str) -> str:
        return expand_placeholders(text, what=what, keep_unset=keep_unset)

    return replace(cmd, argv=[ex(a) for a in cmd.argv], env={k: ex(v) for k, v in cmd.env.items()},
                   lane_args=[ex(a) for a in cmd.lane_args], output_env={k: ex(v) for k, v in cmd.output_env.items()},
                   arm_env={k: ex(v) for k, v in cmd.arm_env.items()})


def plan_arms(engine: Engine, spec: ABSpec, ctx: RunContext, extra_arms: Iterable[ExtraArm] = (), *,
              keep_unset: bool = False) -> dict[tuple[Lane, str], ArmOutcome]:
    """Every arm's resolved command and directory, lane by lane (the pair first, then extras)."""
    extras = list(extra_arms)
    for extra in extras:
        if extra.spec.engine != spec.engine or extra.lane not in spec.lanes or extra.key in ARM_ROLES:
            raise SpecError(f"extra arm {extra.key!r}: needs a key other than {ARM_ROLES}, engine {spec.engine!r} "
                            f"and one of the lanes {spec.lanes}")
    planned: dict[tuple[Lane, str], ArmOutcome] = {}
    for lane in lanes_in_order(spec):
        dirs = {role: arm_dir(ctx.run_dir, lane, role) for role in ARM_ROLES}
        layout = ArmLayout(ctx.run_dir, lane, dirs, f"{ctx.run_dir}/{SPEC_FILE}")
        base, kern = (_expand(c, keep_unset=keep_unset) for c in engine.arm_commands(spec, lane, ctx, layout))
        check_arms_differ_only_by_switch(base, kern, spec.kernel_switch)
        for cmd in (base, kern):
            planned[(lane, cmd.role)] = ArmOutcome(cmd.role, spec, cmd, Path(dirs[cmd.role]))
        for extra in (e for e in extras if e.lane == lane):
            own = arm_dir(ctx.run_dir, lane, extra.key)
            layout = ArmLayout(ctx.run_dir, lane, {role: own for role in ARM_ROLES}, f"{own}/{SPEC_FILE}")
            cmd = engine.arm_commands(extra.spec, lane, ctx, layout)[ARM_ROLES.index(extra.role)]
            planned[(lane, extra.key)] = ArmOutcome(extra.key, extra.spec, _expand(cmd, keep_unset=keep_unset),
                                                    Path(own))
    return planned


def plan_text(spec: ABSpec, options: Mapping[str, Any] | None = None, *, run_dir: str | None = None) -> str:
    """The dry run: the exact commands of both arms for every lane."""
    engine = get_engine(spec.engine)
    ctx = engine.prepare(spec, resolve_options(engine, options), run_dir=run_dir or RUN_DIR_PLACEHOLDER,
                         for_run=False)
    planned = plan_arms(engine, spec, ctx, keep_unset=True)
    switch = spec.kernel_switch
    lines = [
        f"# A/B plan: {spec.case} (engine {spec.engine}, {spec.purpose}): {spec.description}",
        f"# model {spec.model.name}, dataset {spec.dataset.name}, {spec.hardware.gpus}x {spec.hardware.platform}",
        f"# arms differ only by the kernel switch: env {' '.join(f'{k}={v}' for k, v in switch.env.items())}"
        + (f"; args {' '.join(switch.args)}" if switch.args else ""),
    ]
    lines += [f"# declared environment of the {o.key} arm: {' '.join(f'{k}={v}' for k, v in o.command.arm_env.items())}"
              for o in planned.values() if o.command.arm_env and o.lane == lanes_in_order(spec)[-1]]
    if run_dir is None:
        lines.append(f"# {RUN_DIR_PLACEHOLDER}: the run's --out directory; `rlk e2e run` writes the spec to "
                     f"{RUN_DIR_PLACEHOLDER}/{SPEC_FILE} first")
    unset = sorted({name for name in placeholder_names(spec.model_dump_json()) if environment_value(name) is None})
    if unset:
        lines.append("# not set here, so shown as written (`rlk e2e run` refuses them unset): "
                     + ", ".join(f"${{{name}}}" for name in unset))
    lines += [f"# {note}" for note in ctx.plan_notes]
    lane = None
    for (arm_lane, key), outcome in planned.items():
        if arm_lane != lane:
            lane = arm_lane
            lines += ["", f"## lane {lane}"]
        lines.append(f"# {outcome.role} arm {outcome.label!r}")
        lines += command_lines(outcome.command, ctx.launch, name=f"{spec.case}-{lane}-{key}")
    return "\n".join(lines)


def claim_out_dir(out_dir: Path, *, overwrite: bool) -> None:
    """Create the run directory. One that holds anything is refused unless `overwrite`; then it
    must be an earlier run's (it has spec.json) and is emptied first."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputExistsError(f"--out {out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"--out {out_dir}: not empty (an earlier run?); pass --overwrite to replace "
                                    "it, or choose another --out")
        if not (out_dir / SPEC_FILE).is_file():
            raise OutputExistsError(f"--out {out_dir}: not empty and not an earlier `rlk e2e run` output (no "
                                    f"{SPEC_FILE}); --overwrite replaces only those: choose another --out")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)


def run_ab(spec: ABSpec, out_dir: str | Path, *, options: Mapping[str, Any] | None = None,
           extra_arms: Iterable[ExtraArm] = (), overwrite: bool = False, progress: Progress | None = None) -> ABRun:
    """Run every lane of `spec` into `out_dir` (see the module doc). `options`: the engine's
    (`Engine.options` by dest, e.g. {"vime_root": ...}); usage errors raise `SpecError` before
    anything is written."""
    engine = get_engine(spec.engine)
    out = Path(out_dir).resolve()
    ctx = engine.prepare(spec, resolve_options(engine, options), run_dir=str(out), for_run=True)
    extras = list(extra_arms)
    planned = plan_arms(engine, spec, ctx, extras)
    claim_out_dir(out, overwrite=overwrite)
    (out / SPEC_FILE).write_text(spec.model_dump_json(indent=1))
    for outcome in planned.values():
        outcome.arm_dir.mkdir(parents=True, exist_ok=True)
        if outcome.spec is not spec:
            (outcome.arm_dir / SPEC_FILE).write_text(outcome.spec.model_dump_json(indent=1))
    run = ABRun(spec, out, ctx, planned)
    progress = progress or SilentProgress()
    progress.message(f"A/B {spec.case} (engine {ctx.label}) into {out}")
    start = time.perf_counter()
    for lane in lanes_in_order(spec):
        _run_lane(engine, run, lane, progress)
    run.wall_s = time.perf_counter() - start
    for outcome in run.arms.values():
        if outcome.result is None or not outcome.result.ok:
            run.failures.append("\n".join(outcome.problems) or f"{outcome.label}: {outcome.status}")
    lane_verdicts = [gate_arms(run, lane) for lane in run.lanes()
                     if all(run.arms[(lane, role)].result is not None for role in ARM_ROLES)]
    run.verdict = pair_verdict(lane_verdicts) if lane_verdicts else None
    progress.message(f"{spec.case}: writing the report")
    run.report = write_run_report(run, out / "report")
    write_result(run)
    if run.failures:
        raise ABRunError(f"A/B {spec.case}: {len(run.failures)} arm failure(s); artifacts kept in {out}; "
                         f"report {run.report.markdown}\n" + "\n\n".join(run.failures), run)
    return run


def _run_lane(engine: Engine, run: ABRun, lane: Lane, progress: Progress) -> None:
    arms = [o for (arm_lane, _), o in run.arms.items() if arm_lane == lane]
    concurrent = run.ctx.concurrent_arms and lane != "replay"
    progress.message(f"{run.spec.case}: {lane} lane, {len(arms)} arms"
                     + (" at the same time" if concurrent else ", one after the other")
                     + "; each arm's full output goes to its arm.log")

    def run_one(outcome: ArmOutcome) -> None:
        baseline = run.arms[(lane, "baseline")]
        if lane == "replay" and outcome.key != "baseline" and not (baseline.result and baseline.result.ok):
            outcome.status = "not run"
            outcome.reading.problems.append("not run: the baseline arm did not record the rollouts to replay")
            return
        _run_arm(engine, outcome, run.ctx, progress)

    if concurrent:
        with ThreadPoolExecutor(max_workers=len(arms)) as pool:
            list(pool.map(run_one, arms))
    else:
        for outcome in arms:
            run_one(outcome)


def _run_arm(engine: Engine, outcome: ArmOutcome, ctx: RunContext, progress: Progress) -> None:
    total = outcome.spec.hyperparameters.num_rollout
    shown = threading.Event()

    def on_line(line: str) -> None:
        try:
            step = engine.progress(line)
        except Exception as exc:  # progress is a display: the arm goes on, and the reason is shown once
            if not shown.is_set():
                shown.set()
                progress.message(f"[{outcome.label}] progress display stopped: {type(exc).__name__}: {exc}")
            return
        if step is not None:
            progress.step(outcome.label, step, total)

    progress.arm_started(outcome.label, outcome.lane, outcome.arm_dir / ARM_LOG)
    result = launch_arm(outcome.command, arm_dir=outcome.arm_dir, config=ctx.launch,
                        timeout_s=outcome.spec.timeouts.job_s, on_line=on_line)
    progress.arm_finished(outcome.label, result.status, result.duration_s)
    outcome.result, outcome.status = result, result.status
    outcome.reading = engine.read_arm(outcome.spec, outcome.command, result, outcome.arm_dir)
    if not result.ok:
        outcome.reading.problems.insert(0, result.failure_message())
    outcome.save()

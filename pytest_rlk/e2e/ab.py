"""A/B orchestration for the vime engine: run both arms of every lane, parse, gate, report.

For each lane of the spec (replay first: its baseline records the rollouts the kernel arm
replays), the baseline arm runs, then the kernel arm, each under a fresh Ray head of its own
(`launcher`), with NVML polling on GPU platforms. Each arm's directory keeps `job.log` (full
output), `ray_head.log`, `series.json` (the parsed metrics) and `tensorboard/` (vime's events).
Metrics come from stdout (`vime_log`), cross-checked against TensorBoard where events exist.
The gates (`gates.gate_lane`, engine-agnostic) give a verdict per lane and for the pair, and
`report.write_report` writes plots and the reproducibility page, also when an arm failed.

Artifacts from a failed run are kept; `run_ab` then raises `ABRunError` with the failing arm's
log tail after writing the report.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e import vime_engine
from pytest_rlk.e2e.gates import LaneVerdict, PairVerdict, gate_lane, pair_verdict
from pytest_rlk.e2e.launcher import (
    ArmResult, LaunchMode, RayHead, job_submit_argv, ray_start_argv, run_arm,
)
from pytest_rlk.e2e.report import ArmRun, ReportInputs, ReportPaths, write_report
from pytest_rlk.e2e.spec import (
    ABSpec, ArmCommand, Lane, SpecError, check_arms_differ_only_by_switch, expand_placeholders,
)
from pytest_rlk.e2e.tensorboard import TensorBoardError, cross_check, read_scalars
from pytest_rlk.e2e.vime_log import VimeLog, VimeLogError, parse_vime_log
from pytest_rlk.schema import MetricComparison, Verdict

LANE_ORDER: tuple[Lane, ...] = ("replay", "live")


class ABRunError(RuntimeError):
    """An arm failed or timed out; artifacts and the report were written before raising."""

    def __init__(self, message: str, run: ABRun) -> None:
        super().__init__(message)
        self.run = run


@dataclass
class ArmOutcome:
    command: ArmCommand
    result: ArmResult | None
    log: VimeLog | None = None
    series: m.ArmSeries = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class ABRun:
    spec: ABSpec
    out_dir: Path
    arms: dict[tuple[Lane, str], ArmOutcome]
    verdict: PairVerdict | None
    report: ReportPaths
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures and self.verdict is not None and self.verdict.passed


def steps_per_rollout(spec: ABSpec) -> int:
    hp = spec.hyperparameters
    return hp.rollout_batch_size * hp.n_samples_per_prompt // hp.global_batch_size


def _expand(cmd: ArmCommand) -> ArmCommand:
    what = f"{cmd.label} ({cmd.lane})"
    return ArmCommand(
        role=cmd.role, label=cmd.label, lane=cmd.lane,
        argv=[expand_placeholders(a, what=what) for a in cmd.argv],
        env={k: expand_placeholders(v, what=what) for k, v in cmd.env.items()},
        lane_args=[expand_placeholders(a, what=what) for a in cmd.lane_args],
        output_env={k: expand_placeholders(v, what=what) for k, v in cmd.output_env.items()},
        workdir=cmd.workdir,
    )


def lanes_in_order(spec: ABSpec) -> list[Lane]:
    return [lane for lane in LANE_ORDER if lane in spec.lanes]


def plan_text(spec: ABSpec, *, vime_root: str = vime_engine.VIME_ROOT_PLACEHOLDER,
              run_dir: str = vime_engine.RUN_DIR_PLACEHOLDER) -> str:
    """The dry run: the exact commands of both arms for every lane (ports chosen at run time)."""
    switch = spec.kernel_switch
    lines = [
        f"# A/B plan: {spec.case} (engine {spec.engine}, {spec.purpose}): {spec.description}",
        f"# model {spec.model.name}, dataset {spec.dataset.name}, {spec.hardware.gpus}x {spec.hardware.platform}",
        f"# arms differ only by the kernel switch: env {' '.join(f'{k}={v}' for k, v in switch.env.items())}"
        + (f"; args {shlex.join(switch.args)}" if switch.args else ""),
        f"# placeholders: {vime_engine.VIME_ROOT_PLACEHOLDER}, {vime_engine.RUN_DIR_PLACEHOLDER} and the spec's "
        "${VAR} paths are substituted by `rlk e2e run`; each arm gets its own Ray head on free loopback ports",
    ]
    dashboard = "http://127.0.0.1:<dashboard-port>"
    for lane in lanes_in_order(spec):
        base, kern = vime_engine.arm_commands(spec, lane, vime_root=vime_root, run_dir=run_dir)
        check_arms_differ_only_by_switch(base, kern, switch)
        lines += ["", f"## lane {lane}"]
        for cmd in (base, kern):
            head = ray_start_argv(None, f"<own temp dir>/{lane}/{cmd.role}", spec.hardware.gpus)
            submit = job_submit_argv(cmd, dashboard, f"rlk-{spec.case}-{lane}-{cmd.role}")
            lines += [f"# {cmd.role} arm {cmd.label!r}", shlex.join(head), shlex.join(submit)]
    return "\n".join(lines)


def _git_commit(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def check_vime_root(spec: ABSpec, vime_root: Path, *, entry: str | None) -> str | None:
    """Validate the checkout; returns its commit. A pinned commit must match."""
    assert spec.vime is not None
    if not vime_root.is_dir():
        raise SpecError(f"--vime-root {vime_root}: not a directory")
    script = Path(entry) if entry else vime_root / spec.vime.entry
    if not script.is_file():
        raise SpecError(f"--vime-root {vime_root}: {script} not found (is this a vime checkout?)")
    commit = _git_commit(vime_root)
    if spec.vime.commit and commit and not commit.startswith(spec.vime.commit):
        raise SpecError(f"{spec.case}: spec pins vime commit {spec.vime.commit} but {vime_root} is at {commit}")
    return commit


def _run_one_arm(cmd: ArmCommand, arm_dir: Path, *, spec: ABSpec, mode: LaunchMode, ray_bin: str,
                 poll_memory: bool) -> ArmResult:
    if mode == "local":
        return run_arm(cmd, log_path=arm_dir / "job.log", timeout_s=spec.timeouts.job_s, mode="local",
                       poll_memory=poll_memory)
    head = RayHead.start(num_gpus=spec.hardware.gpus, log_dir=arm_dir, timeout_s=spec.timeouts.head_start_s,
                         ray_bin=ray_bin)
    try:
        return run_arm(cmd, log_path=arm_dir / "job.log", timeout_s=spec.timeouts.job_s, mode="ray", head=head,
                       poll_memory=poll_memory)
    finally:
        head.stop()


def _collect(outcome: ArmOutcome, arm_dir: Path, spec: ABSpec) -> None:
    """Parse what the arm left (also after a failure) and save it as series.json."""
    result = outcome.result
    assert result is not None
    if not result.ok:
        outcome.problems.append(result.failure_message())
    log = parse_vime_log(result.log_path)
    outcome.log = log
    try:
        outcome.series = log.series(steps_per_rollout(spec))
    except VimeLogError as exc:
        outcome.problems.append(f"{outcome.command.label}: unusable metrics in {result.log_path}: {exc}")
    if log.malformed:
        first = log.malformed[0].describe()
        outcome.problems.append(f"{outcome.command.label}: {len(log.malformed)} malformed metric lines in "
                                f"{result.log_path} (first: {first})")
    tb_dir = Path(outcome.command.output_env.get("TENSORBOARD_DIR", arm_dir / "tensorboard"))
    try:
        tb = read_scalars(tb_dir) if tb_dir.is_dir() else None
    except TensorBoardError as exc:
        outcome.problems.append(str(exc))
        tb = None
    if tb is None or not tb.files:
        outcome.notes.append(f"{outcome.command.label}: no TensorBoard events under {tb_dir}: stdout is the only source")
    else:
        for kind in ("rollout", "step", "perf"):
            problems, notes = cross_check(log.records[kind], tb)
            outcome.problems += [f"{outcome.command.label}: metric sources disagree: {p}" for p in problems]
            outcome.notes += [f"{outcome.command.label}: {n}" for n in notes]
        outcome.notes += tb.truncated
    (arm_dir / "series.json").write_text(json.dumps({
        "label": outcome.command.label, "lane": outcome.command.lane, "status": result.status,
        "series": outcome.series, "peak_vram_mib_per_gpu": result.peak_vram_mib_per_gpu,
        "nvml": result.nvml_reason, "malformed_lines": len(log.malformed),
        "fallback_log_lines": log.fallback_lines,
    }, indent=1))


def _peak(result: ArmResult | None) -> dict[str, float]:
    if result is None or not result.peak_vram_mib_per_gpu:
        return {}
    return {m.PEAK_VRAM: max(result.peak_vram_mib_per_gpu.values())}


def _gate(spec: ABSpec, lane: Lane, base: ArmOutcome, kern: ArmOutcome, platform: str) -> LaneVerdict:
    assert kern.log is not None
    verdict = gate_lane(
        base.series, kern.series, case=spec.case, platform=platform, lane=lane,
        skip_warmup=spec.window.skip_warmup_rollouts, gates=spec.gates,
        baseline_label=base.command.label, kernels_label=kern.command.label,
        kernel_fallback_events=len(kern.log.fallback_lines),
        baseline_scalars=_peak(base.result), kernels_scalars=_peak(kern.result),
    )
    for outcome in (base, kern):
        for problem in outcome.problems:
            verdict.gate.comparisons.append(MetricComparison(
                name=f"{outcome.command.role}_run", verdict=Verdict.MISSING_METRIC, detail=problem.splitlines()[0]))
    if spec.gates.memory and lane == "live" and spec.hardware.platform != "cpu":
        missing = [o.result.nvml_reason for o in (base, kern) if o.result and o.result.nvml_reason]
        if missing:
            verdict.gate.comparisons.append(MetricComparison(
                name=m.PEAK_VRAM, verdict=Verdict.MISSING_METRIC, detail=f"memory gate without NVML: {missing[0]}"))
    verdict.notes.extend(base.notes + kern.notes)
    return verdict


def _command_text(outcome: ArmOutcome) -> str:
    """What the arm ran: the Ray head and job submit lines with their real ports (ray mode), or
    the local command with its environment."""
    cmd, result = outcome.command, outcome.result
    lines = []
    if result is not None and result.head_argv:
        lines.append(shlex.join(result.head_argv))
    if result is not None and result.mode == "ray":
        lines.append(shlex.join(result.launch_argv))
    else:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(cmd.full_env.items()))
        lines.append(f"cd {shlex.quote(cmd.workdir or '.')} && env {env} {shlex.join(cmd.argv)}")
    return "\n".join(lines)


def run_ab(spec: ABSpec, *, vime_root: Path, out_dir: Path, mode: LaunchMode = "ray", entry: str | None = None,
           python: str = "python3", ray_bin: str = "ray", platform: str | None = None) -> ABRun:
    """Run the spec's lanes; `entry` replaces train.py (tests run the stand-in through it)."""
    if spec.engine != "vime":
        raise SpecError(f"{spec.case}: run_ab drives the vime engine; engine {spec.engine!r} has its own runner")
    commit = check_vime_root(spec, vime_root, entry=entry)
    out_dir.mkdir(parents=True, exist_ok=True)
    platform = platform or spec.hardware.platform
    poll_memory = spec.hardware.platform != "cpu"
    arms: dict[tuple[Lane, str], ArmOutcome] = {}
    lane_verdicts: list[LaneVerdict] = []
    failures: list[str] = []
    for lane in lanes_in_order(spec):
        planned = vime_engine.arm_commands(spec, lane, vime_root=str(vime_root), run_dir=str(out_dir),
                                           python=python, entry=entry)
        base_cmd, kern_cmd = (_expand(c) for c in planned)
        check_arms_differ_only_by_switch(base_cmd, kern_cmd, spec.kernel_switch)
        for cmd in (base_cmd, kern_cmd):
            arm_dir = Path(vime_engine.arm_dir(str(out_dir), lane, cmd.role))
            arm_dir.mkdir(parents=True, exist_ok=True)
            outcome = ArmOutcome(cmd, None)
            arms[(lane, cmd.role)] = outcome
            if cmd.role == "kernels" and lane == "replay" and not arms[(lane, "baseline")].result.ok:
                outcome.problems.append("not run: the baseline arm did not record the rollouts to replay")
                continue
            outcome.result = _run_one_arm(cmd, arm_dir, spec=spec, mode=mode, ray_bin=ray_bin,
                                          poll_memory=poll_memory)
            _collect(outcome, arm_dir, spec)
        base, kern = arms[(lane, "baseline")], arms[(lane, "kernels")]
        failures += [p for o in (base, kern) for p in o.problems if o.result is None or not o.result.ok]
        if base.result is not None and kern.result is not None:
            lane_verdicts.append(_gate(spec, lane, base, kern, platform))
    verdict = pair_verdict(lane_verdicts) if lane_verdicts else None
    report = write_report(out_dir / "report", ReportInputs(
        case=spec.case, engine=f"vime ({mode} mode{', entry ' + entry if entry else ''})", platform=platform,
        hardware=f"{spec.hardware.gpus}x {spec.hardware.platform}, {spec.hardware.nodes} node",
        skip_warmup=spec.window.skip_warmup_rollouts,
        arms=[ArmRun(o.command.role, o.command.label, lane, o.series, command=_command_text(o),
                     status=o.result.status if o.result else "not run",
                     log_path=str(o.result.log_path) if o.result else None,
                     peak_vram_mib_per_gpu=o.result.peak_vram_mib_per_gpu if o.result else {})
              for (lane, _), o in arms.items()],
        verdict=verdict,
        setup_commands=[f"# {mode} mode: each arm below lists its Ray head command (ray mode) and the launch "
                        "command; the job log starts with the exact command it ran"],
        commits={"vime": commit, "pytest-rlk": _git_commit(Path(__file__).resolve().parents[2])},
        settings=spec.model_dump(mode="json", exclude={"arms", "kernel_switch"}),
        kernel_switch=" ".join(f"{k}={v}" for k, v in spec.kernel_switch.env.items()) + " "
        + shlex.join(spec.kernel_switch.args),
        notes=[f"python: {python}", f"launched by: {shlex.join([sys.executable, *sys.argv])}"],
    ))
    (out_dir / "ab_result.json").write_text(json.dumps({
        "case": spec.case, "platform": platform, "passed": bool(verdict and verdict.passed and not failures),
        "lanes": {v.lane: {"verdict": v.verdict, "failures": v.failures()} for v in (verdict.lanes if verdict else [])},
        "failures": [f.splitlines()[0] for f in failures], "report": str(report.markdown),
    }, indent=1))
    run = ABRun(spec, out_dir, arms, verdict, report, failures)
    if failures:
        raise ABRunError(f"A/B {spec.case}: {len(failures)} arm failure(s); artifacts kept in {out_dir}; "
                         f"report {report.markdown}\n" + "\n\n".join(failures), run)
    return run

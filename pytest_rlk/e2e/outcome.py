"""What an A/B run produced, for every engine: its arms, the gates, the report, `ab_result.json`.

A run directory holds `spec.json` (the spec as validated), `<lane>/<arm>/` per arm (`arm.log`,
`series.json`, the engine's own outputs), `report/` and `ab_result.json`. `load_ab_run` reads it
back; `gate_arms` gates any kernel-side arm of a lane against that lane's baseline.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.arms import ArmCommand
from pytest_rlk.e2e.engine import UNREADABLE_LINES, ArmReading, RunContext, resolve_options
from pytest_rlk.e2e.engines import get_engine
from pytest_rlk.e2e.gates import LaneVerdict, PairVerdict, gate_lane, pair_verdict
from pytest_rlk.e2e.launcher import ARM_LOG, ArmResult, command_lines
from pytest_rlk.e2e.report import ArmRun, ReportInputs, ReportPaths, write_report
from pytest_rlk.e2e.spec import ARM_ROLES, ABSpec, ArmRole, Lane, load_spec
from pytest_rlk.manifest import suite_state
from pytest_rlk.schema import MetricComparison, Verdict

SPEC_FILE = "spec.json"
SERIES_FILE = "series.json"
RESULT_FILE = "ab_result.json"
SUITE_ROOT = Path(__file__).resolve().parents[2]


class ABRunError(RuntimeError):
    """An arm failed or timed out; artifacts and the report were written before raising."""

    def __init__(self, message: str, run: ABRun) -> None:
        super().__init__(message)
        self.run = run


@dataclass(frozen=True)
class ExtraArm:
    """A further arm run beside a lane's pair, e.g. a variant that must fail the gate. It is
    gated only on request (`gate_arms(run, lane, key)`), never in the run's verdict or report."""

    key: str
    spec: ABSpec  # a variant of the run's spec (same engine): fewer rollouts, an arm's env, a label
    role: ArmRole = "kernels"
    lane: Lane = "live"


@dataclass
class ArmOutcome:
    key: str  # "baseline", "kernels" or an extra arm's key
    spec: ABSpec  # the spec this arm ran (the run's, or an extra arm's variant)
    command: ArmCommand
    arm_dir: Path
    result: ArmResult | None = None
    reading: ArmReading = field(default_factory=ArmReading)
    status: str = "not run"
    saved_peak_vram_mib_per_gpu: dict[int, float] = field(default_factory=dict)  # read back (load_ab_run)

    @property
    def label(self) -> str:
        return self.command.label

    @property
    def role(self) -> ArmRole:
        return self.command.role

    @property
    def lane(self) -> Lane:
        return self.command.lane

    @property
    def series(self) -> m.ArmSeries:
        return self.reading.series

    @property
    def info(self) -> dict:
        return self.reading.info

    @property
    def problems(self) -> list[str]:
        return self.reading.problems

    def save(self) -> None:
        peaks = self.result.peak_vram_mib_per_gpu if self.result else {}
        (self.arm_dir / SERIES_FILE).write_text(json.dumps({
            "key": self.key, "label": self.label, "lane": self.lane, "role": self.role, "status": self.status,
            "series": self.series, "peak_vram_mib_per_gpu": peaks,
            "nvml": self.result.nvml_reason if self.result else None, "problems": self.problems,
            "notes": self.reading.notes, "fallback_events": self.reading.fallback_events, "info": self.info,
            "command": dataclasses.asdict(self.command),
        }, indent=1))


@dataclass
class ABRun:
    spec: ABSpec
    out_dir: Path
    ctx: RunContext
    arms: dict[tuple[Lane, str], ArmOutcome]
    verdict: PairVerdict | None = None
    report: ReportPaths | None = None
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures and self.verdict is not None and self.verdict.passed

    @property
    def platform(self) -> str:
        return self.ctx.platform or self.spec.hardware.platform

    def lanes(self) -> list[Lane]:
        return list(dict.fromkeys(lane for lane, _ in self.arms))

    def arm(self, key: str, lane: Lane | None = None) -> ArmOutcome:
        """The arm `key` of `lane` (default: the last lane, `live` where the spec has it)."""
        return self.arms[(lane or self.lanes()[-1], key)]


def _peak(outcome: ArmOutcome) -> dict[str, float]:
    peaks = _peak_per_gpu(outcome)
    return {m.PEAK_VRAM: max(peaks.values())} if peaks else {}


def gate_arms(run: ABRun, lane: Lane | None = None, kernels_key: str = "kernels",
              baseline_key: str = "baseline") -> LaneVerdict:
    """Gate `kernels_key` against `baseline_key` of `lane` (engine-agnostic gates, `gates.gate_lane`);
    `baseline_key="kernels"` gates an A/A rerun against the kernel arm.

    A kernel-side arm planned with fewer rollouts than the baseline (an extra arm's variant) is
    compared with the baseline's first rollouts: same seeds, so the same steps.
    """
    lane = lane or run.lanes()[-1]
    base, kern = run.arms[(lane, baseline_key)], run.arms[(lane, kernels_key)]
    baseline_series = base.series
    planned = kern.spec.hyperparameters.num_rollout
    if planned < base.spec.hyperparameters.num_rollout:
        baseline_series = {name: values[:planned] for name, values in baseline_series.items()}
    spec = run.spec
    verdict = gate_lane(
        baseline_series, kern.series, case=spec.case, platform=run.platform, lane=lane,
        skip_warmup=spec.window.skip_warmup_rollouts, gates=spec.gates,
        baseline_label=base.label, kernels_label=kern.label,
        kernel_fallback_events=kern.reading.fallback_events,
        baseline_scalars=_peak(base), kernels_scalars=_peak(kern), bands=spec.bands,
        replay_horizon=spec.window.replay_horizon,
    )
    verdict.gate.comparisons.extend(absolute_checks(run, lane, (base, kern)))
    for outcome in (base, kern):
        for problem in outcome.problems:
            verdict.gate.comparisons.append(MetricComparison(
                name=f"{outcome.role}_run", verdict=Verdict.MISSING_METRIC, detail=problem.splitlines()[0]))
    if spec.gates.memory and lane == "live" and spec.hardware.platform != "cpu":
        missing = [o.result.nvml_reason for o in (base, kern) if o.result and o.result.nvml_reason]
        if missing:
            verdict.gate.comparisons.append(MetricComparison(
                name=m.PEAK_VRAM, verdict=Verdict.MISSING_METRIC, detail=f"memory gate without NVML: {missing[0]}"))
    verdict.notes.extend(base.reading.notes + kern.reading.notes)
    return verdict


def absolute_checks(run: ABRun, lane: Lane, arms: tuple[ArmOutcome, ...]) -> list[MetricComparison]:
    """Checks of each arm on its own, beside the A/B comparison:

    - vime's ceiling ``train_rollout_logprob_abs_diff <= 0.1`` on every step of a live lane
      (pytest_rlk.mismatch.gates: the assert vime and slime run under --ci-test);
    - the step-0 identities where the engine's first step has old = reference = current weights
      (``Engine.step0_identities``; pytest_rlk.mismatch.identities): ``kl_loss`` 0 within the ops'
      tolerance at the training dtype.
    """
    from pytest_rlk.mismatch import every_step_within, step0_problems, step0_tolerance
    from pytest_rlk.mismatch.gates import VIME_CEILING_ONLY

    out: list[MetricComparison] = []
    engine = get_engine(run.spec.engine)
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(getattr(run.spec.settings, "dtype", ""), "fp32")
    for arm in arms:
        series = arm.series
        if lane == "live" and m.ABS_DIFF in series:
            problems = every_step_within([{m.ABS_DIFF: v} for v in series[m.ABS_DIFF]], VIME_CEILING_ONLY)
            out.append(MetricComparison(
                name=f"{arm.role}.{m.ABS_DIFF}_ceiling", verdict=Verdict.REGRESSION if problems else Verdict.PASS,
                detail="; ".join(problems[:3]) or f"every step <= {VIME_CEILING_ONLY[0].high:g} "
                                                  f"({VIME_CEILING_ONLY[0].source})"))
        if getattr(engine, "step0_identities", False) and series.get(m.KL_LOSS):
            problems = step0_problems(kl_loss=series[m.KL_LOSS][0], tolerance=step0_tolerance(dtype))
            out.append(MetricComparison(
                name=f"{arm.role}.step0_kl_loss", verdict=Verdict.REGRESSION if problems else Verdict.PASS,
                detail="; ".join(problems) or f"kl_loss[0] = {series[m.KL_LOSS][0]:.3g}: old = reference = "
                                              "current weights at step 0"))
    return out


def write_run_report(run: ABRun, out_dir: Path, *, kernels_key: str = "kernels",
                     verdict: PairVerdict | None = None) -> ReportPaths:
    """The report (plots + reproducibility page) of every lane's baseline and `kernels_key` arm."""
    engine, spec, ctx = get_engine(run.spec.engine), run.spec, run.ctx
    pair = [o for (_, key), o in run.arms.items() if key in ("baseline", kernels_key)]
    readings = {o.role: o.reading for o in pair if o.lane == run.lanes()[-1]}
    extras = engine.report_extras(spec, ctx, readings, run.wall_s)
    switch = spec.kernel_switch
    suite_commit, suite_dirty = suite_state(SUITE_ROOT)
    declared = [f"Declared environment of the {o.label!r} arm ({o.lane} lane), beyond the kernel switch: "
                + " ".join(f"{k}={v}" for k, v in sorted(o.command.arm_env.items())) for o in pair if o.command.arm_env]
    return write_report(out_dir, ReportInputs(
        case=spec.case, engine=ctx.label, scope=engine.scope, platform=run.platform, hardware=extras.hardware,
        skip_warmup=spec.window.skip_warmup_rollouts,
        arms=[ArmRun(o.role, o.label, o.lane, o.series, status=o.status,
                     command="\n".join(command_lines(o.command, ctx.launch, name=f"{spec.case}-{o.lane}-{o.key}",
                                                     result=o.result)),
                     log_path=str(o.arm_dir / ARM_LOG), peak_vram_mib_per_gpu=_peak_per_gpu(o))
              for o in pair],
        verdict=verdict if verdict is not None else run.verdict,
        setup_commands=extras.setup_commands,
        commits={**ctx.commits, "pytest-rlk": suite_commit, **extras.commits},
        dirty={"pytest-rlk": suite_dirty}, versions=extras.versions,
        settings=spec.model_dump(mode="json", exclude={"arms", "kernel_switch"}),
        kernel_switch=" ".join([*(f"{k}={v}" for k, v in switch.env.items()), shlex.join(switch.args)]).strip(),
        notes=[*declared, *extras.notes, f"Wall time of all arms of this run: {run.wall_s:.0f} s.",
               f"launched by: {shlex.join([sys.executable, *sys.argv])}"],
    ))


def _peak_per_gpu(outcome: ArmOutcome) -> dict[int, float]:
    return outcome.result.peak_vram_mib_per_gpu if outcome.result else outcome.saved_peak_vram_mib_per_gpu


def write_result(run: ABRun) -> None:
    lanes = run.verdict.lanes if run.verdict else []
    (run.out_dir / RESULT_FILE).write_text(json.dumps({
        "case": run.spec.case, "engine": run.spec.engine, "platform": run.platform, "passed": run.passed,
        "lanes": {v.lane: {"verdict": v.verdict, "failures": v.failures()} for v in lanes},
        "failures": [f.splitlines()[0] for f in run.failures],
        UNREADABLE_LINES: {f"{lane}/{key}": o.info[UNREADABLE_LINES] for (lane, key), o in run.arms.items()
                           if UNREADABLE_LINES in o.info},
        "report": str(run.report.markdown) if run.report else None, "wall_s": run.wall_s,
    }, indent=1))


def load_ab_run(out_dir: Path, *, allow_partial: bool = False) -> ABRun:
    """A finished run (`rlk e2e run`, `run_ab`) read back from its directory: the spec, every
    arm's command, status, series and engine record, the wall time. Gate it with `gate_arms`.
    `allow_partial`: a run that died before its result is read from the arms it finished."""
    out_dir = Path(out_dir)
    result_path = out_dir / RESULT_FILE
    if not result_path.exists() and not (allow_partial and (out_dir / SPEC_FILE).exists()):
        raise FileNotFoundError(f"{result_path}: no A/B result (was {out_dir} written by `rlk e2e run`?)")
    spec = load_spec(out_dir / SPEC_FILE)
    engine = get_engine(spec.engine)
    ctx = engine.prepare(spec, resolve_options(engine, {}), run_dir=str(out_dir), for_run=False)
    arms: dict[tuple[Lane, str], ArmOutcome] = {}
    for path in sorted(out_dir.glob(f"*/*/{SERIES_FILE}")):
        saved = json.loads(path.read_text())
        arm_spec = load_spec(path.parent / SPEC_FILE) if (path.parent / SPEC_FILE).exists() else spec
        reading = ArmReading(saved["series"], saved["problems"], saved["notes"], saved["fallback_events"],
                             saved["info"])
        arms[(saved["lane"], saved["key"])] = ArmOutcome(
            saved["key"], arm_spec, ArmCommand(**saved["command"]), path.parent, reading=reading,
            status=saved["status"],
            saved_peak_vram_mib_per_gpu={int(g): v for g, v in (saved.get("peak_vram_mib_per_gpu") or {}).items()})
    lane_rank = {lane: i for i, lane in enumerate(("replay", "live"))}
    arms = dict(sorted(arms.items(), key=lambda item: lane_rank.get(item[0][0], 9)))
    wall_s = json.loads(result_path.read_text())["wall_s"] if result_path.exists() else 0.0
    return ABRun(spec, out_dir, ctx, arms, wall_s=wall_s)


def report_ab_dir(out_dir: Path, report_dir: Path | None = None) -> tuple[ABRun, ReportPaths]:
    """The report of a finished A/B directory written again (`rlk report DIR`): its arms read back,
    every lane whose two arms ran gated as `rlk e2e run` gates them, into `report_dir` (default
    DIR/report)."""
    run = load_ab_run(out_dir)
    lanes = [gate_arms(run, lane) for lane in run.lanes()
             if all((lane, role) in run.arms and run.arms[(lane, role)].status != "not run" for role in ARM_ROLES)]
    run.verdict = pair_verdict(lanes) if lanes else None
    run.report = write_run_report(run, Path(report_dir) if report_dir is not None else Path(out_dir) / "report")
    return run, run.report

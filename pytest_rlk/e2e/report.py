"""The e2e A/B report: PNG plots and a Markdown page that makes a run reproducible.

Engine-agnostic: it takes `ReportInputs` (per-arm series in the canonical schema, the exact
commands, commits, hardware, the spec's settings, the verdicts) and writes into one directory:

- `step_time_mean.png`   mean step time per arm and lane (after warmup), p50/p90 as markers
- `step_time_steps.png`  step time over rollouts, per arm
- `module_breakdown.png` median per-module times (rollout, log-probs, ref log-probs, train, sync)
- `peak_vram.png`        peak memory per GPU and arm (NVML poller), when measured
- `reward_absdiff.png`   raw_reward and train_rollout_logprob_abs_diff over rollouts
- `report.md`            verdicts, metric table, commands, commits, hardware, hyperparameters

The scope statement comes from the engine (`Engine.scope`: what the kernels compute in that
engine and what they do not); every engine's ends with `NO_MOE_CLAIM`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_rlk.e2e import metrics as m
from pytest_rlk.e2e.gates import PairVerdict
from pytest_rlk.e2e.spec import ArmRole, Lane
from pytest_rlk.schema import Window
from pytest_rlk.stats import aggregate

NO_MOE_CLAIM = (
    "This report makes no claim about mixture-of-experts (expert or router) kernels: both arms run "
    "the same expert and router code."
)


@dataclass(frozen=True)
class ArmRun:
    """One arm of one lane, as the report needs it."""

    role: ArmRole
    label: str
    lane: Lane
    series: m.ArmSeries
    command: str
    status: str = "completed"
    log_path: str | None = None
    peak_vram_mib_per_gpu: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportInputs:
    case: str
    engine: str  # as the report names it, e.g. "vime (ray mode)"
    scope: str  # the engine's scope statement (`Engine.scope`)
    platform: str
    hardware: str
    skip_warmup: int
    arms: list[ArmRun]
    verdict: PairVerdict | None
    setup_commands: list[str] = field(default_factory=list)
    commits: dict[str, str | None] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    kernel_switch: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ReportPaths:
    markdown: Path
    plots: list[Path]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _name(arm: ArmRun) -> str:
    return f"{arm.label} ({arm.lane})"


def _window_stat(values: Sequence[float], skip: int, agg: str) -> float | None:
    if len(values) <= skip:
        return None
    return aggregate(values, Window(skip=skip, agg=agg))


def _plot_step_time_mean(arms: list[ArmRun], skip: int, path: Path) -> bool:
    rows = [(a, a.series.get(m.STEP_TIME, [])) for a in arms]
    rows = [(a, v) for a, v in rows if len(v) > skip]
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [_name(a) for a, _ in rows]
    means = [_window_stat(v, skip, "mean") for _, v in rows]
    ax.bar(names, means, color=["#4c72b0" if a.role == "baseline" else "#dd8452" for a, _ in rows])
    for i, (_, v) in enumerate(rows):
        ax.scatter([i, i], [_window_stat(v, skip, "median"), _window_stat(v, skip, "p90")],
                   color="black", marker="_", s=200, zorder=3)
    ax.set_ylabel("step time (s)")
    ax.set_title(f"mean step time after {skip} warmup rollouts (ticks: p50, p90)")
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_over_steps(arms: list[ArmRun], names: Sequence[str], path: Path, skip: int) -> bool:
    present = [n for n in names if any(n in a.series for a in arms)]
    if not present:
        return False
    plt = _plt()
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 3 * len(present)), squeeze=False)
    for ax, name in zip(axes[:, 0], present, strict=True):
        for arm in arms:
            if name in arm.series:
                ax.plot(range(len(arm.series[name])), arm.series[name], marker="o", label=_name(arm))
        if skip:
            ax.axvspan(-0.5, skip - 0.5, color="grey", alpha=0.2, label="warmup (not gated)")
        ax.set_xlabel("rollout")
        ax.set_ylabel(f"{name} ({m.E2E_METRICS[name].unit})" if name in m.E2E_METRICS and m.E2E_METRICS[name].unit else name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_module_breakdown(arms: list[ArmRun], skip: int, path: Path) -> bool:
    rows = [a for a in arms if any(len(a.series.get(t, [])) > skip for t in m.MODULE_TIMES)]
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottoms = [0.0] * len(rows)
    for module in m.MODULE_TIMES:
        heights = [(_window_stat(a.series.get(module, []), skip, "median") or 0.0) for a in rows]
        ax.bar([_name(a) for a in rows], heights, bottom=bottoms, label=module.removesuffix("_s"))
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_ylabel("median time after warmup (s)")
    ax.set_title("step time by module")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_peak_vram(arms: list[ArmRun], path: Path) -> bool:
    rows = [a for a in arms if a.peak_vram_mib_per_gpu]
    if not rows:
        return False
    plt = _plt()
    gpus = sorted({g for a in rows for g in a.peak_vram_mib_per_gpu})
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, arm in enumerate(rows):
        ax.bar([g + i * width for g in range(len(gpus))],
               [arm.peak_vram_mib_per_gpu.get(g, 0.0) for g in gpus], width, label=_name(arm))
    ax.set_xticks([g + width * (len(rows) - 1) / 2 for g in range(len(gpus))], [f"GPU {g}" for g in gpus])
    ax.set_ylabel("peak memory (MiB, NVML)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _metric_table(inputs: ReportInputs) -> list[str]:
    names = sorted({n for a in inputs.arms for n in a.series})
    header = "| metric | unit | agg | " + " | ".join(_name(a) for a in inputs.arms) + " |"
    lines = [header, "|" + "---|" * (3 + len(inputs.arms))]
    for name in names:
        policy = m.E2E_METRICS.get(name)
        agg = policy.agg if policy else "mean"
        cells = []
        for arm in inputs.arms:
            stat = _window_stat(arm.series.get(name, []), inputs.skip_warmup, agg)
            cells.append("n/a" if stat is None else f"{stat:.6g}")
        note = " (not compared)" if name in m.NEVER_COMPARED else ""
        lines.append(f"| {name}{note} | {policy.unit if policy else ''} | {agg} | " + " | ".join(cells) + " |")
    if any(arm.peak_vram_mib_per_gpu for arm in inputs.arms):
        cells = [f"{max(a.peak_vram_mib_per_gpu.values()):.6g}" if a.peak_vram_mib_per_gpu else "n/a"
                 for a in inputs.arms]
        lines.append(f"| {m.PEAK_VRAM} (NVML, max over GPUs) | MiB | max | " + " | ".join(cells) + " |")
    for agg in ("p50", "p90", "p99"):
        cells = []
        for arm in inputs.arms:
            stat = _window_stat(arm.series.get(m.STEP_TIME, []), inputs.skip_warmup,
                                "median" if agg == "p50" else agg)
            cells.append("n/a" if stat is None else f"{stat:.6g}")
        lines.append(f"| {m.STEP_TIME} | s | {agg} | " + " | ".join(cells) + " |")
    return lines


def _verdict_lines(verdict: PairVerdict | None) -> list[str]:
    if verdict is None:
        return ["No verdict: the run did not produce metrics for both arms."]
    lines = [f"**Pair verdict: {verdict.verdict.upper()}** ({verdict.case} on {verdict.platform})", ""]
    lines += ["| lane | metric | baseline (fallbacks: required) | kernels | band | verdict | detail |",
              "|---|---|---|---|---|---|---|"]
    for lane in verdict.lanes:
        for c in lane.gate.comparisons:
            band = "" if c.band is None else f"{c.band.describe()} ({c.band.source})"
            lines.append(f"| {lane.lane} | {c.name} | {_fmt(c.baseline)} | {_fmt(c.new)} | {band} | "
                         f"{c.verdict.label} | {c.detail} |")
    lines.append("")
    lines += [f"- note ({lane.lane}): {note}" for lane in verdict.lanes for note in lane.notes]
    return lines


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def write_report(out_dir: str | Path, inputs: ReportInputs) -> ReportPaths:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    skip = inputs.skip_warmup
    plots: list[Path] = []
    makers = [
        ("step_time_mean.png", lambda p: _plot_step_time_mean(inputs.arms, skip, p)),
        ("step_time_steps.png", lambda p: _plot_over_steps(inputs.arms, [m.STEP_TIME], p, skip)),
        ("module_breakdown.png", lambda p: _plot_module_breakdown(inputs.arms, skip, p)),
        ("peak_vram.png", lambda p: _plot_peak_vram(inputs.arms, p)),
        ("reward_absdiff.png", lambda p: _plot_over_steps(inputs.arms, [m.RAW_REWARD, m.ABS_DIFF], p, skip)),
    ]
    missing: list[str] = []
    for filename, make in makers:
        path = out / filename
        if make(path):
            plots.append(path)
        else:
            missing.append(filename)

    md = [f"# A/B report: {inputs.case}", "", inputs.scope, ""]
    md += ["## Verdict", ""] + _verdict_lines(inputs.verdict) + [""]
    md += ["## Metrics (window after %d warmup rollouts)" % skip, ""] + _metric_table(inputs) + [""]
    md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    md += [f"- {name}: not drawn (no data for it in this run)" for name in missing] + [""]
    md += ["## Reproduce", "", f"Engine: `{inputs.engine}`. Hardware: {inputs.hardware} (platform `{inputs.platform}`).", ""]
    md += ["Commits:", ""] + [f"- {k}: `{v or 'unknown'}`" for k, v in sorted(inputs.commits.items())] + [""]
    if inputs.kernel_switch:
        md += [f"The only difference between the arms (kernel switch): `{inputs.kernel_switch}`", ""]
    if inputs.setup_commands:
        md += ["Setup:", "", "```sh", *inputs.setup_commands, "```", ""]
    for arm in inputs.arms:
        md += [f"### {_name(arm)}: {arm.status}", ""]
        if arm.log_path:
            md += [f"Full log: `{arm.log_path}`", ""]
        md += ["```sh", arm.command, "```", ""]
    md += ["## Settings (identical in both arms)", "", "```json", json.dumps(inputs.settings, indent=2, sort_keys=True), "```", ""]
    md += [f"- {note}" for note in inputs.notes]
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    return ReportPaths(path, plots)

"""The e2e A/B report: PNG plots, a Markdown page that makes a run reproducible, and the same page
as one self-contained ``report.html`` (plots inlined).

Engine-agnostic and generic over what the arms record: it takes `ReportInputs` (per-arm series in
the canonical schema, the exact commands, commits, hardware, versions, the spec's settings, the
verdicts); metric names come from the data. Into one directory it writes, where the data is there:

- `step_time_mean.png`   mean step time per arm and lane (after warmup), p50/p90/p99 as markers
- `step_time_steps.png`  step time over rollouts, per arm
- `module_breakdown.png` median time of each phase an arm records (every `*_time_s` series but the step)
- `peak_vram.png`        peak memory per arm: per GPU (NVML poller) or the arms' own peak series
- `reward_absdiff.png`   raw_reward and train_rollout_logprob_abs_diff over rollouts
- `series_steps.png`     every other per-step series, one panel each
- `report.md`, `report.html`  verdict, metric table (mean, p50/p90/p99, delta and speedup),
  plots, commands, commits (with dirty flags), hardware, versions, settings

A plot or series without data is named with the reason, never drawn empty. The scope statement
comes from the engine (`Engine.scope`); every engine's ends with `NO_MOE_CLAIM`.
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
from pytest_rlk.report_html import write_html
from pytest_rlk.schema import Window
from pytest_rlk.stats import aggregate

NO_MOE_CLAIM = (
    "This report makes no claim about mixture-of-experts (expert or router) kernels: both arms run "
    "the same expert and router code."
)
ROLE_NAMES = {"baseline": "baseline arm", "kernels": "kernel arm"}
DPI = 90
MAX_PANELS = 12
STATS = ("mean", "p50", "p90", "p99")


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
    dirty: dict[str, bool | None] = field(default_factory=dict)  # per commit: uncommitted changes (None: unknown)
    versions: dict[str, str | None] = field(default_factory=dict)  # software of the arms (torch, triton, ...)
    settings: dict[str, Any] = field(default_factory=dict)
    kernel_switch: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ReportPaths:
    markdown: Path
    plots: list[Path]
    html: Path | None = None


def _name(arm: ArmRun) -> str:
    return f"{arm.label} ({arm.lane})"


def _header(arm: ArmRun) -> str:
    return f"{ROLE_NAMES.get(arm.role, arm.role)} `{arm.label}`"


def _window_stat(values: Sequence[float], skip: int, agg: str) -> float | None:
    if len(values) <= skip:
        return None
    return aggregate(values, Window(skip=skip, agg="median" if agg == "p50" else agg))


def is_time(name: str) -> bool:
    return name.endswith("_time_s")


def phases(arms: list[ArmRun]) -> list[str]:
    """The phase times the arms record (every `*_time_s` series but the whole step), the known
    ones in `MODULE_TIMES` order first."""
    found = {n for a in arms for n, v in a.series.items() if is_time(n) and n != m.STEP_TIME and v}
    return [n for n in m.MODULE_TIMES if n in found] + sorted(found - set(m.MODULE_TIMES))


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.1)  # "tight": legends beside the axes


def _legend_outside(ax) -> None:
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _color(arm: ArmRun, arms: list[ArmRun]) -> str:
    palette = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
    return palette[arms.index(arm) % len(palette)]


def _plot_step_time_mean(arms: list[ArmRun], skip: int, path: Path) -> str | None:
    rows = [a for a in arms if len(a.series.get(m.STEP_TIME, [])) > skip]
    if not rows:
        return None
    fig = _figure(7, 1.4 + 0.5 * len(rows))
    ax = fig.add_subplot()
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [_window_stat(a.series[m.STEP_TIME], skip, "mean") for a in rows], height=0.6,
            color=[_color(a, arms) for a in rows], label="mean")
    for stat, marker in (("p50", "|"), ("p90", "4"), ("p99", "x")):
        ax.scatter([_window_stat(a.series[m.STEP_TIME], skip, stat) for a in rows], ys, color="black",
                   marker=marker, s=120, zorder=3, label=stat)
    ax.set_yticks(ys, [_name(a) for a in rows], fontsize="small")
    ax.set_xlabel("step time (s)")
    ax.set_title(f"step time after {skip} warmup rollouts", fontsize="medium")
    _legend_outside(ax)
    _save(fig, path)
    return f"mean step time per arm after {skip} warmup rollouts (bars), p50/p90/p99 as markers"


def _plot_over_steps(arms: list[ArmRun], names: Sequence[str], path: Path, skip: int, title: str) -> str | None:
    present = [n for n in names if any(a.series.get(n) for a in arms)]
    if not present:
        return None
    columns = 1 if len(present) == 1 else 2 if len(present) <= 4 else 3
    rows = -(-len(present) // columns)
    fig = _figure(4.2 * columns + 1.8, 2.8 * rows)
    for i, name in enumerate(present):
        ax = fig.add_subplot(rows, columns, i + 1)
        for arm in arms:
            if arm.series.get(name):
                ax.plot(range(len(arm.series[name])), arm.series[name], marker="o", markersize=3,
                        color=_color(arm, arms), label=_name(arm))
        if skip:
            ax.axvspan(-0.5, skip - 0.5, color="grey", alpha=0.2, label="warmup (not gated)")
        ax.set_xlabel("rollout", fontsize="small")
        unit = m.E2E_METRICS[name].unit if name in m.E2E_METRICS else ""
        ax.set_title(f"{name} ({unit})" if unit else name, fontsize="small")
        ax.tick_params(labelsize="x-small")
        if i == columns - 1 or len(present) == 1:
            _legend_outside(ax)
    fig.tight_layout()
    _save(fig, path)
    return f"{title} over rollouts, one line per arm" + ("; shaded: warmup" if skip else "")


def _plot_module_breakdown(arms: list[ArmRun], skip: int, path: Path) -> str | None:
    names = phases(arms)
    rows = [a for a in arms if any(len(a.series.get(n, [])) > skip for n in names)]
    if not rows:
        return None
    fig = _figure(8, 1.4 + 0.35 * len(names) * len(rows))
    ax = fig.add_subplot()
    height = 0.8 / len(rows)
    for k, arm in enumerate(rows):
        ys = [len(names) - 1 - i + (len(rows) / 2 - k - 0.5) * height for i in range(len(names))]
        ax.barh(ys, [_window_stat(arm.series.get(n, []), skip, "median") or 0.0 for n in names], height=height,
                color=_color(arm, arms), label=_name(arm))
    ax.set_yticks(list(range(len(names)))[::-1], [n.removesuffix("_s") for n in names], fontsize="small")
    ax.set_xlabel("median time per rollout after warmup (s)")
    ax.set_title("time per phase", fontsize="medium")
    _legend_outside(ax)
    _save(fig, path)
    absent = [n for n in m.MODULE_TIMES if n not in names]
    return ("median time of each phase the arms record, after warmup (phases may nest: a training phase holds "
            "its loss and optimizer times)" + (f"; not recorded by this engine's arms: {', '.join(absent)}"
                                               if absent else ""))


def _memory_series(arms: list[ArmRun]) -> list[str]:
    return sorted({n for a in arms for n, v in a.series.items() if n.startswith("peak_") and n.endswith("_mib") and v})


def _plot_peak_vram(arms: list[ArmRun], path: Path) -> str | None:
    per_gpu = [a for a in arms if a.peak_vram_mib_per_gpu]
    if per_gpu:
        gpus = sorted({g for a in per_gpu for g in a.peak_vram_mib_per_gpu})
        bars = {(f"GPU {g}", _name(a)): a.peak_vram_mib_per_gpu.get(g, 0.0) for a in per_gpu for g in gpus}
        rows, groups, what = [f"GPU {g}" for g in gpus], [a for a in per_gpu], "peak memory per GPU (MiB, NVML poller)"
    else:
        names = _memory_series(arms)
        groups = [a for a in arms if any(a.series.get(n) for n in names)]
        if not groups:
            return None
        bars = {(n, _name(a)): max(a.series[n]) for a in groups for n in names if a.series.get(n)}
        rows, what = names, "peak memory the arms record (MiB, the largest value over the run)"
    fig = _figure(7, 1.4 + 0.45 * len(rows) * len(groups))
    ax = fig.add_subplot()
    height = 0.8 / len(groups)
    for k, arm in enumerate(groups):
        ys = [len(rows) - 1 - i + (len(groups) / 2 - k - 0.5) * height for i in range(len(rows))]
        ax.barh(ys, [bars.get((r, _name(arm)), 0.0) for r in rows], height=height, color=_color(arm, arms),
                label=_name(arm))
    ax.set_yticks(list(range(len(rows)))[::-1], rows, fontsize="small")
    ax.set_xlabel("MiB")
    ax.set_title(what, fontsize="medium")
    _legend_outside(ax)
    _save(fig, path)
    return what


def _other_series(arms: list[ArmRun]) -> tuple[list[str], list[str]]:
    """(names to plot, names left out with why): per-step series not plotted elsewhere."""
    taken = {m.STEP_TIME, m.RAW_REWARD, m.ABS_DIFF, *phases(arms), *_memory_series(arms)}
    names = sorted({n for a in arms for n in a.series} - taken)
    shown, left = [], []
    for n in names:
        values = [v for a in arms for v in a.series.get(n, [])]
        if not values:
            left.append(f"{n}: no values")
        elif all(v == 0 for v in values):
            left.append(f"{n}: 0 at every step in every arm")
        elif len(shown) >= MAX_PANELS:
            left.append(f"{n}: past the {MAX_PANELS} panels of the chart (in the metric table)")
        else:
            shown.append(n)
    return shown, left


def _delta_cells(name: str, base: float | None, new: float | None) -> list[str]:
    if base is None or new is None:
        return ["-", "-", "-"]
    delta = new - base
    rel = f"{delta / abs(base):+.1%}" if base else "-"
    if is_time(name) and new > 0:
        speedup = f"{base / new:.3g}x"
    elif name.endswith("_per_s") and base > 0:
        speedup = f"{new / base:.3g}x"
    else:
        speedup = "-"
    return [f"{delta:+.4g}", rel, speedup]


def _metric_table(inputs: ReportInputs) -> list[str]:
    """One row per metric and arm: mean and p50/p90/p99 after warmup; the kernel arm's rows add the
    delta of the mean to its lane's baseline and, for times and throughputs, the speedup."""
    skip = inputs.skip_warmup
    names = sorted({n for a in inputs.arms for n in a.series})
    headers = ["metric", "arm", "rollouts", *STATS, "Δ mean vs baseline", "Δ %", "speedup"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    baselines = {a.lane: a for a in inputs.arms if a.role == "baseline"}
    for name in names:
        policy = m.E2E_METRICS.get(name)
        unit = f" [{policy.unit}]" if policy and policy.unit else " [s]" if is_time(name) else ""
        note = " (not compared)" if name in m.NEVER_COMPARED else ""
        for k, arm in enumerate(inputs.arms):
            values = arm.series.get(name, [])
            stats = [_window_stat(values, skip, s) for s in STATS]
            cells = ["n/a" if s is None else f"{s:.4g}" for s in stats]
            base = baselines.get(arm.lane)
            delta = (_delta_cells(name, _window_stat(base.series.get(name, []), skip, "mean"), stats[0])
                     if arm.role != "baseline" and base is not None else ["", "", ""])
            label = f"{name}{unit}{note}" if k == 0 else ""
            lines.append(f"| {label} | {_name(arm)} | {max(0, len(values) - skip)} | " + " | ".join(cells + delta) + " |")
    if any(arm.peak_vram_mib_per_gpu for arm in inputs.arms):
        for k, arm in enumerate(inputs.arms):
            peak = max(arm.peak_vram_mib_per_gpu.values()) if arm.peak_vram_mib_per_gpu else None
            label = f"{m.PEAK_VRAM} [MiB] (NVML, max over GPUs)" if k == 0 else ""
            lines.append(f"| {label} | {_name(arm)} | - | {'n/a' if peak is None else f'{peak:.6g}'} | | | | | | |")
    return lines


def _verdict_lines(inputs: ReportInputs) -> list[str]:
    verdict = inputs.verdict
    if verdict is None:
        return ["No verdict: the run did not produce metrics for both arms."]
    base = next((a for a in inputs.arms if a.role == "baseline"), None)
    kern = next((a for a in inputs.arms if a.role == "kernels"), None)
    lines = [f"**Pair verdict: {verdict.verdict.upper()}** ({verdict.case} on {verdict.platform})", ""]
    headers = ["lane", "metric", _header(base) if base else "baseline arm", _header(kern) if kern else "kernel arm",
               "band", "verdict", "detail"]
    lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for lane in verdict.lanes:
        for c in lane.gate.comparisons:
            band = "" if c.band is None else f"{c.band.describe()} ({c.band.source})"
            lines.append(f"| {lane.lane} | {c.name} | {_fmt(c.baseline)} | {_fmt(c.new)} | {band} | "
                         f"{c.verdict.label} | {c.detail} |")
    lines += ["", "The baseline arm runs without our kernels (a kernel fallback there is expected); the kernel arm "
                  "runs with the kernel switch below.", ""]
    lines += [f"- note ({lane.lane}): {note}" for lane in verdict.lanes for note in lane.notes]
    return lines


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def _commit_lines(inputs: ReportInputs) -> list[str]:
    lines = []
    for name, commit in sorted(inputs.commits.items()):
        dirty = inputs.dirty.get(name)
        flag = "dirty: unknown" if dirty is None else "dirty: yes (uncommitted changes)" if dirty else "dirty: no"
        lines.append(f"- {name}: `{commit or 'unknown'}` ({flag})")
    return lines or ["- none recorded"]


def write_report(out_dir: str | Path, inputs: ReportInputs) -> ReportPaths:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):  # a report directory holds this run's plots only
        old.unlink()
    skip, arms = inputs.skip_warmup, inputs.arms
    others, left_out = _other_series(arms)
    makers = [
        ("step_time_mean.png", lambda p: _plot_step_time_mean(arms, skip, p), f"no {m.STEP_TIME} after warmup"),
        ("step_time_steps.png", lambda p: _plot_over_steps(arms, [m.STEP_TIME], p, skip, m.STEP_TIME),
         f"no {m.STEP_TIME}"),
        ("module_breakdown.png", lambda p: _plot_module_breakdown(arms, skip, p), "no phase times (`*_time_s`)"),
        ("peak_vram.png", lambda p: _plot_peak_vram(arms, p), "no memory measured (no NVML poller, no peak_*_mib series)"),
        ("reward_absdiff.png", lambda p: _plot_over_steps(arms, [m.RAW_REWARD, m.ABS_DIFF], p, skip,
                                                          f"{m.RAW_REWARD} and {m.ABS_DIFF}"),
         f"no {m.RAW_REWARD} or {m.ABS_DIFF}"),
        ("series_steps.png", lambda p: _plot_over_steps(arms, others, p, skip, "every other per-step series"),
         "no other per-step series"),
    ]
    plots: list[tuple[Path, str]] = []
    missing: list[str] = []
    for filename, make, why in makers:
        caption = make(out / filename)
        if caption:
            plots.append((out / filename, caption))
        else:
            missing.append(f"{filename}: not drawn ({why} in this run)")

    verdict = inputs.verdict
    headline = (f"**{verdict.verdict.upper()}**: pair verdict of {verdict.case} on {verdict.platform}"
                if verdict else "**NO VERDICT**: the run did not produce metrics for both arms")
    sections = ["Verdict", "Metrics", "Plots", "Reproduce", "Settings"]
    md = [f"# A/B report: {inputs.case}", "", headline, "",
          "Contents: " + " · ".join(f"[{s}](#{s.lower()})" for s in sections), "", inputs.scope, ""]
    md += ["## Verdict", ""] + _verdict_lines(inputs) + [""]
    md += ["## Metrics", "", f"After {skip} warmup rollouts; the kernel arm's rows give the change of the mean "
                             "from its lane's baseline, and for times and throughputs the speedup (baseline time / "
                             "kernel arm time).", ""]
    md += _metric_table(inputs) + [""]
    md += ["## Plots", ""]
    for path, caption in plots:
        md += [f"![{path.stem}]({path.name})", "", f"*{caption}*", ""]
    md += [f"- {line}" for line in missing + [f"series left out of series_steps.png: {n}" for n in left_out]] + [""]
    md += ["## Reproduce", "", f"Engine: `{inputs.engine}`. Hardware: {inputs.hardware} (platform `{inputs.platform}`).", ""]
    md += ["Commits:", ""] + _commit_lines(inputs) + [""]
    if inputs.versions:
        md += ["Software (the arms'): " + ", ".join(f"{k} {v or 'not installed'}"
                                                   for k, v in sorted(inputs.versions.items())), ""]
    if inputs.kernel_switch:
        md += [f"The only difference between the arms (kernel switch): `{inputs.kernel_switch}`", ""]
    if inputs.setup_commands:
        md += ["Setup:", "", "```sh", *inputs.setup_commands, "```", ""]
    for arm in arms:
        md += [f"### {_name(arm)}: {arm.status}", ""]
        if arm.log_path:
            md += [f"Full log: `{arm.log_path}`", ""]
        md += ["```sh", arm.command, "```", ""]
    md += ["## Settings", "", "Identical in both arms:", "", "```json",
           json.dumps(inputs.settings, indent=2, sort_keys=True), "```", ""]
    md += [f"- {note}" for note in inputs.notes]
    text = "\n".join(md) + "\n"
    path = out / "report.md"
    path.write_text(text)
    html = write_html(text, out, out / "report.html", title=f"A/B report: {inputs.case}")
    return ReportPaths(path, [p for p, _ in plots], html)

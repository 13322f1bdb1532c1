"""PNG plots of a run (matplotlib's Agg canvas directly: no global backend switch)."""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pytest_rlk.compare import scalar_value
from pytest_rlk.performance import PerfCase, collect, is_ours
from pytest_rlk.schema import MetricRecord, RunRecord


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:120] or "plot"


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _label(metric: MetricRecord) -> str:
    unit = f" [{metric.unit}]" if metric.unit else ""
    return f"{metric.name}{unit} ({metric.space}, {metric.direction.replace('_', ' ')})"


def _metrics_by_name(run: RunRecord) -> dict[str, list[tuple[str, MetricRecord]]]:
    by_name: dict[str, list[tuple[str, MetricRecord]]] = defaultdict(list)
    for test in run.tests:
        for m in test.metrics:
            by_name[m.name].append((test.case, m))
    return by_name


def plot_series(run: RunRecord, out_dir: Path) -> list[Path]:
    """One line plot per series metric over steps, one line per case."""
    paths = []
    for name, entries in sorted(_metrics_by_name(run).items()):
        series = [(case, m) for case, m in entries if m.is_series]
        if not series:
            continue
        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        for case, m in series:
            ax.plot(range(len(m.value)), m.value, marker=".", label=case)
        ax.set_xlabel("step")
        ax.set_ylabel(_label(series[0][1]))
        ax.set_title(name)
        ax.legend(fontsize="small")
        paths.append(_save(fig, out_dir / f"series_{_slug(name)}.png"))
    return paths


def _bars(title: str, ylabel: str, labels: list[str], values: list[float], path: Path) -> Path:
    fig = Figure(figsize=(max(5, 0.8 * len(labels) + 2), 4))
    ax = fig.add_subplot()
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _save(fig, path)


def plot_scalars(run: RunRecord, out_dir: Path) -> list[Path]:
    """One bar chart per scalar metric (memory ones included), one bar per case."""
    paths = []
    for name, entries in sorted(_metrics_by_name(run).items()):
        scalars = [(case, m) for case, m in entries if not m.is_series]
        if not scalars:
            continue
        prefix = "memory" if scalars[0][1].space == "memory" else "scalar"
        paths.append(_bars(name, _label(scalars[0][1]), [c for c, _ in scalars],
                           [m.value for _, m in scalars], out_dir / f"{prefix}_{_slug(name)}.png"))
    return paths


def plot_time_breakdown(run: RunRecord, out_dir: Path) -> list[Path]:
    """Stacked bars per case of the time metrics tagged with a ``module``."""
    per_case: dict[str, dict[str, float]] = defaultdict(dict)
    units: set[str] = set()
    for test in run.tests:
        for m in test.metrics:
            if m.space == "time" and "module" in m.tags:
                units.add(m.unit)
                per_case[test.case][m.tags["module"]] = per_case[test.case].get(m.tags["module"], 0.0) + scalar_value(m)
    if not per_case:
        return []
    cases = sorted(per_case)
    modules = sorted({mod for parts in per_case.values() for mod in parts})
    fig = Figure(figsize=(max(5, 0.8 * len(cases) + 3), 4))
    ax = fig.add_subplot()
    bottom = [0.0] * len(cases)
    for mod in modules:
        heights = [per_case[c].get(mod, 0.0) for c in cases]
        ax.bar(range(len(cases)), heights, bottom=bottom, label=mod)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right", fontsize="small")
    ax.set_ylabel("time" + (f" [{units.pop()}]" if len(units) == 1 and "" not in units else ""))
    ax.set_title("time breakdown by module")
    ax.legend(fontsize="small")
    return [_save(fig, out_dir / "time_breakdown.png")]


def plot_performance(cases: list[PerfCase], path: Path) -> Path:
    """Grouped bars: ms per impl (ours and peers) per benchmark case, log scale (peers can be
    10x apart)."""
    impls = sorted({name for c in cases for name in c.timings}, key=lambda name: (not is_ours(name), name))
    width = 0.8 / len(impls)
    fig = Figure(figsize=(max(6.0, 1.0 * len(cases) + 3), 4.5))
    ax = fig.add_subplot()
    for i, impl in enumerate(impls):
        xs = [k + (i - (len(impls) - 1) / 2) * width for k, c in enumerate(cases) if impl in c.timings]
        heights = [c.timings[impl].ms for c in cases if impl in c.timings]
        ax.bar(xs, heights, width=width, label=impl)
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)), [c.label for c in cases], rotation=30, ha="right", fontsize="small")
    ax.set_ylabel("median time [ms] (log scale)")
    ax.set_title("benchmark time per implementation")
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_run(run: RunRecord, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = collect(run)
    performance = [plot_performance(cases, out_dir / "performance_ms.png")] if cases else []
    return performance + plot_series(run, out_dir) + plot_scalars(run, out_dir) + plot_time_breakdown(run, out_dir)

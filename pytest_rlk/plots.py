"""PNG charts of a run, grouped by what they show, each with a caption (matplotlib's Agg canvas
directly: no global backend switch). No chart is wider than ``MAX_WIDTH_PX``; long lists of cases
are split over several charts of at most ``ROWS_PER_CHART`` rows.

- errors vs tolerance: one chart per error metric, a horizontal bar per case on a log scale,
  each case's tolerance (its band's ``abs_floor``) drawn as a red tick (a line when all share it);
- A/B arms: metrics of several arms (tag ``arm``, named ``<arm>_<name>`` or ``<arm>.<name>``) on
  one chart per name: series over steps with the warmup (the window's ``skip``) shaded, scalars
  as grouped bars;
- time breakdown: per case and arm, the parts of a step (time metrics tagged ``module``) stacked,
  the whole step (module ``step``/``total``) a black mark beside them, never stacked on its parts;
- other series and scalars, memory, and the benchmark times (log scale).
"""
from __future__ import annotations

import math
import os
import re
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pytest_rlk.bands import metric_kind
from pytest_rlk.compare import scalar_value, window_for
from pytest_rlk.performance import PerfCase, collect, is_ours
from pytest_rlk.schema import MetricRecord, RunRecord

DPI = 100
MAX_WIDTH_PX = 2000
WIDTH_IN = 10.0
ROWS_PER_CHART = 40
ROW_IN = 0.24
WHOLE_MODULES = ("step", "total")  # a module time that is the sum of the others: never stacked on them
ARM_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
LABEL_CHARS = 56

# sections in the order the report shows them
ERRORS = "Errors vs tolerance"
ARMS = "A/B arms"
TIME = "Time breakdown"
SERIES = "Series over steps"
SCALARS = "Other values"
MEMORY = "Memory"
PERFORMANCE = "Benchmark times"
SECTIONS = (PERFORMANCE, ERRORS, ARMS, TIME, SERIES, SCALARS, MEMORY)


@dataclass(frozen=True)
class Chart:
    path: Path
    section: str
    caption: str


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:120] or "plot"


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    width, height = fig.get_size_inches()
    if width * DPI > MAX_WIDTH_PX:
        fig.set_size_inches(MAX_WIDTH_PX / DPI, height)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _unit(metric: MetricRecord) -> str:
    return f" [{metric.unit}]" if metric.unit else ""


def _short(label: str, limit: int = LABEL_CHARS) -> str:
    return label if len(label) <= limit else label[: limit // 2 - 1] + "…" + label[-(limit // 2 - 1):]


def _strip_common(labels: Sequence[str]) -> tuple[str, list[str]]:
    """(the common prefix, cut at a separator, and the labels without it) when that saves room."""
    if len(labels) < 2:
        return "", list(labels)
    prefix = os.path.commonprefix(list(labels))
    cut = max(prefix.rfind(c) for c in ".-_/=, ") + 1
    prefix = prefix[:cut]
    if len(prefix) < 8:
        return "", list(labels)
    return prefix, [label[len(prefix):] or "(the prefix)" for label in labels]


def _chunks(rows: list, size: int = ROWS_PER_CHART) -> list[list]:
    return [rows[i:i + size] for i in range(0, len(rows), size)] or [[]]


def _part(name: str, i: int, n: int) -> str:
    return name if n == 1 else f"{name} ({i + 1}/{n})"


def _is_error(metric: MetricRecord) -> bool:
    return metric_kind(metric.name, metric.space) == "error"


def _arm_split(metric: MetricRecord) -> tuple[str, str] | None:
    """(the name without its arm, the arm's label) for a metric tagged ``arm``: names are
    ``<role>.<name>`` (the role's label may differ: ``baseline.raw_reward`` of arm ``trl``) or
    ``<arm>_<name>``."""
    arm = metric.tags.get("arm")
    if arm is None:
        return None
    if "." in metric.name:
        return metric.name.split(".", 1)[1], arm
    if metric.name.startswith(f"{arm}_"):
        return metric.name[len(arm) + 1:], arm
    return metric.name, arm


# -- errors vs tolerance ---------------------------------------------------------------------

def _error_chart(name: str, rows: list[tuple[str, float, float | None]], unit: str, path: Path,
                 caption_of_part: str) -> Path:
    prefix, labels = _strip_common([label for label, _, _ in rows])
    positive = [v for _, v, _ in rows if v > 0] + [t for _, _, t in rows if t]
    floor = min(positive) / 10 if positive else 1e-12
    fig = Figure(figsize=(WIDTH_IN, 1.4 + ROW_IN * len(rows)))
    ax = fig.add_subplot()
    ys = list(range(len(rows)))[::-1]
    values = [max(v, floor) for _, v, _ in rows]
    colors = ["#c44e52" if tol is not None and v > tol else "#bbbbbb" if v == 0 else "#4c72b0"
              for _, v, tol in rows]
    ax.barh(ys, values, color=colors, left=floor * 0.5)
    ax.set_xscale("log")
    tols = [t for _, _, t in rows]
    if tols and all(t is not None and t == tols[0] for t in tols):
        ax.axvline(tols[0], color="#c44e52", linestyle="--", linewidth=1.2, label=f"tolerance {tols[0]:.3g}")
        ax.legend(fontsize="small", loc="lower right")
    else:
        for y, tol in zip(ys, tols):
            if tol is not None:
                ax.plot([tol, tol], [y - 0.42, y + 0.42], color="#c44e52", linewidth=2)
    right = max([v for _, v, _ in rows] + [t for t in tols if t is not None] + [floor * 10])
    ax.set_xlim(floor * 0.4, right * 2)
    for y, (_, v, _) in zip(ys, rows):
        if v == 0:
            ax.text(floor * 0.6, y, " 0 (exact)", va="center", fontsize="x-small", color="#555555")
    ax.set_yticks(ys, [_short(label) for label in labels], fontsize="x-small")
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(f"{name}{unit} (log scale)")
    title = f"{name}: {caption_of_part}"
    if prefix:
        title += f"\ncases: {_short(prefix, 90)}…"
    ax.set_title(title, fontsize="medium")
    return _save(fig, path)


def plot_errors(run: RunRecord, out_dir: Path) -> list[Chart]:
    """One chart per error metric: the max error of each case against its tolerance."""
    by_name: dict[str, list[tuple[str, MetricRecord]]] = defaultdict(list)
    for test in run.tests:
        for m in test.metrics:
            if _is_error(m) and not m.is_series:
                by_name[m.name].append((_case_label(test.case, m), m))
    charts = []
    for name, entries in sorted(by_name.items()):
        rows = sorted((label, float(m.value), m.band.abs_floor if m.band and m.band.abs_floor > 0 else None)
                      for label, m in entries)
        parts = _chunks(rows)
        over = sum(1 for _, v, t in rows if t is not None and v > t)
        for i, part in enumerate(parts):
            path = out_dir / f"errors_{_slug(name)}{'' if len(parts) == 1 else f'_{i + 1}'}.png"
            what = f"{len(part)} cases" if len(parts) == 1 else f"cases {i * ROWS_PER_CHART + 1}-{i * ROWS_PER_CHART + len(part)} of {len(rows)}"
            _error_chart(name, part, _unit(entries[0][1]), path, what)
            caption = f"{_part(name, i, len(parts))}: max error per case, log scale; grey bar: exactly 0; "
            if any(t is not None for _, _, t in part):
                sources = sorted({m.band.source for _, m in entries if m.band and m.band.abs_floor > 0 and m.band.source})
                caption += ("red tick: the case's tolerance (" + "; ".join(sources[:3])
                            + (f"; {len(sources) - 3} more sources" if len(sources) > 3 else "") + "); ")
                caption += f"{over} case(s) above it (red bars)" if over else "every case within it"
            else:
                caption += "no tolerance was recorded with these values (their test asserts its own)"
            charts.append(Chart(path, ERRORS, caption))
    return charts


def _case_label(case: str, metric: MetricRecord) -> str:
    """The case, plus the tags that tell one metric of a case from another (not the arm)."""
    extra = [f"{k}={v}" for k, v in sorted(metric.tags.items())
             if k in ("backend", "dtype", "op") and k not in case and v not in case]
    return case + (f" [{', '.join(extra)}]" if extra else "")


# -- A/B arms ------------------------------------------------------------------------------

def _shade_warmup(ax, skip: int) -> None:
    if skip:
        ax.axvspan(-0.5, skip - 0.5, color="grey", alpha=0.2, label="warmup (not gated)")


def plot_arms_over_steps(lines: Sequence[tuple[str, str, Sequence[float]]], *, skip: int, title: str,
                         ylabel: str, path: Path) -> Path:
    """Series of several arms on one chart: ``lines`` = (case, arm, values); one colour per arm,
    one line style per case; the first ``skip`` steps shaded as warmup."""
    arms = list(dict.fromkeys(arm for _, arm, _ in lines))
    cases = list(dict.fromkeys(case for case, _, _ in lines))
    prefix, short_cases = _strip_common(cases)
    shown = dict(zip(cases, short_cases))
    styles = ("-", "--", ":", "-.")
    fig = Figure(figsize=(WIDTH_IN * 0.8, 4.2))
    ax = fig.add_subplot()
    for case, arm, values in lines:
        label = arm if len(cases) == 1 else f"{_short(shown[case], 40)} / {arm}"
        k = arms.index(arm)  # later arms thinner, so an arm equal to the first shows inside it
        ax.plot(range(len(values)), values, marker="ox+."[k % 4], color=ARM_COLORS[k % len(ARM_COLORS)],
                linewidth=max(1.0, 3.5 - 1.5 * k), alpha=0.9 if k else 0.6,
                linestyle=styles[cases.index(case) % len(styles)], label=label)
    _shade_warmup(ax, skip)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    subtitle = cases[0] if len(cases) == 1 else f"cases: {prefix}…" if prefix else ""
    ax.set_title(f"{title}\n{_short(subtitle, 90)}" if subtitle else title, fontsize="medium")
    ax.legend(fontsize="x-small")
    return _save(fig, path)


def _grouped_bars(title: str, xlabel: str, rows: list[str], groups: list[str],
                  values: dict[tuple[str, str], float], path: Path) -> Path:
    """Horizontal bars: one row per ``rows`` entry, one bar per group (arm) in it."""
    prefix, labels = _strip_common(rows)
    fig = Figure(figsize=(WIDTH_IN * 0.8, 1.4 + ROW_IN * max(1, len(rows)) * max(1, len(groups)) * 0.8))
    ax = fig.add_subplot()
    height = 0.8 / max(1, len(groups))
    for g, group in enumerate(groups):
        ys = [len(rows) - 1 - r + (len(groups) / 2 - g - 0.5) * height for r in range(len(rows))]
        xs = [values.get((row, group), math.nan) for row in rows]
        ax.barh(ys, xs, height=height, color=ARM_COLORS[g % len(ARM_COLORS)], label=group)
    positive = [v for v in values.values() if v > 0]
    if positive and min(positive) > 0 and max(positive) / min(positive) > 100 and all(v >= 0 for v in values.values()):
        ax.set_xscale("log")
        xlabel += " (log scale)"
    ax.set_yticks(list(range(len(rows)))[::-1], [_short(label) for label in labels], fontsize="x-small")
    ax.set_xlabel(xlabel)
    ax.set_title(title + (f"\ncases: {_short(prefix, 90)}…" if prefix else ""), fontsize="medium")
    if len(groups) > 1:
        ax.legend(fontsize="x-small")
    return _save(fig, path)


def plot_arms(run: RunRecord, out_dir: Path) -> list[Chart]:
    """Metrics of several arms (tag ``arm``), overlaid per name; module times are the breakdown's."""
    series: dict[str, list[tuple[str, str, MetricRecord]]] = defaultdict(list)
    scalars: dict[str, list[tuple[str, str, MetricRecord]]] = defaultdict(list)
    for test in run.tests:
        for m in test.metrics:
            split = _arm_split(m)
            if split is None or _is_error(m) or "module" in m.tags and m.tags["module"] not in WHOLE_MODULES:
                continue
            name, arm = split
            (series if m.is_series else scalars)[name].append((test.case, arm, m))
    charts = []
    for name, entries in sorted(series.items()):
        if len({arm for _, arm, _ in entries}) < 2:
            continue
        first = entries[0][2]
        window = window_for(first)
        skip = window.skip if window is not None else 0
        path = plot_arms_over_steps([(case, arm, m.value) for case, arm, m in entries], skip=skip,
                                    title=name, ylabel=f"{name}{_unit(first)}", path=out_dir / f"arms_{_slug(name)}.png")
        agg = f"; gated on the {window.agg} after {skip} warmup steps" if window is not None else ""
        charts.append(Chart(path, ARMS, f"{name} over steps, arms overlaid (colour: arm; line style: case)"
                                        f"{'; shaded: warmup' if skip else ''}{agg}"))
    by_case: dict[str, list[tuple[str, str, MetricRecord]]] = defaultdict(list)
    for name, entries in sorted(scalars.items()):
        if len({arm for _, arm, _ in entries}) > 1:
            for case, arm, m in entries:
                by_case[case].append((name, arm, m))
    for case, entries in sorted(by_case.items()):
        arms = list(dict.fromkeys(arm for _, arm, _ in entries))
        names = list(dict.fromkeys(name for name, _, _ in entries))
        values = {(name, arm): float(m.value) for name, arm, m in entries}
        path = out_dir / f"arms_{_slug(case)}.png"
        if len(arms) == 2:
            _relative_difference(case, names, arms, values, path)
            caption = (f"{case}: each value of arm {arms[1]} relative to arm {arms[0]}, (B - A) / |A|; "
                       "both values written beside each bar")
        else:
            _grouped_bars(f"A/B values: {_short(case, 90)}", "value", names, arms, values, path)
            caption = f"the scalar values each arm recorded in {case}, one bar per arm"
        charts.append(Chart(path, ARMS, caption))
    return charts


def _relative_difference(case: str, names: list[str], arms: list[str],
                         values: dict[tuple[str, str], float], path: Path) -> Path:
    """Two arms' scalars of different magnitudes on one axis: B relative to A per name."""
    a, b = arms
    rel = []
    for name in names:
        va, vb = values.get((name, a), math.nan), values.get((name, b), math.nan)
        rel.append(0.0 if va == vb else (vb - va) / abs(va) if va else math.copysign(math.inf, vb - va))
    shown = [r if math.isfinite(r) else 0.0 for r in rel]
    fig = Figure(figsize=(WIDTH_IN * 0.8, 1.4 + 0.32 * len(names)))
    ax = fig.add_subplot()
    ys = list(range(len(names)))[::-1]
    ax.barh(ys, shown, color=["#c44e52" if r > 0 else "#4c72b0" for r in shown], height=0.6)
    ax.axvline(0.0, color="black", linewidth=0.8)
    for y, name, r in zip(ys, names, rel):
        note = "equal" if r == 0 else "A is 0" if not math.isfinite(r) else f"{r:+.3g}"
        ax.text(0, y, f"  {note}: A {values.get((name, a), math.nan):.4g}, B {values.get((name, b), math.nan):.4g}",
                va="center", fontsize="x-small")
    ax.set_yticks(ys, [_short(n) for n in names], fontsize="x-small")
    limit = max([abs(x) for x in shown] + [0.01]) * 1.3
    ax.set_xlim(-limit, limit)
    ax.set_xlabel(f"(B - A) / |A|   A: {a}, B: {b}")
    ax.set_title(f"A/B values: {_short(case, 90)}", fontsize="medium")
    return _save(fig, path)


# -- time breakdown ----------------------------------------------------------------------------

@dataclass
class TimeBreakdown:
    """Per (case, arm): each part's time, and the whole step's where measured (never a part)."""

    parts: dict[tuple[str, str], dict[str, float]]
    whole: dict[tuple[str, str], float]
    units: set[str]


def time_breakdown(run: RunRecord) -> TimeBreakdown:
    """Time metrics tagged ``module`` (gated values: the window's aggregate), per case and arm."""
    found = TimeBreakdown(defaultdict(dict), {}, set())
    for test in run.tests:
        for m in test.metrics:
            if m.space != "time" or "module" not in m.tags:
                continue
            found.units.add(m.unit)
            key = (test.case, m.tags.get("arm", ""))
            if m.tags["module"] in WHOLE_MODULES:
                found.whole[key] = scalar_value(m)
            else:
                found.parts[key][m.tags["module"]] = scalar_value(m)
    return found


def plot_time_breakdown(run: RunRecord, out_dir: Path) -> list[Chart]:
    """Per case and arm: the parts of a step stacked; the whole step a black mark, not a part."""
    found = time_breakdown(run)
    parts, whole, units = found.parts, found.whole, found.units
    if not parts:
        return []
    keys = sorted(parts)
    modules = sorted({mod for p in parts.values() for mod in p})
    labels = [f"{case} / {arm}" if arm else case for case, arm in keys]
    prefix, labels = _strip_common(labels)
    unit = units.pop() if len(units) == 1 else ""
    fig = Figure(figsize=(WIDTH_IN, 1.8 + 0.42 * len(keys)))
    ax = fig.add_subplot()
    ys = list(range(len(keys)))[::-1]
    left = [0.0] * len(keys)
    for i, mod in enumerate(modules):
        widths = [parts[k].get(mod, 0.0) for k in keys]
        ax.barh(ys, widths, left=left, height=0.6, label=mod, color=f"C{i}")
        left = [a + b for a, b in zip(left, widths)]
    marked = [(y, whole[k]) for y, k in zip(ys, keys) if k in whole]
    if marked:
        ax.scatter([w for _, w in marked], [y for y, _ in marked], marker="|", s=500, color="black", zorder=3,
                   label="whole step (measured)")
    ax.set_yticks(ys, [_short(label) for label in labels], fontsize="small")
    ax.set_xlabel(f"median time per step after warmup{f' [{unit}]' if unit else ''}")
    ax.set_title("time per step by part" + (f"\ncases: {_short(prefix, 90)}…" if prefix else ""), fontsize="medium")
    ax.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    path = _save(fig, out_dir / "time_breakdown.png")
    caption = ("time of each part of a step per case and arm (stacked, median after warmup); the black mark is "
               "the whole step as measured (the gap to it is time outside the named parts)")
    return [Chart(path, TIME, caption)]


# -- everything else ---------------------------------------------------------------------------

def plot_series(run: RunRecord, out_dir: Path) -> list[Chart]:
    """Series without arms (arms are overlaid by plot_arms), one line per case."""
    by_name: dict[str, list[tuple[str, MetricRecord]]] = defaultdict(list)
    for test in run.tests:
        for m in test.metrics:
            if m.is_series and "arm" not in m.tags and "module" not in m.tags:
                by_name[m.name].append((test.case, m))
    charts = []
    for name, entries in sorted(by_name.items()):
        window = window_for(entries[0][1])
        skip = window.skip if window is not None else 0
        path = plot_arms_over_steps([(case, "value", m.value) for case, m in entries], skip=skip, title=name,
                                    ylabel=f"{name}{_unit(entries[0][1])}", path=out_dir / f"series_{_slug(name)}.png")
        charts.append(Chart(path, SERIES, f"{name} over steps, one line per case" + ("; shaded: warmup" if skip else "")))
    return charts


def plot_scalars(run: RunRecord, out_dir: Path) -> list[Chart]:
    """Scalars that are neither errors nor arms nor benchmark timings, one chart per name."""
    perf_names = {f"{t.impl}_{s}" for c in collect(run) for t in c.timings.values()
                  for s in ("ms", "graph_ms", "fraction_of_hbm_limit", "peak_extra_bytes")}
    by_name: dict[str, list[tuple[str, MetricRecord]]] = defaultdict(list)
    for test in run.tests:
        for m in test.metrics:
            if not m.is_series and not _is_error(m) and "arm" not in m.tags and "module" not in m.tags \
                    and m.name not in perf_names and "impl" not in m.tags:
                by_name[m.name].append((test.case, m))
    charts = []
    for name, entries in sorted(by_name.items()):
        memory = entries[0][1].space == "memory"
        rows = [case for case, _ in entries]
        values = {(case, name): float(m.value) for case, m in entries}
        for i, part in enumerate(_chunks(rows)):
            suffix = "" if len(rows) <= ROWS_PER_CHART else f"_{i + 1}"
            path = _grouped_bars(_part(name, i, len(_chunks(rows))), f"{name}{_unit(entries[0][1])}", part, [name],
                                 values, out_dir / f"{'memory' if memory else 'scalar'}_{_slug(name)}{suffix}.png")
            charts.append(Chart(path, MEMORY if memory else SCALARS, f"{name} per case ({entries[0][1].space})"))
    return charts


def plot_performance(cases: list[PerfCase], path: Path) -> Path:
    """Grouped horizontal bars: ms per impl (ours and peers) per benchmark case, log scale (peers
    can be 10x apart)."""
    impls = sorted({name for c in cases for name in c.timings}, key=lambda name: (not is_ours(name), name))
    values = {(c.label, impl): c.timings[impl].ms for c in cases for impl in c.timings}
    return _grouped_bars("benchmark time per implementation", "median time [ms]", [c.label for c in cases],
                         impls, values, path)


def plot_run(run: RunRecord, out_dir: Path) -> list[Chart]:
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.png"):  # a report directory holds this run's charts only
        old.unlink()
    cases = collect(run)
    charts = [Chart(plot_performance(cases, out_dir / "performance_ms.png"), PERFORMANCE,
                    "median time per implementation and case, log scale (ours first)")] if cases else []
    charts += plot_errors(run, out_dir) + plot_arms(run, out_dir) + plot_time_breakdown(run, out_dir)
    charts += plot_series(run, out_dir) + plot_scalars(run, out_dir)
    return sorted(charts, key=lambda c: SECTIONS.index(c.section))


def wrap(text: str, width: int = 100) -> str:
    return "\n".join(textwrap.wrap(text, width))

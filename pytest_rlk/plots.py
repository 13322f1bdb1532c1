"""PNG charts of a run, grouped by what they show, each with a caption (matplotlib's Agg canvas
directly: no global backend switch). Where each metric goes is :mod:`pytest_rlk.report_data`'s
call; no chart is wider than ``MAX_WIDTH_PX``, and a run draws at most ``MAX_CHARTS`` (the rest
are named in the report, their values in ``metrics.csv``).

- margins: one chart per tier, error / tolerance per case on a log scale, sorted, the worst
  ``MARGIN_ROWS`` named (the rest counted);
- A/B arms: series of several arms overlaid per name, the warmup (the window's ``skip``) shaded,
  the legend beside the axes with the cases' full names;
- time breakdown: per case and arm, the parts of a step (time metrics tagged ``module``) stacked,
  the whole step (module ``step``/``total``) a black mark beside them, never stacked on its parts;
- curves: one line per arm through points gathered over the run's tests (memory and tokens/s
  against the tokens of a micro-batch), one chart per curve and y axis;
- other series, and the benchmark times (log scale).

A chart whose values are all 0 is not drawn: the report says so in a line.
Tests marked ``injected_fault`` are in none of them (the report lists them apart).
"""
from __future__ import annotations

import io
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter
from PIL import Image

from pytest_rlk.compare import scalar_value, window_for
from pytest_rlk.performance import PerfCase, collect, is_ours
from pytest_rlk.report_data import WHOLE_MODULES, Margin, ReportData, all_zero, report_data
from pytest_rlk.schema import MetricRecord, RunRecord

DPI = 90
MAX_WIDTH_PX = 2000
MAX_CHARTS = 24
AXES_IN = 6.5  # the width of a chart's axes; the labels and the legend get room beside them
ROWS_PER_CHART = 40
MARGIN_ROWS = 25
ROW_IN = 0.24
ARM_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


def arm_color(k: int) -> str:
    """The k-th arm's colour: ours, then matplotlib's cycle (distinct beyond four arms)."""
    return ARM_COLORS[k] if k < len(ARM_COLORS) else f"C{k}"
LABEL_CHARS = 56
TICK_CHARS = 80  # a y tick label: its room beside the axes is made to fit (_layout)
LEGEND_CHARS = 44
CHAR_IN = {"x-small": 0.056, "small": 0.068}  # the width of an average character of the tick fonts at DPI

# sections in the order the report shows them
MARGINS = "Errors against tolerance"
ARMS = "A/B arms"
TIME = "Time breakdown"
SERIES = "Series over steps"
PERFORMANCE = "Benchmark times"
CURVES = "Curves by arm"
SECTIONS = (MARGINS, PERFORMANCE, CURVES, ARMS, TIME, SERIES)


@dataclass(frozen=True)
class Chart:
    """A drawn chart (``path``), or a line saying why there is none (``path`` None)."""

    path: Path | None
    section: str
    caption: str


@dataclass(frozen=True)
class _Planned:
    section: str
    path: Path
    caption: str
    draw: Callable[[Path], object]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:120] or "plot"


def _layout(fig: Figure, ax, *, label_chars: int = 0, legend_chars: int = 0, label_size: str = "x-small") -> None:
    """Room for the y tick labels, the title and a legend beside the axes, worked out from their
    lengths: no layout pass (matplotlib's tight layouts draw the figure once more to measure it)."""
    per_char = CHAR_IN[label_size]
    width, height = fig.get_size_inches()
    left = 0.45 + per_char * label_chars
    right = 0.2 + (CHAR_IN["x-small"] * legend_chars + 0.6 if legend_chars else 0.0)
    title_lines = ax.get_title().count("\n") + 1 if ax.get_title() else 0
    top, bottom = 0.15 + 0.22 * title_lines, 0.6
    fig.set_size_inches(min(width + left + right, MAX_WIDTH_PX / DPI), height + top + bottom)
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height)


def _legend_chars(ax) -> int:
    handles, labels = ax.get_legend_handles_labels()
    return max((len(line) for label in labels for line in label.split("\n")), default=0)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    buffer.seek(0)
    # a palette of 256 colours: a third of the bytes of full colour, for a page with every chart inlined
    Image.open(buffer).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE).save(path, format="PNG")
    return path


def _unit(metric: MetricRecord) -> str:
    return f" [{metric.unit}]" if metric.unit else ""


def _short(label: str, limit: int = LABEL_CHARS) -> str:
    return label if len(label) <= limit else label[: limit // 2 - 1] + "…" + label[-(limit // 2 - 1):]


def _wrapped(label: str, width: int = LEGEND_CHARS) -> str:
    """The whole label over several lines (a legend entry: nothing cut), broken after separators."""
    pieces = re.findall(r"[^_\-./ =,]*[_\-./ =,]?", label)
    lines, line = [], ""
    for piece in (p for p in pieces if p):
        while len(piece) > width:  # a piece longer than a line: cut it (never a name's end lost)
            lines, line, piece = lines + ([line] if line else []) + [piece[:width]], "", piece[width:]
        if len(line) + len(piece) > width and line:
            lines.append(line)
            line = ""
        line += piece
    return "\n".join(lines + ([line] if line else [])) or label


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


# -- margins: error / tolerance ----------------------------------------------------------------

def plot_margin(tier: str, rows: list[Margin], path: Path) -> Path:
    """The worst ``MARGIN_ROWS`` of ``rows`` (worst first) as bars of error / tolerance, log scale,
    the tolerance a line at 1; exact zeros are counted in the title, not drawn."""
    nonzero = [r for r in rows if r.value > 0]
    shown = nonzero[:MARGIN_ROWS]
    labels = [f"{r.case} · {r.metric}" for r in shown]
    prefix, labels = _strip_common(labels)
    fig = Figure(figsize=(AXES_IN, 0.4 + ROW_IN * max(1, len(shown))))
    ax = fig.add_subplot()
    ys = list(range(len(shown)))[::-1]
    ratios = [r.ratio for r in shown]
    low = min(ratios + [1.0]) / 3
    ax.barh(ys, [x - low for x in ratios], left=low, height=0.7,
            color=["#c44e52" if x > 1 else "#4c72b0" for x in ratios])
    ax.axvline(1.0, color="#c44e52", linestyle="--", linewidth=1.2, label="tolerance (error = tolerance)")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # labelled decades only: minor labels cost seconds to lay out
    ax.set_xlim(low, max(ratios + [1.0]) * 3)
    ax.set_yticks(ys, [_short(label, 70) for label in labels], fontsize="x-small")
    ax.set_ylim(-0.6, max(1, len(shown)) - 0.4)
    ax.set_xlabel("error / tolerance (log scale; right of the dashed line: over tolerance)")
    zeros = len(rows) - len(nonzero)
    title = f"tier {tier}: the {len(shown)} largest of {len(rows)} errors against their tolerance"
    if zeros:
        title += f" ({zeros} exactly 0)"
    if prefix:
        title += f"\ncases: {_short(prefix, 90)}…"
    ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="x-small", loc="lower right")
    _layout(fig, ax, label_chars=max((len(_short(label, 70)) for label in labels), default=0))
    return _save(fig, path)


def _plan_margins(data: ReportData, out_dir: Path) -> tuple[list[_Planned], list[Chart]]:
    planned, notes = [], []
    for tier, rows in data.margins.items():
        over = [r for r in rows if r.ratio > 1]
        if all(r.value == 0 for r in rows):
            notes.append(Chart(None, MARGINS, f"tier {tier}: all {len(rows)} errors with a tolerance are exactly 0 "
                                              "(no chart)"))
            continue
        worst = rows[0]
        caption = (f"tier {tier}: each case's error divided by its tolerance, worst first; worst: {worst.case} "
                   f"{worst.metric} at {worst.ratio:.3g} of its tolerance; "
                   + (f"{len(over)} over tolerance (red)" if over else "every case within tolerance"))
        planned.append(_Planned(MARGINS, out_dir / f"margins_{_slug(tier)}.png", caption,
                                lambda p, tier=tier, rows=rows: plot_margin(tier, rows, p)))
    return planned, notes


# -- A/B arms ------------------------------------------------------------------------------

def _shade_warmup(ax, skip: int) -> None:
    if skip:
        ax.axvspan(-0.5, skip - 0.5, color="grey", alpha=0.2, label="warmup (not gated)")


def plot_arms_over_steps(lines: Sequence[tuple[str, str, Sequence[float]]], *, skip: int, title: str,
                         ylabel: str, path: Path) -> Path:
    """Series of several arms on one chart: ``lines`` = (case, arm, values); one colour per arm,
    one line style per case; the first ``skip`` steps shaded as warmup; the legend beside the
    axes, each entry whole (wrapped, never cut)."""
    arms = list(dict.fromkeys(arm for _, arm, _ in lines))
    cases = list(dict.fromkeys(case for case, _, _ in lines))
    prefix, short_cases = _strip_common(cases)
    shown = dict(zip(cases, short_cases))
    styles = ("-", "--", ":", "-.")
    fig = Figure(figsize=(AXES_IN, 3.2 + 0.12 * max(0, len(lines) - 8)))
    ax = fig.add_subplot()
    for case, arm, values in lines:
        label = arm if len(cases) == 1 else _wrapped(f"{shown[case]} / {arm}")
        k = arms.index(arm)  # later arms thinner, so an arm equal to the first shows inside it
        ax.plot(range(len(values)), values, marker="ox+."[k % 4], color=arm_color(k),
                linewidth=max(1.0, 3.5 - 1.5 * k), alpha=0.9 if k else 0.6,
                linestyle=styles[cases.index(case) % len(styles)], label=label)
    _shade_warmup(ax, skip)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if max((len(v) for _, _, v in lines), default=0) <= 12:
        ax.set_xticks(range(max(len(v) for _, _, v in lines)))
    subtitle = cases[0] if len(cases) == 1 else f"cases: {prefix}…" if prefix else ""
    ax.set_title(f"{title}\n{_short(subtitle, 90)}" if subtitle else title, fontsize="medium")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    _layout(fig, ax, label_chars=8, legend_chars=_legend_chars(ax))
    return _save(fig, path)


def _grouped_bars(title: str, xlabel: str, rows: list[str], groups: list[str],
                  values: dict[tuple[str, str], float], path: Path) -> Path:
    """Horizontal bars: one row per ``rows`` entry, one bar per group in it."""
    prefix, labels = _strip_common(rows)
    fig = Figure(figsize=(AXES_IN, 0.4 + ROW_IN * max(1, len(rows)) * max(1, len(groups)) * 0.8))
    ax = fig.add_subplot()
    height = 0.8 / max(1, len(groups))
    for g, group in enumerate(groups):
        ys = [len(rows) - 1 - r + (len(groups) / 2 - g - 0.5) * height for r in range(len(rows))]
        xs = [values.get((row, group), math.nan) for row in rows]
        ax.barh(ys, xs, height=height, color=arm_color(g), label=group)
    positive = [v for v in values.values() if v > 0]
    if positive and max(positive) / min(positive) > 100 and all(v >= 0 for v in values.values()):
        ax.set_xscale("log")
        xlabel += " (log scale)"
    ax.set_yticks(list(range(len(rows)))[::-1], [_short(label, TICK_CHARS) for label in labels], fontsize="x-small")
    ax.set_xlabel(xlabel)
    ax.set_title(title + (f"\ncases: {_short(prefix, 90)}…" if prefix else ""), fontsize="medium")
    if len(groups) > 1:
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    _layout(fig, ax, label_chars=max((len(_short(label, TICK_CHARS)) for label in labels), default=0),
            legend_chars=_legend_chars(ax) if len(groups) > 1 else 0)
    return _save(fig, path)


def _plan_series(section: str, name: str, entries: list[tuple[str, str, MetricRecord]], out_dir: Path,
                 caption: str) -> _Planned | Chart:
    if all_zero(v for _, _, m in entries for v in m.value):
        return Chart(None, section, f"{name}: every value of every case is 0 (no chart)")
    first = entries[0][2]
    window = window_for(first)
    skip = window.skip if window is not None else 0
    agg = f"; gated on the {window.agg} after {skip} warmup steps" if window is not None and first.gate else ""
    prefix = "arms" if section == ARMS else "series"
    return _Planned(section, out_dir / f"{prefix}_{_slug(name)}.png",
                    caption + ("; shaded: warmup" if skip else "") + agg,
                    lambda p: plot_arms_over_steps([(case, arm, m.value) for case, arm, m in entries], skip=skip,
                                                   title=name, ylabel=f"{name}{_unit(first)}", path=p))


def _plan_arms(data: ReportData, out_dir: Path) -> list[_Planned | Chart]:
    return [_plan_series(ARMS, name, entries, out_dir,
                         f"{name} over steps, arms overlaid (colour: arm; line style: case)")
            for name, entries in data.arm_series.items()]


# -- time breakdown ----------------------------------------------------------------------------

@dataclass
class TimeBreakdown:
    """Per (case, arm): each part's time, and the whole step's where measured (never a part)."""

    parts: dict[tuple[str, str], dict[str, float]]
    whole: dict[tuple[str, str], float]
    units: set[str]


def time_breakdown(run: RunRecord) -> TimeBreakdown:
    """Time metrics tagged ``module`` (gated values: the window's aggregate), per case and arm;
    tests marked ``injected_fault`` are left out."""
    found = TimeBreakdown(defaultdict(dict), {}, set())
    for test in run.tests:
        if test.injected_fault:
            continue
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


def plot_time_breakdown(found: TimeBreakdown, path: Path) -> Path:
    """Per case and arm: the parts of a step stacked; the whole step a black mark, not a part."""
    parts, whole, units = found.parts, found.whole, set(found.units)
    keys = sorted(parts)
    modules = sorted({mod for p in parts.values() for mod in p})
    labels = [f"{case} / {arm}" if arm else case for case, arm in keys]
    prefix, labels = _strip_common(labels)
    unit = units.pop() if len(units) == 1 else ""
    fig = Figure(figsize=(AXES_IN, 0.6 + 0.42 * len(keys)))
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
    ax.set_yticks(ys, [_short(label, TICK_CHARS) for label in labels], fontsize="small")
    ax.set_xlabel(f"median time per step after warmup{f' [{unit}]' if unit else ''}")
    ax.set_title("time per step by part" + (f"\ncases: {_short(prefix, 90)}…" if prefix else ""), fontsize="medium")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    _layout(fig, ax, label_chars=max((len(_short(label, TICK_CHARS)) for label in labels), default=0), label_size="small",
            legend_chars=_legend_chars(ax))
    return _save(fig, path)


def _plan_time_breakdown(run: RunRecord, out_dir: Path) -> list[_Planned | Chart]:
    found = time_breakdown(run)
    if not found.parts:
        return []
    if all_zero(v for p in found.parts.values() for v in p.values()):
        return [Chart(None, TIME, "time breakdown: every part's time is 0 (no chart)")]
    caption = ("time of each part of a step per case and arm (stacked, median after warmup); the black mark is "
               "the whole step as measured (the gap to it is time outside the named parts)")
    return [_Planned(TIME, out_dir / "time_breakdown.png", caption, lambda p: plot_time_breakdown(found, p))]


# -- curves ----------------------------------------------------------------------------------

def plot_curves(title: str, xlabel: str, ylabel: str, lines: dict[str, list[tuple[float, float]]], path: Path) -> Path:
    """One line per arm through its (x, y) points; both axes log scale where the x values span
    more than 8x (sizes found by doubling)."""
    fig = Figure(figsize=(AXES_IN, 3.4))
    ax = fig.add_subplot()
    for k, (arm, points) in enumerate(lines.items()):
        ax.plot([x for x, _ in points], [y for _, y in points], marker="ox+.sd"[k % 6], label=_wrapped(arm),
                color=arm_color(k))
    xs = [x for points in lines.values() for x, _ in points if x > 0]
    if xs and max(xs) / min(xs) > 8:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(_short(ylabel, 48), fontsize="small")
    ax.set_title(_short(title, 90), fontsize="medium")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    _layout(fig, ax, label_chars=8, legend_chars=_legend_chars(ax))
    return _save(fig, path)


def _plan_curves(data: ReportData, out_dir: Path) -> list[_Planned]:
    return [_Planned(CURVES, out_dir / f"curve_{_slug(curve)}_{_slug(y)[:40]}.png",
                     f"{curve}: {y} against {x}, one line per arm",
                     lambda p, curve=curve, x=x, y=y, lines=lines: plot_curves(curve, x, y, lines, p))
            for (curve, x, y), lines in data.curves.items()]


# -- everything else ---------------------------------------------------------------------------

def _plan_plain_series(data: ReportData, out_dir: Path) -> list[_Planned | Chart]:
    """Series without several arms, one line per case."""
    return [_plan_series(SERIES, name, [(case, "value", m) for case, m in entries], out_dir,
                         f"{name} over steps, one line per case")
            for name, entries in data.series.items()]


def plot_performance(cases: list[PerfCase], path: Path) -> Path:
    """Grouped horizontal bars: ms per impl (ours and peers) per benchmark case, log scale (peers
    can be 10x apart)."""
    impls = sorted({name for c in cases for name in c.timings}, key=lambda name: (not is_ours(name), name))
    values = {(c.label, impl): c.timings[impl].ms for c in cases for impl in c.timings}
    return _grouped_bars("benchmark time per implementation", "median time [ms]", [c.label for c in cases],
                         impls, values, path)


def _plan_performance(run: RunRecord, out_dir: Path) -> list[_Planned]:
    cases = collect(run)
    parts = _chunks(cases, ROWS_PER_CHART // 2)
    return [_Planned(PERFORMANCE, out_dir / f"performance_ms{'' if len(parts) == 1 else f'_{i + 1}'}.png",
                     _part("median time per implementation and case, log scale (ours first)", i, len(parts)),
                     lambda p, part=part: plot_performance(part, p))
            for i, part in enumerate(parts) if part]


def plot_run(run: RunRecord, out_dir: Path, *, data: ReportData | None = None,
             max_charts: int = MAX_CHARTS) -> list[Chart]:
    """Every chart of the run in section order, at most ``max_charts`` drawn; the rest, and those
    with nothing to draw, come back as lines (``Chart.path`` None)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.png"):  # a report directory holds this run's charts only
        old.unlink()
    data = data if data is not None else report_data(run)
    margins, notes = _plan_margins(data, out_dir)
    planned: list[_Planned | Chart] = [*margins, *notes, *_plan_performance(run, out_dir), *_plan_curves(data, out_dir),
                                       *_plan_arms(data, out_dir),
                                       *_plan_time_breakdown(run, out_dir), *_plan_plain_series(data, out_dir)]
    planned.sort(key=lambda c: SECTIONS.index(c.section))
    charts: list[Chart] = []
    drawn = 0
    for item in planned:
        if isinstance(item, Chart):
            charts.append(item)
        elif drawn < max_charts:
            item.draw(item.path)
            drawn += 1
            charts.append(Chart(item.path, item.section, item.caption))
        else:
            charts.append(Chart(None, item.section, f"{item.path.stem}: not drawn (this report draws at most "
                                                    f"{max_charts} charts; its values are in metrics.csv)"))
    return charts

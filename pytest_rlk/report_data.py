"""Where each metric of a run goes in its report (no matplotlib here: ``rlk report --no-plots``
uses it too).

- margins: error metrics with a tolerance (the band's ``abs_floor``), as error / tolerance per
  case and tier: one chart per tier;
- arm series: series of several arms (tag ``arm``, named ``<arm>_<name>`` or ``<role>.<name>``),
  overlaid per name; arm scalars: one table row per case and name, the arms side by side;
- series: other series, one chart per name (all-zero ones are named, not drawn);
- single values: every other scalar (errors without a tolerance included), one table row per
  metric name; the benchmark timings go to the roofline table (``pytest_rlk.performance``);
- curves: scalars tagged ``curve`` (the chart), ``curve_x`` / ``curve_y`` (its axes), ``curve_at``
  (the point's x) and ``arm`` (its line), gathered over the run's tests: one chart per curve and
  y axis, one line per arm (the capacity benchmark's memory and tokens/s against the tokens);
- injected faults: every metric of a test marked ``injected_fault``, apart from all of the above.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from pytest_rlk.bands import metric_kind
from pytest_rlk.compare import scalar_value
from pytest_rlk.performance import collect
from pytest_rlk.schema import MetricRecord, RunRecord, TestRecord

CURVE_TAGS = ("curve", "curve_x", "curve_y", "curve_at", "arm")
WHOLE_MODULES = ("step", "total")  # a module time that is the sum of the others: never stacked on them
INJECTED = "injected fault (expected to fail its gate)"


def is_error(metric: MetricRecord) -> bool:
    return metric_kind(metric.name, metric.space) == "error"


def tolerance(metric: MetricRecord) -> float | None:
    return metric.band.abs_floor if metric.band is not None and metric.band.abs_floor > 0 else None


def arm_split(metric: MetricRecord) -> tuple[str, str] | None:
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


def case_label(case: str, metric: MetricRecord) -> str:
    """The case, plus the tags that tell one metric of a case from another (not the arm)."""
    extra = [f"{k}={v}" for k, v in sorted(metric.tags.items())
             if k in ("backend", "dtype", "op") and k not in case and v not in case]
    return case + (f" [{', '.join(extra)}]" if extra else "")


@dataclass(frozen=True)
class Margin:
    case: str
    metric: str
    value: float
    tolerance: float
    source: str

    @property
    def ratio(self) -> float:
        return self.value / self.tolerance


@dataclass(frozen=True)
class ValueRow:
    """One metric name's scalars over the cases that recorded it."""

    name: str
    space: str
    unit: str
    values: list[tuple[str, float]]  # (case, value)

    def describe(self) -> str:
        if len(self.values) <= 3:
            return "; ".join(f"{v:.4g} ({case})" for case, v in self.values)
        numbers = [v for _, v in self.values]
        extreme_case, extreme = max(self.values, key=lambda cv: abs(cv[1]))
        return (f"min {min(numbers):.4g}, median {statistics.median(numbers):.4g}, max {max(numbers):.4g}; "
                f"largest |value|: {extreme_case}")


@dataclass
class ReportData:
    margins: dict[str, list[Margin]] = field(default_factory=dict)  # per tier, worst first
    arm_series: dict[str, list[tuple[str, str, MetricRecord]]] = field(default_factory=dict)  # name -> (case, arm, m)
    arm_scalars: list[tuple[str, str, dict[str, float]]] = field(default_factory=list)  # (case, name, {arm: value})
    series: dict[str, list[tuple[str, MetricRecord]]] = field(default_factory=dict)
    values: list[ValueRow] = field(default_factory=list)
    # (curve, x axis, y axis) -> {arm: [(x, y), ...] sorted by x}
    curves: dict[tuple[str, str, str], dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    injected: list[TestRecord] = field(default_factory=list)


def _tier(test: TestRecord) -> str:
    return test.tier or "untiered"


def _is_perf(metric: MetricRecord, perf_names: set[str]) -> bool:
    return metric.name in perf_names or "impl" in metric.tags


def report_data(run: RunRecord) -> ReportData:
    """Each metric of ``run`` in its one place (see the module's docstring)."""
    data = ReportData()
    perf_names = {f"{t.impl}_{s}" for c in collect(run) for t in c.timings.values()
                  for s in ("ms", "graph_ms", "fraction_of_hbm_limit", "peak_extra_bytes")}
    margins: dict[str, list[Margin]] = defaultdict(list)
    arm_series: dict[str, list] = defaultdict(list)
    arm_scalars: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    series: dict[str, list] = defaultdict(list)
    values: dict[str, list[tuple[str, MetricRecord]]] = defaultdict(list)
    curves: dict[tuple[str, str, str], dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for test in run.tests:
        if test.injected_fault:
            data.injected.append(test)
            continue
        for m in test.metrics:
            if not m.is_series and all(tag in m.tags for tag in CURVE_TAGS):
                key = (m.tags["curve"], m.tags["curve_x"], m.tags["curve_y"])
                curves[key][m.tags["arm"]].append((float(m.tags["curve_at"]), float(m.value)))
                continue
            split = arm_split(m)
            if "module" in m.tags and m.space == "time" and (split is None or m.tags["module"] not in WHOLE_MODULES):
                continue  # the time breakdown's (pytest_rlk.plots.time_breakdown)
            if m.is_series:
                if split is not None:
                    arm_series[split[0]].append((test.case, split[1], m))
                else:
                    series[m.name].append((test.case, m))
            elif is_error(m) and tolerance(m) is not None:
                margins[_tier(test)].append(Margin(case_label(test.case, m), m.name, float(m.value), tolerance(m),
                                                   m.band.source if m.band else ""))
            elif split is not None and not is_error(m):
                arm_scalars[(test.case, split[0])][split[1]] = float(m.value)
            elif not _is_perf(m, perf_names):
                values[m.name].append((case_label(test.case, m), m))
    data.margins = {tier: sorted(rows, key=lambda r: -r.ratio) for tier, rows in sorted(margins.items())}
    data.arm_series = {name: rows for name, rows in sorted(arm_series.items()) if len({a for _, a, _ in rows}) > 1}
    for name, rows in sorted(arm_series.items()):  # a series of one arm is a plain series
        if name not in data.arm_series:
            series[name] += [(f"{case} / {arm}", m) for case, arm, m in rows]
    data.arm_scalars = [(case, name, arms) for (case, name), arms in sorted(arm_scalars.items())]
    data.series = dict(sorted(series.items()))
    data.curves = {key: {arm: sorted(points) for arm, points in arms.items()} for key, arms in sorted(curves.items())}
    data.values = [ValueRow(name, rows[0][1].space, rows[0][1].unit,
                            [(case, float(scalar_value(m))) for case, m in rows])
                   for name, rows in sorted(values.items())]
    return data


def all_zero(values) -> bool:
    return all(v == 0 for v in values)

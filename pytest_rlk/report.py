"""The report of one run (``rlk report RUN``): ``report.md`` with its PNG charts beside it, the
same page as one self-contained ``report.html`` (charts inlined: the form CI systems publish),
and every metric in ``metrics.csv``.

The page reads top-down: the verdict (its first lines), then failures (one line each) and
regressions, the gate table, skips by cause, performance and A/B values, the single values as one
table, the charts, and last each failure's whole message and the run's provenance, under a table
of contents. Where each metric goes is :mod:`pytest_rlk.report_data`'s
call; tests marked ``injected_fault`` are listed apart from real cases. matplotlib is imported
only when charts are drawn: ``--no-plots`` reports on machines without it, and says so.
"""
from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from pytest_rlk.compare import scalar_value
from pytest_rlk.performance import collect, command_line, md_table, tables_markdown
from pytest_rlk.report_data import INJECTED, ReportData, is_error, report_data, tolerance
from pytest_rlk.report_html import anchor, write_html
from pytest_rlk.schema import RunRecord, Verdict
from pytest_rlk.skips import skips_by_cause
from pytest_rlk.table import backends_text, comparison_row, count, exercised_backends, fmt

GATE_HEADERS = ("case", "metric", "baseline", "new", "delta", "band", "verdict", "band source")
METRICS_CSV = "metrics.csv"
FIRST_LINE_CHARS = 160  # a failure's first line beside its test; the whole message follows in a block
VERDICT = "Verdict"
FAILURES = "Failures and regressions"
GATE = "Gate"
SKIPPED = "Skipped, by cause"
PERFORMANCE = "Performance and A/B"
VALUES = "Single values"
CHARTS = "Charts"
MESSAGES = "Failure messages"
RUN = "Run"
_FINDINGS = (Verdict.REGRESSION, Verdict.MISSING_METRIC, Verdict.IMPROVED, Verdict.UNGATED)


def _real(run: RunRecord):
    return [t for t in run.tests if not t.injected_fault]


def verdict_of(run: RunRecord) -> tuple[str, list[str]]:
    """``PASS`` / ``FAIL`` / ``INCOMPLETE`` and why."""
    failed = [t for t in run.tests if t.outcome in ("failed", "error")]
    regressions = [c for t in run.tests if t.gate for c in t.gate.failing]
    gate_errors = [t for t in run.tests if t.gate_error]
    why = []
    if failed:
        why.append(f"{len(failed)} failed test{'s' if len(failed) > 1 else ''}")
    if regressions:
        why.append(f"{len(regressions)} gate regression{'s' if len(regressions) > 1 else ''}")
    if gate_errors:
        why.append(f"{len(gate_errors)} unusable baseline{'s' if len(gate_errors) > 1 else ''}")
    if why:
        return "FAIL", why
    if run.partial:
        return "INCOMPLETE", [run.describe_status()]
    return "PASS", []


def verdict_line(run: RunRecord) -> str:
    verdict, why = verdict_of(run)
    return f"**{verdict}**" + (f": {', '.join(why)}" if why else "")


def contents(sections: list[str]) -> list[str]:
    return ["Contents: " + " · ".join(f"[{s}](#{anchor(s)})" for s in sections), ""]


def summary(run: RunRecord, data: ReportData) -> list[str]:
    m = run.manifest
    outcomes = Counter(t.outcome for t in run.tests)
    lines = [f"## {VERDICT}", "",
             f"- run `{m.run_id}`: {run.describe_status()} (exit status {run.exit_status}); "
             f"platform {m.platform.tag} ({m.platform.describe()}); tiers {', '.join(m.tiers)}",
             "- tests: " + (", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) or "none recorded")
             + (f" ({len(data.injected)} of them with an injected fault, listed apart)" if data.injected else "")]
    verdicts = Counter(c.verdict.value for t in run.tests if t.gate for c in t.gate.comparisons)
    gated_cases = sum(1 for t in run.tests if t.gate and t.gate.comparisons)
    lines.append("- gate: " + (", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())) + f" ({gated_cases} cases)"
                               if verdicts else "no gated metrics recorded"))
    missing = sum(1 for t in run.tests if t.gate and t.gate.missing_baseline)
    if missing:
        from pytest_rlk.table import record_command

        lines.append(f"- {count(missing, 'case')} without a baseline: record them with `{record_command(run)}`")
    worst = [rows[0] for rows in data.margins.values() if rows and rows[0].value > 0]
    if worst:
        lines.append("- closest to its tolerance: " + "; ".join(
            f"{w.case} {w.metric} at {w.ratio:.3g} of it" for w in sorted(worst, key=lambda w: -w.ratio)))
    causes = skips_by_cause(run.tests)
    if causes:
        lines.append(f"- skipped: {sum(sum(c.values()) for c in causes.values())} ("
                     + ", ".join(f"{cause} {sum(c.values())}" for cause, c in causes.items())
                     + f"; [reasons](#{anchor(SKIPPED)}))")
    used = exercised_backends(run)
    lines.append("- kernel backends exercised: " + (backends_text(used) if used else "none recorded by the tests "
                                                  f"(configured: {', '.join(m.kernel_backend_ids) or '-'})"))
    if run.fallback_counts:
        lines.append("- kernel fallbacks: " + ", ".join(f"{op} {n}" for op, n in sorted(run.fallback_counts.items())))
    lines += [f"- file: {d}: `{p}`" for d, p in sorted(run.files.items())]
    return lines + [""]


def failures_section(run: RunRecord, data: ReportData) -> list[str]:
    lines = [f"## {FAILURES}", ""]
    failed = [t for t in _real(run) if t.outcome in ("failed", "error")]
    problems = [[t.case, c.name, fmt(c.baseline), fmt(c.new), c.verdict.label, c.detail]
                for t in _real(run) if t.gate for c in t.gate.comparisons if c.verdict in _FINDINGS]
    problems += [[t.case, "(baseline file)", "-", "-", "gate error", t.gate_error] for t in run.tests if t.gate_error]
    if not failed and not problems:
        lines += ["None among the real cases: every test that ran passed and every gated metric is within its band.", ""]
    for t in failed:
        first = (t.failure or "(no message recorded)").splitlines()[0]
        first = first if len(first) <= FIRST_LINE_CHARS else first[:FIRST_LINE_CHARS - 1] + "…"
        lines.append(f"- `{t.nodeid}` ({t.outcome}): {first}")
    if failed:
        lines += ["", f"Each failure's whole message: [{MESSAGES}](#{anchor(MESSAGES)}).", ""]
    if problems:
        lines += ["### Regressions and other gate findings", ""] + md_table(
            ["case", "metric", "baseline", "new", "verdict", "detail"], problems) + [""]
    if data.injected:
        lines += ["### Injected faults", "",
                  f"Each test below runs a deliberately wrong part: {INJECTED}. Their metrics are kept out of "
                  "the real cases' charts and tables.", ""]
        rows = []
        for t in data.injected:
            over = [mm for mm in t.metrics if not mm.is_series and is_error(mm) and tolerance(mm) is not None
                    and float(mm.value) > tolerance(mm)]
            worst = max(over, key=lambda mm: float(mm.value) / tolerance(mm)) if over else None
            caught = (f"{count(len(over), 'error')} over tolerance; worst {worst.name} at "
                      f"{float(worst.value) / tolerance(worst):.3g}x its tolerance" if worst is not None
                      else "no recorded error over its tolerance")
            findings = [c for c in (t.gate.comparisons if t.gate else []) if c.verdict in _FINDINGS]
            rows.append([f"`{t.nodeid}`", t.injected_fault, t.outcome, caught,
                         ", ".join(f"{c.name} {c.verdict.value}" for c in findings) or "-"])
        lines += md_table(["test", "injected fault", "outcome", "caught by", "gate findings"], rows) + [""]
    return lines


def gate_section(run: RunRecord) -> list[str]:
    """The gate table, one case's rows together (its name once), the band sources as notes."""
    sources: list[str] = []
    rows = []
    for t in run.tests:
        for i, c in enumerate(t.gate.comparisons if t.gate else []):
            source = c.band.source if c.band and c.band.source else ""
            if source and source not in sources:
                sources.append(source)
            case = (t.case + (" (injected fault)" if t.injected_fault else "")) if i == 0 else ""
            rows.append([case, *comparison_row(c, short=True), f"[{sources.index(source) + 1}]" if source else "-"])
    if not rows:
        return []
    return ([f"## {GATE}", ""] + md_table(GATE_HEADERS, rows) + ["", "Band sources:", ""]
            + [f"{i}. {s}" for i, s in enumerate(sources, 1)] + [""])


def skipped_section(run: RunRecord) -> list[str]:
    causes = skips_by_cause(run.tests)
    if not causes:
        return []
    lines = [f"## {SKIPPED}", ""]
    for cause, reasons in causes.items():
        lines += [f"**{cause}** ({sum(reasons.values())})", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda r: (-r[1], r[0]))] + [""]
    return lines


def performance_section(run: RunRecord, data: ReportData) -> list[str]:
    cases = collect(run)
    if not cases and not data.arm_scalars:
        return []
    lines = [f"## {PERFORMANCE}", ""]
    if cases:
        lines += ["### Roofline", ""] + tables_markdown(cases)
    if data.arm_scalars:
        rows = []
        for case, name, arms in data.arm_scalars:
            values = list(arms.items())
            (_, va), rest = values[0], values[1:]
            cells = "; ".join(f"{arm} {v:.4g}" for arm, v in values)
            rel = "; ".join(f"{arm} {(v - va) / abs(va):+.3g}" if va else f"{arm}: A is 0" for arm, v in rest) or "-"
            rows.append([case, name, cells, rel])
        lines += ["### A/B values", "", "Scalars that several arms recorded; B vs A is (B - A) / |A|, A the first arm.", ""]
        lines += md_table(["case", "metric", "values per arm", "B vs A"], rows) + [""]
    return lines


def values_section(data: ReportData) -> list[str]:
    if not data.values:
        return []
    rows = [[r.name, r.space + (f" [{r.unit}]" if r.unit else ""), len(r.values), r.describe()] for r in data.values]
    return ([f"## {VALUES}", "", f"Each metric name recorded as one value per case (no chart: every value is in "
                                 f"`{METRICS_CSV}`); errors here carry no tolerance (their test asserts its own).", ""]
            + md_table(["metric", "space", "cases", "values"], rows) + [""])


def charts_section(charts) -> list[str]:
    if charts is None:
        return [f"## {CHARTS}", "", "not drawn (`rlk report --no-plots`): run `rlk report` where matplotlib is installed",
                ""]
    if not charts:
        return []
    lines = [f"## {CHARTS}", ""]
    sections = list(dict.fromkeys(c.section for c in charts))
    lines += ["Sections: " + " · ".join(f"[{s}](#{anchor(s)})" for s in sections), ""]
    for section in sections:
        lines += [f"### {section}", ""]
        for chart in (c for c in charts if c.section == section):
            if chart.path is None:
                lines += [f"- {chart.caption}", ""]
            else:
                lines += [f"![{chart.path.stem}]({chart.path.name})", "", f"*{chart.caption}*", ""]
    return lines


def messages_section(run: RunRecord) -> list[str]:
    failed = [t for t in run.tests if t.outcome in ("failed", "error")]
    if not failed:
        return []
    lines = [f"## {MESSAGES}", ""]
    for t in failed:
        message = (t.failure or "(no message recorded)").splitlines()
        lines += [f"- `{t.nodeid}` ({t.outcome})", "", "  ```", *(f"  {line}" for line in message), "  ```", ""]
    return lines


def run_section(run: RunRecord) -> list[str]:
    m = run.manifest
    return [f"## {RUN}", "",
            f"- started {m.created_utc}, finished {run.finished_utc}",
            f"- command: `{command_line(run)}`",
            (f"- platform: {m.platform.tag} ({m.platform.describe()}; capability {m.platform.capability}, "
             f"CUDA {m.platform.cuda}, driver {m.platform.driver})"),
            f"- suite commit: {m.suite_commit} (dirty: {m.suite_dirty}); vime commit: {m.vime_commit}",
            f"- kernel backend option: {m.kernel_backend_option or '-'}",
            "- software: " + ", ".join(f"{k} {v}" for k, v in m.software.items() if v),
            f"- every metric: `{METRICS_CSV}` ({sum(len(t.metrics) for t in run.tests)} rows)", ""]


def render(run: RunRecord, charts, data: ReportData | None = None) -> str:
    """``charts`` None: not drawn (``--no-plots``)."""
    data = data if data is not None else report_data(run)
    parts = [summary(run, data), failures_section(run, data), gate_section(run), skipped_section(run),
             performance_section(run, data), values_section(data), charts_section(charts), messages_section(run),
             run_section(run)]
    sections = [p[0][3:] for p in parts if p]
    lines = [f"# rlk run {run.manifest.run_id}", "", verdict_line(run), ""] + contents(sections)
    for part in parts:
        lines += part
    return "\n".join(lines)


def write_metrics_csv(run: RunRecord, path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        out = csv.writer(fh)
        out.writerow(["case", "metric", "value", "unit", "space", "direction", "kind", "gated", "tolerance",
                      "injected_fault", "tags"])
        for t in run.tests:
            for mm in t.metrics:
                try:
                    value = fmt(scalar_value(mm))
                except ValueError:
                    value = "-"
                tol = tolerance(mm)
                out.writerow([t.case, mm.name, value, mm.unit, mm.space, mm.direction,
                              "series" if mm.is_series else "scalar", mm.gate, "" if tol is None else fmt(tol),
                              t.injected_fault or "", " ".join(f"{k}={v}" for k, v in sorted(mm.tags.items()))])
    return path


def write_report(run: RunRecord, out_dir: Path, *, plots: bool = True) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = report_data(run)
    charts = None
    if plots:
        from pytest_rlk.plots import plot_run

        charts = plot_run(run, out_dir, data=data)
    write_metrics_csv(run, out_dir / METRICS_CSV)
    text = render(run, charts, data)
    path = out_dir / "report.md"
    path.write_text(text, encoding="utf-8")
    write_html(text, out_dir, out_dir / "report.html", title=f"rlk run {run.manifest.run_id}")
    return path

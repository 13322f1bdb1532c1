"""The report of one run (``rlk report RUN``): ``report.md`` with its PNG charts beside it, the
same page as one self-contained ``report.html`` (charts inlined: the form CI systems publish),
and every metric in ``metrics.csv``.

The page starts with a summary a reader can stop after (verdict, tests, gate, regressions, skips
by cause, backends), then the charts grouped with captions, then the details (failures, the gate
table, the run's provenance). matplotlib is imported only when charts are drawn: ``--no-plots``
reports on machines without it (the GPU machines), and says so in the report.
"""
from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from pytest_rlk.compare import scalar_value
from pytest_rlk.performance import collect, command_line, md_table, tables_markdown
from pytest_rlk.report_html import write_html
from pytest_rlk.schema import RunRecord, Verdict
from pytest_rlk.skips import skips_by_cause
from pytest_rlk.table import comparison_row, exercised_backends, fmt

GATE_HEADERS = ("case", "metric", "baseline", "new", "delta", "band", "verdict", "band source")
METRICS_CSV = "metrics.csv"


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


def summary(run: RunRecord) -> list[str]:
    m = run.manifest
    verdict, why = verdict_of(run)
    outcomes = Counter(t.outcome for t in run.tests)
    lines = ["## Summary", "",
             f"**{verdict}**" + (f": {', '.join(why)}" if why else ""), "",
             f"- run `{m.run_id}`: {run.describe_status()} (exit status {run.exit_status}); "
             f"platform {m.platform.tag} ({m.platform.describe()}); tiers {', '.join(m.tiers)}",
             "- tests: " + (", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) or "none recorded")]
    verdicts = Counter(c.verdict.value for t in run.tests if t.gate for c in t.gate.comparisons)
    gated_cases = sum(1 for t in run.tests if t.gate and t.gate.comparisons)
    lines.append("- gate: " + (", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())) + f" ({gated_cases} cases)"
                               if verdicts else "no gated metrics recorded"))
    missing = sum(1 for t in run.tests if t.gate and t.gate.missing_baseline)
    if missing:
        from pytest_rlk.table import record_command

        lines.append(f"- {missing} cases have no baseline: record them with `{record_command(run)}`")
    causes = skips_by_cause(run.tests)
    if causes:
        lines.append(f"- skipped: {sum(sum(c.values()) for c in causes.values())} ("
                     + ", ".join(f"{cause} {sum(c.values())}" for cause, c in causes.items()) + "; reasons below)")
    used = exercised_backends(run)
    lines.append("- kernel backends exercised: " + (", ".join(f"{b} ({n} tests)" for b, n in used.most_common())
                                                  if used else f"none recorded by the tests (configured: "
                                                  f"{', '.join(m.kernel_backend_ids) or '-'})"))
    if run.fallback_counts:
        lines.append("- kernel fallbacks: " + ", ".join(f"{op} {n}" for op, n in sorted(run.fallback_counts.items())))
    lines += [f"- file: {d}: `{p}`" for d, p in sorted(run.files.items())]
    lines.append("")
    problems = [[t.case, c.name, fmt(c.baseline), fmt(c.new), c.verdict.label, c.detail]
                for t in run.tests if t.gate for c in t.gate.comparisons
                if c.verdict in (Verdict.REGRESSION, Verdict.MISSING_METRIC, Verdict.IMPROVED, Verdict.UNGATED)]
    problems += [[t.case, "(baseline file)", "-", "-", "gate error", t.gate_error] for t in run.tests if t.gate_error]
    if problems:
        lines += ["### Regressions and other gate findings", ""] + md_table(
            ["case", "metric", "baseline", "new", "verdict", "detail"], problems) + [""]
    failed = [t for t in run.tests if t.outcome in ("failed", "error")]
    if failed:
        lines += ["### Failed tests", ""] + [f"- `{t.nodeid}` ({t.outcome}): "
                                             f"{(t.failure or '').splitlines()[0] if t.failure else '-'}" for t in failed] + [""]
    return lines


def skipped_section(run: RunRecord) -> list[str]:
    causes = skips_by_cause(run.tests)
    if not causes:
        return []
    lines = ["## Skipped, by cause", ""]
    for cause, reasons in causes.items():
        lines += [f"**{cause}** ({sum(reasons.values())})", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda r: (-r[1], r[0]))] + [""]
    return lines


def charts_section(charts, out_dir: Path) -> list[str]:
    if charts is None:
        return ["## Charts", "", "not drawn (`rlk report --no-plots`): run `rlk report` where matplotlib is installed", ""]
    if not charts:
        return []
    lines = ["## Charts", ""]
    section = None
    for chart in charts:
        if chart.section != section:
            section = chart.section
            lines += [f"### {section}", ""]
        lines += [f"![{chart.path.stem}]({chart.path.relative_to(out_dir)})", "", f"*{chart.caption}*", ""]
    return lines


def details(run: RunRecord) -> list[str]:
    m = run.manifest
    lines = []
    failed = [t for t in run.tests if t.outcome in ("failed", "error")]
    if failed:
        lines += ["## Failed", ""]
        for t in failed:
            message = (t.failure or "(no message recorded)").splitlines()
            lines += [f"- `{t.nodeid}` ({t.outcome})", "", "  ```", *(f"  {line}" for line in message), "  ```", ""]
    gate_rows = []
    for t in run.tests:
        for c in (t.gate.comparisons if t.gate else []):
            row = comparison_row(c, short=True)
            gate_rows.append([t.case, *row, c.band.source if c.band else ""])
    if gate_rows:
        lines += ["## Gate", ""] + md_table(GATE_HEADERS, gate_rows) + [""]
    lines += ["## Run", "",
              f"- started {m.created_utc}, finished {run.finished_utc}",
              f"- command: `{command_line(run)}`",
              (f"- platform: {m.platform.tag} ({m.platform.describe()}; capability {m.platform.capability}, "
               f"CUDA {m.platform.cuda}, driver {m.platform.driver})"),
              f"- suite commit: {m.suite_commit} (dirty: {m.suite_dirty}); vime commit: {m.vime_commit}",
              f"- kernel backend option: {m.kernel_backend_option or '-'}",
              "- software: " + ", ".join(f"{k} {v}" for k, v in m.software.items() if v),
              f"- every metric: `{METRICS_CSV}` ({sum(len(t.metrics) for t in run.tests)} rows)", ""]
    return lines


def render(run: RunRecord, charts, out_dir: Path) -> str:
    """``charts`` None: not drawn (``--no-plots``)."""
    lines = [f"# rlk run {run.manifest.run_id}", ""] + summary(run)
    cases = collect(run)
    if cases:
        lines += ["## Performance (roofline)", ""] + tables_markdown(cases)
    lines += charts_section(charts, out_dir) + skipped_section(run) + details(run)
    return "\n".join(lines)


def write_metrics_csv(run: RunRecord, path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        out = csv.writer(fh)
        out.writerow(["case", "metric", "value", "unit", "space", "direction", "kind", "gated", "tags"])
        for t in run.tests:
            for mm in t.metrics:
                try:
                    value = fmt(scalar_value(mm))
                except ValueError:
                    value = "-"
                out.writerow([t.case, mm.name, value, mm.unit, mm.space, mm.direction,
                              "series" if mm.is_series else "scalar", mm.gate,
                              " ".join(f"{k}={v}" for k, v in sorted(mm.tags.items()))])
    return path


def write_report(run: RunRecord, out_dir: Path, *, plots: bool = True) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = None
    if plots:
        from pytest_rlk.plots import plot_run

        charts = plot_run(run, out_dir)
    write_metrics_csv(run, out_dir / METRICS_CSV)
    text = render(run, charts, out_dir)
    path = out_dir / "report.md"
    path.write_text(text, encoding="utf-8")
    write_html(text, out_dir, out_dir / "report.html", title=f"rlk run {run.manifest.run_id}")
    return path

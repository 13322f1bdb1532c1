"""The Markdown report of one run (``rlk report RUN``), with its PNG plots beside it.

matplotlib is imported only when plots are drawn: ``--no-plots`` reports on machines without it
(the GPU machines), and says so in the report.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from pytest_rlk.compare import scalar_value
from pytest_rlk.performance import collect, command_line, md_table, tables_markdown
from pytest_rlk.schema import RunRecord
from pytest_rlk.table import DIFF_HEADERS, comparison_row, fmt


def render(run: RunRecord, images: list[Path] | None, out_dir: Path) -> str:
    """``images`` None: plots were not drawn (``--no-plots``)."""
    m = run.manifest
    outcomes = Counter(t.outcome for t in run.tests)
    lines = [f"# rlk run {m.run_id}", "",
             f"- status: **{run.status}** (exit status {run.exit_status}); started {m.created_utc}, finished {run.finished_utc}",
             f"- command: `{command_line(run)}`", f"- tiers: {', '.join(m.tiers)}",
             (f"- platform: {m.platform.tag} ({m.platform.describe()}; capability {m.platform.capability}, "
              f"CUDA {m.platform.cuda}, driver {m.platform.driver})"),
             f"- suite commit: {m.suite_commit} (dirty: {m.suite_dirty}); vime commit: {m.vime_commit}",
             f"- kernel backends: {', '.join(m.kernel_backend_ids) or '-'}",
             "- software: " + ", ".join(f"{k} {v}" for k, v in m.software.items() if v),
             "- tests: " + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())), ""]
    if run.fallback_counts:
        lines += ["## Kernel fallbacks", ""] + md_table(
            ["op", "count"], sorted(run.fallback_counts.items())) + [""]
    cases = collect(run)
    if cases:
        lines += ["## Performance (roofline)", ""] + tables_markdown(cases)
    metric_rows = [[t.case, mm.name, fmt(scalar_value(mm)), mm.unit, mm.space, mm.direction,
                    "series" if mm.is_series else "scalar"] for t in run.tests for mm in t.metrics]
    if metric_rows:
        lines += ["## Metrics", ""] + md_table(
            ["case", "metric", "value", "unit", "space", "direction", "kind"], metric_rows) + [""]
    gate_rows = [comparison_row(c, f"{t.case}/") for t in run.tests if t.gate for c in t.gate.comparisons]
    if gate_rows:
        lines += ["## Gate", ""] + md_table(DIFF_HEADERS, gate_rows) + [""]
    failed = [t for t in run.tests if t.outcome in ("failed", "error")]
    if failed:
        lines += ["## Failed", ""]
        for t in failed:
            message = (t.failure or "(no message recorded)").splitlines()
            lines += [f"- `{t.nodeid}` ({t.outcome})", "", "  ```", *(f"  {m}" for m in message), "  ```", ""]
    skipped = [t for t in run.tests if t.outcome == "skipped"]
    if skipped:
        lines += ["## Skipped", ""] + [f"- `{t.nodeid}`: {t.skip_reason}" for t in skipped] + [""]
    if images is None:
        lines += ["## Plots", "", "not drawn (`rlk report --no-plots`): run `rlk report` where matplotlib is installed", ""]
    elif images:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out_dir)})" for p in images] + [""]
    return "\n".join(lines)


def write_report(run: RunRecord, out_dir: Path, *, plots: bool = True) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    images = None
    if plots:
        from pytest_rlk.plots import plot_run

        images = plot_run(run, out_dir)
    path = out_dir / "report.md"
    path.write_text(render(run, images, out_dir), encoding="utf-8")
    return path

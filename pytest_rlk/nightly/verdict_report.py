"""The verdict as text (terminal) and as a Markdown report with a column per platform.

Each run also gets its own full report (``pytest_rlk.report``, plots included) under
``runs/<platform>-<node>/``; the verdict report links them.
"""
from __future__ import annotations

from pathlib import Path

from pytest_rlk.nightly.verdict import NOT_RUN, VerdictInputs, VerdictRecord
from pytest_rlk.performance import md_table
from pytest_rlk.table import format_table

SHOWN_NOTES = 30


def _problems(n: int) -> str:
    return "1 problem" if n == 1 else f"{n} problems"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "-"


def summary_rows(verdict: VerdictRecord) -> tuple[list[str], list[list[str]]]:
    """One column per platform: nodes, runs, test outcomes, gate verdicts, verdict."""
    cols = verdict.columns
    headers = ["", *[c.platform + ("" if c.expected else " (not expected)") for c in cols]]
    rows = [
        ["nodes", *[", ".join(c.nodes) or "-" for c in cols]],
        ["runs", *[", ".join(c.run_statuses) or "none" for c in cols]],
        ["tests", *[_counts(c.outcomes) for c in cols]],
        ["gate", *[_counts(c.gate) for c in cols]],
        ["verdict", *["ok" if c.ok else f"FAIL ({_problems(c.problems)})" for c in cols]],
    ]
    return headers, rows


def headline(verdict: VerdictRecord) -> str:
    state = "PASS" if verdict.passed else f"FAIL ({_problems(len(verdict.problems))})"
    expected = ", ".join(verdict.expected_platforms) or "none stated"
    return f"rlk verdict: {state}; platforms expected: {expected}; baselines {verdict.baselines}"


def text_lines(verdict: VerdictRecord) -> list[str]:
    lines = [headline(verdict), "", format_table(*summary_rows(verdict)), ""]
    if verdict.problems:
        lines += [f"problems ({len(verdict.problems)}):"] + [f"  {p.line()}" for p in verdict.problems] + [""]
    if verdict.notes:
        lines += [f"notes ({len(verdict.notes)}):"] + [f"  {n}" for n in verdict.notes[:SHOWN_NOTES]]
        if len(verdict.notes) > SHOWN_NOTES:
            lines.append(f"  ... {len(verdict.notes) - SHOWN_NOTES} more in verdict.json")
    return lines


def _matrix(verdict: VerdictRecord) -> list[str]:
    """Tests with metrics or problems somewhere; rows skipped everywhere are left to the runs'
    own reports."""
    platforms = [c.platform for c in verdict.columns]
    rows = [[f"`{r.nodeid}`", *[r.cells.get(p, NOT_RUN) for p in platforms]] for r in verdict.rows
            if any(not text.startswith("skipped") for text in r.cells.values())]
    if not rows:
        return []
    return ["## Tests", "", f"`{NOT_RUN}`: not run on that platform.", ""] + md_table(["test", *platforms], rows) + [""]


def render(verdict: VerdictRecord, run_reports: dict[str, Path], images: list[Path] | None, out_dir: Path) -> str:
    lines = [f"# {headline(verdict)}", "", f"- created {verdict.created_utc}", ""]
    lines += ["## Platforms", ""] + md_table(*summary_rows(verdict)) + [""]
    if verdict.problems:
        lines += ["## Problems", ""] + [f"- {p.line()}" for p in verdict.problems] + [""]
    if verdict.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in verdict.notes] + [""]
    lines += _matrix(verdict)
    if run_reports:
        lines += ["## Runs", ""] + [f"- {label}: [{path.relative_to(out_dir)}]({path.relative_to(out_dir)})"
                                    for label, path in run_reports.items()] + [""]
    if images is None:
        lines += ["## Plots", "", "not drawn (`--no-plots`)", ""]
    elif images:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out_dir)})" for p in images] + [""]
    return "\n".join(lines)


def plot_verdict(verdict: VerdictRecord, path: Path) -> Path:
    """Two stacked-bar panels per platform: test outcomes, and gate verdicts."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    platforms = [c.platform for c in verdict.columns]
    fig = Figure(figsize=(max(7.0, 2.2 * len(platforms) + 3), 4))
    for k, (title, counts_of) in enumerate((("test outcomes", lambda c: c.outcomes),
                                            ("gated metrics", lambda c: c.gate))):
        ax = fig.add_subplot(1, 2, k + 1)
        keys = sorted({key for c in verdict.columns for key in counts_of(c)})
        bottom = [0] * len(platforms)
        for key in keys:
            heights = [counts_of(c).get(key, 0) for c in verdict.columns]
            ax.bar(range(len(platforms)), heights, bottom=bottom, label=key)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(range(len(platforms)), platforms)
        ax.set_title(title)
        if keys:
            ax.legend(fontsize="small")
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_verdict_report(verdict: VerdictRecord, inputs: VerdictInputs, out_dir: Path, *,
                         plots: bool = True) -> Path:
    """``out_dir/report.md`` and ``verdict.json``, and each run's own report under ``runs/``."""
    from pytest_rlk import storage
    from pytest_rlk.report import write_report

    out_dir.mkdir(parents=True, exist_ok=True)
    storage.write_json_atomic(out_dir / "verdict.json", verdict)
    run_reports = {}
    for item in inputs.runs:
        label = f"{item.run.manifest.platform.tag}-{item.node}"
        label += f"-{len(run_reports)}" if any(k.startswith(label + " ") for k in run_reports) else ""
        run_reports[f"{label} ({item.run.status})"] = write_report(item.run, out_dir / "runs" / label, plots=plots)
    images = [plot_verdict(verdict, out_dir / "verdict.png")] if plots else None
    path = out_dir / "report.md"
    path.write_text(render(verdict, run_reports, images, out_dir), encoding="utf-8")
    return path

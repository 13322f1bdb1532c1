"""Plain-text tables for ``rlk diff`` and the ``rlk`` terminal-summary section."""
from __future__ import annotations

import shlex
import textwrap
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

from pytest_rlk.history import shadow_lines
from pytest_rlk.schema import GateResult, MetricComparison, RunRecord, Verdict
from pytest_rlk.skips import skip_lines

DIFF_HEADERS = ("metric", "baseline", "new", "delta", "band", "verdict")
GROUPED_WIDTH = 100  # rlk diff's default table: fits a 120-column terminal
SLOWEST_AFTER_S = 60.0  # sessions longer than this list their slowest tests (CI budgeting)
SLOWEST_COUNT = 5


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "test")`` -> ``1 test``; ``count(2, "test")`` -> ``2 tests``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [list(map(str, r)) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def comparison_row(c: MetricComparison, prefix: str = "", *, short: bool = False) -> list[str]:
    band = "-" if c.band_width is None else f"±{c.band_width:.3g}" if c.direction == "two_sided" else f"{c.band_width:.3g}"
    verdict = c.verdict.value if short else c.verdict.label
    return [prefix + c.name, fmt(c.baseline), fmt(c.new), fmt(c.delta), band, verdict]


VERDICT_NOTES = {
    Verdict.IMPROVED: "improved: better than the reference beyond the refresh band (refresh the baseline)",
    Verdict.UNGATED: "ungated: in the baseline, recorded, but its test no longer gates it (refresh the baseline)",
    Verdict.MISSING_METRIC: "missing_metric: in the reference, not recorded (a lost gate fails)",
    Verdict.NEW_METRIC: "new_metric: recorded, not in the reference (passes)",
}


def diff_table(results: Iterable[GateResult], *, headers: Sequence[str] = DIFF_HEADERS, wide: bool = False) -> str:
    """``wide``: one line per metric, ``case/metric`` (for grep). Otherwise one line per case
    and its metrics indented under it (about 100 columns); a case without its baseline file is
    one line naming its metrics; notes explain the short verdicts and name the band sources."""
    # unsupported metrics are named once per backend under the table (tag_diff.unsupported_lines);
    # a case with nothing to compare (no gated metric on either side) has no line
    results = [r.model_copy(update={"comparisons": [c for c in r.comparisons if c.verdict is not Verdict.UNSUPPORTED]})
               for r in results]
    results = [r for r in results if r.comparisons]
    if wide:
        rows = [comparison_row(c, f"{r.case}/") for r in results for c in r.comparisons]
        return "\n".join([format_table(headers, rows)] + _notes(results, short=False))
    rows: list[list[str] | str] = []
    for r in results:
        rows.append(r.case)
        missing = r.with_verdict(Verdict.MISSING_BASELINE)
        if missing and len(missing) == len(r.comparisons):
            rows.append(f"  (no baseline file: {len(missing)} gated metrics: {', '.join(c.name for c in missing)})")
            continue
        rows += [comparison_row(c, "  ", short=True) for c in r.comparisons]
    notes = [wrapped for note in _notes(results, short=True)
             for wrapped in textwrap.wrap(note, GROUPED_WIDTH, subsequent_indent="    ",
                                          break_long_words=False, break_on_hyphens=False)]
    return "\n".join([format_grouped(headers, rows)] + notes)


def format_grouped(headers: Sequence[str], rows: Sequence[list[str] | str]) -> str:
    """A table whose string rows are group titles spanning the line (wrapped at the table width)."""
    cells = [r for r in rows if not isinstance(r, str)]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths)).rstrip()
    total = max(len(line(headers)), GROUPED_WIDTH)
    out = [line(headers), line(["-" * w for w in widths])]
    for row in rows:
        if isinstance(row, str):  # a case name is never split (it names a file); notes wrap
            out += textwrap.wrap(row, total, subsequent_indent="    ", break_long_words=False,
                                 break_on_hyphens=False) or [""]
        else:
            out.append(line(row))
    return "\n".join(out)


def one_run_only_lines(only_a: Sequence[str], only_b: Sequence[str]) -> list[str]:
    """The cases of an A/B diff that one run holds and the other does not, under one heading with
    counts (not compared: the runs selected different tests)."""
    if not only_a and not only_b:
        return []
    lines = [f"cases in one run only (not compared): {len(only_a) + len(only_b)} "
             f"({len(only_a)} in A only, {len(only_b)} in B only)"]
    for side, cases in (("A", only_a), ("B", only_b)):
        if cases:
            lines += textwrap.wrap(f"{side} only ({len(cases)}): " + ", ".join(cases), GROUPED_WIDTH,
                                   initial_indent="  ", subsequent_indent="      ",
                                   break_long_words=False, break_on_hyphens=False)
    return lines


def _notes(results: Sequence[GateResult], *, short: bool) -> list[str]:
    comparisons = [c for r in results for c in r.comparisons]
    present = {c.verdict for c in comparisons}
    notes = [VERDICT_NOTES[v] for v in VERDICT_NOTES if v in present] if short else []
    sources = Counter(c.band.source for c in comparisons if c.band is not None and c.band.source)
    notes += [f"band source: {src}" + (f" ({n} metrics)" if n > 1 else "") for src, n in sorted(sources.items())]
    return notes


def _shown(path: Path) -> str:
    """Relative to the current directory when under it (the summary's lines stay short)."""
    here = Path.cwd()
    return str(path.relative_to(here)) if path.is_absolute() and path.is_relative_to(here) else str(path)


def record_command(run: RunRecord) -> str:
    """The pytest command that records this run's missing baselines: its own arguments with
    ``--rlk-update-baselines=failed`` (writes only the missing or failing files)."""
    args, skip_next = [], False
    for arg in run.manifest.argv:
        if skip_next:
            skip_next = False
            continue
        if arg == "--rlk-update-baselines":
            skip_next = True
            continue
        if not arg.startswith("--rlk-update-baselines="):
            args.append(arg)
    return shlex.join(["pytest", *args, "--rlk-update-baselines=failed"])


def missing_baseline_lines(run: RunRecord, results: Iterable[GateResult]) -> list[str]:
    """Where baselines are missing: how many, where, and the exact command that records them."""
    missing = [r for r in results if r.missing_baseline and not r.baseline_written]  # not the ones this run recorded
    if not missing:
        return []
    dirs = sorted({_shown(Path(r.baseline_path).parent) for r in missing if r.baseline_path})
    where = f" under {', '.join(d + '/' for d in dirs)}" if dirs else ""
    return [f"no baseline for {len(missing)} case{'s' if len(missing) > 1 else ''}{where}; record them with:",
            f"  {record_command(run)}"]


def refresh_lines(run: RunRecord, run_dir: Path) -> list[str]:
    """The command that refreshes, from this run, the baselines its gate calls out of date (a
    passed real case with a metric improved beyond its refresh band, or one its test no longer
    gates); ``rlk baselines update`` writes them without running the tests again."""
    improved, ungated = [], []
    for t in run.tests:
        if t.gate is None or t.gate.baseline_written or t.outcome != "passed" or t.injected_fault:
            continue
        if t.gate.improvements:
            improved.append(t.case)
        elif t.gate.with_verdict(Verdict.UNGATED):
            ungated.append(t.case)
    lines = []
    for cases, mode, what in ((improved, " --mode all", "improved: every metric of these cases from this run"),
                              (ungated, "", "metrics no longer gated dropped, the references that pass kept")):
        if cases:
            lines += [f"refresh {count(len(cases), 'baseline')} from this run ({what}):",
                      f"  rlk baselines update {shlex.quote(str(run_dir))}{mode} "
                      + " ".join(f"--case {shlex.quote(c)}" for c in cases)]
    return lines


def summary_lines(run: RunRecord, run_dir: Path, tiers: Sequence[str], *,
                  not_collected: Mapping[str, str] | None = None,
                  deselected_by: tuple[tuple[str, str], int] | None = None) -> list[str]:
    """The ``rlk`` terminal section: tiers, hardware skips, gate verdicts, fallbacks, artifacts.

    ``not_collected``: tier -> its directory, skipped at collection (tier not selected);
    ``deselected_by``: ((the -m expression, the -k expression), how many of the selected tiers'
    tests they deselected)."""
    per_tier = Counter(t.tier or "untiered" for t in run.tests)
    ran = ", ".join(f"{tier} ({count(per_tier.get(tier, 0), 'test')})" for tier in tiers)
    lines = [f"tiers run: {ran}" + (f"; untiered: {per_tier['untiered']}" if per_tier.get("untiered") else "")]
    if any(run.deselected.values()):
        lines.append("deselected (tier not selected): " + ", ".join(
            f"{tier} {n}" for tier, n in sorted(run.deselected.items()) if n))
    if deselected_by is not None and deselected_by[1]:
        (markexpr, keyword), n = deselected_by
        given = " and ".join(f"{flag} {shlex.quote(expr)}" for flag, expr in (("-m", markexpr), ("-k", keyword)) if expr)
        hint = "; tox -e tests runs the slow ones" if "not slow" in (markexpr or "") else ""
        lines.append(f"deselected by {given or 'the selection'}: {count(n, 'test')}{hint}")
    if not_collected:
        lines.append("not collected (tier not selected): " + ", ".join(
            f"{tier} ({path}/)" for tier, path in sorted(not_collected.items())))
    lines += skip_lines(run.tests)
    lines += backend_lines(run)
    verdicts: Counter[str] = Counter()
    problem_lines: list[str] = []
    written = []
    for t in run.tests:
        if t.gate is None:
            continue
        if t.gate.baseline_written:
            written.append(t.gate.baseline_path)
        for c in t.gate.comparisons:
            verdicts[c.verdict.value] += 1
            if c.verdict in (Verdict.REGRESSION, Verdict.MISSING_METRIC, Verdict.IMPROVED, Verdict.UNGATED):
                problem_lines.append(f"  {c.verdict.label}: {t.case}/{c.name}: baseline "
                                     f"{fmt(c.baseline)}, new {fmt(c.new)} ({c.detail})")
    gate_errors = [t.gate_error for t in run.tests if t.gate_error]
    counts = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
    if gate_errors:
        plural = "s" if len(gate_errors) > 1 else ""
        lines.append(f"gate: {counts + '; ' if counts else ''}{len(gate_errors)} gate error{plural}:")
        lines += [f"  gate error: {e}" for e in gate_errors]
    elif verdicts:
        lines.append(f"gate: {counts}")
    else:
        lines.append("gate: no gated metrics recorded")
    lines += problem_lines
    lines += refresh_lines(run, run_dir)
    lines += shadow_lines(t.gate for t in run.tests if t.gate)
    lines += ["  " + line for line in missing_baseline_lines(run, (t.gate for t in run.tests if t.gate))]
    if written:
        lines.append(f"baselines written: {len(written)}")
        lines += [f"  {p}" for p in written]
    if run.fallback_counts:
        lines.append("kernel fallbacks: " + ", ".join(f"{op}={n}" for op, n in sorted(run.fallback_counts.items())))
    lines += [f"file: {description}: {_shown(Path(path))}" for description, path in sorted(run.files.items())]
    lines += slowest_lines(run)
    lines.append(f"run status: {run.describe_status()}; artifacts: {run_dir}")
    if not run.tests:  # session.py: `latest` moves at a run's first result
        lines.append("latest: not moved (this run recorded no test)")
        return lines
    if run.partial:
        lines += partial_run_lines(run_dir)
        return lines
    lines.append(f"report: rlk report {run_dir}   diff: rlk diff {run_dir}")
    return lines


def partial_run_lines(run_dir: Path) -> list[str]:
    """What to do with a run stopped before its end (the same lines start a stopped run's summary
    and the session's header, which a run killed before its summary still printed)."""
    return [f"merge: rlk merge {run_dir}   (finalizes run.json from the parts its processes wrote)",
            f"report: rlk report {run_dir}   diff: rlk diff {run_dir} --allow-partial"]


def exercised_backends(run: RunRecord) -> Counter[str]:
    """Kernel backend id/version -> how many tests exercised it (the tests' own records)."""
    return Counter(b for t in run.tests for b in t.backends)


def backends_text(used: Counter[str]) -> str:
    """``liger/0.8.5 (2 tests), rlk-triton/0.1.0 (1 test)``: commonest first."""
    return ", ".join(f"{b} ({count(n, 'test')})" for b, n in used.most_common())


def backend_lines(run: RunRecord) -> list[str]:
    used = exercised_backends(run)
    if not used:
        return []
    return ["kernel backends exercised: " + backends_text(used)]


def run_elapsed_s(run: RunRecord) -> float | None:
    """Wall time from the run's start to its end (None while it has no end)."""
    if run.finished_utc is None:
        return None
    parse = lambda text: datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (parse(run.finished_utc) - parse(run.manifest.created_utc)).total_seconds()


def slowest_lines(run: RunRecord, *, after_s: float = SLOWEST_AFTER_S, count: int = SLOWEST_COUNT) -> list[str]:
    """The ``count`` slowest tests (setup + call + teardown) when the run took over ``after_s``."""
    elapsed = run_elapsed_s(run)
    if elapsed is None or elapsed <= after_s or not run.tests:
        return []
    slowest = sorted(run.tests, key=lambda t: t.duration_s, reverse=True)[:count]
    return [f"slowest {len(slowest)} tests (whole run {elapsed:.0f} s):"] + [
        f"  {t.duration_s:7.1f} s  {t.nodeid}" for t in slowest]

"""The ``rlk`` command line: ``rlk diff``, ``rlk report``, ``rlk merge``, ``rlk env`` (+ extension commands:
``rlk e2e ...``, ``rlk nightly``, ``rlk verdict``, ``rlk same``, ``rlk drift``; ``rlk --help`` lists them all).

``rlk diff RUN --a-tag backend=X --b-tag backend=Y`` compares two tag selections of one run
(``pytest_rlk.tag_diff``).

Exit codes: 0 clean, 1 a regression (or an improvement under --fail-on-improvement, or a
missing baseline under --require-baselines), 2 usage error, an unreadable/corrupt file, or a diff
of a partial run (stopped before its end) without --allow-partial.

Other parts add subcommands through ``add_subcommands(subparsers)`` in ``pytest_rlk.e2e.cli``,
``pytest_rlk.bench_cli`` and ``pytest_rlk.drift.cli`` (``rlk drift``); each subparser sets ``func=handler`` with ``handler(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.compare import compare_records, compare_to_baseline
from pytest_rlk.gate import UNTIERED
from pytest_rlk.history import band_source_lines, shadow_lines
from pytest_rlk.options import OptionError, parse_refresh_rel
from pytest_rlk.schema import GateResult, RunRecord
from pytest_rlk.session import merge_run
from pytest_rlk.table import DIFF_HEADERS, count, diff_table, missing_baseline_lines, one_run_only_lines
from pytest_rlk.tag_diff import diff_tag_selections, parse_selectors, selector_text, unsupported_lines

EXTENSION_MODULES = ("pytest_rlk.e2e.cli", "pytest_rlk.bench_cli", "pytest_rlk.nightly.cli", "pytest_rlk.drift.cli",
                     "pytest_rlk.baselines_cli", "pytest_rlk.prove.cli")


def _load_run(arg: str, artifacts: Path | None) -> tuple[Path, RunRecord]:
    path = storage.resolve_run_file(arg, artifacts)
    return path, storage.load_run(path)


def diff_against_baselines(run: RunRecord, baselines: Path, *, refresh_rel: float | None) -> list[GateResult]:
    platform = run.manifest.platform.tag
    results = []
    for test in run.tests:
        if not any(m.gate for m in test.metrics):
            continue
        tier = test.tier or UNTIERED
        path, baseline = storage.find_baseline(baselines, tier, test.gated_platform(platform), test.case)
        result = compare_to_baseline(test, baseline, refresh_rel=refresh_rel)
        result.baseline_path = str(path)
        results.append(result)
    return results


def diff_runs(a: RunRecord, b: RunRecord, *, refresh_rel: float | None
              ) -> tuple[list[GateResult], list[str], list[str]]:
    """A/B per case (A is the reference) of the cases both runs gate; and the gated cases of A
    only and of B only, not compared (the runs selected different tests)."""
    a_cases = {t.case: t for t in a.tests if any(m.gate for m in t.metrics)}
    b_cases = {t.case: t for t in b.tests if any(m.gate for m in t.metrics)}
    results = []
    for case in sorted(a_cases.keys() & b_cases.keys()):
        a_metrics = [m for m in a_cases[case].metrics if m.gate]
        b_metrics = [m for m in b_cases[case].metrics if m.gate]
        results.append(compare_records(a_metrics, b_metrics, case=case, refresh_rel=refresh_rel))
    return results, sorted(a_cases.keys() - b_cases.keys()), sorted(b_cases.keys() - a_cases.keys())


def _exit_code(results: list[GateResult], *, fail_on_improvement: bool, require_baselines: bool) -> int:
    failed = any(r.failed(fail_on_improvement=fail_on_improvement) for r in results)
    missing = require_baselines and any(r.missing_baseline for r in results)
    return 1 if failed or missing else 0


def _verdict_counts(results: list[GateResult]) -> str:
    counts: dict[str, int] = {}
    for c in (c for r in results for c in r.comparisons):
        counts[c.verdict.value] = counts.get(c.verdict.value, 0) + 1
    return ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) or "nothing to compare"


def _check_complete(path: Path, run: RunRecord, allow_partial: bool) -> None:
    """A diff of a partial run passes over the tests it never recorded: an error, unless asked for."""
    if run.partial and not allow_partial:
        raise PartialRunError(f"{path}: {run.describe_status()}; a diff of it says nothing of the tests it "
                              "did not record: rerun it, or pass --allow-partial to compare what it holds"
                              + (" (rlk merge finalizes a run that is not running any more)"
                                 if run.status == "running" else ""))


class PartialRunError(OptionError):
    """``rlk diff`` of a run stopped before its end, without ``--allow-partial``."""


def cmd_diff(args: argparse.Namespace) -> int:
    refresh_rel = parse_refresh_rel(args.refresh_rel)
    new_path, new = _load_run(args.runs[0], args.artifacts)
    _check_complete(new_path, new, args.allow_partial)
    notes: list[str] = []
    if args.a_tag or args.b_tag:
        if len(args.runs) != 1:
            raise OptionError("--a-tag/--b-tag compare two tag selections of ONE run: give one RUN")
        a = parse_selectors(args.a_tag or [], "--a-tag")
        b = parse_selectors(args.b_tag or [], "--b-tag")
        results = diff_tag_selections(new, a, b, refresh_rel=refresh_rel)
        headers = ("metric", f"A:{selector_text(a)}", f"B:{selector_text(b)}", *DIFF_HEADERS[3:])
        notes = unsupported_lines(results)
        print(f"run {new_path} ({new.describe_status()}): A = {selector_text(a)}, B = {selector_text(b)}; "
              "paired by metric and the other tags (A is the reference)")
    elif len(args.runs) == 2:
        b_path, b = _load_run(args.runs[1], args.artifacts)
        _check_complete(b_path, b, args.allow_partial)
        results, only_a, only_b = diff_runs(new, b, refresh_rel=refresh_rel)
        headers = ("metric", "A", "B", *DIFF_HEADERS[3:])
        notes = one_run_only_lines(only_a, only_b)
        print(f"A/B: A = {new_path} ({new.describe_status()}), B = {b_path} ({b.describe_status()})")
    else:
        results = diff_against_baselines(new, args.baselines, refresh_rel=refresh_rel)
        headers = DIFF_HEADERS
        notes = missing_baseline_lines(new, results)
        print(f"run {new_path} ({new.describe_status()}) vs the baselines in {args.baselines}/ "
              f"(platform {new.manifest.platform.tag})")
    print(diff_table(results, headers=headers, wide=args.wide))
    print(_verdict_counts(results))
    for line in notes:
        print(line)
    for line in [*shadow_lines(results), *band_source_lines(results)]:
        print(line)
    return _exit_code(results, fail_on_improvement=args.fail_on_improvement,
                      require_baselines=args.require_baselines)


def _ab_dir(arg: str) -> Path | None:
    """``arg`` as the directory of an A/B run (``rlk e2e run --out DIR``), else None."""
    path = Path(arg)
    if not path.is_dir() or (path / storage.RUN_FILE).exists():
        return None
    from pytest_rlk.e2e.outcome import RESULT_FILE, SPEC_FILE

    return path if (path / RESULT_FILE).exists() or (path / SPEC_FILE).exists() else None


def _report_ab(args: argparse.Namespace, ab_dir: Path) -> int:
    for flag, given in (("--performance", args.performance is not None), ("--no-plots", args.no_plots)):
        if given:
            raise OptionError(f"{flag}: {ab_dir} is an A/B directory (rlk e2e run); its report always draws its "
                              "plots and holds no benchmark timings")
    from pytest_rlk.e2e.outcome import report_ab_dir

    try:
        _, paths = report_ab_dir(ab_dir, args.output)
    except FileNotFoundError as exc:  # an A/B run that did not finish: no ab_result.json
        print(f"rlk: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {paths.markdown} and {paths.html} (one file, plots inlined): A/B report of {ab_dir}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pytest_rlk.report import write_report

    ab_dir = _ab_dir(args.run)
    if ab_dir is not None:
        return _report_ab(args, ab_dir)
    run_path, run = _load_run(args.run, args.artifacts)
    out = args.output or run_path.parent / "report"
    path = write_report(run, out, plots=not args.no_plots)
    print(f"wrote {path} and {path.with_suffix('.html')} (one file, charts inlined)")
    if args.performance is not None:
        from pytest_rlk.performance import collect, update_performance_doc

        cases = collect(run)
        if not cases:
            print(f"rlk: error: --performance: run {run_path} holds no benchmark timings "
                  "(metrics '<impl>_ms' tagged impl=<impl>, see docs/performance.md); "
                  f"{args.performance} not written", file=sys.stderr)
            return 2
        print(f"wrote {update_performance_doc(args.performance, run, cases)} "
              f"(section {run.manifest.platform.tag}, {len(cases)} cases)")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    run_dir = storage.resolve_run_dir(args.run_dir, args.artifacts)
    run = merge_run(run_dir)
    print(f"{run_dir / storage.RUN_FILE}: status {run.status}, {count(len(run.tests), 'test')}")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    """Every setting (kernels/settings.py): effective value, default and source; or docs/settings.md."""
    from pytest_rlk._kernels_guard import import_project_settings

    try:
        settings = import_project_settings()
    except ImportError as exc:
        print(f"rlk: error: {exc}", file=sys.stderr)
        return 2
    if args.markdown:
        print(settings.render_markdown(), end="")
        return 0
    rows = [("variable", "value", "default", "source")]
    rows += [(e.name, e.value, e.default, e.source) for e in settings.effective()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 1 if any(e.value.startswith("INVALID") for e in settings.effective()) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlk")
    parser.add_argument("--artifacts", type=Path, default=None,
                        help="where 'latest' and run ids are looked up (default: .rlk/runs here or in "
                             "the nearest parent directory that has one)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    diff = sub.add_parser("diff", help="compare a run with the baselines, or run A with run B")
    diff.add_argument("runs", nargs="+", metavar="RUN",
                      help="NEW_RUN (vs baselines) or RUN_A RUN_B (A/B); a run dir, run.json, run id or 'latest'")
    diff.add_argument("--baselines", type=Path, default=Path("baselines"), help="default: baselines/")
    diff.add_argument("--refresh-rel", default=None, metavar="X",
                      help="flag values better than baseline by more than max(X*|ref|, abs_floor)")
    diff.add_argument("--fail-on-improvement", action="store_true", help="exit 1 on 'refresh the baseline' too")
    diff.add_argument("--require-baselines", action="store_true", help="exit 1 when a baseline is missing")
    diff.add_argument("--a-tag", action="append", metavar="KEY=VALUE",
                      help="with --b-tag: compare two tag selections of ONE run (e.g. backend=rlk-triton "
                           "vs backend=rl_engine), paired by metric and the other tags; repeatable")
    diff.add_argument("--b-tag", action="append", metavar="KEY=VALUE", help="the B side (see --a-tag)")
    diff.add_argument("--allow-partial", action="store_true",
                      help="compare a run stopped before its end (interrupted, crashed, running) too; "
                           "without it such a run exits 2")
    diff.add_argument("--wide", action="store_true",
                      help="one line per metric as case/metric with the verdicts spelt out (for grep; "
                           "default: metrics grouped under their case, about 100 columns)")
    diff.set_defaults(func=cmd_diff)

    report = sub.add_parser("report", help="write a run's report: report.md and report.html (one self-contained "
                                           "page, charts inlined)")
    report.add_argument("run", metavar="RUN", help="a run dir, run.json, run id or 'latest', or an A/B directory "
                                                   "(rlk e2e run --out DIR)")
    report.add_argument("-o", "--output", type=Path, default=None, help="default: RUN/report/")
    report.add_argument("--performance", type=Path, default=None, metavar="MD",
                        help="also write/update the run platform's roofline section of MD "
                             "(e.g. docs/performance.md); exit 2 if the run holds no benchmark timings")
    report.add_argument("--no-plots", action="store_true",
                        help="Markdown only, no PNGs (for machines without matplotlib)")
    report.set_defaults(func=cmd_report)

    merge = sub.add_parser("merge", help="merge a run's part files into run.json (crashed runs too)")
    merge.add_argument("run_dir", metavar="RUN", help="a run dir, run id or 'latest'")
    merge.set_defaults(func=cmd_merge)

    env = sub.add_parser("env", help="print every setting (environment variable): value, default, source")
    env.add_argument("--markdown", action="store_true", help="print docs/settings.md (the settings table) instead")
    env.set_defaults(func=cmd_env)

    for name in EXTENSION_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # that part is not installed: no subcommands from it
            print(f"rlk: warning: subcommands of {name} not loaded: {exc}", file=sys.stderr)
            continue
        except ImportError as exc:
            print(f"rlk: warning: subcommands of {name} not loaded: {exc}", file=sys.stderr)
            continue
        add = getattr(module, "add_subcommands", None)
        if not callable(add):
            print(f"rlk: warning: {name} has no add_subcommands(subparsers)", file=sys.stderr)
            continue
        add(sub)
    parser.description = f"pytest-rlk runs and the tools around them; commands: {', '.join(sub.choices)}"
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(getattr(args, "runs", ())) > 2:
        parser.error("diff takes NEW_RUN or RUN_A RUN_B")
    try:
        return int(args.func(args))
    except (storage.RlkFileError, OptionError) as exc:
        print(f"rlk: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

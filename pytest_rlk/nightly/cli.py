"""``rlk nightly``, ``rlk verdict`` and ``rlk same`` (added to the ``rlk`` command line).

Exit codes as ``rlk diff``: 0 clean, 1 a problem (regression, failure, absent platform, dead
node...; for ``same``: a difference), 2 usage error or an unreadable file.
"""
from __future__ import annotations

import argparse
import os
from datetime import datetime, timezone
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.options import OptionError, parse_platform, parse_refresh_rel

VERDICT_DIR = "verdict"


def _platforms(text: str | None) -> list[str]:
    if not text:
        return []
    return [parse_platform(p.strip()) or "" for p in text.split(",") if p.strip()]


def _matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def _verdict(sources: list[str | Path], *, expect: list[str], baselines: Path, out: Path, plots: bool,
             refresh_rel: float | None, require_baselines: bool, fail_on_improvement: bool) -> int:
    from pytest_rlk.nightly.verdict import build_verdict, collect_inputs
    from pytest_rlk.nightly.verdict_report import text_lines, write_verdict_report

    inputs = collect_inputs(sources, expect=expect)
    verdict = build_verdict(inputs, baselines, refresh_rel=refresh_rel, require_baselines=require_baselines,
                            fail_on_improvement=fail_on_improvement)
    if plots and _matplotlib_missing():
        print("rlk verdict: matplotlib not importable: report without plots")
        plots = False
    path = write_verdict_report(verdict, inputs, out, plots=plots)
    print("\n".join(text_lines(verdict)))
    print(f"report: {path}")
    return 0 if verdict.passed else 1


def cmd_verdict(args: argparse.Namespace) -> int:
    sources = list(args.sources)
    default_out = Path(sources[0]) / VERDICT_DIR if len(sources) == 1 and Path(sources[0]).is_dir() else Path(VERDICT_DIR)
    return _verdict(sources, expect=_platforms(args.expect), baselines=args.baselines, out=args.output or default_out,
                    plots=not args.no_plots, refresh_rel=parse_refresh_rel(args.refresh_rel),
                    require_baselines=args.require_baselines, fail_on_improvement=args.fail_on_improvement)


def cmd_nightly(args: argparse.Namespace) -> int:
    from pytest_rlk.nightly.plan import load_plan

    plan = load_plan(args.plan)
    suite_root = (args.suite_root or Path.cwd()).resolve()
    out = args.out or suite_root / ".rlk" / "nightly" / f"{plan.name}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    try:
        import ray  # noqa: F401
    except ImportError:
        raise OptionError("rlk nightly runs its node jobs through Ray: pip install 'ray[default]'") from None
    from pytest_rlk.nightly.ray_driver import run_nightly

    nodes = "1 node" if len(plan.nodes) == 1 else f"{len(plan.nodes)} nodes"
    print(f"rlk nightly: plan {args.plan} ({nodes}), results in {out}")
    run_nightly(plan, out, suite_root=suite_root, address=args.address or os.environ.get("RAY_ADDRESS") or "auto")
    baselines = suite_root / plan.baselines
    return _verdict([out], expect=[], baselines=baselines, out=out / VERDICT_DIR, plots=not args.no_plots,
                    refresh_rel=None, require_baselines=plan.require_baselines, fail_on_improvement=False)


def cmd_same(args: argparse.Namespace) -> int:
    from pytest_rlk.same_results import compare_runs, compared_value_count

    runs = []
    for arg in (args.run_a, args.run_b):
        path = storage.resolve_run_file(arg, args.artifacts)
        runs.append((path, storage.load_run(path)))
    (path_a, a), (path_b, b) = runs
    diffs = compare_runs(a, b, rel_tol=args.rel_tol, measured=args.measured)
    for name, path, run in (("A", path_a, a), ("B", path_b, b)):
        workers = sorted({t.worker for t in run.tests})
        print(f"{name}: {path} ({run.status}, {len(run.tests)} tests, "
              f"{compared_value_count(run, args.measured)} values compared, workers {', '.join(workers) or '-'})")
    tol = f"within rel {args.rel_tol:g}" if args.rel_tol else "exactly"
    what = "values" if args.measured else "computed values (timings not compared)"
    if not diffs:
        print(f"same results: {len(a.tests)} tests, the same outcomes and {what} ({tol})")
        return 0
    print(f"{len(diffs)} differences ({what} compared {tol}):")
    for d in diffs:
        print(f"  {d.line()}")
    return 1


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    verdict = sub.add_parser("verdict", help="one gate result and report over runs of several platforms")
    verdict.add_argument("sources", nargs="+", metavar="RUN",
                         help="run dirs / run.json files, or a nightly directory (its plan's platforms are expected)")
    verdict.add_argument("--expect", metavar="P1,P2", default=None,
                         help="platforms that must be present (absent: a failure), e.g. h100,h200")
    verdict.add_argument("--baselines", type=Path, default=Path("baselines"), help="default: baselines/")
    verdict.add_argument("-o", "--output", type=Path, default=None,
                         help="report directory (default: NIGHTLY_DIR/verdict for one directory, else ./verdict)")
    verdict.add_argument("--no-plots", action="store_true", help="Markdown only")
    verdict.add_argument("--refresh-rel", default=None, metavar="X", help="as rlk diff")
    verdict.add_argument("--require-baselines", action="store_true", help="a missing baseline is a failure")
    verdict.add_argument("--fail-on-improvement", action="store_true", help="an improvement is a failure")
    verdict.set_defaults(func=cmd_verdict)

    nightly = sub.add_parser("nightly", help="run a nightly plan over a Ray cluster, then its verdict")
    nightly.add_argument("plan", type=Path, metavar="PLAN", help="the plan (JSON, see docs/nightly.md)")
    nightly.add_argument("--address", default=None,
                         help="Ray cluster address (default: RAY_ADDRESS, else the cluster on this machine)")
    nightly.add_argument("--out", type=Path, default=None, help="default: .rlk/nightly/<plan name>-<UTC time>")
    nightly.add_argument("--suite-root", type=Path, default=None, help="this checkout (default: the current directory)")
    nightly.add_argument("--no-plots", action="store_true", help="verdict report without plots")
    nightly.set_defaults(func=cmd_nightly)

    same = sub.add_parser("same", help="do two runs give the same per-test results? (e.g. sharded vs serial)")
    same.add_argument("run_a", metavar="RUN_A")
    same.add_argument("run_b", metavar="RUN_B")
    same.add_argument("--rel-tol", type=float, default=0.0, metavar="X",
                      help="values may differ by X relative (default 0: exactly equal)")
    same.add_argument("--measured", action="store_true",
                      help="compare timings, throughputs and memory too (give --rel-tol: they vary run to run)")
    same.set_defaults(func=cmd_same)

"""``rlk baselines recommend RUN...``, ``rlk baselines distrust RUN`` (pytest_rlk.history) and
``rlk baselines update RUN`` (pytest_rlk.gate: a recorded run's tests written as
``--rlk-update-baselines`` writes them).

Exit codes: 0 done, 2 runs that cannot make a band (named) or an unreadable file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pytest_rlk import storage
from pytest_rlk.bands import NOISE_RULE
from pytest_rlk.gate import UpdateError, update_from_run
from pytest_rlk.history import HistoryError, distrust, recommend, write_recommendations
from pytest_rlk.options import UPDATE_MODES
from pytest_rlk.schema import Verdict


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def cmd_recommend(args: argparse.Namespace) -> int:
    runs = []
    for arg in args.recommend_runs:
        path = storage.resolve_run_file(arg, args.artifacts)
        runs.append((path, storage.load_run(path)))
    try:
        recs = recommend(runs, args.baselines)
    except HistoryError as exc:
        print(f"rlk baselines recommend: error: {exc}", file=sys.stderr)
        return 2
    platform = runs[0][1].manifest.platform.tag
    print(f"{len(runs)} runs on platform {platform}; rule {NOISE_RULE.describe()} around the mean "
          f"(pytest_rlk.bands.NOISE_RULE); {len(recs)} cases")
    header = ("case/metric", "mean", "sd", "min", "max", "stated band", "recommended band")
    rows = [header]
    for rec in recs:
        for m in rec.metrics:
            rows.append((f"{rec.case}/{m.name}", _fmt(m.stats.mean), _fmt(m.stats.sd), _fmt(m.stats.min),
                         _fmt(m.stats.max), f"{m.stated.describe()} = {_fmt(m.stated.width(m.stats.mean))}",
                         _fmt(m.width)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for rec in recs:
        if rec.dropped:
            print(f"{rec.case}: no longer in its baseline (recorded by none of the runs): {', '.join(rec.dropped)}")
    if args.dry_run:
        print("--dry-run: nothing written")
        return 0
    written = write_recommendations(recs)
    print(f"wrote {len(written)} baselines under {args.baselines}")
    return 0


def cmd_distrust(args: argparse.Namespace) -> int:
    run_id = args.run
    try:
        run_id = storage.load_run(storage.resolve_run_file(args.run, args.artifacts)).manifest.run_id
    except storage.RlkFileError:
        pass  # not a run on this machine: the id as given (the baselines name their runs by id)
    try:
        changed = distrust(run_id, args.baselines)
    except HistoryError as exc:
        print(f"rlk baselines distrust: error: {exc}", file=sys.stderr)
        return 2
    for d in changed:
        print(f"{d.path}: run {run_id} removed" + ("; the case gates in shadow mode" if d.shadow else ""))
    shadow = sum(d.shadow for d in changed)
    print(f"{len(changed)} baselines changed, {shadow} now in shadow mode (fewer than "
          f"{NOISE_RULE.min_runs} trusted runs)")
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    path = storage.resolve_run_file(args.run, args.artifacts)
    run = storage.load_run(path)
    try:
        outcomes = update_from_run(run, args.baselines, mode=args.mode, cases=args.case)
    except UpdateError as exc:
        print(f"rlk baselines update: error: {path}: {exc}", file=sys.stderr)
        return 2
    if run.partial:  # each record is whole; the tests it lacks are left as they are
        print(f"{path}: {run.describe_status()}: only the tests it recorded are written")
    written = [o.result for o in outcomes if o.result.baseline_written]
    for result in written:
        changed = [c.name for c in result.comparisons if c.verdict is not Verdict.PASS]
        print(f"wrote {result.baseline_path}" + (f" ({', '.join(changed)})" if changed else ""))
    print(f"{len(written)} of {len(outcomes)} baselines written (--mode {args.mode}) from run "
          f"{run.manifest.run_id} on {run.manifest.platform.tag}")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("baselines", help="bands from measured noise: recommend from runs, distrust a run; update from a run")
    cmds = parser.add_subparsers(dest="baselines_command", required=True, metavar="ACTION")

    rec = cmds.add_parser("recommend", help=f"per metric mean, sd, min, max and a band from >= "
                          f"{NOISE_RULE.min_runs} runs of the same cases on one platform; written into the baselines")
    rec.add_argument("recommend_runs", nargs="+", metavar="RUN", help="run dirs, run.json files or run ids")
    rec.add_argument("--baselines", type=Path, default=Path("baselines"), help="default: baselines/")
    rec.add_argument("--dry-run", action="store_true", help="print the table, write nothing")
    rec.set_defaults(func=cmd_recommend)

    dis = cmds.add_parser("distrust", help="remove a run's values from every baseline history that holds it")
    dis.add_argument("run", metavar="RUN", help="a run id (as the baselines' histories name it) or a run dir")
    dis.add_argument("--baselines", type=Path, default=Path("baselines"), help="default: baselines/")
    dis.set_defaults(func=cmd_distrust)

    upd = cmds.add_parser("update", help="write baselines from a recorded run's tests, as --rlk-update-baselines "
                          "does, without running them again")
    upd.add_argument("run", metavar="RUN", help="a run dir, run.json file or run id")
    upd.add_argument("--mode", choices=UPDATE_MODES, default="failed",
                     help="failed (default): only baselines that fail or are out of date, keeping the references "
                          "that pass; all: every gated test's baseline")
    upd.add_argument("--case", action="append", default=[], metavar="GLOB",
                     help="a glob on the case or the node id (repeatable); default: every gated test of the run")
    upd.add_argument("--baselines", type=Path, default=Path("baselines"), help="default: baselines/")
    upd.set_defaults(func=cmd_update)

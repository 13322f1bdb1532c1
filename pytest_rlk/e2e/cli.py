"""`rlk e2e plan SPEC` (dry run: both arms' exact commands) and `rlk e2e run SPEC`.

SPEC is a spec file or the case name of a shipped spec (`rlk e2e list` shows them). Both commands
follow the spec's engine: vime specs go to `ab` (own Ray head, `--vime-root` required), TRL specs
to `engines.trl_engine` (two subprocesses of this checkout; vime-only options are refused).
Exit codes: 0 plan printed / A/B passed, 1 A/B failed (a gate or an arm), 2 bad spec or usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pytest_rlk.e2e.ab import ABRunError, plan_text, run_ab
from pytest_rlk.e2e.launcher import LaunchError
from pytest_rlk.e2e.spec import (
    ABSpec, ArmMismatchError, SpecError, load_spec, matrix_spec_paths, resolve_spec_name,
)
from pytest_rlk.e2e.vime_engine import RUN_DIR_PLACEHOLDER

# The checkout (or installed tree) that holds pytest_rlk and kernels: the TRL arms run from here.
REPO_ROOT = Path(__file__).resolve().parents[2]

# Options of `rlk e2e run` that only the vime engine uses, with their vime defaults.
VIME_RUN_DEFAULTS = {"vime_root": None, "mode": "ray", "entry": None, "python": "python3", "ray_bin": "ray",
                     "platform": None}


def _fail(command: str, message: str, code: int) -> int:
    kind = "error" if code == 2 else "FAILED"
    print(f"rlk e2e {command}: {kind}: {message}", file=sys.stderr)
    return code


def cmd_plan(args: argparse.Namespace) -> int:
    from pytest_rlk.e2e.engines import trl_engine

    try:
        path = resolve_spec_name(args.spec)
        spec = load_spec(path)
        if spec.engine == "trl":
            if args.vime_root:
                raise SpecError(f"{spec.case}: engine 'trl' does not use --vime-root")
            print(trl_engine.plan_text(path, Path(RUN_DIR_PLACEHOLDER), repo_root=REPO_ROOT))
        else:
            print(plan_text(spec, vime_root=args.vime_root or "${VIME_ROOT}"))
    except (SpecError, ArmMismatchError, ValueError) as exc:
        return _fail("plan", str(exc), 2)
    return 0


def _vime_only_options_given(args: argparse.Namespace) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name in VIME_RUN_DEFAULTS if getattr(args, name) is not None]


def _run_vime(spec: ABSpec, args: argparse.Namespace, out: Path) -> int:
    if args.vime_root is None:
        return _fail("run", f"{spec.case}: engine 'vime' needs --vime-root (the vime checkout)", 2)
    options = {name: default if getattr(args, name) is None else getattr(args, name)
               for name, default in VIME_RUN_DEFAULTS.items()}
    try:
        run = run_ab(spec, vime_root=Path(args.vime_root).resolve(), out_dir=out.resolve(), mode=options["mode"],
                     entry=options["entry"], python=options["python"], ray_bin=options["ray_bin"],
                     platform=options["platform"])
    except (ABRunError, LaunchError) as exc:
        return _fail("run", str(exc), 1)
    print(run.verdict.summary() if run.verdict else "no verdict")
    print(f"report: {run.report.markdown}")
    return 0 if run.passed else 1


def _run_trl(path: Path, spec: ABSpec, args: argparse.Namespace, out: Path) -> int:
    from pytest_rlk.e2e.engines import trl_engine

    given = _vime_only_options_given(args)
    if given:
        return _fail("run", f"{spec.case}: engine 'trl' does not take {', '.join(given)} (vime-only options)", 2)
    try:
        trl_engine.TrlArmConfig.from_spec(spec, where=str(path))
    except ValueError as exc:
        return _fail("run", str(exc), 2)
    try:
        result = trl_engine.run_and_report(path.resolve(), out.resolve(), repo_root=REPO_ROOT)
    except (RuntimeError, OSError, ValueError) as exc:  # an arm failed, timed out or wrote no metrics
        return _fail("run", f"{spec.case}: {exc}; artifacts kept in {out}", 1)
    print(result.verdict.summary())
    print(f"report: {result.report.markdown}")
    return 0 if result.passed else 1


def cmd_run(args: argparse.Namespace) -> int:
    try:
        path = resolve_spec_name(args.spec)
        spec = load_spec(path)
    except (SpecError, ArmMismatchError) as exc:
        return _fail("run", str(exc), 2)
    out = Path(args.out) if args.out else Path(".rlk/e2e") / spec.case
    try:
        if spec.engine == "trl":
            return _run_trl(path, spec, args, out)
        return _run_vime(spec, args, out)
    except (SpecError, ArmMismatchError) as exc:
        return _fail("run", str(exc), 2)


def cmd_list(_args: argparse.Namespace) -> int:
    for path in matrix_spec_paths():
        spec = load_spec(path)
        print(f"{spec.case:40s} {spec.engine:5s} {spec.purpose:15s} {' '.join(spec.markers)}")
    return 0


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    e2e = subparsers.add_parser("e2e", help="end-to-end A/B runs (vime, TRL)")
    sub = e2e.add_subparsers(dest="e2e_command", required=True)

    plan = sub.add_parser("plan", help="print both arms' exact commands (dry run)")
    plan.add_argument("spec", metavar="SPEC", help="spec file or shipped case name")
    plan.add_argument("--vime-root", help="vime checkout to show in the commands (vime specs; default: ${VIME_ROOT})")
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser("run", help="run both arms, gate, and write the report (vime or TRL, from the spec)")
    run.add_argument("spec", metavar="SPEC", help="spec file or shipped case name")
    run.add_argument("--out", help="artifacts directory (default .rlk/e2e/<case>)")
    vime = run.add_argument_group("vime engine only (refused for TRL specs)")
    vime.add_argument("--vime-root", help="vime checkout (the fork, for the kernel switches); required for vime")
    vime.add_argument("--mode", choices=("ray", "local"),
                      help="ray: own Ray head + ray job submit (default); local: plain subprocess")
    vime.add_argument("--entry", help="script to run instead of the spec's train.py (tests: the stand-in)")
    vime.add_argument("--python", help="interpreter for train.py inside the job (default python3)")
    vime.add_argument("--ray-bin", help="the `ray` executable (default ray; needs ray[default] for jobs)")
    vime.add_argument("--platform", help="platform tag for the verdict (default: the spec's)")
    run.set_defaults(func=cmd_run)

    lst = sub.add_parser("list", help="the shipped specs")
    lst.set_defaults(func=cmd_list)

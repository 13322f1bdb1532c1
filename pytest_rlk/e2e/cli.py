"""`rlk e2e plan SPEC` (dry run: both arms' exact commands) and `rlk e2e run SPEC --vime-root DIR`.

SPEC is a spec file or the case name of a shipped spec (`rlk e2e list` shows them).
Exit codes: 0 plan printed / A/B passed, 1 A/B failed (a gate or an arm), 2 bad spec or usage.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from pytest_rlk.e2e.ab import ABRunError, plan_text, run_ab
from pytest_rlk.e2e.launcher import LaunchError
from pytest_rlk.e2e.spec import (
    ArmMismatchError, SpecError, load_spec, matrix_spec_paths, resolve_spec_name,
)
from pytest_rlk.e2e.vime_engine import RUN_DIR_PLACEHOLDER


def _trl_plan_text(spec_path: Path) -> str:
    from pytest_rlk.e2e.engines import trl_engine

    spec = load_spec(spec_path)
    commands = trl_engine.arm_commands(spec_path, Path(RUN_DIR_PLACEHOLDER))
    lines = [f"# A/B plan: {spec.case} (engine trl, {spec.purpose}): {spec.description}",
             "# arms differ only by the kernel switch: env "
             + " ".join(f"{k}={v}" for k, v in spec.kernel_switch.env.items())]
    for role, cmd in commands.items():
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(cmd.full_env.items()))
        lines += [f"# {role} arm {cmd.label!r}", f"env {env} {shlex.join(cmd.argv)}"]
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        path = resolve_spec_name(args.spec)
        spec = load_spec(path)
        if spec.engine == "trl":
            print(_trl_plan_text(path))
        else:
            print(plan_text(spec, vime_root=args.vime_root or "${VIME_ROOT}"))
    except (SpecError, ArmMismatchError) as exc:
        print(f"rlk e2e plan: error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(resolve_spec_name(args.spec))
        out = Path(args.out) if args.out else Path(".rlk/e2e") / spec.case
        run = run_ab(spec, vime_root=Path(args.vime_root).resolve(), out_dir=out.resolve(), mode=args.mode,
                     entry=args.entry, python=args.python, ray_bin=args.ray_bin, platform=args.platform)
    except (SpecError, ArmMismatchError) as exc:
        print(f"rlk e2e run: error: {exc}", file=sys.stderr)
        return 2
    except (ABRunError, LaunchError) as exc:
        print(f"rlk e2e run: FAILED: {exc}", file=sys.stderr)
        return 1
    print(run.verdict.summary() if run.verdict else "no verdict")
    print(f"report: {run.report.markdown}")
    return 0 if run.passed else 1


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
    plan.add_argument("--vime-root", help="vime checkout to show in the commands (default: ${VIME_ROOT})")
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser("run", help="run both arms, gate, and write the report (vime engine)")
    run.add_argument("spec", metavar="SPEC", help="spec file or shipped case name")
    run.add_argument("--vime-root", required=True, help="vime checkout (the fork, for the kernel switches)")
    run.add_argument("--out", help="artifacts directory (default .rlk/e2e/<case>)")
    run.add_argument("--mode", choices=("ray", "local"), default="ray",
                     help="ray: own Ray head + ray job submit (default); local: plain subprocess")
    run.add_argument("--entry", help="script to run instead of the spec's train.py (tests: the stand-in)")
    run.add_argument("--python", default="python3", help="interpreter for train.py inside the job")
    run.add_argument("--ray-bin", default="ray", help="the `ray` executable (needs ray[default] for jobs)")
    run.add_argument("--platform", help="platform tag for the verdict (default: the spec's)")
    run.set_defaults(func=cmd_run)

    lst = sub.add_parser("list", help="the shipped specs")
    lst.set_defaults(func=cmd_list)

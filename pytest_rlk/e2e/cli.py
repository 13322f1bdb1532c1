"""`rlk e2e list`, `rlk e2e plan SPEC` (dry run: both arms' exact commands) and `rlk e2e run SPEC`.

SPEC is a spec file or the case name of a shipped spec (`rlk e2e list` shows them). The spec's
engine is looked up by name (`pytest_rlk.e2e.engines`); each engine's own options (`--vime-root`
...) are listed under its name and refused for a spec of another engine. Usage errors (a bad spec,
an option that cannot work, an `--out` that holds an earlier run) come before anything runs.
Exit codes: 0 plan printed / A/B passed, 1 A/B failed (a gate or an arm), 2 bad spec or usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pytest_rlk.e2e.arms import ArmMismatchError
from pytest_rlk.e2e.engine import EngineOption
from pytest_rlk.e2e.engines import engine_names, get_engine
from pytest_rlk.e2e.launcher import LaunchError
from pytest_rlk.e2e.outcome import ABRunError
from pytest_rlk.e2e.progress import LineProgress
from pytest_rlk.e2e.runner import plan_text, run_ab
from pytest_rlk.e2e.spec import ABSpec, SpecError, load_spec, matrix_spec_paths, resolve_spec_name

DEFAULT_OUT = Path(".rlk/e2e")


def _fail(command: str, message: str, code: int) -> int:
    kind = "error" if code == 2 else "FAILED"
    print(f"rlk e2e {command}: {kind}: {message}", file=sys.stderr)
    return code


def _engine_options() -> dict[str, tuple[EngineOption, list[str]]]:
    """Every engine's options by dest, with the engines that take each."""
    found: dict[str, tuple[EngineOption, list[str]]] = {}
    for name in engine_names():
        for option in get_engine(name).options:
            found.setdefault(option.dest, (option, []))[1].append(name)
    return found


def _options_for(spec: ABSpec, args: argparse.Namespace) -> dict[str, Any]:
    """The options given for the spec's engine; one of another engine is a usage error."""
    given = {dest: getattr(args, dest) for dest in _engine_options() if getattr(args, dest, None) is not None}
    foreign = {dest: engines for dest, (_, engines) in _engine_options().items()
               if dest in given and spec.engine not in engines}
    if foreign:
        flags = ", ".join(_engine_options()[dest][0].flag for dest in foreign)
        owners = sorted({e for engines in foreign.values() for e in engines})
        raise SpecError(f"{spec.case}: engine {spec.engine!r} does not take {flags} (options of engine "
                        f"{', '.join(owners)})")
    return given


def _load(args: argparse.Namespace) -> ABSpec:
    return load_spec(resolve_spec_name(args.spec))


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        spec = _load(args)
        print(plan_text(spec, _options_for(spec, args), run_dir=str(Path(args.out).resolve()) if args.out else None))
    except (SpecError, ArmMismatchError) as exc:
        return _fail("plan", str(exc), 2)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    try:
        spec = _load(args)
        options = _options_for(spec, args)
    except (SpecError, ArmMismatchError) as exc:
        return _fail("run", str(exc), 2)
    out = Path(args.out) if args.out else DEFAULT_OUT / spec.case
    try:
        run = run_ab(spec, out, options=options, overwrite=args.overwrite, progress=LineProgress())
    except (SpecError, ArmMismatchError) as exc:
        return _fail("run", str(exc), 2)
    except (ABRunError, LaunchError) as exc:
        return _fail("run", f"{spec.case}: {exc}", 1)
    print(run.verdict.summary() if run.verdict else "no verdict")
    print(f"report: {run.report.markdown}")
    return 0 if run.passed else 1


def _one_line(text: str, width: int = 100) -> str:
    first = text.split("; ")[0].rstrip(".")
    return first if len(first) <= width else first[: first.rfind(" ", 0, width - 3)] + " ..."


def cmd_list(_args: argparse.Namespace) -> int:
    specs = [load_spec(path) for path in matrix_spec_paths()]
    width = max(len(spec.case) for spec in specs)
    for spec in specs:
        print(f"{spec.case:{width}s}  {spec.engine:5s} {spec.purpose:14s} {_one_line(spec.description)}")
    print(f"\n{len(specs)} specs: `rlk e2e plan CASE` prints a case's commands, `rlk e2e run CASE` runs it")
    return 0


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option, engines in _engine_options().values():
        title = f"engine {', '.join(engines)} only (refused for other engines' specs)"
        group = groups.setdefault(title, parser.add_argument_group(title))
        group.add_argument(option.flag, dest=option.dest, choices=option.choices, default=None, help=option.help)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    e2e = subparsers.add_parser("e2e", help=f"end-to-end A/B runs ({', '.join(engine_names())})")
    sub = e2e.add_subparsers(dest="e2e_command", required=True)

    plan = sub.add_parser("plan", help="print both arms' exact commands (dry run)")
    plan.add_argument("spec", metavar="SPEC", help="spec file or shipped case name")
    plan.add_argument("--out", help="the run directory to show in the commands (default: ${RLK_RUN_DIR})")
    _add_engine_options(plan)
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser("run", help="run both arms, gate, and write the report")
    run.add_argument("spec", metavar="SPEC", help="spec file or shipped case name")
    run.add_argument("--out", help=f"artifacts directory (default {DEFAULT_OUT}/<case>); must be new or empty")
    run.add_argument("--overwrite", action="store_true",
                     help="replace --out when it holds an earlier `rlk e2e run` output")
    _add_engine_options(run)
    run.set_defaults(func=cmd_run)

    lst = sub.add_parser("list", help="the shipped specs, one line each")
    lst.set_defaults(func=cmd_list)

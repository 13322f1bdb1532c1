"""``rlk prove [--tier op,module] [--fault NAME] [--size X] [--graded]``: run each registered fault
against its real tests and print, per gate and fault, whether it was caught and by what margin.

Exit codes: 0 every fault at its nominal size caught and every gate family served here caught at
least one; 1 a fault not caught, or a family with no caught fault; 2 usage errors, or runs that
prove nothing (a case missing or skipped, the clean run failing).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pytest_rlk.prove.registry import CASES, FAMILIES, REGISTRY
from pytest_rlk.prove.runner import ProveError, Row, prove, smallest_caught

DEFAULT_TIERS = "op,module"
GATES = {
    "op": "op: tolerance table",
    "module": "module: baselines + test tolerance",
    "op-gpu": "op: GPU baselines",
}


def _margin(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}x band"


def table(rows: list[Row]) -> list[str]:
    out = [("gate", "family", "fault", "size", "caught", "margin", "first failure")]
    for r in rows:
        if r.result is None:
            out.append((GATES.get(r.tier, r.tier), r.fault.family, r.fault.name, f"{r.size:g}",
                        f"skipped ({r.skip_reason})", "", ""))
            continue
        caught = "CAUGHT" if r.result.caught else "NOT CAUGHT"
        out.append((GATES.get(r.tier, r.tier), r.fault.family, r.fault.name,
                    f"{r.size:g}" + ("" if r.nominal else " (graded)"), caught, _margin(r.result.margin),
                    r.result.detail))
    widths = [max(len(row[i]) for row in out) for i in range(6)]
    return ["  ".join(c.ljust(w) for c, w in zip(row[:6], widths)) + "  " + row[6] for row in out]


def _root(arg: Path | None) -> Path:
    if arg is not None:
        return arg
    here = Path(__file__).resolve().parents[2]
    if (here / "suites").is_dir():
        return here
    return Path.cwd()


def cmd_prove(args: argparse.Namespace) -> int:
    tiers = [t for t in args.tier.split(",") if t]
    known = sorted({tier for tier, _ in CASES})
    bad = [t for t in tiers if t not in known]
    if bad:
        print(f"rlk prove: error: --tier {','.join(bad)}: not a tier with cases (known: {', '.join(known)})",
              file=sys.stderr)
        return 2
    unknown = [f for f in args.fault or [] if f not in REGISTRY]
    if unknown:
        print(f"rlk prove: error: --fault {', '.join(unknown)}: not registered (known: {', '.join(REGISTRY)})",
              file=sys.stderr)
        return 2
    faults = [REGISTRY[f] for f in args.fault] if args.fault else list(REGISTRY.values())
    if args.size is not None and not args.fault:
        print("rlk prove: error: --size needs --fault (the faults whose size it sets)", file=sys.stderr)
        return 2
    sizes = {f.name: args.size for f in faults} if args.size is not None else None
    try:
        clean, rows = prove(faults, tiers, _root(args.root), sizes=sizes, graded=args.graded, keep=args.keep)
    except ProveError as exc:
        print(f"rlk prove: error: {exc}", file=sys.stderr)
        return 2
    for tier, result in clean.items():
        print(f"clean run (no fault), {GATES.get(tier, tier)}: passed; its closest error to a band: "
              f"{_margin(result.margin)}")
    for line in table(rows):
        print(line)
    problems = [f"{r.fault.name}={r.size:g} not caught by {GATES.get(r.tier, r.tier)} "
                f"(margin {_margin(r.result.margin)})"
                for r in rows if r.nominal and r.result is not None and not r.result.caught]
    served = {r.fault.family for r in rows if r.result is not None}
    caught = {r.fault.family for r in rows if r.result is not None and r.result.caught}
    if not args.fault:
        problems += [f"gate family {fam} ({FAMILIES[fam]}): no fault caught" for fam in sorted(served - caught)]
    unserved = [f for f in FAMILIES if f not in served]
    print(f"families proven: {', '.join(f for f in FAMILIES if f in caught) or 'none'}"
          + (f"; not served here: {', '.join(unserved)}" if unserved else ""))
    if args.graded:
        print("smallest detectable effect (smallest size caught):")
        for (name, tier), size in sorted(smallest_caught(rows).items()):
            print(f"  {GATES.get(tier, tier)}: {name} ({REGISTRY[name].what}): {size:g}")
    for p in problems:
        print(f"rlk prove: FAILED: {p}")
    return 1 if problems else 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prove", help="inject each registered fault into real tests: which gates catch it, "
                                     "by what margin")
    p.add_argument("--tier", default=DEFAULT_TIERS,
                   help=f"case tiers, comma-separated (default {DEFAULT_TIERS}; op-gpu: the GPU benchmarks' "
                        "time and memory gates)")
    p.add_argument("--fault", action="append", metavar="NAME", help="only this fault (repeatable); default: all")
    p.add_argument("--size", type=float, default=None,
                   help="with --fault: run it at this size instead of its nominal one")
    p.add_argument("--graded", action="store_true", help="also each fault's ladder of sizes: the smallest caught")
    p.add_argument("--root", type=Path, default=None, help="the checkout whose suites/ run (default: this one)")
    p.add_argument("--keep", type=Path, default=None, help="write the runs' artifacts here (default: a temp dir)")
    p.set_defaults(func=cmd_prove)

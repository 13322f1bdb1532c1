"""The power of an A/B spec's gates, measured: A/A false alarms and injected faults caught.

    python tools/e2e_power.py SPEC --out DIR [--aa N] [--fault NAME=SIZE[,SIZE...]]... [--lanes replay,live]
    python tools/e2e_power.py SPEC --regate DIR      # the table again, from the arms DIR holds

One ``rlk e2e run`` of SPEC (baseline vs kernels, each lane) with extra arms beside the pair:

- N A/A reruns of the kernel arm. In the live lane rerun i draws other rollouts
  (``seeds.rollout_seed`` + i: other prompts, other samples, the same model), so the A/A verdict
  tests the bands against sampling noise: past its first steps a correct kernel's run is as far from
  the baseline's as another seed's. In the replay lane the rollouts are the recorded ones, so a
  rerun measures the run-to-run noise of training alone.
- in the live lane, N reruns of the baseline arm with the same seeds as the kernel A/A reruns: the
  seed-to-seed spread of the baseline's reward rise (first 4 rollouts against the last 4).
- one kernel arm per injected fault and size (``pytest_rlk.prove.faults``, the registry ``rlk prove``
  uses, chosen by dotted path with ``RLK_FAULT=NAME=SIZE`` in the arm's environment).

Then, per lane: false alarms (the pair's own verdict, each A/A rerun gated against the kernel arm:
every one must pass) and detection (each fault arm gated against the baseline: the gates that fail
and the margin of the most-exceeded one: distance from the reference over the band's width, > 1
fails). Every arm saves its series as it ends, so ``--regate DIR`` rebuilds the table of a run that
died part-way from the arms it finished.

Prints a Markdown table and writes ``DIR/power.json`` and ``DIR/power.md``. Exit 0 when every A/A
comparison passes; the faults' rows are findings (the smallest size a gate catches), not pass/fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytest_rlk.e2e.outcome import ABRun, ABRunError, ExtraArm, gate_arms, load_ab_run  # noqa: E402
from pytest_rlk.e2e.progress import LineProgress  # noqa: E402
from pytest_rlk.e2e.runner import run_ab  # noqa: E402
from pytest_rlk.e2e.spec import SPECS_DIR, ABSpec, load_spec  # noqa: E402
from pytest_rlk.prove import faults  # noqa: E402
from pytest_rlk.schema import Verdict  # noqa: E402

# sizes as pytest_rlk.prove.faults reads them: logp_grad_scale_even multiplies every other token's
# gradient by 1 + size, logp_grad_sign_even=1 turns it around, logp_slowdown adds size x the op's work
DEFAULT_FAULTS = {"logp_bias": [1e-3, 3e-3, 1e-2], "logp_grad_scale_even": [-0.1, -0.3, -0.5],
                  "logp_grad_sign_even": [1.0], "logp_slowdown": [0.2, 1.0], "logp_extra_buffer": [1.0]}
# the lanes where each fault is looked for (a speed or memory fault has no replay-lane gate)
FAULT_LANES = {"logp_bias": ("live",), "logp_grad_scale_even": ("replay", "live"),
               "logp_grad_sign_even": ("replay", "live"), "logp_slowdown": ("live",), "logp_extra_buffer": ("live",)}


def fault_key(name: str, size: float) -> str:
    return f"fault_{name}_{size:g}".replace(".", "p").replace("-", "m")


def margins(verdict) -> tuple[list[str], float]:
    """(failed metric names, the largest |observed - ref| / band width of a compared metric on
    its failing side; an improvement counts 0)."""
    failed, worst = [], 0.0
    for c in verdict.gate.comparisons:
        if c.verdict is Verdict.REGRESSION:
            failed.append(c.name)
        if c.delta is not None and c.band_width and c.verdict is not Verdict.IMPROVED:
            worst = max(worst, abs(c.delta) / c.band_width)
    return failed, worst


def reward_rise(series: dict[str, list[float]], n: int = 4) -> float | None:
    """Mean raw_reward of the last n rollouts minus that of the first n."""
    values = series.get("raw_reward") or []
    if len(values) < 2 * n:
        return None
    return sum(values[-n:]) / n - sum(values[:n]) / n


def plan_extras(spec: ABSpec, aa: int, chosen: dict[str, list[float]]) -> list[ExtraArm]:
    extras = []
    for lane in spec.lanes:
        for i in range(1, aa + 1):
            offset = i if lane == "live" else 0
            extras.append(ExtraArm(f"aa{i}", spec.arm_variant("kernels", f"A/A rerun {i}", rollout_seed_offset=offset),
                                   lane=lane))
            if lane == "live":
                extras.append(ExtraArm(f"seed{i}", spec.arm_variant("baseline", f"rollout seed +{i}",
                                                                    rollout_seed_offset=i), role="baseline", lane=lane))
        for name, sizes in chosen.items():
            if lane not in FAULT_LANES[name]:
                continue
            for size in sizes:
                extras.append(ExtraArm(fault_key(name, size), spec.arm_variant(
                    "kernels", f"fault {name} {size:g}", env=faults.arm_env(name, size)), lane=lane))
    return extras


def power_rows(spec: ABSpec, run: ABRun, aa: int, chosen: dict[str, list[float]]) -> tuple[list[dict], list[dict]]:
    """(gate rows, reward-rise rows) of the arms `run` holds; an arm missing from it is a row
    saying so (`passed` None)."""
    rows, rises = [], []

    def gated(lane: str, arm: str, kind: str, key: str, against: str, size: str = "") -> None:
        row = {"lane": lane, "arm": arm, "kind": kind, "size": size, "passed": None,
               "failed": ["(arm did not finish)"], "worst_margin": 0.0}
        if (lane, key) in run.arms and (lane, against) in run.arms:
            verdict = gate_arms(run, lane, kernels_key=key, baseline_key=against)
            row["passed"] = verdict.passed
            row["failed"], row["worst_margin"] = margins(verdict)
        rows.append(row)

    for lane in spec.lanes:
        gated(lane, "kernels vs baseline (the A/B)", "A/A", "kernels", "baseline")
        for i in range(1, aa + 1):
            gated(lane, f"A/A rerun {i} vs kernels", "A/A", f"aa{i}", "kernels")
        for name, sizes in chosen.items():
            for size in sizes if lane in FAULT_LANES[name] else ():
                gated(lane, name, "fault", fault_key(name, size), "baseline", f"{size:g}")
        if lane == "live":
            keys = ["baseline", "kernels", *(f"seed{i}" for i in range(1, aa + 1)), *(f"aa{i}" for i in range(1, aa + 1))]
            rises += [{"lane": lane, "arm": run.arms[(lane, k)].label, "rise": reward_rise(run.arms[(lane, k)].series)}
                      for k in keys if (lane, k) in run.arms]
    return rows, rises


def table(rows: list[dict], rises: list[dict]) -> str:
    lines = ["| lane | arm | size | verdict | failed gates | largest distance / band |", "|---|---|---|---|---|---|"]
    for row in rows:
        if row["passed"] is None:
            verdict = "not run"
        elif row["kind"] == "A/A":
            verdict = "pass" if row["passed"] else "FAIL"
        else:
            verdict = "caught" if not row["passed"] else "not caught"
        shown = ", ".join(row["failed"][:6]) + (f" (+{len(row['failed']) - 6})" if len(row["failed"]) > 6 else "")
        lines.append(f"| {row['lane']} | {row['arm']} | {row['size']} | {verdict} | {shown} | {row['worst_margin']:.2f} |")
    if rises:
        lines += ["", "| arm (live lane) | raw_reward rise (last 4 - first 4 rollouts) |", "|---|---|"]
        lines += [f"| {r['arm']} | {'-' if r['rise'] is None else format(r['rise'], '.3f')} |" for r in rises]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", help="a spec file or a shipped case name")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="run the arms into this folder")
    where.add_argument("--regate", type=Path, metavar="DIR", help="gate the arms an earlier run left in DIR")
    parser.add_argument("--aa", type=int, default=5, help="A/A reruns of the kernel arm (default 5)")
    parser.add_argument("--fault", action="append", default=[], metavar="NAME=SIZE[,SIZE]",
                        help=f"a fault and its sizes (default: {DEFAULT_FAULTS})")
    parser.add_argument("--lanes", default=None, help="comma-separated lanes to run (default: the spec's)")
    ns = parser.parse_args(argv)
    spec = load_spec(ns.spec if Path(ns.spec).is_file() else SPECS_DIR / f"{ns.spec}.json")
    if ns.lanes:
        raw = spec.model_dump(mode="json")
        raw["lanes"] = ns.lanes.split(",")
        spec = ABSpec.model_validate(raw)
    chosen = DEFAULT_FAULTS
    if ns.fault:
        chosen = {}
        for item in ns.fault:
            name, _, sizes = item.partition("=")
            if name not in FAULT_LANES or not sizes:
                parser.error(f"--fault {item!r}: NAME=SIZE[,SIZE] with NAME one of {sorted(FAULT_LANES)}")
            chosen[name] = [float(x) for x in sizes.split(",")]

    if ns.regate is not None:
        out = ns.regate
        run = dataclasses.replace(load_ab_run(out, allow_partial=True), spec=spec)  # gated with SPEC's bands
    else:
        out = ns.out
        try:
            run = run_ab(spec, out, extra_arms=plan_extras(spec, ns.aa, chosen), overwrite=True,
                         progress=LineProgress(sys.stdout))
        except ABRunError as exc:
            run = exc.run
            print(f"e2e_power: {exc}".splitlines()[0], file=sys.stderr)
    rows, rises = power_rows(spec, run, ns.aa, chosen)
    text = table(rows, rises)
    print(f"\n# gate power: {spec.case} on {run.platform}\n\n{text}")
    (out / "power.json").write_text(json.dumps({"case": spec.case, "platform": run.platform, "rows": rows,
                                                "reward_rise": rises}, indent=1))
    (out / "power.md").write_text(text + "\n")
    return 1 if any(r["kind"] == "A/A" and r["passed"] is not True for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The power of an A/B spec's gates, measured: A/A false alarms and injected faults caught.

    python tools/e2e_power.py SPEC --out DIR [--aa N] [--fault NAME=SIZE[,SIZE...]]... [--lanes replay,live]

One ``rlk e2e run`` of SPEC (baseline vs kernels, each lane) with extra kernel-role arms beside
the pair: N reruns of the kernel arm unchanged (the A/A arms) and one arm per injected fault and
size (``pytest_rlk.prove.faults``, the fault registry ``rlk prove`` uses, chosen by dotted path with
``RLK_FAULT=NAME=SIZE`` in the arm's environment). Then, per lane:

- false alarms: the pair's own verdict, and each A/A rerun gated against the kernel arm (kernels
  vs kernels, another run): every one must pass;
- detection: each fault arm gated against the baseline: which gated metrics fail, and the margin
  of the most-exceeded one (observed distance from the reference over the band's width; > 1 fails).

Prints a Markdown table and writes ``DIR/power.json``. Exit 0 when every A/A comparison passes;
the faults' rows are findings (the smallest size a gate catches), not pass/fail.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytest_rlk.e2e.gates import gate_lane  # noqa: E402
from pytest_rlk.e2e.outcome import ABRun, ABRunError, ExtraArm, gate_arms  # noqa: E402
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


def variant(spec: ABSpec, label: str, env: dict[str, str]) -> ABSpec:
    raw = spec.model_dump(mode="json")
    raw["arms"]["kernels"] = {"label": f"{spec.arms.kernels.label} ({label})", "env": env}
    return ABSpec.model_validate(raw)


def fault_key(name: str, size: float) -> str:
    return f"fault_{name}_{size:g}".replace(".", "p").replace("-", "m")


def margins(verdict) -> tuple[list[str], float]:
    """(failed metric names, the largest |observed - ref| / band width of any compared metric)."""
    failed, worst = [], 0.0
    for c in verdict.gate.comparisons:
        if c.verdict is Verdict.REGRESSION:
            failed.append(c.name)
        if c.delta is not None and c.band_width:
            worst = max(worst, abs(c.delta) / c.band_width)
    return failed, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", help="a spec file or a shipped case name")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--aa", type=int, default=4, help="A/A reruns of the kernel arm (default 4)")
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

    extras, rows = [], []
    for lane in spec.lanes:
        for i in range(ns.aa):
            extras.append(ExtraArm(f"aa{i + 1}", variant(spec, f"A/A rerun {i + 1}", {}), lane=lane))
        for name, sizes in chosen.items():
            if lane not in FAULT_LANES[name]:
                continue
            for size in sizes:
                env = {"VIME_RL_KERNEL_BACKEND": faults.DOTTED_PATH, faults.FAULT_ENV: f"{name}={size!r}"}
                extras.append(ExtraArm(fault_key(name, size), variant(spec, f"fault {name} {size:g}", env), lane=lane))
    try:
        run: ABRun = run_ab(spec, ns.out, extra_arms=extras, overwrite=True, progress=LineProgress(sys.stdout))
    except ABRunError as exc:
        run = exc.run
        print(f"e2e_power: {exc}".splitlines()[0], file=sys.stderr)
    false_alarms = 0
    for lane in spec.lanes:
        pair = gate_arms(run, lane)
        failed, worst = margins(pair)
        rows.append({"lane": lane, "arm": "kernels vs baseline (the A/B)", "kind": "A/A", "size": "",
                     "passed": pair.passed, "failed": failed, "worst_margin": worst})
        false_alarms += not pair.passed
        kern = run.arms[(lane, "kernels")]
        for i in range(ns.aa):
            other = run.arms[(lane, f"aa{i + 1}")]
            verdict = gate_lane(kern.series, other.series, case=spec.case, platform=run.platform, lane=lane,
                                skip_warmup=spec.window.skip_warmup_rollouts, gates=spec.gates,
                                baseline_label=kern.label, kernels_label=other.label, bands=spec.bands)
            failed, worst = margins(verdict)
            rows.append({"lane": lane, "arm": f"A/A rerun {i + 1} vs kernels", "kind": "A/A", "size": "",
                         "passed": verdict.passed, "failed": failed, "worst_margin": worst})
            false_alarms += not verdict.passed
        for name, sizes in chosen.items():
            if lane not in FAULT_LANES[name]:
                continue
            for size in sizes:
                verdict = gate_arms(run, lane, kernels_key=fault_key(name, size))
                failed, worst = margins(verdict)
                rows.append({"lane": lane, "arm": name, "kind": "fault", "size": f"{size:g}",
                             "passed": verdict.passed, "failed": failed, "worst_margin": worst})
    lines = ["| lane | arm | size | verdict | failed gates | largest distance / band |", "|---|---|---|---|---|---|"]
    for row in rows:
        verdict = ("pass" if row["passed"] else "FAIL") if row["kind"] == "A/A" else \
            ("caught" if not row["passed"] else "not caught")
        shown = ", ".join(row["failed"][:6]) + (f" (+{len(row['failed']) - 6})" if len(row["failed"]) > 6 else "")
        lines.append(f"| {row['lane']} | {row['arm']} | {row['size']} | {verdict} | {shown} | {row['worst_margin']:.2f} |")
    table = "\n".join(lines)
    print(f"\n# gate power: {spec.case} on {run.platform}\n\n{table}")
    (ns.out / "power.json").write_text(json.dumps({"case": spec.case, "platform": run.platform, "rows": rows}, indent=1))
    (ns.out / "power.md").write_text(table + "\n")
    return 1 if false_alarms else 0


if __name__ == "__main__":
    sys.exit(main())

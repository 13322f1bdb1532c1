"""What each comparison is held to: a strict contract on max |dlogp| where one exists, and the
regression band its gated metrics get against a baseline, each with its source.

* A0: bitwise (max |dlogp| == 0).
* A1: the operator's tolerance from ``kernels/tolerances.py`` (per op, dtype, platform).
* A2: TP=2 gets the table's ``logp.tp2``; batch layouts get the table's fp32 ``logp`` tolerance,
  applied to the whole training forward (the table has no batch-invariance entry of its own).
* A3 and the A4 pairs that change the dtype: no contract (representation error is what is being
  measured); the gate is a regression band around the baseline: rel 0.5 (miles' logprob-diff band,
  peers.md) with the table's ``logp`` atol at that dtype as the floor.
* A4 pairs without a dtype change: the sum of the two single-factor contracts (errors add at worst).
* A5: measured, the same regression band, and vime's CI cap on ``abs_diff`` (0.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels import tolerances
from pytest_rlk.drift.diagnostics import Diagnostics
from pytest_rlk.drift.rungs import ComparisonSpec, SideConfig
from pytest_rlk.mismatch.gates import VIME_ABS_DIFF_CEILING, VIME_ABS_DIFF_CEILING_SOURCE

REGRESSION_REL = 0.5
REGRESSION_SOURCE = "miles: logprob diff up rel 0.5 (peers.md)"
VIME_ABS_DIFF_CAP = VIME_ABS_DIFF_CEILING
VIME_CAP_SOURCE = VIME_ABS_DIFF_CEILING_SOURCE
DTYPE_OF = {"fp32": "fp32", "bf16-logits": "bf16", "bf16": "bf16", "fp16": "fp16"}
BATCH_INVARIANCE_NOTE = ("applied to the whole training forward (no batch-invariance entry in the table; "
                         "vime's strict mode asks the op for bitwise batch invariance)")


@dataclass(frozen=True)
class Contract:
    kind: str  # "bitwise" | "tolerance" | "measured"
    max_abs: float | None  # strict bound on max |dlogp|; None: measured, no bound
    band_rel: float
    band_abs: float
    source: str
    abs_diff_cap: float | None = None

    def band(self) -> dict[str, object]:
        """The regression band of the gated metrics (``rlk_metrics.record(band=...)``)."""
        return {"rel": self.band_rel, "abs_floor": self.band_abs, "source": self.source}

    def describe(self) -> str:
        if self.kind == "bitwise":
            return "bitwise"
        if self.max_abs is not None:
            return f"max <= {self.max_abs:g}"
        cap = f", abs_diff <= {self.abs_diff_cap:g}" if self.abs_diff_cap is not None else ""
        return f"band rel {self.band_rel:g} / abs {self.band_abs:g}{cap}"

    def violation(self, diag: Diagnostics) -> str | None:
        """Why ``diag`` breaks the contract, or None."""
        if self.max_abs is not None and not diag.abs_max <= self.max_abs:
            w = diag.worst
            return (f"max |dlogp| {diag.abs_max:.3g} > {self.max_abs:g} ({self.source}); worst token: sample "
                    f"{w.sample}, position {w.position}, id {w.token_id}, logp {w.logp_a:.6g} -> {w.logp_b:.6g}")
        if self.abs_diff_cap is not None and not diag.abs_diff <= self.abs_diff_cap:
            return f"abs_diff {diag.abs_diff:.3g} > {self.abs_diff_cap:g} ({VIME_CAP_SOURCE})"
        return None


def _table(check: str, dtype: str, platform: str) -> tuple[float, str]:
    tol = tolerances.get(check, dtype, platform)
    if tol.rtol or tol.ulp is not None:
        raise ValueError(f"kernels/tolerances.py {check} {dtype} {platform}: {tol.describe()} is not a plain atol; "
                         "the drift ladder bounds max |dlogp| by an atol")
    return tol.atol, f"kernels/tolerances.py {check} {dtype} {platform}: atol {tol.atol:g} [{tol.source}]"


def _measured(side: SideConfig, platform: str, *, cap: bool = False) -> Contract:
    dtype = DTYPE_OF.get(side.dtype, "fp32")
    floor, source = _table("logp", dtype, platform)
    return Contract("measured", None, REGRESSION_REL, floor, f"{REGRESSION_SOURCE}; floor {source}",
                    abs_diff_cap=VIME_ABS_DIFF_CAP if cap else None)


def _single(factor: str, side: SideConfig, platform: str) -> tuple[float, str]:
    if factor == "arith":
        check = "linear_logp" if side.arith == "kernels-linear" else "logp"
        return _table(check, "fp32", platform)
    if side.layout == "tp2":
        return _table("logp.tp2", "fp32", platform)
    atol, source = _table("logp", "fp32", platform)
    return atol, f"{source}, {BATCH_INVARIANCE_NOTE}"


def contract_for(spec: ComparisonSpec, platform: str | None = None) -> Contract:
    platform = platform or tolerances.current_platform()
    if spec.rung == "A0":
        return Contract("bitwise", 0.0, 0.0, 0.0, "the same forward twice is bitwise equal (the harness's noise floor)")
    if spec.rung == "A5":
        return _measured(spec.a, platform, cap=True)
    diff = spec.a.differing(spec.b)
    if "dtype" in diff:
        return _measured(spec.b, platform)
    parts = [_single(factor, spec.b, platform) for factor in sorted(diff)]
    atol = sum(p[0] for p in parts)
    source = " + ".join(p[1] for p in parts)
    return Contract("tolerance", atol, 0.0, atol, source)

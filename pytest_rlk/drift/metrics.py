"""The ladder's numbers as pytest-rlk metrics: what a rung's test records and gates.

Gated against the baseline (``baselines/module/<platform>/...``, written by
``--rlk-update-baselines``), with the comparison's contract band (contracts.py):

* every comparison: ``<source>.abs_mean``;
* comparisons with a contract (A0, A1, A2, A4 without a dtype change): also ``<source>.abs_max``
  (for measured rungs the max over one token set is too noisy to gate: it is recorded).

Recorded ungated: the other quantiles, abs_diff, ratio0, clipfrac0, approx_kl0, the active tokens,
and every metric of the mismatch table as ``<source>.mismatch.<metric>``.
Tags name the rung, the source, the model, the preconditions' fingerprint and both layouts.
"""

from __future__ import annotations

from typing import Protocol

from pytest_rlk.drift.result import Comparison, LadderResult
from pytest_rlk.mismatch.metrics import BY_NAME as MISMATCH

GATED_ALWAYS = ("abs_mean",)
GATED_WITH_CONTRACT = ("abs_max",)
RECORDED = ("abs_p50", "abs_p90", "abs_p99", "abs_diff", "ratio0_mean", "ratio0_min", "ratio0_max", "clipfrac0",
            "approx_kl0")
SPACES = {"ratio0_mean": "ratio", "ratio0_min": "ratio", "ratio0_max": "ratio", "clipfrac0": "ratio"}
TWO_SIDED = ("ratio0_mean", "ratio0_min", "ratio0_max")


class Recorder(Protocol):
    def record(self, name: str, value: float, **kwargs: object) -> object: ...


def gated_names(comparison: Comparison) -> tuple[str, ...]:
    return GATED_ALWAYS + (GATED_WITH_CONTRACT if comparison.contract.max_abs is not None else ())


def record_comparison(recorder: Recorder, result: LadderResult, comparison: Comparison) -> list[str]:
    """Record one ran comparison's diagnostics; returns the metric names it gates."""
    d = comparison.diagnostics
    if d is None:
        raise ValueError(f"{comparison.spec.key} did not run ({comparison.skipped}): nothing to record")
    src = comparison.spec.source
    tags = {"rung": comparison.spec.rung, "source": src, "model": result.model,
            "preconditions": _fingerprint(result), "layout_a": d.layout_a, "layout_b": d.layout_b,
            "b": (comparison.b or {}).get("implementation", "")}
    gated = gated_names(comparison)
    for name in gated:
        recorder.record(f"{src}.{name}", getattr(d, name), direction="lower_is_better", space="logprob", tags=tags,
                        band=comparison.contract.band())
    for name in RECORDED + tuple(n for n in GATED_WITH_CONTRACT if n not in gated):
        recorder.record(f"{src}.{name}", getattr(d, name), direction="two_sided" if name in TWO_SIDED else "lower_is_better",
                        space=SPACES.get(name, "logprob"), tags=tags, gate=False)
    for name, value in d.mismatch.items():
        recorder.record(f"{src}.mismatch.{name}", value, direction=MISMATCH[name].direction,
                        space="logprob" if MISMATCH[name].space == "logprob" else "ratio", tags=tags, gate=False)
    recorder.record(f"{src}.active_tokens", d.active_tokens, direction="two_sided", space="count", tags=tags, gate=False)
    return [f"{src}.{n}" for n in gated]


def _fingerprint(result: LadderResult) -> str:
    from pytest_rlk.drift.preconditions import Preconditions

    return Preconditions(**result.preconditions).fingerprint


def gate_between(reference: LadderResult, new: LadderResult) -> dict[str, list[str]]:
    """Gate ``new`` against ``reference`` as the baseline gate would (the same metrics, bands and
    contracts): {comparison key: failure messages} for every comparison that ran in both."""
    from pytest_rlk.compare import compare_value
    from pytest_rlk.schema import Band, Verdict

    out: dict[str, list[str]] = {}
    for c in new.comparisons:
        if c.diagnostics is None:
            continue
        ref = reference.get(c.spec.key)
        if ref.diagnostics is None:
            continue
        problems = [f"contract: {c.violation}"] if c.violation else []
        for name in gated_names(c):
            cmp = compare_value(f"{c.spec.source}.{name}", getattr(ref.diagnostics, name), getattr(c.diagnostics, name),
                                direction="lower_is_better", band=Band(**c.contract.band()))
            if cmp.verdict is Verdict.REGRESSION:
                problems.append(f"{cmp.name}: {cmp.baseline:.4g} -> {cmp.new:.4g} ({cmp.detail})")
        out[c.spec.key] = problems
    return out

"""The ladder's plain parts on hand-made numbers: diagnostics, rung labels, contracts, attribution."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels import tolerances
from pytest_rlk.drift import contracts, rungs, table
from pytest_rlk.drift.diagnostics import diagnose
from pytest_rlk.drift.preconditions import Preconditions
from pytest_rlk.drift.result import Comparison, LadderResult
from pytest_rlk.drift.rungs import A0_SIDE, ComparisonSpec, LadderError, SideConfig


def _diag(a, b, mask=None, samples=None, **kw):
    a, b = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    n = a.numel()
    return diagnose(a, b, mask=torch.ones(n) if mask is None else torch.tensor(mask),
                    samples=samples or [0] * n, positions=list(range(n)), token_ids=torch.arange(10, 10 + n),
                    layout_a="la", layout_b="lb", **kw)


def test_diagnostics_on_known_numbers():
    # dlogp = b - a = [0, 0.1, -0.3, 0.5] over samples [0, 0, 1, 1]
    d = _diag([-1.0, -2.0, -3.0, -4.0], [-1.0, -1.9, -3.3, -3.5], samples=[0, 0, 1, 1])
    dl = torch.tensor([0.0, -1.9 + 2.0, -3.3 + 3.0, -3.5 + 4.0], dtype=torch.float32).double()  # as fp32 computes it
    assert d.active_tokens == 4
    assert d.abs_mean == pytest.approx(float(dl.abs().mean()))
    assert d.abs_max == pytest.approx(0.5)
    assert d.abs_p50 == pytest.approx(float(torch.quantile(dl.abs(), 0.5)))
    assert d.abs_diff == pytest.approx((0.05 + 0.4) / 2, rel=1e-6)  # mean of the per-sample means
    assert d.ratio0_max == pytest.approx(math.exp(0.5), rel=1e-6)
    assert d.ratio0_min == pytest.approx(math.exp(-0.3), rel=1e-6)
    # exp(-0.3) = 0.74 < 0.8 and exp(0.5) = 1.65 > 1.28 are clipped; exp(0.1) = 1.105 is not
    assert d.clipfrac0 == pytest.approx(0.5)
    assert d.approx_kl0 == pytest.approx(float((dl.exp() - 1 - dl).mean()), rel=1e-6)
    w = d.worst
    assert (w.sample, w.position, w.token_id) == (1, 3, 13)
    assert (w.logp_a, w.logp_b) == (pytest.approx(-4.0), pytest.approx(-3.5))
    assert d.space == "logprob"


def test_mask_and_clips():
    d = _diag([0.0, 0.0, 0.0], [0.0, 2.0, 0.2], mask=[1.0, 0.0, 1.0])
    assert d.active_tokens == 2 and d.abs_max == pytest.approx(0.2)  # the masked token is not counted
    assert d.clipfrac0 == 0.0  # exp(0.2) = 1.22 within [0.8, 1.28]
    assert _diag([0.0], [0.2], eps_clip_high=0.2).clipfrac0 == 1.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="side b has a non-finite log-prob nan at sample 0, response position 1"):
        _diag([0.0, 0.0], [0.0, float("nan")])
    with pytest.raises(ValueError, match="no active token"):
        _diag([0.0], [0.0], mask=[0.0])
    with pytest.raises(ValueError, match="logp_b has 1 entries"):
        diagnose(torch.zeros(2), torch.zeros(1), mask=torch.ones(2), samples=[0, 0], positions=[0, 1],
                 token_ids=torch.zeros(2), layout_a="", layout_b="")


@pytest.mark.parametrize("rung, b, message", [
    ("A1", SideConfig(arith="kernels", dtype="bf16"), "A1 changes exactly 1 of .*arith.*dtype"),
    ("A0", SideConfig(layout="alone"), "A0 changes exactly 0"),
    ("A3", SideConfig(layout="micro2"), "A3 changes exactly 1 of .*dtype.*layout differ"),
    ("A4", SideConfig(arith="kernels"), "A4 changes exactly 2"),
    ("A5", SideConfig(arith="kernels"), "A5 compares the rollout engine"),
    ("A2", SideConfig(engine="vllm", arith="vllm", layout="vllm", dtype="bf16"), "that is rung A5"),
    ("A9", SideConfig(), "unknown rung"),
])
def test_mislabelled_comparison_is_refused(rung, b, message):
    with pytest.raises(LadderError, match=message):
        rungs.check_rung(ComparisonSpec(rung, "x", A0_SIDE, b))


def test_default_ladder_changes_one_source_per_rung():
    specs = rungs.default_ladder()
    assert [s.rung for s in specs] == sorted(s.rung for s in specs)
    for s in specs:
        diff = s.a.differing(s.b)
        assert len(diff) == {"A0": 0, "A1": 1, "A2": 1, "A3": 1, "A4": 2}.get(s.rung, len(diff)), s.key
    assert {s.rung for s in specs} == set(rungs.RUNGS)
    assert not any(s.b.layout == "tp2" for s in rungs.default_ladder(tp=False))
    assert [s.rung for s in rungs.select(specs, "a0, A5")] == ["A0"] + ["A5"] * 3
    with pytest.raises(LadderError, match="unknown rung"):
        rungs.select(specs, "A1,B2")
    with pytest.raises(LadderError, match="arith 'fast'"):
        SideConfig(arith="fast")


def test_contracts_come_from_the_tolerance_table():
    by_key = {s.key: contracts.contract_for(s, "cpu") for s in rungs.default_ladder()}
    assert by_key["A0/twice"].kind == "bitwise" and by_key["A0/twice"].max_abs == 0.0
    assert by_key["A1/kernels"].max_abs == tolerances.get("logp", "fp32", "cpu").atol
    assert by_key["A1/kernels-linear"].max_abs == tolerances.get("linear_logp", "fp32", "cpu").atol
    assert by_key["A2/tp2"].max_abs == tolerances.get("logp.tp2", "fp32", "cpu").atol
    assert "kernels/tolerances.py logp fp32 cpu" in by_key["A2/alone"].source
    pair = by_key["A4/kernels+tp2"]
    assert pair.max_abs == pytest.approx(by_key["A1/kernels"].max_abs + by_key["A2/tp2"].max_abs)
    bf16 = by_key["A3/bf16"]
    assert bf16.max_abs is None and bf16.band_rel == 0.5 and bf16.band_abs == tolerances.get("logp", "bf16", "cpu").atol
    assert by_key["A4/kernels+bf16"].max_abs is None
    assert by_key["A5/vllm-vs-kernels"].abs_diff_cap == 0.1
    d = _diag([-1.0, -2.0], [-1.0, -2.0 + 3e-5])
    assert "max |dlogp| 3e-05 > 1e-05" in by_key["A1/kernels"].violation(d)
    assert "sample 0, position 1" in by_key["A1/kernels"].violation(d)
    assert by_key["A3/bf16"].violation(d) is None
    assert by_key["A0/twice"].violation(_diag([-1.0], [-1.0])) is None


def _result(means: dict[str, float]) -> LadderResult:
    comparisons = []
    for spec in rungs.default_ladder(tp=False):
        if spec.key not in means:
            continue
        d = _diag([0.0, 0.0], [means[spec.key], -means[spec.key]])
        comparisons.append(Comparison(spec, contracts.contract_for(spec, "cpu"), d))
    pre = Preconditions("c", "t", "m", 1.0, 1.0, -1, "processed").to_dict()
    return LadderResult("m", "/m", "c", "cpu", "cpu", "vllm", {}, 2, pre, comparisons, 1.0)


def test_attribution_states_shares_of_production():
    result = _result({"A0/twice": 0.0, "A1/kernels": 1e-6, "A3/bf16": 0.008, "A4/kernels+bf16": 0.0081,
                      "A5/vllm-vs-kernels": 0.01})
    prod, shares = table.attribution(result)
    assert prod.spec.key == "A5/vllm-vs-kernels"
    share = {s.key: s.share for s in shares}
    assert share["A3/bf16"] == pytest.approx(0.8) and share["A1/kernels"] == pytest.approx(1e-4)
    text = "\n".join(table.attribution_lines(result))
    assert "Largest single source: A3/bf16 (representation), 80% of A5" in text
    assert "Pair A4/kernels+bf16: 0.0081 vs its parts' sum 0.008 (A1/kernels + A3/bf16)" in text
    assert "do not add up to 100%" in text
    skipped = dataclasses.replace(result, comparisons=[
        c if c.spec.rung != "A5" else Comparison(c.spec, c.contract, skipped="no vLLM") for c in result.comparisons])
    assert table.attribution_lines(skipped)[0].startswith("A5 did not run here (no vLLM)")


def test_result_round_trips_through_json(tmp_path):
    from pytest_rlk.drift.runner import load_results, write_outputs

    result = _result({"A0/twice": 0.0, "A3/bf16": 0.008, "A5/vllm-vs-kernels": 0.01})
    paths = write_outputs([result], tmp_path, plot=False)
    (back,) = load_results(paths["json"])
    assert back.to_dict() == result.to_dict()
    text = paths["table"].read_text()
    assert "| A3 | bf16 | dtype: fp32 -> bf16 |" in text
    # every comparison's row of the mismatch section carries every metric of the mismatch table
    from pytest_rlk.mismatch.metrics import METRIC_NAMES

    section = text[text.index("### Mismatch metrics"):]
    assert "| rung | source | " + " | ".join(METRIC_NAMES) + " |" in section
    for c in result.comparisons:
        assert set(c.diagnostics.mismatch) == set(METRIC_NAMES)
        row = next(line for line in section.splitlines() if line.startswith(f"| {c.spec.rung} | {c.spec.source} |"))
        assert row.count("|") == len(METRIC_NAMES) + 3 and " - " not in row


def test_diagnostics_carry_the_mismatch_table():
    d = _diag([-1.0, -2.0, -3.0, -4.0], [-1.0, -1.9, -3.3, -3.5], samples=[0, 0, 1, 1])
    m = d.mismatch
    assert m["logp_abs_mean"] == pytest.approx(d.abs_mean) and m["logp_abs_max"] == pytest.approx(d.abs_max)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(d.abs_diff)
    assert m["kl_k3"] == pytest.approx(d.approx_kl0) and m["is_weight_mean"] == pytest.approx(d.ratio0_mean)


def test_a_case_the_backend_cannot_serve_makes_the_side_unavailable(monkeypatch):
    """Strict mode's fallback error becomes the side's skip reason (the dispatcher's words); the
    reference is never measured under the kernel's name."""
    import torch

    from pytest_rlk.drift.arith import SideUnavailable, logp_from_hidden

    # a test-only backend that serves logp only: linear_logp falls back, which strict mode refuses
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "suites.e2e.perturbed_logp_backend:make_backend")
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 8, generator=gen), torch.randn(16, 8, generator=gen)
    with pytest.raises(SideUnavailable, match="linear_logp"):
        logp_from_hidden("kernels-linear", hidden, weight, None, torch.randint(0, 16, (4,), generator=gen), 1.0)

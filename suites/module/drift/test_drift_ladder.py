"""The ladder on the tiny dense and MoE Qwen3 models: one gated profile per rung, and the run's table.

Each rung's test records its comparisons (pytest_rlk/drift/metrics.py: gated ``abs_mean`` /
``abs_max`` with the contract's band, the other diagnostics ungated) against
``baselines/module/<platform>/test_drift_ladder.test_rung-<kind>-<rung>.json`` (``<platform>x2``
where a TP=2 side ran over NCCL, a GPU per rank: its figures are the 2-GPU topology's) and asserts the
contracts (A0 bitwise, A1/A2 the tolerance table's bounds). The table test writes the run's drift
table, plot and attribution to its artifact directory.
"""

from __future__ import annotations

import importlib.util
import json
import warnings

import pytest
import torch

from pytest_rlk.drift import metrics, table
from pytest_rlk.drift.rungs import RUNGS
from pytest_rlk.drift.runner import write_outputs

# slow: the quick start (tox -e suite, -m "not slow") proves the ladder on the dense model
KINDS = ["dense", pytest.param("moe", marks=[pytest.mark.moe, pytest.mark.slow])]


@pytest.mark.tiny
@pytest.mark.parametrize("rung", list(RUNGS))
@pytest.mark.parametrize("kind", KINDS)
def test_rung(kind, rung, ladders, rlk_metrics):
    result = ladders(kind)
    comparisons = result.rung(rung)
    ran = [c for c in comparisons if c.diagnostics is not None]
    if not ran:
        pytest.skip("; ".join(sorted({c.skipped or "" for c in comparisons})))
    for c in ran:
        metrics.record_comparison(rlk_metrics, result, c)
    if torch.cuda.is_available() and any("tp2" in c.spec.source.split("+") for c in ran):
        rlk_metrics.set_gpus(2)  # the TP=2 side ran over NCCL, a GPU per rank: baselines under <tag>x2
    (rlk_metrics.artifact_dir / "comparisons.json").write_text(json.dumps([c.to_dict() for c in comparisons], indent=1))
    skipped = [f"{c.spec.key}: {c.skipped}" for c in comparisons if c.diagnostics is None]
    broken = [f"{c.spec.key}: {c.violation}" for c in ran if c.violation]
    if skipped:  # a machine without a GPU pair, megatron-core or Liger; the baseline gate names them too
        warnings.warn(f"{result.model} rung {rung}: sources that did not run here: " + "; ".join(skipped), stacklevel=1)
    assert not broken, f"{result.model} rung {rung} breaks its contract:\n  " + "\n  ".join(broken)


@pytest.mark.tiny
@pytest.mark.slow  # both models' ladders: the MoE one is slow
def test_drift_table(ladders, rlk_metrics):
    results = [ladders("dense"), ladders("moe")]
    paths = write_outputs(results, rlk_metrics.artifact_dir)
    text = paths["table"].read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert paths["plot"].is_file()
    print(text)
    for result in results:
        for c in result.comparisons:
            assert f"| {c.spec.rung} | {c.spec.source} |" in text, f"{c.spec.key} missing from the table"
        prod, shares = table.attribution(result)
        if prod is None or prod.diagnostics is None:
            assert "did not run here" in text or "nothing to attribute" in text
            continue
        assert {s.key for s in shares} == {c.spec.key for c in result.comparisons
                                           if c.diagnostics is not None and c.spec.rung != "A5"}
        for s in shares:
            assert s.share == pytest.approx(result.get(s.key).diagnostics.abs_mean / prod.diagnostics.abs_mean)
            rlk_metrics.record(f"{result.model}.{s.key}.share_of_A5", s.share, direction="two_sided", space="none",
                               tags={"model": result.model, "rung": s.key.split("/")[0]}, gate=False)
        assert "Largest single source" in text

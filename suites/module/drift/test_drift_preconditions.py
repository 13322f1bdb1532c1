"""A comparison whose sides did not score the same thing is refused, never measured.

The rollout side's preconditions come from the engine's own record (the checkpoint it loaded, its
token ids, its sampling parameters); the training side's from the tensors it forwards. Each test
breaks one of them and expects the refusal to name it. The records here are written by hand from
transformers-sampled tokens (what vLLM's output file holds, without starting vLLM: the real engine
path runs in test_drift_ladder.py); the training side is the real tiny model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pytest_rlk.drift import batch as drift_batch
from pytest_rlk.drift.preconditions import PreconditionError, check_comparable, checkpoint_fingerprint
from pytest_rlk.drift.rungs import A0_SIDE, ComparisonSpec, SideConfig
from pytest_rlk.drift.runner import run_ladder
from suites.module import tiny

SAMPLING = drift_batch.Sampling(temperature=1.0, n=2, max_tokens=6, seed=3)
VLLM = SideConfig(engine="vllm", arith="vllm", layout="vllm", dtype="bf16")
A5 = [ComparisonSpec("A5", "vllm-vs-reference", VLLM, A0_SIDE)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.save_model_dir("dense", tmp_path_factory.mktemp("pre") / "dense", seed=5)


@pytest.fixture(scope="module")
def sampled(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return drift_batch.sample_with_hf(model, tiny.drift_prompts(2), SAMPLING)


def engine_record(batch: drift_batch.TokenBatch, model: str, **request: object) -> dict:
    """An engine's output file for ``batch``'s samples (pytest_rlk.drift.rollout's format)."""
    samples = [{"prompt_ids": p, "response_ids": r, "response_logprobs": [-1.0] * len(r)}
               for p, r in zip(batch.prompts, batch.responses)]
    return {"samples": samples, "vllm_version": "record", "model": model, "logprobs_mode": "processed_logprobs",
            "request": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "dtype": "bfloat16", **request}}


def ladder(model_dir, batch):
    return run_ladder(model_dir, batch, A5, device=torch.device("cpu"))


def test_matching_record_is_compared(model_dir, sampled):
    result = ladder(model_dir, drift_batch.batch_from_rollout(engine_record(sampled, str(model_dir)), SAMPLING))
    (comparison,) = result.comparisons
    assert comparison.diagnostics is not None and comparison.diagnostics.active_tokens == sum(sampled.lengths)
    assert comparison.a["preconditions"] == comparison.b["preconditions"]


@pytest.mark.parametrize("request_change, field", [
    ({"temperature": 0.7}, "temperature"),  # the engine sampled at another temperature
    ({"top_k": 20}, "top_k"),  # processed log-probs after top-k: training cannot reproduce them
    ({"top_p": 0.9}, "top_p"),
])
def test_sampling_mismatch_is_refused(model_dir, sampled, request_change, field):
    batch = drift_batch.batch_from_rollout(engine_record(sampled, str(model_dir), **request_change), SAMPLING)
    with pytest.raises(PreconditionError, match=rf"A5/vllm-vs-reference .*refused.*{field}: "):
        ladder(model_dir, batch)


def test_other_checkpoint_is_refused(model_dir, sampled, tmp_path):
    other = tiny.save_model_dir("dense", tmp_path / "other", seed=6)
    batch = drift_batch.batch_from_rollout(engine_record(sampled, str(other)), SAMPLING)
    with pytest.raises(PreconditionError, match=r"checkpoint: 'sha256:"):
        ladder(model_dir, batch)


def test_other_token_ids_are_refused(model_dir, sampled):
    # the training side scores a token the engine did not sample (a retokenization bug, say)
    batch = drift_batch.batch_from_rollout(engine_record(sampled, str(model_dir)), SAMPLING)
    batch.responses[1][2] = (batch.responses[1][2] + 1) % tiny.TINY_VOCAB
    with pytest.raises(PreconditionError, match=r"token_ids: "):
        ladder(model_dir, batch)


def test_other_mask_is_refused(model_dir, sampled):
    batch = drift_batch.batch_from_rollout(engine_record(sampled, str(model_dir)), SAMPLING)
    batch.mask[0][0] = 0.0
    with pytest.raises(PreconditionError, match=r"masks: "):
        ladder(model_dir, batch)


def test_every_differing_field_is_named(model_dir, sampled):
    a = drift_batch.batch_from_rollout(engine_record(sampled, str(model_dir)), SAMPLING).rollout.preconditions("x")
    b = dataclasses.replace(a, temperature=0.5, top_p=0.8, checkpoint="y")
    with pytest.raises(PreconditionError) as info:
        check_comparable(a, b, what="A5/test")
    message = str(info.value)
    assert all(f"{name}: " in message for name in ("temperature", "top_p", "checkpoint")), message
    assert "token_ids" not in message


def test_checkpoint_fingerprint_reads_the_weights(model_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(model_dir)
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(model_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreconditionError, match="no weight files"):
        checkpoint_fingerprint(tmp_path / "empty")

"""Models for the module tier, built on the shared tiny-model builder
(``pytest_rlk.e2e.engines.tiny_models``: transformers' Qwen3 / Qwen3-MoE classes from configs,
random weights, a locally trained tokenizer; nothing from a hub).

The module tier pads the model vocabulary beyond the tokenizer's (as real checkpoints do, e.g.
Qwen3's 151936 rows for ~151k tokens) so the log-prob sees a vocabulary of realistic structure
while staying small for Triton's interpreter on CPU. ``head_dim`` is 64: vLLM's CPU attention
does not support smaller heads, and the same saved model serves the training step and vLLM.

``lm_head_std`` re-draws the LM head with a larger spread so the logits are as peaked as a trained
model's (std ~3 instead of the init's ~0.16, whose near-uniform next-token distribution would
understate how much a dtype or a kernel moves a sampled token's log-prob). ``python -m
suites.module.tiny OUT`` writes the drift ladder's models and prompts (for ``rlk drift`` on a GPU).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from pytest_rlk.drift import rollout
from pytest_rlk.drift.batch import Sampling, TokenBatch, batch_from_rollout, sample_with_hf
from pytest_rlk.e2e.engines.task import DISTRACTOR_WORDS, make_prompts
from pytest_rlk.e2e.engines.tiny_models import TinyModelSize, build_config, train_tokenizer

TINY_VOCAB = 128
TINY_SIZE = TinyModelSize(hidden_size=64, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                          intermediate_size=128, num_hidden_layers=2, moe_intermediate_size=64)
# Qwen3-0.6B's published shape (28 layers, hidden 1024, 16 q / 8 kv heads of 128, ffn 3072,
# vocab 151936); untied LM head like the larger Qwen3 checkpoints; random init.
QWEN3_0P6B_VOCAB = 151936
QWEN3_0P6B_SIZE = TinyModelSize(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                max_position_embeddings=4096)
# The drift models' logit spread: hidden states after the final RMSNorm have unit scale, so an LM
# head of std s gives logits of std ~ sqrt(hidden_size) * s; 3.2 is a trained model's order.
TRAINED_LIKE_LOGIT_STD = 3.2


def trained_like_lm_head_std(size: TinyModelSize) -> float:
    return TRAINED_LIKE_LOGIT_STD / size.hidden_size ** 0.5


TRAINED_LIKE_LM_HEAD_STD = trained_like_lm_head_std(TINY_SIZE)  # 0.4
DRIFT_SEED = 99
DRIFT_SAMPLING = Sampling(temperature=1.0, n=4, max_tokens=32, seed=DRIFT_SEED)


def build_model(kind: str, *, seed: int, vocab_size: int = TINY_VOCAB, size: TinyModelSize = TINY_SIZE,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                lm_head_std: float | None = None) -> torch.nn.Module:
    """A random-init Qwen3 (``kind="dense"``) or Qwen3-MoE (``"moe"``) causal LM, deterministic in ``seed``."""
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer()
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = build_config(kind, vocab_size, size, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    # initialised where it runs: a Qwen3-0.6B-sized model's CPU init takes tens of seconds
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lm_head_std is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        head = model.get_output_embeddings().weight
        with torch.no_grad():
            head.copy_(torch.randn(head.shape, generator=gen) * lm_head_std)
    return model


def save_model_dir(kind: str, out_dir: Path, *, seed: int, vocab_size: int = TINY_VOCAB,
                   size: TinyModelSize = TINY_SIZE, lm_head_std: float | None = None) -> Path:
    """``save_pretrained`` the model and its tokenizer to ``out_dir`` (an HF dir vLLM can load)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_model(kind, seed=seed, vocab_size=vocab_size, size=size, lm_head_std=lm_head_std).save_pretrained(out_dir)
    train_tokenizer().save_pretrained(out_dir)
    (out_dir / "rlk_module_model.json").write_text(json.dumps(
        {"kind": kind, "seed": seed, "vocab_size": vocab_size, "size": dataclasses.asdict(size),
         "lm_head_std": lm_head_std}, indent=1))
    return out_dir


def drift_prompts(n: int = 4, seed: int = DRIFT_SEED) -> list[list[int]]:
    """``n`` task prompts of different lengths (2, 5, 8, ... tokens: distractor words in front), so
    a padded micro-batch really pads."""
    tokenizer = train_tokenizer()
    rows = make_prompts(n, seed)
    texts = [" ".join([*DISTRACTOR_WORDS[: 3 * i], row["prompt"]]) for i, row in enumerate(rows)]
    return [tokenizer(t)["input_ids"] for t in texts]


def save_drift_models(out_dir: Path, *, qwen3_0p6b_sized: bool = False) -> dict[str, Path]:
    """The drift ladder's dense and MoE models (trained-like logits) under ``out_dir/<kind>``, and
    ``out_dir/prompts.json`` (token ids, for ``rlk drift --prompts``); with ``qwen3_0p6b_sized``
    also ``out_dir/dense-0p6b``, a random model of Qwen3-0.6B's shape and vocab (2.4 GB, for GPUs)."""
    out_dir = Path(out_dir)
    models = {kind: save_model_dir(kind, out_dir / kind, seed=DRIFT_SEED, lm_head_std=TRAINED_LIKE_LM_HEAD_STD)
              for kind in ("dense", "moe")}
    if qwen3_0p6b_sized:
        models["dense-0p6b"] = save_model_dir(
            "dense", out_dir / "dense-0p6b", seed=DRIFT_SEED, vocab_size=QWEN3_0P6B_VOCAB, size=QWEN3_0P6B_SIZE,
            lm_head_std=trained_like_lm_head_std(QWEN3_0P6B_SIZE))
    (out_dir / "prompts.json").write_text(json.dumps(drift_prompts()))
    return models


@dataclasses.dataclass
class DriftCase:
    """A drift model and the responses every rung scores."""

    kind: str
    model_dir: Path
    batch: TokenBatch  # vLLM's samples (with its log-probs) when it ran, else transformers'
    rollout: dict | None  # vLLM's output (pytest_rlk.drift.rollout): version, load and generate times
    rollout_unavailable: str | None  # why there is no rollout


def roll_out_drift_models(out_dir: Path, sampling: Sampling = DRIFT_SAMPLING) -> dict[str, DriftCase]:
    """Build the drift models and sample their responses: with vLLM when installed (one subprocess
    for both models), else with transformers on the CPU in fp32 (seeded, the same on every host)."""
    out_dir = Path(out_dir)
    models = save_drift_models(out_dir)
    prompts = drift_prompts()
    why = rollout.vllm_missing_reason()
    if why is None:
        request = rollout.request_for(prompts, sampling, dtype="bfloat16", gpu_memory_utilization=0.3,
                                      max_model_len=64)
        jobs = [{"model": str(path), "out": str(out_dir / f"rollout-{kind}.json"), "request": request}
                for kind, path in models.items()]
        outputs = rollout.run_rollouts(jobs, out_dir)
        return {kind: DriftCase(kind, path, batch_from_rollout(out, sampling), out, None)
                for (kind, path), out in zip(models.items(), outputs)}
    from transformers import AutoModelForCausalLM

    cases = {}
    for kind, path in models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cases[kind] = DriftCase(kind, path, sample_with_hf(model, prompts, sampling), None, why)
    return cases


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write the drift ladder's models and prompts (for rlk drift)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--qwen3-0p6b-sized", action="store_true", help="also a Qwen3-0.6B-shaped model (2.4 GB)")
    ns = parser.parse_args()
    for kind, path in save_drift_models(ns.out, qwen3_0p6b_sized=ns.qwen3_0p6b_sized).items():
        print(f"{kind}: {path}")

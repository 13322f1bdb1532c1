"""Models for the module tier, built on the shared tiny-model builder
(``pytest_rlk.e2e.engines.tiny_models``: transformers' Qwen3 / Qwen3-MoE classes from configs,
random weights, a locally trained tokenizer; nothing from a hub).

The module tier pads the model vocabulary beyond the tokenizer's (as real checkpoints do, e.g.
Qwen3's 151936 rows for ~151k tokens) so the log-prob sees a vocabulary of realistic structure
while staying small for Triton's interpreter on CPU. ``head_dim`` is 64: vLLM's CPU attention
does not support smaller heads, and the same saved model serves the training step and vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

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


def build_model(kind: str, *, seed: int, vocab_size: int = TINY_VOCAB, size: TinyModelSize = TINY_SIZE,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A random-init Qwen3 (``kind="dense"``) or Qwen3-MoE (``"moe"``) causal LM, deterministic in ``seed``."""
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer()
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = build_config(kind, vocab_size, size, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device)


def save_model_dir(kind: str, out_dir: Path, *, seed: int, vocab_size: int = TINY_VOCAB,
                   size: TinyModelSize = TINY_SIZE) -> Path:
    """``save_pretrained`` the model and its tokenizer to ``out_dir`` (an HF dir vLLM can load)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_model(kind, seed=seed, vocab_size=vocab_size, size=size).save_pretrained(out_dir)
    train_tokenizer().save_pretrained(out_dir)
    (out_dir / "rlk_module_model.json").write_text(json.dumps(
        {"kind": kind, "seed": seed, "vocab_size": vocab_size, "size": dataclasses.asdict(size)}, indent=1))
    return out_dir

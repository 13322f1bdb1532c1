"""Tiny real Qwen3 models (dense and MoE) built from configs, with a locally trained tokenizer.

Nothing is downloaded: the model classes are transformers' own Qwen3 / Qwen3-MoE code, the
weights are random (seeded), and the tokenizer is a word-level tokenizer trained with
``tokenizers`` on the synthetic task's own alphabet. ``build_tiny_model_dir`` writes both to a
directory with ``save_pretrained`` so every consumer (TRL, vLLM) loads them the ordinary way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from pytest_rlk.e2e.engines.task import TASK_WORDS

# Special tokens of the local tokenizer; ids are fixed by their order here.
PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)

MODEL_KINDS = ("dense", "moe")


@dataclasses.dataclass(frozen=True)
class TinyModelSize:
    """Shape of a tiny Qwen3. ``head_dim`` 64 is what vLLM's CPU attention supports."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 128
    # MoE only
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 256

    @classmethod
    def from_dict(cls, values: dict) -> TinyModelSize:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model size: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def train_tokenizer(extra_words: tuple[str, ...] = ()):
    """Train a word-level tokenizer on the task's alphabet; returns a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = tuple(TASK_WORDS) + tuple(extra_words)
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), min_frequency=1)
    tokenizer.train_from_iterator([" ".join(words)] * 2, trainer=trainer)
    # Decoding joins words with spaces, so completions round-trip through text for the reward.
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
    )


def build_config(kind: str, vocab_size: int, size: TinyModelSize, *, pad_id: int, eos_id: int):
    """A transformers config for a tiny Qwen3 (``kind="dense"``) or Qwen3-MoE (``kind="moe"``)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        head_dim=size.head_dim,
        intermediate_size=size.intermediate_size,
        max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=False,  # Qwen3 checkpoints the suite targets are untied
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
    )
    if kind == "dense":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    if kind == "moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            num_experts=size.num_experts,
            num_experts_per_tok=size.num_experts_per_tok,
            moe_intermediate_size=size.moe_intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    raise ValueError(f"model kind: {kind!r} is not one of {MODEL_KINDS}")


def build_tiny_model_dir(
    out_dir: Path, kind: str, size: TinyModelSize, *, seed: int, extra_vocab: int = 0
) -> Path:
    """Build a random-init tiny model + local tokenizer and ``save_pretrained`` both to ``out_dir``.

    ``extra_vocab`` filler words widen the vocabulary (a realistic logits width for GPU runs).
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(tuple(f"x{i}" for i in range(extra_vocab)))
    config = build_config(
        kind,
        len(tokenizer),
        size,
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "rlk_tiny_model.json").write_text(
        json.dumps(
            {"kind": kind, "seed": seed, "extra_vocab": extra_vocab, "size": dataclasses.asdict(size)}, indent=1
        )
    )
    return out_dir

"""The models of the capacity benchmark: transformers' Qwen3 (``Qwen3ForCausalLM``) built from a
config at the published Qwen3 shapes, random init, and the AdamW the training step runs.

The model class is HF Qwen3 (transformers), not megatron-core's GPT: the benchmark's arms differ
only after the last hidden state (the LM head and the loss), which both models share in shape.
Shapes (Qwen3's published configs): 0.6B hidden 1024, 28 layers, 16 q / 8 kv heads of 128, ffn
3072; 1.7B hidden 2048, 28 layers, 16 / 8 heads, ffn 6144; 4B hidden 2560, 36 layers, 32 / 8 heads,
ffn 9728; vocab 151936; the three checkpoints tie the LM head to the embedding, and so do these.
Parameters bf16 on a GPU (the optimizer's states then bf16 too: no fp32 master copy), fp32 on CPU.
"""

from __future__ import annotations

import dataclasses

import torch

from pytest_rlk.e2e.engines.tiny_models import TinyModelSize, build_config

QWEN3_VOCAB = 151936


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    size: TinyModelSize
    vocab_size: int
    tied: bool  # the LM head is the embedding's weight


QWEN3_SPECS = {
    "qwen3_0p6b": ModelSpec("qwen3_0p6b", TinyModelSize(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                                        num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                                        max_position_embeddings=40960), QWEN3_VOCAB, True),
    "qwen3_1p7b": ModelSpec("qwen3_1p7b", TinyModelSize(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                                                        num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                                                        max_position_embeddings=40960), QWEN3_VOCAB, True),
    "qwen3_4b": ModelSpec("qwen3_4b", TinyModelSize(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                                                    num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                                                    max_position_embeddings=40960), QWEN3_VOCAB, True),
}
# The CPU form's model: Qwen3's structure at a size two cores train in milliseconds; its vocab
# (1024) is wide against its hidden size (32), as a real LM head is, so the logits dominate memory.
TINY_SPEC = ModelSpec("qwen3_tiny", TinyModelSize(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                  num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                                  max_position_embeddings=4096), 1024, True)


def build_model(spec: ModelSpec, *, device: torch.device, dtype: torch.dtype, recompute: bool,
                seed: int = 1234) -> torch.nn.Module:
    """A random-init ``Qwen3ForCausalLM`` of ``spec`` on ``device`` in training mode; ``recompute``:
    activation checkpointing of every decoder layer (transformers' gradient checkpointing,
    non-reentrant)."""
    from transformers import AutoModelForCausalLM

    config = build_config("dense", spec.vocab_size, spec.size, pad_id=0, eos_id=1)
    config.tie_word_embeddings = spec.tied
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def make_optimizer(model: torch.nn.Module, *, lr: float = 1e-6) -> torch.optim.Optimizer:
    """AdamW (fused on CUDA) with its states allocated now (a zero-gradient step that moves no
    parameter): every probe then starts from the optimizer's steady-state memory."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0, fused=fused)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the parameters and of the optimizer's states (the memory every probe starts from)."""
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"parameters": sum(params.values()), "optimizer_state": state}

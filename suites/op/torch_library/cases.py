"""What the tests of the ops as PyTorch operators share: a tiny batch, the backends (the reference,
rlk-triton strict; conftest.py's fixtures set them), outputs and gradients of a call, a bitwise
comparison, linear_logp's residual layout and a stand-in that forbids the generic split."""

from __future__ import annotations

import socket

import torch

from kernels.contracts import LinearLogpCall, LossConfig
from kernels.library import linear_logp as linear_logp_library
from suites.op.rlk_op_cases import DEVICE

T, V, H = 6, 37, 8
CONFIG = LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.01)
BACKENDS = ("reference", "rlk-triton")
SWITCHES = ("VIME_RL_KERNEL", "VIME_RL_KERNEL_STRICT", "VIME_RL_KERNEL_OPS", "VIME_RL_KERNEL_BACKEND")
KERNELS_ON = {"VIME_RL_KERNEL": "1", "VIME_RL_KERNEL_STRICT": "1"}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = V) -> dict[str, torch.Tensor]:
    """One tiny batch on DEVICE: logits [T, vocab], ids (one ignored row), per-token inputs,
    hidden/weight/bias (V rows)."""
    g = gen(seed)
    ids = torch.randint(0, vocab, (T,), generator=g)
    ids[2] = -100
    tensors = {
        "logits": torch.randn(T, vocab, generator=g) * 3, "ids": ids,
        "logp": torch.randn(T, generator=g) - 2, "old_logp": torch.randn(T, generator=g) - 2,
        "ref_logp": torch.randn(T, generator=g) - 2, "advantages": torch.randn(T, generator=g),
        "mask": torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool), "lengths": torch.tensor([2, 4]),
        "hidden": torch.randn(T, H, generator=g), "weight": torch.randn(V, H, generator=g) / 3,
        "bias": torch.randn(V, generator=g), "grad": torch.randn(T, generator=g),
    }
    out = {k: v.to(DEVICE) for k, v in tensors.items()}
    for k in ("logits", "hidden", "weight", "bias"):
        out[k] = out[k].to(dtype)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_with_grads(fn, x: dict[str, torch.Tensor], wrt: tuple[str, ...]):
    """(outputs, gradients w.r.t. ``wrt`` of every differentiable output: a loss with gradient 1, a
    [T] output with ``grad``)."""
    x = {k: (v.detach().requires_grad_() if k in wrt else v) for k, v in x.items()}
    outputs = fn(x)
    differentiable = [o for o in outputs if o.requires_grad]
    grad_outputs = [torch.ones_like(o) if o.dim() == 0 else x["grad"] for o in differentiable]
    grads = torch.autograd.grad(differentiable, [x[k] for k in wrt], grad_outputs)
    return [o.detach() for o in outputs], list(grads)


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert u.dtype == v.dtype and u.shape == v.shape, i
        assert torch.equal(u, v), f"output {i} differs: max |diff| {(u.float() - v.float()).abs().max().item()}"


def linear_logp_layout(hidden, weight, bias, ids, temperature, workspace_bytes=None) -> list[int]:
    """The residual layout the public function passes to the forward operator (every gradient)."""
    call = LinearLogpCall(hidden, weight, ids, bias, temperature, workspace_bytes=workspace_bytes)
    return linear_logp_library.residual_layout(call, (True, True, True))


def generic_split_forbidden(*args, **kwargs):
    raise AssertionError("the generic split (an autograd run inside the operator) served an rlk-triton call")

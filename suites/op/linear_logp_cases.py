"""What the linear_logp tests share: inputs on the test device (a prime vocab: every tile size leaves
a partial last tile), the gradients of a call, the closeness check against the fp32 reference, and a
workspace budget and its plan."""

from __future__ import annotations

import torch

from kernels import tolerances
from kernels.ops.linear_logp import plan as llp_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ODD_VOCAB = 1031  # prime: every tile size leaves a partial last tile


def linear_logp_inputs(dtype, T=24, H=40, V=ODD_VOCAB, bias=True, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H**0.5)  # logits of a few units, like a trained LM head
    b = torch.randn(V, generator=gen) * 0.5 if bias else None
    ids = torch.randint(0, V, (T,), generator=gen)
    ids[:4] = torch.tensor([0, V - 1, -100, V // 2])  # vocab edges and one ignored row
    to = {"device": device, "dtype": dtype}
    leaves = [hidden.to(**to).requires_grad_(), weight.to(**to).requires_grad_()]
    leaves.append(b.to(**to).requires_grad_() if bias else None)
    return leaves, ids.to(device)


def logp_and_grads(fn, leaves, ids, temperature, **kw):
    hidden, weight, bias = leaves
    logp = fn(hidden, weight, ids, bias, temperature, **kw)
    upstream = torch.linspace(-1.0, 2.0, logp.shape[0], device=logp.device)
    wrt = [t for t in leaves if t is not None and t.requires_grad]
    return logp, torch.autograd.grad(logp, wrt, upstream)


def assert_linear_logp_close(logp, grads, ref_logp, ref_grads, dtype, rlk_metrics=None):
    """logp vs the fp32 reference; grads vs the fp32 reference cast to the grads' dtype."""
    assert logp.dtype == torch.float32
    result = tolerances.assert_close(logp, ref_logp, "linear_logp", dtype, name="logp")
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert got.dtype == dtype, f"grad of {name} is {got.dtype}, expected {dtype}"
        tolerances.assert_close(got, want.to(dtype).float(), "linear_logp.grad", dtype, name=f"grad of {name}")
    if rlk_metrics is not None:
        rlk_metrics.record("logp_max_abs_err", result.max_abs_err, unit="", direction="lower_is_better",
                           space="logprob", tags={"dtype": tolerances.dtype_name(dtype)}, gate=False)


def workspace_budget(T, H, V, dtype, cols, saved=None, in_weight_grad=False):
    """The workspace budget whose plan uses a buffer of ``cols`` vocab columns (the run's tile sizes),
    keeping ``saved`` (default: as many as the buffer holds; every column with ``in_weight_grad``)
    columns."""
    block_v = llp_plan._tile_config(dtype).block_v
    element = torch.empty((), dtype=dtype).element_size()
    saved = (V if in_weight_grad else min(cols, V)) if saved is None else saved
    return llp_plan._workspace(T, H, V, element, block_v, saved, cols, True, in_weight_grad)


def plan_of(T, H, V, dtype, budget, save=True, weight_grad=False):
    return llp_plan._plan(T, H, V, dtype, budget, explicit=True, save=save, tp=False, weight_grad=weight_grad)

"""linear_logp's split on rlk-triton as PyTorch operators: under every plan of its workspace (the
weight gradient's layout, every column kept, some, none), bf16 and fp32, compiled to the eager bits
with its forward run once per compiled forward and backward; the forward operator returns the
plan's residuals; compiled calls follow the settings and token counts; a backward refuses residuals
of another plan."""

from __future__ import annotations

import pytest
import torch

import kernels
import kernels.library  # registers torch.ops.rlk.*
from kernels.library import linear_logp as linear_logp_library
from suites.op.rlk_op_cases import DEVICE
from suites.op.torch_library.cases import (
    assert_bitwise,
    gen,
    generic_split_forbidden,
    linear_logp_layout,
    run_with_grads,
)


# -- linear_logp's split on rlk-triton ------------------------------------------------------------------

LLP_T, LLP_H = 24, 40  # T <= H: the weight gradient can hold the logits


def _llp_v() -> int:
    """A vocab of several of the run's vocab tiles (bf16 and fp32; the interpreter's or a GPU's), a
    partial last one."""
    from kernels.ops.linear_logp import plan as llp_plan

    return 3 * max(llp_plan._tile_config(dtype).block_v for dtype in (torch.bfloat16, torch.float32)) + 8


def _linear_logp_plan(plan: str, dtype: torch.dtype, monkeypatch) -> int | None:
    """The settings and the workspace budget (returned) under which the forward keeps: every column
    in the weight gradient's layout, read in several chunks (``in_weight_grad``); every column in
    the workspace (``all``); two vocab tiles, the rest recomputed in chunks (``some``); nothing
    (``none``). Asserts the plan."""
    from kernels.ops import linear_logp as op_module
    from kernels.ops.linear_logp import plan as llp_plan

    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "1" if plan == "in_weight_grad" else "0")
    monkeypatch.setenv(op_module.SAVE_LOGITS_ENV, "0" if plan == "none" else "1")
    V, block_v = _llp_v(), llp_plan._tile_config(dtype).block_v
    element = torch.empty((), dtype=dtype).element_size()
    cols = {"in_weight_grad": block_v, "some": 2 * block_v}.get(plan)
    budget = None if cols is None else llp_plan._workspace(
        LLP_T, LLP_H, V, element, block_v, V if plan == "in_weight_grad" else cols, cols, True,
        plan == "in_weight_grad")
    found = llp_plan._plan(LLP_T, LLP_H, V, dtype, budget or op_module.DEFAULT_WORKSPACE_BYTES,
                            explicit=budget is not None, save=plan != "none", tp=False,
                            weight_grad=plan == "in_weight_grad")
    kept = {"in_weight_grad": V, "all": V, "some": cols, "none": 0}[plan]
    assert (found.saved_cols, found.in_weight_grad) == (kept, plan == "in_weight_grad"), found
    if plan == "in_weight_grad":
        assert len(llp_plan._even_chunks(0, V, found.buffer_cols, block_v)) > 1, found
    return budget


def _linear_logp_inputs(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = gen(seed)
    V = _llp_v()
    ids = torch.randint(0, V, (LLP_T,), generator=g)
    ids[:3] = torch.tensor([0, V - 1, -100])
    x = {"hidden": torch.randn(LLP_T, LLP_H, generator=g), "weight": torch.randn(V, LLP_H, generator=g) / 3,
         "bias": torch.randn(V, generator=g), "ids": ids, "grad": torch.randn(LLP_T, generator=g)}
    return {k: v.to(DEVICE, dtype=dtype if v.is_floating_point() and k != "grad" else None) for k, v in x.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("plan", ["in_weight_grad", "all", "some", "none"])
def test_linear_logp_split_compiles_to_the_eager_bits_without_a_second_forward(plan, dtype, rlk_triton,
                                                                               monkeypatch):
    """rlk-triton's linear_logp operators under ``torch.compile(fullgraph=True)``: logp and the three
    gradients bitwise those of the plain call, with every plan of the workspace (the logits kept in
    the weight gradient's layout, all in the workspace, part of them, none); the compiled forward and
    backward run the forward kernels once (the backward reads the forward's residuals: no
    recomputed forward, no autograd run inside an operator)."""
    from kernels.ops.linear_logp import autograd as llp_autograd

    budget = _linear_logp_plan(plan, dtype, monkeypatch)
    x = _linear_logp_inputs(dtype, seed=8)
    wrt = ("hidden", "weight", "bias")

    def fn(x):
        return (kernels.linear_logp(x["hidden"], x["weight"], x["ids"], x["bias"], 0.9, workspace_bytes=budget),)

    eager = run_with_grads(fn, x, wrt)
    forwards = []
    forward = llp_autograd._forward
    monkeypatch.setattr(llp_autograd, "_forward", lambda *a, **k: forwards.append(a) or forward(*a, **k))
    monkeypatch.setattr(linear_logp_library, "recomputed_grads", generic_split_forbidden)
    compiled_fn = torch.compile(fn, fullgraph=True)
    compiled = run_with_grads(compiled_fn, x, wrt)
    assert len(forwards) == 1, f"compiled forward + backward ran the forward {len(forwards)} times"
    assert_bitwise(eager[0], compiled[0])
    assert_bitwise(eager[1], compiled[1])


@pytest.mark.parametrize("plan", ["in_weight_grad", "some", "none"])
def test_linear_logp_forward_operator_returns_the_plans_residuals(plan, rlk_triton, monkeypatch):
    """The forward operator's residuals are the plan's: the row statistics (lse, target logit, the
    kept tiles' row maxima) and the kept logits in the plan's layout ([V, T] in the weight
    gradient's, [T, kept columns] in the workspace); the log-probs are the plain call's; the
    reference returns no residuals."""
    from kernels.ops.linear_logp import plan as llp_plan

    budget = _linear_logp_plan(plan, torch.bfloat16, monkeypatch)
    x = _linear_logp_inputs(torch.bfloat16, seed=9)
    layout = linear_logp_layout(x["hidden"], x["weight"], x["bias"], x["ids"], 0.9, budget)
    args = (x["hidden"], x["weight"], x["bias"], x["ids"], 0.9, None, 0, _llp_v(), budget, True, True, True)
    logp, stats, kept = torch.ops.rlk.linear_logp(*args, layout)
    block_v = llp_plan._tile_config(torch.bfloat16).block_v
    tiles = {"in_weight_grad": -(-_llp_v() // block_v), "some": 2, "none": 0}[plan]
    assert stats.shape == (2 + tiles, LLP_T) and stats.dtype == torch.float32
    shape = {"in_weight_grad": (_llp_v(), LLP_T), "some": (LLP_T, 2 * block_v), "none": (0, 0)}[plan]
    assert kept.shape == shape and kept.dtype == torch.bfloat16
    with torch.no_grad():
        assert_bitwise([logp], [kernels.linear_logp(x["hidden"], x["weight"], x["ids"], x["bias"], 0.9)])
    assert layout == [2 + tiles, *shape, kept.stride(0)] and kept.stride(1) == 1
    monkeypatch.delenv("VIME_RL_KERNEL")
    with pytest.raises(RuntimeError, match="a graph compiled under other settings"):
        torch.ops.rlk.linear_logp(*args, layout)
    layout = linear_logp_layout(x["hidden"], x["weight"], x["bias"], x["ids"], 0.9, budget)
    assert layout == [0, 0, 0, 0]
    _, stats, kept = torch.ops.rlk.linear_logp(*args, layout)
    assert stats.shape == (0, LLP_T) and kept.shape == (0, 0)


def test_linear_logp_compiled_follows_settings_and_token_counts(rlk_triton, monkeypatch):
    """One compiled function over calls whose plans differ: another token count (a dynamic shape after
    the first recompile), then a workspace budget set in the environment and a keep setting turned
    off after compiling (the settings the residual layout reads are the graph's guards): each call
    the eager bits."""
    from kernels.ops import linear_logp as op_module

    budget = _linear_logp_plan("in_weight_grad", torch.bfloat16, monkeypatch)
    monkeypatch.delenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV)
    wrt = ("hidden", "weight", "bias")

    def fn(x):
        return (kernels.linear_logp(x["hidden"], x["weight"], x["ids"], x["bias"], 0.9),)

    compiled = torch.compile(fn, fullgraph=True)
    x = _linear_logp_inputs(torch.bfloat16, seed=11)
    fewer = {k: (v if k == "weight" or k == "bias" else v[:LLP_T - 6]) for k, v in x.items()}
    for case, batch, env in (("default", x, {}), ("fewer tokens", fewer, {}),
                             ("budget setting", x, {op_module.WORKSPACE_ENV: str(budget)}),
                             ("keep setting off", x, {op_module.KEEP_IN_WEIGHT_GRAD_ENV: "0"})):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        eager = run_with_grads(fn, batch, wrt)
        got = run_with_grads(compiled, batch, wrt)
        assert_bitwise(eager[0], got[0])
        assert_bitwise(eager[1], got[1])


def test_linear_logp_backward_refuses_residuals_of_another_plan(rlk_triton, monkeypatch):
    """A setting that changes the plan between a forward and its backward is an error naming the
    settings, never a backward over misread residuals."""
    from kernels.ops import linear_logp as op_module

    budget = _linear_logp_plan("in_weight_grad", torch.bfloat16, monkeypatch)
    x = _linear_logp_inputs(torch.bfloat16, seed=10)
    rest = (0.9, None, 0, _llp_v(), budget)
    layout = linear_logp_layout(x["hidden"], x["weight"], x["bias"], x["ids"], 0.9, budget)
    _, stats, kept = torch.ops.rlk.linear_logp(x["hidden"], x["weight"], x["bias"], x["ids"], *rest, True, True, True,
                                               layout)
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "0")
    with pytest.raises(RuntimeError, match="changed between the forward and its backward"):
        torch.ops.rlk.linear_logp_backward(x["grad"], x["hidden"], x["weight"], x["bias"], x["ids"], stats, kept,
                                           *rest, True, True, True)

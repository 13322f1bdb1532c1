"""linear_logp's workspace and settings: the logits kept in the weight gradient or in the budget,
the plans at the issue's shape, the default budget's chunks, every bad setting an error naming it
(save-logits, keep-in-weight-grad, workspace bytes and its minimum, backward matmul, tiles, TMA), the
dispatch serving it from the Triton backend, the budget passed through the public API, no full
logits materialized, and the kernels compiling for sm_90a."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import tolerances
from kernels.ops import value_checks
from kernels.ops import linear_logp as op_module
from kernels.ops.linear_logp import launch as llp_launch
from kernels.ops.linear_logp import plan as llp_plan
from kernels.ops.linear_logp import linear_logp
from kernels.reference.linear_logp import linear_logp as reference_linear_logp
from pytest_rlk.e2e.processes import pythonpath_first
from suites.op.linear_logp_cases import (
    ODD_VOCAB,
    assert_linear_logp_close,
    linear_logp_inputs,
    logp_and_grads,
    plan_of,
    workspace_budget,
)


def test_bad_save_logits_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(op_module.SAVE_LOGITS_ENV, "sometimes")
    leaves, ids = linear_logp_inputs(torch.float32, T=8, H=16, V=40)
    with pytest.raises(ValueError, match=op_module.SAVE_LOGITS_ENV):
        linear_logp(leaves[0], leaves[1], ids, leaves[2])


def _weight_grad_budget(T, H, V, dtype, chunks):
    """A budget whose plan keeps every column in the weight gradient and runs ``chunks`` chunks."""
    block_v = llp_plan._tile_config(dtype).block_v
    return workspace_budget(T, H, V, dtype, -(-V // chunks // block_v) * block_v, in_weight_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_kept_in_the_weight_gradient(monkeypatch, dtype):
    """Where the budget cannot hold the logits and the weight needs a gradient (T <= H), the forward
    keeps them all in the weight gradient's buffer (transposed rows) and the backward returns that
    buffer as dW: log-probs identical to the budget path's (the setting off), gradients within the
    tolerances of the fp32 reference, several chunks, and ``weight.grad`` is the buffer the forward
    allocated."""
    T, H, V = 24, 40, ODD_VOCAB
    budget = _weight_grad_budget(T, H, V, dtype, chunks=3)
    plan = plan_of(T, H, V, dtype, budget, weight_grad=True)
    assert plan.in_weight_grad and plan.saved_cols == V and plan.workspace <= budget
    assert len(llp_plan._even_chunks(0, V, plan.buffer_cols, llp_plan._tile_config(dtype).block_v)) == 3
    assert plan_of(T, H, V, dtype, budget).saved_cols < V, "without the weight gradient, not all fit"
    leaves, ids = linear_logp_inputs(dtype, T=T, H=H, V=V, seed=5)
    hidden, weight, bias = leaves
    ref_logp, ref_grads = logp_and_grads(reference_linear_logp, leaves, ids, 0.7)
    logp = linear_logp(hidden, weight, ids, bias, 0.7, workspace_bytes=budget)
    buffer_ptr = logp.grad_fn.saved_logits.weight_grad.data_ptr()  # no reference kept: autograd may adopt it
    logp.backward(torch.linspace(-1.0, 2.0, T, device=logp.device))
    assert weight.grad.data_ptr() == buffer_ptr, "dW must be the buffer the forward kept the logits in"
    grads = [t.grad for t in leaves]
    assert_linear_logp_close(logp.detach(), grads, ref_logp, ref_grads, dtype)
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "0")
    off_logp, off_grads = logp_and_grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 0.7)
    assert torch.equal(off_logp, logp.detach()), "where the logits are kept must not change the log-probs"
    for name, got, other in zip(("hidden", "weight", "bias"), grads, off_grads):
        tolerances.assert_close(got.float(), other.float(), "linear_logp.grad", dtype, name=f"grad of {name} vs the budget path")


@pytest.mark.parametrize("case", ["weight_without_grad", "setting_off", "tokens_over_hidden"])
def test_logits_stay_in_the_budget_where_the_weight_gradient_cannot_hold_them(monkeypatch, case):
    """The budget path (some columns kept, the rest recomputed) where the weight needs no gradient,
    where RLK_LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD=0 opts out, and where T > H (q would not fit in dW)."""
    T, H, V = (48, 40, ODD_VOCAB) if case == "tokens_over_hidden" else (24, 40, ODD_VOCAB)
    dtype = torch.bfloat16
    budget = workspace_budget(T, H, V, dtype, 2 * llp_plan._tile_config(dtype).block_v)
    leaves, ids = linear_logp_inputs(dtype, T=T, H=H, V=V, seed=6)
    if case == "weight_without_grad":
        leaves[1].requires_grad_(False)
    if case == "setting_off":
        monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "0")
    ref_logp, ref_grads = logp_and_grads(reference_linear_logp, leaves, ids, 0.7)
    logp, grads = logp_and_grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 0.7)
    with torch.enable_grad():
        again = linear_logp(*leaves[:2], ids, leaves[2], 0.7, workspace_bytes=budget)
    saved = again.grad_fn.saved_logits
    assert saved.weight_grad is None and 0 < saved.cols < V, f"{case}: the budget path keeps some columns"
    # without the weight's gradient: those of hidden and bias only
    names = ("hidden", "bias") if case == "weight_without_grad" else ("hidden", "weight", "bias")
    assert len(grads) == len(names)
    tolerances.assert_close(logp, ref_logp, "linear_logp", dtype, name="logp")
    for name, got, want in zip(names, grads, ref_grads):
        tolerances.assert_close(got.float(), want.to(dtype).float(), "linear_logp.grad", dtype, name=f"grad of {name}")


def test_default_budget_keeps_every_logit_in_the_weight_gradient_at_the_issue_shape(monkeypatch):
    """At T = H = 4096, V = 151936 the default 256 MB budget, with the weight's gradient computed,
    keeps every column (three products) within 256 MB; opted out, or without dW, the budget path."""
    T, H, V = ISSUE_SHAPE
    default = llp_plan._plan(*ISSUE_SHAPE, torch.bfloat16, op_module.DEFAULT_WORKSPACE_BYTES, explicit=False,
                              save=True, tp=False, weight_grad=True, interpreted=False)
    assert default.in_weight_grad and default.saved_cols == V and default.dh32
    assert default.workspace <= op_module.DEFAULT_WORKSPACE_BYTES
    assert op_module.kept_vocab_columns(T, H, V, torch.bfloat16) == V
    assert op_module.kept_vocab_columns(T, H, V, torch.bfloat16, weight_grad=False) < V
    assert op_module.planned_workspace_bytes(T, H, V, torch.bfloat16) <= op_module.DEFAULT_WORKSPACE_BYTES
    # a budget that holds every logit in the workspace still keeps them in the weight gradient
    # (faster on an H200: 23.2 against 24.2-24.4 ms), the budget sizing two chunks
    roomy = llp_plan._plan(*ISSUE_SHAPE, torch.bfloat16, int(T * V * 2 * 1.02), explicit=True, save=True, tp=False,
                            weight_grad=True, interpreted=False)
    assert roomy.in_weight_grad and len(llp_plan._even_chunks(0, V, roomy.buffer_cols, 256)) == 2
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "0")
    assert op_module.kept_vocab_columns(T, H, V, torch.bfloat16) < V


def test_bad_keep_in_weight_grad_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "maybe")
    leaves, ids = linear_logp_inputs(torch.float32, T=8, H=16, V=40)
    with pytest.raises(ValueError, match=op_module.KEEP_IN_WEIGHT_GRAD_ENV):
        linear_logp(leaves[0], leaves[1], ids, leaves[2])


ISSUE_SHAPE = (4096, 4096, 151936)


def _issue_plan(budget, explicit=True, weight_grad=False):
    return llp_plan._plan(*ISSUE_SHAPE, torch.bfloat16, budget, explicit=explicit, save=True, tp=False,
                           weight_grad=weight_grad, interpreted=False)


def test_workspace_plans_at_the_issue_shape():
    """Without the weight gradient's buffer (no dW, or opted out): default 256 MB: some columns kept,
    the rest in even chunks of the same buffer, within budget; a budget of the bf16 logits' size keeps
    > 90% of them; ~2% more keeps all (no fp32 dH buffer)."""
    T, H, V = ISSUE_SHAPE
    default = _issue_plan(op_module.DEFAULT_WORKSPACE_BYTES, explicit=False)
    assert default.workspace <= op_module.DEFAULT_WORKSPACE_BYTES and default.dh32
    assert 0 < default.saved_cols < V and default.saved_cols == default.buffer_cols
    widths = [cols for _, cols in llp_plan._even_chunks(default.saved_cols, V, default.buffer_cols, 256)]
    assert max(widths) <= default.buffer_cols and max(widths) - min(widths) < max(widths) // 10, widths
    logits_size = _issue_plan(T * V * 2)
    assert logits_size.workspace <= T * V * 2 and logits_size.saved_cols >= 0.9 * V
    everything = _issue_plan(int(T * V * 2 * 1.02))
    assert everything.saved_cols == V and not everything.dh32
    assert op_module.kept_vocab_columns(T, H, V, torch.bfloat16, int(T * V * 2 * 1.02), weight_grad=False) == V


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "256MB"])
def test_bad_workspace_bytes_is_an_error(value):
    leaves, ids = linear_logp_inputs(torch.float32, T=8, H=16, V=40)
    with pytest.raises(ValueError, match="workspace_bytes must be a positive int"):
        linear_logp(leaves[0], leaves[1], ids, leaves[2], workspace_bytes=value)


def test_workspace_below_the_minimum_names_it():
    leaves, ids = linear_logp_inputs(torch.float32, T=8, H=16, V=40)
    with pytest.raises(ValueError, match=r"workspace_bytes=1000 is below the \d+ bytes linear_logp needs"):
        linear_logp(leaves[0], leaves[1], ids, leaves[2], workspace_bytes=1000)


def test_workspace_setting(monkeypatch):
    """RLK_LINEAR_LOGP_WORKSPACE_BYTES sets the budget when the argument is absent (and is then held
    to it like an explicit one); a bad value names the setting."""
    T, H, V = ISSUE_SHAPE
    monkeypatch.setenv(op_module.WORKSPACE_ENV, str(T * V * 2))
    assert op_module.planned_workspace_bytes(T, H, V, torch.bfloat16) == _issue_plan(T * V * 2, weight_grad=True).workspace
    monkeypatch.setenv(op_module.WORKSPACE_ENV, "1000")
    with pytest.raises(ValueError, match="below"):
        op_module.planned_workspace_bytes(T, H, V, torch.bfloat16)
    monkeypatch.setenv(op_module.WORKSPACE_ENV, "1.2e9")
    with pytest.raises(ValueError, match=op_module.WORKSPACE_ENV):
        op_module.planned_workspace_bytes(T, H, V, torch.bfloat16)


def test_default_budget_keeps_chunks_wide_where_the_shape_needs_more():
    """At T = 16384, H = 8192 the fp32 dH accumulator alone is 537 MB: the default budget grows to
    chunks of 4096 columns rather than failing or crawling; an explicit budget is held to."""
    plan = llp_plan._plan(16384, 8192, 151936, torch.bfloat16, op_module.DEFAULT_WORKSPACE_BYTES,
                           explicit=False, save=True, tp=False, interpreted=False)
    assert plan.buffer_cols == op_module.MIN_DEFAULT_CHUNK_COLS
    with pytest.raises(ValueError, match="below"):
        llp_plan._plan(16384, 8192, 151936, torch.bfloat16, op_module.DEFAULT_WORKSPACE_BYTES,
                        explicit=True, save=True, tp=False, interpreted=False)


def test_bad_backward_matmul_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(op_module.BWD_MATMUL_ENV, "cublas-ish")
    leaves, ids = linear_logp_inputs(torch.float32, T=8, H=16, V=40)
    logp = linear_logp(leaves[0], leaves[1], ids, leaves[2])
    with pytest.raises(ValueError, match="RLK_LINEAR_LOGP_BWD_MATMUL"):
        logp.sum().backward()


def test_bad_tile_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(op_module.TILES_ENV, "128,100,64,8,3")
    with pytest.raises(ValueError, match="powers of two"):
        llp_plan._tile_config(torch.bfloat16, interpreted=False)


@pytest.mark.parametrize("value", ["0", "x"])
def test_bad_tma_setting_is_an_error(monkeypatch, value):
    monkeypatch.setenv(op_module.GROUP_T_ENV, value)
    with pytest.raises(ValueError, match=op_module.GROUP_T_ENV):
        llp_launch._tma_group_t()


def test_dispatch_serves_linear_logp_from_the_triton_backend(triton_strict):
    leaves, ids = linear_logp_inputs(torch.float32, T=20, H=32, V=100)
    hidden, weight, bias = leaves
    backend, impl = kernels.dispatch.select("linear_logp", device=hidden.device, dtype=hidden.dtype,
                                            shape=tuple(hidden.shape), temperature=1.0, tp_world=1)
    # the ops' linear_logp behind the device-side ids check (kernels/ops/value_checks.py)
    assert backend.id == "rlk-triton" and impl is value_checks.linear_logp_call
    got = kernels.linear_logp(hidden, weight, ids, bias)
    want = reference_linear_logp(hidden, weight, ids, bias)
    tolerances.assert_close(got, want, "linear_logp", torch.float32, name="kernels.linear_logp")


def test_never_materializes_full_logits_workspace_bound():
    """The LM head's shape (T = H = 4096, V = 151936) stays within 256 MB of workspace by default
    (computed from the plan)."""
    budget = 256 * 10**6
    for dtype in (torch.bfloat16, torch.float32):
        need = op_module.planned_workspace_bytes(*ISSUE_SHAPE, dtype)
        assert need <= budget, f"{dtype}: workspace {need / 1e6:.0f} MB > 256 MB"
        assert need < 4096 * 151936 * 2, "workspace must be far below one [T, V] bf16 logits buffer"


def test_public_api_passes_the_workspace_budget_to_the_kernels(triton_strict):
    """``kernels.linear_logp(..., workspace_bytes=)`` (the contract's argument, through dispatch) reaches
    the op's plan: a budget below one chunk is the op's error, not ignored; a bad one the contract's."""
    leaves, ids = linear_logp_inputs(torch.float32, T=8, H=16, V=40)
    with pytest.raises(ValueError, match=r"workspace_bytes=1000 is below the \d+ bytes linear_logp needs"):
        kernels.linear_logp(leaves[0], leaves[1], ids, leaves[2], workspace_bytes=1000)
    with pytest.raises(ValueError, match="workspace_bytes must be a positive int"):
        kernels.linear_logp(leaves[0], leaves[1], ids, leaves[2], workspace_bytes=-1)


def _ptxas_missing() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90).path  # noqa: B018 - raises when Triton's CUDA backend has no ptxas
    except Exception as exc:  # noqa: BLE001 - any failure to find the tool is the skip's reason
        return f"Triton's CUDA backend cannot compile here (no ptxas: {exc})"
    return None


# slow: the quick start (tox -e suite, -m "not slow") leaves it out; tox -e tests runs it
@pytest.mark.slow
@pytest.mark.skipif(_ptxas_missing() is not None, reason=str(_ptxas_missing()))
def test_triton_kernels_compile_for_sm_90a():
    """Every Triton kernel of the op in its GPU configs (TMA descriptors, 128x256 tiles) compiles for
    sm_90a with the installed Triton, no GPU needed: the interpreter runs kernels the GPU compiler
    can still reject. A real process, without TRITON_INTERPRET (which this tier sets)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = pythonpath_first(root, environ=env)
    proc = subprocess.run([sys.executable, str(root / "tools/probes/probe_linear_logp.py"), "--compile-check"],
                          check=False, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    compiled = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAILED "))]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(compiled) >= 11 and all(line.startswith("ok ") for line in compiled), proc.stdout

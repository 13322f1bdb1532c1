"""linear_logp parity, vocab-parallel and bad inputs (the vime provider: test_linear_logp_provider.py).

Oracle: kernels.reference.linear_logp (fp32 upcast of hidden and weight before the matmul). On CPU the
Triton kernels run through the interpreter (suites/op/conftest.py sets TRITON_INTERPRET=1 when there
is no CUDA), so shapes stay small: T <= 64, H <= 64, V <= 1031.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kernels
from kernels import tolerances
from kernels.ops import INTERPRETED, value_checks
from kernels.ops import linear_logp as op_module
from kernels.ops.linear_logp import launch as llp_launch
from kernels.ops.linear_logp import passes as llp_passes
from kernels.ops.linear_logp import plan as llp_plan
from kernels.ops.linear_logp import linear_logp
from kernels.reference.linear_logp import linear_logp as reference_linear_logp
from pytest_rlk.e2e.processes import pythonpath_first

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ODD_VOCAB = 1031  # prime: every tile size leaves a partial last tile


def _inputs(dtype, T=24, H=40, V=ODD_VOCAB, bias=True, seed=0, device=DEVICE):
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


def _grads(fn, leaves, ids, temperature, **kw):
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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity_with_fp32_reference(dtype, temperature, rlk_metrics):
    leaves, ids = _inputs(dtype)
    logp, grads = _grads(linear_logp, leaves, ids, temperature)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, temperature)
    assert logp[2].item() == 0.0 and all(g is not None for g in grads)
    assert torch.all(grads[0][2] == 0), "the ignored row (-100) must get a zero hidden gradient"
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, dtype, rlk_metrics)


def _budget(T, H, V, dtype, cols, saved=None, in_weight_grad=False):
    """The workspace budget whose plan uses a buffer of ``cols`` vocab columns (the run's tile sizes),
    keeping ``saved`` (default: as many as the buffer holds; every column with ``in_weight_grad``)
    columns."""
    block_v = llp_plan._tile_config(dtype).block_v
    element = torch.empty((), dtype=dtype).element_size()
    saved = (V if in_weight_grad else min(cols, V)) if saved is None else saved
    return llp_plan._workspace(T, H, V, element, block_v, saved, cols, True, in_weight_grad)


def _plan_of(T, H, V, dtype, budget, save=True, weight_grad=False):
    return llp_plan._plan(T, H, V, dtype, budget, explicit=True, save=save, tp=False, weight_grad=weight_grad)


def test_backward_over_several_vocab_chunks_without_bias():
    """A small workspace budget forces the backward through several recomputed vocab chunks after the
    kept one (dH accumulates across them)."""
    T, H, V = 40, 32, 257
    leaves, ids = _inputs(torch.float32, T=T, H=H, V=V, bias=False, seed=1)
    block_v = llp_plan._tile_config(torch.float32).block_v
    budget = _budget(T, H, V, torch.float32, block_v)
    plan = _plan_of(T, H, V, torch.float32, budget)
    assert plan.saved_cols == block_v and plan.dh32
    assert len(llp_plan._even_chunks(plan.saved_cols, V, plan.buffer_cols, block_v)) > 1, "several chunks"
    logp, grads = _grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 1.0)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 1.0)
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, torch.float32)


@pytest.mark.parametrize("matmul", ["torch", "triton"])
@pytest.mark.parametrize("kept", ["some", "all", "in_weight_grad"])
def test_backward_matmul_options(monkeypatch, matmul, kept):
    """Both backward matmul options (cuBLAS, the default, and our Triton matmul) meet the tolerances,
    over several vocab chunks, with every column kept (dH in one product, no fp32 accumulator) and
    with every column kept in the weight gradient (chunks read transposed)."""
    monkeypatch.setenv(op_module.BWD_MATMUL_ENV, matmul)
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "1" if kept == "in_weight_grad" else "0")
    T, H, V = 24, 32, 257
    block_v = llp_plan._tile_config(torch.bfloat16).block_v
    budget = _budget(T, H, V, torch.bfloat16, block_v, in_weight_grad=kept == "in_weight_grad")
    if kept == "all":
        budget = 10**9
        assert not _plan_of(T, H, V, torch.bfloat16, budget).dh32
    leaves, ids = _inputs(torch.bfloat16, T=T, H=H, V=V, seed=2)
    logp, grads = _grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 0.7)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 0.7)
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, torch.bfloat16)


@pytest.mark.skipif(not INTERPRETED, reason="on a Hopper GPU the TMA kernel is the bf16 default (covered above)")
@pytest.mark.parametrize("group_t", ["4096", "1"], ids=["token_tile_fastest", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tma_kernel_through_the_interpreter(monkeypatch, dtype, group_t):
    """The persistent TMA kernel (GPU default for bf16/fp16) forced on in the interpreter: partial
    tiles in T, V and K (H = 40), bias, an ignored row, several backward chunks, both tile orders."""
    monkeypatch.setattr(llp_launch, "TMA_IN_INTERPRETER", True)
    monkeypatch.setenv(op_module.GROUP_T_ENV, group_t)
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "0")  # the backward recomputes (in the TMA kernel)
    launched = []
    kernel = llp_launch._tma_tiles_kernel

    class _Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(llp_launch, "_tma_tiles_kernel", _Spy())
    T, H = 40, 40
    budget = _budget(T, H, ODD_VOCAB, dtype, 2 * llp_plan._tile_config(dtype).block_v)
    leaves, ids = _inputs(dtype, T=T, H=H, V=ODD_VOCAB, seed=3)
    logp, grads = _grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 0.7)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 0.7)
    assert len(launched) > 2, "forward plus several backward chunks must run the TMA kernel"
    assert torch.all(grads[0][2] == 0)
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, dtype)


# the quick start keeps one kept-logits case per path ("some"); tox -e tests runs them all
@pytest.mark.parametrize("kept", ["some", pytest.param("all", marks=pytest.mark.slow),
                                  pytest.param("in_weight_grad", marks=pytest.mark.slow)])
# the TMA paths through the interpreter are slow: the quick start keeps the default path's cases
@pytest.mark.parametrize("path", ["default", pytest.param("tma", marks=pytest.mark.slow),
                                  pytest.param("tma_store", marks=pytest.mark.slow)])
def test_kept_logits_match_recompute(monkeypatch, path, kept):
    """The forward keeps the logits (exp(z - tile max)) of the columns the budget allows, or all of
    them in the weight gradient's buffer; the backward turns them into dlogits instead of recomputing
    them. Same tolerances as the recompute path, through the default kernel, the TMA kernel and its
    TMA stores (interpreter), with some columns kept (the rest recomputed in chunks), all kept, and
    all kept in the weight gradient (several chunks); no_grad keeps nothing; a second backward over
    the same graph (retain_graph) recomputes and agrees."""
    if path != "default" and not INTERPRETED:
        pytest.skip("the TMA paths are the GPU default for bf16 (covered by the parity tests there)")
    monkeypatch.setattr(llp_launch, "TMA_IN_INTERPRETER", path != "default")
    for knob in ("TMA_STORE_Q", "TMA_STORE_DLOGITS"):
        monkeypatch.setattr(llp_launch, knob, path == "tma_store")
    in_grad = kept == "in_weight_grad"
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "1" if in_grad else "0")
    T, H, V = 40, 40, ODD_VOCAB
    budget = _budget(T, H, V, torch.bfloat16, 2 * llp_plan._tile_config(torch.bfloat16).block_v, in_weight_grad=in_grad)
    if kept == "all":
        budget = 10**9
    plan = _plan_of(T, H, V, torch.bfloat16, budget, weight_grad=in_grad)
    assert (plan.saved_cols == V) == (kept != "some") and plan.in_weight_grad == in_grad
    finished = []
    finish = llp_passes._saved_dlogits
    monkeypatch.setattr(llp_passes, "_saved_dlogits", lambda *a: finished.append(1) or finish(*a))
    ours = functools.partial(linear_logp, workspace_bytes=budget)
    leaves, ids = _inputs(torch.bfloat16, T=T, H=H, V=V, seed=4)
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 0.7)
    got = {}
    for save in ("1", "0"):
        monkeypatch.setenv(op_module.SAVE_LOGITS_ENV, save)
        got[save] = _grads(ours, leaves, ids, 0.7)
        assert_linear_logp_close(*got[save], ref_logp, ref_grads, torch.bfloat16)
    kept_pieces = len(finished)  # the kept block, or each chunk of the weight gradient's rows
    block_v = llp_plan._tile_config(torch.bfloat16).block_v
    assert kept_pieces == (len(llp_plan._even_chunks(0, V, plan.buffer_cols, block_v)) if in_grad else 1), \
        "only the saving run may take the kept-logits path"
    assert in_grad == (kept_pieces > 1)
    assert torch.equal(got["1"][0], got["0"][0]), "keeping logits must not change the forward's log-probs"
    monkeypatch.setenv(op_module.SAVE_LOGITS_ENV, "1")
    hidden, weight, bias = leaves
    logp = ours(hidden, weight, ids, bias, 0.7)
    upstream = torch.linspace(-1.0, 2.0, logp.shape[0], device=logp.device)
    first = torch.autograd.grad(logp, (hidden, weight, bias), upstream, retain_graph=True)
    second = torch.autograd.grad(logp, (hidden, weight, bias), upstream)
    assert len(finished) == 2 * kept_pieces, "the second backward must recompute (the kept logits were consumed)"
    for a, b in zip(first, second):
        tolerances.assert_close(a.float(), b.float(), "linear_logp.grad", torch.bfloat16, name="second backward")
    with torch.no_grad():
        ours(hidden, weight, ids, bias, 0.7)
    assert len(finished) == 2 * kept_pieces


def test_bad_save_logits_setting_is_an_error(monkeypatch):
    monkeypatch.setenv(op_module.SAVE_LOGITS_ENV, "sometimes")
    leaves, ids = _inputs(torch.float32, T=8, H=16, V=40)
    with pytest.raises(ValueError, match=op_module.SAVE_LOGITS_ENV):
        linear_logp(leaves[0], leaves[1], ids, leaves[2])


def _weight_grad_budget(T, H, V, dtype, chunks):
    """A budget whose plan keeps every column in the weight gradient and runs ``chunks`` chunks."""
    block_v = llp_plan._tile_config(dtype).block_v
    return _budget(T, H, V, dtype, -(-V // chunks // block_v) * block_v, in_weight_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_kept_in_the_weight_gradient(monkeypatch, dtype):
    """Where the budget cannot hold the logits and the weight needs a gradient (T <= H), the forward
    keeps them all in the weight gradient's buffer (transposed rows) and the backward returns that
    buffer as dW: log-probs identical to the budget path's (the setting off), gradients within the
    tolerances of the fp32 reference, several chunks, and ``weight.grad`` is the buffer the forward
    allocated."""
    T, H, V = 24, 40, ODD_VOCAB
    budget = _weight_grad_budget(T, H, V, dtype, chunks=3)
    plan = _plan_of(T, H, V, dtype, budget, weight_grad=True)
    assert plan.in_weight_grad and plan.saved_cols == V and plan.workspace <= budget
    assert len(llp_plan._even_chunks(0, V, plan.buffer_cols, llp_plan._tile_config(dtype).block_v)) == 3
    assert _plan_of(T, H, V, dtype, budget).saved_cols < V, "without the weight gradient, not all fit"
    leaves, ids = _inputs(dtype, T=T, H=H, V=V, seed=5)
    hidden, weight, bias = leaves
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 0.7)
    logp = linear_logp(hidden, weight, ids, bias, 0.7, workspace_bytes=budget)
    buffer_ptr = logp.grad_fn.saved_logits.weight_grad.data_ptr()  # no reference kept: autograd may adopt it
    logp.backward(torch.linspace(-1.0, 2.0, T, device=logp.device))
    assert weight.grad.data_ptr() == buffer_ptr, "dW must be the buffer the forward kept the logits in"
    grads = [t.grad for t in leaves]
    assert_linear_logp_close(logp.detach(), grads, ref_logp, ref_grads, dtype)
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "0")
    off_logp, off_grads = _grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 0.7)
    assert torch.equal(off_logp, logp.detach()), "where the logits are kept must not change the log-probs"
    for name, got, other in zip(("hidden", "weight", "bias"), grads, off_grads):
        tolerances.assert_close(got.float(), other.float(), "linear_logp.grad", dtype, name=f"grad of {name} vs the budget path")


@pytest.mark.parametrize("case", ["weight_without_grad", "setting_off", "tokens_over_hidden"])
def test_logits_stay_in_the_budget_where_the_weight_gradient_cannot_hold_them(monkeypatch, case):
    """The budget path (some columns kept, the rest recomputed) where the weight needs no gradient,
    where RLK_LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD=0 opts out, and where T > H (q would not fit in dW)."""
    T, H, V = (48, 40, ODD_VOCAB) if case == "tokens_over_hidden" else (24, 40, ODD_VOCAB)
    dtype = torch.bfloat16
    budget = _budget(T, H, V, dtype, 2 * llp_plan._tile_config(dtype).block_v)
    leaves, ids = _inputs(dtype, T=T, H=H, V=V, seed=6)
    if case == "weight_without_grad":
        leaves[1].requires_grad_(False)
    if case == "setting_off":
        monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "0")
    ref_logp, ref_grads = _grads(reference_linear_logp, leaves, ids, 0.7)
    logp, grads = _grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 0.7)
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
    leaves, ids = _inputs(torch.float32, T=8, H=16, V=40)
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
    leaves, ids = _inputs(torch.float32, T=8, H=16, V=40)
    with pytest.raises(ValueError, match="workspace_bytes must be a positive int"):
        linear_logp(leaves[0], leaves[1], ids, leaves[2], workspace_bytes=value)


def test_workspace_below_the_minimum_names_it():
    leaves, ids = _inputs(torch.float32, T=8, H=16, V=40)
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
    leaves, ids = _inputs(torch.float32, T=8, H=16, V=40)
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
    leaves, ids = _inputs(torch.float32, T=20, H=32, V=100)
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
    leaves, ids = _inputs(torch.float32, T=8, H=16, V=40)
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


# --------------------------------------------------------------------------------------------
# Vocab-parallel: two gloo processes on CPU (or two GPUs when present)
# --------------------------------------------------------------------------------------------

TP_CASES = [(torch.float32, 0.7, True), (torch.bfloat16, 1.0, False)]
TP_SHAPE = {"T": 16, "H": 32}  # V stays ODD_VOCAB: unequal shards (516 + 515)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def _tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    # CPU: gloo + the interpreter; GPU machine: one GPU per rank + NCCL.
    device = "cpu" if INTERPRETED else f"cuda:{rank}"
    if not INTERPRETED:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if INTERPRETED else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        results = []
        for dtype, temperature, bias in TP_CASES:
            (hidden, weight, b), ids = _inputs(dtype, bias=bias, device=device, **TP_SHAPE)
            hidden, weight = hidden.detach(), weight.detach()
            b = None if b is None else b.detach()
            width = -(-ODD_VOCAB // world)
            start, stop = rank * width, min(ODD_VOCAB, (rank + 1) * width)
            # shard-edge targets: last id of shard 0 and first of shard 1
            ids[4:6] = torch.tensor([width - 1, width], device=device)
            shard = [hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()]
            shard.append(None if b is None else b[start:stop].clone().requires_grad_())
            kw = {"tp_group": dist.group.WORLD, "vocab_start": start, "global_vocab": ODD_VOCAB}
            ours = _grads(linear_logp, shard, ids, temperature, **kw)
            ref = _grads(reference_linear_logp, shard, ids, temperature, **kw)
            results.append(_to_cpu({"ours": ours, "ref": ref, "start": start, "stop": stop, "ids": ids}))
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not INTERPRETED and torch.cuda.device_count() < 2,
                    reason="vocab-parallel TP=2 needs the CPU interpreter (gloo) or 2 GPUs (NCCL)")
def test_vocab_parallel_tp2_matches_single_device_reference(tmp_path):
    world = 2
    mp.spawn(_tp_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for case_index, (dtype, temperature, bias) in enumerate(TP_CASES):
        (hidden, weight, b), _ = _inputs(dtype, bias=bias, device="cpu", **TP_SHAPE)
        full = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
        full.append(None if b is None else b.detach().requires_grad_())
        ids = per_rank[0][case_index]["ids"]
        want_logp, want_grads = _grads(reference_linear_logp, full, ids, temperature)
        for rank in range(world):
            case = per_rank[rank][case_index]
            lo, hi = case["start"], case["stop"]
            sliced = [want_grads[0], want_grads[1][lo:hi]] + ([want_grads[2][lo:hi]] if bias else [])
            for label in ("ours", "ref"):
                logp, grads = case[label]
                assert_linear_logp_close(logp, grads, want_logp, sliced, dtype)
        assert torch.equal(per_rank[0][case_index]["ours"][0], per_rank[1][case_index]["ours"][0]), \
            "every rank must return the same log-probs"


# --------------------------------------------------------------------------------------------
# Bad inputs: one test per error, each naming the input
# --------------------------------------------------------------------------------------------


def _good():
    (hidden, weight, bias), ids = _inputs(torch.float32, T=8, H=16, V=40)
    return {"hidden": hidden, "weight": weight, "target_ids": ids, "bias": bias}


BAD_INPUTS = {
    "hidden_not_2d": (lambda a: a.update(hidden=a["hidden"][None]), "hidden must be 2-D"),
    "hidden_int": (lambda a: a.update(hidden=a["hidden"].long()), "hidden dtype"),
    "weight_dtype_mismatch": (lambda a: a.update(weight=a["weight"].double()), "weight dtype"),
    "weight_wrong_H": (lambda a: a.update(weight=a["weight"][:, :8]), "weight must be [V_local, H=16]"),
    "weight_not_tensor": (lambda a: a.update(weight=[1.0]), "weight must be a torch.Tensor"),
    "empty_hidden": (lambda a: a.update(hidden=a["hidden"][:0], target_ids=a["target_ids"][:0]), "hidden is empty"),
    "bias_wrong_shape": (lambda a: a.update(bias=a["bias"][:-1]), "bias must have shape [40]"),
    "ids_out_of_range": (lambda a: a["target_ids"].__setitem__(0, 40), "target_ids has 1 id(s) outside [0, 40)"),
    "ids_wrong_length": (lambda a: a.update(target_ids=a["target_ids"][:-1]), "target_ids must have shape [8]"),
    "ids_float": (lambda a: a.update(target_ids=a["target_ids"].float()), "target_ids dtype"),
    "temperature_zero": (lambda a: a.update(temperature=0.0), "temperature must be a finite float > 0"),
    "vocab_start_without_tp": (lambda a: a.update(vocab_start=8), "without tp_group"),
    "negative_vocab_start": (lambda a: a.update(vocab_start=-1), "vocab_start must be an int >= 0"),
    "global_vocab_too_small": (lambda a: a.update(global_vocab=10), "global_vocab must be an int >= "),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_it(case):
    mutate, message = BAD_INPUTS[case]
    args = _good()
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        linear_logp(**args)


def test_tp_group_requires_global_vocab():
    args = _good()
    with pytest.raises(ValueError, match="global_vocab is required with tp_group"):
        linear_logp(**args, tp_group=object())

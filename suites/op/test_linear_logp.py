"""linear_logp parity, vocab-parallel and bad inputs (its workspace and settings:
test_linear_logp_workspace.py; the vime provider: test_linear_logp_provider.py).

Oracle: kernels.reference.linear_logp (fp32 upcast of hidden and weight before the matmul). On CPU the
Triton kernels run through the interpreter (suites/op/conftest.py sets TRITON_INTERPRET=1 when there
is no CUDA), so shapes stay small: T <= 64, H <= 64, V <= 1031.
"""

from __future__ import annotations

import functools
import re
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels import tolerances
from kernels.ops import INTERPRETED
from kernels.ops import linear_logp as op_module
from kernels.ops.linear_logp import launch as llp_launch
from kernels.ops.linear_logp import passes as llp_passes
from kernels.ops.linear_logp import plan as llp_plan
from kernels.ops.linear_logp import linear_logp
from kernels.reference.linear_logp import linear_logp as reference_linear_logp
from suites.op.linear_logp_cases import (
    ODD_VOCAB,
    assert_linear_logp_close,
    linear_logp_inputs,
    logp_and_grads,
    plan_of,
    workspace_budget,
)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity_with_fp32_reference(dtype, temperature, rlk_metrics):
    leaves, ids = linear_logp_inputs(dtype)
    logp, grads = logp_and_grads(linear_logp, leaves, ids, temperature)
    ref_logp, ref_grads = logp_and_grads(reference_linear_logp, leaves, ids, temperature)
    assert logp[2].item() == 0.0 and all(g is not None for g in grads)
    assert torch.all(grads[0][2] == 0), "the ignored row (-100) must get a zero hidden gradient"
    assert_linear_logp_close(logp, grads, ref_logp, ref_grads, dtype, rlk_metrics)


def test_backward_over_several_vocab_chunks_without_bias():
    """A small workspace budget forces the backward through several recomputed vocab chunks after the
    kept one (dH accumulates across them)."""
    T, H, V = 40, 32, 257
    leaves, ids = linear_logp_inputs(torch.float32, T=T, H=H, V=V, bias=False, seed=1)
    block_v = llp_plan._tile_config(torch.float32).block_v
    budget = workspace_budget(T, H, V, torch.float32, block_v)
    plan = plan_of(T, H, V, torch.float32, budget)
    assert plan.saved_cols == block_v and plan.dh32
    assert len(llp_plan._even_chunks(plan.saved_cols, V, plan.buffer_cols, block_v)) > 1, "several chunks"
    logp, grads = logp_and_grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 1.0)
    ref_logp, ref_grads = logp_and_grads(reference_linear_logp, leaves, ids, 1.0)
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
    budget = workspace_budget(T, H, V, torch.bfloat16, block_v, in_weight_grad=kept == "in_weight_grad")
    if kept == "all":
        budget = 10**9
        assert not plan_of(T, H, V, torch.bfloat16, budget).dh32
    leaves, ids = linear_logp_inputs(torch.bfloat16, T=T, H=H, V=V, seed=2)
    logp, grads = logp_and_grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 0.7)
    ref_logp, ref_grads = logp_and_grads(reference_linear_logp, leaves, ids, 0.7)
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
    budget = workspace_budget(T, H, ODD_VOCAB, dtype, 2 * llp_plan._tile_config(dtype).block_v)
    leaves, ids = linear_logp_inputs(dtype, T=T, H=H, V=ODD_VOCAB, seed=3)
    logp, grads = logp_and_grads(functools.partial(linear_logp, workspace_bytes=budget), leaves, ids, 0.7)
    ref_logp, ref_grads = logp_and_grads(reference_linear_logp, leaves, ids, 0.7)
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
    budget = workspace_budget(T, H, V, torch.bfloat16, 2 * llp_plan._tile_config(torch.bfloat16).block_v, in_weight_grad=in_grad)
    if kept == "all":
        budget = 10**9
    plan = plan_of(T, H, V, torch.bfloat16, budget, weight_grad=in_grad)
    assert (plan.saved_cols == V) == (kept != "some") and plan.in_weight_grad == in_grad
    finished = []
    finish = llp_passes._saved_dlogits
    monkeypatch.setattr(llp_passes, "_saved_dlogits", lambda *a: finished.append(1) or finish(*a))
    ours = functools.partial(linear_logp, workspace_bytes=budget)
    leaves, ids = linear_logp_inputs(torch.bfloat16, T=T, H=H, V=V, seed=4)
    ref_logp, ref_grads = logp_and_grads(reference_linear_logp, leaves, ids, 0.7)
    got = {}
    for save in ("1", "0"):
        monkeypatch.setenv(op_module.SAVE_LOGITS_ENV, save)
        got[save] = logp_and_grads(ours, leaves, ids, 0.7)
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
            (hidden, weight, b), ids = linear_logp_inputs(dtype, bias=bias, device=device, **TP_SHAPE)
            hidden, weight = hidden.detach(), weight.detach()
            b = None if b is None else b.detach()
            width = -(-ODD_VOCAB // world)
            start, stop = rank * width, min(ODD_VOCAB, (rank + 1) * width)
            # shard-edge targets: last id of shard 0 and first of shard 1
            ids[4:6] = torch.tensor([width - 1, width], device=device)
            shard = [hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()]
            shard.append(None if b is None else b[start:stop].clone().requires_grad_())
            kw = {"tp_group": dist.group.WORLD, "vocab_start": start, "global_vocab": ODD_VOCAB}
            ours = logp_and_grads(linear_logp, shard, ids, temperature, **kw)
            ref = logp_and_grads(reference_linear_logp, shard, ids, temperature, **kw)
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
        (hidden, weight, b), _ = linear_logp_inputs(dtype, bias=bias, device="cpu", **TP_SHAPE)
        full = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
        full.append(None if b is None else b.detach().requires_grad_())
        ids = per_rank[0][case_index]["ids"]
        want_logp, want_grads = logp_and_grads(reference_linear_logp, full, ids, temperature)
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
    (hidden, weight, bias), ids = linear_logp_inputs(torch.float32, T=8, H=16, V=40)
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

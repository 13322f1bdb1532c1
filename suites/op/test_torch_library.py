"""The public ops as PyTorch operators (kernels/library/): opcheck, fullgraph compile, CUDA graphs.

* ``torch.library.opcheck`` of every forward and backward operator (schema, fake tensor, autograd
  registration, AOT dispatch with dynamic shapes), on the reference and on rlk-triton (the Triton
  interpreter on CPU);
* ``torch.compile(fullgraph=True)`` of each op, forward and backward, and of a training-style
  function calling all four: no graph break, the eager result bitwise;
* rlk-triton's splits: no autograd run inside its operators; ``linear_logp``'s under every plan
  of its workspace, its forward run once per compiled forward and backward;
* vocab-parallel calls (the group passed by name) in real gloo processes, world size 1 and 2:
  fullgraph, the eager bits;
* ``grpo_loss(inplace_backward=True)`` under compile: a graph break that names its reason, and
  a warning, with the eager semantics (the logits buffer holds dlogits);
* the private PyTorch APIs the operators use (kernels/library/torch_internals.py) still work;
* the dispatch inside compiled code: fallbacks counted per call, strict mode raising;
* on a GPU: each op's forward and backward captured in a CUDA graph and replayed (default
  configuration and kernels on), eager and compiled.

Shapes are tiny: the point is the operator plumbing; the ops' values are the parity tests'.
"""

from __future__ import annotations

import logging
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kernels
import kernels.library  # registers torch.ops.rlk.*
from kernels.contracts import LinearLogpCall, LossConfig
from kernels.library import grpo_loss as grpo_loss_library
from kernels.library import linear_logp as linear_logp_library
from kernels.library import logp as logp_library
from kernels.library import ratio_kl as ratio_kl_library
from kernels.library import torch_internals
from suites.op.rlk_op_cases import DEVICE

T, V, H = 6, 37, 8
CONFIG = LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.01)
BACKENDS = ("reference", "rlk-triton")
SWITCHES = ("VIME_RL_KERNEL", "VIME_RL_KERNEL_STRICT", "VIME_RL_KERNEL_OPS", "VIME_RL_KERNEL_BACKEND")
KERNELS_ON = {"VIME_RL_KERNEL": "1", "VIME_RL_KERNEL_STRICT": "1"}


@pytest.fixture(autouse=True)
def _dynamo_enabled():
    """torch.compile is a no-op under TORCHDYNAMO_DISABLE=1: the compile tests would pass vacuously."""
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        pytest.fail("TORCHDYNAMO_DISABLE=1 in this process: torch.compile does nothing, so these tests prove nothing")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Every switch cleared (the default: the reference), or the kernels on, strict."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    if request.param == "rlk-triton":
        for name, value in KERNELS_ON.items():
            monkeypatch.setenv(name, value)
    kernels.reset_fallback_counts()
    yield request.param
    assert kernels.fallback_counts() == {}
    torch._dynamo.reset()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = V) -> dict[str, torch.Tensor]:
    """One tiny batch on DEVICE: logits [T, vocab], ids (one ignored row), per-token inputs,
    hidden/weight/bias (V rows)."""
    g = _gen(seed)
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


# op -> (differentiable inputs, function of the batch returning the op's outputs as a tuple)
def _logp(x):
    return (kernels.logp(x["logits"], x["ids"], 0.7),)


def _ratio_kl(x):
    return kernels.ratio_kl(x["logp"], x["old_logp"], x["ref_logp"], x["mask"], kl_type="k3")


def _grpo_loss(x):
    loss, metrics = kernels.grpo_loss(x["logits"], x["ids"], old_logp=x["old_logp"], ref_logp=x["ref_logp"],
                                      advantages=x["advantages"], loss_mask=x["mask"], lengths=x["lengths"],
                                      config=CONFIG, temperature=0.9)
    return (loss, *metrics.values())


def _linear_logp(x):
    return (kernels.linear_logp(x["hidden"], x["weight"], x["ids"], x["bias"], 0.9),)


OPS = {"logp": (("logits",), _logp), "ratio_kl": (("logp",), _ratio_kl),
       "grpo_loss": (("logits",), _grpo_loss), "linear_logp": (("hidden", "weight", "bias"), _linear_logp)}


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


# -- opcheck ---------------------------------------------------------------------------------------

def _opcheck_samples(x: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Arguments of every operator (forward with the differentiable inputs requiring grad)."""
    c = CONFIG
    grad = lambda t: t.detach().requires_grad_()
    config = (c.eps_clip, c.eps_clip_high, c.eps_clip_c, c.kl_loss_coef, c.kl_type, c.use_unbiased_kl, c.use_tis,
              c.tis_clip_low, c.tis_clip_high, c.reduction, c.gspo)
    stats = torch.ops.rlk.logp(x["logits"], x["ids"], 0.7, -100, None, True)[1]
    grpo_inputs = (x["ids"], x["old_logp"], x["ref_logp"], x["advantages"], x["mask"], x["lengths"], None, None,
                   *config, 0.9, -100, None)
    residual = torch.ops.rlk.grpo_loss(x["logits"], *grpo_inputs, True)[2]
    return {
        "logp": (grad(x["logits"]), x["ids"], 0.7, -100, None, True),
        "logp_backward": (x["grad"], x["logits"], x["ids"], stats, 0.7, -100, None),
        "ratio_kl": (grad(x["logp"]), x["old_logp"], x["ref_logp"], x["mask"], "k3", True),
        "ratio_kl_backward": (x["grad"], x["grad"] * 2, x["logp"], x["old_logp"], x["ref_logp"], x["mask"], "k3", True),
        "grpo_loss": (grad(x["logits"]), *grpo_inputs, True),
        "grpo_loss_backward": (torch.tensor(0.5, device=DEVICE), residual, x["logits"], *grpo_inputs),
        **_linear_logp_opcheck_samples(x),
    }


def _linear_logp_layout(hidden, weight, bias, ids, temperature, workspace_bytes=None) -> list[int]:
    """The residual layout the public function passes to the forward operator (every gradient)."""
    call = LinearLogpCall(hidden, weight, ids, bias, temperature, workspace_bytes=workspace_bytes)
    return linear_logp_library.residual_layout(call, (True, True, True))


def _linear_logp_opcheck_samples(x: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """linear_logp's operators; the backward's residuals from its forward (the weight gradient's
    layout on rlk-triton: T <= H)."""
    grad = lambda t: t.detach().requires_grad_()
    rest = (0.9, None, 0, V, None)
    layout = _linear_logp_layout(x["hidden"], x["weight"], x["bias"], x["ids"], 0.9)
    forward = (x["ids"], *rest, True, True, True, layout)
    _, stats, kept = torch.ops.rlk.linear_logp(x["hidden"], x["weight"], x["bias"], *forward)
    return {
        "linear_logp": (grad(x["hidden"]), grad(x["weight"]), grad(x["bias"]), *forward),
        "linear_logp_backward": (x["grad"], x["hidden"], x["weight"], x["bias"], x["ids"], stats, kept, *rest,
                                 True, True, True),
    }


@pytest.mark.parametrize("operator", ["logp", "logp_backward", "ratio_kl", "ratio_kl_backward", "grpo_loss",
                                      "grpo_loss_backward", "linear_logp", "linear_logp_backward"])
def test_opcheck(operator, backend):
    """Schema, fake tensor, autograd registration and AOT dispatch (dynamic shapes) of each operator."""
    args = _opcheck_samples(inputs())[operator]
    result = torch.library.opcheck(getattr(torch.ops.rlk, operator).default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


# -- torch.compile(fullgraph=True) -------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_fullgraph_compile_equals_eager(op, backend):
    """The op compiles without a graph break, and forward and backward give the eager bits."""
    wrt, fn = OPS[op]
    x = inputs()
    eager = run_with_grads(fn, x, wrt)
    compiled = run_with_grads(torch.compile(fn, fullgraph=True), x, wrt)
    assert_bitwise(eager[0], compiled[0])
    assert_bitwise(eager[1], compiled[1])


def _training_step(x):
    """A training-style function: hidden -> linear_logp; logits -> logp, ratio/KL and the GRPO loss."""
    logp_h = kernels.linear_logp(x["hidden"], x["weight"], x["ids"], x["bias"])
    logp = kernels.logp(x["logits"], x["ids"])
    ratio, kl = kernels.ratio_kl(logp, x["old_logp"], x["ref_logp"], x["mask"])
    loss, metrics = kernels.grpo_loss(x["logits"], x["ids"], old_logp=x["old_logp"], ref_logp=x["ref_logp"],
                                      advantages=x["advantages"], loss_mask=x["mask"], lengths=x["lengths"],
                                      config=CONFIG)
    return loss, logp_h, logp, ratio, kl, metrics["pg_clipfrac"]


def test_training_step_fullgraph(backend):
    """All four ops in one compiled function: one graph, the eager outputs and gradients bitwise."""
    x = inputs(seed=3)
    wrt = ("logits", "hidden", "weight", "bias")
    eager = run_with_grads(_training_step, x, wrt)
    explanation = torch._dynamo.explain(_training_step)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = run_with_grads(torch.compile(_training_step, fullgraph=True), x, wrt)
    assert_bitwise(eager[0], compiled[0])
    assert_bitwise(eager[1], compiled[1])


# -- grpo_loss: any loss gradient, no [T, V] residual ------------------------------------------------

def _grpo_loss_grads(fn, x: dict[str, torch.Tensor], grad_loss: float, **kwargs):
    """(loss and metrics, dlogits for the incoming gradient ``grad_loss``) of ``fn`` = grpo_loss."""
    logits = x["logits"].detach().requires_grad_()
    loss, metrics = fn(logits, x["ids"], old_logp=x["old_logp"], ref_logp=x["ref_logp"], advantages=x["advantages"],
                       loss_mask=x["mask"], lengths=x["lengths"], **{"config": CONFIG, "temperature": 0.9, **kwargs})
    (grad,) = torch.autograd.grad(loss, logits, torch.tensor(grad_loss, device=loss.device))
    return [loss.detach(), *(m.detach() for m in metrics.values())], [grad]


@pytest.mark.parametrize("grad_loss", [1.0, 0.37])
def test_grpo_loss_compiled_equals_eager_for_any_loss_gradient(backend, grad_loss):
    """The compiled call's backward runs the eager backward's kernels: the eager bits for
    ``loss.backward()`` and for any other incoming gradient."""
    x = inputs(seed=4)
    eager = _grpo_loss_grads(kernels.grpo_loss, x, grad_loss)
    compiled = _grpo_loss_grads(torch.compile(kernels.grpo_loss, fullgraph=True), x, grad_loss)
    assert_bitwise(eager[0], compiled[0])
    assert_bitwise(eager[1], compiled[1])


def _aot_graphs(fn, leaf: torch.Tensor) -> dict[str, torch.fx.GraphModule]:
    """The forward and backward graphs AOTAutograd hands the compiler for ``fn(leaf)`` (fullgraph; a
    scalar output, differentiated w.r.t. ``leaf``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name):
        def compiler(gm, _example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")),
                             fullgraph=True)
    torch.autograd.grad(compiled(leaf), leaf)
    return graphs


def test_grpo_loss_holds_no_logits_sized_tensor_between_forward_and_backward(backend):
    """What the compiled forward saves for the backward: the logits themselves (an input, no
    memory of its own) and [4, T] statistics, never a [T, V] tensor the forward made (dlogits)."""
    x = inputs(seed=6)
    logits = x["logits"].detach().requires_grad_()

    def step(logits):
        return _grpo_loss(dict(x, logits=logits))[0]

    graphs = _aot_graphs(step, logits)
    (outputs,) = graphs["forward"].graph.find_nodes(op="output")[0].args
    sized = [node for node in outputs if isinstance(node, torch.fx.Node)
             and tuple(node.meta["val"].shape) == (T, V)]
    assert sized and all(node.op == "placeholder" for node in sized), [(n.op, n.target) for n in sized]
    (backward_call,) = graphs["backward"].graph.find_nodes(op="call_function",
                                                           target=torch.ops.rlk.grpo_loss_backward.default)
    residual = backward_call.args[1]
    assert tuple(residual.meta["val"].shape) == (4, T)
    torch._dynamo.reset()


# (dtype, V, temperature) on the one-read path: one CTA per row (V = 1032) and clusters of 4 (bf16)
# and 8 (fp32) CTAs (V = 151936)
ONE_READ_CASES = [(torch.bfloat16, 1032, 0.9), (torch.float32, 1032, 1.0), (torch.bfloat16, 151936, 1.0),
                  (torch.float32, 151936, 0.9)]


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "vocab", "temperature"), ONE_READ_CASES,
                         ids=[f"{str(d)[6:]}-V{v}-T{t}" for d, v, t in ONE_READ_CASES])
def test_grpo_loss_one_read_compiled_equals_eager(dtype, vocab, temperature, monkeypatch):
    """On the one-read path (the forward operator runs the cluster kernel for its statistics only, the
    backward writes dlogits from them for the gradient it reads on the device,
    kernels/library/grpo_loss.py): compiled == eager bitwise for a training loop's incoming
    gradients (1, vime's 8 / 256, 0.37), the eager call once with a stale prediction (the forward
    writes dlogits for the previous gradient: a miss, rewritten in the backward) and once with the
    right one (a hit), the write kernel launched by each compiled backward; opcheck of both
    operators on the largest rows."""
    from kernels.ops.cuda import grpo_loss_one_read

    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for name, value in KERNELS_ON.items():
        monkeypatch.setenv(name, value)
    x = inputs(dtype, seed=8, vocab=vocab)
    plan = grpo_loss_one_read.plan(x["logits"])
    if isinstance(plan, str):
        pytest.skip(f"the one-read kernel does not run here: {plan}")
    writes = []
    write_from_stats = grpo_loss_one_read.write_from_stats
    monkeypatch.setattr(grpo_loss_one_read, "write_from_stats", lambda *a: writes.append(1) or write_from_stats(*a))
    compiled = torch.compile(kernels.grpo_loss, fullgraph=True)
    try:
        for grad_loss in (1.0, 8 / 256, 0.37):
            eager = _grpo_loss_grads(kernels.grpo_loss, x, grad_loss, temperature=temperature)  # a miss (but 1.0)
            eager_hit = _grpo_loss_grads(kernels.grpo_loss, x, grad_loss, temperature=temperature)
            writes.clear()
            got = _grpo_loss_grads(compiled, x, grad_loss, temperature=temperature)
            assert writes == [1], "the compiled backward did not take the one-read write kernel"
            for other in (eager_hit, got):
                assert_bitwise(eager[0], other[0])
                assert_bitwise(eager[1], other[1])
    finally:
        torch._dynamo.reset()
    if vocab > 100000 and dtype == torch.float32:
        samples = _opcheck_samples(x)
        for operator in ("grpo_loss", "grpo_loss_backward"):
            result = torch.library.opcheck(getattr(torch.ops.rlk, operator).default, samples[operator])
            assert all(v == "SUCCESS" for v in result.values()), (operator, result)


# -- rlk-triton's splits ------------------------------------------------------------------------------

def _generic_split_forbidden(*args, **kwargs):
    raise AssertionError("the generic split (an autograd run inside the operator) served an rlk-triton call")


@pytest.mark.parametrize("op", ["logp", "ratio_kl", "grpo_loss"])
def test_rlk_triton_splits_run_no_autograd_inside(op, monkeypatch):
    """rlk-triton's logp, ratio_kl and grpo_loss operators run their kernels directly, forward and
    backward (no recomputed forward, no nested autograd engine run), for the eager bits."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for name, value in KERNELS_ON.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(logp_library, "recomputed_grads", _generic_split_forbidden)
    monkeypatch.setattr(ratio_kl_library, "recomputed_grads", _generic_split_forbidden)
    monkeypatch.setattr(grpo_loss_library, "recomputed_grads", _generic_split_forbidden)
    wrt, fn = OPS[op]
    x = inputs(seed=5)
    try:
        eager = run_with_grads(fn, x, wrt)
        compiled = run_with_grads(torch.compile(fn, fullgraph=True), x, wrt)
    finally:
        torch._dynamo.reset()
    assert_bitwise(eager[0], compiled[0])
    assert_bitwise(eager[1], compiled[1])


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
    g = _gen(seed)
    V = _llp_v()
    ids = torch.randint(0, V, (LLP_T,), generator=g)
    ids[:3] = torch.tensor([0, V - 1, -100])
    x = {"hidden": torch.randn(LLP_T, LLP_H, generator=g), "weight": torch.randn(V, LLP_H, generator=g) / 3,
         "bias": torch.randn(V, generator=g), "ids": ids, "grad": torch.randn(LLP_T, generator=g)}
    return {k: v.to(DEVICE, dtype=dtype if v.is_floating_point() and k != "grad" else None) for k, v in x.items()}


@pytest.fixture
def rlk_triton(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for name, value in KERNELS_ON.items():
        monkeypatch.setenv(name, value)
    kernels.reset_fallback_counts()
    yield
    assert kernels.fallback_counts() == {}
    torch._dynamo.reset()


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
    monkeypatch.setattr(linear_logp_library, "recomputed_grads", _generic_split_forbidden)
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
    layout = _linear_logp_layout(x["hidden"], x["weight"], x["bias"], x["ids"], 0.9, budget)
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
    layout = _linear_logp_layout(x["hidden"], x["weight"], x["bias"], x["ids"], 0.9, budget)
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
    layout = _linear_logp_layout(x["hidden"], x["weight"], x["bias"], x["ids"], 0.9, budget)
    _, stats, kept = torch.ops.rlk.linear_logp(x["hidden"], x["weight"], x["bias"], x["ids"], *rest, True, True, True,
                                               layout)
    monkeypatch.setenv(op_module.KEEP_IN_WEIGHT_GRAD_ENV, "0")
    with pytest.raises(RuntimeError, match="changed between the forward and its backward"):
        torch.ops.rlk.linear_logp_backward(x["grad"], x["hidden"], x["weight"], x["bias"], x["ids"], stats, kept,
                                           *rest, True, True, True)


# -- vocab-parallel calls: the group by name -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_inputs(world: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's shard of a batch over a vocab of V * world: logits and LM-head rows (and bias)
    of columns [rank * V, (rank + 1) * V), the ids global (some on the other shards)."""
    full = {k: torch.cat([inputs(seed=10 + r)[k] for r in range(world)]) for k in ("weight", "bias")}
    x = inputs(seed=10)
    columns = slice(rank * V, (rank + 1) * V)
    x["logits"] = torch.cat([inputs(seed=10 + r)["logits"] for r in range(world)], dim=1)[:, columns].contiguous()
    x["weight"], x["bias"] = full["weight"][columns].contiguous(), full["bias"][columns].contiguous()
    x["ids"] = torch.randint(0, V * world, (T,), generator=_gen(20))
    x["ids"][2] = -100
    return x


def _tp_step(x, group):
    """logp, linear_logp and the GRPO loss of this rank's shard over ``group``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    logp = kernels.logp(x["logits"], x["ids"], 0.7, tp_group=group)
    logp_h = kernels.linear_logp(x["hidden"], x["weight"], x["ids"], x["bias"], 0.9, tp_group=group,
                                 vocab_start=rank * V, global_vocab=world * V)
    loss, metrics = kernels.grpo_loss(x["logits"], x["ids"], old_logp=x["old_logp"], ref_logp=x["ref_logp"],
                                      advantages=x["advantages"], loss_mask=x["mask"], lengths=x["lengths"],
                                      config=CONFIG, temperature=0.9, tp_group=group)
    return loss, logp, logp_h, metrics["pg_clipfrac"]


def _tp_compiled_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Per backend: the graph breaks of the step over a new group and whether compiled == eager bitwise."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))  # not the default group: its name must resolve
    wrt = ("logits", "hidden", "weight", "bias")
    results = {}
    for backend in BACKENDS:
        for name in SWITCHES:
            os.environ.pop(name, None)
        if backend == "rlk-triton":
            os.environ.update(KERNELS_ON)

        def step(x):
            return _tp_step(x, group)

        x = _tp_inputs(world, rank)
        eager = run_with_grads(step, x, wrt)
        explanation = torch._dynamo.explain(step)(x)
        compiled = run_with_grads(torch.compile(step, fullgraph=True), x, wrt)
        torch._dynamo.reset()
        differ = [i for i, (u, v) in enumerate(zip(eager[0] + eager[1], compiled[0] + compiled[1], strict=True))
                  if not torch.equal(u, v)]
        results[backend] = {"breaks": explanation.graph_break_count, "reasons": str(explanation.break_reasons),
                            "differ": differ, "fallbacks": kernels.fallback_counts()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo/interpreter lane is the CPU lane")
# world 2 (two gloo ranks, slow on two cores) runs in tox -e tests; the quick start keeps world 1
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_vocab_parallel_calls_compile_fullgraph(world, tmp_path, rlk_progress):
    """logp, linear_logp and grpo_loss with a ``tp_group`` (passed to the operators by name):
    one graph, the eager outputs and gradients bitwise, on every rank, reference and rlk-triton."""
    with rlk_progress.step(f"{world} gloo rank process(es): eager vs torch.compile(fullgraph)"):
        mp.spawn(_tp_compiled_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for backend in BACKENDS:
            found = results[backend]
            assert found["breaks"] == 0, (rank, backend, found["reasons"])
            assert found["differ"] == [], f"rank {rank} {backend}: outputs/gradients {found['differ']} differ"
            assert found["fallbacks"] == {}, (rank, backend, found["fallbacks"])


# -- inplace_backward under torch.compile ------------------------------------------------------------

def _grpo_inplace(x):
    advantages = x["advantages"] * 0.5  # a graph before the break (explain records breaks between graphs)
    loss, metrics = kernels.grpo_loss(x["logits"], x["ids"], old_logp=x["old_logp"], ref_logp=x["ref_logp"],
                                      advantages=advantages, loss_mask=x["mask"], lengths=x["lengths"],
                                      config=CONFIG, inplace_backward=True)
    return loss * 1.0, metrics["pg_clipfrac"]


def test_inplace_backward_graph_break_is_reported(backend, caplog):
    """``inplace_backward=True`` cannot live in a compiled graph: the break names the option (an
    error under fullgraph), a warning says so, and the call keeps its eager semantics (the
    gradient is the logits buffer, overwritten with dlogits)."""
    explanation = torch._dynamo.explain(_grpo_inplace)(inputs())
    assert explanation.graph_break_count >= 1
    assert any("inplace_backward" in str(reason) for reason in explanation.break_reasons), explanation.break_reasons
    with pytest.raises(Exception, match="inplace_backward"):
        torch.compile(_grpo_inplace, fullgraph=True)(inputs())
    torch._dynamo.reset()
    grpo_loss_library._warn_inplace_under_compile.cache_clear()

    def run(fn):
        x = inputs()
        logits = x["logits"].detach().clone().requires_grad_()
        outputs = fn({**x, "logits": logits})
        (grad,) = torch.autograd.grad(outputs[0], logits)
        return [o.detach() for o in outputs], grad, logits

    eager_out, eager_grad, eager_logits = run(_grpo_inplace)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kernels"):
        out, grad, logits = run(torch.compile(_grpo_inplace))
    warned = [r.getMessage() for r in caplog.records if "inplace_backward=True" in r.getMessage()]
    assert len(warned) == 1, warned
    assert_bitwise(eager_out, out)
    assert_bitwise([eager_grad], [grad])
    if backend == "rlk-triton":  # the reference never writes its inputs (the contract lets it ignore the option)
        assert grad.data_ptr() == logits.data_ptr()
        assert_bitwise([eager_logits.detach()], [logits.detach()])


# -- the private PyTorch APIs ------------------------------------------------------------------------

@torch.library.custom_op("rlk_test::sin_grad_inside", mutates_args=())
def _sin_grad_inside(x: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    with torch_internals.autograd_inside():
        (grad,) = torch.autograd.grad(leaf.sin().sum(), leaf)
    return grad


def _process_group_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group([0])
    found = torch_internals.process_group(group.group_name)
    ok = found is not None and found.group_name == group.group_name and dist.get_world_size(found) == 1
    torch.save({"ok": ok, "none": torch_internals.process_group(None) is None}, os.path.join(out_dir, "found.pt"))
    dist.destroy_process_group()


def test_private_torch_apis_work(tmp_path):
    """Each private PyTorch API of kernels/library/torch_internals.py exists and does what the
    operators need; a PyTorch release that drops or changes one fails here, naming it."""
    for owner, name in ((torch._C, "_ForceDispatchKeyGuard"), (torch._C, "_dispatch_tls_local_exclude_set"),
                        (torch._C, "_dispatch_tls_local_include_set")):
        assert hasattr(owner, name), f"torch._C.{name} is gone: kernels/library/torch_internals.autograd_inside"
    import torch.distributed.distributed_c10d as c10d

    assert hasattr(c10d, "_resolve_process_group"), (
        "torch.distributed.distributed_c10d._resolve_process_group is gone: "
        "kernels/library/torch_internals.process_group")
    x = torch.randn(5)
    assert torch.equal(torch.ops.rlk_test.sin_grad_inside(x), x.cos()), "autograd_inside records nothing"
    mp.spawn(_process_group_worker, args=(1, _free_port(), str(tmp_path)), nprocs=1, join=True)
    assert torch.load(tmp_path / "found.pt") == {"ok": True, "none": True}, "process_group(name) resolves wrong"


# -- the dispatch inside compiled code ---------------------------------------------------------------

def test_compiled_call_counts_fallbacks_per_call(monkeypatch, caplog):
    """An unavailable backend: every compiled call falls back, is counted, and logs its line once."""
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "no.such.module:factory")
    monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
    monkeypatch.delenv("VIME_RL_KERNEL_OPS", raising=False)
    kernels.reset_fallback_counts()
    x = inputs()
    compiled = torch.compile(_logp, fullgraph=True)
    try:
        with caplog.at_level("WARNING", logger="kernels"):
            first = compiled(x)
            compiled(x)
            compiled(x)
        assert kernels.fallback_counts()["logp"] == 3
        assert sum("logp falls back to reference" in r.getMessage() for r in caplog.records) == 1
        monkeypatch.delenv("VIME_RL_KERNEL")
        assert_bitwise(list(first), list(_logp(x)))
    finally:
        kernels.reset_fallback_counts()
        torch._dynamo.reset()


def test_compiled_call_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "no.such.module:factory")
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    try:
        with pytest.raises(kernels.KernelFallbackError, match="logp"):
            torch.compile(_logp, fullgraph=True)(inputs())
    finally:
        kernels.reset_fallback_counts()
        torch._dynamo.reset()


# -- CUDA graphs -------------------------------------------------------------------------------------

def _graphed(fn, x: dict[str, torch.Tensor], wrt: tuple[str, ...]):
    """``run_with_grads(fn)`` captured in a CUDA graph (after a warm-up on a side stream), replayed once."""
    static = {k: v.clone() for k, v in x.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_with_grads(fn, static, wrt)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs, grads = run_with_grads(fn, static, wrt)
    for k, v in inputs(seed=7).items():  # new data in the captured buffers
        static[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    return static, outputs, grads


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("op", OPS)
def test_cuda_graph_capture_and_replay(op, compiled, backend):
    """Forward and backward captured and replayed give the bits of a plain call on the replayed data;
    a backend that checks ids on the host (the reference) refuses capture with a clear error."""
    wrt, fn = OPS[op]
    fn = torch.compile(fn, fullgraph=True) if compiled else fn
    if backend == "reference" and op != "ratio_kl":
        with pytest.raises(Exception, match="CUDA-graph capture cannot hold"):
            _graphed(fn, inputs(), wrt)
        return
    static, outputs, grads = _graphed(fn, inputs(), wrt)
    expected = run_with_grads(OPS[op][1], static, wrt)
    assert_bitwise([o.clone() for o in outputs], expected[0])
    assert_bitwise([g.clone() for g in grads], expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bad_ids_inside_a_cuda_graph_are_reported(compiled, monkeypatch):
    """An out-of-range id written into a captured graph's input is reported after the replay
    (the kernels' device error word), never a silent number."""
    if not hasattr(kernels, "raise_pending_errors"):
        pytest.skip("needs the sync-free input checks (kernels.raise_pending_errors)")
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    fn = torch.compile(_logp, fullgraph=True) if compiled else _logp
    x = inputs()
    static, _, _ = _graphed(fn, x, ("logits",))
    kernels.raise_pending_errors()  # the captured data is good
    static["ids"][4] = V + 5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_with_grads(fn, static, ("logits",))
    graph.replay()
    with pytest.raises(ValueError, match="target_ids"):
        kernels.raise_pending_errors()


def test_compiled_call_checks_ids(backend):
    """Bad ids reach a compiled call's operator, which checks them at run time (the traced public
    function cannot): on CPU an error naming target_ids at once, on a GPU through the error word."""
    x = inputs()
    compiled = torch.compile(_logp, fullgraph=True)
    compiled(x)
    x["ids"][4] = V + 5
    with pytest.raises(ValueError, match="target_ids"):
        compiled(x)
        kernels.raise_pending_errors()


# -- torch.compile's on-disk caches ------------------------------------------------------------------

def test_the_operators_tag_the_compile_caches():
    """Importing the kernels appends the operators' digest to torch.compile's cache-key tag."""
    from kernels.library import compile_cache

    assert compile_cache.TAG == f"rlk-operators-{compile_cache.operators_digest()}"
    assert compile_cache.TAG in torch.compiler.config.cache_key_tag


def test_the_tag_follows_the_operators_definitions(tmp_path):
    from kernels.library import compile_cache

    for path in compile_cache.LIBRARY.glob("*.py"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    assert compile_cache.operators_digest(tmp_path) == compile_cache.operators_digest()
    changed = tmp_path / "grpo_loss.py"
    changed.write_text(changed.read_text() + "\n# another residual layout\n")
    assert compile_cache.operators_digest(tmp_path) != compile_cache.operators_digest()


def test_a_tag_the_user_set_is_kept():
    from kernels.library import compile_cache

    with torch.compiler.config.patch(cache_key_tag="mine"):
        assert compile_cache.tag_compile_caches() == f"mine|{compile_cache.TAG}"
        assert compile_cache.tag_compile_caches() == f"mine|{compile_cache.TAG}"  # added once


def test_another_tag_misses_the_on_disk_caches(tmp_path, monkeypatch):
    """What the tag is for: with this torch, a graph compiled under another tag (other operators)
    is not served from Inductor's or AOTAutograd's on-disk cache; under the same tag it is."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def compile_and_run() -> tuple[int, int]:
        torch.compiler.reset()
        counters.clear()
        x = torch.randn(8, requires_grad=True)
        torch.compile(lambda t: (t * 2).sin().sum(), fullgraph=True)(x).backward()
        return counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"]

    assert compile_and_run() == (0, 0)
    assert compile_and_run() != (0, 0)  # served from the cache under the same tag
    with torch.compiler.config.patch(cache_key_tag=torch.compiler.config.cache_key_tag + "|other-operators"):
        assert compile_and_run() == (0, 0)
    torch.compiler.reset()

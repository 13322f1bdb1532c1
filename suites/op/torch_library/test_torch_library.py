"""The public ops as PyTorch operators (kernels/library/): opcheck, fullgraph compile, CUDA graphs.

* ``torch.library.opcheck`` of every forward and backward operator (schema, fake tensor, autograd
  registration, AOT dispatch with dynamic shapes), on the reference and on rlk-triton (the Triton
  interpreter on CPU);
* ``torch.compile(fullgraph=True)`` of each op, forward and backward, and of a training-style
  function calling all four: no graph break, the eager result bitwise;
* rlk-triton's splits: no autograd run inside its operators;
* ``grpo_loss(inplace_backward=True)`` under compile: a graph break that names its reason, and
  a warning, with the eager semantics (the logits buffer holds dlogits);
* the dispatch inside compiled code: fallbacks counted per call, strict mode raising;
* on a GPU: each op's forward and backward captured in a CUDA graph and replayed (default
  configuration and kernels on), eager and compiled.

linear_logp's split: test_torch_library_linear_logp.py; process groups by name, the private PyTorch
APIs and the compile caches: test_torch_library_torch_internals.py. Shapes are tiny: the point is
the operator plumbing; the ops' values are the parity tests'.
"""

from __future__ import annotations

import logging

import pytest
import torch

import kernels
import kernels.library  # registers torch.ops.rlk.*
from kernels.library import grpo_loss as grpo_loss_library
from kernels.library import logp as logp_library
from kernels.library import ratio_kl as ratio_kl_library
from suites.op.rlk_op_cases import DEVICE
from suites.op.torch_library.cases import (
    CONFIG,
    KERNELS_ON,
    SWITCHES,
    T,
    V,
    assert_bitwise,
    generic_split_forbidden,
    inputs,
    linear_logp_layout,
    run_with_grads,
)


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


def _linear_logp_opcheck_samples(x: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """linear_logp's operators; the backward's residuals from its forward (the weight gradient's
    layout on rlk-triton: T <= H)."""
    grad = lambda t: t.detach().requires_grad_()
    rest = (0.9, None, 0, V, None)
    layout = linear_logp_layout(x["hidden"], x["weight"], x["bias"], x["ids"], 0.9)
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


@pytest.mark.parametrize("op", ["logp", "ratio_kl", "grpo_loss"])
def test_rlk_triton_splits_run_no_autograd_inside(op, monkeypatch):
    """rlk-triton's logp, ratio_kl and grpo_loss operators run their kernels directly, forward and
    backward (no recomputed forward, no nested autograd engine run), for the eager bits."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for name, value in KERNELS_ON.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(logp_library, "recomputed_grads", generic_split_forbidden)
    monkeypatch.setattr(ratio_kl_library, "recomputed_grads", generic_split_forbidden)
    monkeypatch.setattr(grpo_loss_library, "recomputed_grads", generic_split_forbidden)
    wrt, fn = OPS[op]
    x = inputs(seed=5)
    try:
        eager = run_with_grads(fn, x, wrt)
        compiled = run_with_grads(torch.compile(fn, fullgraph=True), x, wrt)
    finally:
        torch._dynamo.reset()
    assert_bitwise(eager[0], compiled[0])
    assert_bitwise(eager[1], compiled[1])


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

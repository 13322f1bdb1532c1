"""The public ops as PyTorch operators (kernels/library/): opcheck, fullgraph compile, CUDA graphs.

* ``torch.library.opcheck`` of every forward and backward operator (schema, fake tensor, autograd
  registration, AOT dispatch with dynamic shapes), on the reference and on rlk-triton (the Triton
  interpreter on CPU);
* ``torch.compile(fullgraph=True)`` of each op, forward and backward, and of a training-style
  function calling all four: no graph break, the eager result bitwise;
* the dispatch inside compiled code: fallbacks counted per call, strict mode raising;
* on a GPU: each op's forward and backward captured in a CUDA graph and replayed (default
  configuration and kernels on), eager and compiled.

Shapes are tiny: the point is the operator plumbing; the ops' values are the parity tests'.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels
import kernels.library  # registers torch.ops.rlk.*
from kernels.contracts import LossConfig
from suites.op.rlk_op_cases import DEVICE

T, V, H = 6, 37, 8
CONFIG = LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.01)
BACKENDS = ("reference", "rlk-triton")


@pytest.fixture(autouse=True)
def _dynamo_enabled():
    """torch.compile is a no-op under TORCHDYNAMO_DISABLE=1: the compile tests would pass vacuously."""
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        pytest.fail("TORCHDYNAMO_DISABLE=1 in this process: torch.compile does nothing, so these tests prove nothing")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Every switch cleared (the default: the reference), or the kernels on, strict."""
    for name in ("VIME_RL_KERNEL", "VIME_RL_KERNEL_STRICT", "VIME_RL_KERNEL_OPS", "VIME_RL_KERNEL_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    if request.param == "rlk-triton":
        monkeypatch.setenv("VIME_RL_KERNEL", "1")
        monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    kernels.reset_fallback_counts()
    yield request.param
    assert kernels.fallback_counts() == {}
    torch._dynamo.reset()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """One tiny batch on DEVICE: logits [T, V], ids (one ignored row), per-token inputs, hidden/weight/bias."""
    g = _gen(seed)
    ids = torch.randint(0, V, (T,), generator=g)
    ids[2] = -100
    tensors = {
        "logits": torch.randn(T, V, generator=g) * 3, "ids": ids,
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
    dlogits = torch.ops.rlk.grpo_loss(x["logits"], x["ids"], x["old_logp"], x["ref_logp"], x["advantages"],
                                      x["mask"], x["lengths"], None, None, *config, 0.9, -100, None, True)[2]
    return {
        "logp": (grad(x["logits"]), x["ids"], 0.7, -100, None, True),
        "logp_backward": (x["grad"], x["logits"], x["ids"], stats, 0.7, -100, None),
        "ratio_kl": (grad(x["logp"]), x["old_logp"], x["ref_logp"], x["mask"], "k3", True),
        "ratio_kl_backward": (x["grad"], x["grad"] * 2, x["logp"], x["old_logp"], x["ref_logp"], x["mask"], "k3", True),
        "grpo_loss": (grad(x["logits"]), x["ids"], x["old_logp"], x["ref_logp"], x["advantages"], x["mask"],
                      x["lengths"], None, None, *config, 0.9, -100, None, True),
        "grpo_loss_backward": (torch.tensor(0.5, device=DEVICE), dlogits),
        "linear_logp": (grad(x["hidden"]), grad(x["weight"]), grad(x["bias"]), x["ids"], 0.9, None, 0, V, None),
        "linear_logp_backward": (x["grad"], x["hidden"], x["weight"], x["bias"], x["ids"], 0.9, None, 0, V, None,
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

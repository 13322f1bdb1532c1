"""ratio_kl's host path on the GPU: on repeat calls it serves the common case bitwise equal to the
Python path, over what the kernel is specialized on, the public call without dispatch; everything
else (non-contiguous, another device, a gradient through misaligned inputs, bad input) still takes
the Python path, with its errors; CUDA-graph capture records it. With a gradient: ratio, kl and
dlogp bitwise equal to autograd.Function's over KL types, dtypes, T == 1 and gradients that are
random, undefined (kl unused) or expanded; its node's autograd semantics (a retained graph, a second
backward refused, an in-place change refused, saved-tensor hooks); a misaligned input declined;
CUDA-graph capture of forward and backward.
"""

from __future__ import annotations

import pytest
import torch
import triton

from kernels import launch
from kernels.ops import ratio_kl as ratio_kl_op
from suites.op.host_path_checks import (
    assert_host_path_is_bitwise_the_python_path,
    assert_node_matches_the_python_path,
    host_module_or_skip,
    host_path_replays,
    replays_to,
)


def _require_host_path():
    if not triton.__version__.startswith(launch.VERIFIED_TRITON):
        pytest.skip(f"triton {triton.__version__}: the fast path is off for unverified versions")
    assert launch._resolve_runtime() is not None, launch.disabled_reason()
    return host_module_or_skip()


def _gpu_inputs(n, seed=0, dtype=torch.float32, mask_dtype=torch.bool, offset=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logp = -torch.rand(n + offset, device="cuda", generator=gen) * 5
    old = (logp + 0.3 * torch.randn(n + offset, device="cuda", generator=gen)).to(dtype)
    ref = (logp + 0.3 * torch.randn(n + offset, device="cuda", generator=gen)).to(dtype)
    mask = (torch.rand(n + offset, device="cuda", generator=gen) > 0.2).to(mask_dtype)
    return [x[offset:] for x in (logp, old, ref, mask)]


def _host_cases():
    """What the host path's key must tell apart: T == 1, T % 16, the input dtypes, 16-byte
    alignment of each input, the KL type and the unbiased flag."""
    cases = []
    for n in (1, 7, 64, 1000, 3000):
        cases.append((_gpu_inputs(n, seed=n), "low_var_kl", False))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        cases.append((_gpu_inputs(64, dtype=dtype), "k3", False))
    for mask_dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        cases.append((_gpu_inputs(48, mask_dtype=mask_dtype), "k2", True))
    cases.append((_gpu_inputs(64, offset=1), "k1", False))  # every input misaligned
    aligned, misaligned = _gpu_inputs(64), _gpu_inputs(64, offset=1)
    cases.append(([aligned[0], misaligned[1], aligned[2], misaligned[3]], "low_var_kl", True))
    for kl_type in ("k1", "k2", "k3", "low_var_kl"):
        cases.append((_gpu_inputs(64, seed=5), kl_type, True))
    return cases


def _run(cases):
    out = []
    for inputs, kl_type, unbiased in cases:
        out += ratio_kl_op.ratio_kl(*inputs, kl_type=kl_type, use_unbiased_kl=unbiased)
    return out


class _CountingHost:
    def __init__(self, forward):
        self.forward, self.served = forward, 0

    def __call__(self, *args):
        out = self.forward(*args)
        self.served += out is not None
        return out


@pytest.mark.gpu
def test_host_path_is_bitwise_the_python_path_across_its_key(monkeypatch):
    _require_host_path()
    cases = _host_cases()
    with torch.no_grad():
        _run(cases)  # first calls: the Python path launches and registers
        assert ratio_kl_op._HOST.forward is not None, "no kernel was registered with the host path"
        counting = _CountingHost(ratio_kl_op._HOST.forward)
        monkeypatch.setattr(ratio_kl_op._HOST, "forward", counting)
        host = _run(cases)
        assert counting.served == len(cases), f"the host path served {counting.served} of {len(cases)} calls"
        with ratio_kl_op._HOST.off():
            python = _run(cases)
    for i, (a, b) in enumerate(zip(host, python)):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(a, b), f"output {i} differs"


@pytest.mark.gpu
def test_host_path_declines_the_rest_and_the_python_path_explains(monkeypatch):
    _require_host_path()
    logp, old, ref, mask = _gpu_inputs(64)
    with torch.no_grad():
        ratio_kl_op.ratio_kl(logp, old, ref, mask)
    counting = _CountingHost(ratio_kl_op._HOST.forward)
    monkeypatch.setattr(ratio_kl_op._HOST, "forward", counting)
    strided = [x.repeat_interleave(2)[::2] for x in (logp, old, ref, mask)]
    with torch.no_grad():
        want = ratio_kl_op.ratio_kl(logp, old, ref, mask)
        got = ratio_kl_op.ratio_kl(*strided)  # non-contiguous: the Python path copies
        assert counting.served == 1
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with pytest.raises(ValueError, match=r"old_logp must have shape \[64\]"):
            ratio_kl_op.ratio_kl(logp, old[:-1], ref, mask)
        with pytest.raises(ValueError, match="mask must be bool or floating point"):
            ratio_kl_op.ratio_kl(logp, old, ref, mask.int())
        with pytest.raises(ValueError, match="old_logp is on cpu but expected cuda:0"):
            ratio_kl_op.ratio_kl(logp, old.cpu(), ref, mask)
    assert counting.served == 1
    leaf = logp.clone().requires_grad_()
    # the first backward registers its kernel unless an earlier test in this process did: the
    # call after it is served either way
    for _ in range(2):
        served = counting.served
        ratio, kl = ratio_kl_op.ratio_kl(leaf, old, ref, mask)
        torch.autograd.grad((ratio + kl).sum(), leaf)
    assert counting.served == served + 1 and ratio.grad_fn.name() == "RatioKLBackward"
    # a gradient wanted through a misaligned input: the Python path's autograd.Function
    served = counting.served
    misaligned = _gpu_inputs(64, offset=1)
    ratio, kl = ratio_kl_op.ratio_kl(misaligned[0].requires_grad_(), *misaligned[1:])
    assert counting.served == served and ratio.grad_fn.name() == "RatioKLFunctionBackward"
    (grad,) = torch.autograd.grad((ratio + kl).sum(), misaligned[0])
    assert bool(torch.isfinite(grad).all())


@pytest.mark.gpu
def test_ratio_kl_host_path_serves_the_public_call_before_dispatch(monkeypatch):
    import kernels
    from kernels import dispatch
    from kernels.contracts import RatioKLCall

    _require_host_path()
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    logp, old, ref, mask = _gpu_inputs(64)
    with torch.no_grad():
        kernels.ratio_kl(logp, old, ref, mask)  # registers the forward kernel
        want = dispatch.run("ratio_kl", RatioKLCall(logp, old, ref, mask))
        before = ratio_kl_op._HOST.calls_served()
        with monkeypatch.context() as patch:
            patch.setattr(dispatch, "select", lambda op, **case: pytest.fail(f"{op} was dispatched"))
            got = kernels.ratio_kl(logp, old, ref, mask)
        assert ratio_kl_op._HOST.calls_served() == before + 1
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with pytest.raises(ValueError, match=r"old_logp must have shape \[64\]"):
            kernels.ratio_kl(logp, old[:-1], ref, mask)
        with pytest.raises(ValueError, match="old_logp is on cpu but expected cuda:0"):
            kernels.ratio_kl(logp, old.cpu(), ref, mask)
    assert ratio_kl_op._HOST.calls_served() == before + 1


@pytest.mark.gpu
def test_host_path_launches_are_recorded_by_cuda_graph_capture():
    _require_host_path()
    logp, old, ref, mask = _gpu_inputs(64, seed=3)
    with torch.no_grad():
        want = [x.clone() for x in ratio_kl_op.ratio_kl(logp, old, ref, mask)]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ratio_kl_op.ratio_kl(logp, old, ref, mask)  # warm-up on the side stream
            with torch.cuda.graph(graph, stream=stream):
                captured = ratio_kl_op.ratio_kl(logp, old, ref, mask)
        torch.cuda.current_stream().wait_stream(stream)
        replays_to(graph, captured, want)


# ratio_kl with a gradient: the host path's node against autograd.Function, bitwise

def _require_ratio_kl_grad_host_path(monkeypatch):
    monkeypatch.setattr(launch, "verify_keys", False)  # key verification sends every call through Python
    return _require_host_path()


# (name, T, old/ref dtype, mask dtype, KL type, unbiased, gradient: "both" (random for ratio and kl),
# "ratio" (kl unused: an undefined gradient), "sum" (expanded ones))
_RATIO_KL_GRAD_CASES = [
    ("low_var_kl-both", 3000, torch.float32, torch.bool, "low_var_kl", False, "both"),
    ("k2-unbiased-sum", 64, torch.float32, torch.float32, "k2", True, "sum"),
    ("k3-bf16-ratio-only", 48, torch.bfloat16, torch.bool, "k3", False, "ratio"),
    ("k1-fp64-one-token", 1, torch.float64, torch.float16, "k1", False, "both"),
]


def _ratio_kl_run(case, seed=0):
    """(ratio, kl, dlogp) of the op for a case, with a gradient."""
    _, n, dtype, mask_dtype, kl_type, unbiased, gradient = case
    logp, old, ref, mask = _gpu_inputs(n, seed=seed, dtype=dtype, mask_dtype=mask_dtype)
    logp.requires_grad_()
    ratio, kl = ratio_kl_op.ratio_kl(logp, old, ref, mask, kl_type=kl_type, use_unbiased_kl=unbiased)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    if gradient == "sum":
        (dlogp,) = torch.autograd.grad((ratio + kl).sum(), logp)
    elif gradient == "ratio":
        (dlogp,) = torch.autograd.grad(ratio, logp, torch.randn(n, device="cuda", generator=gen))
    else:
        grads = [torch.randn(n, device="cuda", generator=gen) for _ in range(2)]
        (dlogp,) = torch.autograd.grad([ratio, kl], logp, grads)
    return [ratio.detach(), kl.detach(), dlogp]


def _ratio_kl_served():
    return ratio_kl_op._HOST.load().served()


@pytest.mark.gpu
@pytest.mark.parametrize("case", _RATIO_KL_GRAD_CASES, ids=lambda c: c[0])
def test_ratio_kl_host_path_with_a_gradient_is_bitwise_the_python_path(monkeypatch, case):
    _require_ratio_kl_grad_host_path(monkeypatch)
    assert_host_path_is_bitwise_the_python_path(ratio_kl_op, _ratio_kl_run, case, ("ratio", "kl", "dlogp"))


@pytest.mark.gpu
def test_ratio_kl_host_path_node_keeps_autograd_semantics(monkeypatch):
    """A backward through a retained graph, twice (accumulating), then "a second time" refused; an
    input modified in place after the forward refused; saved tensors through a saved-tensor hook."""
    _require_ratio_kl_grad_host_path(monkeypatch)
    _ratio_kl_run(_RATIO_KL_GRAD_CASES[0])

    def twice():
        logp, old, ref, mask = _gpu_inputs(3000, seed=4)
        logp.requires_grad_()
        ratio, kl = ratio_kl_op.ratio_kl(logp, old, ref, mask)
        (ratio + kl).sum().backward(retain_graph=True)
        first = logp.grad.clone()
        kl.backward(torch.full_like(kl, 0.5))  # accumulates; the graph is freed after this one
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            ratio.sum().backward()
        ratio, kl = ratio_kl_op.ratio_kl(logp, old, ref, mask)
        with torch.no_grad():
            old.add_(0.0)  # an in-place change of a saved input
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            kl.sum().backward()
        with torch.autograd.graph.save_on_cpu():
            ratio, kl = ratio_kl_op.ratio_kl(logp, old, ref, mask)
        (hooked,) = torch.autograd.grad([ratio, kl], logp, [torch.ones_like(ratio), torch.ones_like(kl)])
        return first, logp.grad, hooked, ratio.grad_fn.name()

    assert_node_matches_the_python_path(ratio_kl_op, twice, 3, "RatioKLBackward", "RatioKLFunctionBackward")


@pytest.mark.gpu
def test_ratio_kl_host_path_with_a_gradient_is_recorded_by_cuda_graph_capture(monkeypatch):
    _require_ratio_kl_grad_host_path(monkeypatch)
    logp, old, ref, mask = _gpu_inputs(3000, seed=6)
    logp.requires_grad_()
    grads = [torch.randn(3000, device="cuda") for _ in range(2)]

    def step():
        ratio, kl = ratio_kl_op.ratio_kl(logp, old, ref, mask)
        (dlogp,) = torch.autograd.grad([ratio, kl], logp, grads)
        return [ratio.detach(), kl.detach(), dlogp]

    host_path_replays(step, _ratio_kl_served, 1)

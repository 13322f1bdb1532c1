"""The ops' host-side C++ fast paths (kernels/ops/host/): ratio_kl's, grpo_loss's one-read and
logp's single-device forward and backward.

CPU: the module builds against the installed torch (skipped, with the reason, where there is no
C++ compiler or torch's headers), declines every call that is not the common case (so the Python
path's checks run), and a build that cannot run turns the host path off loudly, once.
The public ``kernels.ratio_kl`` asks the host path before it builds or dispatches its call (a stand-in
host path on CPU); ``logp``'s host-first entry declines, without taking a call id, what the contract
decides otherwise. GPU: on repeat calls the host path serves the common case bitwise equal to the
Python path, over what the kernel is specialized on, the public call without dispatch; everything else (non-contiguous, another device, a gradient
through misaligned inputs, bad input) still takes the Python path, with its errors; CUDA-graph capture records it. ratio_kl
with a gradient: ratio, kl and dlogp bitwise equal to autograd.Function's over KL types, dtypes,
T == 1 and gradients that are random, undefined (kl unused) or expanded; its node's autograd
semantics (a retained graph, a second backward refused, an in-place change refused, saved-tensor
hooks); a misaligned input declined; CUDA-graph capture of forward and backward. grpo_loss:
loss, metrics and dlogits bitwise equal to the Python path's over its configurations (reference
or none, dual clip, TIS, packing, reductions, temperature, grad_output != 1, a second backward
through a retained graph), the predicted gradient's hits and misses on both paths, bad ids reported through the error word under the call's id, the public
call served, CUDA-graph capture of forward and backward. logp: the log-prob and dlogits bitwise equal
to the Python path's over dtypes, temperature, T (the statistics rows' alignment), with and without a
gradient, gradients that are ones, random or expanded, a backward through a retained graph, bad ids
reported under the call's id, the public call served and the rest declined, the public call served
before dispatch (bad ids reported under the id its host-first entry took; strict ids, the finite check
and shapes left to the contract), CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

import pytest
import torch
import triton

from kernels import LossConfig, device_errors, launch
from kernels.contracts import GrpoLossCall, LogpCall
from kernels.ops import grpo_loss as grpo_loss_op
from kernels.ops import logp as logp_op
from kernels.ops import ratio_kl as ratio_kl_op
from kernels.ops.host import HostModule, build


def _host_module_or_skip(host: HostModule = ratio_kl_op._HOST):
    if build.find_cxx() is None:
        pytest.skip("no C++ compiler here (g++, $CXX or $RLK_CXX): the host path cannot be built")
    if not build.torch_headers_present():
        pytest.skip(f"torch's C++ headers are not installed under {build._torch_paths()[0]}")
    module = host.load()
    assert module is not None, host.disabled_reason()
    return module


def _cpu_inputs(n=16):
    logp = -torch.rand(n)
    return [logp, logp + 0.1, logp - 0.1, torch.ones(n, dtype=torch.bool)]


def test_host_module_declines_what_is_not_the_common_case():
    module = _host_module_or_skip()
    inputs = _cpu_inputs()
    native = (1, 128, 0, "PPPPPPi")
    served = module.served()  # earlier tests in this process may have been served
    # CPU tensors, other objects, a bad KL code or flag: None (the Python path decides and explains)
    assert module.forward(*inputs, 3, False) is None
    assert module.forward("logp", *inputs[1:], 3, False) is None
    assert module.forward(*inputs, 9, False) is None
    assert module.forward(*inputs, "3", False) is None
    assert module.forward(*inputs, 3, "no") is None
    assert module.register_forward(*inputs, 3, False, 1024, native) is None  # nothing to store
    assert module.register_backward(*inputs, torch.ones(16), torch.ones(16), 3, False, 1024, native) is None
    with pytest.raises(TypeError, match="forward takes 6 arguments, got 4"):
        module.forward(*inputs)
    with pytest.raises(TypeError, match="register_forward takes 8 arguments, got 6"):
        module.register_forward(*inputs, 3, False)
    with pytest.raises(TypeError, match="register_backward takes 10 arguments, got 1"):
        module.register_backward(inputs[0])
    assert module.served() == served


def test_a_host_module_turns_the_forward_on_with_the_first_kernel_stored_and_refuses_a_clash():
    host = HostModule("ratio_kl_elementwise")
    module = _host_module_or_skip(host)
    assert host.forward is None and host.path_label() == "python (no kernel registered)"
    host.registered(None, "this call's kernel")  # not a common case: nothing stored
    assert host.forward is None
    host.registered(True, "this call's kernel")
    assert host.forward is module.forward and host.path_label() == "c++"
    with pytest.raises(launch.LaunchKeyError, match=r"^ratio_kl_elementwise host path: its key for this call's kernel "
                                                    r"holds another compiled kernel$"):
        host.registered(False, "this call's kernel")
    assert host.forward is module.forward


def test_a_host_module_counts_the_calls_its_forward_served_once_built():
    host = HostModule("ratio_kl_elementwise")
    assert host.calls_served() == 0  # not built yet: nothing to ask, nothing built by asking
    assert host._module is None
    module = _host_module_or_skip(host)
    assert host.calls_served() == module.served()  # the process's count (earlier tests may add to it)


def test_a_host_module_turned_off_leaves_its_op_the_python_path_until_the_block_ends():
    host = HostModule("ratio_kl_elementwise")
    module = _host_module_or_skip(host)
    host.registered(True, "this call's kernel")
    with host.off():
        assert host.forward is None and host.path_label() == "python (turned off)"
        assert host.registry() is module, "the Python path's launches must still register their kernels"
        host.registered(True, "this call's kernel")  # a registration does not turn it back on
        assert host.forward is None
        with host.off(register=False):
            assert host.registry() is None
        assert host.forward is None and host.registry() is module, "an inner block's end turned it back on"
        with pytest.raises(launch.LaunchKeyError):
            host.registered(False, "this call's kernel")
    assert host.forward is module.forward and host.registry() is module and host.path_label() == "c++"


def test_a_kernel_first_stored_while_off_turns_the_forward_on_at_the_blocks_end():
    """The Python path's launcher serves a kernel's later launches without registering it again: a
    kernel first launched inside off() must still reach the host path afterwards."""
    host = HostModule("ratio_kl_elementwise")
    module = _host_module_or_skip(host)
    with host.off():
        host.registered(True, "this call's kernel")
        assert host.forward is None
    assert host.forward is module.forward
    fresh = HostModule("ratio_kl_elementwise")
    with fresh.off(register=False):
        assert fresh.registry() is None
    assert fresh.forward is None, "nothing was stored: the forward stays off"


class _FakeRuntime:  # kernels.launch's runtime, whose presence lets an op ask its host path
    def get_device(self):
        return 0  # no direct launch is stored for it: the Python path launches through Triton

    def get_stream(self, device):
        return 0


def test_ratio_kl_asks_its_host_module_first_and_not_while_it_is_off(monkeypatch):
    asked, answer = [], (torch.zeros(16), torch.zeros(16))

    def host(*args):
        asked.append(args)
        return answer

    monkeypatch.setattr(ratio_kl_op._HOST, "forward", host)
    if torch.cuda.is_available():  # the Python path launches the compiled kernel: device inputs
        inputs = [t.cuda() for t in _cpu_inputs()]
    else:  # the Triton interpreter; a stand-in runtime says the fast path may run
        monkeypatch.setattr(launch, "fast_path_now", lambda: _FakeRuntime())
        inputs = _cpu_inputs()
    # the Python path first: on a device its launch starts kernels.launch's runtime
    with ratio_kl_op._HOST.off():
        ratio, kl = ratio_kl_op.ratio_kl(*inputs)
        assert ratio_kl_op.host_path() == "python (turned off)"
    assert not asked and ratio is not answer[0] and bool(torch.isfinite(kl).all())
    assert ratio_kl_op.ratio_kl(*inputs) is answer and len(asked) == 1
    with ratio_kl_op._HOST.off():
        ratio_kl_op.ratio_kl(*inputs)
    assert len(asked) == 1
    assert ratio_kl_op.ratio_kl(*inputs) is answer and len(asked) == 2


def test_public_ratio_kl_asks_the_host_path_before_building_or_dispatching_its_call(monkeypatch, triton_strict):
    """``kernels.ratio_kl`` hands its raw arguments to the backend's host-first entry (this op
    module's ``host_first``): a call the host path serves is neither built nor dispatched; one it
    declines is, and the contract's checks name a bad input."""
    import kernels
    from kernels import dispatch

    if torch.cuda.is_available():
        inputs = [t.cuda() for t in _cpu_inputs()]
    else:
        monkeypatch.setattr(launch, "fast_path_now", lambda: _FakeRuntime())
        inputs = _cpu_inputs()
    kernels.ratio_kl(*inputs)  # through dispatch: loads the backend and the op's module
    asked, answer = [], (torch.zeros(16), torch.zeros(16))

    def host(*args):
        asked.append(args[4:])
        return answer if args[3].dtype == torch.bool else None  # declines a float mask

    monkeypatch.setattr(ratio_kl_op._HOST, "forward", host)
    dispatched, select = [], dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda op, **case: dispatched.append(op) or select(op, **case))
    assert kernels.ratio_kl(*inputs) is answer and asked == [(3, False)] and not dispatched
    assert kernels.ratio_kl(*inputs, kl_type="k2", use_unbiased_kl=1) is answer and asked[-1] == (1, True)
    float_mask = [*inputs[:3], inputs[3].float()]
    ratio, kl = kernels.ratio_kl(*float_mask)  # declined: built, checked, dispatched
    assert dispatched == ["ratio_kl"] and ratio is not answer[0] and bool(torch.isfinite(kl).all())
    with pytest.raises(ValueError, match=r"old_logp must have shape \[16\]"):
        kernels.ratio_kl(float_mask[0], float_mask[1][:-1], *float_mask[2:])
    with pytest.raises(ValueError, match="kl_type must be one of"):
        kernels.ratio_kl(*inputs, kl_type="k9")
    # closed where dispatch would not ask this backend: the op not allowed, kernels off
    asked.clear()
    for name, value in (("VIME_RL_KERNEL_OPS", "logp"), ("VIME_RL_KERNEL", "0")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert kernels.ratio_kl(*inputs)[0] is not answer[0]
    assert not asked


def test_logp_host_first_declines_before_taking_a_call_id_what_the_contract_decides_otherwise(monkeypatch):
    """Without CUDA ids (checked on the host) or with a TP group, a non-float temperature, a bool
    ignore_index or 3-D logits, ``host_first`` declines without asking the host path or taking an id."""
    asked = []
    monkeypatch.setattr(logp_op._HOST, "forward", lambda call: asked.append(call))
    monkeypatch.setattr(launch, "fast_path_now", lambda: _FakeRuntime())
    logits, ids = torch.randn(4, 10), torch.randint(0, 10, (4,))
    first_id = device_errors._next_id
    for args, kwargs in [((logits, ids), {}), ((logits, ids), {"tp_group": object()}), ((logits, ids, 1), {}),
                         ((logits, ids, float("inf")), {}), ((logits, ids), {"ignore_index": True}),
                         ((logits[None], ids), {})]:
        assert logp_op.host_first(*args, **kwargs) is None
    assert not asked and device_errors._next_id == first_id


def test_a_host_path_that_cannot_be_built_is_off_loudly_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("RLK_CUDA_CACHE", str(tmp_path))  # nothing cached: a build is due
    monkeypatch.setenv("RLK_CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv("CXX", raising=False)
    host = HostModule("ratio_kl_elementwise")
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert host.load() is None
        assert host.load() is None
    assert host.disabled_reason() == (f"HostBuildError: the C++ compiler RLK_CXX='{tmp_path / 'no-such-compiler'}' "
                                      "names is not there")
    assert [r.getMessage() for r in caplog.records].count(
        f"kernels: ratio_kl_elementwise host path off, the op keeps its Python path: {host.disabled_reason()}") == 1


def test_no_compiler_at_all_says_how_to_name_one(monkeypatch, tmp_path):
    monkeypatch.setenv("RLK_CUDA_CACHE", str(tmp_path))
    monkeypatch.delenv("RLK_CXX", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ or c++ on it
    with pytest.raises(build.HostBuildError, match=r"no C\+\+ compiler found \(set RLK_CXX or CXX"):
        build.load_extension(HostModule("ratio_kl_elementwise").source)


def test_a_failed_build_names_the_command_and_the_compiler_output(monkeypatch, tmp_path):
    if build.find_cxx() is None:
        pytest.skip("no C++ compiler here (g++, $CXX or $RLK_CXX)")
    monkeypatch.setenv("RLK_CUDA_CACHE", str(tmp_path))
    broken = tmp_path / "broken_module.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(build.HostBuildError, match=r"(?s)failed \(1\): .*broken_module\.cpp.*error"):
        build.load_extension(broken)
    assert not list(tmp_path.glob("broken_module-*")), "a failed build left a file in the cache"


# ---------------------------------------------------------------- GPU


def _require_host_path():
    if not triton.__version__.startswith(launch.VERIFIED_TRITON):
        pytest.skip(f"triton {triton.__version__}: the fast path is off for unverified versions")
    assert launch._resolve_runtime() is not None, launch.disabled_reason()
    return _host_module_or_skip()


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


def _replays_to(graph, captured, want):
    """The captured outputs, poisoned, hold ``want`` again after one replay of ``graph``."""
    for x in captured:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, want))


def _host_path_replays(step, served, calls: int) -> None:
    """``step()`` (a list of outputs) captured in a CUDA graph on a side stream, ``calls`` of its
    calls served by a host path (``served()`` counts them), replays to what it gave eagerly."""
    want = [x.clone() for x in step()]
    step()  # every kernel registered by now (a kernel that only a later call in step() registers)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the side stream
        before = served()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
        assert served() == before + calls
    torch.cuda.current_stream().wait_stream(stream)
    _replays_to(graph, captured, want)


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
        _replays_to(graph, captured, want)


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
    _assert_host_path_is_bitwise_the_python_path(ratio_kl_op, _ratio_kl_run, case, ("ratio", "kl", "dlogp"))


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

    _assert_node_matches_the_python_path(ratio_kl_op, twice, 3, "RatioKLBackward", "RatioKLFunctionBackward")


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

    _host_path_replays(step, _ratio_kl_served, 1)


# ---------------------------------------------------------------- grpo_loss's one-read host path

def _grpo_module_or_skip():
    return _host_module_or_skip(grpo_loss_op._HOST)


def _cpu_grpo_call(**kw):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 32, generator=gen).requires_grad_()
    base = -torch.rand(8, generator=gen)
    return GrpoLossCall(logits, torch.randint(0, 32, (8,), generator=gen), old_logp=base, ref_logp=base - 0.1,
                        advantages=torch.randn(8, generator=gen), loss_mask=torch.ones(8, dtype=torch.bool),
                        config=LossConfig(kl_loss_coef=0.01), **kw)


# slow: the quick start (tox -e suite, -m "not slow") leaves it out; tox -e tests runs it
@pytest.mark.slow
def test_grpo_host_module_declines_what_is_not_the_common_case():
    module = _grpo_module_or_skip()
    call = _cpu_grpo_call()
    served = module.served()  # earlier tests in this process may have been served
    # CPU tensors, other objects, bad registrations: None (the Python path decides and explains)
    assert module.forward(call) is None
    assert module.forward(object()) is None
    assert module.register_forward(call, (1, 128, 0, "PPPPii"), (1, 1, 32, 512, 0), (1, 512, 0, "PPPPif"), 0) is None
    write = (1, 396, 512, 61440, 10, 15200)
    assert module.register_backward(call.logits, write) is None
    assert module.register_backward("logits", write) is None
    with pytest.raises(TypeError, match="register_forward takes 5 arguments, got 1"):
        module.register_forward(call)
    with pytest.raises(TypeError, match="register_backward takes 2 arguments, got 1"):
        module.register_backward(call.logits)
    with pytest.raises(TypeError, match=r"configure\(metric_names"):
        module.configure(("pg_loss",), len)
    assert module.served() == served


def test_grpo_loss_call_takes_the_host_path_only_while_the_fast_path_may_run(monkeypatch):
    """grpo_loss_call asks the host path first, and not at all when kernels.launch's fast path is off
    (VIME_RL_KERNEL_FAST_LAUNCH=0, an unverified Triton, key verification, a launch hook), the
    one-read path is switched off (RLK_GRPO_ONE_READ=0) or its host module is (``_HOST.off()``)."""
    served = []
    sentinel = (torch.zeros(()), {})

    def host(call):
        served.append(call)
        return sentinel

    class PythonPath:  # GrpoLossFunction, as grpo_loss_call sees it
        calls = 0

        @classmethod
        def apply(cls, logits, call):
            cls.calls += 1
            return torch.zeros(()), torch.zeros(4)

    monkeypatch.setattr(grpo_loss_op._HOST, "forward", host)
    monkeypatch.setattr(grpo_loss_op, "GrpoLossFunction", PythonPath)
    call = _cpu_grpo_call()
    monkeypatch.setattr(launch, "fast_path_now", lambda: _FakeRuntime())
    assert grpo_loss_op.grpo_loss_call(call) is sentinel and served == [call] and PythonPath.calls == 0
    with grpo_loss_op._HOST.off():
        assert grpo_loss_op.grpo_loss_call(call) is not sentinel and PythonPath.calls == 1
    monkeypatch.setenv("RLK_GRPO_ONE_READ", "0")
    _, metrics = grpo_loss_op.grpo_loss_call(call)
    assert PythonPath.calls == 2 and set(metrics) == {"pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss"}
    monkeypatch.delenv("RLK_GRPO_ONE_READ")
    monkeypatch.setattr(launch, "fast_path_now", lambda: None)
    assert grpo_loss_op.grpo_loss_call(call) is not sentinel and PythonPath.calls == 3
    assert len(served) == 1


def test_fast_launch_switch_keeps_every_host_path_off():
    """VIME_RL_KERNEL_FAST_LAUNCH=0: the fast path never resolves, so no kernel is registered and
    no host path is built or asked (a fresh process: the switch is read at import)."""
    code = (
        "from kernels import launch\n"
        "from kernels.ops import grpo_loss, logp, ratio_kl\n"
        "assert launch._resolve_runtime() is None and launch.fast_path_now() is None\n"
        "assert grpo_loss._host_module() is None\n"
        "print(launch.disabled_reason())\n"
        "print(grpo_loss.host_path())\n"
        "print(ratio_kl.host_path())\n"
        "print(logp.host_path())\n"
    )
    env = {**os.environ, "VIME_RL_KERNEL_FAST_LAUNCH": "0"}
    out = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["switched off by VIME_RL_KERNEL_FAST_LAUNCH",
                                       *["python (no kernel registered)"] * 3]


# GPU: the host path against the Python path, bitwise


def _require_grpo_host_path(monkeypatch):
    if not triton.__version__.startswith(launch.VERIFIED_TRITON):
        pytest.skip(f"triton {triton.__version__}: the fast path is off for unverified versions")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the one-read path needs thread-block clusters (compute capability 9.0)")
    monkeypatch.setattr(launch, "verify_keys", False)  # key verification sends every call through Python
    assert launch._resolve_runtime() is not None, launch.disabled_reason()
    return _grpo_module_or_skip()


def _grpo_gpu_inputs(t, v, dtype, *, seed=0, ref=True, packing="lengths", mask_dtype=torch.bool, tis=False,
                     id_dtype=torch.int64):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(t, v, device="cuda", generator=gen) * 2).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (t,), device="cuda", generator=gen).to(id_dtype)
    ids[t // 3] = -100
    base = -torch.rand(t, device="cuda", generator=gen) * 5
    kw = {
        "old_logp": base + 0.3 * torch.randn(t, device="cuda", generator=gen),
        "ref_logp": base + 0.3 * torch.randn(t, device="cuda", generator=gen) if ref else None,
        "advantages": torch.randn(t, device="cuda", generator=gen),
        "loss_mask": (torch.rand(t, device="cuda", generator=gen) > 0.2).to(mask_dtype),
    }
    if tis:
        kw["rollout_logp"] = kw["old_logp"] + 0.2 * torch.randn(t, device="cuda", generator=gen)
    first = max(1, t // 3)
    lengths = torch.tensor([first, t - first] if t > first else [t], device="cuda")
    if packing == "lengths":
        kw["lengths"] = lengths
    elif packing == "cu_seqlens":
        kw["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=lengths.dtype, device="cuda"), lengths.cumsum(0)]).int()
    return logits, ids, kw


_GRPO_CASES = [
    # (name, T, V, dtype, input options, LossConfig options, temperature, grad_output)
    ("bf16-kl", 64, 32000, torch.bfloat16, {}, {"kl_loss_coef": 0.01, "eps_clip_high": 0.28}, 1.0, None),
    ("fp32-no-ref", 7, 4096, torch.float32, {"ref": False, "packing": None}, {}, 1.0, None),
    ("fp16-dual-clip-cu", 48, 8192, torch.float16, {"packing": "cu_seqlens"},
     {"kl_loss_coef": 0.1, "kl_type": "k3", "eps_clip_c": 3.0}, 0.7, None),
    ("bf16-tis-per-token", 130, 32000, torch.bfloat16, {"tis": True, "mask_dtype": torch.float32},
     {"kl_loss_coef": 0.01, "use_tis": True, "reduction": "per_token_sum", "use_unbiased_kl": True}, 1.0, None),
    ("bf16-grad-2.5", 64, 32000, torch.bfloat16, {}, {"kl_loss_coef": 0.01}, 1.0, 2.5),
    ("fp32-one-token", 1, 1024, torch.float32, {"packing": None}, {"kl_loss_coef": 0.01, "kl_type": "k2"}, 1.0, None),
]


def _predict(g):
    """Word 3 of the device's error word (kernels/device_errors.py) as if the last backward had met
    ``g``: the next one-read forward writes dlogits for it."""
    torch.cuda.synchronize()  # a backward still in flight would store its own
    word = device_errors.word_for(torch.device("cuda", torch.cuda.current_device()))
    word.view[device_errors.LAST_GRAD] = device_errors.encode_grad(g)


def _grpo_run(case, seed=0):
    """(loss, metrics, dlogits) of the op's entry point for a case, from a forward that predicts a
    gradient of 1."""
    _predict(1.0)
    _, t, v, dtype, inputs, options, temperature, grad_output = case
    logits, ids, kw = _grpo_gpu_inputs(t, v, dtype, seed=seed, **inputs)
    loss, metrics = grpo_loss_op.grpo_loss(logits, ids, config=LossConfig(**options), temperature=temperature, **kw)
    g = None if grad_output is None else torch.tensor(grad_output, device="cuda")
    (dlogits,) = torch.autograd.grad(loss, logits, grad_outputs=g)
    return [loss.detach(), *(metrics[k] for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss")), dlogits]


def _grpo_served():
    return grpo_loss_op._HOST.load().served()


def _assert_node_matches_the_python_path(op_module, run, calls: int, host_node: str, python_node: str):
    """``run()`` (its tensors, then its outputs' last grad_fn name) with ``calls`` calls served by
    ``op_module``'s host path and its node, then on the Python path alone: the same tensors, bitwise."""
    served = op_module._HOST.load().served
    before = served()
    *host, node = run()
    assert served() == before + calls and node == host_node, (served() - before, node)
    with op_module._HOST.off():
        *python, node = run()
    assert node == python_node
    assert all(torch.equal(a, b) for a, b in zip(host, python))


def _assert_host_path_is_bitwise_the_python_path(op_module, run, case, names):
    """``run(case)`` served by ``op_module``'s host path (once the Python path has registered its
    kernels) gives outputs ``names`` bitwise equal to its Python path's."""
    run(case, seed=1)  # the Python path compiles, launches and registers
    assert op_module._HOST.forward is not None, "no kernel was registered with the host path"
    served = op_module._HOST.load().served
    before = served()
    host = run(case)
    assert served() == before + 1, f"the host path did not serve the call: {op_module.host_path()}"
    with op_module._HOST.off():
        python = run(case)
    torch.cuda.synchronize()
    assert len(host) == len(python)
    for name, a, b in zip(names, host, python):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs between the host path and the Python path"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GRPO_CASES, ids=lambda c: c[0])
def test_grpo_host_path_is_bitwise_the_python_path(monkeypatch, case):
    _require_grpo_host_path(monkeypatch)
    _assert_host_path_is_bitwise_the_python_path(grpo_loss_op, _grpo_run, case,
                                                 ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "dlogits"))


@pytest.mark.gpu
def test_grpo_predicted_gradient_hit_or_miss_gives_the_same_bits_on_both_paths(monkeypatch):
    """The one-read forward writes dlogits for the last backward's gradient (word 3), the backward
    rewrites them on the device when the actual gradient differs (a miss). For a training loop's
    gradients (1, vime's 8 / 256, 0.37), a hit and a miss on the host path and on the Python path
    give the same loss, metrics and dlogits bit for bit, dlogits within the reference's tolerance,
    and each backward stores its gradient for the next forward. A miss that kept the forward's rows
    (the rewrite broken on purpose below) fails these checks."""
    from rlk_op_cases import loss_upstream_grad

    from kernels import tolerances
    from kernels.reference import grpo_loss as reference_grpo_loss

    _require_grpo_host_path(monkeypatch)
    t, v, dtype = 64, 32000, torch.bfloat16
    config = LossConfig(kl_loss_coef=0.01, eps_clip_high=0.28)
    logits, ids, kw = _grpo_gpu_inputs(t, v, dtype)
    word = device_errors.word_for(logits.device)
    other = 0.5  # a prediction none of the gradients below has: a miss

    def run(g, predicted, host):
        _predict(predicted)
        before = _grpo_served()
        with contextlib.nullcontext() if host else grpo_loss_op._HOST.off():
            loss, metrics = grpo_loss_op.grpo_loss(logits, ids, config=config, **kw)
            served = _grpo_served() - before
            (dlogits,) = torch.autograd.grad(loss, logits, torch.tensor(g, device="cuda"))
        torch.cuda.synchronize()
        assert served == int(host), f"gradient {g}, prediction {predicted}: host path served {served}"
        return [loss.detach(), *(metrics[k] for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss")), dlogits]

    def check(g, results):
        first, *rest = results
        for other_result in rest:
            for a, b in zip(first, other_result, strict=True):
                assert torch.equal(a, b), f"gradient {g}: a hit and a miss, or the two paths, differ"
        leaf = logits.detach().float().requires_grad_()
        loss, _ = reference_grpo_loss(leaf, ids, config=config, **kw)
        (want,) = torch.autograd.grad(loss, leaf, torch.tensor(g, device="cuda"))
        upstream = loss_upstream_grad(logits, ids, kw, config, 1.0, g)
        for got in results:
            tolerances.assert_close(got[-1], want, "grpo_loss.grad", dtype, name=f"dlogits, gradient {g}",
                                    upstream=upstream)

    run(1.0, 1.0, host=False)  # the Python path compiles and registers its kernels
    for g in (1.0, 8 / 256, 0.37):
        stored = torch.tensor(g, dtype=torch.float32).item()
        results = [run(g, other, host=True)]
        assert word.last_grad() == stored
        results += [run(g, g, host=True), run(g, g, host=False), run(g, other, host=False)]
        assert word.last_grad() == stored
        check(g, results)
    # the miss path broken on purpose: the write kernel told that the gradient was the predicted one
    write = grpo_loss_op._write_dlogits

    def keeps_the_forward_rows(logits, ids, residual, grad_output, grad, expected, temperature):
        if expected is not None:
            grad_output = torch.full_like(grad_output, expected)
        return write(logits, ids, residual, grad_output, grad, expected, temperature)

    good = run(0.37, 0.37, host=False)
    monkeypatch.setattr(grpo_loss_op, "_write_dlogits", keeps_the_forward_rows)
    broken = run(0.37, other, host=False)
    with pytest.raises(AssertionError, match="differ"):
        check(0.37, [good, broken])
    with pytest.raises(AssertionError, match="dlogits, gradient 0.37"):
        check(0.37, [broken])


@pytest.mark.gpu
def test_grpo_host_path_backward_twice_through_a_retained_graph(monkeypatch):
    _require_grpo_host_path(monkeypatch)
    case = _GRPO_CASES[0]
    _grpo_run(case)

    def twice():
        logits, ids, kw = _grpo_gpu_inputs(64, 32000, torch.bfloat16)
        loss, _ = grpo_loss_op.grpo_loss(logits, ids, config=LossConfig(kl_loss_coef=0.01), **kw)
        loss.backward(retain_graph=True)
        first = logits.grad.clone()
        loss.backward(torch.tensor(0.5, device="cuda"))  # accumulates; the graph is freed after this one
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        return first, logits.grad

    before = _grpo_served()
    host = twice()
    assert _grpo_served() == before + 1
    with grpo_loss_op._HOST.off():
        python = twice()
    assert all(torch.equal(a, b) for a, b in zip(host, python))


@pytest.mark.gpu
def test_grpo_host_path_serves_the_public_call_and_declines_the_rest(monkeypatch):
    import kernels

    _require_grpo_host_path(monkeypatch)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    logits, ids, kw = _grpo_gpu_inputs(64, 32000, torch.bfloat16)
    config = LossConfig(kl_loss_coef=0.01)
    for _ in range(2):
        loss, _ = kernels.grpo_loss(logits, ids, config=config, **kw)
        torch.autograd.grad(loss, logits)
    before = _grpo_served()
    loss, _ = kernels.grpo_loss(logits, ids, config=config, **kw)
    assert _grpo_served() == before + 1 and loss.grad_fn.name() == "GrpoLossBackward"
    torch.autograd.grad(loss, logits)
    # not the common case: int32 ids, padded rows (stride 32016), fp64 advantages, no gradient wanted
    padded = torch.zeros(64, 32016, dtype=logits.dtype, device="cuda")
    padded[:, :32000] = logits.detach()
    declined = [
        ((logits, ids.int()), kw),
        ((padded[:, :32000].requires_grad_(), ids), kw),
        ((logits, ids), {**kw, "advantages": kw["advantages"].double()}),
        ((logits.detach(), ids), kw),
    ]
    for args, kwargs in declined:
        kernels.grpo_loss(*args, config=config, **kwargs)
    assert _grpo_served() == before + 1
    with pytest.raises(ValueError, match=r"old_logp must have shape \[64\]"):
        kernels.grpo_loss(logits, ids, config=config, **{**kw, "old_logp": kw["old_logp"][:-1]})


@pytest.mark.gpu
def test_grpo_host_path_reports_bad_ids_through_the_error_word(monkeypatch):
    _require_grpo_host_path(monkeypatch)
    case = _GRPO_CASES[0]
    _grpo_run(case)
    device_errors.raise_pending_errors()
    logits, ids, kw = _grpo_gpu_inputs(64, 32000, torch.bfloat16)
    ids[5] = 32000
    before = _grpo_served()
    loss, _ = grpo_loss_op.grpo_loss(logits, ids, config=LossConfig(kl_loss_coef=0.01), **kw)
    assert _grpo_served() == before + 1
    call_id = device_errors._next_id
    with pytest.raises(device_errors.DeviceInputError, match=r"target_ids\[5\] = 32000") as raised:
        device_errors.raise_pending_errors()
    assert raised.value.call_id == call_id and raised.value.input == "target_ids"
    assert bool(torch.isnan(loss))


@pytest.mark.gpu
def test_grpo_host_path_is_recorded_by_cuda_graph_capture(monkeypatch):
    _require_grpo_host_path(monkeypatch)
    _grpo_run(_GRPO_CASES[0])
    logits, ids, kw = _grpo_gpu_inputs(64, 32000, torch.bfloat16, seed=3)
    config = LossConfig(kl_loss_coef=0.01)

    def step():
        loss, metrics = grpo_loss_op.grpo_loss(logits, ids, config=config, **kw)
        (dlogits,) = torch.autograd.grad(loss, logits)
        return [loss.detach(), metrics["pg_loss"], dlogits]

    _host_path_replays(step, _grpo_served, 1)


# ---------------------------------------------------------------- logp's single-device host path

def _logp_module_or_skip():
    return _host_module_or_skip(logp_op._HOST)


def test_logp_host_module_declines_what_is_not_the_common_case():
    module = _logp_module_or_skip()
    logits = torch.randn(8, 32).requires_grad_()
    ids = torch.randint(0, 32, (8,))
    stats = torch.zeros(3, 8)
    native = (1, 128, 0, "PPPPPPiiiif")
    served = module.served()  # earlier tests in this process may have been served
    # CPU tensors, other objects, bad registrations: None (the Python path decides and explains)
    assert module.forward(LogpCall(logits, ids)) is None
    assert module.forward(object()) is None
    assert module.register_forward(logits, ids, stats[1], stats[2], 1.0, -100, True, native, 0) is None
    assert module.register_forward("logits", ids, stats[1], stats[2], 1.0, -100, True, native, 0) is None
    assert module.register_backward(logits, ids, stats[0], stats[1], stats[2], 1.0, -100, native) is None
    assert module.register_backward(logits, ids.int(), stats[0], stats[1], stats[2], 1.0, -100, native) is None
    with pytest.raises(TypeError, match="register_forward takes 9 arguments, got 2"):
        module.register_forward(logits, ids)
    with pytest.raises(TypeError, match="register_backward takes 8 arguments, got 1"):
        module.register_backward(logits)
    assert module.served() == served


def test_logp_call_takes_the_host_path_only_while_the_fast_path_may_run(monkeypatch):
    """logp_call asks the host path first, takes its answer, runs the Python path where it declines
    (None), and does not ask at all while its host module is off (``_HOST.off()``) or kernels.launch's
    fast path is (VIME_RL_KERNEL_FAST_LAUNCH=0, an unverified Triton, key verification, a launch hook)."""
    asked, answer = [], [torch.zeros(8)]

    def host(call):
        asked.append(call)
        return answer[0]

    python_path = []
    monkeypatch.setattr(logp_op, "_launch_fwd", lambda *a, **k: python_path.append(a) or (torch.ones(8),) * 3)
    monkeypatch.setattr(logp_op._HOST, "forward", host)
    call = LogpCall(torch.randn(8, 32), torch.randint(0, 32, (8,)))
    monkeypatch.setattr(launch, "fast_path_now", lambda: _FakeRuntime())
    assert logp_op.logp_call(call) is answer[0] and asked == [call] and not python_path
    answer[0] = None  # declined: the Python path runs
    assert torch.equal(logp_op.logp_call(call), torch.ones(8)) and len(asked) == 2 and len(python_path) == 1
    with logp_op._HOST.off():
        logp_op.logp_call(call)
    assert len(asked) == 2 and len(python_path) == 2
    monkeypatch.setattr(launch, "fast_path_now", lambda: None)
    logp_op.logp_call(call)
    assert len(asked) == 2 and len(python_path) == 3


# GPU: logp's host path against its Python path, bitwise

def _require_logp_host_path(monkeypatch):
    if not triton.__version__.startswith(launch.VERIFIED_TRITON):
        pytest.skip(f"triton {triton.__version__}: the fast path is off for unverified versions")
    monkeypatch.setattr(launch, "verify_keys", False)  # key verification sends every call through Python
    assert launch._resolve_runtime() is not None, launch.disabled_reason()
    return _logp_module_or_skip()


def _logp_gpu_inputs(t, v, dtype, *, seed=0, offset=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(t * v + offset, device="cuda", generator=gen) * 3).to(dtype)[offset:].view(t, v)
    ids = torch.randint(0, v, (t,), device="cuda", generator=gen)
    ids[t // 3] = -100
    return logits, ids


# (name, T, V, dtype, temperature, gradient: None (no grad), "ones", "randn", "sum" (an expanded one))
_LOGP_CASES = [
    ("bf16-grad", 64, 32000, torch.bfloat16, 1.0, "randn"),
    ("bf16-no-grad", 64, 151936, torch.bfloat16, 1.0, None),
    ("fp16-temperature", 48, 8192, torch.float16, 0.7, "ones"),
    ("fp32-sum", 7, 4096, torch.float32, 1.0, "sum"),
    ("fp32-no-grad-one-token", 1, 1000, torch.float32, 1.3, None),
    ("bf16-T2", 2, 1024, torch.bfloat16, 1.0, "randn"),  # the statistics rows: T % 4 and T % 2
    ("bf16-T3", 3, 1024, torch.bfloat16, 1.0, "randn"),
    ("fp32-T130", 130, 32000, torch.float32, 1.0, "randn"),
]


def _logp_run(case, seed=0):
    """(logp, dlogits or None) of the op's entry point for a case."""
    _, t, v, dtype, temperature, gradient = case
    logits, ids = _logp_gpu_inputs(t, v, dtype, seed=seed)
    if gradient is None:
        with torch.no_grad():
            return [logp_op.logp(logits, ids, temperature)]
    logits.requires_grad_()
    out = logp_op.logp(logits, ids, temperature)
    if gradient == "sum":
        (dlogits,) = torch.autograd.grad(out.sum(), logits)
    else:
        g = torch.ones_like(out) if gradient == "ones" else torch.randn(t, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed + 1))
        (dlogits,) = torch.autograd.grad(out, logits, g)
    return [out.detach(), dlogits]


def _logp_served():
    return logp_op._HOST.calls_served()  # what the benchmarks' rlk_on_host_path reads


@pytest.mark.gpu
@pytest.mark.parametrize("case", _LOGP_CASES, ids=lambda c: c[0])
def test_logp_host_path_is_bitwise_the_python_path(monkeypatch, case):
    _require_logp_host_path(monkeypatch)
    _assert_host_path_is_bitwise_the_python_path(logp_op, _logp_run, case, ("logp", "dlogits"))


@pytest.mark.gpu
def test_logp_host_path_backward_through_a_retained_graph(monkeypatch):
    _require_logp_host_path(monkeypatch)
    case = _LOGP_CASES[0]
    _logp_run(case)

    def twice():
        logits, ids = _logp_gpu_inputs(64, 32000, torch.bfloat16)
        logits.requires_grad_()
        out = logp_op.logp(logits, ids)
        out.sum().backward(retain_graph=True)
        first = logits.grad.clone()
        out.backward(torch.full_like(out, 0.5))  # accumulates; the graph is freed after this one
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.sum().backward()
        return first, logits.grad, out.grad_fn.name()

    _assert_node_matches_the_python_path(logp_op, twice, 1, "LogpBackward", "LogpFunctionBackward")


@pytest.mark.gpu
def test_logp_host_path_serves_the_public_call_and_declines_the_rest(monkeypatch):
    import kernels

    _require_logp_host_path(monkeypatch)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    logits, ids = _logp_gpu_inputs(64, 32000, torch.bfloat16)
    logits.requires_grad_()
    for _ in range(2):
        torch.autograd.grad(kernels.logp(logits, ids).sum(), logits)
    before = _logp_served()
    out = kernels.logp(logits, ids)
    assert _logp_served() == before + 1 and out.grad_fn.name() == "LogpBackward"
    torch.autograd.grad(out.sum(), logits)
    # not the common case: int32 ids, padded rows (stride 32016), misaligned logits, ids on a stride
    padded = torch.zeros(64, 32016, dtype=logits.dtype, device="cuda")
    padded[:, :32000] = logits.detach()
    misaligned, _ = _logp_gpu_inputs(64, 32000, torch.bfloat16, offset=1)
    declined = [(logits, ids.int()), (padded[:, :32000].requires_grad_(), ids), (misaligned.requires_grad_(), ids),
                (logits, ids.repeat(2)[::2])]
    for args in declined:
        out = kernels.logp(*args)
        assert out.grad_fn.name() == "LogpFunctionBackward"
        torch.autograd.grad(out.sum(), args[0])
    assert _logp_served() == before + 1
    with pytest.raises(ValueError, match=r"target_ids must have shape \[64\]"):
        kernels.logp(logits, ids[:-1])


@pytest.mark.gpu
def test_logp_host_path_reports_bad_ids_through_the_error_word(monkeypatch):
    _require_logp_host_path(monkeypatch)
    for case in (_LOGP_CASES[0], _LOGP_CASES[1]):  # with and without a gradient
        _logp_run(case)
        device_errors.raise_pending_errors()
        _, t, v, dtype, _, gradient = case
        logits, ids = _logp_gpu_inputs(t, v, dtype)
        logits.requires_grad_(gradient is not None)
        ids[5] = v
        before = _logp_served()
        out = logp_op.logp(logits, ids)
        assert _logp_served() == before + 1
        call_id = device_errors._next_id
        with pytest.raises(device_errors.DeviceInputError, match=rf"target_ids\[5\] = {v}") as raised:
            device_errors.raise_pending_errors()
        assert raised.value.call_id == call_id and raised.value.input == "target_ids"
        assert bool(torch.isnan(out[5])) and bool(torch.isfinite(out[6]))


@pytest.mark.gpu
def test_logp_host_path_serves_the_public_call_before_dispatch_with_the_contracts_decisions(monkeypatch):
    import kernels
    from kernels import dispatch

    _require_logp_host_path(monkeypatch)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    for name in ("VIME_RL_KERNEL_CHECK_IDS", "VIME_RL_KERNEL_CHECK_FINITE", "VIME_RL_KERNEL_OPS"):
        monkeypatch.delenv(name, raising=False)
    logits, ids = _logp_gpu_inputs(64, 32000, torch.bfloat16)
    bad = ids.clone()
    bad[5] = 32000
    with torch.no_grad():
        kernels.logp(logits, ids)  # registers the forward kernel
        want = dispatch.run("logp", LogpCall(logits, ids))
        device_errors.raise_pending_errors()
        before = _logp_served()
        with monkeypatch.context() as patch:
            patch.setattr(dispatch, "select", lambda op, **case: pytest.fail(f"{op} was dispatched"))
            got = kernels.logp(logits, ids)
            out = kernels.logp(logits, bad)
        assert _logp_served() == before + 2 and torch.equal(got, want)
        call_id = device_errors._next_id  # the bad call's, taken by the host-first entry
        with pytest.raises(device_errors.DeviceInputError, match=r"target_ids\[5\] = 32000") as raised:
            device_errors.raise_pending_errors()
        assert raised.value.call_id == call_id and bool(torch.isnan(out[5])) and bool(torch.isfinite(out[6]))
        # what the contract decides otherwise is declined, and the contract's checks run
        monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "strict")
        with pytest.raises(ValueError, match=r"target_ids has 1 id\(s\) outside \[0, 32000\)"):
            kernels.logp(logits, bad)
        monkeypatch.setenv("VIME_RL_KERNEL_CHECK_IDS", "on")
        monkeypatch.setenv("VIME_RL_KERNEL_CHECK_FINITE", "1")
        nan = logits.clone()
        nan[3, 7] = float("nan")
        with pytest.raises(ValueError, match="logits contains 1 non-finite"):
            kernels.logp(nan, ids)
        monkeypatch.delenv("VIME_RL_KERNEL_CHECK_FINITE")
        with pytest.raises(ValueError, match=r"target_ids must have shape \[64\]"):
            kernels.logp(logits, ids[:-1])
        assert _logp_served() == before + 2
        assert torch.equal(kernels.logp(logits, ids, 1), want)  # an int temperature: built, then served
        assert _logp_served() == before + 3


@pytest.mark.gpu
def test_logp_host_path_is_recorded_by_cuda_graph_capture(monkeypatch):
    _require_logp_host_path(monkeypatch)
    _logp_run(_LOGP_CASES[0])
    logits, ids = _logp_gpu_inputs(64, 32000, torch.bfloat16, seed=3)
    logits.requires_grad_()
    grad = torch.randn(64, device="cuda")

    def step():
        out = logp_op.logp(logits, ids)
        (dlogits,) = torch.autograd.grad(out, logits, grad)
        with torch.no_grad():
            no_grad = logp_op.logp(logits, ids)
        return [out.detach(), dlogits, no_grad]

    _host_path_replays(step, _logp_served, 2)

"""The ops' host-side C++ fast paths (kernels/ops/host/): ratio_kl's no-grad forward.

CPU: the module builds against the installed torch (skipped, with the reason, where there is no
C++ compiler or torch's headers), declines every call that is not the common case (so the Python
path's checks run), and a build that cannot run turns the host path off loudly, once.
GPU: on repeat calls the host path serves the common case bitwise equal to the Python path, over
what the kernel is specialized on; everything else (non-contiguous, another device, a gradient,
bad input) still takes the Python path, with its errors; CUDA-graph capture records it.
"""

from __future__ import annotations

import logging

import pytest
import torch
import triton

from kernels import launch
from kernels.ops import ratio_kl as ratio_kl_op
from kernels.ops.host import HostModule, build


def _host_module_or_skip():
    if build.find_cxx() is None:
        pytest.skip("no C++ compiler here (g++, $CXX or $RLK_CXX): the host path cannot be built")
    if not build.torch_headers_present():
        pytest.skip(f"torch's C++ headers are not installed under {build._torch_paths()[0]}")
    module = ratio_kl_op._HOST.load()
    assert module is not None, ratio_kl_op._HOST.disabled_reason()
    return module


def _cpu_inputs(n=16):
    logp = -torch.rand(n)
    return [logp, logp + 0.1, logp - 0.1, torch.ones(n, dtype=torch.bool)]


def test_host_module_declines_what_is_not_the_common_case():
    module = _host_module_or_skip()
    inputs = _cpu_inputs()
    # CPU tensors, other objects, a bad KL code: None (the Python path decides and explains)
    assert module.forward(*inputs, 3, False, 0, 0) is None
    assert module.forward("logp", *inputs[1:], 3, False, 0, 0) is None
    assert module.forward(*inputs, 9, False, 0, 0) is None
    assert module.forward(*inputs, 3, "no", 0, 0) is None
    assert module.register(*inputs, 3, False, 0, 1, 1024, 128, 0, "PPPPPPi") is None  # nothing to store
    with pytest.raises(TypeError, match="forward takes 8 arguments, got 4"):
        module.forward(*inputs)
    with pytest.raises(TypeError, match="register takes 12 arguments, got 6"):
        module.register(*inputs, 3, False)


def test_a_host_path_that_cannot_be_built_is_off_loudly_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("RLK_CUDA_CACHE", str(tmp_path))  # nothing cached: a build is due
    monkeypatch.setenv("RLK_CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv("CXX", raising=False)
    host = HostModule("ratio_kl_forward")
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert host.load() is None
        assert host.load() is None
    assert host.disabled_reason() == (f"HostBuildError: the C++ compiler RLK_CXX='{tmp_path / 'no-such-compiler'}' "
                                      "names is not there")
    assert [r.getMessage() for r in caplog.records].count(
        f"kernels: ratio_kl_forward host path off, the op keeps its Python path: {host.disabled_reason()}") == 1


def test_no_compiler_at_all_says_how_to_name_one(monkeypatch, tmp_path):
    monkeypatch.setenv("RLK_CUDA_CACHE", str(tmp_path))
    monkeypatch.delenv("RLK_CXX", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ or c++ on it
    with pytest.raises(build.HostBuildError, match=r"no C\+\+ compiler found \(set RLK_CXX or CXX"):
        build.load_extension(HostModule("ratio_kl_forward").source)


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
        assert ratio_kl_op._host_forward is not None, "no kernel was registered with the host path"
        counting = _CountingHost(ratio_kl_op._host_forward)
        monkeypatch.setattr(ratio_kl_op, "_host_forward", counting)
        host = _run(cases)
        assert counting.served == len(cases), f"the host path served {counting.served} of {len(cases)} calls"
        monkeypatch.setattr(ratio_kl_op, "_host_forward", None)
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
    counting = _CountingHost(ratio_kl_op._host_forward)
    monkeypatch.setattr(ratio_kl_op, "_host_forward", counting)
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
    ratio, kl = ratio_kl_op.ratio_kl(leaf, old, ref, mask)  # a gradient is wanted: autograd.Function
    assert counting.served == 1 and ratio.grad_fn is not None
    (grad,) = torch.autograd.grad((ratio + kl).sum(), leaf)
    assert bool(torch.isfinite(grad).all())


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
        for x in captured:
            x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, want))

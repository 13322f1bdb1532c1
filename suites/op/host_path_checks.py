"""What the host-path tests share: the host module built (or the reason it cannot be), a stand-in
runtime, and the checks that a host path gives the Python path's bits and replays in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kernels.ops import ratio_kl as ratio_kl_op
from kernels.ops.host import HostModule, build


def host_module_or_skip(host: HostModule = ratio_kl_op._HOST):
    if build.find_cxx() is None:
        pytest.skip("no C++ compiler here (g++, $CXX or $RLK_CXX): the host path cannot be built")
    if not build.torch_headers_present():
        pytest.skip(f"torch's C++ headers are not installed under {build._torch_paths()[0]}")
    module = host.load()
    assert module is not None, host.disabled_reason()
    return module


class FakeRuntime:  # kernels.launch's runtime, whose presence lets an op ask its host path
    def get_device(self):
        return 0  # no direct launch is stored for it: the Python path launches through Triton

    def get_stream(self, device):
        return 0


def replays_to(graph, captured, want):
    """The captured outputs, poisoned, hold ``want`` again after one replay of ``graph``."""
    for x in captured:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, want))


def host_path_replays(step, served, calls: int) -> None:
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
    replays_to(graph, captured, want)


def assert_node_matches_the_python_path(op_module, run, calls: int, host_node: str, python_node: str):
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


def assert_host_path_is_bitwise_the_python_path(op_module, run, case, names):
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

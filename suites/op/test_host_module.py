"""The ops' host-side C++ fast paths (kernels/ops/host/), what they share: the module builds
against the installed torch (skipped, with the reason, where there is no C++ compiler or torch's
headers), declines every call that is not the common case (so the Python path's checks run), turns
its forward on with the first kernel stored and refuses a clash, and a build that cannot run turns
the host path off loudly, once. The public ``kernels.ratio_kl`` asks the host path before it builds
or dispatches its call (a stand-in host path on CPU); ``logp``'s host-first entry declines, without
taking a call id, what the contract decides otherwise.

The host paths on the GPU, one file per op: test_host_path_ratio_kl.py, test_host_path_grpo_loss.py,
test_host_path_logp.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import device_errors, launch
from kernels.ops import logp as logp_op
from kernels.ops import ratio_kl as ratio_kl_op
from kernels.ops.host import HostModule, build
from suites.op.host_path_checks import FakeRuntime, host_module_or_skip


def _cpu_inputs(n=16):
    logp = -torch.rand(n)
    return [logp, logp + 0.1, logp - 0.1, torch.ones(n, dtype=torch.bool)]


def test_host_module_declines_what_is_not_the_common_case():
    module = host_module_or_skip()
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
    module = host_module_or_skip(host)
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
    module = host_module_or_skip(host)
    assert host.calls_served() == module.served()  # the process's count (earlier tests may add to it)


def test_a_host_module_turned_off_leaves_its_op_the_python_path_until_the_block_ends():
    host = HostModule("ratio_kl_elementwise")
    module = host_module_or_skip(host)
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
    module = host_module_or_skip(host)
    with host.off():
        host.registered(True, "this call's kernel")
        assert host.forward is None
    assert host.forward is module.forward
    fresh = HostModule("ratio_kl_elementwise")
    with fresh.off(register=False):
        assert fresh.registry() is None
    assert fresh.forward is None, "nothing was stored: the forward stays off"


def test_ratio_kl_asks_its_host_module_first_and_not_while_it_is_off(monkeypatch):
    asked, answer = [], (torch.zeros(16), torch.zeros(16))

    def host(*args):
        asked.append(args)
        return answer

    monkeypatch.setattr(ratio_kl_op._HOST, "forward", host)
    if torch.cuda.is_available():  # the Python path launches the compiled kernel: device inputs
        inputs = [t.cuda() for t in _cpu_inputs()]
    else:  # the Triton interpreter; a stand-in runtime says the fast path may run
        monkeypatch.setattr(launch, "fast_path_now", lambda: FakeRuntime())
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
        monkeypatch.setattr(launch, "fast_path_now", lambda: FakeRuntime())
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
    monkeypatch.setattr(launch, "fast_path_now", lambda: FakeRuntime())
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

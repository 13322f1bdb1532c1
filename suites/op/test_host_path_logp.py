"""logp's single-device host path: on CPU it declines what is not the common case and is taken only
while the fast path may run. On the GPU: the log-prob and dlogits bitwise equal to the Python path's
over dtypes, temperature, T (the statistics rows' alignment), with and without a gradient, gradients
that are ones, random or expanded, a backward through a retained graph, bad ids reported under the
call's id, the public call served and the rest declined, the public call served before dispatch (bad
ids reported under the id its host-first entry took; strict ids, the finite check and shapes left to
the contract), CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch
import triton

from kernels import device_errors, launch
from kernels.contracts import LogpCall
from kernels.ops import logp as logp_op
from suites.op.host_path_checks import (
    FakeRuntime,
    assert_host_path_is_bitwise_the_python_path,
    assert_node_matches_the_python_path,
    host_module_or_skip,
    host_path_replays,
)


# ---------------------------------------------------------------- logp's single-device host path

def _logp_module_or_skip():
    return host_module_or_skip(logp_op._HOST)


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
    monkeypatch.setattr(launch, "fast_path_now", lambda: FakeRuntime())
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
    assert_host_path_is_bitwise_the_python_path(logp_op, _logp_run, case, ("logp", "dlogits"))


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

    assert_node_matches_the_python_path(logp_op, twice, 1, "LogpBackward", "LogpFunctionBackward")


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

    host_path_replays(step, _logp_served, 2)

"""grpo_loss's one-read host path: on CPU it declines what is not the common case and is taken only
while the fast path may run. On the GPU: loss, metrics and dlogits bitwise equal to the Python
path's over its configurations (reference or none, dual clip, TIS, packing, reductions, temperature,
grad_output != 1, a second backward through a retained graph), the predicted gradient's hits and
misses on both paths, bad ids reported through the error word under the call's id, the public call
served, CUDA-graph capture of forward and backward.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import triton

from kernels import LossConfig, device_errors, launch
from kernels.contracts import GrpoLossCall
from kernels.ops import grpo_loss as grpo_loss_op
from suites.op.host_path_checks import (
    FakeRuntime,
    assert_host_path_is_bitwise_the_python_path,
    host_module_or_skip,
    host_path_replays,
)


# ---------------------------------------------------------------- grpo_loss's one-read host path

def _grpo_module_or_skip():
    return host_module_or_skip(grpo_loss_op._HOST)


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
    monkeypatch.setattr(launch, "fast_path_now", lambda: FakeRuntime())
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


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GRPO_CASES, ids=lambda c: c[0])
def test_grpo_host_path_is_bitwise_the_python_path(monkeypatch, case):
    _require_grpo_host_path(monkeypatch)
    assert_host_path_is_bitwise_the_python_path(grpo_loss_op, _grpo_run, case,
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

    host_path_replays(step, _grpo_served, 1)

"""Dispatch: switches read at call time, allowlist, backend choice, loud fallback (one log line
per (op, reason), a per-op counter), strict mode (KernelFallbackError) and a backend's host-first
entry (served once the backend is loaded, declined calls dispatched)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rlk_op_cases import DEVICE, loss_inputs, make_ids, make_logits

import kernels
from kernels import backends, dispatch
from kernels.backends.base import BaseBackend, Capabilities
from kernels.reference import ratio_kl as reference_ratio_kl
from kernels.reference import selected_logprob
from pytest_rlk.e2e.processes import pythonpath_first

REPO_ROOT = Path(__file__).resolve().parents[2]


class LogpOnlyBackend(BaseBackend):
    """A real (small) third-party-style backend: serves logp with our Triton op, nothing else,
    and no vocab-parallel mode."""

    id = "logp-only"
    version = "1.0"
    capabilities = Capabilities(ops=frozenset({"logp"}), tp=False)

    def get(self, op):
        from kernels.ops.logp import logp_call

        return logp_call


@pytest.fixture
def logp_only_backend(monkeypatch):
    backends.register_backend("logp-only", LogpOnlyBackend)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "logp-only")
    monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
    monkeypatch.delenv("VIME_RL_KERNEL_OPS", raising=False)
    kernels.reset_fallback_counts()
    yield
    backends.unregister_backend("logp-only")
    kernels.reset_fallback_counts()


class RatioKLFirstBackend(BaseBackend):
    """A third-party-style backend with a host-first entry: ratio_kl on the raw public arguments for
    a bool mask (anything else declined), every call through ``get`` otherwise; both the reference's
    math. It records which of the two served."""

    id = "ratio-kl-first"
    version = "1.0"
    capabilities = Capabilities(ops=frozenset({"ratio_kl"}))

    def __init__(self):
        self.served = []

    def host_first(self, op):
        return self._first if op == "ratio_kl" else None

    def _first(self, logp, old_logp, ref_logp, mask, **options):
        if mask.dtype != torch.bool:
            return None
        self.served.append(("first", options))
        return reference_ratio_kl(logp, old_logp, ref_logp, mask, **options)

    def get(self, op):
        def serve(call):
            self.served.append(("get", call.kl_type))
            return reference_ratio_kl(call.logp, call.old_logp, call.ref_logp, call.mask, kl_type=call.kl_type)

        return serve


def test_host_first_entry_serves_once_its_backend_is_loaded_and_declines_to_dispatch(monkeypatch, kernels_off):
    backends.register_backend("ratio-kl-first", RatioKLFirstBackend)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "ratio-kl-first")
    try:
        logp = -torch.rand(8)
        inputs = [logp, logp + 0.1, logp - 0.2, torch.rand(8) > 0.3]
        want = reference_ratio_kl(*inputs, kl_type="k2")
        assert backends.loaded_backend("ratio-kl-first") is None
        got = kernels.ratio_kl(*inputs, kl_type="k2")  # the lane never loads a backend: dispatch does
        backend = backends.loaded_backend("ratio-kl-first")
        assert backend is not None and backend.served == [("get", "k2")]
        for _ in range(2):
            got = kernels.ratio_kl(*inputs, kl_type="k2")
        assert backend.served[1:] == [("first", {"kl_type": "k2"})] * 2
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        kernels.ratio_kl(*inputs[:3], inputs[3].float())  # declined: built, checked, dispatched
        assert backend.served[-1] == ("get", "low_var_kl")
        with pytest.raises(ValueError, match=r"mask must have shape \[8\]"):
            kernels.ratio_kl(*inputs[:3], inputs[3][:-1].float())
        count = len(backend.served)
        monkeypatch.setenv("VIME_RL_KERNEL", "0")
        kernels.ratio_kl(*inputs)
        assert len(backend.served) == count and kernels.fallback_counts() == {}
    finally:
        backends.unregister_backend("ratio-kl-first")


def test_off_by_default_runs_reference_without_fallback(kernels_off):
    logits, ids = make_logits(7, 1000, torch.float32), make_ids(7, 1000)
    assert kernels.backend_id() == "reference/0.1.0"
    backend, _ = dispatch.select("logp", device=logits.device, dtype=logits.dtype)
    assert backend.id == "reference"
    assert torch.equal(kernels.logp(logits, ids), selected_logprob(logits, ids))
    assert kernels.fallback_counts() == {}


def test_enabled_selects_triton(triton_strict):
    assert kernels.backend_id() == "rlk-triton/0.1.0"
    for op in ("logp", "ratio_kl", "grpo_loss"):
        backend, impl = dispatch.select(op, device=torch.device(DEVICE), dtype=torch.bfloat16)
        assert backend.id == "rlk-triton" and impl.__module__ == f"kernels.ops.{op}"


def test_env_read_at_call_time(monkeypatch, kernels_off):
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    assert kernels.backend_id() == "rlk-triton/0.1.0"
    monkeypatch.setenv("VIME_RL_KERNEL", "0")
    assert kernels.backend_id() == "reference/0.1.0"


def test_allowlist_keeps_other_ops_on_reference_silently(monkeypatch, triton_strict):
    monkeypatch.setenv("VIME_RL_KERNEL_OPS", "ratio_kl, grpo_loss")
    assert dispatch.select("logp", device=torch.device(DEVICE))[0].id == "reference"
    assert dispatch.select("grpo_loss", device=torch.device(DEVICE))[0].id == "rlk-triton"
    kernels.logp(make_logits(3, 1000, torch.float32), make_ids(3, 1000))
    assert kernels.fallback_counts() == {}  # not asked for is not a fallback
    monkeypatch.setenv("VIME_RL_KERNEL_OPS", "*")
    assert dispatch.select("logp", device=torch.device(DEVICE))[0].id == "rlk-triton"


def test_fallback_logs_once_and_counts_every_call(logp_only_backend, caplog, rlk_metrics):
    inputs = loss_inputs(12, 1000, torch.float32, lengths=[5, 7])
    logits = inputs.pop("logits")
    with caplog.at_level(logging.WARNING, logger="kernels"):
        for _ in range(3):
            loss, _ = kernels.grpo_loss(logits, **inputs)
        kernels.logp(logits, inputs["target_ids"])  # served: no fallback
    lines = [r.getMessage() for r in caplog.records if r.name == "kernels"]
    assert lines == ["kernels: grpo_loss falls back to reference: logp-only does not implement grpo_loss"]
    assert kernels.fallback_counts() == {"grpo_loss": 3}
    assert kernels.fallback_reasons() == {"grpo_loss": {"logp-only does not implement grpo_loss": 3}}
    assert torch.isfinite(loss)
    rlk_metrics.record_fallbacks(kernels.fallback_counts())
    assert rlk_metrics.fallback_counts == {"grpo_loss": 3}
    kernels.reset_fallback_counts()
    assert kernels.fallback_counts() == {}
    with caplog.at_level(logging.WARNING, logger="kernels"):
        kernels.grpo_loss(logits, **inputs)
    assert len([r for r in caplog.records if r.name == "kernels"]) == 2  # logged again after a reset


def test_capability_reason_for_tp_layout(logp_only_backend):
    backend = backends.get_backend("logp-only")
    assert backend.supports("logp", device=torch.device(DEVICE), dtype=torch.float16, tp_world=1) is None
    reason = backend.supports("logp", device=torch.device(DEVICE), dtype=torch.float16, tp_world=2)
    assert reason == "vocab-parallel (tp_world=2) not supported by logp-only"


def test_strict_turns_fallback_into_error(logp_only_backend, monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    inputs = loss_inputs(12, 1000, torch.float32, lengths=[5, 7])
    with pytest.raises(kernels.KernelFallbackError, match="grpo_loss .* does not implement grpo_loss") as info:
        kernels.grpo_loss(**inputs)
    assert info.value.op == "grpo_loss"
    assert kernels.fallback_counts() == {}


def test_unloadable_backend_falls_back_or_raises(monkeypatch, kernels_off, caplog):
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "no_such_pkg.backend:make")
    logits, ids = make_logits(3, 1000, torch.float32), make_ids(3, 1000)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        out = kernels.logp(logits, ids)
    assert torch.equal(out, selected_logprob(logits, ids))
    assert kernels.fallback_counts() == {"logp": 1}
    assert "backend 'no_such_pkg.backend:make' unavailable" in caplog.records[-1].getMessage()
    assert kernels.backend_id() == "reference/0.1.0"
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    with pytest.raises(kernels.KernelFallbackError, match="cannot import backend module 'no_such_pkg.backend'"):
        kernels.logp(logits, ids)


def test_dotted_path_backend(monkeypatch, kernels_off):
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "kernels.backends.reference:make_backend")
    assert kernels.backend_id() == "reference/0.1.0"
    assert dispatch.select("logp", device=torch.device("cpu"))[0].id == "reference"
    assert kernels.fallback_counts() == {}


def test_unknown_backend_name_error_names_the_lookups():
    with pytest.raises(backends.BackendLoadError, match="unknown backend 'nope'.*pytest_rlk.backends"):
        backends.get_backend("nope")


def test_bad_input_is_an_error_not_a_fallback(logp_only_backend):
    with pytest.raises(ValueError, match="logits dtype"):
        kernels.logp(torch.zeros(2, 5, dtype=torch.float64, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE))
    assert kernels.fallback_counts() == {}


_NO_INTERPRETER_SCRIPT = """
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
import kernels
logits = torch.randn(4, 1000); ids = torch.randint(0, 1000, (4,))
out = [kernels.logp(logits, ids) for _ in range(2)]
result = {"counts": kernels.fallback_counts(), "equal": bool(torch.equal(out[0], kernels.reference.selected_logprob(logits, ids)))}
import os; os.environ["VIME_RL_KERNEL_STRICT"] = "1"
try:
    kernels.logp(logits, ids)
    result["strict"] = "no error"
except kernels.KernelFallbackError as exc:
    result["strict"] = str(exc)
print(json.dumps(result))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA, no-interpreter case needs a CPU-only machine")
def test_no_cuda_no_interpreter_falls_back_in_a_real_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(VIME_RL_KERNEL="1", PYTHONPATH=pythonpath_first(REPO_ROOT, environ=env))
    env.pop("VIME_RL_KERNEL_STRICT", None)
    proc = subprocess.run(
        [sys.executable, "-c", _NO_INTERPRETER_SCRIPT], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["counts"] == {"logp": 2} and result["equal"]
    assert "no CUDA device and TRITON_INTERPRET unset" in result["strict"]
    warning_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kernels:")]
    assert warning_lines == ["kernels: logp falls back to reference: no CUDA device and TRITON_INTERPRET unset"]


_INTERPRETER_PROBE_SCRIPT = """
import json, torch, kernels
from kernels.backends import get_backend
from kernels.backends.triton import interpreter_fails
reason = interpreter_fails()
result = {"reason": reason, "supports": get_backend("rlk-triton").supports("logp", device=torch.device("cpu"))}
try:
    kernels.logp(torch.randn(4, 40), torch.randint(0, 40, (4,)))
    result["ran"] = True
except Exception as exc:
    result["ran"] = False
    result["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(result))
"""


def test_interpreter_probe_agrees_with_an_op_on_cpu_tensors():
    """In a process with the interpreter on: where the probe kernel runs, an op runs on CPU tensors
    through it; where it fails (numpy >= 2.4 under Triton 3.6's interpreter, the GPU machines'
    image), the backend reports the probe's reason and a strict call raises it, naming it, instead
    of an InterpreterError from inside the op."""
    env = dict(os.environ, TRITON_INTERPRET="1", VIME_RL_KERNEL="1", VIME_RL_KERNEL_STRICT="1",
               VIME_RL_KERNEL_BACKEND="rlk-triton", PYTHONPATH=pythonpath_first(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE_SCRIPT], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["supports"] == result["reason"]
    if result["reason"] is None:
        assert result["ran"], result
    else:
        assert not result["ran"] and result["reason"] in result["error"], result


def test_a_failing_interpreter_probe_is_the_backends_reason_on_cpu(monkeypatch):
    from kernels.backends import triton as triton_backend

    if not triton_backend._interpreter_active():
        pytest.skip("the interpreter is off in this process (the GPU lane): the probe is not consulted")
    monkeypatch.setattr(triton_backend, "interpreter_fails", lambda: "the probe kernel failed (test)")
    assert triton_backend.TritonBackend().supports("logp", device=torch.device("cpu")) == "the probe kernel failed (test)"
    assert triton_backend.TritonBackend().supports("logp", device=torch.device("cuda")) is None

"""One route per op per backend: whatever serves a call (the op's C++ host-first entry, the
operators' splits of kernels/library/, the Python path) computes what the serving backend's
``get(op)`` computes. A backend built on ours that overrides an op gets its override on every
path; the routes that bypass ``get`` decline for it.

On a CUDA device the host-first entries of logp and ratio_kl serve every common call after the
first; the tests call each op several times so that a route that ignores the override would serve
some of them. On CPU (no host module) the same assertions hold through the Python path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from rlk_op_cases import DEVICE, make_ids, make_logits

import kernels
from kernels import backends
from kernels.backends.base import BaseBackend, Capabilities
from kernels.backends.triton import TritonBackend
from kernels.library.serve import split_key
from kernels.reference import selected_logprob

SHIFT = 0.25  # far above any dtype's tolerance: an override that is skipped cannot pass


class ShiftedLogpBackend(TritonBackend):
    """``rlk-triton`` with logp's result shifted by SHIFT; every other op unchanged (ours)."""

    id = "rlk-triton-shifted-logp"

    def get(self, op: str) -> Callable[..., Any]:
        impl = super().get(op)
        if op != "logp":
            return impl

        def shifted(call: Any) -> torch.Tensor:
            return impl(call) + SHIFT

        return shifted


class ForeignSameIdBackend(BaseBackend):
    """A third-party backend that reuses our id but not our code: the reference's logp, shifted."""

    id = "rlk-triton"
    version = "third-party"
    capabilities = Capabilities(ops=frozenset({"logp"}))

    def get(self, op: str) -> Callable[..., Any]:
        def shifted(call: Any) -> torch.Tensor:
            return selected_logprob(call.logits, call.target_ids, temperature=call.temperature) + SHIFT

        return shifted


@pytest.fixture
def use_backend(monkeypatch):
    registered = []

    def use(name: str, factory: Callable[[], Any]) -> None:
        backends.register_backend(name, factory)
        registered.append(name)
        for setting in ("VIME_RL_KERNEL_STRICT", "VIME_RL_KERNEL_OPS"):
            monkeypatch.delenv(setting, raising=False)
        monkeypatch.setenv("VIME_RL_KERNEL", "1")
        monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
        monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", name)
        kernels.reset_fallback_counts()

    yield use
    for name in registered:
        backends.unregister_backend(name)
    kernels.reset_fallback_counts()


def test_a_subclass_that_overrides_get_declines_the_routes_that_bypass_it():
    shifted, ours = ShiftedLogpBackend(), TritonBackend()
    assert not shifted.serves_own_routes("logp")
    assert shifted.serves_own_routes("ratio_kl") and ours.serves_own_routes("logp")
    assert split_key(shifted, "logp") is None and split_key(shifted, "grpo_loss") == shifted.id
    assert split_key(ours, "logp") == "rlk-triton"
    import kernels.ops.logp  # noqa: F401  (the host-first entry exists once the op module is loaded)

    assert shifted.host_first("logp") is None
    assert ours.host_first("logp") is not None


def test_a_foreign_backend_with_our_id_never_gets_our_split():
    assert split_key(ForeignSameIdBackend(), "logp") is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_override_serves_every_call(use_backend, dtype):
    """The public call, repeated (the host-first entry serves repeats on a GPU), no-grad and
    with grad, and the operator path (kernels/library/): the override's shift on every one."""
    use_backend("shifted-logp", ShiftedLogpBackend)
    logits, ids = make_logits(64, 1031, dtype), make_ids(64, 1031).to(DEVICE)
    want = selected_logprob(logits, ids) + SHIFT
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for _ in range(4):
        torch.testing.assert_close(kernels.logp(logits, ids), want, atol=tol, rtol=0)
    leaf = logits.detach().requires_grad_(True)
    for _ in range(2):
        torch.testing.assert_close(kernels.logp(leaf, ids), want, atol=tol, rtol=0)
    from kernels.contracts.logp import LogpCall
    from kernels.library import logp_op

    call = LogpCall(logits=leaf, target_ids=ids)
    torch.testing.assert_close(logp_op(call), want, atol=tol, rtol=0)
    assert kernels.fallback_counts() == {}


def test_a_foreign_backend_with_our_id_serves_every_call(use_backend):
    use_backend("foreign-rlk-triton", ForeignSameIdBackend)
    logits, ids = make_logits(7, 1000, torch.float32), make_ids(7, 1000).to(DEVICE)
    want = selected_logprob(logits, ids) + SHIFT
    for _ in range(3):
        torch.testing.assert_close(kernels.logp(logits, ids), want, atol=1e-5, rtol=0)

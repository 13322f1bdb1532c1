"""Each op's contract (kernels/contracts/) is the one statement of its arguments and checks.

Every keyword entry point of an op (the public API, the reference, the Triton op) has the
contract's signature; the backend serving a call receives the call object the public API built
and checked; the integrations reach the kernels through the same dispatch.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from rlk_op_cases import DEVICE, loss_inputs, make_ids, make_logits

import kernels
from kernels import backends, contracts, reference
from kernels.backends.base import BaseBackend, Capabilities
from kernels.ops import grpo_loss as grpo_loss_op
from kernels.ops import linear_logp as linear_logp_op
from kernels.ops import logp as logp_op
from kernels.ops import ratio_kl as ratio_kl_op
from kernels.reference import linear_logp as reference_linear_logp

ENTRY_POINTS = {
    "logp": (kernels.logp, logp_op.logp),
    "ratio_kl": (kernels.ratio_kl, reference.ratio_kl, ratio_kl_op.ratio_kl),
    "grpo_loss": (kernels.grpo_loss, reference.grpo_loss, grpo_loss_op.grpo_loss),
    "linear_logp": (kernels.linear_logp, reference_linear_logp.linear_logp, linear_logp_op.linear_logp),
}


def _parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("op", sorted(ENTRY_POINTS))
def test_every_entry_point_has_the_contract_signature(op):
    expected = _parameters(contracts.CALLS[op])
    for function in ENTRY_POINTS[op]:
        assert _parameters(function) == expected, f"{function.__module__}.{function.__name__}"


def test_the_public_docstring_is_the_contract():
    assert inspect.cleandoc(contracts.GrpoLossCall.__doc__) in inspect.getdoc(kernels.grpo_loss)
    assert "old_logp        [T] floating point" in contracts.LossInputs.__doc__


class RecordingBackend(BaseBackend):
    """Serves every op with the reference and keeps the call objects it was given."""

    id = "recording"
    version = "1"
    capabilities = Capabilities(ops=frozenset({"logp", "ratio_kl", "grpo_loss", "linear_logp"}))

    def __init__(self) -> None:
        self.calls: list[object] = []

    def get(self, op):
        reference_impl = backends.get_backend("reference").get(op)

        def record(call):
            self.calls.append(call)
            return reference_impl(call)

        return record


@pytest.fixture
def recording(monkeypatch):
    backend = RecordingBackend()
    backends.register_backend("recording", lambda: backend)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "recording")
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    monkeypatch.delenv("VIME_RL_KERNEL_OPS", raising=False)
    yield backend
    backends.unregister_backend("recording")


def test_a_backend_receives_the_checked_call(recording):
    inputs = loss_inputs(12, 50, torch.float32, seed=3, lengths=[5, 7])
    logits = inputs.pop("logits")
    loss, _ = kernels.grpo_loss(logits, temperature=0.7, **inputs)
    (call,) = recording.calls
    assert isinstance(call, contracts.GrpoLossCall) and call.logits is logits and call.temperature == 0.7
    assert call.num_tokens == 12 and call.tp_world == 1 and call.num_samples() == 2
    expected, _ = reference.grpo_loss(logits, temperature=0.7, **inputs)
    assert torch.equal(loss, expected)
    with pytest.raises(ValueError, match="temperature must be a finite float > 0"):
        kernels.grpo_loss(logits, temperature=0.0, **inputs)
    assert len(recording.calls) == 1, "a bad input never reaches the backend"


def test_grpo_loss_takes_ignore_index_on_every_entry_point():
    inputs = loss_inputs(10, 40, torch.float32, seed=5)
    logits, ids = inputs.pop("logits"), inputs.pop("target_ids")
    ids = ids.clone()
    ids[3] = -1
    loss, _ = kernels.grpo_loss(logits, ids, ignore_index=-1, **inputs)
    expected, _ = reference.grpo_loss(logits, ids, ignore_index=-1, **inputs)
    assert torch.equal(loss, expected)
    with pytest.raises(ValueError, match="only ignore_index=-100 may lie outside"):
        kernels.grpo_loss(logits, ids, **inputs)


def _provider_request():
    from types import SimpleNamespace

    from kernels.integrations import linear_logp_provider as provider

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 16, generator=gen).to(DEVICE).requires_grad_()
    weight = torch.randn(40, 16, generator=gen).to(DEVICE)
    # the fork's LinearLogpRequest field names (suites/op/test_linear_logp_provider.py)
    return provider, SimpleNamespace(
        logits=hidden @ weight.t(), target_ids=make_ids(6, 40), tensor_parallel_group=None,
        token_layout=SimpleNamespace(world_size=1, rank=0, layout="single"), with_entropy=False,
        with_entropy_grad=False, chunk_size=-1, log_prob_keep_mask=None, temperature=None, metadata={},
        context=SimpleNamespace(hidden=hidden, projection=SimpleNamespace(weight=weight, bias=None),
                                vocab_partition=SimpleNamespace(local_start=0, local_size=40, real_size=40,
                                                                padded_size=40)),
    )


def test_the_linear_logp_provider_goes_through_dispatch(monkeypatch):
    """The vime provider runs the public op: kernels off -> the reference serves (and says so);
    a backend that cannot serve it -> a counted fallback, or an error in strict mode."""
    monkeypatch.delenv("VIME_RL_KERNEL", raising=False)
    provider, request = _provider_request()
    result = provider.provide(request)
    assert result.backend_id == "reference/0.1.0" and "reference/0.1.0" in result.provenance["implementation"]
    expected = reference_linear_logp.linear_logp(request.context.hidden, request.context.projection.weight,
                                                 request.target_ids)
    assert torch.equal(result.logp[:, 0], expected)

    backends.register_backend("logp-only-here", _LogpOnly)
    try:
        monkeypatch.setenv("VIME_RL_KERNEL", "1")
        monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", "logp-only-here")
        monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
        kernels.reset_fallback_counts()
        assert provider.provide(request).backend_id == "reference/0.1.0"
        assert kernels.fallback_counts() == {"linear_logp": 1}
        monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
        with pytest.raises(kernels.KernelFallbackError, match="does not implement linear_logp"):
            provider.provide(request)
    finally:
        backends.unregister_backend("logp-only-here")
        kernels.reset_fallback_counts()


class _LogpOnly(RecordingBackend):
    id = "logp-only-here"
    capabilities = Capabilities(ops=frozenset({"logp"}))


def test_logp_call_reports_the_case_backends_see():
    logits, ids = make_logits(3, 20, torch.bfloat16), make_ids(3, 20)
    case = contracts.LogpCall(logits, ids, 0.5).case()
    assert case == {"device": logits.device, "dtype": torch.bfloat16, "shape": (3, 20), "requires_grad": False,
                    "temperature": 0.5, "tp_world": 1}

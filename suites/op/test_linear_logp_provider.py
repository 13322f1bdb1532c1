"""The vime fork's linear_logp provider (``kernels.integrations.linear_logp_provider.provide``) on its own.

The requests here carry the fork's field names (``LinearLogpRequest``, ``LinearLogpContext``,
``LinearProjection``, ``VocabPartition``) as plain namespaces: the fork is not installable. The fork's
own classes and its ``compute_linear_logp`` (auto and strict) are exercised in
``suites/module/vime/test_vime_fork_provider.py`` against a fork checkout.
"""

from __future__ import annotations

import importlib
import re
from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import tolerances
from kernels.integrations import linear_logp_provider as provider
from kernels.reference.linear_logp import linear_logp as reference_linear_logp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, H, V = 24, 32, 100


def _request(**overrides):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(DEVICE).requires_grad_()
    bias = (torch.randn(V, generator=gen) * 0.5).to(DEVICE).requires_grad_()
    ids = torch.randint(0, V, (T,), generator=gen).to(DEVICE)
    temperature = 0.7
    logits = hidden @ weight.t() + bias  # the fork hands the LM head's raw output, not divided by T
    request = SimpleNamespace(
        logits=logits, target_ids=ids, tensor_parallel_group=None,
        token_layout=SimpleNamespace(world_size=1, rank=0, layout="single"),
        with_entropy=False, with_entropy_grad=False, chunk_size=-1, log_prob_keep_mask=None,
        context=SimpleNamespace(hidden=hidden, projection=SimpleNamespace(weight=weight, bias=bias),
                                vocab_partition=SimpleNamespace(local_start=0, local_size=V, real_size=V, padded_size=V)),
        temperature=temperature, metadata={"store_prefix": "ref_"},
    )
    for path, value in overrides.items():
        target = request
        *parents, leaf = path.split(".")
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return request


UNSERVABLE = {
    "no_context": ({"context": None}, "has no context"),
    "keep_mask": ({"log_prob_keep_mask": torch.ones(T, V, dtype=torch.bool)}, "log_prob_keep_mask given"),
    "per_row_temperature": ({"temperature": torch.full((T,), 0.7)}, "per-row temperature"),
    "temperature_zero": ({"temperature": 0.0}, "temperature <= 0"),
    "sharded_without_tp": ({"context.vocab_partition.padded_size": 200}, "no tensor_parallel_group"),
    "ids_past_real_vocab": ({"context.vocab_partition.real_size": 50}, "past the real vocab size 50"),
    "empty_rows": ({"context.hidden": torch.empty(0, H), "target_ids": torch.empty(0, dtype=torch.long)},
                   "invalid input"),
}


@pytest.mark.parametrize("case", sorted(UNSERVABLE))
def test_unservable_request_raises_the_forks_unavailable_signal(case):
    """The fork reads "unavailable" only from an exception carrying ``linear_logp_provider_unavailable``."""
    overrides, reason = UNSERVABLE[case]
    with pytest.raises(provider.LinearLogpProviderUnavailable, match=re.escape(reason)) as info:
        provider.provide(_request(**overrides))
    assert getattr(info.value, "linear_logp_provider_unavailable", False) is True


def test_result_carries_the_forks_fields(triton_strict):
    """A served request runs the public op through dispatch: here the kernels (strict, no fallback)."""
    request = _request()
    result = provider.provide(request)
    ctx = request.context
    assert result.logp.shape == (T, 1) and result.logp.dtype == torch.float32
    assert result.logp.device == request.logits.device and result.logp.grad_fn is not None
    assert result.entropy is None
    assert result.backend_id == provider.BACKEND_ID == kernels.backend_id()
    assert result.contract_id == provider.CONTRACT_ID
    assert result.provenance["op"] == "linear_logp" and result.provenance["request_metadata"] == {"store_prefix": "ref_"}
    want = reference_linear_logp(ctx.hidden, ctx.projection.weight, request.target_ids, ctx.projection.bias, 0.7)
    tolerances.assert_close(result.logp[:, 0], want, "linear_logp", torch.float32, name="provider logp")
    (grad_w,) = torch.autograd.grad(result.logp.sum(), [ctx.projection.weight])
    assert grad_w.abs().sum() > 0, "log-probs must be connected to the LM-head weight"


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("with_grad", [False, True])
def test_entropy_from_the_request_logits_over_the_temperature(with_grad, temperature):
    """The policy-loss pass asks ``with_entropy=True``: entropy [T] of softmax(logits / T) (the request's
    logits are the LM head's raw output; vime's native path divides them by the rollout temperature),
    with autograd exactly when ``with_entropy_grad``."""
    request = _request(with_entropy=True, with_entropy_grad=with_grad, temperature=temperature)
    result = provider.provide(request)
    log_p = torch.log_softmax(request.logits.detach().float() / temperature, dim=-1)
    want = -(log_p.exp() * log_p).sum(-1)
    assert result.entropy.shape == (T,)
    tolerances.assert_close(result.entropy.detach(), want, "linear_logp", torch.float32,
                            name=f"entropy at T={temperature}")
    assert result.entropy.requires_grad is with_grad
    if with_grad:
        weight = request.context.projection.weight
        (got,) = torch.autograd.grad(result.entropy.sum(), [weight])
        z = (request.context.hidden.detach() @ weight.t() + request.context.projection.bias.detach()) / temperature
        log_q = torch.log_softmax(z, dim=-1)
        (expected,) = torch.autograd.grad(-(log_q.exp() * log_q).sum(), [weight])
        tolerances.assert_close(got, expected, "linear_logp.grad", torch.float32,
                                name=f"d entropy / d weight at T={temperature}")


def test_temperature_none_is_no_temperature():
    request = _request(temperature=None)
    ctx = request.context
    want = reference_linear_logp(ctx.hidden, ctx.projection.weight, request.target_ids, ctx.projection.bias, 1.0)
    tolerances.assert_close(provider.provide(request).logp[:, 0], want, "linear_logp", torch.float32,
                            name="logp without temperature")
    scalar = provider.provide(_request(temperature=torch.tensor(0.7))).provenance["temperature"]
    assert scalar == pytest.approx(0.7)


def test_dotted_path_resolves_like_the_fork():
    """The fork splits ``pkg.module.callable`` at the last dot and imports the module."""
    module_name, _, attr = provider.DOTTED_PATH.rpartition(".")
    assert getattr(importlib.import_module(module_name), attr) is provider.provide

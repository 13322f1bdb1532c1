"""Our linear_logp provider through the RL-Align fork's own boundary, ``compute_linear_logp``.

The fork's Megatron backend builds a ``LinearLogpRequest`` (logits ``[T, V_local]``, target ids ``[T]``,
``tensor_parallel_group``, ``TokenLayout``, entropy flags, ``chunk_size``, a ``[T, V]``
``log_prob_keep_mask``, a ``LinearLogpContext`` with ``hidden``, ``LinearProjection`` and a
``VocabPartition(local_start, local_size, real_size, padded_size)``, temperature) and calls
``compute_linear_logp(args=args, request=request, native=...)``; the mode comes from
``args.linear_logp_provider_mode``. The result must carry ``logp [T, 1]``, ``entropy`` (``[T]`` exactly
when ``with_entropy``), ``backend_id``, ``contract_id`` and ``provenance``; "unavailable" is an exception
with ``linear_logp_provider_unavailable = True``. The native path is vime's
``calculate_log_probs_and_entropy`` (from ``--rlk-vime-root``).

These tests enter at ``compute_linear_logp``, the fork's boundary function, and build the request the
way the fork's contract describes it: the fork's ``loss.py`` that calls the provider (commit eeda543e)
is not in the stored copies of the fork this suite was built against, so the request its call site
builds (and its ``with_entropy`` choice per pass) is not read from code here. With a fork checkout that
has it, the call site is the place to enter.
"""

from __future__ import annotations

import importlib.util
from argparse import Namespace

import pytest
import torch

from kernels import tolerances
from suites.module.vime import conformance as cf

pytestmark = [pytest.mark.vime, pytest.mark.vime_fork]


@pytest.fixture
def fork(vime_fork_root):
    return cf.use_vime_root(vime_fork_root, cf.PROVIDER_MODULE)


@pytest.fixture
def native(vime_root):
    """vime's native log-prob (+ entropy) path, loaded from the upstream root's ppo_utils file."""
    path = vime_root / "vime" / "utils" / "ppo_utils.py"
    spec = importlib.util.spec_from_file_location("vime_native_ppo_utils", path)
    module = importlib.util.module_from_spec(spec)
    with cf.eager_torch_compile():
        spec.loader.exec_module(module)
    return module.calculate_log_probs_and_entropy


def _request(fork, *, with_entropy: bool, keep_mask: bool = False, seed: int = 0, temperature: float = 1.0,
             with_entropy_grad: bool = False):
    """The request the fork builds: ``logits`` are the LM head's raw output (the fork divides by the
    temperature only inside its native function), ``temperature`` the rollout temperature."""
    g = torch.Generator().manual_seed(seed)
    T, H, V, real = 6, 16, 40, 37
    hidden = torch.randn(T, H, generator=g).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_(True)
    logits = hidden @ weight.t()
    ids = torch.randint(0, real, (T,), generator=g)
    mask = None
    if keep_mask:
        mask = torch.rand(T, V, generator=g) > 0.3
        mask[torch.arange(T), ids] = True
    request = fork.LinearLogpRequest(
        logits=logits, target_ids=ids, tensor_parallel_group=None,
        token_layout=fork.TokenLayout(world_size=1, rank=0, layout="single"),
        with_entropy=with_entropy, with_entropy_grad=with_entropy_grad, chunk_size=-1, log_prob_keep_mask=mask,
        context=fork.LinearLogpContext(hidden=hidden, projection=fork.LinearProjection(weight=weight),
                                       vocab_partition=fork.VocabPartition(0, V, real, V)),
        temperature=temperature,
    )
    return request


def _native_at(native, temperature: float):
    """The fork's native function at a rollout temperature: the raw logits divided by it (where it is not
    1, as vime's ``get_responses`` does) into vime's ``calculate_log_probs_and_entropy``."""
    def fork_native(logits, *args, **kwargs):
        return native(logits.div(temperature) if temperature != 1.0 else logits, *args, **kwargs)
    return fork_native


def _args(mode: str) -> Namespace:
    return Namespace(linear_logp_provider=cf.OUR_PROVIDER, linear_logp_provider_mode=mode)


@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_logp_pass_returns_the_forks_result_contract(fork, native, mode):
    """The log-prob passes (old / ref, ``with_entropy=False``): our provider serves them."""
    request = _request(fork, with_entropy=False)
    logp, entropy = fork.compute_linear_logp(args=_args(mode), request=request, native=native)
    expected, _ = native(request.logits, request.target_ids, None, with_entropy=False, chunk_size=-1)
    assert entropy is None
    assert logp.shape == (request.logits.size(0), 1) and logp.requires_grad
    tolerances.assert_close(logp.detach(), expected.detach(), "linear_logp", torch.float32,
                            name=f"fork compute_linear_logp ({mode}) vs vime native")


@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_policy_loss_pass_with_entropy(fork, native, mode):
    """The policy-loss pass asks ``with_entropy=True``: serve entropy, or signal unavailable (auto falls back
    to vime's native path with equal numbers; strict raises the fork's RuntimeError)."""
    request = _request(fork, with_entropy=True)
    expected_logp, expected_entropy = native(request.logits, request.target_ids, None, with_entropy=True,
                                             with_entropy_grad=False, chunk_size=-1)
    if mode == "strict":
        try:
            logp, entropy = fork.compute_linear_logp(args=_args(mode), request=request, native=native)
        except RuntimeError as exc:
            assert "is unavailable" in str(exc), f"strict mode failed with something else than unavailable: {exc!r}"
            return
    else:
        logp, entropy = fork.compute_linear_logp(args=_args(mode), request=request, native=native)
    tolerances.assert_close(logp.detach(), expected_logp.detach(), "linear_logp", torch.float32, name="logp")
    tolerances.assert_close(entropy.detach(), expected_entropy.detach(), "linear_logp", torch.float32,
                            name="entropy")


def test_keep_mask_is_honoured(fork, native):
    """Top-p replay: ``log_prob_keep_mask [T, V]`` renormalizes over the kept tokens."""
    request = _request(fork, with_entropy=False, keep_mask=True)
    logp, _ = fork.compute_linear_logp(args=_args("auto"), request=request, native=native)
    expected, _ = native(request.logits, request.target_ids, None, with_entropy=False, chunk_size=-1,
                         log_prob_keep_mask=request.log_prob_keep_mask)
    tolerances.assert_close(logp.detach(), expected.detach(), "linear_logp", torch.float32,
                            name="logp with log_prob_keep_mask")


def test_unservable_request_signals_unavailable(fork, native, monkeypatch):
    """A request our provider cannot serve is the fork's explicit unavailable signal: auto falls back
    (same numbers as native), strict raises the fork's ``RuntimeError(... is unavailable ...)``."""
    request = _request(fork, with_entropy=False)
    request = fork.LinearLogpRequest(**{**request.__dict__, "temperature": None, "context": None})
    logp, _ = fork.compute_linear_logp(args=_args("auto"), request=request, native=native)
    expected, _ = native(request.logits, request.target_ids, None, with_entropy=False, chunk_size=-1)
    tolerances.assert_close(logp.detach(), expected.detach(), "linear_logp", torch.float32,
                            name="auto fallback logp")
    with pytest.raises(RuntimeError, match="is unavailable"):
        fork.compute_linear_logp(args=_args("strict"), request=request, native=native)


@pytest.fixture
def kernels_env(monkeypatch):
    """Our provider as a user runs it, whatever the caller's environment: the kernels on, no strict mode."""
    for name in ("VIME_RL_KERNEL_OPS", "VIME_RL_KERNEL_STRICT", "VIME_RL_KERNEL_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")


@pytest.mark.parametrize("mode", ["auto", "strict"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logp", "logp+entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_provider_equals_the_forks_native_at_every_temperature(fork, native, kernels_env, temperature,
                                                                 with_entropy, mode):
    """Through ``compute_linear_logp`` at a rollout temperature: our log-probs, entropy and their
    gradients (hidden states and LM-head weight) equal the fork's native result on the same request."""
    def run(provider: str | None):
        request = _request(fork, with_entropy=with_entropy, with_entropy_grad=with_entropy,
                           temperature=temperature)
        args = Namespace(linear_logp_provider=provider, linear_logp_provider_mode=mode)
        logp, entropy = fork.compute_linear_logp(args=args, request=request, native=_native_at(native, temperature))
        objective = logp.sum() + (entropy.sum() if with_entropy else 0.0)
        ctx = request.context
        grads = torch.autograd.grad(objective, [ctx.hidden, ctx.projection.weight])
        return logp.detach(), None if entropy is None else entropy.detach(), grads

    got_logp, got_entropy, got_grads = run(cf.OUR_PROVIDER)
    want_logp, want_entropy, want_grads = run(None)  # unconfigured: the fork's native path
    where = f"T={temperature}, {mode}"
    tolerances.assert_close(got_logp, want_logp, "linear_logp", torch.float32, name=f"logp ({where})")
    if with_entropy:
        tolerances.assert_close(got_entropy, want_entropy, "linear_logp", torch.float32, name=f"entropy ({where})")
    else:
        assert got_entropy is None and want_entropy is None
    for name, got, want in zip(("hidden", "weight"), got_grads, want_grads, strict=True):
        tolerances.assert_close(got, want, "linear_logp.grad", torch.float32, name=f"d objective / d {name} ({where})")


def test_provider_consulted_without_its_context_reads_as_a_fallback(fork, native, caplog):
    """What the fork does under ``--loss-type custom_loss``: its ``loss_function`` passes the provider's
    context only to policy_loss and sft_loss, so the request our custom loss's hand-off to vime's loss
    reaches the provider with carries none. The provider declines, the fork logs its unavailable WARNING,
    and the log parser counts that line as a kernel fallback: why the plan refuses the provider together
    with our custom loss (``test_vime_plans.py::test_the_forks_provider_with_our_custom_loss_is_refused``)."""
    from pytest_rlk.e2e.engines.vime.log import parse_vime_lines

    request = fork.LinearLogpRequest(**{**_request(fork, with_entropy=False).__dict__, "context": None})
    with caplog.at_level("WARNING", logger=fork.__name__):
        logp, _ = fork.compute_linear_logp(args=_args("auto"), request=request, native=native)
    expected, _ = native(request.logits, request.target_ids, None, with_entropy=False, chunk_size=-1)
    tolerances.assert_close(logp.detach(), expected.detach(), "linear_logp", torch.float32, name="native logp")
    lines = [f"[2026-11-20 03:12:10] loss.py:1 - {r.getMessage()}" for r in caplog.records if r.name == fork.__name__]
    assert len(parse_vime_lines(lines).fallback_lines) == 1, lines

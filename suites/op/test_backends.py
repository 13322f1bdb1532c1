"""The op tier over every backend: each op's cases run on each importable backend and are compared
with the fp32 reference (kernels.reference) under the tolerance table (kernels/tolerances.py).

Backends: ``rlk-triton`` (ours), ``liger`` (Liger-Kernel), ``rl_engine`` (RL-Kernel; importable, or
``RLK_RL_ENGINE_PATH=<checkout>``) and every backend of the entry-point group ``pytest_rlk.backends``;
with ``--rlk-backend NAME|pkg.module:factory`` (or ``VIME_RL_KERNEL_BACKEND``) only that one.
A backend that cannot be loaded is skipped with the reason (and how to provide it). A case the
backend's ``supports(op, **case)`` rejects is SKIPPED with that reason: it is never run with
different math. A disagreement fails with backend, op, output, shape, dtype, max error and the
worst element's index. Max errors (and, on a GPU, times) are recorded through ``rlk_metrics`` with
tags {backend, backend_version, op, dtype, case}; each case's baseline id contains the backend id
and version, so baselines are kept per backend. A table of all results goes to the run's
``files/backends-parity.txt`` (the rlk summary names it).

The harness (the backends chosen, one case on one backend, the table's rows): backend_matrix.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from rlk_op_cases import DEVICE, DTYPES, loss_inputs, loss_upstream_grad, make_ids, make_logits, summed_terms

from kernels.contracts import LossInputs
from kernels.reference import LossConfig, grpo_loss_from_logp
from kernels.reference.linear_logp import linear_logp as reference_linear_logp
from suites.op.backend_matrix import (
    LOADED,
    ROWS,
    CaseRun,
    backend_names,
    full_case,
    load_backend,
    reference_op,
    skip_unless_gpu,
    small_case,
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" in metafunc.fixturenames:
        names = backend_names(metafunc.config)
        metafunc.parametrize("backend_name", list(names.values()), ids=list(names))


# -- results table ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def backends_table(rlk_files):
    """The results as one table in the run's files (named in the rlk summary), not on the
    terminal in the middle of the progress dots."""
    yield
    if not ROWS:
        return
    lines = ["rlk backends: op parity vs the fp32 reference (max abs errors; GPU: median ms)"]
    unavailable: set[str] = set()
    for row in ROWS:
        if row.status.startswith("skip: backend "):  # not loadable: say it once, not per case
            if row.backend not in unavailable:
                unavailable.add(row.backend)
                lines.append(f"  {row.backend}: {row.status}")
            continue
        errs = " ".join(f"{k}={v:.2e}" for k, v in row.errors.items())
        when = f" {row.time_ms:.3f} ms" if row.time_ms is not None else ""
        lines.append(f"  {row.backend:<30} {row.op:<17} {row.case:<36} {row.status}{when} {errs}")
    for backend, _ in (loaded for loaded in LOADED.values() if loaded[0] is not None):
        lines.append(f"  {backend.id}/{backend.version}: {backend.capabilities.extra or 'no extra capability notes'}")
    rlk_files.path("backends-parity.txt", "backend parity table").write_text("\n".join(lines) + "\n")
    ROWS.clear()


# -- logp ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LogpCase:
    id: str
    dtype: str
    temperature: float
    grad: bool
    tokens: int = 16
    vocab: int = 1031  # prime: a partial last vocab tile
    full: bool = False


LOGP_CASES = [
    small_case(LogpCase(f"{dt}-t{t}-{'fwdbwd' if g else 'fwd'}", dt, t, g))
    for dt in DTYPES for t in (1.0, 0.7) for g in (False, True)
] + [
    small_case(LogpCase("fp32-t1.0-fwdbwd-V4099", "fp32", 1.0, True, tokens=8, vocab=4099)),
    full_case(LogpCase("full-bf16-T4096-V151936", "bf16", 1.0, True, tokens=4096, vocab=151936, full=True)),
    full_case(LogpCase("full-fp32-T4096-V151936", "fp32", 1.0, True, tokens=4096, vocab=151936, full=True)),
]


@pytest.mark.parametrize("case", LOGP_CASES)
def test_logp(backend_name, case: LogpCase, rlk_metrics):
    skip_unless_gpu(case.full)
    run = CaseRun(backend_name, "logp", case.id, rlk_metrics)
    dtype = DTYPES[case.dtype]
    logits = make_logits(case.tokens, case.vocab, dtype, seed=case.vocab)
    ids = make_ids(case.tokens, case.vocab, seed=case.vocab, ignore_every=5)
    impl = run.require_support(
        device=logits.device, dtype=dtype, shape=tuple(logits.shape), temperature=case.temperature,
        tp_world=1, requires_grad=case.grad,
    )
    upcast = logits.detach().to(torch.float32, copy=True).requires_grad_(case.grad)
    expected = reference_op("logp")(upcast, ids, case.temperature)
    leaf = logits.detach().clone().requires_grad_(case.grad)
    with torch.set_grad_enabled(case.grad):
        out = impl(leaf, ids, case.temperature)
    assert out.dtype == torch.float32 and out.shape == (case.tokens,), f"logp returned {out.dtype} {tuple(out.shape)}"
    run.compare("logp", out, expected, "logp", dtype)
    if case.grad:
        grad_out = torch.randn(case.tokens, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        out.backward(grad_out)
        expected.backward(grad_out)
        run.compare("dlogits", leaf.grad, upcast.grad, "logp.grad", dtype, upstream=grad_out)
        run.time(lambda: impl(leaf, ids, case.temperature).backward(grad_out))
    else:
        with torch.no_grad():
            run.time(lambda: impl(leaf, ids, case.temperature))
    run.finish()


# -- ratio_kl --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RatioKlCase:
    id: str
    kl_type: str
    use_unbiased_kl: bool = False
    tokens: int = 64
    full: bool = False


RATIO_KL_CASES = [small_case(RatioKlCase(k, k)) for k in ("k3", "low_var_kl", "k1", "k2")] + [
    small_case(RatioKlCase("low_var_kl-unbiased", "low_var_kl", True)),
    full_case(RatioKlCase("full-k3-T65536", "k3", tokens=65536, full=True)),
]


@pytest.mark.parametrize("case", RATIO_KL_CASES)
def test_ratio_kl(backend_name, case: RatioKlCase, rlk_metrics):
    skip_unless_gpu(case.full)
    run = CaseRun(backend_name, "ratio_kl", case.id, rlk_metrics)
    inputs = loss_inputs(case.tokens, 257, torch.float32, seed=case.tokens)
    from kernels.reference import selected_logprob

    logp = selected_logprob(inputs["logits"], inputs["target_ids"])
    old, ref, mask = inputs["old_logp"], inputs["ref_logp"], inputs["loss_mask"]
    impl = run.require_support(
        device=logp.device, dtype=torch.float32, shape=tuple(logp.shape), kl_type=case.kl_type,
        use_unbiased_kl=case.use_unbiased_kl, requires_grad=True,
    )
    kwargs = {"kl_type": case.kl_type, "use_unbiased_kl": case.use_unbiased_kl}
    leaf, ref_leaf = logp.detach().clone().requires_grad_(), logp.detach().clone().requires_grad_()
    ratio, kl = impl(leaf, old, ref, mask, **kwargs)
    ratio_ref, kl_ref = reference_op("ratio_kl")(ref_leaf, old, ref, mask, **kwargs)
    run.compare("ratio", ratio, ratio_ref, "ratio_kl", torch.float32)
    run.compare("kl", kl, kl_ref, "ratio_kl", torch.float32)
    gen = torch.Generator().manual_seed(5)
    g_ratio, g_kl = (torch.randn(case.tokens, generator=gen).to(DEVICE) for _ in range(2))
    torch.autograd.backward((ratio, kl), (g_ratio, g_kl))
    torch.autograd.backward((ratio_ref, kl_ref), (g_ratio, g_kl))
    run.compare("dlogp", leaf.grad, ref_leaf.grad, "ratio_kl.grad", torch.float32)
    run.time(lambda: torch.autograd.backward(impl(leaf, old, ref, mask, **kwargs), (g_ratio, g_kl)))
    run.finish()


# -- grpo_loss -------------------------------------------------------------------------------------

K3 = {"kl_loss_coef": 0.05, "kl_type": "k3"}


@dataclass(frozen=True)
class GrpoCase:
    id: str
    dtype: str
    config: LossConfig
    lengths: tuple[int, ...] = (10, 8, 6)
    temperature: float = 1.0
    vocab: int = 1031
    full: bool = False

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


GRPO_CASES = [
    small_case(GrpoCase("vime-default-3samples-fp32", "fp32", LossConfig())),
    small_case(GrpoCase("vime-default-3samples-bf16", "bf16", LossConfig())),
    small_case(GrpoCase("k3-symmetric-1sample-fp32", "fp32", LossConfig(**K3), lengths=(24,))),
    small_case(GrpoCase("k3-symmetric-1sample-bf16", "bf16", LossConfig(**K3), lengths=(24,))),
    small_case(GrpoCase("k3-symmetric-1sample-fp16", "fp16", LossConfig(**K3), lengths=(24,))),
    small_case(GrpoCase(
        "asym-k3-tis-unbiased-t0.8-fp32", "fp32",
        LossConfig(eps_clip=0.2, eps_clip_high=0.28, use_tis=True, use_unbiased_kl=True, **K3), temperature=0.8,
    )),
    small_case(GrpoCase("low_var_kl-coef-fp32", "fp32", LossConfig(kl_loss_coef=0.05))),
    small_case(GrpoCase("per_token_sum-k3-fp32", "fp32", LossConfig(reduction="per_token_sum", **K3))),
    small_case(GrpoCase("gspo-fp32", "fp32", LossConfig(gspo=True))),
    small_case(GrpoCase("dual-clip-fp32", "fp32", LossConfig(eps_clip_c=3.0))),
    full_case(GrpoCase("full-k3-1sample-bf16-T4096-V151936", "bf16", LossConfig(**K3), lengths=(4096,), vocab=151936, full=True)),
    full_case(GrpoCase("full-k3-1sample-fp32-T4096-V151936", "fp32", LossConfig(**K3), lengths=(4096,), vocab=151936, full=True)),
    full_case(GrpoCase("full-vime-default-16samples-bf16", "bf16", LossConfig(), lengths=(256,) * 16, vocab=151936, full=True)),
]


def _compare_loss(
    run: CaseRun, loss, metrics, expected_loss, expected_metrics, dtype: torch.dtype, terms: int | None
) -> None:
    assert loss.dim() == 0, f"loss must be 0-dim, got shape {tuple(loss.shape)}"
    unknown = set(metrics) - set(expected_metrics)
    assert not unknown, f"{run.backend.id} returned metrics outside the contract: {sorted(unknown)}"
    assert "pg_loss" in metrics, f"{run.backend.id} returned no pg_loss (got {sorted(metrics)})"
    run.compare("loss", loss, expected_loss, "grpo_loss", dtype, terms=terms)
    for name in sorted(metrics):
        run.compare(name, metrics[name], expected_metrics[name], "grpo_loss", dtype, terms=terms)


@pytest.mark.parametrize("case", GRPO_CASES)
def test_grpo_loss(backend_name, case: GrpoCase, rlk_metrics):
    skip_unless_gpu(case.full)
    run = CaseRun(backend_name, "grpo_loss", case.id, rlk_metrics)
    dtype = DTYPES[case.dtype]
    inputs = loss_inputs(case.tokens, case.vocab, dtype, seed=case.tokens, lengths=list(case.lengths))
    logits = inputs.pop("logits")
    ids = inputs.pop("target_ids")
    impl = run.require_support(
        device=logits.device, dtype=dtype, shape=tuple(logits.shape), temperature=case.temperature, tp_world=1,
        config=case.config, inplace_backward=False, requires_grad=True, num_samples=len(case.lengths),
    )
    kwargs = {**inputs, "config": case.config, "temperature": case.temperature}
    upcast = logits.detach().to(torch.float32, copy=True).requires_grad_()
    expected_loss, expected_metrics = reference_op("grpo_loss")(upcast, ids, **kwargs)
    leaf = logits.detach().clone().requires_grad_()
    loss, metrics = impl(leaf, ids, **kwargs)
    terms = summed_terms(case.config, inputs["loss_mask"])
    _compare_loss(run, loss, metrics, expected_loss, expected_metrics, dtype, terms)
    loss.backward()
    expected_loss.backward()
    upstream = loss_upstream_grad(upcast, ids, inputs, case.config, case.temperature)
    run.compare("dlogits", leaf.grad, upcast.grad, "grpo_loss.grad", dtype, upstream=upstream)
    run.time(lambda: impl(leaf, ids, **kwargs)[0].backward())
    run.finish()


# -- linear_logp -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearCase:
    id: str
    dtype: str
    bias: bool
    tokens: int = 16
    hidden: int = 64
    vocab: int = 1031
    config: LossConfig | None = None  # linear_grpo_loss only
    samples: int = 1
    full: bool = False


LINEAR_LOGP_CASES = [
    small_case(LinearCase("fp32", "fp32", False)),
    small_case(LinearCase("fp32-bias", "fp32", True)),
    small_case(LinearCase("bf16-bias", "bf16", True)),
    full_case(LinearCase("full-bf16-T4096-H4096-V151936", "bf16", False, tokens=4096, hidden=4096, vocab=151936, full=True)),
]


def _linear_inputs(case: LinearCase, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.vocab + case.hidden)
    hidden = torch.randn(case.tokens, case.hidden, generator=gen)
    weight = torch.randn(case.vocab, case.hidden, generator=gen) * (2.0 / case.hidden**0.5)
    bias = torch.randn(case.vocab, generator=gen) * 0.5 if case.bias else None
    ids = make_ids(case.tokens, case.vocab, seed=case.hidden)
    to = {"device": DEVICE, "dtype": dtype}
    return hidden.to(**to), weight.to(**to), None if bias is None else bias.to(**to), ids


def _leaves(*tensors: torch.Tensor | None, upcast: bool = False) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().to(torch.float32 if upcast else t.dtype, copy=True).requires_grad_() for t in tensors]


@pytest.mark.parametrize("case", LINEAR_LOGP_CASES)
def test_linear_logp(backend_name, case: LinearCase, rlk_metrics):
    skip_unless_gpu(case.full)
    run = CaseRun(backend_name, "linear_logp", case.id, rlk_metrics)
    dtype = DTYPES[case.dtype]
    hidden, weight, bias, ids = _linear_inputs(case, dtype)
    impl = run.require_support(
        device=hidden.device, dtype=dtype, shape=tuple(hidden.shape), temperature=1.0, tp_world=1, requires_grad=True,
    )
    h, w, b = _leaves(hidden, weight, bias)
    h_ref, w_ref, b_ref = _leaves(hidden, weight, bias, upcast=True)
    out = impl(h, w, ids, b)
    expected = reference_linear_logp(h_ref, w_ref, ids, b_ref)
    run.compare("logp", out, expected, "linear_logp", dtype)
    grad_out = torch.randn(case.tokens, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    out.backward(grad_out)
    expected.backward(grad_out)
    run.compare("dhidden", h.grad, h_ref.grad, "linear_logp.grad", dtype)
    run.compare("dweight", w.grad, w_ref.grad, "linear_logp.grad", dtype)
    if b is not None:
        run.compare("dbias", b.grad, b_ref.grad, "linear_logp.grad", dtype)
    run.time(lambda: impl(h, w, ids, b).backward(grad_out))
    run.finish()


# -- linear_grpo_loss (hidden x LM head -> vime's loss; served by Liger's fused linear GRPO) --------

LINEAR_GRPO_CASES = [
    small_case(LinearCase("k3-1sample-fp32", "fp32", True, tokens=24, config=LossConfig(**K3))),
    small_case(LinearCase("asym-tis-unbiased-1sample-fp32", "fp32", False, tokens=24,
                      config=LossConfig(eps_clip=0.2, eps_clip_high=0.28, use_tis=True, use_unbiased_kl=True, **K3))),
    small_case(LinearCase("k3-3samples-fp32", "fp32", False, tokens=24, config=LossConfig(**K3), samples=3)),
    small_case(LinearCase("k3-1sample-bf16", "bf16", False, tokens=24, config=LossConfig(**K3))),
]


@pytest.mark.parametrize("case", LINEAR_GRPO_CASES)
def test_linear_grpo_loss(backend_name, case: LinearCase, rlk_metrics):
    """Reference: vime's loss (grpo_loss_from_logp) of the fp32 reference linear_logp."""
    run = CaseRun(backend_name, "linear_grpo_loss", case.id, rlk_metrics)
    dtype = DTYPES[case.dtype]
    hidden, weight, bias, ids = _linear_inputs(case, dtype)
    lengths = [case.tokens] if case.samples == 1 else [10, 8, 6]
    impl = run.require_support(
        device=hidden.device, dtype=dtype, shape=tuple(hidden.shape), temperature=1.0, tp_world=1,
        config=case.config, requires_grad=True, num_samples=case.samples,
    )
    h_ref, w_ref, b_ref = _leaves(hidden, weight, bias, upcast=True)
    policy_logp = reference_linear_logp(h_ref, w_ref, ids, b_ref)
    # old/ref/rollout near the policy so ratios straddle the clip range
    gen = torch.Generator().manual_seed(11)
    noise = [torch.randn(case.tokens, generator=gen).to(DEVICE) for _ in range(4)]
    base = policy_logp.detach()
    kwargs = {
        "old_logp": base + 0.3 * noise[0], "ref_logp": base + 0.4 * noise[1],
        "rollout_logp": base + 0.5 * noise[2], "advantages": noise[3],
        "loss_mask": torch.rand(case.tokens, generator=gen).to(DEVICE) > 0.25,
        "lengths": torch.tensor(lengths, device=DEVICE), "config": case.config,
    }
    expected_loss, expected_metrics = grpo_loss_from_logp(policy_logp, LossInputs(**kwargs))
    h, w, b = _leaves(hidden, weight, bias)
    loss, metrics = impl(h, w, ids, b, **kwargs)
    terms = summed_terms(case.config, kwargs["loss_mask"])
    _compare_loss(run, loss, metrics, expected_loss, expected_metrics, dtype, terms)
    loss.backward()
    expected_loss.backward()
    run.compare("dhidden", h.grad, h_ref.grad, "linear_logp.grad", dtype)
    run.compare("dweight", w.grad, w_ref.grad, "linear_logp.grad", dtype)
    run.finish()


# -- the same switch drives kernels' own dispatch --------------------------------------------------

@pytest.mark.parametrize("adapter_name", ["liger", "rl_engine"])
def test_dispatch_routes_through_adapter(adapter_name, monkeypatch):
    """``VIME_RL_KERNEL_BACKEND=<adapter>``: kernels.grpo_loss runs on the adapter where it supports
    the case, and falls back (counted, with the adapter's reason) where it does not."""
    import kernels

    backend, why = load_backend(adapter_name)
    if backend is None:
        pytest.skip(why)
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_BACKEND", adapter_name)
    monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
    monkeypatch.delenv("VIME_RL_KERNEL_OPS", raising=False)
    kernels.reset_fallback_counts()
    assert kernels.backend_id() == f"{backend.id}/{backend.version}"
    inputs = loss_inputs(24, 257, torch.float32, seed=1, lengths=[24])
    logits, ids = inputs.pop("logits"), inputs.pop("target_ids")
    served = LossConfig(**K3)
    loss, _ = kernels.grpo_loss(logits, ids, **inputs, config=served)
    expected, _ = reference_op("grpo_loss")(logits, ids, **inputs, config=served)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-6)
    assert kernels.fallback_counts() == {}, kernels.fallback_reasons()
    unserved = LossConfig(kl_loss_coef=0.05, kl_type="low_var_kl")
    kernels.grpo_loss(logits, ids, **inputs, config=unserved)
    assert kernels.fallback_counts() == {"grpo_loss": 1}
    (reason,) = kernels.fallback_reasons()["grpo_loss"]
    assert "low_var_kl" in reason, reason
    kernels.reset_fallback_counts()

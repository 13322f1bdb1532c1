"""linear_logp at an LM head's shape (T = H = 4096, V = 151936) on a GPU: accuracy, workspace, and
speed beside its peers in one run.

Shape: bf16 hidden [4096, 4096] x LM head [151936, 4096] (Qwen-sized vocab), temperature 1, two
kinds of logits:
  ``random``  hidden ~ N(0, 1), W ~ N(0, (2/sqrt(H))^2): logits std ~2, flat softmax;
  ``peaked``  hidden ~ N(0, 0.5^2), W ~ N(0, 0.125^2): logits std ~4, a few tokens hold most of the
              probability, like a trained model's head (the case where rounding hurts most).
Ours at two workspace budgets (``workspace_bytes``): the default (256 MB, what a user gets: the
logits kept in the weight gradient's buffer, three matrix products in 8 chunks) and ``rlk_ws_logits``
= the bf16 logits' size (T * V * 2 B = 1.24 GB: 2 chunks); labelled variants with
``RLK_LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD=0`` (the weight gradient's buffer not used): ``rlk_budget_only``
at the default budget (only what 256 MB holds is kept: 3.85 products) and ``rlk_keep_all`` at 2% over
the logits' size (every column kept in the workspace, three products); ``rlk_bwd_triton_mm`` is the
default with our Triton dH/dW matmuls. ``cublas_mm`` is no implementation
but the context of a matrix-product-bound op: cuBLAS's own bf16 ``hidden @ weight.T`` ([T, V] bf16
out), timed in the same rounds, its rate (``cublas_mm_tflops``) beside ours (``<impl>_tflops``: the
op's products, 2*T*H*V flops each, per second). Peers timed in the same process: eager (bf16 matmul + fp32 log-softmax),
TRL's ``trl.kernels.ChunkedLogProbFunction`` (chunk 32768, TRL's own default), Cut Cross-Entropy's
``linear_cross_entropy(..., reduction="none")`` (= -logp, its default gradient filter), Liger's
chunked selective log-prob, and Liger's fused linear scaled cross-entropy where its Hopper path
imports (it needs ``nvidia-cutlass-dsl``). ``compiled_ops`` (a labelled variant): the public call
under ``torch.compile(fullgraph=True)`` (the ``torch.ops.rlk`` operators), in the rounds too. Times: ``pytest_rlk.timing.bench`` (CUDA events, L2
flushed, median); memory: ``peak_extra_memory`` (``<impl>_peak_extra_bytes`` beside each time; in
the accuracy test minus the gradients the call returns).

Speed is recorded, never asserted here: the goals (forward at least as fast as the
fastest peer's, forward+backward <= 26 ms at the default budget and <= 21 ms at the logits' size on
an H200) are read from the artifacts and gated by baselines. What gates is ``rlk_interleaved_ms``,
the median of ROUNDS rounds in which ours and the peers are timed round-robin: the clock of these
power-limited GPUs drifts by more than the 15% time band over a run, and a drift moves every
implementation of a round alike (one block of ours alone, ``rlk_ms``, is recorded, not gated). Asserted: logp within 1e-4 of the
fp32-upcast reference, or within twice the error of the tensor cores' own fp32-accumulated products
where those miss 1e-4 (peaked logits); gradients within 2e-2 (max |err| / max |ref|) of it cast to
bf16; the dH and dW relative errors (||err|| / ||ref||) no larger than eager bf16's; the measured
workspace within each budget.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import statistics
from collections.abc import Callable

import pytest
import torch
from rlk_bench import measure, record_limit
from rlk_compiled import COMPILED, measure_compiled

import kernels
from kernels import tolerances
from kernels.ops.linear_logp import (
    BWD_MATMUL_ENV,
    DEFAULT_WORKSPACE_BYTES,
    KEEP_IN_WEIGHT_GRAD_ENV,
    kept_vocab_columns,
)
from kernels.reference.linear_logp import fp32_logits
from pytest_rlk.timing import bench, peak_extra_memory

T, H, V = 4096, 4096, 151936
PRODUCT_FLOPS = 2 * T * H * V  # one [T, H] x [H, V] matrix product
LOGITS_BYTES = T * V * 2
BUDGETS = {"rlk": DEFAULT_WORKSPACE_BYTES, "rlk_ws_logits": LOGITS_BYTES, "rlk_keep_all": int(LOGITS_BYTES * 1.02)}
SHAPE_CASE = f"linear_logp-bf16-T{T}-H{H}-V{V}"
LOGITS = {"random": (1.0, 2.0 / H**0.5), "peaked": (0.5, 0.125)}  # (hidden std, weight std)

# the public API as a user calls it: VIME_RL_KERNEL=1, every other setting at its default
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("user_default")]

Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The H100/H200 run these products at their power limit, where the clock drifts over seconds: the
# same call measured +-7% apart within one run (docs/linear_logp.md). Besides each implementation's
# own measurement, every one is timed again in ROUNDS interleaved rounds; the median of the rounds
# (``<impl>_interleaved_ms``) is the figure to compare implementations by.
ROUNDS = 3
CUBLAS = "cublas_mm"  # cuBLAS's own [T, H] x [H, V] product, timed in the rounds as context


def _case(logits: str) -> str:
    return SHAPE_CASE if logits == "random" else f"{SHAPE_CASE}-peaked"


def _eager(hidden, weight, ids):
    logits = torch.nn.functional.linear(hidden, weight)
    return logits.float().log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)


def _trl() -> Impl | None:
    try:
        function = importlib.import_module("trl.kernels").ChunkedLogProbFunction
    except (ImportError, AttributeError):
        return None
    return lambda hidden, weight, ids: function.apply(hidden, weight, None, ids, 1.0, 32768, None, 1.0, ())[0]


def _liger() -> Impl | None:
    try:
        function = importlib.import_module("liger_kernel.chunked_loss.fused_linear_ppo")._ChunkedSelectiveLogProbFunction
    except (ImportError, AttributeError):
        return None
    return lambda hidden, weight, ids: function.apply(hidden, weight, ids, None, 1.0, 4096)


def _liger_flsce() -> Impl | None:
    """Liger's fused linear scaled cross-entropy; on Hopper only through its CuTe DSL path."""
    try:
        module = importlib.import_module("liger_kernel.ops.fused_linear_scaled_cross_entropy")
        module._resolve_implementation(torch.device("cuda"))  # raises ImportError without nvidia-cutlass-dsl
        function = module.LigerFusedLinearScaledCrossEntropyFunction
    except (ImportError, AttributeError):
        return None
    return lambda hidden, weight, ids: -function.apply(hidden, weight, ids, 1.0)


def _cce() -> Impl | None:
    try:
        function = importlib.import_module("cut_cross_entropy").linear_cross_entropy
    except (ImportError, AttributeError):
        return None
    return lambda hidden, weight, ids: -function(hidden, weight, ids, reduction="none")


def _ours(budget: int) -> Impl:
    """The public call a user makes (``VIME_RL_KERNEL=1``, dispatch and checks included); a budget
    other than the default is the op's ``workspace_bytes`` argument."""
    if budget == DEFAULT_WORKSPACE_BYTES:
        return kernels.linear_logp
    return functools.partial(kernels.linear_logp, workspace_bytes=budget)


# Our labelled variants' settings (the headline ``rlk`` and the budgets run with every setting at its default).
VARIANT_SETTINGS = {"rlk_bwd_triton_mm": {BWD_MATMUL_ENV: "triton"}, "rlk_budget_only": {KEEP_IN_WEIGHT_GRAD_ENV: "0"},
                    "rlk_keep_all": {KEEP_IN_WEIGHT_GRAD_ENV: "0"}}


def _select_variant(monkeypatch, name: str) -> None:
    """Our labelled variant's settings, every other one at its default."""
    for settings in VARIANT_SETTINGS.values():
        for env in settings:
            monkeypatch.delenv(env, raising=False)
    for env, value in VARIANT_SETTINGS.get(name, {}).items():
        monkeypatch.setenv(env, value)


PEERS = {"trl": _trl, "cce": _cce, "liger": _liger, "liger_flsce": _liger_flsce}


def _products(name: str, pass_name: str) -> float:
    """Matrix products (of PRODUCT_FLOPS each) our variant ``name`` runs: the forward's one, and in
    the backward dH, dW and the recompute of every column the forward did not keep."""
    if pass_name == "fwd":
        return 1.0
    budget = BUDGETS.get(name, DEFAULT_WORKSPACE_BYTES)
    in_weight_grad = VARIANT_SETTINGS.get(name, {}).get(KEEP_IN_WEIGHT_GRAD_ENV) != "0"
    kept = kept_vocab_columns(T, H, V, torch.bfloat16, budget, weight_grad=in_weight_grad)
    return 3.0 + (V - kept) / V


def _impls(pass_name: str) -> dict[str, Impl]:
    impls: dict[str, Impl] = {"rlk": _ours(DEFAULT_WORKSPACE_BYTES), "rlk_bwd_triton_mm": _ours(DEFAULT_WORKSPACE_BYTES)}
    if pass_name == "fwd+bwd":  # the budget decides only what a forward that a backward follows keeps
        impls["rlk_budget_only"] = _ours(DEFAULT_WORKSPACE_BYTES)
        impls.update({name: _ours(BUDGETS[name]) for name in ("rlk_ws_logits", "rlk_keep_all")})
    impls["eager"] = _eager
    for name, make in PEERS.items():
        impl = make()
        if impl is not None:
            impls[name] = impl
    return impls


@functools.cache
def _inputs(logits: str):
    hidden_std, weight_std = LOGITS[logits]
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(T, H, device="cuda", generator=gen) * hidden_std).to(torch.bfloat16)
    weight = (torch.randn(V, H, device="cuda", generator=gen) * weight_std).to(torch.bfloat16)
    ids = torch.randint(0, V, (T,), device="cuda", generator=gen)
    ids[:2] = torch.tensor([0, V - 1], device="cuda")
    upstream = torch.randn(T, device="cuda", generator=gen)
    return hidden.requires_grad_(), weight.requires_grad_(), ids, upstream


def _reference(hidden, weight, ids, upstream):
    """fp32-upcast reference logp, dH, dW (rows are independent: 1024 at a time), the logits' std,
    and the log-probs from the tensor cores' own fp32-accumulated products (cuBLAS, fp32 output, then
    an fp32 log-softmax): the most accurate any bf16 tensor-core product gives."""
    ref_logp = torch.empty(T, device="cuda")
    tc_logp = torch.empty(T, device="cuda")
    ref_dh = torch.empty(T, H, device="cuda")
    ref_dw = torch.zeros(V, H, device="cuda")
    w = weight.detach().float().requires_grad_()
    stds = []
    for start in range(0, T, 1024):
        rows = slice(start, start + 1024)
        h = hidden[rows].detach().float().requires_grad_()
        logits = fp32_logits(h, w)
        stds.append(logits.std().item())
        logp = logits.log_softmax(-1).gather(-1, ids[rows, None]).squeeze(-1)
        dh, dw = torch.autograd.grad(logp, (h, w), upstream[rows])
        ref_logp[rows], ref_dh[rows] = logp.detach(), dh
        ref_dw += dw
        del logits, dw
        tc = torch.mm(hidden[rows].detach(), weight.detach().t(), out_dtype=torch.float32)
        tc_logp[rows] = tc.log_softmax(-1).gather(-1, ids[rows, None]).squeeze(-1)
        del tc
    return ref_logp, tc_logp, ref_dh, ref_dw, sum(stds) / len(stds)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, fp32)."""
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("logits", list(LOGITS))
def test_linear_logp_accuracy_and_workspace_at_lm_head_shape(rlk_metrics, monkeypatch, logits):
    hidden, weight, ids, upstream = _inputs(logits)
    rlk_metrics.set_case(_case(logits) + "-accuracy")
    ref_logp, tc_logp, ref_dh, ref_dw, logits_std = _reference(hidden, weight, ids, upstream)
    rlk_metrics.record("logits_std", logits_std, direction="two_sided", space="ratio", gate=False)
    tc_err = (tc_logp - ref_logp).abs().max().item()
    rlk_metrics.record("tensor_core_logp_max_abs_err", tc_err, direction="lower_is_better", space="logprob", gate=False)
    # The tensor cores accumulate bf16 products in fp32 with their own rounding: ~5e-6 of |z| over
    # H = 4096 (1.3e-4 at the peaked case's lse ~ 20, above the 1e-4 tolerance). The logp check is
    # the tolerance, or, where the hardware's own products miss it, twice their error.
    logp_tol = tolerances.get("linear_logp", torch.bfloat16)
    logp_bound = max(logp_tol.atol, 2 * tc_err)
    eager_logp = _eager(hidden, weight, ids)
    eager_dh, eager_dw = torch.autograd.grad(eager_logp, (hidden, weight), upstream)
    eager_err = {"hidden": _rel_err(eager_dh, ref_dh), "weight": _rel_err(eager_dw, ref_dw)}
    rlk_metrics.record("eager_logp_max_abs_err", (eager_logp - ref_logp).abs().max().item(),
                       direction="lower_is_better", space="logprob", gate=False)
    del eager_logp, eager_dh, eager_dw
    returned = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size() + T * 4
    failed: dict[str, str] = {}
    grad_tol = tolerances.get("linear_logp.grad", torch.bfloat16)
    for variant, budget in BUDGETS.items():
        prefix = "" if variant == "rlk" else f"{variant}_"  # the default keeps the metric names it always had
        _select_variant(monkeypatch, variant)
        ours = _ours(budget)
        logp = ours(hidden, weight, ids)
        dh, dw = torch.autograd.grad(logp, (hidden, weight), upstream)
        checks = {"logp": tolerances.closeness(logp, ref_logp, dataclasses.replace(logp_tol, atol=logp_bound))}
        for name, got, want in (("hidden", dh, ref_dh), ("weight", dw, ref_dw)):
            want_cast = want.to(torch.bfloat16).float()
            checks[f"grad_{name}"] = tolerances.closeness(got, want_cast, grad_tol)
            rlk_metrics.record(f"{prefix}grad_{name}_rel_err", checks[f"grad_{name}"].max_abs_err / want_cast.abs().max().item(),
                               direction="lower_is_better", space="error", gate=False)
            rel = _rel_err(got, want)
            rlk_metrics.record(f"{prefix}grad_{name}_norm_rel_err", rel, direction="lower_is_better", space="error",
                               gate=False, tags={"eager_norm_rel_err": f"{eager_err[name]:.3e}"})
            if rel > eager_err[name]:
                failed[f"{variant} grad_{name}"] = f"relative error {rel:.3e} > eager bf16's {eager_err[name]:.3e}"
        rlk_metrics.record(f"{prefix}logp_max_abs_err", checks["logp"].max_abs_err, direction="lower_is_better",
                           space="logprob", gate=False)
        failed.update({f"{variant} {name}": c.describe() for name, c in checks.items() if not c.ok})
        del logp, dh, dw

        def step(ours=ours):
            out = ours(hidden, weight, ids)
            torch.autograd.grad(out, (hidden, weight), upstream)

        workspace = peak_extra_memory(step) - returned
        rlk_metrics.record(f"{prefix}workspace_mb", workspace / 1e6, unit="MB", direction="lower_is_better",
                           space="memory", tags={"budget_mb": f"{budget / 1e6:.0f}"})
        if workspace > budget:
            failed[f"{variant} workspace"] = f"{workspace / 1e6:.1f} MB > budget {budget / 1e6:.1f} MB"
    for name, err in eager_err.items():
        rlk_metrics.record(f"eager_grad_{name}_norm_rel_err", err, direction="lower_is_better", space="error", gate=False)
    assert not failed, (f"linear_logp, bf16, {logits} logits, vs the fp32-upcast reference (logp bound {logp_bound:.2e}: "
                        f"tolerance {logp_tol.atol:.0e}, tensor-core products {tc_err:.2e}) and eager bf16: {failed}")


# The speed at peaked logits is a labelled variant (-m bench_full): the op's work (three matrix
# products and a log-sum-exp per chunk) does not depend on the logits (the interleaved medians of
# both kinds agree within 2%: docs/gpu-runs.md rows 95, 98 and 115), and the nightly's serial phase
# spends 31 s on it; the accuracy test keeps both kinds of logits in the nightly.
SPEED_LOGITS = [pytest.param(name, marks=pytest.mark.bench_full) if name != "random" else name for name in LOGITS]


@pytest.mark.bench
@pytest.mark.parametrize("logits", SPEED_LOGITS)
@pytest.mark.parametrize("pass_name", ["fwd", "fwd+bwd"])
def test_linear_logp_speed_vs_peers(rlk_metrics, monkeypatch, pass_name, logits):
    """Times and peak extra memory of ours (each budget) and the peers, recorded through
    rlk_bench.measure for the roofline table; no timed asserts (speed goals are gated by baselines).

    HBM limit: forward reads hidden and weight once and writes T fp32 log-probs; forward+backward
    reads them twice and writes dhidden and dweight. The op is matmul-bound (2*T*H*V flops per
    matmul), so its fraction of the HBM limit is far below 1 by nature: it is recorded to compare
    implementations, not as a target."""
    hidden, weight, ids, upstream = _inputs(logits)
    rlk_metrics.set_case(f"{_case(logits)}-speed-{pass_name}")
    operands = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    bytes_moved = operands + T * 4 if pass_name == "fwd" else 3 * operands
    tags = {"op": "linear_logp", "pass": pass_name, "dtype": "bf16", "shape": f"{T}x{H}x{V}", "logits": logits}
    record_limit(rlk_metrics, bytes_moved, tags)
    impls = _impls(pass_name)
    measured: dict[str, float] = {}
    peak: dict[str, float] = {}
    fns: dict[str, Callable[[], object]] = {}
    kernels.reset_fallback_counts()
    for name, impl in impls.items():
        _select_variant(monkeypatch, name)

        def forward(impl=impl):
            with torch.no_grad():
                return impl(hidden, weight, ids)

        def forward_backward(impl=impl):
            torch.autograd.grad(impl(hidden, weight, ids), (hidden, weight), upstream)

        fns[name] = forward if pass_name == "fwd" else forward_backward
        # one block of each, with its peak memory; the time that gates is the interleaved median below
        measure(rlk_metrics, name, fns[name], bytes_moved, tags, gate_time=False)
        peak[name] = rlk_metrics.metrics[f"{name}_peak_extra_bytes"].value

    def compiled_ours(f):
        if pass_name == "fwd":
            with torch.no_grad():
                return f(hidden, weight, ids)
        return torch.autograd.grad(f(hidden, weight, ids), (hidden, weight), upstream)

    _select_variant(monkeypatch, "rlk")  # the compiled variant runs with every setting at its default
    measure_compiled(rlk_metrics, kernels.linear_logp, compiled_ours, bytes_moved, tags)
    peak[COMPILED] = rlk_metrics.metrics[f"{COMPILED}_peak_extra_bytes"].value
    # in the interleaved rounds too (the graphs measure_compiled compiled), beside the plain call
    compiled = torch.compile(kernels.linear_logp, fullgraph=True)
    fns[COMPILED] = lambda: compiled_ours(compiled)
    operands = (hidden.detach(), weight.detach())
    fns[CUBLAS] = lambda: torch.mm(operands[0], operands[1].t())  # cuBLAS's own product, bf16 out
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            _select_variant(monkeypatch, name)
            rounds[name].append(bench(fn, device="cuda").median_ms)
    for name, times in rounds.items():
        measured[name] = statistics.median(times)
        all_tags = {**tags, "impl": name, "rounds_ms": " ".join(f"{t:.3f}" for t in times)}
        rlk_metrics.record(f"{name}_interleaved_ms", measured[name], unit="ms", direction="lower_is_better",
                           space="time", gate=name == "rlk", tags=all_tags)
        products = 1.0 if name == CUBLAS else _products(name, pass_name) if name.startswith("rlk") else None
        if products is not None:  # the rate of the products in the op, against cuBLAS's own
            rlk_metrics.record(f"{name}_tflops", products * PRODUCT_FLOPS / measured[name] / 1e9, unit="TFLOP/s",
                               direction="higher_is_better", space="ratio", gate=False,
                               tags={**all_tags, "products": f"{products:.2f}"})

    assert kernels.fallback_counts() == {}, f"our kernels fell back while being timed: {kernels.fallback_counts()}"
    summary = ", ".join(f"{n}: {ms:.2f} ms" + (f" ({peak[n] / 1e9:.2f} GB)" if n in peak else "")
                        for n, ms in measured.items())
    cublas_rate = PRODUCT_FLOPS / measured[CUBLAS] / 1e9
    summary += f"; cuBLAS product {cublas_rate:.0f} TFLOP/s, ours {_products('rlk', pass_name) * PRODUCT_FLOPS / measured['rlk'] / 1e9:.0f}"
    missing = sorted(set(PEERS) - set(impls))
    print(f"\nlinear_logp {pass_name} {_case(logits)} on {torch.cuda.get_device_name()} (median of {ROUNDS} "
          f"interleaved rounds): {summary}; "
          f"not importable: {missing or 'none'}")
    assert {"rlk", "eager"} <= set(impls)
    bad = {name: ms for name, ms in measured.items() if not 0.0 < ms < float("inf")}
    assert not bad, f"non-positive or non-finite times: {bad}"

"""vime adapter (kernels/integrations/vime.py) against vime's documented loss contract.

Inputs are vime-shaped (an args namespace parsed from vime's flags, a packed THD micro-batch); the
expectation is ``kernels.reference.grpo_loss`` on the response rows sliced sample by sample. The
comparison with vime's own ``loss_function`` / ``policy_loss_function`` for every configuration is
the conformance suite's (suites/module/vime/, ``--rlk-vime-root``).
"""

from __future__ import annotations

import logging

import pytest
import torch

import kernels
from kernels import reference
from kernels.integrations import vime as adapter
from suites.module import vime_standin as standin
from suites.module.loss_cases import batch_to, expected_loss, make_case, run_adapter

LOSS_ATOL = 1e-5
GRAD_ATOL = 1e-6
FLAG_SETS = {
    "grpo-kl": ["--use-kl-loss", "--kl-loss-coef", "0.01"],
    "k3-tis-pertoken-asym": ["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--use-tis",
                             "--calculate-per-token-loss", "--eps-clip-high", "0.28"],
    "gspo-temp-unbiased-k2": ["--advantage-estimator", "gspo", "--rollout-temperature", "0.7", "--use-unbiased-kl",
                              "--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "k2"],
    "dualclip-nokl": ["--eps-clip-c", "3.0"],
}


@pytest.mark.parametrize("kernels_on", [False, True], ids=["reference", "kernels"])
@pytest.mark.parametrize("flags", list(FLAG_SETS), ids=list(FLAG_SETS))
def test_custom_loss_matches_vime_math(flags, kernels_on, kernels_arm, device, rlk_metrics):
    kernels_arm(kernels_on)
    args = standin.vime_args_standin(FLAG_SETS[flags])
    batch, logits = make_case(temperature=args.rollout_temperature)
    batch, logits = batch_to(batch, device), logits.to(device)
    loss, metrics, grad = run_adapter(args, batch, logits)

    leaf = logits.clone().requires_grad_(True)
    exp_loss, exp_metrics = expected_loss(args, batch, leaf)
    exp_loss.backward()

    for name in ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "train_rollout_logprob_abs_diff",
                 *(("kl_loss",) if args.use_kl_loss else ()), "rlk_fallback", *adapter.STAGE_METRICS):
        assert name in metrics, f"metric {name} missing from {sorted(metrics)}"
    assert args.use_kl_loss or "kl_loss" not in metrics, "kl_loss logged without --use-kl-loss (vime logs it only with)"
    for name, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, f"metric {name} is not a 0-dim tensor"
    expected_backend = "rlk-triton" if kernels_on else "reference"
    assert adapter.backend_from_metrics({f"train/{k}": v for k, v in metrics.items()}).startswith(expected_backend)
    assert float(metrics["rlk_fallback"]) == 0.0
    loss_err = abs(float(loss) - float(exp_loss.detach()))
    metric_err = max(abs(float(metrics.get(k, 0.0)) - float(exp_metrics[k])) for k in reference.METRIC_NAMES)
    grad_err = float((grad - leaf.grad).abs().max())
    cat = lambda key: torch.cat(batch[key]).float()  # noqa: E731
    lengths = torch.tensor(batch["response_lengths"], device=device)
    abs_diff = reference.reduce((cat("log_probs") - cat("rollout_log_probs")).abs(), cat("loss_masks"), lengths,
                                adapter.loss_config_from_args(args).reduction)
    assert float(metrics["train_rollout_logprob_abs_diff"]) == pytest.approx(float(abs_diff), abs=1e-7)
    for name, value, atol in (("loss_abs_err", loss_err, LOSS_ATOL), ("metric_max_abs_err", metric_err, LOSS_ATOL),
                              ("dlogits_max_abs_err", grad_err, GRAD_ATOL)):
        rlk_metrics.record(name, value, direction="lower_is_better", space="error",
                           band={"abs_floor": atol, "source": "suites/module/test_vime_adapter.py tolerance"})
    assert loss_err <= LOSS_ATOL, f"loss {float(loss)} vs reference {float(exp_loss)}"
    assert metric_err <= LOSS_ATOL, f"metrics {metrics} vs reference {exp_metrics}"
    assert grad_err <= GRAD_ATOL, f"dlogits max abs err {grad_err}"
    # The fused op on the same rows agrees with the adapter's three stages.
    rows, ids = standin.response_rows_standin(batch)
    fused_leaf = logits.clone().requires_grad_(True)
    config = adapter.loss_config_from_args(args)
    fused_loss, fused_metrics = kernels.grpo_loss(
        fused_leaf[rows], ids, old_logp=cat("log_probs"), ref_logp=cat("ref_log_probs") if args.use_kl_loss else None,
        advantages=cat("advantages"), loss_mask=cat("loss_masks"), lengths=lengths,
        config=config, temperature=args.rollout_temperature, rollout_logp=cat("rollout_log_probs"))
    fused_loss.backward()
    assert abs(float(fused_loss.detach()) - float(loss)) <= LOSS_ATOL
    assert max(abs(float(fused_metrics[k]) - float(metrics.get(k, 0.0))) for k in reference.METRIC_NAMES) <= LOSS_ATOL
    assert float((fused_leaf.grad - grad).abs().max()) <= GRAD_ATOL
    # Rows outside the response slices (prompt rows, each sample's last row) get no gradient.
    outside = torch.ones(logits.shape[0], dtype=torch.bool, device=device)
    outside[rows] = False
    assert float(grad[outside].abs().max()) == 0.0


def test_logits_with_leading_batch_dim_are_accepted(kernels_arm):
    kernels_arm(False)
    args = standin.vime_args_standin(FLAG_SETS["grpo-kl"])
    batch, logits = make_case()
    loss_2d, _, _ = run_adapter(args, batch, logits)
    loss_3d, _, _ = run_adapter(args, batch, logits[None])
    assert float(loss_2d) == float(loss_3d)


UNSUPPORTED = {
    "entropy": (["--entropy-coef", "0.01"], "entropy bonus"),
    "context-parallel": (["--context-parallel-size", "2"], "context parallel > 1"),
    "bshd": (["--qkv-format", "bshd"], "qkv format not thd"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED), ids=list(UNSUPPORTED))
def test_unsupported_setting_falls_back_to_native_loss(case, monkeypatch, caplog):
    flags, reason = UNSUPPORTED[case]
    args = standin.vime_args_standin(["--use-kl-loss", "--kl-loss-coef", "0.01", *flags])
    assert any(reason in r for r in adapter.unsupported_reasons(args))
    monkeypatch.setenv(adapter.NATIVE_LOSS_ENV, "suites.module.vime_standin:native_policy_loss_standin")
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
    adapter.reset_native_fallbacks()
    batch, logits = make_case()
    with caplog.at_level(logging.WARNING, logger=adapter.log.name):
        loss, metrics, _ = run_adapter(args, batch, logits)
    assert float(metrics["rlk_fallback"]) == float(adapter.call_weight(args, batch)) > 0.0
    assert sum(adapter.native_fallbacks().values()) == 1
    assert adapter.backend_from_metrics(metrics) == adapter.NATIVE_BACKEND_ID
    assert any(reason in rec.getMessage() and "falls back" in rec.getMessage() for rec in caplog.records)
    sosm = standin.sum_of_sample_mean_standin(batch["response_lengths"], batch["loss_masks"])
    native_loss, _ = standin.native_policy_loss_standin(args, batch, logits, sosm)
    assert float(loss) == pytest.approx(float(native_loss), abs=1e-6)


def test_kernels_off_hand_every_call_to_vimes_loss(monkeypatch, caplog):
    """The baseline arm: the same hook, the kernels off -> vime's own loss, not a fallback (no WARNING,
    rlk_fallback 0, backend vime-native), with the same telemetry keys as the kernels path."""
    monkeypatch.setenv(adapter.NATIVE_LOSS_ENV, "suites.module.vime_standin:native_policy_loss_standin")
    monkeypatch.setenv("VIME_RL_KERNEL", "0")
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    adapter.reset_native_fallbacks()
    args = standin.vime_args_standin(FLAG_SETS["grpo-kl"])
    batch, logits = make_case()
    with caplog.at_level(logging.WARNING, logger=adapter.log.name):
        loss, metrics, _ = run_adapter(args, batch, logits)
    sosm = standin.sum_of_sample_mean_standin(batch["response_lengths"], batch["loss_masks"])
    native_loss, _ = standin.native_policy_loss_standin(args, batch, logits, sosm)
    assert float(loss) == float(native_loss)
    assert float(metrics["rlk_fallback"]) == 0.0 and not adapter.native_fallbacks() and not caplog.records
    assert adapter.backend_from_metrics(metrics) == adapter.NATIVE_BACKEND_ID
    assert set(adapter.STAGE_METRICS) <= set(metrics)


def test_unsupported_setting_raises_under_strict(monkeypatch):
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
    args = standin.vime_args_standin(["--entropy-coef", "0.01"])
    batch, logits = make_case()
    with pytest.raises(kernels.KernelFallbackError, match="entropy bonus"):
        run_adapter(args, batch, logits)


def test_fallback_without_importable_native_loss_is_an_error(monkeypatch):
    monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
    monkeypatch.setenv(adapter.NATIVE_LOSS_ENV, "rlk_no_such_module_anywhere:policy_loss_function")
    args = standin.vime_args_standin(["--context-parallel-size", "2"])
    batch, logits = make_case()
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    with pytest.raises(RuntimeError, match="context parallel > 1.*not importable"):
        run_adapter(args, batch, logits)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.pop("response_lengths"), "response_lengths"),
        (lambda b: b.update(response_lengths=b["response_lengths"][:-1]), "disagree"),
        (lambda b: b.update(log_probs=b["log_probs"][:-1]), r"batch\['log_probs'\] has"),
        (lambda b: b.update(response_lengths=[b["total_lengths"][0]] + b["response_lengths"][1:]), "sample 0"),
        (lambda b: b.update(ref_log_probs=None), "ref_log_probs"),
    ],
    ids=["missing-key", "length-mismatch", "short-logprobs", "response-too-long", "kl-without-ref"],
)
def test_bad_batch_names_the_input(mutate, message, kernels_arm):
    kernels_arm(False)
    args = standin.vime_args_standin(FLAG_SETS["grpo-kl"])
    batch, logits = make_case()
    mutate(batch)
    with pytest.raises((ValueError, KeyError, TypeError), match=message):
        run_adapter(args, batch, logits)


def test_init_hook_decides_once_and_logs(monkeypatch, caplog):
    monkeypatch.setenv("VIME_RL_KERNEL", "1")
    monkeypatch.delenv("VIME_RL_KERNEL_STRICT", raising=False)
    adapter.reset_init_decision()
    try:
        with caplog.at_level(logging.INFO, logger=adapter.log.name):
            first = adapter.init_hook(standin.vime_args_standin(FLAG_SETS["grpo-kl"]))
            second = adapter.init_hook(standin.vime_args_standin(["--entropy-coef", "0.1"]))
        assert first is second and first.kernels_enabled and not first.reasons
        lines = [r.getMessage() for r in caplog.records if "rlk vime loss provider" in r.getMessage()]
        assert lines == [first.line()] and "active" in lines[0] and first.backend_id in lines[0]
        adapter.reset_init_decision()
        monkeypatch.setenv("VIME_RL_KERNEL_STRICT", "1")
        with pytest.raises(kernels.KernelFallbackError, match="context parallel"):
            adapter.init_hook(standin.vime_args_standin(["--context-parallel-size", "2"]))
    finally:
        adapter.reset_init_decision()


@pytest.mark.gpu
@pytest.mark.parametrize("flags", list(FLAG_SETS), ids=list(FLAG_SETS))
def test_a_kernels_call_never_waits_for_the_gpu(flags, kernels_arm):
    """policy_loss and its backward with the kernels on, vime's batch on the GPU, under
    ``torch.cuda.set_sync_debug_mode("error")``: nothing in the call or its backward waits for the
    device, so a micro-batch never drains the training loop's launch queue. The first call runs
    outside it (it compiles and registers the kernels); the timed stages read the device's clock."""
    kernels_arm(True)
    args = standin.vime_args_standin(FLAG_SETS[flags])
    batch, logits = make_case(temperature=args.rollout_temperature)
    batch, logits = batch_to(batch, "cuda"), logits.cuda()
    first_loss, first_metrics, first_grad = run_adapter(args, batch, logits)
    # vime's closure over the micro-batch, built before the call as vime builds it
    sosm = standin.sum_of_sample_mean_standin(batch["response_lengths"], batch["loss_masks"],
                                              args.calculate_per_token_loss)
    leaf = logits.clone().requires_grad_(True)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = adapter.policy_loss(args, batch, leaf, sosm)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    loss, grad = loss.detach(), leaf.grad
    assert torch.equal(loss, first_loss) and torch.equal(grad, first_grad)
    for name in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl"):
        assert torch.equal(metrics[name], first_metrics[name]), name
    assert 0.0 < float(metrics["rlk_logp_ms"]) < 1e3 and 0.0 < float(metrics["rlk_loss_ms"]) < 1e3
    assert all(metrics[name].device.type == "cuda" for name in metrics)

"""Our custom loss through vime's own ``loss_function`` against vime's native ``policy_loss_function``.

Both arms go through the same call site (vime's ``loss_function``: ``--loss-type policy_loss`` vs
``--loss-type custom_loss --custom-loss-function-path kernels.integrations.vime.policy_loss``), on the
same packed micro-batch and logits. For EVERY configuration the scaled loss and d loss / d logits must
equal vime's native ones (tolerances: kernels/tolerances.py ``grpo_loss`` / ``grpo_loss.grad``): either the
adapter implements the configuration exactly, or it hands the call to vime's own loss, loudly
(a WARNING) and counted (``rlk_fallback``). A different number is never acceptable.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import tolerances
from kernels.integrations import vime as adapter
from suites.module.vime import conformance as cf
from suites.module.vime import vime_files

pytestmark = pytest.mark.vime

# name -> (overrides of vime's loss arguments, packed_batch keyword arguments)
CONFIGURATIONS: dict[str, tuple[dict, dict]] = {
    "grpo-lowvarkl": ({}, {}),
    "k3-tis-pertoken": ({"kl_loss_type": "k3", "kl_loss_coef": 0.1, "use_tis": True,
                         "calculate_per_token_loss": True}, {}),
    "gspo-temp0.7-unbiased-k2": ({"advantage_estimator": "gspo", "rollout_temperature": 0.7,
                                  "use_unbiased_kl": True, "kl_loss_type": "k2", "kl_loss_coef": 0.05}, {}),
    "dual-clip-nokl": ({"eps_clip_c": 3.0, "use_kl_loss": False}, {}),
    "shared-rollout-id": ({}, {"rollout_ids": (0, 0, 1, 1)}),
    "get-mismatch-metrics": ({"get_mismatch_metrics": True}, {}),
    "use-rollout-logprobs": ({"use_rollout_logprobs": True}, {}),
    "icepop-tis": ({"use_tis": True, "custom_tis_function_path": "vime.backends.megatron_utils.loss.icepop_function"},
                   {}),
    "cispo": ({"advantage_estimator": "cispo", "eps_clip": 1.0}, {}),
    "reinforce": ({"pg_loss_type": "reinforce"}, {}),
    "opsm": ({"use_opsm": True, "opsm_delta": 1e-4}, {}),
    "entropy-bonus": ({"entropy_coef": 0.01}, {}),
}

# Keys vime's policy_loss_function logs for a configuration; both arms must log the same ones.
ADAPTER_ONLY_KEY_PREFIX = "rlk_"


def _run_both(vime_loss, name):
    overrides, batch_kwargs = CONFIGURATIONS[name]
    args = cf.vime_args(**overrides)
    case = cf.packed_batch(**batch_kwargs)
    native = cf.run_loss_function(vime_loss, args, case)
    ours = cf.run_loss_function(vime_loss, cf.our_custom_loss_args(args), case)
    return args, case, native, ours


@pytest.mark.parametrize("name", list(CONFIGURATIONS), ids=list(CONFIGURATIONS))
def test_custom_loss_equals_vime_native_loss(name, vime_loss, reference_arm, caplog):
    with caplog.at_level(logging.WARNING, logger=adapter.log.name):
        _, _, native, ours = _run_both(vime_loss, name)
    fell_back = ours.metrics.get("rlk_fallback", 0.0) > 0.0
    route = "fell back to vime's loss" if fell_back else "claims the configuration"
    tolerances.assert_close(ours.loss, native.loss, "grpo_loss", torch.float32,
                            name=f"{name}: scaled loss (adapter {route}; vime {float(native.loss):.6g}, "
                                 f"ours {float(ours.loss):.6g})")
    tolerances.assert_close(ours.grad, native.grad, "grpo_loss.grad", torch.float32,
                            name=f"{name}: d loss / d logits (adapter {route})")


@pytest.mark.parametrize("name", list(CONFIGURATIONS), ids=list(CONFIGURATIONS))
def test_custom_loss_logs_vime_metric_keys(name, vime_loss, reference_arm):
    _, _, native, ours = _run_both(vime_loss, name)
    ours_keys = {k for k in ours.metrics if not k.startswith(ADAPTER_ONLY_KEY_PREFIX)}
    missing = sorted(set(native.metrics) - ours_keys)
    extra = sorted(ours_keys - set(native.metrics))
    assert not missing and not extra, (
        f"{name}: custom loss logs train/* keys unlike vime's policy loss: missing {missing}, extra {extra}")
    for key in native.metrics:
        assert ours.metrics[key] == pytest.approx(native.metrics[key], abs=1e-5, rel=1e-5), (
            f"{name}: train/{key} vime {native.metrics[key]:.6g} vs ours {ours.metrics[key]:.6g}")


@pytest.mark.parametrize("name", list(CONFIGURATIONS), ids=list(CONFIGURATIONS))
def test_fallback_is_loud_and_counted(name, vime_loss, reference_arm, caplog):
    """A configuration the adapter hands to vime's loss logs ONE WARNING naming the reason (not one per
    call), is counted per call (``native_fallbacks``) and flagged in ``rlk_fallback``."""
    with caplog.at_level(logging.WARNING, logger=adapter.log.name):
        args, case, _, ours = _run_both(vime_loss, name)
        again = cf.run_loss_function(vime_loss, cf.our_custom_loss_args(args), case)
    reasons = adapter.unsupported_reasons(args)
    warned = [r.getMessage() for r in caplog.records if "falls back to vime's native loss" in r.getMessage()]
    flags = [run.metrics.get("rlk_fallback", 0.0) > 0.0 for run in (ours, again)]
    if reasons:
        assert flags == [True, True], f"{name}: unsupported ({reasons}) but rlk_fallback is not set on every call"
        assert len(warned) == 1 and all(r in warned[0] for r in reasons), (
            f"{name}: expected one WARNING naming {reasons}, got {warned}")
        assert adapter.native_fallbacks() == {"; ".join(reasons): 2}, adapter.native_fallbacks()
    else:
        assert flags == [False, False] and not warned and not adapter.native_fallbacks(), (
            f"{name}: the adapter claims the configuration but fell back (warnings {warned})")


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("name", ["grpo-lowvarkl", "entropy-bonus"], ids=["kernels-path", "fell-back"])
def test_per_call_metrics_survive_vime_reduction(name, per_token, vime_loss, vime_root, reference_arm):
    """vime's train_one_step hands every micro-batch's log dict to ``reduce_train_step_metrics``
    (observability/train_metric_utils.py, run here from the checkout's own text): the values are summed
    over micro-batches, all-reduced over the DP x CP group and divided by the step's global batch size
    (per-sample means) or by the summed token count (per-token loss). The adapter's per-call flag,
    backend marker and stage times must read as the per-call values after it."""
    import torch.distributed as dist

    reduce_train_step_metrics = vime_files.source_function(vime_root, cf.TRAIN_METRIC_UTILS_FILE,
                                                           "reduce_train_step_metrics", {"dist": dist, "torch": torch})
    overrides, _ = CONFIGURATIONS[name]
    args = cf.our_custom_loss_args(cf.vime_args(**overrides, calculate_per_token_loss=per_token))
    micro_batches = [cf.packed_batch(seed=s, response_lengths=lengths)
                     for s, lengths in ((1, (7, 9, 4, 6)), (2, (3, 12, 5, 8)))]
    global_batch = sum(len(c.batch["total_lengths"]) for c in micro_batches)
    logs = [cf.run_loss_function(vime_loss, args, case, num_microbatches=len(micro_batches),
                                 step_global_batch_size=global_batch).log for case in micro_batches]
    reported = reduce_train_step_metrics(logs, calculate_per_token_loss=per_token, step_global_batch_size=global_batch,
                                         cp_size=1, dp_with_cp_group=None)
    fell_back = bool(adapter.unsupported_reasons(args))
    backend_keys = [k for k in reported if k.startswith(adapter.BACKEND_METRIC_PREFIX)]
    assert reported["rlk_fallback"] == pytest.approx(float(fell_back)), (
        f"train/rlk_fallback reads {reported['rlk_fallback']} after vime's reduce_train_step_metrics over "
        f"{len(logs)} micro-batches (global batch {global_batch}); every call {'fell back' if fell_back else 'ran'}")
    assert len(backend_keys) == 1 and reported[backend_keys[0]] == pytest.approx(1.0), {k: reported[k] for k in backend_keys}
    assert set(adapter.STAGE_METRICS) <= set(reported)
    assert reported["rlk_loss_ms"] > 0.0


def test_native_loss_is_vimes(vime_loss):
    """The adapter's fallback target is the policy loss of the vime checkout under test."""
    native = adapter.load_native_loss()
    assert native is vime_loss.policy_loss_function

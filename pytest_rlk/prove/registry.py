"""The registry of injected faults ``rlk prove`` runs: which gate family each one tests, at which
sizes, against which real tests.

A gate family is what a gate checks (``FAMILIES``). A fault (``Fault``) is one of
``pytest_rlk.prove.faults.WRAPPERS`` at a nominal size (the one CI runs: it must be caught) and a
ladder of sizes (``rlk prove --graded``: the smallest caught is the gate's smallest detectable
effect). Its cases are real tests, per tier, run with the fault behind ``rlk-triton``
(``CASES``): the fastest CPU cases that exercise the faulty op, or, for the GPU families, the
benchmarks whose baselines gate times and memory.

Extension point: another tier (the e2e A/B) registers its faults with ``register(Fault(...))``
and its cases in ``CASES[(tier, op)]``; a fault whose arms run in other processes injects by
dotted path (``VIME_RL_KERNEL_BACKEND=pytest_rlk.prove.faults:make_backend``, ``RLK_FAULT``)
through ``Fault.env``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# family -> what its gates check (docs/baselines.md lists each one's smallest detectable effect)
FAMILIES: dict[str, str] = {
    "logp": "selected log-prob values (op: the tolerance table; module: the loss and metrics vs the reference)",
    "dlogits": "gradients to the logits (op: logp.grad, grpo_loss.grad; module: dlogits_max_abs_err)",
    "ratio_kl": "ratio and KL values (op: ratio_kl; module: kl_loss, ppo_kl through the loss)",
    "loss": "the GRPO loss value and its reduction (op: grpo_loss; module: loss_abs_err)",
    "loss_metrics": "the loss's reported metrics pg_clipfrac, ppo_kl, kl_loss (op; module: metric_max_abs_err)",
    "fallback": "fallbacks to the reference (strict mode, fallback counts == 0)",
    "time": "benchmark times against the platform's baselines (GPU only)",
    "memory": "peak extra memory against the platform's baselines (GPU only)",
}

# (tier, op) -> the tests that run a fault of that op: node ids, fastest first
CASES: dict[tuple[str, str], list[str]] = {
    ("op", "logp"): [
        "suites/op/test_backends.py::test_logp[rlk-triton-fp32-t1.0-fwdbwd]",
        "suites/op/test_backends.py::test_logp[rlk-triton-fp32-t0.7-fwdbwd]",
    ],
    ("op", "ratio_kl"): [
        "suites/op/test_backends.py::test_ratio_kl[rlk-triton-k3]",
        "suites/op/test_backends.py::test_ratio_kl[rlk-triton-low_var_kl-unbiased]",
    ],
    ("op", "grpo_loss"): [
        "suites/op/test_backends.py::test_grpo_loss[rlk-triton-vime-default-3samples-fp32]",
        "suites/op/test_backends.py::test_grpo_loss[rlk-triton-k3-symmetric-1sample-fp32]",
    ],
    **{("module", op): [
        "suites/module/test_vime_adapter.py::test_custom_loss_matches_vime_math[grpo-kl-kernels]",
        "suites/module/test_vime_adapter.py::test_custom_loss_matches_vime_math[k3-tis-pertoken-asym-kernels]",
    ] for op in ("logp", "ratio_kl", "grpo_loss")},
    ("op-gpu", "logp"): [
        "suites/op/bench_logp.py::test_bench_logp_forward[bf16-T4096-V32000]",
        "suites/op/bench_logp.py::test_bench_logp_forward_backward[bf16-T4096-V32000]",
    ],
}
# the pytest tier each case tier runs under
PYTEST_TIER = {"op": "op", "module": "module", "op-gpu": "op", "e2e": "e2e"}
# the backend the op tier's cases run (test_backends.py: --rlk-backend picks it)
OP_BACKEND_ARGS = ("--rlk-backend", "rlk-triton")


@dataclass(frozen=True)
class Fault:
    name: str  # a key of pytest_rlk.prove.faults.WRAPPERS
    op: str
    family: str
    what: str
    size: float  # the nominal size: caught, or `rlk prove` fails
    ladder: tuple[float, ...] = ()  # graded sizes, smallest first
    tiers: tuple[str, ...] = ("op", "module")
    needs_gpu: bool = False
    unit: str = ""
    env: dict[str, str] = field(default_factory=dict)  # extra environment of its runs

    def cases(self, tier: str) -> list[str]:
        return CASES.get((tier, self.op), [])


REGISTRY: dict[str, Fault] = {}


def register(fault: Fault) -> Fault:
    if fault.family not in FAMILIES:
        raise ValueError(f"fault {fault.name}: unknown family {fault.family!r} (FAMILIES: {', '.join(FAMILIES)})")
    if fault.name in REGISTRY:
        raise ValueError(f"fault {fault.name} is registered already")
    REGISTRY[fault.name] = fault
    return fault


DECADES = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)

register(Fault("logp_bias", "logp", "logp", "every log-prob too high by SIZE", 1e-3, DECADES))
register(Fault("logp_grad_scale_even", "logp", "dlogits",
               "the gradient of every other token times (1 + SIZE)", 1e-2, DECADES[1:] + (1e-1,)))
register(Fault("logp_grad_sign_even", "logp", "dlogits", "the gradient of every other token turned around "
               "(SIZE 1; 0 harmless)", 1.0, ()))
register(Fault("ratio_kl_bias", "ratio_kl", "ratio_kl", "every KL value too high by SIZE", 1e-3, DECADES))
register(Fault("grpo_loss_scale", "grpo_loss", "loss", "the loss times (1 + SIZE)", 1e-3, DECADES))
register(Fault("grpo_loss_wrong_reduction", "grpo_loss", "loss",
               "the other reduction (per-token sum <-> sum of sample means; SIZE 1, 0 harmless)", 1.0, ()))
register(Fault("grpo_metric_bias", "grpo_loss", "loss_metrics", "the reported ppo_kl too high by SIZE", 1e-3,
               DECADES))
register(Fault("grpo_loss_fallback", "grpo_loss", "fallback",
               "the backend declines grpo_loss: one fallback per call (SIZE 1, 0 harmless)", 1.0, (),
               tiers=("module",)))  # the op tier skips a case its backend declines, by design
register(Fault("logp_slowdown", "logp", "time", "SIZE extra calls of the kernel per call", 1.0, (0.25, 0.5, 1.0),
               tiers=("op-gpu",), needs_gpu=True, unit="calls"))
register(Fault("logp_extra_buffer", "logp", "memory", "an extra [T, V] fp32 buffer times SIZE held through the call",
               1.0, (0.1, 0.25, 0.5, 1.0), tiers=("op-gpu",), needs_gpu=True, unit="[T,V] fp32"))

"""A GRPO training step on real models, kernels on vs off from the same seed (see train_step.py).

Three arms train on one rollout batch from the same parameters: the fp32 reference, a control (the
reference with every log-prob one fp32 ulp off: suites/module/last_bit_backend.py) and the kernels.
At step 1 the kernels' loss and grad norm match the reference's within the case's tolerances; over
the later steps (loss, grad norm, and the parameters' gap as a fraction of the update) they stay
within ``CHAOS_FACTOR`` times the control's distance from the reference, or the case's tolerance
where that is larger (``divergence_problems``). A timing breakdown per module (forward, logp,
ratio_kl, loss, backward, optimizer, step) and, on a GPU, peak memory are recorded per arm with
tags ``{"module": ..., "arm": ...}``.

Every arm's first step is also held to the step-0 identities (``step0_problems``): the batch's old
and reference log-probs are the model's own at the start, so ``ppo_kl`` and ``kl_loss`` are 0 and
the PPO ratio is 1 within the logp and ratio/KL ops' tolerances (slime's step-0 check).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from pytest_rlk.bands import DEFAULT_BANDS
from pytest_rlk.extras import require_extra
from pytest_rlk.mismatch import identities

require_extra("transformers")  # tiny real models
require_extra("tokenizers")

from pytest_rlk.e2e.engines.task import make_prompts  # noqa: E402
from pytest_rlk.e2e.engines.tiny_models import train_tokenizer  # noqa: E402
from suites.module import last_bit_backend, tiny, train_step  # noqa: E402
from suites.module import vime_standin as standin  # noqa: E402

SEED = 1234
# the kernels arm may drift this many times as far from the reference as the one-ulp control arm
# (divergence_problems); both arms' distances are recorded in every run
CHAOS_FACTOR = 4.0
LOSS_FLAGS = ["--use-kl-loss", "--kl-loss-coef", "0.01", "--eps-clip-high", "0.28", "--use-tis"]


@dataclasses.dataclass(frozen=True)
class StepCase:
    kind: str
    vocab_size: int
    size: tiny.TinyModelSize
    dtype: torch.dtype
    n_prompts: int
    group_size: int
    response_len: int
    steps: int
    # Tolerances between the arms (kernels vs reference): at step 1 the bounds, later the floors
    # under the control arm's multiple. fp32 on CPU: the log-prob differs in the last bits only
    # (summation order), so the arms stay within float rounding over k steps.
    loss_atol: float
    grad_norm_rtol: float
    drift_rel_max: float  # ||p_kernels - p_ref|| / ||p_ref - p_init||
    # Whether the kernels arm's op stage times gate on a GPU: a tiny model's step is host time there
    # (launches of kernels that take microseconds), so even its device-clock spans hold the host's
    # launch gaps and move 20-50% between runs on the shared GPU hosts; recorded, not gated
    gates_times: bool = False
    # False: uniform random response ids instead of the model's samples (train_step.random_rollout)
    sampled_responses: bool = True


TINY_CASES = {
    "dense": StepCase("dense", tiny.TINY_VOCAB, tiny.TINY_SIZE, torch.float32, 4, 2, 12, 3, 1e-5, 1e-4, 1e-3),
    "moe": StepCase("moe", tiny.TINY_VOCAB, tiny.TINY_SIZE, torch.float32, 4, 2, 12, 3, 1e-5, 1e-4, 1e-3),
}
# bf16 weights on the GPU: a last-bit difference in a gradient can flip a bf16 rounding of a
# parameter, so later steps drift more than in fp32; the first step's loss is still fp32-close.
GPU_CASE = StepCase("dense", tiny.QWEN3_0P6B_VOCAB, tiny.QWEN3_0P6B_SIZE, torch.bfloat16, 2, 4, 256, 3,
                    2e-3, 2e-2, 5e-2, gates_times=True, sampled_responses=False)


def _prompts(n: int, vocab_size: int) -> list[torch.Tensor]:
    if vocab_size == tiny.TINY_VOCAB:
        tokenizer = train_tokenizer()
        return [torch.tensor(tokenizer(row["prompt"])["input_ids"]) for row in make_prompts(n, SEED)]
    gen = torch.Generator().manual_seed(SEED)  # large vocab: random prompt ids, 32 tokens each
    return [torch.randint(0, vocab_size, (32,), generator=gen) for _ in range(n)]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """How far one arm's run is from the reference arm's."""

    first_loss_abs: float  # step 1: both arms still at the same parameters
    first_grad_norm_rel: float
    loss_abs: float  # the largest over all steps
    grad_norm_rel: float
    drift_rel: float  # ||p_arm - p_ref|| / ||p_ref - p_init|| after the last step
    drift_max_abs: float


def divergence(arm: train_step.StepLog, ref: train_step.StepLog, model: torch.nn.Module,
               ref_model: torch.nn.Module, start: dict[str, torch.Tensor]) -> Divergence:
    loss = [abs(a - b) for a, b in zip(arm.loss, ref.loss)]
    gn = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(arm.grad_norm, ref.grad_norm)]
    drift_max, drift_rel = train_step.param_drift(model, ref_model, start)
    return Divergence(loss[0], gn[0], max(loss), max(gn), drift_rel, drift_max)


def divergence_problems(case: StepCase, kernels: Divergence, control: Divergence) -> list[str]:
    """What the kernels arm fails, each with its value, its bound and where the bound comes from.

    Step 1 (both arms at the same parameters) is held to the case's tolerances: there the arms
    differ by their arithmetic alone. Over the later steps, runs that differ only in last bits drift
    apart (AdamW moves a parameter with a near-zero gradient by about the learning rate whichever way
    its last bits point); the control arm measures how far on this model and batch, and the kernels
    arm may drift ``CHAOS_FACTOR`` times that, or the case's tolerance where that is larger."""
    problems = []
    for what, value, bound in (("step-1 loss abs diff", kernels.first_loss_abs, case.loss_atol),
                               ("step-1 grad norm rel diff", kernels.first_grad_norm_rel, case.grad_norm_rtol)):
        if not value <= bound:
            problems.append(f"{what} {value:.3g} > {bound:.3g} (the case's tolerance)")
    for what, value, control_value, floor in (
            ("loss abs diff (all steps)", kernels.loss_abs, control.loss_abs, case.loss_atol),
            ("grad norm rel diff (all steps)", kernels.grad_norm_rel, control.grad_norm_rel, case.grad_norm_rtol),
            ("parameter drift of the update", kernels.drift_rel, control.drift_rel, case.drift_rel_max)):
        bound = max(floor, CHAOS_FACTOR * control_value)
        if not value <= bound:
            problems.append(f"{what} {value:.3g} > {bound:.3g} (max of the case's tolerance {floor:.3g} and "
                            f"{CHAOS_FACTOR:g} x the one-ulp control arm's {control_value:.3g})")
    return problems


def step0_problems(arm: str, log: train_step.StepLog, n_samples: int) -> list[str]:
    """The step-0 identities on ``arm``'s first step, from the loss's logged metrics as vime logs them
    (each a sum over the samples of the sample's mean: divided by the sample count here): ``ppo_kl``,
    ``kl_loss`` and the ratio (``ois``, the mean of exp(-ppo_kl), logged with --use-tis)."""
    first = log.metrics[0]
    missing = [k for k in ("ppo_kl", "kl_loss", "ois") if k not in first]
    if missing:
        raise KeyError(f"{arm} arm: the loss logged no {missing} at step 1 (LOSS_FLAGS must keep --use-kl-loss "
                       "and --use-tis)")
    means = {k: first[k] / n_samples for k in ("ppo_kl", "kl_loss", "ois")}
    problems = identities.step0_problems(ppo_kl=means["ppo_kl"], kl_loss=means["kl_loss"], ratio=means["ois"],
                                         tolerance=identities.step0_tolerance("fp32"))
    return [f"{arm} arm: {p}" for p in problems]


# Stage times gate only for train_step.OP_STAGES, our ops' calls timed by the vime adapter on the
# device's own clock. The step's other stages (the model's forward and backward, the optimizer, the
# whole step) are host-synchronized wall times of an eager model, which follow the shared host's
# speed (between two H100 runs they moved by 29-74% in both arms, 61-74% in the reference arm, which
# runs no op of ours) and the arm's place in the run (the arm that runs second is 20-40% slower,
# whichever it is). They are recorded, never gated, and do not compare the arms.
# a stage's device-clock stamps bracket its launches, so a microseconds-long stage (ratio_kl) moves by
# launch spacing
OP_STAGE_BAND = DEFAULT_BANDS["launch_time"]


def times_gate(case: StepCase, device: torch.device, kernels_backend: bool | str, arm: str, stage: str) -> bool:
    """Whether an arm's stage time gates against the platform baseline: on a GPU only (shared CPU
    cores are noisy), in a run of our kernels (not a control backend), the kernels arm's alone (the
    reference arm's are the fp32 reference backend's, recorded beside them), only our ops' stages
    (``train_step.OP_STAGES``, device time) and only where the case's step keeps the GPU busy
    (``StepCase.gates_times``: otherwise the device clock's span holds the host's launch gaps)."""
    return (device.type == "cuda" and kernels_backend is True and case.gates_times and arm == "kernels"
            and stage in train_step.OP_STAGES)


def run_case(case: StepCase, device: torch.device, kernels_arm, rlk_metrics, progress,
             kernels_backend: bool | str = True) -> list[str]:
    """The three arms on one rollout batch: reference, control (the reference one ulp off) and
    kernels (``kernels_backend``); records the metrics; returns :func:`divergence_problems`."""
    rollout_kind = "sample a rollout" if case.sampled_responses else "draw a rollout of random ids"
    with progress.step(f"build the {case.kind} model (vocab {case.vocab_size}), {rollout_kind}"):
        base = tiny.build_model(case.kind, seed=SEED, vocab_size=case.vocab_size, size=case.size,
                                dtype=case.dtype, device=device)
        prompts = _prompts(case.n_prompts, case.vocab_size)
        if case.sampled_responses:
            rollout = train_step.sample_rollout(base, prompts, group_size=case.group_size,
                                                response_len=case.response_len, seed=SEED)
        else:
            rollout = train_step.random_rollout(prompts, group_size=case.group_size, response_len=case.response_len,
                                                vocab_size=case.vocab_size, seed=SEED)
        batch = train_step.vime_batch(base, rollout)
    args = standin.vime_args_standin(LOSS_FLAGS)
    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    logs, models = {}, {}
    for arm, backend in (("reference", False), ("control", last_bit_backend.DOTTED_PATH), ("kernels", kernels_backend)):
        kernels_arm(backend)
        models[arm] = copy.deepcopy(base)
        with progress.step(f"{arm} arm: {case.steps} training steps"):
            logs[arm] = train_step.train(models[arm], batch, args, steps=case.steps)
    ref, ker = logs["reference"], logs["kernels"]
    kernels = divergence(ker, ref, models["kernels"], models["reference"], start)
    control = divergence(logs["control"], ref, models["control"], models["reference"], start)
    rlk_metrics.set_seed("torch", SEED)

    tags = {"model": case.kind, "device": device.type}
    # Memory gates against the platform baseline on a GPU only (shared CPU cores are noisy), and only
    # in a run of our kernels' arm; stage times as times_gate says
    perf_gate = device.type == "cuda"
    ours = kernels_backend is True
    for arm, log in logs.items():
        rlk_metrics.record(f"{arm}_loss", log.loss, direction="two_sided", space="loss", tags={**tags, "arm": arm},
                           gate=False)
        rlk_metrics.record(f"{arm}_grad_norm", log.grad_norm, direction="two_sided", space="none",
                           tags={**tags, "arm": arm}, gate=False)
        if arm == "control":
            continue  # the reference's code paths: its times and memory are the reference arm's
        for module, values in log.times_ms.items():
            gated = times_gate(case, device, kernels_backend, arm, module)
            rlk_metrics.record(f"{arm}_{module}_ms", values, unit="ms", direction="lower_is_better", space="time",
                               tags={**tags, "module": module, "arm": arm}, gate=gated,
                               band=OP_STAGE_BAND if gated else None, window={"skip": 1, "agg": "median"})
        if log.peak_memory_mb is not None:
            rlk_metrics.record(f"{arm}_peak_extra_memory_mb", log.peak_memory_mb, unit="MiB", direction="lower_is_better",
                               space="memory", tags={**tags, "arm": arm}, gate=perf_gate and ours)
    # step 1 gates against the baseline with the case's tolerance (our kernels' arm only); the later
    # steps' divergence is chaotic (its value moves with any last bit), so it is asserted against the
    # control arm of the same run and recorded beside it, not gated
    rlk_metrics.record("first_step_loss_abs_diff", kernels.first_loss_abs, direction="lower_is_better",
                       space="error", tags=tags, gate=ours,
                       band={"abs_floor": case.loss_atol, "source": "StepCase tolerance"})
    rlk_metrics.record("first_step_grad_norm_rel_diff", kernels.first_grad_norm_rel, direction="lower_is_better",
                       space="error", tags=tags, gate=ours,
                       band={"abs_floor": case.grad_norm_rtol, "source": "StepCase tolerance"})
    n_samples = len(batch["response_lengths"])
    identity_problems = []
    for arm, log in logs.items():
        identity_problems += step0_problems(arm, log, n_samples)
        for name in ("ppo_kl", "kl_loss", "ois"):
            rlk_metrics.record(f"{arm}_step0_{name}", log.metrics[0][name] / n_samples,
                               direction="two_sided", space="ratio" if name == "ois" else "logprob",
                               tags={**tags, "arm": arm}, gate=False)
    for prefix, div in (("", kernels), ("control_", control)):
        for name, value in (("loss_max_abs_diff", div.loss_abs), ("grad_norm_max_rel_diff", div.grad_norm_rel),
                            ("param_drift_rel", div.drift_rel), ("param_max_abs_diff", div.drift_max_abs)):
            rlk_metrics.record(prefix + name, value, direction="lower_is_better", space="error", tags=tags, gate=False)

    (rlk_metrics.artifact_dir / "steps.json").write_text(json.dumps(
        {"case": {"kind": case.kind, "vocab_size": case.vocab_size, "size": dataclasses.asdict(case.size),
                  "dtype": str(case.dtype), "steps": case.steps, "device": device.type},
         "arms": {arm: dataclasses.asdict(log) for arm, log in logs.items()},
         "kernels_vs_reference": dataclasses.asdict(kernels), "control_vs_reference": dataclasses.asdict(control),
         "chaos_factor": CHAOS_FACTOR}, indent=1))

    assert ref.fallbacks == 0 and ker.fallbacks == 0 and logs["control"].fallbacks == 0
    assert len(set(ref.loss)) > 1, f"the loss did not move over {case.steps} steps: {ref.loss}"
    return identity_problems + divergence_problems(case, kernels, control)


@pytest.mark.tiny
@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.moe)])
def test_tiny_training_step_kernels_match_reference(kind, kernels_arm, device, rlk_metrics, rlk_progress):
    problems = run_case(TINY_CASES[kind], device, kernels_arm, rlk_metrics, rlk_progress)
    assert not problems, "; ".join(problems)


@pytest.mark.tiny
@pytest.mark.injected_fault("a kernels arm whose log-probs are 1e-3 too high")
@pytest.mark.parametrize(("wrong_backend", "turns_gradient"), [
    (last_bit_backend.WRONG_DOTTED_PATH, False),
    (last_bit_backend.WRONG_AT_EVEN_DOTTED_PATH, True),
], ids=["every-token", "even-tokens"])
def test_a_kernel_wrong_by_a_thousandth_of_a_log_prob_fails(wrong_backend, turns_gradient, kernels_arm, device,
                                                             rlk_metrics, rlk_progress):
    """The same three arms with a kernels arm whose log-probs are 1e-3 too high: rejected at step 1,
    where both arms start from the same parameters and differ by the kernel's error alone, and by
    the step-0 identities (its ppo_kl is the error itself, -1e-3 or -5e-4 against 1e-5).

    Every log-prob too high scales the policy gradient (each ratio times e**1e-3), which AdamW's
    normalized update absorbs: on one CPU its parameters drifted 5.8e-4, within the case's 1e-3. Too
    high at every other token turns the gradient as well (a drift of 1.0e-2 there), and where the
    control arm is quiet enough to leave the case's tolerance as the bound (fp32 on a CPU), the
    update's drift rejects it too."""
    case = TINY_CASES["dense"]
    problems = run_case(case, device, kernels_arm, rlk_metrics, rlk_progress, kernels_backend=wrong_backend)
    identity = [p for p in problems if "step-0 identity" in p]
    problems = [p for p in problems if p not in identity]
    assert identity and all(p.startswith("kernels arm: step-0 identity") for p in identity), identity
    assert any("ppo_kl == 0" in p for p in identity) and any("ratio == 1" in p for p in identity), identity
    assert any(p.startswith("step-1 grad norm") for p in problems), problems
    assert all("control arm" in p for p in problems if not p.startswith("step-1 ")), problems
    control_drift = rlk_metrics.metrics["control_param_drift_rel"].value
    if turns_gradient and CHAOS_FACTOR * control_drift <= case.drift_rel_max:
        assert any(p.startswith("parameter drift of the update") for p in problems), problems


def test_stage_times_gate_only_for_our_ops_in_the_kernels_arm_of_a_device_bound_case_on_a_gpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for stage in train_step.OP_STAGES:
        assert times_gate(GPU_CASE, cuda, True, "kernels", stage)
    for stage in ("forward", "backward", "optimizer", "step"):  # the eager model's host-synchronized times
        assert not times_gate(GPU_CASE, cuda, True, "kernels", stage)
    assert not times_gate(GPU_CASE, cuda, True, "reference", "logp")  # the fp32 reference backend's times
    assert not times_gate(GPU_CASE, cpu, True, "kernels", "logp")  # shared CPU cores
    assert not times_gate(GPU_CASE, cuda, last_bit_backend.WRONG_DOTTED_PATH, "kernels", "logp")  # not our kernels
    assert not times_gate(TINY_CASES["dense"], cuda, True, "kernels", "logp")  # a tiny step leaves the GPU idle


def test_a_rollout_of_random_ids_has_the_sampled_rollouts_layout():
    prompts = _prompts(GPU_CASE.n_prompts, 1000)
    rollout = train_step.random_rollout(prompts, group_size=4, response_len=16, vocab_size=1000, seed=SEED)
    again = train_step.random_rollout(prompts, group_size=4, response_len=16, vocab_size=1000, seed=SEED)
    assert len(rollout.prompts) == len(rollout.responses) == 8 and rollout.group_size == 4
    assert all(torch.equal(rollout.prompts[i], prompts[i // 4]) for i in range(8))  # grouped per prompt, in order
    assert all(r.shape == (16,) and 0 <= int(r.min()) and int(r.max()) < 1000 for r in rollout.responses)
    assert all(torch.equal(a, b) for a, b in zip(rollout.responses, again.responses))  # seeded
    assert torch.equal(rollout.rewards, torch.tensor([train_step.even_token_reward(r) for r in rollout.responses]))


def test_divergence_beyond_the_control_arms_multiple_fails():
    """Later steps: the bound is the larger of the case's floor and CHAOS_FACTOR x the control's."""
    case = TINY_CASES["dense"]
    control = Divergence(1e-7, 1e-7, 4e-3, 1e-3, 2e-3, 1e-3)
    within = Divergence(1e-7, 1e-7, CHAOS_FACTOR * 4e-3, 1e-3, CHAOS_FACTOR * 2e-3, 1e-3)
    assert divergence_problems(case, within, control) == []
    beyond = dataclasses.replace(within, drift_rel=1.01 * CHAOS_FACTOR * 2e-3)
    (problem,) = divergence_problems(case, beyond, control)
    assert problem.startswith("parameter drift of the update") and "one-ulp control arm's 0.002" in problem
    # a quiet control leaves the case's tolerances as the bounds
    quiet = Divergence(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert divergence_problems(case, Divergence(0.0, 0.0, case.loss_atol, 0.0, case.drift_rel_max, 0.0), quiet) == []
    assert len(divergence_problems(case, Divergence(0.0, 0.0, 2 * case.loss_atol, 0.0, 0.0, 0.0), quiet)) == 1
    # step 1 is held to the case's tolerance whatever the control did
    (first,) = divergence_problems(case, dataclasses.replace(within, first_grad_norm_rel=2 * case.grad_norm_rtol),
                                   control)
    assert first.startswith("step-1 grad norm rel diff")


@pytest.mark.gpu
@pytest.mark.gpu_mem(40)
@pytest.mark.exclusive_gpu  # gates our ops' device-clock stage times
def test_qwen3_0p6b_sized_training_step(kernels_arm, rlk_metrics, rlk_progress):
    """Qwen3-0.6B-sized random model, bf16 weights, fp32 logits [~2300, 151936]; baselines: h100."""
    problems = run_case(GPU_CASE, torch.device("cuda"), kernels_arm, rlk_metrics, rlk_progress)
    assert not problems, "; ".join(problems)

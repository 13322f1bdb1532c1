"""A vime-shaped GRPO training step on a real causal LM, timed per module (plain functions).

One rollout is sampled from the model itself; vime's per-rollout quantities follow: old log-probs
(the training model before the update), reference log-probs (the frozen initial model: equal to
old at the first rollout), rollout log-probs (the sampler's: the bf16 forward of the same model,
standing in for the inference engine's numerics), GRPO advantages per prompt group. Each step:
forward -> pack to vime's THD logits -> ``kernels.integrations.vime.policy_loss`` (log-prob,
ratio/KL, loss stages timed inside) -> backward -> grad-norm clip -> AdamW step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels import reference
from kernels.integrations import vime as adapter
from suites.module import vime_standin as standin
from suites.module.loss_cases import batch_to

# the stages the vime adapter times on the device's clock (its rlk_<stage>_ms), recorded per call
OP_STAGES = ("logp", "ratio_kl", "loss")
MODULES = ("forward", *OP_STAGES, "backward", "optimizer", "step")


@dataclasses.dataclass
class Rollout:
    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    rewards: torch.Tensor  # [B]
    group_size: int


@dataclasses.dataclass
class StepLog:
    loss: list[float] = dataclasses.field(default_factory=list)
    grad_norm: list[float] = dataclasses.field(default_factory=list)
    metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
    times_ms: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {m: [] for m in MODULES})
    peak_memory_mb: float | None = None  # GPU only: peak allocated above the resident memory at start
    fallbacks: float = 0.0


def even_token_reward(response: torch.Tensor) -> float:
    """A checkable toy reward: the fraction of even token ids in the response (varies within a group)."""
    return float((response % 2 == 0).float().mean())


@torch.no_grad()
def sample_rollout(model: torch.nn.Module, prompts: list[torch.Tensor], *, group_size: int, response_len: int,
                   seed: int) -> Rollout:
    """``group_size`` sampled responses of exactly ``response_len`` tokens per prompt (temperature 1,
    no top-k/top-p), with transformers' ``generate`` and its KV cache."""
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    # prompts of one length sample in one batched generate (no padding to model): a decode step of a
    # large model is host-bound, so one call per prompt multiplies the wall time
    batches = [prompts] if len({p.numel() for p in prompts}) == 1 else [[p] for p in prompts]
    all_prompts, responses = [], []
    for batch in batches:
        ids = torch.stack(batch).to(device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=response_len, min_new_tokens=response_len, num_return_sequences=group_size,
            pad_token_id=0)
        for index, row in enumerate(out):  # group_size rows per prompt, in the prompts' order
            prompt = batch[index // group_size]
            all_prompts.append(prompt.cpu())
            responses.append(row[prompt.numel():].cpu())
    rewards = torch.tensor([even_token_reward(r) for r in responses])
    return Rollout(all_prompts, responses, rewards, group_size)


def random_rollout(prompts: list[torch.Tensor], *, group_size: int, response_len: int, vocab_size: int,
                   seed: int) -> Rollout:
    """``group_size`` responses of ``response_len`` uniform random token ids per prompt, rewarded as
    sampled ones are. For a random-init model with a large vocabulary: its samples are close to
    uniform anyway (at Qwen3-0.6B's width and vocabulary the fresh logits have a std of 0.64 nat and
    the sampling distribution an entropy 0.2 nat below the uniform one's 11.93), and ``generate``
    of 256 tokens on a 28-layer model is about 25 s of host-bound decoding on the GPU, in a test
    that has the GPU to itself. The training step's old log-probs come from the model either way
    (``vime_batch``)."""
    gen = torch.Generator().manual_seed(seed)
    all_prompts = [p.cpu() for p in prompts for _ in range(group_size)]
    responses = [torch.randint(0, vocab_size, (response_len,), generator=gen) for _ in all_prompts]
    rewards = torch.tensor([even_token_reward(r) for r in responses])
    return Rollout(all_prompts, responses, rewards, group_size)


def packed_logits(model: torch.nn.Module, prompts: list[torch.Tensor], responses: list[torch.Tensor],
                  autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Forward a right-padded batch and pack each sample's valid rows: fp32 [T_total, V] (vime's THD)."""
    device = next(model.parameters()).device
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    lengths = [s.numel() for s in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :s.numel()] = s
        mask[i, :s.numel()] = 1
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    return torch.cat([logits[i, :n] for i, n in enumerate(lengths)]).float()


@torch.no_grad()
def response_logp(model: torch.nn.Module, rollout: Rollout, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference log-probs [R] of the rollout's response tokens under ``model``."""
    logits = packed_logits(model, rollout.prompts, rollout.responses, autocast_dtype)
    batch = standin.packed_batch_standin(rollout.prompts, rollout.responses, old_logp=[], advantages=[])
    rows, ids = standin.response_rows_standin(batch)
    return reference.selected_logprob(logits[rows.to(logits.device)], ids.to(logits.device))


def vime_batch(model: torch.nn.Module, rollout: Rollout) -> dict:
    """vime's packed micro-batch for ``rollout`` (old = ref = the model now; rollout = its bf16 forward)."""
    lens = [r.numel() for r in rollout.responses]
    old = response_logp(model, rollout).cpu()
    sampler = response_logp(model, rollout, autocast_dtype=torch.bfloat16).cpu()
    adv = reference.grpo_advantages(rollout.rewards, rollout.group_size)
    split = lambda x: list(torch.split(x, lens))  # noqa: E731
    return standin.packed_batch_standin(
        rollout.prompts, rollout.responses, old_logp=split(old), ref_logp=split(old.clone()),
        rollout_logp=split(sampler), advantages=[adv[i].expand(n).clone() for i, n in enumerate(lens)])


def synced_timer(device: torch.device, walls_ms: dict[str, float]) -> Callable[[str, Callable[[], Any]], Any]:
    """A ``timed(name, fn)`` for :func:`one_step`: ``fn``'s wall time in ms into ``walls_ms[name]``,
    the device synchronized at both ends (so that a stage's time holds its own GPU work)."""
    def timed(name: str, fn: Callable[[], Any]) -> Any:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        walls_ms[name] = (time.perf_counter() - start) * 1e3
        return out

    return timed


def one_step(model: torch.nn.Module, batch: dict, args, sum_of_sample_mean, optimizer: torch.optim.Optimizer,
             timed: Callable[[str, Callable[[], Any]], Any], *, max_grad_norm: float = 1.0):
    """One optimizer step on ``batch`` (on the model's device): forward, vime's loss through the
    adapter, backward, grad-norm clip and optimizer step, each stage run as ``timed(name, fn)``
    (names: forward, policy_loss, backward, optimizer). Returns (loss, the adapter's metrics, grad norm)."""
    logits = timed("forward", lambda: packed_logits(model, _prompts(batch), _responses(batch)))
    loss, metrics = timed("policy_loss", lambda: adapter.policy_loss(args, batch, logits, sum_of_sample_mean))
    timed("backward", loss.backward)

    def update() -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    return loss, metrics, timed("optimizer", update)


def adapter_stage_ms(args, batch: dict, metrics: dict) -> dict[str, float]:
    """The adapter's stage times of one call (``rlk_<stage>_ms``, every one in adapter.STAGE_METRICS)
    per call: the adapter logs each multiplied by the call's weight (vime's metric convention)."""
    weight = float(adapter.call_weight(args, batch))
    return {name: float(metrics[name]) / weight for name in adapter.STAGE_METRICS}


def train(model: torch.nn.Module, batch: dict, args, *, steps: int, lr: float = 1e-3,
          max_grad_norm: float = 1.0) -> StepLog:
    """``steps`` optimizer steps on one rollout batch (vime's several steps per rollout)."""
    device = next(model.parameters()).device
    batch = batch_to(batch, device)
    sosm = standin.sum_of_sample_mean_standin(batch["response_lengths"], batch["loss_masks"],
                                              args.calculate_per_token_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    log = StepLog()
    resident = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    walls: dict[str, float] = {}
    timed = synced_timer(device, walls)
    for _ in range(steps):
        loss, metrics, grad_norm = one_step(model, batch, args, sosm, optimizer, timed, max_grad_norm=max_grad_norm)
        log.loss.append(float(loss.detach()))
        log.grad_norm.append(float(grad_norm))
        log.metrics.append({k: float(v) for k, v in metrics.items()})
        log.fallbacks += float(metrics["rlk_fallback"])
        for name in ("forward", "backward", "optimizer"):
            log.times_ms[name].append(walls[name])
        log.times_ms["step"].append(sum(walls.values()))
        stage_ms = adapter_stage_ms(args, batch, metrics)
        for module in OP_STAGES:
            log.times_ms[module].append(stage_ms[f"rlk_{module}_ms"])
    if device.type == "cuda":
        # Above what was resident when training started (the models of both arms, the batch), so
        # the arms compare although the other arm's model is still alive.
        log.peak_memory_mb = (torch.cuda.max_memory_allocated(device) - resident) / 2**20
    return log


def _prompts(batch: dict) -> list[torch.Tensor]:
    return [t[: t.numel() - r] for t, r in zip(batch["unconcat_tokens"], batch["response_lengths"])]


def _responses(batch: dict) -> list[torch.Tensor]:
    return [t[t.numel() - r:] for t, r in zip(batch["unconcat_tokens"], batch["response_lengths"])]


def param_drift(a: torch.nn.Module, b: torch.nn.Module, start: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max |a - b| over all parameters, ||a - b|| / ||a - start||: the arms' gap relative to the update)."""
    gap_sq, upd_sq, gap_max = 0.0, 0.0, 0.0
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        diff = (pa.detach().float() - pb.detach().float())
        gap_max = max(gap_max, float(diff.abs().max()))
        gap_sq += float(diff.pow(2).sum())
        upd_sq += float((pa.detach().float() - start[name].to(pa.device).float()).pow(2).sum())
    return gap_max, (gap_sq ** 0.5) / max(upd_sq ** 0.5, 1e-30)

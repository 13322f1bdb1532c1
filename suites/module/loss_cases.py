"""Shared vime-shaped loss cases for the module tier: a packed micro-batch with logits, and the
expected loss from ``kernels.reference`` on the response rows sliced sample by sample."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.integrations import vime as adapter
from suites.module import vime_standin as standin

VOCAB = 96


def batch_to(batch: dict, device: torch.device | str) -> dict:
    """A copy of a packed batch with every tensor (and list of tensors) on ``device``."""
    def move(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return [t.to(device) for t in value]
        return value

    return {key: move(value) for key, value in batch.items()}


def make_case(seed: int = 0, vocab: int = VOCAB, temperature: float = 1.0):
    """A packed micro-batch of 4 samples with logits [T_total, vocab] and per-token inputs."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens, resp_lens = [3, 5, 2, 4], [6, 9, 4, 7]
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in prompt_lens]
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in resp_lens]
    total = sum(prompt_lens) + sum(resp_lens)
    logits = torch.randn(total, vocab, generator=gen) * 2.0
    rewards = torch.rand(len(resp_lens), generator=gen)
    adv = reference.grpo_advantages(rewards, group_size=2)
    # Old/ref/rollout log-probs near the current policy's, so ratios straddle the clip range.
    with torch.no_grad():
        rows, ids = standin.response_rows_standin(
            standin.packed_batch_standin(prompts, responses, old_logp=[], advantages=[]))
        cur = reference.selected_logprob(logits[rows], ids, temperature)
    old = cur + 0.15 * torch.randn(cur.shape, generator=gen)
    ref = cur + 0.3 * torch.randn(cur.shape, generator=gen)
    rollout = old + 0.02 * torch.randn(cur.shape, generator=gen)
    masks = [(torch.rand(n, generator=gen) > 0.2).float() for n in resp_lens]
    split = lambda x: list(torch.split(x, resp_lens))  # noqa: E731
    batch = standin.packed_batch_standin(
        prompts, responses, old_logp=split(old), advantages=[adv[i].expand(n).clone() for i, n in enumerate(resp_lens)],
        loss_masks=masks, ref_logp=split(ref), rollout_logp=split(rollout))
    return batch, logits


def expected_loss(args, batch, logits):
    """kernels.reference.grpo_loss on the vime-sliced response rows (independent of the adapter)."""
    rows, ids = standin.response_rows_standin(batch)
    cat = lambda key: torch.cat(batch[key]).float()  # noqa: E731
    config = adapter.loss_config_from_args(args)
    return reference.grpo_loss(
        logits[rows], ids, old_logp=cat("log_probs"), ref_logp=cat("ref_log_probs") if args.use_kl_loss else None,
        advantages=cat("advantages"), loss_mask=cat("loss_masks"), lengths=torch.tensor(batch["response_lengths"]),
        config=config, temperature=args.rollout_temperature, rollout_logp=cat("rollout_log_probs"),
    )


def run_adapter(args, batch, logits):
    """The adapter on a fresh leaf copy of ``logits``: (loss, metrics, dlogits)."""
    leaf = logits.clone().requires_grad_(True)
    sosm = standin.sum_of_sample_mean_standin(batch["response_lengths"], batch["loss_masks"],
                                              args.calculate_per_token_loss)
    loss, metrics = adapter.policy_loss(args, batch, leaf, sosm)
    loss.backward()
    return loss.detach(), metrics, leaf.grad

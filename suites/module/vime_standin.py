"""STAND-IN for vime (it cannot be installed here): its documented argument names, its packed
micro-batch, its ``sum_of_sample_mean`` closure and its native policy loss, built from the contract
in shared/docs/vime-facts.md ("Launching a run", "Hooks", "Training-side math").

Everything here is labelled ``*_standin``; nothing in it is vime's code. Tests that have a real vime
checkout (``--rlk-vime-root``) compare against vime's own functions instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from kernels import reference


def vime_arg_parser_standin() -> argparse.ArgumentParser:
    """The subset of vime's CLI flags the policy loss reads, with vime's spellings and defaults.

    Named in vime-facts.md: --loss-type, --custom-loss-function-path, --custom-megatron-init-path,
    --advantage-estimator, --eps-clip, --eps-clip-high, --use-kl-loss, --kl-loss-coef,
    --kl-loss-type, --use-unbiased-kl, --calculate-per-token-loss, --use-rollout-logprobs,
    --disable-grpo-std-normalization, --seed. Not spelled out there, assumed with Megatron's /
    slime's names (the test against a real checkout, ``--rlk-vime-root``, confirms them):
    --eps-clip-c (dual clip), --use-tis / --tis-clip / --tis-clip-low, --entropy-coef,
    --rollout-temperature, --tensor-model-parallel-size, --context-parallel-size, --qkv-format.
    """
    p = argparse.ArgumentParser(prog="vime-train-standin", add_help=False)
    p.add_argument("--loss-type", default="policy_loss")
    p.add_argument("--custom-loss-function-path", default=None)
    p.add_argument("--custom-megatron-init-path", default=None)
    p.add_argument("--advantage-estimator", default="grpo")
    p.add_argument("--eps-clip", type=float, default=0.2)
    p.add_argument("--eps-clip-high", type=float, default=None)
    p.add_argument("--eps-clip-c", type=float, default=None)
    p.add_argument("--use-kl-loss", action="store_true")
    p.add_argument("--kl-loss-coef", type=float, default=0.0)
    p.add_argument("--kl-loss-type", default="low_var_kl", choices=["low_var_kl", "k1", "k2", "k3"])
    p.add_argument("--use-unbiased-kl", action="store_true")
    p.add_argument("--use-tis", action="store_true")
    p.add_argument("--tis-clip", type=float, default=2.0)
    p.add_argument("--tis-clip-low", type=float, default=0.0)
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--calculate-per-token-loss", action="store_true")
    p.add_argument("--rollout-temperature", type=float, default=1.0)
    p.add_argument("--use-rollout-logprobs", action="store_true")
    p.add_argument("--disable-grpo-std-normalization", action="store_true")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--qkv-format", default="thd", choices=["thd", "bshd"])
    p.add_argument("--seed", type=int, default=1234)
    return p


def vime_args_standin(cli: Sequence[str] = ()) -> argparse.Namespace:
    """Parse vime-style flags (e.g. ``["--use-kl-loss", "--kl-loss-coef", "0.01"]``)."""
    args = vime_arg_parser_standin().parse_args(list(cli))
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    return args


def sum_of_sample_mean_standin(response_lengths: Sequence[int], loss_masks: Sequence[torch.Tensor],
                               calculate_per_token_loss: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """vime's reduction closure over one micro-batch: ``fn(x [R]) -> 0-dim``. Like vime's, it holds
    its tensors on the loss masks' device (vime's batch is on the GPU): a call copies nothing to the
    device, so it never waits for the GPU."""
    mask = torch.cat([m.reshape(-1) for m in loss_masks])
    lengths = torch.tensor(list(response_lengths), dtype=torch.int64).to(mask.device)

    def fn(x: torch.Tensor) -> torch.Tensor:
        m, n = (mask, lengths) if x.device == mask.device else (mask.to(x.device), lengths.to(x.device))
        if calculate_per_token_loss:
            return reference.per_token_sum(x, m)
        return reference.sum_of_sample_mean(x, m, n)

    return fn


def packed_batch_standin(
    prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], *, old_logp: Sequence[torch.Tensor],
    advantages: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor] | None = None,
    ref_logp: Sequence[torch.Tensor] | None = None, rollout_logp: Sequence[torch.Tensor] | None = None,
) -> dict:
    """vime's packed micro-batch: sample i = prompt_i + response_i, tokens concatenated (THD)."""
    unconcat = [torch.cat([p, r]).long() for p, r in zip(prompts, responses)]
    batch = {
        "tokens": torch.cat(unconcat),
        "unconcat_tokens": unconcat,
        "total_lengths": [int(t.numel()) for t in unconcat],
        "response_lengths": [int(r.numel()) for r in responses],
        "loss_masks": list(loss_masks) if loss_masks is not None else [torch.ones(r.numel()) for r in responses],
        "log_probs": list(old_logp),
        "advantages": list(advantages),
        "ref_log_probs": list(ref_logp) if ref_logp is not None else None,
        "rollout_log_probs": list(rollout_logp) if rollout_logp is not None else None,
    }
    return batch


def response_rows_standin(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index [R], target ids [R]) of the response tokens, computed sample by sample the way
    vime slices its logits (``logits[end - R - 1 : end - 1]`` against ``tokens[end - R : end]``)."""
    rows, ids, end = [], [], 0
    for tokens, total, resp in zip(batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"]):
        rows.append(torch.arange(end + total - resp - 1, end + total - 1))
        ids.append(tokens[total - resp:])
        end += total
    return torch.cat(rows), torch.cat(ids)


def native_policy_loss_standin(args: argparse.Namespace, batch: dict, logits: torch.Tensor,
                               sum_of_sample_mean: Callable) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """STAND-IN for vime's native ``policy_loss_function`` (what the adapter falls back to), with
    the entropy bonus vime applies: ``loss = pg_loss - entropy_coef * sum_of_sample_mean(H)``."""
    rows, ids = response_rows_standin(batch)
    z = logits.reshape(-1, logits.shape[-1])[rows].float() / float(args.rollout_temperature)
    cat = lambda key: torch.cat([t.reshape(-1) for t in batch[key]]).float()  # noqa: E731
    use_kl = args.use_kl_loss and batch.get("ref_log_probs") is not None
    config = reference.LossConfig(
        eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high, kl_type=args.kl_loss_type,
        kl_loss_coef=args.kl_loss_coef if use_kl else 0.0,
        reduction="per_token_sum" if args.calculate_per_token_loss else "sum_of_sample_mean",
    )
    loss, metrics = reference.grpo_loss(
        z, ids, old_logp=cat("log_probs"), ref_logp=cat("ref_log_probs") if use_kl else None,
        advantages=cat("advantages"), loss_mask=cat("loss_masks"),
        lengths=torch.tensor(batch["response_lengths"]), config=config,
    )
    log_p = torch.log_softmax(z, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    entropy_loss = sum_of_sample_mean(entropy)
    metrics = dict(metrics, entropy_loss=entropy_loss.detach())
    return loss - args.entropy_coef * entropy_loss, metrics

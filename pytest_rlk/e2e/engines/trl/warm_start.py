"""A short supervised warm start on the task before GRPO, so the A/B's policy learns inside the run.

Real RL starts from an SFT model. A random-init model starts near reward 0 on the repeat-word task
and barely moves in a short run, so a reward gate could not tell a learning regression from noise.
The warm start teaches the task only partly, with a habit GRPO must unlearn: each completion word
is the prompt's target with probability ``correct_fraction``, a distractor word (never rewarded)
with probability ``distractor_fraction``, and a uniformly drawn target word otherwise. The policy
starts near :meth:`WarmStart.start_reward` and GRPO has the distractors to drop (a strong, fast
signal: half the words score 0) and the conditional copy to sharpen.

Both arms run it identically (same seed, same data, plain PyTorch cross-entropy on the HF forward:
no op of ours runs here), which the weight digest after it checks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pytest_rlk.e2e.engines.task import DISTRACTOR_WORDS, PROMPT_VERB, TARGET_WORDS


@dataclass(frozen=True)
class WarmStart:
    """steps: optimizer steps (0: none); batch: sequences per step; words: completion length;
    correct_fraction / distractor_fraction: the chance that a completion word is the prompt's
    target / a distractor; lr: AdamW's."""

    steps: int
    batch: int = 64
    words: int = 6
    correct_fraction: float = 0.2
    distractor_fraction: float = 0.5
    lr: float = 3e-3

    def __post_init__(self) -> None:
        if not (0 <= self.correct_fraction and 0 <= self.distractor_fraction
                and self.correct_fraction + self.distractor_fraction <= 1):
            raise ValueError(f"warm start: correct_fraction ({self.correct_fraction}) and distractor_fraction "
                             f"({self.distractor_fraction}) must be >= 0 and sum to at most 1")

    def start_reward(self) -> float:
        """The reward the warm start's data has (the policy's start, once it has fit the data)."""
        uniform = 1 - self.correct_fraction - self.distractor_fraction
        return self.correct_fraction + uniform / len(TARGET_WORDS)


def warm_start_texts(plan: WarmStart, seed: int) -> list[tuple[str, str]]:
    """(prompt, completion) pairs of every step, seeded."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(plan.steps * plan.batch):
        target = rng.choice(TARGET_WORDS)
        words = []
        for _ in range(plan.words):
            draw = rng.random()
            if draw < plan.correct_fraction:
                words.append(target)
            elif draw < plan.correct_fraction + plan.distractor_fraction:
                words.append(rng.choice(DISTRACTOR_WORDS))
            else:
                words.append(rng.choice(TARGET_WORDS))
        pairs.append((f"{PROMPT_VERB} {target}", " ".join(words)))
    return pairs


def run_warm_start(model: torch.nn.Module, tokenizer, plan: WarmStart, seed: int) -> list[float]:
    """Fit ``model`` in place on the warm-start data; returns the loss of every step.

    The loss is the completion tokens' cross-entropy (the prompt's tokens are context only), in
    the model's own dtype under the same autocast-free forward GRPO's training uses."""
    if plan.steps <= 0:
        return []
    device = next(model.parameters()).device
    pairs = warm_start_texts(plan, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr)
    eos = tokenizer.eos_token_id
    losses = []
    model.train()
    for step in range(plan.steps):
        rows = pairs[step * plan.batch:(step + 1) * plan.batch]
        ids, labels = [], []
        for prompt, completion in rows:
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
            ids.append(p + c)
            labels.append([-100] * len(p) + c)
        width = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids], device=device)
        target = torch.tensor([y + [-100] * (width - len(y)) for y in labels], device=device)
        attention = (torch.arange(width, device=device)[None, :] < torch.tensor([len(x) for x in ids], device=device)[:, None])
        logits = model(input_ids=input_ids, attention_mask=attention.long()).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1),
                               ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    model.zero_grad(set_to_none=True)
    return losses

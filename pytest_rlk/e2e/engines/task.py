"""A synthetic task with a verifiable reward that a random-init tiny model learns in tens of steps.

Prompt: ``"repeat <w>"`` for a target word ``w`` drawn from ``TARGET_WORDS``. Reward: the fraction
of the completion's words equal to ``w`` (in [0, 1]; an empty completion scores 0). It is exact and
checkable from the text alone. A random-init model starts near ``1 / vocab`` per word; GRPO first
learns to emit target words at all, then the conditional copy, so ``raw_reward`` climbs within a few
tens of steps at a high learning rate. Distractor words widen the vocabulary so the start is low.
"""

from __future__ import annotations

import random

PROMPT_VERB = "repeat"
TARGET_WORDS = ("a", "b", "c", "d")
DISTRACTOR_WORDS = tuple(f"w{i}" for i in range(24))
# Every word the tokenizer knows (special tokens come from tiny_models).
TASK_WORDS = (PROMPT_VERB, *TARGET_WORDS, *DISTRACTOR_WORDS)


def make_prompts(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` prompts as dataset rows ``{"prompt": "repeat c", "target": "c"}``, seeded."""
    if n <= 0:
        raise ValueError(f"n (number of prompts) must be positive, got {n}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        target = rng.choice(TARGET_WORDS)
        rows.append({"prompt": f"{PROMPT_VERB} {target}", "target": target})
    return rows


def repeat_reward(completion: str, target: str) -> float:
    """Fraction of the completion's words equal to ``target``."""
    words = completion.split()
    if not words:
        return 0.0
    return sum(word == target for word in words) / len(words)


def repeat_reward_func(prompts: list, completions: list, target: list, **_: object) -> list[float]:
    """TRL reward-function signature: dataset columns (here ``target``) come as keyword lists."""
    return [repeat_reward(str(c), t) for c, t in zip(completions, target, strict=True)]

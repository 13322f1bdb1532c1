"""The token sequences every rung scores: prompts, sampled responses, masks, sampling parameters.

All rungs of one ladder score the SAME sequences. When the rollout engine runs (A5), they are its
samples (so every rung is measured on the tokens whose rollout log-probs A5 compares); otherwise
they are sampled once with transformers' ``generate`` from the fp32 model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pytest_rlk.drift.preconditions import Preconditions, masks_fingerprint, sequences_fingerprint

LOGPROB_SPACE = "processed"  # log-probs after temperature (vLLM's processed_logprobs; vime's rollout_log_probs)
LOGPROB_SPACES = {"processed_logprobs": "processed", "raw_logprobs": "raw"}  # vLLM's logprobs_mode -> ours


@dataclass(frozen=True)
class Sampling:
    """How the responses were sampled; the training side computes log-probs under the same
    temperature and can only reproduce top-p = 1 and top-k off (vime's training math)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 4  # responses per prompt
    max_tokens: int = 24  # every response has exactly this many tokens (EOS ignored)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling temperature {self.temperature}: must be > 0 (log-probs of greedy decoding are not defined)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p {self.top_p}: must be in (0, 1]")
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"sampling n={self.n}, max_tokens={self.max_tokens}: both must be >= 1")


@dataclass(frozen=True)
class RolloutRecord:
    """What the rollout engine reported about its own samples, taken from its output alone (never
    from the training side), so the A5 precondition check compares two independent accounts."""

    engine: str  # e.g. "vllm 0.32.0"
    model: str  # the model directory the engine loaded
    dtype: str
    temperature: float
    top_p: float
    top_k: int
    logprob_space: str
    token_ids: str  # fingerprint of the engine's (prompt ids, response ids), in order
    masks: str  # fingerprint of its response lengths with every token active

    def preconditions(self, checkpoint: str) -> Preconditions:
        return Preconditions(checkpoint=checkpoint, token_ids=self.token_ids, masks=self.masks,
                             temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                             logprob_space=self.logprob_space)


@dataclass
class TokenBatch:
    prompts: list[list[int]]  # one per sample (a prompt repeats over its group)
    responses: list[list[int]]
    sampling: Sampling
    source: str  # who sampled the responses, e.g. "vllm 0.32.0" or "hf-generate"
    mask: list[list[float]] = field(default_factory=list)  # loss mask per response token; default all 1
    rollout_logprobs: list[list[float]] | None = None  # the rollout engine's, when it sampled them
    rollout: RolloutRecord | None = None  # the engine's own account of those samples

    def __post_init__(self) -> None:
        if not self.responses:
            raise ValueError("token batch: no samples")
        if len(self.prompts) != len(self.responses):
            raise ValueError(f"token batch: {len(self.prompts)} prompts for {len(self.responses)} responses")
        for i, (p, r) in enumerate(zip(self.prompts, self.responses)):
            if not p or not r:
                raise ValueError(f"token batch: sample {i} has an empty {'prompt' if not p else 'response'}")
        if not self.mask:
            self.mask = [[1.0] * len(r) for r in self.responses]
        if [len(m) for m in self.mask] != self.lengths:
            raise ValueError("token batch: the mask's lengths differ from the responses'")
        if self.active_tokens == 0:
            raise ValueError("token batch: the mask leaves no active token")
        if self.rollout_logprobs is not None and [len(x) for x in self.rollout_logprobs] != self.lengths:
            raise ValueError("token batch: the rollout log-probs' lengths differ from the responses'")

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.responses]

    @property
    def active_tokens(self) -> int:
        return int(sum(sum(1 for v in m if v) for m in self.mask))

    def sequences(self) -> list[torch.Tensor]:
        return [torch.tensor(p + r, dtype=torch.long) for p, r in zip(self.prompts, self.responses)]

    def flat_response_ids(self) -> torch.Tensor:
        return torch.tensor([t for r in self.responses for t in r], dtype=torch.long)

    def flat_mask(self) -> torch.Tensor:
        return torch.tensor([v for m in self.mask for v in m], dtype=torch.float64)

    def token_meta(self) -> tuple[list[int], list[int]]:
        """(sample index, position within the response) of every response token, flat."""
        samples = [i for i, r in enumerate(self.responses) for _ in r]
        positions = [j for r in self.responses for j in range(len(r))]
        return samples, positions

    def check_vocab(self, vocab_size: int) -> None:
        for i, (p, r) in enumerate(zip(self.prompts, self.responses)):
            bad = [t for t in p + r if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token batch: sample {i} has ids {bad[:5]} outside the model's vocab [0, {vocab_size})")

    def to_dict(self) -> dict[str, object]:
        return {"prompts": self.prompts, "responses": self.responses, "sampling": dataclasses.asdict(self.sampling),
                "source": self.source, "mask": self.mask, "rollout_logprobs": self.rollout_logprobs,
                "rollout": dataclasses.asdict(self.rollout) if self.rollout else None}


def batch_from_rollout(rollout: dict, sampling: Sampling) -> TokenBatch:
    """The rollout engine's samples (``pytest_rlk.drift.rollout``'s output) as a token batch; the
    training side scores them under ``sampling``'s temperature."""
    samples = rollout["samples"]
    request = rollout["request"]
    prompts = [list(s["prompt_ids"]) for s in samples]
    responses = [list(s["response_ids"]) for s in samples]
    engine = f"vllm {rollout.get('vllm_version', '?')}"
    mode = rollout.get("logprobs_mode", "processed_logprobs")
    record = RolloutRecord(
        engine=engine, model=str(rollout["model"]), dtype=str(request.get("dtype", "bfloat16")),
        temperature=float(request["temperature"]), top_p=float(request.get("top_p", 1.0)),
        top_k=int(request.get("top_k", -1)), logprob_space=LOGPROB_SPACES.get(mode, mode),
        token_ids=sequences_fingerprint(prompts, responses),
        masks=masks_fingerprint([len(r) for r in responses], (1.0 for r in responses for _ in r)))
    return TokenBatch(prompts=prompts, responses=responses, sampling=sampling, source=engine,
                      rollout_logprobs=[list(map(float, s["response_logprobs"])) for s in samples], rollout=record)


@torch.no_grad()
def sample_with_hf(model: torch.nn.Module, prompts: list[list[int]], sampling: Sampling) -> TokenBatch:
    """``sampling.n`` responses of exactly ``sampling.max_tokens`` tokens per prompt with
    transformers' ``generate`` (seeded; EOS does not stop a response)."""
    device = next(model.parameters()).device
    torch.manual_seed(sampling.seed)  # generate draws from the global generators (CPU and CUDA)
    out_prompts, responses = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=sampling.temperature,
            top_k=max(0, sampling.top_k), top_p=sampling.top_p,
            max_new_tokens=sampling.max_tokens, min_new_tokens=sampling.max_tokens,
            num_return_sequences=sampling.n, pad_token_id=0)
        for row in out:
            out_prompts.append(list(prompt))
            responses.append(row[len(prompt):].tolist())
    return TokenBatch(prompts=out_prompts, responses=responses, sampling=sampling, source="hf-generate")

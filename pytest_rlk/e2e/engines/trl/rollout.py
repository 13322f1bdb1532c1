"""The TRL lane's rollout: transformers' KV-cache sampler with its own log-probs, recorded or replayed.

TRL's ``GRPOTrainer`` takes a ``rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids",
"logprobs"}``. :class:`SamplerRollout` is that function:

- **live** (``SamplerRollout(record_to=None, replay_from=None)``): the policy's own ``generate``
  (KV-cache decode in the training dtype, the trainer's generation config) samples each prompt's
  completion; the log-prob of each sampled token is read from the sampler's processed scores at
  generation time (``log_softmax(logits / T)`` of the decode step), as vLLM reports them. The
  training side recomputes the same tokens' log-probs with a full forward, so
  ``train_rollout_logprob_abs_diff`` measures decode against training forward plus precision, the
  quantity vime's metric exists for (~1e-3 in bf16).
- **record** (``record_to=PATH``): live, and every step's prompts, ids and log-probs appended to a
  JSON-lines file.
- **replay** (``replay_from=PATH``): each step returns the recorded step's completions instead of
  sampling, after checking that the trainer asks for the same prompts: both arms of the replay lane
  then train on identical samples, so their per-step losses and gradient norms differ by the
  kernels alone.

Completions end after the first EOS (kept), as TRL's own generation path cuts them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch



class RolloutReplayError(RuntimeError):
    """The recorded rollouts do not fit the run that replays them (names the step and the field)."""


class SamplerRollout:
    """TRL's ``rollout_func`` (see the module doc). ``calls`` counts the steps served."""

    def __init__(self, *, record_to: Path | None = None, replay_from: Path | None = None) -> None:
        if record_to is not None and replay_from is not None:
            raise ValueError("a rollout either records or replays, not both")
        self.record_to, self.replay_from = record_to, replay_from
        self.calls = 0
        self._recorded: list[dict[str, Any]] | None = None
        if record_to is not None:
            record_to.parent.mkdir(parents=True, exist_ok=True)
            record_to.write_text("")
        if replay_from is not None:
            self._recorded = read_rollouts(replay_from)

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        step = self.calls
        self.calls += 1
        if self._recorded is not None:
            return self._replay(step, prompts)
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        completion_ids, logprobs = sample_with_logprobs(trainer, prompt_ids)
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}
        if self.record_to is not None:
            with self.record_to.open("a") as f:
                f.write(json.dumps({"step": step, "prompts": [str(p) for p in prompts], **out}) + "\n")
        return out

    def _replay(self, step: int, prompts: list) -> dict[str, list]:
        assert self._recorded is not None
        if step >= len(self._recorded):
            raise RolloutReplayError(f"{self.replay_from}: {len(self._recorded)} recorded steps, step {step} asked")
        record = self._recorded[step]
        asked = [str(p) for p in prompts]
        if record["prompts"] != asked:
            first = next(i for i, (a, b) in enumerate(zip(record["prompts"], asked)) if a != b) \
                if len(asked) == len(record["prompts"]) else None
            where = f"first difference at sample {first}" if first is not None else \
                f"{len(record['prompts'])} recorded prompts, {len(asked)} asked"
            raise RolloutReplayError(f"{self.replay_from}: step {step}: the trainer asks for other prompts than "
                                     f"were recorded ({where}): the arms' data order differs")
        return {key: record[key] for key in ("prompt_ids", "completion_ids", "logprobs")}


def read_rollouts(path: Path) -> list[dict[str, Any]]:
    """The recorded steps of ``path`` (a ``rollouts.jsonl``), checked line by line."""
    if not path.is_file():
        raise RolloutReplayError(f"{path}: no recorded rollouts (the replay lane's baseline arm records them)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RolloutReplayError(f"{path}:{number}: not JSON ({exc})") from None
        missing = [k for k in ("step", "prompts", "prompt_ids", "completion_ids", "logprobs") if k not in record]
        if missing or record["step"] != number - 1:
            raise RolloutReplayError(f"{path}:{number}: a recorded step needs step={number - 1} and the fields "
                                     f"prompts, prompt_ids, completion_ids, logprobs (missing {missing})")
        if [len(c) for c in record["completion_ids"]] != [len(lp) for lp in record["logprobs"]]:
            raise RolloutReplayError(f"{path}:{number}: completion_ids and logprobs lengths differ")
        records.append(record)
    return records


@torch.no_grad()
def sample_with_logprobs(trainer: Any, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one completion per prompt with the trainer's model and generation config; return the
    completions (cut after the first EOS) and each sampled token's log-prob under the sampler's
    processed distribution at that decode step.

    The model is unwrapped for generation the way TRL's own generation path does it (gradient
    checkpointing off, KV cache on: with checkpointing on, transformers drops the cache and each
    decode step would see only its last token)."""
    from trl.models import unwrap_model_for_generation

    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     generation_kwargs=trainer.generation_kwargs,
                                     gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model:
        return _sample(model, trainer, prompt_ids)


def _sample(model: Any, trainer: Any, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    device = next(model.parameters()).device
    pad = trainer.processing_class.pad_token_id
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in prompt_ids], device=device)
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=device)
    config = copy.deepcopy(trainer.generation_config)
    config.output_scores = config.return_dict_in_generate = True
    out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
    tokens = out.sequences[:, width:]
    # scores: one [B, V] per decode step, after the logits processors (temperature, top-k/p)
    scores = torch.stack(out.scores, dim=1).float()
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    eos = set(trainer.eos_token_ids)
    completion_ids, completion_logprobs = [], []
    for row_tokens, row_logprobs in zip(tokens.tolist(), logprobs.tolist(), strict=True):
        end = len(row_tokens)
        for i, token in enumerate(row_tokens):
            if token in eos:
                end = i + 1
                break
        completion_ids.append(row_tokens[:end])
        completion_logprobs.append(row_logprobs[:end])
    return completion_ids, completion_logprobs

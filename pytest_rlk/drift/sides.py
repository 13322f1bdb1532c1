"""The sides of a comparison: the training forward under one :class:`SideConfig`, or the rollout.

The training forward is transformers' own model: the decoder body gives the final hidden states,
the LM head gives the logits (checked once per weight dtype to equal the model's own
``forward(...).logits`` bitwise, so the split changes nothing), and the response rows go to the
side's arithmetic. Sides are computed once and cached; the A0 comparison asks for a second,
independent replica of the same side.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pytest_rlk.drift import tp
from pytest_rlk.drift.arith import SideUnavailable, logp_from_hidden, logp_from_logits
from pytest_rlk.drift.batch import LOGPROB_SPACE, TokenBatch
from pytest_rlk.drift.preconditions import (
    Preconditions,
    checkpoint_fingerprint,
    digest,
    masks_fingerprint,
    sequences_fingerprint,
)
from pytest_rlk.drift.rungs import LadderError, SideConfig

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16-logits": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOGITS_CAST = {"bf16-logits": torch.bfloat16}
PAD_EXTRA = 16  # the pad16 layout's extra right padding
# The training math divides by the temperature and nothing else: top-p / top-k processed log-probs
# cannot be reproduced, so a rollout sampled with them is refused, not compared.
TRAINING_TOP_P, TRAINING_TOP_K = 1.0, -1


@dataclass
class SideResult:
    config: SideConfig
    logp: torch.Tensor  # fp32 [R] on CPU, over the flat response tokens
    preconditions: Preconditions
    layout: dict[str, object]  # how the batch was laid out (its fingerprint goes into the diagnostics)
    implementation: str  # what computed the log-probs, e.g. "rlk-triton/0.1.0", "vllm 0.32.0"
    seconds: float

    @property
    def layout_fingerprint(self) -> str:
        return digest(json.dumps(self.layout, sort_keys=True))[:12]


def rollout_side(batch: TokenBatch) -> SideResult:
    """The rollout engine's own log-probs (A5's reference side), with the preconditions the engine
    reported: the checkpoint it loaded, its token ids, its sampling parameters."""
    record = batch.rollout
    if batch.rollout_logprobs is None or record is None:
        raise ValueError(f"the token batch ({batch.source}) carries no rollout")
    logp = torch.tensor([v for r in batch.rollout_logprobs for v in r], dtype=torch.float32)
    layout = {"engine": record.engine, "layout": "continuous batching (the engine's)", "dtype": record.dtype}
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(record.dtype, record.dtype)
    return SideResult(SideConfig(engine="vllm", arith="vllm", layout="vllm", dtype=dtype), logp,
                      record.preconditions(checkpoint_fingerprint(record.model)), layout, record.engine, 0.0)


def _micro_batches(layout: str, n: int) -> list[list[int]]:
    if layout == "alone":
        return [[i] for i in range(n)]
    if layout == "micro2":
        half = (n + 1) // 2
        return [list(range(half)), list(range(half, n))] if n > 1 else [[0]]
    return [list(range(n))]


class TrainingSides:
    """Computes training-side log-probs of ``batch`` for any :class:`SideConfig` (cached)."""

    def __init__(self, model_dir: str | Path, batch: TokenBatch, *, checkpoint: str, device: torch.device,
                 trust_remote_code: bool = False, progress: Callable[[str], None] | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.batch = batch
        self.checkpoint = checkpoint
        self.device = device
        self.trust_remote_code = trust_remote_code
        self.progress = progress or (lambda line: None)
        self._models: dict[torch.dtype, torch.nn.Module] = {}
        self._cache: dict[tuple[SideConfig, int], SideResult] = {}
        self._tp: dict[str, object] | None = None
        self.tp_ariths: list[str] = []  # every arith the tp2 layout is asked for, run in one group
        self.sequences = batch.sequences()
        self.ids = batch.flat_response_ids()
        self.mask = batch.flat_mask()
        self.temperature = batch.sampling.temperature

    def preconditions(self) -> Preconditions:
        """What the training sides score, from the tensors they forward (not from the rollout's record)."""
        lengths = [len(r) for r in self.batch.responses]
        prompts = [s[: s.numel() - n].tolist() for s, n in zip(self.sequences, lengths)]
        responses = [s[s.numel() - n:].tolist() for s, n in zip(self.sequences, lengths)]
        return Preconditions(checkpoint=self.checkpoint, token_ids=sequences_fingerprint(prompts, responses),
                             masks=masks_fingerprint(lengths, self.mask.tolist()), temperature=self.temperature,
                             top_p=TRAINING_TOP_P, top_k=TRAINING_TOP_K, logprob_space=LOGPROB_SPACE)

    # -- models ------------------------------------------------------------------------------
    def model(self, dtype: torch.dtype) -> torch.nn.Module:
        if dtype not in self._models:
            if torch.float32 not in self._models:
                self._models[torch.float32] = load_model(self.model_dir, self.device, self.trust_remote_code)
                self.batch.check_vocab(self._models[torch.float32].get_output_embeddings().weight.shape[0])
            if dtype != torch.float32:
                # the fp32 weights rounded to ``dtype``: what loading the checkpoint in that dtype gives
                self._models[dtype] = copy.deepcopy(self._models[torch.float32]).to(dtype)
            self._check_head_split(self._models[dtype])
        return self._models[dtype]

    def release(self, dtype: torch.dtype) -> None:
        """Free a cast copy (the fp32 model stays: every other dtype is cast from it)."""
        if dtype != torch.float32:
            self._models.pop(dtype, None)

    @torch.no_grad()
    def _check_head_split(self, model: torch.nn.Module) -> None:
        seq = self.sequences[0][None].to(self.device)
        whole = model(input_ids=seq, use_cache=False).logits
        body = getattr(model, model.base_model_prefix)
        split = model.get_output_embeddings()(body(input_ids=seq, use_cache=False).last_hidden_state)
        if not torch.equal(whole, split):
            raise LadderError(f"{self.model_dir}: the model's logits are not its LM head applied to its final hidden "
                              "states (soft-capping or logit scaling?); the ladder cannot split its forward")

    @torch.no_grad()
    def response_logits(self, dtype: str = "fp32") -> torch.Tensor:
        """The response rows' logits [R, V] (upcast to fp32) of the one-micro-batch forward with the
        weights in ``dtype`` (the semantics rung transforms these)."""
        if dtype not in WEIGHT_DTYPES:
            raise LadderError(f"dtype {dtype!r}: not one of {sorted(WEIGHT_DTYPES)}")
        _, logit_rows, _ = self._forward(self.model(WEIGHT_DTYPES[dtype]), "batch")
        return torch.cat(logit_rows).float()

    # -- forward -----------------------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, model: torch.nn.Module, layout: str) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
        """Per sample: response-row hidden states [R_i, H] and logits [R_i, V], and the layout record."""
        body = getattr(model, model.base_model_prefix)
        head = model.get_output_embeddings()
        seqs = self.sequences
        n = len(seqs)
        hidden_rows: list[torch.Tensor | None] = [None] * n
        logit_rows: list[torch.Tensor | None] = [None] * n
        record: dict[str, object] = {"layout": layout, "device": str(self.device),
                                     "attn": getattr(model.config, "_attn_implementation", None),
                                     "micro_batches": [], "padded_lengths": []}
        if layout == "packed":
            ids = torch.cat(seqs)[None].to(self.device)
            pos = torch.cat([torch.arange(s.numel()) for s in seqs])[None].to(self.device)
            hidden = body(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            logits = head(hidden)
            start = 0
            for i, s in enumerate(seqs):
                r = self._response_slice(i, start)
                hidden_rows[i], logit_rows[i] = hidden[0, r], logits[0, r]
                start += s.numel()
            record["micro_batches"] = [list(range(n))]
            record["padded_lengths"] = [int(ids.shape[1])]
            return hidden_rows, logit_rows, record
        extra = PAD_EXTRA if layout == "pad16" else 0
        for group in _micro_batches(layout, n):
            hidden, logits, width = self._padded(body, head, [seqs[i] for i in group], extra)
            for k, i in enumerate(group):
                r = self._response_slice(i, 0)
                hidden_rows[i], logit_rows[i] = hidden[k, r], logits[k, r]
            record["micro_batches"].append(group)
            record["padded_lengths"].append(width)
        return hidden_rows, logit_rows, record

    def _padded(self, body, head, seqs: list[torch.Tensor], extra: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        width = max(s.numel() for s in seqs) + extra
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, s in enumerate(seqs):
            ids[k, :s.numel()] = s
            mask[k, :s.numel()] = 1
        hidden = body(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False).last_hidden_state
        return hidden, head(hidden), width

    def _response_slice(self, i: int, start: int) -> slice:
        # the logit at position j predicts token j + 1: the response's rows end one before its last token
        p, r = len(self.batch.prompts[i]), len(self.batch.responses[i])
        return slice(start + p - 1, start + p - 1 + r)

    # -- sides -------------------------------------------------------------------------------
    def side(self, config: SideConfig, replica: int = 0) -> SideResult:
        key = (config, replica)
        if key not in self._cache:
            t0 = time.perf_counter()
            if config.engine != "train":
                raise LadderError(f"{config.label}: not a training side")
            if config.layout == "tp2":
                logp, impl, layout = self._tp_side(config)
            else:
                logp, impl, layout = self._local_side(config)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._cache[key] = SideResult(config, logp.detach().float().cpu(), self.preconditions(), layout, impl,
                                          time.perf_counter() - t0)
        return self._cache[key]

    def _local_side(self, config: SideConfig) -> tuple[torch.Tensor, str, dict]:
        if config.arith == "megatron":
            raise SideUnavailable("megatron's cross-entropy runs in a TP group only (layout tp2)")
        model = self.model(WEIGHT_DTYPES[config.dtype])
        hidden_rows, logit_rows, layout = self._forward(model, config.layout)
        ids = self.ids.to(self.device)
        if config.arith == "kernels-linear":
            head = model.get_output_embeddings()
            logp, impl = logp_from_hidden(config.arith, torch.cat(hidden_rows), head.weight, head.bias, ids,
                                          self.temperature)
        else:
            logits = torch.cat(logit_rows)
            if config.dtype in LOGITS_CAST:
                logits = logits.to(LOGITS_CAST[config.dtype])
            logp, impl = logp_from_logits(config.arith, logits, ids, self.temperature)
        layout["logits_dtype"] = str(LOGITS_CAST.get(config.dtype, WEIGHT_DTYPES[config.dtype]))
        return logp, impl, layout

    @torch.no_grad()
    def _tp_side(self, config: SideConfig) -> tuple[torch.Tensor, str, dict]:
        if config.dtype != "fp32":
            raise SideUnavailable(f"the tp2 layout runs fp32 only (asked: {config.dtype})")
        if self._tp is None:
            model = self.model(torch.float32)
            body = getattr(model, model.base_model_prefix)
            head = model.get_output_embeddings()
            hidden, _, width = self._padded(body, head, self.sequences, 0)
            rows = torch.cat([torch.arange(self._response_slice(i, 0).start, self._response_slice(i, 0).stop) + i * width
                              for i in range(len(self.sequences))])
            ariths = self.tp_ariths or [config.arith]
            self.progress(f"TP=2 group ({', '.join(ariths)}): spawning 2 ranks")
            self._tp = tp.run_tp(hidden=hidden, weight=head.weight, bias=head.bias, rows=rows, ids=self.ids,
                                 temperature=self.temperature, ariths=ariths)
            self._tp["_width"] = width
        out = self._tp.get(config.arith)
        if out is None:
            raise LadderError(f"{config.label}: arith {config.arith!r} was not in the TP group's plan {self.tp_ariths}")
        if isinstance(out, tuple):
            kind, reason = out
            if kind == "unavailable":
                raise SideUnavailable(reason)
            raise RuntimeError(f"{config.label} failed in the TP group: {reason}")
        layout = {"layout": "tp2", "tp_world": 2, "process_group": self._tp["_backend"],
                  "micro_batches": [list(range(len(self.sequences)))], "padded_lengths": [self._tp["_width"]],
                  "logits_dtype": "torch.float32"}
        return out, str(self._tp.get(f"{config.arith}_impl", "?")) + " (TP=2)", layout


def load_config(model_dir: Path, trust_remote_code: bool):
    """The model's transformers config; a model that needs its own code is refused unless asked."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            raise LadderError(f"{model_dir}: the model needs its own code (trust_remote_code); pass "
                              "--trust-remote-code only if you trust that code") from exc
        raise


def load_model(model_dir: Path, device: torch.device, trust_remote_code: bool) -> torch.nn.Module:
    """The checkpoint in fp32, in eval mode, on ``device``; never with remote code unless asked."""
    from transformers import AutoModelForCausalLM

    config = load_config(model_dir, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def side_summary(result: SideResult) -> dict[str, object]:
    return {"config": dataclasses.asdict(result.config), "implementation": result.implementation,
            "layout": result.layout, "layout_fingerprint": result.layout_fingerprint,
            "preconditions": result.preconditions.to_dict(), "seconds": round(result.seconds, 4)}

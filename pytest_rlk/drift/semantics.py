"""The semantics rung: do the rollout's and the training's log-probs mean the same thing?

A sampled token's log-prob is the log-softmax of the logits after some of sampling's transforms:
divided by the temperature, restricted to the top-k tokens, restricted to the top-p nucleus (each
restriction renormalizes). vLLM reports either ``raw_logprobs`` (its default: before all of them)
or ``processed_logprobs`` (after all of them, vLLM's order: temperature, top-k, top-p); vime's
Megatron replay divides the logits by the rollout temperature and applies nothing else
(:data:`VIME_TRAINING`). Where the two differ, the mismatch is one of semantics, not of numerics:
vime issues 64 and 69 traced a high ``train_rollout_logprob_abs_diff`` to raw log-probs at a
temperature below 1, and to processed log-probs with top-p < 1.

A cell of this rung takes one rollout (its tokens and the engine's log-probs) and the training
forward's fp32 logits of the same tokens, and

* names every setting in which the two sides' semantics differ (:func:`findings`);
* measures every mismatch metric (pytest_rlk/mismatch) with the training's semantics and again with
  the rollout's (the training side replaying the rollout's temperature / top-k / top-p), so what the
  semantics explain is measured, not assumed (the rest is numerics: dtype, kernels, engine);
* fits each candidate training semantics (temperature applied or not, filter replayed or not) and
  names the one closest to the engine's log-probs.

A cell's gap is attributed to this rung when its semantics differ and matching them removes at
least ``1 - 1 / SEMANTICS_FACTOR`` of its mean |dlogp|.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pytest_rlk.mismatch.metrics import MismatchMetrics, mismatch_metrics

RUNG = "S"
TITLE = "log-prob semantics"
SEMANTICS_FACTOR = 2.0  # matching the semantics must at least halve mean |dlogp| for the gap to be theirs
RAW, PROCESSED = "raw_logprobs", "processed_logprobs"
VIME_TRAINING = "vime's Megatron replay: logits divided by the rollout temperature, no top-k / top-p"


class SemanticsError(ValueError):
    """A setting the rung cannot represent (the message names it)."""


@dataclass(frozen=True)
class LogprobSemantics:
    """What a log-prob means: log-softmax of ``logits / temperature`` over the top-k tokens (-1: all)
    and within them the top-p nucleus (1.0: all), renormalized."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise SemanticsError(f"temperature {self.temperature}: must be > 0")
        if not 0 < self.top_p <= 1:
            raise SemanticsError(f"top_p {self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise SemanticsError(f"top_k {self.top_k}: must be >= 1, or -1 for off")

    def normalized(self, vocab_size: int) -> LogprobSemantics:
        """The same meaning with a top-k that keeps the whole vocabulary written as off."""
        return dataclasses.replace(self, top_k=-1) if self.top_k >= vocab_size else self

    @property
    def filtered(self) -> bool:
        return self.top_k != -1 or self.top_p < 1

    def describe(self) -> str:
        parts = [f"temperature {self.temperature:g}" if self.temperature != 1 else "no temperature"]
        if self.top_k != -1:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        return ", ".join(parts) + ("" if self.filtered else ", whole vocabulary")


def rollout_semantics(logprobs_mode: str, *, temperature: float, top_p: float = 1.0, top_k: int = -1) -> LogprobSemantics:
    """What vLLM's log-probs mean under ``logprobs_mode`` for a request sampled with these settings."""
    if logprobs_mode == RAW:
        return LogprobSemantics()
    if logprobs_mode == PROCESSED:
        return LogprobSemantics(temperature=temperature, top_k=top_k if top_k > 0 else -1, top_p=top_p)
    raise SemanticsError(f"logprobs_mode {logprobs_mode!r}: the rung knows {RAW!r} and {PROCESSED!r}")


def vime_training_semantics(temperature: float) -> LogprobSemantics:
    """:data:`VIME_TRAINING` at the rollout's ``temperature``."""
    return LogprobSemantics(temperature=temperature)


def findings(rollout: LogprobSemantics, training: LogprobSemantics, *, logprobs_mode: str,
             sampling: dict[str, float]) -> list[str]:
    """One message per setting in which the two sides' log-probs mean different things."""
    out = []
    t = float(sampling.get("temperature", 1.0))
    if rollout.temperature != training.temperature:
        if logprobs_mode == RAW:
            out.append(f"temperature {t:g}: vLLM's logprobs_mode {RAW} gives log-probs before the temperature, "
                       f"training divides the logits by {training.temperature:g}")
        else:
            out.append(f"temperature: the rollout's log-probs ({logprobs_mode}) are at temperature "
                       f"{rollout.temperature:g}, training's at {training.temperature:g}")
    for name, what in (("top_k", "top-k"), ("top_p", "top-p")):
        a, b = getattr(rollout, name), getattr(training, name)
        if a != b:
            rollout_side = (f"renormalized over the {what} {a:g} set" if a != (-1 if name == "top_k" else 1.0)
                            else "over the whole vocabulary")
            training_side = (f"over the {what} {b:g} set" if b != (-1 if name == "top_k" else 1.0)
                             else "over the whole vocabulary")
            out.append(f"{name} {sampling.get(name, a):g}: the rollout's log-probs ({logprobs_mode}) are "
                       f"{rollout_side}, training's {training_side}")
    return out


@torch.no_grad()
def logp_under(logits: torch.Tensor, ids: torch.Tensor, semantics: LogprobSemantics) -> tuple[torch.Tensor, int]:
    """(fp32 log-probs [R] of ``ids`` under ``semantics``, how many of those tokens the replayed
    top-k / top-p set left out and were kept). The filter follows vLLM's rule: top-k keeps the
    logits >= the k-th largest; top-p then drops, in ascending order of probability, the tokens whose
    cumulative probability stays <= 1 - p (the most likely token always stays). The sampled token was
    in the engine's set, so where rounding at the set's edge leaves it out here it is kept."""
    if logits.dim() != 2 or ids.shape != logits.shape[:1]:
        raise SemanticsError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)}: expected [R, V] and [R]")
    z = logits.float()
    if semantics.temperature != 1:
        z = z / semantics.temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if semantics.top_k != -1 and semantics.top_k < z.shape[-1]:
        kth = torch.topk(z, semantics.top_k, dim=-1).values[:, -1:]
        keep &= z >= kth
    if semantics.top_p < 1:
        masked = z.masked_fill(~keep, float("-inf"))
        sorted_z, order = torch.sort(masked, dim=-1)  # ascending
        cum = torch.softmax(sorted_z, dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1 - semantics.top_p
        drop_sorted[:, -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        keep &= ~drop
    rows = torch.arange(z.shape[0], device=z.device)
    outside = int((~keep[rows, ids]).sum())
    keep[rows, ids] = True
    logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)[rows, ids]
    return logp, outside


@dataclass
class SemanticsCell:
    """One rollout's semantics against the training's, measured."""

    name: str
    logprobs_mode: str
    rollout_dtype: str
    sampling: dict[str, float]  # temperature, top_p, top_k of the request
    rollout: LogprobSemantics
    training: LogprobSemantics
    findings: list[str]
    metrics: MismatchMetrics  # training's semantics vs the engine's log-probs
    matched: MismatchMetrics  # the training side replaying the rollout's semantics
    outside_set: int  # sampled tokens the replayed set left out (kept)
    fits: dict[str, float] = field(default_factory=dict)  # candidate training semantics -> mean |dlogp|

    @property
    def best_fit(self) -> str:
        return min(self.fits, key=self.fits.get)

    @property
    def explained(self) -> float:
        """The share of mean |dlogp| that matching the semantics removes."""
        total = self.metrics.logp_abs_mean
        return 0.0 if total == 0 else 1.0 - self.matched.logp_abs_mean / total

    @property
    def attributed(self) -> bool:
        """This rung explains the cell's gap: its semantics differ and matching them at least divides
        mean |dlogp| by SEMANTICS_FACTOR."""
        return bool(self.findings) and self.matched.logp_abs_mean * SEMANTICS_FACTOR <= self.metrics.logp_abs_mean

    def verdict(self) -> str:
        m, k = self.metrics.logp_abs_mean, self.matched.logp_abs_mean
        if not self.findings:
            return f"aligned ({self.rollout.describe()} on both sides)"
        what = "; ".join(self.findings)
        if self.attributed:
            return (f"semantics mismatch: {what}. Matching them takes mean |dlogp| from {m:.3g} to {k:.3g} "
                    f"({100 * self.explained:.3g}% of it is semantics; the rest is numerics)")
        return (f"semantics differ ({what}) but matching them takes mean |dlogp| only from {m:.3g} to {k:.3g}: "
                "the gap is not theirs")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "logprobs_mode": self.logprobs_mode, "rollout_dtype": self.rollout_dtype,
                "sampling": self.sampling, "rollout": dataclasses.asdict(self.rollout),
                "training": dataclasses.asdict(self.training), "findings": self.findings,
                "metrics": self.metrics.to_dict(), "matched": self.matched.to_dict(), "outside_set": self.outside_set,
                "fits": self.fits, "best_fit": self.best_fit, "explained": self.explained,
                "attributed": self.attributed, "verdict": self.verdict()}


def candidates(request_filter: LogprobSemantics, temperature: float) -> dict[str, LogprobSemantics]:
    """Training semantics to fit: the temperature applied or not (one candidate at temperature 1),
    the request's top-k / top-p filter replayed or not (one candidate without a filter)."""
    temps = {"no temperature": 1.0} | ({f"temperature {temperature:g}": temperature} if temperature != 1 else {})
    filt = {"top_k": request_filter.top_k, "top_p": request_filter.top_p}
    out = {}
    for label, t in temps.items():
        out[label] = LogprobSemantics(temperature=t)
        if request_filter.filtered:
            out[f"{label}, filter replayed"] = LogprobSemantics(temperature=t, **filt)
    return out


def semantics_cell(name: str, *, rollout_logp: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                   mask: torch.Tensor, lengths: list[int], logprobs_mode: str, sampling: dict[str, float],
                   rollout_dtype: str, training: LogprobSemantics | None = None) -> SemanticsCell:
    """Measure one rollout's semantics against ``training`` (default :func:`vime_training_semantics`)."""
    vocab = logits.shape[-1]
    t = float(sampling["temperature"])
    top_p, top_k = float(sampling.get("top_p", 1.0)), int(sampling.get("top_k", -1))
    rollout = rollout_semantics(logprobs_mode, temperature=t, top_p=top_p, top_k=top_k).normalized(vocab)
    training = (training or vime_training_semantics(t)).normalized(vocab)
    train_lp, _ = logp_under(logits, ids, training)
    matched_lp, outside = logp_under(logits, ids, rollout)
    request_filter = LogprobSemantics(top_k=top_k if top_k > 0 else -1, top_p=top_p).normalized(vocab)
    fits = {label: mismatch_metrics(logp_under(logits, ids, sem)[0], rollout_logp, mask, lengths=lengths).logp_abs_mean
            for label, sem in candidates(request_filter, t).items()}
    return SemanticsCell(
        name=name, logprobs_mode=logprobs_mode, rollout_dtype=rollout_dtype,
        sampling={"temperature": t, "top_p": top_p, "top_k": top_k}, rollout=rollout, training=training,
        findings=findings(rollout, training, logprobs_mode=logprobs_mode, sampling=sampling),
        metrics=mismatch_metrics(train_lp, rollout_logp, mask, lengths=lengths),
        matched=mismatch_metrics(matched_lp, rollout_logp, mask, lengths=lengths), outside_set=outside, fits=fits)


def render(cells: list[SemanticsCell]) -> str:
    """The rung's markdown: a row per cell and side (training's semantics, then the rollout's
    replayed), every mismatch metric, the best-fitting candidate and the verdict."""
    from pytest_rlk.mismatch.metrics import METRIC_NAMES

    head = ["cell", "vLLM logprobs_mode", "rollout dtype", "training computes"] + list(METRIC_NAMES)
    lines = [f"## Rung {RUNG}: {TITLE}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        for label, sem, m in (("training's semantics", c.training, c.metrics), ("rollout's, replayed", c.rollout, c.matched)):
            vals = [f"{v:.4g}" for v in m.values().values()]
            lines.append("| " + " | ".join([c.name, c.logprobs_mode, c.rollout_dtype, f"{label}: {sem.describe()}"]
                                           + vals) + " |")
    lines.append("")
    for c in cells:
        fit = ", ".join(f"{k} {v:.3g}" for k, v in c.fits.items())
        lines.append(f"- **{c.name}**: {c.verdict()} Best fit to the engine's log-probs: {c.best_fit} "
                     f"(mean |dlogp| per candidate: {fit}).")
    return "\n".join(lines) + "\n"

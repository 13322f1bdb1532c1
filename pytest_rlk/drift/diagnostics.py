"""Per-comparison diagnostics (vime's RL-Kernel consistency plan), all in log-prob space.

With ``dlogp = logp_b - logp_a`` over the active response tokens (natural log; for A5, ``a`` is
the rollout engine and ``b`` the training forward, so ``ratio0`` is the PPO ratio the first
optimizer step sees under ``--use-rollout-logprobs``):

* ``|dlogp|``: mean, max, p50, p90, p99 (log-prob space);
* ``ratio0 = exp(dlogp)``: mean, min, max (a probability ratio);
* ``clipfrac0``: the fraction of tokens whose ratio0 lies outside ``[1 - eps_clip, 1 + eps_clip_high]``
  (independent of the advantage's sign: the share the clip would act on for either sign);
* ``approx_kl0 = mean(exp(dlogp) - 1 - dlogp)`` (k3 of the two sides, >= 0);
* ``abs_diff``: vime's ``train_rollout_logprob_abs_diff`` (the mean over samples of each sample's
  masked token mean of ``|dlogp|``), so numbers compare with vime's logs;
* the active-token count, both sides' batch-layout fingerprints, and the worst token's metadata;
* ``mismatch``: every metric of the mismatch table (pytest_rlk/mismatch/metrics.py), with ``b`` in
  the place of training and ``a`` in the place of the rollout.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pytest_rlk.mismatch.metrics import mismatch_metrics

SPACE = "logprob"  # natural-log probabilities of the sampled tokens, after temperature


@dataclass(frozen=True)
class WorstToken:
    sample: int
    position: int  # within the response
    token_id: int
    logp_a: float
    logp_b: float

    @property
    def dlogp(self) -> float:
        return self.logp_b - self.logp_a


@dataclass(frozen=True)
class Diagnostics:
    active_tokens: int
    abs_mean: float
    abs_max: float
    abs_p50: float
    abs_p90: float
    abs_p99: float
    abs_diff: float
    ratio0_mean: float
    ratio0_min: float
    ratio0_max: float
    clipfrac0: float
    approx_kl0: float
    eps_clip: float
    eps_clip_high: float
    layout_a: str
    layout_b: str
    worst: WorstToken
    space: str = SPACE
    mismatch: dict[str, float] = field(default_factory=dict)  # pytest_rlk.mismatch's table, b vs a

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Diagnostics:
        return cls(**{**data, "worst": WorstToken(**data["worst"])})


def diagnose(logp_a: torch.Tensor, logp_b: torch.Tensor, *, mask: torch.Tensor, samples: list[int],
             positions: list[int], token_ids: torch.Tensor, layout_a: str, layout_b: str,
             eps_clip: float = 0.2, eps_clip_high: float = 0.28) -> Diagnostics:
    """Diagnostics of ``logp_b`` against ``logp_a`` (both [R] over the flat response tokens)."""
    n = logp_a.numel()
    for name, x in (("logp_b", logp_b), ("mask", mask), ("token_ids", token_ids)):
        if x.numel() != n:
            raise ValueError(f"diagnose: {name} has {x.numel()} entries, logp_a {n}")
    if len(samples) != n or len(positions) != n:
        raise ValueError(f"diagnose: token metadata covers {len(samples)} tokens, logp_a {n}")
    a = logp_a.detach().double().cpu().numpy()
    b = logp_b.detach().double().cpu().numpy()
    active = mask.detach().cpu().numpy() != 0
    if not active.any():
        raise ValueError("diagnose: the mask leaves no active token")
    for name, x in (("a", a), ("b", b)):
        bad = np.flatnonzero(~np.isfinite(x) & active)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"diagnose: side {name} has a non-finite log-prob {x[i]} at sample {samples[i]}, "
                             f"response position {positions[i]} ({bad.size} such tokens)")
    d = (b - a)[active]
    absd = np.abs(d)
    ratio = np.exp(d)
    clipped = (ratio < 1.0 - eps_clip) | (ratio > 1.0 + eps_clip_high)
    idx = np.flatnonzero(active)
    worst = int(idx[int(np.argmax(absd))])
    per_sample = {}
    for k, i in enumerate(idx):
        per_sample.setdefault(samples[i], []).append(absd[k])
    abs_diff = float(np.mean([np.mean(v) for v in per_sample.values()]))
    lengths = [len(list(run)) for _, run in itertools.groupby(samples)]
    table = mismatch_metrics(logp_b.detach().double().cpu(), logp_a.detach().double().cpu(),
                             (mask.detach().cpu() != 0), lengths=lengths).values()
    return Diagnostics(
        active_tokens=int(active.sum()), abs_mean=float(absd.mean()), abs_max=float(absd.max()),
        abs_p50=float(np.quantile(absd, 0.5)), abs_p90=float(np.quantile(absd, 0.9)),
        abs_p99=float(np.quantile(absd, 0.99)), abs_diff=abs_diff,
        ratio0_mean=float(ratio.mean()), ratio0_min=float(ratio.min()), ratio0_max=float(ratio.max()),
        clipfrac0=float(clipped.mean()), approx_kl0=float(np.mean(np.expm1(d) - d)),
        eps_clip=eps_clip, eps_clip_high=eps_clip_high, layout_a=layout_a, layout_b=layout_b,
        worst=WorstToken(sample=samples[worst], position=positions[worst], token_id=int(token_ids[worst]),
                         logp_a=float(a[worst]), logp_b=float(b[worst])), mismatch=table)


"""The step-0 identities: where the old policy, the reference and the current one are the same
weights (the first optimizer step of a run), ``ppo_kl`` and ``kl_loss`` are 0 and the PPO ratio is 1.

slime (and vime, under ``--ci-test``) asserts ``ppo_kl < 1e-8`` and ``kl_loss < 1e-8`` at step 0: an
exact identity when one code path computes the old, the reference and the current log-probs. When
the current log-probs come from another op than the old ones (our kernels against the fp32
reference), the identities hold within that op's tolerance (``kernels/tolerances.py``):

* ``|ppo_kl| <= atol(logp)``: ppo_kl is a (mean) difference of two log-probs of the same logits;
* ``|ratio - 1| <= expm1(atol(logp)) + atol(ratio_kl) + rtol(ratio_kl)``: the ratio is exp(-ppo_kl)
  computed by the ratio/KL op;
* ``|kl_loss| <= atol(ratio_kl) + k3(atol(logp))``: every KL estimator is second order in the
  log-ratio r (k3 = exp(-r) - 1 + r ~ r^2 / 2), plus the op's own rounding.

Signature (the A/B lanes and the training-step tests call it the same way)::

    step0_problems(*, ppo_kl=None, kl_loss=None, ratio=None, tolerance=step0_tolerance("fp32"))
        -> list[str]   # one message per identity that fails; [] when all given hold

each value a float (the framework's logged step-0 mean: vime's ``train/ppo_kl``, ``train/kl_loss``;
a mean ratio) or a tensor of per-token values (then every token must hold the identity). At least
one value must be given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import tolerances
from pytest_rlk.mismatch.metrics import MismatchError

SLIME_STEP0_BOUND = 1e-8
SLIME_STEP0_SOURCE = "slime --ci-test: ppo_kl < 1e-8 and kl_loss < 1e-8 at step 0 (one code path for old and current)"


@dataclass(frozen=True)
class Step0Tolerance:
    ppo_kl: float  # bound on |ppo_kl|
    kl_loss: float  # bound on |kl_loss|
    ratio: float  # bound on |ratio - 1|
    source: str


def exact_tolerance() -> Step0Tolerance:
    """slime's bound, for a run whose old, reference and current log-probs come from one code path."""
    return Step0Tolerance(SLIME_STEP0_BOUND, SLIME_STEP0_BOUND, SLIME_STEP0_BOUND, SLIME_STEP0_SOURCE)


def step0_tolerance(dtype: str | torch.dtype = "fp32", platform: str | None = None) -> Step0Tolerance:
    """The identities' bounds when the current log-probs come from the ``logp`` op at the logits'
    ``dtype`` (kernels/tolerances.py) and the ratio / KL from the ``ratio_kl`` op (fp32)."""
    logp = tolerances.get("logp", dtype, platform)
    rk = tolerances.get("ratio_kl", "fp32", platform)
    if logp.rtol or logp.ulp is not None:
        raise MismatchError(f"kernels/tolerances.py logp {dtype}: {logp.describe()} is not a plain atol")
    k3 = math.expm1(-logp.atol) + logp.atol
    return Step0Tolerance(
        ppo_kl=logp.atol, kl_loss=rk.atol + k3, ratio=math.expm1(logp.atol) + rk.atol + rk.rtol,
        source=(f"kernels/tolerances.py logp {tolerances.dtype_name(dtype) if not isinstance(dtype, str) else dtype}: "
                f"{logp.describe()} [{logp.source}]; ratio_kl fp32: {rk.describe()} [{rk.source}]"))


def _worst(name: str, value: float | torch.Tensor, centre: float) -> tuple[float, str]:
    if isinstance(value, torch.Tensor):
        v = value.detach().double().reshape(-1)
        if v.numel() == 0:
            raise MismatchError(f"step0 {name}: an empty tensor")
        bad = ~torch.isfinite(v)
        if bool(bad.any()):
            return math.inf, f" ({int(bad.sum())} non-finite tokens)"
        i = int((v - centre).abs().argmax())
        where = f" (worst of {v.numel()} tokens, at token {i})" if v.numel() > 1 else ""
        return float(v[i]), where
    return float(value), ""


def step0_problems(*, ppo_kl: float | torch.Tensor | None = None, kl_loss: float | torch.Tensor | None = None,
                   ratio: float | torch.Tensor | None = None, tolerance: Step0Tolerance | None = None) -> list[str]:
    """The step-0 identities ``ppo_kl == 0``, ``kl_loss == 0``, ``ratio == 1`` within ``tolerance``
    (default :func:`step0_tolerance` of fp32 logits on this platform); a message per one that fails."""
    given = {"ppo_kl": (ppo_kl, 0.0), "kl_loss": (kl_loss, 0.0), "ratio": (ratio, 1.0)}
    if all(v is None for v, _ in given.values()):
        raise MismatchError("step0_problems: give at least one of ppo_kl, kl_loss, ratio")
    tol = tolerance or step0_tolerance("fp32")
    out = []
    for name, (value, centre) in given.items():
        if value is None:
            continue
        worst, where = _worst(name, value, centre)
        bound = getattr(tol, name)
        if not abs(worst - centre) <= bound:
            out.append(f"step-0 identity {name} == {centre:g} fails: {worst:.4g}{where}, |{name} - {centre:g}| "
                       f"> {bound:.3g} ({tol.source})")
    return out

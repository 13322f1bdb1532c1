"""Inputs and helpers shared by the op-tier tests (plain functions, no pytest).

Shapes: on CPU the Triton interpreter is slow, so the matrix uses SMALL_T x SMALL_V; the full
shapes (T = 4096, V in FULL_V) run only on a GPU (``gpu`` marker).
"""

from __future__ import annotations

import torch

from kernels import tolerances
from kernels.contracts import IGNORE_INDEX

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLATFORM = tolerances.current_platform()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SMALL_T = (1, 7, 64)
SMALL_V = (1000, 1031, 4096)  # 1031 is prime: every vocab tile leaves a partial last tile
FULL_T = 4096
FULL_V = (32000, 151936)
TEMPERATURES = (1.0, 0.7)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_logits(num_tokens: int, vocab: int, dtype: torch.dtype, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    """Logits of a few units with a peaked row or two (like a trained LM), drawn on DEVICE with a
    seeded generator of that device (deterministic per device; the CPU's generator would spend
    seconds per full [4096, 151936] case and a host-to-device copy of gigabytes)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(num_tokens, vocab, generator=gen, device=DEVICE) * scale
    logits[::3, 0] += 12.0  # a confident row: softmax mass concentrated on one id
    return logits.to(dtype)


def make_ids(num_tokens: int, vocab: int, seed: int = 0, ignore_every: int = 0) -> torch.Tensor:
    """Target ids: vocab edges included; every ``ignore_every``-th row set to IGNORE_INDEX."""
    gen = generator(seed + 1)
    ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
    ids[0] = vocab - 1
    if num_tokens > 1:
        ids[1] = 0
    if ignore_every:
        ids[ignore_every - 1 :: ignore_every] = IGNORE_INDEX
    return ids.to(DEVICE)


def loss_inputs(
    num_tokens: int, vocab: int, dtype: torch.dtype, seed: int = 0, lengths: list[int] | None = None,
    ignore_every: int = 0,
) -> dict[str, torch.Tensor]:
    """A packed GRPO batch: logits, ids (every ``ignore_every``-th the ignore index, if > 0),
    old/ref/rollout log-probs near the policy's, advantages, a mask with an all-zero sample when
    there are >= 3 samples, and lengths."""
    from kernels.reference import selected_logprob

    lengths = lengths or [num_tokens]
    assert sum(lengths) == num_tokens
    gen = generator(seed + 2)
    logits = make_logits(num_tokens, vocab, dtype, seed)
    ids = make_ids(num_tokens, vocab, seed, ignore_every=ignore_every)
    base = selected_logprob(logits, ids).cpu()
    old = base + 0.3 * torch.randn(num_tokens, generator=gen)
    ref = base + 0.4 * torch.randn(num_tokens, generator=gen)
    rollout = old + 0.3 * torch.randn(num_tokens, generator=gen)
    adv = torch.randn(num_tokens, generator=gen)
    mask = torch.rand(num_tokens, generator=gen) > 0.25
    if len(lengths) >= 3:  # sample 1 fully masked out: contributes exactly 0
        start = lengths[0]
        mask[start : start + lengths[1]] = False
    to = {"device": DEVICE}
    return {
        "logits": logits,
        "target_ids": ids,
        "old_logp": old.to(**to),
        "ref_logp": ref.to(**to),
        "rollout_logp": rollout.to(**to),
        "advantages": adv.to(**to),
        "loss_mask": mask.to(**to),
        "lengths": torch.tensor(lengths, device=DEVICE),
    }


def record_error(rlk_metrics, name: str, result: tolerances.Closeness, tags: dict[str, object], *,
                 band: dict[str, object]) -> None:
    """Record a max error (informational: the tolerance table is the gate). ``band``
    (:func:`tolerance_band`) is what an A/B of two such errors allows (``rlk diff --a-tag``)."""
    rlk_metrics.record(
        name, result.max_abs_err, direction="lower_is_better", space="error", tags=tags, gate=False, band=band
    )


def assert_close_and_record(
    rlk_metrics, metric: str, actual: torch.Tensor, expected: torch.Tensor, check: str, dtype: torch.dtype,
    tags: dict[str, object], *, name: str, upstream: torch.Tensor | float | None = None, terms: int | None = None,
) -> tolerances.Closeness:
    """``tolerances.assert_close``, then record the max error as ``metric`` with the op's tolerance
    as its A/B band, so a tag diff over any tag (backend, dtype, ...) allows what the table allows."""
    result = tolerances.assert_close(actual, expected, check, dtype, name=name, upstream=upstream, terms=terms)
    tol = tolerances.get(check, dtype, upstream=upstream, terms=terms)
    record_error(rlk_metrics, metric, result, tags, band=tolerance_band(check, dtype, tol, expected))
    return result


def tolerance_band(check: str, dtype: torch.dtype, tol: tolerances.Tolerance,
                   expected: torch.Tensor) -> dict[str, object]:
    """The tolerance of ``check`` as a bound on a max abs error: ``atol + rtol * max|ref|``, or
    ``ulp`` x the output dtype's spacing at max|ref| (``expected``: the fp32 reference). An A/B
    of two backends' errors then regresses only when B is worse than A by more than the op's
    tolerance (0 -> 1.9e-6 is no regression for a logp within atol 1e-4)."""
    ref = expected.detach().float()
    peak = ref.abs().max() if ref.numel() else torch.zeros((), device=ref.device)
    if tol.ulp is not None:
        bound = tol.ulp * float(tolerances.spacing(peak.to(dtype).float(), dtype))
    else:
        bound = tol.atol + tol.rtol * float(peak)
    name = tolerances.dtype_name(dtype)
    base = tolerances.TABLE[(check, name, PLATFORM)]
    scaled = "" if tol == base else "; scaled for this case by the table's rules"
    return {"abs_floor": bound, "source": f"kernels.tolerances ({check}, {name}, {PLATFORM}): "
                                          f"{base.describe()} at max|ref|{scaled} [{base.source}]"}


def loss_upstream_grad(
    logits: torch.Tensor, target_ids: torch.Tensor, loss_kwargs: dict[str, torch.Tensor], config,
    temperature: float = 1.0, grad_output: float = 1.0,
) -> torch.Tensor:
    """``grad_output * d loss / d logp`` [T] of the fp32 reference: the upstream gradient that
    scales a loss's dlogits tolerance (kernels.tolerances.UPSTREAM_RULE). ``loss_kwargs``: the
    loss inputs other than logits and ids (old/ref/rollout log-probs, advantages, mask, packing)."""
    from kernels.contracts import LossInputs
    from kernels.reference import grpo_loss_from_logp, selected_logprob

    with torch.no_grad():
        logp = selected_logprob(logits.detach().float(), target_ids, temperature)
    logp.requires_grad_()
    loss, _ = grpo_loss_from_logp(logp, LossInputs(config=config, **loss_kwargs))
    (grad,) = torch.autograd.grad(loss * grad_output, logp)
    return grad


def summed_terms(config, loss_mask: torch.Tensor) -> int | None:
    """Tokens a per-token-sum loss adds up (kernels.tolerances.SUMMED_TERMS_RULE); None for the
    per-sample mean the table's loss tolerances are stated for."""
    return int(loss_mask.sum()) if config.reduction == "per_token_sum" else None

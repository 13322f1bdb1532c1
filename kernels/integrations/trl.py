"""Install our selected log-prob operator into TRL's GRPOTrainer (TRL 1.16).

What TRL does (read from trl 1.16, ``trl/trainer/utils.py`` and ``trl/trainer/grpo_trainer.py``):
``GRPOTrainer.__init__`` calls ``add_fused_lm_head(model, ...)`` on the policy and on the
reference model. That replaces ``model.forward`` with ``_fused_forward``; called with
``fused_lm_head=True`` (which ``GRPOTrainer._get_per_token_logps_and_entropies`` always does, for
the policy's training forward, the old-policy pass and the reference pass) it runs the backbone and
then ``_ChunkedLogProbFunction.apply(hidden [N, H], weight [V, H], bias, targets [N], temperature,
chunk_size, softcap, logit_scale, outputs)``, where ``_ChunkedLogProbFunction`` is a *module
global* of ``trl.trainer.utils`` bound at import time to ``trl.kernels.ChunkedLogProbFunction``.
``_fused_forward`` looks that global up on every call, so replacing the name in
``trl.trainer.utils`` routes every per-token log-prob GRPOTrainer computes (policy, old policy,
reference) through our code, and generation (plain forward, ``fused_lm_head=False``) is untouched.

What we patch: exactly that one name, with ``RlkLmHeadLogProb`` whose ``apply`` has the same
signature and return tuple ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``. It
computes the selected log-prob with ``kernels.linear_logp`` on the hidden states and the LM head
(no [N, V] logits kept), or with ``kernels.logp`` on the projected logits (logit scale and
softcap applied as TRL does) where ``linear_logp`` is not allowed or the head is not plain; both
through our dispatch (backend choice, ``VIME_RL_KERNEL_STRICT``, fallback counters). The optional
outputs are not our operators: entropy (which GRPOTrainer requests for its ``entropy`` metric and
the entropy bonus) and the rest are computed with plain PyTorch from the same logits, so they
match TRL's meaning.

The GRPO loss has no name to patch: TRL computes ratio, clipping and KL inline in
``GRPOTrainer._compute_loss``. :func:`grpo_policy_loss` is vime's loss with the ratio and the KL
from ``kernels.ratio_kl``, for a trainer that computes its loss through it where TRL's configured
loss is vime's math (loss type ``grpo``, token-level ratio, k3 KL; the TRL engine's trainer does).

Switches: ``logp_enabled_by_env()`` says whether ``VIME_RL_KERNEL=1`` and the op allowlist
``VIME_RL_KERNEL_OPS`` admit ``logp`` or ``linear_logp``, ``loss_enabled_by_env()`` whether they
admit ``ratio_kl`` (the same switches as vime's lane); the TRL engine installs the patch only then. ``installed()`` is a context manager that patches and restores the original
name on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import kernels
from kernels import dispatch

PATCH_MODULE = "trl.trainer.utils"
PATCH_NAME = "_ChunkedLogProbFunction"
OP_NAME = "logp"
LINEAR_OP = "linear_logp"
LOSS_OP = "ratio_kl"
OPTIONAL_ROWS = 256  # rows of the optional outputs' fp32 logits at a time (no autograd): 155 MB at V = 151936
SUPPORTED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

# Calls routed through the patched name since install (evidence the kernel arm used our path).
_calls = {"lm_head_logp": 0, LINEAR_OP: 0, LOSS_OP: 0, "tokens": 0}
_original: object | None = None
_entropy_grad = True


class RlkLmHeadLogProb:
    """Drop-in for ``trl.kernels.ChunkedLogProbFunction`` (only ``apply`` is used by TRL).

    Shapes: hidden [N, H] (any float dtype; autocast applies to the projection as in TRL),
    weight [V, H], bias [V] or None, targets int64 [N] (TRL passes valid ids: masked rows are
    either removed or clamped to 0 and zeroed by TRL afterwards). Returns fp32 log-probs [N]
    with autograd to hidden/weight/bias, and the requested optional outputs [N] (others None).

    Which op serves the log-probs: ``linear_logp`` (hidden x LM head, no [N, V] logits kept) where
    the switches allow it and the head is plain (no softcap, logit scale 1, hidden and weight of
    one dtype); ``logp`` on the projected logits otherwise. The optional outputs are plain PyTorch
    from the logits, computed in row chunks without autograd unless the entropy's gradient is
    asked for (``install(entropy_grad=True)``, the default: an entropy bonus needs it).
    """

    @staticmethod
    def apply(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = SUPPORTED_OUTPUTS,
    ) -> tuple[torch.Tensor | None, ...]:
        del chunk_size  # our ops tile the vocab themselves
        unknown = [name for name in outputs if name not in SUPPORTED_OUTPUTS]
        if unknown:
            raise ValueError(f"outputs: {unknown} not among the supported {SUPPORTED_OUTPUTS}")

        def project(rows: slice | None = None) -> torch.Tensor:
            h = hidden if rows is None else hidden[rows]
            logits = F.linear(h, weight, bias)
            if logit_scale != 1.0:
                logits = logits * logit_scale
            if final_logit_softcapping is not None:
                logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
            return logits

        plain_head = logit_scale == 1.0 and final_logit_softcapping is None and hidden.dtype == weight.dtype
        logits = None
        if plain_head and dispatch.kernels_enabled() and dispatch.op_allowed(LINEAR_OP):
            log_probs = kernels.linear_logp(hidden, weight, targets, bias, temperature)
            _calls[LINEAR_OP] += 1
        else:
            logits = project()
            log_probs = kernels.logp(logits, targets, temperature)
            _calls["lm_head_logp"] += 1
        _calls["tokens"] += int(targets.numel())

        optional = [name for name in outputs if name != "log_probs"]
        if not optional:
            return log_probs, None, None, None, None
        if "entropy" in outputs and _entropy_grad and torch.is_grad_enabled():
            z = (project() if logits is None else logits).float() / temperature
            log_softmax = torch.log_softmax(z, dim=-1)
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
            with torch.no_grad():
                rest = _optional_outputs(z.detach(), targets, outputs, skip_entropy=True)
            return log_probs, entropy, *rest[1:]
        with torch.no_grad():
            # Not our operators: plain PyTorch with TRL's meaning, a row chunk at a time so no
            # [N, V] fp32 tensor is ever held.
            parts = []
            for start in range(0, hidden.shape[0], OPTIONAL_ROWS):
                rows = slice(start, start + OPTIONAL_ROWS)
                z = (project(rows) if logits is None else logits[rows]).float() / temperature
                parts.append(_optional_outputs(z, targets[rows], outputs, skip_entropy=False))
        merged = [None if part[0] is None else torch.cat(part) for part in zip(*parts, strict=True)]
        return log_probs, *merged


def _optional_outputs(z: torch.Tensor, targets: torch.Tensor, outputs: tuple[str, ...], *,
                      skip_entropy: bool) -> list[torch.Tensor | None]:
    """(entropy, log_sum_sq_probs, mean_logits, is_top1) of the scaled logits ``z`` [n, V] fp32,
    None where not asked."""
    log_softmax = torch.log_softmax(z, dim=-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if "entropy" in outputs and not skip_entropy else None
    log_sum_sq = torch.logsumexp(2 * log_softmax, dim=-1) if "log_sum_sq_probs" in outputs else None
    mean_logits = z.mean(-1) if "mean_logits" in outputs else None
    is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None
    return [entropy, log_sum_sq, mean_logits, is_top1]


def call_counts() -> dict[str, int]:
    """How many LM-head log-prob calls (and tokens) went through the patched name."""
    return dict(_calls)


def is_installed() -> bool:
    return _original is not None


def _trl_utils():
    import importlib

    try:
        module = importlib.import_module(PATCH_MODULE)
    except ImportError as exc:
        raise ImportError(f"kernels.integrations.trl needs trl (>= 1.16): {exc}") from exc
    if not hasattr(module, PATCH_NAME):
        import trl

        raise RuntimeError(
            f"trl {trl.__version__}: {PATCH_MODULE}.{PATCH_NAME} not found; this integration was "
            "written against trl 1.16, where GRPOTrainer's fused LM head calls that name"
        )
    return module


def install(*, entropy_grad: bool = True) -> None:
    """Patch ``trl.trainer.utils._ChunkedLogProbFunction`` with ``RlkLmHeadLogProb``.

    ``entropy_grad=False`` computes the entropy TRL asks for without autograd (a chunk of rows at a
    time): right where the loss does not differentiate it (no entropy bonus)."""
    global _original, _entropy_grad
    if _original is not None:
        raise RuntimeError("kernels.integrations.trl is already installed")
    module = _trl_utils()
    _original = getattr(module, PATCH_NAME)
    setattr(module, PATCH_NAME, RlkLmHeadLogProb)
    _entropy_grad = entropy_grad
    _calls.update({name: 0 for name in _calls})


def uninstall() -> None:
    """Restore TRL's original name (no-op when not installed)."""
    global _original
    if _original is None:
        return
    setattr(_trl_utils(), PATCH_NAME, _original)
    _original = None
    kernels.raise_pending_errors()  # training is over: bad ids the kernels found raise here at the latest


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Patch for the duration of the ``with`` block; the original is restored on exit."""
    install()
    try:
        yield
    finally:
        uninstall()


def logp_enabled_by_env() -> bool:
    """Whether ``VIME_RL_KERNEL`` / ``VIME_RL_KERNEL_OPS`` enable a log-prob op of TRL's LM head
    (``logp`` or ``linear_logp``)."""
    return dispatch.kernels_enabled() and (dispatch.op_allowed(OP_NAME) or dispatch.op_allowed(LINEAR_OP))


def loss_enabled_by_env() -> bool:
    """Whether the switches enable ``ratio_kl`` for the GRPO loss (:func:`grpo_policy_loss`)."""
    return dispatch.kernels_enabled() and dispatch.op_allowed(LOSS_OP)


def grpo_policy_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    ref_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    unbiased_kl: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's GRPO policy loss with the ratio and the k3 KL from ``kernels.ratio_kl``.

    per_token_logps        [B, L] fp32 with autograd (the policy's log-probs of the completions).
    old_per_token_logps    [B, L] the sampling policy's (detached).
    ref_per_token_logps    [B, L] the reference's, or None when ``beta`` is 0.
    advantages             [B] or [B, 1].
    mask                   [B, L] 0/1 (completion tokens).
    returns                (loss, stats): loss = mean over samples of the masked token mean of
                           ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta k3``, with
                           ``r = exp(logp - old)``, ``k3 = exp(ref - logp) - (ref - logp) - 1``
                           (vime's ``sum_of_sample_mean`` over one micro-batch, divided by its
                           sample count); ``unbiased_kl``: the KL times ``r`` (vime's
                           ``use_unbiased_kl``, TRL's ``use_bias_correction_kl``); stats: the per-token ``ratio``, ``kl`` (0 without a
                           reference) and ``clipped`` (bool), all [B, L].
    """
    shape = per_token_logps.shape
    flat_mask = mask.reshape(-1).bool()
    ref = old_per_token_logps if ref_per_token_logps is None else ref_per_token_logps
    ratio, kl = kernels.ratio_kl(per_token_logps.reshape(-1).float(), old_per_token_logps.reshape(-1).float(),
                                 ref.reshape(-1).float(), flat_mask, kl_type="k3",
                                 use_unbiased_kl=unbiased_kl)
    _calls[LOSS_OP] += 1
    ratio, kl = ratio.view(shape), kl.view(shape)
    adv = advantages.reshape(shape[0], 1)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    if ref_per_token_logps is not None and beta != 0.0:
        per_token = per_token + beta * kl
    weights = mask.to(per_token.dtype)
    loss = ((per_token * weights).sum(-1) / weights.sum(-1).clamp(min=1.0)).mean()
    clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    return loss, {"ratio": ratio.detach(), "kl": kl.detach(), "clipped": clipped & flat_mask.view(shape)}

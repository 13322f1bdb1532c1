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
projects the hidden states through the LM head (``F.linear``; logit scale and softcap applied as
TRL does), then computes the selected log-prob with ``kernels.logp`` (our dispatch: backend
choice, ``VIME_RL_KERNEL_STRICT``, fallback counters). The optional outputs are not our operators:
entropy (which GRPOTrainer requests for its ``entropy`` metric and the entropy bonus) and the
rest are computed with plain PyTorch from the same logits, so they match TRL's meaning.

What we do not patch: the GRPO loss. TRL computes ratio, clipping and KL inline in
``GRPOTrainer._compute_loss`` (no function name to replace) with its own reductions, so our
``grpo_loss`` / ``ratio_kl`` (vime semantics) have no drop-in point there.

Switches: ``logp_enabled_by_env()`` says whether ``VIME_RL_KERNEL=1`` and the op allowlist
``VIME_RL_KERNEL_OPS`` admit ``logp`` (the same switches as vime's lane); the TRL engine installs
the patch only then. ``installed()`` is a context manager that patches and restores the original
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
SUPPORTED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

# Calls routed through the patched name since install (evidence the kernel arm used our path).
_calls = {"lm_head_logp": 0, "tokens": 0}
_original: object | None = None


class RlkLmHeadLogProb:
    """Drop-in for ``trl.kernels.ChunkedLogProbFunction`` (only ``apply`` is used by TRL).

    Shapes: hidden [N, H] (any float dtype; autocast applies to the projection as in TRL),
    weight [V, H], bias [V] or None, targets int64 [N] (TRL passes valid ids: masked rows are
    either removed or clamped to 0 and zeroed by TRL afterwards). Returns fp32 log-probs [N]
    with autograd to hidden/weight/bias, and the requested optional outputs [N] (others None).
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
        del chunk_size  # ours materializes the [N, V] logits once; the kernel tiles the vocab itself
        unknown = [name for name in outputs if name not in SUPPORTED_OUTPUTS]
        if unknown:
            raise ValueError(f"outputs: {unknown} not among the supported {SUPPORTED_OUTPUTS}")
        logits = F.linear(hidden, weight, bias)
        if logit_scale != 1.0:
            logits = logits * logit_scale
        if final_logit_softcapping is not None:
            logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
        log_probs = kernels.logp(logits, targets, temperature)
        _calls["lm_head_logp"] += 1
        _calls["tokens"] += int(targets.numel())

        entropy = log_sum_sq = mean_logits = is_top1 = None
        optional = [name for name in outputs if name != "log_probs"]
        if optional:
            # Not our operators: plain PyTorch from the same logits, with TRL's meaning.
            z = logits.float() / temperature
            log_softmax = torch.log_softmax(z, dim=-1)
            if "entropy" in outputs:
                entropy = -(log_softmax.exp() * log_softmax).sum(-1)
            with torch.no_grad():
                if "log_sum_sq_probs" in outputs:
                    log_sum_sq = torch.logsumexp(2 * log_softmax, dim=-1)
                if "mean_logits" in outputs:
                    mean_logits = z.mean(-1)
                if "is_top1" in outputs:
                    is_top1 = z.argmax(-1) == targets
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1


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


def install() -> None:
    """Patch ``trl.trainer.utils._ChunkedLogProbFunction`` with ``RlkLmHeadLogProb``."""
    global _original
    if _original is not None:
        raise RuntimeError("kernels.integrations.trl is already installed")
    module = _trl_utils()
    _original = getattr(module, PATCH_NAME)
    setattr(module, PATCH_NAME, RlkLmHeadLogProb)
    _calls.update(lm_head_logp=0, tokens=0)


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
    """Whether ``VIME_RL_KERNEL`` / ``VIME_RL_KERNEL_OPS`` enable the ``logp`` op."""
    return dispatch.kernels_enabled() and dispatch.op_allowed(OP_NAME)

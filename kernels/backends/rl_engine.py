"""The ``rl_engine`` backend: RL-Kernel's operators (package ``rl_engine``) behind our op contract.

RL-Kernel is not on PyPI. Make it importable (``pip install -e <checkout>``, or put the checkout on
``PYTHONPATH``), or point ``RLK_RL_ENGINE_PATH`` at a checkout: this module then adds that path to
``sys.path`` when it imports ``rl_engine``. Select it with ``VIME_RL_KERNEL_BACKEND=rl_engine`` (a
built-in name). No RL-Kernel code is copied
here: every op is a call into ``rl_engine.kernels.registry.kernel_registry.get_op(name)``, i.e. the
implementation RL-Kernel itself picks on this machine (on CUDA: its Triton ``ratio_kl``,
``grpo_loss`` and ``linear_logp``, and for ``logp`` its compiled ``_C`` kernel when the extension is
built, else its eager PyTorch op; on CPU: its PyTorch ops). The implementation class serving each op
is listed in ``capabilities.extra["impl"]``.

How each op maps (and where it does not):

``logp`` -> ``op.apply_fp32(logits, ids)`` (log_softmax + gather in fp32). No temperature argument:
    temperature != 1 is unsupported. ``ignore_index`` rows are given id 0 and their output set to 0
    here (our contract's value; RL-Kernel has no ignore_index). The ``_C`` kernel has no backward.

``ratio_kl`` -> RL-Kernel's ratio/KL op takes *logits* (policy, reference) and computes the selected
    log-probs itself. Our contract passes log-probs, so each is written as the logits of a
    two-token distribution, ``[l, log(1 - exp(l))]``, whose selected log-prob (token 0) is ``l``.
    Ratio and k3 depend only on ``logp - old_logp`` and ``ref_logp - logp``, so the three are first
    shifted by the same per-token constant ``max(logp, ref_logp) + log 2`` (detached): both
    shifted log-probs are <= -log 2, so the policy token's probability is at most 1/2 and
    RL-Kernel's gradient to its logits flows back to ``logp`` through a well-conditioned chain (near
    probability 1 the chain would divide by ``1 - p``). Its KL is k3 (unclamped): ``kl_type="k3"`` only, no
    unbiased KL. Its masked positions give ratio 1, KL 0; ours give 0, 0, so the outputs are
    multiplied by the mask here.

``grpo_loss`` -> ``op.apply(policy_logits, ref_logits, ids, old_logp, sample_advantages, mask,
    clip_eps, beta)`` with one token per RL-Kernel "sequence" (``[T, 1, V]``), so per-token
    advantages are exact. Its loss is ``mean_active(pg) + beta * mean_active(k3)`` over all active
    tokens: vime's loss only with ``eps_clip == eps_clip_high``, ``kl_type == "k3"`` (when
    ``kl_loss_coef != 0``), ``reduction == "sum_of_sample_mean"`` over ONE packed sample, a 0/1
    loss mask, temperature 1, and no TIS / GSPO / dual clip / unbiased KL. It reads reference
    *logits*: the adapter builds a ``[T, 1, V]`` fp32 tensor whose selected log-prob is ``ref_logp``
    (the rest of the mass spread evenly), which the k3 term depends on alone; so the op also reads
    a second logits-sized tensor (not the same memory traffic as vime's loss). Metrics: ``pg_loss``
    and ``kl_loss``; RL-Kernel does not produce ``pg_clipfrac`` or ``ppo_kl``.

``linear_logp`` -> ``op(hidden, weight, ids, bias, tp_group=, vocab_start_index=,
    global_vocab_size=)``; temperature 1 only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kernels import settings
from kernels.backends import adapter_common as common
from kernels.backends.base import BaseBackend, Capabilities
from kernels.contracts import GrpoLossCall, LinearLogpCall, LogpCall, LossConfig, RatioKLCall

BACKEND_ID = "rl_engine"
PATH_ENV = settings.RL_ENGINE_PATH.name
RL_ENGINE_OPS = ("logp", "ratio_kl", "grpo_loss", "linear_logp")
GRPO_LOSS_METRICS = ("pg_loss", "kl_loss")
HOW_TO_PROVIDE = (
    f"make RL-Kernel's rl_engine importable (pip install -e <RL-Kernel checkout>, or PYTHONPATH), "
    f"or set {PATH_ENV}=<RL-Kernel checkout>"
)
LOSS_FEATURE_REASONS = {
    "gspo": "GSPO: RL-Kernel's ratio is per token",
    "dual_clip": "dual clip (eps_clip_c): RL-Kernel's surrogate has no third clip",
    "tis": "TIS: RL-Kernel's grpo_loss takes no importance weights",
    "unbiased_kl": "use_unbiased_kl: RL-Kernel's KL is plain k3",
}
# the mass not on the selected token is spread over the other V-1 logits; clamping the log keeps
# them finite where the selected probability rounds to 1 (log(1e-38) ~ -87.5, exp of it ~ 0)
_MIN_REST_LOG = math.log(1e-38)


def import_rl_engine() -> Any:
    """Import ``rl_engine`` (adding ``$RLK_RL_ENGINE_PATH`` to sys.path first when it is set)."""
    checkout = settings.RL_ENGINE_PATH.get()
    if checkout is not None:
        path = str(checkout)
        if not (checkout / "rl_engine" / "__init__.py").is_file():
            raise ImportError(f"{PATH_ENV}={path!r} does not hold an rl_engine package (no rl_engine/__init__.py)")
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module("rl_engine.kernels.registry")
    except ImportError as exc:
        raise ImportError(f"rl_engine not importable ({exc}); {HOW_TO_PROVIDE}") from exc


def _checkout_version(package_dir: Path) -> str:
    """``0.1.0+g<sha10>`` from the checkout's .git (read as files), or the installed version."""
    try:
        return importlib.metadata.version("RL-Kernel")
    except importlib.metadata.PackageNotFoundError:
        pass
    git = package_dir.parent / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            ref_file = git / ref
            if ref_file.is_file():
                head = ref_file.read_text().strip()
            else:
                packed = (git / "packed-refs").read_text().splitlines()
                head = next(line.split()[0] for line in packed if line.endswith(" " + ref))
        return f"checkout+g{head[:10]}"
    except (OSError, StopIteration):
        return "checkout+unknown"


def grpo_config_reason(config: LossConfig) -> str | None:
    """Why RL-Kernel's grpo_loss is not vime's loss for ``config`` (beyond the capability fields)."""
    reason = common.unsupported_loss_features(config, LOSS_FEATURE_REASONS)
    if reason is not None:
        return reason
    if config.kl_loss_coef != 0.0 and config.kl_type != "k3":
        return f"kl_type {config.kl_type}: RL-Kernel's KL is k3 (low_var_kl also clamps to [-10, 10])"
    return None


def _single_sample_reason(n_samples: int | None) -> str | None:
    if n_samples is not None and n_samples != 1:
        return (
            f"{n_samples} packed samples: RL-Kernel's loss is one mean over all active tokens, "
            "vime's sum_of_sample_mean sums per-sample means"
        )
    return None


class RlEngineBackend(BaseBackend):
    """RL-Kernel's ``rl_engine`` behind our op contract (see the module docstring)."""

    id = BACKEND_ID

    def __init__(self) -> None:
        registry_module = import_rl_engine()
        from rl_engine.kernels.ops.base import _EXT_AVAILABLE

        self._registry = registry_module.kernel_registry
        self.ext_available = bool(_EXT_AVAILABLE)
        self._ops: dict[str, Any] = {}
        impl: dict[str, str] = {}
        for op in RL_ENGINE_OPS:
            try:
                self._ops[op] = self._registry.get_op(op)
                impl[op] = type(self._ops[op]).__name__
            except RuntimeError as exc:  # "No functional backend found for <op>"
                impl[op] = f"unavailable: {exc}"
        self.version = _checkout_version(Path(sys.modules["rl_engine"].__file__).parent)
        self.capabilities = Capabilities(
            ops=frozenset(self._ops),
            temperature=False,
            clip_shapes=frozenset({"symmetric"}),
            kl_types=frozenset({"k3"}),
            reductions=frozenset({"sum_of_sample_mean"}),
            tp=True,  # linear_logp only (check_case)
            extra={"impl": impl, "compiled_extension": self.ext_available, "grpo_loss_metrics": GRPO_LOSS_METRICS},
        )

    def supports(self, op: str, **case: Any) -> str | None:
        config = case.get("config")
        if op == "grpo_loss" and config is not None and config.kl_loss_coef == 0.0:
            case = {**case, "config": replace(config, kl_type="k3")}  # no KL term: its type is moot
        return super().supports(op, **case)

    def check_case(self, op: str, **case: Any) -> str | None:
        if case.get("tp_world", 1) > 1 and op != "linear_logp":
            return f"RL-Kernel's {op} has no vocab-parallel form"
        impl = self.capabilities.extra["impl"][op]
        if op == "logp" and case.get("requires_grad") and impl != "NativeLogpOp":
            return f"RL-Kernel's logp is served by {impl} (compiled _C kernel), which has no backward"
        dtype = case.get("dtype")
        if op == "linear_logp" and impl == "NativeLinearLogpOp" and dtype is not None and dtype != torch.float32:
            return (
                f"{dtype} hidden on RL-Kernel's NativeLinearLogpOp: F.linear in the input dtype rounds the "
                "logits, not the fp32-accumulated logits of the linear-op contract (its Triton op on CUDA accumulates in fp32)"
            )
        if op == "ratio_kl" and case.get("use_unbiased_kl"):
            return LOSS_FEATURE_REASONS["unbiased_kl"]
        if op == "grpo_loss":
            if case.get("inplace_backward"):
                return "inplace_backward: RL-Kernel does not write the gradient into the caller's logits"
            config = case.get("config")
            if config is not None:
                return grpo_config_reason(config) or _single_sample_reason(case.get("num_samples"))
        return None

    def get(self, op: str) -> Callable[..., Any]:
        if op not in self._ops:
            raise KeyError(f"{self.id} does not serve {op!r}: {self.capabilities.extra['impl'].get(op, 'unknown op')}")
        impls = {"logp": self._logp, "ratio_kl": self._ratio_kl, "grpo_loss": self._grpo_loss, "linear_logp": self._linear_logp}
        return impls[op]

    # -- implementations: each takes the op's checked call (kernels/contracts/) -----------------

    def _logp(self, call: LogpCall) -> torch.Tensor:
        common.require(self.check_case("logp", tp_world=call.tp_world), self.id, "logp")
        common.require("temperature != 1 (RL-Kernel has no temperature argument)" if call.temperature != 1.0 else None,
                       self.id, "logp")
        ignored = call.target_ids == call.ignore_index
        safe_ids = torch.where(ignored, torch.zeros_like(call.target_ids), call.target_ids)
        out = self._ops["logp"].apply_fp32(call.logits, safe_ids)
        return torch.where(ignored, torch.zeros_like(out), out)

    def _ratio_kl(self, call: RatioKLCall) -> tuple[torch.Tensor, torch.Tensor]:
        kl_type, logp = call.kl_type, call.logp
        common.require(f"kl_type {kl_type} (RL-Kernel's KL is k3)" if kl_type != "k3" else None, self.id, "ratio_kl")
        common.require(LOSS_FEATURE_REASONS["unbiased_kl"] if call.use_unbiased_kl else None, self.id, "ratio_kl")
        active = call.mask != 0
        # ratio and k3 depend on logp - old and ref - logp only: shift all three by a per-token
        # constant so the policy token's probability is 1/2 (a well-conditioned chain back to logp)
        ref = call.ref_logp.detach().float()
        shift = torch.maximum(logp.detach(), ref) + math.log(2.0)
        policy_logits = _two_token_logits(logp - shift)
        ref_logits = _two_token_logits(ref - shift)
        zeros = torch.zeros_like(logp, dtype=torch.long)
        ratio, kl = self._ops["ratio_kl"](policy_logits, ref_logits, zeros, active, call.old_logp.float() - shift)
        m = call.mask.float()
        return ratio * m, kl * m

    def _grpo_loss(self, call: GrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config, target_ids, logits = call.config, call.target_ids, call.logits
        vocab = logits.shape[1]
        common.require(self.supports("grpo_loss", **call.case()), self.id, "grpo_loss")
        common.check_ids_in_vocab(target_ids, vocab, self.id, "grpo_loss")
        if not bool(((call.loss_mask == 0) | (call.loss_mask == 1)).all()):
            common.require("loss_mask has weights other than 0/1 (RL-Kernel's mask is boolean)", self.id, "grpo_loss")
        policy = logits[:, None, :]
        if call.ref_logp is None:
            ref = logits.detach()[:, None, :]  # same logits: k3 is exactly 0, as vime's kl_loss without ref
        else:
            ref = _selected_logits(call.ref_logp.detach().float(), target_ids, vocab)[:, None, :]
        loss, pg_loss, kl = self._ops["grpo_loss"].apply(
            policy,
            ref,
            target_ids.long()[:, None],
            call.old_logp.float()[:, None],
            call.advantages.float(),
            (call.loss_mask != 0)[:, None],
            clip_eps=config.eps_clip,
            beta=float(config.kl_loss_coef),
        )
        metrics = {"pg_loss": pg_loss.detach().float()}
        if config.kl_type == "k3" or call.ref_logp is None:
            metrics["kl_loss"] = kl.detach().float()
        return loss.float(), metrics

    def _linear_logp(self, call: LinearLogpCall) -> torch.Tensor:
        common.require("temperature != 1 (RL-Kernel has no temperature argument)" if call.temperature != 1.0 else None,
                       self.id, "linear_logp")
        return self._ops["linear_logp"](
            call.hidden, call.weight, call.target_ids, call.bias,
            tp_group=call.tp_group, vocab_start_index=call.vocab_start, global_vocab_size=call.global_vocab,
        )


def _rest_log(logp: torch.Tensor, others: int) -> torch.Tensor:
    """log of the probability left to each of ``others`` tokens: log((1 - exp(logp)) / others)."""
    return torch.log(-torch.expm1(logp)).clamp(min=_MIN_REST_LOG) - math.log(others)


def _two_token_logits(logp: torch.Tensor) -> torch.Tensor:
    """[T] log-probs (< 0) -> [T, 2] logits whose log_softmax at token 0 is ``logp``
    (differentiable: the gradient to both logits flows back to ``logp``)."""
    return torch.stack([logp, _rest_log(logp, 1)], dim=-1)


def _selected_logits(logp: torch.Tensor, target_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[T] log-probs -> [T, V] fp32 logits whose log_softmax at ``target_ids`` is ``logp``."""
    rows = _rest_log(logp, vocab - 1)[:, None].expand(-1, vocab).clone()
    rows.scatter_(1, target_ids.long()[:, None], logp[:, None])
    return rows


def make_backend() -> RlEngineBackend:
    return RlEngineBackend()

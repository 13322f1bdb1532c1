"""The arms of the capacity benchmark: how a training step turns the model's last hidden state into
vime's loss (vime's GRPO loss, low_var_kl 0.01, ``LOSS_FLAGS``). Every arm runs the same model,
micro-batch and optimizer; each splits its step into ``forward`` (the model) and ``loss`` (the
log-prob and the loss), and the step times the backward and the optimizer after them.

Logits arms (the model's LM head gives bf16 logits [T, V], upcast to vime's fp32 [T, V]):
- ``vime``: vime's own ``loss_function`` (``vime.backends.megatron_utils.loss``) imported from the
  checkout ``--rlk-vime-root`` names, on one Megatron rank (``suites/module/vime/conformance.py``);
- ``vime_reference`` (without a vime checkout, LABELLED: not vime's code): vime's loss through our
  vime adapter on the fp32 reference backend (``kernels/reference``: fp32 log-softmax, gather, vime's
  math), the path ``suites/module/train_step.py``'s reference arm runs;
- ``rlk_logp_ratio_kl``: the vime adapter on our kernels (``kernels.logp``, ``kernels.ratio_kl``),
  as a vime training step with ``--custom-loss-function-path`` runs them;
- ``rlk_grpo_loss``: ``kernels.grpo_loss`` on the response rows, its backward in place
  (``inplace_backward``: no second [R, V] buffer for the gradient).
Hidden-state arms (the model's backbone; the LM head is the loss's):
- ``rlk_linear_logp``: ``kernels.linear_logp`` (no [T, V] logits), then ``kernels.ratio_kl`` and
  vime's reductions;
- ``liger_fused_linear_grpo``: Liger's ``LigerFusedLinearGRPOLoss`` through our Liger adapter
  (``kernels.backends.liger.liger_linear_grpo_loss``). Its math is not vime's: k3 KL (low_var_kl is
  k3 clamped) and one masked token mean over the micro-batch (Liger's ``bnpo``); the work is the same;
- ``trl_chunked_lm_head``: TRL's ``trl.kernels.ChunkedLogProbFunction`` (TRL's default chunk,
  32768 rows), then vime's loss from the log-probs on the fp32 reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kernels import reference
from kernels.contracts import LossInputs
from kernels.integrations import vime as adapter
from kernels.integrations.vime_batch import pack_responses
from suites.module import vime_standin as standin

LOSS_FLAGS = ["--use-kl-loss", "--kl-loss-coef", "0.01"]  # the loss: vime's, low_var_kl 0.01
PROMPT_FRACTION = 8  # a sample's prompt is 1/8 of its tokens, the rest its response (the loss's rows)
TRL_CHUNK_ROWS = 32768  # TRL's own default chunk size


@dataclasses.dataclass
class MicroBatch:
    """``rows`` packed samples of ``seq_len`` tokens each (vime's THD micro-batch)."""

    input_ids: torch.Tensor  # [B, L] on the device
    vime: dict  # vime's packed batch, every tensor on the device
    loss_inputs: LossInputs  # the response tokens' old / ref log-probs, advantages, mask, lengths
    response_rows: torch.Tensor  # [R] rows of the packed [B * L] positions that predict a response token
    target_ids: torch.Tensor  # [R]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


def micro_batch_shape(tokens: int, seq_len: int) -> tuple[int, int]:
    """(samples, tokens per sample) for a micro-batch of about ``tokens``: as few samples as hold
    them at ``seq_len`` at most, of equal length (so ``samples * length`` is ``tokens`` less under
    ``samples``)."""
    if tokens < 2 or seq_len < 2:
        raise ValueError(f"a micro-batch needs tokens >= 2 and seq_len >= 2, got tokens={tokens}, seq_len={seq_len}")
    rows = -(-tokens // seq_len)
    return rows, tokens // rows


def make_micro_batch(tokens: int, seq_len: int, vocab: int, device: torch.device, seed: int = 0) -> MicroBatch:
    rows, length = micro_batch_shape(tokens, seq_len)
    prompt = max(1, length // PROMPT_FRACTION)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    response = length - prompt
    lp = lambda: -torch.rand(response, generator=gen) * 4  # noqa: E731 - log-probs of sampled tokens
    samples = range(rows)
    batch = standin.packed_batch_standin(
        [ids[i, :prompt] for i in samples], [ids[i, prompt:] for i in samples],
        old_logp=[lp() for _ in samples], ref_logp=[lp() for _ in samples], rollout_logp=[lp() for _ in samples],
        advantages=[torch.full((response,), float(torch.randn((), generator=gen))) for _ in samples])
    batch = {k: [t.to(device) for t in v] if isinstance(v, list) and v and isinstance(v[0], torch.Tensor)
             else v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    cat = lambda key: torch.cat(batch[key]).float()  # noqa: E731
    starts = torch.arange(rows, device=device)[:, None] * length
    resp_rows = (starts + torch.arange(prompt - 1, length - 1, device=device)).reshape(-1)
    inputs = LossInputs(old_logp=cat("log_probs"), ref_logp=cat("ref_log_probs"), advantages=cat("advantages"),
                        loss_mask=cat("loss_masks"), lengths=torch.full((rows,), response, device=device),
                        config=adapter.loss_config_from_args(vime_args()))
    return MicroBatch(ids.to(device), batch, inputs, resp_rows, ids.to(device).reshape(-1)[resp_rows + 1])


def vime_args():
    return standin.vime_args_standin(LOSS_FLAGS)


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    label: str
    forward: Callable[[torch.nn.Module, MicroBatch], Any]
    loss: Callable[[torch.nn.Module, MicroBatch, Any], torch.Tensor]
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # the kernel switches it runs under
    needs: str | None = None  # the module it imports, when not always installed

    def missing(self) -> str | None:
        """Why this arm cannot run here (its package is not installed), or None."""
        if self.needs is not None and importlib.util.find_spec(self.needs.split(".")[0]) is None:
            return f"arm {self.name} needs {self.needs} (not installed)"
        return None


def _kernels_env(backend: str) -> dict[str, str]:
    return {"VIME_RL_KERNEL": "1", "VIME_RL_KERNEL_BACKEND": backend, "VIME_RL_KERNEL_STRICT": "1",
            "VIME_RL_KERNEL_OPS": "*"}


@contextlib.contextmanager
def arm_environment(arm: Arm) -> Iterator[None]:
    """The arm's kernel switches, and every other kernel setting at its default (what a user of
    the kernels runs; the caller's own settings do not reach the arm), for the duration of the
    block; the previous values are restored after it."""
    from kernels import settings

    names = {s.name for s in settings.SETTINGS.values() if s.group == "kernels"} | set(arm.env)
    saved = {name: os.environ.get(name) for name in names}
    for name in names - set(arm.env):
        os.environ.pop(name, None)
    os.environ.update(arm.env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def logits_forward(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The model with its LM head: bf16 logits [B, L, V], packed and upcast to vime's fp32 [T, V]."""
    logits = model(input_ids=mb.input_ids).logits
    return logits.reshape(-1, logits.shape[-1]).float()


def hidden_forward(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The backbone only: the last hidden state (after the final norm) [T, H]."""
    hidden = model.model(input_ids=mb.input_ids).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


def _adapter_loss(model, mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
    sosm = standin.sum_of_sample_mean_standin(mb.vime["response_lengths"], mb.vime["loss_masks"])
    loss, _ = adapter.policy_loss(vime_args(), mb.vime, logits, sosm)
    return loss


def _grpo_loss(model, mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
    import kernels

    packed = pack_responses(mb.vime, logits)
    inputs = mb.loss_inputs
    loss, _ = kernels.grpo_loss(packed.logits, packed.target_ids, old_logp=inputs.old_logp, ref_logp=inputs.ref_logp,
                                advantages=inputs.advantages, loss_mask=inputs.loss_mask, lengths=inputs.lengths,
                                config=inputs.config, inplace_backward=True)
    return loss


def _head_rows(model, mb: MicroBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden.index_select(0, mb.response_rows), model.get_output_embeddings().weight


def _linear_logp_loss(model, mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
    import kernels

    h, weight = _head_rows(model, mb, hidden)
    inputs = mb.loss_inputs
    logp = kernels.linear_logp(h, weight, mb.target_ids)
    _, kl = kernels.ratio_kl(logp, inputs.old_logp, inputs.ref_logp, inputs.loss_mask, kl_type=inputs.config.kl_type)
    loss, _ = reference.reduce_grpo_loss(logp, inputs, inputs.lengths, kl=kl)
    return loss


def _liger_loss(model, mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
    from kernels.backends.liger import liger_linear_grpo_loss
    from kernels.contracts import LinearGrpoLossCall

    h, weight = _head_rows(model, mb, hidden)
    inputs = mb.loss_inputs
    call = LinearGrpoLossCall(h, weight, mb.target_ids, old_logp=inputs.old_logp, ref_logp=inputs.ref_logp,
                              advantages=inputs.advantages, loss_mask=inputs.loss_mask,
                              config=dataclasses.replace(inputs.config, kl_type="k3"))
    loss, _ = liger_linear_grpo_loss(call)
    return loss


def _trl_loss(model, mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
    function = importlib.import_module("trl.kernels").ChunkedLogProbFunction
    h, weight = _head_rows(model, mb, hidden)
    logp = function.apply(h, weight, None, mb.target_ids, 1.0, TRL_CHUNK_ROWS, None, 1.0, ())[0]
    loss, _ = reference.grpo_loss_from_logp(logp.float(), mb.loss_inputs)
    return loss


def vime_own_arm(vime_root: Path) -> Arm:
    """vime's own ``loss_function`` from the checkout at ``vime_root`` (one Megatron rank)."""
    from suites.module.vime import conformance

    conformance.init_single_rank_megatron()
    loss_module = conformance.use_vime_root(vime_root, conformance.LOSS_MODULE)
    args = conformance.vime_args(use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type="low_var_kl", eps_clip_high=0.2)

    def loss(model, mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        batch = dict(mb.vime, rollout_mask_sums=[m.sum() for m in mb.vime["loss_masks"]])
        rows = len(batch["response_lengths"])
        out, _normalizer, _log = loss_module.loss_function(args, batch, 1, rows, logits[None])
        return out

    return Arm("vime", f"vime's own loss_function ({vime_root})", logits_forward, loss)


def vime_path_arm(vime_root: Path | None) -> Arm:
    """vime's path: its own code with ``vime_root``, else the labelled fp32 reference of its math."""
    if vime_root is not None:
        return vime_own_arm(Path(vime_root))
    return Arm("vime_reference", "the fp32 reference of vime's math through our vime adapter (no vime checkout: "
               "not vime's code)", logits_forward, _adapter_loss, _kernels_env("reference"))


def our_and_peer_arms() -> dict[str, Arm]:
    """Our arms and the peers' by name."""
    return {arm.name: arm for arm in (
        Arm("rlk_logp_ratio_kl", "our logp + ratio_kl on the logits (the vime adapter)", logits_forward,
            _adapter_loss, _kernels_env("rlk-triton")),
        Arm("rlk_grpo_loss", "our grpo_loss on the logits, in-place backward", logits_forward, _grpo_loss,
            _kernels_env("rlk-triton")),
        Arm("rlk_linear_logp", "our linear_logp (no [T, V] logits) + ratio_kl", hidden_forward, _linear_logp_loss,
            _kernels_env("rlk-triton")),
        Arm("liger_fused_linear_grpo", "Liger's LigerFusedLinearGRPOLoss (k3, bnpo token mean)", hidden_forward,
            _liger_loss, needs="liger_kernel.chunked_loss"),
        Arm("trl_chunked_lm_head", f"TRL's ChunkedLogProbFunction (chunk {TRL_CHUNK_ROWS}) + vime's loss (fp32 "
            "reference)", hidden_forward, _trl_loss, needs="trl.kernels"),
    )}


VIME_PATH = "vime_path"  # the name that selects vime_path_arm


def arm_named(name: str, vime_root: Path | None = None) -> Arm:
    """The arm ``name`` (``vime_path``: :func:`vime_path_arm`)."""
    if name == VIME_PATH:
        return vime_path_arm(vime_root)
    arms = our_and_peer_arms()
    if name not in arms:
        raise KeyError(f"no capacity arm {name!r}; the arms: {[VIME_PATH, *arms]}")
    return arms[name]

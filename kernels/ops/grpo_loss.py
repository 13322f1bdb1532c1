"""vime's GRPO loss straight from logits: one read (a CUDA cluster kernel) or two (Triton kernels).

The op's arguments, shapes and checks: kernels/contracts/grpo_loss.py (``GrpoLossCall``); the math:
kernels/reference/grpo_loss.py; the Triton kernels: kernels/ops/grpo_loss_kernels.py (this module
launches them and holds the autograd function, the one-read path's choice and the host path).

Fused paths (single device, token-level ratio): every token's share of the loss is known before
the logits are read, because the reduction weights come from the mask alone
(``w_t = m_t / max(sum of m over t's sample, 1)`` for ``sum_of_sample_mean``, ``w_t = m_t`` for
``per_token_sum``; reference ``token_weights``). With ``c = dL/dlogp = w (dpg/dlogp + kl_coef
dkl/dlogp)`` formed per token in registers:

* **one read** (default where it applies: logits that need a gradient on a Hopper-or-newer GPU,
  16-byte aligned rows, nvcc available; see kernels/ops/cuda/grpo_loss_one_read.py): a CUDA
  thread-block-cluster kernel holds each row in the shared memory of a cluster of CTAs, reduces
  it once, and writes the loss terms and ``dlogits = c g (onehot - softmax) / T`` in the forward,
  for ``g`` the incoming gradient the last backward met on this device (a training loop scales its
  loss by the same factor every step; 1.0 at first): the logits are read once and dlogits written
  once. The backward hands that buffer out as the gradient when grad_output has exactly the
  predicted value (checked on the device, no host sync); otherwise a kernel rewrites the rows from
  the logits and the saved statistics with grad_output folded in, the same arithmetic (the same
  bits for the same gradient). A second backward through a retained graph writes fresh rows.
* **two reads** (the Triton path, everywhere else, and with ``RLK_GRPO_ONE_READ=0``): the forward
  sweeps each row once (online max / sum-exp) and stores [7, T] fp32 (the four metric terms, the
  unweighted coefficient, row max, sum-exp); the backward's dlogits kernel forms ``c = w coef`` and
  folds ``g`` (grad_output, read on the device) into it before the single rounding. Both kernels
  run at ~97-100% of HBM bandwidth; the logits are read twice.

Around either: one launch for the reduction weights (``_sample_mean_weights_kernel``) and one for
the four metrics and the loss (``_weighted_sums_kernel``, a fixed summation order), in place of
~15 small PyTorch kernels whose time adds up next to the main kernel's (docs/ncu.md).

Neither path has a [T, V] intermediate besides dlogits itself. The one-read path allocates dlogits
in the forward (its memory is held from the forward on, not from the backward on). Why Triton
alone cannot read once (the row must stay on chip between its two sweeps, and a 152k-entry bf16
row is larger than one multiprocessor's shared memory; Triton has no clusters): docs/performance-notes.md.

Under ``torch.compile`` the PyTorch operators (kernels/library/grpo_loss.py) run these kernels split
so that no [T, V] tensor lives between forward and backward: :func:`grpo_loss_stats` (the one-read
kernel with its statistics only) and :func:`grpo_loss_dlogits` (dlogits from the statistics for the
actual gradient: the eager bits, one more read of the logits on the one-read path).

``inplace_backward=True`` (opt-in; always the two-read path) writes dlogits into the logits buffer during the backward:
no extra [T, V] memory, but the logits' values are destroyed — use it only when nothing reads
the logits after the backward (the returned gradient aliases the logits storage; a second
backward through the same graph raises).

Host time: a launch-bound call (a few hundred tokens) is all host time. Once the Python path below
has run a call's kernels (compiled, launched, keyed), later calls of the common case (one read,
plain contiguous CUDA tensors, the usual dtypes; kernels/ops/host/grpo_loss_one_read.cpp says
which) take the host path: one C++ call that checks, allocates and launches the forward's three
kernels and attaches a C++ autograd node whose backward launches the write kernel, so neither
``grpo_loss(...)`` nor its ``.backward()`` enters Python past the contract and dispatch. Anything
else runs the Python path, the only one that decides and explains; :func:`host_path` says which
path serves calls now.

Composed path (GSPO, whose ratio needs the whole sample's logp first, and vocab-parallel TP):
the Triton ``logp`` op (kernels/ops/logp.py) followed by the reference loss math on [T] tensors;
its backward is the logp backward kernel. Same values, one more read of the logits.
"""

from __future__ import annotations

import logging

import torch

from kernels import device_errors, launch
from kernels.contracts import METRIC_NAMES, GrpoLossCall, entry_point
from kernels.contracts.grpo_loss import to_device
from kernels.launch import CachedLaunch
from kernels.ops.cuda import grpo_loss_one_read as one_read_kernel
from kernels.ops.grpo_loss_kernels import (
    _grpo_dlogits_kernel,
    _grpo_loss_kernel,
    _token_weights_kernel,
    _weighted_sums_kernel,
)
from kernels.ops.host import HostModule
from kernels.ops.logp import LogpFunction, vocab_block
from kernels.ops.ratio_kl import kl_type_code
from kernels.reference.grpo_loss import reduce_grpo_loss

logger = logging.getLogger("kernels")
_two_read_reasons_logged: set[str] = set()


REDUCE_BLOCK = 1024
# _weighted_sums_kernel is one program: 4096 tokens per step over 16 warps keep enough loads in
# flight that a large T takes one or two steps (docs/performance-notes.md)
SUMS_BLOCK, SUMS_WARPS = 4096, 16
_GRPO_LOSS = CachedLaunch(_grpo_loss_kernel)
_TOKEN_WEIGHTS = CachedLaunch(_token_weights_kernel)
_WEIGHTED_SUMS = CachedLaunch(_weighted_sums_kernel)
_GRPO_DLOGITS = CachedLaunch(_grpo_dlogits_kernel)
_HOST = HostModule("grpo_loss_one_read")


def fused_token_weights(loss_mask: torch.Tensor, lengths: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                        reduction: str, call_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.reductions.token_weights in one launch (one program per sample), the
    packing checked on the device (a report under ``call_id``, kernels/device_errors.py);
    written into ``out`` (fp32 [T]) if given."""
    return _token_weights(loss_mask, lengths, cu_seqlens, reduction, call_id, out)[0]


def _token_weights(loss_mask: torch.Tensor, lengths: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                   reduction: str, call_id: int, out: torch.Tensor | None) -> tuple[torch.Tensor, tuple | None]:
    """(:func:`fused_token_weights`, ``native_launch`` of the kernel it ran or None)."""
    num_tokens = loss_mask.shape[0]
    weights = torch.empty(num_tokens, dtype=torch.float32, device=loss_mask.device) if out is None else out
    word = device_errors.word_for(loss_mask.device)
    if lengths is not None:
        offsets, kind, samples = to_device(lengths, loss_mask.device), 1, lengths.shape[0]
    elif cu_seqlens is not None:
        offsets, kind, samples = to_device(cu_seqlens, loss_mask.device), 2, cu_seqlens.shape[0] - 1
    else:
        offsets, kind, samples = loss_mask, 0, 1  # no offsets read
    native = _TOKEN_WEIGHTS.launch_native(
        (samples,), loss_mask, offsets, weights, word.tensor, num_tokens, samples, call_id,
        OFFSETS=kind, PER_TOKEN=reduction != "sum_of_sample_mean", BLOCK=REDUCE_BLOCK)
    return weights, native


def one_read_plan(logits: torch.Tensor) -> one_read_kernel.OneReadPlan | str:
    """The one-read kernel's plan for these logits, or why the two-read path runs (logged once per
    reason at INFO: it is a documented path with the same values, not a fallback)."""
    found = one_read_kernel.plan(logits)
    if isinstance(found, str) and found not in _two_read_reasons_logged:
        _two_read_reasons_logged.add(found)
        logger.info("kernels: grpo_loss runs the two-read Triton path: %s", found)
    return found


class GrpoLossFunction(torch.autograd.Function):
    """Forward: the per-row statistics and loss kernel, or the one-read cluster kernel that also writes
    dlogits for a predicted incoming gradient; backward: the two-read dlogits kernel, or (one read)
    the write kernel, which rewrites the rows only when the actual gradient is not the predicted one.

    Which gradient the one-read forward writes dlogits for: the loss's gradient is known only in
    the backward, and a training step scales the loss (vime's ``loss_function`` multiplies it by
    ``num_microbatches / global_batch_size * dp_size`` for Megatron), the same factor every step.
    The forward predicts the last backward's gradient (kernels/device_errors.py, word 3: the write
    kernel stores it there; 1.0 before any backward) and folds it into the rows it writes; the
    backward's write kernel compares the actual gradient, on the device, with the prediction: equal,
    the forward's rows are the gradient (two passes over [T, V] in all); otherwise it writes them
    again from the saved statistics with the actual gradient (four passes, once per change of the
    gradient). The same arithmetic, c = (w coef) g, either way: the same bits for the same gradient."""

    @staticmethod
    def forward(ctx, logits, call):  # type: ignore[override]
        # the call (kernels/contracts/grpo_loss.py) rides along as one argument: autograd looks at
        # each argument of apply, and only the logits are differentiated (host time of every call)
        inplace = call.inplace_backward
        plan = one_read_plan(logits) if ctx.needs_input_grad[0] and not inplace else None
        if isinstance(plan, one_read_kernel.OneReadPlan):
            # one read: the cluster kernel writes the loss terms and dlogits for the predicted gradient now
            grad_pred = device_errors.word_for(logits.device).last_grad()
            forward_grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        else:
            plan, forward_grad, grad_pred = None, None, 1.0
        loss, metrics, per_token, (weights_native, one_read, sums_native) = _forward_kernels(
            logits, call, plan, forward_grad, grad_pred)
        if one_read is not None and weights_native is not None and sums_native is not None:
            _register_forward(call, weights_native, plan, one_read, sums_native)
        ctx.one_read = plan is not None
        ctx.forward_grad, ctx.grad_pred = forward_grad, grad_pred
        ctx.residual = per_token[4:]
        ctx.temperature, ctx.ignore_index, ctx.inplace = call.temperature, call.ignore_index, inplace
        ctx.backward_done = False
        ctx.host_path = one_read is not None  # a common case registers its backward kernel too
        # saving the logits costs no memory (the caller's graph holds them); the backward reads them once
        ctx.save_for_backward(logits, call.target_ids)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):  # type: ignore[override]
        if ctx.backward_done and ctx.inplace:
            raise RuntimeError("grpo_loss backward ran twice with inplace_backward=True: the logits were "
                               "overwritten by the first one")
        ctx.backward_done = True
        logits, ids = ctx.saved_tensors
        grad_output = grad_loss.reshape(1)
        if not ctx.one_read:
            coef, row_max, sumexp, weights = ctx.residual.unbind(0)
            return _dlogits(logits, ids, weights, (coef, row_max, sumexp), grad_output, ctx.temperature,
                            ctx.ignore_index, ctx.inplace), None
        # the forward's rows are handed out once (autograd may keep them as .grad); a second backward
        # through a retained graph writes fresh ones
        grad, ctx.forward_grad = ctx.forward_grad, None
        if grad is None:
            return _fresh_dlogits(logits, ids, ctx.residual, grad_output, ctx.temperature), None
        launched = _write_dlogits(logits, ids, ctx.residual, grad_output, grad, ctx.grad_pred, ctx.temperature)
        if ctx.host_path and launched is not None:
            _register_backward(logits, launched)
        return grad, None


def _forward_kernels(logits: torch.Tensor, call: GrpoLossCall, plan: one_read_kernel.OneReadPlan | None,
                     grad: torch.Tensor | None, grad_pred: float = 1.0):
    """The forward's launches: the reduction weights, then the one-read cluster kernel (``plan``;
    it writes dlogits for the incoming gradient ``grad_pred`` into ``grad``, or with ``grad=None``
    the statistics only) or the two-read statistics kernel, then the metrics and the loss.

    Returns (loss fp32 [], metrics fp32 [4], per_token fp32 [8, T]: the kernels' rows 0-6 (see
    _grpo_loss_kernel) and the weights in row 7, the host path's (weights, one-read, sums) launches
    (None where a kernel has none))."""
    ids, config, temperature, ignore_index = call.target_ids, call.config, call.temperature, call.ignore_index
    old_logp, ref_logp, advantages, rollout_logp = (
        f32(call.old_logp), f32(call.ref_logp), f32(call.advantages), f32(call.rollout_logp))
    call_id = call.deferred
    num_tokens, vocab = logits.shape
    per_token = torch.empty((8, num_tokens), dtype=torch.float32, device=logits.device)
    has_ref = ref_logp is not None
    weights, weights_native = _token_weights(call.loss_mask, call.lengths, call.cu_seqlens, config.reduction,
                                             call_id, per_token[7])
    one_read = None
    if plan is not None:
        one_read = one_read_kernel.launch(
            plan, logits, grad, ids if ids.dtype == torch.int64 else ids.to(torch.int64), old_logp,
            ref_logp, advantages, rollout_logp, weights, per_token, config, float(temperature),
            ignore_index, kl_type_code(config.kl_type), device_errors.word_for(logits.device).ptr, call_id, grad_pred,
        )
    else:
        block, warps = vocab_block(vocab, logits.dtype, read_only=True)
        _GRPO_LOSS.launch(
            (num_tokens,), logits, ids, old_logp, ref_logp if has_ref else old_logp, advantages,
            rollout_logp if config.use_tis else old_logp, per_token, device_errors.word_for(logits.device).tensor,
            logits.stride(0), num_tokens, vocab, ignore_index, float(temperature),
            float(config.eps_clip), float(config.eps_clip_high), float(config.eps_clip_c or 0.0),
            float(config.tis_clip_low), float(config.tis_clip_high), float(config.kl_loss_coef), call_id,
            BLOCK_V=block, SCALE=temperature != 1.0, HAS_REF=has_ref,
            KL_TYPE=kl_type_code(config.kl_type), UNBIASED=config.use_unbiased_kl,
            DUAL_CLIP=config.eps_clip_c is not None, TIS=config.use_tis, num_warps=warps,
        )
    # [4]: pg_loss, pg_clipfrac, ppo_kl, kl_loss, and the loss, in one launch
    metrics = torch.empty(4, dtype=torch.float32, device=logits.device)
    loss = torch.empty((), dtype=torch.float32, device=logits.device)
    sums_native = _WEIGHTED_SUMS.launch_native(
        (1,), per_token, weights, metrics, loss, num_tokens, float(config.kl_loss_coef),
        HAS_KL=config.kl_loss_coef != 0.0, BLOCK=SUMS_BLOCK, num_warps=SUMS_WARPS,
    )
    return loss, metrics, per_token, (weights_native, one_read, sums_native)


def _dlogits(logits, ids, weights, row_stats, grad_output, temperature, ignore_index, inplace):
    """The two-read backward's dlogits: fresh rows (the logits' buffer when ``inplace``)."""
    coef, row_max, sumexp = row_stats
    grad = logits.detach() if inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
    num_tokens, vocab = logits.shape
    block, warps = vocab_block(vocab, logits.dtype)
    _GRPO_DLOGITS.launch(
        (num_tokens,), logits, grad, ids, weights, coef, grad_output, row_max, sumexp,
        logits.stride(0), grad.stride(0), vocab, ignore_index, float(temperature),
        BLOCK_V=block, SCALE=temperature != 1.0, num_warps=warps,
    )
    return grad


def _write_dlogits(logits, ids, residual, grad_output, grad, expected, temperature):
    """The one-read backward's dlogits into ``grad`` from the residual (per_token rows 4-7: coef, row
    max, sum-exp, weights) for grad_output (fp32 [1], read on the device): the write kernel, which
    returns at once when grad_output is ``expected`` (the gradient the forward wrote ``grad`` for;
    None: a fresh ``grad``, always written) and stores grad_output in the device's word 3 for the
    next forward's prediction. Returns the launch (for the host path) or None."""
    coef, row_max, sumexp, weights = residual.unbind(0)
    if grad_output.dtype != torch.float32:
        grad_output = grad_output.to(torch.float32)
    return one_read_kernel.write_from_stats(
        logits, grad, ids if ids.dtype == torch.int64 else ids.to(torch.int64), weights, coef, row_max, sumexp,
        grad_output, float(temperature), expected, device_errors.word_for(logits.device).last_grad_ptr)


def _fresh_dlogits(logits, ids, residual, grad_loss, temperature):
    """dlogits for ``grad_loss`` into fresh rows, always written: a backward without the forward's
    rows (a second backward through a retained graph, GrpoLossFunction's or the host path's node,
    which calls this; the compiled operators' backward)."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _write_dlogits(logits, ids, residual, grad_loss.reshape(1), grad, None, temperature)
    return grad


def _host_module():
    """The host path's module when the fast path may run now and it can be built (else None, as
    while ``_HOST.off()``); the first time, it learns the metrics' names and the second backward's
    function."""
    if launch.fast_path_now() is None:
        return None
    module = _HOST.registry()  # built on the first registration; None (said once) if it cannot be
    if module is not None and _HOST.forward is None:
        module.configure(METRIC_NAMES, _fresh_dlogits)
    return module


def _register_forward(call, weights_native, plan, one_read, sums_native) -> None:
    """Give the host path the forward kernels this call just launched (each under its own key, which
    must tell apart what Triton specializes: LaunchKeyError if one maps two kernels onto one key)."""
    module = _host_module()
    if module is not None:
        word = device_errors.word_for(call.logits.device).ptr
        one_read_native = (one_read.handle.value, plan.cluster, plan.slice, one_read_kernel.THREADS,
                           plan.shared_bytes)
        _HOST.registered(module.register_forward(call, weights_native, one_read_native, sums_native, word),
                         "this call's forward kernels")


def _register_backward(logits, launched: one_read_kernel.WriteLaunch) -> None:
    """Give the host path the write kernel this backward just launched (under its key: device,
    dtype and V)."""
    module = _host_module()
    if module is not None:
        write_native = (launched.function, launched.ctas, launched.threads, launched.shared_bytes,
                        launched.blocks_per_row, launched.block_cols)
        _HOST.registered(module.register_backward(logits, write_native), "this call's write kernel")


def host_path() -> str:
    """Which path common-case calls take now: ``c++`` (the host path holds kernels; its module's
    ``served()`` counts the calls it took), or ``python`` and why not (for benchmark tags)."""
    return _HOST.path_label()


def grpo_loss_call(call: GrpoLossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's GRPO loss on the fused paths above (composed for GSPO and vocab-parallel TP); the host
    path first."""
    host_forward = _HOST.forward
    if host_forward is not None and launch.fast_path_now() is not None and one_read_kernel.enabled():
        out = host_forward(call)
        if out is not None:
            return out
    logits, num_tokens = call.logits, call.num_tokens
    if call.config.gspo or call.tp_group is not None:
        if call.deferred and (call.lengths is not None or call.cu_seqlens is not None):
            # the packing's check on the device (the weights themselves are not used here)
            fused_token_weights(call.loss_mask, call.lengths, call.cu_seqlens, call.config.reduction, call.deferred)
        logp = LogpFunction.apply(logits, call.target_ids, call.temperature, call.ignore_index, call.tp_group,
                                  call.deferred)
        return reduce_grpo_loss(logp, call, call.sample_lengths(num_tokens, logits.device))
    loss, metrics = GrpoLossFunction.apply(logits, call)
    return loss, dict(zip(METRIC_NAMES, metrics.unbind(0), strict=False))


def f32(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` as fp32 contiguous (itself when it is already)."""
    if x is None or (x.dtype == torch.float32 and x.is_contiguous()):
        return x
    return x.to(torch.float32).contiguous()


grpo_loss = entry_point(GrpoLossCall, grpo_loss_call, name="grpo_loss", checks_values=True)


def grpo_loss_stats(call: GrpoLossCall, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss fp32 [], metrics fp32 [4] in METRIC_NAMES order, residual fp32 [4, T] with
    ``needs_grad``, else [4, 0], rows 4-7 of an [8, T] buffer) of a fused-path call (no GSPO, no ``tp_group``, no
    ``inplace_backward``), without autograd and without dlogits: GrpoLossFunction's forward kernels,
    the one-read cluster kernel (where it applies) with its statistics only. The residual's rows
    are what :func:`grpo_loss_dlogits` reads: the unweighted coefficient, row max, sum-exp and the
    reduction weights. The PyTorch operator's forward (kernels/library/grpo_loss.py) returns these."""
    plan = one_read_plan(call.logits) if needs_grad else None
    plan = plan if isinstance(plan, one_read_kernel.OneReadPlan) else None
    loss, metrics, per_token, _ = _forward_kernels(call.logits, call, plan, None)
    return loss, metrics, per_token[4:] if needs_grad else per_token.new_empty((8, 0))[4:]


def grpo_loss_dlogits(logits: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor, grad_loss: torch.Tensor,
                      temperature: float, ignore_index: int) -> torch.Tensor:
    """dlogits [T, V] (contiguous, the logits dtype) for the loss gradient ``grad_loss`` (fp32 [] on
    the logits' device, read there: no host sync) from :func:`grpo_loss_stats`'s residual: the
    eager backward's kernels and bits. Two reads: the dlogits kernel with grad_output folded in.
    One read: the write kernel from the saved statistics with the gradient folded in (the eager
    call's dlogits for that gradient, bit for bit), into a fresh buffer."""
    residual = residual.contiguous()
    grad_output = grad_loss.to(torch.float32).reshape(1)
    if isinstance(one_read_plan(logits), one_read_kernel.OneReadPlan):
        return _fresh_dlogits(logits, ids, residual, grad_output, temperature)
    coef, row_max, sumexp, weights = residual.unbind(0)
    return _dlogits(logits, ids, weights, (coef, row_max, sumexp), grad_output, temperature, ignore_index, False)

"""Selected log-prob from logits: Triton kernels + autograd (single device and vocab-parallel).

The op's arguments, shapes and checks: kernels/contracts/logp.py (``LogpCall``);
``logp_t = z_{t,id} - logsumexp(z_t)``, ``z = logits / temperature``.

Forward: one program per row reads the row once in vocab tiles with an online max / sum-exp
(no [T, V] intermediate); it stores the row max ``m`` and ``S`` (fp32 [T]) for the backward
(``STATS``; a call with nothing to differentiate stores the log-prob only).
Backward: one program per row recomputes ``softmax = exp(z - m) / S`` tile by tile and writes
``dlogits = g * (onehot - softmax) / temperature`` once, in the logits dtype (fp32 math, one
rounding at the store).

Vocab-parallel (``tp_group``): logits are ``[T, V_local]``, this rank owning global ids
``[rank * V_local, (rank + 1) * V_local)``. The kernel emits per-row local max, local sum-exp and
the target partial (non-zero only on the owning rank); three all-reduces of T fp32 values (MAX,
SUM, SUM) give the global ``m``, ``S`` and ``logp``; the backward is the same kernel as above with
the global ``m`` and ``S`` and the shard-local target id (or none).

Temperature: ``z = logits / temperature`` uses IEEE division (``div_rn``), as vime's
``logits / T`` does; multiplying by ``1 / T`` instead changes z by an ulp, which the softmax turns
into ~1e-6 gradient errors at |z| ~ 20. ``temperature == 1`` skips the division (constexpr).

Row invariance: a row is reduced by one program over tiles in a fixed order, and the tile size
depends only on V and the dtype, so a row's results do not depend on T, its position or padding.
Rows whose id equals ``ignore_index`` give logp 0 and a zero gradient.

Host time: small calls are launch-bound, so the kernels launch through ``kernels.launch``
(Triton's Python launcher skipped on repeat calls) and a call with nothing to differentiate skips
``autograd.Function`` and makes one [T] allocation. Once the Python path below has launched (so
compiled and registered) the kernels for a key, single-device common-case calls (plain contiguous
CUDA logits, int64 ids; kernels/ops/host/logp_single_device.cpp says which) take the host path: one
C++ call that checks, allocates and launches the forward, with a C++ autograd node whose backward
launches the backward kernel, so neither pass enters Python. Everything else runs the Python path,
the only one that decides and explains; :func:`host_path` says which path calls take. The public
``kernels.logp`` asks the host path with its raw arguments (:func:`host_first`, offered by the
backend) before it builds, checks and dispatches the call.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels import device_errors, launch
from kernels.contracts import LogpCall, entry_point
from kernels.contracts.checks import IGNORE_INDEX, defer_value_check, finite_check_enabled
from kernels.launch import CachedLaunch
from kernels.ops.exp2 import LOG2E, exp2_correction
from kernels.ops.host import HostModule
from kernels.ops.value_checks import INPUT_TARGET_IDS, bad_target, report_bad_value


def vocab_block(vocab: int, dtype: torch.dtype, *, read_only: bool = False) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of ``vocab`` elements; a function of V and dtype only.

    ``read_only=True`` (the forward's statistics sweep) gives 16-bit tiles 4 warps instead of 8: a
    read-only sweep keeps more rows in flight that way and comes closer to the HBM read limit; the
    write sweeps (backward) keep 8 (measurements: docs/performance-notes.md)."""
    cap = 4096 if dtype == torch.float32 else 8192
    block = min(cap, triton.next_power_of_2(vocab))
    num_warps = 8 if block >= 4096 else 4
    if read_only and dtype != torch.float32:
        num_warps = 4
    return block, num_warps


@functools.lru_cache(maxsize=None)
def _forward_block(vocab: int, dtype: torch.dtype) -> tuple[int, int]:
    """``vocab_block(vocab, dtype, read_only=True)``, memoized (host time of small calls)."""
    return vocab_block(vocab, dtype, read_only=True)


@triton.jit
def row_max_sumexp(row_ptr, vocab, temperature, BLOCK_V: tl.constexpr, SCALE: tl.constexpr):
    """Online max and sum of exp over one row: returns (m, S) with S = sum exp(z - m).

    exp(z - m) is formed as exp2(fma(z, log2e, -h)) with h = m * log2e rounded: one FFMA per
    element where exp's own lowering takes an FADD and an FMUL, which is what the forward's
    16-bit sweeps are short of (5-6% faster on the H200: docs/performance-notes.md). Every term
    then carries the factor 2**(m log2e - h); the residual m log2e - h is exact in one FMA, and each
    tile's sum is multiplied by 1 - residual * ln 2, so S keeps no bias from h's rounding."""
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        z = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if SCALE:
            z = tl.math.div_rn(z, temperature)
        m_new = tl.maximum(m, tl.max(z, 0))
        h = m_new * LOG2E
        tile = tl.sum(tl.exp2(tl.fma(z, LOG2E, -h)), 0) * exp2_correction(m_new, h)
        # the running sum's rescale is exp(0) = 1 exactly while the max holds: an exp2 of the tiny
        # residual there would carry ex2's own rounding into S once per tile (~4e-6 over 38 tiles)
        s = s * tl.exp(m - m_new) + tile
        m = m_new
    return m, s


@triton.jit
def row_target(row_ptr, target_id, vocab_start, vocab, temperature, SCALE: tl.constexpr):
    """(owned, z_target): whether this shard owns ``target_id`` and its scaled logit (0 if not)."""
    local = target_id - vocab_start
    owned = (local >= 0) & (local < vocab)
    z_t = tl.load(row_ptr + local, mask=owned, other=0.0).to(tl.float32)
    if SCALE:
        z_t = tl.math.div_rn(z_t, temperature)
    return owned, z_t


@triton.jit
def row_write_grad(
    row_ptr, grad_row_ptr, coef, row_max, sumexp, local_target, vocab, temperature,
    BLOCK_V: tl.constexpr, SCALE: tl.constexpr,
):
    """grad_row = coef * (onehot(local_target) - exp(z - m) / S) [/ temperature], in grad's dtype.

    The softmax is formed as exp(z - m) * (coef / S), the order of the reference's autograd;
    exp(z - lse) would carry lse's rounding (an ulp of ~20) into every probability. exp(z - m) is
    exp2(fma(z, log2e, -h)) as in :func:`row_max_sumexp`; the factor 2**(m log2e - h) each term
    carries comes out of coef / S once per row."""
    offs = tl.arange(0, BLOCK_V)
    if SCALE:
        coef = tl.math.div_rn(coef, temperature)
    h = row_max * LOG2E
    coef_over_s = tl.math.div_rn(coef, sumexp) * exp2_correction(row_max, h)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offs
        in_row = cols < vocab
        z = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        if SCALE:
            z = tl.math.div_rn(z, temperature)
        d = tl.where(cols == local_target, coef, 0.0) - tl.exp2(tl.fma(z, LOG2E, -h)) * coef_over_s
        tl.store(grad_row_ptr + cols, d.to(grad_row_ptr.dtype.element_ty), mask=in_row)


@triton.jit(do_not_specialize=["call_id"])
def _logp_fwd_kernel(
    logits_ptr, ids_ptr, out_ptr, max_ptr, sumexp_ptr, err_ptr,
    stride_row, vocab, vocab_start, id_bound, ignore_index, temperature, call_id,
    BLOCK_V: tl.constexpr, SCALE: tl.constexpr, PARTIAL: tl.constexpr, STATS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target_id = tl.load(ids_ptr + row).to(tl.int64)
    m, s = row_max_sumexp(row_ptr, vocab, temperature, BLOCK_V, SCALE)
    owned, z_t = row_target(row_ptr, target_id, vocab_start, vocab, temperature, SCALE)
    ignored = target_id == ignore_index
    # an id outside the (global) vocab: the row's log-prob is NaN and the error word gets a report
    bad = bad_target(target_id, ignore_index, id_bound)
    if bad:
        report_bad_value(err_ptr, call_id, INPUT_TARGET_IDS, row, target_id, id_bound)
    if STATS:
        tl.store(max_ptr + row, m)
        tl.store(sumexp_ptr + row, s)
    if PARTIAL:
        # vocab-parallel: local statistics; the target partial is z_t on the owning shard only
        out = tl.where(owned & (~ignored), z_t, 0.0)
    else:
        out = tl.where(ignored, 0.0, (z_t - m) - tl.log(s))
    tl.store(out_ptr + row, tl.where(bad, float("nan"), out))


@triton.jit
def _logp_bwd_kernel(
    logits_ptr, grad_logits_ptr, ids_ptr, grad_out_ptr, max_ptr, sumexp_ptr,
    stride_row, stride_grad_row, vocab, vocab_start, ignore_index, temperature,
    BLOCK_V: tl.constexpr, SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target_id = tl.load(ids_ptr + row).to(tl.int64)
    ignored = target_id == ignore_index
    g = tl.where(ignored, 0.0, tl.load(grad_out_ptr + row).to(tl.float32))
    row_write_grad(
        logits_ptr + row * stride_row, grad_logits_ptr + row * stride_grad_row, g,
        tl.load(max_ptr + row), tl.load(sumexp_ptr + row),
        target_id - vocab_start, vocab, temperature, BLOCK_V, SCALE,
    )


_FWD = CachedLaunch(_logp_fwd_kernel)
_BWD = CachedLaunch(_logp_bwd_kernel)
_HOST = HostModule("logp_single_device")


def _launch_fwd(logits, ids, temperature, ignore_index, vocab_start, partial, stats=True, call_id=0, id_bound=None):
    """(logp or its TP partial, row max, sum-exp), fp32 [T] each. ``stats=False`` (nothing to
    differentiate): one [T] allocation, passed for the unused statistics pointers too (``STATS=False``
    compiles their stores out); the three returned tensors are then the same one.

    ``temperature`` (float) and ``ignore_index`` / ``vocab_start`` (int) must be Python numbers.
    Ids outside ``[0, id_bound)`` (default V) other than ignore_index give NaN and a report under
    ``call_id`` in the device's error word (kernels/device_errors.py; 0: a call checked on the host).
    The launch key holds everything Triton specializes this kernel on: the inputs' dtypes,
    16-byte alignment, device and type; the outputs are fresh fp32 allocations (aligned; the
    statistics rows of the [3, T] buffer when T % 4 == 0); the ints by value; the constexprs
    follow from the rest (checked under ``RLK_VERIFY_LAUNCH_KEYS=1``, see kernels/launch.py). A
    single-device launch that keeps its kernel registers it with the host path."""
    num_tokens, vocab = logits.shape
    # one allocation for the [T] outputs (host time: small calls are launch-bound)
    if stats:
        out, row_max, row_sumexp = torch.empty((3, num_tokens), dtype=torch.float32, device=logits.device).unbind()
    else:
        out = row_max = row_sumexp = torch.empty(num_tokens, dtype=torch.float32, device=logits.device)
    if id_bound is None:
        id_bound = vocab
    word = device_errors.word_for(logits.device)
    logits_ptr, ids_ptr, out_ptr = logits.data_ptr(), ids.data_ptr(), out.data_ptr()
    stride = logits.stride(0)
    # call_id is not specialized on (do_not_specialize): it stays out of the key; the error word's
    # pointer is fixed per device (the key's device); the statistics rows start 4 T and 8 T bytes in
    key = (type(logits), type(ids), logits.get_device(), logits.dtype, ids.dtype, logits_ptr % 16 == 0,
           ids_ptr % 16 == 0, stats and num_tokens % 4 == 0, stats and num_tokens % 2 == 0, vocab, stride,
           vocab_start, id_bound, ignore_index, temperature != 1.0, partial, stats)
    direct = _FWD.direct(key)
    if direct is not None:
        # the statistics rows of the [3, T] buffer, or (no statistics) the one [T] output again
        row_max_ptr, sumexp_ptr = (out_ptr + 4 * num_tokens, out_ptr + 8 * num_tokens) if stats else (out_ptr, out_ptr)
        direct(num_tokens, logits_ptr, ids_ptr, out_ptr, row_max_ptr, sumexp_ptr, word.ptr, stride, vocab,
               vocab_start, id_bound, ignore_index, temperature, call_id)
        return out, row_max, row_sumexp
    block, warps = _forward_block(vocab, logits.dtype)
    cache_key = _FWD.launch_keyed(
        key, (num_tokens,), logits, ids, out, row_max, row_sumexp, word.tensor, stride, vocab, vocab_start,
        id_bound, ignore_index, temperature, call_id, BLOCK_V=block, SCALE=temperature != 1.0, PARTIAL=partial,
        STATS=stats, num_warps=warps,
    )
    native = None if cache_key is None or partial else _FWD.native_launch(cache_key)
    if native is not None:
        module = _HOST.registry()  # built on the first registration; None (said once) if it cannot be
        if module is not None:
            _HOST.registered(module.register_forward(logits, ids, row_max, row_sumexp, temperature, ignore_index,
                                                     stats, native, word.ptr), "this call's forward kernel")
    return out, row_max, row_sumexp


def launch_logp_backward(
    logits: torch.Tensor, grad_logits: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor,
    row_max: torch.Tensor, sumexp: torch.Tensor, temperature: float, ignore_index: int, vocab_start: int = 0,
) -> torch.Tensor:
    """Write ``grad_out * (onehot - softmax) / temperature`` into ``grad_logits`` (may be ``logits``);
    ``row_max`` / ``sumexp``: the (global) row max and sum of exp(z - max), fp32 [T]."""
    _launch_bwd(logits, grad_logits, ids, grad_out, row_max, sumexp, temperature, ignore_index, vocab_start)
    return grad_logits


def _launch_bwd(logits, grad_logits, ids, grad_out, row_max, sumexp, temperature, ignore_index, vocab_start):
    """:func:`launch_logp_backward`; returns ``native_launch`` of the kernel it ran, or None."""
    num_tokens, vocab = logits.shape
    block, warps = vocab_block(vocab, logits.dtype)
    return _BWD.launch_native(
        (num_tokens,), logits, grad_logits, ids, grad_out, row_max, sumexp,
        logits.stride(0), grad_logits.stride(0), vocab, vocab_start, ignore_index, float(temperature),
        BLOCK_V=block, SCALE=temperature != 1.0, num_warps=warps,
    )


def logp_forward_stats(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, ignore_index: int,
    tp_group: dist.ProcessGroup | None, call_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(logp, row max, sum-exp, vocab_start) without autograd; the max and sum-exp (fp32 [T]) are
    global over the TP group and are what the backward needs. Bad ids: NaN rows and a report under
    ``call_id`` (kernels/device_errors.py)."""
    if tp_group is None:
        logp, row_max, sumexp = _launch_fwd(logits, ids, temperature, ignore_index, 0, partial=False,
                                            call_id=call_id)
        return logp, row_max, sumexp, 0
    vocab_start = dist.get_rank(tp_group) * logits.shape[1]
    target, local_max, local_sumexp = _launch_fwd(
        logits, ids, temperature, ignore_index, vocab_start, partial=True, call_id=call_id,
        id_bound=logits.shape[1] * dist.get_world_size(tp_group))
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    sumexp = local_sumexp * torch.exp(local_max - global_max)
    dist.all_reduce(sumexp, op=dist.ReduceOp.SUM, group=tp_group)
    dist.all_reduce(target, op=dist.ReduceOp.SUM, group=tp_group)
    logp = torch.where(ids == ignore_index, torch.zeros_like(target), (target - global_max) - torch.log(sumexp))
    return logp, global_max, sumexp, vocab_start


class LogpFunction(torch.autograd.Function):
    """Autograd wrapper: forward kernel (+ all-reduces under TP), backward kernel."""

    @staticmethod
    def forward(ctx, logits, ids, temperature, ignore_index, tp_group, call_id=0):  # type: ignore[override]
        logp, row_max, sumexp, vocab_start = logp_forward_stats(logits, ids, temperature, ignore_index, tp_group,
                                                                call_id)
        ctx.save_for_backward(logits, ids, row_max, sumexp)
        ctx.temperature, ctx.ignore_index, ctx.vocab_start = temperature, ignore_index, vocab_start
        return logp

    @staticmethod
    def backward(ctx, grad_logp):  # type: ignore[override]
        logits, ids, row_max, sumexp = ctx.saved_tensors
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad_logp = grad_logp.contiguous()
        native = _launch_bwd(logits, grad_logits, ids, grad_logp, row_max, sumexp, ctx.temperature, ctx.ignore_index,
                             ctx.vocab_start)
        module = _HOST.registry() if native is not None and ctx.vocab_start == 0 else None
        if module is not None:
            # the single-device case: the host path's node launches this kernel for later calls
            _HOST.registered(module.register_backward(logits, ids, grad_logp, row_max, sumexp, ctx.temperature,
                                                      ctx.ignore_index, native), "this call's backward kernel")
        return grad_logits, None, None, None, None, None


def host_path() -> str:
    """Which path common-case calls take now: ``c++`` (the host path holds kernels; its module's
    ``served()`` counts the calls it took), or ``python`` and why not (for benchmark tags)."""
    return _HOST.path_label()


class _HostFirstCall:
    """What the C++ host path reads off a ``LogpCall``, for :func:`host_first`'s raw arguments."""

    __slots__ = ("deferred", "ignore_index", "logits", "target_ids", "temperature", "tp_group")

    def __init__(self, logits, target_ids, temperature: float, ignore_index: int, deferred: int) -> None:
        self.logits, self.target_ids, self.temperature = logits, target_ids, temperature
        self.ignore_index, self.deferred, self.tp_group = ignore_index, deferred, None


def host_first(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    tp_group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor | None:
    """``LogpCall``'s arguments -> the log-prob from the C++ host path, or None where it declines (the
    caller then builds and checks the call). The host path checks the layout it relies on (a subset
    of the contract's); what the contract decides beyond it is decided here as the contract does:
    the ids checked by the kernels (``defer_value_check``: device ids, ``VIME_RL_KERNEL_CHECK_IDS``
    on), no finite check asked for, a finite float temperature > 0, an int ignore_index, no TP
    group; an earlier call's device report is raised first. The call id is taken before the host
    path decides: one it declines leaves an unused id."""
    host_forward = _HOST.forward
    if (host_forward is None or tp_group is not None or type(logits) is not torch.Tensor
            or type(target_ids) is not torch.Tensor or type(temperature) is not float
            or not 0.0 < temperature < math.inf or type(ignore_index) is not int):
        return None
    shape = logits.shape
    if len(shape) != 2 or launch.fast_path_now() is None or not defer_value_check(target_ids) or finite_check_enabled():
        return None
    device_errors.raise_if_reported(logits.device)
    call_id = device_errors.begin_call("logp", shape[0], shape[1])
    return host_forward(_HostFirstCall(logits, target_ids, temperature, ignore_index, call_id))


def logp_call(call: LogpCall) -> torch.Tensor:
    """Selected log-prob on the Triton kernels: fp32 [T], differentiable w.r.t. ``logits``; the host
    path first."""
    host_forward = _HOST.forward
    if host_forward is not None and launch.fast_path_now() is not None:
        out = host_forward(call)
        if out is not None:
            return out
    logits, target_ids, temperature, ignore_index = call.logits, call.target_ids, call.temperature, call.ignore_index
    if not (logits.requires_grad and torch.is_grad_enabled()):
        # nothing to differentiate: skip autograd.Function's bookkeeping (host time of small calls)
        if call.tp_group is None:
            return _launch_fwd(logits, target_ids, temperature, ignore_index, 0, False, stats=False,
                               call_id=call.deferred)[0]
        return logp_forward_stats(logits, target_ids, temperature, ignore_index, call.tp_group, call.deferred)[0]
    return LogpFunction.apply(logits, target_ids, temperature, ignore_index, call.tp_group, call.deferred)


logp = entry_point(LogpCall, logp_call, name="logp", checks_values=True)

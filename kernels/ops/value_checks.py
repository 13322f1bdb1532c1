"""The kernels' side of the value checks: a bad row's report into the device's error word.

kernels/device_errors.py states the protocol: a kernel that meets a bad value (an id outside
``[0, V)`` other than ``ignore_index``; lengths that are negative or do not add up to T) stores the
call's id, the input, the row and the value into the error word, four int64 in pinned host memory
that the kernel writes through the GPU's mapping of it. A good call stores nothing, so the check
costs a compare per row and no host sync.

The logp and grpo_loss kernels check inside their own row loops (:func:`report_bad_value`).
linear_logp's kernels (kernels/ops/linear_logp/) take the ids as they are; its calls run
:func:`launch_ids_check` first, one small launch over the [T] ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import device_errors
from kernels.contracts import IGNORE_INDEX, LinearLogpCall
from kernels.launch import CachedLaunch

INPUT_TARGET_IDS: tl.constexpr = tl.constexpr(device_errors.INPUT_TARGET_IDS)
INPUT_LENGTHS: tl.constexpr = tl.constexpr(device_errors.INPUT_LENGTHS)
INPUT_LENGTHS_SUM: tl.constexpr = tl.constexpr(device_errors.INPUT_LENGTHS_SUM)
INPUT_CU_SEQLENS: tl.constexpr = tl.constexpr(device_errors.INPUT_CU_SEQLENS)
IDS_CHECK_BLOCK = 1024


@triton.jit
def report_bad_value(err_ptr, call_id, input_code, row, value, bound):
    """Store one report (call under ``if bad:``): word 1 = row * 2**32 + value (int32-clamped,
    mod 2**32), word 2 = the bound, then word 0 = call_id * 16 + input_code. Several programs may
    store; each store is one int64, so words 1 and 2 always come from one program's report."""
    v = tl.minimum(tl.maximum(value.to(tl.int64), -2147483648), 2147483647)
    tl.store(err_ptr + 1, row.to(tl.int64) * 4294967296 + (v & 4294967295))
    tl.store(err_ptr + 2, row.to(tl.int64) * 0 + bound)  # a tensor even where bound is a constexpr (1)
    tl.store(err_ptr, call_id.to(tl.int64) * 16 + input_code)


@triton.jit
def bad_target(target_id, ignore_index, id_bound):
    """Whether a row's target id is bad: outside [0, id_bound) and not ignore_index."""
    return (target_id != ignore_index) & ((target_id < 0) | (target_id >= id_bound))


@triton.jit(do_not_specialize=["call_id"])
def _ids_check_kernel(ids_ptr, err_ptr, call_id, num_tokens, id_bound, ignore_index, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_tokens, other=0).to(tl.int64)
    bad = bad_target(ids, ignore_index, id_bound) & (offs < num_tokens)
    if tl.max(bad.to(tl.int32), 0) > 0:
        row = tl.min(tl.where(bad, offs, num_tokens), 0)
        value = tl.load(ids_ptr + row).to(tl.int64)
        report_bad_value(err_ptr, call_id, INPUT_TARGET_IDS, row, value, id_bound)


_IDS_CHECK = CachedLaunch(_ids_check_kernel)


def launch_ids_check(ids: torch.Tensor, id_bound: int, call_id: int, ignore_index: int = IGNORE_INDEX) -> None:
    """Check ``ids`` [T] against ``[0, id_bound)`` on the device, reporting under ``call_id``."""
    num_tokens = ids.shape[0]
    word = device_errors.word_for(ids.device)
    _IDS_CHECK.launch((triton.cdiv(num_tokens, IDS_CHECK_BLOCK),), ids, word.tensor, call_id, num_tokens,
                      id_bound, ignore_index, BLOCK=IDS_CHECK_BLOCK)


def linear_logp_call(call: LinearLogpCall) -> torch.Tensor:
    """linear_logp on the Triton kernels (kernels/ops/linear_logp/), the ids checked on the
    device first when the call left them to it."""
    from kernels.ops.linear_logp import linear_logp_call as run

    if call.deferred:
        launch_ids_check(call.target_ids, call.global_vocab, call.deferred)
    return run(call)


__all__ = ["bad_target", "launch_ids_check", "linear_logp_call", "report_bad_value"]

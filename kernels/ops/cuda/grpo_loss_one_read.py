"""Host side of the one-read GRPO loss kernel (grpo_loss_one_read.cu): when it applies, how it is cut.

:func:`plan` says whether a call can use the kernel and how: a cluster of C CTAs (1, 2, 4 or 8)
per row, each holding ``slice`` columns of the row in shared memory. C is the smallest that keeps a
CTA's slice within ``SLICE_BYTES`` (96 KiB, so that at least two CTAs share a multiprocessor and one
CTA's copy overlaps another's writes; at V = 151936 the slices are 75968 bytes in bf16 (C = 4) and
fp32 (C = 8), and three CTAs fit: 228 KiB of shared memory, registers capped for three in the
source), up to ``MAX_SLICE_BYTES`` (one CTA per multiprocessor) at C = 8. The measurements behind
512 threads, 96 KiB and three CTAs: docs/performance-notes.md. Where it does not apply,
:func:`plan` returns the reason and kernels/ops/grpo_loss.py runs the two-read Triton path (same
values; one more read of the logits).

Applies when: the logits are on a CUDA device of compute capability >= 9.0 (thread-block
clusters), fp32/bf16/fp16, rows contiguous and 16-byte aligned (data pointer, row stride, and
V * itemsize, since dlogits is allocated contiguous and the slices arrive by bulk copies of whole
16-byte pieces), the row fits in 8 slices, nvcc is
available (or the fatbin is cached), and ``RLK_GRPO_ONE_READ`` is not ``0``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import settings
from kernels.ops.cuda import build

SOURCE = Path(__file__).with_name("grpo_loss_one_read.cu")
THREADS = 512  # threads per CTA (RLK_THREADS in the source)
# NAME=VALUE macros for experiments (e.g. RLK_MIN_CTAS=2; tools/probes/probe_grpo_one_read_config.py)
EXTRA_DEFINES: tuple[str, ...] = ()
SLICE_BYTES = 96 * 1024
MAX_SLICE_BYTES = 200 * 1024
CLUSTER_SIZES = (1, 2, 4, 8)
_SUFFIX = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# bit layout of the kernel's `flags` argument (FLAG_* and KL_TYPE_SHIFT in the source)
FLAG_SCALE, FLAG_HAS_REF, FLAG_UNBIASED, FLAG_DUAL_CLIP, FLAG_TIS = 1, 2, 4, 8, 16
FLAG_STATS_ONLY = 32  # per_token only: no write sweep (write_from_stats writes dlogits later)
FLAG_WRITE_ALWAYS = 64  # write_from_stats: write for any gradient (a fresh buffer, nothing to keep)
KL_TYPE_SHIFT = 8
SIGNATURE = (
    "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",  # logits grad ids old ref adv rollout w per_token
    "i64", "i64", "i32", "i32", "i32", "i64",  # stride_row stride_grad T V slice ignore_index
    "f32", "f32", "f32", "f32", "f32", "f32", "f32",  # temperature eps_low eps_high eps_c tis_low tis_high kl_coef
    "f32", "i32",  # grad_pred (the predicted incoming gradient), flags
    "ptr", "i64",  # the error word (pinned host memory), the call id (kernels/device_errors.py)
)
WRITE_SIGNATURE = (
    "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",  # logits grad ids weights coef max sumexp grad_output
    "ptr",  # last_grad: the error word's word 3 (kernels/device_errors.py)
    "i64", "i64", "i32", "i32", "i32", "i32",  # stride_row stride_grad T V blocks_per_row block_cols
    "f32", "f32", "i32",  # temperature expected flags
)
# the write kernel's block: up to WRITE_PIECES 16-byte pieces per thread (32 KiB), all copied at once,
# the next block's copy in flight while a CTA writes the current one (two buffers: 64 KiB of shared
# memory); WRITE_CTAS CTAs per multiprocessor (the write kernel's launch bounds) make the grid's wave
WRITE_PIECES = 4
WRITE_CTAS = 3


@dataclass(frozen=True)
class WriteLaunch:
    """The write kernel's launch for one call (the host path registers it, kernels/ops/host):
    ``function`` its CUfunction handle, ``ctas`` the grid's cap (one wave), the rest as the kernel's
    arguments of the same names."""

    function: int
    ctas: int
    threads: int
    shared_bytes: int
    blocks_per_row: int
    block_cols: int


@dataclass(frozen=True)
class OneReadPlan:
    kernel: str  # grpo_one_read_<dtype>_c<C>
    cluster: int
    slice: int  # columns per CTA (a multiple of the 16-byte vector)
    shared_bytes: int


def cut(vocab: int, itemsize: int) -> tuple[int, int] | None:
    """(cluster size, slice columns) for a row of ``vocab`` elements, or None if it does not fit."""
    vec = 16 // itemsize
    for limit in (SLICE_BYTES, MAX_SLICE_BYTES):
        for cluster in CLUSTER_SIZES:
            slice_cols = -(-vocab // cluster)
            slice_cols = -(-slice_cols // vec) * vec
            if slice_cols * itemsize <= limit:
                return cluster, slice_cols
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _buildable() -> bool:
    """The fatbin is cached or nvcc can build it (asked once per process: it hashes the source)."""
    return build.fatbin_path(SOURCE).is_file() or build.find_nvcc() is not None


def enabled() -> bool:
    return settings.GRPO_ONE_READ.get()


def plan(logits: torch.Tensor) -> OneReadPlan | str:
    """How to run the one-read kernel on ``logits`` [T, V], or why it cannot run (a sentence).
    Decided once per (device, dtype, V, strides, alignment): host time of every call."""
    if not enabled():
        return "RLK_GRPO_ONE_READ=0"
    device = logits.device
    if device.type != "cuda":
        return f"logits on {device.type}, not CUDA"
    return _plan(device.index, logits.dtype, logits.shape[1], logits.stride(0), logits.stride(1),
                 logits.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=256)
def _plan(index: int | None, dtype: torch.dtype, vocab: int, row_stride: int, col_stride: int,
          aligned: bool) -> OneReadPlan | str:
    if index is None:
        index = torch.cuda.current_device()
    if _capability(index) < (9, 0):
        return "thread-block clusters need compute capability 9.0 or newer"
    suffix = _SUFFIX.get(dtype)
    if suffix is None:
        return f"dtype {dtype}"
    itemsize = torch.empty((), dtype=dtype).element_size()
    if col_stride != 1:
        return "logits rows are not contiguous"
    if not aligned or (row_stride * itemsize) % 16 or (vocab * itemsize) % 16:
        return f"rows not 16-byte aligned (V={vocab}, row stride {row_stride}, {itemsize}-byte elements)"
    shape = cut(vocab, itemsize)
    if shape is None:
        return f"a row of {vocab * itemsize} bytes exceeds {max(CLUSTER_SIZES)} x {MAX_SLICE_BYTES} bytes of shared memory"
    if not _buildable():
        return "nvcc not found and no cached build (set RLK_NVCC or CUDA_HOME)"
    cluster, slice_cols = shape
    return OneReadPlan(f"grpo_one_read_{suffix}_c{cluster}", cluster, slice_cols, slice_cols * itemsize)


def flags_for(config, *, scale: bool, has_ref: bool, kl_code: int) -> int:
    flags = kl_code << KL_TYPE_SHIFT
    if scale:
        flags |= FLAG_SCALE
    if has_ref:
        flags |= FLAG_HAS_REF
    if config.use_unbiased_kl:
        flags |= FLAG_UNBIASED
    if config.eps_clip_c is not None:
        flags |= FLAG_DUAL_CLIP
    if config.use_tis:
        flags |= FLAG_TIS
    return flags


def launch(
    the_plan: OneReadPlan, logits: torch.Tensor, grad: torch.Tensor | None, ids: torch.Tensor, old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None, advantages: torch.Tensor, rollout_logp: torch.Tensor | None,
    weights: torch.Tensor, per_token: torch.Tensor, config, temperature: float, ignore_index: int, kl_code: int,
    error_word: int, call_id: int, grad_pred: float = 1.0,
) -> build.CudaKernel:
    """Write per_token [7, T] (as the Triton kernel does) and ``grad`` = dlogits for an incoming
    gradient ``grad_pred`` (the backward's prediction; ``grad=None``: per_token only, the same bits;
    :func:`write_from_stats` writes dlogits later); returns the kernel it launched (a host path
    registers its handle).

    ids int64 [T]; old/ref/adv/rollout/weights fp32 contiguous [T]; grad contiguous like logits.
    A row whose id is outside [0, V) and not ignore_index gets NaN terms and dlogits, and a report
    under ``call_id`` at ``error_word`` (its address; kernels/device_errors.py)."""
    num_tokens, vocab = logits.shape
    kernel = _module(logits.device).kernel(the_plan.kernel, SIGNATURE)
    has_ref = ref_logp is not None
    flags = flags_for(config, scale=temperature != 1.0, has_ref=has_ref, kl_code=kl_code)
    if grad is None:
        flags |= FLAG_STATS_ONLY
    args = (
        logits.data_ptr(), 0 if grad is None else grad.data_ptr(), ids.data_ptr(), old_logp.data_ptr(),
        (ref_logp if has_ref else old_logp).data_ptr(), advantages.data_ptr(),
        (rollout_logp if config.use_tis else old_logp).data_ptr(), weights.data_ptr(), per_token.data_ptr(),
        logits.stride(0), 0 if grad is None else grad.stride(0), num_tokens, vocab, the_plan.slice, ignore_index,
        temperature, config.eps_clip, config.eps_clip_high, config.eps_clip_c or 0.0,
        config.tis_clip_low, config.tis_clip_high, config.kl_loss_coef, grad_pred, flags, error_word, call_id,
    )
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    kernel.launch(num_tokens * the_plan.cluster, THREADS, the_plan.shared_bytes, args, stream)
    return kernel


def write_from_stats(
    logits: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, coef: torch.Tensor,
    row_max: torch.Tensor, sumexp: torch.Tensor, grad_output: torch.Tensor, temperature: float,
    expected: float | None, last_grad: int,
) -> WriteLaunch | None:
    """``grad`` = dlogits for the incoming gradient ``grad_output`` (fp32 [1], read on the device:
    no host sync) from a :func:`launch`'s per_token rows (coef, row max, sum-exp) and the weights:
    the bits the cluster kernel's write sweep gives for ``grad_pred`` equal to it. ``expected``: the
    ``grad_pred`` the forward wrote ``grad`` for (nothing is written when ``grad_output`` has its
    bits), or None for a fresh ``grad`` (written whatever the gradient). The kernel stores the
    gradient at ``last_grad`` (the address of the error word's word 3, kernels/device_errors.py).
    Returns the launch (None when T = 0: nothing launched); its ``ctas`` caps the grid of a launch
    with an expected gradient.

    logits [T, V] as :func:`plan` accepted them; grad contiguous like logits; ids int64 [T];
    weights/coef/row_max/sumexp fp32 contiguous [T]."""
    num_tokens, vocab = logits.shape
    if num_tokens == 0:
        return None
    kernel = _module(logits.device).kernel(f"grpo_write_from_stats_{_SUFFIX[logits.dtype]}", WRITE_SIGNATURE)
    shape = _write_launch(kernel.handle.value, logits.device.index, logits.dtype, vocab)
    flags = FLAG_SCALE if temperature != 1.0 else 0
    if expected is None:
        flags, expected = flags | FLAG_WRITE_ALWAYS, 1.0
    args = (
        logits.data_ptr(), grad.data_ptr(), ids.data_ptr(), weights.data_ptr(), coef.data_ptr(), row_max.data_ptr(),
        sumexp.data_ptr(), grad_output.data_ptr(), last_grad, logits.stride(0), grad.stride(0), num_tokens, vocab,
        shape.blocks_per_row, shape.block_cols, temperature, expected, flags,
    )
    stream = torch.cuda.current_stream(logits.device).cuda_stream
    # expecting the forward's rows: one wave (every CTA returns at once on a hit); writing for sure:
    # a CTA per block (each copies its block while others write theirs, measured faster than the wave)
    blocks = num_tokens * shape.blocks_per_row
    grid = blocks if flags & FLAG_WRITE_ALWAYS else min(blocks, shape.ctas)
    kernel.launch(grid, THREADS, shape.shared_bytes, args, stream)
    return shape


@functools.lru_cache(maxsize=64)
def _write_launch(function: int, device: int, dtype: torch.dtype, vocab: int) -> WriteLaunch:
    """The write kernel's launch for rows of ``vocab`` elements: each row in equal blocks of at
    most ``THREADS * WRITE_PIECES`` 16-byte pieces, a grid of at most one wave."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    vec = 16 // itemsize
    pieces = -(-vocab // vec)
    blocks_per_row = -(-pieces // (THREADS * WRITE_PIECES))
    block_cols = -(-pieces // blocks_per_row) * vec
    ctas = torch.cuda.get_device_properties(device).multi_processor_count * WRITE_CTAS
    return WriteLaunch(function, ctas, THREADS, 2 * block_cols * itemsize, blocks_per_row, block_cols)


def _module(device: torch.device) -> build.CudaModule:
    defines = (() if THREADS == 512 else (f"RLK_THREADS={THREADS}",)) + EXTRA_DEFINES
    return build.load_module(SOURCE, device, defines)

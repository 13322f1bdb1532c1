"""linear_logp's plan: the workspace budget, the tile configs and settings read at each call, and
which vocab columns the forward keeps (the package docstring tells the whole design).

Shapes: T tokens, H hidden size, V (``V_local``) this rank's vocab columns. ``_plan`` turns a budget in
bytes into a ``_Plan``: ``saved_cols`` columns [0, saved_cols) whose q = exp(z - tile row max) the
forward keeps (fp16 for bf16/fp16 inputs, fp32 for fp32: ``_saved_dtype``), either in a
[T, buffer_cols] buffer of the input dtype or in the weight gradient's [V, H] buffer
(``in_weight_grad``), and whether dH accumulates in an fp32 [T, H] buffer (``dh32``).
``planned_workspace_bytes`` and ``kept_vocab_columns`` answer for a shape without running anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels import settings
from kernels.contracts.linear_logp import check_workspace_bytes
from kernels.ops import INTERPRETED  # fixed at first import, like triton.jit's choice

# The workspace budget: ``workspace_bytes`` (the call's argument), else the setting
# RLK_LINEAR_LOGP_WORKSPACE_BYTES (kernels/settings.py), else this default.
DEFAULT_WORKSPACE_BYTES = 256 * 10**6
WORKSPACE_ENV = settings.LINEAR_LOGP_WORKSPACE_BYTES.name
# The default budget never makes recompute chunks thinner than this many columns (cuBLAS and the tile
# kernel lose speed on thin chunks); an explicit budget is honoured down to one vocab tile.
MIN_DEFAULT_CHUNK_COLS = 4096


def _workspace_budget(workspace_bytes: int | None) -> tuple[int, bool]:
    """(budget in bytes, whether the caller chose it): the argument, else the setting, else the default."""
    if workspace_bytes is not None:
        return check_workspace_bytes(workspace_bytes), True
    budget = settings.LINEAR_LOGP_WORKSPACE_BYTES.get()
    return (DEFAULT_WORKSPACE_BYTES, False) if budget is None else (budget, True)


# Tile sizes and launch options; RLK_LINEAR_LOGP_TILES / RLK_LINEAR_LOGP_MATMUL_TILES override the
# built-in ones on compiled kernels (the interpreter keeps its small tiles).
_TileConfig = settings.TileConfig
TILES_ENV = settings.LINEAR_LOGP_TILES.name  # forward + dlogits kernels
MATMUL_TILES_ENV = settings.LINEAR_LOGP_MATMUL_TILES.name  # backward dH / dW matmuls
BWD_MATMUL_ENV = settings.LINEAR_LOGP_BWD_MATMUL.name


def _bwd_matmul() -> str:
    """Which matmuls the backward uses for dH and dW (read at each backward; GPU tuning knob):
    ``torch`` (default): cuBLAS. dW = dlogits^T @ H accumulates over all T in fp32 inside one GEMM;
    dH32 += dlogits @ W is one ``addmm`` with an fp32 output (``out_dtype=torch.float32``), so a
    chunk's product is never rounded to bf16 before the sum.
    ``triton``: our pointer-based matmul kernel, the same fp32 accumulation (slower on H100)."""
    return settings.LINEAR_LOGP_BWD_MATMUL.get()


def _tile_config(dtype: torch.dtype, interpreted: bool = INTERPRETED) -> _TileConfig:
    """Fixed configs, no autotune: autotuning would re-run kernels that accumulate into outputs."""
    if interpreted:
        # The interpreter runs each program in Python: few, small programs keep CPU CI fast while
        # still exercising partial tiles (odd V, T not a multiple of the tile).
        return _TileConfig(block_t=32, block_v=64, block_k=32, num_warps=4, num_stages=1)
    override = settings.LINEAR_LOGP_TILES.get()
    if override is not None:
        return override
    if dtype == torch.float32:
        return _TileConfig(block_t=64, block_v=128, block_k=32, num_warps=8, num_stages=3)
    # H100/H200 bf16/fp16: 128 x 256 fp32 accumulator over 8 warps, 3-stage K pipeline (144 KiB smem,
    # + 64 KiB for the TMA store of the kept logits).
    return _TileConfig(block_t=128, block_v=256, block_k=64, num_warps=8, num_stages=3)


def _matmul_config(dtype: torch.dtype) -> _TileConfig:
    if INTERPRETED:
        return _TileConfig(block_t=32, block_v=32, block_k=32, num_warps=4, num_stages=1)
    override = settings.LINEAR_LOGP_MATMUL_TILES.get()
    if override is not None:
        return override
    if dtype == torch.float32:
        return _TileConfig(block_t=64, block_v=64, block_k=32, num_warps=4, num_stages=3)
    return _TileConfig(block_t=128, block_v=256, block_k=64, num_warps=8, num_stages=3)


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full IEEE fp32 products (the acceptance asks logp atol 1e-5); tf32 would drift.
    # For bf16/fp16 operands the option has no effect (the products are exact in fp32).
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_operands(dtype: torch.dtype) -> bool:
    # Triton's interpreter (3.9) multiplies bf16 tl.dot operands as raw bits (results ~1e10 off).
    # Upcasting them to fp32 first is exact (a product of two bf16 values fits in fp32), so the
    # interpreter computes what the tensor cores compute, up to fp32 summation order.
    return INTERPRETED and dtype == torch.bfloat16


def _saved_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the kept q = exp(z - tile max) in (0, 1]: fp16 for 16-bit inputs (10 mantissa bits
    against bf16's 7, same bytes; values under 6e-8 lose relative precision, never more than 6e-8
    absolute), fp32 for fp32 inputs."""
    return torch.float32 if dtype == torch.float32 else torch.float16


SAVE_LOGITS_ENV = settings.LINEAR_LOGP_SAVE_LOGITS.name  # "0": the forward keeps nothing


def _save_logits() -> bool:
    """Whether the forward, when a backward will follow, keeps the logits (as q) the budget has room
    for, so the backward recomputes only the rest (default on)."""
    return settings.LINEAR_LOGP_SAVE_LOGITS.get()


KEEP_IN_WEIGHT_GRAD_ENV = settings.LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD.name  # "0": opt out


def _keep_in_weight_grad() -> bool:
    """Whether a forward that keeps logits may keep them in the weight gradient's buffer, allocated
    in the forward (default on; it applies where the budget cannot hold them, the weight needs a
    gradient and T <= H)."""
    return settings.LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD.get()


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _even_chunks(start: int, stop: int, max_cols: int, block_v: int) -> list[tuple[int, int]]:
    """[start, stop) as (start, cols) in the fewest chunks of at most ``max_cols`` columns, spread
    evenly (widths a multiple of block_v), so no chunk is a thin leftover."""
    total = stop - start
    if total <= 0:
        return []
    n = -(-total // max_cols)
    width = min(max_cols, _round_up(-(-total // n), block_v))
    return [(s, min(width, stop - s)) for s in range(start, stop, width)]


@dataclass(frozen=True)
class _Plan:
    """How forward+backward use the workspace budget (see the module docstring)."""
    saved_cols: int  # vocab columns [0, saved_cols) whose q the forward keeps when a backward follows
    buffer_cols: int  # row length of the [T, buffer_cols] buffer: kept q, then the recompute chunks
    dh32: bool  # dH accumulates in fp32 [T, H] (several products, or a TP all-reduce)
    workspace: int  # bytes the plan holds at most
    budget: int
    # the kept q lives in the weight gradient's [V, H] buffer (transposed: column v in row v, tokens
    # along it), the [T, buffer_cols] buffer is only the chunk buffer of the backward
    in_weight_grad: bool = False


def _workspace(T: int, H: int, V: int, element: int, block_v: int, saved: int, buffer_cols: int, dh32: bool,
               in_weight_grad: bool = False) -> int:
    vectors = 16 * T * 4 + 2 * V * 4  # per-row vectors, ids, the fp32 bias gradient
    buffer = T * buffer_cols * element
    kept_in_buffer = saved and not in_weight_grad
    forward = (buffer if kept_in_buffer else 0) + 2 * triton.cdiv(V, block_v) * T * 4 + vectors  # + tile partials
    backward = buffer + triton.cdiv(saved, block_v) * T * 4 + (T * H * 4 if dh32 else 0) + vectors
    return max(forward, backward)


def _plan(T: int, H: int, V: int, dtype: torch.dtype, budget: int, *, explicit: bool, save: bool, tp: bool,
          weight_grad: bool = False, interpreted: bool = INTERPRETED) -> _Plan:
    """The fastest use of ``budget`` bytes: where the weight gradient is computed (``weight_grad``:
    its buffer may hold the logits) and holds them (T <= H), keep every column there, the budget
    sizing the backward's chunks (three products; measured faster than keeping them in the workspace,
    and less memory); else keep every column in the workspace if it fits (three products, dH in one
    product); else as many columns as the buffer holds, the rest recomputed in chunks of its size."""
    block_v = _tile_config(dtype, interpreted).block_v
    element = torch.empty((), dtype=dtype).element_size()
    in_grad = save and weight_grad and T <= H

    def kept(cols: int) -> int:
        return V if in_grad else min(cols, V) if save else 0

    def cost(saved: int, cols: int, dh32: bool) -> int:
        return _workspace(T, H, V, element, block_v, saved, cols, dh32, in_grad)

    if save and not in_grad:
        full_cols = _round_up(V, 16 // element)  # 16-byte rows for the TMA store
        all_kept = _workspace(T, H, V, element, block_v, V, full_cols, tp)
        if all_kept <= budget:
            return _Plan(V, full_cols, tp, all_kept, budget)
    widest = _round_up(V, block_v)
    cols = min(widest, max(0, budget - cost(kept(0), 0, True)) // (T * element) // block_v * block_v)
    while cols >= block_v and cost(kept(cols), cols, True) > budget:
        cols -= block_v
    if cols < block_v and explicit:
        need = cost(kept(block_v), block_v, True)
        raise ValueError(
            f"workspace_bytes={budget} is below the {need} bytes linear_logp needs at T={T}, H={H}, "
            f"V_local={V} ({dtype}): an fp32 [T, H] dH accumulator and a chunk of {block_v} vocab columns")
    if not explicit:  # the default budget: never chunks thinner than MIN_DEFAULT_CHUNK_COLS
        cols = max(cols, min(widest, MIN_DEFAULT_CHUNK_COLS))
    if not save or in_grad:  # chunks from column 0: the buffer as wide as the widest even chunk
        cols = _round_up(_even_chunks(0, V, cols, block_v)[0][1], 16 // element)
    dh32 = tp or cols < V  # one product over the whole vocab needs no fp32 accumulator
    return _Plan(kept(cols), cols, dh32, cost(kept(cols), cols, dh32), budget, in_grad)


def planned_workspace_bytes(T: int, H: int, V_local: int, dtype: torch.dtype, workspace_bytes: int | None = None,
                            *, tp: bool = False, save: bool = True, weight_grad: bool | None = None) -> int:
    """Upper bound of the extra memory (beyond inputs, output and returned grads) forward+backward
    hold on a GPU (compiled tile sizes) under a budget (``workspace_bytes``, as ``linear_logp``'s).
    ``weight_grad``: the weight's gradient is computed (None: the setting
    ``RLK_LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD`` decides whether its buffer may hold the kept logits)."""
    budget, explicit = _workspace_budget(workspace_bytes)
    weight_grad = _keep_in_weight_grad() if weight_grad is None else weight_grad
    return _plan(T, H, V_local, dtype, budget, explicit=explicit, save=save, tp=tp, weight_grad=weight_grad,
                 interpreted=False).workspace


def kept_vocab_columns(T: int, H: int, V_local: int, dtype: torch.dtype, workspace_bytes: int | None = None,
                       *, tp: bool = False, weight_grad: bool | None = None) -> int:
    """How many vocab columns' logits a forward that a backward follows keeps under the budget
    (V_local: all of them, three matrix products); ``weight_grad`` as in ``planned_workspace_bytes``."""
    budget, explicit = _workspace_budget(workspace_bytes)
    weight_grad = _keep_in_weight_grad() if weight_grad is None else weight_grad
    return _plan(T, H, V_local, dtype, budget, explicit=explicit, save=True, tp=tp, weight_grad=weight_grad,
                 interpreted=False).saved_cols

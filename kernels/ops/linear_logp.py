"""linear_logp: selected log-prob straight from hidden states and the LM head, never building [T, V].

    logp[t] = z[t, id_t] - logsumexp_v z[t, v],   z = (hidden @ weight.T + bias) / temperature

Shapes and dtypes
    hidden      [T, H]        float32 | bfloat16 | float16
    weight      [V_local, H]  same dtype as hidden (the LM head, or this rank's vocab shard)
    target_ids  [T]           int64 | int32, *global* vocab ids; ``-100`` (ignore_index) rows give
                              logp 0 and gradient 0 (kernels/contracts/checks.py policy)
    bias        [V_local]     optional, same dtype as hidden
    returns     [T]           float32, autograd to hidden, weight and bias

Vocab-parallel (``tp_group`` given): this rank owns global ids
``[vocab_start, vocab_start + V_local)`` of ``global_vocab``. Per row, each rank computes its local
max, sum-exp and (if it owns the target) target logit; three O(T) all-reduces (MAX, SUM, SUM) make
the global log-sum-exp. The gradient uses the global lse, so ``dW``/``db`` are this shard's part;
``dH`` is all-reduced (SUM) over ``tp_group`` because the hidden states are replicated across the
TP ranks (Megatron's ColumnParallelLinear input region does the same all-reduce in its backward).

Matrix products (each 2*T*H*V flops): the forward's logits, and in the backward dH = dlogits @ W and
dW = dlogits^T @ H, plus a recompute of the logits for every vocab column whose logits the forward
did not keep. It keeps them all (three products) where the workspace budget (``workspace_bytes``,
below) holds them (the logits' size, T * V * 2 bytes for 16-bit inputs, plus ~2%), or, within any
budget, in the weight gradient's buffer where the weight needs a gradient and T <= H (below); else
as many as the budget holds (~15% at the default 256 MB at T = H = 4096, V = 151936).

Forward (``_tma_tiles_kernel`` on Hopper+, bf16/fp16): a persistent kernel (one program per SM)
loops over (token tile, vocab tile) pairs, token tile fastest, operands through host-side TMA
descriptors; each tile is a ``tl.dot`` over H with fp32 accumulation, scaled to base-2 units
(z * log2(e)) in one multiply-add that also applies the bias and -inf past the vocab's end. The
tile's row max and sum of exp2(z - max) go to a ``[n_vocab_tiles, T]`` fp32 buffer; for the tiles
of the kept columns it also stores q = exp(z - tile row max) (in (0, 1]; fp16 for 16-bit inputs,
three mantissa bits more than bf16) through a TMA store. The fp32 logits tile never leaves
registers. The tile that holds a row's target writes its logit (the compare/select runs only in
tiles that hold some row's target): taken from the same z as the lse, a dominant target's rounding
cancels in logp = z_t - lse (the tensor cores add the bf16 products into fp32 with their own
rounding, ~5e-6 of |z| at H = 4096; an IEEE fp32 dot product of the target row would not cancel it).
``_merge_partials_kernel`` folds the partials into the row lse.

Backward: the kept columns [0, saved) first: ``_saved_dlogits_kernel`` turns q into dlogits in place
(p = q * exp(tile max - lse); dlogits = g * (onehot - p) / temperature, rounded once to the input
dtype; the target column's p from the fp32 target logit), then cuBLAS dH (+)= dlogits @ W[:saved]
and dW[:saved] = dlogits^T @ H over the whole kept block at once. The other columns follow in even
chunks that reuse the same buffer: the tile kernel recomputes each logits tile (the forward's fp32
math) and writes dlogits = -g * p / temperature (``_target_column_kernel`` then writes the target
column's g * (1 - p) / temperature), then the same two cuBLAS products. dH accumulates in an fp32
[T, H] buffer (``torch.addmm(..., out_dtype=torch.float32)``: a chunk's product is never rounded
before the sum) unless one product covers the whole vocab (everything kept, no TP): then dH is one
cuBLAS product with fp32 accumulation straight into the returned dtype. dW is one product per
chunk (fp32 accumulation over all T, stored once). ``RLK_LINEAR_LOGP_BWD_MATMUL=triton`` runs dH/dW
in our ``_matmul_kernel`` instead.

Kept in the weight gradient (``RLK_LINEAR_LOGP_KEEP_IN_WEIGHT_GRAD``, default on): dW = dlogits^T @ H
is a [V, H] buffer the backward returns, as large as the 16-bit logits when T <= H. Where the budget
cannot hold the logits and the weight needs a gradient, the forward allocates it and stores q of
vocab column v in its row v (tokens along the row: the tile is stored transposed), so the backward's
chunk [s, s + n) reads its q from rows [s, s + n), writes its dlogits into the chunk buffer ([n, T]
rows), and only then its dW product overwrites rows [s, s + n): no chunk's product touches a row
whose q is not yet used. The budget then sizes the chunk buffer only. The cost: the gradient exists
from the forward on (T * V * 2 bytes at T = H), where the budget path allocates it in the backward;
that is free where the backward follows its forward, as the LM head's does (the first backward after
the loss), and adds up where several forwards run before their backwards (interleaved pipeline
schedules: one gradient buffer per microbatch in flight). Opting out (the setting at 0) keeps only
what the budget holds.

Workspace (``workspace_bytes``: the most the op holds beyond its inputs, its output and the
gradients it returns, from the forward through the backward; ``planned_workspace_bytes`` computes
what a budget gives): the [T, buffer_cols] buffer (kept logits, then the recompute chunk), the fp32
dH accumulator (T*H*4), the kept tiles' row maxima, the forward's partials (2 * n_vocab_tiles * T * 4)
and O(T + V) vectors. The default, 256 MB, is raised only where the shape needs more for chunks of
4096 columns (a [T, H] fp32 accumulator alone can exceed it); an explicit budget below what one
vocab tile of chunk needs is an error naming the minimum.

The pointer kernels ``_fwd_tile_kernel`` / ``_dlogits_kernel`` (one program per tile, same math in
natural-log units) serve fp32 inputs, the CPU interpreter, pre-Hopper GPUs, unaligned operands and
``RLK_LINEAR_LOGP_TMA=0``.

GPU tuning knobs (settings, kernels/settings.py, read at each call; defaults are the configs below):
``RLK_LINEAR_LOGP_TILES`` / ``RLK_LINEAR_LOGP_MATMUL_TILES`` = "BLOCK_T,BLOCK_V,BLOCK_K,warps,stages"
for the logits-tile kernels (TMA or pointer) / our backward matmul; ``RLK_LINEAR_LOGP_TMA=0`` uses
the pointer kernels on Hopper too; ``RLK_LINEAR_LOGP_BWD_MATMUL=triton|torch`` picks the backward's
dH/dW matmuls (default ``torch``); ``RLK_LINEAR_LOGP_GROUP_T=N`` (token tiles per group in the TMA
kernel's tile order); ``RLK_LINEAR_LOGP_SAVE_LOGITS=0`` keeps nothing in the forward (the backward
recomputes every column; the budget then sizes the recompute chunk only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (Triton >= 3.4); without them the pointer kernels run
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

from kernels import settings
from kernels.contracts import IGNORE_INDEX, LinearLogpCall, entry_point
from kernels.contracts.linear_logp import check_workspace_bytes
from kernels.ops import INTERPRETED  # fixed at first import, like triton.jit's choice
from kernels.ops.exp2 import LN2, LOG2E

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


TMA_ENV = settings.LINEAR_LOGP_TMA.name
# Persistent TMA kernel options (module attributes, for probes). Measured on an H100 (bf16, issue
# shape, Triton 3.6): flattening the tile and K loops into one pipeline 7.6 ms vs 8.2 ms without;
# Triton's automatic warp specialization 7.7 ms (kept off); num_ctas=2 does not compile.
TMA_FLATTEN = True
TMA_WARP_SPECIALIZE = False
# Stores of the kept logits (forward) / the dlogits tiles (backward): TMA (through a descriptor) or
# masked pointer stores. Measured on an H100 (bf16, T = H = 4096, V = 151936): the forward that keeps a chunk
# 7.12 ms with TMA stores vs 7.54 ms with pointer stores. The dlogits tile's pointer stores take a
# 64-bit address per element: with the one-FMA epilogue ptxas reports 1240 bytes of spills for them
# and none for the TMA store (6008 vs 1520 SASS instructions in the kernel, Triton 3.6, sm_90a).
TMA_STORE_Q = True
TMA_STORE_DLOGITS = True
# Token tiles per group in the tile order (>= n_t: token tile fastest over all T, the default).
# RLK_LINEAR_LOGP_GROUP_T overrides it.
TMA_GROUP_T = 1 << 30
# Tests run the TMA kernel through the CPU interpreter by setting this (host descriptors work there).
TMA_IN_INTERPRETER = False
GROUP_T_ENV = settings.LINEAR_LOGP_GROUP_T.name  # overrides TMA_GROUP_T


def _tma_group_t() -> int:
    group_t = settings.LINEAR_LOGP_GROUP_T.get()
    return TMA_GROUP_T if group_t is None else group_t


def _use_tma(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """The persistent TMA kernel serves bf16/fp16 on Hopper or newer (fp32 stays on the pointer
    kernels: IEEE fp32 products do not run on the tensor cores anyway); RLK_LINEAR_LOGP_TMA=0 turns it
    off. TMA needs 16-byte aligned base pointers and row strides."""
    if TensorDescriptor is None or not settings.LINEAR_LOGP_TMA.get():
        return False
    aligned = all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1
                  for t in (hidden, weight))
    if INTERPRETED:
        return TMA_IN_INTERPRETER and aligned
    return (aligned and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(hidden.device)[0] >= 9)


def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------------------------
# The plan: which vocab columns the forward keeps, the buffer, the dH accumulator
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _logits_tile(
    hidden_ptr, weight_ptr, bias_ptr,
    offs_t, offs_v, T, V_local, H,
    stride_ht, stride_wv, inv_temperature,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
):
    """fp32 [BLOCK_T, BLOCK_V] tile of (hidden @ weight.T + bias) / temperature; -inf past V_local."""
    mask_v = offs_v < V_local
    offs_k = tl.arange(0, BLOCK_K)
    # Rows/columns past the end wrap around to valid ones (loads need no row mask, so the K loop
    # pipelines unmasked when H % BLOCK_K == 0); their results are masked at the end or the store.
    rows_t = (offs_t % T).to(tl.int64)
    rows_v = (offs_v % V_local).to(tl.int64)
    h_ptrs = hidden_ptr + rows_t[:, None] * stride_ht + offs_k[None, :]
    w_ptrs = weight_ptr + rows_v[None, :] * stride_wv + offs_k[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for k in range(tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = H - k * BLOCK_K
            h = tl.load(h_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _dot(h, w, acc, INPUT_PRECISION, UPCAST)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        acc = acc + b[None, :]
    z = acc * inv_temperature
    return tl.where(mask_v[None, :], z, float("-inf"))


@triton.jit
def _fwd_tile_kernel(
    hidden_ptr, weight_ptr, bias_ptr, local_ids_ptr, tile_max_ptr, tile_sumexp_ptr, target_logit_ptr, q_ptr,
    T, H, col_start, n_cols,
    stride_ht, stride_wv, stride_qt, stride_qv, inv_temperature,
    HAS_BIAS: tl.constexpr, STORE_Q: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
):
    """``_tma_tiles_kernel``'s forward over columns [col_start, col_start + n_cols), one program per
    tile, pointer loads, natural-log units; q[t, v] at ``q_ptr + t * stride_qt + v * stride_qv``."""
    pid_t = tl.program_id(0)  # token tile fastest: co-resident programs share weight tiles in L2
    pid_v = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = col_start + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_t = offs_t < T
    end = col_start + n_cols
    z = _logits_tile(
        hidden_ptr, weight_ptr, bias_ptr, offs_t, offs_v, T, end, H, stride_ht, stride_wv,
        inv_temperature, HAS_BIAS, BLOCK_T, BLOCK_V, BLOCK_K, INPUT_PRECISION, UPCAST, EVEN_K,
    )
    # Every vocab tile holds at least one real column, so the row max is finite.
    row_max = tl.max(z, axis=1)
    e = tl.exp(z - row_max[:, None])
    row_sumexp = tl.sum(e, axis=1)
    tile_row = col_start // BLOCK_V + pid_v
    tl.store(tile_max_ptr + tile_row * T + offs_t, row_max, mask=mask_t)
    tl.store(tile_sumexp_ptr + tile_row * T + offs_t, row_sumexp, mask=mask_t)
    # Local id of the target (out of range on other shards / ignored rows): only the owner stores.
    local_id = tl.load(local_ids_ptr + offs_t, mask=mask_t, other=-1)
    target = tl.sum(tl.where(offs_v[None, :] == local_id[:, None], z, 0.0), axis=1)
    owns = mask_t & (local_id >= col_start + pid_v * BLOCK_V) & (local_id < col_start + pid_v * BLOCK_V + BLOCK_V) & (local_id < end)
    tl.store(target_logit_ptr + offs_t, target, mask=owns)
    if STORE_Q:
        q_ptrs = q_ptr + offs_t.to(tl.int64)[:, None] * stride_qt + offs_v.to(tl.int64)[None, :] * stride_qv
        tl.store(q_ptrs, e.to(q_ptr.dtype.element_ty), mask=mask_t[:, None] & (offs_v < end)[None, :])


@triton.jit
def _dlogits_kernel(
    hidden_ptr, weight_ptr, bias_ptr, lse_ptr, coef_ptr, dlogits_ptr,
    T, V_local, H, chunk_start, chunk_cols,
    stride_ht, stride_wv, stride_dt, inv_temperature,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
):
    """dlogits[t, c] = coef[t] * softmax(z)[t, chunk_start + c], c < chunk_cols; coef = -g / temperature.
    (The target column is rewritten by ``_target_column_kernel``.)"""
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_v = chunk_start + offs_c
    mask_t = offs_t < T
    z = _logits_tile(
        hidden_ptr, weight_ptr, bias_ptr, offs_t, offs_v, T, V_local, H, stride_ht, stride_wv,
        inv_temperature, HAS_BIAS, BLOCK_T, BLOCK_V, BLOCK_K, INPUT_PRECISION, UPCAST, EVEN_K,
    )
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    coef = tl.load(coef_ptr + offs_t, mask=mask_t, other=0.0)  # 0 on ignored rows
    dlogits = tl.exp(z - lse[:, None]) * coef[:, None]  # exp(-inf) = 0 past V_local
    out_ptrs = dlogits_ptr + offs_t.to(tl.int64)[:, None] * stride_dt + offs_c[None, :]
    tl.store(out_ptrs, dlogits.to(dlogits_ptr.dtype.element_ty),
             mask=mask_t[:, None] & (offs_c[None, :] < chunk_cols))


@triton.jit
def _tma_tiles_kernel(
    h_desc, w_desc, out_desc, bias_ptr, local_ids_ptr, lse_ptr, coef_ptr,
    tile_max_ptr, tile_sumexp_ptr, target_logit_ptr, out_ptr,
    T, H, col_start, n_cols, stride_ot, scale2, group_t,
    DLOGITS: tl.constexpr, STORE_Q: tl.constexpr, TMA_STORE: tl.constexpr, Q_TRANSPOSED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Persistent (one program per SM) logits tiles over columns [col_start, col_start + n_cols),
    operands fed by TMA descriptors (out-of-range rows/columns arrive as zeros). The epilogue works
    in base-2 units: z2 = acc * scale2 (+ bias * scale2), scale2 = log2(e) / temperature.

    DLOGITS = False (forward): per-tile row max (natural units) and sum of exp2(z2 - max2) into rows
    col_start / BLOCK_V + pid_v of the [n_vocab_tiles, T] partials, the target logit where the tile
    holds it (``local_ids`` - col_start: column; rows of other shards / ignored rows: none); with STORE_Q also every tile's
    q = exp(z - tile row max) into ``out`` (the kept block, column c = vocab column c; a launch
    stores all its tiles or none: a branch on the tile in the flattened loop does not compile in
    Triton 3.6, so the forward runs the kept columns and the rest as two launches); Q_TRANSPOSED: ``out``
    holds q transposed, vocab column c in row c (``stride_ot`` apart), tokens along the row: the
    layout of q kept in the weight gradient's [V, H] buffer. DLOGITS = True
    (backward): coef[t] * exp(z - lse[t]) into ``out``, the chunk buffer (column c = vocab column
    col_start + c). ``out`` is written through ``out_desc`` (TMA_STORE: a TMA store, clipped at
    the descriptor's [T, columns] shape) or through masked pointer stores.
    Tile order: groups of group_t (<= n_t) token tiles sweep the vocab tiles, token tile fastest, so the
    programs resident together share weight tiles (and the group's hidden rows) in L2."""
    n_t = tl.cdiv(T, BLOCK_T)
    n_v = tl.cdiv(n_cols, BLOCK_V)
    k_tiles = tl.cdiv(H, BLOCK_K)
    group_tiles = group_t * n_v
    for tile in tl.range(tl.program_id(0), n_t * n_v, NUM_PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        first_t = (tile // group_tiles) * group_t
        rows_in_group = tl.minimum(n_t - first_t, group_t)
        pid_t = first_t + (tile % group_tiles) % rows_in_group
        pid_v = (tile % group_tiles) // rows_in_group
        off_t = pid_t * BLOCK_T
        off_c = pid_v * BLOCK_V
        acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        for k in range(k_tiles):
            h = h_desc.load([off_t, k * BLOCK_K])
            w = w_desc.load([col_start + off_c, k * BLOCK_K])
            acc = _dot(h, w.T, acc, INPUT_PRECISION, UPCAST)
        offs_t = off_t + tl.arange(0, BLOCK_T)
        offs_c = off_c + tl.arange(0, BLOCK_V)
        mask_t = offs_t < T
        mask_c = offs_c < n_cols
        if DLOGITS:
            # Columns past the chunk are computed but never stored: no -inf needed.
            lse2 = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0) * LOG2E
            coef = tl.load(coef_ptr + offs_t, mask=mask_t, other=0.0)
            x2 = acc * scale2 - lse2[:, None]
            if HAS_BIAS:
                x2 += (tl.load(bias_ptr + col_start + offs_c, mask=mask_c, other=0.0).to(tl.float32) * scale2)[None, :]
            dlogits = (tl.exp2(x2) * coef[:, None]).to(out_ptr.dtype.element_ty)
            if TMA_STORE:
                out_desc.store([off_t, off_c], dlogits)
            else:
                out_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + offs_c[None, :]
                tl.store(out_ptrs, dlogits, mask=mask_t[:, None] & mask_c[None, :])
        else:
            # One multiply-add per element: scale, bias, and -inf past the vocab's end.
            if HAS_BIAS:
                col2 = tl.load(bias_ptr + col_start + offs_c, mask=mask_c, other=0.0).to(tl.float32) * scale2
                col2 = tl.where(mask_c, col2, float("-inf"))
            else:
                col2 = tl.where(mask_c, 0.0, float("-inf"))
            z2 = acc * scale2 + col2[None, :]
            row_max2 = tl.max(z2, axis=1)  # finite: every tile holds a real column
            # The target logit from this tile's own z, so that a dominant target's logit and the
            # lse share its rounding (logp = t - lse cancels exactly there); the select runs only
            # in the tiles that hold some row's target (~1 in 5 at 128 x 256 tiles).
            target_col = tl.load(local_ids_ptr + offs_t, mask=mask_t, other=-1) - (col_start + off_c)
            owns = mask_t & (target_col >= 0) & (target_col < BLOCK_V) & (target_col < n_cols - off_c)
            if tl.max(owns.to(tl.int32), axis=0) > 0:
                target2 = tl.sum(tl.where(tl.arange(0, BLOCK_V)[None, :] == target_col[:, None], z2, 0.0), axis=1)
                tl.store(target_logit_ptr + offs_t, target2 * LN2, mask=owns)
            e = tl.exp2(z2 - row_max2[:, None])
            row_sumexp = tl.sum(e, axis=1)
            if STORE_Q:
                q = e.to(out_ptr.dtype.element_ty)
                if Q_TRANSPOSED:
                    if TMA_STORE:
                        out_desc.store([col_start + off_c, off_t], tl.trans(q))
                    else:
                        q_ptrs = out_ptr + (col_start + offs_c).to(tl.int64)[None, :] * stride_ot + offs_t[:, None]
                        tl.store(q_ptrs, q, mask=mask_t[:, None] & mask_c[None, :])
                elif TMA_STORE:
                    out_desc.store([off_t, col_start + off_c], q)
                else:
                    q_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + (col_start + offs_c)[None, :]
                    tl.store(q_ptrs, q, mask=mask_t[:, None] & mask_c[None, :])
            tile_row = col_start // BLOCK_V + pid_v
            tl.store(tile_max_ptr + tile_row * T + offs_t, row_max2 * LN2, mask=mask_t)
            tl.store(tile_sumexp_ptr + tile_row * T + offs_t, row_sumexp, mask=mask_t)


@triton.jit
def _merge_partials_kernel(
    tile_max_ptr, tile_sumexp_ptr, row_max_ptr, sumexp_ptr, T, n_tiles,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row max and sum-exp (relative to it) over the [n_tiles, T] tile partials, one online pass."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    for start in range(0, n_tiles, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask = (offs_n < n_tiles)[:, None] & mask_t[None, :]
        offs = offs_n.to(tl.int64)[:, None] * T + offs_t[None, :]
        tile_m = tl.load(tile_max_ptr + offs, mask=mask, other=float("-inf"))
        tile_m = tl.where(mask_t[None, :], tile_m, 0.0)  # rows past T: finite, never stored
        tile_s = tl.load(tile_sumexp_ptr + offs, mask=mask, other=0.0)
        new_m = tl.maximum(m, tl.max(tile_m, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tile_s * tl.exp(tile_m - new_m[None, :]), axis=0)
        m = new_m
    tl.store(row_max_ptr + offs_t, m, mask=mask_t)
    tl.store(sumexp_ptr + offs_t, s, mask=mask_t)


@triton.jit
def _target_column_kernel(
    dlogits_ptr, local_ids_ptr, target_logit_ptr, lse_ptr, coef_ptr,
    T, col_start, n_cols, stride_dt, BLOCK_T: tl.constexpr,
):
    """In a recomputed chunk: the target column's dlogits = -coef * (1 - p_target), p_target from the
    fp32 target logit (the tile wrote coef * p there)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    col = tl.load(local_ids_ptr + offs_t, mask=mask_t, other=-1) - col_start
    hit = mask_t & (col >= 0) & (col < n_cols)
    p = tl.exp(tl.load(target_logit_ptr + offs_t, mask=hit, other=0.0) - tl.load(lse_ptr + offs_t, mask=hit, other=0.0))
    d = -tl.load(coef_ptr + offs_t, mask=hit, other=0.0) * (1.0 - p)
    ptrs = dlogits_ptr + offs_t.to(tl.int64) * stride_dt + tl.where(hit, col, 0)
    tl.store(ptrs, d.to(dlogits_ptr.dtype.element_ty), mask=hit)


@triton.jit
def _saved_dlogits_kernel(
    q_ptr, d_ptr, tile_max_ptr, lse_ptr, coef_ptr, target_logit_ptr, local_ids_ptr,
    T, col_start, n_cols, stride_qt, stride_qc, stride_dt, stride_dc,
    TILE_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Kept q = exp(z - m_tile) of vocab columns [col_start, col_start + n_cols) (``q_ptr``, q[t, c] at
    t * stride_qt + c * stride_qc) becomes dlogits (``d_ptr``, in the input dtype, strides likewise;
    the same memory as q for the kept block in the buffer, a chunk buffer for q kept in the weight
    gradient) = coef * p, p = q * exp(m_tile - lse), coef = -g / temperature; in the target column
    -coef * (1 - p) with p = exp(target_logit - lse) from the fp32 target logit. ``tile_max_ptr`` starts
    at the row of column col_start's tile; BLOCK_C divides TILE_V, so one block of columns shares one
    forward tile (one m_tile per row)."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_c < n_cols)[None, :]
    q_offs = offs_t.to(tl.int64)[:, None] * stride_qt + offs_c.to(tl.int64)[None, :] * stride_qc
    q = tl.load(q_ptr + q_offs, mask=mask, other=0.0).to(tl.float32)
    m_tile = tl.load(tile_max_ptr + ((pid_c * BLOCK_C) // TILE_V) * T + offs_t, mask=mask_t, other=0.0)
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    coef = tl.load(coef_ptr + offs_t, mask=mask_t, other=0.0)
    p_target = tl.exp(tl.load(target_logit_ptr + offs_t, mask=mask_t, other=0.0) - lse)
    local_id = tl.load(local_ids_ptr + offs_t, mask=mask_t, other=-1)
    is_target = (col_start + offs_c)[None, :] == local_id[:, None]
    d = tl.where(is_target, -(1.0 - p_target)[:, None], q * tl.exp(m_tile - lse)[:, None]) * coef[:, None]
    d_offs = offs_t.to(tl.int64)[:, None] * stride_dt + offs_c.to(tl.int64)[None, :] * stride_dc
    tl.store(d_ptr + d_offs, d.to(d_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
):
    """C[M, N] (+)= A[M, K] @ B[K, N], fp32 accumulation; C's dtype decides the stored precision."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles sweep the column tiles together, reusing B tiles in L2.
    group_size = GROUP_M * num_n
    group = pid // group_size
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Out-of-range rows/columns wrap around (unmasked loads); the store is masked.
    rows_a = (offs_m % M).to(tl.int64)
    cols_b = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :].to(tl.int64) * stride_ak
    b_ptrs = b_ptr + offs_k.to(tl.int64)[:, None] * stride_bk + cols_b[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _dot(a, b, acc, INPUT_PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    mask_c = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, accumulate: bool) -> None:
    """out (+)= a @ b. a and b may be transposed views; out must be row-contiguous."""
    M, K = a.shape
    N = b.shape[1]
    assert out.shape == (M, N) and out.stride(1) == 1
    cfg = _matmul_config(a.dtype)
    grid = (triton.cdiv(M, cfg.block_t) * triton.cdiv(N, cfg.block_v),)
    _matmul_kernel[grid](
        a, b, out, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
        ACCUMULATE=accumulate, BLOCK_M=cfg.block_t, BLOCK_N=cfg.block_v, BLOCK_K=cfg.block_k,
        GROUP_M=8, INPUT_PRECISION=_input_precision(a.dtype), UPCAST=_upcast_operands(a.dtype),
        EVEN_K=K % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _local_ids(target_ids: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Shard-local int32 ids; ignored rows map to -1 (never a column)."""
    local = target_ids.to(torch.int64) - vocab_start
    local = torch.where(target_ids == IGNORE_INDEX, torch.full_like(local, -1), local)
    return local.to(torch.int32).contiguous()


def _row_grid(T: int) -> tuple[int, int]:
    """(rows per program, grid) of the O(T) row kernels."""
    block_t = 16 if INTERPRETED else 32
    return block_t, triton.cdiv(T, block_t)


def _launch_tiles(hidden, weight, bias, local_ids, inv_temperature, *, col_start, n_cols, partials=None, q=None,
                  dlogits=None, lse=None, coef=None):
    """Runs the logits-tile work over columns [col_start, col_start + n_cols) (col_start a multiple of
    the tile's BLOCK_V): the forward partials (``partials`` = (tile_max, tile_sumexp, target_logit)), with ``q``
    ([T, >= col_start + n_cols], the kept block; a transposed view, ``q.stride(1) != 1``: q kept in the
    weight gradient's rows) also every column's exp(z - tile row max); or the chunk's coef * softmax
    (``dlogits``, [T, >= n_cols])."""
    T, H = hidden.shape
    cfg = _tile_config(hidden.dtype)
    has_bias = bias is not None
    bias_arg = bias if has_bias else hidden
    store_q = q is not None
    precision, upcast = _input_precision(hidden.dtype), _upcast_operands(hidden.dtype)
    is_dlogits = dlogits is not None
    tile_max, tile_sumexp, target_logit = partials if partials is not None else (hidden, hidden, None)
    q_transposed = store_q and q.stride(1) != 1
    if _use_tma(hidden, weight):
        out = dlogits if is_dlogits else q
        n_tiles = triton.cdiv(T, cfg.block_t) * triton.cdiv(n_cols, cfg.block_v)
        programs = min(n_tiles, _num_programs(hidden.device))
        h_desc = TensorDescriptor.from_tensor(hidden, [cfg.block_t, cfg.block_k])
        tma_store = out is not None and (TMA_STORE_DLOGITS if is_dlogits else TMA_STORE_Q)
        if q_transposed:  # the weight gradient's rows: TMA needs 16-byte row strides
            tma_store = tma_store and (q.stride(1) * q.element_size()) % 16 == 0
        if not tma_store:
            out_desc = h_desc
        elif q_transposed:  # [vocab columns, T] rows of the weight gradient's buffer
            out_desc = TensorDescriptor(out.t(), [col_start + n_cols, T], [out.stride(1), 1], [cfg.block_v, cfg.block_t])
        else:
            out_desc = TensorDescriptor(out, [T, n_cols if is_dlogits else col_start + n_cols], [out.stride(0), 1],
                                        [cfg.block_t, cfg.block_v])
        row_stride = 0 if out is None else out.stride(1) if q_transposed else out.stride(0)
        _tma_tiles_kernel[(programs,)](
            h_desc, TensorDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_k]), out_desc,
            bias_arg, local_ids, lse if is_dlogits else hidden, coef if is_dlogits else hidden,
            tile_max, tile_sumexp, target_logit if target_logit is not None else hidden, out if out is not None else hidden,
            T, H, col_start, n_cols, row_stride, inv_temperature * math.log2(math.e),
            min(_tma_group_t(), triton.cdiv(T, cfg.block_t)),
            DLOGITS=is_dlogits, STORE_Q=store_q, TMA_STORE=tma_store, Q_TRANSPOSED=q_transposed,
            HAS_BIAS=has_bias, BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
            NUM_PROGRAMS=programs, FLATTEN=TMA_FLATTEN, WARP_SPECIALIZE=TMA_WARP_SPECIALIZE,
            INPUT_PRECISION=precision, UPCAST=upcast,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return
    common = {"HAS_BIAS": has_bias, "BLOCK_T": cfg.block_t, "BLOCK_V": cfg.block_v, "BLOCK_K": cfg.block_k,
              "INPUT_PRECISION": precision, "UPCAST": upcast, "EVEN_K": H % cfg.block_k == 0,
              "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(n_cols, cfg.block_v))
    if not is_dlogits:
        q_arg = q if store_q else hidden
        _fwd_tile_kernel[grid](
            hidden, weight, bias_arg, local_ids, tile_max, tile_sumexp, target_logit, q_arg, T, H, col_start, n_cols,
            hidden.stride(0), weight.stride(0), q_arg.stride(0), q_arg.stride(1), inv_temperature, STORE_Q=store_q,
            **common,
        )
    else:
        _dlogits_kernel[grid](
            hidden, weight, bias_arg, lse, coef, dlogits,
            T, weight.shape[0], H, col_start, n_cols,
            hidden.stride(0), weight.stride(0), dlogits.stride(0), inv_temperature, **common,
        )


@dataclass
class _SavedLogits:
    """What the forward keeps for the backward: q = exp(z - tile row max) of vocab columns [0, cols)
    in ``buffer`` (columns [0, cols) of its [T, buffer_cols] rows, in ``_saved_dtype``), or, with
    ``weight_grad``, every column's q in that [V, H] buffer of the weight gradient (column v in row v,
    tokens along it: q[t, v] at v * H + t), and those tiles' row maxima. Consumed (turned into
    dlogits) by the first backward; a second backward over the same graph recomputes instead."""
    buffer: torch.Tensor | None  # [T, buffer_cols], input dtype
    tile_max: torch.Tensor  # [ceil(cols / block_v), T] fp32
    cols: int
    block_v: int
    weight_grad: torch.Tensor | None = None  # [V, H], weight's dtype: becomes the returned dW

    def q(self) -> torch.Tensor:
        """The kept q as a [T, >= cols] view (transposed strides when it lives in the weight gradient)."""
        if self.weight_grad is None:
            return self.buffer.view(_saved_dtype(self.buffer.dtype))
        T = self.tile_max.shape[1]
        return self.weight_grad.view(_saved_dtype(self.weight_grad.dtype))[:, :T].t()


def _forward(hidden, weight, bias, local_ids, inv_temperature, tp_group, plan=None):
    """Returns (target_logit [T] fp32, lse [T] fp32, kept logits or None), target_logit and lse
    global over the TP group. ``plan`` (when a backward follows): keep its ``saved_cols`` columns."""
    T = hidden.shape[0]
    V_local = weight.shape[0]
    cfg = _tile_config(hidden.dtype)
    n_v = triton.cdiv(V_local, cfg.block_v)
    tile_max = torch.empty((n_v, T), dtype=torch.float32, device=hidden.device)
    tile_sumexp = torch.empty((n_v, T), dtype=torch.float32, device=hidden.device)
    target_logit = torch.zeros(T, dtype=torch.float32, device=hidden.device)  # written by the owning tile
    saved = None
    if plan is not None and plan.in_weight_grad:
        # the weight gradient the backward returns, allocated now: its rows hold the kept q till then
        weight_grad = torch.empty((V_local, hidden.shape[1]), dtype=weight.dtype, device=weight.device)
        saved = _SavedLogits(buffer=None, tile_max=tile_max, cols=V_local, block_v=cfg.block_v,
                             weight_grad=weight_grad)
    elif plan is not None and plan.saved_cols > 0:
        buffer = torch.empty((T, plan.buffer_cols), dtype=hidden.dtype, device=hidden.device)
        saved = _SavedLogits(buffer=buffer, tile_max=tile_max, cols=plan.saved_cols, block_v=cfg.block_v)
    kept = 0 if saved is None else saved.cols  # a multiple of block_v, or V_local
    if kept:
        _launch_tiles(hidden, weight, bias, local_ids, inv_temperature, col_start=0, n_cols=kept,
                      partials=(tile_max, tile_sumexp, target_logit), q=saved.q())
    if kept < V_local:
        _launch_tiles(hidden, weight, bias, local_ids, inv_temperature, col_start=kept, n_cols=V_local - kept,
                      partials=(tile_max, tile_sumexp, target_logit))
    row_max = torch.empty(T, dtype=torch.float32, device=hidden.device)
    sumexp = torch.empty(T, dtype=torch.float32, device=hidden.device)
    block_t, grid = _row_grid(T)
    _merge_partials_kernel[(grid,)](tile_max, tile_sumexp, row_max, sumexp, T, n_v,
                                    BLOCK_T=block_t, BLOCK_N=64, num_warps=4)
    if saved is not None and saved.cols < V_local:  # keep only the kept tiles' maxima
        saved.tile_max = tile_max[:triton.cdiv(saved.cols, cfg.block_v)].clone()
    del tile_max, tile_sumexp
    if tp_group is not None:
        local_max = row_max.clone()
        torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        sumexp *= torch.exp(local_max - row_max)
        torch.distributed.all_reduce(sumexp, op=torch.distributed.ReduceOp.SUM, group=tp_group)
        torch.distributed.all_reduce(target_logit, op=torch.distributed.ReduceOp.SUM, group=tp_group)
    return target_logit, row_max + torch.log(sumexp), saved


def _saved_dlogits(saved, start, cols, out, lse, coef, target_logit, local_ids) -> torch.Tensor:
    """The dlogits of the kept columns [start, start + cols) (start a multiple of the tile width) from
    their q, into ``out`` ([T, >= cols], the input dtype; the q's own memory works); returns the
    [T, cols] view of ``out``."""
    T = saved.tile_max.shape[1]
    q = saved.q()[:, start:start + cols]
    out = out[:, :cols]
    block_t, block_c = (32, min(32, saved.block_v)) if INTERPRETED else (64, min(128, saved.block_v))
    grid = (triton.cdiv(T, block_t), triton.cdiv(cols, block_c))
    _saved_dlogits_kernel[grid](
        q, out, saved.tile_max[start // saved.block_v:], lse, coef, target_logit, local_ids, T, start, cols,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        TILE_V=saved.block_v, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4,
    )
    return out


def _accumulate_dh(d_hidden32: torch.Tensor, d_chunk: torch.Tensor, w_chunk: torch.Tensor, first: bool) -> None:
    """d_hidden32 (+)= d_chunk @ w_chunk through cuBLAS (``first``: overwrite), the product kept in
    fp32 (never rounded to the input dtype before the sum over chunks)."""
    if d_hidden32.is_cuda and d_chunk.dtype in (torch.bfloat16, torch.float16):
        if first:
            torch.mm(d_chunk, w_chunk, out_dtype=torch.float32, out=d_hidden32)
        else:
            torch.addmm(d_hidden32, d_chunk, w_chunk, out_dtype=torch.float32, out=d_hidden32)
        return
    if d_chunk.dtype != torch.float32:  # CPU (interpreter runs): an exact upcast, then fp32 products
        d_chunk, w_chunk = d_chunk.float(), w_chunk.float()
    if first:
        torch.mm(d_chunk, w_chunk, out=d_hidden32)
    else:
        d_hidden32.addmm_(d_chunk, w_chunk)


def _backward(hidden, weight, bias, local_ids, lse, grad_rows, target_logit, inv_temperature, tp_group, needs,
              plan, saved=None, consume=True):
    """dH, dW, db over the vocab in pieces, each followed by its pair of products: the kept block in
    the buffer (``saved``: turned into dlogits in place, one piece), then the other columns in even
    chunks recomputed into the same buffer; or, with q kept in the weight gradient's rows, every
    column in even chunks, each chunk's dlogits written into the chunk buffer (so that the chunk's dW
    product overwrites only rows whose q is used), and that buffer returned as dW.
    ``consume=False`` (the operator's split: its residuals are read-only) writes the kept block's
    dlogits into a fresh buffer of the kept buffer's shape, and dW into a fresh tensor; the same
    pieces and products, so the same bits."""
    T, H = hidden.shape
    V_local = weight.shape[0]
    cfg = _tile_config(hidden.dtype)
    need_dh, need_dw, need_db = needs
    use_torch_mm = _bwd_matmul() == "torch"
    coef = (grad_rows * -inv_temperature).contiguous()
    in_grad = saved is not None and saved.weight_grad is not None
    # pieces: (start, cols, dlogits [T, cols] | "kept" (from q in the weight gradient) | None (recompute))
    if in_grad:
        pieces = [(start, cols, "kept") for start, cols in _even_chunks(0, V_local, plan.buffer_cols, cfg.block_v)]
        # [cols, T] rows: the dlogits chunk is read transposed, as its q is stored
        chunk_rows = torch.empty((pieces[0][1], T), dtype=hidden.dtype, device=hidden.device)
        chunk_view = chunk_rows.t()
    else:
        if saved is not None:
            buffer = saved.buffer if consume else torch.empty((T, plan.buffer_cols), dtype=hidden.dtype,
                                                              device=hidden.device)
            pieces = [(0, saved.cols, _saved_dlogits(saved, 0, saved.cols, buffer, lse, coef, target_logit, local_ids))]
            if consume:
                saved.buffer = None
        else:
            buffer = torch.empty((T, plan.buffer_cols), dtype=hidden.dtype, device=hidden.device)
            pieces = []
        done = pieces[0][1] if pieces else 0
        chunks = _even_chunks(done, V_local, buffer.shape[1], cfg.block_v)
        # Row length of the chunk view: 16-byte rows (TMA) within the buffer (itself 16-byte aligned).
        width = min(buffer.shape[1], _round_up(chunks[0][1], 16 // buffer.element_size())) if chunks else 0
        chunk_view = buffer.view(-1)[:T * width].view(T, width) if chunks else None
        pieces += [(start, cols, None) for start, cols in chunks]
    # One product over the whole vocab, no TP: dH straight into its dtype, no fp32 accumulator.
    dh_direct = need_dh and tp_group is None and len(pieces) == 1
    d_hidden = torch.empty_like(hidden) if dh_direct else None
    alloc = torch.empty if use_torch_mm else torch.zeros  # cuBLAS overwrites on the first product
    d_hidden32 = alloc((T, H), dtype=torch.float32, device=hidden.device) if need_dh and not dh_direct else None
    if in_grad and consume:
        # its rows' q are used chunk by chunk before the chunk's dW product overwrites them
        d_weight = saved.weight_grad if need_dw else None
    else:
        d_weight = torch.empty_like(weight) if need_dw else None
    d_bias32 = torch.empty(V_local, dtype=torch.float32, device=hidden.device) if need_db else None
    for index, (start, cols, d_piece) in enumerate(pieces):
        if isinstance(d_piece, str):  # q kept in the weight gradient's rows -> the chunk buffer
            d_piece = _saved_dlogits(saved, start, cols, chunk_view, lse, coef, target_logit, local_ids)
        elif d_piece is None:  # recompute this chunk's softmax into the buffer
            d_piece = chunk_view[:, :cols]
            _launch_tiles(hidden, weight, bias, local_ids, inv_temperature, col_start=start, n_cols=cols,
                          dlogits=d_piece, lse=lse, coef=coef)
            block_t, grid = _row_grid(T)
            _target_column_kernel[(grid,)](d_piece, local_ids, target_logit, lse, coef, T, start, cols,
                                           d_piece.stride(0), BLOCK_T=block_t, num_warps=4)
        w_piece = weight[start:start + cols]
        if dh_direct:
            if use_torch_mm:
                torch.mm(d_piece, w_piece, out=d_hidden)
            else:
                _matmul(d_piece, w_piece, d_hidden, accumulate=False)
        elif need_dh:
            if use_torch_mm:
                _accumulate_dh(d_hidden32, d_piece, w_piece, first=index == 0)
            else:
                _matmul(d_piece, w_piece, d_hidden32, accumulate=True)
        if need_dw:
            if use_torch_mm:
                torch.mm(d_piece.t(), hidden, out=d_weight[start:start + cols])
            else:
                _matmul(d_piece.t(), hidden, d_weight[start:start + cols], accumulate=False)
        if need_db:
            d_bias32[start:start + cols] = d_piece.sum(dim=0, dtype=torch.float32)  # fp32 accumulate
    if need_dh and not dh_direct:
        if tp_group is not None:
            torch.distributed.all_reduce(d_hidden32, op=torch.distributed.ReduceOp.SUM, group=tp_group)
        d_hidden = d_hidden32.to(hidden.dtype)
    d_bias = d_bias32.to(bias.dtype) if need_db else None
    return d_hidden, d_weight, d_bias


class _LinearLogpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, temperature, tp_group, vocab_start, plan, save):
        inv_temperature = 1.0 / temperature
        local_ids = _local_ids(target_ids, vocab_start)
        target_logit, lse, saved = _forward(hidden, weight, bias, local_ids, inv_temperature, tp_group,
                                            plan if save else None)
        ignored = target_ids == IGNORE_INDEX
        logp = torch.where(ignored, torch.zeros_like(lse), target_logit - lse)
        ctx.save_for_backward(hidden, weight, bias, local_ids, lse, ignored, target_logit)
        ctx.saved_logits = saved
        ctx.plan = plan
        ctx.inv_temperature = inv_temperature
        ctx.tp_group = tp_group
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, bias, local_ids, lse, ignored, target_logit = ctx.saved_tensors
        saved, ctx.saved_logits = ctx.saved_logits, None  # consumed in place: a second backward recomputes
        grad_rows = torch.where(ignored, torch.zeros_like(lse), grad_logp.float())
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        d_hidden, d_weight, d_bias = _backward(
            hidden, weight, bias, local_ids, lse, grad_rows, target_logit, ctx.inv_temperature, ctx.tp_group,
            needs, ctx.plan, saved=saved,
        )
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


def _operands(call: LinearLogpCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """hidden, weight and bias as the kernels read them: rows with unit stride along H."""
    hidden, weight, bias = call.hidden, call.weight, call.bias
    hidden_c = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight_c = weight if weight.stride(1) == 1 else weight.contiguous()
    return hidden_c, weight_c, None if bias is None else bias.contiguous()


def _call_plan(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> tuple[_Plan, bool]:
    """(plan, whether the forward keeps logits) of ``call`` when ``needs`` says which of hidden,
    weight and bias get a gradient: the budget and the settings read now."""
    budget, explicit = _workspace_budget(call.workspace_bytes)
    save = any(needs) and _save_logits()
    weight_grad = save and needs[1] and _keep_in_weight_grad()
    T, H = call.hidden.shape
    plan = _plan(T, H, call.weight.shape[0], call.hidden.dtype, budget, explicit=explicit, save=save,
                 tp=call.tp_group is not None, weight_grad=weight_grad)
    return plan, save


def linear_logp_call(call: LinearLogpCall) -> torch.Tensor:
    """Selected log-prob of ``target_ids`` under ``softmax((hidden @ weight.T + bias) / temperature)``
    on the kernels above: fp32 [T] on hidden's device, differentiable w.r.t. hidden, weight and bias.
    The workspace budget (``workspace_bytes``, else ``RLK_LINEAR_LOGP_WORKSPACE_BYTES``, else 256 MB)
    sets how much of the logits the forward keeps for the backward (module docstring)."""
    hidden_c, weight_c, bias_c = _operands(call)
    on = torch.is_grad_enabled()
    needs = tuple(on and t is not None and t.requires_grad for t in (hidden_c, weight_c, bias_c))
    plan, save = _call_plan(call, needs)
    return _LinearLogpFunction.apply(
        hidden_c, weight_c, bias_c, call.target_ids, call.temperature, call.tp_group, call.vocab_start, plan, save,
    )


# ----------------------------------------------------------------------------------------------
# The split for torch.ops.rlk.linear_logp (kernels/library/linear_logp.py): the forward returns what
# the backward reads; the backward reads it without writing it
# ----------------------------------------------------------------------------------------------


def split_layout(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> tuple[int, tuple[int, int], int]:
    """The residuals :func:`split_forward` returns for ``call`` when ``needs`` says which of hidden,
    weight and bias get a gradient, from the plan (shapes, dtype, budget and settings, read now):
    (rows of ``stats``, shape of ``kept``, row stride of ``kept``). No gradient: no residuals."""
    if not any(needs):
        return 0, (0, 0), 0
    plan, save = _call_plan(call, needs)
    T, H = call.hidden.shape
    block_v = _tile_config(call.hidden.dtype).block_v
    if not save or plan.saved_cols == 0:
        return 2, (0, 0), 0
    tiles = 2 + triton.cdiv(plan.saved_cols, block_v)
    if plan.in_weight_grad:
        return tiles, (call.weight.shape[0], T), H
    return tiles, (T, plan.saved_cols), plan.buffer_cols


def split_forward(call: LinearLogpCall, needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """The forward of ``call`` without autograd, for a backward that gives ``needs`` (hidden, weight,
    bias) a gradient: (logp fp32 [T], stats fp32 [rows, T], kept) as :func:`split_layout` states them.
    ``stats``: the row lse, the target logit, then the row maxima of the kept vocab tiles; ``kept``:
    the kept q (``_saved_dtype``'s bits) as the plan lays it out: [T, saved_cols] (a view of the
    [T, buffer_cols] buffer), [V, T] (a view of the weight gradient's [V, H] layout: column v's q in
    row v), or [0, 0] where nothing is kept. The eager forward's kernels and plan: the same bits."""
    hidden, weight, bias = _operands(call)
    plan, save = _call_plan(call, needs)
    local_ids = _local_ids(call.target_ids, call.vocab_start)
    target_logit, lse, saved = _forward(hidden, weight, bias, local_ids, 1.0 / call.temperature, call.tp_group,
                                        plan if save else None)
    ignored = call.target_ids == IGNORE_INDEX
    logp = torch.where(ignored, torch.zeros_like(lse), target_logit - lse)
    T = hidden.shape[0]
    nothing = hidden.new_empty_strided((0, 0), (0, 1))
    if not any(needs):
        return logp, lse.new_empty((0, T)), nothing
    if saved is None:
        return logp, torch.stack([lse, target_logit]), nothing
    # the kept columns only (a view: the unused columns hold no values)
    kept = saved.buffer[:, :saved.cols] if saved.weight_grad is None else saved.weight_grad[:, :T]
    return logp, torch.cat([lse.view(1, T), target_logit.view(1, T), saved.tile_max]), kept


def split_backward(call: LinearLogpCall, grad_logp: torch.Tensor, stats: torch.Tensor, kept: torch.Tensor,
                   needs: tuple[bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """(dH, dW, db) (None where ``needs`` is false) of :func:`split_forward`'s call from its ``stats``
    and ``kept``, read and never written: the eager backward's pieces and products (the same bits),
    the kept block's dlogits and dW in fresh memory. The plan is made again from the same budget and
    settings; residuals that do not match it (a setting changed between the forward and its
    backward) are an error."""
    hidden, weight, bias = _operands(call)
    plan, _ = _call_plan(call, needs)
    rows, shape, _ = split_layout(call, needs)
    if tuple(kept.shape) != shape or stats.shape[0] != rows:
        raise RuntimeError(
            f"linear_logp's backward: the forward kept logits {tuple(kept.shape)} and statistics "
            f"{tuple(stats.shape)}, the plan now gives {shape} and {(rows, stats.shape[1])}: the workspace budget "
            f"or a setting ({settings.LINEAR_LOGP_WORKSPACE_BYTES.name}, {SAVE_LOGITS_ENV}, "
            f"{KEEP_IN_WEIGHT_GRAD_ENV}, {TILES_ENV}) changed between the forward and its backward")
    block_v = _tile_config(hidden.dtype).block_v
    tiles = rows - 2
    lse, target_logit = stats[0], stats[1]
    saved = None
    if tiles:
        in_grad = plan.in_weight_grad
        saved = _SavedLogits(buffer=None if in_grad else kept, tile_max=stats[2:], cols=plan.saved_cols,
                             block_v=block_v, weight_grad=kept if in_grad else None)
    local_ids = _local_ids(call.target_ids, call.vocab_start)
    ignored = call.target_ids == IGNORE_INDEX
    grad_rows = torch.where(ignored, torch.zeros_like(lse), grad_logp.float())
    needs = (needs[0], needs[1], bias is not None and needs[2])
    return _backward(hidden, weight, bias, local_ids, lse, grad_rows, target_logit, 1.0 / call.temperature,
                     call.tp_group, needs, plan, saved=saved, consume=False)


linear_logp = entry_point(LinearLogpCall, linear_logp_call, name="linear_logp")


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


__all__ = ["DEFAULT_WORKSPACE_BYTES", "WORKSPACE_ENV", "kept_vocab_columns", "linear_logp", "linear_logp_call",
           "planned_workspace_bytes", "split_backward", "split_forward", "split_layout"]

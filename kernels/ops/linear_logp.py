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

Forward: every (token tile, vocab tile) of the logits is a ``tl.dot`` over H (bf16/fp16 operands on
tensor cores, fp32 accumulate; fp32 operands in full IEEE precision), bias and temperature applied
in fp32; the tile's row max and sum-exp go to a small ``[n_vocab_tiles, T]`` fp32 buffer and the
owning tile writes the target logit. The logits tile never leaves registers and is never rounded.
A cross-tile merge (a few O(n_vocab_tiles * T) torch ops) gives the per-row lse, the only thing
saved for backward. Tiles run token tile fastest, so the programs resident at one time share
weight tiles in L2 and the weight is read from HBM about once.

Two implementations of the tile work, same math and results:
  ``_tma_tiles_kernel`` (bf16/fp16 on Hopper+, the default there): persistent, one program per SM
      looping over tiles; operands arrive through host-side TMA descriptors (zero-filled past the
      ends), the tile and K loops are flattened into one software pipeline so the next tile's loads
      overlap this tile's epilogue. 128 x 256 x 64 tiles, 8 warps, 3 stages.
  ``_fwd_tile_kernel`` / ``_dlogits_kernel``: one program per tile, pointer loads. fp32 inputs, the
      CPU interpreter, pre-Hopper GPUs, unaligned operands and ``RLK_LINEAR_LOGP_TMA=0``.

Saved first chunk: when a backward will follow (grad enabled and an input requires grad), the forward
allocates the backward's chunk buffer and, for the tiles of the first chunk's columns, also writes
q = exp(z - tile row max) there (the value its sum-exp already computed; a TMA store). The backward
turns q into that chunk's dlogits in place (``_saved_dlogits_kernel``: p = q * exp(tile max - lse);
the target column's p from the fp32 target logit) instead of recomputing the chunk: one chunk's
GEMM fewer (1/9 of a product at the issue's shape), no extra workspace (the buffer is the one the
backward needs anyway; it is allocated in the forward instead), and q is rounded to the input dtype
once more than a recomputed dlogits (relative 2^-9 in bf16, the same order as dlogits' own rounding).
``RLK_LINEAR_LOGP_SAVE_CHUNK=0`` recomputes every chunk; a second backward over the same graph does.

Backward, per vocab chunk of at most ``BACKWARD_WORKSPACE_BYTES`` (132 MiB) of dlogits, the chunk
columns spread evenly over the fewest chunks:
    dlogits kernel        recomputes the logits tile (same fp32 math as the forward) and writes
                          dlogits = g * (onehot - exp(z - lse)) / temperature into the chunk buffer
                          (input dtype: bf16/fp16 operands for the tensor-core matmuls; fp32 for fp32)
    cuBLAS addmm          dH32 += dlogits_chunk @ W_chunk (fp32 output: no bf16 rounding per chunk)
    cuBLAS mm             dW_chunk = dlogits_chunk^T @ H  (fp32 accumulate over all T, one store)
    db_chunk = dlogits_chunk.sum(0) in fp32.
(``RLK_LINEAR_LOGP_BWD_MATMUL=triton`` runs dH/dW in our ``_matmul_kernel`` instead.)
Workspace beyond inputs and returned gradients: the chunk buffer (<= 132 MiB; from the forward on
when it saves the first chunk), dH32 (T*H*4 bytes, 67 MB at 4096 x 4096), db32, the saved chunk's
tile maxima (1.1 MB), and in the forward the partials (2 * n_vocab_tiles * T * 4 bytes, 19.5 MB at
T = 4096, V = 151936, bf16; freed before the backward): ``workspace_bytes`` adds them all up, 227 MB
(bf16) / 246 MB (fp32) at the issue's shape, inside the 256 MB budget (a test checks it).

GPU tuning knobs (environment, read at each call; defaults are the configs below):
``RLK_LINEAR_LOGP_TILES`` / ``RLK_LINEAR_LOGP_MATMUL_TILES`` = "BLOCK_T,BLOCK_V,BLOCK_K,warps,stages"
for the logits-tile kernels (TMA or pointer) / our backward matmul; ``RLK_LINEAR_LOGP_TMA=0`` uses
the pointer kernels on Hopper too; ``RLK_LINEAR_LOGP_BWD_MATMUL=triton|torch`` picks the backward's
dH/dW matmuls (default ``torch``, see ``_bwd_matmul``); ``RLK_LINEAR_LOGP_GROUP_T=N`` (token tiles
per group in the TMA kernel's tile order) is an alternative that measured no faster on an H100 (as
did a [chunk, T] dlogits layout, removed: docs/linear_logp.md); ``RLK_LINEAR_LOGP_SAVE_CHUNK=0|1``
turns the saved first chunk off / on (default on).
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
from kernels.ops import INTERPRETED  # fixed at first import, like triton.jit's choice

# Bytes of dlogits held at once in backward; the vocab chunk is sized from it.
# 132 MiB: at T = 4096, V = 151936 (bf16) nine chunks of 16896 columns, 66 vocab tiles x 32 token
# tiles = 16 full waves of 132 SMs each, and GEMM shapes cuBLAS runs near its best.
BACKWARD_WORKSPACE_BYTES = 132 * 1024 * 1024

# Tile sizes and launch options; RLK_LINEAR_LOGP_TILES / RLK_LINEAR_LOGP_MATMUL_TILES override the
# built-in ones on compiled kernels (the interpreter keeps its small tiles).
_TileConfig = settings.TileConfig
TILES_ENV = settings.LINEAR_LOGP_TILES.name  # forward + dlogits kernels
MATMUL_TILES_ENV = settings.LINEAR_LOGP_MATMUL_TILES.name  # backward dH / dW matmuls
BWD_MATMUL_ENV = settings.LINEAR_LOGP_BWD_MATMUL.name


def _bwd_matmul() -> str:
    """Which matmuls the backward uses for dH and dW (read at each backward; GPU tuning knob):
    ``torch`` (default): cuBLAS. dW_chunk = dlogits_chunk^T @ H accumulates over all T in fp32
    inside one GEMM; dH32 += dlogits_chunk @ W_chunk is one ``addmm`` with an fp32 output
    (``out_dtype=torch.float32``), so the chunk's product is never rounded to bf16 before the sum.
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
    # H100/H200 bf16/fp16: 128 x 256 fp32 accumulator over 8 warps, 3-stage K pipeline (144 KiB smem).
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


SAVE_CHUNK_ENV = settings.LINEAR_LOGP_SAVE_CHUNK.name  # "0": the backward recomputes every chunk


def _save_chunk() -> bool:
    """Whether the forward, when a backward will follow, keeps the first backward chunk's
    exp(z - tile max) in the backward's chunk buffer (no extra workspace: the buffer exists in the
    backward anyway), so the backward recomputes one chunk fewer (default on)."""
    return settings.LINEAR_LOGP_SAVE_CHUNK.get()


TMA_ENV = settings.LINEAR_LOGP_TMA.name
# Persistent TMA kernel options (module attributes, for probes). Measured on an H100 (bf16, issue
# shape, Triton 3.6): flattening the tile and K loops into one pipeline 7.6 ms vs 8.2 ms without;
# Triton's automatic warp specialization 7.7 ms (kept off); num_ctas=2 does not compile.
TMA_FLATTEN = True
TMA_WARP_SPECIALIZE = False
# Stores of the saved-chunk tiles (forward) / the dlogits tiles (backward): TMA (through a
# descriptor) or masked pointer stores. Measured on an H100 (bf16, issue shape): the forward that
# saves the chunk 7.12 ms with TMA stores vs 7.54 ms with pointer stores; the dlogits chunk kernel
# no faster with TMA stores (0.85 vs 0.83 ms; forward+backward 30.5 vs 29.8 ms interleaved).
TMA_STORE_Q = True
TMA_STORE_DLOGITS = False
# Token tiles per group in the tile order (>= n_t: token tile fastest over all T, the default; 8 and
# 4 measured no faster). RLK_LINEAR_LOGP_GROUP_T overrides it.
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
    hidden_ptr, weight_ptr, bias_ptr, local_ids_ptr,
    tile_max_ptr, tile_sumexp_ptr, target_logit_ptr, q_ptr,
    T, V_local, H, q_cols,
    stride_ht, stride_wv, stride_qt, inv_temperature,
    HAS_BIAS: tl.constexpr, STORE_Q: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_t = tl.program_id(0)  # token tile fastest: co-resident programs share weight tiles in L2
    pid_v = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_t = offs_t < T
    z = _logits_tile(
        hidden_ptr, weight_ptr, bias_ptr, offs_t, offs_v, T, V_local, H, stride_ht, stride_wv,
        inv_temperature, HAS_BIAS, BLOCK_T, BLOCK_V, BLOCK_K, INPUT_PRECISION, UPCAST, EVEN_K,
    )
    # Every vocab tile holds at least one real column, so the row max is finite.
    row_max = tl.max(z, axis=1)
    e = tl.exp(z - row_max[:, None])
    row_sumexp = tl.sum(e, axis=1)
    tl.store(tile_max_ptr + pid_v * T + offs_t, row_max, mask=mask_t)
    tl.store(tile_sumexp_ptr + pid_v * T + offs_t, row_sumexp, mask=mask_t)
    if STORE_Q:  # the saved first chunk (see _tma_tiles_kernel)
        if pid_v * BLOCK_V < q_cols:
            q_ptrs = q_ptr + offs_t.to(tl.int64)[:, None] * stride_qt + offs_v[None, :]
            tl.store(q_ptrs, e.to(q_ptr.dtype.element_ty), mask=mask_t[:, None] & (offs_v < q_cols)[None, :])
    # Local id of the target (out of range on other shards / ignored rows): only the owner stores.
    local_id = tl.load(local_ids_ptr + offs_t, mask=mask_t, other=-1)
    is_target = offs_v[None, :] == local_id[:, None]
    target = tl.sum(tl.where(is_target, z, 0.0), axis=1)
    owns = mask_t & (local_id >= pid_v * BLOCK_V) & (local_id < pid_v * BLOCK_V + BLOCK_V) & (local_id < V_local)
    tl.store(target_logit_ptr + offs_t, target, mask=owns)


@triton.jit
def _dlogits_kernel(
    hidden_ptr, weight_ptr, bias_ptr, local_ids_ptr, lse_ptr, grad_ptr, dlogits_ptr,
    T, V_local, H, chunk_start, chunk_cols,
    stride_ht, stride_wv, stride_dt, inv_temperature,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
):
    """dlogits[t, c] = g[t] * (1[chunk_start + c == id_t] - softmax) / temperature, c < chunk_cols."""
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
    g = tl.load(grad_ptr + offs_t, mask=mask_t, other=0.0)  # 0 on ignored rows (set by the wrapper)
    local_id = tl.load(local_ids_ptr + offs_t, mask=mask_t, other=-1)
    prob = tl.exp(z - lse[:, None])  # exp(-inf) = 0 past V_local
    onehot = (offs_v[None, :] == local_id[:, None]).to(tl.float32)
    dlogits = (g * inv_temperature)[:, None] * (onehot - prob)
    out_ptrs = dlogits_ptr + offs_t.to(tl.int64)[:, None] * stride_dt + offs_c[None, :]
    tl.store(out_ptrs, dlogits.to(dlogits_ptr.dtype.element_ty),
             mask=mask_t[:, None] & (offs_c[None, :] < chunk_cols))


@triton.jit
def _tma_tiles_kernel(
    h_desc, w_desc, out_desc, bias_ptr, local_ids_ptr, lse_ptr, grad_ptr,
    tile_max_ptr, tile_sumexp_ptr, target_logit_ptr, out_ptr,
    T, V_local, H, col_start, n_cols, q_cols, stride_ot, inv_temperature, group_t,
    DLOGITS: tl.constexpr, STORE_Q: tl.constexpr, TMA_STORE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Persistent (one program per SM) logits tiles over columns [col_start, col_start + n_cols),
    operands fed by TMA descriptors (out-of-range rows/columns arrive as zeros).

    DLOGITS = False (forward, col_start = 0, n_cols = V_local): per-tile row max / sum-exp partials
    and the target logit, as ``_fwd_tile_kernel``; with STORE_Q also, for the tiles of the first
    ``q_cols`` columns, ``exp(z - tile row max)`` into ``out`` ([T, >= q_cols], the backward's first
    chunk, saved so that the backward need not recompute it). DLOGITS = True (backward): the dlogits
    tile of ``_dlogits_kernel`` into ``out``, the chunk buffer (column c = vocab column col_start + c).
    The tile goes to ``out`` through ``out_desc`` (TMA_STORE: a TMA store, clipped at the
    descriptor's [T, columns] shape) or through masked pointer stores.
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
        offs_v = col_start + offs_c
        mask_t = offs_t < T
        mask_c = offs_c < n_cols
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_v, mask=mask_c, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        z = tl.where(mask_c[None, :], acc * inv_temperature, float("-inf"))
        local_id = tl.load(local_ids_ptr + offs_t, mask=mask_t, other=-1)
        if DLOGITS:
            lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
            g = tl.load(grad_ptr + offs_t, mask=mask_t, other=0.0)
            prob = tl.exp(z - lse[:, None])
            onehot = (offs_v[None, :] == local_id[:, None]).to(tl.float32)
            dlogits = ((g * inv_temperature)[:, None] * (onehot - prob)).to(out_ptr.dtype.element_ty)
            if TMA_STORE:
                out_desc.store([off_t, off_c], dlogits)
            else:
                out_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + offs_c[None, :]
                tl.store(out_ptrs, dlogits, mask=mask_t[:, None] & mask_c[None, :])
        else:
            row_max = tl.max(z, axis=1)
            e = tl.exp(z - row_max[:, None])
            row_sumexp = tl.sum(e, axis=1)
            tl.store(tile_max_ptr + pid_v * T + offs_t, row_max, mask=mask_t)
            tl.store(tile_sumexp_ptr + pid_v * T + offs_t, row_sumexp, mask=mask_t)
            if STORE_Q:
                if off_c < q_cols:
                    q = e.to(out_ptr.dtype.element_ty)
                    if TMA_STORE:
                        out_desc.store([off_t, off_c], q)
                    else:
                        q_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + offs_c[None, :]
                        tl.store(q_ptrs, q, mask=mask_t[:, None] & (offs_c < q_cols)[None, :])
            owns = mask_t & (local_id >= off_c) & (local_id < off_c + BLOCK_V) & (local_id < n_cols)
            target = tl.sum(tl.where(offs_v[None, :] == local_id[:, None], z, 0.0), axis=1)
            tl.store(target_logit_ptr + offs_t, target, mask=owns)


@triton.jit
def _saved_dlogits_kernel(
    q_ptr, tile_max_ptr, lse_ptr, grad_ptr, target_logit_ptr, local_ids_ptr,
    T, n_cols, stride_qt, inv_temperature,
    TILE_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """In place: the forward's saved q = exp(z - m_tile) (columns [0, n_cols)) becomes dlogits
    = g * (onehot - q * exp(m_tile - lse)) / temperature; in the target column the probability is
    exp(target_logit - lse), from the fp32 target logit (exact, no rounded q). BLOCK_C divides TILE_V,
    so one block of columns shares one forward tile (one m_tile per row)."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_c < n_cols)[None, :]
    ptrs = q_ptr + offs_t.to(tl.int64)[:, None] * stride_qt + offs_c[None, :]
    q = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    m_tile = tl.load(tile_max_ptr + ((pid_c * BLOCK_C) // TILE_V) * T + offs_t, mask=mask_t, other=0.0)
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    g = tl.load(grad_ptr + offs_t, mask=mask_t, other=0.0)
    p_target = tl.exp(tl.load(target_logit_ptr + offs_t, mask=mask_t, other=0.0) - lse)
    local_id = tl.load(local_ids_ptr + offs_t, mask=mask_t, other=-1)
    is_target = offs_c[None, :] == local_id[:, None]
    prob = q * tl.exp(m_tile - lse)[:, None]
    d = tl.where(is_target, (1.0 - p_target)[:, None], -prob) * (g * inv_temperature)[:, None]
    tl.store(ptrs, d.to(q_ptr.dtype.element_ty), mask=mask)


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


def _launch_tiles(hidden, weight, bias, local_ids, inv_temperature, *, col_start, n_cols, forward_out=None,
                  dlogits=None, lse=None, grad_rows=None, saved_q=None, q_cols=0):
    """Runs the logits-tile work over columns [col_start, col_start + n_cols): the forward partials
    (``forward_out`` = (tile_max, tile_sumexp, target_logit)), with ``saved_q`` ([T, >= q_cols]) also
    the first ``q_cols`` columns' exp(z - tile row max), or the dlogits chunk (``dlogits``, [T, chunk])."""
    T, H = hidden.shape
    V_local = weight.shape[0]
    cfg = _tile_config(hidden.dtype)
    has_bias = bias is not None
    bias_arg = bias if has_bias else hidden
    store_q = saved_q is not None and q_cols > 0
    precision, upcast = _input_precision(hidden.dtype), _upcast_operands(hidden.dtype)
    if _use_tma(hidden, weight):
        tile_max, tile_sumexp, target_logit = forward_out if forward_out is not None else (hidden,) * 3
        is_dlogits = dlogits is not None
        out = dlogits if is_dlogits else (saved_q if store_q else None)
        n_tiles = triton.cdiv(T, cfg.block_t) * triton.cdiv(n_cols, cfg.block_v)
        programs = min(n_tiles, _num_programs(hidden.device))
        h_desc = TensorDescriptor.from_tensor(hidden, [cfg.block_t, cfg.block_k])
        tma_store = out is not None and (TMA_STORE_DLOGITS if is_dlogits else TMA_STORE_Q)
        out_desc = (TensorDescriptor(out, [T, n_cols if is_dlogits else q_cols], [out.stride(0), 1],
                                     [cfg.block_t, cfg.block_v]) if tma_store else h_desc)
        _tma_tiles_kernel[(programs,)](
            h_desc, TensorDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_k]), out_desc,
            bias_arg, local_ids, lse if is_dlogits else hidden, grad_rows if is_dlogits else hidden,
            tile_max, tile_sumexp, target_logit, out if out is not None else hidden,
            T, V_local, H, col_start, n_cols, q_cols if store_q else 0,
            out.stride(0) if out is not None else 0, inv_temperature,
            min(_tma_group_t(), triton.cdiv(T, cfg.block_t)),
            DLOGITS=is_dlogits, STORE_Q=store_q, TMA_STORE=tma_store,
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
    if dlogits is None:
        tile_max, tile_sumexp, target_logit = forward_out
        q_arg = saved_q if store_q else hidden
        _fwd_tile_kernel[grid](
            hidden, weight, bias_arg, local_ids, tile_max, tile_sumexp, target_logit, q_arg,
            T, V_local, H, q_cols if store_q else 0,
            hidden.stride(0), weight.stride(0), q_arg.stride(0), inv_temperature, STORE_Q=store_q, **common,
        )
    else:
        _dlogits_kernel[grid](
            hidden, weight, bias_arg, local_ids, lse, grad_rows, dlogits,
            T, V_local, H, col_start, n_cols,
            hidden.stride(0), weight.stride(0), dlogits.stride(0), inv_temperature, **common,
        )


@dataclass
class _SavedChunk:
    """The forward's gift to the backward: exp(z - tile row max) of vocab columns [0, cols) in the
    backward's chunk buffer (``q``), and those tiles' row maxima. Consumed (turned into dlogits in
    place) by the first backward; a second backward over the same graph recomputes instead."""
    q: torch.Tensor  # [T, chunk] input dtype, columns [0, cols) filled
    tile_max: torch.Tensor  # [cols / block_v tiles, T] fp32
    cols: int
    block_v: int


def _forward(hidden, weight, bias, local_ids, inv_temperature, tp_group, save_chunk=False):
    """Returns (target_logit [T] fp32, lse [T] fp32, saved chunk or None), target_logit and lse global
    over the TP group. ``save_chunk``: also keep the first backward chunk's exp(z - tile max)."""
    T = hidden.shape[0]
    V_local = weight.shape[0]
    cfg = _tile_config(hidden.dtype)
    n_v = triton.cdiv(V_local, cfg.block_v)
    tile_max = torch.empty((n_v, T), dtype=torch.float32, device=hidden.device)
    tile_sumexp = torch.empty((n_v, T), dtype=torch.float32, device=hidden.device)
    target_logit = torch.zeros(T, dtype=torch.float32, device=hidden.device)
    saved = None
    if save_chunk:
        chunk = _vocab_chunk_cols(T, V_local, hidden.element_size(), cfg.block_v)
        q = torch.empty((T, chunk), dtype=hidden.dtype, device=hidden.device)
        saved = _SavedChunk(q=q, tile_max=tile_max, cols=min(chunk, V_local), block_v=cfg.block_v)
    _launch_tiles(hidden, weight, bias, local_ids, inv_temperature, col_start=0, n_cols=V_local,
                  forward_out=(tile_max, tile_sumexp, target_logit),
                  saved_q=None if saved is None else saved.q, q_cols=0 if saved is None else saved.cols)
    if saved is not None:  # keep only the saved tiles' maxima (the partials are freed)
        saved.tile_max = tile_max[:triton.cdiv(saved.cols, cfg.block_v)].clone()
    row_max = tile_max.max(dim=0).values
    if tp_group is not None:
        torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    sumexp = (tile_sumexp * torch.exp(tile_max - row_max)).sum(dim=0)
    if tp_group is not None:
        torch.distributed.all_reduce(sumexp, op=torch.distributed.ReduceOp.SUM, group=tp_group)
        torch.distributed.all_reduce(target_logit, op=torch.distributed.ReduceOp.SUM, group=tp_group)
    return target_logit, row_max + torch.log(sumexp), saved


def _finish_saved_chunk(saved, lse, grad_rows, target_logit, local_ids, inv_temperature):
    """Turns the saved chunk into the dlogits of columns [0, saved.cols) in place; returns the buffer."""
    T = saved.q.shape[0]
    block_t, block_c = (32, min(32, saved.block_v)) if INTERPRETED else (64, min(128, saved.block_v))
    grid = (triton.cdiv(T, block_t), triton.cdiv(saved.cols, block_c))
    _saved_dlogits_kernel[grid](
        saved.q, saved.tile_max, lse, grad_rows, target_logit, local_ids,
        T, saved.cols, saved.q.stride(0), inv_temperature,
        TILE_V=saved.block_v, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4,
    )
    return saved.q


def _vocab_chunk_cols(T: int, V_local: int, element_size: int, block_v: int) -> int:
    """Columns per backward chunk: the fewest chunks whose dlogits fit BACKWARD_WORKSPACE_BYTES, then
    the columns spread evenly over them (a multiple of block_v), so no chunk is a thin leftover."""
    max_cols = max(block_v, BACKWARD_WORKSPACE_BYTES // max(1, T * element_size) // block_v * block_v)
    n_chunks = triton.cdiv(V_local, max_cols)
    return min(max_cols, triton.cdiv(triton.cdiv(V_local, n_chunks), block_v) * block_v)


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


def _backward(hidden, weight, bias, local_ids, lse, grad_rows, inv_temperature, tp_group, needs,
              saved=None, target_logit=None):
    """dH, dW, db chunk by chunk over the vocab. ``saved`` (the forward's first chunk, see
    ``_SavedChunk``) replaces the recompute of that chunk and is the chunk buffer for the rest."""
    T, H = hidden.shape
    V_local = weight.shape[0]
    cfg = _tile_config(hidden.dtype)
    need_dh, need_dw, need_db = needs
    use_torch_mm = _bwd_matmul() == "torch"
    if saved is not None:
        dlogits = _finish_saved_chunk(saved, lse, grad_rows, target_logit, local_ids, inv_temperature)
        chunk = dlogits.shape[1]
        chunks = [(0, saved.cols)] + [(s, min(chunk, V_local - s)) for s in range(saved.cols, V_local, chunk)]
    else:
        chunk = _vocab_chunk_cols(T, V_local, hidden.element_size(), cfg.block_v)
        dlogits = torch.empty((T, chunk), dtype=hidden.dtype, device=hidden.device)
        chunks = [(s, min(chunk, V_local - s)) for s in range(0, V_local, chunk)]
    alloc = torch.empty if use_torch_mm else torch.zeros  # cuBLAS overwrites on the first chunk
    d_hidden32 = alloc((T, H), dtype=torch.float32, device=hidden.device) if need_dh else None
    d_weight = torch.empty_like(weight) if need_dw else None
    d_bias32 = torch.empty(V_local, dtype=torch.float32, device=hidden.device) if need_db else None
    for index, (start, cols) in enumerate(chunks):
        if index > 0 or saved is None:
            _launch_tiles(hidden, weight, bias, local_ids, inv_temperature, col_start=start, n_cols=cols,
                          dlogits=dlogits, lse=lse, grad_rows=grad_rows)
        d_chunk = dlogits[:, :cols]
        if need_dh:
            if use_torch_mm:
                _accumulate_dh(d_hidden32, d_chunk, weight[start:start + cols], first=index == 0)
            else:
                _matmul(d_chunk, weight[start:start + cols], d_hidden32, accumulate=True)
        if need_dw:
            if use_torch_mm:
                torch.mm(d_chunk.t(), hidden, out=d_weight[start:start + cols])
            else:
                _matmul(d_chunk.t(), hidden, d_weight[start:start + cols], accumulate=False)
        if need_db:
            d_bias32[start:start + cols] = d_chunk.sum(dim=0, dtype=torch.float32)  # fp32 accumulate, no fp32 copy
    d_hidden = None
    if need_dh:
        if tp_group is not None:
            torch.distributed.all_reduce(d_hidden32, op=torch.distributed.ReduceOp.SUM, group=tp_group)
        d_hidden = d_hidden32.to(hidden.dtype)
    d_bias = d_bias32.to(bias.dtype) if need_db else None
    return d_hidden, d_weight, d_bias


class _LinearLogpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, temperature, tp_group, vocab_start, save_chunk):
        inv_temperature = 1.0 / temperature
        local_ids = _local_ids(target_ids, vocab_start)
        target_logit, lse, saved = _forward(hidden, weight, bias, local_ids, inv_temperature, tp_group, save_chunk)
        ignored = target_ids == IGNORE_INDEX
        logp = torch.where(ignored, torch.zeros_like(lse), target_logit - lse)
        ctx.save_for_backward(hidden, weight, bias, local_ids, lse, ignored, target_logit)
        ctx.saved_chunk = saved
        ctx.inv_temperature = inv_temperature
        ctx.tp_group = tp_group
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, bias, local_ids, lse, ignored, target_logit = ctx.saved_tensors
        saved, ctx.saved_chunk = ctx.saved_chunk, None  # consumed in place: a second backward recomputes
        grad_rows = torch.where(ignored, torch.zeros_like(lse), grad_logp.float()).contiguous()
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        d_hidden, d_weight, d_bias = _backward(
            hidden, weight, bias, local_ids, lse, grad_rows, ctx.inv_temperature, ctx.tp_group, needs,
            saved=saved, target_logit=target_logit,
        )
        return d_hidden, d_weight, d_bias, None, None, None, None, None


def linear_logp_call(call: LinearLogpCall) -> torch.Tensor:
    """Selected log-prob of ``target_ids`` under ``softmax((hidden @ weight.T + bias) / temperature)``
    on the kernels above: fp32 [T] on hidden's device, differentiable w.r.t. hidden, weight and bias."""
    hidden, weight, target_ids, bias = call.hidden, call.weight, call.target_ids, call.bias
    # The kernels read rows with unit stride along H.
    hidden_c = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight_c = weight if weight.stride(1) == 1 else weight.contiguous()
    bias_c = None if bias is None else bias.contiguous()
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_c, weight_c, bias_c))
    return _LinearLogpFunction.apply(
        hidden_c, weight_c, bias_c, target_ids, call.temperature, call.tp_group, call.vocab_start,
        wants_grad and _save_chunk(),
    )


linear_logp = entry_point(LinearLogpCall, linear_logp_call, name="linear_logp")


def workspace_bytes(T: int, H: int, V_local: int, dtype: torch.dtype) -> int:
    """Upper bound of the extra memory (beyond inputs and returned grads) forward+backward allocate
    on a GPU (compiled tile sizes)."""
    cfg = _tile_config(dtype, interpreted=False)
    element = torch.empty((), dtype=dtype).element_size()
    n_v = math.ceil(V_local / cfg.block_v)
    forward = 2 * n_v * T * 4 + 3 * T * 4 + T * 4  # partials, target/lse/logp, int32 ids
    chunk = _vocab_chunk_cols(T, V_local, element, cfg.block_v)
    saved_tile_max = math.ceil(min(chunk, V_local) / cfg.block_v) * T * 4  # kept for the saved chunk
    backward = T * chunk * element + T * H * 4 + V_local * 4 + T * 4 + saved_tile_max
    return forward + backward


__all__ = ["BACKWARD_WORKSPACE_BYTES", "linear_logp", "linear_logp_call", "workspace_bytes"]

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

Modules (the Liger / Triton-tutorial layout): ``plan.py`` (workspace budget, tile configs, settings,
the plan of kept columns), ``kernels.py`` (the Triton kernels), ``launch.py`` (which kernel runs,
descriptors, grids; the ``TMA_*`` options), ``passes.py`` (forward and backward over the vocab's
pieces), ``autograd.py`` (the autograd function, ``linear_logp_call`` and the torch.library split).
"""

from __future__ import annotations

from kernels.ops.linear_logp.autograd import (
    linear_logp,
    linear_logp_call,
    split_backward,
    split_forward,
    split_layout,
)
from kernels.ops.linear_logp.launch import GROUP_T_ENV, TMA_ENV
from kernels.ops.linear_logp.plan import (
    BWD_MATMUL_ENV,
    DEFAULT_WORKSPACE_BYTES,
    KEEP_IN_WEIGHT_GRAD_ENV,
    MATMUL_TILES_ENV,
    MIN_DEFAULT_CHUNK_COLS,
    SAVE_LOGITS_ENV,
    TILES_ENV,
    WORKSPACE_ENV,
    kept_vocab_columns,
    planned_workspace_bytes,
)

__all__ = [
    "BWD_MATMUL_ENV",
    "DEFAULT_WORKSPACE_BYTES",
    "GROUP_T_ENV",
    "KEEP_IN_WEIGHT_GRAD_ENV",
    "MATMUL_TILES_ENV",
    "MIN_DEFAULT_CHUNK_COLS",
    "SAVE_LOGITS_ENV",
    "TILES_ENV",
    "TMA_ENV",
    "WORKSPACE_ENV",
    "kept_vocab_columns",
    "linear_logp",
    "linear_logp_call",
    "planned_workspace_bytes",
    "split_backward",
    "split_forward",
    "split_layout",
]

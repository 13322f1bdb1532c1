"""linear_logp's kernel launches: which kernel serves a call (the TMA kernel or the pointer
kernels), its descriptors, grids and compile-time options.

``_launch_tiles`` runs the logits-tile work over vocab columns [col_start, col_start + n_cols) of
hidden [T, H] and weight [V_local, H] (input dtype): the forward partials (fp32 [n_vocab_tiles, T]
row max and sum-exp, fp32 [T] target logit), optionally q into a [T, >= cols] view, or a chunk's
dlogits into [T, >= n_cols] (input dtype). ``_matmul`` is our Triton C[M, N] (+)= A[M, K] @ B[K, N].

The ``TMA_*`` options below are attributes of this module (probes and tests set them here).
"""

from __future__ import annotations

import math

import torch
import triton

try:  # host-side TMA descriptors (Triton >= 3.4); without them the pointer kernels run
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

from kernels import settings
from kernels.contracts import IGNORE_INDEX
from kernels.ops import INTERPRETED
from kernels.ops.linear_logp.kernels import _dlogits_kernel, _fwd_tile_kernel, _matmul_kernel, _tma_tiles_kernel
from kernels.ops.linear_logp.plan import _input_precision, _matmul_config, _tile_config, _upcast_operands

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

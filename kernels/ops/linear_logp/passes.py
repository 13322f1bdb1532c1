"""linear_logp's forward and backward passes on the kernels, without autograd (autograd.py wraps them).

``_forward``: hidden [T, H], weight [V_local, H], bias [V_local] or None (input dtype), local ids [T]
int32 -> (target logit fp32 [T], lse fp32 [T], ``_SavedLogits`` or None), global over the TP group.
``_backward``: the same operands, lse / upstream gradient / target logit fp32 [T] -> (dH [T, H],
dW [V_local, H], db [V_local]) in the input dtype, None where not needed; dH all-reduced over the TP
group. The vocab is walked in pieces (the kept block, then even recompute chunks), each followed by
its dH and dW products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.ops import INTERPRETED
from kernels.ops.linear_logp.kernels import _merge_partials_kernel, _saved_dlogits_kernel, _target_column_kernel
from kernels.ops.linear_logp.launch import _launch_tiles, _matmul, _row_grid
from kernels.ops.linear_logp.plan import _bwd_matmul, _even_chunks, _round_up, _saved_dtype, _tile_config


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

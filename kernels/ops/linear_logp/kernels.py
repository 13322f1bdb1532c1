"""linear_logp's Triton kernels (device code only; the host code that launches them: launch.py,
passes.py).

Operands as the host passes them (T tokens, H hidden, V_local vocab columns of this rank):
hidden [T, H] and weight [V_local, H] in the input dtype (fp32 | bf16 | fp16, rows with unit stride
along H), bias [V_local] of the same dtype (or a dummy pointer with ``HAS_BIAS=False``), local ids [T]
int32 (-1: a row whose target is not a column of this shard). Per-row vectors (lse, coef, target
logit) are fp32 [T]; tile partials (row max, sum-exp) fp32 [n_vocab_tiles, T]; q (kept logits)
fp16 (16-bit inputs) or fp32 [T, >= cols], or transposed in the weight gradient's [V, H] rows;
dlogits in the input dtype [T, >= cols].

* ``_logits_tile`` / ``_dot``: one fp32 [BLOCK_T, BLOCK_V] tile of (hidden @ weight.T + bias) / temperature.
* ``_fwd_tile_kernel`` / ``_dlogits_kernel``: the pointer kernels (one program per tile, natural-log
  units): forward partials (+ q), or a recomputed chunk's dlogits.
* ``_tma_tiles_kernel``: the persistent TMA kernel (Hopper+, bf16/fp16, base-2 units), forward or dlogits.
* ``_merge_partials_kernel``: the tile partials into the row max and sum-exp.
* ``_target_column_kernel`` / ``_saved_dlogits_kernel``: the target column of a recomputed chunk; the
  kept q into dlogits.
* ``_matmul_kernel``: the backward's dH / dW products with ``RLK_LINEAR_LOGP_BWD_MATMUL=triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.ops.exp2 import LN2, LOG2E


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

// vime's GRPO loss and its dlogits in ONE read of the logits: a thread-block-cluster kernel.
//
// One cluster of C CTAs owns one row of logits [T, V] (C = 1, 2, 4 or 8, compiled in: the
// function name ends in _c<C>). CTA r of the cluster copies its slice of the row, columns
// [r * slice, (r + 1) * slice), from HBM into its shared memory once (one bulk copy per stage,
// STAGES of them, each completing on its own mbarrier, so the statistics start on the first stage
// while the rest is in flight). Then:
//   1. each CTA reduces its slice to (max, sum of exp);
//   2. it pushes that pair into the shared memory of every CTA of the cluster (st.async, completing
//      on the receiver's mbarrier: no cluster barrier and no fence on the way), waits for the C
//      pairs, combines them in lane order (the same in every CTA, so all C get bit-identical row
//      statistics), and forms logp, the token's loss terms and c = dL/dlogp;
//   3. each CTA writes dlogits = c * (onehot - exp(z - m) / S) [/ temperature] for its slice
//      from the copy still in shared memory, in the logits dtype (one rounding), with the loss's
//      gradient folded into c: the caller's prediction of it (grad_pred, see below).
// HBM traffic: the logits read once, dlogits written once, a few [T] vectors.
//
// One file of ~720 lines on purpose: kernels/ops/cuda/build.py builds one .cu as one nvcc unit (its
// fatbin cached by this file's hash), and the forward and the backward's write kernels share their
// loads, stores and loss math as __forceinline__ device functions.
//
// The loss math is the Triton kernel's (kernels/ops/grpo_loss_kernels.py: token_pg_and_grad,
// kernels/ops/ratio_kl.py: kl_value_and_grad), statement for statement; so are the softmax
// gradient's rounding order (kernels/ops/logp.py: row_write_grad) and the outputs' layout.
// dlogits is written for the incoming gradient grad_pred, the caller's prediction (the last backward's
// gradient, kernels/device_errors.py); the backward's grpo_write_from_stats_* rewrites the rows from
// the saved statistics when the actual gradient differs (same arithmetic: the same bits).
//
// Requirements checked by the caller (kernels/ops/cuda/grpo_loss_one_read.py): logits and dlogits
// rows 16-byte aligned (data pointer, row stride and V * itemsize), ids int64, [T] inputs fp32
// contiguous.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <climits>
#include <type_traits>
#include <stdint.h>

namespace cg = cooperative_groups;

#ifndef RLK_THREADS
// 512 threads: 256 measured within 1.5% of it on an H100 and an H200 (docs/performance-notes.md)
#define RLK_THREADS 512
#endif
// registers capped so that three CTAs of 75968-byte slices fit on one multiprocessor (H100/H200:
// 64K registers, 228 KiB of shared memory): while one writes its row, the others load theirs
#ifndef RLK_MIN_CTAS
#define RLK_MIN_CTAS 3
#endif
#ifndef RLK_STAGES
#define RLK_STAGES 4
#endif
// 1: one thread brings the slice in with a bulk copy per stage (cp.async.bulk, completing on one
// mbarrier per stage); 0: every thread copies 16-byte pieces (cp.async, ~9 per thread). The bulk
// copies cut the kernel's instructions by 16% and its time by 2-11% on an H100 and an H200
// (docs/performance-notes.md)
#ifndef RLK_BULK_LOAD
#define RLK_BULK_LOAD 1
#endif

// flags (bit set by the caller)
#define FLAG_SCALE 1      // temperature != 1: z = logits / temperature (IEEE division)
#define FLAG_HAS_REF 2    // KL term (ref_logp given)
#define FLAG_UNBIASED 4   // KL times exp(logp - old)
#define FLAG_DUAL_CLIP 8  // dual clip with eps_c
#define FLAG_TIS 16       // truncated importance sampling weight
#define FLAG_STATS_ONLY 32  // per_token only, no dlogits (grpo_write_from_stats_* writes them later)
#define FLAG_WRITE_ALWAYS 64  // grpo_write_from_stats_*: write whatever the gradient (no dlogits to keep)
#define KL_TYPE_SHIFT 8   // bits 8..9: 0 k1, 1 k2, 2 k3, 3 low_var_kl

template <typename T> struct Vec;
template <> struct Vec<float> { static constexpr int N = 4; };
template <> struct Vec<__nv_bfloat16> { static constexpr int N = 8; };
template <> struct Vec<__half> { static constexpr int N = 8; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// exp(x) for the sweeps: ex2.approx.ftz of x * log2(e), two instructions (nvcc's __expf adds a
// denormal fix-up: five more per element). Results below 2^-126 flush to 0: they are below any
// gradient tolerance and sum-exp contributions of ~1e-38.
#define LOG2E 1.4426950408889634f
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float exp_sweep(float x) { return exp2_ftz(x * LOG2E); }

// 16 bytes of shared memory <-> VEC floats (bf16: a shift or a mask per element)
__device__ __forceinline__ void unpack(const int4& raw, float (&z)[4]) {
    z[0] = __int_as_float(raw.x); z[1] = __int_as_float(raw.y); z[2] = __int_as_float(raw.z); z[3] = __int_as_float(raw.w);
}
template <typename T> __device__ __forceinline__ void unpack16(const int4& raw, float (&z)[8]);
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(const int4& raw, float (&z)[8]) {
    const unsigned w[4] = {static_cast<unsigned>(raw.x), static_cast<unsigned>(raw.y),
                           static_cast<unsigned>(raw.z), static_cast<unsigned>(raw.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // element 2i is the low half of word i
        z[2 * i] = __uint_as_float(w[i] << 16);
        z[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
template <> __device__ __forceinline__ void unpack16<__half>(const int4& raw, float (&z)[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        z[2 * i] = f.x;
        z[2 * i + 1] = f.y;
    }
}
template <typename T> __device__ __forceinline__ void load_piece(const T* p, float (&z)[Vec<T>::N]) {
    const int4 raw = *reinterpret_cast<const int4*>(p);
    if constexpr (sizeof(T) == 4) unpack(raw, z); else unpack16<T>(raw, z);
}
__device__ __forceinline__ int4 pack(const float (&d)[4]) {
    return make_int4(__float_as_int(d[0]), __float_as_int(d[1]), __float_as_int(d[2]), __float_as_int(d[3]));
}
template <typename T> __device__ __forceinline__ unsigned pack2(float a, float b);
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&v);
}
template <typename T> __device__ __forceinline__ int4 pack_piece(const float (&d)[Vec<T>::N]) {
    if constexpr (sizeof(T) == 4) {
        return pack(d);
    } else {
        return make_int4(static_cast<int>(pack2<T>(d[0], d[1])), static_cast<int>(pack2<T>(d[2], d[3])),
                         static_cast<int>(pack2<T>(d[4], d[5])), static_cast<int>(pack2<T>(d[6], d[7])));
    }
}

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
    // copies src_bytes (0..16) and zero-fills the rest of the 16-byte piece; bypasses L1
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void cp_async_wait_stage(int pending) {
    // wait until at most `pending` of this thread's commit groups are still in flight
    switch (pending) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        case 6: cp_async_wait<6>(); break;
        default: cp_async_wait<7>(); break;
    }
}
// bulk copy global -> this CTA's shared memory, completing `bytes` (a multiple of 16) on an mbarrier
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, int bytes, uint64_t* bar) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(gmem_src), "r"(bytes), "r"(b) : "memory");
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(b), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, int bytes) {
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait_phase0(uint64_t* bar) {
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile(
        "{\n .reg .pred done;\n"
        "WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
        " @!done bra WAIT_%=;\n}\n" ::"r"(b) : "memory");
}
// every CTA of the cluster has initialized its barriers: arrive early (relaxed: the only writes to
// publish are the mbarrier inits, which fence.mbarrier_init releases), wait just before the first push
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// (a, b) into the shared memory of CTA `rank` of the cluster, at that CTA's `slot`, completing 8
// bytes on that CTA's mbarrier `bar` (st.async: no fence, no cluster barrier; the receiver's wait
// on `bar` makes the pair visible to it)
__device__ __forceinline__ void push_pair(float2* slot, uint64_t* bar, unsigned rank, float a, float b) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(slot));
    const unsigned br = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    unsigned rs, rb;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(rs) : "r"(s), "r"(rank));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(rb) : "r"(br), "r"(rank));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n"
                 ::"r"(rs), "f"(a), "f"(b), "r"(rb) : "memory");
}

// the (max, sum of exp) of a warp's 32 (m, s) pairs (s = sum exp(z - m)), in every lane: the max by
// a butterfly, each lane's sum rescaled to it once, then a butterfly sum. Floating-point addition
// and fmaxf are commutative, so every lane ends with the same bits; lanes with m = -inf hold s = 0
__device__ __forceinline__ void warp_combine(float& m, float& s) {
    float mx = m;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float t = mx == -INFINITY ? 0.0f : s * exp_sweep(m - mx);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
    m = mx;
    s = t;
}

// vime's clipped policy loss for one token: (pg, clipped flag, d pg / d logp); ties as torch
__device__ __forceinline__ void token_pg_and_grad(
    float logp, float old_logp, float adv, float rollout_logp, float eps_low, float eps_high, float eps_c,
    float tis_low, float tis_high, int flags, float& pg, float& clipped, float& dpg) {
    float ratio = __expf(logp - old_logp);
    float l1 = -ratio * adv;
    float clipped_ratio = fminf(fmaxf(ratio, 1.0f - eps_low), 1.0f + eps_high);
    float l2 = -clipped_ratio * adv;
    float d1 = -ratio * adv;
    bool in_range = (ratio >= 1.0f - eps_low) && (ratio <= 1.0f + eps_high);
    float d2 = in_range ? d1 : 0.0f;
    pg = fmaxf(l1, l2);
    dpg = l1 > l2 ? d1 : (l2 > l1 ? d2 : 0.5f * (d1 + d2));
    clipped = l2 > l1 ? 1.0f : 0.0f;
    if (flags & FLAG_DUAL_CLIP) {
        float l3 = -eps_c * adv;
        float dual = fminf(l3, pg);
        float d_dual = pg < l3 ? dpg : (pg > l3 ? 0.0f : 0.5f * dpg);
        if (adv < 0.0f) { pg = dual; dpg = d_dual; }
    }
    if (flags & FLAG_TIS) {
        float w = fminf(fmaxf(__expf(old_logp - rollout_logp), tis_low), tis_high);
        pg = pg * w;
        dpg = dpg * w;
    }
}

// (kl, d kl / d logp) for kl types 0 k1, 1 k2, 2 k3, 3 low_var_kl (k3 clamped to +-10)
__device__ __forceinline__ void kl_value_and_grad(float logp, float ref, float old, int flags, float& kl, float& dkl) {
    int kl_type = (flags >> KL_TYPE_SHIFT) & 3;
    float r = logp - ref;
    if (kl_type == 0) {
        kl = r; dkl = 1.0f;
    } else if (kl_type == 1) {
        kl = r * r / 2.0f; dkl = r;
    } else {
        float e = __expf(-r);
        kl = e - 1.0f + r;
        dkl = 1.0f - e;
        if (kl_type == 3) {
            bool inside = (kl >= -10.0f) && (kl <= 10.0f);
            dkl = inside ? dkl : 0.0f;
            kl = fminf(fmaxf(kl, -10.0f), 10.0f);
        }
    }
    if (flags & FLAG_UNBIASED) {
        float w = __expf(logp - old);
        dkl = w * dkl + w * kl;
        kl = kl * w;
    }
}

// z of one element: the logit in fp32, divided by the temperature (IEEE) when SCALE
template <bool SCALE> __device__ __forceinline__ float scaled(float x, float temperature) {
    return SCALE ? __fdiv_rn(x, temperature) : x;
}

// The sweeps' exp(z - m) is 2^(z log2e - h) with h = m log2e rounded to fp32: one FFMA per element.
// The rounding of h (up to |m| 2^-25) would scale every term of the row alike, a bias of ~1e-6 in
// log S that KL terms such as k3's exp(ref - logp) amplify past the loss tolerance (seen at
// temperature 0.7); so each sum of such terms is multiplied by 2^-(m log2e - h) = 1 - (m log2e - h) ln 2
// (the residual m log2e - h is exact in one FFMA; the correction is 1 within 2^-23, itself correct to
// half an ulp of 1), which leaves no bias above fp32's rounding near 1
#define LN2 0.6931471805599453f
__device__ __forceinline__ float ffma_exp_correction(float m, float h) {
    return m == -INFINITY ? 1.0f : fmaf(-fmaf(m, LOG2E, -h), LN2, 1.0f);
}

// the largest element of K 16-byte pieces (as fp32, before the temperature): packed bf16x2 / half2
// maxima for 16-bit types (exact, and NaN-ignoring like fmaxf), fmaxf for fp32
template <typename T, int K> __device__ __forceinline__ float pieces_max(const int4 (&raw)[K]) {
    if constexpr (sizeof(T) == 4) {
        float pm = __int_as_float(raw[0].x);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (k) pm = fmaxf(pm, __int_as_float(raw[k].x));
            pm = fmaxf(fmaxf(pm, __int_as_float(raw[k].y)), fmaxf(__int_as_float(raw[k].z), __int_as_float(raw[k].w)));
        }
        return pm;
    } else {
        using T2 = typename std::conditional<std::is_same<T, __half>::value, __half2, __nv_bfloat162>::type;
        T2 a = __hmax2(*reinterpret_cast<const T2*>(&raw[0].x), *reinterpret_cast<const T2*>(&raw[0].y));
        T2 b = __hmax2(*reinterpret_cast<const T2*>(&raw[0].z), *reinterpret_cast<const T2*>(&raw[0].w));
#pragma unroll
        for (int k = 1; k < K; ++k) {
            a = __hmax2(a, __hmax2(*reinterpret_cast<const T2*>(&raw[k].x), *reinterpret_cast<const T2*>(&raw[k].y)));
            b = __hmax2(b, __hmax2(*reinterpret_cast<const T2*>(&raw[k].z), *reinterpret_cast<const T2*>(&raw[k].w)));
        }
        a = __hmax2(a, b);
        return fmaxf(to_f32(a.x), to_f32(a.y));
    }
}

// K full pieces (p, p + THREADS, ...) into the thread's (m, s): their max first (one rescale for
// all K), then the sum of their exps
template <typename T, bool SCALE, int K>
__device__ __forceinline__ void stats_pieces(const T* srow, int p, float temperature, float& m, float& h,
                                             float& corr, float& s) {
    constexpr int VEC = Vec<T>::N;
    int4 raw[K];
#pragma unroll
    for (int k = 0; k < K; ++k) raw[k] = *reinterpret_cast<const int4*>(srow + (p + k * RLK_THREADS) * VEC);
    // max(x) / T = max(x / T): IEEE division is monotonic
    const float pm = scaled<SCALE>(pieces_max<T, K>(raw), temperature);
    if (pm > m) {
        s = s * exp_sweep(m - pm);
        m = pm;
        h = m * LOG2E;
        corr = ffma_exp_correction(m, h);
    }
    if (m == -INFINITY) return;  // every element so far is -inf
    float ps = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        float z[VEC];
        if constexpr (sizeof(T) == 4) unpack(raw[k], z); else unpack16<T>(raw[k], z);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const float e = exp2_ftz(fmaf(scaled<SCALE>(z[j], temperature), LOG2E, -h));
            ps = (k == 0 && j == 0) ? e : ps + e;
        }
    }
    s = fmaf(ps, corr, s);
}

// online (max, sum of exp) over this thread's pieces of one stage, two full pieces per step; the
// slice's last piece may be partial (zero-filled past the row's end: masked)
template <typename T, bool SCALE>
__device__ __forceinline__ void stats_stage(const T* srow, int begin, int end, int ncols, float temperature,
                                            float& m, float& s) {
    constexpr int VEC = Vec<T>::N;
    float h = m * LOG2E, corr = ffma_exp_correction(m, h);
    const int full_end = min(end, ncols / VEC);
    int p = begin;
    for (; p + RLK_THREADS < full_end; p += 2 * RLK_THREADS) stats_pieces<T, SCALE, 2>(srow, p, temperature, m, h, corr, s);
    if (p < full_end) {
        stats_pieces<T, SCALE, 1>(srow, p, temperature, m, h, corr, s);
        p += RLK_THREADS;
    }
    if (p < end) {  // the partial piece
        float z[VEC];
        load_piece<T>(srow + p * VEC, z);
        const int valid = ncols - p * VEC;
        float pm = -INFINITY;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            z[j] = j < valid ? scaled<SCALE>(z[j], temperature) : -INFINITY;
            pm = fmaxf(pm, z[j]);
        }
        if (pm > m) {
            s = s * exp_sweep(m - pm);
            m = pm;
            h = m * LOG2E;
            corr = ffma_exp_correction(m, h);
        }
        if (m != -INFINITY) {
            float ps = 0.0f;
#pragma unroll
            for (int j = 0; j < VEC; ++j) ps += j < valid ? exp2_ftz(fmaf(z[j], LOG2E, -h)) : 0.0f;
            s = fmaf(ps, corr, s);
        }
    }
}

// dlogits of this CTA's slice: -exp(z - m) * (c / S) everywhere (the one-hot term is added to the
// target's element afterwards, by the caller), 16-byte streaming stores for full pieces
template <typename T, bool SCALE>
__device__ __forceinline__ void write_slice(const T* srow, T* dst, int npieces, int ncols, float temperature,
                                            float row_max, float c_over_s) {
    constexpr int VEC = Vec<T>::N;
    const float h = row_max * LOG2E;
    // exp(z - m) (c / S) = 2^(z log2e - h) * [(c / S) * (1 - (m log2e - h) ln 2)], negated
    const float neg_cs = -c_over_s * ffma_exp_correction(row_max, h);
    const int nfull = ncols / VEC;
    for (int p = threadIdx.x; p < nfull; p += RLK_THREADS) {
        float d[VEC];
        load_piece<T>(srow + p * VEC, d);
#pragma unroll
        for (int j = 0; j < VEC; ++j) d[j] = exp2_ftz(fmaf(scaled<SCALE>(d[j], temperature), LOG2E, -h)) * neg_cs;
        __stcs(reinterpret_cast<int4*>(dst + p * VEC), pack_piece<T>(d));
    }
    const int valid = ncols - nfull * VEC;
    if (valid > 0 && threadIdx.x == nfull % RLK_THREADS) {  // the partial piece
        float d[VEC];
        load_piece<T>(srow + nfull * VEC, d);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (j < valid) dst[nfull * VEC + j] = from_f32<T>(exp2_ftz(fmaf(scaled<SCALE>(d[j], temperature), LOG2E, -h)) * neg_cs);
        }
    }
}

// dlogits of a slice held in shared memory: write_slice's -exp(z - m) * (c / S) everywhere, then
// the thread that wrote the target's piece rewrites that one element with the one-hot term
// (program order: its store lands last), c - exp(z - m) * (c / S): row_write_grad's operations and
// rounding. `local_target` is the target's column in the slice (outside [0, ncols): none here).
template <typename T>
__device__ __forceinline__ void write_dlogits(const T* srow, T* dst, int npieces, int ncols, bool scale,
                                              float temperature, float row_max, float c, float c_over_s,
                                              int64_t local_target) {
    constexpr int VEC = Vec<T>::N;
    if (scale) {
        write_slice<T, true>(srow, dst, npieces, ncols, temperature, row_max, c_over_s);
    } else {
        write_slice<T, false>(srow, dst, npieces, ncols, temperature, row_max, c_over_s);
    }
    if (local_target >= 0 && local_target < ncols && (local_target / VEC) % RLK_THREADS == threadIdx.x) {
        float x = to_f32(srow[local_target]);
        if (scale) x = __fdiv_rn(x, temperature);
        dst[local_target] = from_f32<T>(c - exp_sweep(x - row_max) * c_over_s);
    }
}

template <typename T, int C>
__device__ __forceinline__ void grpo_one_read(
    const T* __restrict__ logits, T* __restrict__ grad, const int64_t* __restrict__ ids,
    const float* __restrict__ old_logp, const float* __restrict__ ref_logp, const float* __restrict__ adv,
    const float* __restrict__ rollout_logp, const float* __restrict__ weights, float* __restrict__ per_token,
    int64_t stride_row, int64_t stride_grad, int num_tokens, int vocab, int slice, int64_t ignore_index,
    float temperature, float eps_low, float eps_high, float eps_c, float tis_low, float tis_high, float kl_coef,
    float grad_pred, int flags, int64_t* __restrict__ error_word, int64_t call_id) {
    constexpr int VEC = Vec<T>::N;
    constexpr int WARPS = RLK_THREADS / 32;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* srow = reinterpret_cast<T*>(smem_raw);
    __shared__ float warp_m[WARPS], warp_s[WARPS];
    __shared__ float coef_smem[3];  // (c, c / S, row max) for the write sweep
    __shared__ int64_t target_smem;  // the row's id, read by thread 0
    // (bulk loads) stage st's bytes have landed
    __shared__ __align__(8) uint64_t stage_bar[RLK_STAGES];
    // (C > 1) the (m, s) of CTA r of the cluster at [r], pushed there by CTA r; exchange_bar completes
    // when all C have landed
    __shared__ __align__(8) float2 partials[C];
    __shared__ __align__(8) uint64_t exchange_bar;

    cg::cluster_group cluster = cg::this_cluster();
    const int rank = C == 1 ? 0 : static_cast<int>(cluster.block_rank());
    const int64_t row = blockIdx.x / C;
    const int tid = threadIdx.x;
    const bool scale = flags & FLAG_SCALE;
    const int col0 = rank * slice;
    const int ncols = max(0, min(vocab - col0, slice));
    const int npieces = (ncols + VEC - 1) / VEC;
    const T* src = logits + row * stride_row + col0;

    if (tid == 0) {
#if RLK_BULK_LOAD
#pragma unroll
        for (int st = 0; st < RLK_STAGES; ++st) mbar_init(&stage_bar[st], 1);
#endif
        if (C > 1) mbar_init(&exchange_bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        // the one arrival, with the bytes the C pushes bring: the phase completes when they are all in
        if (C > 1) mbar_arrive_expect_tx(&exchange_bar, C * static_cast<int>(sizeof(float2)));
    }
    __syncthreads();
    if (C > 1) cluster_arrive_relaxed();

    // 1. issue the whole slice's copy, in STAGES groups; a thread later reads exactly the pieces
    //    it copied, so its own wait_group is all the synchronisation the statistics need
    const int per_stage = (npieces + RLK_STAGES - 1) / RLK_STAGES;
#if RLK_BULK_LOAD
    // one thread issues a bulk copy per stage; every thread waits on the stage's mbarrier. The slice's
    // bytes are whole 16-byte pieces (the caller requires V * itemsize % 16 == 0)
    if (tid == 0) {
#pragma unroll
        for (int st = 0; st < RLK_STAGES; ++st) {
            const int first = min(npieces, st * per_stage), end = min(npieces, (st + 1) * per_stage);
            const int bytes = (end - first) * 16;
            mbar_arrive_expect_tx(&stage_bar[st], bytes);
            if (bytes > 0) bulk_load(srow + first * VEC, src + first * VEC, bytes, &stage_bar[st]);
        }
    }
#else
#pragma unroll
    for (int st = 0; st < RLK_STAGES; ++st) {
        const int end = min(npieces, (st + 1) * per_stage);
        for (int p = st * per_stage + tid; p < end; p += RLK_THREADS) {
            const int bytes = min(VEC, ncols - p * VEC) * static_cast<int>(sizeof(T));
            cp_async_16(srow + p * VEC, src + p * VEC, bytes);
        }
        cp_async_commit();
    }
#endif
    // thread 0 reads the row's id and forms the loss: its scalar inputs (the target logit, the
    // token's log-probs, advantage and weight) are loaded now, while the slice is in flight, not after
    // the exchange, where a global round trip would hold up the whole CTA; the other threads read the
    // id from shared memory before the write sweep (no global load to wait for at the start)
    bool ignored = false, bad = false;
    float z_t = 0.0f, old = 0.0f, a = 0.0f, rollout = 0.0f, ref = 0.0f, w = 0.0f;
    if (tid == 0) {
        const int64_t target = ids[row];
        target_smem = target;
        ignored = target == ignore_index;
        const bool owned = target >= 0 && target < vocab;
        // an id outside the vocab (not ignore_index): NaN terms and dlogits for the row, and a report
        // in the error word (pinned host memory; kernels/device_errors.py states the layout)
        bad = !ignored && !owned;
        if (bad && rank == 0) {
            const int64_t v = target < INT_MIN ? INT_MIN : (target > INT_MAX ? INT_MAX : target);
            error_word[1] = static_cast<int64_t>(row) * 4294967296LL + (v & 4294967295LL);
            error_word[2] = vocab;
            __threadfence_system();
            error_word[0] = call_id * 16 + 1;
        }
        if (owned) z_t = to_f32(logits[row * stride_row + target]);
        old = old_logp[row];
        a = adv[row];
        w = weights[row];
        rollout = (flags & FLAG_TIS) ? rollout_logp[row] : old;
        if (flags & FLAG_HAS_REF) ref = ref_logp[row];
    }

    float m = -INFINITY, s = 0.0f;
#pragma unroll
    for (int st = 0; st < RLK_STAGES; ++st) {
#if RLK_BULK_LOAD
        mbar_wait_phase0(&stage_bar[st]);
#else
        cp_async_wait_stage(RLK_STAGES - 1 - st);
#endif
        const int begin = st * per_stage + tid, end = min(npieces, (st + 1) * per_stage);
        if (scale) {
            stats_stage<T, true>(srow, begin, end, ncols, temperature, m, s);
        } else {
            stats_stage<T, false>(srow, begin, end, ncols, temperature, m, s);
        }
    }
    // CTA reduction: each warp's (m, s), then warp 0 over the warps
    warp_combine(m, s);
    if ((tid & 31) == 0) { warp_m[tid >> 5] = m; warp_s[tid >> 5] = s; }
    __syncthreads();
    // every CTA of the cluster has initialized exchange_bar (long ago: this wait does not hold)
    if (C > 1) cluster_wait();
    // 2. the row's statistics: warp 0 pushes this CTA's (m, s) into every CTA of the cluster, waits
    //    for the C pairs, and combines them in lane order (the same operations on the same values in
    //    every CTA, so all C get bit-identical row statistics); no cluster barrier, no fence
    if (tid < 32) {
        float rm = tid < WARPS ? warp_m[tid] : -INFINITY;
        float rs = tid < WARPS ? warp_s[tid] : 0.0f;
        warp_combine(rm, rs);
        if constexpr (C > 1) {
            if (tid < C) push_pair(&partials[rank], &exchange_bar, static_cast<unsigned>(tid), rm, rs);
            mbar_wait_phase0(&exchange_bar);
            rm = tid < C ? partials[tid].x : -INFINITY;
            rs = tid < C ? partials[tid].y : 0.0f;
            warp_combine(rm, rs);
        }
        if (tid == 0) {
            if (scale) z_t = __fdiv_rn(z_t, temperature);
            const float logp = bad ? __int_as_float(0x7fc00000) : (ignored ? 0.0f : (z_t - rm) - logf(rs));
            float pg, clipped, dpg;
            token_pg_and_grad(logp, old, a, rollout, eps_low, eps_high, eps_c, tis_low, tis_high, flags, pg, clipped, dpg);
            float kl = 0.0f, dkl = 0.0f;
            if (flags & FLAG_HAS_REF) kl_value_and_grad(logp, ref, old, flags, kl, dkl);
            float coef = ignored ? 0.0f : dpg + kl_coef * dkl;
            if (bad) {  // a bad row's terms are NaN (the clamps would drop a NaN log-prob)
                pg = kl = coef = __int_as_float(0x7fc00000);
            }
            if (rank == 0) {
                per_token[row] = pg;
                per_token[num_tokens + row] = clipped;
                per_token[2 * static_cast<int64_t>(num_tokens) + row] = old - logp;
                per_token[3 * static_cast<int64_t>(num_tokens) + row] = kl;
                per_token[4 * static_cast<int64_t>(num_tokens) + row] = coef;
                per_token[5 * static_cast<int64_t>(num_tokens) + row] = rm;
                per_token[6 * static_cast<int64_t>(num_tokens) + row] = rs;
            }
            // c = (w * coef) * grad_pred, the backward's row gradient for the predicted incoming
            // gradient (x * 1 is exact); then the softmax gradient's order of operations
            // (row_write_grad): c [/ T], c / S, onehot * c - exp(z - m) * (c / S)
            float c = (w * coef) * grad_pred;
            if (scale) c = __fdiv_rn(c, temperature);
            coef_smem[0] = c;
            coef_smem[1] = __fdiv_rn(c, rs);
            coef_smem[2] = rm;
        }
    }
    // every pair pushed into this CTA has landed (warp 0 waited for them), so it may exit after its
    // sweep: nothing in its shared memory is read or written by another CTA from here on
    __syncthreads();
    if (flags & FLAG_STATS_ONLY) return;  // no write sweep
    // 3. dlogits for this slice, from shared memory (write_dlogits)
    write_dlogits(srow, grad + row * stride_grad + col0, npieces, ncols, scale, temperature, coef_smem[2],
                  coef_smem[0], coef_smem[1], target_smem - col0);
}

#define RLK_DEFINE(NAME, T, C)                                                                            \
    extern "C" __global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(RLK_THREADS, RLK_MIN_CTAS) NAME(             \
        const T* logits, T* grad, const int64_t* ids, const float* old_logp, const float* ref_logp,       \
        const float* adv, const float* rollout_logp, const float* weights, float* per_token,              \
        int64_t stride_row, int64_t stride_grad, int num_tokens, int vocab, int slice, int64_t ignore_index, \
        float temperature, float eps_low, float eps_high, float eps_c, float tis_low, float tis_high,     \
        float kl_coef, float grad_pred, int flags, int64_t* error_word, int64_t call_id) {              \
        grpo_one_read<T, C>(logits, grad, ids, old_logp, ref_logp, adv, rollout_logp, weights, per_token, \
                            stride_row, stride_grad, num_tokens, vocab, slice, ignore_index, temperature, \
                            eps_low, eps_high, eps_c, tis_low, tis_high, kl_coef, grad_pred, flags,       \
                            error_word, call_id);                                                         \
    }

#define RLK_DEFINE_DTYPE(SUFFIX, T)                 \
    RLK_DEFINE(grpo_one_read_##SUFFIX##_c1, T, 1)   \
    RLK_DEFINE(grpo_one_read_##SUFFIX##_c2, T, 2)   \
    RLK_DEFINE(grpo_one_read_##SUFFIX##_c4, T, 4)   \
    RLK_DEFINE(grpo_one_read_##SUFFIX##_c8, T, 8)

RLK_DEFINE_DTYPE(fp32, float)
RLK_DEFINE_DTYPE(bf16, __nv_bfloat16)
RLK_DEFINE_DTYPE(fp16, __half)

// The backward's dlogits from the statistics the cluster kernel saved (per_token rows 4-6: coef, row
// max, sum-exp; the reduction weights): its write sweep with c = (w * coef) * g, where g is the loss's
// incoming gradient, read here on the device (no host sync): bit for bit what the cluster kernel
// writes for grad_pred == g. `expected` is the gradient the forward wrote `grad` for (its grad_pred):
// when g has exactly its bits, `grad` already holds dlogits and every CTA returns at once; with
// FLAG_WRITE_ALWAYS (a fresh `grad`: the compiled operators' backward, a second backward through a
// retained graph) the rows are written for any g. First, thread 0 of CTA 0 stores g at `last_grad`
// (the error word's word 3, kernels/device_errors.py: bits(g) XOR bits(1.0f), so that an untouched
// word reads as 1.0): the next forward's prediction.
// Each row is cut into blocks_per_row blocks of block_cols columns; CTA b takes blocks b, b + gridDim.x,
// ... of the num_rows * blocks_per_row: the caller launches about one wave of CTAs when it expects
// the forward's rows (a CTA per block that only returns would cost measurable time at large T), a CTA
// per block with FLAG_WRITE_ALWAYS. A CTA copies its next block into its second buffer (cp.async;
// 2 * block_cols * sizeof(T) bytes of dynamic shared memory) while it writes the current one from
// shared memory with write_dlogits (the target's one-hot term included), as the cluster kernel does
// on its slice.
#ifndef RLK_WRITE_MIN_CTAS
#define RLK_WRITE_MIN_CTAS 3  // registers for three CTAs of RLK_THREADS per multiprocessor
#endif
#define FP32_ONE_BITS 0x3f800000u

// this thread's 16-byte pieces of block `block` (the ones write_dlogits has it read later), queued
template <typename T>
__device__ __forceinline__ void copy_block(T* dst, const T* logits, int64_t stride_row, int vocab, int64_t block,
                                           int blocks_per_row, int block_cols) {
    constexpr int VEC = Vec<T>::N;
    const int64_t row = block / blocks_per_row;
    const int col0 = static_cast<int>(block % blocks_per_row) * block_cols;
    const int ncols = max(0, min(vocab - col0, block_cols));
    const T* src = logits + row * stride_row + col0;
    for (int p = threadIdx.x; p * VEC < ncols; p += RLK_THREADS) {
        const int bytes = min(VEC, ncols - p * VEC) * static_cast<int>(sizeof(T));
        cp_async_16(dst + p * VEC, src + p * VEC, bytes);
    }
}

template <typename T>
__device__ __forceinline__ void grpo_write_from_stats(
    const T* __restrict__ logits, T* __restrict__ grad, const int64_t* __restrict__ ids,
    const float* __restrict__ weights, const float* __restrict__ coef, const float* __restrict__ row_max_in,
    const float* __restrict__ sumexp, const float* __restrict__ grad_output, int64_t* __restrict__ last_grad,
    int64_t stride_row, int64_t stride_grad, int num_rows, int vocab, int blocks_per_row, int block_cols,
    float temperature, float expected, int flags) {
    constexpr int VEC = Vec<T>::N;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sbase = reinterpret_cast<T*>(smem_raw);
    const float g = *grad_output;
    if (blockIdx.x == 0 && threadIdx.x == 0) *last_grad = static_cast<int64_t>(__float_as_uint(g) ^ FP32_ONE_BITS);
    if (!(flags & FLAG_WRITE_ALWAYS) && __float_as_uint(g) == __float_as_uint(expected)) return;
    const int64_t blocks = static_cast<int64_t>(num_rows) * blocks_per_row;
    int64_t b = blockIdx.x;
    if (b >= blocks) return;
    const bool scale = flags & FLAG_SCALE;
    copy_block(sbase, logits, stride_row, vocab, b, blocks_per_row, block_cols);
    cp_async_commit();
    for (int i = 0; b < blocks; ++i, b += gridDim.x) {
        // the other buffer's last reads (the previous block) are done in every thread before it is refilled
        __syncthreads();
        const int64_t next = b + gridDim.x;
        if (next < blocks) {
            copy_block(sbase + ((i + 1) & 1) * block_cols, logits, stride_row, vocab, next, blocks_per_row,
                       block_cols);
        }
        cp_async_commit();  // one group per step (maybe empty): waiting for all but one leaves only `next` in flight
        const int64_t row = b / blocks_per_row;
        const int col0 = static_cast<int>(b % blocks_per_row) * block_cols;
        const int ncols = max(0, min(vocab - col0, block_cols));
        // the cluster kernel's c and c / S: c = (w * coef) * g [/ T], one IEEE division each
        float c = (weights[row] * coef[row]) * g;
        if (scale) c = __fdiv_rn(c, temperature);
        const float c_over_s = __fdiv_rn(c, sumexp[row]);
        const float row_max = row_max_in[row];
        const int64_t local_target = ids[row] - col0;
        cp_async_wait<1>();
        write_dlogits(sbase + (i & 1) * block_cols, grad + row * stride_grad + col0, (ncols + VEC - 1) / VEC, ncols,
                      scale, temperature, row_max, c, c_over_s, local_target);
    }
}

#define RLK_DEFINE_WRITE(NAME, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(RLK_THREADS, RLK_WRITE_MIN_CTAS) NAME(                    \
        const T* logits, T* grad, const int64_t* ids, const float* weights, const float* coef,            \
        const float* row_max, const float* sumexp, const float* grad_output, int64_t* last_grad,          \
        int64_t stride_row, int64_t stride_grad, int num_rows, int vocab, int blocks_per_row,             \
        int block_cols, float temperature, float expected, int flags) {                                    \
        grpo_write_from_stats<T>(logits, grad, ids, weights, coef, row_max, sumexp, grad_output, last_grad, \
                                 stride_row, stride_grad, num_rows, vocab, blocks_per_row, block_cols,    \
                                 temperature, expected, flags);                                            \
    }

RLK_DEFINE_WRITE(grpo_write_from_stats_fp32, float)
RLK_DEFINE_WRITE(grpo_write_from_stats_bf16, __nv_bfloat16)
RLK_DEFINE_WRITE(grpo_write_from_stats_fp16, __half)

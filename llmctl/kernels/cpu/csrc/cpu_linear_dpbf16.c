/* bfloat16 linear layer on the bf16 dot-product instruction (AVX512-BF16 `vdpbf16ps`):
 * y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), x, w, bias and y bfloat16 (passed as uint16 bits), w in
 * PyTorch's row-major layout. Built as its own library by llmctl/kernels/cpu_dpbf16.py (a compiler
 * or CPU without these instructions loses only this kernel) and called only where /proc/cpuinfo
 * lists avx512_bf16; the reference is torch.nn.functional.linear.
 *
 * Why: on decode-sized row counts a linear layer streams its weight once; widening bf16 to float32
 * (cpu_linear.c) costs two instructions per 8 weights, where one vdpbf16ps multiplies 32 weights by
 * 32 inputs and adds pairs of products into 16 float32 sums, so the loop keeps up with memory.
 *
 * How: a register tile of up to 4 rows of x by 4 rows of w keeps 16 accumulators of 16 float32
 * partial sums; each k step reads 32 values of each row (the tail of K through a masked load, so any
 * K works). One row of x uses a 1 x 8 tile (8 weight streams). Sums are reduced, the bias added in
 * float32, and the result rounded to bfloat16 (nearest even), as oneDNN's bf16 matmul does. Work
 * items are 64 weight rows, split over the threads.
 */
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 10 || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define INLINE TARGET static inline __attribute__((always_inline))

enum { ROWS_PER_ITEM = 64 };

INLINE __m512bh load32(const uint16_t *p, int64_t k, int64_t K) {
    if (k + 32 <= K) return (__m512bh)_mm512_loadu_si512((const void *)(p + k));
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << (K - k)) - 1), p + k);
}

INLINE uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);  /* quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

INLINE float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* One row i of x against the 4 weight vectors b0..b3, into accumulators a<i>0..a<i>3. */
#define ROW(i)                                          \
    if (mv > i) {                                       \
        const __m512bh xv = load32(x[i], k, K);         \
        a##i##0 = _mm512_dpbf16_ps(a##i##0, xv, b0);    \
        a##i##1 = _mm512_dpbf16_ps(a##i##1, xv, b1);    \
        a##i##2 = _mm512_dpbf16_ps(a##i##2, xv, b2);    \
        a##i##3 = _mm512_dpbf16_ps(a##i##3, xv, b3);    \
    }

/* mv rows of x (1 to 4, a constant per call site) by 4 rows of w; stores i < mv, j < nv. The
 * accumulators are named one by one: GCC keeps arrays of vectors in memory here. */
INLINE void tile4x4(const uint16_t *const *x, const uint16_t *const *w, int64_t K, uint16_t *y,
                    int64_t ldy, const uint16_t *bias, const int mv, int nv) {
    const __m512 z = _mm512_setzero_ps();
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z,
           a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
    for (int64_t k = 0; k < K; k += 32) {
        const __m512bh b0 = load32(w[0], k, K), b1 = load32(w[1], k, K), b2 = load32(w[2], k, K),
                       b3 = load32(w[3], k, K);
        ROW(0) ROW(1) ROW(2) ROW(3)
    }
    const __m512 acc[4][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                              {a30, a31, a32, a33}};
    for (int i = 0; i < mv; ++i)
        for (int j = 0; j < nv; ++j)
            y[i * ldy + j] = to_bf16(_mm512_reduce_add_ps(acc[i][j]) + (bias ? from_bf16(bias[j]) : 0.f));
}
#undef ROW

/* 1 row of x by 8 rows of w: 8 independent weight streams keep the loads in flight. */
INLINE void tile1x8(const uint16_t *x, const uint16_t *const *w, int64_t K, uint16_t *y,
                    const uint16_t *bias, int nv) {
    const __m512 z = _mm512_setzero_ps();
    __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;
    for (int64_t k = 0; k < K; k += 32) {
        const __m512bh xv = load32(x, k, K);
        a0 = _mm512_dpbf16_ps(a0, xv, load32(w[0], k, K));
        a1 = _mm512_dpbf16_ps(a1, xv, load32(w[1], k, K));
        a2 = _mm512_dpbf16_ps(a2, xv, load32(w[2], k, K));
        a3 = _mm512_dpbf16_ps(a3, xv, load32(w[3], k, K));
        a4 = _mm512_dpbf16_ps(a4, xv, load32(w[4], k, K));
        a5 = _mm512_dpbf16_ps(a5, xv, load32(w[5], k, K));
        a6 = _mm512_dpbf16_ps(a6, xv, load32(w[6], k, K));
        a7 = _mm512_dpbf16_ps(a7, xv, load32(w[7], k, K));
    }
    const __m512 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int j = 0; j < nv; ++j)
        y[j] = to_bf16(_mm512_reduce_add_ps(acc[j]) + (bias ? from_bf16(bias[j]) : 0.f));
}

/* Output columns [n0, n1) for all M rows: each 4-row weight tile stays in L1 while every row tile
 * of x passes over it. */
TARGET static void item(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                        uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    const int nr = M == 1 ? 8 : 4;
    for (int64_t n = n0; n < n1; n += nr) {
        const int nv = n1 - n < nr ? (int)(n1 - n) : nr;
        const uint16_t *wr[8];
        for (int j = 0; j < 8; ++j) wr[j] = w + (n + (j < nv ? j : nv - 1)) * K;
        const uint16_t *bn = bias ? bias + n : 0;
        if (M == 1) {
            tile1x8(x, wr, K, y + n, bn, nv);
            continue;
        }
        for (int64_t m = 0; m < M; m += 4) {
            const int mv = M - m < 4 ? (int)(M - m) : 4;
            const uint16_t *xr[4];
            for (int i = 0; i < 4; ++i) xr[i] = x + (m + (i < mv ? i : mv - 1)) * ldx;
            uint16_t *ym = y + m * N + n;
            switch (mv) {  /* a constant row count per call: the accumulators stay in registers */
                case 4: tile4x4(xr, wr, K, ym, N, bn, 4, nv); break;
                case 3: tile4x4(xr, wr, K, ym, N, bn, 3, nv); break;
                case 2: tile4x4(xr, wr, K, ym, N, bn, 2, nv); break;
                default: tile4x4(xr, wr, K, ym, N, bn, 1, nv); break;
            }
        }
    }
}

int linear_dpbf16_built(void) { return 1; }

TARGET void linear_dpbf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                          uint16_t *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t items = (N + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t n0 = it * ROWS_PER_ITEM, n1 = n0 + ROWS_PER_ITEM < N ? n0 + ROWS_PER_ITEM : N;
        item(x, ldx, w, bias, y, M, N, K, n0, n1);
    }
}

#else /* not x86-64, or a compiler without AVX512-BF16 intrinsics: the caller never calls it */

int linear_dpbf16_built(void) { return 0; }

void linear_dpbf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                   uint16_t *y, int64_t M, int64_t N, int64_t K, int threads) {
    (void)x; (void)ldx; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)threads;
}
#endif

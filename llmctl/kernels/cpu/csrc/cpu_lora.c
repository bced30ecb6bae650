/* LoRA's low-rank update for the CPU, many adapters in one call (punica's BGMV, S-LoRA's gathered
 * GEMMs): for each row t of the batch, s = row_slot[t] and r = ranks[s] (0: no update),
 *
 *     y[t, :] += (x[t, :] @ A[s, :r, :].T) @ Bt[s, :r, :]
 *
 * x [T, K] (row stride ldx), y [T, N] (row stride ldy: a column slice of a merged q/k/v or
 * gate/up output), A [slots, R, K] and Bt [slots, R, N] contiguous (B transposed, the adapter's
 * scale folded in), all float32 or all bfloat16 (uint16 bits). The reference is
 * llmctl/kernels/cpu/lora.py's `lora_reference`.
 *
 * Why: PyTorch spends 30-50 us on each skinny GEMM ([rows, 576] x [576, 16]) and two are needed
 * per adapter and projection; here one call per projection serves every adapter, at the FMA rate.
 * Arithmetic in float32: the shrink x @ A.T is kept in float (not rounded to bf16 between the two
 * products), and y is rounded once, after the add. Each row is its own loop over fixed lengths,
 * so a row's result does not depend on the other rows (batch-invariant).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512F__)
#define LORA_WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define LORA_WIDE
#endif

static inline uint16_t lora_to_bf16(float f) { /* round to nearest even, as PyTorch */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffff) > 0x7f800000) return 0x7fc0; /* NaN: a bit test (-ffast-math) */
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

static inline float lora_from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* xa[j] = sum_k x[k] * a[j, k] for j < r; four rows of A a pass (x read once per four). */
LORA_WIDE static void shrink_f32(const float *x, const float *a, int64_t K, int r, float *xa) {
    int j = 0;
    for (; j + 4 <= r; j += 4) {
        const float *a0 = a + j * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        for (int64_t k = 0; k < K; ++k) {
            const float v = x[k];
            s0 += v * a0[k];
            s1 += v * a1[k];
            s2 += v * a2[k];
            s3 += v * a3[k];
        }
        xa[j] = s0, xa[j + 1] = s1, xa[j + 2] = s2, xa[j + 3] = s3;
    }
    for (; j < r; ++j) {
        const float *aj = a + j * K;
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += x[k] * aj[k];
        xa[j] = s;
    }
}

LORA_WIDE static void shrink_bf16(const float *x, const uint16_t *a, int64_t K, int r, float *xa) {
    int j = 0;
    for (; j + 4 <= r; j += 4) {
        const uint16_t *a0 = a + j * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        for (int64_t k = 0; k < K; ++k) {
            const float v = x[k];
            s0 += v * lora_from_bf16(a0[k]);
            s1 += v * lora_from_bf16(a1[k]);
            s2 += v * lora_from_bf16(a2[k]);
            s3 += v * lora_from_bf16(a3[k]);
        }
        xa[j] = s0, xa[j + 1] = s1, xa[j + 2] = s2, xa[j + 3] = s3;
    }
    for (; j < r; ++j) {
        const uint16_t *aj = a + j * K;
        float s = 0.f;
        for (int64_t k = 0; k < K; ++k) s += x[k] * lora_from_bf16(aj[k]);
        xa[j] = s;
    }
}

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#include <immintrin.h>

#include "cpu_bf16x16.h"
#define LORA_DPBF16 1

/* shrink_bf16 on bf16 x through vdpbf16ps (pairs of bf16 products summed into float32, 32
 * elements an instruction, no widening): four rows of A a pass, the tail masked (so a row's
 * sums do not depend on anything but K). */
static void shrink_dpbf16(const uint16_t *x, const uint16_t *a, int64_t K, int r, float *xa) {
    for (int j = 0; j < r; j += 4) {
        const int rows = r - j < 4 ? r - j : 4;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int64_t k = 0; k < K; k += 32) {
            const __mmask32 m = K - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
            for (int i = 0; i < rows; ++i) {
                const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, a + (j + i) * K + k);
                acc[i] = _mm512_dpbf16_ps(acc[i], xv, av);
            }
        }
        for (int i = 0; i < rows; ++i) xa[j + i] = _mm512_reduce_add_ps(acc[i]);
    }
}

/* SGMV for bf16: G (1-4) consecutive rows of one slot at a time, so each load of A and Bt
 * serves G rows. Row g's arithmetic is the single row's (the same instructions in the same
 * order, only interleaved with the other rows'), so a row's result does not depend on its
 * group. xs/ys: the rows' x and y; xa [G][r] float scratch. */
#define LORA_NE 32 /* expand columns a block: 2 vectors of 16 a row */
static inline __attribute__((always_inline)) void group_dpbf16(
    const int G, const uint16_t *const *xs, uint16_t *const *ys, const uint16_t *a,
    const uint16_t *bt, int64_t K, int64_t N, int r, float *xa) {
    for (int j = 0; j < r; j += 2) { /* shrink: 2 rows of A against the G rows of x */
        __m512 acc[4][2];
        for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
        const __mmask32 both = r - j >= 2 ? 0xffffffffu : 0;
        for (int64_t k = 0; k < K; k += 32) {
            const __mmask32 m = K - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
            const __m512bh a0 = (__m512bh)_mm512_maskz_loadu_epi16(m, a + j * K + k);
            const __m512bh a1 = (__m512bh)_mm512_maskz_loadu_epi16(m & both, a + (j + 1) * K + k);
            for (int g = 0; g < G; ++g) {
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xs[g] + k);
                acc[g][0] = _mm512_dpbf16_ps(acc[g][0], xv, a0);
                acc[g][1] = _mm512_dpbf16_ps(acc[g][1], xv, a1);
            }
        }
        for (int g = 0; g < G; ++g) {
            xa[g * r + j] = _mm512_reduce_add_ps(acc[g][0]);
            if (both) xa[g * r + j + 1] = _mm512_reduce_add_ps(acc[g][1]);
        }
    }
    for (int64_t n = 0; n < N; n += LORA_NE) { /* expand: 32 columns of the G rows in registers */
        const __mmask16 m0 = N - n >= 16 ? 0xffff : (__mmask16)((1u << (N - n)) - 1);
        const __mmask16 m1 = N - n >= 32 ? 0xffff : N - n <= 16 ? 0 : (__mmask16)((1u << (N - n - 16)) - 1);
        __m512 acc[4][2];
        for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
        for (int j = 0; j < r; ++j) {
            const __m512 b0 = load16(bt + j * N + n, m0), b1 = load16(bt + j * N + n + 16, m1);
            for (int g = 0; g < G; ++g) {
                const __m512 w = _mm512_set1_ps(xa[g * r + j]);
                acc[g][0] = _mm512_fmadd_ps(w, b0, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(w, b1, acc[g][1]);
            }
        }
        for (int g = 0; g < G; ++g) { /* y + update, rounded once */
            uint16_t *y = ys[g] + n;
            _mm256_mask_storeu_epi16(y, m0, narrow16(_mm512_add_ps(load16(y, m0), acc[g][0])));
            _mm256_mask_storeu_epi16(y + 16, m1, narrow16(_mm512_add_ps(load16(y + 16, m1), acc[g][1])));
        }
    }
}

/* Rows t0 .. t0 + G - 1 (one slot, G <= 4) through group_dpbf16 specialised for G. */
static void rows_dpbf16(int G, const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy,
                        const uint16_t *a, const uint16_t *bt, int64_t K, int64_t N, int r,
                        float *xa) {
    const uint16_t *xs[4];
    uint16_t *ys[4];
    for (int g = 0; g < G; ++g) xs[g] = x + g * ldx, ys[g] = y + g * ldy;
    switch (G) {
    case 4: group_dpbf16(4, xs, ys, a, bt, K, N, r, xa); break;
    case 3: group_dpbf16(3, xs, ys, a, bt, K, N, r, xa); break;
    case 2: group_dpbf16(2, xs, ys, a, bt, K, N, r, xa); break;
    default: group_dpbf16(1, xs, ys, a, bt, K, N, r, xa); break;
    }
}
#else
#define LORA_DPBF16 0
#endif

/* y[n] += sum_j xa[j] * bt[j, n] for j < r, 64 columns a block whose sums stay in registers
 * across the r rows of bt (y read and written once). */
#define LORA_NB 64
#define LORA_EXPAND(NAME, T, LOAD, STORE)                                                       \
    LORA_WIDE static void NAME(const float *xa, const T *bt, int64_t N, int r, T *y) {         \
        for (int64_t n0 = 0; n0 < N; n0 += LORA_NB) {                                           \
            const int64_t nb = N - n0 < LORA_NB ? N - n0 : LORA_NB;                             \
            float acc[LORA_NB];                                                                 \
            if (nb == LORA_NB) {                                                                \
                for (int i = 0; i < LORA_NB; ++i) acc[i] = 0.f;                                 \
                for (int j = 0; j < r; ++j) {                                                   \
                    const float w = xa[j];                                                      \
                    const T *b = bt + j * N + n0;                                               \
                    for (int i = 0; i < LORA_NB; ++i) acc[i] += w * LOAD(b[i]);                 \
                }                                                                               \
            } else {                                                                            \
                for (int64_t i = 0; i < nb; ++i) acc[i] = 0.f;                                  \
                for (int j = 0; j < r; ++j) {                                                   \
                    const float w = xa[j];                                                      \
                    const T *b = bt + j * N + n0;                                               \
                    for (int64_t i = 0; i < nb; ++i) acc[i] += w * LOAD(b[i]);                  \
                }                                                                               \
            }                                                                                   \
            for (int64_t i = 0; i < nb; ++i) y[n0 + i] = STORE(LOAD(y[n0 + i]) + acc[i]);       \
        }                                                                                       \
    }

#define LORA_ID(v) (v)
LORA_EXPAND(expand_f32, float, LORA_ID, LORA_ID)
LORA_EXPAND(expand_bf16, uint16_t, lora_from_bf16, lora_to_bf16)

/* One row: y[:] += shrink then expand, through float scratch xf [K] and xa [R]. */
LORA_WIDE static void lora_row(const void *x, void *y, const void *a, const void *bt, int r,
                               int64_t K, int64_t N, int bf16, float *xf, float *xa) {
    if (bf16) {
        const uint16_t *xh = (const uint16_t *)x;
#if LORA_DPBF16
        (void)xf;
        shrink_dpbf16(xh, (const uint16_t *)a, K, r, xa);
#else
        for (int64_t k = 0; k < K; ++k) xf[k] = lora_from_bf16(xh[k]);
        shrink_bf16(xf, (const uint16_t *)a, K, r, xa);
#endif
        expand_bf16(xa, (const uint16_t *)bt, N, r, (uint16_t *)y);
    } else {
        shrink_f32((const float *)x, (const float *)a, K, r, xa);
        expand_f32(xa, (const float *)bt, N, r, (float *)y);
    }
}

/* The groups lora_apply works on: runs of up to 4 consecutive rows of one slot (an adapter's
 * rows are consecutive where the engine sorted them), base rows and skipping slots left out.
 * starts [T], sizes [T]; returns the count. */
static int64_t groups(const int32_t *row_slot, const int32_t *ranks, int64_t T, int max,
                      int64_t *starts, int *sizes) {
    int64_t n = 0;
    for (int64_t t = 0; t < T;) {
        const int32_t s = row_slot[t];
        int g = 1;
        while (g < max && t + g < T && row_slot[t + g] == s) ++g;
        if (s > 0 && ranks[s]) starts[n] = t, sizes[n++] = g;
        t += g;
    }
    return n;
}

/* Group i of `groups`' list: its rows' update, through float scratch [K + 4 R]. */
static void run_group(const void *x, int64_t ldx, void *y, int64_t ldy, const void *a,
                      const void *bt, int32_t s, int r, int64_t t, int g, int64_t K, int64_t N,
                      int64_t R, int bf16, float *scratch) {
    const size_t es = bf16 ? 2 : 4;
    const char *xt = (const char *)x + (size_t)(t * ldx) * es;
    char *yt = (char *)y + (size_t)(t * ldy) * es;
    const char *as = (const char *)a + (size_t)(s * R * K) * es;
    const char *bs = (const char *)bt + (size_t)(s * R * N) * es;
#if LORA_DPBF16
    if (bf16) {
        rows_dpbf16(g, (const uint16_t *)xt, ldx, (uint16_t *)yt, ldy, (const uint16_t *)as,
                    (const uint16_t *)bs, K, N, r, scratch);
        return;
    }
#endif
    (void)g; /* 1 here: `groups` makes groups of one row without dpbf16 */
    lora_row(xt, yt, as, bs, r, K, N, bf16, scratch, scratch + K);
}

#define LORA_STACK 4096 /* floats of scratch on the stack: K + 4 R up to this */

/* See the file's comment. Returns 0, or 1 where scratch memory could not be had (y untouched;
 * the caller raises). One thread, or few rows: no thread team and no heap (a decode step calls
 * this 7 times a layer, so the fixed cost counts). */
int lora_apply(const void *x, int64_t ldx, void *y, int64_t ldy, const void *a, const void *bt,
               const int32_t *row_slot, const int32_t *ranks, int64_t T, int64_t K, int64_t N,
               int64_t R, int bf16, int threads) {
    const int max = bf16 && LORA_DPBF16 ? 4 : 1;
    if (threads <= 1 || T < 64) {
        float stack[LORA_STACK];
        float *scratch = K + 4 * R <= LORA_STACK ? stack : (float *)malloc((size_t)(K + 4 * R) * 4);
        if (!scratch) return 1;
        for (int64_t t = 0; t < T;) {
            const int32_t s = row_slot[t];
            int g = 1;
            while (g < max && t + g < T && row_slot[t + g] == s) ++g;
            if (s > 0 && ranks[s])
                run_group(x, ldx, y, ldy, a, bt, s, ranks[s], t, g, K, N, R, bf16, scratch);
            t += g;
        }
        if (scratch != stack) free(scratch);
        return 0;
    }
    int64_t *starts = (int64_t *)malloc((size_t)T * sizeof(int64_t));
    int *sizes = (int *)malloc((size_t)T * sizeof(int));
    if (!starts || !sizes) {
        free(starts), free(sizes);
        return 1;
    }
    const int64_t n = groups(row_slot, ranks, T, max, starts, sizes);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = (float *)malloc((size_t)(K + 4 * R) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            const int32_t s = row_slot[starts[i]];
            if (scratch)
                run_group(x, ldx, y, ldy, a, bt, s, ranks[s], starts[i], sizes[i], K, N, R, bf16,
                          scratch);
        }
        free(scratch);
    }
    free(starts), free(sizes);
    return failed;
}

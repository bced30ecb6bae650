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
        for (int64_t k = 0; k < K; ++k) xf[k] = lora_from_bf16(xh[k]);
        shrink_bf16(xf, (const uint16_t *)a, K, r, xa);
        expand_bf16(xa, (const uint16_t *)bt, N, r, (uint16_t *)y);
    } else {
        shrink_f32((const float *)x, (const float *)a, K, r, xa);
        expand_f32(xa, (const float *)bt, N, r, (float *)y);
    }
}

/* See the file's comment. Returns 0, or 1 where scratch memory could not be had (y untouched
 * for the rows not yet done; the caller raises). */
int lora_apply(const void *x, int64_t ldx, void *y, int64_t ldy, const void *a, const void *bt,
               const int32_t *row_slot, const int32_t *ranks, int64_t T, int64_t K, int64_t N,
               int64_t R, int bf16, int threads) {
    const size_t es = bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && T >= 16)
    {
        float *scratch = (float *)malloc((size_t)(K + R) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const int32_t s = row_slot[t];
            const int r = s > 0 ? ranks[s] : 0;
            if (!r || !scratch) continue;
            lora_row((const char *)x + (size_t)(t * ldx) * es, (char *)y + (size_t)(t * ldy) * es,
                     (const char *)a + (size_t)(s * R * K) * es,
                     (const char *)bt + (size_t)(s * R * N) * es, r, K, N, bf16, scratch,
                     scratch + K);
        }
        free(scratch);
    }
    return failed;
}

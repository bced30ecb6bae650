/* RMSNorm for the CPU: y[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * w, float32 or bfloat16
 * (bfloat16 passed as uint16 bits). Compiled on first use by llmctl/kernels/cpu_native.py; the
 * reference is RMSNorm in llmctl/models/llama.py (Hugging Face's arithmetic).
 *
 * Why: PyTorch runs RMSNorm as five or more separate ops, about 20 us for one row of 576 on this
 * CPU; a decode step at batch 1 runs 2 per layer plus one, about 5% of the step. This is one pass.
 *
 * bfloat16 follows the reference step by step: normalise in float32, round to bfloat16, then
 * multiply by the bfloat16 weight and round again (two roundings, as `weight * x.to(bf16)` does).
 *
 * `add_rms_norm` is vLLM's fused_add_rms_norm: x += r (rounded to x's dtype, as `x.add_(r)`),
 * then y = RMSNorm(x), in one pass over the row while it is in cache (a decoder layer's residual
 * add and the next norm; PyTorch reads and writes x twice).
 */
#include <math.h>

#include "cpu_vec.h"

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as PyTorch's conversion */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffff) > 0x7f800000) return 0x7fc0;  /* NaN (a bit test: -ffast-math drops f != f) */
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline __attribute__((always_inline)) void norm_row(const void *x, const void *w, void *y, int64_t K,
                                                           float eps, const int bf16) {
    v8r acc = {0};
    for (int64_t k = 0; k < K; k += 8) {
        const v8r v = load8(x, k, bf16);
        acc += v * v;
    }
    /* In double: with -ffast-math GCC turns 1.0f / sqrtf into an approximate reciprocal square
     * root, which would differ from torch.rsqrt in the last bits. */
    const float scale = (float)(1.0 / sqrt((double)(hsum(acc) / (float)K + eps)));
    if (bf16) {
        const uint16_t *xs = x, *ws = w;
        uint16_t *ys = y;
        for (int64_t k = 0; k < K; ++k)
            ys[k] = to_bf16(from_bf16(ws[k]) * from_bf16(to_bf16(from_bf16(xs[k]) * scale)));
    } else {
        const float *xs = x, *ws = w;
        float *ys = y;
        for (int64_t k = 0; k < K; ++k) ys[k] = ws[k] * (xs[k] * scale);
    }
}

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "cpu_bf16x16.h"
/* bfloat16 rows on 16-lane registers, where the CPU has AVX512-BF16: the same arithmetic as
 * norm_row/add_row (float32 sums, the reference's two roundings, nearest even by vcvtneps2bf16),
 * about 3x their rate at decode sizes, where these row loops are compute-bound. The sum of
 * squares runs in 16 lanes instead of 8: its last bits (and so, rarely, a rounded output) differ
 * from the 8-lane loop's, the same for every row count. */
#define HAVE_ROWS512 1

static inline __mmask16 lanes(int64_t k, int64_t K) {
    return K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
}


/* y = w * bf16(x * scale), x, y, w [K] bfloat16. */
static inline void norm_row512(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t K,
                               float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = load16(x + k, lanes(k, K));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    /* in double, as norm_row (no approximate reciprocal square root under -ffast-math) */
    const float scale = (float)(1.0 / sqrt((double)(_mm512_reduce_add_ps(acc) / (float)K + eps)));
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = lanes(k, K);
        const __m256i h = narrow16(_mm512_mul_ps(load16(x + k, m), sc));
        const __m512 hv = widen16(h);
        _mm256_mask_storeu_epi16(y + k, m, narrow16(_mm512_mul_ps(load16(w + k, m), hv)));
    }
}

/* x += r, rounded to bfloat16 (x.add_(r)). */
static inline void add_row512(uint16_t *x, const uint16_t *r, int64_t K) {
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = lanes(k, K);
        _mm256_mask_storeu_epi16(x + k, m, narrow16(_mm512_add_ps(load16(x + k, m), load16(r + k, m))));
    }
}
#endif

/* M rows of K (K % 8 == 0), contiguous. */
void rms_norm(const void *x, const void *w, void *y, int64_t M, int64_t K, float eps, int bf16, int threads) {
    const size_t row = (size_t)K * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 64)
    for (int64_t m = 0; m < M; ++m) {
        const char *xm = (const char *)x + m * row;
        char *ym = (char *)y + m * row;
#ifdef HAVE_ROWS512
        if (bf16) {
            norm_row512((const uint16_t *)xm, w, (uint16_t *)ym, K, eps);
            continue;
        }
#endif
        if (bf16) norm_row(xm, w, ym, K, eps, 1);
        else norm_row(xm, w, ym, K, eps, 0);
    }
}

static inline __attribute__((always_inline)) void add_row(void *x, const void *r, int64_t K,
                                                          const int bf16) {
    if (bf16) {
        uint16_t *xs = x;
        const uint16_t *rs = r;
        for (int64_t k = 0; k < K; ++k) xs[k] = to_bf16(from_bf16(xs[k]) + from_bf16(rs[k]));
    } else {
        float *xs = x;
        const float *rs = r;
        for (int64_t k = 0; k < K; ++k) xs[k] += rs[k];
    }
}

/* M rows of K (K % 8 == 0), contiguous: x[m] += r[m], then y[m] = RMSNorm(x[m]). */
void add_rms_norm(void *x, const void *r, const void *w, void *y, int64_t M, int64_t K, float eps,
                  int bf16, int threads) {
    const size_t row = (size_t)K * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 64)
    for (int64_t m = 0; m < M; ++m) {
        char *xm = (char *)x + m * row, *ym = (char *)y + m * row;
        const char *rm = (const char *)r + m * row;
        if (bf16) {
#ifdef HAVE_ROWS512
            add_row512((uint16_t *)xm, (const uint16_t *)rm, K);
            norm_row512((const uint16_t *)xm, w, (uint16_t *)ym, K, eps);
#else
            add_row(xm, rm, K, 1);
            norm_row(xm, w, ym, K, eps, 1);
#endif
        } else {
            add_row(xm, rm, K, 0);
            norm_row(xm, w, ym, K, eps, 0);
        }
    }
}

/* SiLU-gated product for the CPU, one row at a time: g[m, :] = silu(g[m, :]) * u[m, :], float32
 * or bfloat16 (passed as uint16 bits). Compiled on first use by llmctl/kernels/cpu_native.py; the
 * reference is `F.silu(gate) * up` in llmctl/models/llama.py's MLP.
 *
 * Why: PyTorch's elementwise loops run vector code over the flattened tensor and scalar code on
 * its tail (and on the tail of each thread's share), and the two expf differ in the last bit, so
 * an element's result depends on how many rows share the call. Here each row is its own loop, so
 * element j of a row takes the same path whatever the row count (batch-invariant mode).
 *
 * bfloat16 follows the reference's two roundings: silu rounded to bfloat16, then the product.
 *
 * `silu_and_mul` is vLLM's silu_and_mul for the merged gate/up projection (models/merged.py):
 * x [M, 2F] holds gate in its first F columns and up in the last F, out [M, F] gets the product.
 * One pass instead of PyTorch's two bf16 ops (silu_, mul_) over strided halves.
 */
#include <math.h>
#include <stdint.h>

static inline uint16_t act_to_bf16(float f) {  /* round to nearest even, as PyTorch's conversion */
    union { float f; uint32_t u; } v = {f};
    /* NaN: a bit test, since -ffast-math drops f != f */
    if ((v.u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

static inline float act_from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static void row_f32(float *g, const float *u, int64_t F) {
    for (int64_t j = 0; j < F; ++j) g[j] = g[j] / (1.f + expf(-g[j])) * u[j];
}

static void row_bf16(uint16_t *g, const uint16_t *u, int64_t F) {
    for (int64_t j = 0; j < F; ++j) {
        const float x = act_from_bf16(g[j]);
        const float s = act_from_bf16(act_to_bf16(x / (1.f + expf(-x))));
        g[j] = act_to_bf16(s * act_from_bf16(u[j]));
    }
}

/* M rows of F, contiguous; g is overwritten with the result. */
void silu_mul(void *g, const void *u, int64_t M, int64_t F, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 16)
    for (int64_t m = 0; m < M; ++m) {
        if (bf16) row_bf16((uint16_t *)g + m * F, (const uint16_t *)u + m * F, F);
        else row_f32((float *)g + m * F, (const float *)u + m * F, F);
    }
}

/* 512-bit vectors where the CPU has them (GCC keeps 256 by default): libmvec's 16-lane expf, about
 * 1.3-3x the 8-lane loop at 32-2048 rows. */
#if defined(__x86_64__) && defined(__AVX512F__)
#define WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define WIDE
#endif

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "cpu_bf16x16.h"
#include "cpu_exp512.h"


/* One bfloat16 row: silu(g) rounded, times u, rounded. exp on the polynomial of cpu_exp512.h and
 * the division as a reciprocal with one Newton step (relative error ~1e-7 each, far below bf16's
 * rounding), instead of libmvec's expf and a divide: about 3x the element rate (the kernel is
 * bound by them). Element j takes the same lanes' arithmetic whatever the row count (the tail is
 * masked, not a scalar loop), as batch-invariant mode needs. */
static inline void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t F) {
    const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
    for (int64_t j = 0; j < F; j += 16) {
        const __mmask16 m = F - j >= 16 ? 0xffff : (__mmask16)((1u << (F - j)) - 1);
        const __m512 v = load16(g + j, m);
        /* exp(-v) for -v <= 88 (exp_neg's polynomial holds for any argument below its overflow) */
        const __m512 e = exp_neg(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), v),
                                               _mm512_set1_ps(88.f)));
        const __m512 d = _mm512_add_ps(one, e);
        __m512 r = _mm512_rcp14_ps(d);
        r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two));  /* one Newton step */
        const __m512 s = round16(_mm512_mul_ps(v, r));
        const __m512 y = _mm512_mul_ps(s, load16(u + j, m));
        _mm256_mask_storeu_epi16(o + j, m, narrow16(y));
    }
}
#define HAVE_SILU_ROW_BF16 1
#endif

/* x [M, 2F] (gate | up per row), out [M, F], both contiguous. */
WIDE void silu_and_mul(const void *x, void *out, int64_t M, int64_t F, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 16)
    for (int64_t m = 0; m < M; ++m) {
#ifdef HAVE_SILU_ROW_BF16
        if (bf16) {
            const uint16_t *g = (const uint16_t *)x + m * 2 * F;
            silu_mul_row_bf16(g, g + F, (uint16_t *)out + m * F, F);
            continue;
        }
#endif
        if (bf16) {
            const uint16_t *g = (const uint16_t *)x + m * 2 * F;
            uint16_t *o = (uint16_t *)out + m * F;
            for (int64_t j = 0; j < F; ++j) {
                const float v = act_from_bf16(g[j]);
                const float s = act_from_bf16(act_to_bf16(v / (1.f + expf(-v))));
                o[j] = act_to_bf16(s * act_from_bf16(g[F + j]));
            }
        } else {
            const float *g = (const float *)x + m * 2 * F;
            float *o = (float *)out + m * F;
            for (int64_t j = 0; j < F; ++j) o[j] = g[j] / (1.f + expf(-g[j])) * g[F + j];
        }
    }
}

/* W8A8 int8 linear helpers for the CPU: the dynamic per-token quantization of the activations and
 * the rescale of the int32 products, each one pass over its rows. The int8 x int8 -> int32 GEMM
 * between them is torch._int_mm (oneDNN's u8s8 VNNI / AMX-INT8 kernel). Compiled on first use by
 * llmctl/kernels/cpu/library.py; the references are quantize_rows and _rescale in
 * llmctl/kernels/cpu/linear/int8.py (tests/test_w8a8.py compares them).
 *
 * Why: PyTorch's version of each is 5-7 elementwise passes (float cast, abs, amax, divide, round,
 * clamp, int8 cast; cast, two multiplies, cast), which measured as costly as the int8 GEMM itself
 * at prefill row counts on SmolLM2's shapes.
 *
 * quant_rows_int8: x [M, K] (row stride ldx; float32 or bfloat16 as uint16 bits) ->
 *   q int8 [M, K] and scale float32 [M]: amax = max|x_row|, scale = amax / 127 (1 for an all-zero
 *   row), q = rint(x * (127 / amax)) clamped to [-127, 127]; the same IEEE operations as the
 *   reference (one division per row, one multiply per element, round half to even), so the codes
 *   are identical.
 * rescale_int32: acc int32 [M, N] -> out [M, N] (float32, or bfloat16 rounded to nearest even) =
 *   (float)acc * xs[m] * ws[n].
 */
#include <math.h>
#include <stdint.h>

static inline float i8_from_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t i8_to_bf16(float f) {  /* round to nearest even, as PyTorch's conversion */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

/* amax / 127 and 127 / amax as the reference's correctly rounded float32 divisions: -ffast-math
 * compiles a division by the constant 127 as a multiply by its rounded reciprocal (one rounding
 * more: seen to change scales by an ulp and flip codes at .5). A volatile 127 is no constant. */
static float row_inv(float amax, float *scale) {
    volatile float qmax_v = 127.f;
    const float qmax = qmax_v;
    if (amax > 0.f) {
        *scale = amax / qmax;
        return qmax / amax;
    }
    *scale = 1.f;
    return 1.f;
}

static void quant_row_f32(const float *x, int64_t K, int8_t *q, float *scale) {
    float amax = 0.f;
    for (int64_t j = 0; j < K; ++j) amax = fmaxf(amax, fabsf(x[j]));
    const float inv = row_inv(amax, scale);
    for (int64_t j = 0; j < K; ++j) {
        float v = rintf(x[j] * inv);
        v = fminf(fmaxf(v, -127.f), 127.f);
        q[j] = (int8_t)v;
    }
}

static void quant_row_bf16(const uint16_t *x, int64_t K, int8_t *q, float *scale) {
    float amax = 0.f;
    for (int64_t j = 0; j < K; ++j) amax = fmaxf(amax, fabsf(i8_from_bf16(x[j])));
    const float inv = row_inv(amax, scale);
    for (int64_t j = 0; j < K; ++j) {
        float v = rintf(i8_from_bf16(x[j]) * inv);
        v = fminf(fmaxf(v, -127.f), 127.f);
        q[j] = (int8_t)v;
    }
}

void quant_rows_int8(const void *x, int64_t ldx, int bf16, int64_t M, int64_t K, int8_t *q,
                     float *scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 16)
    for (int64_t m = 0; m < M; ++m) {
        if (bf16) quant_row_bf16((const uint16_t *)x + m * ldx, K, q + m * K, scale + m);
        else quant_row_f32((const float *)x + m * ldx, K, q + m * K, scale + m);
    }
}

void rescale_int32(const int32_t *acc, int64_t M, int64_t N, const float *xs, const float *ws,
                   void *out, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 16)
    for (int64_t m = 0; m < M; ++m) {
        const int32_t *a = acc + m * N;
        const float s = xs[m];
        if (bf16) {
            uint16_t *o = (uint16_t *)out + m * N;
            for (int64_t n = 0; n < N; ++n) o[n] = i8_to_bf16((float)a[n] * s * ws[n]);
        } else {
            float *o = (float *)out + m * N;
            for (int64_t n = 0; n < N; ++n) o[n] = (float)a[n] * s * ws[n];
        }
    }
}

/* gemm_int8_exact: out int32 [M, N] = x int8 [M, K] . w int8 [N, K]^T, exact (int32 sums of
 * int16 products: 127 * 127 * K stays far inside int32 for any K a model has). For CPUs whose
 * int8 GEMM in torch._int_mm saturates (x86 without VNNI: oneDNN's vpmaddubsw adds u8 x s8 pairs
 * into int16, kernels/cpu/linear/int8.py int_mm_exact), where the alternative was dequantized
 * weights. x is widened to int16 once; each weight row is widened 16 values at a time and
 * multiplied with vpmaddwd (16 products added in pairs into 8 int32 lanes, no saturation: two
 * products of at most 127 * 127 each), 4 rows of x by 2 weight rows per register tile; the
 * threads split the weight rows (the weight, 1 byte a value, is read once per 64 rows of x). */
#if defined(__AVX2__)
#include <immintrin.h>
#include <stdlib.h>

static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* rows r0 .. r0 + nr (nr <= 4) of x16 [*, K] against weight rows n, n + 1 (the second only if
 * two): out[r][n..]; K16 = K rounded down to 16, the tail in scalar. */
static inline void tile(const int16_t *x16, int64_t K, int64_t r0, int nr, const int8_t *w,
                        int64_t n, int two, int32_t *out, int64_t N) {
    const int64_t K16 = K & ~(int64_t)15;
    __m256i acc[4][2];
    for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int8_t *w0 = w + n * K, *w1 = w + (n + two) * K;
    for (int64_t k = 0; k < K16; k += 16) {
        const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w0 + k)));
        const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w1 + k)));
        for (int r = 0; r < 4; ++r) {
            if (r >= nr) break;
            const __m256i a = _mm256_loadu_si256((const __m256i *)(x16 + (r0 + r) * K + k));
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, b0));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, b1));
        }
    }
    for (int r = 0; r < nr; ++r) {
        int32_t s0 = hsum8(acc[r][0]), s1 = hsum8(acc[r][1]);
        for (int64_t k = K16; k < K; ++k) {
            s0 += (int32_t)x16[(r0 + r) * K + k] * w0[k];
            s1 += (int32_t)x16[(r0 + r) * K + k] * w1[k];
        }
        out[(r0 + r) * N + n] = s0;
        if (two) out[(r0 + r) * N + n + 1] = s1;
    }
}

int gemm_int8_exact(const int8_t *x, int64_t M, int64_t K, const int8_t *w, int64_t N,
                    int32_t *out, int threads) {
    int16_t *x16 = malloc(sizeof(int16_t) * (size_t)M * (size_t)K);
    if (!x16) return 1;
    for (int64_t i = 0; i < M * K; ++i) x16[i] = x[i];
    for (int64_t m0 = 0; m0 < M; m0 += 64) { /* 64 rows of x16 (in L2) against every weight */
        const int64_t m1 = m0 + 64 < M ? m0 + 64 : M;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
        for (int64_t n = 0; n < N; n += 2)
            for (int64_t r = m0; r < m1; r += 4)
                tile(x16, K, r, m1 - r < 4 ? (int)(m1 - r) : 4, w, n, n + 1 < N, out, N);
    }
    free(x16);
    return 0;
}
int gemm_int8_exact_built(void) { return 1; }
#else
int gemm_int8_exact(const int8_t *x, int64_t M, int64_t K, const int8_t *w, int64_t N,
                    int32_t *out, int threads) {
    (void)x, (void)M, (void)K, (void)w, (void)N, (void)out, (void)threads;
    return 1;
}
int gemm_int8_exact_built(void) { return 0; }
#endif

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

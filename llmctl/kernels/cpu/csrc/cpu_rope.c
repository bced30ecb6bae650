/* Rotary position embedding in place for bfloat16 q and k on the CPU, with exactly PyTorch's
 * arithmetic in models/rope.py (_rotate_in_place): the float32 cos/sin table rounded to bf16,
 * then each product and each sum rounded to bf16 as the separate bf16 tensor ops round them, so
 * results are bit-identical to that path while one call replaces ~25 tensor ops per layer.
 * Compiled on first use by llmctl/kernels/cpu_rope.py.
 *
 *   x          [T, heads, D] bf16 (uint16 bits), each token's heads contiguous, tokens ldx
 *              elements apart (a column slice of the merged q/k/v projection's output)
 *   y          [T, heads, D] contiguous: the rotated x (y == x with ldx == heads * D: in place)
 *   cos, sin   [positions, D] float32, contiguous (only the first D / 2 columns are read: the
 *              table repeats its first half)
 *   positions  [T] int64
 * Reading the merged projection's slices and writing contiguous q and k saves the two copies
 * that would make them contiguous first.
 */
#include <stdint.h>
#include <string.h>

static inline float f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 to bf16, round to nearest even, NaN kept a NaN: what PyTorch's conversion does. */
static inline uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Each step rounds to bf16 before the next reads it: a product of two bf16 values is exact in
 * float32, so no contraction into an FMA can change a result. */
static void rotate(const uint16_t *x, int64_t ldx, uint16_t *y, int64_t rows, int heads, int D,
                   const float *cos, const float *sin, const int64_t *pos) {
    const int half = D / 2;
    for (int64_t t = 0; t < rows; ++t) {
        const float *ct = cos + pos[t] * D, *st = sin + pos[t] * D;
        for (int h = 0; h < heads; ++h) {
            const uint16_t *r = x + t * ldx + h * (int64_t)D;
            uint16_t *o = y + (t * heads + h) * (int64_t)D;
            for (int i = 0; i < half; ++i) {
                const float c = f32(bf16(ct[i])), s = f32(bf16(st[i]));
                const float x1 = f32(r[i]), x2 = f32(r[i + half]);
                const float x1c = f32(bf16(x1 * c)), x2s = f32(bf16(x2 * s));
                const float x2c = f32(bf16(x2 * c)), x1s = f32(bf16(x1 * s));
                o[i] = bf16(x1c - x2s);
                o[i + half] = bf16(x2c + x1s);
            }
        }
    }
}

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "cpu_bf16x16.h"
#define HAVE_ROTATE512 1


/* `rotate` on 16-lane registers for D / 2 % 16 == 0: the same roundings in the same order, the
 * cos/sin rows rounded once per token for all its heads. (vcvtneps2bf16 flushes float32
 * denormals to zero where the scalar rounding keeps them: values below 1e-38, not met by
 * activations times cos/sin.) */
static void rotate512(const uint16_t *x, int64_t ldx, uint16_t *y, int64_t rows, int heads,
                      int D, const float *cos, const float *sin, const int64_t *pos) {
    const int half = D / 2;
    __m512 c[8], s[8]; /* half <= 128 */
    for (int64_t t = 0; t < rows; ++t) {
        const float *ct = cos + pos[t] * D, *st = sin + pos[t] * D;
        for (int j = 0; j < half / 16; ++j)
            c[j] = round16(_mm512_loadu_ps(ct + 16 * j)), s[j] = round16(_mm512_loadu_ps(st + 16 * j));
        for (int h = 0; h < heads; ++h) {
            const uint16_t *r = x + t * ldx + h * (int64_t)D;
            uint16_t *o = y + (t * heads + h) * (int64_t)D;
            for (int j = 0; j < half / 16; ++j) {
                const __m512 x1 = widen16(_mm256_loadu_si256((const __m256i *)(r + 16 * j)));
                const __m512 x2 = widen16(_mm256_loadu_si256((const __m256i *)(r + half + 16 * j)));
                const __m512 x1c = round16(_mm512_mul_ps(x1, c[j]));
                const __m512 x2s = round16(_mm512_mul_ps(x2, s[j]));
                const __m512 x2c = round16(_mm512_mul_ps(x2, c[j]));
                const __m512 x1s = round16(_mm512_mul_ps(x1, s[j]));
                _mm256_storeu_si256((__m256i *)(o + 16 * j),
                                    narrow16(_mm512_sub_ps(x1c, x2s)));
                _mm256_storeu_si256((__m256i *)(o + half + 16 * j),
                                    narrow16(_mm512_add_ps(x2c, x1s)));
            }
        }
    }
}
#endif

void rope_bf16(const uint16_t *q, int64_t ldq, const uint16_t *k, int64_t ldk, uint16_t *q_out,
               uint16_t *k_out, int64_t rows, int heads, int kv_heads, int D, const float *cos,
               const float *sin, const int64_t *pos, int threads) {
    /* Decode steps have a handful of rows: threads only pay off for prefill chunks. */
    const int nt = rows >= 64 ? threads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t b = 0; b < (rows + 15) / 16; ++b) {
        const int64_t r0 = 16 * b, n = rows - r0 < 16 ? rows - r0 : 16;
#ifdef HAVE_ROTATE512
        if (D % 32 == 0 && D <= 256) {
            rotate512(q + r0 * ldq, ldq, q_out + r0 * heads * (int64_t)D, n, heads, D, cos, sin,
                      pos + r0);
            rotate512(k + r0 * ldk, ldk, k_out + r0 * kv_heads * (int64_t)D, n, kv_heads, D,
                      cos, sin, pos + r0);
            continue;
        }
#endif
        rotate(q + r0 * ldq, ldq, q_out + r0 * heads * (int64_t)D, n, heads, D, cos, sin, pos + r0);
        rotate(k + r0 * ldk, ldk, k_out + r0 * kv_heads * (int64_t)D, n, kv_heads, D, cos, sin,
               pos + r0);
    }
}

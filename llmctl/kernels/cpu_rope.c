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

void rope_bf16(const uint16_t *q, int64_t ldq, const uint16_t *k, int64_t ldk, uint16_t *q_out,
               uint16_t *k_out, int64_t rows, int heads, int kv_heads, int D, const float *cos,
               const float *sin, const int64_t *pos, int threads) {
    /* Decode steps have a handful of rows: threads only pay off for prefill chunks. */
    const int nt = rows >= 64 ? threads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t b = 0; b < (rows + 15) / 16; ++b) {
        const int64_t r0 = 16 * b, n = rows - r0 < 16 ? rows - r0 : 16;
        rotate(q + r0 * ldq, ldq, q_out + r0 * heads * (int64_t)D, n, heads, D, cos, sin, pos + r0);
        rotate(k + r0 * ldk, ldk, k_out + r0 * kv_heads * (int64_t)D, n, kv_heads, D, cos, sin,
               pos + r0);
    }
}

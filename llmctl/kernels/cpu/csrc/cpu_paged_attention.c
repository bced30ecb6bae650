/* Paged decode attention for the CPU: one query token per sequence, K/V read in place from the
 * paged cache through the block table (no gathered copy). Compiled on first use by
 * llmctl/kernels/cpu_native.py; the plain-PyTorch reference is decode_attention in attention.py.
 *
 * Layouts (all contiguous):
 *   q            [B, H, D]            float32
 *   k/v cache    [KVH, slots, D]      float32, bfloat16 passed as its uint16 bits, or fp8
 *                                     (e4m3fn or e5m2) passed as its bytes
 *   block_tables [B, max_blocks]      int64, slot = block * bs + offset
 *   context_lens [B]                  int64, tokens in cache including the new one
 *   out          [B, H, D]            float32
 * D must be a multiple of 16 (checked by the caller).
 * Work item = (sequence, KV head): its G = H / KVH query heads share every K/V row read, so the
 * cache is streamed once per step. Two passes over the context, each reading whole blocks of
 * bs * D contiguous values: scores into a per-thread buffer [G, len] (rows 64-byte aligned),
 * softmax, weighted sum of V. A row's result depends on its own query, K/V and length only (no
 * split of the context across threads), which batch-invariant mode relies on.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

/* Blocks sit anywhere in the cache and the hardware prefetchers stop at page boundaries (an fp32
 * block of 16 x 64 is exactly one page), so each token row fetches the same row of the next
 * block. */
static inline void prefetch_row(const char *p, size_t row) {
    for (size_t o = 0; o < row; o += 64) __builtin_prefetch(p + o, 0, 0);
}

/* The scores of G query heads q [G, D] against one K row kr (of element kind `kind`) into
 * s[g * stride]. */
static inline __attribute__((always_inline)) void score_row(
    const float *q, const void *kr, int G, const int D, float scale, float *s, int64_t stride,
    const int kind) {
    for (int g = 0; g < G; ++g) {
        const float *qg = q + (int64_t)g * D;
        /* two chains: the FMA latency, not the loads, bounds one */
        v8f a0 = {0}, a1 = {0};
        for (int d = 0; d < D; d += 16) {
            a0 += *(const v8f *)(qg + d) * load8(kr, d, kind);
            a1 += *(const v8f *)(qg + d + 8) * load8(kr, d + 8, kind);
        }
        s[(int64_t)g * stride] = hsum(a0 + a1) * scale;
    }
}

/* Softmax of each of the G rows of s [G, stride] (len entries, all finite) in place. */
static inline void softmax_rows(float *s, int64_t len, int G, int64_t stride) {
    for (int g = 0; g < G; ++g) {
        float *sg = s + (int64_t)g * stride, m = sg[0], sum = 0.f;
        for (int64_t t = 1; t < len; ++t) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
    }
}

/* One (sequence, KV head). q, out: its G query rows [G, D]; k, v: this KV head's slot 0.
 * Inlined with D a constant for the common head sizes, so the loops over D unroll into
 * registers. */
static inline __attribute__((always_inline)) void item(
    const float *q, const char *k, const char *v, const int64_t *table, int64_t len, float *out,
    int G, const int D, int bs, float scale, float *s, int64_t stride, const int kind) {
    const size_t row = kind_size(kind) * (size_t)D;
    for (int64_t start = 0; start < len; start += bs) {
        const int64_t n = len - start < bs ? len - start : bs;
        const char *kb = k + (size_t)table[start / bs] * bs * row;
        const char *next = start + bs < len ? k + (size_t)table[start / bs + 1] * bs * row : NULL;
        for (int64_t t = 0; t < n; ++t) {
            const void *kr = kb + t * row;
            if (next) prefetch_row(next + t * row, row);
            score_row(q, kr, G, D, scale, s + start + t, stride, kind);
        }
    }
    softmax_rows(s, len, G, stride);
    for (int g = 0; g < G; ++g) {
        float *og = out + (int64_t)g * D;
        const float *pg = s + (int64_t)g * stride;
        for (int c = 0; c < D; c += 64) {  /* 8 register accumulators per 64 columns */
            const int w = D - c < 64 ? D - c : 64;
            v8f acc[8] = {{0}};
            for (int64_t start = 0; start < len; start += bs) {
                const int64_t n = len - start < bs ? len - start : bs;
                const char *vb = v + (size_t)table[start / bs] * bs * row + kind_size(kind) * c;
                const int more = g == 0 && start + bs < len;
                const char *next = more ? v + (size_t)table[start / bs + 1] * bs * row : NULL;
                for (int64_t t = 0; t < n; ++t) {
                    if (next && c == 0) prefetch_row(next + t * row, row);
                    const float p = pg[start + t];
                    const void *vr = vb + t * row;
                    for (int j = 0; j < w / 8; ++j) acc[j] += p * load8(vr, 8 * j, kind);
                }
            }
            for (int j = 0; j < w / 8; ++j) *(v8f *)(og + c + 8 * j) = acc[j];
        }
    }
}


/* n (a multiple of 16) fp8 values (e4m3fn or e5m2 bytes) as float32, exactly, through float16:
 * e5m2 is the top byte of a float16; e4m3 sign-extended to 16 bits and shifted left by 7 has its
 * sign at bit 15 (a copy at 14, cleared), its exponent and mantissa below: a float16 worth the
 * value times 2^-8, subnormals included, which one multiply by 256 restores. With AVX2 and F16C
 * 16 values take 7 instructions; GCC's generic vector code (the fallback) loads the bytes one by
 * one (its assembly). Compiled for AVX2, an fp8 cache read at 0.84x a float32 cache's speed
 * through a 256-entry table, and at 1.37x with this (BENCHMARKS KV38h). */
static inline void fp8_row(const uint8_t *src, int n, const int kind, float *dst) {
#if defined(__AVX2__) && defined(__F16C__)
    for (int i = 0; i < n; i += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(src + i));
        const __m256i h = kind == KIND_E5M2
                              ? _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8)
                              : _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                                 _mm256_set1_epi16((short)0xBFFF));
        __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        if (kind == KIND_E4M3) {
            lo = _mm256_mul_ps(lo, _mm256_set1_ps(256.f));
            hi = _mm256_mul_ps(hi, _mm256_set1_ps(256.f));
        }
        _mm256_storeu_ps(dst + i, lo);
        _mm256_storeu_ps(dst + i + 8, hi);
    }
#else
    typedef uint8_t v8b __attribute__((vector_size(8), aligned(1)));
    typedef _Float16 v8hf __attribute__((vector_size(16)));
    for (int i = 0; i < n; i += 8) {
        const v8h x = __builtin_convertvector(*(const v8b *)(src + i), v8h);
        const v8h h = kind == KIND_E5M2 ? (v8h)(x << 8) : ((x & 0x80) << 8) | ((x & 0x7f) << 7);
        const v8r f = __builtin_convertvector((v8hf)h, v8r);
        *(v8f *)(dst + i) = kind == KIND_E5M2 ? f : f * 256.f;
    }
#endif
}

/* item's contract over an fp8 or int8 cache: the item's K and V rows widened once each (not once
 * per query head) into float32 scratch kf, vf [len, D], laid out as consecutive blocks of `ident`
 * (ident[i] = i), then item itself over them: the results equal item's over the cache widened
 * to float32, bit for bit. */
static inline __attribute__((always_inline)) void item_fp8(
    const float *q, const char *k, const char *v, const int64_t *table, int64_t len, float *out,
    int G, const int D, int bs, float scale, float *s, int64_t stride, float *kf, float *vf,
    const int64_t *ident, const int kind) {
    const size_t row = row_bytes(kind, D);
    for (int64_t start = 0; start < len; start += bs) {
        const int64_t n = len - start < bs ? len - start : bs;
        const char *kb = k + (size_t)table[start / bs] * bs * row;
        const char *vb = v + (size_t)table[start / bs] * bs * row;
        for (int64_t t = 0; t < n; ++t) {
            float *kd = kf + (start + t) * D, *vd = vf + (start + t) * D;
            if (kind == KIND_I8) { /* int8 values times the row's scale, in float32 */
                const int8_t *kr = (const int8_t *)(kb + t * row), *vr = (const int8_t *)(vb + t * row);
                float ks, vs;
                memcpy(&ks, kr + D, 4), memcpy(&vs, vr + D, 4);
                for (int d = 0; d < D; ++d) kd[d] = (float)kr[d] * ks, vd[d] = (float)vr[d] * vs;
                continue;
            }
            const uint8_t *kr = (const uint8_t *)(kb + t * row), *vr = (const uint8_t *)(vb + t * row);
            fp8_row(kr, D, kind, kd), fp8_row(vr, D, kind, vd);
        }
    }
    item(q, (const char *)kf, (const char *)vf, ident, len, out, G, D, bs, scale, s, stride,
         KIND_F32);
}

/* Returns 0, or 1 when a scratch buffer could not be allocated (out is then incomplete). */
static int run(
    const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
    float *out, int B, int H, int KVH, int D, int64_t slots, int max_blocks, int bs, float scale,
    int64_t max_len, int threads, const int kind) {
    const int G = H / KVH;
    /* Rows of the score buffer start 64-byte aligned, whatever max_len and the allocator give:
     * the vectorised softmax sum then splits a row the same way in every call (batch-invariant
     * mode relies on it; rows never share a vector). */
    const int64_t stride = ((max_len > 0 ? max_len : 1) + 15) & ~(int64_t)15;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *s = (float *)aligned_alloc(64, sizeof(float) * (size_t)G * (size_t)stride);
        /* fp8: an item's K and V rows widened to float32, [stride + bs, D] each, and the block
         * table of those scratch rows */
        const int fp8 = kind >= KIND_E4M3;
        const size_t rows = (size_t)(stride + bs) * (size_t)D * sizeof(float);
        float *kf = fp8 ? (float *)aligned_alloc(64, rows) : NULL;
        float *vf = fp8 ? (float *)aligned_alloc(64, rows) : NULL;
        int64_t *ident = fp8 ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(max_blocks + 1)) : NULL;
        const int ok = s != NULL && (!fp8 || (kf != NULL && vf != NULL && ident != NULL));
        if (ok && fp8)
            for (int64_t i = 0; i <= max_blocks; ++i) ident[i] = i;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < (int64_t)B * KVH; ++it) {
            if (!ok) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t b = it / KVH, h = it % KVH, r = (b * H + h * G) * D;
            const size_t head = (size_t)h * slots * row_bytes(kind, D);
            const char *k = (const char *)kc + head, *v = (const char *)vc + head;
            /* Every specialisation is chosen here, inside the loop: GCC outlines the parallel
             * region before inlining, so a constant passed into run() would reach item() as a
             * variable. */
            const int64_t *tb = tables + b * max_blocks;
            const float *qr = q + r;
            float *o = out + r;
            const int64_t n = lens[b];
            /* one specialisation per (kind, D in 64, 128, other) */
#define ITEM(KIND, DD)                                                                           \
    (KIND) >= KIND_E4M3                                                                          \
        ? item_fp8(qr, k, v, tb, n, o, G, DD, bs, scale, s, stride, kf, vf, ident, KIND)        \
        : item(qr, k, v, tb, n, o, G, DD, bs, scale, s, stride, KIND)
#define ITEMS(KIND)                                                                              \
    if (kind == KIND && D == 64) ITEM(KIND, 64);                                                 \
    else if (kind == KIND && D == 128) ITEM(KIND, 128);                                          \
    else if (kind == KIND) ITEM(KIND, D)
            ITEMS(KIND_F32);
            ITEMS(KIND_BF16);
            ITEMS(KIND_E4M3);
            ITEMS(KIND_E5M2);
            ITEMS(KIND_I8);
#undef ITEMS
#undef ITEM
        }
        free(s), free(kf), free(vf), free(ident);
    }
    return failed;
}

/* The exported entry of one cache kind (float32 query). */
#define DECODE(name, kind)                                                                       \
    int name(const float *q, const void *kc, const void *vc, const int64_t *tables,             \
             const int64_t *lens, float *out, int B, int H, int KVH, int D, int64_t slots,      \
             int max_blocks, int bs, float scale, int64_t max_len, int threads) {               \
        return run(q, kc, vc, tables, lens, out, B, H, KVH, D, slots, max_blocks, bs, scale,   \
                   max_len, threads, kind);                                                    \
    }
DECODE(paged_decode_f32, KIND_F32)
DECODE(paged_decode_bf16, KIND_BF16)
/* over a quantized cache: the fallback where vdpbf16ps is missing, and float32 models' kernel */
DECODE(paged_decode_e4m3, KIND_E4M3)
DECODE(paged_decode_e5m2, KIND_E5M2)
DECODE(paged_decode_i8, KIND_I8)

/* The K and V rows of T new tokens into their cache slots, one call for both caches (two
 * index_copy_ calls took ~25-60 us per layer and step). k, v [T, KVH, D] with token strides ldk,
 * ldv in elements (v may be a column slice of the merged q/k/v output) and head stride D; caches
 * [KVH, nslots, D]; elements of `esize` bytes (any dtype). Slots come from the engine's block
 * tables (in range by construction); the Python caller checks shapes, strides and dtypes. Long
 * writes (prefill chunks) are split over the threads by token. */
void write_kv(const char *k, int64_t ldk, const char *v, int64_t ldv, char *kc, char *vc,
              const int64_t *slots, int64_t T, int KVH, int D, int64_t nslots, int esize,
              int threads) {
    const size_t row = (size_t)D * (size_t)esize;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= 256)
    for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < KVH; ++h) {
            const size_t dst = ((size_t)h * (size_t)nslots + (size_t)slots[t]) * row;
            memcpy(kc + dst, k + ((size_t)t * (size_t)ldk + (size_t)h * D) * esize, row);
            memcpy(vc + dst, v + ((size_t)t * (size_t)ldv + (size_t)h * D) * esize, row);
        }
}

/* int8 KV rows (kernels/kv_dtype.py to_cache, the same codes bit for bit): for each new token and
 * KV head, scale = max(amax, 1e-30) / 127, codes = round-half-even(x / scale) clamped to +-127,
 * then the scale's 4 bytes; k, v [T, KVH, D] float32 or bf16 bits (`bf16`) with token strides
 * ldk, ldv; caches [KVH, nslots, D + 4] int8. True divisions (no reciprocal: -ffast-math is off
 * here) and nearbyintf in the default rounding mode, as torch computes them. Called per decode
 * step, where ten small torch ops per layer would cost more than the write. */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
static void quant_row(const char *x, const int bf16, int D, int8_t *dst) {
    float amax = 0.f, val[D];
    for (int d = 0; d < D; ++d) {
        if (bf16) {
            uint32_t u = (uint32_t)((const uint16_t *)x)[d] << 16;
            memcpy(&val[d], &u, 4);
        } else {
            val[d] = ((const float *)x)[d];
        }
        const float a = fabsf(val[d]);
        amax = a > amax ? a : amax;
    }
    const float scale = (amax > 1e-30f ? amax : 1e-30f) / 127.f;
    for (int d = 0; d < D; ++d) {
        float c = nearbyintf(val[d] / scale);
        c = c > 127.f ? 127.f : c < -127.f ? -127.f : c;
        dst[d] = (int8_t)c;
    }
    memcpy(dst + D, &scale, 4);
}

void write_kv_i8(const char *k, int64_t ldk, const char *v, int64_t ldv, int8_t *kc, int8_t *vc,
                 const int64_t *slots, int64_t T, int KVH, int D, int64_t nslots, int bf16,
                 int threads) {
    const size_t row = (size_t)D + 4, esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= 64)
    for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < KVH; ++h) {
            const size_t dst = ((size_t)h * (size_t)nslots + (size_t)slots[t]) * row;
            quant_row(k + ((size_t)t * (size_t)ldk + (size_t)h * D) * esize, bf16, D, kc + dst);
            quant_row(v + ((size_t)t * (size_t)ldv + (size_t)h * D) * esize, bf16, D, vc + dst);
        }
}
#pragma GCC pop_options

/* An fp8 cache's rows into and out of it (kernels/kv_dtype.py to_cache and widen) through tables
 * that torch's own casts filled (exact by construction): narrowing maps every 16-bit pattern
 * (bf16 or fp16) to its saturated fp8 code [65536], widening every code to its 16-bit value [256].
 * x [rows, w] with row stride ld (elements: K or V may be a column slice of the q/k/v output);
 * out [rows, w] contiguous. torch's casts and clamp took 0.65 s and its widening about 1 s of a
 * 40 s prefill-heavy job on an fp8 cache (BENCHMARKS KV38f); a lookup per value is bandwidth. */
#define LUT_OMP _Pragma("omp parallel for num_threads(threads) if (threads > 1 && rows >= 64)")
#define LUT_ROWS(name, src_t, dst_t)                                                             \
    void name(const src_t *x, int64_t ld, int64_t rows, int64_t w, const dst_t *lut, dst_t *out, \
              int threads) {                                                                     \
        LUT_OMP                                                                                  \
        for (int64_t r = 0; r < rows; ++r)                                                       \
            for (int64_t i = 0; i < w; ++i) out[r * w + i] = lut[x[r * ld + i]];                \
    }
LUT_ROWS(lut_narrow, uint16_t, uint8_t)
LUT_ROWS(lut_widen, uint8_t, uint16_t)

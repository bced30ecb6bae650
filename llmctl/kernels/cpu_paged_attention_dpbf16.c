/* Paged decode attention for a bfloat16 query and cache on the bf16 dot-product instruction
 * (AVX512-BF16 `vdpbf16ps`). Same contract as paged_decode_bf16 in cpu_paged_attention.c, which
 * stays the fallback: built into the same library with -march=native, and where the compiler or
 * CPU lacks AVX512-BF16 only `paged_decode_dpbf16_built` (returning 0) and a stub exist; the
 * caller (cpu_native.py) also checks /proc/cpuinfo. Reference: decode_attention in attention.py.
 *
 * Layouts (all contiguous; bfloat16 passed as its uint16 bits):
 *   q, out       [B, H, D]            bfloat16 (out rounded once, to nearest even)
 *   k/v cache    [KVH, slots, D]      bfloat16
 *   block_tables [B, max_blocks]      int64, slot = block * bs + offset
 *   context_lens [B]                  int64, 1 <= len
 * D must be a multiple of 16. Work item = (sequence, KV head) with its G = H / KVH query heads.
 *
 * Why: the generic kernel widens every bf16 value to float32 (G times per V row) and ends each
 * score with a horizontal sum; here one vdpbf16ps multiplies 32 bf16 pairs into 16 float sums.
 * How, per item:
 *   scores  16 tokens of one block at a time: per query head, 16 vectors of partial dot products
 *           reduced by a transpose-add tree into one vector of 16 scores [G, len] (float32);
 *   softmax scale, max, a polynomial exp on 16 lanes; P rounded to bf16 [G, len] (as the
 *           reference rounds its probabilities), and its sum taken over the rounded values;
 *   P V     each pair of V rows (t, t + 1) is interleaved once and multiplied by the broadcast
 *           pair (P[g][t], P[g][t + 1]) for up to 8 query heads, so V is read once per 32 or 64
 *           columns for all G heads, not once per head; out = acc / sum.
 * Every score, exp and output element is computed by the same operations in the same order
 * whatever the token's block, the block size, the batch or the thread count (the reduction tree
 * treats the 16 lanes alike; sums run from token 0), which batch-invariant mode relies on.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#include <math.h>

#include "cpu_exp512.h"

#define INLINE static inline __attribute__((always_inline))

/* K blocks prefetched ahead (measured 8 better than 1, 2 or 4, equal to 16, on the benchmark). */
enum { AHEAD = 8 };

/* Elements [c, c + 32) of a row of D: a mask for the 16-element tail when D % 32 == 16. */
INLINE __mmask32 cols(int c, int D) {
    return D - c >= 32 ? ~(__mmask32)0 : D - c > 0 ? (__mmask32)((1u << (D - c)) - 1) : 0;
}

/* Lane t of the result = the sum of the 16 lanes of v[t]: 45 shuffles and adds for 16 sums, each
 * lane of every v[t] summed in the same order. */
INLINE __m512 reduce16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)  /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  /* per 128-bit lane: the 4 vectors' lane sums */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)  /* 128-bit lanes 0 + 2 and 1 + 3, two vectors' worth each */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

/* Raw scores q[g] . K[t] of the n <= 16 rows k[0 .. n) (contiguous, D each) for the G heads of
 * q [G, D] into s[g * stride]. Rows past n repeat row n - 1; their lanes are not stored. `full`
 * (n == 16, a constant) keeps GCC from merging this call with the general one. */
INLINE void scores16(const uint16_t *q, const uint16_t *k, int n, const int full, int G,
                     const int D, float *s, int64_t stride) {
    for (int g = 0; g < G; ++g) {
        __m512 acc[16];
        /* k opaque per head: else GCC hoists the 16 x D / 32 row addresses and spills them */
        __asm__("" : "+r"(k));
        for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 32) {
            const __mmask32 m = cols(c, D);
            const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + g * D + c);
            for (int t = 0; t < 16; ++t) {
                const uint16_t *kr = k + (full || t < n ? t : n - 1) * D + c;
                acc[t] = _mm512_dpbf16_ps(acc[t], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, kr));
            }
        }
        _mm512_mask_storeu_ps(s + g * stride, (__mmask16)((1u << n) - 1), reduce16(acc));
    }
}

/* `bytes` from p into L2: prefetcht1 leaves L1's miss buffers to the loads (prefetcht0 here
 * stalled on them; measured slower). */
INLINE void prefetch(const uint16_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}

/* Scores of one item over its context, 16 rows of a block at a time, into s [G, stride]; the
 * cache offsets of its tokens' rows into off [len]. Blocks are scattered and the hardware
 * prefetchers stop at page boundaries, so K is prefetched AHEAD blocks ahead, and each V block
 * while its K block is scored (the P V pass then finds it in L2). */
INLINE void score_pass(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                       const int64_t *table, int64_t len, int G, const int D, int bs, float *s,
                       int64_t stride, int64_t *off) {
    for (int64_t j = 0; j < AHEAD && j * bs < len; ++j)
        prefetch(k + table[j] * bs * D, (len - j * bs < bs ? len - j * bs : bs) * D * 2);
    for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
        const int64_t nb = len - start < bs ? len - start : bs, base = table[j] * bs * D;
        const int64_t ahead = start + AHEAD * bs < len ? table[j + AHEAD] * bs * D : -1;
        for (int64_t o = 0; o < nb; o += 16) {
            const int n = nb - o < 16 ? (int)(nb - o) : 16;
            if (ahead >= 0) prefetch(k + ahead + o * D, (int64_t)n * D * 2);
            prefetch(v + base + o * D, (int64_t)n * D * 2);
            for (int i = 0; i < n; ++i) off[start + o + i] = base + (o + i) * D;
            if (n == 16) scores16(q, k + base + o * D, 16, 1, G, D, s + start + o, stride);
            else scores16(q, k + base + o * D, n, 0, G, D, s + start + o, stride);
        }
    }
}

/* Softmax of the raw scores s [G, stride] (len each, times scale) into bf16 p [G, stride], zero
 * from len up to the next multiple of 16; inv[g] = 1 / the sum of the rounded p[g]. */
INLINE void softmax(const float *s, uint16_t *p, int64_t len, int G, float scale,
                    int64_t stride, float *inv) {
    for (int g = 0; g < G; ++g) {
        const float *sg = s + g * stride;
        uint16_t *pg = p + g * stride;
        __m512 mx = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
            mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, sg + t));
        }
        const __m512 sc = _mm512_set1_ps(scale);
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale);
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
            const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, sg + t), sc, top);
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(m, exp_neg(x)));
            _mm256_storeu_si256((__m256i *)(pg + t), h);
            total = _mm512_add_ps(total, _mm512_castsi512_ps(
                                             _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        inv[g] = 1.f / _mm512_reduce_add_ps(total);
    }
}

/* out[g][c .. c + 32 NC) = inv[g] * sum_t p[g][t] V[t][...] for the gn <= 8 / NC heads of
 * p [gn, stride] and out [gn, D]: 2 NC accumulators per head, 16 at most. A pair of V rows
 * interleaved (unpack lo/hi) holds columns {0-3, 8-11, ...} / {4-7, 12-15, ...} of each 32, put
 * back in order at the end. An odd last token pairs with a zero row (and p = 0). */
INLINE void pv(const uint16_t *v, const int64_t *off, int64_t len, const uint16_t *p,
               int64_t stride, int gn, const int D, int c, const int NC, const float *inv,
               uint16_t *out) {
    __m512 acc[8][4];
    for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    const __mmask32 m[2] = {cols(c, D), cols(c + 32, D)};
    for (int64_t t = 0; t < len; t += 2) {
        const int two = t + 1 < len;
        const uint16_t *r0 = v + off[t] + c, *r1 = v + off[t + two] + c;
        __m512i lo[2], hi[2];
        for (int j = 0; j < NC; ++j) {
            const __m512i a = _mm512_maskz_loadu_epi16(m[j], r0 + 32 * j);
            const __m512i b = _mm512_maskz_loadu_epi16(two ? m[j] : 0, r1 + 32 * j);
            lo[j] = _mm512_unpacklo_epi16(a, b), hi[j] = _mm512_unpackhi_epi16(a, b);
        }
        for (int g = 0; g < 8 / NC; ++g) {
            if (g >= gn) break;
            uint32_t w;
            memcpy(&w, p + g * stride + t, 4);
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)w);
            for (int j = 0; j < NC; ++j) {
                acc[g][2 * j] = _mm512_dpbf16_ps(acc[g][2 * j], pp, (__m512bh)lo[j]);
                acc[g][2 * j + 1] = _mm512_dpbf16_ps(acc[g][2 * j + 1], pp, (__m512bh)hi[j]);
            }
        }
    }
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));
    for (int g = 0; g < 8 / NC && g < gn; ++g)
        for (int j = 0; j < NC; ++j) {
            const __m512 a = acc[g][2 * j], b = acc[g][2 * j + 1], sc = _mm512_set1_ps(inv[g]);
            uint16_t *o = out + g * D + c + 32 * j;
            const __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(a, i0, b), sc);
            const __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(a, i1, b), sc);
            _mm256_mask_storeu_epi16(o, (__mmask16)m[j], (__m256i)_mm512_cvtneps_pbh(lo));
            _mm256_mask_storeu_epi16(o + 16, (__mmask16)(m[j] >> 16),
                                     (__m256i)_mm512_cvtneps_pbh(hi));
        }
}

/* One (sequence, KV head): q, out [G, D]; k, v this KV head's slot 0. Scratch: s, p [G, stride],
 * off [stride]. Up to 4 heads take 64 columns per pass over V, more take 32 (8 heads a pass). */
INLINE void item(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table,
                 int64_t len, uint16_t *out, int G, const int D, int bs, float scale, float *s,
                 uint16_t *p, int64_t *off, int64_t stride) {
    float inv[G];
    score_pass(q, k, v, table, len, G, D, bs, s, stride, off);
    softmax(s, p, len, G, scale, stride, inv);
    if (G <= 4) {
        for (int c = 0; c < D; c += 64) pv(v, off, len, p, stride, G, D, c, 2, inv, out);
        return;
    }
    for (int g = 0; g < G; g += 8)
        for (int c = 0; c < D; c += 32)
            pv(v, off, len, p + g * stride, stride, G - g < 8 ? G - g : 8, D, c, 1, inv + g,
               out + g * D);
}

int paged_decode_dpbf16_built(void) { return 1; }

/* Returns 0, or 1 when a scratch buffer could not be allocated (out is then incomplete). */
int paged_decode_dpbf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                        const int64_t *tables, const int64_t *lens, uint16_t *out, int B, int H,
                        int KVH, int D, int64_t slots, int max_blocks, int bs, float scale,
                        int64_t max_len, int threads) {
    const int G = H / KVH;
    const int64_t stride = ((max_len > 0 ? max_len : 1) + 31) & ~(int64_t)31;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *s = aligned_alloc(64, sizeof(float) * (size_t)G * (size_t)stride);
        uint16_t *p = aligned_alloc(64, sizeof(uint16_t) * (size_t)G * (size_t)stride);
        int64_t *off = aligned_alloc(64, sizeof(int64_t) * (size_t)stride);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < (int64_t)B * KVH; ++it) {
            if (s == NULL || p == NULL || off == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t b = it / KVH, h = it % KVH, r = (b * H + h * G) * D;
            const uint16_t *k = kc + h * slots * D, *v = vc + h * slots * D;
            const int64_t *tb = tables + b * max_blocks, n = lens[b];
            /* chosen inside the loop: GCC outlines the parallel region before inlining */
            const uint16_t *qr = q + r;
            uint16_t *o = out + r;
            if (D == 64) item(qr, k, v, tb, n, o, G, 64, bs, scale, s, p, off, stride);
            else if (D == 128) item(qr, k, v, tb, n, o, G, 128, bs, scale, s, p, off, stride);
            else item(qr, k, v, tb, n, o, G, D, bs, scale, s, p, off, stride);
        }
        free(s), free(p), free(off);
    }
    return failed;
}

#else /* no AVX512-BF16 on this CPU or compiler: the caller keeps paged_decode_bf16 */
int paged_decode_dpbf16_built(void) { return 0; }

int paged_decode_dpbf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                        const int64_t *tables, const int64_t *lens, uint16_t *out, int B, int H,
                        int KVH, int D, int64_t slots, int max_blocks, int bs, float scale,
                        int64_t max_len, int threads) {
    (void)q, (void)kc, (void)vc, (void)tables, (void)lens, (void)out, (void)B, (void)H, (void)KVH;
    (void)D, (void)slots, (void)max_blocks, (void)bs, (void)scale, (void)max_len, (void)threads;
    return 1;
}
#endif

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
 * An fp8 cache (e4m3fn or e5m2 bytes) or an int8 one (rows with a scale) takes
 * `paged_decode_dpbf16_e4m3/_e5m2/_i8`: the same items over tiles widened to bf16 on the way.
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

/* The item's first AHEAD blocks of K, prefetched before its tiles are scored. */
INLINE void prefetch_start(const uint16_t *k, const int64_t *table, int64_t len, const int D,
                           int bs) {
    for (int64_t j = 0; j < AHEAD && j * bs < len; ++j)
        prefetch(k + table[j] * bs * D, (len - j * bs < bs ? len - j * bs : bs) * D * 2);
}

/* One tile of n <= 16 rows at offset o of block j (which starts at token `start`): the cache
 * offsets of its rows into off, K AHEAD blocks on and this tile's V prefetched; returns the cache
 * offset of its first row. Blocks are scattered and the hardware prefetchers stop at page
 * boundaries, so K is prefetched ahead, and each V tile while its K tile is scored (the P V pass
 * then finds it in L2). */
INLINE int64_t tile_rows(const uint16_t *k, const uint16_t *v, const int64_t *table, int64_t len,
                         const int D, int bs, int64_t start, int64_t j, int64_t o, int64_t n,
                         int64_t *off) {
    const int64_t base = table[j] * bs * D + o * D;
    if (start + AHEAD * bs < len) prefetch(k + table[j + AHEAD] * bs * D + o * D, n * D * 2);
    prefetch(v + base, n * D * 2);
    for (int64_t i = 0; i < n; ++i) off[start + o + i] = base + i * D;
    return base;
}

/* Scores of one item over its context, 16 rows of a block at a time, into s [G, stride]; the
 * cache offsets of its tokens' rows into off. */
INLINE void score_pass(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                       const int64_t *table, int64_t len, int G, const int D, int bs, float *s,
                       int64_t stride, int64_t *off) {
    prefetch_start(k, table, len, D, bs);
    for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
        const int64_t nb = len - start < bs ? len - start : bs;
        for (int64_t o = 0; o < nb; o += 16) {
            const int n = nb - o < 16 ? (int)(nb - o) : 16;
            const uint16_t *kt = k + tile_rows(k, v, table, len, D, bs, start, j, o, n, off);
            if (n == 16) scores16(q, kt, 16, 1, G, D, s + start + o, stride);
            else scores16(q, kt, n, 0, G, D, s + start + o, stride);
        }
    }
}

/* Softmax of the raw scores s [G, stride] (len each, times scale) into bf16 p [G, stride], zero
 * from len up to the next multiple of 16; inv[g] = 1 / the sum of the rounded p[g]. */
/* Lanes [t, t + 16) of a context of len tokens whose first `skip` are left out. */
INLINE __mmask16 lanes(int64_t t, int64_t len, int64_t skip) {
    const __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
    return skip <= t ? m : skip >= t + 16 ? 0 : m & (__mmask16)~((1u << (skip - t)) - 1);
}

/* P = exp(scale s - max) over tokens [skip, len) rounded to bf16 (tokens before skip get P = 0
 * exactly, so they add nothing to the sum or to P V: a sliding window's tokens before its start,
 * which share the window's first block), inv = 1 / the sum of the rounded P. */
INLINE void softmax(const float *s, uint16_t *p, int64_t len, int G, float scale,
                    int64_t stride, float *inv, int64_t skip) {
    for (int g = 0; g < G; ++g) {
        const float *sg = s + g * stride;
        uint16_t *pg = p + g * stride;
        __m512 mx = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = lanes(t, len, skip);
            mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, sg + t));
        }
        const __m512 sc = _mm512_set1_ps(scale);
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale);
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = lanes(t, len, skip);
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

/* out [G, D] = P V / sum for all G heads: up to 4 heads take 64 columns per pass over V, more
 * take 32 (8 heads a pass). */
INLINE void pv_heads(const uint16_t *v, const int64_t *off, int64_t len, const uint16_t *p,
                     int64_t stride, int G, const int D, const float *inv, uint16_t *out) {
    if (G <= 4) {
        for (int c = 0; c < D; c += 64) pv(v, off, len, p, stride, G, D, c, 2, inv, out);
        return;
    }
    for (int g = 0; g < G; g += 8)
        for (int c = 0; c < D; c += 32)
            pv(v, off, len, p + g * stride, stride, G - g < 8 ? G - g : 8, D, c, 1, inv + g,
               out + g * D);
}

/* One (sequence, KV head): q, out [G, D]; k, v this KV head's slot 0. Scratch: s, p [G, stride],
 * off [stride]. Up to 4 heads take 64 columns per pass over V, more take 32 (8 heads a pass). */
INLINE void item(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table,
                 int64_t len, uint16_t *out, int G, const int D, int bs, float scale, float *s,
                 uint16_t *p, int64_t *off, int64_t stride, int64_t skip) {
    float inv[G];
    score_pass(q, k, v, table, len, G, D, bs, s, stride, off);
    softmax(s, p, len, G, scale, stride, inv, skip);
    pv_heads(v, off, len, p, stride, G, D, inv, out);
}

/* fp8 caches (--kv-cache-dtype fp8: e4m3fn, or e5m2), read as bytes and widened tile by tile
 * into bf16 (exact: 3 or 2 mantissa bits fit bf16's 7; e4m3 times 2^-8) in L1/L2 scratch, never a widened copy
 * of the cache: K 16 rows at a time into kt [16, D], V into vb [len, D] while its K tile is
 * scored, then the bf16 items' softmax and P V over vb. The cache traffic is half of bf16's. */

/* 16 fp8 bytes as float16 bits (16-bit lanes). e5m2 is the top byte of a float16. e4m3,
 * sign-extended to 16 bits and shifted left by 7, has its sign at bit 15 and a copy at bit 14
 * (cleared), its 4 exponent bits at 10-13 and 3 mantissa bits at 7-9: a float16 worth exactly the
 * value times 2^-8, subnormals included; the caller folds the 256 into its scales. */
INLINE __m256i fp8_half16(__m128i b, const int e5m2) {
    if (e5m2) return _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
    const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
    return _mm256_and_si256(x, _mm256_set1_epi16((short)0xBFFF));
}

/* count (a multiple of 16) fp8 values from src into bf16 dst, exactly (e4m3: times 2^-8). */
INLINE void fp8_rows(const uint8_t *src, int64_t count, const int e5m2, uint16_t *dst) {
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        const __m512 lo = _mm512_cvtph_ps(fp8_half16(_mm_loadu_si128((const __m128i *)(src + i)),
                                                     e5m2));
        const __m512 hi = _mm512_cvtph_ps(
            fp8_half16(_mm_loadu_si128((const __m128i *)(src + i + 16)), e5m2));
        _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    if (i < count) {
        const __m512 f = _mm512_cvtph_ps(fp8_half16(_mm_loadu_si128((const __m128i *)(src + i)),
                                                    e5m2));
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(f));
    }
}

INLINE void prefetch8(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}

/* n int8 rows of D values and a float32 scale each (row stride R = D + 4 bytes) into bf16 dst
 * [n, D]: each value times its row's scale in float32, rounded once (as kv_dtype.widen). */
INLINE void i8_rows(const int8_t *src, int n, const int D, uint16_t *dst) {
    for (int r = 0; r < n; ++r) {
        const int8_t *row = src + (int64_t)r * (D + 4);
        float sc;
        memcpy(&sc, row + D, 4);
        const __m512 scv = _mm512_set1_ps(sc);
        for (int c = 0; c < D; c += 16) {
            const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c)));
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(x), scv);
            _mm256_storeu_si256((__m256i *)(dst + (int64_t)r * D + c),
                                (__m256i)_mm512_cvtneps_pbh(f));
        }
    }
}

/* fmt: the cache's bytes: 0 e4m3fn, 1 e5m2, 2 int8 rows with their scales, 3 bf16 (no widening). */
enum { FMT_E4M3 = 0, FMT_E5M2 = 1, FMT_I8 = 2, FMT_BF16 = 3 };

/* n rows at src (row stride R bytes) widened into bf16 dst [n, D]. */
INLINE void widen_rows(const uint8_t *src, int n, const int D, const int fmt, uint16_t *dst) {
    if (fmt == FMT_I8) i8_rows((const int8_t *)src, n, D, dst);
    else fp8_rows(src, (int64_t)n * D, fmt == FMT_E5M2, dst);
}

/* Scores of one item over a quantized cache (as score_pass), V widened into vb [len, D] on the
 * way, off[t] = t * D into vb. */
INLINE void score_pass_fp8(const uint16_t *q, const uint8_t *k, const uint8_t *v,
                           const int64_t *table, int64_t len, int G, const int D, int bs,
                           float *s, int64_t stride, int64_t *off, uint16_t *kt, uint16_t *vb,
                           const int fmt) {
    const int64_t R = D + (fmt == FMT_I8 ? 4 : 0); /* bytes per cached row */
    for (int64_t j = 0; j < AHEAD && j * bs < len; ++j)
        prefetch8(k + table[j] * bs * R, (len - j * bs < bs ? len - j * bs : bs) * R);
    for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
        const int64_t nb = len - start < bs ? len - start : bs;
        if (start + AHEAD * bs < len) prefetch8(k + table[j + AHEAD] * bs * R, bs * R);
        prefetch8(v + table[j] * bs * R, nb * R);
        for (int64_t o = 0; o < nb; o += 16) {
            const int n = nb - o < 16 ? (int)(nb - o) : 16;
            const int64_t base = table[j] * bs * R + o * R, t0 = start + o;
            widen_rows(k + base, n, D, fmt, kt);
            widen_rows(v + base, n, D, fmt, vb + t0 * D);
            for (int i = 0; i < n; ++i) off[t0 + i] = (t0 + i) * D;
            if (n == 16) scores16(q, kt, 16, 1, G, D, s + t0, stride);
            else scores16(q, kt, n, 0, G, D, s + t0, stride);
        }
    }
}

/* item's contract over a quantized cache; kt [16, D] and vb [stride, D] bf16 scratch. */
INLINE void item_fp8(const uint16_t *q, const uint8_t *k, const uint8_t *v, const int64_t *table,
                     int64_t len, uint16_t *out, int G, const int D, int bs, float scale, float *s,
                     uint16_t *p, int64_t *off, int64_t stride, uint16_t *kt, uint16_t *vb,
                     const int fmt) {
    float inv[G];
    score_pass_fp8(q, k, v, table, len, G, D, bs, s, stride, off, kt, vb, fmt);
    /* e4m3 tiles hold K and V times 2^-8: scale and 1 / sum take the 256 (powers of two: the
     * results equal the bf16 items' over the widened cache, bit for bit) */
    const int e4m3 = fmt == FMT_E4M3;
    softmax(s, p, len, G, e4m3 ? scale * 256.f : scale, stride, inv, 0);
    if (e4m3)
        for (int g = 0; g < G; ++g) inv[g] *= 256.f;
    pv_heads(vb, off, len, p, stride, G, D, inv, out);
}

/* paged_decode_dpbf16's contract over a bf16 cache (fmt FMT_BF16) or a quantized one (bytes). */
static int decode_items(const uint16_t *q, const uint8_t *kc, const uint8_t *vc,
                        const int64_t *tables, const int64_t *lens, uint16_t *out, int B, int H,
                        int KVH, int D, int64_t slots, int max_blocks, int bs, float scale,
                        int64_t max_len, int threads, const int fmt, const int64_t *skips) {
    const int G = H / KVH, quant = fmt != FMT_BF16;
    const int64_t stride = ((max_len > 0 ? max_len : 1) + 31) & ~(int64_t)31;
    const int64_t R = fmt == FMT_BF16 ? 2 * D : D + (fmt == FMT_I8 ? 4 : 0); /* row bytes */
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *s = aligned_alloc(64, sizeof(float) * (size_t)G * (size_t)stride);
        uint16_t *p = aligned_alloc(64, sizeof(uint16_t) * (size_t)G * (size_t)stride);
        int64_t *off = aligned_alloc(64, sizeof(int64_t) * (size_t)stride);
        /* a quantized cache's K tile and V rows widened to bf16 */
        uint16_t *kt = quant ? aligned_alloc(64, sizeof(uint16_t) * 16 * (size_t)D) : NULL;
        uint16_t *vb = quant ? aligned_alloc(64, sizeof(uint16_t) * (size_t)stride * (size_t)D)
                             : NULL;
        const int ok = s && p && off && (!quant || (kt && vb));
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < (int64_t)B * KVH; ++it) {
            if (!ok) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t b = it / KVH, h = it % KVH, r = (b * H + h * G) * D;
            const uint8_t *k = kc + h * slots * R, *v = vc + h * slots * R;
            const int64_t *tb = tables + b * max_blocks, n = lens[b], skip = skips ? skips[b] : 0;
            const uint16_t *qr = q + r, *kh = (const uint16_t *)k, *vh = (const uint16_t *)v;
            uint16_t *o = out + r;
            /* chosen inside the loop: GCC outlines the parallel region before inlining */
#define ITEM(F, DD)                                                                              \
    (F) == FMT_BF16 ? item(qr, kh, vh, tb, n, o, G, DD, bs, scale, s, p, off, stride, skip)      \
                    : item_fp8(qr, k, v, tb, n, o, G, DD, bs, scale, s, p, off, stride, kt, vb, F)
#define ITEMS(F)                                                                                 \
    if (fmt == F && D == 64) ITEM(F, 64);                                                        \
    else if (fmt == F && D == 128) ITEM(F, 128);                                                 \
    else if (fmt == F) ITEM(F, D)
            ITEMS(FMT_BF16);
            ITEMS(FMT_E4M3);
            ITEMS(FMT_E5M2);
            ITEMS(FMT_I8);
#undef ITEMS
#undef ITEM
        }
        free(s), free(p), free(off), free(kt), free(vb);
    }
    return failed;
}

/* The exported entry of one format: paged_decode_dpbf16's signature over a quantized cache. */
#define QUANT_DECODE(name, fmt)                                                                  \
    int name(const uint16_t *q, const uint8_t *kc, const uint8_t *vc, const int64_t *tables,   \
             const int64_t *lens, uint16_t *out, int B, int H, int KVH, int D, int64_t slots,   \
             int max_blocks, int bs, float scale, int64_t max_len, int threads) {               \
        return decode_items(q, kc, vc, tables, lens, out, B, H, KVH, D, slots, max_blocks, bs, \
                          scale, max_len, threads, fmt, NULL);                                 \
    }
QUANT_DECODE(paged_decode_dpbf16_e4m3, FMT_E4M3)
QUANT_DECODE(paged_decode_dpbf16_e5m2, FMT_E5M2)
QUANT_DECODE(paged_decode_dpbf16_i8, FMT_I8)

int paged_decode_dpbf16_built(void) { return 1; }

/* Returns 0, or 1 when a scratch buffer could not be allocated (out is then incomplete). */
int paged_decode_dpbf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                        const int64_t *tables, const int64_t *lens, uint16_t *out, int B, int H,
                        int KVH, int D, int64_t slots, int max_blocks, int bs, float scale,
                        int64_t max_len, int threads) {
    return decode_items(q, (const uint8_t *)kc, (const uint8_t *)vc, tables, lens, out, B, H, KVH,
                        D, slots, max_blocks, bs, scale, max_len, threads, FMT_BF16, NULL);
}

/* paged_decode_dpbf16 with skips [B]: row b attends to tokens [skips[b], lens[b]) of its table,
 * so a sliding window is served in place (its table starting at the window's first block, the
 * tokens before the window in that block skipped) rather than gathered into a scratch cache. */
int paged_decode_dpbf16_skip(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                             const int64_t *tables, const int64_t *lens, uint16_t *out, int B,
                             int H, int KVH, int D, int64_t slots, int max_blocks, int bs,
                             float scale, int64_t max_len, int threads, const int64_t *skips) {
    return decode_items(q, (const uint8_t *)kc, (const uint8_t *)vc, tables, lens, out, B, H, KVH,
                        D, slots, max_blocks, bs, scale, max_len, threads, FMT_BF16, skips);
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The same contract on AMX tiles (`paged_decode_amx`), for blocks of a multiple of 16 tokens,
 * D % 32 == 0 up to 128 and at most 16 query heads per KV head; where these fail the call takes
 * the `vdpbf16ps` items above. Per item:
 *   scores  S^T [16 tokens, 16 heads] = K_tile [16 tokens, 32 D] x Q^T (B tiles built once per
 *           item: pairs of D per head column, heads past G zero), K tiles loaded straight from the
 *           cache (16 rows of a block at stride D); S^T stored token-major, then gathered per head;
 *   softmax as above (the same function), P rounded to bf16;
 *   P V     O [16 heads, 16 columns] += P [16 heads, 32 tokens] x V (B tiles: pairs of tokens per
 *           column, interleaved from 32 cache rows by `vpunpck*wd`, rows past the context zero),
 *           up to 64 columns per pass; out = O / sum, its columns put back in order.
 * Each token's score and each output element sums the same terms in an order fixed by D and the
 * context length alone (tile products accumulate in a fixed order), whatever the batch, block
 * table or threads. */
#include "cpu_amx.h"

int paged_decode_amx_available(void) { return amx_request(); }

/* Tiles (configure_tiles). Scores: 0 S^T, 1 K, 2-5 Q^T. P V: 1 P, 0/2/3 V, 4-7 O. */

typedef struct {
    float *st, *s, *o;  /* S^T [stride][16], S [G][stride], O [16][64] */
    uint16_t *p, *qb, *vb; /* P [16][stride], Q^T tiles [D / 32][512], V tiles [4][512] */
    int64_t *off;          /* [stride] */
} amx_scratch;

/* q [G, D] as B tiles: tile c row r, element 2n + e = q[n][32 c + 2 r + e] (0 for n >= G). */
INLINE void q_tiles(const uint16_t *q, int G, int D, uint16_t *qb) {
    memset(qb, 0, (size_t)(D / 32) * 1024);
    for (int c = 0; c < D / 32; ++c)
        for (int r = 0; r < 16; ++r)
            for (int n = 0; n < G; ++n) {
                memcpy(qb + c * 512 + r * 32 + 2 * n, q + n * D + 32 * c + 2 * r, 4);
            }
}

/* Raw scores into S [G, stride] and the cache offsets of the tokens' rows into off. */
INLINE void amx_scores(const uint16_t *k, const uint16_t *v, const int64_t *table, int64_t len,
                       int G, int D, int bs, int64_t stride, const amx_scratch *w) {
    _tile_loadd(2, w->qb, 64); /* tile numbers must be constants */
    if (D >= 64) _tile_loadd(3, w->qb + 512, 64);
    if (D >= 96) _tile_loadd(4, w->qb + 1024, 64);
    if (D >= 128) _tile_loadd(5, w->qb + 1536, 64);
    prefetch_start(k, table, len, D, bs);
    for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
        const int64_t nb = len - start < bs ? len - start : bs;
        for (int64_t o = 0; o < nb; o += 16) {
            const int64_t n = nb - o < 16 ? nb - o : 16;
            const uint16_t *kt = k + tile_rows(k, v, table, len, D, bs, start, j, o, n, w->off);
            /* rows past the context are the block's own (stale) rows: their scores are unused */
            _tile_zero(0);
            for (int c = 0; c < D / 32; ++c) {
                _tile_loadd(1, kt + 32 * c, D * 2);
                switch (c) { /* tile numbers must be constants */
                case 0: _tile_dpbf16ps(0, 1, 2); break;
                case 1: _tile_dpbf16ps(0, 1, 3); break;
                case 2: _tile_dpbf16ps(0, 1, 4); break;
                default: _tile_dpbf16ps(0, 1, 5); break;
                }
            }
            _tile_stored(0, w->st + (start + o) * 16, 64);
        }
    }
    const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                               12, 13, 14, 15),
                                             _mm512_set1_epi32(16));
    for (int g = 0; g < G; ++g)
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
            const __m512 x = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, lanes,
                                                      w->st + t * 16 + g, 4);
            _mm512_mask_storeu_ps(w->s + g * stride + t, m, x);
        }
}

/* Interleave the 32 rows t0 .. t0 + 31 (zero past len), columns c0 .. c0 + 32 nc, into V tiles
 * 2 j and 2 j + 1 per 32 columns: row r holds the pairs (V[t0 + 2 r][c], V[t0 + 2 r + 1][c]) for
 * the columns c0 + 32 j + {0-3, 8-11, 16-19, 24-27} and {4-7, 12-15, 20-23, 28-31} (vpunpck*wd's
 * order, one uop each; `amx_pv` puts the output columns back in order). */
INLINE void v_tiles(const uint16_t *v, const int64_t *off, int64_t t0, int64_t len, int c0,
                    int nc, uint16_t *vb) {
    for (int r = 0; r < 16; ++r) {
        const int64_t ta = t0 + 2 * r, tb = ta + 1;
        for (int j = 0; j < nc; ++j) {
            const __m512i a = ta < len ? _mm512_loadu_si512(v + off[ta] + c0 + 32 * j)
                                       : _mm512_setzero_si512();
            const __m512i b = tb < len ? _mm512_loadu_si512(v + off[tb] + c0 + 32 * j)
                                       : _mm512_setzero_si512();
            _mm512_store_si512(vb + (2 * j) * 512 + r * 32, _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(vb + (2 * j + 1) * 512 + r * 32, _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* out [G, D] = P V / sum, P [16, stride] (rows past G unused), 64 columns (4 tiles) a pass. */
INLINE void amx_pv(const uint16_t *v, int64_t len, int G, int D, int64_t stride,
                   const float *inv, uint16_t *out, const amx_scratch *w) {
    for (int c0 = 0; c0 < D; c0 += 64) {
        const int nc = D - c0 >= 64 ? 2 : 1; /* 32-column halves in this pass */
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t t0 = 0; t0 < len; t0 += 32) {
            v_tiles(v, w->off, t0, len, c0, nc, w->vb);
            _tile_loadd(1, w->p + t0, stride * 2);
            _tile_loadd(0, w->vb, 64);
            _tile_loadd(2, w->vb + 512, 64);
            _tile_dpbf16ps(4, 1, 0);
            _tile_dpbf16ps(5, 1, 2);
            if (nc == 2) {
                _tile_loadd(3, w->vb + 1024, 64);
                _tile_loadd(0, w->vb + 1536, 64);
                _tile_dpbf16ps(6, 1, 3);
                _tile_dpbf16ps(7, 1, 0);
            }
        }
        _tile_stored(4, w->o, 256);
        _tile_stored(5, w->o + 16, 256);
        _tile_stored(6, w->o + 32, 256);
        _tile_stored(7, w->o + 48, 256);
        const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22,
                                             23);
        const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));
        for (int g = 0; g < G; ++g) {
            const __m512 sc = _mm512_set1_ps(inv[g]);
            for (int j = 0; j < nc; ++j) { /* tiles 2 j, 2 j + 1: v_tiles' column order */
                const __m512 a = _mm512_load_ps(w->o + g * 64 + 32 * j);
                const __m512 b = _mm512_load_ps(w->o + g * 64 + 32 * j + 16);
                const __m512 lo = _mm512_mul_ps(_mm512_permutex2var_ps(a, i0, b), sc);
                const __m512 hi = _mm512_mul_ps(_mm512_permutex2var_ps(a, i1, b), sc);
                uint16_t *o = out + g * D + c0 + 32 * j;
                _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(lo));
                _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(hi));
            }
        }
    }
}

INLINE void amx_item(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                     const int64_t *table, int64_t len, uint16_t *out, int G, int D, int bs,
                     float scale, int64_t stride, const amx_scratch *w) {
    float inv[16];
    q_tiles(q, G, D, w->qb);
    amx_scores(k, v, table, len, G, D, bs, stride, w);
    softmax(w->s, w->p, len, G, scale, stride, inv, 0);
    const int64_t l16 = (len + 15) & ~(int64_t)15;
    if (l16 & 31) /* P tiles read 32 tokens: zero the last 16 (softmax zeroed up to l16) */
        for (int g = 0; g < G; ++g) memset(w->p + g * stride + l16, 0, 32);
    amx_pv(v, len, G, D, stride, inv, out, w);
}

/* The AMX kernel applies: else the vdpbf16ps items serve the call. */
static int amx_fits(int G, int D, int bs) {
    return G <= 16 && D % 32 == 0 && D <= 128 && bs % 16 == 0;
}

/* paged_decode_dpbf16's contract and return. Call only where paged_decode_amx_available(). */
int paged_decode_amx(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                     const int64_t *tables, const int64_t *lens, uint16_t *out, int B, int H,
                     int KVH, int D, int64_t slots, int max_blocks, int bs, float scale,
                     int64_t max_len, int threads) {
    const int G = H / KVH;
    if (!amx_fits(G, D, bs))
        return paged_decode_dpbf16(q, kc, vc, tables, lens, out, B, H, KVH, D, slots, max_blocks,
                                   bs, scale, max_len, threads);
    const int64_t stride = ((max_len > 0 ? max_len : 1) + 31) & ~(int64_t)31;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        amx_scratch w;
        w.st = aligned_alloc(64, sizeof(float) * 16 * (size_t)stride);
        w.s = aligned_alloc(64, sizeof(float) * (size_t)G * (size_t)stride);
        w.o = aligned_alloc(64, sizeof(float) * 16 * 64);
        w.p = aligned_alloc(64, sizeof(uint16_t) * 16 * (size_t)stride);
        w.qb = aligned_alloc(64, 4 * 1024);
        w.vb = aligned_alloc(64, 4 * 1024);
        w.off = aligned_alloc(64, sizeof(int64_t) * (size_t)stride);
        const int ok = w.st && w.s && w.o && w.p && w.qb && w.vb && w.off;
        if (ok) {
            memset(w.p, 0, sizeof(uint16_t) * 16 * (size_t)stride); /* rows past G: finite */
            configure_tiles();
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < (int64_t)B * KVH; ++it) {
            if (!ok) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t b = it / KVH, h = it % KVH, r = (b * H + h * G) * D;
            amx_item(q + r, kc + h * slots * D, vc + h * slots * D, tables + b * max_blocks,
                     lens[b], out + r, G, D, bs, scale, stride, &w);
        }
        if (ok) _tile_release();
        free(w.st), free(w.s), free(w.o), free(w.p), free(w.qb), free(w.vb), free(w.off);
    }
    return failed;
}
#define HAVE_DECODE_AMX 1
#endif /* AMX */

#else /* no AVX512-BF16 on this CPU or compiler: the caller keeps paged_decode_bf16 */
int paged_decode_dpbf16_built(void) { return 0; }

/* Stubs: never called where paged_decode_dpbf16_built() is 0; every name the library declares
 * must exist, or the whole library fails to load (tests/test_cpu_native.py builds it so). */
int paged_decode_dpbf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                        const int64_t *tables, const int64_t *lens, uint16_t *out, int B, int H,
                        int KVH, int D, int64_t slots, int max_blocks, int bs, float scale,
                        int64_t max_len, int threads) {
    (void)q, (void)kc, (void)vc, (void)tables, (void)lens, (void)out, (void)B, (void)H, (void)KVH;
    (void)D, (void)slots, (void)max_blocks, (void)bs, (void)scale, (void)max_len, (void)threads;
    return 1; /* "failed": out untouched */
}
#define QUANT_STUB(name)                                                                         \
    int name(const uint16_t *q, const uint8_t *kc, const uint8_t *vc, const int64_t *tables,   \
             const int64_t *lens, uint16_t *out, int B, int H, int KVH, int D, int64_t slots,   \
             int max_blocks, int bs, float scale, int64_t max_len, int threads) {               \
        return paged_decode_dpbf16((const uint16_t *)q, (const uint16_t *)kc,                  \
                                   (const uint16_t *)vc, tables, lens, out, B, H, KVH, D,      \
                                   slots, max_blocks, bs, scale, max_len, threads);            \
    }
QUANT_STUB(paged_decode_dpbf16_e4m3)
QUANT_STUB(paged_decode_dpbf16_e5m2)
QUANT_STUB(paged_decode_dpbf16_i8)
int paged_decode_dpbf16_skip(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                             const int64_t *tables, const int64_t *lens, uint16_t *out, int B,
                             int H, int KVH, int D, int64_t slots, int max_blocks, int bs,
                             float scale, int64_t max_len, int threads, const int64_t *skips) {
    (void)skips;
    return paged_decode_dpbf16(q, kc, vc, tables, lens, out, B, H, KVH, D, slots, max_blocks, bs,
                               scale, max_len, threads);
}
#endif

#ifndef HAVE_DECODE_AMX /* no AMX-BF16 here: the vdpbf16ps items (or their stub) serve */
int paged_decode_amx_available(void) { return 0; }
int paged_decode_amx(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                     const int64_t *tables, const int64_t *lens, uint16_t *out, int B, int H,
                     int KVH, int D, int64_t slots, int max_blocks, int bs, float scale,
                     int64_t max_len, int threads) {
    return paged_decode_dpbf16(q, kc, vc, tables, lens, out, B, H, KVH, D, slots, max_blocks, bs,
                               scale, max_len, threads);
}
#endif

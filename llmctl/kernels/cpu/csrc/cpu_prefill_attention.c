/* Causal prefill attention in bfloat16: one multi-token chunk of one sequence, after `nc` cached
 * positions, GQA, on AMX tiles or on AVX512-BF16 `vdpbf16ps`. Compiled on first use by
 * llmctl/kernels/cpu_prefill.py with -march=native: on a CPU without AVX512-BF16 (or a compiler
 * without its intrinsics) only the `prefill_*_available` probes exist and return 0, and the caller
 * keeps PyTorch's SDPA.
 *
 * Layouts (element strides; bfloat16 passed as its uint16 bits):
 *   q, out   [Tq, H, D]   token stride qt / ot, head stride qh / oh
 *   k, v     [L, KVH, D]  token stride kt, head stride kh (L = nc + Tq keys)
 * Query i sits at position nc + i and attends keys 0 .. nc + i; with a sliding window w > 0 only
 * keys nc + i - w + 1 .. nc + i (the others get P = 0 exactly; the caller passes keys from the
 * first one any query of the chunk sees). D must be a multiple of 64.
 *
 * Why: PyTorch's CPU flash kernel ran at a fraction of the matmul peak on the engine's prefill
 * shapes (one call per sequence and layer, head_dim 64). Here K and V are packed once per call
 * into VNNI pairs (AMX's tile layout, which is also `vdpbf16ps`'s: 16 columns x 2 consecutive K
 * elements per 64 bytes) and shared by the G = H / KVH query heads of each KV head; a work item is
 * (query head, 16 query rows): S = Q K^T into a float row buffer [16, keys], an exact softmax per
 * row in float32 (scale, max, exp, sum), P rounded to bfloat16 as SDPA's bf16 path does,
 * O = P V, divided by the row sum in float32, rounded once. The two products run on AMX tiles
 * where the CPU has them (mode 1), else on zmm registers with `vdpbf16ps` (mode 0).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <math.h>

#include "cpu_exp512.h"

int prefill_dpbf16_available(void) { return 1; }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1

#include "cpu_amx.h"

int prefill_amx_available(void) { return amx_request(); }

/* Tiles (configure_tiles): 0, 1: S (16 x 16 floats); 2: A (Q or P); 3: B (K or V); 4-7: O
 * (16 x 16 floats each, 64 columns of D); the phases reuse free tiles as extra B. */

#else
int prefill_amx_available(void) { return 0; }
#endif /* AMX */

static inline uint16_t to_bf16(float f) { /* round to nearest even (values are finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Rows r[0..15] of 16 dwords each, transposed in place: r[i] lane j <- r[j] lane i. */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane l of r[i] now holds rows 4 (i / 4) .. + 3, columns 4 l + (i % 4 order) */
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* K of one KV head as tiles [L32 / 16][D / 32][16][32]: tile (j, c) row r, element 2n + p is
 * K[16 j + n][32 c + 2 r + p] (TDPBF16PS's B for S = Q K^T): a 16 x 16 transpose of the keys'
 * 32-bit pairs; keys past L are zero. */
static void pack_k(const uint16_t *k, int64_t kt, int64_t L, int D, int64_t j, uint16_t *dst) {
    for (int c = 0; c < D / 32; ++c, dst += 512) {
        __m512i r[16];
        for (int n = 0; n < 16; ++n) {
            const int64_t t = 16 * j + n;
            r[n] = t < L ? _mm512_loadu_si512(k + t * kt + 32 * c) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_si512(dst + 32 * i, r[i]);
    }
}

/* V of one KV head as tiles [L32 / 32][D / 16][16][32]: tile (j, c) row r, element 2n + p is
 * V[32 j + 2 r + p][16 c + n] (B for O = P V): pairs of rows interleaved; keys past L are zero,
 * so padded P entries (zero) never meet garbage. */
static void pack_v(const uint16_t *v, int64_t kt, int64_t L, int D, int64_t j, uint16_t *dst) {
    for (int c = 0; c < D / 16; ++c, dst += 512)
        for (int r = 0; r < 16; ++r) {
            const int64_t t = 32 * j + 2 * r;
            const __m512i a = t < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                          (const __m256i *)(v + t * kt + 16 * c)))
                                    : _mm512_setzero_si512();
            const __m512i b = t + 1 < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                              (const __m256i *)(v + (t + 1) * kt + 16 * c)))
                                        : _mm512_setzero_si512();
            _mm512_store_si512(dst + 32 * r, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
}

/* Lanes [t, t + 16) of keys [lo, n). */
static inline __mmask16 key_lanes(int64_t t, int64_t n, int64_t lo) {
    const __mmask16 k = n - t >= 16 ? 0xffff : n > t ? (__mmask16)((1u << (n - t)) - 1) : 0;
    return lo <= t ? k : lo >= t + 16 ? 0 : k & (__mmask16)~((1u << (lo - t)) - 1);
}

/* Softmax of the 16 score rows s [16, stride] into p (bf16 [16, pstride], unnormalised, zero up to
 * 32 nkb); row m may see keys 0 .. first + m, or with window > 0 the last `window` of them (rows
 * at or past `rows` see none). Row sums into sum[16]. */
static void softmax_rows(const float *s, uint16_t *p, int64_t stride, int64_t pstride,
                         int64_t nkb, int64_t first, int rows, float scale, float *sum,
                         int64_t window) {
    for (int m = 0; m < 16; ++m) {
        const float *sm = s + m * stride;
        uint16_t *pm = p + m * pstride;
        const int64_t n = m < rows ? first + m + 1 : 0;
        const int64_t lo = window > 0 && n > window ? n - window : 0;
        __m512 mx = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int64_t t = lo & ~(int64_t)15; t < n; t += 16) {
            const __mmask16 k = key_lanes(t, n, lo);
            mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, sm + t));
        }
        /* scores to log2 units in one step: y = (s - max) scale log2(e) */
        const float l2 = scale * 1.44269504f;
        const __m512 sc = _mm512_set1_ps(l2);
        const __m512 off = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * l2);
        const int64_t full = n & ~(int64_t)15, clear = lo & ~(int64_t)15;
        memset(pm, 0, (size_t)clear * 2); /* whole tiles before the window */
        for (int64_t t = clear; t < full && t < lo; t += 16) { /* the tile holding lo */
            const __mmask16 k = key_lanes(t, n, lo);
            const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, sm + t), sc, off);
            const __m512 e = _mm512_maskz_mov_ps(k, exp2_neg(x));
            total = _mm512_add_ps(total, e);
            _mm256_storeu_si256((__m256i *)(pm + t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        for (int64_t t = lo > clear ? clear + 16 : clear; t < full; t += 16) {
            const __m512 e = exp2_neg(_mm512_fmsub_ps(_mm512_loadu_ps(sm + t), sc, off));
            total = _mm512_add_ps(total, e);
            _mm256_storeu_si256((__m256i *)(pm + t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        for (int64_t t = full; t < 32 * nkb; t += 16) { /* the tail, then zeros up to 32 nkb */
            const __mmask16 k = key_lanes(t, n, lo);
            const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, sm + t), sc, off);
            const __m512 e = _mm512_maskz_mov_ps(k, exp2_neg(x));
            total = _mm512_add_ps(total, e);
            _mm256_storeu_si256((__m256i *)(pm + t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        sum[m] = _mm512_reduce_add_ps(total);
    }
}

typedef struct {
    const uint16_t *q, *kp, *vp;
    uint16_t *out;
    int64_t qt, qh, ot, oh, tq, nc, nk32, window;
    int H, G, D;
    float scale;
} job;

#ifdef HAVE_AMX
/* One work item: query head hq, query rows i0 .. i0 + 15. Scratch: s [16, 32 nk32] floats,
 * p [16, 32 nk32] bf16, o [16, 64] floats, qpad [16, D] bf16, all 64-byte aligned. */
static void item(const job *J, int hq, int64_t i0, float *s, uint16_t *p, float *o,
                 uint16_t *qpad) {
    const int D = J->D, rows = J->tq - i0 < 16 ? (int)(J->tq - i0) : 16;
    const int64_t h = hq / J->G, last = J->nc + i0 + rows;  /* keys the block's last row sees */
    const int64_t nkb = (last + 31) / 32, stride = 32 * J->nk32 + 16, pstride = 32 * nkb + 32;
    const uint16_t *qa = J->q + i0 * J->qt + hq * J->qh;
    int64_t qstride = J->qt * 2;
    if (rows < 16) { /* tile loads read 16 rows: copy the tail into zero-padded scratch */
        memset(qpad, 0, (size_t)16 * D * 2);
        for (int m = 0; m < rows; ++m) memcpy(qpad + m * D, qa + m * J->qt, (size_t)D * 2);
        qa = qpad, qstride = (int64_t)D * 2;
    }
    const uint16_t *kp = J->kp + h * J->nk32 * 32 * D, *vp = J->vp + h * J->nk32 * 32 * D;
    for (int64_t j = 0; j < nkb; ++j) { /* S tiles 0, 1; Q tiles 2, 6; K tiles 3, 7 */
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < D / 32; ++c) {
            const uint16_t *kt = kp + ((2 * j) * (D / 32) + c) * 512;
            _tile_loadd(2, qa + 32 * c, qstride);
            _tile_loadd(3, kt, 64);
            _tile_loadd(7, kt + (D / 32) * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 7);
        }
        _tile_stored(0, s + 32 * j, stride * 4);
        _tile_stored(1, s + 32 * j + 16, stride * 4);
    }
    float sum[16];
    softmax_rows(s, p, stride, pstride, nkb, J->nc + i0, rows, J->scale, sum, J->window);
    for (int c4 = 0; c4 < D / 64; ++c4) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t j = 0; j < nkb; ++j) {
            const uint16_t *vt = vp + (j * (D / 16) + 4 * c4) * 512;
            /* three B tiles in turn: a tile load waits for the product still reading it */
            _tile_loadd(2, p + 32 * j, pstride * 2);
            _tile_loadd(0, vt, 64);
            _tile_loadd(1, vt + 512, 64);
            _tile_loadd(3, vt + 1024, 64);
            _tile_dpbf16ps(4, 2, 0);
            _tile_dpbf16ps(5, 2, 1);
            _tile_dpbf16ps(6, 2, 3);
            _tile_loadd(0, vt + 1536, 64);
            _tile_dpbf16ps(7, 2, 0);
        }
        _tile_stored(4, o, 256);
        _tile_stored(5, o + 16, 256);
        _tile_stored(6, o + 32, 256);
        _tile_stored(7, o + 48, 256);
        for (int m = 0; m < rows; ++m) {
            uint16_t *om = J->out + (i0 + m) * J->ot + hq * J->oh + 64 * c4;
            const float inv = 1.f / sum[m];
            for (int n = 0; n < 64; ++n) om[n] = to_bf16(o[m * 64 + n] * inv);
        }
    }
}

#endif /* HAVE_AMX */

/* S for MR query rows (row m at qa + m * qt) against NT 16-key tiles of packed K from tile t0
 * (tile t: [D / 2 pairs][16 keys][2] at kp + 16 D t, pack_k's layout) into s [MR, stride].
 * MR x NT zmm accumulators; each K load serves MR rows, each broadcast Q pair NT tiles. */
static inline __attribute__((always_inline)) void s_tiles(const uint16_t *qa, int64_t qt,
                                                          const uint16_t *kp, int D, int64_t t0,
                                                          const int MR, const int NT, float *s,
                                                          int64_t stride) {
    __m512 acc[4][4];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
    const uint16_t *kt = kp + t0 * 16 * D;
    for (int r = 0; r < D / 2; ++r) {
        __m512bh b[4];
        for (int n = 0; n < NT; ++n) b[n] = (__m512bh)_mm512_load_si512(kt + n * 16 * D + r * 32);
        for (int m = 0; m < MR; ++m) {
            uint32_t pair;
            memcpy(&pair, qa + m * qt + 2 * r, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], a, b[n]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NT; ++n) _mm512_storeu_ps(s + m * stride + 16 * (t0 + n), acc[m][n]);
}

/* O [MR rows, 64 columns from 64 c4] = P V over npairs key pairs, divided by the row sums and
 * rounded into out (row m at om + m * ot). P row m: bf16 at p + m * pstride; V pair j, column
 * block c (16 wide) at vp + 32 D (j / 16) + 512 c + 32 (j % 16) (pack_v's layout). */
static inline __attribute__((always_inline)) void o_rows(const uint16_t *p, int64_t pstride,
                                                         const uint16_t *vp, int D, int64_t npairs,
                                                         int c4, const int MR, const float *sum,
                                                         uint16_t *om, int64_t ot) {
    __m512 acc[4][4];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < 4; ++n) acc[m][n] = _mm512_setzero_ps();
    for (int64_t j = 0; j < npairs; ++j) {
        const uint16_t *vr = vp + (j >> 4) * 32 * D + 4 * c4 * 512 + (j & 15) * 32;
        __m512bh b[4];
        for (int n = 0; n < 4; ++n) b[n] = (__m512bh)_mm512_load_si512(vr + n * 512);
        for (int m = 0; m < MR; ++m) {
            uint32_t pair;
            memcpy(&pair, p + m * pstride + 2 * j, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int n = 0; n < 4; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], a, b[n]);
        }
    }
    for (int m = 0; m < MR; ++m) {
        const __m512 inv = _mm512_set1_ps(1.f / sum[m]);
        for (int n = 0; n < 4; ++n)
            _mm256_storeu_si256((__m256i *)(om + m * ot + 64 * c4 + 16 * n),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[m][n], inv)));
    }
}

/* The same work item as the AMX one on zmm registers: rows in groups of up to 4 (constant MR for
 * each instantiation, so the accumulators stay in registers). */
static void item_dp(const job *J, int hq, int64_t i0, float *s, uint16_t *p) {
    const int D = J->D, rows = J->tq - i0 < 16 ? (int)(J->tq - i0) : 16;
    const int64_t h = hq / J->G, last = J->nc + i0 + rows;
    const int64_t nkb = (last + 31) / 32, stride = 32 * J->nk32 + 16, pstride = 32 * nkb + 32;
    const uint16_t *qa = J->q + i0 * J->qt + hq * J->qh;
    const uint16_t *kp = J->kp + h * J->nk32 * 32 * D, *vp = J->vp + h * J->nk32 * 32 * D;
#define S_CASE(M)                                                                               \
    case M:                                                                                     \
        if (2 * nkb - t >= 4) s_tiles(qa + m0 * J->qt, J->qt, kp, D, t, M, 4, sm, stride);      \
        else s_tiles(qa + m0 * J->qt, J->qt, kp, D, t, M, 2, sm, stride);                       \
        break;
    for (int m0 = 0; m0 < rows; m0 += 4) {
        float *sm = s + m0 * stride;
        for (int64_t t = 0; t < 2 * nkb; t += 4) switch (rows - m0 < 4 ? rows - m0 : 4) {
                S_CASE(1) S_CASE(2) S_CASE(3) S_CASE(4)
            }
    }
#undef S_CASE
    float sum[16];
    softmax_rows(s, p, stride, pstride, nkb, J->nc + i0, rows, J->scale, sum, J->window);
#define O_CASE(M)                                                                               \
    case M: o_rows(p + m0 * pstride, pstride, vp, D, 16 * nkb, c4, M, sum + m0, om, J->ot); break;
    for (int c4 = 0; c4 < D / 64; ++c4)
        for (int m0 = 0; m0 < rows; m0 += 4) {
            uint16_t *om = J->out + (i0 + m0) * J->ot + hq * J->oh;
            switch (rows - m0 < 4 ? rows - m0 : 4) { O_CASE(1) O_CASE(2) O_CASE(3) O_CASE(4) }
        }
#undef O_CASE
}

/* amx: 1 for AMX tiles (where prefill_amx_available() said 1), 0 for vdpbf16ps; window: 0, or
 * the sliding window in tokens. Returns 0, 1 when scratch could not be allocated, 2 when D or the
 * mode is unsupported. */
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                           int64_t tq, int64_t nc, int H, int KVH, int D, int64_t qt, int64_t qh,
                           int64_t kt, int64_t kh, int64_t ot, int64_t oh, float scale,
                           int threads, int amx, int64_t window) {
#ifndef HAVE_AMX
    if (amx) return 2;
#endif
    if (D % 64 || H % KVH) return 2;
    const int64_t L = nc + tq, nk32 = (L + 31) / 32, nqb = (tq + 15) / 16;
    const size_t head = (size_t)nk32 * 32 * D;
    uint16_t *kp = aligned_alloc(64, head * KVH * 2), *vp = aligned_alloc(64, head * KVH * 2);
    int failed = kp == NULL || vp == NULL;
    job J = {q, kp, vp, out, qt, qh, ot, oh, tq, nc, nk32, window, H, H / KVH, D, scale};
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < (int64_t)KVH * nk32; ++it) {
                const int64_t h = it / nk32, j = it % nk32;
                pack_k(k + h * kh, kt, L, D, 2 * j, kp + h * head + 2 * j * 16 * D);
                pack_k(k + h * kh, kt, L, D, 2 * j + 1, kp + h * head + (2 * j + 1) * 16 * D);
                pack_v(v + h * kh, kt, L, D, j, vp + h * head + j * 32 * D);
            }
        }
        const size_t row = (size_t)32 * nk32 + 32; /* + padding: row strides off 4 KiB multiples */
        float *s = aligned_alloc(64, 16 * row * 4), *o = aligned_alloc(64, 16 * 64 * 4);
        uint16_t *p = aligned_alloc(64, 16 * row * 2);
        uint16_t *qpad = aligned_alloc(64, (size_t)16 * D * 2);
        if (s == NULL || o == NULL || p == NULL || qpad == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#ifdef HAVE_AMX
            if (amx) configure_tiles();
#endif
            /* heaviest first: the last query blocks see the most keys */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < (int64_t)H * nqb; ++it) {
                const int hq = (int)(it % H);
                const int64_t i0 = 16 * (nqb - 1 - it / H);
#ifdef HAVE_AMX
                if (amx) {
                    item(&J, hq, i0, s, p, o, qpad);
                    continue;
                }
#endif
                item_dp(&J, hq, i0, s, p);
            }
#ifdef HAVE_AMX
            if (amx) _tile_release();
#endif
        }
        free(s), free(o), free(p), free(qpad);
    }
    free(kp), free(vp);
    return failed;
}

#else /* no AVX512-BF16 on this CPU or compiler: the caller keeps SDPA */
int prefill_amx_available(void) { return 0; }
int prefill_dpbf16_available(void) { return 0; }

int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out,
                           int64_t tq, int64_t nc, int H, int KVH, int D, int64_t qt, int64_t qh,
                           int64_t kt, int64_t kh, int64_t ot, int64_t oh, float scale,
                           int threads, int amx, int64_t window) {
    (void)window, (void)q, (void)k, (void)v, (void)out, (void)tq, (void)nc, (void)H, (void)KVH, (void)D;
    (void)qt, (void)qh, (void)kt, (void)kh, (void)ot, (void)oh, (void)scale, (void)threads;
    (void)amx;
    return 2;
}
#endif

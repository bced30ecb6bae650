/* bfloat16 linear layers on AMX tiles: y [M, N] = x [M, K] W^T (+ bias), float32 accumulation,
 * rounded once to bfloat16 (nearest even). Compiled on first use by kernels/cpu_amx.py (through
 * cpu_native.build, -march=native); where the compiler or CPU lacks AMX-BF16 only stubs exist and
 * `linear_amx_available` returns 0. Reference: F.linear in bfloat16.
 *
 * Why: at the row counts of decode steps (8-128 rows), oneDNN's bf16 matmul reads its packed
 * weights at a fraction of the memory bandwidth (measured 7-12 GB/s of 36 on 2 cores of a Xeon
 * with AMX, weights streaming from memory as in a forward pass), and the step is bound by it.
 * Here the weights are packed once (`amx_pack_bf16`) into the tile layout, each thread streams a
 * contiguous range of them exactly once per call (the hardware prefetcher follows one stream), and
 * the activations x stay in L1/L2.
 *
 * Layouts (bfloat16 passed as its uint16 bits):
 *   x        [M, K] rows at stride ldx (elements), read directly by tile loads
 *   packed   [N / 16][K / 32][16 r][16 n][2]: element (r, n, p) of tile (nb, kt) is
 *            W[16 nb + n][32 kt + 2 r + p] (TDPBF16PS's B operand, pairs of K per column)
 *   bias     [N] or NULL;  y [M, N] rows at stride ldy
 * N and K multiples of 32. Work: pairs of 16-column blocks (32 output columns), split into
 * contiguous ranges per thread; per pair, 32-row groups of x with 2 x 2 accumulator tiles.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "cpu_amx.h"

int linear_amx_available(void) { return amx_request(); }

/* Tiles (configure_tiles): 0-3 C (16 x 16 floats: rows 0-15 / 16-31 x columns 0-15 / 16-31);
 * 4, 5 A (16 rows of x x 32 K); 6, 7 B (the two column blocks' packed tiles). */

void amx_pack_bf16(const uint16_t *w, uint16_t *dst, int64_t N, int64_t K) {
    const int64_t KT = K / 32;
    for (int64_t nb = 0; nb < N / 16; ++nb)
        for (int64_t kt = 0; kt < KT; ++kt, dst += 512)
            for (int r = 0; r < 16; ++r)
                for (int n = 0; n < 16; ++n) {
                    const uint16_t *src = w + (16 * nb + n) * K + 32 * kt + 2 * r;
                    dst[r * 32 + 2 * n] = src[0];
                    dst[r * 32 + 2 * n + 1] = src[1];
                }
}

/* The C tiles of one (column pair, row group) from float scratch cs [32][32] to y, bias added,
 * rounded: `rows` rows of 32 columns at y (stride ldy). */
static inline void store_rows(const float *cs, const uint16_t *bias, uint16_t *y, int64_t ldy,
                              int rows) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        const __m512i bb = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias));
        const __m512i bh = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + 16)));
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(bb, 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(bh, 16));
    }
    for (int r = 0; r < rows; ++r) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(cs + 32 * r), b0);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(cs + 32 * r + 16), b1);
        _mm512_storeu_si512((__m512i *)(y + r * ldy), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* One column pair (packed tiles b0, b1: K / 32 each) against every row group of x. xpad: the
 * last, partial row group (32 rows, zero past M), or NULL when M % 32 == 0. */
static void column_pair(const uint16_t *x, int64_t ldx, const uint16_t *xpad, const uint16_t *b0,
                        const uint16_t *b1, const uint16_t *bias, uint16_t *y, int64_t ldy,
                        int64_t M, int64_t K, float *cs) {
    const int64_t KT = K / 32;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int partial = M - m0 < 32;
        const uint16_t *a = partial ? xpad : x + m0 * ldx;
        const int64_t lda = (partial ? K : ldx) * 2;
        const int two = M - m0 > 16; /* a second 16-row half with any row in it */
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t kt = 0; kt < KT; ++kt) {
            _tile_loadd(4, a + 32 * kt, lda);
            _tile_loadd(6, b0 + 512 * kt, 64);
            _tile_loadd(7, b1 + 512 * kt, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, (const char *)a + 16 * lda + 64 * kt, lda);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, cs, 128);
        _tile_stored(1, cs + 16, 128);
        if (two) {
            _tile_stored(2, cs + 512, 128);
            _tile_stored(3, cs + 528, 128);
        }
        store_rows(cs, bias, y + m0 * ldy, ldy, partial ? (int)(M - m0) : 32);
    }
}

int linear_amx_built(void) { return 1; }

/* Returns 0, or 1 when the padded rows could not be allocated (y is then not written). */
int linear_amx_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                    uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t KT = K / 32, pairs = N / 32, tail = M % 32;
    uint16_t *xpad = NULL;
    if (tail) { /* tile loads read 32 rows: the last group zero-padded */
        xpad = aligned_alloc(64, (size_t)32 * K * 2);
        if (xpad == NULL) return 1;
        memset(xpad, 0, (size_t)32 * K * 2);
        for (int64_t r = 0; r < tail; ++r)
            memcpy(xpad + r * K, x + (M - tail + r) * ldx, (size_t)K * 2);
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float cs[32 * 32] __attribute__((aligned(64))); /* the C tiles of one group, 4 KiB */
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; ++p) {
            const uint16_t *b0 = packed + 2 * p * KT * 512;
            const uint16_t *bb = bias ? bias + 32 * p : NULL;
            column_pair(x, ldx, xpad, b0, b0 + KT * 512, bb, y + 32 * p, ldy, M, K, cs);
        }
        _tile_release();
    }
    free(xpad);
    return 0;
}

#else /* no AMX-BF16 on this CPU or compiler */
int linear_amx_available(void) { return 0; }
int linear_amx_built(void) { return 0; }
void amx_pack_bf16(const uint16_t *w, uint16_t *dst, int64_t N, int64_t K) {
    (void)w, (void)dst, (void)N, (void)K;
}
int linear_amx_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
                    uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
    (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K;
    (void)threads;
    return 1;
}
#endif

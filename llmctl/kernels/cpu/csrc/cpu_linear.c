/* Linear layer for the CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), reading w in PyTorch's own
 * row-major layout, float32 or bfloat16 (passed as its uint16 bits). Compiled on first use by
 * llmctl/kernels/cpu_native.py; the reference is torch.nn.functional.linear.
 *
 * Why: a decode step multiplies a few rows (one per running sequence) by every weight once. The
 * BLAS behind F.linear is tuned for large M: measured on an AVX2 CPU, 1 thread, weights cold in
 * cache, at 16 rows it runs at 36-44 GFLOP/s where this kernel runs at 42-58, at 4 rows 12-17
 * against 18-33; its bfloat16 path is a slow fallback there (about 10 GFLOP/s), against 37-50 at
 * 16 rows (bfloat16 weights widened once per tile of weight rows; 25-37 when widened in the k loop).
 *
 * How: each register tile of 3 rows of x by 4 rows of w keeps 12 vector accumulators of 8 partial
 * dot products along K, so w is read once, as 4 sequential streams, while x is reused from cache.
 * One row of x (matrix-vector, memory-bound) uses a 1 x 8 tile instead. K must be a multiple of 8
 * (checked by the caller); x and y are float32, contiguous rows (x with row stride ldx).
 */
#include <stdlib.h>

#include "cpu_vec.h"

/* The hardware prefetchers lose track of several rows at once, each a few KB long, so a first
 * pass over w rows would stall on memory. Instead each tile fetches part of the next tile's rows
 * while it computes: bytes [off, end) of each, one cache line every `every` steps of its k loop, so
 * the rows arrive spread over all the tiles that use the current ones. */
typedef struct {
    const char *const *rows;  /* the next tile's rows */
    int64_t off, end;
    int every, countdown;
} prefetch_plan;

static inline prefetch_plan plan_prefetch(const char *const *rows, int64_t off, int64_t end, int64_t K) {
    const int64_t lines = (end - off + 63) / 64, steps = K / 8;
    const int every = lines > 0 && steps > lines ? (int)(steps / lines) : 1;
    return (prefetch_plan){rows, off, end, every, every};
}

/* Called once per k step: the next line of each of `n` rows when its turn comes. */
static inline __attribute__((always_inline)) void prefetch_step(prefetch_plan *pf, const int n) {
    if (--pf->countdown == 0) {
        pf->countdown = pf->every;
        if (pf->off < pf->end) {
            for (int j = 0; j < n; ++j) __builtin_prefetch(pf->rows[j] + pf->off, 0, 0);
            pf->off += 64;
        }
    }
}

/* mv (2 or 3, a constant) rows of x by 4 rows of w, accumulators named one by one: GCC keeps
 * arrays of vectors in memory here. Tails repeat a row pointer; only i < sv, j < nv are stored. */
static inline __attribute__((always_inline)) void tile3x4(
    const float *x0, const float *x1, const float *x2, const char *const *w, prefetch_plan pf, int64_t K,
    float *y, int64_t ldy, const float *bias, const int mv, int sv, int nv, const int bf16) {
    v8r a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0},
        a20 = {0}, a21 = {0}, a22 = {0}, a23 = {0};
    const char *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    for (int64_t k = 0; k < K; k += 8) {
        prefetch_step(&pf, 4);
        const v8r b0 = load8(w0, k, bf16), b1 = load8(w1, k, bf16), b2 = load8(w2, k, bf16),
                  b3 = load8(w3, k, bf16);
        v8r x = *(const v8f *)(x0 + k);
        a00 += x * b0; a01 += x * b1; a02 += x * b2; a03 += x * b3;
        x = *(const v8f *)(x1 + k);
        a10 += x * b0; a11 += x * b1; a12 += x * b2; a13 += x * b3;
        if (mv > 2) {  /* a constant: two-row tiles leave out the third row's work */
            x = *(const v8f *)(x2 + k);
            a20 += x * b0; a21 += x * b1; a22 += x * b2; a23 += x * b3;
        }
    }
    const float r[3][4] = {{hsum(a00), hsum(a01), hsum(a02), hsum(a03)},
                           {hsum(a10), hsum(a11), hsum(a12), hsum(a13)},
                           {hsum(a20), hsum(a21), hsum(a22), hsum(a23)}};
    for (int i = 0; i < sv; ++i)
        for (int j = 0; j < nv; ++j) y[i * ldy + j] = r[i][j] + (bias ? bias[j] : 0.f);
}

/* 1 row of x by 8 rows of w: 8 independent accumulators hide the FMA latency. */
static inline __attribute__((always_inline)) void tile1x8(
    const float *x0, const char *const *w, prefetch_plan pf, int64_t K, float *y, const float *bias, int nv,
    const int bf16) {
    v8r a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    const char *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3], *w4 = w[4], *w5 = w[5], *w6 = w[6], *w7 = w[7];
    for (int64_t k = 0; k < K; k += 8) {
        prefetch_step(&pf, 8);
        const v8r x = *(const v8f *)(x0 + k);
        a0 += x * load8(w0, k, bf16); a1 += x * load8(w1, k, bf16);
        a2 += x * load8(w2, k, bf16); a3 += x * load8(w3, k, bf16);
        a4 += x * load8(w4, k, bf16); a5 += x * load8(w5, k, bf16);
        a6 += x * load8(w6, k, bf16); a7 += x * load8(w7, k, bf16);
    }
    const float r[8] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3), hsum(a4), hsum(a5), hsum(a6), hsum(a7)};
    for (int j = 0; j < nv; ++j) y[j] = r[j] + (bias ? bias[j] : 0.f);
}

enum { ROWS_PER_ITEM = 64, /* rows of w per parallel work item */
       M_BLOCK = 48 };     /* rows of x per pass over an item's w rows: both stay in L2 */

/* Widen n bfloat16 rows of K values into float32 rows of dst (row stride K). */
static inline void widen_rows(const char *const *rows, int n, int64_t K, float *dst) {
    for (int j = 0; j < n; ++j)
        for (int64_t k = 0; k < K; k += 8) *(v8f *)(dst + j * K + k) = load8(rows[j], k, 1);
}

/* Output columns [n0, n1) for all M rows. With bfloat16 weights and more than one row tile, each
 * tile's 4 weight rows are widened to float32 once (into `wide`, 4 x K floats that stay in L2) and
 * every row tile reads those: widening in the k loop would repeat it for each row tile, and it
 * measured 1.7x slower than float32 weights at 16 rows. */
static inline __attribute__((always_inline)) void item(
    const float *x, int64_t ldx, const char *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
    int64_t n0, int64_t n1, const int bf16, float *wide) {
    const size_t row = (size_t)K * (bf16 ? 2 : 4);
    const int nr = M == 1 ? 8 : 4;
    for (int64_t mb = 0; mb < M; mb += M_BLOCK) {
        const int64_t me = mb + M_BLOCK < M ? mb + M_BLOCK : M;
        for (int64_t n = n0; n < n1; n += nr) {
            const int nv = n1 - n < nr ? (int)(n1 - n) : nr;
            const char *wr[8], *pf[8];
            const int64_t nn = n + nr < n1 ? n + nr : n0;  /* the next tile, or the first again */
            const int pv = n1 - nn < nr ? (int)(n1 - nn) : nr;
            for (int j = 0; j < 8; ++j) {
                wr[j] = w + (size_t)(n + (j < nv ? j : nv - 1)) * row;
                pf[j] = w + (size_t)(nn + (j < pv ? j : pv - 1)) * row;
            }
            const float *bn = bias ? bias + n : NULL;
            if (M == 1) {
                tile1x8(x, wr, plan_prefetch(pf, 0, (int64_t)row, K), K, y + n, bn, nv, bf16);
                continue;
            }
            const int widened = bf16 && wide != NULL;
            if (widened) {
                widen_rows(wr, nv, K, wide);
                for (int j = 0; j < 4; ++j) wr[j] = (const char *)(wide + (j < nv ? j : nv - 1) * K);
            }
            /* Rows in tiles of 3, ending 2 + 2 where 3s would leave 1 (16 = 3 * 4 + 2 + 2): a
             * one-row tile has too few accumulators to hide the FMA latency. */
            const int64_t rows = me - mb, tiles = (rows + 2) / 3, threes = rows % 3 == 1 ? tiles - 2 : rows / 3;
            for (int64_t m = mb, t = 0; m < me; ++t) {
                const int mv = t < threes ? 3 : (int)(me - m < 2 ? me - m : 2);
                const float *xm = x + m * ldx;
                const int64_t end = t == tiles - 1 ? (int64_t)row : (int64_t)(row * (t + 1) / tiles);
                const prefetch_plan plan = plan_prefetch(pf, (int64_t)(row * t / tiles) & ~63, end, K);
                float *ym = y + m * N + n;
                if (widened) {  /* float32 rows now: the same tiles as for float32 weights */
                    if (mv == 3) tile3x4(xm, xm + ldx, xm + 2 * ldx, wr, plan, K, ym, N, bn, 3, 3, nv, 0);
                    else tile3x4(xm, xm + (mv > 1 ? ldx : 0), xm, wr, plan, K, ym, N, bn, 2, mv, nv, 0);
                } else if (mv == 3) {
                    tile3x4(xm, xm + ldx, xm + 2 * ldx, wr, plan, K, ym, N, bn, 3, 3, nv, bf16);
                } else {
                    tile3x4(xm, xm + (mv > 1 ? ldx : 0), xm, wr, plan, K, ym, N, bn, 2, mv, nv, bf16);
                }
                m += mv;
            }
        }
    }
}

void linear(const float *x, int64_t ldx, const void *w, const float *bias, float *y, int64_t M, int64_t N,
            int64_t K, int bf16, int threads) {
    const int64_t items = (N + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* Per thread: room for 4 widened weight rows (bf16 weights, more than one row tile). */
        float *wide = bf16 && M > 3 ? aligned_alloc(64, ((size_t)4 * K * sizeof(float) + 63) & ~(size_t)63) : NULL;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t n0 = it * ROWS_PER_ITEM, n1 = n0 + ROWS_PER_ITEM < N ? n0 + ROWS_PER_ITEM : N;
            /* The dtype branch sits inside the parallel loop: GCC outlines the loop body before
             * inlining, so a constant passed from outside would reach it as a variable, branching
             * in the k loop. (Without memory for `wide`, bf16 rows are widened in the k loop.) */
            if (bf16)
                item(x, ldx, (const char *)w, bias, y, M, N, K, n0, n1, 1, wide);
            else
                item(x, ldx, (const char *)w, bias, y, M, N, K, n0, n1, 0, NULL);
        }
        free(wide);
    }
}

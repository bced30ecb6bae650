/* Greedy decoding's argmax over logits rows on the CPU, float32 or bfloat16 (passed as uint16 bits).
 * Compiled on first use by llmctl/kernels/cpu_native.py; the reference is torch.max(dim=-1)'s
 * indices (engine/sampler.py's `greedy`): the first index of a row's maximum, or of its first NaN
 * where the row has one, with -0.0 equal to +0.0.
 *
 * Why: PyTorch's CPU reduction widens bfloat16 to float32 and keeps its index bookkeeping per
 * element; with a vocabulary of 50k-150k and a row per sequence it took a step's sampling time
 * (BENCHMARKS.md). Here the logits are read once in the model's dtype, 16 lanes at a time.
 *
 * How (AVX-512; elsewhere only `argmax_rows_built`, returning 0, and a stub, and the caller keeps
 * torch.max): each value becomes an unsigned key ordered as the floats are (sign bit set for
 * positives, all bits flipped for negatives, -0.0 mapped onto +0.0, every NaN the largest key), so
 * integer compares decide, which -ffast-math cannot reorder or assume NaN-free. One pass keeps per
 * lane the largest key and the first index holding it; the row's answer is the smallest index among
 * the lanes holding the largest key. Rows are split over the threads.
 */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Keys of 16 float32 bit patterns u (see above). */
static inline __m512i keys(__m512i u) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    u = _mm512_mask_mov_epi32(u, _mm512_cmpeq_epi32_mask(u, sign), _mm512_setzero_si512());
    const __mmask16 neg = _mm512_test_epi32_mask(u, sign);
    const __m512i k = _mm512_mask_xor_epi32(_mm512_or_si512(u, sign), neg, u,
                                            _mm512_set1_epi32(-1));
    return _mm512_mask_mov_epi32(k, nan, _mm512_set1_epi32(-1));
}

/* 16 values from row x at j (m: the lanes inside the row), as float32 bit patterns. */
static inline __m512i load16(const void *x, int64_t j, __mmask16 m, int bf16) {
    if (bf16)
        return _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + j)), 16);
    return _mm512_maskz_loadu_epi32(m, (const uint32_t *)x + j);
}

/* One pass: per lane the largest key and the first index holding it (a strict > keeps the
 * first); then the largest key over the lanes and its smallest index. Lanes past the row's end
 * load 0, below every key. */
static inline int64_t row_argmax(const void *x, int64_t n, int bf16) {
    __m512i best = _mm512_setzero_si512(), at = _mm512_setzero_si512();
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512i k = _mm512_maskz_mov_epi32(m, keys(load16(x, j, m, bf16)));
        const __mmask16 gt = _mm512_cmpgt_epu32_mask(k, best);
        best = _mm512_mask_mov_epi32(best, gt, k);
        at = _mm512_mask_mov_epi32(at, gt, idx);
        idx = _mm512_add_epi32(idx, step);
    }
    const uint32_t top = (uint32_t)_mm512_reduce_max_epu32(best);
    const __mmask16 is_top = _mm512_cmpeq_epi32_mask(best, _mm512_set1_epi32((int)top));
    return _mm512_mask_reduce_min_epu32(is_top, at);
}

int argmax_rows_built(void) { return 1; }

/* out[i] = the argmax of row i of x [rows, n] (row stride ld elements); 1 <= n < 2^31. */
void argmax_rows(const void *x, int64_t rows, int64_t n, int64_t ld, int bf16, int64_t *out,
                 int threads) {
    const int64_t esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t i = 0; i < rows; ++i) out[i] = row_argmax((const char *)x + i * ld * esize, n, bf16);
}

#else /* no AVX-512: a scalar loop here was slower than PyTorch's; the caller keeps torch.max */
int argmax_rows_built(void) { return 0; }

void argmax_rows(const void *x, int64_t rows, int64_t n, int64_t ld, int bf16, int64_t *out,
                 int threads) {
    (void)x, (void)rows, (void)n, (void)ld, (void)bf16, (void)out, (void)threads;
}
#endif

/* Structured outputs (engine/grammar.py): row i of x [rows, n] (row stride ld elements) set to
 * -inf wherever bit j % 32 of word j / 32 of mask row i [rows, words] is clear, for j < n; columns
 * past 32 * words are disallowed too. The masks come from the grammar engine (llguidance's
 * layout); most words are all ones or all zeros, so those take one test or one fill. Portable C:
 * the cost is the zero words' stores. */
void mask_rows(void *x, int64_t rows, int64_t n, int64_t ld, int bf16, const int32_t *mask,
               int64_t words, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 4)
    for (int64_t i = 0; i < rows; ++i) {
        const uint32_t *m = (const uint32_t *)mask + i * words;
        uint16_t *xb = (uint16_t *)x + i * ld;
        float *xf = (float *)x + i * ld;
        const float ninf = -__builtin_inff();
        for (int64_t j = 0; j < n; ++j) {
            const int64_t w = j >> 5;
            if (w < words && m[w] == 0xffffffffu) {  /* a whole word allowed: skip it */
                j = (w << 5) + 31;
                continue;
            }
            if (w < words && (m[w] >> (j & 31)) & 1u) continue;
            if (bf16) xb[j] = 0xff80; /* bfloat16 -inf */
            else xf[j] = ninf;
        }
    }
}

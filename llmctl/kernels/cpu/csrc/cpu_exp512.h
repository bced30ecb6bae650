/* Shared by the AVX-512 attention kernels beside it (prefill and paged decode): a vector exp for
 * their softmax. Include only where __AVX512F__ is defined. */
#ifndef LLMCTL_CPU_EXP512_H
#define LLMCTL_CPU_EXP512_H
#include <immintrin.h>

/* 2^y on 16 lanes for y in [-125.5, 0]: 2^n * p(f), y = n + f, f in [-0.5, 0.5], p of degree 5
 * (relative error about 2e-7, far below bf16's rounding of P; libmvec's expf cost 3x more here,
 * where the exponentials bound the kernels). */
static inline __m512 pow2_small(__m512 y) {
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180447e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* exp(x) for x <= 0. Lanes below -87 flush to 2^-125.5 (nothing beside the row's maximum). */
static inline __m512 exp_neg(__m512 x) {
    return pow2_small(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                    _mm512_set1_ps(1.44269504f)));
}

/* 2^y for y <= 0: exp_neg for an argument already in log2 units (a softmax folds log2(e) into
 * its scale and saves a multiply per element). */
static inline __m512 exp2_neg(__m512 y) {
    return pow2_small(_mm512_max_ps(y, _mm512_set1_ps(-125.5f)));
}
#endif

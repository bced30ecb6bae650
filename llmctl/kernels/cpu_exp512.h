/* Shared by the AVX-512 attention kernels beside it (prefill and paged decode): a vector exp for
 * their softmax. Include only where __AVX512F__ is defined. */
#ifndef LLMCTL_CPU_EXP512_H
#define LLMCTL_CPU_EXP512_H
#include <immintrin.h>

/* exp(x) for x <= 0 on 16 lanes: 2^n * p(f), x log2(e) = n + f, f in [-0.5, 0.5], p of degree 5
 * (relative error about 2e-7, far below bf16's rounding of P; libmvec's expf cost 3x more here,
 * where the exponentials bound the kernel). Lanes below -87 flush to 0. */
static inline __m512 exp_neg(__m512 x) {
    const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                   _mm512_set1_ps(1.44269504f));
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
#endif

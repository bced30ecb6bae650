/* Shared by the AVX-512 element-wise kernels beside it (RMSNorm, RoPE, SiLU-and-multiply): 16
 * bfloat16 lanes (uint16 bits) to and from float32. Include only where __AVX512BF16__,
 * __AVX512BW__ and __AVX512VL__ are defined. */
#ifndef LLMCTL_CPU_BF16X16_H
#define LLMCTL_CPU_BF16X16_H
#include <immintrin.h>
#include <stdint.h>

/* 16 bfloat16 values widened to float32 (exact). */
static inline __m512 widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The lanes of m loaded from p and widened; the others 0. */
static inline __m512 load16(const uint16_t *p, __mmask16 m) {
    return widen16(_mm256_maskz_loadu_epi16(m, p));
}

/* float32 to bfloat16, nearest even (vcvtneps2bf16). */
static inline __m256i narrow16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* float32 rounded to bfloat16 and back. */
static inline __m512 round16(__m512 v) { return widen16(narrow16(v)); }
#endif

/* Shared by the C kernels beside it: 8-float vectors through GCC/Clang vector extensions, so the
 * loops are SIMD on any target (AVX2 here), and loads of float32 or bfloat16 rows into them. */
#ifndef LLMCTL_CPU_VEC_H
#define LLMCTL_CPU_VEC_H
#include <stddef.h>
#include <stdint.h>

typedef float v8r __attribute__((vector_size(32)));              /* in registers */
typedef float v8f __attribute__((vector_size(32), aligned(4)));  /* loads from any float */
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));

/* 8 values from element i of p: float32, or bfloat16 passed as its uint16 bits. */
static inline v8r load8(const void *p, int64_t i, const int bf16) {
    if (bf16) {  /* bfloat16 is the top half of a float32 */
        v8u u = __builtin_convertvector(*(const v8h *)((const uint16_t *)p + i), v8u) << 16;
        return (v8r)u;
    }
    return *(const v8f *)((const float *)p + i);
}

static inline float hsum(v8r v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
#endif

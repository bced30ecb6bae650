/* Shared by the C kernels beside it: 8-float vectors through GCC/Clang vector extensions, so the
 * loops are SIMD on any target (AVX2 here), and loads of float32, bfloat16 or fp8 rows into
 * them. */
#ifndef LLMCTL_CPU_VEC_H
#define LLMCTL_CPU_VEC_H
#include <stddef.h>
#include <stdint.h>

typedef float v8r __attribute__((vector_size(32)));              /* in registers */
typedef float v8f __attribute__((vector_size(32), aligned(4)));  /* loads from any float */
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));

/* Element kinds of cached rows (load8 reads the first two): float32, bfloat16 (as its uint16
 * bits), fp8 e4m3fn and fp8 e5m2 (as their bytes, the KV cache's --kv-cache-dtype fp8 formats);
 * int8 (the int8 KV cache: rows of int8 values and a float32 scale). */
enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_E4M3 = 2, KIND_E5M2 = 3, KIND_I8 = 4 };

static inline size_t kind_size(const int kind) { return kind >= KIND_E4M3 ? 1 : 2 * (2 - kind); }

/* Bytes of one cached row of D values: an int8 row (KV cache int8) ends in its float32 scale. */
static inline size_t row_bytes(const int kind, int D) {
    return kind_size(kind) * (size_t)D + (kind == KIND_I8 ? 4 : 0);
}

/* 8 values from element i of p, of element kind KIND_F32 or KIND_BF16 (0/1 is the old bf16
 * flag); fp8 and int8 rows are widened by their kernels (cpu_paged_attention.c fp8_row). */
static inline v8r load8(const void *p, int64_t i, const int kind) {
    if (kind == KIND_BF16) {  /* bfloat16 is the top half of a float32 */
        v8u u = __builtin_convertvector(*(const v8h *)((const uint16_t *)p + i), v8u) << 16;
        return (v8r)u;
    }
    return *(const v8f *)((const float *)p + i);
}

static inline float hsum(v8r v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
#endif

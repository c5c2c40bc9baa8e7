/* What the int8 GEMMs (gemm_q4_i8.c, gemm_q8_i8.c) share across their instruction-set paths: the vector types,
 * the paths' target attributes, and a fused multiply-add per path (16 lanes; 8 on AVX2), each rounding
 * a * b + c once per lane (so every path's epilogue gives the same bits). */
#ifndef SPECSERVE_INT8_SIMD_H
#define SPECSERVE_INT8_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "gemm_common.h"

#define ALWAYS_INLINE __attribute__((always_inline))

typedef int32_t i32v __attribute__((vector_size(64)));
typedef uint8_t u8v __attribute__((vector_size(64)));

/* a * b + c rounded once, lane by lane (what vfmadd does) */
static inline ALWAYS_INLINE v16 fmadd_portable(v16 a, v16 b, v16 c) {
    for (int j = 0; j < 16; j++) c[j] = fmaf(a[j], b[j], c[j]);
    return c;
}

#if defined(__x86_64__)
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));

TARGET_AVX2 static inline ALWAYS_INLINE f32x8 fmadd_avx2(f32x8 a, f32x8 b, f32x8 c) {
    __m256 x, y, z;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    memcpy(&z, &c, sizeof z);
    z = _mm256_fmadd_ps(x, y, z);
    memcpy(&c, &z, sizeof c);
    return c;
}

TARGET_VNNI static inline ALWAYS_INLINE v16 fmadd_vnni(v16 a, v16 b, v16 c) {
    __m512 x, y, z;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    memcpy(&z, &c, sizeof z);
    z = _mm512_fmadd_ps(x, y, z);
    memcpy(&c, &z, sizeof c);
    return c;
}
#endif

#endif

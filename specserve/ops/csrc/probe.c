/* What this machine can do, for the benchmarks' bounds (benchmarks/step_rows.py): the rate of reading memory
 * and the rate of 512-bit int8 dot products (AVX512-VNNI vpdpbusd: 64 multiply-adds each), both on the
 * OpenMP threads the kernels use. */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "specserve_kernels.h"

typedef uint64_t u64v __attribute__((vector_size(64)));

/* Reads buf [bytes] (a multiple of 256) once, split among the threads; returns a checksum so that the
 * reads cannot be dropped. */
uint64_t probe_read(const uint8_t *buf, int64_t bytes) {
    uint64_t sum = 0;
#pragma omp parallel for schedule(static) reduction(^ : sum)
    for (int64_t i = 0; i < bytes; i += 256) {
        u64v a, b, c, d;
        memcpy(&a, buf + i, 64);
        memcpy(&b, buf + i + 64, 64);
        memcpy(&c, buf + i + 128, 64);
        memcpy(&d, buf + i + 192, 64);
        const u64v x = a ^ b ^ c ^ d;
        for (int j = 0; j < 8; j++) sum ^= x[j];
    }
    return sum;
}

#if defined(__x86_64__)
/* iters x 12 independent vpdpbusd per thread; returns the instructions run (0 without AVX512-VNNI). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static int64_t dot_products_vnni(int64_t iters) {
    int64_t total = 0;
#pragma omp parallel reduction(+ : total)
    {
        __m512i acc[12];
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i);
        __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
        for (int64_t it = 0; it < iters; it++) {
            for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], u, s);
            __asm__ volatile("" : "+v"(u), "+v"(s)); /* keeps the loop from being folded */
        }
        __m512i r = acc[0];
        for (int i = 1; i < 12; i++) r = _mm512_add_epi32(r, acc[i]);
        total += 12 * iters + (_mm512_reduce_add_epi32(r) == 7); /* the sum keeps the chains alive */
    }
    return total;
}
#endif

int64_t probe_dot_products(int64_t iters) {
#if defined(__x86_64__)
    if (q4_i8_supported(INT8_VNNI)) return dot_products_vnni(iters);
#endif
    (void)iters;
    return 0;
}

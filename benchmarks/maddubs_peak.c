/* The int8 products a second of one thread doing nothing but AVX2's vpmaddubsw (32 u8 x s8 products into 16
 * int16 pair sums) and the vpaddw that keeps each sum, on 12 independent accumulators: the ceiling of the
 * AVX2 path of the int8 GEMMs (csrc/gemm_q4_i8.c), which benchmarks/gemm_rows.py's figures compare with.
 *
 *     cc -O2 -mavx2 benchmarks/maddubs_peak.c -o /tmp/maddubs_peak && /tmp/maddubs_peak
 *     (/tmp/maddubs_peak & /tmp/maddubs_peak & wait)   # both vCPUs at once
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

int main(void) {
    __m256i acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_epi16((short)i);
    __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
    const long n = 200000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) acc[j] = _mm256_add_epi16(acc[j], _mm256_maddubs_epi16(w, x));
        __asm__ volatile("" : "+x"(w), "+x"(x)); /* the operands change as far as the compiler knows */
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    __m256i r = acc[0];
    for (int i = 1; i < 12; i++) r = _mm256_add_epi16(r, acc[i]);
    printf("%.1f G int8 products/s on one thread (checksum %d)\n", (double)n * 12 * 32 / s / 1e9,
           _mm256_extract_epi16(r, 0));
    return 0;
}

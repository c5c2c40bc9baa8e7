/* What the packed GEMMs share (gemm.c, gemm_gguf.c): the block width, the row chunks and the one k step
 * every kernel takes, so that fp32, int8 and GGUF-block weights accumulate each output in the same FMA chain. */
#ifndef SPECSERVE_GEMM_COMMON_H
#define SPECSERVE_GEMM_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 32
/* The vector the fp32 GEMMs compute in: the build's native width, 16 floats with AVX-512 and 8 otherwise, NV
 * of them per block of 32 columns. GCC keeps a vector wider than the machine's registers in memory, so a
 * 64-byte vector on an AVX2 build loads and stores around every operation (half of a decode step's
 * instructions were stack traffic). Each output column is the same FMA chain over k whatever the width, so
 * every build gives the same bits. */
#if defined(__AVX512F__)
#define VLEN 16
#else
#define VLEN 8
#endif
#define NV (BLOCK / VLEN)
typedef float vf __attribute__((vector_size(VLEN * sizeof(float))));
/* The int8 kernels' 16-lane vector (their paths pick their instruction sets per function). */
typedef float v16 __attribute__((vector_size(64)));

/* Rows sharing each weight load, as many as keep their accumulators (NV each) beside the weight vectors in the
 * vector registers. AVX-512: 12 rows keep 24 accumulators + 2 weight vectors in the 32 registers, so a
 * verification step of 1 + 8 tokens is one pass over the weights (with 8 rows it would be two, the second a
 * latency-bound single row: a 9-token step then costs ~1.28x a 1-token step, not ~1.15x). AVX2 (16 registers,
 * 4 accumulators a row): 4 rows, measured on a Q8_0 GEMM of 896 x 9728 (one thread, AMD EPYC Zen 3): 9 rows
 * 4.1 ms with 4 rows a pass, 4.9 with 3, 7.0 with 2; one row 0.7-0.9 ms whatever the setting. */
#ifndef MAX_ROWS_NARROW
#define MAX_ROWS_NARROW 4
#endif
#if defined(__AVX512F__)
#define MAX_ROWS 12
#else
#define MAX_ROWS MAX_ROWS_NARROW
#endif

/* Run CALL(rows) for each chunk of at most MAX_ROWS rows, m being the chunk's first row, with `rows` a
 * compile-time constant in each case so the accumulators stay in registers (the cases past MAX_ROWS - 1 are
 * never taken). */
#define FOR_ROW_CHUNKS(M, m, CALL)                                       \
    for (m = 0; m + MAX_ROWS <= (M); m += MAX_ROWS) CALL(MAX_ROWS);      \
    switch ((M) - m) {                                                   \
        case 1: CALL(1); break;                                          \
        case 2: if (MAX_ROWS > 2) CALL(2); break;                        \
        case 3: if (MAX_ROWS > 3) CALL(3); break;                        \
        case 4: if (MAX_ROWS > 4) CALL(4); break;                        \
        case 5: if (MAX_ROWS > 5) CALL(5); break;                        \
        case 6: if (MAX_ROWS > 6) CALL(6); break;                        \
        case 7: if (MAX_ROWS > 7) CALL(7); break;                        \
        case 8: if (MAX_ROWS > 8) CALL(8); break;                        \
        case 9: if (MAX_ROWS > 9) CALL(9); break;                        \
        case 10: if (MAX_ROWS > 10) CALL(10); break;                     \
        case 11: if (MAX_ROWS > 11) CALL(11); break;                     \
        default: break;                                                  \
    }
/* Software prefetch distance, in floats (4 KB): the stream runs ahead of the FMAs, so with 2-8 rows the
 * arithmetic hides under the memory traffic (measured: 6 rows cost what 1 row does; 1 row 8% faster). */
#define PREFETCH 1024

/* a * b + c rounded once per lane, as an explicit fused multiply-add: GCC decides on its own whether to fuse
 * a * b + c written out (tuned for AMD Zen it leaves loop-carried chains unfused), and every kernel that must
 * reproduce another's sums needs the same roundings. */
static inline __attribute__((always_inline)) vf fma_vf(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    __m512 x, y, z;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    memcpy(&z, &c, sizeof z);
    z = _mm512_fmadd_ps(x, y, z);
    memcpy(&c, &z, sizeof c);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 x, y, z;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    memcpy(&z, &c, sizeof z);
    z = _mm256_fmadd_ps(x, y, z);
    memcpy(&c, &z, sizeof c);
#else
    for (int i = 0; i < VLEN; i++) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
#endif
    return c;
}

/* One k step: every row's broadcast x[m, k] (x points at column k of row 0) times the block's 32 weights. */
static inline __attribute__((always_inline)) void accumulate(vf acc[][NV], const float *x, int64_t K,
                                                             const vf w[NV], const int rows) {
    for (int m = 0; m < rows; m++) {
        const vf xv = (vf){0} + x[m * K];
        for (int j = 0; j < NV; j++) acc[m][j] = fma_vf(xv, w[j], acc[m][j]);
    }
}

/* Each row's 32 sums (acc: rows x BLOCK floats, one row after the other), times the column scales and plus the
 * bias where given, into its ncols outputs. */
static inline __attribute__((always_inline)) void store_rows(const void *acc, float *y, int64_t N, int64_t ncols,
                                                             const float *scale, const float *bias,
                                                             const int rows) {
    for (int m = 0; m < rows; m++) {
        float tmp[BLOCK];
        memcpy(tmp, (const float *)acc + m * BLOCK, sizeof tmp);
        if (scale)
            for (int64_t j = 0; j < ncols; j++) tmp[j] *= scale[j];
        if (bias)
            for (int64_t j = 0; j < ncols; j++) tmp[j] += bias[j];
        memcpy(y + m * N, tmp, ncols * sizeof(float));
    }
}

/* VLEN int8 -> VLEN fp32, exact. GCC turns __builtin_convertvector on int8 into lane-by-lane scalar code, so
 * AVX-512 / AVX2 builds use the sign-extend and convert instructions directly. */
static inline __attribute__((always_inline)) vf widen(const int8_t *p) {
    vf r;
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&r, &f, sizeof r);
#elif defined(__AVX2__)
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&r, &f, sizeof r);
#else
    for (int i = 0; i < VLEN; i++) r[i] = (float)p[i];
#endif
    return r;
}

/* NV vectors from 32 floats at p (any alignment). */
static inline __attribute__((always_inline)) void load_block(vf w[NV], const float *p) {
    for (int j = 0; j < NV; j++) memcpy(&w[j], p + j * VLEN, sizeof w[j]);
}

/* The group records of the GGUF-block layouts (gemm_gguf.c, gemm_q4_i8.c, gemm_q8_i8.c). A weight's `group` is
 * G | S << 8. With S = 0 each record is a[32], b[32] (fp32) and then the group's q bytes. With S > 0 (a power
 * of two; the k-quants: Q4_K's super-blocks of 8 groups of 32, Q6_K's of 16 groups of 16) every S records follow the
 * super-block's fp32 factors D[32], E[32], and each record is sc[32], mn[32] (int8) and then its q bytes, with
 * a = D * sc and b = E * mn: the file's fp16 scale times a small integer, an exact product, so the same fp32
 * a and b as the plain records hold, in 64 + q bytes a group instead of 256 + q (Q4_K: 4.75 bits a weight
 * against 6; Q6_K widened to int8: 9.5 against 12). */
#define RECORD_GROUP(group) ((group) & 255)
#define RECORD_SUPERS(group) ((int)((group) >> 8))
#define PLAIN_HEADER (2 * BLOCK * (int64_t)sizeof(float)) /* a[32], b[32] */
#define SMALL_HEADER (2 * BLOCK)                          /* sc[32], mn[32] */

/* Bytes of one block of 32 columns: `groups` records of `qbytes` q bytes each. */
static inline int64_t records_bytes(int64_t groups, int64_t qbytes, int supers) {
    if (!supers) return groups * (PLAIN_HEADER + qbytes);
    return groups / supers * PLAIN_HEADER + groups * (SMALL_HEADER + qbytes);
}

/* The super-block holding group g (supers, a power of two: the kernels refuse others; shifts, not divisions,
 * in the groups' loops). */
static inline __attribute__((always_inline)) const uint8_t *group_super(const uint8_t *block, int64_t g,
                                                                        int64_t qbytes, int supers) {
    return block + (g >> __builtin_ctz(supers)) * (PLAIN_HEADER + supers * (SMALL_HEADER + qbytes));
}

/* Group g's q bytes in a block. */
static inline __attribute__((always_inline)) const uint8_t *group_q(const uint8_t *block, int64_t g, int64_t qbytes,
                                                                    int supers) {
    if (!supers) return block + g * (PLAIN_HEADER + qbytes) + PLAIN_HEADER;
    const int64_t within = g & (supers - 1);
    return group_super(block, g, qbytes, supers) + PLAIN_HEADER + within * (SMALL_HEADER + qbytes) + SMALL_HEADER;
}

/* The a[32], b[32] of a group in a super-block, made from its factors and its int8 scales (q: group_q). */
static inline __attribute__((always_inline)) void make_scales(const uint8_t *block, int64_t g, const uint8_t *q,
                                                              int64_t qbytes, int supers, float *ab) {
    const float *factors = (const float *)group_super(block, g, qbytes, supers);
    const int8_t *small = (const int8_t *)(q - SMALL_HEADER);
    for (int j = 0; j < 2 * BLOCK; j += VLEN) { /* widen: the vector instructions, not GCC's lane-by-lane code */
        vf f;
        memcpy(&f, factors + j, sizeof f);
        f *= widen(small + j);
        memcpy(ab + j, &f, sizeof f);
    }
}

/* Group g of a block: returns its q bytes and points *ab at its a[32], b[32], the record's own or made in
 * buf[64] from the super-block's factors. */
static inline __attribute__((always_inline)) const uint8_t *group_record(const uint8_t *block, int64_t g,
                                                                      int64_t qbytes, int supers, float *buf,
                                                                      const float **ab) {
    const uint8_t *q = group_q(block, g, qbytes, supers);
    if (!supers) {
        *ab = (const float *)(q - PLAIN_HEADER);
    } else {
        make_scales(block, g, q, qbytes, supers, buf);
        *ab = buf;
    }
    return q;
}

#endif

/* y = x @ W^T (+ bias) for 4-bit GGUF blocks with integer dot products on 15-bit activations.
 *
 * Each row of x is quantized per group of 32 k's (the weights' groups) to two int8 digits, x ~ d * (hi + lo /
 * 256) with d = max|x| / 127 (an error below max|x| / 65000, where one int8 digit, llama.cpp's Q8 activations,
 * errs up to max|x| / 254 and flips near-tied greedy tokens). Every output is the sum over groups of
 * (a * d / 256) * sum_k q_w * (256 hi + lo) + b * (d / 256) * sum_k (256 hi + lo), with the weights'
 * w = a * q_w + b (q_w in 0..15; a, b per column and group, gemm_gguf.c). The integer sums are exact; the fp32
 * epilogue takes the same operations in the same order for every row, so a row's result does not depend on
 * the other rows of the call (a verification step gives each position what a one-token step gives) nor on
 * the thread count. Per 32 weights a row costs one 512-bit dot-product instruction (AVX512-VNNI vpdpbusd:
 * 64 u8 x s8 products into 16 int32 lanes, twice for the two digits) where the fp32 GEMM spends two FMAs and
 * the dequantization, so a one-token step is bound by the blocks' bytes and extra verified rows are cheap.
 *
 * Instruction-set paths: the kernel is compiled once per path (gemm_q4_i8_path.h) with function-level target
 * attributes, so every x86 build holds all of them whatever the build host has: AVX512-VNNI, AVX2 (vpmaddubsw
 * + vpmaddwd: the same integer sums) and portable C, and AMX tiles (gemm_q4_i8_amx.h) where the CPU has them and
 * Linux grants the tile state. The integer sums are exact on each and the epilogue's multiply-adds are explicit
 * fused ones, so every path gives the same bits, and each call may take whichever is fastest for its row count:
 * a per-kernel table of row count -> path (int8_route_set), measured on the loaded model's own calls
 * (specserve/ops/int8_routes.py); until one is set, every call takes the fastest vector path the CPU runs. AMX
 * runs only after a forked child has run it on a fixed problem and given the VNNI path's bits (a fault or a
 * wrong result there costs the child, not the process).
 *
 * WEIGHT_Q4_Q8 (gguf_compute="q8") is the same layout multiplied by one digit (lo = 0, llama.cpp's Q8_0
 * activations): half the dot products, the same code otherwise.
 *
 * Packed layout (WEIGHT_Q4_I8, WEIGHT_Q4_Q8): gemm_gguf.c's Q4 records (a[32], b[32], then the group's q) with the q bytes
 * of each group reordered from [k][16] to [k / 4][16][4]: byte 4j + i of quad t holds column j (low nibble)
 * and column j + 16 (high nibble) at k = 4t + i, so one 64-byte load gives 16 columns x 4 k's for each half.
 * A k-quant's records may instead come in super-blocks with int8 scales (gemm_common.h's group_record): the same
 * fp32 a and b, made per group from the super-block's factors, and the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#define Q4_X86 1
#endif

#include "gemm_common.h"
#include "int8_simd.h"
#include "specserve_kernels.h"

#define QGROUP 32
#define Q4_QBYTES (QGROUP * 16) /* a group's nibbles: 32 k's x 32 columns */
#define Q4_RECORD (PLAIN_HEADER + Q4_QBYTES)
/* Rows sharing each block's loads: 4 rows keep 16 int32 and 8 fp32 accumulators with the scales and the
 * unpacked nibbles in the 32 vector registers (AVX-512). With 16 registers of half the width (AVX2), a row
 * needs twice the vectors: 2 rows (a 9-row call of 896 x 9728 took 2.2 ms against 2.6 with 1 row a pass and
 * 2.4 with 4, one thread, AMD EPYC Zen 3). */
#define I8_ROWS 4
#ifndef I8_ROWS_AVX2
#define I8_ROWS_AVX2 2
#endif
/* Records ahead that each group prefetches, all 12 of a record's cache lines: a shorter stream (3 lines 2
 * records ahead) leaves the loads waiting on memory, ~3.4 ms for a 2-row call on a 75 MB weight against
 * 2.0-3.0 ms with these. */
#define I8_PREFETCH 8

/* ---- the portable path: plain C (vectorized as the build's flags allow) ---- */

/* For each of 16 int32 lanes j: acc[j] + sum_i u[4j + i] * s[i], with s the four int8 of s4. */
static inline ALWAYS_INLINE i32v dot4_portable(i32v acc, u8v u, int32_t s4) {
    int8_t s[4];
    memcpy(s, &s4, sizeof s);
    for (int j = 0; j < 16; j++)
        acc[j] += u[4 * j] * s[0] + u[4 * j + 1] * s[1] + u[4 * j + 2] * s[2] + u[4 * j + 3] * s[3];
    return acc;
}

/* One group of 32 values -> hi[32], lo[32] (x ~ d * (hi + lo / 256), d = max|x| / 127; lo = 0 with one
 * digit); returns sum(256 hi + lo) and sets *d. */
static inline ALWAYS_INLINE int32_t quantize_group_portable(const float *v, int8_t *hi, int8_t *lo, float *d_out,
                                                            const int digits) {
    float amax = 0.0f;
    for (int i = 0; i < QGROUP; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < QGROUP; i++) {
        const float r = v[i] * inv;
        const int h = (int)nearbyintf(r);
        int l = digits == 2 ? (int)nearbyintf((r - (float)h) * 256.0f) : 0;
        l = l > 127 ? 127 : l < -127 ? -127 : l;
        hi[i] = (int8_t)h;
        lo[i] = (int8_t)l;
        sum += 256 * h + l;
    }
    *d_out = d;
    return sum;
}

#define Q4_PATH portable
#define Q4_TARGET
#define Q4_L 16
#define Q4_F v16
#define Q4_I i32v
#define Q4_U u8v
#define Q4_ROWS I8_ROWS
#define Q4_DOT4 dot4_portable
#define Q4_FMADD fmadd_portable
#define Q4_QUANTIZE_GROUP quantize_group_portable
#include "gemm_q4_i8_path.h"

#if defined(Q4_X86)
/* ---- AVX2 (+ FMA) ---- */
typedef int16_t i16x16 __attribute__((vector_size(32)));

/* u <= 15, |s| <= 127: each pair sum of vpmaddubsw is at most 3,810 in size, and a group's 8 quads add up in its
 * int16 lanes to at most 30,480 (no saturation, no wrap); pairs_avx2 then adds each lane pair into int32 once a
 * group (vpmaddwd), giving vpdpbusd's sums with one instruction less per quad. */
TARGET_AVX2 static inline ALWAYS_INLINE i16x16 dot4_avx2(i16x16 acc, u8x32 u, int32_t s4) {
    __m256i uu;
    memcpy(&uu, &u, sizeof uu);
    const __m256i p = _mm256_maddubs_epi16(uu, _mm256_set1_epi32(s4));
    i16x16 r;
    memcpy(&r, &p, sizeof r);
    return acc + r;
}

TARGET_AVX2 static inline ALWAYS_INLINE i32x8 pairs_avx2(i16x16 acc) {
    __m256i a;
    memcpy(&a, &acc, sizeof a);
    const __m256i p = _mm256_madd_epi16(a, _mm256_set1_epi16(1));
    i32x8 r;
    memcpy(&r, &p, sizeof r);
    return r;
}

/* quantize_group_portable's numbers, 8 lanes at a time (vcvtps2dq rounds to nearest even, as nearbyintf) */
TARGET_AVX2 static inline ALWAYS_INLINE int32_t quantize_group_avx2(const float *v, int8_t *hi, int8_t *lo,
                                                                    float *d_out, const int digits) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < QGROUP; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv), k256 = _mm256_set1_ps(256.0f);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < QGROUP; i += 8) {
        const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(v + i), vinv);
        const __m256i h = _mm256_cvtps_epi32(r);
        __m256i l = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(r, _mm256_cvtepi32_ps(h)), k256));
        l = digits == 2 ? _mm256_max_epi32(_mm256_min_epi32(l, top), bottom) : _mm256_setzero_si256();
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_slli_epi32(h, 8), l));
        int32_t hv[8], lv[8];
        _mm256_storeu_si256((__m256i *)hv, h);
        _mm256_storeu_si256((__m256i *)lv, l);
        for (int j = 0; j < 8; j++) hi[i + j] = (int8_t)hv[j], lo[i + j] = (int8_t)lv[j];
    }
    int32_t s[8], total = 0;
    _mm256_storeu_si256((__m256i *)s, sum);
    for (int j = 0; j < 8; j++) total += s[j];
    *d_out = d;
    return total;
}

#define Q4_PATH avx2
#define Q4_TARGET TARGET_AVX2
#define Q4_L 8
#define Q4_F f32x8
#define Q4_I i32x8
#define Q4_U u8x32
#define Q4_ROWS I8_ROWS_AVX2
#define Q4_DOT4 dot4_avx2
#define Q4_ACC i16x16
#define Q4_ACC_SUM pairs_avx2
#define Q4_FMADD fmadd_avx2
#define Q4_QUANTIZE_GROUP quantize_group_avx2
#include "gemm_q4_i8_path.h"

/* ---- AVX512-VNNI ---- */
TARGET_VNNI static inline ALWAYS_INLINE i32v dot4_vnni(i32v acc, u8v u, int32_t s4) {
    __m512i a, uu;
    memcpy(&a, &acc, sizeof a);
    memcpy(&uu, &u, sizeof uu);
    a = _mm512_dpbusd_epi32(a, uu, _mm512_set1_epi32(s4));
    memcpy(&acc, &a, sizeof acc);
    return acc;
}

TARGET_VNNI static inline ALWAYS_INLINE int32_t quantize_group_vnni(const float *v, int8_t *hi, int8_t *lo,
                                                                    float *d_out, const int digits) {
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv), k256 = _mm512_set1_ps(256.0f);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < 2; i++) {
        const __m512 r = _mm512_mul_ps(i ? v1 : v0, vinv);
        const __m512i h = _mm512_cvtps_epi32(r);
        __m512i l = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(r, _mm512_cvtepi32_ps(h)), k256));
        l = digits == 2 ? _mm512_max_epi32(_mm512_min_epi32(l, top), bottom) : _mm512_setzero_si512();
        sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_slli_epi32(h, 8), l));
        _mm_storeu_si128((__m128i *)(hi + 16 * i), _mm512_cvtepi32_epi8(h));
        _mm_storeu_si128((__m128i *)(lo + 16 * i), _mm512_cvtepi32_epi8(l));
    }
    *d_out = d;
    return _mm512_reduce_add_epi32(sum);
}

#define Q4_PATH vnni
#define Q4_TARGET TARGET_VNNI
#define Q4_L 16
#define Q4_F v16
#define Q4_I i32v
#define Q4_U u8v
#define Q4_ROWS I8_ROWS
#define Q4_DOT4 dot4_vnni
#define Q4_FMADD fmadd_vnni
#define Q4_QUANTIZE_GROUP quantize_group_vnni
#include "gemm_q4_i8_path.h"

/* ---- AMX ---- */
#define AMX_ROWS 16 /* activation rows per A tile */
/* The quantized rows the AMX path reads for M rows: M below one tile, else whole tiles of AMX_ROWS */
static inline int64_t amx_rows(int64_t M) { return M < AMX_ROWS ? M : (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS; }
/* Tile registers (literal numbers: GCC's tile intrinsics paste them into the instruction) */
#define TILE_C0 0
#define TILE_C1 1
#define TILE_C2 2
#define TILE_C3 3
#define TILE_AHI 4
#define TILE_ALO 5
#define TILE_B0 6
#define TILE_B1 7

#include "amx_tiles.h"

#if INT8_AMX_BUILT
#define Q4A_PATH amx
#define Q4A_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define AMX_EMULATED 0
#include "gemm_q4_i8_amx.h"
#undef Q4A_PATH
#undef Q4A_TARGET
#undef AMX_EMULATED
#endif
#define Q4A_PATH amx_emulated
#define Q4A_TARGET TARGET_VNNI
#define AMX_EMULATED 1
#include "gemm_q4_i8_amx.h"
#endif /* Q4_X86 */

/* ---- choosing a path ---- */

#if defined(Q4_X86)
static int vnni_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
}

/* The bits of the AMX path (emulated: its C tiles) against the VNNI path's on a fixed problem (34 rows:
 * three tile chunks, the last padded; two groups; one block), in this process. Allocates nothing: it runs in
 * a forked child. */
static int amx_self_check(int emulated) {
    enum { M = 34, K = 64, N = 32, NG = K / QGROUP, PADDED = 48 };
    static uint8_t packed[NG * Q4_RECORD] __attribute__((aligned(64)));
    static float x[M * K], y_vnni[M * N], y_amx[M * N], xu[M * NG], xs[M * NG];
    static float acc[PADDED * BLOCK] __attribute__((aligned(64)));
    static int8_t xq[2 * PADDED * K];
    uint32_t state = 12345;
    for (int64_t i = 0; i < NG * Q4_RECORD; i++) {
        state = state * 1664525u + 1013904223u;
        packed[i] = (uint8_t)(state >> 24);
    }
    for (int64_t g = 0; g < NG; g++) /* scales a > 0, offsets b <= 0 */
        for (int j = 0; j < 2 * BLOCK; j++) {
            float *ab = (float *)(packed + g * Q4_RECORD) + j;
            *ab = j < BLOCK ? 1e-3f * (float)(1 + (packed[g * Q4_RECORD + 256 + j] & 15)) : -0.01f * (float)(j & 7);
        }
    for (int64_t i = 0; i < M * K; i++) {
        state = state * 1664525u + 1013904223u;
        x[i] = ((float)(state >> 8) / 16777216.0f - 0.5f) * (float)(1 + i % 7);
    }
    memset(xq, 0, sizeof xq);
    int same = 1;
    for (int digits = 1; digits <= 2; digits++) {
        quantize_rows_vnni(x, M, K, xq, xu, xs, digits);
        gemm_blocks_vnni(xq, xu, xs, packed, NULL, y_vnni, M, K, N, digits, 0);
        if (emulated) gemm_blocks_amx_emulated(xq, xu, xs, packed, NULL, y_amx, M, K, N, acc, digits, 0);
#if INT8_AMX_BUILT
        else gemm_blocks_amx(xq, xu, xs, packed, NULL, y_amx, M, K, N, acc, digits, 0);
#endif
        same &= memcmp(y_vnni, y_amx, sizeof y_vnni) == 0;
    }
    return same && screen_amx_self_check(emulated);
}

/* 1 when amx_self_check(emulated) passes in a forked child (which may fault without harm: 0 then, as when
 * it fails or runs over 10 s). Exported for tests, which run it emulated. */
int q4_i8_amx_check_in_child(int64_t emulated) {
    if (!vnni_supported()) return 0;
    int *verdict = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (verdict == MAP_FAILED) return 0;
    *verdict = 0;
    const pid_t pid = fork();
    if (pid == 0) {
        *verdict = amx_self_check((int)emulated) ? 1 : 2;
        _exit(0);
    }
    int status = 0, done = 0;
    for (int waited_ms = 0; pid > 0 && waited_ms < 10000 && !done; waited_ms++) {
        done = waitpid(pid, &status, WNOHANG) == pid;
        if (!done) nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    if (pid > 0 && !done) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    const int ok = done && WIFEXITED(status) && *verdict == 1;
    munmap(verdict, 4096);
    return ok;
}

/* Whether AMX runs here: the CPU's flags, Linux's permission for the tile state (arch_prctl
 * ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), and the self-check in a child. */
static int amx_usable(void) {
#if !INT8_AMX_BUILT
    return 0;
#else
    __builtin_cpu_init();
    if (!vnni_supported() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 0;
    return q4_i8_amx_check_in_child(0);
#endif
}
#endif

/* Whether this CPU (and its OS, for the vector and tile state) runs `path`. */
int q4_i8_supported(int64_t path) {
    switch (path) {
        case INT8_PORTABLE: return 1;
#if defined(Q4_X86)
        case INT8_AVX2:
            __builtin_cpu_init();
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case INT8_VNNI:
        case INT8_AMX_EMULATED: return vnni_supported();
        case INT8_AMX: {
            static int usable = -1;
            if (usable < 0) usable = amx_usable();
            return usable;
        }
#endif
        default: return 0;
    }
}

/* Per kernel, the path of each row count 1..INT8_ROUTE_ROWS (-1 until set), and the calls each path took. */
static signed char routes[INT8_KERNELS][INT8_ROUTE_ROWS];
static int routes_ready;
static int64_t route_calls[INT8_KERNELS][INT8_PATHS];

/* Whether `kernel` has an AMX version: the Q8-layout GEMM (gemm_q8_i8.c) has none, so its routes never name
 * AMX (a forced AMX path gives it the VNNI one, the AMX path's vector twin). */
static int has_amx(int64_t kernel) { return kernel != INT8_GEMM_Q8; }

/* The fastest vector path this CPU runs: what every row count takes until measured routes are set. AMX is
 * not among them: its tiles pay only from some row count on, which only a measurement finds. */
static int vector_default(void) {
    int path = INT8_VNNI;
    while (!q4_i8_supported(path)) path--;
    return path;
}

/* Route every row count of every kernel to `path` (-1: vector_default); returns the path, or -1 (and nothing
 * changes) when the CPU cannot run `path`. */
int q4_i8_select(int64_t path) {
    if (path < 0) path = vector_default();
    else if (path >= INT8_PATHS || !q4_i8_supported(path)) return -1;
    memset(routes, (int)path, sizeof routes);
    for (int kernel = 0; kernel < INT8_KERNELS; kernel++)
        if (!has_amx(kernel) && (path == INT8_AMX || path == INT8_AMX_EMULATED))
            memset(routes[kernel], INT8_VNNI, sizeof routes[kernel]);
    routes_ready = 1;
    return (int)path;
}

/* Route `kernel`'s calls of r rows (1 <= r <= n) to paths[r - 1] and larger ones to paths[n - 1]. Returns 0,
 * or -1 (and nothing changes) for an unknown kernel, n outside 1..INT8_ROUTE_ROWS, a path the CPU cannot run
 * or an AMX path for a kernel without one. */
int int8_route_set(int64_t kernel, const int64_t *paths, int64_t n) {
    if (kernel < 0 || kernel >= INT8_KERNELS || n < 1 || n > INT8_ROUTE_ROWS) return -1;
    for (int64_t r = 0; r < n; r++) {
        if (paths[r] < 0 || paths[r] >= INT8_PATHS || !q4_i8_supported(paths[r])) return -1;
        if (!has_amx(kernel) && (paths[r] == INT8_AMX || paths[r] == INT8_AMX_EMULATED)) return -1;
    }
    if (!routes_ready) q4_i8_select(-1);
    for (int64_t r = 0; r < INT8_ROUTE_ROWS; r++) routes[kernel][r] = (signed char)paths[r < n ? r : n - 1];
    return 0;
}

int int8_path_for(int kernel, int64_t rows) {
    if (!routes_ready) q4_i8_select(-1);
    const int64_t r = rows < 1 ? 1 : rows > INT8_ROUTE_ROWS ? INT8_ROUTE_ROWS : rows;
    const int path = routes[kernel][r - 1];
    __atomic_fetch_add(&route_calls[kernel][path], 1, __ATOMIC_RELAXED);
    return path;
}

/* The path `kernel`'s calls of `rows` rows take now (not counted), or -1 for an unknown kernel. */
int int8_route_get(int64_t kernel, int64_t rows) {
    if (kernel < 0 || kernel >= INT8_KERNELS) return -1;
    if (!routes_ready) q4_i8_select(-1);
    return routes[kernel][(rows < 1 ? 1 : rows > INT8_ROUTE_ROWS ? INT8_ROUTE_ROWS : rows) - 1];
}

/* How many calls of `kernel` took `path` since the library loaded (tests check the routing with it). */
int64_t int8_route_calls(int64_t kernel, int64_t path) {
    if (kernel < 0 || kernel >= INT8_KERNELS || path < 0 || path >= INT8_PATHS) return -1;
    return __atomic_load_n(&route_calls[kernel][path], __ATOMIC_RELAXED);
}

/* x [M, K] -> per row and group of 32 the int8 digits, q[2mK .. 2mK + K) (hi) and q[2mK + K .. 2mK + 2K) (lo,
 * zeros with one digit), the unit u = d / 256 [M, K / 32] and u * sum(256 hi + lo), with `path`'s
 * instructions. */
static void quantize_rows(int path, const float *x, int64_t M, int64_t K, int8_t *q, float *unit, float *usum,
                          int digits) {
#if defined(Q4_X86)
    if (path == INT8_VNNI || path == INT8_AMX || path == INT8_AMX_EMULATED)
        return quantize_rows_vnni(x, M, K, q, unit, usum, digits);
    if (path == INT8_AVX2) return quantize_rows_avx2(x, M, K, q, unit, usum, digits);
#endif
    quantize_rows_portable(x, M, K, q, unit, usum, digits);
}

/* quantize_rows for the other int8 GEMMs (gemm_q8_i8.c), whose every path takes the same digits. */
void int8_quantize_rows(int64_t path, const float *x, int64_t M, int64_t K, int8_t *q, float *unit, float *usum,
                        int64_t digits) {
    quantize_rows((int)path, x, M, K, q, unit, usum, (int)digits);
}

/* x: [M, K] fp32 (K a multiple of 32); packed: WEIGHT_Q4_I8 records, plain (supers 0) or in super-blocks of
 * `supers` groups (gemm_common.h's group_record); bias: [N] or NULL; y: [M, N]; digits: 2 (x to ~15 bits) or 1 (8
 * bits: half the dot products). Returns 0, or 1 when the activations' buffer cannot be allocated, digits is
 * neither, or the groups are not whole super-blocks. */
int gemm_q4_i8(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t K, int64_t N,
               int64_t digits, int64_t supers) {
    if ((digits != 1 && digits != 2) || supers < 0 || (supers & (supers - 1)) || (supers && (K / QGROUP) % supers))
        return 1;
    const int path = int8_path_for(INT8_GEMM, M);
    const int64_t ng = K / QGROUP;
#if defined(Q4_X86)
    /* AMX: the digits padded with zero rows to whole tiles (from 16 rows on), and each thread's accumulators */
    const int amx = path == INT8_AMX || path == INT8_AMX_EMULATED;
    const int64_t rows = amx ? amx_rows(M) : M;
    const int64_t acc_floats = amx ? omp_get_max_threads() * rows * BLOCK : 0;
#else
    const int64_t rows = M, acc_floats = 0;
#endif
    /* one buffer: the digits, the accumulators (both in whole cache lines), the units and their sums */
    const int64_t digits_bytes = (2 * rows * K + 63) & ~(int64_t)63;
    const int64_t bytes = (digits_bytes + (acc_floats + 2 * M * ng) * (int64_t)sizeof(float) + 63) & ~(int64_t)63;
    int8_t *xq = aligned_alloc(64, bytes);
    if (!xq) return 1;
    float *acc = (float *)(xq + digits_bytes), *xu = acc + acc_floats, *xs = xu + M * ng;
    memset(xq + 2 * M * K, 0, 2 * (rows - M) * K);
    quantize_rows(path, x, M, K, xq, xu, xs, (int)digits);
    const int s = (int)supers;
    switch (path) {
#if defined(Q4_X86)
#if INT8_AMX_BUILT
        case INT8_AMX: gemm_blocks_amx(xq, xu, xs, packed, bias, y, M, K, N, acc, (int)digits, s); break;
#endif
        case INT8_AMX_EMULATED:
            gemm_blocks_amx_emulated(xq, xu, xs, packed, bias, y, M, K, N, acc, (int)digits, s);
            break;
        case INT8_VNNI: gemm_blocks_vnni(xq, xu, xs, packed, bias, y, M, K, N, (int)digits, s); break;
        case INT8_AVX2: gemm_blocks_avx2(xq, xu, xs, packed, bias, y, M, K, N, (int)digits, s); break;
#endif
        default: gemm_blocks_portable(xq, xu, xs, packed, bias, y, M, K, N, (int)digits, s); break;
    }
    free(xq);
    return 0;
}

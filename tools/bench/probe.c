/*
 * bench/probe.c - the probes of bench/probe.h. Each is written so no compiler can
 * shortcut it: sums into four independent vectors, FMA chains whose results are
 * kept, a naive decode whose output is used. Wider variants are compiled with
 * target attributes and chosen at run time by __builtin_cpu_supports.
 */
#include "bench/probe.h"
#include "common/cli.h"

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define BENCH_X86 1
#else
#define BENCH_X86 0
#endif
#if defined(__aarch64__)
#include <arm_neon.h> /* Advanced SIMD: every AArch64 CPU has it */
#include <sys/auxv.h>
#define BENCH_ARM 1
#else
#define BENCH_ARM 0
#endif

/* ---- small helpers --------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double bench_median(double *v, uint32_t n)
{
    if (n == 0)
        return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dull;
}

void bench_fill_uniform(uint64_t *s, float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((double)(rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* Run fn(ctx, t, n) on n threads (t = 0 on the caller); seconds from start to join. */

typedef struct {
    bench_team_fn fn;
    void *ctx;
    uint32_t t, n;
} team_arg;

static void *team_main(void *p)
{
    team_arg *a = p;
    a->fn(a->ctx, a->t, a->n);
    return NULL;
}

double bench_team_run(uint32_t n, bench_team_fn fn, void *ctx)
{
    pthread_t th[BENCH_MAX_THREADS];
    team_arg args[BENCH_MAX_THREADS];
    uint32_t started = 1;
    const double t0 = cli_now();
    for (uint32_t t = 1; t < n; t++) {
        args[t] = (team_arg){fn, ctx, t, n};
        if (pthread_create(&th[t], NULL, team_main, &args[t]) != 0)
            break; /* fewer threads: the caller does the rest below */
        started++;
    }
    for (uint32_t t = started; t < n; t++)
        fn(ctx, t, n);
    fn(ctx, 0, n);
    for (uint32_t t = 1; t < started; t++)
        pthread_join(th[t], NULL);
    return cli_now() - t0;
}

/* ---- DRAM read bandwidth: a vectorized sum ----------------------------------------- */

/* 8 x uint32: SSE2 pairs by default, one AVX2 register under target("avx2"). */




/* Four independent vector sums, written so that no compiler can keep it scalar. */
static inline __attribute__((always_inline)) uint32_t sum_body(const bench_vec *p, size_t n)
{
    bench_vec a = {0}, b = {0}, c = {0}, d = {0};
    for (size_t i = 0; i < n; i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
    }
    a += b + c + d;
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

#if BENCH_X86
__attribute__((target("avx2"))) static uint32_t sum_avx2(const bench_vec *p, size_t n)
{
    return sum_body(p, n);
}
#endif

static uint32_t sum_default(const bench_vec *p, size_t n)
{
    return sum_body(p, n);
}

static void bw_part(void *ctx, uint32_t t, uint32_t n)
{
    bench_bw *j = ctx;
    const size_t per = j->vecs / n / 4 * 4;
#if BENCH_X86
    if (__builtin_cpu_supports("avx2")) {
        j->sink[t] = sum_avx2(j->buf + (size_t)t * per, per);
        return;
    }
#endif
    j->sink[t] = sum_default(j->buf + (size_t)t * per, per);
}

/* GB/s of one sum over the buffer with n threads */
double bench_bw_measure(bench_bw *j, uint32_t n)
{
    const double s = bench_team_run(n, bw_part, j);
    return (double)(j->vecs / n / 4 * 4) * n * sizeof(bench_vec) / s / 1e9;
}

/* ---- peak FMA rate ------------------------------------------------------------------ */

/* The largest of v[0..n): a peak is the best rate seen; other programs on a shared
 * machine can only lower a run, never raise it (a median would report their load). */
static double best_of(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    return m;
}

typedef struct {
    uint64_t iters;
    float sink[BENCH_MAX_THREADS];
    uint32_t lanes, chains;
} fma_job;

#if BENCH_X86
__attribute__((target("avx512f"))) static float fma_avx512(uint64_t iters)
{
    __m512 a[12];
    for (int i = 0; i < 12; i++)
        a[i] = _mm512_set1_ps(1.0f + (float)i * 1e-3f);
    const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    for (uint64_t k = 0; k < iters; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = _mm512_fmadd_ps(a[i], b, c);
    }
    __m512 s = a[0];
    for (int i = 1; i < 12; i++)
        s = _mm512_add_ps(s, a[i]);
    return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static float fma_avx2(uint64_t iters)
{
    __m256 a[12];
    for (int i = 0; i < 12; i++)
        a[i] = _mm256_set1_ps(1.0f + (float)i * 1e-3f);
    const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    for (uint64_t k = 0; k < iters; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = _mm256_fmadd_ps(a[i], b, c);
    }
    __m256 s = a[0];
    for (int i = 1; i < 12; i++)
        s = _mm256_add_ps(s, a[i]);
    float w[8];
    _mm256_storeu_ps(w, s);
    return w[0] + w[1] + w[2] + w[3] + w[4] + w[5] + w[6] + w[7];
}
#endif

#if BENCH_ARM
/* 16 chains, not 12: cores with four 128-bit FMA pipes of latency 4 (Neoverse V1/V2,
 * Apple's) need 16 in flight; the 32 vector registers hold them. */
enum { NEON_FMA_CHAINS = 16 };

static float fma_neon(uint64_t iters)
{
    float32x4_t a[NEON_FMA_CHAINS];
    for (int i = 0; i < NEON_FMA_CHAINS; i++)
        a[i] = vdupq_n_f32(1.0f + (float)i * 1e-3f);
    const float32x4_t b = vdupq_n_f32(0.9999f), c = vdupq_n_f32(1e-4f);
    for (uint64_t k = 0; k < iters; k++) {
#pragma GCC unroll 16
        for (int i = 0; i < NEON_FMA_CHAINS; i++)
            a[i] = vfmaq_f32(c, a[i], b);
    }
    float32x4_t s = a[0];
    for (int i = 1; i < NEON_FMA_CHAINS; i++)
        s = vaddq_f32(s, a[i]);
    return vaddvq_f32(s);
}
#endif

/* The host's widest FMA: 16 lanes with AVX-512, 8 with AVX2 + FMA, 4 with NEON (every
 * aarch64 CPU), 1 (unknown). */
static uint32_t host_fma_lanes(void)
{
#if BENCH_X86
    if (__builtin_cpu_supports("avx512f"))
        return 16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 8;
#endif
#if BENCH_ARM
    return 4;
#endif
    return 1; /* unknown */
}

uint32_t bench_fma_lanes(const char *isa)
{
    const uint32_t host = host_fma_lanes();
    if (isa && strncmp(isa, "avx512", 6) == 0 && host >= 16)
        return 16;
    if (isa && strncmp(isa, "avx2", 4) == 0 && host >= 8) /* avx2, avx2vnni */
        return 8;
    return host;
}

static void fma_part(void *ctx, uint32_t t, uint32_t n)
{
    (void)n;
    fma_job *j = ctx;
#if BENCH_X86
    if (j->lanes == 16) {
        j->sink[t] = fma_avx512(j->iters);
        return;
    }
    if (j->lanes == 8) {
        j->sink[t] = fma_avx2(j->iters);
        return;
    }
#endif
#if BENCH_ARM
    if (j->lanes == 4) {
        j->sink[t] = fma_neon(j->iters);
        return;
    }
#endif
    j->sink[t] = 0; /* no vector FMA known here: the peak is reported as unknown */
}

/* GFLOP/s over n threads: chains x lanes x 2 FLOPs per iteration per thread. */
double bench_fma_peak(uint32_t n, const char *isa)
{
    fma_job j;
    j.lanes = bench_fma_lanes(isa);
    j.chains = 12;
#if BENCH_ARM
    j.chains = NEON_FMA_CHAINS;
#endif
    j.iters = 4000000;
    if (j.lanes == 1)
        return NAN;
    double v[5];
    for (int r = 0; r < 5; r++) {
        const double s = bench_team_run(n, fma_part, &j);
        v[r] = (double)j.iters * j.chains * j.lanes * 2 * n / s / 1e9;
    }
    return best_of(v, 5);
}

/* ---- peak int8 dot-product rate ---------------------------------------------------- */

/* 4 streams; each round of a stream multiplies and adds W bytes (W = 32 or 64; VNNI:
 * two instructions of 64, or of 32 for AVX-VNNI). The empty asm keeps each stream's
 * input "changed", so no compiler hoists the products out of the loop; the
 * accumulators are the only loop-carried dependence. */
#define INT8_STREAMS 4

typedef struct {
    uint64_t iters;
    int32_t sink[BENCH_MAX_THREADS];
    int kind;       /* 0 none, 1 avx2, 2 avx512bw, 3 avx512 vnni, 4 avx-vnni (ymm),
                     * 5 neon sdot, 6 neon (widening multiplies) */
} int8_job;

#if BENCH_X86 || BENCH_ARM
/* What the int8 probes return to keep their work alive: the sum of n lanes in
 * unsigned arithmetic. The lanes have wrapped long before (vector adds wrap, defined),
 * so a signed sum would overflow: undefined behaviour, which UBSan reported (with
 * _mm512_reduce_add_epi32, whose last step is a plain int addition). */
static int32_t int8_sink(const int32_t *w, int n)
{
    uint32_t s = 0;
    for (int i = 0; i < n; i++)
        s += (uint32_t)w[i];
    return (int32_t)(s & 0x7fffffffu);
}

/* One round of the four streams; S(i) is stream i's multiply-add into acc i. The
 * accumulators are named variables, not an array, so that they stay in registers. */
#define INT8_ROUND(S) do { S(0); S(1); S(2); S(3); } while (0)
#endif

#if BENCH_ARM
/* SDOT (the neon_dotprod kernels' block sums): two chains per stream, 16 bytes each. */
__attribute__((target("arch=armv8.2-a+dotprod"))) static int32_t int8_sdot(uint64_t iters)
{
    const int8x16_t b = vdupq_n_s8(3);
    int8x16_t x0 = vdupq_n_s8(1), x1 = vdupq_n_s8(2), x2 = vdupq_n_s8(3), x3 = vdupq_n_s8(4);
    int32x4_t a0 = vdupq_n_s32(0), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
#define S(i)                                                                                \
    a##i = vdotq_s32(a##i, x##i, b);                                                        \
    c##i = vdotq_s32(c##i, x##i, b);                                                        \
    __asm__ volatile("" : "+w"(x##i))
    for (uint64_t k = 0; k < iters; k++)
        INT8_ROUND(S);
#undef S
    int32_t w[4];
    vst1q_s32(w, vaddq_s32(vaddq_s32(vaddq_s32(a0, a1), vaddq_s32(a2, a3)),
                           vaddq_s32(vaddq_s32(c0, c1), vaddq_s32(c2, c3))));
    return int8_sink(w, 4);
}

/* The neon kernels' block sums without SDOT: SMULL + SMLAL2 (16 bytes into int16
 * pairs), SADALP into int32. */
static int32_t int8_neon(uint64_t iters)
{
    const int8x16_t b = vdupq_n_s8(3);
    int8x16_t x0 = vdupq_n_s8(1), x1 = vdupq_n_s8(2), x2 = vdupq_n_s8(3), x3 = vdupq_n_s8(4);
    int32x4_t a0 = vdupq_n_s32(0), a1 = a0, a2 = a0, a3 = a0;
#define S(i)                                                                                \
    a##i = vpadalq_s16(a##i, vmlal_high_s8(vmull_s8(vget_low_s8(x##i), vget_low_s8(b)),     \
                                           x##i, b));                                       \
    __asm__ volatile("" : "+w"(x##i))
    for (uint64_t k = 0; k < iters; k++)
        INT8_ROUND(S);
#undef S
    int32_t w[4];
    vst1q_s32(w, vaddq_s32(vaddq_s32(a0, a1), vaddq_s32(a2, a3)));
    return int8_sink(w, 4);
}

/* AT_HWCAP's ASIMDDP bit (the aarch64 Linux ABI, asm/hwcap.h). */
static bool host_asimddp(void)
{
    return (getauxval(AT_HWCAP) >> 20) & 1u;
}
#endif

#if BENCH_X86
__attribute__((target("avx2"))) static int32_t int8_avx2(uint64_t iters)
{
    const __m256i b = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    __m256i x0 = _mm256_set1_epi8(1), x1 = _mm256_set1_epi8(2), x2 = _mm256_set1_epi8(3),
            x3 = _mm256_set1_epi8(4);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#define S(i)                                                                                \
    a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(_mm256_maddubs_epi16(x##i, b), ones));  \
    __asm__ volatile("" : "+x"(x##i))
    for (uint64_t k = 0; k < iters; k++)
        INT8_ROUND(S);
#undef S
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
    int32_t w[8];
    _mm256_storeu_si256((__m256i *)w, s);
    return int8_sink(w, 8);
}

__attribute__((target("avx512f,avx512bw"))) static int32_t int8_avx512bw(uint64_t iters)
{
    const __m512i b = _mm512_set1_epi8(3), ones = _mm512_set1_epi16(1);
    __m512i x0 = _mm512_set1_epi8(1), x1 = _mm512_set1_epi8(2), x2 = _mm512_set1_epi8(3),
            x3 = _mm512_set1_epi8(4);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
#define S(i)                                                                                \
    a##i = _mm512_add_epi32(a##i, _mm512_madd_epi16(_mm512_maddubs_epi16(x##i, b), ones));  \
    __asm__ volatile("" : "+v"(x##i))
    for (uint64_t k = 0; k < iters; k++)
        INT8_ROUND(S);
#undef S
    int32_t w[16];
    _mm512_storeu_si512(w, _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
    return int8_sink(w, 16);
}

__attribute__((target("avx512f,avx512vnni"))) static int32_t int8_vnni(uint64_t iters)
{
    const __m512i b = _mm512_set1_epi8(3);
    __m512i x0 = _mm512_set1_epi8(1), x1 = _mm512_set1_epi8(2), x2 = _mm512_set1_epi8(3),
            x3 = _mm512_set1_epi8(4);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    /* vpdpbusd's accumulator is its input: four chains of its latency (5) would not
     * keep two ports busy, so each stream has two accumulators */
    __m512i c0 = a0, c1 = a0, c2 = a0, c3 = a0;
#define S(i)                                                                                \
    a##i = _mm512_dpbusd_epi32(a##i, x##i, b);                                              \
    c##i = _mm512_dpbusd_epi32(c##i, x##i, b);                                              \
    __asm__ volatile("" : "+v"(x##i))
    for (uint64_t k = 0; k < iters; k++)
        INT8_ROUND(S);
#undef S
    const __m512i s = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    const __m512i t = _mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3));
    int32_t w[16];
    _mm512_storeu_si512(w, _mm512_add_epi32(s, t));
    return int8_sink(w, 16);
}

/* AVX-VNNI's vpdpbusd on ymm: the avx2vnni kernels' int8 dot. Two chains per stream,
 * as int8_vnni. */
__attribute__((target("avx2,avxvnni"))) static int32_t int8_avxvnni(uint64_t iters)
{
    const __m256i b = _mm256_set1_epi8(3);
    __m256i x0 = _mm256_set1_epi8(1), x1 = _mm256_set1_epi8(2), x2 = _mm256_set1_epi8(3),
            x3 = _mm256_set1_epi8(4);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i c0 = a0, c1 = a0, c2 = a0, c3 = a0;
#define S(i)                                                                                \
    a##i = _mm256_dpbusd_avx_epi32(a##i, x##i, b);                                          \
    c##i = _mm256_dpbusd_avx_epi32(c##i, x##i, b);                                          \
    __asm__ volatile("" : "+x"(x##i))
    for (uint64_t k = 0; k < iters; k++)
        INT8_ROUND(S);
#undef S
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3));
    int32_t w[8];
    _mm256_storeu_si256((__m256i *)w, _mm256_add_epi32(s, t));
    return int8_sink(w, 8);
}

/* AVX-VNNI: cpuid leaf 7 subleaf 1, EAX bit 4 (gcc's and clang's __builtin_cpu_supports
 * do not all know it); its YMM state is AVX2's. */
static bool host_avxvnni(void)
{
    uint32_t a, b, c, d;
    if (!__builtin_cpu_supports("avx2") || __get_cpuid_max(0, NULL) < 7)
        return false;
    __cpuid_count(7, 0, a, b, c, d);
    if (a < 1)
        return false;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 4) & 1u;
}
#endif

/* Whether the host runs int8 dot kind k (int8_job.kind). */
static bool host_int8_has(int k)
{
#if BENCH_X86
    switch (k) {
    case 1:
        return __builtin_cpu_supports("avx2");
    case 2:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case 3:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
    case 4:
        return host_avxvnni();
    }
#endif
#if BENCH_ARM
    if (k == 5)
        return host_asimddp();
    if (k == 6)
        return true;
#endif
    (void)k;
    return false;
}

/* The host's widest int8 dot: AVX-512 VNNI, AVX-512 BW, AVX-VNNI, AVX2, NEON SDOT,
 * NEON, or 0 none. */
static int host_int8_kind(void)
{
    static const int widest_first[] = {3, 2, 4, 1, 5, 6};
    for (size_t i = 0; i < sizeof widest_first / sizeof widest_first[0]; i++)
        if (host_int8_has(widest_first[i]))
            return widest_first[i];
    return 0;
}

/* The int8 dot of the kernels named isa (as pkv_stats.isa names them), where the host
 * has it; the host's widest otherwise. */
static int int8_kind(const char *isa)
{
    const int want = !isa                           ? 0
                     : strcmp(isa, "avx512vnni") == 0 ? 3
                     : strcmp(isa, "avx512") == 0     ? 2
                     : strcmp(isa, "avx2vnni") == 0   ? 4
                     : strcmp(isa, "avx2") == 0       ? 1
                     : strcmp(isa, "neon_dotprod") == 0 ? 5
                     : strcmp(isa, "neon") == 0       ? 6
                                                      : 0;
    return want && host_int8_has(want) ? want : host_int8_kind();
}

const char *bench_int8_kind(const char *isa)
{
    static const char *const names[] = {"none",     "avx2",      "avx512bw", "avx512-vnni",
                                        "avx-vnni", "neon-sdot", "neon"};
    return names[int8_kind(isa)];
}

static void int8_part(void *ctx, uint32_t t, uint32_t n)
{
    (void)n;
    int8_job *j = ctx;
    j->sink[t] = 0;
#if BENCH_X86
    if (j->kind == 4)
        j->sink[t] = int8_avxvnni(j->iters);
    else if (j->kind == 3)
        j->sink[t] = int8_vnni(j->iters);
    else if (j->kind == 2)
        j->sink[t] = int8_avx512bw(j->iters);
    else if (j->kind == 1)
        j->sink[t] = int8_avx2(j->iters);
#endif
#if BENCH_ARM
    if (j->kind == 5)
        j->sink[t] = int8_sdot(j->iters);
    else if (j->kind == 6)
        j->sink[t] = int8_neon(j->iters);
#endif
}

/* GOP/s over n threads: streams x bytes x 2 operations per iteration per thread. */
double bench_int8_peak(uint32_t n, const char *isa)
{
    int8_job j;
    j.kind = int8_kind(isa);
    j.iters = 4000000;
    if (j.kind == 0)
        return NAN;
    /* bytes a stream multiplies and adds per round */
    const double bytes = j.kind == 6   ? 16.0
                         : j.kind == 1 || j.kind == 5 ? 32.0
                         : j.kind == 2 || j.kind == 4 ? 64.0
                                                      : 128.0;
    double v[5];
    for (int r = 0; r < 5; r++) {
        const double s = bench_team_run(n, int8_part, &j);
        v[r] = (double)j.iters * INT8_STREAMS * bytes * 2 * n / s / 1e9;
    }
    return best_of(v, 5);
}

/* ---- naive decode ------------------------------------------------------------------- */



/* The textbook loop: for each head, all scores, max, exp and sum, weighted sum. */
void bench_naive_part(void *ctx, uint32_t t, uint32_t nt)
{
    bench_naive *j = ctx;
    const uint32_t d = j->d, hg = j->h / j->g;
    float *att = j->scores[t];
    for (uint32_t i = t; i < j->h; i += nt) {
        const float *q = j->q + (size_t)i * d;
        const uint32_t grp = i / hg;
        float mx = -INFINITY;
        for (uint64_t p = 0; p < j->n; p++) {
            const float *k = j->K + ((size_t)p * j->g + grp) * d;
            float s = 0.0f;
            for (uint32_t c = 0; c < d; c++)
                s += q[c] * k[c];
            att[p] = s * j->scale;
            if (att[p] > mx)
                mx = att[p];
        }
        float sum = 0.0f;
        for (uint64_t p = 0; p < j->n; p++) {
            att[p] = expf(att[p] - mx);
            sum += att[p];
        }
        float *o = j->out + (size_t)i * d;
        for (uint32_t c = 0; c < d; c++)
            o[c] = 0.0f;
        for (uint64_t p = 0; p < j->n; p++) {
            const float *v = j->V + ((size_t)p * j->g + grp) * d;
            const float w = att[p] / sum;
            for (uint32_t c = 0; c < d; c++)
                o[c] += w * v[c];
        }
    }
}

/* The first word of cpu0's cache index i attribute `name` (sysfs) into buf; false when
 * the file is missing or empty. */
static bool cache_attr(unsigned i, const char *name, char buf[32])
{
    char path[96];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%u/%s", i, name);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    const bool ok = fscanf(f, "%31s", buf) == 1;
    fclose(f);
    return ok;
}

uint64_t bench_llc_bytes(void)
{
    uint64_t best = 0;
    unsigned long best_level = 0;
    char level[32], type[32], size[32];
    for (unsigned i = 0; cache_attr(i, "level", level); i++) {
        if (!cache_attr(i, "type", type) || strcmp(type, "Instruction") == 0 ||
            !cache_attr(i, "size", size))
            continue;
        char *unit;
        const unsigned long lv = strtoul(level, NULL, 10);
        const unsigned long long n = strtoull(size, &unit, 10);
        if (lv < best_level)
            continue;
        best = *unit == 'K' ? n << 10 : *unit == 'M' ? n << 20 : *unit == 'G' ? n << 30 : n;
        best_level = lv;
    }
    return best;
}

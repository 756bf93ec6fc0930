/*
 * bench_probe.c - the probes of bench_probe.h. Each is written so no compiler can
 * shortcut it: sums into four independent vectors, FMA chains whose results are
 * kept, a naive decode whose output is used. Wider variants are compiled with
 * target attributes and chosen at run time by __builtin_cpu_supports.
 */
#include "bench_probe.h"
#include "cli.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BENCH_X86 1
#else
#define BENCH_X86 0
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

typedef struct {
    uint64_t iters;
    float sink[BENCH_MAX_THREADS];
    uint32_t lanes;
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

uint32_t bench_fma_lanes(void)
{
#if BENCH_X86
    if (__builtin_cpu_supports("avx512f"))
        return 16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 8;
#endif
    return 1; /* unknown */
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
    j->sink[t] = 0; /* no vector FMA known here: the peak is reported as unknown */
}

/* GFLOP/s over n threads: 12 chains x lanes x 2 FLOPs per iteration per thread. */
double bench_fma_peak(uint32_t n)
{
    fma_job j;
    j.lanes = bench_fma_lanes();
    j.iters = 4000000;
    if (j.lanes == 1)
        return NAN;
    double v[5];
    for (int r = 0; r < 5; r++) {
        const double s = bench_team_run(n, fma_part, &j);
        v[r] = (double)j.iters * 12 * j.lanes * 2 * n / s / 1e9;
    }
    return bench_median(v, 5);
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

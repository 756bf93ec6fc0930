/*
 * probe_tile.c - the parts of one tile of SIMD decode, timed apart, in L1
 * (docs/performance.md, "One tile in L1").
 *
 * One KV group's tile of 16 tokens and 4 query heads (a llama3-8b group), K and V rows
 * stored in each dtype, is scored (qk_heads), softmaxed (softmax_tile) and summed into
 * the heads' outputs (pv_heads), over and over, from L1: the kernel's own functions,
 * compiled into this probe from src/kernels/avx512.c (probe_tile) or src/kernels/avx2.c
 * (probe_tile_avx2, built with PROBE_AVX2). Printed per dtype: ns per tile of
 * QK alone, PV alone, the softmax alone, and of the three pipelined as the walk
 * (walk.h) runs them: QK(k), PV(k-1), softmax(k); and ns per position and KV group of
 * the pipelined step against the FMAs' own time at the given peak, if one is given
 * (`pagedkv bench` prints it; 2 x 4 x head_dim FMAs of one lane per position and group:
 * QK and PV, 4 heads). No page walk, prefetch or DRAM: what the arithmetic costs once
 * the data is there.
 *
 * For f32, f16 and bf16 it also times a QK the kernels do not have: K stored by channel
 * (the tile's 16 values of channel c contiguous, [head_dim][16]), so that one vector
 * load holds 8 or 16 tokens of one channel and each head's q value is broadcast to it:
 * the scores build up in the tokens' lanes and no reduction across lanes is left. The
 * columns `qk kt` and `pipe kt` are that QK alone and pipelined with the same PV and
 * softmax; the probe checks its scores against qk_heads' first. It measures what a page
 * layout with K by channel would buy, before anyone builds one.
 *
 * A development probe, built with -Dprobes=true on x86-64, never installed.
 *
 * usage: probe_tile | probe_tile_avx2 [head_dim (32..512, a multiple of 32; 128)]
 *        [peak GFLOP/s (0)]
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#ifndef PROBE_AVX2
#define PROBE_AVX2 0
#endif
#if PROBE_AVX2
#include "kernels/avx2.c"

#include <cpuid.h>
#else
#include "kernels/avx512.c"
#endif

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef PKVI_WALK_PERMUTED_BF16
#define PERMUTED_BF16 1
#else
#define PERMUTED_BF16 0
#endif
#ifdef PKVI_WALK_PERMUTED_Q4
#define PERMUTED_Q4 1
#else
#define PERMUTED_Q4 0
#endif

enum { T = PKVI_TILE, HB = 4, MAX_D = 512, REPS = 7 };

/* Unscaled scores of HB heads (q rows qh in row order, stride d) with a tile of 16
 * tokens whose K is stored by channel (kt: [d][16] values of dt), into s [HB][16]. Each
 * head's dot runs over the channels in order; the AVX-512 form keeps 4 partial sums per
 * head (channels c % 4, added at the end) so that 16 independent FMA chains are in
 * flight, the AVX2 form has 8 (4 heads x two 8-token halves). */
#if PROBE_AVX2
AI void qk_heads_kt(pkv_dtype dt, const void *kt, uint32_t d, const float *qh, float *s)
{
    __m256 a[HB][2];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        a[h][0] = a[h][1] = _mm256_setzero_ps();
    for (uint32_t c = 0; c < d; c++) {
        const __m256 k0 = ld(dt, kt, (size_t)c * T), k1 = ld(dt, kt, (size_t)c * T + 8);
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const __m256 qb = _mm256_broadcast_ss(qh + (size_t)h * d + c);
            a[h][0] = _mm256_fmadd_ps(qb, k0, a[h][0]);
            a[h][1] = _mm256_fmadd_ps(qb, k1, a[h][1]);
        }
    }
    PKVI_UNROLL
    for (int h = 0; h < HB; h++) {
        _mm256_storeu_ps(s + h * T, a[h][0]);
        _mm256_storeu_ps(s + h * T + 8, a[h][1]);
    }
}
#else
AI void qk_heads_kt(pkv_dtype dt, const void *kt, uint32_t d, const float *qh, float *s)
{
    __m512 a[HB][4];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        a[h][0] = a[h][1] = a[h][2] = a[h][3] = _mm512_setzero_ps();
    for (uint32_t c = 0; c < d; c += 4)
        PKVI_UNROLL
        for (int j = 0; j < 4; j++) {
            const __m512 k = ld(dt, kt, (size_t)(c + j) * T);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h][j] = _mm512_fmadd_ps(_mm512_set1_ps(qh[(size_t)h * d + c + j]), k, a[h][j]);
        }
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        _mm512_storeu_ps(s + h * T, _mm512_add_ps(_mm512_add_ps(a[h][0], a[h][1]),
                                                  _mm512_add_ps(a[h][2], a[h][3])));
}
#endif

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* x[0..n) = a fixed pattern in [-1, 1), one per seed */
static void fill(float *x, size_t n, uint32_t seed)
{
    uint32_t s = seed;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)(s >> 8) / 8388608.0f - 1.0f;
    }
}

typedef struct {
    pkv_dtype dt;
    uint32_t d;
    size_t row;
    _Alignas(64) char k[T * MAX_D * 4], v[T * MAX_D * 4];
    _Alignas(64) char kt[T * MAX_D * 4]; /* f32/f16/bf16: K by channel, [d][T] */
    _Alignas(64) float q[HB * MAX_D], acc[HB * MAX_D], s[2][HB * T];
    _Alignas(64) float qrow[HB * MAX_D]; /* q in row order: what qk_heads_kt reads */
    float m[HB], l[HB], alpha[2][HB];
} bench;

static void setup(bench *b, pkv_dtype dt, uint32_t d)
{
    float row[MAX_D];
    b->dt = dt;
    b->d = d;
    b->row = row_bytes_of(dt, d);
    for (uint32_t t = 0; t < T; t++) {
        fill(row, d, 1 + t);
        store_row(dt, b->k + t * b->row, row, d);
        if (!QTYPE(dt)) { /* the same stored values, channel by channel */
            const size_t es = pkv_dtype_size(dt);
            for (uint32_t c = 0; c < d; c++)
                memcpy(b->kt + ((size_t)c * T + t) * es, b->k + t * b->row + c * es, es);
        }
        fill(row, d, 101 + t);
        store_row(dt, b->v + t * b->row, row, d);
    }
    /* q in the order this dtype's QK reads it, as attend_prep gives it: permuted for
     * the dtypes whose walk prepares q (bf16 in avx2.c, Q4 in avx512.c), else as is */
    for (int h = 0; h < HB; h++) {
        fill(row, d, 7 + (uint32_t)h);
        if ((dt == PKV_BF16 && PERMUTED_BF16) || (dt == PKV_Q4 && PERMUTED_Q4))
            q_permute(dt, row, b->q + (size_t)h * d, d);
        else
            memcpy(b->q + (size_t)h * d, row, d * sizeof(float));
        memcpy(b->qrow + (size_t)h * d, row, d * sizeof(float));
    }
    memset(b->acc, 0, sizeof b->acc);
    memset(b->s, 0, sizeof b->s);
    for (int h = 0; h < HB; h++) {
        b->m[h] = -INFINITY;
        b->l[h] = 0.0f;
        b->alpha[0][h] = b->alpha[1][h] = 1.0f;
    }
}

/* Largest |difference| of qk_heads_kt's scores from qk_heads', over the largest score:
 * the two sum the same products in different orders, so a few ulp of the sums. */
static double kt_check(bench *b)
{
    _Alignas(64) float s0[HB * T], s1[HB * T];
    qk_heads(b->dt, b->k, b->row, b->d, T, b->q, s0, NULL, false, HB);
    qk_heads_kt(b->dt, b->kt, b->d, b->qrow, s1);
    double diff = 0.0, top = 0.0;
    for (int i = 0; i < HB * T; i++) {
        diff = fmax(diff, fabs((double)s0[i] - s1[i]));
        top = fmax(top, fabs((double)s0[i]));
    }
    return diff / top;
}

/* part 0: QK, 1: PV, 2: softmax, 3: the three pipelined; 4, 5: 0 and 3 with
 * qk_heads_kt; ns per tile, best of REPS. dt is a constant in each call (time_part), as
 * in the walk's entry points (walk.h WALK_FN): read at run time, it left the dtype's
 * tests in the loops, and the probe timed code the library does not run
 * (docs/performance.md, "One tile in L1"). */
AI double time_dt(bench *b, const pkv_dtype dt, int part, long iters)
{
    const float scale = 1.0f / sqrtf((float)b->d);
    double best = 1e300;
    for (int r = 0; r < REPS; r++) {
        const double t0 = now_ns();
        for (long i = 0; i < iters; i++) {
            const int cur = (int)(i & 1);
            if (part == 4 || part == 5)
                qk_heads_kt(dt, b->kt, b->d, b->qrow, b->s[cur]);
            if (part == 0 || part == 3)
                qk_heads(dt, b->k, b->row, b->d, T, b->q, b->s[cur], NULL, false, HB);
            if (part == 1 || part == 3 || part == 5)
                pv_heads(dt, b->v, b->d, T, b->s[!cur], b->alpha[!cur], b->acc, NULL, false,
                         HB);
            if (part == 2 || part == 3 || part == 5)
                softmax_tile(HB, T, scale, 0.0f, b->s[cur], b->m, b->l, b->alpha[cur]);
            __asm__ volatile("" ::: "memory"); /* each iteration's stores happen */
        }
        const double ns = (now_ns() - t0) / (double)iters;
        best = ns < best ? ns : best;
        if (part >= 2 && part != 4) /* keep the softmax state finite across reps */
            for (int h = 0; h < HB; h++)
                b->l[h] = 0.0f;
    }
    return best;
}

static double time_part(bench *b, int part, long iters)
{
    switch (b->dt) {
    case PKV_F16: return time_dt(b, PKV_F16, part, iters);
    case PKV_BF16: return time_dt(b, PKV_BF16, part, iters);
    case PKV_F32: return time_dt(b, PKV_F32, part, iters);
    case PKV_Q8: return time_dt(b, PKV_Q8, part, iters);
    case PKV_Q4: return time_dt(b, PKV_Q4, part, iters);
    }
    return 0.0;
}

int main(int argc, char **argv)
{
    const long d = argc > 1 ? strtol(argv[1], NULL, 10) : 128;
    const double peak = argc > 2 ? strtod(argv[2], NULL) : 0.0;
    if (d < 32 || d > MAX_D || d % 32 != 0 || peak < 0.0) {
        fprintf(stderr, "usage: %s [head_dim (32..%d, a multiple of 32)] [peak GFLOP/s]\n",
                PROBE_AVX2 ? "probe_tile_avx2" : "probe_tile", MAX_D);
        return 2;
    }
#if PROBE_AVX2
    const char *self = "probe_tile_avx2", *isa = "AVX2 (avx2.c)";
    unsigned int ax, bx, cx, dx; /* F16C: cpuid 1, ecx bit 29 (clang 14's builtin lacks it) */
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__get_cpuid(1, &ax, &bx, &cx, &dx) || !(cx & (1u << 29))) {
        fprintf(stderr, "%s: this CPU has no AVX2, FMA and F16C: skipped\n", self);
        return 77;
    }
#else
    const char *self = "probe_tile", *isa = "AVX-512 (avx512.c)";
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq")) {
        fprintf(stderr, "%s: this CPU has no AVX-512 (F, BW, VL, DQ): skipped\n", self);
        return 77;
    }
#endif
    static bench b;
    const long iters = 4000000L / d;
    /* flops per position and KV group: QK and PV, 4 heads, d multiply-adds each */
    const double flop = 2.0 * HB * (double)d * 2.0;
    printf("%s: %s, one tile of %u tokens, %d heads, head_dim %ld, in L1; ns, best of %d "
           "runs of %ld tiles\n", self, isa, T, HB, d, REPS, iters);
    printf("dtype |      qk      pv softmax pipelined | per position%s |   qk kt pipe kt%s\n",
           peak > 0 ? "   fma ns  of fma" : "", peak > 0 ? "  of fma" : "");
    const pkv_dtype dts[] = {PKV_F16, PKV_BF16, PKV_F32, PKV_Q8, PKV_Q4};
    const char *names[] = {"f16", "bf16", "f32", "q8", "q4"};
    for (int i = 0; i < 5; i++) {
        setup(&b, dts[i], (uint32_t)d);
        const bool kt = !QTYPE(dts[i]);
        const double kt_err = kt ? kt_check(&b) : 0.0;
        if (kt_err > 1e-5) {
            fprintf(stderr, "%s: %s: scores from K by channel differ by %.3g: a bug\n", self,
                    names[i], kt_err);
            return 1;
        }
        double t[6];
        for (int part = 0; part < (kt ? 6 : 4); part++)
            t[part] = time_part(&b, part, iters);
        printf("%-5s | %7.1f %7.1f %7.1f %9.1f | %12.2f", names[i], t[0], t[1], t[2], t[3],
               t[3] / T);
        if (peak > 0)
            printf(" %8.2f %7.2f", flop / peak, flop / peak / (t[3] / T));
        if (kt) {
            printf(" | %7.1f %7.1f", t[4], t[5]);
            if (peak > 0)
                printf(" %7.2f", flop / peak / (t[5] / T));
        }
        printf("\n");
    }
    return 0;
}

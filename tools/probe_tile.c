/*
 * probe_tile.c - the parts of one tile of AVX-512 decode, timed apart, in L1
 * (docs/numerics.md, "A Zen 5 host").
 *
 * One KV group's tile of 16 tokens and 4 query heads (a llama3-8b group), K and V rows
 * stored in each dtype, is scored (qk_heads), softmaxed (softmax_tile) and summed into
 * the heads' outputs (pv_heads), over and over, from L1: the kernel's own functions,
 * compiled into this probe from src/kernels/avx512.c. Printed per dtype: ns per tile of
 * QK alone, PV alone, the softmax alone, and of the three pipelined as the walk
 * (walk.h) runs them: QK(k), PV(k-1), softmax(k); and ns per position and KV group of
 * the pipelined step against the FMAs' own time at the given peak, if one is given
 * (`pagedkv bench` prints it; 2 x 4 x head_dim / 16 FMAs of 16 lanes per position and
 * group: QK and PV, 4 heads). No page walk, prefetch or DRAM: what the arithmetic costs once the data is
 * there. A development probe, built with -Dprobes=true on x86-64, never installed.
 *
 * usage: probe_tile [head_dim (32..512, a multiple of 32; 128)] [peak GFLOP/s (0)]
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kernels/avx512.c"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { T = PKVI_TILE, HB = 4, MAX_D = 512, REPS = 7 };

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
    _Alignas(64) float q[HB * MAX_D], acc[HB * MAX_D], s[2][HB * T];
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
        fill(row, d, 101 + t);
        store_row(dt, b->v + t * b->row, row, d);
    }
    /* q in the order this dtype's QK reads it, as attend_prep gives it (Q4 permuted) */
    for (int h = 0; h < HB; h++) {
        fill(row, d, 7 + (uint32_t)h);
        q_permute(dt, row, b->q + (size_t)h * d, d);
    }
    memset(b->acc, 0, sizeof b->acc);
    memset(b->s, 0, sizeof b->s);
    for (int h = 0; h < HB; h++) {
        b->m[h] = -INFINITY;
        b->l[h] = 0.0f;
        b->alpha[0][h] = b->alpha[1][h] = 1.0f;
    }
}

/* part 0: QK, 1: PV, 2: softmax, 3: the three pipelined; ns per tile, best of REPS */
static double time_part(bench *b, int part, long iters)
{
    const float scale = 1.0f / sqrtf((float)b->d);
    double best = 1e300;
    for (int r = 0; r < REPS; r++) {
        const double t0 = now_ns();
        for (long i = 0; i < iters; i++) {
            const int cur = (int)(i & 1);
            if (part == 0 || part == 3)
                qk_heads(b->dt, b->k, b->row, b->d, T, b->q, b->s[cur], NULL, false, HB);
            if (part == 1 || part == 3)
                pv_heads(b->dt, b->v, b->d, T, b->s[!cur], b->alpha[!cur], b->acc, NULL, false,
                         HB);
            if (part == 2 || part == 3)
                softmax_tile(HB, T, scale, 0.0f, b->s[cur], b->m, b->l, b->alpha[cur]);
            __asm__ volatile("" ::: "memory"); /* each iteration's stores happen */
        }
        const double ns = (now_ns() - t0) / (double)iters;
        best = ns < best ? ns : best;
        if (part == 2 || part == 3) /* keep the softmax state finite across reps */
            for (int h = 0; h < HB; h++)
                b->l[h] = 0.0f;
    }
    return best;
}

int main(int argc, char **argv)
{
    const long d = argc > 1 ? strtol(argv[1], NULL, 10) : 128;
    const double peak = argc > 2 ? strtod(argv[2], NULL) : 0.0;
    if (d < 32 || d > MAX_D || d % 32 != 0 || peak < 0.0) {
        fprintf(stderr, "usage: probe_tile [head_dim (32..%d, a multiple of 32)] "
                        "[peak GFLOP/s]\n", MAX_D);
        return 2;
    }
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq")) {
        fprintf(stderr, "probe_tile: this CPU has no AVX-512 (F, BW, VL, DQ): skipped\n");
        return 77;
    }
    static bench b;
    const long iters = 4000000L / d;
    /* FMAs of 16 lanes per position and KV group: QK and PV, 4 heads, d / 16 each */
    const double flop = 2.0 * HB * (double)d * 2.0;
    printf("probe_tile: one tile of %u tokens, %d heads, head_dim %ld, in L1; ns, best of %d "
           "runs of %ld tiles\n", T, HB, d, REPS, iters);
    printf("dtype |      qk      pv softmax pipelined | per position%s\n",
           peak > 0 ? "   fma ns  of fma" : "");
    const pkv_dtype dts[] = {PKV_F16, PKV_BF16, PKV_F32, PKV_Q8, PKV_Q4};
    const char *names[] = {"f16", "bf16", "f32", "q8", "q4"};
    for (int i = 0; i < 5; i++) {
        setup(&b, dts[i], (uint32_t)d);
        double t[4];
        for (int part = 0; part < 4; part++)
            t[part] = time_part(&b, part, iters);
        printf("%-5s | %7.1f %7.1f %7.1f %9.1f | %12.2f", names[i], t[0], t[1], t[2], t[3],
               t[3] / T);
        if (peak > 0)
            printf(" %8.2f %7.2f", flop / peak, flop / peak / (t[3] / T));
        printf("\n");
    }
    return 0;
}

/*
 * bench/probe.h - what `pagedkv bench` measures the library against: the DRAM read
 * bandwidth (a vectorized sum), the peak FMA rate (independent FMA chains) and a
 * naive decode (plain loops), each run on a team of threads; plus the small helpers
 * the bench tools share (median, a seeded uniform fill). bench/probe.c has the code.
 */
#ifndef PKV_TOOLS_BENCH_PROBE_H
#define PKV_TOOLS_BENCH_PROBE_H

#include <stddef.h>
#include <stdint.h>

/* Most threads a probe runs on. */
#define BENCH_MAX_THREADS 256u

/* Median of v[0..n) (sorts v); NAN when n == 0. */
double bench_median(double *v, uint32_t n);
/* x[0..n) uniform in [-1, 1) from the xorshift state *s. */
void bench_fill_uniform(uint64_t *s, float *x, size_t n);

/* Run fn(ctx, t, n) on n threads (t = 0 on the caller); seconds from start to join. */
typedef void (*bench_team_fn)(void *ctx, uint32_t t, uint32_t n);
double bench_team_run(uint32_t n, bench_team_fn fn, void *ctx);

/* The bandwidth probe: a sum over vecs 32-byte vectors at buf. */
typedef uint32_t bench_vec __attribute__((vector_size(32)));
typedef struct {
    const bench_vec *buf;
    size_t vecs;           /* multiple of 4 * BENCH_MAX_THREADS */
    uint32_t sink[BENCH_MAX_THREADS];
} bench_bw;
/* GB/s of one sum over the buffer with n threads. */
double bench_bw_measure(bench_bw *j, uint32_t n);

/* The peak probes measure the instruction set of the kernels in use, isa as
 * pkv_stats.isa names it ("avx2", "avx2vnni", "avx512", "avx512vnni", "neon",
 * "neon_dotprod"), so a run under
 * PKV_FORCE_ISA=avx2 on an AVX-512 host is held to AVX2's peaks; NULL, "scalar" or a
 * name the host cannot run: the host's widest. */

/* Lanes of the FMA probe (16 for AVX-512, 8 for AVX2, 4 for NEON, 1: unknown) and its peak
 * GFLOP/s on n threads (NAN when unknown). */
uint32_t bench_fma_lanes(const char *isa);
double bench_fma_peak(uint32_t n, const char *isa);

/* The int8 dot-product probe: independent streams of the kernels' int8 dot (VNNI
 * vpdpbusd for avx512vnni, on ymm for avx2vnni; vpmaddubsw + vpmaddwd + vpaddd on 64
 * bytes for avx512, on 32 for avx2), accumulating into int32, which is what an
 * integer-dot decode kernel runs. Its peak in GOP/s (2 operations a multiply-add, as
 * FLOPs count) on n threads, and the name of the instruction sequence ("avx512-vnni",
 * "avx512bw", "avx-vnni", "avx2", "neon-sdot" (SDOT), "neon" (SMULL + SADALP); "none":
 * NAN). */
double bench_int8_peak(uint32_t n, const char *isa);
const char *bench_int8_kind(const char *isa);

/* Bytes of cpu0's highest-level data or unified cache as sysfs gives it (0: unknown):
 * what the in-cache figure is measured against. */
uint64_t bench_llc_bytes(void);

/* The naive decode: llama2.c-style loops over contiguous f32 K, V [n][g][d]. */
typedef struct {
    uint32_t h, g, d;
    uint64_t n;
    float scale;
    const float *K, *V;  /* [n][g][d] */
    const float *q;      /* [h][d] */
    float *out;          /* [h][d] */
    float *scores[BENCH_MAX_THREADS]; /* [n] each */
} bench_naive;
/* A bench_team_fn: thread t of nt does heads t, t + nt, ... */
void bench_naive_part(void *ctx, uint32_t t, uint32_t nt);

#endif

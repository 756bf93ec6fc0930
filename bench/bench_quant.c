/*
 * bench_quant.c - decode time of one llama3-8b layer (h 32, g 8, d 128) at a given
 * context for f16, Q8 and Q4 pages and both quant_dot paths, relative to f16: a
 * benchmark (built, never run as a test; HACKING.md, "Test tiers"). Public header only.
 *   bench_quant [ctx=131072] [threads=1] [reps=7] [dtypes=f16,q8,q4,q8i,q4i]
 * Prints the median of reps decodes per configuration, in ms (thread CPU time with one
 * thread, else wall time), K/V GB/s and the ratio to f16.
 */
#include "pagedkv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* With one thread the decode runs on this thread: its CPU time leaves out the time a
 * shared machine's other programs hold the core (BENCH_WALL=1: wall time instead). */
static clockid_t clk = CLOCK_MONOTONIC;

static double now(void)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmpd(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rng = 88172645463325252ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

int main(int argc, char **argv)
{
    const uint64_t ctx = argc > 1 ? strtoull(argv[1], NULL, 0) : 131072;
    const uint32_t threads = argc > 2 ? (uint32_t)atoi(argv[2]) : 1;
    const int reps = argc > 3 ? atoi(argv[3]) : 7;
    const char *list = argc > 4 ? argv[4] : "f16,q8,q4,q8i,q4i";
    const uint32_t h = 32, g = 8, d = 128;
    if (threads == 1 && !getenv("BENCH_WALL"))
        clk = CLOCK_THREAD_CPUTIME_ID;
    float *k = malloc(g * d * sizeof *k * 256), *v = malloc(g * d * sizeof *v * 256);
    float *q = malloc(h * d * sizeof *q), *out = malloc(h * d * sizeof *out);
    for (uint32_t i = 0; i < g * d * 256; i++) {
        k[i] = frand();
        v[i] = frand();
    }
    for (uint32_t i = 0; i < h * d; i++)
        q[i] = frand();
    double f16ms = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        pkv_config c = pkv_config_default();
        c.n_layers = 1;
        c.n_heads = h;
        c.n_kv_heads = g;
        c.head_dim = d;
        c.n_threads = threads;
        c.kv_dtype = strncmp(tok, "q8", 2) == 0 ? PKV_Q8 : strncmp(tok, "q4", 2) == 0 ? PKV_Q4
                   : strcmp(tok, "bf16") == 0 ? PKV_BF16 : strcmp(tok, "f32") == 0 ? PKV_F32
                   : PKV_F16;
        c.quant_dot = tok[2] == 'i';
        pkv_engine *e;
        pkv_session *s;
        if (pkv_engine_create(&c, &e) != PKV_OK) {
            fprintf(stderr, "%s: engine refused\n", tok);
            continue;
        }
        pkv_session_create(e, &s);
        for (uint64_t t = 0; t < ctx; t++)
            pkv_append(s, 0, k + (t % 256) * g * d, v + (t % 256) * g * d);
        double ms[64];
        const int n = reps > 64 ? 64 : reps;
        pkv_decode(s, 0, q, out);
        for (int i = 0; i < n; i++) {
            const double t0 = now();
            pkv_decode(s, 0, q, out);
            ms[i] = (now() - t0) * 1e3;
        }
        qsort(ms, n, sizeof *ms, cmpd);
        pkv_memory m;
        pkv_session_memory(s, &m);
        const double med = ms[n / 2];
        if (strcmp(tok, "f16") == 0)
            f16ms = med;
        pkv_stats st;
        pkv_engine_stats(e, &st);
        printf("%-5s %-7s threads %u ctx %llu: median %.2f ms (min %.2f max %.2f) %.2f GB/s"
               " rel f16 %.3f\n", tok, st.isa, threads, (unsigned long long)ctx, med, ms[0],
               ms[n - 1], (double)ctx * g * 2 * pkv_row_bytes(c.kv_dtype, d) / med / 1e6, f16ms > 0 ? med / f16ms : 0.0);
        pkv_session_destroy(s);
        pkv_engine_destroy(e);
    }
    free(k);
    free(v);
    free(q);
    free(out);
    return 0;
}

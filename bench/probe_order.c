/*
 * probe_order.c - how fast memory streams in the orders a decode kernel could read it,
 * with no arithmetic at all (docs/performance.md, "The read side of one core").
 *
 * A 1 GiB buffer is laid out as back-to-back units of a llama3-8b f32 layer: one KV
 * group's 16 K rows of 512 bytes (8 KiB), then its 16 V rows. Each order reads every
 * byte once (64-byte lines summed into four vectors, so nothing is optimized away),
 * optionally with T0 software prefetches of the unit ahead, and is reported as a
 * ratio to a plain sequential sum of the same buffer in the same round; the ratios
 * are medians over the rounds. This is a development probe, not part of the library
 * or of `pagedkv bench`; it is built beside the tool (with -mavx512f where the
 * compiler has it: 64-byte loads, as the kernel's) and not installed.
 *
 * usage: probe_order [threads (1..2, default 1)] [rounds (1..32, default 7)]
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ROW 512u            /* bytes of one f32 row, d = 128 */
#define ROWS 16u            /* rows of a K (or V) block: block_tokens 16 */
#define BLOCK (ROW * ROWS)  /* 8 KiB */
#define UNIT (2 * BLOCK)    /* one group's K then V */
#define BUF_BYTES ((size_t)1 << 30)
#define MAX_ROUNDS 32

/* may_alias: the buffer is bytes; aligned: every load is of a whole 64-byte line */
typedef float v16 __attribute__((vector_size(64), may_alias, aligned(64)));
typedef struct { v16 a, b, c, d; } acc;

static inline v16 ld(const char *p) { return *(const v16 *)p; }
static inline void pf(const char *p) { __builtin_prefetch(p, 0, 3); }

/* n bytes in address order, 256 at a time; with `ahead`, prefetch the same bytes there. */
static inline void seq(acc *s, const char *r, size_t n, const char *ahead)
{
    for (size_t o = 0; o < n; o += 256) {
        if (ahead)
            for (size_t l = 0; l < 256; l += 64)
                pf(ahead + o + l);
        s->a += ld(r + o);
        s->b += ld(r + o + 64);
        s->c += ld(r + o + 128);
        s->d += ld(r + o + 192);
    }
}

/* The kernel's QK order: rows four at a time, their 64-byte chunks interleaved; a
 * prefetch burst of the same four rows of the unit ahead before each group of four. */
static inline void qk_order(acc *s, const char *k, const char *ahead)
{
    for (unsigned b = 0; b < ROWS; b += 4) {
        if (ahead)
            for (unsigned o = 0; o < 4 * ROW; o += 64)
                pf(ahead + b * ROW + o);
        for (unsigned c = 0; c < ROW; c += 64) {
            s->a += ld(k + b * ROW + c);
            s->b += ld(k + (b + 1) * ROW + c);
            s->c += ld(k + (b + 2) * ROW + c);
            s->d += ld(k + (b + 3) * ROW + c);
        }
    }
}

/* QK with each row read whole, in address order. */
static inline void qk_rows(acc *s, const char *k, const char *ahead)
{
    for (unsigned b = 0; b < ROWS; b += 4) {
        if (ahead)
            for (unsigned o = 0; o < 4 * ROW; o += 64)
                pf(ahead + b * ROW + o);
        seq(s, k + b * ROW, 4 * ROW, NULL);
    }
}

/* The kernel's PV order: 256-byte column blocks, every row per block; the prefetch of
 * a row's block bytes in the unit ahead as the row is reached. */
static inline void pv_order(acc *s, const char *v, const char *ahead)
{
    for (unsigned cb = 0; cb < ROW; cb += 256)
        for (unsigned t = 0; t < ROWS; t++) {
            if (ahead)
                for (unsigned o = 0; o < 256; o += 64)
                    pf(ahead + t * ROW + cb + o);
            seq(s, v + t * ROW + cb, 256, NULL);
        }
}

/* Plain loads of every line of a block in order, kept (or-ed) so they are not dropped. */
static inline void touch(acc *s, const char *r)
{
    v16 x = {0};
    for (unsigned o = 0; o < BLOCK; o += 64)
        x += ld(r + o) * 0.0f;
    s->a += x;
}

typedef enum {
    SEQ, CUR, CUR_NOPF, CUR_ADDR_PF, ASC, ASC_NOPF, ASC_K_ROWS, ASC_V_ROWS, ASC_ROWS,
    ASC_TOUCH, N_ORDERS
} order;

static const char *const names[N_ORDERS] = {
    "sequential sum (the reference)",
    "kernel today: K(u), V(u-1); kernel order inside; prefetch as the kernel",
    "  the same without software prefetch",
    "  the same, prefetches in address order (K(u+1), V(u+1))",
    "units ascending: K(u), V(u); kernel order inside; prefetch",
    "  the same without software prefetch",
    "  K rows whole, V kernel order; prefetch",
    "  K kernel order, V rows whole; prefetch",
    "  everything in address order; prefetch",
    "  each block read whole by plain loads first, then kernel order; no prefetch",
};

typedef struct {
    const char *buf;
    size_t u0, u1; /* units [u0, u1) */
    order o;
    float sink;
} job;

static void *run(void *p)
{
    job *j = p;
    acc s = {{0}, {0}, {0}, {0}};
    for (size_t i = j->u0; i < j->u1; i++) {
        const char *k = j->buf + i * UNIT, *v = k + BLOCK;
        const char *ak = i + 1 < j->u1 ? k + UNIT : NULL, *av = ak ? ak + BLOCK : NULL;
        const bool first = i == j->u0;
        switch (j->o) {
        case SEQ:
            seq(&s, k, UNIT, NULL);
            break;
        case CUR: /* QK(u) beside PV(u-1); PV prefetches its own rows ahead */
            qk_order(&s, k, ak);
            if (!first)
                pv_order(&s, v - UNIT, v);
            break;
        case CUR_NOPF:
            qk_order(&s, k, NULL);
            if (!first)
                pv_order(&s, v - UNIT, NULL);
            break;
        case CUR_ADDR_PF:
            qk_order(&s, k, ak);
            if (!first)
                pv_order(&s, v - UNIT, av);
            break;
        case ASC:
            qk_order(&s, k, ak);
            pv_order(&s, v, av);
            break;
        case ASC_NOPF:
            qk_order(&s, k, NULL);
            pv_order(&s, v, NULL);
            break;
        case ASC_K_ROWS:
            qk_rows(&s, k, ak);
            pv_order(&s, v, av);
            break;
        case ASC_V_ROWS:
            qk_order(&s, k, ak);
            seq(&s, v, BLOCK, av);
            break;
        case ASC_ROWS:
            qk_rows(&s, k, ak);
            seq(&s, v, BLOCK, av);
            break;
        case ASC_TOUCH:
            touch(&s, k);
            qk_order(&s, k, NULL);
            touch(&s, v);
            pv_order(&s, v, NULL);
            break;
        case N_ORDERS:
            break;
        }
    }
    const v16 t = s.a + s.b + s.c + s.d;
    j->sink = t[0];
    return NULL;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* GB/s of reading the whole buffer in order o on nt threads (halves of the units). */
static double measure(const char *buf, order o, int nt)
{
    const size_t units = BUF_BYTES / UNIT;
    job jobs[2];
    pthread_t th;
    const double t0 = now();
    for (int t = 0; t < nt; t++)
        jobs[t] = (job){buf, (size_t)t * units / nt, (size_t)(t + 1) * units / nt, o, 0};
    if (nt == 2 && pthread_create(&th, NULL, run, &jobs[1]) != 0)
        return 0;
    run(&jobs[0]);
    if (nt == 2)
        pthread_join(th, NULL);
    return (double)BUF_BYTES / (now() - t0) / 1e9;
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
#if defined(__AVX512F__) && (defined(__x86_64__) || defined(__i386__))
    if (!__builtin_cpu_supports("avx512f")) { /* meson builds it with -mavx512f */
        fprintf(stderr, "probe_order: built for AVX-512, which this CPU lacks\n");
        return 77;
    }
#endif
    const int nt = argc > 1 ? atoi(argv[1]) : 1, rounds = argc > 2 ? atoi(argv[2]) : 7;
    if (argc > 3 || nt < 1 || nt > 2 || rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "usage: probe_order [threads 1..2] [rounds 1..%d]\n", MAX_ROUNDS);
        return 2;
    }
    char *buf = aligned_alloc(2u << 20, BUF_BYTES);
    if (!buf) {
        fprintf(stderr, "probe_order: cannot allocate 1 GiB\n");
        return 1;
    }
    memset(buf, 1, BUF_BYTES);
    static double gbs[N_ORDERS][MAX_ROUNDS], ratio[N_ORDERS][MAX_ROUNDS];
    for (int r = 0; r < rounds; r++)
        for (int o = 0; o < N_ORDERS; o++) {
            gbs[o][r] = measure(buf, (order)o, nt);
            ratio[o][r] = gbs[o][r] / gbs[SEQ][r];
        }
    printf("probe_order: %d thread(s), %d rounds, 1 GiB of f32 units (K 8 KiB, V 8 KiB); "
           "medians\n", nt, rounds);
    for (int o = 0; o < N_ORDERS; o++)
        printf("  %-78s %6.1f GB/s  %5.3f\n", names[o], median(gbs[o], rounds),
               median(ratio[o], rounds));
    free(buf);
    return 0;
}

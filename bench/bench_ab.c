/*
 * bench_ab.c - two builds of libpagedkv in one process, decoding the same layer in
 * turn: a benchmark (built, never run as a test) for changes whose effect is smaller
 * than a shared host's drift. Runs of separate processes minutes apart swung up to
 * 1.7x on a shared VM; here each round times build A, then build B,
 * loops decodes each, so both see the same minute, and the median of the per-round
 * ratios is what it reports. Public header only (the two libraries by dlopen).
 *   bench_ab LIB_A LIB_B [ctx=4096] [dtypes=f16,q8,q8i] [rounds=21] [loops=10]
 * One llama3-8b layer (h 32, g 8, d 128), one thread, K/V and q from a fixed seed.
 * Prints per dtype (q8i/q4i: quant_dot = 1) the best ns per position and KV group of
 * each build, the median of B/A, and whether the two outputs are the same bits (else
 * their largest difference over the largest |output|).
 *
 * Copies. Where a library's pages land in physical memory moves its speed: byte-
 * identical copies of one build decoded Q8 on the integer path 11% apart, every
 * process that loaded them (docs/performance.md, "How to measure"). A ratio of
 * two files is then partly a ratio of two placements, and running both orders does
 * not cancel it. So bench_ab writes BENCH_AB_COPIES (default 3) fresh copies of each
 * library into a temporary directory, loads them all, and round r times copy
 * r % copies of A, then of B: the median of B/A is over placements too, and each
 * copy's best time is printed, so a slow copy shows. BENCH_AB_COPIES=1 loads the two
 * paths as given.
 * BENCH_AB_BT_A / BENCH_AB_BT_B set block_tokens of each build's engines (default:
 * the library's), to compare page sizes with one build.
 * BENCH_AB_ISA_A / BENCH_AB_ISA_B force each build's kernels (PKV_FORCE_ISA, which an
 * engine reads when it is created), to compare two tables of one build: e.g. the same
 * library twice with avx2 and avx2vnni.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, strtok_r, mkdtemp */
#include "pagedkv.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef pkv_config (*config_default_fn)(void);
typedef pkv_status (*engine_create_fn)(const pkv_config *, pkv_engine **);
typedef void (*engine_destroy_fn)(pkv_engine *);
typedef pkv_status (*session_create_fn)(pkv_engine *, pkv_session **);
typedef void (*session_destroy_fn)(pkv_session *);
typedef pkv_status (*append_fn)(pkv_session *, uint32_t, const float *, const float *);
typedef pkv_status (*decode_fn)(pkv_session *, uint32_t, const float *, float *);

typedef struct {
    config_default_fn config_default;
    engine_create_fn engine_create;
    engine_destroy_fn engine_destroy;
    session_create_fn session_create;
    session_destroy_fn session_destroy;
    append_fn append;
    decode_fn decode;
} api;

enum { H = 32, G = 8, D = 128, MAX_ROUNDS = 101, MAX_COPIES = 8 };

static int load(const char *path, api *a)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "bench_ab: %s\n", dlerror());
        return -1;
    }
    /* POSIX guarantees a dlsym result converts to a function pointer; memcpy says so
     * without a cast ISO C leaves undefined */
#define SYM(field, name)                                                                   \
    do {                                                                                   \
        void *p_ = dlsym(h, name);                                                         \
        memcpy(&a->field, &p_, sizeof p_);                                                 \
    } while (0)
    SYM(config_default, "pkv_config_default");
    SYM(engine_create, "pkv_engine_create");
    SYM(engine_destroy, "pkv_engine_destroy");
    SYM(session_create, "pkv_session_create");
    SYM(session_destroy, "pkv_session_destroy");
    SYM(append, "pkv_append");
    SYM(decode, "pkv_decode");
#undef SYM
    if (!a->config_default || !a->engine_create || !a->engine_destroy || !a->session_create ||
        !a->session_destroy || !a->append || !a->decode) {
        fprintf(stderr, "bench_ab: %s lacks a pagedkv symbol\n", path);
        return -1;
    }
    return 0;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmpd(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rng;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

/* dtype name (q8i / q4i: quant_dot = 1) into c; -1 if unknown */
static int parse_dtype(const char *s, pkv_config *c)
{
    static const struct { const char *name; pkv_dtype t; uint32_t qd; } tab[] = {
        {"f32", PKV_F32, 0}, {"f16", PKV_F16, 0}, {"bf16", PKV_BF16, 0}, {"q8", PKV_Q8, 0},
        {"q4", PKV_Q4, 0},   {"q8i", PKV_Q8, 1},  {"q4i", PKV_Q4, 1}};
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (!strcmp(s, tab[i].name)) {
            c->kv_dtype = tab[i].t;
            c->quant_dot = tab[i].qd;
            return 0;
        }
    return -1;
}

/* A session of ctx positions of random K/V (the same for every build: seeded). */
static int setup(const api *a, const char *dt, uint32_t ctx, uint32_t bt, const char *isa,
                 pkv_engine **e, pkv_session **s)
{
    pkv_config c = a->config_default();
    c.block_tokens = bt;
    c.n_layers = 1;
    c.n_heads = H;
    c.n_kv_heads = G;
    c.head_dim = D;
    c.n_threads = 1;
    if (parse_dtype(dt, &c) != 0) {
        fprintf(stderr, "bench_ab: unknown dtype '%s'\n", dt);
        return -1;
    }
    if (isa && setenv("PKV_FORCE_ISA", isa, 1) != 0)
        return -1;
    if (a->engine_create(&c, e) != PKV_OK || a->session_create(*e, s) != PKV_OK) {
        fprintf(stderr, "bench_ab: engine or session refused (%s%s%s)\n", dt,
                isa ? ", PKV_FORCE_ISA=" : "", isa ? isa : "");
        return -1;
    }
    float k[G * D], v[G * D];
    rng = 88172645463325252ull;
    for (uint32_t t = 0; t < ctx; t++) {
        for (int i = 0; i < G * D; i++) {
            k[i] = frand();
            v[i] = frand();
        }
        if (a->append(*s, 0, k, v) != PKV_OK) {
            fprintf(stderr, "bench_ab: append failed at %u\n", t);
            return -1;
        }
    }
    return 0;
}

/* Copy the file at src to dst (created 0600, never over an existing file). */
static int copy_file(const char *src, const char *dst)
{
    const int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0) {
        perror(src);
        return -1;
    }
    const int out = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int rc = out < 0 ? -1 : 0;
    static char buf[1 << 16];
    for (ssize_t n; rc == 0 && (n = read(in, buf, sizeof buf)) != 0;) {
        if (n < 0 || write(out, buf, (size_t)n) != n)
            rc = -1;
    }
    if (rc != 0)
        perror(dst);
    close(in);
    if (out >= 0 && close(out) != 0)
        rc = -1;
    return rc;
}

/* Load `copies` fresh copies of path into lib[0..copies) (the path itself if copies
 * is 1). The copies are unlinked once loaded: their mappings stay. */
static int load_copies(const char *path, char tag, int copies, const char *dir, api *lib)
{
    if (copies == 1)
        return load(path, &lib[0]);
    for (int i = 0; i < copies; i++) {
        char dst[4096];
        snprintf(dst, sizeof dst, "%s/%c%d.so", dir, tag, i);
        const int rc = copy_file(path, dst) == 0 ? load(dst, &lib[i]) : -1;
        unlink(dst);
        if (rc != 0)
            return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_ab LIB_A LIB_B [ctx=4096] [dtypes=f16,q8,q8i] "
                        "[rounds=21] [loops=10]\n"
                        "environment: BENCH_AB_COPIES (fresh copies of each library, "
                        "default 3), BENCH_AB_BT_A / BENCH_AB_BT_B (block_tokens), "
                        "BENCH_AB_ISA_A / BENCH_AB_ISA_B (PKV_FORCE_ISA)\n");
        return 2;
    }
    const uint32_t ctx = argc > 3 ? (uint32_t)strtoul(argv[3], NULL, 10) : 4096;
    const char *dtypes = argc > 4 ? argv[4] : "f16,q8,q8i";
    int rounds = argc > 5 ? atoi(argv[5]) : 21, loops = argc > 6 ? atoi(argv[6]) : 10;
    const char *ce = getenv("BENCH_AB_COPIES");
    const int copies = ce ? atoi(ce) : 3;
    if (ctx == 0 || rounds < 1 || loops < 1 || copies < 1 || copies > MAX_COPIES) {
        fprintf(stderr, "bench_ab: ctx, rounds and loops must be positive, "
                        "BENCH_AB_COPIES 1 to %d\n", MAX_COPIES);
        return 2;
    }
    rounds = rounds > MAX_ROUNDS ? MAX_ROUNDS : rounds;
    const char *bte[2] = {getenv("BENCH_AB_BT_A"), getenv("BENCH_AB_BT_B")};
    const uint32_t bt[2] = {bte[0] ? (uint32_t)strtoul(bte[0], NULL, 10) : 0,
                            bte[1] ? (uint32_t)strtoul(bte[1], NULL, 10) : 0};
    const char *isa[2] = {getenv("BENCH_AB_ISA_A"), getenv("BENCH_AB_ISA_B")};
    const char *tmp = getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/bench_ab.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (copies > 1 && !mkdtemp(dir)) {
        perror(dir);
        return 1;
    }
    static api lib[2][MAX_COPIES];
    const int loaded = load_copies(argv[1], 'a', copies, dir, lib[0]) == 0 &&
                       load_copies(argv[2], 'b', copies, dir, lib[1]) == 0;
    if (copies > 1)
        rmdir(dir);
    if (!loaded)
        return 1;
    printf("A %s (block_tokens %u%s%s)\nB %s (block_tokens %u%s%s)\n", argv[1], bt[0],
           isa[0] ? ", " : "", isa[0] ? isa[0] : "", argv[2], bt[1], isa[1] ? ", " : "",
           isa[1] ? isa[1] : "");
    printf("ctx %u, one llama3-8b layer, 1 thread, %d rounds of %d decodes each, %d copies "
           "of each build\n", ctx, rounds, loops, copies);
    printf("%-5s %10s %10s %8s  %s\n", "dtype", "A ns", "B ns", "B/A", "outputs");
    char list[256];
    snprintf(list, sizeof list, "%s", dtypes);
    static float q[H * D], out[2][MAX_COPIES][H * D];
    for (char *save = NULL, *dt = strtok_r(list, ",", &save); dt; dt = strtok_r(NULL, ",", &save)) {
        pkv_engine *e[2][MAX_COPIES] = {{NULL}};
        pkv_session *s[2][MAX_COPIES] = {{NULL}};
        int bad = 0;
        for (int c = 0; c < copies && !bad; c++)
            for (int b = 0; b < 2 && !bad; b++)
                bad = setup(&lib[b][c], dt, ctx, bt[b], isa[b], &e[b][c], &s[b][c]) != 0;
        for (int i = 0; i < H * D; i++)
            q[i] = frand();
        double best[2][MAX_COPIES], ratio[MAX_ROUNDS];
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < copies; c++)
                best[b][c] = 1e30;
        for (int r = 0; r < rounds && !bad; r++) {
            const int c = r % copies;
            double t[2];
            for (int b = 0; b < 2; b++) {
                const double t0 = now();
                for (int l = 0; l < loops; l++)
                    bad |= lib[b][c].decode(s[b][c], 0, q, out[b][c]) != PKV_OK;
                t[b] = (now() - t0) / loops;
                best[b][c] = t[b] < best[b][c] ? t[b] : best[b][c];
            }
            ratio[r] = t[1] / t[0];
        }
        if (!bad) {
            qsort(ratio, (size_t)rounds, sizeof ratio[0], cmpd);
            /* every copy's output against A's first; comparisons, not fmax: aarch64
             * gcc 12 (CI's cross build) crashes vectorizing an fmax reduction here
             * (internal compiler error) */
            const int used = rounds < copies ? rounds : copies;
            double md = 0, mo = 0;
            int same = 1;
            for (int b = 0; b < 2; b++)
                for (int c = 0; c < used; c++) {
                    same &= memcmp(out[0][0], out[b][c], sizeof out[0][0]) == 0;
                    for (int i = 0; i < H * D; i++) {
                        const double dif = fabs((double)out[0][0][i] - out[b][c][i]);
                        const double o = fabs(out[0][0][i]);
                        md = dif > md || dif != dif ? dif : md;
                        mo = o > mo ? o : mo;
                    }
                }
            const double per = 1e9 / ((double)ctx * G);
            double lo[2] = {1e30, 1e30};
            for (int b = 0; b < 2; b++)
                for (int c = 0; c < used; c++)
                    lo[b] = best[b][c] < lo[b] ? best[b][c] : lo[b];
            char verdict[64];
            if (same)
                snprintf(verdict, sizeof verdict, "same bits");
            else
                snprintf(verdict, sizeof verdict, "differ: %.2g of max|out|", md / mo);
            printf("%-5s %10.2f %10.2f %8.3f  %s\n", dt, lo[0] * per, lo[1] * per,
                   ratio[rounds / 2], verdict);
            if (used > 1)
                for (int b = 0; b < 2; b++) {
                    printf("      %c copies:", "AB"[b]);
                    for (int c = 0; c < used; c++)
                        printf(" %.2f", best[b][c] * per);
                    printf("\n");
                }
        } else {
            fprintf(stderr, "bench_ab: %s failed\n", dt);
        }
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < copies; c++) {
                if (s[b][c])
                    lib[b][c].session_destroy(s[b][c]);
                if (e[b][c])
                    lib[b][c].engine_destroy(e[b][c]);
            }
        if (bad)
            return 1;
    }
    return 0;
}

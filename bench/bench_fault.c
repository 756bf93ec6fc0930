/*
 * bench_fault.c - decode rate of resident sessions while another session of the same
 * engine is spilled and faulted back in, for one or two builds of libpagedkv in one
 * process (a benchmark, built with -Dbench=true, never run as a test). Public header
 * only (the libraries by dlopen, as bench_ab does).
 *
 *   bench_fault LIB_A [LIB_B] [rounds=9] [seconds=0.5]
 *
 * Two engines per build (one measured, one the control): one layer, h 8, g 2, d 128,
 * block_tokens 16, f16 (16 KiB pages), one thread, a spill file in $BENCH_FAULT_DIR
 * (default $TMPDIR or /tmp). K = 4 resident sessions of 256 tokens (64 pages) are
 * decoded in turn on one thread; M = 6 faulting sessions of 1024 tokens (64 pages
 * each) are decoded in turn on a second thread. The budget (64 + 5 x 64 pages) holds
 * the residents and all faulting sessions but one, so each faulting decode reads its
 * session back from the spill file and spills the least recently used one, the next
 * in turn. A resident is spilled only when its thread did not decode it for five
 * fault-ins (a host so loaded that it starves that thread): the run then prints how
 * many resident pages it found spilled. Each round times, for each build, `seconds`
 * of:
 *   alone    the resident decodes alone
 *   fault    beside the faulting thread
 *   poll     beside the faulting thread and a third calling pkv_engine_stats in a loop
 *   control  beside a faulting thread on another engine of the same build: the same
 *            CPU and I/O work, but not this engine's lock (on a machine with fewer free
 *            cores than threads, CPU contention alone slows the residents)
 * and prints the medians over rounds (and the worst round) of the resident rate, of
 * fault / alone, fault / control and poll / alone, and the faulting thread's fault-ins
 * per second with and without the poller (the spill-heavy decoder of issue 49).
 *
 * The rates move with whatever else the host runs. What the engine lock does to the
 * residents shows apart from that in their thread's blocked time: wall time less the
 * time on a CPU and the time runnable but waiting for one (Linux's
 * /proc/thread-self/schedstat). The residents do no I/O, so they sleep only on the
 * engine lock; printed as a share of wall time for each kind of run ("n/a" where the
 * kernel keeps no schedstat).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, mkdtemp */
#include "pagedkv.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    pkv_config (*config_default)(void);
    pkv_status (*engine_create)(const pkv_config *, pkv_engine **);
    void (*engine_destroy)(pkv_engine *);
    pkv_status (*engine_stats)(const pkv_engine *, pkv_stats *);
    pkv_status (*session_create)(pkv_engine *, pkv_session **);
    void (*session_destroy)(pkv_session *);
    pkv_status (*append)(pkv_session *, uint32_t, const float *, const float *);
    pkv_status (*decode)(pkv_session *, uint32_t, const float *, float *);
    pkv_status (*session_memory)(const pkv_session *, pkv_memory *);
} api;

enum {
    H = 8, G = 2, D = 128, BT = 16, K = 4, RES_TOKENS = 256, M = 6, FAULT_TOKENS = 1024,
    MAX_ROUNDS = 101
};
#define PAGE_BYTES (2ull * G * BT * D * 2)
#define BUDGET_PAGES (K * RES_TOKENS / BT + (M - 1) * FAULT_TOKENS / BT)

static int load(const char *path, api *a)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "bench_fault: %s\n", dlerror());
        return -1;
    }
    /* POSIX guarantees a dlsym result converts to a function pointer; memcpy says so
     * without a cast ISO C leaves undefined */
#define SYM(field, name)                                                                   \
    do {                                                                                   \
        void *p_ = dlsym(h, name);                                                         \
        if (!p_) {                                                                         \
            fprintf(stderr, "bench_fault: %s lacks %s\n", path, name);                     \
            return -1;                                                                     \
        }                                                                                  \
        memcpy(&a->field, &p_, sizeof p_);                                                 \
    } while (0)
    SYM(config_default, "pkv_config_default");
    SYM(engine_create, "pkv_engine_create");
    SYM(engine_destroy, "pkv_engine_destroy");
    SYM(engine_stats, "pkv_engine_stats");
    SYM(session_create, "pkv_session_create");
    SYM(session_destroy, "pkv_session_destroy");
    SYM(append, "pkv_append");
    SYM(decode, "pkv_decode");
    SYM(session_memory, "pkv_session_memory");
#undef SYM
    return 0;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmpd(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

static void fill(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = frand();
}

/* One engine with its resident sessions and its faulting ones. */
typedef struct {
    const api *a;
    pkv_engine *e;
    pkv_session *res[K], *f[M];
} world;

static const char *spill_dir;

static int world_make(const api *a, world *w)
{
    memset(w, 0, sizeof *w);
    w->a = a;
    pkv_config c = a->config_default();
    c.n_layers = 1;
    c.n_heads = H;
    c.n_kv_heads = G;
    c.head_dim = D;
    c.block_tokens = BT;
    c.kv_dtype = PKV_F16;
    c.n_threads = 1;
    c.mem_budget = (uint64_t)BUDGET_PAGES * PAGE_BYTES;
    c.spill_dir = spill_dir;
    if (a->engine_create(&c, &w->e) != PKV_OK)
        return -1;
    float k[G * D], v[G * D];
    for (int i = 0; i < M; i++) {
        if (a->session_create(w->e, &w->f[i]) != PKV_OK)
            return -1;
        for (int t = 0; t < FAULT_TOKENS; t++) {
            fill(k, G * D);
            fill(v, G * D);
            if (a->append(w->f[i], 0, k, v) != PKV_OK)
                return -1;
        }
    }
    for (int i = 0; i < K; i++) {
        if (a->session_create(w->e, &w->res[i]) != PKV_OK)
            return -1;
        for (int t = 0; t < RES_TOKENS; t++) {
            fill(k, G * D);
            fill(v, G * D);
            if (a->append(w->res[i], 0, k, v) != PKV_OK)
                return -1;
        }
    }
    return 0;
}

static void world_free(world *w)
{
    if (!w->e)
        return;
    for (int i = 0; i < K; i++)
        if (w->res[i])
            w->a->session_destroy(w->res[i]);
    for (int i = 0; i < M; i++)
        if (w->f[i])
            w->a->session_destroy(w->f[i]);
    w->a->engine_destroy(w->e);
}

/* ---- the threads --------------------------------------------------------------------- */

typedef struct {
    world *w;
    atomic_int *stop;
    double blocked;    /* the share of the run this thread slept (NAN: unknown) */
    uint64_t n;        /* decodes (or polls) done */
    uint64_t failed;   /* calls that did not return PKV_OK */
    pkv_status last;   /* the last such status */
} worker;

static void note(worker *t, pkv_status st)
{
    if (st != PKV_OK) {
        t->failed++;
        t->last = st;
    }
}

static float q[H * D];

/* This thread's time on a CPU and time runnable but off one, in ns; false when the
 * kernel does not say. */
static bool sched_times(double *run_ns, double *wait_ns)
{
    FILE *f = fopen("/proc/thread-self/schedstat", "r");
    if (!f)
        return false;
    uint64_t run, wait;
    const bool ok = fscanf(f, "%" SCNu64 " %" SCNu64, &run, &wait) == 2;
    fclose(f);
    *run_ns = (double)run;
    *wait_ns = (double)wait;
    return ok;
}

static void *resident_loop(void *p)
{
    worker *t = p;
    float out[H * D];
    double run0, wait0, run1, wait1;
    const bool known = sched_times(&run0, &wait0);
    const double t0 = now();
    for (uint64_t i = 0; !atomic_load(t->stop); i++) {
        note(t, t->w->a->decode(t->w->res[i % K], 0, q, out));
        t->n++;
    }
    const double wall = (now() - t0) * 1e9;
    t->blocked = NAN;
    if (known && sched_times(&run1, &wait1) && wall > 0)
        t->blocked = (wall - (run1 - run0) - (wait1 - wait0)) / wall;
    return NULL;
}

static void *fault_loop(void *p)
{
    worker *t = p;
    float out[H * D];
    for (uint64_t i = 0; !atomic_load(t->stop); i++) {
        note(t, t->w->a->decode(t->w->f[i % M], 0, q, out));
        t->n++;
    }
    return NULL;
}

static void *poll_loop(void *p)
{
    worker *t = p;
    while (!atomic_load(t->stop)) {
        pkv_stats st;
        note(t, t->w->a->engine_stats(t->w->e, &st));
        t->n++;
    }
    return NULL;
}

/* `seconds` of the residents of w decoding, beside a faulting thread on fw (NULL:
 * none) and a poller on w (or not). Returns the residents' decodes a second; the
 * faulting thread's fault-ins a second into *fault_rate, the residents' blocked share
 * into *blocked (NAN: unknown). */
static double run(world *w, world *fw, int poll, double seconds, double *fault_rate,
                  double *blocked, int *failed)
{
    atomic_int stop;
    atomic_init(&stop, 0);
    worker r = {.w = w, .stop = &stop}, f = {.w = fw, .stop = &stop},
           pl = {.w = w, .stop = &stop};
    pthread_t tr, tf, tp;
    const double t0 = now();
    if (fw)
        pthread_create(&tf, NULL, fault_loop, &f);
    if (poll)
        pthread_create(&tp, NULL, poll_loop, &pl);
    pthread_create(&tr, NULL, resident_loop, &r);
    struct timespec ts = {.tv_sec = (time_t)seconds,
                          .tv_nsec = (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    atomic_store(&stop, 1);
    pthread_join(tr, NULL);
    const double dt = now() - t0;
    if (fw)
        pthread_join(tf, NULL);
    if (poll)
        pthread_join(tp, NULL);
    *fault_rate = (double)f.n / dt;
    *blocked = r.blocked;
    const worker *ws[3] = {&r, &f, &pl};
    static const char *const who[3] = {"resident", "faulting", "stats"};
    for (int i = 0; i < 3; i++)
        if (ws[i]->failed) {
            fprintf(stderr, "bench_fault: %llu %s call(s) failed (the last with status %d)\n",
                    (unsigned long long)ws[i]->failed, who[i], (int)ws[i]->last);
            *failed = 1;
        }
    return (double)r.n / dt;
}

typedef struct {
    double alone[MAX_ROUNDS], fault[MAX_ROUNDS], control[MAX_ROUNDS], poll[MAX_ROUNDS];
    double f_rate[MAX_ROUNDS], f_rate_poll[MAX_ROUNDS];
    double blocked[4][MAX_ROUNDS]; /* alone, fault, poll, control */
    uint64_t res_spilled;          /* resident pages found spilled after a run */
} figures;

static double median(double *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmpd);
    return n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

static void report(const char *name, figures *f, int rounds)
{
    double ratio_fault[MAX_ROUNDS], ratio_ctl[MAX_ROUNDS], ratio_poll[MAX_ROUNDS],
        ratio_fpoll[MAX_ROUNDS];
    for (int i = 0; i < rounds; i++) {
        ratio_fault[i] = f->fault[i] / f->alone[i];
        ratio_ctl[i] = f->fault[i] / f->control[i];
        ratio_poll[i] = f->poll[i] / f->alone[i];
        ratio_fpoll[i] = f->f_rate_poll[i] / f->f_rate[i];
    }
    const double m_fault = median(ratio_fault, rounds), m_ctl = median(ratio_ctl, rounds);
    const double m_poll = median(ratio_poll, rounds), m_fpoll = median(ratio_fpoll, rounds);
    printf("%s\n", name);
    printf("  resident decodes/s alone     %10.0f\n", median(f->alone, rounds));
    printf("  fault / alone                %10.3f   (worst round %.3f)\n", m_fault,
           ratio_fault[0]);
    printf("  fault / control              %10.3f   (worst round %.3f)\n", m_ctl,
           ratio_ctl[0]);
    printf("  poll / alone                 %10.3f   (worst round %.3f)\n", m_poll,
           ratio_poll[0]);
    printf("  fault-ins/s, no poller       %10.0f\n", median(f->f_rate, rounds));
    printf("  fault-ins/s with poller / without %5.3f   (worst round %.3f)\n", m_fpoll,
           ratio_fpoll[0]);
    static const char *const kind[4] = {"alone", "fault", "poll", "control"};
    printf("  residents blocked (share of wall time), median (worst round):\n   ");
    for (int k = 0; k < 4; k++) {
        if (isnan(f->blocked[k][0])) {
            printf(" %s n/a", kind[k]);
            continue;
        }
        const double m = median(f->blocked[k], rounds);
        printf(" %s %.3f (%.3f)", kind[k], m, f->blocked[k][rounds - 1]);
    }
    printf("\n");
    if (f->res_spilled)
        printf("  resident pages found spilled after runs: %llu (the host starved the "
               "residents' thread: their rate includes their own fault-ins)\n",
               (unsigned long long)f->res_spilled);
}

/* Resident pages of w in the spill file now. */
static uint64_t resident_spilled(const world *w)
{
    uint64_t n = 0;
    for (int i = 0; i < K; i++) {
        pkv_memory m;
        if (w->a->session_memory(w->res[i], &m) == PKV_OK)
            n += m.bytes_spilled / PAGE_BYTES;
    }
    return n;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_fault LIB_A [LIB_B] [rounds=9] [seconds=0.5]\n");
        return 2;
    }
    int nlib = 1;
    if (argc > 2 && strchr(argv[2], '/'))
        nlib = 2;
    const int rounds = argc > nlib + 1 ? atoi(argv[nlib + 1]) : 9;
    const double seconds = argc > nlib + 2 ? atof(argv[nlib + 2]) : 0.5;
    if (rounds < 1 || rounds > MAX_ROUNDS || !(seconds > 0)) {
        fprintf(stderr, "bench_fault: rounds 1..%d, seconds > 0\n", MAX_ROUNDS);
        return 2;
    }
    spill_dir = getenv("BENCH_FAULT_DIR");
    if (!spill_dir)
        spill_dir = getenv("TMPDIR");
    if (!spill_dir)
        spill_dir = "/tmp";
    api a[2];
    world w[2], ctl[2];
    static figures fig[2];
    for (int i = 0; i < nlib; i++) {
        if (load(argv[1 + i], &a[i]) != 0)
            return 1;
        if (world_make(&a[i], &w[i]) != 0 || world_make(&a[i], &ctl[i]) != 0) {
            fprintf(stderr, "bench_fault: cannot build the sessions with %s in %s\n",
                    argv[1 + i], spill_dir);
            return 1;
        }
    }
    fill(q, H * D);
    printf("bench_fault: %d resident sessions of %d tokens, %d faulting sessions of %d "
           "tokens, budget %d pages of %llu bytes, spill dir %s; %d rounds of %.2f s\n", K,
           RES_TOKENS, M, FAULT_TOKENS, BUDGET_PAGES,
           (unsigned long long)PAGE_BYTES, spill_dir, rounds, seconds);
    int failed = 0;
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < nlib; i++) {
            double fr = 0, fr_poll = 0, unused = 0;
            double *b[4];
            for (int k = 0; k < 4; k++)
                b[k] = &fig[i].blocked[k][r];
            fig[i].alone[r] = run(&w[i], NULL, 0, seconds, &unused, b[0], &failed);
            fig[i].fault[r] = run(&w[i], &w[i], 0, seconds, &fr, b[1], &failed);
            fig[i].res_spilled += resident_spilled(&w[i]);
            fig[i].poll[r] = run(&w[i], &w[i], 1, seconds, &fr_poll, b[2], &failed);
            fig[i].res_spilled += resident_spilled(&w[i]);
            fig[i].control[r] = run(&w[i], &ctl[i], 0, seconds, &unused, b[3], &failed);
            fig[i].f_rate[r] = fr;
            fig[i].f_rate_poll[r] = fr_poll;
        }
    for (int i = 0; i < nlib; i++) {
        char name[600];
        snprintf(name, sizeof name, "%s: %s", i ? "B" : "A", argv[1 + i]);
        report(name, &fig[i], rounds);
        world_free(&w[i]);
        world_free(&ctl[i]);
    }
    if (failed) {
        fprintf(stderr, "bench_fault: a call failed during the runs\n");
        return 1;
    }
    return 0;
}

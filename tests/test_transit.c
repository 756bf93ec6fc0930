/*
 * test_transit.c - spill transfers outside the engine lock (docs/design.md, "Memory
 * budget and spill"; the states in src/store/spill.h): while one session's pages are
 * written out or read back, every other call on the engine goes on; a call that needs
 * a page in transit waits for it and then sees its bytes; a page whose last holder
 * left during its transfer is freed when the transfer ends; and many threads with
 * their own sessions under a tight budget, with failing I/O, keep every session equal
 * to a twin engine without a budget and the engine's invariants true.
 *
 * The oracle is a twin engine of the same geometry and no budget (the same kernels and
 * split, so decodes must be bitwise equal). The spill file's transfer hook
 * (pkvi_spill_hook_transfer) holds one transfer in flight on purpose; the I/O object's
 * fault injection fails reads and writes. The I/O backend is the run's (meson runs the
 * program with PKV_NO_URING=1 and without).
 */
#include "testutil.h"
#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { NH = 8, G = 2, D = 32, BT = 8, LAYERS = 2 };
#define KD (G * D)
#define QD (NH * D)
#define PAGE_BYTES (2ull * G * BT * D * 2) /* f16 */

static char dir[512];

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* An engine of budget_pages pages spilling to dir (0: no budget, no spill file). Its
 * prefix cache never drops a page: the threads test compares one engine's index with
 * one twin's per thread, so none may be trimmed by the others' pages. */
static pkv_engine *engine(uint64_t budget_pages, uint32_t threads)
{
    pkv_config c = pkvt_config(LAYERS, NH, G, D, BT, PKV_F16);
    c.n_threads = threads;
    c.prefix_cache_bytes = 1ull << 30;
    if (budget_pages) {
        c.mem_budget = budget_pages * PAGE_BYTES;
        c.spill_dir = dir;
    }
    return pkvt_engine_cfg(&c);
}

static pkvi_spill *spill_of(pkv_engine *e)
{
    return pkvi_engine_ctx(e).cache->spill;
}

/* The same random rows appended to `layer` of a and of b (b may be NULL). */
static void grow_layer(pkv_session *a, pkv_session *b, pkvt_rng *r, uint32_t layer,
                       uint32_t tokens)
{
    float k[KD], v[KD];
    for (uint32_t t = 0; t < tokens; t++) {
        pkvt_fill(r, k, KD, -1, 1);
        pkvt_fill(r, v, KD, -1, 1);
        ck_assert_int_eq(pkv_append(a, layer, k, v), PKV_OK);
        if (b)
            ck_assert_int_eq(pkv_append(b, layer, k, v), PKV_OK);
    }
}

static void grow(pkv_session *a, pkv_session *b, pkvt_rng *r, uint32_t tokens)
{
    for (uint32_t l = 0; l < LAYERS; l++)
        grow_layer(a, b, r, l, tokens);
}

/* ---- holding one transfer in flight ---------------------------------------------- */

/* The spill file's transfer hook: the next transfer of the armed direction stops
 * until released (or 60 s passed, so a broken test cannot hang the suite). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool arm_write, arm_read; /* stop the next write / read */
    bool stalled;             /* one is stopped now (or was) */
    bool released;
    uint64_t reads, writes;   /* transfers begun */
} stall;

static void stall_init(stall *s)
{
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
}

static void stall_hook(void *ctx, bool write, uint64_t n)
{
    (void)n;
    stall *s = ctx;
    pthread_mutex_lock(&s->mu);
    s->reads += !write;
    s->writes += write;
    if (write ? s->arm_write : s->arm_read) {
        s->arm_write = s->arm_read = false;
        s->stalled = true;
        pthread_cond_broadcast(&s->cv);
        const double end = now_s() + 60;
        while (!s->released && now_s() < end) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 10 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        }
    }
    pthread_mutex_unlock(&s->mu);
}

static void stall_arm(stall *s, bool write)
{
    pthread_mutex_lock(&s->mu);
    s->arm_write = write;
    s->arm_read = !write;
    s->stalled = s->released = false;
    pthread_mutex_unlock(&s->mu);
}

static uint64_t stall_reads(stall *s)
{
    pthread_mutex_lock(&s->mu);
    const uint64_t n = s->reads;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* Wait until a transfer is held (true), or `seconds` passed (false). */
static bool stall_wait(stall *s, double seconds)
{
    const double end = now_s() + seconds;
    pthread_mutex_lock(&s->mu);
    while (!s->stalled && now_s() < end) {
        pthread_mutex_unlock(&s->mu);
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&s->mu);
    }
    const bool got = s->stalled;
    pthread_mutex_unlock(&s->mu);
    return got;
}

static void stall_release(stall *s)
{
    pthread_mutex_lock(&s->mu);
    s->released = true;
    s->arm_write = s->arm_read = false;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* A call run on a thread of its own, so the test can see whether it returns while a
 * transfer is held. */
typedef struct {
    void (*fn)(void *arg);
    void *arg;
    atomic_int done;
    pthread_t th;
} job;

static void *job_main(void *p)
{
    job *j = p;
    j->fn(j->arg);
    atomic_store(&j->done, 1);
    return NULL;
}

static void job_start(job *j, void (*fn)(void *), void *arg)
{
    j->fn = fn;
    j->arg = arg;
    atomic_init(&j->done, 0);
    ck_assert_int_eq(pthread_create(&j->th, NULL, job_main, j), 0);
}

/* Whether the job returned within `seconds`. */
static bool job_done_within(job *j, double seconds)
{
    const double end = now_s() + seconds;
    while (!atomic_load(&j->done) && now_s() < end) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return atomic_load(&j->done) != 0;
}

static void job_join(job *j)
{
    pthread_join(j->th, NULL);
}

/* The calls the jobs make. */
typedef struct {
    pkv_session *s, *twin;  /* decode s, compare with twin's decode */
    pkv_engine *e;
    uint32_t layer;
    uint64_t seed;
    pkv_status st;          /* what the call returned */
    bool same;              /* decode: the twin's bits */
    pkv_stats stats;
} call;

static void do_decode(void *p)
{
    call *c = p;
    pkvt_rng r;
    pkvt_rng_init(&r, c->seed);
    float q[QD], o[QD], ot[QD];
    pkvt_fill(&r, q, QD, -2, 2);
    c->st = pkv_decode(c->s, c->layer, q, o);
    ck_assert_int_eq(pkv_decode(c->twin, c->layer, q, ot), PKV_OK);
    c->same = c->st == PKV_OK && memcmp(o, ot, sizeof o) == 0;
}

static void do_append(void *p)
{
    call *c = p;
    pkvt_rng r;
    pkvt_rng_init(&r, c->seed);
    float k[KD], v[KD];
    pkvt_fill(&r, k, KD, -1, 1);
    pkvt_fill(&r, v, KD, -1, 1);
    c->st = pkv_append(c->s, c->layer, k, v);
    if (c->st == PKV_OK && c->twin)
        ck_assert_int_eq(pkv_append(c->twin, c->layer, k, v), PKV_OK);
}

static void do_stats(void *p)
{
    call *c = p;
    c->st = pkv_engine_stats(c->e, &c->stats);
}

static void do_destroy(void *p)
{
    call *c = p;
    pkv_session_destroy(c->s);
    c->st = PKV_OK;
}

/* ---- other sessions go on while one transfer is in flight ----------------------------- */

/*
 * Budget 24 pages. v (the victim: 16 pages, least recently used) and a (4 pages,
 * touched after v) and w (4 full pages) fill it. The first part holds the write that
 * w's next page causes (it spills v's 16 pages: a batch is at least SPILL_BATCH pages,
 * and v holds that many), the second the read of v's layer 0 back; in both, a decode
 * and an append on a (into its last page: no room needed), and the engine's stats,
 * must return while the transfer is held.
 */
static void others_go_on(void)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 1);
    pkv_engine *e = engine(24, 1), *twin = engine(0, 1);
    stall hold;
    stall_init(&hold);
    pkvi_spill_hook_transfer(spill_of(e), stall_hook, &hold);
    pkv_session *v, *a, *w, *tv, *ta, *tw;
    v = pkvt_session(e);
    a = pkvt_session(e);
    w = pkvt_session(e);
    tv = pkvt_session(twin);
    ta = pkvt_session(twin);
    tw = pkvt_session(twin);
    grow(v, tv, &r, 8 * BT);
    grow(a, ta, &r, 2 * BT - 3); /* the appends below fit a's last pages */
    grow(w, tw, &r, 2 * BT);
    call dec_a = {.s = a, .twin = ta, .layer = 1, .seed = 7};
    do_decode(&dec_a); /* a is now more recently used than v */
    ck_assert(dec_a.same);
    pkv_stats st;
    pkv_engine_stats(e, &st);
    ck_assert_uint_eq(st.pages_in_use, 24);
    ck_assert_uint_eq(st.pages_spilled, 0);

    for (int part = 0; part < 2; part++) {
        const bool write = part == 0;
        stall_arm(&hold, write);
        /* the transfer: w grows a page (spills v) / v's layer 0 is decoded (read) */
        call mover = {.s = write ? w : v, .twin = write ? tw : tv, .layer = 0, .seed = 11};
        job jm;
        job_start(&jm, write ? do_append : do_decode, &mover);
        ck_assert_msg(stall_wait(&hold, 30), "part %d: no %s transfer started", part,
                      write ? "write" : "read");
        /* meanwhile: a decode and an append on a, and the stats */
        call c1 = {.s = a, .twin = ta, .layer = 0, .seed = 21 + (uint64_t)part};
        call c2 = {.s = a, .twin = ta, .layer = 1, .seed = 31 + (uint64_t)part};
        call c3 = {.e = e};
        job j1, j2, j3;
        job_start(&j3, do_stats, &c3);
        const bool stats_back = job_done_within(&j3, 5);
        job_start(&j1, do_decode, &c1);
        const bool decode_back = job_done_within(&j1, 5);
        job_start(&j2, do_append, &c2);
        const bool append_back = job_done_within(&j2, 5);
        const bool held = !atomic_load(&jm.done);
        stall_release(&hold);
        job_join(&jm);
        job_join(&j1);
        job_join(&j2);
        job_join(&j3);
        printf("%s held: stats %s, decode %s, append %s\n", write ? "a spill write" : "a read",
               stats_back ? "returned" : "waited", decode_back ? "returned" : "waited",
               append_back ? "returned" : "waited");
        fflush(stdout);
        ck_assert_msg(held, "part %d: the held transfer's call returned early", part);
        ck_assert_msg(stats_back, "part %d: pkv_engine_stats waited for a %s", part,
                      write ? "spill write" : "read");
        ck_assert_msg(decode_back, "part %d: a resident session's decode waited for a %s",
                      part, write ? "spill write" : "read");
        ck_assert_msg(append_back, "part %d: an append to a resident session waited for a "
                      "%s", part, write ? "spill write" : "read");
        ck_assert_int_eq(mover.st, PKV_OK);
        ck_assert_int_eq(c1.st, PKV_OK);
        ck_assert(c1.same);
        ck_assert_int_eq(c2.st, PKV_OK);
        ck_assert_int_eq(c3.st, PKV_OK);
        ck_assert(write || mover.same);
        ck_assert(pkvi_engine_check(e));
    }
    pkv_engine_stats(e, &st);
    ck_assert_uint_gt(st.pages_spilled, 0);
    pkvi_spill_hook_transfer(spill_of(e), NULL, NULL);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

START_TEST(others_proceed)
{
    pkvt_scratch_dir(dir, sizeof dir, "transit");
    others_go_on();
    pkvt_remove_dir(dir);
}
END_TEST

/* ---- a call that needs a page in transit waits for it -------------------------------- */

/* Whether t is pinned now (a call has taken it and waits inside). */
static bool pinned(pkv_engine *e, pkv_session *s, uint32_t layer)
{
    pkvi_cache *cache = pkvi_engine_ctx(e).cache;
    pthread_mutex_lock(&cache->lock);
    const bool p = pkvi_btable_pinned(s->layers[layer]);
    pthread_mutex_unlock(&cache->lock);
    return p;
}

/* Wait until j's call has pinned s's layer (it is inside, waiting) or returned. */
static bool inside_within(pkv_engine *e, pkv_session *s, uint32_t layer, job *j,
                          double seconds)
{
    const double end = now_s() + seconds;
    while (!pinned(e, s, layer) && !atomic_load(&j->done) && now_s() < end) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return pinned(e, s, layer) || atomic_load(&j->done);
}

/* Entries of `layer` of s that are in memory, by pkv_session_pages. */
static uint64_t resident_pages(pkv_session *s, uint32_t layer)
{
    pkv_page_info info[64];
    uint64_t n = 0, r = 0;
    ck_assert_int_eq(pkv_session_pages(s, layer, 0, 64, info, &n), PKV_OK);
    for (uint64_t i = 0; i < n; i++)
        r += info[i].resident;
    return r;
}

/*
 * The scene of others_go_on. First the write of v's 16 pages is held and v's layer 0
 * is decoded meanwhile: the decode must wait (its entries read NULL while the pages
 * are OUTGOING), and when the write ends those 8 pages are kept (the commit sees the
 * pin) while layer 1's 8 are spilled. Then the read of v's layer 1 is held and a fork
 * of v, which shares those pages, decodes layer 1: it waits for them to arrive and
 * reads them, it does not read them again.
 */
static void waiters_wait(void)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 2);
    pkv_engine *e = engine(24, 1), *twin = engine(0, 1);
    stall hold;
    stall_init(&hold);
    pkvi_spill_hook_transfer(spill_of(e), stall_hook, &hold);
    pkv_session *v = pkvt_session(e), *a = pkvt_session(e), *w = pkvt_session(e);
    pkv_session *tv = pkvt_session(twin), *ta = pkvt_session(twin), *tw = pkvt_session(twin);
    grow(v, tv, &r, 8 * BT);
    grow(a, ta, &r, 2 * BT);
    grow(w, tw, &r, 2 * BT);
    call touch = {.s = a, .twin = ta, .layer = 0, .seed = 3};
    do_decode(&touch);
    ck_assert(touch.same);

    stall_arm(&hold, true);
    call grower = {.s = w, .twin = tw, .layer = 0, .seed = 5};
    job jg;
    job_start(&jg, do_append, &grower);
    ck_assert_msg(stall_wait(&hold, 30), "no spill write started");
    const uint64_t reads0 = stall_reads(&hold);
    call reader = {.s = v, .twin = tv, .layer = 0, .seed = 6};
    job jr;
    job_start(&jr, do_decode, &reader);
    ck_assert_msg(inside_within(e, v, 0, &jr, 30), "the decode of v did not start");
    /* it waits inside (a condition wait, the lock free): the engine answers meanwhile */
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    ck_assert_msg(!atomic_load(&jr.done), "a decode read pages that were being written out");
    ck_assert(pkvi_sessions_check(pkvi_engine_ctx(e).geom, pkvi_engine_ctx(e).cache, false));
    stall_release(&hold);
    job_join(&jg);
    job_join(&jr);
    ck_assert_int_eq(grower.st, PKV_OK);
    ck_assert_int_eq(reader.st, PKV_OK);
    ck_assert_msg(reader.same, "the waiting decode differs from the twin's");
    ck_assert_uint_eq(resident_pages(v, 0), 8); /* kept: pinned when the write ended, */
    ck_assert_uint_eq(stall_reads(&hold), reads0); /* so never read back */
    ck_assert_uint_eq(resident_pages(v, 1), 0); /* spilled */
    ck_assert(pkvi_engine_check(e));

    pkv_session *f = NULL, *tf = NULL;
    ck_assert_int_eq(pkv_session_fork(v, &f), PKV_OK);
    ck_assert_int_eq(pkv_session_fork(tv, &tf), PKV_OK);
    stall_arm(&hold, false);
    reader = (call){.s = v, .twin = tv, .layer = 1, .seed = 7};
    job_start(&jr, do_decode, &reader);
    ck_assert_msg(stall_wait(&hold, 30), "no read started");
    call other = {.s = f, .twin = tf, .layer = 1, .seed = 8};
    job jo;
    job_start(&jo, do_decode, &other);
    ck_assert_msg(inside_within(e, f, 1, &jo, 30), "the fork's decode did not start");
    nanosleep(&ts, NULL);
    ck_assert_msg(!atomic_load(&jo.done), "a decode read pages before they arrived");
    ck_assert(pkvi_sessions_check(pkvi_engine_ctx(e).geom, pkvi_engine_ctx(e).cache, false));
    stall_release(&hold);
    job_join(&jr);
    job_join(&jo);
    ck_assert_int_eq(reader.st, PKV_OK);
    ck_assert_int_eq(other.st, PKV_OK);
    ck_assert(reader.same);
    ck_assert_msg(other.same, "the fork's decode differs from the twin's");
    ck_assert_uint_eq(resident_pages(f, 1), 8);
    ck_assert(pkvi_engine_check(e));
    pkvi_spill_hook_transfer(spill_of(e), NULL, NULL);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

/*
 * The same scene with v's last pages partly filled: an append to v while its pages are
 * being written out must wait (it would write into a page the write is reading, and
 * its row could be lost if that page were then spilled), and lands once the write
 * ended: layer 1, pinned by the append, is kept; layer 0 is spilled.
 */
static void writer_waits(void)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 4);
    pkv_engine *e = engine(24, 1), *twin = engine(0, 1);
    stall hold;
    stall_init(&hold);
    pkvi_spill_hook_transfer(spill_of(e), stall_hook, &hold);
    pkv_session *v = pkvt_session(e), *a = pkvt_session(e), *w = pkvt_session(e);
    pkv_session *tv = pkvt_session(twin), *ta = pkvt_session(twin), *tw = pkvt_session(twin);
    grow(v, tv, &r, 8 * BT - 4);
    grow(a, ta, &r, 2 * BT);
    grow(w, tw, &r, 2 * BT);
    call touch = {.s = a, .twin = ta, .layer = 0, .seed = 3};
    do_decode(&touch);
    stall_arm(&hold, true);
    call grower = {.s = w, .twin = tw, .layer = 0, .seed = 5};
    job jg;
    job_start(&jg, do_append, &grower);
    ck_assert_msg(stall_wait(&hold, 30), "no spill write started");
    call writer = {.s = v, .twin = tv, .layer = 1, .seed = 6};
    job jw;
    job_start(&jw, do_append, &writer);
    ck_assert_msg(inside_within(e, v, 1, &jw, 30), "the append to v did not start");
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    ck_assert_msg(!atomic_load(&jw.done), "an append wrote into a page being written out");
    stall_release(&hold);
    job_join(&jg);
    job_join(&jw);
    ck_assert_int_eq(grower.st, PKV_OK);
    ck_assert_int_eq(writer.st, PKV_OK);
    ck_assert_uint_eq(resident_pages(v, 1), 8);
    ck_assert_uint_eq(resident_pages(v, 0), 0);
    ck_assert(pkvi_engine_check(e));
    for (uint32_t l = 0; l < LAYERS; l++) {
        call dec = {.s = v, .twin = tv, .layer = l, .seed = 20 + l};
        do_decode(&dec);
        ck_assert_int_eq(dec.st, PKV_OK);
        ck_assert_msg(dec.same, "layer %u of v differs from the twin's", l);
    }
    pkvi_spill_hook_transfer(spill_of(e), NULL, NULL);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

/*
 * Every victim wanted: v's 16 pages, shared with its fork f, are being written out
 * while v's layer 0 and f's layer 1 are decoded. Keeping them all would free nothing,
 * so the write spills what the room needs all the same, and the waiter of such a page
 * reads it back: both decodes are the twin's, the grower gets its page.
 */
static void all_wanted(void)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 5);
    pkv_engine *e = engine(24, 1), *twin = engine(0, 1);
    stall hold;
    stall_init(&hold);
    pkvi_spill_hook_transfer(spill_of(e), stall_hook, &hold);
    pkv_session *v = pkvt_session(e), *a = pkvt_session(e), *w = pkvt_session(e);
    pkv_session *tv = pkvt_session(twin), *ta = pkvt_session(twin), *tw = pkvt_session(twin);
    grow(v, tv, &r, 8 * BT);
    pkv_session *f = NULL, *tf = NULL;
    ck_assert_int_eq(pkv_session_fork(v, &f), PKV_OK);
    ck_assert_int_eq(pkv_session_fork(tv, &tf), PKV_OK);
    grow(a, ta, &r, 2 * BT);
    grow(w, tw, &r, 2 * BT);
    call touch = {.s = a, .twin = ta, .layer = 0, .seed = 3};
    do_decode(&touch);
    stall_arm(&hold, true);
    call grower = {.s = w, .twin = tw, .layer = 0, .seed = 5};
    job jg;
    job_start(&jg, do_append, &grower);
    ck_assert_msg(stall_wait(&hold, 30), "no spill write started");
    const uint64_t reads0 = stall_reads(&hold);
    call r0 = {.s = v, .twin = tv, .layer = 0, .seed = 6}, r1 = {.s = f, .twin = tf,
                                                                   .layer = 1, .seed = 7};
    job j0, j1;
    job_start(&j0, do_decode, &r0);
    job_start(&j1, do_decode, &r1);
    ck_assert(inside_within(e, v, 0, &j0, 30) && inside_within(e, f, 1, &j1, 30));
    ck_assert_msg(!atomic_load(&j0.done) && !atomic_load(&j1.done),
                  "a decode read pages that were being written out");
    stall_release(&hold);
    job_join(&jg);
    job_join(&j0);
    job_join(&j1);
    ck_assert_int_eq(grower.st, PKV_OK);
    ck_assert(r0.st == PKV_OK && r0.same);
    ck_assert(r1.st == PKV_OK && r1.same);
    ck_assert_uint_gt(stall_reads(&hold), reads0); /* a spilled page was read back */
    ck_assert(pkvi_engine_check(e));
    pkvi_spill_hook_transfer(spill_of(e), NULL, NULL);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

/*
 * Room that only a transfer in flight can make: v's 16 pages are being written out
 * for w's next page, and a (whose only pages are in the layer it appends to) needs a
 * page too. Nothing else can be spilled - v's pages are in transit, a's and w's
 * layers pinned by their own calls - so a's append waits for the write to end (it
 * does not fail with PKV_ENOMEM) and then finds the room the write made.
 */
static void room_waits(void)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 6);
    pkv_engine *e = engine(24, 1), *twin = engine(0, 1);
    stall hold;
    stall_init(&hold);
    pkvi_spill_hook_transfer(spill_of(e), stall_hook, &hold);
    pkv_session *v = pkvt_session(e), *a = pkvt_session(e), *w = pkvt_session(e);
    pkv_session *tv = pkvt_session(twin), *ta = pkvt_session(twin), *tw = pkvt_session(twin);
    grow(v, tv, &r, 8 * BT);
    grow_layer(a, ta, &r, 0, 4 * BT);
    grow_layer(w, tw, &r, 0, 4 * BT);
    pkv_stats st;
    ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
    ck_assert_uint_eq(st.pages_in_use, 24);
    stall_arm(&hold, true);
    call grower = {.s = w, .twin = tw, .layer = 0, .seed = 5};
    job jg;
    job_start(&jg, do_append, &grower);
    ck_assert_msg(stall_wait(&hold, 30), "no spill write started");
    call other = {.s = a, .twin = ta, .layer = 0, .seed = 6};
    job ja;
    job_start(&ja, do_append, &other);
    ck_assert_msg(inside_within(e, a, 0, &ja, 30), "the append to a did not start");
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    const bool waited = !atomic_load(&ja.done);
    ck_assert(pkvi_sessions_check(pkvi_engine_ctx(e).geom, pkvi_engine_ctx(e).cache, false));
    stall_release(&hold);
    job_join(&jg);
    job_join(&ja);
    ck_assert_msg(waited, "an append with no room but what a transfer in flight frees "
                  "returned %s before the transfer ended", pkv_status_str(other.st));
    ck_assert_int_eq(grower.st, PKV_OK);
    ck_assert_int_eq(other.st, PKV_OK);
    ck_assert(pkvi_engine_check(e));
    pkv_session *s2[2] = {a, w}, *t2[2] = {ta, tw};
    for (int k = 0; k < 2; k++) {
        call dec = {.s = s2[k], .twin = t2[k], .layer = 0, .seed = 40 + (uint64_t)k};
        do_decode(&dec);
        ck_assert_int_eq(dec.st, PKV_OK);
        ck_assert(dec.same);
    }
    pkvi_spill_hook_transfer(spill_of(e), NULL, NULL);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

START_TEST(waiters)
{
    pkvt_scratch_dir(dir, sizeof dir, "transit");
    waiters_wait();
    writer_waits();
    all_wanted();
    room_waits();
    pkvt_remove_dir(dir);
}
END_TEST

/*
 * A session destroyed while its pages are being written out: the destroy returns at
 * once (it does not wait for the write), and the pages, whose last holder left, are
 * freed when the write ends (their buffers back to the pool, their slots free): the
 * counts come out as if the session had never been spilled.
 */
static void orphans_freed(void)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 3);
    pkv_engine *e = engine(24, 1), *twin = engine(0, 1);
    stall hold;
    stall_init(&hold);
    pkvi_spill_hook_transfer(spill_of(e), stall_hook, &hold);
    pkv_session *v = pkvt_session(e), *a = pkvt_session(e), *w = pkvt_session(e);
    pkv_session *tv = pkvt_session(twin), *ta = pkvt_session(twin), *tw = pkvt_session(twin);
    grow(v, tv, &r, 8 * BT);
    grow(a, ta, &r, 2 * BT);
    grow(w, tw, &r, 2 * BT);
    call touch = {.s = a, .twin = ta, .layer = 0, .seed = 3};
    do_decode(&touch);
    stall_arm(&hold, true);
    call grower = {.s = w, .twin = tw, .layer = 0, .seed = 5};
    job jg;
    job_start(&jg, do_append, &grower);
    ck_assert_msg(stall_wait(&hold, 30), "no spill write started");
    call killer = {.s = v};
    job jk;
    job_start(&jk, do_destroy, &killer);
    const bool back = job_done_within(&jk, 5);
    ck_assert(pkvi_sessions_check(pkvi_engine_ctx(e).geom, pkvi_engine_ctx(e).cache, false));
    pkv_stats st;
    ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
    const uint64_t during = st.pages_in_use; /* the orphans' buffers are still in use */
    stall_release(&hold);
    job_join(&jg);
    job_join(&jk);
    pkv_session_destroy(tv);
    ck_assert_msg(back, "pkv_session_destroy waited for the write of its pages");
    ck_assert_int_eq(grower.st, PKV_OK);
    ck_assert_uint_eq(during, 24);
    ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
    ck_assert_uint_eq(st.pages_spilled, 0);
    ck_assert_uint_eq(st.pages_in_use, 4 + 5); /* a, and w with its new page */
    ck_assert(pkvi_engine_check(e));
    call dec = {.s = w, .twin = tw, .layer = 0, .seed = 9};
    do_decode(&dec);
    ck_assert(dec.same);
    /* the slots came back: spilling a and w fills the file from its start again */
    pkvi_spill_hook_transfer(spill_of(e), NULL, NULL);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

START_TEST(orphans)
{
    pkvt_scratch_dir(dir, sizeof dir, "transit");
    orphans_freed();
    pkvt_remove_dir(dir);
}
END_TEST

/* ---- many threads, failing I/O ----------------------------------------------------- */

enum { CT_THREADS = 4, CT_SESSIONS = 3, CT_MAX_TOKENS = 48, CT_BUDGET = 28, CT_ROUND = 25 };

typedef struct {
    pkv_engine *e, *twin;
    pthread_barrier_t *barrier;
    atomic_int *stop;
    int id;
    uint64_t seed, ops;
    pkv_session *s[CT_SESSIONS], *t[CT_SESSIONS];
    uint32_t n;                 /* live sessions */
    uint64_t done, eio, enomem, faults;
    char fail[256];             /* the first failure ("" none); ck_assert is the main
                                   thread's */
} ct_worker;

#define CT_FAIL(w, ...)                                                                 \
    do {                                                                                \
        if (!(w)->fail[0])                                                              \
            snprintf((w)->fail, sizeof (w)->fail, __VA_ARGS__);                         \
    } while (0)

static bool ct_ok_or_busy(ct_worker *w, pkv_status st, const char *what)
{
    if (st == PKV_OK)
        return true;
    if (st == PKV_EIO)
        w->eio++;
    else if (st == PKV_ENOMEM)
        w->enomem++;
    else
        CT_FAIL(w, "thread %d: %s returned %s", w->id, what, pkv_status_str(st));
    return false;
}

/* Every layer of session i the same length in both engines. */
static void ct_same_lengths(ct_worker *w, uint32_t i, const char *what)
{
    for (uint32_t l = 0; l < LAYERS; l++)
        if (pkv_session_len(w->s[i], l) != pkv_session_len(w->t[i], l))
            CT_FAIL(w, "thread %d: %s: layer %u holds %llu positions, the twin %llu", w->id,
                    what, l, (unsigned long long)pkv_session_len(w->s[i], l),
                    (unsigned long long)pkv_session_len(w->t[i], l));
}

static int32_t ct_id(const ct_worker *w, uint64_t p)
{
    return (int32_t)((uint64_t)w->id * 100000 + p);
}

static void ct_step(ct_worker *w, pkvt_rng *r)
{
    const uint32_t i = pkvt_below(r, w->n), l = pkvt_below(r, LAYERS);
    pkv_session *s = w->s[i], *t = w->t[i];
    const uint64_t len = pkv_session_len(s, l);
    float q[4 * QD], k[4 * KD], v[4 * KD], o[4 * QD], ot[4 * QD];
    const uint32_t op = pkvt_below(r, 100);
    if (op < 38) { /* append */
        if (len >= CT_MAX_TOKENS)
            return;
        pkvt_fill(r, k, KD, -1, 1);
        pkvt_fill(r, v, KD, -1, 1);
        if (ct_ok_or_busy(w, pkv_append(s, l, k, v), "append") &&
            pkv_append(t, l, k, v) != PKV_OK)
            CT_FAIL(w, "thread %d: the twin's append failed", w->id);
        ct_same_lengths(w, i, "append");
    } else if (op < 43) { /* prefill */
        const uint32_t n = 1 + pkvt_below(r, 4);
        if (len + n > CT_MAX_TOKENS)
            return;
        pkvt_fill(r, q, (size_t)n * QD, -2, 2);
        pkvt_fill(r, k, (size_t)n * KD, -1, 1);
        pkvt_fill(r, v, (size_t)n * KD, -1, 1);
        if (ct_ok_or_busy(w, pkv_prefill(s, l, n, q, k, v, o), "prefill")) {
            if (pkv_prefill(t, l, n, q, k, v, ot) != PKV_OK)
                CT_FAIL(w, "thread %d: the twin's prefill failed", w->id);
            else if (memcmp(o, ot, (size_t)n * QD * sizeof *o) != 0)
                CT_FAIL(w, "thread %d: prefill differs from the twin's", w->id);
        }
        ct_same_lengths(w, i, "prefill");
    } else if (op < 68) { /* decode */
        if (len == 0)
            return;
        pkvt_fill(r, q, QD, -2, 2);
        if (ct_ok_or_busy(w, pkv_decode(s, l, q, o), "decode")) {
            if (pkv_decode(t, l, q, ot) != PKV_OK)
                CT_FAIL(w, "thread %d: the twin's decode failed", w->id);
            else if (memcmp(o, ot, QD * sizeof *o) != 0)
                CT_FAIL(w, "thread %d: decode of layer %u (%llu positions) differs from "
                        "the twin's", w->id, l, (unsigned long long)len);
        }
    } else if (op < 73) { /* every session of this thread in one batch */
        for (uint32_t j = 0; j < w->n; j++)
            if (pkv_session_len(w->s[j], l) == 0)
                return;
        pkvt_fill(r, q, (size_t)w->n * QD, -2, 2);
        if (ct_ok_or_busy(w, pkv_decode_batch(w->e, l, w->n, w->s, q, o), "decode_batch")) {
            if (pkv_decode_batch(w->twin, l, w->n, w->t, q, ot) != PKV_OK)
                CT_FAIL(w, "thread %d: the twin's batch failed", w->id);
            else if (memcmp(o, ot, (size_t)w->n * QD * sizeof *o) != 0)
                CT_FAIL(w, "thread %d: a batch differs from the twin's", w->id);
        }
    } else if (op < 80) { /* fork */
        if (w->n == CT_SESSIONS)
            return;
        if (pkv_session_fork(s, &w->s[w->n]) != PKV_OK ||
            pkv_session_fork(t, &w->t[w->n]) != PKV_OK)
            CT_FAIL(w, "thread %d: fork failed", w->id);
        else
            w->n++;
    } else if (op < 86) { /* truncate */
        uint64_t max = 0;
        for (uint32_t j = 0; j < LAYERS; j++)
            max = pkv_session_len(s, j) > max ? pkv_session_len(s, j) : max;
        const uint64_t n = pkvt_below(r, (uint32_t)max + 1);
        if (pkv_session_truncate(s, n) != PKV_OK || pkv_session_truncate(t, n) != PKV_OK)
            CT_FAIL(w, "thread %d: truncate failed", w->id);
        ct_same_lengths(w, i, "truncate");
    } else if (op < 90) { /* destroy */
        if (w->n == 1)
            return;
        pkv_session_destroy(s);
        pkv_session_destroy(t);
        w->s[i] = w->s[w->n - 1];
        w->t[i] = w->t[w->n - 1];
        w->n--;
    } else if (op < 94) { /* record the ids of what every layer holds: the prefix cache */
        uint64_t n = UINT64_MAX;
        for (uint32_t j = 0; j < LAYERS; j++)
            n = pkv_session_len(s, j) < n ? pkv_session_len(s, j) : n;
        int32_t ids[CT_MAX_TOKENS];
        for (uint64_t p = 0; p < n; p++)
            ids[p] = ct_id(w, p);
        const pkv_status a = pkv_session_set_tokens(s, n, ids);
        if (a != pkv_session_set_tokens(t, n, ids))
            CT_FAIL(w, "thread %d: set_tokens differs from the twin's", w->id);
    } else if (op < 97) { /* a session from the prefix cache */
        if (w->n == CT_SESSIONS)
            return;
        const uint64_t n = 1 + pkvt_below(r, CT_MAX_TOKENS);
        int32_t ids[CT_MAX_TOKENS];
        for (uint64_t p = 0; p < n; p++)
            ids[p] = ct_id(w, p);
        uint64_t m = 0, mt = 0;
        if (pkv_session_from_prefix(w->e, n, ids, &w->s[w->n], &m) != PKV_OK ||
            pkv_session_from_prefix(w->twin, n, ids, &w->t[w->n], &mt) != PKV_OK)
            CT_FAIL(w, "thread %d: from_prefix failed", w->id);
        else if (m != mt)
            CT_FAIL(w, "thread %d: from_prefix reused %llu positions, the twin %llu", w->id,
                    (unsigned long long)m, (unsigned long long)mt);
        else
            w->n++;
    } else { /* the next read or write of the spill file fails */
        pkvi_io_inject_fault(pkvi_spill_io(spill_of(w->e)),
                             pkvt_below(r, 2) ? PKVI_FAULT_READ : PKVI_FAULT_WRITE,
                             1 + pkvt_below(r, 4));
        w->faults++;
    }
    pkv_memory m;
    if (pkv_session_memory(w->s[0], &m) != PKV_OK ||
        m.bytes_resident + m.bytes_spilled != m.blocks * PAGE_BYTES)
        CT_FAIL(w, "thread %d: pkv_session_memory does not add up", w->id);
}

static void *ct_main(void *arg)
{
    ct_worker *w = arg;
    pkvt_rng r;
    pkvt_rng_init(&r, w->seed);
    for (uint64_t k = 0; k < w->ops; k++) {
        if (k % CT_ROUND == 0) { /* a quiescent point: no call in flight */
            pthread_barrier_wait(w->barrier);
            if (w->id == 0 && !pkvi_engine_check(w->e))
                CT_FAIL(w, "the engine's invariants are broken at a quiescent point "
                        "(op %llu)", (unsigned long long)k);
            /* and the next read of the spill file fails, whatever the random steps
             * arm (a write that fails may be retried into free slots) */
            if (w->id == 0) {
                pkvi_io_inject_fault(pkvi_spill_io(spill_of(w->e)), PKVI_FAULT_READ, 1);
                w->faults++;
            }
            pthread_barrier_wait(w->barrier);
        }
        ct_step(w, &r);
        w->done++;
    }
    pthread_barrier_wait(w->barrier);
    for (uint32_t i = 0; i < w->n; i++) {
        pkv_session_destroy(w->s[i]);
        pkv_session_destroy(w->t[i]);
    }
    return NULL;
}

/* Beside the workers: the invariants whenever the lock is free, and the stats. */
typedef struct {
    pkv_engine *e;
    atomic_int *stop;
    uint64_t checks;
    bool ok, stats_ok;
} ct_checker;

static void *ct_check(void *arg)
{
    ct_checker *c = arg;
    const pkvi_ctx ctx = pkvi_engine_ctx(c->e);
    c->ok = c->stats_ok = true;
    while (!atomic_load(c->stop)) {
        c->ok &= pkvi_sessions_check(ctx.geom, ctx.cache, false);
        pkv_stats st;
        c->stats_ok &= pkv_engine_stats(c->e, &st) == PKV_OK &&
                       st.pages_in_use + st.pages_cached + st.pages_free <= CT_BUDGET;
        c->checks++;
        struct timespec ts = {0, 200 * 1000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void threads_run(void)
{
    pkv_engine *e = engine(CT_BUDGET, 2);
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, CT_THREADS);
    atomic_int stop;
    atomic_init(&stop, 0);
    static ct_worker w[CT_THREADS];
    pthread_t th[CT_THREADS], tc;
    const uint64_t ops = pkvt_quick() ? 150 : 1000;
    for (int i = 0; i < CT_THREADS; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].e = e;
        w[i].twin = engine(0, 1);
        w[i].barrier = &barrier;
        w[i].id = i;
        w[i].seed = pkvt_seed() + 1000 * (uint64_t)(i + 1);
        w[i].ops = ops;
        w[i].s[0] = pkvt_session(e);
        w[i].t[0] = pkvt_session(w[i].twin);
        w[i].n = 1;
        /* half full from the start (24 of the budget's 28 pages over the threads), so
         * the spill file is busy - and the armed faults fire - from the first calls,
         * also at quick counts */
        pkvt_rng r;
        pkvt_rng_init(&r, w[i].seed + 1);
        grow(w[i].s[0], w[i].t[0], &r, CT_MAX_TOKENS / 2);
    }
    ct_checker c = {.e = e, .stop = &stop};
    ck_assert_int_eq(pthread_create(&tc, NULL, ct_check, &c), 0);
    for (int i = 0; i < CT_THREADS; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, ct_main, &w[i]), 0);
    uint64_t done = 0, eio = 0, enomem = 0, faults = 0;
    for (int i = 0; i < CT_THREADS; i++) {
        pthread_join(th[i], NULL);
        done += w[i].done;
        eio += w[i].eio;
        enomem += w[i].enomem;
        faults += w[i].faults;
    }
    atomic_store(&stop, 1);
    pthread_join(tc, NULL);
    pkv_stats st;
    pkv_engine_stats(e, &st);
    printf("%d threads (%s): %llu calls, %llu faults armed, %llu EIO, %llu ENOMEM; %llu "
           "checks beside them\n", CT_THREADS, st.io_backend, (unsigned long long)done,
           (unsigned long long)faults, (unsigned long long)eio, (unsigned long long)enomem,
           (unsigned long long)c.checks);
    fflush(stdout);
    for (int i = 0; i < CT_THREADS; i++) {
        ck_assert_msg(!w[i].fail[0], "%s (seed %llu)", w[i].fail,
                      (unsigned long long)w[i].seed);
        pkv_engine_destroy(w[i].twin);
    }
    ck_assert_msg(c.ok, "the invariants broke while the lock was free");
    ck_assert_msg(c.stats_ok, "a stats snapshot broke the budget");
    ck_assert_uint_gt(eio, 0);   /* the failures did happen */
    ck_assert_uint_gt(c.checks, 0);
    ck_assert_uint_eq(st.pages_in_use, 0); /* the index keeps what it cached */
    ck_assert(pkvi_engine_check(e));
    pthread_barrier_destroy(&barrier);
    pkv_engine_destroy(e);
}

START_TEST(threads)
{
    pkvt_scratch_dir(dir, sizeof dir, "transit");
    threads_run();
    pkvt_remove_dir(dir);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("transit");
    TCase *tc = tcase_create("stalls");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, others_proceed);
    tcase_add_test(tc, waiters);
    tcase_add_test(tc, orphans);
    suite_add_tcase(s, tc);
    TCase *tt = tcase_create("threads");
    tcase_set_timeout(tt, 600);
    tcase_add_test(tt, threads);
    suite_add_tcase(s, tt);
    return pkvt_run(s);
}

/*
 * test_sharing.c - the rule every path that adds a reference to a page keeps
 * (btable.h, B5): a page that may still be written never gains a holder, and a
 * failed call never gives up a page it cannot get back.
 *
 * The race this guards against (docs/design.md, "Writes: reserve, then commit"): a prefill on a
 * fork `s` that failed after copying the shared tail used to re-share the original page on
 * rollback; if the owner of the original session `o` had meanwhile truncated into that page, seen
 * it unshared and released the lock but not yet written, `o`'s next row landed in the
 * page `s` shared again. Here the writer is forced to stall exactly there (the
 * session's write hook, pkvi_session_hook_before_write) while the other thread's
 * prefill runs and fails.
 */
#include "testutil.h"
#include "internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

enum { H = 2, G = 2, D = 4, BT = 4, ROW = G * D };

typedef struct {
    pkv_engine *e;
    pkv_session *o, *s;
    pthread_t writer;            /* o's owner: the thread the hook stalls */
    atomic_int prefill_done;
    pthread_barrier_t go;
    float rows[8][ROW];          /* o's rows */
    float q[H * D];
    pkv_status prefill_st, append_st;
    uint32_t delay_ns;           /* how long s's owner waits before its prefill */
    uint64_t stalls;
} race;

/* Stall o's writer (and only it) until s's prefill has returned, at most ~20 ms. */
static void stall_writer(void *ctx)
{
    race *r = ctx;
    if (!pthread_equal(pthread_self(), r->writer))
        return;
    r->stalls++;
    for (int i = 0; i < 20000 && !atomic_load(&r->prefill_done); i++) {
        struct timespec ts = {0, 1000};
        nanosleep(&ts, NULL);
    }
}

static void *writer_main(void *arg)
{
    race *r = arg;
    pthread_barrier_wait(&r->go);
    /* truncate into the page o shares with s, then write a new row into it */
    ck_assert_int_eq(pkv_session_truncate(r->o, 2), PKV_OK);
    r->append_st = pkv_append(r->o, 0, r->rows[6], r->rows[6]);
    return NULL;
}

static void *prefiller_main(void *arg)
{
    race *r = arg;
    float k[2][ROW], q[2][H * D], out[2][H * D];
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < ROW; i++) {
            k[t][i] = (float)(t + 1) * 0.25f - (float)i * 0.125f;
            q[t][i % (H * D)] = 0.5f;
        }
    pthread_barrier_wait(&r->go);
    struct timespec ts = {0, r->delay_ns};
    if (r->delay_ns)
        nanosleep(&ts, NULL);
    /* row 3 copies the shared tail, row 4 needs one page more than the budget has */
    r->prefill_st = pkv_prefill(r->s, 0, 2, q[0], k[0], k[0], out[0]);
    atomic_store(&r->prefill_done, 1);
    return NULL;
}

START_TEST(a_stalled_writer_never_writes_into_a_fork)
{
    pkv_config c = pkv_config_default();
    c.n_layers = 1;
    c.n_heads = H;
    c.n_kv_heads = G;
    c.head_dim = D;
    c.block_tokens = BT;
    c.n_threads = 1;
    const uint64_t pb = 2ull * G * BT * D * sizeof(float);
    c.mem_budget = 2 * pb; /* the shared page and one more */
    race r;
    memset(&r, 0, sizeof r);
    ck_assert_int_eq(pkv_engine_create(&c, &r.e), PKV_OK);
    pkvt_rng rng;
    const uint64_t seed = pkvt_seed();
    pkvt_rng_init(&rng, seed);
    pkvt_fill(&rng, r.rows[0], sizeof r.rows / sizeof(float), -1, 1);
    pkvt_fill(&rng, r.q, H * D, -1, 1);
    ck_assert_int_eq(pkv_session_create(r.e, &r.o), PKV_OK);
    pkvi_session_hook_before_write(r.o, stall_writer, &r);

    const int iters = pkvt_quick() ? 60 : 400;
    uint64_t changed = 0, prefill_failed = 0;
    for (int it = 0; it < iters; it++) {
        /* o: 4 rows (one full page); s: a fork truncated to 3, so both hold the page
         * and s's tail is partly filled */
        ck_assert_int_eq(pkv_session_truncate(r.o, 0), PKV_OK);
        for (int t = 0; t < 4; t++)
            ck_assert_int_eq(pkv_append(r.o, 0, r.rows[t], r.rows[t]), PKV_OK);
        ck_assert_int_eq(pkv_session_fork(r.o, &r.s), PKV_OK);
        ck_assert_int_eq(pkv_session_truncate(r.s, 3), PKV_OK);
        float before[H * D], after[H * D];
        ck_assert_int_eq(pkv_decode(r.s, 0, r.q, before), PKV_OK);

        atomic_store(&r.prefill_done, 0);
        r.delay_ns = pkvt_below(&rng, 20000);
        pthread_barrier_init(&r.go, NULL, 2);
        pthread_t pf;
        ck_assert_int_eq(pthread_create(&r.writer, NULL, writer_main, &r), 0);
        ck_assert_int_eq(pthread_create(&pf, NULL, prefiller_main, &r), 0);
        pthread_join(r.writer, NULL);
        pthread_join(pf, NULL);
        pthread_barrier_destroy(&r.go);

        ck_assert_msg(pkvi_engine_check(r.e), "invariants broken, iteration %d seed %llu",
                      it, (unsigned long long)seed);
        if (r.prefill_st != PKV_OK) {
            prefill_failed++;
            ck_assert_int_eq(r.prefill_st, PKV_ENOMEM);
            ck_assert_uint_eq(pkv_session_len(r.s, 0), 3);
            ck_assert_int_eq(pkv_decode(r.s, 0, r.q, after), PKV_OK);
            changed += memcmp(before, after, sizeof before) != 0;
        }
        /* o holds its rows 0, 1 and the new one, whatever happened to s */
        if (r.append_st == PKV_OK) {
            pkv_session *x;
            float want[H * D], got[H * D];
            ck_assert_int_eq(pkv_session_create(r.e, &x), PKV_OK);
            pkv_session_destroy(r.s); /* room for x's page */
            r.s = NULL;
            const int ids[3] = {0, 1, 6};
            for (int t = 0; t < 3; t++)
                ck_assert_int_eq(pkv_append(x, 0, r.rows[ids[t]], r.rows[ids[t]]), PKV_OK);
            ck_assert_int_eq(pkv_decode(x, 0, r.q, want), PKV_OK);
            ck_assert_int_eq(pkv_decode(r.o, 0, r.q, got), PKV_OK);
            ck_assert_msg(memcmp(want, got, sizeof want) == 0,
                          "o's rows changed, iteration %d seed %llu", it,
                          (unsigned long long)seed);
            pkv_session_destroy(x);
        }
        pkv_session_destroy(r.s);
        r.s = NULL;
    }
    fprintf(stderr, "sharing race: %d iterations, %llu failed prefills, %llu writer stalls, "
                    "%llu changed decodes\n", iters, (unsigned long long)prefill_failed,
            (unsigned long long)r.stalls, (unsigned long long)changed);
    ck_assert_msg(changed == 0, "%llu of %llu failed prefills changed the fork (seed %llu)",
                  (unsigned long long)changed, (unsigned long long)prefill_failed,
                  (unsigned long long)seed);
    ck_assert_uint_gt(prefill_failed, 0); /* the scenario really ran */
    pkv_session_destroy(r.o);
    pkv_engine_destroy(r.e);
}
END_TEST

/* The invariant check sees a broken B5: a shared page marked as being written. */
START_TEST(the_check_catches_a_shared_page_being_written)
{
    pkv_engine *e = pkvt_engine(1, H, G, D, BT, PKV_F32);
    pkv_session *a, *b;
    float kv[ROW] = {0};
    ck_assert_int_eq(pkv_session_create(e, &a), PKV_OK);
    ck_assert_int_eq(pkv_append(a, 0, kv, kv), PKV_OK);
    ck_assert_int_eq(pkv_session_fork(a, &b), PKV_OK);
    ck_assert(pkvi_engine_check(e));
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkvi_page *pg = pkvi_btable_page(a->layers[0], 0);
    atomic_store(&pg->writing, 1);
    ck_assert(!pkvi_engine_check(e));
    ck_assert_int_eq(pkv_engine_check(e), PKV_ECORRUPT);
    atomic_store(&pg->writing, 0);
    pkvi_page_skew_refs(pg, +1); /* E3: a count that no table backs */
    ck_assert(!pkvi_engine_check(e));
    pkvi_page_skew_refs(pg, -1);
    ck_assert(pkvi_engine_check(e));
    pkv_session_destroy(b);
    pkv_session_destroy(a);
    pkv_engine_destroy(e);
}
END_TEST

/* A failed prefill on a fork leaves its sharing exactly as it was: no page given up. */
START_TEST(a_failed_prefill_gives_up_no_page)
{
    pkv_config c = pkv_config_default();
    c.n_layers = 1;
    c.n_heads = H;
    c.n_kv_heads = G;
    c.head_dim = D;
    c.block_tokens = BT;
    c.mem_budget = 2ull * (2ull * G * BT * D * sizeof(float));
    pkv_engine *e;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_OK);
    pkv_session *o, *s;
    float kv[ROW], q[2][H * D], out[2][H * D];
    for (int i = 0; i < ROW; i++)
        kv[i] = (float)i / 8.0f;
    memset(q, 0, sizeof q);
    ck_assert_int_eq(pkv_session_create(e, &o), PKV_OK);
    for (int t = 0; t < 3; t++)
        ck_assert_int_eq(pkv_append(o, 0, kv, kv), PKV_OK);
    ck_assert_int_eq(pkv_session_fork(o, &s), PKV_OK);
    pkv_page_info before[2], after[2];
    uint64_t n;
    ck_assert_int_eq(pkv_session_pages(s, 0, 0, 2, before, &n), PKV_OK);
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_eq(before[0].refs, 2);
    /* 1 + 4 rows: the copy of the tail and one more page, one more than the budget */
    float k5[5][ROW];
    for (int t = 0; t < 5; t++)
        memcpy(k5[t], kv, sizeof kv);
    float q5[5][H * D], o5[5][H * D];
    memset(q5, 0, sizeof q5);
    ck_assert_int_eq(pkv_prefill(s, 0, 5, q5[0], k5[0], k5[0], o5[0]), PKV_ENOMEM);
    ck_assert_int_eq(pkv_session_pages(s, 0, 0, 2, after, &n), PKV_OK);
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_eq(after[0].id, before[0].id);
    ck_assert_uint_eq(after[0].refs, 2);
    ck_assert_uint_eq(pkv_session_len(s, 0), 3);
    ck_assert(pkvi_engine_check(e));
    /* what fits does succeed */
    ck_assert_int_eq(pkv_prefill(s, 0, 1, q[0], kv, kv, out[0]), PKV_OK);
    ck_assert_int_eq(pkv_session_pages(s, 0, 0, 2, after, &n), PKV_OK);
    ck_assert(after[0].id != before[0].id);
    ck_assert_uint_eq(after[0].refs, 1);
    pkv_session_destroy(s);
    pkv_session_destroy(o);
    pkv_engine_destroy(e);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("sharing");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, a_stalled_writer_never_writes_into_a_fork);
    tcase_add_test(tc, the_check_catches_a_shared_page_being_written);
    tcase_add_test(tc, a_failed_prefill_gives_up_no_page);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

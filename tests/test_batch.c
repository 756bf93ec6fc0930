/*
 * test_batch.c - pkv_decode_batch reads a page once for all the sessions of the batch
 * that hold it (docs/speculative.md): forks, prefix-cache sessions, shards and spilled sessions
 * in random batches give, to the bit, what separate pkv_decode calls give, for every
 * dtype, variant and thread count; the stats count the pages read shared and private
 * exactly; a batch that cannot get the executor's scratch decodes each session alone,
 * with the same bits.
 */
#include "testutil.h"
#include "internal.h"

#include <stdlib.h>
#include <string.h>

enum { NS = 72 }; /* more than a run (PKVI_BATCH_MAX) */

typedef struct {
    pkv_config c;
    pkv_layer_config lc[2];
    float logits[16];
} bcase;

static void random_bcase(pkvt_rng *r, bcase *k)
{
    static const uint32_t hg[][2] = {{1, 1}, {4, 2}, {8, 2}, {6, 3}, {16, 4}};
    static const uint32_t bts[] = {1, 2, 3, 4, 16};
    memset(k, 0, sizeof *k);
    const uint32_t *p = hg[pkvt_below(r, 5)];
    k->c = pkvt_config(2, p[0], p[1], (uint32_t[]){1, 5, 16, 32}[pkvt_below(r, 4)],
                       bts[pkvt_below(r, 5)], (pkv_dtype)pkvt_below(r, 5));
    if (pkvt_below(r, 3) == 0)
        k->c.head_dim_v = 1 + pkvt_below(r, 12);
    if ((k->c.kv_dtype == PKV_Q8 || k->c.kv_dtype == PKV_Q4) && pkvt_below(r, 2))
        k->c.quant_dot = 1;
    /* layer 1 a variant: a window (sinks), soft-cap, or sink logits */
    switch (pkvt_below(r, 3)) {
    case 0:
        k->lc[1].window = 1 + pkvt_below(r, 20);
        k->lc[1].sink_tokens = pkvt_below(r, 3);
        break;
    case 1:
        k->lc[1].softcap = 10.0f;
        break;
    default:
        for (uint32_t i = 0; i < p[0]; i++)
            k->logits[i] = 0.25f * (float)i - 1.0f;
        k->lc[1].sink_logits = k->logits;
        break;
    }
    k->c.layer_cfg = k->lc;
    k->c.n_threads = 1 + pkvt_below(r, 3);
}

/* Random sessions that share pages every way the engine lets them: a parent, forks
 * that go on (some not at all), prefix-cache sessions, unrelated ones, a shard and
 * its forks. Returns how many. */
static uint32_t make_sessions(pkv_engine *e, const pkv_config *c, pkvt_rng *r,
                              pkv_session **ss)
{
    const uint32_t bt = c->block_tokens;
    uint32_t n = 0;
    pkv_session *parent = pkvt_session(e);
    const uint64_t len0 = 1 + pkvt_below(r, 8 * bt + 40);
    int32_t ids[2048];
    for (uint32_t i = 0; i < 2048; i++)
        ids[i] = (int32_t)i;
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(parent, r, l, len0, 1.5f, 2.0f);
    ck_assert_int_eq(pkv_session_set_tokens(parent, len0, ids), PKV_OK);
    ss[n++] = parent;
    const uint32_t forks = pkvt_below(r, 30);
    for (uint32_t i = 0; i < forks && n < NS; i++) {
        pkv_session *f = NULL;
        ck_assert_int_eq(pkv_session_fork(ss[pkvt_below(r, n)], &f), PKV_OK);
        const uint32_t more = pkvt_below(r, 3) ? pkvt_below(r, 2 * bt + 3) : 0;
        for (uint32_t l = 0; l < 2; l++)
            pkvt_append_random(f, r, l, more, 1.5f, 2.0f);
        ss[n++] = f;
    }
    const uint32_t prefixed = pkvt_below(r, 8);
    for (uint32_t i = 0; i < prefixed && n < NS; i++) {
        pkv_session *f = NULL;
        uint64_t got = 0;
        ck_assert_int_eq(pkv_session_from_prefix(e, len0 + 1, ids, &f, &got), PKV_OK);
        for (uint32_t l = 0; l < 2; l++)
            pkvt_append_random(f, r, l, 1 + pkvt_below(r, 2 * bt), 1.5f, 2.0f);
        ss[n++] = f;
    }
    const uint32_t alone = pkvt_below(r, 6);
    for (uint32_t i = 0; i < alone && n < NS; i++) {
        pkv_session *f = pkvt_session(e);
        for (uint32_t l = 0; l < 2; l++)
            pkvt_append_random(f, r, l, 1 + pkvt_below(r, 4 * bt), 1.5f, 2.0f);
        ss[n++] = f;
    }
    if (pkvt_below(r, 3) == 0 && n + 3 <= NS) { /* a shard and two forks of it */
        pkv_session *sh = pkvt_session(e);
        ck_assert_int_eq(pkv_session_set_first(sh, pkv_shard_align(e)), PKV_OK);
        for (uint32_t l = 0; l < 2; l++)
            pkvt_append_random(sh, r, l, 1 + pkvt_below(r, 3 * bt), 1.5f, 2.0f);
        ss[n++] = sh;
        for (uint32_t i = 0; i < 2; i++) {
            pkv_session *f = NULL;
            ck_assert_int_eq(pkv_session_fork(sh, &f), PKV_OK);
            for (uint32_t l = 0; l < 2; l++)
                pkvt_append_random(f, r, l, pkvt_below(r, 2), 1.5f, 2.0f);
            ss[n++] = f;
        }
    }
    return n;
}

/* A batch of the sessions in random order against pkv_decode of each: the same bits. */
static void batch_vs_single(pkv_engine *e, const pkv_config *c, pkvt_rng *r,
                            pkv_session **ss, uint32_t n, uint64_t seed)
{
    const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
    const size_t qd = (size_t)c->n_heads * c->head_dim, od = (size_t)c->n_heads * dv;
    pkv_session *b[NS];
    memcpy(b, ss, n * sizeof *b);
    for (uint32_t i = n; i > 1; i--) {
        const uint32_t j = pkvt_below(r, i);
        pkv_session *t = b[i - 1];
        b[i - 1] = b[j];
        b[j] = t;
    }
    float *q = pkvt_calloc(n * qd, sizeof(float));
    float *o1 = pkvt_calloc(n * od, sizeof(float)), *o2 = pkvt_calloc(n * od, sizeof(float));
    for (uint32_t l = 0; l < 2; l++) {
        pkvt_fill(r, q, n * qd, -1.5f, 1.5f);
        ck_assert_int_eq(pkv_decode_batch(e, l, n, b, q, o1), PKV_OK);
        for (uint32_t i = 0; i < n; i++)
            ck_assert_int_eq(pkv_decode(b[i], l, q + i * qd, o2 + i * od), PKV_OK);
        for (uint32_t i = 0; i < n; i++)
            ck_assert_msg(memcmp(o1 + i * od, o2 + i * od, od * sizeof(float)) == 0,
                          "seed %llu: layer %u, session %u of %u: batch != decode",
                          (unsigned long long)seed, l, i, n);
    }
    free(q);
    free(o1);
    free(o2);
}

START_TEST(shared_batches_are_separate_decodes)
{
    const uint64_t seed0 = pkvt_seed();
    const uint32_t cases = pkvt_quick() ? 12 : 60;
    for (uint32_t t = 0; t < cases; t++) {
        const uint64_t seed = seed0 + t * 0x9E3779B97F4A7C15ull;
        pkvt_rng r;
        pkvt_rng_init(&r, seed);
        bcase k;
        random_bcase(&r, &k);
        pkv_engine *e =
            k.c.n_threads > 1 ? pkvt_engine_workers(&k.c) : pkvt_engine_cfg(&k.c);
        pkv_session *ss[NS];
        const uint32_t n = make_sessions(e, &k.c, &r, ss);
        batch_vs_single(e, &k.c, &r, ss, n, seed);
        /* and with the scratch held elsewhere: every session alone */
        pkvi_exec *x = pkvi_engine_ctx(e).exec;
        ck_assert_ptr_nonnull(pkvi_exec_scratch_take(x, 1));
        pkv_stats a, b;
        ck_assert_int_eq(pkv_engine_stats(e, &a), PKV_OK);
        batch_vs_single(e, &k.c, &r, ss, n, seed);
        ck_assert_int_eq(pkv_engine_stats(e, &b), PKV_OK);
        ck_assert_uint_eq(a.pages_read_shared, b.pages_read_shared);
        pkvi_exec_scratch_put(x);
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        for (uint32_t i = 0; i < n; i++)
            pkv_session_destroy(ss[i]);
        pkv_engine_destroy(e);
    }
}
END_TEST

/* The stats count exactly: 4 sessions sharing 8 full pages, 3 of them with a page of
 * their own, read in one batch: 8 pages shared (sparing 24 reads), 3 private. */
START_TEST(stats_count_shared_and_private_pages)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    pkv_config c = pkvt_config(1, 8, 2, 16, 4, PKV_F16);
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *ss[4];
    ss[0] = pkvt_session(e);
    pkvt_append_random(ss[0], &r, 0, 32, 1.5f, 2.0f);
    for (uint32_t i = 1; i < 4; i++) {
        ck_assert_int_eq(pkv_session_fork(ss[0], &ss[i]), PKV_OK);
        pkvt_append_random(ss[i], &r, 0, i, 1.5f, 2.0f);
    }
    float q[4 * 8 * 16], out[4 * 8 * 16];
    pkvt_fill(&r, q, sizeof q / sizeof *q, -1, 1);
    pkv_stats a, b;
    ck_assert_int_eq(pkv_engine_stats(e, &a), PKV_OK);
    ck_assert_int_eq(pkv_decode_batch(e, 0, 4, ss, q, out), PKV_OK);
    ck_assert_int_eq(pkv_engine_stats(e, &b), PKV_OK);
    ck_assert_uint_eq(b.pages_read_shared - a.pages_read_shared, 8);
    ck_assert_uint_eq(b.page_reads_saved - a.page_reads_saved, 24);
    ck_assert_uint_eq(b.pages_read_private - a.pages_read_private, 3);
    /* a decode alone: its 9 pages private */
    ck_assert_int_eq(pkv_decode(ss[1], 0, q, out), PKV_OK);
    ck_assert_int_eq(pkv_engine_stats(e, &a), PKV_OK);
    ck_assert_uint_eq(a.pages_read_private - b.pages_read_private, 9);
    ck_assert_uint_eq(a.pages_read_shared, b.pages_read_shared);
    for (uint32_t i = 0; i < 4; i++)
        pkv_session_destroy(ss[i]);
    pkv_engine_destroy(e);
}
END_TEST

/* Spilled sessions in a batch: brought back, then read shared, the same bits. */
START_TEST(spilled_sessions_in_a_shared_batch)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    char dir[256];
    pkvt_scratch_dir(dir, sizeof dir, "batch-spill");
    pkv_config c = pkvt_config(2, 4, 2, 8, 4, PKV_F32);
    const uint64_t page = 2ull * 2 * 4 * 8 * 4;
    c.mem_budget = 40 * page;
    c.spill_dir = dir;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *ss[NS];
    uint32_t n = 0;
    ss[n++] = pkvt_session(e);
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(ss[0], &r, l, 30, 1.5f, 2.0f);
    for (uint32_t i = 0; i < 5; i++) {
        ck_assert_int_eq(pkv_session_fork(ss[0], &ss[n]), PKV_OK);
        for (uint32_t l = 0; l < 2; l++)
            pkvt_append_random(ss[n], &r, l, 1 + i, 1.5f, 2.0f);
        n++;
    }
    pkv_session *big = pkvt_session(e); /* pushes the family out */
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(big, &r, l, 60, 1.5f, 2.0f);
    pkv_memory m;
    ck_assert_int_eq(pkv_session_memory(ss[0], &m), PKV_OK);
    ck_assert_uint_gt(m.bytes_spilled, 0);
    batch_vs_single(e, &c, &r, ss, n, pkvt_seed());
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    for (uint32_t i = 0; i < n; i++)
        pkv_session_destroy(ss[i]);
    pkv_session_destroy(big);
    pkv_engine_destroy(e);
    pkvt_remove_dir(dir);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("batch");
    TCase *tc = tcase_create("batch");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, shared_batches_are_separate_decodes);
    tcase_add_test(tc, stats_count_shared_and_private_pages);
    tcase_add_test(tc, spilled_sessions_in_a_shared_batch);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

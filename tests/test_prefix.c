/*
 * test_prefix.c - the prefix cache (docs/prefix-cache.md): pkv_session_set_tokens,
 * pkv_session_from_prefix, prefix_cache_bytes and the stats.
 *
 * K/V rows are a function of the token prefix they follow (rows_for: a hash of ids
 * [0, p] seeds the row of position p), as a real model's are; so a session built from
 * the cache must hold exactly the rows a cold session that appended the same tokens
 * holds, and its decode must be bitwise that session's (checked against a second
 * engine that never uses the cache).
 *
 * The model-based walk keeps a trivial model of the index: with an unbounded cache,
 * the set of page prefixes ever recorded (a page index of a session is in the set
 * once set_tokens covered it). from_prefix must return exactly the longest recorded
 * prefix in whole pages, at most n - 1 positions. After every step: pkv_engine_check,
 * pages_in_use + pages_cached + pages_free == the pool's buffers, pages_in_use ==
 * the distinct pages live sessions name, and every session's bytes_shared == its
 * pages another session names too.
 */
#include "testutil.h"
#include "internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { H = 2, G = 1, D = 4, BT = 4, L = 2, ROW = G * D, VOCAB = 3, MAXS = 8, MAXT = 96 };

/* ---- rows that follow from the tokens --------------------------------------------- */

static uint64_t mix(uint64_t h, int32_t t)
{
    h ^= (uint32_t)t + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

/* Append positions [from, n) of tokens to every layer of s. */
static void append_tokens(pkv_session *s, const int32_t *tokens, uint64_t from, uint64_t n)
{
    uint64_t h = 1;
    for (uint64_t p = 0; p < n; p++) {
        h = mix(h, tokens[p]);
        if (p < from)
            continue;
        for (uint32_t l = 0; l < L; l++) {
            pkvt_rng r;
            pkvt_rng_init(&r, h + l);
            float k[ROW], v[ROW];
            pkvt_fill(&r, k, ROW, -1, 1);
            pkvt_fill(&r, v, ROW, -1, 1);
            ck_assert_int_eq(pkv_append(s, l, k, v), PKV_OK);
        }
    }
}

static pkv_engine *engine(uint64_t cache_bytes, uint64_t budget, const char *spill,
                          const pkv_layer_config *lc)
{
    pkv_config c = pkvt_config(L, H, G, D, BT, PKV_F32);
    c.prefix_cache_bytes = cache_bytes;
    c.mem_budget = budget;
    c.spill_dir = spill;
    c.layer_cfg = lc;
    c.n_threads = 1;
    return pkvt_engine_cfg(&c);
}

/* Decode of every layer of s equals (bitwise) that of a cold session of ref that
 * appended the same tokens. */
static void assert_like_cold(pkv_engine *ref, pkv_session *s, const int32_t *tokens,
                             uint64_t n, uint64_t seed)
{
    if (n == 0)
        return;
    pkv_session *c = pkvt_session(ref);
    append_tokens(c, tokens, 0, n);
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    for (uint32_t l = 0; l < L; l++) {
        float q[H * D], a[H * D], b[H * D];
        pkvt_fill(&r, q, H * D, -2, 2);
        ck_assert_int_eq(pkv_decode(s, l, q, a), PKV_OK);
        ck_assert_int_eq(pkv_decode(c, l, q, b), PKV_OK);
        ck_assert_msg(memcmp(a, b, sizeof a) == 0, "layer %u: cached decode differs", l);
    }
    pkv_session_destroy(c);
}

/* ---- the accounting every step checks ---------------------------------------------- */

static void assert_accounting(pkv_engine *e, pkv_session *const *ss, int n)
{
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_stats st;
    ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
    ck_assert_uint_eq(st.pages_in_use + st.pages_cached + st.pages_free, pkvi_pool_count(pkvi_engine_ctx(e).cache->pool).allocated);
    /* distinct resident pages of live sessions, and how many sessions name each */
    uint64_t ids[MAXS * L * (MAXT / BT + 2)];
    uint32_t holders[MAXS * L * (MAXT / BT + 2)];
    uint64_t n_ids = 0;
    for (int i = 0; i < n; i++)
        for (uint32_t l = 0; l < L; l++) {
            pkv_page_info pi[MAXT / BT + 2];
            uint64_t got = 0;
            ck_assert_int_eq(pkv_session_pages(ss[i], l, 0, MAXT / BT + 2, pi, &got), PKV_OK);
            for (uint64_t k = 0; k < got; k++) {
                if (!pi[k].id || !pi[k].resident)
                    continue;
                uint64_t j = 0;
                while (j < n_ids && ids[j] != pi[k].id)
                    j++;
                if (j == n_ids) {
                    ids[n_ids] = pi[k].id;
                    holders[n_ids++] = 0;
                }
                holders[j]++;
                ck_assert_uint_ge(pi[k].refs, 1);
            }
        }
    ck_assert_uint_eq(st.pages_in_use, n_ids);
    for (int i = 0; i < n; i++) {
        uint64_t shared = 0;
        for (uint32_t l = 0; l < L; l++) {
            pkv_page_info pi[MAXT / BT + 2];
            uint64_t got = 0;
            pkv_session_pages(ss[i], l, 0, MAXT / BT + 2, pi, &got);
            for (uint64_t k = 0; k < got; k++) {
                if (!pi[k].id || !pi[k].resident)
                    continue;
                uint64_t j = 0;
                while (ids[j] != pi[k].id)
                    j++;
                shared += holders[j] > 1;
            }
        }
        pkv_memory m;
        ck_assert_int_eq(pkv_session_memory(ss[i], &m), PKV_OK);
        ck_assert_uint_eq(m.bytes_shared, shared * st.page_bytes);
    }
}

/* ---- the model -------------------------------------------------------------------------- */

typedef struct {
    int32_t tok[MAXT];
    uint64_t len, recorded;
} msess;

typedef struct {
    int32_t (*keys)[MAXT];   /* recorded page prefixes: keys[i][0 .. lens[i]) */
    uint64_t *lens;
    uint64_t n, cap;
} mindex;

static bool mindex_has(const mindex *x, const int32_t *t, uint64_t len)
{
    for (uint64_t i = 0; i < x->n; i++)
        if (x->lens[i] == len && memcmp(x->keys[i], t, len * sizeof *t) == 0)
            return true;
    return false;
}

static void mindex_record(mindex *x, const int32_t *t, uint64_t n)
{
    for (uint64_t p = 1; p * BT <= n; p++) {
        if (mindex_has(x, t, p * BT))
            continue;
        if (x->n == x->cap) {
            x->cap = x->cap ? 2 * x->cap : 64;
            x->keys = realloc(x->keys, x->cap * sizeof *x->keys);
            x->lens = realloc(x->lens, x->cap * sizeof *x->lens);
            ck_assert(x->keys && x->lens);
        }
        memcpy(x->keys[x->n], t, p * BT * sizeof *t);
        x->lens[x->n++] = p * BT;
    }
}

static uint64_t mindex_match(const mindex *x, const int32_t *t, uint64_t n)
{
    uint64_t m = 0;
    while ((m + 1) * BT <= (n ? n - 1 : 0) && mindex_has(x, t, (m + 1) * BT))
        m++;
    return m * BT;
}

static void random_tokens(pkvt_rng *r, int32_t *t, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        t[i] = (int32_t)pkvt_below(r, VOCAB);
}

static void model_walk(bool collide, const char *dir)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ (collide ? 77 : 0));
    pkv_engine *e = engine(UINT64_MAX, 0, NULL, NULL);
    pkv_engine *ref = engine(0, 0, NULL, NULL);
    pkvi_prefix_set_collide(&pkvi_engine_ctx(e).cache->prefix, collide);
    pkv_session *ss[MAXS];
    msess ms[MAXS];
    int n = 0;
    mindex mx = {0};
    uint64_t hits = 0, lookups = 0;
    const int steps = pkvt_quick() ? 500 : 2000;
    char path[512];
    snprintf(path, sizeof path, "%s/s.pkv", dir);
    for (int step = 0; step < steps; step++) {
        /* from_prefix twice as often as the rest; a full table makes room first */
        uint32_t op = pkvt_below(&r, 10);
        op = op == 9 ? 3 : op;
        if (n == MAXS && (op == 0 || op == 3 || op == 4) && pkvt_below(&r, 2))
            op = 6;
        const int i = n ? (int)pkvt_below(&r, (uint32_t)n) : -1;
        if (op == 0 && n < MAXS) {                       /* create */
            ss[n] = pkvt_session(e);
            memset(&ms[n], 0, sizeof ms[n]);
            n++;
        } else if (op == 1 && i >= 0) {                  /* append */
            msess *m = &ms[i];
            uint64_t k = 1 + pkvt_below(&r, 24);
            if (m->len + k > MAXT)
                k = MAXT - m->len;
            random_tokens(&r, m->tok + m->len, k);
            append_tokens(ss[i], m->tok, m->len, m->len + k);
            m->len += k;
        } else if (op == 2 && i >= 0) {                  /* set_tokens */
            msess *m = &ms[i];
            const uint64_t to = pkvt_below(&r, 2) ? m->len
                                : m->recorded + pkvt_below(&r, (uint32_t)(m->len - m->recorded + 1));
            ck_assert_int_eq(pkv_session_set_tokens(ss[i], to, m->tok), PKV_OK);
            if (to > m->recorded)
                m->recorded = to;
            mindex_record(&mx, m->tok, m->recorded);
        } else if (op == 3 && n < MAXS) {                /* from_prefix */
            int32_t t[MAXT];
            uint64_t len = 1 + pkvt_below(&r, MAXT);
            random_tokens(&r, t, len);
            if (i >= 0 && pkvt_below(&r, 4) != 0) {      /* mostly: a live prefix */
                const uint64_t keep = pkvt_below(&r, 2) ? ms[i].len
                                                        : pkvt_below(&r, (uint32_t)ms[i].len + 1);
                memcpy(t, ms[i].tok, keep * sizeof *t);
            }
            const uint64_t want = mindex_match(&mx, t, len);
            uint64_t got = 12345;
            ck_assert_int_eq(pkv_session_from_prefix(e, len, t, &ss[n], &got), PKV_OK);
            ck_assert_uint_eq(got, want);
            lookups++;
            hits += got;
            memset(&ms[n], 0, sizeof ms[n]);
            memcpy(ms[n].tok, t, got * sizeof *t);
            ms[n].len = ms[n].recorded = got;
            for (uint32_t l = 0; l < L; l++)
                ck_assert_uint_eq(pkv_session_len(ss[n], l), got);
            n++;
        } else if (op == 4 && i >= 0 && n < MAXS) {      /* fork */
            ck_assert_int_eq(pkv_session_fork(ss[i], &ss[n]), PKV_OK);
            ms[n] = ms[i];
            n++;
        } else if (op == 5 && i >= 0) {                  /* truncate */
            const uint64_t back = pkvt_below(&r, 4) ? pkvt_below(&r, 9) : ms[i].len;
            const uint64_t to = back >= ms[i].len ? pkvt_below(&r, (uint32_t)ms[i].len + 1)
                                                  : ms[i].len - back;
            ck_assert_int_eq(pkv_session_truncate(ss[i], to), PKV_OK);
            ms[i].len = to;
            if (ms[i].recorded > to)
                ms[i].recorded = to;
        } else if (op == 6 && i >= 0) {                  /* destroy */
            pkv_session_destroy(ss[i]);
            ss[i] = ss[n - 1];
            ms[i] = ms[n - 1];
            n--;
        } else if (op == 7 && i >= 0 && pkvt_below(&r, 3) == 0) { /* save, destroy, load */
            ck_assert_int_eq(pkv_session_save(ss[i], path), PKV_OK);
            pkv_file_info fi;
            ck_assert_int_eq(pkv_session_file_check(path, &fi, NULL, 0), PKV_OK);
            ck_assert_uint_eq(fi.version, ms[i].recorded ? 3 : 1);
            ck_assert_uint_eq(fi.n_token_ids, ms[i].recorded);
            pkv_session_destroy(ss[i]);
            ck_assert_int_eq(pkv_session_load(e, path, &ss[i]), PKV_OK);
        } else if (op == 8 && i >= 0) {                  /* exactness */
            assert_like_cold(ref, ss[i], ms[i].tok, ms[i].len, pkvt_next(&r));
            /* the record is what the model says: extending it by a wrong id fails */
            if (ms[i].recorded > 0) {
                int32_t bad[MAXT];
                memcpy(bad, ms[i].tok, ms[i].recorded * sizeof *bad);
                bad[ms[i].recorded - 1] ^= 1;
                ck_assert_int_eq(pkv_session_set_tokens(ss[i], ms[i].recorded, bad),
                                 PKV_EINVAL);
            }
        }
        assert_accounting(e, ss, n);
    }
    pkv_stats st;
    ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
    ck_assert_uint_eq(st.prefix_lookups, lookups);
    ck_assert_uint_eq(st.prefix_hit_tokens, hits);
    ck_assert_uint_gt(hits, 0);
    unlink(path);
    free(mx.keys);
    free(mx.lens);
    pkv_engine_destroy(e);
    pkv_engine_destroy(ref);
}

START_TEST(model_based)
{
    char dir[256];
    pkvt_scratch_dir(dir, sizeof dir, "prefix");
    model_walk(false, dir);
    pkvt_remove_dir(dir);
}
END_TEST

/* Every hash equal: one bucket, and matches still compare the ids. */
START_TEST(forced_collisions)
{
    char dir[256];
    pkvt_scratch_dir(dir, sizeof dir, "prefix");
    model_walk(true, dir);
    pkvt_remove_dir(dir);
    /* and directly: two prompts that differ in one id of their second page */
    pkv_engine *e = engine(UINT64_MAX, 0, NULL, NULL);
    pkvi_prefix_set_collide(&pkvi_engine_ctx(e).cache->prefix, true);
    int32_t a[17], b[17];
    for (int i = 0; i < 17; i++)
        a[i] = b[i] = i;
    b[6] = 99;
    pkv_session *s = pkvt_session(e), *f = NULL;
    append_tokens(s, a, 0, 16);
    ck_assert_int_eq(pkv_session_set_tokens(s, 16, a), PKV_OK);
    uint64_t got = 0;
    ck_assert_int_eq(pkv_session_from_prefix(e, 17, b, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, BT);          /* the first page only */
    pkv_session_destroy(f);
    ck_assert_int_eq(pkv_session_from_prefix(e, 17, a, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 16);
    pkv_session_destroy(f);
    ck_assert_int_eq(pkv_session_from_prefix(e, 16, a, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 12);          /* at most n - 1 positions */
    pkv_session_destroy(f);
    pkv_session_destroy(s);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_engine_destroy(e);
}
END_TEST

/* Retention: a destroyed session's pages stay cached up to prefix_cache_bytes, least
 * recently used dropped first; 0 keeps none. */
START_TEST(retention_lru)
{
    for (int limit_pages = 0; limit_pages <= 8; limit_pages += 4) {
        pkv_engine *e = engine(0, 0, NULL, NULL);
        pkv_stats st;
        pkv_engine_stats(e, &st);
        pkv_engine_destroy(e);
        e = engine((uint64_t)limit_pages * st.page_bytes, 0, NULL, NULL);
        int32_t a[9] = {1, 1, 1, 1, 2, 2, 2, 2, 3}, b[9] = {5, 5, 5, 5, 6, 6, 6, 6, 7};
        pkv_session *s = pkvt_session(e), *t = pkvt_session(e), *f;
        append_tokens(s, a, 0, 8);
        append_tokens(t, b, 0, 8);
        ck_assert_int_eq(pkv_session_set_tokens(s, 8, a), PKV_OK);
        ck_assert_int_eq(pkv_session_set_tokens(t, 8, b), PKV_OK);
        pkv_session_destroy(s);          /* a: 2 pages x 2 layers cached */
        pkv_session_destroy(t);          /* b: 4 more; b is the newer */
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        pkv_engine_stats(e, &st);
        ck_assert_uint_eq(st.pages_cached, (uint64_t)(limit_pages < 8 ? limit_pages : 8));
        ck_assert_uint_eq(st.pages_in_use, 0);
        uint64_t got = 0;
        ck_assert_int_eq(pkv_session_from_prefix(e, 9, b, &f, &got), PKV_OK);
        ck_assert_uint_eq(got, limit_pages >= 4 ? 8 : 0);  /* b survived: newer */
        pkv_session_destroy(f);
        ck_assert_int_eq(pkv_session_from_prefix(e, 9, a, &f, &got), PKV_OK);
        ck_assert_uint_eq(got, limit_pages >= 8 ? 8 : 0);
        pkv_engine *ref = engine(0, 0, NULL, NULL);
        append_tokens(f, a, got, 9);
        assert_like_cold(ref, f, a, 9, 3);
        pkv_session_destroy(f);
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        pkv_engine_destroy(ref);
        pkv_engine_destroy(e);
    }
}
END_TEST

/* Under a memory budget cached pages go first: without a spill file they are
 * dropped, with one they are spilled, before any live page is. */
START_TEST(budget_drops_cached_first)
{
    char dir[256];
    pkvt_scratch_dir(dir, sizeof dir, "prefix-spill");
    for (int spill = 0; spill <= 1; spill++) {
        pkv_engine *probe = engine(0, 0, NULL, NULL);
        pkv_stats st;
        pkv_engine_stats(probe, &st);
        pkv_engine_destroy(probe);
        const uint64_t pb = st.page_bytes;
        pkv_engine *e = engine(UINT64_MAX, 12 * pb, spill ? dir : NULL, NULL);
        int32_t a[16], b[16];
        for (int i = 0; i < 16; i++) {
            a[i] = i;
            b[i] = 100 + i;
        }
        pkv_session *s = pkvt_session(e), *live = pkvt_session(e);
        append_tokens(s, a, 0, 16);      /* 8 pages */
        ck_assert_int_eq(pkv_session_set_tokens(s, 16, a), PKV_OK);
        pkv_session_destroy(s);          /* 8 cached */
        append_tokens(live, b, 0, 8);    /* 4 live: the budget is full */
        pkv_engine_stats(e, &st);
        ck_assert_uint_eq(st.pages_cached, 8);
        ck_assert_uint_eq(st.pages_in_use, 4);
        append_tokens(live, b, 8, 12);   /* 2 more pages: cached ones make room */
        pkv_engine_stats(e, &st);
        ck_assert_uint_eq(st.pages_in_use, 6);
        ck_assert_uint_le(st.pages_cached, 6);
        pkv_memory m;
        ck_assert_int_eq(pkv_session_memory(live, &m), PKV_OK);
        ck_assert_uint_eq(m.bytes_spilled, 0); /* no live page went */
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        uint64_t got = 0;
        pkv_session *f = NULL;
        int32_t a17[17];
        memcpy(a17, a, sizeof a);
        a17[16] = 0;
        ck_assert_int_eq(pkv_session_from_prefix(e, 17, a17, &f, &got), PKV_OK);
        if (spill) {                     /* spilled, still reusable and exact */
            ck_assert_uint_eq(got, 16);
            pkv_session_destroy(live);
            pkv_engine *ref = engine(0, 0, NULL, NULL);
            assert_like_cold(ref, f, a, 16, 9);
            pkv_engine_destroy(ref);
        } else {
            ck_assert_uint_eq(got, 12);  /* the least recently used (deepest) page went */
            pkv_session_destroy(live);
        }
        pkv_session_destroy(f);
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        pkv_engine_destroy(e);
    }
    pkvt_remove_dir(dir);
}
END_TEST

/* Sessions whose pages are in the spill file: recording indexes spilled pages, a
 * match shares them spilled, and the decode reads them back, exact. */
START_TEST(spilled_sessions)
{
    char dir[256];
    pkvt_scratch_dir(dir, sizeof dir, "prefix-spilled");
    pkv_engine *probe = engine(0, 0, NULL, NULL);
    pkv_stats st;
    pkv_engine_stats(probe, &st);
    pkv_engine_destroy(probe);
    pkv_engine *e = engine(UINT64_MAX, 20 * st.page_bytes, dir, NULL);
    pkv_engine *ref = engine(0, 0, NULL, NULL);
    int32_t a[33], b[33];
    for (int i = 0; i < 33; i++) {
        a[i] = i * 3;
        b[i] = -i;
    }
    pkv_session *s = pkvt_session(e), *o = pkvt_session(e), *f = NULL;
    append_tokens(s, a, 0, 32);          /* 16 pages */
    append_tokens(o, b, 0, 32);          /* 16 more: most of s goes to disk */
    pkv_memory m;
    pkv_session_memory(s, &m);
    ck_assert_uint_gt(m.bytes_spilled, 0);
    ck_assert_int_eq(pkv_session_set_tokens(s, 32, a), PKV_OK);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    uint64_t got = 0;
    ck_assert_int_eq(pkv_session_from_prefix(e, 33, a, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 32);
    assert_like_cold(ref, f, a, 32, 11);
    append_tokens(f, a, 32, 33);
    assert_like_cold(ref, f, a, 33, 12);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(s);
    pkv_session_destroy(f);
    pkv_session_destroy(o);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_engine_destroy(ref);
    pkv_engine_destroy(e);
    pkvt_remove_dir(dir);
}
END_TEST

/* A windowed layer: a match is usable when every page a session of that length
 * needs is held; the new session's hole is a cold session's. */
START_TEST(windowed_layers)
{
    pkv_layer_config lc[L];
    memset(lc, 0, sizeof lc);
    lc[1].window = 6;
    lc[1].sink_tokens = 2;
    pkv_engine *e = engine(UINT64_MAX, 0, NULL, lc);
    pkv_engine *ref = engine(0, 0, NULL, lc);
    int32_t t[41];
    for (int i = 0; i < 41; i++)
        t[i] = i % 7;
    /* recorded as it goes: every page indexed while the window still held it */
    pkv_session *s = pkvt_session(e);
    for (uint64_t p = 0; p < 40; p++) {
        append_tokens(s, t, p, p + 1);
        ck_assert_int_eq(pkv_session_set_tokens(s, p + 1, t), PKV_OK);
    }
    pkv_session *f = NULL;
    uint64_t got = 0;
    ck_assert_int_eq(pkv_session_from_prefix(e, 41, t, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 40);
    assert_like_cold(ref, f, t, 40, 1);
    pkv_memory mf, ms;
    pkv_session_memory(f, &mf);
    pkv_session_memory(s, &ms);
    ck_assert_uint_eq(mf.blocks, ms.blocks);    /* the same hole */
    append_tokens(f, t, 40, 41);
    assert_like_cold(ref, f, t, 41, 2);
    pkv_session_destroy(f);
    /* recorded only at the end: the released pages cannot be shared, so only
     * prefixes whose window does not need them are */
    pkv_session *u = pkvt_session(e);
    int32_t w[41];
    for (int i = 0; i < 41; i++)
        w[i] = 50 + i;
    append_tokens(u, w, 0, 40);
    ck_assert_int_eq(pkv_session_set_tokens(u, 40, w), PKV_OK);
    ck_assert_int_eq(pkv_session_from_prefix(e, 41, w, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 40);                 /* the same pages are needed at 40 */
    assert_like_cold(ref, f, w, 40, 4);
    pkv_session_destroy(f);
    ck_assert_int_eq(pkv_session_from_prefix(e, 21, w, &f, &got), PKV_OK);
    ck_assert_uint_le(got, 20);
    if (got)
        assert_like_cold(ref, f, w, got, 5);
    pkv_session_destroy(f);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    /* saved and loaded into a new engine (version 3 with the variants): hits again */
    char dir[256], path[300];
    pkvt_scratch_dir(dir, sizeof dir, "prefix-window");
    snprintf(path, sizeof path, "%s/w.pkv", dir);
    ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
    pkv_file_info fi;
    ck_assert_int_eq(pkv_session_file_check(path, &fi, NULL, 0), PKV_OK);
    ck_assert_uint_eq(fi.version, 3);
    ck_assert_uint_eq(fi.n_token_ids, 40);
    ck_assert_uint_eq(fi.n_variant_layers, 1);
    pkv_engine *e2 = engine(UINT64_MAX, 0, NULL, lc);
    pkv_session *ld = NULL;
    ck_assert_int_eq(pkv_session_load(e2, path, &ld), PKV_OK);
    ck_assert_int_eq(pkv_session_from_prefix(e2, 41, t, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 40);
    assert_like_cold(ref, f, t, 40, 6);
    pkv_session_destroy(f);
    pkv_session_destroy(ld);
    ck_assert_int_eq(pkv_engine_check(e2), PKV_OK);
    pkv_engine_destroy(e2);
    pkvt_remove_dir(dir);
    pkv_session_destroy(s);
    pkv_session_destroy(u);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_engine_destroy(e);
    pkv_engine_destroy(ref);
}
END_TEST

/* Bad calls are statuses that change nothing. */
START_TEST(bad_calls)
{
    pkv_engine *e = engine(UINT64_MAX, 0, NULL, NULL);
    int32_t t[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    pkv_session *s = pkvt_session(e), *f = (pkv_session *)&t;
    append_tokens(s, t, 0, 8);
    uint64_t got = 77;
    ck_assert_int_eq(pkv_session_set_tokens(NULL, 4, t), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_set_tokens(s, 4, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_set_tokens(s, 9, t), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_set_tokens(s, 0, NULL), PKV_OK);
    ck_assert_int_eq(pkv_session_from_prefix(NULL, 4, t, &f, &got), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_from_prefix(e, 4, NULL, &f, &got), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_from_prefix(e, 4, t, NULL, &got), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_from_prefix(e, 4, t, &f, NULL), PKV_EINVAL);
    ck_assert_ptr_eq(f, (pkv_session *)&t);
    ck_assert_uint_eq(got, 77);
    pkv_stats st;
    pkv_engine_stats(e, &st);
    ck_assert_uint_eq(st.prefix_lookups, 0);
    ck_assert_int_eq(pkv_session_set_tokens(s, 8, t), PKV_OK);
    int32_t bad[8];
    memcpy(bad, t, sizeof bad);
    bad[2] = -5;
    ck_assert_int_eq(pkv_session_set_tokens(s, 8, bad), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_set_tokens(s, 4, bad), PKV_EINVAL);
    /* a shorter call compares and keeps the record */
    ck_assert_int_eq(pkv_session_set_tokens(s, 4, t), PKV_OK);
    ck_assert_int_eq(pkv_session_from_prefix(e, 9, t, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 8);
    pkv_session_destroy(f);
    /* an empty request is an empty session */
    ck_assert_int_eq(pkv_session_from_prefix(e, 0, NULL, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 0);
    ck_assert_uint_eq(pkv_session_len(f, 0), 0);
    pkv_session_destroy(f);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
}
END_TEST

/* A truncate into an indexed page, then an append: copy-on-write keeps the cache's
 * page as it was (B5 through the index's own reference). */
START_TEST(truncate_then_append_copies)
{
    pkv_engine *e = engine(UINT64_MAX, 0, NULL, NULL);
    pkv_engine *ref = engine(0, 0, NULL, NULL);
    int32_t t[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, u[9] = {1, 2, 3, 4, 5, 6, 0, 0, 0};
    pkv_session *s = pkvt_session(e), *f;
    append_tokens(s, t, 0, 8);
    ck_assert_int_eq(pkv_session_set_tokens(s, 8, t), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(s, 6), PKV_OK);
    append_tokens(s, u, 6, 8);           /* writes into a copy of page 1 */
    ck_assert_int_eq(pkv_session_set_tokens(s, 8, u), PKV_OK);
    assert_like_cold(ref, s, u, 8, 1);
    uint64_t got = 0;
    ck_assert_int_eq(pkv_session_from_prefix(e, 9, t, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 8);
    assert_like_cold(ref, f, t, 8, 2);
    pkv_session_destroy(f);
    ck_assert_int_eq(pkv_session_from_prefix(e, 9, u, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 8);
    assert_like_cold(ref, f, u, 8, 3);
    pkv_session_destroy(f);
    pkv_session_destroy(s);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_engine_destroy(ref);
    pkv_engine_destroy(e);
}
END_TEST

/* Threads: sessions of one engine on several threads, each recording, matching,
 * forking and destroying its own while the others do (the index is engine-wide). */
typedef struct {
    pkv_engine *e;
    uint64_t seed;
    int fails;
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    pkvt_rng r;
    pkvt_rng_init(&r, w->seed);
    const int rounds = pkvt_quick() ? 40 : 200;
    for (int i = 0; i < rounds; i++) {
        int32_t t[33];
        for (int k = 0; k < 33; k++)
            t[k] = (int32_t)pkvt_below(&r, 2);   /* few prompts: many shared prefixes */
        pkv_session *s = NULL, *f = NULL;
        uint64_t got = 0;
        if (pkv_session_from_prefix(w->e, 33, t, &s, &got) != PKV_OK) {
            w->fails++;
            continue;
        }
        append_tokens(s, t, got, 32);
        w->fails += pkv_session_set_tokens(s, 32, t) != PKV_OK;
        w->fails += pkv_session_fork(s, &f) != PKV_OK;
        if (f)
            w->fails += pkv_session_truncate(f, pkvt_below(&r, 33)) != PKV_OK;
        float q[H * D], out[H * D];
        pkvt_fill(&r, q, H * D, -1, 1);
        w->fails += pkv_decode(s, 0, q, out) != PKV_OK;
        pkv_session_destroy(f);
        pkv_session_destroy(s);
    }
    return NULL;
}

START_TEST(threads)
{
    pkv_engine *probe = engine(0, 0, NULL, NULL);
    pkv_stats st;
    pkv_engine_stats(probe, &st);
    pkv_engine_destroy(probe);
    pkv_engine *e = engine(24 * st.page_bytes, 0, NULL, NULL);   /* trims as it goes */
    worker w[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (worker){e, pkvt_seed() + (uint64_t)i, 0};
        ck_assert_int_eq(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(w[i].fails, 0);
    }
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_engine_stats(e, &st);
    ck_assert_uint_gt(st.prefix_hit_tokens, 0);
    ck_assert_uint_le(st.pages_cached, 24);
    pkv_engine_destroy(e);
}
END_TEST

/* The tools: generate --prefix-cache prints the same text as forks and reports the
 * hits; stress --prefix reports both runs. */
START_TEST(tools)
{
    const char *prompt = "Once upon a time there was a little cat who liked to play";
    const char *const a[] = {"generate", "--sessions", "3", "-n", "120", "-i", prompt, "-t",
                             "0.8", NULL};
    const char *const b[] = {"generate", "--sessions", "3", "-n", "120", "-i", prompt, "-t",
                             "0.8", "--prefix-cache", NULL};
    const char *const bj[] = {"generate", "--sessions", "3", "-n", "120", "-i", prompt, "-t",
                              "0.8", "--prefix-cache", "--json", NULL};
    pkvt_proc x = pkvt_tool(a, NULL), y = pkvt_tool(b, NULL), z = pkvt_tool(bj, NULL);
    ck_assert_msg(x.status == 0 && y.status == 0 && z.status == 0, "%s / %s / %s", x.err,
                  y.err, z.err);
    ck_assert_str_eq(x.out, y.out);
    ck_assert_ptr_nonnull(strstr(y.err, "prefix cache: 2 of 2 later session(s) hit"));
    ck_assert(pkvt_json_valid(z.out));
    ck_assert_uint_eq(pkvt_json_u64(z.out, "prefix_cache.hits"), 2);
    ck_assert(pkvt_json_is(z.out, "prefix_cache.logits_identical", "true"));
    const uint64_t reused = pkvt_json_u64(z.out, "prefix_cache.tokens_reused");
    const uint64_t pre = pkvt_json_u64(z.out, "prefix_cache.tokens_prefilled");
    ck_assert_uint_eq(reused + pre, 2 * pkvt_json_u64(z.out, "prompt_positions"));
    ck_assert_uint_gt(reused, 0);
    pkvt_proc_free(&x);
    pkvt_proc_free(&y);
    pkvt_proc_free(&z);
    const char *const sp[] = {"stress", "--prefix", "512", "--prefix-tail", "40", "--sessions",
                              "4", "--layers", "2", "--json", NULL};
    pkvt_proc s = pkvt_tool(sp, NULL);
    ck_assert_msg(s.status == 0, "%s", s.err);
    ck_assert(pkvt_json_valid(s.out));
    /* 512 = 32 pages; from_prefix shares at most 511 positions: 31 pages */
    ck_assert_uint_eq(pkvt_json_u64(s.out, "with_cache.positions_reused"), 3 * 496);
    ck_assert_uint_eq(pkvt_json_u64(s.out, "with_cache.hits"), 3);
    const uint64_t pb = pkvt_json_u64(s.out, "page_bytes");
    /* with: 32 + 4 * 3 + 3 more prefix pages (position 496..511 each) ... per layer */
    ck_assert_uint_eq(pkvt_json_u64(s.out, "with_cache.engine_bytes"),
                      2 * (32 + 3 + 4 * 3) * pb);
    ck_assert_uint_eq(pkvt_json_u64(s.out, "without_cache.engine_bytes"), 2 * 4 * 35 * pb);
    pkvt_proc_free(&s);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("prefix");
    TCase *tc = tcase_create("prefix");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, model_based);
    tcase_add_test(tc, forced_collisions);
    tcase_add_test(tc, retention_lru);
    tcase_add_test(tc, budget_drops_cached_first);
    tcase_add_test(tc, windowed_layers);
    tcase_add_test(tc, spilled_sessions);
    tcase_add_test(tc, bad_calls);
    tcase_add_test(tc, truncate_then_append_copies);
    tcase_add_test(tc, threads);
    suite_add_tcase(s, tc);
    TCase *tt = tcase_create("tools");
    tcase_set_timeout(tt, 300);
    tcase_add_test(tt, tools);
    suite_add_tcase(s, tt);
    return pkvt_run(s);
}

/*
 * test_spill.c - spilling pages past the memory budget and reading them back, on both
 * I/O backends.
 *
 * The oracle is a twin engine with the same geometry and no budget: the same kernels
 * and the same split, so every decode of a spilled-and-restored session must be
 * bitwise identical to the twin's. Fault injection proves that failed writes keep
 * pages in memory and failed reads keep them on disk, with nothing lost.
 */
#include "testutil.h"
#include "internal.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { NH = 8, G = 2, D = 32, BT = 8, LAYERS = 2 };
#define KD (G * D)
#define QD (NH * D)

static char spill_dir[256];
static bool uring_ok;

static bool make_dir(void)
{
    snprintf(spill_dir, sizeof spill_dir, "/tmp/pkv-spill-test-XXXXXX");
    return mkdtemp(spill_dir) != NULL;
}

static size_t dir_entries(const char *dir)
{
    DIR *dp = opendir(dir);
    size_t n = 0;
    struct dirent *de;
    while (dp && (de = readdir(dp)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            n++;
    if (dp)
        closedir(dp);
    return n;
}

static pkv_engine *engine(uint64_t budget_pages, bool sync)
{
    pkv_config c = pkv_config_default();
    c.n_layers = LAYERS;
    c.n_heads = NH;
    c.n_kv_heads = G;
    c.head_dim = D;
    c.block_tokens = BT;
    c.kv_dtype = PKV_F16;
    c.n_threads = 2;
    if (budget_pages) {
        c.mem_budget = budget_pages * (2ull * G * BT * D * 2);
        c.spill_dir = spill_dir;
    }
    if (sync)
        setenv("PKV_NO_URING", "1", 1);
    pkv_engine *e = NULL;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_OK);
    unsetenv("PKV_NO_URING");
    return e;
}

/* Both backends: sync always; io_uring where the kernel allows it. */
static bool backend_usable(bool sync)
{
    if (sync)
        return true;
    if (!uring_ok)
        fprintf(stderr, "io_uring cannot be set up here: io_uring case skipped\n");
    return uring_ok;
}

/* Append the same random tokens to a session of each engine. */
static void grow(pkv_session *a, pkv_session *b, pkvt_rng *r, uint32_t tokens)
{
    float k[KD], v[KD];
    for (uint32_t t = 0; t < tokens; t++)
        for (uint32_t l = 0; l < LAYERS; l++) {
            pkvt_fill(r, k, KD, -1, 1);
            pkvt_fill(r, v, KD, -1, 1);
            ck_assert_int_eq(pkv_append(a, l, k, v), PKV_OK);
            ck_assert_int_eq(pkv_append(b, l, k, v), PKV_OK);
        }
}

static void same_decode(pkv_session *a, pkv_session *b, uint32_t layer, pkvt_rng *r,
                        const char *what)
{
    float q[QD], oa[QD], ob[QD];
    pkvt_fill(r, q, QD, -2, 2);
    ck_assert_int_eq(pkv_decode(a, layer, q, oa), PKV_OK);
    ck_assert_int_eq(pkv_decode(b, layer, q, ob), PKV_OK);
    ck_assert_msg(memcmp(oa, ob, sizeof oa) == 0, "%s: spilled session decodes differently",
                  what);
}

static void many_sessions(bool sync)
{
    if (!backend_usable(sync))
        return;
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 10 + sync);
    const uint32_t NS = 10, TOK = 60; /* 60 tokens x 2 layers = 16 pages a session */
    pkv_engine *e = engine(48, sync), *twin = engine(0, false); /* 160 pages vs 48 */
    pkv_stats st;
    pkv_engine_stats(e, &st);
    ck_assert_str_eq(st.io_backend, sync ? "sync" : "io_uring");
    pkv_session *s[10], *t[10];
    for (uint32_t i = 0; i < NS; i++) {
        ck_assert_int_eq(pkv_session_create(e, &s[i]), PKV_OK);
        ck_assert_int_eq(pkv_session_create(twin, &t[i]), PKV_OK);
        grow(s[i], t[i], &r, TOK);
        ck_assert(pkvi_engine_check(e));
    }
    pkv_engine_stats(e, &st);
    ck_assert_uint_gt(st.pages_spilled, 0);
    ck_assert_uint_le((st.pages_in_use + st.pages_free) * st.page_bytes, st.mem_budget);
    const int rounds = pkvt_quick() ? 30 : 200;
    for (int k = 0; k < rounds; k++) {
        uint32_t i = pkvt_below(&r, NS), l = pkvt_below(&r, LAYERS);
        if (pkvt_below(&r, 4) == 0)
            grow(s[i], t[i], &r, 1 + pkvt_below(&r, 9));
        same_decode(s[i], t[i], l, &r, "round");
        ck_assert(pkvi_engine_check(e));
        pkv_memory m;
        pkv_session_memory(s[i], &m);
        ck_assert_uint_eq(m.bytes_resident + m.bytes_spilled, m.blocks * st.page_bytes);
    }
    pkv_engine_stats(e, &st);
    ck_assert_uint_le((st.pages_in_use + st.pages_free) * st.page_bytes, st.mem_budget);
    ck_assert_uint_eq(dir_entries(spill_dir), 0); /* the spill file has no name */
    for (uint32_t i = 0; i < NS; i++) {
        pkv_session_destroy(s[i]);
        pkv_session_destroy(t[i]);
    }
    pkv_engine_stats(e, &st);
    ck_assert_uint_eq(st.pages_in_use + st.pages_spilled, 0);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
    ck_assert_uint_eq(dir_entries(spill_dir), 0);
}

START_TEST(many_sessions_sync) { many_sessions(true); }
END_TEST
START_TEST(many_sessions_uring) { many_sessions(false); }
END_TEST

/* Forks share pages; a shared page is one descriptor, written to disk once. */
static void forks_share_spilled(bool sync)
{
    if (!backend_usable(sync))
        return;
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 20 + sync);
    pkv_engine *e = engine(20, sync), *twin = engine(0, false);
    pkv_session *base, *tb;
    pkv_session_create(e, &base);
    pkv_session_create(twin, &tb);
    grow(base, tb, &r, 36); /* 5 pages a layer, last partly filled: 10 pages */
    pkv_session *f[4], *tf[4];
    for (int i = 0; i < 4; i++) {
        ck_assert_int_eq(pkv_session_fork(base, &f[i]), PKV_OK);
        ck_assert_int_eq(pkv_session_fork(tb, &tf[i]), PKV_OK);
    }
    /* a big unrelated session pushes the shared pages out */
    pkv_session *big, *tbig;
    pkv_session_create(e, &big);
    pkv_session_create(twin, &tbig);
    grow(big, tbig, &r, 72);
    pkv_stats st;
    pkv_engine_stats(e, &st);
    ck_assert_uint_ge(st.pages_spilled, 1);
    ck_assert_uint_le(st.pages_spilled + st.pages_in_use, 10 + 18); /* shared once */
    for (int i = 0; i < 4; i++) {
        grow(f[i], tf[i], &r, 1 + (uint32_t)i * 5);
        same_decode(f[i], tf[i], (uint32_t)i % LAYERS, &r, "fork");
        ck_assert(pkvi_engine_check(e));
    }
    same_decode(base, tb, 0, &r, "base");
    same_decode(big, tbig, 1, &r, "big");
    pkv_session_destroy(base);
    for (int i = 0; i < 4; i++) {
        same_decode(f[i], tf[i], 1, &r, "fork after base destroyed");
        pkv_session_destroy(f[i]);
        pkv_session_destroy(tf[i]);
    }
    pkv_session_destroy(big);
    pkv_session_destroy(tbig);
    pkv_session_destroy(tb);
    ck_assert(pkvi_engine_check(e));
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

START_TEST(forks_sync) { forks_share_spilled(true); }
END_TEST
START_TEST(forks_uring) { forks_share_spilled(false); }
END_TEST

/* A failed spill write keeps the pages in memory; a failed read keeps them on disk. */
static void faults_keep_data(bool sync)
{
    if (!backend_usable(sync))
        return;
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 30 + sync);
    pkv_engine *e = engine(24, sync), *twin = engine(0, false);
    pkv_session *a, *b, *ta, *tb;
    pkv_session_create(e, &a);
    pkv_session_create(e, &b);
    pkv_session_create(twin, &ta);
    pkv_session_create(twin, &tb);
    grow(a, ta, &r, 48); /* 12 pages */
    grow(b, tb, &r, 40); /* 10 pages: 22 of 24 */

    /* the next write fails: b's growth past the budget gets PKV_EIO, nothing changes */
    pkvi_io_inject_fault(pkvi_spill_io(e->spill), PKVI_FAULT_WRITE, 1);
    float k[KD], v[KD];
    pkvt_fill(&r, k, KD, -1, 1);
    pkvt_fill(&r, v, KD, -1, 1);
    pkv_status st = PKV_OK;
    uint32_t added = 0;
    for (; added < 40 && st == PKV_OK; added++) {
        st = pkv_append(b, 0, k, v);
        if (st == PKV_OK)
            ck_assert_int_eq(pkv_append(tb, 0, k, v), PKV_OK);
    }
    ck_assert_int_eq(st, PKV_EIO);
    ck_assert(pkvi_engine_check(e));
    same_decode(a, ta, 0, &r, "after failed write (a)");
    same_decode(b, tb, 0, &r, "after failed write (b)");
    /* the fault is spent: the same append now spills and succeeds */
    ck_assert_int_eq(pkv_append(b, 0, k, v), PKV_OK);
    ck_assert_int_eq(pkv_append(tb, 0, k, v), PKV_OK);
    pkv_stats es;
    pkv_engine_stats(e, &es);
    ck_assert_uint_gt(es.pages_spilled, 0);

    /* a is (partly) on disk now; its next read fails: PKV_EIO, then success */
    pkv_memory m;
    pkv_session_memory(a, &m);
    ck_assert_uint_gt(m.bytes_spilled, 0);
    pkvi_io_inject_fault(pkvi_spill_io(e->spill), PKVI_FAULT_READ, 1);
    float q[QD], o[QD];
    pkvt_fill(&r, q, QD, -1, 1);
    ck_assert_int_eq(pkv_decode(a, 0, q, o), PKV_EIO);
    ck_assert(pkvi_engine_check(e));
    pkv_memory m2;
    pkv_session_memory(a, &m2);
    ck_assert_uint_eq(m2.blocks, m.blocks);
    same_decode(a, ta, 0, &r, "after failed read");
    same_decode(b, tb, 0, &r, "b at the end");
    pkv_session_destroy(a);
    pkv_session_destroy(b);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

START_TEST(faults_sync) { faults_keep_data(true); }
END_TEST
START_TEST(faults_uring) { faults_keep_data(false); }
END_TEST

/* Decode needs a whole layer resident: a layer larger than the budget cannot be
 * decoded (PKV_ENOMEM), and the session survives intact. */
START_TEST(layer_larger_than_budget)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 40);
    pkv_engine *e = engine(4, true), *twin = engine(0, false);
    pkv_session *a, *ta;
    pkv_session_create(e, &a);
    pkv_session_create(twin, &ta);
    grow(a, ta, &r, 40); /* 5 pages a layer, 10 in all, budget 4 */
    float q[QD], o[QD];
    pkvt_fill(&r, q, QD, -1, 1);
    ck_assert_int_eq(pkv_decode(a, 0, q, o), PKV_ENOMEM);
    ck_assert_uint_eq(pkv_session_len(a, 0), 40);
    ck_assert(pkvi_engine_check(e));
    ck_assert_int_eq(pkv_session_truncate(a, 32), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(ta, 32), PKV_OK);
    same_decode(a, ta, 0, &r, "after truncate");
    same_decode(a, ta, 1, &r, "other layer");
    pkv_session_destroy(a);
    pkv_session_destroy(ta);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}
END_TEST

int main(void)
{
    if (!make_dir()) {
        perror("mkdtemp");
        return 1;
    }
    /* Can this kernel run io_uring? An engine left to choose tells. */
    pkv_config c = pkv_config_default();
    c.n_layers = c.n_heads = c.n_kv_heads = c.head_dim = 1;
    c.mem_budget = 1 << 20;
    c.spill_dir = spill_dir;
    pkv_engine *probe = NULL;
    pkv_stats st;
    if (pkv_engine_create(&c, &probe) != PKV_OK || pkv_engine_stats(probe, &st) != PKV_OK) {
        fprintf(stderr, "cannot create a spilling engine in %s\n", spill_dir);
        return 1;
    }
    uring_ok = strcmp(st.io_backend, "io_uring") == 0;
    pkv_engine_destroy(probe);
    printf("spill backends: sync%s\n", uring_ok ? ", io_uring" : " (io_uring unavailable)");

    Suite *s = suite_create("spill");
    TCase *tc = tcase_create("spill");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, many_sessions_sync);
    tcase_add_test(tc, many_sessions_uring);
    tcase_add_test(tc, forks_sync);
    tcase_add_test(tc, forks_uring);
    tcase_add_test(tc, faults_sync);
    tcase_add_test(tc, faults_uring);
    tcase_add_test(tc, layer_larger_than_budget);
    suite_add_tcase(s, tc);
    int rc = pkvt_run(s);
    rmdir(spill_dir);
    return rc;
}

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
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
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
    pkvi_io_inject_fault(pkvi_spill_io(pkvi_engine_ctx(e).cache->spill), PKVI_FAULT_WRITE, 1);
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
    pkvi_io_inject_fault(pkvi_spill_io(pkvi_engine_ctx(e).cache->spill), PKVI_FAULT_READ, 1);
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

/* The spill file's size through /proc/self/fd (the file has no name of its own, or
 * a removed one): the descriptor whose target is in spill_dir. -1 if not found. */
static long long spill_file_bytes(void)
{
    DIR *dp = opendir("/proc/self/fd");
    long long size = -1;
    struct dirent *de;
    while (dp && (de = readdir(dp))) {
        char p[300], target[512];
        snprintf(p, sizeof p, "/proc/self/fd/%s", de->d_name);
        ssize_t n = readlink(p, target, sizeof target - 1);
        if (n <= 0)
            continue;
        target[n] = '\0';
        struct stat fs;
        if (strncmp(target, spill_dir, strlen(spill_dir)) == 0 &&
            target[strlen(spill_dir)] == '/' && stat(p, &fs) == 0 && S_ISREG(fs.st_mode))
            size = (long long)fs.st_size;
    }
    if (dp)
        closedir(dp);
    return size;
}

/* A full disk (here: RLIMIT_FSIZE at the spill file's size, so writes inside the file
 * work and growing it fails) must not stop spills that fit the file's free slots:
 * a failed batch that wanted new slots is retried into the free room, and its slots
 * do not stay first in line for the next batch. */
static void full_disk_uses_free_room(bool sync)
{
    if (!backend_usable(sync))
        return;
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 50 + sync);
    pkv_engine *e = engine(24, sync), *twin = engine(0, false);
    pkv_session *a, *b, *c, *ta, *tb, *tc;
    pkv_session_create(e, &a);
    pkv_session_create(e, &b);
    pkv_session_create(e, &c);
    pkv_session_create(twin, &ta);
    pkv_session_create(twin, &tb);
    pkv_session_create(twin, &tc);
    grow(a, ta, &r, 48); /* 12 pages */
    grow(b, tb, &r, 40); /* 10 pages: 22 of 24 */
    grow(c, tc, &r, 32); /* 8 more: a and b spill (a batch of 16 slots) */
    pkv_stats st;
    pkv_engine_stats(e, &st);
    ck_assert_uint_ge(st.pages_spilled, 6);
    /* a's slots become free room inside the file */
    pkv_session_destroy(a);
    pkv_session_destroy(ta);
    pkv_engine_stats(e, &st);
    const long long fbytes = spill_file_bytes();
    ck_assert_msg(fbytes > 0, "spill file not found under %s", spill_dir);
    const uint64_t slots = (uint64_t)fbytes / st.page_bytes;
    ck_assert_uint_gt(slots, st.pages_spilled);
    const uint64_t room = slots - st.pages_spilled;
    ck_assert_uint_lt(room, 16); /* a batch of 16 must grow the file */

    struct rlimit old;
    ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    void (*old_sig)(int) = signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {.rlim_cur = (rlim_t)fbytes, .rlim_max = old.rlim_max};
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    /* Grow c page by page until an append fails: the free room must be used first.
     * (A failed append leaves the session as it was, so the twin skips it too.) */
    const uint64_t spilled0 = st.pages_spilled;
    pkv_status s = PKV_OK;
    uint32_t pages = 0;
    float k[KD], v[KD];
    while (s == PKV_OK && pages < 64) {
        for (uint32_t t = 0; t < BT && s == PKV_OK; t++) {
            pkvt_fill(&r, k, KD, -1, 1);
            pkvt_fill(&r, v, KD, -1, 1);
            s = pkv_append(c, pages % LAYERS, k, v); /* layers stay within the budget */
            if (s == PKV_OK)
                ck_assert_int_eq(pkv_append(tc, pages % LAYERS, k, v), PKV_OK);
        }
        pages += s == PKV_OK;
        ck_assert(pkvi_engine_check(e));
    }
    pkv_engine_stats(e, &st);
    const long long fbytes_after = spill_file_bytes();
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, old_sig);
    printf("full disk (%s): %llu free slots, %u pages appended, %llu more spilled, "
           "then status %s\n", sync ? "sync" : "io_uring", (unsigned long long)room, pages,
           (unsigned long long)(st.pages_spilled - spilled0), pkv_status_str(s));
    ck_assert_int_eq(s, PKV_EIO); /* the room ran out: growing the file fails */
    ck_assert_msg(st.pages_spilled == spilled0 + room,
                  "%llu of %llu free slots used before the file had to grow",
                  (unsigned long long)(st.pages_spilled - spilled0),
                  (unsigned long long)room);
    ck_assert_int_eq(fbytes_after, fbytes);
    /* nothing was lost, and with the limit gone the file grows again */
    same_decode(b, tb, 0, &r, "b after the full disk");
    same_decode(c, tc, 0, &r, "c after the full disk");
    same_decode(b, tb, 1, &r, "b layer 1");
    grow(c, tc, &r, 16);
    same_decode(c, tc, 1, &r, "c after the limit");
    ck_assert(pkvi_engine_check(e));
    pkv_session_destroy(b);
    pkv_session_destroy(c);
    pkv_session_destroy(tb);
    pkv_session_destroy(tc);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
}

START_TEST(full_disk_sync) { full_disk_uses_free_room(true); }
END_TEST
START_TEST(full_disk_uring) { full_disk_uses_free_room(false); }
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
    tcase_add_test(tc, full_disk_sync);
    tcase_add_test(tc, full_disk_uring);
    suite_add_tcase(s, tc);
    int rc = pkvt_run(s);
    rmdir(spill_dir);
    return rc;
}

/*
 * test_pool.c - the page pool (store/pool.c) against a trivial model: random sequences
 * of gets, puts, spills, restores and descriptor lifetimes (seeded), with the pool's
 * own consistency check (pkvi_pool_check) and the model's counts compared after every
 * step; then the edges one by one: the budget exhausted and given back, allocator
 * and slot-array failures by the pool's fault hook, tiny and huge pages.
 *
 * Owns: checks of pool.c only. The model is a list of the buffers the test holds and
 * three counters (in use, spilled, and what the pool may keep besides); every buffer
 * held carries a pattern of its own, so a buffer handed out twice shows.
 */
#include "testutil.h"
#include "internal.h"

#include <stdlib.h>
#include <string.h>

/* Checks that report only when they fail: ck_assert passes every check it makes to the
 * runner through a pipe, and the model's comparisons after every step would spend the
 * suite's time there. pkvt_run names the seed of a failed run. */
#define EXPECT(c) EXPECT_MSG(c, "%s", #c)
#define EXPECT_MSG(c, ...)                                                              \
    do {                                                                                \
        if (!(c))                                                                       \
            ck_abort_msg(__VA_ARGS__);                                                  \
    } while (0)

/* ---- the model ------------------------------------------------------------------------ */

enum { MAXH = 160 };

typedef struct {
    pkvi_pool *p;
    uint64_t page_bytes, budget;   /* budget in pages, 0 = none */
    void *held[MAXH];              /* buffers the model holds (from get or descriptors) */
    pkvi_page *desc[MAXH];         /* the descriptor a held buffer belongs to, or NULL */
    unsigned char mark[MAXH];      /* the byte each held buffer is filled with */
    uint32_t n_held;
    uint64_t spilled;              /* spilled descriptors the model has counted */
    unsigned char next_mark;
} model;

static void model_init(model *m, uint64_t page_bytes, uint64_t budget_pages)
{
    memset(m, 0, sizeof *m);
    m->page_bytes = page_bytes;
    m->budget = budget_pages;
    EXPECT((pkvi_pool_create(page_bytes, budget_pages * page_bytes, &m->p)) == (PKV_OK));
    const char *kind = pkvi_pool_kind(m->p);
    EXPECT(!strcmp(kind, "aligned") || (PKV_HAVE_JEMALLOC && !strcmp(kind, "jemalloc")));
    EXPECT((pkvi_pool_page_bytes(m->p)) == (page_bytes));
}

/* Everything the model knows holds, and so do the pool's own invariants. */
static void model_check(const model *m, const char *step, uint64_t seed)
{
    const pkvi_pool_counts c = pkvi_pool_count(m->p);
    EXPECT_MSG(pkvi_pool_check(m->p), "%s: pool invariants broken (seed %llu)", step, (unsigned long long)seed);
    EXPECT_MSG(c.in_use == m->n_held, "%s: in_use %llu, model %u (seed %llu)", step, (unsigned long long)c.in_use, m->n_held, (unsigned long long)seed);
    EXPECT_MSG(c.spilled == m->spilled, "%s: spilled %llu, model %llu (seed %llu)", step, (unsigned long long)c.spilled, (unsigned long long)m->spilled, (unsigned long long)seed);
    EXPECT((c.allocated) == (c.in_use + c.n_free));
    EXPECT((c.budget_pages) == (m->budget));
    if (m->budget)
        EXPECT((c.in_use + c.n_free) <= (m->budget));
    for (uint32_t i = 0; i < m->n_held; i++) {
        const unsigned char *b = m->held[i];
        EXPECT_MSG(((uintptr_t)b % PKVI_PAGE_ALIGN) == 0, "%s: buffer not aligned", step);
        for (uint64_t k = 0; k < m->page_bytes; k += 1 + m->page_bytes / 7)
            EXPECT_MSG(b[k] == m->mark[i], "%s: buffer %u overwritten (seed %llu)", step, i, (unsigned long long)seed);
        EXPECT(b[m->page_bytes - 1] == m->mark[i]);
    }
    /* room: what must leave before n more fit */
    for (uint64_t n = 0; n < 4; n++) {
        uint64_t need = 99;
        const bool fits = pkvi_pool_room(m->p, n, &need);
        if (!m->budget) {
            EXPECT(fits && need == 0);
        } else if (n > m->budget) {
            EXPECT(!fits);
        } else {
            EXPECT(fits);
            EXPECT((need) == (c.in_use + n > m->budget ? c.in_use + n - m->budget : 0));
        }
    }
}

/* The model takes buf (of descriptor pg, or NULL) and marks its bytes. */
static void hold(model *m, void *buf, pkvi_page *pg)
{
    EXPECT((m->n_held) < (MAXH));
    m->mark[m->n_held] = ++m->next_mark;
    memset(buf, m->mark[m->n_held], (size_t)m->page_bytes);
    m->held[m->n_held] = buf;
    m->desc[m->n_held++] = pg;
}

/* The model lets go of held buffer i (the last one moves into its place). */
static void unhold(model *m, uint32_t i)
{
    m->n_held--;
    m->held[i] = m->held[m->n_held];
    m->desc[i] = m->desc[m->n_held];
    m->mark[i] = m->mark[m->n_held];
}

/* Whether a get must succeed now, by the rule of pool.h: a cached buffer, or room in
 * the budget (and no injected failure). */
static bool get_must_work(const model *m)
{
    const pkvi_pool_counts c = pkvi_pool_count(m->p);
    return c.n_free > 0 || !m->budget || c.in_use + 1 <= m->budget;
}

/* One random step. */
static void step(model *m, pkvt_rng *r, uint64_t seed)
{
    const pkvi_pool_counts before = pkvi_pool_count(m->p);
    const uint32_t op = pkvt_below(r, 10);
    if (op < 3 || m->n_held == 0) {                   /* get */
        if (m->n_held == MAXH)
            return;
        const bool must = get_must_work(m);
        void *buf = NULL;
        const pkv_status st = pkvi_pool_get(m->p, &buf);
        EXPECT_MSG((st == PKV_OK) == must, "get gave %s, the model says %s (seed %llu)", pkv_status_str(st), must ? "it fits" : "ENOMEM", (unsigned long long)seed);
        if (st == PKV_OK)
            hold(m, buf, NULL);
        else
            EXPECT((pkvi_pool_count(m->p).allocated) == (before.allocated));
        model_check(m, "get", seed);
    } else if (op < 5) {                              /* a descriptor */
        if (m->n_held == MAXH)
            return;
        const bool must = get_must_work(m);
        pkvi_page *pg = NULL;
        const pkv_status st = pkvi_page_create(m->p, &pg);
        EXPECT((st == PKV_OK) == must);
        if (st == PKV_OK) {
            EXPECT(pg->data != NULL);
            EXPECT((pg->tally) == (0));
            EXPECT((atomic_load(&pg->writing)) == (0));
            hold(m, pg->data, pg);
        }
        model_check(m, "page_create", seed);
    } else if (op < 7) {                              /* give one back */
        const uint32_t i = pkvt_below(r, m->n_held);
        if (m->desc[i])
            pkvi_page_destroy(m->p, m->desc[i]);
        else
            pkvi_pool_put(m->p, m->held[i]);
        unhold(m, i);
        const pkvi_pool_counts c = pkvi_pool_count(m->p);
        /* cached for reuse, or back to the allocator */
        EXPECT((c.n_free == before.n_free + 1 && c.allocated == before.allocated) ||
                  (c.n_free == before.n_free && c.allocated == before.allocated - 1));
        model_check(m, "put", seed);
    } else if (op < 9) {                              /* spill one: its buffer goes */
        const uint32_t i = pkvt_below(r, m->n_held);
        pkvi_pool_put_spilled(m->p, m->held[i]);
        if (m->desc[i]) { /* a spilled descriptor keeps no buffer (its slot is spill.c's) */
            m->desc[i]->data = NULL;
            pkvi_page_destroy(m->p, m->desc[i]); /* the model keeps counting it spilled */
        }
        unhold(m, i);
        m->spilled++;
        model_check(m, "put_spilled", seed);
    } else if (m->spilled) {                          /* a spilled page comes back or goes */
        if (pkvt_below(r, 2) && m->n_held < MAXH && get_must_work(m)) {
            void *buf = NULL;
            EXPECT((pkvi_pool_get(m->p, &buf)) == (PKV_OK));
            hold(m, buf, NULL);
        }
        pkvi_pool_unspilled(m->p);
        m->spilled--;
        model_check(m, "unspilled", seed);
    }
}

static void model_fini(model *m)
{
    while (m->n_held) {
        if (m->desc[0])
            pkvi_page_destroy(m->p, m->desc[0]);
        else
            pkvi_pool_put(m->p, m->held[0]);
        unhold(m, 0);
    }
    while (m->spilled) {
        pkvi_pool_unspilled(m->p);
        m->spilled--;
    }
    model_check(m, "end", 0);
    const pkvi_pool_counts c = pkvi_pool_count(m->p);
    EXPECT((c.in_use) == (0));
    EXPECT((c.allocated) == (c.n_free));
    pkvi_pool_destroy(m->p);
}

/* ---- random sequences --------------------------------------------------------------- */

START_TEST(random_steps_match_the_model)
{
    /* page sizes from tiny (a 1x1x1 f16 geometry) to large, budgets from none to one page */
    static const uint64_t pages[] = {4, 64, 100, 4096, 65536};
    static const uint64_t budgets[] = {0, 1, 2, 7, 40, 1000};
    const int steps = pkvt_quick() ? 300 : 3000;
    for (size_t pi = 0; pi < sizeof pages / sizeof *pages; pi++)
        for (size_t bi = 0; bi < sizeof budgets / sizeof *budgets; bi++) {
            const uint64_t seed = pkvt_seed() ^ (pi * 31 + bi);
            pkvt_rng r;
            pkvt_rng_init(&r, seed);
            model m;
            model_init(&m, pages[pi], budgets[bi]);
            model_check(&m, "start", seed);
            for (int s = 0; s < steps; s++)
                step(&m, &r, seed);
            model_fini(&m);
        }
}
END_TEST

/* ---- edges ----------------------------------------------------------------------------- */

START_TEST(the_budget_is_exhausted_and_given_back)
{
    model m;
    model_init(&m, 256, 3);
    void *buf;
    for (int i = 0; i < 3; i++) {
        EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_OK));
        hold(&m, buf, NULL);
    }
    uint64_t need;
    EXPECT(pkvi_pool_room(m.p, 1, &need));
    EXPECT((need) == (1));
    EXPECT(pkvi_pool_room(m.p, 3, &need));
    EXPECT((need) == (3));
    EXPECT(!pkvi_pool_room(m.p, 4, &need)); /* more than the whole budget */
    const pkvi_pool_counts full = pkvi_pool_count(m.p);
    EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_ENOMEM));
    pkvi_page *pg = (pkvi_page *)&pg;
    EXPECT((pkvi_page_create(m.p, &pg)) == (PKV_ENOMEM));
    EXPECT((pg) == ((pkvi_page *)&pg)); /* untouched */
    const pkvi_pool_counts after = pkvi_pool_count(m.p);
    EXPECT((after.in_use) == (full.in_use));
    EXPECT((after.allocated) == (full.allocated));
    model_check(&m, "full", 0);
    /* one back: cached, so the next get reuses it without the allocator */
    pkvi_pool_put(m.p, m.held[2]);
    unhold(&m, 2);
    EXPECT((pkvi_pool_count(m.p).n_free) == (1));
    EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_OK));
    hold(&m, buf, NULL);
    EXPECT((pkvi_pool_count(m.p).allocated) == (3));
    /* a spilled page frees its buffer for someone else */
    pkvi_pool_put_spilled(m.p, m.held[0]);
    unhold(&m, 0);
    m.spilled++;
    EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_OK));
    hold(&m, buf, NULL);
    model_check(&m, "spilled", 0);
    model_fini(&m);
}
END_TEST

START_TEST(allocator_failures_change_nothing)
{
    model m;
    model_init(&m, 512, 0);
    void *buf;
    /* a buffer the allocator refuses: ENOMEM, counters unchanged */
    pkvi_pool_inject_fault(m.p, PKVI_POOL_FAULT_BUFFER, 1);
    EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_ENOMEM));
    model_check(&m, "buffer refused", 0);
    EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_OK)); /* disarmed after firing */
    hold(&m, buf, NULL);
    /* the third allocation from now */
    pkvi_pool_inject_fault(m.p, PKVI_POOL_FAULT_BUFFER, 3);
    EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_OK));
    hold(&m, buf, NULL);
    EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_OK));
    hold(&m, buf, NULL);
    EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_ENOMEM));
    model_check(&m, "third refused", 0);
    /* a descriptor refused: its buffer is not taken either */
    const pkvi_pool_counts c0 = pkvi_pool_count(m.p);
    pkvi_page *pg = NULL;
    pkvi_pool_inject_fault(m.p, PKVI_POOL_FAULT_DESCRIPTOR, 1);
    EXPECT((pkvi_page_create(m.p, &pg)) == (PKV_ENOMEM));
    EXPECT((pkvi_pool_count(m.p).in_use) == (c0.in_use));
    /* a descriptor whose buffer is refused: the descriptor is not kept */
    pkvi_pool_inject_fault(m.p, PKVI_POOL_FAULT_BUFFER, 1);
    EXPECT((pkvi_page_create(m.p, &pg)) == (PKV_ENOMEM));
    model_check(&m, "descriptor refused", 0);
    /* the free cache cannot grow its slot array: the buffer goes back to the allocator
     * instead, and nothing is lost */
    pkvi_pool_inject_fault(m.p, PKVI_POOL_FAULT_SLOTS, 1);
    const pkvi_pool_counts c1 = pkvi_pool_count(m.p);
    EXPECT((c1.n_free) == (0));
    pkvi_pool_put(m.p, m.held[0]);
    unhold(&m, 0);
    const pkvi_pool_counts c2 = pkvi_pool_count(m.p);
    EXPECT((c2.n_free) == (0));
    EXPECT((c2.allocated) == (c1.allocated - 1));
    model_check(&m, "slots refused", 0);
    /* and the next put caches again */
    pkvi_pool_put(m.p, m.held[0]);
    unhold(&m, 0);
    EXPECT((pkvi_pool_count(m.p).n_free) == (1));
    model_check(&m, "slots again", 0);
    model_fini(&m);
}
END_TEST

START_TEST(the_free_cache_is_bounded)
{
    /* no budget: the cache keeps a bounded amount (pool.c: FREE_CACHE_BYTES, 16 MiB),
     * the rest goes back to the allocator; with a budget it keeps every buffer up to
     * the budget (restores reuse them) */
    model m;
    model_init(&m, 1u << 20, 0);
    void *buf;
    for (int i = 0; i < 24; i++) {
        EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_OK));
        hold(&m, buf, NULL);
    }
    while (m.n_held) {
        pkvi_pool_put(m.p, m.held[0]);
        unhold(&m, 0);
    }
    const pkvi_pool_counts b = pkvi_pool_count(m.p);
    EXPECT((b.n_free) > (0));
    EXPECT((b.n_free) < (24));
    EXPECT((b.allocated) == (b.n_free));
    model_check(&m, "bounded", 0);
    model_fini(&m);
    model_init(&m, 1024, 5);
    for (int i = 0; i < 5; i++) {
        EXPECT((pkvi_pool_get(m.p, &buf)) == (PKV_OK));
        hold(&m, buf, NULL);
    }
    while (m.n_held) {
        pkvi_pool_put(m.p, m.held[0]);
        unhold(&m, 0);
    }
    const pkvi_pool_counts c = pkvi_pool_count(m.p);
    EXPECT((c.n_free) == (5));
    EXPECT((c.allocated) == (5));
    model_check(&m, "all cached", 0);
    model_fini(&m);
    pkvi_pool_destroy(NULL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("pool");
    TCase *tc = tcase_create("pool");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, random_steps_match_the_model);
    tcase_add_test(tc, the_budget_is_exhausted_and_given_back);
    tcase_add_test(tc, allocator_failures_change_nothing);
    tcase_add_test(tc, the_free_cache_is_bounded);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

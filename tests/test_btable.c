/*
 * test_btable.c - block tables (cache/btable.c) against a trivial model: random
 * sequences (seeded) of appends with copy-on-write, truncates, a window's releases,
 * forks, the prefix index's references, shares in the prefix cache's way, spills and
 * restores, pins, shard starts and loaded holes, over several tables that share pages;
 * after every step each table's check (B1-B5), every accessor and the census (E3:
 * holders == refs, resident and spilled counts, the cached counts) against the model.
 * Then the edges one by one: truncate to 0, release and hole arithmetic at page
 * boundaries, a shard's first page, the truncate rules, growth that cannot happen.
 *
 * Owns: checks of btable.c only (through a real pool and spill file). The model is, per
 * table, an array of page numbers (-1: the hole) with len, the hole, first and pins;
 * per page, its holders, whether the index holds it, whether it is spilled, and the
 * byte its data is filled with (a copy-on-write copy keeps it).
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

enum { MAXT = 6, MAXE = 40, MAXP = 4096, PB = 48 };

typedef struct {
    pkvi_page *pg;
    uint32_t holders;        /* table entries naming it, plus 1 while indexed */
    bool in_index, spilled, alive;
    unsigned char mark;
} mpage;

typedef struct {
    pkvi_btable *t;          /* NULL: this slot has no table */
    int32_t ent[MAXE];       /* page numbers, -1 in the hole */
    uint64_t n, len, hole_lo, hole_hi, first;
    uint64_t sinks;          /* keep_lo of its releases (a window's sink pages) */
    uint32_t pins;
} mtab;

typedef struct {
    pkvi_pool *pool;
    pkvi_spill *sp;
    pkvi_cached cached;
    pkvi_pages ps;
    uint64_t bt;
    mpage pg[MAXP];
    uint32_t n_pg;
    mtab tab[MAXT];
    unsigned char next_mark;
    uint64_t seed;
    char dir[256];
} world;

/* ---- the world: pool, spill file, pages ------------------------------------------------ */

static void world_init(world *w, uint64_t bt, uint64_t seed)
{
    memset(w, 0, sizeof *w);
    w->bt = bt;
    w->seed = seed;
    EXPECT((pkvi_pool_create(PB, 0, &w->pool)) == (PKV_OK));
    pkvt_scratch_dir(w->dir, sizeof w->dir, "btable");
    EXPECT((pkvi_spill_open(w->dir, PB, &w->sp)) == (PKV_OK));
    w->ps = (pkvi_pages){w->pool, w->sp, &w->cached};
}

/* A fresh page (refs 0) filled with a new mark; its model number. */
static int32_t new_page(world *w, pkvi_page **out)
{
    EXPECT((w->n_pg) < (MAXP));
    pkvi_page *pg = NULL;
    EXPECT((pkvi_page_create(w->pool, &pg)) == (PKV_OK));
    mpage *m = &w->pg[w->n_pg];
    *m = (mpage){.pg = pg, .alive = true, .mark = ++w->next_mark};
    memset(pg->data, m->mark, PB);
    *out = pg;
    return (int32_t)w->n_pg++;
}

/* One holder fewer: a page left to the index alone is cached; the last one frees it. */
static void model_unref(world *w, int32_t p)
{
    mpage *m = &w->pg[p];
    EXPECT(m->alive && m->holders > 0);
    m->holders--;
    if (m->holders == 0)
        m->alive = false;
}

/* Every table's entry i that names page p: its data moved (spill, restore). */
static void sync_holders(world *w, int32_t p, uint64_t i)
{
    for (int k = 0; k < MAXT; k++) {
        mtab *T = &w->tab[k];
        if (T->t && i < T->n && T->ent[i] == p) {
            EXPECT(pkvi_btable_names(T->t, i, w->pg[p].pg));
            pkvi_btable_sync(T->t, i);
        } else if (T->t) {
            EXPECT(!pkvi_btable_names(T->t, i, w->pg[p].pg));
        }
    }
}

/* Whether a table holding page p is pinned (B4: at index i). */
static bool holder_pinned(const world *w, int32_t p, uint64_t i)
{
    for (int k = 0; k < MAXT; k++)
        if (w->tab[k].t && w->tab[k].pins && i < w->tab[k].n && w->tab[k].ent[i] == p)
            return true;
    return false;
}

/* ---- the check after every step --------------------------------------------------------- */

static void check_world(world *w, const char *what)
{
    const uint64_t seed = w->seed;
    /* tables: their own check, and every accessor against the model */
    for (int k = 0; k < MAXT; k++) {
        const mtab *T = &w->tab[k];
        if (!T->t)
            continue;
        EXPECT_MSG(pkvi_btable_check(T->t, w->bt, T->pins == 0), "%s: table %d fails its check (seed %llu)", what, k, (unsigned long long)seed);
        EXPECT((pkvi_btable_len(T->t)) == (T->len));
        EXPECT((pkvi_btable_n_pages(T->t)) == (T->n));
        EXPECT((pkvi_btable_first(T->t)) == (T->first));
        EXPECT((pkvi_btable_held(T->t)) == (T->n - (T->hole_hi - T->hole_lo)));
        EXPECT((pkvi_btable_hole_end(T->t)) == (T->hole_hi > T->hole_lo ? T->hole_hi : 0));
        EXPECT(pkvi_btable_pinned(T->t) == (T->pins != 0));
        EXPECT((T->n) == ((T->len + w->bt - 1) / w->bt)); /* B1, by the model */
        const void *const *data = pkvi_btable_data(T->t);
        uint64_t spilled = 0, shared = 0;
        pkv_page_info info[MAXE];
        EXPECT((pkvi_btable_info(T->t, 0, MAXE, info)) == (T->n));
        for (uint64_t i = 0; i < T->n; i++) {
            const int32_t p = T->ent[i];
            EXPECT((p < 0) == (i >= T->hole_lo && i < T->hole_hi));
            if (p < 0) {
                EXPECT((pkvi_btable_page(T->t, i)) == NULL);
                EXPECT((data[i]) == NULL);
                EXPECT((info[i].id) == (0));
                continue;
            }
            const mpage *m = &w->pg[p];
            EXPECT_MSG(m->alive && pkvi_btable_page(T->t, i) == m->pg, "%s: table %d entry %llu names the wrong page (seed %llu)", what, k, (unsigned long long)i, (unsigned long long)seed);
            EXPECT((data[i]) == (m->spilled ? NULL : m->pg->data));
            spilled += m->spilled;
            shared += !m->spilled && m->holders - m->in_index > 1;
            EXPECT((info[i].id) == ((uint64_t)(uintptr_t)m->pg));
            EXPECT((info[i].refs) == (m->holders - m->in_index));
            EXPECT((info[i].resident) == (!m->spilled));
        }
        EXPECT((pkvi_btable_n_spilled(T->t)) == (spilled));
        EXPECT((pkvi_btable_shared_resident(T->t)) == (shared));
        EXPECT(pkvi_btable_tail_shared(T->t) ==
                  (T->n && T->ent[T->n - 1] >= 0 && w->pg[T->ent[T->n - 1]].holders > 1));
        EXPECT((pkvi_btable_spilled(T->t, 0, NULL, NULL)) == (spilled));
    }
    /* the census: every holder counted, each page visited once */
    for (int k = 0; k < MAXT; k++)
        if (w->tab[k].t)
            pkvi_btable_tally(w->tab[k].t, true);
    for (uint32_t p = 0; p < w->n_pg; p++)
        if (w->pg[p].alive && w->pg[p].in_index)
            w->pg[p].pg->tally = 0;
    for (int k = 0; k < MAXT; k++)
        if (w->tab[k].t)
            pkvi_btable_tally(w->tab[k].t, false);
    for (uint32_t p = 0; p < w->n_pg; p++) /* the index counts its own (prefix.c) */
        if (w->pg[p].alive && w->pg[p].in_index)
            w->pg[p].pg->tally++;
    pkvi_census c = {.ok = true};
    for (int k = 0; k < MAXT; k++)
        if (w->tab[k].t)
            pkvi_btable_census(w->tab[k].t, &c);
    for (uint32_t p = 0; p < w->n_pg; p++)
        if (w->pg[p].alive && w->pg[p].in_index)
            pkvi_page_census(w->pg[p].pg, &c);
    uint64_t resident = 0, spilled = 0, indexed = 0, cached = 0, cached_res = 0;
    for (uint32_t p = 0; p < w->n_pg; p++) {
        const mpage *m = &w->pg[p];
        if (!m->alive)
            continue;
        EXPECT((m->pg->tally) == (0));
        resident += !m->spilled;
        spilled += m->spilled;
        indexed += m->in_index;
        EXPECT(pkvi_page_indexed(m->pg) == m->in_index);
        EXPECT(pkvi_page_shared(m->pg) == (m->holders > 1));
        EXPECT(pkvi_page_cached(m->pg) == (m->in_index && m->holders == 1));
        cached += m->in_index && m->holders == 1;
        cached_res += m->in_index && m->holders == 1 && !m->spilled;
        if (!m->spilled) {
            const unsigned char *b = m->pg->data;
            EXPECT_MSG(b[0] == m->mark && b[PB - 1] == m->mark, "%s: a page's bytes changed (seed %llu)", what, (unsigned long long)seed);
        }
    }
    EXPECT_MSG(c.ok, "%s: a page's refs differ from its holders (seed %llu)", what, (unsigned long long)seed);
    EXPECT((c.resident) == (resident));
    EXPECT((c.spilled) == (spilled));
    EXPECT((c.indexed) == (indexed));
    EXPECT((w->cached.pages) == (cached));
    EXPECT((w->cached.resident) == (cached_res));
    const pkvi_pool_counts pc = pkvi_pool_count(w->pool);
    EXPECT((pc.in_use) == (resident));
    EXPECT((pc.spilled) == (spilled));
    EXPECT(pkvi_pool_check(w->pool));
}

/* ---- the operations, each on the table and the model ------------------------------------- */

static int free_slot(const world *w)
{
    for (int k = 0; k < MAXT; k++)
        if (!w->tab[k].t)
            return k;
    return -1;
}

static mtab *new_table(world *w, int k, uint64_t sinks)
{
    mtab *T = &w->tab[k];
    memset(T, 0, sizeof *T);
    T->t = pkvi_btable_new();
    EXPECT((T->t) != NULL);
    T->sinks = sinks;
    return T;
}

/* One page through a whole transfer, as session/residency.c moves it (spill.h's
 * states; no other thread here, so its holders are synced after it ended). */
static void write_one(world *w, pkvi_page *pg)
{
    bool written = false;
    pkvi_spill_mark_out(pg);
    EXPECT((pkvi_spill_write(w->sp, &pg, 1, 1, &written)) == (PKV_OK));
    EXPECT(written);
    pkvi_spill_end_out(w->sp, w->pool, pg, true, false);
}

static void read_one(world *w, pkvi_page *pg)
{
    void *buf = NULL;
    EXPECT((pkvi_pool_get(w->pool, &buf)) == (PKV_OK));
    pkvi_spill_mark_in(pg);
    EXPECT((pkvi_spill_read(w->sp, &pg, &buf, 1)) == (PKV_OK));
    pkvi_spill_end_in(w->sp, w->pool, pg, buf, true);
}

/* Bring page p (at index i) back from the spill file, syncing its holders. */
static void restore(world *w, int32_t p, uint64_t i)
{
    pkvi_page *pg = w->pg[p].pg;
    read_one(w, pg);
    w->pg[p].spilled = false;
    sync_holders(w, p, i);
}

/* k rows at the end of T, as a reservation writes them: the tail back in memory, a
 * shared tail copied first, new pages pushed, marked while written, len advanced. */
static void append(world *w, mtab *T, uint64_t k)
{
    const uint64_t bt = w->bt, end_page = (T->len + k + bt - 1) / bt;
    if (end_page > MAXE)
        return;
    const bool partial = T->len % bt != 0;
    if (partial && T->ent[T->n - 1] < 0) /* a partly filled page released: the engine's */
        return;                          /* truncate rule never leaves one (cut_check) */
    if (partial && w->pg[T->ent[T->n - 1]].spilled)
        restore(w, T->ent[T->n - 1], T->n - 1);
    const bool cow = partial && w->pg[T->ent[T->n - 1]].holders > 1;
    EXPECT(!partial || pkvi_btable_tail_shared(T->t) == cow);
    EXPECT((pkvi_btable_reserve(T->t, end_page)) == (PKV_OK));
    if (cow) {
        pkvi_page *fresh;
        const int32_t old = T->ent[T->n - 1], p = new_page(w, &fresh);
        memset(fresh->data, 0, PB);
        pkvi_btable_cow_tail(T->t, w->ps, fresh, PB);
        w->pg[p].mark = w->pg[old].mark; /* the copy's bytes are the original's */
        w->pg[p].holders = 1;
        T->ent[T->n - 1] = p;
        model_unref(w, old); /* left to the index alone, it is cached now */
    }
    while (T->n < end_page) {
        pkvi_page *fresh;
        const int32_t p = new_page(w, &fresh);
        pkvi_btable_push(T->t, fresh);
        w->pg[p].holders = 1;
        T->ent[T->n++] = p;
    }
    const uint64_t first_page = T->len / bt;
    pkvi_btable_mark_writing(T->t, first_page, end_page, true);
    EXPECT(pkvi_btable_check(T->t, bt, false)); /* B5: only unshared pages marked */
    pkvi_btable_mark_writing(T->t, first_page, end_page, false);
    pkvi_btable_advance(T->t, k);
    T->len += k;
}

/* The model's truncate (btable.h): entries past ceil(n / bt) dropped, the hole clipped. */
static void truncate_to(world *w, mtab *T, uint64_t n)
{
    pkvi_btable_truncate(T->t, w->ps, w->bt, n);
    if (n >= T->len)
        return;
    const uint64_t keep = (n + w->bt - 1) / w->bt;
    for (uint64_t i = keep; i < T->n; i++)
        if (T->ent[i] >= 0)
            model_unref(w, T->ent[i]);
    if (T->n > keep)
        T->n = keep;
    if (T->hole_hi > keep)
        T->hole_hi = keep;
    if (T->hole_hi <= T->hole_lo)
        T->hole_lo = T->hole_hi = 0;
    if (n < T->first)
        T->first = 0;
    T->len = n;
}

/* A window's release of entries [max(hole_hi, sinks), keep_hi). */
static void release(world *w, mtab *T, uint64_t keep_hi)
{
    const uint64_t from = T->hole_hi > T->sinks ? T->hole_hi : T->sinks;
    const uint64_t hi = keep_hi < T->n ? keep_hi : T->n;
    EXPECT(pkvi_btable_release_due(T->t, T->sinks, keep_hi) == (hi > from));
    pkvi_btable_release(T->t, w->ps, T->sinks, keep_hi);
    if (hi <= from)
        return;
    for (uint64_t i = from; i < hi; i++) {
        model_unref(w, T->ent[i]);
        T->ent[i] = -1;
    }
    if (T->hole_hi == T->hole_lo)
        T->hole_lo = from;
    T->hole_hi = hi;
}

static void destroy_table(world *w, mtab *T)
{
    truncate_to(w, T, 0);
    EXPECT((pkvi_btable_n_pages(T->t)) == (0));
    pkvi_btable_free(T->t);
    T->t = NULL;
}

/* dst (a new table) shares every page of src, index-preserving (a fork). */
static void fork_table(world *w, mtab *src, mtab *dst)
{
    EXPECT((pkvi_btable_reserve(dst->t, src->n)) == (PKV_OK));
    pkvi_btable_share(dst->t, src->t);
    memcpy(dst->ent, src->ent, sizeof dst->ent);
    dst->n = src->n;
    dst->len = src->len;
    dst->hole_lo = src->hole_lo;
    dst->hole_hi = src->hole_hi;
    dst->first = src->first;
    dst->sinks = src->sinks;
    for (uint64_t i = 0; i < dst->n; i++)
        if (dst->ent[i] >= 0)
            w->pg[dst->ent[i]].holders++;
}

/* dst (a new table) takes src's first m pages as pkv_session_from_prefix does: one by
 * one with push_shared (the hole as NULL), then len advanced over them. */
static void share_prefix(world *w, mtab *src, mtab *dst, uint64_t m)
{
    EXPECT((pkvi_btable_reserve(dst->t, m)) == (PKV_OK));
    for (uint64_t i = 0; i < m; i++) {
        const int32_t p = src->ent[i];
        pkvi_btable_push_shared(dst->t, w->ps, p >= 0 ? w->pg[p].pg : NULL);
        if (p >= 0)
            w->pg[p].holders++;
        else {
            if (dst->hole_hi == dst->hole_lo)
                dst->hole_lo = dst->hole_hi = dst->n;
            dst->hole_hi++;
        }
        dst->ent[dst->n++] = p;
    }
    pkvi_btable_advance(dst->t, m * w->bt);
    dst->len = m * w->bt;
    dst->sinks = src->sinks;
}

/* Spill the resident page the spiller would meet first in T from entry i on, unless a
 * holder is pinned. */
static void spill_one(world *w, mtab *T, uint64_t from)
{
    uint64_t i = from;
    pkvi_page *pg = NULL;
    const bool found = pkvi_btable_next_resident(T->t, &i, &pg);
    /* the model's answer: nothing in a pinned or wholly spilled table */
    uint64_t want = UINT64_MAX;
    for (uint64_t k = from; !T->pins && k < T->n && want == UINT64_MAX; k++)
        if (T->ent[k] >= 0 && !w->pg[T->ent[k]].spilled)
            want = k;
    if (T->pins || pkvi_btable_n_spilled(T->t) == T->n)
        want = UINT64_MAX;
    EXPECT(found == (want != UINT64_MAX));
    if (!found)
        return;
    EXPECT((i) == (want));
    const int32_t p = T->ent[i];
    EXPECT((pg) == (w->pg[p].pg));
    if (holder_pinned(w, p, i))
        return;
    write_one(w, pg);
    EXPECT((pg->data) == NULL);
    w->pg[p].spilled = true;
    sync_holders(w, p, i);
}

/* Bring T's spilled entries from `from` on back, as fault-in does. */
static void restore_from(world *w, mtab *T, uint64_t from)
{
    uint64_t idx[MAXE];
    pkvi_page *pages[MAXE];
    const uint64_t n = pkvi_btable_spilled(T->t, from, idx, pages);
    uint64_t k = 0;
    for (uint64_t i = from; i < T->n; i++)
        if (T->ent[i] >= 0 && w->pg[T->ent[i]].spilled) {
            EXPECT((k) < (n));
            EXPECT((idx[k]) == (i));
            EXPECT((pages[k]) == (w->pg[T->ent[i]].pg));
            k++;
        }
    EXPECT((k) == (n));
    for (k = 0; k < n; k++)
        restore(w, T->ent[idx[k]], idx[k]);
}

/* A cached page (only the index holds it) spilled or restored, as the spiller and
 * fault-in do: the cached counts' resident part follows it (session/residency.c). */
static void move_cached(world *w, int32_t p)
{
    pkvi_page *pg = w->pg[p].pg;
    if (w->pg[p].spilled) {
        read_one(w, pg);
        w->cached.resident++;
    } else {
        write_one(w, pg);
        w->cached.resident--;
    }
    w->pg[p].spilled = !w->pg[p].spilled;
}

static mtab *random_table(world *w, pkvt_rng *r)
{
    const int k0 = (int)pkvt_below(r, MAXT);
    for (int d = 0; d < MAXT; d++)
        if (w->tab[(k0 + d) % MAXT].t)
            return &w->tab[(k0 + d) % MAXT];
    return NULL;
}

/* A random alive page with a property: indexed or not, any. -1 if none. */
static int32_t random_page(world *w, pkvt_rng *r, int want_indexed)
{
    if (!w->n_pg)
        return -1;
    const uint32_t p0 = pkvt_below(r, w->n_pg);
    for (uint32_t d = 0; d < w->n_pg; d++) {
        const uint32_t p = (p0 + d) % w->n_pg;
        if (w->pg[p].alive && (want_indexed < 0 || w->pg[p].in_index == (want_indexed > 0)))
            return (int32_t)p;
    }
    return -1;
}

static void step(world *w, pkvt_rng *r)
{
    const uint64_t bt = w->bt;
    mtab *T = random_table(w, r);
    const uint32_t op = pkvt_below(r, 16);
    if (!T || op == 0) {                                   /* a new table */
        const int k = free_slot(w);
        if (k < 0)
            return;
        mtab *N = new_table(w, k, pkvt_below(r, 3));
        if (pkvt_below(r, 4) == 0) {                       /* a shard's start */
            const uint64_t f = (1 + pkvt_below(r, 3)) * bt;
            EXPECT((pkvi_btable_set_first(N->t, bt, f)) == (PKV_OK));
            N->n = N->hole_hi = f / bt;
            for (uint64_t i = 0; i < N->n; i++)
                N->ent[i] = -1;
            N->len = N->first = f;
            N->sinks = 0;
        }
        check_world(w, "new table");
        return;
    }
    if (op <= 4) {
        append(w, T, 1 + pkvt_below(r, (uint32_t)(2 * bt)));
        check_world(w, "append");
    } else if (op == 5) {
        const uint64_t n = pkvt_below(r, (uint32_t)T->len + 1);
        if (n >= T->first || n == 0) /* below a shard's start only a destroy goes */
            truncate_to(w, T, n);
        check_world(w, "truncate");
    } else if (op == 6) {
        release(w, T, pkvt_below(r, (uint32_t)T->n + 2));
        check_world(w, "release");
    } else if (op == 7 || op == 8) {                       /* fork, or share a prefix */
        const int k = free_slot(w);
        if (k < 0)
            return;
        mtab *D = new_table(w, k, 0);
        if (op == 7)
            fork_table(w, T, D);
        else
            share_prefix(w, T, D, pkvt_below(r, (uint32_t)(T->len / bt) + 1));
        check_world(w, op == 7 ? "fork" : "share prefix");
    } else if (op == 9) {                                  /* the index takes a full page */
        const uint64_t full = T->len / bt;
        if (!full)
            return;
        const uint64_t i = pkvt_below(r, (uint32_t)full);
        const int32_t p = T->ent[i];
        if (p < 0 || w->pg[p].in_index)
            return;
        pkvi_page_index(w->pg[p].pg);
        w->pg[p].in_index = true;
        w->pg[p].holders++;
        check_world(w, "index");
    } else if (op == 10) {                                 /* the index lets one go */
        const int32_t p = random_page(w, r, 1);
        if (p < 0)
            return;
        if (w->pg[p].holders == 1) /* it was cached: it goes now */
            EXPECT(pkvi_page_cached(w->pg[p].pg));
        pkvi_page_unindex(w->ps, w->pg[p].pg);
        w->pg[p].in_index = false;
        model_unref(w, p);
        check_world(w, "unindex");
    } else if (op == 11 || op == 12) {
        spill_one(w, T, pkvt_below(r, (uint32_t)T->n + 1));
        check_world(w, "spill");
    } else if (op == 13) {
        if (pkvt_below(r, 2))
            restore_from(w, T, pkvt_below(r, (uint32_t)T->n + 1));
        else {
            const int32_t p = random_page(w, r, 1);
            if (p >= 0 && w->pg[p].holders == 1)
                move_cached(w, p);
        }
        check_world(w, "restore");
    } else if (op == 14) {
        if (T->pins && pkvt_below(r, 3)) {
            pkvi_btable_unpin(T->t);
            T->pins--;
        } else if (T->pins < 3) {
            pkvi_btable_pin(T->t);
            T->pins++;
        }
        check_world(w, "pin");
    } else {
        if (T->pins)
            return;
        destroy_table(w, T);
        check_world(w, "destroy");
    }
}

static void world_fini(world *w)
{
    for (int k = 0; k < MAXT; k++)
        if (w->tab[k].t)
            destroy_table(w, &w->tab[k]);
    for (uint32_t p = 0; p < w->n_pg; p++)
        if (w->pg[p].alive && w->pg[p].in_index) {
            pkvi_page_unindex(w->ps, w->pg[p].pg);
            w->pg[p].in_index = false;
            model_unref(w, (int32_t)p);
        }
    check_world(w, "end");
    EXPECT((pkvi_pool_count(w->pool).in_use) == (0));
    EXPECT((pkvi_pool_count(w->pool).spilled) == (0));
    pkvi_spill_close(w->sp);
    pkvi_pool_destroy(w->pool);
    pkvt_remove_dir(w->dir);
}

START_TEST(random_steps_match_the_model)
{
    static const uint64_t bts[] = {1, 2, 3, 4, 16};
    const int steps = pkvt_quick() ? 400 : 4000;
    for (size_t b = 0; b < sizeof bts / sizeof *bts; b++) {
        world *w = pkvt_alloc(sizeof *w);
        const uint64_t seed = pkvt_seed() ^ (b * 977);
        world_init(w, bts[b], seed);
        pkvt_rng r;
        pkvt_rng_init(&r, seed);
        for (int s = 0; s < steps && w->n_pg + 2 * MAXE < MAXP; s++)
            step(w, &r);
        world_fini(w);
        free(w);
    }
}
END_TEST

/* ---- edges ------------------------------------------------------------------------------- */

START_TEST(truncate_to_zero_and_reuse)
{
    world *w = pkvt_alloc(sizeof *w);
    world_init(w, 4, 1);
    mtab *A = new_table(w, 0, 1), *B = new_table(w, 1, 1);
    append(w, A, 13);                     /* 4 pages, the last with 1 row */
    fork_table(w, A, B);
    release(w, A, 3);                     /* A: hole [1, 3) */
    check_world(w, "released");
    truncate_to(w, A, 0);                 /* the hole goes with everything else */
    check_world(w, "A empty");
    EXPECT((pkvi_btable_held(A->t)) == (0));
    EXPECT((pkvi_btable_hole_end(A->t)) == (0));
    truncate_to(w, A, 0);                 /* again: nothing */
    append(w, A, 5);                      /* and the table is as new */
    check_world(w, "A again");
    truncate_to(w, B, 8);                 /* exactly at a page boundary: 2 pages stay */
    EXPECT((pkvi_btable_n_pages(B->t)) == (2));
    truncate_to(w, B, 7);                 /* inside the last page: it stays, partly */
    EXPECT((pkvi_btable_n_pages(B->t)) == (2));
    EXPECT(!pkvi_btable_tail_shared(B->t));
    check_world(w, "B cut");
    world_fini(w);
    free(w);
}
END_TEST

START_TEST(release_and_the_hole_at_page_boundaries)
{
    world *w = pkvt_alloc(sizeof *w);
    world_init(w, 2, 2);
    mtab *T = new_table(w, 0, 1);         /* one sink page */
    append(w, T, 12);                     /* 6 pages */
    EXPECT(!pkvi_btable_release_due(T->t, 1, 1));   /* keep_hi == keep_lo */
    EXPECT(!pkvi_btable_release_due(T->t, 1, 0));   /* below it */
    release(w, T, 1);
    check_world(w, "nothing to release");
    EXPECT((pkvi_btable_hole_end(T->t)) == (0));
    release(w, T, 2);                     /* exactly one page: hole [1, 2) */
    EXPECT((pkvi_btable_hole_end(T->t)) == (2));
    EXPECT((pkvi_btable_held(T->t)) == (5));
    EXPECT(!pkvi_btable_release_due(T->t, 1, 2));   /* already released */
    release(w, T, 2);
    release(w, T, 4);                     /* the hole grows from its end: [1, 4) */
    EXPECT((pkvi_btable_hole_end(T->t)) == (4));
    check_world(w, "hole grown");
    release(w, T, 100);                   /* clamped to the table: everything past sinks */
    EXPECT((pkvi_btable_hole_end(T->t)) == (6));
    EXPECT((pkvi_btable_held(T->t)) == (1));
    check_world(w, "all released");
    append(w, T, 3);                      /* rows after the hole: pages 6, 7 */
    EXPECT((pkvi_btable_n_pages(T->t)) == (8));
    check_world(w, "appended after the hole");
    truncate_to(w, T, 9);                 /* back into the hole's last page: clipped */
    EXPECT((pkvi_btable_hole_end(T->t)) == (5));
    check_world(w, "cut into the hole");
    truncate_to(w, T, 2);                 /* to the sinks: the hole is gone */
    EXPECT((pkvi_btable_hole_end(T->t)) == (0));
    check_world(w, "sinks only");
    world_fini(w);
    free(w);
}
END_TEST

START_TEST(a_shard_starts_at_its_first_page)
{
    world *w = pkvt_alloc(sizeof *w);
    world_init(w, 4, 3);
    mtab *T = new_table(w, 0, 0);
    const uint64_t f = 12;                /* pages 0..2 are other shards' */
    EXPECT((pkvi_btable_set_first(T->t, 4, f)) == (PKV_OK));
    T->n = T->hole_hi = 3;
    T->ent[0] = T->ent[1] = T->ent[2] = -1;
    T->len = T->first = f;
    check_world(w, "empty shard");
    append(w, T, 1);                      /* the first page pushed is page 3 */
    EXPECT((pkvi_btable_page(T->t, 3)) != NULL);
    EXPECT((pkvi_btable_page(T->t, 2)) == NULL);
    EXPECT((pkvi_btable_held(T->t)) == (1));
    append(w, T, 6);
    check_world(w, "shard grown");
    uint64_t at = 0;
    EXPECT((pkvi_btable_cut_check(T->t, 4, 0, f - 1, &at)) == (PKVI_CUT_SHARD));
    EXPECT((at) == (f));
    EXPECT((pkvi_btable_cut_check(T->t, 4, 0, f, &at)) == (PKVI_CUT_OK));
    truncate_to(w, T, f);                 /* back to the start: the hole stays */
    EXPECT((pkvi_btable_hole_end(T->t)) == (3));
    EXPECT((pkvi_btable_first(T->t)) == (f));
    check_world(w, "shard at its start");
    /* a loaded window: the sink pages, then the released hole up to page 5 */
    mtab *L = new_table(w, 1, 1);
    append(w, L, 4);                      /* exactly the sink page */
    EXPECT((pkvi_btable_skip_to(L->t, 4, 1, 1)) == (PKV_EINVAL));  /* no room */
    EXPECT((pkvi_btable_skip_to(L->t, 4, 2, 5)) == (PKV_EINVAL));  /* not lo pages */
    EXPECT((pkvi_btable_skip_to(L->t, 4, 1, 5)) == (PKV_OK));
    for (uint64_t i = 1; i < 5; i++)
        L->ent[i] = -1;
    L->hole_lo = 1;
    L->n = L->hole_hi = 5;
    L->len = 20;
    check_world(w, "loaded hole");
    EXPECT((pkvi_btable_skip_to(L->t, 4, 5, 7)) == (PKV_EINVAL));  /* a hole already */
    append(w, L, 2);                      /* the next page is 5 */
    EXPECT((pkvi_btable_page(L->t, 5)) != NULL);
    check_world(w, "after the loaded hole");
    world_fini(w);
    free(w);
}
END_TEST

START_TEST(the_truncate_rules_of_a_window)
{
    world *w = pkvt_alloc(sizeof *w);
    world_init(w, 4, 4);
    mtab *T = new_table(w, 0, 1);
    append(w, T, 40);                     /* 10 pages */
    release(w, T, 6);                     /* hole [1, 6): positions 4..23 released */
    uint64_t at = 0;
    /* window 8: a decode at n - 1 reads from n - 8 on */
    EXPECT((pkvi_btable_cut_check(T->t, 4, 8, 40, &at)) == (PKVI_CUT_OK)); /* no-op */
    EXPECT((pkvi_btable_cut_check(T->t, 4, 8, 32, &at)) == (PKVI_CUT_OK)); /* 24.. */
    EXPECT((pkvi_btable_cut_check(T->t, 4, 8, 31, &at)) == (PKVI_CUT_RELEASED));
    EXPECT((at) == (24));
    EXPECT((pkvi_btable_cut_check(T->t, 4, 8, 4, &at)) == (PKVI_CUT_OK)); /* sinks only */
    EXPECT((pkvi_btable_cut_check(T->t, 4, 8, 0, &at)) == (PKVI_CUT_OK));
    EXPECT((pkvi_btable_cut_check(T->t, 4, 0, 31, &at)) == (PKVI_CUT_OK)); /* no window */
    check_world(w, "checked");
    world_fini(w);
    free(w);
}
END_TEST

START_TEST(growth_that_cannot_happen_changes_nothing)
{
    world *w = pkvt_alloc(sizeof *w);
    world_init(w, 2, 5);
    mtab *T = new_table(w, 0, 0);
    append(w, T, 5);
    const void *const *data = pkvi_btable_data(T->t);
    /* a capacity whose bytes overflow: refused before any allocation */
    EXPECT((pkvi_btable_reserve(T->t, UINT64_MAX / 4)) == (PKV_ENOMEM));
    EXPECT((pkvi_btable_reserve(T->t, UINT64_MAX)) == (PKV_ENOMEM));
    EXPECT((pkvi_btable_data(T->t)) == (data));
    check_world(w, "refused");
    mtab *E = new_table(w, 2, 0);
    EXPECT((pkvi_btable_set_first(E->t, 2, UINT64_MAX / 2)) == (PKV_ENOMEM));
    check_world(w, "set_first refused");
    /* the checks see what no holder backs, and a shared page being written */
    mtab *F = new_table(w, 1, 0);
    fork_table(w, T, F);
    pkvi_page *pg = pkvi_btable_page(T->t, 0);
    pkvi_page_skew_refs(pg, +1);
    pkvi_btable_tally(T->t, true);
    pkvi_btable_tally(F->t, true);
    pkvi_btable_tally(T->t, false);
    pkvi_btable_tally(F->t, false);
    pkvi_census c = {.ok = true};
    pkvi_btable_census(T->t, &c);
    pkvi_btable_census(F->t, &c);
    EXPECT(!c.ok);
    pkvi_page_skew_refs(pg, -1);
    pkvi_btable_mark_writing(T->t, 0, 1, true);
    EXPECT(!pkvi_btable_check(T->t, 2, true));
    pkvi_btable_mark_writing(T->t, 0, 1, false);
    pkvi_btable_pin(T->t);
    EXPECT(!pkvi_btable_check(T->t, 2, true)); /* pins: not between calls */
    EXPECT(pkvi_btable_check(T->t, 2, false));
    pkvi_btable_unpin(T->t);
    check_world(w, "restored");
    world_fini(w);
    free(w);
    pkvi_btable_free(NULL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("btable");
    TCase *tc = tcase_create("btable");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, random_steps_match_the_model);
    tcase_add_test(tc, truncate_to_zero_and_reuse);
    tcase_add_test(tc, release_and_the_hole_at_page_boundaries);
    tcase_add_test(tc, a_shard_starts_at_its_first_page);
    tcase_add_test(tc, the_truncate_rules_of_a_window);
    tcase_add_test(tc, growth_that_cannot_happen_changes_nothing);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

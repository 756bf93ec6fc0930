/*
 * btable.c - a layer's block table (btable.h): its entries and the references they
 * hold; growth, push, copy-on-write, truncate, a window's release, the holes of shards
 * and loaded windows, sharing (fork, prefix cache), pins, the residency walks of the
 * spiller, the figures of pkv_session_memory / _pages, and the checks.
 *
 * Owns struct pkvi_btable, which no other file sees, and every read and write of
 * pkvi_page.refs and .indexed: the only code that adds, drops or counts a holder (B5).
 * Runs under the engine lock but for the owner thread's reads (btable.h); knows
 * nothing of sessions, budgets or the I/O behind a spill.
 */
#include "cache/btable.h"

#include <stdlib.h>
#include <string.h>

struct pkvi_btable {
    uint64_t len;            /* cached positions (absolute: a shard's start at first) */
    uint64_t pend;           /* pending drafts (pkv_verify): rows stored at positions
                                len .. len + pend - 1, which len does not count */
    uint64_t n_pages;        /* entries in use (B1) */
    uint64_t cap;            /* capacity of pages[] and data[] */
    pkvi_page **pages;       /* [cap] descriptors, one reference each (NULL: the hole) */
    const void **data;       /* [cap] pages[i]->data, NULL while spilled or in transit
                                (B2): what decode walks */
    uint64_t n_spilled;      /* entries whose data[i] is NULL but for the hole: the
                                page spilled or in transit (B3) */
    uint64_t hole_lo, hole_hi; /* released entries [hole_lo, hole_hi); empty: equal */
    uint64_t stale_lo, stale_hi; /* positions a discard (SPEC §14) left without rows
                                  nothing may read: its new hole's and up to a page of
                                  rows beyond, which held pages keep (empty: equal) */
    uint64_t first;          /* a shard's first position (pkv_session_set_first): its
                                first first / bt entries are a hole; 0 otherwise */
    uint32_t pins;           /* calls reading or writing this table's pages right now
                                (spill engines only): the spiller leaves them alone */
};

/* ---- references ------------------------------------------------------------------------ */

/* A page left to the prefix index alone became a cached page, or stopped being one. */
static void cached_add(pkvi_pages ps, const pkvi_page *pg, int sign)
{
    if (sign > 0) {
        ps.cached->pages++;
        ps.cached->resident += pg->data != NULL;
    } else {
        ps.cached->pages--;
        ps.cached->resident -= pg->data != NULL;
    }
}

/* Drop one reference; the last one frees the page (and its slot, when spilled). A
 * page left to the prefix index alone becomes a cached page. A page in transit
 * (spill.h) is left to its transfer, which frees it when it ends: its buffer or slot
 * is in use until then (session/residency.c asks pkvi_page_orphan). */
static void page_unref(pkvi_pages ps, pkvi_page *pg)
{
    if (--pg->refs > 0) {
        if (pg->refs == 1 && pg->indexed)
            cached_add(ps, pg, +1);
        return;
    }
    if (pg->transit != PKVI_SETTLED)
        return;
    if (!pg->data)
        pkvi_spill_drop(ps.spill, ps.pool, pg);
    pkvi_page_destroy(ps.pool, pg);
}

/* What an entry naming pg shows decode (B2): its bytes while resident and settled;
 * NULL while spilled or in transit (a reader must wait for the transfer). */
static const void *readable(const pkvi_page *pg)
{
    return pg->transit == PKVI_SETTLED ? pg->data : NULL;
}

/* Entry i names pg (whose reference the caller already counted). */
static void set_entry(pkvi_btable *t, uint64_t i, pkvi_page *pg)
{
    t->pages[i] = pg;
    t->data[i] = pg ? readable(pg) : NULL;
    t->n_spilled += pg && t->data[i] == NULL;
}

/* Entry i stops naming its page (not in the hole); the reference is dropped. */
static void drop_entry(pkvi_btable *t, pkvi_pages ps, uint64_t i)
{
    pkvi_page *pg = t->pages[i];
    t->n_spilled -= t->data[i] == NULL;
    t->pages[i] = NULL;
    t->data[i] = NULL;
    page_unref(ps, pg);
}

static bool in_hole(const pkvi_btable *t, uint64_t i)
{
    return i >= t->hole_lo && i < t->hole_hi;
}

/* ---- life ------------------------------------------------------------------------------ */

pkvi_btable *pkvi_btable_new(void)
{
    return calloc(1, sizeof(pkvi_btable));
}

void pkvi_btable_free(pkvi_btable *t)
{
    if (!t)
        return;
    free(t->pages);
    free(t->data);
    free(t);
}

/* ---- reading --------------------------------------------------------------------------- */

uint64_t pkvi_btable_len(const pkvi_btable *t)
{
    return t->len;
}

uint64_t pkvi_btable_n_pages(const pkvi_btable *t)
{
    return t->n_pages;
}

uint64_t pkvi_btable_first(const pkvi_btable *t)
{
    return t->first;
}

uint64_t pkvi_btable_pending(const pkvi_btable *t)
{
    return t->pend;
}

uint64_t pkvi_btable_held(const pkvi_btable *t)
{
    return t->n_pages - (t->hole_hi - t->hole_lo);
}

uint64_t pkvi_btable_n_spilled(const pkvi_btable *t)
{
    return t->n_spilled;
}

uint64_t pkvi_btable_hole_end(const pkvi_btable *t)
{
    return t->hole_hi > t->hole_lo ? t->hole_hi : 0;
}

pkvi_page *pkvi_btable_page(const pkvi_btable *t, uint64_t i)
{
    return t->pages[i];
}

const void *const *pkvi_btable_data(const pkvi_btable *t)
{
    return t->data;
}

uint64_t pkvi_btable_overhead(const pkvi_btable *t)
{
    return sizeof *t + t->cap * (sizeof(pkvi_page *) + sizeof(void *)) +
           pkvi_btable_held(t) * sizeof(pkvi_page);
}

/* ---- writing rows ---------------------------------------------------------------------- */

pkv_status pkvi_btable_reserve(pkvi_btable *t, uint64_t n)
{
    if (n <= t->cap)
        return PKV_OK;
    uint64_t cap = t->cap ? t->cap * 2 : 4;
    if (cap < n)
        cap = n;
    uint64_t bytes;
    if (!pkvi_mul(cap, sizeof(void *), &bytes) || bytes > SIZE_MAX)
        return PKV_ENOMEM;
    /* Two arrays: a failure of the second leaves the first grown, which changes
     * nothing observable (cap is raised only once both are). */
    pkvi_page **pages = realloc(t->pages, (size_t)bytes);
    if (!pages)
        return PKV_ENOMEM;
    t->pages = pages;
    const void **data = realloc(t->data, (size_t)bytes);
    if (!data)
        return PKV_ENOMEM;
    t->data = data;
    t->cap = cap;
    return PKV_OK;
}

void pkvi_btable_push(pkvi_btable *t, pkvi_page *fresh)
{
    fresh->refs = 1;
    set_entry(t, t->n_pages++, fresh);
}

bool pkvi_btable_tail_shared(const pkvi_btable *t)
{
    return t->n_pages && t->pages[t->n_pages - 1] && t->pages[t->n_pages - 1]->refs > 1;
}

void pkvi_btable_cow_tail(pkvi_btable *t, pkvi_pages ps, pkvi_page *fresh,
                          uint64_t page_bytes)
{
    pkvi_btable_cow_at(t, ps, t->n_pages - 1, fresh, page_bytes);
}

bool pkvi_btable_shared_at(const pkvi_btable *t, uint64_t i)
{
    return i < t->n_pages && t->pages[i] && t->pages[i]->refs > 1;
}

void pkvi_btable_cow_at(pkvi_btable *t, pkvi_pages ps, uint64_t i, pkvi_page *fresh,
                        uint64_t page_bytes)
{
    memcpy(fresh->data, t->pages[i]->data, (size_t)page_bytes);
    drop_entry(t, ps, i);
    fresh->refs = 1;
    set_entry(t, i, fresh);
}

void pkvi_btable_mark_writing(pkvi_btable *t, uint64_t from, uint64_t to, bool on)
{
    for (uint64_t i = from; i < to; i++)
        atomic_store_explicit(&t->pages[i]->writing, on ? 1u : 0u, memory_order_relaxed);
}

void pkvi_btable_advance(pkvi_btable *t, uint64_t n)
{
    t->len += n;
}

/* ---- pending drafts ------------------------------------------------------------------ */

void pkvi_btable_set_pending(pkvi_btable *t, uint64_t n)
{
    t->pend = n;
}

void pkvi_btable_drop_from(pkvi_btable *t, pkvi_pages ps, uint64_t i)
{
    for (uint64_t k = i; k < t->n_pages; k++)
        if (t->pages[k])
            drop_entry(t, ps, k);
    if (i < t->n_pages)
        t->n_pages = i;
}

void pkvi_btable_settle(pkvi_btable *t, pkvi_pages ps, uint64_t bt, uint64_t n_keep)
{
    t->len += n_keep;
    t->pend = 0;
    pkvi_btable_drop_from(t, ps, (t->len + bt - 1) / bt);
}

/* ---- giving pages back ----------------------------------------------------------------- */

void pkvi_btable_truncate(pkvi_btable *t, pkvi_pages ps, uint64_t bt, uint64_t n)
{
    if (n >= t->len) {
        if (!t->pend) /* pending drafts go too (a destroy) */
            return;
        n = t->len;
    }
    t->pend = 0;
    const uint64_t keep = (n + bt - 1) / bt;
    for (uint64_t i = keep; i < t->n_pages; i++)
        if (t->pages[i]) /* else released (the hole) */
            drop_entry(t, ps, i);
    if (t->n_pages > keep)
        t->n_pages = keep;
    if (t->hole_hi > keep)
        t->hole_hi = keep;
    if (t->hole_hi <= t->hole_lo)
        t->hole_lo = t->hole_hi = 0;
    if (t->stale_hi > n)
        t->stale_hi = n;
    if (t->stale_hi <= t->stale_lo)
        t->stale_lo = t->stale_hi = 0;
    if (n < t->first) /* only a destroy goes below a shard's first position */
        t->first = 0;
    t->len = n;
}

pkvi_cut pkvi_btable_cut_check(const pkvi_btable *t, uint64_t bt, uint32_t w, uint64_t n,
                               uint64_t *at)
{
    if (n < t->first) {
        *at = t->first;
        return PKVI_CUT_SHARD;
    }
    /* a windowed layer goes back only as far as what a decode at n - 1 reads is held;
     * the hole below a shard's first position holds other shards' positions, not
     * released ones */
    if (!w || n >= t->len || n == 0)
        return PKVI_CUT_OK;
    const uint64_t lo = n > w ? n - w : 0;
    const uint64_t base = t->first > t->hole_lo * bt ? t->first : t->hole_lo * bt;
    if (t->hole_hi * bt > base && lo < t->hole_hi * bt && n > base) {
        *at = t->hole_hi * bt;
        return PKVI_CUT_RELEASED;
    }
    if (t->stale_hi > t->stale_lo && lo < t->stale_hi && n > t->stale_lo) {
        *at = t->stale_hi;
        return PKVI_CUT_RELEASED;
    }
    return PKVI_CUT_OK;
}

bool pkvi_btable_release_due(const pkvi_btable *t, uint64_t keep_lo, uint64_t keep_hi)
{
    const uint64_t from = t->hole_hi > keep_lo ? t->hole_hi : keep_lo;
    return (keep_hi < t->n_pages ? keep_hi : t->n_pages) > from;
}

void pkvi_btable_release(pkvi_btable *t, pkvi_pages ps, uint64_t keep_lo, uint64_t keep_hi)
{
    const uint64_t from = t->hole_hi > keep_lo ? t->hole_hi : keep_lo;
    if (keep_hi > t->n_pages)
        keep_hi = t->n_pages;
    if (keep_hi <= from)
        return;
    for (uint64_t i = from; i < keep_hi; i++)
        drop_entry(t, ps, i);
    if (t->hole_hi == t->hole_lo)
        t->hole_lo = from;
    t->hole_hi = keep_hi;
}

/* ---- holes a table starts with --------------------------------------------------------- */

/* Entries [lo, hi) become the hole (capacity reserved, entries [0, lo) full, no hole
 * yet) and len = hi * bt. */
static void make_hole(pkvi_btable *t, uint64_t bt, uint64_t lo, uint64_t hi)
{
    for (uint64_t i = lo; i < hi; i++)
        set_entry(t, i, NULL);
    t->hole_lo = lo;
    t->hole_hi = t->n_pages = hi;
    t->len = hi * bt;
}

pkv_status pkvi_btable_set_first(pkvi_btable *t, uint64_t bt, uint64_t first)
{
    const uint64_t n = first / bt;
    const pkv_status st = pkvi_btable_reserve(t, n);
    if (st != PKV_OK)
        return st;
    make_hole(t, bt, 0, n);
    t->len = t->first = first;
    return PKV_OK;
}

pkv_status pkvi_btable_skip_to(pkvi_btable *t, uint64_t bt, uint64_t lo, uint64_t page)
{
    /* a shard's table starts as its own hole [0, first / bt), which the window's
     * release extends (lo 0); any other holds its sink pages and no hole yet */
    const bool fresh = t->first ? lo == 0 && t->n_pages == t->first / bt &&
                                      t->hole_lo == 0 && t->hole_hi == t->n_pages
                                : t->n_pages == lo && t->hole_hi == t->hole_lo;
    if (!fresh || t->len != t->n_pages * bt || page <= t->n_pages)
        return PKV_EINVAL;
    const pkv_status st = pkvi_btable_reserve(t, page);
    if (st != PKV_OK)
        return st;
    make_hole(t, bt, lo, page);
    return PKV_OK;
}

/* ---- a discard's new tail (SPEC §14) ----------------------------------------------------- */

void pkvi_btable_hole(const pkvi_btable *t, uint64_t *lo, uint64_t *hi)
{
    *lo = t->hole_lo;
    *hi = t->hole_hi;
}

void pkvi_btable_stale(const pkvi_btable *t, uint64_t *lo, uint64_t *hi)
{
    *lo = t->stale_lo;
    *hi = t->stale_hi;
}

void pkvi_btable_set_stale(pkvi_btable *t, uint64_t lo, uint64_t hi)
{
    t->stale_lo = hi > lo ? lo : 0;
    t->stale_hi = hi > lo ? hi : 0;
}

void pkvi_page_mark_writing(pkvi_page *pg, bool on)
{
    atomic_store_explicit(&pg->writing, on ? 1u : 0u, memory_order_relaxed);
}

void pkvi_btable_rewrite(pkvi_btable *t, pkvi_pages ps, uint64_t from, pkvi_page *const *dst,
                         uint64_t n, const pkvi_btable_shape *sh)
{
    for (uint64_t i = from + n; i < t->n_pages; i++)
        if (t->pages[i])
            drop_entry(t, ps, i);
    for (uint64_t i = 0; i < n; i++) {
        pkvi_page *old = t->pages[from + i], *pg = dst[i];
        if (pg == old)
            continue;
        if (old)
            drop_entry(t, ps, from + i);
        if (pg)
            pg->refs = 1; /* fresh: the table's is its first reference */
        set_entry(t, from + i, pg);
    }
    t->n_pages = from + n;
    t->len = sh->len;
    t->hole_lo = sh->hole_hi > sh->hole_lo ? sh->hole_lo : 0;
    t->hole_hi = sh->hole_hi > sh->hole_lo ? sh->hole_hi : 0;
    pkvi_btable_set_stale(t, sh->stale_lo, sh->stale_hi);
}

/* ---- sharing ----------------------------------------------------------------------------- */

void pkvi_btable_share(pkvi_btable *dst, const pkvi_btable *src)
{
    for (uint64_t i = 0; i < src->n_pages; i++) {
        pkvi_page *pg = src->pages[i];
        if (pg)
            pg->refs++;
        dst->pages[i] = pg;
        dst->data[i] = src->data[i];
    }
    dst->hole_lo = src->hole_lo;
    dst->hole_hi = src->hole_hi;
    dst->stale_lo = src->stale_lo;
    dst->stale_hi = src->stale_hi;
    dst->n_pages = src->n_pages;
    dst->n_spilled = src->n_spilled;
    dst->len = src->len;
    dst->first = src->first;
}

void pkvi_btable_push_shared(pkvi_btable *t, pkvi_pages ps, pkvi_page *pg)
{
    if (!pg) {
        if (t->hole_hi == t->hole_lo)
            t->hole_lo = t->hole_hi = t->n_pages;
        t->hole_hi++;
        set_entry(t, t->n_pages++, NULL);
        return;
    }
    if (pg->refs == 1 && pg->indexed) /* a cached page is in use again */
        cached_add(ps, pg, -1);
    pg->refs++;
    set_entry(t, t->n_pages++, pg);
}

void pkvi_page_index(pkvi_page *pg)
{
    pg->refs++;
    pg->indexed = 1;
}

void pkvi_page_unindex(pkvi_pages ps, pkvi_page *pg)
{
    if (pg->refs == 1) /* it was a cached page: it goes now */
        cached_add(ps, pg, -1);
    pg->indexed = 0;
    page_unref(ps, pg);
}

bool pkvi_page_indexed(const pkvi_page *pg)
{
    return pg->indexed != 0;
}

bool pkvi_page_cached(const pkvi_page *pg)
{
    return pg->refs == 1 && pg->indexed;
}

bool pkvi_page_shared(const pkvi_page *pg)
{
    return pg->refs > 1;
}

bool pkvi_page_orphan(const pkvi_page *pg)
{
    return pg->refs == 0;
}

/* ---- pins and residency ------------------------------------------------------------------ */

void pkvi_btable_pin(pkvi_btable *t)
{
    t->pins++;
}

void pkvi_btable_unpin(pkvi_btable *t)
{
    t->pins--;
}

bool pkvi_btable_pinned(const pkvi_btable *t)
{
    return t->pins != 0;
}

bool pkvi_btable_next_resident(const pkvi_btable *t, uint64_t *i, pkvi_page **pg)
{
    if (t->pins || t->n_spilled == t->n_pages)
        return false;
    for (uint64_t k = *i; k < t->n_pages; k++)
        if (t->data[k]) { /* resident and settled (B2) */
            *i = k;
            *pg = t->pages[k];
            return true;
        }
    return false;
}

uint64_t pkvi_btable_spilled(const pkvi_btable *t, uint64_t from, uint64_t *idx,
                             pkvi_page **pages)
{
    uint64_t n = 0;
    if (!t->n_spilled)
        return 0;
    for (uint64_t i = from; i < t->n_pages; i++)
        if (t->pages[i] && t->data[i] == NULL) {
            if (idx && pages) {
                idx[n] = i;
                pages[n] = t->pages[i];
            }
            n++;
        }
    return n;
}

bool pkvi_btable_names(const pkvi_btable *t, uint64_t i, const pkvi_page *pg)
{
    return i < t->n_pages && t->pages[i] == pg;
}

void pkvi_btable_sync(pkvi_btable *t, uint64_t i)
{
    const void *now = readable(t->pages[i]);
    const bool was_out = t->data[i] == NULL, is_out = now == NULL;
    t->data[i] = now;
    t->n_spilled = t->n_spilled - was_out + is_out;
}

/* ---- accounting ---------------------------------------------------------------------------- */

uint64_t pkvi_btable_shared_resident(const pkvi_btable *t)
{
    uint64_t n = 0;
    for (uint64_t i = 0; i < t->n_pages; i++) {
        const pkvi_page *pg = t->pages[i];
        n += pg && pg->data && pg->refs - pg->indexed > 1; /* the index is no session */
    }
    return n;
}

uint64_t pkvi_btable_info(const pkvi_btable *t, uint64_t first, uint64_t n,
                          pkv_page_info *out)
{
    uint64_t k = 0;
    for (uint64_t i = first; i < t->n_pages && k < n; i++, k++) {
        const pkvi_page *pg = t->pages[i]; /* NULL: released by a window */
        out[k].id = (uint64_t)(uintptr_t)pg;
        out[k].refs = pg ? pg->refs - pg->indexed : 0; /* table entries: not the index's */
        out[k].resident = pg && pg->data != NULL;
    }
    return k;
}

/* ---- checks --------------------------------------------------------------------------------- */

bool pkvi_btable_check(const pkvi_btable *t, uint64_t bt, bool quiescent)
{
    if (t->n_pages > t->cap || (t->n_pages && (!t->pages || !t->data)))
        return false;
    /* B1 reads len, which a writer updates outside the lock: only when quiescent.
     * Pending drafts (pkv_verify) hold pages past len. */
    if (quiescent && t->n_pages != (t->len + t->pend + bt - 1) / bt)
        return false;
    if (t->hole_lo > t->hole_hi || t->hole_hi > t->n_pages)
        return false;
    if (t->stale_lo > t->stale_hi || (quiescent && t->stale_hi > t->len))
        return false;
    /* a shard: its first first / bt entries are the hole */
    if (t->first && (t->first % bt || t->len < t->first || t->hole_lo != 0 ||
                     t->hole_hi < t->first / bt))
        return false;
    uint64_t out = 0;
    for (uint64_t i = 0; i < t->n_pages; i++) {
        const pkvi_page *pg = t->pages[i];
        if (in_hole(t, i)) {
            if (pg || t->data[i])
                return false;
            continue;
        }
        if (!pg || pg->refs == 0 || t->data[i] != readable(pg))
            return false;
        /* B5, and B6: a page being written is never in transit */
        const bool writing = atomic_load_explicit(&pg->writing, memory_order_relaxed);
        if (writing && (pg->refs > 1 || pg->transit != PKVI_SETTLED))
            return false;
        out += t->data[i] == NULL;
    }
    return out == t->n_spilled && (!quiescent || t->pins == 0);
}

void pkvi_btable_tally(const pkvi_btable *t, bool reset)
{
    for (uint64_t i = 0; i < t->n_pages; i++)
        if (t->pages[i])
            t->pages[i]->tally = reset ? 0 : t->pages[i]->tally + 1;
}

void pkvi_page_census(pkvi_page *pg, pkvi_census *c)
{
    if (pg->tally == 0) /* visited already */
        return;
    c->ok &= pg->tally == pg->refs;
    c->resident += pg->data != NULL;
    c->spilled += pg->data == NULL;
    c->indexed += pg->indexed;
    c->transit += pg->transit != PKVI_SETTLED;
    pg->tally = 0;
}

void pkvi_btable_census(const pkvi_btable *t, pkvi_census *c)
{
    for (uint64_t i = 0; i < t->n_pages; i++)
        if (t->pages[i])
            pkvi_page_census(t->pages[i], c);
}

void pkvi_page_skew_refs(pkvi_page *pg, int delta)
{
    pg->refs = (uint32_t)((int64_t)pg->refs + delta);
}

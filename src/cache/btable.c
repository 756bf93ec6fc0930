/*
 * btable.c - a layer's block table: capacity, push, copy-on-write replace,
 * truncate, share (fork), residency sync, and its own consistency check.
 *
 * Owns the arrays of one table and the references its entries hold; the only code
 * that increments or decrements pkvi_page.refs (btable.h, B5). Runs under the engine
 * lock; knows nothing of sessions, budgets or the I/O behind a spill.
 */
#include "cache/btable.h"

#include <stdlib.h>

/* Drop one reference; the last one frees the page (and its slot, when spilled). A
 * page left to the prefix index alone becomes a cached page. */
static void page_unref(pkvi_pages ps, pkvi_page *pg)
{
    if (--pg->refs > 0) {
        if (pg->refs == 1 && pg->indexed) {
            ps.cached->pages++;
            ps.cached->resident += pg->data != NULL;
        }
        return;
    }
    if (!pg->data)
        pkvi_spill_drop(ps.spill, ps.pool, pg);
    pkvi_page_destroy(ps.pool, pg);
}

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

void pkvi_btable_push(pkvi_btable *t, pkvi_page *pg)
{
    t->pages[t->n_pages] = pg;
    t->data[t->n_pages] = pg->data;
    t->n_spilled += pg->data == NULL;
    t->n_pages++;
}

void pkvi_btable_replace(pkvi_btable *t, pkvi_pages ps, uint64_t i, pkvi_page *pg)
{
    pkvi_page *old = t->pages[i];
    t->n_spilled -= old->data == NULL;
    t->pages[i] = pg;
    t->data[i] = pg->data;
    t->n_spilled += pg->data == NULL;
    page_unref(ps, old);
}

void pkvi_btable_truncate(pkvi_btable *t, pkvi_pages ps, uint64_t bt, uint64_t n)
{
    if (n >= t->len)
        return;
    const uint64_t keep = (n + bt - 1) / bt;
    for (uint64_t i = keep; i < t->n_pages; i++) {
        if (!t->pages[i])
            continue; /* released (the hole) */
        t->n_spilled -= t->pages[i]->data == NULL;
        page_unref(ps, t->pages[i]);
    }
    if (t->n_pages > keep)
        t->n_pages = keep;
    if (t->hole_hi > keep)
        t->hole_hi = keep;
    if (t->hole_hi <= t->hole_lo)
        t->hole_lo = t->hole_hi = 0;
    if (n < t->first) /* only a destroy goes below a shard's first position */
        t->first = 0;
    t->len = n;
}

void pkvi_btable_release(pkvi_btable *t, pkvi_pages ps, uint64_t keep_lo, uint64_t keep_hi)
{
    const uint64_t from = t->hole_hi > keep_lo ? t->hole_hi : keep_lo;
    if (keep_hi > t->n_pages)
        keep_hi = t->n_pages;
    if (keep_hi <= from)
        return;
    for (uint64_t i = from; i < keep_hi; i++) {
        t->n_spilled -= t->pages[i]->data == NULL;
        page_unref(ps, t->pages[i]);
        t->pages[i] = NULL;
        t->data[i] = NULL;
    }
    if (t->hole_hi == t->hole_lo)
        t->hole_lo = from;
    t->hole_hi = keep_hi;
}

pkv_status pkvi_btable_set_first(pkvi_btable *t, uint64_t bt, uint64_t first)
{
    const uint64_t n = first / bt;
    const pkv_status st = pkvi_btable_reserve(t, n);
    if (st != PKV_OK)
        return st;
    for (uint64_t i = 0; i < n; i++) {
        t->pages[i] = NULL;
        t->data[i] = NULL;
    }
    t->hole_lo = 0;
    t->hole_hi = t->n_pages = n;
    t->len = t->first = first;
    return PKV_OK;
}

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
    dst->n_pages = src->n_pages;
    dst->n_spilled = src->n_spilled;
    dst->len = src->len;
    dst->first = src->first;
}

void pkvi_page_index(pkvi_page *pg)
{
    pg->refs++;
    pg->indexed = 1;
}

void pkvi_page_unindex(pkvi_pages ps, pkvi_page *pg)
{
    if (pg->refs == 1) { /* it was a cached page: it goes now */
        ps.cached->pages--;
        ps.cached->resident -= pg->data != NULL;
    }
    pg->indexed = 0;
    page_unref(ps, pg);
}

void pkvi_btable_push_shared(pkvi_btable *t, pkvi_pages ps, pkvi_page *pg)
{
    if (!pg) {
        if (t->hole_hi == t->hole_lo)
            t->hole_lo = t->hole_hi = t->n_pages;
        t->hole_hi++;
        t->pages[t->n_pages] = NULL;
        t->data[t->n_pages++] = NULL;
        return;
    }
    if (pg->refs == 1 && pg->indexed) { /* a cached page is in use again */
        ps.cached->pages--;
        ps.cached->resident -= pg->data != NULL;
    }
    pg->refs++;
    pkvi_btable_push(t, pg);
}

void pkvi_btable_sync(pkvi_btable *t, uint64_t i)
{
    const bool was_out = t->data[i] == NULL, is_out = t->pages[i]->data == NULL;
    t->data[i] = t->pages[i]->data;
    t->n_spilled = t->n_spilled - was_out + is_out;
}

void pkvi_btable_free(pkvi_btable *t)
{
    free(t->pages);
    free(t->data);
    t->pages = NULL;
    t->data = NULL;
    t->cap = t->n_pages = t->len = t->n_spilled = t->hole_lo = t->hole_hi = t->first = 0;
}

bool pkvi_btable_check(const pkvi_btable *t, uint64_t bt, bool quiescent)
{
    if (t->n_pages > t->cap || (t->n_pages && (!t->pages || !t->data)))
        return false;
    /* B1 reads len, which a writer updates outside the lock: only when quiescent. */
    if (quiescent && t->n_pages != (t->len + bt - 1) / bt)
        return false;
    if (t->hole_lo > t->hole_hi || t->hole_hi > t->n_pages)
        return false;
    /* a shard: its first first / bt entries are the hole */
    if (t->first && (t->first % bt || t->len < t->first || t->hole_lo != 0 ||
                     t->hole_hi < t->first / bt))
        return false;
    uint64_t out = 0;
    for (uint64_t i = 0; i < t->n_pages; i++) {
        const pkvi_page *pg = t->pages[i];
        const bool in_hole = i >= t->hole_lo && i < t->hole_hi;
        if (in_hole) {
            if (pg || t->data[i])
                return false;
            continue;
        }
        if (!pg || pg->refs == 0 || t->data[i] != pg->data)
            return false;
        if (pg->refs > 1 && atomic_load_explicit(&pg->writing, memory_order_relaxed))
            return false;
        out += pg->data == NULL;
    }
    return out == t->n_spilled && (!quiescent || t->pins == 0);
}

uint64_t pkvi_btable_overhead(const pkvi_btable *t)
{
    return t->cap * (sizeof(pkvi_page *) + sizeof(void *)) +
           pkvi_btable_held(t) * sizeof(pkvi_page);
}

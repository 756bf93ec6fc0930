/*
 * session/residency.c - which pages are in memory: the choice of spill victims (LRU
 * order, whole sessions at a time), making room under the budget, bringing a table's
 * spilled pages back (fault in), taking new pages all or nothing, and the pins that
 * keep the spiller away from a layer in use (pkvi_session_acquire / _release).
 *
 * Owns no state of its own: it works on the cache state's pool, spill file and
 * session list (cache/cache.h) under its lock. Calls down into btable.c (the tables'
 * residency walks, sync after a move), prefix.c (cached pages go first), pool.c
 * (pages, the budget) and spill.c (moving bytes); calls no other session file. What a
 * write takes from it is session/write.c's; creating, forking and destroying sessions
 * is session.c's.
 *
 * Spill victims: resident pages of the least recently used sessions first, whole
 * sessions at a time (a session is idle as a whole, and decode needs all of a layer's
 * pages back together, so spilling one session completely beats nibbling at many),
 * never a page of a pinned table. A page shared by forks is one descriptor: written
 * once, and only when no table holding it is pinned; every holder's entry is synced
 * (B2, B3). A holder is found where B4 says it can only be: the same (layer, index).
 */
#include "session/private.h"

#include <stdlib.h>
#include <string.h>

/* Spill at least this many pages per make_room: one batched write instead of many
 * single-page round trips when sessions grow page by page under a full budget. */
#define SPILL_BATCH 16u

/* ---- holders of a page (B4) ------------------------------------------------------ */

/* Whether a table holding pg (at layer, index i) is pinned. */
static bool holder_pinned(const pkvi_cache *cache, uint32_t layer, uint64_t i,
                          const pkvi_page *pg)
{
    for (const pkv_session *s = cache->sessions; s; s = s->next) {
        const pkvi_btable *t = s->layers[layer];
        if (pkvi_btable_pinned(t) && pkvi_btable_names(t, i, pg))
            return true;
    }
    return false;
}

/* pg (at layer, index i; one holder is t) moved: sync every table that holds it. */
static void sync_holders(pkvi_cache *cache, pkvi_btable *t, uint32_t layer, uint64_t i,
                         const pkvi_page *pg)
{
    if (!pkvi_page_shared(pg)) {
        pkvi_btable_sync(t, i);
        return;
    }
    for (pkv_session *s = cache->sessions; s; s = s->next)
        if (pkvi_btable_names(s->layers[layer], i, pg))
            pkvi_btable_sync(s->layers[layer], i);
}

/* ---- making room under the budget --------------------------------------------------- */

typedef struct {
    pkvi_page *pg;
    pkvi_btable *t;          /* a table holding it */
    uint32_t layer;
    uint64_t index;
} located;

static int by_lru(const void *a, const void *b)
{
    const pkv_session *x = *(pkv_session *const *)a, *y = *(pkv_session *const *)b;
    return x->lru < y->lru ? -1 : x->lru > y->lru;
}

/* Resident cached pages (only the prefix index holds them), least recently used
 * nodes first: the first spill victims, before any live session's page
 * (docs/prefix-cache.md). Marks them in tally like make_room does. */
static uint64_t cached_victims(const pkvi_geom *geo, pkvi_cache *cache, located *vic,
                               pkvi_page **pages, uint64_t want)
{
    uint64_t nv = 0;
    if (!cache->prefix.cached.resident)
        return 0;
    for (pkvi_pnode *n = cache->prefix.oldest; n && nv < want; n = n->newer)
        for (uint32_t l = 0; l < geo->cfg.n_layers && nv < want; l++) {
            pkvi_page *pg = n->pages[l];
            if (!pg || !pkvi_page_cached(pg) || !pg->data || pg->tally)
                continue;
            pg->tally = 1;
            vic[nv] = (located){pg, NULL, l, n->depth};
            pages[nv++] = pg;
        }
    return nv;
}

/*
 * Room for n more resident pages: spill pages of unpinned tables, least recently used
 * sessions first (at least SPILL_BATCH pages when anything must go). PKV_OK when the
 * budget already has room; PKV_ENOMEM when not enough can be spilled (the rest is
 * pinned by calls in flight) or there is no spill file; PKV_EIO when the write failed
 * (every page stays resident). Under the lock.
 */
static pkv_status make_room(const pkvi_geom *geo, pkvi_cache *cache, uint64_t n)
{
    uint64_t need;
    if (!pkvi_pool_room(cache->pool, n, &need))
        return PKV_ENOMEM;
    if (need == 0)
        return PKV_OK;
    if (!cache->spill) { /* cached pages (docs/prefix-cache.md) are dropped before
                            anything fails */
        pkvi_prefix_drop(&cache->prefix, pkvi_cache_pages(cache), need);
        return pkvi_pool_room(cache->pool, n, &need) && need == 0 ? PKV_OK : PKV_ENOMEM;
    }
    const uint64_t want = need < SPILL_BATCH ? SPILL_BATCH : need;

    pkv_session **order =
        malloc((size_t)(cache->n_sessions ? cache->n_sessions : 1) * sizeof *order);
    located *vic = malloc((size_t)want * sizeof *vic);
    pkvi_page **pages = malloc((size_t)want * sizeof *pages);
    if (!order || !vic || !pages) {
        free(order);
        free(vic);
        free(pages);
        return PKV_ENOMEM;
    }
    uint64_t ns = 0;
    for (pkv_session *s = cache->sessions; s; s = s->next)
        order[ns++] = s;
    qsort(order, (size_t)ns, sizeof *order, by_lru);

    /* `tally` marks a descriptor already chosen (a shared page is met once per holder) */
    uint64_t nv = cached_victims(geo, cache, vic, pages, want);
    /* cached pages alone suffice: no live page is spilled just to fill the batch */
    const bool cached_enough = nv >= need;
    for (uint64_t k = 0; !cached_enough && k < ns && nv < want; k++)
        for (uint32_t l = 0; l < geo->cfg.n_layers && nv < want; l++) {
            pkvi_btable *t = order[k]->layers[l];
            pkvi_page *pg;
            for (uint64_t i = 0; nv < want && pkvi_btable_next_resident(t, &i, &pg); i++) {
                if (pg->tally || (pkvi_page_shared(pg) && holder_pinned(cache, l, i, pg)))
                    continue;
                pg->tally = 1;
                vic[nv] = (located){pg, t, l, i};
                pages[nv++] = pg;
            }
        }
    pkv_status st = nv < need ? PKV_ENOMEM
                              : pkvi_spill_write(cache->spill, cache->pool, pages, nv, need);
    for (uint64_t v = 0; v < nv; v++) {
        vic[v].pg->tally = 0;
        if (st == PKV_OK && !vic[v].pg->data) { /* written (a retry may write fewer) */
            if (vic[v].t)
                sync_holders(cache, vic[v].t, vic[v].layer, vic[v].index, vic[v].pg);
            else /* a cached page: no table names it */
                cache->prefix.cached.resident--;
        }
    }
    free(order);
    free(vic);
    free(pages);
    return st;
}

/* Bring the spilled pages of table t (layer) from entry `from` on back into memory;
 * the caller pinned t, so making room never spills them again. Under the lock. */
pkv_status pkvi_session_fault_in(const pkvi_geom *geo, pkvi_cache *cache, pkvi_btable *t,
                                 uint32_t layer, uint64_t from)
{
    const uint64_t n = pkvi_btable_spilled(t, from, NULL, NULL);
    if (n == 0)
        return PKV_OK;
    pkv_status st = make_room(geo, cache, n);
    if (st != PKV_OK)
        return st;
    uint64_t *idx = malloc((size_t)n * sizeof *idx);
    pkvi_page **pages = malloc((size_t)n * sizeof *pages);
    if (!idx || !pages) {
        free(idx);
        free(pages);
        return PKV_ENOMEM;
    }
    (void)pkvi_btable_spilled(t, from, idx, pages);
    st = pkvi_spill_read(cache->spill, cache->pool, pages, n);
    if (st == PKV_OK)
        for (uint64_t k = 0; k < n; k++)
            sync_holders(cache, t, layer, idx[k], pages[k]);
    free(idx);
    free(pages);
    return st;
}

/* n new pages, all or nothing, spilling to make room. Under the lock. */
pkv_status pkvi_session_take_pages(const pkvi_geom *geo, pkvi_cache *cache, uint64_t n,
                                   pkvi_page **out)
{
    pkv_status st = make_room(geo, cache, n);
    uint64_t got = 0;
    while (st == PKV_OK && got < n)
        if ((st = pkvi_page_create(cache->pool, &out[got])) == PKV_OK)
            got++;
    if (st != PKV_OK) {
        while (got-- > 0)
            pkvi_page_destroy(cache->pool, out[got]); /* nobody holds them yet */
        return st;
    }
#if !PKV_POISON
    /* A spilled page is written whole, unused rows included: start them defined, so
     * no stale bytes of an earlier page (another user's K/V) ever reach the disk. */
    if (cache->spill)
        for (uint64_t i = 0; i < n; i++)
            memset(out[i]->data, 0, (size_t)geo->page_bytes);
#endif
    return PKV_OK;
}

/* ---- residency ------------------------------------------------------------------------ */

pkv_status pkvi_session_acquire(pkv_session *s, uint32_t layer)
{
    pkvi_cache *cache = s->cache;
    if (!cache->spill)
        return PKV_OK;
    pkvi_btable *t = s->layers[layer];
    pthread_mutex_lock(&cache->lock);
    pkvi_btable_pin(t); /* first: making room must not spill what is being brought back */
    const pkv_status st =
        pkvi_btable_n_spilled(t) ? pkvi_session_fault_in(s->geom, cache, t, layer, 0) : PKV_OK;
    if (st != PKV_OK)
        pkvi_btable_unpin(t);
    else
        s->lru = ++cache->clock;
    pthread_mutex_unlock(&cache->lock);
    if (st != PKV_OK)
        return pkvi_fail(s->errs, st,
                         "layer %u: its spilled pages could not be brought back (%s)", layer,
                         st == PKV_EIO ? "a read failed" : "the budget has no room");
    return st;
}

void pkvi_session_release(pkv_session *s, uint32_t layer)
{
    pkvi_cache *cache = s->cache;
    if (!cache->spill)
        return;
    pthread_mutex_lock(&cache->lock);
    pkvi_btable_unpin(s->layers[layer]);
    pthread_mutex_unlock(&cache->lock);
}

/*
 * session/residency.c - which pages are in memory: the choice of spill victims (LRU
 * order, whole sessions at a time), making room under the budget, bringing a table's
 * spilled pages back (fault in), taking new pages all or nothing, and the pins that
 * keep the spiller away from a layer in use (pkvi_session_acquire / _release).
 *
 * Owns no state of its own but the transfers it has in flight: it works on the cache
 * state's pool, spill file and session list (cache/cache.h) under its lock. Calls down
 * into btable.c (the tables' residency walks, sync after a move), prefix.c (cached
 * pages go first), pool.c (pages, the budget) and spill.c (moving bytes); calls no
 * other session file. What a write takes from it is session/write.c's; creating,
 * forking and destroying sessions is session.c's.
 *
 * Spill victims: resident pages of the least recently used sessions first, whole
 * sessions at a time (a session is idle as a whole, and decode needs all of a layer's
 * pages back together, so spilling one session completely beats nibbling at many),
 * never a page of a pinned table. A page shared by forks is one descriptor: written
 * once, and only when no table holding it is pinned; every holder's entry is synced
 * (B2, B3). A holder is found where B4 says it can only be: the same (layer, index).
 *
 * No I/O under the engine lock. Every transfer (a batch of victims written out, or a
 * table's spilled pages read back) is three steps (spill.h draws the states):
 *
 *   lock held   choose the pages, take read buffers, mark each OUTGOING / INCOMING
 *               (every holder's entry now reads NULL: B2), register the transfer
 *   lock free   pkvi_spill_write / pkvi_spill_read
 *   lock held   end each page's transfer: a victim is spilled, or kept when the
 *               write failed or a holder pinned it meanwhile (if the batch frees its
 *               room without it); a read page arrives, or stays spilled when the read
 *               failed. Sync its holders, free the pages whose last holder left
 *               meanwhile (orphans), end the transfer (which wakes every waiter on
 *               cache->moved)
 *
 * So a failed transfer changes nothing, and the invariants hold at every point the
 * lock is free (cache.h). A call that needs a page of its own pinned table while that
 * page is in transit waits on cache->moved (a condition, not a spin): an OUTGOING page
 * is then kept (its commit saw the pin) or SPILLED, an INCOMING one has arrived or is
 * SPILLED again; a SPILLED one the waiter reads itself. Waiters wait only for
 * transfers, and a transfer never waits for anything but the spill file's own `io`
 * lock, so nothing deadlocks.
 */
#include "session/private.h"

#include <stdlib.h>
#include <string.h>

/* Spill at least this many pages per make_room: one batched write instead of many
 * single-page round trips when sessions grow page by page under a full budget
 * (docs/performance.md, decision table: SPILL_BATCH). */
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

/* pg (at layer, index i) moved or began or ended a transfer: sync every table that
 * holds it. */
static void sync_all(pkvi_cache *cache, uint32_t layer, uint64_t i, const pkvi_page *pg)
{
    for (pkv_session *s = cache->sessions; s; s = s->next)
        if (pkvi_btable_names(s->layers[layer], i, pg))
            pkvi_btable_sync(s->layers[layer], i);
}

/* The sessions alive at a commit, by address: a victim's session may have been
 * destroyed while its pages were written (its pages are then orphans, or held by a
 * fork), so its pointer is looked up, never followed, until found here. */
typedef struct {
    pkv_session **s;
    uint64_t n;
} roster;

static int by_addr(const void *a, const void *b)
{
    const uintptr_t x = (uintptr_t) * (pkv_session *const *)a,
                    y = (uintptr_t) * (pkv_session *const *)b;
    return x < y ? -1 : x > y;
}

/* False when out of memory: the commit then walks every session for every page. */
static bool roster_take(const pkvi_cache *cache, roster *r)
{
    r->n = 0;
    r->s = malloc((size_t)(cache->n_sessions ? cache->n_sessions : 1) * sizeof *r->s);
    if (!r->s)
        return false;
    for (pkv_session *s = cache->sessions; s; s = s->next)
        r->s[r->n++] = s;
    qsort(r->s, (size_t)r->n, sizeof *r->s, by_addr);
    return true;
}

/* ---- making room under the budget --------------------------------------------------- */

typedef struct {
    pkvi_page *pg;
    pkv_session *s;          /* a session holding it when chosen; NULL: a cached page */
    uint32_t layer;
    uint64_t index;
} located;

/* The one table holding v's page, when it is v's own (its session alive, still naming
 * the page at v's index, and no other holder); NULL otherwise: the caller then walks
 * every session (or, for a cached page, there is no table). */
static pkvi_btable *sole_holder(const roster *r, const located *v)
{
    if (!r || !v->s || pkvi_page_shared(v->pg) ||
        !bsearch(&v->s, r->s, (size_t)r->n, sizeof *r->s, by_addr))
        return NULL;
    pkvi_btable *t = v->s->layers[v->layer];
    return pkvi_btable_names(t, v->index, v->pg) ? t : NULL;
}

static int by_lru(const void *a, const void *b)
{
    const pkv_session *x = *(pkv_session *const *)a, *y = *(pkv_session *const *)b;
    return x->lru < y->lru ? -1 : x->lru > y->lru;
}

/* Resident cached pages (only the prefix index holds them), least recently used
 * nodes first: the first spill victims, before any live session's page
 * (docs/prefix-cache.md). Marks them in tally like choose does. */
static uint64_t cached_victims(const pkvi_geom *geo, pkvi_cache *cache, located *vic,
                               uint64_t want)
{
    uint64_t nv = 0;
    if (!cache->prefix.cached.resident)
        return 0;
    for (pkvi_pnode *n = cache->prefix.oldest; n && nv < want; n = n->newer)
        for (uint32_t l = 0; l < geo->cfg.n_layers && nv < want; l++) {
            pkvi_page *pg = n->pages[l];
            if (!pg || !pkvi_page_cached(pg) || !pg->data || pg->transit || pg->tally)
                continue;
            pg->tally = 1;
            vic[nv++] = (located){pg, NULL, l, n->depth};
        }
    return nv;
}

/* Up to `want` victims into vic (cached pages, then pages of unpinned tables, least
 * recently used sessions first; none in transit); order has room for every session.
 * Under the lock; leaves every tally 0. */
static uint64_t choose(const pkvi_geom *geo, pkvi_cache *cache, pkv_session **order,
                       uint64_t need, uint64_t want, located *vic)
{
    uint64_t ns = 0;
    for (pkv_session *s = cache->sessions; s; s = s->next)
        order[ns++] = s;
    qsort(order, (size_t)ns, sizeof *order, by_lru);
    /* `tally` marks a descriptor already chosen (a shared page is met once per holder) */
    uint64_t nv = cached_victims(geo, cache, vic, want);
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
                vic[nv++] = (located){pg, order[k], l, i};
            }
        }
    for (uint64_t v = 0; v < nv; v++)
        vic[v].pg->tally = 0;
    return nv;
}

/* Where a victim stands when its write has ended (under the lock). */
typedef struct {
    pkvi_btable *t;          /* its one holder, when sole_holder finds it */
    bool cached;             /* only the prefix index holds it */
    bool wanted;             /* a table holding it was pinned meanwhile */
    bool orphan;             /* nobody holds it any more */
} standing;

static standing stand(pkvi_cache *cache, const located *v, const roster *r)
{
    standing f = {.orphan = pkvi_page_orphan(v->pg)};
    if (f.orphan)
        return f;
    f.t = sole_holder(r, v);
    f.cached = !f.t && pkvi_page_cached(v->pg);
    f.wanted = f.t ? pkvi_btable_pinned(f.t)
                   : !f.cached && holder_pinned(cache, v->layer, v->index, v->pg);
    return f;
}

/* The end of v's write (under the lock): spilled, or kept (not written, or keep);
 * holders synced; an orphan freed. Returns whether it gave its buffer back. */
static bool end_out(pkvi_cache *cache, const located *v, const standing *f, bool written,
                    bool keep)
{
    pkvi_page *pg = v->pg;
    if (f->orphan) {
        pkvi_spill_end_out(cache->spill, cache->pool, pg, written, true);
        pkvi_page_destroy(cache->pool, pg);
        return true;
    }
    pkvi_spill_end_out(cache->spill, cache->pool, pg, written, keep);
    if (f->t)
        pkvi_btable_sync(f->t, v->index);
    else if (!f->cached)
        sync_all(cache, v->layer, v->index, pg);
    const bool spilled = pg->data == NULL;
    if (spilled && f->cached)
        cache->prefix.cached.resident--;
    return spilled;
}

/*
 * One batch of victims written out: at least `need` buffers given back unless the
 * write failed. A victim whose table was pinned while it was written (a call waits for
 * it) is kept while the others free enough; else it is spilled all the same and the
 * waiter reads it back, so a batch always makes the room it was for. *freed: the
 * buffers it gave back. PKV_OK; PKV_ENOMEM with *few when fewer than `need` pages
 * could be chosen (nothing is written then), or without it when out of memory;
 * PKV_EIO when the write failed (every page stays resident). Called and returns
 * under the lock; lets it go during the write.
 */
static pkv_status spill_batch(const pkvi_geom *geo, pkvi_cache *cache, uint64_t need,
                              bool *few, uint64_t *freed)
{
    const uint64_t want = need < SPILL_BATCH ? SPILL_BATCH : need;
    *few = false;
    *freed = 0;
    pkv_session **order =
        malloc((size_t)(cache->n_sessions ? cache->n_sessions : 1) * sizeof *order);
    located *vic = malloc((size_t)want * sizeof *vic);
    standing *fate = malloc((size_t)want * sizeof *fate);
    pkvi_page **pages = malloc((size_t)want * sizeof *pages);
    bool *written = malloc((size_t)want * sizeof *written);
    pkv_status st = PKV_ENOMEM;
    if (!order || !vic || !fate || !pages || !written)
        goto out;
    const uint64_t nv = choose(geo, cache, order, need, want, vic);
    if (nv < need) {
        *few = true;
        goto out;
    }
    /* 1. under the lock: every victim and its holders' entries in transit */
    for (uint64_t v = 0; v < nv; v++) {
        pkvi_page *pg = pages[v] = vic[v].pg;
        pkvi_spill_mark_out(pg);
        if (!vic[v].s) /* a cached page: no table names it */
            continue;
        if (pkvi_page_shared(pg))
            sync_all(cache, vic[v].layer, vic[v].index, pg);
        else
            pkvi_btable_sync(vic[v].s->layers[vic[v].layer], vic[v].index);
    }
    pkvi_transfer x = {.pages = pages, .n = nv, .incoming = false};
    pkvi_cache_transfer_begin(cache, &x);
    /* 2. the write, without the lock */
    pthread_mutex_unlock(&cache->lock);
    st = pkvi_spill_write(cache->spill, pages, nv, need, written);
    pthread_mutex_lock(&cache->lock);
    /* 3. under the lock: spill or keep each */
    roster r;
    const bool have_roster = roster_take(cache, &r);
    uint64_t sure = 0; /* buffers given back whatever the pins */
    for (uint64_t v = 0; v < nv; v++) {
        written[v] = st == PKV_OK && written[v];
        fate[v] = stand(cache, &vic[v], have_roster ? &r : NULL);
        sure += fate[v].orphan || (written[v] && !fate[v].wanted);
    }
    for (uint64_t v = 0; v < nv; v++) {
        bool keep = fate[v].wanted;
        if (keep && written[v] && sure < need) { /* the room comes first */
            keep = false;
            sure++;
        }
        *freed += end_out(cache, &vic[v], &fate[v], written[v], keep);
    }
    if (have_roster)
        free(r.s);
    pkvi_cache_transfer_end(cache, &x);
out:
    free(order);
    free(vic);
    free(fate);
    free(pages);
    free(written);
    return st;
}

/*
 * Room for n more resident pages: spill pages of unpinned tables, least recently used
 * sessions first (at least SPILL_BATCH pages when anything must go). PKV_OK when the
 * budget has room now (the lock is held from that check to the return); PKV_ENOMEM
 * when not enough can be spilled (the rest is pinned by calls in flight) or there is
 * no spill file; PKV_EIO when the write failed (every page stays resident). Under the
 * lock, which it lets go while a batch is written.
 */
static pkv_status make_room(const pkvi_geom *geo, pkvi_cache *cache, uint64_t n)
{
    for (;;) {
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
        bool few;
        uint64_t freed;
        const pkv_status st = spill_batch(geo, cache, need, &few, &freed);
        if (st == PKV_OK)
            continue; /* it freed `need`; another call may have taken room meanwhile */
        if (!few)
            return st;
        /* Too little to choose: what is not pinned is in other calls' transfers, which
         * give buffers back or settle pages when they end. Wait for one to end (the
         * calls moving pages make progress meanwhile); with none in flight, the budget
         * is held by pinned pages. */
        if (!cache->transfers)
            return PKV_ENOMEM;
        pthread_cond_wait(&cache->moved, &cache->lock);
    }
}

/* ---- fault in ------------------------------------------------------------------------- */

/* Read pages[0, m) (SPILLED pages of t, pinned, at idx[k]; the budget has room for m)
 * back in one batch. PKV_EIO (every page stays spilled), PKV_ENOMEM. Called and returns
 * under the lock; lets it go during the read. */
static pkv_status read_back(pkvi_cache *cache, pkvi_btable *t, uint32_t layer,
                            const uint64_t *idx, pkvi_page *const *pages, uint64_t m)
{
    void **bufs = malloc((size_t)m * sizeof *bufs);
    if (!bufs)
        return PKV_ENOMEM;
    pkv_status st = PKV_OK;
    uint64_t got = 0;
    for (; got < m && st == PKV_OK; got += st == PKV_OK)
        st = pkvi_pool_get(cache->pool, &bufs[got]);
    if (st != PKV_OK) {
        while (got-- > 0)
            pkvi_pool_put(cache->pool, bufs[got]);
        free(bufs);
        return st;
    }
    /* 1. under the lock: in transit (the entries already read NULL: spilled) */
    for (uint64_t k = 0; k < m; k++)
        pkvi_spill_mark_in(pages[k]);
    pkvi_transfer x = {.pages = pages, .n = m, .incoming = true};
    pkvi_cache_transfer_begin(cache, &x);
    cache->incoming += m;
    /* 2. the read, without the lock */
    pthread_mutex_unlock(&cache->lock);
    st = pkvi_spill_read(cache->spill, pages, bufs, m);
    pthread_mutex_lock(&cache->lock);
    /* 3. under the lock: arrived, or spilled as before. t is pinned and its owner is
     * in this call, so t still holds every page: none is an orphan. */
    cache->incoming -= m;
    for (uint64_t k = 0; k < m; k++) {
        pkvi_page *pg = pages[k];
        pkvi_spill_end_in(cache->spill, cache->pool, pg, bufs[k], st == PKV_OK);
        if (st != PKV_OK)
            continue;
        if (pkvi_page_cached(pg))
            cache->prefix.cached.resident++;
        if (pkvi_page_shared(pg))
            sync_all(cache, layer, idx[k], pg);
        else
            pkvi_btable_sync(t, idx[k]);
    }
    pkvi_cache_transfer_end(cache, &x);
    free(bufs);
    return st;
}

/* Bring the spilled pages of table t (layer) from entry `from` on back into memory;
 * the caller pinned t, so making room never spills them again. Pages of t that other
 * calls have in transit are waited for: one being written out is kept (t is pinned) or,
 * when its batch needed it, spilled and then read here; one being read back arrives
 * (or is read here if that failed). Under the lock, which it lets go while it reads,
 * spills or waits. */
pkv_status pkvi_session_fault_in(const pkvi_geom *geo, pkvi_cache *cache, pkvi_btable *t,
                                 uint32_t layer, uint64_t from)
{
    uint64_t *idx = NULL, cap = 0;
    pkvi_page **pages = NULL;
    pkv_status st = PKV_OK;
    for (;;) {
        const uint64_t n = pkvi_btable_spilled(t, from, NULL, NULL);
        if (n == 0)
            break;
        if (n > cap) {
            free(idx);
            free(pages);
            idx = malloc((size_t)n * sizeof *idx);
            pages = malloc((size_t)n * sizeof *pages);
            cap = n;
            if (!idx || !pages) {
                st = PKV_ENOMEM;
                break;
            }
        }
        (void)pkvi_btable_spilled(t, from, idx, pages);
        uint64_t m = 0; /* the settled ones, SPILLED: this call reads them */
        for (uint64_t k = 0; k < n; k++)
            if (pages[k]->transit == PKVI_SETTLED) {
                idx[m] = idx[k];
                pages[m++] = pages[k];
            }
        if (m == 0) { /* all in other calls' transfers */
            pthread_cond_wait(&cache->moved, &cache->lock);
            continue;
        }
        uint64_t need;
        if (!pkvi_pool_room(cache->pool, m, &need) || need > 0) {
            if ((st = make_room(geo, cache, m)) != PKV_OK)
                break;
            continue; /* the lock was let go: look again */
        }
        if ((st = read_back(cache, t, layer, idx, pages, m)) != PKV_OK)
            break;
    }
    free(idx);
    free(pages);
    return st;
}

/* n new pages, all or nothing, spilling to make room. Under the lock, which making
 * room may let go; from the room's check to the return it is held. */
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

pkv_status pkvi_session_acquire(pkv_session *s, uint32_t layer, const char *call)
{
    return pkvi_session_acquire_from(s, layer, 0, call);
}

pkv_status pkvi_session_acquire_from(pkv_session *s, uint32_t layer, uint64_t from,
                                     const char *call)
{
    pkvi_cache *cache = s->cache;
    if (!cache->spill)
        return PKV_OK;
    pkvi_btable *t = s->layers[layer];
    pthread_mutex_lock(&cache->lock);
    pkvi_btable_pin(t); /* first: making room must not spill what is being brought back */
    const pkv_status st = pkvi_btable_n_spilled(t)
                              ? pkvi_session_fault_in(s->geom, cache, t, layer, from)
                              : PKV_OK;
    if (st != PKV_OK)
        pkvi_btable_unpin(t);
    else
        s->lru = ++cache->clock;
    pthread_mutex_unlock(&cache->lock);
    if (st != PKV_OK)
        return pkvi_fail(s->errs, st,
                         "%s: layer %u: its spilled pages could not be brought back (%s)",
                         call, layer, st == PKV_EIO ? "a read failed" : "the budget has no room");
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

/*
 * cache.c - the state an engine's sessions share (cache.h): creating and freeing the
 * pool, the spill file and the prefix index behind the engine lock, the registry of
 * spill transfers in flight, and the statistics read from them.
 *
 * Owns their lifetime, not their contents: pages are the pool's and btable.c's,
 * sessions session.c's, what a transfer moves and when session/residency.c's. Knows
 * nothing of the geometry beyond the page size.
 */
#include "cache/cache.h"

#include <string.h>

pkv_status pkvi_cache_init(pkvi_cache *c, const pkv_config *cfg, uint64_t page_bytes)
{
    memset(c, 0, sizeof *c);
    pkvi_prefix_init(&c->prefix, cfg->n_layers, cfg->block_tokens,
                     cfg->prefix_cache_bytes / page_bytes);
    pkv_status st = pkvi_pool_create(page_bytes, cfg->mem_budget, &c->pool);
    if (st == PKV_OK && cfg->spill_dir)
        st = pkvi_spill_open(cfg->spill_dir, page_bytes, &c->spill);
    if (st != PKV_OK) {
        pkvi_pool_destroy(c->pool);
        c->pool = NULL;
        return st;
    }
    /* The engine lock is held for a few microseconds at a time (a transfer's
     * bookkeeping, a decode's pins): a waiter spins a little before it sleeps, where
     * glibc offers that, instead of paying a futex sleep and wake-up for every
     * collision (docs/performance.md, decision table: engine_lock) */
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
#ifdef PTHREAD_ADAPTIVE_MUTEX_INITIALIZER_NP
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
#endif
    pthread_mutex_init(&c->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    pthread_mutex_init(&c->file_io_lock, NULL);
    pthread_cond_init(&c->moved, NULL);
    return PKV_OK;
}

void pkvi_cache_fini(pkvi_cache *c)
{
    pkvi_prefix_fini(&c->prefix, pkvi_cache_pages(c));
    pkvi_spill_close(c->spill);
    pkvi_pool_destroy(c->pool);
    pkvi_io_close(c->file_io);
    pthread_cond_destroy(&c->moved);
    pthread_mutex_destroy(&c->lock);
    pthread_mutex_destroy(&c->file_io_lock);
}

pkv_status pkvi_cache_file_io(pkvi_cache *c, pkvi_io **out)
{
    pkv_status st = PKV_OK;
    pthread_mutex_lock(&c->file_io_lock);
    if (!c->file_io)
        st = pkvi_io_open(false, &c->file_io);
    *out = c->file_io;
    pthread_mutex_unlock(&c->file_io_lock);
    return st;
}

/* ---- transfers in flight ------------------------------------------------------------ */

void pkvi_cache_transfer_begin(pkvi_cache *c, pkvi_transfer *x)
{
    x->prev = NULL;
    x->next = c->transfers;
    if (c->transfers)
        c->transfers->prev = x;
    c->transfers = x;
}

void pkvi_cache_transfer_end(pkvi_cache *c, pkvi_transfer *x)
{
    if (x->prev)
        x->prev->next = x->next;
    else
        c->transfers = x->next;
    if (x->next)
        x->next->prev = x->prev;
    pthread_cond_broadcast(&c->moved);
}

pkvi_transit_census pkvi_cache_transit_census(const pkvi_cache *c)
{
    pkvi_transit_census t = {.ok = true};
    for (const pkvi_transfer *x = c->transfers; x; x = x->next) {
        const uint32_t state = x->incoming ? PKVI_INCOMING : PKVI_OUTGOING;
        if (x->incoming)
            t.buffers += x->n;
        for (uint64_t k = 0; k < x->n; k++) {
            const pkvi_page *pg = x->pages[k];
            /* an OUTGOING page keeps its bytes until it ends, an INCOMING one gets them
             * when it ends */
            t.ok &= pg->transit == state && (pg->data != NULL) == !x->incoming;
            if (!pkvi_page_orphan(pg))
                t.named++;
            else if (x->incoming)
                t.orphans_spilled++;
            else
                t.orphans_resident++;
        }
    }
    t.ok &= t.buffers == c->incoming;
    return t;
}

void pkvi_cache_stats(pkvi_cache *c, pkv_stats *out)
{
    /* The lock that appends and (with spill) decodes need is held only to copy the
     * counters: a consistent snapshot of them. jemalloc's statistics (an epoch
     * refresh) are read after it, from the arena that is this engine's for its whole
     * life; jemalloc serialises those calls itself. Under the lock the refresh starved
     * a decoding thread (docs/performance.md, decision table: stats-lock). */
    pthread_mutex_lock(&c->lock);
    out->io_backend = c->spill ? pkvi_spill_backend(c->spill) : "none"; /* may fall back */
    const pkvi_pool_counts n = pkvi_pool_count(c->pool);
    /* cached pages (docs/prefix-cache.md) are resident pages only the prefix index
     * holds: in the pool's in_use, not in pages_in_use; spilled ones are in
     * pages_spilled */
    out->pages_in_use = n.in_use - c->prefix.cached.resident - c->incoming;
    out->pages_cached = c->prefix.cached.resident;
    out->pages_free = n.n_free;
    out->pages_spilled = n.spilled;
    out->prefix_lookups = c->prefix.lookups;
    out->prefix_hit_tokens = c->prefix.hit_tokens;
    pthread_mutex_unlock(&c->lock);
    out->pool = pkvi_pool_kind(c->pool);
    out->bytes_allocator = pkvi_pool_allocator_bytes(c->pool, n.allocated);
}

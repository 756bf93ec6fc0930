/*
 * cache.h - the state an engine's sessions share, under the engine lock (cache.c):
 * the lock itself, the page pool, the spill file, the prefix index and the list of
 * live sessions with the LRU clock the spiller follows.
 *
 * Owns the lock and the lifetime of what it guards: cache.c creates and frees the
 * pool, the spill file and the index; session.c links sessions into the list. The
 * geometry (geom.h) is a separate, immutable context: nothing here needs it.
 *
 * Locking: `lock` (a plain mutex) guards everything in this struct, every page
 * descriptor's refs / data / slot, and every block table's structure (entries,
 * counts, pins). A session's owner thread reads its own tables without it: only the
 * owner changes them (under the lock), and the spiller moves pages only of tables
 * with no pin. Without a spill file pages never move, so decode takes no lock at all.
 *
 * Invariants (pkvi_sessions_check, session/account.c):
 *   E1  pool in_use   == distinct resident pages named by a table or the index
 *   E2  pool spilled  == distinct spilled pages named by a table or the index
 *   E3  for every page P: table entries naming P + P->indexed == P->refs
 *   E4  the pool's own (pkvi_pool_check): allocated == in_use + n_free, the budget
 *   and B1-B5 of btable.h for every table, P1-P4 of prefix.h for the index.
 */
#ifndef PAGEDKV_CACHE_H
#define PAGEDKV_CACHE_H

#include "cache/prefix.h"

#include <pthread.h>

typedef struct {
    pthread_mutex_t lock;        /* see the file comment */
    pkvi_pool *pool;             /* lock */
    pkvi_spill *spill;           /* NULL without spill_dir; lock */
    pkvi_prefix prefix;          /* the prefix cache's index (docs/prefix-cache.md); lock */
    pkv_session *sessions;       /* doubly linked list of live sessions (session.c); lock */
    uint64_t n_sessions;         /* lock */
    uint64_t clock;              /* LRU clock: a session's lru is its last use; lock */
} pkvi_cache;

/* The state of an engine of cfg (resolved) and pages of page_bytes: an empty pool
 * under cfg->mem_budget, the spill file in cfg->spill_dir (when set), an empty index
 * of cfg->prefix_cache_bytes. PKV_ENOMEM, PKV_EIO (the spill file); then nothing is
 * left to free. */
PKVI_HIDDEN pkv_status pkvi_cache_init(pkvi_cache *c, const pkv_config *cfg,
                                       uint64_t page_bytes);
/* Free it all; every session is gone already. */
PKVI_HIDDEN void pkvi_cache_fini(pkvi_cache *c);

/* Where released pages go (btable.h). */
static inline pkvi_pages pkvi_cache_pages(pkvi_cache *c)
{
    return (pkvi_pages){c->pool, c->spill, &c->prefix.cached};
}

/* pkv_engine_stats' figures of this state: pages in use, cached, free and spilled,
 * the prefix cache's counters, the I/O backend and the pool's kind; takes the lock
 * only to copy the counters, and reads the allocator's own statistics after it. */
PKVI_HIDDEN void pkvi_cache_stats(pkvi_cache *c, pkv_stats *out);

#endif /* PAGEDKV_CACHE_H */

/*
 * cache.h - the state an engine's sessions share, under the engine lock (cache.c):
 * the lock itself, the page pool, the spill file, the prefix index, the list of live
 * sessions with the LRU clock the spiller follows, and the spill transfers in flight;
 * and, beside them under a lock of its own, the I/O object of the session files.
 *
 * Owns the lock, the condition `moved` that goes with it, and the lifetime of what it
 * guards: cache.c creates and frees the pool, the spill file and the index; session.c
 * links sessions into the list; session/residency.c registers its transfers here. The
 * geometry (geom.h) is a separate, immutable context: nothing here needs it.
 *
 * Locking: `lock` (a plain mutex) guards everything in this struct, every page
 * descriptor's refs / data / slot / transit, and every block table's structure
 * (entries, counts, pins). A session's owner thread reads its own tables without it:
 * only the owner changes them (under the lock), and the spiller moves pages only of
 * tables with no pin. Without a spill file pages never move, so decode takes no lock
 * at all. No I/O runs under it: a spill transfer marks its pages in transit, lets the
 * lock go for the I/O and takes it again to commit (session/residency.c; the states
 * are spill.h's). A call that needs a page in transit waits on `moved`, which every
 * transfer broadcasts when it ends; so every invariant below holds whenever the lock
 * is free, transfers in flight included.
 *
 * Invariants (pkvi_sessions_check, session/account.c; "named" = by a table or the
 * index, "orphans" = pages in transit whose last holder left, freed when it ends):
 *   E1  pool in_use   == distinct named pages with data != NULL (RESIDENT, OUTGOING)
 *                        + buffers of INCOMING pages (`incoming`) + OUTGOING orphans
 *   E2  pool spilled  == distinct named pages with data == NULL (SPILLED, INCOMING)
 *                        + INCOMING orphans
 *   E3  for every page P: table entries naming P + P->indexed == P->refs
 *   E4  the pool's own (pkvi_pool_check): allocated == in_use + n_free, the budget
 *   T1  the pages in transit are exactly those of the registered transfers, each in
 *       its transfer's direction
 *   and B1-B6 of btable.h for every table, P1-P4 of prefix.h for the index.
 */
#ifndef PAGEDKV_CACHE_H
#define PAGEDKV_CACHE_H

#include "cache/prefix.h"

#include <pthread.h>

/* A spill transfer in flight (session/residency.c makes one per batch, on its
 * stack): its pages are OUTGOING or INCOMING until it ends. */
typedef struct pkvi_transfer {
    struct pkvi_transfer *prev, *next; /* the cache state's list; lock */
    pkvi_page *const *pages;           /* [n] */
    uint64_t n;
    bool incoming;                     /* read back (else written out) */
} pkvi_transfer;

typedef struct {
    pthread_mutex_t lock;        /* see the file comment */
    pthread_cond_t moved;        /* broadcast when a transfer ends; waited on with lock */
    pkvi_pool *pool;             /* lock */
    pkvi_spill *spill;           /* NULL without spill_dir; lock */
    pkvi_prefix prefix;          /* the prefix cache's index (docs/prefix-cache.md); lock */
    pkv_session *sessions;       /* doubly linked list of live sessions (session.c); lock */
    uint64_t n_sessions;         /* lock */
    uint64_t clock;              /* LRU clock: a session's lru is its last use; lock */
    pkvi_transfer *transfers;    /* in flight, newest first; lock */
    uint64_t incoming;           /* buffers taken for INCOMING pages: in the pool's
                                    in_use, in no descriptor yet; lock */
    pthread_mutex_t file_io_lock;/* guards file_io's creation alone: not `lock`, which
                                    a save takes to pin pages while it holds file_io */
    pkvi_io *file_io;            /* session files' I/O (save, load): one ring for all
                                    of the engine's sessions (io.c serializes its use),
                                    created on first use; file_io_lock */
} pkvi_cache;

/* The state of an engine of cfg (resolved) and pages of page_bytes: an empty pool
 * under cfg->mem_budget, the spill file in cfg->spill_dir (when set), an empty index
 * of cfg->prefix_cache_bytes. PKV_ENOMEM, PKV_EIO (the spill file); then nothing is
 * left to free. */
PKVI_HIDDEN pkv_status pkvi_cache_init(pkvi_cache *c, const pkv_config *cfg,
                                       uint64_t page_bytes);
/* Free it all; every session is gone already, and with it every transfer. */
PKVI_HIDDEN void pkvi_cache_fini(pkvi_cache *c);

/* The I/O object of the engine's session files, created on first use (io_uring unless
 * PKV_NO_URING=1 or the kernel refuses it, read then): one ring per engine, not one
 * per call (liburing maps rings with raw system calls, which ThreadSanitizer cannot
 * follow across threads). PKV_ENOMEM. Thread-safe. */
PKVI_HIDDEN pkv_status pkvi_cache_file_io(pkvi_cache *c, pkvi_io **out);

/* Where released pages go (btable.h). */
static inline pkvi_pages pkvi_cache_pages(pkvi_cache *c)
{
    return (pkvi_pages){c->pool, c->spill, &c->prefix.cached};
}

/* ---- transfers in flight (session/residency.c; under the lock) ---------------------- */

/* x (pages already marked, and for a read their buffers counted in `incoming`) is in
 * flight from now on. */
PKVI_HIDDEN void pkvi_cache_transfer_begin(pkvi_cache *c, pkvi_transfer *x);
/* x ended (its pages settled, orphans freed): off the list, and every waiter on
 * `moved` wakes. */
PKVI_HIDDEN void pkvi_cache_transfer_end(pkvi_cache *c, pkvi_transfer *x);

/* E1, E2 and T1's terms of the transfers in flight (session/account.c adds them to
 * the census of the named pages). */
typedef struct {
    uint64_t buffers;            /* INCOMING pages' buffers (== `incoming`) */
    uint64_t orphans_resident;   /* OUTGOING orphans: their buffers */
    uint64_t orphans_spilled;    /* INCOMING orphans: their slots */
    uint64_t named;              /* pages in transit that are not orphans */
    bool ok;                     /* each page in its transfer's state; buffers exact */
} pkvi_transit_census;
PKVI_HIDDEN pkvi_transit_census pkvi_cache_transit_census(const pkvi_cache *c);

/* pkv_engine_stats' figures of this state: pages in use, cached, free and spilled,
 * the prefix cache's counters, the I/O backend and the pool's kind; takes the lock
 * only to copy the counters (never held across I/O, so it never waits for a
 * transfer), and reads the allocator's own statistics after it. A page being read
 * back counts as spilled until it arrived; its buffer is in none of the figures. */
PKVI_HIDDEN void pkvi_cache_stats(pkvi_cache *c, pkv_stats *out);

#endif /* PAGEDKV_CACHE_H */

/*
 * pool.h - the page pool (pool.c): fixed-size, aligned page buffers from a private
 * arena of the jemalloc found at run time (or aligned_alloc), a small cache of free
 * buffers, the memory budget, and the page descriptors that name those buffers.
 *
 * Owns page buffers, their counts and the descriptors' creation and destruction.
 * Does not own who holds a page (btable.c counts references) or where a spilled
 * page's bytes are (spill.c). Every function runs under the engine lock.
 *
 * A page's life (descriptor fields; every transition under the engine lock):
 *
 *    pkvi_page_create        spill write (spill.c)
 *   ------------------> RESIDENT ------------------> SPILLED
 *      refs = 1        data != NULL <------------------ data == NULL, slot
 *                           |          spill read        |
 *            last unref     v                            v   last unref
 *                    pkvi_page_destroy          pkvi_spill_drop + pkvi_page_destroy
 */
#ifndef PAGEDKV_POOL_H
#define PAGEDKV_POOL_H

#include "base/util.h"

#include <stdatomic.h>

/* Largest page the engine accepts (bytes). */
#define PKVI_MAX_PAGE_BYTES (1ull << 30)

/* A page descriptor. The page's bytes live at `data` while resident; while spilled,
 * data == NULL and the bytes are at slot `slot` of the spill file. */
typedef struct pkvi_page {
    void *data;            /* page_bytes, aligned; NULL when spilled */
    uint64_t slot;         /* spill-file slot while spilled */
    uint32_t refs;         /* block-table entries (over all sessions) naming this page */
    uint32_t tally;        /* scratch of the invariant check and the spiller; 0 between */
    uint32_t indexed;      /* 1 while the prefix index (prefix.c) holds one of the refs */
    atomic_uint writing;   /* 1 while a reservation may write rows into it (set under
                              the lock, cleared by the writer); then refs == 1 (B4) */
} pkvi_page;

typedef struct {
    bool use_jemalloc;     /* false: aligned_alloc (-Djemalloc=disabled, or no jemalloc
                              found at run time: pool.c, "jemalloc, found at run time") */
    unsigned arena;        /* jemalloc arena index (when use_jemalloc) */
    uint64_t page_bytes;
    uint64_t budget_pages; /* 0 = unlimited */
    uint64_t in_use;       /* resident pages held by descriptors */
    uint64_t spilled;      /* descriptors whose bytes are in the spill file */
    void **free_list;      /* cached free page buffers, [free_slots], grown on demand */
    uint64_t n_free, free_slots, free_cap;
    uint64_t allocated;    /* page buffers obtained from the allocator and not returned */
} pkvi_pool;

PKVI_HIDDEN pkv_status pkvi_pool_init(pkvi_pool *p, uint64_t page_bytes,
                                      uint64_t budget_bytes);
PKVI_HIDDEN void pkvi_pool_fini(pkvi_pool *p);
/* One page buffer; PKV_ENOMEM past the budget or when the allocator fails.
 * Caller holds e->lock. Counts the page in in_use. */
PKVI_HIDDEN pkv_status pkvi_pool_get(pkvi_pool *p, void **out);
/* Return a page buffer (uncounts it from in_use). Caller holds e->lock. */
PKVI_HIDDEN void pkvi_pool_put(pkvi_pool *p, void *buf);
/* Whether one more page fits the budget right now (free-list reuse always fits). */
PKVI_HIDDEN bool pkvi_pool_can_get(const pkvi_pool *p);
/* Bytes jemalloc reports for the arena (stats.arenas.<i>.small/large allocated);
 * without jemalloc: `allocated` (the caller's copy of p->allocated, taken under
 * e->lock) * page_bytes. Call it without e->lock: it reads only fields fixed for the
 * pool's life, and jemalloc's epoch refresh is slow (~25 us). */
PKVI_HIDDEN uint64_t pkvi_pool_allocator_bytes(const pkvi_pool *p, uint64_t allocated);

/* A new resident descriptor with refs = 1 and a buffer from the pool (counted in
 * in_use). PKV_ENOMEM past the budget or when the allocator fails; nothing taken. */
PKVI_HIDDEN pkv_status pkvi_page_create(pkvi_pool *p, pkvi_page **out);
/* Free a descriptor nobody holds (refs == 0): its buffer goes back to the pool. A
 * spilled page's slot must have been dropped first (pkvi_spill_drop). */
PKVI_HIDDEN void pkvi_page_destroy(pkvi_pool *p, pkvi_page *pg);

#endif /* PAGEDKV_POOL_H */

/*
 * pool.h - the page pool (pool.c): fixed-size, aligned page buffers from a private
 * arena of the jemalloc found at run time (or aligned_alloc), a small cache of free
 * buffers, the memory budget, and the page descriptors that name those buffers.
 *
 * Owns page buffers, their counts and the descriptors' creation and destruction. The
 * pool is opaque: only pool.c touches its fields, everyone else reads its counters
 * through the functions below. Does not own who holds a page (btable.c counts
 * references) or where a spilled page's bytes are (spill.c).
 *
 * Lock: every function runs under the engine lock (cache/cache.h), but create and
 * destroy (no other thread knows the pool yet, or any more) and
 * pkvi_pool_allocator_bytes (see there).
 *
 * Invariants (pkvi_pool_check):
 *   allocated == in_use + n_free          (every buffer is held or cached)
 *   budget_pages == 0 || in_use + n_free <= budget_pages
 *   spilled == descriptors whose bytes are in the spill file
 *
 * A page's life: pkvi_page_create makes a RESIDENT descriptor (refs = 0: btable.c's
 * push takes the first reference) and pkvi_page_destroy frees one; in between it may
 * be spilled and read back, through the states of spill.h (RESIDENT, OUTGOING,
 * SPILLED, INCOMING; the diagram and the function of each transition are there).
 */
#ifndef PAGEDKV_POOL_H
#define PAGEDKV_POOL_H

#include "base/util.h"

#include <stdatomic.h>

/* Largest page the engine accepts (bytes). */
#define PKVI_MAX_PAGE_BYTES (1ull << 30)

/* Where a page's bytes are going (pkvi_page.transit; spill.h draws the states). */
enum { PKVI_SETTLED = 0, PKVI_OUTGOING, PKVI_INCOMING };

/* A page descriptor. The page's bytes live at `data` while resident; while spilled,
 * data == NULL and the bytes are at slot `slot` of the spill file. refs and indexed
 * are btable.c's alone (the only code that counts holders). */
typedef struct pkvi_page {
    void *data;            /* page_bytes, aligned; NULL when spilled (pool.c, spill.c) */
    uint64_t slot;         /* spill-file slot while spilled or in transit (spill.c) */
    uint32_t transit;      /* PKVI_SETTLED, or a transfer of its bytes is in flight
                              outside the engine lock (spill.h; set and cleared under
                              it by spill.c) */
    uint32_t refs;         /* holders: table entries naming it, plus the prefix index's
                              one while indexed (btable.c) */
    uint32_t tally;        /* scratch of the invariant check and the spiller; 0 between */
    uint32_t indexed;      /* 1 while the prefix index holds one of the refs (btable.c) */
    atomic_uint writing;   /* 1 while a reservation may write rows into it (set under
                              the lock, cleared by the writer); then refs == 1 (B5) */
} pkvi_page;

typedef struct pkvi_pool pkvi_pool;

/* A pool of page_bytes pages holding at most budget_bytes (0: unlimited; else at least
 * one page). PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_pool_create(uint64_t page_bytes, uint64_t budget_bytes,
                                        pkvi_pool **out);
/* Free a pool whose every page buffer came back (NULL: no-op). */
PKVI_HIDDEN void pkvi_pool_destroy(pkvi_pool *p);

/* One page buffer; PKV_ENOMEM past the budget or when the allocator fails. Counts the
 * page in in_use. */
PKVI_HIDDEN pkv_status pkvi_pool_get(pkvi_pool *p, void **out);
/* Return a page buffer (uncounts it from in_use). */
PKVI_HIDDEN void pkvi_pool_put(pkvi_pool *p, void *buf);
/* The same for the buffer of a page whose bytes went to the spill file: it now counts
 * in spilled instead. */
PKVI_HIDDEN void pkvi_pool_put_spilled(pkvi_pool *p, void *buf);
/* A spilled descriptor is resident again (its new buffer came from pkvi_pool_get) or
 * is gone: one fewer in spilled. */
PKVI_HIDDEN void pkvi_pool_unspilled(pkvi_pool *p);

/* Before n more pages fit the budget, *need pages must leave memory (0: they fit, or
 * there is no budget). False when n alone exceeds the whole budget. */
PKVI_HIDDEN bool pkvi_pool_room(const pkvi_pool *p, uint64_t n, uint64_t *need);
PKVI_HIDDEN uint64_t pkvi_pool_page_bytes(const pkvi_pool *p);

/* The counters, as one snapshot (under the engine lock). */
typedef struct {
    uint64_t in_use;       /* resident pages held by descriptors */
    uint64_t n_free;       /* free buffers cached for reuse */
    uint64_t spilled;      /* descriptors whose bytes are in the spill file */
    uint64_t allocated;    /* buffers obtained from the allocator and not returned */
    uint64_t budget_pages; /* 0 = unlimited */
} pkvi_pool_counts;
PKVI_HIDDEN pkvi_pool_counts pkvi_pool_count(const pkvi_pool *p);
/* "jemalloc" or "aligned": what the buffers come from (fixed for the pool's life). */
PKVI_HIDDEN const char *pkvi_pool_kind(const pkvi_pool *p);
/* The invariants above; true when they hold. */
PKVI_HIDDEN bool pkvi_pool_check(const pkvi_pool *p);
/* Bytes jemalloc reports for the arena (stats.arenas.<i>.small/large allocated);
 * without jemalloc: `allocated` (the caller's copy of the counter, taken under the
 * engine lock) * page_bytes. Call it without the engine lock: it reads only fields
 * fixed for the pool's life, and jemalloc's epoch refresh is slow
 * (docs/performance.md, decision table: stats-lock). */
PKVI_HIDDEN uint64_t pkvi_pool_allocator_bytes(const pkvi_pool *p, uint64_t allocated);

/* A new resident descriptor nobody holds yet (refs = 0: btable.c's push takes the
 * first reference) with a buffer from the pool (counted in in_use). PKV_ENOMEM past
 * the budget or when the allocator fails; nothing taken. */
PKVI_HIDDEN pkv_status pkvi_page_create(pkvi_pool *p, pkvi_page **out);
/* Free a descriptor nobody holds (refs == 0): its buffer goes back to the pool. A
 * spilled page's slot must have been dropped first (pkvi_spill_drop). */
PKVI_HIDDEN void pkvi_page_destroy(pkvi_pool *p, pkvi_page *pg);

/* Test hook: the nth (1-based) next allocation of `kind` fails as if the system were
 * out of memory (0 disarms). Per pool, never global. */
typedef enum {
    PKVI_POOL_FAULT_BUFFER = 0, /* a page buffer from the allocator */
    PKVI_POOL_FAULT_SLOTS,      /* growing the free cache's slot array */
    PKVI_POOL_FAULT_DESCRIPTOR, /* a page descriptor */
} pkvi_pool_fault;
PKVI_HIDDEN void pkvi_pool_inject_fault(pkvi_pool *p, pkvi_pool_fault kind, uint64_t nth);

#endif /* PAGEDKV_POOL_H */

/*
 * btable.h - a layer's block table (btable.c): which page holds which positions of
 * one layer of one session, and the references those entries hold.
 *
 * Owns the table's arrays and the reference counts of the pages it names. It is the
 * only code that adds or drops a page reference. Does not choose pages
 * (session/write.c reserves them through session/residency.c), move their bytes
 * (spill.c) or read them (decode.c reads data[] through pkvi_btable_data while the
 * table is pinned).
 *
 *      pages[0]      pages[1]            pages[n_pages-1]
 *    +-----------+ +-----------+       +-----------+
 *    | 0 .. bt-1 | | bt..2bt-1 |  ...  | .. len-1  |░░░|   last page partly filled
 *    +-----------+ +-----------+       +-----------+
 *    position p lives in pages[p / bt], row p % bt.
 *
 * A windowed layer (SPEC §8) releases pages nothing will read again: entries
 * [hole_lo, hole_hi) are then NULL (hole_lo = the layer's sink pages), and positions
 * keep their indices, so position p still lives in pages[p / bt].
 *
 * A shard (SPEC §11) that starts at position `first` (a multiple of bt) holds no
 * page below it: entries [0, first / bt) are a hole from the start, len counts from
 * 0 (absolute positions), and a window's release later extends that same hole.
 *
 * Invariants (pkvi_btable_check; B1 between calls, the rest always, under the lock):
 *   B1  n_pages == ceil(len / bt)            (a reservation may push pages ahead of
 *                                             the rows it writes: then n_pages > that)
 *   B2  data[i] == pages[i]->data for i < n_pages      (NULL while spilled); pages[i]
 *       == NULL exactly for hole_lo <= i < hole_hi
 *   B3  n_spilled == #{ i < n_pages : pages[i] && pages[i]->data == NULL }
 *   B4  a page sits at the same index i in every table that holds it (sharing is
 *       index-preserving: fork and the prefix cache)
 *   B5  a page with refs > 1 is never written; a page gains a holder only through
 *       pkvi_btable_share, pkvi_page_index or pkvi_btable_push_shared, never while a
 *       writer may hold it (writing == 0)
 * The engine-wide count (sum over tables of entries naming P == P->refs) is checked
 * by session/account.c, which sees every table.
 */
#ifndef PAGEDKV_BTABLE_H
#define PAGEDKV_BTABLE_H

#include "store/pool.h"
#include "store/spill.h"

typedef struct {
    uint64_t len;            /* cached positions */
    uint64_t n_pages;        /* entries in use (B1) */
    uint64_t cap;            /* capacity of pages[] and data[] */
    pkvi_page **pages;       /* [cap] descriptors, one reference each */
    const void **data;       /* [cap] pages[i]->data (B2): what decode walks */
    uint64_t n_spilled;      /* entries whose page is in the spill file (B3) */
    uint64_t hole_lo, hole_hi; /* released entries [hole_lo, hole_hi); empty: equal */
    uint64_t first;          /* a shard's first position (pkv_session_set_first): its
                                first first / bt entries are a hole; 0 otherwise */
    uint32_t pins;           /* calls reading or writing this table's pages right now
                                (spill engines only): the spiller leaves them alone */
} pkvi_btable;

/* Indexed pages (pkvi_page.indexed) whose only reference is the prefix index's:
 * pages kept only for reuse (prefix.h). Kept exact by every reference change here. */
typedef struct {
    uint64_t pages;          /* all of them */
    uint64_t resident;       /* those in memory (the rest are in the spill file) */
} pkvi_cached;

/* Where a released page goes: the pool, and the spill file for a spilled one; and
 * the count of cached pages a dropped reference may add to. */
typedef struct {
    pkvi_pool *pool;
    pkvi_spill *spill;       /* NULL without a spill file */
    pkvi_cached *cached;
} pkvi_pages;

/* Capacity for n entries; on failure the table is unchanged. */
PKVI_HIDDEN pkv_status pkvi_btable_reserve(pkvi_btable *t, uint64_t n);
/* Append pg (whose reference the table takes over) as entry n_pages; capacity must
 * have been reserved. */
PKVI_HIDDEN void pkvi_btable_push(pkvi_btable *t, pkvi_page *pg);
/* Entry i now names pg (its reference taken over); the old page's reference is
 * dropped. Copy-on-write uses it. */
PKVI_HIDDEN void pkvi_btable_replace(pkvi_btable *t, pkvi_pages ps, uint64_t i,
                                     pkvi_page *pg);
/* Keep positions [0, n): entries past ceil(n / bt) are dropped. */
PKVI_HIDDEN void pkvi_btable_truncate(pkvi_btable *t, pkvi_pages ps, uint64_t bt,
                                      uint64_t n);
/* Release entries [max(hole_hi, keep_lo), keep_hi) (a windowed layer's pages that
 * nothing reads again; keep_lo = its sink pages): the hole grows to end at keep_hi. */
PKVI_HIDDEN void pkvi_btable_release(pkvi_btable *t, pkvi_pages ps, uint64_t keep_lo,
                                     uint64_t keep_hi);
/* Make an empty table a shard whose first position is `first` (a multiple of bt):
 * entries [0, first / bt) become the hole, len = first. PKV_ENOMEM (unchanged). */
PKVI_HIDDEN pkv_status pkvi_btable_set_first(pkvi_btable *t, uint64_t bt, uint64_t first);
/* Entries that name a page: n_pages less the hole. */
static inline uint64_t pkvi_btable_held(const pkvi_btable *t)
{
    return t->n_pages - (t->hole_hi - t->hole_lo);
}
/* dst (empty, capacity reserved) names every page of src: one more reference each. */
PKVI_HIDDEN void pkvi_btable_share(pkvi_btable *dst, const pkvi_btable *src);
/* The prefix cache's references (SPEC §10). An index entry is one more holder of a
 * full page, counted in refs like a table entry (E3 counts it through `indexed`).
 * pkvi_page_index: the index takes a reference on pg, a full page some table holds
 * (refs >= 1, not being written: B5). pkvi_page_unindex: it drops it (the page is
 * freed when that was the last). pkvi_btable_push_shared: entry n_pages (capacity
 * reserved) names pg, an indexed page, with one more reference (from_prefix shares
 * as a fork does); pg NULL extends the hole (a window's released page). */
PKVI_HIDDEN void pkvi_page_index(pkvi_page *pg);
PKVI_HIDDEN void pkvi_page_unindex(pkvi_pages ps, pkvi_page *pg);
PKVI_HIDDEN void pkvi_btable_push_shared(pkvi_btable *t, pkvi_pages ps, pkvi_page *pg);
/* Entry i's page moved between memory and the spill file: refresh data[i] and
 * n_spilled (B2, B3). */
PKVI_HIDDEN void pkvi_btable_sync(pkvi_btable *t, uint64_t i);
/* Free the arrays of a table with no entries. */
PKVI_HIDDEN void pkvi_btable_free(pkvi_btable *t);
/* B1 (when quiescent) to B3 and B5 for this table; true when they hold. */
PKVI_HIDDEN bool pkvi_btable_check(const pkvi_btable *t, uint64_t bt, bool quiescent);
/* Bytes of the table's own arrays (bookkeeping in pkv_session_memory). */
PKVI_HIDDEN uint64_t pkvi_btable_overhead(const pkvi_btable *t);

/* The page data decode walks: valid while the table is pinned (or always on an
 * engine without a spill file, where pages never move). */
static inline const void *const *pkvi_btable_data(const pkvi_btable *t)
{
    return t->data;
}

#endif /* PAGEDKV_BTABLE_H */

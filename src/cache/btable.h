/*
 * btable.h - a layer's block table (btable.c): which page holds which positions of
 * one layer of one session, and the references those entries hold.
 *
 * Owns the table (an opaque struct: no other file sees its fields) and the reference
 * counts of pages (pkvi_page.refs, .indexed): btable.c is the only code that adds,
 * drops or reads a holder. Every operation the session files do on a table is a named
 * function here. Does not choose pages (session/write.c reserves them through
 * session/residency.c), move their bytes (spill.c) or read them (decode.c reads the
 * entries' page data through pkvi_btable_data while the table is pinned).
 *
 *      pages[0]      pages[1]            pages[n_pages-1]
 *    +-----------+ +-----------+       +-----------+
 *    | 0 .. bt-1 | | bt..2bt-1 |  ...  | .. len-1  |░░░|   last page partly filled
 *    +-----------+ +-----------+       +-----------+
 *    position p lives in pages[p / bt], row p % bt.
 *
 * A windowed layer (docs/variants.md) releases pages nothing will read again: entries
 * [hole_lo, hole_hi) are then NULL (hole_lo = the layer's sink pages), and positions
 * keep their indices, so position p still lives in pages[p / bt].
 *
 * A shard (docs/sharding.md) that starts at position `first` (a multiple of bt) holds
 * no page below it: entries [0, first / bt) are a hole from the start, len counts from
 * 0 (absolute positions), and a window's release later extends that same hole.
 *
 * Lock: every call that changes a table, and every call on a table another thread
 * owns, runs under the engine lock (cache/cache.h). A session's owner thread reads its
 * own tables without it (len, n_pages, the data array): only the owner changes them,
 * and the spiller moves pages only of unpinned tables.
 *
 * Pending drafts (pkv_verify, session/drafts.c): `pending` rows stored at positions
 * len .. len + pending - 1, in pages of this table, that len does not count until a
 * commit makes some of them positions (pkvi_btable_settle) and drops the rest.
 *
 * Invariants (pkvi_btable_check; B1 between calls, the rest always, under the lock):
 *   B1  n_pages == ceil((len + pending) / bt) (a reservation may push pages ahead of
 *                                             the rows it writes: then n_pages > that)
 *   B2  data[i] == pages[i]->data for i < n_pages while the page is settled, NULL while
 *       it is spilled or in transit (spill.h: a reader waits for the transfer);
 *       pages[i] == NULL exactly for hole_lo <= i < hole_hi
 *   B3  n_spilled == #{ i < n_pages : pages[i] && data[i] == NULL }: pages spilled or
 *       in transit, so a pin that finds n_spilled == 0 has every page to read
 *   B4  a page sits at the same index i in every table that holds it (sharing is
 *       index-preserving: fork and the prefix cache)
 *   B5  a page with refs > 1 is never written; a page gains a holder only through
 *       pkvi_btable_share, pkvi_page_index or pkvi_btable_push_shared, never while a
 *       writer may hold it (writing == 0)
 *   B6  a page being written (writing == 1) is not in transit
 * The engine-wide count (sum over tables of entries naming P, plus the index's, ==
 * P->refs: E3) is checked by session/account.c with the census calls below.
 */
#ifndef PAGEDKV_BTABLE_H
#define PAGEDKV_BTABLE_H

#include "store/pool.h"
#include "store/spill.h"

typedef struct pkvi_btable pkvi_btable;

/* Indexed pages (pkvi_page.indexed) whose only reference is the prefix index's:
 * pages kept only for reuse (prefix.h). Kept exact by every reference change here. */
typedef struct {
    uint64_t pages;          /* all of them */
    uint64_t resident;       /* those in memory (the rest are in the spill file) */
} pkvi_cached;

/* Where a released page goes: the pool, and the spill file for a spilled one; and
 * the count of cached pages a dropped reference may add to (cache/cache.h builds it). */
typedef struct {
    pkvi_pool *pool;
    pkvi_spill *spill;       /* NULL without a spill file */
    pkvi_cached *cached;
} pkvi_pages;

/* ---- life ------------------------------------------------------------------------- */

/* An empty table; NULL when out of memory. */
PKVI_HIDDEN pkvi_btable *pkvi_btable_new(void);
/* Free a table that names no page any more (after pkvi_btable_truncate to 0), or
 * never did. NULL: no-op. */
PKVI_HIDDEN void pkvi_btable_free(pkvi_btable *t);

/* ---- reading (the owner thread, or under the lock) ---------------------------------- */

PKVI_HIDDEN uint64_t pkvi_btable_len(const pkvi_btable *t);     /* positions, absolute */
PKVI_HIDDEN uint64_t pkvi_btable_n_pages(const pkvi_btable *t); /* entries, hole included */
PKVI_HIDDEN uint64_t pkvi_btable_first(const pkvi_btable *t);   /* a shard's first
                                                                    position; 0 else */
PKVI_HIDDEN uint64_t pkvi_btable_pending(const pkvi_btable *t); /* pending draft rows */
/* Entries that name a page: n_pages less the hole. */
PKVI_HIDDEN uint64_t pkvi_btable_held(const pkvi_btable *t);
/* Entries whose page is in the spill file or in transit (B3). */
PKVI_HIDDEN uint64_t pkvi_btable_n_spilled(const pkvi_btable *t);
/* The end of a window's released entries (hole_hi), or 0 without such a hole. */
PKVI_HIDDEN uint64_t pkvi_btable_hole_end(const pkvi_btable *t);
/* Entry i's page (i < n_pages); NULL in the hole. Its `data` is the page's bytes while
 * resident. */
PKVI_HIDDEN pkvi_page *pkvi_btable_page(const pkvi_btable *t, uint64_t i);
/* The page data decode walks, [n_pages], NULL for a hole or a page spilled or in
 * transit: valid
 * while the table is pinned (or always on an engine without a spill file, where pages
 * never move) and until the table grows. Decode reads it once per query set, never
 * through a call per page. */
PKVI_HIDDEN const void *const *pkvi_btable_data(const pkvi_btable *t);
/* Bytes of the table itself (bookkeeping in pkv_session_memory). */
PKVI_HIDDEN uint64_t pkvi_btable_overhead(const pkvi_btable *t);

/* ---- writing rows: reserve, push, copy-on-write, advance ------------------------- */

/* Capacity for n entries; on failure the table is unchanged. PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_btable_reserve(pkvi_btable *t, uint64_t n);
/* Append a fresh page (pkvi_page_create: refs 0) as entry n_pages; the table takes
 * its first reference. Capacity must have been reserved. */
PKVI_HIDDEN void pkvi_btable_push(pkvi_btable *t, pkvi_page *fresh);
/* Whether the last entry's page has another holder (a fork, the prefix index): a
 * write into it must copy it first (B5). */
PKVI_HIDDEN bool pkvi_btable_tail_shared(const pkvi_btable *t);
/* Copy-on-write of the last entry: its page_bytes bytes are copied into `fresh`
 * (refs 0), which replaces it; the old page loses this holder. */
PKVI_HIDDEN void pkvi_btable_cow_tail(pkvi_btable *t, pkvi_pages ps, pkvi_page *fresh,
                                      uint64_t page_bytes);
/* The same for entry i (< n_pages, not in the hole): whether its page has another
 * holder, and its copy-on-write. */
PKVI_HIDDEN bool pkvi_btable_shared_at(const pkvi_btable *t, uint64_t i);
PKVI_HIDDEN void pkvi_btable_cow_at(pkvi_btable *t, pkvi_pages ps, uint64_t i,
                                    pkvi_page *fresh, uint64_t page_bytes);
/* Mark entries [from, to) as being written (on) or not (off): B5's writer side. */
PKVI_HIDDEN void pkvi_btable_mark_writing(pkvi_btable *t, uint64_t from, uint64_t to,
                                          bool on);
/* n more positions were written: len += n (within the entries pushed). Owner thread. */
PKVI_HIDDEN void pkvi_btable_advance(pkvi_btable *t, uint64_t n);

/* ---- pending drafts (session/drafts.c) -------------------------------------------- */

/* n draft rows were stored at positions len .. len + n - 1 (within the entries
 * pushed); 0: none pending. Owner thread, under the lock. */
PKVI_HIDDEN void pkvi_btable_set_pending(pkvi_btable *t, uint64_t n);
/* Drop entries [i, n_pages) (pages of drafts no longer pending). */
PKVI_HIDDEN void pkvi_btable_drop_from(pkvi_btable *t, pkvi_pages ps, uint64_t i);
/* A commit: the first n_keep pending rows (already moved into place) become positions,
 * len += n_keep; the rest are no longer pending, and entries past ceil(len / bt) are
 * dropped. */
PKVI_HIDDEN void pkvi_btable_settle(pkvi_btable *t, pkvi_pages ps, uint64_t bt,
                                    uint64_t n_keep);

/* ---- giving pages back: truncate, a window's release ------------------------------- */

/* Keep positions [0, n): entries past ceil(n / bt) are dropped, and pending drafts
 * with them. */
PKVI_HIDDEN void pkvi_btable_truncate(pkvi_btable *t, pkvi_pages ps, uint64_t bt,
                                      uint64_t n);
/* Why truncating to n would lose a position a decode at n - 1 reads, on a layer of
 * window w (0: none): PKVI_CUT_OK when it would not; PKVI_CUT_SHARD when n is below a
 * shard's first position (*at = it); PKVI_CUT_RELEASED when the window released
 * positions below *at that such a decode reads. */
typedef enum { PKVI_CUT_OK = 0, PKVI_CUT_SHARD, PKVI_CUT_RELEASED } pkvi_cut;
PKVI_HIDDEN pkvi_cut pkvi_btable_cut_check(const pkvi_btable *t, uint64_t bt, uint32_t w,
                                           uint64_t n, uint64_t *at);
/* Whether pkvi_btable_release(t, keep_lo, keep_hi) would release an entry (the owner
 * asks without the lock, so a layer takes it once a page, not once a row). */
PKVI_HIDDEN bool pkvi_btable_release_due(const pkvi_btable *t, uint64_t keep_lo,
                                         uint64_t keep_hi);
/* Release entries [max(hole_hi, keep_lo), keep_hi) (a windowed layer's pages that
 * nothing reads again; keep_lo = its sink pages): the hole grows to end at keep_hi. */
PKVI_HIDDEN void pkvi_btable_release(pkvi_btable *t, pkvi_pages ps, uint64_t keep_lo,
                                     uint64_t keep_hi);

/* ---- holes a table starts with: shards and loaded windows --------------------------- */

/* Make an empty table a shard whose first position is `first` (a multiple of bt):
 * entries [0, first / bt) become the hole, len = first. PKV_ENOMEM (unchanged). */
PKVI_HIDDEN pkv_status pkvi_btable_set_first(pkvi_btable *t, uint64_t bt, uint64_t first);
/* A loaded windowed layer: the table holds exactly its sink pages [0, lo) (full, no
 * hole yet) - or is a shard's, just its own hole [0, first / bt), and lo is 0; entries
 * [lo, page) become the released hole and len = page * bt, so the next page pushed is
 * `page`. PKV_EINVAL when the table is not in that state or page is not past its
 * entries; PKV_ENOMEM (unchanged). */
PKVI_HIDDEN pkv_status pkvi_btable_skip_to(pkvi_btable *t, uint64_t bt, uint64_t lo,
                                           uint64_t page);

/* ---- a discard's new tail (SPEC §14, session/discard.c) ---------------------------- */

/* The hole's entries [*lo, *hi) (equal: none). */
PKVI_HIDDEN void pkvi_btable_hole(const pkvi_btable *t, uint64_t *lo, uint64_t *hi);
/* Stale positions [*lo, *hi) (equal: none): rows a discard left in held pages that no
 * decode may read (their source had been released by the window). pkvi_btable_cut_check
 * refuses a truncate that would read them, like the hole's; a truncate clips them. */
PKVI_HIDDEN void pkvi_btable_stale(const pkvi_btable *t, uint64_t *lo, uint64_t *hi);
PKVI_HIDDEN void pkvi_btable_set_stale(pkvi_btable *t, uint64_t lo, uint64_t hi);
/* What a table becomes after a discard: its length, hole (entries) and stale positions. */
typedef struct {
    uint64_t len;
    uint64_t hole_lo, hole_hi;
    uint64_t stale_lo, stale_hi;
} pkvi_btable_shape;
/* Entries [from, from + n) become dst[0..n): the entry's own page (kept), a fresh page
 * (pkvi_page_create: refs 0; the table takes its first reference and the old page
 * loses this holder) or NULL (the hole); entries past from + n are dropped; then the
 * table takes the shape sh. from + n <= n_pages (a discard only shrinks a table). */
PKVI_HIDDEN void pkvi_btable_rewrite(pkvi_btable *t, pkvi_pages ps, uint64_t from,
                                     pkvi_page *const *dst, uint64_t n,
                                     const pkvi_btable_shape *sh);
/* Mark one page as being written (on) or not (off): B5's writer side for the pages a
 * discard rewrites in place (held by this table alone). */
PKVI_HIDDEN void pkvi_page_mark_writing(pkvi_page *pg, bool on);

/* ---- sharing: forks and the prefix cache (docs/prefix-cache.md) -------------------- */

/* dst (empty, capacity reserved) names every page of src: one more reference each. */
PKVI_HIDDEN void pkvi_btable_share(pkvi_btable *dst, const pkvi_btable *src);
/* Entry n_pages (capacity reserved) names pg, an indexed page, with one more
 * reference (from_prefix shares as a fork does); pg NULL extends the hole (a window's
 * released page). */
PKVI_HIDDEN void pkvi_btable_push_shared(pkvi_btable *t, pkvi_pages ps, pkvi_page *pg);
/* The prefix index's own reference: an index entry is one more holder of a full page,
 * counted in refs like a table entry (E3 counts it through `indexed`).
 * pkvi_page_index: the index takes a reference on pg, a full page some table holds
 * (refs >= 1, not being written: B5). pkvi_page_unindex: it drops it (the page is
 * freed when that was the last). */
PKVI_HIDDEN void pkvi_page_index(pkvi_page *pg);
PKVI_HIDDEN void pkvi_page_unindex(pkvi_pages ps, pkvi_page *pg);
PKVI_HIDDEN bool pkvi_page_indexed(const pkvi_page *pg);
/* Whether the prefix index is pg's only holder (a cached page). */
PKVI_HIDDEN bool pkvi_page_cached(const pkvi_page *pg);
/* Whether pg has more than one holder. */
PKVI_HIDDEN bool pkvi_page_shared(const pkvi_page *pg);
/* Whether pg's last holder left while it was in transit (spill.h): its transfer
 * frees it when it ends. */
PKVI_HIDDEN bool pkvi_page_orphan(const pkvi_page *pg);

/* ---- pins and residency: what the spiller may move ---------------------------------- */

/* A call is reading or writing the table's pages (spill engines): the spiller leaves
 * every page of a pinned table alone. Counted; under the lock. */
PKVI_HIDDEN void pkvi_btable_pin(pkvi_btable *t);
PKVI_HIDDEN void pkvi_btable_unpin(pkvi_btable *t);
PKVI_HIDDEN bool pkvi_btable_pinned(const pkvi_btable *t);
/* The spiller's walk: the first entry at or after *i whose page is resident and
 * settled (not in transit), in an unpinned table (none of a pinned one): true with *i
 * and *pg set, false at the end. */
PKVI_HIDDEN bool pkvi_btable_next_resident(const pkvi_btable *t, uint64_t *i,
                                           pkvi_page **pg);
/* Entries from `from` on whose page is spilled or in transit (data[i] NULL): their
 * count, and (when idx and pages are not NULL) their indices and pages, in order. */
PKVI_HIDDEN uint64_t pkvi_btable_spilled(const pkvi_btable *t, uint64_t from, uint64_t *idx,
                                         pkvi_page **pages);
/* Whether entry i names pg (B4: a holder of a page at index i is found there). */
PKVI_HIDDEN bool pkvi_btable_names(const pkvi_btable *t, uint64_t i, const pkvi_page *pg);
/* Entry i's page moved between memory and the spill file, or began or ended a
 * transfer: refresh data[i] and n_spilled (B2, B3). */
PKVI_HIDDEN void pkvi_btable_sync(pkvi_btable *t, uint64_t i);

/* ---- accounting --------------------------------------------------------------------- */

/* Entries whose page is resident and has another table as a holder (the prefix index
 * is no session): pkv_session_memory's bytes_shared, in pages. */
PKVI_HIDDEN uint64_t pkvi_btable_shared_resident(const pkvi_btable *t);
/* pkv_session_pages of entries [first, first + n): what each names; returns how many
 * were written (none past n_pages). */
PKVI_HIDDEN uint64_t pkvi_btable_info(const pkvi_btable *t, uint64_t first, uint64_t n,
                                      pkv_page_info *out);

/* ---- checks ------------------------------------------------------------------------- */

/* B1 (when quiescent) to B3, B5 and B6 for this table, and no pins when quiescent;
 * true when they hold. */
PKVI_HIDDEN bool pkvi_btable_check(const pkvi_btable *t, uint64_t bt, bool quiescent);
/* E3, the count of holders over every table and the index, in three passes over all
 * of them (session/account.c): reset each page's tally; count each holder into it
 * (pkvi_btable_tally; the prefix index counts its own); then visit each page once
 * (pkvi_btable_census, pkvi_page_census): tally == refs, resident / spilled / indexed
 * counted, tally back to 0. */
typedef struct {
    uint64_t resident;       /* distinct pages in memory (data != NULL: RESIDENT and
                                OUTGOING, spill.h) */
    uint64_t spilled;        /* distinct pages in the spill file (SPILLED, INCOMING) */
    uint64_t indexed;        /* distinct pages the prefix index holds */
    uint64_t transit;        /* distinct pages in transit (OUTGOING, INCOMING) */
    bool ok;                 /* every page's holders == its refs */
} pkvi_census;
PKVI_HIDDEN void pkvi_btable_tally(const pkvi_btable *t, bool reset);
PKVI_HIDDEN void pkvi_btable_census(const pkvi_btable *t, pkvi_census *c);
PKVI_HIDDEN void pkvi_page_census(pkvi_page *pg, pkvi_census *c);

/* Test hook: move pg's refs by delta, to show that the check above sees a count that
 * no holder backs. Never called by the library. */
PKVI_HIDDEN void pkvi_page_skew_refs(pkvi_page *pg, int delta);

#endif /* PAGEDKV_BTABLE_H */

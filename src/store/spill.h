/*
 * spill.h - the spill file (spill.c): page bytes written out when the memory budget
 * is full and read back on the next use, through the I/O interface (io.h), and the
 * states a page descriptor goes through on the way.
 *
 * Owns the file (one per engine, private: O_TMPFILE or created 0600 and unlinked at
 * once), its slots, the I/O object behind it, and the descriptor's location fields
 * (data, slot, transit) through the transitions below. Does not choose victims
 * (session/residency.c knows sessions, their LRU order and which tables are pinned),
 * never looks at block tables and never counts holders (btable.c).
 *
 * No I/O under the engine lock. A transfer is three steps, and the transfer calls
 * below are the middle one, made without the engine lock:
 *
 *   engine lock      choose pages, take read buffers, pkvi_spill_mark_out / _mark_in
 *   no engine lock   pkvi_spill_write / pkvi_spill_read        (the I/O)
 *   engine lock      pkvi_spill_end_out / _end_in              (commit or roll back)
 *
 * A descriptor's states (data, transit; every arrow but the I/O under the engine lock):
 *
 *                   pkvi_spill_mark_out            pkvi_spill_write          end_out:
 *   RESIDENT ----------------------------> OUTGOING ..............> written, no holder
 *   data = buf       a victim: no holder   data = buf (read by the   pinned: buf to the
 *   transit = 0      pinned (residency.c)  write), slot taken by it  pool, data = NULL
 *      ^  ^                                    |                           |
 *      |  +------------------------------------+                           v
 *      |    end_out: not written, or a holder pinned meanwhile:   SPILLED
 *      |    kept (slot back to the file)                          data = NULL, slot
 *      |                                                          transit = 0
 *      |    end_in: arrived: data = buf,      pkvi_spill_mark_in       |
 *      +---------------------------------- INCOMING <------------------+
 *           slot back to the file          data = NULL, buf from the pool (the
 *                                          caller's), pkvi_spill_read fills it
 *           end_in: failed: buf back to the pool ----------------> SPILLED
 *
 * While a page is OUTGOING or INCOMING the transfer owns it: its buffer is not
 * freed or reused, its slot not given away, and a holder's table entry reads NULL
 * (btable.h, B2), so a decode or write that needs it waits on the engine's `moved`
 * condition (cache/cache.h) until end_out / end_in ran. A page whose last holder
 * left meanwhile (refs 0: btable.c defers freeing it) is freed by the caller right
 * after its end_out / end_in (pkvi_spill_drop first if it ended SPILLED).
 *
 * Invariants (counted by session/account.c with cache.h's transfer registry):
 *   pool.spilled == descriptors with data == NULL (SPILLED or INCOMING), each owning
 *                   one slot; a slot is owned by one descriptor or is free
 *   pool.in_use  == descriptors with data != NULL (RESIDENT or OUTGOING)
 *                   + buffers of INCOMING pages
 *
 * Locks of its own: `slots` (the free list and the file's end; held briefly, also
 * inside the engine lock) and `io` (the I/O object and the file's size; held across
 * a transfer, never with the engine lock held). Order: engine lock -> slots,
 * io -> slots. So one transfer at a time moves bytes, and nobody waits for it while
 * holding the engine lock.
 */
#ifndef PAGEDKV_SPILL_H
#define PAGEDKV_SPILL_H

#include "store/io.h"
#include "store/pool.h"

typedef struct pkvi_spill pkvi_spill;

/* A private spill file in dir for pages of page_bytes. PKV_EIO if it cannot be
 * created, PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_spill_open(const char *dir, uint64_t page_bytes,
                                       pkvi_spill **out);
PKVI_HIDDEN void pkvi_spill_close(pkvi_spill *sp);                  /* NULL: no-op */
/* "io_uring" | "sync": what the transfers use now (io_uring may fall back to sync).
 * Takes no lock, so stats never wait for a transfer. */
PKVI_HIDDEN const char *pkvi_spill_backend(const pkvi_spill *sp);
/* The io object (tests inject faults through it). */
PKVI_HIDDEN pkvi_io *pkvi_spill_io(pkvi_spill *sp);

/* ---- under the engine lock: start a transfer ----------------------------------- */

/* RESIDENT -> OUTGOING: pg is a victim about to be written out. */
PKVI_HIDDEN void pkvi_spill_mark_out(pkvi_page *pg);
/* SPILLED -> INCOMING: pg is about to be read into a buffer the caller took from the
 * pool (pkvi_pool_get). */
PKVI_HIDDEN void pkvi_spill_mark_in(pkvi_page *pg);

/* ---- without the engine lock: the I/O ------------------------------------------ */

/* Write n distinct OUTGOING pages to slots of the file in one batch (free slots
 * first, then new ones at the end); written[k] says whether pages[k] reached the file
 * (its slot is then in pg->slot). When a batch that grew the file fails and the file's
 * free slots hold at least `need` pages, the pages that got free slots are written
 * again into free slots alone (a full disk stops only what does not fit): PKV_OK
 * then, with fewer pages written. On failure (PKV_EIO, PKV_ENOMEM) nothing was
 * written and the slots are as they were. Changes no descriptor field but `slot`. */
PKVI_HIDDEN pkv_status pkvi_spill_write(pkvi_spill *sp, pkvi_page *const *pages, uint64_t n,
                                        uint64_t need, bool *written);
/* Read n distinct INCOMING pages from their slots into bufs[k] (page_bytes each), in
 * one batch. PKV_EIO, PKV_ENOMEM: some buffers may hold part of their bytes. Changes
 * no descriptor field. */
PKVI_HIDDEN pkv_status pkvi_spill_read(pkvi_spill *sp, pkvi_page *const *pages,
                                       void *const *bufs, uint64_t n);

/* ---- under the engine lock: end a transfer ------------------------------------- */

/* OUTGOING -> SPILLED when written and not keep (its buffer goes back to the pool,
 * counted in spilled instead), else -> RESIDENT (a written page's slot is freed). */
PKVI_HIDDEN void pkvi_spill_end_out(pkvi_spill *sp, pkvi_pool *p, pkvi_page *pg,
                                    bool written, bool keep);
/* INCOMING -> RESIDENT with data = buf when arrived (its slot is freed), else ->
 * SPILLED (buf back to the pool). */
PKVI_HIDDEN void pkvi_spill_end_in(pkvi_spill *sp, pkvi_pool *p, pkvi_page *pg, void *buf,
                                   bool arrived);
/* A SPILLED page is being freed: its slot becomes free. */
PKVI_HIDDEN void pkvi_spill_drop(pkvi_spill *sp, pkvi_pool *p, pkvi_page *pg);

/* Test hook: fn(ctx, write, n) runs at the start of every pkvi_spill_write (write) and
 * pkvi_spill_read of sp, for n pages, without any lock held (fn NULL: none). Set it
 * while no transfer is in flight. */
PKVI_HIDDEN void pkvi_spill_hook_transfer(pkvi_spill *sp,
                                          void (*fn)(void *ctx, bool write, uint64_t n),
                                          void *ctx);

#endif /* PAGEDKV_SPILL_H */

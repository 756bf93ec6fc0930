/*
 * spill.h - the spill file (spill.c): page bytes written out when the memory budget
 * is full and read back on the next use, through the I/O interface (io.h).
 *
 * Owns the file (one per engine, private: O_TMPFILE or created 0600 and unlinked at
 * once) and its slots. Does not choose victims (session/residency.c knows sessions,
 * their LRU order and which tables are pinned) and never looks at block tables.
 * Every function runs under the engine lock.
 *
 * Invariant: pool.spilled == descriptors with data == NULL, each owning one slot;
 * a slot is owned by one descriptor or is free.
 */
#ifndef PAGEDKV_SPILL_H
#define PAGEDKV_SPILL_H

#include "store/io.h"
#include "store/pool.h"

typedef struct pkvi_spill pkvi_spill;

/* A private spill file in dir. PKV_EIO if it cannot be created, PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_spill_open(const char *dir, pkvi_spill **out);
PKVI_HIDDEN void pkvi_spill_close(pkvi_spill *sp);                  /* NULL: no-op */
PKVI_HIDDEN const char *pkvi_spill_backend(const pkvi_spill *sp);   /* "io_uring"|"sync" */
/* The io object (tests inject faults through it). */
PKVI_HIDDEN pkvi_io *pkvi_spill_io(pkvi_spill *sp);
/* Write n distinct resident pages to the file in one batch, then give their buffers
 * back to the pool: each written page becomes SPILLED (data == NULL). When a batch
 * that grew the file fails and the file's free slots hold at least `need` pages, the
 * first of them that fit are written instead (a full disk stops only what does not
 * fit): PKV_OK then, with fewer pages spilled - the caller looks at each page's data.
 * On failure (PKV_EIO, PKV_ENOMEM) every page stays resident and no slot is lost. */
PKVI_HIDDEN pkv_status pkvi_spill_write(pkvi_spill *sp, pkvi_pool *p,
                                        pkvi_page *const *pages, uint64_t n, uint64_t need);
/* Read n distinct spilled pages back in one batch into buffers from the pool (the
 * caller made room): each becomes RESIDENT. On failure every page stays spilled. */
PKVI_HIDDEN pkv_status pkvi_spill_read(pkvi_spill *sp, pkvi_pool *p,
                                       pkvi_page *const *pages, uint64_t n);
/* A spilled page is being freed: its slot becomes free. */
PKVI_HIDDEN void pkvi_spill_drop(pkvi_spill *sp, pkvi_pool *p, pkvi_page *pg);

/* Test hook: fn(ctx, write, n) runs at the start of every pkvi_spill_write (write) and
 * pkvi_spill_read of sp, for n pages (fn NULL: none). Set it while no transfer is in
 * flight. */
PKVI_HIDDEN void pkvi_spill_hook_transfer(pkvi_spill *sp,
                                          void (*fn)(void *ctx, bool write, uint64_t n),
                                          void *ctx);

#endif /* PAGEDKV_SPILL_H */

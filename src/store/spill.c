/*
 * spill.c - the spill file: page bytes written out when the memory budget is full,
 * and read back on the next use, and the descriptor states on the way (spill.h draws
 * them).
 *
 * Owns the file (one per engine, slots of page_bytes), its free slots, the I/O object
 * the bytes move through (io.c: io_uring or pread/pwrite; batched, one vectored
 * request per run of adjacent slots), and the two locks that guard them. Which pages
 * go is session/residency.c's choice; this file never looks at a block table.
 *
 * Locks (spill.h): the transfers, pkvi_spill_write and pkvi_spill_read, run without
 * the engine lock and hold `io` for their whole I/O, so one batch moves bytes at a
 * time and the file's size changes under one holder; `slots` guards the free list
 * and the file's end and is held only for a few instructions, by the transfers and by
 * the calls made under the engine lock (end_out, end_in, drop). The mark and end
 * calls change descriptor fields, under the engine lock (cache/cache.h).
 *
 * A failed write keeps every page resident; a failed read keeps every page spilled;
 * nothing is lost either way.
 *
 * Slots: free slots (inside the file) are used before the file grows. A failed batch
 * gives back the slots it took and the file's end is put back where it was (only a
 * write grows the file, and writes hold `io`), and when it had to grow the file it is
 * retried into the free slots alone: a full disk stops only the spills that do not fit
 * the room the file already has.
 *
 * Privacy (docs/design.md, "Memory budget and spill"): the file is O_TMPFILE (no name
 * at all) where the file system has it, else created 0600 with O_EXCL under a fixed
 * name pattern and unlinked at once.
 */
#include "store/spill.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct pkvi_spill {
    int fd;
    uint64_t page_bytes;
    pthread_mutex_t io_lock;     /* `io` of spill.h: held across a transfer */
    pkvi_io *io;                 /* io_lock */
    _Atomic(const char *) backend; /* pkvi_io_backend(io) after the last transfer: read
                                      without a lock (stats) */
    pthread_mutex_t slots_lock;  /* `slots` of spill.h: held briefly */
    uint64_t next_slot;          /* slots [0, next_slot) exist in the file; slots_lock,
                                    and only a write (io_lock) moves it */
    uint64_t *free_slots;        /* reusable slots, [n_free] of [cap_free]; slots_lock */
    uint64_t n_free, cap_free;
    void (*hook)(void *ctx, bool write, uint64_t n); /* test hook (NULL: none) */
    void *hook_ctx;
};

static int open_private(const char *dir)
{
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0)
        return fd;
    /* No O_TMPFILE here: a fresh name, exclusive, owner-only, unlinked at once. */
    size_t n = strlen(dir) + sizeof "/.pagedkv-spill-XXXXXX";
    char *path = malloc(n);
    if (!path)
        return -1;
    snprintf(path, n, "%s/.pagedkv-spill-XXXXXX", dir);
    fd = mkostemp(path, O_CLOEXEC);
    if (fd >= 0)
        unlink(path);
    free(path);
    return fd;
}

pkv_status pkvi_spill_open(const char *dir, uint64_t page_bytes, pkvi_spill **out)
{
    pkvi_spill *sp = calloc(1, sizeof *sp);
    if (!sp)
        return PKV_ENOMEM;
    sp->page_bytes = page_bytes;
    sp->fd = open_private(dir);
    if (sp->fd < 0) {
        free(sp);
        return PKV_EIO;
    }
    pkv_status st = pkvi_io_open(false, &sp->io);
    if (st != PKV_OK) {
        close(sp->fd);
        free(sp);
        return st;
    }
    atomic_init(&sp->backend, pkvi_io_backend(sp->io));
    pthread_mutex_init(&sp->io_lock, NULL);
    pthread_mutex_init(&sp->slots_lock, NULL);
    *out = sp;
    return PKV_OK;
}

void pkvi_spill_close(pkvi_spill *sp)
{
    if (!sp)
        return;
    pkvi_io_close(sp->io);
    close(sp->fd); /* the file has no name: closing it removes it */
    free(sp->free_slots);
    pthread_mutex_destroy(&sp->io_lock);
    pthread_mutex_destroy(&sp->slots_lock);
    free(sp);
}

const char *pkvi_spill_backend(const pkvi_spill *sp)
{
    return atomic_load_explicit(&sp->backend, memory_order_relaxed);
}

pkvi_io *pkvi_spill_io(pkvi_spill *sp)
{
    return sp->io;
}

void pkvi_spill_hook_transfer(pkvi_spill *sp, void (*fn)(void *ctx, bool write, uint64_t n),
                              void *ctx)
{
    sp->hook = fn;
    sp->hook_ctx = ctx;
}

/* ---- slots (slots_lock) ----------------------------------------------------------- */

/* A free slot, reused first; otherwise the file grows by one slot. */
static uint64_t slot_take(pkvi_spill *sp)
{
    return sp->n_free ? sp->free_slots[--sp->n_free] : sp->next_slot++;
}

/* Return a slot; the list grows so a later take never fails. */
static void slot_give(pkvi_spill *sp, uint64_t slot)
{
    if (sp->n_free == sp->cap_free) {
        uint64_t cap = sp->cap_free ? sp->cap_free * 2 : 64;
        uint64_t *p = realloc(sp->free_slots, (size_t)cap * sizeof *p);
        if (!p)
            return; /* the slot is leaked in the file (disk, not memory); harmless */
        sp->free_slots = p;
        sp->cap_free = cap;
    }
    sp->free_slots[sp->n_free++] = slot;
}

static void slot_give_locked(pkvi_spill *sp, uint64_t slot)
{
    pthread_mutex_lock(&sp->slots_lock);
    slot_give(sp, slot);
    pthread_mutex_unlock(&sp->slots_lock);
}

/* ---- the transfers (no engine lock; io_lock inside) ---------------------------------- */

/* A page of a transfer with the buffer its bytes move from or to, and its place in
 * the caller's arrays. */
typedef struct {
    pkvi_page *pg;
    void *buf;
    uint64_t at;
} moving;

static int by_slot(const void *a, const void *b)
{
    const uint64_t x = ((const moving *)a)->pg->slot, y = ((const moving *)b)->pg->slot;
    return x < y ? -1 : x > y;
}

/* One request per run of adjacent slots (m sorted by slot): a vectored transfer of
 * up to PKVI_IO_MAX_IOV pages instead of one request per page (docs/performance.md,
 * decision table: SPILL_BATCH). iov and reqs hold n entries. Returns the number of
 * requests. */
static uint32_t slot_runs(const pkvi_spill *sp, bool write, const moving *m, uint32_t n,
                          struct iovec *iov, pkvi_io_req *reqs)
{
    const uint64_t pb = sp->page_bytes;
    uint32_t nr = 0;
    for (uint32_t k = 0; k < n;) {
        uint32_t end = k + 1;
        while (end < n && end - k < PKVI_IO_MAX_IOV && m[end].pg->slot == m[end - 1].pg->slot + 1)
            end++;
        for (uint32_t j = k; j < end; j++)
            iov[j] = (struct iovec){.iov_base = m[j].buf, .iov_len = (size_t)pb};
        reqs[nr++] = (pkvi_io_req){.write = write, .fd = sp->fd, .len = (end - k) * pb,
                                   .off = m[k].pg->slot * pb, .iov = &iov[k],
                                   .iovcnt = end - k};
        k = end;
    }
    return nr;
}

/* Under io_lock: submit, and note the backend (a broken ring falls back to sync). */
static pkv_status submit(pkvi_spill *sp, const pkvi_io_req *reqs, uint32_t nr)
{
    const pkv_status st = pkvi_io_submit(sp->io, reqs, nr);
    atomic_store_explicit(&sp->backend, pkvi_io_backend(sp->io), memory_order_relaxed);
    return st;
}

/* Under io_lock: write m[0..n) to slots in one batch, free slots first (they lie
 * inside the file), then new slots at the end of the file. On failure the slots taken
 * are given back and the file's end is where it was - cut back if a partial write
 * grew it - so the slots that failed are not first in line for the next batch (a
 * full disk would then fail every later spill, even one that fits the free room);
 * each page's `slot` still says where it would have gone. Sorts m by slot. */
static pkv_status write_batch(pkvi_spill *sp, moving *m, uint64_t n, struct iovec *iov,
                              pkvi_io_req *reqs)
{
    pthread_mutex_lock(&sp->slots_lock);
    const uint64_t end0 = sp->next_slot; /* only writes move it, and they hold io_lock */
    for (uint64_t v = 0; v < n; v++)
        m[v].pg->slot = slot_take(sp);
    pthread_mutex_unlock(&sp->slots_lock);
    qsort(m, (size_t)n, sizeof *m, by_slot);
    const pkv_status st = submit(sp, reqs, slot_runs(sp, true, m, (uint32_t)n, iov, reqs));
    if (st != PKV_OK) {
        pthread_mutex_lock(&sp->slots_lock);
        for (uint64_t v = 0; v < n; v++)
            if (m[v].pg->slot < end0)
                slot_give(sp, m[v].pg->slot);
        sp->next_slot = end0;
        pthread_mutex_unlock(&sp->slots_lock);
        struct stat fs;
        if (fstat(sp->fd, &fs) == 0 && (uint64_t)fs.st_size > end0 * sp->page_bytes &&
            ftruncate(sp->fd, (off_t)(end0 * sp->page_bytes)) != 0) {
            /* the file keeps the failed bytes: disk space only, never read */
        }
    }
    return st;
}

/* The scratch of one transfer: n of each. */
typedef struct {
    moving *m;
    pkvi_io_req *reqs;
    struct iovec *iov;
} scratch;

static bool scratch_get(scratch *s, uint64_t n)
{
    s->m = malloc((size_t)n * sizeof *s->m);
    s->reqs = malloc((size_t)n * sizeof *s->reqs);
    s->iov = malloc((size_t)n * sizeof *s->iov);
    return s->m && s->reqs && s->iov;
}

static void scratch_put(scratch *s)
{
    free(s->m);
    free(s->reqs);
    free(s->iov);
}

pkv_status pkvi_spill_write(pkvi_spill *sp, pkvi_page *const *pages, uint64_t n,
                            uint64_t need, bool *written)
{
    for (uint64_t v = 0; v < n; v++)
        written[v] = false;
    if (n == 0)
        return need ? PKV_ENOMEM : PKV_OK;
    if (n > UINT32_MAX)
        return PKV_ENOMEM;
    if (sp->hook)
        sp->hook(sp->hook_ctx, true, n);
    scratch s;
    if (!scratch_get(&s, n)) {
        scratch_put(&s);
        return PKV_ENOMEM;
    }
    for (uint64_t v = 0; v < n; v++) /* OUTGOING: data stays put until end_out */
        s.m[v] = (moving){.pg = pages[v], .buf = pages[v]->data, .at = v};
    pthread_mutex_lock(&sp->io_lock);
    pthread_mutex_lock(&sp->slots_lock);
    const uint64_t reusable = sp->n_free;
    pthread_mutex_unlock(&sp->slots_lock);
    uint64_t done = n;
    pkv_status st = write_batch(sp, s.m, n, s.iov, s.reqs);
    if (st != PKV_OK && n > reusable && reusable >= need) {
        /* The batch grew the file and failed: perhaps the disk is full, or the file
         * reached a size limit. The free slots lie inside the file and can still take
         * pages, so retry with as many pages as they hold (enough for the call): those
         * write_batch gave the free slots, below the file's end. Slots other calls
         * freed meanwhile only add room. */
        done = 0;
        for (uint64_t v = 0; v < n; v++)
            if (s.m[v].pg->slot < sp->next_slot)
                s.m[done++] = s.m[v];
        st = write_batch(sp, s.m, done, s.iov, s.reqs);
    }
    pthread_mutex_unlock(&sp->io_lock);
    for (uint64_t v = 0; st == PKV_OK && v < done; v++)
        written[s.m[v].at] = true;
    scratch_put(&s);
    return st;
}

pkv_status pkvi_spill_read(pkvi_spill *sp, pkvi_page *const *pages, void *const *bufs,
                           uint64_t n)
{
    if (n == 0)
        return PKV_OK;
    if (n > UINT32_MAX)
        return PKV_ENOMEM;
    if (sp->hook)
        sp->hook(sp->hook_ctx, false, n);
    scratch s;
    if (!scratch_get(&s, n)) {
        scratch_put(&s);
        return PKV_ENOMEM;
    }
    for (uint64_t k = 0; k < n; k++)
        s.m[k] = (moving){.pg = pages[k], .buf = bufs[k], .at = k};
    qsort(s.m, (size_t)n, sizeof *s.m, by_slot);
    pthread_mutex_lock(&sp->io_lock);
    const pkv_status st = submit(sp, s.reqs, slot_runs(sp, false, s.m, (uint32_t)n, s.iov,
                                                       s.reqs));
    pthread_mutex_unlock(&sp->io_lock);
    scratch_put(&s);
    return st;
}

/* ---- the descriptor's states (engine lock) ------------------------------------------- */

void pkvi_spill_mark_out(pkvi_page *pg)
{
    pg->transit = PKVI_OUTGOING;
}

void pkvi_spill_mark_in(pkvi_page *pg)
{
    pg->transit = PKVI_INCOMING;
}

void pkvi_spill_end_out(pkvi_spill *sp, pkvi_pool *p, pkvi_page *pg, bool written,
                        bool keep)
{
    pg->transit = PKVI_SETTLED;
    if (!written)
        return;
    if (keep) { /* a holder wants it now: it stays, its copy in the file is dropped */
        slot_give_locked(sp, pg->slot);
        return;
    }
    pkvi_pool_put_spilled(p, pg->data);
    pg->data = NULL;
}

void pkvi_spill_end_in(pkvi_spill *sp, pkvi_pool *p, pkvi_page *pg, void *buf, bool arrived)
{
    pg->transit = PKVI_SETTLED;
    if (!arrived) {
        pkvi_pool_put(p, buf);
        return;
    }
    slot_give_locked(sp, pg->slot);
    pg->data = buf;
    pkvi_pool_unspilled(p);
}

void pkvi_spill_drop(pkvi_spill *sp, pkvi_pool *p, pkvi_page *pg)
{
    slot_give_locked(sp, pg->slot);
    pkvi_pool_unspilled(p);
}

/*
 * spill.c - the spill file: page bytes written out when the memory budget is full,
 * and read back on the next use (spill.h).
 *
 * Owns the file (one per engine, slots of page_bytes) and its free slots. The bytes
 * move through the I/O interface (io.c: io_uring or pread/pwrite), batched, one
 * vectored request per run of adjacent slots. Which pages go is session/residency.c's
 * choice; this file never looks at a block table. Every function runs under the engine
 * lock (cache/cache.h).
 *
 * A failed write keeps every page resident; a failed read keeps every page spilled;
 * nothing is lost either way.
 *
 * Slots: free slots (inside the file) are used before the file grows. A failed batch
 * puts the slot state back exactly as it was, and when it had to grow the file it is
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct pkvi_spill {
    int fd;
    pkvi_io *io;
    uint64_t next_slot;          /* slots [0, next_slot) exist in the file */
    uint64_t *free_slots;        /* reusable slots, [n_free] of [cap_free] */
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

pkv_status pkvi_spill_open(const char *dir, pkvi_spill **out)
{
    pkvi_spill *sp = calloc(1, sizeof *sp);
    if (!sp)
        return PKV_ENOMEM;
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
    free(sp);
}

const char *pkvi_spill_backend(const pkvi_spill *sp)
{
    return pkvi_io_backend(sp->io);
}

pkvi_io *pkvi_spill_io(pkvi_spill *sp)
{
    return sp->io;
}

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

static int by_slot(const void *a, const void *b)
{
    const pkvi_page *x = *(pkvi_page *const *)a, *y = *(pkvi_page *const *)b;
    return x->slot < y->slot ? -1 : x->slot > y->slot;
}

/* One request per run of adjacent slots (pages sorted by slot; bufs[k] is the memory of
 * pages[k]): a vectored transfer of up to PKVI_IO_MAX_IOV pages instead of one request
 * per page. Measured (256 MiB sessions, 64 KiB pages): per-page requests moved spill
 * and restore at 0.42-0.58 of a plain 1 MiB-request sequential write+read; per-page
 * requests were the whole gap (plain at 64 KiB requests ran at the same speed).
 * iov and reqs hold n entries. Returns the number of requests. */
static uint32_t slot_runs(const pkvi_spill *sp, bool write, pkvi_page *const *pages,
                          void *const *bufs, uint32_t n, uint64_t pb, struct iovec *iov,
                          pkvi_io_req *reqs)
{
    uint32_t nr = 0;
    for (uint32_t k = 0; k < n;) {
        uint32_t end = k + 1;
        while (end < n && end - k < PKVI_IO_MAX_IOV && pages[end]->slot == pages[end - 1]->slot + 1)
            end++;
        for (uint32_t j = k; j < end; j++)
            iov[j] = (struct iovec){.iov_base = bufs[j], .iov_len = (size_t)pb};
        reqs[nr++] = (pkvi_io_req){.write = write, .fd = sp->fd, .len = (end - k) * pb,
                                   .off = pages[k]->slot * pb, .iov = &iov[k],
                                   .iovcnt = end - k};
        k = end;
    }
    return nr;
}

/* Write pages[0..n) to slots in one batch: free slots first (they lie inside the
 * file), then new slots at the end of the file. On failure the slot state is exactly
 * as it was - the free list and the file's end restored, and the file cut back if a
 * partial write grew it - so the slots that failed are not first in line for the
 * next batch (a full disk would then fail every later spill, even one that fits the
 * free room); the pages keep their memory and `slot` says where each would have
 * gone. Sorts pages by slot. bufs, iov and reqs hold n entries. */
static pkv_status write_batch(pkvi_spill *sp, uint64_t page_bytes, pkvi_page **pages,
                              uint64_t n, void **bufs, struct iovec *iov, pkvi_io_req *reqs)
{
    const uint64_t free0 = sp->n_free, end0 = sp->next_slot;
    for (uint64_t v = 0; v < n; v++)
        pages[v]->slot = slot_take(sp);
    qsort(pages, (size_t)n, sizeof *pages, by_slot);
    for (uint64_t v = 0; v < n; v++)
        bufs[v] = pages[v]->data;
    const uint32_t nr = slot_runs(sp, true, pages, bufs, (uint32_t)n, page_bytes, iov, reqs);
    const pkv_status st = pkvi_io_submit(sp->io, reqs, nr);
    if (st != PKV_OK) {
        /* slot_take only popped the free list: its entries are still in place */
        sp->n_free = free0;
        sp->next_slot = end0;
        struct stat fs;
        if (fstat(sp->fd, &fs) == 0 && (uint64_t)fs.st_size > end0 * page_bytes &&
            ftruncate(sp->fd, (off_t)(end0 * page_bytes)) != 0) {
            /* the file keeps the failed bytes: disk space only, never read */
        }
    }
    return st;
}

pkv_status pkvi_spill_write(pkvi_spill *sp, pkvi_pool *p, pkvi_page *const *pages,
                            uint64_t n, uint64_t need)
{
    if (n == 0)
        return need ? PKV_ENOMEM : PKV_OK;
    if (n > UINT32_MAX)
        return PKV_ENOMEM;
    if (sp->hook)
        sp->hook(sp->hook_ctx, true, n);
    pkvi_page **order = malloc((size_t)n * sizeof *order);
    pkvi_io_req *reqs = malloc((size_t)n * sizeof *reqs);
    struct iovec *iov = malloc((size_t)n * sizeof *iov);
    void **bufs = malloc((size_t)n * sizeof *bufs);
    pkv_status st = PKV_ENOMEM;
    uint64_t m = n;
    if (order && reqs && iov && bufs) {
        memcpy(order, pages, (size_t)n * sizeof *order);
        const uint64_t reusable = sp->n_free;
        st = write_batch(sp, pkvi_pool_page_bytes(p), order, n, bufs, iov, reqs);
        if (st != PKV_OK && n > reusable && reusable >= need) {
            /* The batch grew the file and failed: perhaps the disk is full, or the
             * file reached a size limit. The free slots lie inside the file and can
             * still take pages, so retry with as many pages as they hold (enough for
             * the call): those write_batch gave the free slots, below the file's end. */
            m = 0;
            for (uint64_t v = 0; v < n; v++)
                if (order[v]->slot < sp->next_slot)
                    order[m++] = order[v];
            st = write_batch(sp, pkvi_pool_page_bytes(p), order, m, bufs, iov, reqs);
        }
        for (uint64_t v = 0; st == PKV_OK && v < m; v++) {
            pkvi_pool_put_spilled(p, order[v]->data);
            order[v]->data = NULL;
        }
    }
    free(order);
    free(reqs);
    free(iov);
    free(bufs);
    return st;
}

pkv_status pkvi_spill_read(pkvi_spill *sp, pkvi_pool *p, pkvi_page *const *pages,
                           uint64_t n)
{
    if (n == 0)
        return PKV_OK;
    if (n > UINT32_MAX)
        return PKV_ENOMEM;
    if (sp->hook)
        sp->hook(sp->hook_ctx, false, n);
    pkvi_page **order = malloc((size_t)n * sizeof *order);
    void **bufs = malloc((size_t)n * sizeof *bufs);
    pkvi_io_req *reqs = malloc((size_t)n * sizeof *reqs);
    struct iovec *iov = malloc((size_t)n * sizeof *iov);
    if (!order || !bufs || !reqs || !iov) {
        free(order);
        free(bufs);
        free(reqs);
        free(iov);
        return PKV_ENOMEM;
    }
    memcpy(order, pages, (size_t)n * sizeof *order);
    qsort(order, (size_t)n, sizeof *order, by_slot);
    pkv_status st = PKV_OK;
    uint64_t got = 0;
    for (; got < n; got++) {
        st = pkvi_pool_get(p, &bufs[got]);
        if (st != PKV_OK)
            break;
    }
    if (st == PKV_OK)
        st = pkvi_io_submit(sp->io, reqs, slot_runs(sp, false, order, bufs, (uint32_t)n,
                                                    pkvi_pool_page_bytes(p), iov, reqs));
    if (st != PKV_OK) {
        for (uint64_t k = 0; k < got; k++)
            pkvi_pool_put(p, bufs[k]);
    } else {
        for (uint64_t k = 0; k < n; k++) {
            slot_give(sp, order[k]->slot);
            order[k]->data = bufs[k];
            pkvi_pool_unspilled(p);
        }
    }
    free(order);
    free(bufs);
    free(reqs);
    free(iov);
    return st;
}

void pkvi_spill_drop(pkvi_spill *sp, pkvi_pool *p, pkvi_page *pg)
{
    slot_give(sp, pg->slot);
    pkvi_pool_unspilled(p);
}

void pkvi_spill_hook_transfer(pkvi_spill *sp, void (*fn)(void *ctx, bool write, uint64_t n),
                              void *ctx)
{
    sp->hook = fn;
    sp->hook_ctx = ctx;
}

/*
 * io.c - the I/O object behind pkvi_io_*: backend choice, the pread/pwrite backend,
 * fsync and fault injection.
 *
 * Owns: struct pkvi_io (one per user: the engine's spill file, the engine's session
 *   files - save and load of all its sessions - and each pkv_session_file_check
 *   call); the synchronous backend; the per-object fault counters; the object's lock.
 * Does not own: the io_uring backend (io_uring.c, reached through io_backend.h), the
 *   file descriptors (callers open and close them).
 *
 * Locking: io->lock serializes the submissions on one object (its ring and backend
 *   choice), so several threads may share it - the engine's saves and loads of
 *   different sessions do; the spill file also holds its own `io` lock around its
 *   object, never the engine lock. A submission completes every request before it
 *   returns, so the lock is held only while that object's I/O runs; fsync takes no
 *   lock (it touches no ring). The fault counters are atomic (tests arm them from
 *   any thread).
 *
 * Invariants:
 *   - pkvi_io_submit returns only when no request of the call is still in flight, so
 *     the caller's buffers are free again whatever the outcome.
 *   - A request completes only when all its `len` bytes moved; a read that meets the
 *     end of the file first is an error (PKV_EIO), never a silent short read.
 *   - fault[k] == 0: disarmed; fault[k] == n > 0: the nth next operation of kind k
 *     fails (then fault[k] == 0 again). One request is one operation.
 *
 * Backend choice: io_uring when io_uring_queue_init succeeds, unless the caller asks
 * for the synchronous backend or PKV_NO_URING=1 is in the environment (tests run
 * both backends that way). A kernel or sandbox that refuses io_uring silently gets
 * the synchronous backend; pkvi_io_backend tells which one is in use.
 */
#include "store/io_backend.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct pkvi_io {
    pthread_mutex_t lock;    /* guards every field below during a submission */
    pkvi_uring *uring;       /* NULL: the pread/pwrite backend */
    uint64_t max_chunk;      /* bytes per transfer (tests lower it) */
    _Atomic uint64_t fault[3]; /* countdown per pkvi_fault_kind, 0 = disarmed; atomic, so
                                  a test may arm it from any thread while another one
                                  transfers (the spill file's transfers run outside
                                  the engine lock) */
};

static bool env_no_uring(void)
{
    const char *v = getenv("PKV_NO_URING");
    return v != NULL && strcmp(v, "1") == 0;
}

pkv_status pkvi_io_open(bool force_sync, pkvi_io **out)
{
    if (out == NULL)
        return PKV_EINVAL;
    *out = NULL;
    pkvi_io *io = calloc(1, sizeof *io);
    if (io == NULL)
        return PKV_ENOMEM;
    if (pthread_mutex_init(&io->lock, NULL) != 0) {
        free(io);
        return PKV_ENOMEM;
    }
    io->max_chunk = PKVI_IO_MAX_CHUNK;
    for (int k = 0; k < 3; k++)
        atomic_init(&io->fault[k], 0);
    if (!force_sync && !env_no_uring()) {
        /* Any failure to set up a ring (ENOSYS, EPERM under seccomp, ENOMEM for
         * locked memory) means the synchronous backend, not an error. */
        if (pkvi_uring_create(&io->uring) != 0)
            io->uring = NULL;
    }
    *out = io;
    return PKV_OK;
}

void pkvi_io_close(pkvi_io *io)
{
    if (io == NULL)
        return;
    pkvi_uring_destroy(io->uring);
    pthread_mutex_destroy(&io->lock);
    free(io);
}

const char *pkvi_io_backend(const pkvi_io *io)
{
    if (io == NULL)
        return "none";
    return io->uring != NULL ? "io_uring" : "sync";
}

int pkvi_uring_probe(void)
{
    pkvi_uring *u = NULL;
    int rc = pkvi_uring_create(&u);
    if (rc == 0)
        pkvi_uring_destroy(u);
    return rc;
}

void pkvi_io_limit_transfer(pkvi_io *io, uint64_t max_bytes)
{
    if (io == NULL)
        return;
    io->max_chunk = (max_bytes == 0 || max_bytes > PKVI_IO_MAX_CHUNK) ? PKVI_IO_MAX_CHUNK
                                                                      : max_bytes;
}

void pkvi_io_inject_fault(pkvi_io *io, pkvi_fault_kind kind, uint64_t nth)
{
    if (io == NULL || (unsigned)kind > PKVI_FAULT_FSYNC)
        return;
    atomic_store(&io->fault[kind], nth);
}

/* Count one operation of `kind`; true when it is the one that must fail. */
static bool fault_fires(pkvi_io *io, pkvi_fault_kind kind)
{
    uint64_t n = atomic_load(&io->fault[kind]);
    while (n != 0 && !atomic_compare_exchange_weak(&io->fault[kind], &n, n - 1)) {
    }
    return n == 1;
}

/* ---- the pread/pwrite backend ------------------------------------------------------ */

static pkv_status sync_one(const pkvi_io_req *r, uint64_t max_chunk)
{
    uint64_t done = 0;
    struct iovec v[PKVI_IO_MAX_IOV];
    while (done < r->len) {
        uint32_t n = pkvi_io_window(r, done, max_chunk, v);
        off_t off = (off_t)(r->off + done);
        ssize_t got;
        if (n == 1)
            got = r->write ? pwrite(r->fd, v[0].iov_base, v[0].iov_len, off)
                           : pread(r->fd, v[0].iov_base, v[0].iov_len, off);
        else
            got = r->write ? pwritev(r->fd, v, (int)n, off) : preadv(r->fd, v, (int)n, off);
        if (got < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            return PKV_EIO;
        }
        if (got == 0)   /* end of file on a read; a write that makes no progress */
            return PKV_EIO;
        done += (uint64_t)got;
    }
    return PKV_OK;
}

static pkv_status sync_submit(const pkvi_io_req *reqs, uint32_t n, uint64_t max_chunk)
{
    pkv_status st = PKV_OK;
    /* Keep going after a failure: the contract is "others may have completed", and
     * doing them all makes the outcome independent of the request order. */
    for (uint32_t i = 0; i < n; i++)
        if (sync_one(&reqs[i], max_chunk) != PKV_OK)
            st = PKV_EIO;
    return st;
}

static pkv_status backend_submit(pkvi_io *io, const pkvi_io_req *reqs, uint32_t n)
{
    if (n == 0)
        return PKV_OK;
    if (io->uring != NULL) {
        pkv_status st = pkvi_uring_submit(io->uring, reqs, n, io->max_chunk);
        if (pkvi_uring_broken(io->uring)) {
            /* The ring cannot be trusted any more; the requests of this call
             * failed, later ones go through pread/pwrite. */
            pkvi_uring_destroy(io->uring);
            io->uring = NULL;
        }
        return st;
    }
    return sync_submit(reqs, n, io->max_chunk);
}

/* pkvi_io_submit under io->lock. */
static pkv_status submit_locked(pkvi_io *io, const pkvi_io_req *reqs, uint32_t n);

pkv_status pkvi_io_submit(pkvi_io *io, const pkvi_io_req *reqs, uint32_t n)
{
    if (io == NULL || (n > 0 && reqs == NULL))
        return PKV_EINVAL;
    if (n == 0)
        return PKV_OK;
    for (uint32_t i = 0; i < n; i++) {
        const pkvi_io_req *r = &reqs[i];
        if (r->fd < 0 || r->off + r->len < r->off || r->off > (uint64_t)INT64_MAX ||
            r->off + r->len > (uint64_t)INT64_MAX)
            return PKV_EINVAL;
        if (r->iovcnt == 0 && r->len > 0 && r->buf == NULL)
            return PKV_EINVAL;
        if (r->iovcnt > 0) { /* the segments must exist and add up to len */
            uint64_t sum = 0;
            if (r->iov == NULL || r->iovcnt > PKVI_IO_MAX_IOV)
                return PKV_EINVAL;
            for (uint32_t k = 0; k < r->iovcnt; k++) {
                if (r->iov[k].iov_base == NULL && r->iov[k].iov_len > 0)
                    return PKV_EINVAL;
                sum += r->iov[k].iov_len;
            }
            if (sum != r->len)
                return PKV_EINVAL;
        }
    }

    pthread_mutex_lock(&io->lock);
    const pkv_status st = submit_locked(io, reqs, n);
    pthread_mutex_unlock(&io->lock);
    return st;
}

static pkv_status submit_locked(pkvi_io *io, const pkvi_io_req *reqs, uint32_t n)
{
    /* Fault injection: the armed requests are skipped (they "fail"); every other
     * request is performed, in segments between them. */
    pkv_status st = PKV_OK;
    uint32_t seg = 0;
    for (uint32_t i = 0; i < n; i++) {
        pkvi_fault_kind k = reqs[i].write ? PKVI_FAULT_WRITE : PKVI_FAULT_READ;
        if (!fault_fires(io, k))
            continue;
        if (backend_submit(io, reqs + seg, i - seg) != PKV_OK)
            st = PKV_EIO;
        st = PKV_EIO;
        seg = i + 1;
    }
    if (backend_submit(io, reqs + seg, n - seg) != PKV_OK)
        st = PKV_EIO;
    return st;
}

pkv_status pkvi_io_fsync(pkvi_io *io, int fd)
{
    if (io == NULL || fd < 0)
        return PKV_EINVAL;
    if (fault_fires(io, PKVI_FAULT_FSYNC))
        return PKV_EIO;
    while (fsync(fd) != 0) {
        if (errno != EINTR)
            return PKV_EIO;
    }
    return PKV_OK;
}

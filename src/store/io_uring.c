/*
 * io_uring.c - the io_uring backend of pkvi_io (liburing).
 *
 * Owns: one ring per io object and the bookkeeping of the requests in flight on it.
 * Does not own: backend choice, fault injection, fsync (io.c), file descriptors or
 *   buffers (the caller's), locking (one thread at a time per ring; see io.c).
 *
 * How a request array is performed (pkvi_uring_submit):
 *   - up to PKVI_URING_DEPTH chunks are in flight; a chunk is at most max_chunk bytes
 *     of one request, and each in-flight chunk has a slot that remembers its request
 *     and how many bytes of it have moved;
 *   - new chunks are queued as slots free up and submitted in one io_uring_enter with
 *     the wait for the next completion (io_uring_submit_and_wait): one system call
 *     per batch, and the thread sleeps in the kernel while I/O runs (no polling);
 *   - a completion that moved fewer bytes than asked (a short transfer) is resubmitted
 *     for the rest; -EINTR / -EAGAIN are resubmitted unchanged; any other error, or
 *     zero bytes (end of file on a read), fails that request;
 *   - every request is attempted even after another one failed, and the call returns
 *     only when nothing is in flight, so the caller's buffers are free again.
 *
 * Invariants: in_flight + n_free == DEPTH (a slot is in flight iff it is not on the
 *   free stack); each in-flight slot owns exactly one queued SQE, kernel request or
 *   unreaped CQE, so the DEPTH-entry SQ never overflows. A ring that failed hard
 *   (io_uring_enter error other than EINTR/EAGAIN/EBUSY) is marked broken: what the
 *   kernel holds is drained, and io.c drops the ring for pread/pwrite.
 *
 * Registered buffers and fixed files are not used: no consistent gain, while the
 * callers' buffers (pool pages, save staging) change on every call, so registering
 * them would add a pin/unpin per call. PKVI_URING_DEPTH 64 was never worse than
 * smaller depths and keeps a whole spill batch in few system calls
 * (docs/performance.md, decision table: PKVI_URING_DEPTH).
 */
#include "store/io_backend.h"
#include "pkv_config.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>

#if PKV_HAVE_URING

#include <liburing.h>

/* Memcheck cannot see the kernel write into a buffer when an io_uring read completes
 * (it only models system-call arguments), so every read would look uninitialised
 * under valgrind. Where valgrind's headers exist, the completed bytes are declared
 * defined; outside valgrind the client request is a few no-op instructions. */
#if defined(__has_include)
#if __has_include(<valgrind/memcheck.h>)
#include <valgrind/memcheck.h>
#define MARK_DEFINED(p, n) VALGRIND_MAKE_MEM_DEFINED((p), (n))
#endif
#endif
#ifndef MARK_DEFINED
#define MARK_DEFINED(p, n) ((void)(p), (void)(n))
#endif

typedef struct {
    uint32_t req;       /* index into the caller's request array */
    uint64_t done;      /* bytes of that request already moved */
    uint32_t n_iov;     /* segments of the chunk in flight (vectored requests) */
    struct iovec iov[PKVI_IO_MAX_IOV]; /* read by the kernel until the chunk completes */
} pkvi_uring_slot;

struct pkvi_uring {
    struct io_uring ring;
    bool broken;                          /* a submit failed hard: refuse further use */
    uint32_t n_free;                      /* entries of free_stack in use */
    uint32_t free_stack[PKVI_URING_DEPTH];
    pkvi_uring_slot slots[PKVI_URING_DEPTH];
};

int pkvi_uring_create(pkvi_uring **out)
{
    *out = NULL;
    pkvi_uring *u = calloc(1, sizeof *u);
    if (u == NULL)
        return -ENOMEM;
    int rc = io_uring_queue_init(PKVI_URING_DEPTH, &u->ring, 0);
    if (rc < 0) {
        free(u);
        return rc;
    }
    *out = u;
    return 0;
}

void pkvi_uring_destroy(pkvi_uring *u)
{
    if (u == NULL)
        return;
    io_uring_queue_exit(&u->ring);
    free(u);
}

/* Queue the next chunk of slot s's request. false when no SQE could be had even
 * after flushing the queue to the kernel (a broken ring). */
static bool queue_chunk(pkvi_uring *u, uint32_t s, const pkvi_io_req *reqs,
                        uint64_t max_chunk)
{
    const pkvi_io_req *r = &reqs[u->slots[s].req];
    struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
    if (sqe == NULL) {
        /* Cannot happen while the invariant holds; be safe rather than stuck. */
        if (io_uring_submit(&u->ring) < 0)
            return false;
        sqe = io_uring_get_sqe(&u->ring);
        if (sqe == NULL)
            return false;
    }
    pkvi_uring_slot *sl = &u->slots[s];
    uint64_t done = sl->done;
    sl->n_iov = pkvi_io_window(r, done, max_chunk, sl->iov);
    if (sl->n_iov == 1) {
        if (r->write)
            io_uring_prep_write(sqe, r->fd, sl->iov[0].iov_base,
                                (unsigned)sl->iov[0].iov_len, r->off + done);
        else
            io_uring_prep_read(sqe, r->fd, sl->iov[0].iov_base,
                               (unsigned)sl->iov[0].iov_len, r->off + done);
    } else if (r->write) {
        io_uring_prep_writev(sqe, r->fd, sl->iov, sl->n_iov, r->off + done);
    } else {
        io_uring_prep_readv(sqe, r->fd, sl->iov, sl->n_iov, r->off + done);
    }
    io_uring_sqe_set_data64(sqe, s);
    return true;
}

/* Wait for and retire every chunk the kernel still owns (SQEs it has consumed),
 * starting nothing new: used once the ring can no longer be trusted. */
static void drain(pkvi_uring *u, uint32_t in_flight)
{
    uint32_t owned = in_flight - io_uring_sq_ready(&u->ring);
    while (owned > 0) {
        struct io_uring_cqe *cqe = NULL;
        int rc = io_uring_wait_cqe(&u->ring, &cqe);
        if (rc == -EINTR || rc == -EAGAIN)
            continue;
        if (rc < 0)
            return;   /* nothing more can be learnt; io.c drops this ring */
        io_uring_cqe_seen(&u->ring, cqe);
        owned--;
    }
}

/* A transient -EAGAIN with nothing in flight to reap: retry this many times,
 * AGAIN_WAIT_NS apart, before declaring the ring unusable. */
#define AGAIN_RETRIES 100
#define AGAIN_WAIT_NS 1000000

pkv_status pkvi_uring_submit(pkvi_uring *u, const pkvi_io_req *reqs, uint32_t n,
                             uint64_t max_chunk)
{
    if (u->broken)
        return PKV_EIO;
    if (max_chunk == 0 || max_chunk > PKVI_IO_MAX_CHUNK)
        max_chunk = PKVI_IO_MAX_CHUNK;

    u->n_free = PKVI_URING_DEPTH;
    for (uint32_t i = 0; i < PKVI_URING_DEPTH; i++)
        u->free_stack[i] = PKVI_URING_DEPTH - 1 - i;

    bool failed = false;
    uint32_t next = 0;       /* next request not yet started */
    uint32_t in_flight = 0;  /* slots owning a queued SQE, a kernel request or a CQE */
    uint32_t again = 0;
    for (;;) {
        while (next < n && u->n_free > 0) {
            if (reqs[next].len == 0) {
                next++;
                continue;
            }
            uint32_t s = u->free_stack[--u->n_free];
            u->slots[s].req = next++;
            u->slots[s].done = 0;
            if (!queue_chunk(u, s, reqs, max_chunk)) {
                u->free_stack[u->n_free++] = s;
                goto broken;
            }
            in_flight++;
        }
        if (in_flight == 0)
            break;

        /* Flush queued SQEs and sleep until at least one completion. */
        int rc = io_uring_submit_and_wait(&u->ring, 1);
        if (rc == -EINTR)
            continue;   /* queued SQEs stay queued; enter again */
        if (rc == -EAGAIN || rc == -EBUSY) {
            /* Out of kernel resources: reap what is in flight, or wait and retry. */
            if (in_flight == io_uring_sq_ready(&u->ring)) {
                if (++again > AGAIN_RETRIES)
                    goto broken;
                struct timespec ts = {0, AGAIN_WAIT_NS};
                nanosleep(&ts, NULL);
                continue;
            }
        } else if (rc < 0) {
            goto broken;
        }
        again = 0;

        struct io_uring_cqe *cqe = NULL;
        rc = io_uring_wait_cqe(&u->ring, &cqe);
        if (rc == -EINTR || rc == -EAGAIN)
            continue;
        if (rc < 0)
            goto broken;
        /* Retire everything that is ready, not only the one we waited for. */
        do {
            uint32_t s = (uint32_t)io_uring_cqe_get_data64(cqe);
            int res = cqe->res;
            io_uring_cqe_seen(&u->ring, cqe);
            const pkvi_io_req *r = &reqs[u->slots[s].req];
            bool requeue = false;
            if (res == -EINTR || res == -EAGAIN) {
                requeue = true;
            } else if (res <= 0) {
                failed = true;   /* an error, or EOF / no progress */
            } else {
                if (!r->write) {
                    uint64_t left = (uint64_t)res;
                    for (uint32_t k = 0; k < u->slots[s].n_iov && left; k++) {
                        size_t m = u->slots[s].iov[k].iov_len < left
                                       ? u->slots[s].iov[k].iov_len : (size_t)left;
                        MARK_DEFINED(u->slots[s].iov[k].iov_base, m);
                        left -= m;
                    }
                }
                u->slots[s].done += (uint64_t)res;
                requeue = u->slots[s].done < r->len;
            }
            if (requeue) {
                if (queue_chunk(u, s, reqs, max_chunk))
                    continue;
                u->free_stack[u->n_free++] = s;
                in_flight--;
                goto broken;
            }
            u->free_stack[u->n_free++] = s;
            in_flight--;
        } while (io_uring_peek_cqe(&u->ring, &cqe) == 0);
    }
    return failed ? PKV_EIO : PKV_OK;

broken:
    /* SQEs still queued may point at the caller's buffers: this ring is never entered
     * again (io.c switches the io object to pread/pwrite). */
    u->broken = true;
    drain(u, in_flight);
    return PKV_EIO;
}

bool pkvi_uring_broken(const pkvi_uring *u)
{
    return u != NULL && u->broken;
}

#else /* !PKV_HAVE_URING */

/* Built without liburing: the backend always reports itself unavailable, and io.c
 * uses pread/pwrite. */
int pkvi_uring_create(pkvi_uring **out)
{
    *out = NULL;
    return -ENOSYS;
}

void pkvi_uring_destroy(pkvi_uring *u)
{
    (void)u;
}

pkv_status pkvi_uring_submit(pkvi_uring *u, const pkvi_io_req *reqs, uint32_t n,
                             uint64_t max_chunk)
{
    (void)u;
    (void)reqs;
    (void)n;
    (void)max_chunk;
    return PKV_EIO;
}

bool pkvi_uring_broken(const pkvi_uring *u)
{
    (void)u;
    return false;
}

#endif /* PKV_HAVE_URING */

/*
 * io.h - the I/O interface of spill and persistence: batched, vectored requests on
 * io_uring, or on pread/pwrite where io_uring is refused (io.c, io_uring.c).
 *
 * Owns a ring (or none) per io object; no global state. Short transfers are resumed;
 * a request either completes whole or the batch reports PKV_EIO. One io object is used
 * by one thread at a time (the spill file's under its own `io` lock, spill.h); no lock
 * of its own.
 * The backends behind it share store/io_backend.h, and nothing else does.
 */
#ifndef PAGEDKV_IO_H
#define PAGEDKV_IO_H

#include "base/util.h"

#include <sys/uio.h>

typedef struct pkvi_io pkvi_io;
/* Segments of one vectored request at most (bounds per-request scratch in the rings). */
#define PKVI_IO_MAX_IOV 64u
typedef struct {
    bool write;        /* pwrite when true, pread otherwise */
    int fd;
    void *buf;         /* the one buffer, unless iovcnt > 0 */
    uint64_t len;      /* bytes (with iov: their sum); short transfers are retried */
    uint64_t off;      /* file offset */
    const struct iovec *iov; /* iovcnt > 0: gather/scatter segments instead of buf */
    uint32_t iovcnt;         /* 0, or 1..PKVI_IO_MAX_IOV */
} pkvi_io_req;
/* The segments of r covering bytes [done, done + min(max, len - done)) of the request
 * (a single buffer is one segment); returns their count (<= PKVI_IO_MAX_IOV). */
PKVI_HIDDEN uint32_t pkvi_io_window(const pkvi_io_req *r, uint64_t done, uint64_t max,
                                    struct iovec *out);
typedef enum { PKVI_FAULT_READ = 0, PKVI_FAULT_WRITE, PKVI_FAULT_FSYNC } pkvi_fault_kind;

/* io_uring unless force_sync or PKV_NO_URING=1 or the kernel refuses it. */
PKVI_HIDDEN pkv_status pkvi_io_open(bool force_sync, pkvi_io **out);
PKVI_HIDDEN void pkvi_io_close(pkvi_io *io);
PKVI_HIDDEN const char *pkvi_io_backend(const pkvi_io *io);   /* "io_uring" | "sync" */
/* Perform all n requests (batched); PKV_EIO if any failed (others may have completed). */
PKVI_HIDDEN pkv_status pkvi_io_submit(pkvi_io *io, const pkvi_io_req *reqs, uint32_t n);
PKVI_HIDDEN pkv_status pkvi_io_fsync(pkvi_io *io, int fd);

/* Requests in flight at once on one ring (its SQ and CQ size); callers that gather
 * batches (save) size them by it, so one batch is one submission. See io_uring.c for
 * why this depth. */
#define PKVI_URING_DEPTH 64u

/* ---- test hooks (per io object, never global) ------------------------------------ */

/* Make the nth (1-based) future operation of `kind` fail with EIO (0 disarms). Safe
 * from any thread, also while another one submits. */
PKVI_HIDDEN void pkvi_io_inject_fault(pkvi_io *io, pkvi_fault_kind kind, uint64_t nth);
/* Cap every single transfer (pread/pwrite call or SQE) of io at max_bytes (0: the
 * default), so tests drive the short-transfer path. */
PKVI_HIDDEN void pkvi_io_limit_transfer(pkvi_io *io, uint64_t max_bytes);
/* Whether this process can set up io_uring: 0, or the negative errno that says why
 * not (-ENOSYS: built without liburing). Ignores PKV_NO_URING. */
PKVI_HIDDEN int pkvi_uring_probe(void);

#endif /* PAGEDKV_IO_H */

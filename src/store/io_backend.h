/*
 * io_backend.h - the two I/O backends behind pkvi_io (io.h), as io.c and io_uring.c
 * share them: the io_uring ring's calls, and the transfer limit both backends cut
 * requests at. Nothing else includes it.
 *
 * Owns: nothing at run time; it only declares. A ring belongs to one io object
 * (io.c), which one thread uses at a time; no lock of its own.
 */
#ifndef PAGEDKV_IO_BACKEND_H
#define PAGEDKV_IO_BACKEND_H

#include "store/io.h"

/* Largest transfer handed to one pread/pwrite or one SQE. Linux moves at most
 * 0x7ffff000 bytes per call and an SQE length is 32 bits; 1 GiB keeps every chunk
 * well inside both. Anything longer is transferred as several chunks. */
#define PKVI_IO_MAX_CHUNK (1ull << 30)

typedef struct pkvi_uring pkvi_uring;

/* Set up a ring. 0, or a negative errno (-ENOSYS when built without liburing, or what
 * io_uring_queue_init said: -EPERM in a sandbox that forbids it, -ENOMEM, ...). */
PKVI_HIDDEN int pkvi_uring_create(pkvi_uring **out);
PKVI_HIDDEN void pkvi_uring_destroy(pkvi_uring *u);
/* Perform reqs[0..n) completely; every chunk is at most max_chunk bytes (short
 * transfers are resumed). Returns PKV_OK, or PKV_EIO when any request failed; all
 * submitted requests have completed (or failed) before it returns, so the caller's
 * buffers are free again. */
PKVI_HIDDEN pkv_status pkvi_uring_submit(pkvi_uring *u, const pkvi_io_req *reqs,
                                         uint32_t n, uint64_t max_chunk);
/* Whether the ring failed in a way that forbids entering it again (a hard
 * io_uring_enter error): io.c then drops it and continues with pread/pwrite. */
PKVI_HIDDEN bool pkvi_uring_broken(const pkvi_uring *u);

#endif /* PAGEDKV_IO_BACKEND_H */

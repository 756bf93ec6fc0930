/*
 * persist/format.c - the out-of-line half of persist/format.h: the magic, the file's
 * dtype codes, aligned buffers and the one bounded transfer that the session file's
 * writer (persist/save.c) and reader (persist/load.c) both use.
 *
 * Owns: the dtype code table (fixed codes of docs/file-format.md, not the C enum) and
 *   how a transfer is cut into requests. Does not own: any file's contents or checks
 *   (persist/save.c, persist/load.c), the I/O backends (io.c, io_uring.c).
 *
 * Invariant: a transfer is whole or PKV_EIO; every request is at most REQ_BYTES.
 */
#include "persist/format.h"

#include <stdlib.h>

const unsigned char pkvi_sfile_magic[8] = {0x89, 'P', 'K', 'V', '\r', '\n', 0x1a, '\n'};

/* Reads and writes are cut into requests of this size so io_uring keeps several in
 * flight. */
#define REQ_BYTES (1ull << 20)

bool pkvi_sfile_dtype_code(pkv_dtype t, uint32_t *code)
{
    switch (t) {
    case PKV_F32: *code = 0; return true;
    case PKV_F16: *code = 1; return true;
    case PKV_BF16: *code = 2; return true;
    case PKV_Q8: *code = 3; return true; /* version 2 on */
    case PKV_Q4: *code = 4; return true;
    }
    return false;
}

pkv_dtype pkvi_sfile_code_dtype(uint32_t code)
{
    static const pkv_dtype t[] = {PKV_F32, PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};
    return t[code < 5 ? code : 0];
}

void *pkvi_sfile_alloc(uint64_t bytes)
{
    if (bytes == 0 || bytes > SIZE_MAX - PKVI_SFILE_ALIGN)
        return NULL;
    return aligned_alloc(PKVI_SFILE_ALIGN, (size_t)pkvi_align_up(bytes, PKVI_SFILE_ALIGN));
}

/* One contiguous transfer, cut into REQ_BYTES requests submitted together. */
pkv_status pkvi_sfile_transfer(pkvi_io *io, bool write, int fd, void *buf, uint64_t len,
                               uint64_t off)
{
    enum { MAXR = 64 };
    pkvi_io_req reqs[MAXR];
    uint64_t done = 0;
    while (done < len) {
        uint32_t n = 0;
        while (n < MAXR && done < len) {
            uint64_t want = len - done < REQ_BYTES ? len - done : REQ_BYTES;
            reqs[n++] = (pkvi_io_req){.write = write, .fd = fd, .buf = (char *)buf + done,
                                      .len = want, .off = off + done};
            done += want;
        }
        if (pkvi_io_submit(io, reqs, n) != PKV_OK)
            return PKV_EIO;
    }
    return PKV_OK;
}

/*
 * io_window.c - the segments of one I/O request that a transfer of at most `max`
 * bytes covers, from byte `done` on. Both backends (io.c's pread/pwrite, io_uring.c's
 * SQEs) resume short transfers through it, so it sits below both of them and neither
 * calls the other for it.
 */
#include "store/io.h"

uint32_t pkvi_io_window(const pkvi_io_req *r, uint64_t done, uint64_t max,
                        struct iovec *out)
{
    uint64_t want = r->len - done < max ? r->len - done : max;
    if (r->iovcnt == 0) {
        out[0].iov_base = (char *)r->buf + done;
        out[0].iov_len = (size_t)want;
        return 1;
    }
    uint32_t n = 0;
    uint64_t skip = done;
    for (uint32_t k = 0; k < r->iovcnt && want > 0; k++) {
        uint64_t seg = r->iov[k].iov_len;
        if (skip >= seg) {
            skip -= seg;
            continue;
        }
        uint64_t take = seg - skip < want ? seg - skip : want;
        out[n].iov_base = (char *)r->iov[k].iov_base + skip;
        out[n].iov_len = (size_t)take;
        n++;
        want -= take;
        skip = 0;
    }
    return n;
}

/*
 * test_io.c - the I/O layer (io.c, io_uring.c) and CRC-32C (crc32c.c).
 *
 * Every I/O test runs once per backend: test case "sync" (pread/pwrite) and test case
 * "io_uring". Where io_uring cannot be set up (old kernel, seccomp sandbox, a build
 * without liburing, PKV_NO_URING=1) the io_uring case is left out with the reason on
 * stderr; if it was the only case asked for (CK_RUN_CASE=io_uring) the binary exits
 * 77, the skip code, never a silent pass.
 *
 * References are independent of the code under test: file contents are checked with
 * plain pread, CRCs against a bitwise (one bit per step) implementation written here.
 */
#include "testutil.h"
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

/* The backend of the current test case (set by an unchecked fixture, before fork). */
static bool g_uring;

static void use_sync(void) { g_uring = false; }
static void use_uring(void) { g_uring = true; }

static pkvi_io *open_io(void)
{
    pkvi_io *io = NULL;
    ck_assert_int_eq(pkvi_io_open(!g_uring, &io), PKV_OK);
    ck_assert_str_eq(pkvi_io_backend(io), g_uring ? "io_uring" : "sync");
    return io;
}

/* An anonymous temporary file (unlinked at once). */
static int tmp_fd(void)
{
    return pkvt_tmp_fd();
}

/* Read the file's bytes [off, off+len) with plain pread: the independent reference. */
static void file_bytes(int fd, void *buf, size_t len, off_t off)
{
    size_t done = 0;
    while (done < len) {
        ssize_t got = pread(fd, (char *)buf + done, len - done, off + (off_t)done);
        ck_assert_msg(got > 0, "reference pread: %zd (%s)", got, strerror(errno));
        done += (size_t)got;
    }
}

static void fill_bytes(pkvt_rng *r, unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(pkvt_next(r) >> 56);
}

/* ---- CRC-32C ------------------------------------------------------------------------- */

static uint32_t crc_bitwise(const unsigned char *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int b = 0; b < 8; b++)
            c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
    }
    return ~c;
}

START_TEST(crc_vectors)
{
    ck_assert_uint_eq(pkvi_crc32c(0, "123456789", 9), 0xe3069283u);
    ck_assert_uint_eq(pkvi_crc32c_sw(0, "123456789", 9), 0xe3069283u);
    ck_assert_uint_eq(pkvi_crc32c(0, "", 0), 0);
    /* RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xff, ascending 0..31. */
    unsigned char b[32];
    memset(b, 0, sizeof b);
    ck_assert_uint_eq(pkvi_crc32c(0, b, 32), 0x8a9136aau);
    memset(b, 0xff, sizeof b);
    ck_assert_uint_eq(pkvi_crc32c(0, b, 32), 0x62a8ab43u);
    for (int i = 0; i < 32; i++)
        b[i] = (unsigned char)i;
    ck_assert_uint_eq(pkvi_crc32c(0, b, 32), 0x46dd794eu);
}
END_TEST

/* The slicing tables (generated from the polynomial by src/store/gen_crc32c.c) against the
 * bitwise definition: one nonzero byte at every position of one and two 8-byte
 * blocks, every value, reaches every entry of all eight tables. */
START_TEST(crc_every_table_entry)
{
    unsigned char b[16];
    for (size_t len = 8; len <= 16; len += 8)
        for (size_t pos = 0; pos < len; pos++)
            for (unsigned v = 0; v < 256; v++) {
                memset(b, 0, sizeof b);
                b[pos] = (unsigned char)v;
                ck_assert_msg(pkvi_crc32c_sw(0, b, len) == crc_bitwise(b, len),
                              "sw crc of %zu bytes with 0x%02x at %zu", len, v, pos);
            }
}
END_TEST

/* The SSE4.2 crc32 path (test case "crc32c_hw": meson registers it on x86-64, where it
 * is a SKIP on a CPU without SSE4.2). */
START_TEST(crc_hw_vs_bitwise)
{
    ck_assert_uint_eq(pkvi_crc32c_hw(0, "123456789", 9), 0xe3069283u);
    uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x42);
    enum { MAX = 600 };
    unsigned char buf[MAX + 8];
    int cases = pkvt_quick() ? 200 : 3000;
    for (int t = 0; t < cases; t++) {
        size_t off = pkvt_below(&r, 8), n = pkvt_below(&r, MAX + 1);
        fill_bytes(&r, buf, sizeof buf);
        ck_assert_msg(pkvi_crc32c_hw(0, buf + off, n) == crc_bitwise(buf + off, n),
                      "hw n=%zu off=%zu seed=%llu", n, off, (unsigned long long)seed);
    }
}
END_TEST

START_TEST(crc_random_vs_bitwise)
{
    uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    enum { MAX = 600 };
    unsigned char buf[MAX + 8];
    int cases = pkvt_quick() ? 200 : 3000;
    for (int t = 0; t < cases; t++) {
        size_t off = pkvt_below(&r, 8), n = pkvt_below(&r, MAX + 1);
        fill_bytes(&r, buf, sizeof buf);
        uint32_t want = crc_bitwise(buf + off, n);
        ck_assert_msg(pkvi_crc32c_sw(0, buf + off, n) == want, "sw n=%zu off=%zu seed=%llu",
                      n, off, (unsigned long long)seed);
        ck_assert_uint_eq(pkvi_crc32c(0, buf + off, n), want);
        /* Chaining: crc(crc(a), b) == crc(a || b). */
        size_t cut = n ? pkvt_below(&r, (uint32_t)n + 1) : 0;
        ck_assert_msg(pkvi_crc32c(pkvi_crc32c(0, buf + off, cut), buf + off + cut, n - cut) ==
                          want, "chain n=%zu cut=%zu seed=%llu", n, cut,
                      (unsigned long long)seed);
    }
}
END_TEST

/* ---- both backends ------------------------------------------------------------------- */

START_TEST(backend_choice)
{
    pkvi_io *io = NULL;
    ck_assert_int_eq(pkvi_io_open(true, &io), PKV_OK);
    ck_assert_str_eq(pkvi_io_backend(io), "sync");
    pkvi_io_close(io);
    setenv("PKV_NO_URING", "1", 1);
    ck_assert_int_eq(pkvi_io_open(false, &io), PKV_OK);
    ck_assert_str_eq(pkvi_io_backend(io), "sync");
    pkvi_io_close(io);
    unsetenv("PKV_NO_URING");
    ck_assert_int_eq(pkvi_io_open(false, &io), PKV_OK);
    ck_assert_str_eq(pkvi_io_backend(io), pkvi_uring_probe() == 0 ? "io_uring" : "sync");
    pkvi_io_close(io);
    ck_assert_int_eq(pkvi_io_open(false, NULL), PKV_EINVAL);
    ck_assert_str_eq(pkvi_io_backend(NULL), "none");
    pkvi_io_close(NULL);
}
END_TEST

/* Many buffers of random sizes at random, disjoint offsets, submitted in an order
 * unrelated to their offsets, more requests than the ring holds at once. */
static void roundtrip_many(uint64_t max_chunk, uint32_t n, uint32_t big, uint32_t small)
{
    uint64_t seed = pkvt_seed() ^ max_chunk;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    pkvi_io *io = open_io();
    pkvi_io_limit_transfer(io, max_chunk);
    int fd = tmp_fd();
    if (pkvt_quick())
        n = n / 8 + 1;
    pkvi_io_req *w = pkvt_alloc(n * sizeof *w), *rd = pkvt_alloc(n * sizeof *rd);
    uint32_t *order = pkvt_alloc(n * sizeof *order);
    uint64_t off = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = 1 + pkvt_below(&r, i % 10 == 0 ? big : small);
        off += pkvt_below(&r, 5000);               /* a hole before it */
        w[i] = (pkvi_io_req){.write = true, .fd = fd, .buf = pkvt_alloc(len), .len = len, .off = off};
        fill_bytes(&r, w[i].buf, len);
        rd[i] = (pkvi_io_req){.write = false, .fd = fd, .buf = pkvt_alloc(len), .len = len, .off = off};
        memset(rd[i].buf, 0xa5, len);
        off += len;
        order[i] = i;
    }
    for (uint32_t i = n - 1; i > 0; i--) {         /* shuffle the submission order */
        uint32_t j = pkvt_below(&r, i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    pkvi_io_req *ws = pkvt_alloc(n * sizeof *ws), *rs = pkvt_alloc(n * sizeof *rs);
    for (uint32_t i = 0; i < n; i++) {
        ws[i] = w[order[i]];
        rs[i] = rd[order[(i + 7) % n]];
    }
    ck_assert_int_eq(pkvi_io_submit(io, ws, n), PKV_OK);
    for (uint32_t i = 0; i < n; i++) {
        unsigned char *ref = pkvt_alloc(w[i].len);
        file_bytes(fd, ref, w[i].len, (off_t)w[i].off);
        ck_assert_msg(memcmp(ref, w[i].buf, w[i].len) == 0,
                      "file differs at request %u (chunk %llu, seed %llu)", i,
                      (unsigned long long)max_chunk, (unsigned long long)seed);
        free(ref);
    }
    ck_assert_int_eq(pkvi_io_submit(io, rs, n), PKV_OK);
    for (uint32_t i = 0; i < n; i++) {
        ck_assert_msg(memcmp(rd[i].buf, w[i].buf, w[i].len) == 0,
                      "read-back differs at request %u (chunk %llu, seed %llu)", i,
                      (unsigned long long)max_chunk, (unsigned long long)seed);
        free(w[i].buf);
        free(rd[i].buf);
    }
    free(w);
    free(rd);
    free(ws);
    free(rs);
    free(order);
    close(fd);
    pkvi_io_close(io);
}

START_TEST(batched_roundtrip) { roundtrip_many(0, 300, 300000, 9000); }
END_TEST

/* Every transfer capped: each request completes through many partial transfers. */
START_TEST(short_transfers)
{
    roundtrip_many(1, 12, 3000, 300);          /* one byte per transfer */
    roundtrip_many(4093, 100, 300000, 9000);
    roundtrip_many(65536 + 17, 100, 300000, 9000);
}
END_TEST

/* A read that crosses the end of the file gets a short transfer, then 0 bytes:
 * that is an error, never a silent short read. Other requests still complete. */
START_TEST(read_past_eof)
{
    pkvi_io *io = open_io();
    int fd = tmp_fd();
    unsigned char data[10000], back[10000], other[100];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (unsigned char)(i * 31 + 7);
    ck_assert_int_eq((int)pwrite(fd, data, sizeof data, 0), (int)sizeof data);
    memset(back, 0, sizeof back);
    pkvi_io_req r1 = {.write = false, .fd = fd, .buf = back, .len = sizeof back, .off = 5000};  /* 5000 bytes exist */
    ck_assert_int_eq(pkvi_io_submit(io, &r1, 1), PKV_EIO);
    pkvi_io_req two[2] = {{.write = false, .fd = fd, .buf = back, .len = 20, .off = 100000}, {.write = false, .fd = fd, .buf = other, .len = 100, .off = 200}};
    ck_assert_int_eq(pkvi_io_submit(io, two, 2), PKV_EIO);
    ck_assert(memcmp(other, data + 200, 100) == 0);
    pkvi_io_req r2 = {.write = false, .fd = fd, .buf = back, .len = 5000, .off = 5000};         /* exactly up to EOF */
    ck_assert_int_eq(pkvi_io_submit(io, &r2, 1), PKV_OK);
    ck_assert(memcmp(back, data + 5000, 5000) == 0);
    close(fd);
    pkvi_io_close(io);
}
END_TEST

/* A write that the file-size limit cuts short: the first transfer moves part of the
 * data, the next fails with EFBIG. The bytes that made it must be right, the call
 * must report EIO. Runs in a child so the limit cannot leak into other tests. */
START_TEST(short_write_then_error)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        signal(SIGXFSZ, SIG_IGN);
        int fd = tmp_fd();
        struct rlimit rl = {300000, RLIM_INFINITY};
        if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
            _exit(3);
        pkvi_io *io = NULL;
        if (pkvi_io_open(!g_uring, &io) != PKV_OK)
            _exit(4);
        size_t n = 1 << 20;
        unsigned char *buf = malloc(n), *back = malloc(300000);
        for (size_t i = 0; i < n; i++)
            buf[i] = (unsigned char)(i ^ (i >> 9));
        pkvi_io_req w = {.write = true, .fd = fd, .buf = buf, .len = n, .off = 0};
        if (pkvi_io_submit(io, &w, 1) != PKV_EIO)
            _exit(5);
        if (pread(fd, back, 300000, 0) != 300000 || memcmp(back, buf, 300000) != 0)
            _exit(6);
        pkvi_io_close(io);
        free(buf);
        free(back);
        close(fd);
        _exit(0);
    }
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "child failed: status %d", status);
}
END_TEST

/* The nth future operation of a kind fails, exactly that one, once. */
START_TEST(fault_exact_nth)
{
    pkvi_io *io = open_io();
    int fd = tmp_fd();
    enum { N = 6, LEN = 4096 };
    static unsigned char bufs[N][LEN], back[N][LEN];
    for (int i = 0; i < N; i++)
        memset(bufs[i], 'a' + i, LEN);

    /* Single writes: ops 1, 2 pass, 3 fails, 4.. pass (the fault is one-shot). */
    pkvi_io_inject_fault(io, PKVI_FAULT_WRITE, 3);
    for (int i = 0; i < N; i++) {
        pkvi_io_req w = {.write = true, .fd = fd, .buf = bufs[i], .len = LEN, .off = (uint64_t)i * LEN};
        ck_assert_int_eq(pkvi_io_submit(io, &w, 1), i == 2 ? PKV_EIO : PKV_OK);
    }
    unsigned char ref[LEN], zero[LEN];
    memset(zero, 0, LEN);
    for (int i = 0; i < N; i++) {
        file_bytes(fd, ref, LEN, (off_t)i * LEN);
        ck_assert(memcmp(ref, i == 2 ? zero : bufs[i], LEN) == 0);
    }

    /* In one batch: the 4th request fails, every other one completes. */
    int fd2 = tmp_fd();
    pkvi_io_req ws[N];
    for (int i = 0; i < N; i++)
        ws[i] = (pkvi_io_req){.write = true, .fd = fd2, .buf = bufs[i], .len = LEN, .off = (uint64_t)i * LEN};
    pkvi_io_inject_fault(io, PKVI_FAULT_WRITE, 4);
    ck_assert_int_eq(pkvi_io_submit(io, ws, N), PKV_EIO);
    for (int i = 0; i < N; i++) {
        file_bytes(fd2, ref, LEN, (off_t)i * LEN);
        ck_assert_msg(memcmp(ref, i == 3 ? zero : bufs[i], LEN) == 0, "region %d", i);
    }
    ck_assert_int_eq(pkvi_io_submit(io, ws, N), PKV_OK);  /* disarmed after firing */

    /* Reads: the 2nd read of a batch fails and leaves its buffer alone. */
    pkvi_io_req rs[N];
    for (int i = 0; i < N; i++) {
        memset(back[i], 0x5a, LEN);
        rs[i] = (pkvi_io_req){.write = false, .fd = fd2, .buf = back[i], .len = LEN, .off = (uint64_t)i * LEN};
    }
    pkvi_io_inject_fault(io, PKVI_FAULT_READ, 2);
    ck_assert_int_eq(pkvi_io_submit(io, rs, N), PKV_EIO);
    unsigned char untouched[LEN];
    memset(untouched, 0x5a, LEN);
    for (int i = 0; i < N; i++)
        ck_assert_msg(memcmp(back[i], i == 1 ? untouched : bufs[i], LEN) == 0, "read %d", i);

    /* Disarm with 0; reads and writes count separately. */
    pkvi_io_inject_fault(io, PKVI_FAULT_READ, 1);
    pkvi_io_inject_fault(io, PKVI_FAULT_READ, 0);
    pkvi_io_inject_fault(io, PKVI_FAULT_WRITE, 1);
    ck_assert_int_eq(pkvi_io_submit(io, rs, 1), PKV_OK);
    ck_assert_int_eq(pkvi_io_submit(io, ws, 1), PKV_EIO);

    /* fsync: 1 passes, 2 fails, 3 passes. */
    pkvi_io_inject_fault(io, PKVI_FAULT_FSYNC, 2);
    ck_assert_int_eq(pkvi_io_fsync(io, fd), PKV_OK);
    ck_assert_int_eq(pkvi_io_fsync(io, fd), PKV_EIO);
    ck_assert_int_eq(pkvi_io_fsync(io, fd), PKV_OK);

    /* Faults belong to one io object. */
    pkvi_io *other = open_io();
    pkvi_io_inject_fault(io, PKVI_FAULT_WRITE, 1);
    ck_assert_int_eq(pkvi_io_submit(other, ws, 1), PKV_OK);
    pkvi_io_close(other);
    close(fd);
    close(fd2);
    pkvi_io_close(io);
}
END_TEST

START_TEST(bad_requests)
{
    pkvi_io *io = open_io();
    unsigned char b[16] = {0};
    int fd = tmp_fd();
    pkvi_io_req ok = {.write = true, .fd = fd, .buf = b, .len = sizeof b, .off = 0};
    ck_assert_int_eq(pkvi_io_submit(NULL, &ok, 1), PKV_EINVAL);
    ck_assert_int_eq(pkvi_io_submit(io, NULL, 1), PKV_EINVAL);
    ck_assert_int_eq(pkvi_io_submit(io, NULL, 0), PKV_OK);
    pkvi_io_req bad = {.write = true, .fd = -1, .buf = b, .len = sizeof b, .off = 0};
    ck_assert_int_eq(pkvi_io_submit(io, &bad, 1), PKV_EINVAL);
    bad = (pkvi_io_req){.write = true, .fd = fd, .buf = NULL, .len = 5, .off = 0};
    ck_assert_int_eq(pkvi_io_submit(io, &bad, 1), PKV_EINVAL);
    bad = (pkvi_io_req){.write = true, .fd = fd, .buf = b, .len = 16, .off = UINT64_MAX - 4};
    ck_assert_int_eq(pkvi_io_submit(io, &bad, 1), PKV_EINVAL);
    pkvi_io_req empty = {.write = true, .fd = fd, .buf = NULL, .len = 0, .off = 0};
    ck_assert_int_eq(pkvi_io_submit(io, &empty, 1), PKV_OK);
    ck_assert_int_eq(pkvi_io_fsync(io, -1), PKV_EINVAL);
    ck_assert_int_eq(pkvi_io_fsync(NULL, fd), PKV_EINVAL);

    /* A closed descriptor: the system says no, the call says EIO. */
    int dead = tmp_fd();
    close(dead);
    pkvi_io_req rd = {.write = false, .fd = dead, .buf = b, .len = sizeof b, .off = 0};
    ck_assert_int_eq(pkvi_io_submit(io, &rd, 1), PKV_EIO);
    /* A read-only descriptor of the same file: EBADF becomes EIO. */
    char self[64];
    snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
    int ro = open(self, O_RDONLY);
    ck_assert_int_ge(ro, 0);
    pkvi_io_req rw = {.write = true, .fd = ro, .buf = b, .len = sizeof b, .off = 0};
    ck_assert_int_eq(pkvi_io_submit(io, &rw, 1), PKV_EIO);
    close(ro);
    /* The io object stays usable after errors. */
    ck_assert_int_eq(pkvi_io_submit(io, &ok, 1), PKV_OK);
    close(fd);
    pkvi_io_close(io);
}
END_TEST

/* Vectored requests: segments of random sizes written in one request, read back with
 * a different segmentation, with transfers capped so windows cut segments anywhere;
 * also the validation of bad segment lists. */
static void vectored(uint64_t max_chunk)
{
    uint64_t seed = pkvt_seed() ^ (max_chunk * 31 + 7);
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    pkvi_io *io = open_io();
    pkvi_io_limit_transfer(io, max_chunk);
    int fd = tmp_fd();
    const int rounds = pkvt_quick() ? 3 : 40;
    for (int round = 0; round < rounds; round++) {
        uint32_t nw = 1 + pkvt_below(&r, PKVI_IO_MAX_IOV), nr = 1 + pkvt_below(&r, 16);
        struct iovec wv[PKVI_IO_MAX_IOV], rv[16];
        uint64_t total = 0;
        for (uint32_t k = 0; k < nw; k++) {
            size_t len = 1 + pkvt_below(&r, 9000);
            wv[k].iov_base = pkvt_alloc(len);
            wv[k].iov_len = len;
            fill_bytes(&r, wv[k].iov_base, len);
            total += len;
        }
        unsigned char *flat = pkvt_alloc(total), *back = pkvt_alloc(total);
        for (uint64_t k = 0, o = 0; k < nw; o += wv[k].iov_len, k++)
            memcpy(flat + o, wv[k].iov_base, wv[k].iov_len);
        /* the read side: nr segments over the same bytes, cut at random points */
        uint64_t cut[17];
        cut[0] = 0;
        cut[nr] = total;
        for (uint32_t k = 1; k < nr; k++)
            cut[k] = pkvt_below(&r, (uint32_t)total + 1);
        for (uint32_t a = 1; a < nr; a++) /* sort the cuts */
            for (uint32_t b = a; b > 1 && cut[b] < cut[b - 1]; b--) {
                uint64_t t = cut[b];
                cut[b] = cut[b - 1];
                cut[b - 1] = t;
            }
        for (uint32_t k = 0; k < nr; k++)
            rv[k] = (struct iovec){.iov_base = back + cut[k], .iov_len = cut[k + 1] - cut[k]};
        uint64_t off = pkvt_below(&r, 1u << 20);
        pkvi_io_req w = {.write = true, .fd = fd, .len = total, .off = off, .iov = wv,
                         .iovcnt = nw};
        pkvi_io_req rd = {.write = false, .fd = fd, .len = total, .off = off, .iov = rv,
                          .iovcnt = nr};
        ck_assert_int_eq(pkvi_io_submit(io, &w, 1), PKV_OK);
        unsigned char *file = pkvt_alloc(total);
        file_bytes(fd, file, total, (off_t)off);
        ck_assert_msg(memcmp(file, flat, total) == 0, "vectored write differs (seed %llu)",
                      (unsigned long long)seed);
        ck_assert_int_eq(pkvi_io_submit(io, &rd, 1), PKV_OK);
        ck_assert_msg(memcmp(back, flat, total) == 0, "vectored read differs (seed %llu)",
                      (unsigned long long)seed);
        /* segments that do not add up to len, or too many, are refused */
        pkvi_io_req bad = w;
        bad.len = total + 1;
        ck_assert_int_eq(pkvi_io_submit(io, &bad, 1), PKV_EINVAL);
        bad = w;
        bad.iovcnt = PKVI_IO_MAX_IOV + 1;
        ck_assert_int_eq(pkvi_io_submit(io, &bad, 1), PKV_EINVAL);
        bad = w;
        bad.iov = NULL;
        ck_assert_int_eq(pkvi_io_submit(io, &bad, 1), PKV_EINVAL);
        for (uint32_t k = 0; k < nw; k++)
            free(wv[k].iov_base);
        free(flat);
        free(back);
        free(file);
    }
    close(fd);
    pkvi_io_close(io);
}

START_TEST(vectored_roundtrip) { vectored(0); }
END_TEST
START_TEST(vectored_short_transfers) { vectored(777); }
END_TEST

static void add_io_tests(TCase *tc)
{
    tcase_add_test(tc, vectored_roundtrip);
    tcase_add_test(tc, vectored_short_transfers);
    tcase_add_test(tc, batched_roundtrip);
    tcase_add_test(tc, short_transfers);
    tcase_add_test(tc, read_past_eof);
    tcase_add_test(tc, short_write_then_error);
    tcase_add_test(tc, fault_exact_nth);
    tcase_add_test(tc, bad_requests);
    tcase_set_timeout(tc, 120);
}

int main(void)
{
    const char *why = pkvt_uring_skip_reason();
    const char *only = getenv("CK_RUN_CASE");
    if (why != NULL) {
        fprintf(stderr, "test_io: SKIP io_uring backend: %s\n", why);
        if (only != NULL && strcmp(only, "io_uring") == 0)
            return 77;
    }

    Suite *s = suite_create("io");
    TCase *crc = tcase_create("crc32c");
    tcase_add_test(crc, crc_vectors);
    tcase_add_test(crc, crc_every_table_entry);
    tcase_add_test(crc, crc_random_vs_bitwise);
    tcase_add_test(crc, backend_choice);
    suite_add_tcase(s, crc);
    if (pkvi_crc32c_hw_available()) {
        TCase *hw = tcase_create("crc32c_hw");
        tcase_add_test(hw, crc_hw_vs_bitwise);
        suite_add_tcase(s, hw);
    } else {
        fprintf(stderr, "test_io: crc32c_hw case left out: no SSE4.2 crc32 here\n");
    }

    TCase *sync = tcase_create("sync");
    tcase_add_unchecked_fixture(sync, use_sync, NULL);
    add_io_tests(sync);
    suite_add_tcase(s, sync);
    if (why == NULL) {
        TCase *ur = tcase_create("io_uring");
        tcase_add_unchecked_fixture(ur, use_uring, NULL);
        add_io_tests(ur);
        suite_add_tcase(s, ur);
    }
    return pkvt_run(s);
}

/*
 * test_robust.c - the library's resource bounds and crash behaviour (issue 21):
 *
 *   hostile   session files whose headers claim huge sizes (sparse files, a few KiB
 *             on disk) are refused with the documented status, quickly, and without
 *             memory that follows the claims: each load and check runs in a forked
 *             child, whose peak RSS growth (VmHWM after resetting it through
 *             /proc/self/clear_refs) and time are reported and bounded;
 *   killed    saves SIGKILLed at random moments leave no temporary file and the
 *             target old or new, never anything else;
 *   cycles    engine create / use / destroy does not grow the process's RSS.
 *
 * Bounds on time are generous (a shared, loaded machine): they catch work that
 * follows a header's claims (seconds to minutes), not slowness.
 */
#include "testutil.h"
#include "io_backend.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- scratch directory ----------------------------------------------------------------- */

static char dir[512];

static void make_scratch(void)
{
    const char *base = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/pkv-test-robust-XXXXXX", base && *base ? base : "/tmp");
    ck_assert_msg(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
}

static void remove_scratch(void)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    char p[1200];
    for (struct dirent *de; (de = readdir(d)) != NULL;) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A field of /proc/self/status in KiB, or -1. */
static long status_kib(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (f == NULL)
        return -1;
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0 && line[n] == ':') {
            v = strtol(line + n + 1, NULL, 10);
            break;
        }
    fclose(f);
    return v;
}

/* ---- forged files (docs/file-format.md, written independently of persist.c) ------------ */

static void set32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> 8 * i);
}
static void set64(unsigned char *p, uint64_t v)
{
    set32(p, (uint32_t)v);
    set32(p + 4, (uint32_t)(v >> 32));
}

static const unsigned char magic[8] = {0x89, 'P', 'K', 'V', '\r', '\n', 0x1a, '\n'};

/* Write `bytes` at the start of path and extend it (sparse) to `size` bytes. */
static void write_sparse(const char *path, const void *bytes, size_t n, uint64_t size)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ck_assert_msg(fd >= 0, "open %s: %s", path, strerror(errno));
    ck_assert_int_eq(write(fd, bytes, n), (ssize_t)n);
    ck_assert_msg(ftruncate(fd, (off_t)size) == 0, "ftruncate %llu: %s",
                  (unsigned long long)size, strerror(errno));
    ck_assert_int_eq(close(fd), 0);
}

/* A sound version-1 header (its CRC matches) of one layer of `n_pages` pages of the
 * geometry h = g = d = bt = 1, f16 (4-byte pages), scale 1, and a file exactly as
 * long as that header says; the page table and the pages are holes (zeros). */
static void forge_tiny_geometry(const char *path, uint64_t n_pages)
{
    enum { L = 1, H = 92 + 8 * L };
    unsigned char h[H];
    memset(h, 0, sizeof h);
    memcpy(h, magic, 8);
    set32(h + 8, 1);
    set32(h + 12, H);
    set32(h + 16, L);
    set32(h + 20, 1);           /* n_heads */
    set32(h + 24, 1);           /* n_kv_heads */
    set32(h + 28, 1);           /* head_dim */
    set32(h + 32, 1);           /* f16 */
    set32(h + 36, 1);           /* block_tokens */
    set32(h + 40, 0x3f800000u); /* scale 1.0f = 1/sqrt(1) */
    const uint64_t pb = 2 * 1 * 1 * 1 * 2;
    set64(h + 48, pb);
    set64(h + 56, n_pages);
    set64(h + 64, H);
    const uint64_t data_off = (H + 16 * n_pages + 4095) / 4096 * 4096;
    set64(h + 72, data_off);
    set32(h + 80, 0x12345678u); /* table CRC: whatever; the table is zeros */
    set64(h + 88, n_pages);     /* layer 0 holds n_pages positions (bt = 1) */
    set32(h + H - 4, pkvi_crc32c(0, h, H - 4));
    write_sparse(path, h, sizeof h, data_off + n_pages * pb);
}

/* A sound file (header and page table CRCs match) of one layer of one token in one
 * page of h = g = 1, head_dim d, bt = 2, f32: a page of 16 * d bytes whose K and V
 * blocks are 8 * d each, row 0 valid and row 1 padding. The page is a hole except
 * for one nonzero byte at `poke` (none if poke == UINT64_MAX); its table entry holds
 * the CRC of those bytes when `good_crc`, else 0. */
static void forge_big_page(const char *path, uint32_t d, uint64_t poke, bool good_crc)
{
    enum { L = 1, H = 92 + 8 * L };
    const uint64_t pb = 16ull * d, data_off = 4096;
    unsigned char head[4096];
    memset(head, 0, sizeof head);
    unsigned char *h = head, *ent = head + H;
    memcpy(h, magic, 8);
    set32(h + 8, 1);
    set32(h + 12, H);
    set32(h + 16, L);
    set32(h + 20, 1);
    set32(h + 24, 1);
    set32(h + 28, d);
    set32(h + 32, 0);           /* f32 */
    set32(h + 36, 2);
    float scale = 1.0f / sqrtf((float)d);
    uint32_t bits;
    memcpy(&bits, &scale, 4);
    set32(h + 40, bits);
    set64(h + 48, pb);
    set64(h + 56, 1);
    set64(h + 64, H);
    set64(h + 72, data_off);
    set64(h + 88, 1);
    uint32_t crc = 0;
    if (good_crc) {
        unsigned char *page = calloc(1, (size_t)pb);
        ck_assert(page != NULL);
        if (poke != UINT64_MAX)
            page[poke] = 0x5a;
        crc = pkvi_crc32c(0, page, (size_t)pb);
        free(page);
    }
    set32(ent, 0);
    set32(ent + 4, crc);
    set64(ent + 8, 0);
    set32(h + 80, pkvi_crc32c(0, ent, 16));
    set32(h + H - 4, pkvi_crc32c(0, h, H - 4));
    write_sparse(path, head, sizeof head, data_off + pb);
    if (poke != UINT64_MAX) {
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        ck_assert(fd >= 0);
        unsigned char x = 0x5a;
        ck_assert_int_eq(pwrite(fd, &x, 1, (off_t)(data_off + poke)), 1);
        ck_assert_int_eq(close(fd), 0);
    }
}

/* pkvi_sfile_verify in this process: its status and reason. */
static pkv_status verify_why(const char *path, const char **why)
{
    pkvi_io *io = NULL;
    ck_assert_int_eq(pkvi_io_open(true, &io), PKV_OK);
    pkvi_sfile_info info;
    pkv_status st = pkvi_sfile_verify(io, path, &info, why);
    pkvi_sfile_info_free(&info);
    pkvi_io_close(io);
    return st;
}

/* 16 bytes claiming a header of `hbytes`, in a file of that many bytes. */
static void forge_huge_header(const char *path, uint32_t hbytes)
{
    unsigned char p[16];
    memcpy(p, magic, 8);
    set32(p + 8, 1);
    set32(p + 12, hbytes);
    write_sparse(path, p, sizeof p, hbytes);
}

/* ---- one hostile attempt in a child ---------------------------------------------------- */

typedef struct {
    int status;        /* pkv_status, or -1 when the child died */
    long rss_kib;      /* peak RSS growth of the call */
    double seconds;
} outcome;

enum { ENGINE_TEST, ENGINE_TINY, CHECK_ONLY };

/* Load `path` into a fresh engine (the test's geometry, or the tiny one of the forged
 * files), or run pkv_session_file_check on it, in a forked child. Without a shadow
 * sanitizer the child's address space is limited to 1 GiB above what it has, so a
 * load that allocates what a header claims fails there instead of growing. */
static outcome attempt(const char *path, int how)
{
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork();
    ck_assert(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        pkv_config c = pkv_config_default();
        c.n_threads = 1;
        if (how == ENGINE_TINY) {
            c.n_layers = c.n_heads = c.n_kv_heads = c.head_dim = c.block_tokens = 1;
            c.kv_dtype = PKV_F16;
        } else {
            c.n_layers = 2;
            c.n_heads = 4;
            c.n_kv_heads = 2;
            c.head_dim = 8;
            c.block_tokens = 4;
        }
        pkv_engine *e = NULL;
        if (how != CHECK_ONLY && pkv_engine_create(&c, &e) != PKV_OK)
            _exit(3);
        if (!PKVT_SHADOW_SANITIZER) {
            long vm = status_kib("VmSize");
            struct rlimit lim = {.rlim_cur = (rlim_t)(vm + (1l << 20)) * 1024,
                                 .rlim_max = RLIM_INFINITY};
            if (vm < 0 || setrlimit(RLIMIT_AS, &lim) != 0)
                _exit(4);
        }
        int fd = open("/proc/self/clear_refs", O_WRONLY);
        if (fd < 0 || write(fd, "5", 1) != 1) /* VmHWM := VmRSS */
            _exit(5);
        close(fd);
        long rss0 = status_kib("VmRSS");
        double t0 = now_s();
        pkv_status st;
        if (how == CHECK_ONLY) {
            pkv_file_info info;
            st = pkv_session_file_check(path, &info, NULL, 0);
        } else {
            pkv_session *s = NULL;
            st = pkv_session_load(e, path, &s);
            pkv_session_destroy(s);
        }
        outcome o = {.status = (int)st, .seconds = now_s() - t0,
                     .rss_kib = status_kib("VmHWM") - rss0};
        if (write(fds[1], &o, sizeof o) != (ssize_t)sizeof o)
            _exit(6);
        _exit(0);
    }
    close(fds[1]);
    outcome o = {.status = -1};
    ssize_t got = read(fds[0], &o, sizeof o);
    close(fds[0]);
    int ws = 0;
    ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
    if (got != (ssize_t)sizeof o || !WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
        o.status = -1;
    if (WIFSIGNALED(ws))
        fprintf(stderr, "  child killed by signal %d\n", WTERMSIG(ws));
    else if (WIFEXITED(ws) && WEXITSTATUS(ws) != 0)
        fprintf(stderr, "  child exited with %d\n", WEXITSTATUS(ws));
    return o;
}

static const char *how_name(int how)
{
    return how == CHECK_ONLY ? "file_check" : how == ENGINE_TINY ? "load (same geometry)"
                                                                 : "load (other engine)";
}

/* Peak RSS growth allowed for a refused file: a few MiB, whatever it claims. */
#define HOSTILE_RSS_KIB (8l << 10)
#define HOSTILE_SECONDS 10.0

static void expect_refused(const char *what, const char *path, int how, pkv_status want)
{
    outcome o = attempt(path, how);
    printf("hostile %-28s %-21s -> %-12s peak RSS +%ld KiB, %.3f s\n", what, how_name(how),
           o.status < 0 ? "(died)" : pkv_status_str((pkv_status)o.status), o.rss_kib,
           o.seconds);
    fflush(stdout);
    ck_assert_msg(o.status == (int)want, "%s, %s: status %d, want %d", what, how_name(how),
                  o.status, (int)want);
    if (!PKVT_SHADOW_SANITIZER)
        ck_assert_msg(o.rss_kib < HOSTILE_RSS_KIB, "%s, %s: peak RSS grew %ld KiB", what,
                      how_name(how), o.rss_kib);
    ck_assert_msg(o.seconds < HOSTILE_SECONDS, "%s, %s: %.1f s", what, how_name(how),
                  o.seconds);
}

START_TEST(hostile_files)
{
    make_scratch();
    char path[600];
    snprintf(path, sizeof path, "%s/hostile.pkv", dir);

    /* 16 bytes claiming a 4 GiB header: damage, found without reading 4 GiB */
    forge_huge_header(path, 0xfffffff0u);
    expect_refused("16 B claiming a 4 GiB header", path, ENGINE_TEST, PKV_ECORRUPT);
    expect_refused("16 B claiming a 4 GiB header", path, CHECK_ONLY, PKV_ECORRUPT);

    /* Sound headers of another geometry: EINVAL from the header alone. The verifier
     * (no engine) and an engine of that geometry find the page table of zeros out of
     * order at its second entry. */
    const uint64_t counts[] = {1ull << 26, 1ull << 32};
    const char *names[] = {"2^26 pages (1 GiB table)", "2^32 pages (64 GiB table)"};
    for (int i = 0; i < 2; i++) {
        forge_tiny_geometry(path, counts[i]);
        struct stat sb;
        ck_assert_int_eq(stat(path, &sb), 0);
        printf("hostile %s: file of %llu bytes, %llu KiB on disk\n", names[i],
               (unsigned long long)sb.st_size, (unsigned long long)sb.st_blocks / 2);
        expect_refused(names[i], path, ENGINE_TEST, PKV_EINVAL);
        expect_refused(names[i], path, ENGINE_TINY, PKV_ECORRUPT);
        expect_refused(names[i], path, CHECK_ONLY, PKV_ECORRUPT);
    }

    /* A sound header and table with one page of 64 MiB (more than the verifier reads
     * at once): checked in pieces with a small buffer, padding rows included. */
    const uint32_t d = 1u << 22;
    const uint64_t row = 4ull * d;  /* K rows at [0, 2 row), V rows at [2 row, 4 row) */
    forge_big_page(path, d, UINT64_MAX, false);
    expect_refused("one 64 MiB page of holes", path, CHECK_ONLY, PKV_ECORRUPT);
    const char *why = NULL;
    ck_assert_int_eq(verify_why(path, &why), PKV_ECORRUPT);
    ck_assert_str_eq(why, "page checksum mismatch");
    forge_big_page(path, d, 3 * row + 12345, true); /* V padding, CRC right */
    ck_assert_int_eq(verify_why(path, &why), PKV_ECORRUPT);
    ck_assert_str_eq(why, "nonzero padding in a partly filled page");
    forge_big_page(path, d, row + 1, true);         /* K padding, its first byte */
    ck_assert_int_eq(verify_why(path, &why), PKV_ECORRUPT);
    ck_assert_str_eq(why, "nonzero padding in a partly filled page");
    forge_big_page(path, d, 2 * row + row - 1, true); /* V row 0, its last byte */
    ck_assert_msg(verify_why(path, &why) == PKV_OK, "a sound big page refused: %s", why);
    forge_big_page(path, d, row - 1, true);         /* K row 0, its last byte */
    ck_assert_msg(verify_why(path, &why) == PKV_OK, "a sound big page refused: %s", why);

    unlink(path);
    remove_scratch();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("robust");
    TCase *hostile = tcase_create("hostile");
    tcase_add_test(hostile, hostile_files);
    tcase_set_timeout(hostile, 120);
    suite_add_tcase(s, hostile);
    return pkvt_run(s);
}

/*
 * persist/save.c - writing session files: pkv_session_save. The layout is
 * persist/format.h (docs/file-format.md).
 *
 * Owns: turning a session into the bytes of a file (header, page table, pages, token
 *   ids) and the atomic-save protocol: a locked 0600 temporary in the target's
 *   directory (unnamed with O_TMPFILE, else named O_EXCL), write, fsync, link,
 *   rename, directory fsync; and the removal of temporaries that killed saves left
 *   (clean_stale). Does not own: the layout and its codecs (persist/format.h),
 *   reading or checking files (persist/load.c), sessions and pages
 *   (session/residency.c: pkvi_session_acquire/release; the tables' entries through
 *   btable.c), the I/O backends (io.c, io_uring.c), the checksum (crc32c.c). Works
 *   from the session's contexts (its geometry, error sink and the cache state's I/O
 *   object for session files), never its engine.
 *
 * Invariants:
 *   - Save never writes memory it did not define: rows past a layer's length in its
 *     last page are written as zeros (and load insists they are zero).
 *   - Save either replaces the target with a complete, fsynced file or leaves it as
 *     it was and removes its temporary file (a failing close or directory fsync,
 *     after the rename, is the one exception: the new file is in place, durability
 *     unknown). Killed, it leaves the target old or new; with O_TMPFILE nothing else
 *     (but in the microseconds between link and rename), and whatever it left is
 *     removed by the next save to the directory: a save's temporary is flock'ed from
 *     creation until after the rename, so an unlocked one is a dead save's.
 *   - It writes the oldest version that holds the session (1 for a plain engine; 5
 *     with rope or a discard's traces, SPEC §14).
 */
#include "persist/format.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Save writes pages of at least this size straight from pool memory; smaller pages
 * (and every partly filled last page) are gathered in a staging buffer first so one
 * request moves many of them. */
#define DIRECT_MIN (64ull << 10)

/* ---- writing pages ------------------------------------------------------------------- */

/* Gathers the page writes of one layer: big full pages go straight from pool memory,
 * the rest through the staging buffer, whose pages form runs contiguous in the file. */
typedef struct {
    pkvi_io *io;
    int fd;
    unsigned char *stage;
    uint64_t stage_cap, stage_used;
    uint64_t run_start;     /* stage offset where the open run begins */
    uint64_t run_off;       /* file offset of the open run */
    pkvi_io_req reqs[PKVI_URING_DEPTH];
    uint32_t n_reqs;
} writer;

static void close_run(writer *w)
{
    if (w->stage_used > w->run_start) {
        w->reqs[w->n_reqs++] = (pkvi_io_req){.write = true, .fd = w->fd,
                                             .buf = w->stage + w->run_start,
                                             .len = w->stage_used - w->run_start,
                                             .off = w->run_off};
        w->run_start = w->stage_used;
    }
}

static pkv_status flush(writer *w)
{
    close_run(w);
    pkv_status st = pkvi_io_submit(w->io, w->reqs, w->n_reqs);
    w->n_reqs = 0;
    w->stage_used = w->run_start = 0;
    return st;
}

/* Room for one more request (and the run that close_run may add). */
static pkv_status need_reqs(writer *w)
{
    return w->n_reqs + 2 > PKVI_URING_DEPTH ? flush(w) : PKV_OK;
}

/* Write one page; returns its CRC through *crc. */
static pkv_status write_page(writer *w, const pkvi_geom *geo, const unsigned char *data,
                             uint32_t tokens, uint64_t off, uint32_t *crc)
{
    uint64_t pb = geo->page_bytes;
    uint32_t bt = geo->cfg.block_tokens;
    pkv_status st = need_reqs(w);
    if (st != PKV_OK)
        return st;
    if (tokens == bt && pb >= DIRECT_MIN) {
        *crc = pkvi_crc32c(0, data, (size_t)pb);
        w->reqs[w->n_reqs++] =
            (pkvi_io_req){.write = true, .fd = w->fd, .buf = (void *)data, .len = pb, .off = off};
        return PKV_OK;
    }
    if (w->stage_used + pb > w->stage_cap && (st = flush(w)) != PKV_OK)
        return st;
    if (w->stage_used > w->run_start && w->run_off + (w->stage_used - w->run_start) != off)
        close_run(w);
    if (w->stage_used == w->run_start)
        w->run_off = off;
    unsigned char *dst = w->stage + w->stage_used;
    if (tokens == bt) {
        memcpy(dst, data, (size_t)pb);
    } else {
        /* Only the valid rows of each group's K and V; the rest is zero. */
        const uint64_t rk = geo->row_bytes, rv = geo->row_bytes_v;
        const uint64_t stride = (uint64_t)bt * (rk + rv);
        memset(dst, 0, (size_t)pb);
        for (uint32_t gi = 0; gi < geo->cfg.n_kv_heads; gi++) {
            const uint64_t base = stride * gi;
            memcpy(dst + base, data + base, (size_t)(tokens * rk));
            memcpy(dst + base + bt * rk, data + base + bt * rk, (size_t)(tokens * rv));
        }
    }
    *crc = pkvi_crc32c(0, dst, (size_t)pb);
    w->stage_used += pb;
    return PKV_OK;
}

/* The token ids of a version-3 file, little-endian, from offset `at`; *crc their
 * CRC-32C. */
static pkv_status write_ids(pkvi_io *io, int fd, const int32_t *ids, uint64_t n, uint64_t at,
                            uint32_t *crc)
{
    enum { PER = 65536 };
    unsigned char *buf = malloc(4u * PER);
    if (!buf)
        return PKV_ENOMEM;
    pkv_status st = PKV_OK;
    *crc = 0;
    for (uint64_t o = 0; o < n && st == PKV_OK; o += PER) {
        const uint64_t k = n - o < PER ? n - o : PER;
        for (uint64_t i = 0; i < k; i++)
            pkvi_put32(buf + 4 * i, (uint32_t)ids[o + i]);
        *crc = pkvi_crc32c(*crc, buf, (size_t)(4 * k));
        st = pkvi_sfile_transfer(io, true, fd, buf, 4 * k, at + 4 * o);
    }
    free(buf);
    return st;
}

/* ---- the temporary file and the atomic replace --------------------------------------- */

/* Temporary name: the target path, the pid and 64 random bits. Never built from
 * anything but the caller's own path. clean_stale() recognises exactly this pattern. */
static char *temp_name(const char *path)
{
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        rnd ^= (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)&ts;
    }
    size_t n = strlen(path) + 64;
    char *t = malloc(n);
    if (t != NULL)
        snprintf(t, n, "%s.tmp-%ld-%016llx", path, (long)getpid(), (unsigned long long)rnd);
    return t;
}

/* Whether a directory entry is named like temp_name's: "X.tmp-PID-HEX16". */
static bool temp_pattern(const char *name)
{
    const char *t = NULL;
    for (const char *p = strstr(name, ".tmp-"); p != NULL; p = strstr(p + 1, ".tmp-"))
        t = p;
    if (t == NULL || t == name)
        return false;
    const char *p = t + 5;
    size_t digits = strspn(p, "0123456789");
    if (digits == 0 || p[digits] != '-')
        return false;
    p += digits + 1;
    return strspn(p, "0123456789abcdef") == 16 && p[16] == '\0';
}

/* The directory holding path ("." for a bare name), malloc'd. */
static char *dir_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash == NULL ? strdup(".")
           : slash == path ? strdup("/") : strndup(path, (size_t)(slash - path));
}

/* Remove the temporaries that killed saves left in dir: entries named like
 * temp_name's, regular files of this user, that no save holds (a save keeps an
 * exclusive flock on its temporary from creation to rename). Best effort: an entry
 * that cannot be checked is left alone. */
static void clean_stale(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    const int dfd = dirfd(d);
    for (struct dirent *de; (de = readdir(d)) != NULL;) {
        if (!temp_pattern(de->d_name))
            continue;
        int fd = openat(dfd, de->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0)
            continue;
        struct stat a, b;
        if (fstat(fd, &a) == 0 && S_ISREG(a.st_mode) && a.st_uid == geteuid() &&
            flock(fd, LOCK_EX | LOCK_NB) == 0 &&
            fstatat(dfd, de->d_name, &b, AT_SYMLINK_NOFOLLOW) == 0 && a.st_dev == b.st_dev &&
            a.st_ino == b.st_ino)
            (void)unlinkat(dfd, de->d_name, 0);   /* under our lock: no save holds it */
        close(fd);
    }
    closedir(d);
}

/* fsync a directory, so a rename in it is durable. */
static pkv_status sync_dir(pkvi_io *io, const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return PKV_EIO;
    pkv_status st = pkvi_io_fsync(io, fd);
    close(fd);
    return st;
}

/* An unnamed file in dir (O_TMPFILE), locked, that can later be linked through
 * /proc/self/fd; -1 where the file system, the kernel or a missing /proc forbid it. */
static int open_unnamed(const char *dir)
{
#ifdef O_TMPFILE
    int fd = open(dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    char proc[64];
    struct stat sb;
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    if (stat(proc, &sb) != 0 || flock(fd, LOCK_EX | LOCK_NB) != 0) {
        close(fd);
        return -1;
    }
    return fd;
#else
    (void)dir;
    return -1;
#endif
}

/* A new named temporary next to path, created exclusively, 0600, locked. *tmp gets
 * its name. PKV_EIO if it cannot be created (the reason in errno's domain is lost on
 * purpose: the caller reports EIO), PKV_ENOMEM. */
static pkv_status open_named(const char *path, char **tmp, int *out)
{
    for (int tries = 0; tries < 8; tries++) {
        char *t = temp_name(path);
        if (t == NULL)
            return PKV_ENOMEM;
        int fd = open(t, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0) {
            free(t);
            if (errno == EEXIST)
                continue;
            return PKV_EIO;
        }
        /* A concurrent clean_stale may have taken it between open and flock (it then
         * unlinks it): the lock fails or the name is gone; take another name. */
        struct stat sb;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &sb) == 0 && sb.st_nlink > 0) {
            *tmp = t;
            *out = fd;
            return PKV_OK;
        }
        close(fd);
        free(t);
    }
    return PKV_EIO;
}

/* Give the complete, fsynced unnamed file fd the name *tmp (a fresh temp_name). */
static pkv_status link_unnamed(int fd, const char *path, char **tmp)
{
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    for (int tries = 0; tries < 8; tries++) {
        char *t = temp_name(path);
        if (t == NULL)
            return PKV_ENOMEM;
        if (linkat(AT_FDCWD, proc, AT_FDCWD, t, AT_SYMLINK_FOLLOW) == 0) {
            *tmp = t;
            return PKV_OK;
        }
        int err = errno;
        free(t);
        if (err != EEXIST)
            return PKV_EIO;
    }
    return PKV_EIO;
}

/* ---- saving -------------------------------------------------------------------------- */

/* The reader's checks (persist/header.c) on the header and page table of head, for a
 * file of file_bytes, and on the engine it must load into: what a save is about to
 * commit. PKV_ECORRUPT (a library defect) with the reader's reason, or PKV_OK. */
static pkv_status check_before_commit(const pkvi_geom *geo, const unsigned char *head,
                                      uint64_t hbytes, uint64_t file_bytes, const char **why)
{
    pkvi_sfile_info in;
    memset(&in, 0, sizeof in);
    in.file_bytes = file_bytes;
    const char *r = "ok";
    pkv_status st = pkvi_sfile_parse_header(head, (uint32_t)hbytes, &in, &r);
    if (st == PKV_OK)
        st = pkvi_sfile_match_engine(&in, geo, &r);
    if (st == PKV_OK) {
        pkvi_sfile_walk w = pkvi_sfile_walk_start(&in);
        if (!pkvi_sfile_walk_entries(&in, &w, head + hbytes, in.n_pages))
            st = PKV_ECORRUPT, r = "page table entries out of order";
        else if (w.crc != in.table_crc)
            st = PKV_ECORRUPT, r = "page table checksum mismatch";
    }
    pkvi_sfile_info_free(&in);
    if (st == PKV_ENOMEM) {
        *why = "out of memory";
        return st;
    }
    if (st != PKV_OK) {
        /* the reasons are static strings: say which check, and whose fault */
        *why = r;
        return PKV_ECORRUPT;
    }
    return PKV_OK;
}

pkv_status pkvi_session_save_opts(pkv_session *s, const char *path, pkvi_io *io,
                                  unsigned flags, const char **why)
{
    const char *w_why = "invalid arguments";
    if (why != NULL)
        *why = w_why;
    if (s == NULL || path == NULL || *path == '\0' || io == NULL ||
        (flags & ~PKVI_SAVE_NAMED_TEMP) != 0)
        return PKV_EINVAL;
    const pkvi_geom *geo = s->geom;
    const pkv_config *c = &geo->cfg;
    uint32_t L = c->n_layers, bt = c->block_tokens, code = 0;
    /* The format's page layout is [g][K bt rows | V bt rows]; the engine's must match. */
    if (!pkvi_sfile_dtype_code(c->kv_dtype, &code) || geo->kp.v_offset != bt * geo->row_bytes ||
        geo->kp.group_stride != bt * (geo->row_bytes + geo->row_bytes_v) ||
        geo->page_bytes != (uint64_t)c->n_kv_heads * geo->kp.group_stride) {
        if (why != NULL)
            *why = "the engine's page layout is not the file format's";
        return PKV_EINVAL;
    }
    /* A shard's layers all start at `first` (pkv_session_set_first): version 4. */
    const uint64_t first = pkvi_btable_first(s->layers[0]);
    for (uint32_t l = 1; l < L; l++)
        if (pkvi_btable_first(s->layers[l]) != first) {
            if (why != NULL)
                *why = "its layers start at different positions (a library defect)";
            return PKV_ECORRUPT;
        }
    /* The oldest version that holds the session: 1 for a plain engine (so readers of
     * version 1 still read what it saves), 2 with variants or block dtypes, 3 with
     * recorded token ids, 4 for a shard, 5 with RoPE or a discard's traces (SPEC §14). */
    bool v5 = s->record_max != UINT64_MAX;
    for (uint32_t l = 0; l < L; l++) {
        uint64_t lo, hi;
        pkvi_btable_stale(s->layers[l], &lo, &hi);
        v5 |= geo->layers[l].rope != 0 || hi > lo;
    }
    const uint32_t version = v5      ? 5u
                             : first ? 4u
                             : s->n_tokens ? 3u
                             : geo->variants || code > 2 ? 2u : 1u;
    uint64_t n_logit_layers = 0;
    for (uint32_t l = 0; l < L; l++)
        n_logit_layers += geo->layers[l].sink_logits != NULL;

    uint64_t n_pages = 0, hbytes = PKVI_SFILE_HEADER_FIXED + 8ull * L, table_end = 0, data_off;
    if (version >= 2)
        hbytes += PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * L +
                  4ull * c->n_heads * n_logit_layers;
    if (version >= 3)
        hbytes += PKVI_SFILE_V3_EXTRA;
    if (version >= 4)
        hbytes += PKVI_SFILE_V4_EXTRA;
    hbytes += pkvi_sfile_v5_bytes(version, L);
    if (hbytes > PKVI_SFILE_MAX_HEADER) { /* more layers than the format holds */
        if (why != NULL)
            *why = "more layers than a file's header holds (1 MiB of header)";
        return PKV_EINVAL;
    }
    if (why != NULL)
        *why = "out of memory (the page table)";
    for (uint32_t l = 0; l < L; l++)
        if (!pkvi_add(n_pages, pkvi_btable_held(s->layers[l]), &n_pages))
            return PKV_ENOMEM;
    if (!pkvi_mul(n_pages, PKVI_SFILE_ENTRY_BYTES, &table_end) ||
        !pkvi_add(table_end, hbytes, &table_end) || table_end > SIZE_MAX / 2)
        return PKV_ENOMEM;
    data_off = pkvi_align_up(table_end, PKVI_SFILE_ALIGN);

    pkv_status st = PKV_ENOMEM;
    bool created = false;   /* tmp exists and is ours: unlink it on failure */
    char *tmp = NULL;       /* the temporary's name, once it has one */
    uint64_t k = 0;
    unsigned char *head = calloc(1, (size_t)data_off);   /* header, table, zero gap */
    writer w = {.io = io, .fd = -1};
    /* Staging for pages written as copies: a quarter of a batch, but never more than
     * the session itself (a 4 KiB session must not cost a 4 MiB buffer). */
    uint64_t need;
    if (!pkvi_mul(n_pages ? n_pages : 1, geo->page_bytes, &need))
        need = UINT64_MAX;
    w.stage_cap = need < PKVI_SFILE_BATCH_BYTES / 4 ? need : PKVI_SFILE_BATCH_BYTES / 4;
    if (w.stage_cap < geo->page_bytes)
        w.stage_cap = geo->page_bytes;
    w.stage = pkvi_sfile_alloc(w.stage_cap);
    char *dir = dir_of(path);
    w_why = "out of memory";
    if (head == NULL || w.stage == NULL || dir == NULL)
        goto out;

    /* Step 1: the temporary. Unnamed (O_TMPFILE) where the file system allows it, so
     * a save killed before step 5 leaves nothing; else named, exclusive. Either is
     * locked (flock) until the rename, which is how clean_stale tells the
     * temporaries of killed saves from those of saves in progress. */
    clean_stale(dir);
    st = PKV_EIO;
    w_why = "cannot create the temporary file";
    w.fd = (flags & PKVI_SAVE_NAMED_TEMP) ? -1 : open_unnamed(dir);
    if (w.fd < 0) {
        if ((st = open_named(path, &tmp, &w.fd)) != PKV_OK) {
            if (st == PKV_ENOMEM)
                w_why = "out of memory";
            goto out;
        }
        created = true;
    }
    st = PKV_EIO;
    if (fchmod(w.fd, 0600) != 0)  /* exactly 0600, whatever the umask */
        goto out;

    w_why = "write error";
    for (uint32_t l = 0; l < L; l++) {
        const pkvi_btable *ly = s->layers[l];
        const uint64_t np = pkvi_btable_n_pages(ly), len = pkvi_btable_len(ly);
        if (np == 0)
            continue;
        if ((st = pkvi_session_acquire(s, l, "pkv_session_save")) != PKV_OK) {
            w_why = "could not bring spilled pages back";
            goto out;
        }
        for (uint64_t i = 0; i < np && st == PKV_OK; i++, k++) {
            const pkvi_page *pg = pkvi_btable_page(ly, i);
            if (pg == NULL) { /* the hole (a window's release, a shard's start): not in
                                 the file */
                k--;
                continue;
            }
            uint32_t crc = 0;
            st = write_page(&w, geo, pg->data, pkvi_sfile_page_tokens(len, np, i, bt),
                            data_off + k * geo->page_bytes, &crc);
            unsigned char *ent = head + hbytes + k * PKVI_SFILE_ENTRY_BYTES;
            pkvi_put32(ent, l);
            pkvi_put32(ent + 4, crc);
            pkvi_put64(ent + 8, i);
        }
        if (st == PKV_OK)
            st = flush(&w);   /* before release: direct requests point at the pages */
        pkvi_session_release(s, l);
        if (st != PKV_OK) {
            st = PKV_EIO;
            goto out;
        }
    }

    memcpy(head + PKVI_SFILE_OFF_MAGIC, pkvi_sfile_magic, sizeof pkvi_sfile_magic);
    pkvi_put32(head + PKVI_SFILE_OFF_VERSION, version);
    pkvi_put32(head + PKVI_SFILE_OFF_HEADER_BYTES, (uint32_t)hbytes);
    pkvi_put32(head + PKVI_SFILE_OFF_N_LAYERS, L);
    pkvi_put32(head + PKVI_SFILE_OFF_N_HEADS, c->n_heads);
    pkvi_put32(head + PKVI_SFILE_OFF_N_KV_HEADS, c->n_kv_heads);
    pkvi_put32(head + PKVI_SFILE_OFF_HEAD_DIM, c->head_dim);
    pkvi_put32(head + PKVI_SFILE_OFF_DTYPE, code);
    pkvi_put32(head + PKVI_SFILE_OFF_BLOCK_TOKENS, bt);
    pkvi_put32(head + PKVI_SFILE_OFF_SCALE, pkvi_float_bits(c->scale));
    pkvi_put64(head + PKVI_SFILE_OFF_PAGE_BYTES, geo->page_bytes);
    pkvi_put64(head + PKVI_SFILE_OFF_N_PAGES, n_pages);
    pkvi_put64(head + PKVI_SFILE_OFF_TABLE_OFF, hbytes);
    pkvi_put64(head + PKVI_SFILE_OFF_DATA_OFF, data_off);
    pkvi_put32(head + PKVI_SFILE_OFF_TABLE_CRC,
               pkvi_crc32c(0, head + hbytes, (size_t)(n_pages * PKVI_SFILE_ENTRY_BYTES)));
    for (uint32_t l = 0; l < L; l++)
        pkvi_put64(head + PKVI_SFILE_OFF_LAYER_LEN + 8ull * l, pkvi_btable_len(s->layers[l]));
    uint32_t ids_crc = 0;
    if (version >= 3) { /* the ids go after the last page */
        w_why = "write error";
        st = write_ids(io, w.fd, s->tokens, s->n_tokens,
                       data_off + n_pages * geo->page_bytes, &ids_crc);
        if (st != PKV_OK)
            goto out;
    }
    if (version >= 2) {
        unsigned char *x = head + PKVI_SFILE_HEADER_FIXED + 8ull * L - 4;
        pkvi_put32(x, c->head_dim_v);
        unsigned char *z = x + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * L;
        for (uint32_t l = 0; l < L; l++) {
            const pkv_layer_config *lc = &geo->layers[l];
            unsigned char *y = x + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * l;
            pkvi_put32(y, lc->window);
            pkvi_put32(y + 4, lc->sink_tokens);
            pkvi_put32(y + 8, lc->rollback_tokens);
            pkvi_put32(y + 12, pkvi_float_bits(lc->softcap));
            pkvi_put32(y + 16, lc->sink_logits != NULL);
            pkvi_put64(y + 24, pkvi_btable_hole_end(s->layers[l]));
            for (uint32_t i = 0; lc->sink_logits && i < c->n_heads; i++, z += 4)
                pkvi_put32(z, pkvi_float_bits(lc->sink_logits[i]));
        }
        if (version >= 3) { /* the token record after the logits */
            pkvi_put64(z, s->n_tokens);
            pkvi_put32(z + 8, ids_crc);
            z += PKVI_SFILE_V3_EXTRA;
        }
        if (version >= 4) { /* the shard's first position */
            pkvi_put64(z, first);
            z += PKVI_SFILE_V4_EXTRA;
        }
        if (version >= 5) { /* the record's limit, each layer's rope and stale rows */
            pkvi_put64(z, s->record_max);
            for (uint32_t l = 0; l < L; l++) {
                const pkv_layer_config *lc = &geo->layers[l];
                unsigned char *y = z + PKVI_SFILE_V5_EXTRA + (uint64_t)PKVI_SFILE_V5_LAYER * l;
                uint64_t lo, hi;
                pkvi_btable_stale(s->layers[l], &lo, &hi);
                pkvi_put32(y, lc->rope);
                pkvi_put32(y + 4, lc->rope_dims);
                pkvi_put32(y + 8, pkvi_float_bits(lc->rope_theta));
                pkvi_put32(y + 12, pkvi_float_bits(lc->rope_freq_scale));
                pkvi_put64(y + 16, lo);
                pkvi_put64(y + 24, hi);
            }
        }
    }
    pkvi_put32(head + hbytes - 4, pkvi_crc32c(0, head, (size_t)hbytes - 4));
    /* Before anything is committed: the file must pass the reader's own checks. */
    if ((st = check_before_commit(geo, head, hbytes, data_off + n_pages * geo->page_bytes +
                                                       4 * (version >= 3 ? s->n_tokens : 0),
                                  &w_why)) != PKV_OK)
        goto out;
    w_why = "write error";
    if ((st = pkvi_sfile_transfer(io, true, w.fd, head, data_off, 0)) != PKV_OK)
        goto out;

    w_why = "fsync failed";
    if ((st = pkvi_io_fsync(io, w.fd)) != PKV_OK)
        goto out;
    if (tmp == NULL) {   /* complete and durable: now it may have a name */
        w_why = "cannot link the temporary file";
        if ((st = link_unnamed(w.fd, path, &tmp)) != PKV_OK)
            goto out;
        created = true;
    }
    if (rename(tmp, path) != 0) {
        st = PKV_EIO;
        w_why = "cannot rename the temporary file over the target";
        goto out;
    }
    created = false;   /* it is the target now: never unlink it */
    /* Closed only now: the lock must cover the name until the rename. The data is
     * already durable (fsync), so a failing close means an unknown state of the
     * file system, reported like a failing directory fsync. */
    if (close(w.fd) != 0) {
        w.fd = -1;
        st = PKV_EIO;
        w_why = "close failed (the file is in place)";
        goto out;
    }
    w.fd = -1;
    st = sync_dir(io, dir);
    w_why = st == PKV_OK ? "ok" : "directory fsync failed (the file is in place)";

out:
    if (created)
        unlink(tmp);     /* while still locked: no one else may take the name */
    if (w.fd >= 0)
        close(w.fd);
    free(tmp);
    free(dir);
    free(w.stage);
    free(head);
    if (why != NULL)
        *why = w_why;
    return st;
}

pkv_status pkvi_session_save_io(pkv_session *s, const char *path, pkvi_io *io,
                                const char **why)
{
    return pkvi_session_save_opts(s, path, io, 0, why);
}

pkv_status pkv_session_save(pkv_session *s, const char *path)
{
    if (s == NULL)
        return PKV_EINVAL;
    if (path == NULL || *path == '\0')
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_save: path is %s",
                         path ? "empty" : "NULL");
    if (pkvi_session_pending(s)) /* drafts are no positions yet: no file holds them */
        return pkvi_fail(s->errs, PKV_ESTATE, "pkv_session_save: drafts are pending "
                         "(pkv_session_commit first)");
    pkvi_io *io = NULL;
    pkv_status st = pkvi_cache_file_io(s->cache, &io);
    if (st != PKV_OK)
        return pkvi_fail(s->errs, st, "pkv_session_save: out of memory");
    const char *why = NULL;
    st = pkvi_session_save_io(s, path, io, &why);
    if (st == PKV_ECORRUPT)
        return pkvi_fail(s->errs, st, "pkv_session_save: %s: not written, the file would not "
                         "load (%s): a library defect, please report it", path,
                         why ? why : "?");
    if (st != PKV_OK)
        return pkvi_fail(s->errs, st, "pkv_session_save: %s: %s", path, why ? why : "failed");
    return st;
}

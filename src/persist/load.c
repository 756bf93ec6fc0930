/*
 * persist/load.c - reading session files: pkv_session_load, and the engine-free
 * verifier behind pkv_session_file_check and `pagedkv inspect`. The layout is
 * persist/format.h (docs/file-format.md); a file is hostile input until checked.
 *
 * Owns: the validation of a session file (header, page table, every page's CRC and
 *   padding, the token ids), the mapping of what is wrong to a status and a reason,
 *   and building a session from a file that passed. Does not own: the layout and its
 *   codecs (persist/format.h), writing files (persist/save.c), sessions and pages
 *   (session.c: pkvi_session_create, pkv_session_set_first; session/write.c:
 *   pkvi_session_push_page/skip_pages; session/reuse.c: pkvi_session_set_tokens), which
 *   it builds from the engine's contexts (pkvi_ctx: the geometry it compares a file
 *   with, the error sink, the cache state's I/O object for session files),
 *   the I/O backends (io.c, io_uring.c), the checksum (crc32c.c).
 *
 * Invariants:
 *   - Nothing of a file is trusted before it is checked: sizes are bounded by the
 *     file's real size before anything is allocated from them; arithmetic on file
 *     fields is checked (pkvi_mul/pkvi_add).
 *   - Memory does not follow a file's claims: the header is at most
 *     PKVI_SFILE_MAX_HEADER, the page table is streamed in TABLE_CHUNK entries, pages
 *     in batches of at most PKVI_SFILE_BATCH_BYTES (a bigger page in pieces, unless it
 *     is being loaded: then it is the engine's own page size). A refused file costs at
 *     most about 18 MiB of buffers, whatever its header says.
 *   - Load compares a sound header with the engine before reading anything past it.
 *   - Load validates the whole file (header, page table, every page's CRC and
 *     padding) before it creates the session, then builds it while checking every
 *     page again (the file may change between the passes); any failure destroys the
 *     half-built session: a load either returns a whole session or nothing.
 *   - Rows past a layer's length in its last page must be zero (save writes zeros).
 *
 * Error mapping (docs/file-format.md): not a session file (magic), or a sound header (CRC
 *   matches) of another version / geometry / dtype / block size / scale -> EINVAL;
 *   any other damage (header or page CRC, truncation, trailing bytes, nonzero
 *   padding, inconsistent fields) -> ECORRUPT; failing system calls -> EIO.
 */
#include "persist/format.h"

#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The first batch of pages read; later ones double up to PKVI_SFILE_BATCH_BYTES. */
#define FIRST_BATCH_BYTES (1ull << 20)
/* The page table is read in chunks of at most this many entries (1 MiB). */
#define TABLE_CHUNK 65536u

/* ---- checking a file ----------------------------------------------------------------- */

typedef struct {
    pkvi_io *io;
    int fd;
    pkvi_sfile_info *info;
    const char *why;
} reader;

static pkv_status fail(reader *r, pkv_status st, const char *why)
{
    r->why = why;
    return st;
}

static bool all_zero(const unsigned char *p, uint64_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, (size_t)(n - 1)) == 0);
}

/* Magic and the header's size, then the header itself through the one definition of
 * a sound header (pkvi_sfile_parse_header, persist/header.c). Reads nothing past the
 * header: its one allocation is bounded by PKVI_SFILE_MAX_HEADER and the file's size,
 * whatever the header claims. */
static pkv_status read_header(reader *r)
{
    pkvi_sfile_info *in = r->info;
    unsigned char pre[PKVI_SFILE_PREFIX_BYTES];
    uint64_t have =
        in->file_bytes < PKVI_SFILE_PREFIX_BYTES ? in->file_bytes : PKVI_SFILE_PREFIX_BYTES;
    if (have > 0 && pkvi_sfile_transfer(r->io, false, r->fd, pre, have, 0) != PKV_OK)
        return fail(r, PKV_EIO, "read error");
    uint64_t m = have < 8 ? have : 8;
    if (memcmp(pre, pkvi_sfile_magic, (size_t)m) != 0)
        return fail(r, PKV_EINVAL, "not a pagedkv session file (bad magic)");
    if (have < PKVI_SFILE_PREFIX_BYTES)
        return fail(r, PKV_ECORRUPT, "truncated header");
    uint32_t hbytes = pkvi_get32(pre + PKVI_SFILE_OFF_HEADER_BYTES);
    if (hbytes < PKVI_SFILE_PREFIX_BYTES + 4 || hbytes > PKVI_SFILE_MAX_HEADER)
        return fail(r, PKV_ECORRUPT, "header size field is damaged");
    if (hbytes > in->file_bytes)
        return fail(r, PKV_ECORRUPT, "truncated header");

    unsigned char *h = malloc(hbytes);
    if (h == NULL)
        return fail(r, PKV_ENOMEM, "out of memory");
    pkv_status st;
    if (pkvi_sfile_transfer(r->io, false, r->fd, h, hbytes, 0) != PKV_OK)
        st = fail(r, PKV_EIO, "read error");
    else
        st = pkvi_sfile_parse_header(h, hbytes, in, &r->why);
    free(h);
    return st;
}

/* The page table and the zero gap up to the first page, read in chunks of at most
 * TABLE_CHUNK entries: memory stays fixed however many pages the header claims, and
 * a table of holes (a sparse forgery) fails at its second entry, not after reading
 * gigabytes. Runs only after read_header succeeded. */
static pkv_status check_table(reader *r)
{
    const pkvi_sfile_info *in = r->info;
    const uint64_t per = in->n_pages < TABLE_CHUNK ? in->n_pages : TABLE_CHUNK;
    const uint64_t gap_off = in->header_bytes + in->n_pages * PKVI_SFILE_ENTRY_BYTES;
    const uint64_t gap = in->data_off - gap_off;   /* < PKVI_SFILE_ALIGN */
    const uint64_t cap =
        per * PKVI_SFILE_ENTRY_BYTES > gap ? per * PKVI_SFILE_ENTRY_BYTES : gap;
    unsigned char *buf = cap ? malloc((size_t)cap) : NULL;
    if (cap && buf == NULL)
        return fail(r, PKV_ENOMEM, "out of memory");
    pkv_status st = PKV_OK;
    pkvi_sfile_walk w = pkvi_sfile_walk_start(in);
    for (uint64_t k = 0; k < in->n_pages && st == PKV_OK; k += per) {
        uint64_t cnt = in->n_pages - k < per ? in->n_pages - k : per;
        if (pkvi_sfile_transfer(r->io, false, r->fd, buf, cnt * PKVI_SFILE_ENTRY_BYTES,
                                in->header_bytes + k * PKVI_SFILE_ENTRY_BYTES) != PKV_OK)
            st = fail(r, PKV_EIO, "read error");
        else if (!pkvi_sfile_walk_entries(in, &w, buf, cnt))
            st = fail(r, PKV_ECORRUPT, "page table entries out of order");
    }
    if (st == PKV_OK && w.crc != in->table_crc)
        st = fail(r, PKV_ECORRUPT, "page table checksum mismatch");
    if (st == PKV_OK && gap > 0) {
        if (pkvi_sfile_transfer(r->io, false, r->fd, buf, gap, gap_off) != PKV_OK)
            st = fail(r, PKV_EIO, "read error");
        else if (!all_zero(buf, gap))
            st = fail(r, PKV_ECORRUPT, "nonzero padding before the first page");
    }
    free(buf);
    return st;
}

/* Whether the bytes [off, off + n) of a page (given at p, i.e. page byte `off` is p[0])
 * are zero wherever they fall on the rows past `tokens` of a group's K or V (rows of
 * rk and rv bytes). */
static bool padding_zero(const unsigned char *p, uint64_t off, uint64_t n, uint32_t g,
                         uint32_t bt, uint64_t rk, uint64_t rv, uint32_t tokens)
{
    if (tokens == bt)
        return true;
    const uint64_t stride = (uint64_t)bt * (rk + rv);
    /* each group: K block then V block, each `tokens` rows then padding */
    for (uint64_t gi = off / stride; gi < g && gi * stride < off + n; gi++)
        for (int kv = 0; kv < 2; kv++) {
            const uint64_t row = kv ? rv : rk, base = gi * stride + (kv ? bt * rk : 0);
            uint64_t lo = base + (uint64_t)tokens * row, hi = base + (uint64_t)bt * row;
            if (lo < off)
                lo = off;
            if (hi > off + n)
                hi = off + n;
            if (lo < hi && !all_zero(p + (lo - off), hi - lo))
                return false;
        }
    return true;
}

/* Read every page, check its CRC (against the table entry, read again in step) and
 * padding; with s != NULL also append it to the session. Every read is bounded:
 * batches of up to PKVI_SFILE_BATCH_BYTES of whole pages; a page larger than that is read
 * whole only when it is appended (s != NULL: its size is the engine's own page
 * size), in FIRST_BATCH_BYTES pieces when it is only checked. The table entries are
 * walked (order, CRC) again here, so a table changed since check_table is caught. */
static pkv_status scan_pages(reader *r, pkv_session *s)
{
    pkvi_sfile_info *in = r->info;
    if (in->n_pages == 0)
        return PKV_OK;
    const uint64_t pb = in->page_bytes;
    const bool pieces = s == NULL && pb > PKVI_SFILE_BATCH_BYTES;
    uint64_t per = pieces || PKVI_SFILE_BATCH_BYTES / pb == 0 ? 1 : PKVI_SFILE_BATCH_BYTES / pb;
    if (per > TABLE_CHUNK)
        per = TABLE_CHUNK;
    if (per > in->n_pages)
        per = in->n_pages;
    const uint64_t piece = pieces ? FIRST_BATCH_BYTES : per * pb;
    unsigned char *buf = pkvi_sfile_alloc(piece);
    unsigned char *ents = malloc((size_t)(per * PKVI_SFILE_ENTRY_BYTES));
    if (buf == NULL || ents == NULL) {
        free(buf);
        free(ents);
        return fail(r, PKV_ENOMEM, "out of memory");
    }
    pkv_status st = PKV_OK;
    pkvi_sfile_walk w = pkvi_sfile_walk_start(in);
    /* Reads start at FIRST_BATCH_BYTES and double up to the buffer's size as pages
     * verify: a file damaged early (a forgery of holes) touches a MiB of it. */
    uint64_t step = FIRST_BATCH_BYTES;
    for (uint64_t k = 0, cnt = 0; k < in->n_pages && st == PKV_OK; k += cnt) {
        cnt = pieces ? 1 : step / pb;
        cnt = cnt < 1 ? 1 : cnt > per ? per : cnt;
        if (cnt > in->n_pages - k)
            cnt = in->n_pages - k;
        if (pkvi_sfile_transfer(r->io, false, r->fd, ents, cnt * PKVI_SFILE_ENTRY_BYTES,
                                in->header_bytes + k * PKVI_SFILE_ENTRY_BYTES) != PKV_OK) {
            st = fail(r, PKV_EIO, "read error");
            break;
        }
        pkvi_sfile_walk at = w;   /* the (layer, index) of entry k */
        if (!pkvi_sfile_walk_entries(in, &w, ents, cnt)) {
            st = fail(r, PKV_ECORRUPT, "page table entries out of order");
            break;
        }
        if (!pieces && pkvi_sfile_transfer(r->io, false, r->fd, buf, cnt * pb,
                                           in->data_off + k * pb) != PKV_OK) {
            st = fail(r, PKV_EIO, "read error");
            break;
        }
        for (uint64_t j = 0; j < cnt; j++) {
            pkvi_sfile_walk_settle(in, &at);
            uint64_t len = in->layer_len[at.layer];
            uint32_t tok = pkvi_sfile_page_tokens(len, pkvi_sfile_layer_pages(len, in->block_tokens),
                                                  at.index, in->block_tokens);
            uint32_t crc = 0;
            bool pad_ok = true;
            if (!pieces) {
                const unsigned char *page = buf + j * pb;
                crc = pkvi_crc32c(0, page, (size_t)pb);
                pad_ok = padding_zero(page, 0, pb, in->n_kv_heads, in->block_tokens,
                                      in->rows_k, in->rows_v, tok);
            } else {
                for (uint64_t o = 0, n = 0; o < pb && st == PKV_OK; o += n) {
                    n = pb - o < piece ? pb - o : piece;
                    if (pkvi_sfile_transfer(r->io, false, r->fd, buf, n,
                                            in->data_off + k * pb + o) != PKV_OK) {
                        st = fail(r, PKV_EIO, "read error");
                        break;
                    }
                    crc = pkvi_crc32c(crc, buf, (size_t)n);
                    pad_ok = padding_zero(buf, o, n, in->n_kv_heads, in->block_tokens,
                                          in->rows_k, in->rows_v, tok) && pad_ok;
                }
                if (st != PKV_OK)
                    break;
            }
            if (crc != pkvi_get32(ents + j * PKVI_SFILE_ENTRY_BYTES + 4))
                st = fail(r, PKV_ECORRUPT, "page checksum mismatch");
            else if (!pad_ok)
                st = fail(r, PKV_ECORRUPT, "nonzero padding in a partly filled page");
            if (st != PKV_OK) {
                in->bad_page = k + j;
                in->bad_layer = at.layer;
                in->bad_index = at.index;
                break;
            }
            if (s != NULL) {
                const uint32_t layer = at.layer;
                const unsigned char *page = buf + j * pb;
                /* the first page past a hole a window released (a shard's own hole
                 * [0, first / bt) is the new session's already) */
                if (at.index == in->hole_hi[layer] && at.index > in->first / in->block_tokens &&
                    at.index > 0)
                    st = pkvi_session_skip_pages(s, layer, at.index);
                if (st == PKV_OK)
                    st = pkvi_session_push_page(s, layer, page, tok);
                if (st != PKV_OK) {
                    r->why = "could not add a page to the session";
                    break;
                }
            }
            at.index = pkvi_sfile_next_index(in, at.layer, at.index);
        }
        step = step * 2 < PKVI_SFILE_BATCH_BYTES ? step * 2 : PKVI_SFILE_BATCH_BYTES;
    }
    if (st == PKV_OK && w.crc != in->table_crc)
        st = fail(r, PKV_ECORRUPT, "page table checksum mismatch");
    free(buf);
    free(ents);
    return st;
}

/* Version 3: the token ids after the last page, checked against tokens_crc. ids
 * (NULL: only check) receives them; the file's size bounded them (read_header). */
static pkv_status read_ids(reader *r, int32_t *ids)
{
    const pkvi_sfile_info *in = r->info;
    if (in->n_token_ids == 0)
        return PKV_OK;
    const uint64_t at = in->data_off + in->n_pages * in->page_bytes;
    const uint64_t chunk = TABLE_CHUNK * 4ull; /* 256 Ki ids a read */
    const uint64_t total = in->n_token_ids * 4;
    unsigned char *buf = malloc((size_t)(total < chunk ? total : chunk));
    if (!buf)
        return fail(r, PKV_ENOMEM, "out of memory");
    uint32_t crc = 0;
    pkv_status st = PKV_OK;
    for (uint64_t o = 0; o < total; o += chunk) {
        const uint64_t n = total - o < chunk ? total - o : chunk;
        if (pkvi_sfile_transfer(r->io, false, r->fd, buf, n, at + o) != PKV_OK) {
            st = fail(r, PKV_EIO, "read error");
            break;
        }
        crc = pkvi_crc32c(crc, buf, (size_t)n);
        for (uint64_t k = 0; ids && k < n / 4; k++)
            ids[o / 4 + k] = (int32_t)pkvi_get32(buf + 4 * k);
    }
    free(buf);
    if (st == PKV_OK && crc != in->tokens_crc)
        st = fail(r, PKV_ECORRUPT, "token id checksum mismatch");
    return st;
}

/* Open path and check that it is a regular file; fills info->file_bytes. The open is
 * non-blocking, so a FIFO without a writer is refused instead of waited on forever;
 * the flag is cleared once the file is known to be regular (io_uring would otherwise
 * return EAGAIN for reads that miss the page cache). */
static pkv_status open_file(reader *r, const char *path)
{
    r->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (r->fd < 0)
        return fail(r, PKV_EIO, "cannot open the file");
    struct stat st;
    if (fstat(r->fd, &st) != 0)
        return fail(r, PKV_EIO, "cannot stat the file");
    if (!S_ISREG(st.st_mode))
        return fail(r, PKV_EINVAL, "not a regular file");
    const int fl = fcntl(r->fd, F_GETFL);
    if (fl < 0 || fcntl(r->fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        return fail(r, PKV_EIO, "cannot clear O_NONBLOCK");
    r->info->file_bytes = (uint64_t)st.st_size;
    return PKV_OK;
}

static void reader_close(reader *r)
{
    if (r->fd >= 0)
        close(r->fd);
}

/* ---- the engine-free verifier (pkv_session_file_check, pagedkv inspect) -------------- */

pkv_status pkvi_sfile_verify(pkvi_io *io, const char *path, pkvi_sfile_info *info,
                             const char **why)
{
    static const char *const bad_args = "invalid arguments";
    if (why != NULL)
        *why = bad_args;
    if (io == NULL || path == NULL || info == NULL)
        return PKV_EINVAL;
    memset(info, 0, sizeof *info);
    info->bad_page = UINT64_MAX;
    reader r = {.io = io, .fd = -1, .info = info, .why = "ok"};
    pkv_status st = open_file(&r, path);
    if (st == PKV_OK)
        st = read_header(&r);
    if (st == PKV_OK)
        st = check_table(&r);
    if (st == PKV_OK)
        st = scan_pages(&r, NULL);
    if (st == PKV_OK)
        st = read_ids(&r, NULL);
    reader_close(&r);
    if (why != NULL)
        *why = r.why;
    return st;
}

pkv_status pkv_session_file_check(const char *path, pkv_file_info *info,
                                  uint64_t *layer_len, uint32_t max_layers)
{
    if (path == NULL || *path == '\0' || info == NULL)
        return PKV_EINVAL;
    pkvi_io *io = NULL;
    pkv_status st = pkvi_io_open(false, &io);
    if (st != PKV_OK)
        return st;
    pkvi_sfile_info in;
    const char *why = NULL;
    st = pkvi_sfile_verify(io, path, &in, &why);
    pkvi_io_close(io);
    pkv_file_info f;
    memset(&f, 0, sizeof f);
    f.header_sound = in.header_sound;
    f.version = in.version;
    f.n_layers = in.n_layers;
    f.n_heads = in.n_heads;
    f.n_kv_heads = in.n_kv_heads;
    f.head_dim = in.head_dim;
    f.head_dim_v = in.head_dim_v;
    for (uint32_t l = 0; in.layer_cfg != NULL && l < in.n_layers; l++)
        f.n_variant_layers += in.layer_cfg[l].window || in.layer_cfg[l].softcap > 0.0f ||
                              in.layer_cfg[l].sink_logits;
    f.block_tokens = in.block_tokens;
    f.kv_dtype = pkvi_sfile_code_dtype(in.dtype_code);
    uint32_t bits = in.scale_bits;
    memcpy(&f.scale, &bits, sizeof f.scale);
    f.page_bytes = in.page_bytes;
    f.n_pages = in.n_pages;
    f.data_offset = in.data_off;
    f.file_bytes = in.file_bytes;
    for (uint32_t l = 0; in.layer_len != NULL && l < in.n_layers; l++) {
        f.tokens += in.layer_len[l];
        if (layer_len != NULL && l < max_layers)
            layer_len[l] = in.layer_len[l];
    }
    f.bad_page = in.bad_page;
    f.bad_layer = in.bad_layer;
    f.bad_index = in.bad_index;
    f.n_token_ids = in.n_token_ids;
    if (st != PKV_OK && why != NULL)
        snprintf(f.reason, sizeof f.reason, "%s", why);
    pkvi_sfile_info_free(&in);
    *info = f;
    return st;
}

/* ---- loading into an engine ---------------------------------------------------------- */

pkv_status pkvi_session_load_io(const pkvi_ctx *ctx, const char *path, pkvi_io *io,
                                pkv_session **out, const char **why)
{
    if (why != NULL)
        *why = "invalid arguments";
    if (ctx == NULL || path == NULL || io == NULL || out == NULL)
        return PKV_EINVAL;
    pkvi_sfile_info info;
    memset(&info, 0, sizeof info);
    info.bad_page = UINT64_MAX;
    reader r = {.io = io, .fd = -1, .info = &info, .why = "ok"};
    pkv_session *s = NULL;
    pkv_status st = open_file(&r, path);
    if (st == PKV_OK) {
        st = read_header(&r);
        /* A header that is sound but of another engine says so even when the layout
         * checks after the CRC failed: the caller's real problem is the mismatch. And
         * it says so before anything past the header is read: a file of another
         * geometry may claim any number of pages. */
        if (info.header_sound && (st == PKV_OK || st == PKV_ECORRUPT)) {
            const char *why0 = r.why;
            pkv_status mst = pkvi_sfile_match_engine(&info, ctx->geom, &r.why);
            if (mst != PKV_OK)
                st = mst;
            else
                r.why = why0;
        }
    }
    if (st == PKV_OK)
        st = check_table(&r);
    if (st == PKV_OK)
        st = scan_pages(&r, NULL);                 /* pass 1: verify everything */
    int32_t *ids = NULL;
    if (st == PKV_OK && info.n_token_ids) {       /* bounded by the file's size */
        ids = info.n_token_ids <= SIZE_MAX / 4 ? malloc((size_t)info.n_token_ids * 4) : NULL;
        st = ids ? read_ids(&r, ids) : fail(&r, PKV_ENOMEM, "out of memory");
    }
    if (st == PKV_OK) {
        st = pkvi_session_create(ctx, &s);
        if (st != PKV_OK)
            r.why = "could not create the session";
    }
    if (st == PKV_OK && info.first) {             /* a shard (version 4) */
        st = pkv_session_set_first(s, info.first);
        if (st != PKV_OK)
            r.why = "could not make the session a shard";
    }
    if (st == PKV_OK)
        st = scan_pages(&r, s);                    /* pass 2: check again, build */
    if (st == PKV_OK && ids) {  /* the token record (docs/prefix-cache.md), indexed */
        st = pkvi_session_set_tokens(s, info.n_token_ids, ids);
        if (st != PKV_OK)
            r.why = "could not record the token ids";
    }
    free(ids);
    if (st == PKV_OK)
        pkvi_sfile_rope_apply(&info, s);  /* version 5: stale rows, record limit */
    if (st != PKV_OK) {
        pkv_session_destroy(s);
        s = NULL;
    }
    reader_close(&r);
    pkvi_sfile_info_free(&info);
    if (why != NULL)
        *why = r.why;
    if (st == PKV_OK)
        *out = s;
    return st;
}

pkv_status pkvi_session_load(const pkvi_ctx *ctx, const char *path, pkv_session **out)
{
    /* "" is EINVAL, as pkv_session_save says: the same bad input, the same status */
    if (path == NULL || *path == '\0' || out == NULL)
        return pkvi_fail(ctx->errs, PKV_EINVAL, "pkv_session_load: %s",
                         out == NULL ? "out is NULL" : path ? "path is empty" : "path is NULL");
    pkvi_io *io = NULL;
    pkv_status st = pkvi_cache_file_io(ctx->cache, &io);
    if (st != PKV_OK)
        return pkvi_fail(ctx->errs, st, "pkv_session_load: out of memory");
    const char *why = NULL;
    st = pkvi_session_load_io(ctx, path, io, out, &why);
    if (st != PKV_OK)
        return pkvi_fail(ctx->errs, st, "pkv_session_load: %s: %s", path,
                         why ? why : "failed");
    return st;
}

/*
 * persist/load.c - reading session files: pkv_session_load, and the engine-free
 * verifier behind pkv_session_file_check and `pagedkv inspect`. The layout is
 * persist/format.h (docs/file-format.md); a file is hostile input until checked.
 *
 * Owns: the validation of a session file (header, page table, every page's CRC and
 *   padding, the token ids), the mapping of what is wrong to a status and a reason,
 *   and building a session from a file that passed. Does not own: the layout and its
 *   codecs (persist/format.h), writing files (persist/save.c), sessions and pages
 *   (session.c: pkvi_session_create; session/write.c: pkvi_session_push_page/
 *   skip_pages; session/reuse.c: pkvi_session_set_tokens), which it builds from the
 *   engine's contexts (pkvi_ctx: the geometry it compares a file with, the error sink),
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
    uint32_t header_bytes;   /* where the page table starts */
    uint32_t table_crc;      /* the header's CRC of the page table */
    uint64_t rows_k, rows_v; /* bytes of one K row, one V row of one group */
    const char *why;
} reader;

static pkv_status fail(reader *r, pkv_status st, const char *why)
{
    r->why = why;
    return st;
}

/* Pages of layer `len` positions: ceil(len / bt). */
static uint64_t layer_pages(uint64_t len, uint32_t bt)
{
    return len / bt + (len % bt != 0);
}

static bool all_zero(const unsigned char *p, uint64_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, (size_t)(n - 1)) == 0);
}

/* Bytes of a stored row of n values of a file dtype code; 0 for a code `version`
 * does not know (v1: 0..2; v2: 0..4). */
static uint64_t code_row_bytes(uint32_t version, uint32_t code, uint32_t n)
{
    if (code > (version >= 2 ? 4u : 2u))
        return 0;
    return pkv_row_bytes(pkvi_sfile_code_dtype(code), n);
}

/* Magic, header CRC, version; then the version-1 fields into r->info and their
 * consistency with each other and with the file's size. Reads nothing past the
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
    pkv_status st = PKV_OK;
    if (pkvi_sfile_transfer(r->io, false, r->fd, h, hbytes, 0) != PKV_OK) {
        st = fail(r, PKV_EIO, "read error");
        goto out;
    }
    if (pkvi_crc32c(0, h, hbytes - 4) != pkvi_get32(h + hbytes - 4)) {
        st = fail(r, PKV_ECORRUPT, "header checksum mismatch");
        goto out;
    }
    in->version = pkvi_get32(h + PKVI_SFILE_OFF_VERSION);
    if (in->version < 1 || in->version > PKVI_SFILE_VERSION) {
        st = fail(r, PKV_EINVAL, "unsupported format version");
        goto out;
    }
    in->n_layers = pkvi_get32(h + PKVI_SFILE_OFF_N_LAYERS);
    const uint64_t v1_bytes = PKVI_SFILE_HEADER_FIXED + 8ull * in->n_layers;
    const uint64_t v2_min =
        v1_bytes + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * in->n_layers;
    if (in->n_layers == 0 || (in->version == 1 && hbytes != v1_bytes) ||
        (in->version >= 2 && hbytes < v2_min)) {
        st = fail(r, PKV_ECORRUPT, "header size does not match its layer count");
        goto out;
    }
    in->n_heads = pkvi_get32(h + PKVI_SFILE_OFF_N_HEADS);
    in->n_kv_heads = pkvi_get32(h + PKVI_SFILE_OFF_N_KV_HEADS);
    in->head_dim = pkvi_get32(h + PKVI_SFILE_OFF_HEAD_DIM);
    in->dtype_code = pkvi_get32(h + PKVI_SFILE_OFF_DTYPE);
    in->block_tokens = pkvi_get32(h + PKVI_SFILE_OFF_BLOCK_TOKENS);
    in->scale_bits = pkvi_get32(h + PKVI_SFILE_OFF_SCALE);
    in->page_bytes = pkvi_get64(h + PKVI_SFILE_OFF_PAGE_BYTES);
    in->n_pages = pkvi_get64(h + PKVI_SFILE_OFF_N_PAGES);
    in->data_off = pkvi_get64(h + PKVI_SFILE_OFF_DATA_OFF);
    /* n_layers < hbytes / 8: bounded like the header itself */
    in->layer_len = malloc(sizeof(uint64_t) * in->n_layers);
    if (in->layer_len == NULL) {
        st = fail(r, PKV_ENOMEM, "out of memory");
        goto out;
    }
    for (uint32_t l = 0; l < in->n_layers; l++)
        in->layer_len[l] = pkvi_get64(h + PKVI_SFILE_OFF_LAYER_LEN + 8ull * l);
    /* version 2: V width, per-layer variants, released pages, sink logits */
    in->head_dim_v = pkvi_get32(h + PKVI_SFILE_OFF_HEAD_DIM);
    in->layer_cfg = calloc(in->n_layers, sizeof *in->layer_cfg);
    in->hole_hi = calloc(in->n_layers, sizeof *in->hole_hi);
    if (in->layer_cfg == NULL || in->hole_hi == NULL) {
        st = fail(r, PKV_ENOMEM, "out of memory");
        goto out;
    }
    bool ext_ok = true;
    if (in->version >= 2) {
        const unsigned char *x = h + v1_bytes - 4; /* where v1's CRC would be */
        in->head_dim_v = pkvi_get32(x);
        ext_ok = pkvi_get32(x + 4) == 0;
        uint64_t n_logit_layers = 0;
        for (uint32_t l = 0; l < in->n_layers; l++) {
            const unsigned char *y =
                x + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * l;
            pkv_layer_config *lc = &in->layer_cfg[l];
            lc->window = pkvi_get32(y);
            lc->sink_tokens = pkvi_get32(y + 4);
            lc->rollback_tokens = pkvi_get32(y + 8);
            const uint32_t cap = pkvi_get32(y + 12);
            memcpy(&lc->softcap, &cap, sizeof cap);
            const uint32_t has = pkvi_get32(y + 16);
            ext_ok = ext_ok && has <= 1 && pkvi_get32(y + 20) == 0;
            n_logit_layers += has == 1;
            in->hole_hi[l] = pkvi_get64(y + 24);
        }
        /* the logits follow; the header's size must be exactly what they need */
        uint64_t want = 0;
        if (!pkvi_mul(n_logit_layers, 4ull * in->n_heads, &want) ||
            !pkvi_add(want, v2_min + (in->version >= 3 ? PKVI_SFILE_V3_EXTRA : 0) +
                                pkvi_sfile_v4_bytes(in->version, in->n_layers), &want) ||
            want != hbytes) {
            st = fail(r, PKV_ECORRUPT, "header size does not match its layer count");
            goto out;
        }
        if (n_logit_layers) { /* bounded by the header's size */
            in->logits = malloc((size_t)(n_logit_layers * 4 * in->n_heads));
            if (in->logits == NULL) {
                st = fail(r, PKV_ENOMEM, "out of memory");
                goto out;
            }
        }
        const unsigned char *z =
            x + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * in->n_layers;
        float *next = in->logits;
        for (uint32_t l = 0; l < in->n_layers; l++) {
            const unsigned char *y =
                x + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * l;
            if (pkvi_get32(y + 16) != 1)
                continue;
            for (uint32_t i = 0; i < in->n_heads; i++, z += 4) {
                const uint32_t b = pkvi_get32(z);
                memcpy(&next[i], &b, sizeof b);
            }
            in->layer_cfg[l].sink_logits = next;
            next += in->n_heads;
        }
        if (in->version >= 3) { /* the token record */
            const unsigned char *t3 = h + hbytes - 4 -
                                      pkvi_sfile_v4_bytes(in->version, in->n_layers) -
                                      PKVI_SFILE_V3_EXTRA;
            in->n_token_ids = pkvi_get64(t3);
            in->tokens_crc = pkvi_get32(t3 + 8);
            ext_ok = ext_ok && pkvi_get32(t3 + 12) == 0;
        }
    }
    in->header_sound = true;
    if ((st = pkvi_sfile_read_v4(h, hbytes, in, &r->why)) != PKV_OK)
        goto out;

    /* Internal consistency of a header whose CRC matched: our writer never produces
     * these, so they are damage (or a forged file), not another format. */
    uint32_t g = in->n_kv_heads, bt = in->block_tokens;
    if (pkvi_get32(h + PKVI_SFILE_OFF_FLAGS) != 0 ||
        pkvi_get32(h + PKVI_SFILE_OFF_RESERVED) != 0) {
        st = fail(r, PKV_ECORRUPT, "reserved header fields are not zero");
        goto out;
    }
    if (code_row_bytes(in->version, in->dtype_code, 1) == 0) {
        st = fail(r, PKV_EINVAL, "unknown dtype code");
        goto out;
    }
    if (!ext_ok) {
        st = fail(r, PKV_ECORRUPT, "reserved header fields are not zero");
        goto out;
    }
    if (in->n_heads == 0 || g == 0 || in->n_heads % g != 0 || in->head_dim == 0 ||
        in->head_dim_v == 0 || bt == 0) {
        st = fail(r, PKV_ECORRUPT, "header geometry is invalid");
        goto out;
    }
    const uint64_t rk = code_row_bytes(in->version, in->dtype_code, in->head_dim);
    const uint64_t rv = code_row_bytes(in->version, in->dtype_code, in->head_dim_v);
    uint64_t pb = 0, n_pages = 0, end = 0;
    bool ok = pkvi_mul(rk + rv, bt, &pb) && pkvi_mul(pb, g, &pb);
    for (uint32_t l = 0; ok && l < in->n_layers; l++) {
        /* a layer's pages less those its window released: [sink pages, hole_hi) */
        const pkv_layer_config *lc = &in->layer_cfg[l];
        const uint64_t np = layer_pages(in->layer_len[l], bt), sp = pkvi_window_sink_pages(lc, bt);
        const uint64_t hole = in->hole_hi[l] ? in->hole_hi[l] - sp : 0;
        const uint64_t keep = pkvi_window_keep_from(lc, in->layer_len[l], bt);
        ok = (lc->window || (!lc->sink_tokens && !lc->rollback_tokens && !in->hole_hi[l])) &&
             (!in->hole_hi[l] || (in->hole_hi[l] > sp && in->hole_hi[l] <= keep &&
                                  in->hole_hi[l] < np)) &&
             isfinite(lc->softcap) && lc->softcap >= 0.0f &&
             pkvi_add(n_pages, np - hole, &n_pages);
    }
    /* version 3: at most as many ids as every layer has positions (load records them) */
    for (uint32_t l = 0; ok && l < in->n_layers; l++)
        ok = in->n_token_ids <= in->layer_len[l];
    uint64_t table_end = 0, ids_bytes = 0;
    ok = ok && pkvi_mul(in->n_token_ids, 4, &ids_bytes) &&
         pkvi_mul(in->n_pages, PKVI_SFILE_ENTRY_BYTES, &table_end) &&
         pkvi_add(table_end, hbytes, &table_end) && table_end <= UINT64_MAX - PKVI_SFILE_ALIGN;
    if (!ok || pb != in->page_bytes || n_pages != in->n_pages ||
        pkvi_get64(h + PKVI_SFILE_OFF_TABLE_OFF) != hbytes ||
        in->data_off != pkvi_align_up(table_end, PKVI_SFILE_ALIGN) ||
        !pkvi_mul(in->n_pages, pb, &end) || !pkvi_add(end, in->data_off, &end) ||
        !pkvi_add(end, ids_bytes, &end)) {
        st = fail(r, PKV_ECORRUPT, "header fields are inconsistent");
        goto out;
    }
    r->rows_k = rk;
    r->rows_v = rv;
    r->header_bytes = hbytes;
    r->table_crc = pkvi_get32(h + PKVI_SFILE_OFF_TABLE_CRC);
    if (in->file_bytes < end) {
        st = fail(r, PKV_ECORRUPT, "truncated file");
        goto out;
    }
    if (in->file_bytes > end) {
        st = fail(r, PKV_ECORRUPT, "trailing bytes after the last page (and token ids)");
        goto out;
    }
out:
    free(h);
    return st;
}

/* Walks the page table in file order, entry by entry, whatever chunks it is read in:
 * the (layer, index) every entry must hold, and the CRC of the entries so far. */
typedef struct {
    uint32_t layer;
    uint64_t index;          /* within `layer` */
    uint32_t crc;            /* CRC-32C of the entries walked */
} table_walk;

/* The first page index of layer l the file holds, and the one after idx: a windowed
 * layer's released pages [sink pages, hole_hi) are not in the file. */
static uint64_t first_index(const pkvi_sfile_info *in, uint32_t l)
{
    return in->hole_hi[l] && pkvi_window_sink_pages(&in->layer_cfg[l], in->block_tokens) == 0
               ? in->hole_hi[l] : 0;
}

static uint64_t next_index(const pkvi_sfile_info *in, uint32_t l, uint64_t idx)
{
    idx++;
    if (in->hole_hi[l] && idx == pkvi_window_sink_pages(&in->layer_cfg[l], in->block_tokens))
        idx = in->hole_hi[l];
    return idx;
}

/* Move w to the next layer that has pages to hold, when its current one is done. */
static void walk_settle(const pkvi_sfile_info *in, table_walk *w)
{
    while (w->index >= layer_pages(in->layer_len[w->layer], in->block_tokens) &&
           w->layer + 1 < in->n_layers) {
        w->layer++;
        w->index = first_index(in, w->layer);
    }
}

static table_walk walk_start(const pkvi_sfile_info *in)
{
    table_walk w = {0, first_index(in, 0), 0};
    return w;
}

/* Check entries [0, n) of buf (the next n of the table) against their expected
 * (layer, index), folding them into the CRC. False at the first one out of order. */
static bool walk_entries(const pkvi_sfile_info *in, table_walk *w, const unsigned char *buf,
                         uint64_t n)
{
    w->crc = pkvi_crc32c(w->crc, buf, (size_t)(n * PKVI_SFILE_ENTRY_BYTES));
    for (uint64_t k = 0; k < n; k++) {
        walk_settle(in, w);
        const unsigned char *ent = buf + k * PKVI_SFILE_ENTRY_BYTES;
        if (pkvi_get32(ent) != w->layer || pkvi_get64(ent + 8) != w->index)
            return false;
        w->index = next_index(in, w->layer, w->index);
    }
    return true;
}

/* The page table and the zero gap up to the first page, read in chunks of at most
 * TABLE_CHUNK entries: memory stays fixed however many pages the header claims, and
 * a table of holes (a sparse forgery) fails at its second entry, not after reading
 * gigabytes. Runs only after read_header succeeded. */
static pkv_status check_table(reader *r)
{
    const pkvi_sfile_info *in = r->info;
    const uint64_t per = in->n_pages < TABLE_CHUNK ? in->n_pages : TABLE_CHUNK;
    const uint64_t gap_off = r->header_bytes + in->n_pages * PKVI_SFILE_ENTRY_BYTES;
    const uint64_t gap = in->data_off - gap_off;   /* < PKVI_SFILE_ALIGN */
    const uint64_t cap =
        per * PKVI_SFILE_ENTRY_BYTES > gap ? per * PKVI_SFILE_ENTRY_BYTES : gap;
    unsigned char *buf = cap ? malloc((size_t)cap) : NULL;
    if (cap && buf == NULL)
        return fail(r, PKV_ENOMEM, "out of memory");
    pkv_status st = PKV_OK;
    table_walk w = walk_start(in);
    for (uint64_t k = 0; k < in->n_pages && st == PKV_OK; k += per) {
        uint64_t cnt = in->n_pages - k < per ? in->n_pages - k : per;
        if (pkvi_sfile_transfer(r->io, false, r->fd, buf, cnt * PKVI_SFILE_ENTRY_BYTES,
                                r->header_bytes + k * PKVI_SFILE_ENTRY_BYTES) != PKV_OK)
            st = fail(r, PKV_EIO, "read error");
        else if (!walk_entries(in, &w, buf, cnt))
            st = fail(r, PKV_ECORRUPT, "page table entries out of order");
    }
    if (st == PKV_OK && w.crc != r->table_crc)
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
    table_walk w = walk_start(in);
    /* Reads start at FIRST_BATCH_BYTES and double up to the buffer's size as pages
     * verify: a file damaged early (a forgery of holes) touches a MiB of it. */
    uint64_t step = FIRST_BATCH_BYTES;
    for (uint64_t k = 0, cnt = 0; k < in->n_pages && st == PKV_OK; k += cnt) {
        cnt = pieces ? 1 : step / pb;
        cnt = cnt < 1 ? 1 : cnt > per ? per : cnt;
        if (cnt > in->n_pages - k)
            cnt = in->n_pages - k;
        if (pkvi_sfile_transfer(r->io, false, r->fd, ents, cnt * PKVI_SFILE_ENTRY_BYTES,
                                r->header_bytes + k * PKVI_SFILE_ENTRY_BYTES) != PKV_OK) {
            st = fail(r, PKV_EIO, "read error");
            break;
        }
        table_walk at = w;   /* the (layer, index) of entry k */
        if (!walk_entries(in, &w, ents, cnt)) {
            st = fail(r, PKV_ECORRUPT, "page table entries out of order");
            break;
        }
        if (!pieces && pkvi_sfile_transfer(r->io, false, r->fd, buf, cnt * pb,
                                           in->data_off + k * pb) != PKV_OK) {
            st = fail(r, PKV_EIO, "read error");
            break;
        }
        for (uint64_t j = 0; j < cnt; j++) {
            walk_settle(in, &at);
            uint64_t len = in->layer_len[at.layer];
            uint32_t tok = pkvi_sfile_page_tokens(len, layer_pages(len, in->block_tokens),
                                                  at.index, in->block_tokens);
            uint32_t crc = 0;
            bool pad_ok = true;
            if (!pieces) {
                const unsigned char *page = buf + j * pb;
                crc = pkvi_crc32c(0, page, (size_t)pb);
                pad_ok = padding_zero(page, 0, pb, in->n_kv_heads, in->block_tokens,
                                      r->rows_k, r->rows_v, tok);
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
                                          r->rows_k, r->rows_v, tok) && pad_ok;
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
                if (at.index == in->hole_hi[layer] && at.index > 0) /* past the hole */
                    st = pkvi_session_skip_pages(s, layer, at.index);
                if (st == PKV_OK)
                    st = pkvi_session_push_page(s, layer, page, tok);
                if (st != PKV_OK) {
                    r->why = "could not add a page to the session";
                    break;
                }
            }
            at.index = next_index(in, at.layer, at.index);
        }
        step = step * 2 < PKVI_SFILE_BATCH_BYTES ? step * 2 : PKVI_SFILE_BATCH_BYTES;
    }
    if (st == PKV_OK && w.crc != r->table_crc)
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

void pkvi_sfile_info_free(pkvi_sfile_info *info)
{
    if (info == NULL)
        return;
    free(info->layer_len);
    free(info->layer_cfg);
    free(info->logits);
    free(info->hole_hi);
    free(info->stale);
    info->stale = NULL;
    info->layer_len = NULL;
    info->layer_cfg = NULL;
    info->logits = NULL;
    info->hole_hi = NULL;
}

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

/* A sound header of another engine is another format for this engine: EINVAL. */
static pkv_status match_engine(reader *r, const pkvi_geom *geo)
{
    const pkvi_sfile_info *in = r->info;
    const pkv_config *c = &geo->cfg;
    uint32_t code = 0;
    if (in->n_layers != c->n_layers || in->n_heads != c->n_heads ||
        in->n_kv_heads != c->n_kv_heads || in->head_dim != c->head_dim ||
        in->head_dim_v != c->head_dim_v)
        return fail(r, PKV_EINVAL, "the file's geometry differs from the engine's");
    /* every layer's variant (a version-1 file's are all plain causal) */
    for (uint32_t l = 0; l < in->n_layers; l++) {
        const pkv_layer_config *a = &in->layer_cfg[l], *b = &geo->layers[l];
        bool same = a->window == b->window && a->sink_tokens == b->sink_tokens &&
                    a->rollback_tokens == b->rollback_tokens &&
                    pkvi_float_bits(a->softcap) == pkvi_float_bits(b->softcap) &&
                    !a->sink_logits == !b->sink_logits;
        for (uint32_t i = 0; same && a->sink_logits && i < in->n_heads; i++)
            same = pkvi_float_bits(a->sink_logits[i]) == pkvi_float_bits(b->sink_logits[i]);
        if (!same)
            return fail(r, PKV_EINVAL, "the file's attention variants differ from the engine's");
    }
    if (!pkvi_sfile_rope_match(in, geo))
        return fail(r, PKV_EINVAL, "the file's RoPE config differs from the engine's");
    if (!pkvi_sfile_dtype_code(c->kv_dtype, &code) || code != in->dtype_code)
        return fail(r, PKV_EINVAL, "the file's dtype differs from the engine's");
    if (in->block_tokens != c->block_tokens)
        return fail(r, PKV_EINVAL, "the file's block size differs from the engine's");
    if (in->scale_bits != pkvi_float_bits(c->scale))
        return fail(r, PKV_EINVAL, "the file's softmax scale differs from the engine's");
    return PKV_OK;
}

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
            pkv_status mst = match_engine(&r, ctx->geom);
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
    if (st == PKV_OK)
        st = scan_pages(&r, s);                    /* pass 2: check again, build */
    if (st == PKV_OK && ids) {  /* the token record (docs/prefix-cache.md), indexed */
        st = pkvi_session_set_tokens(s, info.n_token_ids, ids);
        if (st != PKV_OK)
            r.why = "could not record the token ids";
    }
    free(ids);
    if (st == PKV_OK)
        pkvi_sfile_rope_apply(&info, s);
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
        return PKV_EINVAL;
    pkvi_io *io = NULL;
    pkv_status st = pkvi_io_open(false, &io);
    if (st != PKV_OK)
        return st;
    const char *why = NULL;
    st = pkvi_session_load_io(ctx, path, io, out, &why);
    pkvi_io_close(io);
    if (st != PKV_OK)
        return pkvi_fail(ctx->errs, st, "pkv_session_load: %s: %s", path,
                         why ? why : "failed");
    return st;
}

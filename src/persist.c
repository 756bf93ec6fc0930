/*
 * persist.c - session files: pkv_session_save, pkv_session_load and the engine-free
 * verifier behind `pagedkv inspect`. The format is docs/file-format.md; this file
 * and that document change together (a layout change bumps PKVI_SFILE_VERSION).
 *
 * Owns: the byte layout of a session file, its validation, the atomic-save protocol
 *   (a locked 0600 temporary in the target's directory - unnamed with O_TMPFILE,
 *   else named O_EXCL - write, fsync, link, rename, directory fsync) and the removal
 *   of temporaries that killed saves left (clean_stale).
 * Does not own: sessions and pages (session.c: pkvi_session_acquire/release/
 *   push_page), the I/O backends (io.c, io_uring.c), the checksum (crc32c.c).
 *
 * Invariants:
 *   - Nothing of a file is trusted before it is checked: sizes are bounded by the
 *     file's real size before anything is allocated from them; arithmetic on file
 *     fields is checked (pkvi_mul/pkvi_add).
 *   - Memory does not follow a file's claims: the header is at most
 *     PKVI_SFILE_MAX_HEADER, the page table is streamed in TABLE_CHUNK entries, pages
 *     in batches of at most BATCH_BYTES (a bigger page in pieces, unless it is being
 *     loaded: then it is the engine's own page size). A refused file costs at most
 *     about 18 MiB of buffers, whatever its header says.
 *   - Load compares a sound header with the engine before reading anything past it.
 *   - Load validates the whole file (header, page table, every page's CRC and
 *     padding) before it creates the session, then builds it while checking every
 *     page again (the file may change between the passes); any failure destroys the
 *     half-built session: a load either returns a whole session or nothing.
 *   - Save never writes memory it did not define: rows past a layer's length in its
 *     last page are written as zeros (and load insists they are zero).
 *   - Save either replaces the target with a complete, fsynced file or leaves it as
 *     it was and removes its temporary file (a failing close or directory fsync,
 *     after the rename, is the one exception: the new file is in place, durability
 *     unknown). Killed, it leaves the target old or new; with O_TMPFILE nothing else
 *     (but in the microseconds between link and rename), and whatever it left is
 *     removed by the next save to the directory: a save's temporary is flock'ed from
 *     creation until after the rename, so an unlocked one is a dead save's.
 *
 * Error mapping (SPEC §5): not a session file (magic), or a sound header (CRC
 *   matches) of another version / geometry / dtype / block size / scale -> EINVAL;
 *   any other damage (header or page CRC, truncation, trailing bytes, nonzero
 *   padding, inconsistent fields) -> ECORRUPT; failing system calls -> EIO.
 */
#include "io_backend.h"
#include "session.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- the layout (docs/file-format.md) ------------------------------------------------ */

static const unsigned char sfile_magic[8] = {0x89, 'P', 'K', 'V', '\r', '\n', 0x1a, '\n'};

enum {
    OFF_MAGIC = 0, OFF_VERSION = 8, OFF_HEADER_BYTES = 12, OFF_N_LAYERS = 16,
    OFF_N_HEADS = 20, OFF_N_KV_HEADS = 24, OFF_HEAD_DIM = 28, OFF_DTYPE = 32,
    OFF_BLOCK_TOKENS = 36, OFF_SCALE = 40, OFF_FLAGS = 44, OFF_PAGE_BYTES = 48,
    OFF_N_PAGES = 56, OFF_TABLE_OFF = 64, OFF_DATA_OFF = 72, OFF_TABLE_CRC = 80,
    OFF_RESERVED = 84, OFF_LAYER_LEN = 88,
    HEADER_FIXED = 92,     /* v1: header_bytes = HEADER_FIXED + 8 * n_layers */
    V2_EXTRA = 8,          /* v2, after layer_len: head_dim_v u32, reserved u32 */
    V2_LAYER = 32,         /* v2, then per layer: window, sink_tokens, rollback_tokens,
                              softcap bits, has_sink_logits, reserved (u32 each),
                              hole_hi (u64); then n_heads f32 logits per flagged layer */
    V3_EXTRA = 16,         /* v3, after the v2 fields: n_token_ids u64, tokens_crc u32,
                              reserved u32; the ids follow the last page */
    PREFIX_BYTES = 16,     /* magic, version, header_bytes: the same in every version */
    ENTRY_BYTES = 16,      /* page-table entry: layer u32, crc u32, index u64 */
};

/* Reads and writes are cut into requests of this size so io_uring keeps several in
 * flight; batches of pages are read into a buffer of about BATCH_BYTES. */
#define REQ_BYTES (1ull << 20)
#define BATCH_BYTES (16ull << 20)
/* The first batch of pages read; later ones double up to BATCH_BYTES. */
#define FIRST_BATCH_BYTES (1ull << 20)
/* The page table is read in chunks of at most this many entries (1 MiB). */
#define TABLE_CHUNK 65536u
/* Save writes pages of at least this size straight from pool memory; smaller pages
 * (and every partly filled last page) are gathered in a staging buffer first so one
 * request moves many of them. */
#define DIRECT_MIN (64ull << 10)

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static void put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get32(const unsigned char *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static uint64_t get64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static bool dtype_to_code(pkv_dtype t, uint32_t *code)
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
static pkv_dtype code_to_dtype(uint32_t code)
{
    static const pkv_dtype t[] = {PKV_F32, PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};
    return t[code < 5 ? code : 0];
}

/* Bytes of a stored row of n values of a file dtype code; 0 for a code `version`
 * does not know (v1: 0..2; v2: 0..4). */
static uint64_t code_row_bytes(uint32_t version, uint32_t code, uint32_t n)
{
    if (code > (version >= 2 ? 4u : 2u))
        return 0;
    return pkv_row_bytes(code_to_dtype(code), n);
}


static uint32_t float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static bool all_zero(const unsigned char *p, uint64_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, (size_t)(n - 1)) == 0);
}

static uint64_t align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

static void *alloc_aligned(uint64_t bytes)
{
    if (bytes == 0 || bytes > SIZE_MAX - PKVI_SFILE_ALIGN)
        return NULL;
    return aligned_alloc(PKVI_SFILE_ALIGN, (size_t)align_up(bytes, PKVI_SFILE_ALIGN));
}

/* One contiguous transfer, cut into REQ_BYTES requests submitted together. */
static pkv_status transfer(pkvi_io *io, bool write, int fd, void *buf, uint64_t len,
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

/* ---- reading and checking a file ----------------------------------------------------- */

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

/* Magic, header CRC, version; then the version-1 fields into r->info and their
 * consistency with each other and with the file's size. Reads nothing past the
 * header: its one allocation is bounded by PKVI_SFILE_MAX_HEADER and the file's size,
 * whatever the header claims. */
static pkv_status read_header(reader *r)
{
    pkvi_sfile_info *in = r->info;
    unsigned char pre[PREFIX_BYTES];
    uint64_t have = in->file_bytes < PREFIX_BYTES ? in->file_bytes : PREFIX_BYTES;
    if (have > 0 && transfer(r->io, false, r->fd, pre, have, 0) != PKV_OK)
        return fail(r, PKV_EIO, "read error");
    uint64_t m = have < 8 ? have : 8;
    if (memcmp(pre, sfile_magic, (size_t)m) != 0)
        return fail(r, PKV_EINVAL, "not a pagedkv session file (bad magic)");
    if (have < PREFIX_BYTES)
        return fail(r, PKV_ECORRUPT, "truncated header");
    uint32_t hbytes = get32(pre + OFF_HEADER_BYTES);
    if (hbytes < PREFIX_BYTES + 4 || hbytes > PKVI_SFILE_MAX_HEADER)
        return fail(r, PKV_ECORRUPT, "header size field is damaged");
    if (hbytes > in->file_bytes)
        return fail(r, PKV_ECORRUPT, "truncated header");

    unsigned char *h = malloc(hbytes);
    if (h == NULL)
        return fail(r, PKV_ENOMEM, "out of memory");
    pkv_status st = PKV_OK;
    if (transfer(r->io, false, r->fd, h, hbytes, 0) != PKV_OK) {
        st = fail(r, PKV_EIO, "read error");
        goto out;
    }
    if (pkvi_crc32c(0, h, hbytes - 4) != get32(h + hbytes - 4)) {
        st = fail(r, PKV_ECORRUPT, "header checksum mismatch");
        goto out;
    }
    in->version = get32(h + OFF_VERSION);
    if (in->version < 1 || in->version > PKVI_SFILE_VERSION) {
        st = fail(r, PKV_EINVAL, "unsupported format version");
        goto out;
    }
    in->n_layers = get32(h + OFF_N_LAYERS);
    const uint64_t v1_bytes = HEADER_FIXED + 8ull * in->n_layers;
    const uint64_t v2_min = v1_bytes + V2_EXTRA + (uint64_t)V2_LAYER * in->n_layers;
    if (in->n_layers == 0 || (in->version == 1 && hbytes != v1_bytes) ||
        (in->version >= 2 && hbytes < v2_min)) {
        st = fail(r, PKV_ECORRUPT, "header size does not match its layer count");
        goto out;
    }
    in->n_heads = get32(h + OFF_N_HEADS);
    in->n_kv_heads = get32(h + OFF_N_KV_HEADS);
    in->head_dim = get32(h + OFF_HEAD_DIM);
    in->dtype_code = get32(h + OFF_DTYPE);
    in->block_tokens = get32(h + OFF_BLOCK_TOKENS);
    in->scale_bits = get32(h + OFF_SCALE);
    in->page_bytes = get64(h + OFF_PAGE_BYTES);
    in->n_pages = get64(h + OFF_N_PAGES);
    in->data_off = get64(h + OFF_DATA_OFF);
    /* n_layers < hbytes / 8: bounded like the header itself */
    in->layer_len = malloc(sizeof(uint64_t) * in->n_layers);
    if (in->layer_len == NULL) {
        st = fail(r, PKV_ENOMEM, "out of memory");
        goto out;
    }
    for (uint32_t l = 0; l < in->n_layers; l++)
        in->layer_len[l] = get64(h + OFF_LAYER_LEN + 8ull * l);
    /* version 2: V width, per-layer variants, released pages, sink logits */
    in->head_dim_v = get32(h + OFF_HEAD_DIM);
    in->layer_cfg = calloc(in->n_layers, sizeof *in->layer_cfg);
    in->hole_hi = calloc(in->n_layers, sizeof *in->hole_hi);
    if (in->layer_cfg == NULL || in->hole_hi == NULL) {
        st = fail(r, PKV_ENOMEM, "out of memory");
        goto out;
    }
    bool ext_ok = true;
    if (in->version >= 2) {
        const unsigned char *x = h + v1_bytes - 4; /* where v1's CRC would be */
        in->head_dim_v = get32(x);
        ext_ok = get32(x + 4) == 0;
        uint64_t n_logit_layers = 0;
        for (uint32_t l = 0; l < in->n_layers; l++) {
            const unsigned char *y = x + V2_EXTRA + (uint64_t)V2_LAYER * l;
            pkv_layer_config *lc = &in->layer_cfg[l];
            lc->window = get32(y);
            lc->sink_tokens = get32(y + 4);
            lc->rollback_tokens = get32(y + 8);
            const uint32_t cap = get32(y + 12);
            memcpy(&lc->softcap, &cap, sizeof cap);
            const uint32_t has = get32(y + 16);
            ext_ok = ext_ok && has <= 1 && get32(y + 20) == 0;
            n_logit_layers += has == 1;
            in->hole_hi[l] = get64(y + 24);
        }
        /* the logits follow; the header's size must be exactly what they need */
        uint64_t want = 0;
        if (!pkvi_mul(n_logit_layers, 4ull * in->n_heads, &want) ||
            !pkvi_add(want, v2_min + (in->version >= 3 ? V3_EXTRA : 0), &want) ||
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
        const unsigned char *z = x + V2_EXTRA + (uint64_t)V2_LAYER * in->n_layers;
        float *next = in->logits;
        for (uint32_t l = 0; l < in->n_layers; l++) {
            const unsigned char *y = x + V2_EXTRA + (uint64_t)V2_LAYER * l;
            if (get32(y + 16) != 1)
                continue;
            for (uint32_t i = 0; i < in->n_heads; i++, z += 4) {
                const uint32_t b = get32(z);
                memcpy(&next[i], &b, sizeof b);
            }
            in->layer_cfg[l].sink_logits = next;
            next += in->n_heads;
        }
        if (in->version >= 3) { /* the token record */
            const unsigned char *t3 = h + hbytes - 4 - V3_EXTRA;
            in->n_token_ids = get64(t3);
            in->tokens_crc = get32(t3 + 8);
            ext_ok = ext_ok && get32(t3 + 12) == 0;
        }
    }
    in->header_sound = true;

    /* Internal consistency of a header whose CRC matched: our writer never produces
     * these, so they are damage (or a forged file), not another format. */
    uint32_t g = in->n_kv_heads, bt = in->block_tokens;
    if (get32(h + OFF_FLAGS) != 0 || get32(h + OFF_RESERVED) != 0) {
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
         pkvi_mul(in->n_pages, ENTRY_BYTES, &table_end) &&
         pkvi_add(table_end, hbytes, &table_end) && table_end <= UINT64_MAX - PKVI_SFILE_ALIGN;
    if (!ok || pb != in->page_bytes || n_pages != in->n_pages ||
        get64(h + OFF_TABLE_OFF) != hbytes ||
        in->data_off != align_up(table_end, PKVI_SFILE_ALIGN) ||
        !pkvi_mul(in->n_pages, pb, &end) || !pkvi_add(end, in->data_off, &end) ||
        !pkvi_add(end, ids_bytes, &end)) {
        st = fail(r, PKV_ECORRUPT, "header fields are inconsistent");
        goto out;
    }
    r->rows_k = rk;
    r->rows_v = rv;
    r->header_bytes = hbytes;
    r->table_crc = get32(h + OFF_TABLE_CRC);
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
    w->crc = pkvi_crc32c(w->crc, buf, (size_t)(n * ENTRY_BYTES));
    for (uint64_t k = 0; k < n; k++) {
        walk_settle(in, w);
        const unsigned char *ent = buf + k * ENTRY_BYTES;
        if (get32(ent) != w->layer || get64(ent + 8) != w->index)
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
    const uint64_t gap_off = r->header_bytes + in->n_pages * ENTRY_BYTES;
    const uint64_t gap = in->data_off - gap_off;   /* < PKVI_SFILE_ALIGN */
    const uint64_t cap = per * ENTRY_BYTES > gap ? per * ENTRY_BYTES : gap;
    unsigned char *buf = cap ? malloc((size_t)cap) : NULL;
    if (cap && buf == NULL)
        return fail(r, PKV_ENOMEM, "out of memory");
    pkv_status st = PKV_OK;
    table_walk w = walk_start(in);
    for (uint64_t k = 0; k < in->n_pages && st == PKV_OK; k += per) {
        uint64_t cnt = in->n_pages - k < per ? in->n_pages - k : per;
        if (transfer(r->io, false, r->fd, buf, cnt * ENTRY_BYTES,
                     r->header_bytes + k * ENTRY_BYTES) != PKV_OK)
            st = fail(r, PKV_EIO, "read error");
        else if (!walk_entries(in, &w, buf, cnt))
            st = fail(r, PKV_ECORRUPT, "page table entries out of order");
    }
    if (st == PKV_OK && w.crc != r->table_crc)
        st = fail(r, PKV_ECORRUPT, "page table checksum mismatch");
    if (st == PKV_OK && gap > 0) {
        if (transfer(r->io, false, r->fd, buf, gap, gap_off) != PKV_OK)
            st = fail(r, PKV_EIO, "read error");
        else if (!all_zero(buf, gap))
            st = fail(r, PKV_ECORRUPT, "nonzero padding before the first page");
    }
    free(buf);
    return st;
}

/* Positions held by page i of a layer of len positions that has np pages. */
static uint32_t page_tokens(uint64_t len, uint64_t np, uint64_t i, uint32_t bt)
{
    return i + 1 < np ? bt : (uint32_t)(len - (np - 1) * bt);
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
 * batches of up to BATCH_BYTES of whole pages; a page larger than that is read
 * whole only when it is appended (s != NULL: its size is the engine's own page
 * size), in FIRST_BATCH_BYTES pieces when it is only checked. The table entries are
 * walked (order, CRC) again here, so a table changed since check_table is caught. */
static pkv_status scan_pages(reader *r, pkv_session *s)
{
    pkvi_sfile_info *in = r->info;
    if (in->n_pages == 0)
        return PKV_OK;
    const uint64_t pb = in->page_bytes;
    const bool pieces = s == NULL && pb > BATCH_BYTES;
    uint64_t per = pieces || BATCH_BYTES / pb == 0 ? 1 : BATCH_BYTES / pb;
    if (per > TABLE_CHUNK)
        per = TABLE_CHUNK;
    if (per > in->n_pages)
        per = in->n_pages;
    const uint64_t piece = pieces ? FIRST_BATCH_BYTES : per * pb;
    unsigned char *buf = alloc_aligned(piece);
    unsigned char *ents = malloc((size_t)(per * ENTRY_BYTES));
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
        if (transfer(r->io, false, r->fd, ents, cnt * ENTRY_BYTES,
                     r->header_bytes + k * ENTRY_BYTES) != PKV_OK) {
            st = fail(r, PKV_EIO, "read error");
            break;
        }
        table_walk at = w;   /* the (layer, index) of entry k */
        if (!walk_entries(in, &w, ents, cnt)) {
            st = fail(r, PKV_ECORRUPT, "page table entries out of order");
            break;
        }
        if (!pieces && transfer(r->io, false, r->fd, buf, cnt * pb,
                                in->data_off + k * pb) != PKV_OK) {
            st = fail(r, PKV_EIO, "read error");
            break;
        }
        for (uint64_t j = 0; j < cnt; j++) {
            walk_settle(in, &at);
            uint64_t len = in->layer_len[at.layer];
            uint32_t tok = page_tokens(len, layer_pages(len, in->block_tokens), at.index,
                                       in->block_tokens);
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
                    if (transfer(r->io, false, r->fd, buf, n, in->data_off + k * pb + o) !=
                        PKV_OK) {
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
            if (crc != get32(ents + j * ENTRY_BYTES + 4))
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
        step = step * 2 < BATCH_BYTES ? step * 2 : BATCH_BYTES;
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
        if (transfer(r->io, false, r->fd, buf, n, at + o) != PKV_OK) {
            st = fail(r, PKV_EIO, "read error");
            break;
        }
        crc = pkvi_crc32c(crc, buf, (size_t)n);
        for (uint64_t k = 0; ids && k < n / 4; k++)
            ids[o / 4 + k] = (int32_t)get32(buf + 4 * k);
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

void pkvi_sfile_info_free(pkvi_sfile_info *info)
{
    if (info == NULL)
        return;
    free(info->layer_len);
    free(info->layer_cfg);
    free(info->logits);
    free(info->hole_hi);
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

/* A sound header of another engine is another format for this engine: EINVAL. */
static pkv_status match_engine(reader *r, const pkv_engine *e)
{
    const pkvi_sfile_info *in = r->info;
    uint32_t code = 0;
    if (in->n_layers != e->cfg.n_layers || in->n_heads != e->cfg.n_heads ||
        in->n_kv_heads != e->cfg.n_kv_heads || in->head_dim != e->cfg.head_dim ||
        in->head_dim_v != e->cfg.head_dim_v)
        return fail(r, PKV_EINVAL, "the file's geometry differs from the engine's");
    /* every layer's variant (a version-1 file's are all plain causal) */
    for (uint32_t l = 0; l < in->n_layers; l++) {
        const pkv_layer_config *a = &in->layer_cfg[l], *b = &e->layers[l];
        bool same = a->window == b->window && a->sink_tokens == b->sink_tokens &&
                    a->rollback_tokens == b->rollback_tokens &&
                    float_bits(a->softcap) == float_bits(b->softcap) &&
                    !a->sink_logits == !b->sink_logits;
        for (uint32_t i = 0; same && a->sink_logits && i < in->n_heads; i++)
            same = float_bits(a->sink_logits[i]) == float_bits(b->sink_logits[i]);
        if (!same)
            return fail(r, PKV_EINVAL, "the file's attention variants differ from the engine's");
    }
    if (!dtype_to_code(e->cfg.kv_dtype, &code) || code != in->dtype_code)
        return fail(r, PKV_EINVAL, "the file's dtype differs from the engine's");
    if (in->block_tokens != e->cfg.block_tokens)
        return fail(r, PKV_EINVAL, "the file's block size differs from the engine's");
    if (in->scale_bits != float_bits(e->cfg.scale))
        return fail(r, PKV_EINVAL, "the file's softmax scale differs from the engine's");
    return PKV_OK;
}

pkv_status pkvi_session_load_io(pkv_engine *e, const char *path, pkvi_io *io,
                                pkv_session **out, const char **why)
{
    if (why != NULL)
        *why = "invalid arguments";
    if (e == NULL || path == NULL || io == NULL || out == NULL)
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
            pkv_status mst = match_engine(&r, e);
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
        st = pkv_session_create(e, &s);
        if (st != PKV_OK)
            r.why = "could not create the session";
    }
    if (st == PKV_OK)
        st = scan_pages(&r, s);                    /* pass 2: check again, build */
    if (st == PKV_OK && ids) {                     /* SPEC §10: the record, indexed */
        st = pkvi_session_set_tokens(s, info.n_token_ids, ids);
        if (st != PKV_OK)
            r.why = "could not record the token ids";
    }
    free(ids);
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

pkv_status pkv_session_load(pkv_engine *e, const char *path, pkv_session **out)
{
    /* "" is EINVAL, as pkv_session_save says: the same bad input, the same status */
    if (e == NULL || path == NULL || *path == '\0' || out == NULL)
        return PKV_EINVAL;
    pkvi_io *io = NULL;
    pkv_status st = pkvi_io_open(false, &io);
    if (st != PKV_OK)
        return st;
    const char *why = NULL;
    st = pkvi_session_load_io(e, path, io, out, &why);
    pkvi_io_close(io);
    if (st != PKV_OK)
        return pkvi_fail(e, st, "pkv_session_load: %s: %s", path, why ? why : "failed");
    return st;
}

/* ---- saving ------------------------------------------------------------------------ */

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
static pkv_status write_page(writer *w, const pkv_engine *e, const unsigned char *data,
                             uint32_t tokens, uint64_t off, uint32_t *crc)
{
    uint64_t pb = e->page_bytes;
    uint32_t bt = e->cfg.block_tokens;
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
        const uint64_t rk = e->row_bytes, rv = e->row_bytes_v, stride = (uint64_t)bt * (rk + rv);
        memset(dst, 0, (size_t)pb);
        for (uint32_t gi = 0; gi < e->cfg.n_kv_heads; gi++) {
            const uint64_t base = stride * gi;
            memcpy(dst + base, data + base, (size_t)(tokens * rk));
            memcpy(dst + base + bt * rk, data + base + bt * rk, (size_t)(tokens * rv));
        }
    }
    *crc = pkvi_crc32c(0, dst, (size_t)pb);
    w->stage_used += pb;
    return PKV_OK;
}

/* Temporary name: the target path, the pid and 64 random bits. Never built from
 * anything but the caller's own path. clean_stale() recognises exactly this pattern. */
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
            put32(buf + 4 * i, (uint32_t)ids[o + i]);
        *crc = pkvi_crc32c(*crc, buf, (size_t)(4 * k));
        st = transfer(io, true, fd, buf, 4 * k, at + 4 * o);
    }
    free(buf);
    return st;
}

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

pkv_status pkvi_session_save_opts(pkv_session *s, const char *path, pkvi_io *io,
                                  unsigned flags, const char **why)
{
    const char *w_why = "invalid arguments";
    if (why != NULL)
        *why = w_why;
    if (s == NULL || path == NULL || *path == '\0' || io == NULL ||
        (flags & ~PKVI_SAVE_NAMED_TEMP) != 0)
        return PKV_EINVAL;
    const pkv_engine *e = s->e;
    const pkv_config *c = &e->cfg;
    uint32_t L = c->n_layers, bt = c->block_tokens, code = 0;
    /* The format's page layout is [g][K bt rows | V bt rows]; the engine's must match. */
    if (!dtype_to_code(c->kv_dtype, &code) || e->kp.v_offset != bt * e->row_bytes ||
        e->kp.group_stride != bt * (e->row_bytes + e->row_bytes_v) ||
        e->page_bytes != (uint64_t)c->n_kv_heads * e->kp.group_stride)
        return PKV_EINVAL;
    /* The oldest version that holds the session: 1 for a plain engine (so readers of
     * version 1 still read what it saves), 2 with variants or block dtypes. */
    const uint32_t version = s->n_tokens ? 3u : e->variants || code > 2 ? 2u : 1u;
    uint64_t n_logit_layers = 0;
    for (uint32_t l = 0; l < L; l++)
        n_logit_layers += e->layers[l].sink_logits != NULL;

    uint64_t n_pages = 0, hbytes = HEADER_FIXED + 8ull * L, table_end = 0, data_off;
    if (version >= 2)
        hbytes += V2_EXTRA + (uint64_t)V2_LAYER * L + 4ull * c->n_heads * n_logit_layers;
    if (version >= 3)
        hbytes += V3_EXTRA;
    if (hbytes > PKVI_SFILE_MAX_HEADER)   /* more layers than the format holds */
        return PKV_EINVAL;
    for (uint32_t l = 0; l < L; l++)
        if (!pkvi_add(n_pages, pkvi_btable_held(&s->layers[l]), &n_pages))
            return PKV_ENOMEM;
    if (!pkvi_mul(n_pages, ENTRY_BYTES, &table_end) ||
        !pkvi_add(table_end, hbytes, &table_end) || table_end > SIZE_MAX / 2)
        return PKV_ENOMEM;
    data_off = align_up(table_end, PKVI_SFILE_ALIGN);

    pkv_status st = PKV_ENOMEM;
    bool created = false;   /* tmp exists and is ours: unlink it on failure */
    char *tmp = NULL;       /* the temporary's name, once it has one */
    uint64_t k = 0;
    unsigned char *head = calloc(1, (size_t)data_off);   /* header, table, zero gap */
    writer w = {.io = io, .fd = -1};
    /* Staging for pages written as copies: a quarter of a batch, but never more than
     * the session itself (a 4 KiB session must not cost a 4 MiB buffer). */
    uint64_t need;
    if (!pkvi_mul(n_pages ? n_pages : 1, e->page_bytes, &need))
        need = UINT64_MAX;
    w.stage_cap = need < BATCH_BYTES / 4 ? need : BATCH_BYTES / 4;
    if (w.stage_cap < e->page_bytes)
        w.stage_cap = e->page_bytes;
    w.stage = alloc_aligned(w.stage_cap);
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
        const pkvi_btable *ly = &s->layers[l];
        if (ly->n_pages == 0)
            continue;
        if ((st = pkvi_session_acquire(s, l)) != PKV_OK) {
            w_why = "could not bring spilled pages back";
            goto out;
        }
        for (uint64_t i = 0; i < ly->n_pages && st == PKV_OK; i++, k++) {
            if (ly->pages[i] == NULL) { /* released by the window: not in the file */
                k--;
                continue;
            }
            uint32_t crc = 0;
            st = write_page(&w, e, ly->pages[i]->data,
                            page_tokens(ly->len, ly->n_pages, i, bt),
                            data_off + k * e->page_bytes, &crc);
            unsigned char *ent = head + hbytes + k * ENTRY_BYTES;
            put32(ent, l);
            put32(ent + 4, crc);
            put64(ent + 8, i);
        }
        if (st == PKV_OK)
            st = flush(&w);   /* before release: direct requests point at the pages */
        pkvi_session_release(s, l);
        if (st != PKV_OK) {
            st = PKV_EIO;
            goto out;
        }
    }

    memcpy(head + OFF_MAGIC, sfile_magic, sizeof sfile_magic);
    put32(head + OFF_VERSION, version);
    put32(head + OFF_HEADER_BYTES, (uint32_t)hbytes);
    put32(head + OFF_N_LAYERS, L);
    put32(head + OFF_N_HEADS, c->n_heads);
    put32(head + OFF_N_KV_HEADS, c->n_kv_heads);
    put32(head + OFF_HEAD_DIM, c->head_dim);
    put32(head + OFF_DTYPE, code);
    put32(head + OFF_BLOCK_TOKENS, bt);
    put32(head + OFF_SCALE, float_bits(c->scale));
    put64(head + OFF_PAGE_BYTES, e->page_bytes);
    put64(head + OFF_N_PAGES, n_pages);
    put64(head + OFF_TABLE_OFF, hbytes);
    put64(head + OFF_DATA_OFF, data_off);
    put32(head + OFF_TABLE_CRC, pkvi_crc32c(0, head + hbytes, (size_t)(n_pages * ENTRY_BYTES)));
    for (uint32_t l = 0; l < L; l++)
        put64(head + OFF_LAYER_LEN + 8ull * l, s->layers[l].len);
    if (version >= 2) {
        unsigned char *x = head + HEADER_FIXED + 8ull * L - 4;
        put32(x, c->head_dim_v);
        unsigned char *z = x + V2_EXTRA + (uint64_t)V2_LAYER * L;
        for (uint32_t l = 0; l < L; l++) {
            const pkv_layer_config *lc = &e->layers[l];
            const pkvi_btable *t = &s->layers[l];
            unsigned char *y = x + V2_EXTRA + (uint64_t)V2_LAYER * l;
            put32(y, lc->window);
            put32(y + 4, lc->sink_tokens);
            put32(y + 8, lc->rollback_tokens);
            put32(y + 12, float_bits(lc->softcap));
            put32(y + 16, lc->sink_logits != NULL);
            put64(y + 24, t->hole_hi > t->hole_lo ? t->hole_hi : 0);
            for (uint32_t i = 0; lc->sink_logits && i < c->n_heads; i++, z += 4)
                put32(z, float_bits(lc->sink_logits[i]));
        }
    }
    if (version >= 3) { /* the ids go after the last page */
        unsigned char *t3 = head + hbytes - 4 - V3_EXTRA;
        uint32_t crc = 0;
        w_why = "write error";
        st = write_ids(io, w.fd, s->tokens, s->n_tokens, data_off + n_pages * e->page_bytes,
                       &crc);
        if (st != PKV_OK)
            goto out;
        put64(t3, s->n_tokens);
        put32(t3 + 8, crc);
    }
    put32(head + hbytes - 4, pkvi_crc32c(0, head, (size_t)hbytes - 4));
    if ((st = transfer(io, true, w.fd, head, data_off, 0)) != PKV_OK)
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
    if (s == NULL || path == NULL)
        return PKV_EINVAL;
    pkvi_io *io = NULL;
    pkv_status st = pkvi_io_open(false, &io);
    if (st != PKV_OK)
        return st;
    const char *why = NULL;
    st = pkvi_session_save_io(s, path, io, &why);
    pkvi_io_close(io);
    if (st != PKV_OK)
        return pkvi_fail(s->e, st, "pkv_session_save: %s: %s", path, why ? why : "failed");
    return st;
}

static pkv_dtype code_dtype(uint32_t code)
{
    return code_to_dtype(code);
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
    f.kv_dtype = code_dtype(in.dtype_code);
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

/*
 * persist/header.c - the one definition of a sound session file: what a header and
 * its page table must say (docs/file-format.md), and whether a sound file fits an
 * engine. The reader (persist/load.c) runs these checks on what it reads; the writer
 * (persist/save.c) runs the same checks on what it is about to commit, so a save
 * never returns PKV_OK for a file that load would refuse.
 *
 * Owns: the parse of a header's bytes into pkvi_sfile_info and every rule a header
 *   and a page table keep (field consistency, a windowed layer's or a shard's hole,
 *   the table's (layer, index) order), and the engine comparison. Does not own:
 *   reading or writing files (persist/load.c, persist/save.c), the layout constants
 *   and codecs (persist/format.h), the checksum (crc32c.c).
 *
 * Invariants:
 *   - Nothing of the bytes is trusted: sizes are checked against hbytes and the file's
 *     size before anything is allocated from them; arithmetic is checked.
 *   - A layer's hole [lo, hole_hi) is what its table holds as NULL entries: lo is its
 *     sink pages (0 for a shard, whose first first / bt entries hold other shards'
 *     positions). A released hole keeps what a decode at the layer's last position
 *     reads: hole_hi * bt <= len - window, the rule pkv_session_truncate keeps.
 */
#include "persist/format.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static pkv_status fail(const char **why, pkv_status st, const char *reason)
{
    *why = reason;
    return st;
}

/* Pages of a layer of len positions: ceil(len / bt). */
uint64_t pkvi_sfile_layer_pages(uint64_t len, uint32_t bt)
{
    return len / bt + (len % bt != 0);
}

/* Bytes of a stored row of n values of a file dtype code; 0 for a code `version`
 * does not know (v1: 0..2; v2 on: 0..4). */
static uint64_t code_row_bytes(uint32_t version, uint32_t code, uint32_t n)
{
    if (code > (version >= 2 ? 4u : 2u))
        return 0;
    return pkv_row_bytes(pkvi_sfile_code_dtype(code), n);
}

uint64_t pkvi_sfile_hole_lo(const pkvi_sfile_info *in, uint32_t l)
{
    return in->first ? 0 : pkvi_window_sink_pages(&in->layer_cfg[l], in->block_tokens);
}

/* Whether layer l's length, variant and hole are consistent: the hole is the shard's
 * own [0, first / bt), or what a window released, never a position a decode at
 * len - 1 (after a rollback truncate included) reads. */
static bool layer_sound(const pkvi_sfile_info *in, uint32_t l)
{
    const pkv_layer_config *lc = &in->layer_cfg[l];
    const uint64_t bt = in->block_tokens, len = in->layer_len[l], hi = in->hole_hi[l];
    const uint64_t np = pkvi_sfile_layer_pages(len, in->block_tokens);
    const uint64_t sp = pkvi_window_sink_pages(lc, bt), base = in->first / bt;
    if (!lc->window && (lc->sink_tokens || lc->rollback_tokens))
        return false;
    if (!isfinite(lc->softcap) || lc->softcap < 0.0f)
        return false;
    if (len < in->first || (in->first && sp > base)) /* a shard holds no sink position */
        return false;
    if (hi == 0)
        return in->first == 0;
    if (hi <= pkvi_sfile_hole_lo(in, l) || hi > np || hi < base)
        return false;
    return (in->first && hi == base) ||
           (lc->window && len > lc->window && hi <= (len - lc->window) / bt);
}

/* Parse and check the v2 extension (head_dim_v, per-layer variants and holes, sink
 * logits), the v3 token record and the v4 shard start of h into `in`. */
static pkv_status parse_extensions(const unsigned char *h, uint32_t hbytes, uint64_t v1_bytes,
                                   uint64_t v2_min, pkvi_sfile_info *in, bool *ext_ok,
                                   const char **why)
{
    const unsigned char *x = h + v1_bytes - 4; /* where v1's CRC would be */
    in->head_dim_v = pkvi_get32(x);
    *ext_ok = pkvi_get32(x + 4) == 0;
    uint64_t n_logit_layers = 0;
    for (uint32_t l = 0; l < in->n_layers; l++) {
        const unsigned char *y = x + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * l;
        pkv_layer_config *lc = &in->layer_cfg[l];
        lc->window = pkvi_get32(y);
        lc->sink_tokens = pkvi_get32(y + 4);
        lc->rollback_tokens = pkvi_get32(y + 8);
        const uint32_t cap = pkvi_get32(y + 12);
        memcpy(&lc->softcap, &cap, sizeof cap);
        const uint32_t has = pkvi_get32(y + 16);
        *ext_ok = *ext_ok && has <= 1 && pkvi_get32(y + 20) == 0;
        n_logit_layers += has == 1;
        in->hole_hi[l] = pkvi_get64(y + 24);
    }
    /* the logits follow; the header's size must be exactly what they need */
    const uint64_t tail = (in->version >= 3 ? PKVI_SFILE_V3_EXTRA : 0) +
                          (in->version >= 4 ? PKVI_SFILE_V4_EXTRA : 0) +
                          pkvi_sfile_v5_bytes(in->version, in->n_layers);
    uint64_t want = 0;
    if (!pkvi_mul(n_logit_layers, 4ull * in->n_heads, &want) ||
        !pkvi_add(want, v2_min + tail, &want) || want != hbytes)
        return fail(why, PKV_ECORRUPT, "header size does not match its layer count");
    if (n_logit_layers) { /* bounded by the header's size */
        in->logits = malloc((size_t)(n_logit_layers * 4 * in->n_heads));
        if (in->logits == NULL)
            return fail(why, PKV_ENOMEM, "out of memory");
    }
    const unsigned char *z = x + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * in->n_layers;
    float *next = in->logits;
    for (uint32_t l = 0; l < in->n_layers; l++) {
        const unsigned char *y = x + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * l;
        if (pkvi_get32(y + 16) != 1)
            continue;
        for (uint32_t i = 0; i < in->n_heads; i++, z += 4) {
            const uint32_t b = pkvi_get32(z);
            memcpy(&next[i], &b, sizeof b);
        }
        in->layer_cfg[l].sink_logits = next;
        next += in->n_heads;
    }
    if (in->version >= 3) { /* the token record, right after the logits */
        in->n_token_ids = pkvi_get64(z);
        in->tokens_crc = pkvi_get32(z + 8);
        *ext_ok = *ext_ok && pkvi_get32(z + 12) == 0;
        z += PKVI_SFILE_V3_EXTRA;
    }
    if (in->version >= 4) { /* the shard's first position */
        in->first = pkvi_get64(z);
        *ext_ok = *ext_ok && pkvi_get64(z + 8) == 0;
    }
    return PKV_OK;
}

pkv_status pkvi_sfile_parse_header(const unsigned char *h, uint32_t hbytes,
                                   pkvi_sfile_info *in, const char **why)
{
    if (hbytes < PKVI_SFILE_PREFIX_BYTES + 4 || hbytes > PKVI_SFILE_MAX_HEADER ||
        pkvi_get32(h + PKVI_SFILE_OFF_HEADER_BYTES) != hbytes)
        return fail(why, PKV_ECORRUPT, "header size field is damaged");
    if (pkvi_crc32c(0, h, hbytes - 4) != pkvi_get32(h + hbytes - 4))
        return fail(why, PKV_ECORRUPT, "header checksum mismatch");
    in->version = pkvi_get32(h + PKVI_SFILE_OFF_VERSION);
    if (in->version < 1 || in->version > PKVI_SFILE_VERSION)
        return fail(why, PKV_EINVAL, "unsupported format version");
    in->n_layers = pkvi_get32(h + PKVI_SFILE_OFF_N_LAYERS);
    const uint64_t v1_bytes = PKVI_SFILE_HEADER_FIXED + 8ull * in->n_layers;
    const uint64_t v2_min =
        v1_bytes + PKVI_SFILE_V2_EXTRA + (uint64_t)PKVI_SFILE_V2_LAYER * in->n_layers;
    if (in->n_layers == 0 || (in->version == 1 && hbytes != v1_bytes) ||
        (in->version >= 2 && hbytes < v2_min))
        return fail(why, PKV_ECORRUPT, "header size does not match its layer count");
    in->n_heads = pkvi_get32(h + PKVI_SFILE_OFF_N_HEADS);
    in->n_kv_heads = pkvi_get32(h + PKVI_SFILE_OFF_N_KV_HEADS);
    in->head_dim = pkvi_get32(h + PKVI_SFILE_OFF_HEAD_DIM);
    in->dtype_code = pkvi_get32(h + PKVI_SFILE_OFF_DTYPE);
    in->block_tokens = pkvi_get32(h + PKVI_SFILE_OFF_BLOCK_TOKENS);
    in->scale_bits = pkvi_get32(h + PKVI_SFILE_OFF_SCALE);
    in->page_bytes = pkvi_get64(h + PKVI_SFILE_OFF_PAGE_BYTES);
    in->n_pages = pkvi_get64(h + PKVI_SFILE_OFF_N_PAGES);
    in->data_off = pkvi_get64(h + PKVI_SFILE_OFF_DATA_OFF);
    in->table_crc = pkvi_get32(h + PKVI_SFILE_OFF_TABLE_CRC);
    /* n_layers < hbytes / 8: bounded like the header itself */
    in->layer_len = malloc(sizeof(uint64_t) * in->n_layers);
    in->layer_cfg = calloc(in->n_layers, sizeof *in->layer_cfg);
    in->hole_hi = calloc(in->n_layers, sizeof *in->hole_hi);
    if (in->layer_len == NULL || in->layer_cfg == NULL || in->hole_hi == NULL)
        return fail(why, PKV_ENOMEM, "out of memory");
    for (uint32_t l = 0; l < in->n_layers; l++)
        in->layer_len[l] = pkvi_get64(h + PKVI_SFILE_OFF_LAYER_LEN + 8ull * l);
    in->head_dim_v = in->head_dim; /* version 1 */
    bool ext_ok = true;
    if (in->version >= 2) {
        const pkv_status st = parse_extensions(h, hbytes, v1_bytes, v2_min, in, &ext_ok, why);
        if (st != PKV_OK)
            return st;
    }
    in->header_sound = true;
    const pkv_status st5 = pkvi_sfile_read_v5(h, hbytes, in, why); /* RoPE, discards */
    if (st5 != PKV_OK)
        return st5;

    /* Internal consistency of a header whose CRC matched: our writer never produces
     * these, so they are damage (or a forged file), not another format. */
    const uint32_t g = in->n_kv_heads, bt = in->block_tokens;
    if (pkvi_get32(h + PKVI_SFILE_OFF_FLAGS) != 0 ||
        pkvi_get32(h + PKVI_SFILE_OFF_RESERVED) != 0)
        return fail(why, PKV_ECORRUPT, "reserved header fields are not zero");
    if (code_row_bytes(in->version, in->dtype_code, 1) == 0)
        return fail(why, PKV_EINVAL, "unknown dtype code");
    if (!ext_ok)
        return fail(why, PKV_ECORRUPT, "reserved header fields are not zero");
    if (in->n_heads == 0 || g == 0 || in->n_heads % g != 0 || in->head_dim == 0 ||
        in->head_dim_v == 0 || bt == 0)
        return fail(why, PKV_ECORRUPT, "header geometry is invalid");
    const uint64_t rk = code_row_bytes(in->version, in->dtype_code, in->head_dim);
    const uint64_t rv = code_row_bytes(in->version, in->dtype_code, in->head_dim_v);
    uint64_t pb = 0, n_pages = 0, end = 0;
    bool ok = pkvi_mul(rk + rv, bt, &pb) && pkvi_mul(pb, g, &pb) && in->first % bt == 0;
    for (uint32_t l = 0; ok && l < in->n_layers; l++) {
        /* a layer's pages less its hole [lo, hole_hi) */
        const uint64_t np = pkvi_sfile_layer_pages(in->layer_len[l], bt);
        const uint64_t hole = in->hole_hi[l] ? in->hole_hi[l] - pkvi_sfile_hole_lo(in, l) : 0;
        ok = layer_sound(in, l) && pkvi_add(n_pages, np - hole, &n_pages);
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
        !pkvi_add(end, ids_bytes, &end))
        return fail(why, PKV_ECORRUPT, "header fields are inconsistent");
    in->rows_k = rk;
    in->rows_v = rv;
    in->header_bytes = hbytes;
    if (in->file_bytes < end)
        return fail(why, PKV_ECORRUPT, "truncated file");
    if (in->file_bytes > end)
        return fail(why, PKV_ECORRUPT, "trailing bytes after the last page (and token ids)");
    return PKV_OK;
}

/* ---- the page table ------------------------------------------------------------------- */

/* The first page index of layer l the file holds, and the one after idx: the hole
 * [lo, hole_hi) is not in the file. */
static uint64_t first_index(const pkvi_sfile_info *in, uint32_t l)
{
    return in->hole_hi[l] && pkvi_sfile_hole_lo(in, l) == 0 ? in->hole_hi[l] : 0;
}

uint64_t pkvi_sfile_next_index(const pkvi_sfile_info *in, uint32_t l, uint64_t idx)
{
    idx++;
    if (in->hole_hi[l] && idx == pkvi_sfile_hole_lo(in, l))
        idx = in->hole_hi[l];
    return idx;
}

void pkvi_sfile_walk_settle(const pkvi_sfile_info *in, pkvi_sfile_walk *w)
{
    while (w->index >= pkvi_sfile_layer_pages(in->layer_len[w->layer], in->block_tokens) &&
           w->layer + 1 < in->n_layers) {
        w->layer++;
        w->index = first_index(in, w->layer);
    }
}

pkvi_sfile_walk pkvi_sfile_walk_start(const pkvi_sfile_info *in)
{
    pkvi_sfile_walk w = {0, first_index(in, 0), 0};
    return w;
}

bool pkvi_sfile_walk_entries(const pkvi_sfile_info *in, pkvi_sfile_walk *w,
                             const unsigned char *buf, uint64_t n)
{
    w->crc = pkvi_crc32c(w->crc, buf, (size_t)(n * PKVI_SFILE_ENTRY_BYTES));
    for (uint64_t k = 0; k < n; k++) {
        pkvi_sfile_walk_settle(in, w);
        const unsigned char *ent = buf + k * PKVI_SFILE_ENTRY_BYTES;
        if (pkvi_get32(ent) != w->layer || pkvi_get64(ent + 8) != w->index)
            return false;
        w->index = pkvi_sfile_next_index(in, w->layer, w->index);
    }
    return true;
}

/* ---- a sound file and an engine -------------------------------------------------------- */

pkv_status pkvi_sfile_match_engine(const pkvi_sfile_info *in, const pkvi_geom *geo,
                                   const char **why)
{
    const pkv_config *c = &geo->cfg;
    uint32_t code = 0;
    if (in->n_layers != c->n_layers || in->n_heads != c->n_heads ||
        in->n_kv_heads != c->n_kv_heads || in->head_dim != c->head_dim ||
        in->head_dim_v != c->head_dim_v)
        return fail(why, PKV_EINVAL, "the file's geometry differs from the engine's");
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
            return fail(why, PKV_EINVAL, "the file's attention variants differ from the engine's");
    }
    if (!pkvi_sfile_rope_match(in, geo))
        return fail(why, PKV_EINVAL, "the file's RoPE config differs from the engine's");
    if (!pkvi_sfile_dtype_code(c->kv_dtype, &code) || code != in->dtype_code)
        return fail(why, PKV_EINVAL, "the file's dtype differs from the engine's");
    if (in->block_tokens != c->block_tokens)
        return fail(why, PKV_EINVAL, "the file's block size differs from the engine's");
    if (in->scale_bits != pkvi_float_bits(c->scale))
        return fail(why, PKV_EINVAL, "the file's softmax scale differs from the engine's");
    if (in->first % pkvi_shard_align(geo) != 0)
        return fail(why, PKV_EINVAL,
                    "the file's shard start is not a multiple of the engine's pkv_shard_align");
    return PKV_OK;
}

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

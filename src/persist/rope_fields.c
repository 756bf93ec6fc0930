/*
 * persist/rope_fields.c - the version-5 fields of a session file (SPEC §14,
 * docs/file-format.md "Version 5"): each layer's RoPE config and stale positions (what
 * a discard left in a windowed layer's held pages), and how far the token record may
 * grow (a discard's p0). The reader's side: parse and check them (persist/header.c calls
 * it once the version-2 to -4 fields are in), compare them with an engine's, and give them
 * to a loaded session. persist/save.c writes them.
 *
 * Owns nothing at run time. What a sound file is stays header.c's rule: damage is
 * PKV_ECORRUPT, a sound file of another config PKV_EINVAL (match).
 */
#include "persist/format.h"

#include <stdlib.h>
#include <string.h>

pkv_status pkvi_sfile_read_v5(const unsigned char *h, uint32_t hbytes, pkvi_sfile_info *in,
                              const char **why)
{
    const uint32_t L = in->n_layers;
    in->record_max = UINT64_MAX;
    in->stale = calloc(L, 2 * sizeof *in->stale);
    if (!in->stale) {
        *why = "out of memory";
        return PKV_ENOMEM;
    }
    if (in->version < 5)
        return PKV_OK;
    const unsigned char *t4 = h + hbytes - 4 - pkvi_sfile_v5_bytes(in->version, L);
    in->record_max = pkvi_get64(t4);
    bool ok = pkvi_get64(t4 + 8) == 0 && in->n_token_ids <= in->record_max;
    for (uint32_t l = 0; ok && l < L; l++) {
        const unsigned char *y = t4 + PKVI_SFILE_V5_EXTRA + (uint64_t)PKVI_SFILE_V5_LAYER * l;
        pkv_layer_config *lc = &in->layer_cfg[l];
        lc->rope = pkvi_get32(y);
        lc->rope_dims = pkvi_get32(y + 4);
        const uint32_t th = pkvi_get32(y + 8), fs = pkvi_get32(y + 12);
        memcpy(&lc->rope_theta, &th, sizeof th);
        memcpy(&lc->rope_freq_scale, &fs, sizeof fs);
        const uint64_t lo = pkvi_get64(y + 16), hi = pkvi_get64(y + 24);
        /* the writer stores the resolved config: no field left at its default */
        pkv_layer_config res;
        ok = pkvi_rope_check(lc, in->head_dim, &res, NULL, 0) &&
             memcmp(&res, lc, sizeof res) == 0;
        /* stale rows: only a windowed layer has them, past its sink pages and below
         * what a decode at its length (or after a truncate of up to rollback_tokens)
         * reads */
        const uint64_t len = in->layer_len[l], bt = in->block_tokens;
        const uint64_t span = (uint64_t)lc->window + lc->rollback_tokens;
        ok = ok && lo <= hi &&
             (lo == hi ? lo == 0
                       : lc->window && lo >= pkvi_window_sink_pages(lc, bt) * bt &&
                             len > span && hi <= len - span);
        in->stale[2 * l] = lo;
        in->stale[2 * l + 1] = hi;
    }
    if (!ok) {
        *why = "the RoPE or discard fields are inconsistent";
        return PKV_ECORRUPT;
    }
    return PKV_OK;
}

bool pkvi_sfile_rope_match(const pkvi_sfile_info *in, const pkvi_geom *geo)
{
    for (uint32_t l = 0; l < in->n_layers; l++) {
        const pkv_layer_config *a = &in->layer_cfg[l], *b = &geo->layers[l];
        if (a->rope != b->rope || a->rope_dims != b->rope_dims ||
            pkvi_float_bits(a->rope_theta) != pkvi_float_bits(b->rope_theta) ||
            pkvi_float_bits(a->rope_freq_scale) != pkvi_float_bits(b->rope_freq_scale))
            return false;
    }
    return true;
}

void pkvi_sfile_rope_apply(const pkvi_sfile_info *in, pkv_session *s)
{
    for (uint32_t l = 0; l < in->n_layers; l++)
        pkvi_btable_set_stale(s->layers[l], in->stale[2 * l], in->stale[2 * l + 1]);
    s->record_max = in->record_max;
}

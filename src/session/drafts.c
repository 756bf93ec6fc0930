/*
 * session/drafts.c - pending drafts (SPEC §13): the tree each layer's last pkv_verify
 * stored, and pkv_session_commit, which keeps one root-to-node path of it on every
 * layer and releases the rest.
 *
 * Owns the session's tree records (session.h: `drafts`). The rows themselves live in
 * the layer's pages past its length (btable.h: pending rows); writing them, moving
 * the kept ones into place and releasing the rest are session/write.c's; pkv_verify
 * (attention/verify.c) stores them and attends them.
 *
 * A layer's states (every transition by the call named on its arrow):
 *
 *        pkv_verify (nothing pending)             pkv_verify (replaces the tree)
 *   NONE ---------------------------> PENDING(tree) <-----------+
 *    ^                                  |  |                   |
 *    |  pkv_session_commit(n_keep, path)|  +-------------------+
 *    +----------------------------------+  (len += n_keep, the rest released)
 *
 * While a layer is PENDING: pkv_append and pkv_prefill of that layer, and
 * pkv_session_fork, pkv_session_truncate and pkv_session_save of the session, are
 * PKV_ESTATE and change nothing; decodes (single, batch, partial) attend the cached
 * positions only, as pkv_session_len says; pkv_session_destroy releases the drafts.
 * The header (include/pagedkv.h) says the same to users.
 */
#include "session/private.h"

#include <stdlib.h>
#include <string.h>

int32_t *pkvi_drafts_copy(const pkv_session *s, uint32_t n, const int32_t *parent)
{
    (void)s;
    int32_t *t = malloc((size_t)n * sizeof *t);
    if (t)
        memcpy(t, parent, (size_t)n * sizeof *t);
    return t;
}

pkv_status pkvi_drafts_ready(pkv_session *s)
{
    if (s->drafts)
        return PKV_OK;
    s->drafts = calloc(s->geom->cfg.n_layers, sizeof *s->drafts);
    return s->drafts ? PKV_OK : PKV_ENOMEM;
}

void pkvi_drafts_set(pkv_session *s, uint32_t layer, int32_t *tree)
{
    free(s->drafts[layer]);
    s->drafts[layer] = tree;
}

/* The first layer with pending drafts, or n_layers when none has. */
static uint32_t first_pending(const pkv_session *s)
{
    uint32_t l = 0;
    while (l < s->geom->cfg.n_layers && !pkvi_btable_pending(s->layers[l]))
        l++;
    return l;
}

pkv_status pkv_session_commit(pkv_session *s, uint32_t n_keep, const uint32_t *path)
{
    if (!s)
        return PKV_EINVAL;
    const pkvi_geom *geo = s->geom;
    if (pkvi_boundary_check(geo, s->cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    const uint32_t L = geo->cfg.n_layers, l0 = first_pending(s);
    if (l0 == L)
        return pkvi_fail(s->errs, PKV_ESTATE, "pkv_session_commit: no drafts are pending "
                         "(pkv_verify first)");
    const uint64_t n = pkvi_btable_pending(s->layers[l0]);
    const int32_t *tree = s->drafts[l0];
    for (uint32_t l = l0 + 1; l < L; l++) {
        const uint64_t nl = pkvi_btable_pending(s->layers[l]);
        if (nl && (nl != n || memcmp(s->drafts[l], tree, (size_t)n * sizeof *tree)))
            return pkvi_fail(s->errs, PKV_ESTATE, "pkv_session_commit: layers %u and %u "
                             "were verified with different trees", l0, l);
    }
    if (n_keep > n || (n_keep && !path))
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_commit: %s",
                         n_keep > n ? "n_keep exceeds the pending drafts" : "path is NULL");
    /* a root-to-node path: each entry a draft whose parent is the entry before (the
     * first's is -1); parents come before children, so no entry can repeat */
    for (uint32_t j = 0; j < n_keep; j++) {
        const int32_t want = j ? (int32_t)path[j - 1] : -1;
        if (path[j] >= n || tree[path[j]] != want)
            return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_commit: path[%u] = %u is not "
                             "%s", j, path[j],
                             path[j] >= n ? "a pending draft"
                             : j ? "a child of the entry before it" : "a root (parent -1)");
    }
    /* Rows move only when a path is kept: then every pending layer is pinned with the
     * pages of its pending rows in memory (from the page of position len on: no row
     * before it moves, so a layer longer than the budget holds commits as its decode
     * runs), or nothing changes. Dropping every draft moves no row, so it reads no
     * spilled page back and, as a truncate, cannot fail: a caller can always abandon a
     * tree. */
    const bool move = n_keep > 0;
    const uint64_t bt = geo->cfg.block_tokens;
    uint32_t l = l0;
    pkv_status st = PKV_OK;
    for (; move && l < L; l++)
        if (pkvi_btable_pending(s->layers[l]) &&
            (st = pkvi_session_acquire_from(s, l, pkvi_btable_len(s->layers[l]) / bt,
                                            "pkv_session_commit")) != PKV_OK)
            break;
    if (st != PKV_OK) {
        for (uint32_t k = l0; k < l; k++)
            if (pkvi_btable_pending(s->layers[k]))
                pkvi_session_release(s, k);
        return pkvi_fail(s->errs, st, "pkv_session_commit: layer %u's drafts could not be "
                         "brought back (nothing changed; n_keep 0 drops them)", l);
    }
    /* nothing fails from here on */
    for (l = l0; l < L; l++) {
        if (!pkvi_btable_pending(s->layers[l]))
            continue;
        pkvi_session_keep_drafts(s, l, n_keep, path);
        pkvi_drafts_set(s, l, NULL);
        if (move)
            pkvi_session_release(s, l);
    }
    return PKV_OK;
}

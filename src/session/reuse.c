/*
 * session/reuse.c - sessions and the prefix cache (docs/prefix-cache.md): pkv_session_set_tokens
 * records a session's token ids and indexes its full pages; pkv_session_from_prefix
 * creates a session that shares the longest usable match, as a fork shares its
 * source's pages.
 *
 * Owns the decisions that join the two: which of a session's pages the index gains
 * (full pages covered by recorded ids, on the session's own thread: B5), and which
 * pages of a match of m pages a new session needs (every page of a full layer; a
 * windowed layer's sinks and the pages from pkvi_window_keep_from on). The index
 * itself is prefix.c's, the references btable.c's, the session object and its token
 * record session.c's (allocation, list link, the copy a fork makes, the cut a
 * truncate makes). Nothing below calls this file.
 */
#include "session/private.h"

#include <stdlib.h>
#include <string.h>

/* ---- set_tokens ------------------------------------------------------------------------ */

/* Index the record's first `full` page indices (ids in s->tokens): the nodes that
 * exist are reused (a window-released entry filled in when s still holds that page),
 * the missing ones are created from s's pages. All nodes are allocated before the
 * index changes: PKV_ENOMEM changes nothing. chain: [full]. Under the lock. */
static pkv_status index_record(pkv_session *s, uint64_t full, pkvi_pnode **chain)
{
    pkvi_prefix *p = &s->cache->prefix;
    const uint64_t bt = s->geom->cfg.block_tokens;
    pkvi_pnode *parent = NULL;
    uint64_t j = 0;
    for (; j < full; j++) {
        pkvi_pnode *nd = pkvi_prefix_find(p, parent, s->tokens + j * bt);
        if (!nd)
            break;
        chain[j] = parent = nd;
    }
    pkvi_pnode *spare = NULL;
    const pkv_status st = pkvi_prefix_alloc(p, full - j, &spare);
    if (st != PKV_OK)
        return st;
    /* B5: only full pages of s gain the index as a holder, on s's owner thread (the
     * only one that could write s's unshared pages) */
    for (uint64_t i = 0; i < full; i++) {
        if (i >= j) {
            pkvi_pnode *nd = spare;
            spare = spare->hnext;
            pkvi_prefix_insert(p, nd, parent, s->tokens + i * bt, NULL);
            chain[i] = parent = nd;
        }
        for (uint32_t l = 0; l < s->geom->cfg.n_layers; l++) {
            pkvi_page *pg = pkvi_btable_page(s->layers[l], i);
            if (!chain[i]->pages[l] && pg && !pkvi_page_indexed(pg))
                pkvi_prefix_fill(chain[i], l, pg);
        }
    }
    pkvi_prefix_touch(p, chain, full);
    return PKV_OK;
}

pkv_status pkvi_session_set_tokens(pkv_session *s, uint64_t n, const int32_t *tokens)
{
    const pkvi_geom *geo = s->geom;
    const uint64_t bt = geo->cfg.block_tokens;
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
        if (n > pkvi_btable_len(s->layers[l]))
            return pkvi_fail(s->errs, PKV_ERANGE, "pkv_session_set_tokens: %llu ids, but "
                             "layer %u holds %llu positions", (unsigned long long)n, l,
                             (unsigned long long)pkvi_btable_len(s->layers[l]));
    if (n > s->record_max)
        return pkvi_fail(s->errs, PKV_ESTATE, "pkv_session_set_tokens: %llu ids, but "
                         "pkv_session_discard moved the K/V from position %llu on (it is "
                         "no prefill of those ids); truncate to %llu first to record past it",
                         (unsigned long long)n, (unsigned long long)s->record_max,
                         (unsigned long long)s->record_max);
    const uint64_t old = s->n_tokens, same = n < old ? n : old;
    if (same && memcmp(tokens, s->tokens, (size_t)same * sizeof *tokens) != 0)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_set_tokens: the ids differ from "
                         "the ones recorded (truncate first to change them)");
    if (n <= old)
        return PKV_OK;
    if (n > s->tokens_cap) {
        uint64_t cap = s->tokens_cap ? s->tokens_cap * 2 : 64;
        if (cap < n)
            cap = n;
        int32_t *t = cap > SIZE_MAX / sizeof *t ? NULL
                                                : realloc(s->tokens, (size_t)cap * sizeof *t);
        if (!t)
            return pkvi_fail(s->errs, PKV_ENOMEM, "pkv_session_set_tokens: out of memory");
        s->tokens = t;
        s->tokens_cap = cap;
    }
    memcpy(s->tokens + old, tokens + old, (size_t)(n - old) * sizeof *tokens);
    const uint64_t full = n / bt;
    if (full > s->indexed_pages) {
        pkvi_pnode **chain = malloc((size_t)full * sizeof *chain);
        pkv_status st = chain ? PKV_OK : PKV_ENOMEM;
        if (st == PKV_OK) {
            pthread_mutex_lock(&s->cache->lock);
            st = index_record(s, full, chain);
            pthread_mutex_unlock(&s->cache->lock);
        }
        free(chain);
        if (st != PKV_OK)
            return pkvi_fail(s->errs, st, "pkv_session_set_tokens: out of memory");
        s->indexed_pages = full;
    }
    s->n_tokens = n;
    return PKV_OK;
}

pkv_status pkv_session_set_tokens(pkv_session *s, uint64_t n, const int32_t *tokens)
{
    if (!s)
        return PKV_EINVAL;
    if (n && !tokens)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_set_tokens: tokens is NULL");
    if (pkvi_boundary_check(s->geom, s->cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    return pkvi_session_set_tokens(s, n, tokens);
}

/* ---- from_prefix ----------------------------------------------------------------------- */

/* Whether layer l of a session of m pages needs page i: every page of a full layer; a
 * windowed one its sink pages and those from pkvi_window_keep_from on (the rest is
 * its hole, as in a session that appended the same rows). */
static bool page_needed(const pkvi_geom *geo, uint32_t l, uint64_t i, uint64_t m)
{
    const pkv_layer_config *lc = &geo->layers[l];
    if (!lc->window)
        return true;
    const uint64_t bt = geo->cfg.block_tokens;
    return i < pkvi_sink_pages(geo, lc) || i >= pkvi_window_keep_from(lc, m * bt, bt);
}

/* The longest m <= m_max such that chain[0..m) holds every page a session of m
 * pages needs. */
static uint64_t usable_pages(const pkvi_geom *geo, pkvi_pnode *const *chain, uint64_t m_max)
{
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++) /* a full layer needs every page */
        for (uint64_t i = 0; !geo->layers[l].window && i < m_max; i++)
            if (!chain[i]->pages[l])
                m_max = i;
    for (uint64_t m = m_max; m > 0; m--) {
        bool ok = true;
        for (uint32_t l = 0; ok && l < geo->cfg.n_layers; l++)
            for (uint64_t i = 0; ok && i < m; i++)
                ok = chain[i]->pages[l] || !page_needed(geo, l, i, m);
        if (ok)
            return m;
    }
    return 0;
}

pkv_status pkvi_session_from_prefix(const pkvi_ctx *ctx, uint64_t n, const int32_t *tokens,
                                    pkv_session **out, uint64_t *n_cached)
{
    const pkvi_geom *geo = ctx->geom;
    pkvi_cache *cache = ctx->cache;
    if (n && !tokens)
        return pkvi_fail(ctx->errs, PKV_EINVAL, "pkv_session_from_prefix: tokens is NULL");
    if (pkvi_boundary_check(geo, cache, "pkv_session_from_prefix") != PKV_OK)
        return PKV_ECORRUPT;
    const uint64_t bt = geo->cfg.block_tokens, L = geo->cfg.n_layers;
    const uint64_t max_pages = n ? (n - 1) / bt : 0;   /* at most n - 1 positions */
    pkv_session *s = pkvi_session_alloc(ctx);
    if (!s)
        return pkvi_fail(ctx->errs, PKV_ENOMEM, "pkv_session_from_prefix: out of memory");
    pkvi_pnode **chain = NULL;
    uint64_t chain_cap = 0, m = 0;
    pkv_status st = PKV_OK;
    pthread_mutex_lock(&cache->lock);
    /* the longest match: each step compares the parent and bt stored ids */
    pkvi_pnode *parent = NULL;
    for (uint64_t i = 0; i < max_pages && st == PKV_OK; i++) {
        pkvi_pnode *nd = pkvi_prefix_find(&cache->prefix, parent, tokens + i * bt);
        if (!nd)
            break;
        if (i == chain_cap) {
            const uint64_t cap = chain_cap ? chain_cap * 2 : 64;
            pkvi_pnode **c = cap > SIZE_MAX / sizeof *c ? NULL
                                                         : realloc(chain, (size_t)cap * sizeof *c);
            if (!c) {
                st = PKV_ENOMEM;
                break;
            }
            chain = c;
            chain_cap = cap;
        }
        chain[i] = parent = nd;
        m = i + 1;
    }
    if (st == PKV_OK)
        m = usable_pages(geo, chain, m);
    /* everything the shared part needs, before anything changes */
    for (uint32_t l = 0; st == PKV_OK && l < L; l++)
        st = pkvi_btable_reserve(s->layers[l], m);
    if (st == PKV_OK)
        st = pkvi_session_reserve_partials(s, m);
    if (st == PKV_OK && m) {
        s->tokens = malloc((size_t)(m * bt) * sizeof *s->tokens);
        st = s->tokens ? PKV_OK : PKV_ENOMEM;
    }
    if (st != PKV_OK) {
        pthread_mutex_unlock(&cache->lock);
        free(chain);
        pkvi_session_free(s);
        return pkvi_fail(ctx->errs, st, "pkv_session_from_prefix: out of memory");
    }
    /* B5: only full, indexed pages gain a holder; none of them can be written (a
     * table holding one shares it with the index, so its owner copies it first) */
    const pkvi_pages ps = pkvi_cache_pages(cache);
    for (uint32_t l = 0; l < L; l++) {
        pkvi_btable *t = s->layers[l];
        for (uint64_t i = 0; i < m; i++)
            pkvi_btable_push_shared(t, ps,
                                    page_needed(geo, l, i, m) ? chain[i]->pages[l] : NULL);
        pkvi_btable_advance(t, m * bt);
    }
    pkvi_prefix_touch(&cache->prefix, chain, m);
    cache->prefix.lookups++;
    cache->prefix.hit_tokens += m * bt;
    pkvi_session_link(s);
    pthread_mutex_unlock(&cache->lock);
    free(chain);
    if (m) {
        memcpy(s->tokens, tokens, (size_t)(m * bt) * sizeof *tokens);
        s->n_tokens = s->tokens_cap = m * bt;
        s->indexed_pages = m;
    }
    *out = s;
    *n_cached = m * bt;
    return PKV_OK;
}

/*
 * session.c - a session's lifecycle: the object itself (its tables, its decode
 * scratch, its token record) and its place on the engine's session list; create,
 * fork, destroy, truncate, pkv_session_len; and the shard call pkv_session_set_first
 * (docs/sharding.md).
 *
 * Owns struct pkv_session's allocation and the links of the session list (the cache
 * state's, under its lock). Calls down into btable.c (tables and references) and
 * prefix.c (trim after a page is let go); nothing here calls another session file but
 * the invariant check at API boundaries (session/account.c), and nothing calls
 * decode.c, persist/ or engine.c. What a write takes is session/write.c's, which pages are in memory
 * session/residency.c's, the prefix cache's walk (set_tokens, from_prefix)
 * session/reuse.c's - all of them above this file.
 *
 * A fork shares every page of its source (B4: index-preserving) and copies only the
 * token record; everything it allocates is allocated before the first page gains a
 * holder, so a failed fork changes nothing.
 */
#include "session/private.h"

#include <stdlib.h>
#include <string.h>

/* ---- the object and the session list --------------------------------------------------- */

pkv_session *pkvi_session_alloc(const pkvi_ctx *ctx)
{
    pkv_session *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->geom = ctx->geom;
    s->cache = ctx->cache;
    s->exec = ctx->exec;
    s->errs = ctx->errs;
    const uint32_t L = s->geom->cfg.n_layers;
    s->layers = calloc(L, sizeof *s->layers);
    for (uint32_t l = 0; s->layers && l < L; l++)
        if (!(s->layers[l] = pkvi_btable_new())) {
            pkvi_session_free(s);
            return NULL;
        }
    if (!s->layers) {
        free(s);
        return NULL;
    }
    s->record_max = UINT64_MAX;
    return s;
}

void pkvi_session_free(pkv_session *s)
{
    for (uint32_t l = 0; s->layers && l < s->geom->cfg.n_layers; l++)
        pkvi_btable_free(s->layers[l]);
    free(s->layers);
    free(s->partials);
    free(s->tokens);
    for (uint32_t l = 0; s->drafts && l < s->geom->cfg.n_layers; l++)
        free(s->drafts[l]);
    free(s->drafts);
    free(s);
}

/* Under the lock. */
void pkvi_session_link(pkv_session *s)
{
    pkvi_cache *cache = s->cache;
    s->prev = NULL;
    s->next = cache->sessions;
    if (cache->sessions)
        cache->sessions->prev = s;
    cache->sessions = s;
    cache->n_sessions++;
    s->lru = ++cache->clock;
}

/* ---- decode scratch ------------------------------------------------------------------ */

/* Split-K partial states for layers of up to n_pages pages (decode.c's layout; the
 * sink pages of a windowed layer add chunks of their own). */
pkv_status pkvi_session_reserve_partials(pkv_session *s, uint64_t n_pages)
{
    const pkvi_geom *geo = s->geom;
    const uint64_t chunks = pkvi_max_chunks(geo, n_pages);
    if (chunks <= s->partials_chunks)
        return PKV_OK;
    uint64_t want = s->partials_chunks ? s->partials_chunks * 2 : 1;
    if (want < chunks)
        want = chunks;
    if (want > PKVI_MAX_CHUNKS + 1) /* the running states and one wave */
        want = PKVI_MAX_CHUNKS + 1;
    uint64_t floats, bytes;
    if (!pkvi_mul(want, geo->cfg.n_heads, &floats) ||
        !pkvi_mul(floats, (uint64_t)geo->cfg.head_dim_v + 2, &floats) ||
        !pkvi_mul(floats, sizeof(float), &bytes) || bytes > SIZE_MAX - 63)
        return PKV_ENOMEM;
    float *p = aligned_alloc(PKVI_PAGE_ALIGN, (size_t)((bytes + 63) & ~63ull));
    if (!p)
        return PKV_ENOMEM;
    free(s->partials);
    s->partials = p;
    s->partials_chunks = want;
    return PKV_OK;
}

/* ---- the token record (docs/prefix-cache.md) ------------------------------------------ */

/* The fork's copy of src's token record. PKV_ENOMEM. */
static pkv_status copy_record(pkv_session *s, const pkv_session *src)
{
    s->record_max = src->record_max;
    if (!src->n_tokens)
        return PKV_OK;
    s->tokens = malloc((size_t)src->n_tokens * sizeof *s->tokens);
    if (!s->tokens)
        return PKV_ENOMEM;
    memcpy(s->tokens, src->tokens, (size_t)src->n_tokens * sizeof *s->tokens);
    s->n_tokens = s->tokens_cap = src->n_tokens;
    s->indexed_pages = src->indexed_pages;
    return PKV_OK;
}

/* A truncate to n shortens the record; at or below a discard's p0 (record_max) the
 * moved rows are gone, and the record may grow again. */
static void truncate_record(pkv_session *s, uint64_t n)
{
    if (n <= s->record_max)
        s->record_max = UINT64_MAX;
    if (n >= s->n_tokens)
        return;
    s->n_tokens = n;
    const uint64_t pages = n / s->geom->cfg.block_tokens;
    if (s->indexed_pages > pages)
        s->indexed_pages = pages;
}

void pkvi_session_seal_record(pkv_session *s, uint64_t p0)
{
    truncate_record(s, p0);
    if (p0 < s->record_max)
        s->record_max = p0;
}

/* ---- create, fork, destroy, truncate ---------------------------------------------------- */

pkv_status pkvi_session_create(const pkvi_ctx *ctx, pkv_session **out)
{
    pkv_session *s = pkvi_session_alloc(ctx);
    if (!s)
        return pkvi_fail(ctx->errs, PKV_ENOMEM, "pkv_session_create: out of memory");
    pthread_mutex_lock(&s->cache->lock);
    pkvi_session_link(s);
    pthread_mutex_unlock(&s->cache->lock);
    *out = s;
    return PKV_OK;
}

pkv_status pkv_session_fork(pkv_session *src, pkv_session **out)
{
    if (!src)
        return PKV_EINVAL;
    if (!out)
        return pkvi_fail(src->errs, PKV_EINVAL, "pkv_session_fork: out is NULL");
    const pkvi_geom *geo = src->geom;
    pkvi_cache *cache = src->cache;
    if (pkvi_boundary_check(geo, cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    if (pkvi_session_pending(src))
        return pkvi_fail(src->errs, PKV_ESTATE, "pkv_session_fork: drafts are pending "
                         "(pkv_session_commit first)");
    const pkvi_ctx ctx = {geo, cache, src->exec, src->errs};
    pkv_session *s = pkvi_session_alloc(&ctx);
    if (!s)
        return pkvi_fail(src->errs, PKV_ENOMEM, "pkv_session_fork: out of memory");
    /* Allocate everything first, so the shared part below cannot fail. */
    uint64_t max_pages = 0;
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++) {
        const uint64_t n = pkvi_btable_n_pages(src->layers[l]);
        max_pages = n > max_pages ? n : max_pages;
        if (pkvi_btable_reserve(s->layers[l], n) != PKV_OK) {
            pkvi_session_free(s);
            return pkvi_fail(src->errs, PKV_ENOMEM, "pkv_session_fork: out of memory");
        }
    }
    if (pkvi_session_reserve_partials(s, max_pages) != PKV_OK ||
        copy_record(s, src) != PKV_OK) {
        pkvi_session_free(s);
        return pkvi_fail(src->errs, PKV_ENOMEM, "pkv_session_fork: out of memory");
    }
    /* B5: src's pages gain holders here; the only thread that may write one of them
     * (src's owner, for a tail page with refs == 1) is the one making this call. */
    pthread_mutex_lock(&cache->lock);
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
        pkvi_btable_share(s->layers[l], src->layers[l]);
    pkvi_session_link(s);
    pthread_mutex_unlock(&cache->lock);
    *out = s;
    return PKV_OK;
}

void pkv_session_destroy(pkv_session *s)
{
    if (!s)
        return;
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    const pkvi_pages ps = pkvi_cache_pages(cache);
    pthread_mutex_lock(&cache->lock);
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
        pkvi_btable_truncate(s->layers[l], ps, geo->cfg.block_tokens, 0);
    if (s->prev)
        s->prev->next = s->next;
    else
        cache->sessions = s->next;
    if (s->next)
        s->next->prev = s->prev;
    cache->n_sessions--;
    pkvi_prefix_trim(&cache->prefix, ps); /* its indexed pages are cached now */
    pthread_mutex_unlock(&cache->lock);
    pkvi_session_free(s);
}

void pkvi_sessions_destroy_all(pkvi_cache *cache)
{
    while (cache->sessions)
        pkv_session_destroy(cache->sessions);
}

uint64_t pkv_session_len(const pkv_session *s, uint32_t layer)
{
    if (!s || layer >= s->geom->cfg.n_layers)
        return 0;
    return pkvi_btable_len(s->layers[layer]);
}

pkv_status pkv_session_truncate(pkv_session *s, uint64_t n_tokens)
{
    if (!s)
        return PKV_EINVAL;
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    if (pkvi_boundary_check(geo, cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    if (pkvi_session_pending(s))
        return pkvi_fail(s->errs, PKV_ESTATE, "pkv_session_truncate: drafts are pending "
                         "(pkv_session_commit first)");
    uint64_t max_len = 0;
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
        if (pkvi_btable_len(s->layers[l]) > max_len)
            max_len = pkvi_btable_len(s->layers[l]);
    if (n_tokens > max_len)
        return pkvi_fail(s->errs, PKV_ERANGE, "pkv_session_truncate: %llu is past every "
                         "layer's length (the longest holds %llu)",
                         (unsigned long long)n_tokens, (unsigned long long)max_len);
    /* a windowed layer goes back only as far as what a decode at n - 1 reads is held;
     * a shard (docs/sharding.md) never below its first position (the hole below it
     * holds other shards' positions, not released ones) */
    const uint64_t bt = geo->cfg.block_tokens;
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++) {
        uint64_t at = 0;
        switch (pkvi_btable_cut_check(s->layers[l], bt, geo->layers[l].window, n_tokens, &at)) {
        case PKVI_CUT_OK:
            break;
        case PKVI_CUT_SHARD:
            return pkvi_fail(s->errs, PKV_ERANGE, "pkv_session_truncate: layer %u is a "
                             "shard that starts at %llu", l, (unsigned long long)at);
        case PKVI_CUT_RELEASED:
            return pkvi_fail(s->errs, PKV_ERANGE, "pkv_session_truncate: layer %u's window "
                             "released positions below %llu, which a decode at %llu would "
                             "read", l, (unsigned long long)at,
                             (unsigned long long)(n_tokens - 1));
        }
    }
    const pkvi_pages ps = pkvi_cache_pages(cache);
    pthread_mutex_lock(&cache->lock);
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
        pkvi_btable_truncate(s->layers[l], ps, bt, n_tokens);
    pkvi_prefix_trim(&cache->prefix, ps);
    pthread_mutex_unlock(&cache->lock);
    truncate_record(s, n_tokens);
    return PKV_OK;
}

/* ---- shards (docs/sharding.md) ---------------------------------------------------------- */

/* Every layer of an empty session starts at `first`: its first first / bt entries
 * are a hole (btable.c), so positions keep their absolute indices and decode's
 * absolute chunks (decode.c) are the whole context's. All or nothing. */
pkv_status pkv_session_set_first(pkv_session *s, uint64_t first)
{
    if (!s)
        return PKV_EINVAL;
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    if (pkvi_boundary_check(geo, cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    const uint64_t align = pkvi_shard_align(geo), bt = geo->cfg.block_tokens;
    if (first % align)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_set_first: %llu is not a "
                         "multiple of pkv_shard_align (%llu)", (unsigned long long)first,
                         (unsigned long long)align);
    if (first > UINT64_MAX / 2)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_set_first: %llu is above 2^63 - "
                         "1, the last first position a shard may have",
                         (unsigned long long)first);
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
        if (pkvi_btable_len(s->layers[l]) || pkvi_btable_n_pages(s->layers[l]))
            return pkvi_fail(s->errs, PKV_ESTATE, "pkv_session_set_first: layer %u is not "
                             "empty", l);
    if (first == 0)
        return PKV_OK;
    pthread_mutex_lock(&cache->lock);
    pkv_status st = PKV_OK;
    /* capacity first, so that setting the holes below cannot fail half-way */
    for (uint32_t l = 0; l < geo->cfg.n_layers && st == PKV_OK; l++)
        st = pkvi_btable_reserve(s->layers[l], first / bt + 1);
    if (st == PKV_OK)
        st = pkvi_session_reserve_partials(s, first / bt + 1);
    if (st == PKV_OK)
        for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
            (void)pkvi_btable_set_first(s->layers[l], bt, first);
    pthread_mutex_unlock(&cache->lock);
    if (st != PKV_OK)
        return pkvi_fail(s->errs, st, "pkv_session_set_first: out of memory");
    return PKV_OK;
}

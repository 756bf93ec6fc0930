/*
 * session.c - a session's lifecycle: the object itself (its tables, its decode
 * scratch, its token record) and its place on the engine's session list; create,
 * fork, destroy, truncate, pkv_session_len; and the shard calls pkv_shard_align /
 * pkv_session_set_first (SPEC §11).
 *
 * Owns struct pkv_session's allocation and the engine's session list (e->lock).
 * Calls down into btable.c (tables and references) and prefix.c (trim after a
 * page is let go); nothing here calls another session file but the invariant check
 * at API boundaries (session/account.c), and nothing calls decode.c, persist_*.c or
 * engine.c. What a write takes is session/write.c's, which pages are in memory
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

pkv_session *pkvi_session_alloc(pkv_engine *e)
{
    pkv_session *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->e = e;
    s->layers = calloc(e->cfg.n_layers, sizeof *s->layers);
    if (!s->layers) {
        free(s);
        return NULL;
    }
    return s;
}

void pkvi_session_free(pkv_session *s)
{
    for (uint32_t l = 0; l < s->e->cfg.n_layers; l++)
        pkvi_btable_free(&s->layers[l]);
    free(s->layers);
    free(s->partials);
    free(s->tokens);
    free(s);
}

/* Under e->lock. */
void pkvi_session_link(pkv_engine *e, pkv_session *s)
{
    s->prev = NULL;
    s->next = e->sessions;
    if (e->sessions)
        e->sessions->prev = s;
    e->sessions = s;
    e->n_sessions++;
    s->lru = ++e->clock;
}

/* ---- decode scratch ------------------------------------------------------------------ */

/* Split-K partial states for layers of up to n_pages pages (decode.c's layout; the
 * sink pages of a windowed layer add chunks of their own). */
pkv_status pkvi_session_reserve_partials(pkv_session *s, uint64_t n_pages)
{
    pkv_engine *e = s->e;
    const uint64_t chunks = pkvi_max_chunks(e, n_pages);
    if (chunks <= s->partials_chunks)
        return PKV_OK;
    uint64_t want = s->partials_chunks ? s->partials_chunks * 2 : 1;
    if (want < chunks)
        want = chunks;
    if (want > PKVI_MAX_CHUNKS + 1) /* the running states and one wave */
        want = PKVI_MAX_CHUNKS + 1;
    uint64_t floats, bytes;
    if (!pkvi_mul(want, e->cfg.n_heads, &floats) ||
        !pkvi_mul(floats, (uint64_t)e->cfg.head_dim_v + 2, &floats) ||
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

/* ---- the token record (SPEC §10) ----------------------------------------------------- */

/* The fork's copy of src's token record. PKV_ENOMEM. */
static pkv_status copy_record(pkv_session *s, const pkv_session *src)
{
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

/* A truncate to n shortens the record. */
static void truncate_record(pkv_session *s, uint64_t n)
{
    if (n >= s->n_tokens)
        return;
    s->n_tokens = n;
    const uint64_t pages = n / s->e->cfg.block_tokens;
    if (s->indexed_pages > pages)
        s->indexed_pages = pages;
}

/* ---- create, fork, destroy, truncate ---------------------------------------------------- */

pkv_status pkv_session_create(pkv_engine *e, pkv_session **out)
{
    if (!e)
        return PKV_EINVAL;
    if (!out)
        return pkvi_fail(e, PKV_EINVAL, "pkv_session_create: out is NULL");
    pkv_session *s = pkvi_session_alloc(e);
    if (!s)
        return pkvi_fail(e, PKV_ENOMEM, "pkv_session_create: out of memory");
    pthread_mutex_lock(&e->lock);
    pkvi_session_link(e, s);
    pthread_mutex_unlock(&e->lock);
    *out = s;
    return PKV_OK;
}

pkv_status pkv_session_fork(pkv_session *src, pkv_session **out)
{
    if (!src)
        return PKV_EINVAL;
    pkv_engine *e = src->e;
    if (!out)
        return pkvi_fail(e, PKV_EINVAL, "pkv_session_fork: out is NULL");
    PKVI_BOUNDARY_CHECK(e);
    pkv_session *s = pkvi_session_alloc(e);
    if (!s)
        return pkvi_fail(e, PKV_ENOMEM, "pkv_session_fork: out of memory");
    /* Allocate everything first, so the shared part below cannot fail. */
    uint64_t max_pages = 0;
    for (uint32_t l = 0; l < e->cfg.n_layers; l++) {
        const uint64_t n = src->layers[l].n_pages;
        max_pages = n > max_pages ? n : max_pages;
        if (pkvi_btable_reserve(&s->layers[l], n) != PKV_OK) {
            pkvi_session_free(s);
            return pkvi_fail(e, PKV_ENOMEM, "pkv_session_fork: out of memory");
        }
    }
    if (pkvi_session_reserve_partials(s, max_pages) != PKV_OK ||
        copy_record(s, src) != PKV_OK) {
        pkvi_session_free(s);
        return pkvi_fail(e, PKV_ENOMEM, "pkv_session_fork: out of memory");
    }
    /* B5: src's pages gain holders here; the only thread that may write one of them
     * (src's owner, for a tail page with refs == 1) is the one making this call. */
    pthread_mutex_lock(&e->lock);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        pkvi_btable_share(&s->layers[l], &src->layers[l]);
    pkvi_session_link(e, s);
    pthread_mutex_unlock(&e->lock);
    *out = s;
    return PKV_OK;
}

void pkv_session_destroy(pkv_session *s)
{
    if (!s)
        return;
    pkv_engine *e = s->e;
    pthread_mutex_lock(&e->lock);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        pkvi_btable_truncate(&s->layers[l], pkvi_engine_pages(e), e->cfg.block_tokens, 0);
    if (s->prev)
        s->prev->next = s->next;
    else
        e->sessions = s->next;
    if (s->next)
        s->next->prev = s->prev;
    e->n_sessions--;
    pkvi_prefix_trim(&e->prefix, pkvi_engine_pages(e)); /* its indexed pages are cached now */
    pthread_mutex_unlock(&e->lock);
    pkvi_session_free(s);
}

uint64_t pkv_session_len(const pkv_session *s, uint32_t layer)
{
    if (!s || layer >= s->e->cfg.n_layers)
        return 0;
    return s->layers[layer].len;
}

pkv_status pkv_session_truncate(pkv_session *s, uint64_t n_tokens)
{
    if (!s)
        return PKV_EINVAL;
    pkv_engine *e = s->e;
    PKVI_BOUNDARY_CHECK(e);
    uint64_t max_len = 0;
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        if (s->layers[l].len > max_len)
            max_len = s->layers[l].len;
    if (n_tokens > max_len)
        return pkvi_fail(e, PKV_ERANGE, "pkv_session_truncate: %llu is past every layer's "
                         "length (the longest holds %llu)", (unsigned long long)n_tokens,
                         (unsigned long long)max_len);
    /* a windowed layer goes back only as far as what a decode at n - 1 reads is held;
     * a shard (SPEC §11) never below its first position (the hole below it holds
     * other shards' positions, not released ones) */
    const uint64_t bt = e->cfg.block_tokens;
    for (uint32_t l = 0; l < e->cfg.n_layers; l++) {
        const pkvi_btable *t = &s->layers[l];
        if (n_tokens < t->first)
            return pkvi_fail(e, PKV_ERANGE, "pkv_session_truncate: layer %u is a shard "
                             "that starts at %llu", l, (unsigned long long)t->first);
        const uint32_t w = e->layers[l].window;
        const uint64_t base = t->first > t->hole_lo * bt ? t->first : t->hole_lo * bt;
        if (!w || n_tokens >= t->len || n_tokens == 0 || t->hole_hi * bt <= base)
            continue;
        const uint64_t lo = n_tokens > w ? n_tokens - w : 0;
        if (lo < t->hole_hi * bt && n_tokens > base)
            return pkvi_fail(e, PKV_ERANGE, "pkv_session_truncate: layer %u's window released "
                             "positions below %llu, which a decode at %llu would read",
                             l, (unsigned long long)(t->hole_hi * bt),
                             (unsigned long long)(n_tokens - 1));
    }
    pthread_mutex_lock(&e->lock);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        pkvi_btable_truncate(&s->layers[l], pkvi_engine_pages(e), e->cfg.block_tokens,
                             n_tokens);
    pkvi_prefix_trim(&e->prefix, pkvi_engine_pages(e));
    pthread_mutex_unlock(&e->lock);
    truncate_record(s, n_tokens);
    return PKV_OK;
}

/* ---- shards (SPEC §11) ------------------------------------------------------------------ */

uint64_t pkv_shard_align(const pkv_engine *e)
{
    if (!e)
        return 0;
    uint64_t sinks = 0;
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        if (e->layers[l].window && e->layers[l].sink_tokens > sinks)
            sinks = e->layers[l].sink_tokens;
    return pkvi_shard_align(e, sinks);
}

/* Every layer of an empty session starts at `first`: its first first / bt entries
 * are a hole (btable.c), so positions keep their absolute indices and decode's
 * absolute chunks (decode.c) are the whole context's. All or nothing. */
pkv_status pkv_session_set_first(pkv_session *s, uint64_t first)
{
    if (!s)
        return PKV_EINVAL;
    pkv_engine *e = s->e;
    PKVI_BOUNDARY_CHECK(e);
    const uint64_t align = pkv_shard_align(e), bt = e->cfg.block_tokens;
    if (first % align)
        return pkvi_fail(e, PKV_EINVAL, "pkv_session_set_first: %llu is not a multiple of "
                         "pkv_shard_align (%llu)", (unsigned long long)first,
                         (unsigned long long)align);
    if (first > UINT64_MAX / 2)
        return pkvi_fail(e, PKV_EINVAL, "pkv_session_set_first: %llu is above 2^63 - 1, the "
                         "last first position a shard may have", (unsigned long long)first);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        if (s->layers[l].len || s->layers[l].n_pages)
            return pkvi_fail(e, PKV_ESTATE, "pkv_session_set_first: layer %u is not empty",
                             l);
    if (first == 0)
        return PKV_OK;
    pthread_mutex_lock(&e->lock);
    pkv_status st = PKV_OK;
    /* capacity first, so that setting the holes below cannot fail half-way */
    for (uint32_t l = 0; l < e->cfg.n_layers && st == PKV_OK; l++)
        st = pkvi_btable_reserve(&s->layers[l], first / bt + 1);
    if (st == PKV_OK)
        st = pkvi_session_reserve_partials(s, first / bt + 1);
    if (st == PKV_OK)
        for (uint32_t l = 0; l < e->cfg.n_layers; l++)
            (void)pkvi_btable_set_first(&s->layers[l], bt, first);
    pthread_mutex_unlock(&e->lock);
    if (st != PKV_OK)
        return pkvi_fail(e, st, "pkv_session_set_first: out of memory");
    return PKV_OK;
}

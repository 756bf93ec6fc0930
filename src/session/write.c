/*
 * session/write.c - every write into a layer, as one reserve-then-commit path
 * (session.h draws it): pkvi_session_reserve / _write / _write_pages / _finish (which
 * also gives back what a windowed layer will not read again), and the calls made of
 * it - pkv_append, the loader's pkvi_session_push_page, the draft rows of pkv_verify
 * (pkvi_session_reserve_drafts / _write_drafts) and the moves of a commit
 * (pkvi_session_keep_drafts) - plus the loader's pkvi_session_skip_pages (a windowed
 * layer's released hole).
 *
 * Owns the order a write takes things in, and with it B5's writer side: a page is
 * marked as being written only while its table holds it alone, and nothing is given
 * up before everything the call needs is held, so a failed write changes nothing and
 * never needs an undo. Takes its pages from session/residency.c (which spills to make
 * room) and grows the decode scratch through session.c; pkv_prefill (decode.c) writes
 * through the same reservation. Every change to a table is a call of btable.c (push,
 * copy-on-write, the writing marks, advance, release). Does not create, fork or
 * truncate sessions (session.c).
 */
#include "session/private.h"

#include <stdlib.h>
#include <string.h>

/* ---- reserve, write, finish ------------------------------------------------------------ */

/* Rows [len, len + n) of `layer`: for a write (they become positions) or for drafts,
 * which replace the layer's pending drafts: the pages those hold past the n rows are
 * released once everything is held. Page len / bt, where a partial first row goes,
 * is brought back and copied if shared; pages past the table's entries are taken.
 * `call` is the public call, for the failure reasons. */
static pkv_status reserve_rows(pkv_session *s, uint32_t layer, uint64_t n, bool drafts,
                               pkvi_reservation *r, const char *call)
{
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    pkvi_btable *t = s->layers[layer];
    const uint64_t bt = geo->cfg.block_tokens, start = pkvi_btable_len(t);
    uint64_t end_len;
    if (n == 0 || !pkvi_add(start, n, &end_len) || end_len > UINT64_MAX - bt)
        return pkvi_fail(s->errs, PKV_EINVAL, "%s: layer %u holds %llu positions; %llu more %s",
                         call, layer, (unsigned long long)start, (unsigned long long)n,
                         n ? "overflow a position" : "is nothing to write");
    const uint64_t end_page = (end_len + bt - 1) / bt, had = pkvi_btable_n_pages(t);
    const uint64_t n_new = end_page > had ? end_page - had : 0;
    const bool partial = start % bt != 0;

    /* The page list: on the stack for an append (at most 2 pages), else allocated. */
    pkvi_page *small[2], **fresh = small;
    if (n_new + 1 > 2) {
        uint64_t bytes;
        if (!pkvi_mul(n_new + 1, sizeof *fresh, &bytes) || bytes > SIZE_MAX ||
            !(fresh = malloc((size_t)bytes)))
            return pkvi_fail(s->errs, PKV_ENOMEM, "%s: layer %u: out of memory", call, layer);
    }
    pthread_mutex_lock(&cache->lock);
    if (cache->spill)
        pkvi_btable_pin(t);
    /* Bringing the tail back and making room may let the lock go (the I/O runs without
     * it): t is pinned, so its tail stays resident, but another holder may drop the
     * tail meanwhile - so whether it is shared is asked again once the pages are held,
     * under the same hold as everything after. */
    pkv_status st = PKV_OK;
    bool cow = false;
    for (;;) {
        if (partial &&
            (st = pkvi_session_fault_in(geo, cache, t, layer, start / bt)) != PKV_OK)
            break;
        cow = partial && pkvi_btable_shared_at(t, start / bt);
        if ((st = pkvi_session_take_pages(geo, cache, n_new + cow, fresh)) != PKV_OK)
            break;
        const bool cow_now = partial && pkvi_btable_shared_at(t, start / bt);
        if (cow_now == cow)
            break;
        for (uint64_t i = 0; i < n_new + cow; i++)
            pkvi_page_destroy(cache->pool, fresh[i]); /* nobody holds them yet */
    }
    if (st == PKV_OK) {
        st = pkvi_btable_reserve(t, end_page);
        if (st == PKV_OK)
            st = pkvi_session_reserve_partials(s, end_page);
        if (st != PKV_OK)
            for (uint64_t i = 0; i < n_new + cow; i++)
                pkvi_page_destroy(cache->pool, fresh[i]); /* nobody holds them yet */
    }
    if (st != PKV_OK) {
        if (cache->spill)
            pkvi_btable_unpin(t);
        const uint64_t budget = pkvi_pool_count(cache->pool).budget_pages;
        pthread_mutex_unlock(&cache->lock);
        if (fresh != small)
            free(fresh);
        if (st == PKV_EIO)
            return pkvi_fail(s->errs, st, "%s: layer %u: a spilled page could not be read back",
                             call, layer);
        if (budget)
            return pkvi_fail(s->errs, st, "%s: layer %u: %llu more page(s) do not fit the "
                             "budget of %llu pages%s", call, layer,
                             (unsigned long long)(n_new + cow), (unsigned long long)budget,
                             cache->spill ? " (nothing more could be spilled)"
                                          : " (no spill_dir)");
        return pkvi_fail(s->errs, st, "%s: layer %u: out of memory", call, layer);
    }
    /* Nothing fails from here on. */
    const pkvi_pages ps = pkvi_cache_pages(cache);
    if (cow) { /* copy-on-write: the only copy a fork ever causes */
        pkvi_btable_cow_at(t, ps, start / bt, fresh[n_new], geo->page_bytes);
        pkvi_prefix_trim(&cache->prefix, ps); /* the original may be cached now */
    }
    for (uint64_t i = 0; i < n_new; i++)
        pkvi_btable_push(t, fresh[i]);
    if (drafts) { /* the drafts before are replaced: their rows are overwritten next */
        pkvi_btable_drop_from(t, ps, end_page);
        pkvi_btable_set_pending(t, 0);
    }
    r->layer = layer;
    r->first_page = start / bt;
    r->end_page = end_page;
    r->pinned = cache->spill != NULL;
    pkvi_btable_mark_writing(t, r->first_page, end_page, true);
    s->lru = ++cache->clock;
    pthread_mutex_unlock(&cache->lock);
    if (fresh != small)
        free(fresh);
    return PKV_OK;
}

pkv_status pkvi_session_reserve(pkv_session *s, uint32_t layer, uint64_t n,
                                pkvi_reservation *r, const char *call)
{
    return reserve_rows(s, layer, n, false, r, call);
}

pkv_status pkvi_session_reserve_drafts(pkv_session *s, uint32_t layer, uint64_t n,
                                       pkvi_reservation *r)
{
    return reserve_rows(s, layer, n, true, r, "pkv_verify");
}

/* Store n rows (k, v [n][g][d]) at positions pos, pos + 1, ... of table t (layer's).
 * A rope layer turns each key at its position (SPEC §14): the slot it is stored at, or
 * for drafts (depth non-NULL) pos + depth[j], the position the draft stands for - a
 * commit moves a kept draft's row to exactly that position, so its bits are then what
 * an append there would have stored. */
static void store_rows(pkv_session *s, pkvi_btable *t, uint32_t layer, uint64_t pos,
                       uint64_t n, const uint32_t *depth, const float *k, const float *v)
{
    const pkvi_geom *geo = s->geom;
    const uint32_t d = geo->cfg.head_dim, dv = geo->cfg.head_dim_v, g = geo->cfg.n_kv_heads;
    const uint64_t bt = geo->cfg.block_tokens, base = pos;
    const pkvi_kparams *kp = &geo->kp;
    const pkvi_rope *rope = pkvi_layer_rope(geo, layer);
    float cs[PKVI_ROPE_MAX_DIMS], kr[PKVI_MAX_HEAD_DIM]; /* rope: the angles, one key */
    for (uint64_t j = 0; j < n; j++, pos++, k += (size_t)g * d, v += (size_t)g * dv) {
        char *page = pkvi_btable_page(t, pos / bt)->data;
        const uint64_t row = pos % bt;
        if (rope)
            pkvi_rope_at(rope, depth ? base + depth[j] : pos, cs);
        for (uint32_t gi = 0; gi < g; gi++) {
            char *gb = page + gi * kp->group_stride;
            const float *key = k + (size_t)gi * d;
            if (rope) {
                memcpy(kr, key, (size_t)d * sizeof *kr);
                pkvi_rope_apply(rope, cs, kr, 1, d);
                key = kr;
            }
            geo->kern->store_row(geo->cfg.kv_dtype, gb + row * geo->row_bytes, key, d);
            geo->kern->store_row(geo->cfg.kv_dtype, gb + kp->v_offset + row * geo->row_bytes_v,
                                 v + (size_t)gi * dv, dv);
        }
    }
}

void pkvi_session_write_drafts(pkv_session *s, const pkvi_reservation *r, uint64_t n,
                               const uint32_t *depth, const float *k, const float *v)
{
    pkvi_btable *t = s->layers[r->layer];
    if (s->hook_before_write)
        s->hook_before_write(s->hook_ctx);
    store_rows(s, t, r->layer, pkvi_btable_len(t), n, depth, k, v);
    pthread_mutex_lock(&s->cache->lock);
    pkvi_btable_set_pending(t, n);
    pthread_mutex_unlock(&s->cache->lock);
}

void pkvi_session_keep_drafts(pkv_session *s, uint32_t layer, uint32_t n_keep,
                              const uint32_t *path)
{
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    pkvi_btable *t = s->layers[layer];
    const uint32_t g = geo->cfg.n_kv_heads;
    const uint64_t bt = geo->cfg.block_tokens, len = pkvi_btable_len(t);
    const pkvi_kparams *kp = &geo->kp;
    /* draft path[j] sits at len + path[j] >= len + j, and path[j] < path[j + 1]: moving
     * in order of j never overwrites a row still to move. A stored row moves as its
     * bytes, so the position holds what storing it there would have. The pages are this
     * table's alone: a verify copied a shared one, and nothing shares pending pages. */
    for (uint32_t j = 0; j < n_keep; j++) {
        if (path[j] == j)
            continue;
        const uint64_t from = len + path[j], to = len + j;
        const char *src = pkvi_btable_page(t, from / bt)->data;
        char *dst = pkvi_btable_page(t, to / bt)->data;
        for (uint32_t gi = 0; gi < g; gi++) {
            const size_t gs = gi * kp->group_stride;
            memcpy(dst + gs + (to % bt) * geo->row_bytes, src + gs + (from % bt) * geo->row_bytes,
                   (size_t)geo->row_bytes);
            memcpy(dst + gs + kp->v_offset + (to % bt) * geo->row_bytes_v,
                   src + gs + kp->v_offset + (from % bt) * geo->row_bytes_v,
                   (size_t)geo->row_bytes_v);
        }
    }
    const pkv_layer_config *lc = &geo->layers[layer];
    const pkvi_pages ps = pkvi_cache_pages(cache);
    pthread_mutex_lock(&cache->lock);
    pkvi_btable_settle(t, ps, bt, n_keep);
    /* a windowed layer gives back what nothing reads again, as a write's finish does */
    const uint64_t sinks = pkvi_sink_pages(geo, lc);
    const uint64_t keep = lc->window ? pkvi_window_keep_from(lc, len + n_keep, bt) : 0;
    if (pkvi_btable_release_due(t, sinks, keep))
        pkvi_btable_release(t, ps, sinks, keep);
    pkvi_prefix_trim(&cache->prefix, ps);
    s->lru = ++cache->clock;
    pthread_mutex_unlock(&cache->lock);
}

void pkvi_session_write(pkv_session *s, const pkvi_reservation *r, uint64_t n,
                        const float *k, const float *v)
{
    pkvi_btable *t = s->layers[r->layer];
    if (s->hook_before_write)
        s->hook_before_write(s->hook_ctx);
    store_rows(s, t, r->layer, pkvi_btable_len(t), n, NULL, k, v);
    pkvi_btable_advance(t, n);
}

void pkvi_session_write_pages(pkv_session *s, const pkvi_reservation *r, const void *bytes,
                              uint64_t tokens)
{
    const pkvi_geom *geo = s->geom;
    pkvi_btable *t = s->layers[r->layer];
    const uint64_t bt = geo->cfg.block_tokens;
    for (uint64_t done = 0; done < tokens; done += bt) {
        memcpy(pkvi_btable_page(t, pkvi_btable_len(t) / bt)->data,
               (const char *)bytes + done / bt * geo->page_bytes, (size_t)geo->page_bytes);
        pkvi_btable_advance(t, tokens - done < bt ? tokens - done : bt);
    }
}

void pkvi_session_finish(pkv_session *s, pkvi_reservation *r)
{
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    pkvi_btable *t = s->layers[r->layer];
    const pkv_layer_config *lc = &geo->layers[r->layer];
    pkvi_btable_mark_writing(t, r->first_page, r->end_page, false);
    /* a windowed layer gives back what nothing reads again: at most once a page */
    const uint64_t sinks = pkvi_sink_pages(geo, lc);
    const uint64_t keep =
        lc->window ? pkvi_window_keep_from(lc, pkvi_btable_len(t), geo->cfg.block_tokens) : 0;
    const bool trim = pkvi_btable_release_due(t, sinks, keep);
    if (r->pinned || trim) {
        const pkvi_pages ps = pkvi_cache_pages(cache);
        pthread_mutex_lock(&cache->lock);
        if (trim) {
            pkvi_btable_release(t, ps, sinks, keep);
            pkvi_prefix_trim(&cache->prefix, ps);
        }
        if (r->pinned)
            pkvi_btable_unpin(t);
        pthread_mutex_unlock(&cache->lock);
    }
}

/* ---- the calls made of it ------------------------------------------------------------- */

pkv_status pkv_append(pkv_session *s, uint32_t layer, const float *k, const float *v)
{
    if (!s)
        return PKV_EINVAL;
    if (layer >= s->geom->cfg.n_layers)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_append: layer %u, but the engine has %u",
                         layer, s->geom->cfg.n_layers);
    if (!k || !v)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_append: k or v is NULL");
    if (pkvi_boundary_check(s->geom, s->cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    if (pkvi_btable_pending(s->layers[layer]))
        return pkvi_fail(s->errs, PKV_ESTATE, "pkv_append: layer %u has pending drafts "
                         "(pkv_session_commit first)", layer);
    pkvi_reservation r;
    const pkv_status st = pkvi_session_reserve(s, layer, 1, &r, "pkv_append");
    if (st != PKV_OK)
        return st;
    pkvi_session_write(s, &r, 1, k, v);
    pkvi_session_finish(s, &r);
    return PKV_OK;
}

pkv_status pkvi_session_push_page(pkv_session *s, uint32_t layer, const void *bytes,
                                  uint32_t tokens)
{
    const uint64_t bt = s->geom->cfg.block_tokens;
    if (tokens == 0 || tokens > bt || pkvi_btable_len(s->layers[layer]) % bt)
        return PKV_EINVAL;
    pkvi_reservation r;
    const pkv_status st = pkvi_session_reserve(s, layer, tokens, &r, "pkv_session_load");
    if (st != PKV_OK)
        return st;
    pkvi_session_write_pages(s, &r, bytes, tokens);
    pkvi_session_finish(s, &r);
    return PKV_OK;
}

pkv_status pkvi_session_skip_pages(pkv_session *s, uint32_t layer, uint64_t page)
{
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    const pkv_layer_config *lc = &geo->layers[layer];
    if (!lc->window)
        return PKV_EINVAL;
    pkvi_btable *t = s->layers[layer];
    /* the hole grows from the sink pages, or from a shard's own hole [0, first / bt) */
    const uint64_t lo = pkvi_btable_first(t) ? 0 : pkvi_sink_pages(geo, lc);
    pthread_mutex_lock(&cache->lock);
    const pkv_status st = pkvi_btable_skip_to(t, geo->cfg.block_tokens, lo, page);
    pthread_mutex_unlock(&cache->lock);
    return st;
}

void pkvi_session_hook_before_write(pkv_session *s, void (*fn)(void *ctx), void *ctx)
{
    s->hook_before_write = fn;
    s->hook_ctx = ctx;
}

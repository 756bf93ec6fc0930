/*
 * session/write.c - every write into a layer, as one reserve-then-commit path
 * (session.h draws it): pkvi_session_reserve / _write / _write_pages / _finish (which
 * also gives back what a windowed layer will not read again), and the calls made of
 * it - pkv_append, the loader's pkvi_session_push_page - plus the loader's
 * pkvi_session_skip_pages (a windowed layer's released hole).
 *
 * Owns the order a write takes things in, and with it B5's writer side: a page is
 * marked as being written only while its table holds it alone, and nothing is given
 * up before everything the call needs is held, so a failed write changes nothing and
 * never needs an undo. Takes its pages from session/residency.c (which spills to make
 * room) and grows the decode scratch through session.c; pkv_prefill (decode.c) writes
 * through the same reservation. Does not create, fork or truncate sessions
 * (session.c).
 */
#include "session/private.h"

#include <stdlib.h>
#include <string.h>

/* ---- reserve, write, finish ------------------------------------------------------------ */

pkv_status pkvi_session_reserve(pkv_session *s, uint32_t layer, uint64_t n,
                                pkvi_reservation *r, const char *call)
{
    pkv_engine *e = s->e;
    pkvi_btable *t = &s->layers[layer];
    const uint64_t bt = e->cfg.block_tokens, start = t->len;
    uint64_t end_len;
    if (n == 0 || !pkvi_add(start, n, &end_len) || end_len > UINT64_MAX - bt)
        return pkvi_fail(e, PKV_EINVAL, "%s: layer %u holds %llu positions; %llu more %s", call,
                         layer, (unsigned long long)start, (unsigned long long)n,
                         n ? "overflow a position" : "is nothing to write");
    const uint64_t end_page = (end_len + bt - 1) / bt;
    const uint64_t n_new = end_page - t->n_pages;
    const bool partial = start % bt != 0;

    /* The page list: on the stack for an append (at most 2 pages), else allocated. */
    pkvi_page *small[2], **fresh = small;
    if (n_new + 1 > 2) {
        uint64_t bytes;
        if (!pkvi_mul(n_new + 1, sizeof *fresh, &bytes) || bytes > SIZE_MAX ||
            !(fresh = malloc((size_t)bytes)))
            return pkvi_fail(e, PKV_ENOMEM, "%s: layer %u: out of memory", call, layer);
    }
    pthread_mutex_lock(&e->lock);
    if (e->spill)
        t->pins++;
    pkv_status st = partial ? pkvi_session_fault_in(e, t, layer, t->n_pages - 1) : PKV_OK;
    const bool cow = partial && st == PKV_OK && t->pages[t->n_pages - 1]->refs > 1;
    if (st == PKV_OK)
        st = pkvi_session_take_pages(e, n_new + cow, fresh);
    if (st == PKV_OK) {
        st = pkvi_btable_reserve(t, end_page);
        if (st == PKV_OK)
            st = pkvi_session_reserve_partials(s, end_page);
        if (st != PKV_OK)
            for (uint64_t i = 0; i < n_new + cow; i++) {
                fresh[i]->refs = 0;
                pkvi_page_destroy(&e->pool, fresh[i]);
            }
    }
    if (st != PKV_OK) {
        if (e->spill)
            t->pins--;
        const uint64_t budget = e->pool.budget_pages;
        pthread_mutex_unlock(&e->lock);
        if (fresh != small)
            free(fresh);
        if (st == PKV_EIO)
            return pkvi_fail(e, st, "%s: layer %u: a spilled page could not be read back", call,
                             layer);
        if (budget)
            return pkvi_fail(e, st, "%s: layer %u: %llu more page(s) do not fit the budget of "
                             "%llu pages%s", call, layer, (unsigned long long)(n_new + cow),
                             (unsigned long long)budget,
                             e->spill ? " (nothing more could be spilled)" : " (no spill_dir)");
        return pkvi_fail(e, st, "%s: layer %u: out of memory", call, layer);
    }
    /* Nothing fails from here on. */
    if (cow) { /* copy-on-write: the only copy a fork ever causes */
        pkvi_page *copy = fresh[n_new];
        memcpy(copy->data, t->pages[t->n_pages - 1]->data, (size_t)e->page_bytes);
        pkvi_btable_replace(t, pkvi_engine_pages(e), t->n_pages - 1, copy);
        pkvi_prefix_trim(&e->prefix, pkvi_engine_pages(e)); /* the original may be cached now */
    }
    for (uint64_t i = 0; i < n_new; i++)
        pkvi_btable_push(t, fresh[i]);
    r->layer = layer;
    r->first_page = start / bt;
    r->end_page = end_page;
    r->pinned = e->spill != NULL;
    for (uint64_t i = r->first_page; i < end_page; i++)
        atomic_store_explicit(&t->pages[i]->writing, 1, memory_order_relaxed);
    s->lru = ++e->clock;
    pthread_mutex_unlock(&e->lock);
    if (fresh != small)
        free(fresh);
    return PKV_OK;
}

void pkvi_session_write(pkv_session *s, const pkvi_reservation *r, uint64_t n,
                        const float *k, const float *v)
{
    pkv_engine *e = s->e;
    pkvi_btable *t = &s->layers[r->layer];
    const uint32_t d = e->cfg.head_dim, dv = e->cfg.head_dim_v, g = e->cfg.n_kv_heads;
    const uint64_t bt = e->cfg.block_tokens;
    if (e->hook_before_write)
        e->hook_before_write(e->hook_ctx);
    for (uint64_t j = 0; j < n; j++, k += (size_t)g * d, v += (size_t)g * dv) {
        char *page = t->pages[t->len / bt]->data;
        const uint64_t row = t->len % bt;
        for (uint32_t gi = 0; gi < g; gi++) {
            char *gb = page + gi * e->kp.group_stride;
            e->kern->store_row(e->cfg.kv_dtype, gb + row * e->row_bytes, k + (size_t)gi * d, d);
            e->kern->store_row(e->cfg.kv_dtype, gb + e->kp.v_offset + row * e->row_bytes_v,
                               v + (size_t)gi * dv, dv);
        }
        t->len++;
    }
}

void pkvi_session_write_pages(pkv_session *s, const pkvi_reservation *r, const void *bytes,
                              uint64_t tokens)
{
    pkv_engine *e = s->e;
    pkvi_btable *t = &s->layers[r->layer];
    const uint64_t bt = e->cfg.block_tokens;
    for (uint64_t done = 0; done < tokens; done += bt) {
        memcpy(t->pages[t->len / bt]->data,
               (const char *)bytes + done / bt * e->page_bytes, (size_t)e->page_bytes);
        t->len += tokens - done < bt ? tokens - done : bt;
    }
}

void pkvi_session_finish(pkv_session *s, pkvi_reservation *r)
{
    pkv_engine *e = s->e;
    pkvi_btable *t = &s->layers[r->layer];
    const pkv_layer_config *lc = &e->layers[r->layer];
    for (uint64_t i = r->first_page; i < r->end_page; i++)
        atomic_store_explicit(&t->pages[i]->writing, 0, memory_order_relaxed);
    /* a windowed layer gives back what nothing reads again: at most once a page */
    const uint64_t sinks = pkvi_sink_pages(e, lc);
    const uint64_t keep = lc->window ? pkvi_window_keep_from(lc, t->len, e->cfg.block_tokens) : 0;
    const bool trim = keep > (t->hole_hi > sinks ? t->hole_hi : sinks);
    if (r->pinned || trim) {
        pthread_mutex_lock(&e->lock);
        if (trim) {
            pkvi_btable_release(t, pkvi_engine_pages(e), sinks, keep);
            pkvi_prefix_trim(&e->prefix, pkvi_engine_pages(e));
        }
        if (r->pinned)
            t->pins--;
        pthread_mutex_unlock(&e->lock);
    }
}

/* ---- the calls made of it ------------------------------------------------------------- */

pkv_status pkv_append(pkv_session *s, uint32_t layer, const float *k, const float *v)
{
    if (!s)
        return PKV_EINVAL;
    if (layer >= s->e->cfg.n_layers)
        return pkvi_fail(s->e, PKV_EINVAL, "pkv_append: layer %u, but the engine has %u",
                         layer, s->e->cfg.n_layers);
    if (!k || !v)
        return pkvi_fail(s->e, PKV_EINVAL, "pkv_append: k or v is NULL");
    PKVI_BOUNDARY_CHECK(s->e);
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
    pkv_engine *e = s->e;
    if (tokens == 0 || tokens > e->cfg.block_tokens ||
        s->layers[layer].len % e->cfg.block_tokens)
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
    pkv_engine *e = s->e;
    pkvi_btable *t = &s->layers[layer];
    const uint64_t bt = e->cfg.block_tokens;
    /* the hole grows from the sink pages, or a shard's own hole [0, first / bt) */
    const uint64_t from = t->first ? t->first / bt : pkvi_sink_pages(e, &e->layers[layer]);
    if (!e->layers[layer].window || t->n_pages != from || t->len != from * bt ||
        page <= from || (t->first ? t->hole_hi != from : t->hole_hi != t->hole_lo))
        return PKV_EINVAL;
    pthread_mutex_lock(&e->lock);
    pkv_status st = pkvi_btable_reserve(t, page);
    if (st == PKV_OK) {
        for (uint64_t i = from; i < page; i++) {
            t->pages[i] = NULL;
            t->data[i] = NULL;
        }
        if (!t->first)
            t->hole_lo = from;
        t->hole_hi = t->n_pages = page;
        t->len = page * bt;
    }
    pthread_mutex_unlock(&e->lock);
    return st;
}

/*
 * session.c - sessions: create, fork, truncate, destroy; the LRU order and the
 * choice of spill victims; residency (pin a layer, bring its pages back); the
 * reservation every write goes through (append, prefill, load); memory accounting;
 * the engine-wide invariants.
 *
 * Owns struct pkv_session and the engine's session list (e->lock). Calls down into
 * btable.c (tables and references), pool.c (pages), spill.c (moving bytes); nothing
 * here calls decode.c, persist_*.c or engine.c.
 *
 * Spill victims: resident pages of the least recently used sessions first, whole
 * sessions at a time (a session is idle as a whole, and decode needs all of a layer's
 * pages back together, so spilling one session completely beats nibbling at many),
 * never a page of a pinned table. A page shared by forks is one descriptor: written
 * once, and only when no table holding it is pinned; every holder's entry is synced
 * (B2, B3). A holder is found where B4 says it can only be: the same (layer, index).
 */
#include "session.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Spill at least this many pages per make_room: one batched write instead of many
 * single-page round trips when sessions grow page by page under a full budget. */
#define SPILL_BATCH 16u

static pkv_status copy_record(pkv_session *s, const pkv_session *src);
static void truncate_record(pkv_session *s, uint64_t n);

/* ---- holders of a page (B4) ------------------------------------------------------ */

/* Whether a table holding pg (at layer, index i) is pinned. */
static bool holder_pinned(const pkv_engine *e, uint32_t layer, uint64_t i,
                          const pkvi_page *pg)
{
    for (const pkv_session *s = e->sessions; s; s = s->next) {
        const pkvi_btable *t = &s->layers[layer];
        if (t->pins && i < t->n_pages && t->pages[i] == pg)
            return true;
    }
    return false;
}

/* pg (at layer, index i; one holder is t) moved: sync every table that holds it. */
static void sync_holders(pkv_engine *e, pkvi_btable *t, uint32_t layer, uint64_t i,
                         const pkvi_page *pg)
{
    if (pg->refs == 1) {
        pkvi_btable_sync(t, i);
        return;
    }
    for (pkv_session *s = e->sessions; s; s = s->next) {
        pkvi_btable *h = &s->layers[layer];
        if (i < h->n_pages && h->pages[i] == pg)
            pkvi_btable_sync(h, i);
    }
}

/* ---- making room under the budget --------------------------------------------------- */

typedef struct {
    pkvi_page *pg;
    pkvi_btable *t;          /* a table holding it */
    uint32_t layer;
    uint64_t index;
} located;

static int by_lru(const void *a, const void *b)
{
    const pkv_session *x = *(pkv_session *const *)a, *y = *(pkv_session *const *)b;
    return x->lru < y->lru ? -1 : x->lru > y->lru;
}

/* Resident cached pages (only the prefix index holds them), least recently used
 * nodes first: the first spill victims, before any live session's page (SPEC §10).
 * Marks them in tally like make_room does. */
static uint64_t cached_victims(pkv_engine *e, located *vic, pkvi_page **pages,
                               uint64_t want)
{
    uint64_t nv = 0;
    if (!e->prefix.cached.resident)
        return 0;
    for (pkvi_pnode *n = e->prefix.oldest; n && nv < want; n = n->newer)
        for (uint32_t l = 0; l < e->cfg.n_layers && nv < want; l++) {
            pkvi_page *pg = n->pages[l];
            if (!pg || pg->refs != 1 || !pg->data || pg->tally)
                continue;
            pg->tally = 1;
            vic[nv] = (located){pg, NULL, l, n->depth};
            pages[nv++] = pg;
        }
    return nv;
}

/*
 * Room for n more resident pages: spill pages of unpinned tables, least recently used
 * sessions first (at least SPILL_BATCH pages when anything must go). PKV_OK when the
 * budget already has room; PKV_ENOMEM when not enough can be spilled (the rest is
 * pinned by calls in flight) or there is no spill file; PKV_EIO when the write failed
 * (every page stays resident). Under e->lock.
 */
static pkv_status make_room(pkv_engine *e, uint64_t n)
{
    pkvi_pool *p = &e->pool;
    if (!p->budget_pages || p->in_use + n <= p->budget_pages)
        return PKV_OK;
    if (n > p->budget_pages)
        return PKV_ENOMEM;
    const uint64_t need = p->in_use + n - p->budget_pages;
    if (!e->spill) { /* cached pages (SPEC §10) are dropped before anything fails */
        pkvi_prefix_drop(&e->prefix, pkvi_engine_pages(e), need);
        return p->in_use + n <= p->budget_pages ? PKV_OK : PKV_ENOMEM;
    }
    const uint64_t want = need < SPILL_BATCH ? SPILL_BATCH : need;

    pkv_session **order = malloc((size_t)(e->n_sessions ? e->n_sessions : 1) * sizeof *order);
    located *vic = malloc((size_t)want * sizeof *vic);
    pkvi_page **pages = malloc((size_t)want * sizeof *pages);
    if (!order || !vic || !pages) {
        free(order);
        free(vic);
        free(pages);
        return PKV_ENOMEM;
    }
    uint64_t ns = 0;
    for (pkv_session *s = e->sessions; s; s = s->next)
        order[ns++] = s;
    qsort(order, (size_t)ns, sizeof *order, by_lru);

    /* `tally` marks a descriptor already chosen (a shared page is met once per holder) */
    uint64_t nv = cached_victims(e, vic, pages, want);
    /* cached pages alone suffice: no live page is spilled just to fill the batch */
    const bool cached_enough = nv >= need;
    for (uint64_t k = 0; !cached_enough && k < ns && nv < want; k++)
        for (uint32_t l = 0; l < e->cfg.n_layers && nv < want; l++) {
            pkvi_btable *t = &order[k]->layers[l];
            if (t->pins || t->n_spilled == t->n_pages)
                continue;
            for (uint64_t i = 0; i < t->n_pages && nv < want; i++) {
                pkvi_page *pg = t->pages[i];
                if (!pg || !pg->data || pg->tally ||
                    (pg->refs > 1 && holder_pinned(e, l, i, pg)))
                    continue;
                pg->tally = 1;
                vic[nv] = (located){pg, t, l, i};
                pages[nv++] = pg;
            }
        }
    pkv_status st = nv < need ? PKV_ENOMEM : pkvi_spill_write(e->spill, p, pages, nv, need);
    for (uint64_t v = 0; v < nv; v++) {
        vic[v].pg->tally = 0;
        if (st == PKV_OK && !vic[v].pg->data) { /* written (a retry may write fewer) */
            if (vic[v].t)
                sync_holders(e, vic[v].t, vic[v].layer, vic[v].index, vic[v].pg);
            else /* a cached page: no table names it */
                e->prefix.cached.resident--;
        }
    }
    free(order);
    free(vic);
    free(pages);
    return st;
}

/* Bring the spilled pages of table t (layer) from entry `from` on back into memory;
 * the caller pinned t, so making room never spills them again. Under e->lock. */
static pkv_status fault_in(pkv_engine *e, pkvi_btable *t, uint32_t layer, uint64_t from)
{
    uint64_t n = 0;
    for (uint64_t i = from; i < t->n_pages; i++)
        n += t->pages[i] && t->data[i] == NULL;
    if (n == 0)
        return PKV_OK;
    pkv_status st = make_room(e, n);
    if (st != PKV_OK)
        return st;
    uint64_t *idx = malloc((size_t)n * sizeof *idx);
    pkvi_page **pages = malloc((size_t)n * sizeof *pages);
    if (!idx || !pages) {
        free(idx);
        free(pages);
        return PKV_ENOMEM;
    }
    uint64_t k = 0;
    for (uint64_t i = from; i < t->n_pages; i++)
        if (t->pages[i] && t->data[i] == NULL) {
            idx[k] = i;
            pages[k++] = t->pages[i];
        }
    st = pkvi_spill_read(e->spill, &e->pool, pages, n);
    if (st == PKV_OK)
        for (k = 0; k < n; k++)
            sync_holders(e, t, layer, idx[k], pages[k]);
    free(idx);
    free(pages);
    return st;
}

/* n new pages, all or nothing, spilling to make room. Under e->lock. */
static pkv_status take_pages(pkv_engine *e, uint64_t n, pkvi_page **out)
{
    pkv_status st = make_room(e, n);
    uint64_t got = 0;
    while (st == PKV_OK && got < n)
        if ((st = pkvi_page_create(&e->pool, &out[got])) == PKV_OK)
            got++;
    if (st != PKV_OK) {
        while (got-- > 0) {
            out[got]->refs = 0;
            pkvi_page_destroy(&e->pool, out[got]);
        }
        return st;
    }
#if !PKV_POISON
    /* A spilled page is written whole, unused rows included: start them defined, so
     * no stale bytes of an earlier page (another user's K/V) ever reach the disk. */
    if (e->spill)
        for (uint64_t i = 0; i < n; i++)
            memset(out[i]->data, 0, (size_t)e->page_bytes);
#endif
    return PKV_OK;
}

/* ---- decode scratch ------------------------------------------------------------------ */

/* Split-K partial states for layers of up to n_pages pages (decode.c's layout; the
 * sink pages of a windowed layer add chunks of their own). */
static pkv_status reserve_partials(pkv_session *s, uint64_t n_pages)
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

/* ---- residency ------------------------------------------------------------------------ */

pkv_status pkvi_session_acquire(pkv_session *s, uint32_t layer)
{
    pkv_engine *e = s->e;
    if (!e->spill)
        return PKV_OK;
    pkvi_btable *t = &s->layers[layer];
    pthread_mutex_lock(&e->lock);
    t->pins++; /* first: making room must not spill what is being brought back */
    const pkv_status st = t->n_spilled ? fault_in(e, t, layer, 0) : PKV_OK;
    if (st != PKV_OK)
        t->pins--;
    else
        s->lru = ++e->clock;
    pthread_mutex_unlock(&e->lock);
    if (st != PKV_OK)
        return pkvi_fail(e, st, "layer %u: its spilled pages could not be brought back (%s)",
                         layer, st == PKV_EIO ? "a read failed" : "the budget has no room");
    return st;
}

void pkvi_session_release(pkv_session *s, uint32_t layer)
{
    pkv_engine *e = s->e;
    if (!e->spill)
        return;
    pthread_mutex_lock(&e->lock);
    s->layers[layer].pins--;
    pthread_mutex_unlock(&e->lock);
}

/* ---- reserve, write, finish ------------------------------------------------------------ */

pkv_status pkvi_session_reserve(pkv_session *s, uint32_t layer, uint64_t n,
                                pkvi_reservation *r)
{
    pkv_engine *e = s->e;
    pkvi_btable *t = &s->layers[layer];
    const uint64_t bt = e->cfg.block_tokens, start = t->len;
    uint64_t end_len;
    if (n == 0 || !pkvi_add(start, n, &end_len) || end_len > UINT64_MAX - bt)
        return PKV_EINVAL;
    const uint64_t end_page = (end_len + bt - 1) / bt;
    const uint64_t n_new = end_page - t->n_pages;
    const bool partial = start % bt != 0;

    /* The page list: on the stack for an append (at most 2 pages), else allocated. */
    pkvi_page *small[2], **fresh = small;
    if (n_new + 1 > 2) {
        uint64_t bytes;
        if (!pkvi_mul(n_new + 1, sizeof *fresh, &bytes) || bytes > SIZE_MAX ||
            !(fresh = malloc((size_t)bytes)))
            return PKV_ENOMEM;
    }
    pthread_mutex_lock(&e->lock);
    if (e->spill)
        t->pins++;
    pkv_status st = partial ? fault_in(e, t, layer, t->n_pages - 1) : PKV_OK;
    const bool cow = partial && st == PKV_OK && t->pages[t->n_pages - 1]->refs > 1;
    if (st == PKV_OK)
        st = take_pages(e, n_new + cow, fresh);
    if (st == PKV_OK) {
        st = pkvi_btable_reserve(t, end_page);
        if (st == PKV_OK)
            st = reserve_partials(s, end_page);
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
            return pkvi_fail(e, st, "layer %u: a spilled page could not be read back", layer);
        if (budget)
            return pkvi_fail(e, st, "layer %u: %llu more page(s) do not fit the budget of %llu "
                             "pages%s", layer, (unsigned long long)(n_new + cow),
                             (unsigned long long)budget,
                             e->spill ? " (nothing more could be spilled)" : " (no spill_dir)");
        return pkvi_fail(e, st, "layer %u: out of memory", layer);
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

/* ---- sessions --------------------------------------------------------------------------- */

static pkv_session *session_alloc(pkv_engine *e)
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

static void session_free(pkv_session *s)
{
    for (uint32_t l = 0; l < s->e->cfg.n_layers; l++)
        pkvi_btable_free(&s->layers[l]);
    free(s->layers);
    free(s->partials);
    free(s->tokens);
    free(s);
}

/* Under e->lock. */
static void session_link(pkv_engine *e, pkv_session *s)
{
    s->prev = NULL;
    s->next = e->sessions;
    if (e->sessions)
        e->sessions->prev = s;
    e->sessions = s;
    e->n_sessions++;
    s->lru = ++e->clock;
}

pkv_status pkv_session_create(pkv_engine *e, pkv_session **out)
{
    if (!out || !e)
        return PKV_EINVAL;
    pkv_session *s = session_alloc(e);
    if (!s)
        return PKV_ENOMEM;
    pthread_mutex_lock(&e->lock);
    session_link(e, s);
    pthread_mutex_unlock(&e->lock);
    *out = s;
    return PKV_OK;
}

pkv_status pkv_session_fork(pkv_session *src, pkv_session **out)
{
    if (!out || !src)
        return PKV_EINVAL;
    pkv_engine *e = src->e;
    PKVI_BOUNDARY_CHECK(e);
    pkv_session *s = session_alloc(e);
    if (!s)
        return PKV_ENOMEM;
    /* Allocate everything first, so the shared part below cannot fail. */
    uint64_t max_pages = 0;
    for (uint32_t l = 0; l < e->cfg.n_layers; l++) {
        const uint64_t n = src->layers[l].n_pages;
        max_pages = n > max_pages ? n : max_pages;
        if (pkvi_btable_reserve(&s->layers[l], n) != PKV_OK) {
            session_free(s);
            return PKV_ENOMEM;
        }
    }
    if (reserve_partials(s, max_pages) != PKV_OK || copy_record(s, src) != PKV_OK) {
        session_free(s);
        return PKV_ENOMEM;
    }
    /* B5: src's pages gain holders here; the only thread that may write one of them
     * (src's owner, for a tail page with refs == 1) is the one making this call. */
    pthread_mutex_lock(&e->lock);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        pkvi_btable_share(&s->layers[l], &src->layers[l]);
    session_link(e, s);
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
    session_free(s);
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
    const pkv_status st = pkvi_session_reserve(s, layer, 1, &r);
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
    const pkv_status st = pkvi_session_reserve(s, layer, tokens, &r);
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
    const uint64_t sinks = pkvi_sink_pages(e, &e->layers[layer]);
    if (!e->layers[layer].window || t->n_pages != sinks || t->len != sinks * bt ||
        page <= sinks || t->hole_hi != t->hole_lo)
        return PKV_EINVAL;
    pthread_mutex_lock(&e->lock);
    pkv_status st = pkvi_btable_reserve(t, page);
    if (st == PKV_OK) {
        for (uint64_t i = sinks; i < page; i++) {
            t->pages[i] = NULL;
            t->data[i] = NULL;
        }
        t->hole_lo = sinks;
        t->hole_hi = t->n_pages = page;
        t->len = page * bt;
    }
    pthread_mutex_unlock(&e->lock);
    return st;
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
    if (first % align || first > UINT64_MAX / 2)
        return pkvi_fail(e, PKV_EINVAL, "pkv_session_set_first: %llu is not a multiple of "
                         "pkv_shard_align (%llu), or too far", (unsigned long long)first,
                         (unsigned long long)align);
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
        st = reserve_partials(s, first / bt + 1);
    if (st == PKV_OK)
        for (uint32_t l = 0; l < e->cfg.n_layers; l++)
            (void)pkvi_btable_set_first(&s->layers[l], bt, first);
    pthread_mutex_unlock(&e->lock);
    if (st != PKV_OK)
        return pkvi_fail(e, st, "pkv_session_set_first: out of memory");
    return PKV_OK;
}

/* ---- accounting --------------------------------------------------------------------------- */

pkv_status pkv_session_memory(const pkv_session *s, pkv_memory *out)
{
    if (!s || !out)
        return PKV_EINVAL;
    pkv_engine *e = s->e;
    pkv_memory m;
    memset(&m, 0, sizeof m);
    const uint64_t pb = e->page_bytes;
    const uint64_t token_bytes = (uint64_t)e->cfg.n_kv_heads * (e->row_bytes + e->row_bytes_v);
    m.bytes_overhead = sizeof *s + (uint64_t)e->cfg.n_layers * sizeof(pkvi_btable) +
                       s->partials_chunks * e->cfg.n_heads *
                           ((uint64_t)e->cfg.head_dim_v + 2) * sizeof(float);
    pthread_mutex_lock(&e->lock);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++) {
        const pkvi_btable *t = &s->layers[l];
        const pkv_layer_config *lc = &e->layers[l];
        m.tokens += t->len;
        m.blocks += pkvi_btable_held(t);
        /* a windowed layer needs only what a decode (or one after a rollback) reads */
        m.bytes_ideal += pkvi_window_needed(lc, t->len) * token_bytes;
        m.bytes_overhead += pkvi_btable_overhead(t);
        m.bytes_spilled += t->n_spilled * pb;
        for (uint64_t i = 0; i < t->n_pages; i++)
            if (t->pages[i] && t->pages[i]->data &&
                t->pages[i]->refs - t->pages[i]->indexed > 1) /* the index is no session */
                m.bytes_shared += pb;
    }
    m.bytes_resident = m.blocks * pb - m.bytes_spilled;
    pthread_mutex_unlock(&e->lock);
    *out = m;
    return PKV_OK;
}

pkv_status pkv_session_pages(const pkv_session *s, uint32_t layer, uint64_t first,
                             uint64_t n, pkv_page_info *out, uint64_t *n_out)
{
    if (!s || layer >= s->e->cfg.n_layers || (!out && n > 0))
        return PKV_EINVAL;
    pkv_engine *e = s->e;
    const pkvi_btable *t = &s->layers[layer];
    uint64_t k = 0;
    pthread_mutex_lock(&e->lock);
    for (uint64_t i = first; i < t->n_pages && k < n; i++, k++) {
        const pkvi_page *pg = t->pages[i]; /* NULL: released by a window */
        out[k].id = (uint64_t)(uintptr_t)pg;
        out[k].refs = pg ? pg->refs - pg->indexed : 0; /* table entries: not the index's */
        out[k].resident = pg && pg->data != NULL;
    }
    pthread_mutex_unlock(&e->lock);
    if (n_out)
        *n_out = k;
    return PKV_OK;
}

/* ---- invariants --------------------------------------------------------------------------- */

/* Visit every block-table entry of every live session. */
#define FOR_EACH_ENTRY(e, pg, body)                                                     \
    for (pkv_session *s_ = (e)->sessions; s_; s_ = s_->next)                            \
        for (uint32_t l_ = 0; l_ < (e)->cfg.n_layers; l_++)                              \
            for (uint64_t i_ = 0; i_ < s_->layers[l_].n_pages; i_++) {                  \
                pkvi_page *pg = s_->layers[l_].pages[i_];                                \
                if (pg) {                                                                \
                    body                                                                 \
                }                                                                        \
            }

/* Visit every page the prefix index names. */
#define FOR_EACH_NODE_PAGE(e, pg, body)                                                 \
    for (pkvi_pnode *n_ = (e)->prefix.oldest; n_; n_ = n_->newer)                       \
        for (uint32_t l_ = 0; l_ < (e)->cfg.n_layers; l_++) {                            \
            pkvi_page *pg = n_->pages[l_];                                               \
            if (pg) {                                                                    \
                body                                                                     \
            }                                                                            \
        }

bool pkvi_sessions_check(pkv_engine *e, bool quiescent)
{
    bool ok = true;
    pthread_mutex_lock(&e->lock);
    const pkvi_pool *p = &e->pool;
    if (p->allocated != p->in_use + p->n_free || p->n_free > p->free_slots ||
        p->free_slots > p->free_cap)
        ok = false;
    if (p->budget_pages && p->in_use + p->n_free > p->budget_pages)   /* E4 */
        ok = false;
    for (pkv_session *s = e->sessions; ok && s; s = s->next)
        for (uint32_t l = 0; ok && l < e->cfg.n_layers; l++)
            ok = pkvi_btable_check(&s->layers[l], e->cfg.block_tokens, quiescent);
    if (ok) {
        /* E1-E3: tally entries per descriptor (the prefix index's references too),
         * then visit each descriptor once. */
        FOR_EACH_ENTRY(e, pg, { pg->tally = 0; })
        FOR_EACH_NODE_PAGE(e, pg, { pg->tally = 0; })
        FOR_EACH_ENTRY(e, pg, { pg->tally++; })
        uint64_t node_pages = 0, indexed = 0;
        ok = pkvi_prefix_check(&e->prefix, quiescent, &node_pages); /* tally++ each */
        uint64_t resident = 0, spilled = 0;
#define VISIT_ONCE(pg)                                                                      if (pg->tally != 0) {                                                                       ok &= pg->tally == pg->refs;                                                            resident += pg->data != NULL;                                                           spilled += pg->data == NULL;                                                            indexed += pg->indexed;                                                                 pg->tally = 0;                                                                      }
        FOR_EACH_ENTRY(e, pg, { VISIT_ONCE(pg) })
        FOR_EACH_NODE_PAGE(e, pg, { VISIT_ONCE(pg) })
#undef VISIT_ONCE
        /* Pages a reservation took but has not yet pushed do not exist between the
         * lock's holds, so these are exact. An indexed page is in exactly one node
         * (P3): the distinct indexed pages are the node pages. */
        ok &= resident == p->in_use && spilled == p->spilled && indexed == node_pages;
    }
    pthread_mutex_unlock(&e->lock);
    return ok;
}

#if PKV_POISON
pkv_status pkvi_report_broken(const char *where)
{
    fprintf(stderr, "pagedkv: engine invariants broken (detected in %s)\n", where);
    return PKV_ECORRUPT;
}
#endif

pkv_status pkv_engine_check(pkv_engine *e)
{
    if (!e)
        return PKV_EINVAL;
    return pkvi_sessions_check(e, true) ? PKV_OK : PKV_ECORRUPT;
}

bool pkvi_engine_check(pkv_engine *e)
{
    return pkvi_sessions_check(e, true);
}

bool pkvi_engine_check_live(pkv_engine *e)
{
    return pkvi_sessions_check(e, false);
}

/* ---- the prefix cache (SPEC §10): token records, set_tokens, from_prefix ------------------ */

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

/* Index the record's first `full` page indices (ids in s->tokens): the nodes that
 * exist are reused (a window-released entry filled in when s still holds that page),
 * the missing ones are created from s's pages. All nodes are allocated before the
 * index changes: PKV_ENOMEM changes nothing. chain: [full]. Under e->lock. */
static pkv_status index_record(pkv_engine *e, pkv_session *s, uint64_t full,
                               pkvi_pnode **chain)
{
    pkvi_prefix *p = &e->prefix;
    const uint64_t bt = e->cfg.block_tokens;
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
        for (uint32_t l = 0; l < e->cfg.n_layers; l++) {
            pkvi_page *pg = s->layers[l].pages[i];
            if (!chain[i]->pages[l] && pg && !pg->indexed)
                pkvi_prefix_fill(chain[i], l, pg);
        }
    }
    pkvi_prefix_touch(p, chain, full);
    return PKV_OK;
}

pkv_status pkvi_session_set_tokens(pkv_session *s, uint64_t n, const int32_t *tokens)
{
    pkv_engine *e = s->e;
    const uint64_t bt = e->cfg.block_tokens;
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        if (n > s->layers[l].len)
            return pkvi_fail(e, PKV_ERANGE, "pkv_session_set_tokens: %llu ids, but layer %u "
                             "holds %llu positions", (unsigned long long)n, l,
                             (unsigned long long)s->layers[l].len);
    const uint64_t old = s->n_tokens, same = n < old ? n : old;
    if (same && memcmp(tokens, s->tokens, (size_t)same * sizeof *tokens) != 0)
        return pkvi_fail(e, PKV_EINVAL, "pkv_session_set_tokens: the ids differ from the "
                         "ones recorded (truncate first to change them)");
    if (n <= old)
        return PKV_OK;
    if (n > s->tokens_cap) {
        uint64_t cap = s->tokens_cap ? s->tokens_cap * 2 : 64;
        if (cap < n)
            cap = n;
        int32_t *t = cap > SIZE_MAX / sizeof *t ? NULL
                                                : realloc(s->tokens, (size_t)cap * sizeof *t);
        if (!t)
            return pkvi_fail(e, PKV_ENOMEM, "pkv_session_set_tokens: out of memory");
        s->tokens = t;
        s->tokens_cap = cap;
    }
    memcpy(s->tokens + old, tokens + old, (size_t)(n - old) * sizeof *tokens);
    const uint64_t full = n / bt;
    if (full > s->indexed_pages) {
        pkvi_pnode **chain = malloc((size_t)full * sizeof *chain);
        pkv_status st = chain ? PKV_OK : PKV_ENOMEM;
        if (st == PKV_OK) {
            pthread_mutex_lock(&e->lock);
            st = index_record(e, s, full, chain);
            pthread_mutex_unlock(&e->lock);
        }
        free(chain);
        if (st != PKV_OK)
            return pkvi_fail(e, st, "pkv_session_set_tokens: out of memory");
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
        return pkvi_fail(s->e, PKV_EINVAL, "pkv_session_set_tokens: tokens is NULL");
    PKVI_BOUNDARY_CHECK(s->e);
    return pkvi_session_set_tokens(s, n, tokens);
}

/* Whether layer l of a session of m pages needs page i: every page of a full layer; a
 * windowed one its sink pages and those from pkvi_window_keep_from on (the rest is
 * its hole, as in a session that appended the same rows). */
static bool page_needed(const pkv_engine *e, uint32_t l, uint64_t i, uint64_t m)
{
    const pkv_layer_config *lc = &e->layers[l];
    if (!lc->window)
        return true;
    const uint64_t bt = e->cfg.block_tokens;
    return i < pkvi_sink_pages(e, lc) || i >= pkvi_window_keep_from(lc, m * bt, bt);
}

/* The longest m <= m_max such that chain[0..m) holds every page a session of m
 * pages needs. */
static uint64_t usable_pages(const pkv_engine *e, pkvi_pnode *const *chain, uint64_t m_max)
{
    for (uint32_t l = 0; l < e->cfg.n_layers; l++) /* a full layer needs every page */
        for (uint64_t i = 0; !e->layers[l].window && i < m_max; i++)
            if (!chain[i]->pages[l])
                m_max = i;
    for (uint64_t m = m_max; m > 0; m--) {
        bool ok = true;
        for (uint32_t l = 0; ok && l < e->cfg.n_layers; l++)
            for (uint64_t i = 0; ok && i < m; i++)
                ok = chain[i]->pages[l] || !page_needed(e, l, i, m);
        if (ok)
            return m;
    }
    return 0;
}

pkv_status pkv_session_from_prefix(pkv_engine *e, uint64_t n, const int32_t *tokens,
                                   pkv_session **out, uint64_t *n_cached)
{
    if (!e || !out || !n_cached)
        return PKV_EINVAL;
    if (n && !tokens)
        return pkvi_fail(e, PKV_EINVAL, "pkv_session_from_prefix: tokens is NULL");
    PKVI_BOUNDARY_CHECK(e);
    const uint64_t bt = e->cfg.block_tokens, L = e->cfg.n_layers;
    const uint64_t max_pages = n ? (n - 1) / bt : 0;   /* at most n - 1 positions */
    pkv_session *s = session_alloc(e);
    if (!s)
        return pkvi_fail(e, PKV_ENOMEM, "pkv_session_from_prefix: out of memory");
    pkvi_pnode **chain = NULL;
    uint64_t chain_cap = 0, m = 0;
    pkv_status st = PKV_OK;
    pthread_mutex_lock(&e->lock);
    /* the longest match: each step compares the parent and bt stored ids */
    pkvi_pnode *parent = NULL;
    for (uint64_t i = 0; i < max_pages && st == PKV_OK; i++) {
        pkvi_pnode *nd = pkvi_prefix_find(&e->prefix, parent, tokens + i * bt);
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
        m = usable_pages(e, chain, m);
    /* everything the shared part needs, before anything changes */
    for (uint32_t l = 0; st == PKV_OK && l < L; l++)
        st = pkvi_btable_reserve(&s->layers[l], m);
    if (st == PKV_OK)
        st = reserve_partials(s, m);
    if (st == PKV_OK && m) {
        s->tokens = malloc((size_t)(m * bt) * sizeof *s->tokens);
        st = s->tokens ? PKV_OK : PKV_ENOMEM;
    }
    if (st != PKV_OK) {
        pthread_mutex_unlock(&e->lock);
        free(chain);
        session_free(s);
        return pkvi_fail(e, st, "pkv_session_from_prefix: out of memory");
    }
    /* B5: only full, indexed pages gain a holder; none of them can be written (a
     * table holding one shares it with the index, so its owner copies it first) */
    const pkvi_pages ps = pkvi_engine_pages(e);
    for (uint32_t l = 0; l < L; l++) {
        pkvi_btable *t = &s->layers[l];
        for (uint64_t i = 0; i < m; i++)
            pkvi_btable_push_shared(t, ps, page_needed(e, l, i, m) ? chain[i]->pages[l] : NULL);
        t->len = m * bt;
    }
    pkvi_prefix_touch(&e->prefix, chain, m);
    e->prefix.lookups++;
    e->prefix.hit_tokens += m * bt;
    session_link(e, s);
    pthread_mutex_unlock(&e->lock);
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

/*
 * session.c - sessions and their block tables: create, fork (shared pages,
 * copy-on-write), append, truncate, destroy, memory accounting, prefill.
 *
 * Owns page descriptors (pkvi_page) and their reference counts; page buffers come
 * from pool.c, spilled bytes are handled by spill.c, attention by decode.c.
 *
 * Block table of one layer (bt = block_tokens):
 *
 *     pages[0]      pages[1]            pages[n_pages-1]
 *   +-----------+ +-----------+       +-----------+
 *   | 0 .. bt-1 | | bt..2bt-1 |  ...  | .. len-1  |░░░|   last page partly filled
 *   +-----------+ +-----------+       +-----------+
 *   n_pages = ceil(len / bt); position p lives in pages[p / bt], row p % bt.
 *
 * Copy-on-write rule: a page with refs > 1 is never written. Appending into a shared,
 * partly filled tail page first copies it (the only copy a fork ever causes); full
 * shared pages are never written, so they are never copied. Truncate can make a shared
 * full page partly filled again; the rule covers that case unchanged.
 *
 * Locking: structural changes (tables, refs, pool) under e->lock; with a spill file
 * the whole append runs under it, so the spiller never sees a half-written page.
 */
#include "internal.h"
#include "pkv_config.h"

#include <stdlib.h>
#include <string.h>

/* ---- page descriptors (under e->lock) ---------------------------------------------- */

/* A fresh page with refs = 1, spilling others to make room when a spill file exists. */
static pkv_status page_new(pkv_engine *e, pkvi_page **out)
{
    pkvi_page *pg = calloc(1, sizeof *pg);
    if (!pg)
        return PKV_ENOMEM;
    pkv_status st = PKV_OK;
    if (e->spill && !pkvi_pool_can_get(&e->pool))
        st = pkvi_spill_make_room(e, 1);
    if (st == PKV_OK)
        st = pkvi_pool_get(&e->pool, &pg->data);
    if (st != PKV_OK) {
        free(pg);
        return st;
    }
#if !PKV_POISON
    /* A spilled page is written whole, unused rows included: start them defined, so
     * no stale bytes of an earlier page (another user's K/V) ever reach the disk. */
    if (e->spill)
        memset(pg->data, 0, (size_t)e->page_bytes);
#endif
    pg->refs = 1;
    *out = pg;
    return PKV_OK;
}

static void page_unref(pkv_engine *e, pkvi_page *pg)
{
    if (--pg->refs > 0)
        return;
    if (pg->data)
        pkvi_pool_put(&e->pool, pg->data);
    else
        pkvi_spill_drop(e, pg);
    free(pg);
}

/* ---- block tables ------------------------------------------------------------------- */

/* Capacity for n pages; on failure the table is unchanged (a grown array is kept). */
static pkv_status layer_reserve(pkvi_layer *L, uint64_t n)
{
    if (n <= L->cap)
        return PKV_OK;
    uint64_t cap = L->cap ? L->cap * 2 : 4;
    if (cap < n)
        cap = n;
    uint64_t bytes;
    if (!pkvi_mul(cap, sizeof(void *), &bytes) || bytes > SIZE_MAX)
        return PKV_ENOMEM;
    pkvi_page **pages = realloc(L->pages, (size_t)bytes);
    if (!pages)
        return PKV_ENOMEM;
    L->pages = pages;
    const void **data = realloc(L->data, (size_t)bytes);
    if (!data)
        return PKV_ENOMEM;
    L->data = data;
    L->cap = cap;
    return PKV_OK;
}

/* Drop positions >= n of one layer, releasing whole pages. Under e->lock. */
static void layer_truncate(pkv_engine *e, pkvi_layer *L, uint64_t n)
{
    if (n >= L->len)
        return;
    const uint64_t bt = e->cfg.block_tokens;
    const uint64_t keep = (n + bt - 1) / bt;
    for (uint64_t i = keep; i < L->n_pages; i++)
        page_unref(e, L->pages[i]);
    L->n_pages = keep;
    L->len = n;
}

/* Split-K partial states: per chunk, per group, hg * (d + 2) floats (decode.c). */
pkv_status pkvi_session_reserve_partials(pkv_session *s, uint64_t n_pages)
{
    pkv_engine *e = s->e;
    const uint64_t chunks = pkvi_split_chunks(e, n_pages);
    if (chunks <= s->partials_chunks)
        return PKV_OK;
    uint64_t want = s->partials_chunks ? s->partials_chunks * 2 : 1;
    if (want < chunks)
        want = chunks;
    if (want > PKVI_MAX_CHUNKS)
        want = PKVI_MAX_CHUNKS;
    uint64_t floats, bytes;
    if (!pkvi_mul(want, e->cfg.n_heads, &floats) ||
        !pkvi_mul(floats, (uint64_t)e->cfg.head_dim + 2, &floats) ||
        !pkvi_mul(floats, sizeof(float), &bytes) || bytes > SIZE_MAX)
        return PKV_ENOMEM;
    float *p = aligned_alloc(PKVI_PAGE_ALIGN, (size_t)((bytes + 63) & ~63ull));
    if (!p)
        return PKV_ENOMEM;
    free(s->partials);
    s->partials = p;
    s->partials_chunks = want;
    return PKV_OK;
}

/* ---- sessions ----------------------------------------------------------------------- */

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
    for (uint32_t l = 0; l < s->e->cfg.n_layers; l++) {
        free(s->layers[l].pages);
        free(s->layers[l].data);
    }
    free(s->layers);
    free(s->partials);
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
        uint64_t n = src->layers[l].n_pages;
        if (n > max_pages)
            max_pages = n;
        if (layer_reserve(&s->layers[l], n) != PKV_OK) {
            session_free(s);
            return PKV_ENOMEM;
        }
    }
    if (pkvi_session_reserve_partials(s, max_pages) != PKV_OK) {
        session_free(s);
        return PKV_ENOMEM;
    }
    pthread_mutex_lock(&e->lock);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++) {
        const pkvi_layer *S = &src->layers[l];
        pkvi_layer *D = &s->layers[l];
        for (uint64_t i = 0; i < S->n_pages; i++) {
            D->pages[i] = S->pages[i];
            D->data[i] = S->data[i];
            S->pages[i]->refs++;
        }
        D->n_pages = S->n_pages;
        D->len = S->len;
    }
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
        layer_truncate(e, &s->layers[l], 0);
    if (s->prev)
        s->prev->next = s->next;
    else
        e->sessions = s->next;
    if (s->next)
        s->next->prev = s->prev;
    e->n_sessions--;
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
        return PKV_ERANGE;
    pthread_mutex_lock(&e->lock);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++)
        layer_truncate(e, &s->layers[l], n_tokens);
    pthread_mutex_unlock(&e->lock);
    return PKV_OK;
}

/* ---- append ------------------------------------------------------------------------- */

/* Make the page that will hold position L->len writable and resident; returns it.
 * Under e->lock. On failure nothing changed: a new page is taken before the tables
 * grow, so a budget that has no page left fails with every figure as it was (only an
 * allocator failure between the two can leave a table's capacity grown). */
static pkv_status writable_tail(pkv_session *s, pkvi_layer *L, pkvi_page **out)
{
    pkv_engine *e = s->e;
    const uint64_t bt = e->cfg.block_tokens;
    pkv_status st;

    if (L->len % bt == 0) { /* a new page */
        pkvi_page *pg = NULL;
        st = page_new(e, &pg);
        if (st == PKV_OK)
            st = layer_reserve(L, L->n_pages + 1);
        if (st == PKV_OK)
            st = pkvi_session_reserve_partials(s, L->n_pages + 1);
        if (st != PKV_OK) {
            if (pg)
                page_unref(e, pg);
            return st;
        }
        L->pages[L->n_pages] = pg;
        L->data[L->n_pages] = pg->data;
        L->n_pages++;
        *out = pg;
        return PKV_OK;
    }

    const uint64_t i = L->n_pages - 1;
    pkvi_page *pg = L->pages[i];
    pg->pins++; /* neither make_room below may spill it */
    if (!pg->data) {
        st = pkvi_spill_fault_in(e, &pg, 1);
        if (st != PKV_OK) {
            pg->pins--;
            return st;
        }
    }
    if (pg->refs > 1) { /* copy-on-write: the only copy a fork causes */
        pkvi_page *np = NULL;
        st = page_new(e, &np);
        if (st != PKV_OK) {
            pg->pins--;
            return st;
        }
        memcpy(np->data, pg->data, (size_t)e->page_bytes);
        pg->pins--;
        page_unref(e, pg);
        L->pages[i] = np;
        pg = np;
    } else {
        pg->pins--;
    }
    L->data[i] = pg->data;
    *out = pg;
    return PKV_OK;
}

/* Store one token's K/V rows at row `slot` of page data. */
static void write_rows(const pkv_engine *e, void *data, uint64_t slot, const float *k,
                       const float *v)
{
    const uint32_t d = e->cfg.head_dim;
    for (uint32_t gi = 0; gi < e->cfg.n_kv_heads; gi++) {
        char *kb = (char *)data + gi * e->kp.group_stride + slot * e->row_bytes;
        e->kern->store_row(e->cfg.kv_dtype, kb, k + (size_t)gi * d, d);
        e->kern->store_row(e->cfg.kv_dtype, kb + e->kp.v_offset, v + (size_t)gi * d, d);
    }
}

pkv_status pkv_append(pkv_session *s, uint32_t layer, const float *k, const float *v)
{
    if (!s || !k || !v || layer >= s->e->cfg.n_layers)
        return PKV_EINVAL;
    pkv_engine *e = s->e;
    PKVI_BOUNDARY_CHECK(e);
    pkvi_layer *L = &s->layers[layer];
    const uint64_t slot = L->len % e->cfg.block_tokens;

    pthread_mutex_lock(&e->lock);
    pkvi_page *pg = NULL;
    pkv_status st = writable_tail(s, L, &pg);
    if (st != PKV_OK) {
        pthread_mutex_unlock(&e->lock);
        return st;
    }
    s->lru = ++e->clock;
    if (e->spill) { /* the spiller must not see a half-written page */
        write_rows(e, pg->data, slot, k, v);
        L->len++;
        pthread_mutex_unlock(&e->lock);
    } else { /* the page is ours alone (refs == 1) and cannot move: write unlocked */
        pthread_mutex_unlock(&e->lock);
        write_rows(e, pg->data, slot, k, v);
        L->len++;
    }
    return PKV_OK;
}

pkv_status pkvi_session_push_page(pkv_session *s, uint32_t layer, const void *bytes,
                                  uint32_t tokens)
{
    pkv_engine *e = s->e;
    pkvi_layer *L = &s->layers[layer];
    if (tokens == 0 || tokens > e->cfg.block_tokens || L->len % e->cfg.block_tokens)
        return PKV_EINVAL;
    pthread_mutex_lock(&e->lock);
    pkvi_page *pg = NULL;
    pkv_status st = writable_tail(s, L, &pg);
    if (st == PKV_OK) {
        memcpy(pg->data, bytes, (size_t)e->page_bytes);
        L->len += tokens;
    }
    pthread_mutex_unlock(&e->lock);
    return st;
}

/* ---- decode entry points -------------------------------------------------------------- */

pkv_status pkv_decode(pkv_session *s, uint32_t layer, const float *q, float *out)
{
    if (!s || !q || !out)
        return PKV_EINVAL;
    return pkvi_decode_many(s->e, layer, 1, &s, q, out);
}

pkv_status pkv_decode_batch(pkv_engine *e, uint32_t layer, uint32_t n,
                            pkv_session *const *sessions, const float *q, float *out)
{
    if (!e || !sessions || !q || !out || n == 0)
        return PKV_EINVAL;
    return pkvi_decode_many(e, layer, n, sessions, q, out);
}

/*
 * Undo a copy-on-write: layer `layer` of s has, as its tail page, a private copy of
 * the page whose descriptor was at address `orig`, made by a call that is failing,
 * and gets that page back if it is still shared. No reference was held on it (the
 * engine's invariant I3 counts block-table entries only) and another thread may have
 * destroyed its other holders meanwhile, so it is looked for by address where it can
 * only be - the same position of another session's table - and its bytes are compared
 * with the copy's live rows: a new descriptor that reused the address cannot be
 * mistaken for it. Spilled pages are left alone. Under e->lock.
 */
static void reshare_tail(pkv_engine *e, pkv_session *s, uint32_t layer, uintptr_t orig)
{
    pkvi_layer *L = &s->layers[layer];
    const uint64_t i = L->n_pages - 1;
    pkvi_page *copy = L->pages[i];
    const uint64_t rows = L->len - i * e->cfg.block_tokens;
    for (pkv_session *o = e->sessions; o; o = o->next) {
        const pkvi_layer *M = &o->layers[layer];
        if (o == s || M->n_pages <= i || (uintptr_t)M->pages[i] != orig)
            continue;
        pkvi_page *pg = M->pages[i]; /* live: a table names it */
        if (!pg->data || !copy->data)
            return;
        for (uint32_t g = 0; g < e->cfg.n_kv_heads; g++) {
            const size_t at = g * e->kp.group_stride, n = (size_t)(rows * e->row_bytes);
            if (memcmp((char *)pg->data + at, (char *)copy->data + at, n) != 0 ||
                memcmp((char *)pg->data + at + e->kp.v_offset,
                       (char *)copy->data + at + e->kp.v_offset, n) != 0)
                return;
        }
        pg->refs++;
        L->pages[i] = pg;
        L->data[i] = pg->data;
        page_unref(e, copy);
        return;
    }
}

pkv_status pkv_prefill(pkv_session *s, uint32_t layer, uint32_t n, const float *q,
                       const float *k, const float *v, float *out)
{
    if (!s || !q || !k || !v || !out || n == 0 || layer >= s->e->cfg.n_layers)
        return PKV_EINVAL;
    pkv_engine *e = s->e;
    const uint64_t start = s->layers[layer].len, bt = e->cfg.block_tokens;
    const size_t qd = (size_t)e->cfg.n_heads * e->cfg.head_dim;
    const size_t kd = (size_t)e->cfg.n_kv_heads * e->cfg.head_dim;
    const uint32_t tile_max = pkvi_prefill_tile_max(e);
    pkvi_layer *L = &s->layers[layer];
    float *scratch;
    pkv_status st = pkvi_prefill_scratch(e, (start + n + bt - 1) / bt, &scratch);
    if (st != PKV_OK)
        return st;
    /* A failure must leave the session as it was, sharing included: if the first
     * append copies a shared tail page (copy-on-write), the rollback below gives the
     * layer the shared page back (see reshare_tail). */
    uintptr_t shared_tail = 0; /* an address only: the page may be freed meanwhile */
    pthread_mutex_lock(&e->lock);
    if (start % bt && L->pages[L->n_pages - 1]->refs > 1)
        shared_tail = (uintptr_t)L->pages[L->n_pages - 1];
    pthread_mutex_unlock(&e->lock);
    /* Tiles of queries that land in one page: append them, then attend all at once
     * (decode.c keeps each query's arithmetic that of append + pkv_decode). */
    for (uint32_t i = 0; i < n && st == PKV_OK;) {
        const uint64_t room = bt - (start + i) % bt;
        uint32_t nq = n - i < tile_max ? n - i : tile_max;
        if (nq > room)
            nq = (uint32_t)room;
        for (uint32_t t = 0; t < nq && st == PKV_OK; t++)
            st = pkv_append(s, layer, k + (i + t) * kd, v + (i + t) * kd);
        if (st == PKV_OK)
            st = pkvi_prefill_attend(e, s, layer, nq, q + i * qd, out + i * qd, scratch);
        i += nq;
    }
    free(scratch);
    if (st != PKV_OK) {
        pthread_mutex_lock(&e->lock);
        layer_truncate(e, L, start);
        if (shared_tail && (uintptr_t)L->pages[L->n_pages - 1] != shared_tail)
            reshare_tail(e, s, layer, shared_tail);
        pthread_mutex_unlock(&e->lock);
    }
    return st;
}

/* ---- memory ------------------------------------------------------------------------- */

pkv_status pkv_session_memory(const pkv_session *s, pkv_memory *out)
{
    if (!s || !out)
        return PKV_EINVAL;
    pkv_engine *e = s->e;
    pkv_memory m;
    memset(&m, 0, sizeof m);
    const uint64_t pb = e->page_bytes;
    const uint64_t token_bytes = 2ull * e->cfg.n_kv_heads * e->row_bytes;
    m.bytes_overhead = sizeof *s + (uint64_t)e->cfg.n_layers * sizeof(pkvi_layer) +
                       s->partials_chunks * e->cfg.n_heads *
                           ((uint64_t)e->cfg.head_dim + 2) * sizeof(float);
    pthread_mutex_lock(&e->lock);
    for (uint32_t l = 0; l < e->cfg.n_layers; l++) {
        const pkvi_layer *L = &s->layers[l];
        m.tokens += L->len;
        m.blocks += L->n_pages;
        m.bytes_ideal += L->len * token_bytes;
        m.bytes_overhead += L->cap * (sizeof(pkvi_page *) + sizeof(void *)) +
                            L->n_pages * sizeof(pkvi_page);
        for (uint64_t i = 0; i < L->n_pages; i++) {
            const pkvi_page *pg = L->pages[i];
            if (pg->data) {
                m.bytes_resident += pb;
                if (pg->refs > 1)
                    m.bytes_shared += pb;
            } else {
                m.bytes_spilled += pb;
            }
        }
    }
    pthread_mutex_unlock(&e->lock);
    *out = m;
    return PKV_OK;
}

/* ---- spill hooks ------------------------------------------------------------------------ */

pkv_status pkvi_session_acquire(pkv_session *s, uint32_t layer)
{
    pkv_engine *e = s->e;
    if (!e->spill)
        return PKV_OK;
    pkvi_layer *L = &s->layers[layer];
    pkv_status st = PKV_OK;
    pthread_mutex_lock(&e->lock);
    uint64_t n_out = 0;
    for (uint64_t i = 0; i < L->n_pages; i++) {
        L->pages[i]->pins++;
        n_out += L->pages[i]->data == NULL;
    }
    if (n_out) {
        pkvi_page **need = n_out <= UINT32_MAX ? malloc((size_t)n_out * sizeof *need) : NULL;
        if (!need) {
            st = PKV_ENOMEM;
        } else {
            uint64_t j = 0;
            for (uint64_t i = 0; i < L->n_pages; i++)
                if (!L->pages[i]->data)
                    need[j++] = L->pages[i];
            st = pkvi_spill_fault_in(e, need, (uint32_t)n_out);
            free(need);
        }
    }
    if (st != PKV_OK) {
        for (uint64_t i = 0; i < L->n_pages; i++)
            L->pages[i]->pins--;
    } else {
        for (uint64_t i = 0; i < L->n_pages; i++)
            L->data[i] = L->pages[i]->data;
        s->lru = ++e->clock;
    }
    pthread_mutex_unlock(&e->lock);
    return st;
}

void pkvi_session_release(pkv_session *s, uint32_t layer)
{
    pkv_engine *e = s->e;
    if (!e->spill)
        return;
    pkvi_layer *L = &s->layers[layer];
    pthread_mutex_lock(&e->lock);
    for (uint64_t i = 0; i < L->n_pages; i++)
        L->pages[i]->pins--;
    pthread_mutex_unlock(&e->lock);
}

pkv_status pkv_session_pages(const pkv_session *s, uint32_t layer, uint64_t first,
                             uint64_t n, pkv_page_info *out, uint64_t *n_out)
{
    if (!s || layer >= s->e->cfg.n_layers || (!out && n > 0))
        return PKV_EINVAL;
    pkv_engine *e = s->e;
    const pkvi_layer *L = &s->layers[layer];
    uint64_t k = 0;
    pthread_mutex_lock(&e->lock);
    for (uint64_t i = first; i < L->n_pages && k < n; i++, k++) {
        const pkvi_page *pg = L->pages[i];
        out[k].id = (uint64_t)(uintptr_t)pg;
        out[k].refs = pg->refs;
        out[k].resident = pg->data != NULL;
    }
    pthread_mutex_unlock(&e->lock);
    if (n_out)
        *n_out = k;
    return PKV_OK;
}

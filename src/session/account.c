/*
 * session/account.c - what sessions hold, counted: per session pkv_session_memory and
 * pkv_session_pages, and engine-wide the invariants E1-E4 (engine/engine.h) with B1-B5
 * of every table and P1-P4 of the prefix index - pkvi_sessions_check, which
 * pkv_engine_check and, in -Dpoison=true builds, every API boundary run
 * (PKVI_BOUNDARY_CHECK, session.h).
 *
 * Owns nothing and changes nothing a caller can see: it reads the pool, the session
 * list, every table and the index under e->lock (the E3 pass uses each descriptor's
 * `tally` as scratch and leaves it 0). Calls only the checks of btable.c and
 * prefix.c; no other session file, so every layer above can call it.
 */
#include "session/session.h"

#include <stdio.h>
#include <string.h>

/* ---- accounting --------------------------------------------------------------------------- */

pkv_status pkv_session_memory(const pkv_session *s, pkv_memory *out)
{
    if (!s)
        return PKV_EINVAL;
    if (!out)
        return pkvi_fail(s->e, PKV_EINVAL, "pkv_session_memory: out is NULL");
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
    if (!s)
        return PKV_EINVAL;
    if (layer >= s->e->cfg.n_layers || (!out && n > 0))
        return pkvi_fail(s->e, PKV_EINVAL, "pkv_session_pages: %s",
                         layer >= s->e->cfg.n_layers ? "layer out of range"
                                                     : "out is NULL with n > 0");
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
#define VISIT_ONCE(pg)                                                                     \
    if (pg->tally != 0) {                                                                  \
        ok &= pg->tally == pg->refs;                                                       \
        resident += pg->data != NULL;                                                      \
        spilled += pg->data == NULL;                                                       \
        indexed += pg->indexed;                                                            \
        pg->tally = 0;                                                                     \
    }
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
    if (!pkvi_sessions_check(e, true))
        return pkvi_fail(e, PKV_ECORRUPT, "pkv_engine_check: an invariant is broken (a library "
                         "defect: please report it)");
    return PKV_OK;
}

bool pkvi_engine_check(pkv_engine *e)
{
    return pkvi_sessions_check(e, true);
}

bool pkvi_engine_check_live(pkv_engine *e)
{
    return pkvi_sessions_check(e, false);
}

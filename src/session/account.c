/*
 * session/account.c - what sessions hold, counted: per session pkv_session_memory and
 * pkv_session_pages, and engine-wide the invariants E1-E4 and T1 (cache/cache.h) with
 * B1-B6 of every table and P1-P4 of the prefix index - pkvi_sessions_check, which
 * pkv_engine_check and, in -Dpoison=true builds, every API boundary run
 * (pkvi_boundary_check, session.h).
 *
 * Owns nothing and changes nothing a caller can see: it reads the pool, the session
 * list, every table and the index under the cache state's lock. The walks are calls
 * of the modules that own what they walk: btable.c's figures, checks and census (the
 * E3 pass uses each descriptor's `tally` as scratch and leaves it 0), prefix.c's,
 * pool.c's. No other session file, so every layer above can call it.
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
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_memory: out is NULL");
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    pkv_memory m;
    memset(&m, 0, sizeof m);
    const uint64_t pb = geo->page_bytes;
    const uint64_t token_bytes =
        (uint64_t)geo->cfg.n_kv_heads * (geo->row_bytes + geo->row_bytes_v);
    m.bytes_overhead = sizeof *s + (uint64_t)geo->cfg.n_layers * sizeof(pkvi_btable *) +
                       s->partials_chunks * geo->cfg.n_heads *
                           ((uint64_t)geo->cfg.head_dim_v + 2) * sizeof(float);
    pthread_mutex_lock(&cache->lock);
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++) {
        const pkvi_btable *t = s->layers[l];
        const uint64_t len = pkvi_btable_len(t);
        m.tokens += len;
        m.blocks += pkvi_btable_held(t);
        /* a windowed layer needs only what a decode (or one after a rollback) reads */
        m.bytes_ideal += pkvi_window_needed(&geo->layers[l], len) * token_bytes;
        m.bytes_overhead += pkvi_btable_overhead(t);
        m.bytes_spilled += pkvi_btable_n_spilled(t) * pb;
        m.bytes_shared += pkvi_btable_shared_resident(t) * pb;
    }
    m.bytes_resident = m.blocks * pb - m.bytes_spilled;
    pthread_mutex_unlock(&cache->lock);
    *out = m;
    return PKV_OK;
}

pkv_status pkv_session_pages(const pkv_session *s, uint32_t layer, uint64_t first,
                             uint64_t n, pkv_page_info *out, uint64_t *n_out)
{
    if (!s)
        return PKV_EINVAL;
    if (layer >= s->geom->cfg.n_layers || (!out && n > 0))
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_pages: %s",
                         layer >= s->geom->cfg.n_layers ? "layer out of range"
                                                        : "out is NULL with n > 0");
    pkvi_cache *cache = s->cache;
    pthread_mutex_lock(&cache->lock);
    const uint64_t k = pkvi_btable_info(s->layers[layer], first, n, out);
    pthread_mutex_unlock(&cache->lock);
    if (n_out)
        *n_out = k;
    return PKV_OK;
}

/* ---- invariants --------------------------------------------------------------------------- */

/* Every table of every live session: B1-B6. */
static bool tables_ok(const pkvi_geom *geo, const pkvi_cache *cache, bool quiescent)
{
    for (const pkv_session *s = cache->sessions; s; s = s->next)
        for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
            if (!pkvi_btable_check(s->layers[l], geo->cfg.block_tokens, quiescent))
                return false;
    return true;
}

/* Every table's holders counted into its pages' tallies (reset: tallies cleared). */
static void tally_tables(const pkvi_geom *geo, const pkvi_cache *cache, bool reset)
{
    for (const pkv_session *s = cache->sessions; s; s = s->next)
        for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
            pkvi_btable_tally(s->layers[l], reset);
}

bool pkvi_sessions_check(const pkvi_geom *geo, pkvi_cache *cache, bool quiescent)
{
    pthread_mutex_lock(&cache->lock);
    bool ok = pkvi_pool_check(cache->pool) && tables_ok(geo, cache, quiescent); /* E4, B */
    if (ok) {
        /* E1-E3: count every holder of every page (tables, then the index through its
         * own check), then visit each page once. */
        tally_tables(geo, cache, true);
        pkvi_prefix_tally_reset(&cache->prefix);
        tally_tables(geo, cache, false);
        uint64_t node_pages = 0;
        ok = pkvi_prefix_check(&cache->prefix, quiescent, &node_pages); /* P1-P4 */
        pkvi_census c = {.ok = true};
        for (const pkv_session *s = cache->sessions; s; s = s->next)
            for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
                pkvi_btable_census(s->layers[l], &c);
        pkvi_prefix_census(&cache->prefix, &c);
        /* Pages a reservation took but has not yet pushed do not exist between the
         * lock's holds, so these are exact; the transfers in flight add their read
         * buffers and their orphans (cache.h: E1, E2, T1). An indexed page is in
         * exactly one node (P3): the distinct indexed pages are the node pages. */
        const pkvi_pool_counts n = pkvi_pool_count(cache->pool);
        const pkvi_transit_census x = pkvi_cache_transit_census(cache);
        ok = ok && c.ok && x.ok &&
             c.resident + x.buffers + x.orphans_resident == n.in_use &&
             c.spilled + x.orphans_spilled == n.spilled && c.transit == x.named &&
             c.indexed == node_pages;
    }
    pthread_mutex_unlock(&cache->lock);
    return ok;
}

#if PKV_POISON
pkv_status pkvi_boundary_check(const pkvi_geom *geo, pkvi_cache *cache, const char *where)
{
    if (pkvi_sessions_check(geo, cache, false))
        return PKV_OK;
    fprintf(stderr, "pagedkv: engine invariants broken (detected in %s)\n", where);
    return PKV_ECORRUPT;
}
#endif

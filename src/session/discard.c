/*
 * session/discard.c - pkv_session_discard (SPEC §14, docs/rope.md): drop positions
 * [p0, p1) of every layer; the later rows move down by delta = p1 - p0, their keys
 * turned back by delta positions.
 *
 * Owns the plan of a discard and its three steps, the reserve-then-commit of every
 * write (session.h) applied to a layer's tail:
 *
 *   plan      no lock: every check (range, rope, shard, window); per layer what it
 *        |    becomes (nothing, a truncate to p0, or a shift) and, for a windowed
 *        |    layer, its new hole and stale rows. Fails -> nothing changed.
 *        v
 *   reserve   the lock: pin the shifted layers, bring their pages from p0 on back
 *        |    (spill engines), take a fresh page for every destination page another
 *        |    holder shares (copy-on-write) or the window had released, mark the
 *        |    pages written in place. Fails -> everything given back, nothing changed.
 *        v
 *   move      no lock: rows q = p0 .. new_len - 1 from old position q + delta, in
 *        |    increasing q (a row is read before its slot is written: q < q + delta),
 *        |    K re-rotated and rounded again, V copied byte for byte. Cannot fail.
 *        v
 *   commit    the lock: the tables take their new tails (btable.c's rewrite: fresh
 *             pages in, replaced and dropped ones out), truncated layers are cut,
 *             marks cleared, unpinned; the token record ends at p0.
 *
 * The old pages a destination replaces stay in the table until the commit, so a
 * shared page another session holds is read, never written (B5), and its other
 * holders keep it. A page wholly below p0 is never touched: it stays shared.
 *
 * Windows (docs/variants.md): positions a windowed layer released are "gone"; after
 * the discard the gone positions are one run [gone_lo, gone_hi) again, whose whole
 * pages become the hole and whose other rows (at most a page's worth at its end) are
 * stale: kept in a held page, read by nothing (btable.h; truncate refuses to reach
 * them). The plan refuses a discard that would bring a gone position into the new
 * window (or its rollback) or into the sinks' pages.
 *
 * Calls btable.c for every table change and session/residency.c for pages; the
 * record is session.c's. Nothing below calls this file.
 */
#include "session/private.h"
#include "base/dtype.h"

#include <stdlib.h>
#include <string.h>

enum { KEEP, CUT, SHIFT };  /* what a layer becomes: unchanged, truncated to p0, moved */

typedef struct {
    int kind;
    uint64_t len, new_len;
    uint64_t a, n;           /* SHIFT: entries [a, a + n) are rewritten */
    uint64_t gone_lo, gone_hi; /* old gone positions (empty: equal) */
    pkvi_btable_shape shape; /* SHIFT: what the table becomes */
    pkvi_page **dst;         /* SHIFT: [n] each entry's page after (see btable.h) */
    bool pinned;
} layer_plan;

typedef struct {
    uint64_t p0, p1, delta;
    layer_plan *lp;          /* [n_layers] */
    pkvi_page **fresh;       /* every fresh page taken, [n_fresh] */
    uint64_t n_fresh;
} plan;

/* ---- plan ------------------------------------------------------------------------------ */

/* The gone positions of table t (the hole's above `first`, with the stale rows): one
 * run, by construction. */
static void gone_of(const pkvi_btable *t, uint64_t bt, uint64_t *lo, uint64_t *hi)
{
    uint64_t hl, hh, sl, sh;
    pkvi_btable_hole(t, &hl, &hh);
    pkvi_btable_stale(t, &sl, &sh);
    const uint64_t first = pkvi_btable_first(t);
    uint64_t glo = hl * bt > first ? hl * bt : first, ghi = hh * bt;
    if (ghi <= glo)
        glo = ghi = 0;
    if (sh > sl) { /* stale rows extend it (or stand alone when no page is released) */
        glo = ghi > glo && glo < sl ? glo : sl;
        ghi = sh > ghi ? sh : ghi;
    }
    *lo = glo;
    *hi = ghi;
}

/* Whether [a, b) and [c, d) overlap. */
static bool overlap(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return a < d && c < b && a < b && c < d;
}

/* A windowed layer's new gone run, hole and stale rows, or PKV_ERANGE (with a reason)
 * when a gone position would land where a decode reads. */
static pkv_status plan_window(pkv_session *s, uint32_t l, const plan *p, layer_plan *lp)
{
    const pkvi_geom *geo = s->geom;
    const pkv_layer_config *lc = &geo->layers[l];
    const pkvi_btable *t = s->layers[l];
    const uint64_t bt = geo->cfg.block_tokens, first = pkvi_btable_first(t);
    const uint64_t G0 = lp->gone_lo, G1 = lp->gone_hi, L2 = lp->new_len;
    const uint64_t p0 = p->p0, p1 = p->p1, delta = p->delta;
    /* where the old gone run lands: its part below p0 stays, its part at or past p1
     * moves down by delta, its part in [p0, p1) is dropped */
    uint64_t J0 = 0, J1 = 0;
    if (G1 > G0) {
        if (G0 < p0) {
            J0 = G0;
            J1 = G1 <= p0 ? G1 : G1 <= p1 ? p0 : G1 - delta;
        } else if (G1 > p1) {
            J0 = G0 >= p1 ? G0 - delta : p0;
            J1 = G1 - delta;
        }
    }
    /* what must stay readable: the new window with its rollback, and the rows of the
     * sink pages (a gone run starts past them) */
    const uint64_t span = (uint64_t)lc->window + lc->rollback_tokens;
    const uint64_t need_lo = L2 > span ? L2 - span : 0;
    const uint64_t sink_end = pkvi_sink_pages(geo, lc) * bt;
    if (overlap(J0, J1, need_lo, L2) || overlap(J0, J1, first, sink_end < L2 ? sink_end : L2))
        return pkvi_fail(s->errs, PKV_ERANGE, "pkv_session_discard: layer %u's window had "
                         "released positions that would land at %llu..%llu, inside its new "
                         "window (from %llu) or its sink pages", l, (unsigned long long)J0,
                         (unsigned long long)(J1 - 1), (unsigned long long)need_lo);
    /* the hole: the whole pages of the run, which starts on a page (past the sink
     * pages, or at a shard's first position; the checks above saw to it) - a shard's
     * hole starts at entry 0 anyway - extended to the window's release point below */
    const uint64_t lo = first ? 0 : pkvi_sink_pages(geo, lc);
    uint64_t hi = J1 > J0 ? J1 / bt : 0;
    if (first && hi < first / bt)
        hi = first / bt;
    /* and what the window no longer reads at the new length, as an append to it would
     * release (session/write.c): a loaded copy of the session holds the same pages */
    const uint64_t kf = pkvi_window_keep_from(lc, L2, bt);
    if (kf > hi && kf > pkvi_sink_pages(geo, lc))
        hi = kf;
    lp->shape.hole_lo = hi > lo ? lo : 0;
    lp->shape.hole_hi = hi > lo ? hi : 0;
    lp->shape.stale_lo = J1 > J0 ? J0 : 0;
    lp->shape.stale_hi = J1 > J0 ? J1 : 0;
    return PKV_OK;
}

/* Every check; each layer's kind, lengths and new shape. Owner thread, no lock. */
static pkv_status plan_layers(pkv_session *s, plan *p)
{
    const pkvi_geom *geo = s->geom;
    const uint32_t L = geo->cfg.n_layers;
    const uint64_t bt = geo->cfg.block_tokens;
    uint64_t max_len = 0;
    for (uint32_t l = 0; l < L; l++)
        if (pkvi_btable_len(s->layers[l]) > max_len)
            max_len = pkvi_btable_len(s->layers[l]);
    if (p->p1 > max_len)
        return pkvi_fail(s->errs, PKV_ERANGE, "pkv_session_discard: [%llu, %llu) ends past "
                         "every layer (the longest holds %llu)", (unsigned long long)p->p0,
                         (unsigned long long)p->p1, (unsigned long long)max_len);
    for (uint32_t l = 0; l < L; l++) {
        const pkvi_btable *t = s->layers[l];
        layer_plan *lp = &p->lp[l];
        lp->len = lp->new_len = pkvi_btable_len(t);
        if (lp->len <= p->p0 || p->delta == 0)
            continue;
        if (p->p0 < pkvi_btable_first(t))
            return pkvi_fail(s->errs, PKV_ERANGE, "pkv_session_discard: layer %u is a shard "
                             "that starts at %llu, above p0 %llu", l,
                             (unsigned long long)pkvi_btable_first(t),
                             (unsigned long long)p->p0);
        if (lp->len <= p->p1) { /* the end goes: a truncate to p0 */
            uint64_t at = 0;
            if (pkvi_btable_cut_check(t, bt, geo->layers[l].window, p->p0, &at) != PKVI_CUT_OK)
                return pkvi_fail(s->errs, PKV_ERANGE, "pkv_session_discard: layer %u would "
                                 "end at %llu, but its window released positions below %llu "
                                 "that a decode there reads", l, (unsigned long long)p->p0,
                                 (unsigned long long)at);
            lp->kind = CUT;
            lp->new_len = p->p0;
            continue;
        }
        if (!pkvi_layer_rope(geo, l))
            return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_discard: layer %u holds "
                             "positions from %llu on and has no rope: its keys cannot be "
                             "turned to new positions", l, (unsigned long long)p->p1);
        lp->kind = SHIFT;
        lp->new_len = lp->len - p->delta;
        lp->a = p->p0 / bt;
        lp->n = (lp->new_len + bt - 1) / bt - lp->a;
        lp->shape.len = lp->new_len;
        gone_of(t, bt, &lp->gone_lo, &lp->gone_hi);
        if (geo->layers[l].window) {
            const pkv_status st = plan_window(s, l, p, lp);
            if (st != PKV_OK)
                return st;
        } else { /* a shard's hole below `first` stays what it is */
            pkvi_btable_hole(t, &lp->shape.hole_lo, &lp->shape.hole_hi);
        }
    }
    return PKV_OK;
}

/* ---- reserve --------------------------------------------------------------------------- */

/* Whether entry i of a shifted layer is in its new hole. */
static bool in_new_hole(const layer_plan *lp, uint64_t i)
{
    return i >= lp->shape.hole_lo && i < lp->shape.hole_hi;
}

/* Give back what reserve took (the lock held): fresh pages nobody holds, pins, marks. */
static void unreserve(pkv_session *s, plan *p)
{
    pkvi_cache *cache = s->cache;
    for (uint64_t i = 0; i < p->n_fresh; i++)
        pkvi_page_destroy(cache->pool, p->fresh[i]);
    p->n_fresh = 0;
    for (uint32_t l = 0; l < s->geom->cfg.n_layers; l++)
        if (p->lp[l].pinned) {
            pkvi_btable_unpin(s->layers[l]);
            p->lp[l].pinned = false;
        }
}

/* Under the lock: pins, the pages from p0 on in memory, the destination of every new
 * entry. All or nothing. */
static pkv_status reserve(pkv_session *s, plan *p)
{
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    const uint32_t L = geo->cfg.n_layers;
    pkv_status st = PKV_OK;
    for (uint32_t l = 0; l < L && st == PKV_OK; l++)
        if (p->lp[l].kind == SHIFT && cache->spill) {
            pkvi_btable_pin(s->layers[l]); /* first: making room spills no pinned page */
            p->lp[l].pinned = true;
        }
    for (uint32_t l = 0; l < L && st == PKV_OK; l++)
        if (p->lp[l].kind == SHIFT && cache->spill)
            st = pkvi_session_fault_in(geo, cache, s->layers[l], l, p->lp[l].a);
    uint64_t want = 0;
    for (uint32_t l = 0; l < L && st == PKV_OK; l++) {
        layer_plan *lp = &p->lp[l];
        const pkvi_btable *t = s->layers[l];
        for (uint64_t i = 0; lp->kind == SHIFT && i < lp->n; i++) {
            const uint64_t e = lp->a + i;
            pkvi_page *old = pkvi_btable_page(t, e);
            lp->dst[i] = in_new_hole(lp, e) ? NULL
                         : old && !pkvi_page_shared(old) ? old /* rewritten in place */
                                                         : NULL;
            want += !in_new_hole(lp, e) && lp->dst[i] == NULL;
        }
    }
    if (st == PKV_OK && want)
        st = pkvi_session_take_pages(geo, cache, want, p->fresh);
    if (st != PKV_OK) {
        unreserve(s, p);
        return st;
    }
    p->n_fresh = want;
    uint64_t f = 0;
    for (uint32_t l = 0; l < L; l++) {
        layer_plan *lp = &p->lp[l];
        for (uint64_t i = 0; lp->kind == SHIFT && i < lp->n; i++) {
            if (in_new_hole(lp, lp->a + i))
                continue;
            if (!lp->dst[i])
                lp->dst[i] = p->fresh[f++];
            else /* B5: written in place, so it must not gain a holder meanwhile */
                pkvi_page_mark_writing(lp->dst[i], true);
        }
    }
    s->lru = ++cache->clock;
    return PKV_OK;
}

/* ---- move ------------------------------------------------------------------------------ */

/* The rows of a shifted layer, no lock: destination pages start as copies (the first,
 * whose rows below p0 stay) or zeros (nothing of another user's ever lands in a page of
 * this session); then every row that has a readable source and a held destination. */
static void move_rows(pkv_session *s, uint32_t l, const plan *p)
{
    const pkvi_geom *geo = s->geom;
    const layer_plan *lp = &p->lp[l];
    const pkvi_btable *t = s->layers[l];
    const pkvi_rope *rope = pkvi_layer_rope(geo, l);
    const uint64_t bt = geo->cfg.block_tokens;
    const uint32_t g = geo->cfg.n_kv_heads, d = geo->cfg.head_dim;
    const pkv_dtype dt = geo->cfg.kv_dtype;
    const size_t gs = geo->kp.group_stride, vo = geo->kp.v_offset;
    const size_t rk = (size_t)geo->row_bytes, rv = (size_t)geo->row_bytes_v;
    /* the values that rotate, rounded up to whole blocks on Q8/Q4 (a block's scale
     * covers its 32 values); the bytes past them are copied */
    uint32_t nr = 2 * rope->half;
    if (dt == PKV_Q8 || dt == PKV_Q4)
        nr = (nr + 31) / 32 * 32 < d ? (nr + 31) / 32 * 32 : d;
    const size_t pre = pkv_row_bytes(dt, nr);
    float cs[PKVI_ROPE_MAX_DIMS], row[PKVI_MAX_HEAD_DIM];
    pkvi_rope_back(rope, p->delta, cs);

    for (uint64_t i = 0; i < lp->n; i++) {
        pkvi_page *pg = lp->dst[i], *old = pkvi_btable_page(t, lp->a + i);
        if (!pg || pg == old)
            continue;
        if (i == 0 && old && p->p0 % bt)
            memcpy(pg->data, old->data, (size_t)geo->page_bytes);
        else
            memset(pg->data, 0, (size_t)geo->page_bytes);
    }
    for (uint64_t q = p->p0; q < lp->new_len; q++) {
        const uint64_t o = q + p->delta;
        pkvi_page *dpg = lp->dst[q / bt - lp->a];
        if (!dpg || (o >= lp->gone_lo && o < lp->gone_hi))
            continue; /* a destination in the hole, or a source the window released */
        const char *src = pkvi_btable_page(t, o / bt)->data;
        char *dst = dpg->data;
        const size_t so = (size_t)(o % bt), dof = (size_t)(q % bt);
        for (uint32_t gi = 0; gi < g; gi++) {
            const char *sk = src + gi * gs + so * rk;
            char *dk = dst + gi * gs + dof * rk;
            pkvi_load_row(dt, row, sk, nr);
            pkvi_rope_apply(rope, cs, row, 1, nr);
            geo->kern->store_row(dt, dk, row, nr);
            memcpy(dk + pre, sk + pre, rk - pre);
            memcpy(dst + gi * gs + vo + dof * rv, src + gi * gs + vo + so * rv, rv);
        }
    }
}

/* ---- commit ---------------------------------------------------------------------------- */

static void commit(pkv_session *s, plan *p)
{
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    const pkvi_pages ps = pkvi_cache_pages(cache);
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++) {
        layer_plan *lp = &p->lp[l];
        pkvi_btable *t = s->layers[l];
        if (lp->kind == CUT)
            pkvi_btable_truncate(t, ps, geo->cfg.block_tokens, p->p0);
        if (lp->kind != SHIFT)
            continue;
        for (uint64_t i = 0; i < lp->n; i++)
            if (lp->dst[i] && lp->dst[i] == pkvi_btable_page(t, lp->a + i))
                pkvi_page_mark_writing(lp->dst[i], false);
        pkvi_btable_rewrite(t, ps, lp->a, lp->dst, lp->n, &lp->shape);
        if (lp->pinned)
            pkvi_btable_unpin(t);
    }
    pkvi_prefix_trim(&cache->prefix, ps); /* replaced pages may be cached ones now */
}

/* ---- the call ---------------------------------------------------------------------------- */

static void plan_free(plan *p, uint32_t L)
{
    for (uint32_t l = 0; p->lp && l < L; l++)
        free(p->lp[l].dst);
    free(p->lp);
    free(p->fresh);
}

pkv_status pkv_session_discard(pkv_session *s, uint64_t p0, uint64_t p1)
{
    if (!s)
        return PKV_EINVAL;
    const pkvi_geom *geo = s->geom;
    pkvi_cache *cache = s->cache;
    const uint32_t L = geo->cfg.n_layers;
    if (p0 > p1)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_session_discard: p0 %llu > p1 %llu",
                         (unsigned long long)p0, (unsigned long long)p1);
    if (pkvi_boundary_check(geo, cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    /* pending drafts sit past len in slots a move would overwrite or leave behind */
    if (pkvi_session_pending(s))
        return pkvi_fail(s->errs, PKV_ESTATE, "pkv_session_discard: drafts are pending "
                         "(pkv_session_commit first)");
    plan p = {.p0 = p0, .p1 = p1, .delta = p1 - p0};
    p.lp = calloc(L, sizeof *p.lp);
    if (!p.lp)
        return pkvi_fail(s->errs, PKV_ENOMEM, "pkv_session_discard: out of memory");
    pkv_status st = plan_layers(s, &p);
    if (st != PKV_OK || p.delta == 0) {
        plan_free(&p, L);
        return st;
    }
    uint64_t total = 0;
    for (uint32_t l = 0; l < L && st == PKV_OK; l++)
        if (p.lp[l].kind == SHIFT) {
            total += p.lp[l].n;
            if (!(p.lp[l].dst = calloc(p.lp[l].n ? p.lp[l].n : 1, sizeof *p.lp[l].dst)))
                st = PKV_ENOMEM;
        }
    if (st == PKV_OK && !(p.fresh = calloc(total ? total : 1, sizeof *p.fresh)))
        st = PKV_ENOMEM;
    if (st != PKV_OK) {
        plan_free(&p, L);
        return pkvi_fail(s->errs, st, "pkv_session_discard: out of memory");
    }

    pthread_mutex_lock(&cache->lock);
    st = reserve(s, &p);
    const uint64_t budget = pkvi_pool_count(cache->pool).budget_pages;
    pthread_mutex_unlock(&cache->lock);
    if (st != PKV_OK) {
        plan_free(&p, L);
        if (st == PKV_EIO)
            return pkvi_fail(s->errs, st, "pkv_session_discard: spilled pages could not be "
                             "read back");
        return pkvi_fail(s->errs, st, "pkv_session_discard: the pages to rewrite do not fit "
                         "%s", budget ? "the budget (nothing more could be spilled)"
                                      : "in memory");
    }
    for (uint32_t l = 0; l < L; l++)
        if (p.lp[l].kind == SHIFT)
            move_rows(s, l, &p);
    pthread_mutex_lock(&cache->lock);
    commit(s, &p);
    pthread_mutex_unlock(&cache->lock);
    pkvi_session_seal_record(s, p0);
    plan_free(&p, L);
    return PKV_OK;
}

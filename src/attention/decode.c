/*
 * decode.c - the public calls of the attention pipeline (pipeline.c) that read cached
 * positions: pkv_decode, pkv_decode_batch, pkv_prefill and the shard calls
 * pkv_decode_partial / pkv_merge_partials (docs/sharding.md). pkv_verify, which reads
 * drafts as well, is verify.c's.
 *
 * Owns how each call becomes query sets: a decode is a set of one query; a batch is a
 * set per group of sessions that hold the same pages (forks, prefix-cache sessions:
 * each page they share is read once for all of them, and those of a session alone as
 * a set of one); a prefill is a set per page-sized tile of queries. Works from the
 * narrow contexts a session carries (session.h): the geometry (cache/geom.h), the
 * executor (attention/exec.h) and the error sink; the calls that take an engine handle
 * reach it through engine.c. Residency and the reservation a prefill writes through
 * are session/residency.c's and session/write.c's; a layer's page data is read
 * through btable.c's array, once per call, while the layer is pinned.
 *
 * A batch's sets: its sessions sorted by their pages (so that sessions sharing pages
 * sit side by side), then cut wherever two neighbours share no page, hold a different
 * first position (shards) or, on a windowed layer, a different length (their windows
 * differ), and wherever a set would exceed the kernels' head limit. The states of a
 * stacked set live in the executor's batch scratch; when another call holds it (or it
 * cannot grow) every session is a set of its own, which gives the same bits.
 */
#include "attention/decode.h"
#include "attention/pipeline.h"

#include <stdlib.h>
#include <string.h>

/* ---- a session's query --------------------------------------------------------------- */

/* The pages the query of a session at its last position reads: [first page, P). */
static pkvi_qpages session_pages(const pkvi_geom *geo, const pkvi_btable *t)
{
    const uint64_t bt = geo->cfg.block_tokens, len = pkvi_btable_len(t);
    const uint64_t P = (len + bt - 1) / bt;
    const void *const *data = pkvi_btable_data(t);
    return (pkvi_qpages){data, P, NULL, P, (uint32_t)(len - (P - 1) * bt)};
}

/* The set of one query of a session at position pos (len - 1, or later for a shard
 * that holds earlier positions: pkv_decode_partial_at); seg is its one segment. */
static pkvi_qset one_query(const pkvi_geom *geo, const pkvi_btable *t, uint32_t layer,
                           uint64_t pos, const float *q, float *st, pkvi_seg *seg)
{
    const uint64_t bt = geo->cfg.block_tokens, first = pkvi_btable_first(t);
    const pkvi_qpages qp = session_pages(geo, t);
    *seg = (pkvi_seg){qp.head + first / bt, first / bt, qp.end, 0, 1, qp.last};
    pkvi_qset Q = {.nq = 1, .H = geo->hg, .segs = seg, .n_segs = 1, .qg = q, .st = st};
    pkvi_set_runs(geo, layer, first, pkvi_btable_len(t), pos, &Q);
    return Q;
}

/* ---- decode and batch ---------------------------------------------------------------- */

static int cmp_ptr(const void *a, const void *b)
{
    const uintptr_t x = (uintptr_t)*(pkv_session *const *)a;
    const uintptr_t y = (uintptr_t)*(pkv_session *const *)b;
    return (x > y) - (x < y);
}

/* PKV_OK if the n sessions are distinct; PKV_EINVAL if one appears twice (both slots
 * would share its scratch). Pairwise for a small batch, else a sorted copy. */
static pkv_status distinct(pkv_session *const *ss, uint32_t n)
{
    if (n <= PKVI_BATCH_MAX) {
        for (uint32_t i = 1; i < n; i++)
            for (uint32_t k = 0; k < i; k++)
                if (ss[k] == ss[i])
                    return PKV_EINVAL;
        return PKV_OK;
    }
    pkv_session **c = malloc((size_t)n * sizeof *c);
    if (!c)
        return PKV_ENOMEM;
    memcpy(c, ss, (size_t)n * sizeof *c);
    qsort(c, n, sizeof *c, cmp_ptr);
    pkv_status st = PKV_OK;
    for (uint32_t i = 1; i < n && st == PKV_OK; i++)
        if (c[i - 1] == c[i])
            st = PKV_EINVAL;
    free(c);
    return st;
}

/* One session of a batch: its pages, what decides which sessions may share a set,
 * and its place in the batch. */
typedef struct {
    pkvi_qpages qp;
    uint64_t first;          /* a shard's first position */
    uint64_t wlen;           /* its length on a windowed layer, else 0 */
    uint32_t slot;           /* index in the batch */
} bquery;

static bquery batch_query(const pkvi_geom *geo, const pkvi_btable *t, bool windowed,
                          uint32_t slot)
{
    return (bquery){session_pages(geo, t), pkvi_btable_first(t),
                    windowed ? pkvi_btable_len(t) : 0, slot};
}

/* Sessions by (first, wlen) and then by their pages' addresses, so that sessions
 * holding the same pages sit side by side (the order decides only how many page
 * reads sharing saves, never a result). */
static int cmp_bquery(const void *pa, const void *pb)
{
    const bquery *a = pa, *b = pb;
    if (a->first != b->first)
        return a->first < b->first ? -1 : 1;
    if (a->wlen != b->wlen)
        return a->wlen < b->wlen ? -1 : 1;
    const uint64_t end = a->qp.end < b->qp.end ? a->qp.end : b->qp.end;
    for (uint64_t p = 0; p < end; p++) {
        const uintptr_t x = (uintptr_t)a->qp.head[p], y = (uintptr_t)b->qp.head[p];
        if (x != y)
            return x < y ? -1 : 1;
    }
    if (a->qp.end != b->qp.end)
        return a->qp.end < b->qp.end ? -1 : 1;
    return (a->qp.last > b->qp.last) - (a->qp.last < b->qp.last);
}

/* The batch's sets, each a run of bq (sorted): their first query and size into
 * start[] and size[]; returns how many. Stacked sets need the scratch. */
static uint32_t batch_groups(const pkvi_geom *geo, const bquery *bq, uint32_t n,
                             uint32_t *start, uint32_t *size)
{
    const uint32_t bt = geo->cfg.block_tokens;
    const uint32_t cap = PKVI_MAX_GROUP_HEADS / geo->hg;
    uint32_t ns = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (ns > 0 && size[ns - 1] < cap && bq[i].first == bq[i - 1].first &&
            bq[i].wlen == bq[i - 1].wlen) {
            const uint64_t p0 = bq[i].first / bt;
            if (pkvi_qpages_common(&bq[i - 1].qp, &bq[i].qp, p0, bt) > p0) {
                size[ns - 1]++;
                continue;
            }
        }
        start[ns] = i;
        size[ns++] = 1;
    }
    return ns;
}

/* Run nb <= PKVI_BATCH_MAX sessions' queries (their layer pinned): stacked where they
 * share pages and the scratch is free, else one set each. */
static void run_batch(const pkvi_ctx *ctx, uint32_t layer, uint32_t nb,
                      pkv_session *const *ss, const float *q, float *out)
{
    const pkvi_geom *geo = ctx->geom;
    pkvi_exec *x = ctx->exec;
    const uint32_t g = geo->cfg.n_kv_heads, d = geo->cfg.head_dim, hg = geo->hg;
    const uint32_t bt = geo->cfg.block_tokens;
    const size_t qd = (size_t)geo->cfg.n_heads * d;
    bquery bq[PKVI_BATCH_MAX];
    uint32_t start[PKVI_BATCH_MAX], size[PKVI_BATCH_MAX], slot[PKVI_BATCH_MAX];
    pkvi_seg segs[4 * PKVI_BATCH_MAX];
    pkvi_qset sets[PKVI_BATCH_MAX];
    const bool windowed = geo->layers[layer].window != 0;
    for (uint32_t i = 0; i < nb; i++)
        bq[i] = batch_query(geo, ss[i]->layers[layer], windowed, i);
    uint32_t ns = nb;
    float *scratch = NULL;
    uint32_t wave = PKVI_MAX_CHUNKS;
    if (nb > 1 && !x->no_share) {
        qsort(bq, nb, sizeof *bq, cmp_bquery);
        ns = batch_groups(geo, bq, nb, start, size);
        /* the stacked sets' queries and states: [g][H][d] and (1 + wave) blocks each */
        uint64_t heads = 0, chunks = 0;
        for (uint32_t k = 0; k < ns; k++)
            if (size[k] > 1) {
                heads += (uint64_t)size[k] * hg;
                const pkvi_qpages *last = &bq[start[k] + size[k] - 1].qp;
                chunks = last->end > chunks ? last->end : chunks; /* pages, for now */
            }
        if (heads) {
            const uint64_t qf = heads * g * d;
            const uint64_t cap = PKVI_BATCH_SCRATCH_BYTES / sizeof(float);
            wave = pkvi_wave_for(geo, heads, cap > qf ? cap - qf : 0);
            const uint64_t need = pkvi_split_chunks(geo, chunks) + geo->sink_chunks_max;
            if (need < wave)
                wave = need ? (uint32_t)need : 1;
            scratch = pkvi_exec_scratch_take(
                x, qf + (1 + (uint64_t)wave) * g * heads * (geo->cfg.head_dim_v + 2ull));
        }
        if (!scratch) { /* one set each, in the batch's order */
            ns = nb;
            wave = PKVI_MAX_CHUNKS;
            for (uint32_t i = 0; i < nb; i++)
                bq[i] = batch_query(geo, ss[i]->layers[layer], windowed, i);
        }
    }
    if (ns == nb)
        for (uint32_t i = 0; i < nb; i++)
            start[i] = i, size[i] = 1;
    uint32_t nseg = 0;
    float *sp = scratch;
    for (uint32_t k = 0; k < ns; k++) {
        const bquery *b = &bq[start[k]];
        const uint32_t m = size[k];
        pkvi_qset *Q = &sets[k];
        uint64_t end = 0;
        for (uint32_t i = 0; i < m; i++) {
            slot[start[k] + i] = b[i].slot;
            const uint64_t len = pkvi_btable_len(ss[b[i].slot]->layers[layer]);
            end = len > end ? len : end;
        }
        *Q = (pkvi_qset){.nq = m, .H = m * hg, .out = out, .slot = slot + start[k],
                         .segs = segs + nseg};
        pkvi_set_runs(geo, layer, b->first, end, end - 1, Q);
        if (m == 1) {
            const pkvi_qpages *p = &b->qp;
            const uint64_t p0 = b->first / bt;
            segs[nseg++] = (pkvi_seg){p->head + p0, p0, p->end, 0, 1, p->last};
            Q->n_segs = 1;
            Q->qg = q + b->slot * qd;
            Q->st = ss[b->slot]->partials;
            continue;
        }
        pkvi_qpages qp[PKVI_BATCH_MAX];
        for (uint32_t i = 0; i < m; i++)
            qp[i] = b[i].qp;
        Q->n_segs = pkvi_segments(qp, m, b->first / bt, bt, segs + nseg);
        nseg += Q->n_segs;
        /* head hh of group gr of query i goes to qg[gr][i * hg + hh] */
        float *qg = sp;
        for (uint32_t gr = 0; gr < g; gr++)
            for (uint32_t i = 0; i < m; i++)
                memcpy(qg + ((size_t)gr * m * hg + (size_t)i * hg) * d,
                       q + b[i].slot * qd + (size_t)gr * hg * d,
                       (size_t)hg * d * sizeof(float));
        Q->qg = qg;
        Q->st = qg + (size_t)g * m * hg * d;
        sp = Q->st + (1 + (size_t)wave) * g * m * hg * (geo->cfg.head_dim_v + 2ull);
    }
    pkvi_run_sets(geo, x, ns, sets, wave);
    if (scratch)
        pkvi_exec_scratch_put(x);
}

/* Decode n queries, one per session, PKVI_BATCH_MAX sessions per run. Every session
 * belongs to the engine whose contexts ctx names; `call` is the public call, for the
 * failure reasons. */
static pkv_status decode_many(const pkvi_ctx *ctx, const char *call, uint32_t layer,
                              uint32_t n, pkv_session *const *sessions, const float *q,
                              float *out)
{
    const pkvi_geom *geo = ctx->geom;
    if (layer >= geo->cfg.n_layers)
        return pkvi_fail(ctx->errs, PKV_EINVAL, "%s: layer %u, but the engine has %u", call,
                         layer, geo->cfg.n_layers);
    if (pkvi_boundary_check(geo, ctx->cache, call) != PKV_OK)
        return PKV_ECORRUPT;
    for (uint32_t i = 0; i < n; i++)
        if (!sessions[i] || !pkvi_session_of(sessions[i], ctx->cache))
            return pkvi_fail(ctx->errs, PKV_EINVAL, "%s: session %u is NULL or of another "
                             "engine", call, i);
    const pkv_status dup = distinct(sessions, n);
    if (dup != PKV_OK)
        return pkvi_fail(ctx->errs, dup, "%s: %s", call,
                         dup == PKV_EINVAL ? "a session is in the batch twice"
                                           : "out of memory (checking for duplicates)");
    for (uint32_t i = 0; i < n; i++) {
        const pkvi_btable *t = sessions[i]->layers[layer];
        if (pkvi_btable_len(t) == pkvi_btable_first(t))
            return pkvi_fail(ctx->errs, PKV_ESTATE, n == 1 ? "%s: layer %u is empty"
                                                           : "%s: layer %u of session %u is empty",
                             call, layer, i);
    }

    const size_t qd = (size_t)geo->cfg.n_heads * geo->cfg.head_dim;
    const size_t od = (size_t)geo->cfg.n_heads * geo->cfg.head_dim_v;
    for (uint32_t i0 = 0; i0 < n; i0 += PKVI_BATCH_MAX) {
        const uint32_t nb = n - i0 < PKVI_BATCH_MAX ? n - i0 : PKVI_BATCH_MAX;
        uint32_t got = 0;
        pkv_status st = PKV_OK;
        for (; got < nb; got++) {
            st = pkvi_session_acquire(sessions[i0 + got], layer, call);
            if (st != PKV_OK)
                break;
        }
        if (st == PKV_OK) {
            if (nb == 1) { /* pkv_decode: no sorting, no scratch */
                pkv_session *s = sessions[i0];
                pkvi_seg seg;
                const pkvi_btable *t = s->layers[layer];
                pkvi_qset Q = one_query(geo, t, layer, pkvi_btable_len(t) - 1, q + i0 * qd,
                                        s->partials, &seg);
                Q.out = out + i0 * od;
                pkvi_run_sets(geo, ctx->exec, 1, &Q, PKVI_MAX_CHUNKS);
            } else {
                run_batch(ctx, layer, nb, sessions + i0, q + i0 * qd, out + i0 * od);
            }
        }
        for (uint32_t k = 0; k < got; k++)
            pkvi_session_release(sessions[i0 + k], layer);
        if (st != PKV_OK)
            return st;
    }
    return PKV_OK;
}

pkv_status pkv_decode(pkv_session *s, uint32_t layer, const float *q, float *out)
{
    if (!s)
        return PKV_EINVAL;
    if (!q || !out)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_decode: %s is NULL", !q ? "q" : "out");
    const pkvi_ctx ctx = {s->geom, s->cache, s->exec, s->errs};
    return decode_many(&ctx, "pkv_decode", layer, 1, &s, q, out);
}

pkv_status pkvi_decode_batch(const pkvi_ctx *ctx, uint32_t layer, uint32_t n,
                             pkv_session *const *sessions, const float *q, float *out)
{
    return decode_many(ctx, "pkv_decode_batch", layer, n, sessions, q, out);
}

/* ---- prefill --------------------------------------------------------------------------- */

/* Most queries in one set: a page's positions, and no more than the kernels' head
 * limit allows; one on a windowed layer (each query's window starts elsewhere). */
static uint32_t tile_max(const pkvi_geom *geo, uint32_t layer)
{
    if (geo->layers[layer].window)
        return 1;
    const uint32_t by_heads = PKVI_MAX_GROUP_HEADS / geo->hg;
    return by_heads < geo->cfg.block_tokens ? by_heads : geo->cfg.block_tokens;
}

/*
 * Reserve, then commit: the scratch, the layer's residency (all of it: attention reads
 * every page) and every page the n rows need are taken first; from then on nothing
 * can fail, so a failed call has changed nothing and needs no undo.
 */
pkv_status pkv_prefill(pkv_session *s, uint32_t layer, uint32_t n, const float *q,
                       const float *k, const float *v, float *out)
{
    if (!s)
        return PKV_EINVAL;
    const pkvi_geom *geo = s->geom;
    if (layer >= geo->cfg.n_layers)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_prefill: layer %u, but the engine has %u",
                         layer, geo->cfg.n_layers);
    if (!q || !k || !v || !out || n == 0)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_prefill: %s",
                         n == 0 ? "n is 0" : "q, k, v or out is NULL");
    if (pkvi_boundary_check(geo, s->cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    const pkvi_btable *t = s->layers[layer];
    if (pkvi_btable_pending(t))
        return pkvi_fail(s->errs, PKV_ESTATE, "pkv_prefill: layer %u has pending drafts "
                         "(pkv_session_commit first)", layer);
    const uint32_t g = geo->cfg.n_kv_heads, d = geo->cfg.head_dim, dv = geo->cfg.head_dim_v;
    const uint32_t hg = geo->hg;
    const uint64_t bt = geo->cfg.block_tokens;
    const size_t qd = (size_t)geo->cfg.n_heads * d, kd = (size_t)g * d, vd = (size_t)g * dv;
    const size_t od = (size_t)geo->cfg.n_heads * dv;
    const uint32_t tmax = tile_max(geo, layer);
    uint64_t end_len;
    if (!pkvi_add(pkvi_btable_len(t), n, &end_len) || end_len > UINT64_MAX - bt)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_prefill: layer %u holds %llu positions; %u "
                         "more overflow a position", layer,
                         (unsigned long long)pkvi_btable_len(t), n);

    /* scratch: the queries by group [g][tmax * hg][d], then [C][g] state blocks */
    const uint64_t C = pkvi_max_chunks(geo, (end_len + bt - 1) / bt);
    const uint64_t H = (uint64_t)tmax * hg;
    uint64_t qfloats, floats, bytes;
    if (!pkvi_mul((uint64_t)g * H, d, &qfloats) || !pkvi_mul(C * g, H * (dv + 2ull), &floats) ||
        !pkvi_add(floats, qfloats, &floats) || !pkvi_mul(floats, sizeof(float), &bytes) ||
        bytes > SIZE_MAX - 63)
        return pkvi_fail(s->errs, PKV_ENOMEM, "pkv_prefill: the scratch of %u queries "
                         "overflows", n);
    bool own = true; /* no block yet: put back is free(NULL) */
    float *qg = pkvi_exec_block_take(s->exec, bytes, &own);
    if (!qg)
        return pkvi_fail(s->errs, PKV_ENOMEM, "pkv_prefill: out of memory (scratch of %llu "
                         "bytes)", (unsigned long long)bytes);
    float *states = qg + qfloats;

    pkv_status st = pkvi_session_acquire(s, layer, "pkv_prefill");
    pkvi_reservation r;
    if (st == PKV_OK) {
        st = pkvi_session_reserve(s, layer, n, &r, "pkv_prefill");
        if (st != PKV_OK)
            pkvi_session_release(s, layer);
    }
    if (st != PKV_OK) {
        pkvi_exec_block_put(s->exec, qg, own);
        return st;
    }
    /* Nothing fails from here on: tiles of queries that land in one page. */
    pkvi_seg segs[PKVI_MAX_GROUP_HEADS + 1];
    for (uint32_t i = 0; i < n;) {
        const uint64_t room = bt - pkvi_btable_len(t) % bt;
        uint32_t nq = n - i < tmax ? n - i : tmax;
        if (nq > room)
            nq = (uint32_t)room;
        pkvi_session_write(s, &r, nq, k + i * kd, v + i * vd);
        /* regroup: head hh of group gr of query j goes to qg[gr][j * hg + hh] */
        for (uint32_t gr = 0; gr < g; gr++)
            for (uint32_t j = 0; j < nq; j++)
                memcpy(qg + ((size_t)gr * nq * hg + (size_t)j * hg) * d,
                       q + (size_t)(i + j) * qd + (size_t)gr * hg * d,
                       (size_t)hg * d * sizeof(float));
        /* the pages before the last for the whole tile, the last for each query */
        const uint64_t len = pkvi_btable_len(t), first = pkvi_btable_first(t);
        const uint64_t P = (len + bt - 1) / bt, fp = first / bt;
        const void *const *data = pkvi_btable_data(t);
        uint32_t ns = 0;
        if (P - 1 > fp)
            segs[ns++] = (pkvi_seg){data + fp, fp, P - 1, 0, nq, (uint32_t)bt};
        for (uint32_t j = 0; j < nq; j++)
            segs[ns++] = (pkvi_seg){data + P - 1, P - 1, P, j, j + 1,
                                    (uint32_t)(len - nq + j - (P - 1) * bt + 1)};
        pkvi_qset set = {.nq = nq, .H = nq * hg, .segs = segs, .n_segs = ns, .qg = qg,
                         .st = states, .out = out + i * od};
        pkvi_set_runs(geo, layer, first, len, len - 1, &set);
        pkvi_run_sets(geo, s->exec, 1, &set, PKVI_MAX_CHUNKS);
        i += nq;
    }
    pkvi_session_finish(s, &r);
    pkvi_session_release(s, layer);
    pkvi_exec_block_put(s->exec, qg, own);
    return PKV_OK;
}

/* ---- shards: partial states and their merge (docs/sharding.md) ------------------------- */

/* pkv_decode_partial_at and pkv_decode_partial (at_last: pos is the layer's last
 * position, whatever it says), `call` naming which for the reasons. */
static pkv_status partial_at(pkv_session *s, const char *call, uint32_t layer, bool at_last,
                             uint64_t pos, const float *q, uint32_t max_chunks, float *states,
                             uint32_t *n_chunks)
{
    if (!s)
        return PKV_EINVAL;
    const pkvi_geom *geo = s->geom;
    if (layer >= geo->cfg.n_layers)
        return pkvi_fail(s->errs, PKV_EINVAL, "%s: layer %u, but the engine has %u", call,
                         layer, geo->cfg.n_layers);
    if (!q || !states || !n_chunks)
        return pkvi_fail(s->errs, PKV_EINVAL, "%s: q, states or n_chunks is NULL", call);
    if (pkvi_boundary_check(geo, s->cache, call) != PKV_OK)
        return PKV_ECORRUPT;
    const pkvi_btable *t = s->layers[layer];
    const uint64_t len = pkvi_btable_len(t);
    if (len == pkvi_btable_first(t))
        return pkvi_fail(s->errs, PKV_ESTATE, "%s: layer %u is empty", call, layer);
    pos = at_last ? len - 1 : pos;
    /* before any arithmetic on pos: a query is at or after the layer's last position,
     * and below UINT64_MAX (no layer reaches it: a length is a uint64) */
    if (pos < len - 1 || pos == UINT64_MAX)
        return pkvi_fail(s->errs, PKV_EINVAL, "%s: position %llu is %s", call,
                         (unsigned long long)pos, pos == UINT64_MAX ? "UINT64_MAX, which no "
                         "layer reaches" : "before the layer's last");
    pkvi_seg seg;
    pkvi_qset Q = one_query(geo, t, layer, pos, q, s->partials, &seg);
    Q.part = states;
    const uint64_t need = Q.C + Q.sigma;
    if (need > max_chunks) {
        *n_chunks = need > UINT32_MAX ? UINT32_MAX : (uint32_t)need;
        return pkvi_fail(s->errs, PKV_ERANGE, "%s: %llu states do not fit max_chunks = %u",
                         call, (unsigned long long)need, max_chunks);
    }
    const pkv_status st = pkvi_session_acquire(s, layer, call);
    if (st != PKV_OK)
        return st;
    /* the pages may have been brought back: the set reads the table's array afresh */
    seg.pages = pkvi_btable_data(t) + seg.p0;
    pkvi_run_sets(geo, s->exec, 1, &Q, PKVI_MAX_CHUNKS);
    pkvi_session_release(s, layer);
    if (Q.sigma) { /* the shard holding position 0 starts with the sink logits */
        const uint32_t h = geo->cfg.n_heads, dv = geo->cfg.head_dim_v;
        for (uint32_t j = 0; j < h; j++) {
            float *o = states + (size_t)j * (dv + 2);
            o[0] = Q.lc->sink_logits[j];
            o[1] = 1.0f;
            memset(o + 2, 0, (size_t)dv * sizeof(float));
        }
    }
    *n_chunks = (uint32_t)need;
    return PKV_OK;
}

pkv_status pkv_decode_partial_at(pkv_session *s, uint32_t layer, uint64_t pos,
                                 const float *q, uint32_t max_chunks, float *states,
                                 uint32_t *n_chunks)
{
    return partial_at(s, "pkv_decode_partial_at", layer, false, pos, q, max_chunks, states,
                      n_chunks);
}

pkv_status pkv_decode_partial(pkv_session *s, uint32_t layer, const float *q,
                              uint32_t max_chunks, float *states, uint32_t *n_chunks)
{
    return partial_at(s, "pkv_decode_partial", layer, true, 0, q, max_chunks, states,
                      n_chunks);
}

pkv_status pkv_partial_chunks(const pkv_session *s, uint32_t layer, uint64_t *out)
{
    if (!s)
        return PKV_EINVAL;
    if (!out || layer >= s->geom->cfg.n_layers)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_partial_chunks: %s",
                         !out ? "out is NULL" : "layer out of range");
    const pkvi_btable *t = s->layers[layer];
    const uint64_t len = pkvi_btable_len(t);
    if (len == pkvi_btable_first(t)) { /* empty: nothing to decode */
        *out = 0;
        return PKV_OK;
    }
    pkvi_qset Q;
    pkvi_set_runs(s->geom, layer, pkvi_btable_first(t), len, len - 1, &Q);
    *out = Q.C + Q.sigma;
    return PKV_OK;
}

/*
 * pipeline.c - the attention pipeline (pipeline.h): query sets cut into split-K tasks
 * over fixed page chunks, run on the executor's threads and merged in a fixed order;
 * the segments that let one kernel call serve every query that reads a page; and the
 * merge of partial states (pkv_merge_partials, pkv_fold_partials).
 *
 * Owns the work decomposition and the merge. Works from the geometry (cache/geom.h)
 * and the executor (attention/exec.h); the per-page arithmetic is the kernel's
 * (kernels/). What a call attends, which pages its queries read and where its scratch
 * lives are its caller's (decode.c: decode, batch, prefill, the shard calls;
 * verify.c: pkv_verify); the caller pins the layers a run reads.
 *
 * Per head the arithmetic is that of a decode of one query: a set of one query, the
 * sessions of a batch that share pages, a prefill tile and a verify tile all give each
 * head the same bits, by construction, not by a second implementation kept in step.
 * A set's segment of queries [q0, q1) goes through the kernel as one group of
 * (q1 - q0) * h/g heads, so each K/V row of it is loaded once for all of them.
 *
 * Determinism (include/pagedkv.h; docs/sharding.md): the chunks are absolute. Chunk c
 * holds the pages [c * chunk_pages, (c + 1) * chunk_pages) of the layer - by position
 * alone, never by the length, the thread count, the batch, the set a query is in or
 * where a shard starts. What a query attends is one or two runs of positions (a
 * window's sinks and its window); a run's chunks are the absolute chunks it meets,
 * clipped to the run. The states of a head are folded one by one in position order
 * into a running state (m, l, acc) that starts empty - or at (sigma, 1, 0), the
 * learned sink logit, which is the fold of that state into the empty one - by one
 * thread, and out = acc / l at the end. A query of a set whose pages end before the
 * set's last chunk gets empty states for the chunks after its own, and folding an
 * empty state changes no bit (fold_state). The kernels are page-local and head-local
 * (kernels.h), so how a chunk's groups are cut into tasks, how many heads share a
 * kernel call and where calls split the pages do not change a bit. So results are
 * bitwise identical for any n_threads; and since a shard boundary (pkv_shard_align) is
 * a chunk boundary, the chunk states of several shards, folded in position order, are
 * the chunk states of the whole.
 *
 * Waves: a decode of any length needs only `wave` chunk states of scratch per set. The
 * chunks are computed a wave at a time (in parallel), then each (query, group) folds
 * that wave's states into its running state. Folding is sequential, so where a wave
 * ends changes nothing either.
 *
 * Work: a task is (set, chunk, block of groups). One block holds every group unless
 * there are too few chunks to keep the threads busy; a task then walks each of its
 * pages front to back across the groups (pages are group-major), which is the stream
 * the hardware prefetcher follows (docs/performance.md, "The read side of one core").
 * Which chunk a task index names is pkvi_chunk_order's: with T threads, consecutive
 * tasks rotate over T regions of the wave, so each thread streams one region of its
 * own.
 *
 * Fold of a state (m', l', acc') into (m, l, acc):
 *     M = max(m, m');  a = exp(m - M);  b = exp(m' - M)
 *     l = l*a + l'*b;  acc = acc*a + acc'*b;  m = M;   finally out = acc / l.
 */
#include "attention/pipeline.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Aim for at least this many tasks per thread when cutting chunks into group blocks. */
#define TASKS_PER_THREAD 4u

/* Floats of one (chunk, group) state block for H heads: m [H], l [H], acc [H][d]. */
static size_t state_floats(uint32_t H, uint32_t d)
{
    return (size_t)H * ((size_t)d + 2);
}

/* Empty states for groups [g0, g0 + ng) of one chunk (blocks of sf floats). */
static void states_clear(float *st, uint32_t ng, size_t sf, uint32_t H, uint32_t d)
{
    for (uint32_t i = 0; i < ng; i++, st += sf) {
        for (uint32_t h = 0; h < H; h++) {
            st[h] = -INFINITY;
            st[H + h] = 0.0f;
        }
        memset(st + 2 * H, 0, (size_t)H * d * sizeof(float));
    }
}

/*
 * Fold the state (mc, lc, ac[d]) into the running state (*m, *l, o[d]): the one
 * definition of the merge, for pkv_decode, prefill and pkv_merge_partials alike, so
 * their results agree to the bit. An empty state (mc = -inf, lc = 0: nothing attended) adds
 * nothing; the sink logit sigma as a first state (sigma, 1, 0) leaves exactly
 * (sigma, 1, 0), which is how the pipeline starts a head that has one.
 */
static inline void fold_state(float *m, float *l, float *restrict o, float mc, float lc,
                              const float *restrict ac, uint32_t d)
{
    if (mc == -INFINITY && lc == 0.0f) /* empty; a NaN l (NaN or inf in q) must not be
                                          taken for empty: it poisons its head only */
        return;
    const float nm = fmaxf(*m, mc);
    const float a = expf(*m - nm), w = expf(mc - nm);
    *l = *l * a + lc * w;
    /* by eight: independent lanes the compiler packs into vector instructions at -O2
     * (the same multiply and add per element, so the same bits as one at a time) */
    uint32_t x = 0;
    for (; x + 8 <= d; x += 8)
        for (uint32_t u = 0; u < 8; u++)
            o[x + u] = o[x + u] * a + ac[x + u] * w;
    for (; x < d; x++)
        o[x] = o[x] * a + ac[x] * w;
    *m = nm;
}

/* fold_state of a chunk state into the empty state (m = -inf, l = 0, o = 0) without
 * reading it, where mc is finite: a = e^-inf = 0 and w = e^0 = 1, so l = 0 * 0 + lc * 1
 * and o = 0 * 0 + ac * 1, which are lc + 0 and ac + 0 (-0 becomes +0): the same bits.
 * False, and nothing written, where mc is not finite (the caller folds). A decode
 * within one chunk (chunk_pages) needs no fold at all; this spares it the zeroing and
 * the fold's multiplies, about half of the merge (docs/performance.md, decision table:
 * first_state). */
static inline bool first_state(float *m, float *l, float *restrict o, float mc, float lc,
                               const float *restrict ac, uint32_t d)
{
    if (!isfinite(mc))
        return false;
    *m = mc;
    *l = lc + 0.0f;
    for (uint32_t x = 0; x < d; x++)
        o[x] = ac[x] + 0.0f;
    return true;
}

/* out[d] = o / l (zeros where nothing was attended: l == 0, only pkv_merge_partials
 * of empty states gets there). */
static void finish_state(float l, const float *o, uint32_t d, float *out)
{
    for (uint32_t x = 0; x < d; x++)
        out[x] = l != 0.0f ? o[x] / l : 0.0f;
}

/*
 * The chunk that a set's t-th chunk task walks when R threads share its C chunks of
 * one wave. The chunks are cut into R contiguous regions and consecutive tasks rotate
 * over them: threads that take tasks in turn from the pool's counter each walk one
 * region front to back, far from the others, instead of all walking neighbouring
 * chunks side by side (docs/performance.md, decision table: pkvi_chunk_order). Any
 * order gives the same bits: each chunk's arithmetic is its own and the fold runs in
 * chunk order.
 */
uint32_t pkvi_chunk_order(uint32_t t, uint32_t C, uint32_t R)
{
    if (R > C)
        R = C;
    if (R <= 1)
        return t;
    const uint32_t q = (C + R - 1) / R;  /* chunks per region; the last may be short */
    const uint32_t nr = (C + q - 1) / q; /* regions used: 2 .. R */
    const uint32_t s = C - (nr - 1) * q; /* chunks of the last region: 1 .. q */
    uint32_t k, r;                       /* the k-th chunk of region r */
    if (t < s * nr) {                    /* rounds in which every region has a chunk */
        k = t / nr;
        r = t % nr;
    } else {                             /* then the last region is done */
        const uint32_t u = t - s * nr;
        k = s + u / (nr - 1);
        r = u % (nr - 1);
    }
    return r * q + k;
}

/* Group blocks per chunk: 1 when `tasks` chunks already give every thread enough to
 * do, else enough blocks for TASKS_PER_THREAD tasks a thread (at most g). */
static uint32_t group_blocks(const pkvi_geom *geo, const pkvi_exec *x, bool parallel,
                             uint64_t tasks)
{
    const uint64_t want = (uint64_t)x->n_threads * TASKS_PER_THREAD;
    if (!parallel || tasks >= want)
        return 1;
    const uint64_t b = (want + tasks - 1) / tasks;
    return b > geo->cfg.n_kv_heads ? geo->cfg.n_kv_heads : (uint32_t)b;
}

/* Groups [*g0, *g0 + *ng) of block b of nb. */
static void block_groups(uint32_t g, uint32_t b, uint32_t nb, uint32_t *g0, uint32_t *ng)
{
    *g0 = (uint32_t)((uint64_t)b * g / nb);
    *ng = (uint32_t)((uint64_t)(b + 1) * g / nb) - *g0;
}

/* ---- segments ------------------------------------------------------------------------ */

/* Page p of query a, and the rows of it that a reads. */
static const void *qpage(const pkvi_qpages *a, uint64_t p)
{
    return p < a->split ? a->head[p] : a->tail[p - a->split];
}

static uint32_t qrows(const pkvi_qpages *a, uint64_t p, uint32_t bt)
{
    return p + 1 == a->end ? a->last : bt;
}

uint64_t pkvi_qpages_common(const pkvi_qpages *a, const pkvi_qpages *b, uint64_t p0,
                            uint32_t bt)
{
    const uint64_t end = a->end < b->end ? a->end : b->end;
    if (end <= p0)
        return p0;
    uint64_t p = p0;
    if (a->head == b->head) { /* one array (one session): the same pages up to both
                                 splits; only the rows of a last page can differ */
        uint64_t s = a->split < b->split ? a->split : b->split;
        if (s > end - 1)
            s = end - 1;
        if (s > p)
            p = s;
    }
    while (p < end && qpage(a, p) == qpage(b, p) && qrows(a, p, bt) == qrows(b, p, bt))
        p++;
    return p;
}

typedef struct {
    const pkvi_qpages *qp;
    const uint64_t *common;  /* [nq - 1]: pkvi_qpages_common of queries i and i + 1 */
    uint32_t bt;
    pkvi_seg *segs;
    uint32_t n;
} seg_builder;

/* Pages [p, L) of queries [q0, q1), read from q0's arrays: one segment per array. */
static void emit(seg_builder *b, uint32_t q0, uint32_t q1, uint64_t p, uint64_t L)
{
    const pkvi_qpages *a = &b->qp[q0];
    if (p < a->split && L > a->split) {
        emit(b, q0, q1, p, a->split);
        p = a->split;
    }
    if (L <= p)
        return;
    pkvi_seg *s = &b->segs[b->n++];
    s->pages = p < a->split ? a->head + p : a->tail + (p - a->split);
    s->p0 = p;
    s->p1 = L;
    s->q0 = q0;
    s->q1 = q1;
    s->last = qrows(a, L - 1, b->bt);
}

/* Queries [q0, q1) share every page before p: their common run from p on, then each
 * part that shares more, recursively (a node of the tree, then its children). */
static void build(seg_builder *b, uint32_t q0, uint32_t q1, uint64_t p)
{
    if (q1 - q0 == 1) {
        emit(b, q0, q1, p, b->qp[q0].end);
        return;
    }
    uint64_t L = UINT64_MAX;
    for (uint32_t i = q0; i + 1 < q1; i++)
        if (b->common[i] < L)
            L = b->common[i];
    emit(b, q0, q1, p, L);
    uint32_t s = q0;
    for (uint32_t i = q0; i + 1 < q1; i++)
        if (b->common[i] == L) {
            build(b, s, i + 1, L);
            s = i + 1;
        }
    build(b, s, q1, L);
}

uint32_t pkvi_segments(const pkvi_qpages *qp, uint32_t nq, uint64_t p0, uint32_t bt,
                       pkvi_seg *segs)
{
    uint64_t common[PKVI_MAX_GROUP_HEADS];
    for (uint32_t i = 0; i + 1 < nq; i++)
        common[i] = pkvi_qpages_common(&qp[i], &qp[i + 1], p0, bt);
    seg_builder b = {qp, common, bt, segs, 0};
    build(&b, 0, nq, p0);
    return b.n;
}

/* ---- the pipeline ------------------------------------------------------------------ */

typedef struct {
    const pkvi_geom *geo;
    pkvi_exec *x;
    uint32_t n, blocks;               /* sets; group blocks per chunk */
    uint32_t regions;                 /* pkvi_chunk_order's R: threads sharing the run */
    uint32_t wave;                    /* chunks of a set per wave */
    uint64_t w0;                      /* first chunk of the wave, in every set */
    const pkvi_qset *sets;            /* [n] */
    uint32_t base[PKVI_BATCH_MAX + 1];  /* first chunk task of each set */
    uint32_t mbase[PKVI_BATCH_MAX + 1]; /* first merge task of each set */
} pipeline;

/* Chunks of set Q in the wave from chunk w0 on. */
static uint32_t wave_chunks(const pkvi_qset *Q, uint64_t w0, uint32_t wave)
{
    if (Q->C <= w0)
        return 0;
    return Q->C - w0 < wave ? (uint32_t)(Q->C - w0) : wave;
}

/* Which set a task index belongs to (n <= PKVI_BATCH_MAX: a linear scan). */
static uint32_t set_of(const uint32_t *base, uint32_t task)
{
    uint32_t i = 0;
    while (task >= base[i + 1])
        i++;
    return i;
}

/* Fold one chunk of one block of groups of one set into its partial states: each
 * segment's pages in the chunk, for all the heads of its queries at once. */
static void chunk_task(void *ctx, uint32_t task)
{
    const pipeline *j = ctx;
    const pkvi_geom *geo = j->geo;
    const uint32_t i = set_of(j->base, task);
    const pkvi_qset *Q = &j->sets[i];
    const uint32_t g = geo->cfg.n_kv_heads, d = geo->cfg.head_dim, dv = geo->cfg.head_dim_v;
    const uint32_t hg = geo->hg, H = Q->H;
    const uint64_t bt = geo->cfg.block_tokens, cp = geo->chunk_pages;
    /* task layout inside a set: chunk-major, group-block-minor */
    const uint32_t t = task - j->base[i];
    const uint32_t slot =
        pkvi_chunk_order(t / j->blocks, wave_chunks(Q, j->w0, j->wave), j->regions);
    uint32_t g0, ng;
    block_groups(g, t % j->blocks, j->blocks, &g0, &ng);
    /* the run the chunk belongs to, and its pages [first, end): the absolute chunk
     * clipped to the run */
    uint32_t r = 0;
    uint64_t k = j->w0 + slot;
    while (k >= Q->runs[r].C)
        k -= Q->runs[r++].C;
    const pkvi_run *R = &Q->runs[r];
    const uint64_t r_first = R->p0 / bt, r_end = (R->p1 + bt - 1) / bt;
    const uint64_t c = R->c0 + k;
    uint64_t first = c * cp, end = (c + 1) * cp;
    if (first < r_first)
        first = r_first;
    if (end > r_end)
        end = r_end;
    const uint32_t row0 = first == r_first ? (uint32_t)(R->p0 % bt) : 0;
    const uint32_t r_last = (uint32_t)(R->p1 - (r_end - 1) * bt);

    const size_t sf = state_floats(H, dv);
    float *st = Q->st + ((size_t)(1 + slot) * g + g0) * sf;
    states_clear(st, ng, sf, H, dv);
    pkvi_kparams kp = geo->kp;
    kp.softcap = Q->lc->softcap;
    uint64_t shared = 0, priv = 0, saved = 0;
    for (uint32_t si = 0; si < Q->n_segs; si++) {
        const pkvi_seg *S = &Q->segs[si];
        uint64_t a = S->p0 > first ? S->p0 : first;
        const uint64_t b = S->p1 < end ? S->p1 : end;
        if (a >= b)
            continue;
        const uint32_t nqs = S->q1 - S->q0;
        kp.hg = nqs * hg;
        const pkvi_heads x = {
            .q = Q->qg + ((size_t)g0 * H + (size_t)S->q0 * hg) * d,
            .m = st + (size_t)S->q0 * hg,
            .l = st + H + (size_t)S->q0 * hg,
            .acc = st + 2 * (size_t)H + (size_t)S->q0 * hg * dv,
            .q_stride = (size_t)H * d,
            .st_stride = sf,
        };
        uint32_t last = b == S->p1 ? S->last : (uint32_t)bt;
        if (b == r_end && r_last < last)
            last = r_last;
        if (nqs > 1) {
            shared += b - a;
            saved += (b - a) * (nqs - 1);
        } else {
            priv += b - a;
        }
        const void *const *pages = S->pages + (a - S->p0);
        if (a == first && row0) { /* a window starting inside its first page: that page
                                   * alone, its rows from row0 on (K and V bases moved
                                   * by row0 rows) */
            pkvi_kparams k1 = kp;
            k1.v_offset =
                (size_t)(bt - row0) * geo->row_bytes + (size_t)row0 * geo->row_bytes_v;
            const void *one = (const char *)pages[0] + (size_t)row0 * geo->row_bytes;
            geo->kern->attend(&k1, &one, 1, (b == a + 1 ? last : (uint32_t)bt) - row0, g0,
                              ng, &x);
            a++;
            pages++;
        }
        if (b > a)
            geo->kern->attend(&kp, pages, (uint32_t)(b - a), last, g0, ng, &x);
    }
    if (g0 == 0) /* a page counts once, however many group blocks read it */
        pkvi_exec_count(j->x, shared, priv, saved);
}

/* Fold this wave's chunk states of one (set, query, group) in chunk order into its
 * running states; after the set's last wave, write out = acc / l. pkv_decode_partial
 * (out NULL) copies the wave's states to the caller's [chunk][head][dv + 2] instead. */
static void merge_task(void *ctx, uint32_t task)
{
    const pipeline *j = ctx;
    const pkvi_geom *geo = j->geo;
    const uint32_t g = geo->cfg.n_kv_heads, dv = geo->cfg.head_dim_v, hg = geo->hg;
    const uint32_t i = set_of(j->mbase, task);
    const pkvi_qset *Q = &j->sets[i];
    const uint32_t t = task - j->mbase[i], q = t / g, group = t % g;
    const uint32_t H = Q->H, nc = wave_chunks(Q, j->w0, j->wave);
    const size_t sf = state_floats(H, dv), cs = (size_t)g * sf;
    const float *wave = Q->st + cs + (size_t)group * sf;
    if (!Q->out) {
        const size_t hs = (size_t)dv + 2, ps = (size_t)geo->cfg.n_heads * hs;
        float *dst = Q->part + (j->w0 + Q->sigma) * ps + (size_t)group * hg * hs;
        for (uint32_t c = 0; c < nc; c++, dst += ps) {
            const float *b = wave + c * cs;
            for (uint32_t h = 0; h < hg; h++) {
                float *o = dst + h * hs;
                o[0] = b[h];
                o[1] = b[H + h];
                memcpy(o + 2, b + 2 * (size_t)H + (size_t)h * dv, (size_t)dv * sizeof(float));
            }
        }
        return;
    }
    float *run_st = Q->st + (size_t)group * sf;
    const float *sigma = Q->sigma ? Q->lc->sink_logits + (size_t)group * hg : NULL;
    float *out = Q->out + (size_t)(Q->slot ? Q->slot[q] : q) * geo->cfg.n_heads * dv +
                 (size_t)group * hg * dv;
    for (uint32_t jh = q * hg; jh < (q + 1) * hg; jh++) {
        float *m = run_st + jh, *l = run_st + H + jh;
        float *o = run_st + 2 * (size_t)H + (size_t)jh * dv;
        uint32_t c = 0;
        if (j->w0 == 0) { /* the first wave: chunk 0's state where first_state can take
                             it, else the empty state, or the sink logit's */
            const float *ac0 = wave + 2 * (size_t)H + (size_t)jh * dv;
            if (!sigma && nc > 0 && first_state(m, l, o, wave[jh], wave[H + jh], ac0, dv))
                c = 1;
            else {
                *m = sigma ? sigma[jh - q * hg] : -INFINITY;
                *l = sigma ? 1.0f : 0.0f;
                memset(o, 0, (size_t)dv * sizeof(float));
            }
        }
        for (; c < nc; c++) {
            const float *b = wave + c * cs;
            fold_state(m, l, o, b[jh], b[H + jh], b + 2 * (size_t)H + (size_t)jh * dv, dv);
        }
        if (j->w0 + nc == Q->C)
            finish_state(*l, o, dv, out + (size_t)(jh - q * hg) * dv);
    }
}

void pkvi_run_sets(const pkvi_geom *geo, pkvi_exec *x, uint32_t n, const pkvi_qset *sets,
                   uint32_t wave)
{
    pipeline j;
    j.geo = geo;
    j.x = x;
    j.n = n;
    j.sets = sets;
    j.wave = wave;
    /* work ~ K/V values x queries, counted as f16 bytes (2 a value), the unit the split
     * thresholds were measured in: in cache, where they matter, a decode costs its
     * arithmetic, which follows values, not stored bytes (Q4 has a quarter of f16's
     * bytes and more work per value). In double: only a threshold, it cannot wrap. */
    double bytes = 0;
    const double value_bytes = 2.0 * ((double)geo->cfg.head_dim + (double)PKVI_DV(&geo->kp));
    uint64_t waves_end = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (sets[i].C > waves_end)
            waves_end = sets[i].C;
        uint64_t attended = 0;
        for (uint32_t r = 0; r < sets[i].n_runs; r++)
            attended += sets[i].runs[r].p1 - sets[i].runs[r].p0;
        bytes += (double)attended * geo->cfg.n_kv_heads * value_bytes * sets[i].nq;
    }
    const bool parallel = pkvi_exec_parallel(x, bytes);
    pkvi_threads *pool = parallel ? x->threads : NULL;
    j.regions = parallel ? x->n_threads : 1;
    for (j.w0 = 0; j.w0 < waves_end; j.w0 += wave) {
        uint64_t chunks = 0;
        for (uint32_t i = 0; i < n; i++)
            chunks += wave_chunks(&sets[i], j.w0, wave);
        j.blocks = group_blocks(geo, x, parallel, chunks);
        j.base[0] = j.mbase[0] = 0;
        for (uint32_t i = 0; i < n; i++) {
            const uint32_t nc = wave_chunks(&sets[i], j.w0, wave);
            j.base[i + 1] = j.base[i] + nc * j.blocks;
            j.mbase[i + 1] = j.mbase[i] + (nc ? sets[i].nq * geo->cfg.n_kv_heads : 0);
        }
        pkvi_threads_run(pool, j.base[n], chunk_task, &j);
        pkvi_threads_run(pool, j.mbase[n], merge_task, &j);
    }
    pkvi_threads_call_done(x->threads);
}

uint32_t pkvi_wave_for(const pkvi_geom *geo, uint64_t H, uint64_t floats)
{
    const uint64_t per = (uint64_t)geo->cfg.n_kv_heads * H * (geo->cfg.head_dim_v + 2ull);
    const uint64_t w = per ? floats / per : 0;
    if (w <= 1)
        return 1;
    return w - 1 < PKVI_MAX_CHUNKS ? (uint32_t)(w - 1) : PKVI_MAX_CHUNKS;
}

/* A run of positions [p0, p1) and the absolute chunks it meets. */
static pkvi_run make_run(const pkvi_geom *geo, uint64_t p0, uint64_t p1)
{
    const uint64_t bt = geo->cfg.block_tokens, cp = geo->chunk_pages;
    pkvi_run r = {p0, p1, 0, 0};
    if (p1 > p0) {
        r.c0 = p0 / bt / cp;
        r.C = (p1 - 1) / bt / cp - r.c0 + 1;
    }
    return r;
}

void pkvi_set_runs(const pkvi_geom *geo, uint32_t layer, uint64_t first, uint64_t end,
                   uint64_t pos, pkvi_qset *Q)
{
    const pkv_layer_config *lc = &geo->layers[layer];
    Q->lc = lc;
    Q->sigma = lc->sink_logits && first == 0;
    Q->n_runs = 0;
    Q->C = 0;
    if (lc->window) { /* the sink run [first, min(sinks, lo)) and the window run
                         [max(lo, first), end), lo = pos + 1 - window */
        const uint64_t lo = pkvi_window_lo(lc, pos);
        const uint64_t sink_end = lc->sink_tokens < lo ? lc->sink_tokens : lo;
        const uint64_t w_lo = lo > first ? lo : first;
        if (sink_end > first)
            Q->runs[Q->n_runs++] = make_run(geo, first, sink_end);
        if (end > w_lo)
            Q->runs[Q->n_runs++] = make_run(geo, w_lo, end);
    } else {
        Q->runs[Q->n_runs++] = make_run(geo, first, end);
    }
    for (uint32_t r = 0; r < Q->n_runs; r++)
        Q->C += Q->runs[r].C;
}

/* ---- the merge of partial states (docs/sharding.md) ---------------------------------- */

/* Fold head j of n states [n][h][dv + 2] in order from the empty state into (*m, *l,
 * o[dv]). */
static void fold_head(const pkvi_geom *geo, uint32_t n_chunks, const float *states,
                      uint32_t j, float *m, float *l, float *o)
{
    const uint32_t h = geo->cfg.n_heads, dv = geo->cfg.head_dim_v;
    const size_t hs = (size_t)dv + 2, ps = (size_t)h * hs;
    *m = -INFINITY;
    *l = 0.0f;
    memset(o, 0, (size_t)dv * sizeof(float));
    for (uint32_t c = 0; c < n_chunks; c++) {
        const float *b = states + c * ps + j * hs;
        fold_state(m, l, o, b[0], b[1], b + 2, dv);
    }
}

pkv_status pkvi_merge_partials(const pkvi_geom *geo, uint32_t n_chunks, const float *states,
                               float *out)
{
    const uint32_t h = geo->cfg.n_heads, dv = geo->cfg.head_dim_v;
    for (uint32_t j = 0; j < h; j++) {
        float m, l, *o = out + (size_t)j * dv;
        fold_head(geo, n_chunks, states, j, &m, &l, o);
        finish_state(l, o, dv, o);
    }
    return PKV_OK;
}

pkv_status pkvi_fold_partials(const pkvi_geom *geo, uint32_t n_chunks, const float *states,
                              float *state_out)
{
    const uint32_t h = geo->cfg.n_heads;
    const size_t hs = (size_t)geo->cfg.head_dim_v + 2;
    /* into a copy first: state_out may be one of the states */
    float *tmp = malloc((size_t)h * hs * sizeof(float));
    if (!tmp)
        return PKV_ENOMEM;
    for (uint32_t j = 0; j < h; j++)
        fold_head(geo, n_chunks, states, j, tmp + j * hs, tmp + j * hs + 1, tmp + j * hs + 2);
    memcpy(state_out, tmp, (size_t)h * hs * sizeof(float));
    free(tmp);
    return PKV_OK;
}

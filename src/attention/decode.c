/*
 * decode.c - the attention pipeline: pkv_decode, pkv_decode_batch, pkv_prefill and
 * the shard calls pkv_decode_partial / pkv_merge_partials (docs/sharding.md) as one
 * pipeline of split-K tasks over fixed page chunks, run on the engine's threads and
 * merged in a fixed order.
 *
 * Owns the work decomposition and the merge. Works from the narrow contexts a session
 * carries (session.h): the geometry (cache/geom.h), the executor (attention/exec.h)
 * and the error sink; the calls that take an engine handle reach it through engine.c.
 * The per-page arithmetic is the kernel's (kernels/); residency and the reservation a
 * prefill writes through are session/residency.c's and session/write.c's; a layer's
 * page data is read through btable.c's array, once per query set, while the layer is
 * pinned.
 *
 * One pipeline. Its unit is a query set: nq consecutive queries of one session, at
 * the layer's last nq positions, all in its last page. A decode is a set of one
 * query; a batch is n such sets; a prefill is a set per page-sized tile of queries.
 * A set's H = nq * hg heads of a group go through the kernel as one group of H heads
 * (each K/V row is loaded once for all of them), except on the last page, where query
 * j sees only its first positions and runs alone. Per head the arithmetic is that of a
 * decode of one query: single, batched and prefill results are the same bits by
 * construction, not by a second implementation kept in step.
 *
 * Determinism (include/pagedkv.h; docs/sharding.md): the chunks are absolute. Chunk c
 * holds the pages [c * chunk_pages, (c + 1) * chunk_pages) of the layer - by position
 * alone, never by the length, the thread count, the batch or where a shard starts. What
 * a query attends is one or two runs of positions (a window's sinks and its window); a
 * run's chunks are the absolute chunks it meets, clipped to the run. The states of a
 * head are folded one by one in position order into a running state (m, l, acc) that
 * starts empty - or at (sigma, 1, 0), the learned sink logit, which is the fold of that
 * state into the empty one - by one thread, and out = acc / l at the end. The kernels
 * are page-local and head-local (kernels.h), so how a chunk's groups are cut into
 * tasks, how many heads share a kernel call and where calls split the pages do not
 * change a bit. So results are bitwise identical for any n_threads; and since a shard
 * boundary (pkv_shard_align) is a chunk boundary, the chunk states of several shards,
 * folded in position order, are the chunk states of the whole.
 *
 * Waves: a decode of any length needs only PKVI_MAX_CHUNKS chunk states of scratch.
 * The chunks are computed PKVI_MAX_CHUNKS at a time (a wave, in parallel), then each
 * (query, group) folds that wave's states into its running state. Folding is
 * sequential, so where a wave ends changes nothing either.
 *
 * Work: a task is (set, chunk, block of groups). One block holds every group unless
 * there are too few chunks to keep the threads busy; a task then walks each of its
 * pages front to back across the groups (pages are group-major), which is the stream
 * the hardware prefetcher follows (docs/performance.md, "The read side of one core").
 * Which chunk a
 * task index names is pkvi_chunk_order's: with T threads, consecutive tasks rotate over
 * T regions of the wave, so each thread streams one region of its own.
 *
 * Fold of a state (m', l', acc') into (m, l, acc):
 *     M = max(m, m');  a = exp(m - M);  b = exp(m' - M)
 *     l = l*a + l'*b;  acc = acc*a + acc'*b;  m = M;   finally out = acc / l.
 */
#include "attention/decode.h"
#include "attention/exec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Sessions per pool run in a batch (bounds the stack tables below). */
#define BATCH_MAX 64u
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

/* ---- the pipeline ------------------------------------------------------------------ */

/* Attended positions [p0, p1); the absolute chunks it meets are [c0, c0 + C). */
typedef struct {
    uint64_t p0, p1;
    uint64_t c0, C;
} run;

/* nq queries of one session at the layer's last nq positions, all in its last page
 * (or, for pkv_decode_partial_at, one query at a later position). What they attend is
 * one run [first, len) - or, on a windowed layer (then nq == 1), the sink run
 * [first, min(sinks, lo)) and the window run [max(lo, first), len), lo = pos + 1 -
 * window; first is a shard's first position (0 for a whole session). */
typedef struct {
    const void *const *data;          /* the layer's page data (btable.c's array; the
                                         layer pinned on spill engines) */
    const pkv_layer_config *lc;       /* its variant */
    uint64_t len;                     /* positions the last query sees */
    uint64_t P;                       /* pages of the layer: ceil(len / bt) */
    uint32_t nq, H;                   /* queries; heads per group, nq * hg */
    run runs[2];                      /* in position order */
    uint32_t n_runs;
    uint64_t C;                       /* chunks of all runs */
    bool sigma;                       /* starts from the layer's sink logits */
    const float *qg;                  /* [g][H][dk] the queries, by group */
    float *st;                        /* [1 + a wave's chunks][g] state blocks of H
                                         heads: the running states, then the wave's */
    float *out;                       /* [nq][h][dv]; NULL: copy states to `part` */
    float *part;                      /* pkv_decode_partial: [C][h][dv + 2] */
} qset;

typedef struct {
    const pkvi_geom *geo;
    uint32_t n, blocks;               /* sets; group blocks per chunk */
    uint32_t regions;                 /* pkvi_chunk_order's R: threads sharing the run */
    uint64_t w0;                      /* first chunk of the wave, in every set */
    const qset *sets;                 /* [n] */
    uint32_t base[BATCH_MAX + 1];     /* first chunk task of each set */
    uint32_t mbase[BATCH_MAX + 1];    /* first merge task of each set */
} pipeline;

/* Chunks of set Q in the wave from chunk w0 on. */
static uint32_t wave_chunks(const qset *Q, uint64_t w0)
{
    if (Q->C <= w0)
        return 0;
    return Q->C - w0 < PKVI_MAX_CHUNKS ? (uint32_t)(Q->C - w0) : PKVI_MAX_CHUNKS;
}

/* Which set a task index belongs to (n <= BATCH_MAX: a linear scan). */
static uint32_t set_of(const uint32_t *base, uint32_t task)
{
    uint32_t i = 0;
    while (task >= base[i + 1])
        i++;
    return i;
}

/* Fold one chunk of one block of groups of one set into its partial states. */
static void chunk_task(void *ctx, uint32_t task)
{
    const pipeline *j = ctx;
    const pkvi_geom *geo = j->geo;
    const uint32_t i = set_of(j->base, task);
    const qset *Q = &j->sets[i];
    const uint32_t g = geo->cfg.n_kv_heads, d = geo->cfg.head_dim, dv = geo->cfg.head_dim_v;
    const uint32_t hg = geo->hg, H = Q->H;
    const uint64_t bt = geo->cfg.block_tokens, cp = geo->chunk_pages;
    /* task layout inside a set: chunk-major, group-block-minor */
    const uint32_t t = task - j->base[i];
    const uint32_t slot = pkvi_chunk_order(t / j->blocks, wave_chunks(Q, j->w0), j->regions);
    uint32_t g0, ng;
    block_groups(g, t % j->blocks, j->blocks, &g0, &ng);
    /* the run the chunk belongs to, and its pages [first, end): the absolute chunk
     * clipped to the run */
    uint32_t r = 0;
    uint64_t k = j->w0 + slot;
    while (k >= Q->runs[r].C)
        k -= Q->runs[r++].C;
    const run *R = &Q->runs[r];
    const uint64_t r_first = R->p0 / bt, r_end = (R->p1 + bt - 1) / bt;
    const uint64_t c = R->c0 + k;
    uint64_t first = c * cp, end = (c + 1) * cp;
    if (first < r_first)
        first = r_first;
    if (end > r_end)
        end = r_end;
    const uint32_t row0 = first == r_first ? (uint32_t)(R->p0 % bt) : 0;
    const uint32_t last = end == r_end ? (uint32_t)(R->p1 - (r_end - 1) * bt) : (uint32_t)bt;
    const void *const *data = Q->data;

    const size_t sf = state_floats(H, dv);
    float *st = Q->st + ((size_t)(1 + slot) * g + g0) * sf;
    states_clear(st, ng, sf, H, dv);
    pkvi_kparams kp = geo->kp;
    kp.hg = H;
    kp.softcap = Q->lc->softcap;
    const pkvi_heads x = {
        .q = Q->qg + (size_t)g0 * H * d, .m = st, .l = st + H, .acc = st + 2 * (size_t)H,
        .q_stride = (size_t)H * d, .st_stride = sf,
    };
    if (Q->nq == 1) { /* a decode: the last page is one more page of the walk */
        if (row0) { /* a window starting inside its first page: that page alone, its
                     * rows from row0 on (K and V bases moved by row0 rows) */
            pkvi_kparams k1 = kp;
            k1.v_offset =
                (size_t)(bt - row0) * geo->row_bytes + (size_t)row0 * geo->row_bytes_v;
            const void *one = (const char *)data[first] + (size_t)row0 * geo->row_bytes;
            geo->kern->attend(&k1, &one, 1, (end == first + 1 ? last : (uint32_t)bt) - row0, g0,
                            ng, &x);
            first++;
        }
        if (end > first)
            geo->kern->attend(&kp, data + first, (uint32_t)(end - first), last, g0, ng, &x);
        return;
    }
    /* several queries (never windowed): all but the last page for all of them at once */
    const uint64_t P = Q->P;
    const uint64_t full_end = end == P ? P - 1 : end;
    if (full_end > first)
        geo->kern->attend(&kp, data + first, (uint32_t)(full_end - first), (uint32_t)bt, g0,
                        ng, &x);
    if (end == P) { /* the last page: each query up to and including its own position */
        pkvi_kparams k1 = kp;
        k1.hg = hg;
        for (uint32_t q = 0; q < Q->nq; q++) {
            const uint64_t pos = Q->len - Q->nq + q;
            const pkvi_heads xq = {
                .q = x.q + (size_t)q * hg * d, .m = x.m + (size_t)q * hg,
                .l = x.l + (size_t)q * hg, .acc = x.acc + (size_t)q * hg * dv,
                .q_stride = x.q_stride, .st_stride = sf,
            };
            geo->kern->attend(&k1, data + P - 1, 1, (uint32_t)(pos - (P - 1) * bt + 1), g0,
                            ng, &xq);
        }
    }
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
    const qset *Q = &j->sets[i];
    const uint32_t t = task - j->mbase[i], q = t / g, group = t % g;
    const uint32_t H = Q->H, nc = wave_chunks(Q, j->w0);
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
            finish_state(*l, o, dv,
                         Q->out + (size_t)q * geo->cfg.n_heads * dv +
                             ((size_t)group * hg + (jh - q * hg)) * dv);
    }
}

/* Run n <= BATCH_MAX query sets (their layers resident and pinned) to their outputs,
 * a wave of chunks at a time. */
static void run_sets(const pkvi_geom *geo, pkvi_exec *x, uint32_t n, const qset *sets)
{
    pipeline j;
    j.geo = geo;
    j.n = n;
    j.sets = sets;
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
    for (j.w0 = 0; j.w0 < waves_end; j.w0 += PKVI_MAX_CHUNKS) {
        uint64_t chunks = 0;
        for (uint32_t i = 0; i < n; i++)
            chunks += wave_chunks(&sets[i], j.w0);
        j.blocks = group_blocks(geo, x, parallel, chunks);
        j.base[0] = j.mbase[0] = 0;
        for (uint32_t i = 0; i < n; i++) {
            const uint32_t nc = wave_chunks(&sets[i], j.w0);
            j.base[i + 1] = j.base[i] + nc * j.blocks;
            j.mbase[i + 1] = j.mbase[i] + (nc ? sets[i].nq * geo->cfg.n_kv_heads : 0);
        }
        pkvi_threads_run(pool, j.base[n], chunk_task, &j);
        pkvi_threads_run(pool, j.mbase[n], merge_task, &j);
    }
    pkvi_threads_call_done(x->threads);
}

/* A run of positions [p0, p1) and the absolute chunks it meets. */
static run make_run(const pkvi_geom *geo, uint64_t p0, uint64_t p1)
{
    const uint64_t bt = geo->cfg.block_tokens, cp = geo->chunk_pages;
    run r = {p0, p1, 0, 0};
    if (p1 > p0) {
        r.c0 = p0 / bt / cp;
        r.C = (p1 - 1) / bt / cp - r.c0 + 1;
    }
    return r;
}

/* The set of the last nq positions of `layer` (all in its last page; nq == 1 on a
 * windowed layer), for a query at position pos (len - 1, or later for a shard that
 * holds earlier positions: pkv_decode_partial_at). */
static qset last_queries(const pkvi_geom *geo, const pkvi_btable *t, uint32_t layer,
                         uint32_t nq, uint64_t pos, const float *qg, float *st, float *out)
{
    const uint64_t bt = geo->cfg.block_tokens, len = pkvi_btable_len(t);
    const uint64_t P = (len + bt - 1) / bt, first = pkvi_btable_first(t);
    const pkv_layer_config *lc = &geo->layers[layer];
    qset Q = {.data = pkvi_btable_data(t), .lc = lc, .len = len, .P = P, .nq = nq,
              .H = nq * geo->hg, .sigma = lc->sink_logits && first == 0, .qg = qg,
              .st = st, .out = out};
    if (lc->window) {
        const uint64_t lo = pkvi_window_lo(lc, pos);
        const uint64_t sink_end = lc->sink_tokens < lo ? lc->sink_tokens : lo;
        const uint64_t w_lo = lo > first ? lo : first;
        if (sink_end > first)
            Q.runs[Q.n_runs++] = make_run(geo, first, sink_end);
        if (len > w_lo)
            Q.runs[Q.n_runs++] = make_run(geo, w_lo, len);
    } else {
        Q.runs[Q.n_runs++] = make_run(geo, first, len);
    }
    for (uint32_t r = 0; r < Q.n_runs; r++)
        Q.C += Q.runs[r].C;
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
    if (n <= BATCH_MAX) {
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

/* Decode n queries, one per session: n sets of one query, BATCH_MAX per run. Every
 * session belongs to the engine whose contexts ctx names; `call` is the public call,
 * for the failure reasons. */
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
    qset sets[BATCH_MAX];
    for (uint32_t i0 = 0; i0 < n; i0 += BATCH_MAX) {
        const uint32_t nb = n - i0 < BATCH_MAX ? n - i0 : BATCH_MAX;
        uint32_t got = 0;
        pkv_status st = PKV_OK;
        for (; got < nb; got++) {
            st = pkvi_session_acquire(sessions[i0 + got], layer, call);
            if (st != PKV_OK)
                break;
        }
        if (st == PKV_OK) {
            for (uint32_t i = 0; i < nb; i++) {
                pkv_session *s = sessions[i0 + i];
                const pkvi_btable *t = s->layers[layer];
                sets[i] = last_queries(geo, t, layer, 1, pkvi_btable_len(t) - 1,
                                       q + (i0 + i) * qd, s->partials, out + (i0 + i) * od);
            }
            run_sets(geo, ctx->exec, nb, sets);
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
    float *qg = aligned_alloc(PKVI_PAGE_ALIGN, (size_t)((bytes + 63) & ~63ull));
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
        free(qg);
        return st;
    }
    /* Nothing fails from here on: tiles of queries that land in one page. */
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
        const qset set = last_queries(geo, t, layer, nq, pkvi_btable_len(t) - 1, qg, states,
                                      out + i * od);
        run_sets(geo, s->exec, 1, &set);
        i += nq;
    }
    pkvi_session_finish(s, &r);
    pkvi_session_release(s, layer);
    free(qg);
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
    qset Q = last_queries(geo, t, layer, 1, pos, q, s->partials, NULL);
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
    Q.data = pkvi_btable_data(t);
    run_sets(geo, s->exec, 1, &Q);
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
    const qset Q = last_queries(s->geom, t, layer, 1, len - 1, NULL, NULL, NULL);
    *out = Q.C + Q.sigma;
    return PKV_OK;
}

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

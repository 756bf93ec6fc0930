/*
 * decode.c - the attention pipeline: pkv_decode, pkv_decode_batch and pkv_prefill as
 * one pipeline of split-K tasks over fixed page chunks, run on the engine's threads
 * and merged in a fixed order.
 *
 * Owns the work decomposition and the merge. The per-page arithmetic is the kernel's
 * (kernels/); residency and the reservation a prefill writes through are session.c's.
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
 * Determinism (SPEC §2): a layer of P pages is split into
 *     C = min(PKVI_MAX_CHUNKS, ceil(P / chunk_pages))
 * chunks, chunk k holding pages [floor(k*P/C), floor((k+1)*P/C)). C and the ranges
 * depend only on P and the engine's fixed chunk_pages - never on the thread count or on
 * the batch - and the partial states of a head are merged in chunk order 0..C-1 by one
 * thread. The kernels are page-local and head-local (kernels.h), so how a chunk's
 * groups are cut into tasks, how many heads share a kernel call and where calls split
 * the pages do not change a bit. So results are bitwise identical for any n_threads.
 *
 * Work: a task is (set, chunk, block of groups). One block holds every group unless
 * there are too few chunks to keep the threads busy; a task then walks each of its
 * pages front to back across the groups (pages are group-major), which is the stream
 * the hardware prefetcher follows (docs/numerics.md, "Performance"). Which chunk a
 * task index names is pkvi_chunk_order's: with T threads, consecutive tasks rotate over
 * T regions of the layer, so each thread streams one region of its own.
 *
 * Merge of two states (m, l, acc) and (m', l', acc'):
 *     M = max(m, m');  a = exp(m - M);  b = exp(m' - M)
 *     l = l*a + l'*b;  acc = acc*a + acc'*b;   finally out = acc / l.
 */
#include "decode.h"
#include "session.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Whether a call over `bytes` of K/V (times queries) goes to the engine's threads. */
static bool go_parallel(const pkv_engine *e, double bytes)
{
    return pkvi_threads_split(e->threads, bytes, e->split_awake, e->split_asleep);
}
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
 * out[j][d] for heads j0 .. j0 + nh of a group: merge chunk states 0..C-1 in order.
 * The group's state of chunk c is at st + c * chunk_stride, holding H heads. Decode
 * and prefill both merge through here, so their results agree to the bit. A learned
 * sink logit sigma[j - j0] (SPEC §8; sigma NULL: none) is the state (sigma, 1, 0)
 * folded first: it joins the denominator and adds nothing to the sum.
 */
static void merge_heads(const float *st, size_t chunk_stride, uint32_t C, uint32_t H,
                        uint32_t j0, uint32_t nh, uint32_t d, const float *sigma,
                        float *out)
{
    for (uint32_t j = j0; j < j0 + nh; j++) {
        float M = sigma ? sigma[j - j0] : -INFINITY, Lsum = sigma ? 1.0f : 0.0f;
        float *o = out + (size_t)(j - j0) * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (uint32_t c = 0; c < C; c++) {
            const float *b = st + c * chunk_stride;
            const float mc = b[j], lc = b[H + j];
            const float *ac = b + 2 * (size_t)H + (size_t)j * d;
            const float nm = fmaxf(M, mc);
            const float a = expf(M - nm), w = expf(mc - nm);
            Lsum = Lsum * a + lc * w;
            for (uint32_t x = 0; x < d; x++)
                o[x] = o[x] * a + ac[x] * w;
            M = nm;
        }
        for (uint32_t x = 0; x < d; x++)
            o[x] /= Lsum;
    }
}

/*
 * The chunk that a session's t-th chunk task walks when R threads share its C chunks.
 * The chunks are cut into R contiguous regions and consecutive tasks rotate over them:
 * threads that take tasks in turn from the pool's counter each walk one region front
 * to back, far from the others, instead of all walking neighbouring chunks side by
 * side. Measured on the Zen 5 dev VM (128k tokens of a llama3-8b f16 layer, 2 threads,
 * in-process A/B against chunks in order): 35-37 -> 57-59 GB/s, 0.68-0.71 -> 1.01-1.05
 * of the same rounds' DRAM sum; one thread walking the rotated order lost nothing
 * (docs/numerics.md, "What moved the figures"). Any order gives the same bits: each
 * chunk's arithmetic is its own and the merge runs in chunk order.
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

/* Pages [first, end) of chunk k of C over P pages. */
static void chunk_range(uint64_t P, uint32_t C, uint32_t k, uint64_t *first, uint64_t *end)
{
    *first = k * P / C;
    *end = (k + 1) * P / C;
}

/* Group blocks per chunk: 1 when `tasks` chunks already give every thread enough to
 * do, else enough blocks for TASKS_PER_THREAD tasks a thread (at most g). */
static uint32_t group_blocks(const pkv_engine *e, bool parallel, uint64_t tasks)
{
    const uint64_t want = (uint64_t)e->cfg.n_threads * TASKS_PER_THREAD;
    if (!parallel || tasks >= want)
        return 1;
    const uint64_t b = (want + tasks - 1) / tasks;
    return b > e->cfg.n_kv_heads ? e->cfg.n_kv_heads : (uint32_t)b;
}

/* Groups [*g0, *g0 + *ng) of block b of nb. */
static void block_groups(uint32_t g, uint32_t b, uint32_t nb, uint32_t *g0, uint32_t *ng)
{
    *g0 = (uint32_t)((uint64_t)b * g / nb);
    *ng = (uint32_t)((uint64_t)(b + 1) * g / nb) - *g0;
}

/* ---- the pipeline ------------------------------------------------------------------ */

/* Attended positions [p0, p1), split into C chunks over its pages. */
typedef struct {
    uint64_t p0, p1;
    uint32_t C;
} run;

/* nq queries of one session at the layer's last nq positions, all in its last page.
 * What they attend is one run [0, len) - or, on a windowed layer (then nq == 1), the
 * sink run [0, min(sinks, lo)) and the window run [lo, len), lo = len - window. */
typedef struct {
    const pkvi_btable *t;             /* the layer (pinned on spill engines) */
    const pkv_layer_config *lc;       /* its variant */
    uint64_t len;                     /* positions the last query sees */
    uint64_t P;                       /* pages: ceil(len / bt) */
    uint32_t nq, H, C;                /* queries, heads per group (nq * hg), chunks */
    run runs[2];                      /* in position order; their C add up to C */
    uint32_t n_runs;
    const float *qg;                  /* [g][H][dk] the queries, by group */
    float *st;                        /* [C][g] state blocks of H heads */
    float *out;                       /* [nq][h][dv] */
} qset;

typedef struct {
    const pkv_engine *e;
    uint32_t n, blocks;               /* sets; group blocks per chunk */
    uint32_t regions;                 /* pkvi_chunk_order's R: threads sharing the run */
    const qset *sets;                 /* [n] */
    uint32_t base[BATCH_MAX + 1];     /* first chunk task of each set */
    uint32_t mbase[BATCH_MAX + 1];    /* first merge task of each set */
} pipeline;

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
    const pkv_engine *e = j->e;
    const uint32_t i = set_of(j->base, task);
    const qset *Q = &j->sets[i];
    const uint32_t g = e->cfg.n_kv_heads, d = e->cfg.head_dim, dv = e->cfg.head_dim_v;
    const uint32_t hg = e->hg, H = Q->H;
    const uint64_t bt = e->cfg.block_tokens;
    /* task layout inside a set: chunk-major, group-block-minor */
    const uint32_t t = task - j->base[i];
    const uint32_t chunk = pkvi_chunk_order(t / j->blocks, Q->C, j->regions);
    uint32_t g0, ng;
    block_groups(g, t % j->blocks, j->blocks, &g0, &ng);
    /* the run the chunk belongs to, and its pages [first, end) */
    uint32_t r = 0, k = chunk;
    while (k >= Q->runs[r].C)
        k -= Q->runs[r++].C;
    const run *R = &Q->runs[r];
    const uint64_t r_first = R->p0 / bt, r_end = (R->p1 + bt - 1) / bt;
    uint64_t first, end;
    chunk_range(r_end - r_first, R->C, k, &first, &end);
    first += r_first;
    end += r_first;
    const uint32_t row0 = first == r_first ? (uint32_t)(R->p0 % bt) : 0;
    const uint32_t last = end == r_end ? (uint32_t)(R->p1 - (r_end - 1) * bt) : (uint32_t)bt;
    const void *const *data = pkvi_btable_data(Q->t);

    const size_t sf = state_floats(H, dv);
    float *st = Q->st + ((size_t)chunk * g + g0) * sf;
    states_clear(st, ng, sf, H, dv);
    pkvi_kparams kp = e->kp;
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
            k1.v_offset = (size_t)(bt - row0) * e->row_bytes + (size_t)row0 * e->row_bytes_v;
            const void *one = (const char *)data[first] + (size_t)row0 * e->row_bytes;
            e->kern->attend(&k1, &one, 1, (end == first + 1 ? last : (uint32_t)bt) - row0, g0,
                            ng, &x);
            first++;
        }
        if (end > first)
            e->kern->attend(&kp, data + first, (uint32_t)(end - first), last, g0, ng, &x);
        return;
    }
    /* several queries (never windowed): all but the last page for all of them at once */
    const uint64_t P = Q->P;
    const uint64_t full_end = end == P ? P - 1 : end;
    if (full_end > first)
        e->kern->attend(&kp, data + first, (uint32_t)(full_end - first), (uint32_t)bt, g0,
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
            e->kern->attend(&k1, data + P - 1, 1, (uint32_t)(pos - (P - 1) * bt + 1), g0,
                            ng, &xq);
        }
    }
}

/* Merge the chunk states of one (set, query, group) in chunk order into out. */
static void merge_task(void *ctx, uint32_t task)
{
    const pipeline *j = ctx;
    const pkv_engine *e = j->e;
    const uint32_t g = e->cfg.n_kv_heads, dv = e->cfg.head_dim_v, hg = e->hg;
    const uint32_t i = set_of(j->mbase, task);
    const qset *Q = &j->sets[i];
    const uint32_t t = task - j->mbase[i], q = t / g, group = t % g;
    const size_t sf = state_floats(Q->H, dv);
    const float *sigma = Q->lc->sink_logits ? Q->lc->sink_logits + (size_t)group * hg : NULL;
    merge_heads(Q->st + (size_t)group * sf, g * sf, Q->C, Q->H, q * hg, hg, dv, sigma,
                Q->out + (size_t)q * e->cfg.n_heads * dv + (size_t)group * hg * dv);
}

/* Run n <= BATCH_MAX query sets (their layers resident and pinned) to their outputs. */
static void run_sets(const pkv_engine *e, uint32_t n, const qset *sets)
{
    pipeline j;
    j.e = e;
    j.n = n;
    j.sets = sets;
    /* work ~ K/V bytes x queries; in double: only a threshold, and it cannot wrap */
    double bytes = 0;
    uint64_t chunks = 0;
    for (uint32_t i = 0; i < n; i++) {
        chunks += sets[i].C;
        uint64_t attended = 0;
        for (uint32_t r = 0; r < sets[i].n_runs; r++)
            attended += sets[i].runs[r].p1 - sets[i].runs[r].p0;
        bytes += (double)attended * e->cfg.n_kv_heads *
                 (double)(e->row_bytes + e->row_bytes_v) * sets[i].nq;
    }
    const bool parallel = go_parallel(e, bytes);
    j.blocks = group_blocks(e, parallel, chunks);
    j.regions = parallel ? e->cfg.n_threads : 1;
    j.base[0] = j.mbase[0] = 0;
    for (uint32_t i = 0; i < n; i++) {
        j.base[i + 1] = j.base[i] + sets[i].C * j.blocks;
        j.mbase[i + 1] = j.mbase[i] + sets[i].nq * e->cfg.n_kv_heads;
    }
    pkvi_threads *pool = parallel ? e->threads : NULL;
    pkvi_threads_run(pool, j.base[n], chunk_task, &j);
    pkvi_threads_run(pool, j.mbase[n], merge_task, &j);
    pkvi_threads_call_done(e->threads);
}

/* Chunks of a run of positions [p0, p1): by its page count alone. */
static run make_run(const pkv_engine *e, uint64_t p0, uint64_t p1)
{
    const uint64_t bt = e->cfg.block_tokens;
    return (run){p0, p1, pkvi_split_chunks(e, (p1 + bt - 1) / bt - p0 / bt)};
}

/* The set of the last nq positions of `layer` (all in its last page; nq == 1 on a
 * windowed layer). */
static qset last_queries(const pkv_engine *e, const pkvi_btable *t, uint32_t layer,
                         uint32_t nq, const float *qg, float *st, float *out)
{
    const uint64_t bt = e->cfg.block_tokens, len = t->len, P = (len + bt - 1) / bt;
    const pkv_layer_config *lc = &e->layers[layer];
    qset Q = {.t = t, .lc = lc, .len = len, .P = P, .nq = nq, .H = nq * e->hg,
              .qg = qg, .st = st, .out = out};
    if (lc->window) {
        const uint64_t lo = len > lc->window ? len - lc->window : 0;
        const uint64_t sink_end = lc->sink_tokens < lo ? lc->sink_tokens : lo;
        if (sink_end)
            Q.runs[Q.n_runs++] = make_run(e, 0, sink_end);
        Q.runs[Q.n_runs++] = make_run(e, lo, len);
    } else {
        Q.runs[Q.n_runs++] = make_run(e, 0, len);
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

/* Decode n queries, one per session: n sets of one query, BATCH_MAX per run. */
static pkv_status decode_many(pkv_engine *e, uint32_t layer, uint32_t n,
                              pkv_session *const *sessions, const float *q, float *out)
{
    if (layer >= e->cfg.n_layers)
        return pkvi_fail(e, PKV_EINVAL, "decode: layer %u, but the engine has %u", layer,
                         e->cfg.n_layers);
    PKVI_BOUNDARY_CHECK(e);
    for (uint32_t i = 0; i < n; i++)
        if (!sessions[i] || sessions[i]->e != e)
            return pkvi_fail(e, PKV_EINVAL, "decode: session %u is NULL or of another engine",
                             i);
    const pkv_status dup = distinct(sessions, n);
    if (dup != PKV_OK)
        return pkvi_fail(e, dup, dup == PKV_EINVAL ? "pkv_decode_batch: a session is in the "
                                                     "batch twice" : "out of memory");
    for (uint32_t i = 0; i < n; i++)
        if (sessions[i]->layers[layer].len == 0)
            return pkvi_fail(e, PKV_ESTATE, "decode: layer %u of session %u is empty", layer,
                             i);

    const size_t qd = (size_t)e->cfg.n_heads * e->cfg.head_dim;
    const size_t od = (size_t)e->cfg.n_heads * e->cfg.head_dim_v;
    qset sets[BATCH_MAX];
    for (uint32_t i0 = 0; i0 < n; i0 += BATCH_MAX) {
        const uint32_t nb = n - i0 < BATCH_MAX ? n - i0 : BATCH_MAX;
        uint32_t got = 0;
        pkv_status st = PKV_OK;
        for (; got < nb; got++) {
            st = pkvi_session_acquire(sessions[i0 + got], layer);
            if (st != PKV_OK)
                break;
        }
        if (st == PKV_OK) {
            for (uint32_t i = 0; i < nb; i++) {
                pkv_session *s = sessions[i0 + i];
                sets[i] = last_queries(e, &s->layers[layer], layer, 1, q + (i0 + i) * qd,
                                       s->partials, out + (i0 + i) * od);
            }
            run_sets(e, nb, sets);
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
    if (!s || !q || !out)
        return PKV_EINVAL;
    return decode_many(s->e, layer, 1, &s, q, out);
}

pkv_status pkv_decode_batch(pkv_engine *e, uint32_t layer, uint32_t n,
                            pkv_session *const *sessions, const float *q, float *out)
{
    if (!e || !sessions || !q || !out || n == 0)
        return PKV_EINVAL;
    return decode_many(e, layer, n, sessions, q, out);
}

/* ---- prefill --------------------------------------------------------------------------- */

/* Most queries in one set: a page's positions, and no more than the kernels' head
 * limit allows; one on a windowed layer (each query's window starts elsewhere). */
static uint32_t tile_max(const pkv_engine *e, uint32_t layer)
{
    if (e->layers[layer].window)
        return 1;
    const uint32_t by_heads = PKVI_MAX_GROUP_HEADS / e->hg;
    return by_heads < e->cfg.block_tokens ? by_heads : e->cfg.block_tokens;
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
    pkv_engine *e = s->e;
    if (!q || !k || !v || !out || n == 0 || layer >= e->cfg.n_layers)
        return pkvi_fail(e, PKV_EINVAL, "pkv_prefill: %s",
                         layer >= e->cfg.n_layers ? "layer out of range"
                         : n == 0 ? "n is 0" : "q, k, v or out is NULL");
    PKVI_BOUNDARY_CHECK(e);
    const pkvi_btable *t = &s->layers[layer];
    const uint32_t g = e->cfg.n_kv_heads, d = e->cfg.head_dim, dv = e->cfg.head_dim_v;
    const uint32_t hg = e->hg;
    const uint64_t bt = e->cfg.block_tokens;
    const size_t qd = (size_t)e->cfg.n_heads * d, kd = (size_t)g * d, vd = (size_t)g * dv;
    const size_t od = (size_t)e->cfg.n_heads * dv;
    const uint32_t tmax = tile_max(e, layer);
    uint64_t end_len;
    if (!pkvi_add(t->len, n, &end_len) || end_len > UINT64_MAX - bt)
        return PKV_EINVAL;

    /* scratch: the queries by group [g][tmax * hg][d], then [C][g] state blocks */
    const uint64_t C = pkvi_max_chunks(e, (end_len + bt - 1) / bt);
    const uint64_t H = (uint64_t)tmax * hg;
    uint64_t qfloats, floats, bytes;
    if (!pkvi_mul((uint64_t)g * H, d, &qfloats) || !pkvi_mul(C * g, H * (dv + 2ull), &floats) ||
        !pkvi_add(floats, qfloats, &floats) || !pkvi_mul(floats, sizeof(float), &bytes) ||
        bytes > SIZE_MAX - 63)
        return PKV_ENOMEM;
    float *qg = aligned_alloc(PKVI_PAGE_ALIGN, (size_t)((bytes + 63) & ~63ull));
    if (!qg)
        return PKV_ENOMEM;
    float *states = qg + qfloats;

    pkv_status st = pkvi_session_acquire(s, layer);
    pkvi_reservation r;
    if (st == PKV_OK) {
        st = pkvi_session_reserve(s, layer, n, &r);
        if (st != PKV_OK)
            pkvi_session_release(s, layer);
    }
    if (st != PKV_OK) {
        free(qg);
        return st;
    }
    /* Nothing fails from here on: tiles of queries that land in one page. */
    for (uint32_t i = 0; i < n;) {
        const uint64_t room = bt - t->len % bt;
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
        const qset set = last_queries(e, t, layer, nq, qg, states, out + i * od);
        run_sets(e, 1, &set);
        i += nq;
    }
    pkvi_session_finish(s, &r);
    pkvi_session_release(s, layer);
    free(qg);
    return PKV_OK;
}

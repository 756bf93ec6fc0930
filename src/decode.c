/*
 * decode.c - single-query decode attention over a session's pages: split-K over
 * fixed page chunks, run on the engine's threads, merged in a fixed order; and the
 * attention half of prefill, which runs a page's worth of queries through the same
 * arithmetic at once.
 *
 * Owns the work decomposition and the merge. The per-page arithmetic is the kernel's
 * (kernels/); page residency is session.c's (acquire/release); so is prefill's append.
 *
 * Determinism (SPEC §2): a layer of P pages is split into
 *     C = min(PKVI_MAX_CHUNKS, ceil(P / chunk_pages))
 * chunks, chunk k holding pages [floor(k*P/C), floor((k+1)*P/C)). C and the ranges
 * depend only on P and the engine's fixed chunk_pages - never on the thread count or on
 * the batch - and the partial states of a head are merged in chunk order 0..C-1 by one
 * thread. The kernels are page-local and head-local (internal.h), so how a chunk's
 * groups are cut into tasks, and how many queries share a kernel call, do not change a
 * bit. So pkv_decode, pkv_decode_batch and pkv_prefill produce bitwise identical
 * results for any n_threads.
 *
 * Work: a task is (session, chunk, block of groups). One block holds every group
 * unless there are too few chunks to keep the threads busy; a task then walks each of
 * its pages front to back across the groups (pages are group-major), which is the
 * stream the hardware prefetcher follows (docs/numerics.md, "Performance"). Which
 * chunk a task index names is pkvi_chunk_order's: with T threads, consecutive tasks
 * rotate over T regions of the layer, so each thread streams one region of its own.
 *
 * Merge of two states (m, l, acc) and (m', l', acc'):
 *     M = max(m, m');  a = exp(m - M);  b = exp(m' - M)
 *     l = l*a + l'*b;  acc = acc*a + acc'*b;   finally out = acc / l.
 */
#include "internal.h"
#include "pkv_config.h"

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
 * and prefill both merge through here, so their results agree to the bit.
 */
static void merge_heads(const float *st, size_t chunk_stride, uint32_t C, uint32_t H,
                        uint32_t j0, uint32_t nh, uint32_t d, float *out)
{
    for (uint32_t j = j0; j < j0 + nh; j++) {
        float M = -INFINITY, Lsum = 0.0f;
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

/* ---- decode --------------------------------------------------------------------- */

typedef struct {
    pkv_engine *e;
    uint32_t layer, n, blocks;        /* blocks: group blocks per chunk */
    uint32_t regions;                 /* pkvi_chunk_order's R: threads sharing the run */
    pkv_session *const *ss;
    const float *q;                   /* [n][h][d] */
    float *out;                       /* [n][h][d] */
    uint32_t chunks[BATCH_MAX];       /* C of each session */
    uint32_t base[BATCH_MAX + 1];     /* first task of each session */
} job;

/* Which session a task index belongs to (n <= BATCH_MAX: a linear scan). */
static uint32_t session_of(const job *j, uint32_t task)
{
    uint32_t i = 0;
    while (task >= j->base[i + 1])
        i++;
    return i;
}

static void chunk_task(void *ctx, uint32_t task)
{
    const job *j = ctx;
    const pkv_engine *e = j->e;
    const uint32_t i = session_of(j, task);
    const pkv_session *s = j->ss[i];
    const pkvi_layer *L = &s->layers[j->layer];
    const uint32_t C = j->chunks[i], g = e->cfg.n_kv_heads, d = e->cfg.head_dim;
    /* task layout inside a session: chunk-major, group-block-minor */
    const uint32_t t = task - j->base[i];
    const uint32_t chunk = pkvi_chunk_order(t / j->blocks, C, j->regions);
    uint32_t g0, ng;
    block_groups(g, t % j->blocks, j->blocks, &g0, &ng);
    uint64_t first, end;
    chunk_range(L->n_pages, C, chunk, &first, &end);
    const uint64_t bt = e->cfg.block_tokens;
    const uint32_t last_tokens =
        end == L->n_pages ? (uint32_t)(L->len - (L->n_pages - 1) * bt) : (uint32_t)bt;

    const size_t sf = state_floats(e->hg, d);
    float *st = s->partials + ((size_t)chunk * g + g0) * sf;
    states_clear(st, ng, sf, e->hg, d);
    const pkvi_heads x = {
        .q = j->q + (size_t)i * e->cfg.n_heads * d + (size_t)g0 * e->hg * d,
        .m = st, .l = st + e->hg, .acc = st + 2 * e->hg,
        .q_stride = (size_t)e->hg * d, .st_stride = sf,
    };
    e->kern->attend(&e->kp, L->data + first, (uint32_t)(end - first), last_tokens, g0, ng,
                    &x);
}

/* Merge the chunk states of one (session, group) in chunk order into out. */
static void merge_task(void *ctx, uint32_t task)
{
    const job *j = ctx;
    const pkv_engine *e = j->e;
    const uint32_t g = e->cfg.n_kv_heads, d = e->cfg.head_dim, hg = e->hg;
    const uint32_t i = task / g, group = task % g;
    const size_t sf = state_floats(hg, d);
    merge_heads(j->ss[i]->partials + (size_t)group * sf, g * sf, j->chunks[i], hg, 0, hg, d,
                j->out + (size_t)i * e->cfg.n_heads * d + (size_t)group * hg * d);
}

/* Decode up to BATCH_MAX already-validated, acquired sessions. */
static void run_batch(pkv_engine *e, uint32_t layer, uint32_t n, pkv_session *const *ss,
                      const float *q, float *out)
{
    job j;
    j.e = e;
    j.layer = layer;
    j.n = n;
    j.ss = ss;
    j.q = q;
    j.out = out;
    uint64_t bytes = 0, chunks = 0;
    for (uint32_t i = 0; i < n; i++) {
        const pkvi_layer *L = &ss[i]->layers[layer];
        j.chunks[i] = pkvi_split_chunks(e, L->n_pages);
        chunks += j.chunks[i];
        bytes += L->len * 2 * e->cfg.n_kv_heads * e->row_bytes;
    }
    const bool parallel = go_parallel(e, (double)bytes);
    j.blocks = group_blocks(e, parallel, chunks);
    j.regions = parallel ? e->cfg.n_threads : 1;
    j.base[0] = 0;
    for (uint32_t i = 0; i < n; i++)
        j.base[i + 1] = j.base[i] + j.chunks[i] * j.blocks;
    pkvi_threads *pool = parallel ? e->threads : NULL;
    pkvi_threads_run(pool, j.base[n], chunk_task, &j);
    pkvi_threads_run(pool, n * e->cfg.n_kv_heads, merge_task, &j);
    pkvi_threads_call_done(e->threads);
}

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

pkv_status pkvi_decode_many(pkv_engine *e, uint32_t layer, uint32_t n,
                            pkv_session *const *sessions, const float *q, float *out)
{
    if (layer >= e->cfg.n_layers)
        return PKV_EINVAL;
    PKVI_BOUNDARY_CHECK(e);
    for (uint32_t i = 0; i < n; i++)
        if (!sessions[i] || sessions[i]->e != e)
            return PKV_EINVAL;
    const pkv_status dup = distinct(sessions, n);
    if (dup != PKV_OK)
        return dup;
    for (uint32_t i = 0; i < n; i++)
        if (sessions[i]->layers[layer].len == 0)
            return PKV_ESTATE;

    const size_t qd = (size_t)e->cfg.n_heads * e->cfg.head_dim;
    for (uint32_t i0 = 0; i0 < n; i0 += BATCH_MAX) {
        const uint32_t nb = n - i0 < BATCH_MAX ? n - i0 : BATCH_MAX;
        uint32_t got = 0;
        pkv_status st = PKV_OK;
        for (; got < nb; got++) {
            st = pkvi_session_acquire(sessions[i0 + got], layer);
            if (st != PKV_OK)
                break;
        }
        if (st == PKV_OK)
            run_batch(e, layer, nb, sessions + i0, q + i0 * qd, out + i0 * qd);
        for (uint32_t k = 0; k < got; k++)
            pkvi_session_release(sessions[i0 + k], layer);
        if (st != PKV_OK)
            return st;
    }
    return PKV_OK;
}

/* ---- prefill ---------------------------------------------------------------------
 * A tile is nq consecutive queries whose positions lie in the layer's last page, so
 * they see the same P pages and the same chunks. Each kernel call takes all nq
 * queries' heads of a group as one group of H = nq * hg heads (K/V rows are loaded
 * once for all of them), except on the last page, where query j sees only its first
 * positions: there it runs alone. Per head the arithmetic is that of pkv_decode. */

uint32_t pkvi_prefill_tile_max(const pkv_engine *e)
{
    const uint32_t by_heads = PKVI_MAX_GROUP_HEADS / e->hg;
    return by_heads < e->cfg.block_tokens ? by_heads : e->cfg.block_tokens;
}

pkv_status pkvi_prefill_scratch(const pkv_engine *e, uint64_t n_pages, float **out)
{
    const uint64_t C = pkvi_split_chunks(e, n_pages);
    const uint64_t H = (uint64_t)pkvi_prefill_tile_max(e) * e->cfg.n_heads;
    uint64_t floats, bytes;
    if (!pkvi_mul(C + 1, H, &floats) || !pkvi_mul(floats, (uint64_t)e->cfg.head_dim + 2, &floats) ||
        !pkvi_mul(floats, sizeof(float), &bytes) || bytes > SIZE_MAX - 63)
        return PKV_ENOMEM;
    float *p = aligned_alloc(PKVI_PAGE_ALIGN, (size_t)((bytes + 63) & ~63ull));
    if (!p)
        return PKV_ENOMEM;
    *out = p;
    return PKV_OK;
}

typedef struct {
    const pkv_engine *e;
    const pkvi_layer *L;
    uint32_t nq, H, C, blocks, regions;
    uint64_t pos0;                    /* position of the tile's first query */
    const float *q;                   /* [nq][h][d] as given */
    float *out;                       /* [nq][h][d] */
    float *qg;                        /* [g][H][d]: the queries regrouped */
    float *st;                        /* [C][g] state blocks of H heads */
} tile_job;

static void tile_task(void *ctx, uint32_t task)
{
    const tile_job *j = ctx;
    const pkv_engine *e = j->e;
    const uint32_t g = e->cfg.n_kv_heads, d = e->cfg.head_dim, hg = e->hg, H = j->H;
    const uint32_t chunk = pkvi_chunk_order(task / j->blocks, j->C, j->regions);
    uint32_t g0, ng;
    block_groups(g, task % j->blocks, j->blocks, &g0, &ng);
    const uint64_t P = j->L->n_pages, bt = e->cfg.block_tokens;
    uint64_t first, end;
    chunk_range(P, j->C, chunk, &first, &end);

    const size_t sf = state_floats(H, d);
    float *st = j->st + ((size_t)chunk * g + g0) * sf;
    states_clear(st, ng, sf, H, d);
    const uint64_t full_end = end == P ? P - 1 : end;
    if (full_end > first) {
        pkvi_kparams kp = e->kp;
        kp.hg = H;
        const pkvi_heads x = {
            .q = j->qg + (size_t)g0 * H * d, .m = st, .l = st + H, .acc = st + 2 * (size_t)H,
            .q_stride = (size_t)H * d, .st_stride = sf,
        };
        e->kern->attend(&kp, j->L->data + first, (uint32_t)(full_end - first),
                        (uint32_t)bt, g0, ng, &x);
    }
    if (end == P) /* the last page: each query up to and including its own position */
        for (uint32_t q = 0; q < j->nq; q++) {
            const uint64_t pos = j->pos0 + q;
            const pkvi_heads x = {
                .q = j->qg + ((size_t)g0 * H + (size_t)q * hg) * d,
                .m = st + (size_t)q * hg, .l = st + H + (size_t)q * hg,
                .acc = st + 2 * (size_t)H + (size_t)q * hg * d,
                .q_stride = (size_t)H * d, .st_stride = sf,
            };
            e->kern->attend(&e->kp, j->L->data + P - 1, 1, (uint32_t)(pos - (P - 1) * bt + 1),
                            g0, ng, &x);
        }
}

static void tile_merge_task(void *ctx, uint32_t task)
{
    const tile_job *j = ctx;
    const pkv_engine *e = j->e;
    const uint32_t g = e->cfg.n_kv_heads, d = e->cfg.head_dim, hg = e->hg;
    const uint32_t q = task / g, group = task % g;
    const size_t sf = state_floats(j->H, d);
    merge_heads(j->st + (size_t)group * sf, g * sf, j->C, j->H, q * hg, hg, d,
                j->out + (size_t)q * e->cfg.n_heads * d + (size_t)group * hg * d);
}

pkv_status pkvi_prefill_attend(pkv_engine *e, pkv_session *s, uint32_t layer, uint32_t nq,
                               const float *q, float *out, float *scratch)
{
    const pkvi_layer *L = &s->layers[layer];
    const uint32_t g = e->cfg.n_kv_heads, d = e->cfg.head_dim, hg = e->hg;
    tile_job j;
    j.e = e;
    j.L = L;
    j.nq = nq;
    j.H = nq * hg;
    j.pos0 = L->len - nq;
    j.C = pkvi_split_chunks(e, L->n_pages);
    j.q = q;
    j.out = out;
    j.qg = scratch;
    j.st = scratch + (size_t)g * j.H * d;
    /* regroup: head hh of group gr of query k goes to qg[gr][k * hg + hh] */
    for (uint32_t gr = 0; gr < g; gr++)
        for (uint32_t k = 0; k < nq; k++)
            memcpy(j.qg + ((size_t)gr * j.H + (size_t)k * hg) * d,
                   q + ((size_t)k * e->cfg.n_heads + (size_t)gr * hg) * d,
                   (size_t)hg * d * sizeof(float));

    pkv_status st = pkvi_session_acquire(s, layer);
    if (st != PKV_OK)
        return st;
    /* work ~ K/V bytes x queries; in double: only a threshold, and it cannot wrap */
    const bool parallel = go_parallel(e, (double)L->len * 2.0 * g * (double)e->row_bytes * nq);
    j.blocks = group_blocks(e, parallel, j.C);
    j.regions = parallel ? e->cfg.n_threads : 1;
    pkvi_threads *pool = parallel ? e->threads : NULL;
    pkvi_threads_run(pool, j.C * j.blocks, tile_task, &j);
    pkvi_threads_run(pool, nq * g, tile_merge_task, &j);
    pkvi_threads_call_done(e->threads);
    pkvi_session_release(s, layer);
    return PKV_OK;
}

/*
 * decode.c - single-query decode attention over a session's pages: split-K over
 * fixed page chunks, run on the engine's threads, merged in a fixed order.
 *
 * Owns the work decomposition and the merge. The per-chunk arithmetic is the kernel's
 * (kernels/); page residency is session.c's (acquire/release).
 *
 * Determinism (SPEC §2): a layer of P pages is split into
 *     C = min(PKVI_MAX_CHUNKS, ceil(P / chunk_pages))
 * chunks, chunk k holding pages [floor(k*P/C), floor((k+1)*P/C)). C and the ranges
 * depend only on P and the engine's fixed chunk_pages - never on the thread count or on
 * the batch - and the partial states of a group are merged in chunk order 0..C-1 by one
 * thread. So pkv_decode, pkv_decode_batch and pkv_prefill produce bitwise identical
 * results for any n_threads.
 *
 * Merge of two states (m, l, acc) and (m', l', acc'):
 *     M = max(m, m');  a = exp(m - M);  b = exp(m' - M)
 *     l = l*a + l'*b;  acc = acc*a + acc'*b;   finally out = acc / l.
 */
#include "internal.h"
#include "pkv_config.h"

#include <math.h>
#include <string.h>

/* Below this many K/V bytes in a whole call the calling thread works alone: waking a
 * worker costs microseconds, about what one thread needs to stream 1 MiB. A chosen
 * figure, not a tuned one; what was measured is that a 4k-token llama3-8b f16 layer
 * (16 MiB) streams faster on 2 threads than on 1 (pagedkv bench: 24.7 vs 20.2 GB/s). */
#define PARALLEL_MIN_BYTES (1ull << 20)
/* Sessions per pool run in a batch (bounds the stack tables below). */
#define BATCH_MAX 64u

typedef struct {
    pkv_engine *e;
    uint32_t layer, n;
    pkv_session *const *ss;
    const float *q;                   /* [n][h][d] */
    float *out;                       /* [n][h][d] */
    uint32_t chunks[BATCH_MAX];       /* C of each session */
    uint32_t base[BATCH_MAX + 1];     /* first chunk task of each session */
} job;

static size_t state_floats(const pkv_engine *e)
{
    return (size_t)e->hg * ((size_t)e->cfg.head_dim + 2);
}

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
    const uint32_t C = j->chunks[i];
    /* task layout inside a session: group-major, chunk-minor */
    const uint32_t t = task - j->base[i];
    const uint32_t group = t / C, chunk = t % C;
    const uint64_t P = L->n_pages;
    const uint64_t first = chunk * P / C, end = (chunk + 1) * P / C;
    const uint64_t bt = e->cfg.block_tokens;
    const uint32_t last_tokens =
        end == P ? (uint32_t)(L->len - (P - 1) * bt) : (uint32_t)bt;

    float *st = s->partials + ((size_t)group * C + chunk) * state_floats(e);
    float *m = st, *l = st + e->hg, *acc = st + 2 * e->hg;
    for (uint32_t h = 0; h < e->hg; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, (size_t)e->hg * e->cfg.head_dim * sizeof(float));
    const float *q = j->q + (size_t)i * e->cfg.n_heads * e->cfg.head_dim +
                     (size_t)group * e->hg * e->cfg.head_dim;
    e->kern->attend(&e->kp, L->data + first, (uint32_t)(end - first), last_tokens, group,
                    q, m, l, acc);
}

/* Merge the chunk states of one (session, group) in chunk order into out. */
static void merge_task(void *ctx, uint32_t task)
{
    const job *j = ctx;
    const pkv_engine *e = j->e;
    const uint32_t g = e->cfg.n_kv_heads, d = e->cfg.head_dim, hg = e->hg;
    const uint32_t i = task / g, group = task % g;
    const pkv_session *s = j->ss[i];
    const uint32_t C = j->chunks[i];
    float *out = j->out + (size_t)i * e->cfg.n_heads * d + (size_t)group * hg * d;

    for (uint32_t h = 0; h < hg; h++) {
        float M = -INFINITY, Lsum = 0.0f;
        float *o = out + (size_t)h * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (uint32_t c = 0; c < C; c++) {
            const float *st = s->partials + ((size_t)group * C + c) * state_floats(e);
            const float mc = st[h], lc = st[hg + h];
            const float *ac = st + 2 * hg + (size_t)h * d;
            const float nm = fmaxf(M, mc);
            const float a = expf(M - nm), b = expf(mc - nm);
            Lsum = Lsum * a + lc * b;
            for (uint32_t x = 0; x < d; x++)
                o[x] = o[x] * a + ac[x] * b;
            M = nm;
        }
        for (uint32_t x = 0; x < d; x++)
            o[x] /= Lsum;
    }
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
    j.base[0] = 0;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; i++) {
        const pkvi_layer *L = &ss[i]->layers[layer];
        j.chunks[i] = pkvi_split_chunks(e, L->n_pages);
        j.base[i + 1] = j.base[i] + j.chunks[i] * e->cfg.n_kv_heads;
        bytes += L->len * 2 * e->cfg.n_kv_heads * e->row_bytes;
    }
    pkvi_threads *pool = bytes >= PARALLEL_MIN_BYTES ? e->threads : NULL;
    pkvi_threads_run(pool, j.base[n], chunk_task, &j);
    pkvi_threads_run(pool, n * e->cfg.n_kv_heads, merge_task, &j);
}

pkv_status pkvi_decode_many(pkv_engine *e, uint32_t layer, uint32_t n,
                            pkv_session *const *sessions, const float *q, float *out)
{
    if (layer >= e->cfg.n_layers)
        return PKV_EINVAL;
    PKVI_BOUNDARY_CHECK(e);
    for (uint32_t i = 0; i < n; i++) {
        if (!sessions[i] || sessions[i]->e != e)
            return PKV_EINVAL;
        for (uint32_t k = 0; k < i && n <= 4096; k++)
            if (sessions[k] == sessions[i])
                return PKV_EINVAL;
    }
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

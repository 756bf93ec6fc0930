/*
 * test_crossings.c - where features meet: a model-based property test over their
 * product. Random engines (every dtype, both Q8/Q4 paths, windows with sinks and
 * rollback, soft-caps, sink logits, head_dim_v != head_dim, page sizes 1..16, spill
 * under a budget or a budget alone, a prefix cache, 1 or 2 threads) run random
 * operations on random sessions (append, prefill, decode, batch, partial states,
 * truncate, fork, destroy, save + load, record tokens, sessions from the prefix
 * cache, shards, speculative verify + commit of a draft tree) and the bad inputs of
 * each call, against a model of each session.
 *
 * The model is what the documentation promises, not the library's code: a session is
 * its shard's first position and, per layer, its length and the token id of every
 * position; the row appended at position p of layer l is a fixed function of (id, p,
 * l), so every session that holds an id at p holds the same row (which makes the
 * prefix cache's answer checkable), and the cache gives back that row rounded
 * (pkv_dtype_round_row). A windowed layer holds every position except the pages its
 * window released: page i >= its sink pages goes once a length L was reached with
 * (i + 1) * bt <= L - window - rollback; truncating to n is allowed when every
 * position a decode at n - 1 reads is held.
 *
 * After every step: pkv_engine_check passes; the touched sessions decode within the
 * documented bound of the double reference (pkv_attention_reference on the rounded
 * rows; docs/numerics.md: 1e-5 max|V|, plus the integer path's bound of section 7);
 * their holes are the model's (pkv_session_pages). A call that must fail fails with
 * its status, a reason naming it, and changes nothing: lengths, memory figures and
 * decode bitwise as before. A save that returns PKV_OK wrote a file that passes
 * pkv_session_file_check and loads into a session that decodes bitwise like the
 * original; a save that fails left the old file.
 *
 * PKV_TEST_QUICK=1 (sanitizer runs) does fewer operations, PKV_TEST_LONG=1 (the slow
 * suite's run, crossings-long) many more; PKV_TEST_SEED picks the walk.
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NL 3          /* layers: 0 full causal, 1 windowed, 2 sink logits (maybe windowed) */
#define SLOTS 6       /* live sessions at most */
#define MAX_NEW 40    /* positions a session holds beyond its first, at most */
#define PROMPT 64     /* a shared prompt: sessions that follow it share prefixes */

typedef struct {
    pkv_session *s;        /* NULL: an empty slot */
    uint64_t first;        /* a shard's first position */
    uint64_t len[NL];
    uint64_t hole_lo[NL], hole_hi[NL]; /* entries that name no page; hole_hi 0: none */
    int32_t *ids;          /* [cap]: the token id of each position */
    uint64_t cap;
    uint64_t n_tokens;     /* recorded with pkv_session_set_tokens */
    uint64_t diverge;      /* positions below it follow the prompt */
} slot;

typedef struct {
    pkvt_rng r;
    uint64_t seed;
    pkv_config c;
    pkv_layer_config lc[NL];
    float logits[8];
    pkv_engine *e;
    uint32_t h, g, d, dv, bt;
    char dir[512], path[600], junk[600];
    int32_t prompt[PROMPT];
    slot sl[SLOTS];
    uint64_t budget_pages; /* 0: none */
    bool quant_dot;
    long checks, failures_checked, saves;
    long window_refusals, shard_saves, prefix_hits, spilled, enomem; /* what was reached */
    long verified;         /* verify + commit steps that succeeded */
} world;

/* ---- the model ------------------------------------------------------------------------- */

static uint64_t hash3(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t x = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull) * 0xbf58476d1ce4e5b9ull;
    x ^= (c + 1) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    x *= 0xd6e8feb86659fd93ull;
    return x ^ (x >> 29);
}

/* The row of (id, position, layer): K [g][d] and V [g][dv], unrounded. */
static void row_of(const world *w, int32_t id, uint64_t p, uint32_t l, float *k, float *v)
{
    pkvt_rng r;
    pkvt_rng_init(&r, hash3(w->seed, ((uint64_t)(uint32_t)id << 8) | l, p));
    pkvt_fill(&r, k, (size_t)w->g * w->d, -2.0f, 2.0f);
    pkvt_fill(&r, v, (size_t)w->g * w->dv, -1.0f, 1.0f);
}

static void round_rows(const world *w, float *k, float *v)
{
    for (uint32_t gi = 0; gi < w->g; gi++) {
        pkv_dtype_round_row(w->c.kv_dtype, w->d, k + gi * w->d, k + gi * w->d);
        pkv_dtype_round_row(w->c.kv_dtype, w->dv, v + gi * w->dv, v + gi * w->dv);
    }
}

static uint64_t max_len(const slot *s)
{
    uint64_t m = 0;
    for (uint32_t l = 0; l < NL; l++)
        m = s->len[l] > m ? s->len[l] : m;
    return m;
}

/* The id of position p of s, made when p is first appended to. */
static int32_t id_at(world *w, slot *s, uint64_t p)
{
    if (p >= s->cap) {
        uint64_t cap = s->cap ? s->cap * 2 : 64;
        while (cap <= p)
            cap *= 2;
        s->ids = realloc(s->ids, cap * sizeof *s->ids);
        ck_assert_ptr_nonnull(s->ids);
        for (uint64_t i = s->cap; i < cap; i++)
            s->ids[i] = -1;
        s->cap = cap;
    }
    if (s->ids[p] < 0)
        s->ids[p] = p < s->diverge && p < PROMPT ? w->prompt[p]
                                                 : (int32_t)pkvt_below(&w->r, 1000) + 1000;
    return s->ids[p];
}

static uint64_t sink_pages(const world *w, uint32_t l)
{
    return w->lc[l].window ? (w->lc[l].sink_tokens + w->bt - 1) / w->bt : 0;
}

/* A window's release after a write that reached `len`: pages the window and the
 * rollback can no longer reach. */
static void release(const world *w, slot *s, uint32_t l)
{
    const pkv_layer_config *lc = &w->lc[l];
    if (!lc->window)
        return;
    const uint64_t span = (uint64_t)lc->window + lc->rollback_tokens, len = s->len[l];
    const uint64_t keep = len > span ? (len - span) / w->bt : 0, sp = sink_pages(w, l);
    const uint64_t hi = s->hole_hi[l];
    if (keep > (hi > sp ? hi : sp)) {
        if (hi == 0)
            s->hole_lo[l] = sp;
        s->hole_hi[l] = keep;
    }
}

/* Whether truncating layer l of s to n keeps every position a decode at n - 1 reads. */
static bool truncate_allowed(const world *w, const slot *s, uint32_t l, uint64_t n)
{
    const pkv_layer_config *lc = &w->lc[l];
    if (n >= s->len[l] || n == 0 || s->hole_hi[l] == 0)
        return true;
    uint64_t lo = lc->window && n > lc->window ? n - lc->window : 0;
    if (lo < s->first)
        lo = s->first;
    /* the window run [lo, n) must not meet the hole [hole_lo, hole_hi), in positions */
    const uint64_t h0 = s->hole_lo[l] * w->bt, h1 = s->hole_hi[l] * w->bt;
    return !(lo < h1 && n > h0 && lo < n);
}

static void model_truncate(const world *w, slot *s, uint64_t n)
{
    for (uint32_t l = 0; l < NL; l++) {
        if (n >= s->len[l])
            continue;
        s->len[l] = n;
        const uint64_t keep = (n + w->bt - 1) / w->bt;
        if (s->hole_hi[l] > keep)
            s->hole_hi[l] = keep;
        if (s->hole_hi[l] <= s->hole_lo[l])
            s->hole_lo[l] = s->hole_hi[l] = 0;
    }
    if (s->n_tokens > n)
        s->n_tokens = n;
    for (uint64_t p = max_len(s); p < s->cap; p++)
        s->ids[p] = -1;
}

static void model_copy(slot *dst, const slot *src, pkv_session *s)
{
    *dst = *src;
    dst->s = s;
    dst->ids = NULL;
    if (src->cap) {
        dst->ids = malloc(src->cap * sizeof *dst->ids);
        ck_assert_ptr_nonnull(dst->ids);
        memcpy(dst->ids, src->ids, src->cap * sizeof *dst->ids);
    }
}

static void model_free(slot *s)
{
    free(s->ids);
    memset(s, 0, sizeof *s);
}

/* ---- checks ------------------------------------------------------------------------------- */

static float *query(world *w, uint32_t salt)
{
    static float q[64 * 64];
    pkvt_rng r;
    pkvt_rng_init(&r, hash3(w->seed, salt, 77));
    pkvt_fill(&r, q, (size_t)w->h * w->d, -1.0f, 1.0f);
    return q;
}

/* Decode layer l of s against the double reference on the model's rounded rows. */
static void check_decode(world *w, slot *s, uint32_t l, const char *what)
{
    const uint64_t F = s->first, len = s->len[l];
    const size_t qd = (size_t)w->h * w->d, od = (size_t)w->h * w->dv;
    float *q = query(w, (uint32_t)len + 31 * l), out[64 * 64], out2[64 * 64];
    if (len == F) {
        ck_assert_int_eq(pkv_decode(s->s, l, q, out), PKV_ESTATE);
        return;
    }
    const pkv_status st = pkv_decode(s->s, l, q, out);
    ck_assert_msg(st == PKV_OK, "%s: decode of layer %u: %s (seed %llu)", what, l,
                  pkv_status_str(st), (unsigned long long)w->seed);
    ck_assert_int_eq(pkv_decode(s->s, l, q, out2), PKV_OK);
    ck_assert_msg(memcmp(out, out2, od * sizeof(float)) == 0, "%s: decode twice differs", what);
    /* the shard's own positions: a window over them, its sink logits only at 0 */
    const uint64_t T = len - F;
    const size_t gk = (size_t)w->g * w->d, gv = (size_t)w->g * w->dv;
    float *K = pkvt_calloc(T, gk * sizeof(float)), *V = pkvt_calloc(T, gv * sizeof(float));
    float *Q = pkvt_calloc(T, qd * sizeof(float)), *R = pkvt_calloc(T, od * sizeof(float));
    float vmax = 0;
    for (uint64_t t = 0; t < T; t++) {
        row_of(w, s->ids[F + t], F + t, l, K + t * gk, V + t * gv);
        round_rows(w, K + t * gk, V + t * gv);
        for (size_t i = 0; i < gv; i++)
            vmax = fabsf(V[t * gv + i]) > vmax ? fabsf(V[t * gv + i]) : vmax;
    }
    memcpy(Q + (T - 1) * qd, q, qd * sizeof(float));
    pkv_layer_config lc = w->lc[l];
    if (F) {
        lc.sink_tokens = 0;
        lc.sink_logits = NULL;
    }
    lc.rollback_tokens = 0;
    ck_assert_int_eq(pkv_attention_reference((uint32_t)T, w->h, w->g, w->d, w->dv, w->c.scale,
                                             &lc, Q, K, V, R),
                     PKV_OK);
    /* the integer path's bound (docs/numerics.md, section 7), per head */
    const float scale = w->c.scale ? w->c.scale : 1.0f / sqrtf((float)w->d);
    for (uint32_t i = 0; i < w->h; i++) {
        double delta = 0;
        if (w->quant_dot) {
            const uint32_t gi = i / (w->h / w->g);
            for (uint64_t t = 0; t < T; t++) {
                double dt = 0;
                for (uint32_t b = 0; b < w->d; b += 32) {
                    const uint32_t e = b + 32 < w->d ? b + 32 : w->d;
                    float a = 0;
                    double ks = 0;
                    for (uint32_t j = b; j < e; j++) {
                        a = fabsf(q[i * w->d + j]) > a ? fabsf(q[i * w->d + j]) : a;
                        ks += fabs(K[t * gk + gi * w->d + j]);
                    }
                    dt += a / 127.0 / 2.0 * ks;
                }
                delta = dt * scale > delta ? dt * scale : delta;
            }
        }
        const double tol = (exp(2 * delta) - 1) * vmax + 1e-5 * vmax + 1e-30;
        for (uint32_t x = 0; x < w->dv; x++) {
            const double diff = fabs((double)out[i * w->dv + x] - R[(T - 1) * od + i * w->dv + x]);
            ck_assert_msg(diff <= tol, "%s: layer %u head %u dim %u: got %.9g, reference %.9g "
                          "(|diff| %.3g > tol %.3g; len %llu first %llu; seed %llu)", what, l,
                          i, x, (double)out[i * w->dv + x], (double)R[(T - 1) * od + i * w->dv + x],
                          diff, tol, (unsigned long long)len, (unsigned long long)F,
                          (unsigned long long)w->seed);
        }
    }
    /* the partial states, merged, are the decode's bits */
    enum { CAP = 16 };
    float *part = pkvt_alloc(CAP * (size_t)w->h * (w->dv + 2) * sizeof(float));
    uint32_t n = 0;
    ck_assert_int_eq(pkv_decode_partial(s->s, l, q, CAP, part, &n), PKV_OK);
    ck_assert_int_eq(pkv_merge_partials(w->e, n, part, out2), PKV_OK);
    ck_assert_msg(memcmp(out, out2, od * sizeof(float)) == 0, "%s: partial + merge differs",
                  what);
    free(part);
    free(K);
    free(V);
    free(Q);
    free(R);
    w->checks++;
}

/* The session's lengths, holes and memory figures against the model. */
static void check_shape(world *w, slot *s, const char *what)
{
    uint64_t tokens = 0, blocks = 0;
    for (uint32_t l = 0; l < NL; l++) {
        ck_assert_msg(pkv_session_len(s->s, l) == s->len[l], "%s: layer %u length %llu, "
                      "model %llu (seed %llu)", what, l,
                      (unsigned long long)pkv_session_len(s->s, l),
                      (unsigned long long)s->len[l], (unsigned long long)w->seed);
        const uint64_t np = (s->len[l] + w->bt - 1) / w->bt;
        pkv_page_info pi[64];
        uint64_t got = 0;
        for (uint64_t i0 = 0; i0 < np; i0 += 64) {
            ck_assert_int_eq(pkv_session_pages(s->s, l, i0, 64, pi, &got), PKV_OK);
            for (uint64_t k = 0; k < got; k++) {
                const uint64_t i = i0 + k;
                const bool hole = (s->first && i < s->first / w->bt) ||
                                  (s->hole_hi[l] && i >= s->hole_lo[l] && i < s->hole_hi[l]);
                ck_assert_msg((pi[k].id == 0) == hole, "%s: layer %u page %llu: %s, model %s "
                              "(seed %llu)", what, l, (unsigned long long)i,
                              pi[k].id ? "held" : "released", hole ? "released" : "held",
                              (unsigned long long)w->seed);
                blocks += !hole;
            }
        }
        tokens += s->len[l];
    }
    pkv_memory m;
    ck_assert_int_eq(pkv_session_memory(s->s, &m), PKV_OK);
    ck_assert_uint_eq(m.tokens, tokens);
    ck_assert_uint_eq(m.blocks, blocks);
}

static void check_slot(world *w, slot *s, const char *what)
{
    check_shape(w, s, what);
    for (uint32_t l = 0; l < NL; l++)
        check_decode(w, s, l, what);
}

/* What "nothing changed" compares: lengths, memory figures, decode of every layer. */
typedef struct {
    uint64_t len[NL];
    pkv_memory m;
    float out[NL][64 * 64];
    pkv_status st[NL];
} snap;

static void take(world *w, slot *s, snap *z)
{
    memset(z, 0, sizeof *z);
    for (uint32_t l = 0; l < NL; l++) {
        z->len[l] = pkv_session_len(s->s, l);
        z->st[l] = pkv_decode(s->s, l, query(w, 5 + l), z->out[l]);
    }
    ck_assert_int_eq(pkv_session_memory(s->s, &z->m), PKV_OK);
    /* where pages live may change (a spill), what they hold may not */
    z->m.bytes_resident = z->m.bytes_spilled = z->m.bytes_shared = 0;
}

static void unchanged(world *w, slot *s, const snap *before, const char *what)
{
    snap *after = malloc(sizeof *after);
    ck_assert_ptr_nonnull(after);
    take(w, s, after);
    ck_assert_msg(memcmp(before, after, sizeof *after) == 0,
                  "%s: a failed call changed the session (seed %llu)", what,
                  (unsigned long long)w->seed);
    free(after);
}

/* A call that had to fail with `want`: it did, it said so under its own name. */
static void failed(world *w, pkv_status got, pkv_status want, const char *call)
{
    ck_assert_msg(got == want, "%s gave %s, want %s (seed %llu)", call, pkv_status_str(got),
                  pkv_status_str(want), (unsigned long long)w->seed);
    char why[256];
    ck_assert_int_eq(pkv_engine_last_error(w->e, why, sizeof why), PKV_OK);
    ck_assert_msg(strncmp(why, call, strlen(call)) == 0 && why[strlen(call)] == ':',
                  "%s failed with reason \"%s\"", call, why);
    w->failures_checked++;
}

/* ENOMEM from a budget (or EIO never): allowed for calls that take pages. */
static bool out_of_room(const world *w, pkv_status st)
{
    return st == PKV_ENOMEM && w->budget_pages;
}

/* ---- operations --------------------------------------------------------------------------- */

static int free_slot(world *w)
{
    for (int i = 0; i < SLOTS; i++)
        if (!w->sl[i].s)
            return i;
    return -1;
}

static int live_slot(world *w)
{
    int n = 0, pick = -1;
    for (int i = 0; i < SLOTS; i++)
        if (w->sl[i].s && pkvt_below(&w->r, (uint32_t)++n) == 0)
            pick = i;
    return pick;
}

static void op_create(world *w)
{
    const int i = free_slot(w);
    if (i < 0)
        return;
    slot *s = &w->sl[i];
    memset(s, 0, sizeof *s);
    s->s = pkvt_session(w->e);
    s->diverge = pkvt_below(&w->r, 2) ? pkvt_below(&w->r, PROMPT) : 0;
    if (pkvt_below(&w->r, 5) == 0) { /* a shard */
        const uint64_t F = pkv_shard_align(w->e) * (1 + pkvt_below(&w->r, 2));
        ck_assert_int_eq(pkv_session_set_first(s->s, F), PKV_OK);
        s->first = F;
        for (uint32_t l = 0; l < NL; l++) {
            s->len[l] = F;
            s->hole_lo[l] = 0;
            s->hole_hi[l] = F / w->bt;
        }
    }
}

/* Append n rows (prefill when asked) to layer l of s. */
static void op_write(world *w, slot *s, uint32_t l, uint32_t n, bool prefill)
{
    if (s->len[l] + n > s->first + MAX_NEW)
        return;
    const size_t gk = (size_t)w->g * w->d, gv = (size_t)w->g * w->dv;
    const size_t qd = (size_t)w->h * w->d, od = (size_t)w->h * w->dv;
    float *k = pkvt_calloc(n, gk * sizeof(float)), *v = pkvt_calloc(n, gv * sizeof(float));
    float *q = pkvt_calloc(n, qd * sizeof(float)), *o = pkvt_calloc(n, od * sizeof(float));
    for (uint32_t j = 0; j < n; j++) {
        const uint64_t p = s->len[l] + j;
        row_of(w, id_at(w, s, p), p, l, k + j * gk, v + j * gv);
        memcpy(q + j * qd, query(w, (uint32_t)p), qd * sizeof(float));
    }
    snap *before = malloc(sizeof *before);
    take(w, s, before);
    pkv_status st = PKV_OK;
    uint32_t done = 0;
    if (prefill) {
        st = pkv_prefill(s->s, l, n, q, k, v, o);
        done = st == PKV_OK ? n : 0;
    } else {
        for (; done < n && st == PKV_OK; done += st == PKV_OK)
            st = pkv_append(s->s, l, k + done * gk, v + done * gv);
    }
    if (st != PKV_OK) {
        ck_assert_msg(out_of_room(w, st), "%s: %s (seed %llu)", prefill ? "prefill" : "append",
                      pkv_status_str(st), (unsigned long long)w->seed);
        w->enomem++;
        if (done == 0)
            unchanged(w, s, before, prefill ? "a failed prefill" : "a failed append");
    }
    s->len[l] += done;
    release(w, s, l);
    if (prefill && done) { /* the last row is the decode after it, to the bit */
        float out[64 * 64];
        ck_assert_int_eq(pkv_decode(s->s, l, q + (n - 1) * qd, out), PKV_OK);
        ck_assert_msg(memcmp(out, o + (n - 1) * od, od * sizeof(float)) == 0,
                      "prefill's last row differs from decode (seed %llu)",
                      (unsigned long long)w->seed);
    }
    free(before);
    free(k);
    free(v);
    free(q);
    free(o);
}

/* Verify a small random tree on every layer, then keep a random root-to-node path of
 * it (or none): the kept rows become the model's next positions (the other drafts
 * hold rows no position has), and the last kept draft's verify output is, to the bit,
 * the decode after the commit. While the drafts are pending an append is PKV_ESTATE
 * and changes nothing. */
static void op_verify(world *w, slot *s)
{
    enum { NMAX = 4 };
    const uint32_t n = 1 + pkvt_below(&w->r, NMAX);
    for (uint32_t l = 0; l < NL; l++)
        if (s->len[l] + n > s->first + MAX_NEW)
            return;
    int32_t par[NMAX];
    uint32_t depth[NMAX], path[NMAX], n_keep = 0;
    bool on_path[NMAX] = {false};
    for (uint32_t i = 0; i < n; i++) {
        par[i] = (int32_t)pkvt_below(&w->r, i + 1) - 1;
        depth[i] = par[i] < 0 ? 0 : depth[par[i]] + 1;
    }
    if (pkvt_below(&w->r, 4)) { /* a node and its ancestors, root first */
        int32_t x = (int32_t)pkvt_below(&w->r, n);
        n_keep = depth[x] + 1;
        for (uint32_t j = n_keep; j-- > 0; x = par[x]) {
            path[j] = (uint32_t)x;
            on_path[x] = true;
        }
    }
    const size_t gk = (size_t)w->g * w->d, gv = (size_t)w->g * w->dv;
    const size_t qd = (size_t)w->h * w->d, od = (size_t)w->h * w->dv;
    float *k = pkvt_calloc(n, gk * sizeof(float)), *v = pkvt_calloc(n, gv * sizeof(float));
    float *q = pkvt_calloc(n, qd * sizeof(float));
    float *o = pkvt_calloc((size_t)NL * n, od * sizeof(float));
    uint64_t len0[NL];
    snap *before = malloc(sizeof *before);
    ck_assert_ptr_nonnull(before);
    take(w, s, before);
    pkv_status st = PKV_OK;
    uint32_t verified = 0;
    for (; verified < NL && st == PKV_OK; verified += st == PKV_OK) {
        const uint32_t l = verified;
        len0[l] = s->len[l];
        for (uint32_t i = 0; i < n; i++) {
            const uint64_t p = s->len[l] + depth[i];
            const int32_t id = on_path[i] ? id_at(w, s, p) : 100000 + (int32_t)i;
            row_of(w, id, p, l, k + i * gk, v + i * gv);
            memcpy(q + i * qd, query(w, (uint32_t)p + 7 * i), qd * sizeof(float));
        }
        st = pkv_verify(s->s, l, n, par, q, k, v, o + (size_t)l * n * od);
    }
    if (st == PKV_OK) {
        snap *mid = malloc(sizeof *mid);
        ck_assert_ptr_nonnull(mid);
        take(w, s, mid);
        failed(w, pkv_append(s->s, 0, k, v), PKV_ESTATE, "pkv_append");
        unchanged(w, s, mid, "an append while drafts are pending");
        free(mid);
        st = pkv_session_commit(s->s, n_keep, path);
    }
    if (st != PKV_OK) {
        ck_assert_msg(out_of_room(w, st), "verify/commit: %s (seed %llu)", pkv_status_str(st),
                      (unsigned long long)w->seed);
        w->enomem++;
        const pkv_status drop = pkv_session_commit(s->s, 0, NULL); /* never fails */
        ck_assert(drop == (verified ? PKV_OK : PKV_ESTATE));
        if (verified == 0)
            unchanged(w, s, before, "a failed verify");
    } else {
        w->verified++;
        for (uint32_t l = 0; l < NL; l++) {
            s->len[l] += n_keep;
            release(w, s, l);
        }
        for (uint32_t l = 0; n_keep && l < NL; l++) {
            const uint32_t i = path[n_keep - 1];
            float out[64 * 64];
            ck_assert_int_eq(pkv_decode(s->s, l, query(w, (uint32_t)(len0[l] + depth[i]) +
                                                          7 * i), out), PKV_OK);
            ck_assert_msg(memcmp(out, o + ((size_t)l * n + i) * od, od * sizeof(float)) == 0,
                          "layer %u: the kept draft's verify output differs from the decode "
                          "after commit (seed %llu)", l, (unsigned long long)w->seed);
        }
    }
    free(before);
    free(k);
    free(v);
    free(q);
    free(o);
}

static void op_truncate(world *w, slot *s)
{
    const uint64_t top = max_len(s);
    uint64_t n;
    const uint64_t room = top - s->first; /* positions of its own */
    switch (pkvt_below(&w->r, 5)) {
    case 0: n = top + 1 + pkvt_below(&w->r, 3); break;       /* past the end */
    case 1: /* below a shard's first position, or anywhere */
        n = s->first ? s->first - 1 - pkvt_below(&w->r, 2)
                     : pkvt_below(&w->r, (uint32_t)top + 1);
        break;
    default: /* a rollback: a few positions back */
        n = room ? top - 1 - pkvt_below(&w->r, (uint32_t)(room < 8 ? room : 8)) : top;
    }
    bool ok = n <= top && n >= s->first;
    for (uint32_t l = 0; ok && l < NL; l++)
        ok = truncate_allowed(w, s, l, n);
    snap *before = malloc(sizeof *before);
    take(w, s, before);
    const pkv_status st = pkv_session_truncate(s->s, n);
    if (ok) {
        ck_assert_msg(st == PKV_OK, "truncate to %llu: %s, model allows it (seed %llu)",
                      (unsigned long long)n, pkv_status_str(st), (unsigned long long)w->seed);
        model_truncate(w, s, n);
    } else {
        failed(w, st, PKV_ERANGE, "pkv_session_truncate");
        unchanged(w, s, before, "a refused truncate");
        w->window_refusals += n <= top && n >= s->first;
    }
    free(before);
}

static void op_fork(world *w, slot *s)
{
    const int i = free_slot(w);
    if (i < 0)
        return;
    pkv_session *f = NULL;
    const pkv_status st = pkv_session_fork(s->s, &f);
    if (st != PKV_OK) {
        ck_assert(out_of_room(w, st));
        return;
    }
    model_copy(&w->sl[i], s, f);
}

static void op_destroy(slot *s)
{
    pkv_session_destroy(s->s);
    model_free(s);
}

/* Save s; PKV_OK means a file that checks, loads and decodes as s; the loaded copy
 * takes a free slot. */
static void op_save_load(world *w, slot *s)
{
    size_t n_old = 0;
    unsigned char *old = pkvt_read_file(w->path, &n_old);
    const pkv_status st = pkv_session_save(s->s, w->path);
    if (st != PKV_OK) {
        ck_assert_msg(out_of_room(w, st), "save: %s (seed %llu)", pkv_status_str(st),
                      (unsigned long long)w->seed);
        size_t n_now = 0;
        unsigned char *now = pkvt_read_file(w->path, &n_now);
        ck_assert(n_now == n_old && (!old || memcmp(old, now, n_old) == 0));
        free(now);
        free(old);
        return;
    }
    free(old);
    w->saves++;
    w->shard_saves += s->first != 0;
    pkv_file_info fi;
    const pkv_status ck = pkv_session_file_check(w->path, &fi, NULL, 0);
    ck_assert_msg(ck == PKV_OK, "a save said OK, the file check %s (%s) (seed %llu)",
                  pkv_status_str(ck), fi.reason, (unsigned long long)w->seed);
    ck_assert_uint_eq(fi.n_token_ids, s->n_tokens);
    pkv_session *x = NULL;
    const pkv_status ld = pkv_session_load(w->e, w->path, &x);
    if (out_of_room(w, ld))
        return;
    ck_assert_msg(ld == PKV_OK, "a save said OK, load %s (seed %llu)", pkv_status_str(ld),
                  (unsigned long long)w->seed);
    const int i = free_slot(w);
    slot tmp;
    model_copy(&tmp, s, x);
    check_shape(w, &tmp, "a loaded session");
    for (uint32_t l = 0; l < NL; l++) { /* bitwise the original's decode */
        float a[64 * 64], b[64 * 64];
        const float *q = query(w, 900 + l);
        const pkv_status sa = pkv_decode(s->s, l, q, a), sb = pkv_decode(x, l, q, b);
        ck_assert_int_eq(sa, sb);
        ck_assert(sa != PKV_OK || memcmp(a, b, (size_t)w->h * w->dv * sizeof(float)) == 0);
    }
    if (i < 0) {
        pkv_session_destroy(x);
        model_free(&tmp);
    } else {
        w->sl[i] = tmp;
    }
}

static void op_tokens(world *w, slot *s)
{
    uint64_t n = s->len[0];
    for (uint32_t l = 1; l < NL; l++)
        n = s->len[l] < n ? s->len[l] : n;
    n = n ? pkvt_below(&w->r, (uint32_t)n + 1) : 0;
    if (n < s->n_tokens)
        n = s->n_tokens;
    for (uint64_t p = 0; p < n; p++)
        id_at(w, s, p);
    const pkv_status st = pkv_session_set_tokens(s->s, n, s->ids);
    if (st == PKV_OK)
        s->n_tokens = n;
    else
        ck_assert(out_of_room(w, st));
}

static void op_from_prefix(world *w)
{
    const int i = free_slot(w);
    if (i < 0)
        return;
    const uint64_t n = 1 + pkvt_below(&w->r, PROMPT);
    pkv_session *x = NULL;
    uint64_t got = 0;
    const pkv_status st = pkv_session_from_prefix(w->e, n, w->prompt, &x, &got);
    if (st != PKV_OK) {
        ck_assert(out_of_room(w, st));
        return;
    }
    ck_assert(got <= n - 1 && got % w->bt == 0);
    w->prefix_hits += got != 0;
    slot *s = &w->sl[i];
    memset(s, 0, sizeof *s);
    s->s = x;
    s->diverge = n;
    for (uint64_t p = 0; p < got; p++)
        id_at(w, s, p);
    for (uint32_t l = 0; l < NL; l++) {
        s->len[l] = got;
        release(w, s, l); /* a cold session of that length has the same hole */
    }
    s->n_tokens = got;
}

/* One bad call of a random kind on s: its failure status, a reason in its name,
 * nothing changed. */
static void op_bad(world *w, slot *s)
{
    snap *before = malloc(sizeof *before);
    take(w, s, before);
    float k[4096], o[4096];
    memset(k, 0, sizeof k);
    float *q = query(w, 3);
    uint32_t n = 0;
    switch (pkvt_below(&w->r, 13)) {
    case 0: failed(w, pkv_append(s->s, NL, k, k), PKV_EINVAL, "pkv_append"); break;
    case 1: failed(w, pkv_append(s->s, 0, k, NULL), PKV_EINVAL, "pkv_append"); break;
    case 2: failed(w, pkv_decode(s->s, NL, q, o), PKV_EINVAL, "pkv_decode"); break;
    case 3: failed(w, pkv_prefill(s->s, 0, 0, q, k, k, o), PKV_EINVAL, "pkv_prefill"); break;
    case 4:
        failed(w, pkv_session_truncate(s->s, max_len(s) + 1), PKV_ERANGE,
               "pkv_session_truncate");
        break;
    case 5:
        failed(w, pkv_session_set_first(s->s, pkv_shard_align(w->e) + 1), PKV_EINVAL,
               "pkv_session_set_first");
        break;
    case 6:
        if (s->len[0] > s->first)
            failed(w, pkv_decode_partial_at(s->s, 0, UINT64_MAX, q, 8, o, &n), PKV_EINVAL,
                   "pkv_decode_partial_at");
        else
            failed(w, pkv_decode(s->s, 0, q, o), PKV_ESTATE, "pkv_decode");
        break;
    case 7:
        if (s->n_tokens) {
            int32_t *ids = malloc(s->n_tokens * sizeof *ids);
            memcpy(ids, s->ids, s->n_tokens * sizeof *ids);
            ids[pkvt_below(&w->r, (uint32_t)s->n_tokens)] ^= 0x40000000;
            failed(w, pkv_session_set_tokens(s->s, s->n_tokens, ids), PKV_EINVAL,
                   "pkv_session_set_tokens");
            free(ids);
        } else {
            static const int32_t some[1] = {7};
            failed(w, pkv_session_set_tokens(s->s, max_len(s) + 1, some), PKV_ERANGE,
                   "pkv_session_set_tokens");
        }
        break;
    case 8: failed(w, pkv_session_save(s->s, ""), PKV_EINVAL, "pkv_session_save"); break;
    case 9: {
        pkv_session *x = (pkv_session *)w;
        failed(w, pkv_session_load(w->e, w->junk, &x), PKV_EINVAL, "pkv_session_load");
        ck_assert_ptr_eq(x, (pkv_session *)w);
        break;
    }
    case 10: {
        pkv_session *const two[2] = {s->s, s->s};
        float qq[2 * 64 * 64];
        memcpy(qq, q, (size_t)w->h * w->d * sizeof(float));
        memcpy(qq + (size_t)w->h * w->d, q, (size_t)w->h * w->d * sizeof(float));
        failed(w, pkv_decode_batch(w->e, 0, 2, two, qq, o), PKV_EINVAL, "pkv_decode_batch");
        break;
    }
    case 11: { /* SPEC §14: a discard the session refuses (these engines have no rope) */
        const uint64_t top = max_len(s);
        if (pkvt_below(&w->r, 2))
            failed(w, pkv_session_discard(s->s, top + 1, top), PKV_EINVAL,
                   "pkv_session_discard");
        else
            failed(w, pkv_session_discard(s->s, s->first, top + 1), PKV_ERANGE,
                   "pkv_session_discard");
        break;
    }
    default: failed(w, pkv_session_fork(s->s, NULL), PKV_EINVAL, "pkv_session_fork"); break;
    }
    unchanged(w, s, before, "a bad call");
    free(before);
}

/* A batch of the live sessions' layer l: bitwise their own decodes. */
static void op_batch(world *w)
{
    const uint32_t l = pkvt_below(&w->r, NL);
    pkv_session *ss[SLOTS];
    uint32_t n = 0;
    for (int i = 0; i < SLOTS; i++)
        if (w->sl[i].s && w->sl[i].len[l] > w->sl[i].first)
            ss[n++] = w->sl[i].s;
    if (n == 0)
        return;
    const size_t qd = (size_t)w->h * w->d, od = (size_t)w->h * w->dv;
    float *q = pkvt_calloc(n, qd * sizeof(float)), *o = pkvt_calloc(n, od * sizeof(float));
    for (uint32_t i = 0; i < n; i++)
        memcpy(q + i * qd, query(w, 40 + i), qd * sizeof(float));
    const pkv_status st = pkv_decode_batch(w->e, l, n, ss, q, o);
    if (out_of_room(w, st)) { /* the batch's layers together pass the budget */
        free(q);
        free(o);
        return;
    }
    ck_assert_msg(st == PKV_OK, "batch: %s (seed %llu)", pkv_status_str(st),
                  (unsigned long long)w->seed);
    for (uint32_t i = 0; i < n; i++) {
        float one[64 * 64];
        ck_assert_int_eq(pkv_decode(ss[i], l, q + i * qd, one), PKV_OK);
        ck_assert_msg(memcmp(one, o + i * od, od * sizeof(float)) == 0,
                      "batch row %u differs from its decode (seed %llu)", i,
                      (unsigned long long)w->seed);
    }
    free(q);
    free(o);
}

/* ---- engines and the walk ------------------------------------------------------------------ */

/* Engine `idx` of the walk: the budget modes (spill, a bare budget, none) and the
 * dtypes take turns, so that even a short run meets each; the rest is random. */
static void make_engine(world *w, int idx)
{
    static const pkv_dtype dts[5] = {PKV_F32, PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};
    static const uint32_t bts[6] = {1, 2, 3, 4, 5, 16};
    static const uint32_t dims[4] = {8, 5, 33, 16};
    pkvt_rng *r = &w->r;
    w->h = 4;
    w->g = pkvt_below(r, 2) ? 2 : 1;
    w->d = dims[pkvt_below(r, 4)];
    w->dv = pkvt_below(r, 3) ? w->d : 3 + pkvt_below(r, 12);
    w->bt = bts[pkvt_below(r, 6)];
    const pkv_dtype dt = dts[(idx + pkvt_below(r, 2)) % 5];
    w->c = pkvt_config(NL, w->h, w->g, w->d, w->bt, dt);
    w->c.head_dim_v = w->dv;
    w->quant_dot = (dt == PKV_Q8 || dt == PKV_Q4) && pkvt_below(r, 2);
    w->c.quant_dot = w->quant_dot;
    memset(w->lc, 0, sizeof w->lc);
    for (int i = 0; i < 8; i++)
        w->logits[i] = pkvt_uniform(r, -1.0f, 2.0f);
    if (pkvt_below(r, 3) == 0)
        w->lc[0].softcap = 5.0f;
    w->lc[1].window = 2 + pkvt_below(r, 10);
    w->lc[1].sink_tokens = pkvt_below(r, 4);
    w->lc[1].rollback_tokens = pkvt_below(r, 5);
    if (pkvt_below(r, 2))
        w->lc[1].softcap = 3.0f;
    w->lc[2].sink_logits = w->logits;
    if (pkvt_below(r, 2)) {
        w->lc[2].window = 1 + pkvt_below(r, 20);
        w->lc[2].rollback_tokens = pkvt_below(r, 3);
    }
    w->c.layer_cfg = w->lc;
    w->c.n_threads = 1 + pkvt_below(r, 2);
    w->c.prefix_cache_bytes = pkvt_below(r, 2) ? 0 : 1u << 16;
    /* a budget that every layer's decode fits in, but not every session: spilled
     * pages with a spill_dir, PKV_ENOMEM without */
    const uint64_t page = (uint64_t)w->g * w->bt *
                          (pkv_row_bytes(dt, w->d) + pkv_row_bytes(dt, w->dv));
    const uint64_t layer_pages = (MAX_NEW + w->lc[1].sink_tokens) / w->bt + 3;
    w->budget_pages = 0;
    w->c.spill_dir = NULL;
    switch (idx % 3) {
    case 0:
        w->budget_pages = layer_pages * 3;
        w->c.spill_dir = w->dir;
        break;
    case 1:
        w->budget_pages = layer_pages * 4;
        break;
    default:
        break;
    }
    w->c.mem_budget = w->budget_pages * page;
    w->e = w->c.n_threads > 1 ? pkvt_engine_workers(&w->c) : pkvt_engine_cfg(&w->c);
    pkv_config got;
    ck_assert_int_eq(pkv_engine_config(w->e, &got), PKV_OK);
    w->c.scale = got.scale;
    for (int i = 0; i < PROMPT; i++)
        w->prompt[i] = (int32_t)pkvt_below(r, 50);
}

static void walk(world *w, int ops)
{
    for (int op = 0; op < ops; op++) {
        slot *s = &w->sl[0];
        const int li = live_slot(w);
        if (li < 0 || pkvt_below(&w->r, 12) == 0) {
            if (pkvt_below(&w->r, 3) == 0)
                op_from_prefix(w);
            else
                op_create(w);
            continue;
        }
        s = &w->sl[li];
        const uint32_t l = pkvt_below(&w->r, NL);
        const uint32_t k = pkvt_below(&w->r, 100);
        if (k < 30) {
            const uint32_t n = 1 + pkvt_below(&w->r, 6);
            if (pkvt_below(&w->r, 2))
                for (uint32_t a = 0; a < NL; a++)
                    op_write(w, s, a, n, false);
            else
                op_write(w, s, l, n, false);
        } else if (k < 38) {
            op_write(w, s, l, 1 + pkvt_below(&w->r, 9), true);
        } else if (k < 48) {
            op_truncate(w, s);
        } else if (k < 54) {
            op_fork(w, s);
        } else if (k < 59) {
            op_destroy(s);
            continue;
        } else if (k < 65) {
            op_save_load(w, s);
        } else if (k < 71) {
            op_tokens(w, s);
        } else if (k < 75) {
            op_batch(w);
        } else if (k < 87) {
            op_bad(w, s);
        } else if (k < 90) {
            op_verify(w, s);
        } else {
            check_decode(w, s, l, "decode");
        }
        ck_assert_msg(pkv_engine_check(w->e) == PKV_OK, "invariants broken after op %d "
                      "(seed %llu)", op, (unsigned long long)w->seed);
        pkv_stats est;
        ck_assert_int_eq(pkv_engine_stats(w->e, &est), PKV_OK);
        w->spilled += est.pages_spilled != 0;
        if (s->s)
            check_slot(w, s, "after the step");
    }
    for (int i = 0; i < SLOTS; i++) /* a final sweep */
        if (w->sl[i].s)
            check_slot(w, &w->sl[i], "final sweep");
}

START_TEST(crossings_hold)
{
    /* the slow suite's run (PKV_TEST_LONG=1) walks four times the engines, longer */
    const char *lg = getenv("PKV_TEST_LONG");
    const bool long_run = lg && strcmp(lg, "1") == 0;
    const int engines = pkvt_quick() ? 6 : long_run ? 64 : 16;
    const int ops = pkvt_quick() ? 120 : long_run ? 600 : 250;
    world *w = calloc(1, sizeof *w);
    ck_assert_ptr_nonnull(w);
    pkvt_scratch_dir(w->dir, sizeof w->dir, "crossings");
    snprintf(w->path, sizeof w->path, "%s/s.pkv", w->dir);
    snprintf(w->junk, sizeof w->junk, "%s/junk", w->dir);
    pkvt_write_file(w->junk, "\x89PKV no session file", 20);
    long checks = 0, fails = 0, saves = 0, reached[6] = {0};
    for (int i = 0; i < engines; i++) {
        memset(w->sl, 0, sizeof w->sl);
        w->seed = pkvt_seed() + (uint64_t)i * 0x1000193u;
        pkvt_rng_init(&w->r, w->seed);
        make_engine(w, i);
        w->checks = w->failures_checked = w->saves = 0;
        w->window_refusals = w->shard_saves = w->prefix_hits = w->spilled = w->enomem = 0;
        w->verified = 0;
        walk(w, ops);
        checks += w->checks;
        fails += w->failures_checked;
        saves += w->saves;
        reached[0] += w->window_refusals;
        reached[1] += w->shard_saves;
        reached[2] += w->prefix_hits;
        reached[3] += w->spilled;
        reached[4] += w->enomem;
        reached[5] += w->verified;
        for (int j = 0; j < SLOTS; j++)
            if (w->sl[j].s)
                op_destroy(&w->sl[j]);
        ck_assert_int_eq(pkv_engine_check(w->e), PKV_OK);
        pkv_stats st;
        ck_assert_int_eq(pkv_engine_stats(w->e, &st), PKV_OK);
        ck_assert_uint_eq(st.pages_in_use, 0);
        pkv_engine_destroy(w->e);
    }
    fprintf(stderr, "crossings: %d engines, %ld reference checks, %ld refused calls, %ld "
                    "saves loaded; reached: %ld truncates refused by a window, %ld shard "
                    "saves, %ld prefix hits, %ld steps with spilled pages, %ld appends out "
                    "of budget, %ld verify + commit steps\n", engines, checks, fails, saves,
            reached[0], reached[1], reached[2], reached[3], reached[4], reached[5]);
    ck_assert_int_gt(checks, engines * 10);
    ck_assert_int_gt(fails, engines);
    ck_assert_int_gt(saves, engines / 2);
    if (!pkvt_quick()) /* the full walk reaches every crossing */
        for (int i = 0; i < 6; i++)
            ck_assert_msg(reached[i] > 0, "crossing %d never reached (seed %llu)", i,
                          (unsigned long long)pkvt_seed());
    pkvt_remove_dir(w->dir);
    free(w);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("crossings");
    TCase *tc = tcase_create("crossings");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, crossings_hold);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

/*
 * test_verify.c - pkv_verify and pkv_session_commit (docs/speculative.md): a tree of drafts
 * verified in one call gives every draft, to the bit, the output token-by-token append
 * + decode along its path gives, and a commit of any path leaves the session as if that
 * path had been appended (every later decode the same bits); bad trees, bad paths and
 * a budget that runs out are statuses that change nothing; the calls that cannot run
 * while drafts are pending say so; a random walk mixes verify and commit with append,
 * fork, truncate, prefix reuse, save and load against a model of the accepted rows.
 *
 * The reference of a draft is a fork of the session's base that appends the draft's
 * ancestors and decodes (pkv_append + pkv_decode, the path every other suite holds
 * against the double oracle); plain layers are checked against the oracle as well.
 */
#include "testutil.h"
#include "internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { LMAX = 3, HMAX = 12, NMAX = 64 };

/* ---- random engines -------------------------------------------------------------- */

typedef struct {
    pkv_config c;
    pkv_layer_config lc[LMAX];
    float logits[LMAX * HMAX];
    uint32_t threads;
} rcase;

static const uint32_t hg_pairs[][2] = {{1, 1}, {2, 1}, {4, 2}, {6, 3}, {8, 2}, {4, 4},
                                       {12, 3}, {8, 1}};
static const uint32_t dims[] = {1, 3, 8, 17, 32};
static const uint32_t bts[] = {1, 2, 3, 4, 5, 8, 16};

static void random_case(pkvt_rng *r, rcase *k)
{
    memset(k, 0, sizeof *k);
    const uint32_t *hg = hg_pairs[pkvt_below(r, sizeof hg_pairs / sizeof *hg_pairs)];
    const uint32_t d = dims[pkvt_below(r, 5)];
    k->c = pkvt_config(2 + pkvt_below(r, 2), hg[0], hg[1], d, bts[pkvt_below(r, 7)],
                       (pkv_dtype)pkvt_below(r, 5));
    if (pkvt_below(r, 3) == 0)
        k->c.head_dim_v = 1 + pkvt_below(r, 20);
    if ((k->c.kv_dtype == PKV_Q8 || k->c.kv_dtype == PKV_Q4) && pkvt_below(r, 2))
        k->c.quant_dot = 1;
    for (uint32_t l = 0; l < k->c.n_layers; l++) {
        pkv_layer_config *lc = &k->lc[l];
        switch (pkvt_below(r, 6)) {
        case 0: /* a window, sinks, rollback */
            lc->window = 1 + pkvt_below(r, 24);
            lc->sink_tokens = pkvt_below(r, 4);
            lc->rollback_tokens = pkvt_below(r, 7);
            break;
        case 1:
            lc->softcap = 5.0f + (float)pkvt_below(r, 30);
            break;
        case 2: /* sink logits, with a window sometimes */
            for (uint32_t i = 0; i < hg[0]; i++)
                k->logits[l * HMAX + i] = pkvt_uniform(r, -2.0f, 2.0f);
            lc->sink_logits = k->logits + l * HMAX;
            if (pkvt_below(r, 2))
                lc->window = 2 + pkvt_below(r, 9);
            break;
        default:
            break;
        }
    }
    k->c.layer_cfg = k->lc;
    k->threads = 1 + pkvt_below(r, 3);
    k->c.n_threads = k->threads;
}

static pkv_engine *case_engine(const rcase *k)
{
    return k->threads > 1 ? pkvt_engine_workers(&k->c) : pkvt_engine_cfg(&k->c);
}

/* ---- rows and trees ----------------------------------------------------------------- */

/* Draft rows of one layer: q [n][h][d], k [n][g][d], v [n][g][dv]. */
typedef struct {
    float *q, *k, *v;
} rows;

static rows random_rows(pkvt_rng *r, const pkv_config *c, uint32_t n)
{
    const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
    rows x = {pkvt_calloc((uint64_t)n * c->n_heads * c->head_dim, sizeof(float)),
              pkvt_calloc((uint64_t)n * c->n_kv_heads * c->head_dim, sizeof(float)),
              pkvt_calloc((uint64_t)n * c->n_kv_heads * dv, sizeof(float))};
    pkvt_fill(r, x.q, (size_t)n * c->n_heads * c->head_dim, -1.5f, 1.5f);
    pkvt_fill(r, x.k, (size_t)n * c->n_kv_heads * c->head_dim, -1.5f, 1.5f);
    pkvt_fill(r, x.v, (size_t)n * c->n_kv_heads * dv, -2.0f, 2.0f);
    return x;
}

static void rows_free(rows *x)
{
    free(x->q);
    free(x->k);
    free(x->v);
}

/* A random tree of n drafts, depth below max_depth: a chain, a star or random. */
static void random_tree(pkvt_rng *r, uint32_t n, uint32_t max_depth, int32_t *parent)
{
    uint32_t depth[PKV_VERIFY_MAX_DRAFTS];
    const uint32_t kind = pkvt_below(r, 5);
    for (uint32_t i = 0; i < n; i++) {
        int32_t p;
        if (kind == 0)
            p = (int32_t)i - 1;
        else if (kind == 1)
            p = -1;
        else
            do
                p = (int32_t)pkvt_below(r, i + 1) - 1;
            while (p >= 0 && depth[p] + 1 >= max_depth);
        parent[i] = p;
        depth[i] = p < 0 ? 0 : depth[p] + 1;
    }
}

/* The path root..i of the tree, into path; its length. */
static uint32_t path_to(const int32_t *parent, uint32_t i, uint32_t *path)
{
    uint32_t n = 0, rev[PKV_VERIFY_MAX_DRAFTS];
    for (int32_t a = (int32_t)i; a >= 0; a = parent[a])
        rev[n++] = (uint32_t)a;
    for (uint32_t j = 0; j < n; j++)
        path[j] = rev[n - 1 - j];
    return n;
}

/* ---- the reference: append + decode along a path -------------------------------------- */

/* Append the path's rows to `layer` of s. */
static void append_path(pkv_session *s, const pkv_config *c, uint32_t layer,
                        const rows *x, const uint32_t *path, uint32_t n)
{
    const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
    for (uint32_t j = 0; j < n; j++)
        ck_assert_int_eq(pkv_append(s, layer, x->k + (size_t)path[j] * c->n_kv_heads * c->head_dim,
                                    x->v + (size_t)path[j] * c->n_kv_heads * dv),
                         PKV_OK);
}

/* Every draft's output out[i] against a fork of base that appends its path and
 * decodes: the same bits. */
static void check_drafts(pkv_session *base, const pkv_config *c, uint32_t layer, uint32_t n,
                         const int32_t *parent, const rows *x, const float *out,
                         uint64_t seed)
{
    const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
    const size_t od = (size_t)c->n_heads * dv, qd = (size_t)c->n_heads * c->head_dim;
    float *ref = pkvt_calloc(od, sizeof(float));
    uint32_t path[PKV_VERIFY_MAX_DRAFTS];
    for (uint32_t i = 0; i < n; i++) {
        pkv_session *t = NULL;
        ck_assert_int_eq(pkv_session_fork(base, &t), PKV_OK);
        append_path(t, c, layer, x, path, path_to(parent, i, path));
        ck_assert_int_eq(pkv_decode(t, layer, x->q + i * qd, ref), PKV_OK);
        ck_assert_msg(memcmp(ref, out + i * od, od * sizeof(float)) == 0,
                      "seed %llu: layer %u draft %u of %u differs from append + decode",
                      (unsigned long long)seed, layer, i, n);
        pkv_session_destroy(t);
    }
    free(ref);
}

/* decode of q on a and b, same bits, on every layer. */
static void same_decodes(pkv_session *a, pkv_session *b, const pkv_config *c, pkvt_rng *r,
                         const char *what, uint64_t seed)
{
    const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
    const size_t od = (size_t)c->n_heads * dv, qd = (size_t)c->n_heads * c->head_dim;
    float *q = pkvt_calloc(qd, sizeof(float));
    float *oa = pkvt_calloc(od, sizeof(float)), *ob = pkvt_calloc(od, sizeof(float));
    for (uint32_t l = 0; l < c->n_layers; l++) {
        ck_assert_uint_eq(pkv_session_len(a, l), pkv_session_len(b, l));
        if (pkv_session_len(a, l) == 0)
            continue;
        pkvt_fill(r, q, qd, -1.5f, 1.5f);
        ck_assert_int_eq(pkv_decode(a, l, q, oa), PKV_OK);
        ck_assert_int_eq(pkv_decode(b, l, q, ob), PKV_OK);
        ck_assert_msg(memcmp(oa, ob, od * sizeof(float)) == 0,
                      "seed %llu: %s: layer %u decodes differ", (unsigned long long)seed, what,
                      l);
    }
    free(q);
    free(oa);
    free(ob);
}

/* The double oracle on a plain layer of an f32 engine: every draft within 1e-5 x
 * max|V| of full attention over the base's rows and its path (the base's rows are
 * given as kb, vb [n0][g][d]). */
static void oracle_drafts(const pkv_config *c, uint64_t n0, const float *kb, const float *vb,
                          uint32_t n, const int32_t *parent, const rows *x, const float *out)
{
    const uint32_t h = c->n_heads, g = c->n_kv_heads, d = c->head_dim;
    const size_t row = (size_t)g * d;
    float *K = pkvt_calloc((n0 + NMAX) * row, sizeof(float));
    float *V = pkvt_calloc((n0 + NMAX) * row, sizeof(float));
    double *ref = pkvt_calloc((size_t)h * d, sizeof(double));
    memcpy(K, kb, n0 * row * sizeof(float));
    memcpy(V, vb, n0 * row * sizeof(float));
    uint32_t path[NMAX];
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t m = path_to(parent, i, path);
        for (uint32_t j = 0; j < m; j++) {
            memcpy(K + (n0 + j) * row, x->k + path[j] * row, row * sizeof(float));
            memcpy(V + (n0 + j) * row, x->v + path[j] * row, row * sizeof(float));
        }
        pkvt_ref_decode(h, g, d, 0.0f, PKV_F32, n0 + m, x->q + (size_t)i * h * d, K, V, ref);
        const float vmax = pkvt_maxabs(V, (n0 + m) * row);
        ck_assert(pkvt_maxdiff_fd(out + (size_t)i * h * d, ref, (size_t)h * d) <=
                  1e-5 * (vmax > 1 ? vmax : 1));
    }
    free(K);
    free(V);
    free(ref);
}

/* ---- verify and commit over random trees ---------------------------------------------- */

/* How the verified session relates to its base. */
enum { AS_FORK, AS_COPY, AS_PREFIX, N_MODES };

static void one_random_case(uint64_t seed, uint32_t max_n)
{
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    rcase k;
    random_case(&r, &k);
    const pkv_config *c = &k.c;
    pkv_engine *e = case_engine(&k);
    const uint32_t L = c->n_layers, mode = pkvt_below(&r, N_MODES);
    const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
    const size_t kd = (size_t)c->n_kv_heads * c->head_dim, vd = (size_t)c->n_kv_heads * dv;
    /* the base: a shard sometimes, then n0 rows (sometimes past a split-K chunk) */
    pkv_session *base = pkvt_session(e);
    const bool shard = pkvt_below(&r, 6) == 0;
    if (shard)
        ck_assert_int_eq(pkv_session_set_first(base, pkv_shard_align(e)), PKV_OK);
    const uint64_t n0 = pkvt_below(&r, 8) == 0 ? 500 + pkvt_below(&r, 700)
                                                 : pkvt_below(&r, 4 * c->block_tokens + 6);
    /* the base's rows, [layer][n0][g][d] */
    float *kb = pkvt_calloc(L * n0 * kd + 1, sizeof(float));
    float *vb = pkvt_calloc(L * n0 * vd + 1, sizeof(float));
    pkvt_fill(&r, kb, L * n0 * kd, -1.5f, 1.5f);
    pkvt_fill(&r, vb, L * n0 * vd, -2.0f, 2.0f);
    int32_t *ids = pkvt_calloc(n0 + 1, sizeof(int32_t));
    for (uint64_t i = 0; i < n0 + 1; i++)
        ids[i] = (int32_t)(i * 7 + 1);
    for (uint32_t l = 0; l < L; l++)
        for (uint64_t i = 0; i < n0; i++)
            ck_assert_int_eq(pkv_append(base, l, kb + (l * n0 + i) * kd, vb + (l * n0 + i) * vd),
                             PKV_OK);
    pkv_session *s = NULL;
    uint64_t from = 0; /* s holds the base's first `from` rows; it appends the rest */
    if (mode == AS_FORK || shard) {
        ck_assert_int_eq(pkv_session_fork(base, &s), PKV_OK);
        from = n0;
    } else if (mode == AS_PREFIX) { /* sharing the base's recorded full pages */
        ck_assert_int_eq(pkv_session_set_tokens(base, n0, ids), PKV_OK);
        ck_assert_int_eq(pkv_session_from_prefix(e, n0 + 1, ids, &s, &from), PKV_OK);
    } else {
        s = pkvt_session(e);
    }
    for (uint32_t l = 0; l < L; l++)
        for (uint64_t i = from; i < n0; i++)
            ck_assert_int_eq(pkv_append(s, l, kb + (l * n0 + i) * kd, vb + (l * n0 + i) * vd),
                             PKV_OK);

    const uint32_t n = 1 + pkvt_below(&r, max_n);
    int32_t parent[NMAX];
    random_tree(&r, n, 2 + pkvt_below(&r, 15), parent);
    rows x[LMAX];
    float *out = pkvt_calloc((size_t)n * c->n_heads * dv, sizeof(float));
    for (uint32_t l = 0; l < L; l++) {
        x[l] = random_rows(&r, c, n);
        if (pkvt_below(&r, 4) == 0) { /* a verify the next one replaces */
            int32_t other[NMAX];
            const uint32_t m = 1 + pkvt_below(&r, NMAX);
            random_tree(&r, m, 16, other);
            rows y = random_rows(&r, c, m);
            float *o2 = pkvt_calloc((size_t)m * c->n_heads * dv, sizeof(float));
            ck_assert_int_eq(pkv_verify(s, l, m, other, y.q, y.k, y.v, o2), PKV_OK);
            free(o2);
            rows_free(&y);
        }
        ck_assert_int_eq(pkv_verify(s, l, n, parent, x[l].q, x[l].k, x[l].v, out), PKV_OK);
        ck_assert_uint_eq(pkv_session_len(s, l), pkv_session_len(base, l));
        check_drafts(base, c, l, n, parent, &x[l], out, seed);
        const pkv_layer_config *lc = &k.lc[l];
        if (c->kv_dtype == PKV_F32 && !lc->window && !lc->softcap && !lc->sink_logits &&
            dv == c->head_dim && !shard) {
            oracle_drafts(c, n0, kb + l * n0 * kd, vb + l * n0 * vd, n, parent, &x[l], out);
        }
    }
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);

    /* commit a path (or nothing), then the session is the base plus that path */
    uint32_t path[NMAX], n_keep = 0;
    if (pkvt_below(&r, 8))
        n_keep = path_to(parent, pkvt_below(&r, n), path);
    ck_assert_int_eq(pkv_session_commit(s, n_keep, path), PKV_OK);
    ck_assert_int_eq(pkv_session_commit(s, n_keep, path), PKV_ESTATE);
    pkv_session *twin = NULL;
    ck_assert_int_eq(pkv_session_fork(base, &twin), PKV_OK);
    for (uint32_t l = 0; l < L; l++)
        append_path(twin, c, l, &x[l], path, n_keep);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_memory ms, mt;
    ck_assert_int_eq(pkv_session_memory(s, &ms), PKV_OK);
    ck_assert_int_eq(pkv_session_memory(twin, &mt), PKV_OK);
    ck_assert_uint_eq(ms.tokens, mt.tokens);
    ck_assert_uint_eq(ms.blocks, mt.blocks);
    ck_assert_uint_eq(ms.bytes_ideal, mt.bytes_ideal);
    same_decodes(s, twin, c, &r, "after commit", seed);
    /* and after more rows: the pages a commit left are written like any */
    pkvt_rng ra = r, rb = r;
    const uint32_t more = 1 + pkvt_below(&r, c->block_tokens + 2);
    for (uint32_t l = 0; l < L; l++) {
        pkvt_append_random(s, &ra, l, more, 1.5f, 2.0f);
        pkvt_append_random(twin, &rb, l, more, 1.5f, 2.0f);
    }
    same_decodes(s, twin, c, &r, "after commit and appends", seed);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);

    for (uint32_t l = 0; l < L; l++)
        rows_free(&x[l]);
    free(out);
    free(kb);
    free(vb);
    free(ids);
    pkv_session_destroy(twin);
    pkv_session_destroy(s);
    pkv_session_destroy(base);
    pkv_stats st;
    ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
    ck_assert_uint_eq(st.pages_in_use, 0);
    pkv_engine_destroy(e);
}

START_TEST(random_trees_match_token_by_token)
{
    const uint64_t seed = pkvt_seed();
    const uint32_t cases = pkvt_quick() ? 25 : 160;
    for (uint32_t i = 0; i < cases; i++)
        one_random_case(seed + i * 0x9E3779B97F4A7C15ull, i % 4 == 0 ? NMAX : 16);
}
END_TEST

/* Every path of small trees (each node's path, and the empty one), on a fork each:
 * the commit of each equals the base plus that path. */
START_TEST(every_path_of_small_trees)
{
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    const uint32_t trees = pkvt_quick() ? 4 : 16;
    for (uint32_t tr = 0; tr < trees; tr++) {
        rcase k;
        random_case(&r, &k);
        const pkv_config *c = &k.c;
        pkv_engine *e = case_engine(&k);
        pkv_session *base = pkvt_session(e);
        for (uint32_t l = 0; l < c->n_layers; l++)
            pkvt_append_random(base, &r, l, pkvt_below(&r, 3 * c->block_tokens), 1.5f, 2.0f);
        const uint32_t n = 1 + pkvt_below(&r, 7);
        int32_t parent[8];
        random_tree(&r, n, 8, parent);
        rows x[LMAX];
        for (uint32_t l = 0; l < c->n_layers; l++)
            x[l] = random_rows(&r, c, n);
        const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
        float *out = pkvt_calloc((size_t)n * c->n_heads * dv, sizeof(float));
        for (uint32_t node = 0; node <= n; node++) { /* node == n: keep nothing */
            pkv_session *s = NULL, *twin = NULL;
            ck_assert_int_eq(pkv_session_fork(base, &s), PKV_OK);
            for (uint32_t l = 0; l < c->n_layers; l++)
                ck_assert_int_eq(pkv_verify(s, l, n, parent, x[l].q, x[l].k, x[l].v, out),
                                 PKV_OK);
            uint32_t path[8], m = node < n ? path_to(parent, node, path) : 0;
            ck_assert_int_eq(pkv_session_commit(s, m, m ? path : NULL), PKV_OK);
            ck_assert_int_eq(pkv_session_fork(base, &twin), PKV_OK);
            for (uint32_t l = 0; l < c->n_layers; l++)
                append_path(twin, c, l, &x[l], path, m);
            same_decodes(s, twin, c, &r, "every path", seed);
            pkv_session_destroy(s);
            pkv_session_destroy(twin);
        }
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        for (uint32_t l = 0; l < c->n_layers; l++)
            rows_free(&x[l]);
        free(out);
        pkv_session_destroy(base);
        pkv_engine_destroy(e);
    }
}
END_TEST

/* A chain is a prefill that can be taken back: verify of a chain of n (up to
 * PKV_VERIFY_MAX_DRAFTS) gives every draft pkv_prefill's bits. */
START_TEST(a_chain_is_a_prefill)
{
    const uint32_t ns[] = {1, 2, 17, 100, PKV_VERIFY_MAX_DRAFTS};
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    for (uint32_t bi = 0; bi < 3; bi++) {
        const uint32_t bt = (uint32_t[]){1, 5, 16}[bi];
        pkv_config c = pkvt_config(1, 4, 2, 8, bt, (pkv_dtype)(bi == 1 ? PKV_Q8 : PKV_F16));
        pkv_engine *e = pkvt_engine_cfg(&c);
        for (uint32_t t = 0; t < sizeof ns / sizeof *ns; t++) {
            const uint32_t n = ns[t];
            pkv_session *a = pkvt_session(e);
            pkvt_append_random(a, &r, 0, pkvt_below(&r, 40), 1.5f, 2.0f);
            pkv_session *b = NULL;
            ck_assert_int_eq(pkv_session_fork(a, &b), PKV_OK);
            int32_t *parent = pkvt_calloc(n, sizeof(int32_t));
            uint32_t *path = pkvt_calloc(n, sizeof(uint32_t));
            for (uint32_t i = 0; i < n; i++)
                parent[i] = (int32_t)i - 1, path[i] = i;
            rows x = random_rows(&r, &c, n);
            float *o1 = pkvt_calloc((size_t)n * 4 * 8, sizeof(float));
            float *o2 = pkvt_calloc((size_t)n * 4 * 8, sizeof(float));
            ck_assert_int_eq(pkv_verify(a, 0, n, parent, x.q, x.k, x.v, o1), PKV_OK);
            ck_assert_int_eq(pkv_prefill(b, 0, n, x.q, x.k, x.v, o2), PKV_OK);
            ck_assert(memcmp(o1, o2, (size_t)n * 4 * 8 * sizeof(float)) == 0);
            const uint32_t keep = pkvt_below(&r, n + 1);
            ck_assert_int_eq(pkv_session_commit(a, keep, path), PKV_OK);
            ck_assert_uint_eq(pkv_session_len(a, 0), pkv_session_len(b, 0) - n + keep);
            ck_assert_int_eq(pkv_session_truncate(b, pkv_session_len(a, 0)), PKV_OK);
            same_decodes(a, b, &c, &r, "chain", pkvt_seed());
            rows_free(&x);
            free(o1);
            free(o2);
            free(parent);
            free(path);
            pkv_session_destroy(a);
            pkv_session_destroy(b);
        }
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        pkv_engine_destroy(e);
    }
}
END_TEST

/* ---- the batch scratch, one call at a time ---------------------------------------------
 * pkv_verify, pkv_prefill and a shared pkv_decode_batch take the engine's batch scratch
 * when it is free and allocate their own block when another call holds it
 * (attention/exec.c): a verify and a prefill on two threads, each on its own session of
 * one engine, over and over, give every time the bits each gave alone. */
typedef struct {
    pkv_session *s;
    uint32_t n, verify, iters;
    const int32_t *parent;
    const rows *x;
    const float *want;
    size_t nout;
    int bad; /* 1: a status, 2: other bits than alone (Check asserts only on the main thread) */
} race_arg;

static void *race_run(void *p)
{
    race_arg *a = p;
    float *o = malloc(a->nout * sizeof(float));
    for (uint32_t i = 0; o && i < a->iters && !a->bad; i++) {
        const uint64_t len = pkv_session_len(a->s, 0);
        const pkv_status st =
            a->verify ? pkv_verify(a->s, 0, a->n, a->parent, a->x->q, a->x->k, a->x->v, o)
                      : pkv_prefill(a->s, 0, a->n, a->x->q, a->x->k, a->x->v, o);
        if (st != PKV_OK)
            a->bad = 1;
        else if (memcmp(o, a->want, a->nout * sizeof(float)) != 0)
            a->bad = 2;
        if ((a->verify ? pkv_session_commit(a->s, 0, NULL) : pkv_session_truncate(a->s, len)) !=
            PKV_OK)
            a->bad = 1;
    }
    if (!o)
        a->bad = 1;
    free(o);
    return NULL;
}

START_TEST(batch_scratch_one_call_at_a_time)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 0x5c);
    pkv_config c = pkvt_config(1, 8, 2, 16, 4, PKV_F16);
    c.n_threads = 2;
    pkv_engine *e = pkvt_engine_workers(&c);
    const uint32_t n = 6;
    pkv_session *s[2] = {pkvt_session(e), pkvt_session(e)};
    rows x[2];
    float *want[2];
    int32_t parent[6];
    for (uint32_t i = 0; i < n; i++)
        parent[i] = (int32_t)i - 1;
    race_arg a[2];
    for (int i = 0; i < 2; i++) {
        pkvt_append_random(s[i], &r, 0, 150 + 37 * (uint32_t)i, 1.5f, 2.0f);
        x[i] = random_rows(&r, &c, n);
        want[i] = pkvt_calloc((size_t)n * 8 * 16, sizeof(float));
        a[i] = (race_arg){.s = s[i], .n = n, .verify = i == 0, .iters = 60, .parent = parent,
                          .x = &x[i], .want = want[i], .nout = (size_t)n * 8 * 16};
    }
    /* each alone first: the bits to hold */
    const uint64_t len1 = pkv_session_len(s[1], 0);
    ck_assert_int_eq(pkv_verify(s[0], 0, n, parent, x[0].q, x[0].k, x[0].v, want[0]), PKV_OK);
    ck_assert_int_eq(pkv_session_commit(s[0], 0, NULL), PKV_OK);
    ck_assert_int_eq(pkv_prefill(s[1], 0, n, x[1].q, x[1].k, x[1].v, want[1]), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(s[1], len1), PKV_OK);
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, race_run, &a[1]), 0);
    race_run(&a[0]);
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    for (int i = 0; i < 2; i++) {
        ck_assert_msg(a[i].bad == 0, "%s beside a %s: %s", i ? "prefill" : "verify",
                      i ? "verify" : "prefill",
                      a[i].bad == 1 ? "a call failed" : "other bits than alone");
        rows_free(&x[i]);
        free(want[i]);
        pkv_session_destroy(s[i]);
    }
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_engine_destroy(e);
}
END_TEST

/* ---- nothing changed ----------------------------------------------------------------- */

/* What a caller can see of a session: lengths, memory, its pages, a decode per layer. */
typedef struct {
    uint64_t len[LMAX];
    pkv_memory m;
    pkv_page_info pages[LMAX][64];
    uint64_t n_pages[LMAX];
    float out[LMAX][4 * 8];
} snapshot;

static void snap(pkv_session *s, uint32_t L, const float *q, snapshot *o)
{
    memset(o, 0, sizeof *o);
    ck_assert_int_eq(pkv_session_memory(s, &o->m), PKV_OK);
    for (uint32_t l = 0; l < L; l++) {
        o->len[l] = pkv_session_len(s, l);
        ck_assert_int_eq(pkv_session_pages(s, l, 0, 64, o->pages[l], &o->n_pages[l]), PKV_OK);
        if (o->len[l])
            ck_assert_int_eq(pkv_decode(s, l, q, o->out[l]), PKV_OK);
    }
}

static void same_snap(const snapshot *a, const snapshot *b, const char *what)
{
    ck_assert_msg(memcmp(a, b, sizeof *a) == 0, "%s changed the session", what);
}

/* Bad trees and paths, extremes of every argument, calls while drafts are pending:
 * statuses, and nothing changed (the pending drafts included: the commit after gives
 * the same session as one without the failed calls). Geometry h 4, g 2, d 8, bt 4. */
START_TEST(bad_input_changes_nothing)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    pkv_config c = pkvt_config(2, 4, 2, 8, 4, PKV_F16);
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e), *ref = NULL;
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(s, &r, l, 6, 1.5f, 2.0f);
    ck_assert_int_eq(pkv_session_fork(s, &ref), PKV_OK);
    rows x = random_rows(&r, &c, 8);
    float out[8 * 32], q[32];
    pkvt_fill(&r, q, 32, -1, 1);
    const int32_t good[4] = {-1, 0, 0, 1};
    snapshot a, b;

    /* no drafts: commit is ESTATE */
    snap(s, 2, q, &a);
    ck_assert_int_eq(pkv_session_commit(s, 0, NULL), PKV_ESTATE);
    ck_assert_int_eq(pkv_session_commit(NULL, 0, NULL), PKV_EINVAL);
    /* bad verifies */
    const int32_t bad[][4] = {{-1, 0, 2, 0},  {-1, 0, 0, 3},  {-2, 0, 0, 0},
                              {-1, -3, 0, 0}, {0, 0, 0, 0},   {-1, 0, 0, 4},
                              {-1, 0, 0, INT32_MIN}, {-1, 0, 0, INT32_MAX}};
    for (uint32_t i = 0; i < sizeof bad / sizeof *bad; i++)
        ck_assert_int_eq(pkv_verify(s, 0, 4, bad[i], x.q, x.k, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 0, 0, good, x.q, x.k, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 2, 4, good, x.q, x.k, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, UINT32_MAX, 4, good, x.q, x.k, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 0, PKV_VERIFY_MAX_DRAFTS + 1, good, x.q, x.k, x.v, out),
                     PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 0, UINT32_MAX, good, x.q, x.k, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(NULL, 0, 4, good, x.q, x.k, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 0, 4, NULL, x.q, x.k, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 0, 4, good, NULL, x.k, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 0, 4, good, x.q, NULL, x.v, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 0, 4, good, x.q, x.k, NULL, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_verify(s, 0, 4, good, x.q, x.k, x.v, NULL), PKV_EINVAL);
    snap(s, 2, q, &b);
    same_snap(&a, &b, "a bad verify");

    /* drafts pending on layer 0: what may not run, and bad commits */
    ck_assert_int_eq(pkv_verify(s, 0, 4, good, x.q, x.k, x.v, out), PKV_OK);
    snap(s, 2, q, &a);
    ck_assert_uint_eq(a.len[0], 6);
    ck_assert_uint_gt(a.m.blocks, 4); /* layer 0's drafts reach a third page */
    pkv_session *f = NULL;
    ck_assert_int_eq(pkv_session_fork(s, &f), PKV_ESTATE);
    ck_assert_ptr_null(f);
    ck_assert_int_eq(pkv_session_truncate(s, 3), PKV_ESTATE);
    ck_assert_int_eq(pkv_append(s, 0, x.k, x.v), PKV_ESTATE);
    ck_assert_int_eq(pkv_prefill(s, 0, 1, x.q, x.k, x.v, out), PKV_ESTATE);
    char dir[256], path[300];
    pkvt_scratch_dir(dir, sizeof dir, "verify");
    snprintf(path, sizeof path, "%s/s.pkv", dir);
    ck_assert_int_eq(pkv_session_save(s, path), PKV_ESTATE);
    ck_assert_int_eq(access(path, F_OK), -1);
    const uint32_t bad_paths[][3] = {{1, 0, 0}, {0, 0, 0}, {0, 3, 0}, {4, 0, 0},
                                     {UINT32_MAX, 0, 0}, {0, 1, 1}, {0, 2, 3}};
    const uint32_t bad_len[] = {1, 2, 2, 1, 1, 3, 3};
    for (uint32_t i = 0; i < sizeof bad_len / sizeof *bad_len; i++)
        ck_assert_int_eq(pkv_session_commit(s, bad_len[i], bad_paths[i]), PKV_EINVAL);
    const uint32_t ok_path[3] = {0, 1, 3};
    ck_assert_int_eq(pkv_session_commit(s, 5, ok_path), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_commit(s, 2, NULL), PKV_EINVAL);
    snap(s, 2, q, &b);
    same_snap(&a, &b, "a call refused while drafts are pending");
    /* layer 1 verified with another tree: the commit cannot say which */
    const int32_t other[4] = {-1, 0, 1, 2};
    ck_assert_int_eq(pkv_verify(s, 1, 4, other, x.q, x.k, x.v, out), PKV_OK);
    snap(s, 2, q, &a);
    ck_assert_int_eq(pkv_session_commit(s, 1, ok_path), PKV_ESTATE);
    ck_assert_int_eq(pkv_verify(s, 1, 3, good, x.q, x.k, x.v, out), PKV_OK); /* n differs */
    ck_assert_int_eq(pkv_session_commit(s, 1, ok_path), PKV_ESTATE);
    snap(s, 2, q, &b);
    ck_assert_int_eq(pkv_verify(s, 1, 4, good, x.q, x.k, x.v, out), PKV_OK);
    /* set_tokens of cached positions is allowed */
    const int32_t ids[6] = {1, 2, 3, 4, 5, 6};
    ck_assert_int_eq(pkv_session_set_tokens(s, 6, ids), PKV_OK);
    ck_assert_int_eq(pkv_session_commit(s, 3, ok_path), PKV_OK);
    for (uint32_t l = 0; l < 2; l++)
        append_path(ref, &c, l, &x, ok_path, 3);
    same_decodes(s, ref, &c, &r, "after refused calls", pkvt_seed());
    /* and now everything runs again */
    ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK);
    ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(s, 3), PKV_OK);
    pkv_session_destroy(f);
    pkvt_remove_dir(dir);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    rows_free(&x);
    pkv_session_destroy(s);
    pkv_session_destroy(ref);
    pkv_engine_destroy(e);
}
END_TEST

/* A budget that runs out in the middle of a verify's pages: PKV_ENOMEM, nothing
 * changed - a verify before it still pending, its commit as if the failed one never
 * ran; and destroying a session with pending drafts gives every page back. */
START_TEST(budget_exhaustion_changes_nothing)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    pkv_config c = pkvt_config(1, 4, 2, 8, 4, PKV_F32);
    const uint64_t page = 2ull * 2 * 4 * 8 * 4;
    c.mem_budget = 6 * page;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e), *ref = NULL;
    pkvt_append_random(s, &r, 0, 10, 1.5f, 2.0f); /* 3 pages */
    ck_assert_int_eq(pkv_session_fork(s, &ref), PKV_OK);
    rows x = random_rows(&r, &c, 64);
    int32_t chain[64];
    for (uint32_t i = 0; i < 64; i++)
        chain[i] = (int32_t)i - 1;
    float out[64 * 32], q[32];
    pkvt_fill(&r, q, 32, -1, 1);
    const int32_t small[3] = {-1, 0, -1};
    ck_assert_int_eq(pkv_verify(s, 0, 3, small, x.q, x.k, x.v, out), PKV_OK);
    snapshot a, b;
    snap(s, 1, q, &a);
    /* 14 more rows need 3 pages more than the copy of the shared tail: 7 > 6 */
    for (uint32_t n = 12; n <= 64; n += 13)
        ck_assert_int_eq(pkv_verify(s, 0, n, chain, x.q, x.k, x.v, out), PKV_ENOMEM);
    snap(s, 1, q, &b);
    same_snap(&a, &b, "a verify beyond the budget");
    const uint32_t keep[2] = {0, 1};
    ck_assert_int_eq(pkv_session_commit(s, 2, keep), PKV_OK);
    append_path(ref, &c, 0, &x, keep, 2);
    same_decodes(s, ref, &c, &r, "after ENOMEM", pkvt_seed());
    ck_assert_int_eq(pkv_verify(s, 0, 4, chain, x.q, x.k, x.v, out), PKV_OK);
    pkv_session_destroy(s);
    pkv_session_destroy(ref);
    pkv_stats st;
    ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
    ck_assert_uint_eq(st.pages_in_use, 0);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    rows_free(&x);
    pkv_engine_destroy(e);
}
END_TEST

/* With a spill_dir: the pending drafts' pages spill while another session grows, and
 * the commit brings them back; the result is the twin's. */
START_TEST(pending_drafts_spill_and_come_back)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    char dir[256];
    pkvt_scratch_dir(dir, sizeof dir, "verify-spill");
    pkv_config c = pkvt_config(2, 4, 2, 8, 4, PKV_BF16);
    const uint64_t page = 2ull * 2 * 4 * 8 * 2;
    c.mem_budget = 12 * page;
    c.spill_dir = dir;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e), *ref = NULL;
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(s, &r, l, 7, 1.5f, 2.0f);
    ck_assert_int_eq(pkv_session_fork(s, &ref), PKV_OK);
    rows x[2] = {random_rows(&r, &c, 9), random_rows(&r, &c, 9)};
    const int32_t tree[9] = {-1, -1, 1, 2, 0, 3, 5, 6, 7};
    float out[9 * 32];
    for (uint32_t l = 0; l < 2; l++) {
        ck_assert_int_eq(pkv_verify(s, l, 9, tree, x[l].q, x[l].k, x[l].v, out), PKV_OK);
        check_drafts(ref, &c, l, 9, tree, &x[l], out, pkvt_seed());
    }
    pkv_session *big = pkvt_session(e); /* pushes s and ref out */
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(big, &r, l, 16, 1.5f, 2.0f);
    pkv_memory m;
    ck_assert_int_eq(pkv_session_memory(s, &m), PKV_OK);
    ck_assert_uint_gt(m.bytes_spilled, 0);
    uint32_t path[9];
    const uint32_t n_keep = path_to(tree, 8, path);
    ck_assert_int_eq(pkv_session_commit(s, n_keep, path), PKV_OK);
    for (uint32_t l = 0; l < 2; l++)
        append_path(ref, &c, l, &x[l], path, n_keep);
    pkv_session_destroy(big);
    same_decodes(s, ref, &c, &r, "after spill", pkvt_seed());
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    rows_free(&x[0]);
    rows_free(&x[1]);
    pkv_session_destroy(s);
    pkv_session_destroy(ref);
    pkv_engine_destroy(e);
    pkvt_remove_dir(dir);
}
END_TEST

/* A commit that cannot bring the drafts' spilled pages back (a read fault) is PKV_EIO
 * and changes nothing; dropping the drafts (n_keep == 0) reads no page, so it still
 * succeeds, and the session is its base again. */
/* A session whose layers together outgrow the budget (each one fits, as its decode
 * needs): a path verified on every layer commits, bringing back only the pages of the
 * pending rows, and decodes as token by token. Found by the soak: commit brought every
 * pending layer back whole and failed with PKV_ENOMEM where each layer's verify and
 * decode had run. */
START_TEST(commit_past_the_budget)
{
    /* _i 1: layer 0 keeps a window of 10 positions; layer 1's verify spills it, so its
     * commit releases a page that sits spilled before the ones it brings back */
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 3 + (uint64_t)_i);
    char dir[256];
    pkvt_scratch_dir(dir, sizeof dir, "verify-commit-budget");
    pkv_config c = pkvt_config(2, 4, 2, 8, 4, PKV_F16);
    pkv_layer_config lc[2];
    memset(lc, 0, sizeof lc);
    lc[0].window = 10;
    if (_i == 1)
        c.layer_cfg = lc;
    const uint64_t page = 2ull * 2 * 4 * 8 * 2;
    c.mem_budget = (_i ? 13 : 14) * page; /* a full layer: 9 pages, 11 with the drafts */
    c.spill_dir = dir;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e), *ref = NULL;
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(s, &r, l, 36, 1.5f, 2.0f);
    ck_assert_int_eq(pkv_session_fork(s, &ref), PKV_OK);
    rows x[2] = {random_rows(&r, &c, 5), random_rows(&r, &c, 5)};
    const int32_t tree[5] = {-1, 0, 0, 2, 3};
    float out[5 * 32];
    for (uint32_t l = 0; l < 2; l++) {
        ck_assert_int_eq(pkv_verify(s, l, 5, tree, x[l].q, x[l].k, x[l].v, out), PKV_OK);
        check_drafts(ref, &c, l, 5, tree, &x[l], out, pkvt_seed());
    }
    pkv_memory m;
    ck_assert_int_eq(pkv_session_memory(s, &m), PKV_OK);
    ck_assert_uint_gt(m.bytes_spilled, 0);
    uint32_t path[5];
    const uint32_t n_keep = path_to(tree, 4, path);
    ck_assert_uint_eq(n_keep, 4);
    ck_assert_int_eq(pkv_session_commit(s, n_keep, path), PKV_OK);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    for (uint32_t l = 0; l < 2; l++) {
        ck_assert_uint_eq(pkv_session_len(s, l), 40);
        append_path(ref, &c, l, &x[l], path, n_keep);
    }
    same_decodes(s, ref, &c, &r, "after a commit past the budget", pkvt_seed());
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    rows_free(&x[0]);
    rows_free(&x[1]);
    pkv_session_destroy(s);
    pkv_session_destroy(ref);
    pkv_engine_destroy(e);
    pkvt_remove_dir(dir);
}
END_TEST

START_TEST(drop_needs_no_read)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    char dir[256];
    pkvt_scratch_dir(dir, sizeof dir, "verify-drop");
    pkv_config c = pkvt_config(1, 4, 2, 8, 4, PKV_F32);
    const uint64_t page = 2ull * 2 * 4 * 8 * 4;
    c.mem_budget = 6 * page;
    c.spill_dir = dir;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e), *ref = NULL;
    pkvt_append_random(s, &r, 0, 6, 1.5f, 2.0f);
    ck_assert_int_eq(pkv_session_fork(s, &ref), PKV_OK);
    rows x = random_rows(&r, &c, 9);
    const int32_t tree[9] = {-1, 0, 1, 2, 3, 4, 5, 6, 7};
    float out[9 * 32];
    ck_assert_int_eq(pkv_verify(s, 0, 9, tree, x.q, x.k, x.v, out), PKV_OK);
    pkv_session *big = pkvt_session(e); /* pushes s out */
    pkvt_append_random(big, &r, 0, 20, 1.5f, 2.0f);
    pkv_memory m;
    ck_assert_int_eq(pkv_session_memory(s, &m), PKV_OK);
    ck_assert_uint_gt(m.bytes_spilled, 0);
    pkvi_io_inject_fault(pkvi_spill_io(pkvi_engine_ctx(e).cache->spill), PKVI_FAULT_READ, 1);
    const uint32_t path[3] = {0, 1, 2};
    ck_assert_int_eq(pkv_session_commit(s, 3, path), PKV_EIO);
    ck_assert_uint_eq(pkv_session_len(s, 0), 6);
    pkvi_io_inject_fault(pkvi_spill_io(pkvi_engine_ctx(e).cache->spill), PKVI_FAULT_READ, 1);
    ck_assert_int_eq(pkv_session_commit(s, 0, NULL), PKV_OK);
    pkvi_io_inject_fault(pkvi_spill_io(pkvi_engine_ctx(e).cache->spill), PKVI_FAULT_READ, 0);
    ck_assert_int_eq(pkv_session_commit(s, 0, NULL), PKV_ESTATE);
    pkv_session_destroy(big);
    same_decodes(s, ref, &c, &r, "after a dropped tree", pkvt_seed());
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    rows_free(&x);
    pkv_session_destroy(s);
    pkv_session_destroy(ref);
    pkv_engine_destroy(e);
    pkvt_remove_dir(dir);
}
END_TEST

/* ---- a model-based walk ----------------------------------------------------------------- */

/* The accepted rows of every layer (all layers the same length) and a token id per
 * position, unique to its content (the prefix cache matches ids). */
typedef struct {
    const pkv_config *c;
    uint32_t dv;
    float *k, *v;            /* [layer][cap][g][d] */
    int32_t *ids;            /* [cap] */
    uint64_t len, cap;
    int32_t next_id;
} model;

static void model_push(model *m, const float *k, const float *v, uint32_t layer)
{
    const pkv_config *c = m->c;
    const size_t kd = (size_t)c->n_kv_heads * c->head_dim, vd = (size_t)c->n_kv_heads * m->dv;
    ck_assert_uint_lt(m->len, m->cap);
    memcpy(m->k + (layer * m->cap + m->len) * kd, k, kd * sizeof(float));
    memcpy(m->v + (layer * m->cap + m->len) * vd, v, vd * sizeof(float));
}

/* A fresh session holding the model's rows. */
static pkv_session *model_session(pkv_engine *e, const model *m)
{
    const pkv_config *c = m->c;
    const size_t kd = (size_t)c->n_kv_heads * c->head_dim, vd = (size_t)c->n_kv_heads * m->dv;
    pkv_session *s = pkvt_session(e);
    for (uint32_t l = 0; l < c->n_layers; l++)
        for (uint64_t i = 0; i < m->len; i++)
            ck_assert_int_eq(pkv_append(s, l, m->k + (l * m->cap + i) * kd,
                                        m->v + (l * m->cap + i) * vd), PKV_OK);
    return s;
}

START_TEST(walk_mixes_verify_with_everything)
{
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    char dir[256], file[300];
    pkvt_scratch_dir(dir, sizeof dir, "verify-walk");
    snprintf(file, sizeof file, "%s/s.pkv", dir);
    const uint32_t walks = pkvt_quick() ? 3 : 10, steps = pkvt_quick() ? 40 : 120;
    for (uint32_t w = 0; w < walks; w++) {
        rcase k;
        random_case(&r, &k);
        const pkv_config *c = &k.c;
        pkv_engine *e = case_engine(&k);
        model m = {c, c->head_dim_v ? c->head_dim_v : c->head_dim, NULL, NULL, NULL, 0, 4096, 1};
        const size_t kd = (size_t)c->n_kv_heads * c->head_dim, vd = (size_t)c->n_kv_heads * m.dv;
        m.k = pkvt_calloc(c->n_layers * m.cap * kd, sizeof(float));
        m.v = pkvt_calloc(c->n_layers * m.cap * vd, sizeof(float));
        m.ids = pkvt_calloc(m.cap, sizeof(int32_t));
        pkv_session *s = pkvt_session(e), *kept = NULL;
        for (uint32_t step = 0; step < steps; step++) {
            const uint32_t op = pkvt_below(&r, 10);
            if (op <= 3) { /* verify every layer with one tree, commit a path */
                const uint32_t n = 1 + pkvt_below(&r, 12);
                int32_t parent[12];
                random_tree(&r, n, 6, parent);
                rows x[LMAX];
                float *out = pkvt_calloc((size_t)n * c->n_heads * m.dv, sizeof(float));
                for (uint32_t l = 0; l < c->n_layers; l++) {
                    x[l] = random_rows(&r, c, n);
                    ck_assert_int_eq(pkv_verify(s, l, n, parent, x[l].q, x[l].k, x[l].v, out),
                                     PKV_OK);
                }
                if (op == 3) /* a write while pending: refused */
                    ck_assert_int_eq(pkv_append(s, 0, x[0].k, x[0].v), PKV_ESTATE);
                uint32_t path[12], n_keep = 0;
                if (pkvt_below(&r, 6))
                    n_keep = path_to(parent, pkvt_below(&r, n), path);
                ck_assert_int_eq(pkv_session_commit(s, n_keep, path), PKV_OK);
                for (uint32_t j = 0; j < n_keep; j++, m.len++) {
                    for (uint32_t l = 0; l < c->n_layers; l++)
                        model_push(&m, x[l].k + path[j] * kd, x[l].v + path[j] * vd, l);
                    m.ids[m.len] = m.next_id++;
                }
                for (uint32_t l = 0; l < c->n_layers; l++)
                    rows_free(&x[l]);
                free(out);
            } else if (op == 4) { /* append to every layer */
                rows x = random_rows(&r, c, 1);
                for (uint32_t l = 0; l < c->n_layers; l++) {
                    ck_assert_int_eq(pkv_append(s, l, x.k, x.v), PKV_OK);
                    model_push(&m, x.k, x.v, l);
                }
                m.ids[m.len++] = m.next_id++;
                rows_free(&x);
            } else if (op == 5) { /* fork: go on with either */
                pkv_session *f = NULL;
                ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK);
                pkv_session_destroy(kept);
                kept = pkvt_below(&r, 2) ? s : f;
                s = kept == s ? f : s;
            } else if (op == 6 && m.len) { /* truncate, where the windows allow it */
                const uint64_t to = pkvt_below(&r, (uint32_t)m.len + 1);
                const pkv_status st = pkv_session_truncate(s, to);
                ck_assert(st == PKV_OK || st == PKV_ERANGE);
                if (st == PKV_OK)
                    m.len = to;
            } else if (op == 7 && m.len) { /* prefix reuse */
                ck_assert_int_eq(pkv_session_set_tokens(s, m.len, m.ids), PKV_OK);
                pkv_session *f = NULL;
                uint64_t got = 0;
                ck_assert_int_eq(pkv_session_from_prefix(e, m.len, m.ids, &f, &got), PKV_OK);
                for (uint32_t l = 0; l < c->n_layers; l++)
                    for (uint64_t i = got; i < m.len; i++)
                        ck_assert_int_eq(pkv_append(f, l, m.k + (l * m.cap + i) * kd,
                                                    m.v + (l * m.cap + i) * vd), PKV_OK);
                pkv_session_destroy(kept);
                kept = s;
                s = f;
            } else if (op == 8) { /* save and load */
                ck_assert_int_eq(pkv_session_save(s, file), PKV_OK);
                pkv_session *f = NULL;
                const pkv_status ls = pkv_session_load(e, file, &f);
                char why[256] = "";
                if (ls != PKV_OK)
                    pkv_engine_last_error(e, why, sizeof why);
                ck_assert_msg(ls == PKV_OK, "seed %llu: load: %s", (unsigned long long)seed,
                              why);
                pkv_session_destroy(s);
                s = f;
            }
            pkv_session *ref = model_session(e, &m);
            same_decodes(s, ref, c, &r, "walk", seed);
            pkv_session_destroy(ref);
            ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        }
        pkv_session_destroy(s);
        pkv_session_destroy(kept);
        free(m.k);
        free(m.v);
        free(m.ids);
        pkv_engine_destroy(e);
    }
    pkvt_remove_dir(dir);
}
END_TEST

/* RoPE layers (SPEC §14): draft i's key turns at len + depth(i), not at its slot, so a
 * tree off the chain gives every draft append + decode's bits along its path, and the
 * commit of any path leaves the keys an append would have stored (every dtype, both
 * styles, partial rotation, a window on one layer). */
START_TEST(rope_trees_match_token_by_token)
{
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x9e3779b9u);
    static const int32_t parent[8] = {-1, -1, 0, 0, 2, 1, -1, 4};
    const uint32_t n = 8;
    for (uint32_t dt = 0; dt < 5; dt++) {
        pkv_layer_config lc[2];
        memset(lc, 0, sizeof lc);
        lc[0].rope = PKV_ROPE_NEOX;
        lc[1].rope = PKV_ROPE_NORM;
        lc[1].rope_dims = 8;
        lc[1].rope_theta = 500000;
        lc[1].window = 5 + dt;
        pkv_config c = pkvt_config(2, 4, 2, 16, 1 + dt % 4 * 3, (pkv_dtype)dt);
        c.layer_cfg = lc;
        pkv_engine *e = pkvt_engine_cfg(&c);
        pkv_session *base = pkvt_session(e);
        for (uint32_t l = 0; l < c.n_layers; l++)
            pkvt_append_random(base, &r, l, 3 + pkvt_below(&r, 20), 1.5f, 2.0f);
        rows x[2];
        for (uint32_t l = 0; l < c.n_layers; l++)
            x[l] = random_rows(&r, &c, n);
        float *out = pkvt_calloc((size_t)n * c.n_heads * c.head_dim, sizeof(float));
        for (uint32_t node = 0; node <= n; node++) {
            pkv_session *s = NULL, *twin = NULL;
            ck_assert_int_eq(pkv_session_fork(base, &s), PKV_OK);
            for (uint32_t l = 0; l < c.n_layers; l++) {
                ck_assert_int_eq(pkv_verify(s, l, n, parent, x[l].q, x[l].k, x[l].v, out),
                                 PKV_OK);
                if (node == 0)
                    check_drafts(base, &c, l, n, parent, &x[l], out, seed);
            }
            uint32_t path[8], m = node < n ? path_to(parent, node, path) : 0;
            ck_assert_int_eq(pkv_session_commit(s, m, m ? path : NULL), PKV_OK);
            ck_assert_int_eq(pkv_session_fork(base, &twin), PKV_OK);
            for (uint32_t l = 0; l < c.n_layers; l++)
                append_path(twin, &c, l, &x[l], path, m);
            same_decodes(s, twin, &c, &r, "rope path", seed);
            pkv_session_destroy(s);
            pkv_session_destroy(twin);
        }
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        for (uint32_t l = 0; l < c.n_layers; l++)
            rows_free(&x[l]);
        free(out);
        pkv_session_destroy(base);
        pkv_engine_destroy(e);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("verify");
    TCase *tc = tcase_create("verify");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, random_trees_match_token_by_token);
    tcase_add_test(tc, every_path_of_small_trees);
    tcase_add_test(tc, a_chain_is_a_prefill);
    tcase_add_test(tc, batch_scratch_one_call_at_a_time);
    tcase_add_test(tc, bad_input_changes_nothing);
    tcase_add_test(tc, budget_exhaustion_changes_nothing);
    tcase_add_test(tc, pending_drafts_spill_and_come_back);
    tcase_add_loop_test(tc, commit_past_the_budget, 0, 2);
    tcase_add_test(tc, drop_needs_no_read);
    tcase_add_test(tc, walk_mixes_verify_with_everything);
    tcase_add_test(tc, rope_trees_match_token_by_token);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

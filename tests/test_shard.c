/*
 * test_shard.c - the shard calls (docs/sharding.md): pkv_decode_partial / pkv_decode_partial_at,
 * pkv_merge_partials, pkv_session_set_first, pkv_shard_align.
 *
 * The property is bitwise: the partial states of one session, merged, are pkv_decode's
 * bits; the states of shards cut at any aligned positions, concatenated in position
 * order and merged, are the bits of one session holding the whole - for every dtype
 * and variant (window, sinks, soft-cap, sink logits, head_dim_v). The whole itself is
 * held to the double oracle (pkv_attention_reference), so "equal to the whole" is not
 * "equal to something wrong". Past 64 chunks (more than one wave of decode.c), the
 * decode equals itself over thread counts and the oracle. Bad calls are statuses that
 * change nothing.
 */
#include "testutil.h"
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The variants of the layers of one engine (layer l uses variant l). */
#define N_VARIANTS 5
static const float SIGMA[8] = {0.5f, -1.0f, 2.0f, 0.0f, 1.5f, -0.5f, 3.0f, -2.0f};

static void variant(uint32_t l, uint32_t window, pkv_layer_config *lc)
{
    memset(lc, 0, sizeof *lc);
    switch (l) {
    case 0: /* full causal */
        break;
    case 1: /* window with sinks */
        lc->window = window;
        lc->sink_tokens = 5;
        break;
    case 2: /* soft-cap */
        lc->softcap = 3.0f;
        break;
    case 3: /* sink logits */
        lc->sink_logits = SIGMA;
        break;
    default: /* all of it */
        lc->window = window;
        lc->sink_tokens = 3;
        lc->softcap = 4.0f;
        lc->sink_logits = SIGMA;
        break;
    }
}

typedef struct {
    uint32_t h, g, d, dv, bt;
    pkv_dtype dt;
    uint32_t window;
    pkv_layer_config lc[N_VARIANTS];
    pkv_config c;
} geom;

static pkv_engine *make_engine(geom *G, uint32_t threads)
{
    G->c = pkvt_config(N_VARIANTS, G->h, G->g, G->d, G->bt, G->dt);
    G->c.head_dim_v = G->dv;
    G->c.n_threads = threads;
    for (uint32_t l = 0; l < N_VARIANTS; l++)
        variant(l, G->window, &G->lc[l]);
    G->c.layer_cfg = G->lc;
    return threads > 1 ? pkvt_engine_workers(&G->c) : pkvt_engine_cfg(&G->c);
}

/* Positions [p0, p1) of K [T][g][d], V [T][g][dv] appended to every layer of s. */
static void append_range(pkv_session *s, const geom *G, const float *K, const float *V,
                         uint64_t p0, uint64_t p1)
{
    for (uint64_t t = p0; t < p1; t++)
        for (uint32_t l = 0; l < N_VARIANTS; l++)
            ck_assert_int_eq(pkv_append(s, l, K + t * G->g * G->d, V + t * G->g * G->dv),
                             PKV_OK);
}

/* Partial states of s for a query at pos appended to buf at *n (capacity cap). */
static void add_partials(pkv_session *s, uint32_t layer, uint64_t pos, const float *q,
                         float *buf, uint32_t cap, uint32_t *n, size_t ps)
{
    uint32_t got = 0;
    ck_assert_int_eq(pkv_decode_partial_at(s, layer, pos, q, cap - *n, buf + *n * ps, &got),
                     PKV_OK);
    *n += got;
}

/* Every dtype and variant: partial + merge of one session == pkv_decode, the whole ==
 * the oracle, and shards at every aligned cut (and a three-way cut) == the whole. */
static void shards_equal_whole(pkv_dtype dt, uint32_t dv_extra)
{
    pkvt_rng r;
    const uint64_t seed = pkvt_seed() ^ dt ^ ((uint64_t)dv_extra << 8);
    pkvt_rng_init(&r, seed);
    /* quick (sanitizers, whose poison builds check every invariant at every call, over
     * every page): fewer, larger pages */
    geom G = {.h = 4, .g = 2, .d = 8, .bt = pkvt_quick() ? 64 : 16, .dt = dt, .window = 700};
    G.dv = G.d + dv_extra;
    pkv_engine *e = make_engine(&G, 1);
    const uint64_t A = pkv_shard_align(e);
    ck_assert_uint_eq(A % G.bt, 0);
    const uint64_t T = pkvt_quick() ? 2 * A + 29 : 3 * A + 37;
    const size_t kd = (size_t)G.g * G.d, vd = (size_t)G.g * G.dv;
    const size_t od = (size_t)G.h * G.dv, ps = (size_t)G.h * (G.dv + 2);
    float *K = pkvt_alloc(pkvt_mul(T, kd * sizeof(float)));
    float *V = pkvt_alloc(pkvt_mul(T, vd * sizeof(float)));
    float *q = pkvt_alloc((size_t)G.h * G.d * sizeof(float));
    pkvt_fill(&r, K, T * kd, -1.5f, 1.5f);
    pkvt_fill(&r, V, T * vd, -1, 1);
    pkvt_fill(&r, q, (size_t)G.h * G.d, -1.5f, 1.5f);

    pkv_session *whole = pkvt_session(e);
    append_range(whole, &G, K, V, 0, T);
    const uint32_t cap = 64 + (uint32_t)(T / A) * 4 + 8;
    float *st = pkvt_alloc(pkvt_mul(cap, ps * sizeof(float)));
    float *want = pkvt_alloc(od * sizeof(float)), *got = pkvt_alloc(od * sizeof(float));

    /* the oracle on the rounded rows, at position T - 1 */
    float *Kr = pkvt_alloc(pkvt_mul(T, kd * sizeof(float)));
    float *Vr = pkvt_alloc(pkvt_mul(T, vd * sizeof(float)));
    for (uint64_t t = 0; t < T * G.g; t++) {
        pkv_dtype_round_row(dt, G.d, K + t * G.d, Kr + t * G.d);
        pkv_dtype_round_row(dt, G.dv, V + t * G.dv, Vr + t * G.dv);
    }
    float *Qall = pkvt_alloc(pkvt_mul(T, (size_t)G.h * G.d * sizeof(float)));
    float *Oall = pkvt_alloc(pkvt_mul(T, od * sizeof(float)));
    for (uint64_t t = 0; t < T; t++)
        memcpy(Qall + t * G.h * G.d, q, (size_t)G.h * G.d * sizeof(float));

    for (uint32_t l = 0; l < N_VARIANTS; l++) {
        ck_assert_int_eq(pkv_decode(whole, l, q, want), PKV_OK);
        /* the whole against the double oracle (once per dtype: it is O(T^2)) */
        if (dv_extra == 0) {
        ck_assert_int_eq(pkv_attention_reference((uint32_t)T, G.h, G.g, G.d, G.dv, 0, &G.lc[l],
                                                 Qall, Kr, Vr, Oall), PKV_OK);
        const float vmax = pkvt_maxabs(Vr, T * vd);
        const double err = pkvt_maxdiff_ff(want, Oall + (T - 1) * od, od);
        ck_assert_msg(err <= 1e-5 * vmax + 1e-6, "dtype %d layer %u: %g from the oracle "
                      "(seed %llu)", dt, l, err, (unsigned long long)seed);
        }

        /* one session: its partials merged are pkv_decode's bits */
        uint64_t need = 0;
        ck_assert_int_eq(pkv_partial_chunks(whole, l, &need), PKV_OK);
        uint32_t n = 0;
        ck_assert_int_eq(pkv_decode_partial(whole, l, q, cap, st, &n), PKV_OK);
        ck_assert_uint_eq(n, need);
        ck_assert_int_eq(pkv_merge_partials(e, n, st, got), PKV_OK);
        ck_assert_msg(memcmp(got, want, od * sizeof(float)) == 0,
                      "dtype %d layer %u: partial + merge differs from pkv_decode", dt, l);
        /* a chain: the first k states folded into one (in place), then the rest after
         * it - the same bits at every k */
        float *chainb = pkvt_alloc(pkvt_mul(n + 1, ps * sizeof(float)));
        for (uint32_t k = 1; k <= n; k++) {
            memcpy(chainb, st, (size_t)n * ps * sizeof(float));
            ck_assert_int_eq(pkv_fold_partials(e, k, chainb, chainb), PKV_OK);
            memmove(chainb + ps, st + (size_t)k * ps, (size_t)(n - k) * ps * sizeof(float));
            ck_assert_int_eq(pkv_merge_partials(e, 1 + n - k, chainb, got), PKV_OK);
            ck_assert_msg(memcmp(got, want, od * sizeof(float)) == 0,
                          "dtype %d layer %u: a fold of %u states, then the rest, differs",
                          dt, l, k);
        }
        free(chainb);
    }

    /* shards at every aligned cut c in (0, T), and the cut at every two of them */
    const uint64_t n_cuts = (T - 1) / A;
    for (uint64_t c1 = 1; c1 <= n_cuts; c1++)
        for (uint64_t c2 = c1; c2 <= n_cuts; c2++) {
            const uint64_t cuts[3] = {0, c1 * A, c2 * A};
            const uint32_t n_sh = c2 == c1 ? 2 : 3;
            const uint64_t lo[3] = {cuts[0], cuts[1], n_sh == 3 ? cuts[2] : T};
            pkv_session *sh[3];
            for (uint32_t k = 0; k < n_sh; k++) {
                const uint64_t p0 = k == 0 ? 0 : (k == 1 ? cuts[1] : cuts[2]);
                const uint64_t p1 = k + 1 < n_sh ? lo[k + 1] : T;
                sh[k] = pkvt_session(e);
                ck_assert_int_eq(pkv_session_set_first(sh[k], p0), PKV_OK);
                ck_assert_uint_eq(pkv_session_len(sh[k], 0), p0);
                append_range(sh[k], &G, K, V, p0, p1);
                ck_assert_uint_eq(pkv_session_len(sh[k], 0), p1);
            }
            for (uint32_t l = 0; l < N_VARIANTS; l++) {
                ck_assert_int_eq(pkv_decode(whole, l, q, want), PKV_OK);
                uint32_t n = 0;
                for (uint32_t k = 0; k < n_sh; k++)
                    add_partials(sh[k], l, T - 1, q, st, cap, &n, ps);
                ck_assert_int_eq(pkv_merge_partials(e, n, st, got), PKV_OK);
                ck_assert_msg(memcmp(got, want, od * sizeof(float)) == 0,
                              "dtype %d dv %u layer %u, shards at %llu, %llu: the merge "
                              "differs from one engine", dt, G.dv, l,
                              (unsigned long long)cuts[1],
                              (unsigned long long)(n_sh == 3 ? cuts[2] : T));
            }
            for (uint32_t k = 0; k < n_sh; k++)
                pkv_session_destroy(sh[k]);
        }
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(whole);
    pkv_engine_destroy(e);
    free(K);
    free(V);
    free(Kr);
    free(Vr);
    free(Qall);
    free(Oall);
    free(q);
    free(st);
    free(want);
    free(got);
}

START_TEST(shards_f32) { shards_equal_whole(PKV_F32, 0); shards_equal_whole(PKV_F32, 3); }
END_TEST
START_TEST(shards_f16) { shards_equal_whole(PKV_F16, 0); shards_equal_whole(PKV_F16, 5); }
END_TEST
START_TEST(shards_bf16) { shards_equal_whole(PKV_BF16, 0); shards_equal_whole(PKV_BF16, 2); }
END_TEST
START_TEST(shards_q8) { shards_equal_whole(PKV_Q8, 0); shards_equal_whole(PKV_Q8, 24); }
END_TEST
START_TEST(shards_q4) { shards_equal_whole(PKV_Q4, 0); shards_equal_whole(PKV_Q4, 24); }
END_TEST

/* Past one wave (64 chunks of 512 tokens): the number of chunks is unbounded, the
 * scratch is not; the decode is the same bits on 1 and 2 threads, single and batched,
 * and within the oracle's bound; a shard of it merges bitwise too. */
START_TEST(many_chunks)
{
    pkvt_rng r;
    const uint64_t seed = pkvt_seed();
    pkvt_rng_init(&r, seed);
    geom G = {.h = 4, .g = 1, .d = 4, .dv = 4, .bt = pkvt_quick() ? 256 : 32, .dt = PKV_F32,
              .window = 40000};
    pkv_engine *e1 = make_engine(&G, 1);
    pkv_engine *e2 = make_engine(&G, 2);
    const uint64_t A = pkv_shard_align(e1);
    const uint64_t T = pkvt_quick() ? 65 * A + 77 : 131 * A + 77; /* > 1 resp. 2 waves */
    const size_t kd = (size_t)G.g * G.d, od = (size_t)G.h * G.dv;
    const size_t ps = (size_t)G.h * (G.dv + 2);
    float *K = pkvt_alloc(pkvt_mul(T, kd * sizeof(float)));
    float *V = pkvt_alloc(pkvt_mul(T, kd * sizeof(float)));
    float *q = pkvt_alloc((size_t)G.h * G.d * sizeof(float));
    pkvt_fill(&r, K, T * kd, -1, 1);
    pkvt_fill(&r, V, T * kd, -1, 1);
    pkvt_fill(&r, q, (size_t)G.h * G.d, -1, 1);
    pkv_session *s1 = pkvt_session(e1), *s2 = pkvt_session(e2);
    const uint64_t cut = (T / A / 2) * A;
    pkv_session *a = pkvt_session(e2), *b = pkvt_session(e1);
    ck_assert_int_eq(pkv_session_set_first(b, cut), PKV_OK);
    /* layer 0 (full) and 4 (everything) only: the rest are covered above */
    const uint32_t layers[2] = {0, 4};
    for (uint64_t t = 0; t < T; t++)
        for (uint32_t i = 0; i < 2; i++) {
            const float *k = K + t * kd, *v = V + t * kd;
            ck_assert_int_eq(pkv_append(s1, layers[i], k, v), PKV_OK);
            ck_assert_int_eq(pkv_append(s2, layers[i], k, v), PKV_OK);
            ck_assert_int_eq(pkv_append(t < cut ? a : b, layers[i], k, v), PKV_OK);
        }
    /* scratch: the running states and one wave, not one state per chunk */
    ck_assert_uint_le(s1->partials_chunks, PKVI_MAX_CHUNKS + 1);
    float *o1 = pkvt_alloc(od * sizeof(float)), *o2 = pkvt_alloc(od * sizeof(float));
    float *ob = pkvt_alloc(2 * od * sizeof(float));
    double *qd = pkvt_to_double(q, (size_t)G.h * G.d);
    double *Kd = pkvt_to_double(K, T * kd), *Vd = pkvt_to_double(V, T * kd);
    double *ref = pkvt_alloc(od * sizeof(double));
    const uint32_t cap = (uint32_t)(T / A) + 8;
    float *st = pkvt_alloc(pkvt_mul(cap, ps * sizeof(float)));
    for (uint32_t i = 0; i < 2; i++) {
        const uint32_t l = layers[i];
        ck_assert_int_eq(pkv_decode(s1, l, q, o1), PKV_OK);
        ck_assert_int_eq(pkv_decode(s2, l, q, o2), PKV_OK);
        ck_assert_mem_eq(o1, o2, od * sizeof(float));
        pkv_session *pair[2] = {s2, s1};
        float q2[2 * 16];
        memcpy(q2, q, (size_t)G.h * G.d * sizeof(float));
        memcpy(q2 + G.h * G.d, q, (size_t)G.h * G.d * sizeof(float));
        ck_assert_int_eq(pkv_decode_batch(e2, l, 1, pair, q2, ob), PKV_OK);
        ck_assert_mem_eq(ob, o1, od * sizeof(float));
        if (l == 0) { /* the oracle over every position */
            pkvt_oracle_decode(G.h, G.g, G.d, 0, T, qd, Kd, Vd, ref);
            ck_assert_msg(pkvt_maxdiff_fd(o1, ref, od) <= 1e-5,
                          "%g from the oracle (seed %llu)", pkvt_maxdiff_fd(o1, ref, od),
                          (unsigned long long)seed);
        }
        uint32_t n = 0, got = 0;
        ck_assert_int_eq(pkv_decode_partial_at(a, l, T - 1, q, cap, st, &got), PKV_OK);
        n = got;
        ck_assert_int_eq(pkv_decode_partial(b, l, q, cap - n, st + n * ps, &got), PKV_OK);
        n += got;
        ck_assert_int_eq(pkv_merge_partials(e1, n, st, o2), PKV_OK);
        ck_assert_mem_eq(o1, o2, od * sizeof(float));
    }
    pkv_session_destroy(s1);
    pkv_session_destroy(s2);
    pkv_session_destroy(a);
    pkv_session_destroy(b);
    pkv_engine_destroy(e1);
    pkv_engine_destroy(e2);
    free(K);
    free(V);
    free(q);
    free(o1);
    free(o2);
    free(ob);
    free(qd);
    free(Kd);
    free(Vd);
    free(ref);
    free(st);
}
END_TEST

/* A windowed shard far behind the query gives its sinks alone, or nothing. */
START_TEST(window_far_behind)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    geom G = {.h = 2, .g = 1, .d = 4, .dv = 4, .bt = 16, .dt = PKV_F32, .window = 100};
    pkv_engine *e = make_engine(&G, 1);
    const uint64_t A = pkv_shard_align(e);
    pkv_session *a = pkvt_session(e), *b = pkvt_session(e);
    ck_assert_int_eq(pkv_session_set_first(b, A), PKV_OK);
    pkvt_append_random(a, &r, 0, A, 1, 1);
    pkvt_append_random(a, &r, 1, A, 1, 1);
    pkvt_append_random(b, &r, 1, 5, 1, 1);
    float q[8], st[16 * 12];
    pkvt_fill(&r, q, 8, -1, 1);
    uint32_t n = 99;
    /* layer 1 (window 100, 5 sinks) of a for a query at 10 * A: its sinks alone */
    ck_assert_int_eq(pkv_decode_partial_at(a, 1, 10 * A, q, 16, st, &n), PKV_OK);
    ck_assert_uint_eq(n, 1);
    /* b holds no sink and its window is all past: nothing */
    ck_assert_int_eq(pkv_decode_partial_at(b, 1, 10 * A, q, 16, st, &n), PKV_OK);
    ck_assert_uint_eq(n, 0);
    pkv_session_destroy(a);
    pkv_session_destroy(b);
    pkv_engine_destroy(e);
}
END_TEST

/* pkv_decode_partial_at at the extremes of its position (0, len - 1, len, 2^63,
 * UINT64_MAX - 1, UINT64_MAX) on every variant, windowed layers whose windows have
 * released pages included: a status that changes nothing, or exactly the states the
 * position attends - never arithmetic on an unchecked position (pos + 1 once wrapped
 * to 0 at UINT64_MAX, and the kernel walked the released, NULL, pages). */
START_TEST(extreme_positions)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    geom G = {.h = 4, .g = 2, .d = 8, .dv = 8, .bt = 16, .dt = PKV_F32, .window = 100};
    pkv_engine *e = make_engine(&G, 1);
    const uint64_t A = pkv_shard_align(e);
    pkv_session *s = pkvt_session(e);
    for (uint32_t l = 0; l < N_VARIANTS; l++)
        pkvt_append_random(s, &r, l, 3 * A + 5, 1.0f, 1.0f);
    ck_assert_uint_gt(pkvi_btable_hole_end(s->layers[1]), 0); /* pages released */
    enum { CAP = 64 };
    const size_t ps = (size_t)G.h * (G.dv + 2);
    float q[32], *st = pkvt_alloc(CAP * ps * sizeof(float));
    float *ref = pkvt_alloc(CAP * ps * sizeof(float));
    pkvt_fill(&r, q, 32, -1, 1);
    for (uint32_t l = 0; l < N_VARIANTS; l++) {
        const uint64_t len = pkv_session_len(s, l);
        uint32_t n_ref = 0;
        ck_assert_int_eq(pkv_decode_partial(s, l, q, CAP, ref, &n_ref), PKV_OK);
        const uint64_t pos[6] = {0, len - 1, len, 1ull << 63, UINT64_MAX - 1, UINT64_MAX};
        for (int i = 0; i < 6; i++) {
            for (size_t k = 0; k < CAP * ps; k++)
                st[k] = 42.0f;
            uint32_t n = 999;
            const pkv_status got = pkv_decode_partial_at(s, l, pos[i], q, CAP, st, &n);
            if (pos[i] < len - 1 || pos[i] == UINT64_MAX) {
                ck_assert_msg(got == PKV_EINVAL, "layer %u pos %llu: %s", l,
                              (unsigned long long)pos[i], pkv_status_str(got));
                ck_assert_uint_eq(n, 999);
                for (size_t k = 0; k < CAP * ps; k++)
                    ck_assert(st[k] == 42.0f);
                char why[256];
                pkv_engine_last_error(e, why, sizeof why);
                ck_assert_msg(strstr(why, "pkv_decode_partial_at: ") == why, "%s", why);
                continue;
            }
            ck_assert_msg(got == PKV_OK, "layer %u pos %llu: %s", l,
                          (unsigned long long)pos[i], pkv_status_str(got));
            if (!G.lc[l].window || pos[i] == len - 1) { /* what a decode at len - 1 reads */
                ck_assert_uint_eq(n, n_ref);
                ck_assert_mem_eq(st, ref, n * ps * sizeof(float));
            } else if (pos[i] > len + G.window) { /* the sink-logit state and the sinks */
                ck_assert_uint_eq(n, (G.lc[l].sink_logits != NULL) + (G.lc[l].sink_tokens > 0));
            }
        }
    }
    free(st);
    free(ref);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
}
END_TEST

/* Bad calls are statuses and change nothing. */
START_TEST(bad_calls)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    geom G = {.h = 4, .g = 2, .d = 8, .dv = 8, .bt = 16, .dt = PKV_F16, .window = 700};
    pkv_engine *e = make_engine(&G, 1);
    const uint64_t A = pkv_shard_align(e);
    ck_assert_uint_gt(A, 0);
    ck_assert_uint_eq(pkv_shard_align(NULL), 0);
    /* the align is a whole number of pages, independent of any length */
    ck_assert_uint_eq(A % G.bt, 0);
    pkv_session *s = pkvt_session(e);
    ck_assert_int_eq(pkv_session_set_first(NULL, A), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_set_first(s, A + G.bt), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_set_first(s, 1), PKV_EINVAL);
    ck_assert_uint_eq(pkv_session_len(s, 0), 0);
    ck_assert_int_eq(pkv_session_set_first(s, 2 * A), PKV_OK);
    ck_assert_int_eq(pkv_session_set_first(s, 3 * A), PKV_ESTATE); /* not empty: has first */
    ck_assert_uint_eq(pkv_session_len(s, 0), 2 * A);
    float q[32], out[32], st[64 * 40];
    pkvt_fill(&r, q, 32, -1, 1);
    uint32_t n = 7;
    /* an empty shard layer */
    ck_assert_int_eq(pkv_decode_partial(s, 0, q, 64, st, &n), PKV_ESTATE);
    ck_assert_int_eq(pkv_decode(s, 0, q, out), PKV_ESTATE);
    ck_assert_uint_eq(n, 7);
    pkvt_append_random(s, &r, 0, 2 * A + 3, 1, 1);
    ck_assert_uint_eq(pkv_session_len(s, 0), 4 * A + 3);
    pkv_session *t = pkvt_session(e);
    pkvt_append_random(t, &r, 0, 1, 1, 1);
    ck_assert_int_eq(pkv_session_set_first(t, A), PKV_ESTATE); /* holds a position */
    ck_assert_uint_eq(pkv_session_len(t, 0), 1);
    /* too small a state buffer: ERANGE, *n_chunks says how many, states untouched */
    uint64_t need = 0;
    ck_assert_int_eq(pkv_partial_chunks(s, 0, &need), PKV_OK);
    ck_assert_uint_eq(need, 3); /* positions [2A, 4A + 3): chunks 2A.., 3A.., 4A.. */
    for (size_t i = 0; i < 64 * 40; i++)
        st[i] = 42.0f;
    ck_assert_int_eq(pkv_decode_partial(s, 0, q, 2, st, &n), PKV_ERANGE);
    ck_assert_uint_eq(n, 3);
    for (size_t i = 0; i < 64 * 40; i++)
        ck_assert(st[i] == 42.0f);
    /* bad layer, NULLs, a position before the last */
    n = 7;
    ck_assert_int_eq(pkv_decode_partial(s, N_VARIANTS, q, 64, st, &n), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode_partial(NULL, 0, q, 64, st, &n), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode_partial(s, 0, NULL, 64, st, &n), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode_partial(s, 0, q, 64, NULL, &n), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode_partial(s, 0, q, 64, st, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode_partial_at(s, 0, 4 * A + 1, q, 64, st, &n), PKV_EINVAL);
    ck_assert_int_eq(pkv_partial_chunks(s, N_VARIANTS, &need), PKV_EINVAL);
    ck_assert_uint_eq(n, 7);
    ck_assert_int_eq(pkv_merge_partials(NULL, 1, st, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_merge_partials(e, 0, st, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_merge_partials(e, 1, NULL, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_merge_partials(e, 1, st, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_fold_partials(NULL, 1, st, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_fold_partials(e, 0, st, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_fold_partials(e, 1, NULL, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_fold_partials(e, 1, st, NULL), PKV_EINVAL);
    /* a shard is not truncated below its first position */
    ck_assert_int_eq(pkv_session_truncate(s, 2 * A - 1), PKV_ERANGE);
    ck_assert_uint_eq(pkv_session_len(s, 0), 4 * A + 3);
    ck_assert_int_eq(pkv_session_truncate(s, 3 * A), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 0), 3 * A);
    ck_assert_int_eq(pkv_session_truncate(s, 2 * A), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 0), 2 * A);
    ck_assert_int_eq(pkv_decode(s, 0, q, out), PKV_ESTATE);
    /* the pages below first cost nothing; a fork of a shard is a shard */
    pkvt_append_random(s, &r, 0, 17, 1, 1);
    pkv_memory m;
    ck_assert_int_eq(pkv_session_memory(s, &m), PKV_OK);
    ck_assert_uint_eq(m.blocks, 2);
    pkv_session *f = NULL;
    ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(f, 0), 2 * A + 17);
    float o1[32], o2[32];
    ck_assert_int_eq(pkv_decode(s, 0, q, o1), PKV_OK);
    ck_assert_int_eq(pkv_decode(f, 0, q, o2), PKV_OK);
    ck_assert_mem_eq(o1, o2, sizeof o1);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(f);
    pkv_session_destroy(s);
    pkv_session_destroy(t);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_engine_destroy(e);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("shard");
    TCase *td = tcase_create("dtypes");
    tcase_set_timeout(td, 300);
    tcase_add_test(td, shards_f32);
    tcase_add_test(td, shards_f16);
    tcase_add_test(td, shards_bf16);
    tcase_add_test(td, shards_q8);
    tcase_add_test(td, shards_q4);
    suite_add_tcase(s, td);
    TCase *tw = tcase_create("waves");
    tcase_set_timeout(tw, 300);
    tcase_add_test(tw, many_chunks);
    tcase_add_test(tw, window_far_behind);
    suite_add_tcase(s, tw);
    TCase *tc = tcase_create("calls");
    tcase_add_test(tc, bad_calls);
    tcase_add_test(tc, extreme_positions);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

/*
 * test_variants.c - docs/variants.md's attention variants. So far: the dense oracle
 * pkv_attention_reference, held against pkv_causal_attention on rearranged inputs (a
 * window with sinks is causal attention over the attended positions alone; a K/V of
 * different widths is causal attention with V zero-padded) and against closed forms
 * for soft-capping and sink logits, plus its rejections.
 */
#include "testutil.h"
#include "internal.h"

#include <stdio.h>

#include <math.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

/* Causal attention's row `last` over the positions listed in idx[0..n) (in order,
 * the last being the query's own): the attended set of a window with sinks. */
static void causal_over(uint32_t h, uint32_t g, uint32_t d, const float *Q, const float *K,
                        const float *V, uint32_t t, const uint32_t *idx, uint32_t n, float *o)
{
    float *q = pkvt_alloc((size_t)n * h * d * sizeof *q);
    float *k = pkvt_alloc((size_t)n * g * d * sizeof *k);
    float *v = pkvt_alloc((size_t)n * g * d * sizeof *v);
    float *out = pkvt_alloc((size_t)n * h * d * sizeof *out);
    for (uint32_t r = 0; r < n; r++) {
        memcpy(q + (size_t)r * h * d, Q + (size_t)t * h * d, (size_t)h * d * sizeof *q);
        memcpy(k + (size_t)r * g * d, K + (size_t)idx[r] * g * d, (size_t)g * d * sizeof *k);
        memcpy(v + (size_t)r * g * d, V + (size_t)idx[r] * g * d, (size_t)g * d * sizeof *v);
    }
    ck_assert_int_eq(pkv_causal_attention(n, h, g, d, 0, q, k, v, out), PKV_OK);
    memcpy(o, out + (size_t)(n - 1) * h * d, (size_t)h * d * sizeof *o);
    free(q);
    free(k);
    free(v);
    free(out);
}

START_TEST(window_and_sinks_are_causal_over_the_attended_set)
{
    const uint32_t T = 23, h = 4, g = 2, d = 5;
    pkvt_rng r;
    const uint64_t seed = pkvt_seed();
    pkvt_rng_init(&r, seed);
    float *Q = pkvt_alloc(T * h * d * sizeof *Q), *K = pkvt_alloc(T * g * d * sizeof *K);
    float *V = pkvt_alloc(T * g * d * sizeof *V), *O = pkvt_alloc(T * h * d * sizeof *O);
    pkvt_fill(&r, Q, T * h * d, -2, 2);
    pkvt_fill(&r, K, T * g * d, -2, 2);
    pkvt_fill(&r, V, T * g * d, -1, 1);
    const uint32_t windows[] = {1, 2, 5, 8, 30}, sinks[] = {0, 1, 3, 9};
    for (size_t a = 0; a < 5; a++)
        for (size_t b = 0; b < 4; b++) {
            pkv_layer_config lc;
            memset(&lc, 0, sizeof lc);
            lc.window = windows[a];
            lc.sink_tokens = sinks[b];
            ck_assert_int_eq(pkv_attention_reference(T, h, g, d, 0, 0, &lc, Q, K, V, O), PKV_OK);
            for (uint32_t t = 0; t < T; t++) {
                uint32_t idx[64], n = 0;
                for (uint32_t j = 0; j <= t; j++)
                    if (j + lc.window > t || j < lc.sink_tokens)
                        idx[n++] = j;
                float want[4 * 5];
                causal_over(h, g, d, Q, K, V, t, idx, n, want);
                for (uint32_t i = 0; i < h * d; i++)
                    ck_assert_msg(fabsf(O[(size_t)t * h * d + i] - want[i]) <= 1e-6f,
                                  "window %u sinks %u t %u: %g vs %g (seed %llu)", lc.window,
                                  lc.sink_tokens, t, (double)O[(size_t)t * h * d + i],
                                  (double)want[i], (unsigned long long)seed);
            }
        }
    /* a zeroed config is full causal, bit for bit */
    pkv_layer_config zero;
    memset(&zero, 0, sizeof zero);
    float *P = pkvt_alloc(T * h * d * sizeof *P);
    ck_assert_int_eq(pkv_attention_reference(T, h, g, d, 0, 0, &zero, Q, K, V, O), PKV_OK);
    ck_assert_int_eq(pkv_causal_attention(T, h, g, d, 0, Q, K, V, P), PKV_OK);
    ck_assert_mem_eq(O, P, T * h * d * sizeof *O);
    free(Q);
    free(K);
    free(V);
    free(O);
    free(P);
}
END_TEST

/* V of another width: causal attention with V zero-padded to K's width, first dv. */
START_TEST(v_width_differs_from_k_width)
{
    const uint32_t T = 9, h = 6, g = 1, dk = 7, dv = 3;
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 1);
    float Q[9 * 6 * 7], K[9 * 7], V[9 * 3], Vp[9 * 7], O[9 * 6 * 3], P[9 * 6 * 7];
    pkvt_fill(&r, Q, sizeof Q / sizeof *Q, -1, 1);
    pkvt_fill(&r, K, sizeof K / sizeof *K, -1, 1);
    pkvt_fill(&r, V, sizeof V / sizeof *V, -1, 1);
    memset(Vp, 0, sizeof Vp);
    for (uint32_t t = 0; t < T; t++)
        memcpy(Vp + t * dk, V + t * dv, dv * sizeof *V);
    ck_assert_int_eq(pkv_attention_reference(T, h, g, dk, dv, 0.3f, NULL, Q, K, V, O), PKV_OK);
    ck_assert_int_eq(pkv_causal_attention(T, h, g, dk, 0.3f, Q, K, Vp, P), PKV_OK);
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t i = 0; i < h; i++)
            ck_assert_mem_eq(O + ((size_t)t * h + i) * dv, P + ((size_t)t * h + i) * dk,
                             dv * sizeof *O);
}
END_TEST

/* Soft-capping and a sink logit against their closed forms on two positions. */
START_TEST(softcap_and_sink_logit_closed_forms)
{
    const float q[2] = {3.0f, -1.0f}, k[4] = {2.0f, 0.5f, -1.0f, 4.0f};
    const float v[4] = {1.0f, -2.0f, 0.25f, 3.0f};
    const float Q2[4] = {3.0f, -1.0f, 3.0f, -1.0f};
    const float sigma = 0.75f, cap = 2.5f, scale = 0.5f;
    pkv_layer_config lc;
    memset(&lc, 0, sizeof lc);
    lc.softcap = cap;
    lc.sink_logits = &sigma;
    float out[4];
    ck_assert_int_eq(pkv_attention_reference(2, 1, 1, 2, 2, scale, &lc, Q2, k, v, out), PKV_OK);
    double s[2];
    for (int j = 0; j < 2; j++) {
        const double dot = (double)q[0] * k[2 * j] + (double)q[1] * k[2 * j + 1];
        s[j] = cap * tanh(dot * scale / cap);
    }
    /* row 0: position 0 and the sink; row 1: positions 0, 1 and the sink */
    for (int t = 0; t < 2; t++) {
        double m = sigma, den, num[2] = {0, 0};
        for (int j = 0; j <= t; j++)
            m = s[j] > m ? s[j] : m;
        den = exp(sigma - m);
        for (int j = 0; j <= t; j++) {
            const double w = exp(s[j] - m);
            den += w;
            num[0] += w * v[2 * j];
            num[1] += w * v[2 * j + 1];
        }
        for (int c = 0; c < 2; c++)
            ck_assert_msg(fabs(out[2 * t + c] - num[c] / den) <= 1e-6,
                          "row %d col %d: %g vs %g", t, c, (double)out[2 * t + c], num[c] / den);
    }
    /* a huge sink logit takes the whole softmax: out -> 0 */
    const float big = 1e4f;
    lc.sink_logits = &big;
    ck_assert_int_eq(pkv_attention_reference(2, 1, 1, 2, 2, scale, &lc, Q2, k, v, out), PKV_OK);
    for (int i = 0; i < 4; i++)
        ck_assert(fabsf(out[i]) < 1e-30f);
}
END_TEST

START_TEST(bad_configs_are_rejected)
{
    float x[64] = {0}, out[16];
    for (int i = 0; i < 16; i++)
        out[i] = 42.0f;
    pkv_layer_config lc;
    const float nan = NAN, inf = INFINITY;
    memset(&lc, 0, sizeof lc);
    lc.sink_tokens = 1; /* sinks without a window */
    ck_assert_int_eq(pkv_attention_reference(2, 2, 1, 2, 0, 0, &lc, x, x, x, out), PKV_EINVAL);
    memset(&lc, 0, sizeof lc);
    lc.rollback_tokens = 4;
    ck_assert_int_eq(pkv_attention_reference(2, 2, 1, 2, 0, 0, &lc, x, x, x, out), PKV_EINVAL);
    memset(&lc, 0, sizeof lc);
    lc.softcap = -1.0f;
    ck_assert_int_eq(pkv_attention_reference(2, 2, 1, 2, 0, 0, &lc, x, x, x, out), PKV_EINVAL);
    lc.softcap = inf;
    ck_assert_int_eq(pkv_attention_reference(2, 2, 1, 2, 0, 0, &lc, x, x, x, out), PKV_EINVAL);
    memset(&lc, 0, sizeof lc);
    const float logits[2] = {0.0f, nan};
    lc.sink_logits = logits;
    ck_assert_int_eq(pkv_attention_reference(2, 2, 1, 2, 0, 0, &lc, x, x, x, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_attention_reference(2, 3, 2, 2, 0, 0, NULL, x, x, x, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_attention_reference(0, 2, 1, 2, 0, 0, NULL, x, x, x, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_attention_reference(2, 2, 1, 2, 0, 0, NULL, NULL, x, x, out), PKV_EINVAL);
    for (int i = 0; i < 16; i++)
        ck_assert(out[i] == 42.0f); /* untouched */
    memset(&lc, 0, sizeof lc);
    lc.window = 1;
    lc.sink_tokens = 1;
    lc.rollback_tokens = 3;
    lc.softcap = 30.0f;
    ck_assert_int_eq(pkv_attention_reference(2, 2, 1, 2, 0, 0, &lc, x, x, x, out), PKV_OK);
}
END_TEST


/* ---- the engine against the oracle ----------------------------------------------- */

typedef struct {
    uint32_t h, g, d, dv, bt;
} geo;

typedef struct {
    uint32_t window, sinks, rollback;
    float softcap;
    bool logits;
} variant;

static const geo geos[] = {
    {4, 2, 8, 8, 4}, {6, 3, 5, 3, 1}, {2, 1, 17, 9, 16}, {8, 8, 16, 16, 2}, {4, 1, 12, 20, 3},
};
static const variant variants[] = {
    {5, 0, 0, 0, false}, {3, 2, 0, 0, false},  {16, 0, 4, 0, false}, {7, 3, 5, 30, true},
    {0, 0, 0, 20, false}, {0, 0, 0, 0, true}, {1, 1, 0, 0, false},   {33, 4, 2, 0, false},
    {6, 9, 1, 0, true},
};
#define N_VARIANTS (sizeof variants / sizeof *variants)

/* Three layers: the variant, a plain causal layer, the next variant (hybrid models). */
static void layer_configs(size_t vi, uint32_t h, float *logits, pkv_layer_config lc[3])
{
    memset(lc, 0, 3 * sizeof *lc);
    for (int l = 0; l < 3; l += 2) {
        const variant *v = &variants[(vi + (size_t)l / 2) % N_VARIANTS];
        lc[l].window = v->window;
        lc[l].sink_tokens = v->sinks;
        lc[l].rollback_tokens = v->rollback;
        lc[l].softcap = v->softcap;
        if (v->logits) {
            for (uint32_t i = 0; i < h; i++)
                logits[l * h + i] = 0.5f * (float)i - 1.0f;
            lc[l].sink_logits = logits + l * h;
        }
    }
}

static pkv_engine *make_engine(const geo *G, pkv_dtype dt, const pkv_layer_config *lc,
                               uint32_t threads)
{
    pkv_config c = pkv_config_default();
    c.n_layers = 3;
    c.n_heads = G->h;
    c.n_kv_heads = G->g;
    c.head_dim = G->d;
    c.head_dim_v = G->dv;
    c.block_tokens = G->bt;
    c.kv_dtype = dt;
    c.layer_cfg = lc;
    c.n_threads = threads;
    pkv_engine *e = NULL;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_OK);
    return e;
}

/* Pages a layer holds now (entries a window released read as id 0). */
static uint64_t held_pages(const pkv_session *s, uint32_t layer)
{
    pkv_page_info info[512];
    uint64_t n = 0, held = 0;
    ck_assert_int_eq(pkv_session_pages(s, layer, 0, 512, info, &n), PKV_OK);
    for (uint64_t i = 0; i < n; i++)
        held += info[i].id != 0;
    return held;
}

static uint64_t page_ceiling(const pkv_layer_config *lc, uint32_t bt)
{
    if (!lc->window)
        return UINT64_MAX;
    return (lc->sink_tokens + bt - 1) / bt + ((uint64_t)lc->window + lc->rollback_tokens + bt - 1) / bt + 1;
}

/* T tokens of random q/k/v; K, V as the cache stores them (rounded to dt). */
typedef struct {
    uint32_t T;
    float *q, *k, *v, *kr, *vr;
} tokens;

static tokens make_tokens(pkvt_rng *r, const geo *G, pkv_dtype dt, uint32_t T)
{
    tokens t = {T, NULL, NULL, NULL, NULL, NULL};
    const size_t nq = (size_t)T * G->h * G->d, nk = (size_t)T * G->g * G->d,
                 nv = (size_t)T * G->g * G->dv;
    t.q = pkvt_alloc(nq * sizeof(float));
    t.k = pkvt_alloc(nk * sizeof(float));
    t.v = pkvt_alloc(nv * sizeof(float));
    t.kr = pkvt_alloc(nk * sizeof(float));
    t.vr = pkvt_alloc(nv * sizeof(float));
    pkvt_fill(r, t.q, nq, -1.5f, 1.5f);
    pkvt_fill(r, t.k, nk, -1.5f, 1.5f);
    pkvt_fill(r, t.v, nv, -1, 1);
    for (size_t i = 0; i < nk; i++)
        t.kr[i] = pkv_dtype_round(dt, t.k[i]);
    for (size_t i = 0; i < nv; i++)
        t.vr[i] = pkv_dtype_round(dt, t.v[i]);
    return t;
}

static void free_tokens(tokens *t)
{
    free(t->q);
    free(t->k);
    free(t->v);
    free(t->kr);
    free(t->vr);
}

/* Every decode of every layer, token by token, within 1e-5 x max|V| of the oracle on
 * the rounded rows, and the page ceiling of a windowed layer after every append. */
START_TEST(engine_decode_matches_the_oracle)
{
    const pkv_dtype dts[] = {PKV_F32, PKV_F16, PKV_BF16};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed + 7);
    const uint32_t T = pkvt_quick() ? 41 : 75;
    double worst = 0;
    for (size_t gi = 0; gi < sizeof geos / sizeof *geos; gi++)
        for (size_t vi = 0; vi < N_VARIANTS; vi += pkvt_quick() ? 2 : 1) {
            const geo *G = &geos[gi];
            const pkv_dtype dt = dts[(gi + vi) % 3];
            float logits[3 * 8];
            pkv_layer_config lc[3];
            layer_configs(vi, G->h, logits, lc);
            pkv_engine *e = make_engine(G, dt, lc, 1);
            tokens tk = make_tokens(&r, G, dt, T);
            const size_t qd = (size_t)G->h * G->d, kd = (size_t)G->g * G->d,
                         vd = (size_t)G->g * G->dv, od = (size_t)G->h * G->dv;
            float *ref = pkvt_alloc((size_t)T * od * sizeof *ref), out[8 * 20];
            pkv_session *s;
            ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
            for (uint32_t l = 0; l < 3; l++) {
                ck_assert_int_eq(pkv_attention_reference(T, G->h, G->g, G->d, G->dv, 0, &lc[l],
                                                         tk.q, tk.kr, tk.vr, ref),
                                 PKV_OK);
                const float vmax = pkvt_maxabs(tk.vr, (size_t)T * vd);
                for (uint32_t t = 0; t < T; t++) {
                    ck_assert_int_eq(pkv_append(s, l, tk.k + t * kd, tk.v + t * vd), PKV_OK);
                    ck_assert_int_eq(pkv_decode(s, l, tk.q + t * qd, out), PKV_OK);
                    for (size_t i = 0; i < od; i++) {
                        const double diff = fabs((double)out[i] - (double)ref[t * od + i]);
                        if (diff / vmax > worst)
                            worst = diff / vmax;
                        ck_assert_msg(diff <= 1e-5 * vmax,
                                      "geo %zu variant %zu layer %u t %u: |%g - %g| (seed %llu)",
                                      gi, vi, l, t, (double)out[i], (double)ref[t * od + i],
                                      (unsigned long long)seed);
                    }
                    ck_assert_uint_le(held_pages(s, l), page_ceiling(&lc[l], G->bt));
                    ck_assert_uint_eq(pkv_session_len(s, l), t + 1);
                }
            }
            ck_assert(pkvi_engine_check(e));
            pkv_session_destroy(s);
            free(ref);
            free_tokens(&tk);
            pkv_engine_destroy(e);
        }
    fprintf(stderr, "engine variants: largest |diff| / max|V| %.3g\n", worst);
}
END_TEST

/* Prefill in random pieces, batch decode and 3 threads give the token-by-token bits. */
START_TEST(every_path_gives_the_same_bits)
{
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed + 8);
    const uint32_t T = 60;
    for (size_t gi = 0; gi < sizeof geos / sizeof *geos; gi++)
        for (size_t vi = 0; vi < N_VARIANTS; vi += 2) {
            const geo *G = &geos[gi];
            float logits[3 * 8];
            pkv_layer_config lc[3];
            layer_configs(vi + gi, G->h, logits, lc);
            pkv_engine *e1 = make_engine(G, PKV_F16, lc, 1), *e3 = make_engine(G, PKV_F16, lc, 3);
            pkvi_exec_split_always(pkvi_engine_ctx(e3).exec); /* always on the workers */
            tokens tk = make_tokens(&r, G, PKV_F16, T);
            const size_t qd = (size_t)G->h * G->d, kd = (size_t)G->g * G->d,
                         vd = (size_t)G->g * G->dv, od = (size_t)G->h * G->dv;
            float *a = pkvt_alloc((size_t)T * od * sizeof *a), *b = pkvt_alloc((size_t)T * od * sizeof *b);
            float *c = pkvt_alloc((size_t)T * od * sizeof *c);
            for (uint32_t l = 0; l < 3; l++) {
                pkv_session *sa, *sb, *sc, *other;
                ck_assert_int_eq(pkv_session_create(e1, &sa), PKV_OK);
                ck_assert_int_eq(pkv_session_create(e1, &sb), PKV_OK);
                ck_assert_int_eq(pkv_session_create(e3, &sc), PKV_OK);
                ck_assert_int_eq(pkv_session_create(e3, &other), PKV_OK);
                for (uint32_t t = 0; t < T; t++) {
                    ck_assert_int_eq(pkv_append(sa, l, tk.k + t * kd, tk.v + t * vd), PKV_OK);
                    ck_assert_int_eq(pkv_decode(sa, l, tk.q + t * qd, a + t * od), PKV_OK);
                }
                for (uint32_t t = 0; t < T;) {
                    const uint32_t want = 1 + pkvt_below(&r, 13), n = want < T - t ? want : T - t;
                    ck_assert_int_eq(pkv_prefill(sb, l, n, tk.q + t * qd, tk.k + t * kd,
                                                 tk.v + t * vd, b + t * od), PKV_OK);
                    t += n;
                }
                ck_assert_msg(memcmp(a, b, (size_t)T * od * sizeof *a) == 0,
                              "prefill != token by token: geo %zu variant %zu layer %u (seed %llu)",
                              gi, vi, l, (unsigned long long)seed);
                for (uint32_t t = 0; t < T; t++) {
                    ck_assert_int_eq(pkv_append(sc, l, tk.k + t * kd, tk.v + t * vd), PKV_OK);
                    ck_assert_int_eq(pkv_append(other, l, tk.k + t * kd, tk.v + t * vd), PKV_OK);
                    pkv_session *pair[2] = {other, sc};
                    float qq[2 * 8 * 17], oo[2 * 8 * 20];
                    memcpy(qq, tk.q + t * qd, qd * sizeof *qq);
                    memcpy(qq + qd, tk.q + t * qd, qd * sizeof *qq);
                    ck_assert_int_eq(pkv_decode_batch(e3, l, 2, pair, qq, oo), PKV_OK);
                    memcpy(c + t * od, oo + od, od * sizeof *c);
                    ck_assert(memcmp(oo, oo + od, od * sizeof *oo) == 0);
                }
                ck_assert_msg(memcmp(a, c, (size_t)T * od * sizeof *a) == 0,
                              "3 threads + batch != 1 thread: geo %zu variant %zu layer %u", gi,
                              vi, l);
                pkv_session_destroy(sa);
                pkv_session_destroy(sb);
                pkv_session_destroy(sc);
                pkv_session_destroy(other);
            }
            free(a);
            free(b);
            free(c);
            free_tokens(&tk);
            pkv_engine_destroy(e1);
            pkv_engine_destroy(e3);
        }
}
END_TEST

/* Forks of a windowed layer copy on write; truncate goes back within rollback and no
 * further (PKV_ERANGE, nothing changed). */
START_TEST(windowed_fork_and_truncate)
{
    const geo G = {4, 2, 8, 8, 4};
    pkv_layer_config lc[3];
    memset(lc, 0, sizeof lc);
    lc[0].window = 6;
    lc[0].sink_tokens = 2;
    lc[0].rollback_tokens = 5;
    lc[2] = lc[0];
    pkv_engine *e = make_engine(&G, PKV_F32, lc, 1);
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 9);
    const uint32_t T = 50;
    tokens tk = make_tokens(&r, &G, PKV_F32, T);
    tokens alt = make_tokens(&r, &G, PKV_F32, T);
    const size_t qd = 32, kd = 16, od = 32;
    pkv_session *s, *f;
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    for (uint32_t t = 0; t < 30; t++)
        for (uint32_t l = 0; l < 3; l++)
            ck_assert_int_eq(pkv_append(s, l, tk.k + t * kd, tk.v + t * kd), PKV_OK);
    ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK);
    /* the fork goes on with other rows; s must not see them */
    float got[32], want_s[32], *ref = pkvt_alloc((size_t)T * od * sizeof *ref);
    float *K = pkvt_alloc((size_t)T * kd * sizeof *K), *V = pkvt_alloc((size_t)T * kd * sizeof *V);
    for (uint32_t t = 30; t < 40; t++)
        ck_assert_int_eq(pkv_append(f, 0, alt.k + t * kd, alt.v + t * kd), PKV_OK);
    ck_assert_int_eq(pkv_decode(s, 0, tk.q + 29 * qd, got), PKV_OK);
    ck_assert_int_eq(pkv_attention_reference(30, 4, 2, 8, 8, 0, &lc[0], tk.q, tk.k, tk.v, ref), PKV_OK);
    memcpy(want_s, ref + 29 * od, sizeof want_s);
    for (int i = 0; i < 32; i++)
        ck_assert(fabsf(got[i] - want_s[i]) <= 1e-5f);
    memcpy(K, tk.k, 30 * kd * sizeof *K);
    memcpy(V, tk.v, 30 * kd * sizeof *V);
    memcpy(K + 30 * kd, alt.k + 30 * kd, 10 * kd * sizeof *K);
    memcpy(V + 30 * kd, alt.v + 30 * kd, 10 * kd * sizeof *V);
    float *Q = pkvt_alloc((size_t)T * qd * sizeof *Q);
    memcpy(Q, tk.q, (size_t)T * qd * sizeof *Q);
    ck_assert_int_eq(pkv_decode(f, 0, Q + 39 * qd, got), PKV_OK);
    ck_assert_int_eq(pkv_attention_reference(40, 4, 2, 8, 8, 0, &lc[0], Q, K, V, ref), PKV_OK);
    for (int i = 0; i < 32; i++)
        ck_assert(fabsf(got[i] - ref[39 * od + i]) <= 1e-5f);
    ck_assert(pkvi_engine_check(e));
    /* s: 30 positions, window 6 + rollback 5: back to 25 is allowed, to 16 is not */
    float before[32], after[32];
    ck_assert_int_eq(pkv_decode(s, 2, tk.q + 29 * qd, before), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(s, 16), PKV_ERANGE);
    ck_assert_uint_eq(pkv_session_len(s, 0), 30);
    ck_assert_int_eq(pkv_decode(s, 2, tk.q + 29 * qd, after), PKV_OK);
    ck_assert_mem_eq(before, after, sizeof before);
    ck_assert_int_eq(pkv_session_truncate(s, 25), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 0), 25);
    ck_assert_int_eq(pkv_decode(s, 0, tk.q + 24 * qd, got), PKV_OK);
    ck_assert_int_eq(pkv_attention_reference(25, 4, 2, 8, 8, 0, &lc[0], tk.q, tk.k, tk.v, ref), PKV_OK);
    for (int i = 0; i < 32; i++)
        ck_assert(fabsf(got[i] - ref[24 * od + i]) <= 1e-5f);
    /* and it grows again: new rows after the truncate */
    for (uint32_t t = 25; t < 45; t++)
        ck_assert_int_eq(pkv_append(s, 0, tk.k + t * kd, tk.v + t * kd), PKV_OK);
    ck_assert_int_eq(pkv_decode(s, 0, tk.q + 44 * qd, got), PKV_OK);
    ck_assert_int_eq(pkv_attention_reference(45, 4, 2, 8, 8, 0, &lc[0], tk.q, tk.k, tk.v, ref), PKV_OK);
    for (int i = 0; i < 32; i++)
        ck_assert(fabsf(got[i] - ref[44 * od + i]) <= 1e-5f);
    ck_assert_uint_le(held_pages(s, 0), page_ceiling(&lc[0], 4));
    ck_assert_int_eq(pkv_session_truncate(s, 0), PKV_OK); /* nothing needed: always fine */
    ck_assert(pkvi_engine_check(e));
    pkv_session_destroy(f);
    pkv_session_destroy(s);
    free(ref);
    free(K);
    free(V);
    free(Q);
    free_tokens(&tk);
    free_tokens(&alt);
    pkv_engine_destroy(e);
}
END_TEST

/* The rollback allowance counts from the longest length reached (include/pagedkv.h at
 * pkv_session_truncate, with this example): window 4, rollback 2, bt 1. After 20
 * appends positions below 14 are released; a truncate to 18 is allowed, and after it
 * and one append (length 19), a truncate to 17 - two back from 19 - is PKV_ERANGE with
 * nothing changed, while one to 18 again is fine. Each of these states saves to a
 * file that loads. */
START_TEST(rollback_counts_from_the_longest_length)
{
    pkv_layer_config lc[1] = {{.window = 4, .rollback_tokens = 2}};
    pkv_config c = pkvt_config(1, 2, 1, 4, 1, PKV_F32);
    c.layer_cfg = lc;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e);
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 13);
    char dir[512], path[600];
    pkvt_scratch_dir(dir, sizeof dir, "variants");
    snprintf(path, sizeof path, "%s/s.pkv", dir);
    pkvt_append_random(s, &r, 0, 20, 1.0f, 1.0f);
    ck_assert_int_eq(pkv_session_truncate(s, 18), PKV_OK);
    pkvt_append_random(s, &r, 0, 1, 1.0f, 1.0f);
    float q[8], before[8], after[8];
    pkvt_fill(&r, q, 8, -1.0f, 1.0f);
    ck_assert_int_eq(pkv_decode(s, 0, q, before), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(s, 17), PKV_ERANGE);
    ck_assert_uint_eq(pkv_session_len(s, 0), 19);
    ck_assert_int_eq(pkv_decode(s, 0, q, after), PKV_OK);
    ck_assert_mem_eq(before, after, sizeof before);
    ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
    pkv_session *x = NULL;
    ck_assert_int_eq(pkv_session_load(e, path, &x), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(x, 17), PKV_ERANGE); /* the file keeps the hole */
    ck_assert_int_eq(pkv_session_truncate(s, 18), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(x, 18), PKV_OK);
    ck_assert_int_eq(pkv_decode(s, 0, q, before), PKV_OK);
    ck_assert_int_eq(pkv_decode(x, 0, q, after), PKV_OK);
    ck_assert_mem_eq(before, after, sizeof before);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(x);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    pkvt_remove_dir(dir);
}
END_TEST

START_TEST(engine_rejects_bad_variants)
{
    pkv_config c = pkv_config_default();
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 8;
    pkv_layer_config lc[2];
    pkv_engine *e = (pkv_engine *)0x1;
    const float nan = NAN;
    const float logits[4] = {0, 1, nan, 2};
    for (int k = 0; k < 5; k++) {
        memset(lc, 0, sizeof lc);
        switch (k) {
        case 0: lc[1].sink_tokens = 4; break;          /* sinks without a window */
        case 1: lc[0].rollback_tokens = 1; break;      /* rollback without a window */
        case 2: lc[1].softcap = -3; break;
        case 3: lc[0].softcap = INFINITY; break;
        case 4: lc[1].sink_logits = logits; break;     /* a NaN logit */
        }
        c.layer_cfg = lc;
        ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
        ck_assert_ptr_eq(e, (pkv_engine *)0x1);
    }
    c.layer_cfg = NULL;
    c.head_dim_v = 5000;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    ck_assert_ptr_eq(e, (pkv_engine *)0x1);
    /* the config is copied: the caller's arrays may go away */
    c.head_dim_v = 3;
    float mine[4] = {1, 2, 3, 4};
    memset(lc, 0, sizeof lc);
    lc[0].window = 4;
    lc[0].sink_logits = mine;
    c.layer_cfg = lc;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_OK);
    memset(lc, 0, sizeof lc);
    mine[0] = 99;
    pkv_config back;
    ck_assert_int_eq(pkv_engine_config(e, &back), PKV_OK);
    ck_assert_uint_eq(back.head_dim_v, 3);
    ck_assert_uint_eq(back.layer_cfg[0].window, 4);
    ck_assert(back.layer_cfg[0].sink_logits[0] == 1.0f);
    pkv_stats st;
    ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
    ck_assert_uint_eq(st.page_bytes, 2ull * 16 * (8 + 3) * 4); /* g * bt * (dk + dv) * 4 */
    pkv_engine_destroy(e);
}
END_TEST

/*
 * MLA (DeepSeek) served as MQA over the latent: naive MLA decompresses per-head K and V
 * from the latent c_t (rank r) and adds a shared RoPE key kr_t; absorbed, the cache
 * holds [c_t ; kr_t] (head_dim = r + dr) and V = c_t (head_dim_v = r), each query is
 * q'_i = [W_UK_i^T q_nope_i ; q_rope_i], scale = 1/sqrt(dn + dr), and head i's output
 * is W_UV_i times pagedkv's out_i. Both on the same numbers, in double vs through the
 * engine in f32.
 */
START_TEST(mla_absorbed_equals_naive)
{
    enum { H = 4, R = 12, DR = 4, DN = 6, DVH = 5, T = 37 };
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 11);
    float c[T][R], kr[T][DR], qn[T][H][DN], qr[T][H][DR], wuk[H][R][DN], wuv[H][R][DVH];
    pkvt_fill(&r, &c[0][0], sizeof c / sizeof(float), -1, 1);
    pkvt_fill(&r, &kr[0][0], sizeof kr / sizeof(float), -1, 1);
    pkvt_fill(&r, &qn[0][0][0], sizeof qn / sizeof(float), -1, 1);
    pkvt_fill(&r, &qr[0][0][0], sizeof qr / sizeof(float), -1, 1);
    pkvt_fill(&r, &wuk[0][0][0], sizeof wuk / sizeof(float), -0.5f, 0.5f);
    pkvt_fill(&r, &wuv[0][0][0], sizeof wuv / sizeof(float), -0.5f, 0.5f);
    const double scale = 1.0 / sqrt((double)(DN + DR));

    pkv_config cfg = pkv_config_default();
    cfg.n_layers = 1;
    cfg.n_heads = H;
    cfg.n_kv_heads = 1;
    cfg.head_dim = R + DR;
    cfg.head_dim_v = R;
    cfg.block_tokens = 8;
    cfg.scale = (float)scale;
    pkv_engine *e;
    ck_assert_int_eq(pkv_engine_create(&cfg, &e), PKV_OK);
    pkv_session *s;
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    double worst = 0;
    for (int t = 0; t < T; t++) {
        float krow[R + DR], q[H][R + DR], out[H][R];
        memcpy(krow, c[t], sizeof c[t]);
        memcpy(krow + R, kr[t], sizeof kr[t]);
        ck_assert_int_eq(pkv_append(s, 0, krow, c[t]), PKV_OK);
        for (int i = 0; i < H; i++) { /* absorb W_UK into the query */
            for (int a = 0; a < R; a++) {
                double x = 0;
                for (int b = 0; b < DN; b++)
                    x += (double)wuk[i][a][b] * qn[t][i][b];
                q[i][a] = (float)x;
            }
            memcpy(&q[i][R], qr[t][i], sizeof qr[t][i]);
        }
        ck_assert_int_eq(pkv_decode(s, 0, &q[0][0], &out[0][0]), PKV_OK);
        for (int i = 0; i < H; i++) {
            /* naive: per-head K = [W_UK_i^T c_j ; kr_j], V = W_UV_i^T c_j, in double */
            double sc[T], m = -INFINITY, den = 0, o[DVH] = {0};
            for (int j = 0; j <= t; j++) {
                double dot = 0;
                for (int b = 0; b < DN; b++) {
                    double kn = 0;
                    for (int a = 0; a < R; a++)
                        kn += (double)wuk[i][a][b] * c[j][a];
                    dot += (double)qn[t][i][b] * kn;
                }
                for (int b = 0; b < DR; b++)
                    dot += (double)qr[t][i][b] * kr[j][b];
                sc[j] = dot * scale;
                m = sc[j] > m ? sc[j] : m;
            }
            for (int j = 0; j <= t; j++) {
                const double w = exp(sc[j] - m);
                den += w;
                for (int b = 0; b < DVH; b++) {
                    double v = 0;
                    for (int a = 0; a < R; a++)
                        v += (double)wuv[i][a][b] * c[j][a];
                    o[b] += w * v;
                }
            }
            for (int b = 0; b < DVH; b++) { /* absorbed: W_UV_i^T out_i */
                double y = 0;
                for (int a = 0; a < R; a++)
                    y += (double)wuv[i][a][b] * out[i][a];
                const double diff = fabs(y - o[b] / den);
                worst = diff > worst ? diff : worst;
                ck_assert_msg(diff <= 2e-5, "t %d head %d col %d: %g vs %g", t, i, b, y,
                              o[b] / den);
            }
        }
    }
    fprintf(stderr, "mla: absorbed vs naive, largest |diff| %.3g\n", worst);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
}
END_TEST


/* ---- save and load (file format version 2) ------------------------------------------ */

/* A session of every variant, saved and loaded: the loaded one holds the same pages
 * (a window's released ones stay released), decodes bitwise like the original, and
 * both go on identically; the file is version 2 and says what it holds. A plain
 * engine still writes version 1. */
static void save_load_round_trip(pkv_dtype dt, const geo *G, size_t vi)
{
    char dir[] = "/tmp/pkv-variants-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[64];
    snprintf(path, sizeof path, "%s/s.pkv", dir);
    float logits[3 * 8];
    pkv_layer_config lc[3];
    layer_configs(vi, G->h, logits, lc);
    pkv_engine *e = make_engine(G, dt, lc, 1);
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 30 + vi);
    const uint32_t T = 64;
    tokens tk = make_tokens(&r, G, dt, T);
    const size_t qd = (size_t)G->h * G->d, kd = (size_t)G->g * G->d,
                 vd = (size_t)G->g * G->dv, od = (size_t)G->h * G->dv;
    pkv_session *s, *x;
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    for (uint32_t t = 0; t < 50; t++)
        for (uint32_t l = 0; l < 3; l++)
            ck_assert_int_eq(pkv_append(s, l, tk.k + t * kd, tk.v + t * vd), PKV_OK);
    ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
    pkv_file_info info;
    uint64_t lens[3];
    ck_assert_int_eq(pkv_session_file_check(path, &info, lens, 3), PKV_OK);
    ck_assert_uint_eq(info.version, 2);
    ck_assert_uint_eq(info.head_dim_v, G->dv);
    ck_assert_uint_eq(lens[0], 50);
    ck_assert_int_eq(info.kv_dtype, dt);
    ck_assert_int_eq(pkv_session_load(e, path, &x), PKV_OK);
    for (uint32_t l = 0; l < 3; l++) {
        ck_assert_uint_eq(pkv_session_len(x, l), 50);
        ck_assert_uint_eq(held_pages(x, l), held_pages(s, l));
    }
    float a[8 * 20], b[8 * 20];
    for (uint32_t t = 50; t < T; t++)
        for (uint32_t l = 0; l < 3; l++) {
            ck_assert_int_eq(pkv_decode(s, l, tk.q + t * qd, a), PKV_OK);
            ck_assert_int_eq(pkv_decode(x, l, tk.q + t * qd, b), PKV_OK);
            ck_assert_msg(memcmp(a, b, od * sizeof *a) == 0, "loaded != saved: layer %u t %u", l, t);
            ck_assert_int_eq(pkv_append(s, l, tk.k + t * kd, tk.v + t * vd), PKV_OK);
            ck_assert_int_eq(pkv_append(x, l, tk.k + t * kd, tk.v + t * vd), PKV_OK);
            ck_assert_uint_le(held_pages(x, l), page_ceiling(&lc[l], G->bt));
        }
    ck_assert(pkvi_engine_check(e));
    /* another engine's variants: EINVAL, nothing loaded */
    pkv_layer_config other[3];
    memcpy(other, lc, sizeof other);
    other[1].softcap = 7.5f;
    pkv_engine *e2 = make_engine(G, dt, other, 1);
    pkv_session *y = (pkv_session *)0x1;
    ck_assert_int_eq(pkv_session_load(e2, path, &y), PKV_EINVAL);
    ck_assert_ptr_eq(y, (pkv_session *)0x1);
    /* a flipped byte anywhere in the header is caught */
    FILE *f = fopen(path, "r+b");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    const uint32_t hbytes = 92 + 8 * 3 + 8 + 32 * 3;
    for (long off = 16; off < (long)hbytes && off < size; off += 7) {
        unsigned char c;
        fseek(f, off, SEEK_SET);
        ck_assert_uint_eq(fread(&c, 1, 1, f), 1);
        c ^= 0x10;
        fseek(f, off, SEEK_SET);
        fwrite(&c, 1, 1, f);
        fflush(f);
        pkv_session *z = NULL;
        const pkv_status st = pkv_session_load(e, path, &z);
        ck_assert_msg(st == PKV_ECORRUPT, "byte %ld flipped: %s", off, pkv_status_str(st));
        c ^= 0x10;
        fseek(f, off, SEEK_SET);
        fwrite(&c, 1, 1, f);
        fflush(f);
    }
    fclose(f);
    ck_assert_int_eq(pkv_session_load(e, path, &y), PKV_OK); /* restored: sound again */
    pkv_session_destroy(y);
    pkv_session_destroy(s);
    pkv_session_destroy(x);
    pkv_engine_destroy(e);
    pkv_engine_destroy(e2);
    free_tokens(&tk);
    unlink(path);
    rmdir(dir);
}

START_TEST(variants_save_and_load)
{
    save_load_round_trip(PKV_F16, &geos[0], 0);  /* window 5 | plain | sinks */
    save_load_round_trip(PKV_F32, &geos[1], 3);  /* dv != dk, softcap, logits */
    save_load_round_trip(PKV_BF16, &geos[4], 8); /* sinks past the window, logits */
    save_load_round_trip(PKV_Q8, &geos[2], 2);   /* a block dtype, rollback */
    save_load_round_trip(PKV_Q4, &geos[0], 6);
}
END_TEST

START_TEST(a_plain_engine_still_writes_version_1)
{
    char dir[] = "/tmp/pkv-variants-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[64];
    snprintf(path, sizeof path, "%s/s.pkv", dir);
    pkv_engine *e = pkvt_engine(2, 4, 2, 8, 4, PKV_F16);
    pkv_session *s;
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    float kv[16] = {1, 2, 3};
    for (int t = 0; t < 9; t++)
        ck_assert_int_eq(pkv_append(s, 0, kv, kv), PKV_OK);
    ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
    pkv_file_info info;
    ck_assert_int_eq(pkv_session_file_check(path, &info, NULL, 0), PKV_OK);
    ck_assert_uint_eq(info.version, 1);
    ck_assert_uint_eq(info.head_dim_v, 8);
    ck_assert_uint_eq(info.n_variant_layers, 0);
    pkv_session *x;
    ck_assert_int_eq(pkv_session_load(e, path, &x), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(x, 0), 9);
    /* a version-1 file is plain causal: an engine with variants refuses it */
    pkv_layer_config lc[2];
    memset(lc, 0, sizeof lc);
    lc[1].window = 4;
    pkv_config c;
    ck_assert_int_eq(pkv_engine_config(e, &c), PKV_OK);
    c.layer_cfg = lc;
    pkv_engine *ev;
    ck_assert_int_eq(pkv_engine_create(&c, &ev), PKV_OK);
    pkv_session *y = NULL;
    ck_assert_int_eq(pkv_session_load(ev, path, &y), PKV_EINVAL);
    pkv_session_destroy(x);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    pkv_engine_destroy(ev);
    unlink(path);
    rmdir(dir);
}
END_TEST


/* A spill engine under a tight budget with windowed, sink and soft-capped layers: three
 * sessions take turns, so each one's pages go to disk and come back; every decode is
 * bitwise what a twin engine without a budget gives. */
START_TEST(variants_under_spill)
{
    char dir[] = "/tmp/pkv-variants-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    const geo G = {4, 2, 8, 8, 4};
    float logits[3 * 8];
    pkv_layer_config lc[3];
    layer_configs(3, G.h, logits, lc); /* window 7 + sinks 3 + softcap + logits | plain | ... */
    pkv_config c = pkv_config_default();
    c.n_layers = 3;
    c.n_heads = G.h;
    c.n_kv_heads = G.g;
    c.head_dim = G.d;
    c.block_tokens = G.bt;
    c.kv_dtype = PKV_F16;
    c.layer_cfg = lc;
    c.n_threads = 1;
    pkv_engine *twin;
    ck_assert_int_eq(pkv_engine_create(&c, &twin), PKV_OK);
    c.spill_dir = dir;
    c.mem_budget = 24ull * (2ull * G.g * G.bt * G.d * 2); /* 24 pages: one session's worth */
    pkv_engine *e;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_OK);
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 40);
    const uint32_t T = 40;
    tokens tk = make_tokens(&r, &G, PKV_F16, T);
    const size_t qd = 32, kd = 16, od = 32;
    pkv_session *s[3], *w[3];
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(pkv_session_create(e, &s[i]), PKV_OK);
        ck_assert_int_eq(pkv_session_create(twin, &w[i]), PKV_OK);
    }
    uint64_t spilled_max = 0;
    for (uint32_t t = 0; t < T; t++)
        for (int i = 0; i < 3; i++)
            for (uint32_t l = 0; l < 3; l++) {
                const float *k = tk.k + ((t + 7 * (uint32_t)i) % T) * kd;
                ck_assert_int_eq(pkv_append(s[i], l, k, k), PKV_OK);
                ck_assert_int_eq(pkv_append(w[i], l, k, k), PKV_OK);
                float a[32], b[32];
                ck_assert_int_eq(pkv_decode(s[i], l, tk.q + t * qd, a), PKV_OK);
                ck_assert_int_eq(pkv_decode(w[i], l, tk.q + t * qd, b), PKV_OK);
                ck_assert_msg(memcmp(a, b, od * sizeof *a) == 0, "spill changed a decode");
                pkv_stats st;
                ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
                spilled_max = st.pages_spilled > spilled_max ? st.pages_spilled : spilled_max;
            }
    ck_assert_uint_gt(spilled_max, 0); /* the budget really made pages go to disk */
    ck_assert(pkvi_engine_check(e));
    for (int i = 0; i < 3; i++) {
        pkv_session_destroy(s[i]);
        pkv_session_destroy(w[i]);
    }
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
    free_tokens(&tk);
    rmdir(dir);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("variants");
    TCase *tc = tcase_create("reference");
    tcase_add_test(tc, window_and_sinks_are_causal_over_the_attended_set);
    tcase_add_test(tc, v_width_differs_from_k_width);
    tcase_add_test(tc, softcap_and_sink_logit_closed_forms);
    tcase_add_test(tc, bad_configs_are_rejected);
    suite_add_tcase(s, tc);
    TCase *te = tcase_create("engine");
    tcase_set_timeout(te, 240);
    tcase_add_test(te, engine_decode_matches_the_oracle);
    tcase_add_test(te, every_path_gives_the_same_bits);
    tcase_add_test(te, windowed_fork_and_truncate);
    tcase_add_test(te, rollback_counts_from_the_longest_length);
    tcase_add_test(te, engine_rejects_bad_variants);
    tcase_add_test(te, mla_absorbed_equals_naive);
    tcase_add_test(te, variants_save_and_load);
    tcase_add_test(te, a_plain_engine_still_writes_version_1);
    tcase_add_test(te, variants_under_spill);
    suite_add_tcase(s, te);
    return pkvt_run(s);
}

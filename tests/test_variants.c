/*
 * test_variants.c - SPEC §8's attention variants. So far: the dense oracle
 * pkv_attention_reference, held against pkv_causal_attention on rearranged inputs (a
 * window with sinks is causal attention over the attended positions alone; a K/V of
 * different widths is causal attention with V zero-padded) and against closed forms
 * for soft-capping and sink logits, plus its rejections.
 */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
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

int main(void)
{
    Suite *s = suite_create("variants");
    TCase *tc = tcase_create("reference");
    tcase_add_test(tc, window_and_sinks_are_causal_over_the_attended_set);
    tcase_add_test(tc, v_width_differs_from_k_width);
    tcase_add_test(tc, softcap_and_sink_logit_closed_forms);
    tcase_add_test(tc, bad_configs_are_rejected);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

/*
 * test_rope.c - SPEC §14's RoPE in the engine: the rope fields of pkv_layer_config and
 * pkv_rope_q (src/rope/).
 *
 * Three properties, each against something written independently of rope.c:
 *   - accuracy: pkv_rope_q against a rotation computed here in long double from the
 *     definition (angle p * scale * theta^(-2i/dims)), every style, partial rotation,
 *     theta and scale, positions from 0 to 2^24 and past it, within the header's bound;
 *   - the same bits: the SIMD rotation kernels equal rope.c's scalar specification bit
 *     for bit, and a key the engine rotates when it stores it is the key pkv_rope_q
 *     rotates (an engine with rope decodes to the bit what an engine without it decodes
 *     over keys pkv_rope_q turned), for append and prefill, every dtype;
 *   - the config: bad rope fields are PKV_EINVAL with pkv_config_explain's reason,
 *     defaults are resolved, a layer without rope is exactly what it was.
 */
#include "testutil.h"
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the independent reference ---------------------------------------------------- */

/* Rotate head x [d] at position p in long double, in place, pairs by style. */
static void ref_rotate(const pkv_layer_config *lc, uint32_t d, uint64_t p, const float *x,
                       long double *y)
{
    const uint32_t rd = lc->rope_dims ? lc->rope_dims : d, half = rd / 2;
    const long double theta = lc->rope_theta ? lc->rope_theta : 10000.0L;
    const long double sc = lc->rope_freq_scale ? lc->rope_freq_scale : 1.0L;
    for (uint32_t j = 0; j < d; j++)
        y[j] = x[j];
    for (uint32_t i = 0; i < half; i++) {
        /* the frequency as the engine holds it (a double), the product exact */
        const double f = (double)sc * pow((double)theta, -(2.0 * i) / rd);
        const long double a = (long double)p * (long double)f;
        const long double c = cosl(a), s = sinl(a);
        const uint32_t i0 = lc->rope == PKV_ROPE_NORM ? 2 * i : i;
        const uint32_t i1 = lc->rope == PKV_ROPE_NORM ? 2 * i + 1 : i + half;
        y[i0] = x[i0] * c - x[i1] * s;
        y[i1] = x[i0] * s + x[i1] * c;
    }
}

static pkv_config rope_config(uint32_t L, uint32_t h, uint32_t g, uint32_t d, uint32_t bt,
                              pkv_dtype dt, pkv_layer_config *lc)
{
    pkv_config c = pkvt_config(L, h, g, d, bt, dt);
    c.layer_cfg = lc;
    return c;
}

/* ---- accuracy ----------------------------------------------------------------------- */

/* The header's bound for a pair of norm nrm at position p with frequency f: 2^-20 of
 * the norm, plus the angle resolution of a double past the tables. */
static double bound(double nrm, uint64_t p, double f)
{
    const double beyond = p >> 24 ? (double)p * f * 0x1p-52 : 0.0;
    return (0x1p-20 + beyond) * nrm + 1e-30;
}

static void check_positions(const pkv_layer_config *lc0, uint32_t d, const uint64_t *pos,
                            uint32_t n_pos, pkvt_rng *r)
{
    pkv_layer_config lc[1] = {*lc0};
    const uint32_t h = 2;
    pkv_config c = rope_config(1, h, 1, d, 16, PKV_F32, lc);
    pkv_engine *e = pkvt_engine_cfg(&c);
    float *q = pkvt_alloc((size_t)n_pos * h * d * sizeof *q);
    float *q0 = pkvt_alloc((size_t)n_pos * h * d * sizeof *q0);
    long double *y = pkvt_alloc(d * sizeof *y);
    pkvt_fill(r, q0, (size_t)n_pos * h * d, -2.0f, 2.0f);
    memcpy(q, q0, (size_t)n_pos * h * d * sizeof *q);
    ck_assert_int_eq(pkv_rope_q(e, 0, n_pos, pos, q), PKV_OK);
    const uint32_t rd = lc->rope_dims ? lc->rope_dims : d, half = rd / 2;
    const double sc = lc->rope_freq_scale ? lc->rope_freq_scale : 1.0;
    for (uint32_t j = 0; j < n_pos; j++)
        for (uint32_t hh = 0; hh < h; hh++) {
            const float *x = q0 + ((size_t)j * h + hh) * d, *got = q + ((size_t)j * h + hh) * d;
            ref_rotate(lc, d, pos[j], x, y);
            for (uint32_t i = 0; i < half; i++) {
                const uint32_t i0 = lc->rope == PKV_ROPE_NORM ? 2 * i : i;
                const uint32_t i1 = lc->rope == PKV_ROPE_NORM ? 2 * i + 1 : i + half;
                const double nrm = hypot(x[i0], x[i1]);
                const double f = sc * pow(lc->rope_theta ? lc->rope_theta : 1e4,
                                          -(2.0 * i) / rd);
                const double err = hypot((double)(got[i0] - y[i0]), (double)(got[i1] - y[i1]));
                ck_assert_msg(err <= bound(nrm, pos[j], f),
                              "style %u d %u rd %u pos %llu pair %u: error %g > %g (seed %llu)",
                              lc->rope, d, rd, (unsigned long long)pos[j], i, err,
                              bound(nrm, pos[j], f), (unsigned long long)pkvt_seed());
            }
            for (uint32_t k = rd; k < d; k++) /* past rope_dims: unchanged */
                ck_assert(got[k] == x[k]);
        }
    free(q);
    free(q0);
    free(y);
    pkv_engine_destroy(e);
}

START_TEST(accuracy_styles)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    uint64_t pos[64];
    uint32_t n = 0;
    const uint64_t edges[] = {0, 1, 63, 64, 65, 4095, 4096, 262143, 262144, (1u << 24) - 1};
    for (uint32_t i = 0; i < sizeof edges / sizeof edges[0]; i++)
        pos[n++] = edges[i];
    while (n < 64)
        pos[n++] = pkvt_next(&r) & ((1u << 24) - 1);
    const struct { uint32_t style, d, rd; float theta, scale; } cases[] = {
        {PKV_ROPE_NORM, 8, 0, 0, 0},            /* stories260K: d 8, defaults */
        {PKV_ROPE_NORM, 64, 0, 10000, 1},
        {PKV_ROPE_NEOX, 128, 0, 500000, 1},     /* Llama 3 */
        {PKV_ROPE_NEOX, 128, 0, 1000000, 1},    /* Qwen 2 */
        {PKV_ROPE_NEOX, 128, 64, 10000, 1},     /* partial: half the head */
        {PKV_ROPE_NORM, 80, 32, 10000, 0.25f},  /* partial, linear scaling */
        {PKV_ROPE_NEOX, 96, 96, 10000, 0.5f},
        {PKV_ROPE_NORM, 2, 2, 10000, 1},        /* one pair */
        {PKV_ROPE_NEOX, 34, 30, 1000, 4.0f},    /* tails of every vector width */
        {PKV_ROPE_NORM, 46, 0, 10000, 1},
    };
    for (uint32_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        pkv_layer_config lc;
        memset(&lc, 0, sizeof lc);
        lc.rope = cases[k].style;
        lc.rope_dims = cases[k].rd;
        lc.rope_theta = cases[k].theta;
        lc.rope_freq_scale = cases[k].scale;
        check_positions(&lc, cases[k].d, pos, n, &r);
    }
}
END_TEST

/* Past the tables (2^24 and beyond) the bound grows with the angle; at 2^63 and
 * 2^64 - 1 the result is at least a rotation (norms kept). */
START_TEST(accuracy_far)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 1);
    const uint64_t pos[] = {1ull << 24, (1ull << 24) + 1, (1ull << 24) + 12345,
                            (1ull << 30) + 777, (1ull << 32) - 1, (1ull << 32) + 5,
                            1ull << 40, (1ull << 40) + 3};
    const uint32_t n = sizeof pos / sizeof pos[0];
    for (uint32_t style = PKV_ROPE_NORM; style <= PKV_ROPE_NEOX; style++) {
        pkv_layer_config lc;
        memset(&lc, 0, sizeof lc);
        lc.rope = style;
        lc.rope_theta = 10000;
        check_positions(&lc, 64, pos, n, &r);
    }
    /* 2^63 and the largest position: finite, and each pair keeps its norm */
    pkv_layer_config lc[1];
    memset(lc, 0, sizeof lc);
    lc[0].rope = PKV_ROPE_NEOX;
    pkv_config c = rope_config(1, 4, 2, 64, 16, PKV_F32, lc);
    pkv_engine *e = pkvt_engine_cfg(&c);
    const uint64_t far[] = {1ull << 63, UINT64_MAX, (1ull << 63) + 1};
    float q[3][4 * 64], q0[3][4 * 64];
    pkvt_fill(&r, &q0[0][0], sizeof q0 / sizeof(float), -1.0f, 1.0f);
    memcpy(q, q0, sizeof q);
    ck_assert_int_eq(pkv_rope_q(e, 0, 3, far, &q[0][0]), PKV_OK);
    for (int j = 0; j < 3; j++)
        for (int hh = 0; hh < 4; hh++)
            for (int i = 0; i < 32; i++) {
                const float *x = q0[j] + hh * 64, *y = q[j] + hh * 64;
                ck_assert(isfinite(y[i]) && isfinite(y[i + 32]));
                const double n0 = hypot(x[i], x[i + 32]), n1 = hypot(y[i], y[i + 32]);
                ck_assert_msg(fabs(n0 - n1) <= 0x1p-19 * n0 + 1e-30,
                              "pos %llu: norm %g became %g", (unsigned long long)far[j], n0, n1);
            }
    pkv_engine_destroy(e);
}
END_TEST

/* ---- the same bits ------------------------------------------------------------------- */

/* Every rotation table the host runs, against the scalar one: combine and both styles,
 * every width from 1 to 70 pairs (all tails). Every SIMD decode table this build has
 * and the host runs rotates with vectors of its own family (a VNNI or dot-product
 * table with its base table's), never with the scalar kernels. */
START_TEST(kernels_bitwise)
{
    const char *isas[] = {"avx2", "avx2vnni", "avx512", "avx512vnni", "neon", "neon_dotprod"};
    const uint32_t n_isas = sizeof isas / sizeof isas[0];
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 2);
    float a[2 * 70], b[2 * 70], o1[2 * 70], o2[2 * 70], x1[3 * 143], x2[3 * 143];
    for (uint32_t k = 0; k < n_isas; k++) {
        if (!pkvi_isa_supported(isas[k]))
            continue;
        const pkvi_rope_kernels *v = pkvi_rope_kernels_for(isas[k]);
        ck_assert_msg(v != &pkvi_rope_scalar && strncmp(isas[k], v->isa, strlen(v->isa)) == 0,
                      "the %s decode table rotates with the %s kernels", isas[k], v->isa);
        for (uint32_t half = 1; half <= 70; half++) {
            pkvt_fill(&r, a, 2 * half, -1.0f, 1.0f);
            pkvt_fill(&r, b, 2 * half, -1.0f, 1.0f);
            pkvi_rope_scalar.combine(half, a, b, o1);
            v->combine(half, a, b, o2);
            ck_assert_msg(memcmp(o1, o2, 2 * half * sizeof(float)) == 0, "%s combine %u",
                          isas[k], half);
            memcpy(o2, a, sizeof a); /* in place, as pkvi_rope_at uses it */
            v->combine(half, o2, b, o2);
            ck_assert(memcmp(o1, o2, 2 * half * sizeof(float)) == 0);
            for (uint32_t style = PKV_ROPE_NORM; style <= PKV_ROPE_NEOX; style++) {
                const size_t stride = 2 * half + 3; /* rows with values past the pairs */
                pkvt_fill(&r, x1, 3 * stride, -3.0f, 3.0f);
                memcpy(x2, x1, 3 * stride * sizeof(float));
                pkvi_rope_scalar.rotate(style, half, a, x1, 3, stride);
                v->rotate(style, half, a, x2, 3, stride);
                ck_assert_msg(memcmp(x1, x2, 3 * stride * sizeof(float)) == 0,
                              "%s rotate style %u half %u", isas[k], style, half);
            }
        }
    }
}
END_TEST

/* An engine with rope stores keys that pkv_rope_q turns the same way: it decodes (and
 * prefills) to the bit what an engine without rope gives over those keys. */
static void same_bits(pkv_dtype dt, uint32_t style, uint32_t rd)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ (dt * 31u + style));
    const uint32_t h = 8, g = 2, d = 64, bt = 16, T = 70;
    pkv_layer_config lr[2], ln[2];
    memset(lr, 0, sizeof lr);
    memset(ln, 0, sizeof ln);
    lr[0].rope = lr[1].rope = style;
    lr[0].rope_dims = lr[1].rope_dims = rd;
    lr[1].rope_theta = 500000;
    lr[1].window = ln[1].window = 24; /* with a window too */
    pkv_config cr = rope_config(2, h, g, d, bt, dt, lr), cn = rope_config(2, h, g, d, bt, dt, ln);
    pkv_engine *er = pkvt_engine_cfg(&cr), *en = pkvt_engine_cfg(&cn);
    pkv_session *sr = pkvt_session(er), *sn = pkvt_session(en);
    pkv_session *pr = pkvt_session(er), *pn = pkvt_session(en);
    const size_t qn = (size_t)h * d, kn = (size_t)g * d;
    float *K = pkvt_alloc(T * kn * 4), *V = pkvt_alloc(T * kn * 4), *Q = pkvt_alloc(T * qn * 4);
    float *Kr = pkvt_alloc(T * h * d * 4), *o1 = pkvt_alloc(T * qn * 4), *o2 = pkvt_alloc(T * qn * 4);
    pkvt_fill(&r, K, T * kn, -1.5f, 1.5f);
    pkvt_fill(&r, V, T * kn, -1.0f, 1.0f);
    pkvt_fill(&r, Q, T * qn, -1.5f, 1.5f);
    for (uint32_t l = 0; l < 2; l++) {
        uint64_t *pos = pkvt_alloc(T * sizeof *pos);
        for (uint32_t t = 0; t < T; t++) {
            pos[t] = t;
            /* a key row rotated as a query row: the first g heads of an [h][d] row */
            memcpy(Kr + (size_t)t * h * d, K + t * kn, kn * 4);
        }
        float *Qr = pkvt_alloc(T * qn * 4);
        memcpy(Qr, Q, T * qn * 4);
        ck_assert_int_eq(pkv_rope_q(er, l, T, pos, Kr), PKV_OK);
        ck_assert_int_eq(pkv_rope_q(er, l, T, pos, Qr), PKV_OK);
        for (uint32_t t = 0; t < T; t++) {
            ck_assert_int_eq(pkv_append(sr, l, K + t * kn, V + t * kn), PKV_OK);
            ck_assert_int_eq(pkv_append(sn, l, Kr + (size_t)t * h * d, V + t * kn), PKV_OK);
            ck_assert_int_eq(pkv_decode(sr, l, Qr + t * qn, o1 + t * qn), PKV_OK);
            ck_assert_int_eq(pkv_decode(sn, l, Qr + t * qn, o2 + t * qn), PKV_OK);
        }
        ck_assert_msg(memcmp(o1, o2, T * qn * 4) == 0, "append, dtype %s style %u layer %u",
                      pkv_dtype_name(dt), style, l);
        /* prefill in two calls (the second starts inside a page) */
        float *Kp = pkvt_alloc(T * kn * 4);
        for (uint32_t t = 0; t < T; t++)
            memcpy(Kp + t * kn, Kr + (size_t)t * h * d, kn * 4);
        ck_assert_int_eq(pkv_prefill(pr, l, 37, Qr, K, V, o1), PKV_OK);
        ck_assert_int_eq(pkv_prefill(pr, l, T - 37, Qr + 37 * qn, K + 37 * kn, V + 37 * kn,
                                     o1 + 37 * qn), PKV_OK);
        ck_assert_int_eq(pkv_prefill(pn, l, T, Qr, Kp, V, o2), PKV_OK);
        ck_assert_msg(memcmp(o1, o2, T * qn * 4) == 0, "prefill, dtype %s style %u layer %u",
                      pkv_dtype_name(dt), style, l);
        free(Kp);
        free(Qr);
        free(pos);
    }
    free(K);
    free(V);
    free(Q);
    free(Kr);
    free(o1);
    free(o2);
    pkv_engine_destroy(er);
    pkv_engine_destroy(en);
}

START_TEST(store_f32) { same_bits(PKV_F32, PKV_ROPE_NORM, 0); same_bits(PKV_F32, PKV_ROPE_NEOX, 32); }
END_TEST
START_TEST(store_f16) { same_bits(PKV_F16, PKV_ROPE_NEOX, 0); same_bits(PKV_F16, PKV_ROPE_NORM, 40); }
END_TEST
START_TEST(store_bf16) { same_bits(PKV_BF16, PKV_ROPE_NORM, 0); }
END_TEST
START_TEST(store_q8) { same_bits(PKV_Q8, PKV_ROPE_NEOX, 0); same_bits(PKV_Q8, PKV_ROPE_NORM, 24); }
END_TEST
START_TEST(store_q4) { same_bits(PKV_Q4, PKV_ROPE_NORM, 0); same_bits(PKV_Q4, PKV_ROPE_NEOX, 48); }
END_TEST

/* ---- the config ---------------------------------------------------------------------- */

START_TEST(config_checks)
{
    pkv_layer_config lc[2];
    const struct { uint32_t rope, dims; float theta, scale; const char *why; } bad[] = {
        {3, 0, 0, 0, "rope 3"},
        {0, 8, 0, 0, "without rope"},
        {0, 0, 10000, 0, "without rope"},
        {0, 0, 0, 1, "without rope"},
        {PKV_ROPE_NORM, 7, 0, 0, "rope_dims 7"},
        {PKV_ROPE_NORM, 66, 0, 0, "rope_dims 66"},
        {PKV_ROPE_NEOX, 0, -1, 0, "rope_theta"},
        {PKV_ROPE_NEOX, 0, INFINITY, 0, "rope_theta"},
        {PKV_ROPE_NEOX, 0, NAN, 0, "rope_theta"},
        {PKV_ROPE_NEOX, 0, 0, -0.5f, "rope_freq_scale"},
        {PKV_ROPE_NEOX, 0, 0, NAN, "rope_freq_scale"},
        {UINT32_MAX, 0, 0, 0, "rope 4294967295"},
    };
    for (uint32_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        memset(lc, 0, sizeof lc);
        lc[1].rope = bad[k].rope;
        lc[1].rope_dims = bad[k].dims;
        lc[1].rope_theta = bad[k].theta;
        lc[1].rope_freq_scale = bad[k].scale;
        pkv_config c = rope_config(2, 4, 2, 64, 16, PKV_F32, lc);
        char why[256];
        pkv_engine *e = NULL;
        ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
        ck_assert_msg(strstr(why, bad[k].why) && strstr(why, "layer_cfg[1]"), "case %u: '%s'",
                      k, why);
        ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
        ck_assert_ptr_null(e);
    }
    /* an odd head_dim rotates only with an even rope_dims */
    memset(lc, 0, sizeof lc);
    lc[0].rope = PKV_ROPE_NORM;
    pkv_config c = rope_config(2, 4, 2, 65, 16, PKV_F32, lc);
    ck_assert_int_eq(pkv_config_explain(&c, NULL, 0), PKV_EINVAL);
    lc[0].rope_dims = 64;
    ck_assert_int_eq(pkv_config_explain(&c, NULL, 0), PKV_OK);
    /* defaults resolved: dims = head_dim, theta 10000, scale 1; the caller's array
     * untouched and copied */
    memset(lc, 0, sizeof lc);
    lc[0].rope = PKV_ROPE_NEOX;
    c = rope_config(2, 4, 2, 64, 16, PKV_F32, lc);
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_config got;
    ck_assert_int_eq(pkv_engine_config(e, &got), PKV_OK);
    ck_assert_uint_eq(got.layer_cfg[0].rope, PKV_ROPE_NEOX);
    ck_assert_uint_eq(got.layer_cfg[0].rope_dims, 64);
    ck_assert(got.layer_cfg[0].rope_theta == 10000.0f);
    ck_assert(got.layer_cfg[0].rope_freq_scale == 1.0f);
    ck_assert_uint_eq(got.layer_cfg[1].rope, 0);
    ck_assert_uint_eq(lc[0].rope_dims, 0);
    pkv_engine_destroy(e);
}
END_TEST

START_TEST(rope_q_calls)
{
    pkv_layer_config lc[2];
    memset(lc, 0, sizeof lc);
    lc[0].rope = PKV_ROPE_NORM;
    pkv_config c = rope_config(2, 4, 2, 16, 16, PKV_F32, lc);
    pkv_engine *e = pkvt_engine_cfg(&c);
    float q[2 * 4 * 16], q0[2 * 4 * 16];
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 3);
    pkvt_fill(&r, q0, 128, -1.0f, 1.0f);
    memcpy(q, q0, sizeof q);
    const uint64_t pos[2] = {5, 1ull << 63};
    ck_assert_int_eq(pkv_rope_q(NULL, 0, 2, pos, q), PKV_EINVAL);
    ck_assert_int_eq(pkv_rope_q(e, 2, 2, pos, q), PKV_EINVAL);
    ck_assert_int_eq(pkv_rope_q(e, UINT32_MAX, 2, pos, q), PKV_EINVAL);
    ck_assert_int_eq(pkv_rope_q(e, 0, 2, NULL, q), PKV_EINVAL);
    ck_assert_int_eq(pkv_rope_q(e, 0, 2, pos, NULL), PKV_EINVAL);
    char why[128];
    ck_assert_int_eq(pkv_engine_last_error(e, why, sizeof why), PKV_OK);
    ck_assert_msg(strstr(why, "pkv_rope_q"), "%s", why);
    ck_assert_mem_eq(q, q0, sizeof q);
    ck_assert_int_eq(pkv_rope_q(e, 0, 0, NULL, NULL), PKV_OK); /* nothing to do */
    ck_assert_int_eq(pkv_rope_q(e, 1, 2, pos, q), PKV_OK);     /* no rope: unchanged */
    ck_assert_mem_eq(q, q0, sizeof q);
    ck_assert_int_eq(pkv_rope_q(e, 0, 2, pos, q), PKV_OK);
    ck_assert(memcmp(q, q0, sizeof q) != 0);
    /* position 0 is the identity */
    const uint64_t zero[2] = {0, 0};
    memcpy(q, q0, sizeof q);
    ck_assert_int_eq(pkv_rope_q(e, 0, 2, zero, q), PKV_OK);
    ck_assert_mem_eq(q, q0, sizeof q);
    pkv_engine_destroy(e);
}
END_TEST

/* Without rope fields a layer stores exactly what it is given: an engine whose other
 * layer has rope decodes the plain layer to the bit as an engine without rope at all. */
START_TEST(plain_layer_unchanged)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 4);
    pkv_layer_config lc[2];
    memset(lc, 0, sizeof lc);
    lc[1].rope = PKV_ROPE_NEOX;
    pkv_config c1 = rope_config(2, 4, 2, 32, 8, PKV_F16, lc);
    pkv_config c0 = pkvt_config(2, 4, 2, 32, 8, PKV_F16);
    pkv_engine *e1 = pkvt_engine_cfg(&c1), *e0 = pkvt_engine_cfg(&c0);
    pkv_session *s1 = pkvt_session(e1), *s0 = pkvt_session(e0);
    float k[64], v[64], q[128], o1[128], o0[128];
    for (int t = 0; t < 40; t++) {
        pkvt_fill(&r, k, 64, -1, 1);
        pkvt_fill(&r, v, 64, -1, 1);
        pkvt_fill(&r, q, 128, -1, 1);
        ck_assert_int_eq(pkv_append(s1, 0, k, v), PKV_OK);
        ck_assert_int_eq(pkv_append(s0, 0, k, v), PKV_OK);
        ck_assert_int_eq(pkv_decode(s1, 0, q, o1), PKV_OK);
        ck_assert_int_eq(pkv_decode(s0, 0, q, o0), PKV_OK);
        ck_assert_mem_eq(o1, o0, sizeof o1);
    }
    pkv_engine_destroy(e1);
    pkv_engine_destroy(e0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("rope");
    TCase *ta = tcase_create("accuracy");
    tcase_set_timeout(ta, 300);
    tcase_add_test(ta, accuracy_styles);
    tcase_add_test(ta, accuracy_far);
    suite_add_tcase(s, ta);
    TCase *tb = tcase_create("bits");
    tcase_set_timeout(tb, 300);
    tcase_add_test(tb, kernels_bitwise);
    tcase_add_test(tb, store_f32);
    tcase_add_test(tb, store_f16);
    tcase_add_test(tb, store_bf16);
    tcase_add_test(tb, store_q8);
    tcase_add_test(tb, store_q4);
    tcase_add_test(tb, plain_layer_unchanged);
    suite_add_tcase(s, tb);
    TCase *tc = tcase_create("calls");
    tcase_add_test(tc, config_checks);
    tcase_add_test(tc, rope_q_calls);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

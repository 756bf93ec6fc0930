/*
 * test_reference.c - Check suite for src/attention/reference.c: the dense causal-attention
 * oracle, the textbook MHA/GQA/MQA layer and the KV-cache size formula (docs/memory.md, "The size
 * formula").
 *
 * The references here are written independently of the library: attention is the
 * test oracle of testutil.c (double precision, the other spelling of the GQA mapping,
 * floor(i * g / h)), and the naive MHA slices every head out of the weight matrices
 * explicitly before calling it. The size formula is checked against a 128-bit product.
 *
 * Seeds: every randomized test starts from pkvt_seed() (PKV_TEST_SEED overrides) and
 * names the seed and the case in its failure messages.
 */
#include "testutil.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

__extension__ typedef unsigned __int128 u128;

#define SENTINEL 12345.678f
#define N_SENTINEL 16

/* ---- independent references (double) ---------------------------------------------- */

/* C [n][m] = A [n][k] * B [k][m]. */
static void ref_matmul(size_t n, size_t k, size_t m, const double *A, const double *B,
                       double *C)
{
    for (size_t r = 0; r < n; r++)
        for (size_t j = 0; j < m; j++) {
            double s = 0;
            for (size_t x = 0; x < k; x++)
                s += A[r * k + x] * B[x * m + j];
            C[r * m + j] = s;
        }
}

/* Naive MHA/GQA layer: for every head, slice its own columns out of Wq and its group's
 * columns out of Wk / Wv, project, attend, and place the result in the head's slot of
 * the concatenation; then multiply by Wo. Everything in double. out [T][dm]. */
static void ref_mha(uint32_t T, uint32_t dm, uint32_t h, uint32_t g, const float *X,
                    const float *Wq, const float *Wk, const float *Wv, const float *Wo,
                    double *out)
{
    uint32_t d = dm / h, kvw = g * d;
    double *Qi = pkvt_alloc((size_t)T * d * sizeof(double));
    double *Ki = pkvt_alloc((size_t)T * d * sizeof(double));
    double *Vi = pkvt_alloc((size_t)T * d * sizeof(double));
    double *Ai = pkvt_alloc((size_t)T * d * sizeof(double));
    double *cat = pkvt_alloc((size_t)T * dm * sizeof(double));
    double *Wod = pkvt_to_double(Wo, (size_t)dm * dm);
    for (uint32_t i = 0; i < h; i++) {
        uint32_t grp = (uint32_t)((uint64_t)i * g / h);
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t c = 0; c < d; c++) {
                double q = 0, k = 0, v = 0;
                for (uint32_t x = 0; x < dm; x++) {
                    double xv = X[(size_t)t * dm + x];
                    q += xv * Wq[(size_t)x * dm + i * d + c];
                    k += xv * Wk[(size_t)x * kvw + grp * d + c];
                    v += xv * Wv[(size_t)x * kvw + grp * d + c];
                }
                Qi[(size_t)t * d + c] = q;
                Ki[(size_t)t * d + c] = k;
                Vi[(size_t)t * d + c] = v;
            }
        pkvt_oracle_causal(T, 1, 1, d, 1.0 / sqrt((double)d), Qi, Ki, Vi, Ai);
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t c = 0; c < d; c++)
                cat[(size_t)t * dm + i * d + c] = Ai[(size_t)t * d + c];
    }
    ref_matmul(T, dm, dm, cat, Wod, out);
    free(Qi);
    free(Ki);
    free(Vi);
    free(Ai);
    free(cat);
    free(Wod);
}

/* ---- helpers ------------------------------------------------------------------------ */

static float *alloc_out(size_t n)
{
    float *o = pkvt_alloc((n + N_SENTINEL) * sizeof(float));
    for (size_t i = 0; i < n + N_SENTINEL; i++)
        o[i] = SENTINEL;
    return o;
}

/* the N_SENTINEL floats past n are untouched */
static bool tail_intact(const float *o, size_t n)
{
    for (size_t i = n; i < n + N_SENTINEL; i++)
        if (memcmp(&o[i], &(float){SENTINEL}, sizeof(float)) != 0)
            return false;
    return true;
}

/* all n floats and the N_SENTINEL after them are untouched */
static bool all_sentinel(const float *o, size_t n)
{
    for (size_t i = 0; i < n; i += N_SENTINEL)
        if (!tail_intact(o, i))
            return false;
    return tail_intact(o, n);
}

static double maxabs_d(const double *x, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        if (fabs(x[i]) > m)
            m = fabs(x[i]);
    return m;
}

static uint32_t random_divisor(pkvt_rng *r, uint32_t h)
{
    uint32_t divs[16], n = 0;
    for (uint32_t g = 1; g <= h; g++)
        if (h % g == 0)
            divs[n++] = g;
    return divs[pkvt_below(r, n)];
}

/* ---- pkv_kv_cache_bytes -------------------------------------------------------------- */

START_TEST(kv_bytes_spec_values)
{
    uint64_t b = 0;
    ck_assert_int_eq(pkv_kv_cache_bytes(32, 8, 128, 8192, 1, 2, &b), PKV_OK);
    ck_assert_uint_eq(b, 1ull << 30);
    ck_assert_int_eq(pkv_kv_cache_bytes(32, 32, 128, 8192, 1, 2, &b), PKV_OK);
    ck_assert_uint_eq(b, 4ull << 30);
    ck_assert_int_eq(pkv_kv_cache_bytes(1, 1, 1, 1, 1, 1, &b), PKV_OK);
    ck_assert_uint_eq(b, 2);
    ck_assert_int_eq(pkv_kv_cache_bytes(80, 8, 128, 131072, 4, 4, &b), PKV_OK);
    ck_assert_uint_eq(b, 2ull * 80 * 8 * 128 * 131072 * 4 * 4);
    ck_assert_int_eq(pkv_kv_cache_bytes(1, 1, 1, 1, 1, 1, NULL), PKV_EINVAL);
}
END_TEST

START_TEST(kv_bytes_zero_factors)
{
    /* A zero anywhere gives 0, also when the other factors' product would overflow and
     * also when the zero comes after an overflowing partial product. */
    const uint64_t fill[] = {1, 7, UINT64_MAX};
    for (int z = 0; z < 6; z++)
        for (size_t fi = 0; fi < 3; fi++) {
            uint64_t f[6];
            for (int i = 0; i < 6; i++)
                f[i] = fill[fi];
            f[z] = 0;
            uint64_t b = 99;
            pkv_status st = pkv_kv_cache_bytes(f[0], f[1], f[2], f[3], f[4], f[5], &b);
            ck_assert_msg(st == PKV_OK && b == 0, "zero at %d, others %llu: st=%d b=%llu",
                          z, (unsigned long long)fill[fi], (int)st, (unsigned long long)b);
        }
    uint64_t b = 99;
    ck_assert_int_eq(pkv_kv_cache_bytes(0, 0, 0, 0, 0, 0, &b), PKV_OK);
    ck_assert_uint_eq(b, 0);
    b = 99;
    ck_assert_int_eq(pkv_kv_cache_bytes(1ull << 40, 1ull << 40, 1, 1, 1, 0, &b), PKV_OK);
    ck_assert_uint_eq(b, 0);
}
END_TEST

/* Call with factor list f and expect (st, value); `out` starts as a marker that must
 * survive an error. */
static void expect_bytes(const uint64_t f[6], pkv_status want, uint64_t want_b,
                         const char *what)
{
    const uint64_t marker = 0xdeadbeefcafef00dull;
    uint64_t b = marker;
    pkv_status st = pkv_kv_cache_bytes(f[0], f[1], f[2], f[3], f[4], f[5], &b);
    ck_assert_msg(st == want, "%s: (%llu,%llu,%llu,%llu,%llu,%llu) -> %s, want %s", what,
                  (unsigned long long)f[0], (unsigned long long)f[1],
                  (unsigned long long)f[2], (unsigned long long)f[3],
                  (unsigned long long)f[4], (unsigned long long)f[5],
                  pkv_status_str(st), pkv_status_str(want));
    if (want == PKV_OK)
        ck_assert_msg(b == want_b, "%s: got %llu want %llu", what, (unsigned long long)b,
                      (unsigned long long)want_b);
    else
        ck_assert_msg(b == marker, "%s: out changed on error", what);
}

/* The factor `v` at position `pos`, ones elsewhere. */
static void one_hot(uint64_t f[6], int pos, uint64_t v)
{
    for (int i = 0; i < 6; i++)
        f[i] = 1;
    f[pos] = v;
}

START_TEST(kv_bytes_overflow_boundaries)
{
    /* The result is 2 * (...), always even, so UINT64_MAX itself is never a result:
     * the boundary is UINT64_MAX - 1 (valid) against UINT64_MAX + 1 (overflow). */
    uint64_t f[6];
    for (int pos = 0; pos < 6; pos++) {
        /* 2 * (2^63 - 1) = UINT64_MAX - 1: the largest representable result */
        one_hot(f, pos, UINT64_MAX / 2);
        expect_bytes(f, PKV_OK, UINT64_MAX - 1, "2*(2^63-1)");
        /* 2 * 2^63 = 2^64: one past UINT64_MAX, and a wrap would give 0 */
        one_hot(f, pos, 1ull << 63);
        expect_bytes(f, PKV_ERANGE, 0, "2*2^63");
        one_hot(f, pos, UINT64_MAX);
        expect_bytes(f, PKV_ERANGE, 0, "2*UINT64_MAX");
        one_hot(f, pos, 1ull << 62);
        expect_bytes(f, PKV_OK, 1ull << 63, "2*2^62");
        /* 3 * 2^63 * 2 wraps to 0 as well */
        one_hot(f, pos, 1ull << 63);
        f[(pos + 1) % 6] = 3;
        expect_bytes(f, PKV_ERANGE, 0, "2*3*2^63");
    }
    /* 2^63 - 1 = 7^2 * 73 * 127 * 337 * 92737 * 649657: every factor > 1 and the result
     * is UINT64_MAX - 1; in every rotation (so each position sees the last multiply). */
    const uint64_t p[6] = {49, 73, 127, 337, 92737, 649657};
    for (int rot = 0; rot < 6; rot++) {
        for (int i = 0; i < 6; i++)
            f[i] = p[(i + rot) % 6];
        expect_bytes(f, PKV_OK, UINT64_MAX - 1, "factored 2^64-2");
        /* one more unit in any factor pushes it past UINT64_MAX */
        for (int i = 0; i < 6; i++) {
            uint64_t g[6];
            memcpy(g, f, sizeof g);
            g[i] += 1;
            expect_bytes(g, PKV_ERANGE, 0, "factored, one factor +1");
        }
    }
    /* (2^32 + 1)(2^32 - 1) = UINT64_MAX exactly; doubling overflows and a wrapping
     * multiply would return UINT64_MAX - 1 */
    f[0] = (1ull << 32) + 1; f[1] = (1ull << 32) - 1; f[2] = f[3] = f[4] = f[5] = 1;
    expect_bytes(f, PKV_ERANGE, 0, "2*UINT64_MAX via factors");
    /* overflow spread over many factors, wrapping to 0 */
    f[0] = 1ull << 10; f[1] = 1ull << 10; f[2] = 1ull << 10; f[3] = 1ull << 10;
    f[4] = 1ull << 10; f[5] = 1ull << 13;
    expect_bytes(f, PKV_ERANGE, 0, "2^64 over six factors");
    f[5] = 1ull << 12;
    expect_bytes(f, PKV_OK, 1ull << 63, "2^63 over six factors");
    /* overflow in the partial product, a later factor 1 */
    f[0] = UINT64_MAX; f[1] = UINT64_MAX; f[2] = f[3] = f[4] = f[5] = 1;
    expect_bytes(f, PKV_ERANGE, 0, "MAX*MAX");
}
END_TEST

START_TEST(kv_bytes_random_vs_u128)
{
    uint64_t seed = pkvt_seed() ^ 0x6b76;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    int n = pkvt_quick() ? 20000 : 200000;
    for (int it = 0; it < n; it++) {
        uint64_t f[6];
        for (int i = 0; i < 6; i++) {
            /* log-uniform-ish factors so that results straddle 2^64 */
            uint32_t bits = pkvt_below(&r, 20);
            f[i] = (pkvt_next(&r) >> (63 - bits)) | 1;
            if (pkvt_below(&r, 50) == 0)
                f[i] = 0;
        }
        u128 ref = 2;
        bool zero = false, over = false;
        for (int i = 0; i < 6; i++) {
            if (f[i] == 0)
                zero = true;
            if (!over) {
                ref *= f[i];
                if (ref > (u128)UINT64_MAX)
                    over = true;
            }
        }
        uint64_t b = 7;
        pkv_status st = pkv_kv_cache_bytes(f[0], f[1], f[2], f[3], f[4], f[5], &b);
        if (zero)
            ck_assert_msg(st == PKV_OK && b == 0, "seed %llu case %d: zero factor",
                          (unsigned long long)seed, it);
        else if (over)
            ck_assert_msg(st == PKV_ERANGE && b == 7, "seed %llu case %d: overflow missed",
                          (unsigned long long)seed, it);
        else
            ck_assert_msg(st == PKV_OK && b == (uint64_t)ref, "seed %llu case %d: value",
                          (unsigned long long)seed, it);
    }
}
END_TEST

/* ---- pkv_causal_attention ----------------------------------------------------------- */

START_TEST(attention_random_vs_naive)
{
    uint64_t seed = pkvt_seed() ^ 0xa77e;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    int n = pkvt_quick() ? 40 : 600;
    for (int it = 0; it < n; it++) {
        uint32_t h = 1 + pkvt_below(&r, 8), g = random_divisor(&r, h);
        uint32_t d = 1 + pkvt_below(&r, 33), T = 1 + pkvt_below(&r, 40);
        float scale = pkvt_below(&r, 2) ? 0.0f : pkvt_uniform(&r, 0.05f, 2.0f);
        size_t nq = (size_t)T * h * d, nkv = (size_t)T * g * d;
        float *Q = pkvt_alloc(nq * sizeof(float)), *K = pkvt_alloc(nkv * sizeof(float));
        float *V = pkvt_alloc(nkv * sizeof(float)), *out = alloc_out(nq);
        pkvt_fill(&r, Q, nq, -1, 1);
        pkvt_fill(&r, K, nkv, -1, 1);
        pkvt_fill(&r, V, nkv, -2, 2);
        pkv_status st = pkv_causal_attention(T, h, g, d, scale, Q, K, V, out);
        ck_assert_msg(st == PKV_OK, "seed %llu case %d: %s", (unsigned long long)seed, it,
                      pkv_status_str(st));
        ck_assert_msg(tail_intact(out, nq), "seed %llu case %d: wrote past [T][h][d]",
                      (unsigned long long)seed, it);

        double *Qd = pkvt_to_double(Q, nq), *Kd = pkvt_to_double(K, nkv);
        double *Vd = pkvt_to_double(V, nkv);
        double *ref = pkvt_alloc(nq * sizeof(double));
        double sc = scale == 0.0f ? 1.0 / sqrt((double)d) : (double)scale;
        pkvt_oracle_causal(T, h, g, d, sc, Qd, Kd, Vd, ref);
        /* the oracle rounds a double result to float once: <= 2^-24 relative, and
         * every output is a convex combination of V */
        double tol = 1e-7 * pkvt_maxabs(V, nkv) + 1e-30;
        double err = pkvt_maxdiff_fd(out, ref, nq);
        ck_assert_msg(err <= tol,
                      "seed %llu case %d (T=%u h=%u g=%u d=%u scale=%g): err %.3g > %.3g",
                      (unsigned long long)seed, it, T, h, g, d, (double)scale, err, tol);
        free(Q); free(K); free(V); free(out);
        free(Qd); free(Kd); free(Vd); free(ref);
    }
}
END_TEST

START_TEST(attention_gqa_mapping)
{
    /* V of group j is all j + 1; then every output of head i is exactly the value of
     * the group it read. K differs per group too, so the weights differ. */
    static const uint32_t hg[][2] = {{8, 2}, {8, 4}, {6, 3}, {6, 2}, {4, 1}, {8, 8},
                                     {12, 4}, {32, 8}, {64, 8}, {5, 5}, {7, 1}};
    uint64_t seed = pkvt_seed() ^ 0x9a9a;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    for (size_t c = 0; c < sizeof hg / sizeof hg[0]; c++) {
        uint32_t h = hg[c][0], g = hg[c][1], d = 5, T = 9;
        size_t nq = (size_t)T * h * d, nkv = (size_t)T * g * d;
        float *Q = pkvt_alloc(nq * sizeof(float)), *K = pkvt_alloc(nkv * sizeof(float));
        float *V = pkvt_alloc(nkv * sizeof(float)), *out = alloc_out(nq);
        pkvt_fill(&r, Q, nq, -1, 1);
        pkvt_fill(&r, K, nkv, -1, 1);
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t j = 0; j < g; j++)
                for (uint32_t x = 0; x < d; x++)
                    V[((size_t)t * g + j) * d + x] = (float)(j + 1);
        ck_assert_int_eq(pkv_causal_attention(T, h, g, d, 0, Q, K, V, out), PKV_OK);
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t i = 0; i < h; i++)
                for (uint32_t x = 0; x < d; x++) {
                    float o = out[((size_t)t * h + i) * d + x];
                    float want = (float)(i / (h / g) + 1);
                    ck_assert_msg(fabsf(o - want) <= 1e-6f * want,
                                  "h=%u g=%u t=%u head %u read %g, want group %g", h, g,
                                  t, i, (double)o, (double)want);
                }
        ck_assert(tail_intact(out, nq));
        free(Q); free(K); free(V); free(out);
    }
}
END_TEST

START_TEST(attention_causal)
{
    /* Changing K/V at position p never changes output rows < p (bitwise), and does
     * change row p (the new token is always attended). */
    uint64_t seed = pkvt_seed() ^ 0xca5a;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    int n = pkvt_quick() ? 10 : 100;
    for (int it = 0; it < n; it++) {
        uint32_t h = 1 + pkvt_below(&r, 8), g = random_divisor(&r, h);
        uint32_t d = 1 + pkvt_below(&r, 20), T = 2 + pkvt_below(&r, 30);
        uint32_t p = pkvt_below(&r, T);
        size_t nq = (size_t)T * h * d, nkv = (size_t)T * g * d, row = (size_t)h * d;
        float *Q = pkvt_alloc(nq * sizeof(float)), *K = pkvt_alloc(nkv * sizeof(float));
        float *V = pkvt_alloc(nkv * sizeof(float));
        float *o1 = alloc_out(nq), *o2 = alloc_out(nq);
        pkvt_fill(&r, Q, nq, -1, 1);
        pkvt_fill(&r, K, nkv, -1, 1);
        pkvt_fill(&r, V, nkv, -1, 1);
        ck_assert_int_eq(pkv_causal_attention(T, h, g, d, 0, Q, K, V, o1), PKV_OK);
        /* new V at p is shifted far from [-1, 1] so row p must move */
        pkvt_fill(&r, K + (size_t)p * g * d, (size_t)g * d, -1, 1);
        pkvt_fill(&r, V + (size_t)p * g * d, (size_t)g * d, 5, 6);
        ck_assert_int_eq(pkv_causal_attention(T, h, g, d, 0, Q, K, V, o2), PKV_OK);
        ck_assert_msg(memcmp(o1, o2, (size_t)p * row * sizeof(float)) == 0,
                      "seed %llu case %d: K/V at %u changed an earlier row",
                      (unsigned long long)seed, it, p);
        ck_assert_msg(memcmp(o1 + p * row, o2 + p * row, row * sizeof(float)) != 0,
                      "seed %llu case %d: row %u ignored its own token",
                      (unsigned long long)seed, it, p);
        free(Q); free(K); free(V); free(o1); free(o2);
    }
}
END_TEST

START_TEST(attention_huge_scores)
{
    /* One head, d = 1, scale 1: scores q*k of 1e4 overflow exp() without the
     * max-subtraction (exp(1e4) = inf, inf/inf = NaN). */
    float Q[4] = {100, 100, 100, 100}, K[4] = {100, 99, 100.5f, -100};
    float V[4] = {1, 2, 3, 4}, out[4];
    ck_assert_int_eq(pkv_causal_attention(4, 1, 1, 1, 1.0f, Q, K, V, out), PKV_OK);
    for (int t = 0; t < 4; t++)
        ck_assert_msg(isfinite(out[t]), "row %d is %g", t, (double)out[t]);
    ck_assert(out[0] == 1.0f);                         /* a single token: itself */
    ck_assert(fabsf(out[1] - 1.0f) < 1e-6f);           /* 1e4 vs 9900: e^-100 */
    ck_assert(fabsf(out[2] - 3.0f) < 1e-6f);           /* 10050 dominates */
    ck_assert(fabsf(out[3] - 3.0f) < 1e-6f);           /* -1e4 adds nothing */

    /* every score -1e4 (exp underflows to 0 naively, 0/0): equal keys give the mean */
    float Kn[4] = {-100, -100, -100, -100};
    ck_assert_int_eq(pkv_causal_attention(4, 1, 1, 1, 1.0f, Q, Kn, V, out), PKV_OK);
    ck_assert(fabsf(out[3] - 2.5f) < 1e-6f);
    ck_assert(fabsf(out[1] - 1.5f) < 1e-6f);

    /* scores near 1e30: still finite, still the arg-max's value */
    float Qb[2] = {1e15f, 1e15f}, Kb[2] = {1e15f, 2e15f}, Vb[2] = {-7, 9};
    ck_assert_int_eq(pkv_causal_attention(2, 1, 1, 1, 1.0f, Qb, Kb, Vb, out), PKV_OK);
    ck_assert(out[0] == -7.0f && out[1] == 9.0f);
}
END_TEST

START_TEST(attention_bad_input)
{
    float Q[64], K[64], V[64], out[64 + N_SENTINEL];
    for (int i = 0; i < 64; i++)
        Q[i] = K[i] = V[i] = 0.5f;
    for (int i = 0; i < 64 + N_SENTINEL; i++)
        out[i] = SENTINEL;
    /* T=2 h=4 g=2 d=4: Q/out 32 floats, K/V 16 */
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, 0, NULL, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, 0, Q, NULL, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, 0, Q, K, NULL, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, 0, Q, K, V, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(0, 4, 2, 4, 0, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 0, 2, 4, 0, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 0, 4, 0, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 0, 0, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 3, 4, 0, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 2, 4, 4, 0, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, -1.0f, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, NAN, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, INFINITY, Q, K, V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, -INFINITY, Q, K, V, out),
                     PKV_EINVAL);
    /* element counts that overflow 64 bits: rejected before any buffer is read */
    ck_assert_int_eq(pkv_causal_attention(UINT32_MAX, UINT32_MAX, 1, UINT32_MAX, 0, Q, K,
                                          V, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(UINT32_MAX, 1, 1, UINT32_MAX, 0, Q, K, V, out),
                     PKV_EINVAL);
    ck_assert_msg(all_sentinel(out, 64), "out changed by a failed call");
    /* and a valid call still works afterwards, writing exactly [T][h][d] */
    ck_assert_int_eq(pkv_causal_attention(2, 4, 2, 4, 0, Q, K, V, out), PKV_OK);
    ck_assert(tail_intact(out, 32));
    for (int i = 0; i < 32; i++)
        ck_assert(fabsf(out[i] - 0.5f) < 1e-7f);
}
END_TEST

START_TEST(attention_enomem)
{
#if PKVT_ASAN
    /* ASan aborts on impossible allocation sizes instead of returning NULL */
    return;
#else
    /* 2^31 * 2^20 doubles = 2^54 bytes: a valid size no system can supply */
    float buf[4] = {1, 2, 3, 4}, out[4 + N_SENTINEL];
    for (int i = 0; i < 4 + N_SENTINEL; i++)
        out[i] = SENTINEL;
    ck_assert_int_eq(pkv_causal_attention(1u << 31, 1, 1, 1u << 20, 0, buf, buf, buf, out),
                     PKV_ENOMEM);
    ck_assert(all_sentinel(out, 4));
#endif
}
END_TEST

/* ---- pkv_mha_forward ----------------------------------------------------------------- */

typedef struct {
    uint32_t T, dm, h, g;
    float *X, *Wq, *Wk, *Wv, *Wo;
} layer_case;

static void case_make(pkvt_rng *r, layer_case *c, uint32_t T, uint32_t dm, uint32_t h,
                      uint32_t g)
{
    uint32_t kvw = g * (dm / h);
    float ws = 1.0f / sqrtf((float)dm);
    c->T = T; c->dm = dm; c->h = h; c->g = g;
    c->X = pkvt_alloc((size_t)T * dm * sizeof(float));
    c->Wq = pkvt_alloc((size_t)dm * dm * sizeof(float));
    c->Wk = pkvt_alloc((size_t)dm * kvw * sizeof(float));
    c->Wv = pkvt_alloc((size_t)dm * kvw * sizeof(float));
    c->Wo = pkvt_alloc((size_t)dm * dm * sizeof(float));
    pkvt_fill(r, c->X, (size_t)T * dm, -1, 1);
    pkvt_fill(r, c->Wq, (size_t)dm * dm, -2 * ws, 2 * ws);
    pkvt_fill(r, c->Wk, (size_t)dm * kvw, -2 * ws, 2 * ws);
    pkvt_fill(r, c->Wv, (size_t)dm * kvw, -ws, ws);
    pkvt_fill(r, c->Wo, (size_t)dm * dm, -ws, ws);
}

static void case_free(layer_case *c)
{
    free(c->X); free(c->Wq); free(c->Wk); free(c->Wv); free(c->Wo);
}

static pkv_status case_run(const layer_case *c, float *out)
{
    return pkv_mha_forward(c->T, c->dm, c->h, c->g, c->X, c->Wq, c->Wk, c->Wv, c->Wo, out);
}

/* The library's result for c against ref; out has sentinels after T*dm. */
static void check_layer(const layer_case *c, const double *ref, uint64_t seed, int it)
{
    size_t n = (size_t)c->T * c->dm;
    float *out = alloc_out(n);
    pkv_status st = case_run(c, out);
    ck_assert_msg(st == PKV_OK, "seed %llu case %d: %s", (unsigned long long)seed, it,
                  pkv_status_str(st));
    ck_assert_msg(tail_intact(out, n), "seed %llu case %d: wrote past [T][d_model]",
                  (unsigned long long)seed, it);
    /* intermediates in double, one final rounding to float */
    double tol = 1e-7 * maxabs_d(ref, n) + 1e-12;
    double err = pkvt_maxdiff_fd(out, ref, n);
    ck_assert_msg(err <= tol, "seed %llu case %d (T=%u dm=%u h=%u g=%u): err %.3g > %.3g",
                  (unsigned long long)seed, it, c->T, c->dm, c->h, c->g, err, tol);
    free(out);
}

START_TEST(mha_single_head)
{
    /* n_heads = 1: single-head causal attention of X Wq, X Wk, X Wv, then Wo. */
    uint64_t seed = pkvt_seed() ^ 0x51;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    int n = pkvt_quick() ? 5 : 40;
    for (int it = 0; it < n; it++) {
        uint32_t dm = 1 + pkvt_below(&r, 33), T = 1 + pkvt_below(&r, 40);
        layer_case c;
        case_make(&r, &c, T, dm, 1, 1);
        size_t nx = (size_t)T * dm, nw = (size_t)dm * dm;
        double *X = pkvt_to_double(c.X, nx), *Wq = pkvt_to_double(c.Wq, nw);
        double *Wk = pkvt_to_double(c.Wk, nw), *Wv = pkvt_to_double(c.Wv, nw);
        double *Wo = pkvt_to_double(c.Wo, nw);
        double *Qm = pkvt_alloc(nx * sizeof(double)), *Km = pkvt_alloc(nx * sizeof(double));
        double *Vm = pkvt_alloc(nx * sizeof(double)), *A = pkvt_alloc(nx * sizeof(double));
        double *ref = pkvt_alloc(nx * sizeof(double));
        ref_matmul(T, dm, dm, X, Wq, Qm);
        ref_matmul(T, dm, dm, X, Wk, Km);
        ref_matmul(T, dm, dm, X, Wv, Vm);
        /* single head: row t attends to rows 0..t */
        pkvt_oracle_causal(T, 1, 1, dm, 1.0 / sqrt((double)dm), Qm, Km, Vm, A);
        ref_matmul(T, dm, dm, A, Wo, ref);
        check_layer(&c, ref, seed, it);
        free(X); free(Wq); free(Wk); free(Wv); free(Wo);
        free(Qm); free(Km); free(Vm); free(A); free(ref);
        case_free(&c);
    }
}
END_TEST

START_TEST(mha_full_heads)
{
    /* MHA written as n_kv_heads = n_heads equals the per-head textbook layer. */
    uint64_t seed = pkvt_seed() ^ 0x3a;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    int n = pkvt_quick() ? 5 : 40;
    for (int it = 0; it < n; it++) {
        uint32_t h = 1 + pkvt_below(&r, 8), d = 1 + pkvt_below(&r, 16);
        uint32_t T = 1 + pkvt_below(&r, 30);
        layer_case c;
        case_make(&r, &c, T, h * d, h, h);
        double *ref = pkvt_alloc((size_t)T * h * d * sizeof(double));
        ref_mha(T, h * d, h, h, c.X, c.Wq, c.Wk, c.Wv, c.Wo, ref);
        check_layer(&c, ref, seed, it);
        free(ref);
        case_free(&c);
    }
}
END_TEST

START_TEST(mha_random_vs_naive)
{
    /* MHA, GQA and MQA over many geometries: h 1..8, g | h, d 1..33, T 1..40. */
    uint64_t seed = pkvt_seed() ^ 0x6a;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    int n = pkvt_quick() ? 15 : 250;
    for (int it = 0; it < n; it++) {
        uint32_t h = 1 + pkvt_below(&r, 8), g = random_divisor(&r, h);
        uint32_t d = 1 + pkvt_below(&r, 33), T = 1 + pkvt_below(&r, 40);
        layer_case c;
        case_make(&r, &c, T, h * d, h, g);
        double *ref = pkvt_alloc((size_t)T * h * d * sizeof(double));
        ref_mha(T, h * d, h, g, c.X, c.Wq, c.Wk, c.Wv, c.Wo, ref);
        check_layer(&c, ref, seed, it);
        free(ref);
        case_free(&c);
    }
}
END_TEST

START_TEST(mha_gqa_mapping)
{
    /* X[:,0] = 1 and Wv maps it to "j + 1" on every column of group j; Wo = identity.
     * Then head i's slice of the output is exactly group(i) + 1 everywhere. */
    static const uint32_t hg[][2] = {{8, 2}, {8, 4}, {6, 3}, {4, 1}, {8, 8}, {12, 4}};
    uint64_t seed = pkvt_seed() ^ 0x77;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    for (size_t k = 0; k < sizeof hg / sizeof hg[0]; k++) {
        uint32_t h = hg[k][0], g = hg[k][1], d = 3, dm = h * d, T = 7, kvw = g * d;
        layer_case c;
        case_make(&r, &c, T, dm, h, g);
        for (uint32_t t = 0; t < T; t++)
            c.X[(size_t)t * dm] = 1.0f;
        memset(c.Wv, 0, (size_t)dm * kvw * sizeof(float));
        for (uint32_t j = 0; j < g; j++)
            for (uint32_t x = 0; x < d; x++)
                c.Wv[j * d + x] = (float)(j + 1);            /* row 0 of Wv */
        memset(c.Wo, 0, (size_t)dm * dm * sizeof(float));
        for (uint32_t x = 0; x < dm; x++)
            c.Wo[(size_t)x * dm + x] = 1.0f;
        float *out = alloc_out((size_t)T * dm);
        ck_assert_int_eq(case_run(&c, out), PKV_OK);
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t i = 0; i < h; i++)
                for (uint32_t x = 0; x < d; x++) {
                    float o = out[(size_t)t * dm + i * d + x];
                    float want = (float)(i / (h / g) + 1);
                    ck_assert_msg(fabsf(o - want) <= 1e-6f * want,
                                  "h=%u g=%u t=%u head %u got %g want %g", h, g, t, i,
                                  (double)o, (double)want);
                }
        ck_assert(tail_intact(out, (size_t)T * dm));
        free(out);
        case_free(&c);
    }
}
END_TEST

START_TEST(mha_causal)
{
    /* Changing X at position p leaves rows < p bitwise unchanged. */
    uint64_t seed = pkvt_seed() ^ 0xcc;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    int n = pkvt_quick() ? 5 : 40;
    for (int it = 0; it < n; it++) {
        uint32_t h = 1 + pkvt_below(&r, 8), g = random_divisor(&r, h);
        uint32_t d = 1 + pkvt_below(&r, 12), T = 2 + pkvt_below(&r, 20);
        uint32_t p = pkvt_below(&r, T), dm = h * d;
        layer_case c;
        case_make(&r, &c, T, dm, h, g);
        float *o1 = alloc_out((size_t)T * dm), *o2 = alloc_out((size_t)T * dm);
        ck_assert_int_eq(case_run(&c, o1), PKV_OK);
        pkvt_fill(&r, c.X + (size_t)p * dm, dm, 3, 4);
        ck_assert_int_eq(case_run(&c, o2), PKV_OK);
        ck_assert_msg(memcmp(o1, o2, (size_t)p * dm * sizeof(float)) == 0,
                      "seed %llu case %d: X at %u changed an earlier row",
                      (unsigned long long)seed, it, p);
        free(o1); free(o2);
        case_free(&c);
    }
}
END_TEST

START_TEST(mha_bad_input)
{
    float w[256], out[256 + N_SENTINEL];
    for (int i = 0; i < 256; i++)
        w[i] = 0.25f;
    for (int i = 0; i < 256 + N_SENTINEL; i++)
        out[i] = SENTINEL;
    /* T=2, d_model=8, h=4, g=2 is valid; break one thing at a time */
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 2, NULL, w, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 2, w, NULL, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 2, w, w, NULL, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 2, w, w, w, NULL, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 2, w, w, w, w, NULL, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 2, w, w, w, w, w, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(0, 8, 4, 2, w, w, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 0, 4, 2, w, w, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 0, 2, w, w, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 0, w, w, w, w, w, out), PKV_EINVAL);
    /* the two invalid configurations of include/pagedkv.h, pkv_mha_forward */
    ck_assert_int_eq(pkv_mha_forward(2, 10, 4, 2, w, w, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 3, 1, w, w, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 3, w, w, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 8, 2, 4, w, w, w, w, w, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(2, 4, 8, 8, w, w, w, w, w, out), PKV_EINVAL);
    /* sizes whose products overflow: rejected before any buffer is read */
    ck_assert_int_eq(pkv_mha_forward(UINT32_MAX, UINT32_MAX, 1, 1, w, w, w, w, w, out),
                     PKV_EINVAL);
    ck_assert_msg(all_sentinel(out, 256), "out changed by a failed call");
    /* the valid call writes exactly [T][d_model] = 16 floats */
    ck_assert_int_eq(pkv_mha_forward(2, 8, 4, 2, w, w, w, w, w, out), PKV_OK);
    ck_assert(tail_intact(out, 16));
    for (int i = 0; i < 16; i++)
        ck_assert(isfinite(out[i]) && out[i] != SENTINEL);
}
END_TEST

START_TEST(mha_enomem)
{
#if PKVT_ASAN
    return;
#else
    /* T * d_model doubles = 2^54 bytes: valid, but no system can supply it */
    float w[4] = {1, 2, 3, 4}, out[4 + N_SENTINEL];
    for (int i = 0; i < 4 + N_SENTINEL; i++)
        out[i] = SENTINEL;
    ck_assert_int_eq(pkv_mha_forward(1u << 31, 1u << 20, 1, 1, w, w, w, w, w, out),
                     PKV_ENOMEM);
    ck_assert(all_sentinel(out, 4));
#endif
}
END_TEST

int main(void)
{
    Suite *s = suite_create("reference");
    TCase *tk = tcase_create("kv_cache_bytes");
    tcase_add_test(tk, kv_bytes_spec_values);
    tcase_add_test(tk, kv_bytes_zero_factors);
    tcase_add_test(tk, kv_bytes_overflow_boundaries);
    tcase_add_test(tk, kv_bytes_random_vs_u128);
    tcase_set_timeout(tk, 60);
    suite_add_tcase(s, tk);

    TCase *ta = tcase_create("causal_attention");
    tcase_add_test(ta, attention_random_vs_naive);
    tcase_add_test(ta, attention_gqa_mapping);
    tcase_add_test(ta, attention_causal);
    tcase_add_test(ta, attention_huge_scores);
    tcase_add_test(ta, attention_bad_input);
    tcase_add_test(ta, attention_enomem);
    tcase_set_timeout(ta, 60);
    suite_add_tcase(s, ta);

    TCase *tm = tcase_create("mha_forward");
    tcase_add_test(tm, mha_single_head);
    tcase_add_test(tm, mha_full_heads);
    tcase_add_test(tm, mha_random_vs_naive);
    tcase_add_test(tm, mha_gqa_mapping);
    tcase_add_test(tm, mha_causal);
    tcase_add_test(tm, mha_bad_input);
    tcase_add_test(tm, mha_enomem);
    tcase_set_timeout(tm, 60);
    suite_add_tcase(s, tm);
    return pkvt_run(s);
}

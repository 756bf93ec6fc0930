/*
 * test_quant.c - the block-quantized pages PKV_Q8 and PKV_Q4 (docs/numerics.md): the row
 * format's sizes and its error bound, held against the format's definition computed
 * here from public pieces (f16 rounding of the scale); the edge cases (zero, huge,
 * tiny, NaN, every tail length); and decode on quantized pages against the double
 * reference on the rounded rows, with every path's bits equal.
 */
#include "testutil.h"
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const pkv_dtype qtypes[] = {PKV_Q8, PKV_Q4};

/* The decode shapes both paths are held to: head_dim 1..130 (every tail of a 32-value
 * block), page sizes 1..16, groups 1..8 wide. */
static const uint32_t shapes[][4] = {
    /* h, g, d, bt */
    {2, 1, 1, 1}, {4, 2, 3, 4}, {6, 3, 17, 2}, {8, 2, 32, 16}, {4, 4, 33, 5},
    {8, 8, 64, 16}, {32, 8, 128, 16}, {2, 2, 80, 3}, {3, 1, 130, 7},
};

/* The range of a block's integers: Q8 [-127, 127], Q4 all 16 codes [-8, 7]. */
static float qlo_of(pkv_dtype t)
{
    return t == PKV_Q8 ? -127.0f : -8.0f;
}

static float qhi_of(pkv_dtype t)
{
    return t == PKV_Q8 ? 127.0f : 7.0f;
}

/* The next f16 above r (an f16 value >= 0, below 65504). */
static float f16_next(float r)
{
    int e;
    (void)frexpf(r, &e); /* r = f * 2^e, f in [0.5, 1): its ulp is 2^(e - 11) */
    return r + (r < ldexpf(1.0f, -14) ? ldexpf(1.0f, -24) : ldexpf(1.0f, e - 11));
}

/* The smallest f16 d with c d >= b (b > 0; c d is exact in f32 for c = 7.5, 8.5 and
 * 127.5), at most 65504. */
static float f16_cover(float b, float c)
{
    float d = pkv_dtype_round(PKV_F16, b / c);
    while (d < 65504.0f && c * d < b)
        d = f16_next(d);
    return d > 65504.0f ? 65504.0f : d;
}

/* The (signed) covering scale d_0 of a block of m values, the format of src/base/quant.c
 * written again: a = max |x_j|. Q8: max(f16(a / 127) nearest even, the smallest f16
 * with 127.5 d >= a). Q4: of the sign opposite to the block's first value of magnitude
 * a, |d| = max(f16(a / 8), the smallest f16 with 8.5 |d| >= a, the smallest with 7.5 |d|
 * >= b), b the largest magnitude of the other sign's values. |d| at least the smallest
 * f16 subnormal, at most 65504; 0 for a zero block. */
static float cover_of(pkv_dtype t, const float *x, uint32_t m)
{
    float a = 0, b = 0;
    bool neg = false;
    for (uint32_t j = 0; j < m; j++)
        if (fabsf(x[j]) > a) {
            a = fabsf(x[j]);
            neg = x[j] < 0;
        }
    for (uint32_t j = 0; j < m; j++)
        if ((x[j] < 0) != neg && fabsf(x[j]) > b)
            b = fabsf(x[j]);
    if (a == 0.0f)
        return 0.0f;
    float d = fmaxf(pkv_dtype_round(PKV_F16, a / 127.0f), f16_cover(a, 127.5f));
    if (t == PKV_Q4) {
        d = fmaxf(pkv_dtype_round(PKV_F16, a / 8.0f), f16_cover(a, 8.5f));
        const float db = b == 0.0f ? 0.0f : f16_cover(b, 7.5f);
        d = db > d ? db : d;
    }
    if (d == 0.0f)
        d = ldexpf(1.0f, -24);
    if (d > 65504.0f)
        d = 65504.0f;
    return t == PKV_Q4 && !neg ? -d : d;
}

/* The block the format stores on the scale d, read back: d * clamp(rint(x_j / d)). */
static void block_on(pkv_dtype t, const float *x, uint32_t m, float d, float *y)
{
    for (uint32_t j = 0; j < m; j++) {
        float q = rintf(x[j] / d);
        q = q > qhi_of(t) ? qhi_of(t) : q < qlo_of(t) ? qlo_of(t) : q;
        y[j] = d * (q + 0.0f); /* a stored integer has no -0 */
    }
}

static double sq_error(const float *x, const float *y, uint32_t m)
{
    double e = 0;
    for (uint32_t j = 0; j < m; j++)
        e += ((double)x[j] - y[j]) * ((double)x[j] - y[j]);
    return e;
}

/* The scales the format's search tries for a block whose covering scale is d0:
 * f16(|d0| (1 + k / 64)), k < 8, distinct, at most 65504, the sign of d0. */
static uint32_t candidates_of(float d0, float *c)
{
    uint32_t n = 0;
    for (uint32_t k = 0; k < 8; k++) {
        const float v = pkv_dtype_round(PKV_F16, fabsf(d0) * (1.0f + (float)k / 64.0f));
        if (v > 65504.0f)
            break;
        if (n == 0 || v > fabsf(c[n - 1]))
            c[n++] = copysignf(v, d0);
    }
    return n;
}

/* The scale a stored block y of x (m values, not all zero, finite) was written on, held
 * to the format: y is the block on one of the search's candidates, and no candidate's
 * block has a smaller squared error (up to the library's f32 sums, 1e-5 of the error).
 * Returns that scale. */
static float stored_scale(pkv_dtype t, const float *x, uint32_t m, const float *y,
                          const char *what)
{
    float c[8], z[32];
    const uint32_t n = candidates_of(cover_of(t, x, m), c);
    double best = INFINITY;
    float found = NAN; /* the first candidate whose block is y */
    for (uint32_t k = 0; k < n; k++) {
        block_on(t, x, m, c[k], z);
        const double e = sq_error(x, z, m);
        best = e < best ? e : best;
        if (isnan(found) && memcmp(z, y, m * sizeof *z) == 0)
            found = c[k];
    }
    ck_assert_msg(!isnan(found), "%s: the block is on none of the %u candidate scales",
                  what, n);
    ck_assert_msg(sq_error(x, y, m) <= best * (1 + 1e-5),
                  "%s: the block on %g has error %g, a candidate %g", what, (double)found,
                  sq_error(x, y, m), best);
    return found;
}

START_TEST(row_bytes_are_the_format)
{
    ck_assert_uint_eq(pkv_row_bytes(PKV_Q8, 128), 136);
    ck_assert_uint_eq(pkv_row_bytes(PKV_Q4, 128), 72);
    ck_assert(pkv_row_bytes(PKV_Q8, 128) * 8.0 / 128 <= 8.5);
    ck_assert(pkv_row_bytes(PKV_Q4, 128) * 8.0 / 128 <= 4.5);
    ck_assert_uint_eq(pkv_row_bytes(PKV_Q8, 33), 34 + 3);
    ck_assert_uint_eq(pkv_row_bytes(PKV_Q4, 33), 18 + 3);
    ck_assert_uint_eq(pkv_row_bytes(PKV_Q4, 1), 3);
    ck_assert_uint_eq(pkv_row_bytes(PKV_Q8, 0), 0);
    ck_assert_uint_eq(pkv_row_bytes((pkv_dtype)9, 8), 0);
    ck_assert_uint_eq(pkv_row_bytes(PKV_F16, 5), 10);
    ck_assert_uint_eq(pkv_row_bytes(PKV_F32, 5), 20);
    ck_assert_uint_eq(pkv_dtype_size(PKV_Q8), 0);
    ck_assert_uint_eq(pkv_dtype_size(PKV_Q4), 0);
    ck_assert_str_eq(pkv_dtype_name(PKV_Q8), "q8");
    ck_assert_str_eq(pkv_dtype_name(PKV_Q4), "q4");
}
END_TEST

/* Every length 1..300, values of mixed magnitudes (a few outlier channels, as real K
 * has): each block is stored on one of its search's scales, the one of least error;
 * each value comes back as an integer multiple q of that step, q in the type's range,
 * within half a step of the input; a block is 32 values from its row's start. */
START_TEST(round_row_within_half_a_step)
{
    pkvt_rng r;
    const uint64_t seed = pkvt_seed();
    pkvt_rng_init(&r, seed + 21);
    float x[300], y[300];
    for (size_t ti = 0; ti < 2; ti++) {
        const pkv_dtype t = qtypes[ti];
        for (uint32_t n = 1; n <= 300; n++) {
            pkvt_fill(&r, x, n, -1, 1);
            for (uint32_t i = 0; i < n; i += 1 + pkvt_below(&r, 40))
                x[i] *= 20.0f; /* outliers */
            pkv_dtype_round_row(t, n, x, y);
            for (uint32_t b = 0; b < n; b += 32) {
                const uint32_t m = n - b < 32 ? n - b : 32;
                char what[64];
                snprintf(what, sizeof what, "%s n %u block %u", pkv_dtype_name(t), n, b / 32);
                const float d = stored_scale(t, x + b, m, y + b, what);
                for (uint32_t j = 0; j < m; j++) {
                    const float q = y[b + j] / d;
                    ck_assert_msg(q == rintf(q) && q >= qlo_of(t) && q <= qhi_of(t),
                                  "%s n %u value %u: %g is not a step multiple",
                                  pkv_dtype_name(t), n, b + j, (double)y[b + j]);
                    ck_assert_msg(fabsf(x[b + j] - y[b + j]) <= fabsf(d) / 2,
                                  "%s n %u value %u: |%g - %g| > %g / 2 (seed %llu)",
                                  pkv_dtype_name(t), n, b + j, (double)x[b + j],
                                  (double)y[b + j], (double)d, (unsigned long long)seed);
                }
            }
            /* in place gives the same */
            float z[300];
            memcpy(z, x, n * sizeof *z);
            pkv_dtype_round_row(t, n, z, z);
            ck_assert_mem_eq(z, y, n * sizeof *z);
        }
        /* every magnitude from 2^-30 to 2^4: blocks whose scale is an f16 subnormal
         * (a largest value under 127 * 2^-14 for Q8, 8 * 2^-14 for Q4) keep the bound */
        for (int e = -30; e <= 4; e++)
            for (int rep = 0; rep < 64; rep++) {
                const uint32_t m = 1 + pkvt_below(&r, 32);
                pkvt_fill(&r, x, m, -1, 1);
                for (uint32_t j = 0; j < m; j++)
                    x[j] = ldexpf(x[j], e);
                pkv_dtype_round_row(t, m, x, y);
                if (pkvt_maxabs(x, m) == 0.0f)
                    continue;
                char what[64];
                snprintf(what, sizeof what, "%s 2^%d block %d", pkv_dtype_name(t), e, rep);
                const float d = stored_scale(t, x, m, y, what);
                for (uint32_t j = 0; j < m; j++)
                    ck_assert_msg(fabsf(x[j] - y[j]) <= fabsf(d) / 2,
                                  "%s value %u: |%g - %g| > %g / 2 (seed %llu)", what, j,
                                  (double)x[j], (double)y[j], (double)d,
                                  (unsigned long long)seed);
            }
    }
}
END_TEST

START_TEST(zero_huge_tiny_and_nan_rows)
{
    float x[70], y[70];
    for (size_t ti = 0; ti < 2; ti++) {
        const pkv_dtype t = qtypes[ti];
        memset(x, 0, sizeof x);
        pkv_dtype_round_row(t, 70, x, y);
        for (int i = 0; i < 70; i++)
            ck_assert(y[i] == 0.0f && !signbit(y[i]));
        /* tiny: below the f16 scale's normal range, still within half a step */
        for (int i = 0; i < 70; i++)
            x[i] = (i % 2 ? 1e-9f : -3e-9f) * (float)(i + 1);
        pkv_dtype_round_row(t, 70, x, y);
        for (int b = 0; b < 70; b += 32) {
            const uint32_t m = 70 - b < 32 ? 70 - b : 32;
            const float d = stored_scale(t, x + b, m, y + b, "tiny");
            for (uint32_t j = 0; j < m; j++)
                ck_assert(fabsf(x[b + j] - y[b + j]) <= fabsf(d) / 2);
        }
        /* huge: past the saturation range the values clamp, finite; in Q4 the sign of
         * a block's first value (all of one magnitude) takes the -8 end, the other 7 */
        for (int i = 0; i < 70; i++)
            x[i] = i % 3 ? 1e12f : -1e12f;
        pkv_dtype_round_row(t, 70, x, y);
        for (int i = 0; i < 70; i++) {
            ck_assert(isfinite(y[i]));
            const bool first = signbit(x[i]) == signbit(x[i / 32 * 32]);
            const float q = t == PKV_Q8 ? 127.0f : first ? 8.0f : 7.0f;
            ck_assert_msg(fabsf(y[i]) == 65504.0f * q, "%s %d: %g", pkv_dtype_name(t), i,
                          (double)y[i]);
            ck_assert(signbit(y[i]) == signbit(x[i]));
        }
        /* a NaN or an infinity spoils its own block only */
        pkvt_rng r;
        pkvt_rng_init(&r, pkvt_seed() + 22);
        pkvt_fill(&r, x, 70, -1, 1);
        x[40] = NAN;
        x[69] = INFINITY;
        pkv_dtype_round_row(t, 70, x, y);
        for (int i = 0; i < 70; i++) {
            if (i < 32)
                ck_assert(isfinite(y[i]) && fabsf(x[i] - y[i]) <= 1.0f / 7.0f);
            else
                ck_assert(isnan(y[i]));
        }
    }
}
END_TEST

/* Q4 uses its 16th code: on bell-shaped random rows its squared rounding error is
 * below 0.8 of that of the 15-code quantizer of [-7, 7] (step f16(a / 7), the format
 * before; written here): a step of a / 8 where the other sign's values allow it, each
 * block's largest magnitude on a code (0.79; 0.755 with the scale search after it).
 * A 15-code library gives 1.0; the 16 codes at the step a / 7.5 everywhere gave 0.955
 * (the largest magnitude then lands half a step off). Fixed seed; the threshold leaves
 * room for other data. */
START_TEST(q4_uses_all_sixteen_codes)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 25);
    enum { N = 128, ROWS = 2000 };
    float x[N], y[N];
    double e16 = 0, e15 = 0;
    int eights = 0;
    for (int row = 0; row < ROWS; row++) {
        for (int i = 0; i < N; i++) /* sum of 3 uniforms: bell-shaped, in (-3, 3) */
            x[i] = pkvt_uniform(&r, -1, 1) + pkvt_uniform(&r, -1, 1) + pkvt_uniform(&r, -1, 1);
        pkv_dtype_round_row(PKV_Q4, N, x, y);
        for (int b = 0; b < N; b += 32) {
            float a = 0;
            for (int j = 0; j < 32; j++)
                a = fabsf(x[b + j]) > a ? fabsf(x[b + j]) : a;
            const float d15 = pkv_dtype_round(PKV_F16, a / 7.0f);
            const float d = stored_scale(PKV_Q4, x + b, 32, y + b, "q4");
            for (int j = 0; j < 32; j++) {
                float q15 = rintf(x[b + j] / d15);
                q15 = q15 > 7 ? 7 : q15 < -7 ? -7 : q15;
                e15 += pow(x[b + j] - d15 * q15, 2);
                e16 += pow(x[b + j] - y[b + j], 2);
                eights += y[b + j] / d == -8.0f;
            }
        }
    }
    fprintf(stderr, "q4: squared error of 16 codes / of 15: %.3f; code -8 used %d times\n",
            e16 / e15, eights);
    ck_assert_msg(e16 < 0.85 * e15, "16 codes / 15 codes: %.3f", e16 / e15);
    ck_assert(eights > ROWS * N / 32 / 2); /* most blocks put their largest on -8 */
}
END_TEST

/* The scale search earns its place: on bell-shaped random rows the stored blocks'
 * squared error is well below that of the same blocks on their covering scale d_0 (the
 * format before the search): measured 0.86 for Q8 and 0.96 for Q4 at this seed. A
 * library that stores every block on d_0 gives 1.0. */
START_TEST(scale_search_lowers_the_error)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 26);
    enum { N = 128, ROWS = 1000 };
    float x[N], y[N], z[32];
    for (size_t ti = 0; ti < 2; ti++) {
        const pkv_dtype t = qtypes[ti];
        double searched = 0, covering = 0;
        for (int row = 0; row < ROWS; row++) {
            for (int i = 0; i < N; i++)
                x[i] = pkvt_uniform(&r, -1, 1) + pkvt_uniform(&r, -1, 1) +
                       pkvt_uniform(&r, -1, 1);
            pkv_dtype_round_row(t, N, x, y);
            searched += sq_error(x, y, N);
            for (int b = 0; b < N; b += 32) {
                block_on(t, x + b, 32, cover_of(t, x + b, 32), z);
                covering += sq_error(x + b, z, 32);
            }
        }
        fprintf(stderr, "%s: squared error with the search / on the covering scale: %.3f\n",
                pkv_dtype_name(t), searched / covering);
        ck_assert_msg(searched < (t == PKV_Q8 ? 0.92 : 0.985) * covering, "%s: %.3f",
                      pkv_dtype_name(t), searched / covering);
    }
}
END_TEST

/* Decode on quantized pages: within 1e-5 x max|V| of the double reference on the
 * rounded rows, over head_dim 1..130 (tails), page sizes and group shapes. */
START_TEST(decode_matches_reference_on_rounded_rows)
{
    pkvt_rng r;
    const uint64_t seed = pkvt_seed();
    pkvt_rng_init(&r, seed + 23);
    double worst = 0;
    for (size_t ti = 0; ti < 2; ti++)
        for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
            const pkv_dtype t = qtypes[ti];
            const uint32_t h = shapes[si][0], g = shapes[si][1], d = shapes[si][2],
                           bt = shapes[si][3];
            const uint32_t T = pkvt_quick() ? 20 : 45;
            pkv_engine *e = pkvt_engine(1, h, g, d, bt, t);
            pkv_stats st;
            ck_assert_int_eq(pkv_engine_stats(e, &st), PKV_OK);
            ck_assert_uint_eq(st.page_bytes, (uint64_t)g * bt * 2 * pkv_row_bytes(t, d));
            pkv_session *s;
            ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
            const size_t kd = (size_t)g * d, qd = (size_t)h * d;
            float *K = pkvt_alloc(T * kd * sizeof *K), *V = pkvt_alloc(T * kd * sizeof *V);
            float *Kr = pkvt_alloc(T * kd * sizeof *K), *Vr = pkvt_alloc(T * kd * sizeof *V);
            float *Q = pkvt_alloc(T * qd * sizeof *Q), *out = pkvt_alloc(qd * sizeof *out);
            double *ref = pkvt_alloc(qd * sizeof *ref);
            pkvt_fill(&r, K, T * kd, -2, 2);
            pkvt_fill(&r, V, T * kd, -1, 1);
            pkvt_fill(&r, Q, T * qd, -1, 1);
            for (uint32_t i = 0; i < T * g; i++) { /* each group's row is one stored row */
                pkv_dtype_round_row(t, d, K + (size_t)i * d, Kr + (size_t)i * d);
                pkv_dtype_round_row(t, d, V + (size_t)i * d, Vr + (size_t)i * d);
            }
            const float vmax = pkvt_maxabs(Vr, T * kd);
            for (uint32_t p = 0; p < T; p++) {
                ck_assert_int_eq(pkv_append(s, 0, K + p * kd, V + p * kd), PKV_OK);
                ck_assert_int_eq(pkv_decode(s, 0, Q + p * qd, out), PKV_OK);
                /* the reference on rows already rounded: f32 keeps them as they are */
                pkvt_ref_decode(h, g, d, 1.0f / sqrtf((float)d), PKV_F32, p + 1, Q + p * qd,
                                Kr, Vr, ref);
                const double diff = pkvt_maxdiff_fd(out, ref, qd);
                worst = diff / vmax > worst ? diff / vmax : worst;
                ck_assert_msg(diff <= 1e-5 * vmax, "%s h %u g %u d %u bt %u pos %u: %g (seed %llu)",
                              pkv_dtype_name(t), h, g, d, bt, p, diff, (unsigned long long)seed);
            }
            ck_assert(pkvi_engine_check(e));
            pkv_session_destroy(s);
            free(K);
            free(V);
            free(Kr);
            free(Vr);
            free(Q);
            free(out);
            free(ref);
            pkv_engine_destroy(e);
        }
    fprintf(stderr, "quantized decode: largest |diff| / max|V| %.3g\n", worst);
}
END_TEST

/* The documented bound of the integer-dot path (docs/numerics.md): q rounded per block
 * of 32 to int8 with step dq_b = max|q_b| / 127 moves each score by at most
 *     delta_t = scale * sum_b (dq_b / 2) * sum_{j in b} |k_tj|      (k: the rounded row)
 * and the output by at most (exp(2 * max_t delta_t) - 1) * max|V|, plus the exact path's
 * 1e-5 * max|V| for the f32 arithmetic. Held per position against the double
 * reference on the rounded rows, on random data and on data with outlier channels. */
static double score_shift(uint32_t h, uint32_t g, uint32_t d, float scale, uint32_t n,
                          const float *q, const float *Kr)
{
    double worst = 0;
    const uint32_t hg = h / g;
    for (uint32_t hh = 0; hh < h; hh++) {
        const float *qh = q + (size_t)hh * d;
        for (uint32_t t = 0; t < n; t++) {
            const float *k = Kr + ((size_t)t * g + hh / hg) * d;
            double s = 0;
            for (uint32_t b = 0; b < d; b += 32) {
                double a = 0, l1 = 0;
                for (uint32_t j = b; j < d && j < b + 32; j++) {
                    a = fabs(qh[j]) > a ? fabs(qh[j]) : a;
                    l1 += fabs(k[j]);
                }
                s += a / 127.0 * (1 + 0x1p-20) / 2 * l1;
            }
            s *= scale;
            worst = s > worst ? s : worst;
        }
    }
    return worst;
}

/* ---- adversarial query blocks --------------------------------------------------------
 * The exact path must hold the bound of docs/numerics.md for every q. A block of q whose largest
 * value is R times the rest, on a K channel that is 0 in every row, puts the whole
 * score in the small values; a table that holds q per block to some fraction of its
 * largest value (avx512vnni's limbs: 2^-30 of it) rounds the small ones coarsely, and
 * small values placed on that rounding's ties (half a step from either neighbour) make
 * the error as large as it gets. The search below draws such queries from a seed - R
 * from 10^2 to 10^7, where the large value sits in each block, which of the rest sit on
 * ties, the head_dim, the data's magnitude - scores each against the double reference on
 * the rounded rows, and then refines the worst it found (R and the tie pattern moved a
 * little) before it asserts. One draw in two is a group of 24 heads with only some of
 * them adversarial, so a budget check that skipped a run of heads would show. The same
 * queries hold the integer-dot path to its own bound (score_shift, above). */
typedef struct {
    uint32_t d;
    double R;     /* the large value over the block's typical magnitude */
    float mag;    /* the typical magnitude of the small values */
    uint32_t pos; /* seed of the large value's position in each block */
    uint32_t tie; /* 0: no ties, 1: every small value on a tie, 2: every other one */
    uint64_t data; /* seed of K, V and the small values */
} adversary;

/* Step of a block's limbs whose largest magnitude is a: 2^(ilogb(a) - 29), the grid
 * avx512vnni's exact path rounds q to (docs/numerics.md section 3). */
static float limb_step(float a)
{
    return ldexpf(1.0f, ilogbf(a) - 29 > -149 ? ilogbf(a) - 29 : -149);
}

/* q [h][d] of adversary a: per block, the large value at its position, the rest
 * uniform in +-mag and moved onto their tie (k + 1/2) steps where the pattern says. The
 * large channel of each block is 0 in every K row (K [n][d], one group). */
static void adversary_data(const adversary *a, uint32_t h, uint32_t n, float *q, float *K,
                           float *V)
{
    pkvt_rng r;
    pkvt_rng_init(&r, a->data);
    const uint32_t d = a->d;
    pkvt_fill(&r, K, (size_t)n * d, -2, 2);
    pkvt_fill(&r, V, (size_t)n * d, -1, 1);
    for (uint32_t hh = 0; hh < h; hh++)
        for (uint32_t b = 0; b < d; b += 32) {
            /* a group of more than 4 heads: heads 0, 7, 8, 15, 16, 23, .. adversarial (each
             * zeroes a K channel), the others plain small values */
            const bool adversarial = h <= 4 || hh % 8 == 0 || hh % 8 == 7;
            if (!adversarial) {
                for (uint32_t j = b; j < b + 32; j++)
                    q[(size_t)hh * d + j] = pkvt_uniform(&r, -a->mag, a->mag);
                continue;
            }
            const uint32_t big = b + (a->pos * 7 + b / 32 * 13 + hh * 5) % 32;
            const float A = (float)(a->R * a->mag) * (hh % 2 ? -1.0f : 1.0f);
            const float step = limb_step(fabsf(A));
            for (uint32_t j = b; j < b + 32; j++) {
                float v = pkvt_uniform(&r, -a->mag, a->mag);
                const bool on_tie = a->tie == 1 || (a->tie == 2 && j % 2);
                if (on_tie && j != big)
                    v = (floorf(v / step) + 0.5f) * step;
                q[(size_t)hh * d + j] = j == big ? A : v;
            }
            for (uint32_t t = 0; t < n; t++)
                K[(size_t)t * d + big] = 0.0f;
        }
}

/* |out - ref| / max|V| of one adversary on dtype t and path quant_dot (0 exact, 1 the
 * integer dot); *of_bound: that over the path's bound (1e-5, or the integer dot's). */
static double adversary_error(const adversary *a, pkv_dtype t, uint32_t quant_dot,
                              double *of_bound)
{
    /* one draw in two a group of 24 heads: the budget is checked for runs of 16 heads */
    const uint32_t h = a->data % 2 ? 24 : 4, g = 1, d = a->d, n = 37;
    pkv_config c = pkvt_config(1, h, g, d, 16, t);
    c.quant_dot = quant_dot;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e);
    float *K = pkvt_alloc((size_t)n * d * sizeof *K), *V = pkvt_alloc((size_t)n * d * sizeof *V);
    float *Kr = pkvt_alloc((size_t)n * d * sizeof *K), *Vr = pkvt_alloc((size_t)n * d * sizeof *V);
    float *q = pkvt_alloc((size_t)h * d * sizeof *q), *out = pkvt_alloc((size_t)h * d * sizeof *out);
    double *ref = pkvt_alloc((size_t)h * d * sizeof *ref);
    adversary_data(a, h, n, q, K, V);
    for (uint32_t i = 0; i < n; i++) {
        pkv_dtype_round_row(t, d, K + (size_t)i * d, Kr + (size_t)i * d);
        pkv_dtype_round_row(t, d, V + (size_t)i * d, Vr + (size_t)i * d);
        ck_assert_int_eq(pkv_append(s, 0, K + (size_t)i * d, V + (size_t)i * d), PKV_OK);
    }
    ck_assert_int_eq(pkv_decode(s, 0, q, out), PKV_OK);
    const float scale = 1.0f / sqrtf((float)d);
    pkvt_ref_decode(h, g, d, scale, PKV_F32, n, q, Kr, Vr, ref);
    const double vmax = pkvt_maxabs(Vr, (size_t)n * d), err = pkvt_maxdiff_fd(out, ref, (size_t)h * d) / vmax;
    const double tol = quant_dot ? expm1(2 * score_shift(h, g, d, scale, n, q, Kr)) + 1e-5 : 1e-5;
    *of_bound = err / tol;
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    free(K);
    free(V);
    free(Kr);
    free(Vr);
    free(q);
    free(out);
    free(ref);
    return err;
}

START_TEST(exact_path_adversarial_blocks)
{
    static const uint32_t ds[] = {32, 64, 128};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed + 31);
    const int draws = pkvt_quick() ? 24 : 72, refine = pkvt_quick() ? 8 : 24;
    for (size_t ti = 0; ti < 2; ti++)
        for (uint32_t qd = 0; qd < 2; qd++) {
            const pkv_dtype t = qtypes[ti];
            adversary worst = {0};
            double worst_of = -1, worst_err = 0;
            for (int i = 0; i < draws + refine; i++) {
                adversary a;
                if (i < draws) { /* a fresh draw */
                    a = (adversary){ds[pkvt_below(&r, 3)],
                                    pow(10.0, pkvt_uniform(&r, 2.0f, 7.0f)),
                                    powf(10.0f, pkvt_uniform(&r, -2.0f, 0.2f)),
                                    (uint32_t)pkvt_next(&r), pkvt_below(&r, 3), pkvt_next(&r)};
                } else { /* the worst so far, moved a little */
                    a = worst;
                    a.R *= pow(10.0, pkvt_uniform(&r, -0.3f, 0.3f));
                    a.pos = (uint32_t)pkvt_next(&r);
                    a.data = pkvt_next(&r);
                    if (pkvt_below(&r, 4) == 0)
                        a.tie = pkvt_below(&r, 3);
                }
                double of;
                const double err = adversary_error(&a, t, qd, &of);
                if (!(of <= worst_of)) {
                    worst_of = of;
                    worst_err = err;
                    worst = a;
                }
            }
            fprintf(stderr,
                    "adversarial blocks %s %s: worst |diff| / max|V| %.3g (%.3g of the bound) at "
                    "d %u, R %.3g, magnitude %.3g, ties %u\n",
                    pkv_dtype_name(t), qd ? "integer" : "exact", worst_err, worst_of, worst.d,
                    worst.R, worst.mag, worst.tie);
            ck_assert_msg(worst_of <= 1.0,
                          "%s %s: %g of max|V| at d %u, R %g, magnitude %g, ties %u: past the "
                          "bound (%g of it; seed %llu)",
                          pkv_dtype_name(t), qd ? "integer" : "exact", worst_err, worst.d,
                          worst.R, worst.mag, worst.tie, worst_of, (unsigned long long)seed);
        }
}
END_TEST

/* Prefill, batch and threads give the bits of token-by-token decode on Q8/Q4 pages,
 * on both paths (quant_dot 0 and 1). */
START_TEST(paths_agree_bitwise)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 24);
    const uint32_t h = 8, g = 2, d = 40, bt = 8, T = 70;
    for (size_t ti = 0; ti < 4; ti++) {
        const pkv_dtype t = qtypes[ti % 2];
        pkv_config c1 = pkvt_config(1, h, g, d, bt, t);
        c1.quant_dot = ti / 2;
        pkv_engine *e1 = pkvt_engine_cfg(&c1);
        pkv_config c;
        ck_assert_int_eq(pkv_engine_config(e1, &c), PKV_OK);
        c.n_threads = 3;
        pkv_engine *e3 = pkvt_engine_workers(&c);
        const size_t kd = (size_t)g * d, qd = (size_t)h * d;
        float *K = pkvt_alloc(T * kd * sizeof *K), *V = pkvt_alloc(T * kd * sizeof *V);
        float *Q = pkvt_alloc(T * qd * sizeof *Q);
        float *a = pkvt_alloc(T * qd * sizeof *a), *b = pkvt_alloc(T * qd * sizeof *b);
        pkvt_fill(&r, K, T * kd, -2, 2);
        pkvt_fill(&r, V, T * kd, -1, 1);
        pkvt_fill(&r, Q, T * qd, -1, 1);
        pkv_session *sa, *sb, *sc, *sd;
        pkv_session_create(e1, &sa);
        pkv_session_create(e1, &sb);
        pkv_session_create(e3, &sc);
        pkv_session_create(e3, &sd);
        for (uint32_t p = 0; p < T; p++) {
            ck_assert_int_eq(pkv_append(sa, 0, K + p * kd, V + p * kd), PKV_OK);
            ck_assert_int_eq(pkv_decode(sa, 0, Q + p * qd, a + p * qd), PKV_OK);
        }
        ck_assert_int_eq(pkv_prefill(sb, 0, 29, Q, K, V, b), PKV_OK);
        ck_assert_int_eq(pkv_prefill(sb, 0, T - 29, Q + 29 * qd, K + 29 * kd, V + 29 * kd,
                                     b + 29 * qd), PKV_OK);
        ck_assert_mem_eq(a, b, T * qd * sizeof *a);
        for (uint32_t p = 0; p < T; p++) {
            ck_assert_int_eq(pkv_append(sc, 0, K + p * kd, V + p * kd), PKV_OK);
            ck_assert_int_eq(pkv_append(sd, 0, K + p * kd, V + p * kd), PKV_OK);
            pkv_session *pair[2] = {sc, sd};
            float qq[2 * 8 * 40], oo[2 * 8 * 40];
            memcpy(qq, Q + p * qd, qd * sizeof *qq);
            memcpy(qq + qd, Q + p * qd, qd * sizeof *qq);
            ck_assert_int_eq(pkv_decode_batch(e3, 0, 2, pair, qq, oo), PKV_OK);
            ck_assert_mem_eq(oo, a + p * qd, qd * sizeof *oo);
            ck_assert_mem_eq(oo + qd, a + p * qd, qd * sizeof *oo);
        }
        pkv_session_destroy(sa);
        pkv_session_destroy(sb);
        pkv_session_destroy(sc);
        pkv_session_destroy(sd);
        free(K);
        free(V);
        free(Q);
        free(a);
        free(b);
        pkv_engine_destroy(e1);
        pkv_engine_destroy(e3);
    }
}
END_TEST

/* ---- the integer-dot path (quant_dot = 1) ------------------------------------------- */

/* Engines of other storage types refuse quant_dot = 1, saying why; 2 is no path. */
START_TEST(quant_dot_needs_block_pages)
{
    static const pkv_dtype others[] = {PKV_F32, PKV_F16, PKV_BF16};
    for (size_t i = 0; i < 3; i++) {
        pkv_config c = pkvt_config(1, 4, 2, 16, 4, others[i]);
        c.quant_dot = 1;
        char why[256] = "";
        ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
        ck_assert_msg(strstr(why, "PKV_Q8 or PKV_Q4") != NULL, "reason: %s", why);
        pkv_engine *e = NULL;
        ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
        ck_assert_ptr_null(e);
    }
    for (size_t ti = 0; ti < 2; ti++) {
        pkv_config c = pkvt_config(1, 4, 2, 16, 4, qtypes[ti]);
        c.quant_dot = 2;
        ck_assert_int_eq(pkv_config_explain(&c, NULL, 0), PKV_EINVAL);
        c.quant_dot = 1;
        ck_assert_int_eq(pkv_config_explain(&c, NULL, 0), PKV_OK);
        pkv_engine *e = pkvt_engine_cfg(&c);
        pkv_config back;
        ck_assert_int_eq(pkv_engine_config(e, &back), PKV_OK);
        ck_assert_uint_eq(back.quant_dot, 1);
        pkv_engine_destroy(e);
    }
}
END_TEST

static void quant_dot_case(pkvt_rng *r, uint64_t seed, pkv_dtype t, uint32_t h, uint32_t g,
                           uint32_t d, uint32_t bt, uint32_t T, bool outliers, double *worst,
                           double *worst_of_bound)
{
    pkv_config c = pkvt_config(1, h, g, d, bt, t);
    c.quant_dot = 1;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e);
    const size_t kd = (size_t)g * d, qd = (size_t)h * d;
    float *K = pkvt_alloc(T * kd * sizeof *K), *V = pkvt_alloc(T * kd * sizeof *V);
    float *Kr = pkvt_alloc(T * kd * sizeof *K), *Vr = pkvt_alloc(T * kd * sizeof *V);
    float *Q = pkvt_alloc(T * qd * sizeof *Q), *out = pkvt_alloc(qd * sizeof *out);
    double *ref = pkvt_alloc(qd * sizeof *ref);
    pkvt_fill(r, K, T * kd, -2, 2);
    pkvt_fill(r, V, T * kd, -1, 1);
    pkvt_fill(r, Q, T * qd, -1, 1);
    if (outliers) { /* a few channels 10-30x the others, in K and in q (real K has them) */
        for (uint32_t c0 = 0; c0 < d; c0 += 1 + pkvt_below(r, 24)) {
            const float f = pkvt_uniform(r, 10, 30);
            for (uint32_t i = 0; i < T * g; i++)
                K[(size_t)i * d + c0] *= f;
            for (uint32_t i = 0; i < T * h; i++)
                Q[(size_t)i * d + c0] *= f / 10;
        }
    }
    for (uint32_t i = 0; i < T * g; i++) {
        pkv_dtype_round_row(t, d, K + (size_t)i * d, Kr + (size_t)i * d);
        pkv_dtype_round_row(t, d, V + (size_t)i * d, Vr + (size_t)i * d);
    }
    const float vmax = pkvt_maxabs(Vr, T * kd);
    const float scale = 1.0f / sqrtf((float)d);
    for (uint32_t p = 0; p < T; p++) {
        ck_assert_int_eq(pkv_append(s, 0, K + p * kd, V + p * kd), PKV_OK);
        ck_assert_int_eq(pkv_decode(s, 0, Q + p * qd, out), PKV_OK);
        pkvt_ref_decode(h, g, d, scale, PKV_F32, p + 1, Q + p * qd, Kr, Vr, ref);
        const double diff = pkvt_maxdiff_fd(out, ref, qd);
        const double delta = score_shift(h, g, d, scale, p + 1, Q + p * qd, Kr);
        const double tol = (expm1(2 * delta) + 1e-5) * vmax;
        *worst = diff / vmax > *worst ? diff / vmax : *worst;
        *worst_of_bound = diff / tol > *worst_of_bound ? diff / tol : *worst_of_bound;
        ck_assert_msg(diff <= tol, "%s h %u g %u d %u bt %u pos %u%s: %g > %g (seed %llu)",
                      pkv_dtype_name(t), h, g, d, bt, p, outliers ? " outliers" : "", diff,
                      tol, (unsigned long long)seed);
    }
    pkv_session_destroy(s);
    free(K);
    free(V);
    free(Kr);
    free(Vr);
    free(Q);
    free(out);
    free(ref);
    pkv_engine_destroy(e);
}

START_TEST(quant_dot_within_its_bound)
{
    pkvt_rng r;
    const uint64_t seed = pkvt_seed();
    pkvt_rng_init(&r, seed + 26);
    const uint32_t T = pkvt_quick() ? 20 : 60;
    for (int o = 0; o < 2; o++)
        for (size_t ti = 0; ti < 2; ti++) {
            double worst = 0, of_bound = 0;
            for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
                quant_dot_case(&r, seed, qtypes[ti], shapes[si][0], shapes[si][1],
                               shapes[si][2], shapes[si][3], T, o, &worst, &of_bound);
            fprintf(stderr, "quant_dot %s%s: largest |diff| / max|V| %.3g, of the bound %.3g\n",
                    pkv_dtype_name(qtypes[ti]), o ? " (outlier channels)" : "", worst,
                    of_bound);
        }
}
END_TEST

/* Hostile q, on both paths: zero heads give uniform weights (the mean of V), a NaN or
 * an infinity in one head makes that head NaN (never a silent 0: the merge must not
 * take its NaN state for an empty one) and leaves every other head as it was. */
START_TEST(quant_dot_zero_and_nan_queries)
{
    for (size_t run = 0; run < 4; run++) { /* q8, q4; exact path, then integer path */
        const size_t ti = run % 2;
        pkv_config c = pkvt_config(1, 4, 2, 40, 4, qtypes[ti]);
        c.quant_dot = (uint32_t)(run / 2);
        pkv_engine *e = pkvt_engine_cfg(&c);
        pkv_session *s = pkvt_session(e);
        pkvt_rng r;
        pkvt_rng_init(&r, pkvt_seed() + 27);
        float k[80], v[80], vsum[80] = {0}, q[160], o1[160], o2[160];
        for (int t = 0; t < 9; t++) {
            pkvt_fill(&r, k, 80, -1, 1);
            pkvt_fill(&r, v, 80, -1, 1);
            ck_assert_int_eq(pkv_append(s, 0, k, v), PKV_OK);
            float vr[80];
            pkv_dtype_round_row(qtypes[ti], 40, v, vr);
            pkv_dtype_round_row(qtypes[ti], 40, v + 40, vr + 40);
            for (int i = 0; i < 80; i++)
                vsum[i] += vr[i] / 9;
        }
        pkvt_fill(&r, q, 160, -1, 1);
        for (int i = 0; i < 40; i++) /* head 0: zero */
            q[i] = 0.0f;
        ck_assert_int_eq(pkv_decode(s, 0, q, o1), PKV_OK);
        for (int i = 0; i < 40; i++)
            ck_assert(fabsf(o1[i] - vsum[i]) <= 1e-5f);
        q[40 + 7] = NAN;      /* head 1 */
        q[120 + 39] = -INFINITY; /* head 3 */
        ck_assert_int_eq(pkv_decode(s, 0, q, o2), PKV_OK);
        for (int i = 0; i < 160; i++) {
            if ((i >= 40 && i < 80) || i >= 120)
                ck_assert(isnan(o2[i]));
            else
                ck_assert(o2[i] == o1[i]);
        }
        pkv_session_destroy(s);
        pkv_engine_destroy(e);
    }
}
END_TEST

/* A NaN appended to one row leaves every other row of the cache intact. */
START_TEST(a_nan_row_poisons_no_other_row)
{
    for (size_t ti = 0; ti < 4; ti++) { /* both paths */
        pkv_config c = pkvt_config(2, 2, 2, 40, 4, qtypes[ti % 2]);
        c.quant_dot = ti / 2;
        pkv_engine *e = pkvt_engine_cfg(&c);
        pkv_session *s;
        pkv_session_create(e, &s);
        float k[80], v[80], q[80], o1[80], o2[80];
        pkvt_rng r;
        pkvt_rng_init(&r, pkvt_seed() + 25);
        pkvt_fill(&r, q, 80, -1, 1);
        for (int t = 0; t < 6; t++) {
            pkvt_fill(&r, k, 80, -1, 1);
            pkvt_fill(&r, v, 80, -1, 1);
            ck_assert_int_eq(pkv_append(s, 0, k, v), PKV_OK);
            ck_assert_int_eq(pkv_append(s, 1, k, v), PKV_OK);
        }
        ck_assert_int_eq(pkv_decode(s, 1, q, o1), PKV_OK);
        k[45] = NAN; /* group 1, second block */
        ck_assert_int_eq(pkv_append(s, 0, k, v), PKV_OK);
        ck_assert_int_eq(pkv_decode(s, 1, q, o2), PKV_OK); /* the other layer */
        ck_assert_mem_eq(o1, o2, sizeof o1);
        ck_assert_int_eq(pkv_decode(s, 0, q, o2), PKV_OK);
        for (int i = 0; i < 40; i++) /* group 0's heads never read group 1's rows */
            ck_assert(isfinite(o2[i]));
        pkv_session_destroy(s);
        pkv_engine_destroy(e);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("quant");
    TCase *tc = tcase_create("format");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, row_bytes_are_the_format);
    tcase_add_test(tc, round_row_within_half_a_step);
    tcase_add_test(tc, zero_huge_tiny_and_nan_rows);
    tcase_add_test(tc, q4_uses_all_sixteen_codes);
    tcase_add_test(tc, scale_search_lowers_the_error);
    tcase_add_test(tc, decode_matches_reference_on_rounded_rows);
    tcase_add_test(tc, exact_path_adversarial_blocks);
    tcase_add_test(tc, paths_agree_bitwise);
    tcase_add_test(tc, a_nan_row_poisons_no_other_row);
    tcase_add_test(tc, quant_dot_needs_block_pages);
    tcase_add_test(tc, quant_dot_within_its_bound);
    tcase_add_test(tc, quant_dot_zero_and_nan_queries);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

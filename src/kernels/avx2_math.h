/*
 * kernels/avx2_math.h - the AVX2 kernels' softmax step of one tile and what it needs:
 * exp8 and tanh8 (docs/numerics.md section 3 has their methods and accuracy), the
 * fixed reduction trees. For avx2.c and avx2vnni.c. No state.
 */
#ifndef PKV_KERNELS_AVX2_MATH_H
#define PKV_KERNELS_AVX2_MATH_H

#include "kernels/kernels.h"
#include "kernels/avx2_load.h" /* tail_mask */
#include "kernels/qblock256.h" /* qb_hmax */

#include <immintrin.h>
#include <stdbool.h>

/* ---- exp (see avx512.c for the method) --------------------------------------------
 * Without vscalef, 2^n is applied as two normal factors 2^(n>>1) and 2^(n - (n>>1)):
 * the first product is exact, the second rounds once, so subnormal results are as
 * accurate as vscalef's. */
PKVI_INLINE __m256 exp8(__m256 x)
{
    x = _mm256_max_ps(_mm256_set1_ps(-110.0f), x); /* NaN passes (second operand) */
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, f1), f2);
}

/* ---- tanh (soft-capping) -----------------------------------------------------------
 * Below |x| = 0.4 the odd Taylor series to x^13 (the next term is under 4e-9 of the
 * result); above, sign(x) * (1 - 2 / (exp(2|x|) + 1)) with exp8 (the subtraction
 * loses at most 1.5 bits there: 2 / (e^0.8 + 1) = 0.62). What a weight sees is the
 * capped score c * tanh(s / c): tests/test_kernels.c (softcap_accuracy) holds it within
 * 4 ulp of the score plus 2^-22 of c * tanh in double for caps 2.5 to 50
 * (docs/numerics.md section 3). NaN stays NaN; +-inf gives +-1. */
PKVI_INLINE __m256 tanh8(__m256 x)
{
    const __m256 sgn = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 ax = _mm256_andnot_ps(sgn, x);
    const __m256 e = exp8(_mm256_add_ps(ax, ax));
    const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                        _mm256_add_ps(e, one)));
    const __m256 x2 = _mm256_mul_ps(ax, ax);
    __m256 p = _mm256_set1_ps(3.5921280365e-3f);                   /*  21844/6081075 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-8.8632355299e-3f)); /* -1382/155925 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.1869488536e-2f));  /*  62/2835 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-5.3968253968e-2f)); /* -17/315 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(1.3333333333e-1f));  /*  2/15 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-3.3333333333e-1f)); /* -1/3 */
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(ax, x2), p, ax);
    const __m256 r = _mm256_blendv_ps(big, small,
                                      _mm256_cmp_ps(ax, _mm256_set1_ps(0.4f), _CMP_LT_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(x, sgn));
}

/* Scaled scores, soft-capped when cap > 0. */
PKVI_INLINE __m256 scores8(__m256 raw, __m256 sc, float cap)
{
    const __m256 x = _mm256_mul_ps(raw, sc);
    if (cap <= 0.0f)
        return x;
    const __m256 c = _mm256_set1_ps(cap);
    return _mm256_mul_ps(c, tanh8(_mm256_div_ps(x, c)));
}

/* ---- reductions ----------------------------------------------------------------------- */

/* The sums of the 8 lanes of v[0..3], in lanes 0..3: per 128-bit half, two vhaddps
 * levels give the half's four partial sums, then the halves are added (an extract,
 * not a slower vperm2f128). Fixed order. */
PKVI_INLINE __m128 hsum4(const __m256 v[4])
{
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

PKVI_INLINE float hadd8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* ---- softmax of one tile (as ref.c; l uses a fused multiply-add) -------------------
 * Four heads at a time where the group has them: their maxima and sums reduced by one
 * 4x4 transpose (reduce4), their alphas one exp8, m/l/alpha as vectors - where one
 * head at a time ran four dependent chains of shuffles and three exp8 per head. The
 * operations are qb_hmax's and hadd8's on the same operands in the same order, so the
 * same bits. */

/* The scaled (soft-capped) scores of one head's tile, lanes past n -inf. */
PKVI_INLINE void tile_scores(const float *sh, uint32_t n, __m256 sc, float cap, __m256 lo, __m256 hi,
                             __m256 *s0, __m256 *s1)
{
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    /* lanes past n are -inf (their scratch is never read as data) */
    *s0 = _mm256_blendv_ps(ninf, scores8(_mm256_load_ps(sh), sc, cap), lo);
    *s1 = n > 8 ? _mm256_blendv_ps(ninf, scores8(_mm256_load_ps(sh + 8), sc, cap), hi) : ninf;
}

/* Lane h of the result: x[h]'s 8 lanes reduced by max (is_max) or +, as qb_hmax and
 * hadd8 do it (halves, then lanes i and i + 2, then 0 and 1), for 4 heads at once. */
PKVI_INLINE __m128 reduce4(const __m256 x[4], const bool is_max)
{
    __m128 y[4];
    PKVI_UNROLL
    for (int h = 0; h < 4; h++) {
        const __m128 a = _mm256_castps256_ps128(x[h]), b = _mm256_extractf128_ps(x[h], 1);
        y[h] = is_max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
    }
    const __m128 t0 = _mm_unpacklo_ps(y[0], y[1]), t1 = _mm_unpackhi_ps(y[0], y[1]);
    const __m128 t2 = _mm_unpacklo_ps(y[2], y[3]), t3 = _mm_unpackhi_ps(y[2], y[3]);
    const __m128 u0 = is_max ? _mm_max_ps(t0, t1) : _mm_add_ps(t0, t1);
    const __m128 u1 = is_max ? _mm_max_ps(t2, t3) : _mm_add_ps(t2, t3);
    const __m128 v0 = _mm_movelh_ps(u0, u1), v1 = _mm_movehl_ps(u1, u0);
    return is_max ? _mm_max_ps(v0, v1) : _mm_add_ps(v0, v1);
}

PKVI_INLINE void softmax_tile(uint32_t hg, uint32_t n, float scale, float cap, float *s, float *m,
                              float *l, float *alpha)
{
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256 lo = _mm256_castsi256_ps(tail_mask(n < 8 ? n : 8));
    const __m256 hi = _mm256_castsi256_ps(tail_mask(n > 8 ? n - 8 : 0));
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4) {
        __m256 s0[4], s1[4], x[4];
        PKVI_UNROLL
        for (int j = 0; j < 4; j++) {
            tile_scores(s + (size_t)(h + j) * PKVI_TILE, n, sc, cap, lo, hi, &s0[j], &s1[j]);
            x[j] = _mm256_max_ps(s0[j], s1[j]);
        }
        const __m128 mo = _mm_loadu_ps(m + h), mt = reduce4(x, true);
        /* fmaxf(m, mt) per head: m where m > mt or mt is NaN */
        const __m128 mn = _mm_blendv_ps(mt, mo, _mm_or_ps(_mm_cmpgt_ps(mo, mt),
                                                           _mm_cmpunord_ps(mt, mt)));
        _Alignas(16) float mb[4];
        _mm_store_ps(mb, mn);
        PKVI_UNROLL
        for (int j = 0; j < 4; j++) {
            float *sh = s + (size_t)(h + j) * PKVI_TILE;
            const __m256 mv = _mm256_broadcast_ss(mb + j);
            const __m256 e0 = exp8(_mm256_sub_ps(s0[j], mv));
            const __m256 e1 = exp8(_mm256_sub_ps(s1[j], mv));
            _mm256_store_ps(sh, e0);
            _mm256_store_ps(sh + 8, e1);
            x[j] = _mm256_add_ps(e0, e1);
        }
        const __m128 al = _mm256_castps256_ps128(
            exp8(_mm256_insertf128_ps(_mm256_setzero_ps(), _mm_sub_ps(mo, mn), 0)));
        _mm_storeu_ps(alpha + h, al);
        _mm_storeu_ps(l + h, _mm_fmadd_ps(_mm_loadu_ps(l + h), al, reduce4(x, false)));
        _mm_storeu_ps(m + h, mn);
    }
    for (; h < hg; h++) {
        float *sh = s + (size_t)h * PKVI_TILE;
        __m256 s0, s1;
        tile_scores(sh, n, sc, cap, lo, hi, &s0, &s1);
        const float mt = qb_hmax(_mm256_max_ps(s0, s1));
        const float mn = m[h] > mt || mt != mt ? m[h] : mt; /* fmaxf(m[h], mt) */
        const __m256 mv = _mm256_set1_ps(mn);
        const __m256 e0 = exp8(_mm256_sub_ps(s0, mv));
        const __m256 e1 = exp8(_mm256_sub_ps(s1, mv));
        _mm256_store_ps(sh, e0);
        _mm256_store_ps(sh + 8, e1);
        const float al = _mm_cvtss_f32(_mm256_castps256_ps128(exp8(_mm256_set1_ps(m[h] - mn))));
        alpha[h] = al;
        l[h] = __builtin_fmaf(l[h], al, hadd8(_mm256_add_ps(e0, e1)));
        m[h] = mn;
    }
}
#endif /* PKV_KERNELS_AVX2_MATH_H */

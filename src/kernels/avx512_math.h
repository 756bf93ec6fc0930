/*
 * kernels/avx512_math.h - the AVX-512 kernels' softmax step of one tile and what it
 * needs: exp16 and tanh16 (docs/numerics.md section 3: methods and accuracy) and the
 * fixed reduction trees (hsum16, the QK's; red4, the softmax's). For avx512.c and
 * avx512vnni.c. No state.
 */
#ifndef PKV_KERNELS_AVX512_MATH_H
#define PKV_KERNELS_AVX512_MATH_H

#include "kernels/kernels.h"

#include <immintrin.h>
#include <stdint.h>

/* ---- exp ----------------------------------------------------------------------------
 * e^x = 2^n * e^r, n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split
 * in a 9-bit head, so n * head is exact, and a tail). e^r = 1 + r + r^2 p(r) with the
 * Cephes expf minimax coefficients. 2^n is applied by vscalef, which rounds once, so
 * subnormal results are right too. x is clamped to [-110, 89]: below -103.98 the
 * result is 0 (n = -159 puts it under half the smallest subnormal), above 88.73 inf.
 * max/min take x as the second operand, so NaN passes through. Max error measured by
 * tests/test_kernels.c (exp_accuracy) over [-104, 0]: see docs/numerics.md. */
PKVI_INLINE __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* ---- reduction tree: lane i of the result = sum of the 16 lanes of v[i] -----------
 * 4 levels, 30 shuffles + 15 adds for 16 sums (against 16 x 8 ops for 16 separate
 * horizontal sums). The order of additions is fixed. */
PKVI_INLINE __m512 hsum16(const __m512 v[16])
{
    __m512 t[8], u[4], w[2];
    PKVI_UNROLL
    for (int i = 0; i < 8; i++) /* lanes of v[2i] and v[2i+1], interleaved, 2 summed */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    PKVI_UNROLL
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: one sum of 4 for v[4i..4i+3] */
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    PKVI_UNROLL
    for (int i = 0; i < 2; i++) /* fold 128-bit lanes 0+1 and 2+3 */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

/* ---- softmax of one tile --------------------------------------------------------------
 * Lane 4k+i of the result = op over all 16 lanes of v[i] (every 128-bit lane k holds
 * the 4 results): 10 shuffles and 5 ops for 4 heads instead of 4 x 8 dependent steps. */
PKVI_INLINE __m512 red4(__m512 (*op)(__m512, __m512), __m512 v0, __m512 v1, __m512 v2, __m512 v3)
{
    const __m512 a = op(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    const __m512 b = op(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
    __m512 c = op(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)),
                  _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
    c = op(c, _mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
    return op(c, _mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(1, 0, 3, 2)));
}

PKVI_INLINE __m512 vmax(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
PKVI_INLINE __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }

/* tanh for soft-capping: the method and bound of avx2.c's tanh8, 16 lanes. */
PKVI_INLINE __m512 tanh16(__m512 x)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 e = exp16(_mm512_add_ps(ax, ax));
    const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f),
                                                        _mm512_add_ps(e, one)));
    const __m512 x2 = _mm512_mul_ps(ax, ax);
    __m512 p = _mm512_set1_ps(3.5921280365e-3f);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-8.8632355299e-3f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.1869488536e-2f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-5.3968253968e-2f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(1.3333333333e-1f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-3.3333333333e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(ax, x2), p, ax);
    const __mmask16 lt = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.4f), _CMP_LT_OQ);
    const __m512 r = _mm512_mask_mov_ps(big, lt, small);
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(r),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}

/* Scaled scores, soft-capped when cap > 0. */
PKVI_INLINE __m512 scores16(__m512 raw, __m512 sc, float cap)
{
    const __m512 x = _mm512_mul_ps(raw, sc);
    if (cap <= 0.0f)
        return x;
    const __m512 c = _mm512_set1_ps(cap);
    return _mm512_mul_ps(c, tanh16(_mm512_div_ps(x, c)));
}

/* Heads h0 .. h0+nh (nh <= 4) of a tile of n tokens: s[h][0..n) holds unscaled dots;
 * on return the weights exp(s*scale - m'), alpha[h] = exp(m - m'), m and l updated as
 * in ref.c (l = l * alpha + sum, fused here). */
PKVI_INLINE void softmax4(uint32_t nh, uint32_t n, float scale, float cap, float *s, float *m,
                          float *l, float *alpha)
{
    const __mmask16 nk = (__mmask16)((1u << n) - 1u);
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-__builtin_inff());
    __m512 sv[4];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 4; i++) /* missing heads and tokens score -inf */
        sv[i] = i >= nh ? ninf
                : cap > 0.0f
                    ? _mm512_mask_mov_ps(ninf, nk,
                                         scores16(_mm512_maskz_loadu_ps(nk, s + i * PKVI_TILE),
                                                  sc, cap))
                    : _mm512_mask_mul_ps(ninf, nk, _mm512_maskz_loadu_ps(nk, s + i * PKVI_TILE),
                                         sc);
    const __mmask16 hk = (__mmask16)((1u << nh) - 1u);
    const __m512 mt = red4(vmax, sv[0], sv[1], sv[2], sv[3]);
    const __m512 mo = _mm512_broadcast_f32x4(_mm_maskz_loadu_ps((__mmask8)hk, m));
    /* fmaxf(m, mt): a NaN tile max keeps m, as in ref.c */
    const __m512 mn = _mm512_max_ps(mt, mo);
    __m512 e[4];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 4; i++) {
        const __m512 mi = _mm512_permutexvar_ps(_mm512_set1_epi32((int)i), mn);
        e[i] = exp16(_mm512_sub_ps(sv[i], mi));
        if (i < nh)
            _mm512_store_ps(s + i * PKVI_TILE, e[i]);
    }
    const __m512 ps = red4(vadd, e[0], e[1], e[2], e[3]);
    const __m512 al = exp16(_mm512_sub_ps(mo, mn));
    const __m512 lv = _mm512_fmadd_ps(_mm512_zextps128_ps512(_mm_maskz_loadu_ps((__mmask8)hk, l)),
                                      al, ps);
    /* 128-bit stores of the 4 heads' lanes: a 512-bit masked store would span the next
     * 4 heads' m and l, whose loads (the next call) would then wait for it to retire
     * instead of overlapping (docs/performance.md, decision table: softmax stores) */
    _mm_mask_storeu_ps(alpha, (__mmask8)hk, _mm512_castps512_ps128(al));
    _mm_mask_storeu_ps(l, (__mmask8)hk, _mm512_castps512_ps128(lv));
    _mm_mask_storeu_ps(m, (__mmask8)hk, _mm512_castps512_ps128(mn));
}

PKVI_INLINE void softmax_tile(uint32_t hg, uint32_t n, float scale, float cap, float *s, float *m,
                              float *l, float *alpha)
{
    for (uint32_t h = 0; h < hg; h += 4)
        softmax4(hg - h < 4 ? hg - h : 4, n, scale, cap, s + (size_t)h * PKVI_TILE, m + h,
                 l + h, alpha + h);
}
#endif /* PKV_KERNELS_AVX512_MATH_H */

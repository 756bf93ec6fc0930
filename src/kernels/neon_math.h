/*
 * kernels/neon_math.h - the NEON kernels' softmax step of one tile and what it needs:
 * exp4 and tanh4, the methods of avx2_math.h's exp8 and tanh8 (docs/numerics.md
 * section 3) on four lanes, so the same accuracy. For neon.c and neondot.c. No state.
 */
#ifndef PKV_KERNELS_NEON_MATH_H
#define PKV_KERNELS_NEON_MATH_H

#include "kernels/kernels.h"

#include <arm_neon.h>
#include <stdbool.h>

/* ---- exp -------------------------------------------------------------------------------
 * x clamped to [-110, 89] (FMAX/FMIN return a NaN operand, so NaN stays NaN), n =
 * round(x / ln 2) to nearest even, r = x - n ln 2 in two parts, a degree-7 polynomial,
 * and 2^n applied as two normal factors 2^(n>>1) and 2^(n - (n>>1)): the first product
 * is exact, the second rounds once, so subnormal results round once too. */
PKVI_INLINE float32x4_t exp4(float32x4_t x)
{
    x = vmaxq_f32(vdupq_n_f32(-110.0f), x);
    x = vminq_f32(vdupq_n_f32(89.0f), x);
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, r);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, r);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, r);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, r);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, r);
    y = vfmaq_f32(r, y, vmulq_f32(r, r));
    y = vaddq_f32(y, vdupq_n_f32(1.0f));
    const int32x4_t ni = vcvtq_s32_f32(n); /* n is integral: truncation is exact */
    const int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
    const int32x4_t bias = vdupq_n_s32(127);
    const float32x4_t f1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, bias), 23));
    const float32x4_t f2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, bias), 23));
    return vmulq_f32(vmulq_f32(y, f1), f2);
}

/* ---- tanh (soft-capping): avx2_math.h's tanh8 ------------------------------------------
 * Below |x| = 0.4 the odd Taylor series to x^13; above, sign(x) * (1 - 2 / (exp(2|x|) +
 * 1)). NaN stays NaN; +-inf gives +-1. */
PKVI_INLINE float32x4_t tanh4(float32x4_t x)
{
    const float32x4_t one = vdupq_n_f32(1.0f);
    const float32x4_t ax = vabsq_f32(x);
    const float32x4_t e = exp4(vaddq_f32(ax, ax));
    const float32x4_t big = vsubq_f32(one, vdivq_f32(vdupq_n_f32(2.0f), vaddq_f32(e, one)));
    const float32x4_t x2 = vmulq_f32(ax, ax);
    float32x4_t p = vdupq_n_f32(3.5921280365e-3f);                  /*  21844/6081075 */
    p = vfmaq_f32(vdupq_n_f32(-8.8632355299e-3f), p, x2);           /* -1382/155925 */
    p = vfmaq_f32(vdupq_n_f32(2.1869488536e-2f), p, x2);            /*  62/2835 */
    p = vfmaq_f32(vdupq_n_f32(-5.3968253968e-2f), p, x2);           /* -17/315 */
    p = vfmaq_f32(vdupq_n_f32(1.3333333333e-1f), p, x2);            /*  2/15 */
    p = vfmaq_f32(vdupq_n_f32(-3.3333333333e-1f), p, x2);           /* -1/3 */
    const float32x4_t small = vfmaq_f32(ax, vmulq_f32(ax, x2), p);
    const float32x4_t r = vbslq_f32(vcltq_f32(ax, vdupq_n_f32(0.4f)), small, big);
    const uint32x4_t sgn = vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u));
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(r), sgn));
}

/* Scaled scores, soft-capped when cap > 0. */
PKVI_INLINE float32x4_t scores4(float32x4_t raw, float32x4_t sc, float cap)
{
    const float32x4_t x = vmulq_f32(raw, sc);
    if (cap <= 0.0f)
        return x;
    const float32x4_t c = vdupq_n_f32(cap);
    return vmulq_f32(c, tanh4(vdivq_f32(x, c)));
}

/* ---- softmax of one tile (walk_softmax_fn; ref.c's step, l with a fused multiply-add)
 * One head at a time, its PKVI_TILE scores as four vectors (lanes past n -inf, whose
 * exp is 0): the max and the sum reduced in one fixed order (pairs of vectors, then
 * the lanes pairwise), whatever n and hg are. */
PKVI_INLINE void softmax_tile(uint32_t hg, uint32_t n, float scale, float cap, float *s,
                              float *m, float *l, float *alpha)
{
    const float32x4_t sc = vdupq_n_f32(scale), ninf = vdupq_n_f32(-__builtin_inff());
    const int32x4_t lane = {0, 1, 2, 3};
    uint32x4_t live[4];
    PKVI_UNROLL
    for (int i = 0; i < 4; i++)
        live[i] = vcltq_s32(vaddq_s32(lane, vdupq_n_s32(4 * i)), vdupq_n_s32((int32_t)n));
    for (uint32_t h = 0; h < hg; h++) {
        float *sh = s + (size_t)h * PKVI_TILE;
        float32x4_t x[4];
        PKVI_UNROLL
        for (int i = 0; i < 4; i++)
            x[i] = vbslq_f32(live[i], scores4(vld1q_f32(sh + 4 * i), sc, cap), ninf);
        const float mt = vmaxvq_f32(vmaxq_f32(vmaxq_f32(x[0], x[1]), vmaxq_f32(x[2], x[3])));
        const float mn = m[h] > mt || mt != mt ? m[h] : mt; /* fmaxf(m[h], mt) */
        const float32x4_t mv = vdupq_n_f32(mn);
        PKVI_UNROLL
        for (int i = 0; i < 4; i++) {
            x[i] = exp4(vsubq_f32(x[i], mv));
            vst1q_f32(sh + 4 * i, x[i]);
        }
        const float sum = vaddvq_f32(vaddq_f32(vaddq_f32(x[0], x[1]), vaddq_f32(x[2], x[3])));
        const float al = vgetq_lane_f32(exp4(vdupq_n_f32(m[h] - mn)), 0);
        alpha[h] = al;
        l[h] = __builtin_fmaf(l[h], al, sum);
        m[h] = mn;
    }
}

#endif /* PKV_KERNELS_NEON_MATH_H */

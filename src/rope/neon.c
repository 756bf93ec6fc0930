/*
 * rope/neon.c - the RoPE kernels for Advanced SIMD, pkvi_rope_neon (compiled for plain
 * armv8-a like kernels/neon.c; used only by engines whose decode kernels are the neon
 * or neon_dotprod table, which kernels/dispatch.c chose after AT_HWCAP).
 *
 * Owns pkvi_rope_neon. The specification is rope.c's scalar kernels: every lane does
 * the same fused multiply-add (FMLA) on the same rounded product (FMUL), so the
 * results are theirs bit for bit (tests/test_rope.c compares them). Adjacent pairs
 * need no shuffles here: LD2 splits 4 pairs into their first and second values and ST2
 * interleaves them back. Tails (fewer pairs than a vector) run the scalar formula,
 * which aarch64 compiles to the same FMADD.
 */
#include "rope/rope.h"

#include <arm_neon.h>
#include <math.h>

/* x' = fma(x, c, -(y * s)), y' = fma(x, s, y * c) on 4 pairs: the negation is exact,
 * so FMLA onto -(y * s) is the scalar fmaf. */
static inline float32x4_t turn_x(float32x4_t x, float32x4_t y, float32x4_t c, float32x4_t s)
{
    return vfmaq_f32(vnegq_f32(vmulq_f32(y, s)), x, c);
}

static inline float32x4_t turn_y(float32x4_t x, float32x4_t y, float32x4_t c, float32x4_t s)
{
    return vfmaq_f32(vmulq_f32(y, c), x, s);
}

static void combine(uint32_t half, const float *a, const float *b, float *out)
{
    uint32_t i = 0;
    for (; i + 4 <= half; i += 4) {
        const float32x4_t ac = vld1q_f32(a + i), as = vld1q_f32(a + half + i);
        const float32x4_t bc = vld1q_f32(b + i), bs = vld1q_f32(b + half + i);
        /* c = fma(ac, bc, -(as * bs)), s = fma(as, bc, ac * bs) (the sine rounds
         * ac * bs, not as * bc: not turn_y's order); both loads precede the stores, so
         * out may be a or b */
        vst1q_f32(out + i, turn_x(ac, as, bc, bs));
        vst1q_f32(out + half + i, vfmaq_f32(vmulq_f32(ac, bs), as, bc));
    }
    for (; i < half; i++) {
        const float ac = a[i], as = a[half + i], bc = b[i], bs = b[half + i];
        out[i] = fmaf(ac, bc, -(as * bs));
        out[half + i] = fmaf(as, bc, ac * bs);
    }
}

/* Adjacent pairs, 4 a vector: LD2 gives the 4 first values and the 4 second ones. */
static void rotate_norm(uint32_t half, const float *c, const float *s, float *x)
{
    uint32_t i = 0;
    for (; i + 4 <= half; i += 4) {
        const float32x4_t cv = vld1q_f32(c + i), sv = vld1q_f32(s + i);
        const float32x4x2_t v = vld2q_f32(x + 2 * i);
        float32x4x2_t w;
        w.val[0] = turn_x(v.val[0], v.val[1], cv, sv);
        w.val[1] = turn_y(v.val[0], v.val[1], cv, sv);
        vst2q_f32(x + 2 * i, w);
    }
    for (; i < half; i++) {
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = fmaf(a, c[i], -(b * s[i]));
        x[2 * i + 1] = fmaf(a, s[i], b * c[i]);
    }
}

/* Split halves: pair i is (x[i], x[half + i]), 4 pairs a vector. */
static void rotate_neox(uint32_t half, const float *c, const float *s, float *x)
{
    uint32_t i = 0;
    for (; i + 4 <= half; i += 4) {
        const float32x4_t cv = vld1q_f32(c + i), sv = vld1q_f32(s + i);
        const float32x4_t a = vld1q_f32(x + i), b = vld1q_f32(x + half + i);
        vst1q_f32(x + i, turn_x(a, b, cv, sv));
        vst1q_f32(x + half + i, turn_y(a, b, cv, sv));
    }
    for (; i < half; i++) {
        const float a = x[i], b = x[half + i];
        x[i] = fmaf(a, c[i], -(b * s[i]));
        x[half + i] = fmaf(a, s[i], b * c[i]);
    }
}

static void rotate(uint32_t style, uint32_t half, const float *cs, float *x, uint32_t n,
                   size_t stride)
{
    for (uint32_t r = 0; r < n; r++, x += stride) {
        if (style == PKV_ROPE_NORM)
            rotate_norm(half, cs, cs + half, x);
        else
            rotate_neox(half, cs, cs + half, x);
    }
}

const pkvi_rope_kernels pkvi_rope_neon = {"neon", combine, rotate};

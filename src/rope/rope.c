/*
 * rope/rope.c - a layer's RoPE (rope.h): the config check every entry shares, the
 * tables of cos/sin, the rotation of a position and back, and the scalar kernels -
 * the specification rope/avx2.c, rope/avx512.c and rope/neon.c compute bit for bit.
 *
 * Owns pkvi_rope objects (built here, owned by engine.c) and pkvi_rope_scalar. Knows
 * nothing of pages, sessions or dtypes: callers hand it f32 rows.
 */
#include "rope/rope.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the config ------------------------------------------------------------------------ */

__attribute__((format(printf, 3, 4)))
static bool refuse(char *why, size_t n, const char *fmt, ...)
{
    if (why && n) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, n, fmt, ap);
        va_end(ap);
    }
    return false;
}

bool pkvi_rope_check(const pkv_layer_config *lc, uint32_t head_dim, pkv_layer_config *out,
                     char *why, size_t n)
{
    pkv_layer_config c = *lc;
    if (c.rope == 0) {
        if (c.rope_dims || c.rope_theta != 0.0f || c.rope_freq_scale != 0.0f)
            return refuse(why, n, "rope_dims, rope_theta or rope_freq_scale set without "
                          "rope (set rope to PKV_ROPE_NORM or PKV_ROPE_NEOX, or clear them)");
        if (out)
            *out = c;
        return true;
    }
    if (c.rope != PKV_ROPE_NORM && c.rope != PKV_ROPE_NEOX)
        return refuse(why, n, "rope %u is none of 0, PKV_ROPE_NORM (%u), PKV_ROPE_NEOX (%u)",
                      c.rope, PKV_ROPE_NORM, PKV_ROPE_NEOX);
    if (c.rope_dims == 0)
        c.rope_dims = head_dim;
    if (c.rope_dims % 2 || c.rope_dims > head_dim || c.rope_dims > PKVI_ROPE_MAX_DIMS)
        return refuse(why, n, "rope_dims %u: must be even and at most head_dim %u "
                      "(0 = head_dim)", c.rope_dims, head_dim);
    if (!isfinite(c.rope_theta) || c.rope_theta < 0.0f)
        return refuse(why, n, "rope_theta %g: must be finite and > 0 (0 = %g)",
                      (double)c.rope_theta, (double)PKVI_ROPE_THETA_DEFAULT);
    if (c.rope_theta == 0.0f)
        c.rope_theta = PKVI_ROPE_THETA_DEFAULT;
    if (!isfinite(c.rope_freq_scale) || c.rope_freq_scale < 0.0f)
        return refuse(why, n, "rope_freq_scale %g: must be finite and > 0 (0 = 1, none)",
                      (double)c.rope_freq_scale);
    if (c.rope_freq_scale == 0.0f)
        c.rope_freq_scale = 1.0f;
    if (out)
        *out = c;
    return true;
}

/* ---- the scalar kernels: the specification ---------------------------------------------- */

static void combine_scalar(uint32_t half, const float *a, const float *b, float *out)
{
    for (uint32_t i = 0; i < half; i++) {
        const float ac = a[i], as = a[half + i], bc = b[i], bs = b[half + i];
        out[i] = fmaf(ac, bc, -(as * bs));
        out[half + i] = fmaf(as, bc, ac * bs);
    }
}

static void rotate_scalar(uint32_t style, uint32_t half, const float *cs, float *x,
                          uint32_t n, size_t stride)
{
    const float *c = cs, *s = cs + half;
    /* pair i is (x[lo], x[lo + step]): adjacent, or the two halves */
    const size_t step = style == PKV_ROPE_NORM ? 1 : half;
    for (uint32_t r = 0; r < n; r++, x += stride)
        for (uint32_t i = 0; i < half; i++) {
            float *p = x + (style == PKV_ROPE_NORM ? 2 * (size_t)i : i);
            const float a = p[0], b = p[step];
            p[0] = fmaf(a, c[i], -(b * s[i]));
            p[step] = fmaf(a, s[i], b * c[i]);
        }
}

const pkvi_rope_kernels pkvi_rope_scalar = {"scalar", combine_scalar, rotate_scalar};

const pkvi_rope_kernels *pkvi_rope_kernels_for(const char *isa)
{
    /* a VNNI table runs its base table's code, and so do its rotations */
#if PKV_KERNEL_AVX512
    if (strncmp(isa, "avx512", 6) == 0)
        return &pkvi_rope_avx512;
#endif
#if PKV_KERNEL_AVX2
    if (strncmp(isa, "avx2", 4) == 0)
        return &pkvi_rope_avx2;
#endif
#if PKV_KERNEL_NEON
    if (strncmp(isa, "neon", 4) == 0)
        return &pkvi_rope_neon;
#endif
    (void)isa;
    return &pkvi_rope_scalar;
}

/* ---- tables ----------------------------------------------------------------------------- */

pkv_status pkvi_rope_new(const pkv_layer_config *lc, const pkvi_rope_kernels *k,
                         pkvi_rope **out)
{
    const uint32_t half = lc->rope_dims / 2;
    pkvi_rope *r = calloc(1, sizeof *r);
    const size_t tab_floats = (size_t)PKVI_ROPE_LEVELS * PKVI_ROPE_DIGITS * 2 * half;
    if (!r || !(r->freq = malloc(half * sizeof *r->freq)) ||
        !(r->tab = malloc(tab_floats * sizeof *r->tab))) {
        pkvi_rope_free(r);
        return PKV_ENOMEM;
    }
    r->style = lc->rope;
    r->half = half;
    r->lc = *lc;
    r->k = k;
    const double theta = lc->rope_theta, scale = lc->rope_freq_scale;
    for (uint32_t i = 0; i < half; i++)
        r->freq[i] = scale * pow(theta, -(2.0 * i) / lc->rope_dims);
    for (uint32_t lv = 0; lv < PKVI_ROPE_LEVELS; lv++)
        for (uint32_t d = 0; d < PKVI_ROPE_DIGITS; d++) {
            float *t = r->tab + ((size_t)lv * PKVI_ROPE_DIGITS + d) * 2 * half;
            const double steps = (double)((uint64_t)d << (PKVI_ROPE_DIGIT_BITS * lv));
            for (uint32_t i = 0; i < half; i++) {
                const double a = steps * r->freq[i];
                t[i] = (float)cos(a);
                t[half + i] = (float)sin(a);
            }
        }
    *out = r;
    return PKV_OK;
}

void pkvi_rope_free(pkvi_rope *r)
{
    if (!r)
        return;
    free(r->freq);
    free(r->tab);
    free(r);
}

bool pkvi_rope_same(const pkvi_rope *r, const pkv_layer_config *lc)
{
    return r->lc.rope == lc->rope && r->lc.rope_dims == lc->rope_dims &&
           r->lc.rope_theta == lc->rope_theta && r->lc.rope_freq_scale == lc->rope_freq_scale;
}

/* ---- the rotation of a position --------------------------------------------------------- */

/* The part of a position the tables do not hold (p - p mod 2^24), in pieces of this
 * many pairs, so the stack holds one piece however wide the head. */
#define HI_PIECE 64u

void pkvi_rope_at(const pkvi_rope *r, uint64_t pos, float *cs)
{
    const uint32_t half = r->half;
    const size_t vec = 2 * (size_t)half;
    const uint64_t lo = pos & ((1ull << PKVI_ROPE_TABLE_BITS) - 1), hi = pos - lo;
    const float *t0 = r->tab + (lo & (PKVI_ROPE_DIGITS - 1)) * vec;
    memcpy(cs, t0, vec * sizeof *cs);
    for (uint32_t lv = 1; lv < PKVI_ROPE_LEVELS; lv++) {
        const uint64_t d = (lo >> (PKVI_ROPE_DIGIT_BITS * lv)) & (PKVI_ROPE_DIGITS - 1);
        if (d)
            r->k->combine(half, cs, r->tab + ((size_t)lv * PKVI_ROPE_DIGITS + d) * vec, cs);
    }
    if (!hi)
        return;
    /* hi is a multiple of 2^24 below 2^64: exact in double (at most 40 significant bits) */
    for (uint32_t i0 = 0; i0 < half; i0 += HI_PIECE) {
        const uint32_t m = half - i0 < HI_PIECE ? half - i0 : HI_PIECE;
        float a[2 * HI_PIECE], h[2 * HI_PIECE];
        for (uint32_t i = 0; i < m; i++) {
            const double ang = (double)hi * r->freq[i0 + i];
            a[i] = cs[i0 + i];
            a[m + i] = cs[half + i0 + i];
            h[i] = (float)cos(ang);
            h[m + i] = (float)sin(ang);
        }
        r->k->combine(m, a, h, a);
        for (uint32_t i = 0; i < m; i++) {
            cs[i0 + i] = a[i];
            cs[half + i0 + i] = a[m + i];
        }
    }
}

void pkvi_rope_back(const pkvi_rope *r, uint64_t delta, float *cs)
{
    pkvi_rope_at(r, delta, cs);
    for (uint32_t i = 0; i < r->half; i++)
        cs[r->half + i] = -cs[r->half + i];
}

void pkvi_rope_rows(const pkvi_rope *r, uint32_t n, const uint64_t *pos, float *x,
                    uint32_t heads, uint32_t head_dim)
{
    float cs[PKVI_ROPE_MAX_DIMS];
    for (uint32_t j = 0; j < n; j++) {
        pkvi_rope_at(r, pos[j], cs);
        pkvi_rope_apply(r, cs, x + (size_t)j * heads * head_dim, heads, head_dim);
    }
}

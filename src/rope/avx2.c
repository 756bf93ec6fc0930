/*
 * rope/avx2.c - the RoPE kernels for AVX2 + FMA, pkvi_rope_avx2 (compiled with -mavx2
 * -mfma; used only by engines whose decode kernels are an avx2 table, which
 * kernels/dispatch.c chose after cpuid and XGETBV).
 *
 * Owns pkvi_rope_avx2. The specification is rope.c's scalar kernels: every lane does
 * the same fused multiply-add on the same rounded product, so the results are theirs
 * bit for bit (tests/test_rope.c compares them). Tails (fewer pairs than a vector) run
 * the scalar formula, which -mfma compiles to the same instructions.
 */
#include "rope/rope.h"

#include <immintrin.h>
#include <math.h>

static void combine(uint32_t half, const float *a, const float *b, float *out)
{
    uint32_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 ac = _mm256_loadu_ps(a + i), as = _mm256_loadu_ps(a + half + i);
        const __m256 bc = _mm256_loadu_ps(b + i), bs = _mm256_loadu_ps(b + half + i);
        _mm256_storeu_ps(out + i, _mm256_fmsub_ps(ac, bc, _mm256_mul_ps(as, bs)));
        _mm256_storeu_ps(out + half + i, _mm256_fmadd_ps(as, bc, _mm256_mul_ps(ac, bs)));
    }
    for (; i < half; i++) {
        const float ac = a[i], as = a[half + i], bc = b[i], bs = b[half + i];
        out[i] = fmaf(ac, bc, -(as * bs));
        out[half + i] = fmaf(as, bc, ac * bs);
    }
}

/* Adjacent pairs: 4 pairs a vector. The even lanes want fma(x, c, -(y s)), the odd ones
 * fma(x, s, y c): fmaddsub of the even values duplicated, times (c, s) interleaved,
 * with the odd values duplicated times (s, c). */
static void rotate_norm(uint32_t half, const float *c, const float *s, float *x)
{
    uint32_t i = 0;
    for (; i + 4 <= half; i += 4) {
        const __m128 c4 = _mm_loadu_ps(c + i), s4 = _mm_loadu_ps(s + i);
        const __m256 cs = _mm256_set_m128(_mm_unpackhi_ps(c4, s4), _mm_unpacklo_ps(c4, s4));
        const __m256 sc = _mm256_permute_ps(cs, 0xb1);
        const __m256 v = _mm256_loadu_ps(x + 2 * i);
        const __m256 t = _mm256_mul_ps(_mm256_movehdup_ps(v), sc);
        _mm256_storeu_ps(x + 2 * i, _mm256_fmaddsub_ps(_mm256_moveldup_ps(v), cs, t));
    }
    for (; i < half; i++) {
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = fmaf(a, c[i], -(b * s[i]));
        x[2 * i + 1] = fmaf(a, s[i], b * c[i]);
    }
}

/* Split halves: pair i is (x[i], x[half + i]), 8 pairs a vector. */
static void rotate_neox(uint32_t half, const float *c, const float *s, float *x)
{
    uint32_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
        _mm256_storeu_ps(x + i, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
        _mm256_storeu_ps(x + half + i, _mm256_fmadd_ps(a, sv, _mm256_mul_ps(b, cv)));
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

const pkvi_rope_kernels pkvi_rope_avx2 = {"avx2", combine, rotate};

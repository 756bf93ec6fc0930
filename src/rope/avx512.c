/*
 * rope/avx512.c - the RoPE kernels for AVX-512F, pkvi_rope_avx512 (compiled with the
 * decode kernels' AVX-512 flags; used only by engines whose decode kernels are an
 * avx512 table, which kernels/dispatch.c chose after cpuid and XGETBV).
 *
 * Owns pkvi_rope_avx512: rope/avx2.c at twice the width (its comment has the method),
 * with masked loads and stores for the tail, so every element goes through the same
 * fused multiply-add as in rope.c's scalar specification: the same bits.
 */
#include "rope/rope.h"

#include <immintrin.h>
#include <math.h>

static void combine(uint32_t half, const float *a, const float *b, float *out)
{
    for (uint32_t i = 0; i < half; i += 16) {
        const __mmask16 m = half - i >= 16 ? (__mmask16)0xffff
                                           : (__mmask16)((1u << (half - i)) - 1);
        const __m512 ac = _mm512_maskz_loadu_ps(m, a + i);
        const __m512 as = _mm512_maskz_loadu_ps(m, a + half + i);
        const __m512 bc = _mm512_maskz_loadu_ps(m, b + i);
        const __m512 bs = _mm512_maskz_loadu_ps(m, b + half + i);
        _mm512_mask_storeu_ps(out + i, m, _mm512_fmsub_ps(ac, bc, _mm512_mul_ps(as, bs)));
        _mm512_mask_storeu_ps(out + half + i, m, _mm512_fmadd_ps(as, bc, _mm512_mul_ps(ac, bs)));
    }
}

/* Adjacent pairs, 8 a vector: (c, s) interleaved from the planar halves by one
 * permutation of [c0..c7 | s0..s7]. */
static void rotate_norm(uint32_t half, const float *c, const float *s, float *x)
{
    const __m512i inter = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    uint32_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m512 both = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(c + i)),
                                               _mm256_loadu_ps(s + i), 1);
        const __m512 cs = _mm512_permutexvar_ps(inter, both);
        const __m512 sc = _mm512_permute_ps(cs, 0xb1);
        const __m512 v = _mm512_loadu_ps(x + 2 * i);
        const __m512 t = _mm512_mul_ps(_mm512_movehdup_ps(v), sc);
        _mm512_storeu_ps(x + 2 * i, _mm512_fmaddsub_ps(_mm512_moveldup_ps(v), cs, t));
    }
    for (; i < half; i++) {
        const float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = fmaf(a, c[i], -(b * s[i]));
        x[2 * i + 1] = fmaf(a, s[i], b * c[i]);
    }
}

/* Split halves, 16 pairs a vector, the tail masked. */
static void rotate_neox(uint32_t half, const float *c, const float *s, float *x)
{
    for (uint32_t i = 0; i < half; i += 16) {
        const __mmask16 m = half - i >= 16 ? (__mmask16)0xffff
                                           : (__mmask16)((1u << (half - i)) - 1);
        const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
        const __m512 a = _mm512_maskz_loadu_ps(m, x + i);
        const __m512 b = _mm512_maskz_loadu_ps(m, x + half + i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv)));
        _mm512_mask_storeu_ps(x + half + i, m, _mm512_fmadd_ps(a, sv, _mm512_mul_ps(b, cv)));
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

const pkvi_rope_kernels pkvi_rope_avx512 = {"avx512", combine, rotate};

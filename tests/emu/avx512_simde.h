/*
 * tests/emu/avx512_simde.h - runs src/kernels/avx512.c on a host without AVX-512, for
 * tests only (meson option avx512_emulation; docs/reliability.md, "The AVX-512 kernel by emulation").
 *
 * meson force-includes this header into avx512.c, compiled for AVX2. SIMDe's portable
 * AVX-512 (libsimde-dev, its native aliases) stands in for the _mm512_* intrinsics;
 * below are the seventeen this kernel uses that SIMDe 0.7.4 lacks, written lane by lane from
 * Intel's definitions. The masked loads and stores touch only the lanes their mask
 * selects, as the hardware's fault suppression does, so ASan and valgrind see the same
 * reads. Emulation checks the kernel's logic (tiles, tails, masks, walk, integer dots)
 * and the numerics as far as SIMDe follows the hardware; it is no substitute for a run
 * on real AVX-512, and never part of an installed library.
 */
#ifndef PAGEDKV_TESTS_AVX512_SIMDE_H
#define PAGEDKV_TESTS_AVX512_SIMDE_H

#if defined(__AVX512F__)
#error "avx512_simde.h is for builds without AVX-512 code generation"
#endif

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define AI_EMU static inline __attribute__((always_inline))

AI_EMU __m512 pkve_from16f(const float x[16])
{
    return simde_mm512_loadu_ps(x);
}
AI_EMU void pkve_to16f(float x[16], __m512 v)
{
    simde_mm512_storeu_ps(x, v);
}
AI_EMU __m512i pkve_from16i(const int32_t x[16])
{
    return simde_mm512_loadu_si512(x);
}
AI_EMU void pkve_to16i(int32_t x[16], __m512i v)
{
    simde_mm512_storeu_si512(x, v);
}

/* 16 halves (f16) to f32: the two 8-lane F16C conversions. */
AI_EMU __m512 pkve_mm512_cvtph_ps(__m256i h)
{
    float x[16];
    _mm256_storeu_ps(x, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
    _mm256_storeu_ps(x + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    return pkve_from16f(x);
}
#define _mm512_cvtph_ps(h) pkve_mm512_cvtph_ps(h)

/* f32 to f16 with the rounding immediate r, by halves (a macro: r stays immediate). */
#define _mm512_cvtps_ph(v, r)                                                            \
    __extension__({                                                                      \
        float pkve_x_[16];                                                               \
        pkve_to16f(pkve_x_, (v));                                                        \
        _mm256_set_m128i(_mm256_cvtps_ph(_mm256_loadu_ps(pkve_x_ + 8), (r)),             \
                         _mm256_cvtps_ph(_mm256_loadu_ps(pkve_x_), (r)));                \
    })

/* 16 lanes of 8 or 16 bits at p, sign- or zero-extended to 32 (vpmov{s,z}x*d). */
AI_EMU __m512i pkve_widen16(const void *p, int bits, int is_signed)
{
    int32_t x[16];
    for (int i = 0; i < 16; i++) {
        if (bits == 8) {
            const unsigned char b = ((const unsigned char *)p)[i];
            x[i] = is_signed ? (int32_t)(int8_t)b : (int32_t)b;
        } else {
            uint16_t h;
            memcpy(&h, (const char *)p + 2 * i, sizeof h);
            x[i] = is_signed ? (int32_t)(int16_t)h : (int32_t)h;
        }
    }
    return pkve_from16i(x);
}

AI_EMU __m512i pkve_mm512_cvtepu16_epi32(__m256i h)
{
    return pkve_widen16(&h, 16, 0);
}
#define _mm512_cvtepu16_epi32(h) pkve_mm512_cvtepu16_epi32(h)

/* 16 lanes of 32 bits truncated to their low 8 or 16 bits, stored at p (vpmovd{b,w}):
 * pkve_widen16's inverse. */
AI_EMU void pkve_narrow16(void *p, __m512i v, int bits)
{
    int32_t x[16];
    pkve_to16i(x, v);
    for (int i = 0; i < 16; i++) {
        const uint32_t u = (uint32_t)x[i];
        if (bits == 8) {
            ((unsigned char *)p)[i] = (unsigned char)u;
        } else {
            const uint16_t h = (uint16_t)u;
            memcpy((char *)p + 2 * i, &h, sizeof h);
        }
    }
}

AI_EMU __m256i pkve_mm512_cvtepi32_epi16(__m512i v)
{
    __m256i r;
    pkve_narrow16(&r, v, 16);
    return r;
}
#define _mm512_cvtepi32_epi16(v) pkve_mm512_cvtepi32_epi16(v)

AI_EMU __m128i pkve_mm512_cvtepi32_epi8(__m512i v)
{
    __m128i r;
    pkve_narrow16(&r, v, 8);
    return r;
}
#define _mm512_cvtepi32_epi8(v) pkve_mm512_cvtepi32_epi8(v)

/* f32 to int32 rounded to nearest, ties to even, whatever MXCSR says (the only rounding
 * the kernel asks of vcvtps2dq with an embedded rounding mode); out of range or NaN
 * gives INT32_MIN, the hardware's integer indefinite. */
AI_EMU __m512i pkve_mm512_cvt_roundps_epi32_nearest(__m512 v)
{
    float x[16];
    int32_t a[16];
    pkve_to16f(x, v);
    for (int i = 0; i < 16; i++) {
        const float r = x[i] - remainderf(x[i], 1.0f); /* nearest, ties to even */
        a[i] = r >= -2147483648.0f && r < 2147483648.0f ? (int32_t)r : INT32_MIN;
    }
    return pkve_from16i(a);
}
#define _mm512_cvt_roundps_epi32(v, r) pkve_mm512_cvt_roundps_epi32_nearest(v)

/* The largest of 16 lanes (a NaN lane may or may not win: the kernel tests for NaN
 * itself). */
AI_EMU float pkve_mm512_reduce_max_ps(__m512 v)
{
    float x[16];
    pkve_to16f(x, v);
    float m = x[0];
    for (int i = 1; i < 16; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}
#define _mm512_reduce_max_ps(v) pkve_mm512_reduce_max_ps(v)

AI_EMU __mmask16 pkve_mm512_cmpgt_epu32_mask(__m512i a, __m512i b)
{
    int32_t x[16], y[16];
    pkve_to16i(x, a);
    pkve_to16i(y, b);
    unsigned k = 0;
    for (int i = 0; i < 16; i++)
        k |= ((uint32_t)x[i] > (uint32_t)y[i] ? 1u : 0u) << i;
    return (__mmask16)k;
}
#define _mm512_cmpgt_epu32_mask(a, b) pkve_mm512_cmpgt_epu32_mask(a, b)

/* Sign and zero extension of 16 bytes to 32-bit lanes, and int32 to f32 (exact below
 * 2^24, rounded to nearest even above, as vcvtdq2ps under the default MXCSR). */
AI_EMU __m512i pkve_mm512_cvtepi8_epi32(__m128i b)
{
    return pkve_widen16(&b, 8, 1);
}
#define _mm512_cvtepi8_epi32(b) pkve_mm512_cvtepi8_epi32(b)

AI_EMU __m512i pkve_mm512_cvtepu8_epi32(__m128i b)
{
    return pkve_widen16(&b, 8, 0);
}
#define _mm512_cvtepu8_epi32(b) pkve_mm512_cvtepu8_epi32(b)

AI_EMU __m512 pkve_mm512_cvtepi32_ps(__m512i v)
{
    int32_t x[16];
    pkve_to16i(x, v);
    float f[16];
    _mm256_storeu_ps(f, _mm256_cvtepi32_ps(_mm256_loadu_si256((const void *)x)));
    _mm256_storeu_ps(f + 8, _mm256_cvtepi32_ps(_mm256_loadu_si256((const void *)(x + 8))));
    return pkve_from16f(f);
}
#define _mm512_cvtepi32_ps(v) pkve_mm512_cvtepi32_ps(v)

/* Four 128-bit lanes picked by imm: two of a, then two of b (SIMDe has no alias). */
#define _mm512_shuffle_f32x4(a, b, imm) simde_mm512_shuffle_f32x4(a, b, imm)

/* SIMDe 0.7.4's native alias of _mm512_madd_epi16 takes its masked form's four
 * arguments; the plain form's two, to its plain function. */
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

/* The eight floats of half imm (0: lanes 0-7, 1: lanes 8-15). */
AI_EMU __m256 pkve_mm512_extractf32x8_ps(__m512 v, int imm)
{
    float f[16];
    pkve_to16f(f, v);
    return _mm256_loadu_ps(f + 8 * (imm & 1));
}
#define _mm512_extractf32x8_ps(v, imm) pkve_mm512_extractf32x8_ps(v, imm)

/* ---- masked loads and stores: only the selected lanes are read or written ---------- */

/* Lane i (of n lanes of es bytes) copied from src to dst where bit i of k is set; the
 * other lanes of dst keep what they hold (zeros, for a maskz load). */
AI_EMU void pkve_mask_copy(void *dst, const void *src, unsigned k, int n, size_t es)
{
    for (int i = 0; i < n; i++)
        if (k >> i & 1)
            memcpy((char *)dst + (size_t)i * es, (const char *)src + (size_t)i * es, es);
}

AI_EMU __m256i pkve_mm256_maskz_loadu_epi16(__mmask16 k, const void *p)
{
    __m256i r = _mm256_setzero_si256();
    pkve_mask_copy(&r, p, k, 16, sizeof(uint16_t));
    return r;
}
#define _mm256_maskz_loadu_epi16(k, p) pkve_mm256_maskz_loadu_epi16(k, p)

AI_EMU void pkve_mm256_mask_storeu_epi16(void *p, __mmask16 k, __m256i v)
{
    pkve_mask_copy(p, &v, k, 16, sizeof(uint16_t));
}
#define _mm256_mask_storeu_epi16(p, k, v) pkve_mm256_mask_storeu_epi16(p, k, v)

AI_EMU __m512 pkve_mm512_maskz_loadu_ps(__mmask16 k, const void *p)
{
    float x[16] = {0};
    pkve_mask_copy(x, p, k, 16, sizeof(float));
    return pkve_from16f(x);
}
#define _mm512_maskz_loadu_ps(k, p) pkve_mm512_maskz_loadu_ps(k, p)

AI_EMU __m128 pkve_mm_maskz_loadu_ps(__mmask8 k, const void *p)
{
    __m128 r = _mm_setzero_ps();
    pkve_mask_copy(&r, p, k, 4, sizeof(float));
    return r;
}
#define _mm_maskz_loadu_ps(k, p) pkve_mm_maskz_loadu_ps(k, p)

AI_EMU void pkve_mm512_mask_storeu_ps(void *p, __mmask16 k, __m512 v)
{
    float x[16];
    pkve_to16f(x, v);
    pkve_mask_copy(p, x, k, 16, sizeof(float));
}
#define _mm512_mask_storeu_ps(p, k, v) pkve_mm512_mask_storeu_ps(p, k, v)

#endif /* PAGEDKV_TESTS_AVX512_SIMDE_H */

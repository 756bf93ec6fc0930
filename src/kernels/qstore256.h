/*
 * kernels/qstore256.h - the Q8/Q4 row store in 256-bit vectors (AVX2 and F16C; avx512.c
 * compiles it too, with its own flags): qs_store_row, what avx2.c's and avx512.c's
 * store_row do for the block types. quant.c (pkvi_quant_store_row) is the definition:
 * every block gets its scale, its scale search and its codes by the same IEEE single
 * operations in the same order, so the same bytes (tests/test_kernels.c,
 * quant_store_bitwise). Used by avx2.c's and avx512.c's store_row; no state.
 *
 * Why vectors: the scale search rounds each of a block's 32 values against 8 candidate
 * scales, one correctly rounded division each. quant.c, built for the baseline ISA,
 * does that 4 lanes at a time and converts each candidate between f32 and f16 in
 * software; here the 8 candidates are the 8 lanes of one vector (F16C converts all 8
 * at once), so a value costs one vdivps and five to seven other operations
 * (docs/performance.md, decision table: qstore256).
 */
#ifndef PKV_KERNELS_QSTORE256_H
#define PKV_KERNELS_QSTORE256_H

#include "kernels/kernels.h"
#include "kernels/qblock256.h" /* qb_scan, qb_hmax, qb_pack_i8 */
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

/* quant.c's code_of on 8 lanes: clamp to [lo, hi] (minps and maxps are the selects
 * `y < hi ? y : hi` and `y > lo ? y : lo`), then round to the nearest integer, ties to
 * even: vroundps, which for |y| < 2^22 is what quant.c's adding and taking away of
 * 1.5 * 2^23 gives. */
PKVI_INLINE __m256 qs_code(__m256 y, __m256 lo, __m256 hi)
{
    return _mm256_round_ps(_mm256_max_ps(_mm256_min_ps(y, hi), lo),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* Each lane's squared error of the block under its scale d, summed over the values in
 * order. Without `clamp` the codes are not clamped: the caller has shown that no code
 * of any lane reaches past the clamp's bounds by rounding (see qs_search). */
PKVI_INLINE __m256 qs_err(const float *x, uint32_t m, __m256 d, __m256 lo, __m256 hi, bool clamp)
{
    __m256 e = _mm256_setzero_ps();
    for (uint32_t j = 0; j < m; j++) {
        const __m256 xj = _mm256_set1_ps(x[j]);
        const __m256 y = _mm256_div_ps(xj, d);
        const __m256 c = clamp ? qs_code(y, lo, hi)
                               : _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 t = _mm256_sub_ps(xj, _mm256_mul_ps(d, c));
        e = _mm256_add_ps(e, _mm256_mul_ps(t, t));
    }
    return e;
}

/* The least of 8 lanes (no NaN among them). */
PKVI_INLINE float qs_hmin(__m256 v)
{
    __m128 h = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_min_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_min_ss(h, _mm_movehdup_ps(h)));
}

/* The scale search (quant.c search_scale): lane k holds the candidate f16(|d_0| (1 +
 * k / 64)) with d_0's sign, or d_0 itself where that is past the f16 maximum. Where
 * quant.c drops repeats and candidates past 65504, this keeps every lane: a repeat or a
 * d_0 has the same error as the lane before it or lane 0, and the first least error is
 * taken, so the scale chosen is the same. Each lane's error is summed over the values
 * in order, as there. */
PKVI_INLINE uint16_t qs_search(pkv_dtype t, const float *x, uint32_t m, float a, uint16_t h0,
                              __m256 lo, __m256 hi)
{
    const float d0 = _cvtsh_ss(h0);
    const __m256 grow = _mm256_setr_ps(1.0f, 1.0f + 1.0f / 64, 1.0f + 2.0f / 64,
                                       1.0f + 3.0f / 64, 1.0f + 4.0f / 64, 1.0f + 5.0f / 64,
                                       1.0f + 6.0f / 64, 1.0f + 7.0f / 64);
    const __m256 v = _mm256_mul_ps(_mm256_set1_ps(d0 < 0.0f ? -d0 : d0), grow);
    const __m128i mag = _mm_and_si128(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT |
                                                             _MM_FROUND_NO_EXC),
                                      _mm_set1_epi16(0x7fff));
    const __m128i past = _mm_cmpgt_epi16(mag, _mm_set1_epi16(0x7bff)); /* mag <= 0x7c00 */
    const __m128i hk = _mm_blendv_epi8(_mm_or_si128(mag, _mm_set1_epi16((short)(h0 & 0x8000u))),
                                       _mm_set1_epi16((short)h0), past);
    const __m256 d = _mm256_cvtph_ps(hk);
    /* Q8 (d > 0, every lane at least d_0): |x / d| <= a / d_0 for every value and lane,
     * and division rounds monotonically, so when a / d_0 < 127.5 each quotient rounds
     * to a code within [-127, 127] whether clamped or not; the clamp changes nothing
     * then and is skipped. (Q4's scale lets the other sign reach 7.5: it clamps.) */
    const __m256 e = t == PKV_Q8 && a / d0 < 127.5f ? qs_err(x, m, d, lo, hi, false)
                                                    : qs_err(x, m, d, lo, hi, true);
    /* the first lane of the least error: e holds no NaN (x and d are finite, d != 0) */
    const __m256 least = _mm256_set1_ps(qs_hmin(e));
    const unsigned best = (unsigned)__builtin_ctz((unsigned)_mm256_movemask_ps(
        _mm256_cmp_ps(e, least, _CMP_EQ_OQ)));
    uint16_t lanes[8];
    _mm_storeu_si128((void *)lanes, hk);
    return lanes[best];
}

/* One block of m (1..32) values at dst, as quant.c's store_block writes it. */
PKVI_INLINE void qs_store_block(pkv_dtype t, unsigned char *dst, const float *src, uint32_t m)
{
    _Alignas(32) float pad[32];
    const float *x = src;
    if (m < 32) { /* zeros past m: they change no maximum, no sign test, no error sum */
        memset(pad, 0, sizeof pad);
        memcpy(pad, src, (size_t)m * sizeof(float));
        x = pad;
    }
    const __m256 absm = QB_ABSM, fmax = QB_FMAX;
    __m256 v[4], mx = _mm256_setzero_ps();
    int fin = 1;
    PKVI_UNROLL
    for (int u = 0; u < 4; u++) {
        v[u] = _mm256_loadu_ps(x + 8 * u);
        qb_scan(v[u], absm, fmax, &mx, &fin);
    }
    const size_t nq = pkvi_quant_row_bytes(t, m) - 2; /* code bytes: one block of m */
    const float a = fin ? qb_hmax(mx) : 0.0f;
    if (!fin || a == 0.0f) {
        /* NaN scale (the block reads back as NaN), or a zero block: d = 0; q = 0 */
        const uint16_t h = fin ? 0 : 0x7e00u;
        memcpy(dst, &h, sizeof h);
        memset(dst + 2, t == PKV_Q8 ? 0 : 0x88, nq);
        if (t == PKV_Q4 && m % 2)
            dst[2 + m / 2] = 0x08;
        return;
    }
    /* the sign of the first value of magnitude a; the largest magnitude b of the other
     * sign's values (their sign bit differs from neg's: xor, then an arithmetic shift) */
    const __m256 av = _mm256_set1_ps(a);
    uint32_t at = 0;
    PKVI_UNROLL
    for (int u = 0; u < 4; u++)
        at |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v[u], absm), av,
                                                         _CMP_EQ_OQ)) << (8 * u);
    const bool neg = x[__builtin_ctz(at)] < 0.0f;
    const __m256i nb = _mm256_set1_epi32(neg ? (int)0x80000000u : 0);
    __m256 bv = _mm256_setzero_ps();
    PKVI_UNROLL
    for (int u = 0; u < 4; u++) {
        const __m256i s = _mm256_srai_epi32(_mm256_xor_si256(_mm256_castps_si256(v[u]), nb), 31);
        bv = _mm256_max_ps(bv, _mm256_and_ps(_mm256_and_ps(v[u], absm), _mm256_castsi256_ps(s)));
    }
    const uint16_t h0 = pkvi_quant_first_scale(t, a, qb_hmax(bv), neg);
    const __m256 lo = _mm256_set1_ps(t == PKV_Q8 ? -127.0f : -8.0f);
    const __m256 hi = _mm256_set1_ps(t == PKV_Q8 ? 127.0f : 7.0f);
    const uint16_t h = qs_search(t, x, m, a, h0, lo, hi);
    memcpy(dst, &h, sizeof h);
    const __m256 dv = _mm256_set1_ps(_cvtsh_ss(h));
    __m256i c[4];
    PKVI_UNROLL
    for (int u = 0; u < 4; u++)
        c[u] = _mm256_cvtps_epi32(qs_code(_mm256_div_ps(v[u], dv), lo, hi)); /* exact */
    const __m256i p = qb_pack_i8(c); /* bytes in value order */
    _Alignas(32) unsigned char q[32];
    if (t == PKV_Q8) {
        _mm256_store_si256((void *)q, p);
    } else {
        /* codes + 8 in 0..15; byte i = value 2i | value 2i+1 << 4 */
        const __m256i w = _mm256_add_epi8(p, _mm256_set1_epi8(8));
        const __m256i r = _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi16(0x000f)),
                                          _mm256_and_si256(_mm256_srli_epi16(w, 4),
                                                           _mm256_set1_epi16(0x00f0)));
        const __m256i k = _mm256_permute4x64_epi64(_mm256_packus_epi16(r, r), 0x08);
        _mm_store_si128((void *)q, _mm256_castsi256_si128(k));
        if (m % 2) /* an odd block's last high nibble is 0 */
            q[m / 2] &= 0x0f;
    }
    memcpy(dst + 2, q, nq);
}

/* pkvi_quant_store_row: n values as blocks of 32, the last possibly shorter. */
PKVI_INLINE void qs_store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    unsigned char *p = dst;
    for (uint32_t i = 0; i < n; i += 32) {
        const uint32_t m = n - i < 32 ? n - i : 32;
        qs_store_block(t, p, src + i, m);
        p += pkvi_quant_row_bytes(t, m);
    }
}

#endif /* PKV_KERNELS_QSTORE256_H */

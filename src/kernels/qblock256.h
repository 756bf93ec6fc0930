/*
 * kernels/qblock256.h - the steps of quantizing one block of 32 floats that are the
 * same wherever a block is quantized in 256-bit vectors, written once: the scan of the
 * block (its largest magnitude, and whether every value is finite), the horizontal
 * maximum, and the int32 -> int8 pack in value order. Two callers: qdot256.h's
 * qd_quant_query (each head's q on the integer-dot path, every decode call) and
 * qstore256.h's qs_store_block (K/V rows, on append and prefill). Included by those
 * two headers; no state, no allocation.
 */
#ifndef PKV_KERNELS_QBLOCK256_H
#define PKV_KERNELS_QBLOCK256_H

#include "kernels/kernels.h"

#include <immintrin.h>

/* The two constants of qb_scan: the caller makes them once, outside its loop over
 * blocks. */
#define QB_ABSM _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)) /* |x| by a mask */
#define QB_FMAX _mm256_set1_ps(3.40282347e+38f)                     /* largest finite */

/* One step of a block's scan, for each of its 4 vectors v as it is loaded: *mx keeps the
 * largest |v| so far (NaN and infinite lanes included: the caller looks at *fin first),
 * and *fin is cleared by a lane that is not finite, so a NaN or an infinity anywhere in
 * the block is caught. Start with *mx = 0 and *fin = 1. One step a vector, inside the
 * callers' load loops. */
PKVI_INLINE void qb_scan(__m256 v, __m256 absm, __m256 fmax, __m256 *mx, int *fin)
{
    const __m256 a = _mm256_and_ps(v, absm);
    *fin &= _mm256_movemask_ps(_mm256_cmp_ps(a, fmax, _CMP_LE_OQ)) == 0xff;
    *mx = _mm256_max_ps(*mx, a);
}

/* The largest of 8 lanes (no NaN among them). */
PKVI_INLINE float qb_hmax(__m256 v)
{
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* 32 int32 codes (values 8u .. 8u + 7 in c[u]), each within [-128, 127], as 32 bytes in
 * value order: the two signed-saturating packs interleave 128-bit lanes, and the
 * dword permutation undoes it. */
PKVI_INLINE __m256i qb_pack_i8(const __m256i c[4])
{
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                         _mm256_packs_epi32(c[2], c[3]));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#endif /* PKV_KERNELS_QBLOCK256_H */

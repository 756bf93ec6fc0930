/*
 * kernels/qdot256.h - the integer-dot scores of quant_dot = 1 in 256-bit vectors
 * (AVX2 instructions; avx512.c compiles them too, with its own flags): qk_heads_int,
 * the function walk.h calls for PKVI_WALK_QUANT_DOT. Included by avx2.c and avx512.c
 * after they define AI and PF_HINT. ref.c is the definition.
 */
#ifndef PKV_KERNELS_QDOT256_H
#define PKV_KERNELS_QDOT256_H

#include "quant.h"

#include <immintrin.h>
#include <string.h>

/* lane i of the result = sum of the 8 lanes of v[i]; fixed order (avx2.c's hsum8) */
AI __m256 qd_hsum8(const __m256 v[8])
{
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* ---- QK of the integer-dot path (quant_dot = 1; ref.c is its definition) -----------
 * A K block's 32 integers as int8 (Q8 as stored; Q4 as nibble - 8, low nibbles then
 * high, the order walk.h's qd_permute gives q), and q's block: vpmaddubsw(|k|,
 * sign(q, k)) multiplies the pairs exactly (|k| <= 128, |q| <= 127: a pair sums to at
 * most 32512, no saturation), vpmaddwd by ones adds them into 8 int32 lanes, exact.
 * Each lane, converted (exactly: < 2^24) and times dk * dq, is summed with fused
 * multiply-adds across blocks; the 8 lanes in a fixed tree (qd_hsum8). So a score differs
 * from ref.c's only by the order of the f32 additions of its block terms. */
AI __m256i kblock_i8(pkv_dtype dt, const char *blk)
{
    if (dt == PKV_Q8)
        return _mm256_loadu_si256((const void *)(blk + 2));
    const __m128i x = _mm_loadu_si128((const void *)(blk + 2));
    const __m256i w = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
    return _mm256_sub_epi8(_mm256_and_si256(w, _mm256_set1_epi8(15)), _mm256_set1_epi8(8));
}

/* The last block of m < 32 values: its bytes copied into a zeroed block first (rows
 * end there: nothing past them is read). q is 0 past m, so what the copy leaves in
 * those lanes adds 0. */
AI __m256i kblock_i8_tail(pkv_dtype dt, const char *blk, uint32_t m)
{
    _Alignas(32) char tmp[34] = {0};
    memcpy(tmp, blk, 2 + (dt == PKV_Q8 ? m : (m + 1) / 2));
    return kblock_i8(dt, tmp);
}

AI float kblock_scale(const char *blk)
{
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    return _cvtsh_ss(h);
}

/* Integer-dot scores of HB heads (qi rows dpad apart, qs rows nb apart) with TB
 * consecutive K rows; writes s[h * PKVI_TILE + t]. HB * TB <= 8. */
AI void qk_block_int(pkv_dtype dt, const char *krow, uint32_t d, const int8_t *qi,
                     const float *qs, size_t dpad, uint32_t nb, float *s, const char *pf,
                     size_t row_bytes, const int HB, const int TB)
{
    if (pf)
        for (size_t off = 0; off < TB * row_bytes; off += 64)
            _mm_prefetch(pf + off, PF_HINT);
    const size_t bb = pkvi_quant_block_bytes(dt);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a[8];
    #pragma GCC unroll 16
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_ps();
    for (uint32_t b = 0; b < nb; b++) {
        const bool full = (b + 1) * 32 <= d;
        #pragma GCC unroll 16
        for (int t = 0; t < TB; t++) {
            const char *blk = krow + t * row_bytes + b * bb;
            const __m256i k = full ? kblock_i8(dt, blk) : kblock_i8_tail(dt, blk, d - b * 32);
            const __m256i ka = _mm256_abs_epi8(k);
            const __m256 dk = _mm256_set1_ps(kblock_scale(blk));
            #pragma GCC unroll 16
            for (int h = 0; h < HB; h++) {
                const __m256i qv = _mm256_load_si256((const void *)(qi + h * dpad + b * 32));
                const __m256i pr = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(ka, _mm256_sign_epi8(qv, k)), ones);
                a[h * TB + t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pr),
                                                _mm256_mul_ps(dk, _mm256_broadcast_ss(
                                                                      qs + h * nb + b)),
                                                a[h * TB + t]);
            }
        }
    }
    _Alignas(32) float r[8];
    _mm256_store_ps(r, qd_hsum8(a));
    #pragma GCC unroll 16
    for (int h = 0; h < HB; h++)
        #pragma GCC unroll 16
        for (int t = 0; t < TB; t++)
            s[h * PKVI_TILE + t] = r[h * TB + t];
}

AI void qk_heads_int(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t d,
                     uint32_t n, const int8_t *qi, const float *qs, size_t dpad, uint32_t nb,
                     float *s, const char *pf, const int HB)
{
    const int TB = 8 / HB;
    uint32_t t = 0;
    for (; t + (uint32_t)TB <= n; t += (uint32_t)TB)
        qk_block_int(dt, krow + t * row_bytes, d, qi, qs, dpad, nb, s + t,
                     pf ? pf + t * row_bytes : NULL, row_bytes, HB, TB);
    for (; t < n; t++)
        qk_block_int(dt, krow + t * row_bytes, d, qi, qs, dpad, nb, s + t,
                     pf ? pf + t * row_bytes : NULL, row_bytes, HB, 1);
}

#endif

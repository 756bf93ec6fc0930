/*
 * kernels/avx512_qk.h - the AVX-512 kernels' QK step from f32 q (the exact path):
 * unscaled dots of HB heads with TB tokens' K rows, HB * TB == 16 accumulators reduced
 * by one 16-way tree (hsum16); each K row chunk is loaded and widened once for the HB
 * heads. Q8/Q4 rows a whole block at a time where the row has one (each row's scale
 * read once per block), else by ldq/ldqm. For avx512.c, and avx512vnni.c's scores of
 * heads its limbs cannot hold. No state.
 */
#ifndef PKV_KERNELS_AVX512_QK_H
#define PKV_KERNELS_AVX512_QK_H

#include "kernels/kernels.h"
#include "kernels/avx512_load.h"
#include "kernels/avx512_math.h" /* hsum16 */
#include "kernels/walk.h"
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>

/* ---- QK ------------------------------------------------------------------------------
 * Unscaled dots of HB heads (q rows qh, stride d) with TB consecutive K rows (krow);
 * writes s[h * PKVI_TILE + t]. HB * TB <= 16. */
PKVI_INLINE void qk_block(pkv_dtype dt, const void *krow, uint32_t d, const float *qh, float *s,
                          const char *pf, const bool l2, size_t row_bytes, const float *ksc, const int HB,
                          const int TB)
{
    if (pf)
        for (size_t off = 0; off < TB * row_bytes; off += 64)
            pf_line(pf + off, l2);
    __m512 a[16];
    PKVI_UNROLL
    for (int i = 0; i < 16; i++)
        a[i] = _mm512_setzero_ps();
    uint32_t c = 0;
    if (qtype(dt)) /* whole blocks: each row's scale read and broadcast once per block */
        for (; c + 32 <= d; c += 32)
            PKVI_UNROLL
            for (int t = 0; t < TB; t++) {
                const char *blk = qblock(dt, (const char *)krow + t * row_bytes, c);
                const __m512 sc = _mm512_set1_ps(ksc[(c / 32) * PKVI_TILE + (uint32_t)t]);
                __m512 kv[2];
                ldq32_raw(dt, blk, kv);
                PKVI_UNROLL
                for (int u = 0; u < 2; u++) {
                    const __m512 k = _mm512_mul_ps(sc, kv[u]); /* ldq's values */
                    PKVI_UNROLL
                    for (int h = 0; h < HB; h++)
                        a[h * TB + t] = _mm512_fmadd_ps(
                            _mm512_loadu_ps(qh + (size_t)h * d + c + 16 * u), k, a[h * TB + t]);
                }
            }
    for (; c + 16 <= d; c += 16) {
        __m512 qv[4];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            qv[h] = _mm512_loadu_ps(qh + (size_t)h * d + c);
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const __m512 kv = qtype(dt) ? ldq(dt, (const char *)krow + t * row_bytes, c)
                                        : ld(dt, krow, (size_t)t * d + c);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h * TB + t] = _mm512_fmadd_ps(qv[h], kv, a[h * TB + t]);
        }
    }
    if (c < d) {
        const __mmask16 k = (__mmask16)((1u << (d - c)) - 1u);
        __m512 qv[4];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            qv[h] = _mm512_maskz_loadu_ps(k, qh + (size_t)h * d + c);
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const __m512 kv = qtype(dt) ? ldqm(dt, (const char *)krow + t * row_bytes, c, d - c)
                                        : ldm(dt, krow, (size_t)t * d + c, k);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h * TB + t] = _mm512_fmadd_ps(qv[h], kv, a[h * TB + t]);
        }
    }
    const __m512 r = hsum16(a);
    /* lanes [h*TB, h*TB + TB) belong to head h: a masked store at an offset base */
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        _mm512_mask_storeu_ps(s + h * (PKVI_TILE - TB),
                              (__mmask16)(((1u << TB) - 1u) << (h * TB)), r);
}

/* ksc[b * 16 + t]: the scale of whole block b of K row t, for the n rows of a tile */
PKVI_INLINE void ksc_load(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t n, uint32_t d,
                          float *ksc)
{
    for (uint32_t b = 0; (b + 1) * 32 <= d; b++)
        _mm512_store_ps(ksc + b * PKVI_TILE,
                        block_scales16(krow + b * pkvi_quant_block_bytes(dt), row_bytes, n));
}

/* Scores of n tokens for HB heads: blocks of TB tokens, then one token at a time. */
PKVI_INLINE void qk_heads(pkv_dtype dt, const void *krow, size_t row_bytes, uint32_t d,
                          uint32_t n, const float *qh, float *s, const char *pf, const bool l2,
                          const int HB)
{
    const int TB = 16 / HB;
    _Alignas(64) float ksc[PKVI_MAX_HEAD_DIM / 32 * PKVI_TILE]; /* Q8/Q4: ksc_load */
    if (qtype(dt))
        ksc_load(dt, krow, row_bytes, n, d, ksc);
    uint32_t t = 0;
    for (; t + (uint32_t)TB <= n; t += (uint32_t)TB)
        qk_block(dt, (const char *)krow + t * row_bytes, d, qh, s + t,
                 pf ? pf + t * row_bytes : NULL, l2, row_bytes, ksc + t, HB, TB);
    for (; t < n; t++)
        qk_block(dt, (const char *)krow + t * row_bytes, d, qh, s + t,
                 pf ? pf + t * row_bytes : NULL, l2, row_bytes, ksc + t, HB, 1);
}

/* Scores of n tokens for hg heads (q [hg][d]) into s [hg][PKVI_TILE]: heads in blocks of
 * 4, 2, 1; only the first block prefetches (pf: the same rows for all). */
PKVI_INLINE void qk_groups(pkv_dtype dt, const void *krow, size_t row_bytes, uint32_t d,
                           uint32_t n, const float *q, uint32_t hg, float *s, const char *pf,
                           const bool l2)
{
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4, pf = NULL)
        qk_heads(dt, krow, row_bytes, d, n, q + (size_t)h * d, s + h * PKVI_TILE, pf, l2, 4);
    if (hg - h >= 2) {
        qk_heads(dt, krow, row_bytes, d, n, q + (size_t)h * d, s + h * PKVI_TILE, pf, l2, 2);
        h += 2;
        pf = NULL;
    }
    if (h < hg)
        qk_heads(dt, krow, row_bytes, d, n, q + (size_t)h * d, s + h * PKVI_TILE, pf, l2, 1);
}

#endif /* PKV_KERNELS_AVX512_QK_H */

/*
 * kernels/avx512_load.h - the AVX-512 kernels' loads: 16 values of a stored row
 * widened to f32 for every dtype, masked for the d tail (nothing past a row is read),
 * and the Q8/Q4 blocks - dequantized by their f16 scale (exact: bitwise the values of
 * quant.c's loads), a whole block at a time in ldq32_raw's order (Q4 permuted, which
 * q_permute gives q too), and a tile's block scales in one vector. For avx512.c and
 * avx512vnni.c (-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c). No state.
 */
#ifndef PKV_KERNELS_AVX512_LOAD_H
#define PKV_KERNELS_AVX512_LOAD_H

#include "kernels/kernels.h"
#include "kernels/qscales.h"
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

/* ---- loads: 16 values of the page's dtype from element i of row base, as f32 ----- */

PKVI_INLINE __m512 ld(pkv_dtype dt, const void *base, size_t i)
{
    if (dt == PKV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const void *)((const uint16_t *)base + i)));
    if (dt == PKV_BF16) {
        __m256i h = _mm256_loadu_si256((const void *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

/* Same, only lanes of k are read (others 0): the d tail. */
PKVI_INLINE __m512 ldm(pkv_dtype dt, const void *base, size_t i, __mmask16 k)
{
    if (dt == PKV_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)base + i));
    if (dt == PKV_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)base + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)base + i);
}

/* ---- loads of the block types (Q8, Q4; the format is quant.c's) ------------------
 * 16 values from element c (c % 16 == 0) never straddle a block of 32. Dequantized as
 * d * q in f32, exact: bitwise the values quant.c's loads (and avx2.c's) give. */
PKVI_INLINE const char *qblock(pkv_dtype dt, const char *row, uint32_t c)
{
    return row + (size_t)(c / 32) * pkvi_quant_block_bytes(dt);
}

PKVI_INLINE float qscale(const char *blk)
{
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    return _cvtsh_ss(h);
}

PKVI_INLINE __m512 ldq(pkv_dtype dt, const char *row, uint32_t c)
{
    const char *blk = qblock(dt, row, c);
    __m512i v;
    if (dt == PKV_Q8) {
        v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(blk + 2 + c % 32)));
    } else { /* 8 bytes, 16 nibbles: low then high of each byte, in order */
        const __m128i x = _mm_loadl_epi64((const void *)(blk + 2 + (c % 32) / 2));
        const __m128i m = _mm_set1_epi8(15);
        const __m128i b = _mm_unpacklo_epi8(_mm_and_si128(x, m),
                                            _mm_and_si128(_mm_srli_epi16(x, 4), m));
        v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(8));
    }
    return _mm512_mul_ps(_mm512_set1_ps(qscale(blk)), _mm512_cvtepi32_ps(v));
}

/* The 32 integers of a whole block (blk: its scale, then its values) as f32: Q8 as
 * stored, in row order; Q4 nibble - 8 in the block's *permuted* order, values 0, 2, ..,
 * 30 in v[0] and 1, 3, .., 31 in v[1] (its 16 bytes widened once, then the low and the
 * high nibbles looked up: 4 operations where row order took 11 - two byte interleaves
 * and a second widening more), so QK reads q permuted the same way (q_permute) and PV keeps
 * the block's accumulators in that order while it adds (pv_block). Exact: times the
 * block's scale they are ldq's values bit for bit. */
PKVI_INLINE void ldq32_raw(pkv_dtype dt, const char *blk, __m512 v[2])
{
    if (dt == PKV_Q8) {
        v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(blk + 2))));
        v[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(blk + 18))));
        return;
    }
    /* nibble -> nibble - 8 in f32 by table: vpermps reads only the low 4 bits of
     * each index lane, so the low nibble needs no mask and neither needs a subtract
     * or a conversion (4 operations per block where 7 were) */
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i y = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(blk + 2)));
    v[0] = _mm512_permutexvar_ps(y, lut);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(y, 4), lut);
}

/* q in the order the exact Q4 QK reads it (walk.h attend_prep; dst != src): each whole
 * block of 32 as [values 0, 2, .., 30 | 1, 3, .., 31] (ldq32_raw's order), the rest of
 * the row (a shorter last block, read by ldq/ldqm) as it is. */
PKVI_INLINE void q_permute(const pkv_dtype dt, const float *src, float *dst, uint32_t d)
{
    uint32_t c = 0;
    if (dt == PKV_Q4)
        for (; c + 32 <= d; c += 32)
            for (uint32_t j = 0; j < 16; j++) {
                dst[c + j] = src[c + 2 * j];
                dst[c + 16 + j] = src[c + 2 * j + 1];
            }
    memcpy(dst + c, src + c, (size_t)(d - c) * sizeof(float));
}

/* The first rem (1..15) values from element c, the other lanes 0. */
PKVI_INLINE __m512 ldqm(pkv_dtype dt, const char *row, uint32_t c, uint32_t rem)
{
    const char *blk = qblock(dt, row, c);
    const float d = qscale(blk);
    _Alignas(64) float tmp[16] = {0};
    for (uint32_t j = 0; j < rem; j++)
        tmp[j] = d * (float)pkvi_quant_block_int(dt, (const unsigned char *)blk, c % 32 + j);
    return _mm512_load_ps(tmp);
}

/* The f16 scales of one whole block of a tile's n (<= 16) rows, widened (lane t: row
 * t's; 0 past n, whose rows are never read): four 64-bit words of qscales.h moved into
 * one vector (docs/performance.md, decision table: qscales). Lanes 0-3 rows a .. a+3,
 * 4-7 rows b.., 8-11 rows c.., 12-15 rows e.. */
PKVI_INLINE __m512 block_scales16_of(const char *blk0, size_t row_bytes, uint32_t n, uint32_t a,
                                     uint32_t b, uint32_t c, uint32_t e)
{
    return _mm512_cvtph_ps(_mm256_set_m128i(block_scales8(blk0, row_bytes, n, c, e),
                                            block_scales8(blk0, row_bytes, n, a, b)));
}

PKVI_INLINE __m512 block_scales16(const char *blk0, size_t row_bytes, uint32_t n)
{
    return block_scales16_of(blk0, row_bytes, n, 0, 4, 8, 12);
}

/* ---- a tile's rows widened once: many heads a group ----------------------------------
 * A call with many heads a group (verify's drafts, prefill's stacked queries, a shared
 * batch's sessions) reads each K and V row once per block of 4 heads; from f16 or bf16
 * pages every read widened the row again, 4 conversions for 16 multiply-adds. From
 * WIDEN_MIN_HEADS heads on, the QK step widens the tile's K rows into an f32 scratch
 * once and reads that: the values are exact, so the products and every bit after them
 * are those of the narrow reads (tests/test_kernels.c, wide_stacked_heads;
 * docs/performance.md, decision table: WIDEN_MIN_HEADS). */
#define WIDEN_MIN_HEADS 12u
/* Widest row widened (the scratch holds PKVI_TILE rows of it). */
#define WIDEN_MAX_DIM 256u

/* Whether a tile of dtype dt, d values a row, hg heads reads its rows widened. */
PKVI_INLINE bool widen_tile(const pkv_dtype dt, uint32_t d, uint32_t hg)
{
    return (dt == PKV_F16 || dt == PKV_BF16) && hg >= WIDEN_MIN_HEADS && d <= WIDEN_MAX_DIM;
}

/* n rows of dt (f16 or bf16, d values each, from `rows`) widened into wf [n][d]; with pf,
 * the same bytes of the unit ahead are prefetched (into L2 with l2) as they go. */
PKVI_INLINE void widen_rows(const pkv_dtype dt, const void *rows, uint32_t d, uint32_t n,
                            float *wf, const char *pf, const bool l2)
{
    const __mmask16 tk = (__mmask16)((1u << (d % 16)) - 1u);
    for (size_t off = 0; pf && off < (size_t)n * d * 2; off += 64)
        if (l2) /* as walk.h's pf_line */
            __builtin_prefetch(pf + off, 0, 2);
        else
            __builtin_prefetch(pf + off, 0, 3);
    if (d % 16 == 0) { /* the rows are contiguous: one run of whole vectors */
        for (size_t i = 0; i < (size_t)n * d; i += 16)
            _mm512_storeu_ps(wf + i, ld(dt, rows, i));
        return;
    }
    for (uint32_t t = 0; t < n; t++) { /* row by row, the tail masked */
        const size_t r = (size_t)t * d;
        uint32_t c = 0;
        for (; c + 16 <= d; c += 16)
            _mm512_storeu_ps(wf + r + c, ld(dt, rows, r + c));
        _mm512_mask_storeu_ps(wf + r + c, tk, ldm(dt, rows, r + c, tk));
    }
}

#endif /* PKV_KERNELS_AVX512_LOAD_H */

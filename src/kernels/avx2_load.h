/*
 * kernels/avx2_load.h - the AVX2 kernels' loads: 8 (or 16) values of a stored row
 * widened to f32, for every dtype (f32, f16, bf16, and the Q8/Q4 blocks dequantized by
 * their f16 scale: exact, so bitwise the values of dtype.c's and quant.c's loads), the
 * d tail (d % 8) without reading past a row, and the lane order of bf16's 16-value
 * loads (q_permute puts q in it). For avx2.c and avx2vnni.c (-mavx2 -mfma -mf16c). No
 * state.
 */
#ifndef PKV_KERNELS_AVX2_LOAD_H
#define PKV_KERNELS_AVX2_LOAD_H

#include "kernels/kernels.h"
#include "kernels/qscales.h"
#include "kernels/walk.h"
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

/* ---- loads: 8 values of the page's dtype from element i of row base, as f32 ------ */

PKVI_INLINE __m256 widen(pkv_dtype dt, __m128i h)
{
    if (dt == PKV_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

PKVI_INLINE __m256 ld(pkv_dtype dt, const void *base, size_t i)
{
    if (dt == PKV_F32)
        return _mm256_loadu_ps((const float *)base + i);
    return widen(dt, _mm_loadu_si128((const void *)((const uint16_t *)base + i)));
}

/* Lanes [0, rem) for rem in 1..7 */
PKVI_INLINE __m256i tail_mask(uint32_t rem)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The first rem (1..7) values from element i, the other lanes 0. */
PKVI_INLINE __m256 ldt(pkv_dtype dt, const void *base, size_t i, uint32_t rem)
{
    if (dt == PKV_F32)
        return _mm256_maskload_ps((const float *)base + i, tail_mask(rem));
    uint16_t tmp[8] = {0};
    memcpy(tmp, (const uint16_t *)base + i, rem * sizeof(uint16_t));
    return widen(dt, _mm_loadu_si128((const void *)tmp));
}

/* ---- bf16, 16 values at a time ------------------------------------------------------
 * Interleaving 16 bf16 values with zeros (vpunpcklwd/vpunpckhwd, within each 128-bit
 * half) gives their f32 values exactly, in one operation per 8 (where vpmovzxwd +
 * vpslld are two that compete with the FMAs), but in the order
 * [0..3, 8..11] and [4..7, 12..15]. So the walk hands QK a q permuted the same way
 * (q_permute), and PV loads and stores its accumulators in that order (acc_ld16). A
 * d tail (d % 16) stays in row order. */
PKVI_INLINE void ld16_bf16(const void *base, size_t i, __m256 v[2])
{
    const __m256i x = _mm256_loadu_si256((const void *)((const uint16_t *)base + i));
    v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
    v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
}

/* The f32 values of ld16_bf16's lane order: u = 0 gives [p0..3, p8..11], u = 1
 * [p4..7, p12..15]. */
PKVI_INLINE __m256 acc_ld16(const float *p, int u)
{
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + 4 * u)),
                                _mm_loadu_ps(p + 8 + 4 * u), 1);
}

PKVI_INLINE void acc_st16(float *p, int u, __m256 a)
{
    _mm_storeu_ps(p + 4 * u, _mm256_castps256_ps128(a));
    _mm_storeu_ps(p + 8 + 4 * u, _mm256_extractf128_ps(a, 1));
}

/* bf16's QK reads q in that order (walk.h prepares it with q_permute; dst != src) */
PKVI_INLINE void q_permute(const pkv_dtype dt, const float *src, float *dst, uint32_t d)
{
    (void)dt; /* bf16 only */
    uint32_t c = 0;
    for (; c + 16 <= d; c += 16)
        for (int u = 0; u < 2; u++) {
            memcpy(dst + c + 8 * u, src + c + 4 * u, 4 * sizeof(float));
            memcpy(dst + c + 8 * u + 4, src + c + 8 + 4 * u, 4 * sizeof(float));
        }
    memcpy(dst + c, src + c, (size_t)(d - c) * sizeof(float));
}

/* ---- loads of the block types (Q8, Q4; the format is quant.c's) ------------------
 * A row is blocks of 32 values, each an f16 scale then its integers; 8 values from
 * element c (c % 8 == 0) never straddle a block. Dequantized as d * q in f32, exact,
 * so these are bitwise the values quant.c's loads give. */
PKVI_INLINE const char *qblock(pkv_dtype dt, const char *row, uint32_t c)
{
    return row + (size_t)(c / 32) * (dt == PKV_Q8 ? 34u : 18u);
}

PKVI_INLINE __m256 qscale8(const char *blk)
{
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    return _mm256_set1_ps(_cvtsh_ss(h));
}

/* The 8 integers of a block from element c, as f32 (exact), unscaled. */
PKVI_INLINE __m256 ldq_raw(pkv_dtype dt, const char *row, uint32_t c)
{
    const char *blk = qblock(dt, row, c);
    __m256i v;
    if (dt == PKV_Q8) {
        v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(blk + 2 + c % 32)));
    } else {
        uint32_t w;
        memcpy(&w, blk + 2 + (c % 32) / 2, sizeof w);
        const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)w),
                                           _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1,
                                                         -1, -1, -1, -1, -1));
        v = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(b), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
        v = _mm256_sub_epi32(_mm256_and_si256(v, _mm256_set1_epi32(15)), _mm256_set1_epi32(8));
    }
    return _mm256_cvtepi32_ps(v);
}


/* 8 values from element c: the block's scale times its integers. */
PKVI_INLINE __m256 ldq(pkv_dtype dt, const char *row, uint32_t c)
{
    return _mm256_mul_ps(qscale8(qblock(dt, row, c)), ldq_raw(dt, row, c));
}

/* 16 integers of a block from element c (c % 16 == 0) into v[0], v[1], unscaled (exact
 * in f32): Q4's 8 bytes unpacked once; for PV with the block's scale folded into the
 * weights. */
PKVI_INLINE void ldq16_raw(pkv_dtype dt, const char *row, uint32_t c, __m256 v[2])
{
    const char *blk = qblock(dt, row, c);
    __m128i b;
    if (dt == PKV_Q8) {
        b = _mm_loadu_si128((const void *)(blk + 2 + c % 32));
    } else {
        const __m128i x = _mm_loadl_epi64((const void *)(blk + 2 + (c % 32) / 2));
        const __m128i m = _mm_set1_epi8(15);
        b = _mm_sub_epi8(_mm_unpacklo_epi8(_mm_and_si128(x, m),
                                           _mm_and_si128(_mm_srli_epi16(x, 4), m)),
                         _mm_set1_epi8(8));
    }
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
}

/* 16 values from element c (c % 16 == 0: one block) into v[0], v[1]: ldq16_raw times
 * the block's scale, read once; the same values as two ldq. */
PKVI_INLINE void ldq16(pkv_dtype dt, const char *row, uint32_t c, __m256 v[2])
{
    ldq16_raw(dt, row, c, v);
    const __m256 d = qscale8(qblock(dt, row, c));
    v[0] = _mm256_mul_ps(d, v[0]);
    v[1] = _mm256_mul_ps(d, v[1]);
}

/* The first rem (1..7) values from element c, the other lanes 0. */
PKVI_INLINE __m256 ldqt(pkv_dtype dt, const char *row, uint32_t c, uint32_t rem)
{
    const char *blk = qblock(dt, row, c);
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    const float d = _cvtsh_ss(h);
    _Alignas(32) float tmp[8] = {0};
    for (uint32_t j = 0; j < rem; j++) {
        const uint32_t i = c % 32 + j;
        const int q = dt == PKV_Q8 ? (int)(signed char)blk[2 + i]
                                   : (int)(((unsigned char)blk[2 + i / 2] >> (4 * (i % 2))) & 15u) - 8;
        tmp[j] = d * (float)q;
    }
    return _mm256_load_ps(tmp);
}

/* ---- a tile's rows widened once: many heads a group ----------------------------------
 * As avx512_load.h's widen_rows: from WIDEN_MIN_HEADS heads a group the QK widens the
 * tile's f16 K rows into an f32 scratch once instead of once per block of heads (exact
 * values, the same products and bits). bf16 keeps its own reads: its 16-value loads
 * come in ld16_bf16's lane order, which the f32 path does not share. */
#define WIDEN_MIN_HEADS 12u
#define WIDEN_MAX_DIM 256u

PKVI_INLINE bool widen_tile(const pkv_dtype dt, uint32_t d, uint32_t hg)
{
    return dt == PKV_F16 && hg >= WIDEN_MIN_HEADS && d <= WIDEN_MAX_DIM;
}

/* n f16 rows of d values (from `rows`) widened into wf [n][d]; with pf, the same bytes
 * of the unit ahead are prefetched as they go. */
PKVI_INLINE void widen_rows(const void *rows, uint32_t d, uint32_t n, float *wf, const char *pf,
                            const bool l2)
{
    for (size_t off = 0; pf && off < (size_t)n * d * 2; off += 64)
        pf_line(pf + off, l2);
    for (uint32_t t = 0; t < n; t++) {
        const size_t r = (size_t)t * d;
        uint32_t c = 0;
        for (; c + 8 <= d; c += 8)
            _mm256_storeu_ps(wf + r + c, ld(PKV_F16, rows, r + c));
        if (c < d) /* only the row's own lanes: the next row follows */
            _mm256_maskstore_ps(wf + r + c, tail_mask(d - c), ldt(PKV_F16, rows, r + c, d - c));
    }
}

#endif /* PKV_KERNELS_AVX2_LOAD_H */

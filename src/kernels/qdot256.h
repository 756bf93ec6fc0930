/*
 * kernels/qdot256.h - the integer-dot scores of quant_dot = 1 in 256-bit vectors (AVX2
 * instructions; the AVX-512 files compile them too, with their own flags):
 * qk_heads_int, and q's quantization (qd_quant_query). ref.c is the definition. A file
 * with wider vectors passes qk_heads_int a function that scores a row's leading pairs
 * of whole blocks first (avx512.c, avx512vnni.c: qd_wide_blocks). No state.
 */
#ifndef PKV_KERNELS_QDOT256_H
#define PKV_KERNELS_QDOT256_H

#include "kernels/kernels.h"
#include "kernels/qblock256.h"
#include "kernels/walk.h" /* pf_line */
#include "base/quant.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

/* ---- QK of the integer-dot path (quant_dot = 1; ref.c is its definition) -----------
 * A K block's 32 integers as vpmaddubsw's first (unsigned) operand, and q's block as
 * its second: for Q8, |k| with q carrying k's sign (|k| <= 128, |q| <= 127: a pair
 * sums to at most 32512, no saturation); for Q4, the nibbles as stored, k + 8 in 0..15
 * (low nibbles, then high: the order walk.h's qd_permute gives q), times q itself (a
 * pair sums to at most 2 * 15 * 127 = 3810), and qd_lane_bias's 8 * sum(q) comes off
 * the sum afterwards. vpmaddwd by ones adds the pairs into 8 int32 lanes, exact. Each
 * lane, converted (exactly: < 2^24) and times dk * dq, is summed with fused
 * multiply-adds across blocks. So a score differs from ref.c's only by the order of
 * the f32 additions of its block terms. */
PKVI_INLINE __m256i kblock_bytes(pkv_dtype dt, const char *blk)
{
    if (dt == PKV_Q8)
        return _mm256_loadu_si256((const void *)(blk + 2));
    const __m128i x = _mm_loadu_si128((const void *)(blk + 2));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
}

/* The last block of m < 32 values: its bytes copied into a zeroed block first (rows
 * end there: nothing past them is read). q is 0 past m, so what the copy leaves in
 * those lanes adds 0. */
PKVI_INLINE __m256i kblock_bytes_tail(pkv_dtype dt, const char *blk, uint32_t m)
{
    _Alignas(32) char tmp[34] = {0};
    memcpy(tmp, blk, 2 + (dt == PKV_Q8 ? m : (m + 1) / 2));
    return kblock_bytes(dt, tmp);
}

PKVI_INLINE float kblock_scale(const char *blk)
{
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    return _cvtsh_ss(h);
}

/* lane i of the result = sum of the 8 int32 lanes of v[i], exact (|isum| < 2^20, any
 * order). The two 128-bit halves are added after vextracti128, not combined with two
 * vperm2i128. */
PKVI_INLINE __m256i qd_hsum8i(const __m256i v[8])
{
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                         _mm256_hadd_epi32(v[2], v[3]));
    const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]),
                                         _mm256_hadd_epi32(v[6], v[7]));
    const __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(u0), _mm256_extracti128_si256(u0, 1));
    const __m128i hi = _mm_add_epi32(_mm256_castsi256_si128(u1), _mm256_extracti128_si256(u1, 1));
    return _mm256_set_m128i(hi, lo);
}

/* The f16 scale of K row t's block blk, as 16 bits */
PKVI_INLINE uint32_t kblock_scale_bits(const char *blk)
{
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    return h;
}

/* pkvi_quant_query (quant.c, the definition) on 8 lanes: per block of 32, a = max |x|
 * over finite values (a NaN or an infinity makes the block's scale NaN), dq = a / 127,
 * qi = clamp(rint(x / dq), -127, 127) by the same correctly rounded division and
 * round-to-nearest-even, so the same bits; past n, and in a block whose scale is not
 * positive, qi is 0. The kernel quantizes each call's heads (walk.h prep_head), once
 * per split-K chunk: in vector code, since a scalar loop was a visible part of every
 * chunk's time. */
PKVI_INLINE void qd_quant_query(uint32_t n, const float *x, int8_t *qi, float *qs)
{
    const __m256 absm = QB_ABSM, fmax = QB_FMAX;
    for (uint32_t i = 0, b = 0; i < n; i += 32, b++) {
        const uint32_t m = n - i < 32 ? n - i : 32;
        __m256 v[4], mx = _mm256_setzero_ps();
        int fin = 1;
        PKVI_UNROLL
        for (int u = 0; u < 4; u++) {
            const uint32_t lo = 8u * (uint32_t)u;
            v[u] = m >= lo + 8 ? _mm256_loadu_ps(x + i + lo)
                   : m > lo ? _mm256_maskload_ps(x + i + lo, _mm256_cmpgt_epi32(
                                  _mm256_set1_epi32((int)(m - lo)),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
                            : _mm256_setzero_ps();
            qb_scan(v[u], absm, fmax, &mx, &fin);
        }
        const float a = qb_hmax(mx);
        const float dq = fin ? a / 127.0f : NAN;
        qs[b] = dq;
        if (!(dq > 0.0f)) {
            memset(qi + i, 0, 32);
            continue;
        }
        const __m256 dv = _mm256_set1_ps(dq), hi = _mm256_set1_ps(127.0f),
                     lo = _mm256_set1_ps(-127.0f);
        __m256i r[4];
        PKVI_UNROLL
        for (int u = 0; u < 4; u++)
            r[u] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(
                _mm256_div_ps(v[u], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
        _mm256_storeu_si256((void *)(qi + i), qb_pack_i8(r));
    }
}

/* The f16 K scales sb[0..TB) of one block in the 8 lanes i = h * TB + t of the
 * transposed reduction (lane i: dk of token t). */
PKVI_INLINE __m128i qd_lane_scales(const uint32_t *sb, const int TB)
{
    if (TB == 8)
        return _mm_setr_epi16((short)sb[0], (short)sb[1], (short)sb[2], (short)sb[3],
                              (short)sb[4], (short)sb[5], (short)sb[6], (short)sb[7]);
    if (TB == 4)
        return _mm_set1_epi64x((long long)(sb[0] | sb[1] << 16 |
                                           (uint64_t)(sb[2] | sb[3] << 16) << 32));
    if (TB == 2)
        return _mm_set1_epi32((int)(sb[0] | sb[1] << 16));
    return _mm_set1_epi16((short)sb[0]);
}

/* A row's leading pairs of whole blocks scored by a file with wider vectors: blocks
 * [0, b) folded into acc exactly as qk_block_int's loop would fold them, b returned
 * (qd_wide_blocks of the AVX-512 files). */
typedef uint32_t (*qd_wide_fn)(pkv_dtype dt, const char *krow, uint32_t d, const int8_t *qi,
                               const float *dqv, size_t dpad, uint32_t nb, size_t row_bytes,
                               int HB, int TB, __m256 *acc);

/* Integer-dot scores of HB heads (qi rows dpad apart, qs rows nb apart) with TB
 * consecutive K rows; writes s[h * PKVI_TILE + t]. HB * TB == 8 or (TB == 1, any HB).
 * The transposed reduction: per block, the 8 pairs' (head h, token t; lane h * TB + t)
 * int32 partial dots are summed across lanes in one exact integer tree, so one vector
 * holds the 8 exact isum_b; it is converted, times the 8 scales dk_b * dq_b, and added
 * to the 8 scores in block order: ref.c's arithmetic, bit for bit. dqv holds, per
 * block b, the 8 lanes' dq_b (0 in lanes past HB * TB): qk_heads_int lays them out once
 * per tile, not once per block of every token pair. */
PKVI_INLINE void qk_block_int(pkv_dtype dt, const char *krow, uint32_t d, const int8_t *qi,
                              const float *dqv, const int32_t *qbv, size_t dpad, uint32_t nb, float *s,
                              const char *pf, const bool l2, size_t row_bytes, const int HB,
                              const int TB, const qd_wide_fn wide)
{
    if (pf)
        for (size_t off = 0; off < TB * row_bytes; off += 64)
            pf_line(pf + off, l2);
    const size_t bb = pkvi_quant_block_bytes(dt);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    const uint32_t b0 = wide ? wide(dt, krow, d, qi, dqv, dpad, nb, row_bytes, HB, TB, &acc) : 0;
    for (uint32_t b = b0; b < nb; b++) {
        const bool full = (b + 1) * 32 <= d;
        __m256i pr[8];
        PKVI_UNROLL
        for (int i = HB * TB; i < 8; i++)
            pr[i] = _mm256_setzero_si256();
        uint32_t sb[8];
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const char *blk = krow + t * row_bytes + b * bb;
            sb[t] = kblock_scale_bits(blk);
            const __m256i k = full ? kblock_bytes(dt, blk) : kblock_bytes_tail(dt, blk, d - b * 32);
            const __m256i ka = dt == PKV_Q4 ? k : _mm256_abs_epi8(k);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++) {
                const __m256i qv = _mm256_load_si256((const void *)(qi + h * dpad + b * 32));
                pr[h * TB + t] = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(ka, dt == PKV_Q4 ? qv : _mm256_sign_epi8(qv, k)),
                    ones);
            }
        }
        const __m256 dk = _mm256_cvtph_ps(qd_lane_scales(sb, TB));
        const __m256 dq = _mm256_load_ps(dqv + 8 * b);
        __m256i is = qd_hsum8i(pr);
        if (dt == PKV_Q4) /* (k + 8) . q - 8 * sum(q) = k . q, exact */
            is = _mm256_sub_epi32(is, _mm256_load_si256((const void *)(qbv + 8 * b)));
        const __m256 isum = _mm256_cvtepi32_ps(is);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dk, dq), isum));
    }
    _Alignas(32) float r[8];
    _mm256_store_ps(r, acc);
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        PKVI_UNROLL
        for (int t = 0; t < TB; t++)
            s[h * PKVI_TILE + t] = r[h * TB + t];
}

/* dqv[8 * b + h * TB + t] = qs[h * nb + b] for the HB x TB lanes of qk_block_int, 0
 * in the others. */
PKVI_INLINE void qd_lanes(const float *qs, uint32_t nb, float *dqv, const int HB, const int TB)
{
    for (uint32_t b = 0; b < nb; b++) {
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            PKVI_UNROLL
            for (int t = 0; t < TB; t++)
                dqv[8 * b + (uint32_t)(h * TB + t)] = qs[h * nb + b];
        PKVI_UNROLL
        for (int i = HB * TB; i < 8; i++)
            dqv[8 * b + (uint32_t)i] = 0.0f;
    }
}

/* Q4 (kblock_bytes): qbv[8 * b + h * TB + t] = 8 * the sum of head h's 32 integers of
 * block b, for blocks [b0, nb), 0 in the lanes past HB * TB: the lanes of
 * qk_block_int's reduction, by the same tree (qd_hsum8i). |8 * sum| < 2^15: exact. */
PKVI_INLINE void qd_lane_bias(const int8_t *qi, size_t dpad, uint32_t b0, uint32_t nb, int32_t *qbv,
                              const int HB, const int TB)
{
    const __m256i one8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
    for (uint32_t b = b0; b < nb; b++) {
        __m256i pr[8];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const __m256i qv = _mm256_load_si256((const void *)(qi + h * dpad + b * 32));
            const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, qv), one16);
            PKVI_UNROLL
            for (int t = 0; t < TB; t++)
                pr[h * TB + t] = v;
        }
        PKVI_UNROLL
        for (int i = HB * TB; i < 8; i++)
            pr[i] = _mm256_setzero_si256();
        _mm256_store_si256((void *)(qbv + 8 * b), _mm256_slli_epi32(qd_hsum8i(pr), 3));
    }
}

/* The integer-dot scores of n rows for HB heads into s [HB][PKVI_TILE]: blocks of TB = 8
 * / HB tokens, then one token at a time. wide: a file's scoring of a row's leading
 * pairs of whole blocks (NULL for none), b0 the blocks it scores (0 for none). */
PKVI_INLINE void qk_heads_int(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t d,
                              uint32_t n, const int8_t *qi, const float *qs, size_t dpad, uint32_t nb,
                              float *s, const char *pf, const bool l2, const int HB,
                              const qd_wide_fn wide, const uint32_t b0)
{
    const int TB = 8 / HB;
    _Alignas(32) float dqv[8 * (PKVI_MAX_HEAD_DIM / 32)];
    _Alignas(32) int32_t qbv[8 * (PKVI_MAX_HEAD_DIM / 32)]; /* Q4: qd_lane_bias */
    uint32_t t = 0;
    if (n >= (uint32_t)TB) {
        qd_lanes(qs, nb, dqv, HB, TB);
        if (dt == PKV_Q4)
            qd_lane_bias(qi, dpad, b0, nb, qbv, HB, TB);
        for (; t + (uint32_t)TB <= n; t += (uint32_t)TB)
            qk_block_int(dt, krow + t * row_bytes, d, qi, dqv, qbv, dpad, nb, s + t,
                         pf ? pf + t * row_bytes : NULL, l2, row_bytes, HB, TB, wide);
    }
    if (t < n) {
        qd_lanes(qs, nb, dqv, HB, 1);
        if (dt == PKV_Q4)
            qd_lane_bias(qi, dpad, b0, nb, qbv, HB, 1);
        for (; t < n; t++)
            qk_block_int(dt, krow + t * row_bytes, d, qi, dqv, qbv, dpad, nb, s + t,
                         pf ? pf + t * row_bytes : NULL, l2, row_bytes, HB, 1, wide);
    }
}

#endif

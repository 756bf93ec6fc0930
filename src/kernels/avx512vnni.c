/*
 * kernels/avx512vnni.c - pkvi_kernels_avx512vnni: the AVX-512 table for hosts with
 * AVX512-VNNI, compiled with avx512.c's flags and -mavx512vnni; dispatch.c checks
 * AVX512_VNNI in cpuid leaf 7 besides what the avx512 table needs.
 *
 * Owns: the Q8/Q4 scores this table forms with vpdpbusd, and the walks that use them:
 *   - the integer-dot scores (quant_dot = 1) of a whole tile at once where every block
 *     of the row is whole, transposed (tile_scores_limbs with one limb), else of pairs
 *     of whole blocks (qd_wide_blocks); the same bits as the avx512 table's;
 *   - the exact path's scores where every block of the row is whole, from q cut into
 *     four integer limbs a value (ql_prep_head, tile_scores_limbs): within the bound
 *     of docs/numerics.md section 4, not the avx512 table's bits.
 * Everything else - the exact path of rows with a shorter last block, f32, f16, bf16,
 * the store - is avx512.c's: this table calls pkvi_kernels_avx512 for it.
 */
#include "kernels/kernels.h"
#include "kernels/avx512_load.h"
#include "kernels/avx512_math.h"
#include "kernels/avx512_pv.h"
#include "kernels/avx512_qd.h"
#include "kernels/avx512_qk.h" /* qk_heads: limb_fallback's f32 scores */
#include "kernels/qdot256.h"
#include "kernels/qlimbs.h"
#include "kernels/qscales.h"
#include "kernels/walk.h"
#include "base/quant.h"

#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

_Static_assert(QL_LIMBS == 4, "tile_scores_limbs joins limbs 3 and 2, then 1 and 0, and "
                              "ql_prep_head writes four");

/* What the limbs may move a score by (a logit, absolute): their rounding of q and the
 * join of their sums, bounded per head and tile from q and the tile's K block scales
 * (ql_prep_head, tile_scores_limbs); a head and tile that could go past it are scored
 * from f32 q instead (limb_fallback). It moves the output by at most (e^(2 LIMB_BUDGET)
 * - 1) max|V| = 4.8e-7 max|V|, a twentieth of the 1e-5 bound (docs/numerics.md section 4;
 * docs/performance.md, decision table: LIMB_BUDGET). */
#define LIMB_BUDGET 0x1p-22

/* ---- the integer-dot scores of a whole tile, transposed (avx512vnni) ----------------
 * Where every block of the row is whole (d % 32 == 0), the tile's rows are transposed
 * a block at a time so that lane t of vector j holds 4 bytes j of row t's block: then
 * one vpdpbusd per 4 values and head, with the head's 4 q bytes broadcast, adds into
 * 16 tokens' lanes at once, and the block's isums come out per token with no
 * reduction across lanes (qd_wide_blocks spends most of its operations on that). q is
 * the unsigned operand, q + 128 (a byte xor), so k keeps its sign and each lane ends
 * at isum + 128 * sum(k): sum(k) per token is one more vpdpbusd per 4 values (with
 * ones), shared by the heads. The isums are exact, the score terms (dk * dq) * isum
 * are summed in block order: ref.c's arithmetic, bit for bit. */

/* The tile's token order in lane t: QD_T8 for Q8's 8x8 transposes (row t's lanes in
 * 128-bit groups 0, 2, 1, 3), the identity for Q4's 4x4 ones. An involution. */
#define QD_T8 _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)

/* Q8 block b of rows 0..n-1 (rows past n read as 0, never loaded): kt[j] lane t =
 * bytes 4j .. 4j+3 of the block of row QD_T8[t]. An 8x8 dword transpose on each
 * 256-bit half: rows i and i + 8 in one vector, then unpacks and a lane shuffle. */
PKVI_INLINE void qd_kt_q8(const char *blk0, size_t row_bytes, uint32_t n, __m512i kt[8])
{
    __m512i z[8], t[8], u[8];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 8; i++) {
        const __m256i lo = i < n ? _mm256_loadu_si256((const void *)(blk0 + i * row_bytes + 2))
                                 : _mm256_setzero_si256();
        const __m256i hi = i + 8 < n
                               ? _mm256_loadu_si256((const void *)(blk0 + (i + 8) * row_bytes + 2))
                               : _mm256_setzero_si256();
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    PKVI_UNROLL
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    PKVI_UNROLL
    for (int i = 0; i < 8; i += 4) { /* u[i + k]: rows i .. i+3 (and +8), dwords k, k + 4 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    PKVI_UNROLL
    for (int k = 0; k < 4; k++) {
        kt[k] = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(2, 0, 2, 0));
        kt[k + 4] = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* Q4 block b of rows 0..n-1: kt[j] lane t = row t's integers (nibble - 8) at
 * positions 4j .. 4j+3 of kblock_bytes' order (low nibbles, then high: the order q is
 * permuted to). A 4x4 dword transpose of the packed bytes in each 128-bit lane (rows
 * t, t + 4, t + 8, t + 12 in one vector), then the nibbles split. */
PKVI_INLINE void qd_kt_q4(const char *blk0, size_t row_bytes, uint32_t n, __m512i kt[8])
{
    __m512i z[4], t[4];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 4; i++) {
        __m128i r[4];
        PKVI_UNROLL
        for (uint32_t L = 0; L < 4; L++)
            r[L] = i + 4 * L < n
                       ? _mm_loadu_si128((const void *)(blk0 + (i + 4 * L) * row_bytes + 2))
                       : _mm_setzero_si128();
        z[i] = _mm512_inserti32x4(
            _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(r[0]), r[1], 1), r[2],
                               2),
            r[3], 3);
    }
    t[0] = _mm512_unpacklo_epi32(z[0], z[1]);
    t[1] = _mm512_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm512_unpacklo_epi32(z[2], z[3]);
    t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
    const __m512i p[4] = {_mm512_unpacklo_epi64(t[0], t[2]), _mm512_unpackhi_epi64(t[0], t[2]),
                          _mm512_unpacklo_epi64(t[1], t[3]), _mm512_unpackhi_epi64(t[1], t[3])};
    const __m512i m = _mm512_set1_epi8(15), e = _mm512_set1_epi8(8);
    PKVI_UNROLL
    for (int j = 0; j < 4; j++) {
        kt[j] = _mm512_sub_epi8(_mm512_and_si512(p[j], m), e);
        kt[j + 4] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(p[j], 4), m), e);
    }
}

/* Block b of a tile's K, ready for the heads: the transposed integers (kt), 128 times
 * each token's sum of them (bias, which the xor of q's signed limb adds), and the
 * token's block scales (dk). */
typedef struct {
    __m512i kt[8];
    __m512i bias;
    __m512 dk;
} kblock;

PKVI_INLINE void kblock_prep(pkv_dtype dt, const char *blk0, size_t row_bytes, uint32_t n,
                             kblock *kb)
{
    const __m512i ones = _mm512_set1_epi8(1);
    if (dt == PKV_Q8)
        qd_kt_q8(blk0, row_bytes, n, kb->kt);
    else
        qd_kt_q4(blk0, row_bytes, n, kb->kt);
    __m512i ks = _mm512_setzero_si512(); /* per token: sum of its 32 integers */
    PKVI_UNROLL
    for (int j = 0; j < 8; j++)
        ks = _mm512_dpbusd_epi32(ks, ones, kb->kt[j]);
    kb->bias = _mm512_slli_epi32(ks, 7);
    kb->dk = dt == PKV_Q8 ? block_scales16_of(blk0, row_bytes, n, 0, 8, 4, 12)
                          : block_scales16(blk0, row_bytes, n);
}

/* Block b's terms of HB heads' scores added into acc (the block order of ref.c), from
 * q as NL limbs (tile_scores_limbs, below, says how they join). */
PKVI_INLINE void kblock_heads(const kblock *kb, const int8_t *ql, const float *qs, size_t dpad,
                              uint32_t nb, uint32_t b, const int HB, const int NL, __m512 *acc)
{
    const __m512i flip = _mm512_set1_epi8(-128);
    PKVI_UNROLL
    for (int h = 0; h < HB; h++) {
        const int8_t *qb = ql + (size_t)h * NL * dpad + b * 32;
        __m512i a[4];
        PKVI_UNROLL
        for (int r = 0; r < NL; r++)
            a[r] = _mm512_setzero_si512();
        PKVI_UNROLL
        for (int j = 0; j < 8; j++)
            PKVI_UNROLL
            for (int r = 0; r < NL; r++) {
                int32_t q4;
                memcpy(&q4, qb + (size_t)r * dpad + 4 * j, sizeof q4);
                const __m512i qv = _mm512_set1_epi32(q4);
                a[r] = _mm512_dpbusd_epi32(a[r], NL == 1 ? _mm512_xor_si512(qv, flip) : qv,
                                           kb->kt[j]);
            }
        const __m512i top = _mm512_sub_epi32(a[NL - 1], kb->bias);
        const __m512 isum =
            NL == 1 ? _mm512_cvtepi32_ps(top)
                    : _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(
                                          _mm512_slli_epi32(top, 8), a[NL - 2])),
                                      _mm512_set1_ps(65536.0f),
                                      _mm512_cvtepi32_ps(_mm512_add_epi32(
                                          _mm512_slli_epi32(a[1], 8), a[0])));
        const __m512 dkq = _mm512_mul_ps(kb->dk, _mm512_set1_ps(qs[h * nb + b]));
        const __m512 term = _mm512_mul_ps(dkq, isum);
        acc[h] = _mm512_add_ps(acc[h], term);
    }
}

/* The HB heads' scores (acc, lane t: the tile's token order) into s [HB][PKVI_TILE]. */
PKVI_INLINE void kblock_store(pkv_dtype dt, uint32_t n, const __m512 *acc, float *s, const int HB)
{
    const __mmask16 nk = (__mmask16)((1u << n) - 1u);
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        _mm512_mask_storeu_ps(s + h * PKVI_TILE, nk,
                              dt == PKV_Q8 ? _mm512_permutexvar_ps(QD_T8, acc[h]) : acc[h]);
}

/* The scores of n rows and HB heads whose q is NL limbs of int8 per value, the last one
 * signed, the others unsigned bytes (ql + h * NL * dpad + r * dpad: limb r of head h),
 * value = sum_r limb_r 2^(8r) times the head's block scale qs[h * nb + b]. NL = 1 is the
 * integer dot (the limb is pkvi_quant_query's qi); NL = 4 (QL_LIMBS), the exact path's
 * limbs (ql_prep_head). The signed limb is the unsigned operand after a byte xor (+ 128):
 * here for NL = 1, by ql_prep_head for NL = 4 (once per call, not once per tile). 128
 * times each token's sum of k comes off the lanes. Per block the limbs' isums are exact
 * int32; for NL = 4 they join as float(isum_3 2^8 + isum_2) 2^16 + float(isum_1 2^8 +
 * isum_0), both sums exact in int32 (|.| < 2^28.1) and each rounded once, then one fused
 * multiply-add: the block's dot to within 2u of sum |Q_j k_j| plus 2^-7 sum |k_j| (the
 * lower limbs are unsigned, so a small negative Q_j puts up to 2^16 |k_j| in the low
 * sum). NL = 4 with tile_dkmax also stores there the tile's largest |dk| (NaN scales
 * left out), which tile_qk holds against each head's budget (ql_prep_head's lb): a
 * head whose budget it exceeds may have scores off by more than LIMB_BUDGET, formed
 * again by limb_fallback. */
PKVI_INLINE void tile_scores_limbs(pkv_dtype dt, const char *krow, size_t row_bytes,
                                   uint32_t n, const int8_t *ql, const float *qs, size_t dpad,
                                   uint32_t nb, float *s, const char *pf, const bool l2,
                                   const int HB, const int NL, float *tile_dkmax)
{
    const size_t bb = pkvi_quant_block_bytes(dt);
    const size_t lines = (n * row_bytes + 63) / 64; /* prefetched a share per block */
    __m512 acc[4];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        acc[h] = _mm512_setzero_ps();
    __m512 dkmax = _mm512_setzero_ps(); /* NL = 4: the tile's largest |dk| per token */
    for (uint32_t b = 0; b < nb; b++) {
        const char *blk0 = krow + b * bb;
        if (pf)
            for (size_t ln = b * lines / nb; ln < (b + 1) * lines / nb; ln++)
                pf_line(pf + ln * 64, l2);
        kblock kb;
        kblock_prep(dt, blk0, row_bytes, n, &kb);
        if (NL > 1 && tile_dkmax) /* a NaN scale is left out: its scores are NaN on either path */
            dkmax = _mm512_max_ps(_mm512_abs_ps(kb.dk), dkmax);
        kblock_heads(&kb, ql, qs, dpad, nb, b, HB, NL, acc);
    }
    kblock_store(dt, n, acc, s, HB);
    if (NL > 1 && tile_dkmax)
        *tile_dkmax = _mm512_reduce_max_ps(dkmax);
}

/* ---- many heads: the tile's K prepared once ------------------------------------------
 * tile_scores_limbs prepares every block of K again for each run of 4 heads; from
 * KT_MIN_HEADS heads a group (verify, a shared batch, prefill's stacked queries) the
 * tile's blocks are prepared once into a stack array and every run reads them from
 * L1: the same operations on the same values, so the same bits
 * (docs/performance.md, decision table: KT_MIN_HEADS). */
#define KT_MIN_HEADS 8u
#define KT_MAX_BLOCKS 8u /* head_dim <= 256: 5 KiB of stack */

PKVI_INLINE bool kt_once(uint32_t nb, uint32_t hg)
{
    return hg >= KT_MIN_HEADS && nb <= KT_MAX_BLOCKS;
}

/* Every block of the tile prepared into kt[0..nb), prefetching as tile_scores_limbs
 * does; returns the tile's largest |dk| (NaN scales left out). */
PKVI_INLINE float ktile_prep(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t n,
                             uint32_t nb, const char *pf, const bool l2, kblock *kt)
{
    const size_t bb = pkvi_quant_block_bytes(dt);
    const size_t lines = (n * row_bytes + 63) / 64;
    __m512 dkmax = _mm512_setzero_ps();
    for (uint32_t b = 0; b < nb; b++) {
        if (pf)
            for (size_t ln = b * lines / nb; ln < (b + 1) * lines / nb; ln++)
                pf_line(pf + ln * 64, l2);
        kblock_prep(dt, krow + b * bb, row_bytes, n, &kt[b]);
        dkmax = _mm512_max_ps(_mm512_abs_ps(kt[b].dk), dkmax);
    }
    return _mm512_reduce_max_ps(dkmax);
}

PKVI_INLINE void ktile_scores(pkv_dtype dt, const kblock *kt, uint32_t n, const int8_t *ql,
                              const float *qs, size_t dpad, uint32_t nb, float *s, const int HB,
                              const int NL)
{
    __m512 acc[4];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        acc[h] = _mm512_setzero_ps();
    for (uint32_t b = 0; b < nb; b++)
        kblock_heads(&kt[b], ql, qs, dpad, nb, b, HB, NL, acc);
    kblock_store(dt, n, acc, s, HB);
}

/* ---- the exact path's scores from integer limbs of q (avx512vnni, whole blocks) ------
 * Block b of a head's q is held as Q_j 2^e: e = max(ilogb(a) - 29, -149), a the
 * block's largest |q_j|, Q_j = rint(q_j 2^-e), so |Q_j| <= 2^30 and |q_j - Q_j 2^e| <=
 * 2^(e-1), at most 2^-30 a (below a = 2^-120, 2^-150); values of at least a / 64 are
 * held exactly. (Three limbs, 2^-22 a, missed the 1e-5 bound where a block's largest
 * value sits on a K channel of zeros: docs/numerics.md section 3.) Q_j = H 2^24 + N 2^16
 * + M 2^8 + L with L, M, N in [0, 255] and H in [-64, 64], stored as H + 128 (the byte
 * xor tile_scores_limbs needs for its unsigned operand): four vpdpbusd per 4 values and
 * head where the f32 path spends a conversion, a scale multiply and an FMA per value
 * (tile_scores_limbs). A block whose largest |q| is not finite gets the scale NaN, so
 * the head's scores are NaN, as on the f32 path.
 * Returns E = sum over the head's whole blocks of (sum_j |q_j - Q_j 2^e| + 2^(e - 2)),
 * rounded up: with kmax the largest |k| of a stored K integer, the limbs and their join
 * move the head's score of a row by at most scale * kmax * sum_b |dk_b| (E's block b
 * term) <= scale * kmax * max_b |dk_b| * E (docs/numerics.md section 4). A block of
 * values that all sit on its grid (every value of at least a / 64 does) adds only
 * 2^(e - 2). */
PKVI_INLINE double ql_prep_head(uint32_t d, const float *q, int8_t *ql, float *qs)
{
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 err = _mm512_setzero_ps(); /* sum of |q_j - Q_j 2^e| */
    double join = 0;                  /* sum of 2^(e - 2) */
    for (uint32_t i = 0, b = 0; i < d; i += 32, b++) {
        const __m512 v[2] = {_mm512_loadu_ps(q + i), _mm512_loadu_ps(q + i + 16)};
        const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], absm),
                                                           _mm512_and_ps(v[1], absm)));
        const __mmask16 nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                              _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
        int e = -149;
        if (nan || !(a <= 3.4028235e38f)) { /* max drops a NaN lane: each lane is tested */
            qs[b] = NAN;
        } else {
            e = ql_block_exp(a);
            qs[b] = ldexp_pow2(e);
        }
        if (!(qs[b] >= 0.0f)) {
            for (uint32_t r = 0; r < QL_LIMBS; r++)
                memset(ql + (size_t)r * d + i, 0, 32);
            continue;
        }
        const __m512 sc = _mm512_set1_ps((float)-e), step = _mm512_set1_ps(qs[b]);
        join += 0.25 * qs[b];
        PKVI_UNROLL
        for (int u = 0; u < 2; u++) {
            const __m512 r = _mm512_scalef_ps(v[u], sc); /* q_j 2^-e: exact */
            const __m512i Q = _mm512_cvt_roundps_epi32(r, _MM_FROUND_TO_NEAREST_INT |
                                                              _MM_FROUND_NO_EXC);
            /* |r - rint(r)| is exact: r's bits below 2^0 */
            err = _mm512_fmadd_ps(
                _mm512_abs_ps(_mm512_sub_ps(r, _mm512_roundscale_ps(
                                                   r, _MM_FROUND_TO_NEAREST_INT |
                                                          _MM_FROUND_NO_EXC))),
                step, err);
            _mm_storeu_si128((void *)(ql + i + 16 * u), _mm512_cvtepi32_epi8(Q));
            /* the low bytes of Q >> 8, Q >> 16 and Q >> 24: a logical shift gives the
             * same bits as an arithmetic one there */
            _mm_storeu_si128((void *)(ql + d + i + 16 * u),
                             _mm512_cvtepi32_epi8(_mm512_srli_epi32(Q, 8)));
            _mm_storeu_si128((void *)(ql + 2 * (size_t)d + i + 16 * u),
                             _mm512_cvtepi32_epi8(_mm512_srli_epi32(Q, 16)));
            _mm_storeu_si128((void *)(ql + 3 * (size_t)d + i + 16 * u),
                             _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_srli_epi32(Q, 24)),
                                           _mm_set1_epi8(-128)));
        }
    }
    float e16[16];
    _mm512_storeu_ps(e16, err);
    double E = join;
    for (int i = 0; i < 16; i++)
        E += e16[i];
    return E * (1 + 0x1p-16); /* rounded up past the f32 sums' roundings */
}

/* ---- the integer-dot scores, two blocks per vector ------------------------------------
 * avx512.c's qd_wide_blocks with vpdpbusd, which multiplies unsigned by signed bytes
 * and adds each 4 products into an int32 lane - the lanes vpmaddubsw + vpmaddwd fill -
 * in one instruction. k is made unsigned, k + 128 (its sign bit flipped), and each lane
 * starts at -128 times the sum of its 4 q bytes (one vpdpbusd of 128s per head and
 * step), so it ends at sum k * q exactly (|lane| < 2^18: no wrap): the isums, hence the
 * scores, are the avx512 table's bit for bit. */
PKVI_INLINE __m512i kblocks2_u8(pkv_dtype dt, const char *blk, size_t bb)
{
    return _mm512_xor_si512(kblocks2_i8(dt, blk, bb), _mm512_set1_epi8(-128));
}

PKVI_INLINE uint32_t qd_wide_blocks(pkv_dtype dt, const char *krow, uint32_t d, const int8_t *qi,
                                    const float *dqv, size_t dpad, uint32_t nb, size_t row_bytes,
                                    const int HB, const int TB, __m256 *acc)
{
    const size_t bb = pkvi_quant_block_bytes(dt);
    const __m512i zero = _mm512_setzero_si512();
    const uint32_t end = qd_wide_count(d, nb);
    uint32_t b = 0;
    for (; b < end; b += 2) {
        __m512i pr[8];
        PKVI_UNROLL
        for (int i = HB * TB; i < 8; i++)
            pr[i] = zero;
        __m512i bias[4]; /* per head: -128 * (sum of each lane's 4 q bytes) */
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            bias[h] = _mm512_sub_epi32(
                zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(-128),
                                          _mm512_loadu_si512((const void *)(qi + h * dpad + b * 32))));
        uint32_t sb0[8], sb1[8];
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const char *blk = krow + t * row_bytes + b * bb;
            sb0[t] = kblock_scale_bits(blk);
            sb1[t] = kblock_scale_bits(blk + bb);
            const __m512i ku = kblocks2_u8(dt, blk, bb);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                pr[h * TB + t] = _mm512_dpbusd_epi32(
                    bias[h], ku, _mm512_loadu_si512((const void *)(qi + h * dpad + b * 32)));
        }
        const __m512 dk = _mm512_cvtph_ps(
            _mm256_set_m128i(qd_lane_scales(sb1, TB), qd_lane_scales(sb0, TB)));
        const __m512 dq = _mm512_loadu_ps(dqv + 8 * b);
        const __m512 term = _mm512_mul_ps(_mm512_mul_ps(dk, dq), _mm512_cvtepi32_ps(qd_hsum8x2(pr)));
        /* block b's terms, then block b+1's: qdot256.h's order */
        *acc = _mm256_add_ps(*acc, _mm512_castps512_ps256(term));
        *acc = _mm256_add_ps(*acc, _mm512_extractf32x8_ps(term, 1));
    }
    return b;
}

/* ---- the walks ------------------------------------------------------------------------ */

/* The f32 scores (avx512_qk.h, avx512.c's arithmetic) of the heads h0 + i, bit i of
 * `heads`, of a tile whose K block scales let the limbs move a score past LIMB_BUDGET.
 * Out of line and rare: only a query whose blocks span a range the limbs cannot hold
 * against large K comes here. */
static __attribute__((noinline, cold)) void limb_fallback(pkv_dtype dt, const tile *t,
                                                          uint32_t d, size_t row, bool l2,
                                                          uint32_t h0, unsigned heads,
                                                          float *s)
{
    float qp[PKVI_MAX_HEAD_DIM]; /* the head's q in the order qk_heads reads it */
    for (uint32_t i = 0; heads >> i; i++) {
        if (!(heads >> i & 1u))
            continue;
        const uint32_t h = h0 + i;
        if (dt == PKV_Q8) {
            q_permute(PKV_Q8, t->q + (size_t)h * d, qp, d);
            qk_heads(PKV_Q8, t->k, row, d, t->n, qp, s + h * PKVI_TILE, NULL, l2, 1);
        } else {
            q_permute(PKV_Q4, t->q + (size_t)h * d, qp, d);
            qk_heads(PKV_Q4, t->k, row, d, t->n, qp, s + h * PKVI_TILE, NULL, l2, 1);
        }
    }
}

/* The tile's largest |dk| against every head's budget, 16 heads a vector; the heads
 * that could go past LIMB_BUDGET are scored again by limb_fallback. */
PKVI_INLINE void limb_check(pkv_dtype dt, const tile *t, uint32_t d, size_t row, bool l2,
                            uint32_t hg, float dkmax, float *s)
{
    const __m512 dm = _mm512_set1_ps(dkmax);
    for (uint32_t h0 = 0; h0 < hg; h0 += 16) {
        const __mmask16 live = (__mmask16)(hg - h0 >= 16 ? 0xffffu : (1u << (hg - h0)) - 1u);
        /* lb < dkmax: false for a NaN budget */
        const __mmask16 past = _mm512_mask_cmp_ps_mask(
            live, _mm512_maskz_loadu_ps(live, t->lb + h0), dm, _CMP_LT_OQ);
        if (__builtin_expect(past != 0, 0))
            limb_fallback(dt, t, d, row, l2, h0, past, s);
    }
}

/* The scores of the tile's rows for all hg heads into s [hg][PKVI_TILE] (walk_qk_fn):
 * QK_LIMBS (every block whole) from q's limbs, QK_INT from q quantized per block - a
 * whole tile at once where every block is whole, else qdot256.h's blocks with the
 * leading pairs in one zmm. Heads in blocks of 4, 2, 1; only the first block
 * prefetches (the same rows for all). */
PKVI_INLINE void tile_qk(const pkv_dtype dt, const qk_kind qk, const uint32_t D, const pkvi_kparams *p,
                         const tile *t, float *s)
{
    const uint32_t d = walk_dk(p, D), hg = p->hg;
    const size_t row = row_bytes_of(dt, d);
    const char *pk = t->pfk;
    const bool l2 = p->pf_l2;
    const uint32_t nb = (d + 31) / 32, dp = nb * 32;
    uint32_t h = 0;
    if (qk == QK_LIMBS || d % 32 == 0) { /* whole blocks: q as QL_LIMBS limbs, or one */
        const size_t bytes = qk == QK_LIMBS ? (size_t)QL_LIMBS * dp : dp; /* int8s a head */
        const int NL = qk == QK_LIMBS ? QL_LIMBS : 1;
        /* the tile's largest |dk| (NL > 1): from the preparation, or from the first run
         * of heads, which reads every block scale; held against every head's budget
         * once, after all the runs, so the hot loop makes no call and its constants stay
         * in registers (docs/performance.md, decision table: LIMB_BUDGET) */
        float dkmax = 0.0f;
        if (kt_once(nb, hg)) { /* many heads: K prepared once */
            kblock kt[KT_MAX_BLOCKS];
            dkmax = ktile_prep(dt, t->k, row, t->n, nb, pk, l2, kt);
            for (; h + 4 <= hg; h += 4)
                ktile_scores(dt, kt, t->n, t->qi + (size_t)h * bytes, t->qs + (size_t)h * nb,
                             dp, nb, s + h * PKVI_TILE, 4, NL);
            if (hg - h >= 2) {
                ktile_scores(dt, kt, t->n, t->qi + (size_t)h * bytes, t->qs + (size_t)h * nb,
                             dp, nb, s + h * PKVI_TILE, 2, NL);
                h += 2;
            }
            if (h < hg)
                ktile_scores(dt, kt, t->n, t->qi + (size_t)h * bytes, t->qs + (size_t)h * nb,
                             dp, nb, s + h * PKVI_TILE, 1, NL);
        } else {
            for (; h + 4 <= hg; h += 4, pk = NULL)
                tile_scores_limbs(dt, t->k, row, t->n, t->qi + (size_t)h * bytes,
                                  t->qs + (size_t)h * nb, dp, nb, s + h * PKVI_TILE, pk, l2, 4,
                                  NL, h == 0 ? &dkmax : NULL);
            if (hg - h >= 2) {
                tile_scores_limbs(dt, t->k, row, t->n, t->qi + (size_t)h * bytes,
                                  t->qs + (size_t)h * nb, dp, nb, s + h * PKVI_TILE, pk, l2, 2,
                                  NL, h == 0 ? &dkmax : NULL);
                h += 2;
                pk = NULL;
            }
            if (h < hg)
                tile_scores_limbs(dt, t->k, row, t->n, t->qi + (size_t)h * bytes,
                                  t->qs + (size_t)h * nb, dp, nb, s + h * PKVI_TILE, pk, l2, 1,
                                  NL, h == 0 ? &dkmax : NULL);
        }
        if (qk == QK_LIMBS)
            limb_check(dt, t, d, row, l2, hg, dkmax, s);
        return;
    }
    const uint32_t b0 = qd_wide_count(d, nb);
    for (; h + 4 <= hg; h += 4, pk = NULL)
        qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                     dp, nb, s + h * PKVI_TILE, pk, l2, 4, qd_wide_blocks, b0);
    if (hg - h >= 2) {
        qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                     dp, nb, s + h * PKVI_TILE, pk, l2, 2, qd_wide_blocks, b0);
        h += 2;
        pk = NULL;
    }
    if (h < hg)
        qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                     dp, nb, s + h * PKVI_TILE, pk, l2, 1, qd_wide_blocks, b0);
}

/* Head q (d values) into slot k of the scratch (walk_prep_fn): cut into limbs, each
 * limb qd_permute'd (QK_LIMBS), or quantized as avx512.c does it (QK_INT). */
PKVI_INLINE void prep_head(const pkv_dtype dt, const qk_kind qk, uint32_t d, float scale,
                           const float *q, prep_scratch *ps, size_t k)
{
    const uint32_t nb = (d + 31) / 32, dpad = nb * 32;
    if (qk == QK_LIMBS) {
        int8_t *ql = ps->u.qi + k * QL_LIMBS * dpad;
        const double E = ql_prep_head(d, q, ql, ps->qs + k * nb);
        for (uint32_t r = 0; r < QL_LIMBS; r++)
            qd_permute(dt, ql + r * dpad, dpad);
        /* a score moves by at most |scale| * kmax * max|dk| * E (kmax: a K integer's
         * largest magnitude, 128 with a loaded Q8 page's -128): the largest |dk| that
         * keeps it within LIMB_BUDGET, rounded down */
        const double unit = fabs((double)scale) * (dt == PKV_Q8 ? 128.0 : 8.0) * E;
        ps->lb[k] = unit > 0 ? (float)(LIMB_BUDGET / unit * (1 - 0x1p-16)) : INFINITY;
        return;
    }
    qd_quant_query(d, q, ps->u.qi + k * dpad, ps->qs + k * nb);
    qd_permute(dt, ps->u.qi + k * dpad, dpad);
}

/* avx512.c's PV, softmax and kick distance */
enum { KICK_BYTES = 128u << 10 };

/* ---- entry points ---------------------------------------------------------------------
 * As in avx512.c: one out-of-line walk per dtype and path, and one for head_dim =
 * head_dim_v = 128. The limbs' walks run where head_dim % 32 == 0 only. */

static void attend_q8(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                      uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                      const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q8, QK_LIMBS, 0, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_q8_d128(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                           uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                           const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q8, QK_LIMBS, 128, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_q4(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                      uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                      const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q4, QK_LIMBS, 0, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_q4_d128(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                           uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                           const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q4, QK_LIMBS, 128, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_qd_q8(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                         uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                         const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q8, QK_INT, 0, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_qd_q8_d128(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                              uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                              const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q8, QK_INT, 128, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_qd_q4(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                         uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                         const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q4, QK_INT, 0, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_qd_q4_d128(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                              uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                              const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q4, QK_INT, 128, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                   uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                   const pkvi_heads *x)
{
    const bool d128 = p->head_dim == 128 && PKVI_DV(p) == 128;
    pkvi_attend_fn f = pkvi_kernels_avx512.attend;
    if (p->dtype == PKV_Q8 && p->quant_dot)
        f = d128 ? attend_qd_q8_d128 : attend_qd_q8;
    else if (p->dtype == PKV_Q4 && p->quant_dot)
        f = d128 ? attend_qd_q4_d128 : attend_qd_q4;
    else if (p->dtype == PKV_Q8 && p->head_dim % 32 == 0)
        f = d128 ? attend_q8_d128 : attend_q8;
    else if (p->dtype == PKV_Q4 && p->head_dim % 32 == 0)
        f = d128 ? attend_q4_d128 : attend_q4;
    f(p, pages, n_pages, last_tokens, group0, n_groups, x);
}

/* avx512.c's store (the same bytes on every table) */
static void store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    pkvi_kernels_avx512.store_row(t, dst, src, n);
}

const pkvi_kernels pkvi_kernels_avx512vnni = {"avx512vnni", attend, store_row};

/*
 * kernels/avx2vnni.c - pkvi_kernels_avx2vnni: the AVX2 table for hosts with AVX-VNNI
 * (vpdpbusd on ymm, VEX-encoded: Intel since Alder Lake, AMD since Zen 5), compiled with
 * -mavx2 -mfma -mf16c -mavxvnni; dispatch.c checks AVX-VNNI in cpuid leaf 7.1 besides
 * what the avx2 table needs.
 *
 * Owns: the integer-dot Q8/Q4 scores of a whole tile where every block of the row is
 * whole (head_dim % 32 == 0), transposed, and the walks that use them. Everything else
 * - the exact path, the integer dot of rows with a shorter last block, every other
 * dtype, the store - is avx2.c's: this table calls pkvi_kernels_avx2 for it. The same
 * bits as avx2 on every path (tests/test_kernels.c, vnni_same_bits).
 *
 * The tile: avx512vnni.c's transposed tile (its comment says how) at half the width.
 * A tile's rows in two halves of 8 tokens, each block transposed so that lane t of
 * kt[j] holds bytes 4j .. 4j+3 of row t's block; per head one vpdpbusd per 4 values
 * adds into 8 tokens' lanes with no reduction across lanes. The arithmetic per token is
 * avx512vnni.c's, operation for operation, so the integer-dot scores are the
 * avx512vnni table's and the avx2 table's bit for bit. The exact path keeps avx2's f32
 * scores (docs/performance.md, decision table: avx2vnni-exact).
 */
#include "kernels/kernels.h"
#include "kernels/avx2_load.h"
#include "kernels/avx2_math.h"
#include "kernels/avx2_pv.h"
#include "kernels/qdot256.h"
#include "kernels/qscales.h"
#include "kernels/walk.h"
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

/* Q8 block of rows r0 .. r0+7 (rows at or past n read as 0, never loaded): an 8x8 dword
 * transpose, lane t = row r0 + t. */
PKVI_INLINE void qv_kt_q8(const char *blk0, size_t row_bytes, uint32_t r0, uint32_t n, __m256i kt[8])
{
    __m256i z[8], t[8], u[8];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 8; i++)
        z[i] = r0 + i < n ? _mm256_loadu_si256((const void *)(blk0 + (r0 + i) * row_bytes + 2))
                          : _mm256_setzero_si256();
    PKVI_UNROLL
    for (int i = 0; i < 8; i += 2) { /* rows i, i+1: dwords 0 1 | 4 5 and 2 3 | 6 7 */
        t[i] = _mm256_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(z[i], z[i + 1]);
    }
    PKVI_UNROLL
    for (int i = 0; i < 8; i += 4) { /* u[i + k]: rows i .. i+3, dwords k | k + 4 */
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    PKVI_UNROLL
    for (int k = 0; k < 4; k++) {
        kt[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        kt[k + 4] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

/* Q4 block of rows r0 .. r0+7: kt[j] lane t = row r0 + t's integers (nibble - 8) at
 * positions 4j .. 4j+3 of kblock_bytes' order (low nibbles, then high). Rows i and
 * i + 4 share a vector, a 4x4 dword transpose in each 128-bit lane, then the nibbles
 * split. */
PKVI_INLINE void qv_kt_q4(const char *blk0, size_t row_bytes, uint32_t r0, uint32_t n, __m256i kt[8])
{
    __m256i z[4], t[4];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 4; i++) {
        const uint32_t a = r0 + i, b = r0 + i + 4;
        const __m128i lo = a < n ? _mm_loadu_si128((const void *)(blk0 + a * row_bytes + 2))
                                 : _mm_setzero_si128();
        const __m128i hi = b < n ? _mm_loadu_si128((const void *)(blk0 + b * row_bytes + 2))
                                 : _mm_setzero_si128();
        z[i] = _mm256_set_m128i(hi, lo);
    }
    t[0] = _mm256_unpacklo_epi32(z[0], z[1]);
    t[1] = _mm256_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm256_unpacklo_epi32(z[2], z[3]);
    t[3] = _mm256_unpackhi_epi32(z[2], z[3]);
    const __m256i p[4] = {_mm256_unpacklo_epi64(t[0], t[2]), _mm256_unpackhi_epi64(t[0], t[2]),
                          _mm256_unpacklo_epi64(t[1], t[3]), _mm256_unpackhi_epi64(t[1], t[3])};
    const __m256i m = _mm256_set1_epi8(15), e = _mm256_set1_epi8(8);
    PKVI_UNROLL
    for (int j = 0; j < 4; j++) {
        kt[j] = _mm256_sub_epi8(_mm256_and_si256(p[j], m), e);
        kt[j + 4] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(p[j], 4), m), e);
    }
}

/* The integer-dot scores of rows r0 .. min(r0 + 8, n) - 1 for HB heads (avx512.c's
 * tile_scores_limbs with one limb: q, pkvi_quant_query's int8, is the unsigned operand
 * after a byte xor, and 128 times each token's sum of k is taken off). Each block's
 * terms are added in block order into a stack array, not registers: 16 ymm registers do
 * not hold 4 heads' sums beside a block's 8 transposed vectors. */
PKVI_INLINE void tile8_scores_qd(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t r0,
                                 uint32_t n, const int8_t *qi, const float *qs, size_t dpad,
                                 uint32_t nb, float *s, const char *pf, const bool l2, const int HB)
{
    const size_t bb = pkvi_quant_block_bytes(dt);
    const size_t lines = (n * row_bytes + 63) / 64; /* half the lines each half */
    const __m256i ones = _mm256_set1_epi8(1), flip = _mm256_set1_epi8(-128);
    _Alignas(32) float acc[4][8];
    for (uint32_t b = 0; b < nb; b++) {
        const char *blk0 = krow + b * bb;
        if (pf) {
            const size_t u = (r0 / 8) * nb + b, un = 2 * (size_t)nb;
            for (size_t ln = u * lines / un; ln < (u + 1) * lines / un; ln++)
                pf_line(pf + ln * 64, l2);
        }
        __m256i kt[8];
        if (dt == PKV_Q8)
            qv_kt_q8(blk0, row_bytes, r0, n, kt);
        else
            qv_kt_q4(blk0, row_bytes, r0, n, kt);
        __m256i ks = _mm256_setzero_si256(); /* per token: sum of its 32 integers */
        PKVI_UNROLL
        for (int j = 0; j < 8; j++)
            ks = _mm256_dpbusd_avx_epi32(ks, ones, kt[j]);
        const __m256i bias = _mm256_slli_epi32(ks, 7);
        const __m256 dk = _mm256_cvtph_ps(block_scales8(blk0, row_bytes, n, r0, r0 + 4));
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const int8_t *qb = qi + (size_t)h * dpad + b * 32;
            __m256i a = _mm256_setzero_si256();
            PKVI_UNROLL
            for (int j = 0; j < 8; j++) {
                int32_t q4;
                memcpy(&q4, qb + 4 * j, sizeof q4);
                a = _mm256_dpbusd_avx_epi32(a, _mm256_xor_si256(_mm256_set1_epi32(q4), flip),
                                            kt[j]);
            }
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_sub_epi32(a, bias));
            const __m256 dkq = _mm256_mul_ps(dk, _mm256_set1_ps(qs[h * nb + b]));
            const __m256 term = _mm256_mul_ps(dkq, isum);
            _mm256_store_ps(acc[h], b ? _mm256_add_ps(_mm256_load_ps(acc[h]), term)
                                      : _mm256_add_ps(_mm256_setzero_ps(), term));
        }
    }
    const uint32_t m = n - r0 < 8 ? n - r0 : 8;
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        memcpy(s + h * PKVI_TILE + r0, acc[h], m * sizeof(float));
}

/* The integer-dot scores of a tile's n rows (dpad == d, a multiple of 32) for HB heads:
 * qk_block_int's bits, in two halves of 8 tokens. */
PKVI_INLINE void tile_scores_qd(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t n,
                                const int8_t *qi, const float *qs, size_t dpad, uint32_t nb,
                                float *s, const char *pf, const bool l2, const int HB)
{
    tile8_scores_qd(dt, krow, row_bytes, 0, n, qi, qs, dpad, nb, s, pf, l2, HB);
    if (n > 8)
        tile8_scores_qd(dt, krow, row_bytes, 8, n, qi, qs, dpad, nb, s, pf, l2, HB);
}

/* The integer-dot scores of the tile's rows for all hg heads (walk_qk_fn; QK_INT and
 * head_dim % 32 == 0 only): heads in blocks of 4, 2, 1, each a tile in two halves. */
PKVI_INLINE void tile_qk(const pkv_dtype dt, const qk_kind qk, const uint32_t D, const pkvi_kparams *p,
                         const tile *t, float *s)
{
    (void)qk;
    const uint32_t d = walk_dk(p, D), hg = p->hg, nb = d / 32, dp = d;
    const size_t row = row_bytes_of(dt, d);
    const char *pk = t->pfk;
    const bool l2 = p->pf_l2;
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4, pk = NULL)
        tile_scores_qd(dt, t->k, row, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb, dp,
                       nb, s + h * PKVI_TILE, pk, l2, 4);
    if (hg - h >= 2) {
        tile_scores_qd(dt, t->k, row, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb, dp,
                       nb, s + h * PKVI_TILE, pk, l2, 2);
        h += 2;
        pk = NULL;
    }
    if (h < hg)
        tile_scores_qd(dt, t->k, row, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb, dp,
                       nb, s + h * PKVI_TILE, pk, l2, 1);
}

/* Head q (d values) into slot k of the scratch (walk_prep_fn): quantized as avx2.c
 * does it (qd_quant_query, then qd_permute). */
PKVI_INLINE void prep_head(const pkv_dtype dt, const qk_kind qk, uint32_t d, float scale,
                           const float *q, prep_scratch *ps, size_t k)
{
    (void)qk, (void)scale;
    const uint32_t nb = (d + 31) / 32, dpad = nb * 32;
    qd_quant_query(d, q, ps->u.qi + k * dpad, ps->qs + k * nb);
    qd_permute(dt, ps->u.qi + k * dpad, dpad);
}

/* avx2.c's PV, softmax and kick distance */
enum { KICK_BYTES = 512u << 10 };

/* ---- entry points: the integer-dot walks of rows of whole blocks --------------------
 * As in avx2.c, one for head_dim = head_dim_v = 128 (the blocks constants) and one for
 * any other multiple of 32. */

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
    pkvi_attend_fn f = pkvi_kernels_avx2.attend;
    if (p->quant_dot && p->head_dim % 32 == 0) {
        if (p->dtype == PKV_Q8)
            f = d128 ? attend_qd_q8_d128 : attend_qd_q8;
        else if (p->dtype == PKV_Q4)
            f = d128 ? attend_qd_q4_d128 : attend_qd_q4;
    }
    f(p, pages, n_pages, last_tokens, group0, n_groups, x);
}

/* avx2.c's store (the same bytes on every table) */
static void store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    pkvi_kernels_avx2.store_row(t, dst, src, n);
}

const pkvi_kernels pkvi_kernels_avx2vnni = {"avx2vnni", attend, store_row};

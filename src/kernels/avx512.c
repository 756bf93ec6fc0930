/*
 * kernels/avx512.c - the AVX-512 decode kernel and row store, pkvi_kernels_avx512
 * (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; called only
 * after kernels/dispatch.c saw those features in cpuid and the ZMM state enabled in
 * XCR0). avx512vnni.c, the avx512vnni table, takes from here what it does not do
 * itself.
 *
 * Owns: pkvi_kernels_avx512, its QK step and entry points, the integer-dot scores of
 * pairs of whole blocks with vpmaddubsw (qd_wide_blocks), the store. Does not own: the
 * semantics (kernels/ref.c is the specification), the conversions' definition
 * (dtype.c, quant.c), the walk (walk.h), threading or split-K (decode.c).
 *
 * Same tiling as the reference: per page, tiles of at most PKVI_TILE positions that
 * start at the page's first row; per tile the running state is rescaled once. What
 * differs from ref.c (docs/numerics.md section 3): q.k is summed in 16 lane partials,
 * then a fixed reduction tree; l and acc use fused multiply-adds; exp is our own
 * polynomial (<= 2 ulp). Each call is deterministic (no data-dependent order, no
 * threads) and page-local.
 *
 * Shape of the work for one tile of n <= 16 tokens (GQA: hg heads share the rows):
 *   QK:  blocks of HB heads x TB tokens (HB*TB == 16 accumulators), avx512_qk.h; the
 *        integer dot per 8 (head, token) pairs, qdot256.h with pairs of whole blocks
 *        in one zmm here (qd_wide_blocks).
 *   PV:  blocks of HB heads x CB 16-float chunks of d in registers, avx512_pv.h.
 * Rows past `last_tokens` of the last page are never loaded; the d tail uses masked
 * loads and stores, so nothing past a row is read either. The micro-kernels are small
 * arrays of vectors indexed by constant loops; PKVI_UNROLL (kernels.h) unrolls them so
 * the arrays live in registers.
 */
#include "kernels/kernels.h"
#include "kernels/avx512_load.h"
#include "kernels/avx512_math.h"
#include "kernels/avx512_pv.h"
#include "kernels/avx512_qd.h"
#include "kernels/avx512_qk.h"
#include "kernels/qdot256.h"
#include "kernels/qstore256.h"
#include "kernels/walk.h"
#include "base/dtype.h"
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

/* The integer-dot scores of a row's leading pairs of whole blocks, two blocks per
 * vector (qdot256.h's arithmetic on 512-bit vectors, qd_wide_fn): the K integers of
 * blocks b and b+1 in one zmm (kblocks2_i8), |k| times q with k's sign (a byte mask from
 * k, then a masked negation: AVX-512 has no vpsignb), vpmaddubsw then vpmaddwd by ones,
 * exact as there; the isums are reduced by qd_hsum8x2. */
PKVI_INLINE uint32_t qd_wide_blocks(pkv_dtype dt, const char *krow, uint32_t d, const int8_t *qi,
                                    const float *dqv, size_t dpad, uint32_t nb, size_t row_bytes,
                                    const int HB, const int TB, __m256 *acc)
{
    const size_t bb = pkvi_quant_block_bytes(dt);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i ones = _mm512_set1_epi16(1);
    const uint32_t end = qd_wide_count(d, nb);
    uint32_t b = 0;
    for (; b < end; b += 2) {
        __m512i pr[8];
        PKVI_UNROLL
        for (int i = HB * TB; i < 8; i++)
            pr[i] = zero;
        uint32_t sb0[8], sb1[8];
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const char *blk = krow + t * row_bytes + b * bb;
            sb0[t] = kblock_scale_bits(blk);
            sb1[t] = kblock_scale_bits(blk + bb);
            const __m512i k = kblocks2_i8(dt, blk, bb);
            const __m512i ka = _mm512_abs_epi8(k);
            const __mmask64 neg = _mm512_movepi8_mask(k);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++) {
                const __m512i qv = _mm512_loadu_si512((const void *)(qi + h * dpad + b * 32));
                pr[h * TB + t] = _mm512_madd_epi16(
                    _mm512_maddubs_epi16(ka, _mm512_mask_sub_epi8(qv, neg, zero, qv)), ones);
            }
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

/* Unscaled scores of the tile's rows for all hg heads into s [hg][PKVI_TILE]
 * (walk_qk_fn): from f32 q, or from q quantized per block (QK_INT). Heads in blocks
 * of 4, 2, 1; only the first block prefetches (the same rows for all). */
PKVI_INLINE void tile_qk(const pkv_dtype dt, const qk_kind qk, const uint32_t D, const pkvi_kparams *p,
                         const tile *t, float *s)
{
    const uint32_t d = walk_dk(p, D), hg = p->hg;
    const size_t row = row_bytes_of(dt, d);
    const char *pk = t->pfk;
    const bool l2 = p->pf_l2;
    uint32_t h = 0;
    if (qk == QK_INT) {
        const uint32_t nb = (d + 31) / 32, dp = nb * 32, b0 = qd_wide_count(d, nb);
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
        return;
    }
    if (widen_tile(dt, d, hg)) { /* many heads: the rows widened once (avx512_load.h) */
        _Alignas(64) float kf[PKVI_TILE * WIDEN_MAX_DIM];
        widen_rows(dt, t->k, d, t->n, kf, pk, l2);
        qk_groups(PKV_F32, kf, (size_t)d * sizeof(float), d, t->n, t->q, hg, s, NULL, l2);
        return;
    }
    qk_groups(dt, t->k, row, d, t->n, t->q, hg, s, pk, l2);
}

/* Head q (d values) into slot k of the scratch (walk_prep_fn): quantized (qdot256.h's
 * qd_quant_query, pkvi_quant_query's bits, as ref.c) and qd_permute'd, or q_permute'd
 * for Q4's exact QK (ldq32_raw's order). */
PKVI_INLINE void prep_head(const pkv_dtype dt, const qk_kind qk, uint32_t d, float scale,
                           const float *q, prep_scratch *ps, size_t k)
{
    (void)scale;
    const uint32_t nb = (d + 31) / 32, dpad = nb * 32;
    if (qk == QK_INT) {
        qd_quant_query(d, q, ps->u.qi + k * dpad, ps->qs + k * nb);
        qd_permute(dt, ps->u.qi + k * dpad, dpad);
    } else {
        q_permute(dt, q, ps->u.qf + k * d, d);
    }
}

/* The stream kick's distance: docs/performance.md, decision table: KICK_AHEAD_BYTES. */
enum { KICK_BYTES = 128u << 10 };

/* ---- entry points: one out-of-line walk per dtype and path --------------------------
 * Inlined together into one function, the walks shared one frame of tens of KiB and
 * gcc spilled the loops' row pointers. Q8/Q4 also have a walk for head_dim = head_dim_v
 * = 128, where the row's blocks are constants the loops unroll over (docs/performance.md,
 * decision table: WALK_FN_D128); D is 0 in the others (head_dim from the call). Q4's
 * exact QK reads q permuted (q_permute): its walk prepares q first. */

static void attend_f32(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                       uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                       const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_F32, QK_F32, 0, p, pages, n_pages,
                last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_f16(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                       uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                       const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_F16, QK_F32, 0, p, pages, n_pages,
                last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_bf16(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                        uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                        const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_BF16, QK_F32, 0, p, pages, n_pages,
                last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_q8(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                      uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                      const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_Q8, QK_F32, 0, p, pages, n_pages,
                last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_q8_d128(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                           uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                           const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_Q8, QK_F32, 128, p, pages, n_pages,
                last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_q4(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                      uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                      const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q4, QK_F32, 0, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_q4_d128(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                           uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                           const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_Q4, QK_F32, 128, p,
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
    pkvi_attend_fn f = attend_f32;
    switch (p->dtype) {
    case PKV_F16:
        f = attend_f16;
        break;
    case PKV_BF16:
        f = attend_bf16;
        break;
    case PKV_F32:
        f = attend_f32;
        break;
    case PKV_Q8:
        f = p->quant_dot ? (d128 ? attend_qd_q8_d128 : attend_qd_q8)
                         : (d128 ? attend_q8_d128 : attend_q8);
        break;
    case PKV_Q4:
        f = p->quant_dot ? (d128 ? attend_qd_q4_d128 : attend_qd_q4)
                         : (d128 ? attend_q4_d128 : attend_q4);
        break;
    }
    f(p, pages, n_pages, last_tokens, group0, n_groups, x);
}

/* ---- store ---------------------------------------------------------------------------
 * Bitwise the conversions of dtype.c: vcvtps2ph rounds to nearest even with overflow
 * to inf and quiets NaN exactly as pkvi_f32_to_f16 does; bf16 is integer rounding
 * (vcvtneps2bf16 would flush subnormals, so it is not used). */
PKVI_INLINE __m256i bf16_of(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000)); /* quiet bit */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static void store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    uint32_t i = 0;
    switch (t) {
    case PKV_Q8:
    case PKV_Q4: /* quant.c's bytes, from 256-bit vectors */
        qs_store_row(t, dst, src, n);
        break;
    case PKV_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case PKV_F16:
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((void *)((uint16_t *)dst + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if (i < n) {
            const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
            _mm256_mask_storeu_epi16((uint16_t *)dst + i, k,
                                     _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, src + i),
                                                     _MM_FROUND_TO_NEAREST_INT |
                                                         _MM_FROUND_NO_EXC));
        }
        break;
    case PKV_BF16:
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((void *)((uint16_t *)dst + i),
                                bf16_of(_mm512_loadu_ps(src + i)));
        if (i < n) {
            const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
            _mm256_mask_storeu_epi16((uint16_t *)dst + i, k,
                                     bf16_of(_mm512_maskz_loadu_ps(k, src + i)));
        }
        break;
    }
}

const pkvi_kernels pkvi_kernels_avx512 = {"avx512", attend, store_row};

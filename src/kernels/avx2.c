/*
 * kernels/avx2.c - the AVX2 decode kernel and row store, pkvi_kernels_avx2 (compiled
 * with -mavx2 -mfma -mf16c; called only after kernels/dispatch.c saw AVX2, FMA, F16C in
 * cpuid and the YMM state enabled in XCR0). avx2vnni.c, the avx2vnni table, takes
 * everything but its integer-dot tile from here.
 *
 * Owns: pkvi_kernels_avx2, its QK step and entry points. Does not own: the semantics
 * (kernels/ref.c is the specification), the conversions' definition (dtype.c,
 * quant.c), the walk (walk.h), threading or split-K (decode.c).
 *
 * The same tiles as ref.c. QK in blocks of HB heads x TB tokens (HB * TB == 8
 * accumulators, one 8-way reduction tree: avx2_math.h's hsum4), PV in blocks of HB
 * heads x 16 floats of d (avx2_pv.h). Differences from ref.c are the order of
 * additions and the exp polynomial (docs/numerics.md section 3). AVX2 has no 16-bit
 * masked load, so the d tail (d % 8) of f16/bf16 rows is copied into a zeroed 8-element
 * buffer first; f32 rows use vmaskmovps (avx2_load.h). Rows past `last_tokens` and
 * elements past d are never read. The micro-kernels are small arrays of vectors indexed
 * by constant loops; PKVI_UNROLL (kernels.h) unrolls them so the arrays live in
 * registers.
 */
#include "kernels/kernels.h"
#include "kernels/avx2_load.h"
#include "kernels/avx2_math.h"
#include "kernels/avx2_pv.h"
#include "kernels/qdot256.h"
#include "kernels/qstore256.h"
#include "kernels/walk.h"
#include "base/dtype.h"
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

/* ---- QK ------------------------------------------------------------------------------
 * Unscaled dots of HB heads (q rows qh, stride d) with TB consecutive K rows; writes
 * s[h * PKVI_TILE + t]. HB * TB <= 8. */
PKVI_INLINE void qk_block(pkv_dtype dt, const void *krow, uint32_t d, const float *qh, float *s,
                          const char *pf, const bool l2, size_t row_bytes, const int HB, const int TB)
{
    if (pf)
        for (size_t off = 0; off < TB * row_bytes; off += 64)
            pf_line(pf + off, l2);
    __m256 a[8];
    PKVI_UNROLL
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_ps();
    uint32_t c = 0;
    if (qtype(dt)) /* whole blocks: each row's scale read and widened once per block */
        for (; c + 32 <= d; c += 32) {
            __m256 sc[8];
            PKVI_UNROLL
            for (int t = 0; t < TB; t++)
                sc[t] = qscale8(qblock(dt, (const char *)krow + t * row_bytes, c));
            for (uint32_t j = c; j < c + 32; j += 16)
                PKVI_UNROLL
                for (int t = 0; t < TB; t++) {
                    /* ldq's products, bit for bit, 16 integers unpacked at once */
                    __m256 kv[2];
                    ldq16_raw(dt, (const char *)krow + t * row_bytes, j, kv);
                    PKVI_UNROLL
                    for (int u = 0; u < 2; u++) {
                        const __m256 k = _mm256_mul_ps(sc[t], kv[u]);
                        PKVI_UNROLL
                        for (int h = 0; h < HB; h++)
                            a[h * TB + t] = _mm256_fmadd_ps(
                                _mm256_loadu_ps(qh + (size_t)h * d + j + 8 * u), k, a[h * TB + t]);
                    }
                    /* q is read again for the next row: without this barrier gcc 12
                     * keeps the 2 * HB q vectors of the 16 values live across the TB
                     * rows and spills accumulators instead (slower; the same results
                     * bit for bit) */
                    __asm__ volatile("" ::: "memory");
                }
        }
    if (dt == PKV_BF16) /* q permuted (q_permute) */
        for (; c + 16 <= d; c += 16) {
            if (TB <= 2) {
                /* the rows' 16 values widened first, then each q vector loaded once
                 * for them: one q vector live at a time. With the loop over rows
                 * outside, gcc 12 kept all 2 * HB q vectors live and spilled three
                 * accumulators every step. The same FMAs in the same order, so the
                 * same bits. */
                __m256 kv[2][2];
                PKVI_UNROLL
                for (int t = 0; t < TB; t++)
                    ld16_bf16(krow, (size_t)t * d + c, kv[t]);
                PKVI_UNROLL
                for (int u = 0; u < 2; u++)
                    PKVI_UNROLL
                    for (int h = 0; h < HB; h++) {
                        const __m256 qv = _mm256_loadu_ps(qh + (size_t)h * d + c + 8 * u);
                        PKVI_UNROLL
                        for (int t = 0; t < TB; t++)
                            a[h * TB + t] = _mm256_fmadd_ps(qv, kv[t][u], a[h * TB + t]);
                    }
                continue;
            }
            PKVI_UNROLL
            for (int t = 0; t < TB; t++) { /* HB <= 2: its q vectors fit beside */
                __m256 kv[2];
                ld16_bf16(krow, (size_t)t * d + c, kv);
                PKVI_UNROLL
                for (int u = 0; u < 2; u++)
                    PKVI_UNROLL
                    for (int h = 0; h < HB; h++)
                        a[h * TB + t] = _mm256_fmadd_ps(
                            _mm256_loadu_ps(qh + (size_t)h * d + c + 8 * u), kv[u], a[h * TB + t]);
            }
        }
    for (; c + 8 <= d; c += 8) {
        __m256 qv[4];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            qv[h] = _mm256_loadu_ps(qh + (size_t)h * d + c);
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const __m256 kv = qtype(dt) ? ldq(dt, (const char *)krow + t * row_bytes, c)
                                        : ld(dt, krow, (size_t)t * d + c);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h * TB + t] = _mm256_fmadd_ps(qv[h], kv, a[h * TB + t]);
        }
    }
    if (c < d) {
        const uint32_t rem = d - c;
        __m256 qv[4];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            qv[h] = _mm256_maskload_ps(qh + (size_t)h * d + c, tail_mask(rem));
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const __m256 kv = qtype(dt) ? ldqt(dt, (const char *)krow + t * row_bytes, c, rem)
                                        : ldt(dt, krow, (size_t)t * d + c, rem);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h * TB + t] = _mm256_fmadd_ps(qv[h], kv, a[h * TB + t]);
        }
    }
    /* dot i = h * TB + t into s[h * PKVI_TILE + t]: a head's TB dots are adjacent
     * lanes, so each is one 64- or 128-bit store */
    const __m128 r0 = hsum4(a);
    if (HB * TB <= 4) {
        _Alignas(16) float r[4];
        _mm_store_ps(r, r0);
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            PKVI_UNROLL
            for (int t = 0; t < TB; t++)
                s[h * PKVI_TILE + t] = r[h * TB + t];
        return;
    }
    const __m128 r1 = hsum4(a + 4);
    if (TB == 2) { /* HB == 4 */
        _mm_storel_pi((__m64 *)s, r0);
        _mm_storeh_pi((__m64 *)(s + PKVI_TILE), r0);
        _mm_storel_pi((__m64 *)(s + 2 * PKVI_TILE), r1);
        _mm_storeh_pi((__m64 *)(s + 3 * PKVI_TILE), r1);
    } else if (TB == 4) { /* HB == 2 */
        _mm_storeu_ps(s, r0);
        _mm_storeu_ps(s + PKVI_TILE, r1);
    } else { /* TB == 8, HB == 1 */
        _mm_storeu_ps(s, r0);
        _mm_storeu_ps(s + 4, r1);
    }
}

PKVI_INLINE void qk_heads(pkv_dtype dt, const void *krow, size_t row_bytes, uint32_t d,
                          uint32_t n, const float *qh, float *s, const char *pf, const bool l2,
                          const int HB)
{
    const int TB = 8 / HB;
    uint32_t t = 0;
    for (; t + (uint32_t)TB <= n; t += (uint32_t)TB)
        qk_block(dt, (const char *)krow + t * row_bytes, d, qh, s + t,
                 pf ? pf + t * row_bytes : NULL, l2, row_bytes, HB, TB);
    for (; t < n; t++)
        qk_block(dt, (const char *)krow + t * row_bytes, d, qh, s + t,
                 pf ? pf + t * row_bytes : NULL, l2, row_bytes, HB, 1);
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
        const uint32_t nb = (d + 31) / 32, dp = nb * 32;
        for (; h + 4 <= hg; h += 4, pk = NULL)
            qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                         dp, nb, s + h * PKVI_TILE, pk, l2, 4, NULL, 0);
        if (hg - h >= 2) {
            qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                         dp, nb, s + h * PKVI_TILE, pk, l2, 2, NULL, 0);
            h += 2;
            pk = NULL;
        }
        if (h < hg)
            qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                         dp, nb, s + h * PKVI_TILE, pk, l2, 1, NULL, 0);
        return;
    }
    if (widen_tile(dt, d, hg)) { /* many heads: the rows widened once (avx2_load.h) */
        _Alignas(32) float kf[PKVI_TILE * WIDEN_MAX_DIM];
        widen_rows(t->k, d, t->n, kf, pk, l2);
        qk_groups(PKV_F32, kf, (size_t)d * sizeof(float), d, t->n, t->q, hg, s, NULL, l2);
        return;
    }
    qk_groups(dt, t->k, row, d, t->n, t->q, hg, s, pk, l2);
}

/* Head q (d values) into slot k of the scratch (walk_prep_fn): quantized (qdot256.h's
 * qd_quant_query, pkvi_quant_query's bits, as ref.c) and qd_permute'd, or q_permute'd
 * for bf16's QK. */
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

/* The stream kick's distance for this file: 512 KiB, not the 128 KiB of avx512.c
 * (docs/performance.md, decision table: KICK_AHEAD_BYTES). */
enum { KICK_BYTES = 512u << 10 };

/* ---- entry points: one out-of-line walk per dtype and path --------------------------
 * Inlined together into one function, the walks shared one frame of tens of KiB and
 * gcc spilled the loops' row pointers. Q8/Q4 also have a walk for head_dim = head_dim_v
 * = 128, where the row's blocks are constants the loops unroll over (docs/performance.md,
 * decision table: WALK_FN_D128); D is 0 in the others (head_dim from the call). bf16's
 * QK reads q permuted (q_permute): its walk prepares q first. */

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
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head, KICK_BYTES, PKV_BF16, QK_F32, 0, p,
                  pages, n_pages, last_tokens, group0, n_groups, x);
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
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_Q4, QK_F32, 0, p, pages, n_pages,
                last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_q4_d128(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                           uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                           const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_Q4, QK_F32, 128, p, pages, n_pages,
                last_tokens, group0, n_groups, x, NULL, NULL, NULL);
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
 * Bitwise dtype.c's conversions: vcvtps2ph (round to nearest even) for f16, integer
 * rounding for bf16; the last n % 8 values use dtype.c's scalar functions. */
PKVI_INLINE __m128i bf16_of(__m256 x)
{
    const __m256i u = _mm256_castps_si256(x);
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    /* signed compare is right: abs is non-negative */
    const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256i r = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
    /* values < 2^16: the unsigned-saturating pack is exact; fix its lane order */
    const __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(pk);
}

static void store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    uint32_t i = 0;
    uint16_t *o = dst;
    switch (t) {
    case PKV_Q8:
    case PKV_Q4: /* quant.c's bytes, from 256-bit vectors */
        qs_store_row(t, dst, src, n);
        break;
    case PKV_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case PKV_F16:
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((void *)(o + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < n; i++)
            o[i] = pkvi_f32_to_f16(src[i]);
        break;
    case PKV_BF16:
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((void *)(o + i), bf16_of(_mm256_loadu_ps(src + i)));
        for (; i < n; i++)
            o[i] = pkvi_f32_to_bf16(src[i]);
        break;
    }
}

const pkvi_kernels pkvi_kernels_avx2 = {"avx2", attend, store_row};

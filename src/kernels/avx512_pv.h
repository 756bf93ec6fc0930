/*
 * kernels/avx512_pv.h - the AVX-512 kernels' PV step: acc = alpha * acc + the tile's
 * weights times its V rows, for every dtype, in blocks of HB heads x CB 16-float
 * chunks of dv kept in registers; each V row chunk is widened once for the HB heads.
 * Q8/Q4 whole blocks multiply-add their integers with each token's block scale folded
 * into the weights. For avx512.c and avx512vnni.c. No state.
 */
#ifndef PKV_KERNELS_AVX512_PV_H
#define PKV_KERNELS_AVX512_PV_H

#include "kernels/kernels.h"
#include "kernels/avx512_load.h"
#include "kernels/walk.h"
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>

/* ---- PV ------------------------------------------------------------------------------
 * A whole block's 32 accumulators, two vectors in row order, into ldq32_raw's Q4
 * order (values 0, 2, .., 30, then 1, 3, .., 31), and back: once per block, head and
 * tile, where the unpack they spare is once per block and token. */
PKVI_INLINE void q4_acc_split(__m512 *a0, __m512 *a1)
{
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512 e = _mm512_permutex2var_ps(*a0, ev, *a1);
    *a1 = _mm512_permutex2var_ps(*a0, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), *a1);
    *a0 = e;
}

PKVI_INLINE void q4_acc_join(__m512 *a0, __m512 *a1)
{
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512 r = _mm512_permutex2var_ps(*a0, lo, *a1);
    *a1 = _mm512_permutex2var_ps(*a0, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), *a1);
    *a0 = r;
}

/* acc[h][c0 .. c0 + 16*CB) = alpha[h] * acc + sum_t w[h][t] * v_t for HB heads and CB
 * chunks; `tail` (CB == 1): only the lanes of k exist. `raw` (Q8/Q4, CB 2 or 4: one
 * or two whole blocks from c0): w holds each block's weights with the token's block
 * scale folded in (pv_heads), block j's at w + j * WS_STRIDE, and v_t are the blocks'
 * integers. */
#define WS_STRIDE (4 * PKVI_TILE)
PKVI_INLINE void pv_block(pkv_dtype dt, const void *vrow, uint32_t d, uint32_t c0, uint32_t n,
                          const float *w, const float *alpha, float *acc, const char *pf, const bool l2,
                          uint32_t ln0, uint32_t ln1, const int HB, const int CB, const bool tail,
                          const __mmask16 k, const bool raw)
{
    const size_t es = dt == PKV_F32 ? 4u : 2u;
    const size_t vrb = qtype(dt) ? pkvi_quant_row_bytes(dt, d) : 0; /* a block row's bytes */
    __m512 a[4][4];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++) {
        const __m512 al = _mm512_set1_ps(alpha[h]);
        PKVI_UNROLL
        for (int c = 0; c < CB; c++) {
            float *p = acc + (size_t)h * d + c0 + 16 * c;
            a[h][c] = _mm512_mul_ps(tail ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p),
                                    al);
        }
        if (raw && dt == PKV_Q4) /* ldq32_raw's order */
            PKVI_UNROLL
            for (int j = 0; j < CB / 2; j++)
                q4_acc_split(&a[h][2 * j], &a[h][2 * j + 1]);
    }
    for (uint32_t t = 0; t < n; t++) {
        if (pf && dt == PKV_F32) /* step t's part of lines [ln0, ln1) ahead */
            for (uint32_t ln = ln0 + t * (ln1 - ln0) / n; ln < ln0 + (t + 1) * (ln1 - ln0) / n;
                 ln++)
                pf_line(pf + (size_t)ln * 64, l2);
        else if (pf && qtype(dt)) { /* the first block's call asks for row t ahead */
            if (c0 == 0)
                for (size_t off = 0; off < vrb; off += 64)
                    pf_line(pf + t * vrb + off, l2);
        } else if (pf) /* this block's bytes of row t, in the page `dist` ahead */
            for (size_t off = c0 * es; off < (c0 + 16u * CB) * es && off < d * es; off += 64)
                pf_line(pf + t * d * es + off, l2);
        __m512 vv[4];
        if (raw) {
            PKVI_UNROLL
            for (int j = 0; j < CB / 2; j++)
                ldq32_raw(dt, qblock(dt, (const char *)vrow + t * vrb, c0 + 32u * (uint32_t)j),
                          vv + 2 * j);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                PKVI_UNROLL
                for (int c = 0; c < CB; c++)
                    a[h][c] = _mm512_fmadd_ps(
                        _mm512_set1_ps(w[(c / 2) * WS_STRIDE + h * PKVI_TILE + t]), vv[c],
                        a[h][c]);
            continue;
        }
        PKVI_UNROLL
        for (int c = 0; c < CB; c++)
            vv[c] = qtype(dt)
                        ? (tail ? ldqm(dt, (const char *)vrow + t * vrb, c0, d - c0)
                                : ldq(dt, (const char *)vrow + t * vrb, c0 + 16 * (uint32_t)c))
                        : (tail ? ldm(dt, vrow, (size_t)t * d + c0, k)
                                : ld(dt, vrow, (size_t)t * d + c0 + 16 * c));
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const __m512 wb = _mm512_set1_ps(w[h * PKVI_TILE + t]);
            PKVI_UNROLL
            for (int c = 0; c < CB; c++)
                a[h][c] = _mm512_fmadd_ps(wb, vv[c], a[h][c]);
        }
    }
    /* Make the compiler recompute the row addresses here instead of keeping HB*CB
     * pointers live across the token loop (they spilled, and V chunks with them). */
    __asm__("" : "+r"(acc));
    if (raw && dt == PKV_Q4)
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            PKVI_UNROLL
            for (int j = 0; j < CB / 2; j++)
                q4_acc_join(&a[h][2 * j], &a[h][2 * j + 1]);
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        PKVI_UNROLL
        for (int c = 0; c < CB; c++) {
            float *p = acc + (size_t)h * d + c0 + 16 * c;
            if (tail)
                _mm512_mask_storeu_ps(p, k, a[h][c]);
            else
                _mm512_storeu_ps(p, a[h][c]);
        }
}

/* f32 (see pf_in_address_order in walk.h): block b prefetches lines [b*L/B, (b+1)*L/B)
 * of the L lines of the n rows ahead, so the prefetches run in address order. The half
 * types prefetch each block's own columns, row by row; so does avx2_pv.h, for every
 * dtype (docs/performance.md, decision table: PF_IN_ADDRESS_ORDER). */
PKVI_INLINE void pv_heads(pkv_dtype dt, const void *vrow, uint32_t d, uint32_t n, const float *w,
                          const float *alpha, float *acc, const char *pf, const bool l2, const int HB)
{
    const uint32_t B = d / 64 + (d % 64) / 16 + (d % 16 != 0);
    const uint32_t L = (uint32_t)(((size_t)n * d * sizeof(float) + 63) / 64);
    uint32_t c = 0, b = 0;
    if (qtype(dt)) {
        /* Whole blocks, two at a time where the row has them: each token's block scale
         * folded into the weights once per tile, ws[j][h][t] = w[h][t] * dv_t (the
         * tile's 16 scales of a block: block_scales16), so the inner loop
         * multiply-adds the blocks' integers: no per-value multiply, no per-token
         * scale load and broadcast. (w * dv) * q for ldq's w * (dv * q): the products
         * reassociated, as avx2.c does. */
        const size_t vrb = pkvi_quant_row_bytes(dt, d), bb = pkvi_quant_block_bytes(dt);
        _Alignas(64) float ws[2 * WS_STRIDE];
        while (c + 32 <= d) {
            const int nblk = c + 64 <= d ? 2 : 1;
            for (int j = 0; j < nblk; j++) {
                const __m512 sv = block_scales16(
                    (const char *)vrow + (c / 32 + (uint32_t)j) * bb, vrb, n);
                PKVI_UNROLL
                for (int h = 0; h < HB; h++)
                    _mm512_store_ps(ws + j * WS_STRIDE + h * PKVI_TILE,
                                    _mm512_mul_ps(_mm512_loadu_ps(w + h * PKVI_TILE), sv));
            }
            if (nblk == 2)
                pv_block(dt, vrow, d, c, n, ws, alpha, acc, pf, l2, 0, 0, HB, 4, false, 0xffff,
                         true);
            else
                pv_block(dt, vrow, d, c, n, ws, alpha, acc, pf, l2, 0, 0, HB, 2, false, 0xffff,
                         true);
            c += 32u * (uint32_t)nblk;
        }
    }
    for (; c + 64 <= d; c += 64, b++)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, b * L / B, (b + 1) * L / B, HB, 4,
                 false, 0xffff, false);
    for (; c + 16 <= d; c += 16, b++)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, b * L / B, (b + 1) * L / B, HB, 1,
                 false, 0xffff, false);
    if (c < d)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, b * L / B, (b + 1) * L / B, HB, 1,
                 true, (__mmask16)((1u << (d - c)) - 1u), false);
}

/* acc = alpha * acc + weights (s) times n V rows (vrow, dtype dt) for hg heads, in blocks
 * of 4, 2, 1 heads; only the first block prefetches (pv: the same rows for all). */
PKVI_INLINE void pv_groups(const pkv_dtype dt, const void *vrow, uint32_t d, uint32_t n,
                           uint32_t hg, const float *s, const float *alpha, float *acc,
                           const char *pv, const bool l2)
{
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4, pv = NULL)
        pv_heads(dt, vrow, d, n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 4);
    if (hg - h >= 2) {
        pv_heads(dt, vrow, d, n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 2);
        h += 2;
        pv = NULL;
    }
    if (h < hg)
        pv_heads(dt, vrow, d, n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 1);
}

/* acc = alpha * acc + weights (s) times the tile's V rows, for all hg heads (walk_pv_fn).
 * The V rows are read as stored even with many heads: widened once into f32 they were
 * slower to read back (docs/performance.md, decision table: WIDEN_MIN_HEADS). */
PKVI_INLINE void tile_pv(const pkv_dtype dt, const uint32_t D, const pkvi_kparams *p, const tile *t,
                         const float *s, const float *alpha)
{
    pv_groups(dt, t->v, walk_dv(p, D), t->n, p->hg, s, alpha, t->acc, t->pfv, p->pf_l2);
}

#endif /* PKV_KERNELS_AVX512_PV_H */

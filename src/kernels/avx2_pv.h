/*
 * kernels/avx2_pv.h - the AVX2 kernels' PV step: acc = alpha * acc + the tile's
 * weights times its V rows, for every dtype, in blocks of HB heads x 8 or 16 floats of
 * dv kept in registers (avx2.c's file comment has the shape of the work). For avx2.c
 * and avx2vnni.c. No state.
 */
#ifndef PKV_KERNELS_AVX2_PV_H
#define PKV_KERNELS_AVX2_PV_H

#include "kernels/kernels.h"
#include "kernels/avx2_load.h"
#include "kernels/qscales.h" /* block_scales8 */
#include "kernels/walk.h"
#include "base/quant.h"

#include <immintrin.h>
#include <stdbool.h>

/* ---- PV ------------------------------------------------------------------------------
 * acc[h][c0 .. c0 + 8*CB) = alpha[h] * acc + sum_t w[h][t] * v_t for HB heads; with
 * rem (1..7, CB == 1) only the first rem lanes exist. */
PKVI_INLINE void pv_block(pkv_dtype dt, const void *vrow, uint32_t d, uint32_t c0, uint32_t n,
                          const float *w, const float *alpha, float *acc, const char *pf, const bool l2,
                          const int HB, const int CB, const uint32_t rem, const bool raw)
{
    const size_t es = dt == PKV_F32 ? 4u : 2u;
    const size_t vrb = qtype(dt) ? pkvi_quant_row_bytes(dt, d) : 0; /* a block row's bytes */
    /* The prefetch of row t, in the unit `dist` ahead: one line a token, at pfb + t *
     * stride. A half type or f32 block asks for the 64 bytes from its first value when
     * it starts them (its neighbours share the line); the two halves of a Q8/Q4 block
     * ask for the block's first and last byte (a block spans at most two lines). One
     * address per token keeps the loop's registers for the loop: a nested loop over
     * the block's lines spilled the row pointer (a store and a reload every token). */
    const size_t stride = qtype(dt) ? vrb : d * es;
    const size_t b0 = qtype(dt) ? (size_t)(c0 / 32) * pkvi_quant_block_bytes(dt) +
                                      (c0 % 32 ? pkvi_quant_block_bytes(dt) - 1 : 0)
                                : c0 * es;
    const char *pfb = pf && (qtype(dt) || b0 % 64 == 0) ? pf + b0 : NULL;
    const bool bf16x = dt == PKV_BF16 && CB == 2; /* ld16_bf16's lane order */
    __m256 a[4][2];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++) {
        const __m256 al = _mm256_set1_ps(alpha[h]);
        PKVI_UNROLL
        for (int c = 0; c < CB; c++) {
            const float *p = acc + (size_t)h * d + c0 + 8 * c;
            a[h][c] = _mm256_mul_ps(bf16x ? acc_ld16(acc + (size_t)h * d + c0, c)
                                    : rem ? _mm256_maskload_ps(p, tail_mask(rem))
                                          : _mm256_loadu_ps(p),
                                    al);
        }
    }
    for (uint32_t t = 0; t < n; t++) {
        if (pfb)
            pf_line(pfb + t * stride, l2);
        __m256 vv[2];
        if (bf16x)
            ld16_bf16(vrow, (size_t)t * d + c0, vv);
        else if (qtype(dt) && CB == 2 && raw) /* w carries the block's scale */
            ldq16_raw(dt, (const char *)vrow + t * vrb, c0, vv);
        else if (qtype(dt) && CB == 2) /* 16 values of one block, one scale */
            ldq16(dt, (const char *)vrow + t * vrb, c0, vv);
        else
            PKVI_UNROLL
            for (int c = 0; c < CB; c++)
                vv[c] = qtype(dt)
                            ? (rem ? ldqt(dt, (const char *)vrow + t * vrb, c0, rem)
                                   : ldq(dt, (const char *)vrow + t * vrb, c0 + 8 * (uint32_t)c))
                            : (rem ? ldt(dt, vrow, (size_t)t * d + c0, rem)
                                   : ld(dt, vrow, (size_t)t * d + c0 + 8 * c));
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const __m256 wb = _mm256_broadcast_ss(w + h * PKVI_TILE + t);
            PKVI_UNROLL
            for (int c = 0; c < CB; c++)
                a[h][c] = _mm256_fmadd_ps(wb, vv[c], a[h][c]);
        }
    }
    /* recompute addresses rather than keep HB*CB pointers live (see avx512.c) */
    __asm__("" : "+r"(acc));
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        PKVI_UNROLL
        for (int c = 0; c < CB; c++) {
            float *p = acc + (size_t)h * d + c0 + 8 * c;
            if (bf16x)
                acc_st16(acc + (size_t)h * d + c0, c, a[h][c]);
            else if (rem)
                _mm256_maskstore_ps(p, tail_mask(rem), a[h][c]);
            else
                _mm256_storeu_ps(p, a[h][c]);
        }
}

PKVI_INLINE void pv_heads(pkv_dtype dt, const void *vrow, uint32_t d, uint32_t n, const float *w,
                          const float *alpha, float *acc, const char *pf, const bool l2, const int HB)
{
    uint32_t c = 0;
    if (qtype(dt)) {
        /* Whole blocks: each token's block scale folded into the weights once,
         * ws[h][t] = w[h][t] * dv_t (one multiply per block per head per 8 tokens),
         * so the values are the block's integers: acc += ws * q. The 16 scales of the
         * tile's rows are moved in as four 64-bit words and converted in two
         * vcvtph2ps (docs/performance.md, decision table: qscales). */
        const size_t vrb = pkvi_quant_row_bytes(dt, d), bb = pkvi_quant_block_bytes(dt);
        _Alignas(32) float ws[4 * PKVI_TILE];
        for (; c + 32 <= d; c += 32) {
            const char *blk0 = (const char *)vrow + (c / 32) * bb;
            const __m256 s0 = _mm256_cvtph_ps(block_scales8(blk0, vrb, n, 0, 4));
            const __m256 s1 = _mm256_cvtph_ps(block_scales8(blk0, vrb, n, 8, 12));
            PKVI_UNROLL
            for (int h = 0; h < HB; h++) {
                _mm256_store_ps(ws + h * PKVI_TILE,
                                _mm256_mul_ps(_mm256_load_ps(w + h * PKVI_TILE), s0));
                _mm256_store_ps(ws + h * PKVI_TILE + 8,
                                _mm256_mul_ps(_mm256_load_ps(w + h * PKVI_TILE + 8), s1));
            }
            pv_block(dt, vrow, d, c, n, ws, alpha, acc, pf, l2, HB, 2, 0, true);
            pv_block(dt, vrow, d, c + 16, n, ws, alpha, acc, pf, l2, HB, 2, 0, true);
        }
    }
    for (; c + 16 <= d; c += 16)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, HB, 2, 0, false);
    for (; c + 8 <= d; c += 8)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, HB, 1, 0, false);
    if (c < d)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, HB, 1, d - c, false);
}

/* acc = alpha * acc + weights (s) times the tile's V rows, for all hg heads (walk_pv_fn) */
PKVI_INLINE void tile_pv(const pkv_dtype dt, const uint32_t D, const pkvi_kparams *p, const tile *t,
                         const float *s, const float *alpha)
{
    const uint32_t d = walk_dv(p, D), hg = p->hg;
    const char *pv = t->pfv;
    const bool l2 = p->pf_l2;
    float *acc = t->acc;
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4, pv = NULL)
        pv_heads(dt, t->v, d, t->n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 4);
    if (hg - h >= 2) {
        pv_heads(dt, t->v, d, t->n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 2);
        h += 2;
        pv = NULL;
    }
    if (h < hg)
        pv_heads(dt, t->v, d, t->n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 1);
}

#endif /* PKV_KERNELS_AVX2_PV_H */

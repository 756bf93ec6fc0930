/*
 * kernels/neon_pv.h - the NEON kernels' PV step (walk_pv_fn): acc = alpha * acc + the
 * tile's weights times its V rows, for every dtype, in blocks of HB heads x 16 or 8
 * columns of acc kept in registers, then one column at a time for dv's tail.
 *
 * Every element of acc sees the same operations whatever the block it falls in: one
 * multiply by alpha, then one fused multiply-add per token in token order (ref.c's
 * order, fused). So the result of a head does not depend on hg, on the head block or
 * on the column block: kernels.h's head-locality. For neon.c and neondot.c. No state.
 */
#ifndef PKV_KERNELS_NEON_PV_H
#define PKV_KERNELS_NEON_PV_H

#include "kernels/kernels.h"
#include "kernels/neon_load.h"
#include "kernels/walk.h"

#include <arm_neon.h>
#include <stdbool.h>

/* acc[h][c0 .. c0 + 4*CB) for HB heads (CB = 2 or 4 vectors). */
PKVI_INLINE void pv_block(const pkv_dtype dt, const char *v, size_t vrb, uint32_t dv,
                          uint32_t c0, uint32_t n, const float *w, const float *alpha,
                          float *acc, const int HB, const int CB)
{
    float32x4_t a[4][4];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++) {
        const float32x4_t al = vdupq_n_f32(alpha[h]);
        PKVI_UNROLL
        for (int c = 0; c < CB; c++)
            a[h][c] = vmulq_f32(vld1q_f32(acc + (size_t)h * dv + c0 + 4 * c), al);
    }
    for (uint32_t t = 0; t < n; t++) {
        float32x4_t vv[4];
        PKVI_UNROLL
        for (int c = 0; c < CB; c += 2)
            ld8(dt, v + (size_t)t * vrb, c0 + 4 * (uint32_t)c, vv + c);
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const float32x4_t wb = vdupq_n_f32(w[h * PKVI_TILE + t]);
            PKVI_UNROLL
            for (int c = 0; c < CB; c++)
                a[h][c] = vfmaq_f32(a[h][c], wb, vv[c]);
        }
    }
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        PKVI_UNROLL
        for (int c = 0; c < CB; c++)
            vst1q_f32(acc + (size_t)h * dv + c0 + 4 * c, a[h][c]);
}

/* The columns of HB heads' acc rows (dv wide). */
PKVI_INLINE void pv_heads(const pkv_dtype dt, const char *v, size_t vrb, uint32_t dv,
                          uint32_t n, const float *w, const float *alpha, float *acc,
                          const int HB)
{
    uint32_t c = 0;
    for (; c + 16 <= dv; c += 16)
        pv_block(dt, v, vrb, dv, c, n, w, alpha, acc, HB, 4);
    if (c + 8 <= dv) {
        pv_block(dt, v, vrb, dv, c, n, w, alpha, acc, HB, 2);
        c += 8;
    }
    for (; c < dv; c++)
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            float x = acc[(size_t)h * dv + c] * alpha[h];
            for (uint32_t t = 0; t < n; t++)
                x = __builtin_fmaf(w[h * PKVI_TILE + t], ld1(dt, v + (size_t)t * vrb, c), x);
            acc[(size_t)h * dv + c] = x;
        }
}

/* acc = alpha * acc + weights (s) times the tile's V rows, for all hg heads
 * (walk_pv_fn); heads in blocks of 4, 2, 1. */
PKVI_INLINE void tile_pv(const pkv_dtype dt, const uint32_t D, const pkvi_kparams *p,
                         const tile *t, const float *s, const float *alpha)
{
    const uint32_t dv = walk_dv(p, D), hg = p->hg;
    const size_t vrb = row_bytes_of(dt, dv);
    if (t->pfv)
        pf_rows(t->pfv, vrb, t->n, p->pf_l2);
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4)
        pv_heads(dt, t->v, vrb, dv, t->n, s + h * PKVI_TILE, alpha + h, t->acc + (size_t)h * dv, 4);
    if (hg - h >= 2) {
        pv_heads(dt, t->v, vrb, dv, t->n, s + h * PKVI_TILE, alpha + h, t->acc + (size_t)h * dv, 2);
        h += 2;
    }
    if (h < hg)
        pv_heads(dt, t->v, vrb, dv, t->n, s + h * PKVI_TILE, alpha + h, t->acc + (size_t)h * dv, 1);
}

#endif /* PKV_KERNELS_NEON_PV_H */

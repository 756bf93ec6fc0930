/*
 * kernels/neon_qd.h - the NEON kernels' integer-dot scores (quant_dot = 1, Q8/Q4 rows):
 * the q side prepared as ref.c's (pkvi_quant_query; Q4's q in walk.h's qd_permute
 * order), then per row, block and head the exact int32 sum of the block's 32 products,
 * and the score summed over blocks in block order as ref.c does:
 *     dot = dot + (dk_b * dq_b) * (float)isum_b
 *
 * The block's sum is one SDOT pair where the compiler targets the dot-product
 * extension (__ARM_FEATURE_DOTPROD: neondot.c's -march), else widening multiplies
 * (SMULL/SMLAL, int16 pairs of at most 2 * 127 * 128, then SADALP into int32). Both are
 * the exact integer, so the neon and neon_dotprod tables give the same bits
 * (tests/test_kernels.c, vnni_same_bits). For neon.c and neondot.c. No state.
 */
#ifndef PKV_KERNELS_NEON_QD_H
#define PKV_KERNELS_NEON_QD_H

#include "kernels/kernels.h"
#include "kernels/neon_load.h"
#include "kernels/walk.h"
#include "base/quant.h"

#include <arm_neon.h>
#include <stdbool.h>
#include <string.h>

/* The exact sum of the 32 products of q's block (q0, q1) and k's (k0, k1). */
PKVI_INLINE int32_t qd_isum(int8x16_t q0, int8x16_t q1, int8x16_t k0, int8x16_t k1)
{
#if defined(__ARM_FEATURE_DOTPROD)
    return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), q0, k0), q1, k1));
#else
    int16x8_t p0 = vmull_s8(vget_low_s8(q0), vget_low_s8(k0));
    p0 = vmlal_high_s8(p0, q0, k0);
    int16x8_t p1 = vmull_s8(vget_low_s8(q1), vget_low_s8(k1));
    p1 = vmlal_high_s8(p1, q1, k1);
    return vaddvq_s32(vpadalq_s16(vpaddlq_s16(p0), p1));
#endif
}

/* A block's 32 integers as two vectors in the order q is prepared in: Q8 in row order;
 * Q4 the low nibbles (values 0, 2, .., 30) then the high ones (1, 3, .., 31), minus 8.
 * A shorter last block (m < 32 values) is copied into zeros first, so no byte past the
 * row is read; its q past m is 0, so what the padding holds adds nothing. */
PKVI_INLINE void qd_block_ints(const pkv_dtype dt, const char *blk, uint32_t m, int8x16_t k[2])
{
    const size_t bytes = dt == PKV_Q8 ? m : (m + 1) / 2;
    unsigned char pad[32];
    const unsigned char *src = (const unsigned char *)blk + 2;
    if (m < 32) {
        memset(pad, 0, sizeof pad);
        memcpy(pad, src, bytes);
        src = pad;
    }
    if (dt == PKV_Q8) {
        k[0] = vld1q_s8((const int8_t *)(const void *)src);
        k[1] = vld1q_s8((const int8_t *)(const void *)(src + 16));
        return;
    }
    const uint8x16_t b = vld1q_u8(src);
    k[0] = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15))), vdupq_n_s8(8));
    k[1] = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(b, 4)), vdupq_n_s8(8));
}

/* Unscaled integer-dot scores of the tile's rows for all hg heads into s [hg][TILE]:
 * row by row, block by block; each K block is read once for all heads. */
PKVI_INLINE void tile_qk_int(const pkv_dtype dt, const uint32_t D, const pkvi_kparams *p,
                             const tile *t, float *s)
{
    const uint32_t d = walk_dk(p, D), hg = p->hg, nb = (d + 31) / 32, dp = nb * 32;
    const size_t rb = row_bytes_of(dt, d), bb = pkvi_quant_block_bytes(dt);
    if (t->pfk)
        pf_rows(t->pfk, rb, t->n, p->pf_l2);
    for (uint32_t r = 0; r < t->n; r++) {
        const char *row = t->k + (size_t)r * rb;
        for (uint32_t h = 0; h < hg; h++)
            s[h * PKVI_TILE + r] = 0.0f;
        for (uint32_t b = 0; b < nb; b++) {
            const char *blk = row + (size_t)b * bb;
            const uint32_t m = d - b * 32 < 32 ? d - b * 32 : 32;
            int8x16_t k[2];
            qd_block_ints(dt, blk, m, k);
            const float dk = vgetq_lane_f32(q_scale4(blk), 0);
            for (uint32_t h = 0; h < hg; h++) {
                const int8_t *qh = t->qi + (size_t)h * dp + (size_t)b * 32;
                const int32_t isum = qd_isum(vld1q_s8(qh), vld1q_s8(qh + 16), k[0], k[1]);
                float *o = s + h * PKVI_TILE + r;
                *o = *o + (dk * t->qs[(size_t)h * nb + b]) * (float)isum;
            }
        }
    }
}

/* Head q (d values) into slot k of the scratch (walk_prep_fn): quantized as ref.c's
 * (pkvi_quant_query), Q4's in qd_permute's order. */
PKVI_INLINE void prep_head_int(const pkv_dtype dt, const qk_kind qk, uint32_t d, float scale,
                               const float *q, prep_scratch *ps, size_t k)
{
    (void)qk;
    (void)scale;
    const uint32_t nb = (d + 31) / 32, dpad = nb * 32;
    pkvi_quant_query(d, q, ps->u.qi + k * dpad, ps->qs + k * nb);
    qd_permute(dt, ps->u.qi + k * dpad, dpad);
}

#endif /* PKV_KERNELS_NEON_QD_H */

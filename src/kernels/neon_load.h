/*
 * kernels/neon_load.h - the NEON kernels' row loads: 8 values of a stored K or V row
 * widened to f32 (two vectors), and one value for a row's tail. f16 by FCVTL (exact),
 * bf16 by a 16-bit shift (exact), Q8/Q4 as quant.c's load_block: scale * (float)int,
 * one rounding, so every load is the value ref.c's pkvi_load_row gives. For neon.c and
 * neondot.c. No state.
 */
#ifndef PKV_KERNELS_NEON_LOAD_H
#define PKV_KERNELS_NEON_LOAD_H

#include "kernels/kernels.h"
#include "kernels/walk.h" /* qtype */
#include "base/half.h"
#include "base/quant.h"

#include <arm_neon.h>
#include <stdbool.h>
#include <string.h>

/* A Q8/Q4 block's f16 scale, in every lane. */
PKVI_INLINE float32x4_t q_scale4(const char *blk)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_dup_u16((const uint16_t *)(const void *)blk)));
}

/* The 8 integers of values j .. j+7 (j % 8 == 0) of a Q8/Q4 block, as int16. Q4 holds
 * value 2i in the low nibble of byte i and 2i+1 in the high one: the nibbles of 4 bytes
 * interleaved back into row order. Reads only the bytes of those 8 values. */
PKVI_INLINE int16x8_t q_ints8(const pkv_dtype dt, const char *blk, uint32_t j)
{
    if (dt == PKV_Q8)
        return vmovl_s8(vld1_s8((const int8_t *)(const void *)(blk + 2 + j)));
    uint32_t w;
    memcpy(&w, blk + 2 + j / 2, sizeof w);
    const uint8x8_t b = vcreate_u8(w);
    const uint8x8_t z = vzip1_u8(vand_u8(b, vdup_n_u8(15)), vshr_n_u8(b, 4));
    return vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(z)), vdupq_n_s16(8));
}

/* Values c .. c+7 of a row (c % 8 == 0, c + 8 <= the row's length): row is the row's
 * first byte. */
PKVI_INLINE void ld8(const pkv_dtype dt, const char *row, uint32_t c, float32x4_t v[2])
{
    if (dt == PKV_F32) {
        v[0] = vld1q_f32((const float *)(const void *)row + c);
        v[1] = vld1q_f32((const float *)(const void *)row + c + 4);
    } else if (dt == PKV_F16) {
        const uint16x8_t h = vld1q_u16((const uint16_t *)(const void *)row + c);
        v[0] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
        v[1] = vcvt_high_f32_f16(vreinterpretq_f16_u16(h)); /* FCVTL2: no lane move */
    } else if (dt == PKV_BF16) {
        const uint16x8_t h = vld1q_u16((const uint16_t *)(const void *)row + c);
        v[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
        v[1] = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
    } else {
        const char *blk = row + (size_t)(c / 32) * pkvi_quant_block_bytes(dt);
        const float32x4_t d = q_scale4(blk);
        const int16x8_t q = q_ints8(dt, blk, c % 32);
        v[0] = vmulq_f32(d, vcvtq_f32_s32(vmovl_s16(vget_low_s16(q))));
        v[1] = vmulq_f32(d, vcvtq_f32_s32(vmovl_high_s16(q)));
    }
}

/* Value c of a row, the same f32 as ld8's lane. */
PKVI_INLINE float ld1(const pkv_dtype dt, const char *row, uint32_t c)
{
    if (dt == PKV_F32) {
        float x;
        memcpy(&x, row + (size_t)c * 4, sizeof x);
        return x;
    }
    uint16_t h;
    if (dt == PKV_F16 || dt == PKV_BF16) {
        memcpy(&h, row + (size_t)c * 2, sizeof h);
        if (dt == PKV_F16)
            return pkvi_f16_to_f32(h);
        const uint32_t u = (uint32_t)h << 16;
        float x;
        memcpy(&x, &u, sizeof x);
        return x;
    }
    const unsigned char *blk = (const unsigned char *)row + (size_t)(c / 32) * pkvi_quant_block_bytes(dt);
    memcpy(&h, blk, sizeof h);
    return pkvi_f16_to_f32(h) * (float)pkvi_quant_block_int(dt, blk, c % 32);
}

/* Byte offset of value c in a row (c % 8 == 0): where a prefetch for it goes. */
PKVI_INLINE size_t val_offset(const pkv_dtype dt, uint32_t c)
{
    if (qtype(dt))
        return (size_t)(c / 32) * pkvi_quant_block_bytes(dt) + 2 +
               (dt == PKV_Q8 ? c % 32 : (c % 32) / 2);
    return (size_t)c * (dt == PKV_F32 ? 4u : 2u);
}

/* The lines of n rows of rb bytes each, row t at a + t * rb, asked for ahead (pf_line):
 * every 64 bytes of a row and its last byte (a row need not start a line). */
PKVI_INLINE void pf_rows(const char *a, size_t rb, uint32_t n, const bool l2)
{
    for (uint32_t t = 0; t < n; t++) {
        const char *r = a + (size_t)t * rb;
        for (size_t o = 0; o < rb; o += 64)
            pf_line(r + o, l2);
        pf_line(r + rb - 1, l2);
    }
}

#endif /* PKV_KERNELS_NEON_LOAD_H */

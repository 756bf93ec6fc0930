/*
 * quant.h - the block-quantized storage types Q8 and Q4 (quant.c has the format).
 * Called through dtype.c's row conversions; nothing else needs the block layout.
 */
#ifndef PAGEDKV_QUANT_H
#define PAGEDKV_QUANT_H

#include "base/util.h"

/* Bytes of a row of n values of t (PKV_Q8 or PKV_Q4), scales included: full blocks of
 * 2 + 32 (Q8) or 2 + 16 (Q4) bytes, and a last block of m < 32 values of 2 + m or
 * 2 + ceil(m/2). Inline: the SIMD kernels fold it for their constant dtype. */
static inline size_t pkvi_quant_row_bytes(pkv_dtype t, uint32_t n)
{
    const size_t rem = n % 32;
    return (size_t)(n / 32) * (t == PKV_Q8 ? 34u : 18u) +
           (rem ? 2 + (t == PKV_Q8 ? rem : (rem + 1) / 2) : 0);
}
/* dst (pkvi_quant_row_bytes(t, n) bytes) = quant(src[0..n)) */
PKVI_HIDDEN void pkvi_quant_store_row(pkv_dtype t, void *dst, const float *src, uint32_t n);
/* The covering scale d_0 of a block (quant.c's header has the rule), as f16 bits with
 * its sign: a = the block's largest magnitude (finite, > 0); for PKV_Q4, b = the largest
 * magnitude of the values whose sign is not that of the first value of magnitude a,
 * and neg = whether that value is negative (Q8 reads neither). The scale search starts
 * from it; quant.c and the SIMD stores (kernels/qstore256.h) share it. */
PKVI_HIDDEN uint16_t pkvi_quant_first_scale(pkv_dtype t, float a, float b, bool neg);
/* dst[0..n) = dequant(src) */
PKVI_HIDDEN void pkvi_quant_load_row(pkv_dtype t, float *dst, const void *src, uint32_t n);

/*
 * The query side of the integer-dot path (quant_dot = 1, docs/numerics.md "The
 * integer-dot path"): n values of one query head cut into the K rows' blocks of 32,
 * each block b with its own f32 scale qs[b] = a_b / 127 (a_b = max |x_j| of the
 * block) and int8 values qi[j] = clamp(rint(x_j / qs[b]), -127, 127) (nearest even).
 * A zero block, or one whose scale underflows to 0, is qs = 0, qi = 0; a block
 * holding a NaN or an infinity is qs = NaN, qi = 0 (its head's scores are NaN, as on
 * the exact path). qi has ceil(n/32)*32 bytes (the tail past n is 0), qs ceil(n/32).
 */
PKVI_HIDDEN void pkvi_quant_query(uint32_t n, const float *x, int8_t *qi, float *qs);

/* The integer a block of row values holds: value j of the block at blk (Q8: int8;
 * Q4: nibble - 8), and the block's scale as f32. For the scalar kernel. */
static inline int pkvi_quant_block_int(pkv_dtype t, const unsigned char *blk, uint32_t j)
{
    return t == PKV_Q8 ? (int)(signed char)blk[2 + j]
                       : (int)((blk[2 + j / 2] >> (4 * (j % 2))) & 15u) - 8;
}
/* Bytes of a full block (2 + 32 or 2 + 16). */
static inline size_t pkvi_quant_block_bytes(pkv_dtype t)
{
    return t == PKV_Q8 ? 34u : 18u;
}

#endif /* PAGEDKV_QUANT_H */

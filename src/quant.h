/*
 * quant.h - the block-quantized storage types Q8 and Q4 (quant.c has the format).
 * Called through dtype.c's row conversions; nothing else needs the block layout.
 */
#ifndef PAGEDKV_QUANT_H
#define PAGEDKV_QUANT_H

#include "util.h"

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
/* dst[0..n) = dequant(src) */
PKVI_HIDDEN void pkvi_quant_load_row(pkv_dtype t, float *dst, const void *src, uint32_t n);

#endif /* PAGEDKV_QUANT_H */

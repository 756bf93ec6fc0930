/*
 * quant.h - the block-quantized storage types Q8 and Q4 (quant.c has the format).
 * Called through dtype.c's row conversions; nothing else needs the block layout.
 */
#ifndef PAGEDKV_QUANT_H
#define PAGEDKV_QUANT_H

#include "util.h"

/* Bytes of a row of n values of t (PKV_Q8 or PKV_Q4), scales included. */
PKVI_HIDDEN size_t pkvi_quant_row_bytes(pkv_dtype t, uint32_t n);
/* dst (pkvi_quant_row_bytes(t, n) bytes) = quant(src[0..n)) */
PKVI_HIDDEN void pkvi_quant_store_row(pkv_dtype t, void *dst, const float *src, uint32_t n);
/* dst[0..n) = dequant(src) */
PKVI_HIDDEN void pkvi_quant_load_row(pkv_dtype t, float *dst, const void *src, uint32_t n);

#endif /* PAGEDKV_QUANT_H */

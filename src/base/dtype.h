/*
 * dtype.h - conversion between f32 and the storage types of cached K/V (dtype.c).
 *
 * Round-to-nearest-even on store (docs/numerics.md, section 2); exact widening on load.
 */
#ifndef PAGEDKV_DTYPE_H
#define PAGEDKV_DTYPE_H

#include "base/half.h"
/* dst (n values of dtype t) = round(src[0..n)) */
PKVI_HIDDEN void pkvi_store_row(pkv_dtype t, void *dst, const float *src, uint32_t n);
/* dst[0..n) = src (n values of dtype t) as f32 */
PKVI_HIDDEN void pkvi_load_row(pkv_dtype t, float *dst, const void *src, uint32_t n);

#endif /* PAGEDKV_DTYPE_H */

/*
 * half.h - f32 <-> f16 and bf16 for one value (half.c): the rounding that defines what
 * an f16 or bf16 cache stores, and the f16 scales of the block types.
 */
#ifndef PAGEDKV_HALF_H
#define PAGEDKV_HALF_H

#include "base/util.h"

PKVI_HIDDEN uint16_t pkvi_f32_to_f16(float x);
PKVI_HIDDEN float    pkvi_f16_to_f32(uint16_t h);
PKVI_HIDDEN uint16_t pkvi_f32_to_bf16(float x);
PKVI_HIDDEN float    pkvi_bf16_to_f32(uint16_t h);

#endif /* PAGEDKV_HALF_H */

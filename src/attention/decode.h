/*
 * decode.h - the attention pipeline (decode.c): pkv_decode, pkv_decode_batch and
 * pkv_prefill are its public entry points; this header declares what its tests reach.
 */
#ifndef PAGEDKV_DECODE_H
#define PAGEDKV_DECODE_H

#include "base/util.h"

/* The chunk of C that a set's t-th chunk task walks when R threads share them: a
 * permutation of [0, C) for t in [0, C), the identity for R = 1 (decode.c says why). */
PKVI_HIDDEN uint32_t pkvi_chunk_order(uint32_t t, uint32_t C, uint32_t R);

#endif /* PAGEDKV_DECODE_H */

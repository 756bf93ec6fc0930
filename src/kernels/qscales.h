/*
 * kernels/qscales.h - the f16 scales of a tile's Q8/Q4 blocks, four rows to a 64-bit
 * word built in general registers, for the SIMD kernels to move into a vector: where
 * this was a gather (AVX-512) or 16 two-byte stores read back as one vector (AVX2: a
 * store forwarding that fails), the vector units see a move per four scales
 * (docs/performance.md, decision table: qscales). No state.
 */
#ifndef PKV_KERNELS_QSCALES_H
#define PKV_KERNELS_QSCALES_H

#include "kernels/kernels.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Rows r0 .. r0+3 of a tile whose first row's block is at blk0, row_bytes apart: their
 * block's scale bits, row r0's in the low 16; 0 for rows at or past n (not read). */
PKVI_INLINE long long block_scales4(const char *blk0, size_t row_bytes, uint32_t r0, uint32_t n)
{
    uint64_t x = 0;
    if (r0 + 4 <= n) { /* four whole rows (every tile but a page's last): no row tests */
        PKVI_UNROLL
        for (uint32_t j = 0; j < 4; j++) {
            uint16_t h;
            memcpy(&h, blk0 + (r0 + j) * row_bytes, sizeof h);
            x |= (uint64_t)h << (16 * j);
        }
        return (long long)x;
    }
    PKVI_UNROLL
    for (uint32_t j = 0; j < 4; j++) {
        uint16_t h = 0;
        if (r0 + j < n)
            memcpy(&h, blk0 + (r0 + j) * row_bytes, sizeof h);
        x |= (uint64_t)h << (16 * j);
    }
    return (long long)x;
}

/* Rows a .. a+3 in the low 64 bits, rows b .. b+3 in the high. */
PKVI_INLINE __m128i block_scales8(const char *blk0, size_t row_bytes, uint32_t n, uint32_t a, uint32_t b)
{
    return _mm_insert_epi64(_mm_cvtsi64_si128(block_scales4(blk0, row_bytes, a, n)),
                            block_scales4(blk0, row_bytes, b, n), 1);
}

#endif

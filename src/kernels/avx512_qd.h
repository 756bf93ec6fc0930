/*
 * kernels/avx512_qd.h - the pieces of the AVX-512 integer-dot scores that both AVX-512
 * tables share: two whole blocks of a K row in one zmm (kblocks2_i8) and the transposed
 * reduction of their partial dots (qd_hsum8x2). avx512.c and avx512vnni.c each build
 * their qd_wide_blocks on them (vpmaddubsw + vpmaddwd, or vpdpbusd). No state.
 */
#ifndef PKV_KERNELS_AVX512_QD_H
#define PKV_KERNELS_AVX512_QD_H

#include "kernels/kernels.h"

#include <immintrin.h>
#include <stdint.h>

/* ---- the integer-dot scores, two blocks per vector ------------------------------------
 * qdot256.h's arithmetic on 512-bit vectors: the K integers of blocks b and b+1 of a
 * row in one zmm (Q4: each block's low nibbles, then its high ones, the order q is
 * permuted to), |k| times q with k's sign (a byte mask from k, then a masked negation:
 * AVX-512 has no vpsignb), vpmaddubsw then vpmaddwd by ones, exact as there. */
PKVI_INLINE __m512i kblocks2_i8(pkv_dtype dt, const char *blk, size_t bb)
{
    if (dt == PKV_Q8)
        return _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(blk + 2))),
            _mm256_loadu_si256((const void *)(blk + bb + 2)), 1);
    const __m256i x = _mm256_set_m128i(_mm_loadu_si128((const void *)(blk + bb + 2)),
                                       _mm_loadu_si128((const void *)(blk + 2)));
    /* [x0, x1, x0 >> 4, x1 >> 4] in 128-bit lanes, then [x0, x0 >> 4, x1, x1 >> 4] */
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(x), _mm256_srli_epi16(x, 4), 1);
    z = _mm512_shuffle_i32x4(z, z, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm512_sub_epi8(_mm512_and_si512(z, _mm512_set1_epi8(15)), _mm512_set1_epi8(8));
}

/* The transposed reduction of qd_hsum8i for two blocks: v[i] holds pair i's int32
 * partials of block b (lanes 0-7) and b+1 (lanes 8-15); lane i of the result is pair
 * i's exact isum of block b, lane 8 + i its isum of block b+1. */
PKVI_INLINE __m512i qd_hsum8x2(const __m512i v[8])
{
    __m512i t[4], u[2];
    PKVI_UNROLL
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    PKVI_UNROLL
    for (int i = 0; i < 2; i++) /* per 128-bit lane: the 4 sums of pairs 4i .. 4i+3 */
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    /* [b: 0-3, b+1: 0-3, b: 4-7, b+1: 4-7], then blocks in halves */
    const __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0));
}

PKVI_INLINE uint32_t qd_wide_count(uint32_t d, uint32_t nb) /* qd_wide_blocks' loop bound */
{
    return (d / 32 < nb ? d / 32 : nb) & ~1u;
}

#endif /* PKV_KERNELS_AVX512_QD_H */

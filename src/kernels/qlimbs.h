/*
 * kernels/qlimbs.h - the block exponent of the exact path's integer limbs of q
 * (docs/numerics.md section 3), for the avx512vnni table (avx512vnni.c); the avx2vnni
 * table keeps avx2's f32 scores (docs/performance.md, decision table: avx2vnni-exact).
 * Plain C, no state.
 */
#ifndef PKV_KERNELS_QLIMBS_H
#define PKV_KERNELS_QLIMBS_H

#include "kernels/kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define QL_LIMBS 4 /* L, M, N, H: Q = H 2^24 + N 2^16 + M 2^8 + L */

/* 2^e for e in [-149, 127], exactly */
PKVI_INLINE float ldexp_pow2(int e)
{
    if (e < -126)
        return ldexpf(1.0f, e);
    const uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* e = max(ilogb(a) - 29, -149) for a block's largest |q| a (finite, not negative; 0
 * gives -149), so that |rint(q 2^-e)| <= 2^30. ilogb from the exponent field where a
 * is normal, libm's below (docs/performance.md, decision table: QL_LIMBS). */
#define QL_SHIFT (8 * QL_LIMBS - 3) /* ilogb(a) - e: the top limb's H stays in [-64, 64] */
PKVI_INLINE int ql_block_exp(float a)
{
    int e = -149;
    if (a >= 0x1p-126f) {
        uint32_t bits;
        memcpy(&bits, &a, sizeof bits);
        e = (int)(bits >> 23) - 127 - QL_SHIFT;
    } else if (a > 0.0f) {
        e = ilogbf(a) - QL_SHIFT > e ? ilogbf(a) - QL_SHIFT : e;
    }
    return e;
}

#endif /* PKV_KERNELS_QLIMBS_H */

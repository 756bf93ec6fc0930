/*
 * half.c - the scalar conversions between f32 and the 16-bit storage types that define
 * what the cache stores: f32 -> f16/bf16 with round-to-nearest-even (ties to even),
 * NaN kept a quiet NaN with its sign, overflow to infinity; and the exact widening
 * back to f32. SIMD kernels must produce bitwise the same values (tests/test_kernels.c
 * checks it); hardware F16C conversion does. Below dtype.c (rows) and quant.c (the
 * block types' f16 scales), which both use it.
 */
#include "base/half.h"

#include <string.h>

static uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

uint16_t pkvi_f32_to_f16(float x)
{
    uint32_t u = bits_of(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;

    if (a >= 0x7f800000u) /* inf stays inf; NaN becomes a quiet NaN, payload kept */
        return (uint16_t)(sign | 0x7c00u |
                          (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
    if (a >= 0x477ff000u) /* >= 65520 rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {
        /* Below 2^-14: an f16 subnormal or zero. Adding 0.5f lines the f16 subnormal
         * unit (2^-24) up with the f32 ulp at 0.5 (2^-24), so the FPU's own
         * round-to-nearest-even does the rounding; subtract the bits of 0.5f back. */
        float f = float_of(a) + 0.5f;
        return (uint16_t)(sign | (bits_of(f) - 0x3f000000u));
    }
    /* Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to
     * nearest, ties to the even mantissa. A carry into the exponent is correct. */
    uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd; /* (15 - 127) << 23, plus half-ulp minus one, plus odd */
    return (uint16_t)(sign | (a >> 13));
}

float pkvi_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0) {
        /* zero or subnormal: m * 2^-24, exact in f32 */
        float f = (float)m * 0x1p-24f;
        return float_of(sign | bits_of(f));
    }
    if (e == 31)
        return float_of(sign | 0x7f800000u | (m << 13));
    return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t pkvi_f32_to_bf16(float x)
{
    uint32_t u = bits_of(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign and top payload, quiet */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

float pkvi_bf16_to_f32(uint16_t h)
{
    return float_of((uint32_t)h << 16);
}

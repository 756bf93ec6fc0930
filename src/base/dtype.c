/*
 * dtype.c - storage types of cached K/V, a row at a time: f32, f16 (IEEE binary16) and
 * bf16 through half.c's conversions, and the block types Q8 and Q4 through quant.c.
 *
 * Owns the scalar conversions that define what the cache stores: f32 -> f16/bf16 with
 * round-to-nearest-even (ties to even), NaN kept a quiet NaN with its sign, overflow to
 * infinity; and the exact widening back to f32. SIMD kernels must produce bitwise the
 * same values (tests/test_kernels.c checks it); hardware F16C conversion does.
 */
#include "base/dtype.h"
#include "base/quant.h"

#include <string.h>

void pkvi_store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    switch (t) {
    case PKV_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case PKV_F16: {
        uint16_t *o = dst;
        for (uint32_t i = 0; i < n; i++)
            o[i] = pkvi_f32_to_f16(src[i]);
        break;
    }
    case PKV_BF16: {
        uint16_t *o = dst;
        for (uint32_t i = 0; i < n; i++)
            o[i] = pkvi_f32_to_bf16(src[i]);
        break;
    }
    case PKV_Q8:
    case PKV_Q4:
        pkvi_quant_store_row(t, dst, src, n);
        break;
    }
}

void pkvi_load_row(pkv_dtype t, float *dst, const void *src, uint32_t n)
{
    switch (t) {
    case PKV_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case PKV_F16: {
        const uint16_t *p = src;
        for (uint32_t i = 0; i < n; i++)
            dst[i] = pkvi_f16_to_f32(p[i]);
        break;
    }
    case PKV_BF16: {
        const uint16_t *p = src;
        for (uint32_t i = 0; i < n; i++)
            dst[i] = pkvi_bf16_to_f32(p[i]);
        break;
    }
    case PKV_Q8:
    case PKV_Q4:
        pkvi_quant_load_row(t, dst, src, n);
        break;
    }
}

size_t pkv_dtype_size(pkv_dtype t)
{
    switch (t) {
    case PKV_F32: return 4;
    case PKV_F16: return 2;
    case PKV_BF16: return 2;
    case PKV_Q8:
    case PKV_Q4: return 0; /* block types: see pkv_row_bytes */
    }
    return 0;
}

size_t pkv_row_bytes(pkv_dtype t, uint32_t n)
{
    if (n == 0)
        return 0;
    switch (t) {
    case PKV_F32:
    case PKV_F16:
    case PKV_BF16: return (size_t)n * pkv_dtype_size(t);
    case PKV_Q8:
    case PKV_Q4: return pkvi_quant_row_bytes(t, n);
    }
    return 0;
}

void pkv_dtype_round_row(pkv_dtype t, uint32_t n, const float *src, float *dst)
{
    if (n == 0 || !src || !dst || pkv_row_bytes(t, n) == 0)
        return;
    if (t == PKV_Q8 || t == PKV_Q4) {
        /* a row's blocks one at a time: no buffer of the row's size is needed */
        unsigned char blk[2 + 32];
        for (uint32_t i = 0; i < n; i += 32) {
            const uint32_t m = n - i < 32 ? n - i : 32;
            pkvi_quant_store_row(t, blk, src + i, m);
            pkvi_quant_load_row(t, dst + i, blk, m);
        }
        return;
    }
    for (uint32_t i = 0; i < n; i++)
        dst[i] = pkv_dtype_round(t, src[i]);
}

const char *pkv_dtype_name(pkv_dtype t)
{
    switch (t) {
    case PKV_F32: return "f32";
    case PKV_F16: return "f16";
    case PKV_BF16: return "bf16";
    case PKV_Q8: return "q8";
    case PKV_Q4: return "q4";
    }
    return "?";
}

float pkv_dtype_round(pkv_dtype t, float x)
{
    switch (t) {
    case PKV_F32: return x;
    case PKV_F16: return pkvi_f16_to_f32(pkvi_f32_to_f16(x));
    case PKV_BF16: return pkvi_bf16_to_f32(pkvi_f32_to_bf16(x));
    case PKV_Q8:
    case PKV_Q4: {
        float y;
        pkv_dtype_round_row(t, 1, &x, &y);
        return y;
    }
    }
    return x;
}

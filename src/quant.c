/*
 * quant.c - the block-quantized storage types PKV_Q8 and PKV_Q4 (SPEC §9): one row
 * (head_dim or head_dim_v values of one token's K or V of one group) cut into blocks
 * of 32 values, the last possibly shorter, each with its own scale. docs/numerics.md
 * ("Quantized pages") is the format's reference; this file is its definition.
 *
 * Block of m values (1 <= m <= 32), at byte offset 0 of its slot:
 *   Q8:  f16 scale d, then m int8 q_j in [-127, 127]            2 + m bytes
 *   Q4:  f16 scale d, then ceil(m/2) bytes: q_j + 8 in a nibble  2 + ceil(m/2) bytes
 *        (value 2i in the low nibble of byte i, 2i+1 in the high; q_j in [-7, 7]; an
 *        odd block's last high nibble is 0)
 * Quantization (symmetric, per block): a = max_j |x_j|; d = f16(a / Q) (Q = 127 or 7)
 * rounded to nearest even, raised to the smallest f16 subnormal when a > 0 would round
 * it to 0, and saturated at the f16 maximum 65504; q_j = clamp(rint(x_j / d), -Q, Q)
 * with the current (nearest-even) rounding mode. Dequantization: x_j = d * q_j, exact
 * in f32 (an 11-bit scale times a 7-bit integer). A zero block stores d = 0, q = 0.
 * A block holding a NaN or an infinity stores d = NaN and q = 0: its values read back
 * as NaN, and only that block (of that row) is affected.
 * Error: |x_j - d q_j| <= d / 2 for every value within the saturation range
 * (|x| <= Q * 65504); tests/test_quant.c holds it for rows of every length 1..300.
 */
#include "quant.h"
#include "half.h"

#include <math.h>
#include <string.h>

#define BLOCK 32u

static uint32_t qmax(pkv_dtype t)
{
    return t == PKV_Q8 ? 127u : 7u;
}

/* Bytes of a block of m values. */
static size_t block_bytes(pkv_dtype t, uint32_t m)
{
    return 2u + (t == PKV_Q8 ? m : (m + 1) / 2);
}

/* The scale of a block whose largest magnitude is a (finite, >= 0). */
static uint16_t block_scale(pkv_dtype t, float a)
{
    if (a == 0.0f)
        return 0;
    const float d = a / (float)qmax(t);
    uint16_t h = pkvi_f32_to_f16(d);
    if (h == 0)
        h = 1; /* the smallest subnormal: tiny blocks keep their half-step bound */
    if (h >= 0x7c00u)
        h = 0x7bffu; /* 65504: saturate rather than store an infinite scale */
    return h;
}

static void put16(unsigned char *p, uint16_t v)
{
    memcpy(p, &v, sizeof v); /* host order, as f16 pages are stored */
}

static uint16_t get16(const unsigned char *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static void store_block(pkv_dtype t, unsigned char *dst, const float *x, uint32_t m)
{
    float a = 0.0f;
    bool finite = true;
    for (uint32_t j = 0; j < m; j++) {
        finite &= isfinite(x[j]) != 0;
        a = fabsf(x[j]) > a ? fabsf(x[j]) : a;
    }
    unsigned char *q = dst + 2;
    memset(q, 0, block_bytes(t, m) - 2);
    if (!finite) {
        put16(dst, 0x7e00u); /* NaN scale: the block reads back as NaN */
        if (t == PKV_Q4)
            for (uint32_t j = 0; j < m; j++)
                q[j / 2] |= (unsigned char)(8u << (4 * (j % 2)));
        return;
    }
    const uint16_t h = block_scale(t, a);
    put16(dst, h);
    const float d = pkvi_f16_to_f32(h);
    const float Q = (float)qmax(t);
    for (uint32_t j = 0; j < m; j++) {
        float r = d > 0.0f ? rintf(x[j] / d) : 0.0f;
        r = r > Q ? Q : r < -Q ? -Q : r;
        const int v = (int)r;
        if (t == PKV_Q8)
            q[j] = (unsigned char)(signed char)v;
        else
            q[j / 2] |= (unsigned char)((unsigned)(v + 8) << (4 * (j % 2)));
    }
}

static void load_block(pkv_dtype t, float *x, const unsigned char *src, uint32_t m)
{
    const float d = pkvi_f16_to_f32(get16(src));
    const unsigned char *q = src + 2;
    for (uint32_t j = 0; j < m; j++) {
        const int v = t == PKV_Q8 ? (int)(signed char)q[j]
                                  : (int)((q[j / 2] >> (4 * (j % 2))) & 15u) - 8;
        x[j] = d * (float)v;
    }
}

void pkvi_quant_store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    unsigned char *p = dst;
    for (uint32_t i = 0; i < n; i += BLOCK) {
        const uint32_t m = n - i < BLOCK ? n - i : BLOCK;
        store_block(t, p, src + i, m);
        p += block_bytes(t, m);
    }
}

void pkvi_quant_load_row(pkv_dtype t, float *dst, const void *src, uint32_t n)
{
    const unsigned char *p = src;
    for (uint32_t i = 0; i < n; i += BLOCK) {
        const uint32_t m = n - i < BLOCK ? n - i : BLOCK;
        load_block(t, dst + i, p, m);
        p += block_bytes(t, m);
    }
}

void pkvi_quant_query(uint32_t n, const float *x, int8_t *qi, float *qs)
{
    for (uint32_t i = 0, b = 0; i < n; i += BLOCK, b++) {
        const uint32_t m = n - i < BLOCK ? n - i : BLOCK;
        float a = 0.0f;
        bool finite = true;
        for (uint32_t j = 0; j < m; j++) {
            finite &= isfinite(x[i + j]) != 0;
            a = fabsf(x[i + j]) > a ? fabsf(x[i + j]) : a;
        }
        const float d = finite ? a / 127.0f : NAN;
        memset(qi + i, 0, BLOCK);
        qs[b] = d;
        if (!(d > 0.0f)) /* zero, underflowed or not finite: qi stays 0 */
            continue;
        for (uint32_t j = 0; j < m; j++) {
            float r = rintf(x[i + j] / d);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            qi[i + j] = (int8_t)r;
        }
    }
}

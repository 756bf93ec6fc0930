/*
 * quant.c - the block-quantized storage types PKV_Q8 and PKV_Q4 (docs/numerics.md,
 * section 6): one row (head_dim or head_dim_v values of one token's K or V of one
 * group) cut into blocks of 32 values, the last possibly shorter, each with its own
 * scale. docs/numerics.md ("Quantized pages") is the format's reference; this file is
 * its definition.
 *
 * Block of m values (1 <= m <= 32), at byte offset 0 of its slot:
 *   Q8:  f16 scale d, then m int8 q_j in [-127, 127]            2 + m bytes
 *   Q4:  f16 scale d, then ceil(m/2) bytes: q_j + 8 in a nibble  2 + ceil(m/2) bytes
 *        (value 2i in the low nibble of byte i, 2i+1 in the high; q_j in [-8, 7]; an
 *        odd block's last high nibble is 0)
 * Quantization (symmetric, per block; a = max_j |x_j|). First the covering scale d_0:
 *   Q8:  d_0 = max(f16(a / 127) rounded to nearest even, the smallest f16 with
 *        127.5 d_0 >= a); codes in [-127, 127]. (The second is larger only where d_0 is
 *        an f16 subnormal, a < 127 * 2^-14: there nearest-even alone could leave a up to
 *        1.5 times past 127 steps, clamped far outside half a step.)
 *   Q4:  all 16 codes. d_0 takes the sign opposite to the block's first value of
 *        magnitude a, so the largest magnitude goes to the -8 end; b = the largest
 *        magnitude of the values of the other sign, which go to the 7 end. |d_0| =
 *        max(f16(a / 8) nearest even, the smallest f16 with 8.5 |d_0| >= a, the
 *        smallest f16 with 7.5 |d_0| >= b): a lands on -8 (up to the scale's rounding)
 *        and b on at most 7.5, so every value stays within half a step. Against the 15
 *        codes of [-7, 7] with d = a / 7, the step shrinks by up to 7/8: on bell-shaped
 *        rows the squared error falls to ~0.8, and on stories260K (head_dim 8, one block
 *        per row) Q4's mean KL against f32 by ~1/3 (docs/numerics.md). Q8 keeps
 *        [-127, 127]: the same scheme with 256 codes shrinks its step by at most 1/128,
 *        and measured no better on stories260K.
 * Then the scale search (search_scale): d is the one of the 8 scales f16(|d_0| (1 + k /
 *   64)), k = 0..7, sign of d_0, whose block has the least squared error (the smallest
 *   of equals). A scale a few percent coarser often puts the block's values nearer its
 *   codes: on bell-shaped rows of 128 the squared error falls by ~14% for Q8 and ~4%
 *   for Q4, on stories260K's 8-value blocks Q8's mean KL against f32 by ~1/3.
 *   q_j = clamp(rint(x_j / d), lo, hi).
 * |d| is raised to the smallest f16 subnormal when a > 0 would round it to 0 and
 * saturated at the f16 maximum 65504. Codes round in the current (nearest-even)
 * rounding mode, as rint does (code_of). Dequantization: x_j = d * q_j, exact in f32
 * (an 11-bit scale times a 7-bit integer). A zero block stores d = 0, q = 0. A block
 * holding a NaN or an infinity stores d = NaN and q = 0: its values read back as NaN,
 * and only that block (of that row) is affected. Loads read any scale and any code,
 * whichever quantizer wrote them.
 * Error: |x_j - d q_j| <= |d| / 2 for every value within the saturation range
 * (|x| <= 127 * 65504 for Q8, 7.5 * 65504 for Q4); tests/test_quant.c holds it for
 * rows of every length 1..300. The SIMD tables store through kernels/qstore256.h, which
 * must write these bytes (tests/test_kernels.c, quant_store_bitwise).
 */
#include "base/quant.h"
#include "base/half.h"

#include <math.h>
#include <string.h>

#define BLOCK 32u
#define SEARCH 8u          /* scales tried per block: |d_0| (1 + k / 64), k < 8 */
#define SEARCH_STEP (1.0f / 64.0f)

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF /* gcc in C11 mode does not contract either */
#endif

/* Bytes of a block of m values. */
static size_t block_bytes(pkv_dtype t, uint32_t m)
{
    return 2u + (t == PKV_Q8 ? m : (m + 1) / 2);
}

/* f16 bits of a scale magnitude v >= 0, rounded to nearest even; at least the smallest
 * subnormal (tiny blocks keep their half-step bound), at most 65504 (saturate rather
 * than store an infinite scale). */
static uint16_t scale_bits(float v)
{
    uint16_t h = pkvi_f32_to_f16(v);
    if (h == 0)
        h = 1;
    if (h >= 0x7c00u)
        h = 0x7bffu;
    return h;
}

/* max(h, the smallest f16 scale d with c d >= v), or 65504: values of magnitude <= v then
 * land at most on c, so clamped to the code below c + 1/2 they stay within half a step.
 * c is 7.5, 8.5 or 127.5, so c d is exact in f32 (at most 8 bits times 11) and the test
 * is exact. Counting h up to the first f16 that passes gives that maximum, as positive
 * f16 bits count up with their values; from h = f16(v / c), or from a / 127 or a / 8
 * rounded to nearest, it is at most one step. */
static uint16_t cover_from(uint16_t h, float v, float c)
{
    while (h < 0x7bffu && c * pkvi_f16_to_f32(h) < v)
        h++;
    return h;
}

uint16_t pkvi_quant_first_scale(pkv_dtype t, float a, float b, bool neg)
{
    /* a / 127 and a / 8 rounded to nearest, raised where that scale is so small (an f16
     * subnormal, a / 127 under 2^-14) that a would land more than half a step past the
     * end code: then to the least scale that keeps it within (the cover). Above the
     * subnormals the nearest scale always covers, and the test is one multiply. */
    if (t == PKV_Q8)
        return cover_from(scale_bits(a / 127.0f), a, 127.5f);
    const uint16_t ha = cover_from(scale_bits(a / 8.0f), a, 8.5f);
    const uint16_t hb = cover_from(scale_bits(b / 7.5f), b, 7.5f);
    const uint16_t h = ha > hb ? ha : hb; /* positive f16 bits order as their values */
    return neg ? h : (uint16_t)(h | 0x8000u); /* d < 0: a goes to the -8 end */
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

/* The code of y = x / d: rint(clamp(y, lo, hi)), which is clamp(rint(y), lo, hi) for
 * integer bounds; |clamped y| <= 127, so adding and taking away 1.5 * 2^23 rounds it to
 * the nearest integer, ties to even, as rint does in the default rounding mode (and
 * vectorizes where rintf would be a call on the baseline ISA). */
static inline float code_of(float y, float lo, float hi)
{
    y = y < hi ? y : hi; /* minss and maxss as written: y is finite here */
    y = y > lo ? y : lo;
    return (y + 0x1.8p23f) - 0x1.8p23f;
}

/* The scale search: of the distinct f16 scales |d_k| = f16(|d_0| (1 + k / 64)), k < 8
 * (d_0 the covering scale of the header's rule, its sign kept; candidates past 65504
 * dropped), the one whose stored block has the least squared error, summed in f32 in
 * value order; the smallest of equals. Every candidate is at least d_0, so every value
 * stays within half a step of its block's scale. The candidates' sums run side by side
 * (a loop the compiler vectorizes across k), each over the values in order, so they are
 * the same floats on every build: quant.c is compiled without contraction (C11 mode on
 * gcc, the pragma above on clang). */
static uint16_t search_scale(const float *x, uint32_t m, uint16_t h0, float lo, float hi)
{
    const float d0 = pkvi_f16_to_f32(h0);
    uint16_t hk[SEARCH];
    float d[SEARCH], e[SEARCH];
    unsigned n = 1, last = h0 & 0x7fffu;
    hk[0] = h0;
    for (unsigned k = 1; k < SEARCH; k++) {
        const float v = fabsf(d0) * (1.0f + (float)k * SEARCH_STEP);
        const unsigned mag = pkvi_f32_to_f16(v) & 0x7fffu;
        if (mag <= last) /* the same f16 as the last candidate */
            continue;
        if (mag > 0x7bffu) /* past the f16 maximum */
            break;
        last = mag;
        hk[n++] = (uint16_t)((h0 & 0x8000u) | mag);
    }
    for (unsigned k = 0; k < SEARCH; k++) {
        d[k] = k < n ? pkvi_f16_to_f32(hk[k]) : d0; /* padding repeats d_0 */
        e[k] = 0.0f;
    }
    for (uint32_t j = 0; j < m; j++)
        for (unsigned k = 0; k < SEARCH; k++) {
            const float t = x[j] - d[k] * code_of(x[j] / d[k], lo, hi);
            e[k] += t * t;
        }
    unsigned best = 0;
    for (unsigned k = 1; k < n; k++)
        best = e[k] < e[best] ? k : best;
    return hk[best];
}

static void store_block(pkv_dtype t, unsigned char *dst, const float *x, uint32_t m)
{
    /* the largest magnitude a; the sign of its first value; (Q4) the largest magnitude
     * b of the values of the other sign. Selects, not branches: random rows mispredict. */
    float a = 0.0f;
    bool finite = true;
    for (uint32_t j = 0; j < m; j++) {
        finite &= isfinite(x[j]) != 0;
        a = fabsf(x[j]) > a ? fabsf(x[j]) : a;
    }
    unsigned char *q = dst + 2;
    memset(q, 0, block_bytes(t, m) - 2);
    if (!finite || a == 0.0f) {
        /* NaN scale (the block reads back as NaN), or a zero block: d = 0; q = 0 */
        put16(dst, finite ? 0 : 0x7e00u);
        if (t == PKV_Q4)
            for (uint32_t j = 0; j < m; j++)
                q[j / 2] |= (unsigned char)(8u << (4 * (j % 2)));
        return;
    }
    uint32_t first = 0;
    while (fabsf(x[first]) != a)
        first++;
    const bool neg = x[first] < 0.0f;
    float b = 0.0f;
    for (uint32_t j = 0; j < m; j++) {
        uint32_t u; /* |x_j| where its sign bit is not neg's, else 0 (-0 adds nothing) */
        memcpy(&u, &x[j], sizeof u);
        u &= 0x7fffffffu & (0u - ((u >> 31) ^ (uint32_t)neg));
        float v;
        memcpy(&v, &u, sizeof v);
        b = v > b ? v : b;
    }
    const float lo = t == PKV_Q8 ? -127.0f : -8.0f, hi = t == PKV_Q8 ? 127.0f : 7.0f;
    const uint16_t h = search_scale(x, m, pkvi_quant_first_scale(t, a, b, neg), lo, hi);
    put16(dst, h);
    const float d = pkvi_f16_to_f32(h);
    for (uint32_t j = 0; j < m; j++) {
        const int v = (int)code_of(x[j] / d, lo, hi);
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

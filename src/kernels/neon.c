/*
 * kernels/neon.c - pkvi_kernels_neon: the aarch64 table (Advanced SIMD, which every
 * AArch64 CPU has), compiled for plain armv8-a; dispatch.c picks it when AT_HWCAP says
 * asimd. Every dtype and path: f32, f16 (widened by FCVTL), bf16 (a shift), Q8/Q4 on
 * the exact path and on the integer-dot path (neon_qd.h: widening multiplies here;
 * neondot.c is this table with SDOT).
 *
 * The shape of the work is avx2.c's over walk.h at half the width: QK in blocks of 4, 2
 * or 1 heads times 4 or 8 rows, one accumulator vector per (head, row) and 8 values a
 * step, then a fixed reduction; PV (neon_pv.h) in blocks of heads times 16 or 8
 * columns; the softmax of neon_math.h. Each (head, row) dot and each acc element sees
 * the same operations whatever block it falls in, so the arithmetic is page-local and
 * head-local as kernels.h requires (tests/test_kernels.c checks it bitwise); against
 * ref.c it differs by the order of the dot's sums (docs/numerics.md's bound).
 */
#include "kernels/kernels.h"
#include "kernels/neon_load.h"
#include "kernels/neon_math.h"
#include "kernels/neon_pv.h"
#include "kernels/neon_qd.h"
#include "kernels/walk.h"
#include "base/dtype.h"
#include "base/half.h"

#include <arm_neon.h>
#include <stdbool.h>
#include <string.h>

/* ---- QK, exact path -------------------------------------------------------------------
 * Dots of HB heads (q: [HB][d]) with TB rows at k (rb bytes apart): lane-wise FMAs over
 * 8 values a step, the lanes summed pairwise (FADDP), then the last d % 8 values one by
 * one in index order. */
PKVI_INLINE void qk_block(const pkv_dtype dt, const char *k, size_t rb, uint32_t d,
                          const float *q, float *s, const int HB, const int TB)
{
    float32x4_t a[16];
    PKVI_UNROLL
    for (int i = 0; i < HB * TB; i++)
        a[i] = vdupq_n_f32(0.0f);
    uint32_t c = 0;
    for (; c + 8 <= d; c += 8) {
        float32x4_t kv[8][2];
        PKVI_UNROLL
        for (int t = 0; t < TB; t++)
            ld8(dt, k + (size_t)t * rb, c, kv[t]);
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const float32x4_t q0 = vld1q_f32(q + (size_t)h * d + c);
            const float32x4_t q1 = vld1q_f32(q + (size_t)h * d + c + 4);
            PKVI_UNROLL
            for (int t = 0; t < TB; t++)
                a[h * TB + t] = vfmaq_f32(vfmaq_f32(a[h * TB + t], q0, kv[t][0]), q1, kv[t][1]);
        }
    }
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            float dot = vaddvq_f32(a[h * TB + t]);
            for (uint32_t e = c; e < d; e++)
                dot = __builtin_fmaf(q[(size_t)h * d + e], ld1(dt, k + (size_t)t * rb, e), dot);
            s[h * PKVI_TILE + t] = dot;
        }
}

/* The n rows of a tile for HB heads: TB rows at a time (16 accumulators at most), then
 * one at a time. */
PKVI_INLINE void qk_heads(const pkv_dtype dt, const char *k, size_t rb, uint32_t d, uint32_t n,
                          const float *q, float *s, const int HB)
{
    const int TB = HB == 4 ? 4 : HB == 2 ? 4 : 8;
    uint32_t t = 0;
    for (; t + (uint32_t)TB <= n; t += (uint32_t)TB)
        qk_block(dt, k + (size_t)t * rb, rb, d, q, s + t, HB, TB);
    for (; t < n; t++)
        qk_block(dt, k + (size_t)t * rb, rb, d, q, s + t, HB, 1);
}

/* Unscaled scores of the tile's rows for all hg heads into s [hg][PKVI_TILE]
 * (walk_qk_fn): the exact dots, or the integer dots (neon_qd.h). */
PKVI_INLINE void tile_qk(const pkv_dtype dt, const qk_kind qk, const uint32_t D,
                         const pkvi_kparams *p, const tile *t, float *s)
{
    if (qk == QK_INT) {
        tile_qk_int(dt, D, p, t, s);
        return;
    }
    const uint32_t d = walk_dk(p, D), hg = p->hg;
    const size_t rb = row_bytes_of(dt, d);
    if (t->pfk)
        pf_rows(t->pfk, rb, t->n, p->pf_l2);
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4)
        qk_heads(dt, t->k, rb, d, t->n, t->q + (size_t)h * d, s + h * PKVI_TILE, 4);
    if (hg - h >= 2) {
        qk_heads(dt, t->k, rb, d, t->n, t->q + (size_t)h * d, s + h * PKVI_TILE, 2);
        h += 2;
    }
    if (h < hg)
        qk_heads(dt, t->k, rb, d, t->n, t->q + (size_t)h * d, s + h * PKVI_TILE, 1);
}

/* The stream kick's distance: avx2.c's (no aarch64 measurement yet; docs/performance.md
 * has no NEON rows). */
enum { KICK_BYTES = 512u << 10 };

/* ---- entry points: one out-of-line walk per dtype and path ------------------------- */

static void attend_f32(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                       uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                       const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_F32, QK_F32, 0, p, pages,
                n_pages, last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_f16(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                       uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                       const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_F16, QK_F32, 0, p, pages,
                n_pages, last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_bf16(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                        uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                        const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_BF16, QK_F32, 0, p, pages,
                n_pages, last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_q8(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                      uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                      const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_Q8, QK_F32, 0, p, pages,
                n_pages, last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_q4(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                      uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                      const pkvi_heads *x)
{
    walk_attend(tile_qk, tile_pv, softmax_tile, KICK_BYTES, PKV_Q4, QK_F32, 0, p, pages,
                n_pages, last_tokens, group0, n_groups, x, NULL, NULL, NULL);
}

static void attend_qd_q8(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                         uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                         const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head_int, KICK_BYTES, PKV_Q8, QK_INT, 0,
                  p, pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_qd_q4(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                         uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                         const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head_int, KICK_BYTES, PKV_Q4, QK_INT, 0,
                  p, pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                   uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                   const pkvi_heads *x)
{
    pkvi_attend_fn f = attend_f32;
    switch (p->dtype) {
    case PKV_F32:
        f = attend_f32;
        break;
    case PKV_F16:
        f = attend_f16;
        break;
    case PKV_BF16:
        f = attend_bf16;
        break;
    case PKV_Q8:
        f = p->quant_dot ? attend_qd_q8 : attend_q8;
        break;
    case PKV_Q4:
        f = p->quant_dot ? attend_qd_q4 : attend_q4;
        break;
    }
    f(p, pages, n_pages, last_tokens, group0, n_groups, x);
}

/* ---- store ---------------------------------------------------------------------------
 * Bitwise dtype.c's conversions: FCVTN (round to nearest even under the default FPCR,
 * which Linux gives every thread) for f16, integer rounding for bf16 (avx2.c's bf16_of);
 * the last n % 4 values and Q8/Q4 rows through dtype.c itself. */
PKVI_INLINE uint16x4_t bf16_of(float32x4_t x)
{
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffffu)),
                                     vdupq_n_u32(0x7f800000u));
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fffu)), odd);
    const uint32x4_t quiet = vorrq_u32(u, vdupq_n_u32(0x400000u));
    return vshrn_n_u32(vbslq_u32(nan, quiet, rounded), 16);
}

static void store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    uint32_t i = 0;
    uint16_t *o = dst;
    switch (t) {
    case PKV_Q8:
    case PKV_Q4:
    case PKV_F32:
        pkvi_store_row(t, dst, src, n);
        return;
    case PKV_F16:
        for (; i + 4 <= n; i += 4)
            vst1_u16(o + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(src + i))));
        break;
    case PKV_BF16:
        for (; i + 4 <= n; i += 4)
            vst1_u16(o + i, bf16_of(vld1q_f32(src + i)));
        break;
    }
    if (i < n)
        pkvi_store_row(t, o + i, src + i, n - i);
}

const pkvi_kernels pkvi_kernels_neon = {"neon", attend, store_row};

/*
 * kernels/avx2.c - the AVX2 decode kernel and row store (compiled with -mavx2 -mfma
 * -mf16c; called only after kernels/dispatch.c saw AVX2, FMA, F16C in cpuid and the
 * YMM state enabled in XCR0).
 *
 * Owns: pkvi_kernels_avx2. Does not own: the semantics (kernels/ref.c is the
 * specification), the conversions' definition (dtype.c), threading or split-K
 * (decode.c).
 *
 * The structure is avx512.c's at half the width (see that file's comment): the same
 * tiles as ref.c, QK in blocks of HB heads x TB tokens (HB * TB == 8 accumulators, one
 * 8-way reduction tree), PV in blocks of HB heads x 16 floats of d. Differences from
 * ref.c are the order of additions and the exp polynomial (docs/numerics.md).
 * AVX2 has no 16-bit masked load, so the d tail (d % 8) of f16/bf16 rows is copied
 * into a zeroed 8-element buffer first; f32 rows use vmaskmovps. Rows past
 * `last_tokens` and elements past d are never read. The walk across groups and the
 * one-tile software pipeline are walk.h's (shared with avx512.c); software prefetch
 * and the unrolling (PKVI_UNROLL) as in avx512.c.
 */
#include "kernels/kernels.h"
#include "base/dtype.h"
#include "base/quant.h"

#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

#include "qblock256.h" /* qb_hmax: a tile's largest score (the softmax) */

/* Software prefetch of the page ahead: the scheme and the measurements of avx512.c. */
AI void pf_line(const char *a, const bool l2) /* as avx512.c's */
{
    if (l2)
        _mm_prefetch(a, _MM_HINT_T1);
    else
        _mm_prefetch(a, _MM_HINT_T0);
}
#define PF_AHEAD_BYTES 4096u

/* ---- loads: 8 values of the page's dtype from element i of row base, as f32 ------ */

AI __m256 widen(pkv_dtype dt, __m128i h)
{
    if (dt == PKV_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AI __m256 ld(pkv_dtype dt, const void *base, size_t i)
{
    if (dt == PKV_F32)
        return _mm256_loadu_ps((const float *)base + i);
    return widen(dt, _mm_loadu_si128((const void *)((const uint16_t *)base + i)));
}

/* Lanes [0, rem) for rem in 1..7 */
AI __m256i tail_mask(uint32_t rem)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The first rem (1..7) values from element i, the other lanes 0. */
AI __m256 ldt(pkv_dtype dt, const void *base, size_t i, uint32_t rem)
{
    if (dt == PKV_F32)
        return _mm256_maskload_ps((const float *)base + i, tail_mask(rem));
    uint16_t tmp[8] = {0};
    memcpy(tmp, (const uint16_t *)base + i, rem * sizeof(uint16_t));
    return widen(dt, _mm_loadu_si128((const void *)tmp));
}

/* ---- bf16, 16 values at a time ------------------------------------------------------
 * Interleaving 16 bf16 values with zeros (vpunpcklwd/vpunpckhwd, within each 128-bit
 * half) gives their f32 values exactly, in one operation per 8 that runs beside the
 * FMAs on the dev VM (vpmovzxwd + vpslld cost 0.6-1.1 FMAs), but in the order
 * [0..3, 8..11] and [4..7, 12..15]. So the walk hands QK a q permuted the same way
 * (q_permute), and PV loads and stores its accumulators in that order (acc_ld16). A
 * d tail (d % 16) stays in row order. */
AI void ld16_bf16(const void *base, size_t i, __m256 v[2])
{
    const __m256i x = _mm256_loadu_si256((const void *)((const uint16_t *)base + i));
    v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
    v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
}

/* The f32 values of ld16_bf16's lane order: u = 0 gives [p0..3, p8..11], u = 1
 * [p4..7, p12..15]. */
AI __m256 acc_ld16(const float *p, int u)
{
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + 4 * u)),
                                _mm_loadu_ps(p + 8 + 4 * u), 1);
}

AI void acc_st16(float *p, int u, __m256 a)
{
    _mm_storeu_ps(p + 4 * u, _mm256_castps256_ps128(a));
    _mm_storeu_ps(p + 8 + 4 * u, _mm256_extractf128_ps(a, 1));
}

/* bf16's QK reads q in that order (walk.h prepares it with q_permute; dst != src) */
#define PKVI_WALK_PERMUTED_BF16 1
AI void q_permute(const pkv_dtype dt, const float *src, float *dst, uint32_t d)
{
    (void)dt; /* bf16 only */
    uint32_t c = 0;
    for (; c + 16 <= d; c += 16)
        for (int u = 0; u < 2; u++) {
            memcpy(dst + c + 8 * u, src + c + 4 * u, 4 * sizeof(float));
            memcpy(dst + c + 8 * u + 4, src + c + 8 + 4 * u, 4 * sizeof(float));
        }
    memcpy(dst + c, src + c, (size_t)(d - c) * sizeof(float));
}

/* ---- loads of the block types (Q8, Q4; the format is quant.c's) ------------------
 * A row is blocks of 32 values, each an f16 scale then its integers; 8 values from
 * element c (c % 8 == 0) never straddle a block. Dequantized as d * q in f32, exact,
 * so these are bitwise the values quant.c's loads give. */
#define QTYPE(dt) ((dt) == PKV_Q8 || (dt) == PKV_Q4)

AI const char *qblock(pkv_dtype dt, const char *row, uint32_t c)
{
    return row + (size_t)(c / 32) * (dt == PKV_Q8 ? 34u : 18u);
}

AI __m256 qscale8(const char *blk)
{
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    return _mm256_set1_ps(_cvtsh_ss(h));
}

/* The 8 integers of a block from element c, as f32 (exact), unscaled. */
AI __m256 ldq_raw(pkv_dtype dt, const char *row, uint32_t c)
{
    const char *blk = qblock(dt, row, c);
    __m256i v;
    if (dt == PKV_Q8) {
        v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(blk + 2 + c % 32)));
    } else {
        uint32_t w;
        memcpy(&w, blk + 2 + (c % 32) / 2, sizeof w);
        const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)w),
                                           _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1,
                                                         -1, -1, -1, -1, -1));
        v = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(b), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
        v = _mm256_sub_epi32(_mm256_and_si256(v, _mm256_set1_epi32(15)), _mm256_set1_epi32(8));
    }
    return _mm256_cvtepi32_ps(v);
}

#include "qscales.h" /* block_scales8 */

/* 8 values from element c: the block's scale times its integers. */
AI __m256 ldq(pkv_dtype dt, const char *row, uint32_t c)
{
    return _mm256_mul_ps(qscale8(qblock(dt, row, c)), ldq_raw(dt, row, c));
}

/* 16 integers of a block from element c (c % 16 == 0) into v[0], v[1], unscaled (exact
 * in f32): Q4's 8 bytes unpacked once; for PV with the block's scale folded into the
 * weights. */
AI void ldq16_raw(pkv_dtype dt, const char *row, uint32_t c, __m256 v[2])
{
    const char *blk = qblock(dt, row, c);
    __m128i b;
    if (dt == PKV_Q8) {
        b = _mm_loadu_si128((const void *)(blk + 2 + c % 32));
    } else {
        const __m128i x = _mm_loadl_epi64((const void *)(blk + 2 + (c % 32) / 2));
        const __m128i m = _mm_set1_epi8(15);
        b = _mm_sub_epi8(_mm_unpacklo_epi8(_mm_and_si128(x, m),
                                           _mm_and_si128(_mm_srli_epi16(x, 4), m)),
                         _mm_set1_epi8(8));
    }
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
}

/* 16 values from element c (c % 16 == 0: one block) into v[0], v[1]: ldq16_raw times
 * the block's scale, read once; the same values as two ldq. */
AI void ldq16(pkv_dtype dt, const char *row, uint32_t c, __m256 v[2])
{
    ldq16_raw(dt, row, c, v);
    const __m256 d = qscale8(qblock(dt, row, c));
    v[0] = _mm256_mul_ps(d, v[0]);
    v[1] = _mm256_mul_ps(d, v[1]);
}

/* The first rem (1..7) values from element c, the other lanes 0. */
AI __m256 ldqt(pkv_dtype dt, const char *row, uint32_t c, uint32_t rem)
{
    const char *blk = qblock(dt, row, c);
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    const float d = _cvtsh_ss(h);
    _Alignas(32) float tmp[8] = {0};
    for (uint32_t j = 0; j < rem; j++) {
        const uint32_t i = c % 32 + j;
        const int q = dt == PKV_Q8 ? (int)(signed char)blk[2 + i]
                                   : (int)(((unsigned char)blk[2 + i / 2] >> (4 * (i % 2))) & 15u) - 8;
        tmp[j] = d * (float)q;
    }
    return _mm256_load_ps(tmp);
}

/* ---- exp (see avx512.c for the method) --------------------------------------------
 * Without vscalef, 2^n is applied as two normal factors 2^(n>>1) and 2^(n - (n>>1)):
 * the first product is exact, the second rounds once, so subnormal results are as
 * accurate as vscalef's. */
AI __m256 exp8(__m256 x)
{
    x = _mm256_max_ps(_mm256_set1_ps(-110.0f), x); /* NaN passes (second operand) */
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, f1), f2);
}

/* ---- tanh (soft-capping) -----------------------------------------------------------
 * Below |x| = 0.4 the odd Taylor series to x^13 (the next term is under 4e-9 of the
 * result); above, sign(x) * (1 - 2 / (exp(2|x|) + 1)) with exp8 (the subtraction
 * loses at most 1.5 bits there: 2 / (e^0.8 + 1) = 0.62). What a weight sees is the
 * capped score c * tanh(s / c): tests/test_kernels.c (softcap_accuracy) holds it within
 * 4 ulp of the score plus 2^-22 of c * tanh in double for caps 2.5 to 50 (measured
 * here: 0.66 of that bound; libm's tanhf in the scalar kernel: 0.81). NaN stays NaN;
 * +-inf gives +-1. */
AI __m256 tanh8(__m256 x)
{
    const __m256 sgn = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 ax = _mm256_andnot_ps(sgn, x);
    const __m256 e = exp8(_mm256_add_ps(ax, ax));
    const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                        _mm256_add_ps(e, one)));
    const __m256 x2 = _mm256_mul_ps(ax, ax);
    __m256 p = _mm256_set1_ps(3.5921280365e-3f);                   /*  21844/6081075 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-8.8632355299e-3f)); /* -1382/155925 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.1869488536e-2f));  /*  62/2835 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-5.3968253968e-2f)); /* -17/315 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(1.3333333333e-1f));  /*  2/15 */
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-3.3333333333e-1f)); /* -1/3 */
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(ax, x2), p, ax);
    const __m256 r = _mm256_blendv_ps(big, small,
                                      _mm256_cmp_ps(ax, _mm256_set1_ps(0.4f), _CMP_LT_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(x, sgn));
}

/* Scaled scores, soft-capped when cap > 0. */
AI __m256 scores8(__m256 raw, __m256 sc, float cap)
{
    const __m256 x = _mm256_mul_ps(raw, sc);
    if (cap <= 0.0f)
        return x;
    const __m256 c = _mm256_set1_ps(cap);
    return _mm256_mul_ps(c, tanh8(_mm256_div_ps(x, c)));
}

/* ---- reductions ----------------------------------------------------------------------- */

/* The sums of the 8 lanes of v[0..3], in lanes 0..3: per 128-bit half, two vhaddps
 * levels give the half's four partial sums, then the halves are added (an extract,
 * not a vperm2f128: 3 cycles each on the Zen-1-class dev VM). Fixed order. */
AI __m128 hsum4(const __m256 v[4])
{
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

AI float hadd8(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* ---- QK ------------------------------------------------------------------------------
 * Unscaled dots of HB heads (q rows qh, stride d) with TB consecutive K rows; writes
 * s[h * PKVI_TILE + t]. HB * TB <= 8. */
AI void qk_block(pkv_dtype dt, const void *krow, uint32_t d, const float *qh, float *s,
                 const char *pf, const bool l2, size_t row_bytes, const int HB, const int TB)
{
    if (pf)
        for (size_t off = 0; off < TB * row_bytes; off += 64)
            pf_line(pf + off, l2);
    __m256 a[8];
    PKVI_UNROLL
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_ps();
    uint32_t c = 0;
    if (QTYPE(dt)) /* whole blocks: each row's scale read and widened once per block */
        for (; c + 32 <= d; c += 32) {
            __m256 sc[8];
            PKVI_UNROLL
            for (int t = 0; t < TB; t++)
                sc[t] = qscale8(qblock(dt, (const char *)krow + t * row_bytes, c));
            for (uint32_t j = c; j < c + 32; j += 16)
                PKVI_UNROLL
                for (int t = 0; t < TB; t++) {
                    /* ldq's products, bit for bit, 16 integers unpacked at once */
                    __m256 kv[2];
                    ldq16_raw(dt, (const char *)krow + t * row_bytes, j, kv);
                    PKVI_UNROLL
                    for (int u = 0; u < 2; u++) {
                        const __m256 k = _mm256_mul_ps(sc[t], kv[u]);
                        PKVI_UNROLL
                        for (int h = 0; h < HB; h++)
                            a[h * TB + t] = _mm256_fmadd_ps(
                                _mm256_loadu_ps(qh + (size_t)h * d + j + 8 * u), k, a[h * TB + t]);
                    }
                    /* q is read again for the next row: without this barrier gcc 12
                     * keeps the 2 * HB q vectors of the 16 values live across the TB
                     * rows and spills accumulators instead (Q4 exact 4% slower in L2
                     * and at 128k, Q8 2-3%; same results bit for bit) */
                    __asm__ volatile("" ::: "memory");
                }
        }
    if (dt == PKV_BF16) /* q permuted (q_permute) */
        for (; c + 16 <= d; c += 16) {
            if (TB <= 2) {
                /* the rows' 16 values widened first, then each q vector loaded once
                 * for them: one q vector live at a time. With the loop over rows
                 * outside, gcc 12 kept all 2 * HB q vectors live and spilled three
                 * accumulators every step (Zen 5, probe_tile_avx2 128: QK 187 -> 160
                 * ns per tile; bench_ab, bf16 at 512 tokens: 0.984-0.988). The same
                 * FMAs in the same order, so the same bits. */
                __m256 kv[2][2];
                PKVI_UNROLL
                for (int t = 0; t < TB; t++)
                    ld16_bf16(krow, (size_t)t * d + c, kv[t]);
                PKVI_UNROLL
                for (int u = 0; u < 2; u++)
                    PKVI_UNROLL
                    for (int h = 0; h < HB; h++) {
                        const __m256 qv = _mm256_loadu_ps(qh + (size_t)h * d + c + 8 * u);
                        PKVI_UNROLL
                        for (int t = 0; t < TB; t++)
                            a[h * TB + t] = _mm256_fmadd_ps(qv, kv[t][u], a[h * TB + t]);
                    }
                continue;
            }
            PKVI_UNROLL
            for (int t = 0; t < TB; t++) { /* HB <= 2: its q vectors fit beside */
                __m256 kv[2];
                ld16_bf16(krow, (size_t)t * d + c, kv);
                PKVI_UNROLL
                for (int u = 0; u < 2; u++)
                    PKVI_UNROLL
                    for (int h = 0; h < HB; h++)
                        a[h * TB + t] = _mm256_fmadd_ps(
                            _mm256_loadu_ps(qh + (size_t)h * d + c + 8 * u), kv[u], a[h * TB + t]);
            }
        }
    for (; c + 8 <= d; c += 8) {
        __m256 qv[4];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            qv[h] = _mm256_loadu_ps(qh + (size_t)h * d + c);
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const __m256 kv = QTYPE(dt) ? ldq(dt, (const char *)krow + t * row_bytes, c)
                                        : ld(dt, krow, (size_t)t * d + c);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h * TB + t] = _mm256_fmadd_ps(qv[h], kv, a[h * TB + t]);
        }
    }
    if (c < d) {
        const uint32_t rem = d - c;
        __m256 qv[4];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            qv[h] = _mm256_maskload_ps(qh + (size_t)h * d + c, tail_mask(rem));
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const __m256 kv = QTYPE(dt) ? ldqt(dt, (const char *)krow + t * row_bytes, c, rem)
                                        : ldt(dt, krow, (size_t)t * d + c, rem);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h * TB + t] = _mm256_fmadd_ps(qv[h], kv, a[h * TB + t]);
        }
    }
    /* dot i = h * TB + t into s[h * PKVI_TILE + t]: a head's TB dots are adjacent
     * lanes, so each is one 64- or 128-bit store */
    const __m128 r0 = hsum4(a);
    if (HB * TB <= 4) {
        _Alignas(16) float r[4];
        _mm_store_ps(r, r0);
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            PKVI_UNROLL
            for (int t = 0; t < TB; t++)
                s[h * PKVI_TILE + t] = r[h * TB + t];
        return;
    }
    const __m128 r1 = hsum4(a + 4);
    if (TB == 2) { /* HB == 4 */
        _mm_storel_pi((__m64 *)s, r0);
        _mm_storeh_pi((__m64 *)(s + PKVI_TILE), r0);
        _mm_storel_pi((__m64 *)(s + 2 * PKVI_TILE), r1);
        _mm_storeh_pi((__m64 *)(s + 3 * PKVI_TILE), r1);
    } else if (TB == 4) { /* HB == 2 */
        _mm_storeu_ps(s, r0);
        _mm_storeu_ps(s + PKVI_TILE, r1);
    } else { /* TB == 8, HB == 1 */
        _mm_storeu_ps(s, r0);
        _mm_storeu_ps(s + 4, r1);
    }
}

AI void qk_heads(pkv_dtype dt, const void *krow, size_t row_bytes, uint32_t d,
                 uint32_t n, const float *qh, float *s, const char *pf, const bool l2,
                 const int HB)
{
    const int TB = 8 / HB;
    uint32_t t = 0;
    for (; t + (uint32_t)TB <= n; t += (uint32_t)TB)
        qk_block(dt, (const char *)krow + t * row_bytes, d, qh, s + t,
                 pf ? pf + t * row_bytes : NULL, l2, row_bytes, HB, TB);
    for (; t < n; t++)
        qk_block(dt, (const char *)krow + t * row_bytes, d, qh, s + t,
                 pf ? pf + t * row_bytes : NULL, l2, row_bytes, HB, 1);
}

/* ---- PV ------------------------------------------------------------------------------
 * acc[h][c0 .. c0 + 8*CB) = alpha[h] * acc + sum_t w[h][t] * v_t for HB heads; with
 * rem (1..7, CB == 1) only the first rem lanes exist. */
AI void pv_block(pkv_dtype dt, const void *vrow, uint32_t d, uint32_t c0, uint32_t n,
                 const float *w, const float *alpha, float *acc, const char *pf, const bool l2,
                 const int HB, const int CB, const uint32_t rem, const bool raw)
{
    const size_t es = dt == PKV_F32 ? 4u : 2u;
    const size_t vrb = QTYPE(dt) ? pkvi_quant_row_bytes(dt, d) : 0; /* a block row's bytes */
    /* The prefetch of row t, in the unit `dist` ahead: one line a token, at pfb + t *
     * stride. A half type or f32 block asks for the 64 bytes from its first value when
     * it starts them (its neighbours share the line); the two halves of a Q8/Q4 block
     * ask for the block's first and last byte (a block spans at most two lines). One
     * address per token keeps the loop's registers for the loop: a nested loop over
     * the block's lines spilled the row pointer (a store and a reload every token). */
    const size_t stride = QTYPE(dt) ? vrb : d * es;
    const size_t b0 = QTYPE(dt) ? (size_t)(c0 / 32) * pkvi_quant_block_bytes(dt) +
                                      (c0 % 32 ? pkvi_quant_block_bytes(dt) - 1 : 0)
                                : c0 * es;
    const char *pfb = pf && (QTYPE(dt) || b0 % 64 == 0) ? pf + b0 : NULL;
    const bool bf16x = dt == PKV_BF16 && CB == 2; /* ld16_bf16's lane order */
    __m256 a[4][2];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++) {
        const __m256 al = _mm256_set1_ps(alpha[h]);
        PKVI_UNROLL
        for (int c = 0; c < CB; c++) {
            const float *p = acc + (size_t)h * d + c0 + 8 * c;
            a[h][c] = _mm256_mul_ps(bf16x ? acc_ld16(acc + (size_t)h * d + c0, c)
                                    : rem ? _mm256_maskload_ps(p, tail_mask(rem))
                                          : _mm256_loadu_ps(p),
                                    al);
        }
    }
    for (uint32_t t = 0; t < n; t++) {
        if (pfb)
            pf_line(pfb + t * stride, l2);
        __m256 vv[2];
        if (bf16x)
            ld16_bf16(vrow, (size_t)t * d + c0, vv);
        else if (QTYPE(dt) && CB == 2 && raw) /* w carries the block's scale */
            ldq16_raw(dt, (const char *)vrow + t * vrb, c0, vv);
        else if (QTYPE(dt) && CB == 2) /* 16 values of one block, one scale */
            ldq16(dt, (const char *)vrow + t * vrb, c0, vv);
        else
            PKVI_UNROLL
            for (int c = 0; c < CB; c++)
                vv[c] = QTYPE(dt)
                            ? (rem ? ldqt(dt, (const char *)vrow + t * vrb, c0, rem)
                                   : ldq(dt, (const char *)vrow + t * vrb, c0 + 8 * (uint32_t)c))
                            : (rem ? ldt(dt, vrow, (size_t)t * d + c0, rem)
                                   : ld(dt, vrow, (size_t)t * d + c0 + 8 * c));
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const __m256 wb = _mm256_broadcast_ss(w + h * PKVI_TILE + t);
            PKVI_UNROLL
            for (int c = 0; c < CB; c++)
                a[h][c] = _mm256_fmadd_ps(wb, vv[c], a[h][c]);
        }
    }
    /* recompute addresses rather than keep HB*CB pointers live (see avx512.c) */
    __asm__("" : "+r"(acc));
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        PKVI_UNROLL
        for (int c = 0; c < CB; c++) {
            float *p = acc + (size_t)h * d + c0 + 8 * c;
            if (bf16x)
                acc_st16(acc + (size_t)h * d + c0, c, a[h][c]);
            else if (rem)
                _mm256_maskstore_ps(p, tail_mask(rem), a[h][c]);
            else
                _mm256_storeu_ps(p, a[h][c]);
        }
}

AI void pv_heads(pkv_dtype dt, const void *vrow, uint32_t d, uint32_t n, const float *w,
                 const float *alpha, float *acc, const char *pf, const bool l2, const int HB)
{
    uint32_t c = 0;
    if (QTYPE(dt)) {
        /* Whole blocks: each token's block scale folded into the weights once,
         * ws[h][t] = w[h][t] * dv_t (one multiply per block per head per 8 tokens),
         * so the values are the block's integers: acc += ws * q. The 16 scales of the
         * tile's rows are moved in as four 64-bit words and converted in two
         * vcvtph2ps (they were 16 two-byte stores read back as two vectors: a store
         * forwarding that fails; docs/perf-log.md). */
        const size_t vrb = pkvi_quant_row_bytes(dt, d), bb = pkvi_quant_block_bytes(dt);
        _Alignas(32) float ws[4 * PKVI_TILE];
        for (; c + 32 <= d; c += 32) {
            const char *blk0 = (const char *)vrow + (c / 32) * bb;
            const __m256 s0 = _mm256_cvtph_ps(block_scales8(blk0, vrb, n, 0, 4));
            const __m256 s1 = _mm256_cvtph_ps(block_scales8(blk0, vrb, n, 8, 12));
            PKVI_UNROLL
            for (int h = 0; h < HB; h++) {
                _mm256_store_ps(ws + h * PKVI_TILE,
                                _mm256_mul_ps(_mm256_load_ps(w + h * PKVI_TILE), s0));
                _mm256_store_ps(ws + h * PKVI_TILE + 8,
                                _mm256_mul_ps(_mm256_load_ps(w + h * PKVI_TILE + 8), s1));
            }
            pv_block(dt, vrow, d, c, n, ws, alpha, acc, pf, l2, HB, 2, 0, true);
            pv_block(dt, vrow, d, c + 16, n, ws, alpha, acc, pf, l2, HB, 2, 0, true);
        }
    }
    for (; c + 16 <= d; c += 16)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, HB, 2, 0, false);
    for (; c + 8 <= d; c += 8)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, HB, 1, 0, false);
    if (c < d)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, HB, 1, d - c, false);
}

/* ---- softmax of one tile (as ref.c; l uses a fused multiply-add) -------------------
 * Four heads at a time where the group has them: their maxima and sums reduced by one
 * 4x4 transpose (reduce4), their alphas one exp8, m/l/alpha as vectors - where one
 * head at a time ran four dependent chains of shuffles and three exp8 per head. The
 * operations are qb_hmax's and hadd8's on the same operands in the same order, so the
 * same bits (the decode-state hash before and after). Measured: docs/perf-log.md. */

/* The scaled (soft-capped) scores of one head's tile, lanes past n -inf. */
AI void tile_scores(const float *sh, uint32_t n, __m256 sc, float cap, __m256 lo, __m256 hi,
                    __m256 *s0, __m256 *s1)
{
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    /* lanes past n are -inf (their scratch is never read as data) */
    *s0 = _mm256_blendv_ps(ninf, scores8(_mm256_load_ps(sh), sc, cap), lo);
    *s1 = n > 8 ? _mm256_blendv_ps(ninf, scores8(_mm256_load_ps(sh + 8), sc, cap), hi) : ninf;
}

/* Lane h of the result: x[h]'s 8 lanes reduced by max (is_max) or +, as qb_hmax and
 * hadd8 do it (halves, then lanes i and i + 2, then 0 and 1), for 4 heads at once. */
AI __m128 reduce4(const __m256 x[4], const bool is_max)
{
    __m128 y[4];
    PKVI_UNROLL
    for (int h = 0; h < 4; h++) {
        const __m128 a = _mm256_castps256_ps128(x[h]), b = _mm256_extractf128_ps(x[h], 1);
        y[h] = is_max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
    }
    const __m128 t0 = _mm_unpacklo_ps(y[0], y[1]), t1 = _mm_unpackhi_ps(y[0], y[1]);
    const __m128 t2 = _mm_unpacklo_ps(y[2], y[3]), t3 = _mm_unpackhi_ps(y[2], y[3]);
    const __m128 u0 = is_max ? _mm_max_ps(t0, t1) : _mm_add_ps(t0, t1);
    const __m128 u1 = is_max ? _mm_max_ps(t2, t3) : _mm_add_ps(t2, t3);
    const __m128 v0 = _mm_movelh_ps(u0, u1), v1 = _mm_movehl_ps(u1, u0);
    return is_max ? _mm_max_ps(v0, v1) : _mm_add_ps(v0, v1);
}

AI void softmax_tile(uint32_t hg, uint32_t n, float scale, float cap, float *s, float *m,
                     float *l, float *alpha)
{
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256 lo = _mm256_castsi256_ps(tail_mask(n < 8 ? n : 8));
    const __m256 hi = _mm256_castsi256_ps(tail_mask(n > 8 ? n - 8 : 0));
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4) {
        __m256 s0[4], s1[4], x[4];
        PKVI_UNROLL
        for (int j = 0; j < 4; j++) {
            tile_scores(s + (size_t)(h + j) * PKVI_TILE, n, sc, cap, lo, hi, &s0[j], &s1[j]);
            x[j] = _mm256_max_ps(s0[j], s1[j]);
        }
        const __m128 mo = _mm_loadu_ps(m + h), mt = reduce4(x, true);
        /* fmaxf(m, mt) per head: m where m > mt or mt is NaN */
        const __m128 mn = _mm_blendv_ps(mt, mo, _mm_or_ps(_mm_cmpgt_ps(mo, mt),
                                                           _mm_cmpunord_ps(mt, mt)));
        _Alignas(16) float mb[4];
        _mm_store_ps(mb, mn);
        PKVI_UNROLL
        for (int j = 0; j < 4; j++) {
            float *sh = s + (size_t)(h + j) * PKVI_TILE;
            const __m256 mv = _mm256_broadcast_ss(mb + j);
            const __m256 e0 = exp8(_mm256_sub_ps(s0[j], mv));
            const __m256 e1 = exp8(_mm256_sub_ps(s1[j], mv));
            _mm256_store_ps(sh, e0);
            _mm256_store_ps(sh + 8, e1);
            x[j] = _mm256_add_ps(e0, e1);
        }
        const __m128 al = _mm256_castps256_ps128(
            exp8(_mm256_insertf128_ps(_mm256_setzero_ps(), _mm_sub_ps(mo, mn), 0)));
        _mm_storeu_ps(alpha + h, al);
        _mm_storeu_ps(l + h, _mm_fmadd_ps(_mm_loadu_ps(l + h), al, reduce4(x, false)));
        _mm_storeu_ps(m + h, mn);
    }
    for (; h < hg; h++) {
        float *sh = s + (size_t)h * PKVI_TILE;
        __m256 s0, s1;
        tile_scores(sh, n, sc, cap, lo, hi, &s0, &s1);
        const float mt = qb_hmax(_mm256_max_ps(s0, s1));
        const float mn = m[h] > mt || mt != mt ? m[h] : mt; /* fmaxf(m[h], mt) */
        const __m256 mv = _mm256_set1_ps(mn);
        const __m256 e0 = exp8(_mm256_sub_ps(s0, mv));
        const __m256 e1 = exp8(_mm256_sub_ps(s1, mv));
        _mm256_store_ps(sh, e0);
        _mm256_store_ps(sh + 8, e1);
        const float al = _mm_cvtss_f32(_mm256_castps256_ps128(exp8(_mm256_set1_ps(m[h] - mn))));
        alpha[h] = al;
        l[h] = __builtin_fmaf(l[h], al, hadd8(_mm256_add_ps(e0, e1)));
        m[h] = mn;
    }
}

#if PKVI_AVX2_VNNI
/* ---- the Q8/Q4 scores of a whole tile, transposed (avx2vnni) -------------------------
 * avx512.c's transposed tile (its comment says how) at half the width, for hosts with
 * AVX-VNNI (vpdpbusd on ymm; Intel since Alder Lake, AMD since Zen 5): a tile's rows in
 * two halves of 8 tokens, each block transposed so that lane t of kt[j] holds bytes
 * 4j .. 4j+3 of row t's block; per head and limb one vpdpbusd per 4 values adds into 8
 * tokens' lanes with no reduction across lanes. The arithmetic per token is
 * avx512.c's, operation for operation, so the integer-dot scores are the avx512vnni
 * table's and the avx2 table's bit for bit. The exact path keeps avx2's f32 scores:
 * avx512.c's four limbs of q cost more here than those scores (docs/perf-log.md,
 * "Four limbs"). */

/* Q8 block of rows r0 .. r0+7 (rows at or past n read as 0, never loaded): an 8x8 dword
 * transpose, lane t = row r0 + t. */
AI void qv_kt_q8(const char *blk0, size_t row_bytes, uint32_t r0, uint32_t n, __m256i kt[8])
{
    __m256i z[8], t[8], u[8];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 8; i++)
        z[i] = r0 + i < n ? _mm256_loadu_si256((const void *)(blk0 + (r0 + i) * row_bytes + 2))
                          : _mm256_setzero_si256();
    PKVI_UNROLL
    for (int i = 0; i < 8; i += 2) { /* rows i, i+1: dwords 0 1 | 4 5 and 2 3 | 6 7 */
        t[i] = _mm256_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(z[i], z[i + 1]);
    }
    PKVI_UNROLL
    for (int i = 0; i < 8; i += 4) { /* u[i + k]: rows i .. i+3, dwords k | k + 4 */
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    PKVI_UNROLL
    for (int k = 0; k < 4; k++) {
        kt[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        kt[k + 4] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

/* Q4 block of rows r0 .. r0+7: kt[j] lane t = row r0 + t's integers (nibble - 8) at
 * positions 4j .. 4j+3 of kblock_bytes' order (low nibbles, then high). Rows i and
 * i + 4 share a vector, a 4x4 dword transpose in each 128-bit lane, then the nibbles
 * split. */
AI void qv_kt_q4(const char *blk0, size_t row_bytes, uint32_t r0, uint32_t n, __m256i kt[8])
{
    __m256i z[4], t[4];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 4; i++) {
        const uint32_t a = r0 + i, b = r0 + i + 4;
        const __m128i lo = a < n ? _mm_loadu_si128((const void *)(blk0 + a * row_bytes + 2))
                                 : _mm_setzero_si128();
        const __m128i hi = b < n ? _mm_loadu_si128((const void *)(blk0 + b * row_bytes + 2))
                                 : _mm_setzero_si128();
        z[i] = _mm256_set_m128i(hi, lo);
    }
    t[0] = _mm256_unpacklo_epi32(z[0], z[1]);
    t[1] = _mm256_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm256_unpacklo_epi32(z[2], z[3]);
    t[3] = _mm256_unpackhi_epi32(z[2], z[3]);
    const __m256i p[4] = {_mm256_unpacklo_epi64(t[0], t[2]), _mm256_unpackhi_epi64(t[0], t[2]),
                          _mm256_unpacklo_epi64(t[1], t[3]), _mm256_unpackhi_epi64(t[1], t[3])};
    const __m256i m = _mm256_set1_epi8(15), e = _mm256_set1_epi8(8);
    PKVI_UNROLL
    for (int j = 0; j < 4; j++) {
        kt[j] = _mm256_sub_epi8(_mm256_and_si256(p[j], m), e);
        kt[j + 4] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(p[j], 4), m), e);
    }
}

/* The integer-dot scores of rows r0 .. min(r0 + 8, n) - 1 for HB heads (avx512.c's
 * tile_scores_limbs with one limb: q, pkvi_quant_query's int8, is the unsigned operand
 * after a byte xor, and 128 times each token's sum of k is taken off). Each block's
 * terms are added in block order into a stack array, not registers: 16 ymm registers do
 * not hold 4 heads' sums beside a block's 8 transposed vectors. */
AI void tile8_scores_qd(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t r0,
                        uint32_t n, const int8_t *qi, const float *qs, size_t dpad,
                        uint32_t nb, float *s, const char *pf, const bool l2, const int HB)
{
    const size_t bb = pkvi_quant_block_bytes(dt);
    const size_t lines = (n * row_bytes + 63) / 64; /* half the lines each half */
    const __m256i ones = _mm256_set1_epi8(1), flip = _mm256_set1_epi8(-128);
    _Alignas(32) float acc[4][8];
    for (uint32_t b = 0; b < nb; b++) {
        const char *blk0 = krow + b * bb;
        if (pf) {
            const size_t u = (r0 / 8) * nb + b, un = 2 * (size_t)nb;
            for (size_t ln = u * lines / un; ln < (u + 1) * lines / un; ln++)
                pf_line(pf + ln * 64, l2);
        }
        __m256i kt[8];
        if (dt == PKV_Q8)
            qv_kt_q8(blk0, row_bytes, r0, n, kt);
        else
            qv_kt_q4(blk0, row_bytes, r0, n, kt);
        __m256i ks = _mm256_setzero_si256(); /* per token: sum of its 32 integers */
        PKVI_UNROLL
        for (int j = 0; j < 8; j++)
            ks = _mm256_dpbusd_avx_epi32(ks, ones, kt[j]);
        const __m256i bias = _mm256_slli_epi32(ks, 7);
        const __m256 dk = _mm256_cvtph_ps(block_scales8(blk0, row_bytes, n, r0, r0 + 4));
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const int8_t *qb = qi + (size_t)h * dpad + b * 32;
            __m256i a = _mm256_setzero_si256();
            PKVI_UNROLL
            for (int j = 0; j < 8; j++) {
                int32_t q4;
                memcpy(&q4, qb + 4 * j, sizeof q4);
                a = _mm256_dpbusd_avx_epi32(a, _mm256_xor_si256(_mm256_set1_epi32(q4), flip),
                                            kt[j]);
            }
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_sub_epi32(a, bias));
            const __m256 dkq = _mm256_mul_ps(dk, _mm256_set1_ps(qs[h * nb + b]));
            const __m256 term = _mm256_mul_ps(dkq, isum);
            _mm256_store_ps(acc[h], b ? _mm256_add_ps(_mm256_load_ps(acc[h]), term)
                                      : _mm256_add_ps(_mm256_setzero_ps(), term));
        }
    }
    const uint32_t m = n - r0 < 8 ? n - r0 : 8;
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        memcpy(s + h * PKVI_TILE + r0, acc[h], m * sizeof(float));
}

AI bool qd_tile_scores(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t d,
                       uint32_t n, const int8_t *qi, const float *qs, size_t dpad,
                       uint32_t nb, float *s, const char *pf, const bool l2, const int HB)
{
    if (d % 32 != 0)
        return false;
    tile8_scores_qd(dt, krow, row_bytes, 0, n, qi, qs, dpad, nb, s, pf, l2, HB);
    if (n > 8)
        tile8_scores_qd(dt, krow, row_bytes, 8, n, qi, qs, dpad, nb, s, pf, l2, HB);
    return true;
}

#define PKVI_QD_TILE 1
#endif

#include "qdot256.h" /* qk_heads_int: the integer-dot scores */

/* The stream kick's distance (walk.h) for this file: 512 KiB, not the 128 KiB measured on
 * the Zen 5 host for avx512.c. On the AVX2 dev VM (Zen-1-class, one llama3-8b layer at
 * 128k tokens, pagedkv bench --reps 5, three rounds interleaving builds with 128, 256,
 * 512 and 1024 KiB, medians): f32 131.7 -> 121.2 ms on one thread and 74.5 -> 71.1 on
 * two; f16 128.1 -> 125.5, bf16 120.1 -> 120.1 (one thread); 1024 KiB lost f16 4%. */
#ifndef KICK_AHEAD_BYTES
#define KICK_AHEAD_BYTES (512u << 10)
#endif

#define PKVI_WALK_BLOCK_TYPES 1 /* the loads above read Q8 and Q4 */
#define PKVI_WALK_QUANT_DOT 1   /* and qk_heads_int scores them in integers */
#include "walk.h"

/* ---- store ---------------------------------------------------------------------------
 * Bitwise dtype.c's conversions: vcvtps2ph (round to nearest even) for f16, integer
 * rounding for bf16; the last n % 8 values use dtype.c's scalar functions. */
AI __m128i bf16_of(__m256 x)
{
    const __m256i u = _mm256_castps_si256(x);
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    /* signed compare is right: abs is non-negative */
    const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256i r = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
    /* values < 2^16: the unsigned-saturating pack is exact; fix its lane order */
    const __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(pk);
}

#include "qstore256.h" /* qs_store_row: the Q8/Q4 store */

static void store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    uint32_t i = 0;
    uint16_t *o = dst;
    switch (t) {
    case PKV_Q8:
    case PKV_Q4: /* quant.c's bytes, from 256-bit vectors */
        qs_store_row(t, dst, src, n);
        break;
    case PKV_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case PKV_F16:
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((void *)(o + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < n; i++)
            o[i] = pkvi_f32_to_f16(src[i]);
        break;
    case PKV_BF16:
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((void *)(o + i), bf16_of(_mm256_loadu_ps(src + i)));
        for (; i < n; i++)
            o[i] = pkvi_f32_to_bf16(src[i]);
        break;
    }
}

#if PKVI_AVX2_VNNI
const pkvi_kernels pkvi_kernels_avx2vnni = {"avx2vnni", attend, store_row};
#else
const pkvi_kernels pkvi_kernels_avx2 = {"avx2", attend, store_row};
#endif

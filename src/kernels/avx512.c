/*
 * kernels/avx512.c - the AVX-512 decode kernel and row store (compiled with
 * -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; called only after
 * kernels/dispatch.c saw those features in cpuid and the ZMM state enabled in XCR0).
 * meson compiles it twice: as pkvi_kernels_avx512, and with -mavx512vnni and
 * PKVI_AVX512_VNNI as pkvi_kernels_avx512vnni, whose integer-dot scores use vpdpbusd
 * (the same bits: qd_wide_blocks, qd_tile_scores) and whose exact Q8/Q4 scores of rows
 * whose blocks are all whole come from q cut into integer limbs (ql_prep_head,
 * tile_scores_limbs; within the bound of docs/numerics.md section 4, not the same
 * bits): the only differences.
 *
 * Owns: pkvi_kernels_avx512 (or pkvi_kernels_avx512vnni). Does not own: the semantics
 * (kernels/ref.c is the specification), the conversions' definition (dtype.c),
 * threading or split-K (decode.c).
 *
 * Same tiling as the reference: per page, tiles of at most PKVI_TILE positions that
 * start at the page's first row; per tile the running state is rescaled once. What
 * differs from ref.c (docs/numerics.md section 3):
 *   - q.k is summed in 16 lane partials, then a fixed reduction tree;
 *   - l and acc use fused multiply-adds;
 *   - exp is our own polynomial (<= 2 ulp, tests/test_kernels.c measures it).
 * Each call is deterministic (no data-dependent order, no threads) and page-local:
 * the state after a page depends only on the state before it and the page.
 *
 * Shape of the work for one tile of n <= 16 tokens (GQA: hg heads share the rows):
 *   QK:  blocks of HB heads x TB tokens (HB*TB == 16 accumulators); each K row chunk
 *        is loaded and widened once and used by all HB heads; one 16-way reduction
 *        tree turns the 16 accumulators into 16 scores.
 *   PV:  blocks of HB heads x CB 16-float chunks of d kept in registers; each V row
 *        chunk is widened once and used for the HB heads.
 * Rows past `last_tokens` of the last page are never loaded; the d tail uses masked
 * loads and stores, so nothing past a row is read either.
 *
 * The walk over pages and groups, the one-tile software pipeline and the entry points
 * are kernels/walk.h's, written once for both SIMD files. Q8/Q4 rows are read a whole
 * block at a time where the row has one (ldq32_raw: QK scales them once per block, PV
 * folds the scale into the weights; Q4's in a permuted order, which q and the block's
 * accumulators take on too), else by ldq/ldqm (exact path). The integer-dot path's
 * scores are qdot256.h's, with pairs of whole blocks in one zmm (qd_wide_blocks:
 * vpmaddubsw + vpmaddwd, or vpdpbusd in the avx512vnni build); the avx512vnni build
 * scores a tile of rows whose blocks are all whole at once, transposed so that
 * vpdpbusd adds into 16 tokens' lanes and no reduction across lanes is left
 * (qd_tile_scores).
 *
 * The micro-kernels are written with small arrays of vectors indexed by constant
 * loops; PKVI_UNROLL (kernels.h) makes -O2 builds unroll them too, so the arrays live in
 * registers (without it gcc -O2 runs this file 3.5x slower than -O3).
 */
#include "kernels/kernels.h"
#include "base/dtype.h"
#include "base/quant.h"

#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

/* Software prefetch of the page ahead. Pages are scattered and one group's rows in a
 * page are only 2*bt*d*size bytes (8 KiB at bt=16, d=128, f16), too short for the
 * hardware stream prefetcher to get going: while the kernel reads a K/V row chunk it
 * asks for the same chunk `dist` pages ahead, dist = enough pages for PF_AHEAD_BYTES.
 * Measured on the 2-core Zen 5 dev VM (tools: kernel over 128k tokens of a llama3-8b
 * layer in the engine's layout, 1 thread, best of 11, DRAM sum ~36 GB/s): no prefetch
 * 8.3 GB/s; T0 one page ahead 15.9; T1 one page ahead 15.1; a burst of the whole next
 * page at page start 9.6; T1 two and four pages ahead 11.9-15.1. T0 keeps ~24 lines in
 * flight (the L1 miss buffers), which caps one core near 23 GB/s even on contiguous
 * pages; see docs/numerics.md "Performance". */
/* One line of the unit ahead: into L1 (T0), or with l2 (pkvi_kparams.pf_l2) into L2
 * only (T1), which on Zen 4 leaves the L1 miss buffers to the demand loads. */
AI void pf_line(const char *a, const bool l2)
{
    if (l2)
        _mm_prefetch(a, _MM_HINT_T1);
    else
        _mm_prefetch(a, _MM_HINT_T0);
}
#ifndef PF_AHEAD_BYTES
#define PF_AHEAD_BYTES 4096u
#endif

/* ---- loads: 16 values of the page's dtype from element i of row base, as f32 ----- */

AI __m512 ld(pkv_dtype dt, const void *base, size_t i)
{
    if (dt == PKV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const void *)((const uint16_t *)base + i)));
    if (dt == PKV_BF16) {
        __m256i h = _mm256_loadu_si256((const void *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

/* Same, only lanes of k are read (others 0): the d tail. */
AI __m512 ldm(pkv_dtype dt, const void *base, size_t i, __mmask16 k)
{
    if (dt == PKV_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)base + i));
    if (dt == PKV_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)base + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)base + i);
}

/* ---- loads of the block types (Q8, Q4; the format is quant.c's) ------------------
 * 16 values from element c (c % 16 == 0) never straddle a block of 32. Dequantized as
 * d * q in f32, exact: bitwise the values quant.c's loads (and avx2.c's) give. */
#define QTYPE(dt) ((dt) == PKV_Q8 || (dt) == PKV_Q4)

AI const char *qblock(pkv_dtype dt, const char *row, uint32_t c)
{
    return row + (size_t)(c / 32) * pkvi_quant_block_bytes(dt);
}

AI float qscale(const char *blk)
{
    uint16_t h;
    memcpy(&h, blk, sizeof h);
    return _cvtsh_ss(h);
}

AI __m512 ldq(pkv_dtype dt, const char *row, uint32_t c)
{
    const char *blk = qblock(dt, row, c);
    __m512i v;
    if (dt == PKV_Q8) {
        v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(blk + 2 + c % 32)));
    } else { /* 8 bytes, 16 nibbles: low then high of each byte, in order */
        const __m128i x = _mm_loadl_epi64((const void *)(blk + 2 + (c % 32) / 2));
        const __m128i m = _mm_set1_epi8(15);
        const __m128i b = _mm_unpacklo_epi8(_mm_and_si128(x, m),
                                            _mm_and_si128(_mm_srli_epi16(x, 4), m));
        v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(8));
    }
    return _mm512_mul_ps(_mm512_set1_ps(qscale(blk)), _mm512_cvtepi32_ps(v));
}

/* The 32 integers of a whole block (blk: its scale, then its values) as f32: Q8 as
 * stored, in row order; Q4 nibble - 8 in the block's *permuted* order, values 0, 2, ..,
 * 30 in v[0] and 1, 3, .., 31 in v[1] (its 16 bytes widened once, then the low and the
 * high nibbles looked up: 4 operations where row order took 11 - two byte interleaves
 * and a second widening more), so QK reads q permuted the same way (q_permute) and PV keeps
 * the block's accumulators in that order while it adds (pv_block). Exact: times the
 * block's scale they are ldq's values bit for bit. */
AI void ldq32_raw(pkv_dtype dt, const char *blk, __m512 v[2])
{
    if (dt == PKV_Q8) {
        v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(blk + 2))));
        v[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(blk + 18))));
        return;
    }
    /* nibble -> nibble - 8 in f32 by table: vpermps reads only the low 4 bits of
     * each index lane, so the low nibble needs no mask and neither needs a subtract
     * or a conversion (4 operations per block where 7 were) */
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i y = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(blk + 2)));
    v[0] = _mm512_permutexvar_ps(y, lut);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(y, 4), lut);
}

/* q in the order the exact Q4 QK reads it (walk.h attend_prep; dst != src): each whole
 * block of 32 as [values 0, 2, .., 30 | 1, 3, .., 31] (ldq32_raw's order), the rest of
 * the row (a shorter last block, read by ldq/ldqm) as it is. */
#define PKVI_WALK_PERMUTED_Q4 1
AI void q_permute(const pkv_dtype dt, const float *src, float *dst, uint32_t d)
{
    uint32_t c = 0;
    if (dt == PKV_Q4)
        for (; c + 32 <= d; c += 32)
            for (uint32_t j = 0; j < 16; j++) {
                dst[c + j] = src[c + 2 * j];
                dst[c + 16 + j] = src[c + 2 * j + 1];
            }
    memcpy(dst + c, src + c, (size_t)(d - c) * sizeof(float));
}

/* The first rem (1..15) values from element c, the other lanes 0. */
AI __m512 ldqm(pkv_dtype dt, const char *row, uint32_t c, uint32_t rem)
{
    const char *blk = qblock(dt, row, c);
    const float d = qscale(blk);
    _Alignas(64) float tmp[16] = {0};
    for (uint32_t j = 0; j < rem; j++)
        tmp[j] = d * (float)pkvi_quant_block_int(dt, (const unsigned char *)blk, c % 32 + j);
    return _mm512_load_ps(tmp);
}

/* ---- exp ----------------------------------------------------------------------------
 * e^x = 2^n * e^r, n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 split
 * in a 9-bit head, so n * head is exact, and a tail). e^r = 1 + r + r^2 p(r) with the
 * Cephes expf minimax coefficients. 2^n is applied by vscalef, which rounds once, so
 * subnormal results are right too. x is clamped to [-110, 89]: below -103.98 the
 * result is 0 (n = -159 puts it under half the smallest subnormal), above 88.73 inf.
 * max/min take x as the second operand, so NaN passes through. Max error measured by
 * tests/test_kernels.c (exp_accuracy) over [-104, 0]: see docs/numerics.md. */
AI __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* ---- reduction tree: lane i of the result = sum of the 16 lanes of v[i] -----------
 * 4 levels, 30 shuffles + 15 adds for 16 sums (against 16 x 8 ops for 16 separate
 * horizontal sums). The order of additions is fixed. */
AI __m512 hsum16(const __m512 v[16])
{
    __m512 t[8], u[4], w[2];
    PKVI_UNROLL
    for (int i = 0; i < 8; i++) /* lanes of v[2i] and v[2i+1], interleaved, 2 summed */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    PKVI_UNROLL
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: one sum of 4 for v[4i..4i+3] */
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    PKVI_UNROLL
    for (int i = 0; i < 2; i++) /* fold 128-bit lanes 0+1 and 2+3 */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xdd));
}

/* ---- QK ------------------------------------------------------------------------------
 * Unscaled dots of HB heads (q rows qh, stride d) with TB consecutive K rows (krow);
 * writes s[h * PKVI_TILE + t]. HB * TB <= 16. */
AI void qk_block(pkv_dtype dt, const void *krow, uint32_t d, const float *qh, float *s,
                 const char *pf, const bool l2, size_t row_bytes, const float *ksc, const int HB,
                 const int TB)
{
    if (pf)
        for (size_t off = 0; off < TB * row_bytes; off += 64)
            pf_line(pf + off, l2);
    __m512 a[16];
    PKVI_UNROLL
    for (int i = 0; i < 16; i++)
        a[i] = _mm512_setzero_ps();
    uint32_t c = 0;
    if (QTYPE(dt)) /* whole blocks: each row's scale read and broadcast once per block */
        for (; c + 32 <= d; c += 32)
            PKVI_UNROLL
            for (int t = 0; t < TB; t++) {
                const char *blk = qblock(dt, (const char *)krow + t * row_bytes, c);
                const __m512 sc = _mm512_set1_ps(ksc[(c / 32) * PKVI_TILE + (uint32_t)t]);
                __m512 kv[2];
                ldq32_raw(dt, blk, kv);
                PKVI_UNROLL
                for (int u = 0; u < 2; u++) {
                    const __m512 k = _mm512_mul_ps(sc, kv[u]); /* ldq's values */
                    PKVI_UNROLL
                    for (int h = 0; h < HB; h++)
                        a[h * TB + t] = _mm512_fmadd_ps(
                            _mm512_loadu_ps(qh + (size_t)h * d + c + 16 * u), k, a[h * TB + t]);
                }
            }
    for (; c + 16 <= d; c += 16) {
        __m512 qv[4];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            qv[h] = _mm512_loadu_ps(qh + (size_t)h * d + c);
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const __m512 kv = QTYPE(dt) ? ldq(dt, (const char *)krow + t * row_bytes, c)
                                        : ld(dt, krow, (size_t)t * d + c);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h * TB + t] = _mm512_fmadd_ps(qv[h], kv, a[h * TB + t]);
        }
    }
    if (c < d) {
        const __mmask16 k = (__mmask16)((1u << (d - c)) - 1u);
        __m512 qv[4];
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            qv[h] = _mm512_maskz_loadu_ps(k, qh + (size_t)h * d + c);
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const __m512 kv = QTYPE(dt) ? ldqm(dt, (const char *)krow + t * row_bytes, c, d - c)
                                        : ldm(dt, krow, (size_t)t * d + c, k);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                a[h * TB + t] = _mm512_fmadd_ps(qv[h], kv, a[h * TB + t]);
        }
    }
    const __m512 r = hsum16(a);
    /* lanes [h*TB, h*TB + TB) belong to head h: a masked store at an offset base */
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        _mm512_mask_storeu_ps(s + h * (PKVI_TILE - TB),
                              (__mmask16)(((1u << TB) - 1u) << (h * TB)), r);
}

/* The f16 scales of one whole block of a tile's n (<= 16) rows, widened (lane t: row
 * t's; 0 past n, whose rows are never read). Each scale is a two-byte load into a
 * general register, four of them packed into a 64-bit word, the four words moved into
 * one vector: the vector units see 4 moves and a conversion where a masked gather of
 * 16 lanes was (8 per tile). On Zen 5 (bench_ab, one thread, 512 and 131072 tokens)
 * that took Q4 exact to 0.89-0.92 of its time with the gather and the integer paths to
 * 0.89-0.97; Q8 exact unchanged (docs/perf-log.md). Before the gather there was a
 * scalar load, a conversion and a broadcast per row and block. */
#include "qscales.h" /* block_scales8 */

/* lanes 0-3 rows a .. a+3, 4-7 rows b.., 8-11 rows c.., 12-15 rows e.. */
AI __m512 block_scales16_of(const char *blk0, size_t row_bytes, uint32_t n, uint32_t a,
                            uint32_t b, uint32_t c, uint32_t e)
{
    return _mm512_cvtph_ps(_mm256_set_m128i(block_scales8(blk0, row_bytes, n, c, e),
                                            block_scales8(blk0, row_bytes, n, a, b)));
}

AI __m512 block_scales16(const char *blk0, size_t row_bytes, uint32_t n)
{
    return block_scales16_of(blk0, row_bytes, n, 0, 4, 8, 12);
}

/* ksc[b * 16 + t]: the scale of whole block b of K row t, for the n rows of a tile */
AI void ksc_load(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t n, uint32_t d,
                 float *ksc)
{
    for (uint32_t b = 0; (b + 1) * 32 <= d; b++)
        _mm512_store_ps(ksc + b * PKVI_TILE,
                        block_scales16(krow + b * pkvi_quant_block_bytes(dt), row_bytes, n));
}

/* Scores of n tokens for HB heads: blocks of TB tokens, then one token at a time. */
AI void qk_heads(pkv_dtype dt, const void *krow, size_t row_bytes, uint32_t d,
                 uint32_t n, const float *qh, float *s, const char *pf, const bool l2,
                 const int HB)
{
    const int TB = 16 / HB;
    _Alignas(64) float ksc[PKVI_MAX_HEAD_DIM / 32 * PKVI_TILE]; /* Q8/Q4: ksc_load */
    if (QTYPE(dt))
        ksc_load(dt, krow, row_bytes, n, d, ksc);
    uint32_t t = 0;
    for (; t + (uint32_t)TB <= n; t += (uint32_t)TB)
        qk_block(dt, (const char *)krow + t * row_bytes, d, qh, s + t,
                 pf ? pf + t * row_bytes : NULL, l2, row_bytes, ksc + t, HB, TB);
    for (; t < n; t++)
        qk_block(dt, (const char *)krow + t * row_bytes, d, qh, s + t,
                 pf ? pf + t * row_bytes : NULL, l2, row_bytes, ksc + t, HB, 1);
}

/* ---- PV ------------------------------------------------------------------------------
 * A whole block's 32 accumulators, two vectors in row order, into ldq32_raw's Q4
 * order (values 0, 2, .., 30, then 1, 3, .., 31), and back: once per block, head and
 * tile, where the unpack they spare is once per block and token. */
AI void q4_acc_split(__m512 *a0, __m512 *a1)
{
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512 e = _mm512_permutex2var_ps(*a0, ev, *a1);
    *a1 = _mm512_permutex2var_ps(*a0, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), *a1);
    *a0 = e;
}

AI void q4_acc_join(__m512 *a0, __m512 *a1)
{
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512 r = _mm512_permutex2var_ps(*a0, lo, *a1);
    *a1 = _mm512_permutex2var_ps(*a0, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), *a1);
    *a0 = r;
}

/* acc[h][c0 .. c0 + 16*CB) = alpha[h] * acc + sum_t w[h][t] * v_t for HB heads and CB
 * chunks; `tail` (CB == 1): only the lanes of k exist. `raw` (Q8/Q4, CB 2 or 4: one
 * or two whole blocks from c0): w holds each block's weights with the token's block
 * scale folded in (pv_heads), block j's at w + j * WS_STRIDE, and v_t are the blocks'
 * integers. */
#define WS_STRIDE (4 * PKVI_TILE)
AI void pv_block(pkv_dtype dt, const void *vrow, uint32_t d, uint32_t c0, uint32_t n,
                 const float *w, const float *alpha, float *acc, const char *pf, const bool l2,
                 uint32_t ln0, uint32_t ln1, const int HB, const int CB, const bool tail,
                 const __mmask16 k, const bool raw)
{
    const size_t es = dt == PKV_F32 ? 4u : 2u;
    const size_t vrb = QTYPE(dt) ? pkvi_quant_row_bytes(dt, d) : 0; /* a block row's bytes */
    __m512 a[4][4];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++) {
        const __m512 al = _mm512_set1_ps(alpha[h]);
        PKVI_UNROLL
        for (int c = 0; c < CB; c++) {
            float *p = acc + (size_t)h * d + c0 + 16 * c;
            a[h][c] = _mm512_mul_ps(tail ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p),
                                    al);
        }
        if (raw && dt == PKV_Q4) /* ldq32_raw's order */
            PKVI_UNROLL
            for (int j = 0; j < CB / 2; j++)
                q4_acc_split(&a[h][2 * j], &a[h][2 * j + 1]);
    }
    for (uint32_t t = 0; t < n; t++) {
        if (pf && dt == PKV_F32) /* step t's part of lines [ln0, ln1) ahead */
            for (uint32_t ln = ln0 + t * (ln1 - ln0) / n; ln < ln0 + (t + 1) * (ln1 - ln0) / n;
                 ln++)
                pf_line(pf + (size_t)ln * 64, l2);
        else if (pf && QTYPE(dt)) { /* the first block's call asks for row t ahead */
            if (c0 == 0)
                for (size_t off = 0; off < vrb; off += 64)
                    pf_line(pf + t * vrb + off, l2);
        } else if (pf) /* this block's bytes of row t, in the page `dist` ahead */
            for (size_t off = c0 * es; off < (c0 + 16u * CB) * es && off < d * es; off += 64)
                pf_line(pf + t * d * es + off, l2);
        __m512 vv[4];
        if (raw) {
            PKVI_UNROLL
            for (int j = 0; j < CB / 2; j++)
                ldq32_raw(dt, qblock(dt, (const char *)vrow + t * vrb, c0 + 32u * (uint32_t)j),
                          vv + 2 * j);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                PKVI_UNROLL
                for (int c = 0; c < CB; c++)
                    a[h][c] = _mm512_fmadd_ps(
                        _mm512_set1_ps(w[(c / 2) * WS_STRIDE + h * PKVI_TILE + t]), vv[c],
                        a[h][c]);
            continue;
        }
        PKVI_UNROLL
        for (int c = 0; c < CB; c++)
            vv[c] = QTYPE(dt)
                        ? (tail ? ldqm(dt, (const char *)vrow + t * vrb, c0, d - c0)
                                : ldq(dt, (const char *)vrow + t * vrb, c0 + 16 * (uint32_t)c))
                        : (tail ? ldm(dt, vrow, (size_t)t * d + c0, k)
                                : ld(dt, vrow, (size_t)t * d + c0 + 16 * c));
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const __m512 wb = _mm512_set1_ps(w[h * PKVI_TILE + t]);
            PKVI_UNROLL
            for (int c = 0; c < CB; c++)
                a[h][c] = _mm512_fmadd_ps(wb, vv[c], a[h][c]);
        }
    }
    /* Make the compiler recompute the row addresses here instead of keeping HB*CB
     * pointers live across the token loop (they spilled, and V chunks with them). */
    __asm__("" : "+r"(acc));
    if (raw && dt == PKV_Q4)
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            PKVI_UNROLL
            for (int j = 0; j < CB / 2; j++)
                q4_acc_join(&a[h][2 * j], &a[h][2 * j + 1]);
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        PKVI_UNROLL
        for (int c = 0; c < CB; c++) {
            float *p = acc + (size_t)h * d + c0 + 16 * c;
            if (tail)
                _mm512_mask_storeu_ps(p, k, a[h][c]);
            else
                _mm512_storeu_ps(p, a[h][c]);
        }
}

/* f32 (see PF_IN_ADDRESS_ORDER in walk.h): block b prefetches lines [b*L/B, (b+1)*L/B)
 * of the L lines of the n rows ahead, so the prefetches run in address order (+5-6% over
 * each block's own columns on top of the walk's order, 128k tokens, 2 threads). The
 * half types prefetch each block's own columns, row by row (in address order: -6-8%);
 * so does avx2.c, whose eight 64-byte blocks per f32 row measured -12% with shares. */
AI void pv_heads(pkv_dtype dt, const void *vrow, uint32_t d, uint32_t n, const float *w,
                 const float *alpha, float *acc, const char *pf, const bool l2, const int HB)
{
    const uint32_t B = d / 64 + (d % 64) / 16 + (d % 16 != 0);
    const uint32_t L = (uint32_t)(((size_t)n * d * sizeof(float) + 63) / 64);
    uint32_t c = 0, b = 0;
    if (QTYPE(dt)) {
        /* Whole blocks, two at a time where the row has them: each token's block scale
         * folded into the weights once per tile, ws[j][h][t] = w[h][t] * dv_t (the
         * tile's 16 scales of a block: block_scales16), so the inner loop
         * multiply-adds the blocks' integers: no per-value multiply, no per-token
         * scale load and broadcast. (w * dv) * q for ldq's w * (dv * q): the products
         * reassociated, as avx2.c does. */
        const size_t vrb = pkvi_quant_row_bytes(dt, d), bb = pkvi_quant_block_bytes(dt);
        _Alignas(64) float ws[2 * WS_STRIDE];
        while (c + 32 <= d) {
            const int nblk = c + 64 <= d ? 2 : 1;
            for (int j = 0; j < nblk; j++) {
                const __m512 sv = block_scales16(
                    (const char *)vrow + (c / 32 + (uint32_t)j) * bb, vrb, n);
                PKVI_UNROLL
                for (int h = 0; h < HB; h++)
                    _mm512_store_ps(ws + j * WS_STRIDE + h * PKVI_TILE,
                                    _mm512_mul_ps(_mm512_loadu_ps(w + h * PKVI_TILE), sv));
            }
            if (nblk == 2)
                pv_block(dt, vrow, d, c, n, ws, alpha, acc, pf, l2, 0, 0, HB, 4, false, 0xffff,
                         true);
            else
                pv_block(dt, vrow, d, c, n, ws, alpha, acc, pf, l2, 0, 0, HB, 2, false, 0xffff,
                         true);
            c += 32u * (uint32_t)nblk;
        }
    }
    for (; c + 64 <= d; c += 64, b++)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, b * L / B, (b + 1) * L / B, HB, 4,
                 false, 0xffff, false);
    for (; c + 16 <= d; c += 16, b++)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, b * L / B, (b + 1) * L / B, HB, 1,
                 false, 0xffff, false);
    if (c < d)
        pv_block(dt, vrow, d, c, n, w, alpha, acc, pf, l2, b * L / B, (b + 1) * L / B, HB, 1,
                 true, (__mmask16)((1u << (d - c)) - 1u), false);
}

/* ---- softmax of one tile --------------------------------------------------------------
 * Lane 4k+i of the result = op over all 16 lanes of v[i] (every 128-bit lane k holds
 * the 4 results): 10 shuffles and 5 ops for 4 heads instead of 4 x 8 dependent steps. */
AI __m512 red4(__m512 (*op)(__m512, __m512), __m512 v0, __m512 v1, __m512 v2, __m512 v3)
{
    const __m512 a = op(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    const __m512 b = op(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
    __m512 c = op(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)),
                  _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
    c = op(c, _mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
    return op(c, _mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(1, 0, 3, 2)));
}

AI __m512 vmax(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
AI __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }

/* tanh for soft-capping: the method and bound of avx2.c's tanh8, 16 lanes. */
AI __m512 tanh16(__m512 x)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 e = exp16(_mm512_add_ps(ax, ax));
    const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f),
                                                        _mm512_add_ps(e, one)));
    const __m512 x2 = _mm512_mul_ps(ax, ax);
    __m512 p = _mm512_set1_ps(3.5921280365e-3f);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-8.8632355299e-3f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.1869488536e-2f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-5.3968253968e-2f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(1.3333333333e-1f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-3.3333333333e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(ax, x2), p, ax);
    const __mmask16 lt = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.4f), _CMP_LT_OQ);
    const __m512 r = _mm512_mask_mov_ps(big, lt, small);
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(r),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}

/* Scaled scores, soft-capped when cap > 0. */
AI __m512 scores16(__m512 raw, __m512 sc, float cap)
{
    const __m512 x = _mm512_mul_ps(raw, sc);
    if (cap <= 0.0f)
        return x;
    const __m512 c = _mm512_set1_ps(cap);
    return _mm512_mul_ps(c, tanh16(_mm512_div_ps(x, c)));
}

/* Heads h0 .. h0+nh (nh <= 4) of a tile of n tokens: s[h][0..n) holds unscaled dots;
 * on return the weights exp(s*scale - m'), alpha[h] = exp(m - m'), m and l updated as
 * in ref.c (l = l * alpha + sum, fused here). */
AI void softmax4(uint32_t nh, uint32_t n, float scale, float cap, float *s, float *m,
                 float *l, float *alpha)
{
    const __mmask16 nk = (__mmask16)((1u << n) - 1u);
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-__builtin_inff());
    __m512 sv[4];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 4; i++) /* missing heads and tokens score -inf */
        sv[i] = i >= nh ? ninf
                : cap > 0.0f
                    ? _mm512_mask_mov_ps(ninf, nk,
                                         scores16(_mm512_maskz_loadu_ps(nk, s + i * PKVI_TILE),
                                                  sc, cap))
                    : _mm512_mask_mul_ps(ninf, nk, _mm512_maskz_loadu_ps(nk, s + i * PKVI_TILE),
                                         sc);
    const __mmask16 hk = (__mmask16)((1u << nh) - 1u);
    const __m512 mt = red4(vmax, sv[0], sv[1], sv[2], sv[3]);
    const __m512 mo = _mm512_broadcast_f32x4(_mm_maskz_loadu_ps((__mmask8)hk, m));
    /* fmaxf(m, mt): a NaN tile max keeps m, as in ref.c */
    const __m512 mn = _mm512_max_ps(mt, mo);
    __m512 e[4];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 4; i++) {
        const __m512 mi = _mm512_permutexvar_ps(_mm512_set1_epi32((int)i), mn);
        e[i] = exp16(_mm512_sub_ps(sv[i], mi));
        if (i < nh)
            _mm512_store_ps(s + i * PKVI_TILE, e[i]);
    }
    const __m512 ps = red4(vadd, e[0], e[1], e[2], e[3]);
    const __m512 al = exp16(_mm512_sub_ps(mo, mn));
    const __m512 lv = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(hk, l), al, ps);
    _mm512_mask_storeu_ps(alpha, hk, al);
    _mm512_mask_storeu_ps(l, hk, lv);
    _mm512_mask_storeu_ps(m, hk, mn);
}

AI void softmax_tile(uint32_t hg, uint32_t n, float scale, float cap, float *s, float *m,
                     float *l, float *alpha)
{
    for (uint32_t h = 0; h < hg; h += 4)
        softmax4(hg - h < 4 ? hg - h : 4, n, scale, cap, s + (size_t)h * PKVI_TILE, m + h,
                 l + h, alpha + h);
}

#define PKVI_QD_WIDE 1 /* qdot256.h leaves pairs of whole blocks to qd_wide_blocks */

#if PKVI_AVX512_VNNI
/* ---- the integer-dot scores of a whole tile, transposed (avx512vnni) ----------------
 * Where every block of the row is whole (d % 32 == 0), the tile's rows are transposed
 * a block at a time so that lane t of vector j holds 4 bytes j of row t's block: then
 * one vpdpbusd per 4 values and head, with the head's 4 q bytes broadcast, adds into
 * 16 tokens' lanes at once, and the block's isums come out per token with no
 * reduction across lanes (qd_wide_blocks spends most of its operations on that). q is
 * the unsigned operand, q + 128 (a byte xor), so k keeps its sign and each lane ends
 * at isum + 128 * sum(k): sum(k) per token is one more vpdpbusd per 4 values (with
 * ones), shared by the heads. The isums are exact, the score terms (dk * dq) * isum
 * are summed in block order: ref.c's arithmetic, bit for bit. */

/* The tile's token order in lane t: QD_T8 for Q8's 8x8 transposes (row t's lanes in
 * 128-bit groups 0, 2, 1, 3), the identity for Q4's 4x4 ones. An involution. */
#define QD_T8 _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)

/* Q8 block b of rows 0..n-1 (rows past n read as 0, never loaded): kt[j] lane t =
 * bytes 4j .. 4j+3 of the block of row QD_T8[t]. An 8x8 dword transpose on each
 * 256-bit half: rows i and i + 8 in one vector, then unpacks and a lane shuffle. */
AI void qd_kt_q8(const char *blk0, size_t row_bytes, uint32_t n, __m512i kt[8])
{
    __m512i z[8], t[8], u[8];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 8; i++) {
        const __m256i lo = i < n ? _mm256_loadu_si256((const void *)(blk0 + i * row_bytes + 2))
                                 : _mm256_setzero_si256();
        const __m256i hi = i + 8 < n
                               ? _mm256_loadu_si256((const void *)(blk0 + (i + 8) * row_bytes + 2))
                               : _mm256_setzero_si256();
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    PKVI_UNROLL
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    PKVI_UNROLL
    for (int i = 0; i < 8; i += 4) { /* u[i + k]: rows i .. i+3 (and +8), dwords k, k + 4 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    PKVI_UNROLL
    for (int k = 0; k < 4; k++) {
        kt[k] = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(2, 0, 2, 0));
        kt[k + 4] = _mm512_shuffle_i32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* Q4 block b of rows 0..n-1: kt[j] lane t = row t's integers (nibble - 8) at
 * positions 4j .. 4j+3 of kblock_bytes' order (low nibbles, then high: the order q is
 * permuted to). A 4x4 dword transpose of the packed bytes in each 128-bit lane (rows
 * t, t + 4, t + 8, t + 12 in one vector), then the nibbles split. */
AI void qd_kt_q4(const char *blk0, size_t row_bytes, uint32_t n, __m512i kt[8])
{
    __m512i z[4], t[4];
    PKVI_UNROLL
    for (uint32_t i = 0; i < 4; i++) {
        __m128i r[4];
        PKVI_UNROLL
        for (uint32_t L = 0; L < 4; L++)
            r[L] = i + 4 * L < n
                       ? _mm_loadu_si128((const void *)(blk0 + (i + 4 * L) * row_bytes + 2))
                       : _mm_setzero_si128();
        z[i] = _mm512_inserti32x4(
            _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(r[0]), r[1], 1), r[2],
                               2),
            r[3], 3);
    }
    t[0] = _mm512_unpacklo_epi32(z[0], z[1]);
    t[1] = _mm512_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm512_unpacklo_epi32(z[2], z[3]);
    t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
    const __m512i p[4] = {_mm512_unpacklo_epi64(t[0], t[2]), _mm512_unpackhi_epi64(t[0], t[2]),
                          _mm512_unpacklo_epi64(t[1], t[3]), _mm512_unpackhi_epi64(t[1], t[3])};
    const __m512i m = _mm512_set1_epi8(15), e = _mm512_set1_epi8(8);
    PKVI_UNROLL
    for (int j = 0; j < 4; j++) {
        kt[j] = _mm512_sub_epi8(_mm512_and_si512(p[j], m), e);
        kt[j + 4] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(p[j], 4), m), e);
    }
}

/* The scores of n rows and HB heads whose q is NL limbs of int8 per value, the last one
 * signed, the others unsigned bytes (ql + h * NL * dpad + r * dpad: limb r of head h),
 * value = sum_r limb_r 2^(8r) times the head's block scale qs[h * nb + b]. NL = 1 is the
 * integer dot (the limb is pkvi_quant_query's qi); NL = 4 (QL_LIMBS), the exact path's
 * limbs (ql_prep_head). The signed limb is the unsigned operand after a byte xor (+ 128):
 * here for NL = 1, by ql_prep_head for NL = 4 (once per call, not once per tile). 128
 * times each token's sum of k comes off the lanes. Per block the limbs' isums are exact
 * int32; for NL = 4 they join as float(isum_3 2^8 + isum_2) 2^16 + float(isum_1 2^8 +
 * isum_0), both sums exact in int32 (|.| < 2^28.1) and each rounded once, then one fused
 * multiply-add: the block's dot to within 3u of its terms' magnitudes. */
AI void tile_scores_limbs(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t n,
                          const int8_t *ql, const float *qs, size_t dpad, uint32_t nb,
                          float *s, const char *pf, const bool l2, const int HB, const int NL)
{
    const size_t bb = pkvi_quant_block_bytes(dt);
    const size_t lines = (n * row_bytes + 63) / 64; /* prefetched a share per block */
    const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8(-128);
    __m512 acc[4];
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        acc[h] = _mm512_setzero_ps();
    for (uint32_t b = 0; b < nb; b++) {
        const char *blk0 = krow + b * bb;
        if (pf)
            for (size_t ln = b * lines / nb; ln < (b + 1) * lines / nb; ln++)
                pf_line(pf + ln * 64, l2);
        __m512i kt[8];
        if (dt == PKV_Q8)
            qd_kt_q8(blk0, row_bytes, n, kt);
        else
            qd_kt_q4(blk0, row_bytes, n, kt);
        __m512i ks = _mm512_setzero_si512(); /* per token: sum of its 32 integers */
        PKVI_UNROLL
        for (int j = 0; j < 8; j++)
            ks = _mm512_dpbusd_epi32(ks, ones, kt[j]);
        const __m512i bias = _mm512_slli_epi32(ks, 7);
        const __m512 dk = dt == PKV_Q8 ? block_scales16_of(blk0, row_bytes, n, 0, 8, 4, 12)
                                       : block_scales16(blk0, row_bytes, n);
        PKVI_UNROLL
        for (int h = 0; h < HB; h++) {
            const int8_t *qb = ql + (size_t)h * NL * dpad + b * 32;
            __m512i a[4];
            PKVI_UNROLL
            for (int r = 0; r < NL; r++)
                a[r] = _mm512_setzero_si512();
            PKVI_UNROLL
            for (int j = 0; j < 8; j++)
                PKVI_UNROLL
                for (int r = 0; r < NL; r++) {
                    int32_t q4;
                    memcpy(&q4, qb + (size_t)r * dpad + 4 * j, sizeof q4);
                    const __m512i qv = _mm512_set1_epi32(q4);
                    a[r] = _mm512_dpbusd_epi32(
                        a[r], NL == 1 ? _mm512_xor_si512(qv, flip) : qv, kt[j]);
                }
            const __m512i top = _mm512_sub_epi32(a[NL - 1], bias);
            const __m512 isum =
                NL == 1 ? _mm512_cvtepi32_ps(top)
                        : _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(
                                              _mm512_slli_epi32(top, 8), a[NL - 2])),
                                          _mm512_set1_ps(65536.0f),
                                          _mm512_cvtepi32_ps(_mm512_add_epi32(
                                              _mm512_slli_epi32(a[1], 8), a[0])));
            const __m512 dkq = _mm512_mul_ps(dk, _mm512_set1_ps(qs[h * nb + b]));
            const __m512 term = _mm512_mul_ps(dkq, isum);
            acc[h] = _mm512_add_ps(acc[h], term);
        }
    }
    const __mmask16 nk = (__mmask16)((1u << n) - 1u);
    PKVI_UNROLL
    for (int h = 0; h < HB; h++)
        _mm512_mask_storeu_ps(s + h * PKVI_TILE, nk,
                              dt == PKV_Q8 ? _mm512_permutexvar_ps(QD_T8, acc[h]) : acc[h]);
}

AI bool qd_tile_scores(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t d,
                       uint32_t n, const int8_t *qi, const float *qs, size_t dpad,
                       uint32_t nb, float *s, const char *pf, const bool l2, const int HB)
{
    if (d % 32 != 0)
        return false;
    tile_scores_limbs(dt, krow, row_bytes, n, qi, qs, dpad, nb, s, pf, l2, HB, 1);
    return true;
}

/* ---- the exact path's scores from integer limbs of q (avx512vnni, whole blocks) ------
 * Block b of a head's q is held as Q_j 2^e: e = max(ilogb(a) - 29, -149), a the
 * block's largest |q_j|, Q_j = rint(q_j 2^-e), so |Q_j| <= 2^30 and |q_j - Q_j 2^e| <=
 * 2^(e-1), at most 2^-30 a (below a = 2^-120, 2^-150); values of at least a / 64 are
 * held exactly. (Three limbs, 2^-22 a, missed SPEC §9's 1e-5 where a block's largest
 * value sits on a K channel of zeros: docs/numerics.md section 3.) Q_j = H 2^24 + N 2^16
 * + M 2^8 + L with L, M, N in [0, 255] and H in [-64, 64], stored as H + 128 (the byte
 * xor tile_scores_limbs needs for its unsigned operand): four vpdpbusd per 4 values and
 * head where the f32 path spends a conversion, a scale multiply and an FMA per value
 * (tile_scores_limbs). A block whose largest |q| is not finite gets
 * the scale NaN, so the head's scores are NaN, as on the f32 path. The error this adds
 * to a score is in docs/numerics.md section 4. */
#define PKVI_WALK_LIMBS 1
#include "qlimbs.h" /* QL_LIMBS, ql_block_exp, ldexp_pow2 */
_Static_assert(QL_LIMBS == 4, "tile_scores_limbs joins limbs 3 and 2, then 1 and 0, and "
                              "ql_prep_head writes four");

AI void ql_prep_head(uint32_t d, const float *q, int8_t *ql, float *qs)
{
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (uint32_t i = 0, b = 0; i < d; i += 32, b++) {
        const __m512 v[2] = {_mm512_loadu_ps(q + i), _mm512_loadu_ps(q + i + 16)};
        const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], absm),
                                                           _mm512_and_ps(v[1], absm)));
        const __mmask16 nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                              _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
        int e = -149;
        if (nan || !(a <= 3.4028235e38f)) { /* max drops a NaN lane: each lane is tested */
            qs[b] = NAN;
        } else {
            e = ql_block_exp(a);
            qs[b] = ldexp_pow2(e);
        }
        if (!(qs[b] >= 0.0f)) {
            for (uint32_t r = 0; r < QL_LIMBS; r++)
                memset(ql + (size_t)r * d + i, 0, 32);
            continue;
        }
        const __m512 sc = _mm512_set1_ps((float)-e);
        PKVI_UNROLL
        for (int u = 0; u < 2; u++) {
            const __m512i Q = _mm512_cvt_roundps_epi32(
                _mm512_scalef_ps(v[u], sc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((void *)(ql + i + 16 * u), _mm512_cvtepi32_epi8(Q));
            /* the low bytes of Q >> 8, Q >> 16 and Q >> 24: a logical shift gives the
             * same bits as an arithmetic one there */
            _mm_storeu_si128((void *)(ql + d + i + 16 * u),
                             _mm512_cvtepi32_epi8(_mm512_srli_epi32(Q, 8)));
            _mm_storeu_si128((void *)(ql + 2 * (size_t)d + i + 16 * u),
                             _mm512_cvtepi32_epi8(_mm512_srli_epi32(Q, 16)));
            _mm_storeu_si128((void *)(ql + 3 * (size_t)d + i + 16 * u),
                             _mm_xor_si128(_mm512_cvtepi32_epi8(_mm512_srli_epi32(Q, 24)),
                                           _mm_set1_epi8(-128)));
        }
    }
}

AI void ql_tile_scores(pkv_dtype dt, const char *krow, size_t row_bytes, uint32_t n,
                       const int8_t *ql, const float *qs, size_t dpad, uint32_t nb, float *s,
                       const char *pf, const bool l2, const int HB)
{
    tile_scores_limbs(dt, krow, row_bytes, n, ql, qs, dpad, nb, s, pf, l2, HB, QL_LIMBS);
}
#define PKVI_QD_TILE 1
#endif
#include "qdot256.h" /* qk_heads_int: the integer-dot scores, blocks one at a time */

/* ---- the integer-dot scores, two blocks per vector ------------------------------------
 * qdot256.h's arithmetic on 512-bit vectors: the K integers of blocks b and b+1 of a
 * row in one zmm (Q4: each block's low nibbles, then its high ones, the order q is
 * permuted to), |k| times q with k's sign (a byte mask from k, then a masked negation:
 * AVX-512 has no vpsignb), vpmaddubsw then vpmaddwd by ones, exact as there. */
AI __m512i kblocks2_i8(pkv_dtype dt, const char *blk, size_t bb)
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
AI __m512i qd_hsum8x2(const __m512i v[8])
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

#if PKVI_AVX512_VNNI
/* With VNNI (this file compiled a second time, as the avx512vnni table): vpdpbusd
 * multiplies unsigned by signed bytes and adds each 4 products into an int32 lane, the
 * lanes vpmaddubsw + vpmaddwd fill, in one instruction. k is made unsigned, k + 128
 * (its sign bit flipped), and each lane starts at -128 times
 * the sum of its 4 q bytes (one vpdpbusd of 128s per head and step), so it ends at
 * sum k * q exactly (|lane| < 2^18: no wrap): the isums, hence the scores, are the
 * avx512 table's bit for bit. */
AI __m512i kblocks2_u8(pkv_dtype dt, const char *blk, size_t bb)
{
    return _mm512_xor_si512(kblocks2_i8(dt, blk, bb), _mm512_set1_epi8(-128));
}
#endif

AI uint32_t qd_wide_count(uint32_t d, uint32_t nb) /* qd_wide_blocks' loop bound */
{
    return (d / 32 < nb ? d / 32 : nb) & ~1u;
}

AI uint32_t qd_wide_blocks(pkv_dtype dt, const char *krow, uint32_t d, const int8_t *qi,
                           const float *dqv, size_t dpad, uint32_t nb, size_t row_bytes,
                           const int HB, const int TB, __m256 *acc)
{
    const size_t bb = pkvi_quant_block_bytes(dt);
    const __m512i zero = _mm512_setzero_si512();
#if !PKVI_AVX512_VNNI
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    const uint32_t end = qd_wide_count(d, nb);
    uint32_t b = 0;
    for (; b < end; b += 2) {
        __m512i pr[8];
        PKVI_UNROLL
        for (int i = HB * TB; i < 8; i++)
            pr[i] = zero;
#if PKVI_AVX512_VNNI
        __m512i bias[4]; /* per head: -128 * (sum of each lane's 4 q bytes) */
        PKVI_UNROLL
        for (int h = 0; h < HB; h++)
            bias[h] = _mm512_sub_epi32(
                zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(-128),
                                          _mm512_loadu_si512((const void *)(qi + h * dpad + b * 32))));
#endif
        uint32_t sb0[8], sb1[8];
        PKVI_UNROLL
        for (int t = 0; t < TB; t++) {
            const char *blk = krow + t * row_bytes + b * bb;
            sb0[t] = kblock_scale_bits(blk);
            sb1[t] = kblock_scale_bits(blk + bb);
#if PKVI_AVX512_VNNI
            const __m512i ku = kblocks2_u8(dt, blk, bb);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++)
                pr[h * TB + t] = _mm512_dpbusd_epi32(
                    bias[h], ku, _mm512_loadu_si512((const void *)(qi + h * dpad + b * 32)));
#else
            const __m512i k = kblocks2_i8(dt, blk, bb);
            const __m512i ka = _mm512_abs_epi8(k);
            const __mmask64 neg = _mm512_movepi8_mask(k);
            PKVI_UNROLL
            for (int h = 0; h < HB; h++) {
                const __m512i qv = _mm512_loadu_si512((const void *)(qi + h * dpad + b * 32));
                pr[h * TB + t] = _mm512_madd_epi16(
                    _mm512_maddubs_epi16(ka, _mm512_mask_sub_epi8(qv, neg, zero, qv)), ones);
            }
#endif
        }
        const __m512 dk = _mm512_cvtph_ps(
            _mm256_set_m128i(qd_lane_scales(sb1, TB), qd_lane_scales(sb0, TB)));
        const __m512 dq = _mm512_loadu_ps(dqv + 8 * b);
        const __m512 term = _mm512_mul_ps(_mm512_mul_ps(dk, dq), _mm512_cvtepi32_ps(qd_hsum8x2(pr)));
        /* block b's terms, then block b+1's: qdot256.h's order */
        *acc = _mm256_add_ps(*acc, _mm512_castps512_ps256(term));
        *acc = _mm256_add_ps(*acc, _mm512_extractf32x8_ps(term, 1));
    }
    return b;
}

#define PKVI_WALK_BLOCK_TYPES 1 /* the loads above read Q8 and Q4 */
#define PKVI_WALK_QUANT_DOT 1
#include "walk.h"

/* ---- store ---------------------------------------------------------------------------
 * Bitwise the conversions of dtype.c: vcvtps2ph rounds to nearest even with overflow
 * to inf and quiets NaN exactly as pkvi_f32_to_f16 does; bf16 is integer rounding
 * (vcvtneps2bf16 would flush subnormals, so it is not used). */
AI __m256i bf16_of(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000)); /* quiet bit */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

#include "qstore256.h" /* qs_store_row: the Q8/Q4 store */

static void store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    uint32_t i = 0;
    switch (t) {
    case PKV_Q8:
    case PKV_Q4: /* quant.c's bytes, from 256-bit vectors */
        qs_store_row(t, dst, src, n);
        break;
    case PKV_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case PKV_F16:
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((void *)((uint16_t *)dst + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if (i < n) {
            const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
            _mm256_mask_storeu_epi16((uint16_t *)dst + i, k,
                                     _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, src + i),
                                                     _MM_FROUND_TO_NEAREST_INT |
                                                         _MM_FROUND_NO_EXC));
        }
        break;
    case PKV_BF16:
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((void *)((uint16_t *)dst + i),
                                bf16_of(_mm512_loadu_ps(src + i)));
        if (i < n) {
            const __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
            _mm256_mask_storeu_epi16((uint16_t *)dst + i, k,
                                     bf16_of(_mm512_maskz_loadu_ps(k, src + i)));
        }
        break;
    }
}

#if PKVI_AVX512_VNNI
const pkvi_kernels pkvi_kernels_avx512vnni = {"avx512vnni", attend, store_row};
#else
const pkvi_kernels pkvi_kernels_avx512 = {"avx512", attend, store_row};
#endif

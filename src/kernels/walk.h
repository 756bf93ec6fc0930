/*
 * kernels/walk.h - the part of a SIMD decode kernel that does not depend on the ISA:
 * the walk over pages and groups, the one-tile software pipeline, the prefetch
 * targets, and the pkvi_attend_fn entry points for the three dtypes.
 *
 * Included by avx2.c and avx512.c after they define, for their vector width:
 *   AI                 their always-inline function specifier
 *   PF_AHEAD_BYTES     how far ahead (at least) the prefetch target lies
 *   qk_heads(dt, krow, row_bytes, d, n, q, s, pf, HB)
 *                      unscaled dots of HB heads with n K rows into s [HB][PKVI_TILE]
 *   pv_heads(dt, vrow, d, n, w, alpha, acc, pf, HB)
 *                      acc = alpha * acc + weights w times n V rows, for HB heads
 *   softmax_tile(hg, n, scale, cap, s, m, l, alpha)
 *                      the per-tile softmax step of ref.c for hg heads (cap: softcap)
 * and, with PKVI_WALK_QUANT_DOT 1 (the integer-dot path, quant_dot = 1):
 *   qk_heads_int(dt, krow, row_bytes, d, n, qi, qs, dpad, nb, s, pf, HB)
 *                      integer-dot scores of HB quantized heads (qi: [HB][dpad] int8,
 *                      in the order qd_permute gives; qs: [HB][nb] block scales)
 * and, with PKVI_WALK_LIMBS 1 (the exact Q8/Q4 scores from integer limbs of q):
 *   ql_prep_head(d, q, ql, qs)
 *                      one head's q (d a multiple of 32) as QL_LIMBS int8 limbs per
 *                      value, [QL_LIMBS][d], and a power-of-two scale per block
 *   ql_tile_scores(dt, krow, row_bytes, n, ql, qs, dpad, nb, s, pf, HB)
 *                      the exact-path scores of HB heads from those limbs
 * and, with PKVI_WALK_PERMUTED_BF16 1 (a bf16 QK that reads q in a kernel order) or
 * PKVI_WALK_PERMUTED_Q4 1 (the same for the exact Q4 QK):
 *   q_permute(dt, src, dst, d)
 *                      one head's q in that order (attend_prep prepares it per call)
 * so each file is compiled with its own -m flags (STYLE.md) and the code is written
 * once. Defines `attend`, a pkvi_attend_fn.
 */
#ifndef PKV_KERNELS_WALK_H
#define PKV_KERNELS_WALK_H

#include "base/quant.h"

#include <stdbool.h>
#include <string.h>

/* head_dim and head_dim_v of a walk: the call's (D == 0), or both D, a constant the
 * compiler folds into the walk (WALK_FN_D128 below). */
#define WALK_DK(p, D) ((D) ? (D) : (p)->head_dim)
#define WALK_DV(p, D) ((D) ? (D) : PKVI_DV(p))

/* How a walk forms its scores: from f32 q (the exact path's loads), from q rounded to
 * int8 (the integer dot, quant_dot = 1), or from q cut into integer limbs (the exact
 * path of a file with PKVI_WALK_LIMBS, where every block of the row is whole). */
typedef enum { QK_F32, QK_INT, QK_LIMBS } qk_kind;
#ifndef QL_LIMBS
#define QL_LIMBS 1
#endif

/* int8 values of prepared q per value of a head: one for the integer dot, QL_LIMBS */
AI uint32_t qk_bytes(const qk_kind qk)
{
    return qk == QK_LIMBS ? QL_LIMBS : 1u;
}

/* One tile of the walk: n <= PKVI_TILE rows of one group of one page, the heads and
 * state it folds into, and the rows of the unit `dist` ahead to prefetch (or NULL). */
typedef struct {
    const char *k, *v, *pfk, *pfv;
    const float *q;
    const int8_t *qi;   /* QK_INT, QK_LIMBS: the group's heads prepared, [hg][bytes][dpad] */
    const float *qs;    /* QK_INT, QK_LIMBS: their block scales, [hg][nb] */
    float *m, *l, *acc;
    uint32_t n;
} tile;

/* Bytes of a stored row of n values (pkv_row_bytes, inlined for the constant dt). */
AI size_t row_bytes_of(const pkv_dtype dt, uint32_t n)
{
    if (dt == PKV_Q8 || dt == PKV_Q4)
        return pkvi_quant_row_bytes(dt, n);
    return (size_t)n * (dt == PKV_F32 ? 4u : 2u);
}

/* Unscaled scores of the tile's rows for all hg heads into s [hg][TILE]. */
AI void tile_qk(const pkv_dtype dt, const qk_kind qk, const uint32_t D, const pkvi_kparams *p,
                const tile *t, float *s)
{
    const uint32_t d = WALK_DK(p, D), hg = p->hg;
    const size_t row = row_bytes_of(dt, d);
    const char *pk = t->pfk; /* only the first head block prefetches: same rows for all */
    const bool l2 = p->pf_l2;
    uint32_t h = 0;
#if PKVI_WALK_LIMBS
    if (qk == QK_LIMBS) {
        const uint32_t nb = d / 32, dp = d, hs = QL_LIMBS * dp;
        for (; h + 4 <= hg; h += 4, pk = NULL)
            ql_tile_scores(dt, t->k, row, t->n, t->qi + (size_t)h * hs, t->qs + (size_t)h * nb,
                           dp, nb, s + h * PKVI_TILE, pk, l2, 4);
        if (hg - h >= 2) {
            ql_tile_scores(dt, t->k, row, t->n, t->qi + (size_t)h * hs, t->qs + (size_t)h * nb,
                           dp, nb, s + h * PKVI_TILE, pk, l2, 2);
            h += 2;
            pk = NULL;
        }
        if (h < hg)
            ql_tile_scores(dt, t->k, row, t->n, t->qi + (size_t)h * hs, t->qs + (size_t)h * nb,
                           dp, nb, s + h * PKVI_TILE, pk, l2, 1);
        return;
    }
#endif
#if PKVI_WALK_QUANT_DOT
    if (qk == QK_INT) {
        const uint32_t nb = (d + 31) / 32, dp = nb * 32;
        for (; h + 4 <= hg; h += 4, pk = NULL)
            qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                         dp, nb, s + h * PKVI_TILE, pk, l2, 4);
        if (hg - h >= 2) {
            qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                         dp, nb, s + h * PKVI_TILE, pk, l2, 2);
            h += 2;
            pk = NULL;
        }
        if (h < hg)
            qk_heads_int(dt, t->k, row, d, t->n, t->qi + (size_t)h * dp, t->qs + (size_t)h * nb,
                         dp, nb, s + h * PKVI_TILE, pk, l2, 1);
        return;
    }
#endif
    (void)qk;
    for (; h + 4 <= hg; h += 4, pk = NULL)
        qk_heads(dt, t->k, row, d, t->n, t->q + (size_t)h * d, s + h * PKVI_TILE, pk, l2, 4);
    if (hg - h >= 2) {
        qk_heads(dt, t->k, row, d, t->n, t->q + (size_t)h * d, s + h * PKVI_TILE, pk, l2, 2);
        h += 2;
        pk = NULL;
    }
    if (h < hg)
        qk_heads(dt, t->k, row, d, t->n, t->q + (size_t)h * d, s + h * PKVI_TILE, pk, l2, 1);
}

/* acc = alpha * acc + weights (s) times the tile's V rows, for all hg heads. */
AI void tile_pv(const pkv_dtype dt, const uint32_t D, const pkvi_kparams *p, const tile *t,
                const float *s, const float *alpha)
{
    const uint32_t d = WALK_DV(p, D), hg = p->hg;
    const char *pv = t->pfv;
    const bool l2 = p->pf_l2;
    float *acc = t->acc;
    uint32_t h = 0;
    for (; h + 4 <= hg; h += 4, pv = NULL)
        pv_heads(dt, t->v, d, t->n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 4);
    if (hg - h >= 2) {
        pv_heads(dt, t->v, d, t->n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 2);
        h += 2;
        pv = NULL;
    }
    if (h < hg)
        pv_heads(dt, t->v, d, t->n, s + h * PKVI_TILE, alpha + h, acc + (size_t)h * d, pv, l2, 1);
}

/*
 * Which V rows ahead PV(k-1) prefetches. The demand order is K(u), V(u-1), K(u+1),
 * V(u): a step down in address between each pair. By default tile_pv asks for its own
 * rows `dist` units ahead, so the prefetches follow that demand order. For f32 it asks
 * for the V rows of the tile just scored, so the prefetch stream runs in address order
 * (K(u+dist), V(u+dist), K(u+dist+1), ...; the first tile's V rows ahead are skipped).
 * Measured on the Zen 5 dev VM, 128k tokens of a llama3-8b layer, in-process pairs
 * (docs/numerics.md, "What moved the figures" and "The read order alone"): f32
 * +16-24% on 1 and 2 threads; f16 -5-12%, so the half types keep the demand order.
 */
#define PF_IN_ADDRESS_ORDER(dt) ((dt) == PKV_F32)

/*
 * The stream kick. The software prefetches above keep about one unit in flight, which
 * the core's L1 miss buffers cap near 23 GB/s. So for every unit the walk also
 * touches the first two lines of the K and the V block of the unit KICK_AHEAD_BYTES
 * of rows ahead. The likely mechanism (the VM shows no hardware counters to confirm
 * it): those two lines start the L2's hardware stream prefetcher on each 4 KiB block
 * long before the prefetch one unit ahead asks for it, so the block is on its way
 * into L2 without holding L1 miss buffers. Results do not change (prefetches only). Measured on the Zen 5 dev
 * VM, 128k tokens of a llama3-8b layer, in one process against the walk without it
 * (docs/numerics.md, "What moved the figures"): one thread, of DRAM, f16 0.72-0.74 ->
 * 0.93, bf16 0.67-0.70 -> 0.79-0.84, f32 0.64-0.66 -> 0.84-0.85; AVX2 f16 +22%.
 */
#ifndef KICK_AHEAD_BYTES /* an including file (avx2.c) or a -D for A/B runs may set it */
#define KICK_AHEAD_BYTES (128u << 10)
#endif

/* The kick for one unit whose K block starts at kb: its first two lines, then the V
 * block's (v_offset further). Written out: the same four prefetches issued from a
 * loop bounded by the block size measured 20% slower at 128k tokens (one thread),
 * for no reason the loop itself explains; kept this way, and re-measure it if the
 * walk changes. */
AI void kick_unit(const char *kb, size_t v_offset)
{
    _mm_prefetch(kb, _MM_HINT_T0);
    _mm_prefetch(kb + 64, _MM_HINT_T0);
    _mm_prefetch(kb + v_offset, _MM_HINT_T0);
    _mm_prefetch(kb + v_offset + 64, _MM_HINT_T0);
}

/* A unit of the walk, `ahead` units past the current one: (page, group), stepped with
 * the walk. Its address is taken only while it lies inside the call's units. */
typedef struct {
    uint64_t page;
    uint32_t group;
} cursor;

AI cursor cursor_at(uint64_t ahead, uint32_t n_groups)
{
    return (cursor){ahead / n_groups, (uint32_t)(ahead % n_groups)};
}

AI void cursor_step(cursor *c, uint32_t n_groups)
{
    if (++c->group == n_groups) {
        c->group = 0;
        c->page++;
    }
}

AI const char *cursor_unit(const cursor *c, const void *const *pages, const pkvi_kparams *p,
                           uint32_t group0)
{
    return (const char *)pages[c->page] + (size_t)(group0 + c->group) * p->group_stride;
}

/*
 * The walk: units (page, group) in page-major order, a unit being one group's K and V
 * rows of a page, cut into tiles. The prefetch target is the unit `dist` ahead.
 *
 * Software-pipelined by one tile: QK(k), then PV(k-1), then softmax(k). The softmax
 * is a chain of dependent reductions and exps; QK(k+1), which comes next and does not
 * depend on it, keeps the FMA units busy while it resolves. Each head still sees its
 * own operations in the order of ref.c (softmax(k) only reads m and l, and PV(k-1)
 * precedes PV(k)), so the results are those of the unpipelined order, bit for bit.
 */
AI void attend_impl(const pkv_dtype dt, const qk_kind qk, const uint32_t D,
                    const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                    uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                    const pkvi_heads *x, const int8_t *qi, const float *qs)
{
    /* QK_INT, QK_LIMBS: group i's prepared heads at qi + i * qi_stride, qs + i * qs_stride */
    const bool qd = qk != QK_F32;
    const uint32_t nbq = (WALK_DK(p, D) + 31) / 32;
    const size_t qi_stride = (size_t)p->hg * qk_bytes(qk) * nbq * 32;
    const size_t qs_stride = (size_t)p->hg * nbq;
    const size_t row = row_bytes_of(dt, WALK_DK(p, D)), vrow = row_bytes_of(dt, WALK_DV(p, D));
    /* prefetch distance in units: at least PF_AHEAD_BYTES of rows */
    const size_t region = (size_t)p->block_tokens * (row + vrow);
    const uint64_t dist = region >= PF_AHEAD_BYTES ? 1u : (PF_AHEAD_BYTES + region - 1) / region;
    const uint64_t kick = (KICK_AHEAD_BYTES + region - 1) / region; /* the kick's, >= 1 */
    /* blocks under two lines are too small for a stream, and far too small to miss */
    const bool kicks = PKVI_PF && (size_t)p->block_tokens * row >= 128;
    const uint64_t n_units = (uint64_t)n_pages * n_groups;
    /* scores/weights [hg][TILE] and alpha [hg] of the tile in flight and the one before;
     * every tile's lanes are written before they are read (scores up to n, -inf/exp
     * beyond), but they are zeroed so no vector op ever sees indeterminate bits */
    _Alignas(64) float s[2][PKVI_MAX_GROUP_HEADS * PKVI_TILE];
    _Alignas(64) float alpha[2][PKVI_MAX_GROUP_HEADS];
    memset(s[0], 0, (size_t)p->hg * PKVI_TILE * sizeof(float));
    memset(s[1], 0, (size_t)p->hg * PKVI_TILE * sizeof(float));
    tile prev = {0};
    int cur = 0;
    bool pending = false;

    /* the prefetch target, kept `dist` units ahead, and the kick's, `kick` ahead */
    uint64_t u = 0;
    cursor near = cursor_at(dist, n_groups), far = cursor_at(kick, n_groups);
    for (uint32_t pg = 0; pg < n_pages; pg++) {
        const uint32_t ntok = pg + 1 == n_pages ? last_tokens : p->block_tokens;
        for (uint32_t i = 0; i < n_groups; i++, u++) {
            const char *kbase = (const char *)pages[pg] + (size_t)(group0 + i) * p->group_stride;
            const char *pfk = PKVI_PF && u + dist < n_units
                                  ? cursor_unit(&near, pages, p, group0) : NULL;
            if (kicks && u + kick < n_units)
                kick_unit(cursor_unit(&far, pages, p, group0), p->v_offset);
            cursor_step(&near, n_groups);
            cursor_step(&far, n_groups);
            for (uint32_t t0 = 0; t0 < ntok; t0 += PKVI_TILE) {
                const tile t = {
                    .k = kbase + t0 * row,
                    .v = kbase + p->v_offset + t0 * vrow,
                    .pfk = pfk ? pfk + t0 * row : NULL,
                    .pfv = pfk ? pfk + p->v_offset + t0 * vrow : NULL,
                    .q = x->q + i * x->q_stride,
                    .qi = qd ? qi + i * qi_stride : NULL,
                    .qs = qd ? qs + i * qs_stride : NULL,
                    .m = x->m + i * x->st_stride,
                    .l = x->l + i * x->st_stride,
                    .acc = x->acc + i * x->st_stride,
                    .n = ntok - t0 < PKVI_TILE ? ntok - t0 : PKVI_TILE,
                };
                tile_qk(dt, qk, D, p, &t, s[cur]);
                if (pending) {
                    if (PF_IN_ADDRESS_ORDER(dt))
                        prev.pfv = t.pfv;
                    tile_pv(dt, D, p, &prev, s[!cur], alpha[!cur]);
                }
                softmax_tile(p->hg, t.n, p->scale, p->softcap, s[cur], t.m, t.l, alpha[cur]);
                prev = t;
                pending = true;
                cur = !cur;
            }
        }
    }
    if (pending)
        tile_pv(dt, D, p, &prev, s[!cur], alpha[!cur]);
}

/* One out-of-line walk per dtype and path (a pkvi_attend_fn each): inlined together
 * into attend, the walks shared one frame of tens of KiB and gcc spilled the loops' row
 * pointers (Q8/Q4 were: docs/perf-log.md). WALK_FN(name, call) defines name with the
 * kernel signature and `call` as its body, in which D is 0 (head_dim from the call). */
#define WALK_FN(name, call)                                                               \
    AI void name##_body(const uint32_t D, const pkvi_kparams *p, const void *const *pages, \
                        uint32_t n_pages, uint32_t last_tokens, uint32_t group0,           \
                        uint32_t n_groups, const pkvi_heads *x)                            \
    {                                                                                     \
        call;                                                                             \
    }                                                                                     \
    static void name(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,   \
                     uint32_t last_tokens, uint32_t group0, uint32_t n_groups,            \
                     const pkvi_heads *x)                                                 \
    {                                                                                     \
        name##_body(0, p, pages, n_pages, last_tokens, group0, n_groups, x);              \
    }
/* WALK_FN, and name##_d128: the same walk for head_dim = head_dim_v = 128 (Llama,
 * Mistral, Qwen), where they are constants. The block types' walks then unroll their
 * loops over the row's blocks and keep them in registers; `bench_ab`, one thread,
 * both orders, on the Zen 5 dev VM (avx512vnni), time against the generic walk at 4096
 * and 131072 tokens: Q8 0.89-0.95, Q4 0.87-0.91, Q8 integer 0.80-0.89, Q4 integer
 * 0.81-0.91; the AVX2 table (forced) 0.92-0.97. The same bits: only constants change.
 * f16, bf16 and f32 stay generic: so built, f16 was 5% slower at 131072 tokens (faster
 * at 4096) and both half types 3-5% slower on the AVX2 table (docs/perf-log.md). */
#define WALK_FN_D128(name, call)                                                          \
    WALK_FN(name, call)                                                                   \
    static void name##_d128(const pkvi_kparams *p, const void *const *pages,              \
                            uint32_t n_pages, uint32_t last_tokens, uint32_t group0,      \
                            uint32_t n_groups, const pkvi_heads *x)                       \
    {                                                                                     \
        name##_body(128, p, pages, n_pages, last_tokens, group0, n_groups, x);            \
    }
#define WALK_EXACT(dt) \
    attend_impl(dt, QK_F32, D, p, pages, n_pages, last_tokens, group0, n_groups, x, NULL, NULL)

#if PKVI_WALK_QUANT_DOT || PKVI_WALK_PERMUTED_BF16 || PKVI_WALK_PERMUTED_Q4
/* Bytes of prepared q a call holds on its stack - quantized (int8; the scales add 1/8
 * of it), or permuted f32: every group of a decode of usual shapes (llama3-8b: 8 x 4
 * heads x 128, 4 KiB of int8, 16 KiB of f32) at once; a larger call (prefill tiles
 * stack up to 256 heads) is walked in runs of groups, or of heads, that fit - the
 * arithmetic is page-, group- and head-local (kernels.h), so the results are the bits
 * of one walk. */
#define PREP_SCRATCH_BYTES (32u << 10)
_Static_assert(PREP_SCRATCH_BYTES / (PKVI_MAX_HEAD_DIM * sizeof(float)) >= 1,
               "attend_prep's runs need room for at least one head of f32 q");
#if !PKVI_WALK_PERMUTED_BF16 && !PKVI_WALK_PERMUTED_Q4
AI void q_permute(const pkv_dtype dt, const float *src, float *dst, uint32_t d)
{
    (void)dt, (void)src, (void)dst, (void)d;
}
#endif

/* Q4 blocks are read as the low nibbles of their 16 bytes (values 0, 2, .., 30), then
 * the high ones (1, 3, .., 31): q is stored in that order, so the integer dot (exact,
 * any order) pairs each value with its own. Q8 keeps the row order. */
AI void qd_permute(const pkv_dtype dt, int8_t *qi, uint32_t dpad)
{
    if (dt != PKV_Q4)
        return;
    for (uint32_t c = 0; c < dpad; c += 32) {
        int8_t t[32];
        for (uint32_t j = 0; j < 16; j++) {
            t[j] = qi[c + 2 * j];
            t[16 + j] = qi[c + 2 * j + 1];
        }
        memcpy(qi + c, t, sizeof t);
    }
}

/* The stack scratch of prepared q: qi [heads][qk_bytes][dpad] and qs [heads][nb]
 * (QK_INT, QK_LIMBS), or qf [heads][d] (a permuted dtype). */
typedef struct {
    _Alignas(64) union {
        int8_t qi[PREP_SCRATCH_BYTES];
        float qf[PREP_SCRATCH_BYTES / sizeof(float)];
    } u;
    _Alignas(64) float qs[PREP_SCRATCH_BYTES / 32];
} prep_scratch;

/* Head q (d values) into slot k of the scratch: quantized (qdot256.h's qd_quant_query,
 * pkvi_quant_query's bits, as ref.c) and qd_permute'd, cut into limbs (each limb
 * qd_permute'd), or q_permute'd. */
AI void prep_head(const pkv_dtype dt, const qk_kind qk, uint32_t d, const float *q,
                  prep_scratch *ps, size_t k)
{
    const uint32_t nb = (d + 31) / 32, dpad = nb * 32;
    if (qk == QK_INT) {
        qd_quant_query(d, q, ps->u.qi + k * dpad, ps->qs + k * nb);
        qd_permute(dt, ps->u.qi + k * dpad, dpad);
#if PKVI_WALK_LIMBS
    } else if (qk == QK_LIMBS) {
        int8_t *ql = ps->u.qi + k * QL_LIMBS * dpad;
        ql_prep_head(d, q, ql, ps->qs + k * nb);
        for (uint32_t r = 0; r < QL_LIMBS; r++)
            qd_permute(dt, ql + r * dpad, dpad);
#endif
    } else {
        q_permute(dt, q, ps->u.qf + k * d, d);
    }
}

/* The walk of a path whose q is prepared first (the integer dot, or a permuted dtype):
 * prepare the call's heads, then walk in runs whose prepared q fits the scratch. */
AI void attend_prep(const pkv_dtype dt, const qk_kind qk, const uint32_t D,
                    const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                    uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                    const pkvi_heads *x)
{
    const uint32_t d = WALK_DK(p, D), dv = WALK_DV(p, D), H = p->hg, nb = (d + 31) / 32;
    const bool qd = qk != QK_F32;
    /* heads that fit: >= 2 for f32 and >= 8 for int8 at PKVI_MAX_HEAD_DIM */
    const uint32_t fit = PREP_SCRATCH_BYTES / (qd ? qk_bytes(qk) * nb * 32
                                                  : d * (uint32_t)sizeof(float));
    prep_scratch ps;
    const int8_t *qi = qd ? ps.u.qi : NULL;
    const float *qs = qd ? ps.qs : NULL;
    if (H <= fit) { /* runs of whole groups */
        const uint32_t per = fit / H;
        for (uint32_t g = 0; g < n_groups; g += per) {
            const uint32_t ng = n_groups - g < per ? n_groups - g : per;
            for (uint32_t i = 0; i < ng; i++)
                for (uint32_t h = 0; h < H; h++)
                    prep_head(dt, qk, d, x->q + (g + i) * x->q_stride + (size_t)h * d, &ps,
                              (size_t)i * H + h);
            const pkvi_heads xs = {
                .q = qd ? x->q + g * x->q_stride : ps.u.qf,
                .m = x->m + g * x->st_stride, .l = x->l + g * x->st_stride,
                .acc = x->acc + g * x->st_stride,
                .q_stride = qd ? x->q_stride : H * d, .st_stride = x->st_stride,
            };
            attend_impl(dt, qk, D, p, pages, n_pages, last_tokens, group0 + g, ng, &xs, qi, qs);
        }
        return;
    }
    pkvi_kparams ph = *p; /* runs of the heads of one group */
    for (uint32_t g = 0; g < n_groups; g++)
        for (uint32_t h0 = 0; h0 < H; h0 += fit) {
            ph.hg = H - h0 < fit ? H - h0 : fit;
            for (uint32_t h = 0; h < ph.hg; h++)
                prep_head(dt, qk, d, x->q + g * x->q_stride + (size_t)(h0 + h) * d, &ps, h);
            const pkvi_heads xs = {
                .q = qd ? x->q + g * x->q_stride + (size_t)h0 * d : ps.u.qf,
                .m = x->m + g * x->st_stride + h0, .l = x->l + g * x->st_stride + h0,
                .acc = x->acc + g * x->st_stride + (size_t)h0 * dv,
                .q_stride = x->q_stride, .st_stride = x->st_stride,
            };
            attend_impl(dt, qk, D, &ph, pages, n_pages, last_tokens, group0 + g, 1, &xs, qi, qs);
        }
}
#endif

/* bf16 on a kernel whose QK reads q permuted (PKVI_WALK_PERMUTED_BF16) walks with q
 * prepared */
#if PKVI_WALK_QUANT_DOT || PKVI_WALK_PERMUTED_BF16 || PKVI_WALK_PERMUTED_Q4
/* the walk of dtype dt with the call's q prepared first: quantized (QK_INT), cut into
 * limbs (QK_LIMBS) or permuted (QK_F32) */
#define WALK_PREP(dt, qk) \
    attend_prep(dt, qk, D, p, pages, n_pages, last_tokens, group0, n_groups, x)
#endif
#if PKVI_WALK_PERMUTED_BF16
#define WALK_BF16 WALK_PREP(PKV_BF16, QK_F32)
#else
#define WALK_BF16 WALK_EXACT(PKV_BF16)
#endif
WALK_FN(attend_f32, WALK_EXACT(PKV_F32))
WALK_FN(attend_f16, WALK_EXACT(PKV_F16))
WALK_FN(attend_bf16, WALK_BF16)
#if PKVI_WALK_BLOCK_TYPES
#if PKVI_WALK_PERMUTED_Q4 /* its QK reads q permuted: walk with q prepared */
#define WALK_Q4_F32 WALK_PREP(PKV_Q4, QK_F32)
#else
#define WALK_Q4_F32 WALK_EXACT(PKV_Q4)
#endif
#if PKVI_WALK_LIMBS /* the exact scores from limbs where every block is whole */
#define WALK_Q8 (WALK_DK(p, D) % 32 == 0 ? WALK_PREP(PKV_Q8, QK_LIMBS) : WALK_EXACT(PKV_Q8))
#define WALK_Q4 (WALK_DK(p, D) % 32 == 0 ? WALK_PREP(PKV_Q4, QK_LIMBS) : WALK_Q4_F32)
#else
#define WALK_Q8 WALK_EXACT(PKV_Q8)
#define WALK_Q4 WALK_Q4_F32
#endif
WALK_FN_D128(attend_q8, WALK_Q8)
WALK_FN_D128(attend_q4, WALK_Q4)
#endif

#if PKVI_WALK_QUANT_DOT
WALK_FN_D128(attend_qd_q8, WALK_PREP(PKV_Q8, QK_INT))
WALK_FN_D128(attend_qd_q4, WALK_PREP(PKV_Q4, QK_INT))
#endif

static void attend(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                   uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                   const pkvi_heads *x)
{
    const bool d128 = p->head_dim == 128 && PKVI_DV(p) == 128;
#define WALK_CALL(name) \
    (d128 ? name##_d128 : name)(p, pages, n_pages, last_tokens, group0, n_groups, x)
    switch (p->dtype) {
    case PKV_F16:
        attend_f16(p, pages, n_pages, last_tokens, group0, n_groups, x);
        break;
    case PKV_BF16:
        attend_bf16(p, pages, n_pages, last_tokens, group0, n_groups, x);
        break;
    case PKV_F32:
        attend_f32(p, pages, n_pages, last_tokens, group0, n_groups, x);
        break;
    case PKV_Q8:
    case PKV_Q4:
#if PKVI_WALK_BLOCK_TYPES
#if PKVI_WALK_QUANT_DOT
        if (p->quant_dot) {
            if (p->dtype == PKV_Q8)
                WALK_CALL(attend_qd_q8);
            else
                WALK_CALL(attend_qd_q4);
            break;
        }
#endif
        if (p->dtype == PKV_Q8)
            WALK_CALL(attend_q8);
        else
            WALK_CALL(attend_q4);
#else   /* this ISA has no loads of the block types: the scalar kernel */
        pkvi_kernels_scalar.attend(p, pages, n_pages, last_tokens, group0, n_groups, x);
#endif
        break;
    }
#undef WALK_CALL
}

#endif

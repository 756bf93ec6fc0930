/*
 * kernels/walk.h - the part of a SIMD decode kernel that does not depend on the ISA:
 * the walk over pages and groups in tiles, the one-tile software pipeline, the prefetch
 * targets, and the preparation of a call's q (quantized, cut into limbs or permuted)
 * in runs that fit a stack scratch.
 *
 * An ISA's file passes its own tile functions as arguments (walk_qk_fn, walk_pv_fn,
 * walk_softmax_fn, walk_prep_fn), constants at each call, so the compiler inlines them:
 * each of its out-of-line entry points - one per dtype and path - compiles to one walk
 * with the ISA's micro-kernels in it. (Arguments, not a struct of pointers: gcc turns a
 * constant argument into a direct call while it inlines the walk, and a pointer loaded
 * from a struct only later, which left the block types' walks different code.) This
 * header needs nothing from its includer; it owns no state.
 *
 * Invariants (every table's arithmetic depends on them, docs/numerics.md section 2):
 *   - Tiles hold at most PKVI_TILE rows and start at a page's first row: never span pages.
 *   - Each head sees its operations in ref.c's order: QK(k) before softmax(k) before
 *     PV(k), and PV(k-1) before PV(k); the pipeline only interleaves heads' work.
 *   - Prefetches and kicks change no result.
 */
#ifndef PKV_KERNELS_WALK_H
#define PKV_KERNELS_WALK_H

#include "kernels/kernels.h"
#include "kernels/qlimbs.h"
#include "base/quant.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* How a walk forms its scores: from f32 q (the exact path's loads), from q rounded to
 * int8 (the integer dot, quant_dot = 1), or from q cut into integer limbs (avx512vnni's
 * exact Q8/Q4 path where every block of the row is whole). */
typedef enum { QK_F32, QK_INT, QK_LIMBS } qk_kind;

/* head_dim and head_dim_v of a walk: the call's (D == 0), or both D, a constant the
 * compiler folds into the walk (the head_dim-128 entry points). */
PKVI_INLINE uint32_t walk_dk(const pkvi_kparams *p, const uint32_t D)
{
    return D ? D : p->head_dim;
}

PKVI_INLINE uint32_t walk_dv(const pkvi_kparams *p, const uint32_t D)
{
    return D ? D : PKVI_DV(p);
}

/* Whether dt is a block type (Q8, Q4: blocks of 32 values, each with an f16 scale). */
PKVI_INLINE bool qtype(const pkv_dtype dt)
{
    return dt == PKV_Q8 || dt == PKV_Q4;
}

/* Bytes of a stored row of n values (pkv_row_bytes, inlined for a constant dt). */
PKVI_INLINE size_t row_bytes_of(const pkv_dtype dt, uint32_t n)
{
    if (qtype(dt))
        return pkvi_quant_row_bytes(dt, n);
    return (size_t)n * (dt == PKV_F32 ? 4u : 2u);
}

/* int8 values of prepared q per value of a head: one for the integer dot, QL_LIMBS */
PKVI_INLINE uint32_t qk_bytes(const qk_kind qk)
{
    return qk == QK_LIMBS ? QL_LIMBS : 1u;
}

/* One line of the unit ahead: into L1 (T0), or with l2 (pkvi_kparams.pf_l2) into L2
 * only (T1), which on Zen 4 leaves the L1 miss buffers to the demand loads
 * (docs/performance.md, decision table: PKV_PREFETCH). */
PKVI_INLINE void pf_line(const char *a, const bool l2)
{
    if (l2)
        __builtin_prefetch(a, 0, 2); /* x86: prefetcht1, aarch64: prfm pldl2keep */
    else
        __builtin_prefetch(a, 0, 3); /* x86: prefetcht0, aarch64: prfm pldl1keep */
}

/* How far ahead (at least) the software prefetch target lies: pages are scattered and
 * one group's rows in a page are too short for the hardware stream prefetcher, so while
 * a tile reads its rows it asks for the same rows of the unit this many bytes ahead
 * (docs/performance.md, decision table: PF_AHEAD_BYTES). */
#define PF_AHEAD_BYTES 4096u

/* One tile of the walk: n <= PKVI_TILE rows of one group of one page, the heads and
 * state it folds into, and the rows of the unit `dist` ahead to prefetch (or NULL). */
typedef struct {
    const char *k, *v, *pfk, *pfv;
    const float *q;
    const int8_t *qi;   /* QK_INT, QK_LIMBS: the group's heads prepared, [hg][bytes][dpad] */
    const float *qs;    /* QK_INT, QK_LIMBS: their block scales, [hg][nb] */
    const float *lb;    /* QK_LIMBS: per head, the largest K block scale its limbs hold to
                         * LIMB_BUDGET (walk_prepared), [hg] */
    float *m, *l, *acc;
    uint32_t n;
} tile;

/* The prepared q a call holds on its stack: quantized (int8; the scales add 1/8 of
 * it), cut into limbs, or permuted f32 - every group of a decode of usual shapes at
 * once; a larger call (prefill tiles stack up to 256 heads) is walked in runs of
 * groups, or of heads, that fit: the arithmetic is page-, group- and head-local
 * (kernels.h), so the results are the bits of one walk (docs/performance.md, decision
 * table: PREP_SCRATCH_BYTES). */
#define PREP_SCRATCH_BYTES (32u << 10)
_Static_assert(PREP_SCRATCH_BYTES / (PKVI_MAX_HEAD_DIM * sizeof(float)) >= 1,
               "walk_prepared's runs need room for at least one head of f32 q");

/* qi [heads][qk_bytes][dpad] and qs [heads][nb] (QK_INT, QK_LIMBS, with lb [heads] for
 * QK_LIMBS), or qf [heads][d] (a permuted dtype). */
typedef struct {
    _Alignas(64) union {
        int8_t qi[PREP_SCRATCH_BYTES];
        float qf[PREP_SCRATCH_BYTES / sizeof(float)];
    } u;
    _Alignas(64) float qs[PREP_SCRATCH_BYTES / 32];
    float lb[PREP_SCRATCH_BYTES / (QL_LIMBS * 32)]; /* heads of whole blocks that fit */
} prep_scratch;

/* What an ISA gives the walk: its functions, inlined where they are constants. */
/* unscaled scores of the tile's rows for all hg heads into s [hg][PKVI_TILE] */
typedef void (*walk_qk_fn)(pkv_dtype dt, qk_kind qk, uint32_t D, const pkvi_kparams *p,
                           const tile *t, float *s);
/* acc = alpha * acc + weights (s) times the tile's V rows, for all hg heads */
typedef void (*walk_pv_fn)(pkv_dtype dt, uint32_t D, const pkvi_kparams *p, const tile *t,
                           const float *s, const float *alpha);
/* the per-tile softmax step of ref.c for hg heads (cap: softcap) */
typedef void (*walk_softmax_fn)(uint32_t hg, uint32_t n, float scale, float cap, float *s,
                                float *m, float *l, float *alpha);
/* head q (d values) into slot k of the scratch: quantized (QK_INT), cut into limbs
 * (QK_LIMBS, with its lb), or permuted (QK_F32) */
typedef void (*walk_prep_fn)(pkv_dtype dt, qk_kind qk, uint32_t d, float scale, const float *q,
                             prep_scratch *ps, size_t k);

/*
 * Which V rows ahead PV(k-1) prefetches. The demand order is K(u), V(u-1), K(u+1),
 * V(u): a step down in address between each pair. By default the PV step asks for its
 * own rows `dist` units ahead, so the prefetches follow that demand order. For f32 it
 * asks for the V rows of the tile just scored, so the prefetch stream runs in address
 * order (K(u+dist), V(u+dist), K(u+dist+1), ...; the first tile's V rows ahead are
 * skipped): docs/performance.md, decision table: PF_IN_ADDRESS_ORDER.
 */
PKVI_INLINE bool pf_in_address_order(const pkv_dtype dt)
{
    return dt == PKV_F32;
}

/*
 * The stream kick. The software prefetches keep about one unit in flight, which the
 * core's L1 miss buffers cap; so for every unit the walk also touches the first two
 * lines of the K and the V block of the unit kick_bytes of rows ahead. The likely
 * mechanism: those two lines start the L2's hardware stream prefetcher on each 4 KiB
 * block long before the prefetch one unit ahead asks for it, so the block is on its way
 * into L2 without holding L1 miss buffers. Results do not change (prefetches only).
 * The four prefetches are written out, not looped (docs/performance.md, decision table:
 * KICK_AHEAD_BYTES).
 */
PKVI_INLINE void kick_unit(const char *kb, size_t v_offset)
{
    __builtin_prefetch(kb, 0, 3);
    __builtin_prefetch(kb + 64, 0, 3);
    __builtin_prefetch(kb + v_offset, 0, 3);
    __builtin_prefetch(kb + v_offset + 64, 0, 3);
}

/* A unit of the walk, `ahead` units past the current one: (page, group), stepped with
 * the walk. Its address is taken only while it lies inside the call's units. */
typedef struct {
    uint64_t page;
    uint32_t group;
} cursor;

PKVI_INLINE cursor cursor_at(uint64_t ahead, uint32_t n_groups)
{
    return (cursor){ahead / n_groups, (uint32_t)(ahead % n_groups)};
}

PKVI_INLINE void cursor_step(cursor *c, uint32_t n_groups)
{
    if (++c->group == n_groups) {
        c->group = 0;
        c->page++;
    }
}

PKVI_INLINE const char *cursor_unit(const cursor *c, const void *const *pages,
                                    const pkvi_kparams *p, uint32_t group0)
{
    return (const char *)pages[c->page] + (size_t)(group0 + c->group) * p->group_stride;
}

/*
 * The walk: units (page, group) in page-major order, a unit being one group's K and V
 * rows of a page, cut into tiles. The prefetch target is the unit `dist` ahead.
 *
 * Software-pipelined by one tile: QK(k), then PV(k-1), then softmax(k). The softmax
 * is a chain of dependent reductions and exps; QK(k+1), which comes next and does not
 * depend on it, keeps the FMA units busy while it resolves (docs/performance.md,
 * decision table: pipeline). Each head still sees its own operations in the order of
 * ref.c (softmax(k) only reads m and l, and PV(k-1) precedes PV(k)), so the results
 * are those of the unpipelined order, bit for bit.
 *
 * qi, qs, lb: QK_INT and QK_LIMBS, group i's prepared heads at qi + i * hg * qk_bytes *
 * dpad, qs + i * hg * nb, lb + i * hg (walk_prepared lays them out so).
 */
PKVI_INLINE void walk_attend(const walk_qk_fn qk_step, const walk_pv_fn pv_step,
                             const walk_softmax_fn softmax_step, const uint32_t kick_bytes,
                             const pkv_dtype dt, const qk_kind qk, const uint32_t D,
                             const pkvi_kparams *p, const void *const *pages,
                             uint32_t n_pages, uint32_t last_tokens, uint32_t group0,
                             uint32_t n_groups, const pkvi_heads *x, const int8_t *qi,
                             const float *qs, const float *lb)
{
    const bool qd = qk != QK_F32;
    const uint32_t nbq = (walk_dk(p, D) + 31) / 32;
    const size_t qi_stride = (size_t)p->hg * qk_bytes(qk) * nbq * 32;
    const size_t qs_stride = (size_t)p->hg * nbq;
    const size_t row = row_bytes_of(dt, walk_dk(p, D)), vrow = row_bytes_of(dt, walk_dv(p, D));
    /* prefetch distance in units: at least PF_AHEAD_BYTES of rows */
    const size_t region = (size_t)p->block_tokens * (row + vrow);
    const uint64_t dist = region >= PF_AHEAD_BYTES ? 1u : (PF_AHEAD_BYTES + region - 1) / region;
    const uint64_t kick = (kick_bytes + region - 1) / region; /* the kick's, >= 1 */
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
                    .lb = qk == QK_LIMBS ? lb + (size_t)i * p->hg : NULL,
                    .m = x->m + i * x->st_stride,
                    .l = x->l + i * x->st_stride,
                    .acc = x->acc + i * x->st_stride,
                    .n = ntok - t0 < PKVI_TILE ? ntok - t0 : PKVI_TILE,
                };
                qk_step(dt, qk, D, p, &t, s[cur]);
                if (pending) {
                    if (pf_in_address_order(dt))
                        prev.pfv = t.pfv;
                    pv_step(dt, D, p, &prev, s[!cur], alpha[!cur]);
                }
                softmax_step(p->hg, t.n, p->scale, p->softcap, s[cur], t.m, t.l, alpha[cur]);
                prev = t;
                pending = true;
                cur = !cur;
            }
        }
    }
    if (pending)
        pv_step(dt, D, p, &prev, s[!cur], alpha[!cur]);
}

/* Q4 blocks are read as the low nibbles of their 16 bytes (values 0, 2, .., 30), then
 * the high ones (1, 3, .., 31): q is stored in that order, so the integer dot (exact,
 * any order) pairs each value with its own. Q8 keeps the row order. */
PKVI_INLINE void qd_permute(const pkv_dtype dt, int8_t *qi, uint32_t dpad)
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

/* The walk of a path whose q is prepared first (the integer dot, the limbs, or a
 * permuted dtype): prepare the call's heads with prep_step, then walk in runs whose
 * prepared q fits the scratch. */
PKVI_INLINE void walk_prepared(const walk_qk_fn qk_step, const walk_pv_fn pv_step,
                               const walk_softmax_fn softmax_step, const walk_prep_fn prep_step,
                               const uint32_t kick_bytes, const pkv_dtype dt,
                               const qk_kind qk, const uint32_t D, const pkvi_kparams *p,
                               const void *const *pages, uint32_t n_pages,
                               uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                               const pkvi_heads *x)
{
    const uint32_t d = walk_dk(p, D), dv = walk_dv(p, D), H = p->hg, nb = (d + 31) / 32;
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
                    prep_step(dt, qk, d, p->scale,
                              x->q + (g + i) * x->q_stride + (size_t)h * d, &ps,
                              (size_t)i * H + h);
            const pkvi_heads xs = {
                .q = qd ? x->q + g * x->q_stride : ps.u.qf,
                .m = x->m + g * x->st_stride, .l = x->l + g * x->st_stride,
                .acc = x->acc + g * x->st_stride,
                .q_stride = qd ? x->q_stride : H * d, .st_stride = x->st_stride,
            };
            walk_attend(qk_step, pv_step, softmax_step, kick_bytes, dt, qk, D, p, pages, n_pages, last_tokens, group0 + g, ng, &xs,
                        qi, qs, ps.lb);
        }
        return;
    }
    pkvi_kparams ph = *p; /* runs of the heads of one group */
    for (uint32_t g = 0; g < n_groups; g++)
        for (uint32_t h0 = 0; h0 < H; h0 += fit) {
            ph.hg = H - h0 < fit ? H - h0 : fit;
            for (uint32_t h = 0; h < ph.hg; h++)
                prep_step(dt, qk, d, p->scale,
                          x->q + g * x->q_stride + (size_t)(h0 + h) * d, &ps, h);
            const pkvi_heads xs = {
                .q = qd ? x->q + g * x->q_stride + (size_t)h0 * d : ps.u.qf,
                .m = x->m + g * x->st_stride + h0, .l = x->l + g * x->st_stride + h0,
                .acc = x->acc + g * x->st_stride + (size_t)h0 * dv,
                .q_stride = x->q_stride, .st_stride = x->st_stride,
            };
            walk_attend(qk_step, pv_step, softmax_step, kick_bytes, dt, qk, D, &ph, pages, n_pages, last_tokens, group0 + g, 1, &xs,
                        qi, qs, ps.lb);
        }
}

#endif /* PKV_KERNELS_WALK_H */

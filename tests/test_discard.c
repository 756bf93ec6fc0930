/*
 * test_discard.c - SPEC §14's pkv_session_discard: dropping positions, moving the later
 * ones down, re-rotating their keys.
 *
 * The model. Every layer of the session under test is mirrored by a list of rows, each
 * holding the f32 key the engine last stored for it (its K as it was rotated, then for
 * every shift: rounded to the dtype, turned back by the shift with the engine's own
 * rotation - which test_rope.c holds to the exact rotation and pkv_rope_q), its value,
 * and whether the window had released it. After every step a fresh session of an
 * engine WITHOUT rope appends the model's keys at their positions; the session under
 * test must decode to the bit what it decodes (so the rows moved, the keys were turned
 * by the right delta and rounded once, the values are untouched, nothing else read).
 * The model in turn is held to the definition: test discard_reference compares decode
 * against pkv_attention_reference on keys rotated here in double at their new positions.
 *
 * Crossed with: page-aligned and unaligned cuts, several shifts, appends in between,
 * forks sharing the pages being moved, windows with sinks and rollback, every dtype,
 * spill (a budget and a spill_dir), shards, save/load, recorded tokens and the prefix
 * cache, and the failures (bad ranges, layers without rope, no memory): statuses with
 * nothing changed; verify_after_discard commits draft trees between discards (a
 * pending tree refuses a discard); crossings_random crosses them all at once in random
 * rounds and holds every step to the double reference too (each key the decode reads
 * against its exact rotation, within a store's error per move; the decode against
 * attention in double over the stored rows). discard_drift prints how far re-rotated
 * keys drift from keys rotated at their final position after 1, 10 and 100 shifts
 * (docs/rope.md quotes it).
 */
#include "testutil.h"
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the model ------------------------------------------------------------------------ */

typedef struct {
    uint32_t L, h, g, d, bt;
    pkv_dtype dt;
    pkv_layer_config lc[3];
    uint64_t first;          /* a shard's first position */
    char spill_dir[256];     /* "" = none */
    uint64_t budget;
} geo_t;

typedef struct {
    float **k, **v;          /* [L][cap][g*d]: the key last stored (f32), the value */
    uint64_t *len, cap;      /* [L] */
    float **raw;             /* [L][cap][g*d]: the key as appended (before rotation) */
    uint64_t **orig;         /* [L][cap]: the position it was appended at */
    uint32_t **moves;        /* [L][cap]: the discards that moved it (re-rotations) */
} model;

static pkv_config make_config(const geo_t *G, bool rope)
{
    pkv_config c = pkvt_config(G->L, G->h, G->g, G->d, G->bt, G->dt);
    static _Thread_local pkv_layer_config lcs[2][3];
    pkv_layer_config *lc = lcs[rope];
    memcpy(lc, G->lc, sizeof G->lc);
    for (uint32_t l = 0; !rope && l < G->L; l++)
        lc[l].rope = lc[l].rope_dims = 0, lc[l].rope_theta = lc[l].rope_freq_scale = 0;
    c.layer_cfg = lc;
    c.mem_budget = G->budget;
    c.spill_dir = G->spill_dir[0] ? G->spill_dir : NULL;
    return c;
}

static void model_init(model *m, const geo_t *G, uint64_t cap)
{
    m->cap = cap;
    m->k = pkvt_calloc(G->L, sizeof *m->k);
    m->v = pkvt_calloc(G->L, sizeof *m->v);
    m->raw = pkvt_calloc(G->L, sizeof *m->raw);
    m->orig = pkvt_calloc(G->L, sizeof *m->orig);
    m->moves = pkvt_calloc(G->L, sizeof *m->moves);
    m->len = pkvt_calloc(G->L, sizeof *m->len);
    for (uint32_t l = 0; l < G->L; l++) {
        m->k[l] = pkvt_calloc(cap * G->g * G->d, sizeof(float));
        m->v[l] = pkvt_calloc(cap * G->g * G->d, sizeof(float));
        m->raw[l] = pkvt_calloc(cap * G->g * G->d, sizeof(float));
        m->orig[l] = pkvt_calloc(cap, sizeof(uint64_t));
        m->moves[l] = pkvt_calloc(cap, sizeof(uint32_t));
        m->len[l] = G->first;
    }
}

static void model_free(model *m, const geo_t *G)
{
    for (uint32_t l = 0; l < G->L; l++) {
        free(m->k[l]);
        free(m->v[l]);
        free(m->raw[l]);
        free(m->orig[l]);
        free(m->moves[l]);
    }
    free(m->k);
    free(m->v);
    free(m->raw);
    free(m->orig);
    free(m->moves);
    free(m->len);
}

/* dst = a copy of src's rows (dst initialized with the same geometry and capacity). */
static void model_copy(model *dst, const model *src, const geo_t *G)
{
    const size_t rows = src->cap * G->g * G->d;
    for (uint32_t l = 0; l < G->L; l++) {
        dst->len[l] = src->len[l];
        memcpy(dst->k[l], src->k[l], rows * sizeof(float));
        memcpy(dst->v[l], src->v[l], rows * sizeof(float));
        memcpy(dst->raw[l], src->raw[l], rows * sizeof(float));
        memcpy(dst->orig[l], src->orig[l], src->cap * sizeof(uint64_t));
        memcpy(dst->moves[l], src->moves[l], src->cap * sizeof(uint32_t));
    }
}

static const pkvi_rope *rope_of(pkv_engine *e, uint32_t l)
{
    const pkvi_ctx ctx = pkvi_engine_ctx(e);
    return pkvi_layer_rope(ctx.geom, l);
}

/* Append n random rows to every layer of s and the model (e is s's engine). */
static void append_rows(pkv_engine *e, pkv_session *s, model *m, const geo_t *G, pkvt_rng *r,
                        uint64_t n)
{
    const size_t kn = (size_t)G->g * G->d;
    float *tmp = pkvt_alloc((size_t)G->h * G->d * sizeof *tmp);
    for (uint32_t l = 0; l < G->L; l++)
        for (uint64_t j = 0; j < n; j++) {
            const uint64_t p = m->len[l]++;
            ck_assert_uint_lt(p, m->cap);
            float *k = m->k[l] + p * kn, *v = m->v[l] + p * kn, *raw = m->raw[l] + p * kn;
            pkvt_fill(r, raw, kn, -1.5f, 1.5f);
            pkvt_fill(r, v, kn, -1.0f, 1.0f);
            ck_assert_int_eq(pkv_append(s, l, raw, v), PKV_OK);
            m->orig[l][p] = p;
            m->moves[l][p] = 0;
            /* the stored key: rotated as pkv_rope_q rotates (the first g heads of a row) */
            memcpy(tmp, raw, kn * sizeof *tmp);
            if (rope_of(e, l))
                ck_assert_int_eq(pkv_rope_q(e, l, 1, &p, tmp), PKV_OK);
            memcpy(k, tmp, kn * sizeof *k);
        }
    free(tmp);
}

/* What the engine does to the model's rows on a discard of [p0, p1). */
static void model_discard(pkv_engine *e, model *m, const geo_t *G, uint64_t p0, uint64_t p1)
{
    const size_t kn = (size_t)G->g * G->d;
    const uint64_t delta = p1 - p0;
    float *cs = pkvt_alloc(PKVI_ROPE_MAX_DIMS * sizeof *cs);
    float *row = pkvt_alloc(G->d * sizeof *row);
    for (uint32_t l = 0; l < G->L; l++) {
        if (m->len[l] <= p0)
            continue;
        if (m->len[l] <= p1) {
            m->len[l] = p0;
            continue;
        }
        const pkvi_rope *rp = rope_of(e, l);
        ck_assert_ptr_nonnull(rp);
        uint32_t nr = 2 * rp->half;
        if (G->dt == PKV_Q8 || G->dt == PKV_Q4)
            nr = (nr + 31) / 32 * 32 < G->d ? (nr + 31) / 32 * 32 : G->d;
        pkvi_rope_back(rp, delta, cs);
        for (uint64_t q = p0; q + delta < m->len[l]; q++) {
            const uint64_t o = q + delta;
            for (uint32_t gi = 0; gi < G->g; gi++) {
                float *src = m->k[l] + o * kn + (size_t)gi * G->d;
                pkv_dtype_round_row(G->dt, nr, src, row);
                pkvi_rope_apply(rp, cs, row, 1, nr);
                memcpy(m->k[l] + q * kn + (size_t)gi * G->d, row, nr * sizeof *row);
                memcpy(m->k[l] + q * kn + (size_t)gi * G->d + nr, src + nr,
                       (G->d - nr) * sizeof *row);
            }
            memcpy(m->v[l] + q * kn, m->v[l] + o * kn, kn * sizeof(float));
            memcpy(m->raw[l] + q * kn, m->raw[l] + o * kn, kn * sizeof(float));
            m->orig[l][q] = m->orig[l][o];
            m->moves[l][q] = m->moves[l][o] + 1;
        }
        m->len[l] -= delta;
    }
    free(cs);
    free(row);
}

/* A session of the engine without rope holding the model's rows: what s must decode to. */
static pkv_session *model_session(pkv_engine *plain, const model *m, const geo_t *G)
{
    pkv_session *b = pkvt_session(plain);
    if (G->first)
        ck_assert_int_eq(pkv_session_set_first(b, G->first), PKV_OK);
    const size_t kn = (size_t)G->g * G->d;
    for (uint32_t l = 0; l < G->L; l++)
        for (uint64_t p = G->first; p < m->len[l]; p++)
            ck_assert_int_eq(pkv_append(b, l, m->k[l] + p * kn, m->v[l] + p * kn), PKV_OK);
    return b;
}

/* s decodes every layer (a few queries) to the bit as the model's session does. */
static void check_bitwise(pkv_engine *e, pkv_engine *plain, pkv_session *s, const model *m,
                          const geo_t *G, pkvt_rng *r, const char *what)
{
    pkv_session *b = model_session(plain, m, G);
    const size_t qn = (size_t)G->h * G->d;
    float *q = pkvt_alloc(qn * 4), *o1 = pkvt_alloc(qn * 4), *o2 = pkvt_alloc(qn * 4);
    for (uint32_t l = 0; l < G->L; l++) {
        ck_assert_uint_eq(pkv_session_len(s, l), m->len[l]);
        if (m->len[l] == G->first)
            continue;
        for (int k = 0; k < 2; k++) {
            pkvt_fill(r, q, qn, -1.5f, 1.5f);
            const uint64_t p = m->len[l] - 1;
            ck_assert_int_eq(pkv_rope_q(e, l, 1, &p, q), PKV_OK);
            ck_assert_int_eq(pkv_decode(s, l, q, o1), PKV_OK);
            ck_assert_int_eq(pkv_decode(b, l, q, o2), PKV_OK);
            ck_assert_msg(memcmp(o1, o2, qn * 4) == 0, "%s: layer %u (len %llu, %s) differs "
                          "from the model (seed %llu)", what, l, (unsigned long long)m->len[l],
                          pkv_dtype_name(G->dt), (unsigned long long)pkvt_seed());
        }
    }
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(b);
    free(q);
    free(o1);
    free(o2);
}

/* The ids and lengths of every layer's pages, to compare before and after a refusal. */
typedef struct { uint64_t n; pkv_page_info *p; uint64_t len; } snap_layer;
static snap_layer *snapshot(pkv_session *s, uint32_t L)
{
    snap_layer *sn = pkvt_calloc(L, sizeof *sn);
    for (uint32_t l = 0; l < L; l++) {
        sn[l].len = pkv_session_len(s, l);
        sn[l].p = pkvt_calloc(4096, sizeof *sn[l].p);
        ck_assert_int_eq(pkv_session_pages(s, l, 0, 4096, sn[l].p, &sn[l].n), PKV_OK);
    }
    return sn;
}
static void same_snapshot(pkv_session *s, snap_layer *a, uint32_t L)
{
    snap_layer *b = snapshot(s, L);
    for (uint32_t l = 0; l < L; l++) {
        ck_assert_uint_eq(a[l].len, b[l].len);
        ck_assert_uint_eq(a[l].n, b[l].n);
        for (uint64_t i = 0; i < a[l].n; i++) {
            ck_assert_uint_eq(a[l].p[i].id, b[l].p[i].id);
            ck_assert_uint_eq(a[l].p[i].refs, b[l].p[i].refs);
        }
        free(b[l].p);
    }
    free(b);
}
static void snapshot_free(snap_layer *sn, uint32_t L)
{
    for (uint32_t l = 0; l < L; l++)
        free(sn[l].p);
    free(sn);
}

/* Two layers with rope (NORM full, NEOX partial with Llama 3's theta) and one more. */
static geo_t basic_geo(pkvt_rng *r, pkv_dtype dt)
{
    geo_t G;
    memset(&G, 0, sizeof G);
    const uint32_t hs[] = {4, 8, 6}, gs[] = {2, 2, 1}, ds[] = {32, 64, 40}, bts[] = {1, 3, 16, 8};
    const uint32_t k = pkvt_below(r, 3);
    G.L = 2;
    G.h = hs[k];
    G.g = gs[k];
    G.d = ds[k];
    G.bt = bts[pkvt_below(r, 4)];
    G.dt = dt;
    G.lc[0].rope = PKV_ROPE_NORM;
    G.lc[1].rope = PKV_ROPE_NEOX;
    G.lc[1].rope_theta = 500000;
    G.lc[1].rope_dims = (dt == PKV_Q8 || dt == PKV_Q4) && G.d >= 64 ? 32 : G.d / 2 / 2 * 2;
    return G;
}

/* Draft trees verified and committed after discards, all five dtypes: a draft sits
 * at len + depth and the engine turns its key there, so the kept path must be what
 * appending its rows gives, to the bit (against the model's session), and the last
 * kept draft's verify output the decode after the commit. While drafts are pending a
 * discard is PKV_ESTATE and changes nothing. */
START_TEST(verify_after_discard)
{
    static const pkv_dtype dts[] = {PKV_F32, PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 0x5eed);
    for (size_t di = 0; di < 5; di++) {
        geo_t G = basic_geo(&r, dts[di]);
        pkv_config c = make_config(&G, true), cp = make_config(&G, false);
        pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
        pkv_session *s = pkvt_session(e);
        model m;
        model_init(&m, &G, 600);
        append_rows(e, s, &m, &G, &r, 30 + pkvt_below(&r, 60));
        const size_t kn = (size_t)G.g * G.d, qn = (size_t)G.h * G.d;
        const int steps = pkvt_quick() ? 2 : 4;
        for (int step = 0; step < steps; step++) {
            if (m.len[0] < 8)
                append_rows(e, s, &m, &G, &r, 8);
            const uint64_t len = m.len[0];
            const uint64_t p0 = pkvt_below(&r, (uint32_t)len);
            const uint64_t p1 = p0 + 1 + pkvt_below(&r, (uint32_t)(len - p0 < 20 ? len - p0 : 20));
            ck_assert_int_eq(pkv_session_discard(s, p0, p1), PKV_OK);
            model_discard(e, &m, &G, p0, p1);
            /* a tree of 1..7 drafts on every layer: rows, and q turned at each draft's
             * position len + depth */
            const uint32_t n = 1 + pkvt_below(&r, 7);
            int32_t parent[7];
            uint32_t depth[7];
            for (uint32_t i = 0; i < n; i++) {
                parent[i] = (int32_t)pkvt_below(&r, i + 1) - 1;
                depth[i] = parent[i] < 0 ? 0 : depth[parent[i]] + 1;
            }
            float *k = pkvt_alloc(G.L * n * kn * 4), *v = pkvt_alloc(G.L * n * kn * 4);
            float *q = pkvt_alloc(G.L * n * qn * 4), *out = pkvt_alloc(G.L * n * qn * 4);
            for (uint32_t l = 0; l < G.L; l++) {
                pkvt_fill(&r, k + l * n * kn, n * kn, -1.5f, 1.5f);
                pkvt_fill(&r, v + l * n * kn, n * kn, -1.0f, 1.0f);
                pkvt_fill(&r, q + l * n * qn, n * qn, -1.5f, 1.5f);
                for (uint32_t i = 0; i < n; i++) {
                    const uint64_t pos = m.len[l] + depth[i];
                    ck_assert_int_eq(pkv_rope_q(e, l, 1, &pos, q + (l * n + i) * qn), PKV_OK);
                }
                ck_assert_int_eq(pkv_verify(s, l, n, parent, q + l * n * qn, k + l * n * kn,
                                            v + l * n * kn, out + l * n * qn),
                                 PKV_OK);
            }
            ck_assert_int_eq(pkv_session_discard(s, 0, 1), PKV_ESTATE);
            for (uint32_t l = 0; l < G.L; l++)
                ck_assert_uint_eq(pkv_session_len(s, l), m.len[l]);
            uint32_t path[7], rev[7], n_keep = 0;
            for (int32_t j = (int32_t)pkvt_below(&r, n); j >= 0; j = parent[j])
                rev[n_keep++] = (uint32_t)j;
            for (uint32_t j = 0; j < n_keep; j++)
                path[j] = rev[n_keep - 1 - j];
            ck_assert_int_eq(pkv_session_commit(s, n_keep, path), PKV_OK);
            /* the model appends the kept rows at their positions, as append_rows does */
            float *tmp = pkvt_alloc(qn * 4);
            for (uint32_t l = 0; l < G.L; l++)
                for (uint32_t j = 0; j < n_keep; j++) {
                    const uint64_t p = m.len[l]++;
                    const float *raw = k + (l * n + path[j]) * kn;
                    memcpy(m.raw[l] + p * kn, raw, kn * 4);
                    memcpy(m.v[l] + p * kn, v + (l * n + path[j]) * kn, kn * 4);
                    m.orig[l][p] = p;
                    m.moves[l][p] = 0;
                    memcpy(tmp, raw, kn * 4);
                    ck_assert_int_eq(pkv_rope_q(e, l, 1, &p, tmp), PKV_OK);
                    memcpy(m.k[l] + p * kn, tmp, kn * 4);
                }
            for (uint32_t l = 0; l < G.L; l++) { /* the last kept draft: verify == decode */
                const uint32_t last = path[n_keep - 1];
                ck_assert_int_eq(pkv_decode(s, l, q + (l * n + last) * qn, tmp), PKV_OK);
                ck_assert_msg(memcmp(tmp, out + (l * n + last) * qn, qn * 4) == 0,
                              "%s layer %u: the verify output of draft %u is not the decode "
                              "after the commit (seed %llu)", pkv_dtype_name(G.dt), l, last,
                              (unsigned long long)pkvt_seed());
            }
            free(tmp);
            check_bitwise(e, plain, s, &m, &G, &r, "verify + commit after a discard");
            free(k);
            free(v);
            free(q);
            free(out);
        }
        pkv_session_destroy(s);
        model_free(&m, &G);
        pkv_engine_destroy(e);
        pkv_engine_destroy(plain);
    }
}
END_TEST

/* ---- the bitwise runs ----------------------------------------------------------------- */

/* Random appends and discards (aligned and not) on one session, with a fork that shares
 * the pages being moved; every step against the model. */
static void run_shifts(pkv_dtype dt, uint64_t seed_mix)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ seed_mix);
    const int rounds = pkvt_quick() ? 2 : 5;
    for (int round = 0; round < rounds; round++) {
        geo_t G = basic_geo(&r, dt);
        pkv_config c = make_config(&G, true), cp = make_config(&G, false);
        pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
        pkv_session *s = pkvt_session(e);
        model m;
        model_init(&m, &G, 600);
        append_rows(e, s, &m, &G, &r, 40 + pkvt_below(&r, 100));
        check_bitwise(e, plain, s, &m, &G, &r, "after appends");
        for (int step = 0; step < 6; step++) {
            if (m.len[0] < 2 * G.bt + 2)
                append_rows(e, s, &m, &G, &r, 2 * G.bt + 2);
            const uint64_t len = m.len[0];
            uint64_t p0, p1;
            if (step % 2 == 0) { /* whole pages */
                p0 = pkvt_below(&r, (uint32_t)(len / G.bt)) * G.bt;
                p1 = p0 + G.bt * (1 + pkvt_below(&r, (uint32_t)((len - p0) / G.bt)));
                if (p1 > len)
                    p1 = len;
            } else {
                p0 = pkvt_below(&r, (uint32_t)len);
                p1 = p0 + 1 + pkvt_below(&r, (uint32_t)(len - p0));
            }
            /* a fork holds the pages being moved: it must keep what it had */
            pkv_session *f = NULL;
            ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK);
            model fm;
            model_init(&fm, &G, 600);
            for (uint32_t l = 0; l < G.L; l++) {
                fm.len[l] = m.len[l];
                memcpy(fm.k[l], m.k[l], m.cap * G.g * G.d * 4);
                memcpy(fm.v[l], m.v[l], m.cap * G.g * G.d * 4);
            }
            ck_assert_int_eq(pkv_session_discard(s, p0, p1), PKV_OK);
            model_discard(e, &m, &G, p0, p1);
            char what[96];
            snprintf(what, sizeof what, "discard [%llu, %llu) of %llu, bt %u",
                     (unsigned long long)p0, (unsigned long long)p1, (unsigned long long)len,
                     G.bt);
            check_bitwise(e, plain, s, &m, &G, &r, what);
            check_bitwise(e, plain, f, &fm, &G, &r, "the fork after its source's discard");
            /* pages wholly below p0 are still shared with the fork */
            pkv_page_info a[64], b[64];
            uint64_t na, nb;
            ck_assert_int_eq(pkv_session_pages(s, 0, 0, 64, a, &na), PKV_OK);
            ck_assert_int_eq(pkv_session_pages(f, 0, 0, 64, b, &nb), PKV_OK);
            for (uint64_t i = 0; i < p0 / G.bt && i < na; i++) {
                ck_assert_uint_eq(a[i].id, b[i].id);
                ck_assert_uint_ge(a[i].refs, 2);
            }
            pkv_session_destroy(f);
            model_free(&fm, &G);
            append_rows(e, s, &m, &G, &r, 1 + pkvt_below(&r, 30));
            check_bitwise(e, plain, s, &m, &G, &r, "appends after a discard");
        }
        model_free(&m, &G);
        pkv_engine_destroy(e);
        pkv_engine_destroy(plain);
    }
}

START_TEST(shifts_f32) { run_shifts(PKV_F32, 1); }
END_TEST
START_TEST(shifts_f16) { run_shifts(PKV_F16, 2); }
END_TEST
START_TEST(shifts_bf16) { run_shifts(PKV_BF16, 3); }
END_TEST
START_TEST(shifts_q8) { run_shifts(PKV_Q8, 4); }
END_TEST
START_TEST(shifts_q4) { run_shifts(PKV_Q4, 5); }
END_TEST

/* Windowed layers (with sinks, with rollback): discards below the window's start drop
 * what the window had released; the positions the new window reads are the model's. */
START_TEST(windows)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 6);
    const int rounds = pkvt_quick() ? 3 : 10;
    for (int round = 0; round < rounds; round++) {
        geo_t G;
        memset(&G, 0, sizeof G);
        G.L = 3;
        G.h = 4;
        G.g = 2;
        G.d = 16;
        G.bt = 1 + pkvt_below(&r, 8);
        G.dt = round % 2 ? PKV_F16 : PKV_F32;
        for (uint32_t l = 0; l < 3; l++)
            G.lc[l].rope = l % 2 ? PKV_ROPE_NEOX : PKV_ROPE_NORM;
        G.lc[1].window = 20 + pkvt_below(&r, 20);
        G.lc[1].sink_tokens = pkvt_below(&r, 6);
        G.lc[2].window = 10 + pkvt_below(&r, 30);
        G.lc[2].rollback_tokens = pkvt_below(&r, 6);
        pkv_config c = make_config(&G, true), cp = make_config(&G, false);
        pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
        pkv_session *s = pkvt_session(e);
        model m;
        model_init(&m, &G, 2000);
        append_rows(e, s, &m, &G, &r, 100 + pkvt_below(&r, 100));
        int done = 0, refused = 0;
        for (int step = 0; step < 12; step++) {
            const uint64_t len = m.len[0];
            /* keep the sinks (as StreamingLLM does) or not; drop up to half */
            const uint64_t p0 = step % 3 == 0 ? G.lc[1].sink_tokens : pkvt_below(&r, (uint32_t)len / 2);
            const uint64_t p1 = p0 + 1 + pkvt_below(&r, (uint32_t)(len / 2));
            pkv_session *f = NULL;
            ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK);
            snap_layer *sn = snapshot(s, G.L);
            const pkv_status st = pkv_session_discard(s, p0, p1);
            ck_assert_msg(st == PKV_OK || st == PKV_ERANGE, "status %d", st);
            if (st == PKV_OK) {
                model_discard(e, &m, &G, p0, p1);
                done++;
            } else {
                same_snapshot(s, sn, G.L);
                refused++;
            }
            snapshot_free(sn, G.L);
            check_bitwise(e, plain, s, &m, &G, &r, st == PKV_OK ? "window discard" : "refused");
            pkv_session_destroy(f);
            /* truncates back into the rollback still work, or are refused cleanly */
            const uint64_t back = pkvt_below(&r, 4);
            const uint64_t to = back < m.len[0] ? m.len[0] - back : m.len[0];
            if (pkv_session_truncate(s, to) == PKV_OK)
                for (uint32_t l = 0; l < G.L; l++)
                    m.len[l] = m.len[l] < to ? m.len[l] : to;
            check_bitwise(e, plain, s, &m, &G, &r, "truncate after a window discard");
            append_rows(e, s, &m, &G, &r, 20 + pkvt_below(&r, 60));
            check_bitwise(e, plain, s, &m, &G, &r, "appends after a window discard");
        }
        ck_assert_int_gt(done, 0);
        (void)refused;
        model_free(&m, &G);
        pkv_engine_destroy(e);
        pkv_engine_destroy(plain);
    }
}
END_TEST

/* ---- the definition -------------------------------------------------------------------- */

/* After discards, f32: decode within the stated bound of the double oracle over raw keys
 * rotated here (in double) at their new positions and the query rotated at the end. */
START_TEST(discard_reference)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 7);
    geo_t G = basic_geo(&r, PKV_F32);
    G.L = 1;
    pkv_config c = make_config(&G, true);
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e);
    model m;
    model_init(&m, &G, 800);
    append_rows(e, s, &m, &G, &r, 300);
    ck_assert_int_eq(pkv_session_discard(s, 10, 150), PKV_OK);
    model_discard(e, &m, &G, 10, 150);
    append_rows(e, s, &m, &G, &r, 30);
    ck_assert_int_eq(pkv_session_discard(s, 10, 77), PKV_OK);
    model_discard(e, &m, &G, 10, 77);
    const uint64_t T = m.len[0];
    const size_t kn = (size_t)G.g * G.d, qn = (size_t)G.h * G.d;
    float *Q = pkvt_alloc(T * qn * 4), *K = pkvt_alloc(T * kn * 4), *out = pkvt_alloc(T * qn * 4);
    float *o = pkvt_alloc(qn * 4);
    const uint32_t rd = G.lc[0].rope_dims ? G.lc[0].rope_dims : G.d;
    /* keys: raw rotated in double at their new position t; queries at t */
    for (uint64_t t = 0; t < T; t++)
        for (uint32_t gi = 0; gi < G.g; gi++) {
            const float *x = m.raw[0] + t * kn + gi * G.d;
            float *y = K + t * kn + gi * G.d;
            memcpy(y, x, G.d * 4);
            for (uint32_t i = 0; i < rd / 2; i++) {
                const double a = (double)t * pow(10000.0, -(2.0 * i) / rd);
                y[2 * i] = (float)(x[2 * i] * cos(a) - x[2 * i + 1] * sin(a));
                y[2 * i + 1] = (float)(x[2 * i] * sin(a) + x[2 * i + 1] * cos(a));
            }
        }
    pkvt_fill(&r, Q, T * qn, -1.5f, 1.5f);
    float *Qr = pkvt_alloc(qn * 4);
    memcpy(Qr, Q + (T - 1) * qn, qn * 4);
    for (uint32_t hh = 0; hh < G.h; hh++)
        for (uint32_t i = 0; i < rd / 2; i++) {
            const double a = (double)(T - 1) * pow(10000.0, -(2.0 * i) / rd);
            float *y = Q + (T - 1) * qn + hh * G.d;
            const float x0 = Qr[hh * G.d + 2 * i], x1 = Qr[hh * G.d + 2 * i + 1];
            y[2 * i] = (float)(x0 * cos(a) - x1 * sin(a));
            y[2 * i + 1] = (float)(x0 * sin(a) + x1 * cos(a));
        }
    ck_assert_int_eq(pkv_attention_reference((uint32_t)T, G.h, G.g, G.d, 0, 0, NULL, Q, K,
                                             m.v[0], out), PKV_OK);
    const uint64_t p = T - 1;
    ck_assert_int_eq(pkv_rope_q(e, 0, 1, &p, Qr), PKV_OK);
    ck_assert_int_eq(pkv_decode(s, 0, Qr, o), PKV_OK);
    /* score error of two rotations and a re-rotation: scale * 2^-18 * |q| |k| */
    const double bound = 1e-5 + 2 * (1.0 / sqrt(G.d)) * 0x1p-18 * (1.5 * 1.5 * G.d) * 2;
    const double err = pkvt_maxdiff_ff(o, out + (T - 1) * qn, qn);
    ck_assert_msg(err <= bound, "decode after discards: error %g > %g", err, bound);
    free(Q);
    free(K);
    free(out);
    free(o);
    free(Qr);
    model_free(&m, &G);
    pkv_engine_destroy(e);
}
END_TEST

/* How far keys drift after 1, 10 and 100 shifts of 8 positions, per dtype: the largest
 * |stored - exact| / |key| over the keys, where exact is the raw key rotated in double
 * at its final position. The model is the engine (the runs above hold them equal). */
START_TEST(discard_drift)
{
    const pkv_dtype dts[] = {PKV_F32, PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 8);
    for (uint32_t k = 0; k < 5; k++) {
        geo_t G;
        memset(&G, 0, sizeof G);
        G.L = 1;
        G.h = 4;
        G.g = 2;
        G.d = 64;
        G.bt = 16;
        G.dt = dts[k];
        G.lc[0].rope = PKV_ROPE_NEOX;
        pkv_config c = make_config(&G, true);
        pkv_engine *e = pkvt_engine_cfg(&c);
        pkv_session *s = pkvt_session(e);
        model m;
        model_init(&m, &G, 2000);
        append_rows(e, s, &m, &G, &r, 1000);
        double drift[3] = {0, 0, 0}, base = 0;
        int shifts = 0;
        const int marks[3] = {1, 10, 100};
        /* rounding alone (no shift): the stored key's own error */
        for (int t = 0; t <= 100; t++) {
            if (t) {
                ck_assert_int_eq(pkv_session_discard(s, 4, 12), PKV_OK);
                model_discard(e, &m, &G, 4, 12);
                shifts++;
            }
            if (t && t != 1 && t != 10 && t != 100)
                continue;
            double worst = 0;
            const size_t kn = (size_t)G.g * G.d;
            float *rk = pkvt_alloc(G.d * 4);
            for (uint64_t q = 4; q < m.len[0]; q++)
                for (uint32_t gi = 0; gi < G.g; gi++) {
                    const float *x = m.raw[0] + q * kn + gi * G.d;
                    pkv_dtype_round_row(G.dt, G.d, m.k[0] + q * kn + gi * G.d, rk);
                    double e2 = 0, n2 = 0;
                    for (uint32_t i = 0; i < G.d / 2; i++) {
                        const double a = (double)q * pow(10000.0, -(2.0 * i) / G.d);
                        const double y0 = x[i] * cos(a) - x[i + 32] * sin(a);
                        const double y1 = x[i] * sin(a) + x[i + 32] * cos(a);
                        e2 += (rk[i] - y0) * (rk[i] - y0) + (rk[i + 32] - y1) * (rk[i + 32] - y1);
                        n2 += (double)x[i] * x[i] + (double)x[i + 32] * x[i + 32];
                    }
                    worst = fmax(worst, sqrt(e2 / n2));
                }
            free(rk);
            if (t == 0)
                base = worst;
            for (int j = 0; j < 3; j++)
                if (t == marks[j])
                    drift[j] = worst;
        }
        printf("discard_drift %-4s: key error |stored - exact| / |key|: appended %.3g, after 1 "
               "shift %.3g, 10 %.3g, 100 %.3g\n", pkv_dtype_name(G.dt), base, drift[0],
               drift[1], drift[2]);
        /* each shift may add up to one rounding of the dtype (f32: the angle error of
         * the f32 cos/sin of the shift, the same every time), and they can add up
         * coherently: the same rotation, rounded the same way, each shift - so the bound
         * is linear in the shifts, not a random walk (docs/rope.md, the drift table) */
        const double unit = fmax(base, 0x1p-23);
        for (int j = 0; j < 3; j++)
            ck_assert_msg(drift[j] <= (1 + marks[j]) * unit, "%s drifts %g after %d shifts "
                          "(appended: %g)", pkv_dtype_name(G.dt), drift[j], marks[j], base);
        (void)shifts;
        model_free(&m, &G);
        pkv_engine_destroy(e);
    }
}
END_TEST

/* ---- the calls and what they refuse ------------------------------------------------------ */

START_TEST(bad_calls)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 9);
    geo_t G;
    memset(&G, 0, sizeof G);
    G.L = 3;
    G.h = 4;
    G.g = 2;
    G.d = 16;
    G.bt = 4;
    G.dt = PKV_F32;
    G.lc[0].rope = G.lc[1].rope = PKV_ROPE_NEOX; /* layer 2: the caller rotates */
    pkv_config c = make_config(&G, true), cp = make_config(&G, false);
    pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
    pkv_session *s = pkvt_session(e);
    model m;
    model_init(&m, &G, 100);
    append_rows(e, s, &m, &G, &r, 30);
    /* layer 2 shorter: a discard that ends past it truncates it, no rope needed */
    ck_assert_int_eq(pkv_session_truncate(s, 30), PKV_OK);
    snap_layer *sn = snapshot(s, G.L);
    ck_assert_int_eq(pkv_session_discard(NULL, 0, 1), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_discard(s, 5, 4), PKV_EINVAL);            /* p0 > p1 */
    ck_assert_int_eq(pkv_session_discard(s, UINT64_MAX, 0), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_discard(s, 0, 31), PKV_ERANGE);           /* p1 > len */
    ck_assert_int_eq(pkv_session_discard(s, 0, UINT64_MAX), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_discard(s, UINT64_MAX, UINT64_MAX), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_discard(s, 31, 31), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_discard(s, 4, 10), PKV_EINVAL);           /* layer 2 */
    char why[256];
    ck_assert_int_eq(pkv_engine_last_error(e, why, sizeof why), PKV_OK);
    ck_assert_msg(strstr(why, "layer 2") && strstr(why, "rope"), "%s", why);
    same_snapshot(s, sn, G.L);
    check_bitwise(e, plain, s, &m, &G, &r, "after refusals");
    ck_assert_int_eq(pkv_session_discard(s, 7, 7), PKV_OK);                /* nothing */
    ck_assert_int_eq(pkv_session_discard(s, 30, 30), PKV_OK);
    ck_assert_int_eq(pkv_session_discard(s, 0, 0), PKV_OK);
    same_snapshot(s, sn, G.L);
    snapshot_free(sn, G.L);
    /* the end of every layer: a truncate, layer 2 included */
    ck_assert_int_eq(pkv_session_discard(s, 22, 30), PKV_OK);
    model_discard(e, &m, &G, 22, 30);
    check_bitwise(e, plain, s, &m, &G, &r, "discard of the end");
    /* layer 2 shorter than p0: untouched while the others shift (it needs no rope) */
    for (uint32_t l = 0; l < 2; l++) {
        const size_t kn = (size_t)G.g * G.d;
        float *k = pkvt_alloc(kn * 4);
        for (int j = 0; j < 10; j++) {
            const uint64_t p = m.len[l]++;
            pkvt_fill(&r, m.raw[l] + p * kn, kn, -1, 1);
            pkvt_fill(&r, m.v[l] + p * kn, kn, -1, 1);
            ck_assert_int_eq(pkv_append(s, l, m.raw[l] + p * kn, m.v[l] + p * kn), PKV_OK);
            memcpy(k, m.raw[l] + p * kn, kn * 4);
            float *tmp = pkvt_alloc((size_t)G.h * G.d * 4);
            memcpy(tmp, k, kn * 4);
            ck_assert_int_eq(pkv_rope_q(e, l, 1, &p, tmp), PKV_OK);
            memcpy(m.k[l] + p * kn, tmp, kn * 4);
            free(tmp);
        }
        free(k);
    }
    ck_assert_int_eq(pkv_session_discard(s, 22, 27), PKV_OK);
    model_discard(e, &m, &G, 22, 27);
    check_bitwise(e, plain, s, &m, &G, &r, "layer 2 below p0");
    model_free(&m, &G);
    pkv_engine_destroy(e);
    pkv_engine_destroy(plain);
}
END_TEST

/* No memory for the copies of shared pages: PKV_ENOMEM, nothing changed. */
START_TEST(no_memory)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 10);
    geo_t G;
    memset(&G, 0, sizeof G);
    G.L = 1;
    G.h = 4;
    G.g = 2;
    G.d = 16;
    G.bt = 4;
    G.dt = PKV_F16;
    G.lc[0].rope = PKV_ROPE_NORM;
    const uint64_t page = 2ull * G.g * G.bt * G.d * 2;
    G.budget = 10 * page;
    pkv_config c = make_config(&G, true), cp = make_config(&G, false);
    pkv_engine *e = pkvt_engine_cfg(&c);
    G.budget = 0;
    cp.mem_budget = 0;
    pkv_engine *plain = pkvt_engine_cfg(&cp);
    pkv_session *s = pkvt_session(e);
    model m;
    model_init(&m, &G, 100);
    append_rows(e, s, &m, &G, &r, 36); /* 9 pages */
    pkv_session *f = NULL;
    ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK); /* every page shared */
    snap_layer *sn = snapshot(s, 1);
    ck_assert_int_eq(pkv_session_discard(s, 2, 9), PKV_ENOMEM);
    same_snapshot(s, sn, 1);
    check_bitwise(e, plain, s, &m, &G, &r, "after ENOMEM");
    check_bitwise(e, plain, f, &m, &G, &r, "the fork after ENOMEM");
    /* without the fork the pages are rewritten in place: no page needed */
    pkv_session_destroy(f);
    ck_assert_int_eq(pkv_session_discard(s, 2, 9), PKV_OK);
    model_discard(e, &m, &G, 2, 9);
    check_bitwise(e, plain, s, &m, &G, &r, "in place under a full budget");
    snapshot_free(sn, 1);
    model_free(&m, &G);
    pkv_engine_destroy(e);
    pkv_engine_destroy(plain);
}
END_TEST

/* Spilled sessions: the pages from p0 on come back, the rest may stay on disk. */
START_TEST(spilled)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 11);
    geo_t G;
    memset(&G, 0, sizeof G);
    G.L = 2;
    G.h = 4;
    G.g = 2;
    G.d = 16;
    G.bt = 4;
    G.dt = PKV_Q8;
    G.lc[0].rope = PKV_ROPE_NORM;
    G.lc[1].rope = PKV_ROPE_NEOX;
    G.lc[1].window = 30;
    pkvt_scratch_dir(G.spill_dir, sizeof G.spill_dir, "discard");
    G.budget = 40 * pkv_row_bytes(PKV_Q8, 16) * 2 * 2 * 4;
    pkv_config c = make_config(&G, true), cp = make_config(&G, false);
    cp.mem_budget = 0;
    cp.spill_dir = NULL;
    pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
    pkv_session *s = pkvt_session(e), *other[3];
    model m, mo;
    model_init(&m, &G, 400);
    model_init(&mo, &G, 400);
    append_rows(e, s, &m, &G, &r, 70);
    for (int i = 0; i < 3; i++) { /* pushes s out */
        other[i] = pkvt_session(e);
        append_rows(e, other[i], &mo, &G, &r, 50);
        for (uint32_t l = 0; l < G.L; l++)
            mo.len[l] = 0;
    }
    pkv_memory mem;
    ck_assert_int_eq(pkv_session_memory(s, &mem), PKV_OK);
    ck_assert_uint_gt(mem.bytes_spilled, 0);
    ck_assert_int_eq(pkv_session_discard(s, 9, 31), PKV_OK);
    model_discard(e, &m, &G, 9, 31);
    check_bitwise(e, plain, s, &m, &G, &r, "spilled session");
    for (int i = 0; i < 3; i++)
        pkv_session_destroy(other[i]);
    model_free(&m, &G);
    model_free(&mo, &G);
    pkv_engine_destroy(e);
    pkv_engine_destroy(plain);
    pkvt_remove_dir(G.spill_dir);
}
END_TEST

/* A shard keeps its first position: a discard below it is PKV_ERANGE, above it moves. */
START_TEST(shards)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 12);
    geo_t G;
    memset(&G, 0, sizeof G);
    G.L = 2;
    G.h = 4;
    G.g = 2;
    G.d = 16;
    G.bt = 8;
    G.dt = PKV_BF16;
    G.lc[0].rope = PKV_ROPE_NORM;
    G.lc[1].rope = PKV_ROPE_NEOX;
    G.lc[1].window = 100;
    pkv_config c = make_config(&G, true), cp = make_config(&G, false);
    pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
    G.first = pkv_shard_align(e);
    pkv_session *s = pkvt_session(e);
    ck_assert_int_eq(pkv_session_set_first(s, G.first), PKV_OK);
    model m;
    model_init(&m, &G, G.first + 800);
    append_rows(e, s, &m, &G, &r, 700);
    snap_layer *sn = snapshot(s, G.L);
    ck_assert_int_eq(pkv_session_discard(s, G.first - 1, G.first + 5), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_discard(s, 0, G.first + 5), PKV_ERANGE);
    same_snapshot(s, sn, G.L);
    snapshot_free(sn, G.L);
    ck_assert_int_eq(pkv_session_discard(s, G.first, G.first + 13), PKV_OK);
    model_discard(e, &m, &G, G.first, G.first + 13);
    check_bitwise(e, plain, s, &m, &G, &r, "shard");
    ck_assert_int_eq(pkv_session_discard(s, G.first + 100, G.first + 400), PKV_OK);
    model_discard(e, &m, &G, G.first + 100, G.first + 400);
    check_bitwise(e, plain, s, &m, &G, &r, "shard, window");
    model_free(&m, &G);
    pkv_engine_destroy(e);
    pkv_engine_destroy(plain);
}
END_TEST

/* The token record ends at p0 and stays there until a truncate to p0; the prefix cache
 * keeps serving the K/V those ids really gave. */
START_TEST(recorded_tokens)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 13);
    geo_t G;
    memset(&G, 0, sizeof G);
    G.L = 2;
    G.h = 4;
    G.g = 2;
    G.d = 16;
    G.bt = 4;
    G.dt = PKV_F32;
    G.lc[0].rope = G.lc[1].rope = PKV_ROPE_NORM;
    pkv_config c = make_config(&G, true), cp = make_config(&G, false);
    c.prefix_cache_bytes = 1 << 20;
    pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
    pkv_session *s = pkvt_session(e);
    model m, m0;
    model_init(&m, &G, 100);
    append_rows(e, s, &m, &G, &r, 40);
    int32_t ids[40];
    for (int i = 0; i < 40; i++)
        ids[i] = 100 + i;
    ck_assert_int_eq(pkv_session_set_tokens(s, 40, ids), PKV_OK);
    model_init(&m0, &G, 100); /* the rows before the discard */
    for (uint32_t l = 0; l < G.L; l++) {
        m0.len[l] = m.len[l];
        memcpy(m0.k[l], m.k[l], m.cap * G.g * G.d * 4);
        memcpy(m0.v[l], m.v[l], m.cap * G.g * G.d * 4);
    }
    ck_assert_int_eq(pkv_session_discard(s, 10, 20), PKV_OK);
    model_discard(e, &m, &G, 10, 20);
    check_bitwise(e, plain, s, &m, &G, &r, "recorded");
    ck_assert_int_eq(pkv_session_set_tokens(s, 10, ids), PKV_OK);  /* within the record */
    int32_t nid[30];
    memcpy(nid, ids, 10 * sizeof *nid);
    memcpy(nid + 10, ids + 20, 20 * sizeof *nid);
    ck_assert_int_eq(pkv_session_set_tokens(s, 11, nid), PKV_ESTATE);
    ck_assert_int_eq(pkv_session_set_tokens(s, 30, nid), PKV_ESTATE);
    /* a fork keeps the seal */
    pkv_session *f = NULL;
    ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK);
    ck_assert_int_eq(pkv_session_set_tokens(f, 11, nid), PKV_ESTATE);
    pkv_session_destroy(f);
    /* the prefix cache still has the original pages of ids[0..40) */
    pkv_session *h = NULL;
    uint64_t got = 0;
    ck_assert_int_eq(pkv_session_from_prefix(e, 40, ids, &h, &got), PKV_OK);
    ck_assert_uint_eq(got, 36);
    for (uint32_t l = 0; l < G.L; l++)
        m0.len[l] = 36;
    check_bitwise(e, plain, h, &m0, &G, &r, "prefix hit after a discard");
    pkv_session_destroy(h);
    /* truncate to p0: the record may grow again */
    ck_assert_int_eq(pkv_session_truncate(s, 10), PKV_OK);
    for (uint32_t l = 0; l < G.L; l++)
        m.len[l] = 10;
    append_rows(e, s, &m, &G, &r, 5);
    ck_assert_int_eq(pkv_session_set_tokens(s, 15, nid), PKV_OK);
    model_free(&m, &G);
    model_free(&m0, &G);
    pkv_engine_destroy(e);
    pkv_engine_destroy(plain);
}
END_TEST

/* Save and load after discards: the rope config and a window's stale rows go with the
 * file; the loaded session decodes to the bit, and refuses the same truncates. */
START_TEST(save_load)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 14);
    for (int round = 0; round < 4; round++) {
        geo_t G;
        memset(&G, 0, sizeof G);
        G.L = 2;
        G.h = 4;
        G.g = 2;
        G.d = 16;
        G.bt = 3 + round;
        G.dt = round % 2 ? PKV_Q4 : PKV_F16;
        G.lc[0].rope = PKV_ROPE_NORM;
        G.lc[1].rope = PKV_ROPE_NEOX;
        G.lc[1].window = 17;
        G.lc[1].rollback_tokens = 2;
        pkv_config c = make_config(&G, true), cp = make_config(&G, false);
        pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
        pkv_session *s = pkvt_session(e);
        model m;
        model_init(&m, &G, 400);
        append_rows(e, s, &m, &G, &r, 120);
        ck_assert_int_eq(pkv_session_discard(s, 3, 50 + round), PKV_OK);
        model_discard(e, &m, &G, 3, 50 + round);
        char dir[256], path[300];
        pkvt_scratch_dir(dir, sizeof dir, "discard-save");
        snprintf(path, sizeof path, "%s/s.pkv", dir);
        ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
        pkv_session *t = NULL;
        ck_assert_int_eq(pkv_session_load(e, path, &t), PKV_OK);
        check_bitwise(e, plain, t, &m, &G, &r, "loaded after a discard");
        for (uint64_t n = m.len[1]; n > 0; n--) /* the same truncates are refused */
            ck_assert_int_eq(pkv_session_truncate(s, n) == PKV_OK,
                             pkv_session_truncate(t, n) == PKV_OK);
        pkv_session_destroy(t);
        /* an engine of another rope config refuses the file as another format */
        pkv_layer_config lc2[2];
        memcpy(lc2, c.layer_cfg, sizeof lc2);
        lc2[0].rope_theta = 20000;
        pkv_config c2 = c;
        c2.layer_cfg = lc2;
        pkv_engine *e2 = pkvt_engine_cfg(&c2);
        ck_assert_int_eq(pkv_session_load(e2, path, &t), PKV_EINVAL);
        pkv_engine_destroy(e2);
        pkvt_remove_dir(dir);
        model_free(&m, &G);
        pkv_engine_destroy(e);
        pkv_engine_destroy(plain);
    }
}
END_TEST

/* ---- the crossings, randomized ---------------------------------------------------------- */

/* How far one store of dtype dt may move a value, relative to the largest magnitude of
 * its block (docs/numerics.md, "Rounding" and "Error"): half a step; the Q8/Q4 step is
 * the block's largest value over 127 (Q8) or 7.5 (Q4, at worst), raised by up to 8/64
 * by the scale search and one f16 rounding. */
static double store_error(pkv_dtype dt)
{
    switch (dt) {
    case PKV_F16: return 0x1p-11;
    case PKV_BF16: return 0x1p-8;
    case PKV_Q8: return (1.0 + 8.0 / 64) / 254;
    case PKV_Q4: return (1.0 + 8.0 / 64) / 15;
    default: return 0;
    }
}

/* The engine's layer l of s against the double reference, at its end (len - 1):
 *  - every key a decode there reads (its window and sinks), as the page holds it,
 *    against the raw key turned here in double at its current position: each pair
 *    within (1 + n) stores and rotations of error for a key moved n times (a rounding
 *    adds at most store_error of the block's largest value, at most sqrt(2) times the
 *    raw key's largest value plus the errors before it; a rotation 2^-20 of the pair,
 *    docs/rope.md; rotations keep a pair's error, so they add up, no more);
 *  - the decode of a query from pkv_rope_q against attention computed here in double
 *    over the rows the pages hold (window and sinks as docs/variants.md defines them),
 *    within 1e-5 x max(1, max|V|), the bound the variant suites hold decode to. */
static void check_reference(pkv_engine *e, pkv_session *s, const model *m, const geo_t *G,
                            uint32_t l, pkvt_rng *r, const char *what)
{
    const uint64_t n = m->len[l];
    if (n == G->first)
        return;
    const pkv_layer_config *lc = &G->lc[l];
    const size_t kn = (size_t)G->g * G->d, qn = (size_t)G->h * G->d;
    const uint32_t rd = lc->rope_dims ? lc->rope_dims : G->d, half = rd / 2;
    const double theta = lc->rope_theta != 0.0f ? lc->rope_theta : 10000.0;
    const double fscale = lc->rope_freq_scale != 0.0f ? lc->rope_freq_scale : 1.0;
    const double r_dt = store_error(G->dt);
    const uint64_t t = n - 1;
    float *kq = pkvt_alloc(G->d * 4), *vq = pkvt_alloc(G->d * 4);
    float *q = pkvt_alloc(qn * 4), *o = pkvt_alloc(qn * 4);
    double *sc = pkvt_alloc(n * sizeof *sc), *acc = pkvt_alloc(G->d * sizeof *acc);
    double *y = pkvt_alloc(G->d * sizeof *y);
    pkvt_fill(r, q, qn, -1.5f, 1.5f);
    ck_assert_int_eq(pkv_rope_q(e, l, 1, &t, q), PKV_OK);
    ck_assert_int_eq(pkv_decode(s, l, q, o), PKV_OK);
    float vmax = 1.0f;
    for (uint32_t hh = 0; hh < G->h; hh++) {
        const uint32_t gi = hh / (G->h / G->g);
        double mx = -INFINITY, den = 0;
        for (uint64_t j = G->first; j <= t; j++) {
            const bool read = !lc->window || j + lc->window > t || j < lc->sink_tokens;
            sc[j] = -INFINITY;
            if (!read)
                continue;
            const float *raw = m->raw[l] + j * kn + (size_t)gi * G->d;
            pkv_dtype_round_row(G->dt, G->d, m->k[l] + j * kn + (size_t)gi * G->d, kq);
            /* the key against its exact rotation at j (once per key: the first head of
             * its group) */
            if (hh % (G->h / G->g) == 0) {
                double M = 0;
                for (uint32_t i = 0; i < G->d; i++)
                    M = fmax(M, fabs(raw[i]));
                const double k1 = 1.0 + m->moves[l][j];
                const double pair = k1 * 2.0 * (r_dt + 0x1p-20) * M * (1.0 + k1 * r_dt) + 1e-6;
                for (uint32_t i = 0; i < G->d; i++)
                    y[i] = raw[i];
                for (uint32_t i = 0; i < half; i++) {
                    const uint32_t i0 = lc->rope == PKV_ROPE_NORM ? 2 * i : i;
                    const uint32_t i1 = lc->rope == PKV_ROPE_NORM ? 2 * i + 1 : i + half;
                    const double a = (double)j * fscale * pow(theta, -(2.0 * i) / rd);
                    y[i0] = raw[i0] * cos(a) - raw[i1] * sin(a);
                    y[i1] = raw[i0] * sin(a) + raw[i1] * cos(a);
                    const double err = hypot(kq[i0] - y[i0], kq[i1] - y[i1]);
                    ck_assert_msg(err <= pair, "%s: layer %u %s, key %llu (moved %u times) "
                                  "pair %u: error %g > %g (seed %llu)", what, l,
                                  pkv_dtype_name(G->dt), (unsigned long long)j,
                                  m->moves[l][j], i, err, pair, (unsigned long long)pkvt_seed());
                }
                for (uint32_t i = rd; i < G->d; i++)
                    ck_assert_msg(fabs(kq[i] - y[i]) <= pair, "%s: layer %u key %llu value %u "
                                  "past rope_dims", what, l, (unsigned long long)j, i);
            }
            double dot = 0;
            for (uint32_t i = 0; i < G->d; i++)
                dot += (double)q[hh * G->d + i] * kq[i];
            sc[j] = dot / sqrt(G->d);
            mx = fmax(mx, sc[j]);
        }
        for (uint32_t i = 0; i < G->d; i++)
            acc[i] = 0;
        for (uint64_t j = G->first; j <= t; j++) {
            if (sc[j] == -INFINITY)
                continue;
            const double w = exp(sc[j] - mx);
            den += w;
            pkv_dtype_round_row(G->dt, G->d, m->v[l] + j * kn + (size_t)gi * G->d, vq);
            for (uint32_t i = 0; i < G->d; i++) {
                acc[i] += w * vq[i];
                vmax = fmaxf(vmax, fabsf(vq[i]));
            }
        }
        for (uint32_t i = 0; i < G->d; i++) {
            const double want = acc[i] / den, got = o[hh * G->d + i];
            ck_assert_msg(fabs(got - want) <= 1e-5 * vmax, "%s: layer %u %s, head %u value "
                          "%u: decode %g, reference %g (seed %llu)", what, l,
                          pkv_dtype_name(G->dt), hh, i, got, want,
                          (unsigned long long)pkvt_seed());
        }
    }
    free(kq);
    free(vq);
    free(q);
    free(o);
    free(sc);
    free(acc);
    free(y);
}

static void check_all(pkv_engine *e, pkv_engine *plain, pkv_session *s, const model *m,
                      const geo_t *G, pkvt_rng *r, const char *what)
{
    check_bitwise(e, plain, s, m, G, r, what);
    for (uint32_t l = 0; l < G->L; l++)
        check_reference(e, s, m, G, l, r, what);
}

/* Random rounds over the crossings at once: page-aligned and unaligned cuts (and
 * StreamingLLM's, right after the sinks) x a full layer, a window with sinks and a
 * partial one with rollback x every dtype x a forked sibling holding the pages being
 * moved x a spilled session (a budget other sessions fill) x save and load after the
 * discard (the loaded copy carries on). After every step the session, the sibling and
 * the loaded copy are held bitwise to the model and the model (each layer, as its
 * decode reads it) to the double reference. A refused discard (PKV_ERANGE: a window's
 * released rows would come back) changes nothing. */
START_TEST(crossings_random)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() ^ 15);
    const pkv_dtype dts[] = {PKV_F32, PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};
    const int rounds = pkvt_quick() ? 5 : 15;
    int done = 0, refused = 0, n_spilled = 0, loaded = 0, siblings = 0;
    for (int round = 0; round < rounds; round++) {
        geo_t G;
        memset(&G, 0, sizeof G);
        const uint32_t bts[] = {1, 3, 4, 8, 16};
        G.L = 3;
        G.h = 4;
        G.g = 2;
        G.d = pkvt_below(&r, 2) ? 32 : 40;
        G.bt = bts[pkvt_below(&r, 5)];
        G.dt = dts[round % 5];
        G.lc[0].rope = PKV_ROPE_NORM;
        G.lc[1].rope = PKV_ROPE_NEOX;
        G.lc[1].rope_theta = 500000;
        G.lc[1].window = 20 + pkvt_below(&r, 40);
        G.lc[1].sink_tokens = pkvt_below(&r, 5);
        G.lc[2].rope = PKV_ROPE_NORM;
        G.lc[2].rope_dims = G.d / 2;
        G.lc[2].rope_freq_scale = 0.5f;
        G.lc[2].window = 10 + pkvt_below(&r, 30);
        G.lc[2].rollback_tokens = pkvt_below(&r, 4);
        const bool spill = round % 3 == 1;
        const uint64_t cap = 700;
        if (spill) {
            /* twice the pages s can hold (at most 360 rows; the windows' pages and
             * partial ones): a discard brings back what it moves and copies what the
             * sibling shares, at once; the others' 900 rows push s out */
            pkvt_scratch_dir(G.spill_dir, sizeof G.spill_dir, "discard-cross");
            const uint64_t held = (360 + G.bt - 1) / G.bt + 2 +
                                  2 * ((64 + 5 + 4 + G.bt - 1) / G.bt + 2);
            G.budget = (2 * held + 4) * (uint64_t)pkv_row_bytes(G.dt, G.d) * 2 * G.g * G.bt;
        }
        pkv_config c = make_config(&G, true), cp = make_config(&G, false);
        cp.mem_budget = 0;
        cp.spill_dir = NULL;
        pkv_engine *e = pkvt_engine_cfg(&c), *plain = pkvt_engine_cfg(&cp);
        pkv_session *s = pkvt_session(e), *other[3] = {NULL, NULL, NULL};
        model m, fm, scratch;
        model_init(&m, &G, cap);
        model_init(&fm, &G, cap);
        model_init(&scratch, &G, cap);
        append_rows(e, s, &m, &G, &r, 100 + pkvt_below(&r, 60));
        for (int step = 0; step < 5; step++) {
            if (spill) { /* other sessions fill the budget: s goes (partly) to disk */
                for (int i = 0; i < 3; i++) {
                    pkv_session_destroy(other[i]);
                    other[i] = pkvt_session(e);
                    for (uint32_t l = 0; l < G.L; l++)
                        scratch.len[l] = 0;
                    append_rows(e, other[i], &scratch, &G, &r, 300);
                }
                pkv_memory mem;
                ck_assert_int_eq(pkv_session_memory(s, &mem), PKV_OK);
                n_spilled += mem.bytes_spilled > 0;
            }
            const uint64_t len = m.len[0];
            uint64_t p0, p1;
            switch (pkvt_below(&r, 3)) {
            case 0: /* whole pages */
                p0 = pkvt_below(&r, (uint32_t)(len / G.bt)) * G.bt;
                p1 = p0 + G.bt * (1 + pkvt_below(&r, (uint32_t)((len - p0) / G.bt)));
                p1 = p1 < len ? p1 : len;
                break;
            case 1: /* anywhere */
                p0 = pkvt_below(&r, (uint32_t)len);
                p1 = p0 + 1 + pkvt_below(&r, (uint32_t)(len - p0));
                break;
            default: /* StreamingLLM: the oldest positions after the sinks */
                p0 = G.lc[1].sink_tokens;
                p1 = p0 + 1 + pkvt_below(&r, (uint32_t)(len / 2));
                break;
            }
            pkv_session *f = NULL;
            if (pkvt_below(&r, 2)) { /* a sibling sharing every page */
                ck_assert_int_eq(pkv_session_fork(s, &f), PKV_OK);
                model_copy(&fm, &m, &G);
            }
            snap_layer *sn = snapshot(s, G.L);
            const pkv_status st = pkv_session_discard(s, p0, p1);
            char what[128];
            snprintf(what, sizeof what, "round %d step %d: discard [%llu, %llu) of %llu, bt %u%s%s",
                     round, step, (unsigned long long)p0, (unsigned long long)p1,
                     (unsigned long long)len, G.bt, spill ? ", spill" : "", f ? ", forked" : "");
            ck_assert_msg(st == PKV_OK || st == PKV_ERANGE, "%s: status %s", what,
                          pkv_status_str(st));
            if (st == PKV_OK) {
                model_discard(e, &m, &G, p0, p1);
                done++;
            } else {
                same_snapshot(s, sn, G.L);
                refused++;
            }
            snapshot_free(sn, G.L);
            check_all(e, plain, s, &m, &G, &r, what);
            if (f) {
                check_all(e, plain, f, &fm, &G, &r, "the sibling after the discard");
                pkv_session_destroy(f);
                siblings++;
            }
            if (st == PKV_OK && pkvt_below(&r, 3) == 0) { /* carry on with a loaded copy */
                char dir[256], path[300];
                pkvt_scratch_dir(dir, sizeof dir, "discard-cross-save");
                snprintf(path, sizeof path, "%s/s.pkv", dir);
                ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
                pkv_session *t = NULL;
                ck_assert_int_eq(pkv_session_load(e, path, &t), PKV_OK);
                pkvt_remove_dir(dir);
                pkv_session_destroy(s);
                s = t;
                check_all(e, plain, s, &m, &G, &r, "loaded after the discard");
                loaded++;
            }
            append_rows(e, s, &m, &G, &r, 1 + pkvt_below(&r, 40));
            check_all(e, plain, s, &m, &G, &r, "appends after the discard");
        }
        for (int i = 0; i < 3; i++)
            pkv_session_destroy(other[i]);
        pkv_session_destroy(s);
        ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
        model_free(&m, &G);
        model_free(&fm, &G);
        model_free(&scratch, &G);
        pkv_engine_destroy(e);
        pkv_engine_destroy(plain);
        if (spill)
            pkvt_remove_dir(G.spill_dir);
    }
    /* every crossing was reached */
    ck_assert_int_gt(done, 0);
    ck_assert_int_gt(n_spilled, 0);
    ck_assert_int_gt(loaded, 0);
    ck_assert_int_gt(siblings, 0);
    (void)refused;
}
END_TEST

int main(void)
{
    Suite *s = suite_create("discard");
    TCase *tb = tcase_create("bitwise");
    tcase_set_timeout(tb, 300);
    tcase_add_test(tb, shifts_f32);
    tcase_add_test(tb, shifts_f16);
    tcase_add_test(tb, shifts_bf16);
    tcase_add_test(tb, shifts_q8);
    tcase_add_test(tb, shifts_q4);
    tcase_add_test(tb, windows);
    suite_add_tcase(s, tb);
    TCase *tr = tcase_create("reference");
    tcase_set_timeout(tr, 300);
    tcase_add_test(tr, discard_reference);
    tcase_add_test(tr, discard_drift);
    suite_add_tcase(s, tr);
    TCase *tc = tcase_create("crossings");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, bad_calls);
    tcase_add_test(tc, no_memory);
    tcase_add_test(tc, spilled);
    tcase_add_test(tc, shards);
    tcase_add_test(tc, recorded_tokens);
    tcase_add_test(tc, save_load);
    tcase_add_test(tc, crossings_random);
    tcase_add_test(tc, verify_after_discard);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

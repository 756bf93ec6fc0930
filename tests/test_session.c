/*
 * test_session.c - the paged cache against independent references.
 *
 * The core property (include/pagedkv.h, pkv_causal_attention): every incremental decode step equals
 * the matching row of dense causal attention (double precision, on K/V rounded to the storage
 * dtype) within 1e-5 * max|V|. Around it: forks and copy-on-write, truncate,
 * prefill/batch/thread-count bitwise identity, a model-based random walk with pool invariants
 * checked after every step, concurrency, the budget, bad input, and memory that RSS confirms.
 */
#include "testutil.h"
#include "internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const uint32_t head_dims[] = {1, 3, 8, 17, 64, 80, 128, 256};
static const uint32_t block_sizes[] = {1, 2, 5, 16, 64};

/* A contiguous history of one layer: the trivial model of a session. Beside the floats
 * it keeps the oracle's input, each value rounded to the storage dtype as a double, and
 * the largest |rounded V|, extended as positions come (check_decode): rounding the whole
 * history again at every step made the test quadratic in rounding calls and in freshly
 * faulted pages, and that, not the oracle, was most of its time. */
typedef struct {
    float *K, *V;      /* [cap][g][d] */
    uint64_t len, cap;
    double *Kd, *Vd;   /* [cap][g][d]: K, V rounded to `rdt`, valid for [0, rounded) */
    uint64_t rounded;
    pkv_dtype rdt;
    float vmax;        /* max |Vd| over [0, rounded) */
} hist;

static void hist_push(hist *h, uint32_t gd, const float *k, const float *v)
{
    if (h->len == h->cap) {
        h->cap = h->cap ? h->cap * 2 : 64;
        h->K = realloc(h->K, h->cap * gd * sizeof(float));
        h->V = realloc(h->V, h->cap * gd * sizeof(float));
        h->Kd = realloc(h->Kd, h->cap * gd * sizeof(double));
        h->Vd = realloc(h->Vd, h->cap * gd * sizeof(double));
        ck_assert(h->K && h->V && h->Kd && h->Vd);
    }
    memcpy(h->K + h->len * gd, k, gd * sizeof(float));
    memcpy(h->V + h->len * gd, v, gd * sizeof(float));
    h->len++;
}

/* Keep the first n positions (n <= len). Every shortening goes through here, so the
 * rounded copy never outlives the positions it was made from: after one, it (and its
 * vmax, which cannot shrink) is made again from the start. */
static void hist_truncate(hist *h, uint64_t n)
{
    h->len = n;
    if (h->rounded > n)
        h->rounded = 0;
}

static void hist_copy(hist *dst, const hist *src, uint32_t gd)
{
    hist_truncate(dst, 0);
    for (uint64_t i = 0; i < src->len; i++)
        hist_push(dst, gd, src->K + i * gd, src->V + i * gd);
}

static void hist_free(hist *h)
{
    free(h->K);
    free(h->V);
    free(h->Kd);
    free(h->Vd);
    memset(h, 0, sizeof *h);
}

/* Bring h's rounded doubles and vmax up to its length for storage type dt. */
static void hist_round(hist *h, uint32_t gd, pkv_dtype dt)
{
    if (h->rdt != dt || h->rounded == 0) { /* another dtype, or shortened since */
        h->rdt = dt;
        h->rounded = 0;
        h->vmax = 0;
    }
    for (size_t i = h->rounded * gd; i < h->len * gd; i++) {
        h->Kd[i] = pkv_dtype_round(dt, h->K[i]);
        h->Vd[i] = pkv_dtype_round(dt, h->V[i]);
        h->vmax = fmaxf(h->vmax, fabsf((float)h->Vd[i]));
    }
    h->rounded = h->len;
}

/* Decode q on (s, layer) and compare with the double reference on history h. */
static void check_decode(pkv_session *s, uint32_t layer, hist *h, uint32_t nh,
                         uint32_t g, uint32_t d, pkv_dtype dt, const float *q,
                         const char *what, uint64_t seed)
{
    float *out = pkvt_alloc((size_t)nh * d * sizeof(float));
    double *ref = pkvt_alloc((size_t)nh * d * sizeof(double));
    ck_assert_int_eq(pkv_decode(s, layer, q, out), PKV_OK);
    hist_round(h, g * d, dt);
    double *qd = pkvt_to_double(q, (size_t)nh * d);
    pkvt_oracle_decode(nh, g, d, 0, h->len, qd, h->Kd, h->Vd, ref);
    const float vmax = h->vmax;
    double err = pkvt_maxdiff_fd(out, ref, (size_t)nh * d);
    ck_assert_msg(err <= 1e-5 * vmax + 1e-30,
                  "%s: seed %#llx h=%u g=%u d=%u dt=%s len=%llu: err %g > 1e-5*%g", what,
                  (unsigned long long)seed, nh, g, d, pkv_dtype_name(dt),
                  (unsigned long long)h->len, err, vmax);
    free(qd);
    free(out);
    free(ref);
}

/* ---- the core property --------------------------------------------------------------- */

START_TEST(incremental_equals_causal)
{
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    const int cases = pkvt_quick() ? 12 : 160;
    for (int c = 0; c < cases; c++) {
        uint32_t g = 1 + pkvt_below(&r, 8), hg = 1 + pkvt_below(&r, 8), nh = g * hg;
        uint32_t d = head_dims[pkvt_below(&r, 8)];
        uint32_t bt = block_sizes[pkvt_below(&r, 5)];
        pkv_dtype dt = (pkv_dtype)pkvt_below(&r, 3);
        uint32_t layers = 1 + pkvt_below(&r, 3);
        /* lengths up to several hundred, crossing page boundaries; the reference is
         * O(T^2 h d), so big heads get shorter histories */
        uint64_t budget = pkvt_quick() ? 2000000 : 30000000;
        uint32_t tmax = (uint32_t)sqrt((double)budget / ((double)nh * d * layers)) + 2;
        if (tmax > 400)
            tmax = 400;
        uint32_t T = 1 + pkvt_below(&r, tmax);
        pkv_engine *e = pkvt_engine(layers, nh, g, d, bt, dt);
        pkv_session *s;
        ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
        hist *h = pkvt_alloc(layers * sizeof *h);
        float *k = pkvt_alloc((size_t)g * d * sizeof(float));
        float *v = pkvt_alloc((size_t)g * d * sizeof(float));
        float *q = pkvt_alloc((size_t)nh * d * sizeof(float));
        for (uint32_t t = 0; t < T; t++) {
            for (uint32_t l = 0; l < layers; l++) {
                pkvt_fill(&r, k, (size_t)g * d, -2, 2);
                pkvt_fill(&r, v, (size_t)g * d, -1, 1);
                pkvt_fill(&r, q, (size_t)nh * d, -2, 2);
                ck_assert_int_eq(pkv_append(s, l, k, v), PKV_OK);
                hist_push(&h[l], g * d, k, v);
                check_decode(s, l, &h[l], nh, g, d, dt, q, "incremental", seed);
            }
        }
        pkv_memory m;
        ck_assert_int_eq(pkv_session_memory(s, &m), PKV_OK);
        pkv_stats es;
        pkv_engine_stats(e, &es);
        uint64_t pages = layers * ((T + bt - 1) / bt);
        ck_assert_uint_eq(m.blocks, pages);
        ck_assert_uint_eq(m.bytes_resident, pages * es.page_bytes);
        ck_assert_uint_eq(m.tokens, (uint64_t)T * layers);
        ck_assert_uint_eq(m.bytes_ideal,
                          (uint64_t)T * layers * 2 * g * d * pkv_dtype_size(dt));
        ck_assert_uint_eq(es.page_bytes, 2ull * g * bt * d * pkv_dtype_size(dt));
        ck_assert(pkvi_engine_check(e));
        for (uint32_t l = 0; l < layers; l++)
            hist_free(&h[l]);
        free(h);
        free(k);
        free(v);
        free(q);
        pkv_session_destroy(s);
        pkv_engine_destroy(e);
    }
}
END_TEST

/* The public dense oracle agrees with the test's own double reference: the two are
 * written independently, so a shared mistake would have to be made twice. */
START_TEST(decode_rows_match_public_oracle)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 1);
    const uint32_t T = 133, nh = 6, g = 3, d = 17;
    pkv_engine *e = pkvt_engine(1, nh, g, d, 16, PKV_F32);
    pkv_session *s;
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    float *Q = pkvt_alloc(T * nh * d * sizeof(float)), *K = pkvt_alloc(T * g * d * 4),
          *V = pkvt_alloc(T * g * d * 4), *O = pkvt_alloc(T * nh * d * 4),
          *R = pkvt_alloc(T * nh * d * 4);
    pkvt_fill(&r, Q, T * nh * d, -3, 3);
    pkvt_fill(&r, K, T * g * d, -3, 3);
    pkvt_fill(&r, V, T * g * d, -5, 5);
    for (uint32_t t = 0; t < T; t++) {
        ck_assert_int_eq(pkv_append(s, 0, K + t * g * d, V + t * g * d), PKV_OK);
        ck_assert_int_eq(pkv_decode(s, 0, Q + t * nh * d, O + t * nh * d), PKV_OK);
    }
    ck_assert_int_eq(pkv_causal_attention(T, nh, g, d, 0, Q, K, V, R), PKV_OK);
    for (uint32_t i = 0; i < T * nh * d; i++)
        ck_assert_msg(fabsf(O[i] - R[i]) <= 5e-5f, "row %u: %g vs %g", i / (nh * d), O[i],
                      R[i]);
    free(Q); free(K); free(V); free(O); free(R);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
}
END_TEST

/* ---- forks and copy-on-write ----------------------------------------------------------- */

START_TEST(forks_share_and_copy_only_the_tail)
{
    const uint64_t seed = pkvt_seed() + 2;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    const uint32_t nh = 8, g = 2, d = 24, bt = 16, P = 37, F = 6; /* 37: partial tail */
    pkv_engine *e = pkvt_engine(2, nh, g, d, bt, PKV_F16);
    pkv_session *parent;
    ck_assert_int_eq(pkv_session_create(e, &parent), PKV_OK);
    hist ph[2] = {{0}};
    float k[2 * 24], v[2 * 24], q[8 * 24];
    for (uint32_t t = 0; t < P; t++)
        for (uint32_t l = 0; l < 2; l++) {
            pkvt_fill(&r, k, g * d, -1, 1);
            pkvt_fill(&r, v, g * d, -1, 1);
            ck_assert_int_eq(pkv_append(parent, l, k, v), PKV_OK);
            hist_push(&ph[l], g * d, k, v);
        }
    pkv_stats before, after;
    pkv_engine_stats(e, &before);
    pkv_session *f[6];
    hist fh[6][2];
    memset(fh, 0, sizeof fh);
    for (uint32_t i = 0; i < F; i++) {
        ck_assert_int_eq(pkv_session_fork(parent, &f[i]), PKV_OK);
        for (uint32_t l = 0; l < 2; l++)
            hist_copy(&fh[i][l], &ph[l], g * d);
    }
    pkv_engine_stats(e, &after);
    ck_assert_uint_eq(after.pages_in_use, before.pages_in_use); /* a fork copies nothing */
    pkv_memory m;
    pkv_session_memory(f[0], &m);
    ck_assert_uint_eq(m.bytes_shared, m.bytes_resident);
    ck_assert_uint_eq(m.bytes_resident, 2ull * 3 * after.page_bytes);

    /* first append into fork 0, layer 0: exactly one page (the partial tail) copied */
    pkvt_fill(&r, k, g * d, -1, 1);
    pkvt_fill(&r, v, g * d, -1, 1);
    ck_assert_int_eq(pkv_append(f[0], 0, k, v), PKV_OK);
    hist_push(&fh[0][0], g * d, k, v);
    pkv_engine_stats(e, &after);
    ck_assert_uint_eq(after.pages_in_use, before.pages_in_use + 1);
    pkv_session_memory(f[0], &m);
    ck_assert_uint_eq(m.bytes_shared, (2ull * 3 - 1) * after.page_bytes);

    pkv_session_destroy(parent); /* parent first: the forks keep the pages alive */
    for (uint32_t l = 0; l < 2; l++)
        hist_free(&ph[l]);
    /* interleaved appends across forks, crossing page boundaries */
    for (uint32_t step = 0; step < 60; step++) {
        uint32_t i = pkvt_below(&r, F), l = pkvt_below(&r, 2);
        pkvt_fill(&r, k, g * d, -1, 1);
        pkvt_fill(&r, v, g * d, -1, 1);
        ck_assert_int_eq(pkv_append(f[i], l, k, v), PKV_OK);
        hist_push(&fh[i][l], g * d, k, v);
        ck_assert(pkvi_engine_check(e));
    }
    for (uint32_t i = 0; i < F; i++)
        for (uint32_t l = 0; l < 2; l++) {
            pkvt_fill(&r, q, nh * d, -2, 2);
            check_decode(f[i], l, &fh[i][l], nh, g, d, PKV_F16, q, "fork", seed);
        }
    for (uint32_t i = 0; i < F; i++) {
        pkv_session_destroy(f[i]);
        for (uint32_t l = 0; l < 2; l++)
            hist_free(&fh[i][l]);
    }
    pkv_engine_stats(e, &after);
    ck_assert_uint_eq(after.pages_in_use, 0);
    pkv_engine_destroy(e);
}
END_TEST

/* Truncating a fork to the middle of a shared full page makes it partly filled again:
 * the next append must copy it, and the other holder must not see the write. */
START_TEST(truncate_into_shared_page_copies)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed() + 3);
    const uint32_t nh = 4, g = 2, d = 8, bt = 4;
    pkv_engine *e = pkvt_engine(1, nh, g, d, bt, PKV_F32);
    pkv_session *a, *b;
    ck_assert_int_eq(pkv_session_create(e, &a), PKV_OK);
    hist ha = {0}, hb = {0};
    float k[16], v[16], q[32];
    for (int t = 0; t < 8; t++) {
        pkvt_fill(&r, k, 16, -1, 1);
        pkvt_fill(&r, v, 16, -1, 1);
        pkv_append(a, 0, k, v);
        hist_push(&ha, 16, k, v);
    }
    ck_assert_int_eq(pkv_session_fork(a, &b), PKV_OK);
    ck_assert_int_eq(pkv_session_truncate(b, 6), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(b, 0), 6);
    for (int t = 0; t < 6; t++)
        hist_push(&hb, 16, ha.K + t * 16, ha.V + t * 16);
    for (int t = 0; t < 5; t++) {
        pkvt_fill(&r, k, 16, -1, 1);
        pkvt_fill(&r, v, 16, -1, 1);
        ck_assert_int_eq(pkv_append(b, 0, k, v), PKV_OK);
        hist_push(&hb, 16, k, v);
    }
    pkvt_fill(&r, q, 32, -2, 2);
    check_decode(a, 0, &ha, nh, g, d, PKV_F32, q, "truncate-owner", 3);
    check_decode(b, 0, &hb, nh, g, d, PKV_F32, q, "truncate-fork", 3);
    ck_assert_int_eq(pkv_session_truncate(b, 12), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_truncate(b, 0), PKV_OK);
    ck_assert_int_eq(pkv_decode(b, 0, q, q), PKV_ESTATE);
    ck_assert(pkvi_engine_check(e));
    hist_free(&ha);
    hist_free(&hb);
    pkv_session_destroy(a);
    pkv_session_destroy(b);
    pkv_engine_destroy(e);
}
END_TEST

/* ---- bitwise identity: prefill, batch, thread counts --------------------------------- */

static pkv_engine *engine_threads(uint32_t nh, uint32_t g, uint32_t d, uint32_t bt,
                                  pkv_dtype dt, uint32_t threads)
{
    pkv_config c = pkvt_config(1, nh, g, d, bt, dt);
    c.n_threads = threads;
    pkv_engine *e = pkvt_engine_cfg(&c);
    /* every call goes to the workers, whatever its size and timing (decode.c) */
    pkvi_exec_split_always(pkvi_engine_ctx(e).exec);
    return e;
}

/* T tokens of queries (Q [T][qd]) and keys and values (K, V [T][kd]), uniform. */
static void random_qkv(pkvt_rng *r, uint32_t T, size_t qd, size_t kd, float **Q, float **K,
                       float **V)
{
    *Q = pkvt_alloc(T * qd * 4);
    *K = pkvt_alloc(T * kd * 4);
    *V = pkvt_alloc(T * kd * 4);
    pkvt_fill(r, *Q, T * qd, -2, 2);
    pkvt_fill(r, *K, T * kd, -2, 2);
    pkvt_fill(r, *V, T * kd, -1, 1);
}

/* Prefill runs a page's queries through the kernels at once (decode.c); over random
 * geometries - odd head counts, head_dim not a multiple of 8, pages of 1 to 64 tokens,
 * groups of up to 64 heads (fewer queries per tile than a page holds), histories that
 * span several split-K chunks - it must equal append + decode token by token. */
START_TEST(prefill_geometries_bitwise)
{
    const uint64_t seed = pkvt_seed() + 11;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    static const uint32_t hgs[] = {1, 2, 3, 4, 5, 8, 64};
    static const uint32_t dims[] = {3, 17, 64, 80};
    static const uint32_t bts[] = {1, 3, 16, 64};
    const int cases = pkvt_quick() ? 3 : 10;
    for (int cs = 0; cs < cases; cs++) {
        const uint32_t g = 1 + pkvt_below(&r, 3), hg = hgs[pkvt_below(&r, 7)];
        const uint32_t d = dims[pkvt_below(&r, 4)], bt = bts[pkvt_below(&r, 4)];
        const uint32_t T = 1 + pkvt_below(&r, pkvt_quick() ? 150 : 1400);
        const pkv_dtype dt = (pkv_dtype)pkvt_below(&r, 3);
        const uint32_t nh = g * hg;
        const size_t qd = (size_t)nh * d, kd = (size_t)g * d;
        float *Q, *K, *V;
        random_qkv(&r, T, qd, kd, &Q, &K, &V);
        float *ref = pkvt_alloc(T * qd * 4), *got = pkvt_alloc(T * qd * 4);
        pkv_engine *e1 = engine_threads(nh, g, d, bt, dt, 1);
        pkv_engine *e3 = engine_threads(nh, g, d, bt, dt, 3);
        pkv_session *s1, *s3;
        ck_assert_int_eq(pkv_session_create(e1, &s1), PKV_OK);
        ck_assert_int_eq(pkv_session_create(e3, &s3), PKV_OK);
        for (uint32_t t = 0; t < T; t++) {
            ck_assert_int_eq(pkv_append(s1, 0, K + t * kd, V + t * kd), PKV_OK);
            ck_assert_int_eq(pkv_decode(s1, 0, Q + t * qd, ref + t * qd), PKV_OK);
        }
        for (uint32_t t = 0; t < T;) {
            uint32_t n = 1 + pkvt_below(&r, 2 * bt + 40);
            if (n > T - t)
                n = T - t;
            ck_assert_int_eq(pkv_prefill(s3, 0, n, Q + t * qd, K + t * kd, V + t * kd,
                                         got + t * qd), PKV_OK);
            t += n;
        }
        for (uint32_t t = 0; t < T; t++)
            ck_assert_msg(memcmp(got + t * qd, ref + t * qd, qd * 4) == 0,
                          "prefill row %u of %u differs from append + decode (g=%u hg=%u "
                          "d=%u bt=%u %s, seed 0x%llx)", t, T, g, hg, d, bt,
                          pkv_dtype_name(dt), (unsigned long long)seed);
        pkv_session_destroy(s1);
        pkv_session_destroy(s3);
        pkv_engine_destroy(e1);
        pkv_engine_destroy(e3);
        free(Q); free(K); free(V); free(ref); free(got);
    }
}
END_TEST

START_TEST(prefill_batch_threads_bitwise)
{
    const uint64_t seed = pkvt_seed() + 4;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    const uint32_t nh = 8, g = 2, d = 64, bt = 16;
    /* > 1 MiB of f32 K/V engages the threads; quick mode (valgrind) checks the same
     * properties on a shorter history with two thread counts. */
    const uint32_t T = pkvt_quick() ? 160 : 2500;
    const size_t qd = (size_t)nh * d, kd = (size_t)g * d;
    float *Q, *K, *V;
    random_qkv(&r, T, qd, kd, &Q, &K, &V);
    float *ref = pkvt_alloc(T * qd * 4), *got = pkvt_alloc(T * qd * 4);
    const uint32_t threads[] = {1, 2, 3, 7};
    const int n_threads = pkvt_quick() ? 2 : 4;
    const uint32_t step = T / 7; /* batch members: lengths T, T - step, ... */
    for (int dti = 0; dti < 3; dti++) {
        pkv_dtype dt = (pkv_dtype)dti;
        /* token by token on 1 thread: the reference of bitwise identity */
        pkv_engine *e1 = engine_threads(nh, g, d, bt, dt, 1);
        pkv_session *s1;
        pkv_session_create(e1, &s1);
        for (uint32_t t = 0; t < T; t++) {
            ck_assert_int_eq(pkv_append(s1, 0, K + t * kd, V + t * kd), PKV_OK);
            ck_assert_int_eq(pkv_decode(s1, 0, Q + t * qd, ref + t * qd), PKV_OK);
        }
        for (int ti = 0; ti < n_threads; ti++) {
            const uint32_t nt = threads[ti * (4 / n_threads)]; /* quick: 1 and 3 */
            pkv_engine *e = engine_threads(nh, g, d, bt, dt, nt);
            pkv_session *s;
            pkv_session_create(e, &s);
            /* prefill in random chunk sizes */
            for (uint32_t t = 0; t < T;) {
                uint32_t n = 1 + pkvt_below(&r, 300);
                if (n > T - t)
                    n = T - t;
                ck_assert_int_eq(pkv_prefill(s, 0, n, Q + t * qd, K + t * kd, V + t * kd,
                                             got + t * qd), PKV_OK);
                t += n;
            }
            ck_assert_msg(memcmp(got, ref, T * qd * 4) == 0,
                          "prefill with %u threads (%s) differs", nt,
                          pkv_dtype_name(dt));
            /* batch of sessions of different lengths vs single decodes */
            pkv_session *ss[5];
            for (int i = 0; i < 5; i++) {
                pkv_session_fork(s, &ss[i]);
                pkv_session_truncate(ss[i], T - (uint64_t)i * step);
            }
            float *bout = pkvt_alloc(5 * qd * 4), *sout = pkvt_alloc(5 * qd * 4);
            ck_assert_int_eq(pkv_decode_batch(e, 0, 5, ss, Q, bout), PKV_OK);
            for (int i = 0; i < 5; i++) {
                ck_assert_int_eq(pkv_decode(ss[i], 0, Q + i * qd, sout + i * qd), PKV_OK);
                /* and equal to the 1-thread token-by-token row at that length */
                pkv_decode(s1, 0, Q + i * qd, got); /* full length on e1 */
            }
            ck_assert_msg(memcmp(bout, sout, 5 * qd * 4) == 0, "batch != single (%u thr)", nt);
            ck_assert_int_eq(pkv_decode(ss[0], 0, Q, got), PKV_OK);
            float *one = pkvt_alloc(qd * 4);
            ck_assert_int_eq(pkv_decode(s1, 0, Q, one), PKV_OK);
            ck_assert_msg(memcmp(got, one, qd * 4) == 0, "%u threads != 1 thread", nt);
            free(one);
            free(bout);
            free(sout);
            for (int i = 0; i < 5; i++)
                pkv_session_destroy(ss[i]);
            pkv_session_destroy(s);
            pkv_engine_destroy(e);
        }
        pkv_session_destroy(s1);
        pkv_engine_destroy(e1);
    }
    free(Q); free(K); free(V); free(ref); free(got);
}
END_TEST

/* ---- model-based random walk ----------------------------------------------------------- */

START_TEST(model_based_walk)
{
    const uint64_t seed = pkvt_seed() + 5;
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    const uint32_t nh = 4, g = 2, d = 5, bt = 3, NS = 12, L = 2;
    const uint32_t gd = g * d;
    pkv_engine *e = pkvt_engine(L, nh, g, d, bt, PKV_BF16);
    pkv_session *s[12] = {0};
    hist h[12][2];
    memset(h, 0, sizeof h);
    float k[10], v[10], q[20];
    const int steps = pkvt_quick() ? 400 : 4000;
    for (int step = 0; step < steps; step++) {
        uint32_t i = pkvt_below(&r, NS), op = pkvt_below(&r, 10);
        if (!s[i]) {
            ck_assert_int_eq(pkv_session_create(e, &s[i]), PKV_OK);
        } else if (op < 5) { /* append to a random layer */
            uint32_t l = pkvt_below(&r, L);
            pkvt_fill(&r, k, gd, -1, 1);
            pkvt_fill(&r, v, gd, -1, 1);
            ck_assert_int_eq(pkv_append(s[i], l, k, v), PKV_OK);
            hist_push(&h[i][l], gd, k, v);
        } else if (op == 5) { /* fork into another slot */
            uint32_t j = pkvt_below(&r, NS);
            if (j != i) {
                pkv_session_destroy(s[j]);
                ck_assert_int_eq(pkv_session_fork(s[i], &s[j]), PKV_OK);
                for (uint32_t l = 0; l < L; l++)
                    hist_copy(&h[j][l], &h[i][l], gd);
            }
        } else if (op == 6) { /* truncate */
            uint64_t mx = h[i][0].len > h[i][1].len ? h[i][0].len : h[i][1].len;
            uint64_t n = pkvt_below(&r, (uint32_t)mx + 2);
            pkv_status st = pkv_session_truncate(s[i], n);
            ck_assert_int_eq(st, n > mx ? PKV_ERANGE : PKV_OK);
            if (st == PKV_OK)
                for (uint32_t l = 0; l < L; l++)
                    if (h[i][l].len > n)
                        hist_truncate(&h[i][l], n);
        } else if (op == 7) { /* destroy */
            pkv_session_destroy(s[i]);
            s[i] = NULL;
            for (uint32_t l = 0; l < L; l++)
                hist_truncate(&h[i][l], 0);
        } else { /* decode and compare */
            uint32_t l = pkvt_below(&r, L);
            pkvt_fill(&r, q, nh * d, -2, 2);
            if (h[i][l].len == 0) {
                ck_assert_int_eq(pkv_decode(s[i], l, q, q), PKV_ESTATE);
            } else {
                check_decode(s[i], l, &h[i][l], nh, g, d, PKV_BF16, q, "walk", seed);
            }
        }
        for (uint32_t x = 0; x < NS; x++)
            for (uint32_t l = 0; l < L && s[x]; l++)
                ck_assert_uint_eq(pkv_session_len(s[x], l), h[x][l].len);
        ck_assert_msg(pkvi_engine_check(e), "pool invariants broken at step %d (seed %#llx)",
                      step, (unsigned long long)seed);
    }
    for (uint32_t x = 0; x < NS; x++) {
        pkv_session_destroy(s[x]);
        for (uint32_t l = 0; l < L; l++)
            hist_free(&h[x][l]);
    }
    pkv_stats st;
    pkv_engine_stats(e, &st);
    ck_assert_uint_eq(st.pages_in_use, 0);
    pkv_engine_destroy(e);
}
END_TEST

/* ---- concurrency -------------------------------------------------------------------- */

typedef struct {
    pkv_engine *e;
    uint64_t seed;
    int failures;
} worker_arg;

static void *worker(void *p)
{
    worker_arg *w = p;
    pkvt_rng r;
    pkvt_rng_init(&r, w->seed);
    const uint32_t nh = 8, g = 4, d = 16;
    pkv_session *s[3];
    hist h[3] = {{0}};
    for (int i = 0; i < 3; i++)
        if (pkv_session_create(w->e, &s[i]) != PKV_OK)
            w->failures++;
    float k[64], v[64], q[128], out[128];
    double ref[128];
    for (int step = 0; step < 600; step++) {
        int i = (int)pkvt_below(&r, 3);
        pkvt_fill(&r, k, 64, -1, 1);
        pkvt_fill(&r, v, 64, -1, 1);
        pkvt_fill(&r, q, 128, -1, 1);
        if (pkv_append(s[i], 0, k, v) != PKV_OK)
            w->failures++;
        hist_push(&h[i], 64, k, v);
        if (step % 7 == 0) { /* fork/destroy churn touches shared pool state */
            pkv_session *f;
            if (pkv_session_fork(s[i], &f) == PKV_OK) {
                pkv_append(f, 0, k, v);
                pkv_session_destroy(f);
            }
        }
        if (pkv_decode(s[i], 0, q, out) != PKV_OK)
            w->failures++;
        pkvt_ref_decode(nh, g, d, 0, PKV_F32, h[i].len, q, h[i].K, h[i].V, ref);
        if (pkvt_maxdiff_fd(out, ref, 128) > 1e-5)
            w->failures++;
    }
    for (int i = 0; i < 3; i++) {
        pkv_session_destroy(s[i]);
        hist_free(&h[i]);
    }
    return NULL;
}

START_TEST(threads_drive_own_sessions)
{
    pkv_engine *e = pkvt_engine(1, 8, 4, 16, 7, PKV_F32);
    pthread_t t[4];
    worker_arg a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (worker_arg){e, pkvt_seed() + 100 + (uint64_t)i, 0};
        pthread_create(&t[i], NULL, worker, &a[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(t[i], NULL);
        ck_assert_msg(a[i].failures == 0, "thread %d: %d failures", i, a[i].failures);
    }
    ck_assert(pkvi_engine_check(e));
    pkv_stats st;
    pkv_engine_stats(e, &st);
    ck_assert_uint_eq(st.pages_in_use, 0);
    pkv_engine_destroy(e);
}
END_TEST

/* ---- budget, bad input ----------------------------------------------------------------- */

/* One layer, h = g = 2, d = 4, 2-token f32 pages of TINY_PB bytes, and a budget with
 * room for exactly `pages` pages (half a page to spare). */
#define TINY_PB (2ull * 2 * 2 * 4 * 4)
static pkv_engine *tiny_budget_engine(uint64_t pages)
{
    pkv_config c = pkvt_config(1, 2, 2, 4, 2, PKV_F32);
    c.mem_budget = pages * TINY_PB + TINY_PB / 2;
    return pkvt_engine_cfg(&c);
}

START_TEST(budget_is_exact_and_recoverable)
{
    pkv_engine *e = tiny_budget_engine(5);
    pkv_session *a, *b;
    pkv_session_create(e, &a);
    pkv_session_create(e, &b);
    float kv[8] = {1, 2, 3, 4, 5, 6, 7, 8}, q[8] = {1, 0, 0, 0, 0, 1, 0, 0}, o1[8], o2[8];
    for (int t = 0; t < 2; t++) /* 1 page */
        ck_assert_int_eq(pkv_append(a, 0, kv, kv), PKV_OK);
    for (int t = 0; t < 8; t++) /* 4 pages, a full block table: budget full */
        ck_assert_int_eq(pkv_append(b, 0, kv, kv), PKV_OK);
    pkv_memory before, after;
    pkv_session_memory(b, &before);
    ck_assert_int_eq(pkv_decode(b, 0, q, o1), PKV_OK);
    /* a 6th page, which would also grow b's table: every figure stays, overhead too */
    ck_assert_int_eq(pkv_append(b, 0, kv, kv), PKV_ENOMEM);
    pkv_session_memory(b, &after);
    ck_assert_mem_eq(&before, &after, sizeof before);
    ck_assert_uint_eq(pkv_session_len(b, 0), 8);
    ck_assert_int_eq(pkv_decode(b, 0, q, o2), PKV_OK);
    ck_assert_mem_eq(o1, o2, sizeof o1);
    pkv_session *f;                     /* a fork needs no page: fine */
    ck_assert_int_eq(pkv_session_fork(a, &f), PKV_OK);
    pkv_session_destroy(f);
    pkv_session_destroy(a);             /* frees a page: b can grow again */
    ck_assert_int_eq(pkv_append(b, 0, kv, kv), PKV_OK);
    ck_assert(pkvi_engine_check(e));
    pkv_stats st;
    pkv_engine_stats(e, &st);
    ck_assert_uint_le((st.pages_in_use + st.pages_free) * st.page_bytes, st.mem_budget);
    ck_assert_uint_eq(st.mem_budget, 5 * TINY_PB + TINY_PB / 2);
    pkv_session_destroy(b);
    pkv_engine_destroy(e);
}
END_TEST

/* A prefill that fails after its first append copied a shared tail page must give the
 * session its shared page back: the rollback restores sharing, not only the length. */
START_TEST(failed_prefill_keeps_the_shared_tail)
{
    const uint64_t pb = TINY_PB;
    pkv_engine *e = tiny_budget_engine(3);
    pkv_session *a, *f;
    pkv_session_create(e, &a);
    float kv[4][8], q[4][8], o[4][8], o1[8], o2[8];
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < 8; i++) {
            kv[t][i] = (float)(t * 8 + i) / 32.0f - 0.5f;
            q[t][i] = (float)((t * 5 + i * 3) % 7) / 7.0f;
        }
    for (int t = 0; t < 3; t++) /* 2 pages, the second holding 1 of 2 rows */
        ck_assert_int_eq(pkv_append(a, 0, kv[t], kv[t]), PKV_OK);
    ck_assert_int_eq(pkv_session_fork(a, &f), PKV_OK);
    pkv_memory before, after;
    pkv_stats st0, st1;
    pkv_session_memory(f, &before);
    pkv_engine_stats(e, &st0);
    ck_assert_uint_eq(before.bytes_shared, 2 * pb);
    ck_assert_int_eq(pkv_decode(f, 0, q[0], o1), PKV_OK);
    /* row 3 copies the shared tail (3 pages in use), row 4 needs a 4th page: ENOMEM */
    ck_assert_int_eq(pkv_prefill(f, 0, 2, q[0], kv[0], kv[0], o[0]), PKV_ENOMEM);
    pkv_session_memory(f, &after);
    pkv_engine_stats(e, &st1);
    ck_assert_mem_eq(&before, &after, sizeof before);
    ck_assert_uint_eq(st1.pages_in_use, st0.pages_in_use);
    ck_assert_uint_eq(pkv_session_len(f, 0), 3);
    ck_assert_int_eq(pkv_decode(f, 0, q[0], o2), PKV_OK);
    ck_assert_mem_eq(o1, o2, sizeof o1);
    ck_assert(pkvi_engine_check(e));
    /* and the session still grows: the next append copies the tail as it should */
    ck_assert_int_eq(pkv_append(f, 0, kv[3], kv[3]), PKV_OK);
    pkv_session_memory(f, &after);
    ck_assert_uint_eq(after.bytes_shared, pb);
    ck_assert(pkvi_engine_check(e));
    pkv_session_destroy(f);
    pkv_session_destroy(a);
    pkv_engine_destroy(e);
}
END_TEST

START_TEST(bad_input_changes_nothing)
{
    pkv_config c = pkv_config_default();
    pkv_engine *e = (pkv_engine *)0x1; /* a failed create leaves it as it was */
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL); /* zero geometry */
    ck_assert_ptr_eq(e, (pkv_engine *)0x1);
    ck_assert_int_eq(pkv_engine_create(NULL, &e), PKV_EINVAL);
    c.n_layers = 1;
    c.n_heads = 6;
    c.n_kv_heads = 4; /* h % g != 0 */
    c.head_dim = 8;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    c.n_kv_heads = 3;
    ck_assert_int_eq(pkv_engine_create(&c, NULL), PKV_EINVAL);
    c.kv_dtype = (pkv_dtype)7;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    c.kv_dtype = PKV_F32;
    c.scale = -1;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    c.scale = NAN;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    c.scale = 0;
    /* the engine's documented limits, each just past and at its bound */
    const pkv_config ok = c;
    const struct { uint32_t h, g, d, threads; pkv_status want; } lim[] = {
        {257, 1, 8, 1, PKV_EINVAL},     {256, 1, 8, 1, PKV_OK},     /* n_heads / n_kv_heads */
        {65537, 65537, 1, 1, PKV_EINVAL}, {65536, 65536, 1, 1, PKV_OK}, /* n_kv_heads */
        {1, 1, 4097, 1, PKV_EINVAL},    {1, 1, 4096, 1, PKV_OK},    /* head_dim */
        {1, 1, 8, 1025, PKV_EINVAL},    {1, 1, 8, 2, PKV_OK},       /* n_threads */
    };
    for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++) {
        c.n_heads = lim[i].h;
        c.n_kv_heads = lim[i].g;
        c.head_dim = lim[i].d;
        c.n_threads = lim[i].threads;
        c.block_tokens = 1;
        e = NULL;
        ck_assert_msg(pkv_engine_create(&c, &e) == lim[i].want, "limits row %zu", i);
        ck_assert(lim[i].want == PKV_OK ? e != NULL : e == NULL);
        pkv_engine_destroy(e);
    }
    c = ok;
    /* a budget is a ceiling, not a reservation: the largest one costs nothing up front
     * (the pool once sized its free-list array from it and failed here) */
    const uint64_t huge[] = {UINT64_MAX, UINT64_MAX / 2, 1ull << 40};
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        c.mem_budget = huge[i];
        e = NULL;
        ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_OK);
        pkv_session *hs = NULL;
        float row[3 * 8] = {0}, hq[6 * 8] = {0}, ho[6 * 8];
        ck_assert_int_eq(pkv_session_create(e, &hs), PKV_OK);
        for (int t = 0; t < 40; t++)
            ck_assert_int_eq(pkv_append(hs, 0, row, row), PKV_OK);
        ck_assert_int_eq(pkv_decode(hs, 0, hq, ho), PKV_OK);
        pkv_session_destroy(hs); /* its pages go to the pool's cache */
        ck_assert(pkvi_engine_check(e));
        pkv_engine_destroy(e);
    }
    c = ok;
    c.block_tokens = 0xffffffffu; /* page size overflow / absurd */
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    c.block_tokens = 4;
    c.mem_budget = 10; /* smaller than one page */
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    c.mem_budget = 0;
    c.spill_dir = "/nonexistent/dir/for/pagedkv";
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    c.spill_dir = NULL;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_OK);

    pkv_config back;
    ck_assert_int_eq(pkv_engine_config(e, &back), PKV_OK);
    ck_assert_uint_eq(back.block_tokens, 4);
    ck_assert(fabsf(back.scale - 1.0f / sqrtf(8.0f)) < 1e-7f);

    pkv_session *s = (pkv_session *)0x1;
    ck_assert_int_eq(pkv_session_create(NULL, &s), PKV_EINVAL);
    ck_assert_ptr_eq(s, (pkv_session *)0x1);
    ck_assert_int_eq(pkv_session_create(e, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_fork(NULL, &s), PKV_EINVAL);
    ck_assert_ptr_eq(s, (pkv_session *)0x1);
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    float k[24] = {0}, q[48] = {0}, o[48];
    ck_assert_int_eq(pkv_append(NULL, 0, k, k), PKV_EINVAL);
    ck_assert_int_eq(pkv_append(s, 1, k, k), PKV_EINVAL);
    ck_assert_int_eq(pkv_append(s, 0, NULL, k), PKV_EINVAL);
    ck_assert_int_eq(pkv_append(s, 0, k, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode(s, 0, q, o), PKV_ESTATE);
    ck_assert_int_eq(pkv_decode(s, 1, q, o), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode(NULL, 0, q, o), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode(s, 0, NULL, o), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode(s, 0, q, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_truncate(s, 1), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_truncate(NULL, 0), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_truncate(s, 0), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(NULL, 0), 0);
    ck_assert_uint_eq(pkv_session_len(s, 5), 0);
    ck_assert_int_eq(pkv_session_memory(NULL, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_engine_stats(NULL, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_prefill(s, 0, 0, q, k, k, o), PKV_EINVAL);
    ck_assert_int_eq(pkv_prefill(s, 3, 1, q, k, k, o), PKV_EINVAL);
    pkv_session *arr[2] = {s, s};
    ck_assert_int_eq(pkv_decode_batch(e, 0, 0, arr, q, o), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode_batch(NULL, 0, 1, arr, q, o), PKV_EINVAL);
    ck_assert_int_eq(pkv_append(s, 0, k, k), PKV_OK);
    ck_assert_int_eq(pkv_decode_batch(e, 0, 2, arr, q, o), PKV_EINVAL); /* duplicates */
    ck_assert_int_eq(pkv_decode_batch(e, 1, 1, arr, q, o), PKV_EINVAL);
    ck_assert_uint_eq(pkv_session_len(s, 0), 1);
    ck_assert_ptr_nonnull(pkv_status_str((pkv_status)99));
    ck_assert_str_eq(pkv_version(), "0.4.0");
    pkv_session_destroy(NULL);
    pkv_engine_destroy(NULL);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
}
END_TEST

/* The order in which the pool's tasks name a layer's chunks: a permutation (so every
 * chunk is walked exactly once, whatever the thread count), the plain order for one
 * thread, and for R threads R regions of consecutive chunks, each visited front to
 * back, with consecutive tasks in different regions. */
START_TEST(chunk_order_is_a_rotation_over_regions)
{
    for (uint32_t C = 1; C <= PKVI_MAX_CHUNKS; C++)
        for (uint32_t R = 1; R <= 9; R++) {
            bool seen[PKVI_MAX_CHUNKS] = {false};
            uint32_t last_in_region[PKVI_MAX_CHUNKS + 1];
            const uint32_t q = (C + (R < C ? R : C) - 1) / (R < C ? R : C);
            for (uint32_t r = 0; r <= PKVI_MAX_CHUNKS; r++)
                last_in_region[r] = UINT32_MAX;
            uint32_t prev = UINT32_MAX;
            for (uint32_t t = 0; t < C; t++) {
                const uint32_t c = pkvi_chunk_order(t, C, R);
                ck_assert_msg(c < C && !seen[c], "C %u R %u: task %u -> chunk %u", C, R, t, c);
                seen[c] = true;
                if (R == 1)
                    ck_assert_uint_eq(c, t);
                const uint32_t r = c / q; /* regions are runs of q chunks */
                ck_assert_msg(last_in_region[r] == UINT32_MAX || last_in_region[r] + 1 == c,
                              "C %u R %u: region %u visited out of order", C, R, r);
                last_in_region[r] = c;
                if (R > 1 && C > 1 && prev != UINT32_MAX)
                    ck_assert_msg(prev / q != r, "C %u R %u: tasks %u, %u in one region", C,
                                  R, t - 1, t);
                prev = c;
            }
        }
}
END_TEST

/* A session twice in one batch would have both slots fold into its one scratch area:
 * refused at every batch size, the pairwise check of small batches and the sorted one
 * of large batches alike (before, batches over 4096 were not checked at all). */
START_TEST(batch_refuses_a_session_twice_at_any_size)
{
    enum { N = 4097, H = 2, D = 3 };
    pkv_engine *e = pkvt_engine(1, H, 1, D, 4, PKV_F32);
    pkv_session **ss = pkvt_alloc(N * sizeof *ss);
    float *q = pkvt_alloc((size_t)N * H * D * sizeof(float));
    float *o = pkvt_alloc((size_t)N * H * D * sizeof(float));
    float kv[D], one[H * D];
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    pkvt_fill(&r, q, (size_t)N * H * D, -1, 1);
    for (uint32_t i = 0; i < N; i++) {
        ck_assert_int_eq(pkv_session_create(e, &ss[i]), PKV_OK);
        for (uint32_t t = 0; t <= i % 3; t++) {
            pkvt_fill(&r, kv, D, -1, 1);
            ck_assert_int_eq(pkv_append(ss[i], 0, kv, kv), PKV_OK);
        }
    }
    ck_assert_int_eq(pkv_decode_batch(e, 0, N, ss, q, o), PKV_OK);
    for (uint32_t i = 0; i < N; i += 97) {
        ck_assert_int_eq(pkv_decode(ss[i], 0, q + (size_t)i * H * D, one), PKV_OK);
        ck_assert_mem_eq(one, o + (size_t)i * H * D, sizeof one);
    }
    static const uint32_t dup[][2] = {{0, 1}, {5, 63}, {63, 64}, {0, N - 1}, {2000, 4096}};
    for (size_t k = 0; k < sizeof dup / sizeof dup[0]; k++) {
        pkv_session *keep = ss[dup[k][1]];
        ss[dup[k][1]] = ss[dup[k][0]];
        ck_assert_msg(pkv_decode_batch(e, 0, N, ss, q, o) == PKV_EINVAL,
                      "slots %u and %u hold one session, batch of %u", dup[k][0], dup[k][1], N);
        ck_assert_msg(pkv_decode_batch(e, 0, dup[k][1] + 1, ss, q, o) == PKV_EINVAL,
                      "slots %u and %u hold one session, batch of %u", dup[k][0], dup[k][1],
                      dup[k][1] + 1);
        ss[dup[k][1]] = keep;
    }
    for (uint32_t i = 0; i < N; i++)
        pkv_session_destroy(ss[i]);
    free(ss);
    free(q);
    free(o);
    pkv_engine_destroy(e);
}
END_TEST

/* ---- real memory ------------------------------------------------------------------- */

static uint64_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long size = 0, res = 0;
    if (f) {
        if (fscanf(f, "%lu %lu", &size, &res) != 2)
            res = 0;
        fclose(f);
    }
    return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* The process's resident memory follows bytes_resident: growing a 192 MiB cache grows
 * RSS by about that much, and eight forks of it grow RSS by almost nothing. */
START_TEST(rss_follows_the_figures)
{
    /* main() adds this case only where RSS means what it says (pkvt_need_unmet) */
    ck_assert_msg(pkvt_need_unmet("rss") == NULL, "rss: %s", pkvt_need_unmet("rss"));
    const uint32_t g = 8, d = 128, T = 24576; /* f32: 8 KiB per token -> 192 MiB */
    pkv_engine *e = pkvt_engine(1, 32, g, d, 16, PKV_F32);
    pkv_session *s;
    pkv_session_create(e, &s);
    float *kv = pkvt_alloc(g * d * sizeof(float));
    for (uint32_t i = 0; i < g * d; i++)
        kv[i] = 1.0f + (float)i;
    uint64_t r0 = rss_bytes();
    for (uint32_t t = 0; t < T; t++)
        ck_assert_int_eq(pkv_append(s, 0, kv, kv), PKV_OK);
    uint64_t r1 = rss_bytes();
    pkv_memory m;
    pkv_session_memory(s, &m);
    double grow = (double)(r1 - r0), want = (double)m.bytes_resident;
    ck_assert_msg(grow > 0.9 * want && grow < 1.1 * want + (8 << 20),
                  "RSS grew %.0f for %.0f resident bytes", grow, want);
    pkv_session *f[8];
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(pkv_session_fork(s, &f[i]), PKV_OK);
    uint64_t r2 = rss_bytes();
    ck_assert_msg((double)(r2 - r1) < 0.02 * want, "8 forks grew RSS by %llu",
                  (unsigned long long)(r2 - r1));
    for (int i = 0; i < 8; i++)
        pkv_session_destroy(f[i]);
    pkv_session_destroy(s);
    free(kv);
    pkv_engine_destroy(e);
}
END_TEST

/* pkv_config_explain: the status pkv_engine_create gives, with the reason named. */
START_TEST(config_explain_names_the_reason)
{
    pkv_config c = pkv_config_default();
    char why[256];
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "must be > 0"));
    c.n_layers = 2;
    c.n_heads = 8;
    c.n_kv_heads = 2;
    c.head_dim = 5000;
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
    ck_assert_str_eq(why, "head_dim 5000 exceeds the engine limit 4096");
    pkv_engine *e = NULL;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL); /* the same verdict */
    c.head_dim = 64;
    c.n_kv_heads = 3;
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
    ck_assert_str_eq(why, "n_heads 8 is not a multiple of n_kv_heads 3");
    c.n_kv_heads = 2;
    c.n_threads = 100000;
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "n_threads 100000"));
    c.n_threads = 1;
    c.block_tokens = 99999999;
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "1 GiB"));
    c.block_tokens = 16;
    c.spill_dir = "/nonexistent/pkv";
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "/nonexistent/pkv"));
    c.spill_dir = NULL;
    char tiny[8];
    c.mem_budget = 1;
    ck_assert_int_eq(pkv_config_explain(&c, tiny, sizeof tiny), PKV_EINVAL);
    ck_assert_uint_eq(strlen(tiny), sizeof tiny - 1); /* cut, terminated */
    c.mem_budget = 0;
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_OK);
    ck_assert_str_eq(why, "");
    ck_assert_int_eq(pkv_config_explain(&c, NULL, 0), PKV_OK);
    ck_assert_int_eq(pkv_config_explain(NULL, why, sizeof why), PKV_EINVAL);
    /* the forced kernels: a name this host cannot run, or no ISA at all */
    const char *old = getenv("PKV_FORCE_ISA");
    char *saved = old ? strdup(old) : NULL;
    setenv("PKV_FORCE_ISA", "avx9", 1);
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "PKV_FORCE_ISA=avx9"));
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    setenv("PKV_FORCE_ISA", "scalar", 1);
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_OK);
    /* where the kernels' prefetches go: l1 or l2, nothing else */
    const char *old_pf = getenv("PKV_PREFETCH");
    char *saved_pf = old_pf ? strdup(old_pf) : NULL;
    setenv("PKV_PREFETCH", "L2", 1);
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "PKV_PREFETCH=L2"));
    setenv("PKV_PREFETCH", "l2", 1);
    ck_assert_int_eq(pkv_config_explain(&c, why, sizeof why), PKV_OK);
    if (saved_pf) {
        setenv("PKV_PREFETCH", saved_pf, 1);
        free(saved_pf);
    } else {
        unsetenv("PKV_PREFETCH");
    }
    if (saved) {
        setenv("PKV_FORCE_ISA", saved, 1);
        free(saved);
    } else {
        unsetenv("PKV_FORCE_ISA");
    }
}
END_TEST

/* pkv_engine_last_error: the reason of the latest failure, named. */
START_TEST(last_error_names_the_failure)
{
    pkv_engine *e = pkvt_engine(2, 4, 2, 8, 4, PKV_F32);
    char why[256];
    ck_assert_int_eq(pkv_engine_last_error(e, why, sizeof why), PKV_OK);
    ck_assert_str_eq(why, "");
    pkv_session *s;
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    float kv[16] = {0}, q[32] = {0}, out[32];
    ck_assert_int_eq(pkv_append(s, 7, kv, kv), PKV_EINVAL);
    pkv_engine_last_error(e, why, sizeof why);
    ck_assert_str_eq(why, "pkv_append: layer 7, but the engine has 2");
    ck_assert_int_eq(pkv_decode(s, 1, q, out), PKV_ESTATE);
    pkv_engine_last_error(e, why, sizeof why);
    ck_assert_str_eq(why, "pkv_decode: layer 1 is empty");
    ck_assert_int_eq(pkv_append(s, 0, kv, kv), PKV_OK); /* success keeps the last reason */
    pkv_engine_last_error(e, why, sizeof why);
    ck_assert_str_eq(why, "pkv_decode: layer 1 is empty");
    ck_assert_int_eq(pkv_session_truncate(s, 9), PKV_ERANGE);
    pkv_engine_last_error(e, why, sizeof why);
    ck_assert_ptr_nonnull(strstr(why, "the longest holds 1"));
    pkv_session *x = NULL;
    ck_assert_int_eq(pkv_session_load(e, "/nonexistent/file.pkv", &x), PKV_EIO);
    pkv_engine_last_error(e, why, sizeof why);
    ck_assert_ptr_nonnull(strstr(why, "pkv_session_load: /nonexistent/file.pkv"));
    char tiny[5];
    ck_assert_int_eq(pkv_engine_last_error(e, tiny, sizeof tiny), PKV_OK);
    ck_assert_str_eq(tiny, "pkv_");
    ck_assert_int_eq(pkv_engine_last_error(e, tiny, 0), PKV_EINVAL);
    ck_assert_int_eq(pkv_engine_last_error(NULL, tiny, sizeof tiny), PKV_EINVAL);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    /* the budget names itself */
    pkv_config c = pkv_config_default();
    c.n_layers = 1;
    c.n_heads = c.n_kv_heads = 1;
    c.head_dim = 4;
    c.block_tokens = 1;
    c.mem_budget = 2 * 2 * 4 * 4;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_OK);
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    ck_assert_int_eq(pkv_append(s, 0, kv, kv), PKV_OK);
    ck_assert_int_eq(pkv_append(s, 0, kv, kv), PKV_OK);
    ck_assert_int_eq(pkv_append(s, 0, kv, kv), PKV_ENOMEM);
    pkv_engine_last_error(e, why, sizeof why);
    ck_assert_str_eq(why, "pkv_append: layer 0: 1 more page(s) do not fit the budget of 2 "
                          "pages (no spill_dir)");
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("session");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, config_explain_names_the_reason);
    tcase_add_test(tc, last_error_names_the_failure);
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, incremental_equals_causal);
    tcase_add_test(tc, decode_rows_match_public_oracle);
    tcase_add_test(tc, forks_share_and_copy_only_the_tail);
    tcase_add_test(tc, truncate_into_shared_page_copies);
    tcase_add_test(tc, prefill_batch_threads_bitwise);
    tcase_add_test(tc, failed_prefill_keeps_the_shared_tail);
    tcase_add_test(tc, prefill_geometries_bitwise);
    tcase_add_test(tc, model_based_walk);
    tcase_add_test(tc, threads_drive_own_sessions);
    tcase_add_test(tc, budget_is_exact_and_recoverable);
    tcase_add_test(tc, bad_input_changes_nothing);
    tcase_add_test(tc, batch_refuses_a_session_twice_at_any_size);
    tcase_add_test(tc, chunk_order_is_a_rotation_over_regions);
    suite_add_tcase(s, tc);
    /* Its own case (meson: session-rss, PKV_TEST_NEEDS=rss, a SKIP where a sanitizer's
     * shadow or valgrind makes RSS meaningless); left out of a whole-suite run there. */
    const char *no_rss = pkvt_need_unmet("rss");
    if (no_rss == NULL) {
        TCase *tr = tcase_create("rss");
        tcase_set_timeout(tr, 300);
        tcase_add_test(tr, rss_follows_the_figures);
        suite_add_tcase(s, tr);
    } else {
        fprintf(stderr, "test_session: rss case left out: %s\n", no_rss);
    }
    return pkvt_run(s);
}

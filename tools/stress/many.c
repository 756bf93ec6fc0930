/*
 * stress/many.c - `pagedkv stress --verify K` and `--shared N` (docs/speculative.md):
 * at each decode point, the calls where one page read serves many queries, timed on
 * layer 0 of session 0 against the calls they replace - a pkv_verify of a chain of K
 * drafts (dropped again by pkv_session_commit(0)) against K pkv_decode calls, and one
 * pkv_decode_batch of N forks of the session against N pkv_decode calls. The rooflines
 * of those calls are `pagedkv bench --verify/--shared`'s, which measures the machine's
 * bandwidth and FMA peak; stress gives the time against context.
 *
 * Owns the two measurements; leaves the session as it found it (the drafts dropped,
 * the forks destroyed), so the memory checks of the point see what they would without.
 * Uses the public header only.
 */
#include <math.h>
#include <stdlib.h>

#include "common/cli.h"
#include "stress/stress.h"

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, uint32_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* K rows of width w from the stress run's random block, from row t on. */
static const float *rows_at(const stress_run *r, const float *base, size_t w, uint32_t K,
                            uint64_t t)
{
    return base + (size_t)(t % (r->rows - K + 1)) * w;
}

static pkv_status verify_point(stress_run *r, uint64_t n, float *out, double *a, double *b,
                               stress_point *pt)
{
    const stress_opts *o = &r->o;
    const uint32_t K = o->verify;
    const size_t hd = (size_t)o->heads * o->head_dim;
    const size_t gd = (size_t)o->kv_heads * o->head_dim, gdv = (size_t)o->kv_heads * r->dv;
    int32_t parent[STRESS_MANY_MAX];
    for (uint32_t i = 0; i < K; i++)
        parent[i] = (int32_t)i - 1;
    pkv_session *s = r->sess[0];
    const float *q = rows_at(r, r->Q, hd, K, n), *k = rows_at(r, r->K, gd, K, n + 1);
    const float *v = rows_at(r, r->V, gdv, K, n + 2);
    pkv_status st = PKV_OK;
    for (uint32_t rep = 0; rep < o->reps && st == PKV_OK; rep++) {
        double t0 = cli_now();
        st = pkv_verify(s, 0, K, parent, q, k, v, out);
        a[rep] = cli_now() - t0;
        if (st == PKV_OK)
            st = pkv_session_commit(s, 0, NULL);
        t0 = cli_now();
        for (uint32_t i = 0; i < K && st == PKV_OK; i++)
            st = pkv_decode(s, 0, q + i * hd, out);
        b[rep] = cli_now() - t0;
    }
    if (st == PKV_OK) {
        pt->verify_us = median(a, o->reps) * 1e6;
        pt->k_decodes_us = median(b, o->reps) * 1e6;
    }
    return st;
}

static pkv_status shared_point(stress_run *r, uint64_t n, float *out, double *a, double *b,
                               stress_point *pt)
{
    const stress_opts *o = &r->o;
    const uint32_t N = o->shared;
    const size_t hd = (size_t)o->heads * o->head_dim, hdv = (size_t)o->heads * r->dv;
    pkv_session *f[STRESS_MANY_MAX] = {NULL};
    pkv_status st = PKV_OK;
    uint32_t made = 0;
    for (; made < N && st == PKV_OK; made++)
        if ((st = pkv_session_fork(r->sess[0], &f[made])) != PKV_OK)
            break;
    const float *q = rows_at(r, r->Q, hd, N, n + 3);
    for (uint32_t rep = 0; rep < o->reps && st == PKV_OK; rep++) {
        double t0 = cli_now();
        st = pkv_decode_batch(r->eng, 0, N, f, q, out);
        a[rep] = cli_now() - t0;
        t0 = cli_now();
        for (uint32_t i = 0; i < N && st == PKV_OK; i++)
            st = pkv_decode(f[i], 0, q + i * hd, out + i * hdv);
        b[rep] = cli_now() - t0;
    }
    for (uint32_t i = 0; i < made; i++)
        pkv_session_destroy(f[i]);
    if (st == PKV_OK) {
        pt->shared_us = median(a, o->reps) * 1e6;
        pt->separate_us = median(b, o->reps) * 1e6;
    }
    return st;
}

pkv_status stress_many_point(stress_run *r, uint64_t n, stress_point *pt)
{
    const stress_opts *o = &r->o;
    pt->verify_us = pt->k_decodes_us = pt->shared_us = pt->separate_us = NAN;
    if (!o->verify && !o->shared)
        return PKV_OK;
    const uint32_t m = o->verify > o->shared ? o->verify : o->shared;
    float *out = malloc((size_t)m * o->heads * r->dv * sizeof(float));
    double *a = malloc(2 * (size_t)o->reps * sizeof(double));
    pkv_status st = out && a ? PKV_OK : PKV_ENOMEM;
    if (st == PKV_OK && o->verify)
        st = verify_point(r, n, out, a, a + o->reps, pt);
    if (st == PKV_OK && o->shared)
        st = shared_point(r, n, out, a, a + o->reps, pt);
    free(out);
    free(a);
    return st;
}

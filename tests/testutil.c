/* testutil.c - see testutil.h. */
#include "testutil.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io_backend.h"

uint64_t pkvt_seed(void)
{
    const char *s = getenv("PKV_TEST_SEED");
    if (s && *s)
        return strtoull(s, NULL, 0);
    return 0x9e3779b97f4a7c15ull;
}

bool pkvt_quick(void)
{
    const char *s = getenv("PKV_TEST_QUICK");
    return s && *s == '1';
}

void pkvt_rng_init(pkvt_rng *r, uint64_t seed)
{
    r->s = seed ? seed : 0x2545f4914f6cdd1dull;
}

uint64_t pkvt_next(pkvt_rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545f4914f6cdd1dull;
}

uint32_t pkvt_below(pkvt_rng *r, uint32_t n)
{
    return n ? (uint32_t)((pkvt_next(r) >> 32) % n) : 0;
}

float pkvt_uniform(pkvt_rng *r, float lo, float hi)
{
    double u = (double)(pkvt_next(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(lo + (hi - lo) * u);
}

void pkvt_fill(pkvt_rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = pkvt_uniform(r, lo, hi);
}

void *pkvt_alloc(size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    ck_assert_msg(p != NULL, "out of memory allocating %zu bytes", bytes);
    return p;
}

void pkvt_ref_decode(uint32_t h, uint32_t g, uint32_t d, float scale, pkv_dtype dt,
                     uint64_t n_pos, const float *q, const float *K, const float *V,
                     double *out)
{
    uint32_t hg = h / g;
    double sc = scale > 0 ? (double)scale : 1.0 / sqrt((double)d);
    double *w = pkvt_alloc(n_pos * sizeof(double));
    for (uint32_t i = 0; i < h; i++) {
        uint32_t grp = i / hg;
        const float *qi = q + (size_t)i * d;
        double mx = -INFINITY;
        for (uint64_t j = 0; j < n_pos; j++) {
            const float *kj = K + ((size_t)j * g + grp) * d;
            double s = 0;
            for (uint32_t c = 0; c < d; c++)
                s += (double)qi[c] * (double)pkv_dtype_round(dt, kj[c]);
            w[j] = s * sc;
            if (w[j] > mx)
                mx = w[j];
        }
        double sum = 0;
        for (uint64_t j = 0; j < n_pos; j++) {
            w[j] = exp(w[j] - mx);
            sum += w[j];
        }
        double *o = out + (size_t)i * d;
        for (uint32_t c = 0; c < d; c++)
            o[c] = 0;
        for (uint64_t j = 0; j < n_pos; j++) {
            const float *vj = V + ((size_t)j * g + grp) * d;
            for (uint32_t c = 0; c < d; c++)
                o[c] += w[j] / sum * (double)pkv_dtype_round(dt, vj[c]);
        }
    }
    free(w);
}

float pkvt_maxabs(const float *x, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++)
        if (fabsf(x[i]) > m)
            m = fabsf(x[i]);
    return m;
}

double pkvt_maxdiff_fd(const float *a, const double *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double df = fabs((double)a[i] - b[i]);
        if (!(df <= m)) /* NaN propagates as "infinitely wrong" */
            m = isnan(df) ? INFINITY : df;
    }
    return m;
}

pkv_engine *pkvt_engine(uint32_t layers, uint32_t h, uint32_t g, uint32_t d, uint32_t bt,
                        pkv_dtype dt)
{
    pkv_config c = pkv_config_default();
    c.n_layers = layers;
    c.n_heads = h;
    c.n_kv_heads = g;
    c.head_dim = d;
    c.block_tokens = bt;
    c.kv_dtype = dt;
    pkv_engine *e = NULL;
    pkv_status st = pkv_engine_create(&c, &e);
    ck_assert_msg(st == PKV_OK, "engine_create(L=%u h=%u g=%u d=%u bt=%u dt=%d): %s",
                  layers, h, g, d, bt, (int)dt, pkv_status_str(st));
    return e;
}

int pkvt_run(Suite *s)
{
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

const char *pkvt_uring_skip_reason(void)
{
    const char *no = getenv("PKV_NO_URING");
    if (no != NULL && strcmp(no, "1") == 0)
        return "PKV_NO_URING=1 is set";
    int probe = pkvi_uring_probe();
    if (probe != 0)
        return probe == -ENOSYS ? "built without liburing" : strerror(-probe);
    return NULL;
}

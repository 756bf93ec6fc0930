/*
 * grid_hash.c - a hash of every output of one build over a grid of decode shapes, per
 * (kernel table, dtype, path): for checking that a change to the kernels keeps their
 * bits. A tool (built with -Dbench=true, never run as a test). Public header only: the
 * library is loaded by path (dlopen), so two builds are compared by running this twice
 * and diffing the output.
 *   grid_hash LIB [tables=scalar,avx2,avx2vnni,avx512,avx512vnni] [long=2100]
 * For each table (PKV_FORCE_ISA, read at engine creation; a table the host or the build
 * lacks prints "unavailable"), dtype f32, f16, bf16, q8, q4 and, for q8 and q4, both
 * quant_dot paths: head_dim 1, 3, 17, 32, 64, 80, 128, 256 with head_dim_v equal and
 * different; block_tokens 1, 2, 16, 64; group sizes 1..8 (cycled over the shapes);
 * lengths 1, bt - 1, bt + 1 and, once per head_dim, `long` positions. Two layers: the
 * first full causal, the second with a window, sinks, a soft-cap or sink logits (cycled).
 * Each shape runs pkv_prefill over all its positions, token-by-token append + pkv_decode
 * (every position up to 130, the last three beyond), and one pkv_decode_batch of both
 * sessions; every output float goes into one FNV-1a hash per row. K, V and q come from
 * a seeded generator, the same for every build.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "pagedkv.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    pkv_config (*config_default)(void);
    pkv_status (*engine_create)(const pkv_config *, pkv_engine **);
    void (*engine_destroy)(pkv_engine *);
    pkv_status (*session_create)(pkv_engine *, pkv_session **);
    void (*session_destroy)(pkv_session *);
    pkv_status (*append)(pkv_session *, uint32_t, const float *, const float *);
    pkv_status (*decode)(pkv_session *, uint32_t, const float *, float *);
    pkv_status (*prefill)(pkv_session *, uint32_t, uint32_t, const float *, const float *,
                          const float *, float *);
    pkv_status (*batch)(pkv_engine *, uint32_t, uint32_t, pkv_session *const *, const float *,
                        float *);
} api;

static int load(const char *path, api *a)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "grid_hash: %s\n", dlerror());
        return -1;
    }
    void *p[9];
    static const char *const names[9] = {
        "pkv_config_default", "pkv_engine_create", "pkv_engine_destroy",
        "pkv_session_create", "pkv_session_destroy", "pkv_append", "pkv_decode",
        "pkv_prefill", "pkv_decode_batch"};
    for (int i = 0; i < 9; i++)
        if (!(p[i] = dlsym(h, names[i]))) {
            fprintf(stderr, "grid_hash: %s lacks %s\n", path, names[i]);
            return -1;
        }
    /* POSIX: a dlsym result converts to a function pointer; memcpy says so without a
     * cast ISO C leaves undefined */
    memcpy(&a->config_default, &p[0], sizeof p[0]);
    memcpy(&a->engine_create, &p[1], sizeof p[1]);
    memcpy(&a->engine_destroy, &p[2], sizeof p[2]);
    memcpy(&a->session_create, &p[3], sizeof p[3]);
    memcpy(&a->session_destroy, &p[4], sizeof p[4]);
    memcpy(&a->append, &p[5], sizeof p[5]);
    memcpy(&a->decode, &p[6], sizeof p[6]);
    memcpy(&a->prefill, &p[7], sizeof p[7]);
    memcpy(&a->batch, &p[8], sizeof p[8]);
    return 0;
}

static uint64_t rng_state;
static float frand(float lo, float hi)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return lo + (hi - lo) * (float)((rng_state >> 40) / (double)(1ull << 24));
}

static void fill(float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = frand(lo, hi);
}

static uint64_t fnv(uint64_t h, const float *x, size_t n)
{
    const unsigned char *b = (const unsigned char *)x;
    for (size_t i = 0; i < n * sizeof(float); i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

typedef struct {
    uint32_t d, dv, hg, bt, len, variant;
} shape;

/* One shape on one table, dtype and path: its outputs folded into *h. 0, or -1 when the
 * engine cannot be made (the table is unavailable). */
static int run_shape(const api *a, pkv_dtype dt, uint32_t qd, const shape *sh, uint64_t *h)
{
    const uint32_t g = 2, nh = sh->hg * g, L = sh->len;
    float sinks[16];
    for (uint32_t i = 0; i < nh; i++)
        sinks[i] = (float)i * 0.37f - 1.0f;
    pkv_layer_config lc[2];
    memset(lc, 0, sizeof lc);
    switch (sh->variant % 4) {
    case 0:
        lc[1].softcap = 30.0f;
        break;
    case 1:
        lc[1].window = 37;
        lc[1].sink_tokens = 4;
        break;
    case 2:
        lc[1].sink_logits = sinks;
        break;
    default:
        lc[1].window = 21;
        lc[1].sink_tokens = 2;
        lc[1].softcap = 2.5f;
        lc[1].sink_logits = sinks;
        break;
    }
    pkv_config c = a->config_default();
    c.n_layers = 2;
    c.n_heads = nh;
    c.n_kv_heads = g;
    c.head_dim = sh->d;
    c.head_dim_v = sh->dv;
    c.block_tokens = sh->bt;
    c.kv_dtype = dt;
    c.quant_dot = qd;
    c.n_threads = 1;
    c.layer_cfg = lc;
    pkv_engine *e;
    if (a->engine_create(&c, &e) != PKV_OK)
        return -1;
    const size_t kd = (size_t)g * sh->d, vd = (size_t)g * sh->dv, qn = (size_t)nh * sh->d,
                 on = (size_t)nh * sh->dv;
    float *K = malloc(L * kd * sizeof *K), *V = malloc(L * vd * sizeof *V);
    float *Q = malloc((L + 1) * qn * sizeof *Q), *out = malloc((L + 1) * on * sizeof *out);
    pkv_session *sp, *sd;
    if (!K || !V || !Q || !out || a->session_create(e, &sp) != PKV_OK ||
        a->session_create(e, &sd) != PKV_OK) {
        fprintf(stderr, "grid_hash: out of memory\n");
        exit(1);
    }
    for (uint32_t layer = 0; layer < 2; layer++) {
        fill(K, L * kd, -2.0f, 2.0f);
        fill(V, L * vd, -1.0f, 1.0f);
        fill(Q, (L + 1) * qn, -1.0f, 1.0f);
        if (a->prefill(sp, layer, L, Q, K, V, out) != PKV_OK)
            goto fail;
        *h = fnv(*h, out, L * on);
        for (uint32_t t = 0; t < L; t++) {
            if (a->append(sd, layer, K + t * kd, V + t * vd) != PKV_OK)
                goto fail;
            if (t < 130 || t + 3 >= L) {
                if (a->decode(sd, layer, Q + t * qn, out) != PKV_OK)
                    goto fail;
                *h = fnv(*h, out, on);
            }
        }
        pkv_session *both[2] = {sp, sd};
        float q2[2 * 16 * 256];
        memcpy(q2, Q + L * qn, qn * sizeof(float));
        memcpy(q2 + qn, Q, qn * sizeof(float));
        if (a->batch(e, layer, 2, both, q2, out) != PKV_OK)
            goto fail;
        *h = fnv(*h, out, 2 * on);
    }
    a->session_destroy(sp);
    a->session_destroy(sd);
    a->engine_destroy(e);
    free(K);
    free(V);
    free(Q);
    free(out);
    return 0;
fail:
    fprintf(stderr, "grid_hash: a call failed (d %u dv %u hg %u bt %u len %u)\n", sh->d,
            sh->dv, sh->hg, sh->bt, L);
    exit(1);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: grid_hash LIB [tables] [long]\n");
        return 2;
    }
    api a;
    if (load(argv[1], &a))
        return 1;
    char tables[256];
    snprintf(tables, sizeof tables, "%s",
             argc > 2 ? argv[2] : "scalar,avx2,avx2vnni,avx512,avx512vnni");
    const uint32_t long_len = argc > 3 ? (uint32_t)strtoul(argv[3], NULL, 10) : 2100;
    static const uint32_t ds[] = {1, 3, 17, 32, 64, 80, 128, 256};
    static const uint32_t bts[] = {1, 2, 16, 64};
    static const struct { const char *name; pkv_dtype t; uint32_t qd; } paths[] = {
        {"f32", PKV_F32, 0}, {"f16", PKV_F16, 0}, {"bf16", PKV_BF16, 0}, {"q8", PKV_Q8, 0},
        {"q4", PKV_Q4, 0},   {"q8i", PKV_Q8, 1},  {"q4i", PKV_Q4, 1}};
    /* the shapes: every (d, dv, bt) with lengths 1, bt - 1, bt + 1, hg and the layer
     * variant cycling; and one long shape per d */
    shape sh[8 * 2 * 4 * 3 + 8];
    size_t ns = 0;
    uint32_t k = 0;
    for (size_t di = 0; di < 8; di++) {
        const uint32_t d = ds[di];
        for (int alt = 0; alt < 2; alt++) {
            const uint32_t dv = alt ? (d == 256 ? 128 : d == 128 ? 64 : d + 7) : d;
            for (size_t bi = 0; bi < 4; bi++) {
                const uint32_t bt = bts[bi], lens[3] = {1, bt - 1, bt + 1};
                for (int li = 0; li < 3; li++, k++)
                    if (lens[li] > 0)
                        sh[ns++] = (shape){d, dv, 1 + k % 8, bt, lens[li], k};
            }
        }
        sh[ns++] = (shape){d, d, 1 + di % 8, 16, long_len, (uint32_t)di};
    }
    for (char *save = NULL, *isa = strtok_r(tables, ",", &save); isa;
         isa = strtok_r(NULL, ",", &save)) {
        setenv("PKV_FORCE_ISA", isa, 1);
        for (size_t pi = 0; pi < sizeof paths / sizeof paths[0]; pi++) {
            uint64_t h = 0xcbf29ce484222325ull;
            rng_state = 0x9e3779b97f4a7c15ull;
            int ok = 0;
            for (size_t i = 0; i < ns && ok == 0; i++)
                ok = run_shape(&a, paths[pi].t, paths[pi].qd, &sh[i], &h);
            if (ok)
                printf("%-10s %-4s unavailable\n", isa, paths[pi].name);
            else
                printf("%-10s %-4s %016" PRIx64 "\n", isa, paths[pi].name, h);
            fflush(stdout);
        }
    }
    return 0;
}

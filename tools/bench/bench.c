/*
 * bench/bench.c - `pagedkv bench`: decode throughput in GB/s of K/V streamed, next to
 * the DRAM read bandwidth, a naive implementation and the library's own scalar
 * reference, all measured in the same run (docs/performance.md; docs/tools.md); plus prefill
 * tokens/s next to a peak FMA rate measured in the same run.
 *
 * Owns: the measurement loops and the progress lines (the options are
 * bench/options.c's); the probes they time against (DRAM
 * bandwidth, peak FMA, the naive decode) are bench/probe.c's, the table and the JSON
 * bench/report.c's (the results in between: bench.h). Uses only the public API;
 * the scalar reference is reached the public way, PKV_FORCE_ISA=scalar set around
 * pkv_engine_create.
 *
 * Method (each figure is a median over --reps rounds):
 *   - K/V bytes of one decode: 2 * g * ctx * pkv_row_bytes(dtype, d) (one layer; for
 *     f32/f16/bf16 that is 2 * g * d * ctx * dtype_size, Q8/Q4 rows carry their scales).
 *   - DRAM bandwidth: a vectorized sum over a buffer of --bw-mib MiB (default 2 GiB,
 *     far beyond any last-level cache) split over the same number of threads.
 *   - Rounds interleave bandwidth, ours and naive, so slow drifts of a shared machine
 *     hit all of them alike; each row's ratio uses the bandwidth of its own rounds.
 *     Where the sessions of all rows of a context fit in 3/4 of MemAvailable, every
 *     round times each of those rows in turn (run_rows), so their ratios to each
 *     other (vs f16) are of the same moments; else the rows run one after another.
 *     The scalar reference runs right after and shares its row's bandwidth figure.
 *   - warm: right after each timed decode, the fastest of 3 more run back to back;
 *     its FLOP rate (4 * h * d * ctx per decode) over the peak FMA rate is the
 *     in-cache figure for contexts whose layer fits in the last-level cache.
 *   - naive: llama2.c-style plain loops over contiguous f32 arrays (no paging, no
 *     dtype), scores then softmax then the weighted sum, head by head: for GQA each
 *     group's K/V is read once per query head. Threads split the heads.
 *   - prefill: pkv_prefill of --prefill tokens into an empty session, --reps + 1
 *     times (at most 6) on one engine, truncating to 0 in between: the first run pays the
 *     first touch of every page (reported as "cold"), the median of the others is
 *     the steady state of an engine that has served a prompt before. FLOPs =
 *     2 * h * d * n * (n + 1) (q.k and p.v over the causal triangle).
 *   - peak FMA: independent FMA chains in registers, 2 FLOPs per lane, the best of 5
 *     runs (a shared machine only lowers a run); peak int8, the same way:
 *     independent int8 dot-product streams (bench/probe.h), 2 operations a
 *     multiply-add. Both in the instruction set of the kernels in use (pkv_stats.isa:
 *     under PKV_FORCE_ISA=avx2 an AVX-512 host is held to AVX2's peaks).
 *   - roofline (docs/performance.md, "What bounds decode"): per row, the DRAM bound kv_bytes / bw
 *     (bw of the same rounds) and the compute bound ctx * arithmetic per position / peak (bench.h's
 *     bench_arith: f32 FLOPs over the FMA peak plus int8 operations over the int8
 *     peak); the larger of the two times is the roofline, "binds" names it, and the
 *     row's fraction is roofline time / measured time. Paths: exact for every dtype,
 *     integer (quant_dot = 1) for Q8/Q4 when pkv_config_explain accepts it.
 *   - in-cache (--in-cache N, default 4096): for every dtype, path and thread count,
 *     the fastest of WARM_CALLS back-to-back decodes over N tokens after one untimed
 *     one, median over --reps; its fraction of the compute bound.
 * A benchmark, never a test: nothing here asserts a time.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/cli.h"
#include "common/opt.h"

static const char *const CMD = "bench";

/* The most bench holds at once, in bytes (UINT64_MAX on overflow): the bandwidth
 * buffer, plus for the worst preset and context the K/V of the sessions that live at
 * once - the largest dtype's when rows are timed in turn, every row's (all) when they
 * are timed round by round; the formula is a lower bound of their pages - and the
 * naive kernel's f32 K/V and per-thread scores, which live through all the rows of
 * that context. */
static uint64_t peak_bytes(const bench_opts *o, bool all)
{
    uint32_t tmax = 1;
    for (uint32_t i = 0; i < o->n_threads; i++)
        tmax = o->threads[i] > tmax ? o->threads[i] : tmax;
    uint64_t worst = 0;
    for (uint32_t pi = 0; pi < o->n_presets; pi++)
        for (uint32_t ci = 0; ci < o->n_ctx; ci++) {
            const cli_preset *p = o->presets[pi];
            uint64_t kv = 0, naive = 0, one;
            for (uint32_t di = 0; di < o->n_dtypes; di++) {
                const pkv_config c = cli_config(1, p->heads, p->kv_heads, p->head_dim,
                                                o->block_tokens, o->dtypes[di], 1);
                if (cli_kv_bytes(&c, o->ctx[ci], 1, &one) != PKV_OK)
                    return UINT64_MAX;
                if (!all)
                    kv = one > kv ? one : kv;
                else /* Q8/Q4: the exact and the integer path's sessions */
                    for (int k = bench_is_block(o->dtypes[di]) ? 2 : 1; k > 0; k--)
                        kv = kv > UINT64_MAX - one ? UINT64_MAX : kv + one;
            }
            if (kv == UINT64_MAX)
                return UINT64_MAX;
            if (pkv_kv_cache_bytes(1, p->kv_heads, p->head_dim, o->ctx[ci], 1, sizeof(float),
                                   &naive) != PKV_OK)
                return UINT64_MAX;
            if (o->naive && naive <= o->naive_max_bytes)
                naive += (uint64_t)tmax * o->ctx[ci] * sizeof(float);
            else
                naive = 0;
            worst = kv + naive > worst ? kv + naive : worst;
        }
    const uint64_t bw = o->bw_mib << 20;
    return worst > UINT64_MAX - bw ? UINT64_MAX : worst + bw;
}

/* ---- progress ---------------------------------------------------------------------------- */

/* "pagedkv bench: [k/N] what (T s so far)" on stderr as a step begins; nothing with
 * --quiet. A step is one context and thread count of a preset, its in-cache rows, or
 * its prefill. */
static void step(bench *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void step(bench *b, const char *fmt, ...)
{
    bench_opts *o = b->o;
    o->step++;
    if (o->quiet)
        return;
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    fprintf(stderr, "pagedkv bench: [%u/%u] %s (%.0f s so far)\n", o->step, o->steps, what,
            cli_now() - o->t0);
}

/* ---- one row of the table ------------------------------------------------------------- */

/* An engine of one layer of preset p, and a session holding ctx tokens of K/V taken
 * from the pool kv ([pool_tokens][2][g][d], reused cyclically). */
static pkv_status build(const bench_opts *o, const cli_preset *p, pkv_dtype dt, uint32_t path,
                        uint32_t threads, bool scalar, uint64_t ctx, const float *kv,
                        uint32_t pool_tokens, pkv_engine **e, pkv_session **s)
{
    pkv_config c = cli_config(1, p->heads, p->kv_heads, p->head_dim, o->block_tokens, dt,
                              threads);
    c.quant_dot = path == BENCH_INTEGER;
    *e = NULL;
    *s = NULL;
    if (scalar && setenv("PKV_FORCE_ISA", "scalar", 1) != 0)
        return PKV_ENOMEM;
    pkv_status st = pkv_engine_create(&c, e);
    if (scalar)
        unsetenv("PKV_FORCE_ISA");
    if (st != PKV_OK)
        return st;
    if ((st = pkv_session_create(*e, s)) != PKV_OK)
        return st;
    const size_t row_floats = (size_t)p->kv_heads * p->head_dim;
    for (uint64_t t = 0; t < ctx && st == PKV_OK; t++) {
        const float *k = kv + (size_t)(t % pool_tokens) * 2 * row_floats;
        st = pkv_append(*s, 0, k, k + row_floats);
    }
    return st;
}

static void destroy(pkv_engine **e, pkv_session **s)
{
    pkv_session_destroy(*s);
    pkv_engine_destroy(*e);
    *s = NULL;
    *e = NULL;
}

/* Seconds of one decode. */
static pkv_status time_decode(pkv_session *s, const float *q, float *out, double *sec)
{
    const double t0 = cli_now();
    pkv_status st = pkv_decode(s, 0, q, out);
    *sec = cli_now() - t0;
    return st;
}

/* The fastest of WARM_CALLS decodes run back to back right after a timed one: what
 * the kernels do with the cache as warm as the context allows (the "in-cache" rate
 * when the layer fits in the last-level cache; DRAM-bound again when it does not). */
#define WARM_CALLS 3
static pkv_status time_warm(pkv_session *s, const float *q, float *out, double *sec)
{
    pkv_status st = PKV_OK;
    *sec = INFINITY;
    for (int i = 0; i < WARM_CALLS && st == PKV_OK; i++) {
        double t;
        st = time_decode(s, q, out, &t);
        *sec = t < *sec ? t : *sec;
    }
    return st;
}

/* The decode rows of a context or of the in-cache figure: every dtype on the exact
 * path; Q8/Q4 on the integer one too where the engine takes it. Returns how many. */
static uint32_t bench_variants(const bench *b, bench_variant *vs)
{
    uint32_t nv = 0;
    for (uint32_t vi = 0; vi < 2 * b->o->n_dtypes; vi++) {
        const uint32_t path = vi % 2;
        const pkv_dtype dt = b->o->dtypes[vi / 2];
        if (path == BENCH_INTEGER && !(bench_is_block(dt) && b->int_ok[dt]))
            continue;
        vs[nv++] = (bench_variant){dt, path};
    }
    return nv;
}

/* Rows ng of one preset, context and thread count T (the ti-th), built together and
 * timed round by round: in each round, for each row in turn, the bandwidth sweep, one
 * timed decode and the warm ones. So a shared machine's drift, which moves separate
 * runs minutes apart by up to 1.7x (docs/performance.md, "The hosts"), falls on every
 * row of a round
 * alike, and the rows' ratios to each other (vs f16) are of the same moments. nj:
 * the naive kernel, timed in every other round beside the first row (or NULL: the
 * caller passes it with the first rows of each thread count only). The scalar
 * reference of each row runs after, one row at a time. */
static int run_rows(bench *b, const cli_preset *p, uint64_t ctx, uint32_t T, uint32_t ti,
                    const bench_variant *vs, uint32_t ng, const float *kv,
                    uint32_t pool_tokens, const float *q, float *out, bench_naive *nj)
{
    const bench_opts *o = b->o;
    const uint32_t h = p->heads, d = p->head_dim, R = o->reps;
    pkv_engine *e[2 * MAX_LIST] = {NULL};
    pkv_session *s[2 * MAX_LIST] = {NULL};
    double *ours = malloc((size_t)ng * R * sizeof *ours);
    double *bws = malloc((size_t)ng * R * sizeof *bws);
    double *warms = malloc((size_t)ng * R * sizeof *warms);
    double naive_t[SLOW_REPS], naive_bw[SLOW_REPS], naive_sum = 0;
    uint32_t n_naive = 0;
    int rc = CLI_OK;
    pkv_status st = PKV_OK;
    if (!ours || !bws || !warms) {
        rc = cli_fail(CMD, "out of memory");
        goto done;
    }
    for (uint32_t j = 0; j < ng && rc == CLI_OK && st == PKV_OK; j++) {
        bench_row *r = &b->rows[b->n_rows + j];
        memset(r, 0, sizeof *r);
        r->p = p;
        r->ctx = ctx;
        r->dt = vs[j].dt;
        r->path = vs[j].path;
        r->threads = T;
        r->kv_bytes = bench_kv_bytes(p, r->dt, ctx);
        r->scalar_us = r->scalar_gbs = r->scalar_bw_gbs = NAN;
        r->naive_us = r->naive_gbs = r->naive_bw_gbs = NAN;
        st = build(o, p, r->dt, r->path, T, false, ctx, kv, pool_tokens, &e[j], &s[j]);
        if (st != PKV_OK) {
            char why[256] = "";
            pkv_config c = cli_config(1, p->heads, p->kv_heads, p->head_dim, o->block_tokens,
                                      r->dt, T);
            c.quant_dot = r->path == BENCH_INTEGER;
            if (st == PKV_EINVAL)
                pkv_config_explain(&c, why, sizeof why);
            rc = cli_fail(CMD, "building a %s session of %llu tokens: %s%s%s",
                          pkv_dtype_name(r->dt), (unsigned long long)ctx, pkv_status_str(st),
                          why[0] ? ": " : "", why);
            break;
        }
        pkv_config cfg;
        if (pkv_engine_config(e[j], &cfg) == PKV_OK)
            r->bt = cfg.block_tokens;
        double first; /* untimed: the first decode of a session */
        st = time_decode(s[j], q, out, &first);
    }
    for (uint32_t k = 0; k < R && rc == CLI_OK && st == PKV_OK; k++)
        for (uint32_t j = 0; j < ng && st == PKV_OK; j++) {
            bws[j * R + k] = bench_bw_measure(&b->bw, T);
            st = time_decode(s[j], q, out, &ours[j * R + k]);
            if (st == PKV_OK)
                st = time_warm(s[j], q, out, &warms[j * R + k]);
            if (j == 0 && nj && n_naive < SLOW_REPS && naive_sum < SLOW_BUDGET &&
                k % 2 == 0) {
                naive_t[n_naive] = bench_team_run(T, bench_naive_part, nj);
                naive_sum += naive_t[n_naive];
                naive_bw[n_naive++] = bws[j * R + k];
            }
        }
    for (uint32_t j = 0; j < ng; j++)
        if (e[j])
            destroy(&e[j], &s[j]);
    if (rc != CLI_OK)
        goto done;
    if (st != PKV_OK) {
        rc = cli_fail(CMD, "pkv_decode: %s", pkv_status_str(st));
        goto done;
    }
    for (uint32_t j = 0; j < ng; j++) {
        bench_row *r = &b->rows[b->n_rows + j];
        const double tm = bench_median(ours + j * R, R);
        r->ours_us = tm * 1e6;
        r->ours_gbs = (double)r->kv_bytes / tm / 1e9;
        r->bw_gbs = bench_median(bws + j * R, R);
        r->warm_us = bench_median(warms + j * R, R) * 1e6;
        /* q.k and p.v: 2 FMAs = 4 FLOPs per query head, position and element */
        r->warm_gflops = 4.0 * h * d * (double)ctx / r->warm_us / 1e3;
        r->peak = b->peak[ti];
        r->peak_int8 = b->peak_int8[ti];
        if (j == 0 && n_naive > 0) { /* its f32 K and V, each n * g * d */
            const double t = bench_median(naive_t, n_naive);
            r->naive_us = t * 1e6;
            r->naive_gbs = 2.0 * nj->n * nj->g * nj->d * sizeof(float) / t / 1e9;
            r->naive_bw_gbs = bench_median(naive_bw, n_naive);
        }
        if (o->scalar && (o->scalar_max_ctx == 0 || ctx <= o->scalar_max_ctx)) {
            pkv_engine *se;
            pkv_session *ss;
            pkv_stats stats;
            st = build(o, p, r->dt, r->path, T, true, ctx, kv, pool_tokens, &se, &ss);
            if (st == PKV_OK && (st = pkv_engine_stats(se, &stats)) == PKV_OK &&
                strcmp(stats.isa, "scalar") != 0)
                st = PKV_EINVAL;
            const uint32_t cap = R < SLOW_REPS ? R : SLOW_REPS;
            double sc[SLOW_REPS], sum = 0;
            uint32_t n = 0;
            for (; n < cap && sum < SLOW_BUDGET && st == PKV_OK; n++) {
                st = time_decode(ss, q, out, &sc[n]);
                sum += sc[n];
            }
            destroy(&se, &ss);
            if (st != PKV_OK) {
                rc = cli_fail(CMD, "scalar reference (PKV_FORCE_ISA=scalar): %s",
                              pkv_status_str(st));
                goto done;
            }
            const double t = bench_median(sc, n);
            r->scalar_us = t * 1e6;
            r->scalar_gbs = (double)r->kv_bytes / t / 1e9;
            r->scalar_bw_gbs = r->bw_gbs; /* the same thread count, moments before */
        }
    }
    b->n_rows += ng;
done:
    free(ours);
    free(bws);
    free(warms);
    return rc;
}

/* All rows of one preset and context. */
static int run_ctx(bench *b, const cli_preset *p, uint64_t ctx)
{
    const bench_opts *o = b->o;
    const uint32_t g = p->kv_heads, d = p->head_dim, h = p->heads;
    const uint32_t pool_tokens = 256;
    uint64_t seed = 0x9e3779b97f4a7c15ull ^ ctx;
    float *kv = malloc((size_t)pool_tokens * 2 * g * d * sizeof(float));
    float *q = malloc((size_t)h * d * sizeof(float));
    float *out = malloc((size_t)h * d * sizeof(float));
    bench_naive nj;
    memset(&nj, 0, sizeof nj);
    const uint64_t naive_bytes = 2 * (uint64_t)g * d * ctx * sizeof(float);
    const bool do_naive = o->naive && naive_bytes <= o->naive_max_bytes;
    int rc = CLI_OK;
    if (!kv || !q || !out) {
        rc = cli_fail(CMD, "out of memory");
        goto done;
    }
    bench_fill_uniform(&seed, kv, (size_t)pool_tokens * 2 * g * d);
    bench_fill_uniform(&seed, q, (size_t)h * d);
    if (do_naive) {
        float *K = malloc(naive_bytes / 2), *V = malloc(naive_bytes / 2);
        nj.K = K;
        nj.V = V;
        if (!K || !V) {
            free(K);
            free(V);
            nj.K = nj.V = NULL;
            rc = cli_fail(CMD, "out of memory for the naive arrays (%llu bytes)",
                          (unsigned long long)naive_bytes);
            goto done;
        }
        for (uint64_t t = 0; t < ctx; t++) { /* the same values the cache holds */
            const float *src = kv + (size_t)(t % pool_tokens) * 2 * g * d;
            memcpy(K + (size_t)t * g * d, src, (size_t)g * d * sizeof(float));
            memcpy(V + (size_t)t * g * d, src + (size_t)g * d, (size_t)g * d * sizeof(float));
        }
        nj.h = h;
        nj.g = g;
        nj.d = d;
        nj.n = ctx;
        nj.scale = 1.0f / sqrtf((float)d);
        nj.q = q;
        nj.out = out;
    }
    for (uint32_t ti = 0; ti < o->n_threads; ti++) {
        const uint32_t T = o->threads[ti];
        if (do_naive)
            for (uint32_t t = 0; t < T; t++)
                if (!nj.scores[t] && !(nj.scores[t] = malloc(ctx * sizeof(float)))) {
                    rc = cli_fail(CMD, "out of memory");
                    goto done;
                }
        bench_variant vs[2 * MAX_LIST];
        const uint32_t nv = bench_variants(b, vs);
        step(b, "%s, %llu tokens, %u thread%s: %u row%s%s%s", p->name, (unsigned long long)ctx,
             T, T > 1 ? "s" : "", nv, nv > 1 ? "s" : "", do_naive ? ", the naive kernel" : "",
             o->scalar && (o->scalar_max_ctx == 0 || ctx <= o->scalar_max_ctx)
                 ? ", the scalar reference" : "");
        /* the rows timed together: all of them, a round at a time, where their sessions
         * fit in memory at once (b->together), else one at a time */
        const uint32_t group = b->together ? nv : 1;
        for (uint32_t v0 = 0; v0 < nv && rc == CLI_OK; v0 += group) {
            const uint32_t ng = nv - v0 < group ? nv - v0 : group;
            if (b->n_rows + ng > sizeof b->rows / sizeof b->rows[0])
                break;
            rc = run_rows(b, p, ctx, T, ti, vs + v0, ng, kv, pool_tokens, q, out,
                          do_naive && v0 == 0 ? &nj : NULL);
        }
        if (rc != CLI_OK)
            goto done;
    }
done:
    for (uint32_t t = 0; t < BENCH_MAX_THREADS; t++)
        free(nj.scores[t]);
    free((void *)nj.K);
    free((void *)nj.V);
    free(kv);
    free(q);
    free(out);
    return rc;
}

/* Prefill of n tokens into an empty session, for each thread count, with the first
 * --dtype (one 4096-token prefill of a llama3-8b layer is ~137 GFLOP: seconds). */
static int run_prefill(bench *b, const cli_preset *p)
{
    const bench_opts *o = b->o;
    const uint32_t n = o->prefill_tokens, h = p->heads, g = p->kv_heads, d = p->head_dim;
    uint64_t seed = 0x51ed270b27ull;
    float *Q = malloc((size_t)n * h * d * sizeof(float));
    float *KV = malloc((size_t)n * 2 * g * d * sizeof(float));
    float *out = malloc((size_t)n * h * d * sizeof(float));
    int rc = CLI_OK;
    if (!Q || !KV || !out) {
        rc = cli_fail(CMD, "out of memory for the prefill prompt");
        goto done;
    }
    bench_fill_uniform(&seed, Q, (size_t)n * h * d);
    bench_fill_uniform(&seed, KV, (size_t)n * 2 * g * d);
    step(b, "%s, prefill of %u tokens (%s) x %u thread count(s)", p->name, n,
         pkv_dtype_name(o->dtypes[0]), o->n_threads);
    for (uint32_t di = 0; di < 1; di++)
        for (uint32_t ti = 0; ti < o->n_threads; ti++) {
            if (b->n_pre >= sizeof b->pre / sizeof b->pre[0])
                goto done;
            pkv_engine *e;
            pkv_session *s;
            pkv_status st = build(o, p, o->dtypes[di], BENCH_EXACT, o->threads[ti], false, 0, KV,
                                  1, &e, &s);
            const uint32_t runs = o->reps < 5 ? o->reps + 1 : 6; /* 1 cold + warm */
            double sec[6] = {0};
            for (uint32_t k = 0; k < runs && st == PKV_OK; k++) {
                if (k)
                    st = pkv_session_truncate(s, 0);
                const double t0 = cli_now();
                if (st == PKV_OK)
                    st = pkv_prefill(s, 0, n, Q, KV, KV + (size_t)n * g * d, out);
                sec[k] = cli_now() - t0;
            }
            destroy(&e, &s);
            if (st != PKV_OK) {
                rc = cli_fail(CMD, "pkv_prefill: %s", pkv_status_str(st));
                goto done;
            }
            const double flops = 2.0 * h * d * (double)n * (n + 1.0);
            bench_prefill_row *r = &b->pre[b->n_pre++];
            r->p = p;
            r->dt = o->dtypes[di];
            r->threads = o->threads[ti];
            r->tokens = n;
            r->cold_seconds = sec[0];
            r->cold_gflops = flops / sec[0] / 1e9;
            r->seconds = bench_median(sec + 1, runs - 1);
            r->gflops = flops / r->seconds / 1e9;
            r->peak = b->peak[ti];
        }
done:
    free(Q);
    free(KV);
    free(out);
    return rc;
}

/* The in-cache figure of every dtype, path and thread count: a session of
 * o->in_cache tokens, one untimed decode, then --reps times the fastest of WARM_CALLS
 * back-to-back decodes; the median. */
static int run_incache(bench *b, const cli_preset *p)
{
    const bench_opts *o = b->o;
    const uint32_t g = p->kv_heads, d = p->head_dim, h = p->heads, pool_tokens = 256;
    uint64_t seed = 0x1cac4eull;
    float *kv = malloc((size_t)pool_tokens * 2 * g * d * sizeof(float));
    float *q = malloc((size_t)h * d * sizeof(float));
    float *out = malloc((size_t)h * d * sizeof(float));
    int rc = CLI_OK;
    if (!kv || !q || !out) {
        rc = cli_fail(CMD, "out of memory");
        goto done;
    }
    bench_fill_uniform(&seed, kv, (size_t)pool_tokens * 2 * g * d);
    bench_fill_uniform(&seed, q, (size_t)h * d);
    bench_variant vs[2 * MAX_LIST];
    const uint32_t nv = bench_variants(b, vs);
    step(b, "%s, in-cache rows: %u tokens, %u row(s) x %u thread count(s)", p->name,
         o->in_cache, nv, o->n_threads);
    for (uint32_t ti = 0; ti < o->n_threads; ti++)
        for (uint32_t vi = 0; vi < nv; vi++) {
            const pkv_dtype dt = vs[vi].dt;
            const uint32_t path = vs[vi].path;
            if (b->n_inc >= sizeof b->inc / sizeof b->inc[0])
                goto done;
            pkv_engine *e;
            pkv_session *s;
            pkv_status st = build(o, p, dt, path, o->threads[ti], false, o->in_cache, kv,
                                  pool_tokens, &e, &s);
            double t, w[1000];
            if (st == PKV_OK)
                st = time_decode(s, q, out, &t);
            for (uint32_t k = 0; k < o->reps && st == PKV_OK; k++)
                st = time_warm(s, q, out, &w[k]);
            destroy(&e, &s);
            if (st != PKV_OK) {
                rc = cli_fail(CMD, "in-cache decode (%s, %s path): %s", pkv_dtype_name(dt),
                              bench_path_name(path), pkv_status_str(st));
                goto done;
            }
            bench_incache_row *r = &b->inc[b->n_inc++];
            r->p = p;
            r->dt = dt;
            r->path = path;
            r->threads = o->threads[ti];
            r->tokens = o->in_cache;
            r->kv_bytes = bench_kv_bytes(p, dt, o->in_cache);
            r->us = bench_median(w, o->reps) * 1e6;
            r->peak = b->peak[ti];
            r->peak_int8 = b->peak_int8[ti];
        }
done:
    free(kv);
    free(q);
    free(out);
    return rc;
}

int cmd_bench(int argc, char **argv)
{
    int sm = bench_spill_mode(argc, argv);
    if (sm >= 0)
        return sm;
    for (int i = 1; i < argc; i++) /* the many-query rows: bench/many.c */
        if (!strncmp(argv[i], "--verify", 8) || !strncmp(argv[i], "--shared", 8) ||
            !strncmp(argv[i], "--prefill-after", 15))
            return bench_many(argc, argv);
    bench_opts o;
    int rc = bench_parse(argc, argv, &o);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    const uint64_t avail = cli_avail_mem_bytes();
    if (cli_memory_guard(CMD, "the largest context",
                         peak_bytes(&o, false), avail,
                         "the available part (MemAvailable) of the machine's physical memory",
                         o.force) != CLI_OK)
        return CLI_USAGE;
    rc = CLI_OK;
    bench *b = calloc(1, sizeof *b);
    if (!b)
        return cli_fail(CMD, "out of memory");
    b->o = &o;
    b->llc_bytes = bench_llc_bytes();
    /* every row of a context at once where they fit in 3/4 of what is available */
    const uint64_t all = peak_bytes(&o, true);
    b->together = !o.in_turn && avail > 0 && all != UINT64_MAX && all <= avail / 4 * 3;
    b->bw.vecs = (size_t)(o.bw_mib << 20) / sizeof(bench_vec);
    bench_vec *buf = aligned_alloc(64, b->bw.vecs * sizeof(bench_vec));
    if (!buf) {
        free(b);
        return cli_fail(CMD, "cannot allocate the %llu MiB bandwidth buffer",
                        (unsigned long long)o.bw_mib);
    }
    memset(buf, 1, b->bw.vecs * sizeof(bench_vec)); /* touch every page once */
    b->bw.buf = buf;
    /* the peaks are those of the kernels' instruction set (bench/probe.h): ask an
     * engine of the first preset which kernels it uses */
    {
        const cli_preset *p = o.presets[0];
        const pkv_config c = cli_config(1, p->heads, p->kv_heads, p->head_dim,
                                        o.block_tokens, PKV_F16, 1);
        pkv_engine *e = NULL;
        pkv_stats st;
        if (pkv_engine_create(&c, &e) == PKV_OK && pkv_engine_stats(e, &st) == PKV_OK)
            b->isa = st.isa; /* a string of the library's, not the engine's */
        pkv_engine_destroy(e);
    }
    for (uint32_t i = 0; i < o.n_threads; i++) {
        b->peak[i] = bench_fma_peak(o.threads[i], b->isa);
        b->peak_int8[i] = bench_int8_peak(o.threads[i], b->isa);
    }
    /* the integer path (docs/numerics.md, section 7) of each block type: measured where the engine
     * takes quant_dot = 1 for the first preset's geometry, otherwise reported unavailable */
    for (pkv_dtype dt = PKV_Q8; dt <= PKV_Q4; dt++) {
        const cli_preset *p = o.presets[0];
        pkv_config c = cli_config(1, p->heads, p->kv_heads, p->head_dim, o.block_tokens, dt,
                                  1);
        c.quant_dot = 1;
        b->int_ok[dt] = pkv_config_explain(&c, b->int_why[dt], sizeof b->int_why[dt]) ==
                        PKV_OK;
    }
    o.t0 = cli_now();
    o.steps = o.n_presets * (o.n_ctx * o.n_threads + (o.in_cache > 0) + (o.prefill_tokens > 0));
    if (!o.quiet)
        fprintf(stderr, "pagedkv bench: %u step(s): %u context(s) x %u thread count(s)%s%s "
                        "per preset, %u rounds, a %llu MiB bandwidth buffer%s\n", o.steps,
                o.n_ctx, o.n_threads, o.in_cache ? ", in-cache rows" : "",
                o.prefill_tokens ? ", a prefill" : "", o.reps,
                (unsigned long long)o.bw_mib,
                o.full ? " (--full)" : "; --full for the long run");
    for (uint32_t pi = 0; pi < o.n_presets && rc == CLI_OK; pi++) {
        for (uint32_t ci = 0; ci < o.n_ctx && rc == CLI_OK; ci++)
            rc = run_ctx(b, o.presets[pi], o.ctx[ci]);
        if (rc == CLI_OK && o.in_cache > 0)
            rc = run_incache(b, o.presets[pi]);
        if (rc == CLI_OK && o.prefill_tokens > 0)
            rc = run_prefill(b, o.presets[pi]);
    }
    if (rc == CLI_OK) {
        if (o.json)
            bench_print_json(b);
        else
            bench_print_table(b);
    }
    free(buf);
    free(b);
    return rc;
}

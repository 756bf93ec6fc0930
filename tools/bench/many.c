/*
 * bench/many.c - `pagedkv bench --verify K`, `--shared N` and `--prefill-after C`: the
 * calls where one page read serves many queries (docs/speculative.md), each
 * against the calls it replaces and against its roofline, measured in the same run.
 *
 *   verify    pkv_verify of a chain of K drafts over ctx cached tokens, against K
 *             pkv_decode calls of the same session (what token-by-token costs);
 *   shared    one pkv_decode_batch of N sessions that share a ctx-token prefix and
 *             hold --private tokens each, against N pkv_decode calls;
 *   prefill   pkv_prefill of --prefill tokens after ctx cached, its FLOP rate against
 *             the FMA peak.
 *
 * The roofline of a call: max(bytes read / DRAM read bandwidth, FMAs / FMA peak), the
 * bandwidth and the peak measured by bench/probe.c in this run. A verify reads the
 * layer once (its K drafts in one tile) and does K decodes' arithmetic; a shared batch
 * reads the prefix once and each private part once. Rounds interleave the two calls
 * of a row (A, B, A, B, ...) so drift on a shared host hits both alike; the figures
 * are medians. Owns nothing but its rows; uses the public header only.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "common/json.h"
#include "common/opt.h"

static const char *const CMD = "bench";

typedef struct {
    const char *what;          /* "verify", "shared" or "prefill" */
    const cli_preset *p;
    pkv_dtype dt;
    uint32_t path, threads, k; /* k: drafts, sessions or prefill tokens */
    uint64_t ctx, priv;
    double us, base_us;        /* the call; what it replaces (NAN for prefill) */
    double mem_us, fma_us;     /* its two bounds */
    double base_roof_us;       /* the replaced calls' roofline */
} many_row;

/* The arithmetic per attended position and query (bench.h's model, bench_arith): the
 * exact path's q.k and p.v, 2 * h * d FMAs; the integer path's p.v, h * d FMAs, and
 * its scores, h * d int8 multiply-adds (2 * h * d int8 operations). */
static double fmas_per(const cli_preset *p, uint32_t path)
{
    const double hd = (double)p->heads * p->head_dim;
    return path == BENCH_INTEGER ? hd : 2.0 * hd;
}

/* A session of ctx tokens of preset p (one layer) on a new engine. */
static pkv_status make(const cli_preset *p, pkv_dtype dt, uint32_t path, uint32_t threads,
                       uint32_t bt, uint64_t ctx, const float *pool, uint32_t pool_n,
                       pkv_engine **e, pkv_session **s)
{
    pkv_config c = cli_config(1, p->heads, p->kv_heads, p->head_dim, bt, dt, threads);
    c.quant_dot = path == BENCH_INTEGER;
    *s = NULL;
    pkv_status st = pkv_engine_create(&c, e);
    if (st == PKV_OK)
        st = pkv_session_create(*e, s);
    const size_t row = (size_t)p->kv_heads * p->head_dim;
    for (uint64_t t = 0; t < ctx && st == PKV_OK; t++)
        st = pkv_append(*s, 0, pool + (t % pool_n) * 2 * row, pool + (t % pool_n) * 2 * row + row);
    return st;
}

typedef struct {
    uint32_t reps, bt, k, priv, prefill;
    bool verify, shared, prefill_after, json, integer;
    const cli_preset *p;
    uint64_t ctx[MAX_LIST];
    uint32_t n_ctx, threads[MAX_LIST], n_threads;
    pkv_dtype dt;
} many_opts;

/* One verify row: medians of --reps rounds of (verify + reject, K decodes). */
static pkv_status row_verify(const many_opts *o, uint32_t T, uint64_t ctx, const float *pool,
                             uint32_t pool_n, many_row *r)
{
    const cli_preset *p = o->p;
    const uint32_t K = o->k, h = p->heads, g = p->kv_heads, d = p->head_dim;
    pkv_engine *e = NULL;
    pkv_session *s = NULL;
    pkv_status st = make(p, o->dt, o->integer, T, o->bt, ctx, pool, pool_n, &e, &s);
    float *q = malloc((size_t)K * h * d * sizeof(float));
    float *kv = malloc((size_t)K * 2 * g * d * sizeof(float));
    float *out = malloc((size_t)K * h * d * sizeof(float));
    int32_t *parent = malloc(K * sizeof *parent);
    double *a = calloc(o->reps, sizeof *a), *b = calloc(o->reps, sizeof *b);
    if (st == PKV_OK && (!q || !kv || !out || !parent || !a || !b))
        st = PKV_ENOMEM;
    if (st == PKV_OK) {
        uint64_t seed = 0xd7af7ull;
        bench_fill_uniform(&seed, q, (size_t)K * h * d);
        bench_fill_uniform(&seed, kv, (size_t)K * 2 * g * d);
        for (uint32_t i = 0; i < K; i++)
            parent[i] = (int32_t)i - 1;
    }
    for (uint32_t rep = 0; rep <= o->reps && st == PKV_OK; rep++) { /* round 0 warms */
        double t0 = cli_now();
        st = pkv_verify(s, 0, K, parent, q, kv, kv + (size_t)K * g * d, out);
        const double tv = cli_now() - t0;
        if (st == PKV_OK)
            st = pkv_session_commit(s, 0, NULL);
        t0 = cli_now();
        for (uint32_t i = 0; i < K && st == PKV_OK; i++)
            st = pkv_decode(s, 0, q + (size_t)i * h * d, out);
        if (rep) {
            a[rep - 1] = tv;
            b[rep - 1] = cli_now() - t0;
        }
    }
    if (st == PKV_OK) {
        r->us = bench_median(a, o->reps) * 1e6;
        r->base_us = bench_median(b, o->reps) * 1e6;
        r->ctx = ctx;
        r->k = K;
    }
    free(q), free(kv), free(out), free(parent), free(a), free(b);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    return st;
}

/* One shared row: N forks of a ctx-token prefix with --private tokens each; medians of
 * rounds of (one batch, N decodes). */
static pkv_status row_shared(const many_opts *o, uint32_t T, uint64_t ctx, const float *pool,
                             uint32_t pool_n, many_row *r)
{
    const cli_preset *p = o->p;
    const uint32_t N = o->k, h = p->heads, d = p->head_dim;
    const size_t row = (size_t)p->kv_heads * d;
    pkv_engine *e = NULL;
    pkv_session *parent = NULL, **ss = calloc(N, sizeof *ss);
    pkv_status st = make(p, o->dt, o->integer, T, o->bt, ctx, pool, pool_n, &e, &parent);
    float *q = malloc((size_t)N * h * d * sizeof(float));
    float *out = malloc((size_t)N * h * d * sizeof(float));
    double *a = calloc(o->reps, sizeof *a), *b = calloc(o->reps, sizeof *b);
    if (st == PKV_OK && (!ss || !q || !out || !a || !b))
        st = PKV_ENOMEM;
    for (uint32_t i = 0; i < N && st == PKV_OK; i++) {
        st = pkv_session_fork(parent, &ss[i]);
        for (uint32_t t = 0; t < o->priv && st == PKV_OK; t++) {
            const float *k = pool + ((t + 7 * i) % pool_n) * 2 * row;
            st = pkv_append(ss[i], 0, k, k + row);
        }
    }
    if (st == PKV_OK) {
        uint64_t seed = 0x5a4edull;
        bench_fill_uniform(&seed, q, (size_t)N * h * d);
    }
    for (uint32_t rep = 0; rep <= o->reps && st == PKV_OK; rep++) {
        double t0 = cli_now();
        st = pkv_decode_batch(e, 0, N, ss, q, out);
        const double tb = cli_now() - t0;
        t0 = cli_now();
        for (uint32_t i = 0; i < N && st == PKV_OK; i++)
            st = pkv_decode(ss[i], 0, q + (size_t)i * h * d, out + (size_t)i * h * d);
        if (rep) {
            a[rep - 1] = tb;
            b[rep - 1] = cli_now() - t0;
        }
    }
    if (st == PKV_OK) {
        r->us = bench_median(a, o->reps) * 1e6;
        r->base_us = bench_median(b, o->reps) * 1e6;
        r->ctx = ctx;
        r->k = N;
        r->priv = o->priv;
    }
    for (uint32_t i = 0; ss && i < N; i++)
        pkv_session_destroy(ss[i]);
    free(ss), free(q), free(out), free(a), free(b);
    pkv_session_destroy(parent);
    pkv_engine_destroy(e);
    return st;
}

/* One prefill row: --prefill tokens after ctx cached, truncated back between rounds. */
static pkv_status row_prefill(const many_opts *o, uint32_t T, uint64_t ctx, const float *pool,
                              uint32_t pool_n, many_row *r)
{
    const cli_preset *p = o->p;
    const uint32_t n = o->prefill, h = p->heads, g = p->kv_heads, d = p->head_dim;
    pkv_engine *e = NULL;
    pkv_session *s = NULL;
    pkv_status st = make(p, o->dt, o->integer, T, o->bt, ctx, pool, pool_n, &e, &s);
    float *q = malloc((size_t)n * h * d * sizeof(float));
    float *kv = malloc((size_t)n * 2 * g * d * sizeof(float));
    float *out = malloc((size_t)n * h * d * sizeof(float));
    double *a = calloc(o->reps, sizeof *a);
    if (st == PKV_OK && (!q || !kv || !out || !a))
        st = PKV_ENOMEM;
    if (st == PKV_OK) {
        uint64_t seed = 0x9ef111ull;
        bench_fill_uniform(&seed, q, (size_t)n * h * d);
        bench_fill_uniform(&seed, kv, (size_t)n * 2 * g * d);
    }
    for (uint32_t rep = 0; rep <= o->reps && st == PKV_OK; rep++) {
        const double t0 = cli_now();
        st = pkv_prefill(s, 0, n, q, kv, kv + (size_t)n * g * d, out);
        if (rep)
            a[rep - 1] = cli_now() - t0;
        if (st == PKV_OK)
            st = pkv_session_truncate(s, ctx);
    }
    if (st == PKV_OK) {
        r->us = bench_median(a, o->reps) * 1e6;
        r->base_us = NAN;
        r->ctx = ctx;
        r->k = n;
    }
    free(q), free(kv), free(out), free(a);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    return st;
}

/* The two bounds of a row and of what it replaces, from bw (GB/s), peak (GFLOP/s)
 * and the int8 peak (GOP/s, the integer path's scores). */
static void bounds(many_row *r, double bw, double peak, double peak_int8)
{
    const cli_preset *p = r->p;
    const double per = fmas_per(p, r->path); /* per position and query */
    double bytes, fmas, base_bytes, base_fmas;
    if (r->what[0] == 'v') {
        bytes = (double)bench_kv_bytes(p, r->dt, r->ctx);
        fmas = per * (double)r->k * ((double)r->ctx + (r->k + 1) / 2.0);
        base_bytes = bytes * r->k;
        base_fmas = per * (double)r->k * (double)r->ctx;
    } else if (r->what[0] == 's') {
        bytes = (double)bench_kv_bytes(p, r->dt, r->ctx) +
                (double)r->k * (double)bench_kv_bytes(p, r->dt, r->priv);
        fmas = per * (double)r->k * (double)(r->ctx + r->priv);
        base_bytes = (double)r->k * (double)bench_kv_bytes(p, r->dt, r->ctx + r->priv);
        base_fmas = fmas;
    } else {
        bytes = (double)bench_kv_bytes(p, r->dt, r->ctx + r->k);
        fmas = per * ((double)r->k * (double)r->ctx + (double)r->k * (r->k + 1) / 2.0);
        base_bytes = base_fmas = NAN;
    }
    /* the integer path's int8 operations: as many as its f32 FMAs, two each */
    const double int8 = r->path == BENCH_INTEGER ? 2 * fmas / (peak_int8 * 1e3) : 0;
    const double base_int8 = r->path == BENCH_INTEGER ? 2 * base_fmas / (peak_int8 * 1e3) : 0;
    r->mem_us = bytes / (bw * 1e3);
    r->fma_us = fmax(2 * fmas / (peak * 1e3), int8);
    const double base_mem = base_bytes / (bw * 1e3);
    const double base_fma = fmax(2 * base_fmas / (peak * 1e3), base_int8);
    r->base_roof_us = r->what[0] == 'p' ? NAN : fmax(base_mem, base_fma);
}

static void print_rows(const many_opts *o, const many_row *rows, uint32_t n, double bw,
                       const double *peak, const char *isa)
{
    if (o->json) {
        json_writer w = {stdout, true, true}, *W = &w;
        json_open(W, NULL, '{');
        cli_json_envelope(W, "bench", isa);
        json_fmt(W, "dram_read_gbs", "%.2f", bw);
        json_open(W, "rows", '[');
        for (uint32_t i = 0; i < n; i++) {
            const many_row *r = &rows[i];
            const double roof = fmax(r->mem_us, r->fma_us);
            json_open(W, NULL, '{');
            json_str(W, "call", r->what);
            json_str(W, "preset", r->p->name);
            json_str(W, "dtype", pkv_dtype_name(r->dt));
            json_str(W, "path", bench_path_name(r->path));
            JSON_U64S(W, {"threads", r->threads}, {"ctx", r->ctx}, {"k", r->k},
                      {"private", r->priv});
            json_fmt(W, "us", "%.1f", r->us);
            json_fmt(W, "replaced_us", "%.1f", r->base_us);
            json_fmt(W, "mem_bound_us", "%.1f", r->mem_us);
            json_fmt(W, "fma_bound_us", "%.1f", r->fma_us);
            json_fmt(W, "fma_peak_gflops", "%.1f", peak[i]);
            json_fmt(W, "roofline_fraction", "%.3f", roof / r->us);
            json_fmt(W, "speedup", "%.2f", r->base_us / r->us);
            json_fmt(W, "speedup_roofline_allows", "%.2f", r->base_roof_us / roof);
            json_close(W, '}');
        }
        json_close(W, ']');
        json_close(W, '}');
        fputc('\n', stdout);
        return;
    }
    printf("DRAM read %.1f GB/s; bounds: bytes / that, FMAs / the FMA peak of the row's "
           "threads\n", bw);
    printf("%-8s %-10s %-4s %-7s %3s %8s %5s %5s %11s %11s %9s %9s %6s %7s %7s\n", "call",
           "preset", "kv", "path", "thr", "ctx", "k", "priv", "us", "replaced", "mem_us",
           "fma_us", "roof", "speedup", "allows");
    for (uint32_t i = 0; i < n; i++) {
        const many_row *r = &rows[i];
        const double roof = fmax(r->mem_us, r->fma_us);
        printf("%-8s %-10s %-4s %-7s %3u %8llu %5u %5llu %11.1f %11.1f %9.1f %9.1f %6.2f "
               "%7.2f %7.2f\n", r->what, r->p->name, pkv_dtype_name(r->dt),
               bench_path_name(r->path), r->threads, (unsigned long long)r->ctx, r->k,
               (unsigned long long)r->priv, r->us, r->base_us, r->mem_us, r->fma_us,
               roof / r->us, r->base_us / r->us, r->base_roof_us / roof);
    }
    printf("roof: the roofline over the measured time (1 = at the bound); speedup: the "
           "replaced calls' time over this call's; allows: the same ratio of rooflines\n");
}

/* Comma-separated numbers into v[0..MAX_LIST): how many, 0 on a bad item. */
static uint32_t parse_list(const char *s, uint64_t *v, uint64_t lo, uint64_t hi)
{
    uint32_t n = 0;
    char buf[32];
    while (s && *s) {
        const char *end = strchr(s, ',');
        const size_t len = end ? (size_t)(end - s) : strlen(s);
        if (len == 0 || len >= sizeof buf || n == MAX_LIST)
            return 0;
        memcpy(buf, s, len);
        buf[len] = '\0';
        if (!cli_parse_u64(buf, &v[n]) || v[n] < lo || v[n] > hi)
            return 0;
        n++;
        s = end ? end + 1 : NULL;
    }
    return n;
}

static void usage(FILE *f)
{
    fprintf(f,
"usage: pagedkv bench --verify K | --shared N | --prefill-after C [OPTIONS]\n\n"
"The calls where one page read serves many queries (docs/speculative.md), each next\n"
"to the calls it replaces and to its roofline: max(bytes / the DRAM read rate, FMAs /\n"
"the FMA peak), both measured in the same run. Rounds alternate the two calls.\n\n"
"  --verify K          pkv_verify of a chain of K drafts, against K pkv_decode calls\n"
"  --shared N          one pkv_decode_batch of N forks of a ctx-token prefix with\n"
"                      --private tokens each, against N pkv_decode calls\n"
"  --private M         private tokens of each --shared session (default 256)\n"
"  --prefill-after C   pkv_prefill of --prefill tokens after C cached (default 512)\n"
"  --preset NAME       model geometry (default llama3-8b)\n"
"  --ctx LIST          cached tokens, comma-separated (default 32768)\n"
"  --threads LIST      thread counts (default 1,2)\n"
"  --dtype D           KV storage (default f16); --integer: quant_dot (q8, q4)\n"
"  --block-tokens B    tokens per page (default the library's)\n"
"  --reps N            rounds, medians (default 5); --bw-mib M  bandwidth buffer\n"
"  --json              one JSON object on stdout\n");
}

int bench_many(int argc, char **argv)
{
    many_opts o = {.reps = 5, .k = 8, .priv = 256, .prefill = 512, .dt = PKV_F16};
    uint32_t verify = 0, shared = 0;
    uint64_t after = 0, bw_mib = 1024, reps = 5, bt = 0;
    const char *preset = "llama3-8b", *ctx = "32768", *thr = "1,2";
    const cli_opt opts[] = {
        {.name = "verify", .kind = OPT_U32, .dst = &verify, .lo = 1, .hi = 256},
        {.name = "shared", .kind = OPT_U32, .dst = &shared, .lo = 2, .hi = 64},
        {.name = "prefill-after", .kind = OPT_U64, .dst = &after, .lo = 0, .hi = 1u << 24},
        {.name = "private", .kind = OPT_U32, .dst = &o.priv, .lo = 0, .hi = 1u << 20},
        {.name = "prefill", .kind = OPT_U32, .dst = &o.prefill, .lo = 1, .hi = 1u << 16},
        {.name = "preset", .kind = OPT_STRING, .dst = &preset},
        {.name = "ctx", .kind = OPT_STRING, .dst = &ctx},
        {.name = "threads", .kind = OPT_STRING, .dst = &thr},
        {.name = "dtype", .kind = OPT_DTYPE, .dst = &o.dt},
        {.name = "integer", .kind = OPT_FLAG, .dst = &o.integer},
        {.name = "block-tokens", .kind = OPT_U64, .dst = &bt, .lo = 0, .hi = 1u << 16},
        {.name = "reps", .kind = OPT_U64, .dst = &reps, .lo = 1, .hi = 1000},
        {.name = "bw-mib", .kind = OPT_U64, .dst = &bw_mib, .lo = 64, .hi = 1u << 20},
        {.name = "json", .kind = OPT_FLAG, .dst = &o.json},
    };
    int rc = cli_parse(CMD, argc, argv, opts, sizeof opts / sizeof opts[0], usage, NULL, 0,
                       NULL);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    o.reps = (uint32_t)reps;
    o.bt = (uint32_t)bt;
    o.p = cli_preset_find(preset);
    if (!o.p)
        return cli_usage_error(CMD, "unknown preset %s (one of %s)", preset, CLI_PRESET_NAMES);
    uint64_t th[MAX_LIST];
    o.n_ctx = parse_list(ctx, o.ctx, 1, 1ull << 26);
    o.n_threads = parse_list(thr, th, 1, BENCH_MAX_THREADS);
    for (uint32_t i = 0; i < o.n_threads; i++)
        o.threads[i] = (uint32_t)th[i];
    if (!o.n_ctx || !o.n_threads)
        return cli_usage_error(CMD, "--ctx and --threads take comma-separated numbers");
    if (o.integer && !bench_is_block(o.dt))
        return cli_usage_error(CMD, "--integer needs --dtype q8 or q4");
    /* the DRAM read rate of this run, and the FMA peak of each thread count */
    bench_bw bw = {0};
    bw.vecs = (size_t)(bw_mib << 20) / sizeof(bench_vec);
    bench_vec *buf = aligned_alloc(64, bw.vecs * sizeof(bench_vec));
    const uint32_t pool_n = 256;
    const size_t row = (size_t)o.p->kv_heads * o.p->head_dim;
    float *pool = malloc(pool_n * 2 * row * sizeof(float));
    many_row rows[3 * MAX_LIST * MAX_LIST];
    double peaks[3 * MAX_LIST * MAX_LIST];
    uint32_t n = 0;
    if (!buf || !pool) {
        free(buf), free(pool);
        return cli_fail(CMD, "out of memory");
    }
    memset(buf, 1, bw.vecs * sizeof(bench_vec));
    bw.buf = buf;
    uint64_t seed = 0x3a11ull;
    bench_fill_uniform(&seed, pool, pool_n * 2 * row);
    double bw_gbs = 0;
    for (uint32_t i = 0; i < 3; i++) {
        const double x = bench_bw_measure(&bw, o.threads[o.n_threads - 1]);
        bw_gbs = x > bw_gbs ? x : bw_gbs;
    }
    free(buf);
    const char *isa = NULL;
    {
        pkv_engine *e = NULL;
        pkv_stats es;
        const pkv_config c = cli_config(1, o.p->heads, o.p->kv_heads, o.p->head_dim, o.bt,
                                        o.dt, 1);
        if (pkv_engine_create(&c, &e) == PKV_OK && pkv_engine_stats(e, &es) == PKV_OK)
            isa = es.isa;
        pkv_engine_destroy(e);
    }
    pkv_status st = PKV_OK;
    for (uint32_t ti = 0; ti < o.n_threads && st == PKV_OK; ti++) {
        const double peak = bench_fma_peak(o.threads[ti], isa);
        const double peak_int8 = o.integer ? bench_int8_peak(o.threads[ti], isa) : NAN;
        for (uint32_t ci = 0; ci < o.n_ctx && st == PKV_OK; ci++)
            for (int kind = 0; kind < 3 && st == PKV_OK; kind++) {
                many_row *r = &rows[n];
                *r = (many_row){.p = o.p, .dt = o.dt, .path = o.integer,
                                .threads = o.threads[ti]};
                if (kind == 0 && verify) {
                    o.k = verify;
                    r->what = "verify";
                    st = row_verify(&o, o.threads[ti], o.ctx[ci], pool, pool_n, r);
                } else if (kind == 1 && shared) {
                    o.k = shared;
                    r->what = "shared";
                    st = row_shared(&o, o.threads[ti], o.ctx[ci], pool, pool_n, r);
                } else if (kind == 2 && (after || (!verify && !shared))) {
                    r->what = "prefill";
                    st = row_prefill(&o, o.threads[ti], after ? after : o.ctx[ci], pool,
                                     pool_n, r);
                } else {
                    continue;
                }
                if (st == PKV_OK) {
                    bounds(r, bw_gbs, peak, peak_int8);
                    peaks[n++] = peak;
                }
            }
    }
    free(pool);
    if (st != PKV_OK)
        return cli_fail(CMD, "%s", pkv_status_str(st));
    print_rows(&o, rows, n, bw_gbs, peaks, isa);
    return CLI_OK;
}

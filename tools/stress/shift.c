/*
 * stress/shift.c - `pagedkv stress --shift N` (docs/rope.md): sessions whose every layer
 * has the engine's RoPE fill a context of --ctx positions, then shift N times the way
 * llama.cpp's context shift does - keep the first --keep positions, drop half of the
 * rest (pkv_session_discard), append until the context is full again. After every
 * shift it records the memory (the sessions' bytes_resident, the engine's pages, the
 * process's RSS) and the decode time at the full context, and how long the discard
 * took against appending the rows it moved: all of them stay flat, however many
 * shifts run. Text or --json, and --svg plots both against the shift count.
 *
 * Owns: the run and its report. K/V rows come from a fixed block of random rows.
 * Uses only the public header.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/json.h"
#include "common/svg.h"
#include "stress/stress.h"

#define CMD "stress"
#define ROWS 256u

typedef struct {
    double *x;               /* [shifts + 1] shift index (0: before the first) */
    double *resident, *pages, *rss; /* bytes */
    double *decode_us;       /* p50 of a decode of one layer at the full context */
    double *discard_ms;      /* the discard of that shift, all sessions */
    double *refill_ms;       /* appending back to a full context, all sessions */
} shift_series;

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Append positions until every layer of s holds ctx (row p % ROWS for position p). */
static pkv_status fill(pkv_session *s, uint32_t layers, const float *K, const float *V,
                       size_t kr, size_t vr, uint64_t ctx, uint64_t *next_row)
{
    for (uint64_t p = pkv_session_len(s, 0); p < ctx; p++, (*next_row)++) {
        const uint64_t row = *next_row % ROWS;
        for (uint32_t l = 0; l < layers; l++) {
            const pkv_status st = pkv_append(s, l, K + row * kr, V + row * vr);
            if (st != PKV_OK)
                return st;
        }
    }
    return PKV_OK;
}

/* p50 over sessions x layers x reps decodes at the current length, in microseconds. */
static double decode_p50(pkv_engine *e, pkv_session **ss, const stress_opts *o,
                         const float *Q, float *out, double *scratch)
{
    size_t n = 0;
    for (uint32_t i = 0; i < o->sessions; i++)
        for (uint32_t l = 0; l < o->layers; l++)
            for (uint32_t k = 0; k < o->reps; k++) {
                const uint64_t p = pkv_session_len(ss[i], l) - 1;
                float q[8192];
                const size_t qn = (size_t)o->heads * o->head_dim;
                memcpy(q, Q + (k % 4) * qn, qn * sizeof *q);
                (void)pkv_rope_q(e, l, 1, &p, q);
                const double t0 = cli_now();
                if (pkv_decode(ss[i], l, q, out) != PKV_OK)
                    return NAN;
                scratch[n++] = (cli_now() - t0) * 1e6;
            }
    qsort(scratch, n, sizeof *scratch, cmp_double);
    return scratch[n / 2];
}

int stress_shift(const stress_opts *o)
{
    const uint32_t N = o->sessions, S = o->shift;
    const uint64_t ctx = o->ctx, keep = o->keep;
    if (keep + 2 > ctx)
        return cli_usage_error(CMD, "--shift: --keep %llu leaves nothing to shift in --ctx %llu",
                               (unsigned long long)keep, (unsigned long long)ctx);
    if ((size_t)o->heads * o->head_dim > 8192)
        return cli_usage_error(CMD, "--shift: heads x head_dim is at most 8192 here");
    const size_t kr = (size_t)o->kv_heads * o->head_dim;
    const size_t vr = (size_t)o->kv_heads * (o->head_dim_v ? o->head_dim_v : o->head_dim);
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim, o->block_tokens,
                              o->dtype, o->threads);
    c.head_dim_v = o->head_dim_v;
    c.mem_budget = o->budget;
    c.spill_dir = o->spill_dir;
    pkv_layer_config *lc = calloc(o->layers, sizeof *lc);
    float *K = malloc(ROWS * kr * sizeof *K), *V = malloc(ROWS * vr * sizeof *V);
    float *Q = malloc(4 * (size_t)o->heads * o->head_dim * sizeof *Q);
    float *out = malloc((size_t)o->heads * (o->head_dim_v ? o->head_dim_v : o->head_dim) * 4);
    double *buf = calloc((size_t)(S + 1) * 7, sizeof *buf);
    double *scratch = calloc((size_t)N * o->layers * o->reps, sizeof *scratch);
    pkv_session **ss = calloc(N, sizeof *ss);
    pkv_engine *e = NULL;
    int rc = CLI_OK;
    if (!lc || !K || !V || !Q || !out || !buf || !scratch || !ss) {
        rc = cli_fail(CMD, "out of memory");
        goto done;
    }
    for (uint32_t l = 0; l < o->layers; l++) { /* Llama 3's rotation on every layer */
        lc[l].rope = PKV_ROPE_NEOX;
        lc[l].rope_theta = 500000.0f;
    }
    c.layer_cfg = lc;
    pkv_status st = pkv_engine_create(&c, &e);
    if (st != PKV_OK) {
        char why[256];
        pkv_config_explain(&c, why, sizeof why);
        rc = cli_fail(CMD, "pkv_engine_create: %s (%s)", pkv_status_str(st), why);
        goto done;
    }
    uint64_t seed = o->seed;
    for (size_t i = 0; i < ROWS * kr; i++)
        K[i] = (float)((double)(cli_splitmix64(&seed) >> 40) * (2.0 / 16777216.0) - 1.0);
    for (size_t i = 0; i < ROWS * vr; i++)
        V[i] = (float)((double)(cli_splitmix64(&seed) >> 40) * (2.0 / 16777216.0) - 1.0);
    for (size_t i = 0; i < 4 * (size_t)o->heads * o->head_dim; i++)
        Q[i] = (float)((double)(cli_splitmix64(&seed) >> 40) * (2.0 / 16777216.0) - 1.0);
    shift_series z = {buf, buf + (S + 1), buf + 2 * (S + 1), buf + 3 * (S + 1),
                      buf + 4 * (S + 1), buf + 5 * (S + 1), buf + 6 * (S + 1)};
    const uint64_t rss0 = cli_rss_bytes();
    uint64_t rows_moved = 0, next_row = 0;
    double discard_s = 0, refill_s = 0;
    pkv_stats es_last = {0};   /* the engine's figures after the last shift */
    for (uint32_t i = 0; i < N && st == PKV_OK; i++)
        if ((st = pkv_session_create(e, &ss[i])) == PKV_OK)
            st = fill(ss[i], o->layers, K, V, kr, vr, ctx, &next_row);
    for (uint32_t k = 0; k <= S && st == PKV_OK; k++) {
        if (k > 0) { /* the shift: keep, drop half of the rest, fill up again */
            const uint64_t drop = (ctx - keep) / 2;
            double t0 = cli_now();
            for (uint32_t i = 0; i < N && st == PKV_OK; i++)
                st = pkv_session_discard(ss[i], keep, keep + drop);
            const double td = cli_now() - t0;
            rows_moved += (ctx - keep - drop) * N;
            t0 = cli_now();
            for (uint32_t i = 0; i < N && st == PKV_OK; i++)
                st = fill(ss[i], o->layers, K, V, kr, vr, ctx, &next_row);
            const double tf = cli_now() - t0;
            z.discard_ms[k] = td * 1e3;
            z.refill_ms[k] = tf * 1e3;
            discard_s += td;
            refill_s += tf;
            if (st != PKV_OK)
                break;
        }
        uint64_t res = 0;
        for (uint32_t i = 0; i < N; i++) {
            pkv_memory m;
            pkv_session_memory(ss[i], &m);
            res += m.bytes_resident;
        }
        pkv_stats es;
        pkv_engine_stats(e, &es);
        es_last = es;
        const uint64_t rss = cli_rss_bytes();
        z.x[k] = k;
        z.resident[k] = (double)res;
        z.pages[k] = (double)(es.pages_in_use * es.page_bytes);
        z.rss[k] = rss > rss0 ? (double)(rss - rss0) : 0.0;
        z.decode_us[k] = decode_p50(e, ss, o, Q, out, scratch);
        if (!o->quiet && !o->json && (k % 16 == 0 || k == S))
            fprintf(stderr, "shift %u of %u: %s resident, decode p50 %.1f us\n", k, S,
                    cli_bytes(res, (char[32]){0}), z.decode_us[k]);
    }
    if (st != PKV_OK) {
        char why[256];
        pkv_engine_last_error(e, why, sizeof why);
        rc = cli_fail(CMD, "--shift: %s (%s)", pkv_status_str(st), why);
        goto done;
    }
    if (pkv_engine_check(e) != PKV_OK) {
        rc = cli_fail(CMD, "pkv_engine_check failed");
        goto done;
    }
    const uint64_t appended = (uint64_t)S * N * ((ctx - keep) / 2); /* per layer */
    if (o->json) {
        json_writer w = {stdout, true, true}, *W = &w;
        json_open(W, NULL, '{');
        cli_json_envelope(W, "stress", es_last.isa);
        JSON_U64S(W, {"ctx", ctx}, {"keep", keep}, {"shifts", S}, {"sessions", N},
                  {"layers", o->layers}, {"rows_moved", rows_moved},
                  {"rows_appended", appended});
        json_str(W, "dtype", pkv_dtype_name(o->dtype));
        json_fmt(W, "discard_seconds", "%.6f", discard_s);
        json_fmt(W, "refill_seconds", "%.6f", refill_s);
        json_open(W, "points", '[');
        for (uint32_t k = 0; k <= S; k++) {
            json_open(W, NULL, '{');
            json_u64(W, "shift", k);
            JSON_U64S(W, {"bytes_resident", (uint64_t)z.resident[k]},
                      {"engine_bytes", (uint64_t)z.pages[k]}, {"rss_delta", (uint64_t)z.rss[k]});
            json_fmt(W, "decode_us_p50", "%.3f", z.decode_us[k]);
            json_fmt(W, "discard_ms", "%.3f", z.discard_ms[k]);
            json_fmt(W, "refill_ms", "%.3f", z.refill_ms[k]);
            json_close(W, '}');
        }
        json_close(W, ']');
        json_close(W, '}');
        printf("\n");
    } else {
        char b1[32], b2[32], b3[32];
        printf("context shift: %u session(s), ctx %llu, keep %llu, %u shifts of %llu "
               "positions; %u layers of %s\n", N, (unsigned long long)ctx,
               (unsigned long long)keep, S, (unsigned long long)((ctx - keep) / 2), o->layers,
               pkv_dtype_name(o->dtype));
        printf("  memory: resident %s before the first shift, %s after the last (engine %s, "
               "RSS +%s)\n", cli_bytes((uint64_t)z.resident[0], b1),
               cli_bytes((uint64_t)z.resident[S], b2), cli_bytes((uint64_t)z.pages[S], b3),
               cli_bytes((uint64_t)z.rss[S], (char[32]){0}));
        printf("  decode p50 (one layer, full context): %.1f us before, %.1f us after\n",
               z.decode_us[0], z.decode_us[S]);
        if (S)
            printf("  discards: %.3f s for %llu rows moved (x %u layers); appending the "
                   "dropped rows back: %.3f s for %llu rows\n", discard_s,
                   (unsigned long long)rows_moved, o->layers, refill_s,
                   (unsigned long long)appended);
    }
    if (o->svg) {
        svg_series mem[3] = {
            {.name = "bytes_resident, all sessions", .x = z.x, .y = z.resident, .n = S + 1,
             .line = true, .markers = true},
            {.name = "engine pages", .x = z.x, .y = z.pages, .n = S + 1, .line = true},
            {.name = "RSS growth", .x = z.x, .y = z.rss, .n = S + 1, .line = true,
             .dashed = true},
        };
        for (uint32_t k = 0; k <= S; k++) /* the plots' times are in ms */
            z.decode_us[k] /= 1e3;
        svg_series tm[1] = {{.name = "decode p50 at the full context", .x = z.x,
                             .y = z.decode_us, .n = S + 1, .line = true, .markers = true}};
        svg_panel panels[2] = {
            {.title = "K/V memory after each context shift",
             .x = {.label = "shifts", .format = SVG_FMT_NUMBER},
             .y = {.label = "bytes", .format = SVG_FMT_BYTES, .from_zero = true},
             .series = mem, .n_series = 3},
            {.title = "decode time of one layer at the full context",
             .x = {.label = "shifts", .format = SVG_FMT_NUMBER},
             .y = {.label = "time (ms)", .format = SVG_FMT_NUMBER, .from_zero = true},
             .series = tm, .n_series = 1},
        };
        char title[256], where[512];
        snprintf(title, sizeof title, "pagedkv stress --shift: %u shifts of a %llu-position "
                 "context keeping %llu; %u session(s), %u layer(s), h %u, g %u, d %u, %s",
                 S, (unsigned long long)ctx, (unsigned long long)keep, N, o->layers, o->heads,
                 o->kv_heads, o->head_dim, pkv_dtype_name(o->dtype));
        pkv_config ec;
        cli_run_where(where, sizeof where,
                      pkv_engine_config(e, &ec) == PKV_OK ? ec.n_threads : 0, es_last.isa);
        if (svg_write_file(o->svg, title, where, panels, 2) != 0)
            rc = cli_fail(CMD, "cannot write the plot to '%s': %s", o->svg, strerror(errno));
    }
done:
    for (uint32_t i = 0; ss && i < N; i++)
        pkv_session_destroy(ss[i]);
    pkv_engine_destroy(e);
    free(ss), free(lc), free(K), free(V), free(Q), free(out), free(buf), free(scratch);
    return rc;
}

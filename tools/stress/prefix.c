/*
 * stress/prefix.c - `pagedkv stress --prefix P` (docs/prefix-cache.md): N sessions that share a
 * P-token prefix, built twice - once through the prefix cache (session 0 appends
 * the prefix and records its token ids, every later session starts from
 * pkv_session_from_prefix), once without it (every session appends the whole prefix)
 * - each session then appending --prefix-tail tokens of its own. Reports, per mode,
 * the memory after each session (pkv_session_memory sums, the engine's pages and the
 * process's RSS) and the append work, and plots memory against sessions.
 *
 * Owns: the two runs and their report. K/V rows come from a fixed block of random
 * rows, row p % rows for position p, so every session's prefix rows are the same.
 * Uses only the public header.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>

#include "common/cli.h"
#include "common/json.h"
#include "stress/stress.h"
#include "common/svg.h"

#define CMD "stress"
#define ROWS 256u

typedef struct {
    double *x, *pages, *mem_sum, *rss, *secs; /* [N]: after session i */
    uint64_t appended;       /* positions appended (one per position, all layers) */
    uint64_t reused;         /* positions shared from the cache */
    uint64_t hits;           /* from_prefix calls that shared something */
    double append_s;         /* seconds spent building the sessions */
    uint64_t final_pages, final_shared, final_resident, rss_delta;
    bool ran;
} prefix_mode;

/* Append positions [from, to) (rows of the fixed block) to every layer of s. */
static pkv_status append_range(pkv_session *s, uint32_t layers, const float *K,
                               const float *V, size_t kr, size_t vr, uint64_t from,
                               uint64_t to, uint64_t salt)
{
    for (uint64_t p = from; p < to; p++) {
        const uint64_t row = (p + salt) % ROWS;
        for (uint32_t l = 0; l < layers; l++) {
            pkv_status st = pkv_append(s, l, K + row * kr, V + row * vr);
            if (st != PKV_OK)
                return st;
        }
    }
    return PKV_OK;
}

static int run_mode(const stress_opts *o, bool reuse, const float *K, const float *V,
                    size_t kr, size_t vr, const int32_t *ids, prefix_mode *m)
{
    const uint32_t N = o->sessions;
    const uint64_t P = o->prefix, T = o->prefix_tail;
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim, o->block_tokens,
                              o->dtype, o->threads);
    c.head_dim_v = o->head_dim_v;
    c.mem_budget = o->budget;
    c.spill_dir = o->spill_dir;
    pkv_engine *e = NULL;
    pkv_status st = pkv_engine_create(&c, &e);
    if (st != PKV_OK)
        return cli_fail(CMD, "pkv_engine_create: %s", pkv_status_str(st));
    pkv_session **ss = calloc(N, sizeof *ss);
    if (!ss) {
        pkv_engine_destroy(e);
        return cli_fail(CMD, "out of memory");
    }
    const uint64_t rss0 = cli_rss_bytes();
    int rc = CLI_OK;
    pkv_stats es;
    for (uint32_t i = 0; i < N && rc == CLI_OK; i++) {
        const double t0 = cli_now();
        uint64_t have = 0;
        if (reuse && i > 0) {
            /* a request: the shared prefix, then one token of its own */
            st = pkv_session_from_prefix(e, P, ids, &ss[i], &have);
            m->hits += have > 0;
            m->reused += have;
        } else {
            st = pkv_session_create(e, &ss[i]);
        }
        if (st == PKV_OK)
            st = append_range(ss[i], o->layers, K, V, kr, vr, have, P, 0);
        if (st == PKV_OK && reuse && i == 0)
            st = pkv_session_set_tokens(ss[i], P, ids);
        if (st == PKV_OK)   /* its own tail: other rows for every session */
            st = append_range(ss[i], o->layers, K, V, kr, vr, P, P + T, 7 + 13ull * i);
        m->appended += P - have + T;
        m->append_s += cli_now() - t0;
        if (st != PKV_OK) {
            rc = cli_fail(CMD, "session %u: %s", i, pkv_status_str(st));
            break;
        }
        uint64_t sum = 0, shared = 0;
        for (uint32_t j = 0; j <= i; j++) {
            pkv_memory mm;
            pkv_session_memory(ss[j], &mm);
            sum += mm.bytes_resident;
            shared += mm.bytes_shared;
        }
        pkv_engine_stats(e, &es);
        m->x[i] = i + 1;
        m->pages[i] = (double)((es.pages_in_use + es.pages_cached) * es.page_bytes);
        m->mem_sum[i] = (double)sum;
        const uint64_t rss = cli_rss_bytes();
        m->rss[i] = rss > rss0 ? (double)(rss - rss0) : 0.0;
        m->secs[i] = cli_now() - t0;
        m->final_resident = sum;
        m->final_shared = shared;
        m->final_pages = es.pages_in_use + es.pages_cached;
        m->rss_delta = rss > rss0 ? rss - rss0 : 0;
    }
    if (rc == CLI_OK && pkv_engine_check(e) != PKV_OK)
        rc = cli_fail(CMD, "pkv_engine_check failed");
    m->ran = rc == CLI_OK;
    for (uint32_t i = 0; i < N; i++)
        pkv_session_destroy(ss[i]);
    free(ss);
    pkv_engine_destroy(e);
    return rc;
}

static void mode_json(json_writer *W, const char *key, const prefix_mode *m, uint64_t pb)
{
    json_open(W, key, '{');
    json_bool(W, "ran", m->ran);
    json_u64(W, "positions_appended", m->appended);
    json_u64(W, "positions_reused", m->reused);
    json_u64(W, "hits", m->hits);
    json_fmt(W, "append_seconds", "%.6f", m->append_s);
    json_u64(W, "bytes_resident_sum", m->final_resident);
    json_u64(W, "bytes_shared_sum", m->final_shared);
    json_u64(W, "engine_pages", m->final_pages);
    json_u64(W, "engine_bytes", m->final_pages * pb);
    json_u64(W, "rss_delta_bytes", m->rss_delta);
    json_close(W, '}');
}

int stress_prefix(const stress_opts *o)
{
    const uint32_t N = o->sessions;
    const uint64_t P = o->prefix;
    const size_t kr = (size_t)o->kv_heads * o->head_dim;
    const size_t vr = (size_t)o->kv_heads * (o->head_dim_v ? o->head_dim_v : o->head_dim);
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim, o->block_tokens,
                              o->dtype, o->threads);
    c.head_dim_v = o->head_dim_v;
    /* what the run without reuse needs; it is skipped (and said so, with this
     * computed figure) if that is more than half the memory available now: the
     * machine may be shared */
    uint64_t per = 0, need = 0;
    {
        pkv_engine *probe = NULL;
        if (pkv_engine_create(&c, &probe) != PKV_OK)
            return cli_fail(CMD, "pkv_engine_create failed");
        pkv_stats es;
        pkv_engine_stats(probe, &es);
        pkv_config rc;
        pkv_engine_config(probe, &rc);
        pkv_engine_destroy(probe);
        const uint64_t bt = rc.block_tokens;
        per = ((P + o->prefix_tail + bt - 1) / bt) * o->layers * es.page_bytes;
        need = per * N;
    }
    const uint64_t avail = cli_avail_mem_bytes();
    float *K = malloc(ROWS * kr * sizeof *K), *V = malloc(ROWS * vr * sizeof *V);
    int32_t *ids = malloc((size_t)(P ? P : 1) * sizeof *ids);
    prefix_mode m[2];
    memset(m, 0, sizeof m);
    double *buf = calloc((size_t)N * 10, sizeof *buf);
    if (!K || !V || !ids || !buf) {
        free(K), free(V), free(ids), free(buf);
        return cli_fail(CMD, "out of memory");
    }
    uint64_t seed = o->seed;
    for (size_t i = 0; i < ROWS * kr; i++)
        K[i] = (float)((double)(cli_splitmix64(&seed) >> 40) * (2.0 / 16777216.0) - 1.0);
    for (size_t i = 0; i < ROWS * vr; i++)
        V[i] = (float)((double)(cli_splitmix64(&seed) >> 40) * (2.0 / 16777216.0) - 1.0);
    for (uint64_t i = 0; i < P; i++)
        ids[i] = (int32_t)(cli_splitmix64(&seed) % 128000);
    for (int k = 0; k < 2; k++) {
        m[k].x = buf + (size_t)N * (5 * k);
        m[k].pages = m[k].x + N;
        m[k].mem_sum = m[k].pages + N;
        m[k].rss = m[k].mem_sum + N;
        m[k].secs = m[k].rss + N;
    }
    int rc = run_mode(o, true, K, V, kr, vr, ids, &m[0]);
    const bool run_cold = avail == 0 || need <= avail / 2;
    if (rc == CLI_OK && run_cold)
        rc = run_mode(o, false, K, V, kr, vr, ids, &m[1]);
    if (rc == CLI_OK) {
        pkv_engine *probe = NULL;
        pkv_engine_create(&c, &probe);
        pkv_stats es;
        pkv_config pc;
        memset(&es, 0, sizeof es);
        pkv_engine_stats(probe, &es);
        const uint32_t es_threads = pkv_engine_config(probe, &pc) == PKV_OK ? pc.n_threads
                                                                            : o->threads;
        pkv_engine_destroy(probe);
        char b1[32], b2[32], b3[32], b4[32];
        if (o->json) {
            json_writer w = {stdout, true, true}, *W = &w;
            json_open(W, NULL, '{');
            cli_json_envelope(W, "stress", es.isa);
            json_u64(W, "prefix", P);
            json_u64(W, "tail", o->prefix_tail);
            json_u64(W, "sessions", N);
            json_u64(W, "layers", o->layers);
            json_u64(W, "page_bytes", es.page_bytes);
            mode_json(W, "with_cache", &m[0], es.page_bytes);
            mode_json(W, "without_cache", &m[1], es.page_bytes);
            json_u64(W, "without_cache_bytes_computed", need);
            json_close(W, '}');
            printf("\n");
        } else {
            printf("prefix cache: %u sessions sharing a %llu-token prefix, %llu own tokens "
                   "each; %u layers, %s pages of %s (kernels %s)\n", N,
                   (unsigned long long)P, (unsigned long long)o->prefix_tail, o->layers,
                   pkv_dtype_name(o->dtype), cli_bytes(es.page_bytes, b1), es.isa);
            for (int k = 0; k < 2; k++) {
                const prefix_mode *x = &m[k];
                if (!x->ran) {
                    printf("  %-14s not run: needs %s, %s available (computed from the pages "
                           "of one session: %s x %u)\n", k ? "without cache" : "with cache",
                           cli_bytes(need, b1), cli_bytes(avail, b2), cli_bytes(per, b3), N);
                    continue;
                }
                printf("  %-14s engine pages %s, sum of bytes_resident %s (bytes_shared %s), "
                       "RSS +%s; appended %llu positions x %u layers in %.3f s, reused %llu "
                       "(%llu hits)\n", k ? "without cache" : "with cache",
                       cli_bytes(x->final_pages * es.page_bytes, b1),
                       cli_bytes(x->final_resident, b2), cli_bytes(x->final_shared, b3),
                       cli_bytes(x->rss_delta, b4), (unsigned long long)x->appended,
                       o->layers, x->append_s, (unsigned long long)x->reused,
                       (unsigned long long)x->hits);
            }
            printf("  prefill skipped: %llu of %llu positions (x %u layers) not appended\n",
                   (unsigned long long)m[0].reused,
                   (unsigned long long)(m[0].appended + m[0].reused), o->layers);
        }
        /* the stress plots' one time unit: ms */
        double *ms = o->svg ? calloc(2 * (size_t)N + 1, sizeof *ms) : NULL;
        if (o->svg && !ms)
            rc = cli_fail(CMD, "out of memory for the plot");
        for (uint32_t i = 0; ms && i < N; i++) {
            ms[i] = m[0].secs[i] * 1e3;
            ms[N + i] = m[1].ran ? m[1].secs[i] * 1e3 : 0;
        }
        if (ms) {
            svg_series mem[4] = {
                {.name = "engine pages, with cache", .x = m[0].x, .y = m[0].pages, .n = N,
                 .line = true, .markers = true},
                {.name = "RSS growth, with cache", .x = m[0].x, .y = m[0].rss, .n = N,
                 .line = true, .dashed = true},
                {.name = "engine pages, without cache", .x = m[1].x, .y = m[1].pages,
                 .n = m[1].ran ? N : 0, .line = true, .markers = true},
                {.name = "RSS growth, without cache", .x = m[1].x, .y = m[1].rss,
                 .n = m[1].ran ? N : 0, .line = true, .dashed = true},
            };
            svg_series tm[2] = {
                {.name = "with cache", .x = m[0].x, .y = ms, .n = N, .line = true,
                 .markers = true},
                {.name = "without cache", .x = m[1].x, .y = ms + N, .n = m[1].ran ? N : 0,
                 .line = true, .markers = true},
            };
            svg_panel panels[2] = {
                {.title = "K/V memory as sessions sharing the prefix are added",
                 .x = {.label = "sessions", .format = SVG_FMT_NUMBER},
                 .y = {.label = "bytes", .format = SVG_FMT_BYTES, .from_zero = true},
                 .series = mem, .n_series = 4},
                {.title = "time to build each session (append its uncached positions)",
                 .x = {.label = "session", .format = SVG_FMT_NUMBER},
                 .y = {.label = "time (ms)", .format = SVG_FMT_NUMBER, .from_zero = true},
                 .series = tm, .n_series = 2},
            };
            char title[256], where[512];
            snprintf(title, sizeof title, "pagedkv stress --prefix: %u sessions sharing a "
                     "%llu-token prefix, %llu own tokens each; %u layer(s), h %u, g %u, "
                     "d %u, %s, %s pages", N, (unsigned long long)P,
                     (unsigned long long)o->prefix_tail, o->layers, o->heads, o->kv_heads,
                     o->head_dim, pkv_dtype_name(o->dtype), cli_bytes(es.page_bytes, b1));
            cli_run_where(where, sizeof where, es_threads, es.isa);
            if (svg_write_file(o->svg, title, where, panels, 2) != 0)
                rc = cli_fail(CMD, "cannot write the plot to '%s': %s", o->svg,
                              strerror(errno));
        }
        free(ms);
    }
    free(K), free(V), free(ids), free(buf);
    return rc;
}

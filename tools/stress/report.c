/*
 * stress/report.c - the summary of `pagedkv stress`: decode latency against context
 * length (octave buckets, least-squares fits), append rate, memory per session and the
 * check results, as text or one JSON object on stdout, and the plot (drawn by svg.c).
 *
 * Owns: the fits, the buckets, the text and JSON summaries, the plot's series, the
 * exit status of a run. Does not own: the run (stress/stress.c fills the stress_run),
 * the JSON writer (json.c), the SVG text (svg.c), anything in the library.
 *
 * Invariants
 *   - Whatever makes the exit status 1 (a library error, a memory or fork mismatch, an
 *     unwritable plot) is also a `pagedkv stress: ...` line on stderr, after the
 *     report on stdout.
 *   - Reporting changes nothing but the order of r->samples (sorted by octave of ctx,
 *     then latency) and reads the engine's figures; the sessions stay as they are.
 *   - Bucket b covers [2^k, 2^(k+1)) tokens of context; sum over buckets of n ==
 *     n_samples; percentiles are nearest-rank.
 *   - Integers are written exactly (JSON_U64S), figures with %.6g, NaN and infinity
 *     as null.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/json.h"
#include "stress/stress.h"
#include "common/svg.h"

#define CMD "stress"
#define EXIT_INTERRUPTED CLI_INTERRUPTED

/* ---- summary -------------------------------------------------------------------- */

typedef struct {
    bool ok;
    size_t n;
    double slope, intercept, r2; /* us per token of context, us, 1 */
    double gbps;                 /* K/V bytes of one layer per token / slope */
} line_fit;

typedef struct { uint64_t lo, hi; size_t n; double p50, p90, max; } bucket;

static unsigned ilog2(uint64_t x) { return 63u - (unsigned)__builtin_clzll(x); }

static int cmp_sample(const void *a, const void *b)
{
    const stress_sample *x = a, *y = b;
    unsigned bx = ilog2(x->ctx), by = ilog2(y->ctx);
    if (bx != by)
        return bx < by ? -1 : 1;
    return (x->us > y->us) - (x->us < y->us);
}
/* Least squares of the points' p50 (or fastest) latency against context length. The
 * fastest of the repetitions is the one least disturbed by other processes, so on a
 * busy machine its fit shows the kernel's own cost better. */
static line_fit fit_latency(const stress_run *r, bool fastest)
{
    line_fit f = {.n = r->n_points};
    if (r->n_points < 2)
        return f;
    double sx = 0, sy = 0, n = (double)r->n_points;
    for (size_t i = 0; i < r->n_points; i++) {
        sx += (double)r->points[i].ctx;
        sy += fastest ? r->points[i].min : r->points[i].p50;
    }
    double mx = sx / n, my = sy / n, sxx = 0, sxy = 0, syy = 0;
    for (size_t i = 0; i < r->n_points; i++) {
        double dx = (double)r->points[i].ctx - mx;
        double dy = (fastest ? r->points[i].min : r->points[i].p50) - my;
        sxx += dx * dx;
        sxy += dx * dy;
        syy += dy * dy;
    }
    if (sxx <= 0)
        return f;
    f.ok = true;
    f.slope = sxy / sxx;
    f.intercept = my - f.slope * mx;
    f.r2 = syy > 0 ? sxy * sxy / (sxx * syy) : 1.0;
    double bytes = (double)r->o.kv_heads * (double)r->row_pair;
    f.gbps = f.slope > 0 ? bytes / (f.slope * 1e-6) / 1e9 : 0;
    return f;
}

/* A windowed run beyond steady_from: memory and latency should be level there. */
typedef struct {
    size_t n;                           /* points at ctx >= steady_from */
    uint64_t ctx_lo, ctx_hi;
    double p50_lo, p50_hi;              /* us, windowed layers' decodes */
    uint64_t res_lo, res_hi;            /* bytes resident, all sessions */
} steady;

static steady steady_range(const stress_run *r)
{
    steady st = {0};
    for (size_t i = 0; r->windowed && i < r->n_points; i++) {
        const stress_point *p = &r->points[i];
        if (p->ctx < r->steady_from)
            continue;
        if (st.n++ == 0) {
            st.ctx_lo = p->ctx;
            st.p50_lo = st.p50_hi = p->p50_windowed;
            st.res_lo = st.res_hi = p->resident;
        }
        st.ctx_hi = p->ctx;
        st.p50_lo = fmin(st.p50_lo, p->p50_windowed);
        st.p50_hi = fmax(st.p50_hi, p->p50_windowed);
        st.res_lo = p->resident < st.res_lo ? p->resident : st.res_lo;
        st.res_hi = p->resident > st.res_hi ? p->resident : st.res_hi;
    }
    return st;
}

/* Octave buckets [2^k, 2^(k+1)) of every timed decode; sorts r->samples. */
static size_t make_buckets(stress_run *r, bucket *b)
{
    qsort(r->samples, r->n_samples, sizeof(stress_sample), cmp_sample);
    size_t nb = 0;
    for (size_t i = 0; i < r->n_samples;) {
        unsigned k = ilog2(r->samples[i].ctx);
        size_t j = i;
        while (j < r->n_samples && ilog2(r->samples[j].ctx) == k)
            j++;
        size_t n = j - i;
        const stress_sample *s = r->samples + i;
        b[nb++] = (bucket){.lo = 1ull << k, .hi = k < 63 ? 1ull << (k + 1) : UINT64_MAX,
                           .n = n, .p50 = s[(size_t)ceil(0.5 * (double)n) - 1].us,
                           .p90 = s[(size_t)ceil(0.9 * (double)n) - 1].us,
                           .max = s[n - 1].us};
        i = j;
    }
    return nb;
}

static void print_json(const stress_run *r, const line_fit fit[2], const bucket *b, size_t nb,
                       const pkv_memory *mem, const pkv_stats *es, double elapsed,
                       const steady *sr)
{
    const stress_opts *o = &r->o;
    json_writer w = {stdout, true, false}, *W = &w;
    double tok = (double)r->done * o->sessions, rows = tok * o->layers;
    json_open(W, NULL, '{');
    cli_json_envelope(W, CMD, r->isa);
    json_open(W, "config", '{');
    JSON_U64S(W, {"ctx", o->ctx}, {"sessions", o->sessions}, {"layers", o->layers},
              {"heads", o->heads}, {"kv_heads", o->kv_heads}, {"head_dim", o->head_dim});
    json_str(W, "dtype", pkv_dtype_name(o->dtype));
    JSON_U64S(W, {"block_tokens", r->bt}, {"threads", o->threads},
              {"decode_every", o->decode_every}, {"points", o->points}, {"reps", o->reps},
              {"fork_every", o->fork_every}, {"budget", o->budget});
    json_str(W, "spill_dir", o->spill_dir);
    JSON_U64S(W, {"seed", o->seed});
    json_str(W, "model_preset", o->preset);
    JSON_U64S(W, {"head_dim_v", r->dv}, {"window", o->v.window}, {"sinks", o->v.sinks},
              {"rollback", o->v.rollback}, {"window_every", o->v.every},
              {"windowed_layers", r->windowed});
    json_num(W, "softcap", o->v.softcap);
    json_bool(W, "sink_logits", o->v.sink_logits);
    json_close(W, '}');
    if (!r->windowed) {
        json_str(W, "window", NULL);
    } else {
        json_open(W, "window", '{');
        JSON_U64S(W, {"page_ceiling", r->ceiling}, {"pages_held_max", r->window_pages_max},
                  {"steady_from", r->steady_from});
        json_bool(W, "bounded", r->window_pages_max <= r->ceiling && r->mismatches == 0);
        if (!sr->n) {
            json_str(W, "steady", NULL);
        } else {
            json_open(W, "steady", '{');
            JSON_U64S(W, {"points", sr->n}, {"ctx_lo", sr->ctx_lo}, {"ctx_hi", sr->ctx_hi},
                      {"bytes_resident_lo", sr->res_lo}, {"bytes_resident_hi", sr->res_hi});
            json_num(W, "p50_us_lo", sr->p50_lo);
            json_num(W, "p50_us_hi", sr->p50_hi);
            json_close(W, '}');
        }
        json_close(W, '}');
    }
    json_str(W, "io_backend", r->io);
    JSON_U64S(W, {"tokens", r->done});
    json_key(W, "interrupted");
    fputs(cli_interrupted() ? "true" : "false", stdout);
    json_str(W, "error", r->error[0] ? r->error : NULL);
    json_num(W, "elapsed_s", elapsed);
    json_open(W, "append", '{');
    JSON_U64S(W, {"tokens", r->done * o->sessions},
              {"rows", r->done * o->sessions * o->layers});
    json_num(W, "seconds", r->append_s);
    json_num(W, "tokens_per_s", tok / r->append_s);
    json_num(W, "rows_per_s", rows / r->append_s);
    json_close(W, '}');
    json_open(W, "decode", '{');
    JSON_U64S(W, {"samples", r->n_samples});
    json_num(W, "seconds", r->decode_s);
    json_open(W, "points", '[');
    for (size_t i = 0; i < r->n_points; i++) {
        const stress_point *p = &r->points[i];
        json_open(W, NULL, '{');
        JSON_U64S(W, {"ctx", p->ctx});
        json_num(W, "min_us", p->min);
        json_num(W, "p50_us", p->p50);
        json_num(W, "p90_us", p->p90);
        json_num(W, "max_us", p->max);
        JSON_U64S(W, {"bytes_resident", p->resident}, {"bytes_shared", p->shared},
                  {"bytes_spilled", p->spilled}, {"bytes_ideal", p->ideal},
                  {"rss_bytes", p->rss}, {"pages", p->pages},
                  {"window_pages_max", p->window_pages_max});
        json_num(W, "p50_windowed_us", p->p50_windowed);
        if (o->verify) {
            json_num(W, "verify_us", p->verify_us);
            json_num(W, "k_decodes_us", p->k_decodes_us);
        }
        if (o->shared) {
            json_num(W, "shared_batch_us", p->shared_us);
            json_num(W, "separate_decodes_us", p->separate_us);
        }
        json_close(W, '}');
    }
    json_close(W, ']');
    json_open(W, "buckets", '[');
    for (size_t i = 0; i < nb; i++) {
        json_open(W, NULL, '{');
        JSON_U64S(W, {"lo", b[i].lo}, {"hi", b[i].hi}, {"samples", b[i].n});
        json_num(W, "p50_us", b[i].p50);
        json_num(W, "p90_us", b[i].p90);
        json_num(W, "max_us", b[i].max);
        json_close(W, '}');
    }
    json_close(W, ']');
    for (int i = 0; i < 2; i++) {
        const char *name = i ? "fit_fastest" : "fit";
        if (!fit[i].ok) {
            json_str(W, name, NULL);
            continue;
        }
        json_open(W, name, '{');
        json_num(W, "slope_us_per_token", fit[i].slope);
        json_num(W, "intercept_us", fit[i].intercept);
        json_num(W, "r2", fit[i].r2);
        JSON_U64S(W, {"points", fit[i].n});
        json_num(W, "kv_read_gbps", fit[i].gbps);
        json_close(W, '}');
    }
    json_close(W, '}');
    json_open(W, "sessions", '[');
    for (uint32_t s = 0; mem && s < o->sessions; s++) {
        json_open(W, NULL, '{');
        JSON_U64S(W, {"tokens", mem[s].tokens}, {"blocks", mem[s].blocks},
                  {"bytes_resident", mem[s].bytes_resident},
                  {"bytes_shared", mem[s].bytes_shared},
                  {"bytes_spilled", mem[s].bytes_spilled}, {"bytes_ideal", mem[s].bytes_ideal},
                  {"bytes_overhead", mem[s].bytes_overhead});
        json_close(W, '}');
    }
    json_close(W, ']');
    json_open(W, "engine", '{');
    JSON_U64S(W, {"pages_in_use", es->pages_in_use}, {"pages_free", es->pages_free},
              {"pages_spilled", es->pages_spilled}, {"page_bytes", es->page_bytes},
              {"bytes_allocator", es->bytes_allocator}, {"mem_budget", es->mem_budget});
    json_close(W, '}');
    JSON_U64S(W, {"peak_rss_bytes", cli_peak_rss_bytes()});
    json_open(W, "memory_check", '{');
    json_str(W, "compares", r->spill ? "bytes_resident+bytes_spilled" : "bytes_resident");
    JSON_U64S(W, {"checks", r->checks}, {"mismatches", r->mismatches});
    json_key(W, "exact");
    fputs(r->mismatches == 0 && r->checks ? "true" : "false", stdout);
    json_str(W, "first_mismatch", r->mismatches ? r->mismatch : NULL);
    json_close(W, '}');
    json_open(W, "forks", '{');
    JSON_U64S(W, {"count", r->forks}, {"mismatches", r->fork_bad});
    json_str(W, "first_mismatch", r->fork_bad ? r->fork_msg : NULL);
    json_close(W, '}');
    json_close(W, '}');
    fputc('\n', stdout);
}

static void print_text(const stress_run *r, const line_fit fit[2], const bucket *b, size_t nb,
                       const pkv_memory *mem, const pkv_stats *es, double elapsed,
                       const steady *sr)
{
    const stress_opts *o = &r->o;
    char b1[32], b2[32], b3[32], b4[32], b5[32];
    printf("pagedkv stress: %u session(s) x %llu tokens, %u layer(s), heads %u, kv-heads "
           "%u, head-dim %u, %s, %u tokens/page, %u thread(s), isa %s, io %s\n",
           o->sessions, (unsigned long long)o->ctx, o->layers, o->heads, o->kv_heads,
           o->head_dim, pkv_dtype_name(o->dtype), r->bt, o->threads, r->isa, r->io);
    if (cli_variant_any(&o->v) || r->dv != o->head_dim) {
        char vd[256];
        printf("variant: %s; head-dim-v %u\n", cli_variant_describe(&o->v, o->layers, vd,
                                                                     sizeof vd), r->dv);
    }
    if (cli_interrupted())
        printf("interrupted at %llu tokens: the figures below cover the work so far\n",
               (unsigned long long)r->done);
    if (r->error[0])
        printf("error: %s\n", r->error);
    double tok = (double)r->done * o->sessions;
    printf("elapsed %.2f s; append: %.0f tokens in %.2f s = %.0f tokens/s "
           "(%.0f layer rows/s)\n", elapsed, tok, r->append_s,
           r->append_s > 0 ? tok / r->append_s : 0,
           r->append_s > 0 ? tok * o->layers / r->append_s : 0);
    printf("decode: %zu timed decodes at %zu context lengths in %.2f s; latency of one "
           "layer's pkv_decode:\n", r->n_samples, r->n_points, r->decode_s);
    printf("  %-22s %8s %12s %12s %12s\n", "context (tokens)", "samples", "p50 us",
           "p90 us", "max us");
    for (size_t i = 0; i < nb; i++) {
        char range[48];
        snprintf(range, sizeof range, "[%llu, %llu)", (unsigned long long)b[i].lo,
                 (unsigned long long)b[i].hi);
        printf("  %-22s %8zu %12.1f %12.1f %12.1f\n", range, b[i].n, b[i].p50, b[i].p90,
               b[i].max);
    }
    /* the point of a window: memory and latency against context, side by side */
    const bool mixed = r->windowed && r->windowed < o->layers;
    printf("latency and memory against context (the last decode point of each octave):\n"
           "  %12s %12s%s %14s %12s%s\n", "context", "p50 us",
           mixed ? "  windowed us" : "", "resident", "pages",
           r->windowed ? "  pages/windowed layer (ceiling)" : "");
    for (size_t i = 0; i < r->n_points; i++) {
        const stress_point *p = &r->points[i];
        if (i + 1 < r->n_points && ilog2(r->points[i + 1].ctx) == ilog2(p->ctx))
            continue;
        printf("  %12llu %12.1f", (unsigned long long)p->ctx, p->p50);
        if (mixed)
            printf(" %12.1f", p->p50_windowed);
        printf(" %14s %12llu", cli_bytes(p->resident, b1), (unsigned long long)p->pages);
        if (r->windowed)
            printf("  %llu (%llu)", (unsigned long long)p->window_pages_max,
                   (unsigned long long)r->ceiling);
        printf("\n");
    }
    if (o->verify || o->shared) { /* stress/many.c: layer 0 of session 0, medians */
        printf("many queries a page read (layer 0, session 0; us, medians):\n  %12s", "context");
        if (o->verify)
            printf(" %12s %12s %8s", "verify K", "K decodes", "speedup");
        if (o->shared)
            printf(" %12s %12s %8s", "batch N", "N decodes", "speedup");
        printf("   (K = %u, N = %u)\n", o->verify, o->shared);
        for (size_t i = 0; i < r->n_points; i++) {
            const stress_point *p = &r->points[i];
            if (i + 1 < r->n_points && ilog2(r->points[i + 1].ctx) == ilog2(p->ctx))
                continue;
            printf("  %12llu", (unsigned long long)p->ctx);
            if (o->verify)
                printf(" %12.1f %12.1f %8.2f", p->verify_us, p->k_decodes_us,
                       p->k_decodes_us / p->verify_us);
            if (o->shared)
                printf(" %12.1f %12.1f %8.2f", p->shared_us, p->separate_us,
                       p->separate_us / p->shared_us);
            printf("\n");
        }
    }
    if (r->windowed && sr->n)
        printf("windowed: from %llu to %llu tokens (%zu points past sinks + window + "
               "rollback + a page) the windowed layers' p50 latency %.1f..%.1f us, "
               "resident %s..%s%s; pages held per windowed layer at most %llu, page "
               "ceiling %llu\n",
               (unsigned long long)sr->ctx_lo, (unsigned long long)sr->ctx_hi, sr->n,
               sr->p50_lo, sr->p50_hi, cli_bytes(sr->res_lo, b1), cli_bytes(sr->res_hi, b2),
               mixed ? " (the full layers grow with context)" : "",
               (unsigned long long)r->window_pages_max, (unsigned long long)r->ceiling);
    else if (r->windowed)
        printf("windowed: the context never passed sinks + window + rollback + a page "
               "(%llu tokens); pages held per windowed layer at most %llu, page ceiling "
               "%llu\n", (unsigned long long)r->steady_from,
               (unsigned long long)r->window_pages_max, (unsigned long long)r->ceiling);
    if (r->windowed)   /* a line through a level latency is no K/V rate */
        printf("fit: not shown with a window (past it the latency is level, the table "
               "above); --json keeps decode.fit\n");
    for (int i = 0; i < 2 && !r->windowed; i++)
        if (fit[i].ok)
            printf("fit of the %s decode over %zu lengths: latency = %.3f us + %.6g us/token "
                   "x context, R^2 = %.5f (%.3f ms per 1M tokens: K/V read at %.2f GB/s)\n",
                   i ? "fastest" : "p50", fit[i].n, fit[i].intercept, fit[i].slope,
                   fit[i].r2, fit[i].slope * 1048576 / 1e3, fit[i].gbps);
    if (!fit[0].ok && !r->windowed)
        printf("fit: needs at least two decode lengths\n");
    printf("memory per session:\n  %7s %12s %9s %12s %12s %12s %12s %10s\n", "session",
           "tokens", "pages", "resident", "shared", "spilled", "ideal", "overhead");
    for (uint32_t s = 0; mem && s < o->sessions; s++)
        printf("  %7u %12llu %9llu %12s %12s %12s %12s %10s\n", s,
               (unsigned long long)mem[s].tokens, (unsigned long long)mem[s].blocks,
               cli_bytes(mem[s].bytes_resident, b1), cli_bytes(mem[s].bytes_shared, b2),
               cli_bytes(mem[s].bytes_spilled, b3), cli_bytes(mem[s].bytes_ideal, b4),
               cli_bytes(mem[s].bytes_overhead, b5));
    printf("pool: %llu pages in use, %llu free, %llu spilled; page %s; allocator %s; "
           "budget %s\n", (unsigned long long)es->pages_in_use,
           (unsigned long long)es->pages_free, (unsigned long long)es->pages_spilled,
           cli_bytes(es->page_bytes, b1), cli_bytes(es->bytes_allocator, b2),
           es->mem_budget ? cli_bytes(es->mem_budget, b3) : "none");
    printf("peak RSS: %s\n", cli_bytes(cli_peak_rss_bytes(), b1));
    if (r->mismatches)
        printf("memory check: MISMATCH (%llu of %llu checks): %s\n",
               (unsigned long long)r->mismatches, (unsigned long long)r->checks,
               r->mismatch);
    else if (r->checks)
        printf("memory check: exact (%llu checks of %s and bytes_ideal against the "
               "formula)\n", (unsigned long long)r->checks,
               r->spill ? "resident+spilled" : "bytes_resident");
    else
        printf("memory check: nothing to check yet\n");
    if (o->fork_every)
        printf("forks: %llu, %s%s\n", (unsigned long long)r->forks,
               r->fork_bad ? "MISMATCH: " : "copy-on-write checks passed",
               r->fork_bad ? r->fork_msg : "");
}

static int write_svg(const stress_run *r, const line_fit *fit)
{
    size_t n = r->n_points;
    double *buf = calloc(n * 8 + 8, sizeof(double));
    if (!buf)
        return -1;
    double *x = buf, *p50 = x + n, *p90 = p50 + n, *fl = p90 + n,
           *res = fl + n, *ideal = res + n, *spill = ideal + n, *rss = spill + n;
    double *bx = rss + n, *by = bx + 2;   /* the budget: a level line over the data */
    double *cx = by + 2, *cy = cx + 2;     /* docs/variants.md's ceiling of a windowed run */
    /* every latency of the stress plots in one unit, ms, whatever the run's range (the
     * text and JSON keep us); max is left out: one preempted decode would set the
     * scale, the table and the JSON have it */
    const double div = 1000;
    bool any_spill = false;
    for (size_t i = 0; i < n; i++) {
        const stress_point *p = &r->points[i];
        x[i] = (double)p->ctx;
        p50[i] = p->p50 / div;
        p90[i] = p->p90 / div;
        /* a line below zero says nothing about a latency: not drawn */
        fl[i] = fit->ok ? (fit->intercept + fit->slope * x[i]) / div : NAN;
        fl[i] = fl[i] >= 0 ? fl[i] : NAN;
        res[i] = (double)p->resident;
        ideal[i] = (double)p->ideal;
        spill[i] = (double)p->spilled;
        rss[i] = (double)p->rss;
        any_spill = any_spill || p->spilled;
    }
    char fitname[64], lat_title[128];
    snprintf(fitname, sizeof fitname, "least-squares fit, R\xc2\xb2 %.3f", fit->r2);
    snprintf(lat_title, sizeof lat_title, "decode latency of one layer vs context");
    double per_m = fit->slope * 1048576 / 1e3;    /* ms per 1M tokens of context */
    if (fit->ok)
        snprintf(lat_title + strlen(lat_title), sizeof lat_title - strlen(lat_title),
                 ": %.3g %s per 1M tokens", per_m >= 1000 ? per_m / 1000 : per_m,
                 per_m >= 1000 ? "s" : "ms");
    if (r->windowed)   /* a line through a level latency says nothing */
        snprintf(lat_title, sizeof lat_title, "decode latency of one layer vs context "
                 "(window %u on %u of %u layers)", r->o.v.window, r->windowed, r->o.layers);
    const bool draw_fit = fit->ok && !r->windowed;
    double *wl = calloc(n + 1, sizeof(double));
    if (!wl) {
        free(buf);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        wl[i] = r->points[i].p50_windowed / div;
    svg_series lat[] = {
        {.name = "p50", .x = x, .y = p50, .n = n, .line = true, .markers = true},
        {.name = "p90", .x = x, .y = p90, .n = n, .markers = true},
        {.name = fitname, .x = x, .y = fl, .n = fit->ok ? n : 0, .line = true,
         .dashed = true, .color = "#000000"},
        {.name = "p50 of the windowed layers", .x = x, .y = wl, .n = n, .line = true,
         .markers = true},
    };
    const stress_opts *o = &r->o;
    char budget_name[64];
    snprintf(budget_name, sizeof budget_name, "budget (--budget %llu)",
             (unsigned long long)o->budget);
    bx[0] = n ? x[0] : 1;
    bx[1] = n ? x[n - 1] : 1;
    by[0] = by[1] = (double)o->budget;
    /* every layer windowed: the ceiling bounds all of it, a level line */
    const stress_opts *oo = &r->o;
    char ceil_name[96];
    const bool bound = r->windowed == oo->layers && r->windowed;
    snprintf(ceil_name, sizeof ceil_name, "page ceiling: %llu pages/layer",
             (unsigned long long)r->ceiling);
    cx[0] = n ? x[0] : 1;
    cx[1] = n ? x[n - 1] : 1;
    cy[0] = cy[1] = (double)(r->ceiling * r->page_bytes * oo->layers * oo->sessions);
    svg_series memser[6] = {
        {.name = "resident (paged)", .x = x, .y = res, .n = n, .line = true, .markers = true},
        {.name = "ideal (formula)", .x = x, .y = ideal, .n = n, .line = true, .dashed = true},
        {.name = "process RSS", .x = x, .y = rss, .n = n, .line = true},
    };
    size_t n_mem = 3;
    if (any_spill)
        memser[n_mem++] = (svg_series){.name = "spilled", .x = x, .y = spill, .n = n,
                                       .line = true};
    if (bound)
        memser[n_mem++] = (svg_series){.name = ceil_name, .x = cx, .y = cy, .n = n ? 2 : 0,
                                       .line = true, .dashed = true, .color = "#d62728"};
    if (o->budget)
        memser[n_mem++] = (svg_series){.name = budget_name, .x = bx, .y = by, .n = n ? 2 : 0,
                                       .line = true, .dashed = true, .color = "#7f7f7f"};
    /* With a log context axis the short contexts spread over the plot, and a linear
     * y axis would squash them all onto its bottom (latency and memory grow linearly
     * in context): both panels are log-log then. */
    svg_axis xa = {.label = "context length (tokens; K = 1024)", .log = o->svg_logx,
                   .format = SVG_FMT_COUNT, .from_zero = true};
    svg_panel panels[2] = {
        {.title = lat_title, .x = xa,
         .y = {.label = "latency (ms)", .log = o->svg_logx, .from_zero = true},
         .series = lat, .n_series = draw_fit ? 3 : 2},
        {.title = "K/V memory of all sessions vs context", .x = xa,
         .y = {.label = "memory", .log = o->svg_logx, .format = SVG_FMT_BYTES,
               .from_zero = true},
         .series = memser, .n_series = n_mem},
    };
    char title[512], note[768], where[512];
    char vd[200] = "";
    if (cli_variant_any(&o->v))
        cli_variant_describe(&o->v, o->layers, vd, sizeof vd);
    snprintf(title, sizeof title, "pagedkv stress: %u session(s), %u layer(s), h %u, g %u, "
             "d %u, %s, %u tokens/page%s%s%s%s", o->sessions, o->layers, o->heads,
             o->kv_heads, o->head_dim, pkv_dtype_name(o->dtype), r->bt,
             o->preset ? ", " : "", o->preset ? o->preset : "", vd[0] ? "; " : "", vd);
    cli_run_where(where, sizeof where, o->threads, r->isa);
    if (cli_interrupted())
        snprintf(note, sizeof note, "%s; interrupted at %llu of %llu tokens", where,
                 (unsigned long long)r->done, (unsigned long long)o->ctx);
    else if (r->error[0])
        snprintf(note, sizeof note, "%s; stopped by an error at %llu tokens", where,
                 (unsigned long long)r->done);
    else
        snprintf(note, sizeof note, "%s", where);
    /* mixed layers: the windowed layers' own latency, level, next to the mean */
    if (r->windowed && r->windowed < o->layers) {
        lat[2] = lat[3];
        panels[0].n_series = 3;
    }
    int rc = svg_write_file(o->svg, title, note, panels, 2);
    free(wl);
    free(buf);
    return rc;
}

int stress_report(stress_run *r)
{
    const stress_opts *o = &r->o;
    double elapsed = cli_now() - r->t_start;
    line_fit fit[2] = {fit_latency(r, false), fit_latency(r, true)};
    bucket b[64];
    const steady sr = steady_range(r);
    size_t nb = make_buckets(r, b);
    pkv_memory *mem = calloc(o->sessions, sizeof *mem);
    pkv_stats es = {0};
    pkv_engine_stats(r->eng, &es);
    for (uint32_t s = 0; mem && s < o->sessions; s++)
        pkv_session_memory(r->sess[s], &mem[s]);
    if (o->json)
        print_json(r, fit, b, nb, mem, &es, elapsed, &sr);
    else
        print_text(r, fit, b, nb, mem, &es, elapsed, &sr);
    fflush(stdout);
    free(mem);
    int rc = r->error[0] || r->mismatches || r->fork_bad ? CLI_FAIL
             : cli_interrupted()                    ? EXIT_INTERRUPTED
                                                         : CLI_OK;
    /* The report above may be in a file (--json > run.json): every reason for exit 1
     * is said on stderr too, in the form of every other error (docs/tools.md). */
    if (r->error[0])
        cli_fail(CMD, "%s", r->error);
    if (r->mismatches)
        cli_fail(CMD, "memory check: %llu of %llu checks disagree with the formula; the "
                      "first: %s", (unsigned long long)r->mismatches,
                 (unsigned long long)r->checks, r->mismatch);
    if (r->fork_bad)
        cli_fail(CMD, "fork check: %llu of %llu forks failed; the first: %s",
                 (unsigned long long)r->fork_bad, (unsigned long long)r->forks, r->fork_msg);
    if (o->svg && write_svg(r, &fit[0]) != 0)
        rc = cli_fail(CMD, "cannot write the plot to '%s': %s", o->svg, strerror(errno));
    return rc;
}

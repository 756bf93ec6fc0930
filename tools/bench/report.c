/*
 * bench/report.c - the output of `pagedkv bench` (decode mode): the table, or one JSON
 * object whose keys `pagedkv bench --help` lists. Reads a bench of bench.h, changes
 * nothing; a skipped figure (NaN) is "-" in the table and null in JSON.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/json.h"

/* Online CPUs, clamped to what bench can use (here, below the report that prints it and
 * the option parser that defaults to it). */
uint32_t bench_online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1u : n > (long)BENCH_MAX_THREADS ? BENCH_MAX_THREADS : (uint32_t)n;
}

/* The roofline of one row (bench.h's model; NaN where a peak is unknown). */
typedef struct {
    double bytes_pos, flops_pos, int_pos; /* per cached position */
    double dram_us, compute_us;           /* the two bounds of the whole decode */
    double frac;                          /* max(bounds) / measured */
    double vs_f16;                        /* measured / f16 exact of the same ctx, threads */
    const char *binds;                    /* "dram", "compute", or NULL when unknown */
    const char *above;                    /* faster than the bound (frac > ABOVE): why,
                                             "in_cache" or "partly_in_cache"; else NULL */
} roof;

/* frac beyond this is above the roofline, not noise: the DRAM bound assumes every byte
 * comes from DRAM, which a layer the last-level cache holds does not. */
#define ABOVE 1.05

static double compute_us(const cli_preset *p, pkv_dtype dt, uint32_t path, const char *isa,
                         uint64_t n, double peak, double peak_int8)
{
    double fl, io;
    bench_arith(p, dt, path, isa, &fl, &io);
    const double t = (double)n * (fl / (peak * 1e9) + (io > 0 ? io / (peak_int8 * 1e9) : 0));
    return t * 1e6;
}

static roof roofline(const bench *b, const bench_row *r)
{
    roof f;
    bench_arith(r->p, r->dt, r->path, b->isa, &f.flops_pos, &f.int_pos);
    f.bytes_pos = (double)r->kv_bytes / (double)r->ctx;
    f.dram_us = (double)r->kv_bytes / (r->bw_gbs * 1e9) * 1e6;
    f.compute_us = compute_us(r->p, r->dt, r->path, b->isa, r->ctx, r->peak, r->peak_int8);
    const bool known = isfinite(f.dram_us) && isfinite(f.compute_us);
    f.binds = !known ? NULL : f.dram_us >= f.compute_us ? "dram" : "compute";
    f.frac = known ? fmax(f.dram_us, f.compute_us) / r->ours_us : NAN;
    /* above the DRAM bound: the K/V came (partly) from cache. All of it fits in the
     * last-level cache: in cache; else part of it stayed there between rounds */
    f.above = !(f.frac > ABOVE) ? NULL
              : b->llc_bytes && r->kv_bytes <= b->llc_bytes ? "in_cache" : "partly_in_cache";
    f.vs_f16 = NAN;
    for (uint32_t i = 0; i < b->n_rows; i++) {
        const bench_row *x = &b->rows[i];
        if (x->p == r->p && x->ctx == r->ctx && x->threads == r->threads &&
            x->dt == PKV_F16 && x->path == BENCH_EXACT)
            f.vs_f16 = r->ours_us / x->ours_us;
    }
    return f;
}

static double incache_gops(const bench *b, const bench_incache_row *r)
{
    double fl, io;
    bench_arith(r->p, r->dt, r->path, b->isa, &fl, &io);
    return (fl + io) * r->tokens / r->us / 1e3;
}

void bench_print_json(const bench *b)
{
    const bench_opts *o = b->o;
    json_writer w = {stdout, true, false}, *W = &w;
    json_open(W, NULL, '{');
    cli_json_envelope(W, "bench", b->isa);
    JSON_U64S(W, {"reps", o->reps},
              {"bw_buffer_bytes", b->bw.vecs * sizeof(bench_vec)},
              {"llc_bytes", b->llc_bytes});
    json_bool(W, "rows_together", b->together);
    json_open(W, "peak_fma", '[');
    for (uint32_t i = 0; i < o->n_threads; i++) {
        json_open(W, NULL, '{');
        JSON_U64S(W, {"threads", o->threads[i]});
        json_num(W, "gflops", b->peak[i]);
        json_close(W, '}');
    }
    json_close(W, ']');
    json_open(W, "peak_int8", '{');
    json_str(W, "kind", bench_int8_kind(b->isa));
    json_open(W, "threads", '[');
    for (uint32_t i = 0; i < o->n_threads; i++) {
        json_open(W, NULL, '{');
        JSON_U64S(W, {"threads", o->threads[i]});
        json_num(W, "gops", b->peak_int8[i]);
        json_close(W, '}');
    }
    json_close(W, ']');
    json_close(W, '}');
    json_open(W, "integer_path", '[');
    for (pkv_dtype dt = PKV_Q8; dt <= PKV_Q4; dt++) {
        json_open(W, NULL, '{');
        json_str(W, "dtype", pkv_dtype_name(dt));
        json_bool(W, "available", b->int_ok[dt]);
        json_str(W, "reason", b->int_ok[dt] ? NULL : b->int_why[dt]);
        json_close(W, '}');
    }
    json_close(W, ']');
    json_open(W, "decode", '[');
    for (uint32_t i = 0; i < b->n_rows; i++) {
        const bench_row *r = &b->rows[i];
        json_open(W, NULL, '{');
        json_str(W, "preset", r->p->name);
        JSON_U64S(W, {"heads", r->p->heads}, {"kv_heads", r->p->kv_heads},
                  {"head_dim", r->p->head_dim}, {"block_tokens", r->bt}, {"ctx", r->ctx});
        json_str(W, "dtype", pkv_dtype_name(r->dt));
        json_str(W, "path", bench_path_name(r->path));
        JSON_U64S(W, {"threads", r->threads}, {"kv_bytes", r->kv_bytes});
        JSON_NUMS(W, {"ours_us", r->ours_us}, {"ours_gbs", r->ours_gbs},
                  {"bw_gbs", r->bw_gbs}, {"ours_ratio", r->ours_gbs / r->bw_gbs},
                  {"warm_us", r->warm_us}, {"warm_gflops", r->warm_gflops},
                  {"warm_fma_ratio", r->warm_gflops / r->peak},
                  {"scalar_us", r->scalar_us}, {"scalar_gbs", r->scalar_gbs},
                  {"scalar_bw_gbs", r->scalar_bw_gbs},
                  {"scalar_ratio", r->scalar_gbs / r->scalar_bw_gbs},
                  {"naive_us", r->naive_us}, {"naive_gbs", r->naive_gbs},
                  {"naive_ratio", r->naive_gbs / r->naive_bw_gbs});
        const roof f = roofline(b, r);
        JSON_NUMS(W, {"bytes_per_pos", f.bytes_pos}, {"flops_per_pos", f.flops_pos},
                  {"int_ops_per_pos", f.int_pos}, {"dram_bound_us", f.dram_us},
                  {"compute_bound_us", f.compute_us});
        json_str(W, "binds", f.binds);
        JSON_NUMS(W, {"roofline_frac", f.frac}, {"vs_f16", f.vs_f16});
        json_str(W, "above_roofline", f.above);
        json_close(W, '}');
    }
    json_close(W, ']');
    json_open(W, "in_cache", '[');
    for (uint32_t i = 0; i < b->n_inc; i++) {
        const bench_incache_row *r = &b->inc[i];
        const double cb = compute_us(r->p, r->dt, r->path, b->isa, r->tokens, r->peak,
                                     r->peak_int8);
        json_open(W, NULL, '{');
        json_str(W, "preset", r->p->name);
        json_str(W, "dtype", pkv_dtype_name(r->dt));
        json_str(W, "path", bench_path_name(r->path));
        JSON_U64S(W, {"threads", r->threads}, {"tokens", r->tokens}, {"kv_bytes", r->kv_bytes});
        JSON_NUMS(W, {"us", r->us}, {"gflops", incache_gops(b, r)}, {"compute_bound_us", cb},
                  {"frac", cb / r->us});
        json_close(W, '}');
    }
    json_close(W, ']');
    json_open(W, "prefill", '[');
    for (uint32_t i = 0; i < b->n_pre; i++) {
        const bench_prefill_row *r = &b->pre[i];
        json_open(W, NULL, '{');
        json_str(W, "preset", r->p->name);
        json_str(W, "dtype", pkv_dtype_name(r->dt));
        JSON_U64S(W, {"threads", r->threads}, {"tokens", r->tokens});
        JSON_NUMS(W, {"seconds", r->seconds}, {"tokens_per_s", r->tokens / r->seconds},
                  {"gflops", r->gflops}, {"peak_gflops", r->peak},
                  {"ratio", r->gflops / r->peak}, {"cold_seconds", r->cold_seconds},
                  {"cold_gflops", r->cold_gflops});
        json_close(W, '}');
    }
    json_close(W, ']');
    json_close(W, '}');
    fputc('\n', stdout);
}

/* "  123.4" or "      -" */
static void cell(double v, const char *fmt, int width)
{
    if (isfinite(v))
        printf(fmt, width, v);
    else
        printf("%*s", width, "-");
}

/* The roofline of every decode row, the integer path's availability, and the
 * in-cache fractions. */
static void print_roofline(const bench *b)
{
    const bench_opts *o = b->o;
    bool any_block = false;
    for (uint32_t i = 0; i < o->n_dtypes; i++)
        any_block |= bench_is_block(o->dtypes[i]);
    printf("\nroofline (docs/performance.md): dram = K/V bytes / DRAM GB/s of the same\n"
           "rounds, compute = arithmetic / measured peak (FLOP: f32 FMA peak; int8: int8 dot\n"
           "peak); the larger binds; frac = that bound / ours (1.00 = on the roofline); vs f16 =\n"
           "ours / f16's\n");
    const cli_preset *last = NULL;
    uint32_t n_above = 0;
    for (uint32_t i = 0; i < b->n_rows; i++) {
        const bench_row *r = &b->rows[i];
        if (r->p != last) {
            printf("\n%s layer: h=%u g=%u d=%u\n", r->p->name, r->p->heads, r->p->kv_heads,
                   r->p->head_dim);
            printf("%8s %-4s %-7s %3s |%7s %9s %9s |%9s %9s %-7s |%10s %6s %7s\n", "ctx",
                   "type", "path", "thr", "B/pos", "FLOP/pos", "int8/pos", "dram us",
                   "comp us", " binds", "ours us", "frac", "vs f16");
            last = r->p;
        }
        const roof f = roofline(b, r);
        printf("%8llu %-4s %-7s %3u |", (unsigned long long)r->ctx, pkv_dtype_name(r->dt),
               bench_path_name(r->path), r->threads);
        cell(f.bytes_pos, "%*.0f", 7);
        cell(f.flops_pos, "%*.0f", 10);
        cell(f.int_pos, "%*.0f", 10);
        printf(" |");
        cell(f.dram_us, "%*.0f", 9);
        cell(f.compute_us, "%*.0f", 10);
        char binds[16];
        snprintf(binds, sizeof binds, "%s%s", f.binds ? f.binds : "-",
                 !f.above ? "" : strcmp(f.above, "in_cache") == 0 ? "*" : "+");
        n_above += f.above != NULL;
        printf(" %-7s |", binds);
        cell(r->ours_us, "%*.0f", 10);
        cell(f.frac, "%*.2f", 7);
        cell(f.vs_f16, "%*.2f", 8);
        printf("\n");
    }
    char llc[32];
    if (b->llc_bytes)
        snprintf(llc, sizeof llc, "%.1f MiB", (double)b->llc_bytes / (1 << 20));
    if (n_above)
        printf("frac above 1 (faster than its bound): the DRAM bound counts every K/V byte\n"
               "from DRAM, and these rows read some from cache. *: the layer's K/V fits in\n"
               "the last-level cache (%s), which holds it between rounds: an in-cache\n"
               "figure (below), not DRAM's; +: it is larger%s: the part the cache\n"
               "kept between rounds came from there (or the bandwidth probe of those\n"
               "rounds met more contention than the decode: a shared machine).\n",
               b->llc_bytes ? llc : "of unknown size",
               b->llc_bytes ? "" : " or the cache's size unknown");
    if (any_block)
        for (pkv_dtype dt = PKV_Q8; dt <= PKV_Q4; dt++)
            if (!b->int_ok[dt])
                printf("%s integer path (quant_dot = 1): unavailable: %s\n",
                       pkv_dtype_name(dt), b->int_why[dt]);
    if (b->n_inc) {
        printf("\nin-cache (%u tokens: the fastest of 3 back-to-back decodes, median of %u; "
               "frac = compute bound / time;\nKV MiB: the layer's K/V, ", o->in_cache, o->reps);
        if (b->llc_bytes)
            printf("'>' where it exceeds this host's last-level cache of %.1f MiB (sysfs), "
                   "so that row\nstreams part of it from DRAM):\n",
                   (double)b->llc_bytes / (1 << 20));
        else
            printf("next to a last-level cache of unknown size):\n");
        printf("%-10s %-4s %-7s %3s |%9s %9s %9s %9s %6s\n", "preset", "type", "path", "thr",
               "KV MiB", "us", "GOP/s", "comp us", "frac");
        for (uint32_t i = 0; i < b->n_inc; i++) {
            const bench_incache_row *r = &b->inc[i];
            const double cb = compute_us(r->p, r->dt, r->path, b->isa, r->tokens, r->peak,
                                         r->peak_int8);
            const bool over = b->llc_bytes && r->kv_bytes > b->llc_bytes;
            printf("%-10s %-4s %-7s %3u |%8.1f%c%9.0f", r->p->name, pkv_dtype_name(r->dt),
                   bench_path_name(r->path), r->threads, (double)r->kv_bytes / (1 << 20),
                   over ? '>' : ' ', r->us);
            cell(incache_gops(b, r), "%*.1f", 10);
            cell(cb, "%*.0f", 10);
            cell(cb / r->us, "%*.2f", 7);
            printf("\n");
        }
    }
}

void bench_print_table(const bench *b)
{
    const bench_opts *o = b->o;
    printf("pagedkv bench %s: kernels %s; ratio = GB/s of K/V streamed / DRAM read GB/s "
           "measured in the same rounds (%u rounds, medians; %s)\n",
           pkv_version(), b->isa ? b->isa : "?", o->reps,
           b->together ? "each round times every row of a context and thread count in turn"
           : o->in_turn ? "rows one after another (--in-turn)"
                        : "rows one after another: their sessions do not fit in memory at once");
    const cli_preset *last = NULL;
    for (uint32_t i = 0; i < b->n_rows; i++) {
        const bench_row *r = &b->rows[i];
        if (r->p != last) {
            printf("\n%s layer: h=%u g=%u d=%u bt=%u\n", r->p->name, r->p->heads,
                   r->p->kv_heads, r->p->head_dim, r->bt);
            printf("%8s %-7s %3s |%10s %7s %7s %6s |%8s %7s %5s |%10s %7s %6s |%10s %7s %6s\n",
                   "ctx", "type", "thr", "ours us", "GB/s", "bw", "ratio", "warm us", "GF/s",
                   "fma", "scalar us", "GB/s", "ratio", "naive us", "GB/s", "ratio");
            last = r->p;
        }
        char type[16];
        snprintf(type, sizeof type, "%s%s", pkv_dtype_name(r->dt),
                 r->path == BENCH_INTEGER ? " int" : "");
        printf("%8llu %-7s %3u |", (unsigned long long)r->ctx, type, r->threads);
        cell(r->ours_us, "%*.0f", 10);
        cell(r->ours_gbs, "%*.1f", 8);
        cell(r->bw_gbs, "%*.1f", 8);
        cell(r->ours_gbs / r->bw_gbs, "%*.2f", 7);
        printf(" |");
        cell(r->warm_us, "%*.0f", 8);
        cell(r->warm_gflops, "%*.1f", 8);
        cell(r->warm_gflops / r->peak, "%*.2f", 6);
        printf(" |");
        cell(r->scalar_us, "%*.0f", 10);
        cell(r->scalar_gbs, "%*.2f", 8);
        cell(r->scalar_gbs / r->scalar_bw_gbs, "%*.3f", 7);
        printf(" |");
        cell(r->naive_us, "%*.0f", 10);
        cell(r->naive_gbs, "%*.2f", 8);
        cell(r->naive_gbs / r->naive_bw_gbs, "%*.3f", 7);
        printf("\n");
    }
    print_roofline(b);
    if (b->n_pre) {
        printf("\nprefill (pkv_prefill of a %u-token prompt into an empty session; median of\n"
               "the runs after the first; cold = the first run, which touches fresh pages):\n",
               o->prefill_tokens);
        printf("%-10s %-4s %3s %10s %10s %9s %7s %12s\n", "preset", "type", "thr", "tokens/s",
               "GFLOP/s", "peak", "ratio", "cold GFLOP/s");
        for (uint32_t i = 0; i < b->n_pre; i++) {
            const bench_prefill_row *r = &b->pre[i];
            printf("%-10s %-4s %3u %10.0f %10.1f %9.1f %7.3f %12.1f\n", r->p->name,
                   pkv_dtype_name(r->dt), r->threads, r->tokens / r->seconds, r->gflops,
                   r->peak, r->gflops / r->peak, r->cold_gflops);
        }
    }
    printf("\npeak FMA (GFLOP/s, %u-lane FMA chains):", bench_fma_lanes(b->isa));
    for (uint32_t i = 0; i < o->n_threads; i++)
        printf(" %u thread%s %.1f%s", o->threads[i], o->threads[i] > 1 ? "s" : "", b->peak[i],
               i + 1 < o->n_threads ? "," : "\n");
    printf("peak int8 dot (GOP/s, %s):", bench_int8_kind(b->isa));
    for (uint32_t i = 0; i < o->n_threads; i++)
        printf(" %u thread%s %.1f%s", o->threads[i], o->threads[i] > 1 ? "s" : "",
               b->peak_int8[i], i + 1 < o->n_threads ? "," : "\n");
}

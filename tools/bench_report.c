/*
 * bench_report.c - the output of `pagedkv bench` (decode mode): the table, or one JSON
 * object whose keys `pagedkv bench --help` lists. Reads a bench of bench.h, changes
 * nothing; a skipped figure (NaN) is "-" in the table and null in JSON.
 */
#include <math.h>
#include <stdio.h>
#include <unistd.h>

#include "bench.h"
#include "json.h"

/* Online CPUs, clamped to what bench can use (here, below the report that prints it and
 * the option parser that defaults to it). */
uint32_t bench_online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1u : n > (long)BENCH_MAX_THREADS ? BENCH_MAX_THREADS : (uint32_t)n;
}

void bench_print_json(const bench *b)
{
    const bench_opts *o = b->o;
    json_writer w = {stdout, true, false}, *W = &w;
    json_open(W, NULL, '{');
    json_str(W, "tool", "pagedkv bench");
    json_str(W, "version", pkv_version());
    json_str(W, "isa", b->isa ? b->isa : "?");
    JSON_U64S(W, {"online_cpus", bench_online_cpus()}, {"reps", o->reps},
              {"bw_buffer_bytes", b->bw.vecs * sizeof(bench_vec)});
    json_open(W, "peak_fma", '[');
    for (uint32_t i = 0; i < o->n_threads; i++) {
        json_open(W, NULL, '{');
        JSON_U64S(W, {"threads", o->threads[i]});
        json_num(W, "gflops", b->peak[i]);
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

void bench_print_table(const bench *b)
{
    const bench_opts *o = b->o;
    printf("pagedkv bench %s: kernels %s; ratio = GB/s of K/V streamed / DRAM read GB/s "
           "measured in the same rounds (%u rounds, medians)\n",
           pkv_version(), b->isa ? b->isa : "?", o->reps);
    const cli_preset *last = NULL;
    for (uint32_t i = 0; i < b->n_rows; i++) {
        const bench_row *r = &b->rows[i];
        if (r->p != last) {
            printf("\n%s layer: h=%u g=%u d=%u bt=%u\n", r->p->name, r->p->heads,
                   r->p->kv_heads, r->p->head_dim, r->bt);
            printf("%8s %-4s %3s |%10s %7s %7s %6s |%8s %7s %5s |%10s %7s %6s |%10s %7s %6s\n",
                   "ctx", "type", "thr", "ours us", "GB/s", "bw", "ratio", "warm us", "GF/s",
                   "fma", "scalar us", "GB/s", "ratio", "naive us", "GB/s", "ratio");
            last = r->p;
        }
        printf("%8llu %-4s %3u |", (unsigned long long)r->ctx, pkv_dtype_name(r->dt),
               r->threads);
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
    printf("\npeak FMA (GFLOP/s, %u-lane FMA chains):", bench_fma_lanes());
    for (uint32_t i = 0; i < o->n_threads; i++)
        printf(" %u thread%s %.1f%s", o->threads[i], o->threads[i] > 1 ? "s" : "", b->peak[i],
               i + 1 < o->n_threads ? "," : "\n");
}

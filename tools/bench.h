/*
 * bench.h - what the two halves of `pagedkv bench` share: cmd_bench.c parses the
 * options and measures (decode rows, prefill rows, the peak FMA rate), bench_report.c
 * prints them as a table or one JSON object.
 *
 * Owns: the options and the results of a run. Does not own: the probes
 * (bench_probe.h), the spill mode (bench_spill.c), anything in the library.
 *
 * Invariants (when a report is printed): rows[0..n_rows) and pre[0..n_pre) are
 * measured and complete; a figure that was skipped is NaN (printed "-" or null);
 * peak[i] is the FMA rate of o->threads[i] threads.
 */
#ifndef PKV_TOOLS_BENCH_H
#define PKV_TOOLS_BENCH_H

#include <stdbool.h>
#include <stdint.h>

#include "bench_probe.h"
#include "cli.h"
#include "pagedkv.h"

#define MAX_LIST 16
/* naive and scalar measurements repeat at most this often, and stop repeating once
 * they have taken SLOW_BUDGET seconds (at least one run): they are 10-100x slower
 * than ours and would dominate the run time at long contexts. */
#define SLOW_REPS 3u
#define SLOW_BUDGET 1.0

typedef struct {
    const cli_preset *presets[MAX_LIST];
    uint32_t n_presets;
    uint64_t ctx[MAX_LIST];
    uint32_t n_ctx;
    pkv_dtype dtypes[MAX_LIST];
    uint32_t n_dtypes;
    uint32_t threads[MAX_LIST];
    uint32_t n_threads;
    uint32_t reps, block_tokens, prefill_tokens;
    uint64_t bw_mib, scalar_max_ctx, naive_max_bytes;
    bool json, scalar, naive, force;
} bench_opts;

typedef struct {
    const cli_preset *p;
    uint32_t bt;
    uint64_t ctx;
    pkv_dtype dt;
    uint32_t threads;
    uint64_t kv_bytes;
    double ours_us, ours_gbs, bw_gbs;
    double warm_us, warm_gflops, peak; /* back-to-back decodes; peak FMA of the row */
    double scalar_us, scalar_gbs, scalar_bw_gbs;
    double naive_us, naive_gbs, naive_bw_gbs;
} bench_row;

typedef struct {
    const cli_preset *p;
    pkv_dtype dt;
    uint32_t threads, tokens;
    double seconds, gflops, peak;     /* warm: median of the runs after the first */
    double cold_seconds, cold_gflops; /* the first run, fresh pages */
} bench_prefill_row;

typedef struct {
    const bench_opts *o;
    bench_bw bw;
    bench_row rows[4096];
    uint32_t n_rows;
    bench_prefill_row pre[512];
    uint32_t n_pre;
    double peak[MAX_LIST];
    const char *isa;
} bench;

/* Logical CPUs online, at most BENCH_MAX_THREADS. */
uint32_t bench_online_cpus(void);
/* The results as one JSON object on stdout / as the table on stdout. */
void bench_print_json(const bench *b);
void bench_print_table(const bench *b);

#endif

/*
 * bench.h - what the parts of `pagedkv bench` share: bench/options.c parses the
 * options, bench/bench.c measures (decode rows, prefill rows, the peak FMA rate),
 * bench/report.c prints them as a table or one JSON object.
 *
 * Owns: the options and the results of a run. Does not own: the probes
 * (bench/probe.h), the spill mode (bench/spill.c), anything in the library.
 *
 * Invariants (when a report is printed): rows[0..n_rows) and pre[0..n_pre) are
 * measured and complete; a figure that was skipped is NaN (printed "-" or null);
 * peak[i] is the FMA rate of o->threads[i] threads.
 */
#ifndef PKV_TOOLS_BENCH_H
#define PKV_TOOLS_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "bench/probe.h"
#include "common/cli.h"
#include "pagedkv.h"

#define MAX_LIST 16
/* naive and scalar measurements repeat at most this often, and stop repeating once
 * they have taken SLOW_BUDGET seconds (at least one run): they are an order of
 * magnitude slower than ours (docs/performance.md, "Streaming by context length")
 * and would dominate the run time at long contexts. */
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
    uint32_t in_cache;               /* tokens of the in-cache measurement; 0: none */
    uint64_t bw_mib, scalar_max_ctx, naive_max_bytes;
    bool json, scalar, naive, force;
    bool in_turn;                  /* --in-turn: rows one after another, always */
    bool full, quiet;              /* --full: the long run's defaults; --quiet */
    uint32_t steps, step;          /* progress: groups of rows to time, this one */
    double t0;                     /* cli_now() at the start, for the progress lines */
} bench_opts;

/* Decode paths: the exact one (every dtype) and the integer dot products (docs/numerics.md, section
 * 7) (pkv_config.quant_dot = 1; Q8/Q4 pages, where the engine accepts it). */
enum { BENCH_EXACT = 0, BENCH_INTEGER = 1 };
static inline const char *bench_path_name(uint32_t path)
{
    return path == BENCH_INTEGER ? "integer" : "exact";
}
static inline bool bench_is_block(pkv_dtype dt)
{
    return dt == PKV_Q8 || dt == PKV_Q4;
}

/* Bytes of K/V one layer of preset p holds at `tokens` positions in dtype dt (K and V
 * rows of head_dim, scales included): what a decode streams. */
static inline uint64_t bench_kv_bytes(const cli_preset *p, pkv_dtype dt, uint64_t tokens)
{
    return 2 * (uint64_t)p->kv_heads * tokens * pkv_row_bytes(dt, p->head_dim);
}

/* The arithmetic of one decode per cached position (one query, one layer), the model
 * the roofline divides by the compute peaks: the exact path does q.k and p.v in f32,
 * 2 * h * d FMAs = 4 * h * d FLOPs (dequantizing Q8/Q4 is not counted: it is what the
 * path costs beyond the roofline); the integer path takes the scores from int8 dot
 * products (h * d multiply-adds = 2 * h * d int8 operations) and p.v in f32 (2 * h * d
 * FLOPs). The exact Q8/Q4 path of the avx512vnni kernels, where head_dim is a multiple
 * of 32, takes its scores from q cut into four int8 limbs (docs/numerics.md): 8 * h * d
 * int8 operations, and p.v in f32. */
static inline void bench_arith(const cli_preset *p, pkv_dtype dt, uint32_t path,
                               const char *isa, double *flops, double *int_ops)
{
    const double hd = (double)p->heads * p->head_dim;
    const bool limbs = path == BENCH_EXACT && bench_is_block(dt) && p->head_dim % 32 == 0 &&
                       isa && strcmp(isa, "avx512vnni") == 0;
    *flops = path == BENCH_INTEGER || limbs ? 2 * hd : 4 * hd;
    *int_ops = path == BENCH_INTEGER ? 2 * hd : limbs ? 8 * hd : 0;
}

typedef struct {
    const cli_preset *p;
    uint32_t bt;
    uint64_t ctx;
    pkv_dtype dt;
    uint32_t path;                     /* BENCH_EXACT or BENCH_INTEGER */
    uint32_t threads;
    uint64_t kv_bytes;
    double ours_us, ours_gbs, bw_gbs;
    double warm_us, warm_gflops, peak; /* back-to-back decodes; peak FMA of the row */
    double peak_int8;                  /* the int8 dot peak (GOP/s) of the row's threads */
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

/* The in-cache figure: the fastest of back-to-back decodes over o->in_cache tokens
 * (a llama3-8b layer of 4096 tokens is 16 MiB of f16: in the last-level cache of a
 * large server part, not of every host, hence kv_bytes next to bench.llc_bytes),
 * as a fraction of the compute bound of its path. */
typedef struct {
    const cli_preset *p;
    pkv_dtype dt;
    uint32_t path, threads, tokens;
    uint64_t kv_bytes;                 /* the layer's K/V at that many tokens */
    double us, peak, peak_int8;
} bench_incache_row;

typedef struct {
    bench_opts *o;
    bench_bw bw;
    bench_incache_row inc[512];
    uint32_t n_inc;
    double peak_int8[MAX_LIST];        /* int8 dot peak of o->threads[i] threads */
    /* the integer path per dtype: accepted by the engine, or why not */
    bool int_ok[PKV_Q4 + 1];
    char int_why[PKV_Q4 + 1][256];
    bench_row rows[4096];
    uint32_t n_rows;
    bench_prefill_row pre[512];
    uint32_t n_pre;
    double peak[MAX_LIST];
    const char *isa;
    uint64_t llc_bytes;                /* bench_llc_bytes(): 0 unknown */
    bool together;                     /* a context's rows timed round by round (all
                                        * their sessions fit in memory), else in turn */
} bench;

/* One decode row to time: a dtype and its path. */
typedef struct {
    pkv_dtype dt;
    uint32_t path;
} bench_variant;

/* `pagedkv bench --verify K | --shared N | --prefill-after C` (bench/many.c): its own
 * options and rows. */
int bench_many(int argc, char **argv);
/* bench/options.c. bench_parse: the decode mode's options into o; CLI_OK to run,
 * CLI_HELP after --help, CLI_USAGE on a bad argument (message printed).
 * bench_spill_mode: with --spill on the command line, its options and the run
 * (bench_spill); -1 without --spill. */
int bench_parse(int argc, char **argv, bench_opts *o);
int bench_spill_mode(int argc, char **argv);

/* Logical CPUs online, at most BENCH_MAX_THREADS. */
uint32_t bench_online_cpus(void);
/* The results as one JSON object on stdout / as the table on stdout. */
void bench_print_json(const bench *b);
void bench_print_table(const bench *b);

#endif

/*
 * stress.h - what the two halves of `pagedkv stress` share: stress/stress.c runs the
 * sessions up to the context and fills a stress_run; stress/report.c turns it into
 * the text or JSON summary and the SVG plot.
 *
 * Owns: the run's state (options, engine, sessions, samples, points, counters).
 * Does not own: anything in the library.
 *
 * Invariants (hold whenever stress_report is called)
 *   - points[0..n_points) are in increasing ctx, one per decode point reached;
 *     samples[0..n_samples) hold every timed pkv_decode, in the order they ran.
 *   - done <= o.ctx tokens are in every layer of every session; error[] is empty
 *     unless the loop stopped on a failure it describes.
 *   - With a window (docs/variants.md), the memory check compares every layer's pages with
 *     cli_variant_pages_held and with the ceiling; window_pages_max <= ceiling
 *     unless mismatches says otherwise.
 *   - mismatches counts failed memory checks out of checks; fork_bad failed fork
 *     checks out of forks; mismatch[] and fork_msg[] hold the first of each.
 */
#ifndef PKV_TOOLS_STRESS_H
#define PKV_TOOLS_STRESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "common/cli.h"
#include "pagedkv.h"

typedef struct {
    uint64_t ctx, decode_every, fork_every, budget, seed;
    uint64_t prefix, prefix_tail;  /* --prefix P, --prefix-tail T (stress/prefix.c) */
    uint32_t shift;                /* --shift N: context shifts (stress/shift.c) */
    uint64_t keep;                 /* --keep: positions a shift keeps */
    uint32_t sessions, layers, heads, kv_heads, head_dim, block_tokens, threads;
    uint32_t head_dim_v;         /* 0 = head_dim */
    cli_variant v;               /* --window, --sinks, --rollback, --softcap, preset */
    uint32_t points, reps;
    pkv_dtype dtype;
    const char *spill_dir, *svg, *preset;
    bool json, quiet, svg_logx, force;
    uint32_t verify, shared;     /* --verify K, --shared N (stress/many.c; 0: off) */
} stress_opts;

/* Most drafts of --verify and sessions of --shared (stress/many.c). */
#define STRESS_MANY_MAX 16u

typedef struct { uint64_t ctx; float us; } stress_sample;   /* one timed pkv_decode */

typedef struct {                 /* one decode point: latency and memory at ctx */
    uint64_t ctx;
    double min, p50, p90, max;   /* us per pkv_decode of one layer */
    uint64_t resident, shared, spilled, ideal, rss; /* bytes, sums over sessions */
    uint64_t pages;              /* pages held, all sessions and layers */
    uint64_t window_pages_max;   /* most pages one windowed layer holds (0: none) */
    double p50_windowed;         /* us, p50 over the windowed layers' decodes (NaN: none) */
    /* stress/many.c, layer 0 of session 0, medians (NaN: not asked): a pkv_verify of
       --verify K drafts and K pkv_decode calls; one pkv_decode_batch of --shared N
       forks and N pkv_decode calls */
    double verify_us, k_decodes_us, shared_us, separate_us;
} stress_point;

typedef struct {
    stress_opts o;
    pkv_engine *eng;
    pkv_session **sess;          /* [sessions] */
    uint32_t bt;                 /* tokens per page, resolved */
    uint32_t dv;                 /* head_dim_v, resolved */
    pkv_layer_config *lc;        /* [layers] or NULL (every layer full causal) */
    float *sink_store;           /* the sink logits lc points at, or NULL */
    uint32_t windowed;           /* layers with a window */
    uint64_t ceiling;            /* page ceiling per windowed layer (docs/variants.md; 0: none) */
    uint64_t window_pages_max;   /* most pages any windowed layer held at a check */
    uint64_t steady_from;        /* context from which a windowed layer's pages stay
                                    level: sinks + window + rollback + one page */
    uint64_t page_bytes;
    uint64_t row_pair;           /* pkv_row_bytes of a K row + a V row (docs/numerics.md,
                                    section 6) */
    bool spill;                  /* budget and spill dir: pages may be on disk */
    const char *isa, *io;
    uint32_t rows;               /* rows of the random blocks below */
    float *K, *V;                /* [rows][g*d], [rows][g*dv] */
    float *Q;                    /* [rows][h*d] */
    float *out, *out2;           /* [h*dv] */
    float *lat;                  /* [sessions*layers*reps] scratch of one point */
    float *wlat;                 /* the same, windowed layers' decodes only */
    stress_sample *samples;
    size_t n_samples, cap_samples;
    stress_point *points;
    size_t n_points, cap_points;
    uint64_t *sched;             /* log-spaced decode lengths, ascending, unique */
    size_t n_sched, sched_i;
    uint64_t done;               /* tokens in every layer of every session */
    double t_start, append_s, decode_s, decoded_ctx; /* decoded_ctx: sum of ctx decoded */
    uint64_t checks, mismatches, forks, fork_bad;
    char mismatch[256], fork_msg[256], error[256];
} stress_run;

/* The summary of the work so far: text (or JSON with --json) on stdout, then the plot
 * with --svg. Sorts r->samples. Returns the exit status: CLI_FAIL after an error, a
 * memory mismatch, a fork mismatch or a plot that could not be written;
 * CLI_INTERRUPTED after Ctrl-C; CLI_OK otherwise. */
int stress_report(stress_run *r);
/* `--prefix P` (docs/prefix-cache.md): the run with and without the prefix cache, its report and
 * plot (stress/prefix.c). Returns the exit status. */
int stress_prefix(const stress_opts *o);
/* `--shift N` (docs/rope.md): a full context shifted N times, memory and decode time after
 * each shift, its report and plot (stress/shift.c). Returns the exit status. */
int stress_shift(const stress_opts *o);
/* --verify, --shared at decode point n (stress/many.c): their four figures into pt
 * (NaN when not asked); the session is left as it was. A library status on failure. */
pkv_status stress_many_point(stress_run *r, uint64_t n, stress_point *pt);

#endif

/*
 * bench/bench.c - `pagedkv bench`: decode throughput in GB/s of K/V streamed, next to
 * the DRAM read bandwidth, a naive implementation and the library's own scalar
 * reference, all measured in the same run (SPEC §4, §6); plus prefill tokens/s next
 * to a peak FMA rate measured in the same run.
 *
 * Owns: the options and the measurement loops; the probes they time against (DRAM
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
 *   - roofline (SPEC §9): per row, the DRAM bound kv_bytes / bw (bw of the same
 *     rounds) and the compute bound ctx * arithmetic per position / peak (bench.h's
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

static void usage(FILE *f)
{
    fprintf(f,
"usage: pagedkv bench [options]\n"
"\n"
"Decode throughput of one layer in GB/s of K/V streamed (2 * kv_heads * ctx *\n"
"row_bytes(head_dim) bytes per decode; f16: 2 bytes a value, q8/q4: 8.5/4.5 bits\n"
"with their scales at head_dim 128), next to the DRAM read bandwidth measured in the\n"
"same run with the same number of threads, the library's scalar reference kernel\n"
"(PKV_FORCE_ISA=scalar) and a naive implementation (plain loops over contiguous f32,\n"
"no paging); then pkv_prefill tokens/s and its FLOP rate next to a measured peak FMA\n"
"rate. Medians over --reps rounds that interleave bandwidth, ours and naive, and\n"
"every row of a context (dtype, path) where their sessions fit in memory at once.\n"
"Then the roofline of every row (SPEC §9): the DRAM bound (its bytes over the\n"
"bandwidth of the same rounds) and the compute bound (its arithmetic over the FMA\n"
"peak, and for the integer path the int8 dot peak, both measured in this run), which\n"
"one binds, the fraction of that bound the decode reaches and its time relative to\n"
"f16; and the in-cache fraction of the compute bound (--in-cache tokens). Q8/Q4 run\n"
"on the exact path and, where the engine accepts pkv_config.quant_dot = 1, on the\n"
"integer path (otherwise the report says why it is unavailable).\n"
"\n"
"options:\n"
"  --model-preset LIST  comma-separated presets (default llama3-8b; 'all' = llama3-8b,\n"
"                       mqa,mha,d64,d256); one layer of each is measured\n"
"  --ctx LIST           context lengths (default 4096,32768,131072; k/m suffixes)\n"
"  --dtype LIST         f16,bf16,f32,q8,q4 (default all five)\n"
"  --threads LIST       thread counts (default 1 and the number of online CPUs;\n"
"                       0 = all online CPUs)\n"
"  --reps N             rounds per figure (default 7; scalar and naive use <= %u,\n"
"                       fewer once they have taken %.0f s)\n"
"  --block-tokens N     tokens per page (default: the library's)\n"
"  --prefill N          prompt length of the prefill measurement, run with the first\n"
"                       --dtype (default 4096; 0 skips it)\n"
"  --bw-mib N           bandwidth probe buffer in MiB (default 2048)\n"
"  --in-cache N         tokens of the in-cache measurement (default 4096; 0 skips it)\n"
"  --no-scalar          skip the scalar reference\n"
"  --no-naive           skip the naive implementation\n"
"  --scalar-max-ctx N   skip the scalar reference above this context (default 32768:\n"
"                       its ratio is flat in the context and 128k costs ~20 s; 0 = no limit)\n"
"  --in-turn            time the rows of a context one after another (what bench does\n"
"                       when their sessions do not fit in memory at once, below)\n"
"  --force              run even when the largest context's buffers (below) exceed\n"
"                       the memory available now (MemAvailable)\n"
"  --json               one JSON object on stdout instead of the table\n"
"  --help               this text\n"
"\n"
"Before allocating anything, bench adds up the most it will hold at once: the\n"
"bandwidth buffer, the K/V of the largest context in the largest dtype and, for the\n"
"naive kernel, its f32 copy and scores. Above the memory available now (MemAvailable\n"
"in /proc/meminfo, what a shared machine's other programs leave) it refuses (exit 2)\n"
"unless --force: bench has no budget and no spill. Where every row's session of a\n"
"context fits in 3/4 of MemAvailable, they live together and are timed round by\n"
"round; otherwise one at a time (the table's first line says which).\n"
"\n"
"spill mode (SPEC §5: spill and restore next to the disk's own speed):\n"
"  --spill              instead of decode: two sessions of --spill-mib MiB each on an\n"
"                       engine whose budget holds one; alternating decodes spill one\n"
"                       and restore the other. GB/s of spill+restore I/O next to a plain\n"
"                       sequential write+read of the same bytes, both backends\n"
"  --spill-dir DIR      where the spill file and the plain file go (default /tmp)\n"
"  --spill-mib N        MiB per session (default 256); --reps and --json apply\n"
"  (--spill --json keys: tool, version, spill_dir, spill {mib_per_session, reps,\n"
"  backends (list of {backend, spill_restore_gbs, plain_seq_gbs, ratio})})\n"
"\n"
"JSON keys (decode mode): tool, version, isa, online_cpus, reps, bw_buffer_bytes, llc_bytes,\n"
"rows_together (true: each round timed every row of a context), peak_fma (list of\n"
"{threads, gflops}), peak_int8 ({kind, list of {threads, gops}}), integer_path (list of\n"
"{dtype, available, reason}), decode (list of {preset, heads, kv_heads, head_dim,\n"
"block_tokens, ctx, dtype, path, threads, kv_bytes, ours_us, ours_gbs, bw_gbs, ours_ratio,\n"
"warm_us, warm_gflops, warm_fma_ratio,\n"
"scalar_us, scalar_gbs, scalar_bw_gbs, scalar_ratio, naive_us, naive_gbs, naive_ratio,\n"
"bytes_per_pos, flops_per_pos, int_ops_per_pos, dram_bound_us, compute_bound_us,\n"
"binds (\"dram\" or \"compute\"), roofline_frac, vs_f16};\n"
"ratio = GB/s over the bandwidth of the same rounds; skipped figures are null),\n"
"in_cache (list of {preset, dtype, path, threads, tokens, us, gflops, compute_bound_us,\n"
"frac}),\n"
"prefill (list of {preset, dtype, threads, tokens, seconds, tokens_per_s, gflops,\n"
"peak_gflops, ratio, cold_seconds, cold_gflops}: the warm median and the first run).\n"
"\n"
"exit status: 0 ok, 1 the library or the system failed, 2 usage error.\n",
            SLOW_REPS, SLOW_BUDGET);
}

/* ---- option parsing ------------------------------------------------------------------ */

/* Split s at commas into at most MAX_LIST non-empty items, each handed to fn.
 * 0 on error (an empty item included: "4k,,8k" is a typo, not two contexts). */
static int each_item(const char *s, int (*fn)(const char *item, void *ctx), void *ctx)
{
    char buf[512];
    if (!s || !*s || strlen(s) >= sizeof buf)
        return 0;
    int n = 0;
    for (const char *p = s;; p++) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == 0 || ++n > MAX_LIST)
            return 0;
        memcpy(buf, p, len);
        buf[len] = '\0';
        if (!fn(buf, ctx))
            return 0;
        if (!end)
            return 1;
        p = end;
    }
}

static int add_preset(const char *item, void *ctx)
{
    bench_opts *o = ctx;
    if (strcmp(item, "all") == 0) {
        static const char *const all[] = {"llama3-8b", "mqa", "mha", "d64", "d256"};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            if (o->n_presets >= MAX_LIST || !(o->presets[o->n_presets++] = cli_preset_find(all[i])))
                return 0;
        return 1;
    }
    const cli_preset *p = cli_preset_find(item);
    if (!p || o->n_presets >= MAX_LIST)
        return 0;
    o->presets[o->n_presets++] = p;
    return 1;
}

static int add_ctx(const char *item, void *ctx)
{
    bench_opts *o = ctx;
    uint64_t v;
    if (!cli_parse_u64(item, &v) || v == 0 || v > (1ull << 32))
        return 0;
    o->ctx[o->n_ctx++] = v;
    return 1;
}

static int add_dtype(const char *item, void *ctx)
{
    bench_opts *o = ctx;
    return cli_parse_dtype(item, &o->dtypes[o->n_dtypes++]);
}


/* A thread count; 0 means all online CPUs, as everywhere in pagedkv. */
static int add_threads(const char *item, void *ctx)
{
    bench_opts *o = ctx;
    uint32_t v;
    if (!cli_parse_u32(item, &v) || v > BENCH_MAX_THREADS)
        return 0;
    o->threads[o->n_threads++] = v ? v : bench_online_cpus();
    return 1;
}

/* The list options (OPT_CALL): a repeated option replaces the earlier list. */
static bool list_presets(const char *v, void *dst)
{
    ((bench_opts *)dst)->n_presets = 0;
    return each_item(v, add_preset, dst);
}

static bool list_ctx(const char *v, void *dst)
{
    ((bench_opts *)dst)->n_ctx = 0;
    return each_item(v, add_ctx, dst);
}

static bool list_dtypes(const char *v, void *dst)
{
    ((bench_opts *)dst)->n_dtypes = 0;
    return each_item(v, add_dtype, dst);
}

static bool list_threads(const char *v, void *dst)
{
    ((bench_opts *)dst)->n_threads = 0;
    return each_item(v, add_threads, dst);
}

/* CLI_OK to run; CLI_HELP after --help; CLI_USAGE on a bad argument (message printed). */
static int parse(int argc, char **argv, bench_opts *o)
{
    memset(o, 0, sizeof *o);
    uint64_t reps = 7, bt = 0, prefill = 4096, in_cache = 4096;
    o->bw_mib = 2048;
    o->scalar_max_ctx = 32768;
    o->naive_max_bytes = 4ull << 30;
    o->scalar = o->naive = true;
    const cli_opt opts_[] = {
        {.name = "model-preset", .kind = OPT_CALL, .dst = o, .call = list_presets,
         .what = "a comma-separated list of presets (" CLI_PRESET_NAMES ") or 'all'"},
        {.name = "preset", .kind = OPT_CALL, .dst = o, .call = list_presets,
         .what = "a comma-separated list of presets (" CLI_PRESET_NAMES ") or 'all'"},
        {.name = "ctx", .kind = OPT_CALL, .dst = o, .call = list_ctx,
         .what = "a comma-separated list of up to 16 context lengths in 1..2^32"},
        {.name = "dtype", .kind = OPT_CALL, .dst = o, .call = list_dtypes,
         .what = "a comma-separated list of f32, f16, bf16, q8, q4"},
        {.name = "threads", .kind = OPT_CALL, .dst = o, .call = list_threads,
         .what = "a comma-separated list of thread counts in 0..256 (0 = all CPUs; "
                 "bench's limit)"},
        {.name = "reps", .kind = OPT_U64, .dst = &reps, .lo = 1, .hi = 1000},
        {.name = "block-tokens", .kind = OPT_U64, .dst = &bt, .lo = 0, .hi = UINT32_MAX},
        {.name = "prefill", .kind = OPT_U64, .dst = &prefill, .lo = 0, .hi = 1u << 20},
        {.name = "bw-mib", .kind = OPT_U64, .dst = &o->bw_mib, .lo = 1, .hi = 1u << 20},
        {.name = "in-cache", .kind = OPT_U64, .dst = &in_cache, .lo = 0, .hi = 1u << 20},
        {.name = "scalar-max-ctx", .kind = OPT_U64, .dst = &o->scalar_max_ctx, .lo = 0,
         .hi = UINT64_MAX},
        {.name = "no-scalar", .kind = OPT_CLEAR, .dst = &o->scalar},
        {.name = "no-naive", .kind = OPT_CLEAR, .dst = &o->naive},
        {.name = "force", .kind = OPT_FLAG, .dst = &o->force},
        {.name = "in-turn", .kind = OPT_FLAG, .dst = &o->in_turn},
        {.name = "json", .kind = OPT_FLAG, .dst = &o->json},
    };
    int rc = cli_parse(CMD, argc, argv, opts_, sizeof opts_ / sizeof opts_[0], usage, NULL,
                       0, NULL);
    if (rc != CLI_OK)
        return rc;
    o->reps = (uint32_t)reps;
    o->block_tokens = (uint32_t)bt;
    o->prefill_tokens = (uint32_t)prefill;
    o->in_cache = (uint32_t)in_cache;
    if (o->n_presets == 0 && !(o->presets[o->n_presets++] = cli_preset_find("llama3-8b")))
        return cli_fail(CMD, "preset table lacks llama3-8b");
    static const uint64_t def_ctx[] = {4096, 32768, 131072};
    if (o->n_ctx == 0)
        for (; o->n_ctx < 3; o->n_ctx++)
            o->ctx[o->n_ctx] = def_ctx[o->n_ctx];
    static const pkv_dtype def_dt[] = {PKV_F16, PKV_BF16, PKV_F32, PKV_Q8, PKV_Q4};
    if (o->n_dtypes == 0)
        for (; o->n_dtypes < 5; o->n_dtypes++)
            o->dtypes[o->n_dtypes] = def_dt[o->n_dtypes];
    if (o->n_threads == 0) {
        o->threads[o->n_threads++] = 1;
        if (bench_online_cpus() > 1)
            o->threads[o->n_threads++] = bench_online_cpus();
    }
    /* the engine's limits, for every preset and dtype (the thread counts are within
     * bench's own 256) */
    for (uint32_t pi = 0; pi < o->n_presets; pi++)
        for (uint32_t di = 0; di < o->n_dtypes; di++) {
            const cli_preset *p = o->presets[pi];
            const pkv_config c = cli_config(1, p->heads, p->kv_heads, p->head_dim,
                                            o->block_tokens, o->dtypes[di], 1);
            if (cli_check_limits(CMD, &c, NULL) != CLI_OK)
                return CLI_USAGE;
        }
    return CLI_OK;
}

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
 * runs minutes apart by up to 1.7x (docs/perf-log.md), falls on every row of a round
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

/* `--spill` mode: its own small option set, then tools/bench/spill.c. -1: not asked. */
static int spill_mode(int argc, char **argv)
{
    bool spill = false, json = false;
    const char *dir = "/tmp";
    uint64_t mib = 256, reps = 5;
    for (int i = 1; i < argc; i++)
        spill |= strcmp(argv[i], "--spill") == 0;
    if (!spill)
        return -1;
    const cli_opt opts_[] = {
        {.name = "spill", .kind = OPT_FLAG, .dst = &spill},
        {.name = "json", .kind = OPT_FLAG, .dst = &json},
        {.name = "spill-dir", .kind = OPT_STRING, .dst = &dir},
        {.name = "spill-mib", .kind = OPT_U64, .dst = &mib, .lo = 1, .hi = 1u << 20},
        {.name = "reps", .kind = OPT_U64, .dst = &reps, .lo = 1, .hi = 1000},
    };
    int rc = cli_parse(CMD, argc, argv, opts_, sizeof opts_ / sizeof opts_[0], usage, NULL,
                       0, NULL);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    if (cli_check_dir(CMD, "--spill-dir", dir) != CLI_OK)
        return CLI_USAGE;
    return bench_spill(dir, mib, (int)reps, json);
}

int cmd_bench(int argc, char **argv)
{
    int sm = spill_mode(argc, argv);
    if (sm >= 0)
        return sm;
    for (int i = 1; i < argc; i++) /* the many-query rows: bench/many.c */
        if (!strncmp(argv[i], "--verify", 8) || !strncmp(argv[i], "--shared", 8) ||
            !strncmp(argv[i], "--prefill-after", 15))
            return bench_many(argc, argv);
    bench_opts o;
    int rc = parse(argc, argv, &o);
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
    /* the integer path (SPEC §9) of each block type: measured where the engine takes
     * quant_dot = 1 for the first preset's geometry, otherwise reported unavailable */
    for (pkv_dtype dt = PKV_Q8; dt <= PKV_Q4; dt++) {
        const cli_preset *p = o.presets[0];
        pkv_config c = cli_config(1, p->heads, p->kv_heads, p->head_dim, o.block_tokens, dt,
                                  1);
        c.quant_dot = 1;
        b->int_ok[dt] = pkv_config_explain(&c, b->int_why[dt], sizeof b->int_why[dt]) ==
                        PKV_OK;
    }
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

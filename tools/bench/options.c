/*
 * bench/options.c - the command line of `pagedkv bench`: the usage text, the option
 * lists (presets, contexts, dtypes, thread counts), the defaults of the short run and
 * of --full, and the --spill mode's own options. Fills a bench_opts (bench.h); the
 * measuring is bench/bench.c's.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
"Then the roofline of every row (docs/performance.md): the DRAM bound (its bytes\n"
"over the bandwidth of the same rounds) and the compute bound (its arithmetic over\n"
"the FMA peak, and for the integer path the int8 dot peak, both measured in this\n"
"run), which one binds, the fraction of that bound the decode reaches and its time\n"
"relative to f16 (a row faster than its bound is marked: its K/V came from cache);\n"
"and the in-cache fraction of the compute bound (--in-cache tokens). Q8/Q4 run on\n"
"the exact path and, where the engine accepts pkv_config.quant_dot = 1, on the\n"
"integer path (otherwise the report says why it is unavailable).\n"
"\n"
"The default run is short (under a minute on a quiet machine): contexts 4096 and\n"
"32768, 5 rounds, a bandwidth buffer of 8x the last-level cache (256 MiB at least,\n"
"2 GiB at most), the scalar reference up to 4096 tokens, a 1024-token prefill.\n"
"--full is the long run: contexts up to 131072, 7 rounds, a 2 GiB buffer, the scalar\n"
"reference up to 32768, a 4096-token prefill. Any option below overrides either.\n"
"Progress goes to stderr (--quiet: none).\n"
"\n"
"options:\n"
"  --full               the long run's defaults (above)\n"
"  --model-preset LIST  comma-separated presets (default llama3-8b; 'all' = llama3-8b,\n"
"                       mqa,mha,d64,d256); one layer of each is measured\n"
"  --ctx LIST           context lengths (default 4096,32768; --full: and 131072; k/m\n"
"                       suffixes)\n"
"  --dtype LIST         f16,bf16,f32,q8,q4 (default all five)\n"
"  --threads LIST       thread counts (default 1 and the number of online CPUs;\n"
"                       0 = all online CPUs)\n"
"  --reps N             rounds per figure (default 5, --full 7; scalar and naive use\n"
"                       <= %u, fewer once they have taken %.0f s)\n"
"  --block-tokens N     tokens per page (default: the library's)\n"
"  --prefill N          prompt length of the prefill measurement, run with the first\n"
"                       --dtype (default 1024, --full 4096; 0 skips it)\n"
"  --bw-mib N           bandwidth probe buffer in MiB (default 8x the last-level\n"
"                       cache, 256..2048; --full 2048)\n"
"  --in-cache N         tokens of the in-cache measurement (default 4096; 0 skips it)\n"
"  --no-scalar          skip the scalar reference\n"
"  --no-naive           skip the naive implementation\n"
"  --scalar-max-ctx N   skip the scalar reference above this context (default 4096,\n"
"                       --full 32768: its ratio is flat in the context, and it is\n"
"                       the slowest row; 0 = no limit)\n"
"  --in-turn            time the rows of a context one after another (what bench does\n"
"                       when their sessions do not fit in memory at once, below)\n"
"  --force              run even when the largest context's buffers (below) exceed\n"
"                       the memory available now (MemAvailable)\n"
"  --json               one JSON object on stdout instead of the table\n"
"  --quiet              no progress on stderr\n"
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
"spill mode (spill and restore next to the disk's own speed):\n"
"  --spill              instead of decode: two sessions of --spill-mib MiB each on an\n"
"                       engine whose budget holds one; alternating decodes spill one\n"
"                       and restore the other. GB/s of spill+restore I/O next to a plain\n"
"                       sequential write+read of the same bytes, both backends\n"
"  --spill-dir DIR      where the spill file and the plain file go (default /tmp)\n"
"  --spill-mib N        MiB per session (default 256); --reps and --json apply\n"
"  (--spill --json keys: the envelope, spill_dir, spill {mib_per_session, reps,\n"
"  backends (list of {backend, spill_restore_gbs, plain_seq_gbs, ratio})})\n"
"\n"
"many-query mode (a page read once for many queries; bench --verify 1 --help):\n"
"  --verify K           pkv_verify of K drafts against K pkv_decode calls\n"
"  --shared N           one pkv_decode_batch of N prefix forks against N decodes\n"
"  --prefill-after C    pkv_prefill after C cached tokens against the FMA peak\n"
"\n"
"JSON keys (decode mode): the envelope of every command (tool, command, version,\n"
"isa, host, cpu, online_cpus, argv), then reps, bw_buffer_bytes, llc_bytes,\n"
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

int bench_parse(int argc, char **argv, bench_opts *o)
{
    memset(o, 0, sizeof *o);
    uint64_t reps = 5, bt = 0, prefill = 1024, in_cache = 4096, bw_mib = 0;
    bool reps_set = false, prefill_set = false, bw_set = false, scalar_set = false;
    const char *spill_only = NULL;   /* never read: refused without --spill */
    static const char *const spill_why = "it sets the spill benchmark (--spill)";
    o->scalar_max_ctx = 4096;
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
        {.name = "reps", .kind = OPT_U64, .dst = &reps, .lo = 1, .hi = 1000,
         .seen = &reps_set},
        {.name = "block-tokens", .kind = OPT_U64, .dst = &bt, .lo = 0, .hi = UINT32_MAX},
        {.name = "prefill", .kind = OPT_U64, .dst = &prefill, .lo = 0, .hi = 1u << 20,
         .seen = &prefill_set},
        {.name = "bw-mib", .kind = OPT_U64, .dst = &bw_mib, .lo = 1, .hi = 1u << 20,
         .seen = &bw_set},
        {.name = "in-cache", .kind = OPT_U64, .dst = &in_cache, .lo = 0, .hi = 1u << 20},
        {.name = "scalar-max-ctx", .kind = OPT_U64, .dst = &o->scalar_max_ctx, .lo = 0,
         .hi = UINT64_MAX, .seen = &scalar_set},
        {.name = "full", .kind = OPT_FLAG, .dst = &o->full},
        {.name = "quiet", .kind = OPT_FLAG, .dst = &o->quiet},
        {.name = "no-scalar", .kind = OPT_CLEAR, .dst = &o->scalar},
        {.name = "no-naive", .kind = OPT_CLEAR, .dst = &o->naive},
        {.name = "force", .kind = OPT_FLAG, .dst = &o->force},
        {.name = "in-turn", .kind = OPT_FLAG, .dst = &o->in_turn},
        {.name = "json", .kind = OPT_FLAG, .dst = &o->json},
        /* the spill mode's own options (spill_mode: with --spill they are read there) */
        {.name = "spill-dir", .kind = OPT_STRING, .dst = &spill_only, .needs = "spill",
         .why = spill_why},
        {.name = "spill-mib", .kind = OPT_STRING, .dst = &spill_only, .needs = "spill",
         .why = spill_why},
    };
    int rc = cli_parse(CMD, argc, argv, opts_, sizeof opts_ / sizeof opts_[0], usage, NULL,
                       0, NULL);
    if (rc != CLI_OK)
        return rc;
    /* --full: the long run's defaults, where no option gave the figure */
    if (o->full) {
        reps = reps_set ? reps : 7;
        prefill = prefill_set ? prefill : 4096;
        bw_mib = bw_set ? bw_mib : 2048;
        o->scalar_max_ctx = scalar_set ? o->scalar_max_ctx : 32768;
    }
    if (!bw_mib) {
        /* 8x the last-level cache: a sum over it streams from DRAM whatever the cache
         * keeps; 256 MiB at least (an unknown or small cache), 2 GiB at most */
        const uint64_t llc_mib = bench_llc_bytes() >> 20;
        bw_mib = llc_mib * 8 < 256 ? 256 : llc_mib * 8 > 2048 ? 2048 : llc_mib * 8;
    }
    o->bw_mib = bw_mib;
    o->reps = (uint32_t)reps;
    o->block_tokens = (uint32_t)bt;
    o->prefill_tokens = (uint32_t)prefill;
    o->in_cache = (uint32_t)in_cache;
    if (o->n_presets == 0 && !(o->presets[o->n_presets++] = cli_preset_find("llama3-8b")))
        return cli_fail(CMD, "preset table lacks llama3-8b");
    static const uint64_t def_ctx[] = {4096, 32768, 131072};
    if (o->n_ctx == 0)
        for (; o->n_ctx < (o->full ? 3u : 2u); o->n_ctx++)
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

/* `--spill` mode: its own small option set, then tools/bench/spill.c. -1: not asked. */
int bench_spill_mode(int argc, char **argv)
{
    bool spill = false, json = false, quiet = false;
    const char *dir = "/tmp";
    uint64_t mib = 256, reps = 5;
    for (int i = 1; i < argc; i++)
        spill |= strcmp(argv[i], "--spill") == 0;
    if (!spill)
        return -1;
    static const char *const decode_only = "does not combine with --spill (the decode "
                                           "benchmark's option)";
    const char *ignored = NULL;
    const cli_opt opts_[] = {
        {.name = "spill", .kind = OPT_FLAG, .dst = &spill},
        {.name = "model-preset", .kind = OPT_STRING, .dst = &ignored, .refused = decode_only},
        {.name = "ctx", .kind = OPT_STRING, .dst = &ignored, .refused = decode_only},
        {.name = "dtype", .kind = OPT_STRING, .dst = &ignored, .refused = decode_only},
        {.name = "threads", .kind = OPT_STRING, .dst = &ignored, .refused = decode_only},
        {.name = "block-tokens", .kind = OPT_STRING, .dst = &ignored, .refused = decode_only},
        {.name = "prefill", .kind = OPT_STRING, .dst = &ignored, .refused = decode_only},
        {.name = "bw-mib", .kind = OPT_STRING, .dst = &ignored, .refused = decode_only},
        {.name = "in-cache", .kind = OPT_STRING, .dst = &ignored, .refused = decode_only},
        {.name = "json", .kind = OPT_FLAG, .dst = &json},
        {.name = "spill-dir", .kind = OPT_STRING, .dst = &dir},
        {.name = "spill-mib", .kind = OPT_U64, .dst = &mib, .lo = 1, .hi = 1u << 20},
        {.name = "reps", .kind = OPT_U64, .dst = &reps, .lo = 1, .hi = 1000},
        {.name = "full", .kind = OPT_FLAG, .dst = &spill, .refused = decode_only},
        {.name = "quiet", .kind = OPT_FLAG, .dst = &quiet},
    };
    int rc = cli_parse(CMD, argc, argv, opts_, sizeof opts_ / sizeof opts_[0], usage, NULL,
                       0, NULL);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    if (cli_check_dir(CMD, "--spill-dir", dir) != CLI_OK)
        return CLI_USAGE;
    return bench_spill(dir, mib, (int)reps, json);
}


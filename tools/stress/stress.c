/*
 * stress/stress.c - `pagedkv stress`: drive sessions to long contexts and report decode
 * latency against context length and memory per session (docs/tools.md).
 *
 * Owns: option parsing, the token loop (append every token to every layer of every
 * session; decode at scheduled lengths), the fork checks, the memory check against
 * the formula, progress. Does not own: the text/JSON summary and the SVG plot
 * (stress/report.c, from the stress_run of stress.h); anything in the library; it
 * uses only the public API.
 *
 * Invariants
 *   - Every session holds the same number of tokens in every layer: `done` after each
 *     pass of the token loop (a pass is one token for every session and layer).
 *   - Without spill, at every decode point and at the end, for each session of length
 *     n: bytes_resident == layers * ceil(n / bt) * page_bytes and
 *     bytes_ideal == layers * n * g * (row_bytes(d) + row_bytes(dv)) (for f32/f16/bf16
 *     pkv_kv_cache_bytes(layers, g, d, n, 1, dtype_size)); with spill,
 *     bytes_resident + bytes_spilled takes the place of bytes_resident. A mismatch is
 *     reported and makes the exit status 1.
 *   - With variants (docs/variants.md) the same identities hold with a windowed layer's pages
 *     given by cli_variant_pages_held (which never exceeds the ceiling
 *     ceil(S/bt) + ceil((W+R)/bt) + 1) and its ideal by min(n, S + W + R) positions,
 *     each g * (d + dv) values; every windowed layer's own pages are checked too.
 *   - Forks are transient: forked, checked and destroyed within one pass, so they do
 *     not change the figures above.
 *   - The SIGINT handler only sets a sig_atomic_t flag; the loop polls it between
 *     tokens and between decodes, then the summary of the work so far is printed.
 */
#include <math.h>
#include <stdarg.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/model.h"
#include "common/opt.h"
#include "stress/stress.h"
#include "common/mpi_tools.h"

#define CMD "stress"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pagedkv stress [OPTIONS]\n\n"
        "Append tokens to one or more sessions up to a long context, decode at about 64\n"
        "log-spaced context lengths, and report decode latency against context length,\n"
        "append rate and memory per session, checked to the byte against the formula.\n\n"
        );
    cli_model_usage(f);
    fprintf(f,
        "run:\n"
        "  --ctx N              tokens per session (default 65536; k/m/g suffixes)\n"
        "  --sessions N         sessions appended round-robin (default 1)\n"
        "  --decode-every K     also decode every K tokens (default 0: log-spaced only)\n"
        "  --points N           log-spaced decode lengths (default 64)\n"
        "  --reps N             timed decodes per session, layer and point (default 3)\n"
        "  --fork-every N       every N tokens fork each session, check copy-on-write\n"
        "                       (shared pages, bitwise-equal decode), drop the fork\n"
        "  --prefix P           prefix cache (docs/prefix-cache.md): --sessions sessions\n"
        "                       sharing a P-token prefix, built with and without the\n"
        "                       cache; memory and append work of both (--svg plots them)\n"
        "  --prefix-tail T      with --prefix: tokens of each session's own (default 256)\n"
        "  --shift N            context shift (docs/rope.md): every layer with the engine's\n"
        "                       RoPE, fill --ctx, then N times keep --keep positions,\n"
        "                       drop half of the rest and fill again; memory and decode\n"
        "                       time after each shift (flat), --svg plots them\n"
        "  --keep N             with --shift: positions kept at the start (default 1)\n"
        "  --verify K           at each decode point, a pkv_verify of K drafts (up to 16)\n"
        "                       against K pkv_decode calls (layer 0, session 0)\n"
        "  --shared N           at each decode point, one pkv_decode_batch of N forks (up\n"
        "                       to 16) against N pkv_decode calls (docs/speculative.md)\n"
        "  --budget BYTES       resident page budget (0 = none)\n"
        "  --spill-dir DIR      spill pages beyond the budget to a file in DIR\n"
        "  --force              run without --budget even if the K/V cache exceeds the\n"
        "                       memory available now (MemAvailable; refused otherwise)\n"
        "  --threads N          engine threads (default 0: all CPUs)\n"
        "  --seed N             seed of the random K/V/Q rows (default 1)\n"
        "output:\n"
        "  --json               one JSON object on stdout instead of the text summary\n"
        "  --svg FILE           plot latency and memory against context to FILE\n"
        "                       (checked before the run: a usage error if it cannot be\n"
        "                       written)\n"
        "  --svg-logx           logarithmic context axis in the plot\n"
        "  --quiet              no progress on stderr\n"
        "  --mpi                one context sharded over MPI ranks (mpirun -np R ...):\n"
        "                       the same model options; its run options: pagedkv\n"
        "                       stress --mpi --help\n"
        "  --help               this text\n\n"
        "Progress goes to stderr (a bar on a terminal). Ctrl-C stops and prints the\n"
        "summary so far (exit 130). Exit 1 on a library error or a memory mismatch,\n"
        "2 on a usage error.\n");
}

/* ---- options -------------------------------------------------------------------- */

static int parse_opts(int argc, char **argv, stress_opts *o)
{
    *o = (stress_opts){.ctx = 65536, .sessions = 1, .seed = 1, .points = 64, .reps = 3,
                       .prefix_tail = 256, .keep = 1};
    cli_model m = cli_model_default();
    static const char *const mpi_only = "it is an option of one context over MPI ranks";
    const char *mpi_value = NULL;   /* never read: those options are refused here */
    cli_opt opts[CLI_MODEL_NOPTS + 24] = {
        {.name = "ctx", .kind = OPT_U64, .dst = &o->ctx, .lo = 1, .hi = UINT64_MAX},
        {.name = "sessions", .kind = OPT_U32, .dst = &o->sessions, .lo = 1, .hi = 65536},
        {.name = "decode-every", .kind = OPT_U64, .dst = &o->decode_every, .lo = 0,
         .hi = UINT64_MAX},
        {.name = "points", .kind = OPT_U32, .dst = &o->points, .lo = 2, .hi = UINT32_MAX},
        {.name = "reps", .kind = OPT_U32, .dst = &o->reps, .lo = 1, .hi = 1000},
        {.name = "fork-every", .kind = OPT_U64, .dst = &o->fork_every, .lo = 0,
         .hi = UINT64_MAX},
        {.name = "prefix", .kind = OPT_U64, .dst = &o->prefix, .lo = 1, .hi = 1ull << 31},
        {.name = "shift", .kind = OPT_U32, .dst = &o->shift, .lo = 1, .hi = 1u << 20},
        {.name = "keep", .kind = OPT_U64, .dst = &o->keep, .lo = 0, .hi = UINT64_MAX,
         .needs = "shift", .why = "it is the positions each context shift keeps"},
        {.name = "prefix-tail", .kind = OPT_U64, .dst = &o->prefix_tail, .lo = 0,
         .hi = 1ull << 31, .needs = "prefix",
         .why = "it is the length of each session's own tokens after the shared prefix"},
        {.name = "budget", .kind = OPT_U64, .dst = &o->budget, .lo = 0, .hi = UINT64_MAX},
        {.name = "spill-dir", .kind = OPT_STRING, .dst = &o->spill_dir},
        {.name = "force", .kind = OPT_FLAG, .dst = &o->force},
        {.name = "threads", .kind = OPT_U32, .dst = &o->threads, .lo = 0,
         .hi = CLI_MAX_THREADS, .note = "0 = all CPUs; the engine's limit"},
        {.name = "seed", .kind = OPT_U64, .dst = &o->seed, .lo = 0, .hi = UINT64_MAX},
        {.name = "json", .kind = OPT_FLAG, .dst = &o->json},
        {.name = "svg", .kind = OPT_STRING, .dst = &o->svg},
        {.name = "svg-logx", .kind = OPT_FLAG, .dst = &o->svg_logx, .needs = "svg",
         .why = "it sets the context axis of the plot"},
        {.name = "quiet", .kind = OPT_FLAG, .dst = &o->quiet},
        {.name = "verify", .kind = OPT_U32, .dst = &o->verify, .lo = 1, .hi = STRESS_MANY_MAX},
        {.name = "shared", .kind = OPT_U32, .dst = &o->shared, .lo = 2, .hi = STRESS_MANY_MAX},
        /* the options of `stress --mpi` alone (stress/mpi.c), refused in its words */
        {.name = "exchange", .kind = OPT_STRING, .dst = &mpi_value, .needs = "mpi",
         .why = mpi_only},
        {.name = "check", .kind = OPT_STRING, .dst = &mpi_value, .needs = "mpi",
         .why = mpi_only},
        {.name = "timeout", .kind = OPT_STRING, .dst = &mpi_value, .needs = "mpi",
         .why = mpi_only},
    };
    size_t n = 0;
    while (opts[n].name)
        n++;
    cli_model_opts(&m, opts + n);
    n += CLI_MODEL_NOPTS;
    int rc = cli_parse(CMD, argc, argv, opts, n, usage, NULL, 0, NULL);
    if (rc != CLI_OK)
        return rc;
    if (cli_model_resolve(CMD, &m) != CLI_OK)
        return CLI_USAGE;
    o->preset = m.preset;
    o->layers = m.layers;
    o->heads = m.heads;
    o->kv_heads = m.kv_heads;
    o->head_dim = m.head_dim;
    o->head_dim_v = m.head_dim_v;
    o->block_tokens = m.block_tokens;
    o->dtype = m.dtype;
    o->v = m.v;
    /* the plot is written after the run: a path that cannot take it fails now */
    if (o->svg && cli_check_output_file(CMD, "--svg", o->svg) != CLI_OK)
        return CLI_USAGE;
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim,
                              o->block_tokens, o->dtype, o->threads);
    c.head_dim_v = o->head_dim_v;
    if (cli_check_limits(CMD, &c, NULL) != CLI_OK)   /* --threads */
        return CLI_USAGE;
    uint64_t total;
    if (cli_kv_bytes(&c, o->ctx, o->sessions, &total) != PKV_OK ||
        (uint64_t)o->heads * o->head_dim > (1u << 24) ||
        (uint64_t)o->heads * o->head_dim_v > (1u << 24))
        return cli_usage_error(CMD, "the geometry or context is too large");
    return CLI_OK;
}

/* ---- small helpers -------------------------------------------------------------- */

static bool grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return true;
    size_t nc = *cap ? *cap * 2 : 256;
    while (nc < need)
        nc *= 2;
    if (nc > SIZE_MAX / elem)
        return false;
    void *q = realloc(*p, nc * elem);
    if (!q)
        return false;
    *p = q;
    *cap = nc;
    return true;
}

static void fill(float *x, size_t n, uint64_t *s)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((double)(cli_splitmix64(s) >> 40) * (2.0 / 16777216.0) - 1.0);
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted v[0..n). */
static double pct(const float *v, size_t n, double p)
{
    size_t r = (size_t)ceil(p * (double)n);
    return v[r ? r - 1 : 0];
}

static bool is_decode_point(stress_run *r, uint64_t n)
{
    bool hit = n == r->o.ctx || (r->o.decode_every && n % r->o.decode_every == 0);
    while (r->sched_i < r->n_sched && r->sched[r->sched_i] <= n) {
        hit = hit || r->sched[r->sched_i] == n;
        r->sched_i++;
    }
    return hit;
}

/* ---- setup ---------------------------------------------------------------------- */

static int setup(stress_run *r)
{
    const stress_opts *o = &r->o;
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim, o->block_tokens,
                              o->dtype, o->threads);
    c.mem_budget = o->budget;
    c.spill_dir = o->spill_dir;
    c.head_dim_v = o->head_dim_v;
    bool oom = false;
    r->lc = cli_variant_layers(&o->v, o->layers, o->heads, &r->sink_store, &oom);
    if (oom)
        return cli_fail(CMD, "out of memory");
    c.layer_cfg = r->lc;
    pkv_status st = pkv_engine_create(&c, &r->eng);
    if (st != PKV_OK) {
        char why[256];
        if (pkv_config_explain(&c, why, sizeof why) != PKV_OK)
            return cli_fail(CMD, "cannot create the engine: %s", why);
        return cli_fail(CMD, "cannot create the engine: %s", pkv_status_str(st));
    }
    pkv_config rc;
    pkv_stats s;
    if ((st = pkv_engine_config(r->eng, &rc)) != PKV_OK ||
        (st = pkv_engine_stats(r->eng, &s)) != PKV_OK)
        return cli_fail(CMD, "cannot read the engine's figures: %s", pkv_status_str(st));
    r->bt = rc.block_tokens;
    r->dv = rc.head_dim_v;
    r->windowed = cli_variant_windowed_layers(&o->v, o->layers);
    r->ceiling = r->windowed ? cli_variant_page_ceiling(&o->v, r->bt) : 0;
    r->steady_from = r->windowed ? (uint64_t)o->v.sinks + o->v.window + o->v.rollback + r->bt
                                 : 0;
    r->o.threads = rc.n_threads;
    r->page_bytes = s.page_bytes;
    r->isa = s.isa;
    r->io = s.io_backend;
    r->row_pair = pkv_row_bytes(o->dtype, o->head_dim) + pkv_row_bytes(o->dtype, r->dv);
    r->spill = o->budget && o->spill_dir;
    r->sess = calloc(o->sessions, sizeof *r->sess);
    if (!r->sess)
        return cli_fail(CMD, "out of memory");
    for (uint32_t i = 0; i < o->sessions; i++)
        if ((st = pkv_session_create(r->eng, &r->sess[i])) != PKV_OK)
            return cli_fail(CMD, "cannot create session %u: %s", i, pkv_status_str(st));

    /* One block of random rows, cycled with a per-token offset: generating fresh
     * values per token would cost more than the append being measured. */
    size_t gd = (size_t)o->kv_heads * o->head_dim, hd = (size_t)o->heads * o->head_dim;
    size_t gdv = (size_t)o->kv_heads * r->dv, hdv = (size_t)o->heads * r->dv;
    size_t per_row = gd + gdv + hd;
    size_t rows = ((size_t)4 << 20) / per_row;   /* ~16 MB, at least 17 rows */
    r->rows = (uint32_t)(rows > 1021 ? 1021 : rows < 17 ? 17 : rows);
    r->K = malloc(r->rows * gd * sizeof(float));
    r->V = malloc(r->rows * gdv * sizeof(float));
    r->Q = malloc(r->rows * hd * sizeof(float));
    r->out = malloc(hdv * sizeof(float));
    r->out2 = malloc(hdv * sizeof(float));
    r->lat = malloc((size_t)o->sessions * o->layers * o->reps * sizeof(float));
    r->wlat = malloc((size_t)o->sessions * o->layers * o->reps * sizeof(float));
    r->sched = malloc(o->points * sizeof(uint64_t));
    if (!r->K || !r->V || !r->Q || !r->out || !r->out2 || !r->lat || !r->wlat || !r->sched)
        return cli_fail(CMD, "out of memory");
    uint64_t seed = o->seed;
    fill(r->K, r->rows * gd, &seed);
    fill(r->V, r->rows * gdv, &seed);
    fill(r->Q, r->rows * hd, &seed);

    /* n_i = ctx^(i/(P-1)): 1 .. ctx, equal ratios; duplicates of short lengths merge */
    for (uint32_t i = 0; i < o->points; i++) {
        double x = exp(log((double)o->ctx) * i / (o->points - 1));
        uint64_t n = (uint64_t)llround(x);
        n = n < 1 ? 1 : n > o->ctx ? o->ctx : n;
        if (r->n_sched == 0 || n > r->sched[r->n_sched - 1])
            r->sched[r->n_sched++] = n;
    }
    return CLI_OK;
}

static const float *row(const stress_run *r, const float *base, size_t width, uint64_t t,
                        uint32_t s, uint32_t l)
{
    return base + (size_t)((t + 7u * s + 13u * l) % r->rows) * width;
}

/* ---- checks --------------------------------------------------------------------- */

static void note(char *buf, uint64_t *count, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void note(char *buf, uint64_t *count, const char *fmt, ...)
{
    if ((*count)++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, 256, fmt, ap);
        va_end(ap);
    }
}

/* Pages the release rule (docs/variants.md) says a session of length n holds, all layers (cli.h).
 * */
static uint64_t pages_expected(const stress_run *r, uint64_t n)
{
    uint64_t pages = 0;
    for (uint32_t l = 0; l < r->o.layers; l++)
        pages += cli_variant_pages_held(&r->o.v, cli_variant_windowed(&r->o.v, l), n, r->bt);
    return pages;
}

/* What an unpaged cache of what the decodes can still read needs, at length n: every
 * position of a full layer, sinks + window + rollback positions of a windowed one;
 * one position is g * (head_dim + head_dim_v) values. */
static uint64_t ideal_expected(const stress_run *r, uint64_t n)
{
    const stress_opts *o = &r->o;
    const uint64_t tok = (uint64_t)o->kv_heads * r->row_pair;
    const uint64_t keep = (uint64_t)o->v.sinks + o->v.window + o->v.rollback;
    uint64_t ideal = 0;
    for (uint32_t l = 0; l < o->layers; l++)
        ideal += (cli_variant_windowed(&o->v, l) && n > keep ? keep : n) * tok;
    return ideal;
}

/* The memory report of every session against the formula, at length n; with a window
 * also every windowed layer's pages against the release rule (docs/variants.md) and ceiling. */
static void check_memory(stress_run *r, uint64_t n, stress_point *pt)
{
    const stress_opts *o = &r->o;
    uint64_t pages = pages_expected(r, n), ideal = ideal_expected(r, n);
    for (uint32_t s = 0; s < o->sessions; s++) {
        pkv_memory m;
        pkv_status st = pkv_session_memory(r->sess[s], &m);
        r->checks++;
        if (st != PKV_OK) {
            note(r->mismatch, &r->mismatches, "session %u: pkv_session_memory: %s", s,
                 pkv_status_str(st));
            continue;
        }
        if (pt) {
            pt->resident += m.bytes_resident;
            pt->shared += m.bytes_shared;
            pt->spilled += m.bytes_spilled;
            pt->ideal += m.bytes_ideal;
            pt->pages += m.blocks;
        }
        for (uint32_t l = 0; r->windowed && l < o->layers; l++) {
            if (!cli_variant_windowed(&o->v, l))
                continue;
            const uint64_t held = cli_layer_pages_held(r->sess[s], l);
            const uint64_t want = cli_variant_pages_held(&o->v, true, n, r->bt);
            if (held != UINT64_MAX && held > r->window_pages_max)
                r->window_pages_max = held;
            if (pt && held != UINT64_MAX && held > pt->window_pages_max)
                pt->window_pages_max = held;
            if (held != want || held > r->ceiling)
                note(r->mismatch, &r->mismatches,
                     "session %u layer %u at %llu tokens: %llu pages held, the window's "
                     "rule says %llu, the page ceiling %llu", s, l, (unsigned long long)n,
                     (unsigned long long)held, (unsigned long long)want,
                     (unsigned long long)r->ceiling);
        }
        uint64_t held = r->spill ? m.bytes_resident + m.bytes_spilled : m.bytes_resident;
        if (held != pages * r->page_bytes || m.bytes_ideal != ideal ||
            m.tokens != n * o->layers || m.blocks != pages ||
            (!r->spill && (m.bytes_shared != 0 || m.bytes_spilled != 0)))
            note(r->mismatch, &r->mismatches,
                 "session %u at %llu tokens: %s %llu (formula %llu), bytes_ideal %llu "
                 "(formula %llu), blocks %llu (%llu), shared %llu, spilled %llu",
                 s, (unsigned long long)n, r->spill ? "resident+spilled" : "bytes_resident",
                 (unsigned long long)held, (unsigned long long)(pages * r->page_bytes),
                 (unsigned long long)m.bytes_ideal, (unsigned long long)ideal,
                 (unsigned long long)m.blocks, (unsigned long long)pages,
                 (unsigned long long)m.bytes_shared, (unsigned long long)m.bytes_spilled);
    }
}

/* Fork session s at length n and check copy-on-write: the fork shares every page,
 * decodes bitwise like its parent, and one token appended to it copies or adds one
 * page per layer while the parent's result stays bitwise the same. */
static pkv_status fork_check(stress_run *r, uint32_t s, uint64_t n)
{
    const stress_opts *o = &r->o;
    size_t hd = (size_t)o->heads * o->head_dim, gd = (size_t)o->kv_heads * o->head_dim;
    size_t hdv = (size_t)o->heads * r->dv, gdv = (size_t)o->kv_heads * r->dv;
    pkv_session *p = r->sess[s], *c = NULL;
    pkv_status st = pkv_session_fork(p, &c);
    if (st != PKV_OK)
        return st;
    r->forks++;
    const float *q = row(r, r->Q, hd, n, s, 0);
    pkv_memory mp, mc;
    uint64_t pb = r->page_bytes;
    if ((st = pkv_session_memory(p, &mp)) != PKV_OK ||
        (st = pkv_session_memory(c, &mc)) != PKV_OK)
        goto out;
    if (!r->spill && (mc.bytes_resident != mp.bytes_resident ||
                      mc.bytes_shared != mc.bytes_resident ||
                      mp.bytes_shared != mp.bytes_resident))
        note(r->fork_msg, &r->fork_bad,
             "fork of session %u at %llu: resident %llu/%llu, shared %llu/%llu", s,
             (unsigned long long)n, (unsigned long long)mp.bytes_resident,
             (unsigned long long)mc.bytes_resident, (unsigned long long)mp.bytes_shared,
             (unsigned long long)mc.bytes_shared);
    if ((st = pkv_decode(p, 0, q, r->out)) != PKV_OK ||
        (st = pkv_decode(c, 0, q, r->out2)) != PKV_OK)
        goto out;
    if (memcmp(r->out, r->out2, hdv * sizeof(float)) != 0)
        note(r->fork_msg, &r->fork_bad, "fork of session %u at %llu decodes differently",
             s, (unsigned long long)n);
    for (uint32_t l = 0; l < o->layers; l++)
        if ((st = pkv_append(c, l, row(r, r->K, gd, n + 1, s, l),
                             row(r, r->V, gdv, n + 1, s, l))) != PKV_OK)
            goto out;
    if ((st = pkv_session_memory(c, &mc)) != PKV_OK)
        goto out;
    /* every page the fork holds at n + 1 but its last (new, or copied from the shared
     * partial tail) is still the parent's; a window may have dropped one more */
    uint64_t held1 = pages_expected(r, n + 1);
    uint64_t want_res = held1 * pb;                            /* ceil((n+1)/bt) full */
    uint64_t want_shared = (held1 - o->layers) * pb;           /* whole pages stay shared */
    if (!r->spill && (mc.bytes_resident != want_res || mc.bytes_shared != want_shared))
        note(r->fork_msg, &r->fork_bad,
             "fork of session %u at %llu after one append: resident %llu (want %llu), "
             "shared %llu (want %llu)", s, (unsigned long long)n,
             (unsigned long long)mc.bytes_resident, (unsigned long long)want_res,
             (unsigned long long)mc.bytes_shared, (unsigned long long)want_shared);
    if ((st = pkv_decode(p, 0, q, r->out2)) != PKV_OK)
        goto out;
    if (memcmp(r->out, r->out2, hdv * sizeof(float)) != 0)
        note(r->fork_msg, &r->fork_bad,
             "session %u at %llu changed when its fork appended", s, (unsigned long long)n);
out:
    pkv_session_destroy(c);
    return st;
}

/* ---- the loop ------------------------------------------------------------------- */

/* Positions one decode at length n reads, averaged over the layers: a windowed layer
 * reads at most sinks + window. */
static double read_ctx(const stress_run *r, uint64_t n)
{
    const stress_opts *o = &r->o;
    if (!r->windowed)
        return (double)n;
    const uint64_t wmax = (uint64_t)o->v.sinks + o->v.window;
    const double w = (double)(n < wmax ? n : wmax);
    return ((double)(o->layers - r->windowed) * (double)n + (double)r->windowed * w) /
           (double)o->layers;
}

/* Work left in seconds, from the rates measured so far: appends cost per token,
 * decodes per token of context they read. */
static double eta(const stress_run *r)
{
    const stress_opts *o = &r->o;
    double left_tok = (double)(o->ctx - r->done), left_ctx = 0;
    for (size_t i = r->sched_i; i < r->n_sched; i++)
        left_ctx += read_ctx(r, r->sched[i]);
    if (o->decode_every) {
        double k = (double)o->decode_every, a = floor((double)r->done / k) + 1,
               b = floor((double)o->ctx / k);
        if (b >= a && !r->windowed)
            left_ctx += k * (a + b) * (b - a + 1) / 2;
        else if (b >= a)
            left_ctx += (b - a + 1) * read_ctx(r, o->ctx);
    }
    left_ctx *= (double)o->sessions * o->layers * o->reps;
    double per_tok = r->done ? r->append_s / (double)r->done : 0;
    double per_ctx = r->decoded_ctx > 0 ? r->decode_s / r->decoded_ctx : 0;
    return left_tok * per_tok + left_ctx * per_ctx;
}

static void progress(stress_run *r, bool tty, double *last, bool final)
{
    double now = cli_now();
    if (r->o.quiet || (!final && now - *last < (tty ? 0.2 : 5.0)))
        return;
    *last = now;
    double el = now - r->t_start, frac = (double)r->done / (double)r->o.ctx;
    double rate = el > 0 ? (double)r->done * r->o.sessions / el : 0, e = eta(r);
    if (tty) {
        char bar[31];
        int fill_n = (int)(frac * 30);
        for (int i = 0; i < 30; i++)
            bar[i] = i < fill_n ? '#' : '.';
        bar[30] = 0;
        fprintf(stderr, "\r[%s] %5.1f%% %llu/%llu tokens %.0f tok/s ETA %d:%02d\033[K%s", bar,
                100 * frac, (unsigned long long)r->done, (unsigned long long)r->o.ctx,
                rate, (int)(e / 60), (int)fmod(e, 60), final ? "\n" : "");
    } else {
        fprintf(stderr, "pagedkv stress: %.1f%% (%llu/%llu tokens), %.0f tokens/s, "
                        "ETA %.0f s\n", 100 * frac, (unsigned long long)r->done,
                (unsigned long long)r->o.ctx, rate, e);
    }
}

static pkv_status decode_point(stress_run *r, uint64_t n)
{
    const stress_opts *o = &r->o;
    size_t hd = (size_t)o->heads * o->head_dim, hdv = (size_t)o->heads * r->dv, k = 0, kw = 0;
    pkv_status st = PKV_OK;
    for (uint32_t rep = 0; rep < o->reps; rep++)
        for (uint32_t s = 0; s < o->sessions; s++)
            for (uint32_t l = 0; l < o->layers; l++) {
                if (cli_interrupted())   /* a long context's round can take minutes */
                    goto measured;
                const float *q = row(r, r->Q, hd, n + rep, s, l);
                double t0 = cli_now();
                st = pkv_decode(r->sess[s], l, q, r->out);
                double dt = cli_now() - t0;
                if (st != PKV_OK)
                    return st;
                for (size_t i = 0; i < hdv && !r->error[0]; i++)
                    if (!isfinite(r->out[i]))
                        snprintf(r->error, sizeof r->error, "pkv_decode at %llu tokens "
                                 "(session %u, layer %u) returned a non-finite value",
                                 (unsigned long long)n, s, l);
                r->decode_s += dt;
                r->decoded_ctx += read_ctx(r, n);
                r->lat[k++] = (float)(dt * 1e6);
                if (cli_variant_windowed(&o->v, l))
                    r->wlat[kw++] = (float)(dt * 1e6);
                if (!grow((void **)&r->samples, &r->cap_samples, r->n_samples + 1,
                          sizeof(stress_sample)))
                    return PKV_ENOMEM;
                r->samples[r->n_samples++] = (stress_sample){n, (float)(dt * 1e6)};
            }
measured:
    if (k == 0)
        return PKV_OK;
    if (!grow((void **)&r->points, &r->cap_points, r->n_points + 1, sizeof(stress_point)))
        return PKV_ENOMEM;
    qsort(r->lat, k, sizeof(float), cmp_float);
    qsort(r->wlat, kw, sizeof(float), cmp_float);
    stress_point *pt = &r->points[r->n_points++];
    *pt = (stress_point){.ctx = n, .min = r->lat[0], .p50 = pct(r->lat, k, 0.5),
                  .p90 = pct(r->lat, k, 0.9),
                  .max = r->lat[k - 1], .rss = cli_rss_bytes(),
                  .p50_windowed = kw ? pct(r->wlat, kw, 0.5) : NAN};
    const pkv_status st2 = stress_many_point(r, n, pt);
    if (st2 != PKV_OK)
        return st2;
    check_memory(r, n, pt);
    return PKV_OK;
}

static void run(stress_run *r)
{
    const stress_opts *o = &r->o;
    size_t gd = (size_t)o->kv_heads * o->head_dim, gdv = (size_t)o->kv_heads * r->dv;
    bool tty = isatty(STDERR_FILENO);
    double last = 0;
    pkv_status st = PKV_OK;
    const char *what = "";
    r->t_start = last = cli_now();
    if (!o->quiet)
        fprintf(stderr, "pagedkv stress: %u session(s) x %llu tokens, %u layer(s)%s\n",
                o->sessions, (unsigned long long)o->ctx, o->layers,
                tty ? "" : "; progress every 5 s");
    while (r->done < o->ctx && !cli_interrupted()) {
        uint64_t t = r->done;
        double t0 = cli_now();
        for (uint32_t s = 0; s < o->sessions && st == PKV_OK; s++)
            for (uint32_t l = 0; l < o->layers && st == PKV_OK; l++)
                st = pkv_append(r->sess[s], l, row(r, r->K, gd, t, s, l),
                                row(r, r->V, gdv, t, s, l));
        r->append_s += cli_now() - t0;
        if (st != PKV_OK) {
            /* the sessions now differ in length: the summary counts whole passes */
            what = "pkv_append";
            break;
        }
        r->done = t + 1;
        if (o->fork_every && r->done % o->fork_every == 0 && r->done < o->ctx) {
            for (uint32_t s = 0; s < o->sessions && st == PKV_OK; s++)
                st = fork_check(r, s, r->done);
            if (st != PKV_OK) {
                what = "fork check";
                break;
            }
        }
        if (is_decode_point(r, r->done) && (st = decode_point(r, r->done)) != PKV_OK) {
            what = "pkv_decode";
            break;
        }
        if (r->error[0])   /* a decode gave NaN or infinity: already described */
            break;
        if ((t & 63) == 0)
            progress(r, tty, &last, false);
    }
    if (st != PKV_OK)
        snprintf(r->error, sizeof r->error, "%s at %llu tokens: %s", what,
                 (unsigned long long)r->done, pkv_status_str(st));
    progress(r, tty, &last, true);
    if (st == PKV_OK && r->done)
        check_memory(r, r->done, NULL);
}

static void cleanup(stress_run *r)
{
    for (uint32_t i = 0; r->sess && i < r->o.sessions; i++)
        pkv_session_destroy(r->sess[i]);
    pkv_engine_destroy(r->eng);
    free(r->sess);
    free(r->K);
    free(r->V);
    free(r->Q);
    free(r->out);
    free(r->out2);
    free(r->lat);
    free(r->wlat);
    free(r->sched);
    free(r->samples);
    free(r->points);
    free(r->lc);
    free(r->sink_store);
}

int cmd_stress(int argc, char **argv)
{
    if (mpi_tools_requested(argc, argv)) /* the context over MPI ranks: stress/mpi.c */
        return mpi_stress(argc, argv);
    stress_run r;
    memset(&r, 0, sizeof r);
    int rc = parse_opts(argc, argv, &r.o);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    if (r.o.prefix) /* the prefix cache (docs/prefix-cache.md): its own run */
        return stress_prefix(&r.o);
    if (r.o.shift) /* context shift (docs/rope.md): its own run */
        return stress_shift(&r.o);
    /* the budget and spill directory name their mistakes before any work; with spill
     * a decode still needs its whole layer resident, so a budget below one layer of
     * one session would fail at the first long decode */
    pkv_config c = cli_config(r.o.layers, r.o.heads, r.o.kv_heads, r.o.head_dim,
                              r.o.block_tokens, r.o.dtype, r.o.threads);
    c.mem_budget = r.o.budget;
    c.spill_dir = r.o.spill_dir;
    c.head_dim_v = r.o.head_dim_v;
    uint64_t page = 0;
    uint32_t bt = 0;
    if (cli_check_engine_memory(CMD, &c, "--budget", "--spill-dir", true, &page, &bt) !=
        CLI_OK)
        return CLI_USAGE;
    /* a windowed layer holds its ceiling at most; the full ones everything */
    const bool all_windowed = cli_variant_windowed_layers(&r.o.v, r.o.layers) == r.o.layers;
    uint64_t layer_pages = bt ? cli_variant_pages_held(&r.o.v, all_windowed, r.o.ctx, bt) : 0;
    if (r.o.budget && r.o.spill_dir && page && layer_pages <= UINT64_MAX / page &&
        r.o.budget < layer_pages * page)
        return cli_usage_error(CMD, "--budget %llu cannot hold one layer of one session "
                               "(%llu pages of %llu bytes = %llu bytes at --ctx %llu), "
                               "which a decode needs resident at once",
                               (unsigned long long)r.o.budget,
                               (unsigned long long)layer_pages, (unsigned long long)page,
                               (unsigned long long)(layer_pages * page),
                               (unsigned long long)r.o.ctx);
    /* Without a budget nothing bounds the cache: beyond the memory available now
     * (MemAvailable: on a shared machine the others hold the rest) it is refused
     * (--force runs it anyway), near it a warning. A budget bounds what is resident
     * (and with --spill-dir the rest goes to disk), so then it just runs. */
    uint64_t need = 0, ram = cli_avail_mem_bytes();
    if (!cli_variant_any(&r.o.v) && !r.o.head_dim_v) {
        const pkv_config kc = cli_config(r.o.layers, r.o.heads, r.o.kv_heads, r.o.head_dim,
                                         r.o.block_tokens, r.o.dtype, 1);
        cli_kv_bytes(&kc, r.o.ctx, r.o.sessions, &need);
    } else if (bt) {
        /* the pages the release rule (docs/variants.md) lets these layers hold at --ctx (a window
         * bounds them) */
        uint64_t pages = 0;
        for (uint32_t l = 0; l < r.o.layers; l++)
            pages += cli_variant_pages_held(&r.o.v, cli_variant_windowed(&r.o.v, l), r.o.ctx,
                                            bt);
        if (__builtin_mul_overflow(pages, page, &need) ||
            __builtin_mul_overflow(need, (uint64_t)r.o.sessions, &need))
            need = UINT64_MAX;
    }
    if (!r.o.budget &&
        cli_memory_guard(CMD, "the K/V cache, with no --budget to bound it,", need, ram,
                         "the available part (MemAvailable) of the machine's physical memory",
                         r.o.force) != CLI_OK)
        return CLI_USAGE;
    if (!r.o.budget && ram && need > ram / 10 * 9) {
        char b1[32], b2[32];
        fprintf(stderr, "pagedkv stress: warning: the K/V cache needs %s, %s is available "
                "now; consider --budget and --spill-dir\n", cli_bytes(need, b1),
                cli_bytes(ram, b2));
    }
    cli_sigint_catch();
    rc = setup(&r);
    if (rc == CLI_OK) {
        run(&r);
        rc = stress_report(&r);
    }
    cli_sigint_restore();
    cleanup(&r);
    return rc;
}

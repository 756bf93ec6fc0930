/*
 * cmd_stress.c - `pagedkv stress`: drive sessions to long contexts and report decode
 * latency against context length and memory per session (SPEC §6).
 *
 * Owns: option parsing, the token loop (append every token to every layer of every
 * session; decode at scheduled lengths), the fork checks, the memory check against
 * the formula, progress, the text/JSON summary and the SVG plot (drawn by svg.c).
 * Does not own: anything in the library; it uses only the public API.
 *
 * Invariants
 *   - Every session holds the same number of tokens in every layer: `done` after each
 *     pass of the token loop (a pass is one token for every session and layer).
 *   - Without spill, at every decode point and at the end, for each session of length
 *     n: bytes_resident == layers * ceil(n / bt) * page_bytes and
 *     bytes_ideal == pkv_kv_cache_bytes(layers, g, d, n, 1, dtype_size); with spill,
 *     bytes_resident + bytes_spilled takes the place of bytes_resident. A mismatch is
 *     reported and makes the exit status 1.
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

#include "cli.h"
#include "svg.h"

#define CMD "stress"
#define EXIT_INTERRUPTED CLI_INTERRUPTED

typedef struct {
    uint64_t ctx, decode_every, fork_every, budget, seed;
    uint32_t sessions, layers, heads, kv_heads, head_dim, block_tokens, threads;
    uint32_t points, reps;
    pkv_dtype dtype;
    const char *spill_dir, *svg, *preset;
    bool json, quiet, svg_logx;
} stress_opts;

typedef struct { uint64_t ctx; float us; } sample;   /* one timed pkv_decode */

typedef struct {                 /* one decode point: latency and memory at ctx */
    uint64_t ctx;
    double min, p50, p90, max;   /* us per pkv_decode of one layer */
    uint64_t resident, shared, spilled, ideal, rss; /* bytes, sums over sessions */
} point;

typedef struct {
    stress_opts o;
    pkv_engine *eng;
    pkv_session **sess;          /* [sessions] */
    uint32_t bt;                 /* tokens per page, resolved */
    uint64_t page_bytes;
    size_t dsize;
    bool spill;                  /* budget and spill dir: pages may be on disk */
    const char *isa, *io;
    uint32_t rows;               /* rows of the random blocks below */
    float *K, *V;                /* [rows][g*d] */
    float *Q;                    /* [rows][h*d] */
    float *out, *out2;           /* [h*d] */
    float *lat;                  /* [sessions*layers*reps] scratch of one point */
    sample *samples;
    size_t n_samples, cap_samples;
    point *points;
    size_t n_points, cap_points;
    uint64_t *sched;             /* log-spaced decode lengths, ascending, unique */
    size_t n_sched, sched_i;
    uint64_t done;               /* tokens in every layer of every session */
    double t_start, append_s, decode_s, decoded_ctx; /* decoded_ctx: sum of ctx decoded */
    uint64_t checks, mismatches, forks, fork_bad;
    char mismatch[256], fork_msg[256], error[256];
} stress_run;

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pagedkv stress [OPTIONS]\n\n"
        "Append tokens to one or more sessions up to a long context, decode at about 64\n"
        "log-spaced context lengths, and report decode latency against context length,\n"
        "append rate and memory per session, checked to the byte against the formula.\n\n"
        "geometry (default: llama3-8b heads with 1 layer):\n"
        "  --model-preset NAME  llama3-8b, llama3-70b, mistral-7b, llama2-7b, mqa, mha,\n"
        "                       d64, d256 (explicit flags below override it)\n"
        "  --layers L --heads H --kv-heads G --head-dim D   (H %% G == 0)\n"
        "  --dtype f32|f16|bf16 K/V storage type (default f16)\n"
        "  --block-tokens N     tokens per page (default: the library's, 16)\n"
        "run:\n"
        "  --ctx N              tokens per session (default 65536; k/m/g suffixes)\n"
        "  --sessions N         sessions appended round-robin (default 1)\n"
        "  --decode-every K     also decode every K tokens (default 0: log-spaced only)\n"
        "  --points N           log-spaced decode lengths (default 64)\n"
        "  --reps N             timed decodes per session, layer and point (default 3)\n"
        "  --fork-every N       every N tokens fork each session, check copy-on-write\n"
        "                       (shared pages, bitwise-equal decode), drop the fork\n"
        "  --budget BYTES       resident page budget (0 = none)\n"
        "  --spill-dir DIR      spill pages beyond the budget to a file in DIR\n"
        "  --threads N          engine threads (default 0: all CPUs)\n"
        "  --seed N             seed of the random K/V/Q rows (default 1)\n"
        "output:\n"
        "  --json               one JSON object on stdout instead of the text summary\n"
        "  --svg FILE           plot latency and memory against context to FILE\n"
        "  --svg-logx           logarithmic context axis in the plot\n"
        "  --quiet              no progress on stderr\n"
        "  --help               this text\n\n"
        "Progress goes to stderr (a bar on a terminal). Ctrl-C stops and prints the\n"
        "summary so far (exit 130). Exit 1 on a library error or a memory mismatch,\n"
        "2 on a usage error.\n");
}

/* ---- options -------------------------------------------------------------------- */

typedef struct { const char *name; uint32_t *u32; uint64_t *u64; bool *set; } num_opt;

static int parse_opts(int argc, char **argv, stress_opts *o, bool *help)
{
    bool set_l = false, set_h = false, set_g = false, set_d = false, set_bt = false;
    *o = (stress_opts){.ctx = 65536, .sessions = 1, .layers = 1, .heads = 32,
                       .kv_heads = 8, .head_dim = 128, .dtype = PKV_F16, .seed = 1,
                       .points = 64, .reps = 3};
    const num_opt nums[] = {
        {"--ctx", NULL, &o->ctx, NULL},           {"--sessions", &o->sessions, NULL, NULL},
        {"--layers", &o->layers, NULL, &set_l},   {"--heads", &o->heads, NULL, &set_h},
        {"--kv-heads", &o->kv_heads, NULL, &set_g}, {"--head-dim", &o->head_dim, NULL, &set_d},
        {"--block-tokens", &o->block_tokens, NULL, &set_bt},
        {"--threads", &o->threads, NULL, NULL},   {"--decode-every", NULL, &o->decode_every, NULL},
        {"--fork-every", NULL, &o->fork_every, NULL}, {"--budget", NULL, &o->budget, NULL},
        {"--seed", NULL, &o->seed, NULL},         {"--points", &o->points, NULL, NULL},
        {"--reps", &o->reps, NULL, NULL},
    };
    *help = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            *help = true;
            return CLI_OK;
        }
        if (strcmp(a, "--json") == 0) { o->json = true; continue; }
        if (strcmp(a, "--quiet") == 0) { o->quiet = true; continue; }
        if (strcmp(a, "--svg-logx") == 0) { o->svg_logx = true; continue; }
        const num_opt *n = NULL;
        for (size_t j = 0; j < sizeof nums / sizeof nums[0]; j++)
            if (strcmp(a, nums[j].name) == 0)
                n = &nums[j];
        bool known = n || strcmp(a, "--dtype") == 0 || strcmp(a, "--spill-dir") == 0 ||
                     strcmp(a, "--svg") == 0 || strcmp(a, "--model-preset") == 0;
        if (!known)
            return cli_usage_error(CMD, "unknown option '%s'", a);
        const char *v = cli_value(CMD, argc, argv, &i);
        if (!v)
            return CLI_USAGE;
        if (n) {
            int ok = n->u32 ? cli_parse_u32(v, n->u32) : cli_parse_u64(v, n->u64);
            if (!ok)
                return cli_usage_error(CMD, "%s: '%s' is not a non-negative integer",
                                       a, v);
            if (n->set)
                *n->set = true;
        } else if (strcmp(a, "--dtype") == 0) {
            if (!cli_parse_dtype(v, &o->dtype))
                return cli_usage_error(CMD, "--dtype: '%s' is not f32, f16 or bf16", v);
        } else if (strcmp(a, "--spill-dir") == 0) {
            o->spill_dir = v;
        } else if (strcmp(a, "--svg") == 0) {
            o->svg = v;
        } else {
            o->preset = v;
        }
    }
    if (o->preset) {
        const cli_preset *p = cli_preset_find(o->preset);
        if (!p)
            return cli_usage_error(CMD, "--model-preset: unknown model '%s'", o->preset);
        if (!set_l) o->layers = p->layers;
        if (!set_h) o->heads = p->heads;
        if (!set_g) o->kv_heads = p->kv_heads;
        if (!set_d) o->head_dim = p->head_dim;
    }
    struct { const char *name; uint64_t v; } pos[] = {
        {"--ctx", o->ctx}, {"--sessions", o->sessions}, {"--layers", o->layers},
        {"--heads", o->heads}, {"--kv-heads", o->kv_heads}, {"--head-dim", o->head_dim},
        {"--reps", o->reps}};
    for (size_t j = 0; j < sizeof pos / sizeof pos[0]; j++)
        if (pos[j].v == 0)
            return cli_usage_error(CMD, "%s must be greater than 0", pos[j].name);
    if (set_bt && o->block_tokens == 0)
        return cli_usage_error(CMD, "--block-tokens must be greater than 0");
    if (o->points < 2)
        return cli_usage_error(CMD, "--points must be at least 2");
    if (o->heads % o->kv_heads != 0)
        return cli_usage_error(CMD, "--heads (%u) must be a multiple of --kv-heads (%u)",
                               o->heads, o->kv_heads);
    if (o->sessions > 65536 || o->reps > 1000)
        return cli_usage_error(CMD, "--sessions must be <= 65536 and --reps <= 1000");
    uint64_t total;
    if (pkv_kv_cache_bytes(o->layers, o->kv_heads, o->head_dim, o->ctx, o->sessions,
                           pkv_dtype_size(o->dtype), &total) != PKV_OK ||
        (uint64_t)o->heads * o->head_dim > (1u << 24))
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

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill(float *x, size_t n, uint64_t *s)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((double)(splitmix(s) >> 40) * (2.0 / 16777216.0) - 1.0);
}

static uint64_t rss_now(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, res = 0;
    if (!f)
        return 0;
    if (fscanf(f, "%llu %llu", &size, &res) != 2)
        res = 0;
    fclose(f);
    return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static unsigned ilog2(uint64_t x) { return 63u - (unsigned)__builtin_clzll(x); }

static int cmp_sample(const void *a, const void *b)
{
    const sample *x = a, *y = b;
    unsigned bx = ilog2(x->ctx), by = ilog2(y->ctx);
    if (bx != by)
        return bx < by ? -1 : 1;
    return (x->us > y->us) - (x->us < y->us);
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
    pkv_status st = pkv_engine_create(&c, &r->eng);
    if (st != PKV_OK)
        return cli_fail(CMD, "cannot create the engine: %s", pkv_status_str(st));
    pkv_config rc;
    pkv_stats s;
    if ((st = pkv_engine_config(r->eng, &rc)) != PKV_OK ||
        (st = pkv_engine_stats(r->eng, &s)) != PKV_OK)
        return cli_fail(CMD, "cannot read the engine's figures: %s", pkv_status_str(st));
    r->bt = rc.block_tokens;
    r->o.threads = rc.n_threads;
    r->page_bytes = s.page_bytes;
    r->isa = s.isa;
    r->io = s.io_backend;
    r->dsize = pkv_dtype_size(o->dtype);
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
    size_t per_row = 2 * gd + hd;
    size_t rows = ((size_t)4 << 20) / per_row;   /* ~16 MB, at least 17 rows */
    r->rows = (uint32_t)(rows > 1021 ? 1021 : rows < 17 ? 17 : rows);
    r->K = malloc(r->rows * gd * sizeof(float));
    r->V = malloc(r->rows * gd * sizeof(float));
    r->Q = malloc(r->rows * hd * sizeof(float));
    r->out = malloc(hd * sizeof(float));
    r->out2 = malloc(hd * sizeof(float));
    r->lat = malloc((size_t)o->sessions * o->layers * o->reps * sizeof(float));
    r->sched = malloc(o->points * sizeof(uint64_t));
    if (!r->K || !r->V || !r->Q || !r->out || !r->out2 || !r->lat || !r->sched)
        return cli_fail(CMD, "out of memory");
    uint64_t seed = o->seed;
    fill(r->K, r->rows * gd, &seed);
    fill(r->V, r->rows * gd, &seed);
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

/* The memory report of every session against the formula, at length n. */
static void check_memory(stress_run *r, uint64_t n, point *pt)
{
    const stress_opts *o = &r->o;
    uint64_t pages = (n + r->bt - 1) / r->bt * o->layers, ideal = 0;
    pkv_kv_cache_bytes(o->layers, o->kv_heads, o->head_dim, n, 1, r->dsize, &ideal);
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
    if (memcmp(r->out, r->out2, hd * sizeof(float)) != 0)
        note(r->fork_msg, &r->fork_bad, "fork of session %u at %llu decodes differently",
             s, (unsigned long long)n);
    for (uint32_t l = 0; l < o->layers; l++)
        if ((st = pkv_append(c, l, row(r, r->K, gd, n + 1, s, l),
                             row(r, r->V, gd, n + 1, s, l))) != PKV_OK)
            goto out;
    if ((st = pkv_session_memory(c, &mc)) != PKV_OK)
        goto out;
    uint64_t want_res = (n / r->bt + 1) * o->layers * pb;     /* ceil((n+1)/bt) */
    uint64_t want_shared = n / r->bt * o->layers * pb;        /* whole pages stay shared */
    if (!r->spill && (mc.bytes_resident != want_res || mc.bytes_shared != want_shared))
        note(r->fork_msg, &r->fork_bad,
             "fork of session %u at %llu after one append: resident %llu (want %llu), "
             "shared %llu (want %llu)", s, (unsigned long long)n,
             (unsigned long long)mc.bytes_resident, (unsigned long long)want_res,
             (unsigned long long)mc.bytes_shared, (unsigned long long)want_shared);
    if ((st = pkv_decode(p, 0, q, r->out2)) != PKV_OK)
        goto out;
    if (memcmp(r->out, r->out2, hd * sizeof(float)) != 0)
        note(r->fork_msg, &r->fork_bad,
             "session %u at %llu changed when its fork appended", s, (unsigned long long)n);
out:
    pkv_session_destroy(c);
    return st;
}

/* ---- the loop ------------------------------------------------------------------- */

/* Work left in seconds, from the rates measured so far: appends cost per token,
 * decodes per token of context they read. */
static double eta(const stress_run *r)
{
    const stress_opts *o = &r->o;
    double left_tok = (double)(o->ctx - r->done), left_ctx = 0;
    for (size_t i = r->sched_i; i < r->n_sched; i++)
        left_ctx += (double)r->sched[i];
    if (o->decode_every) {
        double k = (double)o->decode_every, a = floor((double)r->done / k) + 1,
               b = floor((double)o->ctx / k);
        if (b >= a)
            left_ctx += k * (a + b) * (b - a + 1) / 2;
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
    size_t hd = (size_t)o->heads * o->head_dim, k = 0;
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
                for (size_t i = 0; i < hd && !r->error[0]; i++)
                    if (!isfinite(r->out[i]))
                        snprintf(r->error, sizeof r->error, "pkv_decode at %llu tokens "
                                 "(session %u, layer %u) returned a non-finite value",
                                 (unsigned long long)n, s, l);
                r->decode_s += dt;
                r->decoded_ctx += (double)n;
                r->lat[k++] = (float)(dt * 1e6);
                if (!grow((void **)&r->samples, &r->cap_samples, r->n_samples + 1,
                          sizeof(sample)))
                    return PKV_ENOMEM;
                r->samples[r->n_samples++] = (sample){n, (float)(dt * 1e6)};
            }
measured:
    if (k == 0)
        return PKV_OK;
    if (!grow((void **)&r->points, &r->cap_points, r->n_points + 1, sizeof(point)))
        return PKV_ENOMEM;
    qsort(r->lat, k, sizeof(float), cmp_float);
    point *pt = &r->points[r->n_points++];
    *pt = (point){.ctx = n, .min = r->lat[0], .p50 = pct(r->lat, k, 0.5),
                  .p90 = pct(r->lat, k, 0.9),
                  .max = r->lat[k - 1], .rss = rss_now()};
    check_memory(r, n, pt);
    return PKV_OK;
}

static void run(stress_run *r)
{
    const stress_opts *o = &r->o;
    size_t gd = (size_t)o->kv_heads * o->head_dim;
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
                                row(r, r->V, gd, t, s, l));
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

/* ---- summary -------------------------------------------------------------------- */

typedef struct {
    bool ok;
    size_t n;
    double slope, intercept, r2; /* us per token of context, us, 1 */
    double gbps;                 /* K/V bytes of one layer per token / slope */
} line_fit;

typedef struct { uint64_t lo, hi; size_t n; double p50, p90, max; } bucket;

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
    double bytes = 2.0 * r->o.kv_heads * r->o.head_dim * (double)r->dsize;
    f.gbps = f.slope > 0 ? bytes / (f.slope * 1e-6) / 1e9 : 0;
    return f;
}

/* Octave buckets [2^k, 2^(k+1)) of every timed decode; sorts r->samples. */
static size_t make_buckets(stress_run *r, bucket *b)
{
    qsort(r->samples, r->n_samples, sizeof(sample), cmp_sample);
    size_t nb = 0;
    for (size_t i = 0; i < r->n_samples;) {
        unsigned k = ilog2(r->samples[i].ctx);
        size_t j = i;
        while (j < r->n_samples && ilog2(r->samples[j].ctx) == k)
            j++;
        size_t n = j - i;
        const sample *s = r->samples + i;
        b[nb++] = (bucket){.lo = 1ull << k, .hi = k < 63 ? 1ull << (k + 1) : UINT64_MAX,
                           .n = n, .p50 = s[(size_t)ceil(0.5 * (double)n) - 1].us,
                           .p90 = s[(size_t)ceil(0.9 * (double)n) - 1].us,
                           .max = s[n - 1].us};
        i = j;
    }
    return nb;
}

/* A JSON writer that places the commas itself: fields are written with their key
 * (or NULL inside arrays) and a separator goes before every field but the first of
 * its object or array. */
typedef struct { FILE *f; bool first; } jw;

static void jw_key(jw *w, const char *key)
{
    if (!w->first)
        fputc(',', w->f);
    w->first = false;
    if (key)
        fprintf(w->f, "\"%s\":", key);
}

static void jw_open(jw *w, const char *key, char c)
{
    jw_key(w, key);
    fputc(c, w->f);
    w->first = true;
}

static void jw_close(jw *w, char c)
{
    fputc(c, w->f);
    w->first = false;
}

static void jw_num(jw *w, const char *key, double v)
{
    jw_key(w, key);
    if (isfinite(v))
        fprintf(w->f, "%.6g", v);
    else
        fputs("null", w->f);
}

static void jw_str(jw *w, const char *key, const char *v)
{
    jw_key(w, key);
    if (v)
        cli_json_str(w->f, v);
    else
        fputs("null", w->f);
}

typedef struct { const char *k; uint64_t v; } kv_u64;

/* Integer fields, exact (no double on the way). */
static void jw_u64s(jw *w, const kv_u64 *f, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        jw_key(w, f[i].k);
        fprintf(w->f, "%llu", (unsigned long long)f[i].v);
    }
}
#define JW_U64S(w, ...)                                                                    \
    jw_u64s(w, (const kv_u64[]){__VA_ARGS__},                                              \
            sizeof((const kv_u64[]){__VA_ARGS__}) / sizeof(kv_u64))

static void print_json(const stress_run *r, const line_fit fit[2], const bucket *b, size_t nb,
                       const pkv_memory *mem, const pkv_stats *es, double elapsed)
{
    const stress_opts *o = &r->o;
    jw w = {stdout, true}, *W = &w;
    double tok = (double)r->done * o->sessions, rows = tok * o->layers;
    jw_open(W, NULL, '{');
    jw_str(W, "command", "stress");
    jw_str(W, "version", pkv_version());
    jw_open(W, "config", '{');
    JW_U64S(W, {"ctx", o->ctx}, {"sessions", o->sessions}, {"layers", o->layers},
            {"heads", o->heads}, {"kv_heads", o->kv_heads}, {"head_dim", o->head_dim});
    jw_str(W, "dtype", pkv_dtype_name(o->dtype));
    JW_U64S(W, {"block_tokens", r->bt}, {"threads", o->threads},
            {"decode_every", o->decode_every}, {"points", o->points}, {"reps", o->reps},
            {"fork_every", o->fork_every}, {"budget", o->budget});
    jw_str(W, "spill_dir", o->spill_dir);
    JW_U64S(W, {"seed", o->seed});
    jw_str(W, "model_preset", o->preset);
    jw_close(W, '}');
    jw_str(W, "isa", r->isa);
    jw_str(W, "io_backend", r->io);
    JW_U64S(W, {"tokens", r->done});
    jw_key(W, "interrupted");
    fputs(cli_interrupted() ? "true" : "false", stdout);
    jw_str(W, "error", r->error[0] ? r->error : NULL);
    jw_num(W, "elapsed_s", elapsed);
    jw_open(W, "append", '{');
    JW_U64S(W, {"tokens", r->done * o->sessions}, {"rows", r->done * o->sessions * o->layers});
    jw_num(W, "seconds", r->append_s);
    jw_num(W, "tokens_per_s", tok / r->append_s);
    jw_num(W, "rows_per_s", rows / r->append_s);
    jw_close(W, '}');
    jw_open(W, "decode", '{');
    JW_U64S(W, {"samples", r->n_samples});
    jw_num(W, "seconds", r->decode_s);
    jw_open(W, "points", '[');
    for (size_t i = 0; i < r->n_points; i++) {
        const point *p = &r->points[i];
        jw_open(W, NULL, '{');
        JW_U64S(W, {"ctx", p->ctx});
        jw_num(W, "min_us", p->min);
        jw_num(W, "p50_us", p->p50);
        jw_num(W, "p90_us", p->p90);
        jw_num(W, "max_us", p->max);
        JW_U64S(W, {"bytes_resident", p->resident}, {"bytes_shared", p->shared},
                {"bytes_spilled", p->spilled}, {"bytes_ideal", p->ideal},
                {"rss_bytes", p->rss});
        jw_close(W, '}');
    }
    jw_close(W, ']');
    jw_open(W, "buckets", '[');
    for (size_t i = 0; i < nb; i++) {
        jw_open(W, NULL, '{');
        JW_U64S(W, {"lo", b[i].lo}, {"hi", b[i].hi}, {"samples", b[i].n});
        jw_num(W, "p50_us", b[i].p50);
        jw_num(W, "p90_us", b[i].p90);
        jw_num(W, "max_us", b[i].max);
        jw_close(W, '}');
    }
    jw_close(W, ']');
    for (int i = 0; i < 2; i++) {
        const char *name = i ? "fit_fastest" : "fit";
        if (!fit[i].ok) {
            jw_str(W, name, NULL);
            continue;
        }
        jw_open(W, name, '{');
        jw_num(W, "slope_us_per_token", fit[i].slope);
        jw_num(W, "intercept_us", fit[i].intercept);
        jw_num(W, "r2", fit[i].r2);
        JW_U64S(W, {"points", fit[i].n});
        jw_num(W, "kv_read_gbps", fit[i].gbps);
        jw_close(W, '}');
    }
    jw_close(W, '}');
    jw_open(W, "sessions", '[');
    for (uint32_t s = 0; mem && s < o->sessions; s++) {
        jw_open(W, NULL, '{');
        JW_U64S(W, {"tokens", mem[s].tokens}, {"blocks", mem[s].blocks},
                {"bytes_resident", mem[s].bytes_resident},
                {"bytes_shared", mem[s].bytes_shared},
                {"bytes_spilled", mem[s].bytes_spilled}, {"bytes_ideal", mem[s].bytes_ideal},
                {"bytes_overhead", mem[s].bytes_overhead});
        jw_close(W, '}');
    }
    jw_close(W, ']');
    jw_open(W, "engine", '{');
    JW_U64S(W, {"pages_in_use", es->pages_in_use}, {"pages_free", es->pages_free},
            {"pages_spilled", es->pages_spilled}, {"page_bytes", es->page_bytes},
            {"bytes_allocator", es->bytes_allocator}, {"mem_budget", es->mem_budget});
    jw_close(W, '}');
    JW_U64S(W, {"peak_rss_bytes", cli_peak_rss_bytes()});
    jw_open(W, "memory_check", '{');
    jw_str(W, "compares", r->spill ? "bytes_resident+bytes_spilled" : "bytes_resident");
    JW_U64S(W, {"checks", r->checks}, {"mismatches", r->mismatches});
    jw_key(W, "exact");
    fputs(r->mismatches == 0 && r->checks ? "true" : "false", stdout);
    jw_str(W, "first_mismatch", r->mismatches ? r->mismatch : NULL);
    jw_close(W, '}');
    jw_open(W, "forks", '{');
    JW_U64S(W, {"count", r->forks}, {"mismatches", r->fork_bad});
    jw_str(W, "first_mismatch", r->fork_bad ? r->fork_msg : NULL);
    jw_close(W, '}');
    jw_close(W, '}');
    fputc('\n', stdout);
}

static void print_text(const stress_run *r, const line_fit fit[2], const bucket *b, size_t nb,
                       const pkv_memory *mem, const pkv_stats *es, double elapsed)
{
    const stress_opts *o = &r->o;
    char b1[32], b2[32], b3[32], b4[32], b5[32];
    printf("pagedkv stress: %u session(s) x %llu tokens, %u layer(s), heads %u, kv-heads "
           "%u, head-dim %u, %s, %u tokens/page, %u thread(s), isa %s, io %s\n",
           o->sessions, (unsigned long long)o->ctx, o->layers, o->heads, o->kv_heads,
           o->head_dim, pkv_dtype_name(o->dtype), r->bt, o->threads, r->isa, r->io);
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
    for (int i = 0; i < 2; i++)
        if (fit[i].ok)
            printf("fit of the %s decode over %zu lengths: latency = %.3f us + %.6g us/token "
                   "x context, R^2 = %.5f (%.3f ms per 1M tokens: K/V read at %.2f GB/s)\n",
                   i ? "fastest" : "p50", fit[i].n, fit[i].intercept, fit[i].slope,
                   fit[i].r2, fit[i].slope * 1048576 / 1e3, fit[i].gbps);
    if (!fit[0].ok)
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
    double *buf = calloc(n ? n * 8 : 1, sizeof(double));
    if (!buf)
        return -1;
    double *x = buf, *p50 = x + n, *p90 = p50 + n, *fl = p90 + n,
           *res = fl + n, *ideal = res + n, *spill = ideal + n, *rss = spill + n;
    double maxlat = 0;
    for (size_t i = 0; i < n; i++)
        maxlat = fmax(maxlat, r->points[i].p90);
    bool ms = maxlat > 20000;
    /* max is left out of the plot: one preempted decode would set the scale; the
     * table and the JSON have it */    /* beyond 20 ms, label the axis in ms */
    double div = ms ? 1000 : 1;
    bool any_spill = false;
    for (size_t i = 0; i < n; i++) {
        const point *p = &r->points[i];
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
    svg_series lat[] = {
        {.name = "p50", .x = x, .y = p50, .n = n, .line = true, .markers = true},
        {.name = "p90", .x = x, .y = p90, .n = n, .markers = true},
        {.name = fitname, .x = x, .y = fl, .n = fit->ok ? n : 0, .line = true,
         .dashed = true, .color = "#000000"},
    };
    svg_series memser[] = {
        {.name = "resident (paged)", .x = x, .y = res, .n = n, .line = true, .markers = true},
        {.name = "ideal (formula)", .x = x, .y = ideal, .n = n, .line = true, .dashed = true},
        {.name = "process RSS", .x = x, .y = rss, .n = n, .line = true},
        {.name = "spilled", .x = x, .y = spill, .n = n, .line = true},
    };
    const stress_opts *o = &r->o;
    svg_axis xa = {.label = "context length (tokens; K = 1024)", .log = o->svg_logx,
                   .format = SVG_FMT_COUNT, .from_zero = true};
    svg_panel panels[2] = {
        {.title = lat_title, .x = xa,
         .y = {.label = ms ? "latency (ms)" : "latency (us)", .from_zero = true},
         .series = lat, .n_series = fit->ok ? 3 : 2},
        {.title = "K/V memory of all sessions vs context", .x = xa,
         .y = {.label = "memory", .format = SVG_FMT_BYTES, .from_zero = true},
         .series = memser, .n_series = any_spill ? 4 : 3},
    };
    char title[256];
    snprintf(title, sizeof title, "pagedkv stress: %u session(s), %u layer(s), h %u, g %u, "
             "d %u, %s, %u tokens/page, isa %s", o->sessions, o->layers, o->heads,
             o->kv_heads, o->head_dim, pkv_dtype_name(o->dtype), r->bt, r->isa);
    int rc = svg_write_file(o->svg, title, panels, 2);
    free(buf);
    return rc;
}

static int report(stress_run *r)
{
    const stress_opts *o = &r->o;
    double elapsed = cli_now() - r->t_start;
    line_fit fit[2] = {fit_latency(r, false), fit_latency(r, true)};
    bucket b[64];
    size_t nb = make_buckets(r, b);
    pkv_memory *mem = calloc(o->sessions, sizeof *mem);
    pkv_stats es = {0};
    pkv_engine_stats(r->eng, &es);
    for (uint32_t s = 0; mem && s < o->sessions; s++)
        pkv_session_memory(r->sess[s], &mem[s]);
    if (o->json)
        print_json(r, fit, b, nb, mem, &es, elapsed);
    else
        print_text(r, fit, b, nb, mem, &es, elapsed);
    fflush(stdout);
    free(mem);
    int rc = r->error[0] || r->mismatches || r->fork_bad ? CLI_FAIL
             : cli_interrupted()                    ? EXIT_INTERRUPTED
                                                         : CLI_OK;
    if (o->svg && write_svg(r, &fit[0]) != 0)
        rc = cli_fail(CMD, "cannot write the plot to '%s'", o->svg);
    return rc;
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
    free(r->sched);
    free(r->samples);
    free(r->points);
}

int cmd_stress(int argc, char **argv)
{
    stress_run r;
    bool help;
    memset(&r, 0, sizeof r);
    int rc = parse_opts(argc, argv, &r.o, &help);
    if (rc != CLI_OK)
        return rc;
    if (help) {
        usage(stdout);
        return CLI_OK;
    }
    uint64_t need = 0;
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    pkv_kv_cache_bytes(r.o.layers, r.o.kv_heads, r.o.head_dim, r.o.ctx, r.o.sessions,
                       pkv_dtype_size(r.o.dtype), &need);
    if (!(r.o.budget && r.o.spill_dir) && pages > 0 && psz > 0 &&
        need > (uint64_t)pages * (uint64_t)psz / 10 * 9) {
        char b1[32], b2[32];
        fprintf(stderr, "pagedkv stress: warning: the K/V cache needs %s, the machine has "
                "%s; consider --budget and --spill-dir\n", cli_bytes(need, b1),
                cli_bytes((uint64_t)pages * (uint64_t)psz, b2));
    }
    cli_sigint_catch();
    rc = setup(&r);
    if (rc == CLI_OK) {
        run(&r);
        rc = report(&r);
    }
    cli_sigint_restore();
    cleanup(&r);
    return rc;
}

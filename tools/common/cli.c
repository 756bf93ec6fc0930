/* cli.c - see cli.h. */
#include "common/cli.h"
#include "common/opt.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* In step with CLI_PRESET_NAMES (cli.h): the messages list the names from there. */
static const cli_preset presets[] = {
    /* name          layers heads kv  d */
    {"llama3-8b",     32,   32,   8, 128},
    {"llama3-70b",    80,   64,   8, 128},
    {"mistral-7b",    32,   32,   8, 128},
    {"llama2-7b",     32,   32,  32, 128},
    {"mqa",           32,   32,   1, 128},
    {"mha",           32,   32,  32, 128},
    {"d64",           32,   32,   8,  64},
    {"d256",          32,   16,   8, 256},
};

const cli_preset *cli_presets(uint32_t *n)
{
    *n = (uint32_t)(sizeof presets / sizeof presets[0]);
    return presets;
}

const cli_preset *cli_preset_find(const char *name)
{
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (strcmp(presets[i].name, name) == 0)
            return &presets[i];
    return NULL;
}

bool cli_opt_preset(const char *value, void *dst)
{
    if (!cli_preset_find(value))
        return false;
    *(const char **)dst = value;
    return true;
}

int cli_parse_u64(const char *s, uint64_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+' || *s == ' ')
        return 0;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return 0;
    unsigned shift = 0;
    if (*end) {
        switch (*end) {
        case 'k': case 'K': shift = 10; break;
        case 'm': case 'M': shift = 20; break;
        case 'g': case 'G': shift = 30; break;
        default: return 0;
        }
        if (end[1])
            return 0;
    }
    if (shift && v > (UINT64_MAX >> shift))
        return 0;
    *out = (uint64_t)v << shift;
    return 1;
}

int cli_parse_u32(const char *s, uint32_t *out)
{
    uint64_t v;
    if (!cli_parse_u64(s, &v) || v > UINT32_MAX)
        return 0;
    *out = (uint32_t)v;
    return 1;
}

int cli_parse_double(const char *s, double *out)
{
    if (!s || !*s)
        return 0;
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v))
        return 0;
    *out = v;
    return 1;
}

int cli_parse_dtype(const char *s, pkv_dtype *out)
{
    if (!s)
        return 0;
    if (strcmp(s, "f32") == 0 || strcmp(s, "fp32") == 0) { *out = PKV_F32; return 1; }
    if (strcmp(s, "f16") == 0 || strcmp(s, "fp16") == 0) { *out = PKV_F16; return 1; }
    if (strcmp(s, "bf16") == 0) { *out = PKV_BF16; return 1; }
    if (strcmp(s, "q8") == 0) { *out = PKV_Q8; return 1; }
    if (strcmp(s, "q4") == 0) { *out = PKV_Q4; return 1; }
    return 0;
}

/* The program a message names: "pagedkv CMD", or the name cli_set_program gave. */
static const char *program;

void cli_set_program(const char *name)
{
    program = name;
}

static void vmsg(const char *cmd, const char *fmt, va_list ap)
{
    if (program)
        fprintf(stderr, "%s: ", program);
    else
        fprintf(stderr, "pagedkv%s%s: ", cmd ? " " : "", cmd ? cmd : "");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

int cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vmsg(cmd, fmt, ap);
    va_end(ap);
    if (program)
        fprintf(stderr, "Try '%s --help'.\n", program);
    else
        fprintf(stderr, "Try 'pagedkv %s --help'.\n", cmd ? cmd : "");
    return CLI_USAGE;
}

int cli_fail(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vmsg(cmd, fmt, ap);
    va_end(ap);
    return CLI_FAIL;
}

/* Why files cannot be created in dir (into buf), or NULL when they can. */
static const char *dir_problem(const char *dir, char *buf, size_t cap)
{
    struct stat st;
    if (stat(dir, &st) != 0)
        snprintf(buf, cap, "'%s' %s", dir,
                 errno == ENOENT ? "does not exist" : strerror(errno));
    else if (!S_ISDIR(st.st_mode))
        snprintf(buf, cap, "'%s' is not a directory", dir);
    else if (access(dir, W_OK | X_OK) != 0)
        snprintf(buf, cap, "cannot create files in '%s': %s", dir, strerror(errno));
    else
        return NULL;
    return buf;
}

int cli_check_dir(const char *cmd, const char *opt, const char *dir)
{
    char why[4200];
    if (!dir || !*dir)
        return cli_usage_error(cmd, "%s: the directory name is empty", opt);
    if (dir_problem(dir, why, sizeof why))
        return cli_usage_error(cmd, "%s: %s", opt, why);
    return CLI_OK;
}

int cli_check_output_file(const char *cmd, const char *opt, const char *path)
{
    struct stat st;
    char dir[4096], why[4200];
    if (!path || !*path)
        return cli_usage_error(cmd, "%s: the file name is empty", opt);
    if (path[strlen(path) - 1] == '/' || (stat(path, &st) == 0 && S_ISDIR(st.st_mode)))
        return cli_usage_error(cmd, "%s: '%s' is a directory, not a file", opt, path);
    if (stat(path, &st) == 0) {
        if (access(path, W_OK) != 0)
            return cli_usage_error(cmd, "%s: cannot write '%s': %s", opt, path,
                                   strerror(errno));
        return CLI_OK;
    }
    /* a new file: its directory must take it */
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else if ((size_t)(slash - path) < sizeof dir)
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    else
        return cli_usage_error(cmd, "%s: '%s': the path is too long", opt, path);
    if (dir_problem(dir, why, sizeof why))
        return cli_usage_error(cmd, "%s: cannot create '%s': %s", opt, path, why);
    return CLI_OK;
}

int cli_check_engine_memory(const char *cmd, const pkv_config *c, const char *budget_opt,
                            const char *dir_opt, bool dir_needs_budget,
                            uint64_t *page_bytes, uint32_t *block_tokens)
{
    if (page_bytes)
        *page_bytes = 0;
    if (block_tokens)
        *block_tokens = 0;
    if (c->spill_dir && cli_check_dir(cmd, dir_opt, c->spill_dir) != CLI_OK)
        return CLI_USAGE;
    if (c->spill_dir && !c->mem_budget && dir_needs_budget)
        return cli_needs_error(cmd, dir_opt, budget_opt,
                               "without a budget nothing is ever spilled (the budget is "
                               "the resident limit beyond which pages go to the spill "
                               "directory)");
    /* the page size the library resolves for this geometry, from a bare engine */
    pkv_config bare = *c;
    bare.mem_budget = 0;
    bare.spill_dir = NULL;
    bare.n_threads = 1;
    pkv_engine *e = NULL;
    pkv_stats st;
    pkv_config rc;
    if (pkv_engine_create(&bare, &e) != PKV_OK || pkv_engine_stats(e, &st) != PKV_OK ||
        pkv_engine_config(e, &rc) != PKV_OK) {
        pkv_engine_destroy(e);
        return CLI_OK;
    }
    pkv_engine_destroy(e);
    if (page_bytes)
        *page_bytes = st.page_bytes;
    if (block_tokens)
        *block_tokens = rc.block_tokens;
    if (c->mem_budget && c->mem_budget < st.page_bytes)
        return cli_usage_error(cmd, "%s %llu is smaller than one page, %llu bytes here (%u "
                                    "kv-heads x %u tokens x (%zu-byte K row + %zu-byte V "
                                    "row), %s); give at least that, or 0 for no budget",
                               budget_opt, (unsigned long long)c->mem_budget,
                               (unsigned long long)st.page_bytes, rc.n_kv_heads,
                               rc.block_tokens, pkv_row_bytes(rc.kv_dtype, rc.head_dim),
                               pkv_row_bytes(rc.kv_dtype, rc.head_dim_v),
                               pkv_dtype_name(rc.kv_dtype));
    return CLI_OK;
}

static uint64_t phys_mem_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || psz <= 0 || (uint64_t)pages > UINT64_MAX / (uint64_t)psz)
        return 0;
    return (uint64_t)pages * (uint64_t)psz;
}

uint64_t cli_avail_mem_bytes(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (f && !found && fgets(line, sizeof line, f))
        found = sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    if (f)
        fclose(f);
    if (found && kib <= UINT64_MAX / 1024)
        return (uint64_t)kib * 1024u;
    return phys_mem_bytes();
}

int cli_check_limits(const char *cmd, const pkv_config *c, const char *geometry_from)
{
    char from[300] = "";
    if (geometry_from)
        snprintf(from, sizeof from, " (the geometry of %s)", geometry_from);
    const char *hd = geometry_from ? "head_dim" : "--head-dim";
    const char *kv = geometry_from ? "n_kv_heads" : "--kv-heads";
    const char *qh = geometry_from ? "n_heads" : "--heads";
    if (c->n_threads > CLI_MAX_THREADS)
        return cli_usage_error(cmd, "--threads %u is beyond the engine's limit of %u "
                                    "(0 = all CPUs)", c->n_threads, CLI_MAX_THREADS);
    if (c->head_dim > CLI_MAX_HEAD_DIM)
        return cli_usage_error(cmd, "%s %u is beyond the engine's limit of %u%s", hd,
                               c->head_dim, CLI_MAX_HEAD_DIM, from);
    if (c->n_kv_heads > CLI_MAX_KV_HEADS)
        return cli_usage_error(cmd, "%s %u is beyond the engine's limit of %u%s", kv,
                               c->n_kv_heads, CLI_MAX_KV_HEADS, from);
    if (c->n_kv_heads && c->n_heads % c->n_kv_heads == 0 &&
        c->n_heads / c->n_kv_heads > CLI_MAX_GROUP_HEADS)
        return cli_usage_error(cmd, "%s %u / %s %u = %u query heads per KV group, beyond "
                                    "the engine's limit of %u%s", qh, c->n_heads, kv,
                               c->n_kv_heads, c->n_heads / c->n_kv_heads,
                               CLI_MAX_GROUP_HEADS, from);
    /* page bytes = g * bt * (row_bytes(d) + row_bytes(dv)) (docs/numerics.md, section 6: rows of
     * the block types carry their scales); the factors are < 2^32 and a row of <= 4096 values is
     * < 2^15 bytes, so two products of two fit in 64 bits and the last is checked */
    const uint64_t bt = c->block_tokens ? c->block_tokens : 16u;
    if (c->head_dim_v > CLI_MAX_HEAD_DIM)
        return cli_usage_error(cmd, "%s %u is beyond the engine's limit of %u%s",
                               geometry_from ? "head_dim_v" : "--head-dim-v", c->head_dim_v,
                               CLI_MAX_HEAD_DIM, from);
    /* with head_dim_v (MLA) a page holds K rows of head_dim and V rows of head_dim_v */
    const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
    const uint64_t rk = pkv_row_bytes(c->kv_dtype, c->head_dim),
                   rv = pkv_row_bytes(c->kv_dtype, dv);
    const uint64_t a = (uint64_t)c->n_kv_heads * (rk + rv), b = bt;
    if (a && b && (a > UINT64_MAX / b || a * b > CLI_MAX_PAGE_BYTES)) {
        char why[64];
        if (a > UINT64_MAX / b)
            snprintf(why, sizeof why, "more than 2^64 bytes");
        else
            snprintf(why, sizeof why, "%llu bytes", (unsigned long long)(a * b));
        return cli_usage_error(cmd, "%s %u makes one page %s (%u kv-heads x %llu "
                                    "tokens x (%llu-byte K row + %llu-byte V row), %s), beyond "
                                    "the engine's limit of 1 GiB per page%s",
                               c->block_tokens ? "--block-tokens" : "the default block size",
                               (unsigned)bt, why, c->n_kv_heads, (unsigned long long)bt,
                               (unsigned long long)rk, (unsigned long long)rv,
                               pkv_dtype_name(c->kv_dtype), from);
    }
    return CLI_OK;
}

int cli_memory_guard(const char *cmd, const char *what, uint64_t need, uint64_t limit,
                     const char *limit_what, bool force)
{
    char b1[32], b2[32];
    if (force || limit == 0 || need <= limit)
        return CLI_OK;
    return cli_usage_error(cmd, "%s needs %llu bytes (%s), more than %s, %llu bytes (%s); "
                                "add --force to do it anyway", what,
                           (unsigned long long)need, cli_bytes(need, b1), limit_what,
                           (unsigned long long)limit, cli_bytes(limit, b2));
}

/* The command line as main got it: process-wide, set once before any subcommand runs,
 * read by the JSON envelope. */
static const char *const *cmd_argv;
static int cmd_argc;

void cli_set_command_line(int argc, char **argv)
{
    /* a copy of the pointers: getopt_long permutes argv, the strings stay where they are */
    static const char *copy[256];
    cmd_argc = argc < 256 ? argc : 255;
    for (int i = 0; i < cmd_argc; i++)
        copy[i] = argv[i];
    copy[cmd_argc] = NULL;
    cmd_argv = copy;
}

const char *const *cli_command_line(int *argc)
{
    *argc = cmd_argc;
    return cmd_argv;
}

const char *cli_host_name(void)
{
    static char name[256];
    if (!name[0] && (gethostname(name, sizeof name - 1) != 0 || !name[0]))
        snprintf(name, sizeof name, "?");
    return name;
}

const char *cli_cpu_name(void)
{
    static char name[256];
    if (name[0])
        return name;
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && !name[0] && fgets(line, sizeof line, f)) {
        const char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) != 0 || !colon)
            continue;
        colon++;
        while (*colon == ' ' || *colon == '\t')
            colon++;
        snprintf(name, sizeof name, "%s", colon);
        name[strcspn(name, "\n")] = '\0';
    }
    if (f)
        fclose(f);
    if (!name[0])
        snprintf(name, sizeof name, "?");
    return name;
}

uint32_t cli_online_cpus(void)
{
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1u : (uint32_t)n;
}

const char *cli_default_isa(void)
{
    static const char *isa;
    if (isa)
        return isa;
    const pkv_config c = cli_config(1, 1, 1, 8, 0, PKV_F16, 1);
    pkv_engine *e = NULL;
    pkv_stats st;
    if (pkv_engine_create(&c, &e) == PKV_OK && pkv_engine_stats(e, &st) == PKV_OK)
        isa = st.isa;   /* a string of the library's, not the engine's */
    pkv_engine_destroy(e);
    return isa ? isa : "?";
}

void cli_json_envelope(json_writer *W, const char *cmd, const char *isa)
{
    json_str(W, "tool", program ? program : "pagedkv");
    json_str(W, "command", cmd);
    json_str(W, "version", pkv_version());
    json_str(W, "isa", isa ? isa : cli_default_isa());
    json_str(W, "host", cli_host_name());
    json_str(W, "cpu", cli_cpu_name());
    json_u64(W, "online_cpus", cli_online_cpus());
    int argc = 0;
    const char *const *argv = cli_command_line(&argc);
    json_open(W, "argv", '[');
    for (int i = 0; i < argc; i++)
        json_str(W, NULL, argv[i]);
    json_close(W, ']');
}

const char *cli_run_where(char *buf, size_t cap, uint32_t threads, const char *isa)
{
    snprintf(buf, cap, "%u thread(s), %s kernels, host %s (%s)", threads,
             isa ? isa : cli_default_isa(), cli_host_name(), cli_cpu_name());
    return buf;
}

/* The SIGINT flag, process-wide: a signal handler can reach nothing else. */
static volatile sig_atomic_t sigint_seen;
static struct sigaction sigint_old;

static void on_sigint(int sig)
{
    (void)sig;
    sigint_seen = 1;
}

void cli_sigint_catch(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigint_seen = 0;
    sigaction(SIGINT, &sa, &sigint_old);
}

bool cli_interrupted(void)
{
    return sigint_seen != 0;
}

void cli_sigint_restore(void)
{
    sigaction(SIGINT, &sigint_old, NULL);
}

double cli_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t cli_peak_rss_bytes(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (uint64_t)ru.ru_maxrss * 1024u;
}

uint64_t cli_rss_bytes(void)
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

const char *cli_bytes(uint64_t b, char *buf)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024.0 && u < 5) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, 32, "%llu B", (unsigned long long)b);
    else
        snprintf(buf, 32, "%.2f %s", v, units[u]);
    return buf;
}

uint64_t cli_token_layer_bytes(const pkv_config *c)
{
    const uint32_t dv = c->head_dim_v ? c->head_dim_v : c->head_dim;
    return (uint64_t)c->n_kv_heads *
           (pkv_row_bytes(c->kv_dtype, c->head_dim) + pkv_row_bytes(c->kv_dtype, dv));
}

pkv_status cli_kv_bytes(const pkv_config *c, uint64_t ctx, uint64_t batch, uint64_t *out)
{
    uint64_t b = cli_token_layer_bytes(c);
    if (__builtin_mul_overflow(b, (uint64_t)c->n_layers, &b) ||
        __builtin_mul_overflow(b, ctx, &b) || __builtin_mul_overflow(b, batch, &b))
        return PKV_ERANGE;
    *out = b;
    return PKV_OK;
}

pkv_config cli_config(uint32_t layers, uint32_t heads, uint32_t kv_heads, uint32_t head_dim,
                      uint32_t block_tokens, pkv_dtype dtype, uint32_t threads)
{
    pkv_config c = pkv_config_default();
    c.n_layers = layers;
    c.n_heads = heads;
    c.n_kv_heads = kv_heads;
    c.head_dim = head_dim;
    c.block_tokens = block_tokens;
    c.kv_dtype = dtype;
    c.n_threads = threads;
    return c;
}

/* ---- attention variants --------------------------------------------------------- */

/* The public config.json values of each model (Hugging Face): the geometry of its
 * attention and the layer pattern; see docs/variants.md. */
static const cli_variant_preset variant_presets[] = {
    {"gemma2-9b", "google/gemma-2-9b", 42, 16, 8, 256, 0,
     {.window = 4096, .every = 2, .softcap = 50.0},
     "sliding_window 4096 on layers 0, 2, 4, ... (the others global), "
     "attn_logit_softcapping 50, query_pre_attn_scalar 256 = head_dim (scale 1/16)"},
    {"gpt-oss-20b", "openai/gpt-oss-20b", 24, 64, 8, 64, 0,
     {.window = 128, .every = 2, .sink_logits = true},
     "sliding_window 128 on layers 0, 2, 4, ... (layer_types; the others full), one "
     "learned sink logit per head on every layer (zeros here: memory does not depend on "
     "them)"},
    {"deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 128, 1, 576, 512, {0},
     "MLA with absorbed up-projections, served as MQA over the latent: kv_lora_rank 512 + "
     "qk_rope_head_dim 64 = head_dim 576, V = the latent, head_dim_v 512; scale "
     "1/sqrt(qk_nope 128 + qk_rope 64)"},
};

const cli_variant_preset *cli_variant_presets(uint32_t *n)
{
    *n = (uint32_t)(sizeof variant_presets / sizeof variant_presets[0]);
    return variant_presets;
}

const cli_variant_preset *cli_variant_preset_find(const char *name)
{
    for (size_t i = 0; i < sizeof variant_presets / sizeof variant_presets[0]; i++)
        if (strcmp(variant_presets[i].name, name) == 0)
            return &variant_presets[i];
    return NULL;
}

bool cli_opt_any_preset(const char *value, void *dst)
{
    if (!cli_preset_find(value) && !cli_variant_preset_find(value))
        return false;
    *(const char **)dst = value;
    return true;
}

uint32_t cli_variant_windowed_layers(const cli_variant *v, uint32_t layers)
{
    uint32_t n = 0;
    for (uint32_t l = 0; l < layers; l++)
        n += cli_variant_windowed(v, l);
    return n;
}

uint64_t cli_variant_page_ceiling(const cli_variant *v, uint32_t bt)
{
    const uint64_t span = (uint64_t)v->window + v->rollback;
    return ((uint64_t)v->sinks + bt - 1) / bt + (span + bt - 1) / bt + 1;
}

uint64_t cli_variant_pages_held(const cli_variant *v, bool windowed, uint64_t n, uint32_t bt)
{
    const uint64_t pages = (n + bt - 1) / bt;
    if (!windowed || !v->window)
        return pages;
    const uint64_t span = (uint64_t)v->window + v->rollback;
    const uint64_t sink_pages = ((uint64_t)v->sinks + bt - 1) / bt;
    /* the first page that holds a position >= n - span */
    const uint64_t first = n > span ? (n - span) / bt : 0;
    return first > sink_pages ? sink_pages + (pages - first) : pages;
}

int cli_variant_check(const char *cmd, const cli_variant *v)
{
    if (!v->window && v->sinks)
        return cli_needs_error(cmd, "--sinks", "--window", "sink tokens are what a "
                               "windowed layer keeps besides its window");
    if (!v->window && v->rollback)
        return cli_needs_error(cmd, "--rollback", "--window", "a full layer keeps every "
                               "position anyway");
    return CLI_OK;
}

pkv_layer_config *cli_variant_layers(const cli_variant *v, uint32_t layers, uint32_t heads,
                                     float **sink_store, bool *oom)
{
    *sink_store = NULL;
    *oom = false;
    if (!cli_variant_any(v))
        return NULL;
    pkv_layer_config *lc = calloc(layers, sizeof *lc);
    float *sinks = v->sink_logits ? calloc(heads, sizeof *sinks) : NULL;
    if (!lc || (v->sink_logits && !sinks)) {
        free(lc);
        free(sinks);
        *oom = true;
        return NULL;
    }
    for (uint32_t l = 0; l < layers; l++) {
        if (cli_variant_windowed(v, l))
            lc[l] = (pkv_layer_config){.window = v->window, .sink_tokens = v->sinks,
                                       .rollback_tokens = v->rollback};
        lc[l].softcap = (float)v->softcap;
        lc[l].sink_logits = sinks;
    }
    *sink_store = sinks;
    return lc;
}

const char *cli_variant_describe(const cli_variant *v, uint32_t layers, char *buf, size_t cap)
{
    size_t n = 0;
    buf[0] = 0;
    if (v->window) {
        const uint32_t w = cli_variant_windowed_layers(v, layers);
        n += (size_t)snprintf(buf, cap, "window %u on %u of %u layer(s)%s, %u sink token(s), "
                              "rollback %u", v->window, w, layers,
                              v->every > 1 ? " (alternating)" : "", v->sinks, v->rollback);
    } else {
        n += (size_t)snprintf(buf, cap, "full causal");
    }
    if (n < cap && v->softcap > 0)
        n += (size_t)snprintf(buf + n, cap - n, ", softcap %g", v->softcap);
    if (n < cap && v->sink_logits)
        snprintf(buf + n, cap - n, ", learned sink logits");
    return buf;
}

uint64_t cli_layer_pages_held(const pkv_session *s, uint32_t l)
{
    pkv_page_info info[256];
    uint64_t held = 0, first = 0, got = 0;
    do {
        if (pkv_session_pages(s, l, first, 256, info, &got) != PKV_OK)
            return UINT64_MAX;
        for (uint64_t i = 0; i < got; i++)
            held += info[i].id != 0;
        first += got;
    } while (got == 256);
    return held;
}

uint64_t cli_splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/*
 * mem/mem.c - `pagedkv mem`: how much KV-cache memory a model geometry costs, as the
 * size formula (docs/memory.md) and as the paged cache really stores it (docs/design.md, "Page
 * layout").
 *
 * Owns: option parsing and presentation of the figures, and the --measure run.
 * Does not own: any arithmetic the library defines. The formula is
 *   pkv_kv_cache_bytes(); the page size and the resolved block size are read back from
 *   a real engine (pkv_engine_stats, pkv_engine_config), so the tool can never drift
 *   from the library. It uses only the public API and cli.h.
 *
 * Figures (all uint64, overflow-checked; "batch" sessions of "ctx" tokens each):
 *   formula         2 * layers * g * d * ctx * batch * bytes_per_value; with variants
 *                   (docs/variants.md) sum over layers of positions * g * (d + dv) * bpv * batch,
 *                   and for the block types (docs/numerics.md, section 6: Q8, Q4, whose rows carry
 *                   a scale per 32 values) positions * g * (row_bytes(d) + row_bytes(dv)),
 *                   positions = ctx for a full layer, min(ctx, sinks + window +
 *                   rollback) for a windowed one (what a decode can still read)
 *   pages/layer     ceil(ctx / block_tokens); a windowed layer's pages come from a
 *                   real one-layer engine of that config (probe_window_pages), next to
 *                   docs/variants.md's ceiling ceil(sinks/bt) + ceil((window+rollback)/bt) + 1
 *   mla             deepseek-v3: the latent the model caches (kv_lora_rank + rope key
 *                   = head_dim values a token), what pagedkv stores (K row and V row:
 *                   head_dim + head_dim_v) and naive MLA's per-head K/V
 *   pages/session   layers * pages/layer
 *   paged           pages/session * page_bytes * batch       (>= formula)
 *   waste           paged - formula   (< layers * page_bytes * batch: the last page of
 *                   each layer is partly filled)
 *   table estimate  pages * (two pointers per block-table entry + a 32-byte page
 *                   descriptor); an estimate only, --measure prints the real figure
 *   mha             the formula with g = heads; GQA saves mha - formula
 *
 * Exit status (cli.h): 0 ok; 1 the library failed (engine, append, or a measured
 * figure disagreeing with the computed one); 2 usage error (missing geometry, bad
 * value, sizes overflowing 64 bits, --measure above the limit without --force).
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/json.h"
#include "common/opt.h"

static const char *const CMD = "mem";

/* --measure refuses sessions larger than this without --force: one session of this
 * size is really allocated (and touched) in RAM. */
#define MEASURE_LIMIT_BYTES (1ull << 30)

/* Bookkeeping per page assumed by the estimate: a page pointer and a data pointer per
 * block-table entry, plus one page descriptor. */
#define TABLE_BYTES_PER_PAGE (2u * sizeof(void *) + 32u)

/* text from column `at` of a line already started there, wrapped at spaces to `width`
 * columns, the continuation lines indented to `at` too. */
static void print_wrapped(FILE *f, const char *text, int at, int width)
{
    int col = at;
    for (const char *p = text; *p;) {
        const int w = (int)strcspn(p, " ");
        if (col > at && col + 1 + w > width) {
            fprintf(f, "\n%*s", at, "");
            col = at;
        } else if (col > at) {
            fputc(' ', f);
            col++;
        }
        fwrite(p, 1, (size_t)w, f);
        col += w;
        p += w;
        while (*p == ' ')
            p++;
    }
    fputc('\n', f);
}

static void usage(FILE *f)
{
    fprintf(f,
"usage: pagedkv mem --layers N --kv-heads N --head-dim N --ctx N [options]\n"
"       pagedkv mem --model-preset NAME --ctx N [options]\n"
"\n"
"KV-cache memory of a model geometry: the size formula (docs/memory.md)\n"
"  2 * layers * kv_heads * head_dim * ctx * batch * bytes_per_value\n"
"and the paged figure, layers * ceil(ctx / block_tokens) * page_bytes * batch, with\n"
"page_bytes read back from a real engine of that geometry.\n"
"\n"
"options:\n"
"  --layers N          transformer layers\n"
"  --heads N           query heads (default: --kv-heads); used for the MHA comparison\n"
"  --kv-heads N        KV heads (groups); must divide --heads\n"
"  --head-dim N        dimension of one head\n"
"  --ctx N             tokens per session (k/m/g suffixes: x1024, x2^20, x2^30)\n"
"  --batch N           sessions (default 1)\n"
"  --dtype T           stored K/V type: f32, f16 (default), bf16, q8 or q4 (q8, q4:\n"
"                      blocks of 32 values with an f16 scale each; docs/numerics.md)\n"
"  --block-tokens N    tokens per page (default: the library's, 0 = the same)\n"
"  --head-dim-v N      width of V rows (default: --head-dim); MLA: kv_lora_rank\n"
"  --window W          sliding window of W positions on every layer (or on the\n"
"                      preset's windowed layers); 0 = full causal\n"
"  --sinks S           with --window: the first S positions are kept too\n"
"  --rollback R        with --window: R more positions kept for truncates\n"
"  --model-preset NAME take the geometry from a preset; explicit flags override it\n"
"  --measure           build one session of ctx tokens in every layer (zeros) and\n"
"                      print pkv_session_memory next to the computed figures\n"
"  --force             allow --measure above %llu bytes per session\n"
"  --json              one JSON object on stdout instead of text\n"
"  --help              this text\n"
"\n",
            (unsigned long long)MEASURE_LIMIT_BYTES);
    uint32_t n;
    const cli_preset *p = cli_presets(&n);
    fprintf(f, "presets (layers/heads/kv-heads/head-dim):\n");
    for (uint32_t i = 0; i < n; i++)
        fprintf(f, "  %-12s %u/%u/%u/%u\n", p[i].name, p[i].layers, p[i].heads,
                p[i].kv_heads, p[i].head_dim);
    const cli_variant_preset *vp = cli_variant_presets(&n);
    fprintf(f, "\nvariant presets, real models' layer patterns (docs/variants.md):\n");
    for (uint32_t i = 0; i < n; i++) {
        char vd[200], line[1024];
        int k = snprintf(line, sizeof line, "like %s: %u layers, %u heads, %u kv-heads, "
                         "head-dim %u", vp[i].like, vp[i].layers, vp[i].heads,
                         vp[i].kv_heads, vp[i].head_dim);
        if (vp[i].head_dim_v && k > 0 && (size_t)k < sizeof line)
            k += snprintf(line + k, sizeof line - (size_t)k, ", head-dim-v %u",
                          vp[i].head_dim_v);
        if (k > 0 && (size_t)k < sizeof line)
            snprintf(line + k, sizeof line - (size_t)k, "; %s (%s)",
                     cli_variant_describe(&vp[i].v, vp[i].layers, vd, sizeof vd), vp[i].note);
        fprintf(f, "  %-12s", vp[i].name);
        print_wrapped(f, line, 14, 80);
    }
    fprintf(f,
"\n"
"JSON keys (stable): the envelope of every command (tool, command, version, isa,\n"
"  host, cpu, online_cpus, argv), then preset (string or null), layers, heads,\n"
"  kv_heads, head_dim,\n"
"  ctx, batch, dtype, bytes_per_value (q8/q4: a fraction, scales included),\n"
"  row_bytes_k, row_bytes_v (pkv_row_bytes of a K and a V row), bytes_per_token (all\n"
"  layers of one session), block_tokens, formula_bytes, paged_bytes,\n"
"  page_bytes, pages_per_layer, pages_per_session, waste_bytes,\n"
"  block_table_bytes_est (null if it overflows 64 bits), mha_formula_bytes,\n"
"  gqa_saving_bytes (both null if the MHA figure overflows 64 bits), gqa_ratio\n"
"  (heads / kv_heads), attention (\"MHA\", \"GQA\", \"MQA\", or null without --heads or\n"
"  a preset: heads is then taken as kv_heads), measured (null without\n"
"  --measure, else an object for one session: tokens, blocks, bytes_resident,\n"
"  bytes_ideal, bytes_overhead, engine_pages_in_use, engine_bytes_allocator,\n"
"  peak_rss_bytes, seconds, matches). All byte figures are for the whole batch\n"
"  unless their name says per session or page.\n"
"Variant keys (always present): head_dim_v, window, sinks, rollback,\n"
"  window_every (0: every layer windowed; 2: layers 0, 2, ...), softcap,\n"
"  sink_logits, windowed_layers, full_layers, formula_assumes (what the formula\n"
"  counts, in words), positions_per_windowed_layer, pages_per_windowed_layer (from\n"
"  a real engine), probe_tokens (positions that engine took; 0: too many, the\n"
"  release rule stands in), page_ceiling (docs/variants.md, per windowed layer),\n"
"  dense_formula_bytes\n"
"  (the formula with no window), window_saving_bytes; null without a\n"
"  window (all five). mla: null, or (deepseek-v3) latent_bytes (head_dim values a token and\n"
"  layer: the latent c_t and the rope key), stored_bytes (= formula_bytes: K row of\n"
"  head_dim + V row of head_dim_v), naive_bytes (per-head K/V, decompressed),\n"
"  naive_values_per_token_layer.\n"
"\n"
"exit status: 0 ok, 1 library failure (or measured figures disagree with the\n"
"computed ones), 2 usage error.\n");
}

typedef struct {
    const char *preset;
    const cli_variant_preset *vp;   /* the preset's variant pattern, or NULL */
    uint32_t layers, heads, kv_heads, head_dim, block_tokens;
    uint32_t head_dim_v;            /* 0 = head_dim */
    cli_variant v;
    uint64_t ctx, batch;
    pkv_dtype dtype;
    bool has_layers, has_heads, has_kv, has_dim, has_ctx, has_dv;
    bool has_w, has_s, has_r;
    bool json, measure, force;
} mem_opts;

/* Naive MLA: per-head K (qk_nope + qk_rope) and V (v_head_dim) values per token, head
 * and layer, DeepSeek-V3's config.json: 128 + 64 + 128 (times its 128 heads). */
#define MLA_NAIVE_PER_HEAD (128u + 64u + 128u)

typedef struct {
    uint64_t bytes_per_value;    /* f32/f16/bf16; 0 for the block types */
    uint64_t row_k, row_v;       /* pkv_row_bytes of a K row (d) and a V row (dv) */
    uint64_t token_bytes;        /* one position of every layer: L * g * (row_k + row_v) */
    uint32_t block_tokens;       /* resolved by the engine */
    uint64_t formula;            /* the size formula (docs/memory.md), whole batch */
    uint64_t formula_session;    /* the same, batch = 1 */
    uint64_t page_bytes;         /* from pkv_engine_stats */
    uint64_t pages_per_layer;    /* ceil(ctx / bt) */
    uint64_t pages_per_session;  /* layers * pages_per_layer */
    uint64_t paged_session;      /* pages_per_session * page_bytes */
    uint64_t paged;              /* paged_session * batch */
    uint64_t waste;              /* paged - formula */
    bool table_ok;               /* false: the estimate overflows */
    uint64_t table_est;          /* whole batch */
    bool mha_ok;                 /* false: the MHA formula overflows */
    uint64_t mha;                /* formula with g = heads, whole batch */
    uint64_t saving;             /* mha - formula */
    /* variants */
    uint32_t dv;                 /* head_dim_v, resolved */
    uint32_t windowed, full;     /* layers of each kind */
    uint64_t win_positions;      /* min(ctx, sinks + window + rollback) */
    uint64_t win_pages;          /* pages a windowed layer holds at ctx (engine) */
    uint64_t win_rule_pages;     /* the same by docs/variants.md's rule (cli.h) */
    uint64_t probe_tokens;       /* positions appended to the probe engine */
    uint64_t ceiling;            /* page ceiling per windowed layer (docs/variants.md) */
    uint64_t dense;              /* the formula without the window, whole batch */
    bool mla;
    uint64_t latent, naive;      /* MLA: the latent cache, per-head K/V; whole batch */
    char assumes[256];
} mem_figures;

typedef struct {
    pkv_memory m;                /* one session */
    pkv_stats st;                /* engine, after the appends */
    uint64_t peak_rss;
    double seconds;
    bool matches;
} mem_measured;

static bool mul64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

static int parse(int argc, char **argv, mem_opts *o)
{
    memset(o, 0, sizeof *o);
    o->batch = 1;
    o->dtype = PKV_F16;
    const cli_opt opts[] = {
        {.name = "layers", .kind = OPT_U32, .dst = &o->layers, .lo = 1, .hi = UINT32_MAX,
         .seen = &o->has_layers},
        {.name = "heads", .kind = OPT_U32, .dst = &o->heads, .lo = 1, .hi = UINT32_MAX,
         .seen = &o->has_heads},
        {.name = "kv-heads", .kind = OPT_U32, .dst = &o->kv_heads, .lo = 1,
         .hi = UINT32_MAX, .seen = &o->has_kv},
        {.name = "head-dim", .kind = OPT_U32, .dst = &o->head_dim, .lo = 1,
         .hi = UINT32_MAX, .seen = &o->has_dim},
        {.name = "ctx", .kind = OPT_U64, .dst = &o->ctx, .lo = 1, .hi = UINT64_MAX,
         .seen = &o->has_ctx},
        {.name = "batch", .kind = OPT_U64, .dst = &o->batch, .lo = 1, .hi = UINT64_MAX},
        {.name = "dtype", .kind = OPT_DTYPE, .dst = &o->dtype},
        {.name = "block-tokens", .kind = OPT_U32, .dst = &o->block_tokens, .lo = 0,
         .hi = UINT32_MAX},
        {.name = "model-preset", .kind = OPT_CALL, .dst = &o->preset,
         .call = cli_opt_any_preset,
         .what = "a preset: one of " CLI_PRESET_NAMES ", " CLI_VARIANT_PRESET_NAMES},
        {.name = "head-dim-v", .kind = OPT_U32, .dst = &o->head_dim_v, .lo = 1,
         .hi = CLI_MAX_HEAD_DIM, .note = "the engine's limit", .seen = &o->has_dv},
        {.name = "window", .kind = OPT_U32, .dst = &o->v.window, .lo = 0, .hi = UINT32_MAX,
         .seen = &o->has_w},
        {.name = "sinks", .kind = OPT_U32, .dst = &o->v.sinks, .lo = 0, .hi = UINT32_MAX,
         .seen = &o->has_s},
        {.name = "rollback", .kind = OPT_U32, .dst = &o->v.rollback, .lo = 0,
         .hi = UINT32_MAX, .seen = &o->has_r},
        {.name = "json", .kind = OPT_FLAG, .dst = &o->json},
        {.name = "measure", .kind = OPT_FLAG, .dst = &o->measure},
        {.name = "force", .kind = OPT_FLAG, .dst = &o->force},
    };
    int rc = cli_parse(CMD, argc, argv, opts, sizeof opts / sizeof opts[0], usage, NULL, 0,
                       NULL);
    if (rc != CLI_OK)
        return rc;

    /* The preset fills whatever the flags left unset (flags override it). */
    o->vp = o->preset ? cli_variant_preset_find(o->preset) : NULL;
    if (o->vp) {
        const cli_variant_preset *vp = o->vp;
        const cli_variant given = o->v;
        o->v = vp->v;
        if (o->has_w) o->v.window = given.window;
        if (o->has_s) o->v.sinks = given.sinks;
        if (o->has_r) o->v.rollback = given.rollback;
        if (!o->has_layers) { o->layers = vp->layers; o->has_layers = true; }
        if (!o->has_heads) { o->heads = vp->heads; o->has_heads = true; }
        if (!o->has_kv) { o->kv_heads = vp->kv_heads; o->has_kv = true; }
        if (!o->has_dim) { o->head_dim = vp->head_dim; o->has_dim = true; }
        if (!o->has_dv) o->head_dim_v = vp->head_dim_v;
    } else if (o->preset) {
        const cli_preset *p = cli_preset_find(o->preset);
        if (!p)
            return cli_usage_error(CMD, "unknown preset '%s' (see --help for the list)",
                                   o->preset);
        if (!o->has_layers) { o->layers = p->layers; o->has_layers = true; }
        if (!o->has_heads) { o->heads = p->heads; o->has_heads = true; }
        if (!o->has_kv) { o->kv_heads = p->kv_heads; o->has_kv = true; }
        if (!o->has_dim) { o->head_dim = p->head_dim; o->has_dim = true; }
    }
    if (!o->has_layers || !o->has_kv || !o->has_dim || !o->has_ctx)
        return cli_usage_error(CMD, "missing geometry: need %s%s%s%s(or --model-preset)",
                               o->has_layers ? "" : "--layers ",
                               o->has_kv ? "" : "--kv-heads ",
                               o->has_dim ? "" : "--head-dim ",
                               o->has_ctx ? "" : "--ctx ");
    if (!o->has_heads)
        o->heads = o->kv_heads;
    if (o->layers == 0 || o->heads == 0 || o->kv_heads == 0 || o->head_dim == 0)
        return cli_usage_error(CMD, "--layers, --heads, --kv-heads and --head-dim must be "
                                    "at least 1");
    if (o->ctx == 0)
        return cli_usage_error(CMD, "--ctx must be at least 1");
    if (o->batch == 0)
        return cli_usage_error(CMD, "--batch must be at least 1");
    if (o->heads % o->kv_heads != 0)
        return cli_usage_error(CMD, "--heads (%u) must be a multiple of --kv-heads (%u)",
                               o->heads, o->kv_heads);
    if (cli_variant_check(CMD, &o->v) != CLI_OK)
        return CLI_USAGE;
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim,
                              o->block_tokens, o->dtype, 1);
    c.head_dim_v = o->head_dim_v;
    return cli_check_limits(CMD, &c, NULL);
}

/* The engine config of o with its layer configs (*lc, *sinks: free them). */
static pkv_config mem_config(const mem_opts *o, pkv_layer_config **lc, float **sinks,
                             bool *oom)
{
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim,
                              o->block_tokens, o->dtype, 1);
    c.head_dim_v = o->head_dim_v;
    *lc = cli_variant_layers(&o->v, o->layers, o->heads, sinks, oom);
    c.layer_cfg = *lc;
    return c;
}

/* Probes longer than this many appends are not run (a window beyond the context of a
 * huge --ctx): the figure is then docs/variants.md's rule, and the output says so. */
#define PROBE_MAX_TOKENS (4u << 20)

/* Pages one windowed layer holds at ctx, from a real engine: a one-layer engine of the
 * layer's config and page size, a session of zeros. Which pages a layer holds depends
 * on the positions, the page size and the layer config only, not on the heads, widths
 * or dtype, so the probe's engine has one head of one value (a page of 8 * bt bytes):
 * cheap for any geometry. A window's pages repeat with period bt once the sinks and
 * the window are behind (the release rule moves with the position), so ctx is
 * replaced by the shortest length past that point with the same ctx mod bt: a few
 * thousand appends instead of ctx. *tokens = 0: too long, not run. */
static pkv_status probe_window_pages(const mem_opts *o, uint32_t bt, uint64_t *pages,
                                     uint64_t *tokens)
{
    pkv_layer_config lc = {.window = o->v.window, .sink_tokens = o->v.sinks,
                           .rollback_tokens = o->v.rollback};
    pkv_config c = cli_config(1, 1, 1, 1, bt, PKV_F32, 1);
    c.layer_cfg = &lc;
    const uint64_t span = (uint64_t)o->v.window + o->v.rollback;
    const uint64_t base = bt * ((span + bt - 1) / bt + ((uint64_t)o->v.sinks + bt - 1) / bt + 2);
    const uint64_t n = o->ctx < base + bt ? o->ctx : base + o->ctx % bt;
    *tokens = 0;
    if (n > PROBE_MAX_TOKENS)
        return PKV_OK;
    const float zero[1] = {0};
    pkv_engine *e = NULL;
    pkv_session *s = NULL;
    pkv_memory m;
    pkv_status st = pkv_engine_create(&c, &e);
    if (st == PKV_OK)
        st = pkv_session_create(e, &s);
    for (uint64_t t = 0; st == PKV_OK && t < n; t++)
        st = pkv_append(s, 0, zero, zero);
    if (st == PKV_OK)
        st = pkv_session_memory(s, &m);
    if (st == PKV_OK) {
        *pages = m.blocks;
        *tokens = n;
    }
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    return st;
}

/* The engine for this geometry (one worker thread: nothing here decodes). */
static int make_engine(const mem_opts *o, pkv_engine **e)
{
    pkv_layer_config *lc = NULL;
    float *sinks = NULL;
    bool oom = false;
    const pkv_config c = mem_config(o, &lc, &sinks, &oom);
    pkv_status st = oom ? PKV_ENOMEM : pkv_engine_create(&c, e);
    char why[256] = "";
    if (st == PKV_EINVAL)
        pkv_config_explain(&c, why, sizeof why);
    free(lc);
    free(sinks);
    if (st != PKV_OK)
        return cli_fail(CMD, "the library refuses this geometry (layers %u, heads %u, "
                             "kv-heads %u, head-dim %u, block-tokens %u, %s): %s%s%s",
                        o->layers, o->heads, o->kv_heads, o->head_dim, o->block_tokens,
                        pkv_dtype_name(o->dtype), pkv_status_str(st), why[0] ? ": " : "",
                        why);
    return CLI_OK;
}

static int overflow(void)
{
    return cli_usage_error(CMD, "the cache of this geometry overflows 64 bits");
}

static int compute(const mem_opts *o, pkv_engine *e, mem_figures *f)
{
    memset(f, 0, sizeof *f);
    f->bytes_per_value = pkv_dtype_size(o->dtype);

    pkv_config rc;
    pkv_stats st;
    pkv_status s = pkv_engine_config(e, &rc);
    if (s == PKV_OK)
        s = pkv_engine_stats(e, &st);
    if (s != PKV_OK)
        return cli_fail(CMD, "cannot read the engine back: %s", pkv_status_str(s));
    f->block_tokens = rc.block_tokens;
    f->page_bytes = st.page_bytes;
    f->dv = rc.head_dim_v;
    if (f->block_tokens == 0)
        return cli_fail(CMD, "the engine reports block_tokens 0");
    f->windowed = cli_variant_windowed_layers(&o->v, o->layers);
    f->full = o->layers - f->windowed;
    f->mla = o->vp && o->vp->head_dim_v != 0 && f->dv != o->head_dim;
    f->row_k = pkv_row_bytes(o->dtype, o->head_dim);
    f->row_v = pkv_row_bytes(o->dtype, f->dv);
    if (!mul64(o->layers, o->kv_heads, &f->token_bytes) ||
        !mul64(f->token_bytes, f->row_k + f->row_v, &f->token_bytes))
        return overflow();
    /* the size formula (docs/memory.md) (bytes_per_value) holds for the per-value types alone */
    const bool plain = !f->windowed && f->dv == o->head_dim && f->bytes_per_value != 0;

    /* positions a session keeps that a decode can still read, summed over layers */
    const uint64_t keep = (uint64_t)o->v.sinks + o->v.window + o->v.rollback;
    f->win_positions = f->windowed ? (o->ctx < keep ? o->ctx : keep) : 0;
    uint64_t positions, a, b;
    if (!mul64(f->full, o->ctx, &a) || !mul64(f->windowed, f->win_positions, &b) ||
        __builtin_add_overflow(a, b, &positions))
        return overflow();

    if (plain) {
        s = pkv_kv_cache_bytes(o->layers, o->kv_heads, o->head_dim, o->ctx, o->batch,
                               f->bytes_per_value, &f->formula);
        if (s == PKV_ERANGE)
            return cli_usage_error(CMD, "the KV cache of %" PRIu64 " sessions of %" PRIu64
                                        " tokens overflows 64 bits", o->batch, o->ctx);
        if (s == PKV_OK)
            s = pkv_kv_cache_bytes(o->layers, o->kv_heads, o->head_dim, o->ctx, 1,
                                   f->bytes_per_value, &f->formula_session);
        if (s != PKV_OK)
            return cli_fail(CMD, "pkv_kv_cache_bytes: %s", pkv_status_str(s));
        f->dense = f->formula;
        snprintf(f->assumes, sizeof f->assumes, "K and V of head_dim for every "
                 "position of every layer");
    } else {
        /* one position of one layer: g K rows of head_dim and V rows of head_dim_v */
        uint64_t tok, dense_pos;
        if (!mul64(o->kv_heads, f->row_k + f->row_v, &tok) ||
            !mul64(positions, tok, &f->formula_session) ||
            !mul64(f->formula_session, o->batch, &f->formula) ||
            !mul64(o->layers, o->ctx, &dense_pos) || !mul64(dense_pos, tok, &f->dense) ||
            !mul64(f->dense, o->batch, &f->dense))
            return overflow();
        size_t n = 0;
        if (f->windowed)
            n += (size_t)snprintf(f->assumes, sizeof f->assumes, "by layer: %u full layer(s) "
                                  "x %" PRIu64 " positions + %u windowed x min(ctx, sinks + "
                                  "window + rollback) = %" PRIu64 " positions; ",
                                  f->full, o->ctx, f->windowed, f->win_positions);
        n += (size_t)snprintf(f->assumes + n, sizeof f->assumes - n, "%s%u kv-head(s) x (K %u "
                              "+ V %u) values a position", f->mla ? "MLA: the latent (K = "
                              "[c_t ; k_rope], V = c_t), not per-head K/V; " : "",
                              o->kv_heads, o->head_dim, f->dv);
        if (!f->bytes_per_value && n < sizeof f->assumes)
            snprintf(f->assumes + n, sizeof f->assumes - n, "; %s rows of %" PRIu64
                     " + %" PRIu64 " bytes (blocks of 32 values, an f16 scale each)",
                     pkv_dtype_name(o->dtype), f->row_k, f->row_v);
    }

    f->pages_per_layer = o->ctx / f->block_tokens + (o->ctx % f->block_tokens != 0);
    if (f->windowed) {
        s = probe_window_pages(o, f->block_tokens, &f->win_pages, &f->probe_tokens);
        if (s != PKV_OK)
            return cli_fail(CMD, "the windowed layer's engine failed: %s", pkv_status_str(s));
        f->win_rule_pages = cli_variant_pages_held(&o->v, true, o->ctx, f->block_tokens);
        if (f->probe_tokens == 0)   /* too long to probe: the rule stands in */
            f->win_pages = f->win_rule_pages;
        f->ceiling = cli_variant_page_ceiling(&o->v, f->block_tokens);
        if (f->win_pages > f->ceiling)
            return cli_fail(CMD, "a windowed layer holds %" PRIu64 " pages, beyond the page "
                                 "ceiling of %" PRIu64, f->win_pages, f->ceiling);
    }
    if (!mul64(f->full, f->pages_per_layer, &a) || !mul64(f->windowed, f->win_pages, &b) ||
        __builtin_add_overflow(a, b, &f->pages_per_session) ||
        !mul64(f->pages_per_session, f->page_bytes, &f->paged_session) ||
        !mul64(f->paged_session, o->batch, &f->paged))
        return cli_usage_error(CMD, "the paged cache of this geometry overflows 64 bits");
    f->table_ok = mul64(f->pages_per_session, o->batch, &f->table_est) &&
                  mul64(f->table_est, TABLE_BYTES_PER_PAGE, &f->table_est);
    if (f->paged < f->formula)
        return cli_fail(CMD, "paged figure %" PRIu64 " below the formula %" PRIu64
                             ": library and formula disagree", f->paged, f->formula);
    f->waste = f->paged - f->formula;

    if (plain) {
        s = pkv_kv_cache_bytes(o->layers, o->heads, o->head_dim, o->ctx, o->batch,
                               f->bytes_per_value, &f->mha);
        f->mha_ok = s == PKV_OK;
        if (s != PKV_OK && s != PKV_ERANGE)
            return cli_fail(CMD, "pkv_kv_cache_bytes: %s", pkv_status_str(s));
    } else {
        /* the formula is linear in g: the same positions with kv_heads = heads */
        f->mha_ok = mul64(f->formula / o->kv_heads, o->heads, &f->mha);
    }
    f->saving = f->mha_ok ? f->mha - f->formula : 0;
    /* the latent: one row of head_dim values a position; naive: per head a K row of
     * 128 + 64 and a V row of 128 values (rows of the block types: their scales too) */
    const uint64_t naive_head = pkv_row_bytes(o->dtype, MLA_NAIVE_PER_HEAD - 128u) +
                                pkv_row_bytes(o->dtype, 128u);
    if (f->mla && (!mul64(positions, f->row_k, &f->latent) ||
                   !mul64(f->latent, o->batch, &f->latent) ||
                   !mul64(positions, (uint64_t)o->heads * naive_head, &f->naive) ||
                   !mul64(f->naive, o->batch, &f->naive)))
        return overflow();
    return CLI_OK;
}

/* One session of ctx zero tokens in every layer; its memory next to the figures. */
static int measure(const mem_opts *o, pkv_engine *e, const mem_figures *f,
                   mem_measured *r)
{
    memset(r, 0, sizeof *r);
    if (cli_memory_guard(CMD, "--measure (one session)", f->paged_session,
                         MEASURE_LIMIT_BYTES, "the --measure limit", o->force) != CLI_OK)
        return CLI_USAGE;
    const uint32_t dv = o->head_dim_v > o->head_dim ? o->head_dim_v : o->head_dim;
    size_t row = (size_t)o->kv_heads * dv;   /* wide enough for a K and a V row */
    float *zeros = calloc(row, sizeof(float));
    if (!zeros)
        return cli_fail(CMD, "out of memory");
    pkv_session *s = NULL;
    double t0 = cli_now();
    pkv_status st = pkv_session_create(e, &s);
    for (uint32_t l = 0; st == PKV_OK && l < o->layers; l++)
        for (uint64_t t = 0; st == PKV_OK && t < o->ctx; t++)
            st = pkv_append(s, l, zeros, zeros);
    if (st == PKV_OK)
        st = pkv_session_memory(s, &r->m);
    if (st == PKV_OK)
        st = pkv_engine_stats(e, &r->st);
    r->seconds = cli_now() - t0;
    r->peak_rss = cli_peak_rss_bytes();
    pkv_session_destroy(s);
    free(zeros);
    if (st != PKV_OK)
        return cli_fail(CMD, "--measure: building the session failed: %s",
                        pkv_status_str(st));
    uint64_t tokens;
    r->matches = mul64(o->layers, o->ctx, &tokens) && r->m.tokens == tokens &&
                 r->m.blocks == f->pages_per_session &&
                 r->m.bytes_resident == f->paged_session &&
                 r->m.bytes_ideal == f->formula_session;
    return CLI_OK;
}

/* "MHA", "MQA", "GQA", or NULL when the query heads were not given. */
static const char *attention_kind(const mem_opts *o)
{
    if (!o->has_heads)
        return NULL;
    return o->kv_heads == o->heads ? "MHA" : o->kv_heads == 1 ? "MQA" : "GQA";
}

static void print_text(const mem_opts *o, const mem_figures *f, const mem_measured *r)
{
    char b1[32], b2[32];
    const uint32_t hg = o->heads / o->kv_heads;
    /* The kind of attention is known only when the query heads are: without --heads
     * (or a preset) the figures take heads = kv-heads, which says nothing about it. */
    const char *kind = attention_kind(o);
    if (o->preset)
        printf("preset          %s\n", o->preset);
    if (kind)
        printf("geometry        %u layers, %u heads, %u kv-heads (%s, %u quer%s per group), "
               "head-dim %u\n", o->layers, o->heads, o->kv_heads, kind, hg,
               hg == 1 ? "y" : "ies", o->head_dim);
    else
        printf("geometry        %u layers, %u kv-heads (query heads not given), head-dim %u\n",
               o->layers, o->kv_heads, o->head_dim);
    if (f->bytes_per_value)
        printf("sessions        %" PRIu64 " x %" PRIu64 " tokens, %s (%" PRIu64
               " bytes/value), block-tokens %u\n",
               o->batch, o->ctx, pkv_dtype_name(o->dtype), f->bytes_per_value, f->block_tokens);
    else
        printf("sessions        %" PRIu64 " x %" PRIu64 " tokens, %s (%.4g bits/value: a "
               "%u-value row is %" PRIu64 " bytes, blocks of 32 values with an f16 scale), "
               "block-tokens %u\n", o->batch, o->ctx, pkv_dtype_name(o->dtype),
               8.0 * (double)f->row_k / o->head_dim, o->head_dim, f->row_k, f->block_tokens);
    printf("per token       %" PRIu64 " bytes (%u layers x %u kv-heads x (K row %" PRIu64
           " + V row %" PRIu64 " bytes))\n", f->token_bytes, o->layers, o->kv_heads, f->row_k,
           f->row_v);
    const bool plain = !f->windowed && f->dv == o->head_dim && f->bytes_per_value != 0;
    if (f->windowed || f->dv != o->head_dim || cli_variant_any(&o->v)) {
        char vd[256];
        printf("variant         %s; head-dim-v %u\n",
               cli_variant_describe(&o->v, o->layers, vd, sizeof vd), f->dv);
    }
    if (o->vp)
        printf("preset assumes  like %s: %s\n", o->vp->like, o->vp->note);
    printf("\n");
    if (plain)
        printf("formula         2 * %u * %u * %u * %" PRIu64 " * %" PRIu64 " * %" PRIu64 "\n",
               o->layers, o->kv_heads, o->head_dim, o->ctx, o->batch, f->bytes_per_value);
    else if (f->bytes_per_value)
        printf("formula         %s\n                (%u full x %" PRIu64 " + %u windowed x %"
               PRIu64 " positions) * %u * (%u + %u) * %" PRIu64 " * %" PRIu64 "\n",
               f->assumes, f->full, o->ctx, f->windowed, f->win_positions, o->kv_heads,
               o->head_dim, f->dv, o->batch, f->bytes_per_value);
    else
        printf("formula         %s\n                (%u full x %" PRIu64 " + %u windowed x %"
               PRIu64 " positions) * %u * (%" PRIu64 " + %" PRIu64 " bytes) * %" PRIu64 "\n",
               f->assumes, f->full, o->ctx, f->windowed, f->win_positions, o->kv_heads,
               f->row_k, f->row_v, o->batch);
    printf("                = %" PRIu64 " bytes (%s)\n", f->formula, cli_bytes(f->formula, b1));
    if (f->windowed)
        printf("paged           (%u full * %" PRIu64 " + %u windowed * %" PRIu64 ") pages * %"
               PRIu64 " bytes * %" PRIu64 "\n", f->full, f->pages_per_layer, f->windowed,
               f->win_pages, f->page_bytes, o->batch);
    else
        printf("paged           %u layers * %" PRIu64 " pages * %" PRIu64 " bytes * %" PRIu64
               "\n", o->layers, f->pages_per_layer, f->page_bytes, o->batch);
    printf("                = %" PRIu64 " bytes (%s)\n", f->paged, cli_bytes(f->paged, b1));
    if (!f->bytes_per_value)
        printf("page            %" PRIu64 " bytes (%s) = %u kv-heads * %u tokens * (%" PRIu64
               " + %" PRIu64 ") bytes a K and a V row\n", f->page_bytes,
               cli_bytes(f->page_bytes, b1), o->kv_heads, f->block_tokens, f->row_k, f->row_v);
    else if (f->dv == o->head_dim)
        printf("page            %" PRIu64 " bytes (%s) = 2 * %u kv-heads * %u tokens * %u "
               "* %" PRIu64 "\n", f->page_bytes, cli_bytes(f->page_bytes, b1), o->kv_heads,
               f->block_tokens, o->head_dim, f->bytes_per_value);
    else
        printf("page            %" PRIu64 " bytes (%s) = %u kv-heads * %u tokens * (%u + %u) "
               "* %" PRIu64 "\n", f->page_bytes, cli_bytes(f->page_bytes, b1), o->kv_heads,
               f->block_tokens, o->head_dim, f->dv, f->bytes_per_value);
    if (f->windowed) {
        char how[160];
        if (f->probe_tokens)
            snprintf(how, sizeof how, "a real engine of this window and page size, %" PRIu64
                     " positions appended: the pages repeat every %u", f->probe_tokens,
                     f->block_tokens);
        else
            snprintf(how, sizeof how, "by the release rule: a probe would append more than %u "
                     "positions", PROBE_MAX_TOKENS);
        printf("windowed layer  %" PRIu64 " pages held at %" PRIu64 " tokens (%s); release "
               "rule %" PRIu64 ", ceiling %" PRIu64 " = ceil(%u/%u) + ceil((%u+%u)/%u) + 1\n",
               f->win_pages, o->ctx, how, f->win_rule_pages,
               f->ceiling, o->v.sinks, f->block_tokens, o->v.window, o->v.rollback,
               f->block_tokens);
        printf("vs no window    %" PRIu64 " bytes (%s) by the formula: the window saves %"
               PRIu64 " bytes (%s)\n", f->dense, cli_bytes(f->dense, b1),
               f->dense - f->formula, cli_bytes(f->dense - f->formula, b2));
    }
    if (f->mla) {
        printf("MLA latent      %" PRIu64 " bytes (%s): the %u values a token and layer "
               "DeepSeek caches ([c_t ; k_rope]); pagedkv stores V = c_t again, %.2fx\n",
               f->latent, cli_bytes(f->latent, b1), o->head_dim,
               f->latent ? (double)f->formula / (double)f->latent : 0.0);
        printf("naive MLA       %" PRIu64 " bytes (%s): per-head K/V, %u heads x %u values; "
               "the latent is %.1fx smaller\n", f->naive, cli_bytes(f->naive, b1), o->heads,
               MLA_NAIVE_PER_HEAD, f->latent ? (double)f->naive / (double)f->latent : 0.0);
    }
    if (f->windowed)
        printf("pages/session   %" PRIu64 " (%" PRIu64 " per full layer, %" PRIu64
               " per windowed layer)\n", f->pages_per_session, f->pages_per_layer,
               f->win_pages);
    else
        printf("pages/session   %" PRIu64 " (%" PRIu64 " per layer)\n", f->pages_per_session,
               f->pages_per_layer);
    printf("waste           %" PRIu64 " bytes (%s, %.3f%%): the partly filled last page "
           "of each layer%s\n", f->waste, cli_bytes(f->waste, b1),
           f->paged ? 100.0 * (double)f->waste / (double)f->paged : 0.0,
           f->windowed ? " (a windowed layer's oldest page may be partly read, too)" : "");
    if (f->table_ok)
        printf("block tables    ~%" PRIu64 " bytes (%s, estimate: %u bytes per page; table "
               "growth slack and decode scratch come on top)\n",
               f->table_est, cli_bytes(f->table_est, b1), (unsigned)TABLE_BYTES_PER_PAGE);
    else
        printf("block tables    the estimate overflows 64 bits\n");
    if (!kind)
        printf("vs MHA          unknown: give --heads (query heads) to compare with MHA\n");
    else if (hg == 1)
        printf("vs MHA          this is MHA (kv-heads = heads); give --heads to compare "
               "a GQA/MQA model\n");
    else if (f->mha_ok)
        printf("vs MHA          %" PRIu64 " bytes (%s) with kv-heads = heads = %u; "
               "%s saves %" PRIu64 " bytes (%s, %ux less)\n",
               f->mha, cli_bytes(f->mha, b1), o->heads, kind, f->saving,
               cli_bytes(f->saving, b2), hg);
    else
        printf("vs MHA          the MHA cache (kv-heads = heads = %u) overflows 64 bits\n",
               o->heads);
    if (!r)
        return;
    printf("\nmeasured        one session, %" PRIu64 " tokens in each of %u layers, %.2f s\n",
           o->ctx, o->layers, r->seconds);
    printf("  tokens          %" PRIu64 "\n", r->m.tokens);
    printf("  blocks          %" PRIu64 "   (computed %" PRIu64 ")\n", r->m.blocks,
           f->pages_per_session);
    printf("  bytes_resident  %" PRIu64 "   (computed paged/session %" PRIu64 ")\n",
           r->m.bytes_resident, f->paged_session);
    printf("  bytes_ideal     %" PRIu64 "   (computed formula/session %" PRIu64 ")\n",
           r->m.bytes_ideal, f->formula_session);
    /* the estimate per session: the pages of one session at the same rate */
    printf("  bytes_overhead  %" PRIu64 "   (estimate %" PRIu64 ")\n", r->m.bytes_overhead,
           f->pages_per_session * (uint64_t)TABLE_BYTES_PER_PAGE);
    printf("  engine          %" PRIu64 " pages in use, allocator %" PRIu64 " bytes (%s)\n",
           r->st.pages_in_use, r->st.bytes_allocator, cli_bytes(r->st.bytes_allocator, b1));
    printf("  peak RSS        %" PRIu64 " bytes (%s)\n", r->peak_rss,
           cli_bytes(r->peak_rss, b1));
    printf("  matches         %s\n", r->matches ? "yes" : "NO");
}

static void print_json(const mem_opts *o, const mem_figures *f, const mem_measured *r)
{
    json_writer w = {stdout, true, false}, *W = &w;
    json_open(W, NULL, '{');
    cli_json_envelope(W, CMD, NULL);
    json_str(W, "preset", o->preset);
    JSON_U64S(W, {"layers", o->layers}, {"heads", o->heads}, {"kv_heads", o->kv_heads},
              {"head_dim", o->head_dim}, {"ctx", o->ctx}, {"batch", o->batch});
    json_str(W, "dtype", pkv_dtype_name(o->dtype));
    if (f->bytes_per_value)
        json_u64(W, "bytes_per_value", f->bytes_per_value);
    else /* a block type: the mean over a K row, scales included */
        json_num(W, "bytes_per_value", (double)f->row_k / o->head_dim);
    JSON_U64S(W, {"row_bytes_k", f->row_k}, {"row_bytes_v", f->row_v},
              {"bytes_per_token", f->token_bytes});
    JSON_U64S(W, {"block_tokens", f->block_tokens},
              {"formula_bytes", f->formula}, {"paged_bytes", f->paged},
              {"page_bytes", f->page_bytes}, {"pages_per_layer", f->pages_per_layer},
              {"pages_per_session", f->pages_per_session}, {"waste_bytes", f->waste});
    if (f->table_ok)
        json_u64(W, "block_table_bytes_est", f->table_est);
    else
        json_str(W, "block_table_bytes_est", NULL);
    if (f->mha_ok) {
        JSON_U64S(W, {"mha_formula_bytes", f->mha}, {"gqa_saving_bytes", f->saving});
    } else {
        json_str(W, "mha_formula_bytes", NULL);
        json_str(W, "gqa_saving_bytes", NULL);
    }
    json_u64(W, "gqa_ratio", o->heads / o->kv_heads);
    json_str(W, "attention", attention_kind(o));
    JSON_U64S(W, {"head_dim_v", f->dv}, {"window", o->v.window}, {"sinks", o->v.sinks},
              {"rollback", o->v.rollback}, {"window_every", o->v.every});
    json_num(W, "softcap", o->v.softcap);
    json_bool(W, "sink_logits", o->v.sink_logits);
    JSON_U64S(W, {"windowed_layers", f->windowed}, {"full_layers", f->full});
    json_str(W, "formula_assumes", f->assumes);
    if (f->windowed) {
        JSON_U64S(W, {"probe_tokens", f->probe_tokens},
                  {"positions_per_windowed_layer", f->win_positions},
                  {"pages_per_windowed_layer", f->win_pages}, {"page_ceiling", f->ceiling},
                  {"dense_formula_bytes", f->dense},
                  {"window_saving_bytes", f->dense - f->formula});
    } else {
        json_str(W, "probe_tokens", NULL);
        json_str(W, "positions_per_windowed_layer", NULL);
        json_str(W, "pages_per_windowed_layer", NULL);
        json_str(W, "page_ceiling", NULL);
        json_str(W, "dense_formula_bytes", NULL);
        json_str(W, "window_saving_bytes", NULL);
    }
    if (!f->mla) {
        json_str(W, "mla", NULL);
    } else {
        json_open(W, "mla", '{');
        JSON_U64S(W, {"latent_bytes", f->latent}, {"stored_bytes", f->formula},
                  {"naive_bytes", f->naive},
                  {"naive_values_per_token_layer", (uint64_t)o->heads * MLA_NAIVE_PER_HEAD});
        json_close(W, '}');
    }
    if (!r) {
        json_str(W, "measured", NULL);
    } else {
        json_open(W, "measured", '{');
        JSON_U64S(W, {"tokens", r->m.tokens}, {"blocks", r->m.blocks},
                  {"bytes_resident", r->m.bytes_resident}, {"bytes_ideal", r->m.bytes_ideal},
                  {"bytes_overhead", r->m.bytes_overhead},
                  {"engine_pages_in_use", r->st.pages_in_use},
                  {"engine_bytes_allocator", r->st.bytes_allocator},
                  {"peak_rss_bytes", r->peak_rss});
        json_fmt(W, "seconds", "%.6f", r->seconds);
        json_bool(W, "matches", r->matches);
        json_close(W, '}');
    }
    json_close(W, '}');
    fputc('\n', stdout);
}

int cmd_mem(int argc, char **argv)
{
    mem_opts o;
    int rc = parse(argc, argv, &o);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    pkv_engine *e = NULL;
    if ((rc = make_engine(&o, &e)) != CLI_OK)
        return rc;
    mem_figures f;
    mem_measured m;
    rc = compute(&o, e, &f);
    if (rc == CLI_OK && o.measure)
        rc = measure(&o, e, &f, &m);
    pkv_engine_destroy(e);
    if (rc != CLI_OK)
        return rc;
    if (o.json)
        print_json(&o, &f, o.measure ? &m : NULL);
    else
        print_text(&o, &f, o.measure ? &m : NULL);
    if (o.measure && !m.matches)
        return cli_fail(CMD, "measured session memory disagrees with the computed figures");
    return CLI_OK;
}

/*
 * mem/mem.c - `pagedkv mem`: how much KV-cache memory a model geometry costs, as the
 * size formula (docs/memory.md) and as the paged cache really stores it (docs/design.md, "Page
 * layout").
 *
 * Owns: option parsing, the figures, and the --measure run (report.c prints them).
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
#include "mem/mem.h"

static const char *const CMD = "mem";

/* --measure refuses sessions larger than this without --force: one session of this
 * size is really allocated (and touched) in RAM. */
#define MEASURE_LIMIT_BYTES (1ull << 30)


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
        mem_print_json(&o, &f, o.measure ? &m : NULL);
    else
        mem_print_text(&o, &f, o.measure ? &m : NULL);
    if (o.measure && !m.matches)
        return cli_fail(CMD, "measured session memory disagrees with the computed figures");
    return CLI_OK;
}

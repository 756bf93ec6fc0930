/*
 * quality/quality.c - `pagedkv quality` (docs/tools.md, "pagedkv quality"): what each storage dtype
 * costs in model quality, measured the way llama.cpp users are told to measure a KV-cache format:
 * KL divergence of the next-token distributions against an f32 cache, position by
 * position on the same tokens.
 *
 * Owns: the options, the two runs of the model mode (the f32 greedy run that decides
 * the tokens, then one teacher-forced run per dtype and path), its figures and table,
 * and the JSON and bar chart of both modes. Does not own: the synthetic
 * attention-only mode (quality/synthetic.c), the rows and their engines
 * (quality/rows.c), the model math (llama/llama.c), the attention through the cache
 * (llama/llama_kv.c), the rounding (pkv_dtype_round_row), the reference
 * (pkv_attention_reference). Uses only the public API.
 *
 * Model mode, for a run of T positions (-n, prompt included, as `generate` counts):
 *   1. f32 cache, greedy: the prompt through pkv_prefill, then one token a step
 *      (pkv_append + pkv_decode); tok[p + 1] = argmax of the logits at p. A --model
 *      stops at BOS as `generate` does (fewer positions then; the report says so).
 *   2. For f32 again, f16, bf16, q8, q4 (each on the exact path, and Q8/Q4 on the
 *      integer path, pkv_config.quant_dot = 1, where pkv_config_explain accepts it):
 *      the same T tokens in one forward through pkv_prefill (bitwise identical to
 *      append + decode, pagedkv.h), the logits of every position. The f32 row is the
 *      self-check: KL 0 and 100% top-1 exactly.
 *   Per row: KL(P_f32 || P_dtype) at every position (softmax of the logits, in
 *   double; mean, p99 by nearest rank, max), top-1 agreement (argmax, lowest id on
 *   ties), and the attention-output error of the cache alone: at every layer, the
 *   output of the cache next to pkv_attention_reference on the same q/K/V unrounded,
 *   max |diff| and that over max |reference|.
 * Synthetic mode (--synthetic): quality/synthetic.c. The rows both modes fill, and
 * their engines: quality/rows.c.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/json.h"
#include "llama.h"
#include "llama_kv.h"
#include "common/opt.h"
#include "quality/quality.h"
#include "common/svg.h"
#include "tokenizer.h"

#define CMD "quality"
/* The built-in model is the one `pagedkv generate` runs without --model (its
 * SYNTHETIC_SEED in generate/generate.c). */
#define BUILTIN_SEED 0x5eedull

static void usage(FILE *f)
{
    fprintf(f,
"usage: pagedkv quality [OPTIONS]\n"
"\n"
"What each K/V storage dtype costs in quality (docs/tools.md). The model (built-in,\n"
"or --model) runs greedy with an f32 cache; that decides the tokens. Then the same\n"
"tokens go through the model with each dtype's cache (teacher-forced, one\n"
"pkv_prefill), and the next-token distributions are compared with the f32 run\n"
"position by position.\n"
"Per dtype and path: bytes per token, KL divergence against f32 (mean, p99, max),\n"
"top-1 agreement, and the attention-output error of the cache (each layer's output\n"
"next to pkv_attention_reference on the same unrounded q/K/V).\n"
"\n"
"  --model FILE        llama2.c checkpoint (default: the built-in model of generate)\n"
"  --tokenizer FILE    llama2.c tokenizer: the prompt is text, the f32 text is shown\n"
"  -n, --steps N       positions, prompt included (default 256; at most seq_len)\n"
"  -i, --prompt TEXT   prompt (default empty: BOS alone; without a tokenizer each\n"
"                      byte b is token b+3)\n"
"  --prompts FILE      one prompt a line (an empty line: BOS alone; at most %u):\n"
"                      each runs -n positions as -i would, and the figures are\n"
"                      over all their positions; the table adds each prompt's top-1\n"
"                      (one text's top-1 moves by 1/n a flip: more text, steadier)\n"
"  --dtype LIST        dtypes compared with f32 (default f16,bf16,q8,q4); q8 and q4\n"
"                      run on the exact path and, where the engine accepts\n"
"                      quant_dot = 1, on the integer path too\n"
"  --block-tokens B    tokens per page (default: the library's)\n"
"  --threads N         engine threads (default 0 = online CPUs)\n"
"  --json              one JSON object on stdout instead of the table\n"
"  --svg FILE          bar chart of KL mean and p99 per dtype and path\n"
"\n"
"  --synthetic         attention alone, no model: one llama3-8b layer (h 32, g 8,\n"
"                      d 128) with random q/K/V whose K has a few large channels;\n"
"                      per dtype the error of each rounding (K, V) and of the engine\n"
"                      against the reference on unrounded and on rounded rows\n"
"  --ctx N             synthetic positions (default 256; the reference is O(N^2))\n"
"  --outliers N        synthetic: large K channels per group (default 4, at most %u)\n"
"  --outlier-scale S   synthetic: their size (default 16: |K| about 16 there, 1 elsewhere)\n"
"  --q-scale S         synthetic: q ~ S * N(0, 1) (default 2)\n"
"  --seed S            synthetic: random seed (default 1)\n"
"  -h, --help          this help\n"
"\n"
"JSON keys: the envelope of every command (tool, command, version, isa, host, cpu,\n"
"  online_cpus, argv), then mode (\"model\" or \"synthetic\"); model mode:\n"
"  model (path or null: built-in), tokenizer, layers, heads, kv_heads, head_dim, vocab,\n"
"  prompts, positions (compared, all prompts), prompt_positions, stopped_at_bos (any\n"
"  prompt), text (the first prompt's; null without a tokenizer); synthetic mode:\n"
"  heads, kv_heads, head_dim, ctx, seed, outlier_channels, outlier_scale, q_scale,\n"
"  max_abs_out; rows (list of {dtype, path, available, reason,\n"
"  bytes_per_token, then model mode: kl_mean, kl_p99, kl_max, top1 (0..1),\n"
"  top1_per_prompt (list), top1_flips, top1_flip_margin_max, attn_max_abs, attn_rel;\n"
"  synthetic mode:\n"
"  k_rms_rel, v_rms_rel, err_k_only, err_v_only, err_ref_rounded, err_vs_unrounded,\n"
"  err_vs_rounded}); figures of an unavailable row are null.\n"
"\n"
"exit status: 0 ok, 1 the library or a file failed, 2 usage error.\n",
            MAX_PROMPTS, MAX_OUTLIERS);
}

static bool list_dtypes(const char *v, void *dst)
{
    q_opts *o = dst;
    char buf[128];
    if (!v || !*v || strlen(v) >= sizeof buf)
        return false;
    snprintf(buf, sizeof buf, "%s", v);
    o->n_dtypes = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->n_dtypes >= 5 || !cli_parse_dtype(t, &o->dtypes[o->n_dtypes]))
            return false;
        o->n_dtypes++;
    }
    return o->n_dtypes > 0 && v[strlen(v) - 1] != ',' && !strstr(v, ",,") && v[0] != ',';
}

static int parse(int argc, char **argv, q_opts *o)
{
    memset(o, 0, sizeof *o);
    o->prompt = "";
    o->steps = 256;
    o->ctx = 256;
    o->outliers = 4;
    o->outlier_scale = 16;
    o->q_scale = 2;
    o->seed = 1;
    bool prompt_seen = false;
    static const char *const synth_why = "it sets the attention-only synthetic run";
    static const pkv_dtype def[] = {PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};
    for (; o->n_dtypes < 4; o->n_dtypes++)
        o->dtypes[o->n_dtypes] = def[o->n_dtypes];
    const cli_opt opts[] = {
        {.name = "model", .kind = OPT_STRING, .dst = &o->model_path},
        {.name = "tokenizer", .kind = OPT_STRING, .dst = &o->tok_path},
        {.name = "steps", .short_name = 'n', .kind = OPT_U32, .dst = &o->steps, .lo = 1,
         .hi = 1u << 20},
        {.name = "prompt", .short_name = 'i', .kind = OPT_STRING, .dst = &o->prompt,
         .seen = &prompt_seen},
        {.name = "prompts", .kind = OPT_STRING, .dst = &o->prompts_path},
        {.name = "dtype", .kind = OPT_CALL, .dst = o, .call = list_dtypes,
         .what = "a comma-separated list of f32, f16, bf16, q8, q4"},
        {.name = "block-tokens", .kind = OPT_U32, .dst = &o->block_tokens, .lo = 1,
         .hi = UINT32_MAX},
        {.name = "threads", .kind = OPT_U32, .dst = &o->threads, .lo = 0,
         .hi = CLI_MAX_THREADS, .note = "0 = all CPUs; the engine's limit"},
        {.name = "json", .kind = OPT_FLAG, .dst = &o->json},
        {.name = "svg", .kind = OPT_STRING, .dst = &o->svg},
        {.name = "synthetic", .kind = OPT_FLAG, .dst = &o->synthetic},
        {.name = "ctx", .kind = OPT_U32, .dst = &o->ctx, .lo = 1, .hi = 1u << 16,
         .note = "the double-precision reference is O(ctx^2)",
         .needs = "synthetic", .why = synth_why},
        {.name = "outliers", .kind = OPT_U32, .dst = &o->outliers, .lo = 0,
         .hi = MAX_OUTLIERS,
         .needs = "synthetic", .why = synth_why},
        {.name = "outlier-scale", .kind = OPT_DOUBLE, .dst = &o->outlier_scale, .dlo = 0,
         .dhi = 1e4,
         .needs = "synthetic", .why = synth_why},
        {.name = "q-scale", .kind = OPT_DOUBLE, .dst = &o->q_scale, .dlo = 0, .dhi = 1e3,
         .needs = "synthetic", .why = synth_why},
        {.name = "seed", .kind = OPT_U64, .dst = &o->seed, .lo = 0, .hi = UINT64_MAX,
         .needs = "synthetic", .why = synth_why},
    };
    int rc = cli_parse(CMD, argc, argv, opts, sizeof opts / sizeof opts[0], usage, NULL, 0,
                       NULL);
    if (rc != CLI_OK)
        return rc;
    if (o->synthetic && (o->model_path || o->tok_path || o->prompts_path))
        return cli_usage_error(CMD, "--synthetic runs no model: drop --model/--tokenizer/"
                                    "--prompts");
    if (prompt_seen && o->prompts_path)
        return cli_usage_error(CMD, "-i and --prompts: give one prompt or a file of them");
    if (o->svg && cli_check_output_file(CMD, "--svg", o->svg) != CLI_OK)
        return CLI_USAGE;
    return CLI_OK;
}

/* ---- model mode ---------------------------------------------------------------- */

/* The attention of a teacher-forced run: the cache (llama_kv_attn), then the
 * reference on the same unrounded q/K/V, for the attention-output error. */
typedef struct {
    llama_kv kv;
    const llama_config *c;
    float *ref;                   /* [rows][dim] */
    double max_abs, ref_max;
    pkv_status ref_st;
} q_attn;

static pkv_status attn_checked(void *ctx, uint32_t layer, uint32_t n, float *q,
                               const float *k, const float *v, float *out)
{
    q_attn *a = ctx;
    pkv_status st = llama_kv_attn(&a->kv, layer, n, q, k, v, out);
    if (st != PKV_OK || !a->ref)
        return st;
    const llama_config *c = a->c;
    st = pkv_attention_reference(n, c->n_heads, c->n_kv_heads, c->head_size, 0, 0.0f, NULL,
                                 q, k, v, a->ref);
    if (st != PKV_OK) {
        a->ref_st = st;
        return st;
    }
    /* compares, not fmax() (generate.c's check_rows says why); a NaN error shows */
    for (size_t i = 0; i < (size_t)n * c->dim; i++) {
        const double e = fabs((double)out[i] - (double)a->ref[i]), r = fabs((double)a->ref[i]);
        a->max_abs = e > a->max_abs || isnan(e) ? e : a->max_abs;
        a->ref_max = r > a->ref_max ? r : a->ref_max;
    }
    return PKV_OK;
}

static uint32_t argmax(const float *x, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* log-softmax of x [n] in double into y. */
static void log_softmax(const float *x, uint32_t n, double *y)
{
    double m = -INFINITY, s = 0;
    for (uint32_t i = 0; i < n; i++)   /* a compare, not fmax(): generate.c's check_rows */
        m = (double)x[i] > m ? (double)x[i] : m;
    for (uint32_t i = 0; i < n; i++)
        s += exp((double)x[i] - m);
    const double ls = m + log(s);
    for (uint32_t i = 0; i < n; i++)
        y[i] = (double)x[i] - ls;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* KL and top-1 of logits [T][V] against ref [T][V], added to row r's running figures:
 * kl [T] receives each position's KL, r->flips and r->flip_margin grow; returns the
 * positions whose argmaxes agree. lp, lq: [V] scratch. A flip is a position where the
 * argmaxes differ; its margin is how far f32 preferred its own token, ln p(f32's top) -
 * ln p(dtype's top) under f32 (the logit difference): near 0 a flip is a near-tie the
 * slightest error decides, large it is a real loss. */
static uint32_t compare_logits(q_row *r, const float *ref, const float *lg, uint32_t T,
                               uint32_t V, double *kl, double *lp, double *lq)
{
    uint32_t agree = 0;
    for (uint32_t p = 0; p < T; p++) {
        const float *a = ref + (size_t)p * V, *b = lg + (size_t)p * V;
        log_softmax(a, V, lp);
        log_softmax(b, V, lq);
        double d = 0;
        for (uint32_t i = 0; i < V; i++)
            d += exp(lp[i]) * (lp[i] - lq[i]);
        kl[p] = d > 0 ? d : 0; /* >= 0 exactly; rounding can leave -1e-17 */
        const uint32_t ta = argmax(a, V), tb = argmax(b, V);
        if (ta == tb) {
            agree++;
        } else {
            r->flips++;
            r->flip_margin = fmax(r->flip_margin, lp[ta] - lp[tb]);
        }
    }
    return agree;
}

/* Row r's figures over all n positions of every prompt: kl [n] (in position order,
 * sorted here), agree of them with f32's argmax. */
static void finish_row(q_row *r, double *kl, uint64_t n, uint64_t agree)
{
    double sum = 0;
    for (uint64_t p = 0; p < n; p++)
        sum += kl[p];
    qsort(kl, n, sizeof *kl, cmp_double);
    r->kl_mean = sum / (double)n;
    r->kl_p99 = kl[(size_t)ceil(0.99 * (double)n) - 1];
    r->kl_max = kl[n - 1];
    r->top1 = (double)agree / (double)n;
}

/* The prompts of a run: -i's, or the lines of --prompts FILE (each line one prompt,
 * an empty line BOS alone, a '\r' before the newline dropped; at most MAX_PROMPTS).
 * *buf holds the file's text, which list[] points into; free it. */
static int read_prompts(const q_opts *o, char **buf, const char **list, uint32_t *n)
{
    *buf = NULL;
    *n = 0;
    if (!o->prompts_path) {
        list[(*n)++] = o->prompt;
        return CLI_OK;
    }
    FILE *f = fopen(o->prompts_path, "rb");
    if (!f)
        return cli_fail(CMD, "cannot open --prompts '%s': %s", o->prompts_path,
                        strerror(errno));
    const size_t cap = (size_t)1 << 24;
    char *t = malloc(cap + 1);
    const size_t len = t ? fread(t, 1, cap + 1, f) : 0;
    const bool bad = !t || ferror(f);
    const char *why = !t ? strerror(ENOMEM) : strerror(errno);
    fclose(f);
    if (bad || len > cap) {
        free(t);
        return bad ? cli_fail(CMD, "cannot read --prompts '%s': %s", o->prompts_path, why)
                   : cli_usage_error(CMD, "--prompts %s: larger than 16 MiB", o->prompts_path);
    }
    t[len] = '\0';
    if (memchr(t, '\0', len)) {
        free(t);
        return cli_usage_error(CMD, "--prompts %s: not text (a NUL byte)", o->prompts_path);
    }
    for (char *line = t, *const stop = t + len; line < stop;) {
        char *end = memchr(line, '\n', (size_t)(stop - line));
        if (end)
            *end = '\0';
        const size_t l = strlen(line);
        if (l && line[l - 1] == '\r')
            line[l - 1] = '\0';
        if (*n == MAX_PROMPTS) {
            free(t);
            return cli_usage_error(CMD, "--prompts %s: more than %u prompts",
                                   o->prompts_path, MAX_PROMPTS);
        }
        list[(*n)++] = line;
        line = end ? end + 1 : stop;
    }
    if (*n == 0) {
        free(t);
        return cli_usage_error(CMD, "--prompts %s: no prompts (an empty file)",
                               o->prompts_path);
    }
    *buf = t;
    return CLI_OK;
}

/* The f32 text of tokens tok[0..n) (the first prompt's), or NULL. */
static char *decode_text(const tokenizer *tk, const uint32_t *tok, uint32_t n)
{
    size_t cap = 1, len = 0;
    for (uint32_t p = 1; p < n; p++) {
        const char *piece;
        size_t pl;
        tokenizer_decode(tk, tok[p - 1], tok[p], &piece, &pl);
        cap += pl;
    }
    char *text = malloc(cap);
    if (!text)
        return NULL;
    for (uint32_t p = 1; p < n; p++) {
        const char *piece;
        size_t pl;
        tokenizer_decode(tk, tok[p - 1], tok[p], &piece, &pl);
        memcpy(text + len, piece, pl);
        len += pl;
    }
    text[len] = '\0';
    return text;
}

static int run_model(q_result *R)
{
    const q_opts *o = R->o;
    llama_model m;
    tokenizer tk;
    llama_state st;
    memset(&m, 0, sizeof m);
    memset(&tk, 0, sizeof tk);
    memset(&st, 0, sizeof st);
    char err[512];
    char *pbuf = NULL;
    const char *prompts[MAX_PROMPTS];
    uint32_t n_prompts = 0;
    uint32_t *prompt = NULL, *tok = NULL, *pos = NULL;
    float *ref = NULL, *lg = NULL, *aref = NULL;
    double *kl = NULL, *lp = NULL, *lq = NULL;
    uint64_t agree[MAX_ROWS] = {0};
    pkv_engine *e = NULL;
    pkv_session *s = NULL;
    pkv_status ps;
    int rc = read_prompts(o, &pbuf, prompts, &n_prompts);
    if (rc != CLI_OK)
        return rc;
    if (o->model_path) {
        if ((ps = llama_load(&m, o->model_path, err, sizeof err)) != PKV_OK) {
            rc = cli_fail(CMD, "%s", err);
            goto done;
        }
    } else if ((ps = llama_synthetic(&m, BUILTIN_SEED)) != PKV_OK) {
        rc = cli_fail(CMD, "built-in model: %s", pkv_status_str(ps));
        goto done;
    }
    const llama_config *c = &m.cfg;
    R->cfg = *c;
    if (o->tok_path &&
        (ps = tokenizer_load(&tk, o->tok_path, c->vocab_size, err, sizeof err)) != PKV_OK) {
        rc = cli_fail(CMD, "%s", err);
        goto done;
    }
    size_t plen = 0;
    for (uint32_t k = 0; k < n_prompts; k++)
        plen = strlen(prompts[k]) > plen ? strlen(prompts[k]) : plen;
    if (plen > (size_t)1 << 20) {
        rc = cli_usage_error(CMD, "a prompt is longer than 1 MiB");
        goto done;
    }
    const uint32_t T = o->steps < c->seq_len ? o->steps : c->seq_len, V = c->vocab_size;
    if (o->steps > c->seq_len)
        fprintf(stderr, "pagedkv quality: -n %u exceeds the model's seq_len; using %u\n",
                o->steps, c->seq_len);
    pkv_config cfg = llama_kv_config(c, o->block_tokens, PKV_F32, o->threads);
    if (cli_check_limits(CMD, &cfg, o->model_path ? o->model_path : "the built-in model") !=
        CLI_OK) {
        rc = CLI_USAGE;
        goto done;
    }
    quality_plan_rows(R, &cfg, c->n_kv_heads, c->n_layers, c->head_size);
    prompt = calloc(tokenizer_max_tokens(plen), sizeof *prompt);
    tok = calloc(T, sizeof *tok);
    pos = calloc(T, sizeof *pos);
    ref = calloc((size_t)T * V, sizeof *ref);
    lg = calloc((size_t)T * V, sizeof *lg);
    aref = calloc((size_t)T * c->dim, sizeof *aref);
    /* every row's KL at every position of every prompt, row-major */
    kl = calloc((size_t)R->n_rows * n_prompts * T, sizeof *kl);
    lp = calloc(V, sizeof *lp);
    lq = calloc(V, sizeof *lq);
    if (!prompt || !tok || !pos || !ref || !lg || !aref || !kl || !lp || !lq ||
        llama_state_init(&st, c, T) != PKV_OK) {
        rc = cli_fail(CMD, "cannot allocate buffers for %u positions", T);
        goto done;
    }
    for (uint32_t p = 0; p < T; p++)
        pos[p] = p;

    for (uint32_t k = 0; k < n_prompts; k++) {
        size_t np = 0;
        if (tokenizer_encode_prompt(o->tok_path ? &tk : NULL, c->vocab_size, prompts[k],
                                    prompt, tokenizer_max_tokens(plen), &np, err,
                                    sizeof err) != PKV_OK) {
            rc = cli_usage_error(CMD, "%s%s", n_prompts > 1 ? "--prompts: " : "", err);
            goto done;
        }
        const uint32_t P = np < T ? (uint32_t)np : T;

        /* 1. the f32 greedy run: it decides the tokens */
        if ((ps = quality_open_engine(R, &cfg, &e, &s)) != PKV_OK) {
            rc = cli_fail(CMD, "f32 engine: %s", pkv_status_str(ps));
            goto done;
        }
        memcpy(tok, prompt, P * sizeof *tok);
        q_attn a = {.kv = llama_kv_init(e, c, &s), .c = c};
        a.kv.prefill = true;
        ps = llama_forward(&m, &st, P, tok, pos, attn_checked, &a, 0, ref);
        uint32_t n = P;
        a.kv.prefill = false;
        while (ps == PKV_OK && n < T) {
            const uint32_t next = argmax(ref + (size_t)(n - 1) * V, V);
            if (o->model_path && next == TOKENIZER_BOS) {
                R->stopped_at_bos = true;
                break;
            }
            tok[n] = next;
            ps = llama_forward(&m, &st, 1, tok + n, pos + n, attn_checked, &a, 0,
                               ref + (size_t)n * V);
            n++;
        }
        quality_close_engine(&e, &s);
        if (ps != PKV_OK) {
            rc = cli_fail(CMD, "f32 run: %s: %s", a.kv.failed ? a.kv.failed : "forward",
                          pkv_status_str(ps));
            goto done;
        }
        if (k == 0 && o->tok_path)
            R->text = decode_text(&tk, tok, n);

        /* 2. every dtype and path, teacher-forced on those tokens in one prefill */
        for (uint32_t i = 0; i < R->n_rows; i++) {
            q_row *r = &R->rows[i];
            if (!r->available)
                continue;
            pkv_config rc_cfg = cfg;
            rc_cfg.kv_dtype = r->dt;
            rc_cfg.quant_dot = r->path;
            if ((ps = quality_open_engine(R, &rc_cfg, &e, &s)) != PKV_OK) {
                rc = cli_fail(CMD, "%s engine: %s", pkv_dtype_name(r->dt),
                              pkv_status_str(ps));
                goto done;
            }
            q_attn b = {.kv = llama_kv_init(e, c, &s), .c = c, .ref = aref};
            b.kv.prefill = true;
            ps = llama_forward(&m, &st, n, tok, pos, attn_checked, &b, 0, lg);
            quality_close_engine(&e, &s);
            if (ps != PKV_OK) {
                rc = cli_fail(CMD, "%s %s run: %s: %s", pkv_dtype_name(r->dt),
                              quality_path_name(r->path),
                              b.ref_st != PKV_OK ? "pkv_attention_reference"
                              : b.kv.failed      ? b.kv.failed
                                                 : "forward",
                              pkv_status_str(ps));
                goto done;
            }
            const uint32_t ag = compare_logits(
                r, ref, lg, n, V, kl + ((size_t)i * n_prompts * T + R->positions), lp, lq);
            agree[i] += ag;
            r->top1_prompt[k] = (double)ag / n;
            r->attn_max_abs = fmax(r->attn_max_abs, b.max_abs);
            r->attn_ref_max = fmax(r->attn_ref_max, b.ref_max);
        }
        R->positions += n;
        R->prompt_positions += P;
    }
    R->n_prompts = n_prompts;
    for (uint32_t i = 0; i < R->n_rows; i++)
        if (R->rows[i].available)
            finish_row(&R->rows[i], kl + (size_t)i * n_prompts * T, R->positions, agree[i]);
done:
    quality_close_engine(&e, &s);
    llama_state_free(&st);
    tokenizer_free(&tk);
    llama_free(&m);
    free(pbuf);
    free(prompt);
    free(tok);
    free(pos);
    free(ref);
    free(lg);
    free(aref);
    free(kl);
    free(lp);
    free(lq);
    return rc;
}

/* ---- output --------------------------------------------------------------------- */

static void print_model(const q_result *R)
{
    const q_opts *o = R->o;
    const llama_config *c = &R->cfg;
    printf("pagedkv quality %s: %s (dim %u, %u layers, %u heads / %u kv-heads of %u, vocab "
           "%u); kernels %s\n", pkv_version(), o->model_path ? o->model_path : "built-in model",
           c->dim, c->n_layers, c->n_heads, c->n_kv_heads, c->head_size, c->vocab_size,
           R->isa ? R->isa : "?");
    if (R->n_prompts > 1)
        printf("%u prompts of up to %u positions: %u positions in all (%u of them "
               "prompts)", R->n_prompts, o->steps, R->positions, R->prompt_positions);
    else
        printf("%u positions (%u of them the prompt)", R->positions, R->prompt_positions);
    printf(" greedy from an f32 cache%s; every dtype teacher-forced on those tokens; "
           "KL(f32 || dtype) of the next-token distributions, in nats\n",
           R->stopped_at_bos ? ", stopped where the model emitted BOS" : "");
    if (R->text)
        printf("f32 text%s: %s\n", R->n_prompts > 1 ? " (the first prompt's)" : "", R->text);
    printf("\n%-5s %-8s %9s %7s | %10s %10s %10s | %7s %5s %7s | %10s %9s\n", "dtype", "path",
           "B/token", "vs f32", "KL mean", "KL p99", "KL max", "top-1", "flips", "margin",
           "attn err", "rel");
    const double f32b = (double)R->rows[0].bytes_per_token;
    for (uint32_t i = 0; i < R->n_rows; i++) {
        const q_row *r = &R->rows[i];
        printf("%-5s %-8s %9llu %7.3f | ", pkv_dtype_name(r->dt), quality_path_name(r->path),
               (unsigned long long)r->bytes_per_token, (double)r->bytes_per_token / f32b);
        if (!r->available) {
            printf("unavailable: %s\n", r->why);
            continue;
        }
        printf("%10.3g %10.3g %10.3g | %6.2f%% %5u %7.3f | %10.3g %9.3g\n", r->kl_mean,
               r->kl_p99, r->kl_max, 100.0 * r->top1, r->flips, r->flip_margin, r->attn_max_abs,
               r->attn_ref_max > 0 ? r->attn_max_abs / r->attn_ref_max : 0.0);
    }
    if (R->n_prompts > 1) {
        printf("\ntop-1 per prompt, in the file's order:\n");
        for (uint32_t i = 0; i < R->n_rows; i++) {
            const q_row *r = &R->rows[i];
            if (!r->available)
                continue;
            printf("%-5s %-8s", pkv_dtype_name(r->dt), quality_path_name(r->path));
            for (uint32_t k = 0; k < R->n_prompts; k++)
                printf(" %6.2f%%", 100.0 * r->top1_prompt[k]);
            printf("\n");
        }
    }
    printf("\nattn err: max |cache - pkv_attention_reference| over every layer, position and\n"
           "head on the same unrounded q/K/V (rel: over max |reference|); top-1: argmax\n"
           "agreement with f32; flips: the positions where it differs; margin: the largest\n"
           "ln p(f32's token) - ln p(dtype's token) under f32 among them (near 0: every flip\n"
           "was a near-tie). f32 is the self-check (0 and 100%%: prefill and decode are\n"
           "bitwise identical).\n");
}

static void json_row_common(json_writer *W, const q_row *r)
{
    json_str(W, "dtype", pkv_dtype_name(r->dt));
    json_str(W, "path", quality_path_name(r->path));
    json_bool(W, "available", r->available);
    json_str(W, "reason", r->available ? NULL : r->why);
    json_u64(W, "bytes_per_token", r->bytes_per_token);
}

static void print_json(const q_result *R)
{
    const q_opts *o = R->o;
    json_writer w = {stdout, true, false}, *W = &w;
    json_open(W, NULL, '{');
    cli_json_envelope(W, CMD, R->isa);
    json_str(W, "mode", o->synthetic ? "synthetic" : "model");
    if (o->synthetic) {
        JSON_U64S(W, {"heads", 32}, {"kv_heads", 8}, {"head_dim", 128}, {"ctx", o->ctx},
                  {"seed", o->seed});
        json_open(W, "outlier_channels", '[');
        for (uint32_t i = 0; i < o->outliers; i++)
            json_u64(W, NULL, R->outlier_ch[i]);
        json_close(W, ']');
        JSON_NUMS(W, {"outlier_scale", o->outlier_scale}, {"q_scale", o->q_scale},
                  {"max_abs_out", R->max_out});
    } else {
        const llama_config *c = &R->cfg;
        json_str(W, "model", o->model_path);
        json_str(W, "tokenizer", o->tok_path);
        JSON_U64S(W, {"prompts", R->n_prompts}, {"layers", c->n_layers}, {"heads", c->n_heads},
                  {"kv_heads", c->n_kv_heads}, {"head_dim", c->head_size},
                  {"vocab", c->vocab_size}, {"positions", R->positions},
                  {"prompt_positions", R->prompt_positions});
        json_bool(W, "stopped_at_bos", R->stopped_at_bos);
        json_str(W, "text", R->text);
    }
    json_open(W, "rows", '[');
    for (uint32_t i = 0; i < R->n_rows; i++) {
        const q_row *r = &R->rows[i];
        const double na = NAN;
        json_open(W, NULL, '{');
        json_row_common(W, r);
        if (o->synthetic)
            JSON_NUMS(W, {"k_rms_rel", r->available ? r->k_rms : na},
                      {"v_rms_rel", r->available ? r->v_rms : na},
                      {"err_k_only", r->available ? r->err_k_only : na},
                      {"err_v_only", r->available ? r->err_v_only : na},
                      {"err_ref_rounded", r->available ? r->err_ref_both : na},
                      {"err_vs_unrounded", r->available ? r->err_raw : na},
                      {"err_vs_rounded", r->available ? r->err_rounded : na});
        else {
            JSON_NUMS(W, {"kl_mean", r->available ? r->kl_mean : na},
                      {"kl_p99", r->available ? r->kl_p99 : na},
                      {"kl_max", r->available ? r->kl_max : na},
                      {"top1", r->available ? r->top1 : na});
            if (r->available) {
                json_open(W, "top1_per_prompt", '[');
                for (uint32_t k = 0; k < R->n_prompts; k++)
                    json_num(W, NULL, r->top1_prompt[k]);
                json_close(W, ']');
            } else {
                json_str(W, "top1_per_prompt", NULL);
            }
            JSON_NUMS(W, {"top1_flips", r->available ? (double)r->flips : na},
                      {"top1_flip_margin_max", r->available ? r->flip_margin : na},
                      {"attn_max_abs", r->available ? r->attn_max_abs : na},
                      {"attn_rel", r->available && r->attn_ref_max > 0
                                       ? r->attn_max_abs / r->attn_ref_max
                                       : na});
        }
        json_close(W, '}');
    }
    json_close(W, ']');
    json_close(W, '}');
    fputc('\n', stdout);
}

/* Model mode: KL mean and p99 of every available row but f32 (0 on a log axis);
 * synthetic mode: the engine's error against the unrounded and the rounded reference. */
static int write_svg(const q_result *R)
{
    const q_opts *o = R->o;
    char names[MAX_ROWS][32];
    const char *cats[MAX_ROWS];
    double x[MAX_ROWS], y1[MAX_ROWS], y2[MAX_ROWS];
    size_t n = 0;
    for (uint32_t i = 0; i < R->n_rows; i++) {
        const q_row *r = &R->rows[i];
        if (!r->available || r->dt == PKV_F32)
            continue;
        snprintf(names[n], sizeof names[n], "%s%s", pkv_dtype_name(r->dt),
                 r->path ? " integer" : "");
        cats[n] = names[n];
        x[n] = (double)n;
        y1[n] = o->synthetic ? r->err_raw : r->kl_mean;
        y2[n] = o->synthetic ? r->err_rounded : r->kl_p99;
        n++;
    }
    const svg_series se[2] = {
        {.name = o->synthetic ? "vs reference on unrounded rows" : "KL mean", .x = x, .y = y1,
         .n = n, .bars = true},
        {.name = o->synthetic ? "vs reference on rounded rows" : "KL p99", .x = x, .y = y2,
         .n = n, .bars = true},
    };
    char title[256];
    if (o->synthetic)
        snprintf(title, sizeof title, "attention-output error per dtype (llama3-8b layer, %u "
                 "positions, %u outlier K channels x %g)", o->ctx, o->outliers,
                 o->outlier_scale);
    else {   /* the model by its file's name: a path says where it is, not what */
        const char *name = o->model_path ? strrchr(o->model_path, '/') : NULL;
        name = name ? name + 1 : o->model_path ? o->model_path : "the built-in model";
        snprintf(title, sizeof title, "KL divergence from the f32 cache per dtype (%s, %u "
                 "positions)", name, R->positions);
    }
    const svg_panel panel = {
        .title = title,
        .x = {.label = "K/V storage (dtype, path)", .categories = cats, .n_categories = n},
        .y = {.label = o->synthetic ? "max |error| / max |output|" : "KL(f32 || dtype), nats",
              .log = true},
        .series = se,
        .n_series = 2,
    };
    char where[512];
    cli_run_where(where, sizeof where, R->threads, R->isa);
    if (svg_write_file(o->svg, "pagedkv quality", where, &panel, 1) != 0)
        return cli_fail(CMD, "cannot write the plot to '%s': %s", o->svg, strerror(errno));
    return CLI_OK;
}

int cmd_quality(int argc, char **argv)
{
    q_opts o;
    int rc = parse(argc, argv, &o);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    q_result *R = calloc(1, sizeof *R);
    if (!R)
        return cli_fail(CMD, "out of memory");
    R->o = &o;
    rc = o.synthetic ? quality_run_synthetic(R) : run_model(R);
    if (rc == CLI_OK) {
        if (o.json)
            print_json(R);
        else if (o.synthetic)
            quality_print_synthetic(R);
        else
            print_model(R);
        if (o.svg)
            rc = write_svg(R);
    }
    free(R->text);
    free(R);
    return rc;
}

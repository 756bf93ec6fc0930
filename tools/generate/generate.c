/*
 * generate/generate.c - `pagedkv generate`: a tiny Llama generating token by token with
 * pagedkv as its only KV cache (the main job of the project; docs/generate.md).
 *
 * Owns: option parsing, the generation loop (the prompt in one forward of all its
 * rows, then one forward per step of the sessions still generating), the N forked
 * continuations, the --check and --check-e2e verifiers, the generated text
 * on stdout (without --json). Does not own: the report (generate/report.c, from the
 * gen of generate.h), the model math (llama/llama.c), the attention through the cache
 * (llama/llama_kv.c), the tokenizer (llama/tokenizer.c), the cache.
 *
 * Invariants:
 *   - Positions are token indices: tok[s][p] is the token forwarded at position p, and
 *     ntok[s] == pkv_session_len(sess[s], layer) + 1 for every layer (the newest token
 *     is sampled but not yet forwarded). `steps` (-n) counts forwarded positions,
 *     prompt included, as llama2.c's runner does.
 *   - Every buffer is allocated before the first token; the token loop only calls the
 *     library, the model and stdio. (--check's reference, pkv_attention_reference,
 *     allocates its own double copies: the checker is not the hot path.)
 *   - Sessions 1..N-1 are forks of session 0 taken right after the prompt's prefill,
 *     so they share the prompt's pages; each has its own sampler stream.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/opt.h"
#include "generate/generate.h"
#include "llama.h"
#include "llama_kv.h"
#include "common/mpi_tools.h"
#include "tokenizer.h"

#define CMD "generate"
#define SYNTHETIC_SEED 0x5eedull
#define MAX_SESSIONS 4096u
/* --check-e2e: |logit_paged - logit_dense| <= max(E2E_REL, 4 eps(dtype)) * max(1,
 * max|logit|). In f32, float reassociation in the decode kernel moves logits by ~1e-6
 * relative; any real defect (a wrong page, position or group) moves them by O(1).
 * With f16/bf16 storage the two paths round K/V computed from activations that differ
 * in the last float bits, so a value can round to the neighbouring f16/bf16 number:
 * differences of about that dtype's machine epsilon eps (2^-10, 2^-7) are
 * legitimate: stories260K shows up to ~1 eps x max|logit|, hence 4 eps. */
#define E2E_REL 1e-3
/* --check warns of its cost above this many multiply-adds (about a second of the
 * double-precision oracle: docs/performance.md, decision table: CHECK_WARN_OPS), and
 * reports progress every CHECK_PROGRESS_SECS of checking. */
#define CHECK_WARN_OPS 1e9
#define CHECK_PROGRESS_SECS 5.0

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pagedkv generate [OPTIONS]\n\n"
        "Run a tiny Llama-architecture model token by token with pagedkv as its KV\n"
        "cache. Without --model it uses a built-in synthetic model (seeded random\n"
        "weights: dim 256, 4 layers, 8 query heads on 2 KV heads, vocab 512).\n\n"
        "  --model FILE        llama2.c checkpoint (legacy version-0 format)\n"
        "  --tokenizer FILE    llama2.c tokenizer; without one, tokens print as ids\n"
        "                      (the prompt's, then the generated ones; never BOS)\n"
        "  -n, --steps N       positions to run, prompt included (default 256;\n"
        "                      at most the model's seq_len without --context-shift)\n"
        "  -i, --prompt TEXT   prompt (default empty: BOS alone). Without a tokenizer\n"
        "                      each byte b is token b+3\n"
        "  -t, --temperature T 0 = greedy (default 1.0)\n"
        "  -p, --top-p P       nucleus sampling mass in (0,1); 0 or 1 = off (default 0.9)\n"
        "  -s, --seed S        sampler seed (default 42); session i uses its own stream\n"
        "  --dtype D           KV storage: f32, f16, bf16, q8, q4 (default f32 with --model,\n"
        "                      f16 for the synthetic model)\n"
        "  --block-tokens B    tokens per page (default: the library's, 16)\n"
        "  --sessions N        N continuations of one prompt, forked after the prompt so\n"
        "                      they share its pages (default 1)\n"
        "  --parallel          with --sessions: the sessions' steps as one\n"
        "                      pkv_decode_batch, which reads the prompt's shared pages\n"
        "                      once for all of them (the default; reports page reads)\n"
        "  --speculate K       speculative decoding: up to K drafts a step from prompt\n"
        "                      lookup (the continuation of the longest earlier match of\n"
        "                      the last 1-3 tokens), verified in one pkv_verify a layer;\n"
        "                      the text is that of plain generation (docs/speculative.md)\n"
        "  --tree              with --speculate: up to 4 candidates, merged as a tree\n"
        "  --prefix-cache      with --sessions: sessions 2..N are not forks but requests\n"
        "                      that take the prompt from the prefix cache\n"
        "                      (docs/prefix-cache.md) and run the model over the rest;\n"
        "                      reports hits, tokens reused and the prefill time saved\n"
        "                      (the text is the same)\n"
        "  --threads N         engine threads (default 0 = online CPUs)\n"
        "  --window W          every layer a sliding window of W positions (0 = full\n"
        "                      causal; docs/variants.md): the cache holds at most\n"
        "                      ceil(S/bt) + ceil((W+R)/bt) + 1 pages a layer, however\n"
        "                      long the run\n"
        "  --sinks S           with --window: the first S positions are attended too\n"
        "  --rollback R        with --window: R more positions kept for truncates\n"
        "  --softcap C         attention logits become C*tanh(s/C) (0 = none)\n"
        "  --context-shift     when the context is full (the model's seq_len), keep the\n"
        "                      first --keep positions, drop half of the rest and go on\n"
        "                      (pkv_session_discard, as llama.cpp's context shift): -n\n"
        "                      may then exceed seq_len\n"
        "  --keep N            positions a context shift keeps (default 1: the BOS)\n"
        "  --check             after every step, recompute each layer's attention densely\n"
        "                      (pkv_attention_reference, with the variant) from the\n"
        "                      same Q/K/V; fail if any\n"
        "                      output differs by more than 1e-5 x max|V|. Costs O(n^3)\n"
        "  --check-e2e         afterwards, recompute every step without the cache (one\n"
        "                      causal pass over each session's tokens); fail if a logit\n"
        "                      differs by more than 1e-3 x max(1, max|logit|) (f16 KV:\n"
        "                      2^-8 x, bf16 and q8: 2^-5 x, q4: 2^-3 x) or a greedy\n"
        "                      token differs beyond\n"
        "                      a near-tie\n"
        "  --save FILE         after the run, write session 0 to FILE (pkv_session_save,\n"
        "                      its token ids recorded): `pagedkv inspect FILE` reads it\n"
        "  --json              one JSON object on stdout instead of text and figures\n"
        "  --mpi               sharded by heads over MPI ranks (mpirun -np R ...): the\n"
        "                      same text; its options: pagedkv generate --mpi --help\n"
        "  -h, --help          this help\n\n"
        "Generation stops after -n positions or when a --model emits BOS (token 1).\n"
        "Text goes to stdout; tokens/s and per-session cache memory to stderr.\n");
}

static int parse_opts(int argc, char **argv, gen_opts *o)
{
    memset(o, 0, sizeof *o);
    o->prompt = "";
    o->steps = 256;
    o->temperature = 1.0;
    o->topp = 0.9;
    o->seed = 42;
    o->sessions = 1;
    o->keep = 1;
    const cli_opt opts[] = {
        {.name = "model", .kind = OPT_STRING, .dst = &o->model_path},
        {.name = "tokenizer", .kind = OPT_STRING, .dst = &o->tok_path},
        {.name = "steps", .short_name = 'n', .kind = OPT_U32, .dst = &o->steps, .lo = 1,
         .hi = UINT32_MAX},
        {.name = "prompt", .short_name = 'i', .kind = OPT_STRING, .dst = &o->prompt},
        {.name = "temperature", .short_name = 't', .kind = OPT_DOUBLE, .dst = &o->temperature,
         .dlo = 0, .dhi = 1e6},
        {.name = "top-p", .short_name = 'p', .kind = OPT_DOUBLE, .dst = &o->topp, .dlo = 0,
         .dhi = 1},
        {.name = "seed", .short_name = 's', .kind = OPT_U64, .dst = &o->seed, .lo = 0,
         .hi = UINT64_MAX},
        {.name = "dtype", .kind = OPT_DTYPE, .dst = &o->dtype, .seen = &o->dtype_set},
        {.name = "block-tokens", .kind = OPT_U32, .dst = &o->block_tokens, .lo = 1,
         .hi = UINT32_MAX},
        {.name = "sessions", .kind = OPT_U32, .dst = &o->sessions, .lo = 1,
         .hi = MAX_SESSIONS},
        {.name = "threads", .kind = OPT_U32, .dst = &o->threads, .lo = 0,
         .hi = CLI_MAX_THREADS, .note = "0 = all CPUs; the engine's limit"},
        {.name = "check", .kind = OPT_FLAG, .dst = &o->check},
        {.name = "check-e2e", .kind = OPT_FLAG, .dst = &o->check_e2e},
        {.name = "json", .kind = OPT_FLAG, .dst = &o->json},
        {.name = "save", .kind = OPT_STRING, .dst = &o->save_path},
        {.name = "prefix-cache", .kind = OPT_FLAG, .dst = &o->prefix_cache},
        {.name = "parallel", .kind = OPT_FLAG, .dst = &o->parallel},
        {.name = "speculate", .kind = OPT_U32, .dst = &o->speculate, .lo = 1, .hi = 64},
        {.name = "tree", .kind = OPT_FLAG, .dst = &o->tree},
        {.name = "window", .kind = OPT_U32, .dst = &o->v.window, .lo = 0, .hi = UINT32_MAX},
        {.name = "sinks", .kind = OPT_U32, .dst = &o->v.sinks, .lo = 0, .hi = UINT32_MAX},
        {.name = "rollback", .kind = OPT_U32, .dst = &o->v.rollback, .lo = 0,
         .hi = UINT32_MAX},
        {.name = "softcap", .kind = OPT_DOUBLE, .dst = &o->v.softcap, .dlo = 0, .dhi = 1e30},
        {.name = "context-shift", .kind = OPT_FLAG, .dst = &o->context_shift},
        {.name = "keep", .kind = OPT_U32, .dst = &o->keep, .lo = 0, .hi = UINT32_MAX},
    };
    int rc = cli_parse(CMD, argc, argv, opts, sizeof opts / sizeof opts[0], usage, NULL, 0,
                       NULL);
    if (rc != CLI_OK)
        return rc;
    if (o->tree && !o->speculate)
        return cli_usage_error(CMD, "--tree needs --speculate K");
    if (o->speculate && (o->sessions > 1 || o->check || o->prefix_cache))
        return cli_usage_error(CMD, "--speculate runs one session: it does not combine "
                               "with --sessions, --prefix-cache or --check (--check-e2e "
                               "does)");
    if (o->prefix_cache && o->sessions < 2)
        return cli_needs_error(CMD, "--prefix-cache", "--sessions N (N >= 2)",
                               "sessions 2..N take the prompt from the prefix cache that "
                               "session 1 fills; one session has nothing to reuse");
    if (o->prefix_cache && o->check) /* --check's history follows forks */
        return cli_usage_error(CMD, "--prefix-cache does not combine with --check "
                               "(--check-e2e does)");
    if (o->context_shift && (o->check || o->check_e2e)) /* both recompute from position 0 */
        return cli_usage_error(CMD, "--context-shift does not combine with --check or "
                               "--check-e2e");
    /* the file is written after the run: a path that cannot take it fails now */
    if (o->save_path && cli_check_output_file(CMD, "--save", o->save_path) != CLI_OK)
        return CLI_USAGE;
    return cli_variant_check(CMD, &o->v);
}

/* ---- allocation ---------------------------------------------------------------- */

/* calloc of a * b * c elements of `size` bytes, NULL on overflow. */
static void *alloc3(size_t a, size_t b, size_t c, size_t size)
{
    if (b && a > SIZE_MAX / b)
        return NULL;
    size_t n = a * b;
    if (c && n > SIZE_MAX / c)
        return NULL;
    n *= c;
    if (n == 0)
        n = 1;
    return calloc(n, size);
}

static void gen_free(gen *g)
{
    if (g->sess)
        for (uint32_t s = 0; s < g->N; s++)
            pkv_session_destroy(g->sess[s]);
    pkv_engine_destroy(g->eng);
    free(g->pfx.logits);
    llama_state_free(&g->st);
    llama_sampler_free(&g->smp);
    tokenizer_free(&g->tk);
    llama_free(&g->model);
    void *bufs[] = {g->prompt, g->sess, g->act_sess, g->act, g->tok, g->ntok, g->rng,
                    g->logits, g->row_tok, g->row_pos, g->rot, g->hq, g->hk, g->hv, g->ref,
                    g->rec_logits, g->coins, g->dense_logits, g->dk, g->dv,
                    g->dense_tok, g->lc, g->sink_store};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
}

/* Load the model and tokenizer, encode the prompt, size every buffer, create the
 * engine. Returns a CLI exit code. */
static int gen_setup(gen *g)
{
    const gen_opts *o = g->o;
    pkv_status st;
    if (o->model_path) {
        st = llama_load(&g->model, o->model_path, g->err, sizeof g->err);
        if (st != PKV_OK)
            return cli_fail(CMD, "%s", g->err);
    } else if ((st = llama_synthetic(&g->model, SYNTHETIC_SEED)) != PKV_OK) {
        return cli_fail(CMD, "synthetic model: %s", pkv_status_str(st));
    }
    g->c = &g->model.cfg;
    const llama_config *c = g->c;
    if (o->tok_path) {
        st = tokenizer_load(&g->tk, o->tok_path, c->vocab_size, g->err, sizeof g->err);
        if (st != PKV_OK)
            return cli_fail(CMD, "%s", g->err);
        g->have_tok = true;
    }
    size_t plen = strlen(o->prompt);
    if (plen > (size_t)1 << 24)
        return cli_usage_error(CMD, "the prompt is too long");
    g->prompt = calloc(tokenizer_max_tokens(plen), sizeof *g->prompt);
    if (!g->prompt)
        return cli_fail(CMD, "out of memory");
    size_t np = 0;
    if (tokenizer_encode_prompt(g->have_tok ? &g->tk : NULL, c->vocab_size, o->prompt,
                                g->prompt, tokenizer_max_tokens(plen), &np, g->err,
                                sizeof g->err) != PKV_OK)
        return cli_usage_error(CMD, "%s", g->err);
    g->n_prompt = (uint32_t)np;
    g->steps = o->steps;
    if (o->context_shift && (o->keep + 2 > c->seq_len || g->n_prompt > c->seq_len))
        return cli_usage_error(CMD, "--context-shift: --keep %u and the prompt's %u "
                               "positions must fit the model's seq_len %u with room to "
                               "shift", o->keep, g->n_prompt, c->seq_len);
    if (g->steps > c->seq_len && !o->context_shift) { /* a note on stderr, as below */
        fprintf(stderr, "pagedkv generate: -n %u exceeds the model's seq_len; using %u\n",
                g->steps, c->seq_len);
        g->steps = c->seq_len;
    }
    g->P = g->n_prompt < g->steps ? g->n_prompt : g->steps;
    g->gen_cap = g->steps - g->P + 1;
    g->N = o->sessions;
    /* -n counts positions, prompt included (BOS is one): say when that leaves the
     * prompt cut short or no room for more than the one token sampled after it */
    if (g->n_prompt > g->steps)
        fprintf(stderr, "pagedkv generate: warning: -n %u cuts the prompt short: %u of its "
                        "%u positions (BOS included) run and nothing is generated; -n counts "
                        "positions, prompt included\n", g->steps, g->steps, g->n_prompt);
    else if (g->n_prompt == g->steps)
        fprintf(stderr, "pagedkv generate: warning: the prompt takes all -n %u positions (BOS "
                        "included): one token is sampled after it and none is run; -n counts "
                        "positions, prompt included\n", g->steps);
    if (o->check) {
        /* dense causal attention at every step: sum over T of T^2 * h * d * 2, i.e.
         * about n^3 / 3 * 2 * h * d per layer and session */
        const double n = g->steps, cost = n * n * n / 3.0 * 2.0 * c->n_heads * c->head_size *
                                           c->n_layers * o->sessions;
        if (cost > CHECK_WARN_OPS)
            fprintf(stderr, "pagedkv generate: warning: --check recomputes every step's "
                            "attention densely, O(n^3): about %.1f G multiply-adds for -n %u; "
                            "progress every %.0f s\n", cost / 1e9, g->steps,
                    CHECK_PROGRESS_SECS);
    }

    const uint32_t N = g->N, S = g->steps, V = c->vocab_size, L = c->n_layers;
    uint32_t rows = g->P > N ? g->P : N;
    if (o->speculate && rows < 1 + GEN_SPEC_BRANCHES * o->speculate) /* a step's tree */
        rows = 1 + GEN_SPEC_BRANCHES * o->speculate;
    if (o->check_e2e && S > rows)
        rows = S;
    st = llama_state_init(&g->st, c, rows);
    if (st == PKV_OK)
        st = llama_sampler_init(&g->smp, V, (float)o->temperature, (float)o->topp);
    g->sess = alloc3(N, 1, 1, sizeof *g->sess);
    g->act_sess = alloc3(N, 1, 1, sizeof *g->act_sess);
    g->act = alloc3(N, 1, 1, sizeof *g->act);
    g->tok = alloc3(N, (size_t)S + 1, 1, sizeof *g->tok);
    g->ntok = alloc3(N, 1, 1, sizeof *g->ntok);
    g->rng = alloc3(N, 1, 1, sizeof *g->rng);
    g->logits = alloc3(rows, V, 1, sizeof *g->logits);
    g->row_tok = alloc3(rows, 1, 1, sizeof *g->row_tok);
    g->row_pos = alloc3(rows, 1, 1, sizeof *g->row_pos);
    g->rot = alloc3(c->dim, 1, 1, sizeof *g->rot);
    bool ok = st == PKV_OK && g->sess && g->act_sess && g->act && g->tok && g->ntok &&
              g->rng && g->logits && g->row_tok && g->row_pos && g->rot;
    if (ok && o->check) {
        g->hq = alloc3((size_t)N * L, S, c->dim, sizeof(float));
        g->hk = alloc3((size_t)N * L, S, c->kv_dim, sizeof(float));
        g->hv = alloc3((size_t)N * L, S, c->kv_dim, sizeof(float));
        g->ref = alloc3(S, c->dim, 1, sizeof(float));
        ok = g->hq && g->hk && g->hv && g->ref;
    }
    if (ok && o->check_e2e) {
        g->rec_logits = alloc3(N, g->gen_cap, V, sizeof(float));
        g->coins = alloc3(N, g->gen_cap, 1, sizeof(float));
        g->dense_logits = alloc3(g->gen_cap, V, 1, sizeof(float));
        g->dk = alloc3(S, c->kv_dim, 1, sizeof(float));
        g->dv = alloc3(S, c->kv_dim, 1, sizeof(float));
        g->dense_tok = alloc3(N, g->gen_cap, 1, sizeof(uint32_t));
        ok = g->rec_logits && g->coins && g->dense_logits && g->dk && g->dv &&
             g->dense_tok;
    }
    if (!ok)
        return cli_fail(CMD, "cannot allocate buffers for %u sessions x %u positions", N,
                        S);
    for (uint32_t s = 0; s < N; s++)
        llama_rng_init(&g->rng[s], o->seed ^ ((uint64_t)s * 0x9e3779b97f4a7c15ull));

    pkv_config cfg = llama_kv_config(c, o->block_tokens,
                                     o->dtype_set ? o->dtype
                                                  : o->model_path ? PKV_F32 : PKV_F16,
                                     o->threads);
    bool oom = false;
    g->lc = cli_variant_layers(&o->v, c->n_layers, c->n_heads, &g->sink_store, &oom);
    if (!g->lc && !oom)
        g->lc = alloc3(c->n_layers, 1, 1, sizeof *g->lc);
    if (oom || !g->lc)
        return cli_fail(CMD, "out of memory");
    /* the engine turns keys and queries (docs/rope.md): what a context shift needs */
    llama_kv_rope(c, g->lc, &cfg);
    g->st.rope_in_attn = true;
    if (cli_check_limits(CMD, &cfg, o->model_path ? o->model_path : "the synthetic model") !=
        CLI_OK)
        return CLI_USAGE;
    st = pkv_engine_create(&cfg, &g->eng);
    if (st != PKV_OK) {
        char why[256];
        if (pkv_config_explain(&cfg, why, sizeof why) != PKV_OK)
            return cli_usage_error(CMD, "the engine rejects this configuration: %s", why);
        return cli_fail(CMD, "cannot create the engine: %s", pkv_status_str(st));
    }
    st = pkv_session_create(g->eng, &g->sess[0]);
    if (st != PKV_OK)
        return cli_fail(CMD, "cannot create a session: %s", pkv_status_str(st));
    g->kv = llama_kv_init(g->eng, c, g->act_sess);
    return CLI_OK;
}

/* ---- attention: the paged cache, and the checks -------------------------------- */

static pkv_dtype gen_dtype(const gen *g)
{
    pkv_config cfg;
    if (pkv_engine_config(g->eng, &cfg) != PKV_OK)
        return PKV_F32;
    return cfg.kv_dtype;
}

static float *hist(const gen *g, float *base, uint32_t s, uint32_t layer, uint32_t pos,
                   uint32_t width)
{
    size_t slot = ((size_t)s * g->c->n_layers + layer) * g->steps + pos;
    return base + slot * width;
}

/* The n rows k, v [rows][head_size] rounded as the cache stores them, row by row
 * (a Q8/Q4 row's scales are its own 32-value blocks'), into dk, dv. */
static void round_rows(const gen *g, pkv_dtype dt, size_t rows, const float *k,
                       const float *v, float *dk, float *dv)
{
    const uint32_t hs = g->c->head_size;
    for (size_t r = 0; r < rows; r++) {
        pkv_dtype_round_row(dt, hs, k + r * hs, dk + r * hs);
        pkv_dtype_round_row(dt, hs, v + r * hs, dv + r * hs);
    }
}

/* Key row k ([n_kv_heads][hs]) of `layer` turned at position pos as the engine turns
 * the keys it stores: pkv_rope_q on a row as wide as a query, whose first n_kv_heads
 * heads are the key's. Into g->rot, which it returns. */
static const float *rope_key(gen *g, uint32_t layer, uint64_t pos, const float *k)
{
    memcpy(g->rot, k, g->c->kv_dim * sizeof(float));
    (void)pkv_rope_q(g->eng, layer, 1, &pos, g->rot);
    return g->rot;
}

/* Record row r's q/k/v for session s at position pos (K/V rounded as the cache
 * stores them). */
static void record(gen *g, pkv_dtype dt, uint32_t s, uint32_t layer, uint32_t pos,
                   const float *q, const float *k, const float *v)
{
    const llama_config *c = g->c;
    memcpy(hist(g, g->hq, s, layer, pos, c->dim), q, c->dim * sizeof(float));
    float *hk = hist(g, g->hk, s, layer, pos, c->kv_dim);
    float *hv = hist(g, g->hv, s, layer, pos, c->kv_dim);
    round_rows(g, dt, c->n_kv_heads, k, v, hk, hv);
}

/* Dense causal attention over positions 0..T-1 of (s, layer); compare rows
 * first..T-1 with out (row first at out[0]). */
static pkv_status check_rows(gen *g, uint32_t s, uint32_t layer, uint32_t T,
                             uint32_t first, const float *out)
{
    const llama_config *c = g->c;
    const float *hv = hist(g, g->hv, s, layer, 0, c->kv_dim);
    pkv_status st = pkv_attention_reference(T, c->n_heads, c->n_kv_heads, c->head_size, 0,
                                            0.0f, g->lc ? &g->lc[layer] : NULL,
                                            hist(g, g->hq, s, layer, 0, c->dim),
                                            hist(g, g->hk, s, layer, 0, c->kv_dim), hv,
                                            g->ref);
    if (st != PKV_OK) {
        snprintf(g->err, sizeof g->err, "check: pkv_attention_reference: %s",
                 pkv_status_str(st));
        return st;
    }
    /* max |V| as a compare, not fmax(): Debian 12's aarch64 gcc (12.2) crashes in its
     * -O3 vectorizer on an fmax reduction of fabs (docs/performance.md, decision
     * table: aarch64-fmax) */
    double vmax = 0;
    for (size_t i = 0; i < (size_t)T * c->kv_dim; i++) {
        const double a = fabs((double)hv[i]);
        vmax = a > vmax ? a : vmax;
    }
    double tol = CHECK_REL * vmax;
    for (uint32_t t = first; t < T; t++) {
        const float *a = out + (size_t)(t - first) * c->dim;
        const float *b = g->ref + (size_t)t * c->dim;
        for (uint32_t i = 0; i < c->dim; i++) {
            double e = fabs((double)a[i] - (double)b[i]);
            if (!(e <= tol)) {
                snprintf(g->err, sizeof g->err,
                         "check failed: session %u, layer %u, position %u, head %u: "
                         "paged %.9g vs dense %.9g (|diff| %.3g > tolerance %.3g = "
                         "%.0e x max|V|)",
                         s, layer, t, i / c->head_size, (double)a[i], (double)b[i], e, tol,
                         CHECK_REL);
                return PKV_ECORRUPT;
            }
            g->check_maxerr = fmax(g->check_maxerr, e);
            if (tol > 0)
                g->check_worst = fmax(g->check_worst, e / tol);
        }
        g->n_checked++;
    }
    return PKV_OK;
}

/* The model's attention: the paged cache (prefill or append + decode), or, for the
 * end-to-end check, dense causal attention with no cache at all. */
static pkv_status attn_cb(void *ctx, uint32_t layer, uint32_t n, float *q,
                          const float *k, const float *v, float *out)
{
    gen *g = ctx;
    const llama_config *c = g->c;
    pkv_status st = PKV_OK;
    if (g->mode == MODE_DENSE) {
        pkv_dtype dt = gen_dtype(g);
        for (uint32_t r = 0; r < n; r++) { /* rotated as the engine rotates them */
            const uint64_t p = g->row_pos[r];
            (void)pkv_rope_q(g->eng, layer, 1, &p, q + (size_t)r * c->dim);
            memcpy(g->dk + (size_t)r * c->kv_dim,
                   rope_key(g, layer, p, k + (size_t)r * c->kv_dim), c->kv_dim * sizeof(float));
        }
        round_rows(g, dt, (size_t)n * c->n_kv_heads, g->dk, v, g->dk, g->dv);
        st = pkv_attention_reference(n, c->n_heads, c->n_kv_heads, c->head_size, 0, 0.0f,
                                     g->lc ? &g->lc[layer] : NULL, q, g->dk, g->dv, out);
        if (st != PKV_OK)
            snprintf(g->err, sizeof g->err, "dense recompute: %s", pkv_status_str(st));
        return st;
    }
    /* the cache: examples/llama/llama_kv.c, as a generator of one's own would call it */
    g->kv.prefill = g->mode == MODE_PREFILL;
    st = llama_kv_attn(&g->kv, layer, n, q, k, v, out);
    if (st != PKV_OK) {
        if (g->kv.prefill)
            snprintf(g->err, sizeof g->err, "%s (layer %u, %u tokens): %s", g->kv.failed,
                     layer, n, pkv_status_str(st));
        else
            snprintf(g->err, sizeof g->err, "%s (layer %u, position %u): %s", g->kv.failed,
                     layer, g->cur_pos, pkv_status_str(st));
        return st;
    }
    if (!g->o->check)
        return PKV_OK;
    double t0 = cli_now();
    pkv_dtype dt = gen_dtype(g);
    /* q came back rotated (llama_kv_attn); k is turned here as the engine stored it */
    if (g->mode == MODE_PREFILL) {
        for (uint32_t r = 0; r < n; r++)
            record(g, dt, 0, layer, r, q + (size_t)r * c->dim,
                   rope_key(g, layer, r, k + (size_t)r * c->kv_dim), v + (size_t)r * c->kv_dim);
        st = check_rows(g, 0, layer, n, 0, out);
    } else {
        for (uint32_t r = 0; r < n && st == PKV_OK; r++) {
            record(g, dt, g->act[r], layer, g->cur_pos, q + (size_t)r * c->dim,
                   rope_key(g, layer, g->cur_pos, k + (size_t)r * c->kv_dim),
                   v + (size_t)r * c->kv_dim);
            st = check_rows(g, g->act[r], layer, g->cur_pos + 1, g->cur_pos,
                            out + (size_t)r * c->dim);
        }
    }
    const double now = cli_now();
    g->check_secs += now - t0;
    if (g->check_secs - g->check_shown >= CHECK_PROGRESS_SECS) {
        g->check_shown = g->check_secs;
        fprintf(stderr, "pagedkv generate: --check: position %u of %u, %.0f s checking so "
                        "far\n", g->mode == MODE_PREFILL ? n : g->cur_pos + 1, g->steps,
                g->check_secs);
    }
    return st;
}

/* ---- generation ---------------------------------------------------------------- */

/* Token i of session s on stdout. Position 0 is always the BOS the prompt starts
 * with: a marker, not text or generated output, so it prints nothing in either form.
 * Without a tokenizer the ids stand for the text: the prompt's ids (echoed, as the
 * text is) and then the generated ones, so an empty prompt prints exactly the ids
 * that "generated: N tokens" counts. */
static void emit(const gen *g, uint32_t s, uint32_t i)
{
    const uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
    if (i == 0)
        return;
    if (!g->have_tok) {
        printf("%s%u", i > 1 ? " " : "", t[i]);
        return;
    }
    const char *p;
    size_t n;
    tokenizer_decode(&g->tk, t[i - 1], t[i], &p, &n);
    fwrite(p, 1, n, stdout);
}

/* Print session s's tokens [from, to), except a final BOS that stopped it. */
void gen_emit_range(const gen *g, uint32_t s, uint32_t from, uint32_t to)
{
    const uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
    for (uint32_t i = from; i < to; i++)
        if (!(i > 0 && i >= g->P && gen_stops(g, t[i])))
            emit(g, s, i);
}

/* Sample session s's next token from `logits` (sampled step `k`). */
bool gen_take(gen *g, uint32_t s, uint32_t k, const float *logits)
{
    const uint32_t V = g->c->vocab_size;
    float coin = llama_rng_coin(&g->rng[s]);
    uint32_t next = llama_sample(&g->smp, logits, coin);
    if (g->o->check_e2e) {
        memcpy(g->rec_logits + ((size_t)s * g->gen_cap + k) * V, logits, V * sizeof(float));
        g->coins[(size_t)s * g->gen_cap + k] = coin;
    }
    uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
    t[g->ntok[s]++] = next;
    g->n_generated++;
    return !gen_stops(g, next);
}

static int gen_run(gen *g)
{
    const uint32_t N = g->N, P = g->P, V = g->c->vocab_size;
    const bool stream = N == 1 && !g->o->json;
    pkv_status st;

    /* the prompt, through pkv_prefill, layer by layer */
    for (uint32_t r = 0; r < P; r++)
        g->row_pos[r] = r;
    g->mode = MODE_PREFILL;
    g->act_sess[0] = g->sess[0];   /* the prompt's rows all go to session 0 */
    double t0 = cli_now();
    bool sample_first = g->n_prompt <= g->steps;
    st = llama_forward(&g->model, &g->st, P, g->prompt, g->row_pos, attn_cb, g,
                       sample_first ? P - 1 : P, g->logits);
    if (st != PKV_OK)
        return cli_fail(CMD, "prompt: %s", g->err[0] ? g->err : pkv_status_str(st));
    g->t_prefill = cli_now() - t0 - g->check_secs;
    double check_before = g->check_secs;

    if (g->o->prefix_cache && N > 1 && gen_prefix_sessions(g, attn_cb, sample_first) != CLI_OK)
        return CLI_FAIL;
    for (uint32_t s = 1; s < N && !g->o->prefix_cache; s++) {
        st = pkv_session_fork(g->sess[0], &g->sess[s]);
        if (st != PKV_OK)
            return cli_fail(CMD, "pkv_session_fork: %s", pkv_status_str(st));
        /* the fork's check history starts as its parent's prompt rows */
        float *const h[3] = {g->hq, g->hk, g->hv};
        const uint32_t w[3] = {g->c->dim, g->c->kv_dim, g->c->kv_dim};
        for (uint32_t l = 0; g->o->check && l < g->c->n_layers; l++)
            for (int a = 0; a < 3; a++)
                memcpy(hist(g, h[a], s, l, 0, w[a]), hist(g, h[a], 0, l, 0, w[a]),
                       (size_t)P * w[a] * sizeof(float));
    }
    bool live = false;
    for (uint32_t s = 0; s < N; s++) {
        uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
        memcpy(t, g->prompt, P * sizeof *t);
        g->ntok[s] = P;
        if (sample_first)
            live = gen_take(g, s, 0, gen_first_logits(g, s)) || live;
        else
            t[g->ntok[s]++] = g->prompt[P];   /* -n ended inside the prompt */
    }
    if (stream) {
        gen_emit_range(g, 0, 0, g->ntok[0]);
        fflush(stdout);
    }

    if (g->o->speculate && live && sample_first) {
        if (gen_speculate(g, attn_cb, stream) != CLI_OK)
            return CLI_FAIL;
        live = false;
    }
    /* token loop: no allocation from here on */
    t0 = cli_now();
    for (uint32_t pos = P; live && sample_first && pos < g->steps; pos++) {
        uint32_t n = 0;
        for (uint32_t s = 0; s < N; s++) {
            const uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
            if (g->ntok[s] == pos + 1 && !gen_stops(g, t[pos])) {
                g->act[n] = s;
                g->act_sess[n] = g->sess[s];
                g->row_tok[n] = t[pos];
                g->row_pos[n] = pos;
                n++;
            }
        }
        if (n == 0)
            break;
        if (g->o->context_shift && gen_context_shift(g, n) != CLI_OK)
            return CLI_FAIL;
        g->mode = MODE_DECODE;
        g->cur_pos = pos;
        st = llama_forward(&g->model, &g->st, n, g->row_tok, g->row_pos, attn_cb, g, 0,
                           g->logits);
        if (st != PKV_OK)
            return cli_fail(CMD, "%s", g->err[0] ? g->err : pkv_status_str(st));
        for (uint32_t r = 0; r < n; r++) {
            uint32_t s = g->act[r];
            gen_take(g, s, pos + 1 - P, g->logits + (size_t)r * V);
            if (stream)
                gen_emit_range(g, s, g->ntok[s] - 1, g->ntok[s]);
        }
        if (stream)
            fflush(stdout);
    }
    if (!g->o->speculate)
        g->t_decode = cli_now() - t0 - (g->check_secs - check_before);
    if (stream) {
        printf("\n");
    } else if (!g->o->json) {
        for (uint32_t s = 0; s < N; s++) {
            printf("[session %u]\n", s);
            gen_emit_range(g, s, 0, g->ntok[s]);
            printf("\n");
        }
    }
    fflush(stdout);
    return CLI_OK;
}

/* ---- the end-to-end check: every step again, without the cache ------------------ */

/* One causal pass over a session's forwarded tokens gives, at row p, exactly the
 * logits a cache-free generator computes at step p (causality: row p sees only
 * tokens 0..p, which are the same tokens). So a single dense pass per session
 * recomputes every step of the generation. */
static double e2e_rel(pkv_dtype dt)
{
    /* Q8/Q4: one step is 1/127 or 1/7 of its block's largest value, but a flip of one
     * value in a block moves a logit far less (stories260K: 3e-6 and 4e-4 x max|logit|):
     * Q8 is held to bf16's bound, Q4 to 4 x 2^-5 */
    double eps = dt == PKV_Q4 ? 0x1p-5 : dt == PKV_Q8 || dt == PKV_BF16 ? 0x1p-7
               : dt == PKV_F16 ? 0x1p-10 : 0x1p-23;
    return 4 * eps > E2E_REL ? 4 * eps : E2E_REL;
}

static int gen_e2e(gen *g)
{
    const uint32_t P = g->P, V = g->c->vocab_size;
    const double rel = e2e_rel(gen_dtype(g));
    if (g->n_prompt > g->steps)
        return CLI_OK;                  /* nothing was sampled */
    g->mode = MODE_DENSE;
    for (uint32_t r = 0; r < g->steps; r++)
        g->row_pos[r] = r;
    for (uint32_t s = 0; s < g->N; s++) {
        const uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
        const uint32_t R = g->ntok[s] - 1, G = g->ntok[s] - P;
        pkv_status st = llama_forward(&g->model, &g->st, R, t, g->row_pos, attn_cb, g,
                                      P - 1, g->dense_logits);
        if (st != PKV_OK)
            return cli_fail(CMD, "%s", g->err[0] ? g->err : pkv_status_str(st));
        for (uint32_t k = 0; k < G; k++) {
            const float *dl = g->dense_logits + (size_t)k * V;
            const float *pl = g->rec_logits + ((size_t)s * g->gen_cap + k) * V;
            double mx = 1.0, diff = 0.0;
            for (uint32_t i = 0; i < V; i++) {   /* compares, not fmax(): check_rows */
                const double a = fabs((double)dl[i]), e = fabs((double)dl[i] - (double)pl[i]);
                mx = a > mx ? a : mx;
                diff = e > diff || isnan(e) ? e : diff;
            }
            double tol = rel * mx;
            g->e2e_maxdiff = fmax(g->e2e_maxdiff, diff);
            g->e2e_tol = fmax(g->e2e_tol, tol);
            if (!(diff <= tol))
                return cli_fail(CMD, "check-e2e failed: session %u, position %u: logits "
                                     "differ by %.3g from the cache-free recompute "
                                     "(tolerance %.3g)", s, P - 1 + k, diff, tol);
            uint32_t dt = llama_sample(&g->smp, dl, g->coins[(size_t)s * g->gen_cap + k]);
            uint32_t pt = t[P + k];
            g->dense_tok[(size_t)s * g->gen_cap + k] = dt;
            g->e2e_steps++;
            if (dt == pt)
                continue;
            /* Greedy: the paged logits may flip a near-tie whose margin is within the
             * logit error; anything wider is a defect. Sampling: the logits are
             * already held to the tolerance above; a token can still differ when the
             * coin sits within that error of a CDF boundary or two near-equal tokens
             * swap places in the nucleus order, so a flip is counted, not failed. */
            double margin = (double)dl[dt] - (double)dl[pt];
            if (g->o->temperature > 0 || margin <= 2.0 * diff) {
                g->e2e_ties++;
                continue;
            }
            return cli_fail(CMD, "check-e2e failed: session %u, position %u: the cache "
                                 "gave token %u, the cache-free recompute %u (margin "
                                 "%.3g, logit error %.3g)",
                            s, P + k, pt, dt, margin, diff);
        }
    }
    return CLI_OK;
}

int cmd_generate(int argc, char **argv)
{
    if (mpi_tools_requested(argc, argv)) /* sharded by heads over MPI: generate/mpi.c */
        return mpi_generate(argc, argv);
    gen_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    gen *g = calloc(1, sizeof *g);
    if (!g)
        return cli_fail(CMD, "out of memory");
    g->o = &o;
    rc = gen_setup(g);
    if (rc == CLI_OK)
        rc = gen_run(g);
    if (rc == CLI_OK && o.check_e2e)
        rc = gen_e2e(g);
    if (rc == CLI_OK && o.save_path)
        rc = gen_save(g);
    if (rc == CLI_OK)
        rc = gen_report(g);
    gen_free(g);
    free(g);
    return rc;
}

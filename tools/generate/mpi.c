/*
 * generate/mpi.c - `pagedkv generate --mpi`: the tiny Llama sharded by heads (tensor
 * parallel, docs/sharding.md) over the ranks of `mpirun -np R`.
 *
 * Owns: the head split, the attention callback that runs a rank's heads through its
 * own engine and gathers every rank's heads, and a one-session generation loop that
 * prints what `pagedkv generate` prints on stdout (rank 0 only).
 *
 * The split: with g KV groups and h/g query heads per group, rank r of R holds the
 * groups [r*g/R, (r+1)*g/R) and their query heads; for R > g (R a multiple of g) each
 * group is replicated on R/g ranks and each of them keeps its share of the group's
 * query heads. Every rank computes the rest of the model (norms, projections, the
 * feed-forward: the model is tiny) on the whole width, identically. Per head, the
 * library's arithmetic does not depend on how many heads or groups an engine has
 * (kernels are head-local; the split-K chunks depend on positions alone), and the
 * gather only places each rank's heads at their index - so the attention output, and
 * with it every logit and token, is bitwise the single-process one for any R.
 *
 * Wire: per layer and step each rank contributes its heads' outputs (n_heads_r *
 * head_size floats per row) to an MPI_Allgatherv; figures on stderr.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "llama.h"
#include "llama_kv.h"
#include "common/mpi_common.h"
#include "common/mpi_tools.h"
#include "common/opt.h"
#include "tokenizer.h"

#define CMD "generate"
#define SYNTHETIC_SEED 0x5eedull /* generate/generate.c's built-in model */

static void usage(FILE *f)
{
    fprintf(f,
        "usage: mpirun -np R pagedkv generate --mpi [OPTIONS]\n\n"
        "The tiny Llama of `pagedkv generate` sharded by heads over R ranks: rank r holds\n"
        "KV groups [r*g/R, (r+1)*g/R) and their query heads (R > g: each group on R/g\n"
        "ranks, each keeping its share of the query heads). Rank 0 prints the text, which\n"
        "is exactly the single-process text. One session.\n\n"
        "  --model FILE --tokenizer FILE   a llama2.c checkpoint (default: built-in model)\n"
        "  -n, --steps N        positions, prompt included (default 256)\n"
        "  -i, --prompt TEXT    the prompt (default: BOS alone)\n"
        "  -t, --temperature T  0 = greedy (default 1)\n"
        "  -p, --top-p P        nucleus mass (default 0.9)\n"
        "  -s, --seed N         sampler seed (default 42)\n"
        "  --dtype T            K/V storage (default f32 with --model, else f16)\n"
        "  --block-tokens N     tokens per page (default: the library's)\n"
        "  --threads N          engine threads per rank (default 1)\n"
        "  --timeout S          give up when the other ranks have not answered for S\n"
        "                       seconds (a rank stopped or died): a message, exit 1\n"
        "                       (default 120). Waits sleep: no rank spins meanwhile\n"
        "  --help               this text\n\n"
        "generate's options of several sessions, variants, checks and JSON (--sessions,\n"
        "--prefix-cache, --window, --check, --json, ...) are refused with --mpi.\n");
}

typedef struct {
    const char *model_path, *tok_path, *prompt;
    uint32_t steps, block_tokens, threads;
    double temperature, topp;
    uint64_t seed;
    pkv_dtype dtype;
    double timeout;            /* --timeout, seconds */
    bool dtype_set, mpi;
} mg_opts;

/* A rank's share: groups [g0, g0 + ng), query heads [h0, h0 + nh). */
typedef struct {
    uint32_t g0, ng, h0, nh;
} share;

/* Rank r's share of h heads in g groups over R ranks; false if R does not divide. */
static bool share_of(uint32_t h, uint32_t g, int R, int r, share *s)
{
    const uint32_t hg = h / g;
    if ((uint32_t)R <= g) {
        s->g0 = (uint32_t)((uint64_t)r * g / (uint32_t)R);
        s->ng = (uint32_t)((uint64_t)(r + 1) * g / (uint32_t)R) - s->g0;
        s->h0 = s->g0 * hg;
        s->nh = s->ng * hg;
        return true;
    }
    const uint32_t k = (uint32_t)R / g; /* ranks per group */
    if ((uint32_t)R % g || hg % k)
        return false;
    s->g0 = (uint32_t)r / k;
    s->ng = 1;
    s->nh = hg / k;
    s->h0 = s->g0 * hg + ((uint32_t)r % k) * s->nh;
    return true;
}

typedef struct {
    llama_kv kv;                 /* this rank's heads on its engine */
    const llama_config *c;
    share me;
    int R;
    share *all;                  /* [R] */
    int *counts, *displs;        /* [R] floats of one gather */
    float *qb, *kb, *vb, *ob;    /* [rows][nh|ng][hs] */
    float *gath;                 /* [rows][h][hs] gathered, rank-major */
    uint64_t bytes;              /* sent by this rank, all gathers */
    uint64_t gathers;
    char err[256];
} mg_attn;

static pkv_status attn(void *ctx, uint32_t layer, uint32_t n, float *q,
                       const float *k, const float *v, float *out)
{
    mg_attn *a = ctx;
    const llama_config *c = a->c;
    const size_t hs = c->head_size;
    for (uint32_t t = 0; t < n; t++) {
        memcpy(a->qb + (size_t)t * a->me.nh * hs, q + (size_t)t * c->dim + a->me.h0 * hs,
               a->me.nh * hs * sizeof(float));
        memcpy(a->kb + (size_t)t * a->me.ng * hs, k + (size_t)t * c->kv_dim + a->me.g0 * hs,
               a->me.ng * hs * sizeof(float));
        memcpy(a->vb + (size_t)t * a->me.ng * hs, v + (size_t)t * c->kv_dim + a->me.g0 * hs,
               a->me.ng * hs * sizeof(float));
    }
    int st = (int)llama_kv_attn(&a->kv, layer, n, a->qb, a->kb, a->vb, a->ob);
    if (st != PKV_OK)
        snprintf(a->err, sizeof a->err, "%s (layer %u): %s", a->kv.failed, layer,
                 pkv_status_str((pkv_status)st));
    const int worst = mpi_common_max(st);
    if (worst != PKV_OK) {
        if (!a->err[0])
            snprintf(a->err, sizeof a->err, "another rank failed (layer %u)", layer);
        return (pkv_status)worst;
    }
    /* every rank's heads, in rank order; then each head to its index */
    for (int r = 0; r < a->R; r++) {
        a->counts[r] = (int)(n * a->all[r].nh * hs);
        a->displs[r] = r ? a->displs[r - 1] + a->counts[r - 1] : 0;
    }
    mpi_allgatherv(a->ob, (int)(n * a->me.nh * hs), MPI_FLOAT, a->gath, a->counts,
                   a->displs, MPI_FLOAT, "gathering every rank's attention heads");
    a->bytes += (uint64_t)n * a->me.nh * hs * sizeof(float);
    a->gathers++;
    for (int r = 0; r < a->R; r++)
        for (uint32_t t = 0; t < n; t++)
            memcpy(out + (size_t)t * c->dim + a->all[r].h0 * hs,
                   a->gath + a->displs[r] + (size_t)t * a->all[r].nh * hs,
                   a->all[r].nh * hs * sizeof(float));
    return PKV_OK;
}

/* The text of token i after token i - 1 (generate/generate.c's emit). */
static void emit(const tokenizer *tk, bool have_tok, const uint32_t *t, uint32_t i)
{
    if (i == 0)
        return;
    if (!have_tok) {
        printf("%s%u", i > 1 ? " " : "", t[i]);
        return;
    }
    const char *p;
    size_t n;
    tokenizer_decode(tk, t[i - 1], t[i], &p, &n);
    fwrite(p, 1, n, stdout);
}

static int run(const void *opts, int rank, int R)
{
    const mg_opts *o = opts;
    llama_model m;
    memset(&m, 0, sizeof m);
    tokenizer tk;
    memset(&tk, 0, sizeof tk);
    char err[512];
    pkv_status st = o->model_path ? llama_load(&m, o->model_path, err, sizeof err)
                                  : llama_synthetic(&m, SYNTHETIC_SEED);
    if (st != PKV_OK) {
        llama_free(&m);
        return cli_fail(CMD, "%s", o->model_path ? err : "synthetic model");
    }
    const llama_config *c = &m.cfg;
    const bool have_tok = o->tok_path != NULL;
    if (have_tok && tokenizer_load(&tk, o->tok_path, c->vocab_size, err, sizeof err) != PKV_OK) {
        llama_free(&m);
        return cli_fail(CMD, "%s", err);
    }
    mg_attn a;
    memset(&a, 0, sizeof a);
    a.c = c;
    a.R = R;
    a.all = calloc((size_t)R, sizeof *a.all);
    a.counts = calloc((size_t)R, sizeof *a.counts);
    a.displs = calloc((size_t)R, sizeof *a.displs);
    int rc = CLI_OK;
    if (!a.all || !a.counts || !a.displs) {
        rc = cli_fail(CMD, "out of memory");
        goto out;
    }
    for (int r = 0; r < R; r++)
        if (!share_of(c->n_heads, c->n_kv_heads, R, r, &a.all[r])) {
            rc = cli_usage_error(CMD, "%d ranks: more ranks than KV groups (%u) must be a "
                                 "multiple of them that splits each group's %u query heads",
                                 R, c->n_kv_heads, c->n_heads / c->n_kv_heads);
            goto out;
        }
    a.me = a.all[rank];

    /* the prompt, as generate/generate.c encodes it */
    const size_t plen = strlen(o->prompt);
    uint32_t *prompt = calloc(tokenizer_max_tokens(plen), sizeof *prompt);
    size_t np = 0;
    if (!prompt) {
        rc = cli_fail(CMD, "out of memory");
        goto out;
    }
    char perr[128];
    if (tokenizer_encode_prompt(have_tok ? &tk : NULL, c->vocab_size, o->prompt, prompt,
                                tokenizer_max_tokens(plen), &np, perr, sizeof perr) != PKV_OK) {
        free(prompt);
        rc = cli_usage_error(CMD, "%s", perr);
        goto out;
    }
    const uint32_t steps = o->steps < c->seq_len ? o->steps : c->seq_len;
    const uint32_t n_prompt = (uint32_t)np, P = n_prompt < steps ? n_prompt : steps;
    const bool sample_first = n_prompt <= steps;

    /* this rank's engine: its groups and heads of every layer */
    llama_config lc = *c;
    lc.n_heads = a.me.nh;
    lc.n_kv_heads = a.me.ng;
    lc.kv_dim = a.me.ng * c->head_size;
    const pkv_dtype dt = o->dtype_set ? o->dtype : o->model_path ? PKV_F32 : PKV_F16;
    pkv_engine *e = NULL;
    pkv_session *s = NULL;
    llama_state ls;
    llama_sampler smp;
    memset(&ls, 0, sizeof ls);
    memset(&smp, 0, sizeof smp);
    const uint32_t rows = P > 1 ? P : 1;
    uint32_t *tok = calloc((size_t)steps + 2, sizeof *tok);
    uint32_t *pos = calloc(rows, sizeof *pos);
    float *logits = calloc(c->vocab_size, sizeof *logits);
    const size_t hs = c->head_size;
    a.qb = calloc((size_t)rows * c->dim, sizeof(float));
    a.kb = calloc((size_t)rows * c->kv_dim, sizeof(float));
    a.vb = calloc((size_t)rows * c->kv_dim, sizeof(float));
    a.ob = calloc((size_t)rows * c->dim, sizeof(float));
    a.gath = calloc((size_t)rows * c->n_heads * hs, sizeof(float));
    if (!tok || !pos || !logits || !a.qb || !a.kb || !a.vb || !a.ob || !a.gath) {
        rc = cli_fail(CMD, "out of memory");
        goto done;
    }
    /* the engine turns keys and queries (as the single-process run does) */
    pkv_config cfg = llama_kv_config(&lc, o->block_tokens, dt, o->threads);
    pkv_layer_config *rl = calloc(c->n_layers, sizeof *rl);
    if (rl)
        llama_kv_rope(&lc, rl, &cfg);
    if ((st = rl ? pkv_engine_create(&cfg, &e) : PKV_ENOMEM) != PKV_OK ||
        (st = pkv_session_create(e, &s)) != PKV_OK ||
        (st = llama_state_init(&ls, c, rows)) != PKV_OK ||
        (st = llama_sampler_init(&smp, c->vocab_size, (float)o->temperature,
                                 (float)o->topp)) != PKV_OK) {
        rc = cli_fail(CMD, "rank %d: setup: %s", rank, pkv_status_str(st));
        free(rl);
        goto done;
    }
    free(rl);
    rl = NULL;
    ls.rope_in_attn = true;
    a.kv = llama_kv_init(e, &lc, &s);
    llama_rng rng;
    llama_rng_init(&rng, o->seed);

    /* the prompt, then one token a step: generate/generate.c's loop for one session */
    const double t0 = MPI_Wtime();
    for (uint32_t r = 0; r < P; r++)
        pos[r] = r;
    a.kv.prefill = true;
    st = llama_forward(&m, &ls, P, prompt, pos, attn, &a, sample_first ? P - 1 : P, logits);
    a.kv.prefill = false;
    if (st != PKV_OK) {
        rc = cli_fail(CMD, "rank %d: prompt: %s", rank, a.err[0] ? a.err : pkv_status_str(st));
        goto done;
    }
    memcpy(tok, prompt, P * sizeof *tok);
    uint32_t ntok = P;
    const bool model = o->model_path != NULL;
    bool live = false;
    if (sample_first) {
        tok[ntok] = llama_sample(&smp, logits, llama_rng_coin(&rng));
        live = !(model && tok[ntok] == TOKENIZER_BOS);
        ntok++;
    } else {
        tok[ntok++] = prompt[P];
    }
    if (rank == 0) {
        for (uint32_t i = 0; i < ntok; i++)
            if (!(i > 0 && i >= P && model && tok[i] == TOKENIZER_BOS))
                emit(&tk, have_tok, tok, i);
        fflush(stdout);
    }
    const double t1 = MPI_Wtime();
    uint32_t generated = sample_first;
    for (uint32_t p = P; live && sample_first && p < steps; p++) {
        uint32_t cur = tok[p];
        st = llama_forward(&m, &ls, 1, &cur, &p, attn, &a, 0, logits);
        if (st != PKV_OK) {
            rc = cli_fail(CMD, "rank %d: %s", rank, a.err[0] ? a.err : pkv_status_str(st));
            goto done;
        }
        tok[ntok] = llama_sample(&smp, logits, llama_rng_coin(&rng));
        live = !(model && tok[ntok] == TOKENIZER_BOS);
        ntok++;
        generated++;
        if (rank == 0 && live) {
            emit(&tk, have_tok, tok, ntok - 1);
            fflush(stdout);
        }
    }
    const double t2 = MPI_Wtime();
    pkv_memory mem;
    memset(&mem, 0, sizeof mem);
    pkv_session_memory(s, &mem);
    uint64_t resident[2] = {mem.bytes_resident, a.bytes}, sum[2] = {0, 0};
    mpi_reduce_sum_u64(resident, sum, 2, 0, "adding up the ranks' memory");
    if (rank == 0) {
        printf("\n");
        fflush(stdout);
        const double step_bytes = (double)c->n_heads * hs * sizeof(float) * c->n_layers;
        fprintf(stderr, "pagedkv generate --mpi: %d ranks (rank 0: groups [%u, %u), heads "
                "[%u, %u)); prompt %u positions in %.1f ms, %u tokens in %.1f ms (%.1f "
                "tokens/s); cache %llu bytes over all ranks; gathered per decode step "
                "%.0f bytes (%u layers x %u heads x %zu floats), sent over the run %llu "
                "bytes\n", R, a.me.g0, a.me.g0 + a.me.ng, a.me.h0, a.me.h0 + a.me.nh, P,
                (t1 - t0) * 1e3, generated, (t2 - t1) * 1e3,
                t2 > t1 ? (generated ? generated - 1 : 0) / (t2 - t1) : 0.0,
                (unsigned long long)sum[0], step_bytes, c->n_layers, c->n_heads, hs,
                (unsigned long long)sum[1]);
    }
done:
    llama_sampler_free(&smp);
    llama_state_free(&ls);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    free(tok);
    free(pos);
    free(logits);
    free(prompt);
out:
    free(a.qb);
    free(a.kb);
    free(a.vb);
    free(a.ob);
    free(a.gath);
    free(a.all);
    free(a.counts);
    free(a.displs);
    tokenizer_free(&tk);
    llama_free(&m);
    return rc;
}

int mpi_generate(int argc, char **argv)
{
    mg_opts o;
    memset(&o, 0, sizeof o);
    o.prompt = "";
    o.steps = 256;
    o.temperature = 1.0;
    o.topp = 0.9;
    o.seed = 42;
    o.threads = 1;
    o.timeout = MPI_COMMON_TIMEOUT_DEFAULT;
    static const char *const not_sharded = "does not combine with --mpi (pagedkv generate "
                                           "--mpi --help)";
    const char *ignored_s = NULL;
    bool ignored_b = false;
    const cli_opt opts[] = {
        {.name = "mpi", .kind = OPT_FLAG, .dst = &o.mpi},
        {.name = "model", .kind = OPT_STRING, .dst = &o.model_path},
        {.name = "tokenizer", .kind = OPT_STRING, .dst = &o.tok_path},
        {.name = "steps", .short_name = 'n', .kind = OPT_U32, .dst = &o.steps, .lo = 1,
         .hi = UINT32_MAX},
        {.name = "prompt", .short_name = 'i', .kind = OPT_STRING, .dst = &o.prompt},
        {.name = "temperature", .short_name = 't', .kind = OPT_DOUBLE, .dst = &o.temperature,
         .dlo = 0, .dhi = 1e6},
        {.name = "top-p", .short_name = 'p', .kind = OPT_DOUBLE, .dst = &o.topp, .dlo = 0,
         .dhi = 1},
        {.name = "seed", .short_name = 's', .kind = OPT_U64, .dst = &o.seed, .lo = 0,
         .hi = UINT64_MAX},
        {.name = "dtype", .kind = OPT_DTYPE, .dst = &o.dtype, .seen = &o.dtype_set},
        {.name = "block-tokens", .kind = OPT_U32, .dst = &o.block_tokens, .lo = 1,
         .hi = UINT32_MAX},
        {.name = "threads", .kind = OPT_U32, .dst = &o.threads, .lo = 0,
         .hi = CLI_MAX_THREADS},
        {.name = "timeout", .kind = OPT_DOUBLE, .dst = &o.timeout, .dlo = 0.1, .dhi = 1e7},
        {.name = "sessions", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "prefix-cache", .kind = OPT_FLAG, .dst = &ignored_b,
         .refused = not_sharded},
        {.name = "window", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "sinks", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "rollback", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "softcap", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "check", .kind = OPT_FLAG, .dst = &ignored_b, .refused = not_sharded},
        {.name = "check-e2e", .kind = OPT_FLAG, .dst = &ignored_b, .refused = not_sharded},
        {.name = "json", .kind = OPT_FLAG, .dst = &ignored_b, .refused = not_sharded},
        {.name = "save", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
    };
    int rc = cli_parse(CMD, argc, argv, opts, sizeof opts / sizeof opts[0], usage, NULL, 0,
                       NULL);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    return mpi_common_main(CMD, argc, argv, o.timeout, run, &o);
}

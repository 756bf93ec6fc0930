/*
 * generate.h - what the two halves of `pagedkv generate` share: generate/generate.c parses
 * the options, runs the generation and its checks and fills a gen; generate/report.c
 * turns it into the figures on stderr, or everything as one JSON object on stdout.
 *
 * Owns: the run's state (options, model, tokenizer, engine, sessions, tokens, check
 * figures, timings). Does not own: anything in the library, the model (llama.h), the
 * tokenizer (tokenizer.h).
 *
 * Invariants (hold whenever gen_report is called)
 *   - Session s's tokens are tok[s * (steps + 1) + i] for i < ntok[s], the first P of
 *     them the prompt's; ntok[s] == pkv_session_len(sess[s], layer) + 1 for every
 *     layer (the newest token is sampled but not yet forwarded).
 *   - n_generated counts the tokens sampled over all sessions; t_prefill and t_decode
 *     exclude check_secs.
 *   - Every check that ran passed (a failure ends the run before the report), and
 *     dense_tok is filled when --check-e2e ran and n_prompt <= steps.
 */
#ifndef PKV_TOOLS_GENERATE_H
#define PKV_TOOLS_GENERATE_H

#include <stdbool.h>
#include <stdint.h>
#include "common/cli.h"
#include "llama.h"
#include "llama_kv.h"
#include "pagedkv.h"
#include "tokenizer.h"

/* --check: |paged - dense| <= CHECK_REL * max|V| per output, the library's own
 * accuracy contract (docs/numerics.md; for f16/bf16 against the reference on rounded K/V). */
#define CHECK_REL 1e-5

/* --prefix-cache (generate/sessions.c): what sessions 1..N-1 took from the cache */
typedef struct {
    bool on, identical;             /* identical: every first logit == session 0's */
    uint32_t hits;
    uint64_t reused, computed;      /* prompt positions shared / run through the model */
    double t_cold, t_tail;          /* session 0's prefill; the later ones', summed */
    float *logits;                  /* [N][vocab] each session's first logits */
} gen_prefix;

typedef struct {
    const char *model_path, *tok_path, *prompt;
    const char *save_path;          /* --save FILE: session 0 written there, or NULL */
    uint32_t steps, block_tokens, sessions, threads;
    double temperature, topp;
    uint64_t seed;
    pkv_dtype dtype;
    bool dtype_set, check, check_e2e, json;
    bool prefix_cache;              /* --prefix-cache: sessions 1.. from the cache */
    bool context_shift;             /* --context-shift: a full context drops half (docs/rope.md) */
    uint32_t keep;                  /* --keep: positions a context shift keeps at the start */
    uint32_t speculate;             /* --speculate K: drafts a step (0: off) */
    bool tree;                      /* --tree: several candidates as a tree */
    bool parallel;                  /* --parallel: the N sessions' steps as one batch */
    cli_variant v;                  /* --window, --sinks, --rollback, --softcap */
} gen_opts;

enum { MODE_PREFILL, MODE_DECODE, MODE_DENSE, MODE_VERIFY }; /* what attn_cb does */

/* --speculate --tree: the most candidates of a step's tree (generate/speculate.c) */
#define GEN_SPEC_BRANCHES 4u

/* --speculate (generate/speculate.c): what the steps did */
typedef struct {
    uint64_t steps;                 /* forwards of a tree (one pkv_verify per layer) */
    uint64_t proposed, accepted;    /* drafts below the root, summed over the steps */
    double attn_secs;               /* inside the attention of those forwards */
} gen_spec;

typedef struct {
    const gen_opts *o;
    llama_model model;
    const llama_config *c;
    tokenizer tk;
    bool have_tok;
    pkv_engine *eng;
    pkv_layer_config *lc;           /* [n_layers] the variant of each layer, or NULL */
    float *sink_store;              /* what lc's sink logits point at (unused: NULL) */
    llama_kv kv;                    /* the model's attention on eng (rows: act_sess) */
    uint32_t N, steps, n_prompt, P; /* P: prompt positions prefilled (<= steps) */
    uint32_t *prompt;               /* [n_prompt] encoded prompt, BOS first */
    pkv_session **sess;             /* [N] */
    pkv_session **act_sess;         /* [N] sessions still generating, this step */
    uint32_t *act;                  /* [N] their indices */
    uint32_t *tok;                  /* [N][steps + 1] */
    uint32_t *ntok;                 /* [N] */
    llama_state st;
    llama_sampler smp;
    llama_rng *rng;                 /* [N] */
    float *logits;                  /* [N][vocab] */
    uint32_t *row_tok, *row_pos;    /* [rows] inputs of one forward */
    float *rot;                     /* [dim] one key turned by the engine's RoPE (checks) */
    uint64_t shifts;                /* context shifts made, all sessions */
    int mode;
    uint32_t cur_pos;
    /* --check: per session and layer, the Q/K/V every position saw (K/V rounded to
     * the cache dtype), and the dense reference rows */
    float *hq, *hk, *hv;            /* [N][L][steps][dim | kv_dim] */
    float *ref;                     /* [steps][dim] */
    uint64_t n_checked;             /* attention rows compared */
    double check_maxerr, check_worst, check_secs;
    double check_shown;             /* check_secs at the last progress line */
    /* --check-e2e: what the paged path saw at every sampled step */
    uint32_t gen_cap;               /* sampled steps per session at most */
    float *rec_logits;              /* [N][gen_cap][vocab] */
    float *coins;                   /* [N][gen_cap] */
    float *dense_logits;            /* [gen_cap][vocab] */
    float *dk, *dv;                 /* [steps][kv_dim] rounded K/V of the dense pass */
    uint32_t *dense_tok;            /* [N][gen_cap] */
    double e2e_maxdiff, e2e_tol;
    uint64_t e2e_steps, e2e_ties;
    double t_prefill, t_decode;
    uint64_t n_generated;
    gen_prefix pfx;
    gen_spec spec;
    char err[512];
} gen;

/* A checkpoint's BOS ends its text (llama2.c). The synthetic model's tokens mean
 * nothing, so it always runs its -n positions: timings stay comparable. */
static inline bool gen_stops(const gen *g, uint32_t token)
{
    return token == TOKENIZER_BOS && g->o->model_path != NULL;
}

/* Why a session stopped: its -n positions ran (or the model's seq_len, which -n
 * exceeded), the model emitted BOS, or -n ended inside the prompt (nothing sampled). */
typedef enum { GEN_STOP_STEPS, GEN_STOP_SEQ_LEN, GEN_STOP_BOS, GEN_STOP_PROMPT } gen_stop;

static inline gen_stop gen_stop_reason(const gen *g, uint32_t s)
{
    const uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
    if (g->n_prompt > g->steps)
        return GEN_STOP_PROMPT;
    if (g->ntok[s] > g->P && gen_stops(g, t[g->ntok[s] - 1]))
        return GEN_STOP_BOS;
    return g->o->steps > g->steps ? GEN_STOP_SEQ_LEN : GEN_STOP_STEPS;
}

/* The report after a run that passed its checks: with --json one JSON object on stdout
 * (model, cache, tokens and memory of every session, engine figures, timings, check
 * results); otherwise memory per session, engine figures, timings and check results
 * on stderr (the text went to stdout during the run). Changes nothing. Returns
 * CLI_FAIL if the engine's or a session's figures cannot be read, CLI_OK otherwise. */
int gen_report(gen *g);

/* --prefix-cache (generate/sessions.c): sessions 1..N-1 from pkv_session_from_prefix,
 * each running the model over its uncached prompt tail; gen_first_logits is what
 * session s samples its first token from; gen_prefix_report adds the figures (to W,
 * or to stderr when W is NULL). */
int gen_prefix_sessions(gen *g, llama_attn_fn attn, bool sample_first);
const float *gen_first_logits(const gen *g, uint32_t s);
#include "common/json.h"
void gen_prefix_report(const gen *g, json_writer *W);
/* --context-shift (generate/sessions.c): each of the n active sessions whose cache holds
 * the model's seq_len keeps its first --keep positions and drops half of the rest
 * (pkv_session_discard). CLI_OK, or CLI_FAIL with the engine's reason. */
int gen_context_shift(gen *g, uint32_t n);

/* Sample session s's next token from `logits` (sampled step k: its coin, and for
 * --check-e2e its record); false when the token ends the text. Print session s's
 * tokens [from, to) (generate.c). */
bool gen_take(gen *g, uint32_t s, uint32_t k, const float *logits);
void gen_emit_range(const gen *g, uint32_t s, uint32_t from, uint32_t to);
/* --speculate (generate/speculate.c): session 0's token loop after its first token,
 * one tree of drafts a step through attn (stream: print tokens as they come);
 * gen_speculate_report adds the figures (to W, or to stderr when W is NULL). */
int gen_speculate(gen *g, llama_attn_fn attn, bool stream);
void gen_speculate_report(const gen *g, json_writer *W);

/* --save: session 0 to o->save_path, its token ids recorded first (sessions.c). */
int gen_save(gen *g);

#endif

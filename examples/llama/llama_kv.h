/*
 * llama_kv.h - the tiny Llama's attention on pagedkv: the engine for a model's
 * geometry, and the llama_attn_fn that runs every layer's attention through sessions
 * of it. With llama.h and tokenizer.h this is the whole generator a program copies;
 * it uses include/pagedkv.h alone.
 *
 * Owns: the mapping from a llama_config to a pkv_config, and the three ways a forward
 * pass meets the cache: a prompt (n consecutive positions of one session, one
 * pkv_prefill per layer), a decode step (one new token in each of n sessions: a
 * pkv_append per row, then pkv_decode, or pkv_decode_batch for n > 1: sessions that
 * share pages, forks of one prompt, read them once), and a speculative step (n draft
 * tokens of one session as a tree, one pkv_verify per layer; docs/speculative.md).
 * Does not own: the engine and sessions (the caller creates and destroys them), the
 * rows' sessions list (the caller fills kv->rows before each step).
 *
 * A generator, in the order the data flows (error checks left out):
 *
 *     llama_model m;   llama_load(&m, "stories260K.bin", err, sizeof err);
 *     llama_state st;  llama_state_init(&st, &m.cfg, n_prompt);   // rows at most
 *     pkv_engine *e;   llama_kv_engine(&m.cfg, 0, PKV_F32, 0, &e);
 *                      // or with the engine's RoPE: llama_kv_config, llama_kv_rope,
 *                      // pkv_engine_create, and st.rope_in_attn = true
 *     pkv_session *s;  pkv_session_create(e, &s);
 *     llama_kv kv = llama_kv_init(e, &m.cfg, &s);
 *     kv.prefill = true;
 *     llama_forward(&m, &st, n_prompt, prompt, pos, llama_kv_attn, &kv,
 *                   n_prompt - 1, logits);                      // the prompt
 *     kv.prefill = false;
 *     for (p = n_prompt; p < steps; p++) {                      // one token a step
 *         tok = llama_sample(&smp, logits, llama_rng_coin(&rng));
 *         llama_forward(&m, &st, 1, &tok, &p, llama_kv_attn, &kv, 0, logits);
 *     }
 *
 * Nothing here allocates: the token loop allocates only if the library does (a
 * decode of a resident session never does).
 */
#ifndef PKV_TOOLS_LLAMA_KV_H
#define PKV_TOOLS_LLAMA_KV_H

#include <stdbool.h>
#include <stdint.h>

#include "llama.h"
#include "pagedkv.h"

typedef struct {
    pkv_engine *eng;
    uint32_t kv_dim;      /* n_kv_heads * head_size: floats of one row's k or v */
    uint32_t q_dim;       /* n_heads * head_size: floats of one row's q */
    pkv_session **rows;   /* [n] the session of each row of the next forward (prefill:
                             rows[0] takes every row) */
    bool prefill;         /* rows are consecutive positions of rows[0] (a prompt) */
    const int32_t *tree;  /* non-NULL: rows are draft tokens of rows[0] as a tree,
                             tree[r] the parent row of row r or -1 (pkv_verify; the
                             caller commits the accepted path with
                             pkv_session_commit after the forward) */
    /* after a failure: the call that failed and its layer */
    const char *failed;
    uint32_t failed_layer;
} llama_kv;

/* The pkv_config of model c: its layers, heads, KV heads and head size, with a page
 * size (0 = the library's), a storage dtype and a thread count (0 = all CPUs). */
pkv_config llama_kv_config(const llama_config *c, uint32_t block_tokens, pkv_dtype dt,
                           uint32_t threads);
/* pkv_engine_create of that config; its statuses. */
pkv_status llama_kv_engine(const llama_config *c, uint32_t block_tokens, pkv_dtype dt,
                           uint32_t threads, pkv_engine **out);

/* The engine's RoPE for model c (docs/rope.md): lc [c->n_layers] is filled with llama2.c's
 * rotation (PKV_ROPE_NORM, theta 10000, every dim of a head) and set as cfg's
 * layer_cfg, keeping any window, sinks or soft-cap already in lc. The generator then
 * sets its llama_state's rope_in_attn: the engine turns each key at its position, and
 * llama_kv_attn the queries (pkv_rope_q), at the positions the cache holds them - so a
 * context shift (pkv_session_discard) needs nothing more from the model. */
void llama_kv_rope(const llama_config *c, pkv_layer_config *lc, pkv_config *cfg);

/* A llama_kv for model c on engine e, rows as above, in decode mode. */
llama_kv llama_kv_init(pkv_engine *e, const llama_config *c, pkv_session **rows);

/* The llama_attn_fn (ctx: a llama_kv): q [n][n_heads][hs], k, v [n][n_kv_heads][hs],
 * out [n][n_heads][hs]. A row's position is where its session stores it (its length
 * before the row); q is rotated there in place (pkv_rope_q: nothing on an engine
 * without rope). Returns the first failing library status, with kv->failed naming the
 * call. */
pkv_status llama_kv_attn(void *ctx, uint32_t layer, uint32_t n, float *q, const float *k,
                         const float *v, float *out);

#endif

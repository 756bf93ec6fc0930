/*
 * llama.h - the tiny Llama-architecture transformer of `pagedkv generate`: weights
 * (a llama2.c checkpoint or seeded synthetic ones), the forward pass, and sampling.
 *
 * Owns: the model's weights and configuration, its activation buffers, the math of
 * one forward pass over a batch of rows (RMSNorm, interleaved RoPE - here, or by the
 * cache when llama_state.rope_in_attn says so -, attention through
 * a caller-supplied function, SwiGLU feed-forward, classifier), the sampler.
 * Does not own: any KV cache. Attention is a callback (llama_attn_fn): the generator
 * passes llama_kv_attn (llama_kv.h: pkv_prefill / pkv_append + pkv_decode), the dense
 * checker passes pkv_causal_attention, so the two paths share every other operation
 * bit for bit.
 *
 * Numerics follow llama2.c's run.c: float everywhere, every dot product summed in
 * index order j = 0..n-1 (no reassociation, so a row's result does not depend on
 * how many rows are in the batch), rmsnorm eps 1e-5, RoPE base 10000 with the
 * angle pos * base^(-2i/head_size) rotating adjacent pairs (2i, 2i+1) of each head.
 */
#ifndef PKV_TOOLS_LLAMA_H
#define PKV_TOOLS_LLAMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pagedkv.h"

typedef struct {
    uint32_t dim;         /* d_model = n_heads * head_size */
    uint32_t hidden_dim;  /* feed-forward width */
    uint32_t n_layers;
    uint32_t n_heads;     /* query heads */
    uint32_t n_kv_heads;  /* KV groups; n_heads % n_kv_heads == 0 */
    uint32_t vocab_size;
    uint32_t seq_len;     /* positions the model was trained for */
    uint32_t head_size;   /* dim / n_heads, even (RoPE rotates pairs) */
    uint32_t kv_dim;      /* n_kv_heads * head_size */
    bool shared_classifier; /* logits use token_embedding (llama2.c: vocab_size > 0) */
} llama_config;

/* Pointers into llama_model.data. Matrices are row-major [out][in]. */
typedef struct {
    const float *token_embedding; /* [vocab][dim] */
    const float *rms_att;         /* [L][dim] */
    const float *wq;              /* [L][dim][dim]       (n_heads * hs rows) */
    const float *wk;              /* [L][kv_dim][dim] */
    const float *wv;              /* [L][kv_dim][dim] */
    const float *wo;              /* [L][dim][dim] */
    const float *rms_ffn;         /* [L][dim] */
    const float *w1;              /* [L][hidden][dim]    gate */
    const float *w2;              /* [L][dim][hidden]    down */
    const float *w3;              /* [L][hidden][dim]    up */
    const float *rms_final;       /* [dim] */
    const float *wcls;            /* [vocab][dim] (== token_embedding when shared) */
} llama_weights;

typedef struct {
    llama_config cfg;
    llama_weights w;
    float *data;       /* owns every weight */
    size_t n_floats;   /* floats in data */
} llama_model;

/* Load a llama2.c "version 0" checkpoint. The header is validated (positive sizes,
 * dim % n_heads == 0, even head size, n_heads % n_kv_heads == 0, sane bounds) and the
 * file size must equal exactly what the header implies before any weight is read;
 * every weight must be finite. On failure err holds a message naming the file and the
 * problem, *m is empty, and the status is PKV_EIO, PKV_ECORRUPT or PKV_ENOMEM. */
pkv_status llama_load(llama_model *m, const char *path, char *err, size_t errlen);
/* The built-in model: weights drawn from a seeded generator (no file needed). */
void llama_synthetic_config(llama_config *c);
pkv_status llama_synthetic(llama_model *m, uint64_t seed);
void llama_free(llama_model *m);   /* safe on an empty or failed model */
/* Parameters (floats) excluding the legacy RoPE tables. */
uint64_t llama_param_count(const llama_config *c);

/* Activations for up to max_rows rows (tokens) at once. Shapes are per row. */
typedef struct {
    uint32_t max_rows;
    float *x;     /* [rows][dim]    residual stream */
    float *xb;    /* [rows][dim]    normalized input of a sublayer */
    float *xb2;   /* [rows][dim]    sublayer output before the residual add */
    float *q;     /* [rows][dim]    queries after RoPE, [n_heads][hs] per row */
    float *k;     /* [rows][kv_dim] keys after RoPE, [n_kv_heads][hs] per row */
    float *v;     /* [rows][kv_dim] values */
    float *att;   /* [rows][dim]    attention output, heads concatenated */
    float *hb;    /* [rows][hidden] gate, then silu(gate) * up */
    float *hb2;   /* [rows][hidden] up */
    float *rope_freq; /* [hs/2] base^(-2i/hs) */
    /* The attention callback rotates q and k itself (an engine whose layers have rope:
     * llama_kv_rope); llama_forward then hands them over as the projections gave
     * them. false (llama_state_init's default): llama_forward rotates them first. */
    bool rope_in_attn;
} llama_state;

pkv_status llama_state_init(llama_state *s, const llama_config *c, uint32_t max_rows);
void llama_state_free(llama_state *s);

/* Attention of one layer for n rows: q [n][n_heads][hs], k, v [n][n_kv_heads][hs],
 * out [n][n_heads][hs]. What "the cache" is belongs to the callee. q is the forward
 * pass's own buffer, which the callee may rotate in place (llama_kv_attn does, with
 * the engine's RoPE). */
typedef pkv_status (*llama_attn_fn)(void *ctx, uint32_t layer, uint32_t n, float *q,
                                    const float *k, const float *v, float *out);

/* Forward n rows (tokens[r] at position pos[r]) through every layer; the logits of
 * rows first_logit..n-1 go to logits[(r - first_logit) * vocab]. Returns the first
 * failure of attn (or PKV_EINVAL for a bad token or n out of range). Never
 * allocates. */
pkv_status llama_forward(const llama_model *m, llama_state *s, uint32_t n,
                         const uint32_t *tokens, const uint32_t *pos, llama_attn_fn attn,
                         void *attn_ctx, uint32_t first_logit, float *logits);

/* ---- sampling ------------------------------------------------------------------ */

/* xorshift64*: the explicit-seed generator of the sampler. */
typedef struct { uint64_t s; } llama_rng;
void llama_rng_init(llama_rng *r, uint64_t seed);
float llama_rng_coin(llama_rng *r);    /* uniform in [0, 1), 24-bit resolution */

typedef struct {
    uint32_t vocab;
    float temperature;   /* 0 = greedy (argmax, lowest id on ties) */
    float topp;          /* nucleus mass; <= 0 or >= 1 samples the full distribution */
    float *prob;         /* [vocab] scratch */
    uint32_t *idx;       /* [vocab] scratch */
} llama_sampler;

pkv_status llama_sampler_init(llama_sampler *s, uint32_t vocab, float temperature,
                              float topp);
void llama_sampler_free(llama_sampler *s);
/* The token for these logits and this coin (a llama_rng_coin draw; unused when
 * greedy). Deterministic in (logits, coin); never allocates; logits unchanged. */
uint32_t llama_sample(llama_sampler *s, const float *logits, float coin);

#endif

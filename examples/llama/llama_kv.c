/*
 * llama_kv.c - see llama_kv.h: the tiny Llama's attention through pagedkv.
 *
 * Invariant: after a decode step every session of kv->rows holds one more position
 * in `layer`; after a prompt, rows[0] holds n more. A failure changes no session
 * (the library's rule), except that the appends of earlier rows of the same step
 * stay: the caller ends the run then.
 */
#include "llama_kv.h"

pkv_config llama_kv_config(const llama_config *c, uint32_t block_tokens, pkv_dtype dt,
                           uint32_t threads)
{
    pkv_config cfg = pkv_config_default();
    cfg.n_layers = c->n_layers;
    cfg.n_heads = c->n_heads;
    cfg.n_kv_heads = c->n_kv_heads;
    cfg.head_dim = c->head_size;
    cfg.block_tokens = block_tokens;
    cfg.kv_dtype = dt;
    cfg.n_threads = threads;
    return cfg;
}

pkv_status llama_kv_engine(const llama_config *c, uint32_t block_tokens, pkv_dtype dt,
                           uint32_t threads, pkv_engine **out)
{
    const pkv_config cfg = llama_kv_config(c, block_tokens, dt, threads);
    return pkv_engine_create(&cfg, out);
}

void llama_kv_rope(const llama_config *c, pkv_layer_config *lc, pkv_config *cfg)
{
    for (uint32_t l = 0; l < c->n_layers; l++) {
        lc[l].rope = PKV_ROPE_NORM;   /* llama2.c rotates adjacent pairs */
        lc[l].rope_dims = c->head_size;
        lc[l].rope_theta = 10000.0f;
        lc[l].rope_freq_scale = 1.0f;
    }
    cfg->layer_cfg = lc;
}

llama_kv llama_kv_init(pkv_engine *e, const llama_config *c, pkv_session **rows)
{
    pkv_config cfg; /* q rows as wide as the engine's heads (a rank's share of them) */
    const uint32_t q_dim = pkv_engine_config(e, &cfg) == PKV_OK ? cfg.n_heads * cfg.head_dim
                                                                : c->dim;
    return (llama_kv){.eng = e, .kv_dim = c->kv_dim, .q_dim = q_dim, .rows = rows};
}

static pkv_status failed(llama_kv *kv, const char *call, uint32_t layer, pkv_status st)
{
    kv->failed = call;
    kv->failed_layer = layer;
    return st;
}

pkv_status llama_kv_attn(void *ctx, uint32_t layer, uint32_t n, float *q, const float *k,
                         const float *v, float *out)
{
    llama_kv *kv = ctx;
    const size_t kv_dim = kv->kv_dim, q_dim = kv->q_dim;
    pkv_status st;

    /* drafts: n tokens of one session as a tree, pending until the caller commits */
    if (kv->tree) {
        /* draft r's query turns at len + depth(r), where the engine turns its key */
        const uint64_t p0 = pkv_session_len(kv->rows[0], layer);
        for (uint32_t r = 0; r < n; r++) {
            uint64_t p = p0;
            for (int32_t a = kv->tree[r]; a >= 0; a = kv->tree[a])
                p++;
            if ((st = pkv_rope_q(kv->eng, layer, 1, &p, q + r * q_dim)) != PKV_OK)
                return failed(kv, "pkv_rope_q", layer, st);
        }
        st = pkv_verify(kv->rows[0], layer, n, kv->tree, q, k, v, out);
        return st == PKV_OK ? st : failed(kv, "pkv_verify", layer, st);
    }
    /* a prompt: n positions of one session, attended causally in one call */
    if (kv->prefill) {
        const uint64_t p0 = pkv_session_len(kv->rows[0], layer);
        for (uint32_t r = 0; r < n; r++) {  /* queries turned where their keys land */
            const uint64_t p = p0 + r;
            if ((st = pkv_rope_q(kv->eng, layer, 1, &p, q + r * q_dim)) != PKV_OK)
                return failed(kv, "pkv_rope_q", layer, st);
        }
        st = pkv_prefill(kv->rows[0], layer, n, q, k, v, out);
        return st == PKV_OK ? st : failed(kv, "pkv_prefill", layer, st);
    }
    /* a step: each row's new K/V into its session, then its query over the cache */
    for (uint32_t r = 0; r < n; r++) {
        const uint64_t p = pkv_session_len(kv->rows[r], layer);
        if ((st = pkv_rope_q(kv->eng, layer, 1, &p, q + r * q_dim)) != PKV_OK)
            return failed(kv, "pkv_rope_q", layer, st);
        if ((st = pkv_append(kv->rows[r], layer, k + r * kv_dim, v + r * kv_dim)) != PKV_OK)
            return failed(kv, "pkv_append", layer, st);
    }
    st = n == 1 ? pkv_decode(kv->rows[0], layer, q, out)
                : pkv_decode_batch(kv->eng, layer, n, kv->rows, q, out);
    return st == PKV_OK ? st : failed(kv, n == 1 ? "pkv_decode" : "pkv_decode_batch", layer,
                                      st);
}

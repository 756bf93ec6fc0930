/*
 * generate/speculate.c - `pagedkv generate --speculate K [--tree]`
 * (docs/speculative.md): speculative decoding with a drafter that needs no second
 * model. Prompt lookup proposes the continuation of the longest earlier n-gram match
 * of the text's last tokens (--tree: several matches' continuations, merged into a
 * tree by their common prefixes); one forward runs the newest token and every draft
 * through pkv_verify (examples/llama/llama_kv.c), and the drafts the model agrees with
 * are kept by pkv_session_commit.
 *
 * Owns the drafter, the accept loop and the speculation figures. The text is the text
 * of plain generation, byte for byte and for any temperature: a verify gives each
 * draft the logits a token-by-token decode gives (bitwise), and each sampled token
 * takes the next coin of the session's stream exactly as the plain loop does - a draft
 * is accepted when it is the token the sampler picks from its parent's logits, and
 * the first token it does not match is the next step's root.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "generate/generate.h"

/* Longest n-gram (of the text's last tokens) the drafter looks for. */
#define SPEC_NGRAM 3u

/* Up to `want` earlier continuations of the longest suffix of t[0..n) that occurred
 * before: cand[c][0..len[c]), at most `max_c` of them (most recent match first, the
 * longest n-gram first, no two alike). Returns how many. */
static uint32_t propose(const uint32_t *t, uint32_t n, uint32_t want, uint32_t max_c,
                        uint32_t *cand, uint32_t *len)
{
    uint32_t nc = 0;
    for (uint32_t g = n < SPEC_NGRAM ? n : SPEC_NGRAM; g >= 1 && nc < max_c; g--) {
        const uint32_t *suf = t + n - g;
        for (uint32_t i = n - g; i-- > 0 && nc < max_c;) {
            if (memcmp(t + i, suf, g * sizeof *t) != 0)
                continue;
            uint32_t m = 0, *c = cand + (size_t)nc * want;
            while (m < want && i + g + m < n)
                c[m] = t[i + g + m], m++;
            bool dup = m == 0;
            for (uint32_t k = 0; k < nc && !dup; k++)
                dup = len[k] >= m && memcmp(cand + (size_t)k * want, c, m * sizeof *c) == 0;
            if (!dup)
                len[nc++] = m;
        }
    }
    return nc;
}

/* The step's tree: node 0 the newest token (parent -1), then the candidates merged
 * by common prefixes, parents before children, at most max_depth below the root.
 * Returns the node count. */
static uint32_t build_tree(const uint32_t *cand, const uint32_t *len, uint32_t nc,
                           uint32_t want, uint32_t root_tok, uint32_t max_depth,
                           uint32_t *tok, int32_t *parent, uint32_t *depth)
{
    uint32_t n = 1;
    tok[0] = root_tok;
    parent[0] = -1;
    depth[0] = 0;
    for (uint32_t c = 0; c < nc; c++) {
        uint32_t cur = 0;
        for (uint32_t j = 0; j < len[c] && depth[cur] < max_depth; j++) {
            const uint32_t want_tok = cand[(size_t)c * want + j];
            uint32_t child = 0;
            for (uint32_t k = cur + 1; k < n && !child; k++)
                if (parent[k] == (int32_t)cur && tok[k] == want_tok)
                    child = k;
            if (!child) {
                child = n++;
                tok[child] = want_tok;
                parent[child] = (int32_t)cur;
                depth[child] = depth[cur] + 1;
            }
            cur = child;
        }
    }
    return n;
}

typedef struct {
    gen *g;
    llama_attn_fn attn;
    double secs;            /* inside attention */
} timed;

static pkv_status timed_attn(void *ctx, uint32_t layer, uint32_t n, float *q,
                             const float *k, const float *v, float *out)
{
    timed *x = ctx;
    const double t0 = cli_now();
    const pkv_status st = x->attn(x->g, layer, n, q, k, v, out);
    x->secs += cli_now() - t0;
    return st;
}

int gen_speculate(gen *g, llama_attn_fn attn, bool stream)
{
    const uint32_t K = g->o->speculate, V = g->c->vocab_size, P = g->P;
    const uint32_t B = g->o->tree ? GEN_SPEC_BRANCHES : 1, max_nodes = 1 + K * B;
    gen_spec *x = &g->spec;
    uint32_t *cand = calloc((size_t)B * K, sizeof *cand), len[GEN_SPEC_BRANCHES];
    uint32_t *tok = calloc(max_nodes, sizeof *tok), *depth = calloc(max_nodes, sizeof *depth);
    uint32_t *path = calloc(max_nodes, sizeof *path);
    int32_t *parent = calloc(max_nodes, sizeof *parent);
    if (!cand || !tok || !depth || !path || !parent) {
        free(cand), free(tok), free(depth), free(path), free(parent);
        return cli_fail("generate", "out of memory");
    }
    uint32_t *t = g->tok;
    timed tm = {g, attn, 0};
    int rc = CLI_OK;
    const double t0 = cli_now();
    /* ntok[0] == len + 1: the newest token is sampled, not yet forwarded */
    while (g->ntok[0] - 1 < g->steps && !gen_stops(g, t[g->ntok[0] - 1])) {
        const uint32_t pos = g->ntok[0] - 1;
        const uint32_t nc = propose(t, g->ntok[0], K, B, cand, len);
        const uint32_t room = g->steps - 1 - pos; /* drafts may sit up to steps - 1 */
        const uint32_t n = build_tree(cand, len, nc, K, t[pos], room < K ? room : K, tok,
                                      parent, depth);
        for (uint32_t r = 0; r < n; r++)
            g->row_pos[r] = pos + depth[r];
        g->mode = MODE_VERIFY;
        g->cur_pos = pos;
        g->act_sess[0] = g->sess[0];
        g->kv.tree = parent;
        const pkv_status st = llama_forward(&g->model, &g->st, n, tok, g->row_pos, timed_attn,
                                            &tm, 0, g->logits);
        g->kv.tree = NULL;
        if (st != PKV_OK) {
            rc = cli_fail("generate", "%s", g->err[0] ? g->err : pkv_status_str(st));
            break;
        }
        /* follow the sampler: a draft is kept while it is the token sampled from its
         * parent's logits; the first token no draft matches ends the step */
        uint32_t node = 0, m = 0;
        for (;;) {
            path[m++] = node;
            const bool more = gen_take(g, 0, pos + depth[node] + 1 - P, g->logits +
                                                                       (size_t)node * V);
            const uint32_t y = t[g->ntok[0] - 1];
            uint32_t child = 0;
            for (uint32_t k = node + 1; more && k < n && !child; k++)
                if (parent[k] == (int32_t)node && tok[k] == y)
                    child = k;
            if (!child)
                break;
            node = child;
        }
        const pkv_status cs = pkv_session_commit(g->sess[0], m, path);
        if (cs != PKV_OK) {
            rc = cli_fail("generate", "pkv_session_commit: %s", pkv_status_str(cs));
            break;
        }
        x->steps++;
        x->proposed += n - 1;
        x->accepted += m - 1;
        if (stream) {
            gen_emit_range(g, 0, g->ntok[0] - m, g->ntok[0]);
            fflush(stdout);
        }
    }
    g->t_decode = cli_now() - t0;
    x->attn_secs = tm.secs;
    free(cand), free(tok), free(depth), free(path), free(parent);
    return rc;
}

void gen_speculate_report(const gen *g, json_writer *W)
{
    const gen_spec *x = &g->spec;
    if (!g->o->speculate)
        return;
    const uint64_t calls = x->steps * g->c->n_layers;
    /* tokens the steps produced: each step's kept drafts and the token after them */
    const uint64_t produced = x->accepted + x->steps;
    const double per_tok = produced ? x->attn_secs / (double)produced : 0;
    if (W) {
        json_open(W, "speculate", '{');
        JSON_U64S(W, {"k", g->o->speculate}, {"branches", g->o->tree ? GEN_SPEC_BRANCHES : 1},
                  {"steps", x->steps}, {"verify_calls", calls},
                  {"drafts_proposed", x->proposed}, {"drafts_accepted", x->accepted});
        json_fmt(W, "attention_seconds", "%.6f", x->attn_secs);
        json_fmt(W, "attention_seconds_per_token", "%.9f", per_tok);
        json_close(W, '}');
        return;
    }
    fprintf(stderr, "speculate: K %u%s, %llu steps (%llu pkv_verify calls): %llu drafts "
                    "proposed, %llu accepted (%.1f%%), %.2f tokens a step; attention %.3f ms, "
                    "%.1f us per token\n", g->o->speculate, g->o->tree ? " as a tree" : "",
            (unsigned long long)x->steps, (unsigned long long)calls,
            (unsigned long long)x->proposed, (unsigned long long)x->accepted,
            x->proposed ? 100.0 * (double)x->accepted / (double)x->proposed : 0.0,
            x->steps ? (double)produced / (double)x->steps : 0.0, x->attn_secs * 1e3,
            per_tok * 1e6);
}

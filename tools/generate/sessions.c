/*
 * generate/sessions.c - `pagedkv generate --sessions N --prefix-cache` (docs/prefix-cache.md):
 * sessions 1..N-1 are not forks of session 0 but requests of their own, as a server
 * sees them: each asks the prefix cache for the prompt (pkv_session_from_prefix) and
 * runs the model only over the positions the cache did not have (at least the last
 * one). Session 0 records the prompt's ids (pkv_session_set_tokens) after its
 * prefill. Owns those sessions' setup, their first logits and the prefix report.
 *
 * The text must not change: every session samples from the logits of its own
 * forward, which are compared with session 0's bit for bit (logits_identical).
 *
 * Also `--context-shift` (docs/rope.md): what a session does when its cache is full,
 * and `--save`: session 0 to a file for `pagedkv inspect`.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "generate/generate.h"

#define CMD "generate"

int gen_prefix_sessions(gen *g, llama_attn_fn attn, bool sample_first)
{
    const uint32_t N = g->N, P = g->P, V = g->c->vocab_size;
    gen_prefix *x = &g->pfx;
    x->on = true;
    x->t_cold = g->t_prefill;
    x->logits = calloc((size_t)N * V, sizeof *x->logits);
    int32_t *ids = malloc((size_t)P * sizeof *ids);
    if (!x->logits || !ids) {
        free(ids);
        return cli_fail("generate", "out of memory");
    }
    for (uint32_t i = 0; i < P; i++)
        ids[i] = (int32_t)g->prompt[i];
    pkv_status st = pkv_session_set_tokens(g->sess[0], P, ids);
    if (st != PKV_OK) {
        free(ids);
        return cli_fail("generate", "pkv_session_set_tokens: %s", pkv_status_str(st));
    }
    x->identical = true;
    for (uint32_t s = 1; s < N; s++) {
        const double t0 = cli_now();
        uint64_t have = 0;
        st = pkv_session_from_prefix(g->eng, P, ids, &g->sess[s], &have);
        if (st != PKV_OK) {
            free(ids);
            return cli_fail("generate", "pkv_session_from_prefix: %s", pkv_status_str(st));
        }
        const uint32_t tail = P - (uint32_t)have;   /* >= 1: at most P - 1 are shared */
        for (uint32_t r = 0; r < tail; r++)
            g->row_pos[r] = (uint32_t)have + r;
        g->mode = MODE_PREFILL;
        g->act_sess[0] = g->sess[s];
        float *out = x->logits + (size_t)s * V;
        st = llama_forward(&g->model, &g->st, tail, g->prompt + have, g->row_pos, attn, g,
                           sample_first ? tail - 1 : tail, out);
        if (st != PKV_OK) {
            free(ids);
            return cli_fail("generate", "session %u's prompt tail: %s", s,
                            g->err[0] ? g->err : pkv_status_str(st));
        }
        x->t_tail += cli_now() - t0;
        x->hits += have > 0;
        x->reused += have;
        x->computed += tail;
        if (sample_first && memcmp(out, g->logits, (size_t)V * sizeof *out) != 0)
            x->identical = false;
    }
    free(ids);
    return CLI_OK;
}

const float *gen_first_logits(const gen *g, uint32_t s)
{
    return g->pfx.on && s > 0 ? g->pfx.logits + (size_t)s * g->c->vocab_size : g->logits;
}

void gen_prefix_report(const gen *g, json_writer *W)
{
    const gen_prefix *x = &g->pfx;
    if (!x->on)
        return;
    const uint32_t later = g->N - 1;
    /* what the later sessions would have cost cold: session 0's prefill each; a saving
     * is claimed only where something was reused */
    const double cold = x->t_cold * later, saved = cold - x->t_tail;
    pkv_stats es;
    pkv_config cfg;
    pkv_engine_stats(g->eng, &es);
    const uint32_t bt = pkv_engine_config(g->eng, &cfg) == PKV_OK ? cfg.block_tokens : 0;
    /* the cache shares whole pages of at most P - 1 positions: a prompt of one page or
     * less can never hit */
    const bool short_prompt = bt && g->P <= bt;
    if (W) {
        json_open(W, "prefix_cache", '{');
        json_u64(W, "lookups", es.prefix_lookups);
        json_u64(W, "hits", x->hits);
        json_u64(W, "tokens_reused", x->reused);
        json_u64(W, "tokens_prefilled", x->computed);
        json_fmt(W, "prefill_seconds_cold", "%.6f", cold);
        json_fmt(W, "prefill_seconds", "%.6f", x->t_tail);
        if (x->hits)
            json_fmt(W, "prefill_seconds_saved", "%.6f", saved);
        else
            json_str(W, "prefill_seconds_saved", NULL);
        json_bool(W, "prompt_within_one_page", short_prompt);
        json_bool(W, "logits_identical", x->identical);
        json_close(W, '}');
        return;
    }
    if (!x->hits) {
        fprintf(stderr, "prefix cache: none of %u later session(s) hit: nothing reused, no "
                        "prefill saved; first logits %s session 0's\n", later,
                x->identical ? "bitwise equal to" : "DIFFERENT from");
        if (short_prompt)
            fprintf(stderr, "prefix cache: the prompt's %u positions (BOS included) fit in "
                            "one page of %u tokens: the cache shares whole pages and leaves "
                            "the last position to the model, so a prompt needs more than %u "
                            "positions to be reused (a longer -i, or --block-tokens)\n",
                    g->P, bt, bt);
        return;
    }
    fprintf(stderr, "prefix cache: %u of %u later session(s) hit, %llu prompt tokens reused, "
                    "%llu prefilled; their prefill %.3f ms instead of %.3f ms (%s %.3f ms); "
                    "first logits %s session 0's\n", x->hits, later,
            (unsigned long long)x->reused, (unsigned long long)x->computed, x->t_tail * 1e3,
            cold * 1e3, saved >= 0 ? "saved" : "lost", fabs(saved) * 1e3,
            x->identical ? "bitwise equal to" : "DIFFERENT from");
}

/* --context-shift: a session whose cache is full (the model's seq_len) keeps its first
 * --keep positions and drops half of the rest, as llama.cpp does; its next token goes
 * where the cache ends (llama_kv_attn reads positions from the cache). */
int gen_context_shift(gen *g, uint32_t n)
{
    const uint32_t ctx = g->c->seq_len, keep = g->o->keep;
    for (uint32_t r = 0; r < n; r++) {
        pkv_session *s = g->act_sess[r];
        const uint64_t len = pkv_session_len(s, 0);
        if (len < ctx)
            continue;
        const uint64_t drop = (len - keep) / 2;
        const pkv_status st = pkv_session_discard(s, keep, keep + drop);
        if (st != PKV_OK) {
            char why[256];
            pkv_engine_last_error(g->eng, why, sizeof why);
            return cli_fail(CMD, "context shift of session %u: %s", g->act[r], why);
        }
        g->shifts++;
    }
    return CLI_OK;
}

/* --save: session 0 to its file, its forwarded token ids recorded first (a
 * version-3 file, whose prefix `inspect` reports). A window releases pages: then the
 * ids are not recorded (pkv_session_set_tokens would refuse nothing, but a windowed
 * session's file is about its pages). */
int gen_save(gen *g)
{
    const char *path = g->o->save_path;
    pkv_session *s = g->sess[0];
    const uint64_t n = pkv_session_len(s, 0);
    pkv_status st = PKV_OK;
    if (!g->o->v.window && n > 0) {
        int32_t *ids = malloc((size_t)n * sizeof *ids);
        if (!ids)
            return cli_fail(CMD, "out of memory");
        for (uint64_t i = 0; i < n; i++)
            ids[i] = (int32_t)g->tok[i];
        st = pkv_session_set_tokens(s, n, ids);
        free(ids);
    }
    if (st == PKV_OK)
        st = pkv_session_save(s, path);
    if (st != PKV_OK) {
        char why[256] = "";
        pkv_engine_last_error(g->eng, why, sizeof why);
        return cli_fail(CMD, "cannot save session 0 to '%s': %s%s%s", path,
                        pkv_status_str(st), why[0] ? ": " : "", why);
    }
    if (!g->o->json)
        fprintf(stderr, "session 0 (%llu positions) saved to %s: `pagedkv inspect %s` "
                        "reads it\n", (unsigned long long)n, path, path);
    return CLI_OK;
}

/*
 * generate/report.c - the report of `pagedkv generate`: cache memory per session, the
 * engine's pages, prefill and decode rates and the check results, as text on stderr or,
 * with --json, as one JSON object on stdout (with every session's tokens and text).
 *
 * Owns: the text and JSON reports, why each session stopped (BOS, -n, the model's
 * seq_len, a prompt that -n cut short), on stderr in text mode and as stop_reason in
 * JSON. Does not own: the run (generate/generate.c fills the gen of generate.h), the
 * generated text printed during the run, the JSON escaping (json.c), anything in the
 * library.
 *
 * Invariants
 *   - Reporting changes nothing: it reads the gen and the engine's and sessions'
 *     figures.
 *   - A session's JSON text is what stdout shows (a final BOS that stopped it left
 *     out), assembled whole before escaping, so a character spelled by several
 *     byte-fallback tokens arrives as one UTF-8 sequence.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "generate/generate.h"
#include "common/json.h"
#include "llama.h"
#include "tokenizer.h"

#define CMD "generate"

static const char *const stop_names[] = {"steps", "seq_len", "bos", "prompt"};

/* Session s's text as the stdout output has it (the final BOS left out), assembled
 * whole so that a character spelled by several byte tokens stays one UTF-8 sequence;
 * malloc'ed (the report is not the token loop), NULL when out of memory. */
static char *session_text(const gen *g, uint32_t s, size_t *len)
{
    const uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
    size_t cap = 1;
    for (uint32_t i = 1; i < g->ntok[s]; i++)
        cap += g->tk.piece_len[t[i] < g->tk.vocab_size ? t[i] : 0] + 1;
    char *buf = malloc(cap);
    *len = 0;
    for (uint32_t i = 1; buf && i < g->ntok[s]; i++) {
        if (i >= g->P && gen_stops(g, t[i]))
            continue;
        const char *p;
        size_t n;
        tokenizer_decode(&g->tk, t[i - 1], t[i], &p, &n);
        memcpy(buf + *len, p, n);
        *len += n;
    }
    return buf;
}

/* Most pages one layer of session s holds (a window bounds it). */
static uint64_t max_layer_pages(const gen *g, uint32_t s)
{
    uint64_t most = 0;
    for (uint32_t l = 0; l < g->c->n_layers; l++) {
        uint64_t n = cli_layer_pages_held(g->sess[s], l);
        most = n != UINT64_MAX && n > most ? n : most;
    }
    return most;
}

static int json_session(const gen *g, json_writer *W, uint32_t s, const pkv_memory *m)
{
    const uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
    const gen_stop why = gen_stop_reason(g, s);
    json_open(W, NULL, '{');
    json_u64(W, "id", s);
    json_u64(W, "positions", pkv_session_len(g->sess[s], 0));
    json_bool(W, "stopped_on_bos", why == GEN_STOP_BOS);
    json_str(W, "stop_reason", stop_names[why]);
    json_open(W, "tokens", '[');
    for (uint32_t i = 0; i < g->ntok[s]; i++)
        json_u64(W, NULL, t[i]);
    json_close(W, ']');
    json_open(W, "generated", '[');
    for (uint32_t i = g->P; i < g->ntok[s] && g->n_prompt <= g->steps; i++)
        json_u64(W, NULL, t[i]);
    json_close(W, ']');
    if (g->o->check_e2e && g->n_prompt <= g->steps) {
        json_open(W, "dense_generated", '[');
        for (uint32_t k = 0; k + g->P < g->ntok[s]; k++)
            json_u64(W, NULL, g->dense_tok[(size_t)s * g->gen_cap + k]);
        json_close(W, ']');
    }
    if (g->have_tok) {
        size_t n;
        char *text = session_text(g, s, &n);
        if (!text)
            return cli_fail(CMD, "out of memory for the JSON text");
        json_str_begin(W, "text");
        json_str_part(W, text, n);
        json_str_end(W);
        free(text);
    }
    json_open(W, "memory", '{');
    JSON_U64S(W, {"tokens", m->tokens}, {"blocks", m->blocks},
              {"bytes_resident", m->bytes_resident}, {"bytes_shared", m->bytes_shared},
              {"bytes_ideal", m->bytes_ideal}, {"bytes_overhead", m->bytes_overhead},
              {"bytes_spilled", m->bytes_spilled},
              {"pages_held_max_layer", max_layer_pages(g, s)});
    json_close(W, '}');
    json_close(W, '}');
    return CLI_OK;
}

/* Why session s stopped, in words, for stderr. */
static void say_stop(const gen *g, uint32_t s)
{
    const char *who = g->N > 1 ? "session " : "";
    char id[16] = "";
    if (g->N > 1)
        snprintf(id, sizeof id, "%u ", s);
    switch (gen_stop_reason(g, s)) {
    case GEN_STOP_BOS:
        fprintf(stderr, "%s%sstopped: the model emitted BOS (end of text) after %u "
                        "generated token(s)\n", who, id, g->ntok[s] - g->P - 1);
        break;
    case GEN_STOP_PROMPT:
        fprintf(stderr, "%s%sstopped: -n %u ended inside the prompt; nothing generated\n",
                who, id, g->steps);
        break;
    case GEN_STOP_SEQ_LEN:
        fprintf(stderr, "%s%sstopped: the model's seq_len, %u positions, reached\n", who,
                id, g->steps);
        break;
    case GEN_STOP_STEPS:
        fprintf(stderr, "%s%sstopped: -n %u positions reached\n", who, id, g->steps);
        break;
    }
}

int gen_report(gen *g)
{
    const gen_opts *o = g->o;
    const llama_config *c = g->c;
    pkv_config cfg;
    pkv_stats es;
    pkv_status st = pkv_engine_config(g->eng, &cfg);
    if (st == PKV_OK)
        st = pkv_engine_stats(g->eng, &es);
    if (st != PKV_OK)
        return cli_fail(CMD, "engine figures: %s", pkv_status_str(st));
    uint64_t decoded = g->n_generated - (g->n_prompt <= g->steps ? g->N : 0);
    double tps = g->t_decode > 0 ? (double)decoded / g->t_decode : 0.0;
    double pps = g->t_prefill > 0 ? (double)g->P / g->t_prefill : 0.0;
    uint64_t sum_resident = 0;
    char b1[32], b2[32], b3[32], b4[32];

    json_writer w = {stdout, true, true}, *W = &w;
    if (o->json) {
        json_open(W, NULL, '{');
        cli_json_envelope(W, CMD, es.isa);
        json_open(W, "model", '{');
        json_str(W, "source", o->model_path ? o->model_path : "synthetic");
        JSON_U64S(W, {"dim", c->dim}, {"hidden_dim", c->hidden_dim}, {"layers", c->n_layers},
                  {"heads", c->n_heads}, {"kv_heads", c->n_kv_heads},
                  {"head_dim", c->head_size}, {"vocab", c->vocab_size},
                  {"seq_len", c->seq_len}, {"params", llama_param_count(c)});
        json_close(W, '}');
        json_open(W, "cache", '{');
        json_str(W, "dtype", pkv_dtype_name(cfg.kv_dtype));
        JSON_U64S(W, {"block_tokens", cfg.block_tokens}, {"page_bytes", es.page_bytes},
                  {"threads", cfg.n_threads});
        JSON_U64S(W, {"window", o->v.window}, {"sinks", o->v.sinks},
                  {"rollback", o->v.rollback});
        json_num(W, "softcap", o->v.softcap);
        if (o->v.window)
            json_u64(W, "page_ceiling", cli_variant_page_ceiling(&o->v, cfg.block_tokens));
        else
            json_str(W, "page_ceiling", NULL);
        json_close(W, '}');
        json_u64(W, "steps", g->steps);
        json_u64(W, "context_shifts", g->shifts);
        json_fmt(W, "temperature", "%g", o->temperature);
        json_fmt(W, "top_p", "%g", o->topp);
        json_u64(W, "seed", o->seed);
        json_open(W, "prompt_tokens", '[');
        for (uint32_t i = 0; i < g->n_prompt; i++)
            json_u64(W, NULL, g->prompt[i]);
        json_close(W, ']');
        json_open(W, "sessions", '[');
    }
    for (uint32_t s = 0; s < g->N; s++) {
        pkv_memory m;
        if ((st = pkv_session_memory(g->sess[s], &m)) != PKV_OK)
            return cli_fail(CMD, "pkv_session_memory: %s", pkv_status_str(st));
        sum_resident += m.bytes_resident;
        if (o->json) {
            if (json_session(g, W, s, &m) != CLI_OK)
                return CLI_FAIL;
        } else {
            if (s == 0)
                fprintf(stderr, "cache memory per session (%s, %u tokens/page, %u layers, "
                                "page %s):\n", pkv_dtype_name(cfg.kv_dtype),
                        cfg.block_tokens, c->n_layers, cli_bytes(es.page_bytes, b1));
            fprintf(stderr, "  session %u: %llu positions, %llu pages: resident %s, "
                            "shared %s, ideal %s, overhead %s\n",
                    s, (unsigned long long)pkv_session_len(g->sess[s], 0),
                    (unsigned long long)m.blocks, cli_bytes(m.bytes_resident, b1),
                    cli_bytes(m.bytes_shared, b2), cli_bytes(m.bytes_ideal, b3),
                    cli_bytes(m.bytes_overhead, b4));
            if (o->v.window)
                fprintf(stderr, "    window %u (sinks %u, rollback %u): at most %llu pages "
                                "held in a layer, page ceiling %llu\n", o->v.window,
                        o->v.sinks, o->v.rollback, (unsigned long long)max_layer_pages(g, s),
                        (unsigned long long)cli_variant_page_ceiling(&o->v,
                                                                     cfg.block_tokens));
        }
    }
    if (!o->json && o->context_shift)
        fprintf(stderr, "context shifts: %llu (each kept %u positions and dropped half of "
                        "the rest of a full %u-position context)\n",
                (unsigned long long)g->shifts, o->keep, c->seq_len);
    uint64_t engine_bytes = es.pages_in_use * es.page_bytes;
    if (o->json) {
        json_close(W, ']');
        json_open(W, "engine", '{');
        JSON_U64S(W, {"pages_in_use", es.pages_in_use}, {"pages_free", es.pages_free},
                  {"bytes_in_use", engine_bytes}, {"sum_session_resident", sum_resident},
                  {"bytes_allocator", es.bytes_allocator},
                  {"pages_read_shared", es.pages_read_shared},
                  {"pages_read_private", es.pages_read_private},
                  {"page_reads_saved", es.page_reads_saved});
        json_close(W, '}');
        json_u64(W, "prompt_positions", g->P);
        json_fmt(W, "prefill_seconds", "%.6f", g->t_prefill);
        json_fmt(W, "prefill_tokens_per_s", "%.1f", pps);
        json_u64(W, "generated_tokens", g->n_generated);
        json_fmt(W, "decode_seconds", "%.6f", g->t_decode);
        json_fmt(W, "tokens_per_s", "%.1f", tps);
        if (o->check) {
            json_open(W, "check", '{');
            json_bool(W, "passed", true);
            json_u64(W, "rows", g->n_checked);
            json_fmt(W, "max_abs_err", "%.3e", g->check_maxerr);
            json_fmt(W, "tolerance_rel_max_v", "%.0e", CHECK_REL);
            json_fmt(W, "worst_fraction_of_tolerance", "%.4f", g->check_worst);
            json_fmt(W, "seconds", "%.3f", g->check_secs);
            json_close(W, '}');
        }
        gen_prefix_report(g, W);
        gen_speculate_report(g, W);
        if (o->check_e2e) {
            json_open(W, "check_e2e", '{');
            json_bool(W, "passed", true);
            json_u64(W, "steps", g->e2e_steps);
            json_fmt(W, "max_logit_diff", "%.3e", g->e2e_maxdiff);
            json_fmt(W, "tolerance", "%.3e", g->e2e_tol);
            json_u64(W, "token_flips", g->e2e_ties);
            json_close(W, '}');
        }
        json_close(W, '}');
        fputc('\n', stdout);
        return CLI_OK;
    }
    if (!o->model_path)
        fprintf(stderr, "model: the built-in synthetic one (random weights): its output is "
                        "token ids, not text; --model and --tokenizer run a real model "
                        "(README.md, \"A real model\")\n");
    else if (!g->have_tok)
        fprintf(stderr, "model: %s without --tokenizer: its output is token ids\n",
                o->model_path);
    for (uint32_t s = 0; s < g->N; s++)
        say_stop(g, s);
    fprintf(stderr, "engine: %llu pages in use = %s for %u session(s) (%s if nothing "
                    "were shared)\n",
            (unsigned long long)es.pages_in_use, cli_bytes(engine_bytes, b1), g->N,
            cli_bytes(sum_resident, b2));
    fprintf(stderr, "prompt: %u positions prefilled in %.3f ms (%.0f tok/s)\n", g->P,
            g->t_prefill * 1e3, pps);
    fprintf(stderr, "generated: %llu tokens, %llu decoded in %.3f s: %.1f tok/s (%s KV, "
                    "%u thread(s), %s kernels%s)\n",
            (unsigned long long)g->n_generated, (unsigned long long)decoded, g->t_decode,
            tps, pkv_dtype_name(cfg.kv_dtype), cfg.n_threads, es.isa,
            o->check ? ", --check time excluded" : "");
    if (es.pages_read_shared)
        fprintf(stderr, "page reads: %llu shared by several queries at once (sparing %llu), "
                        "%llu private\n", (unsigned long long)es.pages_read_shared,
                (unsigned long long)es.page_reads_saved,
                (unsigned long long)es.pages_read_private);
    gen_prefix_report(g, NULL);
    gen_speculate_report(g, NULL);
    if (o->check)
        fprintf(stderr, "check: passed, %llu attention rows vs pkv_attention_reference, max "
                        "|diff| %.3g, worst %.4f of the tolerance (%.0e x max|V|), %.2f s\n",
                (unsigned long long)g->n_checked, g->check_maxerr, g->check_worst,
                CHECK_REL, g->check_secs);
    if (o->check_e2e)
        fprintf(stderr, "check-e2e: passed, %llu steps recomputed without the cache, max "
                        "|logit diff| %.3g (tolerance %.3g), %llu token flip(s) within the error\n",
                (unsigned long long)g->e2e_steps, g->e2e_maxdiff, g->e2e_tol,
                (unsigned long long)g->e2e_ties);
    return CLI_OK;
}

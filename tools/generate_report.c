/*
 * generate_report.c - the report of `pagedkv generate`: cache memory per session, the
 * engine's pages, prefill and decode rates and the check results, as text on stderr or,
 * with --json, as one JSON object on stdout (with every session's tokens and text).
 *
 * Owns: the text and JSON reports, the JSON escaping of token bytes. Does not own: the
 * run (cmd_generate.c fills the gen of generate.h), the generated text printed during
 * the run, anything in the library.
 *
 * Invariants
 *   - Reporting changes nothing: it reads the gen and the engine's and sessions'
 *     figures.
 *   - Text decoded from tokens goes into a JSON string byte by byte: '"' and '\'
 *     escaped, newline as \n, other control bytes and DEL as \u00XX, everything else
 *     (UTF-8 included) as is; a final BOS that stopped a session is left out, as in
 *     the text output.
 */
#include <stdio.h>

#include "cli.h"
#include "generate.h"
#include "llama.h"
#include "tokenizer.h"

#define CMD "generate"

static void json_bytes(FILE *f, const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", f);
        else if (ch < 0x20 || ch == 0x7f)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
}

static void json_session(const gen *g, uint32_t s, const pkv_memory *m)
{
    const uint32_t *t = g->tok + (size_t)s * (g->steps + 1);
    printf("    {\"id\": %u, \"positions\": %llu, \"stopped_on_bos\": %s,\n", s,
           (unsigned long long)pkv_session_len(g->sess[s], 0),
           g->ntok[s] > g->P && gen_stops(g, t[g->ntok[s] - 1]) ? "true" : "false");
    printf("     \"tokens\": [");
    for (uint32_t i = 0; i < g->ntok[s]; i++)
        printf("%s%u", i ? ", " : "", t[i]);
    printf("],\n     \"generated\": [");
    for (uint32_t i = g->P; i < g->ntok[s] && g->n_prompt <= g->steps; i++)
        printf("%s%u", i > g->P ? ", " : "", t[i]);
    printf("],\n");
    if (g->o->check_e2e && g->n_prompt <= g->steps) {
        printf("     \"dense_generated\": [");
        for (uint32_t k = 0; k + g->P < g->ntok[s]; k++)
            printf("%s%u", k ? ", " : "", g->dense_tok[(size_t)s * g->gen_cap + k]);
        printf("],\n");
    }
    if (g->have_tok) {
        printf("     \"text\": \"");
        for (uint32_t i = 1; i < g->ntok[s]; i++) {
            if (i >= g->P && gen_stops(g, t[i]))
                continue;
            const char *p;
            size_t n;
            tokenizer_decode(&g->tk, t[i - 1], t[i], &p, &n);
            json_bytes(stdout, p, n);
        }
        printf("\",\n");
    }
    printf("     \"memory\": {\"tokens\": %llu, \"blocks\": %llu, \"bytes_resident\": %llu, "
           "\"bytes_shared\": %llu, \"bytes_ideal\": %llu, \"bytes_overhead\": %llu, "
           "\"bytes_spilled\": %llu}}",
           (unsigned long long)m->tokens, (unsigned long long)m->blocks,
           (unsigned long long)m->bytes_resident, (unsigned long long)m->bytes_shared,
           (unsigned long long)m->bytes_ideal, (unsigned long long)m->bytes_overhead,
           (unsigned long long)m->bytes_spilled);
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

    if (o->json) {
        printf("{\n  \"model\": {\"source\": ");
        cli_json_str(stdout, o->model_path ? o->model_path : "synthetic");
        printf(", \"dim\": %u, \"hidden_dim\": %u, \"n_layers\": %u, \"n_heads\": %u, "
               "\"n_kv_heads\": %u, \"head_dim\": %u, \"vocab_size\": %u, \"seq_len\": %u, "
               "\"params\": %llu},\n",
               c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->head_size,
               c->vocab_size, c->seq_len, (unsigned long long)llama_param_count(c));
        printf("  \"cache\": {\"dtype\": \"%s\", \"block_tokens\": %u, \"page_bytes\": %llu, "
               "\"n_threads\": %u, \"isa\": ",
               pkv_dtype_name(cfg.kv_dtype), cfg.block_tokens,
               (unsigned long long)es.page_bytes, cfg.n_threads);
        cli_json_str(stdout, es.isa);
        printf("},\n  \"steps\": %u, \"temperature\": %g, \"top_p\": %g, \"seed\": %llu,\n",
               g->steps, o->temperature, o->topp, (unsigned long long)o->seed);
        printf("  \"prompt_tokens\": [");
        for (uint32_t i = 0; i < g->n_prompt; i++)
            printf("%s%u", i ? ", " : "", g->prompt[i]);
        printf("],\n  \"sessions\": [\n");
    }
    for (uint32_t s = 0; s < g->N; s++) {
        pkv_memory m;
        if ((st = pkv_session_memory(g->sess[s], &m)) != PKV_OK)
            return cli_fail(CMD, "pkv_session_memory: %s", pkv_status_str(st));
        sum_resident += m.bytes_resident;
        if (o->json) {
            json_session(g, s, &m);
            printf("%s\n", s + 1 < g->N ? "," : "");
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
        }
    }
    uint64_t engine_bytes = es.pages_in_use * es.page_bytes;
    if (o->json) {
        printf("  ],\n  \"engine\": {\"pages_in_use\": %llu, \"pages_free\": %llu, "
               "\"bytes_in_use\": %llu, \"sum_session_resident\": %llu, "
               "\"bytes_allocator\": %llu},\n",
               (unsigned long long)es.pages_in_use, (unsigned long long)es.pages_free,
               (unsigned long long)engine_bytes, (unsigned long long)sum_resident,
               (unsigned long long)es.bytes_allocator);
        printf("  \"prompt_positions\": %u, \"prefill_seconds\": %.6f, "
               "\"prefill_tokens_per_s\": %.1f,\n",
               g->P, g->t_prefill, pps);
        printf("  \"generated_tokens\": %llu, \"decode_seconds\": %.6f, "
               "\"tokens_per_s\": %.1f",
               (unsigned long long)g->n_generated, g->t_decode, tps);
        if (o->check)
            printf(",\n  \"check\": {\"passed\": true, \"rows\": %llu, \"max_abs_err\": %.3e, "
                   "\"tolerance_rel_max_v\": %.0e, \"worst_fraction_of_tolerance\": %.4f, "
                   "\"seconds\": %.3f}",
                   (unsigned long long)g->n_checked, g->check_maxerr, CHECK_REL,
                   g->check_worst, g->check_secs);
        if (o->check_e2e)
            printf(",\n  \"check_e2e\": {\"passed\": true, \"steps\": %llu, "
                   "\"max_logit_diff\": %.3e, \"tolerance\": %.3e, \"token_flips\": %llu}",
                   (unsigned long long)g->e2e_steps, g->e2e_maxdiff, g->e2e_tol,
                   (unsigned long long)g->e2e_ties);
        printf("\n}\n");
        return CLI_OK;
    }
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
    if (o->check)
        fprintf(stderr, "check: passed, %llu attention rows vs pkv_causal_attention, max "
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

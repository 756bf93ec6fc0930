/*
 * mem/report.c - `pagedkv mem`'s figures as text and as JSON.
 *
 * Owns: the wording and layout of the report. Does not own: any figure (mem.c computes
 * them all, docs/memory.md defines them).
 */
#include <inttypes.h>
#include <stdio.h>

#include "common/json.h"
#include "mem/mem.h"

static const char *const CMD = "mem";

/* "MHA", "MQA", "GQA", or NULL when the query heads were not given. */
static const char *attention_kind(const mem_opts *o)
{
    if (!o->has_heads)
        return NULL;
    return o->kv_heads == o->heads ? "MHA" : o->kv_heads == 1 ? "MQA" : "GQA";
}

void mem_print_text(const mem_opts *o, const mem_figures *f, const mem_measured *r)
{
    char b1[32], b2[32];
    const uint32_t hg = o->heads / o->kv_heads;
    /* The kind of attention is known only when the query heads are: without --heads
     * (or a preset) the figures take heads = kv-heads, which says nothing about it. */
    const char *kind = attention_kind(o);
    if (o->preset)
        printf("preset          %s\n", o->preset);
    if (kind)
        printf("geometry        %u layers, %u heads, %u kv-heads (%s, %u quer%s per group), "
               "head-dim %u\n", o->layers, o->heads, o->kv_heads, kind, hg,
               hg == 1 ? "y" : "ies", o->head_dim);
    else
        printf("geometry        %u layers, %u kv-heads (query heads not given), head-dim %u\n",
               o->layers, o->kv_heads, o->head_dim);
    if (f->bytes_per_value)
        printf("sessions        %" PRIu64 " x %" PRIu64 " tokens, %s (%" PRIu64
               " bytes/value), block-tokens %u\n",
               o->batch, o->ctx, pkv_dtype_name(o->dtype), f->bytes_per_value, f->block_tokens);
    else
        printf("sessions        %" PRIu64 " x %" PRIu64 " tokens, %s (%.4g bits/value: a "
               "%u-value row is %" PRIu64 " bytes, blocks of 32 values with an f16 scale), "
               "block-tokens %u\n", o->batch, o->ctx, pkv_dtype_name(o->dtype),
               8.0 * (double)f->row_k / o->head_dim, o->head_dim, f->row_k, f->block_tokens);
    printf("per token       %" PRIu64 " bytes (%u layers x %u kv-heads x (K row %" PRIu64
           " + V row %" PRIu64 " bytes))\n", f->token_bytes, o->layers, o->kv_heads, f->row_k,
           f->row_v);
    const bool plain = !f->windowed && f->dv == o->head_dim && f->bytes_per_value != 0;
    if (f->windowed || f->dv != o->head_dim || cli_variant_any(&o->v)) {
        char vd[256];
        printf("variant         %s; head-dim-v %u\n",
               cli_variant_describe(&o->v, o->layers, vd, sizeof vd), f->dv);
    }
    if (o->vp)
        printf("preset assumes  like %s: %s\n", o->vp->like, o->vp->note);
    printf("\n");
    if (plain)
        printf("formula         2 * %u * %u * %u * %" PRIu64 " * %" PRIu64 " * %" PRIu64 "\n",
               o->layers, o->kv_heads, o->head_dim, o->ctx, o->batch, f->bytes_per_value);
    else if (f->bytes_per_value)
        printf("formula         %s\n                (%u full x %" PRIu64 " + %u windowed x %"
               PRIu64 " positions) * %u * (%u + %u) * %" PRIu64 " * %" PRIu64 "\n",
               f->assumes, f->full, o->ctx, f->windowed, f->win_positions, o->kv_heads,
               o->head_dim, f->dv, o->batch, f->bytes_per_value);
    else
        printf("formula         %s\n                (%u full x %" PRIu64 " + %u windowed x %"
               PRIu64 " positions) * %u * (%" PRIu64 " + %" PRIu64 " bytes) * %" PRIu64 "\n",
               f->assumes, f->full, o->ctx, f->windowed, f->win_positions, o->kv_heads,
               f->row_k, f->row_v, o->batch);
    printf("                = %" PRIu64 " bytes (%s)\n", f->formula, cli_bytes(f->formula, b1));
    if (f->windowed)
        printf("paged           (%u full * %" PRIu64 " + %u windowed * %" PRIu64 ") pages * %"
               PRIu64 " bytes * %" PRIu64 "\n", f->full, f->pages_per_layer, f->windowed,
               f->win_pages, f->page_bytes, o->batch);
    else
        printf("paged           %u layers * %" PRIu64 " pages * %" PRIu64 " bytes * %" PRIu64
               "\n", o->layers, f->pages_per_layer, f->page_bytes, o->batch);
    printf("                = %" PRIu64 " bytes (%s)\n", f->paged, cli_bytes(f->paged, b1));
    if (!f->bytes_per_value)
        printf("page            %" PRIu64 " bytes (%s) = %u kv-heads * %u tokens * (%" PRIu64
               " + %" PRIu64 ") bytes a K and a V row\n", f->page_bytes,
               cli_bytes(f->page_bytes, b1), o->kv_heads, f->block_tokens, f->row_k, f->row_v);
    else if (f->dv == o->head_dim)
        printf("page            %" PRIu64 " bytes (%s) = 2 * %u kv-heads * %u tokens * %u "
               "* %" PRIu64 "\n", f->page_bytes, cli_bytes(f->page_bytes, b1), o->kv_heads,
               f->block_tokens, o->head_dim, f->bytes_per_value);
    else
        printf("page            %" PRIu64 " bytes (%s) = %u kv-heads * %u tokens * (%u + %u) "
               "* %" PRIu64 "\n", f->page_bytes, cli_bytes(f->page_bytes, b1), o->kv_heads,
               f->block_tokens, o->head_dim, f->dv, f->bytes_per_value);
    if (f->windowed) {
        char how[160];
        if (f->probe_tokens)
            snprintf(how, sizeof how, "a real engine of this window and page size, %" PRIu64
                     " positions appended: the pages repeat every %u", f->probe_tokens,
                     f->block_tokens);
        else
            snprintf(how, sizeof how, "by the release rule: a probe would append more than %u "
                     "positions", PROBE_MAX_TOKENS);
        printf("windowed layer  %" PRIu64 " pages held at %" PRIu64 " tokens (%s); release "
               "rule %" PRIu64 ", ceiling %" PRIu64 " = ceil(%u/%u) + ceil((%u+%u)/%u) + 1\n",
               f->win_pages, o->ctx, how, f->win_rule_pages,
               f->ceiling, o->v.sinks, f->block_tokens, o->v.window, o->v.rollback,
               f->block_tokens);
        printf("vs no window    %" PRIu64 " bytes (%s) by the formula: the window saves %"
               PRIu64 " bytes (%s)\n", f->dense, cli_bytes(f->dense, b1),
               f->dense - f->formula, cli_bytes(f->dense - f->formula, b2));
    }
    if (f->mla) {
        printf("MLA latent      %" PRIu64 " bytes (%s): the %u values a token and layer "
               "DeepSeek caches ([c_t ; k_rope]); pagedkv stores V = c_t again, %.2fx\n",
               f->latent, cli_bytes(f->latent, b1), o->head_dim,
               f->latent ? (double)f->formula / (double)f->latent : 0.0);
        printf("naive MLA       %" PRIu64 " bytes (%s): per-head K/V, %u heads x %u values; "
               "the latent is %.1fx smaller\n", f->naive, cli_bytes(f->naive, b1), o->heads,
               MLA_NAIVE_PER_HEAD, f->latent ? (double)f->naive / (double)f->latent : 0.0);
    }
    if (f->windowed)
        printf("pages/session   %" PRIu64 " (%" PRIu64 " per full layer, %" PRIu64
               " per windowed layer)\n", f->pages_per_session, f->pages_per_layer,
               f->win_pages);
    else
        printf("pages/session   %" PRIu64 " (%" PRIu64 " per layer)\n", f->pages_per_session,
               f->pages_per_layer);
    printf("waste           %" PRIu64 " bytes (%s, %.3f%%): the partly filled last page "
           "of each layer%s\n", f->waste, cli_bytes(f->waste, b1),
           f->paged ? 100.0 * (double)f->waste / (double)f->paged : 0.0,
           f->windowed ? " (a windowed layer's oldest page may be partly read, too)" : "");
    if (f->table_ok)
        printf("block tables    ~%" PRIu64 " bytes (%s, estimate: %u bytes per page; table "
               "growth slack and decode scratch come on top)\n",
               f->table_est, cli_bytes(f->table_est, b1), (unsigned)TABLE_BYTES_PER_PAGE);
    else
        printf("block tables    the estimate overflows 64 bits\n");
    if (!kind)
        printf("vs MHA          unknown: give --heads (query heads) to compare with MHA\n");
    else if (hg == 1)
        printf("vs MHA          this is MHA (kv-heads = heads); give --heads to compare "
               "a GQA/MQA model\n");
    else if (f->mha_ok)
        printf("vs MHA          %" PRIu64 " bytes (%s) with kv-heads = heads = %u; "
               "%s saves %" PRIu64 " bytes (%s, %ux less)\n",
               f->mha, cli_bytes(f->mha, b1), o->heads, kind, f->saving,
               cli_bytes(f->saving, b2), hg);
    else
        printf("vs MHA          the MHA cache (kv-heads = heads = %u) overflows 64 bits\n",
               o->heads);
    if (!r)
        return;
    printf("\nmeasured        one session, %" PRIu64 " tokens in each of %u layers, %.2f s\n",
           o->ctx, o->layers, r->seconds);
    printf("  tokens          %" PRIu64 "\n", r->m.tokens);
    printf("  blocks          %" PRIu64 "   (computed %" PRIu64 ")\n", r->m.blocks,
           f->pages_per_session);
    printf("  bytes_resident  %" PRIu64 "   (computed paged/session %" PRIu64 ")\n",
           r->m.bytes_resident, f->paged_session);
    printf("  bytes_ideal     %" PRIu64 "   (computed formula/session %" PRIu64 ")\n",
           r->m.bytes_ideal, f->formula_session);
    /* the estimate per session: the pages of one session at the same rate */
    printf("  bytes_overhead  %" PRIu64 "   (estimate %" PRIu64 ")\n", r->m.bytes_overhead,
           f->pages_per_session * (uint64_t)TABLE_BYTES_PER_PAGE);
    printf("  engine          %" PRIu64 " pages in use, allocator %" PRIu64 " bytes (%s)\n",
           r->st.pages_in_use, r->st.bytes_allocator, cli_bytes(r->st.bytes_allocator, b1));
    printf("  peak RSS        %" PRIu64 " bytes (%s)\n", r->peak_rss,
           cli_bytes(r->peak_rss, b1));
    printf("  matches         %s\n", r->matches ? "yes" : "NO");
}

void mem_print_json(const mem_opts *o, const mem_figures *f, const mem_measured *r)
{
    json_writer w = {stdout, true, false}, *W = &w;
    json_open(W, NULL, '{');
    cli_json_envelope(W, CMD, NULL);
    json_str(W, "preset", o->preset);
    JSON_U64S(W, {"layers", o->layers}, {"heads", o->heads}, {"kv_heads", o->kv_heads},
              {"head_dim", o->head_dim}, {"ctx", o->ctx}, {"batch", o->batch});
    json_str(W, "dtype", pkv_dtype_name(o->dtype));
    if (f->bytes_per_value)
        json_u64(W, "bytes_per_value", f->bytes_per_value);
    else /* a block type: the mean over a K row, scales included */
        json_num(W, "bytes_per_value", (double)f->row_k / o->head_dim);
    JSON_U64S(W, {"row_bytes_k", f->row_k}, {"row_bytes_v", f->row_v},
              {"bytes_per_token", f->token_bytes});
    JSON_U64S(W, {"block_tokens", f->block_tokens},
              {"formula_bytes", f->formula}, {"paged_bytes", f->paged},
              {"page_bytes", f->page_bytes}, {"pages_per_layer", f->pages_per_layer},
              {"pages_per_session", f->pages_per_session}, {"waste_bytes", f->waste});
    if (f->table_ok)
        json_u64(W, "block_table_bytes_est", f->table_est);
    else
        json_str(W, "block_table_bytes_est", NULL);
    if (f->mha_ok) {
        JSON_U64S(W, {"mha_formula_bytes", f->mha}, {"gqa_saving_bytes", f->saving});
    } else {
        json_str(W, "mha_formula_bytes", NULL);
        json_str(W, "gqa_saving_bytes", NULL);
    }
    json_u64(W, "gqa_ratio", o->heads / o->kv_heads);
    json_str(W, "attention", attention_kind(o));
    JSON_U64S(W, {"head_dim_v", f->dv}, {"window", o->v.window}, {"sinks", o->v.sinks},
              {"rollback", o->v.rollback}, {"window_every", o->v.every});
    json_num(W, "softcap", o->v.softcap);
    json_bool(W, "sink_logits", o->v.sink_logits);
    JSON_U64S(W, {"windowed_layers", f->windowed}, {"full_layers", f->full});
    json_str(W, "formula_assumes", f->assumes);
    if (f->windowed) {
        JSON_U64S(W, {"probe_tokens", f->probe_tokens},
                  {"positions_per_windowed_layer", f->win_positions},
                  {"pages_per_windowed_layer", f->win_pages}, {"page_ceiling", f->ceiling},
                  {"dense_formula_bytes", f->dense},
                  {"window_saving_bytes", f->dense - f->formula});
    } else {
        json_str(W, "probe_tokens", NULL);
        json_str(W, "positions_per_windowed_layer", NULL);
        json_str(W, "pages_per_windowed_layer", NULL);
        json_str(W, "page_ceiling", NULL);
        json_str(W, "dense_formula_bytes", NULL);
        json_str(W, "window_saving_bytes", NULL);
    }
    if (!f->mla) {
        json_str(W, "mla", NULL);
    } else {
        json_open(W, "mla", '{');
        JSON_U64S(W, {"latent_bytes", f->latent}, {"stored_bytes", f->formula},
                  {"naive_bytes", f->naive},
                  {"naive_values_per_token_layer", (uint64_t)o->heads * MLA_NAIVE_PER_HEAD});
        json_close(W, '}');
    }
    if (!r) {
        json_str(W, "measured", NULL);
    } else {
        json_open(W, "measured", '{');
        JSON_U64S(W, {"tokens", r->m.tokens}, {"blocks", r->m.blocks},
                  {"bytes_resident", r->m.bytes_resident}, {"bytes_ideal", r->m.bytes_ideal},
                  {"bytes_overhead", r->m.bytes_overhead},
                  {"engine_pages_in_use", r->st.pages_in_use},
                  {"engine_bytes_allocator", r->st.bytes_allocator},
                  {"peak_rss_bytes", r->peak_rss});
        json_fmt(W, "seconds", "%.6f", r->seconds);
        json_bool(W, "matches", r->matches);
        json_close(W, '}');
    }
    json_close(W, '}');
    fputc('\n', stdout);
}

/*
 * mem/mem.h - `pagedkv mem`'s options and figures, shared by the computation (mem.c)
 * and the report (report.c).
 */
#ifndef PKV_TOOLS_MEM_H
#define PKV_TOOLS_MEM_H

#include <stdbool.h>
#include <stdint.h>

#include "common/cli.h"

/* Bookkeeping per page assumed by the estimate: a page pointer and a data pointer per
 * block-table entry, plus one page descriptor. */
#define TABLE_BYTES_PER_PAGE (2u * sizeof(void *) + 32u)

/* Probes longer than this many appends are not run (a window beyond the context of a
 * huge --ctx): the figure is then docs/variants.md's rule, and the output says so. */
#define PROBE_MAX_TOKENS (4u << 20)

/* Naive MLA: per-head K (qk_nope + qk_rope) and V (v_head_dim) values per token, head
 * and layer, DeepSeek-V3's config.json: 128 + 64 + 128 (times its 128 heads). */
#define MLA_NAIVE_PER_HEAD (128u + 64u + 128u)

typedef struct {
    const char *preset;
    const cli_variant_preset *vp;   /* the preset's variant pattern, or NULL */
    uint32_t layers, heads, kv_heads, head_dim, block_tokens;
    uint32_t head_dim_v;            /* 0 = head_dim */
    cli_variant v;
    uint64_t ctx, batch;
    pkv_dtype dtype;
    bool has_layers, has_heads, has_kv, has_dim, has_ctx, has_dv;
    bool has_w, has_s, has_r;
    bool json, measure, force;
} mem_opts;


typedef struct {
    uint64_t bytes_per_value;    /* f32/f16/bf16; 0 for the block types */
    uint64_t row_k, row_v;       /* pkv_row_bytes of a K row (d) and a V row (dv) */
    uint64_t token_bytes;        /* one position of every layer: L * g * (row_k + row_v) */
    uint32_t block_tokens;       /* resolved by the engine */
    uint64_t formula;            /* the size formula (docs/memory.md), whole batch */
    uint64_t formula_session;    /* the same, batch = 1 */
    uint64_t page_bytes;         /* from pkv_engine_stats */
    uint64_t pages_per_layer;    /* ceil(ctx / bt) */
    uint64_t pages_per_session;  /* layers * pages_per_layer */
    uint64_t paged_session;      /* pages_per_session * page_bytes */
    uint64_t paged;              /* paged_session * batch */
    uint64_t waste;              /* paged - formula */
    bool table_ok;               /* false: the estimate overflows */
    uint64_t table_est;          /* whole batch */
    bool mha_ok;                 /* false: the MHA formula overflows */
    uint64_t mha;                /* formula with g = heads, whole batch */
    uint64_t saving;             /* mha - formula */
    /* variants */
    uint32_t dv;                 /* head_dim_v, resolved */
    uint32_t windowed, full;     /* layers of each kind */
    uint64_t win_positions;      /* min(ctx, sinks + window + rollback) */
    uint64_t win_pages;          /* pages a windowed layer holds at ctx (engine) */
    uint64_t win_rule_pages;     /* the same by docs/variants.md's rule (cli.h) */
    uint64_t probe_tokens;       /* positions appended to the probe engine */
    uint64_t ceiling;            /* page ceiling per windowed layer (docs/variants.md) */
    uint64_t dense;              /* the formula without the window, whole batch */
    bool mla;
    uint64_t latent, naive;      /* MLA: the latent cache, per-head K/V; whole batch */
    char assumes[256];
} mem_figures;

typedef struct {
    pkv_memory m;                /* one session */
    pkv_stats st;                /* engine, after the appends */
    uint64_t peak_rss;
    double seconds;
    bool matches;
} mem_measured;

/* The figures as text or as JSON (--json) on stdout; r is NULL without --measure. */
void mem_print_text(const mem_opts *o, const mem_figures *f, const mem_measured *r);
void mem_print_json(const mem_opts *o, const mem_figures *f, const mem_measured *r);

#endif

/*
 * quality.h - what the parts of `pagedkv quality` share: quality/quality.c (the options,
 * the model mode, the JSON and the bar chart of both modes), quality/synthetic.c (the
 * --synthetic attention-only mode and its table) and, below both, quality/rows.c
 * (the rows and the engine a row runs on).
 *
 * Owns: the options, one row per dtype and path, the result of a run. Does not own:
 * anything in the library.
 *
 * Invariants (hold once a run returned CLI_OK)
 *   - rows[0..n_rows) are f32 on the exact path first (the self-check), then each
 *     --dtype on the exact path and, for Q8/Q4, on the integer path; n_rows <= MAX_ROWS.
 *   - an unavailable row has why[] set and no figures; the figures of an available
 *     row are those of its mode (model or synthetic) alone, the others stay 0.
 */
#ifndef PKV_TOOLS_QUALITY_H
#define PKV_TOOLS_QUALITY_H

#include <stdbool.h>
#include <stdint.h>
#include "llama.h"
#include "pagedkv.h"

#define MAX_ROWS 12
#define MAX_OUTLIERS 32
#define MAX_PROMPTS 64 /* --prompts: lines of the file */

typedef struct {
    const char *model_path, *tok_path, *prompt, *prompts_path, *svg;
    uint32_t steps, block_tokens, threads;
    pkv_dtype dtypes[8];
    uint32_t n_dtypes;
    bool json, synthetic;
    uint32_t ctx, outliers;
    double outlier_scale, q_scale;
    uint64_t seed;
} q_opts;

/* One dtype on one path. */
typedef struct {
    pkv_dtype dt;
    uint32_t path;                /* 0 exact, 1 integer (quant_dot) */
    bool available;
    char why[256];
    uint64_t bytes_per_token;     /* every layer's K and V rows of one position */
    /* model mode, over the positions of every prompt */
    double kl_mean, kl_p99, kl_max, top1;
    double top1_prompt[MAX_PROMPTS]; /* each prompt's own top-1 */
    uint32_t flips;               /* positions whose argmax differs from f32's */
    double flip_margin;           /* largest f32 log-probability margin of a flip (0: none) */
    double attn_max_abs, attn_ref_max;
    /* synthetic mode (relative to max |reference output| on unrounded rows) */
    double k_rms, v_rms, err_k_only, err_v_only, err_ref_both, err_raw, err_rounded;
} q_row;

typedef struct {
    const q_opts *o;
    const char *isa;
    uint32_t threads;             /* the engines' thread count, resolved */
    q_row rows[MAX_ROWS];
    uint32_t n_rows;
    /* model mode: sums over the prompts (one without --prompts) */
    llama_config cfg;
    uint32_t n_prompts;
    uint32_t positions, prompt_positions;
    bool stopped_at_bos;          /* some prompt's run stopped where the model emitted BOS */
    char *text;                   /* the first prompt's f32 greedy text (with a tokenizer),
                                   * or NULL */
    /* synthetic mode */
    uint32_t outlier_ch[MAX_OUTLIERS];
    double max_out;
} q_result;

/* ---- quality/rows.c ---- */
/* "exact" (path 0) or "integer" (1, quant_dot). */
const char *quality_path_name(uint32_t path);
/* The rows of R for engine config cfg (its dtype aside) and that many K/V heads,
 * layers and head_dim d; an integer row pkv_config_explain refuses is unavailable. */
void quality_plan_rows(q_result *R, const pkv_config *cfg, uint32_t kv_heads,
                       uint32_t layers, uint32_t d);
/* An engine and session of config c; its kernels into R->isa. */
pkv_status quality_open_engine(q_result *R, const pkv_config *c, pkv_engine **e,
                               pkv_session **s);
/* Destroy what quality_open_engine opened (either may be NULL) and set both NULL. */
void quality_close_engine(pkv_engine **e, pkv_session **s);

/* The synthetic mode (quality/synthetic.c): fills R's rows, outlier channels and
 * max_out; CLI_OK, or CLI_FAIL / CLI_USAGE after a message. Then its table. */
int quality_run_synthetic(q_result *R);
void quality_print_synthetic(const q_result *R);

#endif

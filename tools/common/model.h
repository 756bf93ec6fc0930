/*
 * model.h - the description of a model's attention that `pagedkv stress` and `pagedkv
 * stress --mpi` take in the same words: a preset (cli.h's two tables: geometries and
 * real models' layer patterns) and the flags that override each part of it. One
 * context sharded over MPI ranks is described exactly as one run on one machine.
 *
 * Owns: those options (names, ranges, help lines), the preset under the flags, and
 * the checks of the result (variants, heads against kv-heads, the engine's limits).
 * Does not own: the options of a run (context, points, output), nor what a command
 * builds from the description.
 *
 * Invariant: after cli_model_resolve returned CLI_OK, heads % kv_heads == 0, the
 * variant passes cli_variant_check and the geometry is within cli_check_limits.
 */
#ifndef PKV_TOOLS_MODEL_H
#define PKV_TOOLS_MODEL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "common/cli.h"
#include "common/opt.h"

/* Entries cli_model_opts writes. */
#define CLI_MODEL_NOPTS 13u

typedef struct {
    const char *preset;        /* --model-preset NAME, or NULL */
    uint32_t layers, heads, kv_heads, head_dim;
    uint32_t head_dim_v;       /* 0 = head_dim */
    uint32_t block_tokens;     /* 0 = the library's */
    pkv_dtype dtype;
    cli_variant v;             /* the flags', or the variant preset's pattern under them */
    /* which flags were given: they win over the preset */
    bool set_layers, set_heads, set_kv, set_dim, set_dv, set_w, set_s, set_r, set_c;
} cli_model;

/* The defaults: one layer of llama3-8b's heads (h 32, g 8, d 128), f16, no variant. */
cli_model cli_model_default(void);
/* The options --model-preset, --layers, --heads, --kv-heads, --head-dim,
 * --head-dim-v, --dtype, --block-tokens, --window, --sinks, --rollback, --softcap,
 * --sink-logits, storing into m: CLI_MODEL_NOPTS entries into opts. */
void cli_model_opts(cli_model *m, cli_opt *opts);
/* After cli_parse: the preset fills what the flags left unset, then the checks.
 * CLI_OK, or CLI_USAGE after the message. */
int cli_model_resolve(const char *cmd, cli_model *m);
/* The help lines of those options (a "geometry" and a "variants" block). */
void cli_model_usage(FILE *f);

#endif

/*
 * cli.h - shared pieces of the `pagedkv` command: subcommand entry points, strict value
 * parsers, checks against the engine's limits, model presets, memory guards, timing.
 * The option parser is opt.h's, the JSON writer json.h's.
 *
 * Exit codes of every subcommand: 0 success, 1 a runtime failure (the library or the
 * system said no), 2 a usage error (message on stderr, then a hint to run --help).
 */
#ifndef PKV_CLI_H
#define PKV_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include "common/json.h"
#include "pagedkv.h"

#define CLI_OK 0
#define CLI_FAIL 1
#define CLI_USAGE 2

int cmd_mem(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_stress(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_quality(int argc, char **argv);

/* `pagedkv bench --spill`: spill/restore GB/s next to plain sequential I/O in `dir`,
 * sessions of `mib` MiB, medians of `reps`, both backends (bench/spill.c). */
int bench_spill(const char *dir, uint64_t mib, int reps, bool json);

/* A model geometry by name: llama3-8b, llama3-70b, mistral-7b, mqa, mha, ... */
typedef struct {
    const char *name;
    uint32_t layers, heads, kv_heads, head_dim;
} cli_preset;
const cli_preset *cli_preset_find(const char *name);   /* NULL if unknown */
const cli_preset *cli_presets(uint32_t *n);             /* the table */
/* The table's names, for messages ("one of ..."); cli.c keeps the two in step. */
#define CLI_PRESET_NAMES "llama3-8b, llama3-70b, mistral-7b, llama2-7b, mqa, mha, d64, d256"
/* An OPT_CALL check (opt.h) of a --model-preset value: a preset's name is stored in
 * *(const char **)dst; false for an unknown name. */
bool cli_opt_preset(const char *value, void *dst);

/* ---- attention variants (docs/variants.md) ----------------------------------------------
 * What --window, --sinks, --rollback, --softcap, --head-dim-v and the variant presets
 * of stress, mem and generate mean, in one place. */

/* The variant options of one command, as given. `every` is the layer pattern: 0 =
 * every layer windowed (when window > 0), k = layers l with l % k == 0 windowed and
 * the others full causal (Gemma 2 and gpt-oss alternate: k = 2, layer 0 windowed).
 * softcap and sink logits apply to every layer (as in those models). */
typedef struct {
    uint32_t window, sinks, rollback, every;
    double softcap;
    bool sink_logits;          /* one (zero) learned sink logit per head, every layer */
} cli_variant;

/* A real model's attention pattern by name (pagedkv mem/stress --model-preset). The
 * figures are the public config.json values of the model named in `like`. */
typedef struct {
    const char *name, *like;
    uint32_t layers, heads, kv_heads, head_dim, head_dim_v;   /* head_dim_v 0 = head_dim */
    cli_variant v;
    const char *note;          /* what the preset assumes, one line */
} cli_variant_preset;
#define CLI_VARIANT_PRESET_NAMES "gemma2-9b, gpt-oss-20b, deepseek-v3"
const cli_variant_preset *cli_variant_preset_find(const char *name); /* NULL if unknown */
const cli_variant_preset *cli_variant_presets(uint32_t *n);
/* OPT_CALL check of --model-preset where both tables are accepted (mem, stress). */
bool cli_opt_any_preset(const char *value, void *dst);

/* Is layer l windowed under v? */
static inline bool cli_variant_windowed(const cli_variant *v, uint32_t l)
{
    return v->window && (v->every == 0 || l % v->every == 0);
}
/* Does v change anything (a window, a cap or sink logits)? */
static inline bool cli_variant_any(const cli_variant *v)
{
    return v->window || v->softcap > 0 || v->sink_logits;
}
/* Layers of v that are windowed, out of `layers`. */
uint32_t cli_variant_windowed_layers(const cli_variant *v, uint32_t layers);
/* docs/variants.md's ceiling of pages one windowed layer holds at block size bt:
 * ceil(sinks / bt) + ceil((window + rollback) / bt) + 1. */
uint64_t cli_variant_page_ceiling(const cli_variant *v, uint32_t bt);
/* Pages a layer of length n holds under docs/variants.md's release rule: the sink pages and
 * every page with a position >= n - window - rollback (n - 1 reads back to
 * n - window; a truncate of up to rollback moves that back by rollback); all
 * ceil(n / bt) pages for a full layer. Derived from docs/variants.md, not from the library:
 * stress checks the engine against it. */
uint64_t cli_variant_pages_held(const cli_variant *v, bool windowed, uint64_t n,
                                uint32_t bt);
/* The checks every command makes of its variant options (cmd names the messages):
 * --sinks and --rollback need --window; CLI_OK or CLI_USAGE after the message. */
int cli_variant_check(const char *cmd, const cli_variant *v);
/* A malloc'ed [layers] array of layer configs for v (sink logits: a malloc'ed [heads]
 * array of zeros in *sink_store, shared by every layer; NULL without them), or NULL
 * when v changes nothing or memory ran out (*oom tells which). Free both. */
pkv_layer_config *cli_variant_layers(const cli_variant *v, uint32_t layers, uint32_t heads,
                                     float **sink_store, bool *oom);
/* Pages layer l of s holds now: block-table entries of a live page (a window's
 * released entries read id 0 in pkv_session_pages). UINT64_MAX if it cannot tell. */
uint64_t cli_layer_pages_held(const pkv_session *s, uint32_t l);
/* "window 4096 on 21 of 42 layers (every 2nd), 0 sinks, rollback 0, softcap 50" */
const char *cli_variant_describe(const cli_variant *v, uint32_t layers, char *buf,
                                 size_t cap);

/* pkv_config_default() with a geometry, a page size (0 = the library's), a storage
 * dtype and a thread count (0 = online CPUs): what every command's engine starts from.
 * No budget and no spill directory; callers that want them set those fields. */
pkv_config cli_config(uint32_t layers, uint32_t heads, uint32_t kv_heads, uint32_t head_dim,
                      uint32_t block_tokens, pkv_dtype dtype, uint32_t threads);

/* Bytes of one position of one layer of config c: n_kv_heads K rows of head_dim and V
 * rows of head_dim_v (0 = head_dim), each pkv_row_bytes (docs/numerics.md, section 6: the block
 * types' scales included; for f32/f16/bf16 it is 2 * g * d * dtype_size). 0 for an unknown
 * dtype. */
uint64_t cli_token_layer_bytes(const pkv_config *c);
/* layers * ctx * batch * cli_token_layer_bytes(c): the unpaged K/V of batch sessions
 * of ctx tokens (the size formula of docs/memory.md, for the per-value types). PKV_ERANGE on
 * overflow, PKV_OK otherwise. */
pkv_status cli_kv_bytes(const pkv_config *c, uint64_t ctx, uint64_t batch, uint64_t *out);

/* splitmix64: the next value of the stream whose state is *s (any seed). The tools'
 * test data comes from it, so a seed gives the same rows in every tool. */
uint64_t cli_splitmix64(uint64_t *s);

/* Strict parsers: the whole string must be consumed; 1 on success, 0 otherwise.
 * Integers accept a k/K (x1024), m/M (x2^20), g/G (x2^30) suffix. */
int cli_parse_u64(const char *s, uint64_t *out);
int cli_parse_u32(const char *s, uint32_t *out);
int cli_parse_double(const char *s, double *out);
int cli_parse_dtype(const char *s, pkv_dtype *out);

/* "pagedkv CMD: <message>\n" on stderr; returns CLI_USAGE / CLI_FAIL for chaining.
 * A program of its own on these conventions (the soak) calls cli_set_program first:
 * its messages are then "NAME: <message>" and the hint "Try 'NAME --help'". */
void cli_set_program(const char *name);
int cli_usage_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
int cli_fail(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Output paths and directories, checked before any work so that a typo fails at once
 * and not after a long run. Each returns CLI_OK, or CLI_USAGE after a message that
 * names the option and the cause. Nothing is created.
 * cli_check_output_file: `path` can be written by fopen(path, "w"): not empty, not a
 *   directory, an existing file writable, otherwise its directory existing and
 *   writable.
 * cli_check_dir: `dir` is not empty, exists, is a directory, and is writable and
 *   searchable (files can be created in it). */
int cli_check_output_file(const char *cmd, const char *opt, const char *path);
int cli_check_dir(const char *cmd, const char *opt, const char *dir);

/* The budget and spill options of an engine of config c (its mem_budget and
 * spill_dir), checked before any work, because pkv_engine_create says only
 * PKV_EINVAL for the usual mistakes. The spill directory as cli_check_dir; a budget
 * of at least one page of c's geometry (read back from an engine of c without budget
 * or spill); with dir_needs_budget, a spill directory without a budget (it would never
 * be used) is refused too. budget_opt and dir_opt name the options in the messages.
 * *page_bytes and *block_tokens (either may be NULL) receive the resolved figures,
 * 0 when the geometry itself is refused (left for pkv_engine_create to report).
 * CLI_OK, or CLI_USAGE after a message naming the cause. */
int cli_check_engine_memory(const char *cmd, const pkv_config *c, const char *budget_opt,
                            const char *dir_opt, bool dir_needs_budget,
                            uint64_t *page_bytes, uint32_t *block_tokens);

/* The engine's limits (pkv_engine_create in pagedkv.h), checked before any work so
 * that a value beyond one is a usage error that names the option and the limit, not
 * a "cannot create the engine" after the fact. */
#define CLI_MAX_HEAD_DIM 4096u
#define CLI_MAX_KV_HEADS 65536u
#define CLI_MAX_GROUP_HEADS 256u      /* n_heads / n_kv_heads */
#define CLI_MAX_THREADS 1024u
#define CLI_MAX_PAGE_BYTES (1ull << 30)
/* c against those limits. geometry_from NULL: the geometry came from the --heads,
 * --kv-heads and --head-dim options (the message names them); otherwise it names its
 * source (e.g. the model file). --threads and --block-tokens are always options.
 * CLI_OK, or CLI_USAGE after the message. */
int cli_check_limits(const char *cmd, const pkv_config *c, const char *geometry_from);

/* Memory guards, before allocating: a typo like `--ctx 1g` for `1k` must not run into
 * the OOM killer on a shared machine.
 * cli_phys_mem_bytes: sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE); 0 if unknown.
 * cli_memory_guard: CLI_OK when force, limit == 0 (unknown) or need <= limit; else
 *   CLI_USAGE after "WHAT needs NEED bytes (..), more than LIMIT_WHAT, LIMIT bytes (..);
 *   add --force to do it anyway" (WHAT and LIMIT_WHAT are the caller's words). */
uint64_t cli_avail_mem_bytes(void);
int cli_memory_guard(const char *cmd, const char *what, uint64_t need, uint64_t limit,
                     const char *limit_what, bool force);

/* Ctrl-C for long-running commands: cli_sigint_catch() installs a handler that only
 * sets a flag (and clears it); cli_interrupted() reads it; cli_sigint_restore() puts
 * back the previous handler. Exit status after an interrupt: CLI_INTERRUPTED. */
#define CLI_INTERRUPTED 130
void cli_sigint_catch(void);
bool cli_interrupted(void);
void cli_sigint_restore(void);

/* ---- the command line, the host, the JSON envelope ------------------------------
 * cli_set_command_line keeps argv as main got it (before a parser permutes it);
 * cli_command_line gives it back (count in *argc). The tool's only other
 * process-wide state besides the SIGINT flag. */
void cli_set_command_line(int argc, char **argv);
const char *const *cli_command_line(int *argc);
/* The host's name (gethostname, "?" if unknown), the CPU's model name
 * (/proc/cpuinfo's first "model name", "?" if none), the online CPUs. */
const char *cli_host_name(void);
const char *cli_cpu_name(void);
uint32_t cli_online_cpus(void);
/* The kernels an engine of this process picks (pkv_stats.isa of a small engine:
 * PKV_FORCE_ISA applies); "?" if none can be made. A string of the library's. */
const char *cli_default_isa(void);
/* The first fields of every --json document, in this order and with these names:
 * tool ("pagedkv", or cli_set_program's name), command (cmd), version (pkv_version()),
 * isa (the kernels the run used; NULL: cli_default_isa()), host, cpu, online_cpus,
 * argv (the command line as main got it, a list of strings). W must have just opened the top-level object. */
void cli_json_envelope(json_writer *W, const char *cmd, const char *isa);
/* "threads T, ISA, host H (CPU)", for plots: what ran where (buf of cap bytes). */
const char *cli_run_where(char *buf, size_t cap, uint32_t threads, const char *isa);

double cli_now(void);                  /* monotonic seconds */
uint64_t cli_peak_rss_bytes(void);     /* getrusage ru_maxrss */
uint64_t cli_rss_bytes(void);          /* resident now (/proc/self/statm); 0 if unreadable */
/* Human-readable bytes ("1.00 GiB") into buf (>= 32 bytes); returns buf. */
const char *cli_bytes(uint64_t b, char *buf);

#endif

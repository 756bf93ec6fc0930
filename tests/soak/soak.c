/*
 * soak/soak.c - `pagedkv-soak`: a model-based soak test. Thousands of sessions take
 * random operations (create, append, prefill, decode, decode_batch, fork, verify +
 * commit, truncate, destroy, save/load) under a tight memory budget with spill, and
 * every result is checked against a trivial model kept beside the engine.
 *
 * A test program, built with the tests (build/tests/pagedkv-soak; test_soak.c runs
 * it) and never installed: it is not part of the `pagedkv` command. It keeps the
 * tools' conventions (tools/common: options, messages, JSON).
 *
 * Owns: the options, the engine and the spill directory, the run loop with the checks
 * after every step (pkv_engine_check, the budget), the spill accounting, the final
 * sweep, the teardown check and the summary. Does not own: the model (per session and
 * layer, every appended K/V row, dtype-rounded), the double-precision reference decode
 * and the operation mix (soak/model.c, sharing the state of soak.h); anything in the
 * library. Public API only: pkv_engine_check after every step, and soak/model.c reads
 * block tables (pkv_session_pages: residency, refs) to count pages read back from and
 * dropped in the spill file. Neither writes library state.
 *
 * Invariants checked (a failure prints the seed, the op number and what differed, and
 * exits 1):
 *   - decode (single, batch, prefill, after fork, after load) is within
 *     1e-5 * max|V| of the double reference on the model's rounded K/V;
 *   - batch == single decode, twin (fork) == original, loaded == saved,
 *     prefill == decode: memcmp;
 *   - pkv_session_len and pkv_session_memory agree with the model after every step
 *     that touched a session; pkv_engine_check (docs/design.md) holds after every
 *     step; resident + cached pages never exceed the budget;
 *   - statuses: OK wherever the budget provably suffices (a decode's pages <= budget),
 *     PKV_ESTATE for an empty layer, PKV_ERANGE for truncating past every layer, and
 *     OK or PKV_ENOMEM (nothing changed) for a batch whose pages exceed the budget;
 *   - at the end, every session destroyed: no page in use or spilled, and the pool's
 *     jemalloc arena holds its free cache only.
 * Memory stays bounded: histories are capped (a session about to pass its cap is
 * truncated first) and slots are recycled: the model needs at most
 * sessions * layers * cap * 2 * g * d floats.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/json.h"
#include "common/opt.h"
#include "soak/soak.h"
#if PKV_TOOLS_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#define CMD "soak"

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pagedkv-soak [OPTIONS]\n\n"
        "Model-based soak: thousands of sessions take random operations (create, append,\n"
        "prefill, decode, decode_batch, fork, verify + commit, truncate, destroy,\n"
        "save/load) under a tight memory budget with spill. Every decode and verified\n"
        "draft is checked against a double-precision reference on the model's K/V\n"
        "(tolerance 1e-5 * max|V|); batch, fork twins, loaded copies and decodes after\n"
        "a commit are checked bitwise; pool invariants after every step.\n\n"
        "  --ops N            operations to run (default 20000 without --minutes)\n"
        "  --minutes M        run for M minutes (fractional allowed; with --ops, the\n"
        "                     first limit reached ends the run)\n"
        "  --seed S           random seed (default 1); a failure prints it\n"
        "  --sessions N       session slots (default 2000)\n"
        "  --budget-pages N   resident page budget (default 384)\n"
        "  --spill-dir DIR    spill and save files there (default: a fresh directory\n"
        "                     under /tmp, removed at the end)\n"
        "  --dtype T          K/V storage type: f32 (default), f16, bf16, q8, q4\n"
        "  --threads N        engine threads (default 0: all CPUs)\n"
        "  --max-len N        history cap of a session, per layer (default 48)\n"
        "  --long-len N       cap of the 1-in-32 long sessions, created half to fully\n"
        "                     filled (default 1100: split-K decodes; 0: none)\n"
        "  --layers L --heads H --kv-heads G --head-dim D --block-tokens B\n"
        "                     geometry (default 2, 4, 2, 8, 4)\n"
        "  --json             one JSON object on stdout instead of the table\n"
        "  --help             this text\n\n"
        "Exit 0 when every check held, 1 when one failed (seed, op number and the\n"
        "difference on stderr) or the library failed, 2 on a usage error, 130 on Ctrl-C.\n");
}

/* ---- options -------------------------------------------------------------------- */

static int parse_opts(int argc, char **argv, soak_opts *o)
{
    *o = (soak_opts){.ops = 20000, .seed = 1, .budget_pages = 384, .sessions = 2000,
                     .layers = 2, .heads = 4, .kv_heads = 2, .head_dim = 8,
                     .block_tokens = 4, .max_len = 48, .long_len = 1100, .dtype = PKV_F32};
    static const char *const small = "a soak's limit: the model holds every row";
    const cli_opt opts[] = {
        {.name = "ops", .kind = OPT_U64, .dst = &o->ops, .lo = 1, .hi = UINT64_MAX,
         .seen = &o->ops_set},
        {.name = "minutes", .kind = OPT_DOUBLE, .dst = &o->minutes, .dlo = 1e-9,
         .dhi = 1e9, .seen = &o->minutes_set},
        {.name = "seed", .kind = OPT_U64, .dst = &o->seed, .lo = 0, .hi = UINT64_MAX},
        {.name = "sessions", .kind = OPT_U32, .dst = &o->sessions, .lo = 2, .hi = 1000000,
         .note = "a fork needs a second slot"},
        {.name = "budget-pages", .kind = OPT_U64, .dst = &o->budget_pages, .lo = 0,
         .hi = UINT64_MAX / (1ull << 32)},
        {.name = "spill-dir", .kind = OPT_STRING, .dst = &o->spill_dir},
        {.name = "dtype", .kind = OPT_DTYPE, .dst = &o->dtype},
        {.name = "threads", .kind = OPT_U32, .dst = &o->threads, .lo = 0,
         .hi = CLI_MAX_THREADS, .note = "0 = all CPUs; the engine's limit"},
        {.name = "max-len", .kind = OPT_U32, .dst = &o->max_len, .lo = 1, .hi = 65536,
         .note = small},
        {.name = "long-len", .kind = OPT_U32, .dst = &o->long_len, .lo = 0, .hi = 65536,
         .note = small},
        {.name = "layers", .kind = OPT_U32, .dst = &o->layers, .lo = 1, .hi = 64,
         .note = small},
        {.name = "heads", .kind = OPT_U32, .dst = &o->heads, .lo = 1, .hi = 64,
         .note = small},
        {.name = "kv-heads", .kind = OPT_U32, .dst = &o->kv_heads, .lo = 1, .hi = 64,
         .note = small},
        {.name = "head-dim", .kind = OPT_U32, .dst = &o->head_dim, .lo = 1, .hi = 256,
         .note = small},
        {.name = "block-tokens", .kind = OPT_U32, .dst = &o->block_tokens, .lo = 1,
         .hi = 1024, .note = small},
        {.name = "json", .kind = OPT_FLAG, .dst = &o->json},
        /* hidden: corrupt the model once, to prove that a soak can fail */
        {.name = "inject-bug", .kind = OPT_FLAG, .dst = &o->inject_bug},
    };
    int rc = cli_parse(CMD, argc, argv, opts, sizeof opts / sizeof opts[0], usage, NULL, 0,
                       NULL);
    if (rc != CLI_OK)
        return rc;
    const char *why =
        o->heads % o->kv_heads ? "--heads must be a multiple of --kv-heads"
        : o->long_len && o->long_len < o->max_len ? "--long-len must be 0 or >= --max-len"
        : NULL;
    if (why)
        return cli_usage_error(CMD, "%s", why);
    /* A decode pins a whole layer and an append up to two pages, so the budget must hold
     * the longest layer plus two; below that PKV_ENOMEM would be legitimate. */
    uint64_t cap = o->long_len > o->max_len ? o->long_len : o->max_len;
    uint64_t need = (cap + o->block_tokens - 1) / o->block_tokens + 2;
    if (o->budget_pages < need)
        return cli_usage_error(CMD, "--budget-pages must be at least " U64 " (the longest "
                               "layer's pages + 2)", need);
    if (o->spill_dir && strlen(o->spill_dir) > 400)   /* S->dir and the save path */
        return cli_usage_error(CMD, "--spill-dir: '%s' is too long (400 bytes at most)",
                               o->spill_dir);
    if (o->spill_dir && cli_check_dir(CMD, "--spill-dir", o->spill_dir) != CLI_OK)
        return CLI_USAGE;
    if (o->minutes_set && !o->ops_set)
        o->ops = UINT64_MAX;
    return CLI_OK;
}

/* ---- the run ------------------------------------------------------------------------ */

/* Resident set size. With purge, hand freed memory back first: the process malloc is
 * jemalloc here (Debian's has no prefix), which keeps dirty pages for a while. */
static uint64_t rss_now(bool purge)
{
#if PKV_TOOLS_JEMALLOC
    char name[64];
    snprintf(name, sizeof name, "arena.%u.purge", (unsigned)MALLCTL_ARENAS_ALL);
    if (purge && mallctl("thread.tcache.flush", NULL, NULL, NULL, 0) == 0)
        mallctl(name, NULL, NULL, NULL, 0);
#else
    (void)purge;
#endif
    return cli_rss_bytes();
}

static bool setup(soak *S)
{
    const soak_opts *o = &S->o;
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim, o->block_tokens,
                              o->dtype, o->threads);
    S->page_bytes = (uint64_t)o->block_tokens * cli_token_layer_bytes(&c);
    c.mem_budget = o->budget_pages * S->page_bytes;
    c.spill_dir = S->dir;
    pkv_status st = pkv_engine_create(&c, &S->e);
    if (st != PKV_OK) {
        char why[256] = "";
        pkv_config_explain(&c, why, sizeof why);
        return soak_fail(S, "pkv_engine_create: %s%s%s", pkv_status_str(st), why[0] ? ": " : "",
                         why);
    }
    pkv_engine_config(S->e, &S->cfg);
    S->kd = o->kv_heads * o->head_dim;
    S->qd = o->heads * o->head_dim;
    const uint32_t cap = o->long_len > o->max_len ? o->long_len : o->max_len;
    S->q = calloc((2 * SOAK_MAX_BATCH + 1) * (size_t)S->qd, sizeof(float));
    S->k = calloc(16 * (size_t)S->kd, sizeof(float));
    S->w = calloc((size_t)cap + o->head_dim, sizeof(double));
    S->pg = calloc((size_t)SOAK_MAX_BATCH * soak_pages_of(S, cap), sizeof *S->pg);
    S->n_pi = soak_pages_of(S, cap) + 1;
    S->pi = calloc(S->n_pi, sizeof *S->pi);
    S->slots = calloc(o->sessions, sizeof *S->slots);
    if (!S->q || !S->k || !S->w || !S->pg || !S->pi || !S->slots)
        return soak_fail(S, "out of memory");
    S->out = S->q + (size_t)SOAK_MAX_BATCH * S->qd;
    S->out2 = S->out + (size_t)SOAK_MAX_BATCH * S->qd;
    S->v = S->k + 8 * (size_t)S->kd;
    S->acc = S->w + cap;
    uint64_t z = o->seed + 0x9e3779b97f4a7c15ull;   /* splitmix64: any seed, nonzero state */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    S->rng = (z ^ (z >> 31)) | 1;
    return true;
}

/* One step and the checks after every step; the spill accounting. */
static bool step_checked(soak *S, pkv_stats *st)
{
    S->op++;
    S->reads = S->drops = 0;
    const uint64_t spilled0 = st->pages_spilled;
    bool ok = soak_step(S);
    if (pkv_engine_stats(S->e, st) != PKV_OK)
        return soak_fail(S, "pkv_engine_stats failed");
    /* Pages written to the spill file: what the spilled count gained, plus what it lost
     * to reads and to dropped spilled pages (a lower bound where a step reads one page
     * twice, e.g. a save after the page was spilled again). */
    const int64_t w = (int64_t)(st->pages_spilled - spilled0) + (int64_t)S->reads +
                      (int64_t)S->drops;
    S->c.spill_written += w > 0 ? (uint64_t)w : 0;
    S->c.spill_read += S->reads;
    S->c.spilled_peak = st->pages_spilled > S->c.spilled_peak ? st->pages_spilled
                                                              : S->c.spilled_peak;
    S->c.inv_checks++;
    if (ok && pkv_engine_check(S->e) != PKV_OK)
        return soak_fail(S, "pool invariants broken (pkv_engine_check)");
    if (ok && st->pages_in_use + st->pages_free > S->o.budget_pages)
        return soak_fail(S, U64 " resident + " U64 " cached pages exceed the budget of " U64,
                         st->pages_in_use, st->pages_free, S->o.budget_pages);
    return ok;
}

/* Destroy every session; then nothing may be in use or spilled, and the pool's arena
 * may hold its free cache only (jemalloc rounds a page up to its size class). */
static bool teardown_check(soak *S, pkv_stats *end, uint64_t alloc0)
{
    for (uint32_t a = 0; a < S->o.sessions; a++)
        soak_slot_clear(S, &S->slots[a]);
    if (pkv_engine_stats(S->e, end) != PKV_OK || pkv_engine_check(S->e) != PKV_OK)
        return soak_fail(S, "engine unsound after destroying every session");
    const uint64_t pb = end->page_bytes, cached = end->bytes_allocator - alloc0;
    if (end->pages_in_use || end->pages_spilled || end->bytes_allocator < alloc0 ||
        cached < end->pages_free * pb || cached > end->pages_free * (pb + pb / 4 + 64))
        return soak_fail(S, "after destroying every session: " U64 " pages in use, " U64
                         " spilled, " U64 " cached; allocator " U64 " B (" U64 " B at start)",
                         end->pages_in_use, end->pages_spilled, end->pages_free,
                         end->bytes_allocator, alloc0);
    return true;
}

static void report(const soak *S, const pkv_stats *st, double secs, const uint64_t rss[3],
                   uint64_t alloc0, bool ok)
{
    const soak_counters *c = &S->c;
    const uint64_t pb = S->page_bytes;
    const struct { const char *k; uint64_t v; } kv[] = {
        {"ops", S->op}, {"sessions_created", c->created}, {"forks", c->forks},
        {"destroys", c->destroys}, {"max_sessions_alive", c->max_alive},
        {"tokens_appended", c->tokens}, {"prefills", c->prefills},
        {"decodes", c->decodes}, {"split_k_decodes", c->split_decodes},
        {"batches", c->batches}, {"verifies", c->verifies}, {"commits", c->commits},
        {"truncates", c->truncates},
        {"save_loads", c->saves},
        {"checks", c->inv_checks + c->ref_checks + c->bit_checks},
        {"invariant_checks", c->inv_checks}, {"reference_checks", c->ref_checks},
        {"bitwise_checks", c->bit_checks}, {"expected_errors", c->expected_errors},
        {"spill_pages_written", c->spill_written}, {"spill_pages_read", c->spill_read},
        {"spill_bytes_written", c->spill_written * pb},
        {"spill_bytes_read", c->spill_read * pb}, {"spilled_pages_peak", c->spilled_peak},
        {"pages_in_use_end", st->pages_in_use}, {"pages_spilled_end", st->pages_spilled},
        {"pages_free_end", st->pages_free}, {"allocator_bytes_start", alloc0},
        {"allocator_bytes_end", st->bytes_allocator}, {"rss_start", rss[0]},
        {"rss_end", rss[1]}, {"rss_peak", rss[2]}, {"seed", S->o.seed},
        {"sessions", S->o.sessions}, {"budget_pages", S->o.budget_pages},
        {"page_bytes", pb}};
    const size_t n = sizeof kv / sizeof kv[0];
    const double rate = secs > 0 ? (double)S->op / secs : 0;
    FILE *f = stdout;
    if (!S->o.json) {
        fprintf(f, "pagedkv-soak: %s: " U64 " ops in %.2f s (%.0f ops/s), seed " U64 "\n"
                   "  %u layers, h=%u, g=%u, d=%u, bt=%u, %s; isa %s, io %s, %u threads\n",
                ok ? "all checks held" : "FAILED", S->op, secs, rate, S->o.seed,
                S->cfg.n_layers, S->cfg.n_heads, S->cfg.n_kv_heads, S->cfg.head_dim,
                S->cfg.block_tokens, pkv_dtype_name(S->cfg.kv_dtype), st->isa,
                st->io_backend, S->cfg.n_threads);
        for (size_t i = 1; i + 1 < n; i += 2)   /* two columns; ops is in the title */
            fprintf(f, "  %-22s %14" PRIu64 "    %-22s %14" PRIu64 "\n", kv[i].k, kv[i].v,
                    kv[i + 1].k, kv[i + 1].v);
        fprintf(f, "  %-22s %14.3g    (bound 1e-5)\n", "max_err / max|V|", c->max_rel_err);
        return;
    }
    json_writer w = {f, true, true}, *W = &w;
    json_open(W, NULL, '{');
    cli_json_envelope(W, CMD, st->isa);
    json_bool(W, "ok", ok);
    json_fmt(W, "seconds", "%.3f", secs);
    json_fmt(W, "ops_per_s", "%.1f", rate);
    json_str(W, "dtype", pkv_dtype_name(S->cfg.kv_dtype));
    json_str(W, "io_backend", st->io_backend);
    for (size_t i = 0; i < n; i++)
        json_u64(W, kv[i].k, kv[i].v);
    json_fmt(W, "max_err_over_max_v", "%.3g", c->max_rel_err);
    json_bool(W, "inject_bug", S->o.inject_bug);
    json_str(W, "failure", ok ? "" : S->failed ? S->fail : "interrupted");
    json_close(W, '}');
    fputc('\n', f);
}

int main(int argc, char **argv)
{
    cli_set_command_line(argc, argv);
    cli_set_program("pagedkv-soak");
    soak *S = calloc(1, sizeof *S);
    int rc = S ? parse_opts(argc, argv, &S->o) : cli_fail(CMD, "out of memory");
    if (rc != CLI_OK) {
        free(S);
        return rc == CLI_HELP ? CLI_OK : rc;
    }
    uint64_t rss[3] = {rss_now(false), 0, 0};
    snprintf(S->dir, sizeof S->dir, "%s", S->o.spill_dir ? S->o.spill_dir
                                                         : "/tmp/pagedkv-soak-XXXXXX");
    if (!S->o.spill_dir && !(S->own_dir = mkdtemp(S->dir) != NULL)) {
        free(S);
        return cli_fail(CMD, "cannot create a directory under /tmp: %s", strerror(errno));
    }
    snprintf(S->save_path, sizeof S->save_path, "%s/pagedkv-soak-%ld.pkv", S->dir,
             (long)getpid());
    cli_sigint_catch();

    pkv_stats st;
    memset(&st, 0, sizeof st);
    const double t0 = cli_now();
    double shown = t0;
    bool ok = setup(S) && pkv_engine_stats(S->e, &st) == PKV_OK;
    const uint64_t alloc0 = st.bytes_allocator;
    const bool tty = !S->o.json && isatty(2);
    while (ok && !cli_interrupted() && S->op < S->o.ops) {
        const double now = (S->op & 63) == 0 ? cli_now() : t0;
        if (S->o.minutes_set && now - t0 >= S->o.minutes * 60)
            break;
        if (tty && now - shown >= 1.0) {
            fprintf(stderr, "\rsoak: op " U64 ", " U64 " sessions, " U64 " pages on disk ",
                    S->op, S->c.alive, st.pages_spilled);
            shown = now;
        }
        ok = step_checked(S, &st);
    }
    if (tty)
        fprintf(stderr, "\r%60s\r", "");
    /* Final sweep: every live session, every layer, against the model. */
    for (uint32_t a = 0; ok && !cli_interrupted() && a < S->o.sessions; a++)
        for (uint32_t l = 0; S->slots[a].s && ok && l < S->cfg.n_layers; l++) {
            soak_random_q(S, S->q);
            ok = soak_check_lens(S, a) &&
                 (!S->slots[a].h[l].len ||
                  soak_decode_checked(S, a, l, S->q, S->out, "final sweep"));
        }
    const double secs = cli_now() - t0;
    if (S->e && S->slots)
        teardown_check(S, &st, alloc0);
    pkv_engine_destroy(S->e);
    free(S->q), free(S->k), free(S->w), free(S->pg), free(S->pi), free(S->slots);
    unlink(S->save_path);
    if (S->own_dir && rmdir(S->dir) != 0)
        fprintf(stderr, "pagedkv-soak: warning: cannot remove %s: %s\n", S->dir,
                strerror(errno));
    cli_sigint_restore();
    rss[1] = rss_now(true);
    rss[2] = cli_peak_rss_bytes();
    if (S->o.inject_bug && !S->injected)
        fprintf(stderr, "pagedkv-soak: warning: --inject-bug found no op to corrupt\n");
    report(S, &st, secs, rss, alloc0, !S->failed && !cli_interrupted());
    if (S->failed)
        fprintf(stderr, "pagedkv-soak: check failed at %s\npagedkv-soak: reproduce with "
                        "the same options, --seed " U64 " --ops " U64 "\n", S->fail,
                S->o.seed, S->op);
    rc = S->failed ? CLI_FAIL : cli_interrupted() ? CLI_INTERRUPTED : CLI_OK;
    free(S);
    return rc;
}

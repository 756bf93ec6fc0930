/*
 * cmd_soak.c - `pagedkv soak`: a model-based soak test. Thousands of sessions take
 * random operations (create, append, prefill, decode, decode_batch, fork, truncate,
 * destroy, save/load) under a tight memory budget with spill, and every result is
 * checked against a trivial model kept beside the engine.
 *
 * Owns: the model (per session and layer, every appended K/V row, dtype-rounded), the
 * double-precision reference decode, the operation mix, the spill accounting and the
 * summary. Does not own anything in the library. Unlike the other subcommands it
 * includes "internal.h": it calls pkvi_engine_check after every step and reads block
 * tables (page residency, refs) to count pages read back from and dropped in the spill
 * file. It never writes library state.
 *
 * Invariants checked (a failure prints the seed, the op number and what differed, and
 * exits 1):
 *   - decode (single, batch, prefill, after fork, after load) is within
 *     1e-5 * max|V| of the double reference on the model's rounded K/V;
 *   - batch == single decode, twin (fork) == original, loaded == saved,
 *     prefill == decode: memcmp;
 *   - pkv_session_len and pkv_session_memory agree with the model after every step
 *     that touched a session; pkvi_engine_check (I1..I5, no pins) holds after every
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
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "internal.h"
#if PKV_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#define CMD "soak"
#define MAX_BATCH 64u /* sessions in one pkv_decode_batch call */
#define U64 "%" PRIu64

typedef struct {
    uint64_t ops, seed, budget_pages;
    double minutes;
    uint32_t sessions, threads, layers, heads, kv_heads, head_dim, block_tokens;
    uint32_t max_len, long_len;
    pkv_dtype dtype;
    const char *spill_dir;
    bool json, inject_bug, ops_set, minutes_set;
} soak_opts;

typedef struct {            /* the model of one layer of one session */
    float *k, *v;           /* [cap][g*d] K and V rows as stored (dtype-rounded) */
    uint32_t len;
} hist;

typedef struct {
    pkv_session *s;         /* NULL: the slot is free */
    hist *h;                /* [layers] */
    uint32_t cap;           /* longest history of this session (max_len or long_len) */
} slot;

typedef struct {
    uint64_t created, forks, destroys, truncates, tokens, prefills, decodes, batches;
    uint64_t saves, inv_checks, ref_checks, bit_checks, expected_errors, split_decodes;
    uint64_t spill_written, spill_read, spilled_peak, alive, max_alive;
    double max_rel_err;     /* largest |out - ref| / max|V| seen */
} counters;

typedef struct {
    soak_opts o;
    pkv_engine *e;
    pkv_config cfg;         /* as resolved by the engine */
    uint32_t kd, qd;        /* g*d, h*d */
    uint64_t page_bytes;
    slot *slots;            /* [sessions] */
    uint64_t rng;
    float *q, *out, *out2;  /* [MAX_BATCH][h*d] twice, then [h*d]; one allocation */
    float *k, *v;           /* [8][g*d] each; one allocation */
    double *w, *acc;        /* [longest cap] scores, then [d]; one allocation */
    pkvi_page **pg;         /* [MAX_BATCH * pages of the longest layer] */
    char dir[512], save_path[600];
    bool own_dir, injected, failed;
    uint64_t op, reads, drops;       /* op number (1-based); this op's spill reads/drops */
    char fail[1024];
    counters c;
} soak;

static void usage(FILE *f)
{
    fprintf(f,
        "usage: pagedkv soak [OPTIONS]\n\n"
        "Model-based soak: thousands of sessions take random operations (create, append,\n"
        "prefill, decode, decode_batch, fork, truncate, destroy, save/load) under a tight\n"
        "memory budget with spill. Every decode is checked against a double-precision\n"
        "reference on the model's K/V (tolerance 1e-5 * max|V|); batch, fork twins and\n"
        "loaded copies are checked bitwise; pool invariants after every step.\n\n"
        "  --ops N            operations to run (default 20000 without --minutes)\n"
        "  --minutes M        run for M minutes (fractional allowed; with --ops, the\n"
        "                     first limit reached ends the run)\n"
        "  --seed S           random seed (default 1); a failure prints it\n"
        "  --sessions N       session slots (default 2000)\n"
        "  --budget-pages N   resident page budget (default 384)\n"
        "  --spill-dir DIR    spill and save files there (default: a fresh directory\n"
        "                     under /tmp, removed at the end)\n"
        "  --dtype f32|f16|bf16  K/V storage type (default f32)\n"
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

typedef struct { const char *name; uint32_t *u32; uint64_t *u64; } num_opt;

static int parse_opts(int argc, char **argv, soak_opts *o, bool *help)
{
    *o = (soak_opts){.ops = 20000, .seed = 1, .budget_pages = 384, .sessions = 2000,
                     .layers = 2, .heads = 4, .kv_heads = 2, .head_dim = 8,
                     .block_tokens = 4, .max_len = 48, .long_len = 1100, .dtype = PKV_F32};
    const num_opt nums[] = {
        {"--ops", NULL, &o->ops},            {"--seed", NULL, &o->seed},
        {"--budget-pages", NULL, &o->budget_pages}, {"--sessions", &o->sessions, NULL},
        {"--threads", &o->threads, NULL},    {"--layers", &o->layers, NULL},
        {"--heads", &o->heads, NULL},        {"--kv-heads", &o->kv_heads, NULL},
        {"--head-dim", &o->head_dim, NULL},  {"--block-tokens", &o->block_tokens, NULL},
        {"--max-len", &o->max_len, NULL},    {"--long-len", &o->long_len, NULL},
    };
    *help = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            *help = true;
            return CLI_OK;
        }
        if (strcmp(a, "--json") == 0) { o->json = true; continue; }
        /* hidden: corrupt the model once, to prove that a soak can fail */
        if (strcmp(a, "--inject-bug") == 0) { o->inject_bug = true; continue; }
        const num_opt *n = NULL;
        for (size_t j = 0; j < sizeof nums / sizeof nums[0]; j++)
            if (strcmp(a, nums[j].name) == 0)
                n = &nums[j];
        if (!n && strcmp(a, "--dtype") && strcmp(a, "--spill-dir") && strcmp(a, "--minutes"))
            return cli_usage_error(CMD, "unknown option '%s'", a);
        const char *v = cli_value(CMD, argc, argv, &i);
        if (!v)
            return CLI_USAGE;
        if (n) {
            if (!(n->u32 ? cli_parse_u32(v, n->u32) : cli_parse_u64(v, n->u64)))
                return cli_usage_error(CMD, "%s: '%s' is not a non-negative integer", a, v);
            o->ops_set |= n->u64 == &o->ops;
        } else if (strcmp(a, "--dtype") == 0) {
            if (!cli_parse_dtype(v, &o->dtype))
                return cli_usage_error(CMD, "--dtype: '%s' is not f32, f16 or bf16", v);
        } else if (strcmp(a, "--spill-dir") == 0) {
            o->spill_dir = v;
        } else {
            if (!cli_parse_double(v, &o->minutes) || !(o->minutes > 0))
                return cli_usage_error(CMD, "--minutes: '%s' is not a positive number", v);
            o->minutes_set = true;
        }
    }
    const char *why =
        !o->ops ? "--ops must be greater than 0"
        : o->sessions < 2 ? "--sessions must be at least 2 (a fork needs a second slot)"
        : !o->layers || !o->heads || !o->kv_heads || !o->head_dim || !o->block_tokens ||
          !o->max_len ? "the geometry and --max-len must be greater than 0"
        : o->heads % o->kv_heads ? "--heads must be a multiple of --kv-heads"
        : o->heads > 64 || o->head_dim > 256 || o->layers > 64 || o->block_tokens > 1024 ||
          o->max_len > 65536 || o->long_len > 65536 || o->sessions > 1000000
            ? "too large for a soak: heads <= 64, head-dim <= 256, layers <= 64, "
              "block-tokens <= 1024, max-len and long-len <= 65536, sessions <= 1000000"
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
    struct stat sb;
    if (o->spill_dir && (stat(o->spill_dir, &sb) != 0 || !S_ISDIR(sb.st_mode) ||
                         strlen(o->spill_dir) > 400))
        return cli_usage_error(CMD, "--spill-dir: '%s' is not a directory (or too long)",
                               o->spill_dir);
    if (o->minutes_set && !o->ops_set)
        o->ops = UINT64_MAX;
    return CLI_OK;
}

/* ---- helpers: random numbers, failures, the model ------------------------------- */

static uint64_t rnd(soak *S)   /* xorshift64* */
{
    S->rng ^= S->rng >> 12;
    S->rng ^= S->rng << 25;
    S->rng ^= S->rng >> 27;
    return S->rng * 0x2545f4914f6cdd1dull;
}

static uint32_t below(soak *S, uint32_t n)
{
    return n ? (uint32_t)((rnd(S) >> 32) % n) : 0;
}

static void fill(soak *S, float *x, size_t n, float amp)   /* uniform in [-amp, amp) */
{
    for (size_t i = 0; i < n; i++)
        x[i] = amp * (float)((double)(rnd(S) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* q [h][d] with a random amplitude: peaked and flat softmax both get exercised. */
static void random_q(soak *S, float *q)
{
    static const float amp[] = {0.25f, 1.0f, 2.0f, 6.0f};
    fill(S, q, S->qd, amp[below(S, 4)]);
}

/* Record the first failure; returns false so checks chain with `return fail(...)`. */
static bool fail(soak *S, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(soak *S, const char *fmt, ...)
{
    if (S->failed)
        return false;
    S->failed = true;
    int n = snprintf(S->fail, sizeof S->fail, "op " U64 " (seed " U64 "): ", S->op,
                     S->o.seed);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof S->fail)
        vsnprintf(S->fail + n, sizeof S->fail - (size_t)n, fmt, ap);
    va_end(ap);
    return false;
}

static bool expect(soak *S, pkv_status got, pkv_status want, const char *what, uint32_t a)
{
    if (got == want)
        return true;
    return fail(S, "%s on slot %u returned %s, expected %s", what, a, pkv_status_str(got),
                pkv_status_str(want));
}

static uint32_t max_len_of(const soak *S, const slot *sl)
{
    uint32_t m = 0;
    for (uint32_t l = 0; l < S->cfg.n_layers; l++)
        m = sl->h[l].len > m ? sl->h[l].len : m;
    return m;
}

static uint64_t pages_of(const soak *S, uint64_t len)
{
    return (len + S->cfg.block_tokens - 1) / S->cfg.block_tokens;
}

static void note_alive(soak *S)
{
    if (++S->c.alive > S->c.max_alive)
        S->c.max_alive = S->c.alive;
}

/* Spilled pages of `layer` from page `first` on (what a decode or append reads back). */
static uint64_t spilled_in(const pkv_session *s, uint32_t layer, uint64_t first)
{
    const pkvi_layer *L = &s->layers[layer];
    uint64_t n = 0;
    for (uint64_t i = first; i < L->n_pages; i++)
        n += L->pages[i]->data == NULL;
    return n;
}

/* Spilled pages only s holds past `keep` tokens: truncate/destroy drop them. */
static uint64_t spilled_alone(const soak *S, const pkv_session *s, uint64_t keep)
{
    uint64_t n = 0;
    for (uint32_t l = 0; l < S->cfg.n_layers; l++) {
        const pkvi_layer *L = &s->layers[l];
        for (uint64_t i = pages_of(S, keep < L->len ? keep : L->len); i < L->n_pages; i++)
            n += !L->pages[i]->data && L->pages[i]->refs == 1;
    }
    return n;
}

/* Append one token (raw k, v [g][d]) to the model, rounded as the cache stores it. */
static void model_append(soak *S, hist *H, const float *k, const float *v)
{
    for (uint32_t i = 0; i < S->kd; i++) {
        H->k[(size_t)H->len * S->kd + i] = pkv_dtype_round(S->cfg.kv_dtype, k[i]);
        H->v[(size_t)H->len * S->kd + i] = pkv_dtype_round(S->cfg.kv_dtype, v[i]);
    }
    H->len++;
}

/* A fresh model for slot sl, or a copy of src's when src is not NULL. */
static bool model_new(soak *S, slot *sl, uint32_t cap, const slot *src)
{
    sl->cap = src ? src->cap : cap;
    sl->h = calloc(S->cfg.n_layers, sizeof *sl->h);
    const size_t bytes = (size_t)sl->cap * S->kd * sizeof(float);
    for (uint32_t l = 0; sl->h && l < S->cfg.n_layers; l++) {
        hist *H = &sl->h[l];
        if (!(H->k = malloc(bytes)) || !(H->v = malloc(bytes)))
            return fail(S, "out of memory for the model");
        if (src) {
            H->len = src->h[l].len;
            memcpy(H->k, src->h[l].k, (size_t)H->len * S->kd * sizeof(float));
            memcpy(H->v, src->h[l].v, (size_t)H->len * S->kd * sizeof(float));
        }
    }
    return sl->h ? true : fail(S, "out of memory for the model");
}

/* Destroy the slot's session (counting the spilled pages it drops) and its model. */
static void slot_clear(soak *S, slot *sl)
{
    if (sl->s) {
        S->drops += spilled_alone(S, sl->s, 0);
        pkv_session_destroy(sl->s);
        sl->s = NULL;
        S->c.alive--;
        S->c.destroys++;
    }
    for (uint32_t l = 0; sl->h && l < S->cfg.n_layers; l++) {
        free(sl->h[l].k);
        free(sl->h[l].v);
    }
    free(sl->h);
    sl->h = NULL;
}

/* ---- checks ------------------------------------------------------------------------ */

/* Lengths and pkv_session_memory of slot a against the model. */
static bool check_lens(soak *S, uint32_t a)
{
    const slot *sl = &S->slots[a];
    uint64_t tokens = 0, blocks = 0;
    for (uint32_t l = 0; l < S->cfg.n_layers; l++) {
        uint64_t got = pkv_session_len(sl->s, l);
        if (got != sl->h[l].len)
            return fail(S, "slot %u layer %u: pkv_session_len " U64 ", model %u", a, l,
                        got, sl->h[l].len);
        tokens += got;
        blocks += pages_of(S, got);
    }
    pkv_memory m;
    if (pkv_session_memory(sl->s, &m) != PKV_OK)
        return fail(S, "pkv_session_memory failed on slot %u", a);
    uint64_t token_bytes = 2ull * S->kd * pkv_dtype_size(S->cfg.kv_dtype);
    if (m.tokens != tokens || m.blocks != blocks ||
        m.bytes_resident + m.bytes_spilled != blocks * S->page_bytes ||
        m.bytes_ideal != tokens * token_bytes || m.bytes_shared > m.bytes_resident)
        return fail(S, "slot %u: pkv_session_memory says " U64 " tokens, " U64 " pages, "
                    U64 " B resident, " U64 " B spilled, " U64 " B ideal; the model: " U64
                    " tokens in " U64 " pages of " U64 " B", a, m.tokens, m.blocks,
                    m.bytes_resident, m.bytes_spilled, m.bytes_ideal, tokens, blocks,
                    S->page_bytes);
    return true;
}

/* out [h][d] against the double reference over the first n tokens of H. */
static bool check_ref(soak *S, const hist *H, uint32_t n, const float *q, const float *out,
                      const char *what, uint32_t a, uint32_t layer)
{
    const uint32_t h = S->cfg.n_heads, d = S->cfg.head_dim, hg = h / S->cfg.n_kv_heads;
    double vmax = 0;
    for (size_t i = 0; i < (size_t)n * S->kd; i++)
        vmax = fmax(vmax, fabs((double)H->v[i]));
    const double tol = 1e-5 * vmax;
    S->c.ref_checks++;
    for (uint32_t i = 0; i < h; i++) {
        const float *qi = q + (size_t)i * d;
        const size_t off = (size_t)(i / hg) * d;   /* query head i reads group i / hg */
        double m = -INFINITY, sum = 0;
        for (uint32_t j = 0; j < n; j++) {
            const float *kj = H->k + (size_t)j * S->kd + off;
            double s = 0;
            for (uint32_t x = 0; x < d; x++)
                s += (double)qi[x] * (double)kj[x];
            S->w[j] = s * (double)S->cfg.scale;
            m = fmax(m, S->w[j]);
        }
        memset(S->acc, 0, d * sizeof(double));
        for (uint32_t j = 0; j < n; j++) {
            const double p = exp(S->w[j] - m);
            const float *vj = H->v + (size_t)j * S->kd + off;
            sum += p;
            for (uint32_t x = 0; x < d; x++)
                S->acc[x] += p * (double)vj[x];
        }
        for (uint32_t x = 0; x < d; x++) {
            const double ref = S->acc[x] / sum, got = (double)out[(size_t)i * d + x];
            const double diff = fabs(got - ref);
            if (!(diff <= tol))
                return fail(S, "%s: slot %u layer %u len %u head %u dim %u: got %.9g, "
                            "reference %.9g (|diff| %.3g > tol %.3g = 1e-5 * max|V|)", what,
                            a, layer, n, i, x, got, ref, diff, tol);
            if (vmax > 0 && diff / vmax > S->c.max_rel_err)
                S->c.max_rel_err = diff / vmax;
        }
    }
    return true;
}

static bool check_same(soak *S, const float *x, const float *y, const char *what,
                       uint32_t a, uint32_t layer)
{
    S->c.bit_checks++;
    if (memcmp(x, y, (size_t)S->qd * sizeof(float)) == 0)
        return true;
    uint32_t i = 0;
    while (i + 1 < S->qd && memcmp(&x[i], &y[i], sizeof(float)) == 0)
        i++;
    return fail(S, "%s: slot %u layer %u: not bitwise equal; first difference at [%u]: "
                "%.9g vs %.9g", what, a, layer, i, (double)x[i], (double)y[i]);
}

/* pkv_decode of session s (slot a) that must succeed; counts the pages it reads back. */
static bool decode_ok(soak *S, pkv_session *s, uint32_t a, uint32_t layer, const float *q,
                      float *out, const char *what)
{
    S->reads += spilled_in(s, layer, 0);
    S->c.decodes++;
    return expect(S, pkv_decode(s, layer, q, out), PKV_OK, what, a);
}

/* ... and checked against the reference on slot a's model. */
static bool decode_checked(soak *S, uint32_t a, uint32_t layer, const float *q, float *out,
                           const char *what)
{
    const slot *sl = &S->slots[a];
    S->c.split_decodes += sl->s->layers[layer].n_pages > S->e->chunk_pages;
    return decode_ok(S, sl->s, a, layer, q, out, what) &&
           check_ref(S, &sl->h[layer], sl->h[layer].len, q, out, what, a, layer);
}

/* ---- operations ------------------------------------------------------------------- */

/* Truncate slot a to t tokens; the model says which status is right. */
static bool do_truncate(soak *S, uint32_t a, uint32_t t)
{
    slot *sl = &S->slots[a];
    const pkv_status want = t > max_len_of(S, sl) ? PKV_ERANGE : PKV_OK;
    if (want == PKV_OK)
        S->drops += spilled_alone(S, sl->s, t);
    if (!expect(S, pkv_session_truncate(sl->s, t), want, "pkv_session_truncate", a))
        return false;
    S->c.truncates++;
    S->c.expected_errors += want != PKV_OK;
    for (uint32_t l = 0; want == PKV_OK && l < S->cfg.n_layers; l++)
        sl->h[l].len = sl->h[l].len > t ? t : sl->h[l].len;
    return check_lens(S, a);
}

/* Make room for *n (clamped to the cap) more tokens in `layer`: a session at its cap
 * is first cut back to a random shorter length. */
static bool make_room(soak *S, uint32_t a, uint32_t layer, uint32_t *n)
{
    slot *sl = &S->slots[a];
    *n = *n > sl->cap ? sl->cap : *n;
    if (sl->h[layer].len + *n <= sl->cap)
        return true;
    return do_truncate(S, a, below(S, sl->cap - *n + 1));
}

/* Append n random tokens to `layer` of slot a (the model follows). */
static bool append_n(soak *S, uint32_t a, uint32_t layer, uint32_t n)
{
    slot *sl = &S->slots[a];
    for (uint32_t t = 0; t < n; t++) {
        fill(S, S->k, S->kd, 1.0f);
        fill(S, S->v, S->kd, 1.0f);
        uint64_t np = sl->s->layers[layer].n_pages;
        if (sl->h[layer].len % S->cfg.block_tokens)   /* the tail page is written */
            S->reads += spilled_in(sl->s, layer, np - 1);
        if (!expect(S, pkv_append(sl->s, layer, S->k, S->v), PKV_OK, "pkv_append", a))
            return false;
        model_append(S, &sl->h[layer], S->k, S->v);
        S->c.tokens++;
    }
    return true;
}

static bool op_create(soak *S, uint32_t a)
{
    slot *sl = &S->slots[a];
    bool long_one = S->o.long_len > S->o.max_len && below(S, 32) == 0;
    if (!model_new(S, sl, long_one ? S->o.long_len : S->o.max_len, NULL) ||
        !expect(S, pkv_session_create(S->e, &sl->s), PKV_OK, "pkv_session_create", a))
        return false;
    S->c.created++;
    note_alive(S);
    /* A long session starts half to completely full, so decodes split into chunks. */
    for (uint32_t l = 0; long_one && l < S->cfg.n_layers; l++)
        if (!append_n(S, a, l, sl->cap / 2 + below(S, sl->cap - sl->cap / 2 + 1)))
            return false;
    return check_lens(S, a);
}

static bool op_append(soak *S, uint32_t a)
{
    slot *sl = &S->slots[a];
    const uint32_t L = S->cfg.n_layers, one = below(S, L);
    const bool all = below(S, 2) == 0;
    uint32_t n = 1 + below(S, 8);
    if (sl->cap > S->o.max_len && below(S, 4) == 0)
        n = 32 + below(S, 97);   /* long sessions also grow in bursts, past a chunk */
    const bool was_empty = sl->h[one].len == 0;
    for (uint32_t l = all ? 0 : one; l < (all ? L : one + 1); l++)
        if (!make_room(S, a, l, &n) || !append_n(S, a, l, n))
            return false;
    bool check = below(S, 3) == 0;
    if (S->o.inject_bug && !S->injected && was_empty && n <= 8 && sl->h[one].len == n) {
        /* The deliberate bug: the model's first V row of this layer loses the sign of
         * its largest value, as a library that mis-stored a row would. The decode
         * right after must notice. */
        float *v0 = sl->h[one].v;
        uint32_t big = 0;
        for (uint32_t i = 1; i < S->kd; i++)
            big = fabsf(v0[i]) > fabsf(v0[big]) ? i : big;
        v0[big] = -v0[big];
        S->injected = check = true;
    }
    if (!check_lens(S, a) || !check)
        return !S->failed;
    random_q(S, S->q);
    return decode_checked(S, a, one, S->q, S->out, "decode after append");
}

static bool op_prefill(soak *S, uint32_t a)
{
    slot *sl = &S->slots[a];
    const uint32_t layer = below(S, S->cfg.n_layers);
    uint32_t n = 1 + below(S, 6);
    if (!make_room(S, a, layer, &n))
        return false;
    hist *H = &sl->h[layer];
    const uint32_t len0 = H->len;
    for (uint32_t t = 0; t < n; t++)
        random_q(S, S->q + (size_t)t * S->qd);
    fill(S, S->k, (size_t)n * S->kd, 1.0f);
    fill(S, S->v, (size_t)n * S->kd, 1.0f);
    S->reads += spilled_in(sl->s, layer, 0);   /* its first decode reads the layer */
    pkv_status st = pkv_prefill(sl->s, layer, n, S->q, S->k, S->v, S->out);
    if (!expect(S, st, PKV_OK, "pkv_prefill", a))
        return false;
    S->c.prefills++;
    S->c.tokens += n;
    for (uint32_t t = 0; t < n; t++)
        model_append(S, H, S->k + (size_t)t * S->kd, S->v + (size_t)t * S->kd);
    for (uint32_t t = 0; t < n; t++)
        if (!check_ref(S, H, len0 + t + 1, S->q + (size_t)t * S->qd,
                       S->out + (size_t)t * S->qd, "pkv_prefill", a, layer))
            return false;
    /* prefill is append + decode through the same code: its last row must equal a
     * decode of the same query bit for bit */
    const size_t last = (size_t)(n - 1) * S->qd;
    return decode_ok(S, sl->s, a, layer, S->q + last, S->out2, "pkv_decode") &&
           check_same(S, S->out + last, S->out2, "prefill vs decode", a, layer) &&
           check_lens(S, a);
}

static bool op_decode(soak *S, uint32_t a)
{
    slot *sl = &S->slots[a];
    const uint32_t layer = below(S, S->cfg.n_layers);
    random_q(S, S->q);
    if (sl->h[layer].len == 0) {
        S->c.expected_errors++;
        return expect(S, pkv_decode(sl->s, layer, S->q, S->out), PKV_ESTATE,
                      "pkv_decode of an empty layer", a);
    }
    if (!decode_checked(S, a, layer, S->q, S->out, "pkv_decode"))
        return false;
    if (below(S, 4))
        return true;
    return decode_ok(S, sl->s, a, layer, S->q, S->out2, "pkv_decode") &&
           check_same(S, S->out, S->out2, "decode twice", a, layer);
}

static int by_ptr(const void *x, const void *y)
{
    const uintptr_t a = (uintptr_t)*(pkvi_page *const *)x;
    const uintptr_t b = (uintptr_t)*(pkvi_page *const *)y;
    return a < b ? -1 : a > b;
}

static bool op_batch(soak *S, uint32_t a)
{
    const uint32_t layer = below(S, S->cfg.n_layers);
    /* Mostly batches that fit the budget; 1 in 16 tries to pass it. A batch whose
     * distinct pages fit must succeed; past the budget PKV_ENOMEM is allowed (decode
     * holds all of a batch's pages at once) but must change nothing. */
    const bool over = below(S, 16) == 0;
    const uint32_t want = over ? MAX_BATCH : 2 + below(S, 15);
    uint32_t ids[MAX_BATCH], n = 0;
    pkv_session *ss[MAX_BATCH];
    uint64_t pages = 0, np = 0, distinct = 0, spilled = 0;
    for (uint32_t tries = 0; n < want && tries < 8 * want; tries++) {
        const uint32_t b = tries == 0 ? a : below(S, S->o.sessions);
        const slot *sl = &S->slots[b];
        bool dup = !sl->s || sl->h[layer].len == 0;
        for (uint32_t i = 0; i < n; i++)
            dup |= ids[i] == b;
        const uint64_t p = dup ? 0 : pages_of(S, sl->h[layer].len);
        if (dup || (!over && pages + p > S->o.budget_pages))
            continue;
        const pkvi_layer *L = &sl->s->layers[layer];
        for (uint64_t i = 0; i < L->n_pages; i++)
            S->pg[np++] = L->pages[i];
        ids[n] = b;
        ss[n++] = sl->s;
        pages += p;
        if (over && pages > S->o.budget_pages)
            break;
    }
    if (n == 0)
        return true;
    qsort(S->pg, (size_t)np, sizeof *S->pg, by_ptr);   /* forks share pages */
    for (uint64_t i = 0; i < np; i++)
        if (i == 0 || S->pg[i] != S->pg[i - 1]) {
            distinct++;
            spilled += S->pg[i]->data == NULL;
        }
    for (uint32_t i = 0; i < n; i++)
        random_q(S, S->q + (size_t)i * S->qd);
    const pkv_status st = pkv_decode_batch(S->e, layer, n, ss, S->q, S->out);
    S->c.batches++;
    if (st == PKV_ENOMEM && distinct > S->o.budget_pages) {
        S->c.expected_errors++;
        for (uint32_t i = 0; i < n; i++)
            if (!check_lens(S, ids[i]))
                return false;
        return decode_checked(S, ids[0], layer, S->q, S->out2, "decode after ENOMEM");
    }
    if (!expect(S, st, PKV_OK, "pkv_decode_batch", a))
        return false;
    S->reads += spilled;
    for (uint32_t i = 0; i < n; i++) {
        const float *qi = S->q + (size_t)i * S->qd, *oi = S->out + (size_t)i * S->qd;
        const hist *H = &S->slots[ids[i]].h[layer];
        if (!check_ref(S, H, H->len, qi, oi, "pkv_decode_batch", ids[i], layer) ||
            !decode_ok(S, ss[i], ids[i], layer, qi, S->out2, "pkv_decode") ||
            !check_same(S, oi, S->out2, "batch vs single decode", ids[i], layer))
            return false;
    }
    return true;
}

/* A random slot other than a, emptied. */
static uint32_t other_slot(soak *S, uint32_t a)
{
    uint32_t b = below(S, S->o.sessions - 1);
    b += b >= a;
    slot_clear(S, &S->slots[b]);
    return b;
}

/* Fork slot a into slot b, then change one of the two: the other must keep decoding
 * exactly as before (copy-on-write), the changed one must match its model. */
static bool op_fork(soak *S, uint32_t a)
{
    const uint32_t b = other_slot(S, a), L = S->cfg.n_layers;
    slot *src = &S->slots[a], *dst = &S->slots[b];
    uint32_t layer = below(S, L), i = 0;
    for (; i < L && src->h[layer].len == 0; i++)
        layer = (layer + 1) % L;
    const bool has = i < L;   /* some layer holds tokens */
    random_q(S, S->q);
    if (has && !decode_checked(S, a, layer, S->q, S->out, "decode before fork"))
        return false;
    if (!expect(S, pkv_session_fork(src->s, &dst->s), PKV_OK, "pkv_session_fork", a) ||
        !model_new(S, dst, 0, src))
        return false;
    S->c.forks++;
    note_alive(S);
    if (!check_lens(S, b) || !has)
        return !S->failed;
    if (!decode_ok(S, dst->s, b, layer, S->q, S->out2, "pkv_decode") ||
        !check_same(S, S->out, S->out2, "fork vs parent", b, layer))
        return false;
    const uint32_t changed = below(S, 2) ? a : b, twin = changed == a ? b : a;
    if (below(S, 2) && !do_truncate(S, changed, below(S, S->slots[changed].h[layer].len + 1)))
        return false;
    uint32_t n = 1 + below(S, 2 * S->cfg.block_tokens);
    return make_room(S, changed, layer, &n) && append_n(S, changed, layer, n) &&
           check_lens(S, changed) && check_lens(S, twin) &&
           decode_ok(S, S->slots[twin].s, twin, layer, S->q, S->out2, "pkv_decode") &&
           check_same(S, S->out, S->out2, "twin after its fork changed", twin, layer) &&
           decode_checked(S, changed, layer, S->q, S->out2, "decode of a changed fork");
}

/* Save slot a, load it back, compare bitwise; the copy replaces a or takes slot b. */
static bool op_save_load(soak *S, uint32_t a)
{
    slot *sl = &S->slots[a];
    for (uint32_t l = 0; l < S->cfg.n_layers; l++)
        S->reads += spilled_in(sl->s, l, 0);
    if (!expect(S, pkv_session_save(sl->s, S->save_path), PKV_OK, "pkv_session_save", a))
        return false;
    pkv_session *ld = NULL;
    const pkv_status st = pkv_session_load(S->e, S->save_path, &ld);
    unlink(S->save_path);
    if (!expect(S, st, PKV_OK, "pkv_session_load", a))
        return false;
    S->c.saves++;
    const bool replace = below(S, 2);
    const uint32_t b = replace ? a : other_slot(S, a);
    if (!replace) {
        if (!model_new(S, &S->slots[b], 0, sl))
            return false;
        S->slots[b].s = ld;
        note_alive(S);
    }
    for (uint32_t l = 0; l < S->cfg.n_layers; l++) {
        if (sl->h[l].len == 0)
            continue;
        random_q(S, S->q);
        if (!decode_checked(S, a, l, S->q, S->out, "decode of the saved session") ||
            !decode_ok(S, ld, b, l, S->q, S->out2, "decode of the loaded session") ||
            !check_same(S, S->out, S->out2, "loaded vs saved", b, l))
            return false;
    }
    if (replace) {
        S->drops += spilled_alone(S, sl->s, 0);
        pkv_session_destroy(sl->s);
        sl->s = ld;
    }
    return check_lens(S, a) && check_lens(S, b);
}

/* One random operation on a random slot. */
static bool step(soak *S)
{
    const uint32_t a = below(S, S->o.sessions), r = below(S, 100);
    slot *sl = &S->slots[a];
    if (!sl->s)
        return op_create(S, a);
    if (r < 40) return op_append(S, a);
    if (r < 44) return op_prefill(S, a);
    if (r < 66) return op_decode(S, a);
    if (r < 74) return op_batch(S, a);
    if (r < 82) return op_fork(S, a);
    if (r < 88) {   /* 1 in 8 past every layer: PKV_ERANGE */
        uint32_t m = max_len_of(S, sl);
        return do_truncate(S, a, below(S, 8) ? below(S, m + 1) : m + 1 + below(S, 4));
    }
    if (r == 99)
        return op_save_load(S, a);
    slot_clear(S, sl);
    return r < 93 || op_create(S, a);   /* destroy, or recycle the slot */
}

/* ---- the run ------------------------------------------------------------------------ */

/* Resident set size. With purge, hand freed memory back first: the process malloc is
 * jemalloc here (Debian's has no prefix), which keeps dirty pages for a while. */
static uint64_t rss_now(bool purge)
{
#if PKV_HAVE_JEMALLOC
    char name[64];
    snprintf(name, sizeof name, "arena.%u.purge", (unsigned)MALLCTL_ARENAS_ALL);
    if (purge && mallctl("thread.tcache.flush", NULL, NULL, NULL, 0) == 0)
        mallctl(name, NULL, NULL, NULL, 0);
#else
    (void)purge;
#endif
    unsigned long long size = 0, res = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f && fscanf(f, "%llu %llu", &size, &res) != 2)
        res = 0;
    if (f)
        fclose(f);
    return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

static bool setup(soak *S)
{
    const soak_opts *o = &S->o;
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim, o->block_tokens,
                              o->dtype, o->threads);
    S->page_bytes = 2ull * o->kv_heads * o->block_tokens * o->head_dim *
                    pkv_dtype_size(o->dtype);
    c.mem_budget = o->budget_pages * S->page_bytes;
    c.spill_dir = S->dir;
    pkv_status st = pkv_engine_create(&c, &S->e);
    if (st != PKV_OK)
        return fail(S, "pkv_engine_create: %s", pkv_status_str(st));
    pkv_engine_config(S->e, &S->cfg);
    S->kd = o->kv_heads * o->head_dim;
    S->qd = o->heads * o->head_dim;
    const uint32_t cap = o->long_len > o->max_len ? o->long_len : o->max_len;
    S->q = calloc((2 * MAX_BATCH + 1) * (size_t)S->qd, sizeof(float));
    S->k = calloc(16 * (size_t)S->kd, sizeof(float));
    S->w = calloc((size_t)cap + o->head_dim, sizeof(double));
    S->pg = calloc((size_t)MAX_BATCH * pages_of(S, cap), sizeof *S->pg);
    S->slots = calloc(o->sessions, sizeof *S->slots);
    if (!S->q || !S->k || !S->w || !S->pg || !S->slots)
        return fail(S, "out of memory");
    S->out = S->q + (size_t)MAX_BATCH * S->qd;
    S->out2 = S->out + (size_t)MAX_BATCH * S->qd;
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
    bool ok = step(S);
    if (pkv_engine_stats(S->e, st) != PKV_OK)
        return fail(S, "pkv_engine_stats failed");
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
    if (ok && !pkvi_engine_check(S->e))
        return fail(S, "pool invariants broken (pkvi_engine_check)");
    if (ok && st->pages_in_use + st->pages_free > S->o.budget_pages)
        return fail(S, U64 " resident + " U64 " cached pages exceed the budget of " U64,
                    st->pages_in_use, st->pages_free, S->o.budget_pages);
    return ok;
}

/* Destroy every session; then nothing may be in use or spilled, and the pool's arena
 * may hold its free cache only (jemalloc rounds a page up to its size class). */
static bool teardown_check(soak *S, pkv_stats *end, uint64_t alloc0)
{
    for (uint32_t a = 0; a < S->o.sessions; a++)
        slot_clear(S, &S->slots[a]);
    if (pkv_engine_stats(S->e, end) != PKV_OK || !pkvi_engine_check(S->e))
        return fail(S, "engine unsound after destroying every session");
    const uint64_t pb = end->page_bytes, cached = end->bytes_allocator - alloc0;
    if (end->pages_in_use || end->pages_spilled || end->bytes_allocator < alloc0 ||
        cached < end->pages_free * pb || cached > end->pages_free * (pb + pb / 4 + 64))
        return fail(S, "after destroying every session: " U64 " pages in use, " U64
                    " spilled, " U64 " cached; allocator " U64 " B (" U64 " B at start)",
                    end->pages_in_use, end->pages_spilled, end->pages_free,
                    end->bytes_allocator, alloc0);
    return true;
}

static void report(const soak *S, const pkv_stats *st, double secs, const uint64_t rss[3],
                   uint64_t alloc0, bool ok)
{
    const counters *c = &S->c;
    const uint64_t pb = S->page_bytes;
    const struct { const char *k; uint64_t v; } kv[] = {
        {"ops", S->op}, {"sessions_created", c->created}, {"forks", c->forks},
        {"destroys", c->destroys}, {"max_sessions_alive", c->max_alive},
        {"tokens_appended", c->tokens}, {"prefills", c->prefills},
        {"decodes", c->decodes}, {"split_k_decodes", c->split_decodes},
        {"batches", c->batches}, {"truncates", c->truncates},
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
        fprintf(f, "pagedkv soak: %s: " U64 " ops in %.2f s (%.0f ops/s), seed " U64 "\n"
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
    fprintf(f, "{\"ok\": %s, \"seconds\": %.3f, \"ops_per_s\": %.1f, \"dtype\": \"%s\", "
               "\"isa\": ", ok ? "true" : "false", secs, rate,
            pkv_dtype_name(S->cfg.kv_dtype));
    cli_json_str(f, st->isa);
    fprintf(f, ", \"io_backend\": ");
    cli_json_str(f, st->io_backend);
    for (size_t i = 0; i < n; i++)
        fprintf(f, ", \"%s\": " U64, kv[i].k, kv[i].v);
    fprintf(f, ", \"max_err_over_max_v\": %.3g, \"inject_bug\": %s, \"failure\": ",
            c->max_rel_err, S->o.inject_bug ? "true" : "false");
    cli_json_str(f, ok ? "" : S->failed ? S->fail : "interrupted");
    fprintf(f, "}\n");
}

int cmd_soak(int argc, char **argv)
{
    soak *S = calloc(1, sizeof *S);
    bool help = false;
    int rc = S ? parse_opts(argc, argv, &S->o, &help) : cli_fail(CMD, "out of memory");
    if (rc != CLI_OK || help) {
        if (help)
            usage(stdout);
        free(S);
        return rc;
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
            random_q(S, S->q);
            ok = check_lens(S, a) && (!S->slots[a].h[l].len ||
                                      decode_checked(S, a, l, S->q, S->out, "final sweep"));
        }
    const double secs = cli_now() - t0;
    if (S->e && S->slots)
        teardown_check(S, &st, alloc0);
    pkv_engine_destroy(S->e);
    free(S->q), free(S->k), free(S->w), free(S->pg), free(S->slots);
    unlink(S->save_path);
    if (S->own_dir && rmdir(S->dir) != 0)
        fprintf(stderr, "pagedkv soak: warning: cannot remove %s: %s\n", S->dir,
                strerror(errno));
    cli_sigint_restore();
    rss[1] = rss_now(true);
    rss[2] = cli_peak_rss_bytes();
    if (S->o.inject_bug && !S->injected)
        fprintf(stderr, "pagedkv soak: warning: --inject-bug found no op to corrupt\n");
    report(S, &st, secs, rss, alloc0, !S->failed && !cli_interrupted());
    if (S->failed)
        fprintf(stderr, "pagedkv soak: check failed at %s\npagedkv soak: reproduce with "
                        "the same options, --seed " U64 " --ops " U64 "\n", S->fail,
                S->o.seed, S->op);
    rc = S->failed ? CLI_FAIL : cli_interrupted() ? CLI_INTERRUPTED : CLI_OK;
    free(S);
    return rc;
}

/*
 * engine.c - the engine: configuration validation, creation and destruction of
 * everything it owns, engine statistics, the small public helpers (status strings,
 * version, config defaults), and every public call that takes an engine handle.
 *
 * Owns struct pkv_engine, which no other file sees. An engine is its contexts - the
 * geometry (cache/geom.h), the shared cache state under the engine lock
 * (cache/cache.h), the decode executor (attention/exec.h), the error sink
 * (base/error.h) - plus what they point to (the layer array, the spill directory's
 * copy). A public call on an engine handle unpacks it here and hands the module the
 * contexts it needs (pkvi_session_create, pkvi_decode_batch, ...); sessions carry
 * pointers to the contexts they use. Does not own sessions' contents (session/) or
 * decode (decode.c).
 */
#include "engine/engine.h"
#include "attention/decode.h"
#include "attention/exec.h"
#include "attention/reference.h"
#include "persist/sfile.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *pkv_status_str(pkv_status s)
{
    switch (s) {
    case PKV_OK: return "success";
    case PKV_EINVAL: return "invalid argument";
    case PKV_ENOMEM: return "out of memory (budget or system)";
    case PKV_EIO: return "I/O error";
    case PKV_ECORRUPT: return "corrupt data";
    case PKV_ERANGE: return "out of range";
    case PKV_ESTATE: return "invalid state for this call";
    }
    return "unknown status";
}

const char *pkv_version(void)
{
    return PKV_VERSION_STRING;
}

pkv_config pkv_config_default(void)
{
    pkv_config c;
    memset(&c, 0, sizeof c);
    c.kv_dtype = PKV_F32;
    return c;
}

/* Split-K chunk: this many tokens per chunk, rounded up to whole pages. 512 tokens of
 * a d=128 f16 group is 256 KiB of K/V (2 MiB for llama3-8b's 8 groups, which one task
 * walks together): large enough that a task's fixed cost (state init, merge) is
 * noise, small enough that a 2-thread machine balances even MQA (g = 1) from a few
 * thousand tokens on. Independent of n_threads by design:
 * the split decides the arithmetic, so it must not depend on the thread count. */
#define CHUNK_TOKENS 512u
/* Default tokens per page. See docs/design.md "Choosing block_tokens". */
#define DEFAULT_BLOCK_TOKENS 16u
/* Largest n_kv_heads: keeps the thread pool's task counts (a batch's sessions or a
 * prefill tile's queries, times groups: at most 256 * 65536 = 2^24) within 32 bits. */
#define MAX_KV_HEADS 65536u
/* Largest n_layers: every session holds a block table per layer, and a session file's
 * header holds them all (docs/file-format.md: at most 131060 layers). */
#define MAX_LAYERS 65536u

struct pkv_engine {
    pkvi_geom geom;              /* immutable after create */
    pkvi_cache cache;            /* the shared state and its lock */
    pkvi_exec exec;              /* worker threads, split thresholds */
    pkvi_errs errs;              /* the last error's text, its own lock */
    pkvi_ctx ctx;                /* pointers to the four above: what modules get */
    pkv_layer_config *layers;    /* [n_layers], sink_logits owned; geom.layers */
    pkvi_rope **ropes;           /* [n_layers] geom.rope (NULL: no layer has rope) */
    pkvi_rope **rope_objs;       /* [n_rope_objs] the distinct ones, owned */
    uint32_t n_rope_objs;
    char *spill_dir;             /* owned copy of cfg.spill_dir, or NULL */
    bool cache_ok, exec_ok;      /* initialised (a failed create frees what is) */
};

static uint32_t online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 && n < 1024 ? (uint32_t)n : 1;
}

/* Pages of one split-K chunk at block_tokens bt (CHUNK_TOKENS rounded up to pages). */
static uint64_t chunk_pages_of(uint64_t bt)
{
    return (CHUNK_TOKENS + bt - 1) / bt;
}

/* Split-K chunks a windowed layer's sink pages take (0 without a window). */
static uint64_t sink_chunks(const pkv_layer_config *lc, uint64_t bt)
{
    const uint64_t cp = chunk_pages_of(bt);
    return (pkvi_window_sink_pages(lc, bt) + cp - 1) / cp;
}

/* The most sink_tokens a windowed layer may have at block_tokens bt: PKVI_MAX_CHUNKS
 * chunks' worth (32768 at 16 tokens a page). */
static uint64_t max_sinks(uint64_t bt)
{
    return (uint64_t)PKVI_MAX_CHUNKS * chunk_pages_of(bt) * bt;
}

/* Write the reason of a rejection into why (size n; may be NULL) and return st. */
__attribute__((format(printf, 4, 5)))
static pkv_status reject(char *why, size_t n, pkv_status st, const char *fmt, ...)
{
    if (why && n) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, n, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* The checks of pkv_engine_create, each with its reason (why may be NULL). */
static pkv_status resolve(const pkv_config *cfg, pkv_config *out, char *why, size_t n)
{
    if (!cfg)
        return reject(why, n, PKV_EINVAL, "no configuration (cfg is NULL)");
    pkv_config c = *cfg;
    if (c.n_layers == 0 || c.n_heads == 0 || c.n_kv_heads == 0 || c.head_dim == 0)
        return reject(why, n, PKV_EINVAL,
                      "n_layers %u, n_heads %u, n_kv_heads %u, head_dim %u: each must be > 0",
                      c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim);
    if (c.n_layers > MAX_LAYERS)
        return reject(why, n, PKV_EINVAL, "n_layers %u exceeds the engine limit %u",
                      c.n_layers, MAX_LAYERS);
    if (c.n_heads % c.n_kv_heads != 0)
        return reject(why, n, PKV_EINVAL, "n_heads %u is not a multiple of n_kv_heads %u",
                      c.n_heads, c.n_kv_heads);
    if (c.n_heads / c.n_kv_heads > PKVI_MAX_GROUP_HEADS)
        return reject(why, n, PKV_EINVAL,
                      "%u query heads per KV group exceed the engine limit %u",
                      c.n_heads / c.n_kv_heads, PKVI_MAX_GROUP_HEADS);
    if (c.head_dim > PKVI_MAX_HEAD_DIM)
        return reject(why, n, PKV_EINVAL, "head_dim %u exceeds the engine limit %u",
                      c.head_dim, PKVI_MAX_HEAD_DIM);
    if (c.n_kv_heads > MAX_KV_HEADS)
        return reject(why, n, PKV_EINVAL, "n_kv_heads %u exceeds the engine limit %u",
                      c.n_kv_heads, MAX_KV_HEADS);
    if (pkv_row_bytes(c.kv_dtype, 1) == 0)
        return reject(why, n, PKV_EINVAL, "kv_dtype %d is not a storage type",
                      (int)c.kv_dtype);
    if (c.block_tokens == 0)
        c.block_tokens = DEFAULT_BLOCK_TOKENS;
    if (!isfinite(c.scale) || c.scale < 0)
        return reject(why, n, PKV_EINVAL, "scale %g: must be finite and >= 0 (0 = default)",
                      (double)c.scale);
    if (c.scale == 0)
        c.scale = (float)(1.0 / sqrt((double)c.head_dim));
    if (c.n_threads == 0)
        c.n_threads = online_cpus();
    if (c.n_threads > 1024)
        return reject(why, n, PKV_EINVAL, "n_threads %u exceeds the engine limit 1024",
                      c.n_threads);
    if (c.head_dim_v == 0)
        c.head_dim_v = c.head_dim;
    if (c.head_dim_v > PKVI_MAX_HEAD_DIM)
        return reject(why, n, PKV_EINVAL, "head_dim_v %u exceeds the engine limit %u",
                      c.head_dim_v, PKVI_MAX_HEAD_DIM);
    for (uint32_t l = 0; c.layer_cfg && l < c.n_layers; l++) {
        const pkv_layer_config *lc = &c.layer_cfg[l];
        if (!lc->window && (lc->sink_tokens || lc->rollback_tokens))
            return reject(why, n, PKV_EINVAL,
                          "layer_cfg[%u]: sink_tokens %u, rollback_tokens %u need a window "
                          "(window is 0)", l, lc->sink_tokens, lc->rollback_tokens);
        if (!isfinite(lc->softcap) || lc->softcap < 0.0f)
            return reject(why, n, PKV_EINVAL,
                          "layer_cfg[%u]: softcap %g must be finite and >= 0 (0 = none)", l,
                          (double)lc->softcap);
        if (!pkvi_layer_config_ok(lc, c.n_heads))
            return reject(why, n, PKV_EINVAL, "layer_cfg[%u]: a sink logit is not finite", l);
        /* the sink run's chunks join every decode's wave of PKVI_MAX_CHUNKS */
        if (sink_chunks(lc, c.block_tokens) > PKVI_MAX_CHUNKS)
            return reject(why, n, PKV_EINVAL,
                          "layer_cfg[%u]: sink_tokens %u exceed the engine limit of %llu at "
                          "block_tokens %u (%u split-K chunks of sinks)", l, lc->sink_tokens,
                          (unsigned long long)max_sinks(c.block_tokens), c.block_tokens,
                          PKVI_MAX_CHUNKS);
        char rwhy[160];
        if (!pkvi_rope_check(lc, c.head_dim, NULL, rwhy, sizeof rwhy))
            return reject(why, n, PKV_EINVAL, "layer_cfg[%u]: %s", l, rwhy);
    }
    if (c.quant_dot > 1)
        return reject(why, n, PKV_EINVAL, "quant_dot %u: must be 0 (exact) or 1 (integer)",
                      c.quant_dot);
    if (c.quant_dot == 1 && c.kv_dtype != PKV_Q8 && c.kv_dtype != PKV_Q4)
        return reject(why, n, PKV_EINVAL,
                      "quant_dot 1: integer dot products need PKV_Q8 or PKV_Q4 pages "
                      "(kv_dtype is %s)", pkv_dtype_name(c.kv_dtype));
    /* page bytes = g * bt * (row_bytes(dk) + row_bytes(dv)), checked */
    uint64_t pb;
    if (!pkvi_mul(c.n_kv_heads, c.block_tokens, &pb) ||
        !pkvi_mul(pb, (uint64_t)pkv_row_bytes(c.kv_dtype, c.head_dim) +
                          pkv_row_bytes(c.kv_dtype, c.head_dim_v), &pb) ||
        pb > PKVI_MAX_PAGE_BYTES)
        return reject(why, n, PKV_EINVAL,
                      "a page of %u tokens would exceed the engine limit of 1 GiB",
                      c.block_tokens);
    if (c.mem_budget && c.mem_budget < pb)
        return reject(why, n, PKV_EINVAL,
                      "mem_budget %llu bytes is smaller than one page (%llu bytes)",
                      (unsigned long long)c.mem_budget, (unsigned long long)pb);
    if (c.spill_dir) {
        struct stat st;
        if (c.spill_dir[0] == '\0' || stat(c.spill_dir, &st) != 0 || !S_ISDIR(st.st_mode))
            return reject(why, n, PKV_EINVAL, "spill_dir '%s' is not an existing directory",
                          c.spill_dir);
    }
    const char *isa = NULL;
    if (pkvi_kernels_check_force(&isa) != PKV_OK)
        return reject(why, n, PKV_EINVAL, "PKV_FORCE_ISA=%s: %s", isa,
                      pkvi_kernels_force_reason(isa));
    uint32_t l2;
    if (pkvi_prefetch_l2(&l2) != PKV_OK)
        return reject(why, n, PKV_EINVAL, "PKV_PREFETCH=%s: not one of l1, l2",
                      getenv("PKV_PREFETCH"));
    if (out)
        *out = c;
    if (why && n)
        why[0] = '\0';
    return PKV_OK;
}

pkv_status pkv_config_explain(const pkv_config *cfg, char *why, size_t why_size)
{
    return resolve(cfg, NULL, why, why_size);
}

/* Each layer's RoPE (SPEC §14): one object per distinct config, with the rotation
 * kernels that go with the decode kernels chosen. PKV_ENOMEM. */
static pkv_status rope_init(pkv_engine *e)
{
    pkvi_geom *geo = &e->geom;
    const uint32_t L = geo->cfg.n_layers;
    bool any = false;
    for (uint32_t l = 0; l < L; l++)
        any |= e->layers[l].rope != 0;
    if (!any)
        return PKV_OK;
    e->ropes = calloc(L, sizeof *e->ropes);
    e->rope_objs = calloc(L, sizeof *e->rope_objs);
    if (!e->ropes || !e->rope_objs)
        return PKV_ENOMEM;
    const pkvi_rope_kernels *k = pkvi_rope_kernels_for(geo->kern->isa);
    for (uint32_t l = 0; l < L; l++) {
        if (!e->layers[l].rope)
            continue;
        for (uint32_t i = 0; i < e->n_rope_objs && !e->ropes[l]; i++)
            if (pkvi_rope_same(e->rope_objs[i], &e->layers[l]))
                e->ropes[l] = e->rope_objs[i];
        if (e->ropes[l])
            continue;
        const pkv_status st = pkvi_rope_new(&e->layers[l], k, &e->rope_objs[e->n_rope_objs]);
        if (st != PKV_OK)
            return st;
        e->ropes[l] = e->rope_objs[e->n_rope_objs++];
    }
    geo->rope = (const pkvi_rope *const *)e->ropes;
    return PKV_OK;
}

/* The geometry of resolved config c: sizes, the layer array (copied, sink logits too),
 * the split-K chunk, the kernels. PKV_ENOMEM, PKV_EINVAL. */
static pkv_status geom_init(pkv_engine *e, const pkv_config *c)
{
    pkvi_geom *geo = &e->geom;
    geo->cfg = *c;
    geo->hg = c->n_heads / c->n_kv_heads;
    geo->row_bytes = pkv_row_bytes(c->kv_dtype, c->head_dim);
    geo->row_bytes_v = pkv_row_bytes(c->kv_dtype, c->head_dim_v);
    geo->page_bytes =
        (uint64_t)c->n_kv_heads * c->block_tokens * (geo->row_bytes + geo->row_bytes_v);
    geo->chunk_pages = (uint32_t)chunk_pages_of(c->block_tokens);
    geo->kp.head_dim = c->head_dim;
    geo->kp.head_dim_v = c->head_dim_v;
    geo->kp.block_tokens = c->block_tokens;
    geo->kp.hg = geo->hg;
    geo->kp.dtype = c->kv_dtype;
    geo->kp.scale = c->scale;
    geo->kp.quant_dot = c->quant_dot;
    geo->kp.v_offset = (size_t)(c->block_tokens * geo->row_bytes);
    geo->kp.group_stride = (size_t)(c->block_tokens * (geo->row_bytes + geo->row_bytes_v));

    /* per-layer variants: a copy of the array and of every sink-logit vector */
    e->layers = calloc(c->n_layers, sizeof *e->layers);
    if (!e->layers)
        return PKV_ENOMEM;
    geo->layers = e->layers;
    for (uint32_t l = 0; c->layer_cfg && l < c->n_layers; l++) {
        e->layers[l] = c->layer_cfg[l];
        if (c->layer_cfg[l].sink_logits) {
            float *copy = malloc((size_t)c->n_heads * sizeof *copy);
            if (!copy) {
                e->layers[l].sink_logits = NULL;
                return PKV_ENOMEM;
            }
            memcpy(copy, c->layer_cfg[l].sink_logits, (size_t)c->n_heads * sizeof *copy);
            e->layers[l].sink_logits = copy;
        }
        geo->variants |= c->layer_cfg[l].window || c->layer_cfg[l].softcap > 0.0f ||
                         c->layer_cfg[l].sink_logits;
    }
    geo->variants |= c->head_dim_v != c->head_dim;
    for (uint32_t l = 0; l < c->n_layers; l++) /* the rope defaults, filled in (valid:
                                                  resolve checked them) */
        (void)pkvi_rope_check(&e->layers[l], c->head_dim, &e->layers[l], NULL, 0);
    for (uint32_t l = 0; l < c->n_layers; l++) { /* at most PKVI_MAX_CHUNKS: resolve */
        const uint64_t ch = sink_chunks(&e->layers[l], c->block_tokens);
        if (ch > geo->sink_chunks_max)
            geo->sink_chunks_max = (uint32_t)ch;
    }
    geo->cfg.layer_cfg = c->layer_cfg ? e->layers : NULL;

    if (c->spill_dir) {
        e->spill_dir = strdup(c->spill_dir);
        if (!e->spill_dir)
            return PKV_ENOMEM;
        geo->cfg.spill_dir = e->spill_dir;
    }
    pkv_status st = pkvi_kernels_select(&geo->kern);
    if (st != PKV_OK)
        return st;
    geo->kern = pkvi_kernels_for_dtype(geo->kern, c->kv_dtype);
    st = rope_init(e);
    if (st != PKV_OK)
        return st;
    return pkvi_prefetch_l2(&geo->kp.pf_l2);
}

pkv_status pkv_engine_create(const pkv_config *cfg, pkv_engine **out)
{
    if (!out)
        return PKV_EINVAL;
    pkv_config c;
    pkv_status st = resolve(cfg, &c, NULL, 0);
    if (st != PKV_OK)
        return st;

    pkv_engine *e = calloc(1, sizeof *e);
    if (!e)
        return PKV_ENOMEM;
    pkvi_errs_init(&e->errs);
    e->ctx = (pkvi_ctx){&e->geom, &e->cache, &e->exec, &e->errs};
    st = geom_init(e, &c);
    if (st == PKV_OK) {
        st = pkvi_cache_init(&e->cache, &e->geom.cfg, e->geom.page_bytes);
        e->cache_ok = st == PKV_OK;
    }
    if (st == PKV_OK) {
        st = pkvi_exec_init(&e->exec, c.n_threads);
        e->exec_ok = st == PKV_OK;
    }
    if (st != PKV_OK) {
        pkv_engine_destroy(e);
        return st;
    }
    *out = e;
    return PKV_OK;
}

void pkv_engine_destroy(pkv_engine *e)
{
    if (!e)
        return;
    if (e->cache_ok) {
        pkvi_sessions_destroy_all(&e->cache);
        pkvi_cache_fini(&e->cache);
    }
    if (e->exec_ok)
        pkvi_exec_fini(&e->exec);
    pkvi_errs_fini(&e->errs);
    for (uint32_t l = 0; e->layers && l < e->geom.cfg.n_layers; l++)
        free((float *)e->layers[l].sink_logits);
    free(e->layers);
    for (uint32_t i = 0; i < e->n_rope_objs; i++)
        pkvi_rope_free(e->rope_objs[i]);
    free(e->rope_objs);
    free(e->ropes);
    free(e->spill_dir);
    free(e);
}

pkv_status pkv_engine_stats(const pkv_engine *ce, pkv_stats *out)
{
    if (!ce)
        return PKV_EINVAL;
    pkv_engine *e = (pkv_engine *)ce; /* the locks are not part of the logical state */
    if (!out)
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_engine_stats: out is NULL");
    pkv_stats s;
    memset(&s, 0, sizeof s);
    s.isa = e->geom.kern->isa;
    s.page_bytes = e->geom.page_bytes;
    s.mem_budget = e->geom.cfg.mem_budget;
    pkvi_cache_stats(&e->cache, &s);
    s.pages_read_shared = atomic_load_explicit(&e->exec.pages_shared, memory_order_relaxed);
    s.pages_read_private = atomic_load_explicit(&e->exec.pages_private, memory_order_relaxed);
    s.page_reads_saved = atomic_load_explicit(&e->exec.reads_saved, memory_order_relaxed);
    *out = s;
    return PKV_OK;
}

pkv_status pkv_engine_config(const pkv_engine *ce, pkv_config *out)
{
    if (!ce)
        return PKV_EINVAL;
    pkv_engine *e = (pkv_engine *)ce; /* the reason's record is not logical state */
    if (!out)
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_engine_config: out is NULL");
    *out = e->geom.cfg;
    return PKV_OK;
}

pkv_status pkv_engine_last_error(const pkv_engine *ce, char *buf, size_t size)
{
    if (!ce || !buf || size == 0)
        return PKV_EINVAL;
    pkv_engine *e = (pkv_engine *)ce; /* the lock is not part of the logical state */
    pkvi_errs_read(&e->errs, buf, size);
    return PKV_OK;
}

pkv_status pkv_engine_check(pkv_engine *e)
{
    if (!e)
        return PKV_EINVAL;
    if (!pkvi_sessions_check(&e->geom, &e->cache, true))
        return pkvi_fail(&e->errs, PKV_ECORRUPT, "pkv_engine_check: an invariant is broken "
                         "(a library defect: please report it)");
    return PKV_OK;
}

/* ---- the public calls on an engine handle: its contexts to the module ----------------- */

pkv_status pkv_session_create(pkv_engine *e, pkv_session **out)
{
    if (!e)
        return PKV_EINVAL;
    if (!out)
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_session_create: out is NULL");
    return pkvi_session_create(&e->ctx, out);
}

pkv_status pkv_session_from_prefix(pkv_engine *e, uint64_t n, const int32_t *tokens,
                                   pkv_session **out, uint64_t *n_cached)
{
    if (!e)
        return PKV_EINVAL;
    if (!out || !n_cached)
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_session_from_prefix: %s is NULL",
                         !out ? "out" : "n_cached");
    return pkvi_session_from_prefix(&e->ctx, n, tokens, out, n_cached);
}

pkv_status pkv_session_load(pkv_engine *e, const char *path, pkv_session **out)
{
    if (!e)
        return PKV_EINVAL;
    return pkvi_session_load(&e->ctx, path, out);
}

pkv_status pkv_decode_batch(pkv_engine *e, uint32_t layer, uint32_t n,
                            pkv_session *const *sessions, const float *q, float *out)
{
    if (!e)
        return PKV_EINVAL;
    if (!sessions || !q || !out || n == 0)
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_decode_batch: %s",
                         n == 0 ? "n is 0" : "sessions, q or out is NULL");
    return pkvi_decode_batch(&e->ctx, layer, n, sessions, q, out);
}

pkv_status pkv_merge_partials(const pkv_engine *ce, uint32_t n_chunks, const float *states,
                              float *out)
{
    if (!ce)
        return PKV_EINVAL;
    pkv_engine *e = (pkv_engine *)ce; /* the reason's record is not logical state */
    if (!states || !out || n_chunks == 0)
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_merge_partials: %s",
                         n_chunks == 0 ? "n_chunks is 0" : "states or out is NULL");
    return pkvi_merge_partials(&e->geom, n_chunks, states, out);
}

pkv_status pkv_fold_partials(const pkv_engine *ce, uint32_t n_chunks, const float *states,
                             float *state_out)
{
    if (!ce)
        return PKV_EINVAL;
    pkv_engine *e = (pkv_engine *)ce; /* the reason's record is not logical state */
    if (!states || !state_out || n_chunks == 0)
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_fold_partials: %s",
                         n_chunks == 0 ? "n_chunks is 0" : "states or state_out is NULL");
    const pkv_status st = pkvi_fold_partials(&e->geom, n_chunks, states, state_out);
    if (st != PKV_OK)
        return pkvi_fail(&e->errs, st, "pkv_fold_partials: out of memory");
    return st;
}

uint64_t pkv_shard_align(const pkv_engine *e)
{
    return e ? pkvi_shard_align(&e->geom) : 0;
}

pkv_status pkv_rope_q(const pkv_engine *ce, uint32_t layer, uint32_t n, const uint64_t *pos,
                      float *q)
{
    if (!ce)
        return PKV_EINVAL;
    pkv_engine *e = (pkv_engine *)ce; /* the error sink is not part of the logical state */
    const pkvi_geom *geo = &e->geom;
    if (layer >= geo->cfg.n_layers)
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_rope_q: layer %u, but the engine has %u",
                         layer, geo->cfg.n_layers);
    if (n && (!pos || !q))
        return pkvi_fail(&e->errs, PKV_EINVAL, "pkv_rope_q: pos or q is NULL");
    const pkvi_rope *r = pkvi_layer_rope(geo, layer);
    if (r) /* else the layer's keys are stored as given: so are its queries */
        pkvi_rope_rows(r, n, pos, q, geo->cfg.n_heads, geo->cfg.head_dim);
    return PKV_OK;
}

/* ---- for the tests (engine/engine.h) ------------------------------------------------------ */

pkvi_ctx pkvi_engine_ctx(pkv_engine *e)
{
    return e->ctx;
}

bool pkvi_engine_check(pkv_engine *e)
{
    return pkvi_sessions_check(&e->geom, &e->cache, true);
}

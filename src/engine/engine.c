/*
 * engine.c - the engine: configuration validation, creation and destruction of
 * everything it owns (pool, kernels, threads, spill file), engine statistics, and the
 * small public helpers (status strings, version, config defaults).
 *
 * Does not own sessions' contents (session*.c) or decode (decode.c).
 */
#include "engine/engine.h"
#include "session/session.h"
#include "attention/reference.h"
#include "pkv_config.h"

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

static uint32_t online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 && n < 1024 ? (uint32_t)n : 1;
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
    if (c.n_kv_heads > PKVI_MAX_KV_HEADS)
        return reject(why, n, PKV_EINVAL, "n_kv_heads %u exceeds the engine limit %u",
                      c.n_kv_heads, PKVI_MAX_KV_HEADS);
    if (pkv_row_bytes(c.kv_dtype, 1) == 0)
        return reject(why, n, PKV_EINVAL, "kv_dtype %d is not a storage type",
                      (int)c.kv_dtype);
    if (c.block_tokens == 0)
        c.block_tokens = PKVI_DEFAULT_BLOCK_TOKENS;
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
    for (uint32_t l = 0; c.layer_cfg && l < c.n_layers; l++)
        if (!pkvi_layer_config_ok(&c.layer_cfg[l], c.n_heads))
            return reject(why, n, PKV_EINVAL,
                          "layer %u: sink_tokens or rollback_tokens need a window; softcap "
                          "must be finite and >= 0; sink logits must be finite",
                          l);
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

pkv_status pkvi_config_resolve(const pkv_config *cfg, pkv_config *out)
{
    if (!out)
        return PKV_EINVAL;
    return resolve(cfg, out, NULL, 0);
}

pkv_status pkv_config_explain(const pkv_config *cfg, char *why, size_t why_size)
{
    return resolve(cfg, NULL, why, why_size);
}

pkv_status pkv_engine_create(const pkv_config *cfg, pkv_engine **out)
{
    if (!out)
        return PKV_EINVAL;
    pkv_config c;
    pkv_status st = pkvi_config_resolve(cfg, &c);
    if (st != PKV_OK)
        return st;

    pkv_engine *e = calloc(1, sizeof *e);
    if (!e)
        return PKV_ENOMEM;
    e->cfg = c;
    e->hg = c.n_heads / c.n_kv_heads;
    e->row_bytes = pkv_row_bytes(c.kv_dtype, c.head_dim);
    e->row_bytes_v = pkv_row_bytes(c.kv_dtype, c.head_dim_v);
    e->page_bytes = (uint64_t)c.n_kv_heads * c.block_tokens * (e->row_bytes + e->row_bytes_v);
    e->chunk_pages = (CHUNK_TOKENS + c.block_tokens - 1) / c.block_tokens;
    e->split_awake = (double)PKVI_SPLIT_AWAKE_BYTES;
    e->split_asleep = (double)PKVI_SPLIT_ASLEEP_BYTES;
    e->kp.head_dim = c.head_dim;
    e->kp.head_dim_v = c.head_dim_v;
    e->kp.block_tokens = c.block_tokens;
    e->kp.hg = e->hg;
    e->kp.dtype = c.kv_dtype;
    e->kp.scale = c.scale;
    e->kp.quant_dot = c.quant_dot;
    e->kp.v_offset = (size_t)(c.block_tokens * e->row_bytes);
    e->kp.group_stride = (size_t)(c.block_tokens * (e->row_bytes + e->row_bytes_v));
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->err_lock, NULL);

    /* per-layer variants: a copy of the array and of every sink-logit vector */
    e->layers = calloc(c.n_layers, sizeof *e->layers);
    if (!e->layers) {
        st = PKV_ENOMEM;
        goto fail;
    }
    for (uint32_t l = 0; c.layer_cfg && l < c.n_layers; l++) {
        e->layers[l] = c.layer_cfg[l];
        if (c.layer_cfg[l].sink_logits) {
            float *copy = malloc((size_t)c.n_heads * sizeof *copy);
            if (!copy) {
                e->layers[l].sink_logits = NULL;
                st = PKV_ENOMEM;
                goto fail;
            }
            memcpy(copy, c.layer_cfg[l].sink_logits, (size_t)c.n_heads * sizeof *copy);
            e->layers[l].sink_logits = copy;
        }
        e->variants |= c.layer_cfg[l].window || c.layer_cfg[l].softcap > 0.0f ||
                       c.layer_cfg[l].sink_logits;
    }
    e->variants |= c.head_dim_v != c.head_dim;
    for (uint32_t l = 0; l < c.n_layers; l++) {
        const uint64_t sp = pkvi_sink_pages(e, &e->layers[l]);
        const uint64_t ch = (sp + e->chunk_pages - 1) / e->chunk_pages;
        if (ch > PKVI_MAX_CHUNKS) { /* sinks beyond 64 chunks' worth: absurd */
            st = PKV_EINVAL;
            goto fail;
        }
        if (ch > e->sink_chunks_max)
            e->sink_chunks_max = (uint32_t)ch;
    }
    e->cfg.layer_cfg = c.layer_cfg ? e->layers : NULL;

    if (c.spill_dir) {
        e->spill_dir = strdup(c.spill_dir);
        if (!e->spill_dir) {
            st = PKV_ENOMEM;
            goto fail;
        }
        e->cfg.spill_dir = e->spill_dir;
    }
    st = pkvi_kernels_select(&e->kern);
    if (st != PKV_OK)
        goto fail;
    e->kern = pkvi_kernels_for_dtype(e->kern, c.kv_dtype);
    st = pkvi_prefetch_l2(&e->kp.pf_l2);
    if (st != PKV_OK)
        goto fail;
    pkvi_prefix_init(&e->prefix, c.n_layers, c.block_tokens,
                     c.prefix_cache_bytes / e->page_bytes);
    st = pkvi_pool_init(&e->pool, e->page_bytes, c.mem_budget);
    if (st != PKV_OK)
        goto fail;
    st = pkvi_threads_create(c.n_threads, &e->threads);
    if (st != PKV_OK)
        goto fail;
    if (e->spill_dir) {
        st = pkvi_spill_open(e->spill_dir, &e->spill);
        if (st != PKV_OK)
            goto fail;
    }
    *out = e;
    return PKV_OK;
fail:
    pkv_engine_destroy(e);
    return st;
}

void pkv_engine_destroy(pkv_engine *e)
{
    if (!e)
        return;
    while (e->sessions)
        pkv_session_destroy(e->sessions);
    if (e->prefix.n_layers) /* zero in a create that failed before it */
        pkvi_prefix_fini(&e->prefix, pkvi_engine_pages(e));
    pkvi_spill_close(e->spill);
    pkvi_threads_destroy(e->threads);
    pkvi_pool_fini(&e->pool); /* a no-op on the zeroed pool of a failed create */
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->err_lock);
    for (uint32_t l = 0; e->layers && l < e->cfg.n_layers; l++)
        free((float *)e->layers[l].sink_logits);
    free(e->layers);
    free(e->spill_dir);
    free(e);
}

pkv_status pkv_engine_stats(const pkv_engine *ce, pkv_stats *out)
{
    if (!ce || !out)
        return PKV_EINVAL;
    pkv_engine *e = (pkv_engine *)ce; /* the lock is not part of the logical state */
    pkv_stats s;
    memset(&s, 0, sizeof s);
    s.isa = e->kern->isa;
    s.page_bytes = e->page_bytes;
    s.mem_budget = e->cfg.mem_budget;
    s.pool = e->pool.use_jemalloc ? "jemalloc" : "aligned";
    /* The lock that appends and (with spill) decodes need is held only to copy the
     * counters: a consistent snapshot of them. jemalloc's statistics (an epoch
     * refresh, ~25 us) are read after it, from the arena that is this engine's for
     * its whole life; jemalloc serialises those calls itself. Measured with a
     * thread decoding on a spill engine and a thread polling stats, against the same
     * poller on another engine: 0.04-0.99 of the control's decodes/s (a round at
     * 0.00: starved) while the refresh ran under the lock, 0.88-1.02 now
     * (docs/memory.md). */
    pthread_mutex_lock(&e->lock);
    s.io_backend = e->spill ? pkvi_spill_backend(e->spill) : "none"; /* may fall back to sync */
    /* cached pages (SPEC §10) are resident pages only the prefix index holds: in
     * pool.in_use, not in pages_in_use; spilled ones are in pages_spilled */
    s.pages_in_use = e->pool.in_use - e->prefix.cached.resident;
    s.pages_cached = e->prefix.cached.resident;
    s.pages_free = e->pool.n_free;
    s.pages_spilled = e->pool.spilled;
    s.prefix_lookups = e->prefix.lookups;
    s.prefix_hit_tokens = e->prefix.hit_tokens;
    const uint64_t allocated = e->pool.allocated;
    pthread_mutex_unlock(&e->lock);
    s.bytes_allocator = pkvi_pool_allocator_bytes(&e->pool, allocated);
    *out = s;
    return PKV_OK;
}

pkv_status pkv_engine_config(const pkv_engine *e, pkv_config *out)
{
    if (!e || !out)
        return PKV_EINVAL;
    *out = e->cfg;
    return PKV_OK;
}

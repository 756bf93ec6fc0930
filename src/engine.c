/*
 * engine.c - the engine: configuration validation, creation and destruction of
 * everything it owns (pool, kernels, threads, spill file), engine statistics, and the
 * small public helpers (status strings, version, config defaults).
 *
 * Does not own sessions' contents (session.c) or decode (decode.c).
 */
#include "internal.h"
#include "pkv_config.h"

#include <errno.h>
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

pkv_status pkvi_config_resolve(const pkv_config *cfg, pkv_config *out)
{
    if (!cfg || !out)
        return PKV_EINVAL;
    pkv_config c = *cfg;
    if (c.n_layers == 0 || c.n_heads == 0 || c.n_kv_heads == 0 || c.head_dim == 0)
        return PKV_EINVAL;
    if (c.n_heads % c.n_kv_heads != 0)
        return PKV_EINVAL;
    if (c.n_heads / c.n_kv_heads > PKVI_MAX_GROUP_HEADS || c.head_dim > PKVI_MAX_HEAD_DIM ||
        c.n_kv_heads > PKVI_MAX_KV_HEADS)
        return PKV_EINVAL;
    if (pkv_dtype_size(c.kv_dtype) == 0)
        return PKV_EINVAL;
    if (c.block_tokens == 0)
        c.block_tokens = PKVI_DEFAULT_BLOCK_TOKENS;
    if (!isfinite(c.scale) || c.scale < 0)
        return PKV_EINVAL;
    if (c.scale == 0)
        c.scale = (float)(1.0 / sqrt((double)c.head_dim));
    if (c.n_threads == 0)
        c.n_threads = online_cpus();
    if (c.n_threads > 1024)
        return PKV_EINVAL;
    /* page bytes = 2 * g * bt * d * size, checked */
    uint64_t pb;
    if (!pkvi_mul(2ull * c.n_kv_heads, c.block_tokens, &pb) ||
        !pkvi_mul(pb, c.head_dim, &pb) || !pkvi_mul(pb, pkv_dtype_size(c.kv_dtype), &pb) ||
        pb > PKVI_MAX_PAGE_BYTES)
        return PKV_EINVAL;
    if (c.mem_budget && c.mem_budget < pb)
        return PKV_EINVAL;
    if (c.spill_dir) {
        struct stat st;
        if (c.spill_dir[0] == '\0' || stat(c.spill_dir, &st) != 0 || !S_ISDIR(st.st_mode))
            return PKV_EINVAL;
    }
    *out = c;
    return PKV_OK;
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
    e->dsize = pkv_dtype_size(c.kv_dtype);
    e->row_bytes = (uint64_t)c.head_dim * e->dsize;
    e->page_bytes = 2ull * c.n_kv_heads * c.block_tokens * e->row_bytes;
    e->chunk_pages = (CHUNK_TOKENS + c.block_tokens - 1) / c.block_tokens;
    e->split_awake = (double)PKVI_SPLIT_AWAKE_BYTES;
    e->split_asleep = (double)PKVI_SPLIT_ASLEEP_BYTES;
    e->kp.head_dim = c.head_dim;
    e->kp.block_tokens = c.block_tokens;
    e->kp.hg = e->hg;
    e->kp.dtype = c.kv_dtype;
    e->kp.scale = c.scale;
    e->kp.v_offset = (size_t)(c.block_tokens * e->row_bytes);
    e->kp.group_stride = 2 * e->kp.v_offset;
    pthread_mutex_init(&e->lock, NULL);

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
    st = pkvi_pool_init(&e->pool, e->page_bytes, c.mem_budget);
    if (st != PKV_OK)
        goto fail;
    st = pkvi_threads_create(c.n_threads, &e->threads);
    if (st != PKV_OK)
        goto fail;
    if (e->spill_dir) {
        st = pkvi_spill_open(e);
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
    pkvi_spill_close(e);
    pkvi_threads_destroy(e->threads);
    pkvi_pool_fini(&e->pool); /* a no-op on the zeroed pool of a failed create */
    pthread_mutex_destroy(&e->lock);
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
    /* The lock that appends and (with spill) decodes need is held only to copy the
     * counters: a consistent snapshot of them. jemalloc's statistics (an epoch
     * refresh, ~25 us) are read after it, from the arena that is this engine's for
     * its whole life; jemalloc serialises those calls itself. Measured with a
     * thread decoding on a spill engine and a thread polling stats, against the same
     * poller on another engine: 0.04-0.99 of the control's decodes/s (a round at
     * 0.00: starved) while the refresh ran under the lock, 0.88-1.02 now
     * (docs/memory.md). */
    pthread_mutex_lock(&e->lock);
    s.io_backend = e->spill ? pkvi_spill_backend(e) : "none"; /* may fall back to sync */
    s.pages_in_use = e->pool.in_use;
    s.pages_free = e->pool.n_free;
    s.pages_spilled = e->pool.spilled;
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

/* Visit every block-table reference of every live session. */
#define FOR_EACH_REF(e, pg, body)                                                   \
    for (pkv_session *s_ = (e)->sessions; s_; s_ = s_->next)                        \
        for (uint32_t l_ = 0; l_ < (e)->cfg.n_layers; l_++)                          \
            for (uint64_t i_ = 0; i_ < s_->layers[l_].n_pages; i_++) {              \
                pkvi_page *pg = s_->layers[l_].pages[i_];                            \
                body                                                                 \
            }

#if PKV_POISON
pkv_status pkvi_report_broken(const char *where)
{
    fprintf(stderr, "pagedkv: engine invariants broken (detected in %s)\n", where);
    return PKV_ECORRUPT;
}
#endif

static bool engine_check(pkv_engine *e, bool quiescent)
{
    bool ok = true;
    pthread_mutex_lock(&e->lock);
    const pkvi_pool *p = &e->pool;
    if (p->allocated != p->in_use + p->n_free || p->n_free > p->free_slots ||
        p->free_slots > p->free_cap)
        ok = false;
    if (p->budget_pages && p->in_use + p->n_free > p->budget_pages)
        ok = false;
    const uint64_t bt = e->cfg.block_tokens;
    for (pkv_session *s = e->sessions; s; s = s->next)
        for (uint32_t l = 0; l < e->cfg.n_layers; l++) {
            const pkvi_layer *L = &s->layers[l];
            /* I5 reads len, which an append updates after dropping the lock: only
             * while no call is in flight (the live check looks at locked state only). */
            if (quiescent && L->n_pages != (L->len + bt - 1) / bt)
                ok = false;
            if (L->n_pages > L->cap)
                ok = false;
            for (uint64_t i = 0; i < L->n_pages; i++)
                if (!L->pages[i] || L->pages[i]->refs == 0 ||
                    (quiescent && L->pages[i]->pins != 0))
                    ok = false;
        }
    if (!ok)
        goto out;
    /* I1-I3: tally references per descriptor, then visit each descriptor once. */
    FOR_EACH_REF(e, pg, { pg->tally = 0; })
    FOR_EACH_REF(e, pg, { pg->tally++; })
    uint64_t resident = 0, spilled = 0;
    FOR_EACH_REF(e, pg, {
        if (pg->tally != 0) {
            if (pg->tally != pg->refs)
                ok = false;
            if (pg->data)
                resident++;
            else
                spilled++;
            pg->tally = 0;
        }
    })
    if (resident != p->in_use || spilled != p->spilled)
        ok = false;
out:
    pthread_mutex_unlock(&e->lock);
    return ok;
}

bool pkvi_engine_check(pkv_engine *e)
{
    return engine_check(e, true);
}

bool pkvi_engine_check_live(pkv_engine *e)
{
    return engine_check(e, false);
}

pkv_status pkv_engine_check(pkv_engine *e)
{
    if (!e)
        return PKV_EINVAL;
    return engine_check(e, true) ? PKV_OK : PKV_ECORRUPT;
}

/*
 * exec.h - the decode executor (exec.c): the engine's worker threads and the rule that
 * decides whether a call of the attention pipeline runs on them or on the calling
 * thread alone. decode.c's context, next to the geometry (cache/geom.h).
 *
 * Owns the worker pool (base/threads.h), the split thresholds, the batch scratch (the
 * states of pkv_decode_batch's shared sets, attention/decode.c) and the counts of pages
 * the pipeline read (pkv_stats). Sessions carry a pointer to their engine's executor
 * (session.h) for their decodes. The thread pool serialises runs itself (a second
 * caller runs its tasks alone), and the thresholds change only through the test hook,
 * before any call; the batch scratch has its own lock, the counts are atomic.
 *
 * Invariant: whether a call splits changes no bit of any result (decode.c: the chunks
 * and the merge order depend on positions only).
 */
#ifndef PAGEDKV_EXEC_H
#define PAGEDKV_EXEC_H

#include "base/threads.h"

#include <pthread.h>
#include <stdatomic.h>

/* Below this many K/V values in a whole decode call (times queries for prefill),
 * counted as f16 bytes (2 a value, whatever the page dtype), the calling thread works
 * alone: below 1 MiB two threads do not beat one even with the worker awake, and a
 * call that must wake a sleeping worker pays for it up to 8 MiB (docs/performance.md,
 * decision table: PKVI_SPLIT_AWAKE_BYTES; the rule is in docs/design.md). */
#define PKVI_SPLIT_AWAKE_BYTES (1ull << 20)
#define PKVI_SPLIT_ASLEEP_BYTES (8ull << 20)

/* Most bytes the batch scratch grows to: a shared set's and a verify's wave is cut to
 * fit it (pipeline.h, pkvi_wave_for), and a prefill that fits takes it too; larger
 * calls allocate their own (docs/performance.md, decision table:
 * PKVI_BATCH_SCRATCH_BYTES). */
#define PKVI_BATCH_SCRATCH_BYTES (32ull << 20)

typedef struct pkvi_exec {
    pkvi_threads *threads;       /* n_threads - 1 workers; the caller is the last */
    uint32_t n_threads;
    double split_awake;          /* K/V bytes (x queries) from which a call uses the */
    double split_asleep;         /* workers, awake / asleep (pkvi_threads_split) */
    bool no_share;               /* test hook: pkv_decode_batch never stacks sessions */
    pthread_mutex_t scratch_lock;/* guards scratch and scratch_floats */
    float *scratch;              /* [scratch_floats], 64-byte aligned: a shared batch's
                                    queries by group and states, a verify's block, a
                                    prefill's queries and states; grown, kept */
    uint64_t scratch_floats;
    /* page walks of the pipeline (pkv_stats): of pages that served several queries
       of one call at once, of pages that served one, and the walks that sharing
       spared (one page for k queries spares k - 1) */
    _Atomic uint64_t pages_shared, pages_private, reads_saved;
} pkvi_exec;

/* An executor of n_threads threads (n_threads - 1 workers). PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_exec_init(pkvi_exec *x, uint32_t n_threads);
PKVI_HIDDEN void pkvi_exec_fini(pkvi_exec *x);
/* Whether a call over `bytes` of K/V (times queries, as f16 bytes) goes to the workers. */
PKVI_HIDDEN bool pkvi_exec_parallel(const pkvi_exec *x, double bytes);
/* Test hook: every call that can split goes to the workers, whatever its size and
 * timing (the thread-count identity tests must exercise the split paths). */
PKVI_HIDDEN void pkvi_exec_split_always(pkvi_exec *x);

/* The batch scratch with room for `floats` floats, locked for the caller until
 * pkvi_exec_scratch_put; NULL when another call holds it, when floats exceeds
 * PKVI_BATCH_SCRATCH_BYTES or when it cannot grow: the caller then decodes its
 * sessions one set each (the same bits). */
PKVI_HIDDEN float *pkvi_exec_scratch_take(pkvi_exec *x, uint64_t floats);
PKVI_HIDDEN void pkvi_exec_scratch_put(pkvi_exec *x);
/* A call's working block of `bytes` (64-byte aligned): the batch scratch when it is free
 * and large enough (its pages stay mapped from call to call; a block of this size
 * allocated per call came back from the allocator unmapped and was faulted in again:
 * docs/performance.md, decision table: PKVI_BATCH_SCRATCH_BYTES), else one of its own;
 * *own says which, for pkvi_exec_block_put (true with NULL: putting NULL back is a
 * no-op). NULL when neither can be had. pkv_verify's and pkv_prefill's. */
PKVI_HIDDEN void *pkvi_exec_block_take(pkvi_exec *x, uint64_t bytes, bool *own);
PKVI_HIDDEN void pkvi_exec_block_put(pkvi_exec *x, void *block, bool own);
/* Add a task's page walks to the counts (relaxed atomics: figures, not ordering). */
static inline void pkvi_exec_count(pkvi_exec *x, uint64_t shared, uint64_t priv,
                                   uint64_t saved)
{
    if (shared)
        atomic_fetch_add_explicit(&x->pages_shared, shared, memory_order_relaxed);
    if (priv)
        atomic_fetch_add_explicit(&x->pages_private, priv, memory_order_relaxed);
    if (saved)
        atomic_fetch_add_explicit(&x->reads_saved, saved, memory_order_relaxed);
}

#endif /* PAGEDKV_EXEC_H */

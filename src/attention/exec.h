/*
 * exec.h - the decode executor (exec.c): the engine's worker threads and the rule that
 * decides whether a call of the attention pipeline runs on them or on the calling
 * thread alone. decode.c's context, next to the geometry (cache/geom.h).
 *
 * Owns the worker pool (base/threads.h) and the split thresholds; sessions carry a
 * pointer to their engine's executor (session.h) for their decodes. No lock of its
 * own: the thread pool serialises runs itself (a second caller runs its tasks alone),
 * and the thresholds change only through the test hook, before any call.
 *
 * Invariant: whether a call splits changes no bit of any result (decode.c: the chunks
 * and the merge order depend on positions only).
 */
#ifndef PAGEDKV_EXEC_H
#define PAGEDKV_EXEC_H

#include "base/threads.h"

/* Below this many K/V values in a whole decode call (times queries for prefill),
 * counted as f16 bytes (2 a value, whatever the page dtype), the calling thread works
 * alone: below 1 MiB two threads do not beat one even with the worker awake, and a
 * call that must wake a sleeping worker pays for it up to 8 MiB (docs/performance.md,
 * decision table: PKVI_SPLIT_AWAKE_BYTES; the rule is in docs/design.md). */
#define PKVI_SPLIT_AWAKE_BYTES (1ull << 20)
#define PKVI_SPLIT_ASLEEP_BYTES (8ull << 20)

typedef struct pkvi_exec {
    pkvi_threads *threads;       /* n_threads - 1 workers; the caller is the last */
    uint32_t n_threads;
    double split_awake;          /* K/V bytes (x queries) from which a call uses the */
    double split_asleep;         /* workers, awake / asleep (pkvi_threads_split) */
} pkvi_exec;

/* An executor of n_threads threads (n_threads - 1 workers). PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_exec_init(pkvi_exec *x, uint32_t n_threads);
PKVI_HIDDEN void pkvi_exec_fini(pkvi_exec *x);
/* Whether a call over `bytes` of K/V (times queries, as f16 bytes) goes to the workers. */
PKVI_HIDDEN bool pkvi_exec_parallel(const pkvi_exec *x, double bytes);
/* Test hook: every call that can split goes to the workers, whatever its size and
 * timing (the thread-count identity tests must exercise the split paths). */
PKVI_HIDDEN void pkvi_exec_split_always(pkvi_exec *x);

#endif /* PAGEDKV_EXEC_H */

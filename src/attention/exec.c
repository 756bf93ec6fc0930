/*
 * exec.c - the decode executor (exec.h): the engine's worker threads and the split
 * rule of the attention pipeline.
 *
 * Owns the pool of worker threads from creation to destruction and the two
 * thresholds; the rule itself (awake or asleep workers) is threads.c's.
 */
#include "attention/exec.h"

pkv_status pkvi_exec_init(pkvi_exec *x, uint32_t n_threads)
{
    x->n_threads = n_threads;
    x->split_awake = (double)PKVI_SPLIT_AWAKE_BYTES;
    x->split_asleep = (double)PKVI_SPLIT_ASLEEP_BYTES;
    return pkvi_threads_create(n_threads, &x->threads);
}

void pkvi_exec_fini(pkvi_exec *x)
{
    pkvi_threads_destroy(x->threads);
    x->threads = NULL;
}

bool pkvi_exec_parallel(const pkvi_exec *x, double bytes)
{
    return pkvi_threads_split(x->threads, bytes, x->split_awake, x->split_asleep);
}

void pkvi_exec_split_always(pkvi_exec *x)
{
    x->split_awake = x->split_asleep = 0;
}

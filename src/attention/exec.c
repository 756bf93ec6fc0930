/*
 * exec.c - the decode executor (exec.h): the engine's worker threads and the split
 * rule of the attention pipeline.
 *
 * Owns the pool of worker threads from creation to destruction, the two thresholds
 * and the batch scratch; the rule itself (awake or asleep workers) is threads.c's.
 */
#include "attention/exec.h"

#include <stdlib.h>

pkv_status pkvi_exec_init(pkvi_exec *x, uint32_t n_threads)
{
    x->n_threads = n_threads;
    x->split_awake = (double)PKVI_SPLIT_AWAKE_BYTES;
    x->split_asleep = (double)PKVI_SPLIT_ASLEEP_BYTES;
    x->no_share = false;
    x->scratch = NULL;
    x->scratch_floats = 0;
    atomic_init(&x->pages_shared, 0);
    atomic_init(&x->pages_private, 0);
    atomic_init(&x->reads_saved, 0);
    if (pthread_mutex_init(&x->scratch_lock, NULL) != 0)
        return PKV_ENOMEM;
    const pkv_status st = pkvi_threads_create(n_threads, &x->threads);
    if (st != PKV_OK)
        pthread_mutex_destroy(&x->scratch_lock);
    return st;
}

void pkvi_exec_fini(pkvi_exec *x)
{
    pkvi_threads_destroy(x->threads);
    x->threads = NULL;
    pthread_mutex_destroy(&x->scratch_lock);
    free(x->scratch);
    x->scratch = NULL;
}

float *pkvi_exec_scratch_take(pkvi_exec *x, uint64_t floats)
{
    if (floats > PKVI_BATCH_SCRATCH_BYTES / sizeof(float) ||
        pthread_mutex_trylock(&x->scratch_lock) != 0)
        return NULL;
    if (floats > x->scratch_floats) {
        /* grown to what the call needs, rounded to a cache line */
        const size_t bytes = (size_t)((floats * sizeof(float) + 63) & ~63ull);
        float *p = aligned_alloc(64, bytes);
        if (!p) {
            pthread_mutex_unlock(&x->scratch_lock);
            return NULL;
        }
        free(x->scratch);
        x->scratch = p;
        x->scratch_floats = bytes / sizeof(float);
    }
    return x->scratch;
}

void pkvi_exec_scratch_put(pkvi_exec *x)
{
    pthread_mutex_unlock(&x->scratch_lock);
}

void *pkvi_exec_block_take(pkvi_exec *x, uint64_t bytes, bool *own)
{
    *own = true; /* a NULL block puts back as free(NULL) */
    if (bytes > SIZE_MAX - 63)
        return NULL;
    void *p = pkvi_exec_scratch_take(x, (bytes + sizeof(float) - 1) / sizeof(float));
    *own = p == NULL;
    if (!p)
        p = aligned_alloc(64, bytes ? (size_t)((bytes + 63) & ~63ull) : 64);
    return p;
}

void pkvi_exec_block_put(pkvi_exec *x, void *block, bool own)
{
    if (own)
        free(block);
    else
        pkvi_exec_scratch_put(x);
}

bool pkvi_exec_parallel(const pkvi_exec *x, double bytes)
{
    return pkvi_threads_split(x->threads, bytes, x->split_awake, x->split_asleep);
}

void pkvi_exec_split_always(pkvi_exec *x)
{
    x->split_awake = x->split_asleep = 0;
}

/*
 * threads.c - the engine's persistent worker pool.
 *
 * Owns n_threads - 1 worker threads created once with the engine; the thread that
 * calls pkvi_threads_run is the n-th worker. A run hands out task indices from an
 * atomic counter, so which thread runs which task varies; callers make every task's
 * arithmetic independent of that (decode.c: fixed chunks, fixed merge order), which is
 * why results are bitwise identical for any thread count.
 *
 * One run at a time: `run_lock` is held for a whole run. A second caller that finds the
 * pool busy does not wait; it runs all its tasks itself (same results, no deadlock, no
 * convoy when many sessions decode from many threads).
 *
 * Job hand-off (guarded by `mu`): the caller publishes (fn, ctx, n_tasks), bumps
 * `generation` and broadcasts `wake`; workers sleep on `wake` until the generation
 * changes. `next` (atomic) hands out tasks; `done` (atomic) counts finished ones; the
 * last finisher signals `idle`.
 */
#include "internal.h"

#include <stdatomic.h>
#include <stdlib.h>

struct pkvi_threads {
    uint32_t n_workers;          /* threads created (n_threads - 1) */
    pthread_t *tids;             /* [n_workers] */
    pthread_mutex_t run_lock;    /* held by the caller for a whole run */
    pthread_mutex_t mu;          /* guards generation, stop, job fields */
    pthread_cond_t wake, idle;
    uint64_t generation;         /* mu */
    bool stop;                   /* mu */
    pkvi_task_fn fn;             /* mu (read by workers after waking) */
    void *ctx;
    uint32_t n_tasks;
    atomic_uint next;            /* next task index to hand out */
    atomic_uint done;            /* tasks finished in this run */
    uint32_t active;             /* workers inside the current run; mu */
};

/* Take and run tasks of the current run until none remain. */
static void drain(pkvi_threads *t, pkvi_task_fn fn, void *ctx, uint32_t n)
{
    for (;;) {
        uint32_t i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
        if (i >= n)
            return;
        fn(ctx, i);
        if (atomic_fetch_add_explicit(&t->done, 1, memory_order_acq_rel) + 1 == n) {
            pthread_mutex_lock(&t->mu);
            pthread_cond_broadcast(&t->idle);
            pthread_mutex_unlock(&t->mu);
        }
    }
}

static void *worker(void *arg)
{
    pkvi_threads *t = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->stop && t->generation == seen)
            pthread_cond_wait(&t->wake, &t->mu);
        if (t->stop)
            break;
        seen = t->generation;
        pkvi_task_fn fn = t->fn;
        void *ctx = t->ctx;
        uint32_t n = t->n_tasks;
        t->active++;
        pthread_mutex_unlock(&t->mu);
        drain(t, fn, ctx, n);
        pthread_mutex_lock(&t->mu);
        t->active--;
        if (t->active == 0)
            pthread_cond_broadcast(&t->idle);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

pkv_status pkvi_threads_create(uint32_t n_threads, pkvi_threads **out)
{
    *out = NULL;
    pkvi_threads *t = calloc(1, sizeof *t);
    if (!t)
        return PKV_ENOMEM;
    t->n_workers = n_threads > 1 ? n_threads - 1 : 0;
    if (t->n_workers) {
        t->tids = calloc(t->n_workers, sizeof *t->tids);
        if (!t->tids) {
            free(t);
            return PKV_ENOMEM;
        }
    }
    pthread_mutex_init(&t->run_lock, NULL);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->wake, NULL);
    pthread_cond_init(&t->idle, NULL);
    atomic_init(&t->next, 0);
    atomic_init(&t->done, 0);
    for (uint32_t i = 0; i < t->n_workers; i++) {
        if (pthread_create(&t->tids[i], NULL, worker, t) != 0) {
            t->n_workers = i; /* destroy joins the ones that started */
            pkvi_threads_destroy(t);
            return PKV_ENOMEM;
        }
    }
    *out = t;
    return PKV_OK;
}

void pkvi_threads_destroy(pkvi_threads *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_broadcast(&t->wake);
    pthread_mutex_unlock(&t->mu);
    for (uint32_t i = 0; i < t->n_workers; i++)
        pthread_join(t->tids[i], NULL);
    pthread_cond_destroy(&t->wake);
    pthread_cond_destroy(&t->idle);
    pthread_mutex_destroy(&t->mu);
    pthread_mutex_destroy(&t->run_lock);
    free(t->tids);
    free(t);
}

void pkvi_threads_run(pkvi_threads *t, uint32_t n_tasks, pkvi_task_fn fn, void *ctx)
{
    if (n_tasks == 0)
        return;
    if (!t || t->n_workers == 0 || n_tasks == 1 || pthread_mutex_trylock(&t->run_lock) != 0) {
        for (uint32_t i = 0; i < n_tasks; i++)
            fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&t->mu);
    /* A worker may still be leaving the previous run (it finished its last task but
     * has not yet decremented `active`); wait so it cannot take tasks of this run with
     * stale fn/ctx. */
    while (t->active > 0)
        pthread_cond_wait(&t->idle, &t->mu);
    t->fn = fn;
    t->ctx = ctx;
    t->n_tasks = n_tasks;
    atomic_store_explicit(&t->next, 0, memory_order_relaxed);
    atomic_store_explicit(&t->done, 0, memory_order_relaxed);
    t->generation++;
    pthread_cond_broadcast(&t->wake);
    pthread_mutex_unlock(&t->mu);

    drain(t, fn, ctx, n_tasks);

    pthread_mutex_lock(&t->mu);
    while (atomic_load_explicit(&t->done, memory_order_acquire) < n_tasks)
        pthread_cond_wait(&t->idle, &t->mu);
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_unlock(&t->run_lock);
}

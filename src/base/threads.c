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
 *
 * Both hand-offs spin briefly before they sleep: a worker that finished a run polls
 * `generation` for SPIN_NS before waiting on `wake`, and the caller polls `done` for
 * as long before waiting on `idle`. A futex wake-up costs more than a whole in-cache
 * decode's share of work (docs/performance.md, decision table: SPIN_NS), and a
 * generator calls decode for every layer back to back. The spin reads only atomics; every job field is still
 * read under `mu`.
 */
#include "base/threads.h"

#include <pthread.h>

#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

/* How long a hand-off polls before it sleeps: a worker at most this long after each
 * run. Long enough for a tight loop of decodes to find the workers awake
 * (docs/performance.md, decision table: SPIN_NS). */
#define SPIN_NS 200000ll

struct pkvi_threads {
    uint32_t n_workers;          /* threads created (n_threads - 1) */
    pthread_t *tids;             /* [n_workers] */
    pthread_mutex_t run_lock;    /* held by the caller for a whole run */
    pthread_mutex_t mu;          /* guards generation, stop, job fields */
    pthread_cond_t wake, idle;
    atomic_uint_fast64_t generation; /* written under mu; polled without it */
    atomic_bool stop;            /* written under mu; polled without it */
    pkvi_task_fn fn;             /* mu (read by workers after waking) */
    void *ctx;
    uint32_t n_tasks;
    atomic_uint next;            /* next task index to hand out */
    atomic_uint done;            /* tasks finished in this run */
    atomic_uint awake;           /* workers not asleep on `wake` (running or polling) */
    atomic_int_fast64_t last_end; /* CLOCK_MONOTONIC ns when the last call ended */
    uint32_t active;             /* workers inside the current run; mu */
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Poll until ready(t, arg) or SPIN_NS have passed (the caller then sleeps if need be). */
static void spin_until(const pkvi_threads *t, bool (*ready)(const pkvi_threads *, uint64_t),
                       uint64_t arg)
{
    const int64_t end = now_ns() + SPIN_NS;
    for (uint32_t i = 0; !ready(t, arg); i++) {
        if (i % 64 == 63 && now_ns() >= end)
            return;
        cpu_relax();
    }
}

/* The conditions a hand-off waits for, polled by spin_until and re-checked under mu
 * before sleeping on the condition variable. */
static bool new_run(const pkvi_threads *t, uint64_t seen)
{
    return atomic_load_explicit(&t->generation, memory_order_relaxed) != seen ||
           atomic_load_explicit(&t->stop, memory_order_relaxed);
}

static bool all_done(const pkvi_threads *t, uint64_t n)
{
    return atomic_load_explicit(&t->done, memory_order_acquire) >= n;
}

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
        if (!new_run(t, seen)) {
            atomic_fetch_sub_explicit(&t->awake, 1, memory_order_relaxed);
            do
                pthread_cond_wait(&t->wake, &t->mu);
            while (!new_run(t, seen));
            atomic_fetch_add_explicit(&t->awake, 1, memory_order_relaxed);
        }
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
        pthread_mutex_unlock(&t->mu);
        spin_until(t, new_run, seen); /* the next run is often right behind */
        pthread_mutex_lock(&t->mu);
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
    atomic_init(&t->generation, 0);
    atomic_init(&t->stop, false);
    atomic_init(&t->awake, t->n_workers); /* each goes to sleep once it starts */
    atomic_init(&t->last_end, 0);
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

bool pkvi_threads_split(const pkvi_threads *t, double work, double hot_min, double cold_min)
{
    if (!t || t->n_workers == 0 || work < hot_min)
        return false;
    if (work >= cold_min ||
        atomic_load_explicit(&t->awake, memory_order_relaxed) == t->n_workers)
        return true;
    /* Asleep, but the last call ended moments ago: calls are coming back to back, and
     * after this one's wake-up the workers will be polling when the next arrives. */
    const int64_t last = atomic_load_explicit(&t->last_end, memory_order_relaxed);
    return last && now_ns() - last < SPIN_NS;
}

void pkvi_threads_call_done(pkvi_threads *t)
{
    if (t)
        atomic_store_explicit(&t->last_end, now_ns(), memory_order_relaxed);
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

    spin_until(t, all_done, n_tasks);
    pthread_mutex_lock(&t->mu);
    while (!all_done(t, n_tasks))
        pthread_cond_wait(&t->idle, &t->mu);
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_unlock(&t->run_lock);
}

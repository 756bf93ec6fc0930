/*
 * threads.h - the engine's persistent worker pool (threads.c).
 *
 * Owns its worker threads and the hand-off of one run of tasks at a time. Knows
 * nothing of attention: a run is n_tasks calls of fn(ctx, task), in any order, on any
 * thread; the caller makes the result independent of that order.
 */
#ifndef PAGEDKV_THREADS_H
#define PAGEDKV_THREADS_H

#include "base/util.h"

typedef struct pkvi_threads pkvi_threads;
/* fn(ctx, task) runs once for every task in [0, n_tasks), on any thread. */
typedef void (*pkvi_task_fn)(void *ctx, uint32_t task);
PKVI_HIDDEN pkv_status pkvi_threads_create(uint32_t n_threads, pkvi_threads **out);
PKVI_HIDDEN void pkvi_threads_destroy(pkvi_threads *t);
/* Run the tasks on the pool plus the calling thread; returns when all are done.
 * If another thread is using the pool, the caller runs every task itself. */
PKVI_HIDDEN void pkvi_threads_run(pkvi_threads *t, uint32_t n_tasks, pkvi_task_fn fn,
                                  void *ctx);
/* Whether a call of `work` units should run on the pool: from hot_min up when every
 * worker is awake (in a run, or polling right after one) or the previous call ended
 * moments ago (calls back to back: after one wake-up they stay awake), else from
 * cold_min up, as a wake-up is then paid on every call. False for NULL or no workers. */
PKVI_HIDDEN bool pkvi_threads_split(const pkvi_threads *t, double work, double hot_min,
                                    double cold_min);
/* Record that a call (on the pool or not) ended now: the back-to-back test above. */
PKVI_HIDDEN void pkvi_threads_call_done(pkvi_threads *t);

#endif /* PAGEDKV_THREADS_H */

/*
 * base/error.h - an engine's error sink (error.c): the reason of its most recent
 * failed call, which pkv_engine_last_error reads.
 *
 * Owns the text and the mutex that guards it. The lock is its own, never the engine
 * lock that decode and append take, so recording a failure never waits on it, and it
 * is held only to copy the text. pkvi_fail formats into a stack buffer first: no
 * allocation, nothing global.
 *
 * Every module that fails a call gets the sink as its context (sessions carry a
 * pointer to their engine's), not the engine.
 */
#ifndef PAGEDKV_ERROR_H
#define PAGEDKV_ERROR_H

#include "base/util.h"

#include <pthread.h>

typedef struct {
    pthread_mutex_t lock;        /* guards text alone */
    char text[256];              /* reason of the most recent failed call; "" at first */
} pkvi_errs;

PKVI_HIDDEN void pkvi_errs_init(pkvi_errs *err);
PKVI_HIDDEN void pkvi_errs_fini(pkvi_errs *err);
/* Record why a call failed (printf format) and return st, so failure paths read
 * `return pkvi_fail(err, PKV_EINVAL, "...", ...)`. */
PKVI_HIDDEN pkv_status pkvi_fail(pkvi_errs *err, pkv_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Copy the recorded reason into buf (size > 0), truncated. */
PKVI_HIDDEN void pkvi_errs_read(pkvi_errs *err, char *buf, size_t size);

#endif /* PAGEDKV_ERROR_H */

/*
 * error.c - the reason of an engine's most recent failed call (pkv_engine_last_error).
 *
 * Owns e->err (under e->err_lock, a mutex of its own so that recording a failure never
 * waits on the engine lock that decode and append take). Failure paths call pkvi_fail,
 * which formats into a stack buffer first and copies it under the lock: no allocation,
 * nothing global.
 */
#include "engine/engine.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

pkv_status pkvi_fail(const pkv_engine *ce, pkv_status st, const char *fmt, ...)
{
    pkv_engine *e = (pkv_engine *)ce; /* the record is not part of the logical state */
    char buf[sizeof e->err];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&e->err_lock);
    memcpy(e->err, buf, sizeof buf);
    pthread_mutex_unlock(&e->err_lock);
    return st;
}

pkv_status pkv_engine_last_error(const pkv_engine *ce, char *buf, size_t size)
{
    if (!ce || !buf || size == 0)
        return PKV_EINVAL;
    pkv_engine *e = (pkv_engine *)ce; /* the lock is not part of the logical state */
    pthread_mutex_lock(&e->err_lock);
    snprintf(buf, size, "%s", e->err);
    pthread_mutex_unlock(&e->err_lock);
    return PKV_OK;
}

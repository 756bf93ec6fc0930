/*
 * error.c - an engine's error sink (base/error.h): the reason of its most recent
 * failed call.
 *
 * Owns the sink's text under its own mutex (never the engine lock that decode and
 * append take: recording a failure never waits on it). pkvi_fail formats into a stack
 * buffer first and copies it under the lock: no allocation, nothing global.
 */
#include "base/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void pkvi_errs_init(pkvi_errs *err)
{
    pthread_mutex_init(&err->lock, NULL);
    err->text[0] = '\0';
}

void pkvi_errs_fini(pkvi_errs *err)
{
    pthread_mutex_destroy(&err->lock);
}

pkv_status pkvi_fail(pkvi_errs *err, pkv_status st, const char *fmt, ...)
{
    char buf[sizeof err->text];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&err->lock);
    memcpy(err->text, buf, sizeof buf);
    pthread_mutex_unlock(&err->lock);
    return st;
}

void pkvi_errs_read(pkvi_errs *err, char *buf, size_t size)
{
    pthread_mutex_lock(&err->lock);
    snprintf(buf, size, "%s", err->text);
    pthread_mutex_unlock(&err->lock);
}

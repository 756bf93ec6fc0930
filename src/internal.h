/*
 * internal.h - every internal header at once, for the test suites (tests/) and the
 * fuzz harnesses, which reach internals through the pagedkv_internal library.
 *
 * The library's own files never include it: each includes the headers of the
 * concerns it uses, so the include graph is the module map of docs/design.md:
 *
 *   util.h  dtype.h  kernels/kernels.h  threads.h  io.h        (leaves)
 *   pool.h  <- spill.h <- btable.h <- engine/engine.h <- session.h     (the page stack)
 *   decode.h                                                    (the pipeline)
 */
#ifndef PAGEDKV_INTERNAL_H
#define PAGEDKV_INTERNAL_H

#include "base/util.h"
#include "base/dtype.h"
#include "kernels/kernels.h"
#include "base/threads.h"
#include "store/io.h"
#include "store/pool.h"
#include "store/spill.h"
#include "cache/btable.h"
#include "engine/engine.h"
#include "session/session.h"
#include "attention/decode.h"

#endif /* PAGEDKV_INTERNAL_H */

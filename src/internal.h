/*
 * internal.h - every internal header at once, for the test suites (tests/) and the
 * fuzz harnesses, which reach internals through the pagedkv_internal library.
 *
 * The library's own files never include it: each includes the headers of the
 * concerns it uses, so the include graph is the module map of docs/design.md:
 *
 *   base/       util.h  dtype.h  quant.h  threads.h  window.h  error.h      (leaves)
 *   kernels/    kernels.h
 *   store/      pool.h <- spill.h, io.h, crc32c.h
 *   cache/      btable.h <- prefix.h <- cache.h (shared state);  geom.h (geometry)
 *   session/    session.h (struct pkv_session, pkvi_ctx)
 *   attention/  exec.h  pipeline.h  decode.h;  persist/sfile.h
 *   engine/     engine.h (for the tests: an engine's contexts)
 */
#ifndef PAGEDKV_INTERNAL_H
#define PAGEDKV_INTERNAL_H

#include "base/util.h"
#include "base/dtype.h"
#include "base/error.h"
#include "base/threads.h"
#include "base/window.h"
#include "kernels/kernels.h"
#include "rope/rope.h"
#include "store/crc32c.h"
#include "store/io.h"
#include "store/pool.h"
#include "store/spill.h"
#include "cache/btable.h"
#include "cache/prefix.h"
#include "cache/cache.h"
#include "cache/geom.h"
#include "session/session.h"
#include "attention/exec.h"
#include "attention/pipeline.h"
#include "attention/decode.h"
#include "persist/sfile.h"
#include "engine/engine.h"

#endif /* PAGEDKV_INTERNAL_H */

/*
 * engine/engine.h - what the tests know of an engine beyond the public API: the
 * narrow contexts it lends its modules. In the library only engine.c includes it:
 * every module works from the contexts it is handed (session/session.h: pkvi_ctx),
 * never from the engine, whose struct engine.c alone defines.
 *
 * Owns nothing; it only declares. An engine's contexts are valid from
 * pkv_engine_create to pkv_engine_destroy; their own headers say what each owns and
 * which lock guards it (cache/geom.h, cache/cache.h, attention/exec.h, base/error.h).
 */
#ifndef PAGEDKV_ENGINE_H
#define PAGEDKV_ENGINE_H

#include "session/session.h"

/* e's contexts: the geometry, the shared cache state, the decode executor and the
 * error sink (the tests reach the hooks of each module through them). */
PKVI_HIDDEN pkvi_ctx pkvi_engine_ctx(pkv_engine *e);
/* Every invariant of e (pkv_engine_check as a bool, between calls). */
PKVI_HIDDEN bool pkvi_engine_check(pkv_engine *e);

#endif /* PAGEDKV_ENGINE_H */

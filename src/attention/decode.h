/*
 * decode.h - the attention calls (decode.c over the pipeline, pipeline.h):
 * pkv_decode, pkv_decode_batch, pkv_prefill and the shard calls are its public entry
 * points, pkv_verify verify.c's. This header declares what engine.c forwards the calls
 * that take an engine handle to, with the contexts they need (the merge of partial
 * states is pipeline.h's), and what the tests reach.
 *
 * Owns nothing at run time; decode.c's state is per call (its scratch is the
 * session's, grown by reservations, so decode never allocates). Lock: none of its
 * own; it pins a layer through the session's residency calls for the length of a
 * call.
 */
#ifndef PAGEDKV_DECODE_H
#define PAGEDKV_DECODE_H

#include "attention/pipeline.h"

/* pkv_decode_batch for the engine whose contexts ctx names (sessions, q and out
 * checked non-NULL, n > 0). */
PKVI_HIDDEN pkv_status pkvi_decode_batch(const pkvi_ctx *ctx, uint32_t layer, uint32_t n,
                                         pkv_session *const *sessions, const float *q,
                                         float *out);
#endif /* PAGEDKV_DECODE_H */

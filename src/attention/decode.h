/*
 * decode.h - the attention pipeline (decode.c): pkv_decode, pkv_decode_batch,
 * pkv_prefill and the shard calls are its public entry points. This header declares
 * what engine.c forwards the calls that take an engine handle to, with the contexts
 * they need, and what the tests reach.
 *
 * Owns nothing at run time; decode.c's state is per call (its scratch is the
 * session's, grown by reservations, so decode never allocates). Lock: none of its
 * own; it pins a layer through the session's residency calls for the length of a
 * call.
 */
#ifndef PAGEDKV_DECODE_H
#define PAGEDKV_DECODE_H

#include "session/session.h"

/* pkv_decode_batch for the engine whose contexts ctx names (sessions, q and out
 * checked non-NULL, n > 0). */
PKVI_HIDDEN pkv_status pkvi_decode_batch(const pkvi_ctx *ctx, uint32_t layer, uint32_t n,
                                         pkv_session *const *sessions, const float *q,
                                         float *out);
/* pkv_merge_partials and pkv_fold_partials of an engine of geometry geo (states and out
 * checked non-NULL, n_chunks > 0). */
PKVI_HIDDEN pkv_status pkvi_merge_partials(const pkvi_geom *geo, uint32_t n_chunks,
                                           const float *states, float *out);
PKVI_HIDDEN pkv_status pkvi_fold_partials(const pkvi_geom *geo, uint32_t n_chunks,
                                          const float *states, float *state_out);

/* The chunk of C that a set's t-th chunk task walks when R threads share them: a
 * permutation of [0, C) for t in [0, C), the identity for R = 1 (decode.c says why). */
PKVI_HIDDEN uint32_t pkvi_chunk_order(uint32_t t, uint32_t C, uint32_t R);

#endif /* PAGEDKV_DECODE_H */

/*
 * reference.h - what the library itself uses of reference.c (the dense oracle of
 * SPEC §1 and §8): the one definition of a valid layer config, shared by the oracle
 * and pkv_engine_create so both reject exactly the same configs.
 */
#ifndef PAGEDKV_REFERENCE_H
#define PAGEDKV_REFERENCE_H

#include "base/util.h"

/* SPEC §8: sink_tokens or rollback_tokens need a window; softcap >= 0 and finite;
 * every sink logit (n_heads of them) finite. NULL is valid (full causal). */
PKVI_HIDDEN bool pkvi_layer_config_ok(const pkv_layer_config *lc, uint32_t n_heads);

/* A windowed layer's page arithmetic (SPEC §8), the one definition the engine and the
 * file format use. Pages of bt positions; 0 sink pages without a window. */
static inline uint64_t pkvi_window_sink_pages(const pkv_layer_config *lc, uint64_t bt)
{
    return lc->window ? ((uint64_t)lc->sink_tokens + bt - 1) / bt : 0;
}
/* The first page a windowed layer of len positions must still hold: a decode at
 * len - 1, or at n - 1 after a truncate to n >= len - rollback, reads no earlier
 * position than len - rollback - window (sinks aside). */
static inline uint64_t pkvi_window_keep_from(const pkv_layer_config *lc, uint64_t len,
                                             uint64_t bt)
{
    const uint64_t span = (uint64_t)lc->window + lc->rollback_tokens;
    return len > span ? (len - span) / bt : 0;
}
/* Positions of a layer of len positions a decode may still need: all of them, or for
 * a windowed layer its sinks and its last window + rollback ones. */
static inline uint64_t pkvi_window_needed(const pkv_layer_config *lc, uint64_t len)
{
    const uint64_t most = (uint64_t)lc->window + lc->rollback_tokens + lc->sink_tokens;
    return lc->window && len > most ? most : len;
}

#endif /* PAGEDKV_REFERENCE_H */

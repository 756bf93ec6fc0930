/*
 * reference.h - what the library itself uses of reference.c (the dense oracle of
 * include/pagedkv.h and docs/variants.md): the one definition of a valid layer config,
 * shared by the oracle and pkv_engine_create so both reject exactly the same configs.
 * The window arithmetic both of them follow is base/window.h. No state, no lock.
 */
#ifndef PAGEDKV_REFERENCE_H
#define PAGEDKV_REFERENCE_H

#include "base/util.h"

/* docs/variants.md: sink_tokens or rollback_tokens need a window; softcap >= 0 and
 * finite; every sink logit (n_heads of them) finite. NULL is valid (full causal). */
PKVI_HIDDEN bool pkvi_layer_config_ok(const pkv_layer_config *lc, uint32_t n_heads);

#endif /* PAGEDKV_REFERENCE_H */

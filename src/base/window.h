/*
 * base/window.h - a windowed layer's position and page arithmetic (docs/variants.md):
 * which positions a query at position t attends, and which pages a layer of len
 * positions must still hold. The one definition that the dense oracle
 * (attention/reference.c), the decode pipeline (attention/decode.c), the sessions
 * (session/) and the session file (persist/) use, so they cannot disagree.
 *
 * Owns nothing: pure functions of a pkv_layer_config and the page size bt (positions
 * per page). No locks. A layer without a window (window == 0) attends every position
 * up to t and holds every page; its sink_tokens and rollback_tokens are 0
 * (pkvi_layer_config_ok, attention/reference.h).
 *
 * With a window w, a query at t attends A = { j <= t : j > t - w } u { j < sinks }:
 *
 *        0      sinks         lo = t + 1 - w               t
 *        [ sinks )   ...released...   [ the window .......... ]
 *        pages [0, sink pages) kept   pages from keep_from(len) on kept
 */
#ifndef PAGEDKV_WINDOW_H
#define PAGEDKV_WINDOW_H

#include "base/util.h"

/* The first position of the window of a query at position t: positions below it are
 * attended only as sinks. 0 without a window (every position is attended). Computed
 * as t - (w - 1), never t + 1 - w: t + 1 wraps to 0 at UINT64_MAX (a window run of
 * [0, len) over released pages, once). */
static inline uint64_t pkvi_window_lo(const pkv_layer_config *lc, uint64_t t)
{
    return lc->window && t >= lc->window ? t - (lc->window - 1) : 0;
}

/* Pages of bt positions holding a windowed layer's sink positions (kept for ever); 0
 * without a window. */
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

#endif /* PAGEDKV_WINDOW_H */

/*
 * geom.h - an engine's geometry: the immutable context every layer above the block
 * tables reads (sessions, the decode pipeline, the session file). The resolved
 * configuration, the page layout derived from it, each layer's attention variant,
 * the split-K chunk and the kernels chosen for this CPU.
 *
 * Owns nothing: engine.c fills one per engine at creation and owns what it points to
 * (the layer array and its sink logits); nothing changes it afterwards, so it is read
 * without any lock. Sessions keep a pointer to their engine's.
 *
 * Invariants (engine.c, pkv_engine_create):
 *   page_bytes == n_kv_heads * kp.group_stride, kp.group_stride == bt * (row_bytes +
 *   row_bytes_v), kp.v_offset == bt * row_bytes: a page is group-major, each group's
 *   bt K rows then its bt V rows (docs/design.md, "Page layout").
 *   layers[l] is all zeros for a plain causal layer; cfg.layer_cfg == layers or NULL;
 *   its rope fields are resolved (defaults filled in), and rope[l] != NULL exactly
 *   when layers[l].rope != 0.
 *   chunk c of a layer is its pages [c * chunk_pages, (c + 1) * chunk_pages), whatever
 *   its length (decode.c: what makes results independent of threads and shards).
 */
#ifndef PAGEDKV_GEOM_H
#define PAGEDKV_GEOM_H

#include "base/window.h"
#include "kernels/kernels.h"
#include "rope/rope.h"

/* Split-K chunks computed at once (a wave, decode.c): bounds the partial-state
 * scratch at (PKVI_MAX_CHUNKS + 1) * h * (dv + 2) floats per session, however long
 * the context - the number of chunks of a decode is not bounded (chunk c holds the
 * absolute pages [c * chunk_pages, (c + 1) * chunk_pages)). docs/performance.md,
 * decision table: PKVI_MAX_CHUNKS. */
#define PKVI_MAX_CHUNKS 64u

typedef struct {
    pkv_config cfg;              /* resolved: block_tokens, scale, n_threads, head_dim_v
                                    set; layer_cfg is `layers` (or NULL); spill_dir the
                                    engine's copy (or NULL) */
    uint32_t hg;                 /* query heads per group, h / g */
    uint64_t row_bytes;          /* one K row of one group: pkv_row_bytes(dtype, dk) */
    uint64_t row_bytes_v;        /* one V row of one group: pkv_row_bytes(dtype, dv) */
    uint64_t page_bytes;         /* g * bt * (row_bytes + row_bytes_v) */
    const pkv_layer_config *layers; /* [n_layers] per-layer variants (zeros: full causal) */
    bool variants;               /* some layer is not plain causal, or dv != dk */
    uint32_t sink_chunks_max;    /* most split-K chunks a layer's sink pages add */
    uint32_t chunk_pages;        /* split-K chunk, fixed (independent of threads) */
    pkvi_kparams kp;             /* kernel geometry */
    const pkvi_kernels *kern;    /* chosen once at creation */
    const pkvi_rope *const *rope;/* [n_layers] each layer's RoPE, NULL where the caller
                                    rotates (SPEC §14); NULL when no layer has one.
                                    Layers of one config share an object. */
} pkvi_geom;

/* Layer l's RoPE, or NULL when its keys are stored as given. */
static inline const pkvi_rope *pkvi_layer_rope(const pkvi_geom *geo, uint32_t l)
{
    return geo->rope ? geo->rope[l] : NULL;
}

/* Split-K chunks of pages [0, n_pages) of a layer: ceil(n_pages / chunk_pages). The
 * chunks are absolute (decode.c): chunk c holds pages [c * chunk_pages, (c + 1) *
 * chunk_pages), whatever the length - what lets shards merge bitwise
 * (docs/sharding.md). */
static inline uint64_t pkvi_split_chunks(const pkvi_geom *geo, uint64_t n_pages)
{
    return (n_pages + geo->chunk_pages - 1) / geo->chunk_pages;
}

/* Pages holding a windowed layer's sink positions (kept for ever); 0 without a window. */
static inline uint64_t pkvi_sink_pages(const pkvi_geom *geo, const pkv_layer_config *lc)
{
    return pkvi_window_sink_pages(lc, geo->cfg.block_tokens);
}

/* State blocks per group a decode of a layer of up to n_pages pages needs: the
 * running state and one wave of chunks (its runs' chunks, a windowed layer's sink
 * pages included, at most PKVI_MAX_CHUNKS). decode.c's runs, session.c's and
 * pkv_prefill's scratch. */
static inline uint64_t pkvi_max_chunks(const pkvi_geom *geo, uint64_t n_pages)
{
    const uint64_t c = pkvi_split_chunks(geo, n_pages) + geo->sink_chunks_max;
    return (c < PKVI_MAX_CHUNKS ? c : PKVI_MAX_CHUNKS) + 1;
}

/* Positions a shard's first position is a multiple of (pkv_shard_align): whole chunks
 * of whole pages, and at least every windowed layer's sink positions, so that every
 * sink lives on the shard that starts at 0. By the geometry alone. */
static inline uint64_t pkvi_shard_align(const pkvi_geom *geo)
{
    uint64_t sinks = 0;
    for (uint32_t l = 0; l < geo->cfg.n_layers; l++)
        if (geo->layers[l].window && geo->layers[l].sink_tokens > sinks)
            sinks = geo->layers[l].sink_tokens;
    const uint64_t chunk = (uint64_t)geo->chunk_pages * geo->cfg.block_tokens;
    const uint64_t n = (sinks + chunk - 1) / chunk;
    return chunk * (n ? n : 1);
}

#endif /* PAGEDKV_GEOM_H */

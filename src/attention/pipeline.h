/*
 * pipeline.h - the attention pipeline (pipeline.c) that pkv_decode, pkv_decode_batch,
 * pkv_prefill, the shard calls (decode.c) and pkv_verify (verify.c) all run: query
 * sets cut into split-K tasks over fixed page chunks, run on the executor's threads
 * and merged in a fixed order.
 *
 * Owns nothing at run time: a run works on the sets, segments, queries and states its
 * caller hands it (the scratch is the caller's: a session's, a call's or the
 * executor's batch scratch, attention/exec.h). No lock: the caller pinned every layer
 * a set reads (pkvi_session_acquire) for the length of the run.
 *
 * A query set is nq queries that attend the same runs of positions of one layer, all
 * starting at the same first position: a decode (one query), the sessions of a batch
 * that hold the same pages, a page-sized tile of a prefill, a tile of a verify's
 * drafts. Its pages are described by segments: pages [p0, p1) that queries [q0, q1)
 * all read, the same page (and the same rows of it) at each index. One kernel call per
 * chunk folds a segment into the states of all its queries' heads (nq * h/g heads
 * stacked as one larger group), so each of its pages is read once for all of them.
 * Per head the arithmetic is that of a decode of one query over the same pages in the
 * same chunks (the kernels are page-local and head-local, kernels.h): every set a
 * query can be in gives it the same bits.
 *
 * Invariants the caller keeps (pkvi_run_sets):
 *   - per query, its segments name the pages of its attended runs in page order, each
 *     page once, and come in the segs array in that order;
 *   - a segment's heads fit a kernel call: (q1 - q0) * h/g <= PKVI_MAX_GROUP_HEADS;
 *   - st holds (1 + wave) * g state blocks of H = nq * h/g heads.
 */
#ifndef PAGEDKV_PIPELINE_H
#define PAGEDKV_PIPELINE_H

#include "attention/exec.h"
#include "session/session.h"

/* Query sets per run (bounds the run's stack tables); a batch is cut into runs of
 * at most this many sessions. */
#define PKVI_BATCH_MAX 64u

/* Attended positions [p0, p1); the absolute chunks it meets are [c0, c0 + C). */
typedef struct {
    uint64_t p0, p1;
    uint64_t c0, C;
} pkvi_run;

/* Pages [p0, p1) of a layer that queries [q0, q1) of a set read alike. */
typedef struct {
    const void *const *pages;   /* pages[i] is page p0 + i (its bytes, resident) */
    uint64_t p0, p1;
    uint32_t q0, q1;
    uint32_t last;              /* rows of page p1 - 1 they read, 1..bt (bt: full) */
} pkvi_seg;

/* One query's pages, for pkvi_segments: page p is head[p] for p < split, then
 * tail[p - split]; it reads pages up to end - 1, `last` rows of that one. */
typedef struct {
    const void *const *head;
    uint64_t split;
    const void *const *tail;
    uint64_t end;
    uint32_t last;
} pkvi_qpages;

typedef struct {
    const pkv_layer_config *lc;  /* the layer's variant */
    uint32_t nq, H;              /* queries; heads per group, nq * h/g */
    pkvi_run runs[2];            /* in position order (a window's sinks, its window) */
    uint32_t n_runs;
    uint64_t C;                  /* chunks of all runs */
    bool sigma;                  /* starts from the layer's sink logits */
    const pkvi_seg *segs;        /* [n_segs], each query's in page order */
    uint32_t n_segs;
    const float *qg;             /* [g][H][dk] the queries, by group */
    float *st;                   /* [1 + wave][g] state blocks of H heads: the running
                                    states, then a wave's chunk states */
    float *out;                  /* query q writes out + slot(q) * h * dv, slot(q) =
                                    slot ? slot[q] : q; NULL: copy states to `part` */
    const uint32_t *slot;
    float *part;                 /* pkv_decode_partial: [C][h][dv + 2] */
} pkvi_qset;

/* The runs of a set on layer `layer` whose queries attend positions up to end - 1
 * from `first` on (a shard's first position; 0 for a whole session) and, on a
 * windowed layer, sit at position pos: fills Q's runs, n_runs, C and sigma. */
PKVI_HIDDEN void pkvi_set_runs(const pkvi_geom *geo, uint32_t layer, uint64_t first,
                               uint64_t end, uint64_t pos, pkvi_qset *Q);
/* The segments of nq queries whose pages start at page p0 (a shard's first page):
 * the tree of their common leading pages (a page is common to two queries when it is
 * the same page and they read the same rows of it), at most 4 * nq, into segs in
 * the order pkvi_run_sets needs. The queries' order decides only how many there are:
 * queries sorted by their pages give each shared page one segment. Returns the count. */
PKVI_HIDDEN uint32_t pkvi_segments(const pkvi_qpages *qp, uint32_t nq, uint64_t p0,
                                   uint32_t bt, pkvi_seg *segs);
/* Common leading pages of two queries from page p0 on: the first page index at
 * which they differ (or one of them ends). */
PKVI_HIDDEN uint64_t pkvi_qpages_common(const pkvi_qpages *a, const pkvi_qpages *b,
                                        uint64_t p0, uint32_t bt);
/* Run n <= PKVI_BATCH_MAX sets to their outputs, `wave` (1..PKVI_MAX_CHUNKS) chunks
 * of each set at a time. */
PKVI_HIDDEN void pkvi_run_sets(const pkvi_geom *geo, pkvi_exec *x, uint32_t n,
                               const pkvi_qset *sets, uint32_t wave);
/* The largest wave whose state blocks fit `floats` floats for sets of H heads:
 * (1 + wave) * g * H * (dv + 2) <= floats, clipped to 1..PKVI_MAX_CHUNKS. */
PKVI_HIDDEN uint32_t pkvi_wave_for(const pkvi_geom *geo, uint64_t H, uint64_t floats);

/* pkv_merge_partials and pkv_fold_partials of an engine of geometry geo (states and out
 * checked non-NULL, n_chunks > 0). */
PKVI_HIDDEN pkv_status pkvi_merge_partials(const pkvi_geom *geo, uint32_t n_chunks,
                                           const float *states, float *out);
PKVI_HIDDEN pkv_status pkvi_fold_partials(const pkvi_geom *geo, uint32_t n_chunks,
                                          const float *states, float *state_out);

/* The chunk of C that a set's t-th chunk task walks when R threads share them: a
 * permutation of [0, C) for t in [0, C), the identity for R = 1 (pipeline.c says why). */
PKVI_HIDDEN uint32_t pkvi_chunk_order(uint32_t t, uint32_t C, uint32_t R);

#endif /* PAGEDKV_PIPELINE_H */

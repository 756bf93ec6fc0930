/*
 * session.h - sessions, as the rest of the library sees them: struct pkv_session, the
 * contexts a session is made of, and the internal calls on it. The module is six
 * files, one concern each, layered so that each calls only those below it
 * (session/private.h is what they share):
 *
 *   session/discard.c   pkv_session_discard: drop positions, move the later rows down
 *   session/drafts.c    pending drafts of pkv_verify: their trees, pkv_session_commit
 *   session/reuse.c     set_tokens / from_prefix: sessions and the prefix cache
 *   session/write.c     the reservation every write goes through; append, load pages,
 *                       the rows of drafts and the moves of a commit
 *   session.c           lifecycle: create, fork, truncate, destroy, the session list,
 *                       the decode scratch, the token record, set_first (shards)
 *   session/residency.c the LRU order the spiller follows, making room under the
 *                       budget, fault in; pin a layer (acquire / release)
 *   session/account.c   pkv_session_memory / _pages and the engine invariants
 *
 * Owns struct pkv_session and the links of the engine's session list (the list head
 * is the cache state's, cache/cache.h). Block tables are btable.c's; attention is
 * decode.c's, which calls down into these files and never the reverse. A session
 * never sees its engine: it keeps pointers to the contexts it uses (pkvi_ctx), which
 * engine.c owns and which outlive every session.
 *
 * Locking: the cache state's lock (cache/cache.h) guards the list links, lru and
 * every table's structure; a session's owner thread reads its own tables, its
 * scratch and its token record without it.
 *
 * Every write into a layer is reserve-then-commit:
 *
 *   pkvi_session_reserve(n)  under the lock: pin the layer (spill engines), bring a
 *        |                   spilled tail back, take every page the n rows need and
 *        |                   the copy-on-write copy of a shared tail, grow the table
 *        |                   and the decode scratch. Fails -> nothing changed. (The
 *        |                   lock is let go only while spill I/O runs, the layer
 *        |                   pinned: session/residency.c.)
 *        v
 *   pkvi_session_write(rows) outside the lock: store rows, advance len. Cannot fail.
 *        v
 *   pkvi_session_finish()    clear the pages' writing marks, unpin.
 *
 * So a failed append or prefill changes nothing and never needs an undo: no page is
 * given up before everything the call needs is held (the rollback that once
 * re-shared a page, and with it another session's rows, is gone; docs/design.md).
 */
#ifndef PAGEDKV_SESSION_H
#define PAGEDKV_SESSION_H

#include "base/error.h"
#include "cache/btable.h"
#include "cache/cache.h"
#include "cache/geom.h"

struct pkvi_exec; /* attention/exec.h: the decode executor; sessions only carry it */

/* What an engine lends each of its sessions (engine.c fills one per engine): the
 * narrow contexts its calls use. Each pointer is valid for the engine's life. */
typedef struct {
    const pkvi_geom *geom;       /* immutable geometry, no lock */
    pkvi_cache *cache;           /* shared state, under cache->lock */
    struct pkvi_exec *exec;      /* the decode executor (decode.c's) */
    pkvi_errs *errs;             /* where failures are recorded (its own lock) */
} pkvi_ctx;

struct pkv_session {
    const pkvi_geom *geom;   /* the contexts of pkvi_ctx, copied at creation */
    pkvi_cache *cache;
    struct pkvi_exec *exec;
    pkvi_errs *errs;
    pkvi_btable **layers;    /* [n_layers], one table each */
    pkv_session *prev, *next;/* the cache state's session list; cache->lock */
    uint64_t lru;            /* cache clock at last use; cache->lock */
    /* Decode scratch for split-K partial states, grown by reservations so decode
     * never allocates: per (chunk, group), chunk-major: m[hg], l[hg], acc[hg][d]. */
    float *partials;
    uint64_t partials_chunks;/* chunks partials can hold, per group */
    /* the recorded token ids of positions [0, n_tokens) (docs/prefix-cache.md; owner
     * thread) */
    int32_t *tokens;
    uint64_t n_tokens, tokens_cap;
    uint64_t indexed_pages;  /* page indices of the record the last set_tokens walked */
    uint64_t record_max;     /* positions the record may reach: a discard's p0 (its
                                shifted K/V is no prefill of those ids), UINT64_MAX
                                otherwise; a truncate to it or below lifts it */
    /* the tree of each layer's pending drafts (session/drafts.c): [n_layers] parent
     * arrays of the layer's last pkv_verify, as many entries as its table's pending
     * rows; NULL (the array, or a layer's entry) while none is pending. Owner thread. */
    int32_t **drafts;
    /* Test hook (pkvi_session_hook_before_write; NULL otherwise): called by a write
     * after its pages are reserved and the lock is dropped, just before it stores the
     * rows - where a descheduled writer once let another session's rollback share its
     * page. */
    void (*hook_before_write)(void *ctx);
    void *hook_ctx;
};

/* What a reservation holds until pkvi_session_finish. */
typedef struct {
    uint32_t layer;
    uint64_t first_page;     /* entry of the first page the rows go to */
    uint64_t end_page;       /* one past the last */
    bool pinned;             /* spill engines: the layer is pinned */
} pkvi_reservation;

/* Whether any layer of s holds pending drafts (pkv_verify not yet committed). */
static inline bool pkvi_session_pending(const pkv_session *s)
{
    for (uint32_t l = 0; l < s->geom->cfg.n_layers; l++)
        if (pkvi_btable_pending(s->layers[l]))
            return true;
    return false;
}

/* ---- session.c ------------------------------------------------------------------------ */

/* pkv_session_create for the engine whose contexts ctx names (engine.c unpacks the
 * handle). PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_session_create(const pkvi_ctx *ctx, pkv_session **out);
/* Destroy every session left on the cache state's list (pkv_engine_destroy). */
PKVI_HIDDEN void pkvi_sessions_destroy_all(pkvi_cache *cache);
/* Whether s belongs to the engine whose cache state is `cache`. */
static inline bool pkvi_session_of(const pkv_session *s, const pkvi_cache *cache)
{
    return s->cache == cache;
}

/* ---- session/write.c ------------------------------------------------------------------ */

/* Reserve room for n more positions of `layer` (see above). PKV_ENOMEM (budget or
 * system), PKV_EIO (a spilled tail could not be read back), PKV_EINVAL (the length
 * would overflow); nothing changed. The reason is recorded under `call`, the public
 * call's name. */
PKVI_HIDDEN pkv_status pkvi_session_reserve(pkv_session *s, uint32_t layer, uint64_t n,
                                            pkvi_reservation *r, const char *call);
/* Store n rows (k, v [n][g][d]) at the layer's end; within the reservation. */
PKVI_HIDDEN void pkvi_session_write(pkv_session *s, const pkvi_reservation *r, uint64_t n,
                                    const float *k, const float *v);
/* Store whole pages of raw stored bytes (load: dtype already applied); `tokens`
 * positions in all, the layer's length a multiple of block_tokens before. */
PKVI_HIDDEN void pkvi_session_write_pages(pkv_session *s, const pkvi_reservation *r,
                                          const void *bytes, uint64_t tokens);
PKVI_HIDDEN void pkvi_session_finish(pkv_session *s, pkvi_reservation *r);
/* reserve + write_pages + finish of one page (load): `tokens` in 1..block_tokens,
 * the layer's length a multiple of block_tokens. PKV_EINVAL otherwise. */
PKVI_HIDDEN pkv_status pkvi_session_push_page(pkv_session *s, uint32_t layer,
                                              const void *bytes, uint32_t tokens);

/* Reserve room for n draft rows of `layer` at positions len .. len + n - 1 (pkv_verify;
 * the caller acquired the layer): as pkvi_session_reserve, over the layer's pending
 * drafts, which this replaces (their pages past the n rows are released once
 * everything is held). PKV_ENOMEM, PKV_EIO, PKV_EINVAL; nothing changed. */
PKVI_HIDDEN pkv_status pkvi_session_reserve_drafts(pkv_session *s, uint32_t layer,
                                                   uint64_t n, pkvi_reservation *r);
/* Store the n draft rows (k, v [n][g][d]) at slots len .. len + n - 1, len
 * unchanged: the layer's pending drafts. A rope layer turns draft j's key at position
 * len + depth[j] (the position it stands for), not at its slot. Within the reservation. */
PKVI_HIDDEN void pkvi_session_write_drafts(pkv_session *s, const pkvi_reservation *r,
                                           uint64_t n, const uint32_t *depth,
                                           const float *k, const float *v);
/* A commit of `layer` (acquired by the caller when n_keep > 0; n_keep == 0 moves no
 * row and drops the drafts' pages as a truncate does): pending drafts path[0..n_keep) become
 * positions len .. len + n_keep - 1 (rows moved where the tree put them elsewhere), the
 * rest are released. Cannot fail. */
PKVI_HIDDEN void pkvi_session_keep_drafts(pkv_session *s, uint32_t layer, uint32_t n_keep,
                                          const uint32_t *path);

/* ---- session/drafts.c ----------------------------------------------------------------- */

/* A copy of the tree parent[0..n) for pkvi_drafts_set (malloc'ed; NULL when out of
 * memory), made before a verify reserves anything. */
PKVI_HIDDEN int32_t *pkvi_drafts_copy(const pkv_session *s, uint32_t n,
                                      const int32_t *parent);
/* Whether s can record a tree for every layer (the per-layer array exists);
 * PKV_ENOMEM otherwise, nothing changed. */
PKVI_HIDDEN pkv_status pkvi_drafts_ready(pkv_session *s);
/* The verify of `layer` succeeded: tree (from pkvi_drafts_copy) is its pending tree,
 * replacing the one before. */
PKVI_HIDDEN void pkvi_drafts_set(pkv_session *s, uint32_t layer, int32_t *tree);

/* Load of a windowed layer: positions up to page * block_tokens were released when it
 * was saved; the table gets its hole [sink pages, page) (a shard's: [0, page)) so the
 * next page pushed is `page`. Only right after the sink pages were pushed (a shard:
 * right after pkv_session_set_first); PKV_EINVAL otherwise. */
PKVI_HIDDEN pkv_status pkvi_session_skip_pages(pkv_session *s, uint32_t layer,
                                               uint64_t page);
/* Test hook: fn(ctx) runs in every write of s between its reservation and its rows
 * (fn NULL: none). */
PKVI_HIDDEN void pkvi_session_hook_before_write(pkv_session *s, void (*fn)(void *ctx),
                                                void *ctx);

/* ---- session/reuse.c ------------------------------------------------------------------ */

/* Record ids [0, n) of s and index its full pages (pkv_session_set_tokens without
 * the argument checks; load calls it). PKV_ERANGE, PKV_EINVAL, PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_session_set_tokens(pkv_session *s, uint64_t n,
                                               const int32_t *tokens);
/* pkv_session_from_prefix for the engine whose contexts ctx names. */
PKVI_HIDDEN pkv_status pkvi_session_from_prefix(const pkvi_ctx *ctx, uint64_t n,
                                                const int32_t *tokens, pkv_session **out,
                                                uint64_t *n_cached);

/* ---- session/residency.c -------------------------------------------------------------- */

/* Pin `layer` and bring every page of it into memory (spill engines; else a no-op):
 * O(1) for a resident layer. PKV_EIO / PKV_ENOMEM leave the session unchanged; the
 * reason is recorded under the public call's name `call`. */
PKVI_HIDDEN pkv_status pkvi_session_acquire(pkv_session *s, uint32_t layer, const char *call);
/* The same, bringing back only the pages of entries `from` on: a call that touches no
 * row before them (pkv_session_commit: the pending rows and where they move) needs no
 * more of the layer in memory, so a layer longer than the budget holds still commits. */
PKVI_HIDDEN pkv_status pkvi_session_acquire_from(pkv_session *s, uint32_t layer,
                                                 uint64_t from, const char *call);
PKVI_HIDDEN void pkvi_session_release(pkv_session *s, uint32_t layer);

/* ---- session/account.c ---------------------------------------------------------------- */

/* Engine invariants E1-E4, T1 (cache/cache.h) and B1-B6 of every table, P1-P4 of the
 * index (takes the lock). quiescent: also B1 and no pins, which hold only while no
 * call is in flight. */
PKVI_HIDDEN bool pkvi_sessions_check(const pkvi_geom *geo, pkvi_cache *cache,
                                     bool quiescent);

/* Debug builds (-Dpoison=true): check the invariants at API boundaries and fail the
 * call loudly (stderr + PKV_ECORRUPT) when they are broken. PKV_OK otherwise, and
 * always in other builds. */
#if PKV_POISON
PKVI_HIDDEN pkv_status pkvi_boundary_check(const pkvi_geom *geo, pkvi_cache *cache,
                                           const char *where);
#else
static inline pkv_status pkvi_boundary_check(const pkvi_geom *geo, pkvi_cache *cache,
                                             const char *where)
{
    (void)geo;
    (void)cache;
    (void)where;
    return PKV_OK;
}
#endif

#endif /* PAGEDKV_SESSION_H */

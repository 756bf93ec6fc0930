/*
 * session.h - sessions, as the rest of the library sees them: struct pkv_session and
 * the internal calls on it. The module is five files, one concern each, layered so
 * that each calls only those below it (session/private.h is what they share):
 *
 *   session/reuse.c     set_tokens / from_prefix: sessions and the prefix cache
 *   session/write.c      the reservation every write goes through; append, load pages
 *   session.c            lifecycle: create, fork, truncate, destroy, the session list,
 *                        the decode scratch, the token record, set_first (shards)
 *   session/residency.c  the LRU order the spiller follows, making room under the
 *                        budget, fault in; pin a layer (acquire / release)
 *   session/account.c    pkv_session_memory / _pages and the engine invariants
 *
 * Owns struct pkv_session and the engine's session list. Block tables are btable.c's;
 * attention is decode.c's, which calls down into these files and never the reverse.
 *
 * Every write into a layer is reserve-then-commit:
 *
 *   pkvi_session_reserve(n)  under the lock: pin the layer (spill engines), bring a
 *        |                   spilled tail back, take every page the n rows need and
 *        |                   the copy-on-write copy of a shared tail, grow the table
 *        |                   and the decode scratch. Fails -> nothing changed.
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

#include "engine/engine.h"

struct pkv_session {
    pkv_engine *e;
    pkvi_btable *layers;     /* [n_layers] */
    pkv_session *prev, *next;/* engine's session list; e->lock */
    uint64_t lru;            /* engine clock at last use; e->lock */
    /* Decode scratch for split-K partial states, grown by reservations so decode
     * never allocates: per (chunk, group), chunk-major: m[hg], l[hg], acc[hg][d]. */
    float *partials;
    uint64_t partials_chunks;/* chunks partials can hold, per group */
    /* SPEC §10: the recorded token ids of positions [0, n_tokens) (owner thread) */
    int32_t *tokens;
    uint64_t n_tokens, tokens_cap;
    uint64_t indexed_pages;  /* page indices of the record the last set_tokens walked */
};

/* What a reservation holds until pkvi_session_finish. */
typedef struct {
    uint32_t layer;
    uint64_t first_page;     /* entry of the first page the rows go to */
    uint64_t end_page;       /* one past the last */
    bool pinned;             /* spill engines: the layer is pinned */
} pkvi_reservation;

/* ---- session/write.c ----------------------------------------------------------------- */

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

/* Load of a windowed layer: positions up to page * block_tokens were released when it
 * was saved; the table gets its hole [sink pages, page) (a shard's: [0, page)) so the
 * next page pushed is `page`. Only right after the sink pages were pushed (a shard:
 * right after pkv_session_set_first); PKV_EINVAL otherwise. */
PKVI_HIDDEN pkv_status pkvi_session_skip_pages(pkv_session *s, uint32_t layer,
                                               uint64_t page);

/* ---- session/reuse.c ---------------------------------------------------------------- */

/* Record ids [0, n) of s and index its full pages (pkv_session_set_tokens without
 * the argument checks; load calls it). PKV_ERANGE, PKV_EINVAL, PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_session_set_tokens(pkv_session *s, uint64_t n,
                                               const int32_t *tokens);

/* ---- session/residency.c ------------------------------------------------------------- */

/* Pin `layer` and bring every page of it into memory (spill engines; else a no-op):
 * O(1) for a resident layer. PKV_EIO / PKV_ENOMEM leave the session unchanged; the
 * reason is recorded under the public call's name `call`. */
PKVI_HIDDEN pkv_status pkvi_session_acquire(pkv_session *s, uint32_t layer, const char *call);
PKVI_HIDDEN void pkvi_session_release(pkv_session *s, uint32_t layer);

/* ---- session/account.c --------------------------------------------------------------- */

/* Engine invariants E1-E4 and B1-B5 of every table (takes the lock). quiescent: also
 * B1 and no pins, which hold only while no call is in flight. */
PKVI_HIDDEN bool pkvi_sessions_check(pkv_engine *e, bool quiescent);
/* The same, as tests call it: quiescent, and live (at API boundaries). */
PKVI_HIDDEN bool pkvi_engine_check(pkv_engine *e);
PKVI_HIDDEN bool pkvi_engine_check_live(pkv_engine *e);

/* Debug builds (-Dpoison=true): check the invariants at API boundaries and fail the
 * call loudly (stderr + PKV_ECORRUPT) when they are broken. Nothing otherwise. */
#if PKV_POISON
#define PKVI_BOUNDARY_CHECK(e)                                                          \
    do {                                                                                \
        if (!pkvi_sessions_check((e), false))                                           \
            return pkvi_report_broken(__func__);                                        \
    } while (0)
PKVI_HIDDEN pkv_status pkvi_report_broken(const char *where);
#else
#define PKVI_BOUNDARY_CHECK(e) ((void)0)
#endif

#endif /* PAGEDKV_SESSION_H */

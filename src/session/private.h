/*
 * session/private.h - what the session files share among themselves and with no one
 * else: the session object's own allocation and list link (session.c), the decode
 * scratch it carries (session.c), and the page supply under the budget that
 * reservations draw on (session/residency.c).
 *
 * Owns nothing at run time; it only declares. The layering it allows, and the only
 * one (each file calls only those below it; nothing calls up):
 *
 *   session/discard.c   pkv_session_discard            -> session.c, session/residency.c
 *   session/reuse.c     set_tokens, from_prefix        -> session.c
 *   session/write.c     reservations, append, load     -> session.c, session/residency.c
 *   session.c           lifecycle, the session object  -> (session/account.c: checks)
 *   session/residency.c LRU victims, make room, fault in, pin
 *   session/account.c   pkv_session_memory / _pages, invariants E1-E4
 */
#ifndef PAGEDKV_SESSION_PRIVATE_H
#define PAGEDKV_SESSION_PRIVATE_H

#include "session/session.h"

/* ---- session.c: the object ---------------------------------------------------------- */

/* A session of the engine ctx names, with empty tables, not yet on the session list;
 * NULL when out of memory. No lock needed: nothing else sees it yet. */
PKVI_HIDDEN pkv_session *pkvi_session_alloc(const pkvi_ctx *ctx);
/* Free s, off the list, whose tables hold no page any more (or never did). No lock. */
PKVI_HIDDEN void pkvi_session_free(pkv_session *s);
/* Put s at the head of its cache state's session list, most recently used. Under the
 * lock. */
PKVI_HIDDEN void pkvi_session_link(pkv_session *s);
/* A discard ends the token record at p0 and keeps it there (record_max) until a
 * truncate to p0 or below. Owner thread. */
PKVI_HIDDEN void pkvi_session_seal_record(pkv_session *s, uint64_t p0);
/* Grow s's split-K scratch for layers of up to n_pages pages (decode.c's layout);
 * touches s alone, so with or without the lock (fork calls it without, a reservation
 * with). PKV_ENOMEM leaves the old scratch in place. */
PKVI_HIDDEN pkv_status pkvi_session_reserve_partials(pkv_session *s, uint64_t n_pages);

/* ---- session/residency.c: pages under the budget ------------------------------------ */

/* Bring the spilled pages of table t (layer) from entry `from` on back into memory,
 * waiting for those other calls have in transit; the caller pinned t, so making room
 * never spills them again. PKV_ENOMEM, PKV_EIO (the pages of the failed read stay
 * spilled). Under the lock, which it lets go while it reads, spills or waits. */
PKVI_HIDDEN pkv_status pkvi_session_fault_in(const pkvi_geom *geo, pkvi_cache *cache,
                                             pkvi_btable *t, uint32_t layer,
                                             uint64_t from);
/* n new pages (refs 0: a push takes them) into out[0, n), all or nothing, spilling
 * to make room; their bytes are zeros on a spill engine. PKV_ENOMEM, PKV_EIO. Under
 * the lock, which making room lets go while it writes or waits; held from the room's
 * check to the return. */
PKVI_HIDDEN pkv_status pkvi_session_take_pages(const pkvi_geom *geo, pkvi_cache *cache,
                                               uint64_t n, pkvi_page **out);

#endif /* PAGEDKV_SESSION_PRIVATE_H */

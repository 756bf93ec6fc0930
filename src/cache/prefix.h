/*
 * prefix.h - the prefix cache's index (prefix.c, docs/prefix-cache.md): which full pages hold the
 * K/V of which token prefix, so that a new session can share them as a fork does.
 *
 * A layer over the block tables, not a second one: a node is one page index of one
 * token prefix, for all layers together, and holds one reference of its own on each
 * of its pages (pkvi_page_index, btable.c: the only code that changes refs). So
 * copy-on-write and B5 stay what they are, and a destroyed session's pages live on as
 * cached pages (only the index holds them) until the index drops them.
 *
 *   root --(tokens 0..bt-1)--> node d=0 --(tokens bt..2bt-1)--> node d=1 --> ...
 *            pages[L]                       pages[L]
 *
 * A node is keyed by (parent, its bt token ids): the whole prefix of its page index,
 * because its parent is keyed the same way. The hash of that key only finds
 * candidates in a bucket; a match compares the parent pointer and the bt stored ids.
 * pages[l] is NULL where layer l's window had released the page when it was indexed
 * (or the page was dropped since): the node is then usable only by a match that does
 * not need that page (session/reuse.c decides which pages a match of m pages needs).
 *
 * Owns the nodes, the hash table, the LRU list (oldest first) and the counts of cached
 * pages (kept exact by btable.c, which counts every reference). Every function runs
 * under the engine lock (cache/cache.h). Does not own the pages' bytes, their
 * reference counts (btable.c) or the block tables (session/reuse.c shares a match
 * into a new session).
 *
 * Invariants (pkvi_prefix_check; session/account.c adds E3 over tables and index
 * together):
 *   P1  a node at depth d > 0 has a parent at depth d - 1; `children` is exact
 *   P2  every node is in bucket hash % n_buckets, its hash is the key's, and the LRU
 *       list holds every node once; n_nodes is exact
 *   P3  a non-NULL pages[l] has indexed == 1 and is named by no other node
 *   P4  cached.pages / .resident == node pages with refs == 1 (in memory), and between
 *       calls cached.pages <= limit_pages
 */
#ifndef PAGEDKV_PREFIX_H
#define PAGEDKV_PREFIX_H

#include "cache/btable.h"

typedef struct pkvi_pnode {
    struct pkvi_pnode *parent;   /* page index depth - 1; NULL at depth 0 */
    struct pkvi_pnode *hnext;    /* bucket chain */
    struct pkvi_pnode *older, *newer; /* LRU list */
    uint64_t hash;
    uint64_t depth;              /* the page index it stands for */
    uint64_t children;
    pkvi_page **pages;           /* [n_layers], one reference each (or NULL) */
    int32_t *tokens;             /* [bt]: ids of positions depth*bt .. depth*bt+bt-1 */
} pkvi_pnode;

typedef struct {
    uint32_t n_layers, bt;
    pkvi_pnode **buckets;        /* [n_buckets] */
    uint64_t n_buckets, n_nodes;
    pkvi_pnode *oldest, *newest; /* LRU list */
    pkvi_cached cached;          /* pages only the index holds (btable.c keeps it) */
    uint64_t limit_pages;        /* prefix_cache_bytes / page_bytes */
    uint64_t lookups, hit_tokens;/* pkv_stats */
    bool collide;                /* test hook: every hash is 0 (pkvi_prefix_set_collide) */
} pkvi_prefix;

PKVI_HIDDEN void pkvi_prefix_init(pkvi_prefix *p, uint32_t n_layers, uint32_t bt,
                                  uint64_t limit_pages);
/* Drop every node (and its references). */
PKVI_HIDDEN void pkvi_prefix_fini(pkvi_prefix *p, pkvi_pages ps);

/* The child of parent (NULL: the root) keyed by tokens[0..bt), or NULL. */
PKVI_HIDDEN pkvi_pnode *pkvi_prefix_find(const pkvi_prefix *p, const pkvi_pnode *parent,
                                         const int32_t *tokens);
/* Room for n more nodes: that many allocated into *out (a list through hnext) and
 * the hash table grown; PKV_ENOMEM and nothing changed otherwise. */
PKVI_HIDDEN pkv_status pkvi_prefix_alloc(pkvi_prefix *p, uint64_t n, pkvi_pnode **out);
/* Free nodes of pkvi_prefix_alloc that were not inserted. */
PKVI_HIDDEN void pkvi_prefix_free_spare(pkvi_pnode *list);
/* Insert node (from pkvi_prefix_alloc) as the child of parent keyed by tokens; pages
 * [n_layers] (NULL entries allowed; pages NULL: none) gain the index's reference.
 * Newest in the LRU. */
PKVI_HIDDEN void pkvi_prefix_insert(pkvi_prefix *p, pkvi_pnode *node, pkvi_pnode *parent,
                                    const int32_t *tokens, pkvi_page *const *pages);
/* Layer l of node gains pg (its entry was NULL). */
PKVI_HIDDEN void pkvi_prefix_fill(pkvi_pnode *node, uint32_t l, pkvi_page *pg);
/* Mark chain[0..n) used now; ancestors end up newer than descendants, so the
 * least recently used end holds the deep pages first. */
PKVI_HIDDEN void pkvi_prefix_touch(pkvi_prefix *p, pkvi_pnode *const *chain, uint64_t n);

/* Drop cached pages (least recently used nodes first) until at most limit_pages
 * remain; a node left with no page and no child goes too. */
PKVI_HIDDEN void pkvi_prefix_trim(pkvi_prefix *p, pkvi_pages ps);
/* Budget pressure without a spill file: drop resident cached pages, least recently
 * used first, until `need` are freed or none is left. Returns how many were freed. */
PKVI_HIDDEN uint64_t pkvi_prefix_drop(pkvi_prefix *p, pkvi_pages ps, uint64_t need);

/* P1-P4; each node page's tally is incremented (session/account.c's E3 pass). */
PKVI_HIDDEN bool pkvi_prefix_check(pkvi_prefix *p, bool quiescent, uint64_t *node_pages);
/* The index's part of the E3 census (btable.h): reset its pages' tallies; visit each
 * of its pages once. */
PKVI_HIDDEN void pkvi_prefix_tally_reset(pkvi_prefix *p);
PKVI_HIDDEN void pkvi_prefix_census(pkvi_prefix *p, pkvi_census *c);

/* Test hook (set before the first node is inserted): every hash 0, one bucket. */
PKVI_HIDDEN void pkvi_prefix_set_collide(pkvi_prefix *p, bool collide);

#endif /* PAGEDKV_PREFIX_H */

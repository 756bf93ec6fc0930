/*
 * prefix.c - the prefix cache's index (prefix.h): nodes keyed by (parent, the bt
 * token ids of one page index), a chained hash table to find them, an LRU list to
 * drop them, and the references the index holds (through btable.c).
 *
 * A lookup never trusts a hash: a candidate matches only when its parent is the
 * node already matched and its bt ids equal the wanted ones (pkvi_prefix_find), so a
 * match of depth d has compared all (d + 1) * bt ids of the prefix. The test hook
 * pkvi_prefix_set_collide makes every hash 0, which puts every node into one bucket.
 *
 * The index's references are btable.c's to count (pkvi_page_index / _unindex): this
 * file asks it whether a page is cached, never reads refs itself.
 */
#include "cache/prefix.h"

#include <stdlib.h>
#include <string.h>

void pkvi_prefix_init(pkvi_prefix *p, uint32_t n_layers, uint32_t bt, uint64_t limit_pages)
{
    memset(p, 0, sizeof *p);
    p->n_layers = n_layers;
    p->bt = bt;
    p->limit_pages = limit_pages;
}

static uint64_t key_hash(const pkvi_prefix *p, const pkvi_pnode *parent,
                         const int32_t *tokens)
{
    if (p->collide)
        return 0;
    uint64_t h = parent ? parent->hash : 0x9e3779b97f4a7c15ull;
    for (uint32_t i = 0; i < p->bt; i++) {
        h ^= (uint32_t)tokens[i];
        h *= 0x100000001b3ull;
        h ^= h >> 29;
    }
    return h ^ (h >> 32);
}

pkvi_pnode *pkvi_prefix_find(const pkvi_prefix *p, const pkvi_pnode *parent,
                             const int32_t *tokens)
{
    if (!p->n_buckets)
        return NULL;
    const uint64_t h = key_hash(p, parent, tokens);
    for (pkvi_pnode *n = p->buckets[h % p->n_buckets]; n; n = n->hnext)
        if (n->hash == h && n->parent == parent &&
            memcmp(n->tokens, tokens, (size_t)p->bt * sizeof *tokens) == 0)
            return n;
    return NULL;
}

/* ---- allocation -------------------------------------------------------------------- */

static pkvi_pnode *node_new(const pkvi_prefix *p)
{
    /* one block: the node, its page pointers, its ids */
    const size_t bytes = sizeof(pkvi_pnode) + (size_t)p->n_layers * sizeof(pkvi_page *) +
                         (size_t)p->bt * sizeof(int32_t);
    pkvi_pnode *n = calloc(1, bytes);
    if (!n)
        return NULL;
    n->pages = (pkvi_page **)(n + 1);
    n->tokens = (int32_t *)(n->pages + p->n_layers);
    return n;
}

void pkvi_prefix_free_spare(pkvi_pnode *list)
{
    while (list) {
        pkvi_pnode *next = list->hnext;
        free(list);
        list = next;
    }
}

/* Rehash into n buckets (a power of two). */
static bool rehash(pkvi_prefix *p, uint64_t n)
{
    pkvi_pnode **b = calloc((size_t)n, sizeof *b);
    if (!b)
        return false;
    for (uint64_t i = 0; i < p->n_buckets; i++)
        for (pkvi_pnode *x = p->buckets[i], *next; x; x = next) {
            next = x->hnext;
            x->hnext = b[x->hash % n];
            b[x->hash % n] = x;
        }
    free(p->buckets);
    p->buckets = b;
    p->n_buckets = n;
    return true;
}

pkv_status pkvi_prefix_alloc(pkvi_prefix *p, uint64_t n, pkvi_pnode **out)
{
    *out = NULL;
    if (n == 0)
        return PKV_OK;
    if (n > (UINT64_MAX >> 2) - p->n_nodes)
        return PKV_ENOMEM;
    const uint64_t want = p->n_nodes + n;
    if (want > p->n_buckets) {   /* load factor <= 1 */
        uint64_t nb = p->n_buckets ? p->n_buckets : 64;
        while (nb < want)
            nb *= 2;
        if (nb > SIZE_MAX / sizeof(pkvi_pnode *) || !rehash(p, nb))
            return PKV_ENOMEM;
    }
    pkvi_pnode *list = NULL;
    for (uint64_t i = 0; i < n; i++) {
        pkvi_pnode *x = node_new(p);
        if (!x) {
            pkvi_prefix_free_spare(list);
            return PKV_ENOMEM;
        }
        x->hnext = list;
        list = x;
    }
    *out = list;
    return PKV_OK;
}

/* ---- the LRU list ------------------------------------------------------------------ */

static void lru_unlink(pkvi_prefix *p, pkvi_pnode *n)
{
    if (n->older)
        n->older->newer = n->newer;
    else
        p->oldest = n->newer;
    if (n->newer)
        n->newer->older = n->older;
    else
        p->newest = n->older;
    n->older = n->newer = NULL;
}

static void lru_push_newest(pkvi_prefix *p, pkvi_pnode *n)
{
    n->older = p->newest;
    n->newer = NULL;
    if (p->newest)
        p->newest->newer = n;
    else
        p->oldest = n;
    p->newest = n;
}

void pkvi_prefix_touch(pkvi_prefix *p, pkvi_pnode *const *chain, uint64_t n)
{
    for (uint64_t i = n; i-- > 0;) {   /* deepest first: ancestors come out newer */
        lru_unlink(p, chain[i]);
        lru_push_newest(p, chain[i]);
    }
}

/* ---- insert, fill, remove ------------------------------------------------------------ */

void pkvi_prefix_insert(pkvi_prefix *p, pkvi_pnode *node, pkvi_pnode *parent,
                        const int32_t *tokens, pkvi_page *const *pages)
{
    node->parent = parent;
    node->depth = parent ? parent->depth + 1 : 0;
    node->children = 0;
    if (parent)
        parent->children++;
    memcpy(node->tokens, tokens, (size_t)p->bt * sizeof *tokens);
    for (uint32_t l = 0; l < p->n_layers; l++) {
        node->pages[l] = pages ? pages[l] : NULL;
        if (node->pages[l])
            pkvi_page_index(node->pages[l]);
    }
    node->hash = key_hash(p, parent, tokens);
    node->hnext = p->buckets[node->hash % p->n_buckets];
    p->buckets[node->hash % p->n_buckets] = node;
    p->n_nodes++;
    lru_push_newest(p, node);
}

void pkvi_prefix_fill(pkvi_pnode *node, uint32_t l, pkvi_page *pg)
{
    node->pages[l] = pg;
    pkvi_page_index(pg);
}

/* Unlink and free a node with no child; its pages must have been dropped. */
static void node_remove(pkvi_prefix *p, pkvi_pnode *n)
{
    pkvi_pnode **at = &p->buckets[n->hash % p->n_buckets];
    while (*at != n)
        at = &(*at)->hnext;
    *at = n->hnext;
    lru_unlink(p, n);
    if (n->parent)
        n->parent->children--;
    p->n_nodes--;
    free(n);
}

static bool node_empty(const pkvi_prefix *p, const pkvi_pnode *n)
{
    for (uint32_t l = 0; l < p->n_layers; l++)
        if (n->pages[l])
            return false;
    return true;
}

/* Remove n and then its ancestors while they are empty leaves. Returns the node
 * the caller's LRU walk may continue from (next_newer, unless that was removed). */
static void prune(pkvi_prefix *p, pkvi_pnode *n, pkvi_pnode **walk_next)
{
    while (n && n->children == 0 && node_empty(p, n)) {
        pkvi_pnode *up = n->parent;
        if (*walk_next == n)
            *walk_next = n->newer;
        node_remove(p, n);
        n = up;
    }
}

void pkvi_prefix_fini(pkvi_prefix *p, pkvi_pages ps)
{
    for (pkvi_pnode *n = p->oldest, *next; n; n = next) {
        next = n->newer;
        for (uint32_t l = 0; l < p->n_layers; l++)
            if (n->pages[l])
                pkvi_page_unindex(ps, n->pages[l]);
        free(n);
    }
    free(p->buckets);
    const uint64_t limit = p->limit_pages;
    const bool collide = p->collide;
    pkvi_prefix_init(p, p->n_layers, p->bt, limit);
    p->collide = collide;
}

/* Drop the cached pages of nodes, oldest first, while `more` says so. resident_only:
 * only pages in memory (budget pressure). Returns the resident pages freed. */
static uint64_t drop_oldest(pkvi_prefix *p, pkvi_pages ps, bool resident_only,
                            uint64_t need)
{
    uint64_t freed = 0;
    for (pkvi_pnode *n = p->oldest, *next; n; n = next) {
        next = n->newer;
        const bool done = resident_only ? freed >= need : p->cached.pages <= p->limit_pages;
        if (done)
            break;
        for (uint32_t l = 0; l < p->n_layers; l++) {
            pkvi_page *pg = n->pages[l];
            if (!pg || !pkvi_page_cached(pg) || (resident_only && !pg->data))
                continue;
            freed += pg->data != NULL;
            n->pages[l] = NULL;
            pkvi_page_unindex(ps, pg);
        }
        prune(p, n, &next);
    }
    return freed;
}

void pkvi_prefix_trim(pkvi_prefix *p, pkvi_pages ps)
{
    if (p->cached.pages > p->limit_pages)
        (void)drop_oldest(p, ps, false, 0);
}

uint64_t pkvi_prefix_drop(pkvi_prefix *p, pkvi_pages ps, uint64_t need)
{
    return p->cached.resident ? drop_oldest(p, ps, true, need) : 0;
}

/* ---- invariants ---------------------------------------------------------------------- */

bool pkvi_prefix_check(pkvi_prefix *p, bool quiescent, uint64_t *node_pages)
{
    uint64_t listed = 0, pages = 0, cached = 0, resident = 0;
    for (const pkvi_pnode *n = p->oldest; n; n = n->newer) {
        if (++listed > p->n_nodes || (n->newer ? n->newer->older != n : p->newest != n))
            return false;
        if (n->parent ? n->depth != n->parent->depth + 1 || n->parent->children == 0
                      : n->depth != 0)
            return false;
        if (n->hash != key_hash(p, n->parent, n->tokens) || !p->n_buckets)
            return false;
        const pkvi_pnode *b = p->buckets[n->hash % p->n_buckets];
        while (b && b != n)
            b = b->hnext;
        if (!b || pkvi_prefix_find(p, n->parent, n->tokens) != n)
            return false;
        for (uint32_t l = 0; l < p->n_layers; l++) {
            pkvi_page *pg = n->pages[l];
            if (!pg)
                continue;
            if (!pkvi_page_indexed(pg)) /* its refs: the census (session/account.c) */
                return false;
            pg->tally++;
            pages++;
            cached += pkvi_page_cached(pg);
            resident += pkvi_page_cached(pg) && pg->data != NULL;
        }
    }
    if (listed != p->n_nodes)
        return false;
    /* children counts: their sum is the number of nodes with a parent */
    uint64_t child_sum = 0, with_parent = 0;
    for (const pkvi_pnode *n = p->oldest; n; n = n->newer) {
        child_sum += n->children;
        with_parent += n->parent != NULL;
    }
    if (child_sum != with_parent)
        return false;
    if (cached != p->cached.pages || resident != p->cached.resident)
        return false;
    if (quiescent && p->cached.pages > p->limit_pages)
        return false;
    *node_pages = pages;
    return true;
}

void pkvi_prefix_tally_reset(pkvi_prefix *p)
{
    for (const pkvi_pnode *n = p->oldest; n; n = n->newer)
        for (uint32_t l = 0; l < p->n_layers; l++)
            if (n->pages[l])
                n->pages[l]->tally = 0;
}

void pkvi_prefix_census(pkvi_prefix *p, pkvi_census *c)
{
    for (const pkvi_pnode *n = p->oldest; n; n = n->newer)
        for (uint32_t l = 0; l < p->n_layers; l++)
            if (n->pages[l])
                pkvi_page_census(n->pages[l], c);
}

void pkvi_prefix_set_collide(pkvi_prefix *p, bool collide)
{
    p->collide = collide;
}

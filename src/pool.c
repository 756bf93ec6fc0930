/*
 * pool.c - the page pool: fixed-size, aligned page buffers from a private jemalloc
 * arena (or aligned_alloc when built with -Djemalloc=disabled), a small cache of free
 * buffers for reuse, and the memory budget. Arenas of destroyed engines are purged
 * and reused by later engines (see "idle arenas" below).
 *
 * Owns page *buffers* and their counts. It does not own page descriptors, reference
 * counts or spilling (session.c, spill.c). Every function runs under e->lock, but
 * init and fini (no other thread knows the engine yet, or any more) and
 * pkvi_pool_allocator_bytes, which reads only fields fixed from init to fini
 * (use_jemalloc, arena, page_bytes) so that stats need not hold e->lock while
 * jemalloc refreshes its statistics. The idle arenas have their own lock,
 * idle_lock, taken only by init and fini.
 *
 * Invariants:
 *   allocated == in_use + n_free          (every buffer is held or cached)
 *   budget_pages == 0 || in_use + n_free <= budget_pages
 *   n_free <= free_slots <= free_cap   (16 MiB worth, or the whole budget when one is
 *                                       set; the slot array grows as buffers come back)
 * The budget caps buffers held *and* cached, so the process's page memory never
 * exceeds mem_budget whatever the reuse pattern.
 */
#include "pool.h"
#include "pkv_config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if PKV_HAVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#include <pthread.h>
#endif

/* Free buffers kept for reuse: at most this many bytes (or 4 pages), so a session
 * destroyed gives its memory back to the allocator instead of pinning it here.
 * 16 MiB is 256 llama3-8b f16 pages (64 KiB at bt=16): enough to absorb the churn of
 * forks and truncates without a trip to the allocator. */
#define FREE_CACHE_BYTES (16ull << 20)
/* ...and at most this many buffers, whatever their size: the cache's own array must
 * stay small for engines with tiny pages (a 1x1x1 f16 geometry has 4-byte pages). */
#define FREE_CACHE_PAGES 1024u

/* Pages of 4 KiB or more are aligned to the OS page, smaller ones to a cache line.
 * Measured (jemalloc 5.3, 512 MiB of 64 KiB pages): with 64-byte alignment RSS grew
 * 545.6 MiB, with 4096-byte alignment 514.1 MiB - a cache-line-aligned large
 * allocation may start inside an OS page and touch one more page than it needs. */
static size_t buf_align(const pkvi_pool *p)
{
    return p->page_bytes >= 4096 ? 4096 : PKVI_PAGE_ALIGN;
}

static void *buf_alloc(pkvi_pool *p)
{
    const size_t align = buf_align(p);
#if PKV_HAVE_JEMALLOC
    if (p->use_jemalloc)
        return mallocx((size_t)p->page_bytes, MALLOCX_ALIGN(align) |
                                              MALLOCX_ARENA(p->arena) |
                                              MALLOCX_TCACHE_NONE);
#endif
    /* aligned_alloc wants a size that is a multiple of the alignment */
    uint64_t sz = (p->page_bytes + align - 1) & ~(uint64_t)(align - 1);
    return aligned_alloc(align, (size_t)sz);
}

static void buf_free(pkvi_pool *p, void *buf)
{
#if PKV_HAVE_JEMALLOC
    if (p->use_jemalloc) {
        dallocx(buf, MALLOCX_TCACHE_NONE);
        return;
    }
#endif
    (void)p;
    free(buf);
}

#if PKV_HAVE_JEMALLOC
/*
 * Arenas of destroyed engines, idle, for the next engines to take (the one piece of
 * process-wide state, documented in pagedkv.h at pkv_engine_destroy).
 *
 * Why not arena.<i>.destroy: jemalloc 5.3 reuses a destroyed arena's index, but not
 * its address space. The arena's base mappings are only purged (with retain, the
 * default on Linux), so every new arena maps fresh memory, and the global radix tree
 * that maps addresses to extents grows leaves for it that are never freed. Measured
 * (10,000 cycles of arenas.create, 8 x 64 KiB mallocx, dallocx, arena.<i>.destroy):
 * RSS +40 MiB, stats.metadata 2.8 -> 42.5 MB, VmSize +20 GB. Purging an arena and
 * handing it to the next engine instead: RSS +180 KiB over the same 10,000 cycles.
 *
 * An idle arena holds no allocation and no dirty page (purged), only jemalloc's
 * metadata for it: there are at most as many arenas as engines were ever alive at
 * once (past IDLE_ARENAS_MAX idle ones, an arena is destroyed after all).
 */
#define IDLE_ARENAS_MAX 256u
static pthread_mutex_t idle_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned idle_arenas[IDLE_ARENAS_MAX]; /* [n_idle], guarded by idle_lock */
static unsigned n_idle;                       /* idle_lock */

static bool arena_take(unsigned *out)
{
    bool got = false;
    pthread_mutex_lock(&idle_lock);
    if (n_idle > 0) {
        *out = idle_arenas[--n_idle];
        got = true;
    }
    pthread_mutex_unlock(&idle_lock);
    if (got)
        return true;
    size_t sz = sizeof *out;
    return mallctl("arenas.create", out, &sz, NULL, 0) == 0;
}

/* Give back an arena that holds no allocation. */
static void arena_give(unsigned arena)
{
    char name[64];
    snprintf(name, sizeof name, "arena.%u.purge", arena); /* its pages go to the OS */
    mallctl(name, NULL, NULL, NULL, 0);
    bool kept = false;
    pthread_mutex_lock(&idle_lock);
    if (n_idle < IDLE_ARENAS_MAX) {
        idle_arenas[n_idle++] = arena;
        kept = true;
    }
    pthread_mutex_unlock(&idle_lock);
    if (!kept) {
        snprintf(name, sizeof name, "arena.%u.destroy", arena);
        mallctl(name, NULL, NULL, NULL, 0);
    }
}
#endif

pkv_status pkvi_pool_init(pkvi_pool *p, uint64_t page_bytes, uint64_t budget_bytes)
{
    memset(p, 0, sizeof *p);
    p->page_bytes = page_bytes;
    p->budget_pages = budget_bytes / page_bytes; /* callers checked budget >= 1 page */
    p->free_cap = FREE_CACHE_BYTES / page_bytes;
    if (p->free_cap > FREE_CACHE_PAGES) /* tiny pages: 16 MiB / 4 B would be 4M slots */
        p->free_cap = FREE_CACHE_PAGES;
    if (p->free_cap < 4)
        p->free_cap = 4;
    if (p->budget_pages) {
        /* A budgeted pool may hold its whole budget anyway, so it keeps every freed
         * buffer up to it: spill and restore then reuse buffers instead of faulting
         * in fresh memory for each page read back (first touch ran at ~0.25 GB/s on
         * the dev VM and made restore 30x slower than the disk). The slot array is
         * kept under 1/512 of the budget for tiny pages. It is allocated as buffers
         * come back, never up front: a budget is a ceiling, and a huge one (even
         * UINT64_MAX) must not reserve memory for slots it may never fill. */
        p->free_cap = p->budget_pages;
        if (p->free_cap > budget_bytes / 512 && budget_bytes / 512 >= 4)
            p->free_cap = budget_bytes / 512;
    }
#if PKV_HAVE_JEMALLOC
    unsigned arena = 0;
    if (!arena_take(&arena))
        return PKV_ENOMEM;
    p->use_jemalloc = true;
    p->arena = arena;
#endif
    return PKV_OK;
}

void pkvi_pool_fini(pkvi_pool *p)
{
    for (uint64_t i = 0; i < p->n_free; i++)
        buf_free(p, p->free_list[i]);
    p->allocated -= p->n_free;
    p->n_free = 0;
    free(p->free_list);
    p->free_list = NULL;
    p->free_slots = 0;
#if PKV_HAVE_JEMALLOC
    /* Only an arena that holds nothing may serve another engine (its stats must
     * start from zero there); one that still holds buffers is left as it is. */
    if (p->use_jemalloc && p->allocated == 0)
        arena_give(p->arena);
    p->use_jemalloc = false;
#endif
}

bool pkvi_pool_can_get(const pkvi_pool *p)
{
    return p->budget_pages == 0 || p->n_free > 0 || p->in_use + 1 <= p->budget_pages;
}

pkv_status pkvi_pool_get(pkvi_pool *p, void **out)
{
    void *buf;
    if (p->n_free > 0) {
        buf = p->free_list[--p->n_free];
    } else {
        if (p->budget_pages && p->in_use + 1 > p->budget_pages)
            return PKV_ENOMEM;
        buf = buf_alloc(p);
        if (!buf)
            return PKV_ENOMEM;
        p->allocated++;
    }
#if PKV_POISON
    memset(buf, 0xff, (size_t)p->page_bytes); /* all-ones is NaN in f32, f16 and bf16 */
#endif
    p->in_use++;
    *out = buf;
    return PKV_OK;
}

/* Room for one more cached buffer: doubles the slot array up to free_cap. False if
 * the cache is full or the array cannot grow (the buffer then goes back instead). */
static bool free_slot(pkvi_pool *p)
{
    if (p->n_free < p->free_slots)
        return true;
    if (p->free_slots >= p->free_cap)
        return false;
    uint64_t n = p->free_slots ? p->free_slots * 2 : 16;
    if (n > p->free_cap)
        n = p->free_cap;
    if (n > SIZE_MAX / sizeof(void *))
        return false;
    void **list = realloc(p->free_list, (size_t)n * sizeof *list);
    if (!list)
        return false;
    p->free_list = list;
    p->free_slots = n;
    return true;
}

void pkvi_pool_put(pkvi_pool *p, void *buf)
{
    p->in_use--;
#if PKV_POISON
    memset(buf, 0xff, (size_t)p->page_bytes);
#endif
    if (free_slot(p)) {
        p->free_list[p->n_free++] = buf;
        return;
    }
    buf_free(p, buf);
    p->allocated--;
}

uint64_t pkvi_pool_allocator_bytes(const pkvi_pool *p, uint64_t allocated)
{
#if PKV_HAVE_JEMALLOC
    if (p->use_jemalloc) {
        /* jemalloc's stats are snapshots refreshed by writing "epoch". */
        uint64_t epoch = 1;
        size_t sz = sizeof epoch;
        mallctl("epoch", &epoch, &sz, &epoch, sz);
        char name[96];
        size_t small = 0, large = 0;
        sz = sizeof small;
        snprintf(name, sizeof name, "stats.arenas.%u.small.allocated", p->arena);
        if (mallctl(name, &small, &sz, NULL, 0) != 0)
            small = 0;
        sz = sizeof large;
        snprintf(name, sizeof name, "stats.arenas.%u.large.allocated", p->arena);
        if (mallctl(name, &large, &sz, NULL, 0) != 0)
            large = 0;
        return (uint64_t)small + (uint64_t)large;
    }
#endif
    return allocated * p->page_bytes;
}

pkv_status pkvi_page_create(pkvi_pool *p, pkvi_page **out)
{
    pkvi_page *pg = calloc(1, sizeof *pg);
    if (!pg)
        return PKV_ENOMEM;
    const pkv_status st = pkvi_pool_get(p, &pg->data);
    if (st != PKV_OK) {
        free(pg);
        return st;
    }
    pg->refs = 1;
    atomic_init(&pg->writing, 0);
    *out = pg;
    return PKV_OK;
}

void pkvi_page_destroy(pkvi_pool *p, pkvi_page *pg)
{
    if (pg->data)
        pkvi_pool_put(p, pg->data);
    free(pg);
}

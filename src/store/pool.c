/*
 * pool.c - the page pool: fixed-size, aligned page buffers from a private arena of the
 * jemalloc found at run time (or aligned_alloc: built with -Djemalloc=disabled, or no
 * usable jemalloc in the process), a small cache of free buffers for reuse, and the
 * memory budget. Arenas of destroyed engines are purged
 * and reused by later engines (see "idle arenas" below).
 *
 * Owns page *buffers*, their counts and struct pkvi_pool, which no other file sees
 * (pool.h: counters are read through functions). It does not own reference counts
 * (btable.c) or spilling (session/residency.c, spill.c). Every function runs under
 * the engine lock, but create and destroy (no other thread knows the engine yet, or
 * any more) and pkvi_pool_allocator_bytes, which reads only fields fixed from create
 * to destroy (use_jemalloc, arena, page_bytes) so that stats need not hold the engine
 * lock while jemalloc refreshes its statistics. The idle arenas have their own lock,
 * idle_lock, taken only by create and destroy.
 *
 * Invariants (pkvi_pool_check):
 *   allocated == in_use + n_free          (every buffer is held or cached)
 *   budget_pages == 0 || in_use + n_free <= budget_pages
 *   n_free <= free_slots <= free_cap   (16 MiB worth, or the whole budget when one is
 *                                       set; the slot array grows as buffers come back)
 * The budget caps buffers held *and* cached, so the process's page memory never
 * exceeds mem_budget whatever the reuse pattern.
 */
#include "store/pool.h"
#include "pkv_config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if PKV_HAVE_JEMALLOC
#include <dlfcn.h>
#include <jemalloc/jemalloc.h> /* the MALLOCX_* flags; the calls go through `je` */
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

struct pkvi_pool {
    bool use_jemalloc;     /* false: aligned_alloc (-Djemalloc=disabled, or no jemalloc
                              found at run time: "jemalloc, found at run time" below) */
    unsigned arena;        /* jemalloc arena index (when use_jemalloc) */
    uint64_t page_bytes;
    uint64_t budget_pages; /* 0 = unlimited */
    uint64_t in_use;       /* resident pages held by descriptors */
    uint64_t spilled;      /* descriptors whose bytes are in the spill file */
    void **free_list;      /* cached free page buffers, [free_slots], grown on demand */
    uint64_t n_free, free_slots, free_cap;
    uint64_t allocated;    /* page buffers obtained from the allocator and not returned */
    uint64_t fault[3];     /* test hook: countdown per pkvi_pool_fault, 0 = disarmed */
};

/* Whether the next allocation of kind k is to fail (the test hook). */
static bool inject(pkvi_pool *p, pkvi_pool_fault k)
{
    return p->fault[k] && --p->fault[k] == 0;
}

#if PKV_HAVE_JEMALLOC
/*
 * jemalloc, found at run time (the library does not link it: Debian's libjemalloc.so.2
 * has initial-exec TLS, and a library that needs it cannot be loaded with dlopen -
 * "cannot allocate memory in static TLS block" - so Python, plugin hosts and JNI could
 * not load pagedkv). Resolved once per process, at the first pkvi_pool_init, in order:
 *
 *   1. the process's jemalloc: a program that links it (pkg-config's recipe does) or
 *      preloads it. The weak references are bound by the link (also in a fully static
 *      executable), dlsym(RTLD_DEFAULT) finds one loaded RTLD_GLOBAL since.
 *   2. a private one: dlopen("libjemalloc.so.2", RTLD_NOW | RTLD_LOCAL). RTLD_LOCAL
 *      keeps its malloc out of the global scope, so it serves the pool only and never
 *      becomes the process's malloc. It fails where static TLS is short (a dlopen'ed
 *      pagedkv in a process started without jemalloc, e.g. Python), and then
 *   3. none: every pool is on aligned_alloc (pkv_stats.pool says "aligned").
 *
 * The table is process-wide state, written once under je_once and read-only after
 * (documented in pagedkv.h at pkv_engine_destroy, like the idle arenas below); a
 * private handle is never closed, because idle arenas and jemalloc's thread caches
 * live in it until the process ends.
 */
#pragma weak mallocx
#pragma weak dallocx
#pragma weak mallctl

typedef void *(*je_mallocx_fn)(size_t size, int flags);
typedef void (*je_dallocx_fn)(void *ptr, int flags);
typedef int (*je_mallctl_fn)(const char *name, void *oldp, size_t *oldlenp, void *newp,
                             size_t newlen);
static struct {
    je_mallocx_fn mallocx;   /* all three set, or all NULL (no jemalloc) */
    je_dallocx_fn dallocx;
    je_mallctl_fn mallctl;
} je;                        /* written once by je_resolve (je_once), then read-only */
static pthread_once_t je_once = PTHREAD_ONCE_INIT;

/* jemalloc 5 or later: mallocx's flags and the arena mallctls are 5.x's. */
static bool je_usable(je_mallctl_fn ctl)
{
    const char *version = NULL;
    size_t sz = sizeof version;
    if (ctl("version", &version, &sz, NULL, 0) != 0 || !version)
        return false;
    return version[0] >= '5' && version[0] <= '9' && version[1] == '.';
}

static bool je_take(je_mallocx_fn mx, je_dallocx_fn dx, je_mallctl_fn ctl)
{
    if (!mx || !dx || !ctl || !je_usable(ctl))
        return false;
    je.mallocx = mx;
    je.dallocx = dx;
    je.mallctl = ctl;
    return true;
}

/* dlsym's object pointer as a function pointer (POSIX guarantees the representation;
 * ISO C has no cast between them, so the bytes are copied). */
#define JE_SYM(handle, name, fn)                                                      \
    do {                                                                              \
        void *sym_ = dlsym(handle, #name);                                            \
        _Static_assert(sizeof sym_ == sizeof fn, "function pointers are not data pointers"); \
        memcpy(&(fn), &sym_, sizeof fn);                                              \
    } while (0)

static void je_resolve(void)
{
    if (je_take(mallocx, dallocx, mallctl)) /* weak: NULL unless the link bound them */
        return;
    je_mallocx_fn mx;
    je_dallocx_fn dx;
    je_mallctl_fn ctl;
    JE_SYM(RTLD_DEFAULT, mallocx, mx);
    JE_SYM(RTLD_DEFAULT, dallocx, dx);
    JE_SYM(RTLD_DEFAULT, mallctl, ctl);
    if (je_take(mx, dx, ctl))
        return;
    void *h = dlopen("libjemalloc.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        (void)dlerror(); /* "cannot allocate memory in static TLS block", or absent */
        return;
    }
    JE_SYM(h, mallocx, mx);
    JE_SYM(h, dallocx, dx);
    JE_SYM(h, mallctl, ctl);
    if (!je_take(mx, dx, ctl))
        dlclose(h); /* not a jemalloc 5: nothing of it is in use */
}
#endif

/* jemalloc's pages of 4 KiB or more are aligned to the OS page, smaller ones to a
 * cache line. Measured (jemalloc 5.3, 512 MiB of 64 KiB pages): with 64-byte
 * alignment RSS grew 545.6 MiB, with 4096-byte alignment 514.1 MiB - a cache-line-
 * aligned large allocation may start inside an OS page and touch one more page than
 * it needs. glibc is the other way round: its aligned_alloc(4096) leaves a fragment
 * of up to 4 KiB before each buffer, whose header it writes. Measured (glibc 2.36,
 * 1 GiB of pages, RSS growth): 8 KiB pages 1538.5 MiB at 4096 against 1035.0 MiB at
 * 64; 64 KiB 1088.6 against 1025.6; 128 KiB 1056.5 against 1027.4; 256 KiB 1040.4
 * against 1026.8. So the aligned pool aligns to a cache line. */
static size_t buf_align(const pkvi_pool *p)
{
    if (!p->use_jemalloc)
        return PKVI_PAGE_ALIGN;
    return p->page_bytes >= 4096 ? 4096 : PKVI_PAGE_ALIGN;
}

static void *buf_alloc(pkvi_pool *p)
{
    if (inject(p, PKVI_POOL_FAULT_BUFFER))
        return NULL;
    const size_t align = buf_align(p);
#if PKV_HAVE_JEMALLOC
    if (p->use_jemalloc)
        return je.mallocx((size_t)p->page_bytes, MALLOCX_ALIGN(align) |
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
        je.dallocx(buf, MALLOCX_TCACHE_NONE);
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
 * that maps addresses to extents grows leaves for it that are never freed; purging an
 * arena and handing it to the next engine instead keeps RSS flat (docs/performance.md,
 * decision table: arena-reuse).
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
    return je.mallctl("arenas.create", out, &sz, NULL, 0) == 0;
}

/* Give back an arena that holds no allocation. */
static void arena_give(unsigned arena)
{
    char name[64];
    snprintf(name, sizeof name, "arena.%u.purge", arena); /* its pages go to the OS */
    je.mallctl(name, NULL, NULL, NULL, 0);
    bool kept = false;
    pthread_mutex_lock(&idle_lock);
    if (n_idle < IDLE_ARENAS_MAX) {
        idle_arenas[n_idle++] = arena;
        kept = true;
    }
    pthread_mutex_unlock(&idle_lock);
    if (!kept) {
        snprintf(name, sizeof name, "arena.%u.destroy", arena);
        je.mallctl(name, NULL, NULL, NULL, 0);
    }
}
#endif

pkv_status pkvi_pool_create(uint64_t page_bytes, uint64_t budget_bytes, pkvi_pool **out)
{
    pkvi_pool *p = calloc(1, sizeof *p);
    if (!p)
        return PKV_ENOMEM;
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
         * in fresh memory for each page read back (first touch made restore many times
         * slower than the disk: docs/performance.md, decision table: FREE_CACHE_BYTES).
         * The slot array is
         * kept under 1/512 of the budget for tiny pages. It is allocated as buffers
         * come back, never up front: a budget is a ceiling, and a huge one (even
         * UINT64_MAX) must not reserve memory for slots it may never fill. */
        p->free_cap = p->budget_pages;
        if (p->free_cap > budget_bytes / 512 && budget_bytes / 512 >= 4)
            p->free_cap = budget_bytes / 512;
    }
#if PKV_HAVE_JEMALLOC
    pthread_once(&je_once, je_resolve);
    if (je.mallocx) {
        unsigned arena = 0;
        if (!arena_take(&arena)) {
            free(p);
            return PKV_ENOMEM;
        }
        p->use_jemalloc = true;
        p->arena = arena;
    }
#endif
    *out = p;
    return PKV_OK;
}

void pkvi_pool_destroy(pkvi_pool *p)
{
    if (!p)
        return;
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
#endif
    free(p);
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
    if (n > SIZE_MAX / sizeof(void *) || inject(p, PKVI_POOL_FAULT_SLOTS))
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

void pkvi_pool_put_spilled(pkvi_pool *p, void *buf)
{
    pkvi_pool_put(p, buf);
    p->spilled++;
}

void pkvi_pool_unspilled(pkvi_pool *p)
{
    p->spilled--;
}

bool pkvi_pool_room(const pkvi_pool *p, uint64_t n, uint64_t *need)
{
    *need = 0;
    if (!p->budget_pages || p->in_use + n <= p->budget_pages)
        return true;
    if (n > p->budget_pages)
        return false;
    *need = p->in_use + n - p->budget_pages;
    return true;
}

uint64_t pkvi_pool_page_bytes(const pkvi_pool *p)
{
    return p->page_bytes;
}

pkvi_pool_counts pkvi_pool_count(const pkvi_pool *p)
{
    return (pkvi_pool_counts){.in_use = p->in_use, .n_free = p->n_free,
                              .spilled = p->spilled, .allocated = p->allocated,
                              .budget_pages = p->budget_pages};
}

const char *pkvi_pool_kind(const pkvi_pool *p)
{
    return p->use_jemalloc ? "jemalloc" : "aligned";
}

bool pkvi_pool_check(const pkvi_pool *p)
{
    return p->allocated == p->in_use + p->n_free && p->n_free <= p->free_slots &&
           p->free_slots <= p->free_cap &&
           (!p->budget_pages || p->in_use + p->n_free <= p->budget_pages);
}

void pkvi_pool_inject_fault(pkvi_pool *p, pkvi_pool_fault kind, uint64_t nth)
{
    p->fault[kind] = nth;
}

uint64_t pkvi_pool_allocator_bytes(const pkvi_pool *p, uint64_t allocated)
{
#if PKV_HAVE_JEMALLOC
    if (p->use_jemalloc) {
        /* jemalloc's stats are snapshots refreshed by writing "epoch". */
        uint64_t epoch = 1;
        size_t sz = sizeof epoch;
        je.mallctl("epoch", &epoch, &sz, &epoch, sz);
        char name[96];
        size_t small = 0, large = 0;
        sz = sizeof small;
        snprintf(name, sizeof name, "stats.arenas.%u.small.allocated", p->arena);
        if (je.mallctl(name, &small, &sz, NULL, 0) != 0)
            small = 0;
        sz = sizeof large;
        snprintf(name, sizeof name, "stats.arenas.%u.large.allocated", p->arena);
        if (je.mallctl(name, &large, &sz, NULL, 0) != 0)
            large = 0;
        return (uint64_t)small + (uint64_t)large;
    }
#endif
    return allocated * p->page_bytes;
}

pkv_status pkvi_page_create(pkvi_pool *p, pkvi_page **out)
{
    pkvi_page *pg = inject(p, PKVI_POOL_FAULT_DESCRIPTOR) ? NULL : calloc(1, sizeof *pg);
    if (!pg)
        return PKV_ENOMEM;
    const pkv_status st = pkvi_pool_get(p, &pg->data);
    if (st != PKV_OK) {
        free(pg);
        return st;
    }
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

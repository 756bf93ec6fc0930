/*
 * internal.h - shared, non-public declarations of pagedkv's modules.
 *
 * Owns: the engine, page and session structures, the kernel signature, the thread
 * pool, the I/O and spill interfaces. Every cross-file name is pkvi_* and hidden.
 *
 * Locking (one lock, e->lock, a plain mutex):
 *   e->lock guards the pool (free list, counters, budget), every page descriptor's
 *   refs / data / spill slot / pins, every session's block-table *structure*
 *   (pointers, counts, capacities) and the engine's session list (LRU order).
 *   The session's owner thread may read its own block tables without the lock:
 *   only it mutates them (under the lock), and the spiller changes page data only
 *   for pages with pins == 0, while decode pins the pages it reads.
 *   Without a spill file, page data never moves, so decode takes no lock at all.
 *
 * Invariants (checked by pkvi_engine_check in tests):
 *   I1  pool.in_use == number of live descriptors with data != NULL
 *   I2  pool.spilled == number of live descriptors with data == NULL
 *   I3  sum over live sessions/layers of references to page P == P->refs
 *   (pins == 0 for every page between API calls)
 *   I4  (pool.in_use + pool.n_free) * page_bytes <= mem_budget (when set)
 *   I5  layer.len <= layer.n_pages * block_tokens < layer.len + block_tokens
 */
#ifndef PAGEDKV_INTERNAL_H
#define PAGEDKV_INTERNAL_H

#define PAGEDKV_BUILDING 1
#include "pagedkv.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PKVI_HIDDEN __attribute__((visibility("hidden")))

/* ---- checked size arithmetic ------------------------------------------------------ */

static inline bool pkvi_mul(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool pkvi_add(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

/* ---- tunables -------------------------------------------------------------------- */

/* Default tokens per page. See docs/design.md "Choosing block_tokens". */
#define PKVI_DEFAULT_BLOCK_TOKENS 16u
/* Largest page the engine accepts (bytes). */
#define PKVI_MAX_PAGE_BYTES (1ull << 30)
/* Largest n_heads / n_kv_heads (bounds the kernels' stack scratch). */
#define PKVI_MAX_GROUP_HEADS 256u
/* Largest head_dim (bounds per-head stack buffers). */
#define PKVI_MAX_HEAD_DIM 4096u
/* At most this many split-K chunks per group and decode: bounds the partial-state
 * scratch (PKVI_MAX_CHUNKS * h * (d + 2) floats per session) and the merge work. */
#define PKVI_MAX_CHUNKS 64u
/* Page alignment (cache line; AVX-512 loads). */
#define PKVI_PAGE_ALIGN 64u
/* Tokens scored per softmax tile inside a kernel (stack scratch of
 * PKVI_TILE * heads-per-group floats). */
#define PKVI_TILE 16u

/* ---- dtype conversion (dtype.c) ---------------------------------------------------- */

PKVI_HIDDEN uint16_t pkvi_f32_to_f16(float x);
PKVI_HIDDEN float    pkvi_f16_to_f32(uint16_t h);
PKVI_HIDDEN uint16_t pkvi_f32_to_bf16(float x);
PKVI_HIDDEN float    pkvi_bf16_to_f32(uint16_t h);
/* dst (n values of dtype t) = round(src[0..n)) */
PKVI_HIDDEN void pkvi_store_row(pkv_dtype t, void *dst, const float *src, uint32_t n);
/* dst[0..n) = src (n values of dtype t) as f32 */
PKVI_HIDDEN void pkvi_load_row(pkv_dtype t, float *dst, const void *src, uint32_t n);

/* ---- kernels (kernels/) ------------------------------------------------------------- */

/* Geometry one kernel call needs. All byte figures are for one page. */
typedef struct {
    uint32_t head_dim;      /* d */
    uint32_t block_tokens;  /* bt: positions per page */
    uint32_t hg;            /* query heads per KV group (h / g) */
    pkv_dtype dtype;        /* storage type of the page */
    float scale;            /* softmax scale applied to q.k */
    size_t group_stride;    /* bytes between consecutive groups in a page: 2*bt*d*size */
    size_t v_offset;        /* bytes from a group's K rows to its V rows: bt*d*size */
} pkvi_kparams;

/*
 * The decode kernel: fold `n_pages` pages (all full but the last, which holds
 * `last_tokens` in 1..bt positions) of KV group `group` into the running softmax
 * state of the group's hg query heads.
 *
 *   q    [hg][d]   the group's query heads (unscaled)
 *   m    [hg]      running max of scale*q.k   (in/out; -INFINITY when empty)
 *   l    [hg]      running sum of exp(s - m)  (in/out; 0 when empty)
 *   acc  [hg][d]   running sum of exp(s - m) * v (in/out; 0 when empty)
 *
 * Score of a position: s = (q . k) * scale, dot accumulated in f32. Positions are
 * folded in order in tiles of at most PKVI_TILE tokens (a tile never spans pages):
 * per tile, m' = max(m, max s); rescale l and acc by exp(m - m'); add exp(s - m').
 * Never allocates, locks or fails. Variants may reassociate sums (documented bound in
 * docs/numerics.md); each variant is deterministic.
 */
typedef void (*pkvi_attend_fn)(const pkvi_kparams *p, const void *const *pages,
                               uint32_t n_pages, uint32_t last_tokens, uint32_t group,
                               const float *restrict q, float *restrict m,
                               float *restrict l, float *restrict acc);

typedef struct {
    const char *isa;                 /* "scalar", "avx2", "avx512" */
    pkvi_attend_fn attend;
    /* store n floats as dtype t (round-to-nearest-even), load them back */
    void (*store_row)(pkv_dtype t, void *dst, const float *src, uint32_t n);
} pkvi_kernels;

PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_scalar;
PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_avx2;    /* may be unavailable */
PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_avx512;  /* may be unavailable */
/* Best kernels the CPU and OS support (cpuid + XGETBV), honouring PKV_FORCE_ISA
 * (scalar|avx2|avx512; a forced ISA the host lacks gives PKV_EINVAL). */
PKVI_HIDDEN pkv_status pkvi_kernels_select(const pkvi_kernels **out);
/* Whether the host can run `isa` ("scalar" always). */
PKVI_HIDDEN bool pkvi_isa_supported(const char *isa);

/* ---- thread pool (threads.c) ------------------------------------------------------- */

typedef struct pkvi_threads pkvi_threads;
/* fn(ctx, task) runs once for every task in [0, n_tasks), on any thread. */
typedef void (*pkvi_task_fn)(void *ctx, uint32_t task);
PKVI_HIDDEN pkv_status pkvi_threads_create(uint32_t n_threads, pkvi_threads **out);
PKVI_HIDDEN void pkvi_threads_destroy(pkvi_threads *t);
/* Run the tasks on the pool plus the calling thread; returns when all are done.
 * If another thread is using the pool, the caller runs every task itself. */
PKVI_HIDDEN void pkvi_threads_run(pkvi_threads *t, uint32_t n_tasks, pkvi_task_fn fn,
                                  void *ctx);

/* ---- I/O backends (io.c, io_uring.c, io_sync.c) ------------------------------------- */

typedef struct pkvi_io pkvi_io;
typedef struct {
    bool write;        /* pwrite when true, pread otherwise */
    int fd;
    void *buf;
    uint64_t len;      /* bytes; short transfers are retried until complete */
    uint64_t off;      /* file offset */
} pkvi_io_req;
typedef enum { PKVI_FAULT_READ = 0, PKVI_FAULT_WRITE, PKVI_FAULT_FSYNC } pkvi_fault_kind;

/* io_uring unless force_sync or PKV_NO_URING=1 or the kernel refuses it. */
PKVI_HIDDEN pkv_status pkvi_io_open(bool force_sync, pkvi_io **out);
PKVI_HIDDEN void pkvi_io_close(pkvi_io *io);
PKVI_HIDDEN const char *pkvi_io_backend(const pkvi_io *io);   /* "io_uring" | "sync" */
/* Perform all n requests (batched); PKV_EIO if any failed (others may have completed). */
PKVI_HIDDEN pkv_status pkvi_io_submit(pkvi_io *io, const pkvi_io_req *reqs, uint32_t n);
PKVI_HIDDEN pkv_status pkvi_io_fsync(pkvi_io *io, int fd);
/* Test hook: make the nth (1-based) future operation of `kind` fail with EIO
 * (0 disarms). Per io object, never global. */
PKVI_HIDDEN void pkvi_io_inject_fault(pkvi_io *io, pkvi_fault_kind kind, uint64_t nth);

/* ---- the page pool (pool.c) --------------------------------------------------------- */

/* A page descriptor. The page's bytes live at `data` while resident; while spilled,
 * data == NULL and the bytes are at slot `slot` of the spill file. */
typedef struct pkvi_page {
    void *data;            /* page_bytes, PKVI_PAGE_ALIGN-aligned; NULL when spilled */
    uint64_t slot;         /* spill-file slot while spilled */
    uint32_t refs;         /* block-table entries (over all sessions) naming this page */
    uint32_t pins;         /* decodes/appends currently reading or writing it */
    uint32_t tally;        /* scratch of pkvi_engine_check only */
} pkvi_page;

typedef struct {
    bool use_jemalloc;     /* false: aligned_alloc (meson -Djemalloc=disabled) */
    unsigned arena;        /* jemalloc arena index (when use_jemalloc) */
    uint64_t page_bytes;
    uint64_t budget_pages; /* 0 = unlimited */
    uint64_t in_use;       /* resident pages held by descriptors */
    uint64_t spilled;      /* descriptors whose bytes are in the spill file */
    void **free_list;      /* cached free page buffers, [free_cap] */
    uint64_t n_free, free_cap;
    uint64_t allocated;    /* page buffers obtained from the allocator and not returned */
} pkvi_pool;

PKVI_HIDDEN pkv_status pkvi_pool_init(pkvi_pool *p, uint64_t page_bytes,
                                      uint64_t budget_bytes);
PKVI_HIDDEN void pkvi_pool_fini(pkvi_pool *p);
/* One page buffer; PKV_ENOMEM past the budget or when the allocator fails.
 * Caller holds e->lock. Counts the page in in_use. */
PKVI_HIDDEN pkv_status pkvi_pool_get(pkvi_pool *p, void **out);
/* Return a page buffer (uncounts it from in_use). Caller holds e->lock. */
PKVI_HIDDEN void pkvi_pool_put(pkvi_pool *p, void *buf);
/* Whether one more page fits the budget right now (free-list reuse always fits). */
PKVI_HIDDEN bool pkvi_pool_can_get(const pkvi_pool *p);
/* Bytes jemalloc reports for the arena (stats.arenas.<i>.small/large allocated);
 * without jemalloc: allocated * page_bytes. */
PKVI_HIDDEN uint64_t pkvi_pool_allocator_bytes(const pkvi_pool *p);

/* ---- the engine (engine.c) ---------------------------------------------------------- */

typedef struct pkvi_spill pkvi_spill;

struct pkv_engine {
    pkv_config cfg;              /* resolved: block_tokens, scale, n_threads set */
    char *spill_dir;             /* owned copy of cfg.spill_dir, or NULL */
    uint32_t hg;                 /* query heads per group, h / g */
    size_t dsize;                /* bytes per stored value */
    uint64_t row_bytes;          /* one K (or V) row of one group: d * dsize */
    uint64_t page_bytes;         /* 2 * g * bt * d * dsize */
    uint32_t chunk_pages;        /* split-K chunk, fixed (independent of threads) */
    pkvi_kparams kp;             /* kernel geometry */
    const pkvi_kernels *kern;    /* chosen once at creation */
    pkvi_threads *threads;       /* workers (n_threads - 1 of them) */

    pthread_mutex_t lock;        /* see the file comment */
    pkvi_pool pool;              /* guarded by lock */
    pkvi_spill *spill;           /* NULL without spill_dir; guarded by lock */
    uint64_t clock;              /* LRU clock; guarded by lock */
    pkv_session *sessions;       /* doubly linked list of live sessions; lock */
    uint64_t n_sessions;         /* lock */
};

/* Validate cfg (SPEC §2 rules); on success *out is cfg with defaults resolved. */
PKVI_HIDDEN pkv_status pkvi_config_resolve(const pkv_config *cfg, pkv_config *out);
/* Consistency check of invariants I1..I5 (tests; takes the lock). true when sound. */
PKVI_HIDDEN bool pkvi_engine_check(pkv_engine *e);

/* ---- sessions (session.c) ----------------------------------------------------------- */

/* One layer's block table. Entry i holds positions [i*bt, (i+1)*bt). */
typedef struct {
    uint64_t len;            /* cached positions */
    uint64_t n_pages;        /* ceil(len / bt) */
    uint64_t cap;            /* capacity of pages[] and data[] */
    pkvi_page **pages;       /* [cap] descriptors */
    const void **data;       /* [cap] pages[i]->data, refreshed by acquire */
} pkvi_layer;

struct pkv_session {
    pkv_engine *e;
    pkvi_layer *layers;      /* [n_layers] */
    pkv_session *prev, *next;/* engine's session list; guarded by e->lock */
    uint64_t lru;            /* engine clock at last use; e->lock */
    /* Decode scratch for split-K partial states, grown at append time so decode
     * never allocates: per (group, chunk): m[hg], l[hg], acc[hg][d]. */
    float *partials;
    uint64_t partials_chunks;/* chunks partials can hold, per group */
};

/* Bring every page of `layer` into memory and pin it (spill only; else a no-op).
 * PKV_EIO / PKV_ENOMEM leave the session unchanged. */
PKVI_HIDDEN pkv_status pkvi_session_acquire(pkv_session *s, uint32_t layer);
PKVI_HIDDEN void pkvi_session_release(pkv_session *s, uint32_t layer);
/* Append one whole or partial page of raw stored bytes (dtype already applied) as the
 * layer's next page; the layer's len must be a multiple of bt. For load. */
PKVI_HIDDEN pkv_status pkvi_session_push_page(pkv_session *s, uint32_t layer,
                                              const void *bytes, uint32_t tokens);
/* Make sure partials can hold n_chunks per group. */
PKVI_HIDDEN pkv_status pkvi_session_reserve_partials(pkv_session *s, uint64_t n_pages);

/* ---- decode (decode.c) ------------------------------------------------------------- */

/* Decode n queries, one per session, on the pool (batch and single use this). */
PKVI_HIDDEN pkv_status pkvi_decode_many(pkv_engine *e, uint32_t layer, uint32_t n,
                                        pkv_session *const *sessions, const float *q,
                                        float *out);

/* ---- spill (spill.c) --------------------------------------------------------------- */

PKVI_HIDDEN pkv_status pkvi_spill_open(pkv_engine *e);
PKVI_HIDDEN void pkvi_spill_close(pkv_engine *e);
PKVI_HIDDEN const char *pkvi_spill_backend(const pkv_engine *e);
/* Under e->lock: free room for `n` more pages by writing unpinned pages of the least
 * recently used sessions to the spill file. PKV_ENOMEM if not enough can be spilled;
 * PKV_EIO if writes failed (those pages stay resident). */
PKVI_HIDDEN pkv_status pkvi_spill_make_room(pkv_engine *e, uint64_t n);
/* Under e->lock: read the n spilled pages back into memory (batched). On failure
 * every page stays spilled and nothing leaks. */
PKVI_HIDDEN pkv_status pkvi_spill_fault_in(pkv_engine *e, pkvi_page *const *pages,
                                           uint32_t n);
/* Under e->lock: forget the spill slot of a page that is being freed. */
PKVI_HIDDEN void pkvi_spill_drop(pkv_engine *e, pkvi_page *page);
/* The engine's io object (tests inject faults through it); NULL without spill. */
PKVI_HIDDEN pkvi_io *pkvi_spill_io(pkv_engine *e);

/* ---- checksums (crc32c.c) ----------------------------------------------------------- */

PKVI_HIDDEN uint32_t pkvi_crc32c(uint32_t crc, const void *buf, size_t len);

#endif /* PAGEDKV_INTERNAL_H */

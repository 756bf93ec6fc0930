/*
 * engine/engine.h - the engine as every module sees it (engine.c creates it): the
 * resolved configuration, the geometry every module derives from it, and what it owns - kernels, worker threads, the
 * page pool, the spill file, the list of live sessions - with the one lock.
 *
 * Locking: e->lock (a plain mutex) guards the pool, every page descriptor's refs /
 * data / slot, the spill file, every block table's structure (entries, counts, pins)
 * and the session list with its LRU clock. A session's owner thread reads its own
 * tables without it: only the owner changes them (under the lock), and the spiller
 * moves pages only of tables with pins == 0. Without a spill file pages never move,
 * so decode takes no lock at all.
 *
 * Invariants (pkvi_engine_check, session/account.c):
 *   E1  pool.in_use   == descriptors with data != NULL
 *   E2  pool.spilled  == descriptors with data == NULL
 *   E3  for every page P: entries naming P over all tables == P->refs
 *   E4  (pool.in_use + pool.n_free) * page_bytes <= mem_budget (when set)
 *   and B1-B5 of btable.h for every table, P1-P4 of prefix.h for the index. E1-E3
 *   count the index's references too: entries naming P + P->indexed == P->refs.
 */
#ifndef PAGEDKV_ENGINE_STATE_H
#define PAGEDKV_ENGINE_STATE_H

#include "cache/btable.h"
#include "kernels/kernels.h"
#include "store/pool.h"
#include "cache/prefix.h"
#include "store/spill.h"
#include "base/threads.h"
#include "attention/reference.h"

#include <pthread.h>

/* Default tokens per page. See docs/design.md "Choosing block_tokens". */
#define PKVI_DEFAULT_BLOCK_TOKENS 16u
/* Largest n_layers: every session holds a block table per layer, and a session file's
 * header holds them all (docs/file-format.md: at most 131060 layers). */
#define PKVI_MAX_LAYERS 65536u
/* Largest n_kv_heads: keeps the thread pool's task counts (a batch's sessions or a
 * prefill tile's queries, times groups: at most 256 * 65536 = 2^24) within 32 bits. */
#define PKVI_MAX_KV_HEADS 65536u
/* Split-K chunks computed at once (a wave, decode.c): bounds the partial-state
 * scratch at (PKVI_MAX_CHUNKS + 1) * h * (dv + 2) floats per session, however long
 * the context - the number of chunks of a decode is not bounded (chunk c holds the
 * absolute pages [c * chunk_pages, (c + 1) * chunk_pages)). */
#define PKVI_MAX_CHUNKS 64u
/* Below this many K/V values in a whole decode call (times queries for prefill),
 * counted as f16 bytes (2 a value, whatever the page dtype), the
 * calling thread works alone (decode.c, through the engine's split_awake and
 * split_asleep). Measured on the 2-core VM (llama3-8b layer, f16): with the worker
 * awake (threads.c polls for a while after each run), 2 threads tie with 1 at 1 MiB
 * (36 vs 32 us) and win from 4 MiB on (118 vs 130 us). A call that must wake a
 * sleeping worker pays 60-90 us more. Calls 1 ms apart, 2 threads (waking the worker)
 * against 1 at 1 / 4 / 8 / 16 MiB, two runs: 105 / 222 / 333 / 540 us against 67 /
 * 211 / 324 / 605, and 157 / 289 / 450 / 677 against 78 / 207 / 515 / 924. So a cold
 * call splits from 8 MiB (docs/design.md has the figures of the final rule). */
#define PKVI_SPLIT_AWAKE_BYTES (1ull << 20)
#define PKVI_SPLIT_ASLEEP_BYTES (8ull << 20)

struct pkv_engine {
    pkv_config cfg;              /* resolved: block_tokens, scale, n_threads set */
    char *spill_dir;             /* owned copy of cfg.spill_dir, or NULL */
    uint32_t hg;                 /* query heads per group, h / g */
    uint64_t row_bytes;          /* one K row of one group: pkv_row_bytes(dtype, dk) */
    uint64_t row_bytes_v;        /* one V row of one group: pkv_row_bytes(dtype, dv) */
    uint64_t page_bytes;         /* g * bt * (row_bytes + row_bytes_v) */
    pkv_layer_config *layers;    /* [n_layers] per-layer variants (zeros: full causal),
                                    sink_logits owned; cfg.layer_cfg points here */
    bool variants;               /* some layer is not plain causal, or dv != dk */
    uint32_t sink_chunks_max;    /* most split-K chunks a layer's sink pages add */
    uint32_t chunk_pages;        /* split-K chunk, fixed (independent of threads) */
    pkvi_kparams kp;             /* kernel geometry */
    const pkvi_kernels *kern;    /* chosen once at creation */
    pkvi_threads *threads;       /* workers (n_threads - 1 of them) */
    double split_awake;          /* K/V bytes (x queries) from which a call uses the */
    double split_asleep;         /* workers, awake / asleep; tests set 0 to force them */

    pthread_mutex_t lock;        /* see the file comment */
    pkvi_pool pool;              /* lock */
    pkvi_spill *spill;           /* NULL without spill_dir; lock */
    uint64_t clock;              /* LRU clock; lock */
    pkv_session *sessions;       /* doubly linked list of live sessions; lock */
    uint64_t n_sessions;         /* lock */
    pkvi_prefix prefix;          /* the prefix cache's index (SPEC §10); lock */

    pthread_mutex_t file_io_lock;/* guards file_io's creation alone: not e->lock, which
                                    saves take to pin pages while they hold file_io */
    pkvi_io *file_io;            /* session files' I/O (save, load), one ring for all of
                                    the engine's sessions (io.c serializes its use);
                                    created on first use; file_io_lock */

    pthread_mutex_t err_lock;    /* guards err alone (error.c) */
    char err[256];               /* reason of the most recent failed call; err_lock */

    /* Test hook (tests/ only; NULL otherwise): called by an append after its pages
     * are reserved and the lock is dropped, just before it writes the rows - where a
     * descheduled writer once let another session's rollback share its page. */
    void (*hook_before_write)(void *ctx);
    void *hook_ctx;
    /* The prefix index's collision hook is prefix.collide (tests set it before the
     * first pkv_session_set_tokens): every hash 0, one bucket. */
};

/* Record why a call on e failed (printf format; pkv_engine_last_error reads it) and
 * return st, so failure paths read `return pkvi_fail(e, PKV_EINVAL, "...", ...)`.
 * Every reason starts with the name of the public call that fails ("pkv_decode: ..."):
 * an internal helper that records one takes that name from its caller. The record is
 * not logical state: calls on a const engine or session record too. */
PKVI_HIDDEN pkv_status pkvi_fail(const pkv_engine *e, pkv_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The engine's I/O object for session files, created on first use (io_uring unless
 * PKV_NO_URING=1 or the kernel refuses it, read then). PKV_ENOMEM. Thread-safe. */
PKVI_HIDDEN pkv_status pkvi_engine_file_io(pkv_engine *e, pkvi_io **out);

/* Validate cfg (SPEC §2 rules); on success *out is cfg with defaults resolved. */
PKVI_HIDDEN pkv_status pkvi_config_resolve(const pkv_config *cfg, pkv_config *out);

/* Split-K chunks of pages [0, n_pages) of a layer: ceil(n_pages / chunk_pages). The
 * chunks are absolute (decode.c): chunk c holds pages [c * chunk_pages, (c + 1) *
 * chunk_pages), whatever the length - what lets shards merge bitwise (SPEC §11). */
static inline uint64_t pkvi_split_chunks(const pkv_engine *e, uint64_t n_pages)
{
    return (n_pages + e->chunk_pages - 1) / e->chunk_pages;
}

/* Pages holding a windowed layer's sink positions (kept for ever); 0 without a window. */
static inline uint64_t pkvi_sink_pages(const pkv_engine *e, const pkv_layer_config *lc)
{
    return pkvi_window_sink_pages(lc, e->cfg.block_tokens);
}

/* State blocks per group a decode of a layer of up to n_pages pages needs: the
 * running state and one wave of chunks (its runs' chunks, a windowed layer's sink
 * pages included, at most PKVI_MAX_CHUNKS). decode.c's runs, session.c's and
 * pkv_prefill's scratch. */
static inline uint64_t pkvi_max_chunks(const pkv_engine *e, uint64_t n_pages)
{
    const uint64_t c = pkvi_split_chunks(e, n_pages) + e->sink_chunks_max;
    return (c < PKVI_MAX_CHUNKS ? c : PKVI_MAX_CHUNKS) + 1;
}

/* Positions a shard's first position is a multiple of (pkv_shard_align): whole chunks
 * of whole pages, and at least a windowed layer's sink positions, so that every sink
 * lives on the shard that starts at 0. By the geometry alone. */
static inline uint64_t pkvi_shard_align(const pkv_engine *e, uint64_t max_sinks)
{
    const uint64_t chunk = (uint64_t)e->chunk_pages * e->cfg.block_tokens;
    const uint64_t n = (max_sinks + chunk - 1) / chunk;
    return chunk * (n ? n : 1);
}

/* Where released pages go (btable.h). */
static inline pkvi_pages pkvi_engine_pages(pkv_engine *e)
{
    return (pkvi_pages){&e->pool, e->spill, &e->prefix.cached};
}

#endif /* PAGEDKV_ENGINE_STATE_H */

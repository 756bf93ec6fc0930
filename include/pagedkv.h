/*
 * pagedkv.h - the public interface of pagedkv, a paged KV cache and single-query
 * decode-attention engine for token-by-token LLM generators.
 *
 * This header is the product. Everything a program needs is here; every other
 * file of the project is an implementation detail. It is grouped by object:
 *
 *   1. statuses and versions          6. persistence (session files)
 *   2. configuration                  7. shards (one context over several engines)
 *   3. the engine                     8. introspection (block tables, invariants)
 *   4. sessions                       9. dense oracles (the reference semantics)
 *   5. attention calls (speculative   10. dtype helpers
 *      verify and commit among them)
 *
 * Glossary
 *   engine   owns the configuration, the page pool, the worker threads, the kernels
 *            and (optionally) the spill file. Create one per model.
 *   session  one sequence being generated: for every layer, a block table that lists
 *            the pages holding that layer's cached K/V, in position order.
 *   page     (block) `block_tokens` consecutive positions of one layer for every KV
 *            group, laid out group-major: per group, block_tokens K rows then
 *            block_tokens V rows. One page is
 *              page_bytes = n_kv_heads * block_tokens *
 *                           (pkv_row_bytes(kv_dtype, head_dim) +
 *                            pkv_row_bytes(kv_dtype, head_dim_v))
 *            bytes (pkv_stats.page_bytes; e.g. 2 * g * bt * d * 2 for f16 with
 *            head_dim_v = head_dim).
 *   position a token's index in its sequence, from 0; a layer of length n holds
 *            positions 0 .. n - 1 (a shard: first .. n - 1).
 *   chunk    split-K unit: 512 positions rounded up to whole pages, fixed per engine;
 *            chunk c holds positions [c * A0, (c + 1) * A0) whatever the length.
 *
 * Shapes (row-major, head-major)
 *   q        [n_heads][head_dim]        float
 *   k        [n_kv_heads][head_dim]     float
 *   v        [n_kv_heads][head_dim_v]   float (head_dim_v = head_dim unless configured)
 *   out      [n_heads][head_dim_v]      float
 *   Query head i reads KV group i / (n_heads / n_kv_heads).
 *
 * Conventions
 *   - Every fallible call returns a pkv_status; results go through out-parameters,
 *     which come last. A constructor sets *out to the new object on success and
 *     leaves it as it was on failure. Destroy functions accept NULL.
 *   - A call that fails changes nothing observable: every session's contents,
 *     lengths and page sharing, and the caller's handles, are as they were (a failed
 *     append leaves the session exactly as it was; the engine stays usable). Where a
 *     page lives is not part of that: with a spill_dir, any call that needs a page or
 *     reads spilled ones may move pages between memory and the spill file, and one
 *     that fails may leave them moved (bytes_resident and bytes_spilled change,
 *     the values do not).
 *   - Why a call failed: every failing call that can reach an engine (through its
 *     engine or session argument) records one English line that starts with its own
 *     name ("pkv_decode: layer 1 is empty"); pkv_engine_last_error reads it. A call
 *     with no engine to reach (a NULL session or engine) records nothing.
 *   - Sizes and positions: every size or count argument is checked before it is used
 *     in arithmetic (zero, and values whose products overflow, are statuses, never a
 *     wrap), and so is every position. Each call says below what it does at the
 *     extremes (0, 1, the largest valid value, one past it, UINT64_MAX). A pointer
 *     argument must point to as many elements as the sizes say; the library cannot
 *     check that.
 *   - Threads: the engine may be shared by many threads. One session is used by one
 *     thread at a time; different sessions may be used concurrently. Results are
 *     bitwise identical for any n_threads, and between single and batched decode
 *     and prefill.
 *   - Lifetimes: a handle is valid from its constructor to its destroy call.
 *     Destroying a handle twice, or using it after its destroy, is undefined, as
 *     free() of a freed pointer is (the library cannot tell a stale handle from a
 *     live one). pkv_engine_destroy destroys the sessions still alive: their handles
 *     die with the engine, so destroy every session first (or never again after).
 *   - The library never calls abort() or exit().
 *
 * Process-wide state
 *   The library keeps no global state of its own: kernels, threads, the spill file,
 *   the session files' I/O ring and the failure reasons belong to each engine. The
 *   one thing engines share is the allocator of their page pools. Each engine's pages
 *   come from a jemalloc arena of its own; on destroy the arena is purged (its pages
 *   go back to the OS) and kept idle for the next pkv_engine_create in the process,
 *   because jemalloc never frees the metadata of a destroyed arena (about 4 KiB of
 *   RSS per create/destroy cycle otherwise). So the process holds at most as many
 *   arenas as engines were ever alive at once (an arena beyond 256 idle ones is
 *   destroyed instead); taking and returning one is thread-safe. The library does not
 *   link jemalloc: the first pkv_engine_create of the process finds it once, for the
 *   process's life - the process's own jemalloc (linked, as pagedkv.pc's Libs do, or
 *   preloaded), else a private copy dlopen'ed RTLD_LOCAL (which never becomes the
 *   process's malloc, and is never unloaded), else none, and then every pool is on
 *   aligned_alloc; pkv_stats.pool says which. A build without jemalloc
 *   (-Djemalloc=disabled) has no such state.
 *
 * Environment
 *   The library reads three variables, each when an engine (or a first session-file
 *   call of an engine) needs it; pkv_config_explain reads the first two as create
 *   does. It never writes the environment.
 *     PKV_FORCE_ISA  scalar, avx2, avx2vnni, avx512, avx512vnni, neon or
 *                    neon_dotprod: the kernels an engine uses (read by
 *                    pkv_engine_create; a name this CPU and OS cannot run, a table this
 *                    build lacks, or an unknown name, is PKV_EINVAL). Unset or empty:
 *                    the best the host runs. Tables may differ in the last bits,
 *                    within the bound of docs/numerics.md.
 *     PKV_PREFETCH   l1 or l2: where the kernels' software prefetches go (read by
 *                    pkv_engine_create; anything else is PKV_EINVAL). Never changes
 *                    a result (docs/reliability.md).
 *     PKV_NO_URING   1: spill and session files use pread/pwrite, not io_uring
 *                    (read when an engine opens its spill file, and on its first
 *                    pkv_session_save or pkv_session_load; pkv_session_file_check
 *                    reads it on every call). A kernel or sandbox that refuses
 *                    io_uring gets pread/pwrite anyway.
 */
#ifndef PAGEDKV_H
#define PAGEDKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) && defined(PAGEDKV_BUILDING)
#define PKV_API __attribute__((visibility("default")))
#else
#define PKV_API
#endif

/* ==== 1. Statuses and versions ====================================================== */

#define PKV_VERSION_MAJOR 0
#define PKV_VERSION_MINOR 4
#define PKV_VERSION_PATCH 0

/* Status of every fallible call. */
typedef enum {
    PKV_OK = 0,
    PKV_EINVAL,   /* bad argument: NULL pointer, bad layer, bad geometry, zero size,
                     overflowing size, a file of another format/version/geometry */
    PKV_ENOMEM,   /* memory budget (after spilling) or the system cannot supply a page */
    PKV_EIO,      /* an I/O call failed (spill, save, load) */
    PKV_ECORRUPT, /* a session file is damaged (checksum, truncation, padding); or an
                     engine's invariants are broken (a library defect) */
    PKV_ERANGE,   /* a position or length out of range (e.g. truncate beyond length) */
    PKV_ESTATE    /* the object is not in a state that allows the call (decode of an
                     empty layer) */
} pkv_status;

/* A static, human-readable description of s. Never NULL (unknown values included). */
PKV_API const char *pkv_status_str(pkv_status s);

/* "MAJOR.MINOR.PATCH"; static storage. */
PKV_API const char *pkv_version(void);

/* ==== 2. Configuration ============================================================== */

/* Storage type of cached K/V. Input and output are always f32; values are rounded to
 * the storage type with round-to-nearest-even when appended. PKV_Q8 and PKV_Q4 store
 * each row in blocks of 32 values with a scale each (section 10, docs/numerics.md). */
typedef enum { PKV_F32 = 0, PKV_F16, PKV_BF16, PKV_Q8 = 3, PKV_Q4 = 4 } pkv_dtype;

/* One layer's attention variant (docs/variants.md). Zero-initialise it: all zeros is
 * full causal. */
typedef struct {
    uint32_t window;          /* 0: full causal; else a decode at position t attends to
                                 positions j with t - window < j <= t */
    uint32_t sink_tokens;     /* with a window: positions j < sink_tokens are attended too */
    uint32_t rollback_tokens; /* with a window: positions kept beyond the window so that
                                 pkv_session_truncate can go back this many tokens */
    float    softcap;         /* 0: none; else every score s becomes softcap*tanh(s/softcap) */
    const float *sink_logits; /* NULL, or [n_heads]: one learned logit per query head that
                                 joins that head's softmax denominator (gpt-oss); copied */
    /* RoPE (appended in soname 3): in the engine, see "RoPE in the engine"
       in section 5. All four 0: the caller rotates q and k itself, as before. */
    uint32_t rope;            /* 0 none, PKV_ROPE_NORM (adjacent pairs (2i, 2i+1): llama2.c,
                                 GPT-J) or PKV_ROPE_NEOX (pairs (i, i + rope_dims/2): Llama
                                 3, Qwen, Mistral) */
    uint32_t rope_dims;       /* leading values of each head that rotate: even, at most
                                 head_dim (0 = head_dim); the rest pass unchanged */
    float    rope_theta;      /* base, e.g. 10000 (Llama 2) or 500000 (Llama 3); finite,
                                 > 0 (0 = 10000) */
    float    rope_freq_scale; /* linear position scale: the angle of pair i at position p
                                 is p * rope_freq_scale * rope_theta^(-2i / rope_dims);
                                 finite, > 0 (0 = 1, none) */
} pkv_layer_config;

/* Values of pkv_layer_config.rope (docs/rope.md). */
#define PKV_ROPE_NORM 1u
#define PKV_ROPE_NEOX 2u

typedef struct {
    uint32_t n_layers, n_heads, n_kv_heads, head_dim;
    uint32_t block_tokens;     /* tokens per page; 0 = library default (16) */
    pkv_dtype kv_dtype;        /* storage type of cached K/V */
    float    scale;            /* 0 = 1/sqrt(head_dim) */
    uint64_t mem_budget;       /* max bytes of resident pages; 0 = unlimited */
    const char *spill_dir;     /* where offloaded pages go; NULL = no spilling.
                                  Copied by pkv_engine_create. */
    uint32_t n_threads;        /* 0 = number of online CPUs */
    /* attention variants, docs/variants.md (appended in soname 1) */
    uint32_t head_dim_v;       /* width of V rows and of out; 0 = head_dim */
    const pkv_layer_config *layer_cfg; /* NULL: every layer full causal; else
                                  [n_layers], copied by pkv_engine_create */
    /* Q8/Q4 integer dot products and the prefix cache (appended in soname 2) */
    uint32_t quant_dot;        /* 0: exact; 1: integer dot products (PKV_Q8/PKV_Q4 pages
                                  only): each query head is rounded per block of 32 to
                                  int8 with its own scale and scored against the K rows'
                                  integers (error bound: docs/numerics.md); the weighted
                                  V sum stays exact. Bitwise identical across threads,
                                  batch and prefill as on the exact path. An f32, f16 or
                                  bf16 engine with quant_dot 1 is PKV_EINVAL
                                  (pkv_config_explain says why); > 1 is PKV_EINVAL. */
    uint64_t prefix_cache_bytes; /* reusable pages that no live session holds are kept
                                  up to this many bytes, least recently used dropped
                                  first; 0 = only pages of live sessions are reusable.
                                  Under mem_budget they go before any live page is
                                  spilled: dropped, or spilled first with a spill_dir */
} pkv_config;

/* All-zero geometry, PKV_F32, defaults elsewhere. Callers start here and set the
 * geometry, so that fields appended later keep their defaults. */
PKV_API pkv_config pkv_config_default(void);

/* Why pkv_engine_create would refuse cfg: the one validation create runs (the rules
 * are listed at pkv_engine_create, the environment variables PKV_FORCE_ISA and
 * PKV_PREFETCH included) and its status, writing a one-line English reason into why
 * (why_size bytes, NUL-terminated, cut to fit; "" on PKV_OK). why may be NULL; with
 * why_size 0 nothing is written. Every config create refuses with PKV_EINVAL, explain
 * refuses with PKV_EINVAL and a reason. Creates nothing and allocates nothing;
 * thread-safe. PKV_OK does not promise creation: memory and the spill file can still
 * fail (PKV_ENOMEM, PKV_EIO). PKV_EINVAL for cfg NULL. */
PKV_API pkv_status pkv_config_explain(const pkv_config *cfg, char *why, size_t why_size);

/* ==== 3. The engine ================================================================= */

typedef struct pkv_engine  pkv_engine;
typedef struct pkv_session pkv_session;

/* Validate cfg and create an engine.
 * PKV_EINVAL: cfg or out NULL; a geometry field 0; n_heads % n_kv_heads != 0; unknown
 *   dtype; scale negative or not finite; page size overflowing or absurd (> 1 GiB);
 *   beyond the engine's limits (n_layers > 65536, n_heads / n_kv_heads > 256,
 *   n_kv_heads > 65536, head_dim or head_dim_v > 4096, n_threads > 1024); a budget
 *   smaller than one page; spill_dir not an existing directory; quant_dot > 1, or 1
 *   without PKV_Q8/PKV_Q4 pages; a layer_cfg entry with sink_tokens or
 *   rollback_tokens but no window, a negative or non-finite softcap, a non-finite
 *   sink logit, or more sink_tokens than 64 split-K chunks hold (64 * ceil(512 /
 *   block_tokens) * block_tokens: 32768 at block_tokens 16); a layer_cfg entry with
 *   bad rope fields (rope not 0, PKV_ROPE_NORM or PKV_ROPE_NEOX; rope_dims odd or
 *   above head_dim, or 0 with an odd head_dim; rope_theta or rope_freq_scale negative
 *   or not finite; any of them set without rope); PKV_FORCE_ISA naming
 *   kernels this host cannot run; PKV_PREFETCH set to anything but l1 or l2.
 *   pkv_config_explain says which.
 * PKV_ENOMEM: the allocator failed. PKV_EIO: the spill file could not be created. */
PKV_API pkv_status pkv_engine_create(const pkv_config *cfg, pkv_engine **out);
/* Destroy the engine and everything it owns. Sessions still alive are destroyed
 * here and their handles become invalid (calling pkv_session_destroy on one of them
 * afterwards is a use after free): destroy every session first. NULL: no-op. The
 * allocator state that outlives an engine: "Process-wide state" above. */
PKV_API void pkv_engine_destroy(pkv_engine *e);
/* The configuration the engine runs with (defaults resolved: block_tokens, scale,
 * n_threads). spill_dir and layer_cfg point into the engine. PKV_EINVAL for NULL. */
PKV_API pkv_status pkv_engine_config(const pkv_engine *e, pkv_config *out);

typedef struct {
    const char *isa;           /* kernels in use: "scalar", "avx2", "avx2vnni", "avx512",
                                  "avx512vnni", "neon", "neon_dotprod" */
    const char *io_backend;    /* "io_uring", "sync", or "none" without spill_dir */
    uint64_t pages_in_use, pages_free, pages_spilled;
    uint64_t page_bytes;       /* bytes of one page (the formula in the glossary) */
    uint64_t bytes_allocator;  /* what jemalloc reports for this engine's arena:
                                  its pages in use and free, each rounded up to its
                                  size class (without jemalloc: those pages' bytes) */
    uint64_t mem_budget;
    /* the prefix cache (docs/prefix-cache.md) */
    uint64_t pages_cached;     /* pages in memory kept only for reuse (no live session
                                  holds them; spilled ones count in pages_spilled):
                                  pages_in_use + pages_cached + pages_free is what the
                                  pool holds */
    uint64_t prefix_lookups;   /* pkv_session_from_prefix calls that succeeded */
    uint64_t prefix_hit_tokens;/* positions they shared, summed (one per position, not
                                  per layer) */
    /* the page pool's allocator: "jemalloc" (a private arena of the jemalloc found at
       run time, see "Process-wide state") or "aligned" (aligned_alloc) */
    const char *pool;
    /* pages read by the attention calls (decode, batch, prefill, the shard calls,
       verify) since the engine was created, a page counted once per read however many
       groups, heads or threads it served (appended in soname 3) */
    uint64_t pages_read_shared;  /* reads that served several queries of one call at
                                    once: the sessions of one pkv_decode_batch that hold
                                    the page (forks, prefix-cache sessions), the drafts
                                    of one pkv_verify, a pkv_prefill tile's queries */
    uint64_t pages_read_private; /* reads that served one query */
    uint64_t page_reads_saved;   /* reads that sharing spared: a page read once for k
                                    queries counts k - 1 (what separate calls add) */
} pkv_stats;
/* Engine-wide figures; safe to call from any thread. PKV_EINVAL for NULL. */
PKV_API pkv_status pkv_engine_stats(const pkv_engine *e, pkv_stats *out);
/* The reason of the most recent failed call on e or on one of its sessions, as one
 * English line that starts with that call's name (e.g. "pkv_decode: layer 3 is
 * empty"), into buf (size bytes, NUL-terminated, cut to fit; "" before any failure).
 * How a caller knows the reason is its own: every failing call records one before
 * it returns and calls that succeed leave it as it was, so read right after a failure
 * it is that failure's, unless another thread failed on the same engine in between
 * (then it is one of theirs: the name at its start tells). A failure with no engine
 * to reach (a NULL session or engine) records nothing. This call records nothing
 * either. PKV_EINVAL for e or buf NULL, or size 0 (buf untouched); size 1 gives "". */
PKV_API pkv_status pkv_engine_last_error(const pkv_engine *e, char *buf, size_t size);

/* ==== 4. Sessions =================================================================== */

/* A new, empty session. PKV_EINVAL (NULL args), PKV_ENOMEM. */
PKV_API pkv_status pkv_session_create(pkv_engine *e, pkv_session **out);
/* A new session that shares every page of src by reference (O(pages), no copy): the
 * same lengths, holes, token record and shard start. The first append into a shared,
 * partly filled page copies that page only. PKV_EINVAL, PKV_ENOMEM (src unchanged),
 * PKV_ESTATE while src has pending drafts (pkv_verify; commit first). */
PKV_API pkv_status pkv_session_fork(pkv_session *src, pkv_session **out);
/* Release the session's references to its pages. NULL: no-op. Destroying a session
 * twice, or after its engine was destroyed, is undefined (see "Lifetimes"). */
PKV_API void pkv_session_destroy(pkv_session *s);

/* Cached positions of `layer` (a shard's count from 0: first + appended); 0 for NULL
 * or a layer >= n_layers. Every appended position counts, also those a window has
 * released. */
PKV_API uint64_t pkv_session_len(const pkv_session *s, uint32_t layer);
/* Every layer keeps min(its length, n_tokens); whole pages past the end are released
 * and the token record (pkv_session_set_tokens) is cut to n_tokens.
 *   - n_tokens 0 empties every layer (a shard: PKV_ERANGE, below its first position);
 *     n_tokens >= the longest layer's length changes nothing then; above every
 *     layer's length (UINT64_MAX included) is PKV_ERANGE.
 *   - A windowed layer (window w, rollback_tokens r, block_tokens bt, S sink pages)
 *     goes back only to where every position a decode at n_tokens - 1 reads is still
 *     held. Once the layer's length reached L, its pages below P = floor((L - w - r)
 *     / bt) * bt positions, the sink pages aside, are released for good; a truncate
 *     to n is allowed when n - w >= P or n <= S * bt, and PKV_ERANGE otherwise. So the
 *     rollback allowance counts from the longest length reached, not from the current
 *     one: with bt 1, after L appends a truncate to L - r is allowed, and after that
 *     truncate and one more append, a truncate to L - r - 1 is PKV_ERANGE.
 *   - A shard (pkv_session_set_first) is never cut below its first position:
 *     PKV_ERANGE.
 * PKV_EINVAL for NULL; PKV_ESTATE while drafts are pending (pkv_verify; commit
 * first). On failure nothing changed. */
PKV_API pkv_status pkv_session_truncate(pkv_session *s, uint64_t n_tokens);

typedef struct {
    uint64_t tokens;           /* sum over layers of cached positions */
    uint64_t blocks;           /* pages this session references */
    uint64_t bytes_resident;   /* bytes of those pages now in memory */
    uint64_t bytes_shared;     /* part of bytes_resident shared with other sessions */
    uint64_t bytes_spilled;    /* bytes of this session's pages now on disk */
    uint64_t bytes_ideal;      /* what an unpaged cache of exactly these tokens needs
                                  (a windowed layer: of the positions it must keep,
                                  its sinks and its last window + rollback ones) */
    uint64_t bytes_overhead;   /* block tables and other bookkeeping */
} pkv_memory;
/* Exact memory figures of one session. PKV_EINVAL for NULL. */
PKV_API pkv_status pkv_session_memory(const pkv_session *s, pkv_memory *out);

/* -- context shift (docs/rope.md): dropping positions, needs RoPE in the engine -- */

/* Drop positions [p0, p1) of every layer of s: positions from p1 on move down by
 * p1 - p0 and attend as if they had always been there - their keys are turned back by
 * p1 - p0 positions (re-rotated), their values copied unchanged - so a decode at the new
 * end sees what a session that had appended those rows at their new positions sees,
 * within the rounding below. This is llama.cpp's context shift (seq_rm + seq_add): keep
 * the first n_keep positions, drop the next n_discard, continue.
 *
 * Per layer of length len: len <= p0, nothing; p0 < len <= p1, truncated to p0 (no
 * rotation needed); len > p1, shifted: len becomes len - (p1 - p0). Pages that held only
 * dropped positions are released; the rows that move are rewritten inside the session's
 * own pages, and a page shared with a fork or the prefix cache is copied first (the
 * other holders keep theirs). Pages wholly below p0 stay shared. Cost: O(rows that
 * move) per layer, no more than appending them again (docs/rope.md has the figures).
 * The token record (pkv_session_set_tokens) ends at p0, and cannot be extended past p0
 * again until a truncate to p0 or below: the moved K/V is not what those ids give from
 * scratch, so it must not serve prefix-cache hits (pkv_session_set_tokens past that is
 * PKV_ESTATE).
 *
 * Rounding: re-rotated keys are rounded to the storage dtype again, and a key that moves
 * n times carries n + 1 roundings. They can add up coherently (the same turn, rounded
 * the same way, each time), so the drift from a key rotated exactly at its final
 * position grows about linearly with n: f32 by about 2e-8 of |k| per shift (the f32
 * cos/sin of the shift); f16, bf16, Q8 and Q4 by up to one rounding of their type per
 * shift (after 100 shifts Q4 keys are noise, bf16 and Q8 ones off by about 10%).
 * docs/rope.md has the figures after 1, 10 and 100 shifts; a cache that shifts often
 * belongs in f32 or f16. Values are copied, never rounded again.
 *
 * Variants: a windowed layer may lose nothing a decode at its new end, or after a
 * truncate of up to rollback_tokens, would read: positions it had released and that
 * land below its new window are simply gone (a discard below the window's start drops
 * what the window had released); a discard that would bring released positions back
 * into the window, or into its sinks, is PKV_ERANGE. A shard (pkv_session_set_first):
 * [p0, p1) must lie at or above its first position, else PKV_ERANGE. Spill engines:
 * the layers' pages from p0 on are brought back into memory first, all of them at once
 * (they must fit mem_budget together with the copies of shared pages).
 *
 * Statuses; a failed call changes nothing (lengths, contents, sharing, the record):
 *   PKV_OK      also for p0 == p1 <= the longest layer (nothing to do).
 *   PKV_EINVAL  s NULL; p0 > p1; a layer holding positions >= p1 has no rope (its keys
 *               cannot be re-rotated).
 *   PKV_ERANGE  p1 beyond every layer's length; a shard's first position above p0; a
 *               windowed layer as above.
 *   PKV_ENOMEM  pages for the copies (under the budget, after spilling) or bookkeeping.
 *   PKV_EIO     spilled pages could not be read back.
 * One session, one thread (like every call on a session); other sessions of the engine
 * may be used meanwhile. */
PKV_API pkv_status pkv_session_discard(pkv_session *s, uint64_t p0, uint64_t p1);

/* -- the prefix cache (docs/prefix-cache.md): sessions by token ids -- */

/* Record the token ids of positions [0, n) of s (tokens[0..n); n <= every layer's
 * length, else PKV_ERANGE): every page index whose positions are covered, on every
 * layer, becomes reusable by later sessions (pkv_session_from_prefix), held by the
 * engine's prefix index as well as by s. Repeated calls extend the record: ids
 * already recorded must be given again unchanged (a call with n at or below the
 * record's length only compares); pkv_session_truncate shortens the record, a fork
 * inherits it, pkv_session_save stores it. A windowed layer's page that its window
 * has released cannot be shared; a page index is then reusable only by a prefix
 * whose sessions would not read that page either (docs/prefix-cache.md).
 * n 0 records nothing (tokens may be NULL); n above any layer's length (UINT64_MAX
 * included) is PKV_ERANGE before tokens is read.
 * PKV_EINVAL (s NULL; tokens NULL with n > 0; ids that differ from the recorded
 * ones), PKV_ERANGE, PKV_ESTATE (n past the p0 of a pkv_session_discard, until a
 * truncate to p0 or below), PKV_ENOMEM; the record and the index unchanged on
 * failure. */
PKV_API pkv_status pkv_session_set_tokens(pkv_session *s, uint64_t n, const int32_t *tokens);
/* A new session sharing (as a fork does, O(pages), no copy) the longest cached prefix
 * of tokens[0..n) in whole pages of every layer, at most n - 1 positions so the
 * caller always runs its last token; *n_cached is its length (0: a new empty
 * session), a multiple of block_tokens. A match compares the stored ids of every
 * position, never a hash alone; ids are read a page at a time only while they match
 * the cache (so any n, up to UINT64_MAX, costs what the match does). The new
 * session's record is tokens[0..*n_cached); it decodes bitwise identically to a
 * session that appended the same K/V. n 0 or 1 gives a new empty session.
 * PKV_EINVAL (e, out or n_cached NULL; tokens NULL with n > 0), PKV_ENOMEM; nothing
 * changes on failure (*out and *n_cached untouched). */
PKV_API pkv_status pkv_session_from_prefix(pkv_engine *e, uint64_t n, const int32_t *tokens,
                                           pkv_session **out, uint64_t *n_cached);

/* ==== 5. Attention calls ============================================================ */

/* Append one token's K ([n_kv_heads][head_dim] floats) and V ([n_kv_heads][head_dim_v]:
 * head_dim unless the config sets head_dim_v) to `layer`, at position
 * pkv_session_len(s, layer). Cached data never moves. A layer holds at most
 * UINT64_MAX - block_tokens positions (PKV_EINVAL past that).
 * PKV_EINVAL (NULL, layer >= n_layers), PKV_ENOMEM (no page under the budget after
 * spilling; session unchanged), PKV_EIO (a spilled tail page could not be read back;
 * session unchanged). */
PKV_API pkv_status pkv_append(pkv_session *s, uint32_t layer, const float *k,
                              const float *v);
/* Append n tokens (k, v [n][g][d] and [n][g][dv]) to `layer` and write each one's
 * attention output (q [n][h][d], out [n][h][dv]): bitwise identical to n calls of
 * append + decode, but faster: the queries of one page are attended together, so each
 * cached row is read once per page of queries. Everything the call needs (a scratch
 * buffer, the layer's pages back from the spill file, every new page and the copy of
 * a shared tail page) is taken before any row is written, so a failed call changes
 * nothing: PKV_EINVAL (NULL, layer >= n_layers, n 0, a length past UINT64_MAX -
 * block_tokens), PKV_ENOMEM (scratch, budget), PKV_EIO (spilled pages could not be
 * read back); `out` is untouched then. Any n >= 1 works (the arrays must hold n
 * rows). */
PKV_API pkv_status pkv_prefill(pkv_session *s, uint32_t layer, uint32_t n, const float *q,
                               const float *k, const float *v, float *out);
/* Single-query attention of q ([n_heads][head_dim]) at the layer's last position over
 * every cached token of `layer` it attends (its layer_cfg: a window, sinks, soft-cap,
 * sink logits; docs/variants.md); out is [n_heads][head_dim_v]. A shard attends its
 * own positions only (docs/sharding.md). Never allocates for a resident session.
 * PKV_EINVAL (NULL, layer >= n_layers), PKV_ESTATE (layer empty), PKV_EIO/PKV_ENOMEM
 * (spilled pages could not be brought back; nothing changed).
 * Decode holds every page of the layer in memory at once. With a spill_dir, appends
 * may grow one layer past mem_budget (the rest spills); such a layer cannot be
 * decoded: every pkv_decode of it is PKV_ENOMEM until it is truncated back within the
 * budget. Keep ceil(len / block_tokens) * page_bytes of every layer <= mem_budget. */
PKV_API pkv_status pkv_decode(pkv_session *s, uint32_t layer, const float *q, float *out);
/* Decode one query per session (q [n][h][d], out [n][h][dv]) on the engine's
 * threads: bitwise identical to n calls of pkv_decode. The sessions must be distinct
 * and belong to e. Any n >= 1 works (runs of 64 sessions; beyond 64, checking for
 * duplicates takes a sorted copy of the list).
 * A page held by several sessions of the batch (forks, prefix-cache sessions) is read
 * once for all of their query heads (pkv_stats.pages_read_shared), with the same bits.
 * PKV_EINVAL (NULL, n == 0, layer >= n_layers, a session twice or of another engine),
 * PKV_ESTATE (a session's layer is empty), PKV_ENOMEM (the copy above; or, as for
 * pkv_decode, spilled pages could not be brought back), PKV_EIO. On failure out is
 * unspecified and no session is changed. */
PKV_API pkv_status pkv_decode_batch(pkv_engine *e, uint32_t layer, uint32_t n,
                                    pkv_session *const *sessions, const float *q,
                                    float *out);

/* -- RoPE in the engine (docs/rope.md) -- */
/* A layer whose pkv_layer_config sets `rope` rotates its keys itself: pkv_append,
 * pkv_prefill and pkv_verify take k before rotation and the engine turns each key at
 * its position when it stores it (pkv_session_len before the call plus its row; for
 * pkv_verify's draft i, len + depth(i)); the caller rotates the queries of that layer
 * with pkv_rope_q, which turns them exactly as the keys are turned. Values are never
 * rotated. Layers without rope behave as before: the caller rotates q and k.
 *
 * The rotation: the first rope_dims values of every head rotate as rope_dims/2 pairs
 * (PKV_ROPE_NORM: (2i, 2i+1); PKV_ROPE_NEOX: (i, i + rope_dims/2)); pair i at position
 * p turns by the angle p * f_i, f_i = rope_freq_scale * rope_theta^(-2i / rope_dims),
 * (x, y) -> (x cos - y sin, x sin + y cos). Accuracy against the exact rotation: each
 * rotated pair is within 2^-20 * |(x, y)| (about 1e-6 relative) for positions below
 * 2^24, plus p * f_i * 2^-52 of angle beyond (the resolution of a double angle; at
 * p = 2^40 with f_i = 1 that is 2^-12 radians). docs/rope.md has the method (tables of
 * cos/sin per base-64 digit of the position, built once per engine in double, stored in
 * f32) and which models use which style.
 *
 * Which style follows the weights' layout, not the model's name: PKV_ROPE_NORM for
 * llama2.c checkpoints, GPT-J and llama.cpp's "llama" GGUF files (its converter permutes
 * Wq and Wk of Llama and Mistral into adjacent pairs); PKV_ROPE_NEOX for Hugging Face
 * checkpoints (rotate_half: Llama 2/3, Mistral, Qwen, Gemma, Phi-3) and GGUF files of
 * Qwen, Gemma, Phi-3, Falcon and GPT-NeoX. */

/* Rotate query rows q [n][n_heads][head_dim] of `layer` in place, row j at position
 * pos[j] (any uint64_t), exactly as the engine rotates the keys it stores for that layer
 * (the same bits for the same position). A layer without rope: q is left as it is (its
 * keys are stored as given). n == 0 does nothing (pos and q may then be NULL). Reads
 * only immutable tables: thread-safe, any number of threads at once. Never allocates.
 * PKV_EINVAL: e NULL, layer out of range, pos or q NULL with n > 0. */
PKV_API pkv_status pkv_rope_q(const pkv_engine *e, uint32_t layer, uint32_t n,
                              const uint64_t *pos, float *q);
/* -- speculative verify and commit (docs/speculative.md) --
 * A speculative decoder proposes several tokens at once - a chain, or a tree of
 * candidate continuations sharing their prefixes (EAGLE, Medusa, SpecInfer) - runs the
 * model over all of them in one step, and keeps the longest run the model agrees
 * with. pkv_verify is that step's attention on one layer; pkv_session_commit keeps
 * the accepted path on every layer.
 *
 * Bitwise: for any root-to-node path, the outputs pkv_verify gave its drafts, and
 * every decode after pkv_session_commit keeps that path, are to the bit what
 * pkv_append + pkv_decode of the same rows, token by token, give (any n_threads, every
 * dtype and quant_dot path, every variant, shards). For a chain (parent[i] = i - 1)
 * that holds for every draft: verify of a chain is a prefill that can be taken back.
 *
 * Pending drafts. A verified layer holds its drafts' rows (in pages of the layer,
 * counted in pkv_session_memory's blocks, bytes_resident and bytes_ideal, and in the
 * budget; not in tokens) until pkv_session_commit; pkv_session_len does not move.
 * While a layer has pending drafts:
 *   pkv_verify of it               replaces its drafts (all of them);
 *   pkv_append, pkv_prefill of it  PKV_ESTATE, nothing changed (other layers: as ever);
 *   pkv_decode, pkv_decode_batch,
 *   pkv_decode_partial(_at)        attend its cached positions only, as its length says;
 *   pkv_session_fork, pkv_session_truncate, pkv_session_save,
 *   pkv_session_discard            PKV_ESTATE (for any pending layer), nothing changed;
 *   pkv_session_set_tokens         records ids of cached positions, as ever;
 *   pkv_session_destroy            releases the drafts with the rest.
 * RoPE (docs/rope.md): on a layer with the engine's rope, draft i's key is turned at
 * position len + depth(i) - the position it stands for, not the slot it is stored in -
 * so a committed path holds exactly the keys pkv_append would have stored there; rotate
 * draft i's queries with pkv_rope_q at that same position.
 * Threads: as every session call - one thread at a time per session. */

/* Most drafts of one pkv_verify. */
#define PKV_VERIFY_MAX_DRAFTS 1024u

/* Verify n draft tokens of `layer` as a tree: parent[i] < i is draft i's parent, or -1
 * for a child of the last cached position; draft i sits at position len + depth(i)
 * (depth 0 for parent -1; len = pkv_session_len(s, layer)) and attends to the cached
 * positions and its ancestors, itself included, with every variant of the layer (a
 * window counted from its own position, sinks, sink logits, soft-cap, head_dim_v).
 * Shapes: parent [n]; q [n][n_heads][head_dim]; k [n][n_kv_heads][head_dim]; v
 * [n][n_kv_heads][head_dim_v]; out [n][n_heads][head_dim_v] (draft i's attention
 * output; no two arrays may overlap out). All are read during the call only (the tree
 * is copied for pkv_session_commit). The drafts stay pending: pkv_session_len does not
 * move until pkv_session_commit; a second verify of the same layer replaces its
 * pending drafts. A verify of an empty layer (len 0, or a shard's first position) is
 * allowed: its drafts attend each other only.
 * Extremes: n 1 is a decode of one appended token that can be taken back; n from 1
 * to PKV_VERIFY_MAX_DRAFTS works (any tree shape: a chain of 1024, or 1024 roots); n 0
 * and n > PKV_VERIFY_MAX_DRAFTS (UINT32_MAX included) are PKV_EINVAL before any array
 * is read. parent[i] must lie in [-1, i - 1]: -2, INT32_MIN, i and above are
 * PKV_EINVAL. A layer holding 2^63 positions or more is PKV_EINVAL.
 * Cost: the cached pages are read once per tile of min(n, 256 / (n_heads/n_kv_heads))
 * drafts (once per draft on a windowed layer); each draft off the chain prefix (index
 * != depth) takes one page of scratch for the page of its position.
 * Everything is taken before anything is written (scratch, the layer's spilled pages
 * back, every page the drafts need and the copy of a shared last page), so a failed
 * call changes nothing: PKV_EINVAL (s, parent, q, k, v or out NULL; layer >= n_layers;
 * the n and parent rules above), PKV_ENOMEM (scratch, budget), PKV_EIO (spilled pages
 * could not be read back); out is untouched then. */
PKV_API pkv_status pkv_verify(pkv_session *s, uint32_t layer, uint32_t n,
                              const int32_t *parent, const float *q, const float *k,
                              const float *v, float *out);
/* Keep drafts path[0..n_keep) (a root-to-node path of the pending tree: path[0] has
 * parent -1, path[j + 1]'s parent is path[j]) on every layer that has pending drafts;
 * they become positions len .. len + n_keep - 1 of each (rows moved within the pages
 * where the tree put them elsewhere) and every other pending draft is released.
 * n_keep == 0 drops them all (path may then be NULL) and reads no spilled page, so it
 * fails only with PKV_ESTATE: a tree can always be abandoned. Layers without pending
 * drafts are untouched; the prefix cache's token record is not extended (record the
 * accepted tokens with pkv_session_set_tokens). path is read during the call only.
 * Extremes: n_keep from 0 to the pending tree's n (its deepest path's length at most,
 * since a path must be root-to-node); n_keep above n (UINT32_MAX included) is
 * PKV_EINVAL before path is read; an entry >= n (UINT32_MAX included) is PKV_EINVAL.
 * PKV_ESTATE: no drafts are pending, or the pending layers were verified with
 * different trees (n or parent); PKV_EINVAL: s NULL, n_keep > n, path NULL with
 * n_keep > 0, an entry >= n or not the child of the one before it (so no repeats);
 * PKV_EIO / PKV_ENOMEM (n_keep > 0): the pending layers' spilled draft pages (those
 * from the page of position len on; no other page is read) could not be brought
 * back. Nothing changes on failure (the drafts stay pending). Layers that hold
 * different trees are made one again by verifying them with the same tree. */
PKV_API pkv_status pkv_session_commit(pkv_session *s, uint32_t n_keep, const uint32_t *path);

/* ==== 6. Persistence: session files (docs/file-format.md) =========================== */

/* Write the session to `path` atomically (temporary file, fsync, rename, directory
 * fsync), mode 0600: every layer's positions and holes, the token record, a shard's
 * first position. The promise: a save either writes a file that loads and decodes
 * bitwise like the session, or fails and leaves the old file at path as it was -
 * before it commits anything, save runs the reader's own checks on what it wrote
 * (the header, the page table, the engine it must load into). Format versions: the
 * oldest that holds the session - 1 for a plain engine, 2 with attention variants or
 * Q8/Q4 pages, 3 when token ids are recorded (pkv_session_set_tokens), 4 for a
 * shard, 5 with the engine's RoPE or after pkv_session_discard. The engine's session files share one I/O ring (created on first use):
 * saves and loads of different sessions may run on different threads at once.
 * PKV_EINVAL (NULL, path ""; more layers than a file's header holds), PKV_ESTATE
 * (drafts are pending: pkv_verify; no file holds them, commit first), PKV_EIO,
 * PKV_ENOMEM, PKV_ECORRUPT (the file would not have passed load's checks: not written,
 * a library defect - please report it). A failing close or directory fsync after the
 * rename is PKV_EIO with the new file in place (durability unknown). */
PKV_API pkv_status pkv_session_save(pkv_session *s, const char *path);
/* Read a session file (format versions 1 to 5, docs/file-format.md) into a new
 * session of e; a version-3 or -4 file's token ids are recorded again (its full
 * pages are reusable by pkv_session_from_prefix), a version-4 or -5 file with a first
 * position is a shard again, a version-5 file keeps its discard limit on the record.
 * The whole file is validated before the session is built: PKV_EINVAL for a file that
 * is not a session file (magic, not a regular file), or a sound file of an unknown
 * version or of another geometry, dtype, block size, scale, attention variant, RoPE
 * or shard alignment; PKV_ECORRUPT for any other damage; PKV_EIO, PKV_ENOMEM; PKV_EINVAL
 * also for NULL or path "". Nothing is half-loaded. pkv_engine_last_error names the
 * cause. */
PKV_API pkv_status pkv_session_load(pkv_engine *e, const char *path, pkv_session **out);

/* What a session file says about itself, as far as it could be read and checked. */
typedef struct {
    uint32_t header_sound;     /* 1 once magic, version and header checksum matched */
    uint32_t version;          /* file format version (when header_sound) */
    uint32_t n_layers, n_heads, n_kv_heads, head_dim, block_tokens;
    pkv_dtype kv_dtype;
    float    scale;
    uint32_t head_dim_v;       /* width of V rows (version 2; head_dim in version 1) */
    uint32_t n_variant_layers; /* layers with a window, soft-cap or sink logits (v2) */
    uint64_t page_bytes;       /* bytes of one page in the file */
    uint64_t n_pages;          /* pages in the file, all layers */
    uint64_t data_offset;      /* file offset of page 0 */
    uint64_t file_bytes;       /* size of the file */
    uint64_t tokens;           /* sum over layers of cached positions */
    uint64_t bad_page;         /* file index of the first page that failed its checks,
                                  UINT64_MAX when none did */
    uint32_t bad_layer;        /* ... its layer, and its index in that layer */
    uint64_t bad_index;
    char     reason[160];      /* why the check failed ("" on PKV_OK) */
    uint64_t n_token_ids;      /* recorded token ids (version 3; 0 before) */
} pkv_file_info;
/* Check every byte of the session file at `path` (header, page table, every page's
 * checksum and padding) without an engine: the checks pkv_session_load makes, with
 * its statuses (PKV_OK, PKV_EINVAL, PKV_ECORRUPT, PKV_EIO, PKV_ENOMEM). `info` is
 * filled as far as the file could be read, also on failure. layer_len (may be NULL)
 * receives the positions of the first min(n_layers, max_layers) layers: max_layers 0
 * writes none, any larger value than the file's n_layers writes n_layers.
 * PKV_EINVAL also for NULL path or info, or path "". */
PKV_API pkv_status pkv_session_file_check(const char *path, pkv_file_info *info,
                                          uint64_t *layer_len, uint32_t max_layers);

/* ==== 7. Shards: one context over several engines (docs/sharding.md) ================ */
/* The library has no MPI in it: these calls let a program (the tools use MPI) cut one
 * context into shards held by different engines - one per machine - and still get,
 * bitwise, what one engine holding the whole gives.
 *
 * Split-K chunks are absolute: chunk c holds positions [c * A0, (c + 1) * A0) of a
 * layer, A0 = block_tokens * the engine's chunk size (512 tokens rounded up to whole
 * pages), whatever the length. A shard starts at a multiple of pkv_shard_align, so
 * every chunk lies in one shard; a decode folds its chunk states in position order,
 * and the states of all shards, concatenated in position order and folded by
 * pkv_merge_partials, are the same fold. Engines of the shards must have the same
 * configuration (geometry, dtype, block_tokens, layer_cfg); n_threads may differ.
 *
 * A shard's positions are absolute: after pkv_session_set_first(s, F) and n appends,
 * pkv_session_len is F + n, and pkv_session_truncate below F is PKV_ERANGE. Variants
 * (docs/variants.md): positions below sink_tokens and the sink-logit state live on the
 * shard that starts at 0 (pkv_shard_align is at least every windowed layer's
 * sink_tokens): only its partial states begin with the sink-logit state, so it is
 * folded exactly once. A windowed layer's window is counted from the query's
 * position: a shard that holds earlier positions than the query is asked with
 * pkv_decode_partial_at. A shard's pkv_decode is the attention over its own positions
 * (its sink logits only when it starts at 0). A shard saves and loads like any
 * session (file format version 4); a fork of a shard is a shard.
 *
 * One state is m, l, acc[head_dim_v] per query head: softmax over the chunk's scores
 * s_j is m = max s_j, l = sum e^(s_j - m), acc = sum e^(s_j - m) v_j; an empty state
 * (nothing attended) is m = -inf, l = 0, acc = 0. */

/* Positions a shard's first position must be a multiple of: block_tokens times the
 * split-K chunk in pages, times enough to cover every windowed layer's sink_tokens.
 * Fixed by the engine's configuration, never by any session's length. 0 for NULL. */
PKV_API uint64_t pkv_shard_align(const pkv_engine *e);
/* Make s, still empty (no layer holds a position), a shard whose first cached position
 * is `first`, a multiple of pkv_shard_align(e); first = 0 is a whole session (no-op).
 * The positions below `first` cost no page (the block table names none of them; its
 * entries cost 16 bytes per page of them, so a far `first` is PKV_ENOMEM). first
 * above 2^63 - 1 (UINT64_MAX included) is PKV_EINVAL. PKV_EINVAL (NULL, first not
 * aligned), PKV_ESTATE (s not empty), PKV_ENOMEM; nothing changes on failure. */
PKV_API pkv_status pkv_session_set_first(pkv_session *s, uint64_t first);
/* Partial states of q ([n_heads][head_dim]) over this session's cached positions of
 * `layer` that a decode at its last position attends, one per split-K chunk, in
 * position order: states [n_chunks][n_heads][head_dim_v + 2] (m, l, acc). A session
 * that starts at 0 on a layer with sink logits puts the sink-logit state (sigma_i, 1,
 * 0) first; it counts as a chunk. PKV_EINVAL (NULL, layer >= n_layers), PKV_ESTATE
 * (layer empty), PKV_ERANGE when more than max_chunks states would be written (then
 * *n_chunks is the number needed - UINT32_MAX if more - and states is untouched:
 * max_chunks 0 asks how many; any larger max_chunks is fine), PKV_EIO / PKV_ENOMEM
 * (spilled pages could not be brought back). Never allocates for a resident session. */
PKV_API pkv_status pkv_decode_partial(pkv_session *s, uint32_t layer, const float *q,
                                      uint32_t max_chunks, float *states,
                                      uint32_t *n_chunks);
/* pkv_decode_partial for a query at absolute position pos >= the layer's last one
 * (a shard holding earlier positions than the query's shard): on a windowed layer the
 * window is pos + 1 - window .. pos, so a shard far behind gives only its sinks (or no
 * state: *n_chunks = 0). Without a window the same as pkv_decode_partial. pos is
 * checked before any arithmetic: every pos from the layer's last position to
 * UINT64_MAX - 1 is valid (2^63: the sinks alone, on a windowed layer); a pos before
 * the layer's last position, or UINT64_MAX (no layer reaches it), is PKV_EINVAL with
 * nothing written. Other statuses as there. */
PKV_API pkv_status pkv_decode_partial_at(pkv_session *s, uint32_t layer, uint64_t pos,
                                         const float *q, uint32_t max_chunks,
                                         float *states, uint32_t *n_chunks);
/* How many states pkv_decode_partial of `layer` writes now (0 for an empty layer):
 * the max_chunks a caller sizes states by. PKV_EINVAL (NULL, layer >= n_layers). */
PKV_API pkv_status pkv_partial_chunks(const pkv_session *s, uint32_t layer, uint64_t *out);
/* Fold n_chunks partial states (in position order) into out [n_heads][head_dim_v],
 * in the order pkv_decode merges its own: from the empty state, each state folded in
 * turn, then acc / l (0 for a head whose states are all empty). Any n_chunks >= 1
 * (states must hold that many). PKV_EINVAL (NULL, n_chunks == 0). */
PKV_API pkv_status pkv_merge_partials(const pkv_engine *e, uint32_t n_chunks,
                                      const float *states, float *out);
/* The fold of pkv_merge_partials without the final division: state_out [n_heads]
 * [head_dim_v + 2] is one state (m, l, acc) that stands for the n_chunks states, in
 * position order. Folding it first and then later states is, to the bit, the fold of
 * all of them (a chain of shards passes one state along instead of every chunk's:
 * docs/sharding.md). state_out may alias states. PKV_EINVAL (NULL, n_chunks == 0),
 * PKV_ENOMEM. */
PKV_API pkv_status pkv_fold_partials(const pkv_engine *e, uint32_t n_chunks,
                                     const float *states, float *state_out);

/* ==== 8. Introspection (what `pagedkv inspect` and `pagedkv soak` are built on) ===== */

/* One entry of a layer's block table. */
typedef struct {
    uint64_t id;               /* identifies the page while it lives: two entries with
                                  one id (in any sessions) are one shared page; 0 for
                                  an entry that names no page (a window released it,
                                  or it lies below a shard's first position) */
    uint32_t refs;             /* block-table entries naming it, over all sessions */
    uint32_t resident;         /* 1 in memory, 0 in the spill file */
} pkv_page_info;
/* Entries [first, first + n) of `layer`'s block table (clipped to its pages: first at
 * or past the last page, UINT64_MAX included, writes none; any n, UINT64_MAX
 * included, writes at most the pages there are); *n_out (may be NULL) is how many
 * were written. Pages are position-ordered: entry i holds positions [i * block_tokens,
 * (i + 1) * block_tokens). PKV_EINVAL for NULL s, layer >= n_layers, or out NULL with
 * n > 0. Safe while other threads use other sessions. */
PKV_API pkv_status pkv_session_pages(const pkv_session *s, uint32_t layer, uint64_t first,
                                     uint64_t n, pkv_page_info *out, uint64_t *n_out);

/* Check the engine's invariants (docs/design.md: page counts, reference counts,
 * budget, block-table shape). PKV_OK when they hold, PKV_ECORRUPT when one is broken
 * (a library defect: please report it), PKV_EINVAL for NULL. Takes the engine lock;
 * meant for tests and soak runs, O(pages of all sessions). Call it while no other
 * thread is inside a call on this engine's sessions. */
PKV_API pkv_status pkv_engine_check(pkv_engine *e);

/* ==== 9. Dense oracles: the reference semantics ===================================== */
/* Engine-free, in double precision, allocating their own scratch. Parameter names are
 * lower-case throughout this header, so a user's single-letter macros such as -DT=1
 * or -DK=2 cannot collide with them. Zero sizes are PKV_EINVAL; sizes whose products
 * overflow are PKV_EINVAL before any buffer is read; out is untouched on failure. */

/* The dense oracle of every variant, in double: q [T][h][head_dim], k [T][g][head_dim],
 * v [T][g][head_dim_v], out [T][h][head_dim_v] (T = n_tokens); lc NULL = full causal;
 * head_dim_v 0 = head_dim; scale 0 = 1/sqrt(head_dim). For head i at position t:
 *   s_j = scale * q_i . k_j, then s_j = c * tanh(s_j / c) when softcap c > 0;
 *   attended A = { j <= t : j > t - window } u { j < sink_tokens } (all j <= t when
 *   window == 0); with a sink logit sigma_i (else sigma_i = -inf):
 *   out_i = sum_A e^(s_j - m) v_j / (sum_A e^(s_j - m) + e^(sigma_i - m)),
 *   m = max(sigma_i, max_A s_j).
 * pkv_causal_attention is this with lc NULL and head_dim_v = head_dim. lc's rope
 * fields are not applied: the oracle takes q and k already rotated.
 * PKV_EINVAL for NULL arrays, zero sizes, h % g != 0, a bad scale, sink_tokens or
 * rollback_tokens without a window, a negative or non-finite softcap, a non-finite
 * sink logit, overflowing sizes; PKV_ENOMEM. */
PKV_API pkv_status pkv_attention_reference(uint32_t n_tokens, uint32_t n_heads,
                                           uint32_t n_kv_heads, uint32_t head_dim,
                                           uint32_t head_dim_v, float scale,
                                           const pkv_layer_config *lc, const float *q,
                                           const float *k, const float *v, float *out);
/* Dense reference, accumulating in double: causal attention over T = n_tokens tokens,
 * q [T][h][d], k, v [T][g][d], out [T][h][d]; scale 0 means 1/sqrt(d).
 * PKV_EINVAL for NULL, zero sizes, h % g != 0, a negative or non-finite scale,
 * overflowing sizes; PKV_ENOMEM. */
PKV_API pkv_status pkv_causal_attention(uint32_t n_tokens, uint32_t n_heads,
                                        uint32_t n_kv_heads, uint32_t head_dim, float scale,
                                        const float *q, const float *k, const float *v,
                                        float *out);
/* The textbook multi-head attention layer with projections: x [T][d_model]
 * (T = n_tokens), wq [d_model][h*d], wk, wv [d_model][g*d], wo [h*d][d_model],
 * d = d_model / h; out is [T][d_model]. Projections and heads are computed in double;
 * out is rounded once at the end.
 * PKV_EINVAL for d_model % h != 0, h % g != 0, NULL, zero sizes, overflowing sizes;
 * PKV_ENOMEM. */
PKV_API pkv_status pkv_mha_forward(uint32_t n_tokens, uint32_t d_model, uint32_t n_heads,
                                   uint32_t n_kv_heads, const float *x, const float *wq,
                                   const float *wk, const float *wv, const float *wo,
                                   float *out);
/* 2 * layers * n_kv_heads * head_dim * seq_len * batch * bytes_per_value.
 * Zero factors give 0 (even when the others alone overflow); PKV_ERANGE if the
 * product overflows uint64; PKV_EINVAL for NULL. */
PKV_API pkv_status pkv_kv_cache_bytes(uint64_t layers, uint64_t n_kv_heads,
                                      uint64_t head_dim, uint64_t seq_len, uint64_t batch,
                                      uint64_t bytes_per_value, uint64_t *out);

/* ==== 10. Dtype helpers ============================================================= */

/* Bytes of one stored row of n values of dtype t (block types included: PKV_Q8 and
 * PKV_Q4 cut a row into blocks of 32 values, the last possibly shorter, each with an
 * f16 scale: 2 + 32 bytes and 2 + 16 bytes a full block, 8.5 and 4.5 bits a value;
 * docs/numerics.md has the format); 0 for an unknown dtype or n == 0. Any n up to
 * UINT32_MAX (the result fits a size_t on the 64-bit hosts the library supports). */
PKV_API size_t pkv_row_bytes(pkv_dtype t, uint32_t n);
/* What the cache gives back for a row of n values stored as t: dst = dequant(quant(src))
 * (for f32/f16/bf16 each value rounded alone). src and dst may be the same array.
 * Nothing happens for an unknown dtype, n == 0 or NULL. For Q8/Q4 a rounded row rounded
 * again can move (each block's scale is searched anew, each value within half a step):
 * append the values themselves, and keep rows rounded once as the reference. */
PKV_API void pkv_dtype_round_row(pkv_dtype t, uint32_t n, const float *src, float *dst);
/* Bytes of one stored value of dtype t (4, 2, 2); 0 for the block types and for an
 * unknown dtype. */
PKV_API size_t pkv_dtype_size(pkv_dtype t);
/* "f32", "f16", "bf16", "q8", "q4"; "?" for an unknown dtype. */
PKV_API const char *pkv_dtype_name(pkv_dtype t);
/* Round one float to dtype t (round-to-nearest-even) and back: what the cache stores
 * for f32/f16/bf16. Q8/Q4 round a whole row together (its blocks share scales): use
 * pkv_dtype_round_row; here x is rounded as a block of one. For tests and references.
 * Unknown dtype: x unchanged. */
PKV_API float pkv_dtype_round(pkv_dtype t, float x);

#ifdef __cplusplus
}
#endif
#endif /* PAGEDKV_H */

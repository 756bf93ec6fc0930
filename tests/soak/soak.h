/*
 * soak.h - what the two halves of `pagedkv-soak` share: soak/soak.c parses the options,
 * sets up the engine, runs the loop (checking the pool after every step) and reports;
 * soak/model.c keeps the model of every session and applies the random operations,
 * each checked against that model.
 *
 * Owns: the soak's state (options, engine, slots with their models, scratch buffers,
 * the first failure, the counters). Does not own anything in the library; the engine
 * and its sessions are the library's, reached through the public API alone (block
 * tables through pkv_session_pages, the invariants through pkv_engine_check).
 *
 * Invariants
 *   - slots[a].s == NULL exactly when slot a is free; a live slot has a model h[layers]
 *     with h[l].len == pkv_session_len(s, l) <= cap after every operation.
 *   - failed is set once, by soak_fail, with fail[] saying what differed; after that
 *     every check returns false and the run ends.
 *   - reads and drops count this op's spilled pages read back and dropped; c.alive
 *     is the number of live slots.
 */
#ifndef PKV_TOOLS_SOAK_H
#define PKV_TOOLS_SOAK_H

#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include "pagedkv.h"

#define SOAK_MAX_BATCH 64u /* sessions in one pkv_decode_batch call */
#define U64 "%" PRIu64    /* printf conversion of a uint64_t */
/* The split-K chunk of a decode, in tokens (docs/design.md: chunk_pages = 512 tokens'
 * worth, fixed per engine): a layer of more pages than ceil(512 / block_tokens) is
 * decoded in several chunks merged in a fixed order, which the soak counts. */
#define SOAK_CHUNK_TOKENS 512u

typedef struct {
    uint64_t ops, seed, budget_pages;
    double minutes;
    uint32_t sessions, threads, layers, heads, kv_heads, head_dim, block_tokens;
    uint32_t max_len, long_len;
    pkv_dtype dtype;
    const char *spill_dir;
    bool json, inject_bug, ops_set, minutes_set;
} soak_opts;

typedef struct {            /* the model of one layer of one session */
    float *k, *v;           /* [cap][g*d] K and V rows as stored (dtype-rounded) */
    uint32_t len;
} soak_hist;

typedef struct {
    pkv_session *s;         /* NULL: the slot is free */
    soak_hist *h;           /* [layers] */
    uint32_t cap;           /* longest history of this session (max_len or long_len) */
} soak_slot;

typedef struct {
    uint64_t created, forks, destroys, truncates, tokens, prefills, decodes, batches;
    uint64_t verifies, commits;
    uint64_t saves, inv_checks, ref_checks, bit_checks, expected_errors, split_decodes;
    uint64_t spill_written, spill_read, spilled_peak, alive, max_alive;
    double max_rel_err;     /* largest |out - ref| / max|V| seen */
} soak_counters;

typedef struct {
    soak_opts o;
    pkv_engine *e;
    pkv_config cfg;         /* as resolved by the engine */
    uint32_t kd, qd;        /* g*d, h*d */
    uint64_t page_bytes;
    soak_slot *slots;       /* [sessions] */
    uint64_t rng;
    float *q, *out, *out2;  /* [SOAK_MAX_BATCH][h*d] twice, then [h*d]; one allocation */
    float *k, *v;           /* [8][g*d] each; one allocation */
    double *w, *acc;        /* [longest cap] scores, then [d]; one allocation */
    pkv_page_info *pg;      /* [SOAK_MAX_BATCH * pages of the longest layer] */
    pkv_page_info *pi;      /* [n_pi] one layer's block table, read in pieces */
    uint64_t n_pi;
    char dir[512], save_path[600];
    bool own_dir, injected, failed;
    uint64_t op, reads, drops;       /* op number (1-based); this op's spill reads/drops */
    char fail[1024];
    soak_counters c;
} soak;

/* soak/model.c. Every bool function returns false after a failure, recorded by
 * soak_fail ("op N (seed S): ..." in S->fail; the first one only). */

/* Record the first failure; returns false so checks chain with `return soak_fail(...)`. */
bool soak_fail(soak *S, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Pages of a layer of len tokens. */
uint64_t soak_pages_of(const soak *S, uint64_t len);
/* q [h][d] with a random amplitude from the soak's generator. */
void soak_random_q(soak *S, float *q);
/* One random operation on a random slot, checked against the model. */
bool soak_step(soak *S);
/* Lengths and pkv_session_memory of slot a against the model. */
bool soak_check_lens(soak *S, uint32_t a);
/* pkv_decode of `layer` of slot a, checked against the reference on its model. */
bool soak_decode_checked(soak *S, uint32_t a, uint32_t layer, const float *q, float *out,
                         const char *what);
/* Destroy the slot's session (counting the spilled pages it drops) and its model. */
void soak_slot_clear(soak *S, soak_slot *sl);

#endif

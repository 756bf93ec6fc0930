/*
 * soak/model.c - the model half of `pagedkv-soak`: a trivial model of every session
 * (each layer's appended K/V rows, rounded as the cache stores them), a double-precision
 * reference decode over it, and the random operations (create, append, prefill, decode,
 * decode_batch, fork, verify + commit, truncate, destroy, save/load), each applied to
 * the engine and to the model and checked.
 *
 * Owns: the random generator's use, the models, the reference decode and its
 * tolerance, the bitwise comparisons, the operation mix (soak_step), the count of
 * spilled pages each operation reads back or drops (S->reads, S->drops), the first
 * failure (soak_fail) and the counters the operations bump.
 * Does not own: the options, the engine's setup, the checks between steps (pool
 * invariants, budget), the spill totals or the report (soak/soak.c). It reads block
 * tables through the public pkv_session_pages (page identity, residency, refs) and
 * never writes library state.
 *
 * Invariants
 *   - After each operation on slot a: pkv_session_len(s, l) == h[l].len <= cap for
 *     every layer, and pkv_session_memory matches the model (soak_check_lens).
 *   - Model rows are pkv_dtype_round_row of what was appended (row by row: a Q8/Q4
 *     row's scales are per 32 values of its own), so the reference decode
 *     sees the values the cache holds; a decode must be within 1e-5 * max|V| of it.
 *   - A history never passes its cap: an append that would is preceded by a truncate
 *     (make_room), so the model needs at most sessions * layers * cap * 2 * g * d floats.
 *   - An operation returns false only after soak_fail recorded why.
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cli.h"
#include "soak/soak.h"

/* ---- helpers: random numbers, failures, the model ------------------------------- */

static uint64_t rnd(soak *S)   /* xorshift64* */
{
    S->rng ^= S->rng >> 12;
    S->rng ^= S->rng << 25;
    S->rng ^= S->rng >> 27;
    return S->rng * 0x2545f4914f6cdd1dull;
}

static uint32_t below(soak *S, uint32_t n)
{
    return n ? (uint32_t)((rnd(S) >> 32) % n) : 0;
}

static void fill(soak *S, float *x, size_t n, float amp)   /* uniform in [-amp, amp) */
{
    for (size_t i = 0; i < n; i++)
        x[i] = amp * (float)((double)(rnd(S) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* q [h][d] with a random amplitude: peaked and flat softmax both get exercised. */
void soak_random_q(soak *S, float *q)
{
    static const float amp[] = {0.25f, 1.0f, 2.0f, 6.0f};
    fill(S, q, S->qd, amp[below(S, 4)]);
}

/* Record the first failure; returns false so checks chain with `return soak_fail(...)`. */
bool soak_fail(soak *S, const char *fmt, ...)
{
    if (S->failed)
        return false;
    S->failed = true;
    int n = snprintf(S->fail, sizeof S->fail, "op " U64 " (seed " U64 "): ", S->op,
                     S->o.seed);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof S->fail)
        vsnprintf(S->fail + n, sizeof S->fail - (size_t)n, fmt, ap);
    va_end(ap);
    return false;
}

static bool expect(soak *S, pkv_status got, pkv_status want, const char *what, uint32_t a)
{
    if (got == want)
        return true;
    return soak_fail(S, "%s on slot %u returned %s, expected %s", what, a,
                     pkv_status_str(got), pkv_status_str(want));
}

static uint32_t max_len_of(const soak *S, const soak_slot *sl)
{
    uint32_t m = 0;
    for (uint32_t l = 0; l < S->cfg.n_layers; l++)
        m = sl->h[l].len > m ? sl->h[l].len : m;
    return m;
}

uint64_t soak_pages_of(const soak *S, uint64_t len)
{
    return (len + S->cfg.block_tokens - 1) / S->cfg.block_tokens;
}

static void note_alive(soak *S)
{
    if (++S->c.alive > S->c.max_alive)
        S->c.max_alive = S->c.alive;
}

/* Entries from `first` on of `layer`'s block table that are in the spill file (with
 * alone, only those no other block table names): read in pieces of S->n_pi. */
static uint64_t count_spilled(soak *S, const pkv_session *s, uint32_t layer, uint64_t first,
                              bool alone)
{
    uint64_t n = 0, got = 0;
    do {
        const pkv_status st = pkv_session_pages(s, layer, first, S->n_pi, S->pi, &got);
        if (st != PKV_OK) {
            soak_fail(S, "pkv_session_pages (layer %u, from %" PRIu64 "): %s", layer, first,
                      pkv_status_str(st));
            return 0;
        }
        for (uint64_t i = 0; i < got; i++)
            n += !S->pi[i].resident && (!alone || S->pi[i].refs == 1);
        first += got;
    } while (got == S->n_pi);
    return n;
}

/* Spilled pages of `layer` from page `first` on (what a decode or append reads back). */
static uint64_t spilled_in(soak *S, const pkv_session *s, uint32_t layer, uint64_t first)
{
    return count_spilled(S, s, layer, first, false);
}

/* Spilled pages only s holds past `keep` tokens: truncate/destroy drop them. */
static uint64_t spilled_alone(soak *S, const pkv_session *s, uint64_t keep)
{
    uint64_t n = 0;
    for (uint32_t l = 0; l < S->cfg.n_layers; l++) {
        const uint64_t len = pkv_session_len(s, l), kept = keep < len ? keep : len;
        n += count_spilled(S, s, l, soak_pages_of(S, kept), true);
    }
    return n;
}

/* Append one token (raw k, v [g][d]) to the model, rounded as the cache stores it. */
static void model_append(soak *S, soak_hist *H, const float *k, const float *v)
{
    const uint32_t d = S->cfg.head_dim;
    for (uint32_t i = 0; i < S->kd; i += d) {
        pkv_dtype_round_row(S->cfg.kv_dtype, d, k + i, H->k + (size_t)H->len * S->kd + i);
        pkv_dtype_round_row(S->cfg.kv_dtype, d, v + i, H->v + (size_t)H->len * S->kd + i);
    }
    H->len++;
}

/* A fresh model for slot sl, or a copy of src's when src is not NULL. */
static bool model_new(soak *S, soak_slot *sl, uint32_t cap, const soak_slot *src)
{
    sl->cap = src ? src->cap : cap;
    sl->h = calloc(S->cfg.n_layers, sizeof *sl->h);
    const size_t bytes = (size_t)sl->cap * S->kd * sizeof(float);
    for (uint32_t l = 0; sl->h && l < S->cfg.n_layers; l++) {
        soak_hist *H = &sl->h[l];
        if (!(H->k = malloc(bytes)) || !(H->v = malloc(bytes)))
            return soak_fail(S, "out of memory for the model");
        if (src) {
            H->len = src->h[l].len;
            memcpy(H->k, src->h[l].k, (size_t)H->len * S->kd * sizeof(float));
            memcpy(H->v, src->h[l].v, (size_t)H->len * S->kd * sizeof(float));
        }
    }
    return sl->h ? true : soak_fail(S, "out of memory for the model");
}

/* Destroy the slot's session (counting the spilled pages it drops) and its model. */
void soak_slot_clear(soak *S, soak_slot *sl)
{
    if (sl->s) {
        S->drops += spilled_alone(S, sl->s, 0);
        pkv_session_destroy(sl->s);
        sl->s = NULL;
        S->c.alive--;
        S->c.destroys++;
    }
    for (uint32_t l = 0; sl->h && l < S->cfg.n_layers; l++) {
        free(sl->h[l].k);
        free(sl->h[l].v);
    }
    free(sl->h);
    sl->h = NULL;
}

/* ---- checks ------------------------------------------------------------------------ */

/* Lengths and pkv_session_memory of slot a against the model. */
bool soak_check_lens(soak *S, uint32_t a)
{
    const soak_slot *sl = &S->slots[a];
    uint64_t tokens = 0, blocks = 0;
    for (uint32_t l = 0; l < S->cfg.n_layers; l++) {
        uint64_t got = pkv_session_len(sl->s, l);
        if (got != sl->h[l].len)
            return soak_fail(S, "slot %u layer %u: pkv_session_len " U64 ", model %u", a, l,
                             got, sl->h[l].len);
        tokens += got;
        blocks += soak_pages_of(S, got);
    }
    pkv_memory m;
    if (pkv_session_memory(sl->s, &m) != PKV_OK)
        return soak_fail(S, "pkv_session_memory failed on slot %u", a);
    uint64_t token_bytes = cli_token_layer_bytes(&S->cfg);
    if (m.tokens != tokens || m.blocks != blocks ||
        m.bytes_resident + m.bytes_spilled != blocks * S->page_bytes ||
        m.bytes_ideal != tokens * token_bytes || m.bytes_shared > m.bytes_resident)
        return soak_fail(S, "slot %u: pkv_session_memory says " U64 " tokens, " U64 " pages, "
                         U64 " B resident, " U64 " B spilled, " U64 " B ideal; the model: " U64
                         " tokens in " U64 " pages of " U64 " B", a, m.tokens, m.blocks,
                         m.bytes_resident, m.bytes_spilled, m.bytes_ideal, tokens, blocks,
                         S->page_bytes);
    return true;
}

/* out [h][d] against the double reference over the first n tokens of H. */
static bool check_ref(soak *S, const soak_hist *H, uint32_t n, const float *q,
                      const float *out, const char *what, uint32_t a, uint32_t layer)
{
    const uint32_t h = S->cfg.n_heads, d = S->cfg.head_dim, hg = h / S->cfg.n_kv_heads;
    double vmax = 0;   /* a compare, not fmax(): see tools/generate/generate.c, check_rows */
    for (size_t i = 0; i < (size_t)n * S->kd; i++) {
        const double v = fabs((double)H->v[i]);
        vmax = v > vmax ? v : vmax;
    }
    const double tol = 1e-5 * vmax;
    S->c.ref_checks++;
    for (uint32_t i = 0; i < h; i++) {
        const float *qi = q + (size_t)i * d;
        const size_t off = (size_t)(i / hg) * d;   /* query head i reads group i / hg */
        double m = -INFINITY, sum = 0;
        for (uint32_t j = 0; j < n; j++) {
            const float *kj = H->k + (size_t)j * S->kd + off;
            double s = 0;
            for (uint32_t x = 0; x < d; x++)
                s += (double)qi[x] * (double)kj[x];
            S->w[j] = s * (double)S->cfg.scale;
            m = fmax(m, S->w[j]);
        }
        memset(S->acc, 0, d * sizeof(double));
        for (uint32_t j = 0; j < n; j++) {
            const double p = exp(S->w[j] - m);
            const float *vj = H->v + (size_t)j * S->kd + off;
            sum += p;
            for (uint32_t x = 0; x < d; x++)
                S->acc[x] += p * (double)vj[x];
        }
        for (uint32_t x = 0; x < d; x++) {
            const double ref = S->acc[x] / sum, got = (double)out[(size_t)i * d + x];
            const double diff = fabs(got - ref);
            if (!(diff <= tol))
                return soak_fail(S, "%s: slot %u layer %u len %u head %u dim %u: got %.9g, "
                                 "reference %.9g (|diff| %.3g > tol %.3g = 1e-5 * max|V|)",
                                 what, a, layer, n, i, x, got, ref, diff, tol);
            if (vmax > 0 && diff / vmax > S->c.max_rel_err)
                S->c.max_rel_err = diff / vmax;
        }
    }
    return true;
}

static bool check_same(soak *S, const float *x, const float *y, const char *what,
                       uint32_t a, uint32_t layer)
{
    S->c.bit_checks++;
    if (memcmp(x, y, (size_t)S->qd * sizeof(float)) == 0)
        return true;
    uint32_t i = 0;
    while (i + 1 < S->qd && memcmp(&x[i], &y[i], sizeof(float)) == 0)
        i++;
    return soak_fail(S, "%s: slot %u layer %u: not bitwise equal; first difference at [%u]: "
                     "%.9g vs %.9g", what, a, layer, i, (double)x[i], (double)y[i]);
}

/* pkv_decode of session s (slot a) that must succeed; counts the pages it reads back. */
static bool decode_ok(soak *S, pkv_session *s, uint32_t a, uint32_t layer, const float *q,
                      float *out, const char *what)
{
    S->reads += spilled_in(S, s, layer, 0);
    S->c.decodes++;
    return expect(S, pkv_decode(s, layer, q, out), PKV_OK, what, a);
}

/* ... and checked against the reference on slot a's model. */
bool soak_decode_checked(soak *S, uint32_t a, uint32_t layer, const float *q, float *out,
                         const char *what)
{
    const soak_slot *sl = &S->slots[a];
    const uint64_t chunk_pages = soak_pages_of(S, SOAK_CHUNK_TOKENS);
    S->c.split_decodes += soak_pages_of(S, sl->h[layer].len) > chunk_pages;
    return decode_ok(S, sl->s, a, layer, q, out, what) &&
           check_ref(S, &sl->h[layer], sl->h[layer].len, q, out, what, a, layer);
}

/* ---- operations ------------------------------------------------------------------- */

/* Truncate slot a to t tokens; the model says which status is right. */
static bool do_truncate(soak *S, uint32_t a, uint32_t t)
{
    soak_slot *sl = &S->slots[a];
    const pkv_status want = t > max_len_of(S, sl) ? PKV_ERANGE : PKV_OK;
    if (want == PKV_OK)
        S->drops += spilled_alone(S, sl->s, t);
    if (!expect(S, pkv_session_truncate(sl->s, t), want, "pkv_session_truncate", a))
        return false;
    S->c.truncates++;
    S->c.expected_errors += want != PKV_OK;
    for (uint32_t l = 0; want == PKV_OK && l < S->cfg.n_layers; l++)
        sl->h[l].len = sl->h[l].len > t ? t : sl->h[l].len;
    return soak_check_lens(S, a);
}

/* Make room for *n (clamped to the cap) more tokens in `layer`: a session at its cap
 * is first cut back to a random shorter length. */
static bool make_room(soak *S, uint32_t a, uint32_t layer, uint32_t *n)
{
    soak_slot *sl = &S->slots[a];
    *n = *n > sl->cap ? sl->cap : *n;
    if (sl->h[layer].len + *n <= sl->cap)
        return true;
    return do_truncate(S, a, below(S, sl->cap - *n + 1));
}

/* Append n random tokens to `layer` of slot a (the model follows). */
static bool append_n(soak *S, uint32_t a, uint32_t layer, uint32_t n)
{
    soak_slot *sl = &S->slots[a];
    for (uint32_t t = 0; t < n; t++) {
        fill(S, S->k, S->kd, 1.0f);
        fill(S, S->v, S->kd, 1.0f);
        const uint64_t np = soak_pages_of(S, sl->h[layer].len);
        if (sl->h[layer].len % S->cfg.block_tokens)   /* the tail page is written */
            S->reads += spilled_in(S, sl->s, layer, np - 1);
        if (!expect(S, pkv_append(sl->s, layer, S->k, S->v), PKV_OK, "pkv_append", a))
            return false;
        model_append(S, &sl->h[layer], S->k, S->v);
        S->c.tokens++;
    }
    return true;
}

static bool op_create(soak *S, uint32_t a)
{
    soak_slot *sl = &S->slots[a];
    bool long_one = S->o.long_len > S->o.max_len && below(S, 32) == 0;
    if (!model_new(S, sl, long_one ? S->o.long_len : S->o.max_len, NULL) ||
        !expect(S, pkv_session_create(S->e, &sl->s), PKV_OK, "pkv_session_create", a))
        return false;
    S->c.created++;
    note_alive(S);
    /* A long session starts half to completely full, so decodes split into chunks. */
    for (uint32_t l = 0; long_one && l < S->cfg.n_layers; l++)
        if (!append_n(S, a, l, sl->cap / 2 + below(S, sl->cap - sl->cap / 2 + 1)))
            return false;
    return soak_check_lens(S, a);
}

static bool op_append(soak *S, uint32_t a)
{
    soak_slot *sl = &S->slots[a];
    const uint32_t L = S->cfg.n_layers, one = below(S, L);
    const bool all = below(S, 2) == 0;
    uint32_t n = 1 + below(S, 8);
    if (sl->cap > S->o.max_len && below(S, 4) == 0)
        n = 32 + below(S, 97);   /* long sessions also grow in bursts, past a chunk */
    const bool was_empty = sl->h[one].len == 0;
    for (uint32_t l = all ? 0 : one; l < (all ? L : one + 1); l++)
        if (!make_room(S, a, l, &n) || !append_n(S, a, l, n))
            return false;
    bool check = below(S, 3) == 0;
    if (S->o.inject_bug && !S->injected && was_empty && n <= 8 && sl->h[one].len == n) {
        /* The deliberate bug: the model's first V row of this layer loses the sign of
         * its largest value, as a library that mis-stored a row would. The decode
         * right after must notice. */
        float *v0 = sl->h[one].v;
        uint32_t big = 0;
        for (uint32_t i = 1; i < S->kd; i++)
            big = fabsf(v0[i]) > fabsf(v0[big]) ? i : big;
        v0[big] = -v0[big];
        S->injected = check = true;
    }
    if (!soak_check_lens(S, a) || !check)
        return !S->failed;
    soak_random_q(S, S->q);
    return soak_decode_checked(S, a, one, S->q, S->out, "decode after append");
}

static bool op_prefill(soak *S, uint32_t a)
{
    soak_slot *sl = &S->slots[a];
    const uint32_t layer = below(S, S->cfg.n_layers);
    uint32_t n = 1 + below(S, 6);
    if (!make_room(S, a, layer, &n))
        return false;
    soak_hist *H = &sl->h[layer];
    const uint32_t len0 = H->len;
    for (uint32_t t = 0; t < n; t++)
        soak_random_q(S, S->q + (size_t)t * S->qd);
    fill(S, S->k, (size_t)n * S->kd, 1.0f);
    fill(S, S->v, (size_t)n * S->kd, 1.0f);
    S->reads += spilled_in(S, sl->s, layer, 0);   /* its first decode reads the layer */
    pkv_status st = pkv_prefill(sl->s, layer, n, S->q, S->k, S->v, S->out);
    if (!expect(S, st, PKV_OK, "pkv_prefill", a))
        return false;
    S->c.prefills++;
    S->c.tokens += n;
    for (uint32_t t = 0; t < n; t++)
        model_append(S, H, S->k + (size_t)t * S->kd, S->v + (size_t)t * S->kd);
    for (uint32_t t = 0; t < n; t++)
        if (!check_ref(S, H, len0 + t + 1, S->q + (size_t)t * S->qd,
                       S->out + (size_t)t * S->qd, "pkv_prefill", a, layer))
            return false;
    /* prefill is append + decode through the same code: its last row must equal a
     * decode of the same query bit for bit */
    const size_t last = (size_t)(n - 1) * S->qd;
    return decode_ok(S, sl->s, a, layer, S->q + last, S->out2, "pkv_decode") &&
           check_same(S, S->out + last, S->out2, "prefill vs decode", a, layer) &&
           soak_check_lens(S, a);
}

static bool op_decode(soak *S, uint32_t a)
{
    soak_slot *sl = &S->slots[a];
    const uint32_t layer = below(S, S->cfg.n_layers);
    soak_random_q(S, S->q);
    if (sl->h[layer].len == 0) {
        S->c.expected_errors++;
        return expect(S, pkv_decode(sl->s, layer, S->q, S->out), PKV_ESTATE,
                      "pkv_decode of an empty layer", a);
    }
    if (!soak_decode_checked(S, a, layer, S->q, S->out, "pkv_decode"))
        return false;
    if (below(S, 4))
        return true;
    return decode_ok(S, sl->s, a, layer, S->q, S->out2, "pkv_decode") &&
           check_same(S, S->out, S->out2, "decode twice", a, layer);
}

static int by_id(const void *x, const void *y)
{
    const uint64_t a = ((const pkv_page_info *)x)->id, b = ((const pkv_page_info *)y)->id;
    return a < b ? -1 : a > b;
}

static bool op_batch(soak *S, uint32_t a)
{
    const uint32_t layer = below(S, S->cfg.n_layers);
    /* Mostly batches that fit the budget; 1 in 16 tries to pass it. A batch whose
     * distinct pages fit must succeed; past the budget PKV_ENOMEM is allowed (decode
     * holds all of a batch's pages at once) but must change nothing. */
    const bool over = below(S, 16) == 0;
    const uint32_t want = over ? SOAK_MAX_BATCH : 2 + below(S, 15);
    uint32_t ids[SOAK_MAX_BATCH], n = 0;
    pkv_session *ss[SOAK_MAX_BATCH];
    uint64_t pages = 0, np = 0, distinct = 0, spilled = 0;
    for (uint32_t tries = 0; n < want && tries < 8 * want; tries++) {
        const uint32_t b = tries == 0 ? a : below(S, S->o.sessions);
        const soak_slot *sl = &S->slots[b];
        bool dup = !sl->s || sl->h[layer].len == 0;
        for (uint32_t i = 0; i < n; i++)
            dup |= ids[i] == b;
        const uint64_t p = dup ? 0 : soak_pages_of(S, sl->h[layer].len);
        if (dup || (!over && pages + p > S->o.budget_pages))
            continue;
        uint64_t got = 0;
        const pkv_status ps = pkv_session_pages(sl->s, layer, 0, p, S->pg + np, &got);
        if (ps != PKV_OK || got != p)
            return soak_fail(S, "pkv_session_pages of slot %u layer %u: %s, " U64 " of " U64
                             " entries", b, layer, pkv_status_str(ps), got, p);
        np += got;
        ids[n] = b;
        ss[n++] = sl->s;
        pages += p;
        if (over && pages > S->o.budget_pages)
            break;
    }
    if (n == 0)
        return true;
    qsort(S->pg, (size_t)np, sizeof *S->pg, by_id);   /* forks share pages */
    for (uint64_t i = 0; i < np; i++)
        if (i == 0 || S->pg[i].id != S->pg[i - 1].id) {
            distinct++;
            spilled += !S->pg[i].resident;
        }
    for (uint32_t i = 0; i < n; i++)
        soak_random_q(S, S->q + (size_t)i * S->qd);
    const pkv_status st = pkv_decode_batch(S->e, layer, n, ss, S->q, S->out);
    S->c.batches++;
    if (st == PKV_ENOMEM && distinct > S->o.budget_pages) {
        S->c.expected_errors++;
        for (uint32_t i = 0; i < n; i++)
            if (!soak_check_lens(S, ids[i]))
                return false;
        return soak_decode_checked(S, ids[0], layer, S->q, S->out2, "decode after ENOMEM");
    }
    if (!expect(S, st, PKV_OK, "pkv_decode_batch", a))
        return false;
    S->reads += spilled;
    for (uint32_t i = 0; i < n; i++) {
        const float *qi = S->q + (size_t)i * S->qd, *oi = S->out + (size_t)i * S->qd;
        const soak_hist *H = &S->slots[ids[i]].h[layer];
        if (!check_ref(S, H, H->len, qi, oi, "pkv_decode_batch", ids[i], layer) ||
            !decode_ok(S, ss[i], ids[i], layer, qi, S->out2, "pkv_decode") ||
            !check_same(S, oi, S->out2, "batch vs single decode", ids[i], layer))
            return false;
    }
    return true;
}

/* A random slot other than a, emptied. */
static uint32_t other_slot(soak *S, uint32_t a)
{
    uint32_t b = below(S, S->o.sessions - 1);
    b += b >= a;
    soak_slot_clear(S, &S->slots[b]);
    return b;
}

/* Fork slot a into slot b, then change one of the two: the other must keep decoding
 * exactly as before (copy-on-write), the changed one must match its model. */
static bool op_fork(soak *S, uint32_t a)
{
    const uint32_t b = other_slot(S, a), L = S->cfg.n_layers;
    soak_slot *src = &S->slots[a], *dst = &S->slots[b];
    uint32_t layer = below(S, L), i = 0;
    for (; i < L && src->h[layer].len == 0; i++)
        layer = (layer + 1) % L;
    const bool has = i < L;   /* some layer holds tokens */
    soak_random_q(S, S->q);
    if (has && !soak_decode_checked(S, a, layer, S->q, S->out, "decode before fork"))
        return false;
    if (!expect(S, pkv_session_fork(src->s, &dst->s), PKV_OK, "pkv_session_fork", a) ||
        !model_new(S, dst, 0, src))
        return false;
    S->c.forks++;
    note_alive(S);
    if (!soak_check_lens(S, b) || !has)
        return !S->failed;
    if (!decode_ok(S, dst->s, b, layer, S->q, S->out2, "pkv_decode") ||
        !check_same(S, S->out, S->out2, "fork vs parent", b, layer))
        return false;
    const uint32_t changed = below(S, 2) ? a : b, twin = changed == a ? b : a;
    if (below(S, 2) && !do_truncate(S, changed, below(S, S->slots[changed].h[layer].len + 1)))
        return false;
    uint32_t n = 1 + below(S, 2 * S->cfg.block_tokens);
    return make_room(S, changed, layer, &n) && append_n(S, changed, layer, n) &&
           soak_check_lens(S, changed) && soak_check_lens(S, twin) &&
           decode_ok(S, S->slots[twin].s, twin, layer, S->q, S->out2, "pkv_decode") &&
           check_same(S, S->out, S->out2, "twin after its fork changed", twin, layer) &&
           soak_decode_checked(S, changed, layer, S->q, S->out2, "decode of a changed fork");
}

/* Draft i's attention out (for q) against the reference over the layer's model and
 * the drafts on its path from the root (k, v [n][g*d]: the drafts' rows as given). */
static bool check_draft(soak *S, const soak_hist *H, const int32_t *parent, uint32_t i,
                        const float *k, const float *v, const float *q, const float *out,
                        uint32_t a, uint32_t layer)
{
    uint32_t path[8], depth = 0;
    for (int32_t j = (int32_t)i; j >= 0; j = parent[j])
        path[depth++] = (uint32_t)j;
    const size_t bytes = (size_t)(H->len + depth) * S->kd * sizeof(float);
    soak_hist T = {malloc(bytes), malloc(bytes), H->len};
    bool ok = T.k && T.v;
    if (!ok)
        soak_fail(S, "out of memory for a draft's reference");
    if (ok) {
        memcpy(T.k, H->k, (size_t)H->len * S->kd * sizeof(float));
        memcpy(T.v, H->v, (size_t)H->len * S->kd * sizeof(float));
        while (depth > 0) { /* root first */
            depth--;
            model_append(S, &T, k + (size_t)path[depth] * S->kd,
                         v + (size_t)path[depth] * S->kd);
        }
        ok = check_ref(S, &T, T.len, q, out, "pkv_verify", a, layer);
    }
    free(T.k);
    free(T.v);
    return ok;
}

/* Verify a random tree of 1..6 drafts on one layer or on all (one tree for all), each
 * draft checked against the reference over its ancestors; 1 in 4 times a second
 * verify of other rows replaces the first. Then commit a random root-to-node path, or
 * none: the model takes the path's rows, and a decode of the last kept draft's q must
 * give that draft's verify output to the bit (SPEC section 13). */
static bool op_verify(soak *S, uint32_t a)
{
    soak_slot *sl = &S->slots[a];
    const uint32_t L = S->cfg.n_layers, one = below(S, L);
    const bool all = below(S, 2) == 0;
    const uint32_t l0 = all ? 0 : one, l1 = all ? L : one + 1, nl = l1 - l0;
    uint32_t n = 1 + below(S, 6);
    for (uint32_t l = l0; l < l1; l++)
        if (!make_room(S, a, l, &n))
            return false;
    int32_t parent[8];
    for (uint32_t i = 0; i < n; i++)
        parent[i] = (int32_t)below(S, i + 1) - 1;
    /* per verified layer: k, v [n][g*d]; q, out [n][h*d] */
    const size_t kn = (size_t)n * S->kd, qn = (size_t)n * S->qd;
    float *buf = malloc((size_t)nl * (2 * kn + 2 * qn) * sizeof(float));
    if (!buf)
        return soak_fail(S, "out of memory for a verify");
    float *k = buf, *v = k + nl * kn, *q = v + nl * kn, *out = q + nl * qn;
    bool ok = true;
    for (uint32_t l = l0; ok && l < l1; l++) {
        const size_t x = l - l0;
        const uint32_t tries = below(S, 4) == 0 ? 2 : 1;
        for (uint32_t r = 0; ok && r < tries; r++) {
            fill(S, k + x * kn, kn, 1.0f);
            fill(S, v + x * kn, kn, 1.0f);
            for (uint32_t i = 0; i < n; i++)
                soak_random_q(S, q + x * qn + (size_t)i * S->qd);
            S->reads += spilled_in(S, sl->s, l, 0);
            ok = expect(S, pkv_verify(sl->s, l, n, parent, q + x * qn, k + x * kn, v + x * kn,
                                      out + x * qn),
                        PKV_OK, "pkv_verify", a);
            S->c.verifies += ok;
        }
        for (uint32_t i = 0; ok && i < n; i++)
            ok = check_draft(S, &sl->h[l], parent, i, k + x * kn, v + x * kn,
                             q + x * qn + (size_t)i * S->qd, out + x * qn + (size_t)i * S->qd,
                             a, l);
    }
    uint32_t path[8], n_keep = 0;
    if (ok && below(S, 5)) { /* the path to a random draft; 1 in 5 keeps none */
        uint32_t rev[8];
        for (int32_t j = (int32_t)below(S, n); j >= 0; j = parent[j])
            rev[n_keep++] = (uint32_t)j;
        for (uint32_t j = 0; j < n_keep; j++)
            path[j] = rev[n_keep - 1 - j];
    }
    for (uint32_t l = l0; ok && n_keep && l < l1; l++) /* the pages from len's on */
        S->reads += spilled_in(S, sl->s, l, sl->h[l].len / S->cfg.block_tokens);
    ok = ok && expect(S, pkv_session_commit(sl->s, n_keep, path), PKV_OK,
                      "pkv_session_commit", a);
    for (uint32_t l = l0; ok && l < l1; l++) {
        const size_t x = l - l0;
        for (uint32_t j = 0; j < n_keep; j++)
            model_append(S, &sl->h[l], k + x * kn + (size_t)path[j] * S->kd,
                         v + x * kn + (size_t)path[j] * S->kd);
        S->c.tokens += n_keep;
    }
    S->c.commits += ok;
    ok = ok && soak_check_lens(S, a);
    if (ok && n_keep > 0) {
        const size_t x = nl - 1, last = path[n_keep - 1];
        ok = decode_ok(S, sl->s, a, l1 - 1, q + x * qn + last * S->qd, S->out2,
                       "pkv_decode after commit") &&
             check_same(S, out + x * qn + last * S->qd, S->out2,
                        "verify vs decode after commit", a, l1 - 1);
    }
    free(buf);
    return ok;
}

/* Save slot a, load it back, compare bitwise; the copy replaces a or takes slot b. */
static bool op_save_load(soak *S, uint32_t a)
{
    soak_slot *sl = &S->slots[a];
    for (uint32_t l = 0; l < S->cfg.n_layers; l++)
        S->reads += spilled_in(S, sl->s, l, 0);
    if (!expect(S, pkv_session_save(sl->s, S->save_path), PKV_OK, "pkv_session_save", a))
        return false;
    pkv_session *ld = NULL;
    const pkv_status st = pkv_session_load(S->e, S->save_path, &ld);
    unlink(S->save_path);
    if (!expect(S, st, PKV_OK, "pkv_session_load", a))
        return false;
    S->c.saves++;
    const bool replace = below(S, 2);
    const uint32_t b = replace ? a : other_slot(S, a);
    if (!replace) {
        if (!model_new(S, &S->slots[b], 0, sl))
            return false;
        S->slots[b].s = ld;
        note_alive(S);
    }
    for (uint32_t l = 0; l < S->cfg.n_layers; l++) {
        if (sl->h[l].len == 0)
            continue;
        soak_random_q(S, S->q);
        if (!soak_decode_checked(S, a, l, S->q, S->out, "decode of the saved session") ||
            !decode_ok(S, ld, b, l, S->q, S->out2, "decode of the loaded session") ||
            !check_same(S, S->out, S->out2, "loaded vs saved", b, l))
            return false;
    }
    if (replace) {
        S->drops += spilled_alone(S, sl->s, 0);
        pkv_session_destroy(sl->s);
        sl->s = ld;
    }
    return soak_check_lens(S, a) && soak_check_lens(S, b);
}

/* One random operation on a random slot. */
bool soak_step(soak *S)
{
    const uint32_t a = below(S, S->o.sessions), r = below(S, 100);
    soak_slot *sl = &S->slots[a];
    if (!sl->s)
        return op_create(S, a);
    if (r < 40) return op_append(S, a);
    if (r < 44) return op_prefill(S, a);
    if (r < 66) return op_decode(S, a);
    if (r < 74) return op_batch(S, a);
    if (r < 80) return op_fork(S, a);
    if (r < 82) return op_verify(S, a);
    if (r < 88) {   /* 1 in 8 past every layer: PKV_ERANGE */
        uint32_t m = max_len_of(S, sl);
        return do_truncate(S, a, below(S, 8) ? below(S, m + 1) : m + 1 + below(S, 4));
    }
    if (r == 99)
        return op_save_load(S, a);
    soak_slot_clear(S, sl);
    return r < 93 || op_create(S, a);   /* destroy, or recycle the soak_slot */
}

/*
 * test_edges.c - the edges of every public call: the configurations pkv_engine_create
 * refuses (pkv_config_explain must refuse each with the same status and a reason), the
 * extremes of every position and size argument (0, 1, the last valid value, one past
 * it, 2^63, the type's maximum), and the failure reason each failing call records
 * (pkv_engine_last_error: fresh, and starting with the call's own name).
 *
 * A call at an extreme either does what its documentation says for that value or
 * returns a status and changes nothing; it never wraps, crashes or reads past what the
 * caller's sizes describe. Positions of pkv_decode_partial_at are test_shard.c's
 * (extreme_positions); the random crossings of features are test_crossings.c's.
 */
#include "testutil.h"
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- pkv_config_explain == pkv_engine_create ------------------------------------------- */

/* Create and explain cfg; they must agree: create's EINVAL is explain's EINVAL with a
 * reason, create's success (or ENOMEM / EIO, which explain cannot foresee) is explain's
 * PKV_OK with "". Returns create's status. */
static pkv_status agree(const pkv_config *c, const char *what)
{
    pkv_engine *e = NULL;
    const pkv_status sc = pkv_engine_create(c, &e);
    pkv_engine_destroy(e);
    char why[256] = "unset";
    const pkv_status sx = pkv_config_explain(c, why, sizeof why);
    if (sc == PKV_EINVAL) {
        ck_assert_msg(sx == PKV_EINVAL && why[0] != '\0' && strcmp(why, "unset") != 0,
                      "%s: create says %s, explain says %s (\"%s\") (seed %llu)", what,
                      pkv_status_str(sc), pkv_status_str(sx), why,
                      (unsigned long long)pkvt_seed());
    } else {
        ck_assert_msg(sx == PKV_OK && why[0] == '\0',
                      "%s: create says %s, explain says %s (\"%s\") (seed %llu)", what,
                      pkv_status_str(sc), pkv_status_str(sx), why,
                      (unsigned long long)pkvt_seed());
    }
    /* the same verdict without a buffer, or with one too small for a word */
    ck_assert_int_eq(pkv_config_explain(c, NULL, 0), sx);
    char one[1] = {'x'};
    ck_assert_int_eq(pkv_config_explain(c, one, 1), sx);
    ck_assert_int_eq(one[0], '\0');
    char none[1] = {'x'};
    ck_assert_int_eq(pkv_config_explain(c, none, 0), sx);
    ck_assert_int_eq(none[0], 'x');
    return sc;
}

static pkv_config base_config(void)
{
    pkv_config c = pkvt_config(2, 4, 2, 8, 16, PKV_F16);
    c.n_threads = 1;
    return c;
}

/* Every rule of the validation, one broken at a time (include/pagedkv.h lists them at
 * pkv_engine_create): create refuses each, explain says why. */
START_TEST(every_rule_is_refused_alike)
{
    static const float nan_logits[4] = {0.0f, NAN, 0.0f, 0.0f};
    pkv_layer_config lc[2];
    char dir[512];
    pkvt_scratch_dir(dir, sizeof dir, "edges");
    char file[600];
    snprintf(file, sizeof file, "%s/f", dir);
    pkvt_write_file(file, "x", 1);
    for (int rule = 0;; rule++) {
        pkv_config c = base_config();
        memset(lc, 0, sizeof lc);
        const char *what = NULL;
        switch (rule) {
        case 0: c.n_layers = 0; what = "n_layers 0"; break;
        case 1: c.n_heads = 0; what = "n_heads 0"; break;
        case 2: c.n_kv_heads = 0; what = "n_kv_heads 0"; break;
        case 3: c.head_dim = 0; what = "head_dim 0"; break;
        case 4: c.n_layers = 65537; what = "n_layers over the limit"; break;
        case 5: c.n_kv_heads = 3; what = "h % g"; break;
        case 6: c.n_heads = 257 * 2; what = "257 heads a group"; break;
        case 7: c.head_dim = 4097; what = "head_dim 4097"; break;
        case 8: c.head_dim_v = 4097; what = "head_dim_v 4097"; break;
        case 9: c.n_heads = c.n_kv_heads = 65537; what = "n_kv_heads 65537"; break;
        case 10: c.kv_dtype = (pkv_dtype)5; what = "dtype 5"; break;
        case 11: c.kv_dtype = (pkv_dtype)-1; what = "dtype -1"; break;
        case 12: c.scale = -1.0f; what = "scale -1"; break;
        case 13: c.scale = NAN; what = "scale NaN"; break;
        case 14: c.scale = INFINITY; what = "scale inf"; break;
        case 15: c.n_threads = 1025; what = "n_threads 1025"; break;
        case 16: c.n_threads = UINT32_MAX; what = "n_threads UINT32_MAX"; break;
        case 17: lc[1].sink_tokens = 1; what = "sinks without a window"; break;
        case 18: lc[1].rollback_tokens = 1; what = "rollback without a window"; break;
        case 19: lc[0].softcap = -1.0f; what = "softcap -1"; break;
        case 20: lc[0].softcap = NAN; what = "softcap NaN"; break;
        case 21: lc[0].softcap = INFINITY; what = "softcap inf"; break;
        case 22: lc[1].sink_logits = nan_logits; what = "a NaN sink logit"; break;
        case 23: lc[1].window = 8; lc[1].sink_tokens = 32769; what = "32769 sinks at bt 16";
            break;
        case 24: c.block_tokens = 1; lc[0].window = 1; lc[0].sink_tokens = 32769;
            what = "32769 sinks at bt 1"; break;
        case 25: c.block_tokens = 3; lc[0].window = 1; lc[0].sink_tokens = 64 * 171 * 3 + 1;
            what = "sinks one past the limit at bt 3"; break;
        case 26: lc[0].window = 4; lc[0].sink_tokens = UINT32_MAX; what = "UINT32_MAX sinks";
            break;
        case 27: c.quant_dot = 2; what = "quant_dot 2"; break;
        case 28: c.quant_dot = 1; what = "quant_dot 1 with f16"; break;
        case 29: c.block_tokens = 1u << 20; c.head_dim = 4096; what = "a page over 1 GiB"; break;
        case 30: c.block_tokens = UINT32_MAX; what = "block_tokens UINT32_MAX"; break;
        case 31: c.mem_budget = 1; what = "a budget under one page"; break;
        case 32: c.spill_dir = ""; what = "spill_dir \"\""; break;
        case 33: c.spill_dir = "/nonexistent/pkv-edges"; what = "no such spill_dir"; break;
        case 34: c.spill_dir = file; what = "spill_dir a file"; break;
        case 35: setenv("PKV_FORCE_ISA", "sse9", 1); what = "PKV_FORCE_ISA=sse9"; break;
        case 36: setenv("PKV_PREFETCH", "l3", 1); what = "PKV_PREFETCH=l3"; break;
        /* SPEC §14: the rope fields (head_dim 8) */
        case 37: lc[0].rope = 3; what = "rope 3"; break;
        case 38: lc[0].rope = UINT32_MAX; what = "rope UINT32_MAX"; break;
        case 39: lc[0].rope = PKV_ROPE_NORM; lc[0].rope_dims = 3; what = "rope_dims odd"; break;
        case 40: lc[0].rope = PKV_ROPE_NEOX; lc[0].rope_dims = 10; what = "rope_dims 10 > 8";
            break;
        case 41: lc[1].rope = PKV_ROPE_NEOX; lc[1].rope_dims = UINT32_MAX - 1;
            what = "rope_dims UINT32_MAX - 1"; break;
        case 42: lc[0].rope = PKV_ROPE_NORM; lc[0].rope_theta = -1.0f; what = "rope_theta -1";
            break;
        case 43: lc[0].rope = PKV_ROPE_NORM; lc[0].rope_theta = NAN; what = "rope_theta NaN";
            break;
        case 44: lc[0].rope = PKV_ROPE_NORM; lc[0].rope_freq_scale = INFINITY;
            what = "rope_freq_scale inf"; break;
        case 45: lc[0].rope = PKV_ROPE_NORM; lc[0].rope_freq_scale = -0.5f;
            what = "rope_freq_scale -0.5"; break;
        case 46: lc[1].rope_dims = 8; what = "rope_dims without rope"; break;
        case 47: lc[1].rope_theta = 10000.0f; what = "rope_theta without rope"; break;
        case 48: lc[1].rope_freq_scale = 1.0f; what = "rope_freq_scale without rope"; break;
        case 49: c.head_dim = 7; lc[0].rope = PKV_ROPE_NEOX; what = "rope_dims 0, head_dim 7";
            break;
        default: break;
        }
        if (!what)
            break;
        c.layer_cfg = c.n_layers == 2 ? lc : NULL; /* [n_layers] entries, or none */
        ck_assert_msg(agree(&c, what) == PKV_EINVAL, "%s: created", what);
        if (rule == 35) /* this program runs without PKV_FORCE_ISA (tests/meson.build) */
            unsetenv("PKV_FORCE_ISA");
        if (rule == 36)
            unsetenv("PKV_PREFETCH");
    }
    /* the limits themselves are accepted */
    pkv_config c = base_config();
    memset(lc, 0, sizeof lc);
    c.layer_cfg = lc;
    lc[1].window = 8;
    lc[1].sink_tokens = 32768;
    ck_assert_int_eq(agree(&c, "32768 sinks at bt 16"), PKV_OK);
    c.block_tokens = 3;
    lc[1].sink_tokens = 64 * 171 * 3;
    ck_assert_int_eq(agree(&c, "the sink limit at bt 3"), PKV_OK);
    c = base_config();
    memset(lc, 0, sizeof lc);
    c.layer_cfg = lc;
    lc[0] = (pkv_layer_config){.rope = PKV_ROPE_NEOX, .rope_dims = 8, .rope_theta = 3e38f,
                               .rope_freq_scale = 1e-30f};
    lc[1] = (pkv_layer_config){.rope = PKV_ROPE_NORM, .rope_dims = 2, .window = 4};
    ck_assert_int_eq(agree(&c, "rope at its limits"), PKV_OK);
    c.head_dim = 7;
    lc[0].rope_dims = 6;
    lc[1].rope_dims = 0; /* head_dim 7 is odd, but layer 1's default would be 7 */
    ck_assert_int_eq(agree(&c, "rope_dims 0 with head_dim 7"), PKV_EINVAL);
    lc[1].rope_dims = 6;
    ck_assert_int_eq(agree(&c, "rope_dims 6 of head_dim 7"), PKV_OK);
    c = base_config();
    c.head_dim = c.head_dim_v = 4096;
    ck_assert_int_eq(agree(&c, "head_dim 4096"), PKV_OK);
    c = base_config();
    c.n_heads = 256 * 2;
    ck_assert_int_eq(agree(&c, "256 heads a group"), PKV_OK);
    ck_assert_int_eq(pkv_config_explain(NULL, NULL, 0), PKV_EINVAL);
    pkvt_remove_dir(dir);
}
END_TEST

/* Random configurations around a valid one (each field from a table of edges, with
 * random layer variants): whatever create says, explain says too. */
START_TEST(random_configs_are_judged_alike)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    static const uint32_t edges[] = {0, 1, 2, 3, 4, 7, 16, 64, 255, 256, 257, 512, 4095,
                                     4096, 4097, 32768, 32769, 65536, 65537, UINT32_MAX};
    static const float floats[] = {0.0f, -0.0f, 1.0f, 0.125f, -1.0f, NAN, INFINITY, -INFINITY,
                                   1e-30f, 3e38f};
    float logits[64];
    pkv_layer_config lc[4];
    const int n = pkvt_quick() ? 400 : 4000;
    int refused = 0;
    for (int i = 0; i < n; i++) {
        pkv_config c = pkvt_config(2 + pkvt_below(&r, 3), 8, 2, 16, 16, PKV_F32);
        c.n_threads = 1;
        memset(lc, 0, sizeof lc);
        for (int k = 0; k < 64; k++)
            logits[k] = pkvt_uniform(&r, -2.0f, 2.0f);
        if (pkvt_below(&r, 3) == 0)
            logits[pkvt_below(&r, 8)] = floats[pkvt_below(&r, 10)];
        for (uint32_t l = 0; l < 4; l++) {
            if (pkvt_below(&r, 2)) {
                lc[l].window = pkvt_below(&r, 4) ? pkvt_below(&r, 40) : edges[pkvt_below(&r, 20)];
                lc[l].sink_tokens = pkvt_below(&r, 3) ? pkvt_below(&r, 5) : edges[pkvt_below(&r, 20)];
                lc[l].rollback_tokens = pkvt_below(&r, 3) ? pkvt_below(&r, 5) : edges[pkvt_below(&r, 20)];
            }
            if (pkvt_below(&r, 4) == 0)
                lc[l].softcap = floats[pkvt_below(&r, 10)];
            if (pkvt_below(&r, 4) == 0)
                lc[l].sink_logits = logits;
        }
        c.layer_cfg = pkvt_below(&r, 5) ? lc : NULL;
        for (int m = 1 + (int)pkvt_below(&r, 3); m > 0; m--) {
            const uint32_t v = edges[pkvt_below(&r, 20)];
            switch (pkvt_below(&r, 10)) {
            case 0: c.n_heads = v; break;
            case 1: c.n_kv_heads = v; break;
            case 2: c.head_dim = v; break;
            case 3: c.head_dim_v = v; break;
            case 4: c.block_tokens = v; break;
            case 5: c.kv_dtype = (pkv_dtype)pkvt_below(&r, 7); break;
            case 6: c.scale = floats[pkvt_below(&r, 10)]; break;
            case 7: c.quant_dot = pkvt_below(&r, 3); break;
            case 8: c.mem_budget = pkvt_below(&r, 2) ? v : (uint64_t)v << 16; break;
            default: c.n_layers = pkvt_below(&r, 2) ? 1 + pkvt_below(&r, 4) : v;
                c.layer_cfg = c.n_layers <= 4 ? c.layer_cfg : NULL;
                break;
            }
        }
        /* the sink logits are [n_heads]: the caller's array must hold them */
        for (uint32_t l = 0; l < 4; l++)
            if (c.n_heads > 64)
                lc[l].sink_logits = NULL;
        char what[64];
        snprintf(what, sizeof what, "random config %d", i);
        refused += agree(&c, what) == PKV_EINVAL;
    }
    /* the walk must reach both verdicts often */
    ck_assert_int_gt(refused, n / 4);
    ck_assert_int_lt(refused, n - n / 10);
}
END_TEST

/* ---- failure reasons: fresh, and named after the call ------------------------------ */

typedef struct {
    pkv_engine *e;
    pkv_session *s;       /* 2 layers, layer 0 holds 5 positions, layer 1 none */
} world;

/* A reason the next failure must replace: a failure of another call than `call`. */
static void stale_reason(world *w, const char *call)
{
    float kv[8] = {0};
    if (strcmp(call, "pkv_append") != 0)
        ck_assert_int_eq(pkv_append(w->s, 99, kv, kv), PKV_EINVAL);
    else
        ck_assert_int_eq(pkv_session_truncate(w->s, 1000), PKV_ERANGE);
}

/* The call that just failed with `st` (want) recorded a reason naming it. */
static void named(world *w, const char *call, pkv_status st, pkv_status want, int line)
{
    ck_assert_msg(st == want, "line %d: %s gave %s, want %s", line, call, pkv_status_str(st),
                  pkv_status_str(want));
    char why[256];
    ck_assert_int_eq(pkv_engine_last_error(w->e, why, sizeof why), PKV_OK);
    const size_t n = strlen(call);
    ck_assert_msg(strncmp(why, call, n) == 0 && why[n] == ':' && why[n + 1] == ' ' &&
                      why[n + 2] != '\0',
                  "line %d: %s failed, but the reason is \"%s\"", line, call, why);
}

#define FAILS(call, want, expr)                                                         \
    do {                                                                                \
        stale_reason(&w, call);                                                         \
        named(&w, call, (expr), want, __LINE__);                                        \
    } while (0)

START_TEST(every_failure_names_its_call)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    char dir[512], path[600], junk[600];
    pkvt_scratch_dir(dir, sizeof dir, "edges");
    snprintf(path, sizeof path, "%s/s.pkv", dir);
    snprintf(junk, sizeof junk, "%s/junk", dir);
    pkvt_write_file(junk, "not a session file at all", 25);
    pkv_layer_config lc[2] = {{.window = 3}, {0}};
    pkv_config c = pkvt_config(2, 4, 2, 4, 2, PKV_F32);
    c.layer_cfg = lc;
    c.n_threads = 1;
    world w = {pkvt_engine_cfg(&c), NULL};
    pkv_engine *e = w.e, *other = pkvt_engine_cfg(&c);
    w.s = pkvt_session(e);
    pkv_session *s = w.s, *x = NULL, *o = pkvt_session(other);
    pkvt_append_random(s, &r, 0, 12, 1, 1);
    pkvt_append_random(o, &r, 0, 1, 1, 1);
    float q[16], k[8], v[8], out[64], st[64 * 6];
    pkvt_fill(&r, q, 16, -1, 1);
    pkvt_fill(&r, k, 8, -1, 1);
    pkvt_fill(&r, v, 8, -1, 1);
    uint32_t nc = 0;
    uint64_t u = 0;
    int32_t ids[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    pkv_memory m;
    pkv_stats sts;
    pkv_config cc;
    pkv_page_info pi[8];

    FAILS("pkv_session_create", PKV_EINVAL, pkv_session_create(e, NULL));
    FAILS("pkv_session_fork", PKV_EINVAL, pkv_session_fork(s, NULL));
    FAILS("pkv_append", PKV_EINVAL, pkv_append(s, 2, k, v));
    FAILS("pkv_append", PKV_EINVAL, pkv_append(s, 0, NULL, v));
    FAILS("pkv_append", PKV_EINVAL, pkv_append(s, 0, k, NULL));
    FAILS("pkv_decode", PKV_EINVAL, pkv_decode(s, 2, q, out));
    FAILS("pkv_decode", PKV_EINVAL, pkv_decode(s, 0, NULL, out));
    FAILS("pkv_decode", PKV_EINVAL, pkv_decode(s, 0, q, NULL));
    FAILS("pkv_decode", PKV_ESTATE, pkv_decode(s, 1, q, out));
    FAILS("pkv_session_truncate", PKV_ERANGE, pkv_session_truncate(s, 13));
    FAILS("pkv_session_truncate", PKV_ERANGE, pkv_session_truncate(s, 5)); /* released */
    FAILS("pkv_session_memory", PKV_EINVAL, pkv_session_memory(s, NULL));
    FAILS("pkv_engine_stats", PKV_EINVAL, pkv_engine_stats(e, NULL));
    FAILS("pkv_engine_config", PKV_EINVAL, pkv_engine_config(e, NULL));
    FAILS("pkv_prefill", PKV_EINVAL, pkv_prefill(s, 2, 1, q, k, v, out));
    FAILS("pkv_prefill", PKV_EINVAL, pkv_prefill(s, 0, 0, q, k, v, out));
    FAILS("pkv_prefill", PKV_EINVAL, pkv_prefill(s, 0, 1, NULL, k, v, out));
    FAILS("pkv_prefill", PKV_EINVAL, pkv_prefill(s, 0, 1, q, k, v, NULL));
    pkv_session *const pair[2] = {s, s}, *const mixed[2] = {s, o}, *const one[1] = {s};
    pkv_session *const nul[1] = {NULL};
    FAILS("pkv_decode_batch", PKV_EINVAL, pkv_decode_batch(e, 0, 0, one, q, out));
    FAILS("pkv_decode_batch", PKV_EINVAL, pkv_decode_batch(e, 0, 1, NULL, q, out));
    FAILS("pkv_decode_batch", PKV_EINVAL, pkv_decode_batch(e, 0, 1, one, NULL, out));
    FAILS("pkv_decode_batch", PKV_EINVAL, pkv_decode_batch(e, 2, 1, one, q, out));
    FAILS("pkv_decode_batch", PKV_EINVAL, pkv_decode_batch(e, 0, 2, pair, q, out));
    FAILS("pkv_decode_batch", PKV_EINVAL, pkv_decode_batch(e, 0, 2, mixed, q, out));
    FAILS("pkv_decode_batch", PKV_EINVAL, pkv_decode_batch(e, 0, 1, nul, q, out));
    FAILS("pkv_decode_batch", PKV_ESTATE, pkv_decode_batch(e, 1, 1, one, q, out));
    FAILS("pkv_session_save", PKV_EINVAL, pkv_session_save(s, NULL));
    FAILS("pkv_session_save", PKV_EINVAL, pkv_session_save(s, ""));
    FAILS("pkv_session_save", PKV_EIO, pkv_session_save(s, "/nonexistent/dir/s.pkv"));
    FAILS("pkv_session_load", PKV_EINVAL, pkv_session_load(e, NULL, &x));
    FAILS("pkv_session_load", PKV_EINVAL, pkv_session_load(e, "", &x));
    FAILS("pkv_session_load", PKV_EINVAL, pkv_session_load(e, junk, NULL));
    FAILS("pkv_session_load", PKV_EIO, pkv_session_load(e, "/nonexistent/s.pkv", &x));
    FAILS("pkv_session_load", PKV_EINVAL, pkv_session_load(e, junk, &x));
    FAILS("pkv_session_set_tokens", PKV_EINVAL, pkv_session_set_tokens(s, 3, NULL));
    FAILS("pkv_session_set_tokens", PKV_ERANGE, pkv_session_set_tokens(s, 1, ids)); /* layer 1 */
    FAILS("pkv_session_from_prefix", PKV_EINVAL, pkv_session_from_prefix(e, 3, NULL, &x, &u));
    FAILS("pkv_session_from_prefix", PKV_EINVAL, pkv_session_from_prefix(e, 3, ids, NULL, &u));
    FAILS("pkv_session_from_prefix", PKV_EINVAL, pkv_session_from_prefix(e, 3, ids, &x, NULL));
    FAILS("pkv_session_set_first", PKV_EINVAL, pkv_session_set_first(s, 1));
    FAILS("pkv_session_set_first", PKV_ESTATE, pkv_session_set_first(s, pkv_shard_align(e)));
    FAILS("pkv_session_set_first", PKV_EINVAL, pkv_session_set_first(s, 1ull << 63));
    FAILS("pkv_decode_partial", PKV_EINVAL, pkv_decode_partial(s, 2, q, 64, st, &nc));
    FAILS("pkv_decode_partial", PKV_EINVAL, pkv_decode_partial(s, 0, NULL, 64, st, &nc));
    FAILS("pkv_decode_partial", PKV_EINVAL, pkv_decode_partial(s, 0, q, 64, st, NULL));
    FAILS("pkv_decode_partial", PKV_ESTATE, pkv_decode_partial(s, 1, q, 64, st, &nc));
    FAILS("pkv_decode_partial", PKV_ERANGE, pkv_decode_partial(s, 0, q, 0, st, &nc));
    FAILS("pkv_decode_partial_at", PKV_EINVAL, pkv_decode_partial_at(s, 0, 3, q, 64, st, &nc));
    FAILS("pkv_decode_partial_at", PKV_EINVAL,
          pkv_decode_partial_at(s, 0, UINT64_MAX, q, 64, st, &nc));
    FAILS("pkv_decode_partial_at", PKV_ERANGE, pkv_decode_partial_at(s, 0, 11, q, 0, st, &nc));
    FAILS("pkv_partial_chunks", PKV_EINVAL, pkv_partial_chunks(s, 2, &u));
    FAILS("pkv_partial_chunks", PKV_EINVAL, pkv_partial_chunks(s, 0, NULL));
    FAILS("pkv_merge_partials", PKV_EINVAL, pkv_merge_partials(e, 0, st, out));
    FAILS("pkv_merge_partials", PKV_EINVAL, pkv_merge_partials(e, 1, NULL, out));
    FAILS("pkv_merge_partials", PKV_EINVAL, pkv_merge_partials(e, 1, st, NULL));
    FAILS("pkv_fold_partials", PKV_EINVAL, pkv_fold_partials(e, 0, st, out));
    FAILS("pkv_fold_partials", PKV_EINVAL, pkv_fold_partials(e, 1, NULL, out));
    FAILS("pkv_fold_partials", PKV_EINVAL, pkv_fold_partials(e, 1, st, NULL));
    FAILS("pkv_session_pages", PKV_EINVAL, pkv_session_pages(s, 2, 0, 1, pi, NULL));
    FAILS("pkv_session_pages", PKV_EINVAL, pkv_session_pages(s, 0, 0, 1, NULL, NULL));
    const uint64_t pos1[1] = {3};
    FAILS("pkv_rope_q", PKV_EINVAL, pkv_rope_q(e, 2, 1, pos1, q));
    FAILS("pkv_rope_q", PKV_EINVAL, pkv_rope_q(e, UINT32_MAX, 0, NULL, NULL));
    FAILS("pkv_rope_q", PKV_EINVAL, pkv_rope_q(e, 0, 1, NULL, q));
    FAILS("pkv_rope_q", PKV_EINVAL, pkv_rope_q(e, 0, 1, pos1, NULL));
    FAILS("pkv_session_discard", PKV_EINVAL, pkv_session_discard(s, 5, 3));
    FAILS("pkv_session_discard", PKV_EINVAL, pkv_session_discard(s, UINT64_MAX, 0));
    FAILS("pkv_session_discard", PKV_ERANGE, pkv_session_discard(s, 0, UINT64_MAX));
    FAILS("pkv_session_discard", PKV_ERANGE, pkv_session_discard(s, 13, 13));
    FAILS("pkv_session_discard", PKV_EINVAL, pkv_session_discard(s, 9, 10)); /* no rope */

    /* pkv_verify and pkv_session_commit (docs/speculative.md): the sizes and trees they
     * refuse, and what the other calls say while drafts are pending */
    float qd[3 * 16], kd[3 * 8], vd[3 * 8], od[3 * 16];
    pkvt_fill(&r, qd, 48, -1, 1);
    pkvt_fill(&r, kd, 24, -1, 1);
    pkvt_fill(&r, vd, 24, -1, 1);
    const int32_t tree[3] = {-1, 0, 0}, chain[3] = {-1, 0, 1};
    const int32_t bad[4][2] = {{0, 0}, {-2, 0}, {INT32_MIN, 0}, {-1, 1}};
    FAILS("pkv_verify", PKV_EINVAL, pkv_verify(s, 2, 3, tree, qd, kd, vd, od));
    FAILS("pkv_verify", PKV_EINVAL, pkv_verify(s, 0, 0, tree, qd, kd, vd, od));
    FAILS("pkv_verify", PKV_EINVAL,
          pkv_verify(s, 0, PKV_VERIFY_MAX_DRAFTS + 1, tree, qd, kd, vd, od));
    FAILS("pkv_verify", PKV_EINVAL, pkv_verify(s, 0, UINT32_MAX, tree, qd, kd, vd, od));
    FAILS("pkv_verify", PKV_EINVAL, pkv_verify(s, 0, 3, NULL, qd, kd, vd, od));
    FAILS("pkv_verify", PKV_EINVAL, pkv_verify(s, 0, 3, tree, NULL, kd, vd, od));
    FAILS("pkv_verify", PKV_EINVAL, pkv_verify(s, 0, 3, tree, qd, kd, vd, NULL));
    for (int i = 0; i < 4; i++)
        FAILS("pkv_verify", PKV_EINVAL, pkv_verify(s, 0, 2, bad[i], qd, kd, vd, od));
    FAILS("pkv_session_commit", PKV_ESTATE, pkv_session_commit(s, 0, NULL));
    ck_assert_int_eq(pkv_verify(s, 0, 3, tree, qd, kd, vd, od), PKV_OK);
    const uint32_t p_past[1] = {3}, p_huge[1] = {UINT32_MAX}, p_child[1] = {1};
    const uint32_t p_twice[2] = {0, 0}, p_keep[2] = {0, 2};
    FAILS("pkv_session_commit", PKV_EINVAL, pkv_session_commit(s, 4, p_keep));
    FAILS("pkv_session_commit", PKV_EINVAL, pkv_session_commit(s, UINT32_MAX, p_keep));
    FAILS("pkv_session_commit", PKV_EINVAL, pkv_session_commit(s, 1, NULL));
    FAILS("pkv_session_commit", PKV_EINVAL, pkv_session_commit(s, 1, p_past));
    FAILS("pkv_session_commit", PKV_EINVAL, pkv_session_commit(s, 1, p_huge));
    FAILS("pkv_session_commit", PKV_EINVAL, pkv_session_commit(s, 1, p_child));
    FAILS("pkv_session_commit", PKV_EINVAL, pkv_session_commit(s, 2, p_twice));
    /* while drafts are pending (stale_reason's truncate would say so too: another
     * call's reason first) */
    ck_assert_int_eq(pkv_session_memory(s, NULL), PKV_EINVAL);
    named(&w, "pkv_append", pkv_append(s, 0, k, v), PKV_ESTATE, __LINE__);
    FAILS("pkv_prefill", PKV_ESTATE, pkv_prefill(s, 0, 1, q, k, v, out));
    FAILS("pkv_session_fork", PKV_ESTATE, pkv_session_fork(s, &x));
    FAILS("pkv_session_truncate", PKV_ESTATE, pkv_session_truncate(s, 12));
    FAILS("pkv_session_save", PKV_ESTATE, pkv_session_save(s, path));
    /* two layers verified with different trees: made one again by a verify */
    ck_assert_int_eq(pkv_verify(s, 1, 3, chain, qd, kd, vd, od), PKV_OK);
    FAILS("pkv_session_commit", PKV_ESTATE, pkv_session_commit(s, 2, p_keep));
    ck_assert_int_eq(pkv_verify(s, 1, 3, tree, qd, kd, vd, od), PKV_OK);
    ck_assert_int_eq(pkv_session_commit(s, 2, p_keep), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 0), 14);
    ck_assert_uint_eq(pkv_session_len(s, 1), 2);

    /* calls that succeed leave the reason as it was */
    char before[256], after[256];
    stale_reason(&w, "-");
    pkv_engine_last_error(e, before, sizeof before);
    ck_assert_int_eq(pkv_decode(s, 0, q, out), PKV_OK);
    ck_assert_int_eq(pkv_session_memory(s, &m), PKV_OK);
    ck_assert_int_eq(pkv_engine_stats(e, &sts), PKV_OK);
    ck_assert_int_eq(pkv_engine_config(e, &cc), PKV_OK);
    ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
    ck_assert_int_eq(pkv_session_load(e, path, &x), PKV_OK);
    pkv_session_destroy(x);
    pkv_engine_last_error(e, after, sizeof after);
    ck_assert_str_eq(before, after);
    /* calls with no engine to reach record nothing (and cannot) */
    ck_assert_int_eq(pkv_append(NULL, 0, k, v), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode(NULL, 0, q, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_truncate(NULL, 0), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode_batch(NULL, 0, 1, one, q, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_engine_last_error(e, NULL, 8), PKV_EINVAL);
    pkv_engine_last_error(e, after, sizeof after);
    ck_assert_str_eq(before, after);

    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(o);
    pkv_engine_destroy(other);
    pkv_engine_destroy(e); /* destroys s too */
    pkvt_remove_dir(dir);
}
END_TEST

/* ---- extremes of positions and sizes ---------------------------------------------------- */

/* Memory figures, lengths and decode of s: "nothing changed" is these, bitwise. */
typedef struct {
    uint64_t len[2];
    pkv_memory m;
    float out[2][16];
} snap;

static snap take(pkv_session *s, const float *q)
{
    snap z;
    memset(&z, 0, sizeof z);
    for (uint32_t l = 0; l < 2; l++) {
        z.len[l] = pkv_session_len(s, l);
        if (z.len[l] > pkvi_btable_first(s->layers[l]))
            ck_assert_int_eq(pkv_decode(s, l, q, z.out[l]), PKV_OK);
    }
    ck_assert_int_eq(pkv_session_memory(s, &z.m), PKV_OK);
    return z;
}

static void same(const snap *a, const snap *b, const char *what)
{
    ck_assert_msg(memcmp(a, b, sizeof *a) == 0, "%s changed the session", what);
}

START_TEST(extremes_of_positions_and_sizes)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    pkv_layer_config lc[2] = {{.window = 5, .rollback_tokens = 2, .sink_tokens = 1}, {0}};
    pkv_config c = pkvt_config(2, 4, 2, 4, 2, PKV_F32);
    c.layer_cfg = lc;
    c.n_threads = 1;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e);
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(s, &r, l, 21, 1, 1);
    float q[16], out[16], states[64 * 24];
    pkvt_fill(&r, q, 16, -1, 1);
    const uint64_t big[3] = {1ull << 63, UINT64_MAX - 1, UINT64_MAX};
    snap a = take(s, q), b;

    /* pkv_session_truncate: past the length and huge are ERANGE; the length is a no-op */
    ck_assert_int_eq(pkv_session_truncate(s, 22), PKV_ERANGE);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(pkv_session_truncate(s, big[i]), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_truncate(s, 21), PKV_OK);
    b = take(s, q);
    same(&a, &b, "truncate past the end");
    /* into the window's released pages: ERANGE; to 0: every layer empty */
    ck_assert_int_eq(pkv_session_truncate(s, 3), PKV_ERANGE);
    b = take(s, q);
    same(&a, &b, "truncate into released positions");

    /* pkv_session_set_tokens: n up to every layer's length */
    int32_t ids[32];
    for (int i = 0; i < 32; i++)
        ids[i] = i;
    ck_assert_int_eq(pkv_session_set_tokens(s, 0, NULL), PKV_OK);
    ck_assert_int_eq(pkv_session_set_tokens(s, 22, ids), PKV_ERANGE);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(pkv_session_set_tokens(s, big[i], ids), PKV_ERANGE);
    ck_assert_int_eq(pkv_session_set_tokens(s, 21, ids), PKV_OK);
    a = take(s, q); /* the record is not part of what follows */
    /* pkv_session_from_prefix: n 0 and 1 share nothing; a huge n reads ids only as
     * far as the index matches them (here the first page: the next ids differ) */
    pkv_session *f = NULL;
    uint64_t got = 99;
    ck_assert_int_eq(pkv_session_from_prefix(e, 0, NULL, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 0);
    pkv_session_destroy(f);
    ck_assert_int_eq(pkv_session_from_prefix(e, 1, ids, &f, &got), PKV_OK);
    ck_assert_uint_eq(got, 0);
    pkv_session_destroy(f);
    int32_t other[32];
    memcpy(other, ids, sizeof other);
    other[3] = -1; /* page 1 (ids 2, 3) differs from the record */
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(pkv_session_from_prefix(e, big[i], other, &f, &got), PKV_OK);
        ck_assert_uint_le(got, 2);
        pkv_session_destroy(f);
    }

    /* pkv_session_pages: first and n clipped to the table, never past it */
    pkv_page_info pi[16];
    uint64_t n_out = 99;
    const uint64_t n_pages = (21 + 1) / 2;
    ck_assert_int_eq(pkv_session_pages(s, 1, 0, 0, NULL, &n_out), PKV_OK);
    ck_assert_uint_eq(n_out, 0);
    ck_assert_int_eq(pkv_session_pages(s, 1, 0, UINT64_MAX, pi, &n_out), PKV_OK);
    ck_assert_uint_eq(n_out, n_pages);
    ck_assert_int_eq(pkv_session_pages(s, 1, n_pages - 1, UINT64_MAX, pi, &n_out), PKV_OK);
    ck_assert_uint_eq(n_out, 1);
    const uint64_t firsts[4] = {n_pages, 1ull << 63, UINT64_MAX - 1, UINT64_MAX};
    for (int i = 0; i < 4; i++) {
        ck_assert_int_eq(pkv_session_pages(s, 1, firsts[i], UINT64_MAX, pi, &n_out), PKV_OK);
        ck_assert_uint_eq(n_out, 0);
    }

    /* pkv_decode_partial's max_chunks: 0 says how many; the type's maximum is fine */
    uint32_t nc = 0;
    ck_assert_int_eq(pkv_decode_partial(s, 1, q, 0, states, &nc), PKV_ERANGE);
    ck_assert_uint_eq(nc, 1);
    ck_assert_int_eq(pkv_decode_partial(s, 1, q, 1, states, &nc), PKV_OK);
    ck_assert_int_eq(pkv_decode_partial(s, 1, q, UINT32_MAX, states, &nc), PKV_OK);
    ck_assert_uint_eq(nc, 1);
    /* pkv_merge_partials / pkv_fold_partials: n_chunks 0 is EINVAL; 1 and many fold */
    ck_assert_int_eq(pkv_merge_partials(e, 0, states, out), PKV_EINVAL);
    ck_assert_int_eq(pkv_merge_partials(e, 1, states, out), PKV_OK);
    ck_assert_mem_eq(out, a.out[1], sizeof out);
    for (int i = 1; i < 64; i++) /* empty states after the first change nothing */
        for (int h = 0; h < 4; h++) {
            float *z = states + (size_t)i * 24 + (size_t)h * 6;
            z[0] = -INFINITY;
            memset(z + 1, 0, 5 * sizeof(float));
        }
    ck_assert_int_eq(pkv_merge_partials(e, 64, states, out), PKV_OK);
    ck_assert_mem_eq(out, a.out[1], sizeof out);
    ck_assert_int_eq(pkv_fold_partials(e, 64, states, states), PKV_OK);
    ck_assert_int_eq(pkv_fold_partials(e, 0, states, states), PKV_EINVAL);

    /* pkv_decode_batch's n: 0 is EINVAL; past a run of 64 sessions is fine */
    enum { NB = 65 };
    pkv_session *many[NB];
    float *qs = pkvt_alloc(NB * 16 * sizeof(float)), *outs = pkvt_alloc(NB * 16 * sizeof(float));
    for (int i = 0; i < NB; i++) {
        ck_assert_int_eq(pkv_session_fork(s, &many[i]), PKV_OK);
        memcpy(qs + i * 16, q, sizeof q);
    }
    ck_assert_int_eq(pkv_decode_batch(e, 1, 0, many, qs, outs), PKV_EINVAL);
    ck_assert_int_eq(pkv_decode_batch(e, 1, 1, many, qs, outs), PKV_OK);
    ck_assert_int_eq(pkv_decode_batch(e, 1, NB, many, qs, outs), PKV_OK);
    for (int i = 0; i < NB; i++)
        ck_assert_mem_eq(outs + i * 16, a.out[1], sizeof out);
    pkv_session *keep = many[NB - 1];
    many[NB - 1] = many[3]; /* a session twice, found by the sorted copy */
    ck_assert_int_eq(pkv_decode_batch(e, 1, NB, many, qs, outs), PKV_EINVAL);
    many[NB - 1] = keep;
    for (int i = 0; i < NB; i++)
        pkv_session_destroy(many[i]);
    free(qs);
    free(outs);

    /* pkv_prefill's n: 0 is EINVAL; 1 is an append and a decode */
    ck_assert_int_eq(pkv_prefill(s, 1, 0, q, q, q, out), PKV_EINVAL);
    b = take(s, q);
    same(&a, &b, "prefill of 0");

    /* pkv_session_set_first: 0 is a no-op, aligned first values only, at most 2^63 - 1 */
    pkv_session *t = pkvt_session(e);
    const uint64_t A = pkv_shard_align(e);
    ck_assert_int_eq(pkv_session_set_first(t, 0), PKV_OK);
    ck_assert_int_eq(pkv_session_set_first(t, 1), PKV_EINVAL);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(pkv_session_set_first(t, big[i]), PKV_EINVAL);
    /* the largest aligned first: its table of holes does not fit memory */
    const uint64_t far = ((1ull << 63) - 1) / A * A;
    ck_assert_int_eq(pkv_session_set_first(t, far), PKV_ENOMEM);
    ck_assert_uint_eq(pkv_session_len(t, 0), 0);
    ck_assert_int_eq(pkv_session_set_first(t, A), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(t, 1), A);
    pkv_session_destroy(t);

    /* pkv_session_file_check's max_layers: 0 writes no length, more than the file
     * holds writes only its layers */
    char dir[512], path[600];
    pkvt_scratch_dir(dir, sizeof dir, "edges");
    snprintf(path, sizeof path, "%s/s.pkv", dir);
    ck_assert_int_eq(pkv_session_save(s, path), PKV_OK);
    pkv_file_info fi;
    uint64_t lens[3] = {7, 7, 7};
    ck_assert_int_eq(pkv_session_file_check(path, &fi, lens, 0), PKV_OK);
    ck_assert_uint_eq(lens[0], 7);
    ck_assert_int_eq(pkv_session_file_check(path, &fi, lens, 1), PKV_OK);
    ck_assert_uint_eq(lens[0], 21);
    ck_assert_uint_eq(lens[1], 7);
    ck_assert_int_eq(pkv_session_file_check(path, &fi, lens, UINT32_MAX), PKV_OK);
    ck_assert_uint_eq(lens[1], 21);
    ck_assert_uint_eq(lens[2], 7);
    pkvt_remove_dir(dir);

    /* pkv_engine_last_error's size: 0 is EINVAL, 1 is "" */
    char one[1] = {'x'};
    ck_assert_int_eq(pkv_engine_last_error(e, one, 0), PKV_EINVAL);
    ck_assert_int_eq(one[0], 'x');
    ck_assert_int_eq(pkv_engine_last_error(e, one, 1), PKV_OK);
    ck_assert_int_eq(one[0], '\0');

    b = take(s, q);
    same(&a, &b, "the calls above");
    ck_assert_int_eq(pkv_session_truncate(s, 0), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 0), 0);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
}
END_TEST

/* pkv_verify's n from 1 to PKV_VERIFY_MAX_DRAFTS, as a chain and as roots; commit's
 * n_keep from 0 to the tree's depth; a refused verify or commit leaves the session,
 * and a tree pending before it, as they were. */
START_TEST(extremes_of_verify_and_commit)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    pkv_config c = pkvt_config(2, 4, 2, 4, 2, PKV_F32);
    c.n_threads = 1;
    pkv_engine *e = pkvt_engine_cfg(&c);
    pkv_session *s = pkvt_session(e);
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(s, &r, l, 5, 1, 1);
    enum { N = PKV_VERIFY_MAX_DRAFTS };
    float *q = pkvt_alloc(N * 16 * sizeof(float)), *k = pkvt_alloc(N * 8 * sizeof(float));
    float *v = pkvt_alloc(N * 8 * sizeof(float)), *out = pkvt_alloc(N * 16 * sizeof(float));
    int32_t *par = pkvt_alloc(N * sizeof(int32_t));
    uint32_t *path = pkvt_alloc(N * sizeof(uint32_t));
    pkvt_fill(&r, q, N * 16, -1, 1);
    pkvt_fill(&r, k, N * 8, -1, 1);
    pkvt_fill(&r, v, N * 8, -1, 1);
    snap a = take(s, q), b;

    /* n 1: verified, then dropped (n_keep 0, path NULL): nothing changed */
    par[0] = -1;
    ck_assert_int_eq(pkv_verify(s, 1, 1, par, q, k, v, out), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 1), 5);
    ck_assert_int_eq(pkv_session_commit(s, 0, NULL), PKV_OK);
    b = take(s, q);
    same(&a, &b, "verify of 1 and commit of 0");
    ck_assert_int_eq(pkv_session_commit(s, 0, NULL), PKV_ESTATE);

    /* bad parents and sizes with no tree pending: nothing changed */
    const int32_t wrong[5] = {1, 2, -2, INT32_MIN, INT32_MAX};
    for (int i = 0; i < 5; i++) {
        par[0] = -1;
        par[1] = wrong[i];
        ck_assert_int_eq(pkv_verify(s, 1, 2, par, q, k, v, out), PKV_EINVAL);
    }
    ck_assert_int_eq(pkv_verify(s, 1, N + 1, par, q, k, v, out), PKV_EINVAL);
    b = take(s, q);
    same(&a, &b, "refused verifies");

    /* n PKV_VERIFY_MAX_DRAFTS as a chain: n_keep past it is refused, the tree stays
     * pending through a refused verify, and the whole chain is kept */
    for (uint32_t i = 0; i < N; i++) {
        par[i] = (int32_t)i - 1;
        path[i] = i;
    }
    ck_assert_int_eq(pkv_verify(s, 1, N, par, q, k, v, out), PKV_OK);
    /* a discard would move rows under the pending drafts: refused before anything */
    ck_assert_int_eq(pkv_session_discard(s, 0, 1), PKV_ESTATE);
    ck_assert_uint_eq(pkv_session_len(s, 1), 5);
    ck_assert_int_eq(pkv_session_commit(s, N + 1, path), PKV_EINVAL);
    ck_assert_int_eq(pkv_session_commit(s, UINT32_MAX, path), PKV_EINVAL);
    par[N - 1] = N - 1;
    ck_assert_int_eq(pkv_verify(s, 1, N, par, q, k, v, out), PKV_EINVAL);
    par[N - 1] = N - 2;
    ck_assert_int_eq(pkv_session_commit(s, N, path), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 1), 5 + N);
    ck_assert_uint_eq(pkv_session_len(s, 0), 5);

    /* n PKV_VERIFY_MAX_DRAFTS roots: a path is one of them */
    for (uint32_t i = 0; i < N; i++)
        par[i] = -1;
    ck_assert_int_eq(pkv_verify(s, 0, N, par, q, k, v, out), PKV_OK);
    path[0] = 0;
    path[1] = 1;
    ck_assert_int_eq(pkv_session_commit(s, 2, path), PKV_EINVAL);
    path[0] = N - 1;
    ck_assert_int_eq(pkv_session_commit(s, 1, path), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 0), 6);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);

    free(q);
    free(k);
    free(v);
    free(out);
    free(par);
    free(path);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
}
END_TEST

/* The engine-free calls at their size extremes: zero sizes are EINVAL (or 0), sizes
 * whose products overflow are refused before any buffer is read. */
/* ---- extremes of RoPE and discard (SPEC §14) ------------------------------------------ */

/* pkv_rope_q at the far positions stays finite and keeps each pair's norm (a rotation);
 * the same position gives the same bits; a layer without rope leaves q alone; n 0 with
 * NULL arrays does nothing. pkv_session_discard at every extreme of (p0, p1): the
 * refused ones change nothing, p0 == p1 changes nothing, [0, len) of the longest layer
 * empties it. */
START_TEST(extremes_of_rope_and_discard)
{
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    pkv_layer_config lc[2] = {{.rope = PKV_ROPE_NEOX}, {.rope = PKV_ROPE_NORM, .window = 6}};
    pkv_config c = pkvt_config(2, 4, 2, 4, 2, PKV_F32);
    c.layer_cfg = lc;
    c.n_threads = 1;
    pkv_engine *e = pkvt_engine_cfg(&c);
    const uint64_t far[7] = {0, 1, 1ull << 24, (1ull << 24) + 1, 1ull << 40, 1ull << 63,
                             UINT64_MAX};
    float q[7][16], q0[7][16];
    pkvt_fill(&r, &q0[0][0], 7 * 16, -1, 1);
    memcpy(q, q0, sizeof q);
    ck_assert_int_eq(pkv_rope_q(e, 0, 0, NULL, NULL), PKV_OK);
    ck_assert_int_eq(pkv_rope_q(e, 0, 7, far, &q[0][0]), PKV_OK);
    for (int j = 0; j < 7; j++)
        for (int h = 0; h < 4; h++)
            for (int i = 0; i < 2; i++) { /* NEOX pairs (i, i + 2) of each head of 4 */
                const float *a = &q0[j][4 * h], *b = &q[j][4 * h];
                const double n0 = (double)a[i] * a[i] + (double)a[i + 2] * a[i + 2];
                const double n1 = (double)b[i] * b[i] + (double)b[i + 2] * b[i + 2];
                ck_assert(isfinite(b[i]) && isfinite(b[i + 2]));
                ck_assert_msg(fabs(n1 - n0) <= 1e-5 * (n0 + 1e-30), "pos %llu: norm %g -> %g",
                              (unsigned long long)far[j], n0, n1);
            }
    ck_assert_mem_eq(q[0], q0[0], sizeof q[0]); /* position 0 turns by nothing */
    float again[16];
    memcpy(again, q0[5], sizeof again);
    ck_assert_int_eq(pkv_rope_q(e, 0, 1, &far[5], again), PKV_OK);
    ck_assert_mem_eq(again, q[5], sizeof again);

    pkv_session *s = pkvt_session(e);
    for (uint32_t l = 0; l < 2; l++)
        pkvt_append_random(s, &r, l, 21, 1, 1);
    float qq[16];
    pkvt_fill(&r, qq, 16, -1, 1);
    snap a = take(s, qq), b;
    static const uint64_t bad[][2] = {{1, 0}, {UINT64_MAX, 0}, {UINT64_MAX, UINT64_MAX - 1},
                                      {0, 22}, {21, 22}, {0, UINT64_MAX}, {22, 22},
                                      {UINT64_MAX, UINT64_MAX}, {1ull << 63, 1ull << 63},
                                      {1, 16}}; /* the last: layer 1's window */
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const pkv_status st = pkv_session_discard(s, bad[i][0], bad[i][1]);
        ck_assert_msg(st == PKV_EINVAL || st == PKV_ERANGE, "discard [%llu, %llu): %s",
                      (unsigned long long)bad[i][0], (unsigned long long)bad[i][1],
                      pkv_status_str(st));
        b = take(s, qq);
        same(&a, &b, "a refused discard");
    }
    for (uint64_t p = 0; p <= 21; p += 7) { /* nothing to drop */
        ck_assert_int_eq(pkv_session_discard(s, p, p), PKV_OK);
        b = take(s, qq);
        same(&a, &b, "discard [p, p)");
    }
    ck_assert_int_eq(pkv_session_discard(s, 20, 21), PKV_OK); /* the last position: a cut */
    ck_assert_uint_eq(pkv_session_len(s, 0), 20);
    ck_assert_int_eq(pkv_session_discard(s, 0, 20), PKV_OK);
    ck_assert_uint_eq(pkv_session_len(s, 0), 0);
    ck_assert_uint_eq(pkv_session_len(s, 1), 0);
    ck_assert_int_eq(pkv_session_discard(s, 0, 0), PKV_OK);
    ck_assert_int_eq(pkv_session_discard(NULL, 0, 0), PKV_EINVAL);
    ck_assert_int_eq(pkv_rope_q(NULL, 0, 0, NULL, NULL), PKV_EINVAL);
    ck_assert_int_eq(pkv_engine_check(e), PKV_OK);
    pkv_engine_destroy(e);
}
END_TEST

START_TEST(extremes_of_the_engine_free_calls)
{
    float x[4] = {0}, y[4];
    const uint32_t M = UINT32_MAX;
    ck_assert_int_eq(pkv_causal_attention(0, 1, 1, 1, 0, x, x, x, y), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(1, 0, 1, 1, 0, x, x, x, y), PKV_EINVAL);
    ck_assert_int_eq(pkv_causal_attention(M, M, 1, M, 0, x, x, x, y), PKV_EINVAL);
    ck_assert_int_eq(pkv_attention_reference(M, M, 1, M, M, 0, NULL, x, x, x, y), PKV_EINVAL);
    ck_assert_int_eq(pkv_attention_reference(1, 1, 1, 1, 0, 0, NULL, x, x, x, y), PKV_OK);
    ck_assert_int_eq(pkv_mha_forward(0, 1, 1, 1, x, x, x, x, x, y), PKV_EINVAL);
    ck_assert_int_eq(pkv_mha_forward(M, M, 1, 1, x, x, x, x, x, y), PKV_EINVAL);
    uint64_t b = 1;
    ck_assert_int_eq(pkv_kv_cache_bytes(0, 8, 128, 8192, 1, 2, &b), PKV_OK);
    ck_assert_uint_eq(b, 0);
    ck_assert_int_eq(pkv_kv_cache_bytes(UINT64_MAX, 1, 1, 1, 1, 1, &b), PKV_ERANGE);
    ck_assert_int_eq(pkv_kv_cache_bytes(1ull << 32, 1ull << 31, 1, 1, 1, 1, &b), PKV_ERANGE);
    ck_assert_int_eq(pkv_kv_cache_bytes(1ull << 31, 1ull << 31, 1, 1, 1, 1, &b), PKV_OK);
    ck_assert_uint_eq(b, 1ull << 63);
    ck_assert_uint_eq(pkv_row_bytes(PKV_F32, 0), 0);
    ck_assert_uint_eq(pkv_row_bytes(PKV_Q8, 1), 3);
    ck_assert_uint_eq(pkv_row_bytes(PKV_F32, M), 4ull * M);
    ck_assert_uint_eq(pkv_row_bytes(PKV_Q4, M), ((uint64_t)M + 31) / 32 * 2 + ((uint64_t)M + 1) / 2);
    ck_assert_uint_eq(pkv_row_bytes((pkv_dtype)9, 4), 0);
    y[0] = 5.0f;
    pkv_dtype_round_row(PKV_Q8, 0, x, y);
    ck_assert(y[0] == 5.0f);
    pkv_dtype_round_row(PKV_Q8, 4, NULL, y);
    ck_assert(y[0] == 5.0f);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("edges");
    TCase *tc = tcase_create("edges");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, every_rule_is_refused_alike);
    tcase_add_test(tc, random_configs_are_judged_alike);
    tcase_add_test(tc, every_failure_names_its_call);
    tcase_add_test(tc, extremes_of_positions_and_sizes);
    tcase_add_test(tc, extremes_of_rope_and_discard);
    tcase_add_test(tc, extremes_of_verify_and_commit);
    tcase_add_test(tc, extremes_of_the_engine_free_calls);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

/*
 * stress/mpi.c - `pagedkv stress --mpi`: one long context sharded by position over the
 * ranks of `mpirun -np R` (context parallel, docs/sharding.md).
 *
 * Owns: the split of the context, the token loop of every rank, the decode of a
 * sharded context (each rank's partial states gathered to the rank that owns the query
 * and merged there in position order), the bitwise check against a single engine, and
 * the report (rank 0: text, or --json).
 *
 * The split: with A = pkv_shard_align, the context's ceil(ctx / A) chunks are cut into
 * R contiguous runs, rank r holding chunks [r*nc/R, (r+1)*nc/R): its session starts at
 * pkv_session_set_first(lo_r). The context grows in position order; at each decode
 * point n every rank holds its part of [0, n), the rank holding n - 1 owns the query.
 * Rows are a function of (seed, position), so every rank makes the rows it holds and
 * the checker makes the prefix, with nothing sent.
 *
 * A decode (per layer): every rank that holds positions runs pkv_decode_partial_at
 * for a query at n - 1; the counts and then the states go to the owner (MPI_Gather,
 * MPI_Gatherv: in rank order, which is position order); the owner folds them with
 * pkv_merge_partials. Latency is the owner's wall time from a barrier to the merged
 * output of every layer, median over --reps. Bytes per step: the states the other
 * ranks send (n_chunks * n_heads * (head_dim_v + 2) floats each) plus the counts.
 *
 * The check: rank 0 also holds positions [0, --check) in a second engine as one
 * whole session; at every decode point within it, the owner's merged output must
 * equal that engine's pkv_decode to the bit. A mismatch is exit 1.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/json.h"
#include "common/mpi_common.h"
#include "common/model.h"
#include "common/mpi_tools.h"
#include "common/opt.h"

#define CMD "stress"

static void usage(FILE *f)
{
    fputs("usage: mpirun -np R pagedkv stress --mpi [OPTIONS]\n\n"
          "One context sharded by position over R ranks: rank r holds a contiguous range\n"
          "of every layer's positions (a multiple of pkv_shard_align wide); each decode\n"
          "gathers the ranks' partial softmax states to the rank holding the query and\n"
          "merges them in position order - bitwise what one engine holding the whole\n"
          "gives, which is checked on a prefix. Prints latency against context, bytes on\n"
          "the wire per decode step and memory per rank. The model is described as for\n"
          "one run on one machine (pagedkv stress --help):\n\n", f);
    cli_model_usage(f);
    fputs("run:\n"
          "  --ctx N              positions (default 65536; k/m/g suffixes)\n"
          "  --threads N          engine threads per rank (default 1)\n"
          "  --points N           log-spaced decode points (default 12)\n"
          "  --reps N             timed decodes per point (default 3)\n"
          "  --check N            bitwise check on positions [0, N) against one engine on\n"
          "                       rank 0 (default min(ctx, 16384); 0 = off)\n"
          "  --exchange MODE      gather: every rank's chunk states go to the owner, which\n"
          "                       folds them (default); chain: rank 0 folds its states\n"
          "                       into one (pkv_fold_partials) and passes it on, each rank\n"
          "                       folds its own after it, the owner finishes - one state\n"
          "                       per hop instead of every chunk's, the same bits\n"
          "  --seed N             seed of the rows (default 1)\n"
          "  --timeout S          give up when the other ranks have not answered for S\n"
          "                       seconds (a rank stopped or died): a message, exit 1\n"
          "                       (default 120; longer than any one rank's work between\n"
          "                       two exchanges). Waits sleep: no rank spins meanwhile\n"
          "  --json               one JSON object on stdout (rank 0)\n"
          "  --help               this text\n\n"
          "stress's options of several sessions, forks, the prefix cache, a budget and\n"
          "plots (--sessions, --fork-every, --prefix, --budget, --svg, ...) do not apply\n"
          "to one sharded context and are refused.\n"
          "Exit 1 on a library error or a bitwise mismatch, 2 on a usage error.\n", f);
}

typedef struct {
    uint64_t ctx, check, seed;
    uint32_t layers, heads, kv_heads, head_dim, head_dim_v, block_tokens, threads;
    uint32_t points, reps;
    pkv_dtype dtype;
    cli_variant v;            /* the model's variant: window pattern, sinks, cap, ... */
    double timeout;           /* --timeout, seconds */
    bool mpi, json, check_set;
    const char *exchange;     /* "gather" or "chain" */
} ms_opts;

/* n values in [-1, 1) from (seed, what, index): the same on every rank. */
static void fill(float *x, size_t n, uint64_t seed, uint64_t what, uint64_t index)
{
    uint64_t s = seed * 0x2545f4914f6cdd1dull ^ what * 0x9e3779b97f4a7c15ull ^ index;
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((double)(cli_splitmix64(&s) >> 11) * 0x1.0p-52 - 1.0);
}

typedef struct {
    uint64_t ctx;
    int owner;
    double us;                /* owner: median wall time of one decode of all layers */
    uint64_t bytes;           /* sent to the owner per decode step, all layers */
    uint64_t states;          /* states merged per layer */
    int checked, equal;
} ms_point;

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Append positions [from, to) of every layer to s (rows of (seed, position)). */
static pkv_status append_rows(pkv_session *s, const ms_opts *o, uint32_t dv, float *k,
                              float *v, uint64_t from, uint64_t to)
{
    const size_t kd = (size_t)o->kv_heads * o->head_dim, vd = (size_t)o->kv_heads * dv;
    for (uint64_t t = from; t < to; t++) {
        fill(k, kd, o->seed, 1, t);
        fill(v, vd, o->seed, 2, t);
        for (uint32_t l = 0; l < o->layers; l++) {
            const pkv_status st = pkv_append(s, l, k, v);
            if (st != PKV_OK)
                return st;
        }
    }
    return PKV_OK;
}

static int run(const void *opts, int rank, int R)
{
    const ms_opts *o = opts;
    const uint32_t dv = o->head_dim_v ? o->head_dim_v : o->head_dim;
    pkv_config c = cli_config(o->layers, o->heads, o->kv_heads, o->head_dim, o->block_tokens,
                              o->dtype, o->threads);
    c.head_dim_v = o->head_dim_v;
    /* the layers as stress builds them (cli_variant_layers: a preset's pattern too),
     * the sink logits seeded rather than zero */
    bool oom = false;
    float *sigma = NULL;
    pkv_layer_config *lc = cli_variant_layers(&o->v, o->layers, o->heads, &sigma, &oom);
    if (oom)
        return cli_fail(CMD, "out of memory");
    if (sigma)
        fill(sigma, o->heads, o->seed, 3, 0);
    c.layer_cfg = lc;
    pkv_engine *e = NULL, *whole_e = NULL;
    pkv_session *s = NULL, *whole = NULL;
    int rc = CLI_OK;
    pkv_status st = pkv_engine_create(&c, &e);
    if (st != PKV_OK) {
        char why[256];
        rc = pkv_config_explain(&c, why, sizeof why) != PKV_OK
                 ? cli_usage_error(CMD, "the engine rejects this configuration: %s", why)
                 : cli_fail(CMD, "cannot create the engine: %s", pkv_status_str(st));
        free(lc);
        free(sigma);
        return rc;
    }
    const uint64_t A = pkv_shard_align(e);
    const uint64_t nc = (o->ctx + A - 1) / A;
    uint64_t *lo = calloc((size_t)R + 1, sizeof *lo);
    const size_t qd = (size_t)o->heads * o->head_dim, od = (size_t)o->heads * dv;
    const size_t ps = (size_t)o->heads * (dv + 2);
    /* the owner receives at most every chunk of [0, ctx) plus a sink-logit state and a
     * window's split chunk per rank */
    const uint64_t max_states = nc + 2 * (uint64_t)R + 3;
    const bool chain = strcmp(o->exchange, "chain") == 0;
    float *k = calloc((size_t)o->kv_heads * o->head_dim, sizeof *k);
    float *v = calloc((size_t)o->kv_heads * dv, sizeof *v);
    float *q = calloc(qd * o->layers, sizeof *q);
    float *out = calloc(od * o->layers, sizeof *out), *ref = calloc(od, sizeof *ref);
    float *mine = calloc((size_t)max_states * ps, sizeof *mine);
    float *all = calloc((size_t)max_states * ps, sizeof *all);
    int *counts = calloc((size_t)R, sizeof *counts), *displs = calloc((size_t)R, sizeof *displs);
    double *lat = calloc(o->reps, sizeof *lat);
    ms_point *pts = calloc(o->points, sizeof *pts);
    uint64_t *sched = calloc(o->points, sizeof *sched);
    if (!lo || !k || !v || !q || !out || !ref || !mine || !all || !counts || !displs ||
        !lat || !pts || !sched) {
        rc = cli_fail(CMD, "rank %d: out of memory (%llu states of %zu floats)", rank,
                      (unsigned long long)max_states, ps);
        goto done;
    }
    for (int r = 0; r <= R; r++) {
        const uint64_t p = (uint64_t)r * nc / (uint64_t)R * A;
        lo[r] = p < o->ctx ? p : o->ctx;
    }
    lo[R] = o->ctx;
    if ((st = pkv_session_create(e, &s)) != PKV_OK ||
        (st = pkv_session_set_first(s, lo[rank])) != PKV_OK) {
        rc = cli_fail(CMD, "rank %d: session: %s", rank, pkv_status_str(st));
        goto done;
    }
    const uint64_t check = o->check_set ? (o->check < o->ctx ? o->check : o->ctx)
                                        : (o->ctx < 16384 ? o->ctx : 16384);
    if (rank == 0 && check) {
        if ((st = pkv_engine_create(&c, &whole_e)) != PKV_OK ||
            (st = pkv_session_create(whole_e, &whole)) != PKV_OK) {
            rc = cli_fail(CMD, "the checking engine: %s", pkv_status_str(st));
            goto done;
        }
    }
    /* log-spaced decode points in [min(ctx, 64), ctx], ascending, unique */
    uint32_t n_pts = 0;
    const double a0 = log((double)(o->ctx < 64 ? o->ctx : 64)), a1 = log((double)o->ctx);
    for (uint32_t i = 0; i < o->points; i++) {
        uint64_t n = (uint64_t)llround(exp(a0 + (a1 - a0) * i / (o->points - 1)));
        if (i == o->points - 1 || n > o->ctx)
            n = o->ctx;
        if (n && (n_pts == 0 || n > sched[n_pts - 1]))
            sched[n_pts++] = n;
    }
    /* the bitwise check also at the prefix's own end */
    uint64_t held = lo[rank], whole_len = 0;
    const uint64_t mine_hi = lo[rank + 1];
    int mismatches = 0, checks = 0;
    for (uint32_t pi = 0; pi < n_pts && rc == CLI_OK; pi++) {
        const uint64_t n = sched[pi];
        /* grow: this rank's positions below n, and the checker's prefix */
        const uint64_t to = n < mine_hi ? n : mine_hi;
        if (to > held) {
            if ((st = append_rows(s, o, dv, k, v, held, to)) != PKV_OK) {
                rc = cli_fail(CMD, "rank %d: append: %s", rank, pkv_status_str(st));
                break;
            }
            held = to;
        }
        if (whole && whole_len < (n < check ? n : check)) {
            const uint64_t wt = n < check ? n : check;
            if ((st = append_rows(whole, o, dv, k, v, whole_len, wt)) != PKV_OK) {
                rc = cli_fail(CMD, "checker: append: %s", pkv_status_str(st));
                break;
            }
            whole_len = wt;
        }
        int owner = 0;
        while (owner + 1 < R && lo[owner + 1] < n)
            owner++;
        for (uint32_t l = 0; l < o->layers; l++)
            fill(q + l * qd, qd, o->seed, 4 + l, n);
        uint64_t sent = 0, merged = 0;
        int fail = 0;
        for (uint32_t rep = 0; rep < o->reps; rep++) {
            mpi_barrier("starting a decode step");
            const double t0 = MPI_Wtime();
            sent = merged = 0;
            for (uint32_t l = 0; l < o->layers; l++) {
                uint32_t got = 0;
                if (held > lo[rank]) {
                    st = pkv_decode_partial_at(s, l, n - 1, q + l * qd,
                                               (uint32_t)max_states - 1, mine, &got);
                    if (st != PKV_OK) {
                        fail = 1;
                        got = 0;
                    }
                }
                if (chain) {
                    /* [the state folded so far, this rank's states]: folded again in
                     * position order, passed to the next rank up to the owner */
                    if (rank > owner)
                        continue;
                    memmove(mine + ps, mine, (size_t)got * ps * sizeof(float));
                    for (uint32_t j = 0; j < o->heads; j++) { /* rank 0: the empty state */
                        float *x = mine + j * (ps / o->heads);
                        x[0] = -INFINITY;
                        x[1] = 0.0f;
                        memset(x + 2, 0, (size_t)dv * sizeof(float));
                    }
                    if (rank > 0)
                        mpi_recv(mine, (int)ps, MPI_FLOAT, rank - 1, 11,
                                 "receiving the folded state of the rank before");
                    if (rank < owner) {
                        if (pkv_fold_partials(e, got + 1, mine, mine) != PKV_OK)
                            fail = 1;
                        mpi_send(mine, (int)ps, MPI_FLOAT, rank + 1, 11,
                                 "passing the folded state on");
                    } else {
                        if (pkv_merge_partials(e, got + 1, mine, out + l * od) != PKV_OK)
                            fail = 1;
                        sent += (uint64_t)owner * ps * sizeof(float);
                        merged = got + 1;
                    }
                    continue;
                }
                int cnt = (int)(got * ps);
                mpi_gather(&cnt, 1, MPI_INT, counts, 1, MPI_INT, owner,
                           "gathering the state counts");
                if (rank == owner) {
                    int total = 0;
                    for (int r = 0; r < R; r++) {
                        displs[r] = total;
                        total += counts[r];
                        if (r != owner)
                            sent += (uint64_t)counts[r] * sizeof(float) + sizeof(int);
                    }
                    merged = (uint64_t)total / ps;
                }
                mpi_gatherv(mine, cnt, MPI_FLOAT, all, counts, displs, MPI_FLOAT, owner,
                            "gathering the partial states");
                if (rank == owner &&
                    pkv_merge_partials(e, (uint32_t)merged, all, out + l * od) != PKV_OK)
                    fail = 1;
            }
            lat[rep] = (MPI_Wtime() - t0) * 1e6;
        }
        qsort(lat, o->reps, sizeof *lat, cmp_double);
        ms_point p = {.ctx = n, .owner = owner, .us = lat[o->reps / 2], .bytes = sent,
                      .states = merged};
        mpi_bcast(&p.us, 1, MPI_DOUBLE, owner, "sharing the step's latency");
        mpi_bcast(&p.bytes, 1, MPI_UINT64_T, owner, "sharing the step's bytes");
        mpi_bcast(&p.states, 1, MPI_UINT64_T, owner, "sharing the step's states");
        /* the bitwise check: the owner's output against one engine on rank 0 */
        if (n <= check) {
            if (owner != 0 && rank == owner)
                mpi_send(out, (int)(od * o->layers), MPI_FLOAT, 0, 7,
                         "sending the output to be checked");
            if (rank == 0) {
                if (owner != 0)
                    mpi_recv(out, (int)(od * o->layers), MPI_FLOAT, owner, 7,
                             "receiving the output to check");
                p.checked = 1;
                p.equal = 1;
                for (uint32_t l = 0; l < o->layers; l++) {
                    if (pkv_decode(whole, l, q + l * qd, ref) != PKV_OK)
                        fail = 1;
                    if (memcmp(ref, out + l * od, od * sizeof(float)) != 0)
                        p.equal = 0;
                }
                checks++;
                mismatches += !p.equal;
            }
        }
        if (mpi_common_max(fail)) {
            rc = cli_fail(CMD, "a decode failed at context %llu", (unsigned long long)n);
            break;
        }
        pts[pi] = p;
        if (rank == 0 && !o->json)
            fprintf(stderr, "  ctx %9llu  owner rank %d  %10.1f us  %9llu states  %11llu "
                    "bytes/step%s\n", (unsigned long long)n, owner, p.us,
                    (unsigned long long)p.states, (unsigned long long)p.bytes,
                    p.checked ? (p.equal ? "  bitwise ==" : "  MISMATCH") : "");
    }
    /* memory per rank */
    pkv_memory m;
    memset(&m, 0, sizeof m);
    pkv_session_memory(s, &m);
    uint64_t mem[3] = {m.bytes_resident, m.bytes_overhead, held - lo[rank]};
    uint64_t *mems = rank == 0 ? calloc((size_t)R * 3, sizeof *mems) : NULL;
    mpi_gather(mem, 3, MPI_UINT64_T, mems, 3, MPI_UINT64_T, 0, "gathering the ranks' memory");
    if (rank == 0 && rc == CLI_OK && mems) {
        pkv_stats es;
        memset(&es, 0, sizeof es);
        pkv_engine_stats(e, &es);
        if (o->json) {
            json_writer w = {stdout, true, true}, *W = &w;
            json_open(W, NULL, '{');
            cli_json_envelope(W, CMD, es.isa);
            JSON_U64S(W, {"ranks", (uint64_t)R}, {"ctx", o->ctx}, {"align", A},
                      {"layers", o->layers}, {"heads", o->heads}, {"kv_heads", o->kv_heads},
                      {"head_dim", o->head_dim}, {"head_dim_v", dv});
            json_str(W, "dtype", pkv_dtype_name(o->dtype));
            JSON_U64S(W, {"threads", o->threads});
            json_str(W, "exchange", o->exchange);
            json_open(W, "rank_memory", '[');
            for (int r = 0; r < R; r++) {
                json_open(W, NULL, '{');
                JSON_U64S(W, {"rank", (uint64_t)r}, {"first", lo[r]},
                          {"positions", mems[3 * r + 2]}, {"bytes_resident", mems[3 * r]},
                          {"bytes_overhead", mems[3 * r + 1]});
                json_close(W, '}');
            }
            json_close(W, ']');
            json_open(W, "points", '[');
            for (uint32_t i = 0; i < n_pts; i++) {
                json_open(W, NULL, '{');
                JSON_U64S(W, {"ctx", pts[i].ctx}, {"owner", (uint64_t)pts[i].owner});
                json_fmt(W, "p50_us", "%.1f", pts[i].us);
                JSON_U64S(W, {"states", pts[i].states}, {"bytes_per_step", pts[i].bytes});
                json_bool(W, "checked", pts[i].checked);
                json_bool(W, "bitwise_equal", pts[i].checked && pts[i].equal);
                json_close(W, '}');
            }
            json_close(W, ']');
            json_open(W, "check", '{');
            JSON_U64S(W, {"prefix", check}, {"points", (uint64_t)checks},
                      {"mismatches", (uint64_t)mismatches});
            json_close(W, '}');
            json_close(W, '}');
            fputc('\n', stdout);
        } else {
            printf("pagedkv stress --mpi: %d ranks, ctx %llu, %u layer(s) h=%u g=%u d=%u "
                   "dv=%u %s, kernels %s, exchange %s, shard "
                   "align %llu positions\n", R, (unsigned long long)o->ctx, o->layers,
                   o->heads, o->kv_heads, o->head_dim, dv, pkv_dtype_name(o->dtype), es.isa,
                   o->exchange, (unsigned long long)A);
            for (int r = 0; r < R; r++)
                printf("  rank %d: positions [%llu, %llu)  %llu bytes resident  %llu bytes "
                       "bookkeeping\n", r, (unsigned long long)lo[r],
                       (unsigned long long)(lo[r] + mems[3 * r + 2]),
                       (unsigned long long)mems[3 * r], (unsigned long long)mems[3 * r + 1]);
            printf("      ctx  owner   p50 us/step   states   bytes/step  check\n");
            for (uint32_t i = 0; i < n_pts; i++)
                printf("  %9llu  %5d  %12.1f  %7llu  %11llu  %s\n",
                       (unsigned long long)pts[i].ctx, pts[i].owner, pts[i].us,
                       (unsigned long long)pts[i].states, (unsigned long long)pts[i].bytes,
                       pts[i].checked ? (pts[i].equal ? "bitwise ==" : "MISMATCH") : "-");
            printf("bitwise check on [0, %llu): %d point(s), %d mismatch(es)\n",
                   (unsigned long long)check, checks, mismatches);
        }
        fflush(stdout);
    }
    free(mems);
    if (rc == CLI_OK && mismatches)
        rc = cli_fail(CMD, "%d decode(s) differ from one engine holding the prefix",
                      mismatches);
done:
    pkv_session_destroy(s);
    pkv_session_destroy(whole);
    pkv_engine_destroy(e);
    pkv_engine_destroy(whole_e);
    free(lc);
    free(sigma);
    free(lo);
    free(k);
    free(v);
    free(q);
    free(out);
    free(ref);
    free(mine);
    free(all);
    free(counts);
    free(displs);
    free(lat);
    free(pts);
    free(sched);
    return rc;
}

int mpi_stress(int argc, char **argv)
{
    ms_opts o;
    memset(&o, 0, sizeof o);
    o.ctx = 65536;
    o.threads = 1;
    o.points = 12;
    o.reps = 3;
    o.seed = 1;
    o.exchange = "gather";
    o.timeout = MPI_COMMON_TIMEOUT_DEFAULT;
    cli_model m = cli_model_default();
    /* stress's run options that one sharded context has no use for: known, refused */
    static const char *const not_sharded = "does not combine with --mpi: one context is "
                                           "sharded over the ranks (pagedkv stress --mpi "
                                           "--help)";
    const char *ignored_s = NULL;
    bool ignored_b = false;
    cli_opt opts[CLI_MODEL_NOPTS + 32] = {
        {.name = "exchange", .kind = OPT_STRING, .dst = &o.exchange},
        {.name = "mpi", .kind = OPT_FLAG, .dst = &o.mpi},
        {.name = "ctx", .kind = OPT_U64, .dst = &o.ctx, .lo = 1, .hi = UINT64_MAX / 4},
        {.name = "threads", .kind = OPT_U32, .dst = &o.threads, .lo = 0,
         .hi = CLI_MAX_THREADS, .note = "0 = all CPUs; the engine's limit"},
        {.name = "points", .kind = OPT_U32, .dst = &o.points, .lo = 2, .hi = 4096},
        {.name = "reps", .kind = OPT_U32, .dst = &o.reps, .lo = 1, .hi = 1000},
        {.name = "check", .kind = OPT_U64, .dst = &o.check, .lo = 0, .hi = UINT64_MAX,
         .seen = &o.check_set},
        {.name = "seed", .kind = OPT_U64, .dst = &o.seed, .lo = 0, .hi = UINT64_MAX},
        {.name = "timeout", .kind = OPT_DOUBLE, .dst = &o.timeout, .dlo = 0.1, .dhi = 1e7},
        {.name = "json", .kind = OPT_FLAG, .dst = &o.json},
        {.name = "quiet", .kind = OPT_FLAG, .dst = &ignored_b},
        {.name = "sessions", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "decode-every", .kind = OPT_STRING, .dst = &ignored_s,
         .refused = not_sharded},
        {.name = "fork-every", .kind = OPT_STRING, .dst = &ignored_s,
         .refused = not_sharded},
        {.name = "prefix", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "prefix-tail", .kind = OPT_STRING, .dst = &ignored_s,
         .refused = not_sharded},
        {.name = "budget", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "spill-dir", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "force", .kind = OPT_FLAG, .dst = &ignored_b, .refused = not_sharded},
        {.name = "svg", .kind = OPT_STRING, .dst = &ignored_s, .refused = not_sharded},
        {.name = "svg-logx", .kind = OPT_FLAG, .dst = &ignored_b, .refused = not_sharded},
    };
    size_t n = 0;
    while (opts[n].name)
        n++;
    cli_model_opts(&m, opts + n);
    n += CLI_MODEL_NOPTS;
    int rc = cli_parse(CMD, argc, argv, opts, n, usage, NULL, 0, NULL);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    if (cli_model_resolve(CMD, &m) != CLI_OK)
        return CLI_USAGE;
    o.layers = m.layers;
    o.heads = m.heads;
    o.kv_heads = m.kv_heads;
    o.head_dim = m.head_dim;
    o.head_dim_v = m.head_dim_v;
    o.block_tokens = m.block_tokens;
    o.dtype = m.dtype;
    o.v = m.v;
    if (strcmp(o.exchange, "gather") && strcmp(o.exchange, "chain"))
        return cli_usage_error(CMD, "--exchange: '%s' is not gather or chain", o.exchange);
    return mpi_common_main(CMD, argc, argv, o.timeout, run, &o);
}

/*
 * test_mpi.c - sharding (docs/sharding.md) over real MPI ranks: `mpirun -np R pagedkv stress --mpi`
 * with its bitwise check on, and `mpirun -np R pagedkv generate --mpi` against the single
 * process text. One meson test per (case, R): PKV_MPI_RANKS is R, CK_RUN_CASE the case.
 *
 * SKIP (77) only when this build has no MPI (PKV_MPI != 1: meson found no 'mpi'
 * dependency) or no mpirun (PKV_MPIRUN empty); CI installs Open MPI so neither happens
 * there. generate also needs stories260K (pkvt_model_dir()), as test_generate does:
 * without it that case is SKIP (77), never a pass.
 *
 * What is asserted:
 *   - stress: exit 0, valid JSON, every decode point checked and bitwise equal to one
 *     engine holding the context, the context split over R ranks (each rank's first
 *     position a multiple of the align, positions adding up to ctx), points owned by
 *     the last rank among the checked ones; on the plain layer and on one with every
 *     variant at once (window, sinks, sink logits, soft-cap, head_dim_v, q8), and
 *     with --exchange chain (one folded state passed rank to rank, q4, a window), and
 *     on a variant preset's layer pattern (--model-preset, as stress takes it); the
 *     options of stress that one sharded context has no use for are refused in words;
 *   - generate: the greedy text of stories260K over R ranks is the single-process text
 *     byte for byte.
 */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define ARGS(...) ((const char *const[]){__VA_ARGS__, NULL})

static int ranks(void)
{
    const char *r = getenv("PKV_MPI_RANKS");
    return r && *r ? atoi(r) : 2;
}

static const char *mpirun(void)
{
    const char *m = getenv("PKV_MPIRUN");
    return m && *m ? m : NULL;
}

/* mpirun -np R <tool> args... (at most 40 args) */
static pkvt_proc run_mpi(int R, const char *const *args)
{
    char np[16];
    snprintf(np, sizeof np, "%d", R);
    const char *argv[48] = {mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", np,
                            pkvt_tool_path()};
    int n = 6;
    for (int i = 0; args[i] && n < 46; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    /* Open MPI leaks by design at MPI_Finalize (its own buffers and dlopen'ed
     * components): under ASan the ranks skip leak checking, which the library's own
     * suites (test_shard, ...) do; every other ASan and UBSan check stays on */
    static char asan[512];
    const char *prev = getenv("ASAN_OPTIONS");
    snprintf(asan, sizeof asan, "ASAN_OPTIONS=%s%sdetect_leaks=0", prev ? prev : "",
             prev && *prev ? ":" : "");
    const char *const env[] = {asan, NULL};
    return pkvt_spawn(mpirun(), argv, PKVT_ASAN ? env : NULL);
}

static void stress_case(const char *const *extra, uint64_t ctx)
{
    const int R = ranks();
    char ctxs[32];
    snprintf(ctxs, sizeof ctxs, "%llu", (unsigned long long)ctx);
    const char *args[40] = {"stress", "--mpi", "--json", "--ctx", ctxs, "--points", "8",
                            "--reps", "1"};
    int n = 9;
    for (int i = 0; extra[i]; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    pkvt_proc p = run_mpi(R, args);
    ck_assert_msg(p.status == 0, "mpirun -np %d stress --mpi: exit %d\n%s", R, p.status,
                  p.err);
    ck_assert_msg(pkvt_json_valid(p.out), "not JSON:\n%s", p.out);
    ck_assert_msg(pkvt_json_is(p.out, "tool", "\"pagedkv\"") &&
                      pkvt_json_is(p.out, "command", "\"stress\"") &&
                      pkvt_json_len(p.out, "argv") > 3,
                  "no JSON envelope:\n%s", p.out);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "ranks"), (uint64_t)R);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "check.mismatches"), 0);
    const size_t np = pkvt_json_len(p.out, "points");
    ck_assert_uint_ge(np, 4);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "check.points"), np);
    const uint64_t align = pkvt_json_u64(p.out, "align");
    uint64_t total = 0;
    for (int r = 0; r < R; r++) {
        char path[64];
        snprintf(path, sizeof path, "rank_memory[%d].first", r);
        ck_assert_uint_eq(pkvt_json_u64(p.out, path) % align, 0);
        ck_assert_uint_eq(pkvt_json_u64(p.out, path), total);
        snprintf(path, sizeof path, "rank_memory[%d].positions", r);
        total += pkvt_json_u64(p.out, path);
    }
    ck_assert_uint_eq(total, ctx);
    bool last_rank_checked = false;
    for (size_t i = 0; i < np; i++) {
        char path[64];
        snprintf(path, sizeof path, "points[%zu].bitwise_equal", i);
        ck_assert_msg(pkvt_json_is(p.out, path, "true"), "point %zu differs:\n%s", i, p.out);
        snprintf(path, sizeof path, "points[%zu].owner", i);
        last_rank_checked |= pkvt_json_u64(p.out, path) == (uint64_t)(R - 1);
    }
    ck_assert_msg(last_rank_checked, "no checked point was owned by the last rank");
    pkvt_proc_free(&p);
}

START_TEST(stress_plain)
{
    stress_case(ARGS("--heads", "8", "--kv-heads", "2", "--head-dim", "64"), 4000);
}
END_TEST

START_TEST(stress_variants)
{
    stress_case(ARGS("--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--head-dim-v",
                     "8", "--layers", "2", "--window", "1500", "--sinks", "5",
                     "--sink-logits", "--softcap", "20", "--dtype", "q8"),
                5000);
}
END_TEST

START_TEST(stress_chain)
{
    stress_case(ARGS("--exchange", "chain", "--heads", "4", "--kv-heads", "2", "--head-dim",
                     "16", "--window", "1500", "--sinks", "5", "--sink-logits", "--dtype",
                     "q4"),
                5000);
}
END_TEST

/* The model described as for one run (a variant preset: gpt-oss-20b's alternating
 * windows and sink logits), cut to two layers; and stress's options that have no
 * meaning for one sharded context refused in words, not as unknown. */
START_TEST(stress_preset)
{
    stress_case(ARGS("--model-preset", "gpt-oss-20b", "--layers", "2", "--heads", "8",
                     "--kv-heads", "2"),
                3000);
    static const char *const refused[] = {"--sessions", "--fork-every", "--prefix",
                                          "--budget", "--svg"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        pkvt_proc p = pkvt_tool(ARGS("stress", "--mpi", refused[i], "2"), NULL);
        ck_assert_msg(p.status == 2 && strstr(p.err, "does not combine with --mpi") &&
                          !strstr(p.err, "unknown option"),
                      "stress --mpi %s 2: exit %d: %s", refused[i], p.status, p.err);
        pkvt_proc_free(&p);
    }
}
END_TEST

START_TEST(generate_text)
{
    char model[4096], tok[4096];
    ck_assert_msg(pkvt_model_paths(model, tok, sizeof model), "no model in %s",
                  pkvt_model_dir());
    pkvt_proc one = pkvt_tool(ARGS("generate", "--model", model, "--tokenizer", tok, "-t",
                                   "0", "-n", "120", "-i", "Once upon a time"), NULL);
    ck_assert_msg(one.status == 0, "single process: exit %d\n%s", one.status, one.err);
    ck_assert_uint_gt(one.out_len, 40);
    const int R = ranks();
    pkvt_proc m = run_mpi(R, ARGS("generate", "--mpi", "--model", model, "--tokenizer", tok,
                                  "-t", "0", "-n", "120", "-i", "Once upon a time"));
    ck_assert_msg(m.status == 0, "mpirun -np %d generate --mpi: exit %d\n%s", R, m.status,
                  m.err);
    ck_assert_msg(m.out_len == one.out_len && memcmp(m.out, one.out, one.out_len) == 0,
                  "R = %d: the text differs\n--- one process:\n%s\n--- %d ranks:\n%s", R,
                  one.out, R, m.out);
    pkvt_proc_free(&one);
    pkvt_proc_free(&m);
}
END_TEST

int main(void)
{
    const char *have = getenv("PKV_MPI");
    if (!have || strcmp(have, "1") != 0 || !mpirun()) {
        printf("SKIP: this build has no MPI (meson found no 'mpi' dependency or no "
               "mpirun); install libopenmpi-dev openmpi-bin\n");
        return PKVT_SKIP;
    }
    Suite *s = suite_create("mpi");
    TCase *ts = tcase_create("stress");
    tcase_set_timeout(ts, 240);
    tcase_add_test(ts, stress_plain);
    tcase_add_test(ts, stress_variants);
    tcase_add_test(ts, stress_chain);
    tcase_add_test(ts, stress_preset);
    suite_add_tcase(s, ts);
    TCase *tg = tcase_create("generate");
    tcase_set_timeout(tg, 240);
    tcase_add_test(tg, generate_text);
    pkvt_add_tcase_needing(s, tg, "generate", "model");
    return pkvt_run(s);
}

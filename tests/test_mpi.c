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
 *   - stop: one of two ranks frozen (SIGSTOP): the other waits without spinning, and the
 *     run ends non-zero within --timeout, naming the wait (issue: ranks spun forever).
 */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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

/* ---- a frozen rank ---------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* /proc/PID/stat: the state letter, the parent and the CPU time (utime + stime, in
 * clock ticks). False when the process is gone. */
static bool proc_stat(int pid, char *state, int *ppid, unsigned long long *ticks)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');   /* the command name may hold spaces */
    unsigned long long ut = 0, stime = 0;
    if (!p || sscanf(p + 2, "%c %d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", state, ppid,
                     &ut, &stime) != 4)
        return false;
    *ticks = ut + stime;
    return true;
}

/* The ranks mpirun (pid) started: its children running pagedkv. */
static int ranks_of(int mpirun_pid, int *pids, int cap)
{
    int n = 0;
    DIR *d = opendir("/proc");
    ck_assert(d != NULL);
    for (struct dirent *e; (e = readdir(d)) && n < cap;) {
        const int pid = atoi(e->d_name);
        char state, path[64], cmd[256] = "";
        int ppid = 0;
        unsigned long long t;
        if (pid <= 0 || !proc_stat(pid, &state, &ppid, &t) || ppid != mpirun_pid)
            continue;
        snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
        FILE *f = fopen(path, "r");
        const size_t len = f ? fread(cmd, 1, sizeof cmd - 1, f) : 0;
        if (f)
            fclose(f);
        cmd[len] = '\0';
        if (strstr(cmd, "pagedkv"))   /* argv[0]: the first NUL-ended word */
            pids[n++] = pid;
    }
    closedir(d);
    return n;
}

/* One rank frozen (SIGSTOP, as a node that hangs): the other does not spin while it
 * waits (its CPU time over 3 s of waiting stays under 0.3 s, where a busy poll takes
 * what the scheduler gives it), and every rank ends, non-zero, with a message naming
 * the wait, within --timeout and some slack; the stopped rank too. */
START_TEST(stopped_rank)
{
    const double timeout = 6;
    char np[16] = "2", to[32];
    snprintf(to, sizeof to, "%g", timeout);
    const char *argv[] = {mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", np,
                          pkvt_tool_path(), "stress", "--mpi", "--ctx", "4m", "--heads", "2",
                          "--kv-heads", "1", "--head-dim", "8", "--points", "40", "--reps",
                          "1", "--check", "0", "--timeout", to, NULL};
    pkvt_child c = pkvt_start(mpirun(), argv, NULL);
    /* running: rank 0 has printed decode points */
    char err_path[64];
    snprintf(err_path, sizeof err_path, "/proc/self/fd/%d", c.err_fd);
    int pids[8], n = 0;
    for (int i = 0; i < 600; i++) {
        char *e = pkvt_read_file(err_path, NULL);
        int lines = 0;
        for (const char *p = e; p && (p = strstr(p, "owner rank")); p++)
            lines++;
        free(e);
        n = ranks_of(c.pid, pids, 8);
        if (lines >= 3 && n == 2)
            break;
        nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
    }
    ck_assert_msg(n == 2, "found %d ranks of mpirun %d", n, c.pid);
    const int victim = pids[1], other = pids[0];
    ck_assert(kill(victim, SIGSTOP) == 0);
    const double t0 = now_s();
    char state;
    int ppid;
    unsigned long long c0 = 0, c1 = 0;
    nanosleep(&(struct timespec){0, 500 * 1000 * 1000}, NULL);   /* into its wait */
    const bool alive0 = proc_stat(other, &state, &ppid, &c0);
    nanosleep(&(struct timespec){3, 0}, NULL);
    const bool alive1 = proc_stat(other, &state, &ppid, &c1);
    /* mpirun ends (a zombie until pkvt_finish reaps it) within the timeout and slack */
    bool ended = false;
    while (!ended && now_s() - t0 < timeout + 30) {
        unsigned long long t;
        ended = !proc_stat(c.pid, &state, &ppid, &t) || state == 'Z';
        if (!ended)
            nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
    }
    const double took = now_s() - t0;
    if (!ended) {   /* the defect: clean up, then fail */
        kill(victim, SIGCONT);
        kill(victim, SIGKILL);
        kill(other, SIGKILL);
        kill(c.pid, SIGKILL);
    }
    pkvt_proc p = pkvt_finish(&c);
    ck_assert_msg(ended, "the ranks still ran %.0f s after rank pid %d stopped", took, victim);
    ck_assert_msg(alive0 && alive1 && (c1 - c0) < 0.3 * (double)sysconf(_SC_CLK_TCK),
                  "the waiting rank used %llu ticks of CPU in 3 s (%ld a second)", c1 - c0,
                  sysconf(_SC_CLK_TCK));
    ck_assert_msg(p.status != 0 && strstr(p.err, "no answer from the other ranks") &&
                      strstr(p.err, "--timeout"),
                  "exit %d after %.0f s:\n%s", p.status, took, p.err);
    /* the frozen rank did not outlive the run */
    unsigned long long t;
    const bool victim_left = proc_stat(victim, &state, &ppid, &t) && state != 'Z';
    if (victim_left) {
        kill(victim, SIGCONT);
        kill(victim, SIGKILL);
    }
    ck_assert_msg(!victim_left, "the stopped rank %d is still there", victim);
    pkvt_proc_free(&p);
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
    TCase *tq = tcase_create("stop");
    tcase_set_timeout(tq, 240);
    tcase_add_test(tq, stopped_rank);
    suite_add_tcase(s, tq);
    TCase *tg = tcase_create("generate");
    tcase_set_timeout(tg, 240);
    tcase_add_test(tg, generate_text);
    pkvt_add_tcase_needing(s, tg, "generate", "model");
    return pkvt_run(s);
}

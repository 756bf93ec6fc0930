/*
 * test_soak.c - `pagedkv soak` as a user runs it: the built binary (env PKV_TOOL) is
 * started with posix_spawn for bounded runs, and its exit status and JSON summary are
 * checked.
 *
 * Owns: proof that the soak runs clean on both I/O backends and really exercises the
 * spill path (pages written to and read back from the spill file, split-K decodes),
 * that its figures do not depend on the backend (same seed, same operations, same
 * spills), that it leaves nothing behind and that it CAN fail: the hidden
 * --inject-bug corrupts its model once and the run must exit 1 naming the seed and the
 * op, while the same run stopped just before that op passes. Usage errors exit 2.
 * Does not own the library's own tests; the soak's checks are in tools/cmd_soak.c.
 *
 * Seeds: pkvt_seed() and pkvt_seed() + 1 (PKV_TEST_SEED overrides); every message
 * names the seed. Run time: about 10-20 s on the 2-core dev machine.
 */
#include "testutil.h"
#include "io_backend.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

typedef struct {
    int status;        /* exit code, or 128 + signal */
    char *out, *err;   /* captured stdout and stderr, NUL-terminated */
} run_result;

static char *read_all(int fd)
{
    size_t cap = 1 << 14, n = 0;
    char *buf = pkvt_alloc(cap);
    ck_assert(lseek(fd, 0, SEEK_SET) == 0);
    for (;;) {
        if (cap - n < 2) {
            cap *= 2;
            buf = realloc(buf, cap);
            ck_assert(buf != NULL);
        }
        ssize_t got = read(fd, buf + n, cap - n - 1);
        ck_assert_msg(got >= 0, "read: %s", strerror(errno));
        if (got == 0)
            break;
        n += (size_t)got;
    }
    buf[n] = 0;
    return buf;
}

/* Run `$PKV_TOOL soak ARGS...` (NULL-terminated). no_uring: with PKV_NO_URING=1,
 * else with PKV_NO_URING removed from the environment. */
static run_result run_soak(bool no_uring, const char *const *args)
{
    const char *tool = getenv("PKV_TOOL");
    ck_assert_msg(tool && *tool, "PKV_TOOL is not set (run through meson test)");
    char *argv[48];
    size_t na = 0;
    argv[na++] = (char *)"pagedkv";
    argv[na++] = (char *)"soak";
    for (size_t i = 0; args[i]; i++) {
        ck_assert(na < 47);
        argv[na++] = (char *)args[i];
    }
    argv[na] = NULL;
    size_t ne = 0;
    while (environ[ne])
        ne++;
    char **envp = pkvt_alloc((ne + 2) * sizeof *envp);
    size_t k = 0;
    for (size_t i = 0; i < ne; i++)
        if (strncmp(environ[i], "PKV_NO_URING=", 13) != 0)
            envp[k++] = environ[i];
    if (no_uring)
        envp[k++] = (char *)"PKV_NO_URING=1";
    envp[k] = NULL;

    char po[] = "/tmp/pkvt-soak-out-XXXXXX", pe[] = "/tmp/pkvt-soak-err-XXXXXX";
    int fo = mkstemp(po), fe = mkstemp(pe);
    ck_assert_msg(fo >= 0 && fe >= 0, "mkstemp: %s", strerror(errno));
    unlink(po);
    unlink(pe);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, fo, 1);
    posix_spawn_file_actions_adddup2(&fa, fe, 2);
    pid_t pid;
    int rc = posix_spawn(&pid, tool, &fa, NULL, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    free(envp);
    ck_assert_msg(rc == 0, "cannot start %s: %s", tool, strerror(rc));
    int st;
    pid_t w;
    while ((w = waitpid(pid, &st, 0)) < 0 && errno == EINTR)
        ;
    ck_assert_msg(w == pid, "waitpid: %s", strerror(errno));
    run_result r = {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), read_all(fo),
                    read_all(fe)};
    close(fo);
    close(fe);
    return r;
}

static void run_free(run_result *r)
{
    free(r->out);
    free(r->err);
}

/* The text right after `"key": ` in a flat JSON object; fails the test if absent. */
static const char *json_at(const char *json, const char *key)
{
    char pat[96];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *p = strstr(json, pat);
    ck_assert_msg(p != NULL, "no \"%s\" in the soak's JSON: %s", key, json);
    return p + strlen(pat);
}

static uint64_t json_u64(const char *json, const char *key)
{
    const char *p = json_at(json, key);
    char *end = NULL;
    unsigned long long v = strtoull(p, &end, 10);
    ck_assert_msg(end != p && (*end == ',' || *end == '}'), "\"%s\" is not an integer: %.40s",
                  key, p);
    return v;
}

static bool json_has(const char *json, const char *key, const char *literal)
{
    return strncmp(json_at(json, key), literal, strlen(literal)) == 0;
}

/* Sanitizer and poison builds (the tool beside this test is built the same way) run
 * the soak about 20x slower: fewer operations keep the suite near a minute there. */
static bool slow_build(void)
{
#if defined(__SANITIZE_ADDRESS__) || PKV_POISON
    return true;
#else
    return false;
#endif
}

static uint32_t n_ops(void)
{
    return pkvt_quick() ? 600 : slow_build() ? 1500 : 8000;
}

/* ---- clean runs on both backends ---------------------------------------------------- */

START_TEST(runs_clean_on_both_backends)
{
    const uint64_t seed0 = pkvt_seed();
    const bool uring = pkvi_uring_probe() == 0;
    if (!uring)
        fprintf(stderr, "test_soak: io_uring unavailable here; both runs use pread/pwrite\n");
    static const char *const dtypes[] = {"f32", "bf16"};
    static const char *const keys[] = {"sessions_created", "forks", "decodes", "checks",
                                       "spill_pages_written", "spill_pages_read",
                                       "tokens_appended", "max_sessions_alive"};
    uint64_t split = 0;
    for (int si = 0; si < 2; si++) {
        char seed[32], ops[32];
        snprintf(seed, sizeof seed, "%" PRIu64, seed0 + (uint64_t)si);
        snprintf(ops, sizeof ops, "%u", n_ops());
        const char *args[] = {"--ops", ops, "--seed", seed, "--sessions", "300",
                              "--threads", "2", "--dtype", dtypes[si], "--json", NULL};
        run_result r[2];
        for (int b = 0; b < 2; b++) {
            r[b] = run_soak(b == 1, args);
            const char *be = b ? "sync" : "io_uring";
            ck_assert_msg(r[b].status == 0, "seed %s, %s: exit %d\nstderr: %s\nstdout: %s",
                          seed, be, r[b].status, r[b].err, r[b].out);
            const char *j = r[b].out;
            ck_assert_msg(json_has(j, "ok", "true"), "seed %s, %s: %s", seed, be, j);
            ck_assert_msg(json_u64(j, "ops") == n_ops(), "seed %s: %s", seed, j);
            /* the spill path ran: pages went to the file and came back */
            ck_assert_msg(json_u64(j, "spill_pages_written") > 0, "seed %s, %s: no spill: %s",
                          seed, be, j);
            ck_assert_msg(json_u64(j, "spill_pages_read") > 0, "seed %s, %s: no read-back: %s",
                          seed, be, j);
            ck_assert_msg(json_u64(j, "checks") > 0 && json_u64(j, "reference_checks") > 0 &&
                          json_u64(j, "bitwise_checks") > 0 &&
                          json_u64(j, "invariant_checks") == n_ops(),
                          "seed %s, %s: checks missing: %s", seed, be, j);
            ck_assert_msg(json_u64(j, "forks") > 0 && json_u64(j, "save_loads") > 0 &&
                          json_u64(j, "batches") > 0 && json_u64(j, "prefills") > 0,
                          "seed %s, %s: an operation never ran: %s", seed, be, j);
            ck_assert_msg(json_u64(j, "pages_in_use_end") == 0 &&
                          json_u64(j, "pages_spilled_end") == 0,
                          "seed %s, %s: pages left: %s", seed, be, j);
            ck_assert_msg(json_u64(j, "allocator_bytes_end") >=
                          json_u64(j, "pages_free_end") * json_u64(j, "page_bytes"),
                          "seed %s, %s: %s", seed, be, j);
            const char *want = b == 1 || !uring ? "\"sync\"" : "\"io_uring\"";
            ck_assert_msg(json_has(j, "io_backend", want), "seed %s: expected %s: %s", seed,
                          want, j);
            split += json_u64(j, "split_k_decodes");
        }
        /* The backend moves bytes; it must not change a single decision. */
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
            ck_assert_msg(json_u64(r[0].out, keys[i]) == json_u64(r[1].out, keys[i]),
                          "seed %s: \"%s\" differs between backends:\n%s\n%s", seed,
                          keys[i], r[0].out, r[1].out);
        run_free(&r[0]);
        run_free(&r[1]);
    }
    ck_assert_msg(n_ops() < 8000 || split > 0, "seed %" PRIu64 ": no split-K decode ran",
                  seed0);
}
END_TEST

/* ---- the soak can fail ------------------------------------------------------------ */

START_TEST(injected_bug_is_caught)
{
    char seed[32];
    snprintf(seed, sizeof seed, "%" PRIu64, pkvt_seed());
    const char *args[] = {"--ops", "3000", "--seed", seed, "--sessions", "200", "--dtype",
                          "f16", "--json", "--inject-bug", NULL};
    run_result r = run_soak(false, args);
    ck_assert_msg(r.status == 1, "seed %s: --inject-bug exited %d, not 1\nstderr: %s", seed,
                  r.status, r.err);
    ck_assert_msg(json_has(r.out, "ok", "false") && json_has(r.out, "inject_bug", "true"),
                  "seed %s: %s", seed, r.out);
    const uint64_t op = json_u64(r.out, "ops");
    char where[96];
    snprintf(where, sizeof where, "check failed at op %" PRIu64 " (seed %s)", op, seed);
    ck_assert_msg(strstr(r.err, where) != NULL, "seed %s: stderr lacks '%s': %s", seed,
                  where, r.err);
    ck_assert_msg(strstr(r.err, "reference") != NULL && strstr(r.err, "tol") != NULL,
                  "seed %s: stderr does not say what differed: %s", seed, r.err);
    run_free(&r);

    /* The same run without the bug, stopped at the failing op, passes: the failure
     * was the injected corruption, and "--seed S --ops N" reproduces a run. */
    char ops[32];
    snprintf(ops, sizeof ops, "%" PRIu64, op);
    const char *clean[] = {"--ops", ops, "--seed", seed, "--sessions", "200", "--dtype",
                           "f16", "--json", NULL};
    r = run_soak(false, clean);
    ck_assert_msg(r.status == 0 && json_u64(r.out, "ops") == op,
                  "seed %s: the clean run to op %s exited %d: %s %s", seed, ops, r.status,
                  r.out, r.err);
    run_free(&r);
}
END_TEST

/* ---- files and usage ---------------------------------------------------------------- */

START_TEST(spill_dir_is_left_empty)
{
    char dir[] = "/tmp/pkvt-soak-dir-XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    char seed[32];
    snprintf(seed, sizeof seed, "%" PRIu64, pkvt_seed());
    const char *args[] = {"--ops", "1500", "--seed", seed, "--sessions", "100",
                          "--spill-dir", dir, NULL};
    run_result r = run_soak(false, args);
    ck_assert_msg(r.status == 0, "seed %s: exit %d: %s", seed, r.status, r.err);
    ck_assert_msg(strstr(r.out, "all checks held") && strstr(r.out, "spill_pages_written"),
                  "seed %s: no summary table: %s", seed, r.out);
    size_t left = 0;
    DIR *dp = opendir(dir);
    ck_assert(dp != NULL);
    for (struct dirent *de; (de = readdir(dp));)
        left += strcmp(de->d_name, ".") && strcmp(de->d_name, "..");
    closedir(dp);
    ck_assert_msg(left == 0, "seed %s: %zu files left in --spill-dir %s", seed, left, dir);
    ck_assert(rmdir(dir) == 0);
    run_free(&r);
}
END_TEST

START_TEST(usage_errors_exit_2)
{
    static const char *const bad[][8] = {
        {"--bogus"},
        {"--ops"},
        {"--ops", "0"},
        {"--ops", "12x"},
        {"--ops", "-5"},
        {"--minutes", "0"},
        {"--minutes", "soon"},
        {"--dtype", "f8"},
        {"--sessions", "1"},
        {"--budget-pages", "3"},          /* smaller than the longest layer */
        {"--heads", "3", "--kv-heads", "2"},
        {"--long-len", "10", "--max-len", "48"},
        {"--spill-dir", "/nonexistent/pagedkv-soak"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        run_result r = run_soak(false, bad[i]);
        ck_assert_msg(r.status == 2, "soak %s %s: exit %d, not 2 (stderr: %s)", bad[i][0],
                      bad[i][1] ? bad[i][1] : "", r.status, r.err);
        ck_assert_msg(strstr(r.err, "pagedkv soak: ") && strstr(r.err, "--help"),
                      "soak %s: no usage message: %s", bad[i][0], r.err);
        ck_assert_msg(r.out[0] == 0, "soak %s: wrote to stdout: %s", bad[i][0], r.out);
        run_free(&r);
    }
    const char *help[] = {"--help", NULL};
    run_result r = run_soak(false, help);
    ck_assert_int_eq(r.status, 0);
    ck_assert(strstr(r.out, "usage: pagedkv soak") != NULL);
    ck_assert(strstr(r.out, "--inject-bug") == NULL);   /* hidden */
    run_free(&r);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("soak");
    TCase *tc = tcase_create("soak");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, runs_clean_on_both_backends);
    tcase_add_test(tc, injected_bug_is_caught);
    tcase_add_test(tc, spill_dir_is_left_empty);
    tcase_add_test(tc, usage_errors_exit_2);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

/*
 * test_tools.c - the `pagedkv` command as a user runs it: the built binary (env
 * PKV_TOOL) is started with posix_spawn and its exit status, stdout and stderr are
 * checked.
 *
 * Owns: argument-parsing tests of the top-level command, `stress` and `mem`; the
 * checks of a real small `stress` run (its JSON against the memory formula computed
 * here independently, its SVG); Ctrl-C handling. Does not own the library's own
 * tests: the tool is only trusted as far as these outputs are checked.
 *
 * The JSON reader (testutil's pkvt_json_*) and the XML checker (tools_run.h) are
 * deliberately small and strict (syntax only, plus a path lookup for JSON); python3,
 * when present, checks the same files again. The option conventions, the engine limits
 * and the newer output contracts are test_cli.c's.
 */
#include "testutil.h"
#include "tools_run.h"

#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

START_TEST(top_level)
{
    pkvt_proc p;
    p = pkvt_tool((const char *[]){NULL}, NULL);
    ck_assert_msg(p.status == 2 && has(p.err, "usage"), "no command: %d %s", p.status, p.err);
    pkvt_proc_free(&p);
    p = pkvt_tool((const char *[]){"--help", NULL}, NULL);
    ck_assert_msg(p.status == 0 && has(p.out, "usage: pagedkv") && has(p.out, "stress"),
                  "--help: %d", p.status);
    pkvt_proc_free(&p);
    p = pkvt_tool((const char *[]){"frobnicate", NULL}, NULL);
    ck_assert_msg(p.status == 2 && has(p.err, "frobnicate") && !p.out[0],
                  "unknown command: %d %s", p.status, p.err);
    pkvt_proc_free(&p);
}
END_TEST

/* ---- usage errors of stress and mem ------------------------------------------- */

/* Each row: the arguments after the command, and a word the message must contain. */
typedef struct { const char *args[11]; const char *says; } bad_args; /* args NULL-ended */

static void expect_usage_errors(const char *cmd, const bad_args *rows, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const char *argv[13] = {cmd};
        for (size_t j = 0; rows[i].args[j]; j++)
            argv[j + 1] = rows[i].args[j];
        pkvt_proc p;
        p = pkvt_tool(argv, NULL);
        char shown[160] = "";
        for (size_t j = 0; rows[i].args[j]; j++)
            snprintf(shown + strlen(shown), sizeof shown - strlen(shown), " %s",
                     rows[i].args[j]);
        ck_assert_msg(p.status == 2, "pagedkv %s%s: exit %d, want 2 (stderr: %s)", cmd,
                      shown, p.status, p.err);
        ck_assert_msg(has(p.err, rows[i].says), "pagedkv %s%s: stderr lacks '%s': %s", cmd,
                      shown, rows[i].says, p.err);
        ck_assert_msg(p.out[0] == 0, "pagedkv %s%s wrote to stdout: %s", cmd, shown, p.out);
        pkvt_proc_free(&p);
    }
}

static void expect_help(const char *cmd)
{
    pkvt_proc p;
    p = pkvt_tool((const char *[]){cmd, "--help", NULL}, NULL);
    char want[64];
    snprintf(want, sizeof want, "pagedkv %s", cmd);
    ck_assert_msg(p.status == 0 && has(p.out, "usage") && has(p.out, want) && has(p.out, "--ctx"),
                  "%s --help: exit %d, stdout %s", cmd, p.status, p.out);
    pkvt_proc_free(&p);
}

START_TEST(stress_usage)
{
    static const bad_args rows[] = {
        {{"--ctx", "-5"}, "-5"},
        {{"--ctx", "abc"}, "abc"},
        {{"--ctx", "12x"}, "12x"},
        {{"--ctx", "99999999999999999999999"}, "--ctx"},
        {{"--ctx"}, "--ctx"},
        {{"--frobnicate"}, "--frobnicate"},
        {{"--kv-heads", "3", "--heads", "8"}, "--kv-heads"},
        {{"--model-preset", "gpt-9"}, "gpt-9"},
        {{"--dtype", "f8"}, "f8"},
        {{"--ctx", "0"}, "--ctx"},
        {{"--sessions", "0"}, "--sessions"},
        {{"--block-tokens", "0"}, "--block-tokens"},
        {{"--points", "1"}, "--points"},
        {{"--layers", ""}, "--layers"},
        {{"--head-dim", "1.5"}, "1.5"},
        /* --svg is checked before the run (each of these would take the whole run and
         * then fail): a missing directory, a directory, an empty name, a file under a
         * file */
        {{"--ctx", "64", "--svg", "/nonexistent-dir/x.svg"}, "'/nonexistent-dir' does not"},
        {{"--ctx", "64", "--svg", "/tmp"}, "is a directory"},
        {{"--ctx", "64", "--svg", "/tmp/"}, "is a directory"},
        {{"--ctx", "64", "--svg", ""}, "empty"},
        {{"--ctx", "64", "--svg", "/dev/null/x.svg"}, "not a directory"},
    };
    expect_usage_errors("stress", rows, sizeof rows / sizeof rows[0]);
    expect_help("stress");
}
END_TEST

START_TEST(mem_usage)
{
    static const bad_args rows[] = {
        {{"--ctx", "-5"}, "-5"},
        {{"--ctx", "abc"}, "abc"},
        {{"--ctx"}, "--ctx"},
        {{"--frobnicate"}, "--frobnicate"},
        {{"--layers", "32", "--kv-heads", "3", "--heads", "8", "--head-dim", "128", "--ctx",
          "8192"}, "heads"},
        /* the range in the message is the one really accepted (0 is refused) */
        {{"--head-dim", "4294967296"}, "'4294967296' is not an integer in 1..4294967295"},
        {{"--layers", "0"}, "'0' is not an integer in 1..4294967295"},
        {{"--block-tokens", "x"}, "in 0..4294967295"},
    };
    expect_usage_errors("mem", rows, sizeof rows / sizeof rows[0]);
    expect_help("mem");
    /* every command words an unknown option the same way */
    static const char *const cmds[] = {"mem", "stress", "bench", "generate", "inspect",
                                       "quality"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        const bad_args row = {{"--frobnicate"}, "unknown option '--frobnicate'"};
        expect_usage_errors(cmds[i], &row, 1);
    }
    /* the soak is a test program of its own (tests/soak), not a command */
    const bad_args soak = {{"--ops", "10"}, "unknown command 'soak'"};
    expect_usage_errors("soak", &soak, 1);
}
END_TEST

/* The budget and spill directory: the usual mistakes are named as usage errors before
 * any work, in every command that takes them (pkv_engine_create alone says only
 * "invalid argument"). */
START_TEST(engine_memory_usage)
{
    static const bad_args stress_rows[] = {
        {{"--ctx", "16", "--budget", "1m", "--spill-dir", "/nonexistent"},
         "--spill-dir: '/nonexistent' does not exist"},
        {{"--ctx", "16", "--budget", "1m", "--spill-dir", "/dev/null"}, "not a directory"},
        {{"--ctx", "16", "--budget", "1m", "--spill-dir", ""}, "empty"},
        /* one llama3-8b page: 2 * 8 * 16 * 128 * 2 bytes */
        {{"--ctx", "16", "--budget", "1"}, "smaller than one page, 65536 bytes"},
        {{"--ctx", "16", "--budget", "100", "--block-tokens", "1", "--dtype", "f32"},
         "8192 bytes"},
        {{"--ctx", "16", "--spill-dir", "/tmp"}, "--spill-dir needs --budget"},
        /* with spill, a decode still needs one layer of one session resident */
        {{"--ctx", "16k", "--sessions", "3", "--budget", "4m", "--spill-dir", "/tmp"},
         "cannot hold one layer"},
    };
    expect_usage_errors("stress", stress_rows, sizeof stress_rows / sizeof stress_rows[0]);
    static const bad_args bench_rows[] = {
        {{"--spill", "--spill-dir", "/nonexistent"}, "'/nonexistent' does not exist"},
        {{"--spill", "--spill-dir", "/dev/null"}, "not a directory"},
    };
    expect_usage_errors("bench", bench_rows, 2);
    if (geteuid() != 0) {   /* root may write anywhere: no unwritable directory to try */
        char dir[] = "/tmp/pkvt-ro-XXXXXX";
        ck_assert(mkdtemp(dir) != NULL);
        ck_assert(chmod(dir, 0500) == 0);
        const bad_args ro[] = {{{"--ctx", "16", "--budget", "1m", "--spill-dir", dir},
                                "cannot create files in"}};
        expect_usage_errors("stress", ro, 1);
        rmdir(dir);
    }
}
END_TEST

/* The size formula's two checks (docs/memory.md), through `pagedkv mem`: the number must appear
 * as a whole word in the output. */
START_TEST(mem_formula)
{
    static const struct { const char *kv; const char *want; } rows[] = {
        {"8", "1073741824"}, {"32", "4294967296"}};
    for (size_t i = 0; i < 2; i++) {
        pkvt_proc p;
        p = pkvt_tool((const char *[]){"mem", "--layers", "32", "--kv-heads", rows[i].kv,
                                      "--head-dim", "128", "--ctx", "8192", "--dtype", "f16",
                                      NULL}, NULL);
        ck_assert_msg(p.status == 0, "mem: exit %d: %s", p.status, p.err);
        const char *at = p.out;
        bool whole = false;
        while ((at = strstr(at, rows[i].want)) != NULL) {
            char before = at == p.out ? ' ' : at[-1], after = at[strlen(rows[i].want)];
            whole = whole || ((before < '0' || before > '9') && (after < '0' || after > '9'));
            at++;
        }
        ck_assert_msg(whole, "mem --kv-heads %s: no %s in: %s", rows[i].kv, rows[i].want,
                      p.out);
        pkvt_proc_free(&p);
    }
}
END_TEST

/* ---- real stress runs ------------------------------------------------------------- */

typedef struct {
    uint32_t ctx, sessions, layers, h, g, d, bt, fork_every, reps;
    pkv_dtype dt;
} geometry;

static const char *const dtype_names[] = {"f32", "f16", "bf16", "q8", "q4"};

/* Bytes of one stored row of d values: the per-value sizes (docs/memory.md); for Q8/Q4
 * (docs/numerics.md, section 6) blocks of 32 values (the last shorter), each 2 bytes of f16 scale
 * and then one byte (Q8) or half a byte rounded up (Q4) per value. Computed here, not taken from
 * the library. */
static uint64_t row_bytes(pkv_dtype dt, uint64_t d)
{
    static const uint64_t per_value[] = {4, 2, 2};
    if (dt <= PKV_BF16)
        return d * per_value[dt];
    uint64_t b = 0;
    for (uint64_t i = 0; i < d; i += 32) {
        const uint64_t m = d - i < 32 ? d - i : 32;
        b += 2 + (dt == PKV_Q8 ? m : (m + 1) / 2);
    }
    return b;
}

/* The expected figures, computed here from docs/memory.md, docs/design.md ("Page layout") and
 * docs/numerics.md (section 6), not by the tool. */
static void check_stress_json(const char *json, const geometry *g, uint64_t seed)
{
    uint64_t pages = (g->ctx + g->bt - 1) / g->bt;
    uint64_t page_bytes = 2ull * g->g * g->bt * row_bytes(g->dt, g->d);
    uint64_t ideal = 2ull * g->layers * g->g * g->ctx * row_bytes(g->dt, g->d);
    ck_assert_msg(pkvt_json_valid(json), "seed %llu: stdout is not one JSON value: %s",
                  (unsigned long long)seed, json);
    ck_assert_msg(pkvt_json_find(json, "command") && pkvt_json_find(json, "config.ctx") &&
                      pkvt_json_find(json, "append.tokens_per_s") &&
                      pkvt_json_find(json, "decode.fit.r2") &&
                      pkvt_json_find(json, "engine.bytes_allocator") &&
                      pkvt_json_find(json, "peak_rss_bytes") &&
                      pkvt_json_find(json, "decode.buckets[0].p90_us"),
                  "seed %llu: keys missing in %s", (unsigned long long)seed, json);
    ck_assert_uint_eq(pkvt_json_u64(json, "tokens"), g->ctx);
    ck_assert_msg(pkvt_json_is(json, "memory_check.exact", "true"), "seed %llu: memory check: %s",
                  (unsigned long long)seed, pkvt_json_find(json, "memory_check"));
    ck_assert_uint_eq(pkvt_json_u64(json, "engine.page_bytes"), page_bytes);
    ck_assert_uint_eq(pkvt_json_u64(json, "engine.pages_in_use"), pages * g->layers * g->sessions);
    ck_assert_uint_eq(pkvt_json_len(json, "sessions"), g->sessions);
    char path[96];
    for (uint32_t s = 0; s < g->sessions; s++) {
        snprintf(path, sizeof path, "sessions[%u].bytes_resident", s);
        ck_assert_msg(pkvt_json_u64(json, path) == pages * g->layers * page_bytes,
                      "seed %llu: %s = %llu, want %llu", (unsigned long long)seed, path,
                      (unsigned long long)pkvt_json_u64(json, path),
                      (unsigned long long)(pages * g->layers * page_bytes));
        snprintf(path, sizeof path, "sessions[%u].bytes_ideal", s);
        ck_assert_uint_eq(pkvt_json_u64(json, path), ideal);
        snprintf(path, sizeof path, "sessions[%u].bytes_shared", s);
        ck_assert_uint_eq(pkvt_json_u64(json, path), 0);
    }
    /* every timed decode lands in exactly one bucket; points ascend and end at ctx */
    size_t np = pkvt_json_len(json, "decode.points"), nb = pkvt_json_len(json, "decode.buckets");
    uint64_t in_buckets = 0, prev = 0;
    for (size_t i = 0; i < nb; i++) {
        snprintf(path, sizeof path, "decode.buckets[%zu].samples", i);
        in_buckets += pkvt_json_u64(json, path);
        snprintf(path, sizeof path, "decode.buckets[%zu].p50_us", i);
        double p50 = pkvt_json_num(json, path);
        snprintf(path, sizeof path, "decode.buckets[%zu].max_us", i);
        ck_assert_msg(p50 <= pkvt_json_num(json, path), "seed %llu: bucket %zu p50 > max",
                      (unsigned long long)seed, i);
    }
    ck_assert_uint_eq(in_buckets, pkvt_json_u64(json, "decode.samples"));
    ck_assert_uint_eq(in_buckets, (uint64_t)np * g->sessions * g->layers * g->reps);
    for (size_t i = 0; i < np; i++) {
        snprintf(path, sizeof path, "decode.points[%zu].ctx", i);
        uint64_t c = pkvt_json_u64(json, path);
        ck_assert_msg(c > prev, "seed %llu: decode points not ascending",
                      (unsigned long long)seed);
        prev = c;
    }
    ck_assert_uint_eq(prev, g->ctx);
    uint64_t forks = g->fork_every ? (uint64_t)(g->ctx - 1) / g->fork_every * g->sessions : 0;
    ck_assert_uint_eq(pkvt_json_u64(json, "forks.count"), forks);
    ck_assert_uint_eq(pkvt_json_u64(json, "forks.mismatches"), 0);
}

/* The SVG is well-formed, has both panels' series, and the p50 line has one vertex
 * per decode point. */
static void check_stress_svg(const char *path, size_t n_points, uint64_t seed)
{
    char *svg = pkvt_slurp(path, NULL), root[48] = "";
    ck_assert_msg(xml_wellformed(svg, root, sizeof root) && strcmp(root, "svg") == 0,
                  "seed %llu: %s is not well-formed SVG", (unsigned long long)seed, path);
    static const char *const names[] = {"p50", "p90", "least-squares fit", "resident (paged)",
                                        "ideal (formula)", "process RSS"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char tag[64];
        snprintf(tag, sizeof tag, "<g class=\"series\"><title>%s", names[i]);
        ck_assert_msg(has(svg, tag), "seed %llu: no series '%s' in the SVG",
                      (unsigned long long)seed, names[i]);
    }
    const char *p50 = strstr(svg, "<title>p50</title>");
    const char *pts = strstr(p50, "points=\"");
    ck_assert(pts != NULL);
    pts += 8;
    size_t commas = 0;
    for (const char *c = pts; *c != '"'; c++)
        commas += *c == ',';
    ck_assert_msg(commas == n_points, "seed %llu: p50 line has %zu vertices, %zu points",
                  (unsigned long long)seed, commas, n_points);
    free(svg);
}

/* python3, when present, parses the same JSON and SVG independently. */
static void python_cross_check(const char *json, const char *svg_path, uint64_t seed)
{
    if (!python())
        return;
    char path[] = "/tmp/pkvt-json-XXXXXX";
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    close(fd);
    pkvt_write_file(path, json, strlen(json));
    char *err;
    int rc = python_check(
        "import sys, json, xml.etree.ElementTree as E\n"
        "j = json.load(open(sys.argv[1]))\n"
        "assert j['memory_check']['exact'] is True\n"
        "r = E.parse(sys.argv[2]).getroot()\n"
        "ns = '{http://www.w3.org/2000/svg}'\n"
        "assert r.tag == ns + 'svg', r.tag\n"
        "t = [g.find(ns + 'title').text for g in r.iter(ns + 'g')\n"
        "     if g.get('class') == 'series']\n"
        "assert len(t) >= 6 and 'p50' in t and 'resident (paged)' in t, t\n",
        path, svg_path, &err);
    unlink(path);
    ck_assert_msg(rc == 0, "seed %llu: python3 rejects the JSON or the SVG: %s",
                  (unsigned long long)seed, err);
    free(err);
}

static void stress_run_geometry(const geometry *g, uint64_t seed)
{
    char a[10][24], svg[] = "/tmp/pkvt-svg-XXXXXX";
    int fd = mkstemp(svg);
    ck_assert(fd >= 0);
    close(fd);
    uint32_t v[] = {g->ctx, g->sessions, g->layers, g->h, g->g, g->d, g->bt, g->fork_every,
                    g->reps};
    for (size_t i = 0; i < 9; i++)
        snprintf(a[i], sizeof a[i], "%u", v[i]);
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"stress", "--ctx", a[0], "--sessions", a[1], "--layers",
                                  a[2], "--heads", a[3], "--kv-heads", a[4], "--head-dim",
                                  a[5], "--block-tokens", a[6], "--fork-every", a[7],
                                  "--reps", a[8], "--dtype", dtype_names[g->dt],
                                  "--points", "24", "--threads", "2", "--json", "--svg", svg,
                                  NULL}, NULL);
    ck_assert_msg(p.status == 0, "seed %llu: stress ctx %u s %u L %u h %u g %u d %u bt %u "
                  "fork %u %s: exit %d\n%s%s", (unsigned long long)seed, g->ctx, g->sessions,
                  g->layers, g->h, g->g, g->d, g->bt, g->fork_every, dtype_names[g->dt],
                  p.status, p.err, p.out);
    check_stress_json(p.out, g, seed);
    check_stress_svg(svg, pkvt_json_len(p.out, "decode.points"), seed);
    python_cross_check(p.out, svg, seed);
    unlink(svg);
    pkvt_proc_free(&p);
}

/* A small `bench --json` run: its JSON has the shape --help promises, every figure
 * asked for is there and positive, and kv_bytes follows the formula. Nothing is timed. */
/* The dtype of a JSON string value of the roofline run below ("f16", "q8" or "q4"). */
static pkv_dtype f16_q8_q4(const char *v)
{
    return strncmp(v, "\"f16\"", 5) == 0  ? PKV_F16
           : strncmp(v, "\"q8\"", 4) == 0 ? PKV_Q8
                                            : PKV_Q4;
}

START_TEST(bench_json)
{
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"bench", "--json", "--model-preset", "mqa", "--ctx", "600",
                                  "--dtype", "bf16", "--threads", "1", "--reps", "2",
                                  "--bw-mib", "8", "--prefill", "48", "--no-naive", NULL}, NULL);
    ck_assert_msg(p.status == 0, "bench: exit %d: %s", p.status, p.err);
    ck_assert_msg(pkvt_json_valid(p.out), "bench --json is not valid JSON: %s", p.out);
    ck_assert_uint_eq(pkvt_json_len(p.out, "decode"), 1);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode[0].ctx"), 600);
    const uint64_t g = pkvt_json_u64(p.out, "decode[0].kv_heads"),
                   d = pkvt_json_u64(p.out, "decode[0].head_dim");
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode[0].kv_bytes"), 2 * g * d * 600 * 2);
    const char *pos[] = {"decode[0].ours_gbs", "decode[0].bw_gbs", "decode[0].ours_ratio",
                         "decode[0].scalar_gbs", "prefill[0].gflops", "prefill[0].peak_gflops",
                         "prefill[0].cold_gflops", "prefill[0].seconds", "peak_fma[0].gflops"};
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        ck_assert_msg(pkvt_json_num(p.out, pos[i]) > 0, "%s is not positive", pos[i]);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "prefill[0].tokens"), 48);
    pkvt_proc_free(&p);

    /* the roofline (docs/performance.md, "What bounds decode") of f16 and the block types: bytes by
     * the block format, arithmetic by the path, the binding bound named, f16 against itself 1 */
    p = pkvt_tool((const char *[]){"bench", "--json", "--model-preset", "mqa", "--ctx", "600",
                                  "--dtype", "f16,q8,q4", "--threads", "1", "--reps", "2",
                                  "--bw-mib", "8", "--prefill", "0", "--no-naive",
                                  "--no-scalar", "--in-cache", "256", NULL}, NULL);
    ck_assert_msg(p.status == 0, "bench: exit %d: %s", p.status, p.err);
    ck_assert_msg(pkvt_json_valid(p.out), "bench --json is not valid JSON: %s", p.out);
    ck_assert_uint_eq(pkvt_json_len(p.out, "integer_path"), 2);
    const bool int_ok[2] = {pkvt_json_is(p.out, "integer_path[0].available", "true"),
                            pkvt_json_is(p.out, "integer_path[1].available", "true")};
    const size_t rows = pkvt_json_len(p.out, "decode");
    ck_assert_uint_eq(rows, 3 + int_ok[0] + int_ok[1]);
    ck_assert_uint_eq(pkvt_json_len(p.out, "in_cache"), rows);
    ck_assert(pkvt_json_num(p.out, "peak_int8.threads[0].gops") > 0);
    for (size_t i = 0; i < rows; i++) {
        char k[64];
#define ROW(key) (snprintf(k, sizeof k, "decode[%zu].%s", i, key), k)
        const pkv_dtype t = f16_q8_q4(pkvt_json_find(p.out, ROW("dtype")));
        const bool integer = pkvt_json_is(p.out, ROW("path"), "\"integer\"");
        ck_assert(integer || pkvt_json_is(p.out, ROW("path"), "\"exact\""));
        ck_assert_uint_eq(pkvt_json_u64(p.out, ROW("kv_bytes")), 2 * g * 600 * row_bytes(t, d));
        const double hd = 32.0 * d; /* mqa: 32 heads */
        /* the exact block types on avx512vnni: scores from four int8 limbs of q */
        const bool limbs = !integer && t != PKV_F16 && d % 32 == 0 &&
                           pkvt_json_is(p.out, "isa", "\"avx512vnni\"");
        ck_assert(pkvt_json_num(p.out, ROW("flops_per_pos")) ==
                  (integer || limbs ? 2 : 4) * hd);
        ck_assert(pkvt_json_num(p.out, ROW("int_ops_per_pos")) ==
                  (integer ? 2 * hd : limbs ? 8 * hd : 0));
        ck_assert(pkvt_json_is(p.out, ROW("binds"), "\"dram\"") ||
                  pkvt_json_is(p.out, ROW("binds"), "\"compute\""));
        ck_assert(pkvt_json_num(p.out, ROW("roofline_frac")) > 0);
        ck_assert(pkvt_json_num(p.out, ROW("dram_bound_us")) > 0 &&
                  pkvt_json_num(p.out, ROW("compute_bound_us")) > 0);
        /* a row faster than its bound says why: its K/V (partly) in cache */
        const double frac = pkvt_json_num(p.out, ROW("roofline_frac"));
        ck_assert_msg(frac > 1.05 ? pkvt_json_is(p.out, ROW("above_roofline"), "\"in_cache\"") ||
                                        pkvt_json_is(p.out, ROW("above_roofline"),
                                                     "\"partly_in_cache\"")
                                  : pkvt_json_is(p.out, ROW("above_roofline"), "null"),
                      "row %zu: frac %g, above_roofline %s", i, frac,
                      pkvt_json_find(p.out, ROW("above_roofline")));
        if (t == PKV_F16)
            ck_assert(pkvt_json_num(p.out, ROW("vs_f16")) == 1.0);
#undef ROW
        snprintf(k, sizeof k, "in_cache[%zu].frac", i);
        ck_assert(pkvt_json_num(p.out, k) > 0);
        /* the in-cache row's K/V at --in-cache tokens, for its own dtype */
        snprintf(k, sizeof k, "in_cache[%zu].dtype", i);
        const pkv_dtype ti = f16_q8_q4(pkvt_json_find(p.out, k));
        snprintf(k, sizeof k, "in_cache[%zu].kv_bytes", i);
        ck_assert_uint_eq(pkvt_json_u64(p.out, k), 2 * g * 256 * row_bytes(ti, d));
    }
    ck_assert(pkvt_json_find(p.out, "llc_bytes") != NULL);
    /* sessions this small fit together: every round timed all five rows */
    ck_assert(pkvt_json_is(p.out, "rows_together", "true"));
    pkvt_proc_free(&p);

    /* --in-turn: the same rows, one after another, said so */
    p = pkvt_tool((const char *[]){"bench", "--json", "--model-preset", "mqa", "--ctx", "600",
                                  "--dtype", "f16,q8", "--threads", "1", "--reps", "2",
                                  "--bw-mib", "8", "--prefill", "0", "--no-naive",
                                  "--no-scalar", "--in-cache", "0", "--in-turn", NULL}, NULL);
    ck_assert_msg(p.status == 0, "bench --in-turn: exit %d: %s", p.status, p.err);
    ck_assert(pkvt_json_is(p.out, "rows_together", "false"));
    ck_assert_uint_eq(pkvt_json_len(p.out, "decode"), 2 + int_ok[0]);
    ck_assert(pkvt_json_is(p.out, "decode[0].dtype", "\"f16\"") &&
              pkvt_json_num(p.out, "decode[0].vs_f16") == 1.0);
    pkvt_proc_free(&p);

    /* the table: a roofline line for every dtype of the default list */
    p = pkvt_tool((const char *[]){"bench", "--model-preset", "mqa", "--ctx", "300",
                                  "--threads", "1", "--reps", "1", "--bw-mib", "8",
                                  "--prefill", "0", "--no-naive", "--no-scalar",
                                  "--in-cache", "0", NULL}, NULL);
    ck_assert_msg(p.status == 0, "bench: exit %d: %s", p.status, p.err);
    const char *roof = strstr(p.out, "\nroofline");
    ck_assert_msg(roof != NULL, "no roofline section: %s", p.out);
    for (size_t i = 0; i < 5; i++) {
        char line[32];
        snprintf(line, sizeof line, "300 %-4s exact ", dtype_names[i]);
        ck_assert_msg(has(roof, line), "roofline lacks '%s': %s", line, roof);
    }
    ck_assert(has(roof, "binds") && has(roof, "vs f16"));
    pkvt_proc_free(&p);

    /* --spill --json has the top-level keys of every bench --json, then its figures */
    char dir[] = "/tmp/pkvt-bspill-XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    p = pkvt_tool((const char *[]){"bench", "--spill", "--json", "--spill-mib", "1", "--reps",
                                  "1", "--spill-dir", dir, NULL}, NULL);
    ck_assert_msg(p.status == 0, "bench --spill: exit %d: %s", p.status, p.err);
    ck_assert_msg(pkvt_json_valid(p.out), "bench --spill --json is not valid JSON: %s", p.out);
    const char *tool_v = pkvt_json_find(p.out, "tool"), *ver = pkvt_json_find(p.out, "version");
    ck_assert_msg(tool_v && strncmp(tool_v, "\"pagedkv\"", 9) == 0 && ver &&
                      *ver == '"' && pkvt_json_find(p.out, "spill_dir"),
                  "top-level keys missing: %s", p.out);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "spill.mib_per_session"), 1);
    ck_assert_msg(pkvt_json_len(p.out, "spill.backends") >= 1 &&
                      pkvt_json_num(p.out, "spill.backends[0].spill_restore_gbs") > 0,
                  "no spill figures: %s", p.out);
    pkvt_proc_free(&p);
    ck_assert_msg(rmdir(dir) == 0, "bench --spill left files behind: %s", strerror(errno));
}
END_TEST

START_TEST(stress_json_random)
{
    uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    static const uint32_t ds[] = {1, 8, 17, 64, 128};
    static const uint32_t bts[] = {1, 3, 16, 64};
    int runs = pkvt_quick() ? 1 : 4;
    for (int i = 0; i < runs; i++) {
        geometry g;
        g.g = 1u << pkvt_below(&r, 3);
        g.h = g.g << pkvt_below(&r, 3);
        g.d = ds[pkvt_below(&r, 5)];
        g.bt = bts[pkvt_below(&r, 4)];
        g.ctx = 1 + pkvt_below(&r, 900);
        g.sessions = 1 + pkvt_below(&r, 3);
        g.layers = 1 + pkvt_below(&r, 3);
        g.fork_every = pkvt_below(&r, 2) ? 1 + pkvt_below(&r, 200) : 0;
        g.reps = 1 + pkvt_below(&r, 3);
        g.dt = (pkv_dtype)pkvt_below(&r, 5);
        stress_run_geometry(&g, seed);
    }
}
END_TEST

/* --decode-every adds exactly its multiples to the log-spaced lengths. */
/* The many-query rows (docs/speculative.md): bench --verify/--shared give a row each
 * with positive times and their roofline, in the JSON envelope; stress --verify/--shared
 * time them at every decode point and leave the memory check exact. */
START_TEST(many_query_rows)
{
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"bench", "--verify", "4", "--shared", "3", "--json",
                                  "--preset", "mqa", "--ctx", "300", "--private", "20",
                                  "--threads", "1", "--reps", "1", "--bw-mib", "64", NULL},
                  NULL);
    ck_assert_msg(p.status == 0 && pkvt_json_valid(p.out), "bench: exit %d: %s%s", p.status,
                  p.out, p.err);
    ck_assert_msg(pkvt_json_is(p.out, "command", "\"bench\""), "%s", p.out);
    ck_assert_uint_eq(pkvt_json_len(p.out, "rows"), 2);
    const char *pos[] = {"rows[0].us", "rows[0].replaced_us", "rows[0].roofline_fraction",
                         "rows[1].us", "rows[1].replaced_us", "rows[1].roofline_fraction"};
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        ck_assert_msg(pkvt_json_num(p.out, pos[i]) > 0, "%s is not positive: %s", pos[i],
                      p.out);
    pkvt_proc_free(&p);
    p = pkvt_tool((const char *[]){"stress", "--ctx", "200", "--heads", "4", "--kv-heads", "2",
                                  "--head-dim", "16", "--block-tokens", "5", "--points", "3",
                                  "--reps", "1", "--verify", "5", "--shared", "3", "--json",
                                  "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0 && pkvt_json_valid(p.out), "stress: exit %d: %s%s", p.status,
                  p.out, p.err);
    const char *sp[] = {"decode.points[2].verify_us", "decode.points[2].k_decodes_us",
                        "decode.points[2].shared_batch_us",
                        "decode.points[2].separate_decodes_us"};
    for (size_t i = 0; i < sizeof sp / sizeof sp[0]; i++)
        ck_assert_msg(pkvt_json_num(p.out, sp[i]) > 0, "%s is not positive: %s", sp[i], p.out);
    pkvt_proc_free(&p);
    static const bad_args rows[] = {{{"--verify", "17"}, "--verify"},
                                    {{"--shared", "1"}, "--shared"}};
    expect_usage_errors("stress", rows, sizeof rows / sizeof rows[0]);
}
END_TEST

START_TEST(stress_decode_every)
{
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"stress", "--ctx", "256", "--heads", "4", "--kv-heads", "2",
                                  "--head-dim", "16", "--points", "2", "--decode-every", "16",
                                  "--reps", "1", "--json", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0, "exit %d: %s", p.status, p.err);
    ck_assert(pkvt_json_valid(p.out));
    /* {1, 256} from --points 2, and 16, 32, ..., 256 */
    ck_assert_uint_eq(pkvt_json_len(p.out, "decode.points"), 17);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode.points[0].ctx"), 1);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode.points[1].ctx"), 16);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode.points[16].ctx"), 256);
    pkvt_proc_free(&p);

    /* the text summary says the memory check passed */
    p = pkvt_tool((const char *[]){"stress", "--ctx", "100", "--model-preset", "mqa",
                                  "--layers", "2", "--head-dim", "8", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0 && has(p.out, "memory check: exact") &&
                      has(p.out, "kv-heads 1") && has(p.out, "heads 32"),
                  "text run: exit %d: %s%s", p.status, p.out, p.err);
    pkvt_proc_free(&p);

    /* a plot that cannot be written is a usage error before any work: no summary,
     * no file left behind (the rows of stress_usage check the other paths) */
    p = pkvt_tool((const char *[]){"stress", "--ctx", "10", "--heads", "2", "--kv-heads", "1",
                                  "--head-dim", "4", "--quiet", "--svg",
                                  "/nonexistent-dir/x.svg", NULL}, NULL);
    ck_assert_msg(p.status == 2 && has(p.err, "x.svg") && !p.out[0],
                  "bad --svg: exit %d, stdout %s, stderr %s", p.status, p.out, p.err);
    pkvt_proc_free(&p);
}
END_TEST

/* Under a budget with a spill directory: pages go to disk, the memory report still
 * adds up to the formula, and the spill file leaves no name behind (docs/design.md, "Memory budget
 * and spill"). Without a spill directory the same budget runs out: exit 1, with the error in the
 * JSON. */
START_TEST(stress_spill)
{
    char dir[] = "/tmp/pkvt-spill-XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    const uint64_t page = 2 * 2 * 16 * 32 * 2, pages = (3000 + 15) / 16;
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"stress", "--ctx", "3000", "--sessions", "3", "--heads", "4",
                                  "--kv-heads", "2", "--head-dim", "32", "--block-tokens", "16",
                                  "--budget", "819200", "--spill-dir", dir, "--fork-every",
                                  "700", "--points", "12", "--json", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0, "spill run: exit %d: %s%s", p.status, p.err, p.out);
    ck_assert(pkvt_json_valid(p.out));
    ck_assert_msg(pkvt_json_is(p.out, "memory_check.exact", "true"), "memory check: %s",
                  pkvt_json_find(p.out, "memory_check"));
    ck_assert(pkvt_json_find(p.out, "memory_check.compares") &&
              strncmp(pkvt_json_find(p.out, "memory_check.compares"), "\"bytes_resident+",
                      16) == 0);
    ck_assert_msg(pkvt_json_u64(p.out, "engine.pages_spilled") > 0, "nothing spilled: %s", p.out);
    ck_assert_uint_le(pkvt_json_u64(p.out, "engine.pages_in_use"), 819200 / page);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "forks.mismatches"), 0);
    char path[64];
    for (int s = 0; s < 3; s++) {
        snprintf(path, sizeof path, "sessions[%d].bytes_resident", s);
        uint64_t res = pkvt_json_u64(p.out, path);
        snprintf(path, sizeof path, "sessions[%d].bytes_spilled", s);
        ck_assert_uint_eq(res + pkvt_json_u64(p.out, path), pages * page);
    }
    pkvt_proc_free(&p);
    ck_assert_msg(rmdir(dir) == 0, "the spill directory is not empty after the run: %s",
                  strerror(errno));

    p = pkvt_tool((const char *[]){"stress", "--ctx", "3000", "--sessions", "3", "--heads", "4",
                                  "--kv-heads", "2", "--head-dim", "32", "--block-tokens", "16",
                                  "--budget", "819200", "--json", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 1, "budget without spill: exit %d", p.status);
    ck_assert(pkvt_json_valid(p.out));
    const char *err = pkvt_json_find(p.out, "error");
    ck_assert_msg(err && *err == '"', "no error in the JSON: %s", p.out);
    ck_assert_uint_lt(pkvt_json_u64(p.out, "tokens"), 3000);
    /* the same error on stderr: `--json > run.json` must not hide it (docs/tools.md) */
    ck_assert_msg(has(p.err, "pagedkv stress: pkv_append at ") &&
                      has(p.err, pkv_status_str(PKV_ENOMEM)),
                  "the error is not on stderr: %s", p.err);
    pkvt_proc_free(&p);

    /* and in text mode: the report's "error:" line on stdout, the error on stderr */
    p = pkvt_tool((const char *[]){"stress", "--ctx", "3000", "--sessions", "3", "--heads", "4",
                                  "--kv-heads", "2", "--head-dim", "32", "--block-tokens", "16",
                                  "--budget", "819200", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 1 && has(p.out, "error: pkv_append at ") &&
                      has(p.err, "pagedkv stress: pkv_append at "),
                  "text run over budget: exit %d\nstdout %s\nstderr %s", p.status, p.out,
                  p.err);
    pkvt_proc_free(&p);
}
END_TEST

/* Contexts whose buffers exceed any machine's memory are refused before anything is
 * allocated, naming the bytes needed and the machine's memory (bench has no spill;
 * stress without --budget has nothing to bound it); a budget lifts stress's guard.
 * Without the guard these runs allocate until the OOM killer ends them. */
START_TEST(memory_guard)
{
    static const bad_args bench_rows[] = {
        {{"--ctx", "1g", "--reps", "1"}, "physical memory"},
        /* 2 * 1 * 128 * 2^32 * 2 bytes of K/V + 1 MiB of bandwidth buffer */
        {{"--ctx", "4g", "--model-preset", "mqa", "--dtype", "f16", "--no-naive",
          "--bw-mib", "1"}, "needs 2199024304128 bytes"},
    };
    expect_usage_errors("bench", bench_rows, 2);
    static const bad_args stress_rows[] = {
        {{"--ctx", "1g"}, "4398046511104 bytes"},
        {{"--ctx", "1g", "--sessions", "3", "--json"}, "--force"},
    };
    expect_usage_errors("stress", stress_rows, 2);
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"bench", "--ctx", "1g", "--bw-mib", "2048", NULL}, NULL);
    ck_assert_msg(has(p.err, "physical memory,") && has(p.err, " bytes (") &&
                      /* f32: 2*8*128*2^30*4 bytes + the 2 GiB bandwidth buffer */
                      has(p.err, "needs 8798240505856 bytes"),
                  "bench's refusal names no figures: %s", p.err);
    pkvt_proc_free(&p);
    /* with a budget stress runs (and the budget, not RAM, stops it: exit 1) */
    p = pkvt_tool((const char *[]){"stress", "--ctx", "1g", "--budget", "1m", "--quiet",
                                  "--json", NULL}, NULL);
    ck_assert_msg(p.status == 1 && pkvt_json_valid(p.out) && has(p.err, "out of memory"),
                  "stress --ctx 1g --budget 1m: exit %d: %s", p.status, p.err);
    pkvt_proc_free(&p);
}
END_TEST

/* Ctrl-C stops the run, and the summary of the work so far is still printed. */
START_TEST(stress_sigint)
{
    const char *argv[] = {"pagedkv", "stress", "--ctx", "1g", "--heads", "2", "--kv-heads",
                          "1", "--head-dim", "4", "--points", "40", "--json", "--force",
                          NULL};
    pkvt_child c = pkvt_start(pkvt_tool_path(), argv, NULL);
    /* the start line on stderr comes after the handler is installed */
    char err_path[64];
    snprintf(err_path, sizeof err_path, "/proc/self/fd/%d", c.err_fd);
    bool started = false;
    for (int i = 0; i < 2000 && !started; i++) {
        struct stat st;
        if (fstat(c.err_fd, &st) == 0 && st.st_size > 0) {
            char *e = pkvt_slurp(err_path, NULL);
            started = has(e, "session(s) x");
            free(e);
        }
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    ck_assert_msg(started, "stress did not start");
    nanosleep(&(struct timespec){0, 300 * 1000 * 1000}, NULL);
    kill(c.pid, SIGINT);
    pkvt_proc p = pkvt_finish(&c);
    ck_assert_msg(p.status == 130, "after SIGINT: exit %d (stderr %s)", p.status, p.err);
    ck_assert_msg(pkvt_json_valid(p.out), "after SIGINT: not JSON: %s", p.out);
    ck_assert(pkvt_json_is(p.out, "interrupted", "true"));
    uint64_t done = pkvt_json_u64(p.out, "tokens");
    ck_assert_msg(done > 0 && done < (1ull << 30), "tokens %llu", (unsigned long long)done);
    ck_assert(pkvt_json_is(p.out, "memory_check.exact", "true"));
    ck_assert_uint_eq(pkvt_json_u64(p.out, "sessions[0].bytes_ideal"), 2ull * 1 * 4 * done * 2);
    pkvt_proc_free(&p);
}
END_TEST

/* bench tells where it is on stderr, step by step (--quiet: silent); its default run
 * is the short one (two contexts), --full the long one (three). */
START_TEST(bench_progress)
{
    const char *base[] = {"bench", "--json", "--model-preset", "mqa", "--dtype", "f16",
                          "--threads", "1", "--reps", "1", "--bw-mib", "8", "--prefill", "0",
                          "--in-cache", "0", "--no-naive", "--no-scalar", NULL, NULL, NULL};
    pkvt_proc p = pkvt_tool(base, NULL);
    ck_assert_msg(p.status == 0, "bench: exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_len(p.out, "decode"), 2);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode[0].ctx"), 4096);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode[1].ctx"), 32768);
    ck_assert_msg(has(p.err, "pagedkv bench: [1/2] mqa, 4096 tokens") &&
                      has(p.err, "pagedkv bench: [2/2] mqa, 32768 tokens") &&
                      has(p.err, "--full for the long run"),
                  "no progress on stderr: %s", p.err);
    pkvt_proc_free(&p);
    base[18] = "--full";
    base[19] = "--quiet";
    p = pkvt_tool(base, NULL);
    ck_assert_msg(p.status == 0, "bench --full: exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_len(p.out, "decode"), 3);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode[2].ctx"), 131072);
    ck_assert_msg(p.err[0] == 0, "--quiet wrote to stderr: %s", p.err);
    pkvt_proc_free(&p);
}
END_TEST

/* The checkers themselves reject what they must, or a broken output would pass. */
START_TEST(checkers)
{
    ck_assert(pkvt_json_valid("{\"a\":[1,2.5e3,-0.5,true,null,\"x\\n\"],\"b\":{}}"));
    static const char *const bad_json[] = {"", "{", "{\"a\":1,}", "[1 2]", "{\"a\" 1}",
                                           "01", "1.", "\"\t\"", "{} {}", "nan", "[-]"};
    for (size_t i = 0; i < sizeof bad_json / sizeof bad_json[0]; i++)
        ck_assert_msg(!pkvt_json_valid(bad_json[i]), "accepted JSON %s", bad_json[i]);
    const char *j = "{\"x\":{\"y\":[5,{\"z\":7}]},\"w\":true}";
    ck_assert_uint_eq(pkvt_json_u64(j, "x.y[0]"), 5);
    ck_assert_uint_eq(pkvt_json_u64(j, "x.y[1].z"), 7);
    ck_assert(pkvt_json_is(j, "w", "true"));
    ck_assert(pkvt_json_find(j, "x.q") == NULL);
    char root[48];
    ck_assert(xml_wellformed("<?xml version=\"1.0\"?>\n<svg a=\"1\"><g><t>x &amp; y</t></g>"
                             "<c/></svg>\n", root, sizeof root));
    ck_assert_str_eq(root, "svg");
    static const char *const bad_xml[] = {"<a><b></a></b>", "<a>", "<a x=1/>", "<a/><b/>",
                                          "<a>&bogus;</a>", "<a>x < y</a>", "text<a/>",
                                          "<a x=\"1\"y=\"2\"/>"};
    for (size_t i = 0; i < sizeof bad_xml / sizeof bad_xml[0]; i++)
        ck_assert_msg(!xml_wellformed(bad_xml[i], root, sizeof root), "accepted XML %s",
                      bad_xml[i]);
}
END_TEST


/* ---- attention variants (docs/variants.md) --------------------------------------------- */

/* Pages one windowed layer of length n holds, from docs/variants.md's words (computed here,
 * not by the tool): the sink pages, and every page with a position a decode at
 * n - 1 - r (r <= rollback) reads, i.e. a position >= n - window - rollback. */
static uint64_t spec_window_pages(uint64_t n, uint64_t bt, uint64_t w, uint64_t sinks,
                                  uint64_t rollback)
{
    uint64_t pages = 0;
    for (uint64_t i = 0; i * bt < n; i++) {
        uint64_t lo = i * bt, hi = lo + bt - 1;   /* the page's positions */
        bool sink = lo < sinks;
        bool read = hi + w + rollback >= n;       /* hi >= n - w - rollback */
        pages += sink || read;
    }
    return pages;
}

/* `stress --shift` (docs/rope.md: llama.cpp's context shift, repeated): its claims
 * against figures computed here. Every shift keeps --keep positions, drops half of the
 * rest and fills the context again, so the pages held are those of a full context
 * after every shift - exactly, not roughly: a discard that leaked or kept one page too
 * many shows at the next point. The rows counted are the formula's; the times are only
 * checked to be there (benchmarks are tools, never timed tests). */
static void check_shift_svg(const char *path, uint32_t points)
{
    char *svg = pkvt_slurp(path, NULL), root[48] = "";
    ck_assert_msg(xml_wellformed(svg, root, sizeof root) && strcmp(root, "svg") == 0,
                  "%s is not well-formed SVG", path);
    static const char *const names[] = {"bytes_resident, all sessions", "engine pages",
                                        "RSS growth", "decode p50 at the full context"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char tag[96];
        snprintf(tag, sizeof tag, "<g class=\"series\"><title>%s", names[i]);
        ck_assert_msg(has(svg, tag), "no series '%s' in the SVG", names[i]);
    }
    const char *line = strstr(svg, "<title>bytes_resident, all sessions</title>");
    const char *pts = line ? strstr(line, "points=\"") : NULL;
    ck_assert(pts != NULL);
    uint32_t commas = 0;
    for (const char *c = pts + 8; *c != '"'; c++)
        commas += *c == ',';
    ck_assert_msg(commas == points, "the memory line has %u vertices, %u points", commas,
                  points);
    free(svg);
}

START_TEST(stress_shift)
{
    /* 2 sessions x 2 layers, g 2, d 16, f16, 16-token pages; ctx 200, keep 5: a shift
     * drops 97 positions and moves the 98 after them */
    const uint64_t S = 6, N = 2, L = 2, ctx = 200, keep = 5, drop = (ctx - keep) / 2;
    const uint64_t page = 2 * 2 * 16 * row_bytes(PKV_F16, 16);
    const uint64_t full = N * L * ((ctx + 15) / 16) * page;
    char svg[] = "/tmp/pkvt-svg-XXXXXX";
    int fd = mkstemp(svg);
    ck_assert(fd >= 0);
    close(fd);
#define SHIFT_ARGS "stress", "--shift", "6", "--ctx", "200", "--keep", "5", "--sessions", "2", \
                   "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",    \
                   "--block-tokens", "16", "--dtype", "f16", "--threads", "1", "--reps", "2"
    pkvt_proc p = pkvt_tool((const char *[]){SHIFT_ARGS, "--json", "--svg", svg, NULL}, NULL);
    ck_assert_msg(p.status == 0, "stress --shift: exit %d\n%s%s", p.status, p.err, p.out);
    ck_assert_msg(pkvt_json_valid(p.out), "stress --shift --json: not one JSON value: %s",
                  p.out);
    ck_assert(pkvt_json_is(p.out, "command", "\"stress\"") &&
              pkvt_json_is(p.out, "dtype", "\"f16\""));
    ck_assert_uint_eq(pkvt_json_u64(p.out, "ctx"), ctx);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "keep"), keep);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "shifts"), S);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "sessions"), N);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "layers"), L);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "rows_moved"), S * N * (ctx - keep - drop));
    ck_assert_uint_eq(pkvt_json_u64(p.out, "rows_appended"), S * N * drop);
    ck_assert(pkvt_json_num(p.out, "discard_seconds") >= 0 &&
              pkvt_json_num(p.out, "refill_seconds") >= 0);
    ck_assert_uint_eq(pkvt_json_len(p.out, "points"), S + 1);
    for (uint64_t k = 0; k <= S; k++) {
        char path[64];
#define AT(field) (snprintf(path, sizeof path, "points[%llu]." field, (unsigned long long)k), path)
        ck_assert_uint_eq(pkvt_json_u64(p.out, AT("shift")), k);
        ck_assert_msg(pkvt_json_u64(p.out, AT("bytes_resident")) == full,
                      "after shift %llu: %llu bytes resident, a full context is %llu",
                      (unsigned long long)k,
                      (unsigned long long)pkvt_json_u64(p.out, AT("bytes_resident")),
                      (unsigned long long)full);
        ck_assert_uint_eq(pkvt_json_u64(p.out, AT("engine_bytes")), full);
        ck_assert(pkvt_json_find(p.out, AT("rss_delta")) != NULL);
        const double us = pkvt_json_num(p.out, AT("decode_us_p50"));
        ck_assert_msg(us > 0 && isfinite(us), "shift %llu: decode p50 %g",
                      (unsigned long long)k, us);
        if (k == 0) /* before the first shift nothing was discarded */
            ck_assert(pkvt_json_num(p.out, AT("discard_ms")) == 0 &&
                      pkvt_json_num(p.out, AT("refill_ms")) == 0);
#undef AT
    }
    check_shift_svg(svg, (uint32_t)(S + 1));
    if (python()) { /* python3 reads the same JSON: memory flat at every point */
        char path[] = "/tmp/pkvt-json-XXXXXX";
        fd = mkstemp(path);
        ck_assert(fd >= 0);
        close(fd);
        pkvt_write_file(path, p.out, strlen(p.out));
        char *err;
        const int rc = python_check(
            "import sys, json\n"
            "j = json.load(open(sys.argv[1]))\n"
            "m = {(q['bytes_resident'], q['engine_bytes']) for q in j['points']}\n"
            "assert len(m) == 1 and len(j['points']) == j['shifts'] + 1, m\n",
            path, svg, &err);
        unlink(path);
        ck_assert_msg(rc == 0, "python3 rejects the --shift JSON: %s", err);
        free(err);
    }
    unlink(svg);
    pkvt_proc_free(&p);

    /* the text report says the same */
    p = pkvt_tool((const char *[]){SHIFT_ARGS, "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0 &&
                      has(p.out, "context shift: 2 session(s), ctx 200, keep 5, 6 shifts of "
                                 "97 positions; 2 layers of f16") &&
                      has(p.out, "memory: resident 104.00 KiB before the first shift, "
                                 "104.00 KiB after the last (engine 104.00 KiB") &&
                      has(p.out, "for 1176 rows moved (x 2 layers)") &&
                      has(p.out, "for 1164 rows"),
                  "stress --shift text: exit %d\n%s%s", p.status, p.out, p.err);
    pkvt_proc_free(&p);

    /* spilled sessions: 3 sessions of 13 pages a layer under a 32-page budget; each
     * discard reads its session's pages back first, and the spill file is gone after */
    char dir[] = "/tmp/pkvt-spill-XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    p = pkvt_tool((const char *[]){SHIFT_ARGS, "--sessions", "3", "--budget", "65536",
                                  "--spill-dir", dir, "--json", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0 && pkvt_json_valid(p.out), "stress --shift --spill-dir: "
                  "exit %d\n%s%s", p.status, p.err, p.out);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "sessions"), 3); /* the later --sessions */
    for (uint64_t k = 0; k <= S; k++) {
        char path[64];
        snprintf(path, sizeof path, "points[%llu].engine_bytes", (unsigned long long)k);
        ck_assert_uint_le(pkvt_json_u64(p.out, path), 65536);
    }
    pkvt_proc_free(&p);
    ck_assert_msg(rmdir(dir) == 0, "the spill directory is not empty after the run: %s",
                  strerror(errno));
#undef SHIFT_ARGS

    /* usage: --keep needs --shift, and must leave something to shift */
    p = pkvt_tool((const char *[]){"stress", "--keep", "4", "--ctx", "100", NULL}, NULL);
    ck_assert_msg(p.status == 2 && has(p.err, "--keep"), "--keep alone: exit %d %s",
                  p.status, p.err);
    pkvt_proc_free(&p);
    p = pkvt_tool((const char *[]){"stress", "--shift", "2", "--ctx", "100", "--keep", "99",
                                  "--layers", "1", "--heads", "4", "--kv-heads", "2",
                                  "--head-dim", "16", NULL}, NULL);
    ck_assert_msg(p.status == 2 && has(p.err, "--keep 99 leaves nothing to shift"),
                  "--keep 99 of --ctx 100: exit %d %s", p.status, p.err);
    pkvt_proc_free(&p);
}
END_TEST

/* A windowed stress run: every layer's pages follow the window's rule and stay under
 * the page ceiling (docs/variants.md) at every decode point, memory is level once the window is
 * full (while the context grows 10x), the forks still check out, the plot draws the bound. */
START_TEST(stress_window)
{
    const char *svg = "/tmp/pkvt-window.svg";
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"stress", "--ctx", "3000", "--window", "64", "--sinks",
                                  "4", "--rollback", "5", "--block-tokens", "8", "--layers",
                                  "2", "--sessions", "2", "--heads", "4", "--kv-heads", "2",
                                  "--head-dim", "16", "--dtype", "f32", "--fork-every", "700",
                                  "--reps", "1", "--json", "--quiet", "--svg", svg, NULL}, NULL);
    ck_assert_msg(p.status == 0, "exit %d: %s", p.status, p.err);
    ck_assert(pkvt_json_valid(p.out));
    const uint64_t bt = 8, page = 2ull * 2 * 8 * 16 * 4;   /* 2 g bt d f32 */
    const uint64_t ceiling = 1 + 9 + 1;                     /* ceil(4/8) + ceil(69/8) + 1 */
    ck_assert_uint_eq(pkvt_json_u64(p.out, "window.page_ceiling"), ceiling);
    ck_assert_uint_le(pkvt_json_u64(p.out, "window.pages_held_max"), ceiling);
    ck_assert_msg(pkvt_json_is(p.out, "window.bounded", "true"), "%s",
                  pkvt_json_find(p.out, "window"));
    ck_assert_msg(pkvt_json_is(p.out, "memory_check.exact", "true"), "%s",
                  pkvt_json_find(p.out, "memory_check"));
    ck_assert_uint_eq(pkvt_json_u64(p.out, "forks.mismatches"), 0);
    ck_assert_uint_ge(pkvt_json_u64(p.out, "forks.count"), 8);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "config.windowed_layers"), 2);
    const uint64_t held = spec_window_pages(3000, bt, 64, 4, 5);
    ck_assert_uint_le(held, ceiling);
    for (int s = 0; s < 2; s++) {
        char path[64];
        snprintf(path, sizeof path, "sessions[%d].bytes_resident", s);
        ck_assert_uint_eq(pkvt_json_u64(p.out, path), 2 * held * page);
        snprintf(path, sizeof path, "sessions[%d].tokens", s);
        ck_assert_uint_eq(pkvt_json_u64(p.out, path), 2 * 3000);   /* every position counts */
        snprintf(path, sizeof path, "sessions[%d].bytes_ideal", s);
        ck_assert_uint_eq(pkvt_json_u64(p.out, path), 2ull * (4 + 64 + 5) * 2 * 2 * 16 * 4);
    }
    /* level memory: past the window every point holds what the rule says, and never
     * more than the ceiling, in 2 sessions x 2 layers */
    size_t np = pkvt_json_len(p.out, "decode.points");
    size_t level = 0;
    for (size_t i = 0; i < np; i++) {
        char path[80];
        snprintf(path, sizeof path, "decode.points[%zu].ctx", i);
        uint64_t n = pkvt_json_u64(p.out, path);
        snprintf(path, sizeof path, "decode.points[%zu].bytes_resident", i);
        uint64_t res = pkvt_json_u64(p.out, path);
        ck_assert_uint_eq(res, 4 * spec_window_pages(n, bt, 64, 4, 5) * page);
        ck_assert_uint_le(res, 4 * ceiling * page);
        snprintf(path, sizeof path, "decode.points[%zu].window_pages_max", i);
        ck_assert_uint_le(pkvt_json_u64(p.out, path), ceiling);
        level += n >= 300;
    }
    ck_assert_uint_ge(level, 10);   /* 300 .. 3000 tokens: the flat part is shown */
    pkvt_proc_free(&p);
    char *text = pkvt_slurp(svg, NULL);
    char root[16];
    ck_assert(xml_wellformed(text, root, sizeof root));
    ck_assert_msg(has(text, "<title>page ceiling: 11 pages/layer</title>"),
                  "no bound in the plot");
    ck_assert_msg(has(text, "window 64 on 2 of 2 layer(s)"), "no variant in the title");
    free(text);
    unlink(svg);

    /* the text says so too */
    p = pkvt_tool((const char *[]){"stress", "--ctx", "2000", "--window", "100", "--heads", "2",
                                  "--kv-heads", "1", "--head-dim", "8", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0 && has(p.out, "windowed: from ") &&
                      has(p.out, "page ceiling 8") && has(p.out, "memory check: exact"),
                  "text: exit %d: %s", p.status, p.out);
    pkvt_proc_free(&p);
}
END_TEST

/* A real model's pattern: gpt-oss alternates windowed (even) and full layers, with sink
 * logits; deepseek-v3 stores V rows narrower than K rows. Both reduced in width. */
START_TEST(stress_presets_pattern)
{
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"stress", "--model-preset", "gpt-oss-20b", "--layers", "4",
                                  "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
                                  "--ctx", "900", "--reps", "1", "--json", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0, "exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "config.window"), 128);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "config.windowed_layers"), 2);
    ck_assert(pkvt_json_is(p.out, "config.sink_logits", "true"));
    ck_assert(pkvt_json_is(p.out, "memory_check.exact", "true"));
    const uint64_t page = 2ull * 2 * 16 * 16 * 2;   /* f16 */
    const uint64_t want = 2 * ((900 + 15) / 16) + 2 * spec_window_pages(900, 16, 128, 0, 0);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "sessions[0].blocks"), want);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "sessions[0].bytes_resident"), want * page);
    pkvt_proc_free(&p);

    p = pkvt_tool((const char *[]){"stress", "--model-preset", "deepseek-v3", "--layers", "1",
                                  "--heads", "4", "--head-dim", "24", "--head-dim-v", "16",
                                  "--ctx", "300", "--reps", "1", "--json", "--quiet", NULL}, NULL);
    ck_assert_msg(p.status == 0, "exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "config.kv_heads"), 1);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "config.head_dim_v"), 16);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "engine.page_bytes"), 16ull * (24 + 16) * 2);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "sessions[0].bytes_ideal"), 300ull * (24 + 16) * 2);
    ck_assert(pkvt_json_is(p.out, "memory_check.exact", "true"));
    pkvt_proc_free(&p);
}
END_TEST

/* `pagedkv mem` of the variant presets, against figures computed here from the
 * models' public configs and docs/variants.md. */
START_TEST(mem_variants)
{
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"mem", "--model-preset", "gemma2-9b", "--ctx", "8192",
                                  "--json", NULL}, NULL);
    ck_assert_msg(p.status == 0 && pkvt_json_valid(p.out), "gemma: exit %d: %s", p.status, p.err);
    /* 42 layers, 21 windowed (4096 positions), 21 global (8192), 8 kv heads x 256, f16 */
    const uint64_t tok = 8ull * (256 + 256) * 2;
    ck_assert_uint_eq(pkvt_json_u64(p.out, "formula_bytes"), (21ull * 8192 + 21ull * 4096) * tok);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "dense_formula_bytes"), 42ull * 8192 * tok);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "page_bytes"), 2ull * 8 * 16 * 256 * 2);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "page_ceiling"), 4096 / 16 + 1);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "pages_per_windowed_layer"),
                      spec_window_pages(8192, 16, 4096, 0, 0));
    ck_assert_uint_eq(pkvt_json_u64(p.out, "paged_bytes"),
                      (21ull * 512 + 21 * spec_window_pages(8192, 16, 4096, 0, 0)) *
                          (2ull * 8 * 16 * 256 * 2));
    ck_assert_uint_eq(pkvt_json_num(p.out, "softcap"), 50);
    /* the probe engine took a few thousand positions, not ctx, and not zero */
    ck_assert_uint_gt(pkvt_json_u64(p.out, "probe_tokens"), 4096);
    ck_assert_uint_lt(pkvt_json_u64(p.out, "probe_tokens"), 8192);
    ck_assert_msg(has(pkvt_json_find(p.out, "formula_assumes"), "sinks + window + rollback"),
                  "%s", pkvt_json_find(p.out, "formula_assumes"));
    pkvt_proc_free(&p);

    /* gpt-oss at a length that is not a multiple of the page: 12 of 24 windowed */
    p = pkvt_tool((const char *[]){"mem", "--model-preset", "gpt-oss-20b", "--ctx", "100003",
                                  "--json", NULL}, NULL);
    ck_assert_msg(p.status == 0, "gpt-oss: exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "windowed_layers"), 12);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "pages_per_windowed_layer"),
                      spec_window_pages(100003, 16, 128, 0, 0));
    ck_assert_uint_eq(pkvt_json_u64(p.out, "page_ceiling"), 128 / 16 + 1);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "formula_bytes"),
                      (12ull * 100003 + 12ull * 128) * 8 * 128 * 2);
    pkvt_proc_free(&p);

    /* DeepSeek-V3 MLA: the latent is 576 values, pagedkv stores 576 + 512 */
    p = pkvt_tool((const char *[]){"mem", "--model-preset", "deepseek-v3", "--ctx", "4096",
                                  "--json", NULL}, NULL);
    ck_assert_msg(p.status == 0, "deepseek: exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "kv_heads"), 1);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "head_dim_v"), 512);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "page_bytes"), 16ull * (576 + 512) * 2);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "formula_bytes"), 61ull * 4096 * (576 + 512) * 2);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "mla.latent_bytes"), 61ull * 4096 * 576 * 2);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "mla.naive_bytes"),
                      61ull * 4096 * 128 * (128 + 64 + 128) * 2);
    ck_assert_msg(has(pkvt_json_find(p.out, "formula_assumes"), "latent"), "%s",
                  pkvt_json_find(p.out, "formula_assumes"));
    ck_assert_ptr_nonnull(pkvt_json_find(p.out, "page_ceiling"));
    ck_assert(strncmp(pkvt_json_find(p.out, "page_ceiling"), "null", 4) == 0);
    pkvt_proc_free(&p);

    /* --measure builds the whole windowed session: the engine agrees to the byte */
    p = pkvt_tool((const char *[]){"mem", "--layers", "3", "--kv-heads", "2", "--head-dim",
                                  "8", "--head-dim-v", "4", "--ctx", "1234", "--window",
                                  "50", "--sinks", "3", "--rollback", "9", "--block-tokens",
                                  "4", "--measure", "--json", NULL}, NULL);
    ck_assert_msg(p.status == 0, "measure: exit %d: %s", p.status, p.err);
    ck_assert(pkvt_json_is(p.out, "measured.matches", "true"));
    ck_assert_uint_eq(pkvt_json_u64(p.out, "measured.blocks"),
                      3 * spec_window_pages(1234, 4, 50, 3, 9));
    ck_assert_uint_eq(pkvt_json_u64(p.out, "measured.bytes_ideal"), 3ull * 62 * 2 * (8 + 4) * 2);
    pkvt_proc_free(&p);
}
END_TEST

/* Variant options: mistakes are usage errors naming the option. */
START_TEST(variant_usage)
{
    static const bad_args mem_rows[] = {
        {{"--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--ctx", "9", "--sinks", "4"},
         "--sinks needs --window"},
        {{"--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--ctx", "9", "--rollback",
          "4"}, "--rollback needs --window"},
        {{"--model-preset", "gemma2-9b", "--ctx", "9", "--head-dim-v", "5000"}, "4096"},
        {{"--model-preset", "gemma2-9b", "--ctx", "9", "--window", "-1"}, "--window"},
    };
    expect_usage_errors("mem", mem_rows, sizeof mem_rows / sizeof mem_rows[0]);
    static const bad_args stress_rows[] = {
        {{"--sinks", "4"}, "--sinks needs --window"},
        {{"--softcap", "-2"}, "--softcap"},
        {{"--softcap", "nan"}, "--softcap"},
        {{"--window", "x"}, "--window"},
        {{"--head-dim-v", "0"}, "--head-dim-v"},
    };
    expect_usage_errors("stress", stress_rows, sizeof stress_rows / sizeof stress_rows[0]);
    static const char *const cmds[] = {"mem", "stress"};
    for (int i = 0; i < 2; i++) {
        pkvt_proc p;
        p = pkvt_tool((const char *[]){cmds[i], "--help", NULL}, NULL);
        ck_assert_msg(p.status == 0 && has(p.out, "--window") && has(p.out, "--sinks") &&
                          has(p.out, "--rollback") && has(p.out, "--head-dim-v") &&
                          has(p.out, "gemma2-9b") && has(p.out, "gpt-oss-20b") &&
                          has(p.out, "deepseek-v3"),
                      "%s --help lacks the variant options: %s", cmds[i], p.out);
        pkvt_proc_free(&p);
    }
}
END_TEST

/* Q8/Q4 (docs/numerics.md, section 6) in every command that takes --dtype: mem sizes them by the
 * block format (row bytes, page bytes, bytes per token) and a real session agrees; stress's
 * memory check holds; generate's --check (against the reference on rows rounded as
 * the cache rounds them) and --check-e2e pass; soak runs. */
START_TEST(block_dtypes)
{
    static const uint32_t ds[] = {128, 100, 7};
    for (pkv_dtype dt = PKV_Q8; dt <= PKV_Q4; dt++)
        for (size_t i = 0; i < sizeof ds / sizeof ds[0]; i++) {
            char dstr[16];
            snprintf(dstr, sizeof dstr, "%u", ds[i]);
            pkvt_proc p = pkvt_tool((const char *[]){"mem", "--layers", "3", "--kv-heads", "2",
                                                    "--heads", "8", "--head-dim", dstr, "--ctx",
                                                    "1000", "--dtype", dtype_names[dt],
                                                    "--measure", "--json", NULL}, NULL);
            ck_assert_msg(p.status == 0, "mem --dtype %s: exit %d: %s", dtype_names[dt],
                          p.status, p.err);
            const uint64_t rb = row_bytes(dt, ds[i]);
            ck_assert_uint_eq(pkvt_json_u64(p.out, "row_bytes_k"), rb);
            ck_assert_uint_eq(pkvt_json_u64(p.out, "row_bytes_v"), rb);
            ck_assert_uint_eq(pkvt_json_u64(p.out, "bytes_per_token"), 3 * 2 * 2 * rb);
            ck_assert_uint_eq(pkvt_json_u64(p.out, "page_bytes"), 2 * 16 * 2 * rb);
            ck_assert_uint_eq(pkvt_json_u64(p.out, "formula_bytes"), 1000ull * 3 * 2 * 2 * rb);
            ck_assert_uint_eq(pkvt_json_u64(p.out, "paged_bytes"),
                              3ull * 63 * 2 * 16 * 2 * rb);
            ck_assert(pkvt_json_is(p.out, "measured.matches", "true"));
            ck_assert(fabs(pkvt_json_num(p.out, "bytes_per_value") - (double)rb / ds[i]) <
                      1e-5);
            pkvt_proc_free(&p);
        }
    pkvt_proc p = pkvt_tool((const char *[]){"mem", "--model-preset", "llama3-8b", "--ctx",
                                            "8192", "--dtype", "q8", NULL}, NULL);
    ck_assert_msg(p.status == 0 && has(p.out, "8.5 bits/value") &&
                      has(p.out, "69632 bytes (32 layers x 8 kv-heads x (K row 136"),
                  "mem text: %s %s", p.out, p.err);
    pkvt_proc_free(&p);
    for (pkv_dtype dt = PKV_Q8; dt <= PKV_Q4; dt++) {
        p = pkvt_tool((const char *[]){"stress", "--ctx", "300", "--heads", "4", "--kv-heads",
                                      "2", "--head-dim", "40", "--layers", "2", "--sessions",
                                      "2", "--dtype", dtype_names[dt], "--fork-every", "70",
                                      "--reps", "1", "--json", "--quiet", NULL}, NULL);
        ck_assert_msg(p.status == 0, "stress --dtype %s: exit %d: %s", dtype_names[dt],
                      p.status, p.err);
        ck_assert(pkvt_json_is(p.out, "memory_check.exact", "true"));
        ck_assert_uint_eq(pkvt_json_u64(p.out, "engine.page_bytes"),
                          2 * 16 * 2 * row_bytes(dt, 40));
        pkvt_proc_free(&p);
        p = pkvt_tool((const char *[]){"generate", "-n", "40", "--dtype", dtype_names[dt],
                                      "--check", "--check-e2e", "-t", "0", "--json", NULL},
                      NULL);
        ck_assert_msg(p.status == 0, "generate --dtype %s --check: exit %d: %s",
                      dtype_names[dt], p.status, p.err);
        ck_assert(pkvt_json_valid(p.out));
        pkvt_proc_free(&p);
        p = soak_run((const char *[]){"--dtype", dtype_names[dt], "--ops", "300",
                                      "--sessions", "40", NULL}, NULL);
        ck_assert_msg(p.status == 0, "soak --dtype %s: exit %d: %s", dtype_names[dt],
                      p.status, p.err);
        pkvt_proc_free(&p);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tools");
    TCase *tc = tcase_create("cli");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, checkers);
    tcase_add_test(tc, top_level);
    tcase_add_test(tc, stress_usage);
    tcase_add_test(tc, mem_usage);
    tcase_add_test(tc, mem_formula);
    tcase_add_test(tc, engine_memory_usage);
    tcase_add_test(tc, variant_usage);
    tcase_add_test(tc, mem_variants);
    suite_add_tcase(s, tc);
    TCase *tr = tcase_create("stress");
    tcase_set_timeout(tr, 120);
    tcase_add_test(tr, bench_json);
    tcase_add_test(tr, bench_progress);
    tcase_add_test(tr, block_dtypes);
    tcase_add_test(tr, stress_json_random);
    tcase_add_test(tr, stress_decode_every);
    tcase_add_test(tr, many_query_rows);
    tcase_add_test(tr, stress_spill);
    tcase_add_test(tr, stress_sigint);
    tcase_add_test(tr, memory_guard);
    tcase_add_test(tr, stress_window);
    tcase_add_test(tr, stress_shift);
    tcase_add_test(tr, stress_presets_pattern);
    suite_add_tcase(s, tr);
    return pkvt_run(s);
}

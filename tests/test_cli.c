/*
 * test_cli.c - the conventions every `pagedkv` command keeps, checked on the built
 * binary (env PKV_TOOL): one option syntax (getopt_long's), usage errors that name
 * the option and its valid range or the engine's limit (exit 2), --threads 0 as all
 * CPUs, `help CMD` = `CMD --help`, the version, the man page, one wording for an
 * option that needs another, the OS's reason for a file that cannot be opened, the
 * JSON envelope of every --json, and the output contracts of the tools
 * (docs/tools.md): mem's attention kind, inspect's status line, the memory guard
 * against MemAvailable, and bootstrap.sh refusing an unknown mode before any work.
 *
 * Owns: those checks. Does not own: the runs of test_tools.c (stress, bench, the
 * usage rows it had first), generate's (test_generate.c) or the plots (test_plots.c).
 */
#include "testutil.h"
#include "tools_run.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers -------------------------------------------------------------------- */

/* The last line of text (without its newline), in buf. */
static const char *last_line(const char *text, char *buf, size_t cap)
{
    size_t n = strlen(text);
    while (n > 0 && text[n - 1] == '\n')
        n--;
    size_t b = n;
    while (b > 0 && text[b - 1] != '\n')
        b--;
    snprintf(buf, cap, "%.*s", (int)(n - b), text + b);
    return buf;
}

static uint32_t online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1u : (uint32_t)n;
}

/* Each row: a command and its arguments (NULL-ended), a word the message must hold. */
typedef struct { const char *argv[12]; const char *says; } usage_row;

static void expect_usage(const usage_row *rows, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        pkvt_proc p;
        p = pkvt_tool(rows[i].argv, NULL);
        char shown[256] = "";
        for (size_t j = 0; rows[i].argv[j]; j++)
            snprintf(shown + strlen(shown), sizeof shown - strlen(shown), " %s",
                     rows[i].argv[j]);
        ck_assert_msg(p.status == 2, "pagedkv%s: exit %d, want 2 (stderr: %s)", shown,
                      p.status, p.err);
        ck_assert_msg(has(p.err, rows[i].says), "pagedkv%s: stderr lacks '%s': %s", shown,
                      rows[i].says, p.err);
        ck_assert_msg(has(p.err, "--help"), "pagedkv%s: no hint to --help: %s", shown,
                      p.err);
        ck_assert_msg(p.out[0] == 0, "pagedkv%s wrote to stdout: %s", shown, p.out);
        pkvt_proc_free(&p);
    }
}

/* ---- one option syntax ---------------------------------------------------------- */

/* The JSON after its envelope's "argv" list, which spells the command line as given:
 * what must not depend on how the options were written. */
static const char *after_argv(const char *json)
{
    const char *a = strstr(json, "\"argv\":");
    ck_assert_msg(a && strchr(a, ']'), "no argv list: %s", json);
    return strchr(a, ']') + 1;
}

/* --opt value, --opt=value, -n5 and -n 5 mean the same everywhere. */
START_TEST(option_forms)
{
    static const char *const forms[][12] = {
        {"mem", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--ctx", "8k",
         "--json", NULL},
        {"mem", "--layers=32", "--kv-heads=8", "--head-dim=128", "--ctx=8k", "--json", NULL},
        {"mem", "--json", "--ctx", "8192", "--head-dim=128", "--layers", "32",
         "--kv-heads=8", NULL},
    };
    char *first = NULL;
    for (size_t i = 0; i < 3; i++) {
        pkvt_proc p;
        p = pkvt_tool(forms[i], NULL);
        ck_assert_msg(p.status == 0, "mem form %zu: exit %d: %s", i, p.status, p.err);
        ck_assert_msg(pkvt_json_valid(p.out), "mem form %zu: not JSON: %s", i, p.out);
        ck_assert_uint_eq(pkvt_json_u64(p.out, "formula_bytes"), 1u << 30);
        if (!first)
            first = strdup(after_argv(p.out));
        else
            ck_assert_str_eq(after_argv(p.out), first);
        pkvt_proc_free(&p);
    }
    free(first);
    first = NULL;
    /* short options of generate, attached and apart, and their long names */
    static const char *const gen[][10] = {
        {"generate", "-n5", "-s7", "-t0.5", "-p0.8", NULL},
        {"generate", "-n", "5", "-s", "7", "-t", "0.5", "-p", "0.8", NULL},
        {"generate", "--steps=5", "--seed=7", "--temperature=0.5", "--top-p", "0.8", NULL},
    };
    for (size_t i = 0; i < 3; i++) {
        pkvt_proc p;
        p = pkvt_tool(gen[i], NULL);
        ck_assert_msg(p.status == 0, "generate form %zu: exit %d: %s", i, p.status, p.err);
        ck_assert_msg(p.out[0] != 0, "generate form %zu printed nothing", i);
        if (!first)
            first = strdup(p.out);
        else
            ck_assert_str_eq(p.out, first);
        pkvt_proc_free(&p);
    }
    free(first);
    /* a different seed gives other tokens: the forms above were really parsed */
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"generate", "-n5", "-s8", "-t0.5", "-p0.8", NULL}, NULL);
    ck_assert_int_eq(p.status, 0);
    pkvt_proc q;
    q = pkvt_tool((const char *[]){"generate", "-n5", "-s7", "-t0.5", "-p0.8", NULL}, NULL);
    ck_assert_msg(strcmp(p.out, q.out) != 0, "seeds 7 and 8 gave the same tokens: %s", p.out);
    pkvt_proc_free(&p);
    pkvt_proc_free(&q);
}
END_TEST

/* --help and -h on every command; the same words for the same mistakes. */
START_TEST(help_and_mistakes)
{
    static const char *const cmds[] = {"mem", "stress", "bench", "generate", "inspect",
                                       "quality"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        for (int h = 0; h < 2; h++) {
            pkvt_proc p;
            p = pkvt_tool((const char *[]){cmds[i], h ? "-h" : "--help", NULL}, NULL);
            char want[64];
            snprintf(want, sizeof want, "usage: pagedkv %s", cmds[i]);
            ck_assert_msg(p.status == 0 && has(p.out, want), "%s %s: exit %d, stdout %s",
                          cmds[i], h ? "-h" : "--help", p.status, p.out);
            pkvt_proc_free(&p);
        }
    static const usage_row rows[] = {
        {{"generate", "--json=1"}, "option '--json' takes no value"},
        {{"stress", "--quiet=yes"}, "option '--quiet' takes no value"},
        {{"generate", "-n"}, "option '-n' needs a value"},
        {{"stress", "--seed"}, "option '--seed' needs a value"},
        {{"generate", "-n0"}, "-n: '0' is not an integer in 1.."},
        {{"generate", "--steps=x"}, "--steps: 'x' is not an integer in 1.."},
        {{"generate", "-p", "1.5"}, "-p: '1.5' is not a number in 0..1"},
        {{"generate", "-q"}, "unknown option '-q'"},
        {{"stress", "--svg-lag"}, "unknown option '--svg-lag'"},
        /* getopt_long takes a unique prefix of a long name; one of several is refused */
        {{"stress", "--s", "1"}, "option '--s' is ambiguous"},
        {{"mem", "extra"}, "unexpected argument 'extra'"},
        {{"stress", "--sessions", "0"}, "--sessions: '0' is not an integer in 1..65536"},
        {{"bench", "--ctx", "4k,,8k"}, "--ctx: '4k,,8k' is not a comma-separated list"},
        {{"bench", "--dtype=f8"}, "--dtype: 'f8' is not a comma-separated list"},
        {{"stress", "--dtype", "f8"}, "--dtype: 'f8' is not f32, f16, bf16, q8 or q4"},
        {{"generate", "--dtype", "q5"}, "--dtype: 'q5' is not f32, f16, bf16, q8 or q4"},
        {{"quality", "--dtype", "q5"}, "--dtype: 'q5' is not a comma-separated list"},
        {{"mem", "--model-preset", "gpt-9"}, "'gpt-9' is not a preset: one of "},
    };
    expect_usage(rows, sizeof rows / sizeof rows[0]);
    /* the list in that message is the table's: every preset mem --help shows */
    pkvt_proc h, e;
    h = pkvt_tool((const char *[]){"mem", "--help", NULL}, NULL);
    e = pkvt_tool((const char *[]){"stress", "--model-preset", "gpt-9", NULL}, NULL);
    const char *t = strstr(h.out, "presets (layers/heads/kv-heads/head-dim):\n");
    ck_assert(t != NULL);
    size_t n = 0;
    char name[32];
    for (t = strchr(t, '\n') + 1; sscanf(t, " %31s %*u/%*u/%*u/%*u", name) == 1 &&
                                   strchr(t, '/') < strchr(t, '\n');
         t = strchr(t, '\n') + 1, n++)
        ck_assert_msg(has(e.err, name), "preset %s is not in the message: %s", name, e.err);
    ck_assert_uint_ge(n, 8);
    pkvt_proc_free(&h);
    pkvt_proc_free(&e);
}
END_TEST

/* `pagedkv help CMD` is `CMD --help`, byte for byte, for every command the top-level
 * help lists; version, -V and --version print one line; the man page (when this build
 * made one: PKV_MANPAGE) holds every command's help. */
START_TEST(help_version_man)
{
    pkvt_proc top = pkvt_tool((const char *[]){"help", NULL}, NULL);
    ck_assert_msg(top.status == 0 && has(top.out, "commands:"), "help: %s", top.err);
    const char *t = strstr(top.out, "commands:\n") + strlen("commands:\n");
    char cmd[32];
    size_t n = 0;
    char *man = getenv("PKV_MANPAGE") && *getenv("PKV_MANPAGE")
                    ? pkvt_slurp(getenv("PKV_MANPAGE"), NULL) : NULL;
    for (; sscanf(t, " %31s", cmd) == 1 && *t == ' '; t = strchr(t, '\n') + 1) {
        if (strcmp(cmd, "help") == 0 || strcmp(cmd, "version") == 0)
            continue;
        pkvt_proc a = pkvt_tool((const char *[]){"help", cmd, NULL}, NULL);
        pkvt_proc b = pkvt_tool((const char *[]){cmd, "--help", NULL}, NULL);
        ck_assert_msg(a.status == 0 && b.status == 0 && strcmp(a.out, b.out) == 0 &&
                          has(a.out, "usage: "),
                      "help %s (exit %d) and %s --help (exit %d) differ:\n%s\n---\n%s", cmd,
                      a.status, cmd, b.status, a.out, b.out);
        if (man) {
            char sh[64];
            snprintf(sh, sizeof sh, ".SH pagedkv %s\n", cmd);
            ck_assert_msg(has(man, sh), "the man page has no section %s", cmd);
            /* the help's second paragraph, verbatim (the usage line may carry roff) */
            char line[128];
            const char *para = strstr(a.out, "\n\n") + 2;
            snprintf(line, sizeof line, "%.*s", (int)strcspn(para, "\n"), para);
            ck_assert_msg(!strchr(line, '\\') && has(man, line),
                          "the man page lacks '%s' of %s --help", line, cmd);
        }
        pkvt_proc_free(&a);
        pkvt_proc_free(&b);
        n++;
    }
    ck_assert_uint_ge(n, 6);
    free(man);
    pkvt_proc_free(&top);
    char want[64];
    snprintf(want, sizeof want, "pagedkv %s\n", pkv_version());
    static const char *const v[] = {"version", "-V", "--version"};
    for (size_t i = 0; i < 3; i++) {
        pkvt_proc p = pkvt_tool((const char *[]){v[i], NULL}, NULL);
        ck_assert_msg(p.status == 0 && strcmp(p.out, want) == 0, "%s: exit %d, '%s'", v[i],
                      p.status, p.out);
        pkvt_proc_free(&p);
    }
    pkvt_proc p = pkvt_tool((const char *[]){"help", "frobnicate", NULL}, NULL);
    ck_assert_msg(p.status == 2 && has(p.err, "unknown command 'frobnicate'"), "%s", p.err);
    pkvt_proc_free(&p);
}
END_TEST

/* An option that needs another is refused the same way in every command, before any
 * work: "pagedkv CMD: --A needs --B: why", exit 2, nothing on stdout. */
START_TEST(needs_one_wording)
{
    static const usage_row rows[] = {
        {{"generate", "--prefix-cache"},
         "pagedkv generate: --prefix-cache needs --sessions"},
        {{"generate", "--sinks", "4"}, "pagedkv generate: --sinks needs --window"},
        {{"stress", "--ctx", "64", "--rollback", "2"},
         "pagedkv stress: --rollback needs --window"},
        {{"stress", "--ctx", "64", "--spill-dir", "/tmp"},
         "pagedkv stress: --spill-dir needs --budget"},
        {{"stress", "--ctx", "64", "--prefix-tail", "8"},
         "pagedkv stress: --prefix-tail needs --prefix"},
        {{"stress", "--ctx", "64", "--svg-logx"}, "pagedkv stress: --svg-logx needs --svg"},
        {{"stress", "--ctx", "64", "--exchange", "chain"},
         "pagedkv stress: --exchange needs --mpi"},
        {{"mem", "--model-preset", "mqa", "--ctx", "64", "--sinks", "4"},
         "pagedkv mem: --sinks needs --window"},
        {{"bench", "--spill-mib", "8"}, "pagedkv bench: --spill-mib needs --spill"},
        {{"quality", "--outliers", "2"}, "pagedkv quality: --outliers needs --synthetic"},
    };
    expect_usage(rows, sizeof rows / sizeof rows[0]);
}
END_TEST

/* A file the tools cannot open is named with the OS's reason (strerror), in every
 * command that opens one. */
START_TEST(os_reasons)
{
    const char *enoent = strerror(ENOENT);
    static const struct { const char *argv[10]; const char *says; } rows[] = {
        {{"generate", "--model", "/nonexistent/m.bin", NULL},
         "cannot open model '/nonexistent/m.bin': "},
        {{"generate", "--tokenizer", "/nonexistent/t.bin", NULL},
         "cannot open tokenizer '/nonexistent/t.bin': "},
        {{"quality", "--model", "/nonexistent/m.bin", NULL},
         "cannot open model '/nonexistent/m.bin': "},
        {{"quality", "--prompts", "/nonexistent/p.txt", NULL},
         "cannot open --prompts '/nonexistent/p.txt': "},
        {{"inspect", "/nonexistent/s.pkv", NULL}, "cannot open '/nonexistent/s.pkv': "},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        pkvt_proc p = pkvt_tool(rows[i].argv, NULL);
        char want[256];
        snprintf(want, sizeof want, "%s%s", rows[i].says, enoent);
        ck_assert_msg(p.status == 1 && has(p.err, want), "%s %s: exit %d, stderr %s",
                      rows[i].argv[0], rows[i].argv[1], p.status, p.err);
        pkvt_proc_free(&p);
    }
}
END_TEST

/* The long options named at the start of the lines of text (after blanks, and after
 * "-x, " where a short form comes first), or in the first cell of a markdown table's
 * rows ("| `-n N`, `--steps N` |"): into names, "--name" each, without repeats.
 * Returns how many. */
static size_t long_options(const char *text, bool table, char names[][32], size_t cap)
{
    size_t n = 0;
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        const char *end = strchr(l, '\n') ? strchr(l, '\n') : l + strlen(l);
        const char *p = l;
        if (table) {
            if (*p != '|')
                continue;
            end = strchr(p + 1, '|') && strchr(p + 1, '|') < end ? strchr(p + 1, '|') : end;
        } else {
            while (*p == ' ')
                p++;
            if (p - l < 2 || p - l > 4 || *p != '-')   /* an option line, not prose */
                continue;
            end = p + strcspn(p, " \n") + 1;
            if (p[1] != '-' && p[2] == ',') {   /* "-n, --steps" */
                p += 3;
                while (*p == ' ')
                    p++;
                end = p + strcspn(p, " \n");
            }
        }
        for (const char *q = p; (q = strstr(q, "--")) && q < end && n < cap; q += 2) {
            const size_t len = strspn(q + 2, "abcdefghijklmnopqrstuvwxyz-0123456789");
            if (len == 0 || q[2] < 'a' || q[2] > 'z')   /* a name starts with a letter */
                continue;
            snprintf(names[n], sizeof names[0], "--%.*s", (int)len, q + 2);
            bool dup = false;
            for (size_t i = 0; i < n && !dup; i++)
                dup = strcmp(names[i], names[n]) == 0;
            n += !dup;
            q += len;
        }
    }
    return n;
}

/* docs/generate.md's option table and `generate --help` name the same options. */
START_TEST(generate_doc_options)
{
    const char *src = getenv("PKV_SRCDIR");
    ck_assert_msg(src && *src, "PKV_SRCDIR is not set (run through meson test)");
    char path[4200];
    snprintf(path, sizeof path, "%s/docs/generate.md", src);
    char *doc = pkvt_slurp(path, NULL);
    char *tbl = strstr(doc, "## Options");
    ck_assert(tbl != NULL);
    char *stop = strstr(tbl + 3, "\n## ");
    if (stop)
        *stop = '\0';
    pkvt_proc h = pkvt_tool((const char *[]){"generate", "--help", NULL}, NULL);
    ck_assert_int_eq(h.status, 0);
    static char in_doc[64][32], in_help[64][32];
    const size_t nd = long_options(tbl, true, in_doc, 64);
    const size_t nh = long_options(h.out, false, in_help, 64);
    ck_assert_uint_ge(nh, 20);
    for (size_t i = 0; i < nh; i++) {
        bool found = false;
        for (size_t j = 0; j < nd && !found; j++)
            found = strcmp(in_help[i], in_doc[j]) == 0;
        ck_assert_msg(found, "generate --help has %s, docs/generate.md's table does not",
                      in_help[i]);
    }
    for (size_t j = 0; j < nd; j++) {
        bool found = false;
        for (size_t i = 0; i < nh && !found; i++)
            found = strcmp(in_help[i], in_doc[j]) == 0;
        ck_assert_msg(found, "docs/generate.md's table has %s, generate --help does not",
                      in_doc[j]);
    }
    pkvt_proc_free(&h);
    free(doc);
}
END_TEST

/* ---- the JSON envelope ---------------------------------------------------------- */

/* Keys no --json may use: each has one name across the commands (layers, heads,
 * kv_heads, threads, isa, vocab), as llama-bench keeps one set of names. */
static const char *const synonyms[] = {"\"n_layers\"", "\"n_heads\"", "\"n_kv_heads\"",
                                       "\"n_threads\"", "\"num_threads\"", "\"kernels\"",
                                       "\"vocab_size\"", "\"kv_dtype\"", "\"head_size\""};

/* Every --json document opens with the same fields, in this order: tool, command,
 * version, isa, host, cpu, online_cpus, argv (the command line as given). */
static void check_envelope(const char *const *args, const char *cmd)
{
    pkvt_proc p = pkvt_tool(args, NULL);
    char shown[512] = "";
    for (size_t i = 0; args[i]; i++)
        snprintf(shown + strlen(shown), sizeof shown - strlen(shown), " %s", args[i]);
    ck_assert_msg(p.status == 0 && pkvt_json_valid(p.out), "pagedkv%s: exit %d, stdout %s\n%s",
                  shown, p.status, p.out, p.err);
    static const char *const keys[] = {"tool", "command", "version", "isa", "host", "cpu",
                                       "online_cpus", "argv"};
    const char *at = p.out;
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        char k[32];
        snprintf(k, sizeof k, "\"%s\":", keys[i]);
        const char *f = strstr(p.out, k);
        ck_assert_msg(f && f >= at, "pagedkv%s: key %s missing or out of order: %s", shown,
                      keys[i], p.out);
        at = f;
    }
    ck_assert_msg(strncmp(p.out, "{\"tool\":", 8) == 0, "pagedkv%s: not first: %s", shown,
                  p.out);
    ck_assert(pkvt_json_is(p.out, "tool", "\"pagedkv\""));
    char want[64];
    snprintf(want, sizeof want, "\"%s\"", cmd);
    ck_assert_msg(pkvt_json_is(p.out, "command", want), "pagedkv%s: command: %s", shown,
                  p.out);
    snprintf(want, sizeof want, "\"%s\"", pkv_version());
    ck_assert(pkvt_json_is(p.out, "version", want));
    static const char *const isas[] = {"\"scalar\"", "\"avx2\"", "\"avx2vnni\"",
                                       "\"avx512\"", "\"avx512vnni\""};
    bool isa = false;
    for (size_t i = 0; i < 5; i++)
        isa = isa || pkvt_json_is(p.out, "isa", isas[i]);
    ck_assert_msg(isa, "pagedkv%s: isa: %s", shown, p.out);
    ck_assert(pkvt_json_u64(p.out, "online_cpus") == online_cpus());
    /* argv: the tool's path, then exactly the arguments given */
    size_t n = 0;
    while (args[n])
        n++;
    ck_assert_uint_eq(pkvt_json_len(p.out, "argv"), n + 1);
    for (size_t i = 0; i <= n; i++) {
        char k[32], v[600];
        snprintf(k, sizeof k, "argv[%zu]", i);
        snprintf(v, sizeof v, "\"%s\"", i ? args[i - 1] : "pagedkv"); /* pkvt_tool's */
        ck_assert_msg(pkvt_json_is(p.out, k, v), "pagedkv%s: %s is not %s", shown, k, v);
    }
    for (size_t i = 0; i < sizeof synonyms / sizeof synonyms[0]; i++)
        ck_assert_msg(!has(p.out, synonyms[i]), "pagedkv%s: key %s: %s", shown, synonyms[i],
                      p.out);
    pkvt_proc_free(&p);
}

START_TEST(json_envelope)
{
    char dir[] = "/tmp/pkvt-env-XXXXXX", file[600];
    ck_assert(mkdtemp(dir) != NULL);
    snprintf(file, sizeof file, "%s/s.pkv", dir);
    /* a session file for inspect, written through the library */
    pkv_engine *e = pkvt_engine(2, 4, 2, 8, 4, PKV_F16);
    pkv_session *s = pkvt_session(e);
    pkvt_rng r;
    pkvt_rng_init(&r, pkvt_seed());
    pkvt_append_random(s, &r, 0, 5, 1, 1);
    pkvt_append_random(s, &r, 1, 5, 1, 1);
    ck_assert_int_eq(pkv_session_save(s, file), PKV_OK);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    check_envelope((const char *[]){"generate", "-n", "4", "--json", NULL}, "generate");
    check_envelope((const char *[]){"stress", "--ctx", "64", "--heads", "2", "--kv-heads", "1",
                                    "--head-dim", "8", "--quiet", "--json", NULL}, "stress");
    check_envelope((const char *[]){"stress", "--prefix", "32", "--prefix-tail", "4",
                                    "--sessions", "2", "--heads", "2", "--kv-heads", "1",
                                    "--head-dim", "8", "--quiet", "--json", NULL}, "stress");
    check_envelope((const char *[]){"bench", "--json", "--model-preset", "mqa", "--ctx", "64",
                                    "--dtype", "f16", "--threads", "1", "--reps", "1",
                                    "--bw-mib", "1", "--prefill", "0", "--in-cache", "0",
                                    "--no-naive", "--no-scalar", NULL}, "bench");
    check_envelope((const char *[]){"bench", "--spill", "--json", "--spill-mib", "1", "--reps",
                                    "1", "--spill-dir", dir, NULL}, "bench");
    check_envelope((const char *[]){"mem", "--model-preset", "llama3-8b", "--ctx", "4k",
                                    "--json", NULL}, "mem");
    check_envelope((const char *[]){"inspect", "--json", file, NULL}, "inspect");
    check_envelope((const char *[]){"quality", "-n", "8", "--dtype", "f16", "--json", NULL},
                   "quality");
    check_envelope((const char *[]){"quality", "--synthetic", "--ctx", "16", "--dtype", "q8",
                                    "--json", NULL}, "quality");
    unlink(file);
    ck_assert(rmdir(dir) == 0);
}
END_TEST

/* Values beyond an engine limit are usage errors that name the limit, before any
 * engine is made: never "cannot create the engine" (exit 1). */
START_TEST(engine_limits)
{
    static const usage_row rows[] = {
        {{"stress", "--head-dim", "5000"}, "4096"},
        {{"stress", "--kv-heads", "70000", "--heads", "70000"}, "65536"},
        {{"stress", "--heads", "512", "--kv-heads", "1"}, "limit of 256"},
        {{"stress", "--threads", "100000"}, "0..1024"},
        {{"stress", "--block-tokens", "99999999"}, "limit of 1 GiB per page"},
        {{"mem", "--layers", "1", "--kv-heads", "8", "--head-dim", "5000", "--ctx", "1"},
         "--head-dim 5000 is beyond the engine's limit of 4096"},
        {{"mem", "--layers", "1", "--kv-heads", "8", "--head-dim", "128", "--ctx", "1",
          "--block-tokens", "99999999"}, "--block-tokens 99999999 makes one page"},
        {{"generate", "--threads", "100000"}, "0..1024"},
        {{"generate", "--block-tokens", "99999999"}, "limit of 1 GiB per page"},
        {{"bench", "--threads", "100000"}, "0..256"},
        {{"bench", "--block-tokens", "99999999"}, "limit of 1 GiB per page"},
        /* a Q8/Q4 page is sized by its rows' bytes, scales included */
        {{"mem", "--model-preset", "llama3-8b", "--ctx", "1", "--dtype", "q8",
          "--block-tokens", "999999"}, "136-byte K row + 136-byte V row"},
        {{"stress", "--dtype", "q4", "--block-tokens", "99999999"}, "limit of 1 GiB per page"},
        {{"bench", "--model-preset", "d256", "--block-tokens", "300000"}, "1 GiB"},
    };
    expect_usage(rows, sizeof rows / sizeof rows[0]);
}
END_TEST

/* --threads 0 is all online CPUs in every command. */
START_TEST(threads_zero)
{
    const uint32_t cpus = online_cpus();
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"bench", "--threads", "0", "--json", "--model-preset", "mqa",
                             "--ctx", "64", "--dtype", "f16", "--reps", "1", "--bw-mib", "1",
                             "--prefill", "0", "--no-naive", "--no-scalar", NULL}, NULL);
    ck_assert_msg(p.status == 0, "bench --threads 0: exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "decode[0].threads"), cpus > 256 ? 256 : cpus);
    pkvt_proc_free(&p);
    p = pkvt_tool((const char *[]){"generate", "--threads", "0", "-n", "4", "--json", NULL}, NULL);
    ck_assert_msg(p.status == 0, "generate --threads 0: exit %d: %s", p.status, p.err);
    ck_assert_msg(pkvt_json_u64(p.out, "cache.threads") == cpus, "generate --threads 0: %s",
                  p.out);
    pkvt_proc_free(&p);
    p = pkvt_tool((const char *[]){"stress", "--threads", "0", "--ctx", "64", "--heads", "2",
                             "--kv-heads", "1", "--head-dim", "8", "--quiet", "--json", NULL},
                  NULL);
    ck_assert_msg(p.status == 0, "stress --threads 0: exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "config.threads"), cpus);
    pkvt_proc_free(&p);
    /* and the soak's first check holds with it (tests/soak: the tools' conventions) */
    p = soak_run((const char *[]){"--threads", "0", "--ops", "200", "--sessions", "8",
                                  "--json", NULL}, NULL);
    ck_assert_msg(p.status == 0 && pkvt_json_is(p.out, "ok", "true"),
                  "soak --threads 0: exit %d: %s %s", p.status, p.out, p.err);
    pkvt_proc_free(&p);
}
END_TEST

/* ---- mem: MHA only when it is one ------------------------------------------------ */

START_TEST(mem_attention_kind)
{
    static const struct { const char *heads; const char *kv; const char *kind, *label; } rows[] = {
        {NULL, "8", NULL, "query heads not given"},
        {NULL, "1", NULL, "query heads not given"},
        {"8", "8", "MHA", "(MHA, 1 query per group)"},
        {"32", "8", "GQA", "(GQA, 4 queries per group)"},
        {"32", "1", "MQA", "(MQA, 32 queries per group)"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        for (int json = 0; json < 2; json++) {
            const char *argv[14] = {"mem", "--layers", "32", "--kv-heads", rows[i].kv,
                                    "--head-dim", "128", "--ctx", "8192"};
            size_t n = 9;
            if (rows[i].heads) {
                argv[n++] = "--heads";
                argv[n++] = rows[i].heads;
            }
            if (json)
                argv[n++] = "--json";
            pkvt_proc p;
            p = pkvt_tool(argv, NULL);
            ck_assert_msg(p.status == 0, "row %zu: exit %d: %s", i, p.status, p.err);
            if (!json) {
                ck_assert_msg(has(p.out, rows[i].label), "row %zu: no '%s' in %s", i,
                              rows[i].label, p.out);
                if (!rows[i].kind)
                    ck_assert_msg(!has(p.out, "(MHA") && !has(p.out, "this is MHA"),
                                  "row %zu: called MHA without --heads: %s", i, p.out);
            } else {
                const char *v = pkvt_json_find(p.out, "attention");
                char want[16];
                snprintf(want, sizeof want, "\"%s\"", rows[i].kind ? rows[i].kind : "");
                ck_assert_msg(v && (rows[i].kind ? strncmp(v, want, strlen(want)) == 0
                                                 : strncmp(v, "null", 4) == 0),
                              "row %zu: attention %s", i, v ? v : "(missing)");
            }
            pkvt_proc_free(&p);
        }
    }
    /* a preset knows its query heads */
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"mem", "--model-preset", "llama2-7b", "--ctx", "1k", NULL},
                  NULL);
    ck_assert_msg(p.status == 0 && has(p.out, "(MHA, 1 query per group)"), "preset: %s",
                  p.out);
    pkvt_proc_free(&p);
}
END_TEST

/* ---- inspect: a status line ends the report, also for a bad file ----------------- */

static void expect_status_line(const char *path, int want_exit, const char *want_line)
{
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"inspect", path, NULL}, NULL);
    char line[512];
    last_line(p.out, line, sizeof line);
    ck_assert_msg(p.status == want_exit, "inspect %s: exit %d, want %d (%s)", path, p.status,
                  want_exit, p.err);
    ck_assert_msg(strncmp(line, want_line, strlen(want_line)) == 0,
                  "inspect %s: last stdout line '%s', want '%s...'\nstdout: %s", path, line,
                  want_line, p.out);
    if (want_exit != 0)
        ck_assert_msg(p.err[0] != 0, "inspect %s: no reason on stderr", path);
    pkvt_proc_free(&p);
}

START_TEST(inspect_status_line)
{
    char dir[] = "/tmp/pkvt-inspect-XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    char good[600], bad[600], junk[600], cut[600];
    snprintf(good, sizeof good, "%s/good.pkv", dir);
    snprintf(bad, sizeof bad, "%s/bad.pkv", dir);
    snprintf(junk, sizeof junk, "%s/junk.pkv", dir);
    snprintf(cut, sizeof cut, "%s/cut.pkv", dir);
    pkv_engine *e = pkvt_engine(2, 4, 2, 8, 4, PKV_F32);
    pkv_session *s = NULL;
    ck_assert_int_eq(pkv_session_create(e, &s), PKV_OK);
    float kv[16];
    for (int i = 0; i < 16; i++)
        kv[i] = 0.25f * (float)i - 1.0f;
    for (uint32_t l = 0; l < 2; l++)
        for (int t = 0; t < 9; t++)
            ck_assert_int_eq(pkv_append(s, l, kv, kv), PKV_OK);
    ck_assert_int_eq(pkv_session_save(s, good), PKV_OK);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);

    expect_status_line(good, 0, "status      sound");
    char *b = pkvt_slurp(good, NULL);
    struct stat st;
    ck_assert(stat(good, &st) == 0);
    const size_t n = (size_t)st.st_size;
    b[n - 1] ^= 0x40;   /* padding of the last, partly filled page */
    pkvt_write_file(bad, b, n);
    expect_status_line(bad, 1, "status      damaged: ");
    pkvt_write_file(cut, b, n / 2);
    expect_status_line(cut, 1, "status      damaged: ");
    pkvt_write_file(junk, "this is not a session file, just text\n", 38);
    expect_status_line(junk, 1, "status      not a session file");
    free(b);
    /* the JSON form carries the same verdict */
    pkvt_proc p;
    p = pkvt_tool((const char *[]){"inspect", "--json", bad, NULL}, NULL);
    ck_assert_msg(p.status == 1 && pkvt_json_valid(p.out) && !pkvt_json_is(p.out, "sound", "true"),
                  "inspect --json of a damaged file: %d %s", p.status, p.out);
    pkvt_proc_free(&p);
    unlink(good), unlink(bad), unlink(junk), unlink(cut);
    ck_assert(rmdir(dir) == 0);
}
END_TEST

/* ---- the memory guard compares with MemAvailable -------------------------------- */

static uint64_t mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kib = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1)
            break;
    if (f)
        fclose(f);
    return kib * 1024u;
}

START_TEST(memory_guard_available)
{
    const uint64_t before = mem_available();
    if (before == 0) {
        printf("SKIP: memory_guard_available: no MemAvailable in /proc/meminfo\n");
        return;
    }
    static const char *const cmds[][6] = {
        {"bench", "--ctx", "1g", "--reps", "1", NULL},
        {"stress", "--ctx", "1g", NULL},
    };
    for (size_t i = 0; i < 2; i++) {
        pkvt_proc p;
        p = pkvt_tool(cmds[i], NULL);
        const uint64_t after = mem_available();
        ck_assert_msg(p.status == 2, "%s: exit %d", cmds[i][0], p.status);
        const char *at = strstr(p.err, "(MemAvailable) of the machine's physical memory, ");
        ck_assert_msg(at != NULL, "%s: the refusal names no MemAvailable: %s", cmds[i][0],
                      p.err);
        const uint64_t limit = strtoull(strchr(at, ',') + 2, NULL, 10);
        const uint64_t lo = (before < after ? before : after) - (64u << 20);
        const uint64_t hi = (before > after ? before : after) + (64u << 20);
        ck_assert_msg(limit >= lo && limit <= hi, "%s: limit %llu, MemAvailable %llu..%llu",
                      cmds[i][0], (unsigned long long)limit, (unsigned long long)before,
                      (unsigned long long)after);
        pkvt_proc_free(&p);
    }
}
END_TEST

/* ---- bootstrap.sh: an unknown mode is refused before any work ------------------- */

START_TEST(bootstrap_unknown_mode)
{
    const char *src = getenv("PKV_SRCDIR");
    ck_assert_msg(src && *src, "PKV_SRCDIR is not set (run through meson test)");
    char dir[] = "/tmp/pkvt-boot-XXXXXX", log[600], script[600], stub[600], path[1200];
    ck_assert(mkdtemp(dir) != NULL);
    snprintf(log, sizeof log, "%s/calls", dir);
    snprintf(script, sizeof script, "%s/tools/bootstrap.sh", src);
    /* every command the script could run records that it ran */
    static const char *const cmds[] = {"apt-get", "sudo", "dpkg-query", "meson", "ninja"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        snprintf(stub, sizeof stub, "%s/%s", dir, cmds[i]);
        FILE *f = fopen(stub, "w");
        ck_assert(f != NULL);
        fprintf(f, "#!/bin/sh\necho %s >> '%s'\nexit 0\n", cmds[i], log);
        ck_assert(fclose(f) == 0);
        ck_assert(chmod(stub, 0755) == 0);
    }
    snprintf(path, sizeof path, "%s:/usr/bin:/bin", dir);
    ck_assert(setenv("PATH", path, 1) == 0);   /* this test's own process (Check forks) */
    static const char *const modes[][2] = {{"frobnicate", NULL}, {"run", "extra"}};
    for (size_t m = 0; m < 2; m++) {
        pkvt_proc p;
        const char *argv[] = {"sh", script, modes[m][0], modes[m][1], NULL};
        p = pkvt_spawn("/bin/sh", argv, NULL);
        ck_assert_msg(p.status == 2 && has(p.err, "usage: tools/bootstrap.sh"),
                      "bootstrap %s: exit %d, stderr %s", modes[m][0], p.status, p.err);
        struct stat st;
        ck_assert_msg(stat(log, &st) != 0, "bootstrap %s ran commands first:\n%s",
                      modes[m][0], (char *)pkvt_slurp(log, NULL));
        pkvt_proc_free(&p);
    }
    /* the stubs are really on the path: a known mode runs them */
    pkvt_proc p;
    const char *argv[] = {"sh", script, "build", NULL};
    p = pkvt_spawn("/bin/sh", argv, NULL);
    struct stat st;
    ck_assert_msg(stat(log, &st) == 0, "bootstrap build ran none of the stubs: %d %s",
                  p.status, p.err);
    pkvt_proc_free(&p);
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        snprintf(stub, sizeof stub, "%s/%s", dir, cmds[i]);
        unlink(stub);
    }
    unlink(log);
    ck_assert(rmdir(dir) == 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("cli");
    TCase *tc = tcase_create("conventions");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, option_forms);
    tcase_add_test(tc, help_and_mistakes);
    tcase_add_test(tc, help_version_man);
    tcase_add_test(tc, needs_one_wording);
    tcase_add_test(tc, generate_doc_options);
    tcase_add_test(tc, engine_limits);
    tcase_add_test(tc, threads_zero);
    suite_add_tcase(s, tc);
    TCase *to = tcase_create("outputs");
    tcase_set_timeout(to, 120);
    tcase_add_test(to, mem_attention_kind);
    tcase_add_test(to, json_envelope);
    tcase_add_test(to, os_reasons);
    tcase_add_test(to, inspect_status_line);
    tcase_add_test(to, memory_guard_available);
    tcase_add_test(to, bootstrap_unknown_mode);
    suite_add_tcase(s, to);
    return pkvt_run(s);
}

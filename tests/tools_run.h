/*
 * tools_run.h - what the suites of the `pagedkv` command share (test_tools.c,
 * test_cli.c): running a program with its stdout and stderr captured, python3 for
 * cross-checks, and strict JSON and XML checkers (syntax, plus a path lookup for
 * JSON). Static inline so that each suite takes what it uses.
 *
 * The checkers are deliberately small and strict; test_tools.c's `checkers` test
 * proves they reject what they must.
 */
#ifndef PKV_TESTS_TOOLS_RUN_H
#define PKV_TESTS_TOOLS_RUN_H

#include "testutil.h"

#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* ---- running a program -------------------------------------------------------- */

typedef struct {
    pid_t pid;
    char out_path[64], err_path[64];
    int status;       /* exit code, or 128 + signal */
    char *out, *err;  /* NUL-terminated captures */
} proc;

static inline char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = pkvt_alloc(cap);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += got;
        if (cap - n < 2) {
            cap *= 2;
            buf = realloc(buf, cap);
            ck_assert(buf != NULL);
        }
    }
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* Start prog (searched in PATH when search is true) with stdout and stderr into
 * temporary files and stdin from /dev/null. */
static inline void proc_start(proc *p, const char *prog, bool search, char *const argv[])
{
    memset(p, 0, sizeof *p);
    snprintf(p->out_path, sizeof p->out_path, "/tmp/pkvt-out-XXXXXX");
    snprintf(p->err_path, sizeof p->err_path, "/tmp/pkvt-err-XXXXXX");
    int fo = mkstemp(p->out_path), fe = mkstemp(p->err_path);
    ck_assert_msg(fo >= 0 && fe >= 0, "mkstemp: %s", strerror(errno));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, fo, 1);
    posix_spawn_file_actions_adddup2(&fa, fe, 2);
    int rc = search ? posix_spawnp(&p->pid, prog, &fa, NULL, argv, environ)
                    : posix_spawn(&p->pid, prog, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fo);
    close(fe);
    ck_assert_msg(rc == 0, "cannot start %s: %s", prog, strerror(rc));
}

static inline void proc_wait(proc *p)
{
    int st;
    pid_t w;
    while ((w = waitpid(p->pid, &st, 0)) < 0 && errno == EINTR)
        ;
    ck_assert_msg(w == p->pid, "waitpid: %s", strerror(errno));
    p->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    p->out = slurp(p->out_path);
    p->err = slurp(p->err_path);
    unlink(p->out_path);
    unlink(p->err_path);
}

static inline void proc_free(proc *p)
{
    free(p->out);
    free(p->err);
}

static inline const char *tool(void)
{
    const char *t = getenv("PKV_TOOL");
    ck_assert_msg(t && *t, "PKV_TOOL is not set (run through meson test)");
    return t;
}

/* Run `pagedkv ARGS...` (NULL-terminated) to completion. */
static inline void run_tool(proc *p, const char *const *args)
{
    char *argv[64];
    size_t n = 0;
    argv[n++] = (char *)"pagedkv";
    for (; args[n - 1] && n < 63; n++)
        argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    proc_start(p, tool(), false, argv);
    proc_wait(p);
}

/* python3 for the cross-checks: the system's first (a version manager's shim in
 * PATH can take seconds per start), else PATH's; NULL when there is none. */
static inline const char *python(void)
{
    static int cached = -1;
    static const char *const cands[] = {"/usr/bin/python3", "python3"};
    static const char *found;
    for (size_t i = 0; cached < 0 && i < 2; i++) {
        if (i == 0 && access(cands[0], X_OK) != 0)
            continue;
        proc p;
        char *argv[] = {(char *)cands[i], (char *)"-c", (char *)"pass", NULL};
        proc_start(&p, cands[i], i == 1, argv);
        proc_wait(&p);
        if (p.status == 0) {
            found = cands[i];
            cached = 1;
        }
        proc_free(&p);
    }
    if (cached < 0)
        cached = 0;
    return found;
}

/* python3 -c script args...: exit status 0 means the script's checks held. */
static inline int python_check(const char *script, const char *a1, const char *a2, char **err)
{
    proc p;
    char *argv[] = {(char *)python(), (char *)"-c", (char *)script, (char *)a1, (char *)a2,
                    NULL};
    proc_start(&p, python(), false, argv);
    proc_wait(&p);
    *err = p.err;
    free(p.out);
    return p.status;
}

static inline void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert(f != NULL);
    fputs(text, f);
    ck_assert(fclose(f) == 0);
}

/* ---- a strict JSON syntax checker with a path lookup --------------------------- */

static inline const char *ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

static inline const char *json_value(const char *p, int depth);

static inline const char *json_string(const char *p)
{
    if (*p++ != '"')
        return NULL;
    for (; *p != '"'; p++) {
        if ((unsigned char)*p < 0x20)
            return NULL;
        if (*p == '\\') {
            p++;
            if (*p == 'u') {
                for (int i = 1; i <= 4; i++)
                    if (!strchr("0123456789abcdefABCDEF", p[i]) || !p[i])
                        return NULL;
                p += 4;
            } else if (!*p || !strchr("\"\\/bfnrt", *p)) {
                return NULL;
            }
        }
    }
    return p + 1;
}

static inline const char *json_number(const char *p)
{
    const char *s = p;
    if (*p == '-')
        p++;
    if (*p == '0')
        p++;
    else if (*p >= '1' && *p <= '9')
        while (*p >= '0' && *p <= '9')
            p++;
    else
        return NULL;
    if (*p == '.') {
        if (!(*++p >= '0' && *p <= '9'))
            return NULL;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-')
            p++;
        if (!(*p >= '0' && *p <= '9'))
            return NULL;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    return p > s ? p : NULL;
}

static inline const char *json_seq(const char *p, int depth, char close, bool object)
{
    p = ws(p + 1);
    if (*p == close)
        return p + 1;
    for (;;) {
        if (object) {
            if (!(p = json_string(p)))
                return NULL;
            p = ws(p);
            if (*p++ != ':')
                return NULL;
        }
        if (!(p = json_value(ws(p), depth + 1)))
            return NULL;
        p = ws(p);
        if (*p == close)
            return p + 1;
        if (*p++ != ',')
            return NULL;
        p = ws(p);
    }
}

static inline const char *json_value(const char *p, int depth)
{
    if (depth > 64)
        return NULL;
    switch (*p) {
    case '{': return json_seq(p, depth, '}', true);
    case '[': return json_seq(p, depth, ']', false);
    case '"': return json_string(p);
    case 't': return strncmp(p, "true", 4) == 0 ? p + 4 : NULL;
    case 'f': return strncmp(p, "false", 5) == 0 ? p + 5 : NULL;
    case 'n': return strncmp(p, "null", 4) == 0 ? p + 4 : NULL;
    default: return json_number(p);
    }
}

/* Exactly one JSON value, surrounded by white space only. */
static inline bool json_valid(const char *text)
{
    const char *e = json_value(ws(text), 0);
    return e && *ws(e) == 0;
}

/* The value at a dotted path ("decode.points.3.ctx": keys, or indexes in arrays) of
 * valid JSON; NULL when absent. Keys are compared raw (the tool writes plain ones). */
static inline const char *json_at(const char *p, const char *path)
{
    p = ws(p);
    if (!*path)
        return p;
    size_t seg = strcspn(path, ".");
    const char *rest = path[seg] ? path + seg + 1 : path + seg;
    if (*p == '{') {
        p = ws(p + 1);
        while (*p == '"') {
            const char *k = p + 1, *ke = json_string(p);
            bool match = (size_t)(ke - 1 - k) == seg && strncmp(k, path, seg) == 0;
            p = ws(ws(ke) + 1);  /* past ':' */
            if (match)
                return json_at(p, rest);
            p = ws(json_value(p, 0));
            if (*p == ',')
                p = ws(p + 1);
        }
        return NULL;
    }
    if (*p == '[') {
        long idx = strtol(path, NULL, 10);
        p = ws(p + 1);
        for (long i = 0; *p != ']'; i++) {
            if (i == idx)
                return json_at(p, rest);
            p = ws(json_value(p, 0));
            if (*p == ',')
                p = ws(p + 1);
        }
    }
    return NULL;
}

static inline uint64_t json_u64(const char *json, const char *path)
{
    const char *v = json_at(json, path);
    ck_assert_msg(v && *v >= '0' && *v <= '9', "JSON has no number at '%s'", path);
    return strtoull(v, NULL, 10);
}

static inline double json_dbl(const char *json, const char *path)
{
    const char *v = json_at(json, path);
    ck_assert_msg(v && json_number(v), "JSON has no number at '%s'", path);
    return strtod(v, NULL);
}

static inline size_t json_len(const char *json, const char *path)
{
    const char *v = json_at(json, path);
    ck_assert_msg(v && *v == '[', "JSON has no array at '%s'", path);
    char buf[160];
    size_t n = 0;
    for (;; n++) {
        snprintf(buf, sizeof buf, "%s.%zu", path, n);
        if (!json_at(json, buf))
            return n;
    }
}

static inline bool json_true(const char *json, const char *path)
{
    const char *v = json_at(json, path);
    return v && strncmp(v, "true", 4) == 0;
}

/* ---- a strict-enough XML well-formedness checker -------------------------------- */

static inline bool xml_name(const char **pp, char *name, size_t cap)
{
    const char *p = *pp;
    size_t n = 0;
    while (*p && (strchr(":_-.", *p) || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')
                  || (n && *p >= '0' && *p <= '9'))) {
        if (n + 1 < cap)
            name[n++] = *p;
        p++;
    }
    name[n] = 0;
    *pp = p;
    return n > 0;
}

static inline bool xml_chars(const char *p, const char *end)
{
    for (; p < end; p++) {
        if (*p == '<')
            return false;
        if (*p == '&') {
            static const char *const ents[] = {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"};
            bool ok = p[1] == '#';
            for (size_t i = 0; i < 5 && !ok; i++)
                ok = strncmp(p, ents[i], strlen(ents[i])) == 0;
            if (!ok || !memchr(p, ';', (size_t)(end - p)))
                return false;
        }
    }
    return true;
}

/* Balanced, properly nested tags with quoted attributes and valid entities; one root
 * element; returns the root's name in root. */
static inline bool xml_wellformed(const char *p, char *root, size_t cap)
{
    char stack[64][48];
    int depth = 0, roots = 0;
    if (strncmp(p, "<?xml", 5) == 0) {
        const char *e = strstr(p, "?>");
        if (!e)
            return false;
        p = e + 2;
    }
    while (*p) {
        const char *lt = strchr(p, '<');
        if (!lt)
            return depth == 0 && roots == 1 && xml_chars(p, p + strlen(p)) &&
                   strspn(p, " \n\t\r") == strlen(p);
        if (!xml_chars(p, lt) || (depth == 0 && strspn(p, " \n\t\r") < (size_t)(lt - p)))
            return false;
        p = lt + 1;
        if (strncmp(p, "!--", 3) == 0) {
            const char *e = strstr(p, "-->");
            if (!e)
                return false;
            p = e + 3;
            continue;
        }
        bool closing = *p == '/';
        char name[48];
        if (closing)
            p++;
        if (!xml_name(&p, name, sizeof name))
            return false;
        if (closing) {
            p = ws(p);
            if (*p++ != '>' || depth == 0 || strcmp(stack[--depth], name) != 0)
                return false;
            continue;
        }
        for (;;) {   /* attributes */
            const char *before = p;
            p = ws(p);
            if (*p == '>' || (p[0] == '/' && p[1] == '>'))
                break;
            char an[48];
            if (p == before || !xml_name(&p, an, sizeof an) || *p++ != '=' ||
                (*p != '"' && *p != '\''))
                return false;
            char q = *p++;
            const char *e = strchr(p, q);
            if (!e || !xml_chars(p, e))
                return false;
            p = e + 1;
        }
        if (depth == 0) {
            if (roots++)
                return false;
            snprintf(root, cap, "%s", name);
        }
        if (*p == '/') {
            p += 2;
            continue;
        }
        p++;
        if (depth == 64)
            return false;
        snprintf(stack[depth++], sizeof stack[0], "%s", name);
    }
    return depth == 0 && roots == 1;
}

/* ---- the top-level command -------------------------------------------------------- */

static inline bool has(const char *hay, const char *needle)
{
    return hay && strstr(hay, needle) != NULL;
}

#endif

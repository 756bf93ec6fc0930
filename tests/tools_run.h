/*
 * tools_run.h - what only the suites of the `pagedkv` command need (test_tools.c,
 * test_cli.c, test_plots.c, test_soak.c) beyond testutil.h: python3 cross-checks, a
 * strict XML well-formedness checker for the SVG plots, running the soak program
 * (PKV_SOAK), and a substring test. Running programs, reading files
 * and JSON are testutil's (pkvt_spawn, pkvt_tool, pkvt_slurp, pkvt_json_*).
 * Static inline so that each suite takes what it uses.
 *
 * The checker is deliberately small and strict; test_tools.c's `checkers` test
 * proves it rejects what it must.
 */
#ifndef PKV_TESTS_TOOLS_RUN_H
#define PKV_TESTS_TOOLS_RUN_H

#include "testutil.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- python3 for the cross-checks ----------------------------------------------- */

/* testutil's python3 if it really starts (a broken shim does not count); NULL when
 * there is none. */
static inline const char *python(void)
{
    static int cached = -1;
    static const char *found;
    if (cached < 0) {
        const char *py = pkvt_python_path();
        cached = 0;
        if (py) {
            const char *argv[] = {py, "-c", "pass", NULL};
            pkvt_proc p = pkvt_spawn(py, argv, NULL);
            if (p.status == 0) {
                found = py;
                cached = 1;
            }
            pkvt_proc_free(&p);
        }
    }
    return found;
}

/* python3 -c script args...: exit status 0 means the script's checks held. */
static inline int python_check(const char *script, const char *a1, const char *a2, char **err)
{
    const char *argv[] = {python(), "-c", script, a1, a2, NULL};
    pkvt_proc p = pkvt_spawn(python(), argv, NULL);
    *err = p.err;
    free(p.out);
    return p.status;
}

/* ---- a strict-enough XML well-formedness checker -------------------------------- */

static inline const char *ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

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

/* ---- the soak program (tests/soak, PKV_SOAK) ---------------------------------------- */

/* `$PKV_SOAK ARGS...` (NULL-terminated, without argv[0]) in the current environment
 * changed by env (as pkvt_spawn). */
static inline pkvt_proc soak_run(const char *const *args, const char *const *env)
{
    const char *soak = getenv("PKV_SOAK");
    ck_assert_msg(soak && *soak, "PKV_SOAK is not set (run through meson test)");
    const char *argv[64] = {"pagedkv-soak"};
    size_t n = 1;
    for (; args[n - 1] && n < 63; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    return pkvt_spawn(soak, argv, env);
}

/* ---- the top-level command -------------------------------------------------------- */

static inline bool has(const char *hay, const char *needle)
{
    return hay && strstr(hay, needle) != NULL;
}

#endif

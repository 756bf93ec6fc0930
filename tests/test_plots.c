/*
 * test_plots.c - the SVG plots of every `pagedkv` command that draws one (stress,
 * stress --prefix, quality, quality --synthetic), read back from the file the built
 * binary (PKV_TOOL) wrote.
 *
 * What must hold in every plot:
 *   - every title line (the page title, the note under it, each panel's title) fits
 *     the room it was given, and that room lies on the page: its width estimated here
 *     from glyph classes, independently of the writer's table (titles_fit);
 *   - a log axis is labelled at both of its ends (log_axes_label_ends);
 *   - one time unit, ms, on every latency or time axis of the stress family
 *     (one_time_unit);
 *   - the note names the threads, the kernels and the host, and "interrupted" when
 *     Ctrl-C stopped the run (what_ran_where, interrupted_note);
 *   - stress: the axes' scales, the data near the axes' ends, the budget line
 *     (stress_plot_axes);
 *   - quality --model names the model by its file's name, not its path ("model" case:
 *     needs stories260K, pkvt_model_dir()).
 */
#include "testutil.h"
#include "tools_run.h"

#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- reading an SVG --------------------------------------------------------------- */

/* The attribute `name="..."` of the tag at p, into buf; NULL if it has none. */
static const char *attr(const char *p, const char *name, char *buf, size_t cap)
{
    const char *end = strchr(p, '>');
    char pat[64];
    snprintf(pat, sizeof pat, " %s=\"", name);
    const char *a = strstr(p, pat);
    if (!a || (end && a > end))
        return NULL;
    a += strlen(pat);
    const char *q = strchr(a, '"');
    snprintf(buf, cap, "%.*s", (int)(q - a), a);
    return buf;
}

typedef struct {
    char xscale[16], yscale[16];
    double plot[4];                  /* left, top, right, bottom */
    double max_x, min_y;             /* rightmost and topmost data vertex, pixels */
    bool budget;                     /* a budget series is drawn */
} panel_info;

/* The panels of an SVG written by tools/common/svg.c: their scales, plot areas, and the
 * extreme data vertices (polylines and circles inside the plot area). */
static size_t read_panels(const char *svg, panel_info *out, size_t cap)
{
    size_t n = 0;
    const char *p = strstr(svg, "<g class=\"panel\"");
    while (p && n < cap) {
        const char *next = strstr(p + 1, "<g class=\"panel\"");
        const char *end = next ? next : p + strlen(p);
        panel_info *pi = &out[n++];
        memset(pi, 0, sizeof *pi);
        char buf[128];
        ck_assert(attr(p, "data-x-scale", pi->xscale, sizeof pi->xscale));
        ck_assert(attr(p, "data-y-scale", pi->yscale, sizeof pi->yscale));
        ck_assert(attr(p, "data-plot", buf, sizeof buf));
        ck_assert(sscanf(buf, "%lf %lf %lf %lf", &pi->plot[0], &pi->plot[1], &pi->plot[2],
                         &pi->plot[3]) == 4);
        pi->max_x = -INFINITY;
        pi->min_y = INFINITY;
        for (const char *q = p; (q = strstr(q, "points=\"")) && q < end;) {
            q += 8;
            double x, y;
            int used;
            while (*q != '"' && sscanf(q, "%lf,%lf%n", &x, &y, &used) == 2) {
                pi->max_x = fmax(pi->max_x, x);
                pi->min_y = fmin(pi->min_y, y);
                q += used;
                while (*q == ' ' || *q == '\n')
                    q++;
            }
        }
        for (const char *q = p; (q = strstr(q, "<circle cx=\"")) && q < end; q++) {
            double x, y;
            ck_assert(sscanf(q, "<circle cx=\"%lf\" cy=\"%lf\"", &x, &y) == 2);
            if (x > pi->plot[2] + 1)
                continue;   /* the legend */
            pi->max_x = fmax(pi->max_x, x);
            pi->min_y = fmin(pi->min_y, y);
        }
        const char *bud = strstr(p, "<title>budget");
        pi->budget = bud && bud < end;
        p = next;
    }
    return n;
}

static void stress_plot(bool logx, bool budget, panel_info pi[2])
{
    char svg[] = "/tmp/pkvt-plot-XXXXXX";
    int fd = mkstemp(svg);
    ck_assert(fd >= 0);
    close(fd);
    const char *argv[24] = {"stress", "--ctx", "3000", "--heads", "4", "--kv-heads", "2",
                            "--head-dim", "16", "--points", "20", "--quiet", "--json",
                            "--svg", svg};
    size_t n = 15;
    if (logx)
        argv[n++] = "--svg-logx";
    if (budget) {
        argv[n++] = "--budget";
        argv[n++] = "8m";
    }
    pkvt_proc p;
    p = pkvt_tool(argv, NULL);
    ck_assert_msg(p.status == 0, "stress: exit %d: %s", p.status, p.err);
    pkvt_proc_free(&p);
    char *text = pkvt_slurp(svg, NULL);
    ck_assert_uint_eq(read_panels(text, pi, 2), 2);
    free(text);
    unlink(svg);
}

START_TEST(stress_plot_axes)
{
    for (int logx = 0; logx < 2; logx++) {
        panel_info pi[2];
        stress_plot(logx, !logx, pi);
        for (int k = 0; k < 2; k++) {
            const char *scale = logx ? "log" : "linear";
            /* with a log context axis the y axes are log too: short contexts would
             * otherwise all sit on the bottom of a linear one */
            ck_assert_msg(strcmp(pi[k].xscale, scale) == 0 && strcmp(pi[k].yscale, scale) == 0,
                          "logx %d panel %d: scales %s/%s", logx, k, pi[k].xscale,
                          pi[k].yscale);
            /* the axes end near the data: within 6% of the plot's width and height */
            const double w = pi[k].plot[2] - pi[k].plot[0], h = pi[k].plot[3] - pi[k].plot[1];
            ck_assert_msg(pi[k].plot[2] - pi[k].max_x <= 0.06 * w,
                          "logx %d panel %d: rightmost point %.1f px, plot ends at %.1f",
                          logx, k, pi[k].max_x, pi[k].plot[2]);
            ck_assert_msg(pi[k].min_y - pi[k].plot[1] <= 0.06 * h,
                          "logx %d panel %d: topmost point %.1f px, plot starts at %.1f",
                          logx, k, pi[k].min_y, pi[k].plot[1]);
        }
        /* the budget is a line on the memory panel, and only there */
        ck_assert_msg(!pi[0].budget && pi[1].budget == !logx, "logx %d: budget %d/%d", logx,
                      pi[0].budget, pi[1].budget);
    }
}
END_TEST


/* A plot written by `pagedkv ARGS... --svg FILE` (FILE chosen here), read back; the
 * run's stdout and stderr are dropped. NUL-terminated, freed by the caller. */
static char *plot_of(const char *const *args)
{
    char svg[] = "/tmp/pkvt-plots-XXXXXX";
    int fd = mkstemp(svg);
    ck_assert(fd >= 0);
    close(fd);
    const char *argv[40];
    size_t n = 0;
    for (; args[n]; n++)
        argv[n] = args[n];
    argv[n++] = "--svg";
    argv[n++] = svg;
    argv[n] = NULL;
    pkvt_proc p = pkvt_tool(argv, NULL);
    ck_assert_msg(p.status == 0, "%s --svg: exit %d: %s", args[0], p.status, p.err);
    pkvt_proc_free(&p);
    char *text = pkvt_slurp(svg, NULL);
    unlink(svg);
    char root[48];
    ck_assert_msg(xml_wellformed(text, root, sizeof root), "not well-formed: %s", text);
    return text;
}

/* Width of one line of text at px, estimated from glyph classes of a sans-serif face
 * (lower-case and digits about 0.55 em, capitals 0.65, spaces and narrow punctuation
 * 0.3), bold a tenth wider: close to DejaVu Sans, and not the writer's own table. */
static double est_width(const char *s, size_t n, double px, bool bold)
{
    double em = 0;
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        if ((c & 0xc0) == 0x80)
            continue;   /* inside a UTF-8 character */
        if (c >= 'A' && c <= 'Z')
            em += 0.65;
        else if (strchr(" .,:;'()[]|/-!", c))
            em += 0.3;
        else
            em += 0.55;
    }
    return em * px * (bold ? 1.1 : 1.0);
}

/* Why the <text class="CLS" ...> line at p does not fit its data-room on the page
 * (centred at x, inside 0..1000), into why; NULL when it fits. */
static const char *line_misfit(const char *p, const char *cls, char *why, size_t cap)
{
    char buf[64];
    double room, x, px;
    ck_assert(attr(p, "data-room", buf, sizeof buf) && sscanf(buf, "%lf", &room) == 1);
    ck_assert(attr(p, "x", buf, sizeof buf) && sscanf(buf, "%lf", &x) == 1);
    ck_assert(attr(p, "font-size", buf, sizeof buf) && sscanf(buf, "%lf", &px) == 1);
    const bool bold = attr(p, "font-weight", buf, sizeof buf) != NULL;
    const char *t = strchr(p, '>') + 1, *e = strstr(t, "</text>");
    const double w = est_width(t, (size_t)(e - t), px, bold);
    if (w > room + 0.5)
        snprintf(why, cap, "a %s line of %.0f px in a room of %.0f: %.*s", cls, w, room,
                 (int)(e - t), t);
    else if (x - room / 2 < -0.5 || x + room / 2 > 1000.5)
        snprintf(why, cap, "the room of a %s line (%.0f px at x %.0f) leaves the page", cls,
                 room, x);
    else if (px < 8)
        snprintf(why, cap, "a %s line at %.1f px", cls, px);
    else
        return NULL;
    return why;
}

/* Every <text class="CLS" ...> line of svg fits (line_misfit). Returns how many lines
 * there were. */
static size_t check_lines(const char *svg, const char *cls, const char *what)
{
    char pat[64], why[1200];
    snprintf(pat, sizeof pat, "<text class=\"%s\"", cls);
    size_t n = 0;
    for (const char *p = strstr(svg, pat); p; p = strstr(p + 1, pat), n++)
        ck_assert_msg(!line_misfit(p, cls, why, sizeof why), "%s: %s", what, why);
    return n;
}

/* The check rejects what it must: a title wider than its room, a room off the page. */
START_TEST(checker)
{
    char why[1200];
    const char *wide = "<text class=\"title\" data-room=\"976\" x=\"500\" font-size=\"15\">"
                       "pagedkv stress: 1 session(s), 4 layer(s), h 16, g 8, d 256, f16, 16 "
                       "tokens/page; window 4096 on 21 of 42 layers (alternating), 0 sink "
                       "token(s), rollback 0, softcap 50</text>";
    ck_assert(line_misfit(wide, "title", why, sizeof why) != NULL);
    const char *off = "<text class=\"title\" data-room=\"976\" x=\"300\" font-size=\"15\">"
                      "short</text>";
    ck_assert(line_misfit(off, "title", why, sizeof why) != NULL);
    const char *ok = "<text class=\"title\" data-room=\"976\" x=\"500\" font-size=\"15\">"
                     "pagedkv stress: 1 session(s), 1 layer(s)</text>";
    ck_assert(line_misfit(ok, "title", why, sizeof why) == NULL);
}
END_TEST

/* ---- titles ------------------------------------------------------------------------- */

#define S(...) ((const char *const[]){__VA_ARGS__, NULL})

/* Long titles: a real model's preset with a window (the variant in the page title),
 * the prefix run's, quality's; every line fits, and the long ones wrapped instead of
 * running off the page. */
START_TEST(titles_fit)
{
    char *a = plot_of(S("stress", "--ctx", "600", "--model-preset", "gemma2-9b", "--layers",
                        "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--window",
                        "100", "--sinks", "4", "--rollback", "2", "--softcap", "30", "--points",
                        "8", "--quiet", "--svg-logx"));
    ck_assert_uint_ge(check_lines(a, "title", "stress"), 2);   /* wrapped */
    ck_assert_uint_ge(check_lines(a, "note", "stress"), 1);
    ck_assert_uint_ge(check_lines(a, "panel-title", "stress"), 2);
    ck_assert_msg(has(a, "softcap 30"), "the title's last words are lost");
    free(a);
    char *b = plot_of(S("stress", "--prefix", "64", "--prefix-tail", "8", "--sessions", "3",
                        "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--quiet"));
    ck_assert_uint_ge(check_lines(b, "title", "stress --prefix"), 1);
    ck_assert_uint_ge(check_lines(b, "panel-title", "stress --prefix"), 2);
    free(b);
    char *c = plot_of(S("quality", "-n", "12", "--dtype", "f16,q8"));
    ck_assert_uint_ge(check_lines(c, "panel-title", "quality"), 1);
    ck_assert_uint_ge(check_lines(c, "note", "quality"), 1);
    free(c);
    char *d = plot_of(S("quality", "--synthetic", "--ctx", "24", "--dtype", "q8,q4",
                        "--outliers", "2"));
    ck_assert_uint_ge(check_lines(d, "panel-title", "quality --synthetic"), 1);
    free(d);
}
END_TEST

/* ---- axes ------------------------------------------------------------------------------ */

/* In every log-scale panel of svg, the tick labels include both ends of each log axis:
 * a y label at the plot's top and bottom, an x label at its left and right. */
static void check_log_ends(const char *svg, const char *what)
{
    size_t logs = 0;
    for (const char *p = strstr(svg, "<g class=\"panel\""); p;
         p = strstr(p + 1, "<g class=\"panel\"")) {
        const char *next = strstr(p + 1, "<g class=\"panel\"");
        char xs[16], ys[16], buf[128];
        double L, T, R, B;
        ck_assert(attr(p, "data-x-scale", xs, sizeof xs) && attr(p, "data-y-scale", ys, sizeof ys));
        ck_assert(attr(p, "data-plot", buf, sizeof buf) &&
                  sscanf(buf, "%lf %lf %lf %lf", &L, &T, &R, &B) == 4);
        const char *ticks = strstr(p, "<g class=\"ticks\"");
        const char *tend = ticks ? strstr(ticks, "</g>") : NULL;
        ck_assert(ticks && tend && (!next || tend < next));
        bool top = false, bottom = false, left = false, right = false;
        for (const char *q = strstr(ticks, "<text "); q && q < tend; q = strstr(q + 1, "<text ")) {
            double x, y;
            ck_assert(attr(q, "x", buf, sizeof buf) && sscanf(buf, "%lf", &x) == 1);
            ck_assert(attr(q, "y", buf, sizeof buf) && sscanf(buf, "%lf", &y) == 1);
            const bool ylabel = has(q, "text-anchor=\"end\"") &&
                                strstr(q, "text-anchor=\"end\"") < strchr(q, '>');
            if (ylabel) {
                top = top || fabs(y - 4 - T) < 0.6;
                bottom = bottom || fabs(y - 4 - B) < 0.6;
            } else {
                left = left || fabs(x - L) < 0.6;
                right = right || fabs(x - R) < 0.6;
            }
        }
        if (strcmp(ys, "log") == 0) {
            logs++;
            ck_assert_msg(top && bottom, "%s: a log y axis without a label at %s", what,
                          top ? "its bottom" : "its top");
        }
        if (strcmp(xs, "log") == 0) {
            logs++;
            ck_assert_msg(left && right, "%s: a log x axis without a label at %s", what,
                          left ? "its right end" : "its left end");
        }
    }
    ck_assert_msg(logs > 0, "%s: no log axis", what);
}

START_TEST(log_axes_label_ends)
{
    char *a = plot_of(S("stress", "--ctx", "3000", "--heads", "4", "--kv-heads", "2",
                        "--head-dim", "16", "--points", "20", "--quiet", "--svg-logx"));
    check_log_ends(a, "stress --svg-logx");
    free(a);
    char *b = plot_of(S("quality", "-n", "12", "--dtype", "f16,bf16,q8,q4"));
    check_log_ends(b, "quality");
    free(b);
}
END_TEST

/* Every latency or time axis of the stress family is in ms, whatever the run's range. */
START_TEST(one_time_unit)
{
    const char *const *runs[] = {
        S("stress", "--ctx", "200", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
          "--points", "6", "--quiet"),
        S("stress", "--ctx", "20000", "--heads", "8", "--kv-heads", "8", "--head-dim", "128",
          "--points", "6", "--reps", "1", "--quiet", "--svg-logx"),
        S("stress", "--prefix", "64", "--prefix-tail", "8", "--sessions", "2", "--heads", "2",
          "--kv-heads", "1", "--head-dim", "8", "--quiet"),
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char *svg = plot_of(runs[i]);
        size_t axes = 0;
        for (const char *p = strstr(svg, "transform=\"rotate(-90"); p;
             p = strstr(p + 1, "transform=\"rotate(-90")) {
            const char *t = strchr(p, '>') + 1;
            const size_t n = (size_t)(strstr(t, "</text>") - t);
            char label[128];
            snprintf(label, sizeof label, "%.*s", (int)n, t);
            if (strstr(label, "latency") || strstr(label, "time")) {
                ck_assert_msg(strstr(label, "(ms)"), "run %zu: axis '%s' is not in ms", i,
                              label);
                axes++;
            }
        }
        ck_assert_msg(axes == 1, "run %zu: %zu time axes", i, axes);
        free(svg);
    }
}
END_TEST

/* ---- what ran where -------------------------------------------------------------- */

START_TEST(what_ran_where)
{
    char host[256] = "";
    ck_assert(gethostname(host, sizeof host - 1) == 0);
    char want[300];
    snprintf(want, sizeof want, "host %s", host);
    const char *const *runs[] = {
        S("stress", "--ctx", "100", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
          "--threads", "1", "--quiet"),
        S("stress", "--prefix", "64", "--prefix-tail", "8", "--sessions", "2", "--heads", "2",
          "--kv-heads", "1", "--head-dim", "8", "--threads", "1", "--quiet"),
        S("quality", "-n", "8", "--dtype", "f16", "--threads", "1"),
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char *svg = plot_of(runs[i]);
        const char *note = strstr(svg, "<text class=\"note\"");
        ck_assert_msg(note, "run %zu: no note", i);
        const char *end = strstr(note, "</g>");
        char text[1024];
        snprintf(text, sizeof text, "%.*s", (int)(end - note), note);
        ck_assert_msg(has(text, "1 thread(s)") && has(text, " kernels") && has(text, want) &&
                          !has(text, "interrupted"),
                      "run %zu: the note says %s", i, text);
        free(svg);
    }
}
END_TEST

/* Ctrl-C: stress stops, writes the plot of what it measured, and the plot says so. */
START_TEST(interrupted_note)
{
    char svg[] = "/tmp/pkvt-plots-XXXXXX";
    int fd = mkstemp(svg);
    ck_assert(fd >= 0);
    close(fd);
    const char *argv[] = {"pagedkv", "stress", "--ctx", "1g", "--heads", "2", "--kv-heads",
                          "1", "--head-dim", "4", "--points", "40", "--force", "--svg", svg,
                          NULL};
    pkvt_child c = pkvt_start(pkvt_tool_path(), argv, NULL);
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
    pkvt_proc_free(&p);
    char *text = pkvt_slurp(svg, NULL);
    unlink(svg);
    const char *note = strstr(text, "<text class=\"note\"");
    ck_assert_msg(note && has(note, "interrupted at "), "the plot does not say interrupted");
    ck_assert_uint_ge(check_lines(text, "note", "stress, interrupted"), 1);
    free(text);
}
END_TEST

/* ---- quality --model: the model by its name ---------------------------------------- */

START_TEST(quality_model_name)
{
    char model[4096], tok[4096];
    ck_assert_msg(pkvt_model_paths(model, tok, sizeof model), "no model in %s",
                  pkvt_model_dir());
    char *svg = plot_of(S("quality", "--model", model, "-n", "16", "--dtype", "q8"));
    ck_assert_msg(has(svg, "(stories260K.bin, "), "the title does not name the model");
    const char *slash = strrchr(model, '/');
    if (slash && slash > model) {   /* the directory is not in the plot */
        char dir[4096];
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - model), model);
        ck_assert_msg(!has(svg, dir), "the plot holds the model's directory %s", dir);
    }
    check_lines(svg, "panel-title", "quality --model");
    free(svg);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("plots");
    TCase *tc = tcase_create("plots");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, checker);
    tcase_add_test(tc, titles_fit);
    tcase_add_test(tc, log_axes_label_ends);
    tcase_add_test(tc, one_time_unit);
    tcase_add_test(tc, what_ran_where);
    tcase_add_test(tc, interrupted_note);
    tcase_add_test(tc, stress_plot_axes);
    suite_add_tcase(s, tc);
    TCase *tm = tcase_create("model");
    tcase_set_timeout(tm, 240);
    tcase_add_test(tm, quality_model_name);
    pkvt_add_tcase_needing(s, tm, "model", "model");
    return pkvt_run(s);
}

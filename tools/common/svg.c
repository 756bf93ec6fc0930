/*
 * svg.c - the chart writer of svg.h.
 *
 * Owns: the page layout (fixed pixel geometry below), axis ranges and ticks, tick
 * labels, the legend, XML escaping. Does not own the data or the FILE.
 *
 * Invariants
 *   - Every coordinate written is finite: non-finite points, and points <= 0 on a log
 *     axis, are skipped before mapping; an empty or degenerate range is widened.
 *   - Ticks lie inside the axis range, and the axis range holds every drawn point: a
 *     linear axis with a margin of AXIS_PAD of the axis at each end (none at a zero
 *     end), so that it ends near the data.
 *   - Each panel says how it was laid out, for programs reading the file:
 *     data-x-scale / data-y-scale ("linear" or "log") and data-x-range / data-y-range
 *     (the axis ends in data units), data-plot (the plot area: left, top, right,
 *     bottom in the panel's pixels).
 *   - All text goes through xml_text(), so a series name cannot break the document.
 *   - Every title line's estimated width (svg_text_width) is at most its room: wrapped
 *     at spaces, then set smaller (down to MIN_PX) until the longest line fits; a word
 *     longer than the room at MIN_PX is cut with an ellipsis.
 *   - A log axis ends on round values enclosing the data, and both ends are ticks
 *     with labels; a regular tick too close to an end to be read apart gives way.
 */
#include "common/svg.h"

#include <errno.h>
#include <math.h>
#include <string.h>

/* Page geometry in pixels: a plot area with room for tick labels on the left and
 * below, and the legend on the right, outside the data. */
enum {
    PAGE_W = 1000,
    PANEL_H = 410,
    PLOT_L = 92,
    PLOT_R = PAGE_W - 280,
    PLOT_T = 52,
    PLOT_B = PANEL_H - 62,
    MAX_TICKS = 24,
    MARGIN = 12,          /* left and right of a title line */
    MIN_PX = 8,           /* titles shrink no further */
    MAX_LINES = 8         /* lines of one title at most */
};

static const char *const palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                      "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};

/* One laid-out axis: the range drawn, the ticks, and the unit of its labels. */
typedef struct {
    const svg_axis *ax;
    double lo, hi;          /* axis range in data units (> 0 on a log axis) */
    double ticks[MAX_TICKS];
    size_t n_ticks;
    double step;            /* linear: distance between ticks in data units */
    double unit;            /* labels are written as value / unit */
    const char *unit_name;  /* suffix of labels: "GiB", "K", "" */
} axis_layout;

static void xml_text(FILE *f, const char *s)
{
    for (const char *p = s ? s : ""; *p; p++) {
        switch (*p) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&apos;", f); break;
        default:
            /* control characters are not allowed in XML 1.0 text */
            if ((unsigned char)*p >= 0x20 || *p == '\t' || *p == '\n')
                fputc(*p, f);
        }
    }
}

/* ---- text that fits ---------------------------------------------------------------- */

/* DejaVu Sans advance widths of ASCII 32..126, in 1/2048 em: the first font the document
 * names, and wider than Helvetica and Arial, so an estimate from it is an upper bound
 * for the usual fallbacks. */
static const unsigned short dejavu[95] = {
    651,  821,  942,  1716, 1303, 1946, 1597, 563,  799,  799,  1024, 1716, 651,  739,
    651,  690,  1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 1303, 690,  690,
    1716, 1716, 1716, 1087, 2048, 1401, 1405, 1430, 1577, 1294, 1178, 1587, 1540, 604,
    604,  1343, 1141, 1767, 1532, 1612, 1235, 1612, 1423, 1300, 1251, 1499, 1401, 2025,
    1403, 1251, 1403, 799,  690,  799,  1716, 1024, 1024, 1255, 1300, 1126, 1300, 1260,
    721,  1300, 1298, 569,  569,  1186, 569,  1995, 1298, 1253, 1300, 1300, 842,  1067,
    803,  1298, 1212, 1675, 1212, 1212, 1075, 1303, 690,  1303, 1716};

double svg_text_width(const char *s, double px, bool bold)
{
    double units = 0;
    for (const unsigned char *p = (const unsigned char *)s; p && *p; p++) {
        if (*p >= 32 && *p < 127)
            units += dejavu[*p - 32];
        else if ((*p & 0xc0) != 0x80)   /* the first byte of any other character */
            units += 2048;
    }
    /* DejaVu Sans Bold is up to 15% wider than the book face */
    return units / 2048.0 * px * (bold ? 1.15 : 1.0);
}

/* Text of one title, laid out: n lines at font size px. */
typedef struct {
    char line[MAX_LINES][512];
    size_t n;
    double px;
} fitted;

/* Wrap s at spaces into lines of at most `room` pixels at px. False when more than
 * MAX_LINES would be needed or a word alone is wider than the room (that word then
 * has a line of its own). */
static bool wrap(fitted *t, const char *s, double px, bool bold, double room)
{
    t->n = 0;
    t->px = px;
    bool ok = true;
    const char *p = s ? s : "";
    while (*p == ' ')
        p++;
    while (*p) {
        if (t->n == MAX_LINES)
            return false;
        char *l = t->line[t->n++];
        size_t len = 0;
        l[0] = '\0';
        /* whole words while they fit; the first word of a line always */
        while (*p) {
            const size_t w = strcspn(p, " ");
            if (len + 1 + w >= sizeof t->line[0])
                break;
            char probe[sizeof t->line[0]];
            snprintf(probe, sizeof probe, "%s%s%.*s", l, len ? " " : "", (int)w, p);
            if (len && svg_text_width(probe, px, bold) > room)
                break;
            ok = ok && svg_text_width(probe, px, bold) <= room;
            snprintf(l, sizeof t->line[0], "%s", probe);
            len = strlen(l);
            p += w;
            while (*p == ' ')
                p++;
        }
        if (!len) {   /* a word longer than a line's storage: its head */
            snprintf(l, sizeof t->line[0], "%.*s", (int)sizeof t->line[0] - 1, p);
            p += strlen(l);
            ok = false;
        }
    }
    return ok;
}

/* s laid out in `room` pixels: at px in at most max_lines lines if it can be, else
 * smaller, down to MIN_PX, in as many lines as it takes (MAX_LINES at most, the rest
 * dropped); a line still too wide is cut short with an ellipsis. */
static void fit(fitted *t, const char *s, double px, bool bold, double room, size_t max_lines)
{
    for (double size = px; size >= MIN_PX; size *= 0.92)
        if (wrap(t, s, size, bold, room) && t->n <= max_lines)
            return;
    if (wrap(t, s, MIN_PX, bold, room))
        return;
    for (size_t i = 0; i < t->n; i++) {
        char *l = t->line[i];
        size_t len = strlen(l);
        if (svg_text_width(l, MIN_PX, bold) <= room)
            continue;
        const double dots = svg_text_width("...", MIN_PX, bold);
        while (len > 0 && svg_text_width(l, MIN_PX, bold) + dots > room) {
            do   /* back to the start of a UTF-8 character */
                len--;
            while (len > 0 && ((unsigned char)l[len] & 0xc0) == 0x80);
            l[len] = '\0';
        }
        if (len + 4 > sizeof t->line[0])
            l[len = sizeof t->line[0] - 4] = '\0';
        strcat(l, "...");
    }
}

/* The lines of t, centred on x, the first baseline at y, line height lh. */
static void draw_fitted(FILE *f, const fitted *t, const char *cls, double x, double y,
                        double lh, double room, bool bold)
{
    for (size_t i = 0; i < t->n; i++) {
        fprintf(f, "<text class=\"%s\" data-room=\"%.0f\" x=\"%.1f\" y=\"%.1f\" "
                   "text-anchor=\"middle\" font-size=\"%.1f\"%s>",
                cls, room, x, y + (double)i * lh, t->px,
                bold ? " font-weight=\"bold\"" : "");
        xml_text(f, t->line[i]);
        fputs("</text>\n", f);
    }
}

/* ---- axes ------------------------------------------------------------------------------ */

/* Heckbert's "nice number": 1, 2, 5 or 10 times a power of ten near x. */
static double nice_num(double x, bool round_it)
{
    double e = floor(log10(x));
    double p = pow(10.0, e);
    double fr = x / p, nf;
    if (round_it)
        nf = fr < 1.5 ? 1 : fr < 3 ? 2 : fr < 7 ? 5 : 10;
    else
        nf = fr <= 1 ? 1 : fr <= 2 ? 2 : fr <= 5 ? 5 : 10;
    return nf * p;
}

/* Binary unit for a magnitude: the largest 1024^k (k <= 4) not above m. */
static void binary_unit(double m, bool bytes, double *unit, const char **name)
{
    static const char *const bnames[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    static const char *const cnames[] = {"", "K", "M", "G", "T"};
    int k = 0;
    double u = 1.0;
    while (k < 4 && m >= u * 1024.0) {
        u *= 1024.0;
        k++;
    }
    *unit = u;
    *name = bytes ? bnames[k] : cnames[k];
}

/* Margin beyond the data at each end of an axis, as a fraction of its length: the
 * axis ends near the data instead of at the next round number (which can leave up to
 * half a linear axis, or most of a decade, empty). */
#define AXIS_PAD 0.03

static void layout_linear(axis_layout *a, double lo, double hi)
{
    if (a->ax->from_zero) {
        lo = fmin(lo, 0.0);
        hi = fmax(hi, 0.0);
    }
    a->unit = 1.0;
    a->unit_name = "";
    if (a->ax->format != SVG_FMT_NUMBER)
        binary_unit(fmax(fabs(lo), fabs(hi)), a->ax->format == SVG_FMT_BYTES, &a->unit,
                    &a->unit_name);
    double l = lo / a->unit, h = hi / a->unit;
    if (!(h > l)) {
        double pad = l != 0.0 ? fabs(l) * 0.1 : 1.0;
        l -= pad;
        h += pad;
    }
    /* a zero end stays at zero; others get the margin */
    const double pad = (h - l) * AXIS_PAD;
    l = l == 0.0 ? 0.0 : l - pad;
    h = h == 0.0 ? 0.0 : h + pad;
    double step = nice_num(nice_num(h - l, false) / 5.0, true);
    if (a->ax->format != SVG_FMT_NUMBER && a->unit == 1.0)
        step = fmax(step, 1.0);   /* no fractions of a token or a byte */
    const double tlo = ceil(l / step - 1e-9) * step;
    a->n_ticks = 0;
    for (double t = tlo; t <= h + step * 1e-9 && a->n_ticks < MAX_TICKS; t += step)
        a->ticks[a->n_ticks++] = (fabs(t) < step * 1e-9 ? 0.0 : t) * a->unit;
    a->lo = l * a->unit;
    a->hi = h * a->unit;
    a->step = step * a->unit;
}

/* Ticks of a log axis over [lo, hi]: powers of base every k exponents, with 2x and 5x
 * between them when mid is set (base 10 over a decade or two). */
static void log_ticks(axis_layout *a, double base, int k, bool mid, double lo, double hi)
{
    a->n_ticks = 0;
    const double elo = floor(log(lo) / log(base)), ehi = ceil(log(hi) / log(base));
    for (double e = ceil(elo / k) * k; e <= ehi && a->n_ticks < MAX_TICKS; e += k) {
        const double v = pow(base, e), m[3] = {1, 2, 5};
        for (int i = 0; i < (mid ? 3 : 1) && a->n_ticks < MAX_TICKS; i++)
            if (v * m[i] >= lo * (1 - 1e-9) && v * m[i] <= hi * (1 + 1e-9))
                a->ticks[a->n_ticks++] = v * m[i];
    }
}

/* The end of a log axis at or below v (down) or at or above it: two significant
 * digits (base 10: 0.0033, 2100) or a quarter-step of a power of 2 (base 2: 1, 1.25,
 * 1.5 or 1.75 times 2^k: 3K, 1.75 MiB), so that the end is labelled with a short
 * number and sits within a factor 1.25 of the data. */
static double round_end(double v, double base, bool down)
{
    if (base == 2.0) {
        const double p = exp2(floor(log2(v))), m = v / p;   /* m in [1, 2) */
        const double q = down ? floor(m * 4 + 1e-9) : ceil(m * 4 - 1e-9);
        return q / 4 * p;
    }
    const double p = pow(10.0, floor(log10(v)) - 1), m = v / p;   /* m in [10, 100) */
    return (down ? floor(m + 1e-9) : ceil(m - 1e-9)) * p;
}

/* bars: bar series are drawn from the axis' lower end, so that end lies a factor 4
 * below the data, or the smallest bar would have no height. */
static void layout_log(axis_layout *a, double lo, double hi, bool bars)
{
    const double base = a->ax->format == SVG_FMT_NUMBER ? 10.0 : 2.0;
    /* the ends: short round values enclosing the data, both labelled */
    lo = round_end(bars ? lo / 4 : lo, base, true);
    hi = round_end(hi, base, false);
    if (!(hi > lo))
        hi = round_end(lo * 1.5, base, false);
    const double span = log(hi / lo) / log(base);
    static const int steps10[] = {1, 2, 3, 5, 10};
    static const int steps2[] = {1, 2, 5, 10, 20, 30};
    const int *st = base == 10.0 ? steps10 : steps2;
    size_t nst = base == 10.0 ? 5 : 6;
    int k = st[nst - 1];
    for (size_t i = 0; i < nst; i++)
        if (span / st[i] <= 8.0) {
            k = st[i];
            break;
        }
    log_ticks(a, base, k, base == 10.0 && span <= 2.0, lo, hi);
    /* both ends are ticks; a regular tick closer to an end than 1/20 of the axis
     * gives way, so that no two labels run into each other */
    const double near = log(hi / lo) / 20.0;
    size_t n = 0;
    double t[MAX_TICKS];
    t[n++] = lo;
    for (size_t i = 0; i < a->n_ticks && n < MAX_TICKS - 1; i++)
        if (log(a->ticks[i] / lo) > near && log(hi / a->ticks[i]) > near)
            t[n++] = a->ticks[i];
    t[n++] = hi;
    memcpy(a->ticks, t, n * sizeof *t);
    a->n_ticks = n;
    a->lo = lo;
    a->hi = hi;
    a->step = 0.0;
    a->unit = 1.0;
    a->unit_name = "";
}

static bool usable(const svg_axis *ax, double v)
{
    return isfinite(v) && (!ax->log || ax->categories || v > 0.0);
}

static void layout_axis(axis_layout *a, const svg_axis *ax, const svg_panel *p, bool is_x)
{
    if (ax->categories && ax->n_categories) {
        /* one slot per category, its tick in the middle */
        a->ax = ax;
        a->lo = -0.5;
        a->hi = (double)ax->n_categories - 0.5;
        a->n_ticks = 0;
        for (size_t i = 0; i < ax->n_categories && a->n_ticks < MAX_TICKS; i++)
            a->ticks[a->n_ticks++] = (double)i;
        a->step = 1.0;
        a->unit = 1.0;
        a->unit_name = "";
        return;
    }
    double lo = INFINITY, hi = -INFINITY;
    for (size_t s = 0; s < p->n_series; s++) {
        const svg_series *se = &p->series[s];
        for (size_t i = 0; i < se->n; i++) {
            double x = se->x[i], y = se->y[i];
            if (!usable(&p->x, x) || !usable(&p->y, y))
                continue;
            double v = is_x ? x : y;
            lo = fmin(lo, v);
            hi = fmax(hi, v);
        }
    }
    a->ax = ax;
    if (!(lo <= hi)) {  /* no point at all */
        lo = ax->log ? 1.0 : 0.0;
        hi = ax->log ? 10.0 : 1.0;
    }
    bool bars = false;
    for (size_t s = 0; s < p->n_series; s++)
        bars = bars || p->series[s].bars;
    if (ax->log)
        layout_log(a, lo, hi, bars && !is_x);
    else
        layout_linear(a, lo, hi);
}

/* Position of v along the axis as a fraction 0..1 of its length. */
static double frac(const axis_layout *a, double v)
{
    if (a->ax->log && !a->ax->categories)
        return (log(v) - log(a->lo)) / (log(a->hi) - log(a->lo));
    return (v - a->lo) / (a->hi - a->lo);
}

static double px_x(const axis_layout *a, double v)
{
    return PLOT_L + frac(a, v) * (PLOT_R - PLOT_L);
}

static double px_y(const axis_layout *a, double v)
{
    return PLOT_B - frac(a, v) * (PLOT_B - PLOT_T);
}

/* Four significant digits: enough for any tick, and no float noise such as
 * 0.30000000000000004 in a label. */
static void short_num(char *buf, size_t len, double v, const char *suffix)
{
    snprintf(buf, len, "%.4g%s", v, suffix);
}

static const char *tick_label(const axis_layout *a, double v, char *buf, size_t len)
{
    if (a->ax->categories) {
        const size_t i = (size_t)(v + 0.5);
        snprintf(buf, len, "%s", i < a->ax->n_categories ? a->ax->categories[i] : "");
        return buf;
    }
    if (v == 0.0) {
        snprintf(buf, len, "0");
        return buf;
    }
    double unit;
    const char *name;
    switch (a->ax->format) {
    case SVG_FMT_BYTES:
        if (a->ax->log)
            binary_unit(fabs(v), true, &unit, &name);
        else
            unit = a->unit, name = a->unit_name;
        snprintf(buf, len, "%.4g %s", v / unit, name);
        return buf;
    case SVG_FMT_COUNT:
        if (a->ax->log)
            binary_unit(fabs(v), false, &unit, &name);
        else
            unit = a->unit, name = a->unit_name;
        short_num(buf, len, v / unit, name);
        return buf;
    case SVG_FMT_NUMBER:
    default: {
        static const char *const si[] = {"", "k", "M", "G", "T"};
        int k = 0;
        double m = fabs(v);
        while (k < 4 && m >= 1e4) {
            m /= 1e3;
            k++;
        }
        short_num(buf, len, v / pow(1e3, k), si[k]);
        return buf;
    }
    }
}

static void draw_axes(FILE *f, const axis_layout *xa, const axis_layout *ya,
                      const svg_panel *p)
{
    char buf[48];
    fputs("<g class=\"grid\" stroke=\"#e3e3e3\" stroke-width=\"1\">\n", f);
    for (size_t i = 0; i < xa->n_ticks; i++) {
        double x = px_x(xa, xa->ticks[i]);
        fprintf(f, "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\"/>\n", x, PLOT_T, x,
                PLOT_B);
    }
    for (size_t i = 0; i < ya->n_ticks; i++) {
        double y = px_y(ya, ya->ticks[i]);
        fprintf(f, "<line x1=\"%d\" y1=\"%.2f\" x2=\"%d\" y2=\"%.2f\"/>\n", PLOT_L, y, PLOT_R,
                y);
    }
    fputs("</g>\n<g class=\"ticks\" fill=\"#333\">\n", f);
    for (size_t i = 0; i < xa->n_ticks; i++) {
        double x = px_x(xa, xa->ticks[i]);
        fprintf(f, "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"#333\"/>", x,
                PLOT_B, x, PLOT_B + 5);
        fprintf(f, "<text x=\"%.2f\" y=\"%d\" text-anchor=\"middle\">", x, PLOT_B + 19);
        xml_text(f, tick_label(xa, xa->ticks[i], buf, sizeof buf));
        fputs("</text>\n", f);
    }
    for (size_t i = 0; i < ya->n_ticks; i++) {
        double y = px_y(ya, ya->ticks[i]);
        fprintf(f, "<line x1=\"%d\" y1=\"%.2f\" x2=\"%d\" y2=\"%.2f\" stroke=\"#333\"/>",
                PLOT_L - 5, y, PLOT_L, y);
        fprintf(f, "<text x=\"%d\" y=\"%.2f\" text-anchor=\"end\">", PLOT_L - 8, y + 4);
        xml_text(f, tick_label(ya, ya->ticks[i], buf, sizeof buf));
        fputs("</text>\n", f);
    }
    fputs("</g>\n", f);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" "
               "stroke=\"#333\"/>\n",
            PLOT_L, PLOT_T, PLOT_R - PLOT_L, PLOT_B - PLOT_T);
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" font-size=\"13\">",
            (PLOT_L + PLOT_R) / 2, PLOT_B + 42);
    xml_text(f, p->x.label);
    fputs("</text>\n", f);
    int cy = (PLOT_T + PLOT_B) / 2;
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" font-size=\"13\" "
               "transform=\"rotate(-90 %d %d)\">",
            22, cy, 22, cy);
    xml_text(f, p->y.label);
    fputs("</text>\n", f);
    /* the title over the plot area, centred on it, in the page's width around it */
    const double cx = (PLOT_L + PLOT_R) / 2.0;
    const double room = 2 * fmin(cx, PAGE_W - cx) - 2 * MARGIN;
    static fitted t;   /* 4 KiB: not on the stack of every panel */
    fit(&t, p->title, 15, true, room, 2);
    const double lh = t.px * 1.2;
    draw_fitted(f, &t, "panel-title", cx, PLOT_T - 14 - lh * (double)(t.n - 1), lh, room,
                true);
}

/* Bars of series se, the bi-th of nb bar series: 80% of each slot (one x unit: a
 * category), split evenly; from the axis' lower end (log) or from 0 (linear). */
static void draw_bars(FILE *f, const svg_series *se, const char *color,
                      const axis_layout *xa, const axis_layout *ya, const svg_panel *p,
                      size_t panel_no, size_t bi, size_t nb)
{
    const double slot = (PLOT_R - PLOT_L) / (xa->hi - xa->lo) * 0.8; /* one x unit */
    const double w = slot / (double)(nb ? nb : 1);
    const double base = ya->ax->log ? PLOT_B
                                    : px_y(ya, fmin(fmax(0.0, ya->lo), ya->hi));
    fprintf(f, "<g fill=\"%s\" clip-path=\"url(#plot%zu)\">\n", color, panel_no);
    for (size_t i = 0; i < se->n; i++) {
        if (!usable(&p->x, se->x[i]) || !usable(&p->y, se->y[i]))
            continue;
        const double x = px_x(xa, se->x[i]) - slot / 2 + (double)bi * w;
        const double y = px_y(ya, se->y[i]);
        fprintf(f, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\"/>\n", x,
                fmin(y, base), w * 0.92, fabs(base - y));
    }
    fputs("</g>\n", f);
}

static void draw_series(FILE *f, const svg_series *se, const char *color,
                        const axis_layout *xa, const axis_layout *ya, const svg_panel *p,
                        size_t panel_no, size_t bi, size_t nb)
{
    fputs("<g class=\"series\"><title>", f);
    xml_text(f, se->name);
    fprintf(f, "</title>\n");
    if (se->bars) {
        draw_bars(f, se, color, xa, ya, p, panel_no, bi, nb);
        fputs("</g>\n", f);
        return;
    }
    if (se->line) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" "
                   "stroke-linejoin=\"round\"%s clip-path=\"url(#plot%zu)\" points=\"",
                color, se->dashed ? " stroke-dasharray=\"6 4\"" : "", panel_no);
        size_t k = 0;
        for (size_t i = 0; i < se->n; i++) {
            if (!usable(&p->x, se->x[i]) || !usable(&p->y, se->y[i]))
                continue;
            const char *sep = k == 0 ? "" : k % 8 == 0 ? "\n" : " ";
            k++;
            fprintf(f, "%s%.2f,%.2f", sep, px_x(xa, se->x[i]), px_y(ya, se->y[i]));
        }
        fputs("\"/>\n", f);
    }
    size_t drawn = 0;
    for (size_t i = 0; i < se->n; i++)
        drawn += usable(&p->x, se->x[i]) && usable(&p->y, se->y[i]);
    if (se->markers || drawn == 1) {   /* a line of one point would be invisible */
        fprintf(f, "<g fill=\"%s\" clip-path=\"url(#plot%zu)\">\n", color, panel_no);
        for (size_t i = 0; i < se->n; i++) {
            if (!usable(&p->x, se->x[i]) || !usable(&p->y, se->y[i]))
                continue;
            fprintf(f, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.6\"/>\n", px_x(xa, se->x[i]),
                    px_y(ya, se->y[i]));
        }
        fputs("</g>\n", f);
    }
    fputs("</g>\n", f);
}

static void draw_legend(FILE *f, const svg_panel *p, const char *const *colors)
{
    fputs("<g class=\"legend\">\n", f);
    for (size_t s = 0; s < p->n_series; s++) {
        const svg_series *se = &p->series[s];
        int y = PLOT_T + 12 + (int)s * 22;
        int x = PLOT_R + 16;
        if (se->line)
            fprintf(f, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" "
                       "stroke-width=\"2\"%s/>",
                    x, y, x + 26, y, colors[s], se->dashed ? " stroke-dasharray=\"6 4\"" : "");
        if (se->markers)
            fprintf(f, "<circle cx=\"%d\" cy=\"%d\" r=\"3\" fill=\"%s\"/>", x + 13, y,
                    colors[s]);
        if (se->bars)
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"26\" height=\"10\" fill=\"%s\"/>",
                    x, y - 5, colors[s]);
        fprintf(f, "<text x=\"%d\" y=\"%d\">", x + 34, y + 4);
        xml_text(f, se->name);
        fputs("</text>\n", f);
    }
    fputs("</g>\n", f);
}

int svg_write(FILE *f, const char *title, const char *note, const svg_panel *panels,
              size_t n_panels)
{
    if (!f || (!panels && n_panels))
        return -1;
    for (size_t i = 0; i < n_panels; i++) {
        if (panels[i].n_series && !panels[i].series)
            return -1;
        for (size_t s = 0; s < panels[i].n_series; s++)
            if (panels[i].series[s].n && (!panels[i].series[s].x || !panels[i].series[s].y))
                return -1;
    }
    /* the page title and the note under it, as many lines as they take */
    static fitted tt, nt;
    const double room = PAGE_W - 2 * MARGIN;
    fit(&tt, title, 15, false, room, 3);
    fit(&nt, note, 12, false, room, 3);
    const double tlh = tt.px * 1.25, nlh = nt.px * 1.3;
    const int title_h = (int)ceil(14 + tlh * (double)tt.n + nlh * (double)nt.n);
    int height = title_h + (int)n_panels * PANEL_H;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" font-family=\"DejaVu Sans, Helvetica, Arial, "
               "sans-serif\" font-size=\"12\">\n",
            PAGE_W, height, PAGE_W, height);
    fputs("<rect x=\"0\" y=\"0\" width=\"100%\" height=\"100%\" fill=\"white\"/>\n", f);
    draw_fitted(f, &tt, "title", PAGE_W / 2.0, 6 + tlh, tlh, room, false);
    fputs("<g fill=\"#555\">\n", f);
    draw_fitted(f, &nt, "note", PAGE_W / 2.0, 6 + tlh * (double)tt.n + nlh, nlh, room, false);
    fputs("</g>\n", f);
    size_t next_color = 0;
    for (size_t i = 0; i < n_panels; i++) {
        const svg_panel *p = &panels[i];
        axis_layout xa, ya;
        layout_axis(&xa, &p->x, p, true);
        layout_axis(&ya, &p->y, p, false);
        fprintf(f, "<g class=\"panel\" transform=\"translate(0 %d)\" data-x-scale=\"%s\" "
                   "data-y-scale=\"%s\" data-x-range=\"%.6g %.6g\" "
                   "data-y-range=\"%.6g %.6g\" data-plot=\"%d %d %d %d\">\n",
                title_h + (int)i * PANEL_H, p->x.log ? "log" : "linear",
                p->y.log ? "log" : "linear", xa.lo, xa.hi, ya.lo, ya.hi, PLOT_L, PLOT_T,
                PLOT_R, PLOT_B);
        fprintf(f, "<defs><clipPath id=\"plot%zu\"><rect x=\"%d\" y=\"%d\" width=\"%d\" "
                   "height=\"%d\"/></clipPath></defs>\n",
                i, PLOT_L - 4, PLOT_T - 4, PLOT_R - PLOT_L + 8, PLOT_B - PLOT_T + 8);
        draw_axes(f, &xa, &ya, p);
        const char *colors[16];
        size_t ns = p->n_series < 16 ? p->n_series : 16, nb = 0, bi = 0;
        for (size_t s = 0; s < ns; s++)
            nb += p->series[s].bars;
        for (size_t s = 0; s < ns; s++) {
            const svg_series *se = &p->series[s];
            colors[s] = se->color ? se->color
                                  : palette[next_color++ % (sizeof palette / sizeof *palette)];
            draw_series(f, se, colors[s], &xa, &ya, p, i, bi, nb);
            bi += se->bars;
        }
        svg_panel shown = *p;
        shown.n_series = ns;
        draw_legend(f, &shown, colors);
        fputs("</g>\n", f);
    }
    fputs("</svg>\n", f);
    return ferror(f) ? -1 : 0;
}

int svg_write_file(const char *path, const char *title, const char *note,
                   const svg_panel *panels, size_t n_panels)
{
    if (!path)
        return -1;
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    int rc = svg_write(f, title, note, panels, n_panels);
    int err = rc ? errno : 0;   /* the first failure's reason, for the caller's message */
    if (fclose(f) != 0 && !rc) {
        rc = -1;
        err = errno;
    }
    errno = err ? err : errno;
    return rc;
}

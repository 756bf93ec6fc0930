/*
 * svg.h - a small chart writer for the `pagedkv` tools: line/marker charts and grouped
 * bar charts with axes, "nice" ticks, labels with units and a legend, written as one
 * standalone SVG file with one or more panels stacked vertically.
 *
 * Owns: layout, tick choice, tick label formatting, XML escaping, the SVG text.
 * Does not own: the data (series arrays are borrowed for the duration of the call)
 * or the file (svg_write writes to a caller's FILE; svg_write_file opens, writes and
 * closes a path).
 *
 * Every series of a panel is drawn as <g class="series"><title>NAME</title>...</g>,
 * so a program (or a test) can find the series in the file by name.
 *
 * Text fits its room: the page title, the note under it and each panel's title are
 * wrapped at spaces to the width they have (the page, the plot area), and set smaller
 * where a line would still not fit. The width of a line is estimated from DejaVu
 * Sans's advance widths (the first font the document asks for, and wider than the
 * others it names), so a line that fits by the estimate fits on the page. Each such
 * line is a <text class="title|note|panel-title" data-room="PX"> whose room is the
 * width it had to fit in.
 */
#ifndef PKV_SVG_H
#define PKV_SVG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

/* How tick labels of an axis are written. */
typedef enum {
    SVG_FMT_NUMBER = 0, /* decimal, SI suffix for large values: 250k, 1.5M */
    SVG_FMT_BYTES,      /* one binary unit per axis: 0, 1, 2 GiB */
    SVG_FMT_COUNT       /* binary suffixes: 512, 1K, 256K, 1M (K = 1024) */
} svg_format;

typedef struct {
    const char *label;  /* axis title with its unit, e.g. "context length (tokens)" */
    bool log;           /* logarithmic axis; points with a value <= 0 are not drawn.
                           Its ends are round values (powers of 2 for bytes and
                           counts, 1-2-5 steps for numbers) enclosing the data, each
                           labelled */
    svg_format format;
    bool from_zero;     /* linear axis: include 0 in the range */
    /* A categorical x axis (bar charts): x value i stands for categories[i], drawn at
     * evenly spaced slots and labelled with the name; NULL: a numeric axis. */
    const char *const *categories;
    size_t n_categories;
} svg_axis;

typedef struct {
    const char *name;      /* legend text */
    const double *x, *y;   /* n points, drawn in the given order */
    size_t n;
    const char *color;     /* "#rrggbb"; NULL = the next colour of the palette */
    bool line;             /* connect the points */
    bool markers;          /* draw a dot at each point */
    bool dashed;
    bool bars;             /* a bar from the axis to each point; the bar series of a
                              panel stand side by side in each category slot */
} svg_series;

typedef struct {
    const char *title;
    svg_axis x, y;
    const svg_series *series;
    size_t n_series;
} svg_panel;

/* Write a complete SVG document: `title` on top, `note` (NULL: none) in smaller type
 * under it (what ran where: threads, kernels, host; "interrupted"), then the panels.
 * Non-finite points are skipped. Returns 0, or -1 on bad arguments or a write error. */
int svg_write(FILE *f, const char *title, const char *note, const svg_panel *panels,
              size_t n_panels);
/* svg_write to a new file at path (truncated); -1 if it cannot be written, with errno
 * saying why (for the caller's strerror). */
int svg_write_file(const char *path, const char *title, const char *note,
                   const svg_panel *panels, size_t n_panels);
/* The estimated width in pixels of UTF-8 text s at font size px (bold: the bold face),
 * as the layout uses it. */
double svg_text_width(const char *s, double px, bool bold);

#endif

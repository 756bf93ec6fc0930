/*
 * json.c - the writer of json.h.
 *
 * Owns: the separators and the text of each value. Does not own the stream or the
 * document's shape (see json.h). Invariant: w->first is true only between an open
 * bracket and the first field after it (or before the document's top value).
 */
#include "json.h"

#include <math.h>

#include "cli.h"

void json_key(json_writer *w, const char *key)
{
    if (!w->first)
        fputc(',', w->f);
    w->first = false;
    if (key)
        fprintf(w->f, "\"%s\":", key);
}

void json_open(json_writer *w, const char *key, char c)
{
    json_key(w, key);
    fputc(c, w->f);
    w->first = true;
}

void json_close(json_writer *w, char c)
{
    fputc(c, w->f);
    w->first = false;
}

void json_num(json_writer *w, const char *key, double v)
{
    json_key(w, key);
    if (isfinite(v))
        fprintf(w->f, "%.6g", v);
    else
        fputs("null", w->f);
}

void json_str(json_writer *w, const char *key, const char *v)
{
    json_key(w, key);
    if (v)
        cli_json_str(w->f, v);
    else
        fputs("null", w->f);
}

void json_nums(json_writer *w, const json_num_field *f, size_t n)
{
    for (size_t i = 0; i < n; i++)
        json_num(w, f[i].k, f[i].v);
}

void json_u64s(json_writer *w, const json_u64_field *f, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        json_key(w, f[i].k);
        fprintf(w->f, "%llu", (unsigned long long)f[i].v);
    }
}

/*
 * json.c - the writer of json.h.
 *
 * Owns: the separators and the text of each value. Does not own the stream or the
 * document's shape (see json.h). Invariant: w->first is true only between an open
 * bracket and the first field after it (or before the document's top value).
 */
#include "json.h"

#include <math.h>
#include <string.h>

/* The bytes of a string literal, without the quotes. */
static void escape_bytes(FILE *f, const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const unsigned char ch = (unsigned char)p[i];
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", f);
        else if (ch < 0x20 || ch == 0x7f)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
}

void json_escape(FILE *f, const char *p, size_t n)
{
    fputc('"', f);
    escape_bytes(f, p, n);
    fputc('"', f);
}

void json_key(json_writer *w, const char *key)
{
    if (!w->first)
        fputs(w->spaced ? ", " : ",", w->f);
    w->first = false;
    if (key) {
        json_escape(w->f, key, strlen(key));
        fputs(w->spaced ? ": " : ":", w->f);
    }
}

void json_bool(json_writer *w, const char *key, bool v)
{
    json_key(w, key);
    fputs(v ? "true" : "false", w->f);
}

void json_u64(json_writer *w, const char *key, uint64_t v)
{
    json_key(w, key);
    fprintf(w->f, "%llu", (unsigned long long)v);
}

void json_fmt(json_writer *w, const char *key, const char *fmt, double v)
{
    json_key(w, key);
    if (isfinite(v))
        fprintf(w->f, fmt, v);
    else
        fputs("null", w->f);
}

void json_str_begin(json_writer *w, const char *key)
{
    json_key(w, key);
    fputc('"', w->f);
}

void json_str_part(json_writer *w, const char *p, size_t n)
{
    escape_bytes(w->f, p, n);
}

void json_str_end(json_writer *w)
{
    fputc('"', w->f);
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
        json_escape(w->f, v, strlen(v));
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
    for (size_t i = 0; i < n; i++)
        json_u64(w, f[i].k, f[i].v);
}

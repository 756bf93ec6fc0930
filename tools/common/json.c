/*
 * json.c - the writer of json.h.
 *
 * Owns: the separators and the text of each value. Does not own the stream or the
 * document's shape (see json.h). Invariant: w->first is true only between an open
 * bracket and the first field after it (or before the document's top value).
 */
#include "common/json.h"

#include <math.h>
#include <string.h>

/* Length of the valid UTF-8 sequence at p[0..n) (p[0] >= 0x80), or 0 when it is not
 * one: overlong forms, surrogates and code points past U+10FFFF are not (RFC 3629). */
static size_t utf8_len(const unsigned char *p, size_t n)
{
    size_t len;
    uint32_t cp, min;
    if (p[0] >= 0xc2 && p[0] <= 0xdf)
        len = 2, cp = p[0] & 0x1fu, min = 0x80;
    else if (p[0] >= 0xe0 && p[0] <= 0xef)
        len = 3, cp = p[0] & 0x0fu, min = 0x800;
    else if (p[0] >= 0xf0 && p[0] <= 0xf4)
        len = 4, cp = p[0] & 0x07u, min = 0x10000;
    else
        return 0;
    if (len > n)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xc0) != 0x80)
            return 0;
        cp = cp << 6 | (p[i] & 0x3fu);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return len;
}

/* The bytes of a string literal, without the quotes. JSON text is Unicode: a byte
 * that starts no valid UTF-8 sequence is written as U+FFFD, so the document stays
 * valid whatever bytes (a model's sampled tokens) come in. */
static void escape_bytes(FILE *f, const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        const unsigned char ch = p[i];
        size_t len = 1;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", f);
        else if (ch < 0x20 || ch == 0x7f)
            fprintf(f, "\\u%04x", ch);
        else if (ch < 0x80)
            fputc(ch, f);
        else if ((len = utf8_len(p + i, n - i)) > 0)
            fwrite(p + i, 1, len, f);
        else
            fputs("\\ufffd", f), len = 1;
        i += len;
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

/*
 * json.h - the JSON writer of every `pagedkv` command: compact (`,` and `:`) or
 * spaced (`, ` and `: `) output, one line, whose commas the writer places itself.
 *
 * Owns: the separators and the form of each value: numbers as %.6g (null when not
 *   finite) or the caller's printf format (json_fmt), integers exact (no double on
 *   the way), strings and byte runs escaped one way (json_escape: '"' and '\'
 *   escaped, newline as \n, other control bytes and DEL as \u00XX, valid UTF-8 as
 *   is, any other byte as \ufffd; a NULL string written as null).
 * Does not own: the stream (the caller's FILE, never closed or flushed here), the
 *   document's shape (the caller opens and closes each object and array, and ends the
 *   line).
 *
 * Invariants
 *   - Every field is written with its key, or NULL inside an array; a ',' goes before
 *     every field but the first of its object or array: `first` is true right after
 *     an open bracket and false after any field or close.
 *   - A writer starts as {f, true} (compact: `,` and `:`) or {f, true, true} (spaced:
 *     `, ` and `: `, the style of `generate` and `soak`): its first field is the
 *     document's top value.
 */
#ifndef PKV_TOOLS_JSON_H
#define PKV_TOOLS_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
    FILE *f;
    bool first;   /* no field yet in the innermost open object or array */
    bool spaced;  /* ", " and ": " instead of "," and ":" */
} json_writer;

/* The JSON string literal of the n bytes at p (quotes included) to f. */
void json_escape(FILE *f, const char *p, size_t n);

/* The separator and `"key":` (nothing but the separator when key is NULL); the caller
 * writes the value. */
void json_key(json_writer *w, const char *key);
/* A field whose value opens with c ('{' or '['), and its close. */
void json_open(json_writer *w, const char *key, char c);
void json_close(json_writer *w, char c);
/* A number (%.6g; null if not finite) and a string (escaped; null if v is NULL). */
void json_num(json_writer *w, const char *key, double v);
void json_str(json_writer *w, const char *key, const char *v);
/* true / false; an integer, exact; a number in the caller's printf format (e.g.
 * "%.3f"; null if not finite). */
void json_bool(json_writer *w, const char *key, bool v);
void json_u64(json_writer *w, const char *key, uint64_t v);
void json_fmt(json_writer *w, const char *key, const char *fmt, double v);
/* The separator and key, then the opening quote of a string the caller writes in
 * pieces with json_str_part, then json_str_end. */
void json_str_begin(json_writer *w, const char *key);
void json_str_part(json_writer *w, const char *p, size_t n);
void json_str_end(json_writer *w);

/* Integer fields, exact. */
typedef struct { const char *k; uint64_t v; } json_u64_field;
void json_u64s(json_writer *w, const json_u64_field *f, size_t n);
/* JSON_U64S(w, {"key", value}, ...): the fields of a list, in order. */
#define JSON_U64S(w, ...)                                                                  \
    json_u64s(w, (const json_u64_field[]){__VA_ARGS__},                                    \
              sizeof((const json_u64_field[]){__VA_ARGS__}) / sizeof(json_u64_field))

/* Number fields, as json_num. */
typedef struct { const char *k; double v; } json_num_field;
void json_nums(json_writer *w, const json_num_field *f, size_t n);
/* JSON_NUMS(w, {"key", value}, ...): the fields of a list, in order. */
#define JSON_NUMS(w, ...)                                                                  \
    json_nums(w, (const json_num_field[]){__VA_ARGS__},                                    \
              sizeof((const json_num_field[]){__VA_ARGS__}) / sizeof(json_num_field))

#endif

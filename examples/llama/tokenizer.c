/*
 * tokenizer.c - see tokenizer.h for the format, the algorithms and the invariants.
 *
 * Loading validates everything before anything is used: each record must fit in the
 * file, each piece must be 1..max_token_length bytes, scores must be finite and the
 * file must end exactly after the last record (a tokenizer of another vocabulary size
 * is an error, not a silent misread).
 */
#include "tokenizer.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Upper bound on a piece length we accept; real tokenizers use < 64. */
#define MAX_PIECE_BYTES 4096u

static int32_t le_i32(const unsigned char *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                 (uint32_t)p[3] << 24;
    int32_t v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static float le_f32(const unsigned char *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                 (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Order of two byte strings: memcmp on the common prefix, then the shorter first. */
static int bytes_cmp(const char *a, size_t la, const char *b, size_t lb)
{
    int c = memcmp(a, b, la < lb ? la : lb);
    if (c)
        return c;
    return (la > lb) - (la < lb);
}

typedef struct {
    const char *s;
    uint32_t len, id;
} sort_entry;

static int sort_entry_cmp(const void *pa, const void *pb)
{
    const sort_entry *a = pa, *b = pb;
    int c = bytes_cmp(a->s, a->len, b->s, b->len);
    if (c)
        return c;
    return (a->id > b->id) - (a->id < b->id);
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* The raw byte of a "<0xHH>" piece, or -1. */
static int byte_piece(const char *s, size_t len)
{
    if (len != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>')
        return -1;
    int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
    if (hi < 0 || lo < 0)
        return -1;
    return hi * 16 + lo;
}

void tokenizer_free(tokenizer *t)
{
    if (!t)
        return;
    free(t->piece);
    free(t->piece_len);
    free(t->score);
    free(t->byte_value);
    free(t->sorted);
    free(t->arena);
    free(t->merge_buf);
    memset(t, 0, sizeof *t);
}

/* Read the whole file (it is small: a few hundred KiB for a 32k vocabulary). */
static pkv_status read_file(const char *path, unsigned char **data, size_t *size,
                            char *err, size_t errlen)
{
    *data = NULL;
    *size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open tokenizer '%s': %s", path, strerror(errno));
        return PKV_EIO;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        snprintf(err, errlen, "tokenizer '%s' is not a regular file", path);
        return PKV_EIO;
    }
    if (st.st_size > (off_t)(256u << 20)) {
        fclose(f);
        snprintf(err, errlen, "tokenizer '%s' is implausibly large (%lld bytes)", path,
                 (long long)st.st_size);
        return PKV_ECORRUPT;
    }
    size_t n = (size_t)st.st_size;
    unsigned char *buf = malloc(n ? n : 1);
    if (!buf) {
        fclose(f);
        snprintf(err, errlen, "out of memory reading tokenizer '%s'", path);
        return PKV_ENOMEM;
    }
    if (n && fread(buf, 1, n, f) != n) {
        const char *why = ferror(f) ? strerror(errno) : "the file ended early";
        free(buf);
        fclose(f);
        snprintf(err, errlen, "cannot read tokenizer '%s': %s", path, why);
        return PKV_EIO;
    }
    fclose(f);
    *data = buf;
    *size = n;
    return PKV_OK;
}

pkv_status tokenizer_load(tokenizer *t, const char *path, uint32_t vocab_size,
                          char *err, size_t errlen)
{
    if (!t || !path || !err || errlen == 0)
        return PKV_EINVAL;
    memset(t, 0, sizeof *t);
    if (vocab_size == 0 || vocab_size > (1u << 24)) {
        snprintf(err, errlen, "vocabulary size %u is out of range", vocab_size);
        return PKV_EINVAL;
    }
    unsigned char *data;
    size_t size;
    pkv_status st = read_file(path, &data, &size, err, errlen);
    if (st != PKV_OK)
        return st;

    /* Pass 1: validate every record and size the arena. */
    st = PKV_ECORRUPT;
    size_t off = 0, arena_bytes = 0;
    if (size < 4) {
        snprintf(err, errlen, "tokenizer '%s' is truncated: %zu bytes, no header", path,
                 size);
        goto fail;
    }
    int32_t mtl = le_i32(data);
    if (mtl <= 0 || (uint32_t)mtl > MAX_PIECE_BYTES) {
        snprintf(err, errlen, "tokenizer '%s': max_token_length %d is not in 1..%u", path,
                 (int)mtl, MAX_PIECE_BYTES);
        goto fail;
    }
    off = 4;
    for (uint32_t i = 0; i < vocab_size; i++) {
        if (size - off < 8) {
            snprintf(err, errlen,
                     "tokenizer '%s' is truncated: record %u of %u starts at byte %zu "
                     "but the file has %zu bytes",
                     path, i, vocab_size, off, size);
            goto fail;
        }
        float sc = le_f32(data + off);
        int32_t len = le_i32(data + off + 4);
        if (!isfinite(sc)) {
            snprintf(err, errlen, "tokenizer '%s': piece %u has a non-finite score", path,
                     i);
            goto fail;
        }
        if (len <= 0 || len > mtl) {
            snprintf(err, errlen,
                     "tokenizer '%s': piece %u has length %d (must be 1..%d, the "
                     "max_token_length)",
                     path, i, (int)len, (int)mtl);
            goto fail;
        }
        off += 8;
        if (size - off < (size_t)len) {
            snprintf(err, errlen, "tokenizer '%s' is truncated inside piece %u", path, i);
            goto fail;
        }
        off += (size_t)len;
        arena_bytes += (size_t)len + 1;
    }
    if (off != size) {
        snprintf(err, errlen,
                 "tokenizer '%s' has %zu bytes after its %u pieces: it does not belong to "
                 "a model with vocab_size %u",
                 path, size - off, vocab_size, vocab_size);
        goto fail;
    }

    /* Pass 2: build the tables. */
    st = PKV_ENOMEM;
    t->vocab_size = vocab_size;
    t->max_token_length = (uint32_t)mtl;
    t->piece = calloc(vocab_size, sizeof *t->piece);
    t->piece_len = calloc(vocab_size, sizeof *t->piece_len);
    t->score = calloc(vocab_size, sizeof *t->score);
    t->byte_value = calloc(vocab_size, sizeof *t->byte_value);
    t->sorted = calloc(vocab_size, sizeof *t->sorted);
    t->arena = malloc(arena_bytes);
    t->merge_buf = malloc(2 * (size_t)mtl + 1);
    sort_entry *ents = calloc(vocab_size, sizeof *ents);
    if (!t->piece || !t->piece_len || !t->score || !t->byte_value || !t->sorted ||
        !t->arena || !t->merge_buf || !ents) {
        free(ents);
        snprintf(err, errlen, "out of memory loading tokenizer '%s'", path);
        goto fail;
    }
    off = 4;
    char *a = t->arena;
    for (uint32_t i = 0; i < vocab_size; i++) {
        float sc = le_f32(data + off);
        uint32_t len = (uint32_t)le_i32(data + off + 4);
        off += 8;
        memcpy(a, data + off, len);
        a[len] = '\0';
        off += len;
        t->piece[i] = a;
        t->piece_len[i] = len;
        t->score[i] = sc;
        t->byte_value[i] = (int16_t)byte_piece(a, len);
        ents[i] = (sort_entry){a, len, i};
        a += len + 1;
    }
    qsort(ents, vocab_size, sizeof *ents, sort_entry_cmp);
    for (uint32_t i = 0; i < vocab_size; i++)
        t->sorted[i] = ents[i].id;
    free(ents);
    for (unsigned b = 0; b < 256; b++)
        t->bytes[b] = (unsigned char)b;
    free(data);
    return PKV_OK;

fail:
    free(data);
    tokenizer_free(t);
    return st;
}

int64_t tokenizer_lookup(const tokenizer *t, const char *s, size_t len)
{
    /* lower bound of (s, len) in the sorted order, so duplicates resolve to the
     * smallest id */
    size_t lo = 0, hi = t->vocab_size;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        uint32_t id = t->sorted[mid];
        if (bytes_cmp(t->piece[id], t->piece_len[id], s, len) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < t->vocab_size) {
        uint32_t id = t->sorted[lo];
        if (bytes_cmp(t->piece[id], t->piece_len[id], s, len) == 0)
            return id;
    }
    return -1;
}

size_t tokenizer_max_tokens(size_t text_len)
{
    return text_len + 2;
}

pkv_status tokenizer_encode(tokenizer *t, const char *text, uint32_t *out, size_t cap,
                            size_t *n_out)
{
    if (!t || !t->piece || !text || !out || !n_out)
        return PKV_EINVAL;
    size_t text_len = strlen(text);
    if (cap < tokenizer_max_tokens(text_len))
        return PKV_EINVAL;
    size_t n = 0;
    out[n++] = TOKENIZER_BOS;
    if (text_len > 0) {
        int64_t sp = tokenizer_lookup(t, " ", 1);
        /* a vocabulary without " " falls back to the byte, like any other code point */
        out[n++] = sp >= 0 ? (uint32_t)sp : (uint32_t)' ' + 3u;
    }
    /* One code point: a byte and the continuation bytes (10xxxxxx) after it, at most
     * four bytes. Malformed UTF-8 is grouped the same way and falls back to bytes. */
    for (size_t i = 0; i < text_len;) {
        size_t start = i++;
        while (i < text_len && i - start < 4 && ((unsigned char)text[i] & 0xC0) == 0x80)
            i++;
        int64_t id = tokenizer_lookup(t, text + start, i - start);
        if (id >= 0) {
            out[n++] = (uint32_t)id;
        } else {
            for (size_t j = start; j < i; j++)
                out[n++] = (uint32_t)(unsigned char)text[j] + 3u;
        }
    }
    /* Greedy merges by score. The pieces of byte tokens are their "<0xHH>" spelling,
     * exactly as the reference concatenates them, so they never merge in practice. */
    for (;;) {
        float best = -INFINITY;
        int64_t best_id = -1;
        size_t best_at = 0;
        for (size_t i = 0; i + 1 < n; i++) {
            uint32_t a = out[i], b = out[i + 1];
            if (a >= t->vocab_size || b >= t->vocab_size)
                continue;
            size_t la = t->piece_len[a], lb = t->piece_len[b];
            if (la + lb > 2 * (size_t)t->max_token_length)
                continue;
            memcpy(t->merge_buf, t->piece[a], la);
            memcpy(t->merge_buf + la, t->piece[b], lb);
            int64_t id = tokenizer_lookup(t, t->merge_buf, la + lb);
            if (id >= 0 && t->score[id] > best) {
                best = t->score[id];
                best_id = id;
                best_at = i;
            }
        }
        if (best_id < 0)
            break;
        out[best_at] = (uint32_t)best_id;
        memmove(out + best_at + 1, out + best_at + 2, (n - best_at - 2) * sizeof *out);
        n--;
    }
    *n_out = n;
    return PKV_OK;
}

void tokenizer_decode(const tokenizer *t, uint32_t prev, uint32_t token, const char **s,
                      size_t *len)
{
    *s = "";
    *len = 0;
    if (!t || token >= t->vocab_size)
        return;
    const char *p = t->piece[token];
    size_t n = t->piece_len[token];
    if (prev == TOKENIZER_BOS && n > 0 && p[0] == ' ') {
        p++;
        n--;
    }
    if (t->byte_value[token] >= 0) {
        p = (const char *)&t->bytes[t->byte_value[token]];
        n = 1;
    }
    /* llama2.c's safe_printf drops a lone unprintable byte; only ASCII control bytes
     * are dropped here: bytes >= 0x80 are pieces of a UTF-8 character that the
     * tokenizer spelled in byte tokens (<0xE6><0x97><0xA5>), and printing them in
     * order gives the character back whole. */
    if (n == 1) {
        unsigned char c = (unsigned char)p[0];
        if (c < 0x80 && !(isprint(c) || isspace(c)))
            return;
    }
    *s = p;
    *len = n;
}

pkv_status tokenizer_encode_prompt(tokenizer *t, uint32_t vocab_size, const char *text,
                                   uint32_t *out, size_t cap, size_t *n_out, char *err,
                                   size_t errlen)
{
    if (t)
        return tokenizer_encode(t, text, out, cap, n_out);
    if (!text || !out || !n_out)
        return PKV_EINVAL;
    const size_t len = strlen(text);
    if (cap < tokenizer_max_tokens(len))
        return PKV_EINVAL;
    if (len && vocab_size < 259) {
        snprintf(err, errlen, "a prompt without --tokenizer needs a vocabulary of at least "
                              "259 (byte tokens)");
        return PKV_EINVAL;
    }
    size_t n = 0;
    out[n++] = TOKENIZER_BOS;
    for (size_t i = 0; i < len; i++)
        out[n++] = (uint32_t)(unsigned char)text[i] + 3u;
    *n_out = n;
    return PKV_OK;
}

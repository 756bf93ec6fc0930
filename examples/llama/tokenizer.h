/*
 * tokenizer.h - the llama2.c / SentencePiece-BPE tokenizer of `pagedkv generate`.
 *
 * Owns: loading a llama2.c tokenizer file (../shared/models/README.md, "Tokenizer
 * format"), encoding a prompt and decoding one token, both as that format's reference
 * runner does them.
 * Does not own: the model, sampling, printing.
 *
 * Encoding: BOS (id 1); the " " piece as a dummy prefix if the text is non-empty; one
 * piece per UTF-8 code point (its bytes + 3 when the code point has no piece); then,
 * repeatedly, merge the adjacent pair whose concatenation is a piece with the highest
 * score (leftmost on ties) until no pair merges.
 * Decoding: after BOS a piece loses one leading space; "<0xHH>" pieces stand for the
 * raw byte HH; a one-byte ASCII piece that is neither printable nor whitespace prints
 * as nothing, while bytes >= 0x80 print raw: they spell UTF-8 characters that have no
 * piece of their own, so the bytes of consecutive tokens give the character back.
 *
 * Invariants after a successful load: every piece is 1..max_token_length bytes (its
 * copy is NUL-terminated too), `sorted` orders all ids by (bytes, id), and
 * byte_value[id] is 0..255 exactly for the "<0xHH>" pieces, -1 otherwise.
 */
#ifndef PKV_TOOLS_TOKENIZER_H
#define PKV_TOOLS_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "pagedkv.h"

#define TOKENIZER_BOS 1u

typedef struct {
    uint32_t vocab_size;        /* pieces; the count comes from the model header */
    uint32_t max_token_length;  /* longest piece in bytes (from the file, checked) */
    const char **piece;         /* [vocab] bytes of each piece, NUL-terminated copies */
    uint32_t *piece_len;        /* [vocab] bytes of each piece, without the NUL */
    float *score;               /* [vocab] merge priority: higher merges first */
    int16_t *byte_value;        /* [vocab] raw byte of a "<0xHH>" piece, else -1 */
    uint32_t *sorted;           /* [vocab] ids ordered by (piece bytes, id) */
    char *arena;                /* storage of every piece copy */
    char *merge_buf;            /* [2 * max_token_length + 1] encode scratch */
    unsigned char bytes[256];   /* bytes[b] == b: what byte pieces decode to */
} tokenizer;

/* Load `path`, which must hold exactly vocab_size records. On failure a message that
 * names the file and the problem is written to err (errlen bytes), *t is left empty
 * (tokenizer_free-able), and the status is PKV_EIO (cannot open/read), PKV_ECORRUPT
 * (malformed or truncated, trailing bytes), PKV_EINVAL (bad arguments) or PKV_ENOMEM. */
pkv_status tokenizer_load(tokenizer *t, const char *path, uint32_t vocab_size,
                          char *err, size_t errlen);
void tokenizer_free(tokenizer *t);   /* safe on a zeroed or failed tokenizer */

/* Tokens `text` can need at most: BOS, the dummy prefix, one per byte. */
size_t tokenizer_max_tokens(size_t text_len);
/* Encode text (NUL-terminated) with a leading BOS into out (cap entries, at least
 * tokenizer_max_tokens(strlen(text))); *n_out gets the count. PKV_EINVAL if cap is too
 * small or an argument is NULL. Does not allocate. */
pkv_status tokenizer_encode(tokenizer *t, const char *text, uint32_t *out, size_t cap,
                            size_t *n_out);
/* The prompt of a tool: encoded with t when it is non-NULL, else as byte tokens (BOS,
 * then each byte b as b + 3, the llama2.c runners' fallback), into out (cap entries, at
 * least tokenizer_max_tokens(strlen(text))). PKV_EINVAL with a message in err if a
 * non-empty text needs byte tokens and vocab_size is under 259, or an argument is bad. */
pkv_status tokenizer_encode_prompt(tokenizer *t, uint32_t vocab_size, const char *text,
                                   uint32_t *out, size_t cap, size_t *n_out, char *err,
                                   size_t errlen);
/* The bytes to print for `token` following `prev` (*len may be 0: print nothing).
 * The pointer stays valid while t is loaded. Out-of-range tokens give nothing. */
void tokenizer_decode(const tokenizer *t, uint32_t prev, uint32_t token, const char **s,
                      size_t *len);
/* Id of a piece with exactly these bytes, or -1. */
int64_t tokenizer_lookup(const tokenizer *t, const char *s, size_t len);

#endif

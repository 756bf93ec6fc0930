/*
 * persist/format.h - the byte layout of a session file (docs/file-format.md) and the
 * helpers its writer (persist/save.c) and its reader (persist/load.c) share: field
 * offsets, the magic, little-endian field codecs, the file's dtype codes, and one
 * bounded transfer (persist/format.c), and the checks of a sound file that both use
 * (persist/header.c). Only the persist/ files include it; they and
 * docs/file-format.md change together (a layout change bumps PKVI_SFILE_VERSION).
 *
 * Owns: where every field sits and how it is encoded. Does not own: what is written
 *   or when (persist/save.c), what a sound file is (persist/header.c, for the reader
 *   and the writer alike), reading and loading (persist/load.c), the version,
 *   alignment and header limit and pkvi_sfile_info (persist/sfile.h, shared with the
 *   tests), the checksum (store/crc32c.h).
 *
 * Layout, versions 1 to 5 (every integer little-endian; offsets in bytes):
 *   header   [0, header_bytes)       the fixed fields at PKVI_SFILE_OFF_*, layer_len[L];
 *                                    v2: the extension, per-layer records, sink
 *                                    logits; v3: the token record; v4: the shard's
 *                                    first position; v5: the record's limit,
 *                                    per-layer RoPE and stale rows; then its CRC-32C
 *   table    [header_bytes, + 16 n)  n_pages entries: layer u32, crc u32, index u64
 *   gap      zeros up to data_off = align_up(header_bytes + 16 n, PKVI_SFILE_ALIGN)
 *   pages    [data_off, + n page_bytes)
 *   ids      v3: n_token_ids i32 after the last page
 */
#ifndef PAGEDKV_PERSIST_FORMAT_H
#define PAGEDKV_PERSIST_FORMAT_H

#include "persist/sfile.h"
#include "store/crc32c.h"

#include <string.h>

/* \x89PKV\r\n\x1a\n: the high byte catches 7-bit transfers, CR LF / LF newline
 * conversion (docs/file-format.md). */
PKVI_HIDDEN extern const unsigned char pkvi_sfile_magic[8];

enum {
    PKVI_SFILE_OFF_MAGIC = 0, PKVI_SFILE_OFF_VERSION = 8, PKVI_SFILE_OFF_HEADER_BYTES = 12,
    PKVI_SFILE_OFF_N_LAYERS = 16, PKVI_SFILE_OFF_N_HEADS = 20, PKVI_SFILE_OFF_N_KV_HEADS = 24,
    PKVI_SFILE_OFF_HEAD_DIM = 28, PKVI_SFILE_OFF_DTYPE = 32, PKVI_SFILE_OFF_BLOCK_TOKENS = 36,
    PKVI_SFILE_OFF_SCALE = 40, PKVI_SFILE_OFF_FLAGS = 44, PKVI_SFILE_OFF_PAGE_BYTES = 48,
    PKVI_SFILE_OFF_N_PAGES = 56, PKVI_SFILE_OFF_TABLE_OFF = 64, PKVI_SFILE_OFF_DATA_OFF = 72,
    PKVI_SFILE_OFF_TABLE_CRC = 80, PKVI_SFILE_OFF_RESERVED = 84, PKVI_SFILE_OFF_LAYER_LEN = 88,
    PKVI_SFILE_HEADER_FIXED = 92, /* v1: header_bytes = HEADER_FIXED + 8 * n_layers */
    PKVI_SFILE_V2_EXTRA = 8,      /* v2, after layer_len: head_dim_v u32, reserved u32 */
    PKVI_SFILE_V2_LAYER = 32,     /* v2, then per layer: window, sink_tokens,
                                     rollback_tokens, softcap bits, has_sink_logits,
                                     reserved (u32 each), hole_hi (u64); then n_heads
                                     f32 logits per flagged layer */
    PKVI_SFILE_V3_EXTRA = 16,     /* v3, after the v2 fields: n_token_ids u64,
                                     tokens_crc u32, reserved u32; the ids follow the
                                     last page */
    PKVI_SFILE_V4_EXTRA = 16,     /* v4, after the v3 fields: first u64 (a shard's first
                                     position), reserved u64 */
    PKVI_SFILE_V5_EXTRA = 16,     /* v5, after the v4 fields: record_max u64 (how far
                                     the token record may grow: a discard's p0, else
                                     all ones), reserved u64 */
    PKVI_SFILE_V5_LAYER = 32,     /* v5, then per layer: rope, rope_dims, rope_theta bits,
                                     rope_freq_scale bits (u32 each), stale_lo, stale_hi
                                     (u64: a discard's stale positions, btable.h) */
    PKVI_SFILE_PREFIX_BYTES = 16, /* magic, version, header_bytes: the same in every
                                     version */
    PKVI_SFILE_ENTRY_BYTES = 16,  /* page-table entry: layer u32, crc u32, index u64 */
};

/* Pages move in batches of about this many bytes: load reads them into a buffer of
 * this size, save stages its copies in a quarter of it. */
#define PKVI_SFILE_BATCH_BYTES (16ull << 20)

/* ---- field codecs -------------------------------------------------------------------- */

static inline void pkvi_put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static inline void pkvi_put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint32_t pkvi_get32(const unsigned char *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static inline uint64_t pkvi_get64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* The IEEE-754 binary32 bits of f: how the scale, softcaps and sink logits are stored
 * and compared (bitwise, so -0.0 and NaN payloads count). */
static inline uint32_t pkvi_float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline uint64_t pkvi_align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

/* Bytes the version-5 fields take at the end of a header of n_layers layers (before
 * its CRC); 0 for older versions. */
static inline uint64_t pkvi_sfile_v5_bytes(uint32_t version, uint32_t n_layers)
{
    return version >= 5 ? PKVI_SFILE_V5_EXTRA + (uint64_t)PKVI_SFILE_V5_LAYER * n_layers : 0;
}

/* ---- persist/header.c: what a sound file is (the reader's and the writer's check) --- */

/* Parse the hbytes header bytes h (its CRC, version, every field and their
 * consistency with each other and with in->file_bytes, which the caller sets) into
 * `in`; filled as far as it got (header_sound once the CRC and version matched).
 * PKV_OK, PKV_EINVAL (another version, an unknown dtype code), PKV_ECORRUPT,
 * PKV_ENOMEM; *why a static reason. Release `in` with pkvi_sfile_info_free. */
PKVI_HIDDEN pkv_status pkvi_sfile_parse_header(const unsigned char *h, uint32_t hbytes,
                                               pkvi_sfile_info *in, const char **why);
/* A sound header of another engine (geometry geo) is another format for this
 * engine: PKV_EINVAL. */
PKVI_HIDDEN pkv_status pkvi_sfile_match_engine(const pkvi_sfile_info *in,
                                               const pkvi_geom *geo, const char **why);
/* Pages of a layer of len positions: ceil(len / bt). */
PKVI_HIDDEN uint64_t pkvi_sfile_layer_pages(uint64_t len, uint32_t bt);
/* Where layer l's hole starts (its sink pages; 0 for a shard); the hole is
 * [lo, hole_hi[l]) when hole_hi[l] != 0. */
PKVI_HIDDEN uint64_t pkvi_sfile_hole_lo(const pkvi_sfile_info *in, uint32_t l);

/* Walks the page table in file order, entry by entry, whatever chunks it is read in:
 * the (layer, index) every entry must hold, and the CRC of the entries so far. */
typedef struct {
    uint32_t layer;
    uint64_t index;          /* within `layer` */
    uint32_t crc;            /* CRC-32C of the entries walked */
} pkvi_sfile_walk;
PKVI_HIDDEN pkvi_sfile_walk pkvi_sfile_walk_start(const pkvi_sfile_info *in);
/* Check entries [0, n) of buf (the next n of the table) against their expected
 * (layer, index), folding them into the CRC. False at the first one out of order. */
PKVI_HIDDEN bool pkvi_sfile_walk_entries(const pkvi_sfile_info *in, pkvi_sfile_walk *w,
                                         const unsigned char *buf, uint64_t n);
/* Move w to the next layer that has pages to hold, when its current one is done. */
PKVI_HIDDEN void pkvi_sfile_walk_settle(const pkvi_sfile_info *in, pkvi_sfile_walk *w);
/* The index after idx of layer l that the file holds (the hole skipped). */
PKVI_HIDDEN uint64_t pkvi_sfile_next_index(const pkvi_sfile_info *in, uint32_t l,
                                           uint64_t idx);

/* Positions held by page i of a layer of len positions that has np pages. */
static inline uint32_t pkvi_sfile_page_tokens(uint64_t len, uint64_t np, uint64_t i,
                                              uint32_t bt)
{
    return i + 1 < np ? bt : (uint32_t)(len - (np - 1) * bt);
}

/* ---- persist/rope_fields.c: version 5 (SPEC §14) -------------------------------------- */

/* Parse the version-5 fields of the sound header h (hbytes, the version-2 to -4 fields
 * and layer lengths already in `in`) into in's rope fields, stale and record_max (a
 * file before version 5: none). PKV_ECORRUPT when they are inconsistent, PKV_ENOMEM;
 * *why a static reason. */
PKVI_HIDDEN pkv_status pkvi_sfile_read_v5(const unsigned char *h, uint32_t hbytes,
                                          pkvi_sfile_info *in, const char **why);
/* Whether every layer's RoPE config in the file is the engine's. */
PKVI_HIDDEN bool pkvi_sfile_rope_match(const pkvi_sfile_info *in, const pkvi_geom *geo);
/* A loaded session takes the file's stale positions and record limit. */
PKVI_HIDDEN void pkvi_sfile_rope_apply(const pkvi_sfile_info *in, pkv_session *s);

/* ---- persist/format.c ---------------------------------------------------------------- */

/* The file's dtype code of t (0 f32, 1 f16, 2 bf16, 3 q8, 4 q4; 3 and 4 from version
 * 2 on); false for a dtype the format does not know. */
PKVI_HIDDEN bool pkvi_sfile_dtype_code(pkv_dtype t, uint32_t *code);
/* The dtype of a file code; code must be below 5 (an unknown one reads as f32). */
PKVI_HIDDEN pkv_dtype pkvi_sfile_code_dtype(uint32_t code);

/* A PKVI_SFILE_ALIGN-aligned buffer of at least `bytes` (rounded up), for free();
 * NULL when bytes is 0 or too large, or memory is short. */
PKVI_HIDDEN void *pkvi_sfile_alloc(uint64_t bytes);

/* Read (write == false) or write [off, off + len) of fd through io as one transfer,
 * cut into requests submitted together so io_uring keeps several in flight.
 * PKV_OK, or PKV_EIO when any part failed. */
PKVI_HIDDEN pkv_status pkvi_sfile_transfer(pkvi_io *io, bool write, int fd, void *buf,
                                           uint64_t len, uint64_t off);

#endif /* PAGEDKV_PERSIST_FORMAT_H */

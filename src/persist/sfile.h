/*
 * sfile.h - the session file as the rest of the tree sees it (persist/load.c,
 * persist/save.c; the layout is docs/file-format.md and persist/format.h): the
 * version and limits every reader and writer agrees on, what a file says about
 * itself (pkvi_sfile_info), the engine-free verifier behind pkv_session_file_check,
 * and save and load with a caller's io object, through which the tests inject faults.
 *
 * Owns: nothing at run time; it only declares. Calls take no engine lock of their
 * own but through the session calls they make (save pins each layer while it writes
 * it; load builds a session nobody else sees yet).
 */
#ifndef PAGEDKV_SFILE_H
#define PAGEDKV_SFILE_H

#include "store/io.h"
#include "session/session.h"

/* The newest version this build writes and reads; it reads every version from 1 on
 * and writes the oldest that holds a session (version 1 for plain engines). */
#define PKVI_SFILE_VERSION 5u
#define PKVI_SFILE_ALIGN 4096u
/* The largest header_bytes of any version (docs/file-format.md, versioning rules): a
 * reader refuses a larger one as damage before it allocates or reads anything for it.
 * Version 1 holds up to (2^20 - 92) / 8 = 131060 layers. */
#define PKVI_SFILE_MAX_HEADER (1u << 20)

/* What a session file says about itself. Filled as far as the file could be read:
 * `header_sound` once the header's CRC matched, then the rest. */
typedef struct {
    bool header_sound;         /* magic, header CRC and version checked */
    uint32_t version;
    uint32_t n_layers, n_heads, n_kv_heads, head_dim;
    uint32_t dtype_code;       /* file code: 0 f32, 1 f16, 2 bf16, 3 q8, 4 q4 (v2) */
    uint32_t head_dim_v;       /* v2; head_dim in a version-1 file */
    uint32_t block_tokens;
    uint32_t scale_bits;       /* IEEE-754 binary32 bits of the softmax scale */
    uint64_t page_bytes;
    uint64_t n_pages;
    uint64_t data_off;         /* offset of page 0 */
    uint64_t file_bytes;
    uint64_t *layer_len;       /* [n_layers] positions per layer, owned (or NULL) */
    pkv_layer_config *layer_cfg; /* [n_layers] (v2; zeros in v1), owned, sink_logits
                                  pointing into `logits` (or NULL); the rope fields
                                  from v5 (zeros before) */
    float *logits;             /* the sink logits of every layer that has them, owned */
    uint64_t *hole_hi;         /* [n_layers]: the first page after the layer's hole -
                                  what a window released, or a shard's positions below
                                  `first` (0: no hole), owned */
    uint64_t n_token_ids;      /* v3: recorded token ids after the last page */
    uint32_t tokens_crc;       /* v3: their CRC-32C */
    uint64_t first;            /* v4: a shard's first position (0: a whole session) */
    uint64_t record_max;       /* v5: how far the record may grow (UINT64_MAX before) */
    uint64_t *stale;           /* [n_layers][2] v5: each layer's stale positions
                                  [lo, hi) (zeros before), owned */
    uint32_t header_bytes;     /* where the page table starts */
    uint32_t table_crc;        /* the header's CRC of the page table */
    uint64_t rows_k, rows_v;   /* bytes of one K row, one V row of one group */
    uint64_t bad_page;         /* file index of the first page that failed its checks,
                                  UINT64_MAX if none did */
    uint32_t bad_layer;        /* ... its layer and index within the layer */
    uint64_t bad_index;
} pkvi_sfile_info;

/* Check every byte of the session file at `path` (header, page table, every page's
 * CRC and padding) without an engine. PKV_OK, PKV_EINVAL (not a session file or of
 * another version), PKV_ECORRUPT, PKV_EIO, PKV_ENOMEM; *why (never NULL on return)
 * is a static English reason. `info` must be released with pkvi_sfile_info_free. */
PKVI_HIDDEN pkv_status pkvi_sfile_verify(pkvi_io *io, const char *path,
                                         pkvi_sfile_info *info, const char **why);
PKVI_HIDDEN void pkvi_sfile_info_free(pkvi_sfile_info *info);

/* pkv_session_save / pkv_session_load with a caller's io object (tests inject
 * faults through it). `why` as above; may be NULL. */
PKVI_HIDDEN pkv_status pkvi_session_save_io(pkv_session *s, const char *path,
                                            pkvi_io *io, const char **why);
/* pkvi_session_save_io with options: PKVI_SAVE_NAMED_TEMP writes through a named
 * temporary even where O_TMPFILE works (the fallback path, for tests). */
#define PKVI_SAVE_NAMED_TEMP 1u
PKVI_HIDDEN pkv_status pkvi_session_save_opts(pkv_session *s, const char *path,
                                              pkvi_io *io, unsigned flags,
                                              const char **why);
PKVI_HIDDEN pkv_status pkvi_session_load_io(const pkvi_ctx *ctx, const char *path,
                                            pkvi_io *io, pkv_session **out,
                                            const char **why);

/* pkv_session_load for the engine whose contexts ctx names (engine.c unpacks the
 * handle): a new session built from the file at path. Failures are recorded in
 * ctx->errs. */
PKVI_HIDDEN pkv_status pkvi_session_load(const pkvi_ctx *ctx, const char *path,
                                         pkv_session **out);

#endif /* PAGEDKV_SFILE_H */

/*
 * io_backend.h - private declarations of the storage layer: the two I/O backends
 * behind pkvi_io (io.c, io_uring.c), the CRC32C variants (crc32c.c) and the session
 * file verifier and test hooks of persist/load.c and persist/save.c (used by the
 * io/persist test suites; `pagedkv inspect` reaches the verifier through the public
 * pkv_session_file_check). The layout itself is private to them: persist/format.h.
 *
 * Owns: nothing at run time; it only declares. Everything here is internal (pkvi_*,
 * hidden) and may change with any commit. The cross-module I/O interface itself is
 * in internal.h (pkvi_io_*); this header is what those modules share among
 * themselves and with their tests.
 */
#ifndef PAGEDKV_IO_BACKEND_H
#define PAGEDKV_IO_BACKEND_H

#include "store/io.h"
#include "base/util.h"

/* ---- io.c <-> io_uring.c ----------------------------------------------------------- */

/* Largest transfer handed to one pread/pwrite or one SQE. Linux moves at most
 * 0x7ffff000 bytes per call and an SQE length is 32 bits; 1 GiB keeps every chunk
 * well inside both. Anything longer is transferred as several chunks. */
#define PKVI_IO_MAX_CHUNK (1ull << 30)

/* Requests in flight at once on one ring (its SQ and CQ size). See io_uring.c for
 * the measurement behind it. */
#define PKVI_URING_DEPTH 64u

typedef struct pkvi_uring pkvi_uring;

/* Set up a ring. 0, or a negative errno (-ENOSYS when built without liburing, or what
 * io_uring_queue_init said: -EPERM in a sandbox that forbids it, -ENOMEM, ...). */
PKVI_HIDDEN int pkvi_uring_create(pkvi_uring **out);
PKVI_HIDDEN void pkvi_uring_destroy(pkvi_uring *u);
/* Perform reqs[0..n) completely; every chunk is at most max_chunk bytes (short
 * transfers are resumed). Returns PKV_OK, or PKV_EIO when any request failed; all
 * submitted requests have completed (or failed) before it returns, so the caller's
 * buffers are free again. */
PKVI_HIDDEN pkv_status pkvi_uring_submit(pkvi_uring *u, const pkvi_io_req *reqs,
                                         uint32_t n, uint64_t max_chunk);
/* Whether the ring failed in a way that forbids entering it again (a hard
 * io_uring_enter error): io.c then drops it and continues with pread/pwrite. */
PKVI_HIDDEN bool pkvi_uring_broken(const pkvi_uring *u);

/* ---- io.c test hooks ----------------------------------------------------------------- */

/* Whether this process can set up io_uring: 0, or the negative errno that says why
 * not (-ENOSYS: built without liburing). Ignores PKV_NO_URING. */
PKVI_HIDDEN int pkvi_uring_probe(void);
/* Cap every single transfer (pread/pwrite call or SQE) of io at max_bytes (0: the
 * default PKVI_IO_MAX_CHUNK), so tests drive the short-transfer path. */
PKVI_HIDDEN void pkvi_io_limit_transfer(pkvi_io *io, uint64_t max_bytes);

/* ---- crc32c.c ------------------------------------------------------------------------ */

/* The two implementations behind pkvi_crc32c, for tests that compare them.
 * pkvi_crc32c_hw may only be called when pkvi_crc32c_hw_available(). */
PKVI_HIDDEN uint32_t pkvi_crc32c_sw(uint32_t crc, const void *buf, size_t len);
PKVI_HIDDEN uint32_t pkvi_crc32c_hw(uint32_t crc, const void *buf, size_t len);
PKVI_HIDDEN bool pkvi_crc32c_hw_available(void);

/* ---- persist/load.c, persist/save.c: the session file (docs/file-format.md) ---------- */

/* The newest version this build writes and reads; it reads every version from 1 on
 * and writes the oldest that holds a session (version 1 for plain engines). */
#define PKVI_SFILE_VERSION 4u
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
                                  pointing into `logits` (or NULL) */
    float *logits;             /* the sink logits of every layer that has them, owned */
    uint64_t *hole_hi;         /* [n_layers]: the first page after the layer's hole -
                                  what a window released, or a shard's positions below
                                  `first` (0: no hole), owned */
    uint64_t n_token_ids;      /* v3: recorded token ids after the last page */
    uint32_t tokens_crc;       /* v3: their CRC-32C */
    uint64_t first;            /* v4: a shard's first position (0: a whole session) */
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
PKVI_HIDDEN pkv_status pkvi_session_load_io(pkv_engine *e, const char *path,
                                            pkvi_io *io, pkv_session **out,
                                            const char **why);

#endif /* PAGEDKV_IO_BACKEND_H */

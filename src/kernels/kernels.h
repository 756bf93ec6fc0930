/*
 * kernels/kernels.h - the decode kernel's contract: the geometry of one call, the
 * heads and softmax states it folds into, the kernel signature, and the table of
 * kernels per ISA chosen once per engine (dispatch.c).
 *
 * Owns nothing at run time. A kernel never allocates, locks, logs or fails; ref.c is
 * the specification every SIMD table (avx2.c, avx2vnni.c, avx512.c, avx512vnni.c;
 * neon.c, neondot.c on aarch64) is tested against.
 */
#ifndef PAGEDKV_KERNELS_H
#define PAGEDKV_KERNELS_H

#include "base/util.h"

/* Largest n_heads / n_kv_heads (bounds the kernels' stack scratch). */
#define PKVI_MAX_GROUP_HEADS 256u
/* Largest head_dim (bounds per-head stack buffers). */
#define PKVI_MAX_HEAD_DIM 4096u
/* Software prefetch of the next page in the SIMD kernels (1 on, 0 off); a -D on the
 * compiler command line overrides it for A/B measurements. */
#ifndef PKVI_PF
#define PKVI_PF 1
#endif
/* Full unrolling of the micro-kernels' constant loops over small arrays of vectors, so
 * the arrays live in registers: gcc's `GCC unroll` and clang's own spelling (clang 14
 * accepts `GCC unroll 16` but does not unroll these loops with it: the accumulators
 * stay on the stack). docs/performance.md, decision table: PKVI_UNROLL. */
#if defined(__clang__)
#define PKVI_UNROLL _Pragma("clang loop unroll(full)")
#else
#define PKVI_UNROLL _Pragma("GCC unroll 16")
#endif
/* The SIMD files' function specifier: their micro-kernels and the walk (walk.h) are
 * inlined into one out-of-line function per dtype and path, where the dtype, the head
 * and token blocks and the tile's shape are constants. An unoptimized build (-O0,
 * meson's debug buildtype) cannot inline the tile functions walk.h receives as
 * arguments, which gcc refuses for always_inline; there they are plain static inline
 * functions (the same arithmetic, called). So are they in an optimized gcc sanitizer
 * build (PKVI_NO_FORCE_INLINE: meson.build, simd_nosan), whose instrumented walks took
 * minutes a file to compile when forced into one function. */
#if defined(__OPTIMIZE__) && !defined(PKVI_NO_FORCE_INLINE)
#define PKVI_INLINE static inline __attribute__((always_inline))
#else
#define PKVI_INLINE static inline
#endif
/* Tokens scored per softmax tile inside a kernel (stack scratch of
 * PKVI_TILE * heads-per-group floats). */
#define PKVI_TILE 16u

/* dv of a call: head_dim_v, or head_dim when it is 0. */
#define PKVI_DV(p) ((p)->head_dim_v ? (p)->head_dim_v : (p)->head_dim)

/* Geometry one kernel call needs. All byte figures are for one page. */
typedef struct {
    uint32_t head_dim;      /* dk: width of q and of K rows */
    uint32_t head_dim_v;    /* dv: width of V rows, acc and out; 0 means dk */
    uint32_t block_tokens;  /* bt: positions per page */
    uint32_t hg;            /* query heads per group in a call: h / g, or a multiple of
                             * it when pkv_prefill stacks queries (<= MAX_GROUP_HEADS) */
    pkv_dtype dtype;        /* storage type of the page */
    float scale;            /* softmax scale applied to q.k */
    float softcap;          /* 0: none; else a scaled score s becomes softcap*tanh(s/softcap) */
    uint32_t quant_dot;     /* 1 (Q8/Q4 pages only): scores from integer dot products of
                             * the K rows' integers with q quantized per head into int8
                             * blocks (pkvi_quant_query); 0: the exact f32 dot */
    uint32_t pf_l2;         /* 1: software prefetches of the unit ahead go to L2 (T1),
                             * 0: to L1 (T0); pkvi_prefetch_l2 picks it per CPU */
    size_t group_stride;    /* bytes between consecutive groups in a page: bt*(dk+dv)*size */
    size_t v_offset;        /* bytes from a group's K rows to its V rows: bt*dk*size, or
                             * (bt-r)*dk*size + r*dv*size for a walk starting at row r */
} pkvi_kparams;

/* The query heads and running softmax states a kernel call works on: those of group
 * `group0` at the pointers, those of the i-th group after it at i strides further. */
typedef struct {
    const float *q;         /* [hg][dk] query heads (unscaled) */
    float *m;               /* [hg]    running max of scale*q.k   (-INFINITY when empty) */
    float *l;               /* [hg]    running sum of exp(s - m)  (0 when empty) */
    float *acc;             /* [hg][dv] running sum of exp(s - m) * v (0 when empty) */
    size_t q_stride;        /* floats from one group's q to the next group's */
    size_t st_stride;       /* floats from one group's m (and l, acc) to the next's */
} pkvi_heads;

/*
 * The decode kernel: fold `n_pages` pages (all full but the last, which holds
 * `last_tokens` in 1..bt positions) of the KV groups group0 .. group0 + n_groups - 1
 * into the running softmax states of each group's hg query heads (x).
 *
 * Score of a position: s = (q . k) * scale, dot accumulated in f32 (with quant_dot:
 * q . k = sum over blocks b of (dk_b * dq_b) * isum_b, isum_b the exact int32 dot of
 * the block's integers, ref.c has the order), then, with a
 * softcap c > 0, s = c * tanh(s / c) (tanh within a few ulp: docs/numerics.md). Positions are
 * folded in order in tiles of at most PKVI_TILE tokens (a tile never spans pages):
 * per tile, m' = max(m, max s); rescale l and acc by exp(m - m'); add exp(s - m').
 *
 * Memory is walked page by page, and inside a page group by group, so a call over all
 * groups reads each page front to back (the page is group-major): the order the
 * hardware prefetcher follows. The arithmetic is page-local and head-local: the state
 * of a head after a page depends only on its state before, its q and the page - not
 * on n_groups, on how calls split the pages, or on how many heads share a call
 * (hg). pkv_prefill relies on the last: it passes several queries' heads as one
 * larger group. tests/test_kernels.c checks all three bitwise.
 * Never allocates, locks or fails. Variants may reassociate sums (documented bound in
 * docs/numerics.md); each variant is deterministic.
 */
typedef void (*pkvi_attend_fn)(const pkvi_kparams *p, const void *const *pages,
                               uint32_t n_pages, uint32_t last_tokens, uint32_t group0,
                               uint32_t n_groups, const pkvi_heads *x);

typedef struct {
    const char *isa; /* "scalar", "avx2", "avx2vnni", "avx512", "avx512vnni", "neon",
                      * "neon_dotprod" */
    pkvi_attend_fn attend;
    /* store n floats as dtype t: bitwise dtype.c's pkvi_store_row (f16/bf16 round to
     * nearest even; Q8/Q4 are quant.c's bytes) */
    void (*store_row)(pkv_dtype t, void *dst, const float *src, uint32_t n);
} pkvi_kernels;

PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_scalar;
PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_avx2;    /* may be unavailable */
/* avx2's kernel with AVX-VNNI: the integer-dot Q8/Q4 scores from a transposed tile by
 * vpdpbusd (avx2's bits); needs AVX-VNNI too (may be unavailable) */
PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_avx2vnni;
PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_avx512;  /* may be unavailable */
/* avx512's kernel with vpdpbusd: the integer-dot scores the same bits; the exact
 * Q8/Q4 scores of whole blocks from integer limbs of q (docs/numerics.md section 3);
 * needs AVX512-VNNI too (may be unavailable) */
PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_avx512vnni;
/* aarch64: Advanced SIMD (may be unavailable: an x86-64 build has none) */
PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_neon;
/* neon's kernel with SDOT: the integer-dot Q8/Q4 scores, the same bits; needs asimddp
 * (may be unavailable) */
PKVI_HIDDEN extern const pkvi_kernels pkvi_kernels_neon_dotprod;
/* Best kernels the CPU and OS support (x86-64: cpuid + XGETBV; aarch64: getauxval's
 * AT_HWCAP), honouring PKV_FORCE_ISA (scalar|avx2|avx2vnni|avx512|avx512vnni|neon|
 * neon_dotprod; a forced ISA the host lacks gives PKV_EINVAL). */
PKVI_HIDDEN pkv_status pkvi_kernels_select(const pkvi_kernels **out);
/* The table an engine of storage type dt uses, given the best one k for the host:
 * k: every table built reads every dtype (kept for a table that some day lacks one). */
PKVI_HIDDEN const pkvi_kernels *pkvi_kernels_for_dtype(const pkvi_kernels *k, pkv_dtype dt);
/* PKV_EINVAL when PKV_FORCE_ISA names an ISA this host cannot run (or none at all);
 * *name is the variable's value (NULL when unset). */
PKVI_HIDDEN pkv_status pkvi_kernels_check_force(const char **name);
/* Why PKV_FORCE_ISA=isa cannot be honoured - not a table's name, a table this build
 * does not contain (meson's `kernels` option), or one the host cannot run - as a
 * static string; NULL when it can. */
PKVI_HIDDEN const char *pkvi_kernels_force_reason(const char *isa);
/* The table of an ISA name this build contains ("scalar", "avx2", "avx2vnni", "avx512",
 * "avx512vnni", "neon", "neon_dotprod": the scalar one and those meson's `kernels` option
 * built), whether or not
 * the host can run it; NULL for a name it does not contain. */
PKVI_HIDDEN const pkvi_kernels *pkvi_kernels_named(const char *isa);
/* Where the SIMD walks' software prefetches of the unit ahead go (pkvi_kparams.pf_l2):
 * 1 (L2, T1) on Zen 4, where T1 fills L2 only and leaves the L1 miss buffers to the
 * demand loads, else 0 (L1, T0); docs/performance.md, decision table: PKV_PREFETCH.
 * PKV_PREFETCH=l1
 * or l2 forces it; any other non-empty value is PKV_EINVAL. Results never change. */
PKVI_HIDDEN pkv_status pkvi_prefetch_l2(uint32_t *out);
/* Whether the host can run `isa` ("scalar" always). */
PKVI_HIDDEN bool pkvi_isa_supported(const char *isa);

#endif /* PAGEDKV_KERNELS_H */

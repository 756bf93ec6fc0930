/*
 * rope/rope.h - rotary position embeddings in the engine (SPEC §14, docs/rope.md): one
 * layer's RoPE, its tables of cos/sin, and the rotation of key and query rows at their
 * positions - what the writes (session/write.c), pkv_rope_q (engine.c) and the
 * re-rotation of pkv_session_discard (session/discard.c) apply.
 *
 * Owns a pkvi_rope and its tables (rope.c builds them once per engine and distinct
 * config; engine.c owns the objects and frees them). Immutable after creation, so read
 * without any lock. The SIMD rotations are rope/avx2.c, rope/avx512.c and rope/neon.c,
 * one file per ISA like the decode kernels; rope.c's scalar functions are their
 * specification, and every table computes the same bits (the same fused multiply-adds,
 * element by element).
 *
 * The rotation. A head's first `dims` values rotate as dims / 2 pairs; pair i turns by
 * the angle pos * f_i, f_i = freq_scale * theta^(-2i / dims):
 *   PKV_ROPE_NORM  pairs (2i, 2i + 1)            (llama2.c, GPT-J: adjacent)
 *   PKV_ROPE_NEOX  pairs (i, i + dims / 2)       (Llama 3, Qwen, Mistral: halves)
 * and a pair (x, y) with c = cos, s = sin becomes
 *   x' = fma(x, c, -(y * s)),   y' = fma(x, s, y * c)      (f32; y * s rounded first)
 *
 * What is tabulated. A table for every position is out of the question (2^24 positions
 * of 64 pairs are 8 GiB). The position is cut into base-64 digits: p = sum_k d_k 64^k
 * below 2^24 (4 digits), and tab[k][d] holds cos/sin of (d * 64^k) * f_i, computed in
 * double and stored in f32; the rotation of p is the product of its digits' rotations
 * (combine: the angle-sum formulas, in f32 with fused multiply-adds, lowest digit
 * first). Past 2^24 the rest, p - (p mod 2^24), is one more factor computed in double
 * at the call (sin and cos of (double)hi * f_i). So a position costs at most three
 * combines below 2^24, and the tables are 4 * 64 * dims floats (128 KiB at dims 128).
 * Accuracy (tests/test_rope.c holds it against a long-double reference):
 * |cos/sin - exact| <= 2^-21 below 2^24, plus p * f_i * 2^-52 beyond (the resolution of
 * a double angle); a rotated pair is within 2^-20 * |(x, y)| of the exact rotation.
 */
#ifndef PAGEDKV_ROPE_H
#define PAGEDKV_ROPE_H

#include "base/util.h"

/* Base-64 digits tabulated: positions below 2^(DIGIT_BITS * LEVELS) = 2^24 come from the
 * tables alone. */
#define PKVI_ROPE_DIGIT_BITS 6u
#define PKVI_ROPE_DIGITS (1u << PKVI_ROPE_DIGIT_BITS)
#define PKVI_ROPE_LEVELS 4u
#define PKVI_ROPE_TABLE_BITS (PKVI_ROPE_DIGIT_BITS * PKVI_ROPE_LEVELS)

/* The widest rotation (rope_dims): the engine's largest head_dim. Bounds the stack
 * vectors of cos/sin (2 * 2048 floats). */
#define PKVI_ROPE_MAX_DIMS 4096u

/* Defaults of the zero fields of a layer with rope (pkvi_rope_check fills them in). */
#define PKVI_ROPE_THETA_DEFAULT 10000.0f

/* The rotation kernels of one ISA. cs vectors are planar: c[half] then s[half]. */
typedef struct {
    const char *isa; /* "scalar", "avx2", "avx512", "neon" */
    /* out = a * b as rotations (a, b, out [2 * half]; out may be a or b):
     * c = fma(a_c, b_c, -(a_s * b_s)), s = fma(a_s, b_c, a_c * b_s) */
    void (*combine)(uint32_t half, const float *a, const float *b, float *out);
    /* rotate the first 2 * half values of each of n rows (row r at x + r * stride) in
     * place, pairs by style (PKV_ROPE_NORM or PKV_ROPE_NEOX) */
    void (*rotate)(uint32_t style, uint32_t half, const float *cs, float *x, uint32_t n,
                   size_t stride);
} pkvi_rope_kernels;

PKVI_HIDDEN extern const pkvi_rope_kernels pkvi_rope_scalar;
PKVI_HIDDEN extern const pkvi_rope_kernels pkvi_rope_avx2;   /* builds with the avx2 table */
PKVI_HIDDEN extern const pkvi_rope_kernels pkvi_rope_avx512; /* builds with the avx512 table */
PKVI_HIDDEN extern const pkvi_rope_kernels pkvi_rope_neon;   /* builds with the neon table */

/* The rotation kernels that go with the decode kernels named isa (the engine's: a
 * forced scalar engine rotates with the scalar ones too; a VNNI or dot-product table
 * with its base table's). */
PKVI_HIDDEN const pkvi_rope_kernels *pkvi_rope_kernels_for(const char *isa);

typedef struct {
    uint32_t style;          /* PKV_ROPE_NORM or PKV_ROPE_NEOX */
    uint32_t half;           /* pairs per head: rope_dims / 2 */
    pkv_layer_config lc;     /* the resolved rope fields it was built from */
    double *freq;            /* [half] f_i, radians per position */
    float *tab;              /* [LEVELS][DIGITS][2][half]: cos, sin of d * 64^k * f_i */
    const pkvi_rope_kernels *k;
} pkvi_rope;

/* Whether lc's rope fields are valid for heads of head_dim values, and its resolved
 * fields: rope 0 (none) with rope_dims, rope_theta and rope_freq_scale all 0; or
 * PKV_ROPE_NORM / PKV_ROPE_NEOX with rope_dims even and in [2, head_dim] (0 = head_dim,
 * which must be even), rope_theta finite and > 0 (0 = 10000), rope_freq_scale finite
 * and > 0 (0 = 1). On success the resolved values go to *out (may be NULL); on failure
 * a reason goes to why (n bytes; may be NULL). The one definition engine creation and
 * pkv_config_explain use. */
PKVI_HIDDEN bool pkvi_rope_check(const pkv_layer_config *lc, uint32_t head_dim,
                                 pkv_layer_config *out, char *why, size_t n);
/* Build the tables of lc's (resolved, valid) rope with the kernels k. PKV_ENOMEM. */
PKVI_HIDDEN pkv_status pkvi_rope_new(const pkv_layer_config *lc,
                                     const pkvi_rope_kernels *k, pkvi_rope **out);
PKVI_HIDDEN void pkvi_rope_free(pkvi_rope *r); /* NULL: no-op */
/* Whether lc's resolved rope fields are r's (layers that agree share one object). */
PKVI_HIDDEN bool pkvi_rope_same(const pkvi_rope *r, const pkv_layer_config *lc);

/* cs [2 * half] = the rotation of position pos (any uint64_t). */
PKVI_HIDDEN void pkvi_rope_at(const pkvi_rope *r, uint64_t pos, float *cs);
/* cs [2 * half] = the rotation back by delta positions: pkvi_rope_at(delta) with the
 * sines negated (what a discard turns the later keys by). */
PKVI_HIDDEN void pkvi_rope_back(const pkvi_rope *r, uint64_t delta, float *cs);
/* Rotate n rows (row j at x + j * stride floats) by cs in place. */
static inline void pkvi_rope_apply(const pkvi_rope *r, const float *cs, float *x,
                                   uint32_t n, size_t stride)
{
    r->k->rotate(r->style, r->half, cs, x, n, stride);
}

/* Rotate n rows of `heads` heads each (x [n][heads][head_dim]) in place, row j at
 * position pos[j]: pkv_rope_q, and what a write does to its keys. */
PKVI_HIDDEN void pkvi_rope_rows(const pkvi_rope *r, uint32_t n, const uint64_t *pos,
                                float *x, uint32_t heads, uint32_t head_dim);

#endif /* PAGEDKV_ROPE_H */

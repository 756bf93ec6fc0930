/*
 * kernels/ref.c - the scalar reference decode kernel: the specification of what every
 * SIMD kernel computes (see pkvi_attend_fn in internal.h), written to be read.
 *
 * Per page, per tile of at most PKVI_TILE positions, for each of the hg query heads of
 * the group:
 *     s_t   = (q . k_t) * scale            dot in f32, in index order (q, k: dk wide)
 *     s_t   = c * tanh(s_t / c)             when softcap c > 0
 *     m'    = max(m, max_t s_t)
 *     alpha = exp(m - m')                  (0 when the state was empty)
 *     l     = l * alpha + sum_t exp(s_t - m')
 *     acc   = acc * alpha + sum_t exp(s_t - m') * v_t     (t in order; v, acc: dv wide)
 * K/V rows are widened to f32 once per row and reused for all hg heads (GQA: the row
 * is loaded once per group, not once per query head).
 *
 * With quant_dot (Q8/Q4 pages), q . k is the integer-dot score instead: each head's
 * q is quantized into int8 blocks (qi, dq_b: pkvi_quant_query, once per head and
 * tile), and for the K row's blocks (integers k_j, scale dk_b)
 *     q . k = sum_b (dk_b * dq_b) * (float)isum_b,   isum_b = sum_j qi_j * k_j
 * summed in f32 in block order; isum_b is exact in int32 (|isum_b| <= 32*127*128).
 * Everything after the score (softmax, the weighted V sum) is the exact path's.
 * Never allocates, locks or fails; rows past `last_tokens` of the last page are never
 * read.
 */
#include "kernels/kernels.h"
#include "base/dtype.h"
#include "base/quant.h"

#include <math.h>
#include <string.h>

/* The integer-dot q . k of one quantized head (qi, qs) with one stored K row. */
static float quant_dot_row(pkv_dtype t, uint32_t d, const int8_t *qi, const float *qs,
                           const unsigned char *row)
{
    float dot = 0.0f;
    for (uint32_t c = 0, b = 0; c < d; c += 32, b++) {
        const unsigned char *blk = row + (size_t)b * pkvi_quant_block_bytes(t);
        const uint32_t m = d - c < 32 ? d - c : 32;
        int32_t isum = 0;
        for (uint32_t j = 0; j < m; j++)
            isum += (int32_t)qi[c + j] * pkvi_quant_block_int(t, blk, j);
        uint16_t h;
        memcpy(&h, blk, sizeof h);
        dot += (pkvi_f16_to_f32(h) * qs[b]) * (float)isum;
    }
    return dot;
}

/* Fold one page's first ntok rows of one group into the state of its hg heads. */
static void fold_page(const pkvi_kparams *p, const char *kbase, uint32_t ntok,
                      const float *restrict q, float *restrict m, float *restrict l,
                      float *restrict acc)
{
    const uint32_t d = p->head_dim, dv = PKVI_DV(p), hg = p->hg;
    const size_t row = pkv_row_bytes(p->dtype, d), vrow = pkv_row_bytes(p->dtype, dv);
    const float cap = p->softcap;
    const char *vbase = kbase + p->v_offset;
    float s[PKVI_MAX_GROUP_HEADS * PKVI_TILE]; /* [hg][PKVI_TILE] scores, then weights */
    float r[PKVI_MAX_HEAD_DIM];                /* one K or V row widened to f32 */

    for (uint32_t t0 = 0; t0 < ntok; t0 += PKVI_TILE) {
        const uint32_t nt = ntok - t0 < PKVI_TILE ? ntok - t0 : PKVI_TILE;

        if (p->quant_dot) {
            int8_t qi[PKVI_MAX_HEAD_DIM];
            float qs[PKVI_MAX_HEAD_DIM / 32];
            for (uint32_t hh = 0; hh < hg; hh++) {
                pkvi_quant_query(d, q + (size_t)hh * d, qi, qs);
                for (uint32_t t = 0; t < nt; t++) {
                    const float sc = quant_dot_row(p->dtype, d, qi, qs,
                                                   (const unsigned char *)kbase +
                                                       (size_t)(t0 + t) * row) * p->scale;
                    s[hh * PKVI_TILE + t] = cap > 0.0f ? cap * tanhf(sc / cap) : sc;
                }
            }
        }
        for (uint32_t t = 0; t < nt && !p->quant_dot; t++) {
            pkvi_load_row(p->dtype, r, kbase + (size_t)(t0 + t) * row, d);
            for (uint32_t hh = 0; hh < hg; hh++) {
                const float *qh = q + (size_t)hh * d;
                float dot = 0.0f;
                for (uint32_t c = 0; c < d; c++)
                    dot += qh[c] * r[c];
                const float sc = dot * p->scale;
                s[hh * PKVI_TILE + t] = cap > 0.0f ? cap * tanhf(sc / cap) : sc;
            }
        }
        for (uint32_t hh = 0; hh < hg; hh++) {
            float *sh = s + hh * PKVI_TILE;
            float mt = sh[0];
            for (uint32_t t = 1; t < nt; t++)
                mt = fmaxf(mt, sh[t]);
            const float mnew = fmaxf(m[hh], mt);
            const float alpha = expf(m[hh] - mnew);
            float sum = 0.0f;
            for (uint32_t t = 0; t < nt; t++) {
                sh[t] = expf(sh[t] - mnew);
                sum += sh[t];
            }
            l[hh] = l[hh] * alpha + sum;
            m[hh] = mnew;
            float *ah = acc + (size_t)hh * dv;
            for (uint32_t c = 0; c < dv; c++)
                ah[c] *= alpha;
        }
        for (uint32_t t = 0; t < nt; t++) {
            pkvi_load_row(p->dtype, r, vbase + (size_t)(t0 + t) * vrow, dv);
            for (uint32_t hh = 0; hh < hg; hh++) {
                const float w = s[hh * PKVI_TILE + t];
                float *ah = acc + (size_t)hh * dv;
                for (uint32_t c = 0; c < dv; c++)
                    ah[c] += w * r[c];
            }
        }
    }
}

static void attend_scalar(const pkvi_kparams *p, const void *const *pages,
                          uint32_t n_pages, uint32_t last_tokens, uint32_t group0,
                          uint32_t n_groups, const pkvi_heads *x)
{
    for (uint32_t pg = 0; pg < n_pages; pg++) {
        const uint32_t ntok = pg + 1 == n_pages ? last_tokens : p->block_tokens;
        for (uint32_t i = 0; i < n_groups; i++) {
            const char *kbase = (const char *)pages[pg] + (size_t)(group0 + i) * p->group_stride;
            fold_page(p, kbase, ntok, x->q + i * x->q_stride, x->m + i * x->st_stride,
                      x->l + i * x->st_stride, x->acc + i * x->st_stride);
        }
    }
}

const pkvi_kernels pkvi_kernels_scalar = {"scalar", attend_scalar, pkvi_store_row};

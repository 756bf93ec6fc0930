/*
 * reference.c - the dense reference math (include/pagedkv.h): causal attention (the oracle every
 * paged result is checked against), the textbook multi-head attention layer with
 * projections, and the KV-cache size formula.
 *
 * Owns: pkv_attention_reference (every variant of docs/variants.md) and its special case
 * pkv_causal_attention, pkv_mha_forward, pkv_kv_cache_bytes.
 * Does not own: anything paged, any engine state, the kernels. Nothing here is fast
 * and nothing here is meant to be; it is written to be obviously right.
 *
 * Numerics (the oracle's contract):
 *   - Every dot product, softmax and weighted sum is accumulated in double. Inputs
 *     are widened exactly (float -> double); the only rounding to float is the final
 *     store into `out`, so each output is the correctly-rounded-to-float value of a
 *     double computation whose own error is ~1e-16 relative.
 *   - Softmax subtracts the row maximum before exp (scores like 1e4 or 1e300 do not
 *     overflow). With finite inputs every score is finite (a float*float product sums
 *     to at most ~1e76 * d in double), so every row has a finite maximum and a weight
 *     exp(0) = 1: the denominator is >= 1 and never 0. Non-finite inputs give NaN/Inf
 *     outputs; they are not rejected (the oracle does not scan data).
 *   - pkv_mha_forward keeps its intermediates (Q, K, V, the concatenated heads) in
 *     double and rounds only the final [T][d_model] product to float. It is therefore
 *     NOT bitwise equal to "pkv_causal_attention on float-rounded projections"; it is
 *     the more accurate of the two.
 *
 * Invariants:
 *   - No state, no abort: every entry validates everything before it touches `out`;
 *     on any error status `out` is unchanged (allocation happens before the first
 *     store, and allocation failure is PKV_ENOMEM).
 *   - Query head i reads KV group i / (h / g) (include/pagedkv.h, pkv_causal_attention),
 *     written once, in group_of().
 *   - Which positions a windowed query attends is base/window.h's, as for the engine.
 *   - Every element count and byte size is computed with pkvi_mul and must fit size_t;
 *     an overflowing size is PKV_EINVAL (the public header's "overflowing sizes").
 *   - pkv_kv_cache_bytes checks for a zero factor *before* multiplying, so a zero
 *     anywhere gives 0 / PKV_OK even when a partial product of the other factors would
 *     overflow; only a product that truly exceeds UINT64_MAX is PKV_ERANGE.
 */
#include "attention/reference.h"
#include "base/window.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The GQA mapping: query head i reads KV group i / (h / g). */
static uint32_t group_of(uint32_t head, uint32_t n_heads, uint32_t n_kv_heads)
{
    return head / (n_heads / n_kv_heads);
}

/* a * b * c elements of `elem` bytes each, as a size_t byte count (stored in *out
 * unless out is NULL); false on overflow. */
static bool bytes_of(uint64_t a, uint64_t b, uint64_t c, uint64_t elem, size_t *out)
{
    uint64_t n;
    if (!pkvi_mul(a, b, &n) || !pkvi_mul(n, c, &n) || !pkvi_mul(n, elem, &n))
        return false;
    if (n > SIZE_MAX)
        return false;
    if (out)
        *out = (size_t)n;
    return true;
}

/*
 * Attention on double arrays, the single implementation every public entry uses.
 * Q [T][h][dk], K [T][g][dk], V [T][g][dv], out [T][h][dv]. w is scratch for T
 * scores. sc is the softmax scale (already resolved). lc NULL is plain causal
 * attention; else docs/variants.md, in this order for head i at position t:
 *     s_j = sc * q_i . k_j;  s_j = c * tanh(s_j / c) when softcap c > 0
 *     A   = { j <= t : j > t - window } u { j < sink_tokens }   (all j <= t if window 0)
 *     m   = max(sigma_i, max_{j in A} s_j)         (sigma_i = -inf without sink logits)
 *     out = sum_A e^(s_j - m) v_j / (sum_A e^(s_j - m) + e^(sigma_i - m))
 */
static void attend(uint32_t T, uint32_t h, uint32_t g, uint32_t dk, uint32_t dv, double sc,
                   const pkv_layer_config *lc, const double *Q, const double *K,
                   const double *V, double *out, double *w)
{
    const double cap = lc ? (double)lc->softcap : 0.0;
    const uint64_t sinks = lc && lc->window ? lc->sink_tokens : 0;
    for (uint32_t t = 0; t < T; t++) {
        /* first position of the window; positions below it are attended only as sinks */
        const uint64_t lo = lc ? pkvi_window_lo(lc, t) : 0;
        for (uint32_t i = 0; i < h; i++) {
            const uint32_t grp = group_of(i, h, g);
            const double *q = Q + ((size_t)t * h + i) * dk;
            double *o = out + ((size_t)t * h + i) * dv;
            const double sigma = lc && lc->sink_logits ? (double)lc->sink_logits[i] : -INFINITY;

            /* scores over the attended positions and their maximum */
            double mx = sigma;
            for (uint32_t j = 0; j <= t; j++) {
                if (j < lo && j >= sinks) {
                    w[j] = -INFINITY; /* outside the window and not a sink */
                    continue;
                }
                const double *k = K + ((size_t)j * g + grp) * dk;
                double s = 0.0;
                for (uint32_t c = 0; c < dk; c++)
                    s += q[c] * k[c];
                s *= sc;
                if (cap > 0.0)
                    s = cap * tanh(s / cap);
                w[j] = s;
                if (s > mx)
                    mx = s;
            }
            /* max-subtracted exponentials: the largest term is exp(0) = 1 */
            double sum = sigma > -INFINITY ? exp(sigma - mx) : 0.0;
            for (uint32_t j = 0; j <= t; j++) {
                w[j] = w[j] == -INFINITY ? 0.0 : exp(w[j] - mx);
                sum += w[j];
            }
            for (uint32_t c = 0; c < dv; c++)
                o[c] = 0.0;
            for (uint32_t j = 0; j <= t; j++) {
                if (w[j] == 0.0)
                    continue;
                const double *v = V + ((size_t)j * g + grp) * dv;
                const double p = w[j] / sum;
                for (uint32_t c = 0; c < dv; c++)
                    o[c] += p * v[c];
            }
        }
    }
}

static void widen(double *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = (double)src[i];
}

bool pkvi_layer_config_ok(const pkv_layer_config *lc, uint32_t n_heads)
{
    if (!lc)
        return true;
    if (lc->window == 0 && (lc->sink_tokens || lc->rollback_tokens))
        return false;
    if (!isfinite(lc->softcap) || lc->softcap < 0.0f)
        return false;
    for (uint32_t i = 0; lc->sink_logits && i < n_heads; i++)
        if (!isfinite(lc->sink_logits[i]))
            return false;
    return true;
}

pkv_status pkv_attention_reference(uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads,
                                   uint32_t head_dim, uint32_t head_dim_v, float scale,
                                   const pkv_layer_config *lc, const float *q,
                                   const float *k, const float *v, float *out)
{
    const uint32_t T = n_tokens, dv = head_dim_v ? head_dim_v : head_dim;
    if (!q || !k || !v || !out)
        return PKV_EINVAL;
    if (T == 0 || n_heads == 0 || n_kv_heads == 0 || head_dim == 0)
        return PKV_EINVAL;
    if (n_heads % n_kv_heads != 0)
        return PKV_EINVAL;
    /* -0.0f compares equal to 0 and therefore also means "the default" */
    if (!isfinite(scale) || scale < 0.0f || !pkvi_layer_config_ok(lc, n_heads))
        return PKV_EINVAL;

    size_t q_bytes, k_bytes, v_bytes, o_bytes, w_bytes;
    if (!bytes_of(T, n_heads, head_dim, sizeof(double), &q_bytes) ||
        !bytes_of(T, n_kv_heads, head_dim, sizeof(double), &k_bytes) ||
        !bytes_of(T, n_kv_heads, dv, sizeof(double), &v_bytes) ||
        !bytes_of(T, n_heads, dv, sizeof(double), &o_bytes) ||
        !bytes_of(T, 1, 1, sizeof(double), &w_bytes))
        return PKV_EINVAL;

    /* Exact double copies keep one attention routine for every entry (mha works in
     * double); the oracle trades memory for having a single, readable code path.
     * Allocated one after the other, queries first (h >= g), so an impossible size
     * fails before anything else large has been obtained. */
    double *Qd = NULL, *Od = NULL, *Kd = NULL, *Vd = NULL, *w = NULL;
    pkv_status st = PKV_ENOMEM;
    if (!(Qd = malloc(q_bytes)) || !(Od = malloc(o_bytes)) || !(Kd = malloc(k_bytes)) ||
        !(Vd = malloc(v_bytes)) || !(w = malloc(w_bytes)))
        goto done;

    widen(Qd, q, q_bytes / sizeof(double));
    widen(Kd, k, k_bytes / sizeof(double));
    widen(Vd, v, v_bytes / sizeof(double));
    const double sc = scale == 0.0f ? 1.0 / sqrt((double)head_dim) : (double)scale;
    attend(T, n_heads, n_kv_heads, head_dim, dv, sc, lc, Qd, Kd, Vd, Od, w);
    /* out is written only now, after everything that can fail and after every input
     * has been copied, so out may even alias q, k or v */
    for (size_t i = 0; i < o_bytes / sizeof(double); i++)
        out[i] = (float)Od[i];
    st = PKV_OK;
done:
    free(Qd);
    free(Kd);
    free(Vd);
    free(Od);
    free(w);
    return st;
}

pkv_status pkv_causal_attention(uint32_t n_tokens, uint32_t n_heads, uint32_t n_kv_heads,
                                uint32_t head_dim, float scale, const float *q,
                                const float *k, const float *v, float *out)
{
    return pkv_attention_reference(n_tokens, n_heads, n_kv_heads, head_dim, head_dim, scale,
                                   NULL, q, k, v, out);
}

/* C [n][m] = A [n][k] * B [k][m], accumulated in double (B, the weights, float). */
static void matmul_dd(size_t n, size_t k, size_t m, const double *A, const float *B,
                      double *C)
{
    for (size_t r = 0; r < n; r++) {
        double *c = C + r * m;
        for (size_t j = 0; j < m; j++)
            c[j] = 0.0;
        for (size_t x = 0; x < k; x++) {
            const double a = A[r * k + x];
            const float *b = B + x * m;
            for (size_t j = 0; j < m; j++)
                c[j] += a * (double)b[j];
        }
    }
}

pkv_status pkv_mha_forward(uint32_t T, uint32_t d_model, uint32_t n_heads,
                           uint32_t n_kv_heads, const float *X, const float *Wq,
                           const float *Wk, const float *Wv, const float *Wo, float *out)
{
    if (!X || !Wq || !Wk || !Wv || !Wo || !out)
        return PKV_EINVAL;
    if (T == 0 || d_model == 0 || n_heads == 0 || n_kv_heads == 0)
        return PKV_EINVAL;
    if (d_model % n_heads != 0 || n_heads % n_kv_heads != 0)
        return PKV_EINVAL;

    const uint32_t d = d_model / n_heads;       /* head_dim; h * d == d_model */
    const uint32_t kv_w = n_kv_heads * d;       /* width of K and V; <= d_model */

    /* Sizes: the weights are caller-owned, but their element counts are still
     * products that must be indexable; the scratch must be allocatable. */
    size_t q_bytes, kv_bytes, w_bytes;
    if (!bytes_of(d_model, d_model, 1, sizeof(float), NULL) ||
        !bytes_of(d_model, kv_w, 1, sizeof(float), NULL) ||
        !bytes_of(T, d_model, 1, sizeof(double), &q_bytes) ||
        !bytes_of(T, kv_w, 1, sizeof(double), &kv_bytes) ||
        !bytes_of(T, 1, 1, sizeof(double), &w_bytes))
        return PKV_EINVAL;
    const size_t q_n = q_bytes / sizeof(double);

    /* Qd [T][h*d], Kd, Vd [T][g*d], Ad [T][h*d] (heads concatenated), Od [T][d_model] */
    double *Qd = NULL, *Ad = NULL, *Od = NULL, *Kd = NULL, *Vd = NULL, *w = NULL;
    pkv_status st = PKV_ENOMEM;
    /* one after the other, largest first (as in pkv_causal_attention) */
    if (!(Qd = malloc(q_bytes)) || !(Ad = malloc(q_bytes)) || !(Od = malloc(q_bytes)) ||
        !(Kd = malloc(kv_bytes)) || !(Vd = malloc(kv_bytes)) || !(w = malloc(w_bytes)))
        goto done;

    widen(Od, X, q_n); /* X in double, in Od until Od is written */
    matmul_dd(T, d_model, d_model, Od, Wq, Qd);
    matmul_dd(T, d_model, kv_w, Od, Wk, Kd);
    matmul_dd(T, d_model, kv_w, Od, Wv, Vd);
    /* Per-head attention written into [T][h][d] is exactly the concatenation of the
     * heads along the feature axis, so Ad is already "concat(heads)". */
    attend(T, n_heads, n_kv_heads, d, d, 1.0 / sqrt((double)d), NULL, Qd, Kd, Vd, Ad, w);
    matmul_dd(T, d_model, d_model, Ad, Wo, Od);
    for (size_t i = 0; i < q_n; i++)
        out[i] = (float)Od[i];
    st = PKV_OK;
done:
    free(Qd);
    free(Kd);
    free(Vd);
    free(Ad);
    free(Od);
    free(w);
    return st;
}

pkv_status pkv_kv_cache_bytes(uint64_t layers, uint64_t n_kv_heads, uint64_t head_dim,
                              uint64_t seq_len, uint64_t batch, uint64_t bytes_per_value,
                              uint64_t *out)
{
    if (!out)
        return PKV_EINVAL;
    const uint64_t f[6] = {layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_value};
    /* Zero first: 0 * (anything) is 0 even if the other factors alone overflow. */
    for (int i = 0; i < 6; i++) {
        if (f[i] == 0) {
            *out = 0;
            return PKV_OK;
        }
    }
    /* All factors >= 1, so the partial products never decrease: a partial overflow
     * means the full product overflows too. */
    uint64_t n = 2;
    for (int i = 0; i < 6; i++)
        if (!pkvi_mul(n, f[i], &n))
            return PKV_ERANGE;
    *out = n;
    return PKV_OK;
}

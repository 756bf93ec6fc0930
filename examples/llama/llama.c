/*
 * llama.c - see llama.h: weights, forward pass and sampler of the tiny transformer.
 *
 * Owns: the weight storage (one float array), the activation buffers, the sampler's
 * scratch. Does not own a KV cache: the attention of every layer is the caller's
 * llama_attn_fn.
 *
 * Invariants:
 *   - A loaded model's header passed validate_config() and the file held exactly
 *     llama_file_floats() floats after the 28-byte header, all finite.
 *   - llama_forward() touches only buffers sized by llama_state_init(); the token loop
 *     of a generator therefore never allocates through this file.
 *   - Each output of matmul_rows() is summed in index order, one accumulator per row,
 *     so a row's value is independent of the batch it was computed in.
 */
#include "llama.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* llama2.c's version 1/2 exports start with this int32 ("ak42" little-endian). */
#define LLAMA2C_V1_MAGIC 0x616b3432
#define RMS_EPS 1e-5f
#define ROPE_BASE 10000.0f

/* ---- sizes ---------------------------------------------------------------------- */

static bool mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a && b > UINT64_MAX / a)
        return false;
    *out = a * b;
    return true;
}

static bool add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (b > UINT64_MAX - a)
        return false;
    *out = a + b;
    return true;
}

/* Floats of one tensor group: a * b * c. */
static bool tensor_floats(uint64_t a, uint64_t b, uint64_t c, uint64_t *total)
{
    uint64_t n;
    return mul_u64(a, b, &n) && mul_u64(n, c, &n) && add_u64(*total, n, total);
}

/* Floats after the header of a version-0 file with this config (legacy RoPE tables
 * and the optional classifier included); false on overflow. */
static bool llama_file_floats(const llama_config *c, uint64_t *out)
{
    uint64_t L = c->n_layers, d = c->dim, kv = c->kv_dim, hid = c->hidden_dim;
    uint64_t t = 0;
    bool ok = tensor_floats(c->vocab_size, d, 1, &t) &&  /* token_embedding */
              tensor_floats(L, d, 1, &t) &&              /* rms_att */
              tensor_floats(L, d, d, &t) &&              /* wq */
              tensor_floats(L, kv, d, &t) &&             /* wk */
              tensor_floats(L, kv, d, &t) &&             /* wv */
              tensor_floats(L, d, d, &t) &&              /* wo */
              tensor_floats(L, d, 1, &t) &&              /* rms_ffn */
              tensor_floats(L, hid, d, &t) &&            /* w1 */
              tensor_floats(L, d, hid, &t) &&            /* w2 */
              tensor_floats(L, hid, d, &t) &&            /* w3 */
              tensor_floats(d, 1, 1, &t) &&              /* rms_final */
              tensor_floats(c->seq_len, c->head_size, 1, &t); /* freq_cis real+imag */
    if (ok && !c->shared_classifier)
        ok = tensor_floats(c->vocab_size, d, 1, &t);
    *out = t;
    return ok;
}

uint64_t llama_param_count(const llama_config *c)
{
    uint64_t t = 0;
    if (!llama_file_floats(c, &t))
        return 0;
    return t - (uint64_t)c->seq_len * c->head_size;
}

/* Point the weight struct at consecutive tensors of m->data, in file order. */
static void map_weights(llama_model *m)
{
    const llama_config *c = &m->cfg;
    size_t L = c->n_layers, d = c->dim, kv = c->kv_dim, hid = c->hidden_dim;
    const float *p = m->data;
    llama_weights *w = &m->w;
    w->token_embedding = p; p += (size_t)c->vocab_size * d;
    w->rms_att = p;         p += L * d;
    w->wq = p;              p += L * d * d;
    w->wk = p;              p += L * kv * d;
    w->wv = p;              p += L * kv * d;
    w->wo = p;              p += L * d * d;
    w->rms_ffn = p;         p += L * d;
    w->w1 = p;              p += L * hid * d;
    w->w2 = p;              p += L * d * hid;
    w->w3 = p;              p += L * hid * d;
    w->rms_final = p;       p += d;
    p += (size_t)c->seq_len * c->head_size;    /* legacy RoPE tables: never read */
    w->wcls = c->shared_classifier ? w->token_embedding : p;
}

/* Header sanity: the bounds keep every product far from overflow and reject files
 * that are clearly not checkpoints (text, another format, random bytes). */
static bool validate_config(const int32_t h[7], llama_config *c, char *why, size_t n)
{
    static const char *names[7] = {"dim", "hidden_dim", "n_layers", "n_heads",
                                   "n_kv_heads", "vocab_size", "seq_len"};
    static const int64_t limit[7] = {1 << 16, 1 << 20, 1 << 12, 1 << 12, 1 << 12,
                                     1 << 24, 1 << 24};
    for (int i = 0; i < 7; i++) {
        int64_t v = h[i];
        if (i == 5 && v < 0)
            v = -v;             /* negative vocab: a separate classifier follows */
        if (v <= 0 || v > limit[i]) {
            snprintf(why, n, "header field %s = %d is out of range 1..%lld", names[i],
                     (int)h[i], (long long)limit[i]);
            return false;
        }
    }
    c->dim = (uint32_t)h[0];
    c->hidden_dim = (uint32_t)h[1];
    c->n_layers = (uint32_t)h[2];
    c->n_heads = (uint32_t)h[3];
    c->n_kv_heads = (uint32_t)h[4];
    c->shared_classifier = h[5] > 0;
    c->vocab_size = (uint32_t)(h[5] > 0 ? (int64_t)h[5] : -(int64_t)h[5]);
    c->seq_len = (uint32_t)h[6];
    if (c->dim % c->n_heads != 0) {
        snprintf(why, n, "dim %u is not a multiple of n_heads %u", c->dim, c->n_heads);
        return false;
    }
    c->head_size = c->dim / c->n_heads;
    if (c->head_size % 2 != 0) {
        snprintf(why, n, "head size %u is odd (RoPE rotates pairs)", c->head_size);
        return false;
    }
    if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads != 0) {
        snprintf(why, n, "n_heads %u is not a multiple of n_kv_heads %u", c->n_heads,
                 c->n_kv_heads);
        return false;
    }
    c->kv_dim = c->n_kv_heads * c->head_size;
    return true;
}

static bool host_is_little_endian(void)
{
    const uint32_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

static uint32_t bswap32(uint32_t x)
{
    return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
}

void llama_free(llama_model *m)
{
    if (!m)
        return;
    free(m->data);
    memset(m, 0, sizeof *m);
}

pkv_status llama_load(llama_model *m, const char *path, char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open model '%s': %s", path, strerror(errno));
        return PKV_EIO;
    }
    pkv_status st = PKV_ECORRUPT;
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        snprintf(err, errlen, "model '%s' is not a regular file", path);
        st = PKV_EIO;
        goto out;
    }
    uint64_t file_size = (uint64_t)sb.st_size;
    unsigned char hb[28];
    if (file_size < sizeof hb || fread(hb, 1, sizeof hb, f) != sizeof hb) {
        snprintf(err, errlen,
                 "model '%s' is truncated: %llu bytes, less than the 28-byte header", path,
                 (unsigned long long)file_size);
        goto out;
    }
    int32_t h[7];
    for (int i = 0; i < 7; i++) {
        uint32_t u = (uint32_t)hb[4 * i] | (uint32_t)hb[4 * i + 1] << 8 |
                     (uint32_t)hb[4 * i + 2] << 16 | (uint32_t)hb[4 * i + 3] << 24;
        memcpy(&h[i], &u, sizeof u);
    }
    if (h[0] == LLAMA2C_V1_MAGIC) {
        snprintf(err, errlen,
                 "model '%s' is a llama2.c version 1/2 export; only the legacy version 0 "
                 "format (export.py --version 0) is supported",
                 path);
        goto out;
    }
    char why[160];
    if (!validate_config(h, &m->cfg, why, sizeof why)) {
        snprintf(err, errlen, "model '%s' has a malformed header: %s", path, why);
        goto out;
    }
    uint64_t floats, want;
    if (!llama_file_floats(&m->cfg, &floats) || !mul_u64(floats, 4, &want) ||
        !add_u64(want, sizeof hb, &want) || floats > SIZE_MAX / 4) {
        snprintf(err, errlen, "model '%s': the header implies an impossible size", path);
        goto out;
    }
    if (file_size != want) {
        snprintf(err, errlen,
                 "model '%s' has %llu bytes but its header (dim %u, hidden %u, %u layers, "
                 "%u/%u heads, vocab %u, seq_len %u) implies %llu: %s",
                 path, (unsigned long long)file_size, m->cfg.dim, m->cfg.hidden_dim,
                 m->cfg.n_layers, m->cfg.n_heads, m->cfg.n_kv_heads, m->cfg.vocab_size,
                 m->cfg.seq_len, (unsigned long long)want,
                 file_size < want ? "truncated" : "trailing bytes");
        goto out;
    }
    m->n_floats = (size_t)floats;
    m->data = malloc(m->n_floats * sizeof(float));
    if (!m->data) {
        snprintf(err, errlen, "out of memory for the %zu weights of '%s'", m->n_floats,
                 path);
        st = PKV_ENOMEM;
        goto out;
    }
    if (fread(m->data, sizeof(float), m->n_floats, f) != m->n_floats) {
        snprintf(err, errlen, "cannot read the weights of '%s': %s", path,
                 ferror(f) ? strerror(errno) : "the file ended early");
        st = PKV_EIO;
        goto out;
    }
    if (!host_is_little_endian()) {
        for (size_t i = 0; i < m->n_floats; i++) {
            uint32_t u;
            memcpy(&u, &m->data[i], 4);
            u = bswap32(u);
            memcpy(&m->data[i], &u, 4);
        }
    }
    for (size_t i = 0; i < m->n_floats; i++) {
        if (!isfinite(m->data[i])) {
            snprintf(err, errlen, "model '%s' holds a non-finite weight at byte %zu", path,
                     28 + 4 * i);
            goto out;
        }
    }
    map_weights(m);
    st = PKV_OK;
out:
    fclose(f);
    if (st != PKV_OK)
        llama_free(m);
    return st;
}

/* ---- the synthetic model ------------------------------------------------------ */

void llama_synthetic_config(llama_config *c)
{
    /* A GQA geometry (4 query heads per KV group) small enough to run anywhere in
     * well under a second for 256 tokens, big enough that pages matter. */
    memset(c, 0, sizeof *c);
    c->dim = 256;
    c->hidden_dim = 688;
    c->n_layers = 4;
    c->n_heads = 8;
    c->n_kv_heads = 2;
    c->vocab_size = 512;
    c->seq_len = 4096;
    c->head_size = c->dim / c->n_heads;
    c->kv_dim = c->n_kv_heads * c->head_size;
    /* Its own classifier: with a shared one, random weights make every token predict
     * itself and the text is one token repeated. */
    c->shared_classifier = false;
}

void llama_rng_init(llama_rng *r, uint64_t seed)
{
    r->s = seed ? seed : 0x9e3779b97f4a7c15ull;
}

static uint64_t rng_next(llama_rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545f4914f6cdd1dull;
}

float llama_rng_coin(llama_rng *r)
{
    return (float)(rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

static void fill_uniform(llama_rng *r, float *p, size_t n, float a)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (2.0f * llama_rng_coin(r) - 1.0f) * a;
}

pkv_status llama_synthetic(llama_model *m, uint64_t seed)
{
    memset(m, 0, sizeof *m);
    llama_synthetic_config(&m->cfg);
    uint64_t floats;
    if (!llama_file_floats(&m->cfg, &floats))
        return PKV_EINVAL;
    m->n_floats = (size_t)floats;
    m->data = calloc(m->n_floats, sizeof(float));
    if (!m->data)
        return PKV_ENOMEM;
    map_weights(m);
    const llama_config *c = &m->cfg;
    size_t L = c->n_layers, d = c->dim, kv = c->kv_dim, hid = c->hidden_dim;
    llama_rng r;
    llama_rng_init(&r, seed);
    /* Uniform(-a, a) has variance a^2/3: a = sqrt(3/in) keeps activations near unit
     * scale; the embedding is larger so that logits are not flat. */
    float *w = m->data;
    fill_uniform(&r, w, (size_t)c->vocab_size * d, 1.0f);
    w += (size_t)c->vocab_size * d;
    for (size_t i = 0; i < L * d; i++)
        *w++ = 1.0f;                                   /* rms_att */
    const float ad = sqrtf(3.0f / (float)d), ah = sqrtf(3.0f / (float)hid);
    fill_uniform(&r, w, L * d * d, 2.0f * ad);  w += L * d * d;    /* wq: peakier scores */
    fill_uniform(&r, w, L * kv * d, 2.0f * ad); w += L * kv * d;   /* wk */
    fill_uniform(&r, w, L * kv * d, ad);        w += L * kv * d;   /* wv */
    fill_uniform(&r, w, L * d * d, ad);         w += L * d * d;    /* wo */
    for (size_t i = 0; i < L * d; i++)
        *w++ = 1.0f;                                   /* rms_ffn */
    fill_uniform(&r, w, L * hid * d, ad);       w += L * hid * d;  /* w1 */
    fill_uniform(&r, w, L * d * hid, ah);       w += L * d * hid;  /* w2 */
    fill_uniform(&r, w, L * hid * d, ad);       w += L * hid * d;  /* w3 */
    for (size_t i = 0; i < d; i++)
        *w++ = 1.0f;                                   /* rms_final */
    w += (size_t)c->seq_len * c->head_size;            /* legacy RoPE tables: unused */
    /* logits of a unit-RMS x get standard deviation ~3: peaked, not degenerate */
    fill_uniform(&r, w, (size_t)c->vocab_size * d, 3.0f * ad);
    return PKV_OK;
}

/* ---- activations -------------------------------------------------------------- */

void llama_state_free(llama_state *s)
{
    if (!s)
        return;
    free(s->x);
    free(s->xb);
    free(s->xb2);
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->att);
    free(s->hb);
    free(s->hb2);
    free(s->rope_freq);
    memset(s, 0, sizeof *s);
}

static float *alloc_rows(uint32_t rows, uint32_t width)
{
    size_t n = (size_t)rows * width;
    if (width && n / width != rows)
        return NULL;
    if (n > SIZE_MAX / sizeof(float))
        return NULL;
    return calloc(n ? n : 1, sizeof(float));
}

pkv_status llama_state_init(llama_state *s, const llama_config *c, uint32_t max_rows)
{
    memset(s, 0, sizeof *s);
    if (max_rows == 0)
        return PKV_EINVAL;
    s->max_rows = max_rows;
    s->x = alloc_rows(max_rows, c->dim);
    s->xb = alloc_rows(max_rows, c->dim);
    s->xb2 = alloc_rows(max_rows, c->dim);
    s->q = alloc_rows(max_rows, c->dim);
    s->k = alloc_rows(max_rows, c->kv_dim);
    s->v = alloc_rows(max_rows, c->kv_dim);
    s->att = alloc_rows(max_rows, c->dim);
    s->hb = alloc_rows(max_rows, c->hidden_dim);
    s->hb2 = alloc_rows(max_rows, c->hidden_dim);
    s->rope_freq = alloc_rows(1, c->head_size / 2);
    if (!s->x || !s->xb || !s->xb2 || !s->q || !s->k || !s->v || !s->att || !s->hb ||
        !s->hb2 || !s->rope_freq) {
        llama_state_free(s);
        return PKV_ENOMEM;
    }
    for (uint32_t i = 0; i < c->head_size / 2; i++)
        s->rope_freq[i] = 1.0f / powf(ROPE_BASE, (float)(2 * i) / (float)c->head_size);
    return PKV_OK;
}

/* ---- forward -------------------------------------------------------------------- */

static void rmsnorm(float *o, const float *x, const float *w, uint32_t n)
{
    float ss = 0.0f;
    for (uint32_t j = 0; j < n; j++)
        ss += x[j] * x[j];
    ss /= (float)n;
    ss += RMS_EPS;
    ss = 1.0f / sqrtf(ss);
    for (uint32_t j = 0; j < n; j++)
        o[j] = w[j] * (ss * x[j]);
}

/* out[r][i] = sum_j w[i][j] * x[r][j] for rows r < n; w is [d_out][d_in]. Four rows
 * share each pass over a weight row (one accumulator each, index order), which is
 * what makes batched rows cheap without changing any row's value. */
static void matmul_batch(float *restrict out, const float *restrict x,
                         const float *restrict w, uint32_t n, uint32_t d_in,
                         uint32_t d_out)
{
    for (uint32_t i = 0; i < d_out; i++) {
        const float *wi = w + (size_t)i * d_in;
        uint32_t r = 0;
        for (; r + 4 <= n; r += 4) {
            const float *x0 = x + (size_t)r * d_in, *x1 = x0 + d_in, *x2 = x1 + d_in,
                        *x3 = x2 + d_in;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            for (uint32_t j = 0; j < d_in; j++) {
                float wj = wi[j];
                s0 += wj * x0[j];
                s1 += wj * x1[j];
                s2 += wj * x2[j];
                s3 += wj * x3[j];
            }
            out[(size_t)r * d_out + i] = s0;
            out[(size_t)(r + 1) * d_out + i] = s1;
            out[(size_t)(r + 2) * d_out + i] = s2;
            out[(size_t)(r + 3) * d_out + i] = s3;
        }
        for (; r < n; r++) {
            const float *xr = x + (size_t)r * d_in;
            float s = 0.0f;
            for (uint32_t j = 0; j < d_in; j++)
                s += wi[j] * xr[j];
            out[(size_t)r * d_out + i] = s;
        }
    }
}

/* matmul_rows for one row: four outputs per pass (one accumulator each, index
 * order, so the values equal matmul_rows'); the four chains hide the add latency
 * that a single running sum is bound by. */
static void matmul_one(float *restrict out, const float *restrict x,
                       const float *restrict w, uint32_t d_in, uint32_t d_out)
{
    uint32_t i = 0;
    for (; i + 4 <= d_out; i += 4) {
        const float *w0 = w + (size_t)i * d_in, *w1 = w0 + d_in, *w2 = w1 + d_in,
                    *w3 = w2 + d_in;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (uint32_t j = 0; j < d_in; j++) {
            float xj = x[j];
            s0 += w0[j] * xj;
            s1 += w1[j] * xj;
            s2 += w2[j] * xj;
            s3 += w3[j] * xj;
        }
        out[i] = s0;
        out[i + 1] = s1;
        out[i + 2] = s2;
        out[i + 3] = s3;
    }
    for (; i < d_out; i++) {
        const float *wi = w + (size_t)i * d_in;
        float s = 0.0f;
        for (uint32_t j = 0; j < d_in; j++)
            s += wi[j] * x[j];
        out[i] = s;
    }
}

static void matmul_rows(float *out, const float *x, const float *w, uint32_t n,
                        uint32_t d_in, uint32_t d_out)
{
    /* whole groups of four rows share weight passes; leftover rows go one by one */
    uint32_t n4 = n - n % 4;
    if (n4)
        matmul_batch(out, x, w, n4, d_in, d_out);
    for (uint32_t r = n4; r < n; r++)
        matmul_one(out + (size_t)r * d_out, x + (size_t)r * d_in, w, d_in, d_out);
}

/* Rotate adjacent pairs (2i, 2i+1) of every head of q [n_heads][hs] and
 * k [n_kv_heads][hs] by pos * freq[i]. */
static void rope(const llama_config *c, const float *freq, uint32_t pos, float *q,
                 float *k)
{
    const uint32_t hs = c->head_size;
    for (uint32_t i = 0; i < hs / 2; i++) {
        float val = (float)pos * freq[i];
        float fcr = cosf(val), fci = sinf(val);
        for (uint32_t h = 0; h < c->n_heads; h++) {
            float *p = q + (size_t)h * hs + 2 * i;
            float a = p[0], b = p[1];
            p[0] = a * fcr - b * fci;
            p[1] = a * fci + b * fcr;
        }
        for (uint32_t h = 0; h < c->n_kv_heads; h++) {
            float *p = k + (size_t)h * hs + 2 * i;
            float a = p[0], b = p[1];
            p[0] = a * fcr - b * fci;
            p[1] = a * fci + b * fcr;
        }
    }
}

pkv_status llama_forward(const llama_model *m, llama_state *s, uint32_t n,
                         const uint32_t *tokens, const uint32_t *pos, llama_attn_fn attn,
                         void *attn_ctx, uint32_t first_logit, float *logits)
{
    const llama_config *c = &m->cfg;
    const llama_weights *w = &m->w;
    const uint32_t d = c->dim, kv = c->kv_dim, hid = c->hidden_dim;
    if (n == 0 || n > s->max_rows || first_logit > n)
        return PKV_EINVAL;
    for (uint32_t r = 0; r < n; r++) {
        if (tokens[r] >= c->vocab_size)
            return PKV_EINVAL;
        memcpy(s->x + (size_t)r * d, w->token_embedding + (size_t)tokens[r] * d,
               d * sizeof(float));
    }
    for (uint32_t l = 0; l < c->n_layers; l++) {
        /* attention block */
        for (uint32_t r = 0; r < n; r++)
            rmsnorm(s->xb + (size_t)r * d, s->x + (size_t)r * d, w->rms_att + (size_t)l * d,
                    d);
        matmul_rows(s->q, s->xb, w->wq + (size_t)l * d * d, n, d, d);
        matmul_rows(s->k, s->xb, w->wk + (size_t)l * kv * d, n, d, kv);
        matmul_rows(s->v, s->xb, w->wv + (size_t)l * kv * d, n, d, kv);
        for (uint32_t r = 0; r < n && !s->rope_in_attn; r++)
            rope(c, s->rope_freq, pos[r], s->q + (size_t)r * d, s->k + (size_t)r * kv);
        pkv_status st = attn(attn_ctx, l, n, s->q, s->k, s->v, s->att);
        if (st != PKV_OK)
            return st;
        matmul_rows(s->xb2, s->att, w->wo + (size_t)l * d * d, n, d, d);
        for (size_t i = 0; i < (size_t)n * d; i++)
            s->x[i] += s->xb2[i];

        /* feed-forward block: w2 . (silu(w1 . xb) * (w3 . xb)) */
        for (uint32_t r = 0; r < n; r++)
            rmsnorm(s->xb + (size_t)r * d, s->x + (size_t)r * d, w->rms_ffn + (size_t)l * d,
                    d);
        matmul_rows(s->hb, s->xb, w->w1 + (size_t)l * hid * d, n, d, hid);
        matmul_rows(s->hb2, s->xb, w->w3 + (size_t)l * hid * d, n, d, hid);
        for (size_t i = 0; i < (size_t)n * hid; i++) {
            float g = s->hb[i];
            g *= 1.0f / (1.0f + expf(-g));
            s->hb[i] = g * s->hb2[i];
        }
        matmul_rows(s->xb2, s->hb, w->w2 + (size_t)l * d * hid, n, hid, d);
        for (size_t i = 0; i < (size_t)n * d; i++)
            s->x[i] += s->xb2[i];
    }
    const uint32_t nl = n - first_logit;
    if (nl == 0)
        return PKV_OK;
    for (uint32_t r = first_logit; r < n; r++)
        rmsnorm(s->xb + (size_t)r * d, s->x + (size_t)r * d, w->rms_final, d);
    matmul_rows(logits, s->xb + (size_t)first_logit * d, w->wcls, nl, d, c->vocab_size);
    return PKV_OK;
}

/* ---- sampler -------------------------------------------------------------------- */

pkv_status llama_sampler_init(llama_sampler *s, uint32_t vocab, float temperature,
                              float topp)
{
    memset(s, 0, sizeof *s);
    if (vocab == 0 || !(temperature >= 0.0f) || !isfinite(temperature) || !isfinite(topp))
        return PKV_EINVAL;
    s->vocab = vocab;
    s->temperature = temperature;
    s->topp = topp;
    s->prob = calloc(vocab, sizeof *s->prob);
    s->idx = calloc(vocab, sizeof *s->idx);
    if (!s->prob || !s->idx) {
        llama_sampler_free(s);
        return PKV_ENOMEM;
    }
    return PKV_OK;
}

void llama_sampler_free(llama_sampler *s)
{
    if (!s)
        return;
    free(s->prob);
    free(s->idx);
    memset(s, 0, sizeof *s);
}

/* a comes before b in the nucleus order: larger probability, then smaller id */
static bool before(const float *p, uint32_t a, uint32_t b)
{
    return p[a] > p[b] || (p[a] == p[b] && a < b);
}

static void sift_down(uint32_t *h, uint32_t n, uint32_t i, const float *p)
{
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= n)
            return;
        /* a max-heap of the *last* element of the order, so the sort ends ascending
         * in "before" order */
        if (c + 1 < n && before(p, h[c], h[c + 1]))
            c++;
        if (!before(p, h[i], h[c]))
            return;
        uint32_t t = h[i];
        h[i] = h[c];
        h[c] = t;
        i = c;
    }
}

/* Heap sort of ids by (probability desc, id asc): in place, no allocation (qsort
 * may allocate), deterministic because the order is total. */
static void sort_by_prob(uint32_t *ids, uint32_t n, const float *p)
{
    if (n < 2)
        return;
    for (uint32_t i = n / 2; i-- > 0;)
        sift_down(ids, n, i, p);
    for (uint32_t end = n - 1; end > 0; end--) {
        uint32_t t = ids[0];
        ids[0] = ids[end];
        ids[end] = t;
        sift_down(ids, end, 0, p);
    }
}

uint32_t llama_sample(llama_sampler *s, const float *logits, float coin)
{
    const uint32_t n = s->vocab;
    if (s->temperature == 0.0f) {
        uint32_t best = 0;
        for (uint32_t i = 1; i < n; i++)
            if (logits[i] > logits[best])
                best = i;
        return best;
    }
    float *p = s->prob;
    float mx = -INFINITY;
    for (uint32_t i = 0; i < n; i++) {
        p[i] = logits[i] / s->temperature;
        if (p[i] > mx)
            mx = p[i];
    }
    float sum = 0.0f;
    for (uint32_t i = 0; i < n; i++) {
        p[i] = expf(p[i] - mx);
        sum += p[i];
    }
    for (uint32_t i = 0; i < n; i++)
        p[i] /= sum;

    if (s->topp <= 0.0f || s->topp >= 1.0f) {
        float cdf = 0.0f;
        for (uint32_t i = 0; i < n; i++) {
            cdf += p[i];
            if (coin < cdf)
                return i;
        }
        return n - 1;   /* rounding left the total a hair under the coin */
    }
    /* Nucleus: tokens below (1 - topp) / (n - 1) cannot be in the smallest set whose
     * mass exceeds topp, so they are dropped before sorting. */
    const float cutoff = (1.0f - s->topp) / (float)(n > 1 ? n - 1 : 1);
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (p[i] >= cutoff)
            s->idx[m++] = i;
    if (m == 0) {
        /* a near-uniform distribution with a tiny topp: the most likely token */
        uint32_t best = 0;
        for (uint32_t i = 1; i < n; i++)
            if (p[i] > p[best])
                best = i;
        return best;
    }
    sort_by_prob(s->idx, m, p);
    float cum = 0.0f;
    uint32_t last = m - 1;
    for (uint32_t i = 0; i < m; i++) {
        cum += p[s->idx[i]];
        if (cum > s->topp) {
            last = i;
            break;
        }
    }
    float r = coin * cum;
    float cdf = 0.0f;
    for (uint32_t i = 0; i <= last; i++) {
        cdf += p[s->idx[i]];
        if (r < cdf)
            return s->idx[i];
    }
    return s->idx[last];
}

/*
 * quality/synthetic.c - `pagedkv quality --synthetic` (docs/tools.md, "pagedkv quality"): what each
 * storage dtype costs in attention output alone, no model.
 *
 * Owns: the synthetic q/K/V (with their outlier channels), its run per dtype and path,
 * and its table. Does not own: the options, the rows' plan, the JSON and the bar chart
 * (quality/quality.c, through quality.h), the rounding (pkv_dtype_round_row), the
 * reference (pkv_attention_reference). Uses only the public API.
 *
 * One llama3-8b layer (h 32, g 8, d 128) of --ctx positions, one causal prefill per
 * dtype and path. q ~ q_scale * N(0, 1); V ~ N(0, 1); K ~ N(0, 1) except --outliers
 * channels per group (the same channels in every group and position, drawn from the
 * seed), which hold sign_c * scale * (1 + 0.25 N(0, 1)): a few large channels of
 * near-constant sign, as real keys have (KIVI, KVQuant). They set their 32-value
 * block's scale, so the other 31 values of that block lose precision. Per dtype: the
 * relative RMS rounding error of K and V, the reference output with rounded K alone,
 * rounded V alone and both, and the engine's output against the reference on
 * unrounded rows (everything) and on rounded rows (the kernel alone: 0 to ~1e-7 on the
 * exact path; the integer path's own rounding); all relative to max |reference
 * output| on unrounded rows.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "quality/quality.h"

#define CMD "quality"

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dull;
}

static double rng_unit(uint64_t *s) /* (0, 1) */
{
    return ((double)(rng_next(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double rng_normal(uint64_t *s) /* Box-Muller */
{
    return sqrt(-2.0 * log(rng_unit(s))) * cos(6.283185307179586 * rng_unit(s));
}

static double max_diff(const float *a, const float *b, size_t n)
{
    double m = 0;   /* compares, not fmax() (generate.c's check_rows); a NaN shows */
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - (double)b[i]);
        m = e > m || isnan(e) ? e : m;
    }
    return m;
}

static double rms_rel(const float *x, const float *y, size_t n)
{
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        e += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        s += (double)x[i] * x[i];
    }
    return s > 0 ? sqrt(e / s) : 0;
}

static void round_rows(pkv_dtype dt, uint32_t d, size_t rows, const float *src, float *dst)
{
    for (size_t r = 0; r < rows; r++)
        pkv_dtype_round_row(dt, d, src + r * d, dst + r * d);
}

int quality_run_synthetic(q_result *R)
{
    const q_opts *o = R->o;
    const uint32_t h = 32, g = 8, d = 128, T = o->ctx;
    const size_t nq = (size_t)T * h * d, nk = (size_t)T * g * d;
    /* zeroed: gcc 12 cannot see that the fill loops below cover q, K and V (in its own
     * file this function warns -Wmaybe-uninitialized at the first reference call) */
    float *q = calloc(nq, sizeof *q), *K = calloc(nk, sizeof *K), *V = calloc(nk, sizeof *V);
    float *Kr = malloc(nk * sizeof *Kr), *Vr = malloc(nk * sizeof *Vr);
    float *raw = malloc(nq * sizeof *raw), *ref = malloc(nq * sizeof *ref);
    float *out = malloc(nq * sizeof *out);
    pkv_engine *e = NULL;
    pkv_session *s = NULL;
    int rc = CLI_OK;
    if (!q || !K || !V || !Kr || !Vr || !raw || !ref || !out) {
        rc = cli_fail(CMD, "out of memory for %u positions", T);
        goto done;
    }
    uint64_t seed = o->seed * 0x9e3779b97f4a7c15ull + 0x5157ull;
    /* the outlier channels: distinct, drawn from the seed, each with its sign */
    double sign[MAX_OUTLIERS];
    for (uint32_t i = 0; i < o->outliers; i++) {
        uint32_t ch;
        bool dup;
        do {
            ch = (uint32_t)(rng_next(&seed) % d);
            dup = false;
            for (uint32_t j = 0; j < i; j++)
                dup |= R->outlier_ch[j] == ch;
        } while (dup);
        R->outlier_ch[i] = ch;
        sign[i] = rng_next(&seed) & 1 ? 1.0 : -1.0;
    }
    for (size_t i = 0; i < nq; i++)
        q[i] = (float)(o->q_scale * rng_normal(&seed));
    for (size_t i = 0; i < nk; i++) {
        V[i] = (float)rng_normal(&seed);
        K[i] = (float)rng_normal(&seed);
    }
    for (size_t row = 0; row < (size_t)T * g; row++)
        for (uint32_t i = 0; i < o->outliers; i++)
            K[row * d + R->outlier_ch[i]] =
                (float)(sign[i] * o->outlier_scale * (1.0 + 0.25 * rng_normal(&seed)));
    pkv_status ps = pkv_attention_reference(T, h, g, d, 0, 0.0f, NULL, q, K, V, raw);
    if (ps != PKV_OK) {
        rc = cli_fail(CMD, "pkv_attention_reference: %s", pkv_status_str(ps));
        goto done;
    }
    R->max_out = 0;
    for (size_t i = 0; i < nq; i++) {   /* a compare, not fmax(): generate.c's check_rows */
        const double v = fabs((double)raw[i]);
        R->max_out = v > R->max_out ? v : R->max_out;
    }
    const double mo = R->max_out > 0 ? R->max_out : 1.0;
    const pkv_config cfg = cli_config(1, h, g, d, o->block_tokens, PKV_F32, o->threads);
    if (cli_check_limits(CMD, &cfg, NULL) != CLI_OK) {
        rc = CLI_USAGE;
        goto done;
    }
    quality_plan_rows(R, &cfg, g, 1, d);
    for (uint32_t i = 0; i < R->n_rows; i++) {
        q_row *r = &R->rows[i];
        if (!r->available)
            continue;
        round_rows(r->dt, d, (size_t)T * g, K, Kr);
        round_rows(r->dt, d, (size_t)T * g, V, Vr);
        r->k_rms = rms_rel(K, Kr, nk);
        r->v_rms = rms_rel(V, Vr, nk);
        const q_row *exact = i > 0 && r->path ? &R->rows[i - 1] : NULL;
        if (exact && exact->dt == r->dt && exact->available) {
            /* the references do not depend on the path */
            r->err_k_only = exact->err_k_only;
            r->err_v_only = exact->err_v_only;
        } else if (r->dt != PKV_F32) {
            ps = pkv_attention_reference(T, h, g, d, 0, 0.0f, NULL, q, Kr, V, ref);
            r->err_k_only = max_diff(ref, raw, nq) / mo;
            if (ps == PKV_OK)
                ps = pkv_attention_reference(T, h, g, d, 0, 0.0f, NULL, q, K, Vr, ref);
            r->err_v_only = max_diff(ref, raw, nq) / mo;
        }
        if (ps == PKV_OK)
            ps = pkv_attention_reference(T, h, g, d, 0, 0.0f, NULL, q, Kr, Vr, ref);
        if (ps != PKV_OK) {
            rc = cli_fail(CMD, "pkv_attention_reference: %s", pkv_status_str(ps));
            goto done;
        }
        r->err_ref_both = max_diff(ref, raw, nq) / mo;
        pkv_config c = cfg;
        c.kv_dtype = r->dt;
        c.quant_dot = r->path;
        ps = quality_open_engine(R, &c, &e, &s);
        if (ps == PKV_OK)
            ps = pkv_prefill(s, 0, T, q, K, V, out);
        quality_close_engine(&e, &s);
        if (ps != PKV_OK) {
            rc = cli_fail(CMD, "%s %s prefill: %s", pkv_dtype_name(r->dt),
                          quality_path_name(r->path), pkv_status_str(ps));
            goto done;
        }
        r->err_raw = max_diff(out, raw, nq) / mo;
        r->err_rounded = max_diff(out, ref, nq) / mo;
    }
done:
    quality_close_engine(&e, &s);
    free(q);
    free(K);
    free(V);
    free(Kr);
    free(Vr);
    free(raw);
    free(ref);
    free(out);
    return rc;
}

void quality_print_synthetic(const q_result *R)
{
    const q_opts *o = R->o;
    printf("pagedkv quality %s --synthetic: one llama3-8b layer (h 32, g 8, d 128), %u "
           "positions, causal prefill; kernels %s\n", pkv_version(), o->ctx,
           R->isa ? R->isa : "?");
    printf("q ~ %g N(0,1); V ~ N(0,1); K ~ N(0,1) except %u channel%s (", o->q_scale,
           o->outliers, o->outliers == 1 ? "" : "s");
    for (uint32_t i = 0; i < o->outliers; i++)
        printf("%s%u", i ? " " : "", R->outlier_ch[i]);
    printf(") of every group and position: +-%g x (1 + 0.25 N(0,1)); seed %llu\n",
           o->outlier_scale, (unsigned long long)o->seed);
    printf("errors: max |diff| over max |reference on unrounded rows| = %.4g\n\n", R->max_out);
    printf("%-5s %-8s %7s | %9s %9s | %10s %10s %10s | %11s %11s\n", "dtype", "path",
           "B/token", "K rms", "V rms", "K rounded", "V rounded", "both", "engine/raw",
           "engine/rnd");
    for (uint32_t i = 0; i < R->n_rows; i++) {
        const q_row *r = &R->rows[i];
        printf("%-5s %-8s %7llu | ", pkv_dtype_name(r->dt), quality_path_name(r->path),
               (unsigned long long)r->bytes_per_token);
        if (!r->available) {
            printf("unavailable: %s\n", r->why);
            continue;
        }
        printf("%9.3g %9.3g | %10.3g %10.3g %10.3g | %11.3g %11.3g\n", r->k_rms, r->v_rms,
               r->err_k_only, r->err_v_only, r->err_ref_both, r->err_raw, r->err_rounded);
    }
    printf("\nK rms, V rms: ||round_row(x) - x|| / ||x|| of the cached rows. K/V rounded, both:\n"
           "the reference output with only K, only V, or both rounded (what the format\n"
           "alone costs). engine/raw: the cache's output against the reference on unrounded\n"
           "rows (everything); engine/rnd: against the reference on the rounded rows (the\n"
           "kernel alone: ~1e-7 on the exact path; the integer path's own rounding).\n");
}

/*
 * test_kernels.c - the SIMD decode kernels and row stores against the scalar reference
 * (kernels/ref.c, dtype.c) and the double-precision reference (testutil).
 *
 * Kernels are called directly on page buffers built here: every invalid row of the
 * last page is NaN (a kernel that reads one produces NaN), and the page of the last
 * group ends at a PROT_NONE guard page (a kernel that reads past a row's end faults;
 * Check reports the signal as a failure). Tolerances are the bound of
 * docs/numerics.md, computed per case from the data.
 *
 * Test cases: "kernels" tests the tables of this run (PKV_FORCE_ISA=isa: that one; unset:
 * every one the host runs); meson registers it once per ISA built, and an ISA the host
 * lacks is reported as SKIP (exit 77 from pkvt_run), never passed. "dispatch" checks the
 * choice of table against /proc/cpuinfo.
 */
#include "internal.h"
#include "base/quant.h"
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* The kernels this run tests, filled by main() before any test runs (Check forks
 * after that, so every test sees them): with PKV_FORCE_ISA=isa only that table
 * (meson registers kernels-scalar, kernels-avx2, kernels-avx2vnni, kernels-avx512,
 * kernels-avx512vnni, and pkvt_run turns an ISA the host lacks into a skip), else every
 * table built here that the host runs. all[]: in the order scalar, avx2, avx2vnni,
 * avx512, avx512vnni; simd_tables[]: the non-scalar ones. */
#define N_SIMD_MAX 4
static const pkvi_kernels *all[1 + N_SIMD_MAX];
static size_t n_all;
static const pkvi_kernels *simd_tables[N_SIMD_MAX];
static size_t N_SIMD;

static const pkv_dtype dtypes[] = {PKV_F32, PKV_F16, PKV_BF16};

#define U 0x1p-24 /* unit roundoff of f32 */

/* A table under test must run here: main() only picks runnable ones, so this failing
 * means the dispatcher changed its mind between main() and the test. */
static bool usable(const pkvi_kernels *k, const char *test)
{
    ck_assert_msg(pkvi_isa_supported(k->isa), "%s: %s kernels under test but not runnable",
                  test, k->isa);
    return true;
}

/* ---- page buffers --------------------------------------------------------------------- */

/* A buffer of `bytes` whose end touches a PROT_NONE page. */
typedef struct {
    void *map;
    size_t map_bytes;
    unsigned char *p;
} guarded;

static guarded guarded_alloc(size_t bytes)
{
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    const size_t body = (bytes + pg - 1) / pg * pg;
    guarded g;
    g.map_bytes = body + pg;
    g.map = mmap(NULL, g.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ck_assert_msg(g.map != MAP_FAILED, "mmap of %zu bytes failed", g.map_bytes);
    ck_assert_int_eq(mprotect((char *)g.map + body, pg, PROT_NONE), 0);
    g.p = (unsigned char *)g.map + body - bytes;
    return g;
}

static void guarded_free(guarded *g)
{
    munmap(g->map, g->map_bytes);
}

/* A layer of n tokens for `g` groups: pages[] as the kernel sees them, plus the K/V
 * values as stored (rounded to dtype) in f32 for the references: K, V [n][g][d]. */
typedef struct {
    pkvi_kparams kp;
    uint32_t g, n, n_pages;
    guarded *bufs;
    const void **pages;
    float *K, *V;
} layer;

static void layer_build(layer *L, pkvt_rng *r, uint32_t g, uint32_t hg, uint32_t d, uint32_t bt,
                        pkv_dtype dt, uint32_t n, float kv_range)
{
    const size_t rb = pkv_row_bytes(dt, d); /* block types (Q8, Q4) included */
    memset(&L->kp, 0, sizeof L->kp); /* fields this test does not set: dv = d, no softcap */
    L->kp.head_dim = d;
    L->kp.block_tokens = bt;
    L->kp.hg = hg;
    L->kp.dtype = dt;
    L->kp.scale = 1.0f / sqrtf((float)d);
    L->kp.group_stride = 2 * (size_t)bt * rb;
    L->kp.v_offset = (size_t)bt * rb;
    L->g = g;
    L->n = n;
    L->n_pages = (n + bt - 1) / bt;
    L->bufs = pkvt_alloc(L->n_pages * sizeof *L->bufs);
    L->pages = pkvt_alloc(L->n_pages * sizeof *L->pages);
    L->K = pkvt_alloc((size_t)n * g * d * sizeof(float));
    L->V = pkvt_alloc((size_t)n * g * d * sizeof(float));
    const size_t page_bytes = (size_t)g * L->kp.group_stride;
    float *row = pkvt_alloc((size_t)d * sizeof(float));
    for (uint32_t p = 0; p < L->n_pages; p++) {
        L->bufs[p] = guarded_alloc(page_bytes);
        unsigned char *page = L->bufs[p].p;
        memset(page, 0xff, page_bytes); /* all-ones is NaN in f32, f16 and bf16, and a
                                         * NaN scale in Q8 and Q4 */
        L->pages[p] = page;
        for (uint32_t t = p * bt; t < n && t < (p + 1) * bt; t++)
            for (uint32_t gi = 0; gi < g; gi++)
                for (int kv = 0; kv < 2; kv++) {
                    pkvt_fill(r, row, d, -kv_range, kv_range);
                    unsigned char *dst = page + gi * L->kp.group_stride +
                                         (kv ? L->kp.v_offset : 0) + (size_t)(t - p * bt) * rb;
                    pkvi_store_row(dt, dst, row, d);
                    float *ref = (kv ? L->V : L->K) + ((size_t)t * g + gi) * d;
                    pkvi_load_row(dt, ref, dst, d);
                }
    }
    free(row);
}

static void layer_free(layer *L)
{
    for (uint32_t p = 0; p < L->n_pages; p++)
        guarded_free(&L->bufs[p]);
    free(L->bufs);
    free(L->pages);
    free(L->K);
    free(L->V);
}

static uint32_t last_tokens(const layer *L)
{
    return L->n - (L->n_pages - 1) * L->kp.block_tokens;
}

/* One kernel call for one group (q [hg][d], m [hg], l [hg], acc [hg][d]). */
static void attend1(const pkvi_kernels *k, const pkvi_kparams *kp, const void *const *pages,
                    uint32_t n_pages, uint32_t last, uint32_t group, const float *q, float *m,
                    float *l, float *acc)
{
    const pkvi_heads x = {.q = q, .m = m, .l = l, .acc = acc, .q_stride = 0, .st_stride = 0};
    k->attend(kp, pages, n_pages, last, group, 1, &x);
}

/* Run kernel k over the whole layer for `group` from the empty state; out [hg][d]. */
static void run_kernel(const pkvi_kernels *k, const layer *L, uint32_t group, const float *q,
                       float *out)
{
    const uint32_t hg = L->kp.hg, d = L->kp.head_dim;
    float *m = pkvt_alloc(hg * sizeof(float)), *l = pkvt_alloc(hg * sizeof(float));
    float *acc = pkvt_alloc((size_t)hg * d * sizeof(float));
    for (uint32_t h = 0; h < hg; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    attend1(k, &L->kp, L->pages, L->n_pages, last_tokens(L), group, q, m, l, acc);
    for (uint32_t h = 0; h < hg; h++)
        for (uint32_t c = 0; c < d; c++)
            out[(size_t)h * d + c] = acc[(size_t)h * d + c] / l[h];
    free(m);
    free(l);
    free(acc);
}

/* ---- the error bound of docs/numerics.md ---------------------------------------------
 * |out - exact| <= max|V| * (2*D + 2*E + (3n + 3T + 1) u), with
 *   D = (K + 1) u S:  S = max over heads and tokens of scale * sum_c |q_c k_c|, K the
 *       additions on the dot's longest path (d for the scalar loop, d/8 + 3 for AVX2,
 *       d/16 + 4 for AVX-512: bounded here by d + 4 for every variant),
 *   E = 4u: the relative error of exp (2 ulp),
 *   T the tiles folded. Two implementations differ by at most twice that. */
/* The magnitudes the bounds take, over the tokens and heads of one group: S (above)
 * and max|V|. */
typedef struct {
    double S, vmax;
} magnitudes;

static magnitudes magnitudes_of(const layer *L, uint32_t group, const float *q)
{
    const uint32_t hg = L->kp.hg, d = L->kp.head_dim, n = L->n;
    magnitudes m = {0, 0};
    for (uint32_t t = 0; t < n; t++) {
        const float *kt = L->K + ((size_t)t * L->g + group) * d;
        const float *vt = L->V + ((size_t)t * L->g + group) * d;
        for (uint32_t h = 0; h < hg; h++) {
            const float *qh = q + (size_t)h * d;
            double s = 0;
            for (uint32_t c = 0; c < d; c++)
                s += fabs((double)qh[c] * kt[c]);
            m.S = fmax(m.S, s * L->kp.scale);
        }
        for (uint32_t c = 0; c < d; c++)
            m.vmax = fmax(m.vmax, fabs((double)vt[c]));
    }
    return m;
}

static double bound(const layer *L, uint32_t group, const float *q)
{
    const uint32_t d = L->kp.head_dim, n = L->n;
    const magnitudes m = magnitudes_of(L, group, q);
    const uint32_t bt = L->kp.block_tokens;
    const uint32_t tiles_per_page = (bt + PKVI_TILE - 1) / PKVI_TILE;
    const double T = (double)(L->n_pages - 1) * tiles_per_page +
                     (last_tokens(L) + PKVI_TILE - 1) / PKVI_TILE;
    const double D = (d + 4 + 1) * U * m.S, E = 4 * U;
    return m.vmax * (2 * D + 2 * E + (3.0 * n + 3 * T + 1) * U);
}

/* What the exact Q8/Q4 scores of avx512vnni add to it where every block of the row is
 * whole (docs/numerics.md section 4): q held per block as integers times 2^e moves a
 * score by at most the limbs' budget, 2^-22 (a head and tile that could go past it is
 * scored from f32 q), so the output by (e^(2 2^-22) - 1) max|V|. 0 for every other
 * table, dtype or shape. */
static bool uses_limbs(const pkvi_kernels *k, const layer *L)
{
    const pkv_dtype dt = L->kp.dtype;
    return strcmp(k->isa, "avx512vnni") == 0 && (dt == PKV_Q8 || dt == PKV_Q4) &&
           !L->kp.quant_dot && L->kp.head_dim % 32 == 0;
}

static double limb_bound(const pkvi_kernels *k, const layer *L, uint32_t group,
                         const float *q)
{
    if (!uses_limbs(k, L))
        return 0;
    const magnitudes m = magnitudes_of(L, group, q);
    return expm1(2 * 0x1p-22) * m.vmax;
}

static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        const double x = fabs((double)a[i] - b[i]);
        if (!(x <= m))
            m = isnan(x) ? INFINITY : x;
    }
    return m;
}

/* ---- SIMD vs scalar over the STYLE.md shape table ------------------------------------ */

/* Largest observed |SIMD - scalar| / bound, per SIMD table (reported, not asserted). */
static double worst_ratio[N_SIMD_MAX];

static void one_shape(pkvt_rng *r, uint64_t seed, uint32_t d, uint32_t hg, uint32_t bt,
                      uint32_t n, pkv_dtype dt, bool *ran)
{
    const uint32_t g = 2, group = 1; /* the last group: its V rows end at the guard */
    layer L;
    layer_build(&L, r, g, hg, d, bt, dt, n, 1.0f);
    float *q = pkvt_alloc((size_t)hg * d * sizeof(float));
    pkvt_fill(r, q, (size_t)hg * d, -2.0f, 2.0f);
    float *ref = pkvt_alloc((size_t)hg * d * sizeof(float));
    float *out = pkvt_alloc((size_t)hg * d * sizeof(float));
    run_kernel(&pkvi_kernels_scalar, &L, group, q, ref);
    const double tol = 2 * bound(&L, group, q);
    for (size_t i = 0; i < N_SIMD; i++) {
        const pkvi_kernels *k = simd_tables[i];
        if (!pkvi_isa_supported(k->isa))
            continue;
        ran[i] = true;
        memset(out, 0, (size_t)hg * d * sizeof(float));
        run_kernel(k, &L, group, q, out);
        const double err = max_abs_diff(out, ref, (size_t)hg * d);
        if (err / tol > worst_ratio[i])
            worst_ratio[i] = err / tol;
        ck_assert_msg(err <= tol,
                      "%s vs scalar: d=%u hg=%u bt=%u n=%u %s: max|diff| %g > bound %g "
                      "(seed 0x%llx)",
                      k->isa, d, hg, bt, n, pkv_dtype_name(dt), err, tol,
                      (unsigned long long)seed);
    }
    free(q);
    free(ref);
    free(out);
    layer_free(&L);
}

START_TEST(shapes_vs_scalar)
{
    static const uint32_t ds[] = {1, 3, 17, 64, 80, 128, 256};
    static const uint32_t bts[] = {1, 2, 16, 64};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed);
    bool ran[N_SIMD_MAX] = {false};
    const bool quick = pkvt_quick();
    uint64_t cases = 0;
    for (size_t di = 0; di < sizeof ds / sizeof ds[0]; di++)
        for (uint32_t hg = 1; hg <= 8; hg++)
            for (size_t bi = 0; bi < sizeof bts / sizeof bts[0]; bi++) {
                const uint32_t bt = bts[bi];
                const uint32_t lens[] = {1, bt - 1, bt, bt + 1, 3 * bt + bt / 2 + 1};
                for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
                    if (lens[li] == 0)
                        continue;
                    const pkv_dtype dt = dtypes[(di + hg + bi + li) % 3];
                    /* every combination with one dtype (rotating); all three dtypes
                     * for the group sizes that matter most (1, 4, 5) */
                    const bool all_dt = hg == 1 || hg == 4 || hg == 5;
                    if (quick && pkvt_below(&r, 8) != 0)
                        continue;
                    for (size_t ti = 0; ti < 3; ti++) {
                        const pkv_dtype t = all_dt ? dtypes[ti] : dt;
                        one_shape(&r, seed, ds[di], hg, bt, lens[li], t, ran);
                        cases++;
                        if (!all_dt)
                            break;
                    }
                }
            }
    for (size_t i = 0; i < N_SIMD; i++) {
        ck_assert_msg(ran[i], "shapes_vs_scalar: %s never ran", simd_tables[i]->isa);
        printf("shapes_vs_scalar: %s: %llu shapes, largest |diff| / bound %.3g\n",
               simd_tables[i]->isa, (unsigned long long)cases, worst_ratio[i]);
    }
}
END_TEST

/* Large group sizes (up to PKVI_MAX_GROUP_HEADS) and odd ones around the blocking. */
START_TEST(many_heads)
{
    static const uint32_t hgs[] = {9, 13, 16, 17, 31, 64, 256};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x51);
    bool ran[N_SIMD_MAX] = {false};
    for (size_t i = 0; i < sizeof hgs / sizeof hgs[0]; i++)
        one_shape(&r, seed, i % 2 ? 24 : 40, hgs[i], 16, 37, dtypes[i % 3], ran);
    for (size_t i = 0; i < N_SIMD; i++)
        ck_assert_msg(ran[i], "many_heads: %s never ran", simd_tables[i]->isa);
}
END_TEST

/* ---- Q8 / Q4 pages, both paths (quant_dot 0 and 1), SIMD against scalar -----------
 * Exact path: bound() as for the other dtypes (the rows as stored are exact in f32).
 * Integer-dot path: both kernels compute the same int32 block dots of the same
 * quantized q (pkvi_quant_query); they differ only in the order of the f32 additions
 * of the block terms (dk*dq)*isum, which bound() covers with q replaced by its
 * dequantized value dq*qi (the magnitudes those terms carry). */
static void dequant_q(uint32_t hg, uint32_t d, const float *q, float *qd)
{
    int8_t qi[PKVI_MAX_HEAD_DIM];
    float qs[PKVI_MAX_HEAD_DIM / 32];
    for (uint32_t h = 0; h < hg; h++) {
        pkvi_quant_query(d, q + (size_t)h * d, qi, qs);
        for (uint32_t c = 0; c < d; c++)
            qd[(size_t)h * d + c] = qs[c / 32] * (float)qi[c];
    }
}

static double quant_worst[2][N_SIMD_MAX];

static void quant_shape(pkvt_rng *r, uint64_t seed, uint32_t d, uint32_t hg, uint32_t bt,
                        uint32_t n, pkv_dtype dt, uint32_t qdot, bool *ran)
{
    const uint32_t g = 2, group = 1;
    layer L;
    layer_build(&L, r, g, hg, d, bt, dt, n, 1.0f);
    L.kp.quant_dot = qdot;
    float *q = pkvt_alloc((size_t)hg * d * sizeof(float));
    float *qd = pkvt_alloc((size_t)hg * d * sizeof(float));
    pkvt_fill(r, q, (size_t)hg * d, -2.0f, 2.0f);
    if (pkvt_below(r, 3) == 0) /* outlier channels, as real q and K have */
        for (uint32_t i = 0; i < hg * d; i += 1 + pkvt_below(r, 20))
            q[i] *= 30.0f;
    dequant_q(hg, d, q, qd);
    float *ref = pkvt_alloc((size_t)hg * d * sizeof(float));
    float *out = pkvt_alloc((size_t)hg * d * sizeof(float));
    run_kernel(&pkvi_kernels_scalar, &L, group, q, ref);
    const double tol0 = 2 * bound(&L, group, qdot ? qd : q);
    for (size_t i = 0; i < N_SIMD; i++) {
        const pkvi_kernels *k = pkvi_kernels_for_dtype(simd_tables[i], dt);
        if (!pkvi_isa_supported(simd_tables[i]->isa))
            continue;
        ran[i] = true;
        const double tol = tol0 + limb_bound(k, &L, group, q);
        memset(out, 0, (size_t)hg * d * sizeof(float));
        run_kernel(k, &L, group, q, out);
        const double err = max_abs_diff(out, ref, (size_t)hg * d);
        if (err / tol > quant_worst[qdot][i])
            quant_worst[qdot][i] = err / tol;
        ck_assert_msg(err <= tol,
                      "%s vs scalar: d=%u hg=%u bt=%u n=%u %s quant_dot %u: max|diff| %g > "
                      "bound %g (seed 0x%llx)",
                      k->isa, d, hg, bt, n, pkv_dtype_name(dt), qdot, err, tol,
                      (unsigned long long)seed);
    }
    free(q);
    free(qd);
    free(ref);
    free(out);
    layer_free(&L);
}

START_TEST(quant_vs_scalar)
{
    static const uint32_t ds[] = {1, 3, 17, 31, 32, 33, 64, 80, 128, 256};
    static const uint32_t bts[] = {1, 2, 16, 64};
    static const pkv_dtype qt[] = {PKV_Q8, PKV_Q4};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x98);
    bool ran[N_SIMD_MAX] = {false};
    const bool quick = pkvt_quick();
    for (size_t di = 0; di < sizeof ds / sizeof ds[0]; di++)
        for (uint32_t hg = 1; hg <= 8; hg++)
            for (size_t bi = 0; bi < sizeof bts / sizeof bts[0]; bi++) {
                const uint32_t bt = bts[bi];
                const uint32_t lens[] = {1, bt + 1, 3 * bt + bt / 2 + 1};
                for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
                    if (pkvt_below(&r, quick ? 16 : 3) != 0)
                        continue;
                    for (uint32_t qdot = 0; qdot < 2; qdot++)
                        quant_shape(&r, seed, ds[di], hg, bt, lens[li], qt[(di + hg + li) % 2],
                                    qdot, ran);
                }
            }
    for (uint32_t i = 0; i < 9; i++) /* many heads, the tile blocking's odd counts */
        quant_shape(&r, seed, 40 + 8 * i, (uint32_t[]){9, 13, 16, 17, 31, 64, 256, 5, 7}[i],
                    16, 37, qt[i % 2], i % 2 ? 1 : (i / 2) % 2, ran);
    for (size_t i = 0; i < N_SIMD; i++) {
        ck_assert_msg(ran[i], "quant_vs_scalar: %s never ran", simd_tables[i]->isa);
        printf("quant_vs_scalar: %s: largest |diff| / bound: exact %.3g, integer dot %.3g\n",
               simd_tables[i]->isa, quant_worst[0][i], quant_worst[1][i]);
    }
}
END_TEST

/* The VNNI tables against the tables they extend, bit for bit (not merely within the
 * bound). avx512vnni (avx512vnni.c) forms the integer-dot scores with vpdpbusd, whose
 * isums are the same integers, and runs avx512.c's code for the rest: on every dtype
 * and path the two give the same bits, except the exact Q8/Q4 scores of whole blocks, which avx512vnni forms from integer limbs of q: other arithmetic
 * than avx512's f32 scores, held to their bound by quant_vs_scalar and limb_queries.
 * avx2vnni is avx2.c compiled again with a transposed tile for the integer-dot scores
 * of Q8/Q4 rows whose blocks are all whole: avx2's integers under the same arithmetic;
 * every other dtype, shape or path is avx2's code. neon_dotprod (neondot.c) is neon
 * with SDOT for the integer-dot block sums, the same integers, and neon's code for the
 * rest. Runs where this run tests a VNNI (or dot-product) table, against its partner (a
 * host with avx512vnni has avx512, one with avx2vnni has avx2, one with asimddp has
 * asimd). */
static const struct {
    const char *isa, *partner;
} vnni_pairs[] = {
    {"avx512vnni", "avx512"},
    {"avx2vnni", "avx2"},
    {"neon_dotprod", "neon"},
};

/* Whether VNNI table isa and its partner give the same bits for dtype dt, head_dim d and
 * path qdot. */
static bool vnni_pair_covers(const char *isa, pkv_dtype dt, uint32_t d, uint32_t qdot)
{
    const bool block = dt == PKV_Q8 || dt == PKV_Q4;
    if (qdot && !block)
        return false;
    /* avx512vnni's limbs against avx512's f32 scores */
    return !(strcmp(isa, "avx512vnni") == 0 && block && !qdot && d % 32 == 0);
}

START_TEST(vnni_same_bits)
{
    static const uint32_t ds[] = {3, 31, 32, 64, 96, 128, 130};
    static const uint32_t bts[] = {1, 16};
    static const pkv_dtype qt[] = {PKV_Q8, PKV_Q4, PKV_F32, PKV_F16, PKV_BF16};
    size_t compared = 0;
    for (size_t i = 0; i < N_SIMD; i++)
        for (size_t p = 0; p < sizeof vnni_pairs / sizeof vnni_pairs[0]; p++) {
            if (strcmp(simd_tables[i]->isa, vnni_pairs[p].isa) != 0)
                continue;
            const pkvi_kernels *plain = pkvi_kernels_named(vnni_pairs[p].partner);
            ck_assert_msg(plain && pkvi_isa_supported(vnni_pairs[p].partner),
                          "%s runs here but %s does not", vnni_pairs[p].isa,
                          vnni_pairs[p].partner);
            const uint64_t seed = pkvt_seed();
            pkvt_rng r;
            pkvt_rng_init(&r, seed ^ 0x7a);
            size_t pair_compared = 0;
            for (size_t di = 0; di < sizeof ds / sizeof ds[0]; di++)
                for (uint32_t hg = 1; hg <= 8; hg *= 2)
                    for (size_t bi = 0; bi < sizeof bts / sizeof bts[0]; bi++)
                        for (size_t ti = 0; ti < sizeof qt / sizeof qt[0] * 2; ti++) {
                            const uint32_t d = ds[di], bt = bts[bi], n = 3 * bt + 2;
                            const pkv_dtype dt = qt[ti / 2];
                            const uint32_t qdot = (uint32_t)(ti % 2);
                            if (!vnni_pair_covers(vnni_pairs[p].isa, dt, d, qdot))
                                continue;
                            layer L;
                            layer_build(&L, &r, 2, hg, d, bt, dt, n, 1.0f);
                            L.kp.quant_dot = qdot;
                            float *q = pkvt_alloc((size_t)hg * d * sizeof(float));
                            float *a = pkvt_alloc((size_t)hg * d * sizeof(float));
                            float *b = pkvt_alloc((size_t)hg * d * sizeof(float));
                            pkvt_fill(&r, q, (size_t)hg * d, -2.0f, 2.0f);
                            run_kernel(plain, &L, 1, q, a);
                            run_kernel(simd_tables[i], &L, 1, q, b);
                            ck_assert_msg(memcmp(a, b, (size_t)hg * d * sizeof(float)) == 0,
                                          "%s and %s differ: d=%u hg=%u bt=%u %s "
                                          "quant_dot %u (seed 0x%llx)",
                                          vnni_pairs[p].isa, vnni_pairs[p].partner, d, hg, bt,
                                          pkv_dtype_name(dt), qdot, (unsigned long long)seed);
                            pair_compared++;
                            free(q);
                            free(a);
                            free(b);
                            layer_free(&L);
                        }
            printf("vnni_same_bits: %s against %s, %zu shapes bitwise\n", vnni_pairs[p].isa,
                   vnni_pairs[p].partner, pair_compared);
            compared += pair_compared;
        }
    printf("vnni_same_bits: %zu shapes compared bitwise%s\n", compared,
           compared ? "" : " (this run tests no VNNI table)");
}
END_TEST

/* The exact Q8/Q4 scores from integer limbs of q (avx512vnni, whole blocks) on the
 * queries fixed point handles worst, against the scalar kernel, each head held to its
 * own f32 bound plus the limbs' budget: a block's largest value 10^7 times the rest
 * (which the limbs cannot hold: those heads are scored from f32 q), subnormal q (held
 * exactly), huge q, zero blocks, one value per block; and a NaN or an infinity in one
 * head, which makes that head NaN, as on the f32 path, and no other. test_quant's
 * adversarial search holds the same path to docs/numerics.md's bound against double precision. */
START_TEST(limb_queries)
{
    static const uint32_t ds[] = {32, 96, 128};
    static const pkv_dtype qt[] = {PKV_Q8, PKV_Q4};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x1b);
    size_t compared = 0;
    double limb_worst = 0;
    for (size_t i = 0; i < N_SIMD; i++)
        for (size_t di = 0; di < sizeof ds / sizeof ds[0]; di++)
            for (size_t ti = 0; ti < 2; ti++)
                for (int kind = 0; kind < 12; kind++) {
                    /* kinds 6..11: kinds 0..5 in a group of 21 heads, two runs of 16
                     * heads for the budget check, kind 0's heads mixed with plain ones */
                    const uint32_t d = ds[di], hg = kind < 6 ? 4 : 21;
                    layer L;
                    layer_build(&L, &r, 2, hg, d, 16, qt[ti], 37, 1.0f);
                    if (!uses_limbs(simd_tables[i], &L)) {
                        layer_free(&L);
                        continue;
                    }
                    float *q = pkvt_alloc((size_t)hg * d * sizeof(float));
                    float *ref = pkvt_alloc((size_t)hg * d * sizeof(float));
                    float *out = pkvt_alloc((size_t)hg * d * sizeof(float));
                    pkvt_fill(&r, q, (size_t)hg * d, -2.0f, 2.0f);
                    for (uint32_t c = 0; c < hg * d; c++)
                        switch (kind % 6) {
                        case 0: /* one large value per block, the rest 1e-7 of it (in the
                                 * 21 heads, every head but 1, 5, 9, .. and 17) */
                            if (hg == 4 || (c / d) % 4 != 1)
                                q[c] = c % 32 == (c / 32) % 32 ? 3e4f : q[c] * 3e-3f;
                            break;
                        case 1: /* subnormal q, and normal ones in head 1 */
                            q[c] = c / d == 1 ? q[c] : q[c] * 1e-39f;
                            break;
                        case 2: /* huge */
                            q[c] *= 1e20f;
                            break;
                        case 3: /* zero blocks, and a block of one value */
                            if ((c / 32) % 3 == 0)
                                q[c] = 0.0f;
                            else if ((c / 32) % 3 == 1 && c % 32 != 5)
                                q[c] = 0.0f;
                            break;
                        default: /* 4: a NaN in head 1, 5: an infinity in head 2 */
                            break;
                        }
                    const uint32_t nan_head = hg == 4 ? 1 : 18, inf_head = hg == 4 ? 2 : 3;
                    if (kind % 6 == 4)
                        q[nan_head * d + d - 3] = NAN;
                    if (kind % 6 == 5)
                        q[inf_head * d + 7] = -INFINITY;
                    run_kernel(&pkvi_kernels_scalar, &L, 1, q, ref);
                    run_kernel(simd_tables[i], &L, 1, q, out);
                    for (uint32_t h = 0; h < hg; h++) {
                        float *qh = q + (size_t)h * d;
                        if ((kind % 6 == 4 && h == nan_head) || (kind % 6 == 5 && h == inf_head)) {
                            for (uint32_t c = 0; c < d; c++)
                                ck_assert_msg(isnan(out[h * d + c]) && isnan(ref[h * d + c]),
                                              "%s: d=%u %s kind %d head %u: not NaN (seed "
                                              "0x%llx)",
                                              simd_tables[i]->isa, d, pkv_dtype_name(qt[ti]),
                                              kind, h, (unsigned long long)seed);
                            continue;
                        }
                        /* this head alone, against its own bound */
                        layer H1 = L;
                        H1.kp.hg = 1;
                        const double tol =
                            2 * bound(&H1, 1, qh) + limb_bound(simd_tables[i], &H1, 1, qh);
                        const double err =
                            max_abs_diff(out + (size_t)h * d, ref + (size_t)h * d, d);
                        ck_assert_msg(err <= tol,
                                      "%s: d=%u %s kind %d head %u: max|diff| %g > bound %g "
                                      "(seed 0x%llx)",
                                      simd_tables[i]->isa, d, pkv_dtype_name(qt[ti]), kind, h,
                                      err, tol, (unsigned long long)seed);
                        if (err / tol > limb_worst)
                            limb_worst = err / tol;
                        compared++;
                    }
                    free(q);
                    free(ref);
                    free(out);
                    layer_free(&L);
                }
    printf("limb_queries: %zu heads compared%s; largest |diff| / bound %.3g\n",
           compared, compared ? "" : " (no table here scores from limbs)", limb_worst);
}
END_TEST

/* The walks that prepare a call's q on their stack first (walk.h, 32 KiB: the integer
 * dot quantizes it, AVX2 bf16 and AVX-512 exact Q4 permute it, the VNNI tables' exact
 * Q8/Q4 cut it into limbs) walk a call too large for it in runs of groups, or of heads of
 * one group: one call over all groups, with such sizes, against
 * the scalar kernel group by group. A run indexing the wrong heads or states is far
 * outside the bound. */
START_TEST(prepared_q_scratch_runs)
{
    static const struct {
        uint32_t d, hg, g;
        pkv_dtype dt;
        uint32_t qdot;
    } cases[] = {
        /* quantized q (int8, d padded to 32): runs of 2 groups; of heads; of 1 head */
        {200, 64, 5, PKV_Q8, 1}, {1000, 40, 2, PKV_Q4, 1}, {4096, 9, 2, PKV_Q8, 1},
        /* permuted f32 q (AVX2 bf16, AVX-512 exact Q4): runs of 16 groups; of 40
         * heads; of 2 heads (d tail 8) */
        {128, 4, 20, PKV_BF16, 0}, {200, 64, 5, PKV_BF16, 0}, {4096, 9, 2, PKV_BF16, 0},
        {24, 3, 3, PKV_BF16, 0}, /* one 16-value block and a tail of 8 */
        {128, 4, 20, PKV_Q4, 0}, {200, 64, 5, PKV_Q4, 0}, {4096, 9, 2, PKV_Q4, 0},
        {40, 3, 3, PKV_Q4, 0}, /* one whole block and a tail of 8 */
        /* exact Q8/Q4 q as four limbs a value (avx512vnni, whole blocks): runs of 16
         * groups; of 32 heads; of 2 heads */
        {128, 4, 22, PKV_Q8, 0}, {256, 64, 3, PKV_Q8, 0}, {4096, 9, 2, PKV_Q8, 0},
    };
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x77);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const uint32_t d = cases[ci].d, hg = cases[ci].hg, g = cases[ci].g, bt = 4, n = 9;
        const pkv_dtype dt = cases[ci].dt;
        const bool qdot = cases[ci].qdot != 0;
        layer L;
        layer_build(&L, &r, g, hg, d, bt, dt, n, 1.0f);
        L.kp.quant_dot = qdot;
        const size_t sf = (size_t)hg * (d + 2);
        float *q = pkvt_alloc((size_t)g * hg * d * sizeof(float));
        float *qd = pkvt_alloc((size_t)hg * d * sizeof(float));
        float *st = pkvt_alloc((size_t)g * sf * sizeof(float));
        float *ref = pkvt_alloc((size_t)hg * d * sizeof(float));
        pkvt_fill(&r, q, (size_t)g * hg * d, -2.0f, 2.0f);
        for (size_t i = 0; i < N_SIMD; i++) {
            const pkvi_kernels *k = simd_tables[i];
            for (uint32_t gi = 0; gi < g; gi++) {
                float *b = st + gi * sf;
                for (uint32_t h = 0; h < hg; h++) {
                    b[h] = -INFINITY;
                    b[hg + h] = 0.0f;
                }
                memset(b + 2 * hg, 0, (size_t)hg * d * sizeof(float));
            }
            const pkvi_heads x = {.q = q, .m = st, .l = st + hg, .acc = st + 2 * hg,
                                  .q_stride = (size_t)hg * d, .st_stride = sf};
            k->attend(&L.kp, L.pages, L.n_pages, last_tokens(&L), 0, g, &x);
            for (uint32_t gi = 0; gi < g; gi++) {
                const float *qg = q + (size_t)gi * hg * d;
                run_kernel(&pkvi_kernels_scalar, &L, gi, qg, ref);
                if (qdot)
                    dequant_q(hg, d, qg, qd);
                const double tol =
                    2 * bound(&L, gi, qdot ? qd : qg) + limb_bound(k, &L, gi, qg);
                const float *b = st + gi * sf;
                double err = 0;
                for (uint32_t h = 0; h < hg; h++)
                    for (uint32_t c = 0; c < d; c++) {
                        const double e = fabs((double)b[2 * hg + (size_t)h * d + c] / b[hg + h] -
                                              ref[(size_t)h * d + c]);
                        err = e > err || e != e ? e : err;
                    }
                ck_assert_msg(err <= tol, "%s %s%s d=%u hg=%u group %u of %u: %g > %g "
                              "(seed 0x%llx)", k->isa, pkv_dtype_name(dt),
                              qdot ? " quant_dot" : "", d, hg, gi, g, err, tol,
                              (unsigned long long)seed);
            }
        }
        free(q);
        free(qd);
        free(st);
        free(ref);
        layer_free(&L);
    }
}
END_TEST

/* ---- walk and head independence: what decode.c's task split and prefill rely on ----
 * For every kernel: (a) one call over a range of groups leaves each group's state
 * exactly as one call per group does; (b) a call whose "group" stacks Q queries' heads
 * (hg' = Q * hg, q and state laid out as one group of hg' heads) leaves each head's
 * state exactly as Q separate calls do. */
static void init_states(float *st, uint32_t n_groups, size_t sf, uint32_t H, uint32_t d,
                        pkvt_rng *r)
{
    for (uint32_t i = 0; i < n_groups; i++) { /* non-empty states, as after some pages */
        float *b = st + i * sf;
        for (uint32_t h = 0; h < H; h++) {
            b[h] = pkvt_uniform(r, -1.0f, 3.0f);
            b[H + h] = pkvt_uniform(r, 1.0f, 9.0f);
        }
        pkvt_fill(r, b + 2 * H, (size_t)H * d, -2.0f, 2.0f);
    }
}

/* One call over g groups of Q stacked queries (Q * hg heads each) against Q * g calls
 * of hg heads, bitwise, for kernel k (a host that cannot run it: no check). */
static void check_stacked(const pkvi_kernels *k, pkvt_rng *r, uint64_t seed, uint32_t g,
                          uint32_t hg, uint32_t Q, uint32_t d, uint32_t bt, uint32_t n,
                          pkv_dtype dt, float softcap)
{
    layer L;
    layer_build(&L, r, g, hg, d, bt, dt, n, 2.0f);
    L.kp.softcap = softcap;
    const size_t sf = (size_t)hg * (d + 2), sfQ = (size_t)Q * sf;
    float *q = pkvt_alloc((size_t)g * Q * hg * d * sizeof(float)); /* [g][Q*hg][d] */
    pkvt_fill(r, q, (size_t)g * Q * hg * d, -2.0f, 2.0f);
    float *init = pkvt_alloc((size_t)g * sfQ * sizeof(float));
    init_states(init, g, sfQ, Q * hg, d, r);
    float *one = pkvt_alloc((size_t)g * sfQ * sizeof(float));
    float *sep = pkvt_alloc((size_t)g * sfQ * sizeof(float));
    float *st = pkvt_alloc(sf * sizeof(float));
    /* one call: all groups, Q*hg heads each */
    pkvi_kparams kpQ = L.kp;
    kpQ.hg = Q * hg;
    memcpy(one, init, (size_t)g * sfQ * sizeof(float));
    const pkvi_heads all_x = {.q = q, .m = one, .l = one + Q * hg,
                              .acc = one + 2 * (size_t)Q * hg,
                              .q_stride = (size_t)Q * hg * d, .st_stride = sfQ};
    k->attend(&kpQ, L.pages, L.n_pages, last_tokens(&L), 0, g, &all_x);
    /* per group, per query: hg heads, states copied out of and back into the stacked
     * layout */
    memcpy(sep, init, (size_t)g * sfQ * sizeof(float));
    for (uint32_t gi = 0; gi < g; gi++)
        for (uint32_t j = 0; j < Q; j++) {
            float *b = sep + gi * sfQ;
            const uint32_t HQ = Q * hg;
            memcpy(st, b + j * hg, hg * sizeof(float));
            memcpy(st + hg, b + HQ + j * hg, hg * sizeof(float));
            memcpy(st + 2 * hg, b + 2 * (size_t)HQ + (size_t)j * hg * d,
                   (size_t)hg * d * sizeof(float));
            attend1(k, &L.kp, L.pages, L.n_pages, last_tokens(&L), gi,
                    q + ((size_t)gi * HQ + (size_t)j * hg) * d, st, st + hg, st + 2 * hg);
            memcpy(b + j * hg, st, hg * sizeof(float));
            memcpy(b + HQ + j * hg, st + hg, hg * sizeof(float));
            memcpy(b + 2 * (size_t)HQ + (size_t)j * hg * d, st + 2 * hg,
                   (size_t)hg * d * sizeof(float));
        }
    ck_assert_msg(memcmp(one, sep, (size_t)g * sfQ * sizeof(float)) == 0,
                  "%s: %u groups x %u stacked queries in one call differ from separate "
                  "calls (hg=%u d=%u bt=%u n=%u %s softcap %g, seed 0x%llx)",
                  k->isa, g, Q, hg, d, bt, n, pkv_dtype_name(dt), (double)softcap,
                  (unsigned long long)seed);
    free(q);
    free(init);
    free(one);
    free(sep);
    free(st);
    layer_free(&L);
}

START_TEST(groups_and_stacked_heads)
{
    static const uint32_t hgs[] = {1, 2, 3, 4, 5, 8};
    static const uint32_t dims[] = {7, 16, 33, 64, 128};
    static const uint32_t bts[] = {1, 3, 16};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x6a);
    for (int cs = 0; cs < 24; cs++) {
        const uint32_t g = 1 + pkvt_below(&r, 4), hg = hgs[pkvt_below(&r, 6)];
        const uint32_t d = dims[pkvt_below(&r, 5)], bt = bts[pkvt_below(&r, 3)];
        const uint32_t n = 1 + pkvt_below(&r, 70), Q = 2 + pkvt_below(&r, 4);
        const pkv_dtype dt = dtypes[cs % 3];
        for (size_t ki = 0; ki < n_all; ki++) {
            const pkvi_kernels *k = all[ki];
            if (!pkvi_isa_supported(k->isa)) {
                if (cs == 0)
                    usable(k, "groups_and_stacked_heads");
                continue;
            }
            check_stacked(k, &r, seed, g, hg, Q, d, bt, n, dt, 0.0f);
        }
    }
}
END_TEST

/* The wide walk (walk.h, walk_wide: 16 or more heads a group, head_dim up to 256; the
 * tables with a wide tile score 16 heads in the lanes of a vector) against the narrow
 * one of the same table, bitwise, through check_stacked: head counts around the blocks
 * of 16 (a remainder scored narrow; runs of heads past walk_wide's scratch at 256), dims
 * with tails and at the limit (and past it: the narrow walk), pages of 1 to 32 rows,
 * last tiles of every length, softcap on and off. */
START_TEST(wide_stacked_heads)
{
    static const struct {
        uint32_t hg, Q;
    } heads[] = {{4, 4}, {1, 20}, {4, 8}, {1, 33}, {8, 6}, {4, 16}, {16, 16}, {5, 13}};
    static const uint32_t dims[] = {7, 16, 40, 128, 200, 256, 264};
    static const uint32_t bts[] = {1, 5, 16, 32};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x3d);
    for (uint32_t cs = 0; cs < 3 * 7 * 2; cs++) {
        const uint32_t hi = pkvt_below(&r, sizeof heads / sizeof heads[0]);
        const uint32_t hg = heads[hi].hg, Q = heads[hi].Q, d = dims[cs % 7];
        const uint32_t bt = bts[pkvt_below(&r, 4)], n = 1 + pkvt_below(&r, 3 * bt + 40);
        const uint32_t g = 1 + pkvt_below(&r, 3);
        const pkv_dtype dt = dtypes[(cs / 7) % 3];
        const float cap = cs % 2 ? 0.0f : 2.5f;
        for (size_t ki = 0; ki < n_all; ki++)
            if (pkvi_isa_supported(all[ki]->isa))
                check_stacked(all[ki], &r, seed, g, hg, Q, d, bt, n, dt, cap);
    }
}
END_TEST

/* ---- against the double reference: the numerics bound ---------------------------------- */

START_TEST(vs_double_reference)
{
    static const uint32_t lens[] = {1, 15, 16, 17, 100, 1000, 4096};
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0xd0);
    const uint32_t g = 2, hg = 4, d = 128, h = g * hg;
    double worst[3] = {0, 0, 0};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
        for (size_t di = 0; di < 3; di++) {
            const uint32_t n = lens[li];
            if (pkvt_quick() && n > 1000)
                continue;
            layer L;
            layer_build(&L, &r, g, hg, d, 16, dtypes[di], n, 1.0f);
            float *q = pkvt_alloc((size_t)h * d * sizeof(float));
            pkvt_fill(&r, q, (size_t)h * d, -2.0f, 2.0f);
            double *ref = pkvt_alloc((size_t)h * d * sizeof(double));
            /* K, V are already rounded, so the reference's rounding is the identity */
            pkvt_ref_decode(h, g, d, L.kp.scale, dtypes[di], n, q, L.K, L.V, ref);
            const float vmax = pkvt_maxabs(L.V, (size_t)n * g * d);
            float *out = pkvt_alloc((size_t)hg * d * sizeof(float));
            for (size_t ki = 0; ki < n_all; ki++) {
                if (!pkvi_isa_supported(all[ki]->isa)) {
                    if (li == 0 && di == 0)
                        usable(all[ki], "vs_double_reference");
                    continue;
                }
                for (uint32_t grp = 0; grp < g; grp++) {
                    run_kernel(all[ki], &L, grp, q + (size_t)grp * hg * d, out);
                    const double err =
                        pkvt_maxdiff_fd(out, ref + (size_t)grp * hg * d, (size_t)hg * d);
                    if (err / vmax > worst[ki])
                        worst[ki] = err / vmax;
                    ck_assert_msg(err <= 1e-5 * vmax,
                                  "%s vs double: n=%u %s group %u: max|diff| %g > 1e-5 * %g "
                                  "(seed 0x%llx)",
                                  all[ki]->isa, n, pkv_dtype_name(dtypes[di]), grp, err,
                                  (double)vmax, (unsigned long long)seed);
                }
            }
            free(out);
            free(ref);
            free(q);
            layer_free(&L);
        }
    for (size_t ki = 0; ki < n_all; ki++)
        if (pkvi_isa_supported(all[ki]->isa))
            printf("vs_double_reference: %s: largest |diff| / max|V| %.3g (n <= %u)\n",
                   all[ki]->isa, worst[ki], pkvt_quick() ? 1000u : 4096u);
}
END_TEST

/* ---- state continuation: two calls on consecutive page ranges == one call ---------
 * Tiles never span pages, so the state after a page depends only on the state before
 * it: splitting the range must give bitwise the same state, for every kernel. Also
 * checks the rescaling path by starting from a non-empty random state. */
START_TEST(continuation)
{
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0xc0);
    static const uint32_t shapes[][4] = {/* d, hg, bt, n */
                                         {128, 4, 16, 16 * 9 + 5},
                                         {80, 3, 64, 64 * 3 + 63},
                                         {17, 8, 2, 41},
                                         {256, 1, 16, 16 * 5},
                                         {3, 5, 1, 9}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const uint32_t d = shapes[si][0], hg = shapes[si][1], bt = shapes[si][2];
        const uint32_t n = shapes[si][3];
        const pkv_dtype dt = dtypes[si % 3];
        layer L;
        layer_build(&L, &r, 1, hg, d, bt, dt, n, 1.0f);
        float *q = pkvt_alloc((size_t)hg * d * sizeof(float));
        pkvt_fill(&r, q, (size_t)hg * d, -3.0f, 3.0f);
        const size_t sf = (size_t)hg * (d + 2);
        float *init = pkvt_alloc(sf * sizeof(float));
        for (uint32_t h = 0; h < hg; h++) { /* a state as if some tokens were folded */
            init[h] = pkvt_uniform(&r, -1.0f, 4.0f);
            init[hg + h] = pkvt_uniform(&r, 1.0f, 20.0f);
        }
        pkvt_fill(&r, init + 2 * hg, (size_t)hg * d, -5.0f, 5.0f);
        float *one = pkvt_alloc(sf * sizeof(float)), *two = pkvt_alloc(sf * sizeof(float));
        float *sref = pkvt_alloc(sf * sizeof(float));
        for (size_t ki = 0; ki < n_all; ki++) {
            const pkvi_kernels *k = all[ki];
            if (!pkvi_isa_supported(k->isa)) {
                if (si == 0)
                    usable(k, "continuation");
                continue;
            }
            memcpy(one, init, sf * sizeof(float));
            attend1(k, &L.kp, L.pages, L.n_pages, last_tokens(&L), 0, q, one, one + hg,
                      one + 2 * hg);
            for (uint32_t split = 1; split < L.n_pages; split++) {
                memcpy(two, init, sf * sizeof(float));
                attend1(k, &L.kp, L.pages, split, bt, 0, q, two, two + hg, two + 2 * hg);
                attend1(k, &L.kp, L.pages + split, L.n_pages - split, last_tokens(&L), 0, q, two,
                          two + hg, two + 2 * hg);
                ck_assert_msg(memcmp(one, two, sf * sizeof(float)) == 0,
                              "%s: split at page %u of %u changes the state (d=%u hg=%u "
                              "bt=%u n=%u %s, seed 0x%llx)",
                              k->isa, split, L.n_pages, d, hg, bt, n, pkv_dtype_name(dt),
                              (unsigned long long)seed);
            }
            if (ki == 0) {
                memcpy(sref, one, sf * sizeof(float));
                continue;
            }
            /* against the scalar kernel from the same non-empty state: out = acc / l */
            double vmax = 0;
            for (size_t i = 0; i < (size_t)n * d; i++)
                vmax = fmax(vmax, fabs(L.V[i]));
            for (size_t i = 0; i < (size_t)hg * d; i++)
                vmax = fmax(vmax, fabs(init[2 * hg + i]));
            const double tol = 2 * bound(&L, 0, q) + 16 * U * vmax;
            for (uint32_t h = 0; h < hg; h++)
                for (uint32_t c = 0; c < d; c++) {
                    const double a = one[2 * hg + (size_t)h * d + c] / one[hg + h];
                    const double b = sref[2 * hg + (size_t)h * d + c] / sref[hg + h];
                    ck_assert_msg(fabs(a - b) <= tol,
                                  "%s vs scalar from a non-empty state: head %u col %u: "
                                  "%.9g vs %.9g (d=%u hg=%u bt=%u, seed 0x%llx)",
                                  k->isa, h, c, a, b, d, hg, bt, (unsigned long long)seed);
                }
        }
        free(q);
        free(init);
        free(one);
        free(two);
        free(sref);
        layer_free(&L);
    }
}
END_TEST

/* ---- exp accuracy, observed through the kernel's state ----------------------------
 * d = 1, f32, scale 1, tokens k = (0, 1), v = (0, 1), empty state: for head h with
 * q_h = x <= 0 the scores are (0, x), m' = 0, and acc = 1*0 + exp(x)*1 exactly, so
 * acc[h] is the kernel's exp(x). Required: <= 2 ulp over [-104, 0] (subnormal results
 * measured in units of the smallest subnormal), exactly 0 below the underflow point. */
static double ulp_of(double x)
{
    int e;
    frexp(x, &e); /* x = f * 2^e, f in [0.5, 1) */
    if (e - 1 < -126)
        return 0x1p-149;
    return ldexp(1.0, e - 1 - 23);
}

/* Soft-capped scores (docs/variants.md): with K rows 0 and 1 and V rows 0 and 1, a query q <= 0
 * scores s = c * tanh(q / c) <= 0 on row 1 and 0 on row 0, so the state's max stays 0 and
 * acc = exp(s). The score the kernel used, log(acc), is held to c * tanh(q / c) in
 * double: within 4 ulp of the score plus what exp's 2 ulp add (2^-22), for caps of 2.5 to
 * 50 and q from -0 down to deep saturation. */
START_TEST(softcap_accuracy)
{
    const uint32_t hg = PKVI_MAX_GROUP_HEADS;
    const float caps[] = {2.5f, 30.0f, 50.0f};
    const float page[4] = {0.0f, 1.0f, 0.0f, 1.0f};
    const void *pages[1] = {page};
    float q[PKVI_MAX_GROUP_HEADS], m[PKVI_MAX_GROUP_HEADS], l[PKVI_MAX_GROUP_HEADS];
    float acc[PKVI_MAX_GROUP_HEADS];
    const uint64_t seed = pkvt_seed();
    const uint32_t rounds = pkvt_quick() ? 20 : 200;
    for (size_t ki = 0; ki < n_all; ki++) {
        const pkvi_kernels *k = all[ki];
        if (!usable(k, "softcap_accuracy"))
            continue;
        double worst = 0, worst_q = 0, worst_c = 0;
        for (size_t ci = 0; ci < sizeof caps / sizeof *caps; ci++) {
            const float c = caps[ci];
            pkvi_kparams kp = {.head_dim = 1, .block_tokens = 2, .hg = hg, .dtype = PKV_F32,
                               .scale = 1.0f, .softcap = c, .group_stride = 4 * sizeof(float),
                               .v_offset = 2 * sizeof(float)};
            pkvt_rng r;
            pkvt_rng_init(&r, seed ^ 0x7a);
            for (uint32_t round = 0; round < rounds; round++) {
                for (uint32_t h = 0; h < hg; h++) {
                    if (round % 3 == 0) /* around the series / exp switch at |q/c| = 0.4 */
                        q[h] = -c * pkvt_uniform(&r, 0.3f, 0.5f);
                    else if (round % 3 == 1) /* small */
                        q[h] = -c * pkvt_uniform(&r, 0.0f, 1.0f) *
                               ldexpf(1.0f, -(int)pkvt_below(&r, 20));
                    else
                        q[h] = -pkvt_uniform(&r, 0.0f, 4.0f * c);
                    m[h] = -INFINITY;
                    l[h] = 0.0f;
                    acc[h] = 0.0f;
                }
                attend1(k, &kp, pages, 1, 2, 0, q, m, l, acc);
                for (uint32_t h = 0; h < hg; h++) {
                    const double want = (double)c * tanh((double)q[h] / c);
                    const double got = log((double)acc[h]);
                    const double bound = 4 * ulp_of(fabs(want)) + 0x1p-22;
                    const double err = fabs(got - want) / bound;
                    if (!(err <= worst)) {
                        worst = isnan(err) ? INFINITY : err;
                        worst_q = q[h];
                        worst_c = c;
                    }
                }
            }
        }
        printf("softcap_accuracy: %s worst error %.3f of the bound (q = %.9g, cap %g)\n",
               k->isa, worst, worst_q, worst_c);
        ck_assert_msg(worst <= 1.0, "%s softcap: %.3f of the bound at q = %.9g, cap %g (seed 0x%llx)",
                      k->isa, worst, worst_q, worst_c, (unsigned long long)seed);
    }
}
END_TEST

START_TEST(exp_accuracy)
{
    const uint32_t hg = PKVI_MAX_GROUP_HEADS;
    pkvi_kparams kp = {.head_dim = 1, .block_tokens = 2, .hg = hg, .dtype = PKV_F32,
                       .scale = 1.0f, .group_stride = 4 * sizeof(float),
                       .v_offset = 2 * sizeof(float)};
    const float page[4] = {0.0f, 1.0f, 0.0f, 1.0f}; /* K rows 0, 1; V rows 0, 1 */
    const void *pages[1] = {page};
    float q[PKVI_MAX_GROUP_HEADS], m[PKVI_MAX_GROUP_HEADS], l[PKVI_MAX_GROUP_HEADS];
    float acc[PKVI_MAX_GROUP_HEADS];
    const uint64_t seed = pkvt_seed();
    const uint32_t rounds = pkvt_quick() ? 40 : 800;
    for (size_t ki = 0; ki < n_all; ki++) {
        const pkvi_kernels *k = all[ki];
        if (!usable(k, "exp_accuracy"))
            continue;
        pkvt_rng r;
        pkvt_rng_init(&r, seed ^ 0xe9);
        double worst = 0, worst_x = 0;
        for (uint32_t round = 0; round < rounds; round++) {
            for (uint32_t h = 0; h < hg; h++) {
                if (round == 0) /* fixed points: 0, tiny, -ln2 multiples, underflow edge */
                    q[h] = h == 0 ? 0.0f : -(float)h * (h < 128 ? 0.6931472f : 0.40625f);
                else if (round % 4 == 1) /* near 0 */
                    q[h] = -pkvt_uniform(&r, 0.0f, 1.0f) * ldexpf(1.0f, -(int)pkvt_below(&r, 30));
                else
                    q[h] = -pkvt_uniform(&r, 0.0f, 104.0f);
                m[h] = -INFINITY;
                l[h] = 0.0f;
                acc[h] = 0.0f;
            }
            attend1(k, &kp, pages, 1, 2, 0, q, m, l, acc);
            for (uint32_t h = 0; h < hg; h++) {
                const double exact = exp((double)q[h]);
                double err;
                if (exact < 0x1p-150) /* rounds to 0 */
                    err = acc[h] == 0.0f ? 0 : INFINITY;
                else
                    err = fabs((double)acc[h] - exact) / ulp_of(exact);
                if (!(err <= worst)) {
                    worst = isnan(err) ? INFINITY : err;
                    worst_x = q[h];
                }
            }
        }
        printf("exp_accuracy: %s max error %.3f ulp (at x = %.9g)\n", k->isa, worst, worst_x);
        ck_assert_msg(worst <= 2.0, "%s exp: %.3f ulp at x = %.9g (> 2 ulp; seed 0x%llx)",
                      k->isa, worst, worst_x, (unsigned long long)seed);
    }
    /* exp(-inf) is exactly 0 and exp(0) exactly 1: the empty state and an unchanged max
     * must not disturb l and acc */
    for (size_t ki = 0; ki < n_all; ki++) {
        if (!pkvi_isa_supported(all[ki]->isa))
            continue;
        q[0] = 0.0f;
        m[0] = -INFINITY;
        l[0] = 0.0f;
        acc[0] = 0.0f;
        kp.hg = 1;
        attend1(all[ki], &kp, pages, 1, 2, 0, q, m, l, acc);
        ck_assert_msg(m[0] == 0.0f && l[0] == 2.0f && acc[0] == 1.0f,
                      "%s: scores (0, 0) from the empty state gave m=%g l=%g acc=%g",
                      all[ki]->isa, (double)m[0], (double)l[0], (double)acc[0]);
        kp.hg = hg;
    }
}
END_TEST

/* ---- store_row: bitwise the scalar conversion ---------------------------------------- */

static float f32_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Values that stress rounding: specials, subnormals, overflow edges, halfway cases. */
static size_t special_floats(float *x, size_t cap, pkvt_rng *r)
{
    static const uint32_t fixed[] = {
        0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x00800000, /* zero, f32 subnormals */
        0x7f800000, 0xff800000, 0x7f7fffff, 0xff7fffff,             /* inf, max finite */
        0x477fe000, 0x477fefff, 0x477ff000, 0x477ff001, 0xc77ff000, /* f16 max, -> inf edge */
        0x38800000, 0x387fe000, 0x387ff000, 0x33800000, 0x33000000, /* f16 normal/subnormal */
        0x33000001, 0x32ffffff, 0x33c00000, 0xb3400000, 0x34000000, /* halfway of 2^-24 unit */
        0x3f801000, 0x3f803000, 0x3f801001, 0x3f800fff,             /* f16 ties at 1 */
        0x3f808000, 0x3f818000, 0x3f808001, 0x3f807fff, 0xbf818000, /* bf16 ties at 1 */
        0x7f7f8000, 0x7f7f7fff, 0x00008000, 0x00018000,             /* bf16 max, subnormal ties */
    };
    size_t n = 0;
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0] && n < cap; i++)
        x[n++] = f32_of(fixed[i]);
    while (n < cap) {
        /* exact midpoints between neighbouring f16 / bf16 values, and 1 f32 ulp off */
        const uint16_t h = (uint16_t)(pkvt_next(r) & 0x7bffu);
        const double a = pkvi_f16_to_f32(h), b = pkvi_f16_to_f32((uint16_t)(h + 1));
        const float mid = (float)((a + b) / 2);
        const uint32_t mb = bits_of(mid);
        const uint32_t bb = (uint32_t)(pkvt_next(r) & 0x7f7f0000u) | 0x8000u;
        const uint32_t sign = (uint32_t)(pkvt_next(r) & 1u) << 31;
        const uint32_t cand[] = {mb, mb + 1, mb - 1, bb, bb + 1, bb - 1};
        for (size_t i = 0; i < 6 && n < cap; i++)
            x[n++] = f32_of(cand[i] | sign);
    }
    return n;
}

START_TEST(store_row_bitwise)
{
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x57);
    enum { N = 4096 };
    float *x = pkvt_alloc(N * sizeof(float));
    uint16_t *want = pkvt_alloc(N * sizeof(uint16_t)), *got = pkvt_alloc((N + 8) * sizeof(uint16_t));
    float *fgot = pkvt_alloc(N * sizeof(float));
    const uint32_t rounds = pkvt_quick() ? 8 : 200;
    for (size_t ki = 0; ki < N_SIMD; ki++) {
        const pkvi_kernels *k = simd_tables[ki];
        if (!usable(k, "store_row_bitwise"))
            continue;
        for (uint32_t round = 0; round < rounds; round++) {
            if (round % 2 == 0)
                special_floats(x, N, &r);
            else /* random bit patterns: every exponent, NaNs included */
                for (size_t i = 0; i < N; i++)
                    x[i] = f32_of((uint32_t)pkvt_next(&r));
            /* lengths that exercise every tail, at odd offsets */
            const uint32_t n = round < 40 ? round + 1 : N - pkvt_below(&r, 64);
            const uint32_t off = pkvt_below(&r, 8);
            for (size_t di = 1; di < 3; di++) {
                const pkv_dtype dt = dtypes[di];
                const uint32_t len = n > off ? n - off : 0;
                pkvi_store_row(dt, want, x + off, len);
                memset(got, 0xa5, (N + 8) * sizeof(uint16_t));
                k->store_row(dt, got, x + off, len);
                for (uint32_t i = 0; i < len; i++) {
                    const float v = x[off + i];
                    const uint32_t inf = dt == PKV_F16 ? 0x7c00u : 0x7f80u;
                    const bool nan_ok = isnan(v) && (got[i] & 0x7fffu) > inf;
                    if (got[i] == want[i] || nan_ok) /* asserting only what fails: each */
                        continue;                    /* ck_assert writes to Check's pipe */
                    ck_assert_msg(0, "%s store %s of 0x%08x: 0x%04x, scalar gives 0x%04x "
                                  "(seed 0x%llx)", k->isa, pkv_dtype_name(dt), bits_of(v),
                                  got[i], want[i], (unsigned long long)seed);
                }
                ck_assert_msg(got[len] == 0xa5a5, "%s store %s wrote past n=%u", k->isa,
                              pkv_dtype_name(dt), len);
            }
            const uint32_t len = n > off ? n - off : 0;
            k->store_row(PKV_F32, fgot, x + off, len);
            ck_assert_msg(memcmp(fgot, x + off, (size_t)len * sizeof(float)) == 0,
                          "%s store f32 is not a copy", k->isa);
        }
    }
    free(x);
    free(want);
    free(got);
    free(fgot);
}
END_TEST

/* ---- store_row of the block types: bitwise quant.c's ---------------------------------- */

/* Row kinds for the Q8/Q4 store: each reaches a different part of the block rule. */
enum { ROW_BELL, ROW_TIES, ROW_OUTLIER, ROW_SIGNS, ROW_SPECIAL, ROW_BITS, ROW_KINDS };

/* n values of one kind: bell-shaped at a random scale 2^-40..2^24 (tiny scales reach
 * the f16 subnormals and the raised smallest scale, large ones the saturated 65504);
 * exact half steps of an f16 step (ties in every division); bell-shaped with one large
 * value; one sign but for a few values (Q4's b and its -8 end); the special floats of
 * store_row_bitwise (NaN, infinities, subnormals); random bit patterns. */
static void quant_row(pkvt_rng *r, int kind, float *x, uint32_t n)
{
    const float s = ldexpf(1.0f, (int)pkvt_below(r, 65) - 40);
    switch (kind) {
    case ROW_SPECIAL:
        special_floats(x, n, r);
        for (uint32_t i = n; i > 1; i--) { /* shuffled: specials land in every block */
            const uint32_t j = pkvt_below(r, i);
            const float t = x[i - 1];
            x[i - 1] = x[j], x[j] = t;
        }
        return;
    case ROW_BITS:
        for (uint32_t i = 0; i < n; i++)
            x[i] = f32_of((uint32_t)pkvt_next(r));
        return;
    case ROW_TIES: {
        const float step = pkvi_f16_to_f32((uint16_t)(0x0400u + pkvt_below(r, 0x6000u)));
        for (uint32_t i = 0; i < n; i++)
            x[i] = step * ((float)pkvt_below(r, 255) - 127.0f + 0.5f * (float)pkvt_below(r, 2));
        return;
    }
    default:
        for (uint32_t i = 0; i < n; i++)
            x[i] = s * (pkvt_uniform(r, -1, 1) + pkvt_uniform(r, -1, 1) + pkvt_uniform(r, -1, 1));
        if (kind == ROW_OUTLIER)
            x[pkvt_below(r, n)] = s * pkvt_uniform(r, -40, 40);
        if (kind == ROW_SIGNS)
            for (uint32_t i = 0; i < n; i++)
                x[i] = pkvt_below(r, 8) ? fabsf(x[i]) : -0.3f * fabsf(x[i]);
        return;
    }
}

START_TEST(quant_store_bitwise)
{
    const uint64_t seed = pkvt_seed();
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x9b);
    enum { N = 300, CAP = 400 };
    float x[N + 8];
    unsigned char want[CAP], got[CAP];
    const uint32_t rounds = pkvt_quick() ? 300 : 3000;
    for (size_t ki = 0; ki < N_SIMD; ki++) {
        const pkvi_kernels *k = simd_tables[ki];
        if (!usable(k, "quant_store_bitwise"))
            continue;
        for (uint32_t round = 0; round < rounds; round++) {
            const int kind = (int)(round % ROW_KINDS);
            /* every length 1..300 in turn (quick runs: 1..50), at odd offsets */
            const uint32_t n = 1 + round / ROW_KINDS % N, off = pkvt_below(&r, 8);
            quant_row(&r, kind, x + off, n);
            for (int qi = 0; qi < 2; qi++) {
                const pkv_dtype dt = qi ? PKV_Q4 : PKV_Q8;
                const size_t bytes = pkv_row_bytes(dt, n);
                memset(want, 0xa5, CAP);
                memset(got, 0xa5, CAP);
                pkvi_store_row(dt, want, x + off, n);
                k->store_row(dt, got, x + off, n);
                size_t i = 0; /* the first byte that differs (one assertion a row:
                                 * each one is a write to Check's pipe) */
                while (i < CAP && got[i] == want[i])
                    i++;
                ck_assert_msg(i == CAP,
                              "%s store %s, row of %u (kind %d): byte %zu of %zu is 0x%02x, "
                              "quant.c gives 0x%02x (seed 0x%llx)", k->isa, pkv_dtype_name(dt),
                              n, kind, i, bytes, i < CAP ? got[i] : 0, i < CAP ? want[i] : 0,
                              (unsigned long long)seed);
            }
        }
    }
}
END_TEST

/* ---- dispatch ----------------------------------------------------------------------- */

START_TEST(dispatch_select)
{
    const pkvi_kernels *k = NULL;
    ck_assert_int_eq(pkvi_kernels_select(&k), PKV_OK);
    ck_assert_ptr_nonnull(k);
    ck_assert_msg(pkvi_isa_supported(k->isa), "selected %s, which is not supported", k->isa);
    ck_assert(pkvi_isa_supported("scalar"));
    ck_assert(!pkvi_isa_supported("sse9"));
    ck_assert(!pkvi_isa_supported(NULL));
    /* the best available: avx512vnni, then avx512 if supported (and not emulated,
     * which only PKV_FORCE_ISA picks), else avx2vnni, avx2, scalar */
    const char *best = pkvi_isa_supported("avx512vnni") && !PKV_AVX512_EMULATED ? "avx512vnni"
                       : pkvi_isa_supported("avx512") && !PKV_AVX512_EMULATED ? "avx512"
                       : pkvi_isa_supported("avx2vnni")                       ? "avx2vnni"
                       : pkvi_isa_supported("avx2")                           ? "avx2"
                       : pkvi_isa_supported("neon_dotprod")                   ? "neon_dotprod"
                       : pkvi_isa_supported("neon")                           ? "neon"
                                                                              : "scalar";
    if (!getenv("PKV_FORCE_ISA"))
        ck_assert_str_eq(k->isa, best);
    printf("dispatch_select: host runs %s (avx2 %s, avx2vnni %s, avx512 %s, avx512vnni %s, "
           "neon %s, neon_dotprod %s)\n",
           k->isa, pkvi_isa_supported("avx2") ? "yes" : "no",
           pkvi_isa_supported("avx2vnni") ? "yes" : "no",
           pkvi_isa_supported("avx512") ? "yes" : "no",
           pkvi_isa_supported("avx512vnni") ? "yes" : "no",
           pkvi_isa_supported("neon") ? "yes" : "no",
           pkvi_isa_supported("neon_dotprod") ? "yes" : "no");
}
END_TEST

START_TEST(force_isa)
{
    static const char *const names[] = {"scalar",     "avx2", "avx2vnni",    "avx512",
                                        "avx512vnni", "neon", "neon_dotprod"};
    char *saved = getenv("PKV_FORCE_ISA") ? strdup(getenv("PKV_FORCE_ISA")) : NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        ck_assert_int_eq(setenv("PKV_FORCE_ISA", names[i], 1), 0);
        const pkvi_kernels *k = NULL;
        const pkv_status st = pkvi_kernels_select(&k);
        if (!pkvi_isa_supported(names[i])) {
            /* the reason names what is missing: the table in this build, or the host */
            const char *why = pkvi_kernels_force_reason(names[i]);
            printf("force_isa: %s unsupported here (%s), expecting PKV_EINVAL\n", names[i],
                   why);
            ck_assert_int_eq(st, PKV_EINVAL);
            ck_assert_ptr_nonnull(why);
            ck_assert_msg(pkvi_kernels_named(names[i]) ? strstr(why, "cannot run") != NULL
                                                       : strstr(why, "not built") != NULL,
                          "%s: reason '%s'", names[i], why);
            /* and so does the engine's explanation */
            char buf[256];
            const pkv_config c = pkvt_config(1, 8, 2, 24, 0, PKV_F32);
            ck_assert_int_eq(pkv_config_explain(&c, buf, sizeof buf), PKV_EINVAL);
            ck_assert_msg(strstr(buf, why) != NULL, "%s: explained as '%s'", names[i], buf);
            continue;
        }
        ck_assert_ptr_null(pkvi_kernels_force_reason(names[i]));
        ck_assert_int_eq(st, PKV_OK);
        ck_assert_str_eq(k->isa, names[i]);
        /* through the public API */
        const pkv_config c = pkvt_config(1, 8, 2, 24, 0, PKV_F32);
        pkv_engine *e = pkvt_engine_cfg(&c);
        pkv_stats s;
        ck_assert_int_eq(pkv_engine_stats(e, &s), PKV_OK);
        ck_assert_str_eq(s.isa, names[i]);
        pkv_engine_destroy(e);
    }
    ck_assert_int_eq(setenv("PKV_FORCE_ISA", "no-such-isa", 1), 0);
    const pkvi_kernels *k = &pkvi_kernels_scalar;
    ck_assert_int_eq(pkvi_kernels_select(&k), PKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(pkvi_kernels_force_reason("no-such-isa"), "not a kernel"));
    pkv_config c = pkv_config_default();
    c.n_layers = c.n_heads = c.n_kv_heads = 1;
    c.head_dim = 8;
    static char sentinel; /* a failed create leaves *out as it was */
    pkv_engine *e = (pkv_engine *)(void *)&sentinel;
    ck_assert_int_eq(pkv_engine_create(&c, &e), PKV_EINVAL);
    ck_assert_ptr_eq(e, (pkv_engine *)(void *)&sentinel);
    if (saved) {
        setenv("PKV_FORCE_ISA", saved, 1);
        free(saved);
    } else {
        unsetenv("PKV_FORCE_ISA");
    }
}
END_TEST

/* The dispatcher's cpuid + XGETBV view against the kernel's (/proc/cpuinfo flags, which
 * Linux clears when the OS does not enable a feature's register state): they must agree
 * on every ISA this build contains, and an ISA the build lacks is never "supported"
 * whatever the CPU says (an aarch64 build under qemu on an AVX2 host, say). */
/* valgrind's synthetic CPU reports fewer features than the real one */
static bool under_valgrind(void)
{
    const char *pre = getenv("LD_PRELOAD");
    return pre != NULL && strstr(pre, "vgpreload") != NULL;
}

START_TEST(isa_matches_cpuinfo)
{
    static const char *const names[] = {"avx2",   "avx2vnni", "avx512",      "avx512vnni",
                                        "neon",   "neon_dotprod"};
    size_t checked = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const bool lib = pkvi_isa_supported(names[i]);
        if (pkvi_kernels_named(names[i]) == NULL) {
            ck_assert_msg(!lib, "%s is not in this build but pkvi_isa_supported says yes",
                          names[i]);
            printf("isa_matches_cpuinfo: %s not built for this architecture\n", names[i]);
            continue;
        }
        const int os = pkvt_cpuinfo_has_isa(names[i]);
#if PKV_HAVE_ARM_KERNELS
        if (os < 0) { /* qemu-user: /proc/cpuinfo is the x86 host's */
            printf("isa_matches_cpuinfo: %s %s, but /proc/cpuinfo has no Features line "
                   "(qemu-user?): not checked\n", names[i], lib ? "present" : "absent");
            checked++;
            continue;
        }
#endif
        ck_assert_msg(os >= 0, "/proc/cpuinfo has no flags line: nothing to check %s against",
                      names[i]);
        if (under_valgrind()) { /* its CPU offers a subset (no AVX-512): one way only */
            ck_assert_msg(!lib || os == 1, "%s: cpuid says supported, /proc/cpuinfo not",
                          names[i]);
            checked++;
            continue;
        }
        ck_assert_msg(lib == (os == 1),
                      "%s: cpuid/XGETBV says %s, /proc/cpuinfo flags say %s", names[i],
                      lib ? "supported" : "unsupported", os ? "supported" : "unsupported");
        printf("isa_matches_cpuinfo: %s %s (cpuid and /proc/cpuinfo agree)\n", names[i],
               lib ? "present" : "absent");
        checked++;
    }
    size_t built = 0; /* every table this build contains is checked */
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        built += pkvi_kernels_named(names[i]) != NULL;
    ck_assert_uint_eq(checked, built);
#if !PKV_HAVE_X86_KERNELS && !PKV_HAVE_ARM_KERNELS
    ck_assert_uint_eq(built, 0);
#endif
}
END_TEST

/* Whether the first processor of /proc/cpuinfo has the word w in its flags line. */
static bool flags_have(const char *flags, const char *w)
{
    const size_t n = strlen(w);
    for (const char *p = strstr(flags, w); p; p = strstr(p + 1, w))
        if ((p == flags || p[-1] == ' ' || p[-1] == '\t') && (p[n] == ' ' || p[n] == '\n' ||
                                                              p[n] == '\0'))
            return true;
    return false;
}

/* The default prefetch level against /proc/cpuinfo: L2 exactly on Zen 4 (AuthenticAMD,
 * cpu family 25, AVX-512 F/BW/VL/DQ), L1 elsewhere; PKV_PREFETCH overrides it. */
START_TEST(prefetch_rule_matches_cpuinfo)
{
    char *saved = getenv("PKV_PREFETCH") ? strdup(getenv("PKV_PREFETCH")) : NULL;
    unsetenv("PKV_PREFETCH");
    uint32_t l2 = 7;
    ck_assert_int_eq(pkvi_prefetch_l2(&l2), PKV_OK);
    FILE *fp = fopen("/proc/cpuinfo", "r");
    ck_assert_ptr_nonnull(fp);
    char line[8192], vendor[64] = "", flags[8192] = "";
    int family = -1;
    while (fgets(line, sizeof line, fp) && line[0] != '\n') {
        const char *v = strchr(line, ':');
        if (!v)
            continue;
        v += v[1] == ' ' ? 2 : 1;
        if (strncmp(line, "vendor_id", 9) == 0)
            snprintf(vendor, sizeof vendor, "%.*s", (int)strcspn(v, "\n"), v);
        else if (strncmp(line, "cpu family", 10) == 0)
            family = atoi(v);
        else if (strncmp(line, "flags", 5) == 0)
            snprintf(flags, sizeof flags, "%s", v);
    }
    fclose(fp);
    const bool zen4 = strcmp(vendor, "AuthenticAMD") == 0 && family == 25 &&
                      flags_have(flags, "avx512f") && flags_have(flags, "avx512bw") &&
                      flags_have(flags, "avx512vl") && flags_have(flags, "avx512dq");
#if PKV_HAVE_X86_KERNELS
    if (under_valgrind()) /* its CPU offers no AVX-512: one way only */
        ck_assert_msg(!l2 || zen4, "L2 prefetch on a CPU /proc/cpuinfo says is not Zen 4");
    else
        ck_assert_msg(l2 == (uint32_t)zen4, "prefetch level %s, /proc/cpuinfo: %s family %d%s",
                      l2 ? "L2" : "L1", vendor, family,
                      zen4 ? " with AVX-512 (Zen 4)" : "");
#else
    (void)zen4; /* no Zen 4 rule off x86-64 */
    ck_assert_uint_eq(l2, 0);
#endif
    printf("prefetch_rule_matches_cpuinfo: %s family %d -> %s\n", vendor, family,
           l2 ? "L2" : "L1");
    setenv("PKV_PREFETCH", "l2", 1);
    ck_assert_int_eq(pkvi_prefetch_l2(&l2), PKV_OK);
    ck_assert_uint_eq(l2, 1);
    setenv("PKV_PREFETCH", "l1", 1);
    ck_assert_int_eq(pkvi_prefetch_l2(&l2), PKV_OK);
    ck_assert_uint_eq(l2, 0);
    setenv("PKV_PREFETCH", "t1", 1);
    l2 = 5;
    ck_assert_int_eq(pkvi_prefetch_l2(&l2), PKV_EINVAL);
    ck_assert_uint_eq(l2, 5); /* nothing written on failure */
    if (saved)
        setenv("PKV_PREFETCH", saved, 1);
    else
        unsetenv("PKV_PREFETCH");
    free(saved);
}
END_TEST

/* End to end: each ISA through the engine (append + decode) against the double
 * reference, and the ISAs against each other. */
START_TEST(engine_each_isa)
{
    const uint64_t seed = pkvt_seed();
    const uint32_t h = 8, g = 2, d = 40, n = 150;
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0xee);
    float *K = pkvt_alloc((size_t)n * g * d * sizeof(float));
    float *V = pkvt_alloc((size_t)n * g * d * sizeof(float));
    float *q = pkvt_alloc((size_t)h * d * sizeof(float));
    float *out = pkvt_alloc((size_t)h * d * sizeof(float));
    double *ref = pkvt_alloc((size_t)h * d * sizeof(double));
    pkvt_fill(&r, K, (size_t)n * g * d, -1, 1);
    pkvt_fill(&r, V, (size_t)n * g * d, -1, 1);
    pkvt_fill(&r, q, (size_t)h * d, -2, 2);
    char *saved = getenv("PKV_FORCE_ISA") ? strdup(getenv("PKV_FORCE_ISA")) : NULL;
    for (size_t di = 0; di < 3; di++) {
        pkvt_ref_decode(h, g, d, 0, dtypes[di], n, q, K, V, ref);
        const float vmax = pkvt_maxabs(V, (size_t)n * g * d);
        for (size_t i = 0; i < n_all; i++) {
            const char *name = all[i]->isa;
            setenv("PKV_FORCE_ISA", name, 1);
            pkv_engine *e = pkvt_engine(1, h, g, d, 16, dtypes[di]);
            unsetenv("PKV_FORCE_ISA");
            pkv_stats es;
            ck_assert_int_eq(pkv_engine_stats(e, &es), PKV_OK);
            ck_assert_str_eq(es.isa, name);
            pkv_session *s = pkvt_session(e);
            for (uint32_t t = 0; t < n; t++)
                ck_assert_int_eq(pkv_append(s, 0, K + (size_t)t * g * d, V + (size_t)t * g * d),
                                 PKV_OK);
            ck_assert_int_eq(pkv_decode(s, 0, q, out), PKV_OK);
            const double err = pkvt_maxdiff_fd(out, ref, (size_t)h * d);
            ck_assert_msg(err <= 1e-5 * vmax, "engine %s %s: max|diff| %g (seed 0x%llx)",
                          name, pkv_dtype_name(dtypes[di]), err, (unsigned long long)seed);
            pkv_session_destroy(s);
            pkv_engine_destroy(e);
        }
    }
    if (saved) {
        setenv("PKV_FORCE_ISA", saved, 1);
        free(saved);
    }
    free(K);
    free(V);
    free(q);
    free(out);
    free(ref);
}
END_TEST

/* Where the walk's prefetches go (PKV_PREFETCH=l1|l2, else the CPU's default) moves
 * no bit: every table, every dtype and both Q8/Q4 paths decode the same bits with
 * either, over enough pages that the prefetch targets lie inside the walk. */
START_TEST(prefetch_level_same_bits)
{
    const uint64_t seed = pkvt_seed();
    const uint32_t h = 8, g = 2, d = 64, n = 300;
    pkvt_rng r;
    pkvt_rng_init(&r, seed ^ 0x9f);
    float *K = pkvt_alloc((size_t)n * g * d * sizeof(float));
    float *V = pkvt_alloc((size_t)n * g * d * sizeof(float));
    float *q = pkvt_alloc((size_t)h * d * sizeof(float));
    float *out[2] = {pkvt_alloc((size_t)h * d * sizeof(float)),
                     pkvt_alloc((size_t)h * d * sizeof(float))};
    pkvt_fill(&r, K, (size_t)n * g * d, -1, 1);
    pkvt_fill(&r, V, (size_t)n * g * d, -1, 1);
    pkvt_fill(&r, q, (size_t)h * d, -2, 2);
    const pkv_dtype all_dt[] = {PKV_F32, PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};
    char *saved_isa = getenv("PKV_FORCE_ISA") ? strdup(getenv("PKV_FORCE_ISA")) : NULL;
    char *saved_pf = getenv("PKV_PREFETCH") ? strdup(getenv("PKV_PREFETCH")) : NULL;
    for (size_t i = 0; i < n_all; i++)
        for (size_t di = 0; di < sizeof all_dt / sizeof all_dt[0]; di++)
            for (uint32_t qd = 0; qd < (all_dt[di] >= PKV_Q8 ? 2u : 1u); qd++) {
                for (int lv = 0; lv < 2; lv++) {
                    setenv("PKV_FORCE_ISA", all[i]->isa, 1);
                    setenv("PKV_PREFETCH", lv ? "l2" : "l1", 1);
                    pkv_config c = pkv_config_default();
                    c.n_layers = 1, c.n_heads = h, c.n_kv_heads = g, c.head_dim = d;
                    c.block_tokens = 16, c.kv_dtype = all_dt[di], c.n_threads = 1;
                    c.quant_dot = qd;
                    pkv_engine *e = pkvt_engine_cfg(&c);
                    pkv_session *s = pkvt_session(e);
                    for (uint32_t t = 0; t < n; t++)
                        ck_assert_int_eq(pkv_append(s, 0, K + (size_t)t * g * d,
                                                    V + (size_t)t * g * d),
                                         PKV_OK);
                    ck_assert_int_eq(pkv_decode(s, 0, q, out[lv]), PKV_OK);
                    pkv_session_destroy(s);
                    pkv_engine_destroy(e);
                }
                ck_assert_msg(memcmp(out[0], out[1], (size_t)h * d * sizeof(float)) == 0,
                              "%s %s quant_dot %u: l1 and l2 prefetch differ (seed 0x%llx)",
                              all[i]->isa, pkv_dtype_name(all_dt[di]), qd,
                              (unsigned long long)seed);
            }
    /* a value that is neither is refused at engine creation */
    setenv("PKV_PREFETCH", "l3", 1);
    pkv_config c = pkv_config_default();
    c.n_layers = 1, c.n_heads = h, c.n_kv_heads = g, c.head_dim = d;
    pkv_engine *bad = NULL;
    ck_assert_int_eq(pkv_engine_create(&c, &bad), PKV_EINVAL);
    ck_assert_ptr_null(bad);
    if (saved_isa)
        setenv("PKV_FORCE_ISA", saved_isa, 1);
    else
        unsetenv("PKV_FORCE_ISA");
    if (saved_pf)
        setenv("PKV_PREFETCH", saved_pf, 1);
    else
        unsetenv("PKV_PREFETCH");
    free(saved_isa);
    free(saved_pf);
    free(K);
    free(V);
    free(q);
    free(out[0]);
    free(out[1]);
}
END_TEST

/* Which tables this run tests (see all[] above). None when PKV_FORCE_ISA names a table
 * this build or host lacks: pkvt_run then reports the skip (or the bad name). */
static void pick_kernels(void)
{
    const char *force = getenv("PKV_FORCE_ISA");
    for (size_t i = 0; pkvt_built_isas[i]; i++) {
        const char *isa = pkvt_built_isas[i];
        if ((force && *force && strcmp(force, isa) != 0) || !pkvi_isa_supported(isa))
            continue;
        const pkvi_kernels *k = pkvi_kernels_named(isa);
        if (k == NULL) { /* pkvt_built_isas and pkvi_kernels_named disagree: a test bug */
            fprintf(stderr, "test_kernels: no table for built ISA %s\n", isa);
            exit(EXIT_FAILURE);
        }
        all[n_all++] = k;
        if (k != &pkvi_kernels_scalar)
            simd_tables[N_SIMD++] = k;
    }
}

int main(void)
{
    pick_kernels();
    Suite *s = suite_create("kernels");
    /* "kernels": the tables under test (one meson test per ISA) */
    TCase *tc = tcase_create("kernels");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, exp_accuracy);
    tcase_add_test(tc, softcap_accuracy);
    tcase_add_test(tc, continuation);
    tcase_add_test(tc, groups_and_stacked_heads);
    tcase_add_test(tc, wide_stacked_heads);
    tcase_add_test(tc, vs_double_reference);
    tcase_add_test(tc, engine_each_isa);
    tcase_add_test(tc, prefetch_level_same_bits);
    if (N_SIMD > 0) { /* SIMD against scalar: nothing to compare in the scalar run */
        tcase_add_test(tc, store_row_bitwise);
        tcase_add_test(tc, quant_store_bitwise);
        tcase_add_test(tc, shapes_vs_scalar);
        tcase_add_test(tc, many_heads);
        tcase_add_test(tc, quant_vs_scalar);
        tcase_add_test(tc, vnni_same_bits);
        tcase_add_test(tc, limb_queries);
        tcase_add_test(tc, prepared_q_scratch_runs);
    }
    suite_add_tcase(s, tc);
    /* "dispatch": which table an engine gets, checked against /proc/cpuinfo */
    TCase *td = tcase_create("dispatch");
    tcase_add_test(td, dispatch_select);
    tcase_add_test(td, isa_matches_cpuinfo);
    tcase_add_test(td, prefetch_rule_matches_cpuinfo);
    tcase_add_test(td, force_isa);
    suite_add_tcase(s, td);
    return pkvt_run(s);
}

/*
 * kernels/neondot.c - pkvi_kernels_neon_dotprod: the neon table for CPUs with the
 * dot-product extension (SDOT; AT_HWCAP asimddp: Cortex-A55/A76 and later, Neoverse,
 * Apple M1 and later), compiled with -march=armv8.2-a+dotprod.
 *
 * Owns: the walks of the integer-dot Q8/Q4 scores (quant_dot = 1), whose block sums
 * neon_qd.h forms with SDOT under this file's flags. Everything else - the exact path,
 * every other dtype, the store - is neon.c's: this table calls pkvi_kernels_neon for
 * it. The block sums are exact integers either way, so the same bits as neon on every
 * path (tests/test_kernels.c, vnni_same_bits).
 */
#include "kernels/kernels.h"
#include "kernels/neon_math.h"
#include "kernels/neon_pv.h"
#include "kernels/neon_qd.h"
#include "kernels/walk.h"

#include <stdbool.h>

#if !defined(__ARM_FEATURE_DOTPROD)
#error "neondot.c is compiled without the dot-product extension (meson.build's flags)"
#endif

/* avx2.c's kick distance, as neon.c's. */
enum { KICK_BYTES = 512u << 10 };

PKVI_INLINE void tile_qk(const pkv_dtype dt, const qk_kind qk, const uint32_t D,
                         const pkvi_kparams *p, const tile *t, float *s)
{
    (void)qk; /* this file's walks are QK_INT only */
    tile_qk_int(dt, D, p, t, s);
}

static void attend_qd_q8(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                         uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                         const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head_int, KICK_BYTES, PKV_Q8, QK_INT, 0,
                  p, pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend_qd_q4(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                         uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                         const pkvi_heads *x)
{
    walk_prepared(tile_qk, tile_pv, softmax_tile, prep_head_int, KICK_BYTES, PKV_Q4, QK_INT, 0,
                  p, pages, n_pages, last_tokens, group0, n_groups, x);
}

static void attend(const pkvi_kparams *p, const void *const *pages, uint32_t n_pages,
                   uint32_t last_tokens, uint32_t group0, uint32_t n_groups,
                   const pkvi_heads *x)
{
    if (p->quant_dot && p->dtype == PKV_Q8)
        attend_qd_q8(p, pages, n_pages, last_tokens, group0, n_groups, x);
    else if (p->quant_dot && p->dtype == PKV_Q4)
        attend_qd_q4(p, pages, n_pages, last_tokens, group0, n_groups, x);
    else
        pkvi_kernels_neon.attend(p, pages, n_pages, last_tokens, group0, n_groups, x);
}

static void store_row(pkv_dtype t, void *dst, const float *src, uint32_t n)
{
    pkvi_kernels_neon.store_row(t, dst, src, n);
}

const pkvi_kernels pkvi_kernels_neon_dotprod = {"neon_dotprod", attend, store_row};

/*
 * verify.c - pkv_verify (SPEC §13): the attention of a tree of draft tokens over a
 * layer's cached positions and each draft's ancestors, with the drafts left pending
 * for pkv_session_commit (session/drafts.c).
 *
 * Owns the plan of one call: where each draft's rows sit, which pages each draft
 * reads, and the query sets that read them (the pipeline, pipeline.h, runs them).
 * The rows are stored and later moved by session/write.c (reservation, then write);
 * the tree record is session/drafts.c's.
 *
 * Where rows are. Draft i is stored at slot len + i of the layer (past len: pending,
 * btable.h), in tree order; it attends at position len + depth(i). Token by token, a
 * decode at that position would read the pages [first page, x_i] (x_i its page) with
 * its ancestors at positions len .. len + depth(i): the bits of a decode are fixed by
 * those pages' rows, in position order, and by the chunks they fall in (the kernels
 * are page-local: pipeline.h). So each draft reads, page for page, what that decode
 * would read:
 *   - pages before x_F = len / bt (full cached pages): the table's, shared by all;
 *   - a page whose rows are the draft's ancestors in their own slots (every ancestor
 *     up to that page has index == depth: the chain prefix of the tree, all of a
 *     chain's drafts) is the table's own page too;
 *   - any other page is an image: a page-sized copy whose rows are the cached rows of
 *     page x_F and the ancestors' stored rows, copied as bytes into position order.
 *     The image of the page holding draft j's own position, with rows up to j, serves
 *     j and, as a full page, every descendant of j that reads past it: one image per
 *     draft off the chain prefix, never more.
 * Each row is stored once by the kernels' store_row (session/write.c), so an image row
 * and a table row are the same bytes; the drafts of one set share, through the
 * pipeline's segments, every page that is the same for them (the cached pages always,
 * images of common ancestors too), so each is read once per set.
 *
 * Everything is taken before anything is written, as pkv_prefill does: the scratch,
 * the tree record, the layer's residency and every page the n rows need. A failed
 * call changes nothing.
 */
#include "attention/decode.h"

#include <stdlib.h>
#include <string.h>

#define NO_IMAGE UINT32_MAX

/* What a call needs, worked out from the tree before anything is taken. */
typedef struct {
    const pkvi_geom *geo;
    uint32_t layer, n;
    const int32_t *parent;
    uint64_t len, first, bt;
    uint32_t *depth;      /* [n] */
    uint32_t *chain;      /* [n] leading ancestors (the draft included) with index ==
                             depth: pages before (len + chain) / bt are the table's */
    uint32_t *image;      /* [n] the draft's image, NO_IMAGE on the chain prefix */
    uint64_t *tail_at;    /* [n] where its image pointers start in the pool */
    uint32_t *anc;        /* [n] scratch: one draft's ancestors by depth */
    uint32_t n_images;
    uint64_t n_tail;      /* image pointers in all */
    uint32_t tile;        /* drafts per set */
    uint32_t sets_per_run;
    uint64_t run_heads;   /* heads of the sets of the largest run */
    uint32_t wave;
} plan;

/* Bytes rounded up to a cache line. */
static bool round64(uint64_t bytes, uint64_t *out)
{
    return pkvi_add(bytes, 63, out) && ((*out &= ~63ull), true);
}

/* The tree's shape, the images and the pointer pool: PKV_EINVAL for a bad tree. */
static pkv_status plan_tree(plan *p, pkvi_errs *errs)
{
    const uint64_t bt = p->bt, len = p->len;
    p->n_images = 0;
    p->n_tail = 0;
    for (uint32_t i = 0; i < p->n; i++) {
        const int32_t a = p->parent[i];
        if (a < -1 || a >= (int32_t)i)
            return pkvi_fail(errs, PKV_EINVAL, "pkv_verify: parent[%u] = %d; it must be -1 "
                             "or a draft before %u", i, a, i);
        p->depth[i] = a < 0 ? 0 : p->depth[a] + 1;
        const bool on_chain = p->depth[i] == i;
        p->chain[i] = on_chain ? i + 1 : a < 0 ? 0 : p->chain[a];
        p->image[i] = on_chain ? NO_IMAGE : p->n_images++;
        p->tail_at[i] = p->n_tail;
        if (!on_chain) {
            const uint64_t x = (len + p->depth[i]) / bt, T = (len + p->chain[i]) / bt;
            p->n_tail += x - T + 1;
        }
    }
    return PKV_OK;
}

/* Copy row sr of page src into row dr of page dst, every group's K and V. */
static void copy_row(const pkvi_geom *geo, char *dst, uint64_t dr, const char *src,
                     uint64_t sr)
{
    const pkvi_kparams *kp = &geo->kp;
    for (uint32_t gi = 0; gi < geo->cfg.n_kv_heads; gi++) {
        const size_t gs = gi * kp->group_stride;
        memcpy(dst + gs + dr * geo->row_bytes, src + gs + sr * geo->row_bytes,
               (size_t)geo->row_bytes);
        memcpy(dst + gs + kp->v_offset + dr * geo->row_bytes_v,
               src + gs + kp->v_offset + sr * geo->row_bytes_v, (size_t)geo->row_bytes_v);
    }
}

/* Every draft's pages (qp) and the images they read, from the stored rows (data: the
 * table's array, the layer pinned). */
static void place(const plan *p, const void *const *data, char *images,
                  const void **pool, pkvi_qpages *qp)
{
    const pkvi_geom *geo = p->geo;
    const uint64_t bt = p->bt, len = p->len, pb = geo->page_bytes;
    for (uint32_t i = 0; i < p->n; i++) {
        const uint64_t pos = len + p->depth[i], x = pos / bt;
        const uint32_t rows = (uint32_t)(pos % bt) + 1;
        if (p->image[i] == NO_IMAGE) {
            qp[i] = (pkvi_qpages){data, x + 1, NULL, x + 1, rows};
            continue;
        }
        for (uint32_t a = i, dd = p->depth[i];; a = (uint32_t)p->parent[a], dd--) {
            p->anc[dd] = a;
            if (dd == 0)
                break;
        }
        /* its image: the page of its position, rows in position order up to its own */
        char *im = images + (size_t)p->image[i] * pb;
        for (uint64_t r = 0; r < rows; r++) {
            const uint64_t at = x * bt + r;
            if (at < len) {
                copy_row(geo, im, r, data[x], r);
            } else {
                const uint64_t slot = len + p->anc[at - len];
                copy_row(geo, im, r, data[slot / bt], slot % bt);
            }
        }
        /* its pages from the first one off the chain: the image of the ancestor at
         * each page's last row, then its own */
        const uint64_t T = (len + p->chain[i]) / bt;
        const void **tail = pool + p->tail_at[i];
        for (uint64_t y = T; y <= x; y++) {
            const uint32_t a = y == x ? i : p->anc[(y + 1) * bt - 1 - len];
            tail[y - T] = images + (size_t)p->image[a] * pb;
        }
        qp[i] = (pkvi_qpages){data, T, tail, x + 1, rows};
    }
}

/* Run the drafts' sets, sets_per_run at a time. */
static void attend(const plan *p, pkv_session *s, const pkvi_qpages *qp, const float *q,
                   float *out, pkvi_seg *segs, float *qg)
{
    const pkvi_geom *geo = p->geo;
    const uint32_t g = geo->cfg.n_kv_heads, d = geo->cfg.head_dim, hg = geo->hg;
    const size_t qd = (size_t)geo->cfg.n_heads * d;
    const size_t od = (size_t)geo->cfg.n_heads * geo->cfg.head_dim_v;
    const uint32_t bt = (uint32_t)p->bt;
    pkvi_qset sets[PKVI_BATCH_MAX];
    for (uint32_t t0 = 0; t0 < p->n;) {
        uint32_t ns = 0, nseg = 0;
        float *qp_at = qg;
        float *st = qg + (size_t)g * p->run_heads * d;
        for (; ns < p->sets_per_run && t0 < p->n; ns++) {
            const uint32_t m = p->n - t0 < p->tile ? p->n - t0 : p->tile;
            pkvi_qset *Q = &sets[ns];
            uint64_t end = 0;
            for (uint32_t i = t0; i < t0 + m; i++)
                if (p->len + p->depth[i] + 1 > end)
                    end = p->len + p->depth[i] + 1;
            *Q = (pkvi_qset){.nq = m, .H = m * hg, .segs = segs + nseg, .qg = qp_at,
                             .out = out + t0 * od};
            Q->n_segs = pkvi_segments(qp + t0, m, p->first / bt, bt, segs + nseg);
            nseg += Q->n_segs;
            pkvi_set_runs(geo, p->layer, p->first, end, end - 1, Q);
            /* head hh of group gr of draft i goes to qg[gr][i * hg + hh] */
            for (uint32_t gr = 0; gr < g; gr++)
                for (uint32_t i = 0; i < m; i++)
                    memcpy(qp_at + ((size_t)gr * m * hg + (size_t)i * hg) * d,
                           q + (t0 + i) * qd + (size_t)gr * hg * d,
                           (size_t)hg * d * sizeof(float));
            qp_at += (size_t)g * m * hg * d;
            Q->st = st;
            st += (1 + (size_t)p->wave) * g * m * hg * (geo->cfg.head_dim_v + 2ull);
            t0 += m;
        }
        pkvi_run_sets(geo, s->exec, ns, sets, p->wave);
    }
}

pkv_status pkv_verify(pkv_session *s, uint32_t layer, uint32_t n, const int32_t *parent,
                      const float *q, const float *k, const float *v, float *out)
{
    if (!s)
        return PKV_EINVAL;
    const pkvi_geom *geo = s->geom;
    if (layer >= geo->cfg.n_layers)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_verify: layer %u, but the engine has %u",
                         layer, geo->cfg.n_layers);
    if (n == 0 || n > PKV_VERIFY_MAX_DRAFTS)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_verify: n is %u; it must be 1 to "
                         "PKV_VERIFY_MAX_DRAFTS (%u)", n, PKV_VERIFY_MAX_DRAFTS);
    if (!parent || !q || !k || !v || !out)
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_verify: parent, q, k, v or out is NULL");
    if (pkvi_boundary_check(geo, s->cache, __func__) != PKV_OK)
        return PKV_ECORRUPT;
    const pkvi_btable *t = s->layers[layer];
    plan p = {.geo = geo, .layer = layer, .n = n, .parent = parent,
              .len = pkvi_btable_len(t), .first = pkvi_btable_first(t),
              .bt = geo->cfg.block_tokens};
    if (p.len > UINT64_MAX / 2) /* then len + n + bt cannot wrap below */
        return pkvi_fail(s->errs, PKV_EINVAL, "pkv_verify: layer %u holds %llu positions, "
                         "2^63 or more", layer, (unsigned long long)p.len);

    /* the tree: shape, images, pointer pool */
    uint32_t *meta = malloc((size_t)n * (4 * sizeof(uint32_t) + sizeof(uint64_t)));
    if (!meta)
        return pkvi_fail(s->errs, PKV_ENOMEM, "pkv_verify: out of memory for %u drafts", n);
    p.depth = meta;
    p.chain = meta + n;
    p.image = meta + 2 * (size_t)n;
    p.anc = meta + 3 * (size_t)n;
    p.tail_at = (uint64_t *)(void *)(meta + 4 * (size_t)n);
    pkv_status st = plan_tree(&p, s->errs);
    if (st != PKV_OK) {
        free(meta);
        return st;
    }

    /* the sets: a tile of drafts each (one on a windowed layer: each draft's window
     * starts elsewhere), as many tiles per run as the pipeline takes */
    const uint32_t hg = geo->hg, g = geo->cfg.n_kv_heads;
    p.tile = geo->layers[layer].window ? 1 : PKVI_MAX_GROUP_HEADS / hg;
    const uint64_t n_sets = (n + p.tile - 1) / p.tile;
    p.sets_per_run = n_sets < PKVI_BATCH_MAX ? (uint32_t)n_sets : PKVI_BATCH_MAX;
    const uint64_t per_run = (uint64_t)p.sets_per_run * p.tile;
    p.run_heads = (per_run < n ? per_run : n) * hg;
    const uint64_t last_page = (p.len + n - 1) / p.bt; /* depth < n */
    const uint64_t chunks = pkvi_split_chunks(geo, last_page + 1) + geo->sink_chunks_max;

    /* one block: images, image pointers, the drafts' pages, segments, queries and
     * states (cache-line aligned parts) */
    uint64_t b_img = 0, b_pool = 0, b_qp = 0, b_seg = 0, b_q = 0, total = 0;
    bool ok = pkvi_mul(p.n_images, geo->page_bytes, &b_img) && round64(b_img, &b_img) &&
              pkvi_mul(p.n_tail, sizeof(void *), &b_pool) && round64(b_pool, &b_pool) &&
              round64((uint64_t)n * sizeof(pkvi_qpages), &b_qp) &&
              round64((4ull * n + 4) * sizeof(pkvi_seg), &b_seg);
    /* the wave: as many chunks' states as fit beside the rest in the batch scratch */
    const uint64_t qf = (uint64_t)g * p.run_heads * geo->cfg.head_dim;
    const uint64_t small = ok ? (b_img + b_pool + b_qp + b_seg) / sizeof(float) + 16 : 0;
    const uint64_t cap = PKVI_BATCH_SCRATCH_BYTES / sizeof(float);
    p.wave = pkvi_wave_for(geo, p.run_heads, cap > qf + small ? cap - qf - small : 0);
    if (chunks < p.wave)
        p.wave = (uint32_t)chunks;
    uint64_t sf;
    ok = ok && pkvi_mul((1 + (uint64_t)p.wave) * g, p.run_heads * (geo->cfg.head_dim_v + 2ull),
                        &sf) &&
         pkvi_add(sf, qf, &b_q) && pkvi_mul(b_q, sizeof(float), &b_q) && round64(b_q, &b_q) &&
         pkvi_add(b_img, b_pool, &total) && pkvi_add(total, b_qp, &total) &&
         pkvi_add(total, b_seg, &total) && pkvi_add(total, b_q, &total) &&
         total <= SIZE_MAX;
    bool own = true; /* no block yet: put back is free(NULL) */
    char *block = ok ? pkvi_exec_block_take(s->exec, total, &own) : NULL;
    int32_t *tree = block ? pkvi_drafts_copy(s, n, parent) : NULL;
    if (!tree || pkvi_drafts_ready(s) != PKV_OK) {
        free(tree);
        pkvi_exec_block_put(s->exec, block, own);
        free(meta);
        return pkvi_fail(s->errs, PKV_ENOMEM, "pkv_verify: out of memory for %u drafts", n);
    }
    char *images = block;
    const void **pool = (const void **)(void *)(block + b_img);
    pkvi_qpages *qp = (pkvi_qpages *)(void *)(block + b_img + b_pool);
    pkvi_seg *segs = (pkvi_seg *)(void *)(block + b_img + b_pool + b_qp);
    float *qg = (float *)(void *)(block + b_img + b_pool + b_qp + b_seg);

    /* the layer in memory and pinned, then every page the n rows need */
    pkvi_reservation r;
    st = pkvi_session_acquire(s, layer, "pkv_verify");
    if (st == PKV_OK) {
        st = pkvi_session_reserve_drafts(s, layer, n, &r);
        if (st != PKV_OK)
            pkvi_session_release(s, layer);
    }
    if (st != PKV_OK) {
        free(tree);
        pkvi_exec_block_put(s->exec, block, own);
        free(meta);
        return st;
    }
    /* nothing fails from here on */
    pkvi_session_write_drafts(s, &r, n, p.depth, k, v);
    place(&p, pkvi_btable_data(t), images, pool, qp);
    attend(&p, s, qp, q, out, segs, qg);
    pkvi_session_finish(s, &r);
    pkvi_session_release(s, layer);
    pkvi_drafts_set(s, layer, tree);
    pkvi_exec_block_put(s->exec, block, own);
    free(meta);
    return PKV_OK;
}

/*
 * fuzz_api.c - libFuzzer harness: the input bytes are a geometry and a sequence of API
 * calls (create, append, decode, batch decode, fork, truncate, save/load, destroy, a
 * verify of a draft tree with the commit of one of its paths) over
 * a few sessions, with or without a budget and spill. Every result is checked against
 * a trivial model (contiguous per-layer histories and a double-precision dense
 * reference), and the engine's invariants are checked after every call.
 *
 * A failed check calls __builtin_trap() so libFuzzer records the input.
 * Build: meson setup build-fuzz -Dfuzz=true (clang); see docs/reliability.md.
 */
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Scratch files live on tmpfs when the machine has one: save's fsyncs then cost
 * nothing, and the fuzzer runs hundreds of times faster than on a disk. */
static const char *scratch_dir(void)
{
    return access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
}

#define NS 4
#define MAXL 3
#define MAXGD 64    /* g * d <= 4 * 16 */
#define MAXQD 256   /* h * d <= 16 * 16 */
#define MAXT 256    /* tokens per layer the model keeps */

#define CHECK(c)                                                                     \
    do {                                                                             \
        if (!(c)) {                                                                  \
            fprintf(stderr, "fuzz_api: check failed: %s (line %d)\n", #c, __LINE__);   \
            __builtin_trap();                                                        \
        }                                                                            \
    } while (0)

typedef struct {
    const uint8_t *p;
    size_t n;
} reader;

static uint8_t byte(reader *r)
{
    if (!r->n)
        return 0;
    r->n--;
    return *r->p++;
}

typedef struct {
    uint32_t len;
    float K[MAXT][MAXGD], V[MAXT][MAXGD];
} layer_model;

typedef struct {
    pkv_session *s;
    layer_model L[MAXL];
} slot;

static slot slots[NS];
static uint32_t nl, g, hg, h, d;
static pkv_dtype dt;

static float value(reader *r)
{
    return ((float)byte(r) - 128.0f) / 32.0f; /* [-4, 4) in steps of 1/32 */
}

static void expect_decode(pkv_session *s, const layer_model *L, const float *q,
                          const float *out)
{
    uint32_t gd = g * d;
    double vmax = 0;
    for (uint32_t t = 0; t < L->len; t++)
        for (uint32_t c = 0; c < gd; c++)
            vmax = fmax(vmax, fabs(pkv_dtype_round(dt, L->V[t][c])));
    for (uint32_t i = 0; i < h; i++) {
        uint32_t grp = i / hg;
        double w[MAXT], mx = -INFINITY, sum = 0;
        for (uint32_t t = 0; t < L->len; t++) {
            double sc = 0;
            for (uint32_t c = 0; c < d; c++)
                sc += (double)q[i * d + c] * pkv_dtype_round(dt, L->K[t][grp * d + c]);
            w[t] = sc / sqrt((double)d);
            mx = fmax(mx, w[t]);
        }
        for (uint32_t t = 0; t < L->len; t++)
            sum += (w[t] = exp(w[t] - mx));
        for (uint32_t c = 0; c < d; c++) {
            double o = 0;
            for (uint32_t t = 0; t < L->len; t++)
                o += w[t] / sum * pkv_dtype_round(dt, L->V[t][grp * d + c]);
            CHECK(fabs(o - out[i * d + c]) <= 1e-5 * vmax + 1e-30);
        }
    }
    (void)s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size};
    nl = 1 + byte(&r) % MAXL;
    g = 1 + byte(&r) % 4;
    hg = 1 + byte(&r) % 4;
    h = g * hg;
    d = 1 + byte(&r) % 16;
    uint32_t bt = 1 + byte(&r) % 8;
    dt = (pkv_dtype)(byte(&r) % 3);
    uint8_t mode = byte(&r) % 3; /* 0: unlimited, 1: budget, 2: budget + spill */
    uint32_t budget_pages = 2 + byte(&r) % 16;

    pkv_config c = pkv_config_default();
    c.n_layers = nl;
    c.n_heads = h;
    c.n_kv_heads = g;
    c.head_dim = d;
    c.block_tokens = bt;
    c.kv_dtype = dt;
    c.n_threads = 1 + byte(&r) % 3;
    uint64_t page_bytes = 2ull * g * bt * d * pkv_dtype_size(dt);
    if (mode)
        c.mem_budget = budget_pages * page_bytes;
    if (mode == 2)
        c.spill_dir = scratch_dir();
    pkv_engine *e = NULL;
    CHECK(pkv_engine_create(&c, &e) == PKV_OK);
    memset(slots, 0, sizeof slots);

    char path[64];
    snprintf(path, sizeof path, "%s/pkv-fuzz-api-%d.pkv", scratch_dir(), (int)getpid());
    float k[MAXGD], v[MAXGD], q[MAXQD], out[MAXQD], out2[MAXQD];

    for (int ops = 0; r.n && ops < 400; ops++) {
        uint8_t op = byte(&r) % 9;
        slot *S = &slots[byte(&r) % NS];
        uint32_t layer = byte(&r) % nl;
        if (!S->s && op != 0)
            op = 0;
        switch (op) {
        case 0: /* create */
            if (!S->s) {
                CHECK(pkv_session_create(e, &S->s) == PKV_OK);
                memset(S->L, 0, sizeof S->L);
            }
            break;
        case 1: { /* append */
            for (uint32_t x = 0; x < g * d; x++) {
                k[x] = value(&r);
                v[x] = value(&r);
            }
            pkv_status st = pkv_append(S->s, layer, k, v);
            layer_model *L = &S->L[layer];
            if (st == PKV_OK && L->len < MAXT) {
                memcpy(L->K[L->len], k, sizeof k);
                memcpy(L->V[L->len], v, sizeof v);
                L->len++;
            } else if (st == PKV_OK) { /* the model is full: undo in the engine */
                CHECK(pkv_session_len(S->s, layer) == (uint64_t)MAXT + 1);
                /* truncate all layers to MAXT keeps the model exact */
                CHECK(pkv_session_truncate(S->s, MAXT) == PKV_OK);
            } else {
                CHECK(st == PKV_ENOMEM && mode != 0);
            }
            CHECK(pkv_session_len(S->s, layer) == L->len);
            break;
        }
        case 2: { /* decode */
            for (uint32_t x = 0; x < h * d; x++)
                q[x] = value(&r);
            pkv_status st = pkv_decode(S->s, layer, q, out);
            if (S->L[layer].len == 0)
                CHECK(st == PKV_ESTATE);
            else if (st == PKV_OK)
                expect_decode(S->s, &S->L[layer], q, out);
            else
                CHECK(st == PKV_ENOMEM && mode == 2);
            break;
        }
        case 3: { /* fork into another slot */
            slot *D = &slots[byte(&r) % NS];
            if (D == S)
                break;
            pkv_session_destroy(D->s);
            D->s = NULL;
            CHECK(pkv_session_fork(S->s, &D->s) == PKV_OK);
            memcpy(D->L, S->L, sizeof S->L);
            break;
        }
        case 4: { /* truncate */
            uint32_t n = byte(&r), mx = 0;
            for (uint32_t l = 0; l < nl; l++)
                mx = S->L[l].len > mx ? S->L[l].len : mx;
            pkv_status st = pkv_session_truncate(S->s, n);
            CHECK(st == (n > mx ? PKV_ERANGE : PKV_OK));
            if (st == PKV_OK)
                for (uint32_t l = 0; l < nl; l++)
                    S->L[l].len = S->L[l].len < n ? S->L[l].len : n;
            break;
        }
        case 5: /* destroy */
            pkv_session_destroy(S->s);
            S->s = NULL;
            break;
        case 6: { /* save, load, compare */
            pkv_status st = pkv_session_save(S->s, path);
            CHECK(st == PKV_OK || (st == PKV_ENOMEM && mode == 2));
            if (st != PKV_OK)
                break;
            pkv_session *t = NULL;
            st = pkv_session_load(e, path, &t);
            unlink(path);
            CHECK(st == PKV_OK || (st == PKV_ENOMEM && mode != 0));
            if (st != PKV_OK)
                break;
            for (uint32_t l = 0; l < nl; l++)
                CHECK(pkv_session_len(t, l) == S->L[l].len);
            if (S->L[layer].len) {
                for (uint32_t x = 0; x < h * d; x++)
                    q[x] = value(&r);
                pkv_status a = pkv_decode(S->s, layer, q, out);
                pkv_status b = pkv_decode(t, layer, q, out2);
                if (a == PKV_OK && b == PKV_OK)
                    CHECK(memcmp(out, out2, (size_t)h * d * sizeof(float)) == 0);
            }
            pkv_session_destroy(S->s);
            S->s = t;
            break;
        }
        case 7: { /* batch decode of every live, non-empty session == single decodes */
            pkv_session *ss[NS];
            float qs[NS][MAXQD], bo[NS][MAXQD];
            uint32_t n = 0;
            for (uint32_t i = 0; i < NS; i++)
                if (slots[i].s && slots[i].L[layer].len) {
                    ss[n] = slots[i].s;
                    for (uint32_t x = 0; x < h * d; x++)
                        qs[n][x] = value(&r);
                    n++;
                }
            if (!n)
                break;
            /* q and out are [n][h][d]: pack densely */
            float qp[NS * MAXQD], op_[NS * MAXQD];
            for (uint32_t i = 0; i < n; i++)
                memcpy(qp + i * h * d, qs[i], (size_t)h * d * sizeof(float));
            pkv_status st = pkv_decode_batch(e, layer, n, ss, qp, op_);
            if (st != PKV_OK) {
                CHECK(st == PKV_ENOMEM && mode == 2);
                break;
            }
            for (uint32_t i = 0; i < n; i++) {
                if (pkv_decode(ss[i], layer, qs[i], bo[i]) == PKV_OK)
                    CHECK(memcmp(bo[i], op_ + i * h * d, (size_t)h * d * sizeof(float)) == 0);
            }
            break;
        }
        case 8: { /* verify a tree on every layer, then commit a path of it */
            enum { ND = 6 };
            const uint32_t n = 1 + byte(&r) % ND;
            int32_t parent[ND];
            float dk[ND][MAXGD], dv_[ND][MAXGD], dq[ND][MAXQD], dout[ND * MAXQD];
            for (uint32_t i = 0; i < n; i++) {
                parent[i] = (int32_t)(byte(&r) % (i + 1)) - 1;
                for (uint32_t x = 0; x < g * d; x++) {
                    dk[i][x] = value(&r);
                    dv_[i][x] = value(&r);
                }
                for (uint32_t x = 0; x < h * d; x++)
                    dq[i][x] = value(&r);
            }
            /* the drafts' rows, packed [n][g][d] and [n][h][d] */
            float kp[ND * MAXGD], vp[ND * MAXGD], qp[ND * MAXQD];
            for (uint32_t i = 0; i < n; i++) {
                memcpy(kp + i * g * d, dk[i], (size_t)g * d * sizeof(float));
                memcpy(vp + i * g * d, dv_[i], (size_t)g * d * sizeof(float));
                memcpy(qp + i * h * d, dq[i], (size_t)h * d * sizeof(float));
            }
            bool verified[MAXL] = {false};
            for (uint32_t l = 0; l < nl; l++) {
                pkv_status st = pkv_verify(S->s, l, n, parent, qp, kp, vp, dout);
                CHECK(st == PKV_OK || (st == PKV_ENOMEM && mode != 0) ||
                      (st == PKV_EIO && mode == 2));
                verified[l] = st == PKV_OK;
                CHECK(pkv_session_len(S->s, l) == S->L[l].len);
            }
            uint32_t keep[ND], m = 0;
            for (int32_t a = (int32_t)(byte(&r) % (n + 1)) - 1; a >= 0; a = parent[a])
                keep[m++] = (uint32_t)a;
            for (uint32_t j = 0; j < m / 2; j++) { /* root first */
                const uint32_t t = keep[j];
                keep[j] = keep[m - 1 - j];
                keep[m - 1 - j] = t;
            }
            bool any = false, room = true;
            for (uint32_t l = 0; l < nl; l++) {
                any = any || verified[l];
                room = room && (!verified[l] || S->L[l].len + m <= MAXT);
            }
            if (!room)
                m = 0;
            pkv_status st = pkv_session_commit(S->s, m, keep);
            CHECK(any ? (st == PKV_OK || (mode == 2 && (st == PKV_ENOMEM || st == PKV_EIO)))
                      : st == PKV_ESTATE);
            if (st != PKV_OK && any) { /* drafts still pending: drop them */
                CHECK(pkv_session_commit(S->s, 0, NULL) == PKV_OK);
                m = 0;
            }
            for (uint32_t l = 0; l < nl; l++) {
                layer_model *L = &S->L[l];
                for (uint32_t j = 0; verified[l] && j < m; j++, L->len++) {
                    memcpy(L->K[L->len], dk[keep[j]], sizeof dk[0]);
                    memcpy(L->V[L->len], dv_[keep[j]], sizeof dv_[0]);
                }
                CHECK(pkv_session_len(S->s, l) == L->len);
            }
            if (S->L[layer].len) {
                for (uint32_t x = 0; x < h * d; x++)
                    q[x] = value(&r);
                if (pkv_decode(S->s, layer, q, out) == PKV_OK)
                    expect_decode(S->s, &S->L[layer], q, out);
            }
            break;
        }
        }
        CHECK(pkvi_engine_check(e));
    }
    for (int i = 0; i < NS; i++)
        pkv_session_destroy(slots[i].s);
    pkv_stats st;
    CHECK(pkv_engine_stats(e, &st) == PKV_OK);
    CHECK(st.pages_in_use == 0 && st.pages_spilled == 0);
    pkv_engine_destroy(e);
    return 0;
}

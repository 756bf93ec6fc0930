/*
 * quality/rows.c - what both modes of `pagedkv quality` share below them: the rows
 * (which dtype and path each is, its bytes per token, whether the engine accepts it)
 * and the engine and session a row runs on. quality/quality.c (options, model mode,
 * output) and quality/synthetic.c (the attention-only mode) both call it; it calls
 * neither, so the three files form no cycle. Public API only.
 */
#include <string.h>

#include "quality/quality.h"

const char *quality_path_name(uint32_t path)
{
    return path ? "integer" : "exact";
}

/* The rows: f32 (the self-check), then each dtype on the exact path and, for Q8/Q4,
 * on the integer path; an integer row pkv_config_explain refuses is kept as
 * unavailable with its reason. cfg is the engine config without the dtype. */
void quality_plan_rows(q_result *R, const pkv_config *cfg, uint32_t kv_heads,
                       uint32_t layers, uint32_t d)
{
    const q_opts *o = R->o;
    pkv_dtype list[9] = {PKV_F32};
    uint32_t n = 1;
    for (uint32_t i = 0; i < o->n_dtypes; i++)
        if (o->dtypes[i] != PKV_F32)
            list[n++] = o->dtypes[i];
    for (uint32_t i = 0; i < n && R->n_rows < MAX_ROWS; i++)
        for (uint32_t path = 0; path < 2 && R->n_rows < MAX_ROWS; path++) {
            const pkv_dtype dt = list[i];
            if (path && dt != PKV_Q8 && dt != PKV_Q4)
                continue;
            q_row *r = &R->rows[R->n_rows++];
            memset(r, 0, sizeof *r);
            r->dt = dt;
            r->path = path;
            r->bytes_per_token = 2ull * layers * kv_heads * pkv_row_bytes(dt, d);
            pkv_config c = *cfg;
            c.kv_dtype = dt;
            c.quant_dot = path;
            r->available = pkv_config_explain(&c, r->why, sizeof r->why) == PKV_OK;
        }
}

/* An engine and session of config c; its kernels and threads into R->isa, R->threads. */
pkv_status quality_open_engine(q_result *R, const pkv_config *c, pkv_engine **e,
                               pkv_session **s)
{
    *e = NULL;
    *s = NULL;
    pkv_status st = pkv_engine_create(c, e);
    pkv_stats stats;
    pkv_config rc;
    if (st == PKV_OK && pkv_engine_stats(*e, &stats) == PKV_OK)
        R->isa = stats.isa;
    if (st == PKV_OK && pkv_engine_config(*e, &rc) == PKV_OK)
        R->threads = rc.n_threads;
    if (st == PKV_OK)
        st = pkv_session_create(*e, s);
    return st;
}

void quality_close_engine(pkv_engine **e, pkv_session **s)
{
    pkv_session_destroy(*s);
    pkv_engine_destroy(*e);
    *s = NULL;
    *e = NULL;
}

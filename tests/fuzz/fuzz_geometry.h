/*
 * fuzz_geometry.h - the engine geometry of fuzz_load, in one place: the seed files in
 * corpus/load (written by make_seeds.c) load only into an engine of exactly this shape,
 * the plain one or, for the files that carry a RoPE config (format version 5), the same
 * shape with the engine's RoPE on both layers.
 */
#ifndef PKV_FUZZ_GEOMETRY_H
#define PKV_FUZZ_GEOMETRY_H

#include "pagedkv.h"

#include <string.h>

/* 2 layers, h 4, g 2, d 8, 4-token pages, f16, one thread. */
static inline pkv_config pkvf_load_config(void)
{
    pkv_config c = pkv_config_default();
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 8;
    c.block_tokens = 4;
    c.kv_dtype = PKV_F16;
    c.n_threads = 1;
    return c;
}

/* The same shape with RoPE: layer 0 split halves over the whole head, layer 1 adjacent
 * pairs over half of it (lc [2], which the config points at). */
static inline pkv_config pkvf_load_rope_config(pkv_layer_config *lc)
{
    pkv_config c = pkvf_load_config();
    memset(lc, 0, 2 * sizeof *lc);
    lc[0].rope = PKV_ROPE_NEOX;
    lc[1].rope = PKV_ROPE_NORM;
    lc[1].rope_dims = 4;
    lc[1].rope_theta = 500000.0f;
    c.layer_cfg = lc;
    return c;
}

#endif

/*
 * fuzz_geometry.h - the engine geometry of fuzz_load, in one place: the seed files in
 * corpus/load (written by make_seeds.c) load only into an engine of exactly this shape.
 */
#ifndef PKV_FUZZ_GEOMETRY_H
#define PKV_FUZZ_GEOMETRY_H

#include "pagedkv.h"

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

#endif

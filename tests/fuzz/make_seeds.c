/*
 * make_seeds.c - writes the seed corpora of the fuzz harnesses:
 *   corpus/load: valid session files of fuzz_load's geometry (empty, one token, partial
 *                last pages, layers of different lengths, a shard: format version 4),
 *                f16; and one of its RoPE engine after a discard (version 5: the RoPE
 *                config, the token record ended at the discard's p0);
 *   corpus/api:  byte programs that exercise every operation of fuzz_api.
 * Usage: make_seeds DIR   (writes the files DIR/load/NAME and DIR/api/NAME)
 */
#include "pagedkv.h"
#include "fuzz_geometry.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int save_case(pkv_engine *e, const char *dir, const char *name, uint64_t first,
                     uint32_t len0, uint32_t len1)
{
    pkv_session *s;
    if (pkv_session_create(e, &s) != PKV_OK)
        return 1;
    if (pkv_session_set_first(s, first) != PKV_OK)
        return 1;
    float k[16], v[16];
    for (uint32_t t = 0; t < len0 || t < len1; t++) {
        for (int i = 0; i < 16; i++) {
            k[i] = (float)((t * 7 + (uint32_t)i * 3) % 11) - 5.0f;
            v[i] = (float)((t * 5 + (uint32_t)i) % 9) * 0.25f;
        }
        if (t < len0 && pkv_append(s, 0, k, v) != PKV_OK)
            return 1;
        if (t < len1 && pkv_append(s, 1, k, v) != PKV_OK)
            return 1;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/load/%s", dir, name);
    pkv_status st = pkv_session_save(s, path);
    pkv_session_destroy(s);
    if (st != PKV_OK)
        fprintf(stderr, "save %s: %s\n", path, pkv_status_str(st));
    return st != PKV_OK;
}

/* A session of the RoPE engine: 14 tokens on both layers, their ids recorded, then
 * positions [3, 7) discarded (the later keys re-rotated; the record ends at 3). */
static int save_rope_case(const char *dir, const char *name)
{
    pkv_layer_config lc[2];
    pkv_config c = pkvf_load_rope_config(lc);
    pkv_engine *e;
    if (pkv_engine_create(&c, &e) != PKV_OK)
        return 1;
    pkv_session *s = NULL;
    pkv_status st = pkv_session_create(e, &s);
    float k[16], v[16];
    int32_t ids[14];
    for (uint32_t t = 0; t < 14 && st == PKV_OK; t++) {
        for (int i = 0; i < 16; i++) {
            k[i] = (float)((t * 5 + (uint32_t)i * 7) % 13) * 0.5f - 3.0f;
            v[i] = (float)((t * 3 + (uint32_t)i) % 7) * 0.125f;
        }
        ids[t] = (int32_t)(t * 37 % 100);
        st = pkv_append(s, 0, k, v);
        if (st == PKV_OK)
            st = pkv_append(s, 1, k, v);
    }
    if (st == PKV_OK)
        st = pkv_session_set_tokens(s, 14, ids);
    if (st == PKV_OK)
        st = pkv_session_discard(s, 3, 7);
    char path[512];
    snprintf(path, sizeof path, "%s/load/%s", dir, name);
    if (st == PKV_OK)
        st = pkv_session_save(s, path);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    if (st != PKV_OK)
        fprintf(stderr, "%s: %s\n", path, pkv_status_str(st));
    return st != PKV_OK;
}

static int write_bytes(const char *dir, const char *name, const unsigned char *b, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/api/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f)
        return 1;
    fwrite(b, 1, n, f);
    return fclose(f) != 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make_seeds DIR\n");
        return 2;
    }
    pkv_config c = pkvf_load_config();
    pkv_engine *e;
    if (pkv_engine_create(&c, &e) != PKV_OK)
        return 1;
    int bad = 0;
    bad |= save_case(e, argv[1], "empty.pkv", 0, 0, 0);
    bad |= save_case(e, argv[1], "one-token.pkv", 0, 1, 0);
    bad |= save_case(e, argv[1], "partial.pkv", 0, 6, 3);
    bad |= save_case(e, argv[1], "full-pages.pkv", 0, 8, 4);
    bad |= save_case(e, argv[1], "longer.pkv", 0, 21, 13);
    bad |= save_case(e, argv[1], "shard.pkv", pkv_shard_align(e), 7, 2);
    pkv_engine_destroy(e);
    bad |= save_rope_case(argv[1], "rope-discard.pkv");

    /* api programs: geometry bytes, then (op, slot, layer, payload...) */
    unsigned char p[4096];
    size_t n = 0;
    unsigned char geom[] = {1, 1, 1, 7, 2, 1, 0, 5, 1}; /* 2 layers, g=2, hg=2, d=8 */
    for (int mode = 0; mode < 3; mode++) {
        n = 0;
        memcpy(p, geom, sizeof geom);
        p[7] = (unsigned char)mode;
        n = sizeof geom;
        for (int op = 0; op < 8 && n + 600 < sizeof p; op++)
            for (int rep = 0; rep < 3; rep++) {
                p[n++] = (unsigned char)(rep == 0 ? 0 : op); /* create first */
                p[n++] = (unsigned char)rep;
                p[n++] = (unsigned char)op;
                for (int x = 0; x < 40; x++)
                    p[n++] = (unsigned char)(x * 37 + op * 11 + rep);
            }
        char name[32];
        snprintf(name, sizeof name, "program-%d", mode);
        bad |= write_bytes(argv[1], name, p, n);
    }
    return bad;
}

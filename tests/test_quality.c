/*
 * test_quality.c - `pagedkv quality` (docs/tools.md, "pagedkv quality") run as a user runs it: its
 * figures against what they must be by construction, its JSON read back, its chart checked,
 * its usage errors.
 *
 * Owns: the cases "builtin" (the built-in model, the synthetic attention-only mode,
 * the SVG and the usage errors; needs the tool) and "stories260K" (the real model;
 * needs pkvt_model_dir(): meson registers it with PKV_TEST_NEEDS=model, a SKIP
 * where the files are absent; a whole-program run leaves it out).
 *
 * What must hold, whatever the host:
 *   - the f32 row is the self-check: the same tokens through an f32 cache in one
 *     prefill give bitwise the logits of the greedy decode run, so KL is exactly 0
 *     and top-1 exactly 100% (pagedkv.h: prefill and decode are bitwise identical);
 *   - f16 moves the distributions little (KL mean < 1e-3 nats) and keeps top-1;
 *   - bytes per token are 2 * layers * kv_heads * pkv_row_bytes(dtype, head_dim);
 *   - KL figures are ordered mean <= p99 <= max, all >= 0;
 *   - in the synthetic mode the exact path is within 1e-5 (of max |out|) of the
 *     reference on rounded rows (docs/numerics.md, section 6: quantization is the only error),
 *     and the error on unrounded rows grows from f16 to bf16 to q8 to q4;
 *   - an integer row is either measured or "unavailable" with its reason.
 */
#include "testutil.h"
#include "tools_run.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ARGS(...) ((const char *[]){"quality", __VA_ARGS__, NULL})

/* The index of the row of dtype `dt` and path `path` in the JSON, or -1. */
static int find_row(const char *json, const char *dt, const char *path)
{
    const size_t n = pkvt_json_len(json, "rows");
    for (size_t i = 0; i < n; i++) {
        char k1[64], k2[64], w1[32], w2[32];
        snprintf(k1, sizeof k1, "rows[%zu].dtype", i);
        snprintf(k2, sizeof k2, "rows[%zu].path", i);
        snprintf(w1, sizeof w1, "\"%s\"", dt);
        snprintf(w2, sizeof w2, "\"%s\"", path);
        if (pkvt_json_is(json, k1, w1) && pkvt_json_is(json, k2, w2))
            return (int)i;
    }
    return -1;
}

static double row_num(const char *json, int row, const char *key)
{
    char k[96];
    snprintf(k, sizeof k, "rows[%d].%s", row, key);
    return pkvt_json_num(json, k);
}

static bool row_available(const char *json, int row)
{
    char k[96];
    snprintf(k, sizeof k, "rows[%d].available", row);
    return pkvt_json_is(json, k, "true");
}

static const pkv_dtype all_dtypes[] = {PKV_F32, PKV_F16, PKV_BF16, PKV_Q8, PKV_Q4};

/* The checks every model-mode JSON passes (see the file comment). */
static void check_model_json(const char *json, uint64_t positions)
{
    ck_assert_msg(pkvt_json_valid(json), "quality --json is not valid JSON: %s", json);
    ck_assert(pkvt_json_is(json, "tool", "\"pagedkv\"") &&
              pkvt_json_is(json, "command", "\"quality\""));
    ck_assert(pkvt_json_is(json, "mode", "\"model\""));
    ck_assert_uint_eq(pkvt_json_u64(json, "positions"), positions);
    const uint64_t L = pkvt_json_u64(json, "layers"), g = pkvt_json_u64(json, "kv_heads"),
                   d = pkvt_json_u64(json, "head_dim");
    for (size_t i = 0; i < sizeof all_dtypes / sizeof all_dtypes[0]; i++) {
        const pkv_dtype dt = all_dtypes[i];
        for (int path = 0; path < 2; path++) {
            const int r = find_row(json, pkv_dtype_name(dt), path ? "integer" : "exact");
            if (path && dt != PKV_Q8 && dt != PKV_Q4) {
                ck_assert_int_eq(r, -1);
                continue;
            }
            ck_assert_msg(r >= 0, "no %s %s row", pkv_dtype_name(dt), path ? "integer" : "exact");
            char k[64];
            snprintf(k, sizeof k, "rows[%d].bytes_per_token", r);
            ck_assert_uint_eq(pkvt_json_u64(json, k), 2 * L * g * pkv_row_bytes(dt, (uint32_t)d));
            if (!row_available(json, r)) {
                /* only the integer path may be missing, and it says why */
                ck_assert_int_eq(path, 1);
                snprintf(k, sizeof k, "rows[%d].reason", r);
                ck_assert_msg(pkvt_json_find(json, k)[0] == '"', "no reason: %s", json);
                continue;
            }
            const double mean = row_num(json, r, "kl_mean"), p99 = row_num(json, r, "kl_p99"),
                         mx = row_num(json, r, "kl_max"), top1 = row_num(json, r, "top1");
            ck_assert_msg(mean >= 0 && mean <= p99 * (1 + 1e-9) + 1e-300 && p99 <= mx,
                          "%s: KL mean %g, p99 %g, max %g", pkv_dtype_name(dt), mean, p99, mx);
            ck_assert(top1 >= 0 && top1 <= 1);
            /* the flips are the positions top-1 misses; a margin exists only with a flip */
            const double flips = row_num(json, r, "top1_flips"),
                         margin = row_num(json, r, "top1_flip_margin_max"),
                         npos = (double)pkvt_json_u64(json, "positions");
            ck_assert_msg(flips == (double)(uint64_t)flips && flips == round((1 - top1) * npos),
                          "%s: %g flips, top-1 %g of %g", pkv_dtype_name(dt), flips, top1, npos);
            ck_assert_msg(margin >= 0 && (margin > 0) == (flips > 0) && margin < 100,
                          "%s: %g flips, margin %g", pkv_dtype_name(dt), flips, margin);
            ck_assert(row_num(json, r, "attn_max_abs") >= 0);
        }
    }
    const int f32 = find_row(json, "f32", "exact"), f16 = find_row(json, "f16", "exact");
    /* the self-check: exactly the greedy run's logits */
    ck_assert_msg(row_num(json, f32, "kl_max") == 0 && row_num(json, f32, "top1") == 1,
                  "f32 against itself: KL max %g, top-1 %g", row_num(json, f32, "kl_max"),
                  row_num(json, f32, "top1"));
    ck_assert_msg(row_num(json, f32, "attn_rel") < 1e-5, "f32 attention error %g",
                  row_num(json, f32, "attn_rel"));
    ck_assert_msg(row_num(json, f16, "kl_mean") < 1e-3 && row_num(json, f16, "top1") >= 0.95,
                  "f16: KL mean %g, top-1 %g", row_num(json, f16, "kl_mean"),
                  row_num(json, f16, "top1"));
}

START_TEST(builtin_model)
{
    pkvt_proc p = pkvt_tool(ARGS("--json", "-n", "64", "--threads", "1"), NULL);
    ck_assert_msg(p.status == 0, "quality: exit %d: %s", p.status, p.err);
    check_model_json(p.out, 64);
    ck_assert(pkvt_json_is(p.out, "model", "null"));
    ck_assert(pkvt_json_is(p.out, "text", "null"));
    pkvt_proc_free(&p);

    /* the table: a line per dtype and path, the self-check visible */
    p = pkvt_tool(ARGS("-n", "32"), NULL);
    ck_assert_msg(p.status == 0, "quality: exit %d: %s", p.status, p.err);
    ck_assert_msg(has(p.out, "\nf32   exact ") && has(p.out, "100.00%") &&
                      has(p.out, "\nf16   exact ") && has(p.out, "\nbf16  exact ") &&
                      has(p.out, "\nq8    exact ") && has(p.out, "\nq8    integer ") &&
                      has(p.out, "\nq4    exact ") && has(p.out, "\nq4    integer ") &&
                      has(p.out, "32 positions"),
                  "quality table: %s", p.out);
    pkvt_proc_free(&p);

    /* --dtype picks the rows (f32, the reference, is always there) */
    p = pkvt_tool(ARGS("--json", "-n", "16", "--dtype", "q4"), NULL);
    ck_assert_msg(p.status == 0, "quality: exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_len(p.out, "rows"), 3);
    ck_assert_int_ge(find_row(p.out, "q4", "exact"), 0);
    pkvt_proc_free(&p);
}
END_TEST

/* --prompts: each line runs as -i would (its top-1 in top1_per_prompt is that of a
 * run of the line alone), and the figures are over the positions of all lines: top-1
 * the positions' agreement, so with equal lengths the mean of the prompts'. */
START_TEST(prompts_file)
{
    char dir[256], file[300];
    pkvt_scratch_dir(dir, sizeof dir, "quality-prompts");
    snprintf(file, sizeof file, "%s/prompts.txt", dir);
    static const char lines[] = "\nab\r\nzq x\n"; /* BOS alone, "ab" (CRLF), "zq x" */
    pkvt_write_file(file, lines, sizeof lines - 1);
    pkvt_proc p = pkvt_tool(ARGS("--json", "-n", "16", "--threads", "1", "--prompts", file),
                            NULL);
    ck_assert_msg(p.status == 0, "quality --prompts: exit %d: %s", p.status, p.err);
    ck_assert_uint_eq(pkvt_json_u64(p.out, "prompts"), 3);
    check_model_json(p.out, 48);
    pkvt_proc one = pkvt_tool(ARGS("--json", "-n", "16", "--threads", "1", "-i", "ab"), NULL);
    ck_assert_msg(one.status == 0, "quality -i ab: exit %d: %s", one.status, one.err);
    ck_assert_uint_eq(pkvt_json_u64(one.out, "prompts"), 1);
    const size_t rows = pkvt_json_len(p.out, "rows");
    for (size_t i = 0; i < rows; i++) {
        if (!row_available(p.out, (int)i))
            continue;
        char k[96];
        snprintf(k, sizeof k, "rows[%zu].top1_per_prompt", i);
        ck_assert_uint_eq(pkvt_json_len(p.out, k), 3);
        double sum = 0, t[3];
        for (int j = 0; j < 3; j++) {
            snprintf(k, sizeof k, "rows[%zu].top1_per_prompt[%d]", i, j);
            t[j] = pkvt_json_num(p.out, k);
            sum += t[j];
        }
        ck_assert_msg(fabs(row_num(p.out, (int)i, "top1") - sum / 3) < 1e-5, /* 6 digits */
                      "row %zu: top-1 %g, prompts %g %g %g", i, row_num(p.out, (int)i, "top1"),
                      t[0], t[1], t[2]);
        snprintf(k, sizeof k, "rows[%zu].top1_per_prompt[0]", i);
        ck_assert(pkvt_json_num(one.out, k) == t[1]);
        ck_assert(row_num(one.out, (int)i, "top1") == t[1]);
        ck_assert(row_num(one.out, (int)i, "kl_max") <= row_num(p.out, (int)i, "kl_max"));
    }
    pkvt_proc_free(&one);
    pkvt_proc_free(&p);

    /* the table: the per-prompt lines */
    p = pkvt_tool(ARGS("-n", "8", "--dtype", "q8", "--prompts", file), NULL);
    ck_assert_msg(p.status == 0 && has(p.out, "3 prompts of up to 8 positions: 24 positions") &&
                      has(p.out, "top-1 per prompt"),
                  "quality --prompts table: %s %s", p.out, p.err);
    pkvt_proc_free(&p);

    /* an empty file, or -i as well, is a usage error; a missing file a failure */
    pkvt_write_file(file, "", 0);
    p = pkvt_tool(ARGS("--prompts", file), NULL);
    ck_assert_msg(p.status == 2 && has(p.err, "no prompts"), "exit %d: %s", p.status, p.err);
    pkvt_proc_free(&p);
    p = pkvt_tool(ARGS("-i", "x", "--prompts", file), NULL);
    ck_assert_msg(p.status == 2 && has(p.err, "-i and --prompts"), "exit %d: %s", p.status,
                  p.err);
    pkvt_proc_free(&p);
    snprintf(file, sizeof file, "%s/missing.txt", dir);
    p = pkvt_tool(ARGS("--prompts", file), NULL);
    ck_assert_msg(p.status == 1 && has(p.err, "missing.txt"), "exit %d: %s", p.status, p.err);
    pkvt_proc_free(&p);
    pkvt_remove_dir(dir);
}
END_TEST

/* The chart: well-formed SVG with the two bar series and a bar per available row. */
START_TEST(svg_chart)
{
    char dir[256], svg[300];
    pkvt_scratch_dir(dir, sizeof dir, "quality");
    snprintf(svg, sizeof svg, "%s/kl.svg", dir);
    pkvt_proc p = pkvt_tool(ARGS("-n", "24", "--svg", svg), NULL);
    ck_assert_msg(p.status == 0, "quality --svg: exit %d: %s", p.status, p.err);
    pkvt_proc_free(&p);
    char *text = pkvt_slurp(svg, NULL), root[48];
    ck_assert_msg(xml_wellformed(text, root, sizeof root) && strcmp(root, "svg") == 0,
                  "not a well-formed SVG: %.300s", text);
    ck_assert(has(text, "<title>KL mean</title>") && has(text, "<title>KL p99</title>"));
    ck_assert(has(text, ">f16<") && has(text, ">q8<") && has(text, ">q4<"));
    size_t bars = 0;
    for (const char *t = text; (t = strstr(t, "<rect x=")); t++)
        bars++;
    /* 2 per non-f32 exact row (4 of them) at least, + legend keys and the frame */
    ck_assert_uint_ge(bars, 8);
    free(text);
    pkvt_remove_dir(dir);
}
END_TEST

START_TEST(synthetic_mode)
{
    pkvt_proc p = pkvt_tool(ARGS("--synthetic", "--json", "--ctx", "48", "--threads", "1"),
                            NULL);
    ck_assert_msg(p.status == 0, "quality --synthetic: exit %d: %s", p.status, p.err);
    const char *j = p.out;
    ck_assert_msg(pkvt_json_valid(j), "not JSON: %s", j);
    ck_assert(pkvt_json_is(j, "mode", "\"synthetic\""));
    ck_assert_uint_eq(pkvt_json_len(j, "outlier_channels"), 4);
    ck_assert(pkvt_json_num(j, "max_abs_out") > 0);
    double prev = -1;
    for (size_t i = 0; i < sizeof all_dtypes / sizeof all_dtypes[0]; i++) {
        const int r = find_row(j, pkv_dtype_name(all_dtypes[i]), "exact");
        ck_assert(r >= 0 && row_available(j, r));
        char k[64];
        snprintf(k, sizeof k, "rows[%d].bytes_per_token", r);
        ck_assert_uint_eq(pkvt_json_u64(j, k), 2 * 8 * pkv_row_bytes(all_dtypes[i], 128));
        /* quantization is the only error of the exact path */
        const double rounded = row_num(j, r, "err_vs_rounded"),
                     raw = row_num(j, r, "err_vs_unrounded");
        ck_assert_msg(rounded < 1e-5, "%s: %g against the rounded reference",
                      pkv_dtype_name(all_dtypes[i]), rounded);
        /* the engine's total error is the format's: the reference on rounded rows */
        ck_assert(fabs(raw - row_num(j, r, "err_ref_rounded")) < 1e-5);
        ck_assert_msg(raw > prev || (i == 0 && raw < 1e-5), "%s: error %g after %g",
                      pkv_dtype_name(all_dtypes[i]), raw, prev);
        prev = raw;
        if (all_dtypes[i] == PKV_F32)
            ck_assert(row_num(j, r, "k_rms_rel") == 0 && row_num(j, r, "err_k_only") == 0);
        else
            ck_assert(row_num(j, r, "k_rms_rel") > 0 && row_num(j, r, "v_rms_rel") > 0);
    }
    /* the outliers make K the larger part of the error of the block types */
    const int q8 = find_row(j, "q8", "exact");
    ck_assert(row_num(j, q8, "err_k_only") > row_num(j, q8, "err_v_only"));
    pkvt_proc_free(&p);

    p = pkvt_tool(ARGS("--synthetic", "--ctx", "16", "--outliers", "0"), NULL);
    ck_assert_msg(p.status == 0 && has(p.out, "0 channels") && has(p.out, "engine/rnd"),
                  "quality --synthetic table: %s %s", p.out, p.err);
    pkvt_proc_free(&p);
}
END_TEST

START_TEST(usage)
{
    static const struct { const char *args[6]; const char *says; } rows[] = {
        {{"--dtype", "q9"}, "--dtype: 'q9' is not"},
        {{"--dtype", "q8,,f16"}, "--dtype"},
        {{"--synthetic", "--model", "x.bin"}, "--synthetic runs no model"},
        {{"--synthetic", "--prompts", "p.txt"}, "--synthetic runs no model"},
        {{"--svg", "/tmp"}, "is a directory"},
        {{"--ctx", "0", "--synthetic"}, "--ctx"},
        {{"--outliers", "99", "--synthetic"}, "--outliers"},
        {{"-n", "0"}, "-n"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        const char *argv[8] = {"quality"};
        for (size_t k = 0; rows[i].args[k]; k++)
            argv[k + 1] = rows[i].args[k];
        pkvt_proc p = pkvt_tool(argv, NULL);
        ck_assert_msg(p.status == 2 && has(p.err, rows[i].says), "quality %s: exit %d: %s",
                      rows[i].args[0], p.status, p.err);
        pkvt_proc_free(&p);
    }
    pkvt_proc p = pkvt_tool(ARGS("--model", "/nonexistent/m.bin"), NULL);
    ck_assert_msg(p.status == 1 && has(p.err, "/nonexistent/m.bin"), "exit %d: %s", p.status,
                  p.err);
    pkvt_proc_free(&p);
    p = pkvt_tool(ARGS("--help"), NULL);
    ck_assert(p.status == 0 && has(p.out, "usage: pagedkv quality") &&
              has(p.out, "--synthetic") && has(p.out, "--svg"));
    pkvt_proc_free(&p);
}
END_TEST

/* stories260K, 256 positions greedy: the figures docs/tools.md ("pagedkv quality") reports. Q8's
 * top-1 target (>= 99%) is a target of the format, not of this tool: asserted loosely. */
START_TEST(stories260K)
{
    char model[4096], tok[4096];
    ck_assert_msg(pkvt_model_paths(model, tok, sizeof model), "no model in %s",
                  pkvt_model_dir());
    pkvt_proc p = pkvt_tool(ARGS("--model", model, "--tokenizer", tok, "--json"), NULL);
    ck_assert_msg(p.status == 0, "quality --model: exit %d: %s", p.status, p.err);
    const uint64_t n = pkvt_json_u64(p.out, "positions");
    ck_assert(n > 16 && n <= 256);
    check_model_json(p.out, n);
    ck_assert_msg(pkvt_json_find(p.out, "text")[0] == '"', "no text");
    const int q8 = find_row(p.out, "q8", "exact");
    ck_assert_msg(row_num(p.out, q8, "top1") >= 0.95, "q8 top-1 %g",
                  row_num(p.out, q8, "top1"));
    pkvt_proc_free(&p);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("quality");
    TCase *tb = tcase_create("builtin");
    tcase_set_timeout(tb, 240);
    tcase_add_test(tb, builtin_model);
    tcase_add_test(tb, prompts_file);
    tcase_add_test(tb, svg_chart);
    tcase_add_test(tb, synthetic_mode);
    tcase_add_test(tb, usage);
    suite_add_tcase(s, tb);
    TCase *tm = tcase_create("stories260K");
    tcase_set_timeout(tm, 240);
    tcase_add_test(tm, stories260K);
    pkvt_add_tcase_needing(s, tm, "stories260K", "model");
    return pkvt_run(s);
}

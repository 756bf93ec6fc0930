/*
 * test_testutil.c - the shared test helpers (testutil.c) hold what the suites rely on:
 * the RNG is the documented xorshift64*, the oracle is softmax attention, the JSON
 * reader finds nested values and rejects malformed text, the spawner captures output
 * and applies environment changes.
 *
 * Owns: checks of testutil.c only; the runner's skip rules are meson tests
 * (runner-* in tests/meson.build).
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

START_TEST(rng_is_xorshift64star)
{
    /* xorshift64* (Vigna): x ^= x >> 12; x ^= x << 25; x ^= x >> 27; x * 2685821657736338717 */
    pkvt_rng r;
    pkvt_rng_init(&r, 1);
    uint64_t x = 1;
    for (int i = 0; i < 1000; i++) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        ck_assert_uint_eq(pkvt_next(&r), x * 2685821657736338717ull);
    }
    pkvt_rng_init(&r, 7);
    for (int i = 0; i < 10000; i++) {
        ck_assert_uint_lt(pkvt_below(&r, 13), 13);
        const float u = pkvt_uniform(&r, -2.0f, 3.0f);
        ck_assert(u >= -2.0f && u <= 3.0f);
    }
    ck_assert_uint_eq(pkvt_below(&r, 0), 0);
}
END_TEST

START_TEST(oracle_is_softmax_attention)
{
    /* one head, d = 1, scale 1: keys 0 and ln 3 weigh the values 1 : 3 */
    const double q[1] = {1.0}, K[2] = {0.0, log(3.0)}, V[2] = {2.0, 6.0};
    double out[1];
    pkvt_oracle_decode(1, 1, 1, 1.0, 2, q, K, V, out);
    ck_assert_double_eq_tol(out[0], (1 * 2.0 + 3 * 6.0) / 4, 1e-12);
    /* GQA: 4 heads over 2 groups, head i reads group i / 2; constant V per group */
    double q4[4] = {0.1, 0.2, 0.3, 0.4}, K2[2 * 2] = {1, 2, 3, 4}, V2[2 * 2] = {5, 7, 5, 7};
    double o4[4];
    pkvt_oracle_decode(4, 2, 1, 0, 2, q4, K2, V2, o4);
    ck_assert_double_eq_tol(o4[0], 5, 1e-12);
    ck_assert_double_eq_tol(o4[1], 5, 1e-12);
    ck_assert_double_eq_tol(o4[2], 7, 1e-12);
    ck_assert_double_eq_tol(o4[3], 7, 1e-12);
    /* causal row t equals the decode over 0..t; huge scores stay finite */
    const double Q[3] = {1e4, 1e4, 1e4}, Kc[3] = {1, 2, 3}, Vc[3] = {1, 2, 3};
    double oc[3];
    pkvt_oracle_causal(3, 1, 1, 1, 1.0, Q, Kc, Vc, oc);
    ck_assert_double_eq(oc[0], 1);
    ck_assert_double_eq_tol(oc[1], 2, 1e-12);
    ck_assert_double_eq_tol(oc[2], 3, 1e-12);
}
END_TEST

START_TEST(json_paths_and_errors)
{
    const char *j = "{\"a\": 1, \"b\": {\"c\": [10, {\"d\": \"x\\\"y\"}, 2.5e1]},"
                    " \"e\": true, \"f\": null, \"g\": [], \"ab\": 3}";
    ck_assert(pkvt_json_valid(j));
    ck_assert_uint_eq(pkvt_json_u64(j, "a"), 1);
    ck_assert_uint_eq(pkvt_json_u64(j, "ab"), 3); /* not the prefix "a" */
    ck_assert_uint_eq(pkvt_json_u64(j, "b.c[0]"), 10);
    ck_assert(pkvt_json_is(j, "b.c[1].d", "\"x\\\"y\""));
    ck_assert_double_eq(pkvt_json_num(j, "b.c[2]"), 25.0);
    ck_assert_uint_eq(pkvt_json_len(j, "b.c"), 3);
    ck_assert_uint_eq(pkvt_json_len(j, "g"), 0);
    ck_assert_uint_eq(pkvt_json_len(j, ""), 6);
    ck_assert(pkvt_json_is(j, "e", "true"));
    ck_assert(!pkvt_json_is(j, "e", "tru"));
    ck_assert(pkvt_json_is(j, "f", "null"));
    ck_assert_ptr_null(pkvt_json_find(j, "b.c[3]"));
    ck_assert_ptr_null(pkvt_json_find(j, "zz"));
    ck_assert_ptr_null(pkvt_json_find(j, "a.b"));
    static const char *const bad[] = {"", "{", "{\"a\":1,}", "[1 2]", "{\"a\" 1}", "01",
                                      "1.", "\"\\q\"", "{\"a\":1} x", "[-]", "tru"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        ck_assert_msg(!pkvt_json_valid(bad[i]), "accepted %s", bad[i]);
}
END_TEST

START_TEST(spawn_captures_and_sets_env)
{
    setenv("PKVT_GONE", "still here", 1);
    const char *argv[] = {"sh", "-c",
                          "echo out:$PKVT_SET; echo err:${PKVT_GONE-unset} >&2; exit 3", NULL};
    const char *env[] = {"PKVT_SET=yes", "PKVT_GONE", NULL};
    pkvt_proc p = pkvt_spawn("/bin/sh", argv, env);
    ck_assert_int_eq(p.status, 3);
    ck_assert_str_eq(p.out, "out:yes\n");
    ck_assert_str_eq(p.err, "err:unset\n");
    ck_assert_uint_eq(p.out_len, 8);
    pkvt_proc_free(&p);
    const char *kill_self[] = {"sh", "-c", "kill -9 $$", NULL};
    p = pkvt_spawn("/bin/sh", kill_self, NULL);
    ck_assert_int_eq(p.status, 128 + 9);
    pkvt_proc_free(&p);
    unsetenv("PKVT_GONE");
}
END_TEST

START_TEST(sizes_are_checked)
{
    ck_assert_uint_eq(pkvt_mul(1u << 20, 1u << 10), 1u << 30);
    ck_assert_uint_eq(pkvt_mul(0, UINT64_MAX), 0);
}
END_TEST

/* SKIP per case: a case whose requirement is unmet is left out and the others run and
 * count; a run that selected only such cases is a skip, not a pass and not a failure.
 * The model is looked for in PKV_MODEL_DIR first, so an empty directory makes it
 * absent, and a directory with both files present. */
START_TEST(ok_case) { ck_assert(1); }
END_TEST

START_TEST(model_case) { ck_abort_msg("a case whose model is absent ran"); }
END_TEST

START_TEST(skip_per_case)
{
    char dir[] = "/tmp/pkvt-nomodel-XXXXXX";
    ck_assert(mkdtemp(dir) != NULL);
    ck_assert(setenv("PKV_MODEL_DIR", dir, 1) == 0);   /* this forked test's own env */
    ck_assert_str_eq(pkvt_model_dir(), dir);
    char m[4096], t[4096];
    ck_assert(!pkvt_model_paths(m, t, sizeof m));
    ck_assert(pkvt_need_unmet("model") != NULL);
    /* the whole program: the model case left out, the other runs and counts */
    unsetenv("CK_RUN_CASE");
    Suite *s = suite_create("inner");
    TCase *a = tcase_create("a"), *b = tcase_create("b");
    tcase_add_test(a, ok_case);
    tcase_add_test(b, model_case);
    suite_add_tcase(s, a);
    pkvt_add_tcase_needing(s, b, "b", "model");
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_SILENT);
    ck_assert_int_eq(srunner_ntests_run(sr), 1);
    ck_assert_int_eq(srunner_ntests_failed(sr), 0);
    srunner_free(sr);
    /* only the model case selected: a skip */
    ck_assert(setenv("CK_RUN_CASE", "b", 1) == 0);
    Suite *s2 = suite_create("inner2");
    TCase *b2 = tcase_create("b");
    tcase_add_test(b2, model_case);
    pkvt_add_tcase_needing(s2, b2, "b", "model");
    ck_assert_int_eq(pkvt_run(s2), PKVT_SKIP);
    unsetenv("CK_RUN_CASE");
    /* with both files there, the case is added and runs */
    char f[4200];
    snprintf(f, sizeof f, "%s/stories260K.bin", dir);
    pkvt_write_file(f, "x", 1);
    snprintf(f, sizeof f, "%s/tok512.bin", dir);
    pkvt_write_file(f, "x", 1);
    ck_assert(pkvt_need_unmet("model") == NULL);
    Suite *s3 = suite_create("inner3");
    TCase *c = tcase_create("c");
    tcase_add_test(c, ok_case);
    pkvt_add_tcase_needing(s3, c, "c", "model");
    SRunner *sr3 = srunner_create(s3);
    srunner_set_fork_status(sr3, CK_NOFORK);
    srunner_run_all(sr3, CK_SILENT);
    ck_assert_int_eq(srunner_ntests_run(sr3), 1);
    srunner_free(sr3);
    pkvt_remove_dir(dir);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("testutil");
    TCase *tc = tcase_create("testutil");
    tcase_add_test(tc, rng_is_xorshift64star);
    tcase_add_test(tc, oracle_is_softmax_attention);
    tcase_add_test(tc, json_paths_and_errors);
    tcase_add_test(tc, spawn_captures_and_sets_env);
    tcase_add_test(tc, sizes_are_checked);
    tcase_add_test(tc, skip_per_case);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}

/*
 * test_generate.c - `pagedkv generate` end to end, through the built binary (PKV_TOOL).
 *
 * What is asserted:
 *   - the synthetic default runs with no files and reports tokens/s and memory; its
 *     --check / --check-e2e pass for f32, f16, bf16 and for forked sessions; a seed
 *     fixes the sampled text and another seed changes it;
 *   - stories260K (pkvt_model_dir()): the prompt encodes as the
 *     reference tokenizer does, greedy tokens equal the ids the tool's own cache-free
 *     recompute produces (and the published anchor), the text is the expected English,
 *     greedy output is identical for every page size, thread count and session count
 *     in f32, --check passes for f32/f16/bf16, forks share exactly the prompt's full
 *     pages; UTF-8 in a prompt (byte-fallback tokens) comes back whole on stdout and in
 *     the JSON text; a prompt cut short by -n is a warning, and why generation stopped
 *     (BOS, -n, inside the prompt) is said in text and JSON;
 *   - --check warns of its cost on a long run;
 *   - malformed checkpoints and tokenizers, and bad options, fail cleanly (exit 1 or 2
 *     with a message, never a signal).
 * The "stories260K" case needs the model (pkvt_model_dir(): PKV_MODEL_DIR, meson's
 * -Dmodel_dir, else ../shared/models): meson runs it as generate-model (SKIP without
 * the files); a whole-program run leaves that case out and runs the others.
 */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- running the tool ------------------------------------------------------------ */

/* `pagedkv generate ARGS...`, for pkvt_tool. */
#define ARGS(...) ((const char *const[]){"generate", __VA_ARGS__, NULL})

/* ---- reading the JSON report (testutil's paths: "sessions[1].memory.blocks") ----- */

/* The integer array at path, into out; returns its length. */
static size_t json_ints(const char *js, const char *path, uint32_t *out, size_t cap)
{
    const size_t n = pkvt_json_len(js, path);
    ck_assert_msg(n <= cap, "\"%s\" has %zu integers, room for %zu", path, n, cap);
    char at[128];
    for (size_t i = 0; i < n; i++) {
        snprintf(at, sizeof at, "%s[%zu]", path, i);
        out[i] = (uint32_t)pkvt_json_u64(js, at);
    }
    return n;
}

/* "sessions[s].key" into buf. */
static const char *session_key(char *buf, size_t cap, int s, const char *key)
{
    snprintf(buf, cap, "sessions[%d].%s", s, key);
    return buf;
}

static int count_of(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        n++;
    return n;
}

/* ---- the real model ---------------------------------------------------------------- */

static char model_path[4096], tok_path[4096];


/* model_path and tok_path from pkvt_model_dir(). The "stories260K" case runs only where
 * they are there (pkvt_add_tcase_needing, PKV_TEST_NEEDS=model): absent, it fails. */
static void model_files(void)
{
    ck_assert_msg(pkvt_model_paths(model_path, tok_path, sizeof model_path),
                  "stories260K.bin and tok512.bin are not in %s", pkvt_model_dir());
}

/* Greedy ids of the model (llama2.c's runner gives the same): what a correct
 * loader, RoPE, GQA mapping and tokenizer give after "Once upon a time". The tool's
 * own cache-free recompute (--check-e2e's dense_generated) is asserted equal too. */
static const uint32_t anchor[16] = {432, 383, 286, 261, 376, 298, 315, 421,
                                    395, 317, 426, 338, 401, 396, 267, 337};

START_TEST(stories_greedy_text)
{
    model_files();
    pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0",
                            "-n", "64", "-i", "Once upon a time", "--check-e2e",
                            "--json"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    uint32_t pt[16], gen[128], dense[128];
    size_t np = json_ints(r.out, "prompt_tokens", pt, 16);
    ck_assert_uint_eq(np, 5);
    const uint32_t want_prompt[5] = {1, 403, 407, 261, 378};
    for (size_t i = 0; i < 5; i++)
        ck_assert_uint_eq(pt[i], want_prompt[i]);
    size_t ng = json_ints(r.out, "sessions[0].generated", gen, 128);
    size_t nd = json_ints(r.out, "sessions[0].dense_generated", dense, 128);
    ck_assert_uint_eq(ng, 64 - 5 + 1);   /* -n counts positions, prompt included */
    ck_assert_uint_eq(nd, ng);
    for (size_t i = 0; i < ng; i++)
        ck_assert_msg(gen[i] == dense[i], "step %zu: paged %u, cache-free %u", i, gen[i],
                      dense[i]);
    for (size_t i = 0; i < 16; i++)
        ck_assert_msg(gen[i] == anchor[i], "token %zu: %u, anchor %u", i, gen[i],
                      anchor[i]);
    ck_assert_msg(strstr(r.out, "\"text\": \"Once upon a time, there was a little girl "
                                "named Lily. She loved to play outside in the park.") !=
                      NULL,
                  "text: %s", r.out);
    ck_assert_double_eq(pkvt_json_num(r.out, "check_e2e.token_flips"), 0);
    pkvt_proc_free(&r);

    /* plain mode: the text on stdout, the figures on stderr */
    r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0", "-n", "40",
                 "-i", "Once upon a time"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    ck_assert_msg(strncmp(r.out, "Once upon a time, there was a little girl named Lily.",
                          53) == 0, "stdout: %s", r.out);
    ck_assert_ptr_nonnull(strstr(r.err, "tok/s"));
    ck_assert_ptr_nonnull(strstr(r.err, "resident"));
    ck_assert_ptr_null(strstr(r.out, "tok/s"));
    pkvt_proc_free(&r);
}
END_TEST

/* The greedy tokens of one configuration (session `s` of the JSON report). */
static size_t greedy_tokens(const char *const *args, int session, uint32_t *out,
                            size_t cap)
{
    pkvt_proc r = pkvt_tool(args, NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    char key[64];
    size_t n = json_ints(r.out, session_key(key, sizeof key, session, "tokens"), out, cap);
    pkvt_proc_free(&r);
    return n;
}

START_TEST(stories_greedy_invariant)
{
    model_files();
    const char *n = pkvt_quick() ? "48" : "128";
    static uint32_t base[600], other[600];
    size_t nb = greedy_tokens(ARGS("--model", model_path, "--tokenizer", tok_path, "-t",
                                   "0", "-n", n, "-i", "Once upon a time", "--json",
                                   "--dtype", "f32", "--block-tokens", "16", "--threads",
                                   "1"),
                              0, base, 600);
    ck_assert_uint_gt(nb, 40);
    const char *blocks[] = {"1", "2", "5", "16", "64", "512"};
    const char *threads[] = {"1", "2", "3"};
    size_t nbk = pkvt_quick() ? 2 : 6;
    for (size_t b = 0; b < nbk; b++) {
        for (size_t t = 0; t < 3; t++) {
            size_t no = greedy_tokens(ARGS("--model", model_path, "--tokenizer", tok_path,
                                           "-t", "0", "-n", n, "-i", "Once upon a time",
                                           "--json", "--block-tokens", blocks[b],
                                           "--threads", threads[t]),
                                      0, other, 600);
            ck_assert_msg(no == nb, "block %s threads %s: %zu tokens, expected %zu",
                          blocks[b], threads[t], no, nb);
            for (size_t i = 0; i < nb; i++)
                ck_assert_msg(other[i] == base[i],
                              "block %s threads %s: token %zu is %u, expected %u",
                              blocks[b], threads[t], i, other[i], base[i]);
        }
    }
    /* forked greedy continuations (batched decode) are the single-session tokens */
    for (int s = 0; s < 3; s++) {
        size_t no = greedy_tokens(ARGS("--model", model_path, "--tokenizer", tok_path, "-t",
                                       "0", "-n", n, "-i", "Once upon a time", "--json",
                                       "--sessions", "3", "--block-tokens", "4"),
                                  s, other, 600);
        ck_assert_uint_eq(no, nb);
        for (size_t i = 0; i < nb; i++)
            ck_assert_msg(other[i] == base[i], "session %d token %zu: %u vs %u", s, i,
                          other[i], base[i]);
    }
}
END_TEST

static const char *dtypes[] = {"f32", "f16", "bf16"};

START_TEST(stories_check_dtypes)
{
    model_files();
    const char *dt = dtypes[_i];
    pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0",
                            "-n", pkvt_quick() ? "40" : "96", "-i", "Once upon a time",
                            "--dtype", dt, "--block-tokens", "8", "--check",
                            "--check-e2e", "--json"), NULL);
    ck_assert_msg(r.status == 0, "%s: exit %d: %s", dt, r.status, r.err);
    ck_assert_ptr_nonnull(strstr(r.out, "\"check\": {\"passed\": true"));
    ck_assert_ptr_nonnull(strstr(r.out, "\"check_e2e\": {\"passed\": true"));
    /* every position of every layer was compared: 5 layers x positions */
    double rows = pkvt_json_num(r.out, "check.rows");
    double pos = pkvt_json_num(r.out, "sessions[0].positions");
    ck_assert_double_eq(rows, 5 * pos);
    ck_assert(pkvt_json_num(r.out, "check.worst_fraction_of_tolerance") <= 1.0);
    pkvt_proc_free(&r);
}
END_TEST

START_TEST(stories_forks_share_prompt)
{
    model_files();
    /* 13 prompt tokens, 4 tokens per page: 3 full pages per layer are the prompt's */
    pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "1",
                            "-s", "7", "-n", "60", "--sessions", "4", "--block-tokens",
                            "4", "-i", "Once upon a time there was a big dog named Max",
                            "--json"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    uint32_t pt[64];
    size_t P = json_ints(r.out, "prompt_tokens", pt, 64);
    ck_assert_uint_gt(P, 8);
    const double page = pkvt_json_num(r.out, "cache.page_bytes");
    const double full = (double)(P / 4) * 5;   /* shared pages: full prompt pages x L */
    double pages_sum = 0, resident_sum = 0;
    for (int s = 0; s < 4; s++) {
        char key[64];
        double shared =
            pkvt_json_num(r.out, session_key(key, sizeof key, s, "memory.bytes_shared"));
        ck_assert_msg(shared == full * page, "session %d shares %.0f bytes, expected %.0f",
                      s, shared, full * page);
        pages_sum += pkvt_json_num(r.out, session_key(key, sizeof key, s, "memory.blocks"));
        resident_sum +=
            pkvt_json_num(r.out, session_key(key, sizeof key, s, "memory.bytes_resident"));
    }
    /* the engine holds the shared pages once */
    double in_use = pkvt_json_num(r.out, "engine.pages_in_use");
    ck_assert_double_eq(in_use, pages_sum - 3 * full);
    ck_assert_double_eq(pkvt_json_num(r.out, "engine.sum_session_resident"), resident_sum);
    ck_assert(pkvt_json_num(r.out, "engine.bytes_in_use") < resident_sum);
    /* sampled continuations of one prompt with their own streams differ */
    uint32_t a[128], b[128];
    size_t na = json_ints(r.out, "sessions[0].generated", a, 128);
    size_t nb = json_ints(r.out, "sessions[1].generated", b, 128);
    ck_assert_msg(na != nb || memcmp(a, b, na * sizeof a[0]) != 0,
                  "sessions 0 and 1 sampled identical continuations");
    pkvt_proc_free(&r);
}
END_TEST

START_TEST(stories_prompt_encoding)
{
    model_files();
    static const struct {
        const char *text;
        size_t n;
        uint32_t ids[24];
    } cases[] = {
        /* merge order matters here (lowest-first or no priority gives other ids);
         * expected ids from an independent script of the README's algorithm */
        {"Lily loved to play outside in the park.", 17,
         {1, 317, 401, 396, 267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433,
          426}},
        {"The little dog was very happy and said thank you.", 15,
         {1, 291, 376, 400, 428, 286, 399, 393, 269, 336, 308, 303, 433, 364, 426}},
        {"", 1, {1}},                          /* empty prompt: BOS alone */
        {"Once upon a time", 5, {1, 403, 407, 261, 378}},
        {"\n", 3, {1, 410, 13}},               /* byte fallback: 0x0A + 3 */
        {"\xe4\xb8\xad", 5, {1, 410, 231, 187, 176}},  /* U+4E2D, not in the vocab */
        {"\xe2\x82\xac", 3, {1, 410, 503}},    /* U+20AC, a piece of its own */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-n", "1",
                                "-i", cases[c].text, "--json"), NULL);
        ck_assert_msg(r.status == 0, "case %zu: exit %d: %s", c, r.status, r.err);
        uint32_t got[64];
        size_t n = json_ints(r.out, "prompt_tokens", got, 64);
        ck_assert_msg(n == cases[c].n, "case %zu: %zu tokens, expected %zu", c, n,
                      cases[c].n);
        for (size_t i = 0; i < n; i++)
            ck_assert_msg(got[i] == cases[c].ids[i], "case %zu token %zu: %u vs %u", c, i,
                          got[i], cases[c].ids[i]);
        pkvt_proc_free(&r);
    }
    /* decoding: with -n = prompt tokens - 1 only the prompt prints, and it prints as
     * it was typed (the dummy-prefix space dropped after BOS, byte pieces raw) */
    static const struct { const char *text, *n; } echo[] = {
        {"Lily loved to play outside in the park.", "16"},
        {"a\nb", "3"},
    };
    for (size_t c = 0; c < 2; c++) {
        pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-n",
                                echo[c].n, "-i", echo[c].text), NULL);
        ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
        char want[128];
        snprintf(want, sizeof want, "%s\n", echo[c].text);
        ck_assert_str_eq(r.out, want);
        pkvt_proc_free(&r);
    }
    /* -n shorter than the prompt: only prompt positions, nothing sampled */
    pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-n", "3",
                            "-i", "Once upon a time", "--json"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    uint32_t t[16];
    ck_assert_uint_eq(json_ints(r.out, "sessions[0].tokens", t, 16), 4);
    ck_assert_uint_eq(json_ints(r.out, "sessions[0].generated", t, 16), 0);
    ck_assert_double_eq(pkvt_json_num(r.out, "sessions[0].positions"), 3);
    pkvt_proc_free(&r);
}
END_TEST

/* ---- malformed files ------------------------------------------------------------- */

static void write_tmp(char *path, const unsigned char *data, size_t n)
{
    strcpy(path, "/tmp/pkv_gen_bad_XXXXXX");
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, data, n), (ssize_t)n);
    close(fd);
}

/* The tool must exit 1 with `want` in its message for the damaged model/tokenizer. */
static void expect_fail(const char *model, const char *tok, const char *want,
                        const char *what)
{
    pkvt_proc r = pkvt_tool(ARGS("--model", model, "--tokenizer", tok, "-n", "8"), NULL);
    ck_assert_msg(r.status == 1, "%s: exit %d (want 1), stderr: %s", what, r.status, r.err);
    ck_assert_msg(strstr(r.err, want) != NULL, "%s: stderr lacks '%s': %s", what, want,
                  r.err);
    ck_assert_msg(r.out[0] == '\0', "%s: printed text: %s", what, r.out);
    pkvt_proc_free(&r);
}

START_TEST(malformed_files)
{
    model_files();
    size_t nm, nt;
    unsigned char *m = pkvt_slurp(model_path, &nm);
    unsigned char *t = pkvt_slurp(tok_path, &nt);
    pkvt_rng rng;
    pkvt_rng_init(&rng, pkvt_seed());
    char p[64];
    const size_t cuts[] = {0, 10, 28, 1000, nm / 2, nm - 4, nm - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        write_tmp(p, m, cuts[i]);
        expect_fail(p, tok_path, "truncated", "truncated model");
        unlink(p);
    }
    /* a random cut (seeded) */
    size_t cut = 28 + pkvt_below(&rng, (uint32_t)(nm - 28));
    write_tmp(p, m, cut);
    expect_fail(p, tok_path, "truncated", "randomly truncated model");
    unlink(p);
    /* trailing bytes */
    unsigned char *big = pkvt_alloc(nm + 4);
    memcpy(big, m, nm);
    write_tmp(p, big, nm + 4);
    expect_fail(p, tok_path, "trailing", "model with trailing bytes");
    unlink(p);
    free(big);
    /* bad header fields */
    static const struct { int field; int32_t value; const char *want; } hdr[] = {
        {0, 0, "malformed header"},        /* dim 0 */
        {0, -64, "malformed header"},      /* negative dim */
        {3, 7, "malformed header"},        /* n_heads does not divide dim */
        {4, 3, "malformed header"},        /* n_kv_heads does not divide n_heads */
        {4, 16, "malformed header"},       /* more KV heads than heads */
        {5, 0, "malformed header"},        /* vocab 0 */
        {5, -512, "truncated"},            /* a classifier should follow: too short */
        {2, 1 << 20, "malformed header"},  /* absurd layer count */
        {0, 0x616b3432, "version 1/2"},    /* a newer llama2.c export */
    };
    unsigned char *mm = pkvt_alloc(nm);
    for (size_t i = 0; i < sizeof hdr / sizeof hdr[0]; i++) {
        memcpy(mm, m, nm);
        pkvt_put_le32(mm + 4 * hdr[i].field, (uint32_t)hdr[i].value);
        write_tmp(p, mm, nm);
        pkvt_proc r = pkvt_tool(ARGS("--model", p, "--tokenizer", tok_path, "-n", "8"), NULL);
        ck_assert_msg(r.status == 1, "header case %zu: exit %d: %s", i, r.status, r.err);
        ck_assert_msg(strstr(r.err, hdr[i].want), "header case %zu: %s", i, r.err);
        pkvt_proc_free(&r);
        unlink(p);
    }
    /* a NaN weight */
    memcpy(mm, m, nm);
    pkvt_put_le32(mm + 28 + 4 * 1000, 0x7fc00000);
    write_tmp(p, mm, nm);
    expect_fail(p, tok_path, "non-finite", "NaN weight");
    unlink(p);
    free(mm);
    /* tokenizers: truncated anywhere, trailing bytes, bad length, missing file */
    const size_t tcuts[] = {0, 3, 4, 11, nt / 2, nt - 1};
    for (size_t i = 0; i < sizeof tcuts / sizeof tcuts[0]; i++) {
        write_tmp(p, t, tcuts[i]);
        expect_fail(model_path, p, "truncated", "truncated tokenizer");
        unlink(p);
    }
    unsigned char *tt = pkvt_alloc(nt + 9);
    memcpy(tt, t, nt);
    memcpy(tt + nt, "\0\0\0\0\1\0\0\0x", 9);   /* one more record: a 513th piece */
    write_tmp(p, tt, nt + 9);
    expect_fail(model_path, p, "does not belong", "tokenizer with an extra piece");
    unlink(p);
    memcpy(tt, t, nt);
    pkvt_put_le32(tt + 4 + 4, 100000);   /* piece 0 claims 100000 bytes */
    write_tmp(p, tt, nt);
    expect_fail(model_path, p, "length", "tokenizer piece too long");
    unlink(p);
    free(tt);
    expect_fail("/nonexistent/model.bin", tok_path, "cannot open", "missing model");
    expect_fail(model_path, "/nonexistent/tok.bin", "cannot open", "missing tokenizer");
    free(m);
    free(t);
}
END_TEST

/* ---- the synthetic default ------------------------------------------------------- */

START_TEST(synthetic_default)
{
    pkvt_proc r = pkvt_tool(ARGS("-n", "40"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    /* no tokenizer: the 40 generated ids on stdout (not the prompt's BOS), as many as
     * the "generated:" figure on stderr counts */
    int ids = 0;
    for (char *p = r.out, *end; (strtoul(p, &end, 10), end != p); p = end)
        ids++;
    ck_assert_int_eq(ids, 40);
    ck_assert_msg(strstr(r.err, "generated: 40 tokens") != NULL, "stderr: %s", r.err);
    ck_assert_ptr_nonnull(strstr(r.err, "tok/s"));
    ck_assert_ptr_nonnull(strstr(r.err, "resident"));
    ck_assert_ptr_nonnull(strstr(r.err, "shared"));
    ck_assert_ptr_nonnull(strstr(r.err, "ideal"));
    pkvt_proc_free(&r);

    /* with a prompt the ids are its bytes + 3 (echoed, as text would be), then the
     * n - P + 1 = 8 generated ones; BOS is never printed */
    r = pkvt_tool(ARGS("-n", "10", "-i", "ab"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    unsigned long v[16];
    ids = 0;
    for (char *p = r.out, *end; ids < 16 && (v[ids] = strtoul(p, &end, 10), end != p);
         p = end)
        ids++;
    ck_assert_int_eq(ids, 10);
    ck_assert_uint_eq(v[0], 'a' + 3);
    ck_assert_uint_eq(v[1], 'b' + 3);
    ck_assert_msg(strstr(r.err, "generated: 8 tokens") != NULL, "stderr: %s", r.err);
    pkvt_proc_free(&r);

    /* the README command itself, exactly */
    r = pkvt_tool(ARGS("--json"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    ck_assert_double_eq(pkvt_json_num(r.out, "sessions[0].positions"), 256);
    ck_assert(pkvt_json_num(r.out, "tokens_per_s") > 0);
    ck_assert_ptr_nonnull(strstr(r.out, "\"dtype\": \"f16\""));
    pkvt_proc_free(&r);
}
END_TEST

START_TEST(synthetic_check_dtypes)
{
    const char *dt = dtypes[_i];
    pkvt_proc r = pkvt_tool(ARGS("-n", pkvt_quick() ? "24" : "48", "--dtype", dt,
                            "--block-tokens", "5", "--sessions", "2", "-t", "0.8", "-i",
                            "ab", "--check", "--check-e2e", "--json"), NULL);
    ck_assert_msg(r.status == 0, "%s: exit %d: %s", dt, r.status, r.err);
    ck_assert_ptr_nonnull(strstr(r.out, "\"check\": {\"passed\": true"));
    ck_assert_ptr_nonnull(strstr(r.out, "\"check_e2e\": {\"passed\": true"));
    uint32_t pt[8];
    ck_assert_uint_eq(json_ints(r.out, "prompt_tokens", pt, 8), 3);
    ck_assert_uint_eq(pt[1], 'a' + 3);   /* no tokenizer: byte tokens */
    ck_assert_uint_eq(pt[2], 'b' + 3);
    pkvt_proc_free(&r);
}
END_TEST

START_TEST(synthetic_seeded)
{
    static uint32_t a[64], b[64], c[64];
    size_t na = greedy_tokens(ARGS("-n", "32", "-s", "11", "--json"), 0, a, 64);
    size_t nb = greedy_tokens(ARGS("-n", "32", "-s", "11", "--json", "--threads", "1"), 0,
                              b, 64);
    size_t nc = greedy_tokens(ARGS("-n", "32", "-s", "12", "--json"), 0, c, 64);
    ck_assert_uint_eq(na, 33);
    ck_assert_uint_eq(nb, na);
    ck_assert_uint_eq(nc, na);
    ck_assert_msg(memcmp(a, b, na * sizeof a[0]) == 0, "same seed, different tokens");
    ck_assert_msg(memcmp(a, c, na * sizeof a[0]) != 0, "seeds 11 and 12 gave the same "
                                                       "sampled tokens");
    /* the synthetic model's tokens are not one token repeated */
    int distinct = 0;
    for (size_t i = 1; i < na; i++)
        distinct += a[i] != a[i - 1];
    ck_assert_int_gt(distinct, 10);
}
END_TEST

START_TEST(stories_sampler_limits)
{
    model_files();
    /* A nucleus of mass 1e-4 holds only the most likely token, and temperature 1e-3
     * makes the full distribution a point mass on it: both are greedy decoding. */
    static uint32_t greedy[128], other[128];
    size_t n = greedy_tokens(ARGS("--model", model_path, "--tokenizer", tok_path, "-t",
                                  "0", "-n", "64", "--json"), 0, greedy, 128);
    static const char *const knobs[][2] = {{"1", "0.0001"}, {"0.001", "0"}};
    for (size_t k = 0; k < 2; k++) {
        size_t m = greedy_tokens(ARGS("--model", model_path, "--tokenizer", tok_path, "-t",
                                      knobs[k][0], "-p", knobs[k][1], "-s", "5", "-n", "64",
                                      "--json"), 0, other, 128);
        ck_assert_uint_eq(m, n);
        for (size_t i = 0; i < n; i++)
            ck_assert_msg(other[i] == greedy[i], "-t %s -p %s: token %zu is %u, greedy %u",
                          knobs[k][0], knobs[k][1], i, other[i], greedy[i]);
    }
    /* real sampling (-t 1 -p 0.9) departs from greedy and depends on the seed */
    size_t m = greedy_tokens(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "1",
                                  "-p", "0.9", "-s", "5", "-n", "64", "--json"), 0, other,
                             128);
    ck_assert_msg(m != n || memcmp(other, greedy, n * sizeof other[0]) != 0,
                  "sampling at -t 1 gave the greedy text");
}
END_TEST

/* ---- what the user is told ------------------------------------------------------ */

/* Valid UTF-8 in a prompt comes back intact: characters without a piece of their own
 * are spelled in byte-fallback tokens (<0xXX>, ids 3..258), and their bytes, printed
 * in order, give the character back, on stdout and in the JSON text. */
START_TEST(stories_utf8_roundtrip)
{
    model_files();
    const char *prompt = "Le caf\xc3\xa9 \xc3\xa9tait tr\xc3\xa8s bon. \xe6\x97\xa5\xe6\x9c\xac "
                         "\xe2\x9c\x93 \xf0\x9f\x98\x80!";
    pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0", "-n",
                            "80", "-i", prompt, "--json"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    uint32_t pt[128];
    size_t np = json_ints(r.out, "prompt_tokens", pt, 128);
    size_t high_bytes = 0;   /* byte tokens of bytes >= 0x80: the case at stake */
    for (size_t i = 0; i < np; i++)
        high_bytes += pt[i] >= 3 + 0x80 && pt[i] <= 3 + 0xff;
    ck_assert_msg(high_bytes >= 4, "the prompt used %zu high byte tokens: no test", high_bytes);
    char want[256];
    snprintf(want, sizeof want, "\"text\": \"%s", prompt);
    ck_assert_msg(strstr(r.out, want) != NULL, "JSON text lost bytes: %s", r.out);
    pkvt_proc_free(&r);
    r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0", "-n", "80", "-i",
                 prompt), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    ck_assert_msg(strncmp(r.out, prompt, strlen(prompt)) == 0, "stdout lost bytes: %s",
                  r.out);
    pkvt_proc_free(&r);
}
END_TEST

/* A prompt that -n cuts short, or that takes all -n positions, says so on stderr; why
 * generation stopped is said in text mode and is stop_reason in JSON. */
START_TEST(stories_stop_reasons)
{
    model_files();
    static const struct { const char *n, *warn, *stopped, *reason; } rows[] = {
        {"3", "-n 3 cuts the prompt short", "stopped: -n 3 ended inside the prompt", "prompt"},
        {"5", "the prompt takes all -n 5 positions", "stopped: -n 5 positions reached",
         "steps"},
        {"40", NULL, "stopped: -n 40 positions reached", "steps"},
        /* greedy, this story ends (BOS) after 341 tokens */
        {"512", NULL, "stopped: the model emitted BOS (end of text) after 341 generated",
         "bos"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0",
                                "-n", rows[i].n, "-i", "Once upon a time"), NULL);
        ck_assert_msg(r.status == 0, "-n %s: exit %d: %s", rows[i].n, r.status, r.err);
        if (rows[i].warn)
            ck_assert_msg(strstr(r.err, rows[i].warn), "-n %s: no '%s': %s", rows[i].n,
                          rows[i].warn, r.err);
        else
            ck_assert_msg(!strstr(r.err, "warning"), "-n %s: a warning: %s", rows[i].n, r.err);
        ck_assert_msg(strstr(r.err, rows[i].stopped), "-n %s: no '%s': %s", rows[i].n,
                      rows[i].stopped, r.err);
        pkvt_proc_free(&r);
        r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0", "-n",
                     rows[i].n, "-i", "Once upon a time", "--json"), NULL);
        char want[64];
        snprintf(want, sizeof want, "\"stop_reason\": \"%s\"", rows[i].reason);
        ck_assert_msg(r.status == 0 && strstr(r.out, want), "-n %s --json: %d, no %s: %s",
                      rows[i].n, r.status, want, r.out);
        const bool bos = strcmp(rows[i].reason, "bos") == 0;
        ck_assert_msg(strstr(r.out, bos ? "\"stopped_on_bos\": true"
                                        : "\"stopped_on_bos\": false"),
                      "-n %s: stopped_on_bos disagrees: %s", rows[i].n, r.out);
        pkvt_proc_free(&r);
    }
}
END_TEST

/* --check on a long run warns of its O(n^3) cost; a short one does not. */
START_TEST(synthetic_check_cost)
{
    pkvt_proc r = pkvt_tool(ARGS("--check", "-n", "128"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    ck_assert_msg(strstr(r.err, "--check recomputes every step's attention densely, O(n^3)"),
                  "-n 128 --check: no warning: %s", r.err);
    pkvt_proc_free(&r);
    r = pkvt_tool(ARGS("--check", "-n", "32"), NULL);
    ck_assert_msg(r.status == 0 && !strstr(r.err, "warning"), "-n 32 --check: %d %s",
                  r.status, r.err);
    pkvt_proc_free(&r);
}
END_TEST

/* ---- options --------------------------------------------------------------------- */

START_TEST(options)
{
    pkvt_proc r = pkvt_tool(ARGS("--help"), NULL);
    ck_assert_int_eq(r.status, 0);
    ck_assert_ptr_nonnull(strstr(r.out, "usage: pagedkv generate"));
    ck_assert_ptr_nonnull(strstr(r.out, "--sessions"));
    pkvt_proc_free(&r);
    static const char *const bad[][3] = {
        {"--bogus", NULL, NULL},   {"-n", "0", NULL},        {"-n", "x", NULL},
        {"-n", NULL, NULL},        {"--dtype", "f8", NULL},  {"-p", "1.5", NULL},
        {"-t", "-1", NULL},        {"--sessions", "0", NULL}, {"--block-tokens", "0", NULL},
        {"-s", "-3", NULL},        {"--threads", "x", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *args[5] = {"generate", bad[i][0], bad[i][1], bad[i][2], NULL};
        r = pkvt_tool(args, NULL);
        ck_assert_msg(r.status == 2, "'%s %s': exit %d (want 2)", bad[i][0],
                      bad[i][1] ? bad[i][1] : "", r.status);
        ck_assert_msg(count_of(r.err, "pagedkv generate") >= 1, "no message: %s", r.err);
        ck_assert_msg(r.out[0] == '\0', "printed to stdout: %s", r.out);
        pkvt_proc_free(&r);
    }
}
END_TEST


/* ---- attention variants (docs/variants.md) ----------------------------------------------- */

/* A window at least the context changes nothing a decode reads: the greedy text of
 * stories260K is the same with and without --window 100000 (all 5 layers windowed). */
START_TEST(stories_window_unchanged)
{
    model_files();
    pkvt_proc a = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0",
                            "-n", "256", "-i", "Once upon a time"), NULL);
    pkvt_proc b = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0",
                            "-n", "256", "-i", "Once upon a time", "--window", "100000"), NULL);
    ck_assert_msg(a.status == 0 && b.status == 0, "exit %d / %d: %s", a.status, b.status,
                  b.err);
    ck_assert_msg(strlen(a.out) > 100, "too little text: %s", a.out);
    ck_assert_msg(strcmp(a.out, b.out) == 0, "text differs with --window 100000:\n%s\n---\n%s",
                  a.out, b.out);
    ck_assert_ptr_nonnull(strstr(b.err, "window 100000"));
    pkvt_proc_free(&a);
    pkvt_proc_free(&b);
}
END_TEST

/* --context-shift (docs/rope.md): a run of -n past the model's seq_len (the synthetic
 * model's 4096; stories260K's stories end on BOS long before its 512) keeps generating,
 * the full cache keeping --keep positions and dropping half of the rest; before the
 * shift its tokens are those of a run without the option. */
START_TEST(synthetic_context_shift)
{
    pkvt_proc a = pkvt_tool(ARGS("-n", "300", "--json"), NULL);
    pkvt_proc b = pkvt_tool(ARGS("-n", "4200", "--context-shift", "--keep", "8", "--json"),
                            NULL);
    ck_assert_msg(a.status == 0 && b.status == 0, "exit %d / %d: %s", a.status, b.status,
                  b.err);
    static uint32_t ta[400], tb[4300];
    const size_t na = json_ints(a.out, "sessions[0].tokens", ta, 400);
    const size_t nb = json_ints(b.out, "sessions[0].tokens", tb, 4300);
    ck_assert_uint_eq(na, 301);   /* -n positions, and the token sampled at the last */
    ck_assert_uint_eq(nb, 4201);
    for (size_t i = 0; i < na; i++)
        ck_assert_msg(ta[i] == tb[i], "token %zu: %u without a shift, %u with", i, ta[i], tb[i]);
    ck_assert_double_eq(pkvt_json_num(b.out, "context_shifts"), 1);
    ck_assert_double_eq(pkvt_json_num(b.out, "sessions[0].positions"), 4200 - (4096 - 8) / 2);
    ck_assert_ptr_nonnull(strstr(b.out, "\"stop_reason\": \"steps\""));
    pkvt_proc_free(&a);
    pkvt_proc_free(&b);
    /* a --keep that leaves no room to shift is a usage error, as is --check with it */
    a = pkvt_tool(ARGS("-n", "5000", "--context-shift", "--keep", "4095"), NULL);
    ck_assert_int_eq(a.status, 2);
    ck_assert_ptr_nonnull(strstr(a.err, "--keep"));
    pkvt_proc_free(&a);
    a = pkvt_tool(ARGS("-n", "50", "--context-shift", "--check"), NULL);
    ck_assert_int_eq(a.status, 2);
    pkvt_proc_free(&a);
}
END_TEST

/* A small window: the run still works (its attention checked against the variant's
 * dense reference, and end to end) and every layer holds at most the page ceiling
 * (docs/variants.md) of pages, well below what the positions would need unwindowed. */
START_TEST(stories_window_bounded)
{
    model_files();
    pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0",
                            "-n", "400", "--window", "24", "--sinks", "4", "--block-tokens",
                            "8", "--check", "--check-e2e", "--json"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    ck_assert_ptr_nonnull(strstr(r.out, "\"check\": {\"passed\": true"));
    ck_assert_ptr_nonnull(strstr(r.out, "\"check_e2e\": {\"passed\": true"));
    const double ceiling = 1 + 3 + 1;   /* ceil(4/8) + ceil(24/8) + 1 */
    ck_assert_double_eq(pkvt_json_num(r.out, "cache.page_ceiling"), ceiling);
    double pos = pkvt_json_num(r.out, "sessions[0].positions");
    double blocks = pkvt_json_num(r.out, "sessions[0].memory.blocks");
    double held = pkvt_json_num(r.out, "sessions[0].memory.pages_held_max_layer");
    double page = pkvt_json_num(r.out, "cache.page_bytes");
    ck_assert_msg(pos >= 64, "only %g positions: the window was never full", pos);
    ck_assert_msg(held <= ceiling && blocks <= 5 * ceiling, "held %g, blocks %g", held,
                  blocks);
    ck_assert_msg(blocks < 5 * ((pos + 7) / 8) - 5, "blocks %g: nothing released", blocks);
    ck_assert_double_eq(pkvt_json_num(r.out, "sessions[0].memory.bytes_resident"),
                        blocks * page);
    pkvt_proc_free(&r);
}
END_TEST

/* The synthetic model with a window and a soft-cap: --check holds every attention
 * row to the variant's reference; bad variant options are usage errors. */
START_TEST(synthetic_variants)
{
    pkvt_proc r = pkvt_tool(ARGS("-n", "80", "--window", "16", "--softcap", "30", "--block-tokens",
                            "4", "--check", "--json"), NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    ck_assert_ptr_nonnull(strstr(r.out, "\"check\": {\"passed\": true"));
    ck_assert_double_eq(pkvt_json_num(r.out, "cache.softcap"), 30);
    ck_assert_msg(pkvt_json_num(r.out, "sessions[0].memory.pages_held_max_layer") <= 4 + 1,
                  "held %g pages",
                  pkvt_json_num(r.out, "sessions[0].memory.pages_held_max_layer"));
    pkvt_proc_free(&r);
    r = pkvt_tool(ARGS("--help"), NULL);
    ck_assert_ptr_nonnull(strstr(r.out, "--window"));
    ck_assert_ptr_nonnull(strstr(r.out, "--sinks"));
    ck_assert_ptr_nonnull(strstr(r.out, "--softcap"));
    pkvt_proc_free(&r);
    static const char *const bad[][3] = {
        {"--sinks", "4", NULL}, {"--rollback", "2", NULL}, {"--window", "x", NULL},
        {"--softcap", "-1", NULL},
    };
    static const char *const says[] = {"--sinks needs --window", "--rollback needs --window",
                                       "--window", "--softcap"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        r = pkvt_tool((const char *const[]){"generate", bad[i][0], bad[i][1], NULL}, NULL);
        ck_assert_msg(r.status == 2 && strstr(r.err, says[i]) && !r.out[0],
                      "'%s %s': exit %d: %s", bad[i][0], bad[i][1], r.status, r.err);
        pkvt_proc_free(&r);
    }
}
END_TEST

/* --prefix-cache claims a saving only where the cache was hit, and says why a prompt
 * of one page or less never is; --save writes session 0 where `inspect` reads it. */
START_TEST(synthetic_prefix_and_save)
{
    pkvt_proc r = pkvt_tool(ARGS("--sessions", "3", "--prefix-cache", "-n", "40", "-i", "hi"),
                            NULL);
    ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
    ck_assert_msg(strstr(r.err, "none of 2 later session(s) hit") &&
                      strstr(r.err, "no prefill saved") && !strstr(r.err, "ms saved") &&
                      strstr(r.err, "fit in one page of 16 tokens"),
                  "stderr: %s", r.err);
    pkvt_proc_free(&r);
    r = pkvt_tool(ARGS("--sessions", "3", "--prefix-cache", "-n", "40", "-i", "hi", "--json"),
                  NULL);
    ck_assert_msg(r.status == 0 && pkvt_json_u64(r.out, "prefix_cache.hits") == 0 &&
                      pkvt_json_is(r.out, "prefix_cache.prefill_seconds_saved", "null") &&
                      pkvt_json_is(r.out, "prefix_cache.prompt_within_one_page", "true"),
                  "JSON: %s", r.out);
    pkvt_proc_free(&r);
    char dir[] = "/tmp/pkvt-gen-save-XXXXXX", file[600];
    ck_assert(mkdtemp(dir) != NULL);
    snprintf(file, sizeof file, "%s/s0.pkv", dir);
    r = pkvt_tool(ARGS("-n", "30", "--save", file), NULL);
    ck_assert_msg(r.status == 0 && strstr(r.err, "pagedkv inspect "), "--save: %s", r.err);
    pkvt_proc_free(&r);
    r = pkvt_tool((const char *const[]){"inspect", "--json", file, NULL}, NULL);
    ck_assert_msg(r.status == 0 && pkvt_json_is(r.out, "sound", "true") &&
                      pkvt_json_u64(r.out, "layer_len[0]") == 30 &&
                      pkvt_json_u64(r.out, "n_token_ids") == 30,
                  "inspect: exit %d: %s", r.status, r.out);
    pkvt_proc_free(&r);
    unlink(file);
    /* a path that cannot take the file is refused before the run */
    snprintf(file, sizeof file, "%s/no/such/dir/s.pkv", dir);
    r = pkvt_tool(ARGS("-n", "30", "--save", file), NULL);
    ck_assert_msg(r.status == 2 && strstr(r.err, "--save") && !r.out[0], "%d %s", r.status,
                  r.err);
    pkvt_proc_free(&r);
    ck_assert(rmdir(dir) == 0);
}
END_TEST

/* --speculate K [--tree]: the text is plain generation's, byte for byte (greedy and
 * sampled, every dtype, a window, small pages), and the drafts are counted; bad
 * combinations are usage errors. `model` runs stories260K, else the synthetic model. */
static void speculate_same_text(bool model)
{
    static const char *const runs[][8] = {
        {"-t", "0", "--dtype", "f32", "--block-tokens", "16", NULL},
        {"-t", "0", "--dtype", "q8", "--block-tokens", "3", NULL},
        {"-t", "0", "--dtype", "q4", "--block-tokens", "5", NULL},
        {"-t", "0.8", "--seed", "7", "--dtype", "f16", NULL},
        {"-t", "0", "--window", "40", "--sinks", "2", NULL},
    };
    static const char *const spec[][4] = {{"--speculate", "4", NULL, NULL},
                                          {"--speculate", "6", "--tree", NULL}};
    const size_t nr = pkvt_quick() ? 2 : sizeof runs / sizeof *runs;
    for (size_t i = 0; i < nr; i++) {
        const char *a[32];
        size_t n = 0;
        a[n++] = "generate";
        if (model) {
            a[n++] = "--model", a[n++] = model_path;
            a[n++] = "--tokenizer", a[n++] = tok_path;
        }
        a[n++] = "-n", a[n++] = model ? "200" : "120";
        a[n++] = "-i", a[n++] = "Once upon a time, there was a little girl. Once upon a";
        for (size_t k = 0; runs[i][k]; k++)
            a[n++] = runs[i][k];
        a[n] = NULL;
        pkvt_proc plain = pkvt_tool(a, NULL);
        ck_assert_msg(plain.status == 0, "exit %d: %s", plain.status, plain.err);
        for (size_t j = 0; j < 2; j++) {
            size_t m = n;
            for (size_t k = 0; spec[j][k]; k++)
                a[m++] = spec[j][k];
            a[m] = NULL;
            pkvt_proc sp = pkvt_tool(a, NULL);
            ck_assert_msg(sp.status == 0, "exit %d: %s", sp.status, sp.err);
            ck_assert_msg(strcmp(plain.out, sp.out) == 0,
                          "run %zu %s %s: the text differs:\n%s\n---\n%s", i, spec[j][0],
                          spec[j][1], plain.out, sp.out);
            ck_assert_msg(strstr(sp.err, "speculate: K ") && strstr(sp.err, " accepted"),
                          "stderr: %s", sp.err);
            pkvt_proc_free(&sp);
        }
        pkvt_proc_free(&plain);
    }
    const char *const tree_alone[] = {"generate", "--tree", NULL};
    pkvt_proc r = pkvt_tool(tree_alone, NULL);
    ck_assert_msg(r.status == 2 && strstr(r.err, "--speculate"), "%d %s", r.status, r.err);
    pkvt_proc_free(&r);
    const char *const with_sessions[] = {"generate", "--speculate", "2", "--sessions", "2",
                                         NULL};
    r = pkvt_tool(with_sessions, NULL);
    ck_assert_msg(r.status == 2, "%d %s", r.status, r.err);
    pkvt_proc_free(&r);
}

START_TEST(synthetic_speculate)
{
    speculate_same_text(false);
}
END_TEST

START_TEST(stories_speculate)
{
    model_files();
    speculate_same_text(true);
    /* the JSON counts: a repetitive story accepts some drafts */
    pkvt_proc r = pkvt_tool(ARGS("--model", model_path, "--tokenizer", tok_path, "-t", "0",
                                 "-n", "200", "-i", "Once upon a time", "--speculate", "4",
                                 "--json"),
                            NULL);
    ck_assert_msg(r.status == 0 && pkvt_json_u64(r.out, "speculate.drafts_proposed") > 0 &&
                      pkvt_json_u64(r.out, "speculate.drafts_accepted") > 0 &&
                      pkvt_json_u64(r.out, "speculate.verify_calls") > 0,
                  "JSON: %s", r.out);
    pkvt_proc_free(&r);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("generate");
    TCase *tc = tcase_create("synthetic");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, synthetic_default);
    tcase_add_loop_test(tc, synthetic_check_dtypes, 0, 3);
    tcase_add_test(tc, synthetic_seeded);
    tcase_add_test(tc, options);
    tcase_add_test(tc, synthetic_check_cost);
    tcase_add_test(tc, synthetic_variants);
    tcase_add_test(tc, synthetic_prefix_and_save);
    tcase_add_test(tc, synthetic_context_shift);
    tcase_add_test(tc, synthetic_speculate);
    suite_add_tcase(s, tc);
    TCase *tm = tcase_create("stories260K");
    tcase_set_timeout(tm, 240);
    tcase_add_test(tm, stories_greedy_text);
    tcase_add_test(tm, stories_prompt_encoding);
    tcase_add_test(tm, stories_greedy_invariant);
    tcase_add_test(tm, stories_sampler_limits);
    tcase_add_loop_test(tm, stories_check_dtypes, 0, 3);
    tcase_add_test(tm, stories_forks_share_prompt);
    tcase_add_test(tm, malformed_files);
    tcase_add_test(tm, stories_utf8_roundtrip);
    tcase_add_test(tm, stories_stop_reasons);
    tcase_add_test(tm, stories_window_unchanged);
    tcase_add_test(tm, stories_window_bounded);
    tcase_add_test(tm, stories_speculate);
    pkvt_add_tcase_needing(s, tm, "stories260K", "model");
    return pkvt_run(s);
}

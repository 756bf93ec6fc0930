/*
 * testutil.h - the helpers every Check suite shares, in one place: the seeded RNG, the
 * ONE test oracle (dense attention in double, written independently of the library's
 * reference.c), checked sizes, engine builders, process spawning, a JSON reader, and
 * the runner that turns "this host lacks X" into the skip status 77.
 *
 * Owns: nothing of the library. Every helper that can fail fails the current test
 * (ck_assert) instead of returning an error, so callers stay short.
 *
 * Seeds: every randomized test starts from pkvt_seed() (fixed default, PKV_TEST_SEED
 * overrides); pkvt_run prints the seed when a test failed, and ck_assert messages name
 * it too.
 *
 * Skips (HACKING.md, "Test tiers": a test that cannot run exits 77, never passes): a test program
 * calls pkvt_run(suite), which first checks what the run needs and returns PKVT_SKIP without
 * running anything when the host lacks it:
 *   - PKV_FORCE_ISA=isa    the kernels named (unknown names fail; an ISA not built
 *                          for this architecture, or one the CPU/OS lacks, skips);
 *   - PKV_TEST_NEEDS=w,... each word one of:
 *       uring   the io_uring backend can be set up (and PKV_NO_URING is not 1);
 *       model   stories260K.bin and tok512.bin in pkvt_model_dir();
 *       rss     RSS means what it says: no sanitizer shadow, no valgrind;
 *       tool    the built `pagedkv` binary (PKV_TOOL) is executable;
 *       python  a python3 for independent cross-checks;
 *       crc32c_hw  the CPU's CRC-32C instruction (SSE4.2);
 *       timing  threads run side by side at their own speed (not under valgrind).
 * meson (tests/meson.build) registers one test per ISA, per I/O backend and per
 * resource-bound case, selecting the case with CK_RUN_CASE. A run in which no test
 * ran at all (CK_RUN_CASE naming no case) is a failure, not a pass. A program run
 * whole (no CK_RUN_CASE) adds its resource-bound cases with pkvt_add_tcase_needing:
 * a case whose requirement is unmet is left out with a "SKIP: case ..." line and the
 * other cases still run and count; a run that selected only such cases is a skip.
 */
#ifndef PKV_TESTUTIL_H
#define PKV_TESTUTIL_H

#include <check.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "pagedkv.h"

/* Sanitizers, as gcc (__SANITIZE_*__) and clang (__has_feature) spell them:
 * PKVT_ASAN       AddressSanitizer, which aborts on impossible allocation sizes;
 * PKVT_SHADOW_SANITIZER  ASan or TSan, whose shadow memory counts in RSS. 0 or 1. */
#if defined(__SANITIZE_ADDRESS__)
#define PKVT_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define PKVT_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(PKVT_ASAN)
#define PKVT_ASAN 1
#endif
#if __has_feature(thread_sanitizer) && !defined(PKVT_TSAN)
#define PKVT_TSAN 1
#endif
#endif
#ifndef PKVT_ASAN
#define PKVT_ASAN 0
#endif
#ifndef PKVT_TSAN
#define PKVT_TSAN 0
#endif
#define PKVT_SHADOW_SANITIZER (PKVT_ASAN || PKVT_TSAN)

/* The exit status meson (and automake, liburing's T_EXIT_SKIP) reads as "skipped". */
#define PKVT_SKIP 77

/* ---- seeds and the RNG ------------------------------------------------------------ */

/* xorshift64* generator: deterministic across platforms. */
typedef struct { uint64_t s; } pkvt_rng;
uint64_t pkvt_seed(void);                  /* PKV_TEST_SEED or 0x9e3779b97f4a7c15 */
void     pkvt_rng_init(pkvt_rng *r, uint64_t seed);
uint64_t pkvt_next(pkvt_rng *r);
uint32_t pkvt_below(pkvt_rng *r, uint32_t n);          /* uniform in [0, n) */
float    pkvt_uniform(pkvt_rng *r, float lo, float hi);
void     pkvt_fill(pkvt_rng *r, float *x, size_t n, float lo, float hi);
/* true when PKV_TEST_QUICK=1 (valgrind, sanitizer and emulated runs): randomized tests
 * do fewer cases, every test still runs */
bool     pkvt_quick(void);

/* ---- sizes and memory ------------------------------------------------------------- */

/* a * b, failing the test on uint64 overflow (and on size_t overflow: 32-bit hosts). */
size_t pkvt_mul(uint64_t a, uint64_t b);
/* zeroed memory that fails the test on NULL; n * size checked like pkvt_mul. */
void  *pkvt_alloc(size_t bytes);
void  *pkvt_calloc(uint64_t n, uint64_t size);

/* ---- the test oracle (double precision) --------------------------------------------
 * One decode step for every head i of q [h][d] over positions 0..n_pos-1 of
 * K, V [n_pos][g][d], head i reading group floor(i * g / h) (the first of the mapping's two
 * spellings; the library writes i / (h / g)), softmax with the max subtracted. scale <= 0 means
 * 1 / sqrt(d). out [h][d]. */
void pkvt_oracle_decode(uint32_t h, uint32_t g, uint32_t d, double scale, uint64_t n_pos,
                        const double *q, const double *K, const double *V, double *out);
/* Causal attention: row t of out [T][h][d] is the decode of Q[t] over 0..t. */
void pkvt_oracle_causal(uint32_t T, uint32_t h, uint32_t g, uint32_t d, double scale,
                        const double *Q, const double *K, const double *V, double *out);
/* The oracle on float data rounded to the storage dtype first (what the cache holds):
 * one decode step at position n_pos - 1. scale 0 = 1 / sqrt(d). out [h][d]. */
void pkvt_ref_decode(uint32_t h, uint32_t g, uint32_t d, float scale, pkv_dtype dt,
                     uint64_t n_pos, const float *q, const float *K, const float *V,
                     double *out);
/* n floats as doubles (freed by the caller) */
double *pkvt_to_double(const float *x, size_t n);
/* max |x| over n floats */
float pkvt_maxabs(const float *x, size_t n);
/* max_i |a_i - b_i|; a NaN anywhere gives INFINITY */
double pkvt_maxdiff_fd(const float *a, const double *b, size_t n);
double pkvt_maxdiff_ff(const float *a, const float *b, size_t n);

/* ---- engines -------------------------------------------------------------------------- */

/* pkv_config_default() with this geometry. */
pkv_config pkvt_config(uint32_t layers, uint32_t h, uint32_t g, uint32_t d, uint32_t bt,
                       pkv_dtype dt);
/* An engine for c; fails the test (naming the geometry) on error. */
pkv_engine *pkvt_engine_cfg(const pkv_config *c);
/* pkvt_engine_cfg, with every call that can split handed to the workers whatever its
 * size and timing (decode.c's split_awake and split_asleep at 0): the engine of a
 * thread-count identity test, which must exercise the split paths. */
pkv_engine *pkvt_engine_workers(const pkv_config *c);
/* An engine with this geometry (other fields default); fails the test on error. */
pkv_engine *pkvt_engine(uint32_t layers, uint32_t h, uint32_t g, uint32_t d, uint32_t bt,
                        pkv_dtype dt);
/* A session of e; fails the test on error. */
pkv_session *pkvt_session(pkv_engine *e);

/* ---- hosts, kernels and backends -------------------------------------------------- */

/* Why this process cannot test the io_uring backend (PKV_NO_URING=1, built without
 * liburing, or the kernel refuses a ring), or NULL when it can. */
const char *pkvt_uring_skip_reason(void);
/* The directory of the real model (stories260K.bin, tok512.bin): PKV_MODEL_DIR from
 * the environment, else the first directory of PKV_MODEL_DIR_BUILD (a ':'-separated
 * list that tests/meson.build passes: -Dmodel_dir, or models/ in the source tree and
 * ../shared/models beside it) that holds both files, else its first. */
const char *pkvt_model_dir(void);
/* The model's and the tokenizer's paths in pkvt_model_dir() into model and tok (each
 * of cap bytes); true when both files can be read. */
bool pkvt_model_paths(char *model, char *tok, size_t cap);
/* Why requirement `need` (a PKV_TEST_NEEDS word) is unmet here, or NULL when met.
 * A test program may also use it to leave a case out of a whole-suite run (as
 * test_session does with "rss"), printing the reason. */
const char *pkvt_need_unmet(const char *need);
/* The kernel ISAs this build contains, NULL-terminated: "scalar" first, then the
 * SIMD ones compiled for this architecture (whether or not the CPU runs them). */
extern const char *const pkvt_built_isas[];
/* Does the CPU/OS run `isa`, by /proc/cpuinfo's flags (the kernel's view, an
 * independent source from the library's cpuid + XGETBV)? -1 when the file is
 * unreadable or has no flags line (emulators, other architectures). */
int pkvt_cpuinfo_has_isa(const char *isa);

/* ---- files and processes -------------------------------------------------------------- */

/* An anonymous read-write temporary file under $TMPDIR (default /tmp), unlinked at once. */
int pkvt_tmp_fd(void);
/* A new directory $TMPDIR/pkv-test-WHAT-XXXXXX (default /tmp), its name into dir. */
void pkvt_scratch_dir(char *dir, size_t cap, const char *what);
/* Removes dir and the files (and empty directories) in it; silent when it is gone. */
void pkvt_remove_dir(const char *dir);
/* Entries of dir other than ".", ".." and `except` (a name, or NULL). */
int pkvt_dir_entries(const char *dir, const char *except);

/* The whole file, NUL-terminated (one byte past *len, which may be NULL; freed by the
 * caller), or NULL when it cannot be opened (errno says why). A read error fails. */
void *pkvt_read_file(const char *path, size_t *len);
/* pkvt_read_file, failing the test when the file cannot be opened. */
void *pkvt_slurp(const char *path, size_t *len);
/* Creates or truncates path to exactly these n bytes. */
void pkvt_write_file(const char *path, const void *bytes, size_t n);

/* Little-endian fields, as docs/file-format.md and llama2.c's files lay them out. */
uint32_t pkvt_le32(const unsigned char *p);
uint64_t pkvt_le64(const unsigned char *p);
void     pkvt_put_le32(unsigned char *p, uint32_t v);
void     pkvt_put_le64(unsigned char *p, uint64_t v);

typedef struct {
    int status;        /* exit code, or 128 + signal number */
    char *out, *err;   /* captured stdout and stderr, NUL-terminated */
    size_t out_len, err_len;
} pkvt_proc;

/* Run `path` with argv (NULL-terminated, argv[0] included) and the current environment
 * changed by env (NULL-terminated or NULL): "NAME=VALUE" sets, "NAME" removes. stdin is
 * /dev/null; stdout and stderr are captured. Waits for the exit. Fails the test if the
 * program cannot be started. */
pkvt_proc pkvt_spawn(const char *path, const char *const *argv, const char *const *env);
/* The built `pagedkv` (PKV_TOOL) with args (NULL-terminated, without argv[0]). */
pkvt_proc pkvt_tool(const char *const *args, const char *const *env);
void pkvt_proc_free(pkvt_proc *p);
/* pkvt_spawn in two halves, for a test that acts on the program while it runs (say,
 * signals it): pkvt_start returns once it runs; its captures are the anonymous files
 * out_fd and err_fd (/proc/self/fd/N opens them again). pkvt_finish waits for the
 * exit, collects the captures and closes them. */
typedef struct { int pid; int out_fd, err_fd; } pkvt_child;
pkvt_child pkvt_start(const char *path, const char *const *argv, const char *const *env);
pkvt_proc  pkvt_finish(pkvt_child *c);
/* PKV_TOOL, failing the test when it is unset (run outside meson test). */
const char *pkvt_tool_path(void);
/* The python3 for cross-checks: /usr/bin/python3 if executable (a version manager's
 * shim on PATH can take seconds per start), else the first on PATH; NULL if none. */
const char *pkvt_python_path(void);
/* Random rows, k in [-k_abs, k_abs] and v in [-v_abs, v_abs] (k then v per row from r),
 * appended n times to one layer of s. */
void pkvt_append_random(pkv_session *s, pkvt_rng *r, uint32_t layer, uint64_t n,
                        float k_abs, float v_abs);

/* ---- JSON (read back what the tools print) --------------------------------------------
 * A path names a value: "a.b[2].c" (object keys by name, array elements by index).
 * Lookups fail the test when the text is not valid JSON or the path is absent. */
bool        pkvt_json_valid(const char *text);
/* the text of the value at path (pointing into json), or NULL if absent */
const char *pkvt_json_find(const char *json, const char *path);
uint64_t    pkvt_json_u64(const char *json, const char *path);   /* a non-negative integer */
double      pkvt_json_num(const char *json, const char *path);
size_t      pkvt_json_len(const char *json, const char *path);   /* array or object size */
/* the value at path is exactly `literal` (e.g. "true", "\"sync\"") */
bool        pkvt_json_is(const char *json, const char *path, const char *literal);

/* ---- running ---------------------------------------------------------------------- */

/* suite_add_tcase(s, tc) when the comma-separated requirements `needs` (PKV_TEST_NEEDS
 * words) are met; otherwise "SKIP: case NAME: needs W: why" on stdout and tc is left
 * out (and freed with the suite's runner), so that the program's other cases run and
 * count. `name` is tc's name as tcase_create got it. */
void pkvt_add_tcase_needing(Suite *s, TCase *tc, const char *name, const char *needs);

/* Check the run's requirements (above), then run the suite with CK_NORMAL output.
 * Returns EXIT_SUCCESS, EXIT_FAILURE (also when no test ran, unless every case the
 * run selected was left out by pkvt_add_tcase_needing: then PKVT_SKIP), or PKVT_SKIP. */
int pkvt_run(Suite *s);

#endif

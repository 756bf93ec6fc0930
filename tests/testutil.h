/*
 * testutil.h - shared helpers for the Check suites: a seeded RNG, tolerances, a dense
 * double-precision reference on dtype-rounded K/V, and small engine builders.
 *
 * Seeds: every randomized test starts from pkvt_seed() (fixed default, PKV_TEST_SEED
 * overrides) and prints it on failure through the ck_assert messages.
 */
#ifndef PKV_TESTUTIL_H
#define PKV_TESTUTIL_H

#include <check.h>
#include <stdbool.h>
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

/* xorshift64* generator: deterministic across platforms. */
typedef struct { uint64_t s; } pkvt_rng;
uint64_t pkvt_seed(void);                  /* PKV_TEST_SEED or 0x9e3779b97f4a7c15 */
void     pkvt_rng_init(pkvt_rng *r, uint64_t seed);
uint64_t pkvt_next(pkvt_rng *r);
uint32_t pkvt_below(pkvt_rng *r, uint32_t n);          /* uniform in [0, n) */
float    pkvt_uniform(pkvt_rng *r, float lo, float hi);
void     pkvt_fill(pkvt_rng *r, float *x, size_t n, float lo, float hi);
/* true when PKV_TEST_QUICK=1 (valgrind runs): randomized tests do fewer cases */
bool     pkvt_quick(void);

/* malloc that fails the test on NULL. */
void *pkvt_alloc(size_t bytes);

/* Dense reference in double for one decode step: for every head i of q [h][d], attend
 * over positions 0..t of K,V [t+1][g][d] rounded to dtype first. out [h][d]. */
void pkvt_ref_decode(uint32_t h, uint32_t g, uint32_t d, float scale, pkv_dtype dt,
                     uint64_t n_pos, const float *q, const float *K, const float *V,
                     double *out);
/* max |x| over n floats */
float pkvt_maxabs(const float *x, size_t n);
/* max_i |a_i - b_i| */
double pkvt_maxdiff_fd(const float *a, const double *b, size_t n);

/* An engine with this geometry (other fields default); fails the test on error. */
pkv_engine *pkvt_engine(uint32_t layers, uint32_t h, uint32_t g, uint32_t d, uint32_t bt,
                        pkv_dtype dt);

/* Why this process cannot test the io_uring backend (PKV_NO_URING=1, built without
 * liburing, or the kernel refuses a ring), or NULL when it can. */
const char *pkvt_uring_skip_reason(void);

/* Run a suite with CK_NORMAL output and return the process exit status. */
int pkvt_run(Suite *s);

#endif

/*
 * bench/spill.c - `pagedkv bench --spill`: spill and restore throughput next to the
 * disk's own sequential speed, measured in the same run, for both I/O backends.
 *
 * Method. Two sessions A and B of one layer, each exactly `--mib` MiB of pages, on an
 * engine whose budget holds one of them. Decoding A then B then A ... makes every
 * decode write the other session's pages to the spill file and read its own back:
 * 2 x size bytes of I/O per switch. A twin engine without a budget measures the decode
 * itself; spill throughput = 2 x size / (switch time - decode time). The plain
 * figure: pwrite the same bytes sequentially to a file in the same directory (1 MiB
 * requests), then pread them back; 2 x size / (write + read time). Medians of --reps.
 * Both go through the page cache (neither uses O_DIRECT), so they compare like with
 * like.
 */
#include "bench/probe.h"
#include "common/cli.h"
#include "common/json.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define GEOM_G 8u
#define GEOM_D 128u
#define GEOM_H 32u

typedef struct {
    double spill_gbs, plain_gbs;
    const char *backend;
} spill_result;

static pkv_status make_engine(uint64_t budget, const char *dir, pkv_engine **e)
{
    pkv_config c = cli_config(1, GEOM_H, GEOM_G, GEOM_D, 0, PKV_F16, 0);
    c.mem_budget = budget;
    c.spill_dir = budget ? dir : NULL;
    return pkv_engine_create(&c, e);
}

static pkv_status fill(pkv_session *s, uint64_t tokens, float *kv)
{
    for (uint64_t t = 0; t < tokens; t++) {
        kv[t % (GEOM_G * GEOM_D)] += 1.0f / 64;
        pkv_status st = pkv_append(s, 0, kv, kv);
        if (st != PKV_OK)
            return st;
    }
    return PKV_OK;
}

/* Plain sequential write then read of `bytes` in 1 MiB requests; seconds of each.
 * -1 after a message that names the file and the OS's reason. */
static int plain_io(const char *dir, uint64_t bytes, double *w_s, double *r_s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/.pagedkv-bench-XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0) {
        cli_fail("bench", "spill: cannot create '%s': %s", path, strerror(errno));
        return -1;
    }
    unlink(path);
    const size_t chunk = 1u << 20;
    char *buf = aligned_alloc(4096, chunk);
    if (!buf) {
        close(fd);
        cli_fail("bench", "spill: out of memory");
        return -1;
    }
    memset(buf, 0x5a, chunk);
    errno = 0;
    double t0 = cli_now();
    for (uint64_t off = 0; off < bytes; off += chunk)
        if (pwrite(fd, buf, chunk, (off_t)off) != (ssize_t)chunk)
            goto fail;
    double t1 = cli_now();
    for (uint64_t off = 0; off < bytes; off += chunk)
        if (pread(fd, buf, chunk, (off_t)off) != (ssize_t)chunk)
            goto fail;
    *w_s = t1 - t0;
    *r_s = cli_now() - t1;
    free(buf);
    close(fd);
    return 0;
fail:
    cli_fail("bench", "spill: plain I/O on '%s' (unlinked): %s", path,
             errno ? strerror(errno) : "a short write or read");
    free(buf);
    close(fd);
    return -1;
}

static int run_backend(const char *dir, uint64_t mib, int reps, spill_result *res)
{
    const uint64_t page = 2ull * GEOM_G * 16 * GEOM_D * 2; /* default 16-token pages */
    const uint64_t bytes = mib << 20, pages = bytes / page, tokens = pages * 16;
    pkv_engine *e = NULL, *twin = NULL;
    pkv_session *a = NULL, *b = NULL, *ta = NULL;
    float *kv = calloc(GEOM_G * GEOM_D, sizeof(float));
    float *q = calloc(GEOM_H * GEOM_D, sizeof(float)), *o = calloc(GEOM_H * GEOM_D, 4);
    double *sw = calloc((size_t)reps, sizeof(double));
    double *pl = calloc((size_t)reps, sizeof(double));
    int rc = CLI_FAIL;
    if (!kv || !q || !o || !sw || !pl)
        goto out;
    for (uint32_t i = 0; i < GEOM_H * GEOM_D; i++)
        q[i] = (float)(i % 7) * 0.01f;
    /* budget: one session's pages (+ slack below one page) */
    if (make_engine(pages * page + page / 2, dir, &e) != PKV_OK ||
        make_engine(0, NULL, &twin) != PKV_OK || pkv_session_create(e, &a) != PKV_OK ||
        pkv_session_create(e, &b) != PKV_OK || pkv_session_create(twin, &ta) != PKV_OK ||
        fill(a, tokens, kv) != PKV_OK || fill(b, tokens, kv) != PKV_OK ||
        fill(ta, tokens, kv) != PKV_OK) {
        cli_fail("bench", "spill: could not build the sessions (%llu MiB each)",
                 (unsigned long long)mib);
        goto out;
    }
    pkv_stats st;
    pkv_engine_stats(e, &st);
    res->backend = st.io_backend;
    if (pkv_decode(a, 0, q, o) != PKV_OK) /* A resident, B on disk */
        goto out;
    for (int r = 0; r < reps; r++) {
        double t0 = cli_now();
        pkv_status s1 = pkv_decode(b, 0, q, o); /* B in, A out */
        pkv_status s2 = pkv_decode(a, 0, q, o); /* A in, B out */
        double t1 = cli_now();
        pkv_status s3 = pkv_decode(ta, 0, q, o);
        pkv_status s4 = pkv_decode(ta, 0, q, o);
        double t2 = cli_now();
        double w, rd;
        if (s1 || s2 || s3 || s4) {
            cli_fail("bench", "spill: a decode failed: %s",
                     pkv_status_str(s1 ? s1 : s2 ? s2 : s3 ? s3 : s4));
            goto out;
        }
        if (plain_io(dir, bytes, &w, &rd) != 0)
            goto out;
        double spill_s = (t1 - t0) - (t2 - t1); /* two switches minus two decodes */
        sw[r] = 4.0 * (double)bytes / (spill_s > 1e-9 ? spill_s : 1e-9) / 1e9;
        pl[r] = 2.0 * (double)bytes / (w + rd) / 1e9;
    }
    res->spill_gbs = bench_median(sw, (uint32_t)reps);
    res->plain_gbs = bench_median(pl, (uint32_t)reps);
    rc = CLI_OK;
out:
    pkv_session_destroy(a);
    pkv_session_destroy(b);
    pkv_session_destroy(ta);
    pkv_engine_destroy(e);
    pkv_engine_destroy(twin);
    free(kv);
    free(q);
    free(o);
    free(sw);
    free(pl);
    return rc;
}

int bench_spill(const char *dir, uint64_t mib, int reps, bool json)
{
    spill_result r[2];
    const char *names[2] = {"io_uring", "sync"};
    int n = 0;
    for (int i = 0; i < 2; i++) {
        if (i == 1)
            setenv("PKV_NO_URING", "1", 1);
        int rc = run_backend(dir, mib, reps, &r[n]);
        if (i == 1)
            unsetenv("PKV_NO_URING");
        if (rc != CLI_OK)
            return rc;
        if (i == 0 && strcmp(r[n].backend, names[0]) != 0) {
            fprintf(stderr, "pagedkv bench: io_uring unavailable here; sync only\n");
            continue;
        }
        n++;
    }
    if (json) {
        /* the top-level keys of every `bench --json`, then the spill figures */
        json_writer w = {stdout, true, true}, *W = &w;
        json_open(W, NULL, '{');
        cli_json_envelope(W, "bench", NULL);
        json_str(W, "spill_dir", dir);
        json_open(W, "spill", '{');
        json_u64(W, "mib_per_session", mib);
        json_u64(W, "reps", (uint64_t)reps);
        json_open(W, "backends", '[');
        for (int i = 0; i < n; i++) {
            json_open(W, NULL, '{');
            json_str(W, "backend", r[i].backend);
            json_fmt(W, "spill_restore_gbs", "%.3f", r[i].spill_gbs);
            json_fmt(W, "plain_seq_gbs", "%.3f", r[i].plain_gbs);
            json_fmt(W, "ratio", "%.3f", r[i].spill_gbs / r[i].plain_gbs);
            json_close(W, '}');
        }
        json_close(W, ']');
        json_close(W, '}');
        json_close(W, '}');
        fputc('\n', stdout);
        return CLI_OK;
    }
    printf("spill + restore vs plain sequential write + read, %llu MiB a session, "
           "median of %d, in %s\n",
           (unsigned long long)mib, reps, dir);
    printf("  %-9s %14s %14s %7s\n", "backend", "spill GB/s", "plain GB/s", "ratio");
    for (int i = 0; i < n; i++)
        printf("  %-9s %14.2f %14.2f %7.2f\n", r[i].backend, r[i].spill_gbs, r[i].plain_gbs,
               r[i].spill_gbs / r[i].plain_gbs);
    return CLI_OK;
}

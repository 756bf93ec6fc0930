/* testutil.c - see testutil.h. */
#include "testutil.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"

extern char **environ;

/* ---- seeds and the RNG ------------------------------------------------------------ */

uint64_t pkvt_seed(void)
{
    const char *s = getenv("PKV_TEST_SEED");
    if (s && *s)
        return strtoull(s, NULL, 0);
    return 0x9e3779b97f4a7c15ull;
}

bool pkvt_quick(void)
{
    const char *s = getenv("PKV_TEST_QUICK");
    return s && *s == '1';
}

void pkvt_rng_init(pkvt_rng *r, uint64_t seed)
{
    r->s = seed ? seed : 0x2545f4914f6cdd1dull;
}

uint64_t pkvt_next(pkvt_rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545f4914f6cdd1dull;
}

uint32_t pkvt_below(pkvt_rng *r, uint32_t n)
{
    return n ? (uint32_t)((pkvt_next(r) >> 32) % n) : 0;
}

float pkvt_uniform(pkvt_rng *r, float lo, float hi)
{
    double u = (double)(pkvt_next(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(lo + (hi - lo) * u);
}

void pkvt_fill(pkvt_rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = pkvt_uniform(r, lo, hi);
}

/* ---- sizes and memory ------------------------------------------------------------- */

size_t pkvt_mul(uint64_t a, uint64_t b)
{
    uint64_t p = 0;
    const bool over = __builtin_mul_overflow(a, b, &p);
    ck_assert_msg(!over && p <= SIZE_MAX, "size %llu * %llu overflows",
                  (unsigned long long)a, (unsigned long long)b);
    return (size_t)p;
}

void *pkvt_alloc(size_t bytes)
{
    void *p = calloc(1, bytes ? bytes : 1);
    ck_assert_msg(p != NULL, "out of memory allocating %zu bytes", bytes);
    return p;
}

void *pkvt_calloc(uint64_t n, uint64_t size)
{
    return pkvt_alloc(pkvt_mul(n, size));
}

/* ---- the test oracle ---------------------------------------------------------------- */

void pkvt_oracle_decode(uint32_t h, uint32_t g, uint32_t d, double scale, uint64_t n_pos,
                        const double *q, const double *K, const double *V, double *out)
{
    const double sc = scale > 0 ? scale : 1.0 / sqrt((double)d);
    double *w = pkvt_calloc(n_pos, sizeof(double));
    for (uint32_t i = 0; i < h; i++) {
        const uint32_t grp = (uint32_t)((uint64_t)i * g / h);
        const double *qi = q + (size_t)i * d;
        double mx = -INFINITY;
        for (uint64_t j = 0; j < n_pos; j++) {
            const double *kj = K + ((size_t)j * g + grp) * d;
            double s = 0;
            for (uint32_t c = 0; c < d; c++)
                s += qi[c] * kj[c];
            w[j] = s * sc;
            mx = fmax(mx, w[j]);
        }
        double sum = 0;
        for (uint64_t j = 0; j < n_pos; j++) {
            w[j] = exp(w[j] - mx);
            sum += w[j];
        }
        double *o = out + (size_t)i * d;
        for (uint32_t c = 0; c < d; c++)
            o[c] = 0;
        for (uint64_t j = 0; j < n_pos; j++) {
            const double *vj = V + ((size_t)j * g + grp) * d;
            for (uint32_t c = 0; c < d; c++)
                o[c] += w[j] * vj[c];
        }
        for (uint32_t c = 0; c < d; c++)
            o[c] /= sum;
    }
    free(w);
}

void pkvt_oracle_causal(uint32_t T, uint32_t h, uint32_t g, uint32_t d, double scale,
                        const double *Q, const double *K, const double *V, double *out)
{
    const size_t row = (size_t)h * d;
    for (uint32_t t = 0; t < T; t++)
        pkvt_oracle_decode(h, g, d, scale, (uint64_t)t + 1, Q + t * row, K, V, out + t * row);
}

double *pkvt_to_double(const float *x, size_t n)
{
    double *d = pkvt_calloc(n, sizeof(double));
    for (size_t i = 0; i < n; i++)
        d[i] = x[i];
    return d;
}

void pkvt_ref_decode(uint32_t h, uint32_t g, uint32_t d, float scale, pkv_dtype dt,
                     uint64_t n_pos, const float *q, const float *K, const float *V,
                     double *out)
{
    const size_t nkv = pkvt_mul(pkvt_mul(n_pos, g), d);
    double *qd = pkvt_to_double(q, (size_t)h * d);
    double *Kd = pkvt_calloc(nkv, sizeof(double)), *Vd = pkvt_calloc(nkv, sizeof(double));
    for (size_t i = 0; i < nkv; i++) {
        Kd[i] = pkv_dtype_round(dt, K[i]);
        Vd[i] = pkv_dtype_round(dt, V[i]);
    }
    pkvt_oracle_decode(h, g, d, scale, n_pos, qd, Kd, Vd, out);
    free(qd);
    free(Kd);
    free(Vd);
}

float pkvt_maxabs(const float *x, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++)
        if (fabsf(x[i]) > m)
            m = fabsf(x[i]);
    return m;
}

double pkvt_maxdiff_fd(const float *a, const double *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double df = fabs((double)a[i] - b[i]);
        if (!(df <= m)) /* NaN propagates as "infinitely wrong" */
            m = isnan(df) ? INFINITY : df;
    }
    return m;
}

double pkvt_maxdiff_ff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double df = fabs((double)a[i] - (double)b[i]);
        if (!(df <= m))
            m = isnan(df) ? INFINITY : df;
    }
    return m;
}

/* ---- engines -------------------------------------------------------------------------- */

pkv_config pkvt_config(uint32_t layers, uint32_t h, uint32_t g, uint32_t d, uint32_t bt,
                       pkv_dtype dt)
{
    pkv_config c = pkv_config_default();
    c.n_layers = layers;
    c.n_heads = h;
    c.n_kv_heads = g;
    c.head_dim = d;
    c.block_tokens = bt;
    c.kv_dtype = dt;
    return c;
}

pkv_engine *pkvt_engine_cfg(const pkv_config *c)
{
    pkv_engine *e = NULL;
    pkv_status st = pkv_engine_create(c, &e);
    ck_assert_msg(st == PKV_OK,
                  "engine_create(L=%u h=%u g=%u d=%u bt=%u dt=%d threads=%u): %s",
                  c->n_layers, c->n_heads, c->n_kv_heads, c->head_dim, c->block_tokens,
                  (int)c->kv_dtype, c->n_threads, pkv_status_str(st));
    return e;
}

pkv_engine *pkvt_engine_workers(const pkv_config *c)
{
    pkv_engine *e = pkvt_engine_cfg(c);
    pkvi_exec_split_always(pkvi_engine_ctx(e).exec);
    return e;
}

pkv_engine *pkvt_engine(uint32_t layers, uint32_t h, uint32_t g, uint32_t d, uint32_t bt,
                        pkv_dtype dt)
{
    const pkv_config c = pkvt_config(layers, h, g, d, bt, dt);
    return pkvt_engine_cfg(&c);
}

pkv_session *pkvt_session(pkv_engine *e)
{
    pkv_session *s = NULL;
    pkv_status st = pkv_session_create(e, &s);
    ck_assert_msg(st == PKV_OK, "session_create: %s", pkv_status_str(st));
    return s;
}

void pkvt_append_random(pkv_session *s, pkvt_rng *r, uint32_t layer, uint64_t n,
                        float k_abs, float v_abs)
{
    const pkv_config c = s->geom->cfg;
    const size_t gk = pkvt_mul(c.n_kv_heads, c.head_dim);
    const size_t gv = pkvt_mul(c.n_kv_heads, c.head_dim_v ? c.head_dim_v : c.head_dim);
    float *k = pkvt_calloc(gk, sizeof(float)), *v = pkvt_calloc(gv, sizeof(float));
    for (uint64_t t = 0; t < n; t++) {
        pkvt_fill(r, k, gk, -k_abs, k_abs);
        pkvt_fill(r, v, gv, -v_abs, v_abs);
        ck_assert_int_eq(pkv_append(s, layer, k, v), PKV_OK);
    }
    free(k);
    free(v);
}

/* ---- hosts, kernels and backends -------------------------------------------------- */

const char *const pkvt_built_isas[] = {
    "scalar",
#if PKV_HAVE_X86_KERNELS
    "avx2",
    "avx2vnni",
    "avx512",
    "avx512vnni",
#endif
#if PKV_HAVE_ARM_KERNELS
    "neon",
    "neon_dotprod",
#endif
    NULL,
};

const char *pkvt_uring_skip_reason(void)
{
    const char *no = getenv("PKV_NO_URING");
    if (no != NULL && strcmp(no, "1") == 0)
        return "PKV_NO_URING=1 is set";
    int probe = pkvi_uring_probe();
    if (probe != 0)
        return probe == -ENOSYS ? "built without liburing" : strerror(-probe);
    return NULL;
}

/* Is every word of `words` (space-separated) a word of the first line that starts
 * with `key` ("flags" on x86, "Features" on aarch64)? -1 when there is none. */
static int cpuinfo_line_has(const char *key, const char *words)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return -1;
    static char line[16384];
    int found = -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, strlen(key)) != 0 || !strchr(line, ':'))
            continue;
        found = 1;
        char want[256];
        snprintf(want, sizeof want, "%s", words);
        for (char *save = NULL, *w = strtok_r(want, " ", &save); w;
             w = strtok_r(NULL, " ", &save)) {
            /* a whole word of the list: " w " or " w\n" */
            const size_t n = strlen(w);
            const char *p = strchr(line, ':') + 1;
            bool hit = false;
            while ((p = strstr(p, w)) != NULL) {
                if (p[-1] == ' ' && (p[n] == ' ' || p[n] == '\n' || p[n] == 0)) {
                    hit = true;
                    break;
                }
                p += n;
            }
            if (!hit)
                found = 0;
        }
        break; /* the first CPU speaks for all */
    }
    fclose(f);
    return found;
}

static int cpuinfo_flags_have(const char *words)
{
    return cpuinfo_line_has("flags", words);
}

int pkvt_cpuinfo_has_isa(const char *isa)
{
    if (strcmp(isa, "scalar") == 0)
        return 1;
    if (strcmp(isa, "avx2") == 0)
        return cpuinfo_flags_have("avx avx2 fma f16c");
    if (strcmp(isa, "avx2vnni") == 0)
        return pkvt_cpuinfo_has_isa("avx2") == 1 && cpuinfo_flags_have("avx_vnni") == 1;
    if (strcmp(isa, "avx512") == 0) /* emulated (a test build): AVX2 is enough */
        return PKV_AVX512_EMULATED
                   ? pkvt_cpuinfo_has_isa("avx2")
                   : cpuinfo_flags_have("avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq");
    if (strcmp(isa, "avx512vnni") == 0)
        return PKV_AVX512_EMULATED ? pkvt_cpuinfo_has_isa("avx2")
                                   : pkvt_cpuinfo_has_isa("avx512") == 1 &&
                                         cpuinfo_flags_have("avx512_vnni") == 1;
    /* aarch64's names of AT_HWCAP's bits; qemu-user shows the host's file (no
     * Features line: -1) */
    if (strcmp(isa, "neon") == 0)
        return cpuinfo_line_has("Features", "asimd");
    if (strcmp(isa, "neon_dotprod") == 0)
        return cpuinfo_line_has("Features", "asimd asimddp");
    return 0;
}

static bool model_files_in(const char *dir)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/stories260K.bin", dir);
    if (access(p, R_OK) != 0)
        return false;
    snprintf(p, sizeof p, "%s/tok512.bin", dir);
    return access(p, R_OK) == 0;
}

const char *pkvt_model_dir(void)
{
    const char *dir = getenv("PKV_MODEL_DIR");
    if (dir && *dir)
        return dir;
    /* meson's list: the first directory that holds both files, else the first */
    static char first[4096], pick[4096];
    const char *list = getenv("PKV_MODEL_DIR_BUILD");
    snprintf(first, sizeof first, "%s", list && *list ? list : "../shared/models");
    char *colon = strchr(first, ':');
    if (colon)
        *colon = '\0';
    for (const char *p = list; p && *p;) {
        const char *end = strchr(p, ':');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        snprintf(pick, sizeof pick, "%.*s", (int)n, p);
        if (n && model_files_in(pick))
            return pick;
        p = end ? end + 1 : NULL;
    }
    return first;
}

bool pkvt_model_paths(char *model, char *tok, size_t cap)
{
    const char *dir = pkvt_model_dir();
    const int a = snprintf(model, cap, "%s/stories260K.bin", dir);
    const int b = snprintf(tok, cap, "%s/tok512.bin", dir);
    return a > 0 && (size_t)a < cap && b > 0 && (size_t)b < cap &&
           access(model, R_OK) == 0 && access(tok, R_OK) == 0;
}

const char *pkvt_need_unmet(const char *need)
{
    if (strcmp(need, "uring") == 0)
        return pkvt_uring_skip_reason();
    if (strcmp(need, "model") == 0) {
        static char why[8192 + 256];
        char model[4096], tok[4096];
        if (pkvt_model_paths(model, tok, sizeof model))
            return NULL;
        snprintf(why, sizeof why, "stories260K.bin and tok512.bin are not both readable in "
                 "'%s' (set PKV_MODEL_DIR or meson -Dmodel_dir; README.md, \"A real "
                 "model\", says where to get them)", pkvt_model_dir());
        return why;
    }
    if (strcmp(need, "rss") == 0) {
        if (PKVT_SHADOW_SANITIZER)
            return "a sanitizer's shadow memory is part of RSS";
        const char *pre = getenv("LD_PRELOAD");
        if (pre && strstr(pre, "vgpreload"))
            return "valgrind replaces the allocator: RSS says nothing here";
        return NULL;
    }
    if (strcmp(need, "timing") == 0) {
        /* threads at their own speed: valgrind runs one thread at a time, and a
         * spinning one holds the others off for long stretches (minutes) */
        const char *pre = getenv("LD_PRELOAD");
        if (pre && strstr(pre, "vgpreload"))
            return "valgrind runs one thread at a time: thread-rate runs crawl there";
        return NULL;
    }
    if (strcmp(need, "python") == 0)
        return pkvt_python_path() ? NULL : "no python3 (/usr/bin/python3 or on PATH)";
    if (strcmp(need, "crc32c_hw") == 0)
        return pkvi_crc32c_hw_available() ? NULL : "no hardware CRC-32C (SSE4.2) here";
    if (strcmp(need, "tool") == 0) {
        const char *t = getenv("PKV_TOOL");
        if (!t || !*t || access(t, X_OK) != 0)
            return "PKV_TOOL is not an executable (run through meson test)";
        return NULL;
    }
    return NULL;
}

static bool known_need(const char *need)
{
    static const char *const all[] = {"uring", "model", "rss", "tool", "python",
                                      "crc32c_hw", "timing"};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(need, all[i]) == 0)
            return true;
    return false;
}

/* ---- processes ------------------------------------------------------------------------ */

static char *read_fd(int fd, size_t *len)
{
    size_t cap = 1 << 14, n = 0;
    char *buf = pkvt_alloc(cap);
    ck_assert(lseek(fd, 0, SEEK_SET) == 0);
    for (;;) {
        if (cap - n < 2) {
            cap *= 2;
            buf = realloc(buf, cap);
            ck_assert(buf != NULL);
        }
        ssize_t got = read(fd, buf + n, cap - n - 1);
        ck_assert_msg(got >= 0, "read: %s", strerror(errno));
        if (got == 0)
            break;
        n += (size_t)got;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

int pkvt_tmp_fd(void)
{
    const char *dir = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/pkvt-proc-XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(path);
    ck_assert_msg(fd >= 0, "mkstemp(%s): %s", path, strerror(errno));
    unlink(path);
    return fd;
}

void pkvt_scratch_dir(char *dir, size_t cap, const char *what)
{
    const char *base = getenv("TMPDIR");
    snprintf(dir, cap, "%s/pkv-test-%s-XXXXXX", base && *base ? base : "/tmp", what);
    ck_assert_msg(mkdtemp(dir) != NULL, "mkdtemp(%s): %s", dir, strerror(errno));
}

void pkvt_remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    char p[8192];
    for (struct dirent *de; (de = readdir(d)) != NULL;) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (unlink(p) != 0)
            rmdir(p);
    }
    closedir(d);
    rmdir(dir);
}

int pkvt_dir_entries(const char *dir, const char *except)
{
    DIR *d = opendir(dir);
    ck_assert_msg(d != NULL, "opendir(%s): %s", dir, strerror(errno));
    int n = 0;
    for (struct dirent *de; (de = readdir(d)) != NULL;)
        n += strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0 &&
             (except == NULL || strcmp(de->d_name, except) != 0);
    closedir(d);
    return n;
}

void *pkvt_read_file(const char *path, size_t *len)
{
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    size_t n = 0;
    char *b = read_fd(fd, &n);
    close(fd);
    if (len)
        *len = n;
    return b;
}

void *pkvt_slurp(const char *path, size_t *len)
{
    void *b = pkvt_read_file(path, len);
    ck_assert_msg(b != NULL, "cannot open %s: %s", path, strerror(errno));
    return b;
}

void pkvt_write_file(const char *path, const void *bytes, size_t n)
{
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f != NULL, "cannot create %s: %s", path, strerror(errno));
    ck_assert_uint_eq(fwrite(bytes, 1, n, f), n);
    ck_assert_int_eq(fclose(f), 0);
}

uint32_t pkvt_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint64_t pkvt_le64(const unsigned char *p)
{
    return pkvt_le32(p) | (uint64_t)pkvt_le32(p + 4) << 32;
}

void pkvt_put_le32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> 8 * i);
}

void pkvt_put_le64(unsigned char *p, uint64_t v)
{
    pkvt_put_le32(p, (uint32_t)v);
    pkvt_put_le32(p + 4, (uint32_t)(v >> 32));
}

/* Does environment entry e ("NAME=...") have the name of change c ("NAME" or "NAME=")? */
static bool same_name(const char *e, const char *c)
{
    const size_t n = strcspn(c, "=");
    return strncmp(e, c, n) == 0 && e[n] == '=';
}

pkvt_child pkvt_start(const char *path, const char *const *argv, const char *const *env)
{
    size_t ne = 0, nc = 0;
    while (environ[ne])
        ne++;
    while (env && env[nc])
        nc++;
    char **envp = pkvt_calloc(ne + nc + 1, sizeof *envp);
    size_t k = 0;
    for (size_t i = 0; i < ne; i++) {
        bool changed = false;
        for (size_t j = 0; j < nc && !changed; j++)
            changed = same_name(environ[i], env[j]);
        if (!changed)
            envp[k++] = environ[i];
    }
    for (size_t j = 0; j < nc; j++)
        if (strchr(env[j], '='))
            envp[k++] = (char *)env[j];
    envp[k] = NULL;

    pkvt_child c = {.pid = -1, .out_fd = pkvt_tmp_fd(), .err_fd = pkvt_tmp_fd()};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, c.out_fd, 1);
    posix_spawn_file_actions_adddup2(&fa, c.err_fd, 2);
    pid_t pid;
    const int rc = posix_spawn(&pid, path, &fa, NULL, (char *const *)argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    free(envp);
    ck_assert_msg(rc == 0, "cannot start %s: %s", path, strerror(rc));
    c.pid = pid;
    return c;
}

pkvt_proc pkvt_finish(pkvt_child *c)
{
    int st;
    pid_t w;
    while ((w = waitpid(c->pid, &st, 0)) < 0 && errno == EINTR)
        ;
    ck_assert_msg(w == c->pid, "waitpid: %s", strerror(errno));
    pkvt_proc p = {0};
    p.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    p.out = read_fd(c->out_fd, &p.out_len);
    p.err = read_fd(c->err_fd, &p.err_len);
    close(c->out_fd);
    close(c->err_fd);
    c->out_fd = c->err_fd = -1;
    return p;
}

pkvt_proc pkvt_spawn(const char *path, const char *const *argv, const char *const *env)
{
    pkvt_child c = pkvt_start(path, argv, env);
    return pkvt_finish(&c);
}

const char *pkvt_tool_path(void)
{
    const char *tool = getenv("PKV_TOOL");
    ck_assert_msg(tool && *tool, "PKV_TOOL is not set (run through meson test)");
    return tool;
}

const char *pkvt_python_path(void)
{
    static char found[4096 + 16];
    if (access("/usr/bin/python3", X_OK) == 0)
        return "/usr/bin/python3";
    const char *path = getenv("PATH");
    for (const char *p = path ? path : ""; *p;) {
        const size_t n = strcspn(p, ":");
        if (n > 0 && n < sizeof found - 16) {
            snprintf(found, sizeof found, "%.*s/python3", (int)n, p);
            if (access(found, X_OK) == 0)
                return found;
        }
        p += n + (p[n] == ':');
    }
    return NULL;
}

pkvt_proc pkvt_tool(const char *const *args, const char *const *env)
{
    const char *tool = pkvt_tool_path();
    size_t n = 0;
    while (args[n])
        n++;
    const char **argv = pkvt_calloc(n + 2, sizeof *argv);
    argv[0] = "pagedkv";
    memcpy(argv + 1, args, n * sizeof *argv);
    pkvt_proc p = pkvt_spawn(tool, argv, env);
    free(argv);
    return p;
}

void pkvt_proc_free(pkvt_proc *p)
{
    free(p->out);
    free(p->err);
    p->out = p->err = NULL;
}

/* ---- JSON ------------------------------------------------------------------------------
 * A strict skipper (RFC 8259 grammar, depth-limited): each function takes a pointer to
 * the start of a value and returns the pointer just past it, or NULL if malformed. */

static const char *ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

static const char *j_value(const char *p, int depth);

static const char *j_string(const char *p)
{
    if (*p++ != '"')
        return NULL;
    for (;;) {
        const unsigned char c = (unsigned char)*p++;
        if (c == '"')
            return p;
        if (c < 0x20)
            return NULL; /* NUL (end of text) or a raw control character */
        if (c == '\\') {
            const char e = *p++;
            if (e == 'u') {
                for (int i = 0; i < 4; i++)
                    if (!isxdigit((unsigned char)*p++))
                        return NULL;
            } else if (!strchr("\"\\/bfnrt", e) || e == 0) {
                return NULL;
            }
        }
    }
}

static const char *j_number(const char *p)
{
    if (*p == '-')
        p++;
    if (*p == '0')
        p++;
    else if (*p >= '1' && *p <= '9')
        while (isdigit((unsigned char)*p))
            p++;
    else
        return NULL;
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p))
            return NULL;
        while (isdigit((unsigned char)*p))
            p++;
    }
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-')
            p++;
        if (!isdigit((unsigned char)*p))
            return NULL;
        while (isdigit((unsigned char)*p))
            p++;
    }
    return p;
}

static const char *j_seq(const char *p, int depth, char close, bool object)
{
    p = ws(p + 1);
    if (*p == close)
        return p + 1;
    for (;;) {
        if (object) {
            if (!(p = j_string(p)))
                return NULL;
            p = ws(p);
            if (*p++ != ':')
                return NULL;
        }
        if (!(p = j_value(ws(p), depth + 1)))
            return NULL;
        p = ws(p);
        if (*p == close)
            return p + 1;
        if (*p++ != ',')
            return NULL;
        p = ws(p);
    }
}

static const char *j_value(const char *p, int depth)
{
    if (depth > 64)
        return NULL;
    switch (*p) {
    case '{': return j_seq(p, depth, '}', true);
    case '[': return j_seq(p, depth, ']', false);
    case '"': return j_string(p);
    case 't': return strncmp(p, "true", 4) == 0 ? p + 4 : NULL;
    case 'f': return strncmp(p, "false", 5) == 0 ? p + 5 : NULL;
    case 'n': return strncmp(p, "null", 4) == 0 ? p + 4 : NULL;
    default: return j_number(p);
    }
}

bool pkvt_json_valid(const char *text)
{
    const char *e = text ? j_value(ws(text), 0) : NULL;
    return e != NULL && *ws(e) == 0;
}

/* The value at `path` inside the (valid) value at p, or NULL. */
static const char *j_find(const char *p, const char *path)
{
    p = ws(p);
    if (*path == 0)
        return p;
    if (*path == '.')
        path++;
    if (*path == '[') {
        if (*p != '[')
            return NULL;
        char *end;
        unsigned long idx = strtoul(path + 1, &end, 10);
        if (*end != ']')
            return NULL;
        p = ws(p + 1);
        for (unsigned long i = 0; *p != ']'; i++) {
            if (i == idx)
                return j_find(p, end + 1);
            p = ws(j_value(p, 0));
            if (*p == ',')
                p = ws(p + 1);
        }
        return NULL;
    }
    if (*p != '{')
        return NULL;
    const size_t klen = strcspn(path, ".[");
    p = ws(p + 1);
    while (*p == '"') {
        const char *ks = p + 1, *ke = j_string(p);
        p = ws(ws(ke) + 1); /* past ':' */
        if ((size_t)(ke - 1 - ks) == klen && strncmp(ks, path, klen) == 0)
            return j_find(p, path + klen);
        p = ws(j_value(p, 0));
        if (*p == ',')
            p = ws(p + 1);
    }
    return NULL;
}

const char *pkvt_json_find(const char *json, const char *path)
{
    ck_assert_msg(pkvt_json_valid(json), "not valid JSON: %.400s", json ? json : "(null)");
    return j_find(json, path);
}

static const char *j_need(const char *json, const char *path)
{
    const char *v = pkvt_json_find(json, path);
    ck_assert_msg(v != NULL, "no \"%s\" in the JSON: %.400s", path, json);
    return v;
}

uint64_t pkvt_json_u64(const char *json, const char *path)
{
    const char *v = j_need(json, path);
    char *end = NULL;
    errno = 0;
    const unsigned long long x = strtoull(v, &end, 10);
    ck_assert_msg(isdigit((unsigned char)*v) && end == j_number(v) && errno == 0,
                  "\"%s\" is not a non-negative integer: %.40s", path, v);
    return x;
}

double pkvt_json_num(const char *json, const char *path)
{
    const char *v = j_need(json, path);
    char *end = NULL;
    const double x = strtod(v, &end);
    ck_assert_msg(end != v && end == j_number(v), "\"%s\" is not a number: %.40s", path, v);
    return x;
}

size_t pkvt_json_len(const char *json, const char *path)
{
    const char *p = j_need(json, path);
    ck_assert_msg(*p == '[' || *p == '{', "\"%s\" is neither an array nor an object", path);
    const bool object = *p == '{';
    const char close = object ? '}' : ']';
    p = ws(p + 1);
    size_t n = 0;
    while (*p != close) {
        if (object)
            p = ws(ws(j_string(p)) + 1);
        p = ws(j_value(p, 0));
        n++;
        if (*p == ',')
            p = ws(p + 1);
    }
    return n;
}

bool pkvt_json_is(const char *json, const char *path, const char *literal)
{
    const char *v = j_need(json, path);
    const char *end = j_value(v, 0);
    return (size_t)(end - v) == strlen(literal) && strncmp(v, literal, strlen(literal)) == 0;
}

/* ---- running ---------------------------------------------------------------------- */

/* PKVT_SKIP with the reason on stdout (meson's log shows it), EXIT_FAILURE for a
 * requirement that is misspelt, or -1 when everything the run needs is here. */
static int check_requirements(void)
{
    const char *isa = getenv("PKV_FORCE_ISA");
    if (isa && *isa) {
        static const char *const known[] = {"scalar",     "avx2", "avx2vnni",    "avx512",
                                            "avx512vnni", "neon", "neon_dotprod"};
        bool ok = false;
        for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
            ok = ok || strcmp(isa, known[i]) == 0;
        if (!ok) {
            printf("PKV_FORCE_ISA=%s names no kernel ISA\n", isa);
            return EXIT_FAILURE;
        }
        if (!pkvi_isa_supported(isa)) {
            printf("SKIP: this build or host cannot run the %s kernels\n", isa);
            return PKVT_SKIP;
        }
    }
    const char *needs = getenv("PKV_TEST_NEEDS");
    if (needs && *needs) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", needs);
        for (char *save = NULL, *w = strtok_r(buf, ", ", &save); w;
             w = strtok_r(NULL, ", ", &save)) {
            if (!known_need(w)) {
                printf("PKV_TEST_NEEDS: unknown requirement '%s'\n", w);
                return EXIT_FAILURE;
            }
            const char *why = pkvt_need_unmet(w);
            if (why) {
                printf("SKIP: needs %s: %s\n", w, why);
                return PKVT_SKIP;
            }
        }
    }
    return -1;
}

/* Before main: a program whose main() builds engines before calling pkvt_run (say, to
 * probe the I/O backend) would fail, not skip, on a host without the forced ISA. So
 * the requirements are checked before any of the program runs, and again (for
 * programs that change their environment) in pkvt_run. */
__attribute__((constructor)) static void requirements_before_main(void)
{
    const int req = check_requirements();
    if (req >= 0) {
        fflush(stdout);
        _exit(req);
    }
}

/* The cases pkvt_add_tcase_needing left out of this process's suite, for pkvt_run. */
static int cases_left_out;

void pkvt_add_tcase_needing(Suite *s, TCase *tc, const char *name, const char *needs)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", needs);
    for (char *save = NULL, *w = strtok_r(buf, ", ", &save); w;
         w = strtok_r(NULL, ", ", &save)) {
        if (!known_need(w)) {   /* a misspelt requirement must not pass as a skip */
            printf("case %s: unknown requirement '%s'\n", name, w);
            exit(EXIT_FAILURE);
        }
        const char *why = pkvt_need_unmet(w);
        if (!why)
            continue;
        const char *only = getenv("CK_RUN_CASE");
        if (!only || !*only || strcmp(only, name) == 0) {
            printf("SKIP: case %s: needs %s: %s\n", name, w, why);
            cases_left_out++;
        }
        /* Check frees a TCase only through its suite: a suite of its own, freed at once */
        Suite *out = suite_create("left out");
        suite_add_tcase(out, tc);
        srunner_free(srunner_create(out));
        return;
    }
    suite_add_tcase(s, tc);
}

int pkvt_run(Suite *s)
{
    const int req = check_requirements();
    if (req >= 0) {
        srunner_free(srunner_create(s)); /* Check frees suites through a runner */
        return req;
    }
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    const int ran = srunner_ntests_run(sr);
    const int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    const char *isa = getenv("PKV_FORCE_ISA"), *seed = getenv("PKV_TEST_SEED");
    if (ran == 0 && cases_left_out > 0)
        return PKVT_SKIP;   /* every case this run selected needs what the host lacks */
    if (ran == 0) {
        const char *only = getenv("CK_RUN_CASE");
        printf("no test ran (CK_RUN_CASE=%s names no test case): a run that tests nothing "
               "fails\n", only ? only : "(unset)");
        return EXIT_FAILURE;
    }
    if (failed) {
        printf("%d of %d failed; seed 0x%llx (%s; rerun with PKV_TEST_SEED=0x%llx), "
               "kernels %s%s\n",
               failed, ran, (unsigned long long)pkvt_seed(),
               seed && *seed ? "from PKV_TEST_SEED" : "the default",
               (unsigned long long)pkvt_seed(), isa && *isa ? isa : "auto",
               pkvt_quick() ? ", PKV_TEST_QUICK=1" : "");
        return EXIT_FAILURE;
    }
    return EXIT_SUCCESS;
}

/*
 * fuzz_load.c - libFuzzer harness for pkv_session_load on arbitrary bytes.
 *
 * Properties: loading never crashes, leaks or half-loads; the engine's invariants hold
 * after every attempt; and the format is canonical - a file that loads, saved again,
 * is byte for byte the input (so every byte of a loadable file is checked by load).
 * The engine geometry is fixed (the seeds in corpus/load were written with it by
 * make_seeds.c); a file refused by the plain engine as another engine's (PKV_EINVAL) is
 * offered to the same shape with RoPE, so that version-5 files with a RoPE config load
 * and their fields are fuzzed past the header check too. The properties hold for both.
 */
#include "internal.h"
#include "fuzz_geometry.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Scratch files live on tmpfs when the machine has one: save's fsyncs then cost
 * nothing, and the fuzzer runs hundreds of times faster than on a disk. */
static const char *scratch_dir(void)
{
    return access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
}

#define CHECK(c)                                                                     \
    do {                                                                             \
        if (!(c)) {                                                                  \
            fprintf(stderr, "fuzz_load: check failed: %s (line %d)\n", #c, __LINE__);  \
            __builtin_trap();                                                        \
        }                                                                            \
    } while (0)

static pkv_engine *engine, *rope_engine;

static int write_file(const char *path, const uint8_t *data, size_t size)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0)
        return -1;
    size_t off = 0;
    while (off < size) {
        ssize_t w = write(fd, data + off, size - off);
        if (w <= 0) {
            close(fd);
            return -1;
        }
        off += (size_t)w;
    }
    close(fd);
    return 0;
}

/* Load the file `in` (the bytes data [size]) into e and check the properties; the
 * status of the load. */
static pkv_status load_into(pkv_engine *e, const char *in, const char *again,
                            const uint8_t *data, size_t size)
{
    pkv_session *s = (pkv_session *)0x1;
    pkv_status st = pkv_session_load(e, in, &s);
    CHECK(st == PKV_OK || st == PKV_EINVAL || st == PKV_ECORRUPT);
    if (st != PKV_OK) {
        CHECK(s == (pkv_session *)0x1); /* a failed load leaves *out as it was */
    } else {
        CHECK(pkv_session_save(s, again) == PKV_OK);
        FILE *f = fopen(again, "rb");
        CHECK(f != NULL);
        uint8_t *buf = malloc(size + 1);
        CHECK(buf != NULL);
        size_t got = fread(buf, 1, size + 1, f);
        fclose(f);
        CHECK(got == size && memcmp(buf, data, size) == 0);
        free(buf);
        unlink(again);
        pkv_session_destroy(s);
    }
    CHECK(pkvi_engine_check(e));
    pkv_stats stt;
    pkv_engine_stats(e, &stt);
    CHECK(stt.pages_in_use == 0);
    return st;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!engine) {
        static pkv_layer_config lc[2];
        pkv_config c = pkvf_load_config();
        CHECK(pkv_engine_create(&c, &engine) == PKV_OK);
        c = pkvf_load_rope_config(lc);
        CHECK(pkv_engine_create(&c, &rope_engine) == PKV_OK);
    }
    char in[64], again[64];
    snprintf(in, sizeof in, "%s/pkv-fuzz-load-%d.in", scratch_dir(), (int)getpid());
    snprintf(again, sizeof again, "%s/pkv-fuzz-load-%d.out", scratch_dir(), (int)getpid());
    CHECK(write_file(in, data, size) == 0);
    if (load_into(engine, in, again, data, size) == PKV_EINVAL)
        load_into(rope_engine, in, again, data, size);
    unlink(in);
    return 0;
}

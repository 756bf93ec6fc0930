/*
 * cmd_inspect.c - `pagedkv inspect FILE [--json]`: print a session file's header and
 * verify every checksum and padding byte, without an engine.
 *
 * Owns: the presentation only. The reading and checking is persist.c's
 *   (pkvi_sfile_verify, the same code pkv_session_load runs), so the tool and the
 *   library can never disagree about what a sound file is.
 * Exit status: 0 the file is sound; 1 it is not (or cannot be read), the reason on
 *   stderr; 2 a usage error (cli.h).
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "io_backend.h"

static const char *const CMD = "inspect";

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pagedkv inspect FILE [--json]\n\n"
            "Print the header of a pagedkv session file (format version, geometry, dtype,\n"
            "block size, per-layer lengths, sizes) and verify the header checksum, the\n"
            "page table, every page's CRC-32C and the zero padding of partly filled pages.\n"
            "The format is described in docs/file-format.md.\n\n"
            "options:\n"
            "  --json   print the figures as one JSON object on stdout\n"
            "  --help   this text\n\n"
            "exit status: 0 the file is sound, 1 it is not (reason on stderr), 2 usage error.\n"
            "PKV_NO_URING=1 reads with pread instead of io_uring.\n");
}

static const char *dtype_name(uint32_t code)
{
    static const char *const names[] = {"f32", "f16", "bf16"};
    return code < 3 ? names[code] : "unknown";
}

static float bits_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* What the verdict means for a user. */
static const char *verdict(pkv_status st)
{
    switch (st) {
    case PKV_OK: return "sound";
    case PKV_EINVAL: return "not a session file this build can read";
    case PKV_ECORRUPT: return "damaged";
    case PKV_EIO: return "I/O error";
    case PKV_ENOMEM: return "out of memory";
    default: return pkv_status_str(st);
    }
}

/* The status a library call (pkv_session_load) would return, by name. */
static const char *status_name(pkv_status st)
{
    switch (st) {
    case PKV_OK: return "PKV_OK";
    case PKV_EINVAL: return "PKV_EINVAL";
    case PKV_ENOMEM: return "PKV_ENOMEM";
    case PKV_EIO: return "PKV_EIO";
    case PKV_ECORRUPT: return "PKV_ECORRUPT";
    default: return "other";
    }
}

static uint64_t total_tokens(const pkvi_sfile_info *in)
{
    uint64_t t = 0;
    for (uint32_t l = 0; in->layer_len != NULL && l < in->n_layers; l++)
        t += in->layer_len[l];
    return t;
}

static void print_text(const char *path, const pkvi_sfile_info *in, pkv_status st)
{
    char b1[32], b2[32];
    if (!in->header_sound)
        return;   /* nothing trustworthy to show; the reason goes to stderr */
    printf("file        %s (%llu bytes, %s)\n", path, (unsigned long long)in->file_bytes,
           cli_bytes(in->file_bytes, b1));
    printf("format      pagedkv session file, version %u\n", in->version);
    if (in->layer_len == NULL)
        return;
    printf("geometry    %u layers, %u heads, %u kv heads, head dim %u\n", in->n_layers,
           in->n_heads, in->n_kv_heads, in->head_dim);
    printf("dtype       %s\n", dtype_name(in->dtype_code));
    printf("scale       %.9g (bits 0x%08x)\n", (double)bits_float(in->scale_bits),
           in->scale_bits);
    printf("pages       %llu of %llu bytes, %u tokens each (%s of page data from offset %llu)\n",
           (unsigned long long)in->n_pages, (unsigned long long)in->page_bytes,
           in->block_tokens, cli_bytes(in->n_pages * in->page_bytes, b2),
           (unsigned long long)in->data_off);
    printf("tokens      %llu in all; per layer:", (unsigned long long)total_tokens(in));
    for (uint32_t l = 0; l < in->n_layers; l++)
        printf("%s%llu", l % 16 == 0 ? "\n              " : " ",
               (unsigned long long)in->layer_len[l]);
    printf("\n");
    if (st == PKV_OK)
        printf("checksums   header, page table and %llu pages verified; padding is zero\n",
               (unsigned long long)in->n_pages);
}

static void print_json(const char *path, const pkvi_sfile_info *in, pkv_status st,
                       const char *why)
{
    printf("{\"file\":");
    cli_json_str(stdout, path);
    printf(",\"sound\":%s,\"status\":", st == PKV_OK ? "true" : "false");
    cli_json_str(stdout, status_name(st));
    printf(",\"reason\":");
    cli_json_str(stdout, st == PKV_OK ? "" : why);
    printf(",\"file_bytes\":%llu,\"header_sound\":%s", (unsigned long long)in->file_bytes,
           in->header_sound ? "true" : "false");
    if (in->header_sound)
        printf(",\"version\":%u", in->version);
    if (in->header_sound && in->layer_len != NULL) {
        printf(",\"n_layers\":%u,\"n_heads\":%u,\"n_kv_heads\":%u,\"head_dim\":%u,"
               "\"dtype\":\"%s\",\"block_tokens\":%u,\"scale\":%.9g,\"scale_bits\":%u,"
               "\"page_bytes\":%llu,\"n_pages\":%llu,\"data_offset\":%llu,\"tokens\":%llu,"
               "\"layer_len\":[",
               in->n_layers, in->n_heads, in->n_kv_heads, in->head_dim,
               dtype_name(in->dtype_code), in->block_tokens,
               (double)bits_float(in->scale_bits), in->scale_bits,
               (unsigned long long)in->page_bytes, (unsigned long long)in->n_pages,
               (unsigned long long)in->data_off, (unsigned long long)total_tokens(in));
        for (uint32_t l = 0; l < in->n_layers; l++)
            printf("%s%llu", l ? "," : "", (unsigned long long)in->layer_len[l]);
        printf("]");
    }
    if (in->bad_page != UINT64_MAX)
        printf(",\"bad_page\":{\"file_index\":%llu,\"layer\":%u,\"index\":%llu}",
               (unsigned long long)in->bad_page, in->bad_layer,
               (unsigned long long)in->bad_index);
    printf("}\n");
}

int cmd_inspect(int argc, char **argv)
{
    const char *path = NULL;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return CLI_OK;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = true;
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            return cli_usage_error(CMD, "unknown option '%s'", argv[i]);
        } else if (path == NULL) {
            path = argv[i];
        } else {
            return cli_usage_error(CMD, "one FILE only ('%s' is extra)", argv[i]);
        }
    }
    if (path == NULL)
        return cli_usage_error(CMD, "a session FILE is needed");

    pkvi_io *io = NULL;
    if (pkvi_io_open(false, &io) != PKV_OK)
        return cli_fail(CMD, "cannot set up I/O: out of memory");
    pkvi_sfile_info info;
    const char *why = NULL;
    pkv_status st = pkvi_sfile_verify(io, path, &info, &why);
    pkvi_io_close(io);

    if (json)
        print_json(path, &info, st, why);
    else
        print_text(path, &info, st);
    uint64_t bad = info.bad_page, bad_index = info.bad_index;
    uint32_t bad_layer = info.bad_layer;
    pkvi_sfile_info_free(&info);
    if (st != PKV_OK && bad != UINT64_MAX)
        return cli_fail(CMD, "%s: %s: %s (page %llu of the file: layer %u, page %llu)", path,
                        verdict(st), why, (unsigned long long)bad, bad_layer,
                        (unsigned long long)bad_index);
    if (st != PKV_OK)
        return cli_fail(CMD, "%s: %s: %s", path, verdict(st), why);
    if (!json)
        printf("status      sound\n");
    return CLI_OK;
}

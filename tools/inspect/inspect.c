/*
 * inspect/inspect.c - `pagedkv inspect FILE [--json]`: print a session file's header and
 * verify every checksum and padding byte, without an engine.
 *
 * Owns: the presentation only. The reading and checking is the library's
 *   (pkv_session_file_check, the checks pkv_session_load makes), so the tool and the
 *   library can never disagree about what a sound file is. Public API only.
 * Output: the text report on stdout always ends with a status line ("status
 *   sound", or "status <verdict>: <reason>"), also for a damaged file, so a reader
 *   of stdout alone sees the verdict; the reason goes to stderr as well.
 * Exit status: 0 the file is sound; 1 it is not (or cannot be read), the reason on
 *   stderr; 2 a usage error (cli.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/json.h"
#include "common/opt.h"

static const char *const CMD = "inspect";

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

static uint32_t scale_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The report on stdout; `len` holds the layers' lengths once the header was sound. */
static void print_text(const char *path, const pkv_file_info *in, const uint64_t *len,
                       pkv_status st)
{
    char b1[32], b2[32];
    if (st == PKV_EIO && in->file_bytes == 0)   /* not opened: no size to tell */
        printf("file        %s\n", path);
    else
        printf("file        %s (%llu bytes, %s)\n", path, (unsigned long long)in->file_bytes,
               cli_bytes(in->file_bytes, b1));
    if (in->header_sound) {
        printf("format      pagedkv session file, version %u\n", in->version);
        printf("geometry    %u layers, %u heads, %u kv heads, head dim %u\n", in->n_layers,
               in->n_heads, in->n_kv_heads, in->head_dim);
        if (in->head_dim_v != in->head_dim)
            printf("v width     %u (head_dim_v)\n", in->head_dim_v);
        if (in->n_variant_layers)
            printf("variants    %u layers with a window, soft-cap or sink logits\n",
                   in->n_variant_layers);
        printf("dtype       %s\n", pkv_dtype_name(in->kv_dtype));
        printf("scale       %.9g (bits 0x%08x)\n", (double)in->scale, scale_bits(in->scale));
        printf("pages       %llu of %llu bytes, %u tokens each (%s of page data from offset "
               "%llu)\n", (unsigned long long)in->n_pages, (unsigned long long)in->page_bytes,
               in->block_tokens, cli_bytes(in->n_pages * in->page_bytes, b2),
               (unsigned long long)in->data_offset);
        printf("tokens      %llu in all; per layer:", (unsigned long long)in->tokens);
        for (uint32_t l = 0; l < in->n_layers; l++)
            printf("%s%llu", l % 16 == 0 ? "\n              " : " ",
                   (unsigned long long)len[l]);
        printf("\n");
        printf("token ids   %llu recorded (the prefix cache's record; version 3)\n",
               (unsigned long long)in->n_token_ids);
    }
    if (st == PKV_OK) {
        printf("checksums   header, page table and %llu pages verified; padding is zero\n",
               (unsigned long long)in->n_pages);
        printf("status      sound\n");
    } else if (in->bad_page != UINT64_MAX) {
        printf("status      %s: %s (page %llu of the file: layer %u, page %llu)\n",
               verdict(st), in->reason, (unsigned long long)in->bad_page, in->bad_layer,
               (unsigned long long)in->bad_index);
    } else {
        printf("status      %s: %s\n", verdict(st), in->reason);
    }
}

static void print_json(const char *path, const pkv_file_info *in, const uint64_t *len,
                       pkv_status st)
{
    json_writer w = {stdout, true, false}, *W = &w;
    json_open(W, NULL, '{');
    cli_json_envelope(W, "inspect", NULL);
    json_str(W, "file", path);
    json_bool(W, "sound", st == PKV_OK);
    json_str(W, "status", status_name(st));
    json_str(W, "reason", st == PKV_OK ? "" : in->reason);
    JSON_U64S(W, {"file_bytes", in->file_bytes});
    json_bool(W, "header_sound", in->header_sound);
    if (in->header_sound) {
        JSON_U64S(W, {"file_version", in->version}, {"layers", in->n_layers},
                  {"heads", in->n_heads}, {"kv_heads", in->n_kv_heads},
                  {"head_dim", in->head_dim});
        json_str(W, "dtype", pkv_dtype_name(in->kv_dtype));
        JSON_U64S(W, {"block_tokens", in->block_tokens});
        json_key(W, "scale");
        fprintf(stdout, "%.9g", (double)in->scale);
        JSON_U64S(W, {"scale_bits", scale_bits(in->scale)}, {"page_bytes", in->page_bytes},
                  {"n_pages", in->n_pages}, {"data_offset", in->data_offset},
                  {"tokens", in->tokens}, {"head_dim_v", in->head_dim_v},
                  {"n_variant_layers", in->n_variant_layers},
                  {"n_token_ids", in->n_token_ids});
        json_open(W, "layer_len", '[');
        for (uint32_t l = 0; l < in->n_layers; l++)
            JSON_U64S(W, {NULL, len[l]});
        json_close(W, ']');
    }
    if (in->bad_page != UINT64_MAX) {
        json_open(W, "bad_page", '{');
        JSON_U64S(W, {"file_index", in->bad_page}, {"layer", in->bad_layer},
                  {"index", in->bad_index});
        json_close(W, '}');
    }
    json_close(W, '}');
    fputc('\n', stdout);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pagedkv inspect FILE [--json]\n\n"
            "Print the header of a pagedkv session file (format version, geometry, dtype,\n"
            "block size, per-layer lengths, sizes) and verify the header checksum, the\n"
            "page table, every page's CRC-32C and the zero padding of partly filled pages.\n"
            "The format is described in docs/file-format.md. The text report ends with a\n"
            "status line, also when the file is damaged.\n\n"
            "options:\n"
            "  --json   print the figures as one JSON object on stdout\n"
            "  --help   this text\n\n"
            "exit status: 0 the file is sound, 1 it is not (reason on stderr), 2 usage error.\n"
            "PKV_NO_URING=1 reads with pread instead of io_uring.\n");
}

int cmd_inspect(int argc, char **argv)
{
    const char *path[2] = {NULL, NULL};
    bool json = false;
    int n_paths = 0;
    const cli_opt opts[] = {{.name = "json", .kind = OPT_FLAG, .dst = &json}};
    int rc = cli_parse(CMD, argc, argv, opts, 1, usage, path, 2, &n_paths);
    if (rc != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : rc;
    if (n_paths == 0)
        return cli_usage_error(CMD, "a session FILE is needed");
    if (n_paths > 1)
        return cli_usage_error(CMD, "one FILE only ('%s' is extra)", path[1]);

    /* the lengths of every layer: a first look says how many layers there are */
    pkv_file_info info;
    uint64_t few[64], *len = few;
    pkv_status st = pkv_session_file_check(path[0], &info, few, 64);
    if (info.header_sound && info.n_layers > 64) {
        if (!(len = malloc(sizeof *len * info.n_layers)))
            return cli_fail(CMD, "out of memory");
        st = pkv_session_file_check(path[0], &info, len, info.n_layers);
    }
    /* not opened: the library's reason is its own words; the OS's is more precise */
    if (st == PKV_EIO && info.file_bytes == 0) {
        int fd = open(path[0], O_RDONLY);
        if (fd < 0)
            snprintf(info.reason, sizeof info.reason, "cannot open '%s': %s", path[0],
                     strerror(errno));
        else
            close(fd);
    }
    if (json)
        print_json(path[0], &info, len, st);
    else
        print_text(path[0], &info, len, st);
    if (len != few)
        free(len);
    if (st != PKV_OK && info.bad_page != UINT64_MAX)
        return cli_fail(CMD, "%s: %s: %s (page %llu of the file: layer %u, page %llu)",
                        path[0], verdict(st), info.reason, (unsigned long long)info.bad_page,
                        info.bad_layer, (unsigned long long)info.bad_index);
    if (st != PKV_OK)
        return cli_fail(CMD, "%s: %s: %s", path[0], verdict(st), info.reason);
    return CLI_OK;
}

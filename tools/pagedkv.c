/*
 * pagedkv.c - the `pagedkv` command: dispatch to one subcommand per file.
 */
#include <stdio.h>
#include <string.h>

#include "common/cli.h"

typedef struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *what;
} command;

static const command commands[] = {
    {"generate", cmd_generate, "run a tiny Llama token by token on pagedkv (the main job)"},
    {"stress",   cmd_stress,   "drive sessions to long contexts; latency and memory vs context"},
    {"bench",    cmd_bench,    "decode throughput next to DRAM bandwidth and a naive kernel"},
    {"mem",      cmd_mem,      "KV-cache memory for a geometry: the formula and the paged figure"},
    {"inspect",  cmd_inspect,  "print a session file's header and verify its checksums"},
    {"soak",     cmd_soak,     "model-based soak: random operations under a tight budget"},
    {"quality",  cmd_quality,  "what each K/V dtype costs: KL vs an f32 cache, top-1, attention error"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: pagedkv COMMAND [OPTIONS]\n\n"
               "pagedkv %s - paged KV cache and decode attention.\n\ncommands:\n",
            pkv_version());
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-9s %s\n", commands[i].name, commands[i].what);
    fprintf(f, "\n'pagedkv COMMAND --help' describes a command's options. Every command\n"
               "takes --opt VALUE or --opt=VALUE, short options as -n5 or -n 5, and -h.\n"
               "Exit status: 0 ok, 1 a runtime failure, 2 a usage error.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return CLI_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return CLI_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("pagedkv %s\n", pkv_version());
        return CLI_OK;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(argv[1], commands[i].name) == 0)
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "pagedkv: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return CLI_USAGE;
}

/*
 * pagedkv.c - the `pagedkv` command: dispatch to one subcommand per folder, `help`,
 * `version`.
 *
 * Invariants: `pagedkv help CMD` is `pagedkv CMD --help` (the same function prints
 * both); `pagedkv version`, `-V` and `--version` print the same line. The command
 * line is kept (cli_set_command_line) before a subcommand's parser permutes it, for
 * the JSON envelope.
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
    {"quality",  cmd_quality,  "what each K/V dtype costs: KL vs an f32 cache, top-1, "
                               "attention error"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: pagedkv COMMAND [OPTIONS]\n\n"
               "pagedkv %s - paged KV cache and decode attention.\n\ncommands:\n",
            pkv_version());
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-9s %s\n", commands[i].name, commands[i].what);
    fprintf(f, "  help      'pagedkv help COMMAND' = 'pagedkv COMMAND --help'\n"
               "  version   the version (also -V, --version)\n"
               "\n'pagedkv COMMAND --help' describes a command's options. Every command\n"
               "takes --opt VALUE or --opt=VALUE, short options as -n5 or -n 5, and -h.\n"
               "--json writes one JSON object whose first keys are the same for every\n"
               "command: tool, command, version, isa, host, cpu, online_cpus, argv.\n"
               "Exit status: 0 ok, 1 a runtime failure, 2 a usage error. man pagedkv has\n"
               "every command's help in one page.\n");
}

static const command *find(const char *name)
{
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(name, commands[i].name) == 0)
            return &commands[i];
    return NULL;
}

int main(int argc, char **argv)
{
    cli_set_command_line(argc, argv);
    if (argc < 2) {
        usage(stderr);
        return CLI_USAGE;
    }
    const char *w = argv[1];
    if (strcmp(w, "--help") == 0 || strcmp(w, "-h") == 0 ||
        (strcmp(w, "help") == 0 && argc == 2)) {
        usage(stdout);
        return CLI_OK;
    }
    if (strcmp(w, "--version") == 0 || strcmp(w, "-V") == 0 || strcmp(w, "version") == 0) {
        if (argc > 2) {
            fprintf(stderr, "pagedkv: %s takes no arguments ('%s' is extra)\n", w, argv[2]);
            return CLI_USAGE;
        }
        printf("pagedkv %s\n", pkv_version());
        return CLI_OK;
    }
    if (strcmp(w, "help") == 0) {
        const command *c = find(argv[2]);
        if (!c || argc > 3) {
            fprintf(stderr, c ? "pagedkv help: one command at a time ('%s' is extra)\n"
                              : "pagedkv help: unknown command '%s'\n",
                    c ? argv[3] : argv[2]);
            usage(stderr);
            return CLI_USAGE;
        }
        char *help_argv[] = {argv[2], "--help", NULL};
        return c->fn(2, help_argv);
    }
    const command *c = find(w);
    if (c)
        return c->fn(argc - 1, argv + 1);
    fprintf(stderr, "pagedkv: unknown command '%s'\n", w);
    usage(stderr);
    return CLI_USAGE;
}

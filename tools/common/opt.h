/*
 * opt.h - the one option parser of the `pagedkv` command, with getopt_long's
 * conventions, driven by a table per subcommand.
 *
 * Owns: the command line of every subcommand: `--name value`, `--name=value`, short
 * options with the value attached or apart (`-n5`, `-n 5`), flags, `--` ending the
 * options, operands (non-option arguments) in order, unique prefixes of long names
 * (getopt_long's rule), the built-in `-h`/`--help`, and the wording of every usage
 * error: "pagedkv CMD: --name: 'VALUE' is not WHAT", then a hint to run --help,
 * exit status CLI_USAGE (cli.h).
 * Does not own: what the options mean, checks that involve the values of several
 * options (each command does those after cli_parse, in the words of cli_needs_error
 * where one option needs another), or the usage text (the command's).
 *
 * Invariants
 *   - A value is stored only after it passed its check, so a failed parse leaves the
 *     destination of the offending option as the command initialised it.
 *   - For integers the message states the range really accepted: [lo, hi], and the
 *     option's `note` (e.g. "the engine's limit") when the range has a reason.
 *   - An option given without the option its `needs` names is refused after the
 *     scan, in cli_needs_error's words ("--A needs --B: why"), before any work; an
 *     option with `refused` set is known but refused in this mode, in its words.
 */
#ifndef PKV_TOOLS_OPT_H
#define PKV_TOOLS_OPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* cli_parse's result after --help was printed: the command exits 0 at once. */
#define CLI_HELP (-1)

typedef enum {
    OPT_FLAG,     /* no value; *(bool *)dst = true */
    OPT_CLEAR,    /* no value; *(bool *)dst = false (a --no-X flag) */
    OPT_U32,      /* integer in [lo, hi] (k/m/g suffixes, cli_parse_u64); uint32_t */
    OPT_U64,      /* the same into a uint64_t */
    OPT_DOUBLE,   /* finite number in [dlo, dhi]; double */
    OPT_STRING,   /* *(const char **)dst = the value (argv's storage) */
    OPT_DTYPE,    /* f32, f16, bf16, q8 or q4 (cli_parse_dtype); pkv_dtype */
    OPT_CALL      /* call(value, dst) decides; `what` describes the valid values */
} opt_kind;

typedef struct {
    const char *name;        /* long name without "--"; NULL: none */
    char short_name;         /* 'n' for -n; 0: none */
    opt_kind kind;
    void *dst;
    uint64_t lo, hi;         /* OPT_U32, OPT_U64: accepted range, inclusive */
    double dlo, dhi;         /* OPT_DOUBLE: accepted range, inclusive */
    const char *note;        /* why the range ends there, shown in the message */
    bool *seen;              /* set to true when the option is given; may be NULL */
    bool (*call)(const char *value, void *dst);   /* OPT_CALL */
    const char *what;        /* OPT_CALL: "a comma-separated list of ..." */
    const char *needs;       /* long name of an option that must be given too; NULL */
    const char *why;         /* with needs: why it needs it, for the message */
    const char *refused;     /* known here but refused: why ("... with --mpi") */
} cli_opt;

/* Parse argv[1..argc) of subcommand `cmd` against opts[0..n). Operands go to
 * operands[0..max_operands) in order; *n_operands (may be NULL when max_operands is
 * 0) receives how many were given, which may exceed max_operands (the command words
 * that error); with max_operands == 0 any operand is a usage error here.
 * `-h`/`--help` prints usage(stdout) and returns CLI_HELP. Returns CLI_OK, CLI_HELP or
 * CLI_USAGE (after the message on stderr). argv may be permuted (getopt_long). */
int cli_parse(const char *cmd, int argc, char **argv, const cli_opt *opts, size_t n,
              void (*usage)(FILE *f), const char **operands, int max_operands,
              int *n_operands);

/* The one wording of "this option needs that one", for every command and every case
 * (a missing option, or one whose value does not give what the first needs):
 * "pagedkv CMD: OPT needs NEEDED: WHY" and the --help hint on stderr; CLI_USAGE.
 * opt and needed as the user writes them ("--sinks", "--window"); why may be NULL. */
int cli_needs_error(const char *cmd, const char *opt, const char *needed, const char *why);

#endif

/* opt.c - see opt.h. getopt_long does the scanning; this file builds its tables from
 * a cli_opt table and checks and stores each value. */
#include "common/opt.h"

#include <getopt.h>
#include <inttypes.h>
#include <string.h>

#include "common/cli.h"

/* Options of one subcommand at most (the largest, stress, has about 30). */
#define MAX_OPTS 64
/* getopt_long's `val` of long option i: above every char, so never a short option. */
#define LONG_VAL(i) (256 + (int)(i))

/* The option's name as the user wrote it: "--name", or "-x" (as_short, or when it has
 * no long name). */
static const char *shown(const cli_opt *o, bool as_short, char *buf, size_t cap)
{
    if (o->name && !(as_short && o->short_name))
        snprintf(buf, cap, "--%s", o->name);
    else
        snprintf(buf, cap, "-%c", o->short_name);
    return buf;
}

static bool takes_value(const cli_opt *o)
{
    return o->kind != OPT_FLAG && o->kind != OPT_CLEAR;
}

/* Check v for option o (given by its short name: as_short) and store it; CLI_OK or
 * CLI_USAGE after the message. */
static int store(const char *cmd, const cli_opt *o, bool as_short, const char *v)
{
    char nm[64];
    shown(o, as_short, nm, sizeof nm);
    const char *note = o->note ? o->note : "";
    const char *open = o->note ? " (" : "", *close = o->note ? ")" : "";
    switch (o->kind) {
    case OPT_FLAG:
    case OPT_CLEAR:
        *(bool *)o->dst = o->kind == OPT_FLAG;
        break;
    case OPT_U32:
    case OPT_U64: {
        uint64_t x;
        if (!cli_parse_u64(v, &x) || x < o->lo || x > o->hi)
            return cli_usage_error(cmd, "%s: '%s' is not an integer in %" PRIu64 "..%" PRIu64
                                        "%s%s%s", nm, v, o->lo, o->hi, open, note, close);
        if (o->kind == OPT_U32)
            *(uint32_t *)o->dst = (uint32_t)x;
        else
            *(uint64_t *)o->dst = x;
        break;
    }
    case OPT_DOUBLE: {
        double x;
        if (!cli_parse_double(v, &x) || !(x >= o->dlo) || !(x <= o->dhi))
            return cli_usage_error(cmd, "%s: '%s' is not a number in %g..%g%s%s%s", nm, v,
                                   o->dlo, o->dhi, open, note, close);
        *(double *)o->dst = x;
        break;
    }
    case OPT_STRING:
        *(const char **)o->dst = v;
        break;
    case OPT_DTYPE:
        if (!cli_parse_dtype(v, (pkv_dtype *)o->dst))
            return cli_usage_error(cmd, "%s: '%s' is not f32, f16, bf16, q8 or q4", nm, v);
        break;
    case OPT_CALL:
        if (!o->call(v, o->dst))
            return cli_usage_error(cmd, "%s: '%s' is not %s", nm, v,
                                   o->what ? o->what : "a valid value");
        break;
    }
    if (o->seen)
        *o->seen = true;
    return CLI_OK;
}

/* The option getopt_long complained about, from what it left in optopt and argv. */
static int bad_option(const char *cmd, int c, char **argv, const cli_opt *opts, size_t n)
{
    char nm[64];
    const int at = optopt;
    const char *arg = optind > 0 ? argv[optind - 1] : "";
    const cli_opt *o = NULL;
    const bool as_short = at > 0 && at < 256;
    if (at >= LONG_VAL(0) && at < LONG_VAL(n))
        o = &opts[at - LONG_VAL(0)];
    for (size_t i = 0; !o && as_short && i < n; i++)
        if (opts[i].short_name == at)
            o = &opts[i];
    if (c == ':' && o)
        return cli_usage_error(cmd, "option '%s' needs a value",
                               shown(o, as_short, nm, sizeof nm));
    if (c == ':')
        return cli_usage_error(cmd, "option '%s' needs a value", arg);
    if (o && !takes_value(o))   /* --flag=value */
        return cli_usage_error(cmd, "option '%s' takes no value",
                               shown(o, false, nm, sizeof nm));
    if (at == 'h' && strncmp(arg, "--", 2) == 0)   /* --help=value */
        return cli_usage_error(cmd, "option '--help' takes no value");
    if (at > 0 && at < 256)
        return cli_usage_error(cmd, "unknown option '-%c'", at);
    /* a long option: unknown, or a prefix of several names */
    char name[128];
    snprintf(name, sizeof name, "%s", arg);
    char *eq = strchr(name, '=');
    if (eq)
        *eq = '\0';
    size_t len = strlen(name) > 2 ? strlen(name) - 2 : 0, matches = 0;
    for (size_t i = 0; len && i < n; i++)
        matches += opts[i].name && strncmp(opts[i].name, name + 2, len) == 0;
    if (matches > 1)
        return cli_usage_error(cmd, "option '%s' is ambiguous (a prefix of %zu options)",
                               name, matches);
    return cli_usage_error(cmd, "unknown option '%s'", name);
}

int cli_needs_error(const char *cmd, const char *opt, const char *needed, const char *why)
{
    return cli_usage_error(cmd, "%s needs %s%s%s", opt, needed, why ? ": " : "",
                           why ? why : "");
}

int cli_parse(const char *cmd, int argc, char **argv, const cli_opt *opts, size_t n,
              void (*usage)(FILE *f), const char **operands, int max_operands,
              int *n_operands)
{
    struct option lo[MAX_OPTS + 2];
    char sh[3 * MAX_OPTS + 4];
    size_t nl = 0, ns = 0;
    if (n > MAX_OPTS)
        return cli_fail(cmd, "internal error: more than %d options", MAX_OPTS);
    sh[ns++] = ':';   /* first: a missing value returns ':', not '?' */
    sh[ns++] = 'h';
    for (size_t i = 0; i < n; i++) {
        if (opts[i].name)
            lo[nl++] = (struct option){opts[i].name,
                                       takes_value(&opts[i]) ? required_argument : no_argument,
                                       NULL, LONG_VAL(i)};
        if (opts[i].short_name) {
            sh[ns++] = opts[i].short_name;
            if (takes_value(&opts[i]))
                sh[ns++] = ':';
        }
    }
    lo[nl++] = (struct option){"help", no_argument, NULL, 'h'};
    lo[nl] = (struct option){NULL, 0, NULL, 0};
    sh[ns] = '\0';

    if (n_operands)
        *n_operands = 0;
    int count = 0;
    bool given[MAX_OPTS] = {false};
    optind = 0;   /* glibc: start afresh (a process may parse twice, e.g. bench) */
    opterr = 0;   /* the messages are ours */
    for (;;) {
        const int c = getopt_long(argc, argv, sh, lo, NULL);
        if (c == -1)
            break;
        if (c == 'h') {
            usage(stdout);
            return CLI_HELP;
        }
        if (c == '?' || c == ':')
            return bad_option(cmd, c, argv, opts, n);
        const cli_opt *o = NULL;
        if (c >= LONG_VAL(0) && c < LONG_VAL(n))
            o = &opts[c - LONG_VAL(0)];
        for (size_t i = 0; !o && i < n; i++)
            if (opts[i].short_name == c)
                o = &opts[i];
        if (!o)
            return cli_fail(cmd, "internal error: getopt_long returned %d", c);
        if (o->refused) {
            char nm[64];
            return cli_usage_error(cmd, "%s %s", shown(o, c < 256, nm, sizeof nm),
                                   o->refused);
        }
        if (store(cmd, o, c < 256, takes_value(o) ? optarg : NULL) != CLI_OK)
            return CLI_USAGE;
        given[o - opts] = true;
    }
    for (size_t i = 0; i < n; i++) {
        if (!given[i] || !opts[i].needs)
            continue;
        bool have = false;
        for (size_t j = 0; j < n && !have; j++)
            have = given[j] && opts[j].name && strcmp(opts[j].name, opts[i].needs) == 0;
        if (!have) {
            char a[64], b[64];
            snprintf(b, sizeof b, "--%s", opts[i].needs);
            return cli_needs_error(cmd, shown(&opts[i], false, a, sizeof a), b,
                                   opts[i].why);
        }
    }
    for (int i = optind; i < argc; i++) {
        if (max_operands == 0)
            return cli_usage_error(cmd, "unexpected argument '%s'", argv[i]);
        if (count < max_operands)
            operands[count] = argv[i];
        count++;
    }
    if (n_operands)
        *n_operands = count;
    return CLI_OK;
}

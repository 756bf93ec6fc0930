/* PLACEHOLDER: replaced by the owner of `pagedkv bench`. */
#include "cli.h"
int cmd_bench(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return cli_fail("bench", "not built yet");
}

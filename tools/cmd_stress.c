/* PLACEHOLDER: replaced by the owner of `pagedkv stress`. */
#include "cli.h"
int cmd_stress(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return cli_fail("stress", "not built yet");
}

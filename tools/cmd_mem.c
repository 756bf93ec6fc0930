/* PLACEHOLDER: replaced by the owner of `pagedkv mem`. */
#include "cli.h"
int cmd_mem(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return cli_fail("mem", "not built yet");
}

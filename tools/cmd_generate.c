/* PLACEHOLDER: replaced by the owner of `pagedkv generate`. */
#include "cli.h"
int cmd_generate(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return cli_fail("generate", "not built yet");
}

/* The public header compiles alone under -std=c11 -pedantic -Werror. */
#include "pagedkv.h"
int main(void)
{
    pkv_config c = {0};
    pkv_memory m = {0};
    pkv_stats s = {0};
    pkv_status st = PKV_OK;
    (void)c; (void)m; (void)s;
    return (int)st;
}

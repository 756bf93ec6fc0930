/* PLACEHOLDER dispatch (owner: kernels): scalar only until the SIMD kernels land. */
#include "internal.h"
#include <string.h>
bool pkvi_isa_supported(const char *isa)
{
    return isa && strcmp(isa, "scalar") == 0;
}
pkv_status pkvi_kernels_select(const pkvi_kernels **out)
{
    *out = &pkvi_kernels_scalar;
    return PKV_OK;
}

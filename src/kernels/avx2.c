/* PLACEHOLDER: AVX2 kernels not built yet. */
#include "internal.h"
const pkvi_kernels pkvi_kernels_avx2 = {"avx2", NULL, NULL};

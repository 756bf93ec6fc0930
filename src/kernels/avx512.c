/* PLACEHOLDER: AVX-512 kernels not built yet. */
#include "internal.h"
const pkvi_kernels pkvi_kernels_avx512 = {"avx512", NULL, NULL};

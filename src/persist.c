/* PLACEHOLDER */
#include "internal.h"
typedef int pkvi_placeholder_persist;

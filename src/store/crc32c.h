/*
 * crc32c.h - CRC-32C (Castagnoli), the checksum of the session file (crc32c.c):
 * pkvi_crc32c for every caller, and its two implementations for the tests that
 * compare them.
 *
 * Owns: nothing at run time; the slicing tables are constants generated at build time
 * (gen_crc32c.c). Pure functions, no lock.
 */
#ifndef PAGEDKV_CRC32C_H
#define PAGEDKV_CRC32C_H

#include "base/util.h"

/* CRC32C of buf, continuing from crc (0 to start). */
PKVI_HIDDEN uint32_t pkvi_crc32c(uint32_t crc, const void *buf, size_t len);

/* The two implementations behind pkvi_crc32c, for tests that compare them.
 * pkvi_crc32c_hw may only be called when pkvi_crc32c_hw_available(). */
PKVI_HIDDEN uint32_t pkvi_crc32c_sw(uint32_t crc, const void *buf, size_t len);
PKVI_HIDDEN uint32_t pkvi_crc32c_hw(uint32_t crc, const void *buf, size_t len);
PKVI_HIDDEN bool pkvi_crc32c_hw_available(void);

#endif /* PAGEDKV_CRC32C_H */

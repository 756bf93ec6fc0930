/*
 * crc32c.c - CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of
 * session files (docs/file-format.md).
 *
 * Owns: pkvi_crc32c and its two implementations: slicing-by-8 over constant tables
 * (any CPU) and the SSE4.2 crc32 instruction (x86-64, chosen at run time with cpuid
 * through __builtin_cpu_supports; no state of ours is kept).
 * Does not own: what is checksummed, or where the checksum is stored (persist/).
 *
 * Convention: pkvi_crc32c(0, buf, n) is the CRC-32C of buf (init and final XOR with
 * 0xFFFFFFFF are inside), and it chains: crc(crc(0, a), b) == crc(0, a || b).
 * Check value: crc32c("123456789") == 0xE3069283 (tests/test_io.c).
 *
 * The tables are computed from the polynomial at build time (src/store/gen_crc32c.c, run by
 * meson: table 0 is the bytewise CRC of each byte value; table k[i] =
 * (k-1)[i] >> 8 ^ 0[(k-1)[i] & 0xff]), never pasted in.
 * Speed: the crc32 instruction path and slicing-by-8 are both above the disk and
 * page-cache rates persistence runs at (docs/performance.md, decision table: crc32c),
 * so there is no 3-way interleaved variant.
 */
#include "store/crc32c.h"

#include <string.h>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

/* crc_table[8][256]: slicing-by-8, generated from the polynomial by gen_crc32c.c */
#include "crc32c_table.h"

uint32_t pkvi_crc32c_sw(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    crc = ~crc;
    /* Byte at a time up to 8-byte alignment, so the wide loop reads aligned words. */
    while (len > 0 && ((uintptr_t)p & 7) != 0) {
        crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
        len--;
    }
    while (len >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        lo = __builtin_bswap32(lo);
        hi = __builtin_bswap32(hi);
#endif
        lo ^= crc;
        crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
              crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^
              crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
              crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len > 0) {
        crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
        len--;
    }
    return ~crc;
}

#if defined(__x86_64__)

__attribute__((target("sse4.2")))
uint32_t pkvi_crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    uint64_t c = ~crc;
    while (len > 0 && ((uintptr_t)p & 7) != 0) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        len -= 8;
    }
    while (len > 0) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    return ~(uint32_t)c;
}

bool pkvi_crc32c_hw_available(void)
{
    return __builtin_cpu_supports("sse4.2");
}

#else

uint32_t pkvi_crc32c_hw(uint32_t crc, const void *buf, size_t len)
{
    return pkvi_crc32c_sw(crc, buf, len);
}

bool pkvi_crc32c_hw_available(void)
{
    return false;
}

#endif

uint32_t pkvi_crc32c(uint32_t crc, const void *buf, size_t len)
{
    if (len == 0)
        return crc;
    if (pkvi_crc32c_hw_available())
        return pkvi_crc32c_hw(crc, buf, len);
    return pkvi_crc32c_sw(crc, buf, len);
}

/*
 * kernels/dispatch.c - which kernel table an engine uses.
 *
 * Owns: pkvi_kernels_select, pkvi_isa_supported, pkvi_kernels_force_reason and
 * pkvi_prefetch_l2. Does not own the kernels (ref.c, avx2.c, avx2vnni.c, avx512.c,
 * avx512vnni.c, neon.c, neondot.c) nor where the choice is stored (engine.c keeps it).
 *
 * Invariants:
 *   - An ISA is usable only if the CPU reports every instruction set its file is
 *     compiled for (cpuid) AND the OS saves the registers it uses (XCR0 via XGETBV,
 *     after checking OSXSAVE): a CPU with AVX-512 under an OS or hypervisor that does
 *     not enable ZMM state must not run the AVX-512 kernel. On aarch64 the kernel's
 *     AT_HWCAP says both (asimd; asimddp for the dot-product table).
 *   - Only the tables this build contains (meson's `kernels` option: PKV_KERNEL_<TABLE>
 *     in pkv_config.h) are named, supported or selected; the scalar one always is.
 *   - No global state: the CPU is asked on every call (once per engine creation).
 *     PKV_FORCE_ISA and PKV_PREFETCH are read here, at engine creation, never later.
 *   - A build with PKV_AVX512_EMULATED (meson's avx512_emulation, tests only) has
 *     AVX-512 tables (avx512, avx512vnni) that run on AVX2 through SIMDe: usable on
 *     AVX2 hosts, and chosen only through PKV_FORCE_ISA.
 */
#include "kernels/kernels.h"
#include "base/dtype.h"

#include <stdlib.h>
#include <string.h>

/* cpuid is asked only in an x86-64 build (32-bit x86 is refused at configure time),
 * getauxval only in an aarch64 one; a table is referenced only where meson compiled its
 * file. Testing the compiler's macros instead would name tables a build does not
 * contain. */
#if PKV_HAVE_X86_KERNELS
#if !defined(__x86_64__)
#error "PKV_HAVE_X86_KERNELS is set for a target that is not x86-64"
#endif
#include <cpuid.h>
#endif
#if PKV_HAVE_ARM_KERNELS
#if !defined(__aarch64__)
#error "PKV_HAVE_ARM_KERNELS is set for a target that is not aarch64"
#endif
#include <sys/auxv.h>
#endif

#define PKVI_X86 PKV_HAVE_X86_KERNELS
#define PKVI_ARM PKV_HAVE_ARM_KERNELS

#if PKVI_X86
/* XCR0 (which register states the OS saves). Only valid when cpuid says OSXSAVE. */
static uint64_t xcr0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* cpuid leaf 1 ECX and leaf 7.0 EBX and ECX; false when a leaf is missing. */
static bool cpu_leaves(uint32_t *ecx1, uint32_t *ebx7, uint32_t *ecx7)
{
    uint32_t a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7)
        return false;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return false;
    *ecx1 = c;
    __cpuid_count(7, 0, a, b, c, d);
    *ebx7 = b;
    *ecx7 = c;
    return true;
}

/* AVX-VNNI (vpdpbusd on ymm, VEX-encoded): cpuid leaf 7 subleaf 1, EAX bit 4. Apart from
 * the levels below: Zen 4 has AVX512-VNNI without it, Alder Lake it without AVX-512. */
static bool cpu_avx_vnni(void)
{
    uint32_t a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7)
        return false;
    __cpuid_count(7, 0, a, b, c, d);
    if (a < 1) /* the highest subleaf of leaf 7 */
        return false;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 4) & 1u;
}

/* Each level includes the ones below it. */
enum { CPU_AVX2 = 1, CPU_AVX512 = 2, CPU_AVX512VNNI = 3 };

static unsigned cpu_level(void)
{
    uint32_t ecx1, ebx7, ecx7;
    if (!cpu_leaves(&ecx1, &ebx7, &ecx7))
        return 0;
    const uint32_t fma = 1u << 12, osxsave = 1u << 27, avx = 1u << 28, f16c = 1u << 29;
    if ((ecx1 & (fma | osxsave | avx | f16c)) != (fma | osxsave | avx | f16c))
        return 0;
    const uint64_t x = xcr0();
    if ((x & 0x6u) != 0x6u) /* XMM and YMM state */
        return 0;
    unsigned level = 0;
    if (ebx7 & (1u << 5)) /* AVX2 */
        level = CPU_AVX2;
    const uint32_t f = 1u << 16, dq = 1u << 17, bw = 1u << 30, vl = 1u << 31;
    if (level == CPU_AVX2 && (ebx7 & (f | dq | bw | vl)) == (f | dq | bw | vl) &&
        (x & 0xe0u) == 0xe0u) /* opmask, upper ZMM0-15, ZMM16-31 */
        level = CPU_AVX512;
    if (level == CPU_AVX512 && (ecx7 & (1u << 11))) /* AVX512_VNNI (ZMM state checked) */
        level = CPU_AVX512VNNI;
    return level;
}
#endif

#if PKVI_ARM
/* AT_HWCAP bits of the aarch64 Linux ABI (asm/hwcap.h): ASIMD (Advanced SIMD) and
 * ASIMDDP (SDOT/UDOT). Written out: the bits are ABI, and an older libc's headers lack
 * the names. */
enum { ARM_HWCAP_ASIMD = 1u << 1, ARM_HWCAP_ASIMDDP = 1u << 20 };

static bool arm_has(unsigned long bits)
{
    return (getauxval(AT_HWCAP) & bits) == bits;
}
#endif

#if PKVI_X86
/* AMD family 19h with AVX-512: Zen 4 (Zen 3, the same family, has no AVX-512). Zen 5
 * (family 1Ah) keeps T0 (docs/performance.md, decision table: PKV_PREFETCH). */
static bool cpu_zen4(void)
{
    uint32_t a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d))
        return false;
    /* "AuthenticAMD" in EBX, EDX, ECX */
    const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d))
        return false;
    const uint32_t family = ((a >> 8) & 0xfu) + ((a >> 20) & 0xffu);
    return family == 0x19u && cpu_level() >= CPU_AVX512;
}
#endif

pkv_status pkvi_prefetch_l2(uint32_t *out)
{
    const char *force = getenv("PKV_PREFETCH");
    if (force && *force) {
        if (strcmp(force, "l1") != 0 && strcmp(force, "l2") != 0)
            return PKV_EINVAL;
        *out = force[1] == '2';
        return PKV_OK;
    }
#if PKVI_X86
    *out = cpu_zen4();
#else
    *out = 0;
#endif
    return PKV_OK;
}

/* Every table's name, built here or not (pkvi_kernels_force_reason tells them apart). */
static const char *const table_names[] = {"scalar",     "avx2", "avx2vnni",    "avx512",
                                          "avx512vnni", "neon", "neon_dotprod"};

const pkvi_kernels *pkvi_kernels_named(const char *isa)
{
    if (!isa)
        return NULL;
    if (strcmp(isa, "scalar") == 0)
        return &pkvi_kernels_scalar;
#if PKV_KERNEL_AVX2
    if (strcmp(isa, "avx2") == 0)
        return &pkvi_kernels_avx2;
#endif
#if PKV_KERNEL_AVX2VNNI
    if (strcmp(isa, "avx2vnni") == 0)
        return &pkvi_kernels_avx2vnni;
#endif
#if PKV_KERNEL_AVX512
    if (strcmp(isa, "avx512") == 0)
        return &pkvi_kernels_avx512;
#endif
#if PKV_KERNEL_AVX512VNNI
    if (strcmp(isa, "avx512vnni") == 0)
        return &pkvi_kernels_avx512vnni;
#endif
#if PKV_KERNEL_NEON
    if (strcmp(isa, "neon") == 0)
        return &pkvi_kernels_neon;
#endif
#if PKV_KERNEL_NEON_DOTPROD
    if (strcmp(isa, "neon_dotprod") == 0)
        return &pkvi_kernels_neon_dotprod;
#endif
    return NULL;
}

/* Whether the host (CPU and OS) can run the table named isa, built or not. */
static bool host_runs(const char *isa)
{
    if (strcmp(isa, "scalar") == 0)
        return true;
#if PKVI_X86
    const unsigned level = cpu_level();
    if (strcmp(isa, "avx2") == 0)
        return level >= CPU_AVX2;
    if (strcmp(isa, "avx2vnni") == 0)
        return level >= CPU_AVX2 && cpu_avx_vnni();
    /* a test build's emulated kernels need AVX2 only */
    if (strcmp(isa, "avx512") == 0)
        return level >= (PKV_AVX512_EMULATED ? CPU_AVX2 : CPU_AVX512);
    if (strcmp(isa, "avx512vnni") == 0)
        return level >= (PKV_AVX512_EMULATED ? CPU_AVX2 : CPU_AVX512VNNI);
#endif
#if PKVI_ARM
    if (strcmp(isa, "neon") == 0)
        return arm_has(ARM_HWCAP_ASIMD);
    if (strcmp(isa, "neon_dotprod") == 0)
        return arm_has(ARM_HWCAP_ASIMD | ARM_HWCAP_ASIMDDP);
#endif
    return false;
}

bool pkvi_isa_supported(const char *isa)
{
    return pkvi_kernels_named(isa) != NULL && host_runs(isa);
}

const char *pkvi_kernels_force_reason(const char *isa)
{
    if (!isa || !*isa || pkvi_isa_supported(isa))
        return NULL;
    bool known = false;
    for (size_t i = 0; i < sizeof table_names / sizeof table_names[0]; i++)
        known = known || strcmp(isa, table_names[i]) == 0;
    if (!known)
        return "not a kernel table (scalar, avx2, avx2vnni, avx512, avx512vnni, neon, "
               "neon_dotprod)";
    const bool arm_table = strncmp(isa, "neon", 4) == 0;
    if (!pkvi_kernels_named(isa) && arm_table && !PKVI_ARM)
        return "this build does not contain that table (it was not built: an aarch64 "
               "table, and this is not an aarch64 build)";
    if (!pkvi_kernels_named(isa) && !arm_table && strcmp(isa, "scalar") != 0 && !PKVI_X86)
        return "this build does not contain that table (it was not built: an x86-64 "
               "table, and this is not an x86-64 build)";
    if (!pkvi_kernels_named(isa))
        return "this build does not contain that table (it was not built: meson -Dkernels)";
    return "this CPU (and OS) cannot run it";
}

const pkvi_kernels *pkvi_kernels_for_dtype(const pkvi_kernels *k, pkv_dtype dt)
{
    /* Every table reads every storage type (the block types since avx512.c gained
     * their loads); kept as the one place a table without some dtype would say so. */
    (void)dt;
    return k;
}

pkv_status pkvi_kernels_check_force(const char **name)
{
    const char *force = getenv("PKV_FORCE_ISA");
    *name = force;
    return force && *force && !pkvi_isa_supported(force) ? PKV_EINVAL : PKV_OK;
}

pkv_status pkvi_kernels_select(const pkvi_kernels **out)
{
    if (!out)
        return PKV_EINVAL;
    *out = NULL;
    const char *force = getenv("PKV_FORCE_ISA");
    if (force && *force) {
        if (!pkvi_isa_supported(force))
            return PKV_EINVAL; /* unknown name, or an ISA this host cannot run */
        *out = pkvi_kernels_named(force);
        return PKV_OK;
    }
    /* An emulated AVX-512 kernel (a test build) runs only where PKV_FORCE_ISA asks. */
    static const char *const best_first[] = {"avx512vnni", "avx512",       "avx2vnni",
                                             "avx2",       "neon_dotprod", "neon"};
    for (size_t i = PKV_AVX512_EMULATED ? 2 : 0; i < sizeof best_first / sizeof best_first[0];
         i++)
        if (pkvi_isa_supported(best_first[i])) {
            *out = pkvi_kernels_named(best_first[i]);
            return PKV_OK;
        }
    *out = &pkvi_kernels_scalar;
    return PKV_OK;
}

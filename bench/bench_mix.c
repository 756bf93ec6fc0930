/*
 * bench_mix.c - what the AVX2 decode's instruction mixes can reach on the host it runs
 * on, with every operand in L1: a benchmark (built, never run as a test; HACKING.md),
 * for the roofline of an AVX2 core (docs/performance.md, "What bounds decode").
 *   bench_mix
 * Times, per token of one KV group of a llama3-8b layer (4 query heads, d 128), loops
 * with the instruction mix of avx2.c's inner loops - QK: 4 q vectors and 2 K rows per
 * step, 8 FMAs; PV: 2 V vectors and 4 broadcast weights per step, 8 FMAs - for f32,
 * f16 (vcvtph2ps) and Q8 (vpmovsxbd + vcvtdq2ps) operands, next to 12 independent FMA
 * chains in registers (bench's "peak FMA"). Prints cycles per token (at the clock
 * measured by a chain of dependent integer adds) and FMAs per cycle. No library code:
 * the loops are written here, so the figures are the host's, not the kernel's.
 * Exit 77 on a host without AVX2, FMA and F16C.
 */
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c"), noinline))
#define TGI static inline __attribute__((target("avx2,fma,f16c"), always_inline))

/* Thread CPU time: a run that other programs preempt is not charged for their turns. */
static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static _Alignas(64) float q[4 * 128], w[4 * 16];
static _Alignas(64) uint16_t kh[2 * 128];
static _Alignas(64) int8_t k8[2 * 128];
static _Alignas(64) float kf[2 * 128];

/* 8 dependent adds per iteration: one cycle each */
static double clock_ghz(void)
{
    long x = 1;
    const long n = 200000000;
    const double t = now();
    for (long i = 0; i < n; i++)
        __asm__ volatile("add %0,%0\n\tadd %0,%0\n\tadd %0,%0\n\tadd %0,%0\n\t"
                         "add %0,%0\n\tadd %0,%0\n\tadd %0,%0\n\tadd %0,%0" : "+r"(x));
    return 8.0 * (double)n / (now() - t) / 1e9;
}

typedef enum { F32, F16, Q8 } op_t;

TGI __m256 row8(const op_t o, int t, int c)
{
    if (o == F32)
        return _mm256_load_ps(kf + t * 128 + c);
    if (o == F16)
        return _mm256_cvtph_ps(_mm_load_si128((const void *)(kh + t * 128 + c)));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(k8 + t * 128 + c))));
}

TGI void zero8(__m256 a[8])
{
    for (int i = 0; i < 8; i++)
        a[i] = _mm256_setzero_ps();
}

/* the accumulators' sum, so no loop's work is dead */
TGI float sum8(const __m256 a[8])
{
    __m256 s = a[0];
    for (int i = 1; i < 8; i++)
        s = _mm256_add_ps(s, a[i]);
    return _mm256_cvtss_f32(s);
}

/* QK: per rep 2 tokens x 4 heads x 128 values (128 FMAs) */
TGI float qk(const op_t o, long reps)
{
    __m256 a[8];
    zero8(a);
    for (long r = 0; r < reps; r++) {
        for (int c = 0; c < 128; c += 8) {
            __m256 qv[4];
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++)
                qv[h] = _mm256_load_ps(q + h * 128 + c);
#pragma GCC unroll 2
            for (int t = 0; t < 2; t++) {
                const __m256 kv = row8(o, t, c);
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++)
                    a[h * 2 + t] = _mm256_fmadd_ps(qv[h], kv, a[h * 2 + t]);
            }
        }
        __asm__ volatile("" ::"r"(r));
    }
    return sum8(a);
}

/* PV: per rep 1 token x 4 heads x 128 values (64 FMAs), 16 values per step */
TGI float pv(const op_t o, long reps)
{
    __m256 a[8];
    zero8(a);
    for (long r = 0; r < reps; r++) {
        for (int c = 0; c < 128; c += 16) {
            const __m256 v0 = row8(o, 0, c), v1 = row8(o, 0, c + 8);
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) {
                const __m256 wb = _mm256_broadcast_ss(w + h * 16 + (c & 15));
                a[2 * h] = _mm256_fmadd_ps(wb, v0, a[2 * h]);
                a[2 * h + 1] = _mm256_fmadd_ps(wb, v1, a[2 * h + 1]);
            }
        }
        __asm__ volatile("" ::"r"(r));
    }
    return sum8(a);
}

/* 12 independent chains, registers only: per rep 12 FMAs, written as one asm block so
 * that gcc and clang run the same instructions (clang folds an intrinsics version). */
TGT static float chains(long reps)
{
    __m256 a0 = _mm256_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
    const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    for (long r = 0; r < reps; r++)
        __asm__ volatile("vfmadd213ps %[c], %[b], %[a0]\n\t"
                         "vfmadd213ps %[c], %[b], %[a1]\n\t"
                         "vfmadd213ps %[c], %[b], %[a2]\n\t"
                         "vfmadd213ps %[c], %[b], %[a3]\n\t"
                         "vfmadd213ps %[c], %[b], %[a4]\n\t"
                         "vfmadd213ps %[c], %[b], %[a5]\n\t"
                         "vfmadd213ps %[c], %[b], %[a6]\n\t"
                         "vfmadd213ps %[c], %[b], %[a7]\n\t"
                         "vfmadd213ps %[c], %[b], %[a8]\n\t"
                         "vfmadd213ps %[c], %[b], %[a9]\n\t"
                         "vfmadd213ps %[c], %[b], %[a10]\n\t"
                         "vfmadd213ps %[c], %[b], %[a11]"
                         : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3),
                           [a4] "+x"(a4), [a5] "+x"(a5), [a6] "+x"(a6), [a7] "+x"(a7),
                           [a8] "+x"(a8), [a9] "+x"(a9), [a10] "+x"(a10), [a11] "+x"(a11)
                         : [b] "x"(b), [c] "x"(c));
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    return _mm256_cvtss_f32(_mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9),
                                                           _mm256_add_ps(a10, a11))));
}

static volatile float sink;

/* Best of 5 (other programs only slow a run), in seconds per rep. */
static double best(float (*f)(op_t, long), op_t o, long reps)
{
    double b = 1e30;
    for (int i = 0; i < 5; i++) {
        const double t = now();
        sink = f(o, reps);
        const double s = now() - t;
        b = s < b ? s : b;
    }
    return b / (double)reps;
}

static float chains_op(op_t o, long reps)
{
    (void)o;
    return chains(reps);
}

/* one instantiation per operand type, so each loop is compiled for its constant type */
TGT static float qk_f32(op_t o, long r) { (void)o; return qk(F32, r); }
TGT static float qk_f16(op_t o, long r) { (void)o; return qk(F16, r); }
TGT static float qk_q8(op_t o, long r) { (void)o; return qk(Q8, r); }
TGT static float pv_f32(op_t o, long r) { (void)o; return pv(F32, r); }
TGT static float pv_f16(op_t o, long r) { (void)o; return pv(F16, r); }
TGT static float pv_q8(op_t o, long r) { (void)o; return pv(Q8, r); }

int main(void)
{
    unsigned ra, rb, rc, rd; /* F16C: CPUID.1:ECX bit 29 (clang has no "f16c" feature string) */
    const int f16c = __get_cpuid(1, &ra, &rb, &rc, &rd) && (rc >> 29 & 1u);
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !f16c) {
        printf("bench_mix: skipped, this host lacks AVX2, FMA or F16C\n");
        return 77;
    }
    for (int i = 0; i < 512; i++)
        q[i] = 1e-3f * (float)(i % 97);
    for (int i = 0; i < 256; i++) {
        kh[i] = (uint16_t)(0x3c00 + i % 64);
        k8[i] = (int8_t)(i % 101 - 50);
        kf[i] = 1e-2f * (float)(i % 31);
    }
    for (int i = 0; i < 64; i++)
        w[i] = 1e-3f * (float)i;
    const double ghz = clock_ghz();
    const double ch = best(chains_op, F32, 20000000) * ghz * 1e9; /* cycles per 12 FMAs */
    printf("bench_mix: clock %.2f GHz (dependent integer adds); 12 register FMA chains: "
           "%.2f FMA/cycle (8 lanes each)\n\n", ghz, 12.0 / ch);
    printf("%-4s %-6s | %8s %9s %10s\n", "loop", "values", "cyc/tok", "FMA/cyc", "of chains");
    static const char *name[] = {"f32", "f16", "q8"};
    float (*const qkf[])(op_t, long) = {qk_f32, qk_f16, qk_q8};
    float (*const pvf[])(op_t, long) = {pv_f32, pv_f16, pv_q8};
    for (int o = F32; o <= Q8; o++) {
        const double c = best(qkf[o], (op_t)o, 2000000) * ghz * 1e9 / 2; /* per token */
        printf("%-4s %-6s | %8.1f %9.2f %10.2f\n", "QK", name[o], c, 64.0 / c, 64.0 / c / (12.0 / ch));
    }
    for (int o = F32; o <= Q8; o++) {
        const double c = best(pvf[o], (op_t)o, 2000000) * ghz * 1e9;
        printf("%-4s %-6s | %8.1f %9.2f %10.2f\n", "PV", name[o], c, 64.0 / c, 64.0 / c / (12.0 / ch));
    }
    printf("\n(per token of one KV group: 64 FMAs in QK and 64 in PV; the AVX2 kernel adds "
           "the score reductions, the softmax and the walk to these)\n");
    return 0;
}
#else
int main(void)
{
    printf("bench_mix: skipped, not an x86-64 host\n");
    return 77;
}
#endif

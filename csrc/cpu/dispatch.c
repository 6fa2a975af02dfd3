/* Run-time choice of the SIMD variant: the best the CPU has, unless one is forced. */
#include "internal.h"

#ifdef PE_HAVE_X86_VARIANTS
#include <cpuid.h>

/* F16C through cpuid: not every compiler's __builtin_cpu_supports knows it. */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

#ifdef PE_HAVE_AVX512BF16
/* AVX512_BF16 (cpuid leaf 7, subleaf 1, eax bit 5), the same way. */
static int has_avx512bf16(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}
#endif
#endif

static int isa_forced = -1;

/* What the CPU supports, found once: cpuid traps to the hypervisor on virtual machines,
 * where a query per call costs more than a decode-size rotation. */
static pe_isa detect(void) {
#ifdef PE_HAVE_X86_VARIANTS /* the AVX2 / AVX-512 kernels were built */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        has_f16c() && __builtin_cpu_supports("fma")) {
#ifdef PE_HAVE_AVX512BF16 /* and only where the hardware rounds bf16 as the software does */
        if (has_avx512bf16() && pe_bf16_hw_exact())
            return PE_ISA_AVX512_BF16;
#endif
        return PE_ISA_AVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c())
        return PE_ISA_AVX2;
#endif
    return PE_ISA_BASELINE;
}

static int isa_detected = -1;

pe_isa pe_isa_best(void) {
    int isa = __atomic_load_n(&isa_detected, __ATOMIC_RELAXED);
    if (isa < 0) { /* threads racing here all store the same value */
        isa = (int)detect();
        __atomic_store_n(&isa_detected, isa, __ATOMIC_RELAXED);
    }
    return (pe_isa)isa;
}

pe_isa pe_isa_current(void) {
    int f = __atomic_load_n(&isa_forced, __ATOMIC_RELAXED);
    return f >= 0 ? (pe_isa)f : pe_isa_best();
}

int pe_isa_set(pe_isa isa) {
    if ((int)isa < PE_ISA_BASELINE || isa > pe_isa_best()) return PE_ERR_ARG;
    __atomic_store_n(&isa_forced, (int)isa, __ATOMIC_RELAXED);
    return PE_OK;
}

const char *pe_isa_name(pe_isa isa) {
    switch (isa) {
    case PE_ISA_BASELINE: return "baseline";
    case PE_ISA_AVX2: return "avx2";
    case PE_ISA_AVX512: return "avx512";
    case PE_ISA_AVX512_BF16: return "avx512bf16";
    }
    return "unknown";
}

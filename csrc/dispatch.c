/* Run-time choice of the SIMD variant: the best the CPU has, unless one is forced. */
#include "internal.h"

static int isa_forced = -1;

pe_isa pe_isa_best(void) {
#ifdef PE_HAVE_X86_VARIANTS /* the AVX2 / AVX-512 kernels were built */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
        return PE_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return PE_ISA_AVX2;
#endif
    return PE_ISA_BASELINE;
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
    }
    return "unknown";
}

/* The fp32 core of the fused q/k norm + RoPE compiled for AVX-512 F/BW/VL/DQ + F16C +
 * AVX512_BF16 (meson.build sets the flags): the avx512 variant with its bf16 roundings done
 * by the hardware where that gives the software's bits (simd.h, PE_BF16_HW). */
#include "qk_norm_f32.h"

void pe_qk_norm_rows_f32_avx512bf16(const pe_qk_norm_args *a, int64_t i0, int64_t n,
                                    int backward, void *scratch) {
    qk_norm_rows_f32(a, i0, n, backward, scratch);
}

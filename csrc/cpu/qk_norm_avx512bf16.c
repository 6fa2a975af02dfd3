/* The fp32 core of the fused q/k norm + RoPE compiled for AVX-512 F/BW/VL/DQ + F16C +
 * AVX512_BF16 (meson.build sets the flags): the avx512 variant with its bf16 roundings done
 * by the hardware where that gives the software's bits (simd.h, PE_BF16_HW). */
#include "qk_norm_f32.h"

PE_QK_DEFINE(avx512bf16)

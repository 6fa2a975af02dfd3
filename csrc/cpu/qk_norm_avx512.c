/* The fp32 core of the fused q/k norm + RoPE compiled for AVX-512 F/BW/VL/DQ + F16C
 * (meson.build sets the flags). */
#include "qk_norm_f32.h"

PE_QK_DEFINE(avx512)

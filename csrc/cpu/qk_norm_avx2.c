/* The fp32 core of the fused q/k norm + RoPE compiled for AVX2 + FMA + F16C
 * (meson.build sets the flags). */
#include "qk_norm_f32.h"

PE_QK_DEFINE(avx2)

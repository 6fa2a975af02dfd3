/* The fp32 core of the fused q/k norm + RoPE compiled for the baseline instruction set of the target. */
#include "qk_norm_f32.h"

PE_QK_DEFINE(baseline)

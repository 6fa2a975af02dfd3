/* The fp32 RoPE core compiled for AVX-512 F/BW/VL/DQ + F16C (meson.build sets the flags). */
#include "rope_f32.h"

int pe_rope_apply_f32_avx512(const pe_rope_args *a, const pe_rope_plan *p) {
    return rope_f32_apply(a, p);
}

int pe_rope_table_grad_f32_avx512(const pe_rope_args *a, const pe_rope_plan *p,
                                 const pe_rope_grads *g) {
    return rope_f32_table_grad(a, p, g);
}

int pe_rope_tables_f32_avx512(const pe_rope_args *a, const pe_rope_plan *p, pe_dtype out_dtype,
                             void *cos, void *sin) {
    return rope_f32_tables(a, p, out_dtype, cos, sin);
}

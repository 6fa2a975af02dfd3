/* The fp32 RoPE core compiled for AVX2 + FMA + F16C (meson.build sets the flags). */
#include "rope_f32.h"

void pe_rope_rotate_f32_avx2(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                             int64_t n, void *scratch) {
    rope_f32_rotate(a, p, i0, n, scratch);
}

void pe_rope_grad_rows_f32_avx2(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                int64_t n, void *scratch) {
    rope_f32_grad_rows(a, p, i0, n, scratch);
}

void pe_rope_table_rows_f32_avx2(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                 int64_t n, void *scratch) {
    rope_f32_table_rows(a, p, i0, n, scratch);
}

void pe_bf16_pairs_avx2(uint16_t *dst, const float *even, const float *odd, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        vi_store((char *)(dst + 2 * i), bf16_pairs_num(vf_load(even + i), vf_load(odd + i)));
}

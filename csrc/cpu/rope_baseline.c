/* The fp32 RoPE core compiled for the baseline instruction set of the target (any x86-64; NEON on aarch64). */
#include "rope_f32.h"

void pe_rope_rotate_f32_baseline(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                 int64_t n, void *scratch) {
    rope_f32_rotate(a, p, i0, n, scratch);
}

void pe_rope_grad_rows_f32_baseline(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                    int64_t n, void *scratch) {
    rope_f32_grad_rows(a, p, i0, n, scratch);
}

void pe_rope_table_rows_f32_baseline(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                     int64_t n, void *scratch) {
    rope_f32_table_rows(a, p, i0, n, scratch);
}

/* The fp32 RoPE core compiled for AVX-512 F/BW/VL/DQ + F16C + AVX512_BF16 (meson.build sets
 * the flags): the avx512 variant with bf16 rows rounded by the hardware (simd.h,
 * PE_BF16_HW), and the check dispatch.c runs before it picks this variant. */
#include "rope_f32.h"

void pe_rope_rotate_f32_avx512bf16(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                   int64_t n, void *scratch) {
    rope_f32_rotate(a, p, i0, n, scratch);
}

void pe_rope_grad_rows_f32_avx512bf16(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                      int64_t n, void *scratch) {
    rope_f32_grad_rows(a, p, i0, n, scratch);
}

void pe_rope_table_rows_f32_avx512bf16(const pe_rope_args *a, const pe_rope_plan *p,
                                       int64_t i0, int64_t n, void *scratch) {
    rope_f32_table_rows(a, p, i0, n, scratch);
}

void pe_bf16_round_hw(uint16_t *dst, const float *src, int64_t n) {
    bf16_round_hw_row(dst, src, n);
}

/* The fp32 bit patterns of every class the rows can meet, each with a few low halves:
 * zeros, normals (ties up and down, a carry into the exponent, the largest finite rounding
 * to infinity), infinities, quiet and signalling NaNs with payloads: 1 when the hardware
 * rounds every one as pe_f32_to_bf16 does (denormals, which the rows leave to software, are
 * not asked about). */
int pe_bf16_hw_exact(void) {
    static const uint32_t hi[] = {0x0000, 0x0001, 0x007f, 0x0080, 0x0081, 0x3f80, 0x3f81,
                                  0x3fff, 0x7f7f, 0x7f80, 0x7f81, 0x7fbf, 0x7fc0, 0x7fc1,
                                  0x7fff};
    static const uint32_t lo[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
    float src[192] = {0}; /* 2 x 15 x 6 values, then zeros to a multiple of 16 */
    uint16_t hw[192];
    int n = 0;
    for (int s = 0; s < 2; ++s)
        for (size_t i = 0; i < sizeof hi / sizeof *hi; ++i)
            for (size_t j = 0; j < sizeof lo / sizeof *lo; ++j) {
                const uint32_t u = (uint32_t)s << 31 | hi[i] << 16 | lo[j];
                memcpy(&src[n++], &u, 4);
            }
    bf16_round_hw_row(hw, src, 192);
    for (int i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, &src[i], 4);
        const int denormal = (u & 0x7f800000u) == 0 && (u & 0x7fffffu) != 0;
        if (!denormal && hw[i] != pe_f32_to_bf16(src[i])) return 0; /* rows redo denormals */
    }
    return 1;
}

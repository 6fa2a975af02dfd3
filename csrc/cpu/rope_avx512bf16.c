/* The fp32 RoPE core compiled for AVX-512 F/BW/VL/DQ + F16C + AVX512_BF16 (meson.build sets
 * the flags): the avx512 variant with bf16 rows rounded by the hardware (simd.h,
 * PE_BF16_HW), and the check dispatch.c runs before it picks this variant. */
#include <float.h>

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

void pe_bf16_dot_hw(float *dst, const uint16_t *x, const uint16_t *t, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_dpbf16_ps(_mm512_setzero_ps(),
                                                   (__m512bh)vi_load((const char *)(x + 2 * i)),
                                                   (__m512bh)vi_load((const char *)(t + 2 * i))));
}

/* Whether vdpbf16ps gives x0 t0 + x1 t1 as the rows' fp32 arithmetic does (two exact
 * products, one rounding to nearest even) on pairs made to round: sums with bits far below
 * the last place, ties either way, carries into the exponent, cancellation, and values from
 * 2^-62 to the largest bf16, with table values of magnitude at most 1 (simd.h,
 * bf16_dot_block; results under 2^-64, which the rows do again, are not asked about). */
static int dot_exact(void) {
    static const uint16_t xs[] = {0x3f80, 0x3f81, 0xbf80, 0x3fff, 0xbfc1, 0x4b00, 0x3300,
                                  0x3380, 0x3381, 0xb37f, 0x3400, 0x4040, 0x7f7f, 0x2080};
    static const uint16_t ts[] = {0x3f80, 0xbf80, 0x3f7f, 0x3b80, 0x3f00, 0xbeab, 0x0000};
    enum { NX = sizeof xs / sizeof *xs, NT = sizeof ts / sizeof *ts };
    enum { N = (NX * NX * NT * NT + 15) / 16 * 16 };
    static uint16_t x[2 * N], t[2 * N];
    static float got[N];
    int64_t n = 0;
    for (int a = 0; a < NX; ++a)
        for (int b = 0; b < NX; ++b)
            for (int c = 0; c < NT; ++c)
                for (int d = 0; d < NT; ++d, ++n) {
                    x[2 * n] = xs[a], x[2 * n + 1] = xs[b];
                    t[2 * n] = ts[c], t[2 * n + 1] = ts[d];
                }
    pe_bf16_dot_hw(got, x, t, N);
    for (int64_t i = 0; i < n; ++i) {
        const float want = pe_bf16_to_f32(x[2 * i]) * pe_bf16_to_f32(t[2 * i]) +
                           pe_bf16_to_f32(x[2 * i + 1]) * pe_bf16_to_f32(t[2 * i + 1]);
        if (fabsf(want) >= 0x1p-64f && fabsf(want) <= FLT_MAX &&
            pe_f32_bits(got[i]) != pe_f32_bits(want))
            return 0;
    }
    return 1;
}

/* The fp32 bit patterns of every class the rows can meet, each with a few low halves:
 * zeros, normals (ties up and down, a carry into the exponent, the largest finite rounding
 * to infinity), infinities, quiet and signalling NaNs with payloads: 1 when the hardware
 * rounds every one as pe_f32_to_bf16 does (denormals, which the rows leave to software, are
 * not asked about), and its dot products of bf16 pairs are the rows' sums (dot_exact). */
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
    return dot_exact();
}

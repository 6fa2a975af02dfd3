/*
 * A sweep over the functions of rope_math.h whose results must not depend on the compiler
 * or the processor: entry i of the sweep turns i into inputs (fp32 angles of every
 * magnitude, all 16-bit patterns, fp64 values near ties) and returns a 64-bit digest of the
 * outputs.  Included as C (gcc, the CPU kernels' compiler), as CUDA host code and as CUDA
 * device code; the three must agree on every entry.
 */
#ifndef POSENC_MATH_SWEEP_H
#define POSENC_MATH_SWEEP_H

#include "rope_math.h"

#define PE_SWEEP_N (1u << 20)

PE_HD uint64_t pe_sweep_mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
}

PE_HD uint64_t pe_math_sweep(uint32_t i) {
    /* angles: spread over the exponents (|x| up to 2^31), half of them negative */
    const uint32_t e = 100u + (i % 58u), m = (i * 2654435761u) & 0x7fffffu;
    const float x = pe_bits_f32(((i & 1u) << 31) | (e << 23) | m);
    const float pos_angle =
        pe_rope_angle(pe_bits_f32(0x3f800000u - (i & 0xffffu)), (int64_t)i * 37);
    float c, s, c2, s2;
    pe_sincos_large(x, 1.0f, &c, &s);
    pe_sincos_large(pos_angle, 0.8125f, &c2, &s2);
    uint64_t h = pe_sweep_mix(0, pe_f32_bits(c));
    h = pe_sweep_mix(h, pe_f32_bits(s));
    h = pe_sweep_mix(h, pe_f32_bits(c2));
    h = pe_sweep_mix(h, pe_f32_bits(s2));
    if (pe_f32_bits(x) < 0x5d000000u) { /* the fast reduction where it applies */
        pe_sincos_fast(x <= PE_SINCOS_FAST_LIMIT && x >= -PE_SINCOS_FAST_LIMIT ? x : 1.0f, 1.0f, &c,
                       &s);
        h = pe_sweep_mix(h, ((uint64_t)pe_f32_bits(c) << 32) | pe_f32_bits(s));
    }
    /* conversions: every 16-bit pattern, fp32 values around the rounding points */
    const uint16_t b = (uint16_t)i;
    h = pe_sweep_mix(h, pe_f32_bits(pe_bf16_to_f32(b)) ^
                            ((uint64_t)pe_f32_bits(pe_f16_to_f32(b)) << 32));
    /* bit-level conversions see every pattern (NaN, inf included); arithmetic sees finite
     * values only (NaN payloads are not specified alike on every processor) */
    const uint32_t yb = i * 4099u + (i >> 7);
    h = pe_sweep_mix(h, pe_f32_to_bf16(pe_bits_f32(yb)) |
                            ((uint64_t)pe_f32_to_f16(pe_bits_f32(yb)) << 16));
    const float y = pe_bits_f32(((yb >> 23) & 0xffu) == 0xffu ? yb ^ 0x40000000u : yb);
    const double d = (double)y * (1.0 + (double)(i & 7u) * 1.1102230246251565e-16);
    h = pe_sweep_mix(h, pe_f64_to_bf16(d) | ((uint64_t)pe_f64_to_f16(d) << 16));
    /* one rotated channel in fp32 and fp64 */
    const float r32 = pe_rot_f32(y, c, pe_bits_f32(i * 7919u), s);
    const double r64 = pe_rot_f64(d, (double)c, (double)pe_bits_f32(i * 7919u), (double)s);
    uint64_t r64_bits;
    memcpy(&r64_bits, &r64, 8);
    h = pe_sweep_mix(h, pe_f32_bits(r32));
    return pe_sweep_mix(h, r64_bits);
}

#endif /* POSENC_MATH_SWEEP_H */

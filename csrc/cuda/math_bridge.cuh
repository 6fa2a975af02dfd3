// Per-element math of the CUDA kernels: the angle of a slot, its scaled sin/cos, and the
// 16-bit conversions (no fused multiply-add: built with --fmad=false).  Stand-in until the shared host/device header lands; the kernels
// call only the functions below.
#pragma once

#include <cstdint>
#include <cstring>

#ifndef PE_HD
#define PE_HD __host__ __device__
#endif

namespace pe_cuda {

PE_HD inline float angle(float inv_freq, int64_t pos) {
    return inv_freq * static_cast<float>(pos);
}

// sin and cos of an fp32 angle, each scaled by `scaling` in fp32 (the CPU's reduction and
// polynomials, fp64 inside).
PE_HD inline void sincos_scaled(float ang, float scaling, float *c, float *s) {
    const double two_over_pi = 6.36619772367581382433e-01;
    const double p1 = 1.57079632673412561417e+00, p2 = 6.07710050630396597660e-11,
                 p3 = 2.02226624879595063154e-21;
    const double S1 = -1.66666666666666324348e-01, S2 = 8.33333333332248946124e-03,
                 S3 = -1.98412698298579493134e-04, S4 = 2.75573137070700676789e-06,
                 S5 = -2.50507602534068634195e-08, S6 = 1.58969099521155010221e-10;
    const double C1 = 4.16666666666666019037e-02, C2 = -1.38888888888741095749e-03,
                 C3 = 2.48015872894767294178e-05, C4 = -2.75573143513906633035e-07,
                 C5 = 2.08757232129817482790e-09, C6 = -1.13596475577881948265e-11;
    const double limit = 823549.6;
    const double x = static_cast<double>(ang);
    if (fabs(x) > limit || x != x) {
        *s = static_cast<float>(sin(x)) * scaling;
        *c = static_cast<float>(cos(x)) * scaling;
        return;
    }
    const double k = nearbyint(x * two_over_pi);
    const double r = ((x - k * p1) - k * p2) - k * p3;
    const double z = r * r;
    const double sr = r + r * z * (S1 + z * (S2 + z * (S3 + z * (S4 + z * (S5 + z * S6)))));
    const double cr =
        1.0 - 0.5 * z + z * z * (C1 + z * (C2 + z * (C3 + z * (C4 + z * (C5 + z * C6)))));
    const double q = k - 4.0 * floor(k * 0.25);
    const bool odd = q == 1.0 || q == 3.0;
    const double sv = odd ? cr : sr, cv = odd ? sr : cr;
    const double ssign = q >= 2.0 ? -1.0 : 1.0;
    const double csign = (q == 1.0 || q == 2.0) ? -1.0 : 1.0;
    *s = static_cast<float>(ssign * sv) * scaling;
    *c = static_cast<float>(csign * cv) * scaling;
}

PE_HD inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even; NaN stays NaN (quieted).
PE_HD inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return static_cast<uint16_t>(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

}  // namespace pe_cuda

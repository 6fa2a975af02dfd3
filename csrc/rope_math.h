/*
 * rope_math.h — the per-element arithmetic of the RoPE kernels, shared by the CPU kernels
 * (plain C) and device code (CUDA C++), so that both give the same bits:
 *
 *   - dtype sizes, and conversions: bf16 / fp16 <-> fp32 and fp64 -> bf16 / fp16, each
 *     rounding once to nearest even (NaN stays a quiet NaN, infinities and signed zeros
 *     are kept);
 *   - the rotation of one channel, out = x * c + x_partner * signed_sine, as a product,
 *     a product and a sum, each rounded (never fused);
 *   - the fused path's angle fl32(inv_freq * fl32(pos)) and its sine and cosine.
 *
 * Everything is integer arithmetic or single IEEE operations (+, *, conversions) in a
 * fixed order: no libm, no fused multiply-add.  The host build compiles with
 * -ffp-contract=off and needs FLT_EVAL_METHOD == 0 (SSE2 on x86-64, any aarch64); under
 * CUDA every floating-point operation is written with the _rn intrinsics, which nvcc
 * never contracts, so no -fmad flag is needed.
 */
#ifndef POSENC_ROPE_MATH_H
#define POSENC_ROPE_MATH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "posenc.h"

#ifdef __CUDACC__
#define PE_HD __host__ __device__ __forceinline__
#else
#define PE_HD static inline
#endif

#if defined(__CUDA_ARCH__)
#define PE_FMUL(a, b) __fmul_rn((a), (b))
#define PE_FADD(a, b) __fadd_rn((a), (b))
#define PE_DMUL(a, b) __dmul_rn((a), (b))
#define PE_DADD(a, b) __dadd_rn((a), (b))
#else
#define PE_FMUL(a, b) ((a) * (b))
#define PE_FADD(a, b) ((a) + (b))
#define PE_DMUL(a, b) ((a) * (b))
#define PE_DADD(a, b) ((a) + (b))
#endif

PE_HD uint32_t pe_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

PE_HD float pe_bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* ---- dtypes ------------------------------------------------------------------------ */

/* Bytes of one element; 0 for a value that is not a pe_dtype. */
PE_HD size_t pe_dtype_size(pe_dtype t) {
    switch (t) {
    case PE_FLOAT32: return 4;
    case PE_FLOAT64: return 8;
    case PE_BFLOAT16:
    case PE_FLOAT16: return 2;
    }
    return 0;
}

PE_HD float pe_bf16_to_f32(uint16_t h) { return pe_bits_f32((uint32_t)h << 16); }

/* The bf16 and fp16 encodings of the fp32 NaN of bits u: quiet, with its sign and leading
 * fraction bits. */
PE_HD uint16_t pe_bf16_of_nan(uint32_t u) { return (uint16_t)((u >> 16) | 0x40u); }
PE_HD uint16_t pe_f16_of_nan(uint32_t u) {
    return (uint16_t)(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
}

PE_HD uint16_t pe_f32_to_bf16(float f) {
    const uint32_t u = pe_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return pe_bf16_of_nan(u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

PE_HD float pe_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) return pe_bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp) return pe_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
    /* zero or subnormal: man * 2^-24, exact in fp32 */
    const float v = PE_FMUL((float)man, 5.9604644775390625e-8f);
    return sign ? -v : v;
}

PE_HD uint16_t pe_f32_to_f16(float f) {
    const uint32_t u = pe_f32_bits(f), a = u & 0x7fffffffu;
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if (a > 0x7f800000u) return pe_f16_of_nan(u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: inf */
    if (a >= 0x38800000u) { /* normal: round at bit 13, rebias the exponent 127 -> 15 */
        const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
    }
    /* below 2^-14: adding 0.5 rounds |f| to a multiple of 2^-24 (the fp16 subnormal step),
     * to nearest even; the low bits of the sum are the fp16 encoding (0x400 = 2^-14) */
    const float sum = PE_FADD(pe_bits_f32(a), 0.5f);
    return (uint16_t)(sign | (pe_f32_bits(sum) - 0x3f000000u));
}

/* fp64 -> fp32 rounded to odd: truncate, then set the last bit when inexact.  Rounding that
 * to a format at least two bits narrower gives the correctly rounded fp64 value. */
PE_HD float pe_f64_to_f32_odd(double d) {
    const float f = (float)d;
    if (d != d || (double)f == d) return f;
    uint32_t u = pe_f32_bits(f);
    if (d > 0 ? (double)f > d : (double)f < d) u -= 1; /* rounded away from zero */
    return pe_bits_f32(u | 1u);
}

PE_HD uint16_t pe_f64_to_bf16(double d) { return pe_f32_to_bf16(pe_f64_to_f32_odd(d)); }
PE_HD uint16_t pe_f64_to_f16(double d) { return pe_f32_to_f16(pe_f64_to_f32_odd(d)); }

/* ---- rotation ------------------------------------------------------------------------ */

/* One rotated channel: x * c + xp * ss, where xp is the partner channel's input and ss the
 * signed sine of the forward (sign(e) s[e]) or of the transpose (-sign(e) s[p(e)]). */
PE_HD float pe_rot_f32(float x, float c, float xp, float ss) {
    return PE_FADD(PE_FMUL(x, c), PE_FMUL(xp, ss));
}

PE_HD double pe_rot_f64(double x, double c, double xp, double ss) {
    return PE_DADD(PE_DMUL(x, c), PE_DMUL(xp, ss));
}

/* Angle of a frequency slot on the fused path: fl32(inv_freq * fl32(pos)). */
PE_HD float pe_rope_angle(float inv_freq, int64_t pos) { return PE_FMUL(inv_freq, (float)pos); }

/* ---- sine and cosine of fp32 angles -------------------------------------------------
 * Results are scaling * sin(x), scaling * cos(x): the sine and cosine are computed in fp64
 * from the exact fp32 angle, rounded to fp32, then multiplied by scaling in fp32.  The
 * fp64 values are accurate to a few fp64 ulps, so the fp32 results are correctly rounded
 * except in rare near-ties.  Angles up to PE_SINCOS_FAST_LIMIT are reduced by Cody-Waite
 * with a three-part pi/2 (k * p1 exact for |k| < 2^19); larger ones by an exact integer
 * product with the bits of 2/pi (Payne-Hanek).  inf and NaN give NaN. */
#define PE_SINCOS_FAST_LIMIT 823549.6f

/* r in [-pi/4, pi/4], quadrant q: the angle is q * pi/2 + r. */
PE_HD void pe_sincos_quadrant(double r, uint32_t q, float scaling, float *c, float *s) {
    const double S1 = -1.66666666666666324348e-01, S2 = 8.33333333332248946124e-03,
                 S3 = -1.98412698298579493134e-04, S4 = 2.75573137070700676789e-06,
                 S5 = -2.50507602534068634195e-08, S6 = 1.58969099521155010221e-10;
    const double C1 = 4.16666666666666019037e-02, C2 = -1.38888888888741095749e-03,
                 C3 = 2.48015872894767294178e-05, C4 = -2.75573143513906633035e-07,
                 C5 = 2.08757232129817482790e-09, C6 = -1.13596475577881948265e-11;
    const double z = PE_DMUL(r, r);
    /* sin r = r + r z (S1 + z (S2 + ...)),  cos r = 1 - z/2 + z^2 (C1 + z (C2 + ...)) */
    double ps = PE_DADD(S5, PE_DMUL(z, S6));
    ps = PE_DADD(S4, PE_DMUL(z, ps));
    ps = PE_DADD(S3, PE_DMUL(z, ps));
    ps = PE_DADD(S2, PE_DMUL(z, ps));
    ps = PE_DADD(S1, PE_DMUL(z, ps));
    double pc = PE_DADD(C5, PE_DMUL(z, C6));
    pc = PE_DADD(C4, PE_DMUL(z, pc));
    pc = PE_DADD(C3, PE_DMUL(z, pc));
    pc = PE_DADD(C2, PE_DMUL(z, pc));
    pc = PE_DADD(C1, PE_DMUL(z, pc));
    const double sr = PE_DADD(r, PE_DMUL(PE_DMUL(r, z), ps));
    const double cr = PE_DADD(PE_DADD(1.0, -PE_DMUL(0.5, z)), PE_DMUL(PE_DMUL(z, z), pc));
    const int odd = (int)(q & 1u);
    const double sv = odd ? cr : sr, cv = odd ? sr : cr;
    const float sf = (float)(q >= 2u ? -sv : sv);
    const float cf = (float)((q == 1u || q == 2u) ? -cv : cv);
    *s = PE_FMUL(sf, scaling);
    *c = PE_FMUL(cf, scaling);
}

/* |x| <= PE_SINCOS_FAST_LIMIT (any other x is treated as 0: no branch, so loops of it
 * vectorize; callers redo those lanes with pe_sincos_large). */
PE_HD void pe_sincos_fast(float x, float scaling, float *c, float *s) {
    const double two_over_pi = 6.36619772367581382433e-01;
    const double p1 = 1.57079632673412561417e+00, p2 = 6.07710050630396597660e-11,
                 p3 = 2.02226624879595063154e-21;
    const double round_const = 6755399441055744.0; /* 1.5 * 2^52: rounds to an integer */
    const double xd = (x <= PE_SINCOS_FAST_LIMIT && x >= -PE_SINCOS_FAST_LIMIT) ? (double)x : 0.0;
    const double k = PE_DADD(PE_DADD(PE_DMUL(xd, two_over_pi), round_const), -round_const);
    const double r = PE_DADD(PE_DADD(PE_DADD(xd, -PE_DMUL(k, p1)), -PE_DMUL(k, p2)),
                             -PE_DMUL(k, p3));
    pe_sincos_quadrant(r, (uint32_t)(int32_t)k & 3u, scaling, c, s);
}

/* 2/pi = 0.A2F9836E 4E441529 ... in hex: bit j (1-based) has weight 2^-j */
#define PE_TWO_OVER_PI_BITS                                                                \
    {0xA2F9836Eu, 0x4E441529u, 0xFC2757D1u, 0xF534DDC0u, 0xDB629599u,                      \
     0x3C439041u, 0xFE5163ABu, 0xDEBBC561u, 0xB7246E3Au}
#ifdef __CUDACC__
/* On the device the table is read with run-time indices: in constant memory it costs no
 * stack frame (a local array would live in local memory). */
static __constant__ const uint32_t pe_two_over_pi_bits_dev[9] = PE_TWO_OVER_PI_BITS;
#endif

/* Any x; exact reduction for |x| > PE_SINCOS_FAST_LIMIT. */
PE_HD void pe_sincos_large(float x, float scaling, float *c, float *s) {
#if defined(__CUDA_ARCH__)
    const uint32_t *two_over_pi_bits = pe_two_over_pi_bits_dev;
#else
    const uint32_t two_over_pi_bits[9] = PE_TWO_OVER_PI_BITS;
#endif
    const uint32_t a = pe_f32_bits(x) & 0x7fffffffu;
    if (a >= 0x7f800000u) { /* inf or NaN */
        const float nan = pe_bits_f32(0x7fc00000u);
        *c = *s = nan;
        return;
    }
    if (a <= pe_f32_bits(PE_SINCOS_FAST_LIMIT)) {
        pe_sincos_fast(x, scaling, c, s);
        return;
    }
    /* |x| = m 2^sh with a 24-bit integer m and sh >= -4.  Bits j < sh - 1 of 2/pi add
     * multiples of 4 to |x| (2/pi) and drop out of the quadrant; with G the 128 bits of 2/pi
     * from bit j0 = sh - 1 on (bits j <= 0 are zeros), |x| (2/pi) = m G 2^-126 (mod 4). */
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const int start = (int)(a >> 23) - 152; /* j0 - 1: index of G's first bit, >= -6 */
    uint32_t g[4];
    if (start >= 0) {
        const int w = start / 32, bit = start % 32;
        for (int i = 0; i < 4; ++i)
            g[i] = bit ? (two_over_pi_bits[w + i] << bit) |
                             (two_over_pi_bits[w + i + 1] >> (32 - bit))
                       : two_over_pi_bits[w + i];
    } else {
        const int bit = -start;
        for (int i = 0; i < 4; ++i)
            g[i] = (two_over_pi_bits[i] >> bit) | (i ? two_over_pi_bits[i - 1] << (32 - bit) : 0u);
    }
    /* N = M G in 32-bit limbs l0 (lowest, unused) .. l3; N mod 2^128 is all that matters */
    uint64_t p = (uint64_t)m * g[3];
    p = (uint64_t)m * g[2] + (p >> 32);
    const uint32_t l1 = (uint32_t)p;
    p = (uint64_t)m * g[1] + (p >> 32);
    const uint32_t l2 = (uint32_t)p;
    p = (uint64_t)m * g[0] + (p >> 32);
    const uint32_t l3 = (uint32_t)p;
    uint32_t q = l3 >> 30; /* bits 126, 127: the quadrant */
    /* bits 62..125: the fraction of a quadrant, rounded to the nearest quadrant */
    const uint64_t f = ((uint64_t)(l3 & 0x3fffffffu) << 34) | ((uint64_t)l2 << 2) | (l1 >> 30);
    double frac;
    if (f >> 63) {
        q = (q + 1u) & 3u;
        frac = -(double)(~f + 1u);
    } else {
        frac = (double)f;
    }
    double r = PE_DMUL(PE_DMUL(frac, 5.42101086242752217004e-20 /* 2^-64 */),
                       1.57079632679489661923e+00);
    if (pe_f32_bits(x) >> 31) { /* sin(-x) = -sin x: negate r and the quadrant */
        r = -r;
        q = (4u - q) & 3u;
    }
    pe_sincos_quadrant(r, q, scaling, c, s);
}

#endif /* POSENC_ROPE_MATH_H */

// A host model of the device's fp32 -> bf16 / fp16 conversion instructions, written from
// their documented semantics rather than from the CPU's code, so that comparing the two
// means something (tests/test_emulated.cu does, over all 2^32 fp32 bit patterns).
//
// PTX ISA, cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 (and their one-value forms): each fp32
// input is rounded to the destination format with .rn, "mantissa LSB rounds to nearest
// even"; without .ftz, subnormal inputs and results are kept; without .satfinite, a value
// too large for the format becomes an infinity of its sign; a NaN input gives a NaN, its bits
// not specified here (the model gives the canonical quiet NaN; the kernels never store the
// instruction's NaN, see rope_kernels.cuh).  This is IEEE 754 roundTiesToEven into a binary
// format of `ebits` exponent and `mbits` fraction bits, which the model computes on the exact
// value: an integer significand times a power of two.
#pragma once

#include <cstdint>
#include <cstring>

namespace pe_cuda {

// The bits of x rounded to nearest even into the binary format (sign, ebits, mbits).
inline uint32_t cvt_rn_model(float x, int ebits, int mbits) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 31) << (ebits + mbits);
    const uint32_t field = (u >> 23) & 0xffu, frac = u & 0x7fffffu;
    const uint32_t exp_ones = (1u << ebits) - 1u;
    if (field == 0xffu) // NaN: canonical quiet NaN; infinity: infinity
        return frac ? (exp_ones << mbits) | ((1u << mbits) - 1u) : sign | (exp_ones << mbits);
    // |x| = m 2^q exactly (m < 2^24)
    const uint64_t m = field ? (frac | 0x800000u) : frac;
    const int q = field ? static_cast<int>(field) - 150 : -149;
    if (m == 0) return sign;
    const int top = 63 - __builtin_clzll(m); // |x| in [2^(top + q), 2^(top + q + 1))
    const int bias = (1 << (ebits - 1)) - 1, emin = 1 - bias;
    const int exponent = top + q < emin ? emin : top + q;
    const int quantum = exponent - mbits; // the format's spacing there: 2^quantum
    uint64_t n;                           // |x| / 2^quantum, rounded to nearest even
    if (q >= quantum) {
        n = m << (q - quantum);
    } else {
        const int d = quantum - q;
        if (d > 40) {
            n = 0; // |x| < 2^(quantum - 17): below half the spacing
        } else {
            n = m >> d;
            const uint64_t rest = m & ((uint64_t{1} << d) - 1), half = uint64_t{1} << (d - 1);
            if (rest > half || (rest == half && (n & 1))) ++n;
        }
    }
    int e = exponent;
    if (n >> (mbits + 1)) { // rounded up to the next power of two
        n >>= 1;
        ++e;
    }
    if (n < (uint64_t{1} << mbits)) return sign | static_cast<uint32_t>(n); // subnormal or 0
    const int biased = e + bias;
    if (biased >= static_cast<int>(exp_ones)) return sign | (exp_ones << mbits); // overflow
    return sign | (static_cast<uint32_t>(biased) << mbits) |
           static_cast<uint32_t>(n - (uint64_t{1} << mbits));
}

inline uint16_t cvt_rn_bf16_model(float x) {
    return static_cast<uint16_t>(cvt_rn_model(x, 8, 7));
}
inline uint16_t cvt_rn_f16_model(float x) {
    return static_cast<uint16_t>(cvt_rn_model(x, 5, 10));
}

// cvt.f32.f16 (exact: every fp16 value is an fp32 value) from the same reading: sign,
// exponent and fraction fields to the value they denote.  NaN: the canonical quiet NaN.
inline float cvt_f32_f16_model(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31, field = (h >> 10) & 0x1fu,
                   frac = h & 0x3ffu;
    uint32_t u;
    if (field == 0x1fu) {
        u = frac ? 0x7fffffffu : sign | 0x7f800000u;
    } else if (field) {
        u = sign | ((field - 15u + 127u) << 23) | (frac << 13);
    } else if (frac) { // frac 2^-24: normalize
        int shift = 0;
        while (!(frac << shift & 0x400u)) ++shift; // leading one to bit 10
        u = sign | ((static_cast<uint32_t>(127 - 14 - shift)) << 23) |
            (((frac << shift) & 0x3ffu) << 13);
    } else {
        u = sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

} // namespace pe_cuda

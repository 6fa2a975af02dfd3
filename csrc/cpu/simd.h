/*
 * The SIMD vocabulary of the fp32 cores (rope_f32.h, qk_norm_f32.h): an fp32 vector type
 * pe_vf of PE_VW lanes with loads, stores and arithmetic, loads and stores of 16-bit
 * dtypes with the conversion inline (bf16 rounds to nearest even), bf16 channel pairs, the
 * scalar sx_load / sx_store, and rows of n values converted to and from fp32.  The
 * compiler's target macros (__AVX512F__, __AVX2__) of the file that includes it pick the
 * rows; the baseline build defines no PE_VW and keeps the scalar helpers.
 */
#ifndef POSENC_SIMD_H
#define POSENC_SIMD_H

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#include <math.h>
#endif

#include "internal.h"

#define PE_INLINE static inline __attribute__((always_inline))

/*
 * Fast rows for the common case: half pairing, same dtype in and out, fp32 compute.  One
 * pass over all heads of a token reads both halves of each row, rotates, and stores with
 * the conversion inline; nothing goes through a scratch buffer.  The vector helpers below
 * take the dtype as an argument and are always inlined with a constant, so each dtype gets
 * its own straight-line loop.  The vectorizer handles plain fp32 well but not the bf16
 * rounding or F16C, hence explicit intrinsics.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PE_VW 16
typedef __m512 pe_vf;
PE_INLINE pe_vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
PE_INLINE pe_vf vf_zero(void) { return _mm512_setzero_ps(); }
PE_INLINE pe_vf vf_set1(float v) { return _mm512_set1_ps(v); }
PE_INLINE pe_vf vf_add(pe_vf a, pe_vf b) { return _mm512_add_ps(a, b); }
PE_INLINE pe_vf vf_sub(pe_vf a, pe_vf b) { return _mm512_sub_ps(a, b); }
PE_INLINE pe_vf vf_mul(pe_vf a, pe_vf b) { return _mm512_mul_ps(a, b); }
PE_INLINE pe_vf vf_neg(pe_vf a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
PE_INLINE pe_vf vf_and(pe_vf m, pe_vf a) { return _mm512_and_ps(m, a); }
PE_INLINE pe_vf vf_or(pe_vf a, pe_vf b) { return _mm512_or_ps(a, b); }
PE_INLINE pe_vf vf_andnot(pe_vf m, pe_vf a) { return _mm512_andnot_ps(m, a); } /* ~m & a */
/* b in the lanes where the sign bit of m is set, else a */
PE_INLINE pe_vf vf_select(pe_vf a, pe_vf b, pe_vf m) {
    return _mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(m)), a, b);
}
PE_INLINE pe_vf vf_rot(pe_vf a, pe_vf ca, pe_vf b, pe_vf sb) {
    return _mm512_add_ps(_mm512_mul_ps(a, ca), _mm512_mul_ps(b, sb));
}
/* 16 values of a 16-bit dtype (fp16, bf16) as fp32 */
PE_INLINE pe_vf vx_widen16(__m256i h, pe_dtype dt) {
    if (dt == PE_FLOAT16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PE_INLINE pe_vf vx_load(const char *p, pe_dtype dt) {
    if (dt == PE_FLOAT32) return _mm512_loadu_ps((const float *)p);
    return vx_widen16(_mm256_loadu_si256((const __m256i *)p), dt);
}
PE_INLINE void vx_store16(char *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }
PE_INLINE void vx_store(char *p, pe_vf v, pe_dtype dt) {
    if (dt == PE_FLOAT32) {
        _mm512_storeu_ps((float *)p, v);
    } else if (dt == PE_FLOAT16) {
        vx_store16(p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else { /* bf16: round to nearest even on the bits; NaN stays a (quiet) NaN */
        const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
        const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
        r = _mm512_srli_epi32(r, 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
        vx_store16(p, _mm512_cvtepi32_epi16(r));
    }
}
/* bf16 as channel pairs (PE_BF16_BLOCK below): each 32-bit word holds channels 2i, 2i+1. */
typedef __m512i pe_vi;
PE_INLINE pe_vi vi_load(const char *p) { return _mm512_loadu_si512((const void *)p); }
PE_INLINE void vi_store(char *p, pe_vi v) { _mm512_storeu_si512((void *)p, v); }
/* Streaming (cache-bypassing) stores to 64-byte aligned rows; bf16 rows of channel order
 * (only row tails, which rope.c never streams) store as usual. */
PE_INLINE void vi_stream(char *p, pe_vi v) { _mm512_stream_si512((void *)p, v); }
PE_INLINE void vx_stream(char *p, pe_vf v, pe_dtype dt) {
    if (dt == PE_FLOAT32) _mm512_stream_ps((float *)p, v);
    else if (dt == PE_FLOAT16)
        _mm256_stream_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else vx_store(p, v, dt);
}
PE_INLINE pe_vf bf16_even(pe_vi u) { return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)); }
PE_INLINE pe_vf bf16_odd(pe_vi u) {
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}
/* v rounded to bf16 in the high half of each word (the low half is left over): for numbers
 * (bf16_round_num) and for any value, NaN included (bf16_round_hi) */
PE_INLINE pe_vi bf16_round_num(pe_vf v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
}
PE_INLINE pe_vi bf16_round_hi(pe_vf v) {
    return _mm512_mask_or_epi32(bf16_round_num(v), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                _mm512_castps_si512(v), _mm512_set1_epi32(0x400000));
}
/* acc with all-ones lanes where a or b, or c or d, is NaN; whether any lane of m is set */
PE_INLINE pe_vf vf_nan_lanes(pe_vf acc, pe_vf a, pe_vf b, pe_vf c, pe_vf d) {
    const __mmask16 m = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(
        _mm512_mask_mov_epi32(_mm512_castps_si512(acc), m, _mm512_set1_epi32(-1)));
}
PE_INLINE int vf_any(pe_vf m) { return _mm512_movepi32_mask(_mm512_castps_si512(m)) != 0; }
/* the bf16 of even channels (high halves of `even`) and odd ones, interleaved again */
PE_INLINE pe_vi bf16_join(pe_vi even, pe_vi odd) {
    return _mm512_mask_blend_epi16((__mmask32)0xaaaaaaaau, _mm512_srli_epi32(even, 16), odd);
}
/* The word permutation that takes the high halves of the 16 fp32 lanes of a and then of b,
 * interleaved (a's lane i, b's lane i): the channel order of two pair-order vectors. */
static const uint16_t pe_high_words[32] = {1,  33, 3,  35, 5,  37, 7,  39, 9,  41, 11,
                                           43, 13, 45, 15, 47, 17, 49, 19, 51, 21, 53,
                                           23, 55, 25, 57, 27, 59, 29, 61, 31, 63};
#ifdef __AVX512BF16__
/*
 * bf16 rounding by the hardware (AVX512_BF16, the avx512bf16 variant).  vcvtne2ps2bf16
 * rounds to nearest even and keeps a NaN's sign and top payload bits with the quiet bit set,
 * as bf16_round_hi does, but takes an fp32 denormal as a zero of its sign (software keeps
 * it: a bf16 denormal, or 2^-126).  So a row whose values hold a denormal (bf16_any_zero,
 * then bf16_denormals) is rounded again in software.  pe_bf16_hw_exact (rope_avx512bf16.c)
 * checks the instruction against the software rounding before dispatch picks this variant.
 */
#define PE_BF16_HW 1
/* the pairs of bf16_join(bf16_round_hi(even), bf16_round_hi(odd)), unless a value is an
 * fp32 denormal: one conversion of both vectors (even in words 0-15, odd in 16-31) and one
 * word permutation back into channel pairs */
PE_INLINE pe_vi bf16_pairs_hw(pe_vf even, pe_vf odd) {
    static const uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i r = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    return _mm512_permutexvar_epi16(_mm512_loadu_si512((const void *)idx), r);
}
/* The words of r that are a bf16 zero of either sign, and whether r0 or r1 (bf16 the
 * hardware rounded) holds one: every fp32 denormal comes out as one and no fp32 normal
 * does (the smallest rounds to 2^-126), so values whose bf16 hold no zero held no
 * denormal.  One test per 32 values; only where a zero shows up does the class test per 16
 * (bf16_denormals) have to tell a denormal from a true zero. */
PE_INLINE __mmask32 bf16_zero_words(pe_vi r) {
    return _mm512_testn_epi16_mask(r, _mm512_set1_epi16(0x7fff));
}
PE_INLINE int bf16_any_zero(pe_vi r0, pe_vi r1) {
    return (bf16_zero_words(r0) | bf16_zero_words(r1)) != 0;
}
/* the lanes of a, b, c or d that hold an fp32 denormal, or-ed into acc */
PE_INLINE __mmask16 bf16_denormals(__mmask16 acc, pe_vf a, pe_vf b, pe_vf c, pe_vf d) {
    return acc | _mm512_fpclass_ps_mask(a, 0x20) | _mm512_fpclass_ps_mask(b, 0x20) |
           _mm512_fpclass_ps_mask(c, 0x20) | _mm512_fpclass_ps_mask(d, 0x20);
}
/*
 * Where no value the hardware rounds can be a denormal, its zero words need no test.  The
 * test needs a bound from below on the magnitudes: bf16_least_acc keeps, per word, the
 * least magnitude of the nonzero bf16 of the vectors u given it (a magnitude less one, so
 * that a zero, wrapping round to 0xffff, is the largest); bf16_least gives the least of them
 * all as fp32, +inf when every one was a zero of either sign.  A NaN's magnitude is above
 * every number's, so the bound holds for the numbers; a row of NaN gives a NaN.
 * Start acc at bf16_least_none().
 */
PE_INLINE pe_vi bf16_least_none(void) { return _mm512_set1_epi16(-1); }
PE_INLINE pe_vi bf16_least_acc(pe_vi acc, pe_vi u) {
    return _mm512_min_epu16(acc, _mm512_sub_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x7fff)),
                                                  _mm512_set1_epi16(1)));
}
PE_INLINE float bf16_least(pe_vi acc) {
    const __m256i m8 = _mm256_min_epu16(_mm512_castsi512_si256(acc),
                                        _mm512_extracti64x4_epi64(acc, 1));
    const __m128i m4 = _mm_min_epu16(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
    const uint32_t w = (uint32_t)_mm_cvtsi128_si32(_mm_minpos_epu16(m4)) & 0xffffu;
    return w == 0xffffu ? INFINITY : pe_bf16_to_f32((uint16_t)(w + 1));
}
/*
 * bf16 rows rotated by dot products of bf16 pairs (vdpbf16ps: lane i is a[2i] b[2i] +
 * a[2i+1] b[2i+1] in fp32, rounded once to nearest even).  Lane j of the pairs
 * (x[e+j], x[e+j+h]) of a row's two halves, with the table pairs (c[e+j], ss[e+j]), is the
 * rotated channel e+j; with (ss[e+j+h], c[e+j+h]) it is channel e+j+h.  One instruction
 * does vf_rot's two products and its sum, and the results come out in channel order.
 *
 * A product of two bf16 is exact in fp32, so the instruction's result is vf_rot's wherever
 * no denormal is met: it takes a denormal input as zero and flushes a denormal result.
 * The rows use it only with tables of bf16 values of magnitude at most 1 and no denormal
 * (bf16_dot_tables).  Then no product overflows, and a product that meets a denormal (a
 * denormal x, or an underflow) is below 2^-126 in magnitude in both computations.  Beside
 * the other product, if that one is 2^-65 or more, such a value moves nothing: the other
 * product is an fp32 value and half its ulp is above 2^-90.  So every result whose bf16
 * is finite and at least 2^-64 is vf_rot's, rounded as bf16_round_hi rounds it.  A row with
 * any other result (bf16_dot_good: zeros, smaller magnitudes, infinities, and NaN, whose
 * payloads the instruction may pass on otherwise: an infinity times zero beside a NaN) is
 * done again by the rows above.  pe_bf16_hw_exact checks the instruction's rounding before
 * dispatch picks the avx512bf16 variant.
 */
PE_INLINE int bf16_dot_tables(const float *v, int64_t n) {
    __m512i low = _mm512_setzero_si512(), top = _mm512_setzero_si512();
    __mmask16 denormal = 0;
    int64_t i = 0;
    for (; i < n % 16; ++i) {
        const uint32_t u = pe_f32_bits(v[i]) & 0x7fffffffu;
        if ((u & 0xffffu) || u > 0x3f800000u || (u && u < 0x800000u)) return 0;
    }
    for (; i < n; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(v + i));
        low = _mm512_or_si512(low, u);
        top = _mm512_max_epu32(top, _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)));
        denormal |= _mm512_fpclass_ps_mask(_mm512_castsi512_ps(u), 0x20);
    }
    return !_mm512_test_epi32_mask(low, _mm512_set1_epi32(0xffff)) && !denormal &&
           !_mm512_cmpgt_epu32_mask(top, _mm512_set1_epi32(0x3f800000)); /* 1.0f */
}
/* the interleave of the first 16 words of a and b (a first), and of the last 16 */
PE_INLINE void bf16_word_pairs(pe_vi a, pe_vi b, pe_vi *lo, pe_vi *hi) {
    static const uint16_t il[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i i0 = _mm512_loadu_si512((const void *)il);
    *lo = _mm512_permutex2var_epi16(a, i0, b);
    *hi = _mm512_permutex2var_epi16(a, _mm512_add_epi16(i0, _mm512_set1_epi16(16)), b);
}
/* The table pairs (t0[ch], t1[ch]) of a block's 32 channels (0-15 in *lo, 16-31 in *hi),
 * from the bf16 values of t0 and t1 in pair order (their fp32 high halves). */
PE_INLINE void bf16_dot_pairs(const float *t0, const float *t1, pe_vi *lo, pe_vi *hi) {
    const __m512i ic = _mm512_loadu_si512((const void *)pe_high_words);
    const __m512i w0 = _mm512_permutex2var_epi16(vi_load((const char *)t0), ic,
                                                 vi_load((const char *)(t0 + 16)));
    const __m512i w1 = _mm512_permutex2var_epi16(vi_load((const char *)t1), ic,
                                                 vi_load((const char *)(t1 + 16)));
    bf16_word_pairs(w0, w1, lo, hi);
}
/* The rotated bf16 of a block of 32 channels in each half, in channel order: u0, u1 the
 * halves' input words; a the table pairs (c, ss) of the first half, b (ss, c) of the
 * second, each as from bf16_dot_pairs. */
PE_INLINE void bf16_dot_block(pe_vi u0, pe_vi u1, const pe_vi a[2], const pe_vi b[2],
                              pe_vi *r0, pe_vi *r1) {
    pe_vi p0, p1;
    bf16_word_pairs(u0, u1, &p0, &p1);
    const __m512 z = _mm512_setzero_ps();
    const __m512bh x0 = (__m512bh)p0, x1 = (__m512bh)p1;
    *r0 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_dpbf16_ps(z, x1, (__m512bh)a[1]),
                                       _mm512_dpbf16_ps(z, x0, (__m512bh)a[0]));
    *r1 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_dpbf16_ps(z, x1, (__m512bh)b[1]),
                                       _mm512_dpbf16_ps(z, x0, (__m512bh)b[0]));
}
/* good, less the words of r outside what bf16_dot_block answers for: exponent below 63
 * (zeros and magnitudes under 2^-64) or all ones (infinities, NaN).  One more on the
 * exponent takes both below 64, the two top exponent bits clear; one test per 32 values,
 * masked by good, so a row's words are and-ed together with no other instruction. */
PE_INLINE __mmask32 bf16_dot_good(__mmask32 good, pe_vi r) {
    return _mm512_mask_test_epi16_mask(good, _mm512_add_epi16(r, _mm512_set1_epi16(0x80)),
                                       _mm512_set1_epi16(0x6000));
}
/* n fp32 values at src rounded to bf16 by the hardware, 16 at a time (n a multiple of 16) */
PE_INLINE void bf16_round_hw_row(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
}
#endif
/* bf16_join(bf16_round_num(even), bf16_round_num(odd)) in the 16-bit words: the pairs of
 * high halves (truncated bf16) and of low halves L, then +1 where L + (the truncated bf16's
 * last bit) > 0x8000, which is where the 32-bit sum u + 0x7fff + that bit carries into the
 * high half (a saturating add: L + 1 past 0xffff stays above 0x8000). */
PE_INLINE pe_vi bf16_pairs_num(pe_vf even, pe_vf odd) {
    const __m512i ih = _mm512_loadu_si512((const void *)pe_high_words);
    const __m512i il = _mm512_sub_epi16(ih, _mm512_set1_epi16(1));
    const __m512i e = _mm512_castps_si512(even), o = _mm512_castps_si512(odd);
    const __m512i t = _mm512_permutex2var_epi16(e, ih, o), l = _mm512_permutex2var_epi16(e, il, o);
    const __m512i lsb = _mm512_and_si512(t, _mm512_set1_epi16(1));
    const __mmask32 up = _mm512_cmpgt_epu16_mask(_mm512_adds_epu16(l, lsb),
                                                 _mm512_set1_epi16((short)0x8000));
    return _mm512_mask_sub_epi16(t, up, t, _mm512_set1_epi16(-1));
}
/* The first n < 16 lanes, for row tails (head_dim 80: 40 = 2 x 16 + 8). */
#define PE_VTAIL 1
PE_INLINE pe_vf vf_load_n(const float *p, int64_t n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
PE_INLINE pe_vf vx_load_n(const char *p, pe_dtype dt, int64_t n) {
    const __mmask16 m = (__mmask16)((1u << n) - 1);
    if (dt == PE_FLOAT32) return _mm512_maskz_loadu_ps(m, (const float *)p);
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (dt == PE_FLOAT16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PE_INLINE void vx_store_n(char *p, pe_vf v, pe_dtype dt, int64_t n) {
    const __mmask16 m = (__mmask16)((1u << n) - 1);
    if (dt == PE_FLOAT32) {
        _mm512_mask_storeu_ps((float *)p, m, v);
        return;
    }
    char tmp[32];
    vx_store(tmp, v, dt);
    _mm256_mask_storeu_epi16(p, m, _mm256_loadu_si256((const __m256i *)tmp));
}
#elif defined(__AVX2__) && defined(__F16C__)
#define PE_VW 8
typedef __m256 pe_vf;
PE_INLINE pe_vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
PE_INLINE pe_vf vf_zero(void) { return _mm256_setzero_ps(); }
PE_INLINE pe_vf vf_set1(float v) { return _mm256_set1_ps(v); }
PE_INLINE pe_vf vf_add(pe_vf a, pe_vf b) { return _mm256_add_ps(a, b); }
PE_INLINE pe_vf vf_sub(pe_vf a, pe_vf b) { return _mm256_sub_ps(a, b); }
PE_INLINE pe_vf vf_mul(pe_vf a, pe_vf b) { return _mm256_mul_ps(a, b); }
PE_INLINE pe_vf vf_neg(pe_vf a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
PE_INLINE pe_vf vf_and(pe_vf m, pe_vf a) { return _mm256_and_ps(m, a); }
PE_INLINE pe_vf vf_or(pe_vf a, pe_vf b) { return _mm256_or_ps(a, b); }
PE_INLINE pe_vf vf_andnot(pe_vf m, pe_vf a) { return _mm256_andnot_ps(m, a); }
PE_INLINE pe_vf vf_select(pe_vf a, pe_vf b, pe_vf m) { return _mm256_blendv_ps(a, b, m); }
PE_INLINE pe_vf vf_rot(pe_vf a, pe_vf ca, pe_vf b, pe_vf sb) {
    return _mm256_add_ps(_mm256_mul_ps(a, ca), _mm256_mul_ps(b, sb));
}
PE_INLINE pe_vf vx_load(const char *p, pe_dtype dt) {
    if (dt == PE_FLOAT32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == PE_FLOAT16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
PE_INLINE void vx_store16(char *p, __m128i v) { _mm_storeu_si128((__m128i *)p, v); }
PE_INLINE void vx_store(char *p, pe_vf v, pe_dtype dt) {
    if (dt == PE_FLOAT32) {
        _mm256_storeu_ps((float *)p, v);
    } else if (dt == PE_FLOAT16) {
        vx_store16(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    } else { /* bf16, as above; packus keeps the 16-bit results, permute joins the lanes */
        const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
        const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
        r = _mm256_srli_epi32(r, 16);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)),
                               _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
        vx_store16(p, _mm256_castsi256_si128(r));
    }
}
typedef __m256i pe_vi;
PE_INLINE pe_vi vi_load(const char *p) { return _mm256_loadu_si256((const __m256i *)p); }
PE_INLINE void vi_store(char *p, pe_vi v) { _mm256_storeu_si256((__m256i *)p, v); }
PE_INLINE void vi_stream(char *p, pe_vi v) { _mm256_stream_si256((__m256i *)p, v); }
PE_INLINE void vx_stream(char *p, pe_vf v, pe_dtype dt) {
    if (dt == PE_FLOAT32) _mm256_stream_ps((float *)p, v);
    else if (dt == PE_FLOAT16)
        _mm_stream_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else vx_store(p, v, dt);
}
PE_INLINE pe_vf bf16_even(pe_vi u) { return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)); }
PE_INLINE pe_vf bf16_odd(pe_vi u) {
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}
PE_INLINE pe_vi bf16_round_num(pe_vf v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
}
PE_INLINE pe_vi bf16_round_hi(pe_vf v) {
    const __m256i u = _mm256_castps_si256(v);
    return _mm256_blendv_epi8(bf16_round_num(v), _mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                              _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
PE_INLINE pe_vf vf_nan_lanes(pe_vf acc, pe_vf a, pe_vf b, pe_vf c, pe_vf d) {
    return _mm256_or_ps(acc, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                          _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
}
PE_INLINE int vf_any(pe_vf m) { return !_mm256_testz_ps(m, m); }
PE_INLINE pe_vi bf16_join(pe_vi even, pe_vi odd) {
    return _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xaa);
}
/* bf16_pairs_num of the AVX-512 rows with AVX2's 16-bit operations: two blends give the
 * pairs of high halves t and of low halves L, and t + 1 where L + (t's last bit) > 0x8000,
 * compared as signed words: (L ^ 0x8000) + that bit > 0 (a saturating add, so 0x7fff + 1
 * stays above 0).  9 operations per 16 values, against 10 for bf16_join of two
 * bf16_round_num. */
PE_INLINE pe_vi bf16_pairs_num(pe_vf even, pe_vf odd) {
    const __m256i e = _mm256_castps_si256(even), o = _mm256_castps_si256(odd);
    const __m256i t = _mm256_blend_epi16(_mm256_srli_epi32(e, 16), o, 0xaa);
    const __m256i l = _mm256_blend_epi16(e, _mm256_slli_epi32(o, 16), 0xaa);
    const __m256i lsb = _mm256_and_si256(t, _mm256_set1_epi16(1));
    const __m256i above = _mm256_adds_epi16(
        _mm256_xor_si256(l, _mm256_set1_epi16((short)0x8000)), lsb);
    return _mm256_sub_epi16(t, _mm256_cmpgt_epi16(above, _mm256_setzero_si256()));
}
#endif

#ifdef PE_VW
/*
 * bf16 rows a block of PE_BF16_BLOCK channels at a time, without widening or narrowing
 * shuffles: the block's 32-bit words are channel pairs, a shift gives the even channels as
 * fp32 and a mask the odd ones, and after rounding a 16-bit blend puts the pairs back.  The
 * tables of such rows are in "pair order" (pair_order_blocks below): per block, the values of its
 * even channels, then those of its odd channels.
 */
#define PE_BF16_BLOCK (2 * PE_VW)

/* The even and the odd lanes of the 2 PE_VW values in a, b (a first). */
PE_INLINE void vf_deinterleave(pe_vf a, pe_vf b, pe_vf *even, pe_vf *odd) {
#if PE_VW == 16
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, io, b);
#else
    *even = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xd8));
    *odd = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xdd)), 0xd8));
#endif
}

/* The inverse of vf_deinterleave: the 2 PE_VW values whose even lanes are `even` and odd
 * lanes `odd`, the first PE_VW in *lo. */
PE_INLINE void vf_interleave(pe_vf even, pe_vf odd, pe_vf *lo, pe_vf *hi) {
#if PE_VW == 16
    const __m512i il = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i ih = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    *lo = _mm512_permutex2var_ps(even, il, odd);
    *hi = _mm512_permutex2var_ps(even, ih, odd);
#else
    const __m256 l = _mm256_unpacklo_ps(even, odd), h = _mm256_unpackhi_ps(even, odd);
    *lo = _mm256_permute2f128_ps(l, h, 0x20);
    *hi = _mm256_permute2f128_ps(l, h, 0x31);
#endif
}

/* n fp32 values (a multiple of PE_BF16_BLOCK) from channel order into pair order. */
PE_INLINE void pair_order_blocks(float *restrict dst, const float *restrict src, int64_t n) {
    for (int64_t b = 0; b < n; b += PE_BF16_BLOCK) {
        pe_vf even, odd;
        vf_deinterleave(vf_load(src + b), vf_load(src + b + PE_VW), &even, &odd);
        vx_store((char *)(dst + b), even, PE_FLOAT32);
        vx_store((char *)(dst + b + PE_VW), odd, PE_FLOAT32);
    }
}
#endif

/* Whether any of the n floats at v is a NaN. */
PE_INLINE int any_nan(const float *v, int64_t n) {
    int64_t i = 0;
#ifdef PE_VW
    pe_vf acc = vf_zero();
    for (; i + 4 * PE_VW <= n; i += 4 * PE_VW)
        acc = vf_nan_lanes(acc, vf_load(v + i), vf_load(v + i + PE_VW),
                           vf_load(v + i + 2 * PE_VW), vf_load(v + i + 3 * PE_VW));
    if (vf_any(acc)) return 1;
#endif
    for (; i < n; ++i)
        if (v[i] != v[i]) return 1;
    return 0;
}

PE_INLINE float sx_load(const char *p, pe_dtype dt) {
    if (dt == PE_FLOAT32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return dt == PE_FLOAT16 ? pe_f16_to_f32(h) : pe_bf16_to_f32(h);
}

PE_INLINE void sx_store(char *p, float v, pe_dtype dt) {
    if (dt == PE_FLOAT32) {
        memcpy(p, &v, 4);
        return;
    }
    const uint16_t h = dt == PE_FLOAT16 ? pe_f32_to_f16(v) : pe_f32_to_bf16(v);
    memcpy(p, &h, 2);
}

/* n values of a 16-bit or fp32 dtype as fp32, a vector at a time (short MRoPE runs too). */
PE_INLINE void to_f32_row(float *restrict dst, const char *restrict src, int64_t n, pe_dtype dt) {
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2;
    int64_t i = 0;
#ifdef PE_VW
    for (; i + PE_VW <= n; i += PE_VW)
        vx_store((char *)(dst + i), vx_load(src + i * es, dt), PE_FLOAT32);
#endif
    for (; i < n; ++i) dst[i] = sx_load(src + i * es, dt);
}

/* n fp32 values stored as a 16-bit or fp32 dtype, a vector at a time. */
PE_INLINE void from_f32_row(char *restrict dst, const float *restrict src, int64_t n,
                            pe_dtype dt) {
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2;
    int64_t i = 0;
#ifdef PE_VW
    for (; i + PE_VW <= n; i += PE_VW) vx_store(dst + i * es, vf_load(src + i), dt);
#endif
    for (; i < n; ++i) sx_store(dst + i * es, src[i], dt);
}

/* n values of dtype dt (fp32 or 16-bit) as fp32. */
PE_INLINE void load_row(float *restrict dst, const void *restrict src, pe_dtype dt, int64_t n) {
    const char *s = (const char *)src;
    switch (dt) {
    case PE_FLOAT32: to_f32_row(dst, s, n, PE_FLOAT32); break;
    case PE_BFLOAT16: to_f32_row(dst, s, n, PE_BFLOAT16); break;
    default: to_f32_row(dst, s, n, PE_FLOAT16); break;
    }
}

/* n fp32 values stored as dtype dt, one rounding each (fp64: the tables from positions). */
PE_INLINE void store_row(void *restrict dst, const float *restrict src, pe_dtype dt, int64_t n) {
    char *d = (char *)dst;
    switch (dt) {
    case PE_FLOAT64:
        for (int64_t i = 0; i < n; ++i) {
            const double v = src[i];
            memcpy(d + i * 8, &v, 8);
        }
        break;
    case PE_FLOAT32: from_f32_row(d, src, n, PE_FLOAT32); break;
    case PE_BFLOAT16: from_f32_row(d, src, n, PE_BFLOAT16); break;
    default: from_f32_row(d, src, n, PE_FLOAT16); break;
    }
}

#endif /* POSENC_SIMD_H */

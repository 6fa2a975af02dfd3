/*
 * The fp32 core of the fused per-head RMSNorm + RoPE (posenc.h, pe_qk_norm_rope) for fp32 /
 * bf16 / fp16 tensors: the forward of tokens i0 .. i0+n-1, and the backward of rows r0 ..
 * r1-1 in the order of autograd's weight-gradient product, whose products go into block
 * sums (qk_norm.c adds those up in torch's order).  Compiled once per instruction set into
 * qk_norm_<isa>.c (the vector width of the loads, stores and of the compiler's vectorized
 * loops); the arithmetic is the same in every variant because each loop is element-wise or
 * keeps torch's own lanes (qk_sum_f32), and nothing is fused (-ffp-contract=off).
 * qk_norm.c runs the tiles and row blocks over threads.
 */
#ifndef POSENC_QK_NORM_F32_H
#define POSENC_QK_NORM_F32_H

#include <math.h>

#include "simd.h"

/* v rounded to dt and back (the identity for fp32): where transformers' norm rounds. */
PE_INLINE float qk_round(float v, pe_dtype dt) {
    if (dt == PE_BFLOAT16) return pe_bf16_to_f32(pe_f32_to_bf16(v));
    if (dt == PE_FLOAT16) return pe_f16_to_f32(pe_f32_to_f16(v));
    return v;
}

/*
 * How the bf16 pair rows round (their argument hw): in software (0); by the hardware, the
 * lanes that held an fp32 denormal (which it takes as zero) or-ed into *den, looked for
 * only where a rounded block holds a zero (QK_HW); or by the hardware without that test
 * (QK_HW_NORMAL), where qk_no_denormal showed that no value rounded can be a denormal.
 */
enum { QK_HW = 1, QK_HW_NORMAL = 2 };

/*
 * Whether no value the forward of a bf16 pair row (qk_forward_out_pairs) rounds can be an
 * fp32 denormal, from bounds from below on the nonzero magnitudes: X of the row's x (least),
 * its r, and bound = min(1, W) min(1, C), W the least of the weights as qk_scale_pairs takes
 * them, C the least of the token's cos and sin values (qk_least_nonzero).  A rounded value
 * that is a number and not zero is then at least
 *  - n = x r: X r, less a rounding;
 *  - y = n v (n rounded to bf16 first in the weight form): X r W, less two;
 *  - a rotated y0 c + y1 s (y rounded to bf16; c, s bf16): a product of two bf16 is exact
 *    and a whole multiple of a power of two above 2^-16 of its magnitude, so a sum that is
 *    not zero is at least 2^-16 of the lesser product that is not: X r W C 2^-16, less
 *    three roundings.
 * A rounding takes off less than 2^-8 of a magnitude, so X r bound >= 2^-90 (a double: no
 * product underflows) leaves each at least 2^-107, a normal.  A NaN, zero or infinite
 * factor: NaN and 0 fail (those rows are tested); an infinite r gives infinities and NaN,
 * and an infinite X (a row of zeros) zeros, or NaN with an infinite r.
 */
PE_INLINE int qk_no_denormal(float least, float r, double bound) {
    return (double)least * (double)r * bound >= 0x1p-90;
}

/* The least magnitude of the nonzero values among n floats (NaN passed over), +inf if none */
PE_INLINE float qk_least_nonzero(const float *v, int64_t n) {
    float m = INFINITY;
    int64_t i = 0;
#ifdef PE_BF16_HW
    __m512 mv = _mm512_set1_ps(INFINITY);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_abs_ps(_mm512_loadu_ps(v + i));
        const __mmask16 k = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_OQ);
        mv = _mm512_mask_min_ps(mv, k, x, mv);
    }
    m = _mm512_reduce_min_ps(mv);
#endif
    for (; i < n; ++i) {
        const float x = fabsf(v[i]);
        m = x != 0.0f && x < m ? x : m;
    }
    return m;
}

/* torch's utils::CeilLog2 */
static inline int64_t qk_ceil_log2(int64_t x) {
    return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1));
}

/* Asks for the `bytes` at p, for reading or for writing. */
PE_INLINE void qk_prefetch_row(const char *p, int64_t bytes, int write) {
    for (int64_t o = 0; o < bytes; o += 64) {
        if (write) __builtin_prefetch(p + o, 1, 3);
        else __builtin_prefetch(p + o, 0, 3);
    }
}

/*
 * The sum of v[0..n-1] as torch's cascade_sum adds a contiguous row (SumKernel.cpp:
 * vectorized_inner_sum -> row_sum -> multi_row_sum, 4 accumulators, 4 cascade levels) with
 * vectors of W lanes; the order is spelled out in posenc.h.  Inlined with W constant, the
 * lane loops vectorize without changing the order.
 */
PE_INLINE float qk_sum_f32(const float *restrict v, int64_t n, int W) {
    if (n < W) W = 1;
    const int64_t nvec = n / W, groups = nvec / 4;
    float acc[4][4][16] = {{{0}}}; /* level, accumulator, lane */
    const int64_t lp = qk_ceil_log2(groups) / 4 > 4 ? qk_ceil_log2(groups) / 4 : 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    int64_t i = 0;
    while (i + step <= groups) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l) acc[0][k][l] += v[(4 * i + k) * W + l];
        for (int j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; ++k)
                for (int l = 0; l < W; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if (i & (mask << (j * lp))) break;
        }
    }
    for (; i < groups; ++i)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < W; ++l) acc[0][k][l] += v[(4 * i + k) * W + l];
    for (int j = 1; j < 4; ++j)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
    for (int64_t r = 4 * groups; r < nvec; ++r) /* vectors left over: accumulator 0 */
        for (int l = 0; l < W; ++l) acc[0][0][l] += v[r * W + l];
    for (int k = 1; k < 4; ++k)
        for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
    float s = 0.0f;
    for (int64_t e = nvec * W; e < n; ++e) s += v[e];
    if (W == 1) return acc[0][0][0]; /* scalar_inner_sum: the row sum itself */
    for (int l = 0; l < W; ++l) s += acc[0][0][l];
    return s;
}

#ifdef __AVX2__
/* qk_sum_f32 for W = 8, n a multiple of 8 and fewer than 64 vectors (no cascade carry), in
 * registers: the same additions in the same order (the accumulators start from +0 and get
 * the joined levels' +0 added, as torch's do, which turns a -0 into +0). */
/* The end of qk_sum8_f32 (a0 already given its +0 and the vectors left over): the other
 * accumulators' +0, ((a0 + a1) + a2) + a3, then the lanes in order from 0. */
PE_INLINE __m256 qk_sum8_vec(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 zero = _mm256_setzero_ps();
    a1 = _mm256_add_ps(a1, zero);
    a2 = _mm256_add_ps(a2, zero);
    a3 = _mm256_add_ps(a3, zero);
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), a2), a3);
}

PE_INLINE float qk_sum8_join(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    float lane[8];
    _mm256_storeu_ps(lane, qk_sum8_vec(a0, a1, a2, a3));
    float s = 0.0f;
    for (int l = 0; l < 8; ++l) s += lane[l];
    return s;
}

PE_INLINE float qk_sum8_f32(const float *restrict v, int64_t n) {
    const int64_t nvec = n / 8, groups = nvec / 4;
    const __m256 zero = _mm256_setzero_ps();
    __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero;
    for (int64_t i = 0; i < groups; ++i) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(v + 32 * i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(v + 32 * i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(v + 32 * i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(v + 32 * i + 24));
    }
    a0 = _mm256_add_ps(a0, zero);
    for (int64_t r = 4 * groups; r < nvec; ++r) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(v + 8 * r));
    return qk_sum8_join(a0, a1, a2, a3);
}
#endif

PE_INLINE float qk_sum_lanes_f32(const float *restrict v, int64_t n, int W) {
#ifdef __AVX2__
    if (W == 8 && n % 8 == 0 && n < 8 * 64) return qk_sum8_f32(v, n);
#endif
    switch (W) { /* a constant width per call site, for the vectorizer */
    case 8: return qk_sum_f32(v, n, 8);
    case 16: return qk_sum_f32(v, n, 16);
    case 4: return qk_sum_f32(v, n, 4);
    default: return qk_sum_f32(v, n, 1);
    }
}

/* The cos row c of token (b, t) and the signed sine ss of the forward (sign(e) s[e]) or of
 * the transpose (-sign(e) s[p(e)]); s is scratch. */
PE_INLINE void qk_tables_f32(const pe_qk_norm_args *a, int64_t b, int64_t t, int transpose,
                             float *restrict c, float *restrict ss, float *restrict s) {
    const int64_t R = a->rot_dim, h = R / 2;
    const int64_t off = ((a->table_batch == 1 ? 0 : b) * a->table_stride[0] +
                         t * a->table_stride[1]) * (int64_t)pe_dtype_size(a->dtype);
    load_row(c, (const char *)a->cos + off, a->dtype, R);
    load_row(s, (const char *)a->sin + off, a->dtype, R);
    if (a->pairing == PE_PAIR_HALF) {
        for (int64_t e = 0; e < h; ++e) ss[e] = transpose ? s[e + h] : -s[e];
        for (int64_t e = h; e < R; ++e) ss[e] = transpose ? -s[e - h] : s[e];
    } else {
        for (int64_t e = 0; e < R; e += 2) {
            ss[e] = transpose ? s[e + 1] : -s[e];
            ss[e + 1] = transpose ? -s[e] : s[e + 1];
        }
    }
}

/* o = the rotation of x (forward or transpose, by ss) on the R rotary channels, x past R. */
PE_INLINE void qk_rotate_f32(const float *restrict x, float *restrict o, const float *restrict c,
                             const float *restrict ss, int64_t R, int64_t D, pe_pairing p) {
    if (p == PE_PAIR_HALF) {
        const int64_t h = R / 2;
        for (int64_t e = 0; e < h; ++e) o[e] = pe_rot_f32(x[e], c[e], x[e + h], ss[e]);
        for (int64_t e = h; e < R; ++e) o[e] = pe_rot_f32(x[e], c[e], x[e - h], ss[e]);
    } else {
        for (int64_t e = 0; e < R; e += 2) {
            o[e] = pe_rot_f32(x[e], c[e], x[e + 1], ss[e]);
            o[e + 1] = pe_rot_f32(x[e + 1], c[e + 1], x[e], ss[e + 1]);
        }
    }
    for (int64_t e = R; e < D; ++e) o[e] = x[e];
}

#ifdef PE_VW
/*
 * v rounded to dt and back, a vector at a time, in registers: the bits of vx_store then
 * vx_load (bf16: bf16_round_hi keeps the rounded value, NaN quieted, in the high halves).
 * hw (the avx512bf16 variant, bf16 only): rounded by the hardware, which takes an fp32
 * denormal as zero where software keeps it, so the lanes holding one are or-ed into *den
 * and the caller does the row again in software (hw = 0) when *den is set.
 */
PE_INLINE pe_vf vf_round(pe_vf v, pe_dtype dt, int hw, unsigned *den) {
    if (dt == PE_FLOAT32) return v;
    if (dt == PE_BFLOAT16) {
#ifdef PE_BF16_HW
        if (hw) {
            *den |= _mm512_fpclass_ps_mask(v, 0x20);
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
#endif
        return bf16_odd(bf16_round_hi(v));
    }
#if PE_VW == 16
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#else
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#endif
}

/* vx_store, with vf_round's hardware bf16 rounding when hw, and as a streaming store when
 * stream (p aligned to the store's width; bf16 rounded in software stores plainly, as
 * vx_stream does) */
PE_INLINE void qk_store(char *p, pe_vf v, pe_dtype dt, int hw, unsigned *den, int stream) {
#ifdef PE_BF16_HW
    if (hw && dt == PE_BFLOAT16) {
        *den |= _mm512_fpclass_ps_mask(v, 0x20);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        if (stream) _mm256_stream_si256((__m256i *)p, h);
        else _mm256_storeu_si256((__m256i *)p, h);
        return;
    }
#endif
    if (stream) vx_stream(p, v, dt);
    else vx_store(p, v, dt);
}

/* One normalized and weighted vector (qk_scale_row's arithmetic) before its last rounding to
 * dt, which every form ends with; w holds 1 + w for one_plus_weight (the same fp32 sum, made
 * once per tile).  A channel past the rotary stores this as it is: rounding an already
 * rounded value changes no bit, so the store's rounding is the only one needed. */
PE_INLINE pe_vf qk_scale_unrounded(pe_vf x, pe_vf w, pe_vf r, pe_norm_form form, pe_dtype dt,
                                   int hw, unsigned *den) {
    const pe_vf n = vf_mul(x, r);
    if (form == PE_NORM_WEIGHT) return vf_mul(w, vf_round(n, dt, hw, den));
    if (form == PE_NORM_ONE_PLUS_WEIGHT) return vf_mul(n, w);
    return vf_mul(w, n);
}

/* qk_scale_unrounded rounded to dt: the normalized row as the rotary reads it */
PE_INLINE pe_vf qk_scale_vec(pe_vf x, pe_vf w, pe_vf r, pe_norm_form form, pe_dtype dt, int hw,
                             unsigned *den) {
    return vf_round(qk_scale_unrounded(x, w, r, form, dt, hw, den), dt, hw, den);
}
#endif

/* y = the normalized and weighted row (the form's roundings), a vector at a time. */
PE_INLINE void qk_scale_row(float *restrict y, const float *restrict x, const float *restrict w,
                            float r, int64_t D, pe_norm_form form, pe_dtype dt) {
    int64_t e = 0;
#ifdef PE_VW
    const pe_vf rr = vf_set1(r), one = vf_set1(1.0f);
    unsigned den = 0; /* (software rounding) */
    for (; e + PE_VW <= D; e += PE_VW) {
        const pe_vf n = vf_mul(vf_load(x + e), rr), wv = vf_load(w + e);
        pe_vf out;
        if (form == PE_NORM_WEIGHT)
            out = vf_round(vf_mul(wv, vf_round(n, dt, 0, &den)), dt, 0, &den);
        else if (form == PE_NORM_ONE_PLUS_WEIGHT)
            out = vf_round(vf_mul(n, vf_add(one, wv)), dt, 0, &den);
        else out = vf_round(vf_mul(wv, n), dt, 0, &den);
        vx_store((char *)(y + e), out, PE_FLOAT32);
    }
#endif
    for (; e < D; ++e) {
        if (form == PE_NORM_WEIGHT) y[e] = qk_round(w[e] * qk_round(x[e] * r, dt), dt);
        else if (form == PE_NORM_ONE_PLUS_WEIGHT) y[e] = qk_round(x[e] * r * (1.0f + w[e]), dt);
        else y[e] = qk_round(w[e] * (x[e] * r), dt);
    }
}

/* The gradient of the mean of squares from gr = dL/dr (the row sum of gn x): rsqrt's
 * backward, or pow's with torch's own P = ms^-1.5 (PE_NORM_POW). */
PE_INLINE float qk_grad_ms(pe_norm_form form, float gr, float r, float p) {
    return form == PE_NORM_POW ? gr * (-0.5f * p) : (-0.5f * gr) * ((r * r) * r);
}

/* Scratch rows of one thread (fp32): the two weights, cos, signed sine, sine, five rows,
 * the two weights as qk_scale_vec takes them (1 + w for one_plus_weight, else w), for the
 * bf16 pair rows (qk_forward_out_pairs, qk_backward_in_pairs) those two weights, cos and the
 * signed sine in pair order, and the 8 gn rows of qk_backward_rows8. */
typedef struct qk_rows_f32 {
    float *w[2], *c, *ss, *s, *x, *t, *y, *o, *g, *v[2];
    float *vp[2], *cp, *ssp, *rows8;
    int stream; /* the vector stores of dx or of the current tensor's output stream
                 * (pe_qk_plan) */
#ifdef PE_BF16_HW
    const pe_vi *dot; /* the forward's token tables for bf16_dot_block (qk_dot_tables), or
                       * NULL */
#endif
} qk_rows_f32;

PE_INLINE void qk_forward_row(const pe_qk_norm_args *a, pe_dtype dt, const float *restrict w,
                              const char *xr, char *orow, float *rstd, qk_rows_f32 *m) {
    const int64_t D = a->head_dim;
    float *restrict x = m->x, *restrict t = m->t, *restrict y = m->y;
    load_row(x, xr, dt, D);
    for (int64_t e = 0; e < D; ++e) t[e] = x[e] * x[e];
    const float ms = qk_sum_lanes_f32(t, D, a->sum_lanes) / (float)D + (float)a->eps;
    const float r = 1.0f / sqrtf(ms);
    *rstd = a->form == PE_NORM_POW ? ms : r;
    qk_scale_row(y, x, w, r, D, a->form, dt);
    qk_rotate_f32(y, m->o, m->c, m->ss, a->rot_dim, D, a->pairing);
    store_row(orow, m->o, dt, D);
}

/* The backward of one row (dx stored in dt); the weight-gradient products are left in m->g
 * (rounded where autograd rounds them).  m->c, m->ss hold the token's transpose tables. */
PE_INLINE void qk_backward_row(const pe_qk_norm_args *a, pe_dtype dt, const float *restrict w,
                               const char *xr, const char *grow, char *dxrow, float r, float p,
                               qk_rows_f32 *m) {
    const int64_t D = a->head_dim;
    const pe_norm_form form = a->form;
    float *restrict x = m->x, *restrict t = m->t, *restrict gy = m->y, *restrict gn = m->o;
    float *restrict wp = m->g;
    load_row(m->g, grow, dt, D);
    qk_rotate_f32(m->g, gy, m->c, m->ss, a->rot_dim, D, a->pairing);
    load_row(x, xr, dt, D);
    int64_t e = 0;
#ifdef PE_VW
    const pe_vf rr = vf_set1(r), one = vf_set1(1.0f);
    for (; e + PE_VW <= D; e += PE_VW) {
        unsigned den = 0; /* (software rounding) */
        const pe_vf g = vf_round(vf_load(gy + e), dt, 0, &den), xv = vf_load(x + e);
        const pe_vf wv = vf_load(w + e), n = vf_mul(xv, rr);
        pe_vf gv, pv;
        if (form == PE_NORM_WEIGHT) {
            gv = vf_round(vf_mul(g, wv), dt, 0, &den);
            pv = vf_round(vf_mul(g, vf_round(n, dt, 0, &den)), dt, 0, &den);
        } else {
            gv = vf_mul(g, form == PE_NORM_ONE_PLUS_WEIGHT ? vf_add(one, wv) : wv);
            pv = vf_mul(g, n);
        }
        vx_store((char *)(gn + e), gv, PE_FLOAT32);
        vx_store((char *)(wp + e), pv, PE_FLOAT32);
        vx_store((char *)(t + e), vf_mul(gv, xv), PE_FLOAT32);
    }
#endif
    for (; e < D; ++e) {
        const float g = qk_round(gy[e], dt), n = x[e] * r;
        if (form == PE_NORM_WEIGHT) {
            gn[e] = qk_round(g * w[e], dt);
            wp[e] = qk_round(g * qk_round(n, dt), dt);
        } else {
            gn[e] = g * (form == PE_NORM_ONE_PLUS_WEIGHT ? 1.0f + w[e] : w[e]);
            wp[e] = g * n;
        }
        t[e] = gn[e] * x[e];
    }
    const float gx2 = qk_grad_ms(form, qk_sum_lanes_f32(t, D, a->sum_lanes), r, p) / (float)D;
    e = 0;
#ifdef PE_VW
    const pe_vf g2 = vf_set1(gx2), two = vf_set1(2.0f);
    for (; e + PE_VW <= D; e += PE_VW)
        vx_store((char *)(t + e),
                 vf_add(vf_mul(vf_load(gn + e), rr), vf_mul(g2, vf_mul(two, vf_load(x + e)))),
                 PE_FLOAT32);
#endif
    for (; e < D; ++e) t[e] = gn[e] * r + gx2 * (2.0f * x[e]);
    store_row(dxrow, t, dt, D);
}

#ifdef PE_VW
/*
 * The rows of the common shapes (half pairing, R a multiple of 2 PE_VW, D of PE_VW) with
 * fewer passes and no fp32 round trips through scratch: the same operations on the same
 * values as qk_forward_row / qk_backward_row, so the same bits.
 *
 * Forward: the row as fp32 and its squares into scratch (L1) for torch's sum, then each
 * pair of vectors (e, e + R/2) normalized, weighted, rotated and stored in q's dtype.
 */
/* Whether a row's sum of squares is qk_sum8_f32's case (8 lanes, no cascade carry, whole
 * groups of 4 vectors), which qk_sq8_row computes in registers. */
PE_INLINE int qk_sum8_case(const pe_qk_norm_args *a) {
    return a->sum_lanes == 8 && a->head_dim % 32 == 0 && a->head_dim < 8 * 64;
}

/* qk_sum8_f32's four accumulators, kept as vectors (AVX2: acc[0 .. 3]; AVX-512: the low
 * and high halves of acc[0] are accumulators 0 and 1, those of acc[1] are 2 and 3), up to
 * the lanes (qk_sum8_vec), a0's +0 included.  8-lane vector i of a row adds into
 * accumulator i % 4, so PE_VW-lane vector i into acc[i % (32 / PE_VW)]. */
PE_INLINE __m256 qk_acc_lanes(const pe_vf *acc) {
#if PE_VW == 8
    return qk_sum8_vec(vf_add(acc[0], vf_zero()), acc[1], acc[2], acc[3]);
#else
    return qk_sum8_vec(_mm256_add_ps(_mm512_castps512_ps256(acc[0]), _mm256_setzero_ps()),
                       _mm512_extractf32x8_ps(acc[0], 1), _mm512_castps512_ps256(acc[1]),
                       _mm512_extractf32x8_ps(acc[1], 1));
#endif
}

/* qk_sum8_f32's additions of the squares of row xr (as fp32) in registers, up to the lanes
 * (qk_acc_lanes). */
PE_INLINE __m256 qk_sq8_row(const char *xr, int64_t D, pe_dtype dt) {
    const int64_t es = (int64_t)pe_dtype_size(dt);
#if PE_VW == 8
    pe_vf a[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
    for (int64_t e = 0; e < D; e += 32) {
        const pe_vf x0 = vx_load(xr + e * es, dt), x1 = vx_load(xr + (e + 8) * es, dt);
        const pe_vf x2 = vx_load(xr + (e + 16) * es, dt), x3 = vx_load(xr + (e + 24) * es, dt);
        a[0] = vf_add(a[0], vf_mul(x0, x0));
        a[1] = vf_add(a[1], vf_mul(x1, x1));
        a[2] = vf_add(a[2], vf_mul(x2, x2));
        a[3] = vf_add(a[3], vf_mul(x3, x3));
    }
#else
    pe_vf a[2] = {vf_zero(), vf_zero()};
    for (int64_t e = 0; e < D; e += 32) {
        const pe_vf x0 = vx_load(xr + e * es, dt), x1 = vx_load(xr + (e + 16) * es, dt);
        a[0] = vf_add(a[0], vf_mul(x0, x0));
        a[1] = vf_add(a[1], vf_mul(x1, x1));
    }
#endif
    return qk_acc_lanes(a);
}

/* The second pass of a forward row: the row xr read again (from the L1, where the first
 * pass left it: a copy in scratch would cost a store and a load per vector), normalized by
 * r, weighted, rotated and stored in dt, each pair of vectors (e, e + R/2) at once.  Returns
 * vf_round's denormal lanes. */
PE_INLINE unsigned qk_forward_out_vec(const pe_qk_norm_args *a, pe_dtype dt,
                                      const float *restrict v, const char *xr, char *orow,
                                      float r, const qk_rows_f32 *m, int hw) {
    const int64_t D = a->head_dim, R = a->rot_dim, h = R / 2;
    const int64_t es = (int64_t)pe_dtype_size(dt);
    const pe_norm_form form = a->form;
    const float *restrict c = m->c, *restrict ss = m->ss;
    const int stream = m->stream; /* read once: the stores may alias *m */
    const pe_vf rr = vf_set1(r);
    unsigned den = 0;
    for (int64_t e = 0; e < h; e += PE_VW) {
        const pe_vf y0 =
            qk_scale_vec(vx_load(xr + e * es, dt), vf_load(v + e), rr, form, dt, hw, &den);
        const pe_vf y1 = qk_scale_vec(vx_load(xr + (e + h) * es, dt), vf_load(v + e + h), rr,
                                      form, dt, hw, &den);
        qk_store(orow + e * es, vf_rot(y0, vf_load(c + e), y1, vf_load(ss + e)), dt, hw, &den,
                 stream);
        qk_store(orow + (e + h) * es, vf_rot(y1, vf_load(c + e + h), y0, vf_load(ss + e + h)),
                 dt, hw, &den, stream);
    }
    for (int64_t e = R; e < D; e += PE_VW)
        qk_store(orow + e * es,
                 qk_scale_unrounded(vx_load(xr + e * es, dt), vf_load(v + e), rr, form, dt, hw,
                                    &den),
                 dt, hw, &den, stream);
    return den;
}

PE_INLINE void qk_forward_out(const pe_qk_norm_args *a, pe_dtype dt, const float *restrict v,
                              const char *xr, char *orow, float r, const qk_rows_f32 *m,
                              int hw) {
    /* hardware bf16 rounding where exact, else the row again in software (after the
     * streaming stores of the first try, if any, are done) */
    if (!hw) {
        qk_forward_out_vec(a, dt, v, xr, orow, r, m, 0);
    } else if (qk_forward_out_vec(a, dt, v, xr, orow, r, m, 1)) {
        if (m->stream) _mm_sfence();
        qk_forward_out_vec(a, dt, v, xr, orow, r, m, 0);
    }
}

PE_INLINE void qk_forward_row_vec(const pe_qk_norm_args *a, pe_dtype dt,
                                  const float *restrict v, const char *xr, char *orow,
                                  float *rstd, qk_rows_f32 *m, int hw) {
    const int64_t D = a->head_dim;
    const int64_t es = (int64_t)pe_dtype_size(dt);
    float *restrict t = m->t;
    float sum;
    if (qk_sum8_case(a)) {
        float lane[8];
        _mm256_storeu_ps(lane, qk_sq8_row(xr, D, dt));
        sum = 0.0f;
        for (int l = 0; l < 8; ++l) sum += lane[l];
    } else {
        for (int64_t e = 0; e < D; e += PE_VW) {
            const pe_vf xv = vx_load(xr + e * es, dt);
            vx_store((char *)(t + e), vf_mul(xv, xv), PE_FLOAT32);
        }
        sum = qk_sum_lanes_f32(t, D, a->sum_lanes);
    }
    const float ms = sum / (float)D + (float)a->eps;
    const float r = 1.0f / sqrtf(ms);
    *rstd = a->form == PE_NORM_POW ? ms : r;
    qk_forward_out(a, dt, v, xr, orow, r, m, hw);
}

#ifdef PE_BF16_BLOCK
/*
 * bf16 rows in pair order, as the rotary's pair rows (simd.h, PE_BF16_BLOCK): a block of
 * channels loads as channel pairs (a shift gives its even channels as fp32, a mask its odd
 * ones), the row waits in scratch in that order, the weights and the token's tables are put
 * in it once (pair_order_blocks), and two vectors round to bf16 together, the pairs coming
 * out in memory order for the store (and, with the hardware rounding, going back to fp32 by
 * the same shift and mask where the norm rounds inside the row).  Each channel gets the
 * operations of qk_forward_out_vec / qk_backward_row_vec on the same values, so the same
 * bits, with half the widening and narrowing.
 *
 * The software rounding (bf16_pairs_num, bf16_round_num) rounds as numbers.  That is the NaN
 * rounding too for a quiet NaN whose low 16 bits are zero, and every value rounded here is
 * a product or a sum whose NaN operands are bf16 values or the default NaN, except for the
 * weights (held as fp32 with weight_f32, whose NaN may have other low bits) and, in a direct
 * call of the backward op, rstd and ms^-1.5: a tensor whose weights hold a NaN, and a row
 * given a NaN r or p, keep the channel-order rows there (qk_pair_weights,
 * qk_backward_rows_dt).
 *
 * Which rows: bf16, qk_sum8_case, half pairing, whole blocks in each half of the rotary and
 * past it.
 */
PE_INLINE int qk_pairs_case(const pe_qk_norm_args *a, pe_dtype dt) {
    return dt == PE_BFLOAT16 && a->pairing == PE_PAIR_HALF && qk_sum8_case(a) &&
           (a->rot_dim / 2) % PE_BF16_BLOCK == 0 && (a->head_dim - a->rot_dim) % PE_BF16_BLOCK == 0;
}

/* The four 8-lane accumulators of qk_sum8_f32 from pair-order ones.  In a block of 32
 * channels torch's accumulator k takes channels 8k .. 8k+7, channel c in lane c % 8; so
 * even channel 2j of the block is accumulator j / 4's lane 2 (j % 4) and odd channel 2j+1
 * its lane 2 (j % 4) + 1: a sum kept per lane of the even and of the odd vectors is the
 * same additions in the same order, and interleaving the two gives accumulators 0 .. 3.
 * AVX-512: a block is 32 channels (ae, ao hold all four accumulators).  AVX2: a block is
 * 16 channels, alternate blocks hold accumulators 0, 1 (ae[0], ao[0]) and 2, 3 (ae[1],
 * ao[1]); D is a multiple of 32. */
PE_INLINE void qk_pair_lanes(const pe_vf *ae, const pe_vf *ao, __m256 acc[4]) {
#if PE_VW == 16
    pe_vf a01, a23;
    vf_interleave(ae[0], ao[0], &a01, &a23);
    acc[0] = _mm512_castps512_ps256(a01), acc[1] = _mm512_extractf32x8_ps(a01, 1);
    acc[2] = _mm512_castps512_ps256(a23), acc[3] = _mm512_extractf32x8_ps(a23, 1);
#else
    vf_interleave(ae[0], ao[0], &acc[0], &acc[1]);
    vf_interleave(ae[1], ao[1], &acc[2], &acc[3]);
#endif
}

/* Which pair-order accumulator the block at channel e adds into (qk_pair_lanes). */
PE_INLINE int qk_pair_acc(int64_t e) {
#if PE_VW == 16
    (void)e;
    return 0;
#else
    return (int)(e / PE_BF16_BLOCK % 2);
#endif
}

/* qk_sq8_row for a bf16 row read as channel pairs: the squares go into the same lanes in
 * the same order (qk_pair_lanes).  least (the avx512bf16 variant, or NULL): where the
 * row's nonzero magnitudes go (bf16_least_acc). */
PE_INLINE __m256 qk_sq8_row_pairs(const char *xr, int64_t D, pe_vi *least) {
    pe_vf ae[2] = {vf_zero(), vf_zero()}, ao[2] = {vf_zero(), vf_zero()};
    (void)least;
    for (int64_t e = 0; e < D; e += PE_BF16_BLOCK) {
        const pe_vi u = vi_load(xr + 2 * e);
        const pe_vf ve = bf16_even(u), vo = bf16_odd(u);
#ifdef PE_BF16_HW
        if (least) *least = bf16_least_acc(*least, u);
#endif
        const int k = qk_pair_acc(e);
        ae[k] = vf_add(ae[k], vf_mul(ve, ve));
        ao[k] = vf_add(ao[k], vf_mul(vo, vo));
    }
    __m256 acc[4];
    qk_pair_lanes(ae, ao, acc);
    return qk_sum8_vec(_mm256_add_ps(acc[0], _mm256_setzero_ps()), acc[1], acc[2], acc[3]);
}

/* A block's even and odd vectors rounded to bf16: its bf16 in memory order (two pairs per
 * 32-bit word); hw as above. */
PE_INLINE pe_vi qk_round_pairs(pe_vf ve, pe_vf vo, int hw, unsigned *den) {
#ifdef PE_BF16_HW
    if (hw) {
        const pe_vi r = bf16_pairs_hw(ve, vo);
        if (hw == QK_HW && __builtin_expect(bf16_zero_words(r) != 0, 0))
            *den |= (unsigned)(_mm512_fpclass_ps_mask(ve, 0x20) | _mm512_fpclass_ps_mask(vo, 0x20));
        return r;
    }
#endif
    (void)hw, (void)den;
    return bf16_pairs_num(ve, vo);
}

/* *ve, *vo rounded to bf16 and back to fp32 (vf_round of each): by the hardware as a pair
 * (one conversion and one permutation for both), in software each in place (the rounded
 * value's high half, as numbers like bf16_pairs_num, without the word shuffles). */
PE_INLINE void qk_round_back(pe_vf *ve, pe_vf *vo, int hw, unsigned *den) {
#ifdef PE_BF16_HW
    if (hw) {
        const pe_vi r = qk_round_pairs(*ve, *vo, hw, den);
        *ve = bf16_even(r);
        *vo = bf16_odd(r);
        return;
    }
#endif
    (void)hw, (void)den;
    *ve = bf16_odd(bf16_round_num(*ve));
    *vo = bf16_odd(bf16_round_num(*vo));
}

/* qk_scale_unrounded of the block of bf16 pairs at xb with the weights w (pair order) */
PE_INLINE void qk_scale_pairs(const char *xb, const float *restrict w, pe_vf rr,
                              pe_norm_form form, int hw, unsigned *den, pe_vf *ye, pe_vf *yo) {
    const pe_vi u = vi_load(xb);
    pe_vf ne = vf_mul(bf16_even(u), rr), no = vf_mul(bf16_odd(u), rr);
    const pe_vf we = vf_load(w), wo = vf_load(w + PE_VW);
    if (form == PE_NORM_WEIGHT) {
        qk_round_back(&ne, &no, hw, den);
        *ye = vf_mul(we, ne), *yo = vf_mul(wo, no);
    } else if (form == PE_NORM_ONE_PLUS_WEIGHT) {
        *ye = vf_mul(ne, we), *yo = vf_mul(no, wo);
    } else {
        *ye = vf_mul(we, ne), *yo = vf_mul(wo, no);
    }
}

/* A block of bf16 pairs to p, with a streaming store when stream */
PE_INLINE void qk_store_pairs(char *p, pe_vi r, int stream) {
    if (stream) vi_stream(p, r);
    else vi_store(p, r);
}

#ifdef PE_BF16_HW
/* The token's table pairs for bf16_dot_block into tab (the first half's blocks, then the
 * second's), where the rotary is one or two blocks per half and its tables pass
 * bf16_dot_tables (the rotary's rows, rope_f32.h, rot_half_rows_dot, do the same); else
 * NULL.  m->cp, m->ssp hold the tables in pair order. */
PE_INLINE const pe_vi *qk_dot_tables(const pe_qk_norm_args *a, const qk_rows_f32 *m,
                                     pe_vi tab[8]) {
    const int64_t R = a->rot_dim, h = R / 2;
    if ((R != 2 * PE_BF16_BLOCK && R != 4 * PE_BF16_BLOCK) || !bf16_dot_tables(m->cp, R) ||
        !bf16_dot_tables(m->ssp, R))
        return NULL;
    for (int64_t k = 0; k < h / PE_BF16_BLOCK; ++k) {
        const int64_t e = k * PE_BF16_BLOCK;
        bf16_dot_pairs(m->cp + e, m->ssp + e, &tab[2 * k], &tab[2 * k + 1]);
        bf16_dot_pairs(m->ssp + h + e, m->cp + h + e, &tab[4 + 2 * k], &tab[5 + 2 * k]);
    }
    return tab;
}
#endif

/* qk_forward_out_pairs' rows; with `good` (the avx512bf16 variant, m->dot set) the rotary
 * blocks rotate the rounded y by dot products of bf16 pairs, and *good keeps what
 * bf16_dot_good says of their results. */
PE_INLINE unsigned qk_forward_pairs_rows(const pe_qk_norm_args *a, const float *restrict v,
                                         const char *xr, char *orow, float r,
                                         const qk_rows_f32 *m, int hw, __mmask32 *good) {
    const int64_t D = a->head_dim, R = a->rot_dim, h = R / 2;
    const pe_norm_form form = a->form;
    const float *restrict c = m->cp, *restrict ss = m->ssp;
    const int stream = m->stream; /* read once: the stores may alias *m */
    const pe_vf rr = vf_set1(r);
    unsigned den = 0;
    (void)good;
    for (int64_t e = 0; e < h; e += PE_BF16_BLOCK) {
        pe_vf y0e, y0o, y1e, y1o; /* the block at e of the first half, of the second */
        qk_scale_pairs(xr + 2 * e, v + e, rr, form, hw, &den, &y0e, &y0o);
        qk_scale_pairs(xr + 2 * (h + e), v + h + e, rr, form, hw, &den, &y1e, &y1o);
#ifdef PE_BF16_HW
        if (good) {
            const int64_t k = e / PE_BF16_BLOCK;
            pe_vi o0, o1;
            const pe_vi u0 = qk_round_pairs(y0e, y0o, hw, &den);
            const pe_vi u1 = qk_round_pairs(y1e, y1o, hw, &den);
            bf16_dot_block(u0, u1, &m->dot[2 * k], &m->dot[4 + 2 * k], &o0, &o1);
            *good = bf16_dot_good(bf16_dot_good(*good, o0), o1);
            qk_store_pairs(orow + 2 * e, o0, stream);
            qk_store_pairs(orow + 2 * (h + e), o1, stream);
            continue;
        }
#endif
        qk_round_back(&y0e, &y0o, hw, &den);
        qk_round_back(&y1e, &y1o, hw, &den);
        const float *c0 = c + e, *s0 = ss + e, *c1 = c + h + e, *s1 = ss + h + e;
        const pe_vf o0e = vf_rot(y0e, vf_load(c0), y1e, vf_load(s0));
        const pe_vf o0o = vf_rot(y0o, vf_load(c0 + PE_VW), y1o, vf_load(s0 + PE_VW));
        const pe_vf o1e = vf_rot(y1e, vf_load(c1), y0e, vf_load(s1));
        const pe_vf o1o = vf_rot(y1o, vf_load(c1 + PE_VW), y0o, vf_load(s1 + PE_VW));
        qk_store_pairs(orow + 2 * e, qk_round_pairs(o0e, o0o, hw, &den), stream);
        qk_store_pairs(orow + 2 * (h + e), qk_round_pairs(o1e, o1o, hw, &den), stream);
    }
    for (int64_t e = R; e < D; e += PE_BF16_BLOCK) { /* past the rotary: one rounding */
        pe_vf ye, yo;
        qk_scale_pairs(xr + 2 * e, v + e, rr, form, hw, &den, &ye, &yo);
        qk_store_pairs(orow + 2 * e, qk_round_pairs(ye, yo, hw, &den), stream);
    }
    return den;
}

/* qk_forward_out_vec for the rows of qk_pairs_case: the row xr read as channel pairs, v the
 * weights in pair order, the token's tables in m->cp, m->ssp.  Returns the denormal lanes of
 * the hardware rounding (0 when hw is 0).  With m->dot the rotary goes by dot products
 * first, and a row with a result they do not answer for is done again without them. */
PE_INLINE unsigned qk_forward_out_pairs(const pe_qk_norm_args *a, const float *restrict v,
                                        const char *xr, char *orow, float r,
                                        const qk_rows_f32 *m, int hw) {
#ifdef PE_BF16_HW
    if (hw && m->dot) {
        __mmask32 good = ~(__mmask32)0;
        const unsigned den = qk_forward_pairs_rows(a, v, xr, orow, r, m, hw, &good);
        if (__builtin_expect(good == ~(__mmask32)0, 1)) return den;
        if (m->stream) _mm_sfence();
    }
#endif
    return qk_forward_pairs_rows(a, v, xr, orow, r, m, hw, NULL);
}
#endif

/* The lanes of 8 rows (acc[g]: row g's, as qk_sum8_vec gives them) each added up in
 * order from 0, as qk_sum8_join adds one row's: lane g of the result is row g's sum. */
PE_INLINE __m256 qk_rows8_sum(const __m256 acc[8]) {
    __m256 u[8], w[8], col[8]; /* 8 x 8 transpose: col[l] holds lane l of every row */
    for (int g = 0; g < 8; g += 2) {
        u[g] = _mm256_unpacklo_ps(acc[g], acc[g + 1]);
        u[g + 1] = _mm256_unpackhi_ps(acc[g], acc[g + 1]);
    }
    for (int g = 0; g < 8; g += 4) {
        w[g] = _mm256_shuffle_ps(u[g], u[g + 2], 0x44);
        w[g + 1] = _mm256_shuffle_ps(u[g], u[g + 2], 0xee);
        w[g + 2] = _mm256_shuffle_ps(u[g + 1], u[g + 3], 0x44);
        w[g + 3] = _mm256_shuffle_ps(u[g + 1], u[g + 3], 0xee);
    }
    for (int l = 0; l < 4; ++l) {
        col[l] = _mm256_permute2f128_ps(w[l], w[l + 4], 0x20);
        col[l + 4] = _mm256_permute2f128_ps(w[l], w[l + 4], 0x31);
    }
    __m256 sum = _mm256_setzero_ps();
    for (int l = 0; l < 8; ++l) sum = _mm256_add_ps(sum, col[l]);
    return sum;
}

/* Up to 8 rows (heads h0 .. h0+n-1 of token (b, t)) of qk_sum8_case at once: each row's
 * first pass, then their 8 lane sums, scales and 1 / sqrt as 8-lane vectors (lane g is
 * row g: the same additions in the same order, and IEEE division and square root round as
 * their scalar forms do), so that no row waits on its own chain of dependent additions,
 * division and square root; then each row's second pass, which reads its row again (the
 * 8 rows are still in the L1).  vp: the weights in pair order for the bf16 pair rows
 * (qk_pairs_case), else NULL; with the hardware rounding (hw), those rows skip its test
 * for denormals where qk_no_denormal holds, with the least nonzero magnitude of the 8 rows'
 * x and bound (min(1, W) min(1, C) of the tensor's weights and the token's tables). */
PE_INLINE void qk_forward_rows8(const pe_qk_norm_args *a, pe_dtype dt, const float *restrict v,
                                const float *restrict vp, const pe_qk_norm_tensor *X, int64_t b,
                                int64_t t, int64_t h0, int n, const qk_rows_f32 *m, int hw,
                                double bound, int64_t ahead) {
    const int64_t D = a->head_dim;
    const size_t es = pe_dtype_size(dt);
    __m256 acc[8];
    pe_vi *least = NULL; /* the rows' nonzero magnitudes (bf16_least_acc) */
    float xleast = 0.0f;
#ifdef PE_BF16_HW
    pe_vi least_acc = bf16_least_none();
    if (hw && vp) least = &least_acc;
#endif
    (void)bound;
    for (int g = 0; g < 8; ++g) {
        if (g >= n) {
            acc[g] = _mm256_setzero_ps();
            continue;
        }
        const char *xr = pe_row(X->x, X->x_stride, es, b, t, h0 + g);
        if (ahead) /* this row's input lines, `ahead` bytes further on (not the output's:
                    * pe_qk_plan) */
            qk_prefetch_row(xr + ahead, D * (int64_t)es, 0);
#ifdef PE_BF16_BLOCK
        if (vp) {
            acc[g] = qk_sq8_row_pairs(xr, D, least);
            continue;
        }
#endif
        acc[g] = qk_sq8_row(xr, D, dt);
    }
    const __m256 sum = qk_rows8_sum(acc);
    const __m256 ms = _mm256_add_ps(_mm256_div_ps(sum, _mm256_set1_ps((float)D)),
                                    _mm256_set1_ps((float)a->eps));
    const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(ms));
    float msv[8], rv[8];
    _mm256_storeu_ps(msv, ms);
    _mm256_storeu_ps(rv, r);
#ifdef PE_BF16_HW
    if (least) xleast = bf16_least(*least);
#endif
    for (int g = 0; g < n; ++g) {
        *(float *)pe_row(X->rstd, X->rstd_stride, 4, b, t, h0 + g) =
            a->form == PE_NORM_POW ? msv[g] : rv[g];
        const char *xr = pe_row(X->x, X->x_stride, es, b, t, h0 + g);
        char *orow = (char *)pe_row(X->out, X->out_stride, es, b, t, h0 + g);
#ifdef PE_BF16_BLOCK
        if (vp) {
            if (least && qk_no_denormal(xleast, rv[g], bound)) {
                qk_forward_out_pairs(a, vp, xr, orow, rv[g], m, QK_HW_NORMAL);
                continue;
            }
            /* a denormal met by the hardware rounding: the row again in channel order */
            if (__builtin_expect(qk_forward_out_pairs(a, vp, xr, orow, rv[g], m, hw), 0)) {
                if (m->stream) _mm_sfence();
                qk_forward_out_vec(a, dt, v, xr, orow, rv[g], m, 0);
            }
            continue;
        }
#endif
        qk_forward_out(a, dt, v, xr, orow, rv[g], m, hw);
    }
}

/* Backward, in two passes over a row.  The first rotates the gradient back (the token's
 * cos row crow and sine row srow read in place, the transpose's signs applied), rounds it,
 * keeps gn = dL/dn (fp32) for the second and leaves the weight-gradient products in wp;
 * the sum of gn x goes into torch's lanes (qk_sum8_f32, when t is NULL: the row is
 * qk_sum8_case's) or into t (for qk_sum_lanes_f32).  The second, once that sum is known
 * (g2: its part of dx per 2 x), reads x again from the row (still in cache: a copy in
 * scratch measured slower, as the scratch of 8 rows then crowds the L1) and stores dx.
 * Each returns vf_round's denormal lanes. */
PE_INLINE unsigned qk_backward_in_vec(const pe_qk_norm_args *a, pe_dtype dt,
                                      const float *restrict v, const char *xr,
                                      const char *grow, const char *crow, const char *srow,
                                      float r, float *restrict gn, float *restrict wp,
                                      float *restrict t, __m256 *lanes, int hw) {
    const int64_t D = a->head_dim, R = a->rot_dim, h = R / 2;
    const int64_t es = (int64_t)pe_dtype_size(dt);
    const pe_norm_form form = a->form;
    const pe_vf rr = vf_set1(r);
    pe_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
    unsigned den = 0;
    for (int64_t e = 0; e < D; e += PE_VW) {
        pe_vf gy = vx_load(grow + e * es, dt);
        if (e < R) {
            const int64_t pe = e < h ? e + h : e - h; /* the partner channel */
            const pe_vf sv = vx_load(srow + pe * es, dt);
            gy = vf_rot(gy, vx_load(crow + e * es, dt), vx_load(grow + pe * es, dt),
                        e < h ? sv : vf_neg(sv));
        }
        const pe_vf g = vf_round(gy, dt, hw, &den), xv = vx_load(xr + e * es, dt);
        const pe_vf wv = vf_load(v + e), n = vf_mul(xv, rr);
        pe_vf gv, pv;
        if (form == PE_NORM_WEIGHT) {
            gv = vf_round(vf_mul(g, wv), dt, hw, &den);
            pv = vf_round(vf_mul(g, vf_round(n, dt, hw, &den)), dt, hw, &den);
        } else {
            gv = vf_mul(g, wv);
            pv = vf_mul(g, n);
        }
        vx_store((char *)(wp + e), pv, PE_FLOAT32);
        vx_store((char *)(gn + e), gv, PE_FLOAT32);
        if (t) {
            vx_store((char *)(t + e), vf_mul(gv, xv), PE_FLOAT32);
        } else {
            pe_vf *k = &acc[e / PE_VW % (32 / PE_VW)];
            *k = vf_add(*k, vf_mul(gv, xv));
        }
    }
    if (!t) *lanes = qk_acc_lanes(acc);
    return den;
}

PE_INLINE unsigned qk_backward_dx_vec(const pe_qk_norm_args *a, pe_dtype dt,
                                      const float *restrict gn, const char *xr, float r,
                                      float g2, char *dxrow, int hw, int stream) {
    const int64_t D = a->head_dim;
    const int64_t es = (int64_t)pe_dtype_size(dt);
    const pe_vf rr = vf_set1(r), gv2 = vf_set1(g2), two = vf_set1(2.0f);
    unsigned den = 0;
    for (int64_t e = 0; e < D; e += PE_VW)
        qk_store(dxrow + e * es,
                 vf_add(vf_mul(vf_load(gn + e), rr),
                        vf_mul(gv2, vf_mul(two, vx_load(xr + e * es, dt)))),
                 dt, hw, &den, stream);
    return den;
}

/* A whole row: both passes, the sum in torch's order of a->sum_lanes lanes between them,
 * on m's scratch rows (products in m->g). */
PE_INLINE unsigned qk_backward_row_vec(const pe_qk_norm_args *a, pe_dtype dt,
                                       const float *restrict v, const char *xr, const char *grow,
                                       const char *crow, const char *srow, char *dxrow, float r,
                                       float p, qk_rows_f32 *m, int hw) {
    const int stream = m->stream; /* read once: the stores may alias *m */
    unsigned den = qk_backward_in_vec(a, dt, v, xr, grow, crow, srow, r, m->o, m->g, m->t,
                                      NULL, hw);
    const float gsum = qk_grad_ms(a->form, qk_sum_lanes_f32(m->t, a->head_dim, a->sum_lanes), r, p);
    return den | qk_backward_dx_vec(a, dt, m->o, xr, r, gsum / (float)a->head_dim, dxrow, hw,
                                    stream);
}

#ifdef PE_BF16_BLOCK
/* qk_backward_in_vec and qk_backward_dx_vec for the rows of qk_pairs_case, in pair order:
 * the gradient, its partner block, the cos and sine rows and x read as channel pairs, vp
 * the weights in pair order.  The first pass keeps gn in pair order for the second and
 * stores the weight-gradient products in channel order (wp, as the block sums take them);
 * the sum of gn x goes into torch's lanes as qk_sq8_row_pairs's squares do.  The
 * software pair rounding rounds numbers only (qk_round_pairs), so r and p, which a direct
 * call may give any value, must not be NaN there (qk_backward_rows_dt).  Each returns the
 * denormal lanes of the hardware rounding. */
PE_INLINE unsigned qk_backward_in_pairs(const pe_qk_norm_args *a, const float *restrict vp,
                                        const char *xr, const char *grow, const char *crow,
                                        const char *srow, float r, float *restrict gn,
                                        float *restrict wp, __m256 *lanes, int hw) {
    const int64_t D = a->head_dim, R = a->rot_dim, h = R / 2;
    const pe_norm_form form = a->form;
    const pe_vf rr = vf_set1(r);
    unsigned den = 0;
    pe_vf ae[2] = {vf_zero(), vf_zero()}, ao[2] = {vf_zero(), vf_zero()};
    for (int64_t e = 0; e < D; e += PE_BF16_BLOCK) {
        const pe_vi gu = vi_load(grow + 2 * e);
        pe_vf ge = bf16_even(gu), go = bf16_odd(gu);
        if (e < R) { /* rotated back: the partner block's gradient and sine */
            const int64_t pe = e < h ? e + h : e - h;
            const pe_vi pu = vi_load(grow + 2 * pe), cu = vi_load(crow + 2 * e);
            const pe_vi su = vi_load(srow + 2 * pe);
            pe_vf se = bf16_even(su), so = bf16_odd(su);
            if (e >= h) se = vf_neg(se), so = vf_neg(so);
            ge = vf_rot(ge, bf16_even(cu), bf16_even(pu), se);
            go = vf_rot(go, bf16_odd(cu), bf16_odd(pu), so);
        }
        qk_round_back(&ge, &go, hw, &den);
        const pe_vi xu = vi_load(xr + 2 * e);
        const pe_vf xe = bf16_even(xu), xo = bf16_odd(xu);
        const pe_vf we = vf_load(vp + e), wo = vf_load(vp + e + PE_VW);
        pe_vf ne = vf_mul(xe, rr), no = vf_mul(xo, rr);
        pe_vf gve = vf_mul(ge, we), gvo = vf_mul(go, wo), pve, pvo;
        if (form == PE_NORM_WEIGHT) {
            qk_round_back(&gve, &gvo, hw, &den);
            qk_round_back(&ne, &no, hw, &den);
            pve = vf_mul(ge, ne), pvo = vf_mul(go, no);
            qk_round_back(&pve, &pvo, hw, &den);
        } else {
            pve = vf_mul(ge, ne), pvo = vf_mul(go, no);
        }
        pe_vf lo, hi;
        vf_interleave(pve, pvo, &lo, &hi);
        vx_store((char *)(wp + e), lo, PE_FLOAT32);
        vx_store((char *)(wp + e + PE_VW), hi, PE_FLOAT32);
        vx_store((char *)(gn + e), gve, PE_FLOAT32);
        vx_store((char *)(gn + e + PE_VW), gvo, PE_FLOAT32);
        const int k = qk_pair_acc(e);
        ae[k] = vf_add(ae[k], vf_mul(gve, xe));
        ao[k] = vf_add(ao[k], vf_mul(gvo, xo));
    }
    __m256 acc[4];
    qk_pair_lanes(ae, ao, acc);
    *lanes = qk_sum8_vec(_mm256_add_ps(acc[0], _mm256_setzero_ps()), acc[1], acc[2], acc[3]);
    return den;
}

PE_INLINE unsigned qk_backward_dx_pairs(const pe_qk_norm_args *a, const float *restrict gn,
                                        const char *xr, float r, float g2, char *dxrow, int hw,
                                        int stream) {
    const int64_t D = a->head_dim;
    const pe_vf rr = vf_set1(r), gv2 = vf_set1(g2), two = vf_set1(2.0f);
    unsigned den = 0;
    for (int64_t e = 0; e < D; e += PE_BF16_BLOCK) {
        const pe_vi xu = vi_load(xr + 2 * e);
        const pe_vf dxe = vf_add(vf_mul(vf_load(gn + e), rr),
                                 vf_mul(gv2, vf_mul(two, bf16_even(xu))));
        const pe_vf dxo = vf_add(vf_mul(vf_load(gn + e + PE_VW), rr),
                                 vf_mul(gv2, vf_mul(two, bf16_odd(xu))));
        qk_store_pairs(dxrow + 2 * e, qk_round_pairs(dxe, dxo, hw, &den), stream);
    }
    return den;
}
#endif

/* The lanes of up to 8 rows (lanes[g], qk_sum8_vec's) added up and turned into each row's
 * g2 as the single-row code does (qk_sum8_join, qk_grad_ms, / D), all 8 rows at once as
 * 8-lane vectors (lane g is row g: the same operations in the same order), so that no row
 * waits on its own chain of dependent additions; r and p: the rows' rstd and ms^-1.5. */
PE_INLINE void qk_backward_g2_8(const pe_qk_norm_args *a, const __m256 lanes[8],
                                const float r[8], const float p[8], float g2[8]) {
    const __m256 sum = qk_rows8_sum(lanes), rv = _mm256_loadu_ps(r);
    const __m256 gsum =
        a->form == PE_NORM_POW
            ? _mm256_mul_ps(sum, _mm256_mul_ps(_mm256_set1_ps(-0.5f), _mm256_loadu_ps(p)))
            : _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(-0.5f), sum),
                            _mm256_mul_ps(_mm256_mul_ps(rv, rv), rv));
    _mm256_storeu_ps(g2, _mm256_div_ps(gsum, _mm256_set1_ps((float)a->head_dim)));
}
#endif

/* The scratch rows of one thread (pe_qk_scratch_bytes): qk_rows_f32's, qk_backward_rows8's
 * rows, then the block accumulators of the backward, D (*plain) and 4 D (*lanes) floats
 * for each of acc_heads heads. */
PE_INLINE qk_rows_f32 qk_scratch(const pe_qk_norm_args *a, void *scratch, int64_t acc_heads,
                                 float **plain, float **lanes) {
    const int64_t D = a->head_dim, R = a->rot_dim;
    float *f = (float *)scratch;
    qk_rows_f32 m;
    m.w[0] = f, m.w[1] = f + D, m.c = f + 2 * D, m.ss = m.c + R, m.s = m.ss + R;
    m.x = m.s + R, m.t = m.x + D, m.y = m.t + D, m.o = m.y + D, m.g = m.o + D;
    m.v[0] = m.g + D, m.v[1] = m.v[0] + D;
    m.vp[0] = m.v[1] + D, m.vp[1] = m.vp[0] + D, m.cp = m.vp[1] + D, m.ssp = m.cp + R;
    m.rows8 = m.ssp + R; /* 8 D */
    *plain = m.rows8 + 8 * D;
    *lanes = *plain + acc_heads * D;
    m.stream = 0;
#ifdef PE_BF16_HW
    m.dot = NULL;
#endif
    return m;
}

/* Tensor X's weight into m->w[w] (fp32) and m->v[w] as qk_scale_vec takes it. */
PE_INLINE void qk_load_weight(const pe_qk_norm_args *a, const pe_qk_norm_tensor *X, int w,
                              pe_dtype dt, qk_rows_f32 *m) {
    const int64_t D = a->head_dim;
    load_row(m->w[w], X->weight, a->weight_f32 ? PE_FLOAT32 : dt, D);
    for (int64_t e = 0; e < D; ++e)
        m->v[w][e] = a->form == PE_NORM_ONE_PLUS_WEIGHT ? 1.0f + m->w[w][e] : m->w[w][e];
}

/* Weight w in pair order (m->vp[w]) for the bf16 pair rows, or NULL where they do not run:
 * not qk_pairs_case, or weights holding a NaN with the software rounding, which rounds
 * numbers only (an fp32 weight's NaN may have low bits that carry into the bf16). */
PE_INLINE const float *qk_pair_weights(const pe_qk_norm_args *a, pe_dtype dt, qk_rows_f32 *m,
                                       int w, int hw) {
#ifdef PE_BF16_BLOCK
    if (!qk_pairs_case(a, dt)) return NULL;
    if (!hw && any_nan(m->v[w], a->head_dim)) return NULL;
    pair_order_blocks(m->vp[w], m->v[w], a->head_dim);
    return m->vp[w];
#else
    (void)a, (void)dt, (void)m, (void)w, (void)hw;
    return NULL;
#endif
}

/* Whether the rows take the vector paths: half pairing, R a multiple of 2 vectors and D of
 * one. */
PE_INLINE int qk_vec_rows(const pe_qk_norm_args *a) {
#ifdef PE_VW
    return a->pairing == PE_PAIR_HALF && a->rot_dim % (2 * PE_VW) == 0 &&
           a->head_dim % PE_VW == 0;
#else
    (void)a;
    return 0;
#endif
}

/* Forward: tokens i0 .. i0+n-1 (i = b T + t), all heads of q then k, tensors of dtype dt
 * (a->dtype, passed as a constant so that each dtype gets its own loops), rows moved as p
 * says (input asked for ahead, streaming stores). */
PE_INLINE void qk_forward_rows_dt(const pe_qk_norm_args *a, const pe_qk_plan *p, int64_t i0,
                                  int64_t n, void *scratch, pe_dtype dt) {
    const int64_t T = a->seq;
    const size_t es = pe_dtype_size(dt);
    float *unused_plain, *unused_lanes;
    qk_rows_f32 m = qk_scratch(a, scratch, 0, &unused_plain, &unused_lanes);
    const pe_qk_norm_tensor *xs[2] = {&a->q, &a->k};
    for (int w = 0; w < 2; ++w)
        if (xs[w]->heads) qk_load_weight(a, xs[w], w, dt, &m);
    const int vec = qk_vec_rows(a);
#ifdef PE_BF16_HW
    const int hw = dt == PE_BFLOAT16; /* the avx512bf16 variant (simd.h) */
#else
    const int hw = 0;
#endif
    (void)vec, (void)hw;
    const float *vp[2] = {NULL, NULL}; /* the bf16 pair rows, per tensor */
    double wleast[2] = {0.0, 0.0};      /* their min(1, W) (qk_no_denormal) */
    for (int w = 0; w < 2; ++w) {
        if (!xs[w]->heads) continue;
        vp[w] = qk_pair_weights(a, dt, &m, w, hw);
        if (hw && vp[w]) wleast[w] = fmin(1.0, qk_least_nonzero(m.v[w], a->head_dim));
    }
    (void)vp;
    double cleast = 0.0; /* the token's min(1, C) */
#ifdef PE_BF16_HW
    pe_vi dot_tab[8]; /* the token's tables for the dot products (qk_dot_tables) */
#endif
    (void)wleast, (void)cleast;
    for (int64_t i = i0; i < i0 + n; ++i) {
        const int64_t b = i / T, t = i % T;
        qk_tables_f32(a, b, t, 0, m.c, m.ss, m.s);
#ifdef PE_BF16_BLOCK
        if (vp[0] || vp[1]) {
            pair_order_blocks(m.cp, m.c, a->rot_dim);
            pair_order_blocks(m.ssp, m.ss, a->rot_dim);
            if (hw)
                cleast = fmin(1.0, fmin(qk_least_nonzero(m.c, a->rot_dim),
                                        qk_least_nonzero(m.s, a->rot_dim)));
#ifdef PE_BF16_HW
            if (hw) m.dot = qk_dot_tables(a, &m, dot_tab);
#endif
        }
#endif
        for (int w = 0; w < 2; ++w) {
            const pe_qk_norm_tensor *x = xs[w];
            m.stream = p->stream[w];
#ifdef PE_VW
            if (vec && qk_sum8_case(a)) {
                for (int64_t h0 = 0; h0 < x->heads; h0 += 8)
                    qk_forward_rows8(a, dt, m.v[w], vp[w], x, b, t, h0,
                                     x->heads - h0 < 8 ? (int)(x->heads - h0) : 8, &m, hw,
                                     wleast[w] * cleast, p->ahead[w]);
                continue;
            }
#endif
            for (int64_t h = 0; h < x->heads; ++h) {
                const char *xr = pe_row(x->x, x->x_stride, es, b, t, h);
                char *orow = (char *)pe_row(x->out, x->out_stride, es, b, t, h);
                float *rstd = (float *)pe_row(x->rstd, x->rstd_stride, 4, b, t, h);
#ifdef PE_VW
                if (vec) {
                    qk_forward_row_vec(a, dt, m.v[w], xr, orow, rstd, &m, hw);
                    continue;
                }
#endif
                qk_forward_row(a, dt, m.w[w], xr, orow, rstd, &m);
            }
        }
    }
#ifdef PE_VW
    if (p->stream[0] || p->stream[1]) _mm_sfence(); /* before the tile is done */
#endif
}

/* acc += p over n floats (acc the first operand, as torch's accumulators are). */
PE_INLINE void qk_accumulate(float *restrict acc, const float *restrict p, int64_t n) {
    int64_t e = 0;
#ifdef PE_VW
    for (; e + PE_VW <= n; e += PE_VW)
        vx_store((char *)(acc + e), vf_add(vf_load(acc + e), vf_load(p + e)), PE_FLOAT32);
#endif
    for (; e < n; ++e) acc[e] = acc[e] + p[e];
}

/* Rows the backward asks for ahead of the one it computes: in the products' order of the
 * (B, H, T, D) views transformers hands over, consecutive rows lie a token apart in memory
 * (all heads' channels), too far for the hardware prefetchers to follow.  Walked token by
 * token the rows are adjacent; the requests are kept there too (without them the walk
 * measured as fast or up to 15% slower, docs/qk_norm.md). */
#define QK_AHEAD 6

/* A row of tensor X: where its input, gradient, dx and table rows are, its rstd r and
 * (PE_NORM_POW) ms^-1.5 p. */
typedef struct qk_bwd_row {
    int64_t b, t;
    const char *x, *grad, *cos, *sin;
    char *dx;
    float r, p;
} qk_bwd_row;

/* A row's (b, t, h): from its index in the walk, or stepped to the next row of the walk
 * (no division).  The walk goes in the products' order (posenc.h), or token by token
 * (by_token: every head's row of a token in turn, the order of (B, T, H) products). */
typedef struct qk_row_pos {
    int64_t b, t, h;
} qk_row_pos;

PE_INLINE int qk_walk_heads_first(const pe_qk_norm_args *a, int by_token) {
    return a->heads_first && !by_token;
}

PE_INLINE qk_row_pos qk_row_at(const pe_qk_norm_args *a, int64_t H, int by_token, int64_t r) {
    const int64_t T = a->seq;
    if (qk_walk_heads_first(a, by_token)) return (qk_row_pos){r / T / H, r % T, r / T % H};
    return (qk_row_pos){r / H / T, r / H % T, r % H};
}

PE_INLINE void qk_row_next(const pe_qk_norm_args *a, int64_t H, int by_token, qk_row_pos *p) {
    const int hf = qk_walk_heads_first(a, by_token);
    int64_t *inner = hf ? &p->t : &p->h, *outer = hf ? &p->h : &p->t;
    const int64_t ni = hf ? a->seq : H, no = hf ? H : a->seq;
    if (++*inner < ni) return;
    *inner = 0;
    if (++*outer < no) return;
    *outer = 0;
    ++p->b;
}

/* The row's index in the products' order */
PE_INLINE int64_t qk_row_index(const pe_qk_norm_args *a, int64_t H, qk_row_pos p) {
    return a->heads_first ? (p.b * H + p.h) * a->seq + p.t : (p.b * a->seq + p.t) * H + p.h;
}

/* Row r's lines of x and of the gradient asked for (not dx's: pe_qk_plan) */
PE_INLINE void qk_backward_prefetch(const pe_qk_norm_args *a, const pe_qk_norm_tensor *X,
                                    size_t es, qk_row_pos q) {
    qk_prefetch_row(pe_row(X->x, X->x_stride, es, q.b, q.t, q.h), a->head_dim * (int64_t)es, 0);
    qk_prefetch_row(pe_row(X->grad, X->grad_stride, es, q.b, q.t, q.h),
                    a->head_dim * (int64_t)es, 0);
}

PE_INLINE qk_bwd_row qk_backward_row_at(const pe_qk_norm_args *a, const pe_qk_norm_tensor *X,
                                        size_t es, qk_row_pos q) {
    qk_bwd_row w;
    const int64_t h = q.h;
    w.b = q.b, w.t = q.t;
    w.x = pe_row(X->x, X->x_stride, es, w.b, w.t, h);
    w.grad = pe_row(X->grad, X->grad_stride, es, w.b, w.t, h);
    w.dx = (char *)pe_row(X->out, X->out_stride, es, w.b, w.t, h);
    const int64_t off = ((a->table_batch == 1 ? 0 : w.b) * a->table_stride[0] +
                         w.t * a->table_stride[1]) * (int64_t)es;
    w.cos = (const char *)a->cos + off, w.sin = (const char *)a->sin + off;
    w.r = *(const float *)pe_row(X->rstd, X->rstd_stride, 4, w.b, w.t, h), w.p = 0.0f;
    if (a->form == PE_NORM_POW) { /* rstd holds ms */
        w.r = 1.0f / sqrtf(w.r);
        w.p = *(const float *)pe_row(X->ms_pow, X->ms_pow_stride, 4, w.b, w.t, h);
    }
    return w;
}

/* Row r's weight-gradient products g into the block sums of each order (the blocks of ws,
 * the running sums plain and lanes). */
PE_INLINE void qk_add_products(const pe_qk_wsum *ws, float *restrict plain,
                               float *restrict lanes, int64_t r, const float *g, int64_t D) {
    const int64_t S = ws->plain_block, LB = ws->lane_block;
    if (S) {
        qk_accumulate(plain, g, D);
        if ((r + 1) % S == 0 || r + 1 == ws->rows) {
            memcpy(ws->plain + r / S * D, plain, (size_t)D * sizeof(float));
            memset(plain, 0, (size_t)D * sizeof(float));
        }
    }
    if (LB) {
        if (r < ws->lane_rows) {
            qk_accumulate(lanes + r % 4 * D, g, D);
            if ((r + 1) % LB == 0 || r + 1 == ws->lane_rows) {
                memcpy(ws->lanes + r / LB * 4 * D, lanes, (size_t)(4 * D) * sizeof(float));
                memset(lanes, 0, (size_t)(4 * D) * sizeof(float));
            }
        } else {
            memcpy(ws->tail + (r - ws->lane_rows) * D, g, (size_t)D * sizeof(float));
        }
    }
}

/* How a backward walks its rows (pe_qk_plan) and where it keeps its running block sums:
 * D (plain) and 4 D (lanes) floats, one set per head when by_token (each head's rows come
 * in the products' order among themselves, so each of its blocks is summed as before). */
typedef struct qk_walk {
    int by_token;
    int64_t heads;
    float *plain, *lanes;
} qk_walk;

/* The products g of the row at p into its head's block sums */
PE_INLINE void qk_walk_add(const pe_qk_norm_args *a, const qk_walk *k, const pe_qk_wsum *ws,
                           qk_row_pos p, const float *g) {
    const int64_t D = a->head_dim, h = k->by_token ? p.h : 0;
    qk_add_products(ws, k->plain + h * D, k->lanes + h * 4 * D, qk_row_index(a, k->heads, p),
                    g, D);
}

#ifdef PE_VW
/* Up to 8 rows r .. r+n-1 of the walk k of tensor X (qk_sum8_case, the vector rows; at and
 * ahead: the positions of row r and of row r + QK_AHEAD, stepped past the n rows) at once:
 * each row's first pass (its weight-gradient products, in wp, added to the block sums right
 * after it, qk_walk_add), then their sums turned into g2 together (qk_backward_g2_8), then each
 * row's dx.  Row g keeps gn in rows + g D.  vp: the weights in pair order for the bf16
 * pair rows, else NULL.  Where the hardware rounding meets a denormal (hw), the row is
 * done again in software in channel order: from its first pass, or from its dx (a pair
 * row's gn made again in channel order first), after the streaming stores of the first
 * try are done.  Measured on an AMD EPYC (Zen 4), one thread, rows in cache: 10-35% less
 * time per row than one row at a time (docs/qk_norm.md). */
PE_INLINE void qk_backward_rows8(const pe_qk_norm_args *a, const pe_qk_norm_tensor *X,
                                 pe_dtype dt, const float *restrict v, const float *restrict vp,
                                 int64_t r, int64_t r1, qk_row_pos *at, qk_row_pos *ahead,
                                 int n, float *restrict rows, float *restrict wp,
                                 const pe_qk_wsum *ws, const qk_walk *k, int hw, int stream) {
    const int64_t D = a->head_dim;
    const size_t es = pe_dtype_size(dt);
    qk_bwd_row w[8];
    __m256 lanes[8];
    float rv[8], pv[8], g2[8];
    unsigned pairs = 0, soft = 0; /* rows in pair order; rows redone in software */
    for (int g = 0; g < 8; ++g) {
        lanes[g] = _mm256_setzero_ps(), rv[g] = 1.0f, pv[g] = 0.0f;
        if (g >= n) continue;
        if (r + g + QK_AHEAD < r1) qk_backward_prefetch(a, X, es, *ahead);
        const qk_row_pos pos = *at;
        w[g] = qk_backward_row_at(a, X, es, pos);
        qk_row_next(a, X->heads, k->by_token, at), qk_row_next(a, X->heads, k->by_token, ahead);
        rv[g] = w[g].r, pv[g] = w[g].p;
        float *gn = rows + g * D;
        unsigned den;
#ifdef PE_BF16_BLOCK
        if (vp && (hw || (w[g].r == w[g].r && w[g].p == w[g].p))) {
            pairs |= 1u << g;
            den = qk_backward_in_pairs(a, vp, w[g].x, w[g].grad, w[g].cos, w[g].sin, w[g].r, gn,
                                       wp, &lanes[g], hw);
        } else
#endif
            den = qk_backward_in_vec(a, dt, v, w[g].x, w[g].grad, w[g].cos, w[g].sin, w[g].r,
                                     gn, wp, NULL, &lanes[g], hw);
        if (hw && den) {
            pairs &= ~(1u << g), soft |= 1u << g;
            qk_backward_in_vec(a, dt, v, w[g].x, w[g].grad, w[g].cos, w[g].sin, w[g].r, gn, wp,
                               NULL, &lanes[g], 0);
        }
        qk_walk_add(a, k, ws, pos, wp);
    }
    (void)vp;
    qk_backward_g2_8(a, lanes, rv, pv, g2);
    for (int g = 0; g < n; ++g) {
        float *gn = rows + g * D;
        const int h = hw && !(soft >> g & 1);
#ifdef PE_BF16_BLOCK
        if (pairs >> g & 1) {
            if (__builtin_expect(!qk_backward_dx_pairs(a, gn, w[g].x, w[g].r, g2[g], w[g].dx, h,
                                                       stream), 1))
                continue;
            if (stream) _mm_sfence();
            __m256 unused;
            qk_backward_in_vec(a, dt, v, w[g].x, w[g].grad, w[g].cos, w[g].sin, w[g].r, gn, wp,
                               NULL, &unused, 0);
            qk_backward_dx_vec(a, dt, gn, w[g].x, w[g].r, g2[g], w[g].dx, 0, stream);
            continue;
        }
#endif
        if (qk_backward_dx_vec(a, dt, gn, w[g].x, w[g].r, g2[g], w[g].dx, h, stream) && h) {
            if (stream) _mm_sfence();
            qk_backward_dx_vec(a, dt, gn, w[g].x, w[g].r, g2[g], w[g].dx, 0, stream);
        }
    }
}
#endif

/* Backward: rows r0 .. r1-1 of tensor `tensor` in the order of its walk (p->by_token:
 * token by token, else the products' order, posenc.h), each row's dx stored (streamed as p
 * says) and its weight-gradient products added to the block sums of ws. */
PE_INLINE void qk_backward_rows_dt(const pe_qk_norm_args *a, const pe_qk_plan *p, int tensor,
                                   int64_t r0, int64_t r1, const pe_qk_wsum *ws, void *scratch,
                                   pe_dtype dt) {
    const pe_qk_norm_tensor *X = tensor ? &a->k : &a->q;
    const int64_t D = a->head_dim;
    const size_t es = pe_dtype_size(dt);
    qk_walk k = {p->by_token[tensor], X->heads, NULL, NULL};
    const int64_t acc = k.by_token ? X->heads : 1; /* heads whose block sums are kept */
    qk_rows_f32 m = qk_scratch(a, scratch, acc, &k.plain, &k.lanes);
    qk_load_weight(a, X, 0, dt, &m);
    m.stream = p->stream[tensor];
    const int vec = qk_vec_rows(a);
#ifdef PE_VW
    const int rows8 = vec && qk_sum8_case(a); /* qk_backward_rows8's rows */
#endif
#ifdef PE_BF16_HW
    const int hw = dt == PE_BFLOAT16;
#else
    const int hw = 0;
#endif
    (void)vec, (void)hw;
    const float *vp = qk_pair_weights(a, dt, &m, 0, hw); /* the bf16 pair rows, or NULL */
    (void)vp;
    if (ws->plain_block) memset(k.plain, 0, (size_t)(acc * D) * sizeof(float));
    if (ws->lane_block) memset(k.lanes, 0, (size_t)(acc * 4 * D) * sizeof(float));
    /* rows far apart in memory: a later row's lines asked for (QK_AHEAD) */
    qk_row_pos at = qk_row_at(a, X->heads, k.by_token, r0),
               ahead = qk_row_at(a, X->heads, k.by_token, r0 + QK_AHEAD);
    for (int64_t r = r0; r < r1;) {
#ifdef PE_VW
        if (rows8) {
            const int n = r1 - r < 8 ? (int)(r1 - r) : 8;
            qk_backward_rows8(a, X, dt, m.v[0], vp, r, r1, &at, &ahead, n, m.rows8, m.g, ws, &k,
                              hw, m.stream);
            r += n;
            continue;
        }
#endif
        if (r + QK_AHEAD < r1) qk_backward_prefetch(a, X, es, ahead);
        const qk_row_pos pos = at;
        const qk_bwd_row w = qk_backward_row_at(a, X, es, pos);
        qk_row_next(a, X->heads, k.by_token, &at), qk_row_next(a, X->heads, k.by_token, &ahead);
#ifdef PE_VW
        if (vec) {
            if (!hw || qk_backward_row_vec(a, dt, m.v[0], w.x, w.grad, w.cos, w.sin, w.dx, w.r,
                                           w.p, &m, 1)) {
                if (hw && m.stream) _mm_sfence();
                qk_backward_row_vec(a, dt, m.v[0], w.x, w.grad, w.cos, w.sin, w.dx, w.r, w.p,
                                    &m, 0);
            }
        } else
#endif
        {
            qk_tables_f32(a, w.b, w.t, 1, m.c, m.ss, m.s);
            qk_backward_row(a, dt, m.w[0], w.x, w.grad, w.dx, w.r, w.p, &m);
        }
        qk_walk_add(a, &k, ws, pos, m.g);
        ++r;
    }
#ifdef PE_VW
    if (m.stream) _mm_sfence(); /* before the rows are done */
#endif
}

/* The entry points of qk_norm_<isa>.c (internal.h), for each dtype. */
#define PE_QK_DEFINE(isa)                                                                      \
    void pe_qk_norm_rows_f32_##isa(const pe_qk_norm_args *a, const pe_qk_plan *p, int64_t i0,  \
                                   int64_t n, void *scratch) {                                 \
        switch (a->dtype) {                                                                    \
        case PE_BFLOAT16: qk_forward_rows_dt(a, p, i0, n, scratch, PE_BFLOAT16); break;        \
        case PE_FLOAT16: qk_forward_rows_dt(a, p, i0, n, scratch, PE_FLOAT16); break;          \
        default: qk_forward_rows_dt(a, p, i0, n, scratch, PE_FLOAT32); break;                  \
        }                                                                                      \
    }                                                                                          \
    void pe_qk_norm_bwd_f32_##isa(const pe_qk_norm_args *a, const pe_qk_plan *p, int tensor,    \
                                  int64_t r0, int64_t r1, const pe_qk_wsum *ws, void *scratch) { \
        switch (a->dtype) {                                                                    \
        case PE_BFLOAT16:                                                                      \
            qk_backward_rows_dt(a, p, tensor, r0, r1, ws, scratch, PE_BFLOAT16);               \
            break;                                                                             \
        case PE_FLOAT16:                                                                       \
            qk_backward_rows_dt(a, p, tensor, r0, r1, ws, scratch, PE_FLOAT16);                \
            break;                                                                             \
        default: qk_backward_rows_dt(a, p, tensor, r0, r1, ws, scratch, PE_FLOAT32); break;    \
        }                                                                                      \
    }

#endif /* POSENC_QK_NORM_F32_H */

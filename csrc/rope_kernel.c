/*
 * RoPE kernels, compiled once per instruction set (see meson.build): PE_ISA_SUFFIX names
 * the variant (_baseline, _avx2, _avx512) and the compiler flags of that build select the
 * vector instructions.  The loops are written for the auto-vectorizer: unit-stride, no
 * aliasing (restrict), no fused multiply-add (-ffp-contract=off keeps HF's rounding).
 */
#include <math.h>
#include <stdlib.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "internal.h"

#ifndef PE_ISA_SUFFIX
#error "PE_ISA_SUFFIX must name the instruction-set variant"
#endif
#define PE_CAT2(a, b) a##b
#define PE_CAT(a, b) PE_CAT2(a, b)
#define PE_ISA_FN(name) PE_CAT(name, PE_ISA_SUFFIX)

/* Per-call layout facts shared by every token. */
typedef struct pe_row_plan {
    int64_t axes;            /* A: 1 or 3 table axes */
    uint8_t *chan_axis;      /* R: axis of channel e */
    int64_t *slot_pos_off;   /* R/2: position offset of slot i's axis */
} pe_row_plan;

/*
 * sin and cos of fp32 angles, each result scaled by `scaling` in fp32.  The reduction and
 * polynomials run in fp64 (Cody-Waite with a 33+33+53-bit pi/2, fdlibm's kernel
 * coefficients), so the fp32 results are correctly rounded except in rare ties; angles
 * beyond the reduction's exact range go through libm.
 */
static void pe_sincos_scaled(const float *restrict ang, float *restrict c, float *restrict s,
                             int64_t n, float scaling) {
    const double two_over_pi = 6.36619772367581382433e-01;
    const double p1 = 1.57079632673412561417e+00, p2 = 6.07710050630396597660e-11,
                 p3 = 2.02226624879595063154e-21;
    const double S1 = -1.66666666666666324348e-01, S2 = 8.33333333332248946124e-03,
                 S3 = -1.98412698298579493134e-04, S4 = 2.75573137070700676789e-06,
                 S5 = -2.50507602534068634195e-08, S6 = 1.58969099521155010221e-10;
    const double C1 = 4.16666666666666019037e-02, C2 = -1.38888888888741095749e-03,
                 C3 = 2.48015872894767294178e-05, C4 = -2.75573143513906633035e-07,
                 C5 = 2.08757232129817482790e-09, C6 = -1.13596475577881948265e-11;
    const double limit = 823549.6; /* |k| < 2^19: k * p1 is exact */
    int any_large = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double x = (double)ang[i];
        const double k = nearbyint(x * two_over_pi);
        const double r = ((x - k * p1) - k * p2) - k * p3;
        const double z = r * r;
        const double sr = r + r * z * (S1 + z * (S2 + z * (S3 + z * (S4 + z * (S5 + z * S6)))));
        const double cr = 1.0 - 0.5 * z + z * z * (C1 + z * (C2 + z * (C3 + z * (C4 + z * (C5 + z * C6)))));
        const double q = k - 4.0 * floor(k * 0.25); /* quadrant 0..3 */
        const int odd = q == 1.0 || q == 3.0;
        const double sv = odd ? cr : sr, cv = odd ? sr : cr;
        const double ssign = q >= 2.0 ? -1.0 : 1.0;
        const double csign = (q == 1.0 || q == 2.0) ? -1.0 : 1.0;
        s[i] = (float)(ssign * sv) * scaling;
        c[i] = (float)(csign * cv) * scaling;
        any_large |= fabs(x) > limit;
    }
    if (any_large) {
        for (int64_t i = 0; i < n; ++i) {
            const double x = (double)ang[i];
            if (fabs(x) > limit || x != x) {
                s[i] = (float)sin(x) * scaling;
                c[i] = (float)cos(x) * scaling;
            }
        }
    }
}

/*
 * Fast rows for the common case: half pairing, same dtype in and out, fp32 compute.  One
 * pass over all heads of a token reads both halves of each row, rotates and stores with
 * the conversion inline; nothing goes through a scratch buffer.  xs, os: head strides.
 */
#define PE_ROT_HALF_ROW(name, T, load, store)                                                \
    static inline __attribute__((always_inline)) void name##_body(                           \
        const T *restrict x, int64_t xs, T *restrict o, int64_t os, int64_t nh,              \
        const float *restrict c, const float *restrict ss, int64_t h) {                      \
        for (int64_t hd = 0; hd < nh; ++hd, x += xs, o += os) {                              \
            for (int64_t e = 0; e < h; ++e) {                                                \
                const float x0 = load(x[e]), x1 = load(x[e + h]);                            \
                o[e] = store(x0 * c[e] + x1 * ss[e]);                                        \
                o[e + h] = store(x1 * c[e + h] + x0 * ss[e + h]);                            \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    /* head_dim 128 (h = 64) gets a fully unrolled copy */                                   \
    static void name(const T *x, int64_t xs, T *o, int64_t os, int64_t nh, const float *c,   \
                     const float *ss, int64_t h) {                                           \
        if (h == 64)                                                                         \
            name##_body(x, xs, o, os, nh, c, ss, 64);                                        \
        else                                                                                 \
            name##_body(x, xs, o, os, nh, c, ss, h);                                         \
    }

static inline float pe_id_f32(float v) { return v; }
static inline float pe_h2f(_Float16 v) { return (float)v; }
static inline _Float16 pe_f2h(float v) { return (_Float16)v; }
PE_ROT_HALF_ROW(rot_half_f32, float, pe_id_f32, pe_id_f32)
PE_ROT_HALF_ROW(rot_half_bf16, uint16_t, pe_bf16_to_f32, pe_f32_to_bf16)

#if defined(__F16C__)
/* The vectorizer does not use F16C for _Float16 loops; convert 8 or 16 lanes explicitly. */
static void rot_half_f16_row(const _Float16 *restrict x, _Float16 *restrict o,
                             const float *restrict c, const float *restrict ss, int64_t h) {
    int64_t e = 0;
#if defined(__AVX512F__)
    for (; e + 16 <= h; e += 16) {
        const __m512 x0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + e)));
        const __m512 x1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + e + h)));
        const __m512 o0 = _mm512_add_ps(_mm512_mul_ps(x0, _mm512_loadu_ps(c + e)),
                                        _mm512_mul_ps(x1, _mm512_loadu_ps(ss + e)));
        const __m512 o1 = _mm512_add_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(c + e + h)),
                                        _mm512_mul_ps(x0, _mm512_loadu_ps(ss + e + h)));
        _mm256_storeu_si256((__m256i *)(o + e), _mm512_cvtps_ph(o0, _MM_FROUND_TO_NEAREST_INT));
        _mm256_storeu_si256((__m256i *)(o + e + h), _mm512_cvtps_ph(o1, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; e + 8 <= h; e += 8) {
        const __m256 x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + e)));
        const __m256 x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + e + h)));
        const __m256 o0 = _mm256_add_ps(_mm256_mul_ps(x0, _mm256_loadu_ps(c + e)),
                                        _mm256_mul_ps(x1, _mm256_loadu_ps(ss + e)));
        const __m256 o1 = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + e + h)),
                                        _mm256_mul_ps(x0, _mm256_loadu_ps(ss + e + h)));
        _mm_storeu_si128((__m128i *)(o + e), _mm256_cvtps_ph(o0, _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128((__m128i *)(o + e + h), _mm256_cvtps_ph(o1, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; e < h; ++e) {
        const float x0 = (float)x[e], x1 = (float)x[e + h];
        o[e] = (_Float16)(x0 * c[e] + x1 * ss[e]);
        o[e + h] = (_Float16)(x1 * c[e + h] + x0 * ss[e + h]);
    }
}

static void rot_half_f16(const _Float16 *x, int64_t xs, _Float16 *o, int64_t os, int64_t nh,
                         const float *c, const float *ss, int64_t h) {
    for (int64_t hd = 0; hd < nh; ++hd) rot_half_f16_row(x + hd * xs, o + hd * os, c, ss, h);
}
#else
PE_ROT_HALF_ROW(rot_half_f16, _Float16, pe_h2f, pe_f2h)
#endif

/* Rotates the nh heads of one token if the fast rows cover the dtype; returns 1 if so. */
static int rot_half_heads(const void *in, int64_t xs, void *out, int64_t os, int64_t nh,
                          pe_dtype dt, const float *c, const float *ss, int64_t R) {
    switch (dt) {
    case PE_FLOAT32:
        rot_half_f32((const float *)in, xs, (float *)out, os, nh, c, ss, R / 2);
        return 1;
    case PE_BFLOAT16:
        rot_half_bf16((const uint16_t *)in, xs, (uint16_t *)out, os, nh, c, ss, R / 2);
        return 1;
    case PE_FLOAT16:
        rot_half_f16((const _Float16 *)in, xs, (_Float16 *)out, os, nh, c, ss, R / 2);
        return 1;
    default:
        return 0;
    }
}

#define REAL float
#define RF(n) n##_f32
#define RF_native PE_FLOAT32
#define RF_FAST_ROWS 1
#include "rope_core.inc"
#undef REAL
#undef RF
#undef RF_native
#undef RF_FAST_ROWS

#define REAL double
#define RF(n) n##_f64
#define RF_native PE_FLOAT64
#define RF_FAST_ROWS 0
#include "rope_core.inc"
#undef REAL
#undef RF
#undef RF_native

static void plan_free(pe_row_plan *p) {
    free(p->chan_axis);
    free(p->slot_pos_off);
}

static int plan_make(const pe_rope_args *a, pe_row_plan *p) {
    const int64_t R = a->rot_dim, nslot = R / 2;
    const pe_rope_source *src = &a->src;
    const uint8_t *axis = src->axis_of_slot;
    p->axes = axis ? 3 : 1;
    p->chan_axis = (uint8_t *)calloc((size_t)R + 1, 1);
    p->slot_pos_off = (int64_t *)calloc((size_t)nslot + 1, sizeof(int64_t));
    if (!p->chan_axis || !p->slot_pos_off) {
        plan_free(p);
        return PE_ERR_NOMEM;
    }
    for (int64_t e = 0; e < R; ++e) p->chan_axis[e] = axis ? axis[pe_slot(a->pairing, e, R)] : 0;
    for (int64_t i = 0; i < nslot; ++i) p->slot_pos_off[i] = (axis ? axis[i] : 0) * src->pos_stride[0];
    return PE_OK;
}

/* The fp64 core runs when any tensor of the call is fp64. */
static int wants_f64(const pe_rope_args *a, pe_dtype extra) {
    int f64 = a->q.in_dtype == PE_FLOAT64 || a->q.out_dtype == PE_FLOAT64 || extra == PE_FLOAT64;
    if (a->k.heads) f64 |= a->k.in_dtype == PE_FLOAT64 || a->k.out_dtype == PE_FLOAT64;
    if (!a->src.pos) f64 |= a->src.table_dtype == PE_FLOAT64;
    return f64;
}

int PE_ISA_FN(pe_rope_apply)(const pe_rope_args *a) {
    pe_row_plan plan;
    int rc = plan_make(a, &plan);
    if (rc) return rc;
    rc = wants_f64(a, PE_FLOAT32) ? apply_f64(a, &plan) : apply_f32(a, &plan);
    plan_free(&plan);
    return rc;
}

int PE_ISA_FN(pe_rope_table_grad)(const pe_rope_args *a, const void *gq, const int64_t gqs[3],
                                  const void *gk, const int64_t gks[3], pe_dtype gdt,
                                  void *dcos, void *dsin) {
    pe_row_plan plan;
    int rc = plan_make(a, &plan);
    if (rc) return rc;
    rc = wants_f64(a, gdt) ? table_grad_f64(a, &plan, gq, gqs, gk, gks, gdt, dcos, dsin)
                           : table_grad_f32(a, &plan, gq, gqs, gk, gks, gdt, dcos, dsin);
    plan_free(&plan);
    return rc;
}

int PE_ISA_FN(pe_rope_tables)(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin) {
    pe_row_plan plan;
    int rc = plan_make(a, &plan);
    if (rc) return rc;
    const int64_t Bp = a->src.pos_batch, T = a->seq, R = a->rot_dim;
    const int64_t nrow = Bp * T;
    const size_t oes = pe_dtype_size(out_dtype);
    const int nt = (a->nthreads > 1 && nrow * R >= PE_SERIAL_ELEMENTS) ? a->nthreads : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *buf = (float *)malloc((size_t)(2 * R + 3 * (R / 2) + 1) * sizeof(float));
        /* positions only: the MRoPE table rows are never read here */
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nrow; ++i) {
            if (!buf) continue;
            const int64_t b = i / T, t = i % T;
            token_tables_f32(a, &plan, b, t, buf, buf + R, NULL, buf + 2 * R);
            store_row_f32((char *)cos + i * R * (int64_t)oes, buf, out_dtype, R);
            store_row_f32((char *)sin + i * R * (int64_t)oes, buf + R, out_dtype, R);
        }
        free(buf);
    }
    plan_free(&plan);
    return failed ? PE_ERR_NOMEM : rc;
}

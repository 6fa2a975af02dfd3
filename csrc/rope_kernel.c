/*
 * RoPE kernels, compiled once per instruction set (see meson.build): PE_ISA_SUFFIX names
 * the variant (_baseline, _avx2, _avx512) and the compiler flags of that build select the
 * vector instructions.  Most loops are written for the auto-vectorizer (unit stride, no
 * aliasing); the hot rows use intrinsics.  No fused multiply-add anywhere
 * (-ffp-contract=off, and explicit mul + add), which keeps transformers' rounding.
 */
#include <stdlib.h>

#if defined(__AVX2__) || defined(__AVX512F__)
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
    int64_t nruns;           /* channels as runs of one axis: [run_start[i], run_start[i+1]) */
    int64_t *run_start;      /* nruns + 1 entries */
    int stream;              /* outputs large enough for streaming stores */
    int64_t *slot_pos_off;   /* R/2: position offset of slot i's axis */
} pe_row_plan;

/* scaling * cos, scaling * sin of n fp32 angles (rope_math.h): a branch-free pass over
 * all of them, then the rare angles beyond the fast reduction again. */
static void pe_sincos_scaled(const float *restrict ang, float *restrict c, float *restrict s,
                             int64_t n, float scaling) {
    int any_large = 0;
    for (int64_t i = 0; i < n; ++i) {
        pe_sincos_fast(ang[i], scaling, c + i, s + i);
        any_large |= !(ang[i] <= PE_SINCOS_FAST_LIMIT && ang[i] >= -PE_SINCOS_FAST_LIMIT);
    }
    if (any_large) {
        for (int64_t i = 0; i < n; ++i)
            if (!(ang[i] <= PE_SINCOS_FAST_LIMIT && ang[i] >= -PE_SINCOS_FAST_LIMIT))
                pe_sincos_large(ang[i], scaling, c + i, s + i);
    }
}

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
#define PE_INLINE static inline __attribute__((always_inline))
PE_INLINE pe_vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
PE_INLINE pe_vf vf_rot(pe_vf a, pe_vf ca, pe_vf b, pe_vf sb) {
    return _mm512_add_ps(_mm512_mul_ps(a, ca), _mm512_mul_ps(b, sb));
}
PE_INLINE pe_vf vx_load(const char *p, pe_dtype dt) {
    if (dt == PE_FLOAT32) return _mm512_loadu_ps((const float *)p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (dt == PE_FLOAT16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PE_INLINE void vx_store16(char *p, __m256i v, int nt) {
    if (nt) _mm256_stream_si256((__m256i *)p, v);
    else _mm256_storeu_si256((__m256i *)p, v);
}
/* nt: non-temporal (streaming) store; p must then be aligned to the vector size */
PE_INLINE void vx_store(char *p, pe_vf v, pe_dtype dt, int nt) {
    if (dt == PE_FLOAT32) {
        if (nt) _mm512_stream_ps((float *)p, v);
        else _mm512_storeu_ps((float *)p, v);
    } else if (dt == PE_FLOAT16) {
        vx_store16(p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT), nt);
    } else { /* bf16: round to nearest even on the bits; NaN stays a (quiet) NaN */
        const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
        const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
        r = _mm512_srli_epi32(r, 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
        vx_store16(p, _mm512_cvtepi32_epi16(r), nt);
    }
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
    vx_store(tmp, v, dt, 0);
    _mm256_mask_storeu_epi16(p, m, _mm256_loadu_si256((const __m256i *)tmp));
}
#elif defined(__AVX2__) && defined(__F16C__)
#define PE_VW 8
typedef __m256 pe_vf;
#define PE_INLINE static inline __attribute__((always_inline))
PE_INLINE pe_vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
PE_INLINE pe_vf vf_rot(pe_vf a, pe_vf ca, pe_vf b, pe_vf sb) {
    return _mm256_add_ps(_mm256_mul_ps(a, ca), _mm256_mul_ps(b, sb));
}
PE_INLINE pe_vf vx_load(const char *p, pe_dtype dt) {
    if (dt == PE_FLOAT32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == PE_FLOAT16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
PE_INLINE void vx_store16(char *p, __m128i v, int nt) {
    if (nt) _mm_stream_si128((__m128i *)p, v);
    else _mm_storeu_si128((__m128i *)p, v);
}
PE_INLINE void vx_store(char *p, pe_vf v, pe_dtype dt, int nt) {
    if (dt == PE_FLOAT32) {
        if (nt) _mm256_stream_ps((float *)p, v);
        else _mm256_storeu_ps((float *)p, v);
    } else if (dt == PE_FLOAT16) {
        vx_store16(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT), nt);
    } else { /* bf16, as above; packus keeps the 16-bit results, permute joins the lanes */
        const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
        const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
        r = _mm256_srli_epi32(r, 16);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)),
                               _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
        vx_store16(p, _mm256_castsi256_si128(r), nt);
    }
}
#else
#define PE_INLINE static inline __attribute__((always_inline))
#endif

PE_INLINE float sx_load(const char *p, pe_dtype dt) {
    uint16_t h;
    if (dt == PE_FLOAT32) return *(const float *)p;
    memcpy(&h, p, 2);
    return dt == PE_FLOAT16 ? pe_f16_to_f32(h) : pe_bf16_to_f32(h);
}

PE_INLINE void sx_store(char *p, float v, pe_dtype dt) {
    if (dt == PE_FLOAT32) {
        *(float *)p = v;
        return;
    }
    const uint16_t h = dt == PE_FLOAT16 ? pe_f32_to_f16(v) : pe_f32_to_bf16(v);
    memcpy(p, &h, 2);
}

/* out[e] = x[e] c[e] + x[e+h] ss[e],  out[e+h] = x[e+h] c[e+h] + x[e] ss[e+h] */
PE_INLINE void rot_half_row(const char *restrict x, char *restrict o, const float *restrict c,
                            const float *restrict ss, int64_t h, pe_dtype dt, int nt) {
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2, hb = h * es;
    int64_t e = 0;
#ifdef PE_VW
    for (; e + PE_VW <= h; e += PE_VW) {
        const pe_vf x0 = vx_load(x + e * es, dt), x1 = vx_load(x + e * es + hb, dt);
        vx_store(o + e * es, vf_rot(x0, vf_load(c + e), x1, vf_load(ss + e)), dt, nt);
        vx_store(o + e * es + hb, vf_rot(x1, vf_load(c + e + h), x0, vf_load(ss + e + h)), dt, nt);
    }
#endif
#ifdef PE_VTAIL
    if (e < h) {
        const int64_t n = h - e;
        const pe_vf x0 = vx_load_n(x + e * es, dt, n), x1 = vx_load_n(x + e * es + hb, dt, n);
        vx_store_n(o + e * es, vf_rot(x0, vf_load_n(c + e, n), x1, vf_load_n(ss + e, n)), dt, n);
        vx_store_n(o + e * es + hb,
                   vf_rot(x1, vf_load_n(c + e + h, n), x0, vf_load_n(ss + e + h, n)), dt, n);
        return;
    }
#endif
    for (; e < h; ++e) {
        const float x0 = sx_load(x + e * es, dt), x1 = sx_load(x + e * es + hb, dt);
        sx_store(o + e * es, pe_rot_f32(x0, c[e], x1, ss[e]), dt);
        sx_store(o + e * es + hb, pe_rot_f32(x1, c[e + h], x0, ss[e + h]), dt);
    }
}

/*
 * Streaming (non-temporal) stores skip reading the output lines before writing them, which
 * a large output would otherwise pay for in memory traffic; every vector store must then be
 * aligned, so rows whose starts or halves are not 64-byte aligned use ordinary stores.
 */
PE_INLINE void rot_half_rows(const char *x, int64_t xs, char *o, int64_t os, int64_t nh,
                             const float *c, const float *ss, int64_t h, pe_dtype dt, int stream) {
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2;
    const int aligned = (uintptr_t)o % 64 == 0 && (os * es) % 64 == 0 && (h * es) % 64 == 0;
    if (stream && aligned) {
        for (int64_t hd = 0; hd < nh; ++hd)
            rot_half_row(x + hd * xs * es, o + hd * os * es, c, ss, h, dt, 1);
    } else {
        for (int64_t hd = 0; hd < nh; ++hd)
            rot_half_row(x + hd * xs * es, o + hd * os * es, c, ss, h, dt, 0);
    }
}

#ifdef PE_VW
/* n values of a 16-bit or fp32 dtype to fp32, a vector at a time (short MRoPE runs too). */
PE_INLINE void to_f32_vec(float *restrict dst, const char *restrict src, int64_t n, pe_dtype dt) {
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2;
    int64_t i = 0;
    for (; i + PE_VW <= n; i += PE_VW)
        vx_store((char *)(dst + i), vx_load(src + i * es, dt), PE_FLOAT32, 0);
    for (; i < n; ++i) dst[i] = sx_load(src + i * es, dt);
}

/* Returns 1 if dt is one the vector conversion handles. */
static int load_f32_vec(float *dst, const void *src, pe_dtype dt, int64_t n) {
    switch (dt) {
    case PE_FLOAT32: to_f32_vec(dst, (const char *)src, n, PE_FLOAT32); return 1;
    case PE_BFLOAT16: to_f32_vec(dst, (const char *)src, n, PE_BFLOAT16); return 1;
    case PE_FLOAT16: to_f32_vec(dst, (const char *)src, n, PE_FLOAT16); return 1;
    default: return 0;
    }
}
#endif

/* Rotates the nh heads of one token (head strides xs, os in elements) if the fast rows
 * cover the dtype; returns 1 if so.  head_dim 128 (h = 64) gets a fully unrolled copy. */
static int rot_half_heads(const void *in, int64_t xs, void *out, int64_t os, int64_t nh,
                          pe_dtype dt, const float *c, const float *ss, int64_t R, int stream) {
    const char *x = (const char *)in;
    char *o = (char *)out;
    const int64_t h = R / 2;
    switch (dt) {
    case PE_FLOAT32:
        if (h == 64) rot_half_rows(x, xs, o, os, nh, c, ss, 64, PE_FLOAT32, stream);
        else rot_half_rows(x, xs, o, os, nh, c, ss, h, PE_FLOAT32, stream);
        return 1;
    case PE_BFLOAT16:
        if (h == 64) rot_half_rows(x, xs, o, os, nh, c, ss, 64, PE_BFLOAT16, stream);
        else rot_half_rows(x, xs, o, os, nh, c, ss, h, PE_BFLOAT16, stream);
        return 1;
    case PE_FLOAT16:
        if (h == 64) rot_half_rows(x, xs, o, os, nh, c, ss, 64, PE_FLOAT16, stream);
        else rot_half_rows(x, xs, o, os, nh, c, ss, h, PE_FLOAT16, stream);
        return 1;
    default:
        return 0;
    }
}

/* Orders this thread's streaming stores before the call returns. */
static inline void store_fence(void) {
#ifdef PE_VW
    _mm_sfence();
#endif
}

#define REAL float
#define RF(n) n##_f32
static inline float rot_f32(float x, float c, float xp, float ss) { return pe_rot_f32(x, c, xp, ss); }
static inline uint16_t to_bf16_f32(float v) { return pe_f32_to_bf16(v); }
static inline uint16_t to_f16_f32(float v) { return pe_f32_to_f16(v); }
#define RF_native PE_FLOAT32
#define RF_FAST_ROWS 1
#include "rope_core.inc"
#undef REAL
#undef RF
#undef RF_native
#undef RF_FAST_ROWS

#define REAL double
#define RF(n) n##_f64
static inline double rot_f64(double x, double c, double xp, double ss) { return pe_rot_f64(x, c, xp, ss); }
static inline uint16_t to_bf16_f64(double v) { return pe_f64_to_bf16(v); }
static inline uint16_t to_f16_f64(double v) { return pe_f64_to_f16(v); }
#define RF_native PE_FLOAT64
#define RF_FAST_ROWS 0
#include "rope_core.inc"
#undef REAL
#undef RF
#undef RF_native

static void plan_free(pe_row_plan *p) {
    free(p->chan_axis);
    free(p->slot_pos_off);
    free(p->run_start);
}

static int plan_make(const pe_rope_args *a, pe_row_plan *p) {
    const int64_t R = a->rot_dim, nslot = R / 2;
    const pe_rope_source *src = &a->src;
    const uint8_t *axis = src->axis_of_slot;
    p->axes = axis ? 3 : 1;
    p->stream = 0;
    p->chan_axis = (uint8_t *)calloc((size_t)R + 1, 1);
    p->slot_pos_off = (int64_t *)calloc((size_t)nslot + 1, sizeof(int64_t));
    p->run_start = (int64_t *)calloc((size_t)R + 1, sizeof(int64_t));
    if (!p->chan_axis || !p->slot_pos_off || !p->run_start) {
        plan_free(p);
        return PE_ERR_NOMEM;
    }
    p->nruns = 0;
    for (int64_t e = 0; e < R; ++e) {
        p->chan_axis[e] = axis ? axis[pe_slot(a->pairing, e, R)] : 0;
        if (e == 0 || p->chan_axis[e] != p->chan_axis[e - 1]) p->run_start[p->nruns++] = e;
    }
    p->run_start[p->nruns] = R;
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
    const int64_t rows = a->batch * a->seq, D = a->head_dim;
    plan.stream = rows * D * (a->q.heads * (int64_t)pe_dtype_size(a->q.out_dtype) +
                              a->k.heads * (int64_t)pe_dtype_size(a->k.out_dtype)) >=
                  PE_STREAM_BYTES;
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

/*
 * Torch-free tests of the RoPE kernels against a scalar fp64 reference written from the
 * specification in posenc.h.  Every case runs on every SIMD variant the CPU supports.
 */
#include <math.h>
#ifdef PE_HAVE_AVX512BF16
#include <cpuid.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "posenc.h"
#include "check.h"

static unsigned rng_state = 12345u;

static double urand(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return ((rng_state >> 8) / 16777216.0) * 2.0 - 1.0;
}

static void put(void *p, pe_dtype dt, int64_t i, double v) {
    switch (dt) {
    case PE_FLOAT32: ((float *)p)[i] = (float)v; break;
    case PE_FLOAT64: ((double *)p)[i] = v; break;
    case PE_BFLOAT16: ((uint16_t *)p)[i] = pe_f32_to_bf16((float)v); break;
    case PE_FLOAT16: ((uint16_t *)p)[i] = pe_f32_to_f16((float)v); break;
    }
}

static double get(const void *p, pe_dtype dt, int64_t i) {
    switch (dt) {
    case PE_FLOAT32: return ((const float *)p)[i];
    case PE_FLOAT64: return ((const double *)p)[i];
    case PE_BFLOAT16: return pe_bf16_to_f32(((const uint16_t *)p)[i]);
    case PE_FLOAT16: return pe_f16_to_f32(((const uint16_t *)p)[i]);
    }
    return NAN;
}

static int64_t partner(pe_pairing p, int64_t e, int64_t R) {
    if (p == PE_PAIR_HALF) return e < R / 2 ? e + R / 2 : e - R / 2;
    return e ^ 1;
}

static double sign_of(pe_pairing p, int64_t e, int64_t R) {
    if (p == PE_PAIR_HALF) return e < R / 2 ? -1.0 : 1.0;
    return (e & 1) ? 1.0 : -1.0;
}

/* v (exact in the compute precision) stored as dt: the expected value, read back.  The
 * conversions themselves are checked for correct rounding by math_cases. */
static double stored(double v, pe_dtype dt, int f64) {
    switch (dt) {
    case PE_FLOAT64: return v;
    case PE_FLOAT32: return (float)v;
    case PE_BFLOAT16: return pe_bf16_to_f32(f64 ? pe_f64_to_bf16(v) : pe_f32_to_bf16((float)v));
    case PE_FLOAT16: return pe_f16_to_f32(f64 ? pe_f64_to_f16(v) : pe_f32_to_f16((float)v));
    }
    return NAN;
}

/* x c + sg (xp s), each product and the sum rounded in fp32 or fp64: the kernels' order. */
static double rot_ref(double x, double c, double sg, double xp, double s, int f64) {
    if (f64) return x * c + sg * (xp * s);
    const float a = (float)x * (float)c, b = (float)xp * (float)s;
    return (double)(a + (float)sg * b);
}

enum { EXPAND_BATCH = 1, EXPAND_HEADS = 2, EXPAND_TABLE_T = 4 };

typedef struct {
    int64_t B, T, Hq, Hk, D, R, Bc;
    pe_pairing pairing;
    pe_dtype dt, tdt;
    int mrope, interleaved;
    int gap;      /* extra elements between heads: non-contiguous views */
    pe_dtype dk;  /* k's dtype (in and out); q uses dt */
    int out;      /* output dtype of q and k, or -1: the input's (else mixed, bf16 -> fp32) */
    int expand;   /* EXPAND_*: stride-0 (expanded) q and k batch or heads, table tokens */
    int outer;    /* inputs with the heads outer in memory, (B, H, T, D) (else (B, T, H, D)) */
} rope_case;

/* Runs one case forward and transpose; every output element must equal the reference
 * computed in the kernel's precision and order and rounded once (exact comparison). */
static void run_case(const rope_case *c, const char *isa) {
    const int64_t A = c->mrope ? 3 : 1;
    const int64_t sh = c->D + c->gap;
    const int64_t heads[2] = {c->Hq, c->Hk};
    const pe_dtype din[2] = {c->dt, c->dk};
    pe_dtype dout[2] = {c->dt, c->dk};
    if (c->out >= 0) dout[0] = dout[1] = (pe_dtype)c->out;
    const size_t tes = pe_dtype_size(c->tdt);
    void *ins[2], *outs[2];
    int64_t ist[2][3], ost[2][3];
    for (int j = 0; j < 2; ++j) {
        const int64_t st = heads[j] * sh;
        ist[j][0] = (c->expand & EXPAND_BATCH) ? 0 : c->T * st;
        ist[j][1] = c->outer ? sh : st;
        ist[j][2] = (c->expand & EXPAND_HEADS) ? 0 : c->outer ? c->T * sh : sh;
        ost[j][0] = c->T * heads[j] * c->D;
        ost[j][1] = heads[j] * c->D;
        ost[j][2] = c->D;
        const int64_t nin = c->B * c->T * st, nout = c->B * c->T * heads[j] * c->D;
        ins[j] = calloc((size_t)nin + 1, pe_dtype_size(din[j]));
        /* 64-byte aligned and untouched: large outputs are fresh pages (see big below) */
        const size_t obytes = ((size_t)nout + 1) * pe_dtype_size(dout[j]);
        outs[j] = aligned_alloc(64, (obytes + 63) / 64 * 64);
        for (int64_t i = 0; i < nin; ++i) put(ins[j], din[j], i, urand());
    }
    const int64_t ntab = A * c->Bc * c->T * c->R;
    void *cs = malloc((size_t)ntab * tes), *sn = malloc((size_t)ntab * tes);
    for (int64_t i = 0; i < ntab; ++i) {
        put(cs, c->tdt, i, urand());
        put(sn, c->tdt, i, urand());
    }
    const int64_t tst[3] = {c->Bc * c->T * c->R, c->T * c->R,
                            (c->expand & EXPAND_TABLE_T) ? 0 : c->R};
    uint8_t axis[256];
    int64_t sec[3] = {c->R / 2 - 2 * (c->R / 6), c->R / 6, c->R / 6};
    if (c->mrope) CHECK(pe_mrope_axis_map(c->R / 2, sec, c->interleaved, axis) == PE_OK, "axis map");

    for (int transpose = 0; transpose < 2; ++transpose) {
        pe_rope_args a;
        memset(&a, 0, sizeof a);
        a.batch = c->B; a.seq = c->T; a.head_dim = c->D; a.rot_dim = c->R;
        a.pairing = c->pairing; a.transpose = transpose; a.nthreads = 2;
        a.src.cos = cs; a.src.sin = sn; a.src.table_dtype = c->tdt; a.src.table_batch = c->Bc;
        memcpy(a.src.table_stride, tst, sizeof tst);
        a.src.axis_of_slot = c->mrope ? axis : NULL;
        pe_rope_tensor *ts[2] = {&a.q, &a.k};
        for (int j = 0; j < 2; ++j) {
            ts[j]->in = ins[j]; ts[j]->out = outs[j];
            ts[j]->in_dtype = din[j]; ts[j]->out_dtype = dout[j];
            ts[j]->heads = heads[j];
            memcpy(ts[j]->in_stride, ist[j], sizeof ist[j]);
            memcpy(ts[j]->out_stride, ost[j], sizeof ost[j]);
        }
        CHECK(pe_rope_apply(&a) == PE_OK, "apply failed");
        int64_t wrong = 0;
        double first_got = 0, first_want = 0;
        for (int j = 0; j < 2; ++j) {
            const int f64 = din[j] == PE_FLOAT64 || dout[j] == PE_FLOAT64 || c->tdt == PE_FLOAT64;
            for (int64_t b = 0; b < c->B; ++b)
                for (int64_t t = 0; t < c->T; ++t)
                    for (int64_t h = 0; h < heads[j]; ++h)
                        for (int64_t e = 0; e < c->D; ++e) {
                            const int64_t base = b * ist[j][0] + t * ist[j][1] + h * ist[j][2];
                            const double x = get(ins[j], din[j], base + e);
                            double ref = x;
                            if (e < c->R) {
                                const int64_t p = partner(c->pairing, e, c->R);
                                const int64_t se = transpose ? p : e; /* sine index */
                                const int64_t ax = c->mrope ? axis[pe_slot(c->pairing, se, c->R)] : 0;
                                const int64_t axc = c->mrope ? axis[pe_slot(c->pairing, e, c->R)] : 0;
                                const int64_t row = (c->Bc == 1 ? 0 : b) * tst[1] + t * tst[2];
                                const double cv = get(cs, c->tdt, axc * tst[0] + row + e);
                                const double sv = get(sn, c->tdt, ax * tst[0] + row + se);
                                const double xp = get(ins[j], din[j], base + p);
                                const double sg = transpose ? -sign_of(c->pairing, e, c->R)
                                                            : sign_of(c->pairing, e, c->R);
                                ref = rot_ref(x, cv, sg, xp, sv, f64);
                            }
                            const double want = stored(ref, dout[j], f64);
                            const double got = get(outs[j], dout[j],
                                                   b * ost[j][0] + t * ost[j][1] + h * ost[j][2] + e);
                            if (got != want && !wrong++) {
                                first_got = got;
                                first_want = want;
                            }
                        }
        }
        CHECK(wrong == 0, "%s B=%ld T=%ld Hq=%ld Hk=%ld D=%ld R=%ld pair=%d q=%d k=%d out=%d "
              "tables=%d mrope=%d/%d expand=%d outer=%d transpose=%d: %ld wrong (first %.9g, "
              "want %.9g)",
              isa, (long)c->B, (long)c->T, (long)c->Hq, (long)c->Hk, (long)c->D, (long)c->R,
              c->pairing, c->dt, c->dk, c->out, c->tdt, c->mrope, c->interleaved, c->expand,
              c->outer, transpose, (long)wrong, first_got, first_want);
    }
    for (int j = 0; j < 2; ++j) {
        free(ins[j]);
        free(outs[j]);
    }
    free(cs);
    free(sn);
}

/* Ulp distance of two finite floats of the same sign (or both zero). */
static int64_t f32_ulps(float a, float b) {
    const int64_t ia = (int32_t)pe_f32_bits(a), ib = (int32_t)pe_f32_bits(b);
    return ia > ib ? ia - ib : ib - ia;
}

/* d rounded by `round` to a 16-bit format (decoded by `widen`) is the nearest value, even on
 * ties: it lies within the midpoints to its neighbours, which are exact in fp64. */
static int rounds_once(double d, uint16_t r, float (*widen)(uint16_t)) {
    const double v = widen(r);
    if (d != d) return v != v;
    if (v == 0 && d != 0 && fabs(d) > 1e-300) {
        const double up = widen((uint16_t)((r & 0x8000u) | 1u));
        return fabs(d) <= fabs(up) / 2 && !(fabs(d) == fabs(up) / 2);
    }
    const uint16_t mag = r & 0x7fffu;
    const double lo = widen((uint16_t)(r - 1)), hi = widen((uint16_t)(r + 1));
    if (mag == 0) return d == 0 || fabs(d) < fabs(hi) / 2 || (fabs(d) == fabs(hi) / 2);
    const double mlo = (v + lo) / 2, mhi = (v + hi) / 2;
    if (v != v || lo != lo || hi != hi || !isfinite(hi) || !isfinite(v)) return 1; /* edges */
    const double a = fmin(mlo, mhi), b = fmax(mlo, mhi);
    if (d < a || d > b) return 0;
    if (d == a || d == b) return (r & 1u) == 0;
    return 1;
}

/* rope_math.h: each conversion rounds once to nearest even; sin/cos agree with libm's fp64
 * values rounded to fp32, on the fast path and past it (exact reduction). */
static void math_cases(void) {
    int64_t bad = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
        const float f = pe_f16_to_f32((uint16_t)h);
        if (f == f && pe_f32_to_f16(f) != h) ++bad;
        if (f == f && pe_f32_to_bf16(pe_bf16_to_f32((uint16_t)h)) != h) ++bad;
    }
    CHECK(bad == 0, "16-bit values do not round-trip through fp32: %ld", (long)bad);
    bad = 0;
    for (uint64_t u = 0; u < ((uint64_t)1 << 32); u += 4099) {
        const float f = pe_bits_f32((uint32_t)u);
        if (fabsf(f) > 6e4f) continue; /* fp16 overflow: checked below */
        bad += !rounds_once(f, pe_f32_to_f16(f), pe_f16_to_f32);
        bad += !rounds_once(f, pe_f32_to_bf16(f), pe_bf16_to_f32);
    }
    CHECK(bad == 0, "fp32 -> bf16/fp16 not correctly rounded: %ld values", (long)bad);
    CHECK(pe_f32_to_f16(65519.0f) == 0x7bff && pe_f32_to_f16(65520.0f) == 0x7c00,
          "fp16 overflow threshold");
    bad = 0;
    for (int i = 0; i < 200000; ++i) {
        const double d = (double)urand() * ldexp(1.0, (int)(urand() * 20)) * (1.0 + urand() * 1e-9);
        bad += !rounds_once(d, pe_f64_to_f16(d), pe_f16_to_f32);
        bad += !rounds_once(d, pe_f64_to_bf16(d), pe_bf16_to_f32);
    }
    /* a tie in bf16 only after rounding to fp32 first: one rounding goes up */
    const double tie = 1.0 + ldexp(1.0, -8) + ldexp(1.0, -30);
    CHECK(pe_f64_to_bf16(tie) == pe_f32_to_bf16(1.0f + 0x1p-7f), "fp64 -> bf16 rounds twice");
    CHECK(pe_f64_to_f16(1.0 + ldexp(1.0, -11) + ldexp(1.0, -40)) == 0x3c01, "fp64 -> fp16 rounds twice");
    CHECK(bad == 0, "fp64 -> bf16/fp16 not correctly rounded: %ld values", (long)bad);

    int64_t n = 0, off = 0, far = 0, fastdiff = 0;
    for (int i = 0; i < 300000; ++i) {
        float x;
        if (i % 3 == 0) x = (float)(urand() * 800000.0);
        else x = pe_bits_f32((uint32_t)(rng_state = rng_state * 1664525u + 1013904223u) & 0x7f7fffffu);
        if (i & 1) x = -x;
        float c, s, c2, s2;
        pe_sincos_large(x, 1.0f, &c, &s);
        if (fabsf(x) <= PE_SINCOS_FAST_LIMIT) {
            pe_sincos_fast(x, 1.0f, &c2, &s2);
            fastdiff += c2 != c || s2 != s;
        }
        const float rc = (float)cos((double)x), rs = (float)sin((double)x);
        ++n;
        if (c != rc || s != rs) {
            ++off;
            if (f32_ulps(c, rc) > 1 || f32_ulps(s, rs) > 1) ++far;
        }
    }
    CHECK(fastdiff == 0, "fast and exact reductions disagree on %ld angles", (long)fastdiff);
    CHECK(far == 0 && off * 10000 <= n, "sincos vs libm: %ld of %ld differ, %ld by more than 1 ulp",
          (long)off, (long)n, (long)far);
    float c, s;
    pe_sincos_large(INFINITY, 1.0f, &c, &s);
    CHECK(c != c && s != s, "sincos(inf) must be NaN");
}

/* <F x, y> == <x, F^T y>: the transpose is the adjoint, checked in fp64. */
static void adjoint_case(pe_pairing pairing, int64_t D, int64_t R) {
    const int64_t T = 5, H = 3, n = T * H * D;
    double *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    double *fx = malloc(n * sizeof *fx), *fty = malloc(n * sizeof *fty);
    double *cs = malloc(T * R * sizeof *cs), *sn = malloc(T * R * sizeof *sn);
    for (int64_t i = 0; i < n; ++i) { x[i] = urand(); y[i] = urand(); }
    for (int64_t i = 0; i < T * R; ++i) { cs[i] = urand(); sn[i] = urand(); }
    for (int transpose = 0; transpose < 2; ++transpose) {
        pe_rope_args a;
        memset(&a, 0, sizeof a);
        a.batch = 1; a.seq = T; a.head_dim = D; a.rot_dim = R; a.pairing = pairing;
        a.transpose = transpose; a.nthreads = 1;
        a.src.cos = cs; a.src.sin = sn; a.src.table_dtype = PE_FLOAT64; a.src.table_batch = 1;
        a.src.table_stride[1] = T * R; a.src.table_stride[2] = R;
        a.q.in = transpose ? y : x; a.q.out = transpose ? fty : fx;
        a.q.in_dtype = a.q.out_dtype = PE_FLOAT64; a.q.heads = H;
        a.q.in_stride[0] = a.q.out_stride[0] = n;
        a.q.in_stride[1] = a.q.out_stride[1] = H * D;
        a.q.in_stride[2] = a.q.out_stride[2] = D;
        CHECK(pe_rope_apply(&a) == PE_OK, "adjoint apply");
    }
    double l = 0, r = 0;
    for (int64_t i = 0; i < n; ++i) { l += fx[i] * y[i]; r += x[i] * fty[i]; }
    CHECK(fabs(l - r) < 1e-10 * (fabs(l) + 1), "adjoint pairing=%d D=%ld R=%ld: %g vs %g",
          pairing, (long)D, (long)R, l, r);
    free(x); free(y); free(fx); free(fty); free(cs); free(sn);
}

/* Fused positions == tables computed by pe_rope_tables, and the angles match libm. */
static void positions_case(int mrope, int interleaved, pe_pairing pairing) {
    const int64_t B = 2, T = 7, H = 2, D = 16, R = 12, ns = R / 2;
    int64_t pos[3 * 2 * 7];
    float inv[6];
    for (int64_t i = 0; i < 3 * B * T; ++i) pos[i] = (i * 7919) % 300000; /* past 2^17 */
    for (int64_t i = 0; i < ns; ++i) inv[i] = (float)(1.0 / pow(10000.0, (2.0 * i) / R));
    uint8_t axis[6];
    int64_t sec[3] = {2, 2, 2};
    pe_mrope_axis_map(ns, sec, interleaved, axis);
    pe_rope_args a;
    memset(&a, 0, sizeof a);
    a.batch = B; a.seq = T; a.head_dim = R; a.rot_dim = R; a.pairing = pairing; a.nthreads = 2;
    a.src.pos = pos; a.src.pos_batch = B;
    a.src.pos_stride[0] = mrope ? B * T : 0; a.src.pos_stride[1] = T; a.src.pos_stride[2] = 1;
    a.src.inv_freq = inv; a.src.scaling = 0.75f; a.src.axis_of_slot = mrope ? axis : NULL;
    float cs[2 * 7 * 12], sn[2 * 7 * 12];
    CHECK(pe_rope_tables(&a, PE_FLOAT32, cs, sn) == PE_OK, "tables");
    double worst = 0;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < R; ++e) {
                const int64_t slot = pe_slot(pairing, e, R);
                const int64_t ax = mrope ? axis[slot] : 0;
                const float ang = inv[slot] * (float)pos[ax * B * T + b * T + t];
                const double rc = cos((double)ang) * 0.75, rs = sin((double)ang) * 0.75;
                const int64_t i = (b * T + t) * R + e;
                worst = fmax(worst, fmax(fabs(cs[i] - rc), fabs(sn[i] - rs)));
            }
    CHECK(worst < 2e-7, "tables vs libm: %g", worst);
    /* fp64 and bf16 tables hold the same fp32 values, widened or rounded once */
    double cs64[2 * 7 * 12], sn64[2 * 7 * 12];
    uint16_t cs16[2 * 7 * 12], sn16[2 * 7 * 12];
    CHECK(pe_rope_tables(&a, PE_FLOAT64, cs64, sn64) == PE_OK, "fp64 tables");
    CHECK(pe_rope_tables(&a, PE_BFLOAT16, cs16, sn16) == PE_OK, "bf16 tables");
    int64_t differ = 0;
    for (int64_t i = 0; i < B * T * R; ++i)
        differ += cs64[i] != cs[i] || sn64[i] != sn[i] || cs16[i] != pe_f32_to_bf16(cs[i]) ||
                  sn16[i] != pe_f32_to_bf16(sn[i]);
    CHECK(differ == 0, "fp64/bf16 tables differ from the fp32 ones in %ld values", (long)differ);
    /* fused apply == table apply with those tables */
    float q[2 * 7 * 2 * 16], o1[2 * 7 * 2 * 16], o2[2 * 7 * 2 * 16];
    for (int64_t i = 0; i < B * T * H * D; ++i) q[i] = (float)urand();
    a.head_dim = D;
    a.q.in = q; a.q.out = o1; a.q.in_dtype = a.q.out_dtype = PE_FLOAT32; a.q.heads = H;
    a.q.in_stride[0] = a.q.out_stride[0] = T * H * D;
    a.q.in_stride[1] = a.q.out_stride[1] = H * D;
    a.q.in_stride[2] = a.q.out_stride[2] = D;
    CHECK(pe_rope_apply(&a) == PE_OK, "fused apply");
    pe_rope_args b = a;
    memset(&b.src, 0, sizeof b.src);
    b.src.cos = cs; b.src.sin = sn; b.src.table_dtype = PE_FLOAT32; b.src.table_batch = B;
    b.src.table_stride[1] = T * R; b.src.table_stride[2] = R;
    b.q.out = o2;
    CHECK(pe_rope_apply(&b) == PE_OK, "table apply");
    CHECK(memcmp(o1, o2, sizeof o1) == 0, "fused != tables (mrope=%d interleaved=%d pairing=%d)",
          mrope, interleaved, pairing);
}

/* dcos/dsin against the definition, including the batch sum for Bc = 1 and MRoPE scatter. */
static void table_grad_case(int64_t Bc, int mrope) {
    const int64_t B = 2, T = 3, Hq = 3, Hk = 1, D = 10, R = 8, A = mrope ? 3 : 1;
    double q[2 * 3 * 3 * 10], k[2 * 3 * 1 * 10], gq[2 * 3 * 3 * 10], gk[2 * 3 * 1 * 10];
    for (int64_t i = 0; i < B * T * Hq * D; ++i) { q[i] = urand(); gq[i] = urand(); }
    for (int64_t i = 0; i < B * T * Hk * D; ++i) { k[i] = urand(); gk[i] = urand(); }
    uint8_t axis[4];
    int64_t sec[3] = {2, 1, 1};
    pe_mrope_axis_map(R / 2, sec, 0, axis);
    double dcos[3 * 2 * 3 * 8], dsin[3 * 2 * 3 * 8];
    pe_rope_args a;
    memset(&a, 0, sizeof a);
    a.batch = B; a.seq = T; a.head_dim = D; a.rot_dim = R; a.pairing = PE_PAIR_HALF; a.nthreads = 1;
    a.src.table_dtype = PE_FLOAT64; a.src.table_batch = Bc; a.src.cos = a.src.sin = dcos;
    a.src.axis_of_slot = mrope ? axis : NULL;
    a.q.in = q; a.q.out = q; a.q.in_dtype = a.q.out_dtype = PE_FLOAT64; a.q.heads = Hq;
    a.q.in_stride[0] = T * Hq * D; a.q.in_stride[1] = Hq * D; a.q.in_stride[2] = D;
    a.k = a.q; a.k.in = k; a.k.out = k; a.k.heads = Hk;
    a.k.in_stride[0] = T * Hk * D; a.k.in_stride[1] = Hk * D; a.k.in_stride[2] = D;
    CHECK(pe_rope_table_grad(&a, gq, a.q.in_stride, gk, a.k.in_stride, PE_FLOAT64, dcos, dsin) == PE_OK,
          "table grad");
    double worst = 0;
    for (int64_t ax = 0; ax < A; ++ax)
        for (int64_t bc = 0; bc < Bc; ++bc)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t e = 0; e < R; ++e) {
                    double rc = 0, rs = 0;
                    const int on = !mrope || axis[pe_slot(PE_PAIR_HALF, e, R)] == ax;
                    for (int64_t b = 0; b < B; ++b) {
                        if (Bc != 1 && b != bc) continue;
                        for (int j = 0; j < 2 && on; ++j) {
                            const double *x = j ? k : q, *g = j ? gk : gq;
                            const int64_t H = j ? Hk : Hq;
                            for (int64_t h = 0; h < H; ++h) {
                                const int64_t base = ((b * T + t) * H + h) * D;
                                rc += g[base + e] * x[base + e];
                                rs += g[base + e] * sign_of(PE_PAIR_HALF, e, R) *
                                      x[base + partner(PE_PAIR_HALF, e, R)];
                            }
                        }
                    }
                    const int64_t i = ((ax * Bc + bc) * T + t) * R + e;
                    worst = fmax(worst, fmax(fabs(dcos[i] - rc), fabs(dsin[i] - rs)));
                }
    CHECK(worst < 1e-12, "table grad Bc=%ld mrope=%d: %g", (long)Bc, mrope, worst);
}

/* Empty problems succeed without touching data (empty tensors may have NULL pointers);
 * table gradients of an empty batch are zeros. */
static void empty_cases(void) {
    pe_rope_args a;
    memset(&a, 0, sizeof a);
    a.batch = 0; a.seq = 4; a.head_dim = 8; a.rot_dim = 8; a.nthreads = 1;
    a.q.heads = 2; a.k.heads = 1; /* in/out NULL */
    CHECK(pe_rope_apply(&a) == PE_OK, "empty batch apply");
    a.batch = 2; a.seq = 0;
    CHECK(pe_rope_apply(&a) == PE_OK, "empty sequence apply");
    CHECK(pe_rope_tables(&a, PE_FLOAT32, NULL, NULL) == PE_OK, "empty sequence tables");
    double dcos[3 * 4 * 8], dsin[3 * 4 * 8];
    for (int i = 0; i < 3 * 4 * 8; ++i) dcos[i] = dsin[i] = 7.0;
    uint8_t axis[4] = {0, 1, 2, 2};
    a.batch = 0; a.seq = 4;
    a.src.table_dtype = PE_FLOAT64; a.src.table_batch = 1; a.src.axis_of_slot = axis;
    a.q.in_dtype = a.q.out_dtype = a.k.in_dtype = a.k.out_dtype = PE_FLOAT64;
    int64_t st[3] = {0, 0, 0};
    CHECK(pe_rope_table_grad(&a, NULL, st, NULL, st, PE_FLOAT64, dcos, dsin) == PE_OK,
          "empty batch table grad");
    double worst = 0;
    for (int i = 0; i < 3 * 4 * 8; ++i) worst = fmax(worst, fmax(fabs(dcos[i]), fabs(dsin[i])));
    CHECK(worst == 0, "table grad of an empty batch must be zeros, got %g", worst);
    a.batch = 1;
    CHECK(pe_rope_table_grad(&a, NULL, st, NULL, st, PE_FLOAT64, dcos, dsin) == PE_ERR_ARG,
          "table grad with data but NULL inputs");
}

static void bad_args(void) {
    pe_rope_args a;
    memset(&a, 0, sizeof a);
    CHECK(pe_rope_apply(NULL) == PE_ERR_ARG, "NULL args");
    a.batch = 1; a.seq = 1; a.head_dim = 8; a.rot_dim = 7;
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "odd rotary width");
    a.rot_dim = 10;
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "rotary width past head_dim");
    a.rot_dim = 8;
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "no angle source");
    uint8_t axis[4];
    int64_t sec[3] = {1, 1, 1};
    CHECK(pe_mrope_axis_map(4, sec, 0, axis) == PE_ERR_ARG, "sections not summing to R/2");
    int64_t neg[3] = {5, -1, 0};
    CHECK(pe_mrope_axis_map(4, neg, 0, axis) == PE_ERR_ARG, "negative section");
    /* sums that wrap around in int64: rejected, never undefined behaviour */
    const int64_t wrap[3] = {INT64_MAX, INT64_MAX, 4}, wrap2[3] = {(int64_t)1 << 62, (int64_t)1 << 62, 4};
    const int64_t wrap3[3] = {INT64_MAX, 2, INT64_MIN + 3};
    CHECK(pe_mrope_axis_map(4, wrap, 0, axis) == PE_ERR_ARG, "sections summing past INT64_MAX");
    CHECK(pe_mrope_axis_map(4, wrap2, 1, axis) == PE_ERR_ARG, "sections of 2^62");
    CHECK(pe_mrope_axis_map(INT64_MAX, wrap3, 0, axis) == PE_ERR_ARG, "negative section with a wrap");
    CHECK(pe_isa_set((pe_isa)7) == PE_ERR_ARG, "unknown isa");
}

/* Outputs that overlap an input or another output are rejected; adjacent buffers are fine. */
static void overlap_cases(void) {
    enum { T = 4, H = 2, D = 8, N = T * H * D };
    static float buf[4 * N], cs[T * D], sn[T * D], dcos[T * D], dsin[T * D];
    for (int i = 0; i < 4 * N; ++i) buf[i] = (float)urand();
    for (int i = 0; i < T * D; ++i) { cs[i] = (float)urand(); sn[i] = (float)urand(); }
    const pe_rope_tensor none = {.heads = 0};
    pe_rope_args a = {
        .batch = 1, .seq = T, .head_dim = D, .rot_dim = D, .pairing = PE_PAIR_HALF, .nthreads = 1,
        .src = {.cos = cs, .sin = sn, .table_dtype = PE_FLOAT32, .table_batch = 1,
                .table_stride = {0, T * D, D}},
        .q = {.in = buf, .out = buf + N, .in_dtype = PE_FLOAT32, .out_dtype = PE_FLOAT32,
              .heads = H, .in_stride = {N, H * D, D}, .out_stride = {N, H * D, D}},
        .k = none,
    };
    CHECK(pe_rope_apply(&a) == PE_OK, "output right after the input");
    a.q.out = buf;
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "in place");
    a.q.out = buf + N - 1;
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "output over the input's last element");
    a.q.out = buf + N;
    a.k = a.q;
    a.k.in = buf + 2 * N;
    a.k.out = buf + N + D;
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "k's output over q's output");
    a.k.out = buf + 3 * N;
    CHECK(pe_rope_apply(&a) == PE_OK, "four disjoint tensors");
    a.k.out = buf; /* over q's input */
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "k's output over q's input");
    a.k.out = buf + 3 * N;
    a.q.out = sn + 4;
    a.q.heads = 1;
    a.q.out_stride[0] = a.q.out_stride[1] = 1;
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "output over the sine table");
    a.q = a.k;
    a.q.out = buf + N;
    a.q.in = buf;
    a.q.in_stride[0] = INT64_MAX / 2;
    a.batch = 3;
    CHECK(pe_rope_apply(&a) == PE_ERR_ARG, "strides whose byte offsets overflow");
    a.batch = 1;
    a.q.in_stride[0] = N;

    int64_t pos[T] = {0, 1, 2, 3};
    float inv[D / 2] = {1.0f, 0.5f, 0.25f, 0.125f};
    pe_rope_args f = a;
    memset(&f.src, 0, sizeof f.src);
    f.src.pos = pos; f.src.pos_batch = 1; f.src.pos_stride[2] = 1;
    f.src.inv_freq = inv; f.src.scaling = 1.0f;
    CHECK(pe_rope_apply(&f) == PE_OK, "fused, disjoint");
    f.k.out = (void *)inv;
    CHECK(pe_rope_apply(&f) == PE_ERR_ARG, "output over inv_freq");
    CHECK(pe_rope_tables(&f, PE_FLOAT32, dcos, dsin) == PE_OK, "tables, disjoint");
    CHECK(pe_rope_tables(&f, PE_FLOAT32, dcos, dcos) == PE_ERR_ARG, "cos and sin tables overlap");
    CHECK(pe_rope_tables(&f, PE_FLOAT64, pos, dsin) == PE_ERR_ARG, "table over the positions");

    const float *g = buf + 2 * N;
    CHECK(pe_rope_table_grad(&a, g, a.q.in_stride, g, a.k.in_stride, PE_FLOAT32, dcos, dsin) == PE_OK,
          "table grad, disjoint");
    CHECK(pe_rope_table_grad(&a, g, a.q.in_stride, g, a.k.in_stride, PE_FLOAT32, (void *)g, dsin) ==
              PE_ERR_ARG,
          "table gradient over grad_q");
    CHECK(pe_rope_table_grad(&a, g, a.q.in_stride, g, a.k.in_stride, PE_FLOAT32, dcos, buf + 1) ==
              PE_ERR_ARG,
          "table gradient over q");
}

/* q's result does not depend on k's dtype: q fp32 (and bf16) with k fp32, then k fp64. */
static void isolation_case(pe_dtype qdt) {
    const int64_t B = 1, T = 9, Hq = 3, Hk = 2, D = 32, R = 32, nq = B * T * Hq * D, nk = B * T * Hk * D;
    float cs[9 * 32], sn[9 * 32];
    for (int64_t i = 0; i < T * R; ++i) { cs[i] = (float)urand(); sn[i] = (float)urand(); }
    void *q = malloc((size_t)nq * 4), *qo1 = calloc((size_t)nq, 4), *qo2 = calloc((size_t)nq, 4);
    double *k = malloc((size_t)nk * 8), *ko = malloc((size_t)nk * 8);
    float *kf = malloc((size_t)nk * 4), *kfo = malloc((size_t)nk * 4);
    for (int64_t i = 0; i < nq; ++i) put(q, qdt, i, urand());
    for (int64_t i = 0; i < nk; ++i) kf[i] = (float)(k[i] = urand());
    pe_rope_args a = {
        .batch = B, .seq = T, .head_dim = D, .rot_dim = R, .pairing = PE_PAIR_HALF, .nthreads = 1,
        .src = {.cos = cs, .sin = sn, .table_dtype = PE_FLOAT32, .table_batch = 1,
                .table_stride = {0, T * R, R}},
        .q = {.in = q, .out = qo1, .in_dtype = qdt, .out_dtype = qdt, .heads = Hq,
              .in_stride = {T * Hq * D, Hq * D, D}, .out_stride = {T * Hq * D, Hq * D, D}},
        .k = {.in = kf, .out = kfo, .in_dtype = PE_FLOAT32, .out_dtype = PE_FLOAT32, .heads = Hk,
              .in_stride = {T * Hk * D, Hk * D, D}, .out_stride = {T * Hk * D, Hk * D, D}},
    };
    CHECK(pe_rope_apply(&a) == PE_OK, "isolation: k fp32");
    a.q.out = qo2;
    a.k.in = k; a.k.out = ko; a.k.in_dtype = a.k.out_dtype = PE_FLOAT64;
    CHECK(pe_rope_apply(&a) == PE_OK, "isolation: k fp64");
    CHECK(memcmp(qo1, qo2, (size_t)nq * pe_dtype_size(qdt)) == 0,
          "q (dtype %d) changes when k is fp64", qdt);
    free(q); free(qo1); free(qo2); free(k); free(ko); free(kf); free(kfo);
}

/* The table gradients of 16-bit and fp32 q, k (D = R = 64 or 128: the vector block path)
 * equal, bit for bit, those of the scalar baseline variant, which sums in the same order. */
static void table_grad_simd_case(pe_isa isa, pe_dtype dt, int mrope, int64_t R, int64_t Bc) {
    const int64_t B = 2, T = 19, H[2] = {3, 2}, A = mrope ? 3 : 1;
    const size_t es = pe_dtype_size(dt);
    void *x[2], *g[2];
    for (int j = 0; j < 2; ++j) {
        const int64_t n = B * T * H[j] * R;
        x[j] = malloc((size_t)n * es);
        g[j] = malloc((size_t)n * es);
        for (int64_t i = 0; i < n; ++i) {
            put(x[j], dt, i, urand());
            put(g[j], dt, i, 8 * urand());
        }
    }
    uint8_t axis[64];
    int64_t sec[3] = {R / 2 - 2 * (R / 6), R / 6, R / 6};
    if (mrope) CHECK(pe_mrope_axis_map(R / 2, sec, 0, axis) == PE_OK, "axis map");
    const size_t nt = (size_t)(A * Bc * T * R) * es;
    void *out[2][2]; /* [variant][cos, sin] */
    for (int v = 0; v < 2; ++v) {
        pe_isa_set(v ? isa : PE_ISA_BASELINE);
        pe_rope_args a;
        memset(&a, 0, sizeof a);
        a.batch = B; a.seq = T; a.head_dim = R; a.rot_dim = R; a.pairing = PE_PAIR_HALF;
        a.nthreads = 2; a.src.table_dtype = dt; a.src.table_batch = Bc;
        a.src.axis_of_slot = mrope ? axis : NULL;
        pe_rope_tensor *ts[2] = {&a.q, &a.k};
        for (int j = 0; j < 2; ++j) {
            ts[j]->in = ts[j]->out = x[j]; ts[j]->in_dtype = ts[j]->out_dtype = dt;
            ts[j]->heads = H[j];
            ts[j]->in_stride[0] = T * H[j] * R; ts[j]->in_stride[1] = H[j] * R;
            ts[j]->in_stride[2] = R;
        }
        out[v][0] = calloc(1, nt);
        out[v][1] = calloc(1, nt);
        CHECK(pe_rope_table_grad(&a, g[0], a.q.in_stride, g[1], a.k.in_stride, dt, out[v][0],
                                 out[v][1]) == PE_OK, "table grad");
    }
    pe_isa_set(isa);
    CHECK(!memcmp(out[0][0], out[1][0], nt) && !memcmp(out[0][1], out[1][1], nt),
          "%s table grad dtype=%d mrope=%d R=%ld Bc=%ld differs from the baseline variant",
          pe_isa_name(isa), dt, mrope, (long)R, (long)Bc);
    for (int j = 0; j < 2; ++j) {
        free(x[j]);
        free(g[j]);
        free(out[j][0]);
        free(out[j][1]);
    }
}

/* bf16 words of the special values special_values_case mixes in: quiet, signalling and
 * negative NaNs, infinities, the largest finite value, a subnormal, zero */
static const uint16_t bf16_specials[] = {0x7fc1, 0x7f81, 0xffa5, 0x7f80, 0xff80, 0x7f7f, 0x0001,
                                         0x8000};

/* The bf16 bits of a rotation whose result is NaN and whose one NaN operand, as fp32, is
 * nan_in: that NaN made quiet (the propagated payload), its top 16 bits. */
static uint16_t nan_result_bits(float nan_in) { return (uint16_t)((pe_f32_bits(nan_in) >> 16) | 0x40u); }

/*
 * bf16 q and k holding NaNs, infinities and extreme values, with bf16 or fp32 tables (fp32
 * ones with NaNs whose low 16 bits are set: `payload`), MRoPE or not, head_dim 64 and 128:
 * every finite or infinite output equals the fp32 reference rounded once; an output that is
 * NaN from one NaN operand has that operand's payload, made quiet; an output with several
 * NaN operands, or an invalid operation (inf x 0, inf - inf), is a NaN.
 */
static void special_values_case(const char *isa, int64_t D, pe_dtype tdt, int payload,
                                int mrope) {
    const int64_t B = 1, T = 37, H[2] = {3, 1}, A = mrope ? 3 : 1, R = D;
    uint16_t *in[2], *out[2];
    for (int j = 0; j < 2; ++j) {
        const int64_t n = B * T * H[j] * D;
        in[j] = malloc((size_t)n * 2);
        out[j] = malloc((size_t)n * 2);
        for (int64_t i = 0; i < n; ++i) {
            const double u = urand();
            in[j][i] = u > 0.9 ? bf16_specials[(int)((u - 0.9) * 79.99)]
                               : pe_f32_to_bf16((float)(4 * u));
        }
    }
    const int64_t ntab = A * T * R;
    void *cs = malloc((size_t)ntab * 4), *sn = malloc((size_t)ntab * 4);
    for (int64_t i = 0; i < ntab; ++i) {
        put(cs, tdt, i, urand());
        put(sn, tdt, i, urand());
        if (payload && urand() > 0.97) ((uint32_t *)cs)[i] = 0x7f80ffffu; /* signalling */
        if (payload && urand() > 0.97) ((uint32_t *)sn)[i] = 0xffc0abcdu;
    }
    uint8_t axis[128];
    int64_t sec[3] = {R / 2 - 2 * (R / 6), R / 6, R / 6};
    if (mrope) CHECK(pe_mrope_axis_map(R / 2, sec, 0, axis) == PE_OK, "axis map");
    for (int transpose = 0; transpose < 2; ++transpose) {
        pe_rope_args a;
        memset(&a, 0, sizeof a);
        a.batch = B; a.seq = T; a.head_dim = D; a.rot_dim = R; a.pairing = PE_PAIR_HALF;
        a.transpose = transpose; a.nthreads = 1;
        a.src.cos = cs; a.src.sin = sn; a.src.table_dtype = tdt; a.src.table_batch = 1;
        a.src.table_stride[0] = T * R; a.src.table_stride[1] = T * R; a.src.table_stride[2] = R;
        a.src.axis_of_slot = mrope ? axis : NULL;
        pe_rope_tensor *ts[2] = {&a.q, &a.k};
        for (int j = 0; j < 2; ++j) {
            ts[j]->in = in[j]; ts[j]->out = out[j]; ts[j]->heads = H[j];
            ts[j]->in_dtype = ts[j]->out_dtype = PE_BFLOAT16;
            ts[j]->in_stride[0] = ts[j]->out_stride[0] = T * H[j] * D;
            ts[j]->in_stride[1] = ts[j]->out_stride[1] = H[j] * D;
            ts[j]->in_stride[2] = ts[j]->out_stride[2] = D;
        }
        CHECK(pe_rope_apply(&a) == PE_OK, "apply failed");
        int64_t wrong = 0, nans = 0;
        for (int j = 0; j < 2; ++j)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t h = 0; h < H[j]; ++h)
                    for (int64_t e = 0; e < R; ++e) {
                        const int64_t base = (t * H[j] + h) * D, p = partner(PE_PAIR_HALF, e, R);
                        const int64_t se = transpose ? p : e;
                        const int64_t axc = mrope ? axis[pe_slot(PE_PAIR_HALF, e, R)] : 0;
                        const int64_t axs = mrope ? axis[pe_slot(PE_PAIR_HALF, se, R)] : 0;
                        const float x = pe_bf16_to_f32(in[j][base + e]);
                        const float xp = pe_bf16_to_f32(in[j][base + p]);
                        const float c = (float)get(cs, tdt, axc * T * R + t * R + e);
                        const float sv = (float)get(sn, tdt, axs * T * R + t * R + se);
                        const float sg = (float)(transpose ? -sign_of(PE_PAIR_HALF, e, R)
                                                           : sign_of(PE_PAIR_HALF, e, R));
                        const float ref = (float)rot_ref(x, c, sg, xp, sv, 0);
                        const uint16_t got = out[j][base + e];
                        if (ref == ref) {
                            wrong += got != pe_f32_to_bf16(ref);
                            continue;
                        }
                        ++nans;
                        const float ops[4] = {x, c, xp, sv};
                        int n_nan = 0;
                        float one = 0;
                        for (int i = 0; i < 4; ++i)
                            if (ops[i] != ops[i]) {
                                ++n_nan;
                                one = ops[i];
                            }
                        /* a NaN, quiet; with one NaN operand, that operand's payload */
                        const int quiet_nan = (got & 0x7fc0u) == 0x7fc0u;
                        /* (the sine's sign is folded into the table: a NaN sine may come
                         * out with its sign flipped) */
                        wrong += n_nan == 1 ? (got & 0x7fffu) != (nan_result_bits(one) & 0x7fffu)
                                            : !quiet_nan;
                    }
        CHECK(wrong == 0 && nans > 0, "%s special values D=%ld tables=%d payload=%d mrope=%d "
              "transpose=%d: %ld wrong of %ld NaN results", isa, (long)D, tdt, payload, mrope,
              transpose, (long)wrong, (long)nans);
    }
    for (int j = 0; j < 2; ++j) {
        free(in[j]);
        free(out[j]);
    }
    free(cs);
    free(sn);
}

/* The AVX-512 and AVX2 rows' bf16 rounding of channel pairs in 16-bit words
 * (bf16_pairs_num) against pe_f32_to_bf16, on every fp32 high half that is not a NaN with
 * the low halves around the ties, in both lanes of a pair: each variant the CPU has. */
static void bf16_pairs_rounding_case(void) {
#ifdef PE_HAVE_X86_VARIANTS
    if (pe_isa_best() < PE_ISA_AVX2) return;
    static const uint32_t lo[] = {0x0000, 0x0001, 0x7ffe, 0x7fff, 0x8000, 0x8001, 0xfffe,
                                  0xffff, 0x1234, 0x4000, 0xc000, 0x9abc, 0x5555, 0xaaaa,
                                  0x0100, 0xff00};
    enum { NLO = sizeof lo / sizeof *lo, N = 65536 * NLO };
    float *even = malloc(N * sizeof(float)), *odd = malloc(N * sizeof(float));
    uint16_t *got = malloc(2 * N * sizeof(uint16_t));
    for (uint32_t h = 0; h < 65536; ++h)
        for (int j = 0; j < NLO; ++j) {
            const uint32_t i = h * NLO + (uint32_t)j;
            const uint32_t ue = h << 16 | lo[j];
            const uint32_t uo = (h * 40503u & 0xffffu) << 16 | lo[(j * 7 + 3) % NLO];
            memcpy(&even[i], &ue, 4);
            memcpy(&odd[i], &uo, 4);
        }
    for (int v = 0; v < 2; ++v) {
        if (v == 1 && pe_isa_best() < PE_ISA_AVX512) break;
        (v == 0 ? pe_bf16_pairs_avx2 : pe_bf16_pairs_avx512)(got, even, odd, N);
        int64_t wrong = 0, checked = 0;
        for (int64_t i = 0; i < N; ++i) {
            if (even[i] == even[i]) {
                wrong += got[2 * i] != pe_f32_to_bf16(even[i]);
                ++checked;
            }
            if (odd[i] == odd[i]) {
                wrong += got[2 * i + 1] != pe_f32_to_bf16(odd[i]);
                ++checked;
            }
        }
        CHECK(wrong == 0, "%s bf16 pair rounding: %ld of %ld values differ from pe_f32_to_bf16",
              v == 0 ? "AVX2" : "AVX-512", (long)wrong, (long)checked);
    }
    free(even);
    free(odd);
    free(got);
#endif
}

/*
 * The hardware's bf16 rounding (vcvtneps2bf16, on a CPU with AVX512_BF16) against the
 * software's (pe_f32_to_bf16) on every fp32 high half (every sign, exponent and top mantissa:
 * zeros, denormals, normals, infinities, quiet and signalling NaNs with payloads) with low
 * halves at and around the ties: the same bits for every value that is not an fp32 denormal,
 * and dispatch picks the avx512bf16 variant.  (A denormal comes out as a zero of its sign
 * there; the rows round those in software.)
 */
static void bf16_hw_rounding_case(void) {
#ifdef PE_HAVE_AVX512BF16
    unsigned a = 0, b, c, d;
    __builtin_cpu_init();
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5)) ||
        !__builtin_cpu_supports("avx512f")) {
        printf("test_rope: no AVX512_BF16 on this CPU, hardware bf16 rounding not checked\n");
        return;
    }
    static const uint32_t lo[] = {0x0000, 0x0001, 0x7ffe, 0x7fff, 0x8000, 0x8001, 0xfffe,
                                  0xffff, 0x1234, 0x4000, 0xc000, 0x9abc, 0x5555, 0xaaaa,
                                  0x0100, 0xff00};
    enum { NLO = sizeof lo / sizeof *lo };
    float *src = malloc(65536 * NLO * sizeof(float));
    uint16_t *hw = malloc(65536 * NLO * sizeof(uint16_t));
    for (uint32_t h = 0; h < 65536; ++h)
        for (int j = 0; j < NLO; ++j) {
            const uint32_t u = h << 16 | lo[j];
            memcpy(&src[h * NLO + (uint32_t)j], &u, 4);
        }
    pe_bf16_round_hw(hw, src, 65536 * NLO);
    int64_t differ = 0, flushed = 0, denormals = 0;
    for (int64_t i = 0; i < 65536 * NLO; ++i) {
        const uint32_t u = pe_f32_bits(src[i]);
        if ((u & 0x7f800000u) == 0 && (u & 0x7fffffu) != 0) {
            ++denormals;
            flushed += hw[i] == (uint16_t)(u >> 16 & 0x8000u);
            continue;
        }
        differ += hw[i] != pe_f32_to_bf16(src[i]);
    }
    CHECK(differ == 0, "hardware bf16 rounding differs from software on %ld non-denormal values",
          (long)differ);
    printf("test_rope: hardware bf16 rounding = software on all %ld non-denormal values; "
           "%ld of %ld denormals flushed to zero\n", (long)(65536 * NLO - denormals),
           (long)flushed, (long)denormals);
    CHECK(pe_bf16_hw_exact() && pe_isa_best() == PE_ISA_AVX512_BF16,
          "AVX512_BF16 CPU whose hardware rounding passes: dispatch should pick avx512bf16");
    free(src);
    free(hw);
#endif
}

/* The bf16 q rows in (T tokens of H heads of D, full rotary, tables (T, D) of dtype tdt)
 * rotated by the baseline variant into ref and by isa into got. */
static void rows_by_baseline_and(pe_isa isa, int64_t T, int64_t H, int64_t D, int transpose,
                                 int nthreads, const void *cs, const void *sn, pe_dtype tdt,
                                 const uint16_t *in, uint16_t *ref, uint16_t *got) {
    pe_rope_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1; a.seq = T; a.head_dim = D; a.rot_dim = D; a.pairing = PE_PAIR_HALF;
    a.transpose = transpose; a.nthreads = nthreads;
    a.src.cos = cs; a.src.sin = sn; a.src.table_dtype = tdt; a.src.table_batch = 1;
    a.src.table_stride[0] = T * D; a.src.table_stride[1] = T * D; a.src.table_stride[2] = D;
    a.q.in = in; a.q.heads = H; a.q.in_dtype = a.q.out_dtype = PE_BFLOAT16;
    a.q.in_stride[0] = a.q.out_stride[0] = T * H * D;
    a.q.in_stride[1] = a.q.out_stride[1] = H * D;
    a.q.in_stride[2] = a.q.out_stride[2] = D;
    a.q.out = ref;
    pe_isa_set(PE_ISA_BASELINE);
    CHECK(pe_rope_apply(&a) == PE_OK, "apply failed");
    a.q.out = got;
    pe_isa_set(isa);
    CHECK(pe_rope_apply(&a) == PE_OK, "apply failed");
}

/* bf16 rows whose results are fp32 denormals (inputs around 2^-126 and below, cancelling
 * products): every variant gives the baseline's bits (the avx512bf16 rows round them in
 * software), forward and transpose, one head row of 128 and of 80. */
static void denormal_rows_case(pe_isa isa) {
    for (int64_t D = 80; D <= 128; D += 48)
        for (int transpose = 0; transpose < 2; ++transpose) {
            const int64_t T = 9, H = 3, n = T * H * D, R = D;
            uint16_t *in = malloc((size_t)n * 2), *ref = malloc((size_t)n * 2);
            uint16_t *got = malloc((size_t)n * 2);
            float *cs = malloc((size_t)(T * R) * 4), *sn = malloc((size_t)(T * R) * 4);
            for (int64_t i = 0; i < n; ++i) { /* either sign, exponents 0 .. 3, any mantissa */
                const double u0 = urand(), u1 = fabs(urand()), u2 = fabs(urand());
                in[i] = (uint16_t)((u0 > 0 ? 0x8000u : 0u) | (uint32_t)(u1 * 3.99) << 7 |
                                   (uint32_t)(u2 * 127.99));
            }
            for (int64_t i = 0; i < T * R; ++i) { /* in [-1, 1], some exactly 1 */
                cs[i] = urand() > 0.6 ? 1.0f : (float)urand();
                sn[i] = urand() > 0.6 ? 1.0f : (float)urand();
            }
            rows_by_baseline_and(isa, T, H, D, transpose, 1, cs, sn, PE_FLOAT32, in, ref, got);
            int64_t wrong = 0, denormal = 0;
            for (int64_t i = 0; i < n; ++i) {
                wrong += got[i] != ref[i];
                denormal += (ref[i] & 0x7f80u) == 0 && (ref[i] & 0x7fu) != 0;
            }
            CHECK(wrong == 0 && denormal > 0, "%s denormal rows D=%ld transpose=%d: %ld of %ld "
                  "differ from baseline (%ld denormal results)", pe_isa_name(isa), (long)D,
                  transpose, (long)wrong, (long)n, (long)denormal);
            free(in); free(ref); free(got); free(cs); free(sn);
        }
}

/*
 * bf16 rows with bf16 tables, which the avx512bf16 rows rotate by dot products of bf16
 * pairs where the tables allow it (simd.h, bf16_dot_block), against the baseline's bits,
 * forward and transpose, head_dim 64 and 128, several heads (the rows that hold their
 * tables), one and two threads:
 * - tables in [-1, 1] with zeros and ones, inputs of every exponent from the denormals to
 *   2^-57 and around 1: results that are zero, denormal, under and over 2^-64, which the
 *   rows must do again where the instruction flushes or drops a denormal (`mode` 0);
 * - inputs of 2^127 to the largest bf16 and tables in [-1/2, 1/2] but for a few values of
 *   1.5 to 1.98: products that overflow fp32 beside others that would bring their sum
 *   back under the largest float, a sum the dot products must not be asked for (1);
 * - tables holding bf16 denormals and normals under 2^-116, inputs near 2^100: products
 *   of 2^-35 and more, which the instruction would take as zero, beside others of about
 *   their size (2).
 */
static void dot_rows_case(pe_isa isa, int mode) {
    for (int64_t D = 64; D <= 128; D += 64)
        for (int transpose = 0; transpose < 2; ++transpose) {
            const int64_t T = 41, H = 5, n = T * H * D, R = D;
            uint16_t *in = malloc((size_t)n * 2), *ref = malloc((size_t)n * 2);
            uint16_t *got = malloc((size_t)n * 2);
            uint16_t *cs = malloc((size_t)(T * R) * 2), *sn = malloc((size_t)(T * R) * 2);
            for (int64_t i = 0; i < n; ++i) {
                const double u0 = urand(), u1 = fabs(urand()), u2 = fabs(urand());
                uint32_t e = mode == 1 ? 254
                             : mode == 2 ? 225 + (uint32_t)(u1 * 4.99)
                             : u1 < 0.5 ? (uint32_t)(u1 * 141.99) : 120 + (uint32_t)(u1 * 13.99);
                in[i] = (uint16_t)((u0 > 0 ? 0x8000u : 0u) | e << 7 | (uint32_t)(u2 * 127.99));
            }
            for (int64_t i = 0; i < T * R; ++i) {
                uint16_t *tab[2] = {&cs[i], &sn[i]};
                for (int k = 0; k < 2; ++k) {
                    const double u = urand();
                    float v = fabs(u) > 0.8 ? (u > 0 ? 1.0f : 0.0f) : (float)u;
                    if (mode == 1) /* in [-1/2, 1/2], one in 64 in 1.5 .. 1.98 */
                        v = fabs(u) < 1.0 / 64 ? (float)(u > 0 ? 1.5 + 30 * u : -1.5 + 30 * u)
                                               : (float)(u / 2);
                    *tab[k] = pe_f32_to_bf16(v);
                    if (mode == 2 && fabs(u) < 0.2) /* a denormal, or a normal under 2^-116 */
                        *tab[k] = (uint16_t)((u > 0 ? 0u : 0x8000u) + 1u +
                                             (uint32_t)(fabs(u) * 7000));
                }
            }
            rows_by_baseline_and(isa, T, H, D, transpose, 1 + transpose, cs, sn, PE_BFLOAT16, in,
                                 ref, got);
            int64_t wrong = 0, kinds[4] = {0}; /* zero, denormal, under 2^-64, not finite */
            for (int64_t i = 0; i < n; ++i) {
                const uint32_t m = ref[i] & 0x7fffu;
                wrong += got[i] != ref[i];
                kinds[0] += m == 0;
                kinds[1] += m && m < 0x80u;
                kinds[2] += m >= 0x80u && m < 0x1f80u;
                kinds[3] += m >= 0x7f80u;
            }
            const int seen = mode == 0   ? kinds[0] && kinds[1] && kinds[2]
                             : mode == 1 ? kinds[3] > 0
                                         : 1;
            CHECK(wrong == 0 && seen, "%s dot-product rows mode=%d D=%ld transpose=%d: %ld of %ld "
                  "differ from baseline (results: %ld zero, %ld denormal, %ld under 2^-64, %ld "
                  "not finite)", pe_isa_name(isa), mode, (long)D, transpose, (long)wrong, (long)n,
                  (long)kinds[0], (long)kinds[1], (long)kinds[2], (long)kinds[3]);
            free(in); free(ref); free(got); free(cs); free(sn);
        }
}

int main(void) {
    const pe_dtype dts[4] = {PE_FLOAT32, PE_FLOAT64, PE_BFLOAT16, PE_FLOAT16};
    for (int isa = PE_ISA_BASELINE; isa <= (int)pe_isa_best(); ++isa) {
        pe_isa_set((pe_isa)isa);
        const char *name = pe_isa_name((pe_isa)isa);
        for (int d = 0; d < 4; ++d)
            for (int p = 0; p < 2; ++p) {
                rope_case c = {.B = 2, .T = 5, .Hq = 4, .Hk = 2, .D = 64, .R = 64, .Bc = 2,
                               .pairing = (pe_pairing)p, .dt = dts[d], .tdt = dts[d],
                               .dk = dts[d], .out = -1};
                run_case(&c, name);
                c.expand = EXPAND_BATCH | EXPAND_TABLE_T; /* expanded q, k and cos/sin */
                run_case(&c, name);
                c.expand = EXPAND_HEADS;
                c.D = c.R = 80; /* one head row read by every head; vector row tails */
                run_case(&c, name);
                c.expand = 0;
                c.R = 24; c.D = 64; c.Bc = 1; c.gap = 3; c.Hk = 1; c.T = 1; /* partial, MQA, views */
                run_case(&c, name);
                c.R = 36; c.D = 40; c.T = 33; c.tdt = PE_FLOAT32; c.mrope = 1; /* MRoPE, mixed */
                run_case(&c, name);
                c.interleaved = 1; c.D = 38; c.R = 38; c.B = 1; c.Bc = 1; /* odd-sized rows */
                run_case(&c, name);
                /* per-tensor precision: k fp64 next to q; fp64 tables; mixed in/out dtypes */
                rope_case m = {.B = 2, .T = 7, .Hq = 3, .Hk = 2, .D = 48, .R = 32, .Bc = 1,
                               .pairing = (pe_pairing)p, .dt = dts[d], .tdt = PE_FLOAT32,
                               .dk = PE_FLOAT64, .out = -1};
                run_case(&m, name);
                m.tdt = PE_FLOAT64; m.dk = dts[d];
                run_case(&m, name);
                m.tdt = PE_FLOAT32; m.out = PE_FLOAT32;
                run_case(&m, name);
            }
        /* MRoPE whose sections share blocks of the vector table pass (rot_dim / 2 a whole
         * number of blocks), for every pair of table and q/k dtypes: the channels of a block
         * come from two axes (rope_f32.h, table_block). */
        const pe_dtype half_dts[3] = {PE_FLOAT32, PE_BFLOAT16, PE_FLOAT16};
        for (int td = 0; td < 3; ++td)
            for (int xd = 0; xd < 3; ++xd) {
                rope_case c = {.B = 2, .T = 19, .Hq = 3, .Hk = 1, .D = 128, .R = 128, .Bc = 2,
                               .pairing = PE_PAIR_HALF, .dt = half_dts[xd], .tdt = half_dts[td],
                               .dk = half_dts[xd], .out = -1, .mrope = 1};
                run_case(&c, name);
            }
        /* Larger problem so the threaded path runs. */
        rope_case big = {.B = 1, .T = 300, .Hq = 8, .Hk = 2, .D = 128, .R = 128, .Bc = 1,
                         .pairing = PE_PAIR_HALF, .dt = PE_BFLOAT16, .tdt = PE_BFLOAT16,
                         .mrope = 1, .dk = PE_BFLOAT16, .out = -1};
        run_case(&big, name);
        /* Outputs past PE_STREAM_BYTES: the forward writes fresh (untouched) pages, the
         * transpose the same pages again, now in memory, with streaming stores. */
        big.T = 2100; big.Hq = 28; big.Hk = 4;
        run_case(&big, name);
        big.T = 1100; big.dt = big.tdt = big.dk = PE_FLOAT32; big.mrope = 0;
        run_case(&big, name);
        /* Heads outer in memory (contiguous (B, H, T, D) inputs, as gradients often are):
         * the tiles go a group of heads at a time, the last group short of one (7 heads). */
        rope_case outer = {.B = 2, .T = 37, .Hq = 7, .Hk = 2, .D = 128, .R = 128, .Bc = 2,
                           .pairing = PE_PAIR_HALF, .dt = PE_BFLOAT16, .tdt = PE_BFLOAT16,
                           .mrope = 1, .dk = PE_BFLOAT16, .out = -1, .outer = 1};
        run_case(&outer, name);
        outer.D = outer.R = 64; outer.Hq = 5; outer.Hk = 1; outer.mrope = 0; /* k: one head */
        run_case(&outer, name);
        outer.D = 128; outer.R = 96; outer.gap = 8; outer.dt = outer.dk = PE_FLOAT32;
        run_case(&outer, name); /* partial rotary, head rows apart by more than D */
        isolation_case(PE_FLOAT32);
        isolation_case(PE_BFLOAT16);
        for (int64_t D = 64; D <= 128; D += 64)
            for (int mrope = 0; mrope < 2; ++mrope) {
                for (int d = 0; d < 4; ++d)
                    if (dts[d] != PE_FLOAT64)
                        table_grad_simd_case((pe_isa)isa, dts[d], mrope, D, 2 - mrope);
                special_values_case(name, D, PE_BFLOAT16, 0, mrope);
                special_values_case(name, D, PE_FLOAT32, 0, mrope);
                special_values_case(name, D, PE_FLOAT32, 1, mrope);
            }
        adjoint_case(PE_PAIR_HALF, 16, 16);
        adjoint_case(PE_PAIR_HALF, 20, 12);
        adjoint_case(PE_PAIR_ADJACENT, 16, 10);
        for (int m = 0; m < 2; ++m)
            for (int p = 0; p < 2; ++p) positions_case(m, m, (pe_pairing)p);
        table_grad_case(1, 0);
        table_grad_case(2, 0);
        table_grad_case(2, 1);
        denormal_rows_case((pe_isa)isa);
        for (int mode = 0; mode < 3; ++mode) dot_rows_case((pe_isa)isa, mode);
    }
    bf16_hw_rounding_case();
    bf16_pairs_rounding_case();
    pe_isa_set(pe_isa_best());
    empty_cases();
    bad_args();
    overlap_cases();
    math_cases();
    return check_report("test_rope");
}

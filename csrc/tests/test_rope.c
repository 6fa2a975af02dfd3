/*
 * Torch-free tests of the RoPE kernels against a scalar fp64 reference written from the
 * specification in posenc.h.  Every case runs on every SIMD variant the CPU supports.
 */
#include <math.h>
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

/* Relative tolerance of one rounding to dt (and a little for fp32 arithmetic). */
static double tol(pe_dtype dt) {
    switch (dt) {
    case PE_FLOAT64: return 1e-12;
    case PE_FLOAT32: return 4e-6;
    case PE_BFLOAT16: return 1.0 / 128;
    case PE_FLOAT16: return 1.0 / 1024;
    }
    return 0;
}

static int64_t partner(pe_pairing p, int64_t e, int64_t R) {
    if (p == PE_PAIR_HALF) return e < R / 2 ? e + R / 2 : e - R / 2;
    return e ^ 1;
}

static double sign_of(pe_pairing p, int64_t e, int64_t R) {
    if (p == PE_PAIR_HALF) return e < R / 2 ? -1.0 : 1.0;
    return (e & 1) ? 1.0 : -1.0;
}

typedef struct {
    int64_t B, T, Hq, Hk, D, R, Bc;
    pe_pairing pairing;
    pe_dtype dt, tdt;
    int mrope, interleaved;
    int gap; /* extra elements between heads: non-contiguous views */
} rope_case;

/* Runs one case forward and transpose and checks both against the fp64 reference. */
static void run_case(const rope_case *c, const char *isa) {
    const int64_t A = c->mrope ? 3 : 1;
    const int64_t sh = c->D + c->gap, st_q = c->Hq * sh, st_k = c->Hk * sh;
    const size_t es = pe_dtype_size(c->dt), tes = pe_dtype_size(c->tdt);
    const int64_t nq = c->B * c->T * st_q, nk = c->B * c->T * st_k;
    const int64_t ntab = A * c->Bc * c->T * c->R;
    void *q = calloc((size_t)nq, es), *k = calloc((size_t)nk, es);
    void *qo = calloc((size_t)nq, es), *ko = calloc((size_t)nk, es);
    void *cs = malloc((size_t)ntab * tes), *sn = malloc((size_t)ntab * tes);
    for (int64_t i = 0; i < nq; ++i) put(q, c->dt, i, urand());
    for (int64_t i = 0; i < nk; ++i) put(k, c->dt, i, urand());
    for (int64_t i = 0; i < ntab; ++i) {
        put(cs, c->tdt, i, urand());
        put(sn, c->tdt, i, urand());
    }
    uint8_t axis[256];
    int64_t sec[3] = {c->R / 2 - 2 * (c->R / 6), c->R / 6, c->R / 6};
    if (c->mrope) CHECK(pe_mrope_axis_map(c->R / 2, sec, c->interleaved, axis) == PE_OK, "axis map");

    for (int transpose = 0; transpose < 2; ++transpose) {
        pe_rope_args a;
        memset(&a, 0, sizeof a);
        a.batch = c->B; a.seq = c->T; a.head_dim = c->D; a.rot_dim = c->R;
        a.pairing = c->pairing; a.transpose = transpose; a.nthreads = 2;
        a.src.cos = cs; a.src.sin = sn; a.src.table_dtype = c->tdt; a.src.table_batch = c->Bc;
        a.src.table_stride[0] = c->Bc * c->T * c->R;
        a.src.table_stride[1] = c->T * c->R;
        a.src.table_stride[2] = c->R;
        a.src.axis_of_slot = c->mrope ? axis : NULL;
        pe_rope_tensor *ts[2] = {&a.q, &a.k};
        void *ins[2] = {q, k}, *outs[2] = {qo, ko};
        int64_t heads[2] = {c->Hq, c->Hk}, st[2] = {st_q, st_k};
        for (int j = 0; j < 2; ++j) {
            ts[j]->in = ins[j]; ts[j]->out = outs[j];
            ts[j]->in_dtype = ts[j]->out_dtype = c->dt;
            ts[j]->heads = heads[j];
            ts[j]->in_stride[0] = ts[j]->out_stride[0] = c->T * st[j];
            ts[j]->in_stride[1] = ts[j]->out_stride[1] = st[j];
            ts[j]->in_stride[2] = ts[j]->out_stride[2] = sh;
        }
        CHECK(pe_rope_apply(&a) == PE_OK, "apply failed");
        double worst = 0;
        for (int j = 0; j < 2; ++j)
            for (int64_t b = 0; b < c->B; ++b)
                for (int64_t t = 0; t < c->T; ++t)
                    for (int64_t h = 0; h < heads[j]; ++h)
                        for (int64_t e = 0; e < c->D; ++e) {
                            const int64_t base = b * c->T * st[j] + t * st[j] + h * sh;
                            const double x = get(ins[j], c->dt, base + e);
                            double ref = x, mag = fabs(x);
                            if (e < c->R) {
                                const int64_t p = partner(c->pairing, e, c->R);
                                const int64_t se = transpose ? p : e; /* sine index */
                                const int64_t ax = c->mrope ? axis[pe_slot(c->pairing, se, c->R)] : 0;
                                const int64_t axc = c->mrope ? axis[pe_slot(c->pairing, e, c->R)] : 0;
                                const int64_t bc = c->Bc == 1 ? 0 : b;
                                const int64_t tr = ((axc * c->Bc + bc) * c->T + t) * c->R;
                                const int64_t ts_ = ((ax * c->Bc + bc) * c->T + t) * c->R;
                                const double cv = get(cs, c->tdt, tr + e);
                                const double sv = get(sn, c->tdt, ts_ + se);
                                const double xp = get(ins[j], c->dt, base + p);
                                const double sg = transpose ? -sign_of(c->pairing, e, c->R)
                                                            : sign_of(c->pairing, e, c->R);
                                ref = x * cv + sg * xp * sv;
                                mag = fabs(x * cv) + fabs(xp * sv);
                            }
                            const double got = get(outs[j], c->dt, base + e);
                            const double err = fabs(got - ref) / (mag + 1e-30);
                            if (err > worst) worst = err;
                        }
        CHECK(worst <= tol(c->dt), "%s B=%ld T=%ld Hq=%ld Hk=%ld D=%ld R=%ld pair=%d dt=%d tdt=%d "
              "mrope=%d/%d transpose=%d: rel err %.3g", isa, (long)c->B, (long)c->T, (long)c->Hq,
              (long)c->Hk, (long)c->D, (long)c->R, c->pairing, c->dt, c->tdt, c->mrope,
              c->interleaved, transpose, worst);
    }
    free(q); free(k); free(qo); free(ko); free(cs); free(sn);
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
    CHECK(pe_isa_set((pe_isa)7) == PE_ERR_ARG, "unknown isa");
}

int main(void) {
    const pe_dtype dts[4] = {PE_FLOAT32, PE_FLOAT64, PE_BFLOAT16, PE_FLOAT16};
    for (int isa = PE_ISA_BASELINE; isa <= (int)pe_isa_best(); ++isa) {
        pe_isa_set((pe_isa)isa);
        const char *name = pe_isa_name((pe_isa)isa);
        for (int d = 0; d < 4; ++d)
            for (int p = 0; p < 2; ++p) {
                rope_case c = {2, 5, 4, 2, 64, 64, 2, (pe_pairing)p, dts[d], dts[d], 0, 0, 0};
                run_case(&c, name);
                c.R = 24; c.Bc = 1; c.gap = 3; c.Hk = 1; c.T = 1; /* partial, MQA, views */
                run_case(&c, name);
                c.R = 36; c.D = 40; c.T = 33; c.tdt = PE_FLOAT32; c.mrope = 1; /* MRoPE, mixed */
                run_case(&c, name);
                c.interleaved = 1; c.D = 38; c.R = 38; c.B = 1; c.Bc = 1; /* odd-sized rows */
                run_case(&c, name);
            }
        /* Larger problem so the threaded path runs. */
        rope_case big = {1, 300, 8, 2, 128, 128, 1, PE_PAIR_HALF, PE_BFLOAT16, PE_BFLOAT16, 1, 0, 0};
        run_case(&big, name);
        adjoint_case(PE_PAIR_HALF, 16, 16);
        adjoint_case(PE_PAIR_HALF, 20, 12);
        adjoint_case(PE_PAIR_ADJACENT, 16, 10);
        for (int m = 0; m < 2; ++m)
            for (int p = 0; p < 2; ++p) positions_case(m, m, (pe_pairing)p);
        table_grad_case(1, 0);
        table_grad_case(2, 0);
        table_grad_case(2, 1);
    }
    pe_isa_set(pe_isa_best());
    empty_cases();
    bad_args();
    math_cases();
    return check_report("test_rope");
}

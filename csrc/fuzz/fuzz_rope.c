/*
 * libFuzzer harness for the RoPE entry points (pe_rope_apply, pe_rope_table_grad,
 * pe_rope_tables), built with ASan + UBSan.  The input bytes choose small shapes, strides
 * (gaps, heads-outer layouts, expanded stride-0 inputs), dtypes per tensor, pairing, table
 * or fused-position source, MRoPE maps, the instruction set and thread count; the data
 * come from a stream seeded by the input, with NaN, infinities and large values mixed in.
 *
 * Valid calls must succeed and agree with a reference computed here: apply and tables
 * exactly (the kernel's precision and operation order, one rounding, see posenc.h), table
 * gradients within a bound of an fp64 sum.  Calls made invalid on purpose (a size, option,
 * pointer, or an output over an input) must return PE_ERR_ARG without writing anything.
 * Inputs are never modified.  Buffers are allocated to the exact bytes each view spans,
 * so any access outside them is an ASan report.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_data.h"

static int same(double a, double b) { return a == b || (a != a && b != b); }

static int64_t partner(pe_pairing p, int64_t e, int64_t R) {
    if (p == PE_PAIR_HALF) return e < R / 2 ? e + R / 2 : e - R / 2;
    return e ^ 1;
}

static int negative(pe_pairing p, int64_t e, int64_t R) {
    return p == PE_PAIR_HALF ? e < R / 2 : !(e & 1);
}

static int64_t slot(pe_pairing p, int64_t e, int64_t R) {
    return p == PE_PAIR_HALF ? (e < R / 2 ? e : e - R / 2) : e / 2;
}

/* A (B, T, H, D) view: strides and the element count its buffer needs. */
typedef struct view {
    int64_t stride[3];
    int64_t count;
} view;

static view make_view(int64_t B, int64_t T, int64_t H, int64_t D, int64_t gap, int heads_outer,
                      unsigned expand) {
    view v;
    const int64_t row = D + gap;
    if (heads_outer) {
        v.stride[1] = row;
        v.stride[2] = T * row;
        v.stride[0] = H * T * row;
    } else {
        v.stride[2] = row;
        v.stride[1] = H * row;
        v.stride[0] = T * H * row;
    }
    for (int i = 0; i < 3; ++i)
        if (expand & (1u << i)) v.stride[i] = 0;
    const int64_t n[3] = {B, T, H};
    v.count = 0;
    if (B && T && H) {
        v.count = D;
        for (int i = 0; i < 3; ++i) v.count += (n[i] - 1) * v.stride[i];
    }
    return v;
}

static void *alloc_filled(int64_t count, pe_dtype dt, uint64_t *s) {
    void *p = malloc((size_t)(count ? count : 1) * dsize(dt));
    for (int64_t i = 0; i < count; ++i) put(p, dt, i, value(s));
    return p;
}

static void *dup(const void *p, size_t bytes) {
    void *c = malloc(bytes ? bytes : 1);
    memcpy(c, p, bytes);
    return c;
}

/* Everything one call needs, owned here. */
typedef struct problem {
    pe_rope_args a;
    int op; /* 0 apply, 1 table gradients, 2 tables from positions */
    int fused;
    void *in[2], *out[2], *cos, *sin, *grad[2];
    int64_t *pos;
    float *inv;
    uint8_t axis[64];
    view vin[2], vout[2], vgrad[2];
    int64_t table_count, pos_count, dtable_count;
    pe_dtype grad_dtype, tables_dtype, in_dtype[2];
    void *dcos, *dsin;
} problem;

static void problem_free(problem *p) {
    for (int j = 0; j < 2; ++j) {
        free(p->in[j]);
        free(p->out[j]);
        free(p->grad[j]);
    }
    free(p->cos);
    free(p->sin);
    free(p->pos);
    free(p->inv);
    free(p->dcos);
    free(p->dsin);
}

/* cos and unsigned sin of channel e of token (b, t), as the kernels see them. */
static void channel_tables(const problem *p, int64_t b, int64_t t, int64_t e, double *c, double *s) {
    const pe_rope_args *a = &p->a;
    const pe_rope_source *src = &a->src;
    const int64_t R = a->rot_dim, i = slot(a->pairing, e, R);
    const int64_t ax = src->axis_of_slot ? src->axis_of_slot[i] : 0;
    if (src->pos) {
        const int64_t pv = src->pos[ax * src->pos_stride[0] +
                                    (src->pos_batch == 1 ? 0 : b) * src->pos_stride[1] +
                                    t * src->pos_stride[2]];
        float cf, sf;
        pe_sincos_large(pe_rope_angle(src->inv_freq[i], pv), src->scaling, &cf, &sf);
        *c = cf;
        *s = sf;
        return;
    }
    const int64_t o = ax * src->table_stride[0] + (src->table_batch == 1 ? 0 : b) * src->table_stride[1] +
                      t * src->table_stride[2] + e;
    *c = get(src->cos, src->table_dtype, o);
    *s = get(src->sin, src->table_dtype, o);
}

static double stored(double v, pe_dtype dt, int f64) {
    switch (dt) {
    case PE_FLOAT64: return v;
    case PE_FLOAT32: return (float)v;
    case PE_BFLOAT16: return pe_bf16_to_f32(f64 ? pe_f64_to_bf16(v) : pe_f32_to_bf16((float)v));
    case PE_FLOAT16: return pe_f16_to_f32(f64 ? pe_f64_to_f16(v) : pe_f32_to_f16((float)v));
    }
    return 0;
}

static void check_apply(const problem *p) {
    const pe_rope_args *a = &p->a;
    const int64_t R = a->rot_dim, D = a->head_dim;
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    for (int j = 0; j < 2; ++j) {
        const pe_rope_tensor *x = xs[j];
        const int f64 = x->in_dtype == PE_FLOAT64 || x->out_dtype == PE_FLOAT64 ||
                        (!a->src.pos && a->src.table_dtype == PE_FLOAT64);
        for (int64_t b = 0; b < a->batch; ++b)
            for (int64_t t = 0; t < a->seq; ++t)
                for (int64_t h = 0; h < x->heads; ++h)
                    for (int64_t e = 0; e < D; ++e) {
                        const int64_t ib = b * x->in_stride[0] + t * x->in_stride[1] + h * x->in_stride[2];
                        const double xv = get(x->in, x->in_dtype, ib + e);
                        double ref = xv;
                        if (e < R) {
                            const int64_t pe = partner(a->pairing, e, R);
                            double c, s, c2, s2;
                            channel_tables(p, b, t, e, &c, &s);
                            channel_tables(p, b, t, pe, &c2, &s2);
                            const double sv = a->transpose ? s2 : s;
                            const int neg = negative(a->pairing, e, R) != (a->transpose != 0);
                            const double xp = get(x->in, x->in_dtype, ib + pe);
                            if (f64) {
                                ref = xv * c + (neg ? -(xp * sv) : xp * sv);
                            } else {
                                const float m = (float)xp * (float)sv;
                                ref = (float)xv * (float)c + (neg ? -m : m);
                            }
                        }
                        const int64_t ob = b * x->out_stride[0] + t * x->out_stride[1] + h * x->out_stride[2];
                        REQUIRE(same(get(x->out, x->out_dtype, ob + e), stored(ref, x->out_dtype, f64)));
                    }
    }
}

static void check_tables(const problem *p) {
    const pe_rope_args *a = &p->a;
    const int64_t R = a->rot_dim;
    for (int64_t b = 0; b < a->src.pos_batch; ++b)
        for (int64_t t = 0; t < a->seq; ++t)
            for (int64_t e = 0; e < R; ++e) {
                double c, s;
                channel_tables(p, b, t, e, &c, &s);
                const int64_t i = (b * a->seq + t) * R + e;
                REQUIRE(same(get(p->dcos, p->tables_dtype, i), stored(c, p->tables_dtype, 0)));
                REQUIRE(same(get(p->dsin, p->tables_dtype, i), stored(s, p->tables_dtype, 0)));
            }
}

/* dcos, dsin against an fp64 sum; the kernel sums in fp32 unless a tensor is fp64. */
static void check_table_grad(const problem *p) {
    const pe_rope_args *a = &p->a;
    const int64_t R = a->rot_dim, Bc = a->src.table_batch, A = a->src.axis_of_slot ? 3 : 1;
    const int f64 = p->grad_dtype == PE_FLOAT64 || a->src.table_dtype == PE_FLOAT64 ||
                    (a->q.heads && a->q.in_dtype == PE_FLOAT64) ||
                    (a->k.heads && a->k.in_dtype == PE_FLOAT64);
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    for (int64_t ax = 0; ax < A; ++ax)
        for (int64_t bc = 0; bc < Bc; ++bc)
            for (int64_t t = 0; t < a->seq; ++t)
                for (int64_t e = 0; e < R; ++e) {
                    const int on = A == 1 || a->src.axis_of_slot[slot(a->pairing, e, R)] == ax;
                    double rc = 0, rs = 0, mag = 0;
                    for (int64_t b = 0; b < a->batch && on; ++b) {
                        if (Bc != 1 && b != bc) continue;
                        for (int j = 0; j < 2; ++j)
                            for (int64_t h = 0; h < xs[j]->heads; ++h) {
                                const pe_rope_tensor *x = xs[j];
                                const int64_t ib = b * x->in_stride[0] + t * x->in_stride[1] + h * x->in_stride[2];
                                const int64_t gb = b * p->vgrad[j].stride[0] + t * p->vgrad[j].stride[1] +
                                                   h * p->vgrad[j].stride[2];
                                const double g = get(p->grad[j], p->grad_dtype, gb + e);
                                const double xv = get(x->in, x->in_dtype, ib + e);
                                const double xp = get(x->in, x->in_dtype, ib + partner(a->pairing, e, R));
                                rc += g * xv;
                                rs += negative(a->pairing, e, R) ? -(g * xp) : g * xp;
                                mag += fabs(g * xv) + fabs(g * xp);
                            }
                    }
                    const int64_t i = ((ax * Bc + bc) * a->seq + t) * R + e;
                    const double gc = get(p->dcos, a->src.table_dtype, i), gs = get(p->dsin, a->src.table_dtype, i);
                    if (!isfinite(mag) || !isfinite(rc) || !isfinite(rs)) continue; /* overflow */
                    const pe_dtype tdt = a->src.table_dtype;
                    const double unit = tdt == PE_FLOAT64 ? 0x1p-52 : tdt == PE_FLOAT32 ? 0x1p-23
                                        : tdt == PE_BFLOAT16 ? 0x1p-8 : 0x1p-11;
                    const double sum_err = (f64 ? 0x1p-52 : 0x1p-23) * 64;
                    if (!isfinite(gc) || !isfinite(gs)) { /* only past the range of a sum */
                        const double top = tdt == PE_FLOAT16 ? 65504.0 : tdt == PE_FLOAT64 ? 1.7e308
                                                                                   : 3.38e38;
                        REQUIRE(mag >= top / 2 || (!f64 && mag >= 1.7e38)); /* fp32 sums */
                        continue;
                    }
                    /* absolute slack: fp32 sums lose bits in the subnormal range, and the
                     * stored value may round to the dtype's smallest subnormal or to 0 */
                    const double tiny = (f64 ? 0 : 64 * 0x1p-149) +
                                        (tdt == PE_FLOAT16 ? 0x1p-24 : tdt == PE_FLOAT64 ? 0x1p-1074
                                         : tdt == PE_BFLOAT16 ? 0x1p-133 : 0x1p-149);
                    const double tol = mag * sum_err + (fabs(rc) + fabs(rs)) * unit + tiny;
                    REQUIRE(fabs(gc - rc) <= tol + mag * unit && fabs(gs - rs) <= tol + mag * unit);
                }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_bytes in = {data, size};
    uint64_t seed = fuzz_u64(&in) | 1u;
    problem p;
    memset(&p, 0, sizeof p);
    pe_rope_args *a = &p.a;
    static const int64_t dims[] = {2, 4, 6, 8, 10, 12, 16, 24, 32, 38, 40, 64, 80, 128};
    p.op = (int)fuzz_below(&in, 3);
    const int64_t B = fuzz_below(&in, 3), T = fuzz_below(&in, 6);
    const int64_t D = dims[fuzz_below(&in, sizeof dims / sizeof *dims)];
    const int64_t R = 2 + 2 * (int64_t)fuzz_below(&in, (unsigned)(D / 2));
    const int64_t heads[2] = {fuzz_below(&in, 4), fuzz_below(&in, 3)};
    a->batch = B;
    a->seq = T;
    a->head_dim = D;
    a->rot_dim = R;
    a->pairing = (pe_pairing)fuzz_below(&in, 2);
    a->transpose = (int)fuzz_below(&in, 2);
    a->nthreads = 1 + (int)fuzz_below(&in, 2);
    pe_isa_set((pe_isa)fuzz_below(&in, (unsigned)pe_isa_best() + 1));

    /* MRoPE: sections that sum to R/2, or interleaved */
    const unsigned mrope = fuzz_below(&in, 3);
    if (mrope) {
        int64_t sec[3];
        sec[1] = fuzz_below(&in, (unsigned)(R / 2 + 1));
        sec[2] = fuzz_below(&in, (unsigned)(R / 2 - sec[1] + 1));
        sec[0] = R / 2 - sec[1] - sec[2];
        REQUIRE(pe_mrope_axis_map(R / 2, sec, mrope == 2, p.axis) == PE_OK);
        a->src.axis_of_slot = p.axis;
    }
    const int64_t A = mrope ? 3 : 1;

    /* angle source */
    p.fused = p.op == 2 || fuzz_below(&in, 3) == 0;
    if (p.op == 1) p.fused = 0;
    const int64_t Bs = B > 1 && fuzz_below(&in, 2) ? B : 1;
    if (p.fused) {
        const int64_t st2 = 1 + fuzz_below(&in, 2), st1 = T * st2, st0 = fuzz_below(&in, 2) ? Bs * st1 : 0;
        p.pos_count = ((A - 1) * st0 + (Bs - 1) * st1 + (T ? (T - 1) * st2 + 1 : 0));
        p.pos = malloc((size_t)(p.pos_count ? p.pos_count : 1) * sizeof(int64_t));
        const unsigned big = fuzz_below(&in, 4);
        for (int64_t i = 0; i < p.pos_count; ++i) {
            const uint64_t r = fuzz_next(&seed);
            p.pos[i] = big == 0 ? (int64_t)(r >> 1) - INT64_MAX / 2 : (int64_t)(r % (big == 1 ? 1000000000 : 70000));
        }
        p.inv = malloc((size_t)(R / 2) * sizeof(float));
        for (int64_t i = 0; i < R / 2; ++i)
            p.inv[i] = (float)(fuzz_next(&seed) % 3 == 0 ? value(&seed) : pow(10000.0, -2.0 * i / R));
        a->src.pos = p.pos;
        a->src.pos_batch = p.op == 2 ? (B ? Bs : 1) : Bs;
        a->src.pos_stride[0] = st0;
        a->src.pos_stride[1] = st1;
        a->src.pos_stride[2] = st2;
        a->src.inv_freq = p.inv;
        a->src.scaling = fuzz_below(&in, 2) ? 1.0f : 0.70710677f;
    } else {
        a->src.table_dtype = dtypes[fuzz_below(&in, 4)];
        a->src.table_batch = Bs;
        const int64_t tgap = fuzz_below(&in, 2);
        a->src.table_stride[2] = fuzz_below(&in, 5) == 0 ? 0 : R + tgap;
        a->src.table_stride[1] = T * (R + tgap);
        a->src.table_stride[0] = Bs * T * (R + tgap);
        p.table_count = T ? (A - 1) * a->src.table_stride[0] + (Bs - 1) * a->src.table_stride[1] +
                                (T - 1) * a->src.table_stride[2] + R
                          : 0;
        if (p.op == 0) {
            p.cos = alloc_filled(p.table_count, a->src.table_dtype, &seed);
            p.sin = alloc_filled(p.table_count, a->src.table_dtype, &seed);
            a->src.cos = p.cos;
            a->src.sin = p.sin;
        }
    }

    /* q and k */
    const int heads_outer = (int)fuzz_below(&in, 2);
    pe_rope_tensor *xs[2] = {&a->q, &a->k};
    for (int j = 0; j < 2; ++j) {
        pe_rope_tensor *x = xs[j];
        x->heads = heads[j];
        x->in_dtype = dtypes[fuzz_below(&in, 4)];
        x->out_dtype = fuzz_below(&in, 3) ? x->in_dtype : dtypes[fuzz_below(&in, 4)];
        p.vin[j] = make_view(B, T, heads[j], D, fuzz_below(&in, 3), heads_outer, fuzz_below(&in, 8));
        p.vout[j] = make_view(B, T, heads[j], D, fuzz_below(&in, 2), heads_outer, 0);
        p.in_dtype[j] = x->in_dtype;
        p.in[j] = alloc_filled(p.vin[j].count, x->in_dtype, &seed);
        p.out[j] = calloc((size_t)(p.vout[j].count ? p.vout[j].count : 1), dsize(x->out_dtype));
        x->in = p.in[j];
        x->out = p.out[j];
        memcpy(x->in_stride, p.vin[j].stride, sizeof x->in_stride);
        memcpy(x->out_stride, p.vout[j].stride, sizeof x->out_stride);
    }
    if (p.op == 1) {
        p.grad_dtype = dtypes[fuzz_below(&in, 4)];
        for (int j = 0; j < 2; ++j) {
            p.vgrad[j] = make_view(B, T, heads[j], D, fuzz_below(&in, 2), heads_outer, 0);
            p.grad[j] = alloc_filled(p.vgrad[j].count, p.grad_dtype, &seed);
        }
        p.dtable_count = A * Bs * T * R;
    }
    if (p.op == 2) {
        p.tables_dtype = dtypes[fuzz_below(&in, 4)];
        p.dtable_count = a->src.pos_batch * T * R;
    }
    if (p.op >= 1) {
        const pe_dtype dt = p.op == 1 ? a->src.table_dtype : p.tables_dtype;
        p.dcos = calloc((size_t)(p.dtable_count ? p.dtable_count : 1), dsize(dt));
        p.dsin = calloc((size_t)(p.dtable_count ? p.dtable_count : 1), dsize(dt));
    }

    /* now and then break one argument: the call must fail without writing anything */
    void *dcos = p.dcos, *dsin = p.dsin;
    const unsigned breakage = fuzz_below(&in, 4) == 0 ? 1 + fuzz_below(&in, 9) : 0;
    switch (breakage) {
    case 1: a->rot_dim = R + 1; break;
    case 2: a->rot_dim = D + 2; break;
    case 3: a->pairing = (pe_pairing)2; break;
    case 4: a->q.in_dtype = (pe_dtype)7; break;
    case 5: a->batch = -1; break;
    case 6:
        if (mrope) p.axis[fuzz_below(&in, (unsigned)(R / 2))] = 3;
        else a->head_dim = -2;
        break;
    case 7:
        if (p.fused) a->src.pos_batch = B + 2;
        else a->src.table_batch = B + 2;
        break;
    case 8: a->q.heads = -1; break;
    case 9: /* an output over an input, both non-empty */
        if (p.op == 0 && p.vin[0].count && p.vout[0].count) a->q.out = p.in[0];
        else if (p.op == 1 && p.vgrad[0].count && p.dtable_count) dcos = p.grad[0];
        else if (p.op == 2 && p.dtable_count && p.pos_count) dsin = p.pos;
        else a->rot_dim = 0;
        break;
    }
    const int must_fail = breakage && !(breakage == 4 && (p.op == 2 || heads[0] == 0)) &&
                          !(breakage == 7 && (T == 0 || (p.op == 0 && B == 0)));

    /* copies that prove the inputs (and, after a failure, the outputs) untouched */
    void *in_copy[2], *out_copy[2], *grad_copy[2] = {NULL, NULL};
    size_t in_bytes[2], out_bytes[2], grad_bytes[2] = {0, 0};
    const size_t table_bytes = (size_t)p.dtable_count * dsize(p.op == 1 ? a->src.table_dtype : p.tables_dtype);
    for (int j = 0; j < 2; ++j) {
        in_bytes[j] = (size_t)p.vin[j].count * dsize(p.in_dtype[j]);
        out_bytes[j] = (size_t)p.vout[j].count * dsize(xs[j]->out_dtype);
        in_copy[j] = dup(p.in[j], in_bytes[j]);
        out_copy[j] = dup(p.out[j], out_bytes[j]);
        if (p.grad[j]) {
            grad_bytes[j] = (size_t)p.vgrad[j].count * dsize(p.grad_dtype);
            grad_copy[j] = dup(p.grad[j], grad_bytes[j]);
        }
    }
    const int64_t pos_bytes = p.pos_count * (int64_t)sizeof(int64_t);
    void *pos_copy = p.pos ? dup(p.pos, (size_t)pos_bytes) : NULL;

    int rc;
    if (p.op == 0) {
        rc = pe_rope_apply(a);
    } else if (p.op == 1) {
        rc = pe_rope_table_grad(a, p.grad[0], p.vgrad[0].stride, p.grad[1], p.vgrad[1].stride,
                                p.grad_dtype, dcos, dsin);
    } else {
        rc = pe_rope_tables(a, p.tables_dtype, dcos, dsin);
    }
    REQUIRE(rc == PE_OK || rc == PE_ERR_ARG);
    if (must_fail) REQUIRE(rc == PE_ERR_ARG);
    if (!breakage) REQUIRE(rc == PE_OK);
    for (int j = 0; j < 2; ++j) {
        REQUIRE(memcmp(p.in[j], in_copy[j], in_bytes[j]) == 0);
        if (p.grad[j]) REQUIRE(memcmp(p.grad[j], grad_copy[j], grad_bytes[j]) == 0);
        if (rc != PE_OK) REQUIRE(memcmp(p.out[j], out_copy[j], out_bytes[j]) == 0);
        free(in_copy[j]);
        free(out_copy[j]);
        free(grad_copy[j]);
    }
    if (p.pos) REQUIRE(memcmp(p.pos, pos_copy, (size_t)pos_bytes) == 0);
    free(pos_copy);
    if (rc != PE_OK && p.dcos) { /* calloc'd: still zeros */
        static const char zeros[1024];
        for (size_t o = 0; o < table_bytes; o += sizeof zeros) {
            const size_t n = table_bytes - o < sizeof zeros ? table_bytes - o : sizeof zeros;
            REQUIRE(memcmp((char *)p.dcos + o, zeros, n) == 0 && memcmp((char *)p.dsin + o, zeros, n) == 0);
        }
    }
    if (rc == PE_OK && !breakage) {
        if (p.op == 0) check_apply(&p);
        else if (p.op == 1) check_table_grad(&p);
        else check_tables(&p);
    }
    problem_free(&p);
    pe_isa_set(pe_isa_best());
    return 0;
}

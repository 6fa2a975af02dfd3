/*
 * libFuzzer harness for the fused per-head RMSNorm + RoPE (pe_qk_norm_rope and
 * pe_qk_norm_rope_backward), built with ASan + UBSan.  The input bytes choose small shapes
 * (B, T, Hq, Hk from 0, D from 2 to 1040, R <= D even), pairing, norm form, dtype, fp32
 * weights where allowed, eps, sum_lanes, table batch 1 or B, strides (gaps, heads-outer
 * layouts, expanded stride-0 inputs, tables shared by the tokens), nthreads, sum_threads,
 * heads_first and the instruction set (a tensor without heads is now and then given NULL
 * pointers); the data come from a stream seeded by the input, with NaN, infinities, subnormal
 * and large values mixed in, and now and then rows scaled so that their squares overflow or
 * underflow fp32.  The backward is given the rstd (and ms^-1.5) of the forward's formula, or
 * arbitrary values.
 *
 * Valid calls must succeed, and every element they write must be exactly what posenc.h's
 * formulas give (the same bits; any NaN for a NaN), computed here: the forward's out and rstd,
 * the backward's dx, fp64's wprod and the weight gradients of fp32 / bf16 / fp16 tensors, with
 * the sums in torch's order as posenc.h spells it out (the row sums' cascade with sum_lanes
 * lanes, fp64 rows with half as many, the lanes of torch's Vectorized<double>; the weight
 * gradients' plain and 4-lane column orders in sum_threads threads' column chunks).  fp32
 * operations are done in double and rounded to fp32 (exact for +, *, / and sqrt).  For fp64
 * tensors eps is added as the double it is (posenc.h's fl32(eps) is fp32's; torch adds a
 * Python float to a double tensor unrounded).
 *
 * Calls made invalid on purpose must return PE_ERR_ARG: R odd, below 2 or above D; an
 * unknown pairing, form or dtype; sum_lanes not in {1, 4, 8, 16}; weight_f32 with fp64, or
 * with 16-bit tensors and PE_NORM_WEIGHT; a negative size; B T (Hq + Hk) D past int64; table
 * batch neither 1 nor B; a NULL pointer the call must read or write; sum_threads < 1 in the
 * backward of fp32 / 16-bit tensors (where it does not count, in the forward and the fp64
 * backward, the call must succeed).  Whatever the call, inputs are never modified, and an
 * output buffer changes only in the elements checked above (never in the gaps between rows,
 * nor the wprod of a backward that sums into wgrad); after a rejected call not at all.
 * Buffers hold exactly the bytes each view spans, so any access outside them is an ASan
 * report.  Not fuzzed: outputs over inputs and strides whose byte offsets overflow int64
 * (posenc.h promises PE_ERR_ARG for those to the RoPE entry points, not to these), negative
 * strides, and PE_ERR_NOMEM.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_data.h"

enum { SENTINEL = 0xa5, MAX_BUFFERS = 24 };

/* The same value with the same sign of zero, or two NaNs. */
static int same(double a, double b) {
    return a != a ? b != b : a == b && signbit(a) == signbit(b);
}

/* ---- posenc.h's arithmetic ------------------------------------------------------------ */

typedef struct arith {
    int f32;     /* fp32 / bf16 / fp16 tensors: each operation rounded to fp32; fp64: none */
    pe_dtype dt; /* the tensors' dtype, which rnd() rounds to */
} arith;

/* One operation's result, done in double, rounded as the tensors' arithmetic rounds it. */
static double fl(const arith *m, double v) { return m->f32 ? (double)(float)v : v; }

/* An fp32 value (or fp64 for fp64 tensors) rounded to the tensors' dtype. */
static double rnd(const arith *m, double v) {
    if (m->dt == PE_BFLOAT16) return pe_bf16_to_f32(pe_f32_to_bf16((float)v));
    if (m->dt == PE_FLOAT16) return pe_f16_to_f32(pe_f32_to_f16((float)v));
    return v;
}

static int64_t ceil_log2(int64_t x) {
    return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1));
}

/* torch's multi_row_sum of one column, v[0], v[s], ..., v[(n-1) s]: 4 cascade levels, a
 * level carried every 2^p items, p = max(4, ceil_log2(n) / 4). */
static double level_sum(const arith *m, const double *v, int64_t n, int64_t s) {
    const int64_t p = ceil_log2(n) / 4 > 4 ? ceil_log2(n) / 4 : 4, step = (int64_t)1 << p;
    double acc[4] = {0, 0, 0, 0};
    int64_t i = 0;
    while (i + step <= n) {
        for (int64_t j = 0; j < step; ++j, ++i) acc[0] = fl(m, acc[0] + v[i * s]);
        for (int j = 1; j < 4; ++j) {
            acc[j] = fl(m, acc[j] + acc[j - 1]);
            acc[j - 1] = 0;
            if (i & ((step - 1) << (j * p))) break;
        }
    }
    for (; i < n; ++i) acc[0] = fl(m, acc[0] + v[i * s]);
    for (int j = 1; j < 4; ++j) acc[0] = fl(m, acc[0] + acc[j]);
    return acc[0];
}

/* torch's row_sum: item i into lane i % 4, each lane a level_sum of the n / 4 groups, the
 * n % 4 items left over added to lane 0, then ((l0 + l1) + l2) + l3. */
static double lane_sum(const arith *m, const double *v, int64_t n, int64_t s) {
    const int64_t g = n / 4;
    double l[4];
    for (int k = 0; k < 4; ++k) l[k] = level_sum(m, v + k * s, g, 4 * s);
    for (int64_t i = 4 * g; i < n; ++i) l[0] = fl(m, l[0] + v[i * s]);
    return fl(m, fl(m, fl(m, l[0] + l[1]) + l[2]) + l[3]);
}

/* The sum of a contiguous row of n values with W lanes (posenc.h): lane l is the lane_sum of
 * v[l], v[l + W], ... over the whole vectors; the lanes are added in order to the sum of the
 * tail.  W = 1, or n < W: the lane_sum of the row. */
static double row_sum(const arith *m, const double *v, int64_t n, int W) {
    if (W == 1 || n < W) return lane_sum(m, v, n, 1);
    const int64_t nv = n / W;
    double s = 0;
    for (int64_t e = nv * W; e < n; ++e) s = fl(m, s + v[e]);
    for (int l = 0; l < W; ++l) s = fl(m, s + lane_sum(m, v + l, nv, W));
    return s;
}

/* plain[c] = 1 where the weight gradient's column c takes the plain order (level_sum), 0
 * for the 4-lane one (lane_sum): posenc.h's column chunks of sum_threads threads. */
static void plain_columns(int64_t D, int64_t N, int threads, int lanes, size_t es,
                          unsigned char *plain) {
    memset(plain, 0, (size_t)D);
    const int serial = N * D < 32768 || threads == 1;
    const int64_t nth = serial ? 1 : threads < D ? threads : D, size = (D + nth - 1) / nth;
    const int64_t per128 = 128 / (int64_t)es, vec = es == 4 ? lanes : 2 * lanes;
    for (int64_t t = 0; t < nth && t * size < D; ++t) {
        int64_t b = t * size, e = b + size < D ? b + size : D;
        if (!serial) {
            b -= b % per128;
            if (e != D) e -= e % per128;
        }
        const int64_t block = e - b >= vec ? 4 * (int64_t)lanes : 4;
        for (int64_t c = b; c + block <= e; c += block) memset(plain + c, 1, (size_t)block);
    }
}

static int64_t partner(pe_pairing pr, int64_t e, int64_t R) {
    return pr == PE_PAIR_HALF ? (e < R / 2 ? e + R / 2 : e - R / 2) : e ^ 1;
}

/* sign(e) = -1 */
static int minus(pe_pairing pr, int64_t e, int64_t R) {
    return pr == PE_PAIR_HALF ? e < R / 2 : !(e & 1);
}

/* ---- views and buffers ---------------------------------------------------------------- */

/* A (B, T, H, inner) view: strides (b, t, h) and the elements its buffer holds. */
typedef struct view {
    int64_t stride[3];
    int64_t count;
} view;

static view make_view(int64_t B, int64_t T, int64_t H, int64_t inner, int64_t gap,
                      int heads_outer, unsigned expand) {
    view v;
    const int64_t row = inner + gap;
    v.stride[0] = T * H * row;
    v.stride[1] = heads_outer ? row : H * row;
    v.stride[2] = heads_outer ? T * row : row;
    for (int i = 0; i < 3; ++i)
        if (expand & (1u << i)) v.stride[i] = 0;
    const int64_t n[3] = {B, T, H};
    v.count = 0;
    if (B && T && H) {
        v.count = inner;
        for (int i = 0; i < 3; ++i) v.count += (n[i] - 1) * v.stride[i];
    }
    return v;
}

static int64_t at(const view *v, int64_t b, int64_t t, int64_t h) {
    return b * v->stride[0] + t * v->stride[1] + h * v->stride[2];
}

typedef struct buffer {
    unsigned char *p, *before; /* the buffer; its bytes before the call */
    size_t bytes;
} buffer;

/* Tensor q or k: its views and buffers (NULL where the call is given none). */
typedef struct tensor {
    view x, out, rstd, grad, wprod, ms_pow;
    buffer *bx, *bw, *bout, *brstd, *bgrad, *bwprod, *bwgrad, *bms_pow;
} tensor;

typedef struct problem {
    pe_qk_norm_args a;
    int backward;
    arith m;
    int W;            /* the row sums' lanes */
    pe_dtype wdt;     /* the weights' dtype */
    pe_dtype pdt;     /* wgrad's (fp32 / 16-bit backward) */
    pe_dtype rdt;     /* rstd's and ms_pow's */
    tensor t[2];
    buffer buf[MAX_BUFFERS];
    int nbuf;
    double *x, *g, *w, *c, *s, *y, *o, *sq, *wp; /* D values each (wp: N D) */
} problem;

/* A buffer of count elements of dt: an input filled from the stream (times scale), or an
 * output filled with SENTINEL. */
static buffer *add_buffer(problem *p, int64_t count, pe_dtype dt, uint64_t *seed, int output,
                          double scale) {
    REQUIRE(p->nbuf < MAX_BUFFERS);
    buffer *b = &p->buf[p->nbuf++];
    b->bytes = (size_t)count * dsize(dt);
    b->p = malloc(b->bytes ? b->bytes : 1);
    b->before = NULL;
    if (output) memset(b->p, SENTINEL, b->bytes);
    else
        for (int64_t i = 0; i < count; ++i) put(b->p, dt, i, value(seed) * scale);
    return b;
}

static void *data(const buffer *b) { return b ? b->p : NULL; }

/* Output element i of b must be want; it then gets SENTINEL back, so that a buffer ends as
 * it began exactly when every byte written belonged to an element checked. */
static void expect(buffer *b, pe_dtype dt, int64_t i, double want) {
    const double got = get(b->p, dt, i);
    if (!same(got, want)) {
        fprintf(stderr, "element %lld: %a, want %a\n", (long long)i, got, want);
        abort();
    }
    memset(b->p + (size_t)i * dsize(dt), SENTINEL, dsize(dt));
}

static void load(const buffer *b, pe_dtype dt, int64_t at0, int64_t n, double *v) {
    for (int64_t e = 0; e < n; ++e) v[e] = get(b->p, dt, at0 + e);
}

/* ---- the reference ---------------------------------------------------------------------- */

static void load_tables(problem *p, int64_t b, int64_t t) {
    const pe_qk_norm_args *a = &p->a;
    const int64_t o = (a->table_batch == 1 ? 0 : b) * a->table_stride[0] + t * a->table_stride[1];
    for (int64_t e = 0; e < a->rot_dim; ++e) {
        p->c[e] = get(a->cos, a->dtype, o + e);
        p->s[e] = get(a->sin, a->dtype, o + e);
    }
}

/* o = v rotated by the token's tables (the forward, or its transpose); v past R. */
static void rotate(const problem *p, const double *v, int transpose, double *o) {
    const arith *m = &p->m;
    const int64_t R = p->a.rot_dim;
    for (int64_t e = 0; e < R; ++e) {
        const int64_t q = partner(p->a.pairing, e, R);
        const int neg = minus(p->a.pairing, e, R);
        /* forward: sign(e) s[e]; transpose: -sign(e) s[p(e)] */
        const double ss = transpose ? (neg ? p->s[q] : -p->s[q]) : (neg ? -p->s[e] : p->s[e]);
        o[e] = fl(m, fl(m, v[e] * p->c[e]) + fl(m, v[q] * ss));
    }
    for (int64_t e = R; e < p->a.head_dim; ++e) o[e] = v[e];
}

/* The forward of row p->x: p->y (normalized and weighted, before the rotation), r and ms. */
static void forward_row(problem *p, double *r, double *ms) {
    const arith *m = &p->m;
    const pe_qk_norm_args *a = &p->a;
    const int64_t D = a->head_dim;
    const double *x = p->x, *w = p->w;
    for (int64_t e = 0; e < D; ++e) p->sq[e] = fl(m, x[e] * x[e]);
    const double eps = m->f32 ? (double)(float)a->eps : a->eps;
    *ms = fl(m, fl(m, row_sum(m, p->sq, D, p->W) / (double)D) + eps);
    *r = fl(m, 1.0 / fl(m, sqrt(*ms)));
    for (int64_t e = 0; e < D; ++e) {
        const double n = fl(m, x[e] * *r);
        if (a->form == PE_NORM_WEIGHT) p->y[e] = rnd(m, fl(m, w[e] * rnd(m, n)));
        else if (a->form == PE_NORM_ONE_PLUS_WEIGHT) p->y[e] = rnd(m, fl(m, n * fl(m, 1.0 + w[e])));
        else p->y[e] = rnd(m, fl(m, w[e] * n));
    }
}

/* The backward's saved values from the forward's formula: rstd (r, or ms for PE_NORM_POW)
 * and ms_pow = ms^-1.5 (any rounding of it is the caller's). */
static void fill_saved(problem *p) {
    const pe_qk_norm_args *a = &p->a;
    for (int j = 0; j < 2; ++j) {
        tensor *X = &p->t[j];
        const int64_t H = j ? a->k.heads : a->q.heads;
        if (!H || !X->brstd) continue;
        load(X->bw, p->wdt, 0, a->head_dim, p->w);
        for (int64_t b = 0; b < a->batch; ++b)
            for (int64_t t = 0; t < a->seq; ++t)
                for (int64_t h = 0; h < H; ++h) {
                    double r, ms;
                    load(X->bx, a->dtype, at(&X->x, b, t, h), a->head_dim, p->x);
                    forward_row(p, &r, &ms);
                    const int64_t i = at(&X->rstd, b, t, h);
                    put(X->brstd->p, p->rdt, i, a->form == PE_NORM_POW ? ms : r);
                    if (X->bms_pow)
                        put(X->bms_pow->p, p->rdt, at(&X->ms_pow, b, t, h),
                            pow(get(X->brstd->p, p->rdt, i), -1.5));
                }
    }
}

static void check_forward(problem *p) {
    const pe_qk_norm_args *a = &p->a;
    const int64_t D = a->head_dim;
    for (int j = 0; j < 2; ++j) {
        tensor *X = &p->t[j];
        const int64_t H = j ? a->k.heads : a->q.heads;
        if (!H) continue;
        load(X->bw, p->wdt, 0, D, p->w);
        for (int64_t b = 0; b < a->batch; ++b)
            for (int64_t t = 0; t < a->seq; ++t) {
                load_tables(p, b, t);
                for (int64_t h = 0; h < H; ++h) {
                    double r, ms;
                    load(X->bx, a->dtype, at(&X->x, b, t, h), D, p->x);
                    forward_row(p, &r, &ms);
                    rotate(p, p->y, 0, p->o);
                    const int64_t o = at(&X->out, b, t, h);
                    for (int64_t e = 0; e < D; ++e)
                        expect(X->bout, a->dtype, o + e, rnd(&p->m, p->o[e]));
                    expect(X->brstd, p->rdt, at(&X->rstd, b, t, h),
                           a->form == PE_NORM_POW ? ms : r);
                }
            }
    }
}

/* The backward of one row (posenc.h): dx checked, the weight-gradient products into wp. */
static void backward_row(problem *p, tensor *X, int64_t b, int64_t t, int64_t h, double *wp) {
    const arith *m = &p->m;
    const pe_qk_norm_args *a = &p->a;
    const int64_t D = a->head_dim;
    const int pow_form = a->form == PE_NORM_POW;
    load_tables(p, b, t);
    load(X->bx, a->dtype, at(&X->x, b, t, h), D, p->x);
    load(X->bgrad, a->dtype, at(&X->grad, b, t, h), D, p->g);
    const double saved = get(X->brstd->p, p->rdt, at(&X->rstd, b, t, h));
    const double r = pow_form ? fl(m, 1.0 / fl(m, sqrt(saved))) : saved;
    const double P = pow_form ? get(X->bms_pow->p, p->rdt, at(&X->ms_pow, b, t, h)) : 0;
    rotate(p, p->g, 1, p->o);
    double *gn = p->y;
    for (int64_t e = 0; e < D; ++e) {
        const double gy = rnd(m, p->o[e]), n = fl(m, p->x[e] * r), w = p->w[e];
        if (a->form == PE_NORM_WEIGHT) {
            gn[e] = rnd(m, fl(m, gy * w));
            wp[e] = rnd(m, fl(m, gy * rnd(m, n)));
        } else {
            gn[e] = fl(m, gy * (a->form == PE_NORM_ONE_PLUS_WEIGHT ? fl(m, 1.0 + w) : w));
            wp[e] = fl(m, gy * n);
        }
        p->sq[e] = fl(m, gn[e] * p->x[e]);
    }
    const double gr = row_sum(m, p->sq, D, p->W);
    const double gv = pow_form ? fl(m, gr * fl(m, -0.5 * P))
                               : fl(m, fl(m, -0.5 * gr) * fl(m, fl(m, r * r) * r));
    const double g2 = fl(m, gv / (double)D);
    const int64_t o = at(&X->out, b, t, h);
    for (int64_t e = 0; e < D; ++e)
        expect(X->bout, a->dtype, o + e,
               rnd(m, fl(m, fl(m, gn[e] * r) + fl(m, g2 * fl(m, 2.0 * p->x[e])))));
}

static void check_backward(problem *p) {
    const pe_qk_norm_args *a = &p->a;
    const int64_t D = a->head_dim, B = a->batch, T = a->seq;
    const int f64 = a->dtype == PE_FLOAT64;
    const size_t es = dsize(p->pdt);
    unsigned char *plain = malloc((size_t)D);
    for (int j = 0; j < 2; ++j) {
        tensor *X = &p->t[j];
        const int64_t H = j ? a->k.heads : a->q.heads, N = B * T * H;
        if (!H) { /* no rows: the weight gradient untouched, or its sum of nothing */
            for (int64_t c = 0; !f64 && X->bwgrad && c < D; ++c)
                if (memcmp(X->bwgrad->p + c * es, X->bwgrad->before + c * es, es))
                    expect(X->bwgrad, p->pdt, c, 0.0);
            continue;
        }
        load(X->bw, p->wdt, 0, D, p->w);
        for (int64_t i = 0; i < N; ++i) { /* rows in the order of the products' sum */
            const int64_t b = i / (T * H);
            const int64_t t = a->heads_first ? i % T : i / H % T;
            const int64_t h = a->heads_first ? i / T % H : i % H;
            double *wp = p->wp + (f64 ? 0 : i * D);
            backward_row(p, X, b, t, h, wp);
            for (int64_t e = 0; f64 && e < D; ++e)
                expect(X->bwprod, PE_FLOAT64, at(&X->wprod, b, t, h) + e, wp[e]);
        }
        if (f64) continue;
        plain_columns(D, N, a->sum_threads, a->sum_lanes, es, plain);
        for (int64_t c = 0; c < D; ++c) {
            const double s = plain[c] ? level_sum(&p->m, p->wp + c, N, D)
                                      : lane_sum(&p->m, p->wp + c, N, D);
            const double v = fl(&p->m, 0.0 + s);
            expect(X->bwgrad, p->pdt, c, es == 2 ? rnd(&p->m, v) : v);
        }
    }
    free(plain);
}

/* ---- invalid calls ---------------------------------------------------------------------- */

/* The pointers the call must read or write: the k-th set to NULL (k >= 0); their count. */
static int pointers(problem *p, int k) {
    pe_qk_norm_args *a = &p->a;
    int n = 0;
#define POINTER(field)                                                                    \
    do {                                                                                  \
        if (k == n++) field = NULL;                                                       \
    } while (0)
    if (!a->batch || !a->seq) return 0;
    if (a->q.heads || a->k.heads) {
        POINTER(a->cos);
        POINTER(a->sin);
    }
    pe_qk_norm_tensor *xs[2] = {&a->q, &a->k};
    for (int j = 0; j < 2; ++j) {
        pe_qk_norm_tensor *X = xs[j];
        if (!X->heads) continue;
        POINTER(X->x);
        POINTER(X->weight);
        POINTER(X->out);
        POINTER(X->rstd);
        if (!p->backward) continue;
        POINTER(X->grad);
        if (a->dtype == PE_FLOAT64) POINTER(X->wprod);
        else POINTER(X->wgrad);
        if (a->form == PE_NORM_POW) POINTER(X->ms_pow);
    }
#undef POINTER
    return n;
}

/* Breaks one argument (case 1 + below(11)); returns whether the call must now fail. */
static int breakage(problem *p, unsigned what, fuzz_bytes *in) {
    pe_qk_norm_args *a = &p->a;
    const int64_t R = a->rot_dim, D = a->head_dim, B = a->batch, T = a->seq;
    const int64_t heads = a->q.heads + a->k.heads;
    static const int bad_lanes[5] = {0, 2, 3, 32, -8};
    switch (what) {
    case 1: {
        const int64_t bad[3] = {R + 1, 0, D + 2};
        a->rot_dim = bad[fuzz_below(in, 3)];
        return 1;
    }
    case 2: a->pairing = (pe_pairing)2; return 1;
    case 3: a->form = (pe_norm_form)4; return 1;
    case 4: a->dtype = (pe_dtype)(4 + fuzz_below(in, 4)); return 1;
    case 5: a->sum_lanes = bad_lanes[fuzz_below(in, 5)]; return 1;
    case 6:
        if (a->dtype == PE_FLOAT64 || (a->dtype != PE_FLOAT32 && a->form == PE_NORM_WEIGHT)) {
            a->weight_f32 = 1;
            return 1;
        }
        break;
    case 7:
        switch (fuzz_below(in, 5)) {
        case 0: a->batch = -1; break;
        case 1: a->seq = -1; break;
        case 2: a->head_dim = -2; break;
        case 3: a->q.heads = -1; break;
        default: a->k.heads = -1; break;
        }
        return 1;
    case 8: /* B T (Hq + Hk) D past int64 */
        if (B * T * heads >= 2 && fuzz_below(in, 2)) a->head_dim = INT64_MAX / 2 + 1;
        else a->batch = INT64_MAX, a->seq = 2;
        return 1;
    case 9: {
        const int n = pointers(p, -1);
        if (n) {
            pointers(p, (int)fuzz_below(in, (unsigned)n));
            return 1;
        }
        break;
    }
    case 10:
        if (B && T && heads) {
            a->table_batch = B + 2;
            return 1;
        }
        break;
    case 11: /* counts only in the backward of fp32 / 16-bit tensors */
        a->sum_threads = fuzz_below(in, 2) ? 0 : -1;
        return p->backward && a->dtype != PE_FLOAT64;
    }
    a->sum_lanes = 3; /* where the case does not apply */
    return 1;
}

/* ---- the harness ------------------------------------------------------------------------ */

/* A (B, T, H, inner) view from the input: up to gaps - 1 elements between rows, the heads
 * outer or inner, and for an input now and then dimensions expanded (stride 0). */
static view fuzz_view(fuzz_bytes *in, const pe_qk_norm_args *a, int64_t H, int64_t inner,
                      unsigned gaps, int input) {
    const int64_t gap = fuzz_below(in, gaps);
    const int heads_outer = (int)fuzz_below(in, 2);
    const unsigned expand = input && fuzz_below(in, 4) == 0 ? fuzz_below(in, 8) : 0;
    return make_view(a->batch, a->seq, H, inner, gap, heads_outer, expand);
}

/* Tensor j's views and buffers (H heads; a tensor without heads is now and then given NULL
 * pointers). */
static void make_tensor(problem *p, int j, int64_t H, fuzz_bytes *in, uint64_t *seed) {
    pe_qk_norm_args *a = &p->a;
    const int64_t D = a->head_dim;
    const pe_dtype dt = a->dtype;
    tensor *X = &p->t[j];
    pe_qk_norm_tensor *x = j ? &a->k : &a->q;
    x->heads = H;
    if (!H && fuzz_below(in, 2)) return;
    static const double scales[4] = {1.0, 1.0, 1e-22, 1e20}; /* squares under / over fp32 */
    const double scale = scales[fuzz_below(in, 4)];
    X->x = fuzz_view(in, a, H, D, 3, 1);
    X->out = fuzz_view(in, a, H, D, 2, 0);
    X->rstd = fuzz_view(in, a, H, 1, 2, 0);
    X->bx = add_buffer(p, X->x.count, dt, seed, 0, scale);
    X->bw = add_buffer(p, D, p->wdt, seed, 0, 1.0);
    X->bout = add_buffer(p, X->out.count, dt, seed, 1, 1.0);
    X->brstd = add_buffer(p, X->rstd.count, p->rdt, seed, !p->backward, 1.0);
    x->x = data(X->bx), x->weight = data(X->bw), x->out = data(X->bout), x->rstd = data(X->brstd);
    memcpy(x->x_stride, X->x.stride, sizeof x->x_stride);
    memcpy(x->out_stride, X->out.stride, sizeof x->out_stride);
    memcpy(x->rstd_stride, X->rstd.stride, sizeof x->rstd_stride);
    if (!p->backward) return;
    X->grad = fuzz_view(in, a, H, D, 3, 1);
    X->bgrad = add_buffer(p, X->grad.count, dt, seed, 0, 1.0);
    x->grad = data(X->bgrad);
    memcpy(x->grad_stride, X->grad.stride, sizeof x->grad_stride);
    if (dt == PE_FLOAT64) {
        X->wprod = fuzz_view(in, a, H, D, 2, 0);
        X->bwprod = add_buffer(p, X->wprod.count, PE_FLOAT64, seed, 1, 1.0);
    } else {
        X->bwgrad = add_buffer(p, D, p->pdt, seed, 1, 1.0);
        if (fuzz_below(in, 2)) { /* given, and not to be written */
            X->wprod = make_view(1, 1, 1, D, 0, 0, 0);
            X->bwprod = add_buffer(p, D, dt, seed, 1, 1.0);
        }
    }
    x->wprod = data(X->bwprod), x->wgrad = data(X->bwgrad);
    memcpy(x->wprod_stride, X->wprod.stride, sizeof x->wprod_stride);
    if (a->form == PE_NORM_POW) {
        X->ms_pow = fuzz_view(in, a, H, 1, 2, 1);
        X->bms_pow = add_buffer(p, X->ms_pow.count, p->rdt, seed, 0, 1.0);
        x->ms_pow = data(X->bms_pow);
        memcpy(x->ms_pow_stride, X->ms_pow.stride, sizeof x->ms_pow_stride);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *bytes, size_t size) {
    fuzz_bytes in = {bytes, size};
    uint64_t seed = fuzz_u64(&in) | 1u;
    static problem p;
    memset(&p, 0, sizeof p);
    pe_qk_norm_args *a = &p.a;
    static const int64_t dims[] = {2,  4,  6,  8,  10, 12,  16,  20,  24,
                                   32, 40, 64, 80, 96, 128, 256, 1040};
    static const double epss[8] = {1e-6, 1e-5, 1e-12, 0.0, 0.25, 3e-39, 1e-50, -1e-6};
    static const int lanes[4] = {1, 4, 8, 16};
    p.backward = (int)fuzz_below(&in, 2);
    const pe_dtype dt = dtypes[fuzz_below(&in, 4)];
    a->dtype = dt;
    a->form = (pe_norm_form)fuzz_below(&in, 4);
    a->pairing = (pe_pairing)fuzz_below(&in, 2);
    const int64_t D = dims[fuzz_below(&in, sizeof dims / sizeof *dims)];
    int64_t R = D; /* all of D, about half, or any even width */
    switch (fuzz_below(&in, 3)) {
    case 1: R = D / 2 & ~(int64_t)1; break;
    case 2: R = 2 + 2 * (int64_t)fuzz_below(&in, (unsigned)(D / 2)); break;
    }
    a->head_dim = D;
    a->rot_dim = R < 2 ? 2 : R;
    /* now and then rows enough for the kernels' threads (B T (Hq + Hk) D >= 2^17) and torch's
     * parallel column sums of the weight gradient (B T H D >= 32768); T from 16 to 64, so
     * that T is now and then a multiple of the weight gradients' blocks (16 and 64 rows),
     * where the backward walks rows that lie token by token so (qk_norm.c, by_token_chunk) */
    const int many = D <= 256 && fuzz_below(&in, 8) == 0;
    a->batch = fuzz_below(&in, 4);
    a->seq = many ? 16 + fuzz_below(&in, 49) : fuzz_below(&in, 6);
    const int64_t Hq = fuzz_below(&in, 5), Hk = fuzz_below(&in, 4);
    a->weight_f32 = (dt == PE_FLOAT32 || (dt != PE_FLOAT64 && a->form != PE_NORM_WEIGHT)) &&
                    fuzz_below(&in, 2);
    a->eps = epss[fuzz_below(&in, 8)];
    a->sum_lanes = lanes[fuzz_below(&in, 4)];
    a->nthreads = (int)fuzz_below(&in, 4);
    a->sum_threads = 1 + (int)fuzz_below(&in, 6);
    a->heads_first = (int)fuzz_below(&in, 2);
    pe_isa_set((pe_isa)fuzz_below(&in, (unsigned)pe_isa_best() + 1));
    p.m.f32 = dt != PE_FLOAT64;
    p.m.dt = dt;
    p.W = dt == PE_FLOAT64 && a->sum_lanes > 1 ? a->sum_lanes / 2 : a->sum_lanes;
    p.wdt = a->weight_f32 ? PE_FLOAT32 : dt;
    p.pdt = a->form == PE_NORM_WEIGHT ? dt : PE_FLOAT32;
    p.rdt = dt == PE_FLOAT64 ? PE_FLOAT64 : PE_FLOAT32;

    /* tables (Bc, T, R): rows R + gap apart, or one row for every token */
    const int64_t B = a->batch, T = a->seq, Bc = fuzz_below(&in, 2) ? B : 1;
    const int64_t row = a->rot_dim + fuzz_below(&in, 3), shared = fuzz_below(&in, 5) == 0;
    a->table_batch = Bc;
    a->table_stride[1] = shared ? 0 : row;
    a->table_stride[0] = shared ? row : T * row;
    const int64_t tcount =
        Bc && T ? (Bc - 1) * a->table_stride[0] + (T - 1) * a->table_stride[1] + a->rot_dim : 0;
    a->cos = add_buffer(&p, tcount, dt, &seed, 0, 1.0)->p;
    a->sin = add_buffer(&p, tcount, dt, &seed, 0, 1.0)->p;
    make_tensor(&p, 0, Hq, &in, &seed);
    make_tensor(&p, 1, Hk, &in, &seed);
    const int saved_from_formula = fuzz_below(&in, 4) != 0;

    const int64_t N = B * T * (Hq > Hk ? Hq : Hk);
    p.x = malloc((size_t)(8 * D + N * D) * sizeof(double));
    p.g = p.x + D, p.w = p.g + D, p.c = p.w + D, p.s = p.c + D, p.y = p.s + D, p.o = p.y + D;
    p.sq = p.o + D, p.wp = p.sq + D;
    if (p.backward && saved_from_formula) fill_saved(&p);

    const int broken = fuzz_below(&in, 5) == 0 && breakage(&p, 1 + fuzz_below(&in, 11), &in);
    for (int i = 0; i < p.nbuf; ++i) {
        p.buf[i].before = malloc(p.buf[i].bytes ? p.buf[i].bytes : 1);
        memcpy(p.buf[i].before, p.buf[i].p, p.buf[i].bytes);
    }
    const int rc = p.backward ? pe_qk_norm_rope_backward(a) : pe_qk_norm_rope(a);
    REQUIRE(rc == (broken ? PE_ERR_ARG : PE_OK));
    if (!broken) {
        if (p.backward) check_backward(&p);
        else check_forward(&p);
    }
    /* inputs as they were; outputs too, once the elements checked have their sentinel back */
    for (int i = 0; i < p.nbuf; ++i) {
        REQUIRE(memcmp(p.buf[i].p, p.buf[i].before, p.buf[i].bytes) == 0);
        free(p.buf[i].p);
        free(p.buf[i].before);
    }
    free(p.x);
    pe_isa_set(pe_isa_best());
    return 0;
}

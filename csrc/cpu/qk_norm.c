/*
 * Fused per-head RMSNorm + RoPE (posenc.h, pe_qk_norm_rope): argument checks, the loop
 * that runs blocks of tokens over threads, and the fp64 core.  The fp32 core is
 * qk_norm_f32.h, compiled per instruction set into qk_norm_<isa>.c.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

typedef void (*qk_rows_fn)(const pe_qk_norm_args *a, int64_t i0, int64_t n, int backward,
                           void *scratch);

/* ---- fp64 core: the same steps as qk_norm_f32.h in double, sums in torch's order for
 * doubles (half as many lanes). */

static double qk_sum_f64(const double *v, int64_t n, int W) {
    if (n < W) W = 1;
    const int64_t nvec = n / W, groups = nvec / 4;
    double acc[4][4][8] = {{{0}}};
    int64_t lp = 4;
    if (groups > 2) {
        const int64_t c = (64 - __builtin_clzll((uint64_t)(groups - 1))) / 4;
        if (c > lp) lp = c;
    }
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
                    acc[j - 1][k][l] = 0.0;
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
    for (int64_t r = 4 * groups; r < nvec; ++r)
        for (int l = 0; l < W; ++l) acc[0][0][l] += v[r * W + l];
    for (int k = 1; k < 4; ++k)
        for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
    if (W == 1) return acc[0][0][0];
    double s = 0.0;
    for (int64_t e = nvec * W; e < n; ++e) s += v[e];
    for (int l = 0; l < W; ++l) s += acc[0][0][l];
    return s;
}

static void qk_rotate_f64(const double *x, double *o, const double *c, const double *ss,
                          int64_t R, int64_t D, pe_pairing p) {
    for (int64_t e = 0; e < R; ++e) {
        const int64_t q = p == PE_PAIR_HALF ? (e < R / 2 ? e + R / 2 : e - R / 2) : e ^ 1;
        o[e] = pe_rot_f64(x[e], c[e], x[q], ss[e]);
    }
    for (int64_t e = R; e < D; ++e) o[e] = x[e];
}

static void qk_norm_rows_f64(const pe_qk_norm_args *a, int64_t i0, int64_t n, int backward,
                             void *scratch) {
    const int64_t D = a->head_dim, R = a->rot_dim, T = a->seq;
    const int W = a->sum_lanes > 1 ? a->sum_lanes / 2 : 1;
    double *w[2] = {(double *)scratch, (double *)scratch + D};
    double *c = w[1] + D, *ss = c + R, *x = ss + R, *t = x + D, *y = t + D, *o = y + D;
    double *g = o + D;
    const pe_qk_norm_tensor *xs[2] = {&a->q, &a->k};
    for (int k = 0; k < 2; ++k)
        if (xs[k]->heads) memcpy(w[k], xs[k]->weight, (size_t)D * 8);
    for (int64_t i = i0; i < i0 + n; ++i) {
        const int64_t b = i / T, tk = i % T;
        const double *cr = (const double *)a->cos +
                           (a->table_batch == 1 ? 0 : b) * a->table_stride[0] +
                           tk * a->table_stride[1];
        const double *sr = (const double *)a->sin + (cr - (const double *)a->cos);
        for (int64_t e = 0; e < R; ++e) {
            const int64_t q = a->pairing == PE_PAIR_HALF ? (e < R / 2 ? e + R / 2 : e - R / 2)
                                                         : e ^ 1;
            const int first = a->pairing == PE_PAIR_HALF ? e < R / 2 : e % 2 == 0;
            c[e] = cr[e];
            ss[e] = backward ? (first ? sr[q] : -sr[q]) : (first ? -sr[e] : sr[e]);
        }
        for (int k = 0; k < 2; ++k) {
            const pe_qk_norm_tensor *X = xs[k];
            const double *wk = w[k];
            for (int64_t h = 0; h < X->heads; ++h) {
                memcpy(x, pe_row(X->x, X->x_stride, 8, b, tk, h), (size_t)D * 8);
                double *out = (double *)pe_row(X->out, X->out_stride, 8, b, tk, h);
                double *rs = (double *)pe_row(X->rstd, X->rstd_stride, 8, b, tk, h);
                if (!backward) {
                    for (int64_t e = 0; e < D; ++e) t[e] = x[e] * x[e];
                    const double ms = qk_sum_f64(t, D, W) / (double)D + a->eps;
                    const double r = 1.0 / sqrt(ms);
                    *rs = a->form == PE_NORM_POW ? ms : r;
                    for (int64_t e = 0; e < D; ++e)
                        y[e] = a->form == PE_NORM_ONE_PLUS_WEIGHT ? x[e] * r * (1.0 + wk[e])
                                                                  : wk[e] * (x[e] * r);
                    qk_rotate_f64(y, out, c, ss, R, D, a->pairing);
                    continue;
                }
                const int pow_form = a->form == PE_NORM_POW;
                const double r = pow_form ? 1.0 / sqrt(*rs) : *rs;
                memcpy(g, pe_row(X->grad, X->grad_stride, 8, b, tk, h), (size_t)D * 8);
                qk_rotate_f64(g, y, c, ss, R, D, a->pairing); /* y: gy */
                double *wp = (double *)pe_row(X->wprod, X->wprod_stride, 8, b, tk, h);
                for (int64_t e = 0; e < D; ++e) {
                    o[e] = y[e] * (a->form == PE_NORM_ONE_PLUS_WEIGHT ? 1.0 + wk[e] : wk[e]);
                    wp[e] = y[e] * (x[e] * r);
                    t[e] = o[e] * x[e];
                }
                const double gr = qk_sum_f64(t, D, W);
                const double gx2 = (pow_form ? gr * (-0.5 * *(const double *)pe_row(
                                                         X->ms_pow, X->ms_pow_stride, 8, b, tk, h))
                                             : (-0.5 * gr) * ((r * r) * r)) /
                                   (double)D;
                for (int64_t e = 0; e < D; ++e) out[e] = o[e] * r + gx2 * (2.0 * x[e]);
            }
        }
    }
}

/* ---- checks and threads ------------------------------------------------------------- */

static int tensor_ok(const pe_qk_norm_args *a, const pe_qk_norm_tensor *x, int backward,
                     int empty) {
    if (x->heads < 0) return 0;
    if (!x->heads || empty) return 1;
    return x->x && x->weight && x->out && x->rstd &&
           (!backward || (x->grad && x->wprod && (a->form != PE_NORM_POW || x->ms_pow)));
}

static int args_ok(const pe_qk_norm_args *a, int backward) {
    if (!a || a->batch < 0 || a->seq < 0 || a->head_dim < 0) return 0;
    if (a->rot_dim < 2 || a->rot_dim % 2 || a->rot_dim > a->head_dim) return 0;
    if (a->pairing != PE_PAIR_HALF && a->pairing != PE_PAIR_ADJACENT) return 0;
    if (a->form != PE_NORM_WEIGHT && a->form != PE_NORM_ONE_PLUS_WEIGHT &&
        a->form != PE_NORM_WEIGHT_F32 && a->form != PE_NORM_POW)
        return 0;
    if (!pe_dtype_valid(a->dtype)) return 0;
    if (a->weight_f32 && (a->dtype == PE_FLOAT64 ||
                          (a->dtype != PE_FLOAT32 && a->form == PE_NORM_WEIGHT)))
        return 0;
    if (a->sum_lanes != 1 && a->sum_lanes != 4 && a->sum_lanes != 8 && a->sum_lanes != 16)
        return 0;
    if (a->q.heads < 0 || a->k.heads < 0) return 0;
    int64_t n;
    if (__builtin_mul_overflow(a->batch, a->seq, &n) ||
        __builtin_add_overflow(a->q.heads, a->k.heads, &n) ||
        __builtin_mul_overflow(a->batch * a->seq, n, &n) ||
        __builtin_mul_overflow(n, a->head_dim, &n))
        return 0;
    const int empty = a->batch == 0 || a->seq == 0;
    if (!empty && (a->q.heads || a->k.heads)) {
        if (!a->cos || !a->sin) return 0;
        if (a->table_batch != 1 && a->table_batch != a->batch) return 0;
    }
    return tensor_ok(a, &a->q, backward, empty) && tensor_ok(a, &a->k, backward, empty);
}

static qk_rows_fn rows_fn(pe_dtype dt) {
    if (dt == PE_FLOAT64) return qk_norm_rows_f64;
#ifdef PE_HAVE_X86_VARIANTS
    switch (pe_isa_current()) {
#ifdef PE_HAVE_AVX512BF16
    case PE_ISA_AVX512_BF16: return pe_qk_norm_rows_f32_avx512bf16;
#else
    case PE_ISA_AVX512_BF16: /* (not built: the compiler lacks -mavx512bf16) */
#endif
    case PE_ISA_AVX512: return pe_qk_norm_rows_f32_avx512;
    case PE_ISA_AVX2: return pe_qk_norm_rows_f32_avx2;
    default: break;
    }
#endif
    return pe_qk_norm_rows_f32_baseline;
}

static int run(const pe_qk_norm_args *a, int backward) {
    if (!args_ok(a, backward)) return PE_ERR_ARG;
    const int64_t tokens = a->batch * a->seq, heads = a->q.heads + a->k.heads;
    if (!tokens || !heads) return PE_OK;
    const qk_rows_fn fn = rows_fn(a->dtype);
    const size_t bytes = pe_qk_scratch_bytes(a->rot_dim, a->head_dim);
    const int64_t elements = tokens * heads * a->head_dim;
    int nth = elements < PE_SERIAL_ELEMENTS || a->nthreads < 1 ? 1 : a->nthreads;
    if (nth > tokens) nth = (int)tokens;
    if (nth == 1) {
        void *scratch = malloc(bytes);
        if (!scratch) return PE_ERR_NOMEM;
        fn(a, 0, tokens, backward, scratch);
        free(scratch);
        return PE_OK;
    }
    const int64_t tile = PE_TOKEN_TILE, tiles = (tokens + tile - 1) / tile;
    int failed = 0;
#pragma omp parallel num_threads(nth)
    {
        void *scratch = malloc(bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; ++i) {
            if (!scratch) continue;
            const int64_t i0 = i * tile;
            fn(a, i0, tokens - i0 < tile ? tokens - i0 : tile, backward, scratch);
        }
        free(scratch);
    }
    return failed ? PE_ERR_NOMEM : PE_OK;
}

int pe_qk_norm_rope(const pe_qk_norm_args *a) { return run(a, 0); }

int pe_qk_norm_rope_backward(const pe_qk_norm_args *a) { return run(a, 1); }

/*
 * Torch-free tests of pe_qk_norm_rope and its backward: fp32 and fp64 against the formula
 * of posenc.h computed in long double, the sum order against a plain emulation of torch's
 * cascade (every lane count, a tail, the cascade levels of long rows), the backward of
 * fp64 against central differences, the fp32 weight gradients (summed in the kernel, in
 * both of torch's orders) against fp64's products, every SIMD variant, threads and bad
 * arguments.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"
#include "posenc.h"

enum { B = 2, T = 5, HQ = 3, HK = 1 };

typedef struct problem {
    int64_t D, R;
    pe_norm_form form;
    pe_pairing pairing;
    double x[2][B * T * HQ * 64], w[2][64], c[T * 64], s[T * 64];
} problem;

static void fill(problem *p, int64_t D, int64_t R, pe_norm_form form, pe_pairing pairing) {
    p->D = D, p->R = R, p->form = form, p->pairing = pairing;
    unsigned seed = 12345u;
    const int64_t heads[2] = {HQ, HK};
    for (int k = 0; k < 2; ++k) {
        for (int64_t i = 0; i < B * T * heads[k] * D; ++i) {
            seed = seed * 1103515245u + 12345u;
            p->x[k][i] = (double)(int)((seed >> 8) % 2001 - 1000) / 250.0;
        }
        for (int64_t e = 0; e < D; ++e) p->w[k][e] = 0.5 + 0.01 * (double)(e % 37) - 0.1 * k;
    }
    for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < R; ++e) {
            const double ang = (double)t * pow(10000.0, -(double)(e % (R / 2)) / (double)R);
            p->c[t * R + e] = cos(ang);
            p->s[t * R + e] = sin(ang);
        }
}

/* The forward of one row in long double, from posenc.h's formula (fp64's steps). */
static void reference_row(const problem *p, int k, const double *x, long double *y) {
    const int64_t D = p->D;
    long double ss = 0;
    for (int64_t e = 0; e < D; ++e) ss += (long double)x[e] * x[e];
    const long double r = 1.0L / sqrtl(ss / D + 1e-6L);
    for (int64_t e = 0; e < D; ++e)
        y[e] = x[e] * r * (p->form == PE_NORM_ONE_PLUS_WEIGHT ? 1.0L + p->w[k][e] : p->w[k][e]);
}

static void rotate_ref(const problem *p, int64_t t, const long double *y, long double *o) {
    const int64_t D = p->D, R = p->R, h = R / 2;
    for (int64_t e = 0; e < R; ++e) {
        const int first = p->pairing == PE_PAIR_HALF ? e < h : e % 2 == 0;
        const int64_t q = p->pairing == PE_PAIR_HALF ? (first ? e + h : e - h) : e ^ 1;
        o[e] = y[e] * p->c[t * R + e] + (first ? -1 : 1) * y[q] * p->s[t * R + e];
    }
    for (int64_t e = R; e < D; ++e) o[e] = y[e];
}

/* Set by bad_arguments: run() passes weight_f32, and no ms_pow rows; sum_threads for the
 * weight gradients' order (0: the run's thread count). */
static int weight_f32_flag, no_ms_pow, sum_threads;

/* The weight gradients of the last backward run: fp32's wgrad, or fp64's products summed
 * in long double. */
static double wgrad_out[2][64];

/* Runs the op on p's data converted to dt (fp32 or fp64); out (B, T, H, D) as double. */
static int run(const problem *p, pe_dtype dt, int nthreads, double *out[2], double *rstd[2],
               const double *grad[2], double *dx[2], int lanes) {
    const size_t es = dt == PE_FLOAT64 ? 8 : 4;
    const int64_t D = p->D, R = p->R, heads[2] = {HQ, HK};
    void *xs[2], *os[2], *rs[2], *ws[2], *gs[2], *ps[2], *pw[2];
    float wg[2][64];
    void *cs = malloc((size_t)(T * R) * es), *sn = malloc((size_t)(T * R) * es);
    for (int64_t i = 0; i < T * R; ++i) {
        if (dt == PE_FLOAT64) ((double *)cs)[i] = p->c[i], ((double *)sn)[i] = p->s[i];
        else ((float *)cs)[i] = (float)p->c[i], ((float *)sn)[i] = (float)p->s[i];
    }
    pe_qk_norm_args a = {0};
    a.batch = B, a.seq = T, a.head_dim = D, a.rot_dim = R, a.pairing = p->pairing;
    a.form = p->form, a.dtype = dt, a.eps = 1e-6, a.sum_lanes = lanes;
    a.weight_f32 = weight_f32_flag;
    a.cos = cs, a.sin = sn, a.table_batch = 1, a.table_stride[0] = 0, a.table_stride[1] = R;
    a.nthreads = nthreads;
    a.sum_threads = sum_threads ? sum_threads : nthreads;
    pe_qk_norm_tensor *ts[2] = {&a.q, &a.k};
    for (int k = 0; k < 2; ++k) {
        const int64_t n = B * T * heads[k] * D, H = heads[k];
        xs[k] = malloc((size_t)n * es), os[k] = malloc((size_t)n * es);
        rs[k] = malloc((size_t)(n / D) * 8), ws[k] = malloc((size_t)D * es);
        gs[k] = malloc((size_t)n * es), ps[k] = malloc((size_t)n * es);
        pw[k] = malloc((size_t)(n / D) * es);
        for (int64_t i = 0; i < n; ++i) {
            if (dt == PE_FLOAT64) {
                ((double *)xs[k])[i] = p->x[k][i];
                ((double *)gs[k])[i] = grad ? grad[k][i] : 0;
            } else {
                ((float *)xs[k])[i] = (float)p->x[k][i];
                ((float *)gs[k])[i] = grad ? (float)grad[k][i] : 0;
            }
        }
        for (int64_t e = 0; e < D; ++e) {
            if (dt == PE_FLOAT64) ((double *)ws[k])[e] = p->w[k][e];
            else ((float *)ws[k])[e] = (float)p->w[k][e];
        }
        pe_qk_norm_tensor *x = ts[k];
        x->heads = H, x->x = xs[k], x->weight = ws[k], x->out = os[k], x->rstd = rs[k];
        x->grad = gs[k], x->wprod = ps[k], x->wgrad = wg[k];
        const int64_t st[3] = {T * H * D, H * D, D}, rst[3] = {T * H, H, 1};
        memcpy(x->x_stride, st, sizeof st), memcpy(x->out_stride, st, sizeof st);
        memcpy(x->grad_stride, st, sizeof st), memcpy(x->wprod_stride, st, sizeof st);
        memcpy(x->rstd_stride, rst, sizeof rst);
        x->ms_pow = no_ms_pow ? NULL : pw[k];
        memcpy(x->ms_pow_stride, rst, sizeof rst);
    }
    int rc = pe_qk_norm_rope(&a);
    for (int k = 0; k < 2 && rc == PE_OK; ++k) {
        const int64_t n = B * T * heads[k] * D;
        for (int64_t i = 0; i < n; ++i)
            out[k][i] = dt == PE_FLOAT64 ? ((double *)os[k])[i] : ((float *)os[k])[i];
        for (int64_t i = 0; rstd && i < n / D; ++i)
            rstd[k][i] = dt == PE_FLOAT64 ? ((double *)rs[k])[i] : ((float *)rs[k])[i];
    }
    if (rc == PE_OK && grad) {
        /* PE_NORM_POW: rstd holds ms; the caller's ms^-1.5 (here libm's pow) */
        for (int k = 0; k < 2 && p->form == PE_NORM_POW; ++k)
            for (int64_t i = 0; i < B * T * heads[k]; ++i) {
                if (dt == PE_FLOAT64) ((double *)pw[k])[i] = pow(((double *)rs[k])[i], -1.5);
                else ((float *)pw[k])[i] = (float)pow(((float *)rs[k])[i], -1.5);
            }
        rc = pe_qk_norm_rope_backward(&a);
        for (int k = 0; k < 2 && rc == PE_OK; ++k) {
            for (int64_t i = 0; i < B * T * heads[k] * D; ++i)
                dx[k][i] = dt == PE_FLOAT64 ? ((double *)os[k])[i] : ((float *)os[k])[i];
            for (int64_t e = 0; e < D; ++e) {
                long double sum = 0;
                for (int64_t row = 0; dt == PE_FLOAT64 && row < B * T * heads[k]; ++row)
                    sum += ((double *)ps[k])[row * D + e];
                wgrad_out[k][e] = dt == PE_FLOAT64 ? (double)sum : wg[k][e];
            }
        }
    }
    for (int k = 0; k < 2; ++k) {
        free(xs[k]), free(os[k]), free(rs[k]);
        free(ws[k]), free(gs[k]), free(ps[k]), free(pw[k]);
    }
    free(cs), free(sn);
    return rc;
}

static double out_q[B * T * HQ * 64], out_k[B * T * HK * 64];

static void forward_matches_formula(pe_dtype dt, double tol) {
    static const int64_t dims[][2] = {{16, 16}, {20, 8}, {64, 64}, {40, 24}};
    for (int form = 0; form <= PE_NORM_POW; ++form)
        for (int pairing = 0; pairing < 2; ++pairing)
            for (size_t d = 0; d < sizeof dims / sizeof dims[0]; ++d) {
                static problem p;
                fill(&p, dims[d][0], dims[d][1], (pe_norm_form)form, (pe_pairing)pairing);
                double *out[2] = {out_q, out_k};
                CHECK(run(&p, dt, 2, out, NULL, NULL, NULL, 8) == PE_OK, "run");
                const int64_t heads[2] = {HQ, HK}, D = p.D;
                double worst = 0;
                for (int k = 0; k < 2; ++k)
                    for (int64_t row = 0; row < B * T * heads[k]; ++row) {
                        long double y[64], o[64];
                        reference_row(&p, k, p.x[k] + row * D, y);
                        rotate_ref(&p, (row / heads[k]) % T, y, o);
                        for (int64_t e = 0; e < D; ++e) {
                            const double err = fabs((double)(out[k][row * D + e] - o[e]));
                            if (err > worst) worst = err;
                        }
                    }
                CHECK(worst <= tol, "dtype %d form %d pairing %d D %lld: error %g > %g", dt,
                      form, pairing, (long long)D, worst, tol);
            }
}

/* fp64 backward against central differences of L = sum(g * out) in q and k. */
static void backward_matches_differences(void) {
    static problem p;
    static double gq[B * T * HQ * 64], gk[B * T * HK * 64], dq[B * T * HQ * 64],
        dk[B * T * HK * 64], lo_q[B * T * HQ * 64], lo_k[B * T * HK * 64];
    for (int form = 0; form <= PE_NORM_POW; ++form) {
        fill(&p, 20, 8, (pe_norm_form)form, PE_PAIR_HALF);
        for (int64_t i = 0; i < B * T * HQ * 20; ++i) gq[i] = sin(0.7 * (double)i);
        for (int64_t i = 0; i < B * T * HK * 20; ++i) gk[i] = cos(0.3 * (double)i);
        const double *grad[2] = {gq, gk};
        double *out[2] = {out_q, out_k}, *dx[2] = {dq, dk};
        CHECK(run(&p, PE_FLOAT64, 1, out, NULL, grad, dx, 8) == PE_OK, "backward");
        const int64_t probes[] = {0, 7, 19, 45, 133};
        for (int k = 0; k < 2; ++k)
            for (size_t j = 0; j < sizeof probes / sizeof probes[0]; ++j) {
                const int64_t i = probes[j];
                const double h = 1e-6, keep = p.x[k][i];
                double *hi[2] = {out_q, out_k}, *lo[2] = {lo_q, lo_k};
                p.x[k][i] = keep + h;
                run(&p, PE_FLOAT64, 1, hi, NULL, NULL, NULL, 8);
                p.x[k][i] = keep - h;
                run(&p, PE_FLOAT64, 1, lo, NULL, NULL, NULL, 8);
                p.x[k][i] = keep;
                double num = 0;
                const int64_t n = B * T * (k ? HK : HQ) * 20;
                for (int64_t e = 0; e < n; ++e) num += grad[k][e] * (hi[k][e] - lo[k][e]);
                num /= 2 * h;
                CHECK(fabs(num - dx[k][i]) <= 1e-6 * (1 + fabs(num)),
                      "form %d tensor %d element %lld: %g vs differences %g", form, k,
                      (long long)i, dx[k][i], num);
            }
    }
}

/* Every variant and thread count gives the same bits; every lane count runs. */
static void variants_agree(void) {
    static problem p;
    static double first_q[B * T * HQ * 64], first_k[B * T * HK * 64];
    fill(&p, 64, 32, PE_NORM_WEIGHT, PE_PAIR_HALF);
    double *ref[2] = {first_q, first_k}, *out[2] = {out_q, out_k};
    pe_isa_set(PE_ISA_BASELINE);
    CHECK(run(&p, PE_FLOAT32, 1, ref, NULL, NULL, NULL, 8) == PE_OK, "baseline");
    for (int isa = PE_ISA_BASELINE; isa <= (int)pe_isa_best(); ++isa)
        for (int threads = 1; threads <= 2; ++threads) {
            pe_isa_set((pe_isa)isa);
            CHECK(run(&p, PE_FLOAT32, threads, out, NULL, NULL, NULL, 8) == PE_OK, "run");
            CHECK(!memcmp(out_q, first_q, sizeof first_q) &&
                      !memcmp(out_k, first_k, sizeof first_k),
                  "isa %d threads %d differs from the baseline", isa, threads);
        }
    pe_isa_set(pe_isa_best());
    for (int lanes = 1; lanes <= 16; lanes *= 2) {
        if (lanes == 2) continue;
        CHECK(run(&p, PE_FLOAT32, 1, out, NULL, NULL, NULL, lanes) == PE_OK, "lanes %d", lanes);
    }
}

/* The fp32 weight gradients, summed by the kernel in torch's order for 1 to 5 threads
 * (which makes some columns take the 4-lane order: D = 40 and 20 are not whole blocks of
 * 4 vectors), against fp64's products summed in long double. */
static void weight_gradients_match_fp64(void) {
    static problem p;
    static double g[2][B * T * HQ * 64], dx[2][B * T * HQ * 64];
    static double want[2][64];
    const int64_t dims[][2] = {{64, 32}, {40, 24}, {20, 8}};
    for (size_t d = 0; d < sizeof dims / sizeof dims[0]; ++d)
        for (int form = 0; form <= PE_NORM_POW; ++form) {
            fill(&p, dims[d][0], dims[d][1], (pe_norm_form)form, PE_PAIR_HALF);
            for (int k = 0; k < 2; ++k)
                for (int64_t i = 0; i < B * T * HQ * p.D; ++i) g[k][i] = sin(0.37 * (double)i + k);
            const double *grad[2] = {g[0], g[1]};
            double *out[2] = {out_q, out_k}, *dxs[2] = {dx[0], dx[1]};
            sum_threads = 1;
            CHECK(run(&p, PE_FLOAT64, 1, out, NULL, grad, dxs, 8) == PE_OK, "fp64 backward");
            memcpy(want, wgrad_out, sizeof want);
            for (int threads = 1; threads <= 5; ++threads) {
                sum_threads = threads;
                CHECK(run(&p, PE_FLOAT32, 2, out, NULL, grad, dxs, 8) == PE_OK, "fp32 backward");
                for (int k = 0; k < 2; ++k)
                    for (int64_t e = 0; e < p.D; ++e) {
                        const double err = fabs(wgrad_out[k][e] - want[k][e]);
                        CHECK(err <= 1e-4 * (1 + fabs(want[k][e])),
                              "D %lld form %d sum_threads %d tensor %d column %lld: %g vs %g",
                              (long long)p.D, form, threads, k, (long long)e,
                              wgrad_out[k][e], want[k][e]);
                    }
            }
            sum_threads = 0;
        }
}

static void bad_arguments(void) {
    static problem p;
    fill(&p, 16, 16, PE_NORM_WEIGHT, PE_PAIR_HALF);
    double *out[2] = {out_q, out_k};
    CHECK(run(&p, PE_FLOAT32, 1, out, NULL, NULL, NULL, 3) == PE_ERR_ARG, "sum_lanes 3");
    p.form = (pe_norm_form)7;
    CHECK(run(&p, PE_FLOAT32, 1, out, NULL, NULL, NULL, 8) == PE_ERR_ARG, "form 7");
    p.form = PE_NORM_WEIGHT, p.R = 7;
    CHECK(run(&p, PE_FLOAT32, 1, out, NULL, NULL, NULL, 8) == PE_ERR_ARG, "odd rotary width");
    CHECK(pe_qk_norm_rope(NULL) == PE_ERR_ARG, "NULL args");
    p.R = 16, weight_f32_flag = 1;
    CHECK(run(&p, PE_FLOAT64, 1, out, NULL, NULL, NULL, 8) == PE_ERR_ARG, "fp64, fp32 weights");
    CHECK(run(&p, PE_FLOAT32, 1, out, NULL, NULL, NULL, 8) == PE_OK, "fp32, fp32 weights");
    weight_f32_flag = 0, no_ms_pow = 1, p.form = PE_NORM_POW;
    static double g[2][B * T * HQ * 64], dx[2][B * T * HQ * 64];
    const double *grad[2] = {g[0], g[1]};
    double *dxs[2] = {dx[0], dx[1]};
    CHECK(run(&p, PE_FLOAT32, 1, out, NULL, grad, dxs, 8) == PE_ERR_ARG, "pow without ms_pow");
    no_ms_pow = 0;
    CHECK(run(&p, PE_FLOAT32, 1, out, NULL, grad, dxs, 8) == PE_OK, "pow with ms_pow");
    sum_threads = -1;
    CHECK(run(&p, PE_FLOAT32, 1, out, NULL, grad, dxs, 8) == PE_ERR_ARG, "sum_threads -1");
    sum_threads = 0;
}

int main(void) {
    forward_matches_formula(PE_FLOAT64, 1e-12);
    forward_matches_formula(PE_FLOAT32, 2e-5);
    backward_matches_differences();
    variants_agree();
    weight_gradients_match_fp64();
    bad_arguments();
    return check_report("test_qk_norm");
}

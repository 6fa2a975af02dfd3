/*
 * Torch-free tests of pe_qk_norm_rope and its backward: fp32 and fp64 against the formula
 * of posenc.h computed in long double, the sum order against a plain emulation of torch's
 * cascade (every lane count, a tail, the cascade levels of long rows), the backward of
 * fp64 against central differences, the fp32 weight gradients (summed in the kernel, in
 * both of torch's orders) against fp64's products, every SIMD variant, threads, outputs
 * large enough for streaming stores, the backward's walk token by token and bad
 * arguments.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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

/* v as element i of p, in dt (bf16 or fp32) */
static void store_as(void *p, int64_t i, pe_dtype dt, double v) {
    if (dt == PE_BFLOAT16) ((uint16_t *)p)[i] = pe_f32_to_bf16((float)v);
    else ((float *)p)[i] = (float)v;
}

/* n bytes of fresh anonymous pages (none in memory yet), or with every page written. */
static void *pages(size_t n, int touch) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (touch) memset(p, 0xa5, n);
    return p;
}

/* The forward and the backward of a Qwen2-VL-sized problem (28 + 4 heads of 128, outputs
 * and input gradients past PE_STREAM_BYTES, page-aligned): where they go to pages already
 * in memory the vector rows store them with streaming stores (qk_norm.c, make_plan), where
 * they are fresh pages with plain stores.  Every variant at 1 and 2 threads, bf16
 * (channel-pair rows) and fp32, full and partial rotary (the channels past it), against the
 * baseline variant's bits (the backward's weight gradients too, summed in one order:
 * sum_threads 1).  Denormal results, which the hardware bf16 rounding does again in
 * software: with three weights that small, in every row's products and in the forward's
 * results; with ordinary weights, in the dx of the rows given a large x and a tiny
 * gradient (every 97th), whose other values are all normal numbers. */
static void streamed_outputs_agree(void) {
    enum { HQ_ = 28, HK_ = 4, D_ = 128 };
    const pe_dtype dts[2] = {PE_BFLOAT16, PE_FLOAT32};
    for (int d = 0; d < 2; ++d)
        for (int tiny_w = 1; tiny_w >= 0; --tiny_w)
        for (int64_t R = D_; R >= D_ / 2; R -= D_ / 2) {
            const pe_dtype dt = dts[d];
            const size_t es = pe_dtype_size(dt);
            const int64_t T_ = dt == PE_BFLOAT16 ? 2100 : 1100, heads[2] = {HQ_, HK_};
            pe_qk_norm_args a = {0};
            a.batch = 1, a.seq = T_, a.head_dim = D_, a.rot_dim = R, a.pairing = PE_PAIR_HALF;
            a.form = PE_NORM_WEIGHT, a.dtype = dt, a.eps = 1e-6, a.sum_lanes = 8;
            a.table_batch = 1, a.table_stride[0] = 0, a.table_stride[1] = R;
            a.sum_threads = 1;
            void *cs = malloc((size_t)(T_ * R) * es), *sn = malloc((size_t)(T_ * R) * es);
            void *xs[2], *gs[2], *ws[2], *rs[2], *ref[2][2], *out[2], *wg[2], *wref[2];
            unsigned seed = 777u;
            for (int64_t i = 0; i < T_ * R; ++i) {
                const double ang = (double)(i / R) * pow(10000.0, -(double)(i % (R / 2)) / R);
                store_as(cs, i, dt, cos(ang));
                store_as(sn, i, dt, sin(ang));
            }
            a.cos = cs, a.sin = sn;
            pe_qk_norm_tensor *ts[2] = {&a.q, &a.k};
            size_t bytes[2];
            for (int k = 0; k < 2; ++k) {
                const int64_t n = T_ * heads[k] * D_;
                bytes[k] = (size_t)n * es;
                xs[k] = malloc(bytes[k]), gs[k] = malloc(bytes[k]);
                ws[k] = malloc((size_t)D_ * es), rs[k] = malloc((size_t)(n / D_) * 4);
                wg[k] = malloc((size_t)D_ * es), wref[k] = malloc((size_t)D_ * es);
                ref[0][k] = malloc(bytes[k]), ref[1][k] = malloc(bytes[k]);
                for (int64_t i = 0; i < 2 * n; ++i) {
                    seed = seed * 1103515245u + 12345u;
                    const int odd_row = i % n / D_ % 97 == 5;
                    const double scale = !odd_row ? 1.0 : i < n ? 1e4 : 1e-34;
                    store_as(i < n ? xs[k] : gs[k], i % n, dt,
                             scale * (double)(int)((seed >> 8) % 2001 - 1000) / 300.0);
                }
                for (int64_t e = 0; e < D_; ++e) { /* channels 5, 5 + R/2, 100: denormals */
                    const int tiny = tiny_w && (e == 5 || e == 5 + R / 2 || e == 100);
                    store_as(ws[k], e, dt, tiny ? 3e-39 : 0.75 + 0.01 * (e % 29));
                }
                pe_qk_norm_tensor *x = ts[k];
                x->heads = heads[k], x->x = xs[k], x->weight = ws[k], x->rstd = rs[k];
                x->grad = gs[k], x->wgrad = wg[k];
                const int64_t st[3] = {T_ * heads[k] * D_, heads[k] * D_, D_};
                const int64_t rst[3] = {T_ * heads[k], heads[k], 1};
                memcpy(x->x_stride, st, sizeof st), memcpy(x->out_stride, st, sizeof st);
                memcpy(x->grad_stride, st, sizeof st), memcpy(x->rstd_stride, rst, sizeof rst);
            }
            /* the baseline's results: forward (its rstd rows the backward's), backward */
            a.nthreads = 1;
            pe_isa_set(PE_ISA_BASELINE);
            for (int k = 0; k < 2; ++k) ts[k]->out = ref[0][k];
            CHECK(pe_qk_norm_rope(&a) == PE_OK, "baseline, dtype %d R %lld", dt, (long long)R);
            for (int k = 0; k < 2; ++k) ts[k]->out = ref[1][k], ts[k]->wgrad = wref[k];
            CHECK(pe_qk_norm_rope_backward(&a) == PE_OK, "baseline backward, dtype %d", dt);
            for (int k = 0; k < 2; ++k) ts[k]->wgrad = wg[k];
            for (int isa = PE_ISA_BASELINE + 1; isa <= (int)pe_isa_best(); ++isa)
                for (int threads = 1; threads <= 2; ++threads)
                    for (int bwd = 0; bwd < 2; ++bwd)
                        for (int touch = 0; touch < 2; ++touch) {
                            pe_isa_set((pe_isa)isa);
                            a.nthreads = threads;
                            for (int k = 0; k < 2; ++k)
                                ts[k]->out = out[k] = pages(bytes[k], touch);
                            CHECK(out[0] && out[1], "mmap");
                            if (!out[0] || !out[1]) return;
                            for (int k = 0; k < 2; ++k) memset(wg[k], 0xa5, (size_t)D_ * es);
                            const int rc = bwd ? pe_qk_norm_rope_backward(&a) : pe_qk_norm_rope(&a);
                            CHECK(rc == PE_OK, "run");
                            for (int k = 0; k < 2; ++k) {
                                CHECK(!memcmp(out[k], ref[bwd][k], bytes[k]) &&
                                          (!bwd || !memcmp(wg[k], wref[k], (size_t)D_ * es)),
                                      "%s dtype %d R %lld tiny weights %d isa %d threads %d %s "
                                      "pages: tensor %d differs from the baseline",
                                      bwd ? "backward" : "forward", dt, (long long)R, tiny_w, isa,
                                      threads, touch ? "resident" : "fresh", k);
                                munmap(out[k], bytes[k]);
                            }
                        }
            pe_isa_set(pe_isa_best());
            for (int k = 0; k < 2; ++k) {
                free(xs[k]), free(gs[k]), free(ws[k]), free(rs[k]), free(wg[k]), free(wref[k]);
                free(ref[0][k]), free(ref[1][k]);
            }
            free(cs), free(sn);
        }
}

/* a's q: H heads of D (B = 1, T tokens, contiguous (T, H, D)) at x, weight w, rstd rs; no k.
 */
static pe_qk_norm_tensor *q_only(pe_qk_norm_args *a, int64_t T_, int64_t H_, int64_t D_,
                                 void *x, const void *w, float *rs) {
    pe_qk_norm_tensor *q = &a->q;
    q->heads = H_, q->x = x, q->weight = w, q->rstd = rs;
    const int64_t st[3] = {T_ * H_ * D_, H_ * D_, D_}, rst[3] = {T_ * H_, H_, 1};
    memcpy(q->x_stride, st, sizeof st), memcpy(q->out_stride, st, sizeof st);
    memcpy(q->rstd_stride, rst, sizeof rst);
    a->k = a->q, a->k.heads = 0;
    return q;
}

/* The bf16 forward of a (q only) by every variant past the baseline at 1 and 2 threads into
 * out, each held to the baseline's n values in ref; label names the case. */
static void variants_match(pe_qk_norm_args *a, uint16_t *out, const uint16_t *ref, size_t n,
                           const char *label) {
    for (int isa = PE_ISA_BASELINE + 1; isa <= (int)pe_isa_best(); ++isa)
        for (int threads = 1; threads <= 2; ++threads) {
            pe_isa_set((pe_isa)isa);
            a->nthreads = threads;
            memset(out, 0xa5, n * 2);
            a->q.out = out;
            CHECK(pe_qk_norm_rope(a) == PE_OK, "run");
            size_t wrong = 0;
            for (size_t i = 0; i < n; ++i) wrong += out[i] != ref[i];
            CHECK(wrong == 0, "%s isa %d threads %d: %zu of %zu differ from the baseline", label,
                  isa, threads, wrong, n);
        }
    pe_isa_set(pe_isa_best());
}

/* The avx512bf16 variant's forward rounds the bf16 pair rows by the hardware without its
 * test for denormals where the rows' magnitudes keep every rounded value from being one
 * (qk_norm_f32.h, qk_no_denormal: X r W C >= 2^-90).  Rows on both sides of that bound:
 * in each, pairs of channels (e, e + R/2), and every fourth channel past the rotary,
 * scaled by 2^-k, k from 50 to 149 across the rows, with tables (down to 2^-15) under
 * which their rotation cancels to 2^-14 of its products; every form, full and partial
 * rotary, each variant at 1 and 2 threads against the baseline's bits.  The baseline's
 * results must hold denormals, or the rows would not reach the other side of the bound. */
static void denormal_bound_agrees(void) {
    enum { T_ = 64, H_ = 8, D_ = 128 };
    const pe_norm_form forms[4] = {PE_NORM_WEIGHT, PE_NORM_ONE_PLUS_WEIGHT, PE_NORM_WEIGHT_F32,
                                   PE_NORM_POW};
    const size_t n = (size_t)T_ * H_ * D_;
    for (int f = 0; f < 4; ++f)
        for (int64_t R = D_; R >= D_ / 2; R -= D_ / 2) {
            const int64_t h = R / 2;
            pe_qk_norm_args a = {0};
            a.batch = 1, a.seq = T_, a.head_dim = D_, a.rot_dim = R, a.pairing = PE_PAIR_HALF;
            a.form = forms[f], a.dtype = PE_BFLOAT16, a.eps = 1e-6, a.sum_lanes = 8;
            a.weight_f32 = forms[f] == PE_NORM_WEIGHT_F32;
            a.table_batch = 1, a.table_stride[0] = 0, a.table_stride[1] = R;
            uint16_t *cs = malloc((size_t)(T_ * R) * 2), *sn = malloc((size_t)(T_ * R) * 2);
            for (int64_t t = 0; t < T_; ++t)
                for (int64_t e = 0; e < R; ++e) {
                    const int64_t j = e % h;
                    const double c =
                        (1.0 + (double)((t + j) % 4) / 128.0) * ldexp(1.0, -(int)(t % 16));
                    store_as(cs, t * R + e, PE_BFLOAT16, c);
                    store_as(sn, t * R + e, PE_BFLOAT16, c * (1.0 - 1.0 / 128.0));
                }
            a.cos = cs, a.sin = sn;
            uint16_t *x = malloc(n * 2), *ref = malloc(n * 2), *out = malloc(n * 2);
            float *rs = malloc(n / D_ * 4);
            void *w = malloc((size_t)D_ * 4);
            for (size_t i = 0; i < n; ++i) {
                const int64_t row = (int64_t)(i / D_), e = (int64_t)(i % D_);
                const int64_t j = e < R ? e % h : e;
                const int k = 50 + (int)(row * 7 % 100);
                double v;
                if (j % 4 == 1) { /* a small pair, its second channel 2^-7 above the first */
                    v = (1.0 + (double)((row + j) % 4) / 128.0) * ldexp(1.0, -k);
                    if (e >= h && e < R) v *= 1.0 + 1.0 / 128.0;
                } else {
                    v = (j % 2 ? -1.0 : 1.0) * (0.5 + (double)((j * 13 + row) % 64) / 64.0);
                }
                store_as(x, (int64_t)i, PE_BFLOAT16, v);
            }
            for (int64_t e = 0; e < D_; ++e)
                store_as(w, e, a.weight_f32 ? PE_FLOAT32 : PE_BFLOAT16,
                         0.5 + (double)(e % 7) / 16.0);
            pe_qk_norm_tensor *q = q_only(&a, T_, H_, D_, x, w, rs);
            a.nthreads = 1;
            pe_isa_set(PE_ISA_BASELINE);
            q->out = ref;
            CHECK(pe_qk_norm_rope(&a) == PE_OK, "baseline, form %d R %lld", f, (long long)R);
            size_t denormals = 0;
            for (size_t i = 0; i < n; ++i)
                denormals += (ref[i] & 0x7f80) == 0 && (ref[i] & 0x7f) != 0;
            CHECK(denormals > 0, "form %d R %lld: no denormal result", f, (long long)R);
            char label[64];
            snprintf(label, sizeof label, "form %d R %lld", f, (long long)R);
            variants_match(&a, out, ref, n, label);
            free(cs), free(sn), free(x), free(ref), free(out), free(rs), free(w);
        }
}

/* The bf16 forward where the avx512bf16 rows rotate by dot products of bf16 pairs (simd.h,
 * bf16_dot_block), held to the baseline's bits by every variant at 1 and 2 threads, full
 * and partial rotary, where the tables that take those rows must not: weights of 2^126, so
 * that the normalized row y reaches the largest bf16, under tables in [-1/2, 1/2] but for
 * one value in 64 of 1.5 to 1.98 (products that overflow fp32 beside others that would
 * bring the sum back: the dot product's sum is finite where the rows' is not; mode 0); and
 * weights of 2^100 under tables holding bf16 denormals and normals under 2^-116 (products
 * of 2^-35 and more, which the instruction takes as zero, beside others of their size;
 * mode 1). */
static void dot_tables_agree(void) {
    enum { T_ = 32, H_ = 4, D_ = 128 };
    const size_t n = (size_t)T_ * H_ * D_;
    unsigned seed = 777u;
    for (int mode = 0; mode < 2; ++mode)
        for (int64_t R = D_; R >= D_ / 2; R -= D_ / 2) {
            pe_qk_norm_args a = {0};
            a.batch = 1, a.seq = T_, a.head_dim = D_, a.rot_dim = R, a.pairing = PE_PAIR_HALF;
            a.form = PE_NORM_WEIGHT, a.dtype = PE_BFLOAT16, a.eps = 1e-6, a.sum_lanes = 8;
            a.table_batch = 1, a.table_stride[0] = 0, a.table_stride[1] = R;
            uint16_t *tab[2] = {malloc((size_t)(T_ * R) * 2), malloc((size_t)(T_ * R) * 2)};
            for (int k = 0; k < 2; ++k)
                for (int64_t i = 0; i < T_ * R; ++i) {
                    seed = seed * 1103515245u + 12345u;
                    const double u = (double)(int)((seed >> 8) % 20001 - 10000) / 10000.0;
                    double v = u / 2;
                    if (mode == 0 && fabs(u) < 1.0 / 64) /* 1.5 .. 1.98 */
                        v = u > 0 ? 1.5 + 30 * u : -1.5 + 30 * u;
                    tab[k][i] = pe_f32_to_bf16((float)v);
                    if (mode == 1 && fabs(u) < 0.2) /* a denormal, or a normal under 2^-116 */
                        tab[k][i] = (uint16_t)((u > 0 ? 0u : 0x8000u) + 1u +
                                               (uint32_t)(fabs(u) * 7000));
                }
            a.cos = tab[0], a.sin = tab[1];
            uint16_t *x = malloc(n * 2), *ref = malloc(n * 2), *out = malloc(n * 2);
            float *rs = malloc(n / D_ * 4);
            uint16_t w[D_];
            for (size_t i = 0; i < n; ++i) {
                seed = seed * 1103515245u + 12345u;
                const int v = (int)((seed >> 8) % 2001) - 1000;
                store_as(x, (int64_t)i, PE_BFLOAT16, v / 500.0);
            }
            for (int64_t e = 0; e < D_; ++e)
                store_as(w, e, PE_BFLOAT16, ldexp(1.0 + (double)(e % 5) / 8.0, mode ? 100 : 126));
            pe_qk_norm_tensor *q = q_only(&a, T_, H_, D_, x, w, rs);
            a.nthreads = 1;
            pe_isa_set(PE_ISA_BASELINE);
            q->out = ref;
            CHECK(pe_qk_norm_rope(&a) == PE_OK, "baseline, mode %d R %lld", mode, (long long)R);
            size_t inf = 0;
            for (size_t i = 0; i < n; ++i) inf += (ref[i] & 0x7f80) == 0x7f80;
            CHECK(mode || inf > 0, "mode 0 R %lld: no infinite result", (long long)R);
            char label[64];
            snprintf(label, sizeof label, "dot tables mode %d R %lld", mode, (long long)R);
            variants_match(&a, out, ref, n, label);
            free(tab[0]), free(tab[1]), free(x), free(ref), free(out), free(rs);
        }
}

/* The backward of transformers' transposed q and k ((B, H, T, D) views of token-major
 * memory, heads_first) with gradients that lie token by token too, as SDPA gives them,
 * walks the rows token by token where T is a multiple of the weight gradients' blocks
 * (qk_norm.c, by_token_chunk): its dx and weight gradients equal, bit for bit, those of
 * the same gradients laid out (B, H, T, D), walked in the products' order.  Two batch rows
 * of 320 tokens (blocks of 16 and 64 rows), heads of 80 (plain and 4-lane columns at one
 * summing thread, plain only at two), 5 q heads and 3 k heads; fp32 and bf16, every
 * variant, 1 to 3 threads. */
static void token_walk_agrees(void) {
    enum { B_ = 2, T_ = 320, D_ = 80 };
    const int64_t heads[2] = {5, 3};
    const pe_dtype dts[2] = {PE_FLOAT32, PE_BFLOAT16};
    for (int d = 0; d < 2; ++d)
        for (int st = 1; st <= 2; ++st) {
            const pe_dtype dt = dts[d];
            const size_t es = pe_dtype_size(dt);
            pe_qk_norm_args a = {0};
            a.batch = B_, a.seq = T_, a.head_dim = D_, a.rot_dim = D_, a.pairing = PE_PAIR_HALF;
            a.form = PE_NORM_WEIGHT, a.dtype = dt, a.eps = 1e-6, a.sum_lanes = 8;
            a.table_batch = 1, a.table_stride[0] = 0, a.table_stride[1] = D_;
            a.sum_threads = st, a.heads_first = 1;
            void *cs = malloc((size_t)(T_ * D_) * es), *sn = malloc((size_t)(T_ * D_) * es);
            for (int64_t i = 0; i < T_ * D_; ++i) {
                const double ang = (double)(i / D_) * pow(10000.0, -(double)(i % (D_ / 2)) / D_);
                store_as(cs, i, dt, cos(ang)), store_as(sn, i, dt, sin(ang));
            }
            a.cos = cs, a.sin = sn;
            pe_qk_norm_tensor *ts[2] = {&a.q, &a.k};
            void *xs[2], *g_tok[2], *g_hf[2], *ws[2], *rs[2], *dx[2], *dx_ref[2], *wg[2],
                *wg_ref[2];
            unsigned seed = 4242u;
            for (int k = 0; k < 2; ++k) {
                const int64_t H = heads[k], n = B_ * T_ * H * D_;
                const size_t bytes = (size_t)n * es;
                xs[k] = malloc(bytes), g_tok[k] = malloc(bytes), g_hf[k] = malloc(bytes);
                dx[k] = malloc(bytes), dx_ref[k] = malloc(bytes);
                rs[k] = malloc((size_t)(n / D_) * 4);
                ws[k] = malloc((size_t)D_ * es), wg[k] = malloc((size_t)D_ * es);
                wg_ref[k] = malloc((size_t)D_ * es);
                for (int64_t i = 0; i < 2 * n; ++i) {
                    seed = seed * 1103515245u + 12345u;
                    store_as(i < n ? xs[k] : g_tok[k], i % n, dt,
                             (double)(int)((seed >> 8) % 2001 - 1000) / 300.0);
                }
                for (int64_t e = 0; e < D_; ++e) store_as(ws[k], e, dt, 0.75 + 0.01 * (e % 29));
                /* token-major (b, t, h, e) to (b, h, t, e) */
                for (int64_t i = 0; i < n; ++i) {
                    const int64_t e = i % D_, h = i / D_ % H, t = i / D_ / H % T_,
                                  b = i / D_ / H / T_, j = ((b * H + h) * T_ + t) * D_ + e;
                    memcpy((char *)g_hf[k] + j * (int64_t)es, (char *)g_tok[k] + i * (int64_t)es,
                           es);
                }
                pe_qk_norm_tensor *x = ts[k];
                const int64_t tok[3] = {T_ * H * D_, H * D_, D_};
                const int64_t hf[3] = {H * T_ * D_, D_, T_ * D_}, rst[3] = {T_ * H, H, 1};
                x->heads = H, x->x = xs[k], x->weight = ws[k], x->rstd = rs[k];
                memcpy(x->x_stride, tok, sizeof tok), memcpy(x->rstd_stride, rst, sizeof rst);
                memcpy(x->out_stride, hf, sizeof hf), x->out = dx[k]; /* forward: its own */
            }
            a.nthreads = 1;
            CHECK(pe_qk_norm_rope(&a) == PE_OK, "forward, dtype %d", dt); /* rstd */
            for (int isa = PE_ISA_BASELINE; isa <= (int)pe_isa_best(); ++isa)
                for (int threads = 1; threads <= 3; ++threads) {
                    pe_isa_set((pe_isa)isa);
                    a.nthreads = threads;
                    for (int walk = 0; walk < 2; ++walk) { /* products' order, then by token */
                        for (int k = 0; k < 2; ++k) {
                            const int64_t H = heads[k];
                            const int64_t tok[3] = {T_ * H * D_, H * D_, D_},
                                          hf[3] = {H * T_ * D_, D_, T_ * D_};
                            ts[k]->grad = walk ? g_tok[k] : g_hf[k];
                            memcpy(ts[k]->grad_stride, walk ? tok : hf, sizeof tok);
                            ts[k]->out = walk ? dx[k] : dx_ref[k];
                            ts[k]->wgrad = walk ? wg[k] : wg_ref[k];
                            memset(ts[k]->out, 0xa5, (size_t)(B_ * T_ * H * D_) * es);
                        }
                        CHECK(pe_qk_norm_rope_backward(&a) == PE_OK, "backward");
                    }
                    for (int k = 0; k < 2; ++k)
                        CHECK(!memcmp(dx[k], dx_ref[k], (size_t)(B_ * T_ * heads[k] * D_) * es) &&
                                  !memcmp(wg[k], wg_ref[k], (size_t)D_ * es),
                              "dtype %d sum_threads %d isa %d threads %d: tensor %d walked by "
                              "token differs", dt, st, isa, threads, k);
                }
            pe_isa_set(pe_isa_best());
            for (int k = 0; k < 2; ++k) {
                free(xs[k]), free(g_tok[k]), free(g_hf[k]), free(dx[k]), free(dx_ref[k]);
                free(rs[k]), free(ws[k]), free(wg[k]), free(wg_ref[k]);
            }
            free(cs), free(sn);
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
    streamed_outputs_agree();
    denormal_bound_agrees();
    dot_tables_agree();
    token_walk_agrees();
    bad_arguments();
    return check_report("test_qk_norm");
}

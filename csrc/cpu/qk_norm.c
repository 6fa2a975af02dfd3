/*
 * Fused per-head RMSNorm + RoPE (posenc.h, pe_qk_norm_rope): argument checks, the loops
 * that run blocks of tokens (forward) or of rows (backward) over threads, the weight
 * gradients' sums in torch's order, and the fp64 core.  The fp32 core is qk_norm_f32.h,
 * compiled per instruction set into qk_norm_<isa>.c.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

typedef void (*qk_rows_fn)(const pe_qk_norm_args *a, const pe_qk_plan *p, int64_t i0, int64_t n,
                           void *scratch);
typedef void (*qk_bwd_fn)(const pe_qk_norm_args *a, const pe_qk_plan *p, int tensor, int64_t r0,
                          int64_t r1, const pe_qk_wsum *ws, void *scratch);

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

static void qk_rows_f64(const pe_qk_norm_args *a, int64_t i0, int64_t n, int backward,
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

static void qk_forward_f64(const pe_qk_norm_args *a, const pe_qk_plan *p, int64_t i0, int64_t n,
                           void *scratch) {
    (void)p;
    qk_rows_f64(a, i0, n, 0, scratch);
}

static void qk_backward_f64(const pe_qk_norm_args *a, const pe_qk_plan *p, int64_t i0,
                            int64_t n, void *scratch) {
    (void)p;
    qk_rows_f64(a, i0, n, 1, scratch);
}

/* ---- checks and threads ------------------------------------------------------------- */

static int tensor_ok(const pe_qk_norm_args *a, const pe_qk_norm_tensor *x, int backward,
                     int empty) {
    if (x->heads < 0) return 0;
    if (!x->heads || empty) return 1;
    const int f64 = a->dtype == PE_FLOAT64;
    return x->x && x->weight && x->out && x->rstd &&
           (!backward || (x->grad && (f64 ? x->wprod != NULL : x->wgrad != NULL) &&
                          (a->form != PE_NORM_POW || x->ms_pow)));
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
    if (backward && a->dtype != PE_FLOAT64 && a->sum_threads < 1) return 0;
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

typedef struct qk_kernels {
    qk_rows_fn forward;
    qk_bwd_fn backward;
} qk_kernels;

static qk_kernels kernels(void) {
#ifdef PE_HAVE_X86_VARIANTS
    switch (pe_isa_current()) {
#ifdef PE_HAVE_AVX512BF16
    case PE_ISA_AVX512_BF16:
        return (qk_kernels){pe_qk_norm_rows_f32_avx512bf16, pe_qk_norm_bwd_f32_avx512bf16};
#else
    case PE_ISA_AVX512_BF16: /* (not built: the compiler lacks -mavx512bf16) */
#endif
    case PE_ISA_AVX512:
        return (qk_kernels){pe_qk_norm_rows_f32_avx512, pe_qk_norm_bwd_f32_avx512};
    case PE_ISA_AVX2: return (qk_kernels){pe_qk_norm_rows_f32_avx2, pe_qk_norm_bwd_f32_avx2};
    default: break;
    }
#endif
    return (qk_kernels){pe_qk_norm_rows_f32_baseline, pe_qk_norm_bwd_f32_baseline};
}

/* The bytes from x's first output element to one past its last (0 for a tensor without
 * rows or with a negative stride). */
static size_t output_bytes(const pe_qk_norm_args *a, const pe_qk_norm_tensor *x) {
    const int64_t n[3] = {a->batch, a->seq, x->heads};
    int64_t last = a->head_dim; /* one past the last element, in elements */
    for (int i = 0; i < 3; ++i) {
        if (n[i] == 0 || x->out_stride[i] < 0) return 0;
        last += (n[i] - 1) * x->out_stride[i];
    }
    return (size_t)last * pe_dtype_size(a->dtype);
}

/* Asks for huge pages behind x's output when it is large (rope.c: page faults of a fresh
 * output cost more than the pass). */
static void hint_output(const pe_qk_norm_args *a, const pe_qk_norm_tensor *x) {
    const size_t bytes = output_bytes(a, x);
    if (bytes) pe_huge_page_hint(x->out, bytes);
}

/* The size from which the forward asks for its dense input rows ahead: twice the L2 cache
 * of a core on the x86-64 CPUs of the last years (1-2 MiB).  Below it the requests only
 * cost (fp32 rows in L2 took 10-20% longer with them). */
#define QK_PREFETCH_MIN_BYTES ((int64_t)4 << 20)

/* The plan (pe_qk_plan) of the forward or the backward.  In the forward, a tensor whose
 * input and output rows each lie in one dense stream (a token's heads adjacent, then the
 * next token's) and that is too large to stay in cache has its input rows asked for
 * PE_PREFETCH_AHEAD bytes ahead, as the rotary's are: the hardware prefetchers alone leave
 * each row's first loads waiting (the backward asks for its rows itself, QK_AHEAD).  In
 * both, its results go out with streaming stores, as the rotary's do, when the outputs
 * together are at least PE_STREAM_BYTES, its own already in memory, and every vector store
 * falls on whole 64-byte units (the output and its strides; in the forward, which stores
 * each half of the rotary on its own, the half rotary width in bytes too): a plain store
 * first reads each line it overwrites.  Measured on an AMD EPYC (Zen 4), bf16 Qwen3-VL-8B
 * forward at T = 4096, with the output lines asked for ahead too and stored plainly, as
 * before: 3.1-3.4x a copy of the bytes at one thread; without those requests 2.3-2.7x;
 * streamed 2.1-2.4x (docs/qk_norm.md). */
static pe_qk_plan make_plan(const pe_qk_norm_args *a, int backward) {
    pe_qk_plan p = {{0, 0}, {0, 0}, {0, 0}};
    const pe_qk_norm_tensor *xs[2] = {&a->q, &a->k};
    const int64_t D = a->head_dim, es = (int64_t)pe_dtype_size(a->dtype);
    const size_t total = output_bytes(a, &a->q) + output_bytes(a, &a->k);
    for (int w = 0; w < 2; ++w) {
        const pe_qk_norm_tensor *x = xs[w];
        if (!x->heads) continue;
        const int64_t HD = x->heads * D, bytes = a->batch * a->seq * HD * es;
        if (!backward && x->x_stride[2] == D && x->x_stride[1] == HD && x->out_stride[2] == D &&
            x->out_stride[1] == HD && bytes >= QK_PREFETCH_MIN_BYTES)
            p.ahead[w] = PE_PREFETCH_AHEAD;
        const int64_t n[3] = {a->batch, a->seq, x->heads};
        int aligned = (uintptr_t)x->out % 64 == 0 && (backward || a->rot_dim / 2 * es % 64 == 0);
        for (int i = 0; i < 3; ++i)
            if (n[i] > 1 && x->out_stride[i] * es % 64) aligned = 0;
        p.stream[w] = aligned && total >= PE_STREAM_BYTES &&
                      pe_pages_resident(x->out, output_bytes(a, x));
    }
    return p;
}

static int threads_for(const pe_qk_norm_args *a, int64_t units) {
    const int64_t elements = a->batch * a->seq * (a->q.heads + a->k.heads) * a->head_dim;
    int nth = elements < PE_SERIAL_ELEMENTS || a->nthreads < 1 ? 1 : a->nthreads;
    return nth > units ? (int)units : nth;
}

/* unit(a, u, scratch, ctx) for u in 0 .. units-1 on nth threads, each with a scratch buffer
 * of pe_qk_scratch_bytes for acc_heads heads. */
typedef void (*qk_unit_fn)(const pe_qk_norm_args *a, int64_t u, void *scratch,
                           const void *ctx);

static int run_units(const pe_qk_norm_args *a, int64_t units, int nth, qk_unit_fn unit,
                     const void *ctx, int64_t acc_heads) {
    const size_t bytes = pe_qk_scratch_bytes(a->rot_dim, a->head_dim, acc_heads);
    if (nth <= 1) { /* the calling thread: a small scratch from the stack (internal.h) */
        _Alignas(64) unsigned char local[PE_STACK_SCRATCH];
        void *scratch = bytes <= sizeof local ? local : malloc(bytes);
        if (!scratch) return PE_ERR_NOMEM;
        for (int64_t u = 0; u < units; ++u) unit(a, u, scratch, ctx);
        if (scratch != local) free(scratch);
        return PE_OK;
    }
    int failed = 0;
#pragma omp parallel num_threads(nth)
    {
        void *scratch = malloc(bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u)
            if (scratch) unit(a, u, scratch, ctx);
        free(scratch);
    }
    return failed ? PE_ERR_NOMEM : PE_OK;
}

/* The qk_rows_fn of a pass over tiles (the forward, and the fp64 backward) with its plan. */
typedef struct tile_pass {
    qk_rows_fn fn;
    pe_qk_plan plan;
} tile_pass;

/* A tile of PE_TOKEN_TILE tokens for the tile_pass at ctx. */
static void tile_unit(const pe_qk_norm_args *a, int64_t u, void *scratch, const void *ctx) {
    const tile_pass *t = (const tile_pass *)ctx;
    const int64_t tokens = a->batch * a->seq, i0 = u * PE_TOKEN_TILE;
    t->fn(a, &t->plan, i0, tokens - i0 < PE_TOKEN_TILE ? tokens - i0 : PE_TOKEN_TILE, scratch);
}

static int run_tiles(const pe_qk_norm_args *a, qk_rows_fn fn, pe_qk_plan plan) {
    const int64_t tokens = a->batch * a->seq;
    const tile_pass t = {fn, plan};
    return run_units(a, (tokens + PE_TOKEN_TILE - 1) / PE_TOKEN_TILE, threads_for(a, tokens),
                     tile_unit, &t, 1);
}

/* ---- the weight gradients: torch's sum of the products over rows --------------------- */

/* utils::CeilLog2, and the level power of multi_row_sum over n items */
static int64_t ceil_log2(int64_t x) {
    return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1));
}

static int level_power(int64_t items) {
    const int64_t p = ceil_log2(items) / 4;
    return p > 4 ? (int)p : 4;
}

/* plain[c] = 1 where torch sums column c in the plain order, 0 in the 4-lane order
 * (posenc.h), for N rows of D columns of es-byte products. */
static void plain_columns(int64_t D, int64_t N, int threads, int lanes, size_t es,
                          uint8_t *plain) {
    const int64_t vec = lanes * (int64_t)(4 / es); /* columns per Vectorized<scalar_t> */
    memset(plain, 0, (size_t)D);
    const int serial = N * D < 32768 || threads == 1; /* at::internal::GRAIN_SIZE */
    const int64_t nth = serial ? 1 : (threads < D ? threads : D), size = (D + nth - 1) / nth;
    const int64_t multiple = 128 / (int64_t)es;
    for (int64_t t = 0; t < nth && t * size < D; ++t) { /* thread t's columns [b, e) */
        int64_t b = t * size, e = b + size < D ? b + size : D;
        if (!serial) {
            b -= b % multiple;
            if (e != D) e -= e % multiple;
        }
        const int64_t block = e - b >= vec ? 4 * lanes : 4;
        for (int64_t c = b; c + block <= e; c += block) memset(plain + c, 1, (size_t)block);
    }
}

/* One order's blocks of row sums (n_full whole ones, then a partial one when `partial`;
 * stride floats apart) added up as multi_row_sum's levels do, over D columns; acc holds
 * 3 D floats. */
static void add_levels(const float *blocks, int64_t n_full, int partial, int p, int64_t stride,
                       int64_t D, float *acc, float *out) {
    float *a1 = acc, *a2 = acc + D, *a3 = acc + 2 * D;
    memset(acc, 0, (size_t)(3 * D) * sizeof(float));
    const int64_t mask = ((int64_t)1 << p) - 1;
    for (int64_t i = 0; i < n_full; ++i) {
        const float *blk = blocks + i * stride;
        for (int64_t c = 0; c < D; ++c) a1[c] = a1[c] + blk[c];
        const int64_t items = (i + 1) << p;
        if (items & (mask << p)) continue;
        for (int64_t c = 0; c < D; ++c) a2[c] = a2[c] + a1[c], a1[c] = 0.0f;
        if (items & (mask << 2 * p)) continue;
        for (int64_t c = 0; c < D; ++c) a3[c] = a3[c] + a2[c], a2[c] = 0.0f;
    }
    for (int64_t c = 0; c < D; ++c) {
        const float a0 = partial ? blocks[n_full * stride + c] : 0.0f;
        out[c] = ((a0 + a1[c]) + a2[c]) + a3[c];
    }
}

/* c10's float -> bf16 / fp16 (to nearest even; NaN to the canonical NaN) */
static uint16_t c10_bf16(float f) {
    return f != f ? 0x7fc0u : pe_f32_to_bf16(f);
}

static uint16_t c10_f16(float f) {
    return f != f ? (uint16_t)(((pe_f32_bits(f) >> 16) & 0x8000u) | 0x7e00u) : pe_f32_to_f16(f);
}

typedef struct wsum_plan {
    pe_qk_wsum ws;
    uint8_t *plain_cols; /* D */
    int64_t chunk;       /* rows per unit of work: a multiple of both block sizes */
    int64_t units;
} wsum_plan;

static int wsum_make(const pe_qk_norm_args *a, const pe_qk_norm_tensor *x, wsum_plan *w) {
    const int64_t D = a->head_dim, N = a->batch * a->seq * x->heads;
    const size_t es = a->form == PE_NORM_WEIGHT ? pe_dtype_size(a->dtype) : 4;
    memset(w, 0, sizeof *w);
    w->ws.rows = N;
    if (!N) return PE_OK;
    w->plain_cols = malloc((size_t)D);
    if (!w->plain_cols) return PE_ERR_NOMEM;
    plain_columns(D, N, a->sum_threads, a->sum_lanes, es, w->plain_cols);
    int any_plain = 0, any_lanes = 0;
    for (int64_t c = 0; c < D; ++c) {
        if (w->plain_cols[c]) any_plain = 1;
        else any_lanes = 1;
    }
    const int64_t G = N / 4;
    w->ws.lane_rows = 4 * G;
    w->chunk = 256;
    size_t floats = 0;
    if (any_plain) {
        w->ws.plain_block = (int64_t)1 << level_power(N);
        floats += (size_t)((N + w->ws.plain_block - 1) / w->ws.plain_block * D);
        if (w->ws.plain_block > w->chunk) w->chunk = w->ws.plain_block;
    }
    if (any_lanes) {
        w->ws.lane_block = (int64_t)4 << level_power(G);
        const int64_t blocks = (4 * G + w->ws.lane_block - 1) / w->ws.lane_block;
        floats += (size_t)((blocks * 4 + (N - 4 * G)) * D);
        if (w->ws.lane_block > w->chunk) w->chunk = w->ws.lane_block;
    }
    float *buf = malloc(floats * sizeof(float) + 1);
    if (!buf) return PE_ERR_NOMEM;
    if (any_plain) {
        w->ws.plain = buf;
        buf += (N + w->ws.plain_block - 1) / w->ws.plain_block * D;
    }
    if (any_lanes) {
        w->ws.lanes = buf;
        w->ws.tail = buf + (4 * G + w->ws.lane_block - 1) / w->ws.lane_block * 4 * D;
    }
    w->units = (N + w->chunk - 1) / w->chunk;
    return PE_OK;
}

static void wsum_free(wsum_plan *w) {
    free(w->plain_cols);
    free(w->ws.plain ? w->ws.plain : w->ws.lanes);
}

/* The blocks added up in torch's order, 0 + that, rounded to the products' dtype, into
 * x->wgrad. */
static int wsum_finish(const pe_qk_norm_args *a, const pe_qk_norm_tensor *x,
                       const wsum_plan *w) {
    const int64_t D = a->head_dim, N = w->ws.rows, G = N / 4;
    float *f = malloc((size_t)(6 * D) * sizeof(float));
    if (!f) return PE_ERR_NOMEM;
    float *acc = f, *plain = f + 3 * D, *lane = f + 4 * D, *more = f + 5 * D;
    if (w->ws.plain_block) {
        const int p = level_power(N);
        add_levels(w->ws.plain, N >> p, (N & (((int64_t)1 << p) - 1)) != 0, p, D, D, acc,
                   plain);
    }
    if (w->ws.lane_block) { /* lane 0, the tail rows, then lanes 1, 2, 3 */
        const int p = level_power(G);
        const int partial = (G & (((int64_t)1 << p) - 1)) != 0;
        add_levels(w->ws.lanes, G >> p, partial, p, 4 * D, D, acc, lane);
        for (int64_t i = 0; i < N - 4 * G; ++i)
            for (int64_t c = 0; c < D; ++c) lane[c] = lane[c] + w->ws.tail[i * D + c];
        for (int k = 1; k < 4; ++k) {
            add_levels(w->ws.lanes + k * D, G >> p, partial, p, 4 * D, D, acc, more);
            for (int64_t c = 0; c < D; ++c) lane[c] = lane[c] + more[c];
        }
    }
    for (int64_t c = 0; c < D; ++c) {
        const float v = 0.0f + (w->plain_cols[c] ? plain[c] : lane[c]);
        if (a->form != PE_NORM_WEIGHT || a->dtype == PE_FLOAT32) ((float *)x->wgrad)[c] = v;
        else if (a->dtype == PE_BFLOAT16) ((uint16_t *)x->wgrad)[c] = c10_bf16(v);
        else ((uint16_t *)x->wgrad)[c] = c10_f16(v);
    }
    free(f);
    return PE_OK;
}

/* The rows per unit of work of tensor x walked token by token, or 0 where it is walked in
 * the products' order.  With transformers' (B, H, T, D) views the products' order is
 * (B, H, T), while x and its gradient usually lie token by token in memory (a token's
 * heads adjacent: the projection's layout, and the gradient SDPA gives back), so that
 * consecutive rows are a token's worth of memory apart.  Token by token, each head's rows
 * still come in the products' order among themselves, so its blocks are summed as before,
 * provided no block spans two units: T a multiple of both block sizes, and units of whole
 * tiles of tokens (at least 512 rows where T allows: q's and k's units alike in size).
 * Measured on an AMD EPYC (Zen 4), Qwen3-VL-8B shapes at T = 4096 (docs/qk_norm.md). */
static int64_t by_token_chunk(const pe_qk_norm_args *a, const pe_qk_norm_tensor *x,
                              const wsum_plan *w) {
    const int64_t T = a->seq, H = x->heads;
    if (!a->heads_first || H < 2 || !w->ws.rows) return 0;
    if (!(x->x_stride[2] < x->x_stride[1] && x->grad_stride[2] < x->grad_stride[1])) return 0;
    int64_t tile = w->ws.plain_block > w->ws.lane_block ? w->ws.plain_block : w->ws.lane_block;
    if (T % tile) return 0;
    while (tile * H < 512 && T % (2 * tile) == 0) tile *= 2;
    return tile * H;
}

typedef struct bwd_ctx {
    qk_bwd_fn fn;
    const wsum_plan *w; /* q's, k's */
    pe_qk_plan plan;
} bwd_ctx;

/* Unit u: a chunk of q's rows, then of k's, in the order of their walk. */
static void bwd_unit(const pe_qk_norm_args *a, int64_t u, void *scratch, const void *ctx) {
    const bwd_ctx *c = ctx;
    const int which = u >= c->w[0].units;
    const wsum_plan *w = &c->w[which];
    const int64_t r0 = (which ? u - c->w[0].units : u) * w->chunk, N = w->ws.rows;
    c->fn(a, &c->plan, which, r0, N - r0 < w->chunk ? N : r0 + w->chunk, &w->ws, scratch);
}

/* The backward of fp32 / bf16 / fp16 tensors: units of rows of q then k over threads. */
static int run_backward_f32(const pe_qk_norm_args *a, qk_bwd_fn fn) {
    wsum_plan w[2];
    const pe_qk_norm_tensor *xs[2] = {&a->q, &a->k};
    int rc = wsum_make(a, xs[0], &w[0]);
    if (rc == PE_OK) rc = wsum_make(a, xs[1], &w[1]);
    else memset(&w[1], 0, sizeof w[1]);
    if (rc == PE_OK) {
        bwd_ctx c = {fn, w, make_plan(a, 1)};
        int64_t acc_heads = 1;
        for (int k = 0; k < 2; ++k) {
            const int64_t chunk = by_token_chunk(a, xs[k], &w[k]);
            if (!chunk) continue;
            c.plan.by_token[k] = 1;
            w[k].chunk = chunk;
            w[k].units = w[k].ws.rows / chunk;
            if (xs[k]->heads > acc_heads) acc_heads = xs[k]->heads;
        }
        const int64_t units = w[0].units + w[1].units;
        rc = run_units(a, units, threads_for(a, units), bwd_unit, &c, acc_heads);
    }
    for (int k = 0; k < 2 && rc == PE_OK; ++k)
        if (xs[k]->heads) rc = wsum_finish(a, xs[k], &w[k]);
    wsum_free(&w[0]);
    wsum_free(&w[1]);
    return rc;
}

static int run(const pe_qk_norm_args *a, int backward) {
    if (!args_ok(a, backward)) return PE_ERR_ARG;
    const int64_t tokens = a->batch * a->seq, heads = a->q.heads + a->k.heads;
    /* a tensor without rows: its weight gradient is a sum of nothing, +0 */
    for (int k = 0; backward && a->dtype != PE_FLOAT64 && k < 2; ++k) {
        const pe_qk_norm_tensor *x = k ? &a->k : &a->q;
        if ((!x->heads || !tokens) && x->wgrad)
            memset(x->wgrad, 0, (size_t)a->head_dim *
                                    (a->form == PE_NORM_WEIGHT ? pe_dtype_size(a->dtype) : 4));
    }
    if (!tokens || !heads) return PE_OK;
    hint_output(a, &a->q);
    hint_output(a, &a->k);
    const pe_qk_plan none = {{0, 0}, {0, 0}, {0, 0}};
    if (a->dtype == PE_FLOAT64)
        return run_tiles(a, backward ? qk_backward_f64 : qk_forward_f64, none);
    const qk_kernels k = kernels();
    return backward ? run_backward_f32(a, k.backward) : run_tiles(a, k.forward, make_plan(a, 0));
}

int pe_qk_norm_rope(const pe_qk_norm_args *a) { return run(a, 0); }

int pe_qk_norm_rope_backward(const pe_qk_norm_args *a) { return run(a, 1); }

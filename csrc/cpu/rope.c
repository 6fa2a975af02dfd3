/*
 * Public RoPE entry points: argument checks (sizes, overflow, overlap), the per-call plan,
 * the choice of compute precision per tensor, the one loop that runs the tiles of a pass
 * over threads (both precisions), and the small fp64 core.  The fp32 core is rope_f32.h,
 * compiled per instruction set into rope_<isa>.c.
 */
#define _DEFAULT_SOURCE /* madvise, mincore */
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "internal.h"
#include "rope_check.h"

int pe_mrope_axis_map(int64_t n_slots, const int64_t sections[3], int interleaved,
                      uint8_t *axis_of_slot) {
    if (n_slots < 0 || !sections || !axis_of_slot) return PE_ERR_ARG;
    /* each section in [0, n_slots] before adding: the sum cannot overflow */
    for (int i = 0; i < 3; ++i)
        if (sections[i] < 0 || sections[i] > n_slots) return PE_ERR_ARG;
    if (sections[0] + sections[1] + sections[2] != n_slots) return PE_ERR_ARG;
    for (int64_t i = 0; i < n_slots; ++i) {
        if (interleaved) { /* i = 3j + 1 -> H while j < s1; i = 3j + 2 -> W while j < s2 */
            axis_of_slot[i] = (i % 3 == 1 && i / 3 < sections[1])   ? 1
                              : (i % 3 == 2 && i / 3 < sections[2]) ? 2
                                                                     : 0;
        } else {
            axis_of_slot[i] = i < sections[0] ? 0 : i - sections[0] < sections[1] ? 1 : 2;
        }
    }
    return PE_OK;
}

/* ---- argument checks ----------------------------------------------------------------- */

/* Empty tensors may have NULL data: pointers are checked only where data is touched. */
static int tensor_ok(const pe_rope_tensor *x, int empty) {
    if (x->heads == 0) return 1;
    return pe_dtype_valid(x->in_dtype) && pe_dtype_valid(x->out_dtype) &&
           (empty || (x->in && x->out));
}

/* Sizes and options, independent of the angle source; B T (Hq + Hk) D must fit int64. */
static int sizes_ok(const pe_rope_args *a) {
    if (!a || a->batch < 0 || a->seq < 0 || a->head_dim < 0) return 0;
    if (a->rot_dim < 2 || a->rot_dim % 2 || a->rot_dim > a->head_dim) return 0;
    if (a->pairing != PE_PAIR_HALF && a->pairing != PE_PAIR_ADJACENT) return 0;
    if (a->q.heads < 0 || a->k.heads < 0) return 0;
    int64_t n;
    if (__builtin_mul_overflow(a->batch, a->seq, &n) || __builtin_add_overflow(a->q.heads, a->k.heads, &n) ||
        __builtin_mul_overflow(a->batch * a->seq, n, &n) || __builtin_mul_overflow(n, a->head_dim, &n))
        return 0;
    const uint8_t *axis = a->src.axis_of_slot;
    if (axis) {
        for (int64_t i = 0; i < a->rot_dim / 2; ++i)
            if (axis[i] > 2) return 0;
    }
    return 1;
}

static int positions_ok(const pe_rope_source *s, int64_t batch) {
    return s->pos && s->inv_freq && (s->pos_batch == 1 || s->pos_batch == batch);
}

static int table_shape_ok(const pe_rope_source *s, int64_t batch) {
    return pe_dtype_valid(s->table_dtype) && (s->table_batch == 1 || s->table_batch == batch);
}

/* The bytes [lo, hi) a view can touch; lo == hi when it touches none. */
typedef struct span {
    uintptr_t lo, hi;
} span;

/* Span of a view of sizes n[0..nd-1] with element strides s, each index selecting a run of
 * `inner` contiguous elements of es bytes.  Returns 0 when the offsets overflow int64. */
static int span_of(const void *base, int nd, const int64_t *n, const int64_t *s, int64_t inner,
                   size_t es, span *out) {
    out->lo = out->hi = 0;
    if (!base || inner <= 0) return 1;
    for (int i = 0; i < nd; ++i)
        if (n[i] <= 0) return 1;
    int64_t lo = 0, hi = inner, ext;
    for (int i = 0; i < nd; ++i) {
        if (__builtin_mul_overflow(n[i] - 1, s[i], &ext)) return 0;
        if (__builtin_add_overflow(ext < 0 ? lo : hi, ext, ext < 0 ? &lo : &hi)) return 0;
    }
    if (__builtin_mul_overflow(lo, (int64_t)es, &lo) || __builtin_mul_overflow(hi, (int64_t)es, &hi))
        return 0;
    out->lo = (uintptr_t)base + (uintptr_t)lo; /* unsigned: wraps instead of overflowing */
    out->hi = (uintptr_t)base + (uintptr_t)hi;
    return 1;
}

static int dense_span(const void *base, int64_t count, size_t es, span *out) {
    const int64_t one = 1;
    return span_of(base, 1, &one, &one, count, es, out);
}

static int overlap(span a, span b) {
    return a.lo < a.hi && b.lo < b.hi && a.lo < b.hi && b.lo < a.hi;
}

/* 1 when no output touches an input or another output. */
static int disjoint(const span *out, int n_out, const span *in, int n_in) {
    for (int i = 0; i < n_out; ++i) {
        for (int j = 0; j < n_in; ++j)
            if (overlap(out[i], in[j])) return 0;
        for (int j = 0; j < i; ++j)
            if (overlap(out[i], out[j])) return 0;
    }
    return 1;
}

/* Input and output spans of x's (B, T, heads, width) rows. */
static int tensor_spans(const pe_rope_args *a, const pe_rope_tensor *x, int64_t width,
                        span *in, span *out) {
    const int64_t n[3] = {a->batch, a->seq, x->heads};
    return span_of(x->in, 3, n, x->in_stride, width, pe_dtype_size(x->in_dtype), in) &&
           span_of(x->out, 3, n, x->out_stride, width, pe_dtype_size(x->out_dtype), out);
}

/* Spans of the angle source: cos, sin or pos, inv_freq; then axis_of_slot.  Tables and
 * positions have A = 3 axes with an axis map, else 1 (posenc.h). */
static int source_spans(const pe_rope_args *a, int tables, span in[3]) {
    const pe_rope_source *s = &a->src;
    const int64_t nslot = a->rot_dim / 2, axes = s->axis_of_slot ? 3 : 1;
    int ok = dense_span(s->axis_of_slot, nslot, 1, &in[2]);
    if (tables) {
        const int64_t n[3] = {axes, s->table_batch, a->seq};
        const size_t es = pe_dtype_size(s->table_dtype);
        return ok && span_of(s->cos, 3, n, s->table_stride, a->rot_dim, es, &in[0]) &&
               span_of(s->sin, 3, n, s->table_stride, a->rot_dim, es, &in[1]);
    }
    const int64_t n[3] = {axes, s->pos_batch, a->seq};
    return ok && span_of(s->pos, 3, n, s->pos_stride, 1, sizeof(int64_t), &in[0]) &&
           dense_span(s->inv_freq, nslot, sizeof(float), &in[1]);
}

/* ---- per-call plan ------------------------------------------------------------------- */

static void plan_free(pe_rope_plan *p) { free(p->slot_pos_off); }

/* The spans of a token's table row (cos or sin, all axes) that the rotation reads: from
 * every axis, the channels that read it (whole blocks of the vector table pass where it has
 * blocks), spans closer than a cache line merged.  rope_f32.h asks for them a tile ahead. */
static void plan_fetch(const pe_rope_args *a, pe_rope_plan *p) {
    const int64_t R = a->rot_dim, es = (int64_t)pe_dtype_size(a->src.table_dtype);
    const int64_t unit = p->block && R % p->block == 0 ? p->block : 1; /* channels per read */
    p->nfetch = 0;
    for (int64_t ax = 0; ax < p->axes; ++ax) {
        int64_t open = -1; /* index of the span being extended, or -1 */
        for (int64_t e = 0, k = 0; e < R; e += unit, ++k) {
            const int reads = unit > 1 ? (p->block_axes[k] >> ax) & 1u : p->chan_axis[e] == ax;
            if (!reads) continue;
            const int64_t at = ax * a->src.table_stride[0] * es + e * es, bytes = unit * es;
            if (open >= 0 && at - (p->fetch[2 * open] + p->fetch[2 * open + 1]) < 64) {
                p->fetch[2 * open + 1] = at + bytes - p->fetch[2 * open];
            } else {
                open = p->nfetch++;
                p->fetch[2 * open] = at;
                p->fetch[2 * open + 1] = bytes;
            }
        }
    }
}

/* `block`: channels per block of the rotation's vector table pass (f32_kernels), 0 for
 * none. */
static int plan_make(const pe_rope_args *a, pe_rope_plan *p, int64_t block) {
    const int64_t R = a->rot_dim, nslot = R / 2, nblock = block ? R / block : 0;
    const uint8_t *axis = a->src.axis_of_slot;
    memset(p, 0, sizeof *p);
    p->axes = axis ? 3 : 1;
    p->tile = 1;
    /* one block: slot_pos_off[nslot + 1], run_start[R + 1], fetch[6 R] (int64); axis_sel[2 R],
     * block_sel[2 (nblock + 1)] (uint32); chan_axis[R + 1], block_axes[nblock + 1] (bytes) */
    const size_t words = (size_t)(nslot + 7 * R + 2), sels = (size_t)(2 * R + 2 * (nblock + 1));
    p->slot_pos_off = (int64_t *)calloc(1, words * sizeof(int64_t) + sels * sizeof(uint32_t) +
                                               (size_t)(R + nblock + 2));
    if (!p->slot_pos_off) return PE_ERR_NOMEM;
    p->run_start = p->slot_pos_off + nslot + 1;
    p->fetch = p->run_start + R + 1;
    p->axis_sel = (uint32_t *)(p->fetch + 6 * R);
    p->block_sel = p->axis_sel + 2 * R;
    p->chan_axis = (uint8_t *)(p->axis_sel + sels);
    p->block_axes = p->chan_axis + R + 1;
    p->block = block;
    p->nruns = 0;
    /* channel e: its axis, the runs, the blend masks and bits (zero from calloc where e reads
     * another axis) and the axes of its block e / block (built in a register, stored once) */
    unsigned used = 0;
    for (int64_t e = 0, k = 0, in_block = 0; e < R; ++e) {
        const uint8_t ax = axis ? axis[pe_slot(a->pairing, e, R)] : 0;
        p->chan_axis[e] = ax;
        if (e == 0 || ax != p->chan_axis[e - 1]) p->run_start[p->nruns++] = e;
        if (ax) p->axis_sel[(ax - 1) * R + e] = 0xffffffffu;
        if (!block) continue;
        if (ax && block <= 32) p->block_sel[(ax - 1) * (nblock + 1) + k] |= 1u << in_block;
        used |= 1u << ax;
        if (++in_block == block || e == R - 1) {
            p->block_axes[k++] = (uint8_t)used;
            used = 0;
            in_block = 0;
        }
    }
    p->run_start[p->nruns] = R;
    for (int64_t i = 0; axis && i < nslot; ++i) p->slot_pos_off[i] = axis[i] * a->src.pos_stride[0];
    if (!a->src.pos) plan_fetch(a, p);
    return PE_OK;
}

/* ---- the driver: one loop over the tiles of a pass, for every entry point and both
 * precisions ---------------------------------------------------------------------------- */

/*
 * Items 0 .. items-1 in tiles of `tile`, on the calling thread when one thread is asked for
 * or the pass touches fewer than PE_SERIAL_ELEMENTS elements (`work`): then no OpenMP
 * region is entered at all (a decode step is a plain call).  Otherwise nthreads threads
 * take dynamic chunks of about an eighth of a thread's share, so that a thread that starts
 * late (a busy machine) hands its work to the others.  Each thread has its own scratch.
 */
static inline __attribute__((always_inline)) int run_tiles(const pe_rope_args *a,
                                                           const pe_rope_plan *p, pe_tile_fn fn,
                                                           int64_t items, int64_t tile,
                                                           int64_t work) {
    const int64_t ntile = (items + tile - 1) / tile;
    const size_t bytes = pe_scratch_bytes(a->rot_dim, a->head_dim, p->tile);
    const int nt = a->nthreads > 1 && work >= PE_SERIAL_ELEMENTS ? a->nthreads : 1;
    if (nt == 1) {
        _Alignas(64) unsigned char local[PE_STACK_SCRATCH];
        void *scratch = bytes <= sizeof local ? local : malloc(bytes);
        if (!scratch) return PE_ERR_NOMEM;
        for (int64_t i = 0; i < ntile; ++i)
            fn(a, p, i * tile, items - i * tile < tile ? items - i * tile : tile, scratch);
        if (scratch != local) free(scratch);
        return PE_OK;
    }
    const int64_t chunk = ntile / (8 * (int64_t)nt) > 1 ? ntile / (8 * (int64_t)nt) : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        void *scratch = malloc(bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, chunk)
        for (int64_t i = 0; i < ntile; ++i)
            if (scratch)
                fn(a, p, i * tile, items - i * tile < tile ? items - i * tile : tile, scratch);
        free(scratch);
    }
    return failed ? PE_ERR_NOMEM : PE_OK;
}

/* ---- fp64 core: tensors that are fp64 or rotate with fp64 tables.  Scalar and small;
 * stores round once from fp64 to the output dtype.  Its tiles run in the driver above. */

static double load_f64(const char *p, pe_dtype dt) {
    float f;
    double d;
    uint16_t h;
    switch (dt) {
    case PE_FLOAT64: memcpy(&d, p, 8); return d;
    case PE_FLOAT32: memcpy(&f, p, 4); return f;
    case PE_BFLOAT16: memcpy(&h, p, 2); return pe_bf16_to_f32(h);
    case PE_FLOAT16: memcpy(&h, p, 2); return pe_f16_to_f32(h);
    }
    return 0;
}

static void store_f64(char *p, pe_dtype dt, double v) {
    const float f = (float)v;
    uint16_t h;
    switch (dt) {
    case PE_FLOAT64: memcpy(p, &v, 8); return;
    case PE_FLOAT32: memcpy(p, &f, 4); return;
    case PE_BFLOAT16: h = pe_f64_to_bf16(v); memcpy(p, &h, 2); return;
    case PE_FLOAT16: h = pe_f64_to_f16(v); memcpy(p, &h, 2); return;
    }
}

static int64_t partner(pe_pairing p, int64_t e, int64_t R) {
    if (p == PE_PAIR_HALF) return e < R / 2 ? e + R / 2 : e - R / 2;
    return e ^ 1;
}

/* sign(e) < 0: the first half (HALF) or even channels (ADJACENT). */
static int negative(pe_pairing p, int64_t e, int64_t R) {
    return p == PE_PAIR_HALF ? e < R / 2 : !(e & 1);
}

/* cos and signed sine of token (b, t) (forward or transpose, see posenc.h); s is scratch. */
static void token_tables_f64(const pe_rope_args *a, const pe_rope_plan *plan, int64_t b, int64_t t,
                             double *c, double *ss, double *s, float *slots) {
    const pe_rope_source *src = &a->src;
    const int64_t R = a->rot_dim;
    if (src->pos) {
        float *cs = slots, *sn = slots + R / 2;
        pe_rope_slot_sincos(a, plan, b, t, cs, sn);
        for (int64_t e = 0; e < R; ++e) {
            c[e] = cs[pe_slot(a->pairing, e, R)];
            s[e] = sn[pe_slot(a->pairing, e, R)];
        }
    } else {
        const int64_t es = (int64_t)pe_dtype_size(src->table_dtype);
        const int64_t off = (src->table_batch == 1 ? 0 : b) * src->table_stride[1] +
                            t * src->table_stride[2];
        for (int64_t e = 0; e < R; ++e) {
            const int64_t o = (off + plan->chan_axis[e] * src->table_stride[0] + e) * es;
            c[e] = load_f64((const char *)src->cos + o, src->table_dtype);
            s[e] = load_f64((const char *)src->sin + o, src->table_dtype);
        }
    }
    for (int64_t e = 0; e < R; ++e) {
        const int neg = negative(a->pairing, e, R);
        ss[e] = a->transpose ? (neg ? s[partner(a->pairing, e, R)] : -s[partner(a->pairing, e, R)])
                             : (neg ? -s[e] : s[e]);
    }
}

/* Rotate heads h0 .. h1-1 of one tensor for token (b, t). */
static void rotate_heads_f64(const pe_rope_args *a, const pe_rope_tensor *x, int64_t b, int64_t t,
                             int64_t h0, int64_t h1, const double *c, const double *ss,
                             double *row) {
    const int64_t R = a->rot_dim, D = a->head_dim;
    const size_t ies = pe_dtype_size(x->in_dtype), oes = pe_dtype_size(x->out_dtype);
    for (int64_t h = h0; h < h1; ++h) {
        const char *in = pe_row(x->in, x->in_stride, ies, b, t, h);
        char *out = (char *)pe_row(x->out, x->out_stride, oes, b, t, h);
        for (int64_t e = 0; e < D; ++e) row[e] = load_f64(in + e * (int64_t)ies, x->in_dtype);
        for (int64_t e = 0; e < R; ++e)
            store_f64(out + e * (int64_t)oes, x->out_dtype,
                      pe_rot_f64(row[e], c[e], row[partner(a->pairing, e, R)], ss[e]));
        for (int64_t e = R; e < D; ++e) store_f64(out + e * (int64_t)oes, x->out_dtype, row[e]);
    }
}

/* A tile of tokens, laid out and visited as the fp32 core's (rope_f32_rotate). */
static void rope_f64_rotate(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0, int64_t n,
                            void *scratch) {
    const int64_t T = a->seq, R = a->rot_dim, D = a->head_dim;
    double *c = (double *)scratch, *ss = c + p->tile * R, *s = ss + p->tile * R, *row = s + R;
    float *slots = (float *)(c + 2 * p->tile * R + 4 * R + 2 * D);
    for (int64_t j = 0; j < n; ++j)
        token_tables_f64(a, p, (i0 + j) / T, (i0 + j) % T, c + j * R, ss + j * R, s, slots);
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    for (int w = 0; w < 2; ++w) {
        const int64_t H = xs[w]->heads, step = p->heads_outer ? 1 : H;
        for (int64_t h = 0; h < H; h += step)
            for (int64_t j = 0; j < n; ++j)
                rotate_heads_f64(a, xs[w], (i0 + j) / T, (i0 + j) % T, h, h + step, c + j * R,
                                 ss + j * R, row);
    }
}

static void accumulate_heads_f64(const pe_rope_args *a, const pe_rope_tensor *x, const void *g,
                                 const int64_t gs[3], pe_dtype gdt, int64_t b, int64_t t,
                                 double *acc_c, double *acc_s, double *xr, double *gr) {
    const int64_t R = a->rot_dim;
    const size_t xes = pe_dtype_size(x->in_dtype), ges = pe_dtype_size(gdt);
    for (int64_t h = 0; h < x->heads; ++h) {
        const char *xp = pe_row(x->in, x->in_stride, xes, b, t, h);
        const char *gp = pe_row(g, gs, ges, b, t, h);
        for (int64_t e = 0; e < R; ++e) {
            xr[e] = load_f64(xp + e * (int64_t)xes, x->in_dtype);
            gr[e] = load_f64(gp + e * (int64_t)ges, gdt);
        }
        for (int64_t e = 0; e < R; ++e) {
            const double gx = gr[e] * xr[partner(a->pairing, e, R)];
            acc_c[e] += gr[e] * xr[e];
            acc_s[e] = negative(a->pairing, e, R) ? acc_s[e] - gx : acc_s[e] + gx;
        }
    }
}

/* Table-gradient rows, as the fp32 core's (rope_f32_grad_rows). */
static void rope_f64_grad_rows(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                               int64_t n, void *scratch) {
    const int64_t B = a->batch, T = a->seq, R = a->rot_dim, Bc = a->src.table_batch;
    const int64_t oes = (int64_t)pe_dtype_size(p->out_dtype);
    double *acc_c = (double *)scratch, *acc_s = acc_c + R, *xr = acc_s + R, *gr = xr + R;
    for (int64_t i = i0; i < i0 + n; ++i) {
        const int64_t bc = i / T, t = i % T;
        for (int64_t e = 0; e < R; ++e) acc_c[e] = acc_s[e] = 0;
        const int64_t b0 = Bc == 1 ? 0 : bc, b1 = Bc == 1 ? B : bc + 1;
        for (int64_t b = b0; b < b1; ++b) {
            accumulate_heads_f64(a, &a->q, p->grad_q, p->grad_q_stride, p->grad_dtype, b, t,
                                 acc_c, acc_s, xr, gr);
            accumulate_heads_f64(a, &a->k, p->grad_k, p->grad_k_stride, p->grad_dtype, b, t,
                                 acc_c, acc_s, xr, gr);
        }
        for (int64_t ax = 0; ax < p->axes; ++ax) {
            char *dc = (char *)p->cos_out + ((ax * Bc + bc) * T + t) * R * oes;
            char *ds = (char *)p->sin_out + ((ax * Bc + bc) * T + t) * R * oes;
            for (int64_t e = 0; e < R; ++e) {
                const int on = p->axes == 1 || p->chan_axis[e] == ax;
                store_f64(dc + e * oes, p->out_dtype, on ? acc_c[e] : 0.0);
                store_f64(ds + e * oes, p->out_dtype, on ? acc_s[e] : 0.0);
            }
        }
    }
}

/* ---- dispatch ------------------------------------------------------------------------ */

typedef struct f32_kernels {
    pe_tile_fn rotate, grad_rows, table_rows;
    int64_t block; /* channels per block of the rotation's vector table pass (rope_f32.h) */
} f32_kernels;

/* Indexed by pe_isa; only variants that were built are listed (pe_isa_best never returns
 * the others). */
static const f32_kernels f32_variants[] = {
    [PE_ISA_BASELINE] = {pe_rope_rotate_f32_baseline, pe_rope_grad_rows_f32_baseline,
                         pe_rope_table_rows_f32_baseline, 0},
#ifdef PE_HAVE_X86_VARIANTS
    [PE_ISA_AVX2] = {pe_rope_rotate_f32_avx2, pe_rope_grad_rows_f32_avx2,
                     pe_rope_table_rows_f32_avx2, 16},
    [PE_ISA_AVX512] = {pe_rope_rotate_f32_avx512, pe_rope_grad_rows_f32_avx512,
                       pe_rope_table_rows_f32_avx512, 32},
#endif
#ifdef PE_HAVE_AVX512BF16
    [PE_ISA_AVX512_BF16] = {pe_rope_rotate_f32_avx512bf16, pe_rope_grad_rows_f32_avx512bf16,
                            pe_rope_table_rows_f32_avx512bf16, 32},
#endif
};

static const f32_kernels *f32_current(void) { return &f32_variants[pe_isa_current()]; }

/* A tensor runs in fp64 when it or the tables are fp64; its result never depends on the
 * other tensor's dtype. */
static int runs_f64(const pe_rope_args *a, const pe_rope_tensor *x) {
    return x->heads && (x->in_dtype == PE_FLOAT64 || x->out_dtype == PE_FLOAT64 ||
                        (!a->src.pos && a->src.table_dtype == PE_FLOAT64));
}

/* Asks the OS to back a large output with huge pages.  A fresh output past the allocator's
 * mmap threshold is untouched memory: writing it costs one page fault per 4 KiB page, each
 * zeroing its page, which takes longer than the rotation itself; with 2 MiB pages the faults
 * are 512x fewer.  Advisory only (memory contents are untouched, and the call does nothing
 * where transparent huge pages are off); only whole 2 MiB pages inside the span are named. */
static void huge_page_hint(span s) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t page = (uintptr_t)2 << 20;
    if (s.hi - s.lo < PE_HUGE_PAGE_HINT_BYTES) return;
    const uintptr_t lo = (s.lo + page - 1) & ~(page - 1), hi = s.hi & ~(page - 1);
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)s;
#endif
}

void pe_huge_page_hint(const void *p, size_t bytes) {
    const span s = {(uintptr_t)p, (uintptr_t)p + bytes};
    huge_page_hint(s);
}

/* 1 when the pages of s that a few samples look at are all in memory (Linux; elsewhere 0,
 * so that nothing streams). */
static int resident(span s) {
#if defined(__linux__)
    const long page = sysconf(_SC_PAGESIZE);
    if (page <= 0 || s.hi <= s.lo) return 0;
    for (int i = 0; i < 8; ++i) {
        const uintptr_t at = s.lo + (s.hi - 1 - s.lo) / 7 * (uintptr_t)i;
        unsigned char in = 0;
        if (mincore((void *)(at & ~((uintptr_t)page - 1)), 1, &in) || !(in & 1)) return 0;
    }
    return 1;
#else
    (void)s;
    return 0;
#endif
}

int pe_pages_resident(const void *p, size_t bytes) {
    const span s = {(uintptr_t)p, (uintptr_t)p + bytes};
    return resident(s);
}

/* Whether x's rotated rows are written with streaming stores (pe_rope_plan.stream_out): the
 * outputs together are at least PE_STREAM_BYTES and x's already in memory (a fresh output
 * faults each page in, zeroed into the cache, where streaming stores cost more), every row
 * starts on 64 bytes and is rotated whole (no pass-through channels). */
static int stream_rows(const pe_rope_args *a, const pe_rope_tensor *x, span out,
                       uintptr_t total) {
    const int64_t es = (int64_t)pe_dtype_size(x->out_dtype), n[3] = {a->batch, a->seq, x->heads};
    if (!x->heads || total < PE_STREAM_BYTES || a->rot_dim != a->head_dim || es > 4 ||
        (uintptr_t)x->out % 64 || a->rot_dim / 2 * es % 64)
        return 0;
    for (int i = 0; i < 3; ++i)
        if (n[i] > 1 && x->out_stride[i] * es % 64) return 0;
    return resident(out);
}

/* 1 when x's input rows fill one span without gaps, whatever the order of its dimensions:
 * then the bytes PE_PREFETCH_AHEAD past a row are rows the pass reads later (or past the
 * end, where a prefetch does nothing). */
static int dense_input(const pe_rope_args *a, const pe_rope_tensor *x) {
    span in, unused;
    const int64_t es = (int64_t)pe_dtype_size(x->in_dtype);
    if (!x->heads || !tensor_spans(a, x, a->head_dim, &in, &unused)) return 0;
    return (int64_t)(in.hi - in.lo) == a->batch * a->seq * x->heads * a->head_dim * es;
}

/* ---- entry points -------------------------------------------------------------------- */

int pe_rope_check_apply(const pe_rope_args *a) {
    if (!sizes_ok(a)) return PE_ERR_ARG;
    const int empty = a->batch == 0 || a->seq == 0;
    if (!tensor_ok(&a->q, empty) || !tensor_ok(&a->k, empty)) return PE_ERR_ARG;
    if (empty) return PE_CHECK_EMPTY;
    const pe_rope_source *s = &a->src;
    const int tables = !s->pos;
    if (tables ? !(s->cos && s->sin && table_shape_ok(s, a->batch)) : !positions_ok(s, a->batch))
        return PE_ERR_ARG;
    span in[5], out[2];
    if (!tensor_spans(a, &a->q, a->head_dim, &in[0], &out[0]) ||
        !tensor_spans(a, &a->k, a->head_dim, &in[1], &out[1]) || !source_spans(a, tables, &in[2]) ||
        !disjoint(out, 2, in, 5))
        return PE_ERR_ARG;
    return PE_CHECK_RUN;
}

int pe_rope_apply(const pe_rope_args *a) {
    int rc = pe_rope_check_apply(a);
    if (rc != PE_CHECK_RUN || (!a->q.heads && !a->k.heads)) return rc < 0 ? rc : PE_OK;
    span unused, out[2] = {{0, 0}, {0, 0}};
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    for (int w = 0; w < 2; ++w)
        if (xs[w]->heads && tensor_spans(a, xs[w], a->head_dim, &unused, &out[w]))
            huge_page_hint(out[w]);
    const f32_kernels *k32 = f32_current();
    pe_rope_plan plan;
    if ((rc = plan_make(a, &plan, k32->block))) return rc;
    const uintptr_t total = (out[0].hi - out[0].lo) + (out[1].hi - out[1].lo);
    for (int w = 0; w < 2; ++w) {
        plan.stream_out[w] = stream_rows(a, xs[w], out[w], total);
        plan.ahead[w] = dense_input(a, xs[w]) ? PE_PREFETCH_AHEAD : 0;
    }
    /* heads outer in memory: the tiles are rotated head by head (rows stay adjacent) */
    const pe_rope_tensor *lead = a->q.heads ? &a->q : &a->k;
    plan.heads_outer = lead->heads > 1 && lead->in_stride[2] > lead->in_stride[1];
    plan.tile = a->src.pos && !plan.heads_outer ? PE_FUSED_TILE : PE_TOKEN_TILE;
    if (a->batch * a->seq < plan.tile) plan.tile = a->batch * a->seq; /* smaller scratch */
    /* q and k in one pass, or one pass each when they run in different precisions */
    const int q64 = runs_f64(a, &a->q), k64 = runs_f64(a, &a->k);
    const int split = a->q.heads && a->k.heads && q64 != k64;
    for (int pass = 0; pass <= split && rc == PE_OK; ++pass) {
        pe_rope_args one = *a;
        if (split) *(pass ? &one.q.heads : &one.k.heads) = 0;
        const int64_t ntok = a->batch * a->seq;
        const int f64 = split ? (pass ? k64 : q64) : q64 || k64;
        rc = run_tiles(&one, &plan, f64 ? rope_f64_rotate : k32->rotate, ntok, plan.tile,
                       ntok * (one.q.heads + one.k.heads) * a->head_dim);
    }
    plan_free(&plan);
    return rc;
}

/* The tables are written densely, (A, Bc, T, R); with B = 0 and Bc = 1 they are zeros. */
int pe_rope_check_table_grad(const pe_rope_args *a, const void *grad_q,
                             const int64_t grad_q_stride[3], const void *grad_k,
                             const int64_t grad_k_stride[3], pe_dtype grad_dtype,
                             const void *dcos, const void *dsin) {
    if (!sizes_ok(a) || a->src.pos || !table_shape_ok(&a->src, a->batch) ||
        !pe_dtype_valid(grad_dtype))
        return PE_ERR_ARG;
    const int no_input = a->batch == 0 || a->seq == 0;
    if (!tensor_ok(&a->q, no_input) || !tensor_ok(&a->k, no_input)) return PE_ERR_ARG;
    if (!no_input && ((a->q.heads && (!grad_q || !grad_q_stride)) ||
                      (a->k.heads && (!grad_k || !grad_k_stride))))
        return PE_ERR_ARG;
    if (a->src.table_batch == 0 || a->seq == 0) return PE_CHECK_EMPTY;
    if (!dcos || !dsin) return PE_ERR_ARG;
    static const int64_t none[3] = {0, 0, 0};
    const int64_t A = a->src.axis_of_slot ? 3 : 1, R = a->rot_dim;
    const int64_t n_q[3] = {a->batch, a->seq, a->q.heads}, n_k[3] = {a->batch, a->seq, a->k.heads};
    const size_t ges = pe_dtype_size(grad_dtype), tes = pe_dtype_size(a->src.table_dtype);
    int64_t count;
    span in[5], out[2], unused;
    if (__builtin_mul_overflow(A * a->src.table_batch, a->seq, &count) ||
        __builtin_mul_overflow(count, R, &count) || !dense_span(dcos, count, tes, &out[0]) ||
        !dense_span(dsin, count, tes, &out[1]) || !tensor_spans(a, &a->q, R, &in[0], &unused) ||
        !tensor_spans(a, &a->k, R, &in[1], &unused) ||
        !span_of(grad_q, 3, n_q, grad_q_stride ? grad_q_stride : none, R, ges, &in[2]) ||
        !span_of(grad_k, 3, n_k, grad_k_stride ? grad_k_stride : none, R, ges, &in[3]) ||
        !dense_span(a->src.axis_of_slot, R / 2, 1, &in[4]) || !disjoint(out, 2, in, 5))
        return PE_ERR_ARG;
    return PE_CHECK_RUN;
}

int pe_rope_table_grad(const pe_rope_args *a, const void *grad_q, const int64_t grad_q_stride[3],
                       const void *grad_k, const int64_t grad_k_stride[3], pe_dtype grad_dtype,
                       void *dcos, void *dsin) {
    int rc = pe_rope_check_table_grad(a, grad_q, grad_q_stride, grad_k, grad_k_stride,
                                      grad_dtype, dcos, dsin);
    if (rc != PE_CHECK_RUN) return rc < 0 ? rc : PE_OK;
    pe_rope_plan plan;
    if ((rc = plan_make(a, &plan, 0))) return rc;
    plan.grad_q = grad_q;
    plan.grad_k = grad_k;
    if (grad_q_stride) memcpy(plan.grad_q_stride, grad_q_stride, sizeof plan.grad_q_stride);
    if (grad_k_stride) memcpy(plan.grad_k_stride, grad_k_stride, sizeof plan.grad_k_stride);
    plan.grad_dtype = grad_dtype;
    plan.cos_out = dcos;
    plan.sin_out = dsin;
    plan.out_dtype = a->src.table_dtype;
    const int f64 = grad_dtype == PE_FLOAT64 || a->src.table_dtype == PE_FLOAT64 ||
                    (a->q.heads && a->q.in_dtype == PE_FLOAT64) ||
                    (a->k.heads && a->k.in_dtype == PE_FLOAT64);
    rc = run_tiles(a, &plan, f64 ? rope_f64_grad_rows : f32_current()->grad_rows,
                   a->src.table_batch * a->seq, PE_TOKEN_TILE,
                   a->batch * a->seq * (a->q.heads + a->k.heads) * a->head_dim);
    plan_free(&plan);
    return rc;
}

int pe_rope_check_tables(const pe_rope_args *a, pe_dtype out_dtype, const void *cos,
                         const void *sin) {
    if (!sizes_ok(a) || !pe_dtype_valid(out_dtype) || a->src.pos_batch < 0) return PE_ERR_ARG;
    if (a->src.pos_batch == 0 || a->seq == 0) return PE_CHECK_EMPTY;
    if (!positions_ok(&a->src, a->batch) || !cos || !sin) return PE_ERR_ARG;
    int64_t count;
    span in[3], out[2];
    if (__builtin_mul_overflow(a->src.pos_batch, a->seq, &count) ||
        __builtin_mul_overflow(count, a->rot_dim, &count) ||
        !dense_span(cos, count, pe_dtype_size(out_dtype), &out[0]) ||
        !dense_span(sin, count, pe_dtype_size(out_dtype), &out[1]) || !source_spans(a, 0, in) ||
        !disjoint(out, 2, in, 3))
        return PE_ERR_ARG;
    return PE_CHECK_RUN;
}

int pe_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin) {
    int rc = pe_rope_check_tables(a, out_dtype, cos, sin);
    if (rc != PE_CHECK_RUN) return rc < 0 ? rc : PE_OK;
    pe_rope_plan plan;
    if ((rc = plan_make(a, &plan, 0))) return rc;
    plan.cos_out = cos;
    plan.sin_out = sin;
    plan.out_dtype = out_dtype;
    const int64_t rows = a->src.pos_batch * a->seq;
    rc = run_tiles(a, &plan, f32_current()->table_rows, rows, PE_TOKEN_TILE, rows * a->rot_dim);
    plan_free(&plan);
    return rc;
}

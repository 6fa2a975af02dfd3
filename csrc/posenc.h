/*
 * posenc.h — the C API of posenc_torch's kernels, and their specification.
 *
 * Everything here is plain C17 over raw memory: no torch, no allocation visible to the
 * caller, no exceptions.  Functions return PE_OK or a negative pe_status.  Sizes, strides
 * and indices are int64_t everywhere; strides count elements, not bytes.
 *
 * ---------------------------------------------------------------------------------------
 * Rotary position embedding (RoPE)
 * ---------------------------------------------------------------------------------------
 * A tensor x of shape (B, T, H, D) (batch, token, head, head_dim; any strides for B, T, H,
 * the last dimension contiguous) is rotated with per-token tables c = cos, s = sin of
 * width R (the rotary width: R <= D, R even).  Channels R..D-1 are copied unchanged.
 *
 * Each of the R rotary channels e has a partner p(e) and a sign:
 *
 *   pairing HALF (transformers' rotate_half, GPT-NeoX), h = R/2:
 *       e      : 0 1 ... h-1 | h  h+1 ... R-1
 *       p(e)   : h h+1 . R-1 | 0  1   ... h-1
 *       sign   : -           | +
 *   pairing ADJACENT (GPT-J, Meta's complex form):
 *       e      : 0 1 | 2 3 | ...
 *       p(e)   : 1 0 | 3 2 | ...
 *       sign   : - + | - + | ...
 *
 *   forward:   out[e] = x[e] * c[e] + sign(e) * x[p(e)] * s[e]
 *   transpose: out[e] = x[e] * c[e] - sign(e) * x[p(e)] * s[p(e)]
 *
 * The transpose is the exact adjoint of the forward for any tables c, s (it is the
 * backward pass: feed it the gradient of the output).  Both halves of the tables are read
 * as given; nothing assumes c[e] == c[p(e)].
 *
 * Frequency slots.  R/2 slots carry the angles; slot i covers channels {i, i+h} (HALF) or
 * {2i, 2i+1} (ADJACENT).  Multimodal RoPE (MRoPE) picks, per slot, which position axis
 * (0 = temporal, 1 = height, 2 = width) the slot's angle comes from:
 *
 *   sections [s0, s1, s2] (Qwen2-VL, Qwen2.5-VL):  slots 0..s0-1 -> T, next s1 -> H, rest W
 *       slot:  T T ... T | H H ... H | W W ... W
 *   interleaved (Qwen3-VL):  slot i -> H if i%3==1 and i < 3*s1; W if i%3==2 and i < 3*s2;
 *       else T            slot:  T H W T H W ... T H W T T T
 *
 * Arithmetic.  16-bit and fp32 data are computed in fp32, fp64 data in fp64 (a call runs
 * in fp64 when any of its tensors is fp64); products and sums are not fused, and each
 * result is rounded once, to nearest even, when it is stored.
 *
 * Threads.  Work is split over tokens (b, t) with OpenMP; the cos/sin row of a token is
 * prepared once and used for every head of q and k.  nthreads <= 1 (or a small problem)
 * runs serially.  SIMD code is chosen at run time for the CPU (see pe_isa_*).
 */
#ifndef POSENC_H
#define POSENC_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pe_status {
    PE_OK = 0,
    PE_ERR_ARG = -1,    /* a size, stride, dtype or option is out of range */
    PE_ERR_NOMEM = -2,  /* a scratch buffer could not be allocated */
    PE_ERR_GRID = -3,   /* position ids: image/video grids disagree with the tokens */
} pe_status;

typedef enum pe_dtype {
    PE_FLOAT32 = 0,
    PE_FLOAT64 = 1,
    PE_BFLOAT16 = 2,
    PE_FLOAT16 = 3,
} pe_dtype;

typedef enum pe_pairing {
    PE_PAIR_HALF = 0,
    PE_PAIR_ADJACENT = 1,
} pe_pairing;

/* One rotated tensor: input x (B, T, heads, D) and output of the same shape. */
typedef struct pe_rope_tensor {
    const void *in;
    void *out;
    pe_dtype in_dtype, out_dtype;
    int64_t heads;
    int64_t in_stride[3];  /* b, t, h */
    int64_t out_stride[3]; /* b, t, h */
} pe_rope_tensor;

/*
 * Where the cos/sin of token (b, t) come from.  Exactly one source is set.
 *
 * Tables:  cos, sin of shape (A, Bc, T, R) with A = 1 (plain) or 3 (MRoPE axes), Bc = 1
 *   (shared by the batch) or B; channel e of token (b, t) reads axis axis_of_slot[slot(e)]
 *   (axis 0 when axis_of_slot is NULL).
 * Positions (fused):  pos of shape (A, Bp, T) int64, inv_freq[R/2] fp32; slot i of token
 *   (b, t) has angle fl32(inv_freq[i] * fl32(pos[axis(i), b, t])), and channel e gets
 *   scaling * cos(angle), scaling * sin(angle) of its slot, in fp32.
 */
typedef struct pe_rope_source {
    /* tables */
    const void *cos, *sin;
    pe_dtype table_dtype;
    int64_t table_batch;     /* Bc: 1 or B */
    int64_t table_stride[3]; /* axis, b, t (the channel stride is 1) */
    /* positions */
    const int64_t *pos;
    int64_t pos_batch;       /* Bp: 1 or B */
    int64_t pos_stride[3];   /* axis, b, t */
    const float *inv_freq;   /* R/2 values */
    float scaling;
    /* both */
    const uint8_t *axis_of_slot; /* R/2 values in {0, 1, 2}, or NULL */
} pe_rope_source;

typedef struct pe_rope_args {
    int64_t batch, seq, head_dim, rot_dim; /* B, T, D, R */
    pe_pairing pairing;
    int transpose;           /* 0: forward, 1: adjoint (backward) */
    pe_rope_source src;
    pe_rope_tensor q, k;     /* k.heads may be 0 (no k) */
    int nthreads;
} pe_rope_args;

/* Rotate q and k (forward or transpose) in one pass over the tokens. */
int pe_rope_apply(const pe_rope_args *a);

/*
 * Gradients of the tables: with g the gradient of the forward output and x the forward
 * input (q and k, a->q.in / a->k.in are x; grad_q / grad_k are g, same shapes),
 *
 *   dcos[a, b', t, e] = sum over heads (and over b when Bc = 1) of g[e] * x[e]
 *   dsin[a, b', t, e] = sum of g[e] * sign(e) * x[p(e)]
 *
 * for the axis a chosen by channel e's slot; the other axes get 0.  dcos, dsin are written
 * densely as (A, Bc, T, R) in table_dtype (src.table_* describe their shape, not data).
 * Sums run in fp32 (fp64 when any tensor is fp64).
 */
int pe_rope_table_grad(const pe_rope_args *a, const void *grad_q, const int64_t grad_q_stride[3],
                       const void *grad_k, const int64_t grad_k_stride[3], pe_dtype grad_dtype,
                       void *dcos, void *dsin);

/*
 * Tables from positions: cos, sin of shape (B, T, R), dense, in out_dtype, from the
 * positions source of a (a->src.pos / inv_freq / scaling / axis_of_slot, pairing decides
 * which channels share a slot).  Angles and trigonometry in fp32 as for the fused path,
 * then one rounding to out_dtype.  q and k in a are ignored.
 */
int pe_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin);

/* Build the per-slot axis map for R/2 slots from mrope sections (3 values).  Returns
 * PE_ERR_ARG unless the sections sum to R/2 (and are non-negative). */
int pe_mrope_axis_map(int64_t n_slots, const int64_t sections[3], int interleaved,
                      uint8_t *axis_of_slot);

/* ---------------------------------------------------------------------------------------
 * Sinusoidal absolute position encoding (Vaswani et al.)
 * ---------------------------------------------------------------------------------------
 * out: (num_positions, dim), dense and row-major, in out_dtype.  Column j of position p:
 *
 *   angle(p, j) = p / base^(2 * floor(j / 2) / dim)
 *   out[p, j]   = sin(angle(p, j)) for even j,  cos(angle(p, j)) for odd j
 *
 * i.e. interleaved [sin, cos, sin, cos, ...] over the frequency ladder base^(-2i/dim), as
 * transformers' DistilBERT create_sinusoidal_embeddings builds it.  Everything runs in fp64
 * (the exponent 2*floor(j/2)/dim as one fp64 division, pow, then p divided by it, then
 * sin/cos); the result is rounded to fp32, and a bf16/fp16 output is rounded from that fp32
 * value (the fp32 table cast to the dtype).  An fp64 output keeps the fp64 value.  An odd
 * dim ends with a sine column (its cosine partner would be column dim).
 *
 * Returns PE_ERR_ARG when num_positions < 0, dim < 1, num_positions * dim overflows, base is
 * not finite and positive, out_dtype is invalid, or out is NULL for a non-empty table.
 * Rows are split over nthreads OpenMP threads when the table is large.
 */
int pe_sinusoidal(int64_t num_positions, int64_t dim, double base, pe_dtype out_dtype,
                  void *out, int nthreads);

/* ---------------------------------------------------------------------------------------
 * Runtime CPU dispatch
 * ------------------------------------------------------------------------------------- */
typedef enum pe_isa {
    PE_ISA_BASELINE = 0, /* x86-64 / generic C, no extensions assumed */
    PE_ISA_AVX2 = 1,     /* AVX2 + FMA + F16C */
    PE_ISA_AVX512 = 2,   /* AVX-512 F/BW/VL/DQ + F16C */
} pe_isa;

pe_isa pe_isa_best(void);           /* the best the CPU supports */
pe_isa pe_isa_current(void);        /* the one in use */
int pe_isa_set(pe_isa isa);         /* force one (PE_ERR_ARG if the CPU lacks it) */
const char *pe_isa_name(pe_isa isa);

#ifdef __cplusplus
}
#endif

#endif /* POSENC_H */

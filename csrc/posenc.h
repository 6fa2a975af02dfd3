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
 * Arithmetic.  Each of q and k is computed in fp32, or in fp64 when that tensor (its input
 * or output) or the tables are fp64: one tensor's dtype never changes the other's result.
 * The fused path's angles and sin/cos are always fp32 (see pe_rope_source).  Products and
 * sums are not fused, and each result is rounded once, to nearest even, when it is stored
 * (an fp64 result stored to bf16/fp16 is rounded directly, not through fp32).  The
 * per-element operations are in rope_math.h.
 *
 * Memory.  Outputs must not overlap the inputs (q, k, tables, positions, inv_freq, the axis
 * map, gradients) or each other: the kernels read and write through restrict pointers, and
 * in-place calls are not supported.  Every entry point compares the byte range each tensor
 * spans (from its lowest to its highest addressed byte) and returns PE_ERR_ARG when an
 * output's range meets another range, even if the elements themselves would interleave
 * without colliding.  A size or stride whose byte offsets overflow int64 is PE_ERR_ARG too.
 *
 * Checks.  The RoPE entry points return PE_ERR_ARG, before writing anything, for: a NULL
 * args; a negative B, T, D or head count; R odd, below 2 or above D; an unknown pairing or
 * dtype; B T (Hq + Hk) D past int64; an axis_of_slot value above 2; Bc (tables) or Bp
 * (positions) other than 1 and B; a NULL pointer where data is read or written (an empty
 * problem reads none); and the overflow and overlap cases above.  They do not check what
 * the memory holds (table values, positions, inv_freq) or that it is as large as the
 * sizes and strides say.  pe_rope_apply with no token (B or T = 0) or no head is PE_OK.
 *
 * Threads.  Work is split over tokens (b, t) with OpenMP; the cos/sin row of a token is
 * prepared once and used for every head of q and k.  nthreads <= 1, or a problem below a
 * small size (a decode step), runs on the calling thread without entering an OpenMP
 * region.  SIMD code is chosen at run time for the CPU (see pe_isa_*).
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
 * Sums run in fp32, or in fp64 when the tables, the gradients or an input is fp64.
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
 * PE_ERR_ARG unless each section is in [0, n_slots] and they sum to n_slots (checked
 * without overflow for any int64 values). */
int pe_mrope_axis_map(int64_t n_slots, const int64_t sections[3], int interleaved,
                      uint8_t *axis_of_slot);

/* ---------------------------------------------------------------------------------------
 * Per-head q/k RMSNorm followed by RoPE (the attention prologue of Qwen3, Qwen3-VL,
 * Qwen3.5, Gemma 3, OLMo, ...)
 * ---------------------------------------------------------------------------------------
 * Each row x of q and k (one token, one head; D channels) is normalized over its D
 * channels, scaled by the tensor's weight w (D values) and rotated as pe_rope_apply's
 * forward does, in one pass, without writing the normalized row:
 *
 *   ss = sum of fl(x[e] * x[e]) in torch's CPU order (below);  mean = ss / D (a true
 *   division);  r = 1 / sqrt(mean + fl32(eps)) (two roundings: torch's CPU rsqrt);
 *   n[e] = x[e] * r;  y[e] by form (rnd() rounds to the tensor's dtype, the identity for
 *   fp32):
 *     PE_NORM_WEIGHT           y = rnd(w * rnd(n))          Llama / Qwen3 / Qwen3-VL
 *     PE_NORM_ONE_PLUS_WEIGHT  y = rnd(n * fl(1 + w))       Gemma 3 / Qwen3.5 / Qwen3-Next
 *     PE_NORM_WEIGHT_F32       y = rnd(w * n)               OLMo per-head (weight in fp32)
 *     PE_NORM_POW              y = rnd(n * w)               Gemma 3n / Gemma 4 (r written
 *                              as torch.pow(mean + eps, -0.5), which is 1 / sqrt on the CPU)
 *   out[e] = y[e] c[e] + sign(e) y[p(e)] s[e] for the R rotary channels (pairings as for
 *   RoPE), y[e] past R; one rounding at the store;  rstd[row] = r, except for PE_NORM_POW:
 *   rstd[row] = ms = mean + fl32(eps), from which the backward takes r again.
 *   The weights are D values of the tensors' dtype, or fp32 with weight_f32 set (16-bit
 *   tensors, every form but PE_NORM_WEIGHT: those convert the weight to fp32 anyway).
 *
 * All products and sums are fp32 and unfused for fp32 / bf16 / fp16 tensors (the forms'
 * 16-bit roundings are where transformers' norm modules round), fp64 tensors compute in
 * fp64 (eps added as given, not fl32(eps)).  The sum of squares follows torch's cascade_sum
 * over a contiguous row (SumKernel vectorized_inner_sum) with sum_lanes lanes (the width of
 * torch's Vectorized<float> in the sum kernel it runs: 8 on x86-64 for every capability, 4
 * for NEON; fp64 rows: sum_lanes / 2, Vectorized<double>'s width, at least 1):
 *     the first V = D / W whole vectors v_i of W lanes, taken 4 at a time: vector 4j + k
 *     goes into accumulator k (a cascade of 4 levels carries every 16 groups); the
 *     accumulators' levels are joined, the V % 4 vectors left over are added to
 *     accumulator 0, then ((a0 + a1) + a2) + a3; the result's lanes are then added in
 *     order to the sum of the D % W tail values (from 0.0, in order).  D < W: W = 1.
 * Which elements are NaN is part of the result; a NaN's sign and payload are not (which
 * operand's NaN an operation passes on varies between the SIMD variants).
 *
 * Backward (pe_qk_norm_rope_backward), with g the gradient of out and x, r as saved: the
 * same steps autograd runs through transformers' norm and the rotation, rounded where
 * autograd rounds:
 *   gy = the transpose rotation of g (pe_rope_apply's), rounded to the dtype;
 *   PE_NORM_WEIGHT           gn = rnd(gy * w),           wprod = rnd(gy * rnd(n))
 *   PE_NORM_ONE_PLUS_WEIGHT  gn = gy * fl(1 + w),        wprod = gy * n   (fp32)
 *   PE_NORM_WEIGHT_F32       gn = gy * w,                wprod = gy * n   (fp32)
 *   PE_NORM_POW              gn = gy * w,                wprod = gy * n   (fp32)
 *   gr = sum of fl(gn[e] * x[e]) (the forward's order);  gv = fl(-0.5 gr) * ((r r) r)
 *   (rsqrt's backward), for PE_NORM_POW gv = gr * fl(-0.5 P) with P = ms^-1.5 (pow's
 *   backward) given per row in ms_pow by the caller (torch's own pow kernel rounds it; its
 *   vector and scalar paths differ, so it is not recomputed here);
 *   dx[e] = rnd(gn[e] r + (gv / D) (2 x[e])).
 * The weight gradient is the sum of wprod over rows, in the order of torch's CPU sum over
 * the rows of autograd's product (laid out contiguous in q's shape: (B, H, T, D) rows when
 * heads_first, else (B, T, H, D) rows; N rows of D columns), which autograd calls:
 *   - fp32 / bf16 / fp16 tensors: computed here, into wgrad (D values of wprod's dtype:
 *     the tensors' dtype for PE_NORM_WEIGHT, else fp32), without writing wprod.  Each
 *     column c is a sum in fp32, by one of two orders, chosen per column as torch's
 *     cascade_sum chooses (vectorized_outer_sum / scalar_outer_sum) for the columns that
 *     torch's parallel_dim_reduction gives each of sum_threads threads (chunks of
 *     ceil(D / threads) columns, their ends rounded down to 128 bytes of wprod, the last
 *     end kept; one chunk of D when N D < 32768 or one thread); with L = sum_lanes and
 *     V = L (fp32 wprod) or 2 L (16-bit) columns per vector, a chunk of w columns takes
 *     "plain" for its leading whole blocks of 4 L columns when w >= V (else its leading
 *     whole groups of 4 columns), "lanes" for the rest:
 *       plain: multi_row_sum over the N rows (4 levels, a level carries every 2^p items,
 *              p = max(4, ceil_log2(N) / 4));
 *       lanes: row_sum: row i into lane i % 4, multi_row_sum over the N / 4 groups (p from
 *              N / 4), the N % 4 rows left over added in order to lane 0, then
 *              ((l0 + l1) + l2) + l3.
 *     wgrad[c] = 0 + that sum, rounded to wprod's dtype as c10 rounds a float (to nearest
 *     even; a NaN becomes the canonical 0x7fc0 / sign | 0x7e00).
 *   - fp64 tensors: wprod is written (B, T, H) rows at wprod_stride, in fp64, and the
 *     caller leaves the sum to torch.
 *
 * Shapes: q (B, T, Hq, D), k (B, T, Hk, D), any strides with unit channel stride; tables
 * cos, sin (Bc, T, R), Bc in {1, B}, unit channel stride, of the tensors' dtype; weights
 * D contiguous values (above); rstd and ms_pow (B, T, H) fp32 (fp64 for fp64) with the given
 * strides.  Outputs must not overlap inputs.  PE_ERR_ARG for sizes out of range (as for
 * RoPE), an unknown form, dtype or pairing, sum_lanes not in {1, 4, 8, 16}, weight_f32 with
 * fp64 tensors or with 16-bit ones and PE_NORM_WEIGHT, or a NULL pointer where data is read
 * or written; sum_threads < 1 in a backward of 16-bit or fp32 tensors.
 * Threads take blocks of tokens (forward) or of rows in wprod's order (backward; with
 * heads_first, x and grad lying token by token in memory and T a multiple of the sums'
 * blocks of rows, tiles of tokens whose rows go token by token: the same sums).
 */
typedef enum pe_norm_form {
    PE_NORM_WEIGHT = 0,
    PE_NORM_ONE_PLUS_WEIGHT = 1,
    PE_NORM_WEIGHT_F32 = 2,
    PE_NORM_POW = 3,
} pe_norm_form;

/* One normalized and rotated tensor (q or k); strides are (b, t, h) in elements. */
typedef struct pe_qk_norm_tensor {
    int64_t heads;
    const void *x;       int64_t x_stride[3];
    const void *weight;  /* D values */
    void *out;           int64_t out_stride[3];    /* forward: the result; backward: dx */
    void *rstd;          int64_t rstd_stride[3];   /* forward: written; backward: read */
    const void *grad;    int64_t grad_stride[3];   /* backward: gradient of the result */
    void *wprod;         int64_t wprod_stride[3];  /* backward, fp64: weight-gradient products */
    void *wgrad;         /* backward, fp32 / bf16 / fp16: D values, the products' sum */
    const void *ms_pow;  int64_t ms_pow_stride[3]; /* backward, PE_NORM_POW: ms^-1.5 */
} pe_qk_norm_tensor;

typedef struct pe_qk_norm_args {
    int64_t batch, seq, head_dim, rot_dim; /* B, T, D, R */
    pe_pairing pairing;
    pe_norm_form form;
    pe_dtype dtype;            /* q, k, weights, tables, outputs, gradients */
    int weight_f32;            /* the weights are fp32 (16-bit tensors, not PE_NORM_WEIGHT) */
    double eps;
    int sum_lanes;
    const void *cos, *sin;
    int64_t table_batch;       /* Bc */
    int64_t table_stride[2];   /* b, t */
    pe_qk_norm_tensor q, k;    /* k.heads may be 0 */
    int nthreads;
    int sum_threads;           /* backward: the threads torch's sum of wprod would run on */
    int heads_first;           /* backward: wprod's rows are (B, H, T) (else (B, T, H)) */
} pe_qk_norm_args;

int pe_qk_norm_rope(const pe_qk_norm_args *a);
int pe_qk_norm_rope_backward(const pe_qk_norm_args *a);

/* ---------------------------------------------------------------------------------------
 * Position ids for multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and the vision tower
 * ---------------------------------------------------------------------------------------
 * pe_mrope_position_ids computes what transformers' get_rope_index of each model computes:
 * position ids (3, B, L) (rows T, H, W) for a batch of tokens, and one delta per batch row
 * for decoding.  Two rule sets, chosen by `rules` (the zero value is the first):
 *
 *   PE_MROPE_RULES_4_57  transformers 4.57: vision items are found in input_ids (a
 *                        placeholder token right after vision_start_token_id); text after
 *                        an item resumes at the item's largest position + 1; masked slots
 *                        hold 1; deltas[b] = max + 1 - L (L the padded length).
 *   PE_MROPE_RULES_5     transformers 5.x (checked: 5.17.0, 5.18.0, 5.24.0): vision items
 *                        are the runs of mm_token_type_ids (0 text, 1 image, 2 video; input
 *                        ids are not read); text after an item resumes at the item's start
 *                        + max(h/m, w/m) (its frames do not count); masked slots hold 0;
 *                        deltas[b] = max + 1 - (number of kept tokens of row b).
 *
 * Grids are patch grids before merging, one (t, h, w) row per image or video, in the
 * order the images / videos appear in the batch (row 0 first, left to right).  With merge
 * size m an image or video covers an LLM grid (t, h/m, w/m), i.e. t*(h/m)*(w/m) tokens.
 * Qwen3-VL splits each video grid (t, h, w) into t frame grids (1, h, w): every frame is its
 * own item (its own vision start, or its own run of type 2).
 *
 * Per batch row, over the tokens kept by the mask (attention_mask == 1; all tokens when
 * there is no mask), with next = 0:
 *   - an item starts (4.57) at a placeholder token (image_token_id or video_token_id) whose
 *     preceding kept token is vision_start_token_id, or (5.x) at a kept token of type 1 or
 *     2 whose preceding kept token has another type; it takes the next unused grid of its
 *     kind and covers n = t*(h/m)*(w/m) tokens, which must all be that placeholder (that
 *     type);
 *   - a text token (anything else; vision-start/-end included) gets next on all three
 *     rows, then next += 1;
 *   - the k-th token of an item, k = (ti*(h/m) + hi)*(w/m) + wi, gets
 *         T = next + tidx(ti),  H = next + hi,  W = next + wi,
 *     and after the item next += max(tidx(t-1), h/m - 1, w/m - 1) + 1 (4.57) or
 *     next += max(h/m, w/m) (5.x);
 *   - 4.57: masked slots get 1, deltas[b] = next - L;  5.x: masked slots get 0, deltas[b] =
 *     (largest position of the row) + 1 - (kept tokens).  A row with no kept token gets
 *     delta 0 (transformers raises there).
 * Temporal index tidx (the frame index ti in every case not listed):
 *   QWEN2_5_VL, 4.57, images: 0.
 *   QWEN2_5_VL videos: by time_rule from s = second_per_grid_ts[video] (1 when the array
 *     is NULL) and tps = tokens_per_second; fl32() rounds to float, trunc() toward zero:
 *     PE_TIME_F64            trunc((ti * s) * tps) in double (the zero value);
 *     PE_TIME_TRUNC_SECONDS  ti * trunc(s) * tps, exact in integers when tps is integral,
 *                            else trunc(fl32(fl32(ti * trunc(s)) * fl32(tps)))
 *                            (4.57 casts s to int64; 5.17 multiplies tps by int(s));
 *     PE_TIME_F32            trunc(fl32(fl32(ti) * fl32(fl32(tps) * fl32(s))))  (5.18 and
 *                            later with float32 second_per_grid_ts: the fraction is kept);
 *     PE_TIME_F64_INTERVAL   trunc(ti * (tps * s)) in double (5.18 and later, float64 s).
 *   QWEN3_VL video frames: t = 1, so 0 (time is in the timestamp text around the frames).
 *
 * Without grids (has_grids == 0: both grid lists absent) every row gets text positions:
 * with a mask cumsum(mask) - 1 on kept tokens, masked slots 1 (4.57) or 0 (5.x), deltas[b]
 * = max(row, masked slots included) + 1 - L (4.57) or 0 (5.x); without a mask 0..L-1 and
 * deltas 0.  A row that contains a vision item is then an error (PE_POS_NO_GRIDS).
 *
 * Example 1 (Qwen2-VL, m = 2; ids x, VS, I, I, I, I, VE, y; image grid (1, 4, 4); types
 *   0 0 1 1 1 1 0 0 for 5.x, which gives the same ids here):
 *      index  0 1 2 3 4 5 6 7
 *      T      0 1 2 2 2 2 4 5
 *      H      0 1 2 2 3 3 4 5
 *      W      0 1 2 3 2 3 4 5        deltas = 6 - 8 = -2
 * Example 2 (Qwen2.5-VL, 4.57, video grid (3, 4, 4), s = 2.0, tokens_per_second = 2;
 *   ids x, VS, V x12, VE, y):  T = 0 1 | 2 2 2 2 6 6 6 6 10 10 10 10 | 11 12,
 *   H = 0 1 | 2 2 3 3 (x3) | 11 12,  W = 0 1 | 2 3 2 3 (x3) | 11 12,  deltas = 13 - 16 = -3.
 *   5.x: the same vision block, then the text resumes at 2 + max(2, 2) = 4: ... | 4 5 on
 *   all rows, deltas = 11 - 16 = -5.
 * Example 3 (Qwen3-VL, video grid (2, 4, 4), three timestamp tokens before each frame;
 *   ids a b c VS V V V V VE d e f VS V V V V VE), 4.57 and 5.x alike:
 *      T  0 1 2 3 | 4 4 4 4 | 6 7 8 9 10 | 11 11 11 11 | 13
 *      H  0 1 2 3 | 4 4 5 5 | 6 7 8 9 10 | 11 11 12 12 | 13
 *      W  0 1 2 3 | 4 5 4 5 | 6 7 8 9 10 | 11 12 11 12 | 13     deltas = 14 - 18 = -4
 * Example 4 (left padding, mask 0 0 1 1 1 1 1 1 1 1 on ids p p x VS I I I I VE y, grid
 *   (1, 4, 4)): 4.57 T = 1 1 | 0 1 2 2 2 2 4 5 (H, W likewise), deltas = 6 - 10 = -4;
 *   5.x T = 0 0 | 0 1 2 2 2 2 4 5, deltas = 6 - 8 = -2.
 * Example 5 (Qwen2-VL, ids x VS V V V V VE y, video grid (4, 2, 2): 4 frames of one token):
 *   4.57: T = 0 1 2 3 4 5 6 7, H = W = 0 1 2 2 2 2 6 7, deltas 0;
 *   5.x:  T = 0 1 2 3 4 5 3 4, H = W = 0 1 2 2 2 2 3 4, deltas = 6 - 8 = -2.
 * Example 6 (Qwen2.5-VL video (3, 2, 2), tokens_per_second = 2): s = 0.5 gives tidx
 *   0 0 0 under PE_TIME_TRUNC_SECONDS and 0 1 2 under PE_TIME_F32 and PE_TIME_F64;
 *   tokens_per_second = 25, s = 2/3 (t = 8) gives tidx 0 16 33 50 66 83 100 116 under F32
 *   (fl32(25 * fl32(2/3)) = 16.666668) and 0 16 33 49 66 83 99 116 under F64_INTERVAL.
 *
 * Everything that makes the grids disagree with the tokens is PE_ERR_GRID, never a silent
 * misplacement: a grid value <= 0 or h, w not divisible by m; more or fewer vision items
 * in the batch than grids (Qwen3-VL: than frames); an item whose run is shorter than its n
 * tokens (the row or run ends early); a placeholder token (5.x: a token of type 1 or 2)
 * outside every item (a run longer than its grid, or no vision start before it);
 * second_per_grid_ts negative, above 2^31, not finite, or giving a temporal index of 2^31
 * or more.  Arguments out of range (sizes, merge size < 1, 4.57 token ids negative or
 * equal, a mask value other than 0 or 1, a kept token type other than 0, 1, 2, no
 * mm_token_type_ids for 5.x with grids, tokens_per_second negative or not finite, or above
 * FLT_MAX under PE_TIME_F32, an unknown rules or time_rule) are PE_ERR_ARG.  err (may be
 * NULL) receives what went wrong: mask and type values, then grid values, then the grid
 * count, then the problem of the lowest batch row (the first in that row).
 * ------------------------------------------------------------------------------------- */
typedef enum pe_mrope_model {
    PE_MROPE_QWEN2_VL = 0,
    PE_MROPE_QWEN2_5_VL = 1,
    PE_MROPE_QWEN3_VL = 2,
} pe_mrope_model;

typedef enum pe_mrope_rules {
    PE_MROPE_RULES_4_57 = 0, /* vision start + placeholder tokens (transformers 4.57) */
    PE_MROPE_RULES_5 = 1,    /* runs of mm_token_type_ids (transformers 5.x) */
} pe_mrope_rules;

typedef enum pe_mrope_time {
    PE_TIME_F64 = 0,
    PE_TIME_TRUNC_SECONDS = 1,
    PE_TIME_F32 = 2,
    PE_TIME_F64_INTERVAL = 3,
} pe_mrope_time;

typedef enum pe_pos_problem {
    PE_POS_NONE = 0,
    PE_POS_BAD_ARG,      /* sizes, ids, merge size, tokens_per_second (status PE_ERR_ARG) */
    PE_POS_BAD_MASK,     /* attention_mask[row, token] is neither 0 nor 1 (PE_ERR_ARG) */
    PE_POS_BAD_GRID,     /* grid row `grid` has a value <= 0, or h or w % m != 0 */
    PE_POS_BAD_SECONDS,  /* second_per_grid_ts[grid] is negative, not finite or too large */
    PE_POS_GRID_COUNT,   /* `found` vision items in the batch, `expected` grids (or frames) */
    PE_POS_NO_GRIDS,     /* a vision item at (row, token) but no grids were given */
    PE_POS_SHORT_RUN,    /* item at (row, token) of grid `grid` needs `expected` placeholder
                            tokens, the run has `found` */
    PE_POS_STRAY_TOKEN,  /* placeholder token at (row, token) belongs to no item */
    PE_POS_BAD_TYPE,     /* mm_token_type_ids[row, token] (kept) is `found`, not 0, 1 or 2
                            (PE_ERR_ARG) */
    /* packed rows (pe_mrope_packed_position_ids) only: */
    PE_POS_BAD_LENGTH,   /* example `example` of row `row` has `found` tokens: negative, or
                            more than the `expected` left in the row (PE_ERR_ARG) */
    PE_POS_CUT_RUN,      /* the item at (row, token) of grid `grid` needs `expected` tokens;
                            `found` are in its example, the run goes on past its end */
    /* vision towers only: */
    PE_POS_BAD_MERGE,    /* the merge size of grid `grid` is `found`, below 1 */
    PE_POS_INT32_OVERFLOW, /* the int32 boundaries pass 2^31 - 1 at grid `grid` */
} pe_pos_problem;

typedef struct pe_pos_error {
    pe_pos_problem problem;
    int video;          /* 1: the grid / item is a video (video_grid_thw), 0: an image */
    int64_t grid;       /* row of image_grid_thw or video_grid_thw, or -1 */
    int64_t frame;      /* Qwen3-VL: frame of that video, else -1 */
    int64_t row, token; /* batch row and token index (padded), or -1 */
    int64_t expected, found;
    int64_t example;    /* packed rows: the example at fault (numbered across the batch), or -1 */
} pe_pos_error;

typedef struct pe_mrope_args {
    int64_t batch, seq;                /* B, L */
    const int64_t *input_ids;          /* (B, L), unit stride along L; 5.x: not read */
    int64_t ids_row_stride;
    const int64_t *attention_mask;     /* (B, L) of 0/1, unit stride along L; NULL: all 1 */
    int64_t mask_row_stride;
    int has_grids;                     /* 0: no grid lists at all (see above) */
    const int64_t *image_grid_thw;     /* (n_images, 3) contiguous; NULL when n_images = 0 */
    int64_t n_images;
    const int64_t *video_grid_thw;     /* (n_videos, 3) contiguous; NULL when n_videos = 0 */
    int64_t n_videos;
    const double *second_per_grid_ts;  /* n_videos values or NULL; QWEN2_5_VL only */
    pe_mrope_model model;
    int64_t image_token_id, video_token_id, vision_start_token_id; /* 4.57 rules only */
    int64_t spatial_merge_size;        /* m >= 1 */
    double tokens_per_second;          /* QWEN2_5_VL only */
    int nthreads;
    /* Added for transformers 5.x; all zero means the 4.57 rules above. */
    pe_mrope_rules rules;
    const int64_t *mm_token_type_ids;  /* (B, L), unit stride along L; 5.x rules only */
    int64_t types_row_stride;
    pe_mrope_time time_rule;           /* QWEN2_5_VL videos */
} pe_mrope_args;

/* position_ids: (3, B, L) dense int64; deltas: (B,) int64.  Rows are independent; batches
 * of 2^18 tokens or more run them on up to nthreads threads (the grids of a row start
 * after those used by earlier rows, found by a first counting pass).  PE_OK, PE_ERR_ARG,
 * PE_ERR_GRID or PE_ERR_NOMEM. */
int pe_mrope_position_ids(const pe_mrope_args *a, int64_t *position_ids, int64_t *deltas,
                          pe_pos_error *err);

/*
 * Packed rows (padding-free batches): several examples laid end to end in each row of
 * input_ids, each given the ids it would get alone.  Row b holds row_examples[b] examples;
 * numbering them across the batch (row 0 first, left to right), example e has
 * example_lens[e] >= 0 tokens and starts where the previous example of its row ends (the
 * first at token 0).  Tokens of a row after its last example are padding.
 *
 * position_ids: (4, B, L) dense int64.  For token k (0-based) of an example:
 *   row 0      k: the text positions, restarting at 0 in each example;
 *   rows 1..3  T, H, W of pe_mrope_position_ids run on that example alone (one row of
 *              example_lens[e] tokens, no mask) under the same rules.
 * The P padding tokens after a row's last example get 0 .. P-1 on all four rows: they form
 * one more sequence (a text-only example), so anything that splits a row where the text
 * position does not grow by one, or where it is 0, never joins them to an example.
 *
 * Example (Qwen2-VL, m = 2; one row of L = 14: the tokens of Example 1 above, a one-token
 *   example, a text example of two tokens, three padding slots; example_lens 8 1 2):
 *      row 0 (text)  0 1 2 3 4 5 6 7 | 0 | 0 1 | 0 1 2
 *      T             0 1 2 2 2 2 4 5 | 0 | 0 1 | 0 1 2
 *      H             0 1 2 2 3 3 4 5 | 0 | 0 1 | 0 1 2
 *      W             0 1 2 3 2 3 4 5 | 0 | 0 1 | 0 1 2
 *
 * Grids (and second_per_grid_ts) are taken in example order, the order their items appear
 * in the batch, as for pe_mrope_position_ids.  a->attention_mask must be NULL; everything
 * else in a is read as there; no deltas are computed.  Examples run on up to nthreads
 * threads from 2^18 tokens on.
 *
 * example_grids (may be NULL): (n_examples, 2) contiguous, the image grids and the video
 * grids of each example (rows of image_grid_thw / video_grid_thw; Qwen3-VL: video grids,
 * not frames), summing to n_images and n_videos.  With it every example owns its grids:
 * its items must be exactly as many as its grids (frames), checked for every example
 * before any is walked, so an error names the example whose grids are at fault rather
 * than a later one that a shifted grid lands on.  Without it the grids are handed out in
 * order and only their total is checked.
 *
 * Errors are those of pe_mrope_position_ids, with err->example the example at fault (the
 * lowest one) and err->token its position in the padded row, plus:
 *   PE_POS_BAD_LENGTH (PE_ERR_ARG)  a negative length, or examples that need more than L
 *                                   tokens in their row;
 *   PE_POS_CUT_RUN (PE_ERR_GRID)    an item still open at its example's end, whose run goes
 *                                   on in the next token of the row (a vision run cut by
 *                                   an example boundary);
 *   PE_POS_GRID_COUNT               with example >= 0 and example_grids: that example has
 *                                   `found` items of the kind (images first) and owns
 *                                   `expected` grids (frames); without example_grids: an
 *                                   item of that example finds no grid left (found = items
 *                                   up to it, expected = grids), or with example -1, grids
 *                                   are left over after the last example;
 *   PE_POS_BAD_GRID, PE_POS_BAD_SECONDS  with example_grids, example is the grid's owner.
 * n_examples < 0, row_examples negative or not summing to n_examples, example_grids
 * negative or not summing to the grid counts, a mask, or 4*B*L overflowing int64 are
 * PE_ERR_ARG (PE_POS_BAD_ARG).
 */
int pe_mrope_packed_position_ids(const pe_mrope_args *a, int64_t n_examples,
                                 const int64_t *example_lens, const int64_t *row_examples,
                                 const int64_t *example_grids, int64_t *position_ids,
                                 pe_pos_error *err);

/* ---------------------------------------------------------------------------------------
 * Vision towers: patch position ids, attention boundaries, window order, interpolation taps
 * ---------------------------------------------------------------------------------------
 * The vision encoders of the Qwen-VL family (and the models built like them) derive these
 * from the patch grids alone; transformers 5.x computes them in vision_utils.py, 4.57 in
 * the vision models' methods.  Each function walks a whole batch of grids in one call.
 *
 * Grids.  n rows (t, h, w) of patch counts before merging, one per image or video, in the
 * order their patches are laid end to end; grid i has a spatial merge size m_i (one value
 * for all grids, or one per grid): its LLM grid is (t, h/m_i, w/m_i).  Valid grids have
 * t, h, w >= 1, h and w divisible by m_i, m_i >= 1, and the sums over the batch below
 * 2^62; otherwise PE_ERR_GRID with err->grid the first row at fault (PE_POS_BAD_GRID, or
 * PE_POS_BAD_MERGE for m_i < 1).  Where a function reads no merge size it checks none.
 *
 * Patch order (every per-patch output).  Grid by grid, frame by frame (frame f of grid i
 * starts at patch offset(i) + f*h*w), and within a frame the (h/m) x (w/m) merge blocks
 * row-major, within a block its m x m patches row-major: patch k of a frame,
 *     k = ((bh * (w/m) + bw) * m + ih) * m + iw,   lies at   row = bh*m + ih, col = bw*m + iw.
 * With m = 1 this is raster order.  Example, frame (h, w) = (4, 4), m = 2:
 *     k    0     1     2     3     4     5     6     7     8     9    ...  15
 *     at  (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3) (2,0) (2,1) ... (3,3)
 *
 * Threads.  The per-patch walks split the grids over up to nthreads OpenMP threads (one
 * grid at a time) when the batch has 2^18 patches or more; nthreads <= 1 runs serially.
 * Every frame of a grid after the first is a copy of the first.  Outputs must not overlap
 * the inputs.  Status: PE_OK, PE_ERR_ARG (err->problem PE_POS_BAD_ARG: a NULL pointer, an
 * output size that is not the one the grids give, an option out of range), PE_ERR_GRID or
 * PE_ERR_NOMEM.
 * ------------------------------------------------------------------------------------- */
typedef struct pe_vision_grids {
    int64_t n;              /* number of grids, >= 0 */
    const int64_t *thw;     /* (n, 3) contiguous; may be NULL when n = 0 */
    const int64_t *merge;   /* (n,) merge size per grid, or NULL: merge_size for every grid */
    int64_t merge_size;
} pe_vision_grids;

/* Sizes of a batch of grids (pe_vision_sizes_of). */
typedef struct pe_vision_sizes {
    int64_t patches;   /* sum of t*h*w: rows of the per-patch outputs */
    int64_t frames;    /* sum of t: attention segments of per-frame cu_seqlens */
    int64_t tokens;    /* sum of t*(h/m)*(w/m): merged tokens (window index entries) */
} pe_vision_sizes;

/* Checks the grids (merge sizes included) and sums their sizes. */
int pe_vision_sizes_of(const pe_vision_grids *g, pe_vision_sizes *sizes, pe_pos_error *err);

/*
 * Position ids (transformers' get_vision_position_ids): one row per patch in patch order,
 * (row, col) with columns = 2, (frame, row, col) with columns = 3 (include_temporal).
 *   grid (1, 4, 4), m = 2, columns 2:  (0,0) (0,1) (1,0) (1,1) | (0,2) (0,3) (1,2) (1,3) |
 *                                      (2,0) (2,1) (3,0) (3,1) | (2,2) (2,3) (3,2) (3,3)
 *   grid (2, 2, 4), m = 2, columns 3:  (0,0,0) (0,0,1) (0,1,0) (0,1,1) (0,0,2) (0,0,3)
 *                                      (0,1,2) (0,1,3), then the same with frame 1.
 * out: (patches, columns) dense int64; patches must equal the grids' patch count.
 */
int pe_vision_positions(const pe_vision_grids *g, int columns, int64_t *out, int64_t patches,
                        int nthreads, pe_pos_error *err);

/*
 * Attention boundaries (get_vision_cu_seqlens / get_vision_attention_seqlens): the
 * cumulative lengths of the attention segments, starting at 0, as int32, and the longest
 * segment.  Per frame (merge_temporal = 0) every frame of every grid is a segment of h*w
 * patches (Qwen2-VL, GLM-4V, ...); with merge_temporal = 1 every grid is one segment of
 * t*h*w (Kimi-K2.5).
 *   grids (2, 4, 4), (1, 2, 6):  per frame  cu = 0 16 32 44, max 16;
 *                                per clip   cu = 0 32 44,    max 32.
 * cu: n_cu = frames + 1 (per frame) or n + 1 (per clip) entries; *max_seqlen gets the
 * largest segment (0 without grids).  Merge sizes are not read.  A total past 2^31 - 1
 * (what int32 holds) is PE_ERR_GRID with PE_POS_INT32_OVERFLOW, err->grid the row where
 * the sum passes it.
 */
int pe_vision_cu_seqlens(const pe_vision_grids *g, int merge_temporal, int32_t *cu, int64_t n_cu,
                         int64_t *max_seqlen, pe_pos_error *err);

/*
 * Window order (Qwen2.5-VL's get_vision_window_index / get_window_index): the window
 * attention layers see the merged tokens window by window.  With ws = window_size / m /
 * patch_size (integer division; ws >= 1 else PE_ERR_ARG), each frame's LLM grid
 * (h/m) x (w/m) is cut into ws x ws windows from the top left corner; windows are taken
 * row-major, and the tokens of a window row-major.  index lists, for each position of that
 * order, the merged token (numbered across the batch in patch order: grid by grid, frame
 * by frame, row-major in the LLM grid) that goes there.  cu_window is 0 followed by the
 * cumulative patch counts (tokens * m^2) of the windows.  transformers pads the LLM grid
 * to whole windows plus one more window row and column, always, which leaves windows
 * without a token, and then drops the repeated boundaries those give
 * (torch.unique_consecutive): so cu_window holds exactly one entry per window that has a
 * token, ceil((h/m)/ws) * ceil((w/m)/ws) of them per frame.
 *   grid (1, 8, 12), m = 2, window_size 112, patch_size 14: ws = 4, LLM grid 4 x 6, two
 *   windows: index = 0 1 2 3 6 7 8 9 12 13 14 15 18 19 20 21 | 4 5 10 11 16 17 22 23,
 *   cu_window = 0 64 96.
 *   grids (1, 8, 8), (2, 4, 6), same sizes: LLM grids 4 x 4 (one window: its padding
 *   windows are empty) and 2 x 3 twice: index = 0 .. 27 in order, cu_window = 0 64 88 112.
 * pe_vision_window_sizes checks the grids and gives tokens (sum of t*(h/m)*(w/m)) and
 * windows (non-empty windows); pe_vision_window_index writes index (tokens,) int64 and
 * cu_window (windows + 1,) int32.  A patch total past 2^31 - 1 is PE_POS_INT32_OVERFLOW.
 */
int pe_vision_window_sizes(const pe_vision_grids *g, int64_t window_size, int64_t patch_size,
                           int64_t *tokens, int64_t *windows, pe_pos_error *err);
int pe_vision_window_index(const pe_vision_grids *g, int64_t window_size, int64_t patch_size,
                           int64_t *index, int64_t tokens, int32_t *cu_window, int64_t windows,
                           int nthreads, pe_pos_error *err);

/*
 * Interpolated position embeddings (get_vision_interpolation_indices_and_weights; 4.57:
 * Qwen3-VL's fast_pos_embed_interpolate): a learned square table of side S x S (flattened,
 * entry r*S + c) is resampled to each grid's h x w, for every patch in patch order, as
 * `taps` table indices and fp32 weights (the embedding is sum_k weights[k] *
 * table[indices[k]]).  The two axes are separable: with per-axis taps a[0..n-1] (weights
 * u[]) for the patch's row and b[0..n-1] (weights v[]) for its column, n = 2 (bilinear) or
 * 4 (bicubic), tap k = i*n + j is
 *     indices[k] = a[i] * S + b[j],      weights[k] = fl32(u[i] * v[j]),
 * so taps = n*n (4 or 16).
 *
 * One axis of length L (h for rows, w for columns), target x (row or col), all fp32 with
 * one rounding per operation, in this order (PE_INTERP_RULES_5, transformers 5.x):
 *     src  = align_corners ? (x * (S-1)) / max(L-1, 1)  :  ((x + 0.5) * S) / L - 0.5
 *     f    = floor(src);  offsets o = 0, 1 (bilinear) or -1, 0, 1, 2 (bicubic)
 *     raw  = f + o;  tap = clamp(raw, 0, S-1)
 *     d    = |(src - f) - o|
 *     bilinear  weight = max(1 - d, 0)
 *     bicubic   (Keys, a = -0.75)  weight = d <= 1 ? ((1.25 d - 2.25) d) d + 1
 *                                              : ((-0.75 d + 3.75) d - 6) d + 3
 *     padding PE_INTERP_ZEROS: weight * (raw in [0, S-1] ? 1 : 0)  (border: as is)
 * PE_INTERP_LINSPACE (4.57, bilinear with align_corners and border padding only): src is
 * torch.linspace(0, S-1, L)[x] in fp32, step = fl32((S-1) / (L-1)), src = fl32(step * x)
 * for x < L/2 and fl32(S-1 - step * (L-1-x)) with one rounding (torch's kernels on AVX2 /
 * AVX-512 CPUs) above, src = 0 when L = 1; PE_INTERP_LINSPACE_TWO_ROUNDINGS rounds the
 * product first (torch's portable kernel).  Then f = trunc(src), taps f and min(f+1, S-1),
 * d = src - f, weights 1 - d and d.
 *
 * Example (S = 2, grid (1, 2, 3), m = 1, bilinear, align_corners = 0): the rows have src 0
 * and 1 (taps 0 1 / 1 1, weights 1 0), the columns src -1/6, 1/2, 7/6 (taps 0 0 / 0 1 /
 * 1 1, weights 1/6 5/6 | 1/2 1/2 | 5/6 1/6, in fp32 0.16666663 0.83333337 ...):
 *     patch (0,0): indices 0 0 2 2, weights 0.16666663 0.83333337 0 0
 *     patch (0,1): indices 0 1 2 3, weights 0.5 0.5 0 0
 *     patch (1,2): indices 3 3 3 3, weights 0.83333337 0.16666663 0 0
 * With PE_INTERP_ZEROS patch (0,0) becomes weights 0 0.83333337 0 0 (its tap -1 is
 * outside the table).
 *
 * indices (patches, taps) int64 and weights (patches, taps) fp32, dense; patches must be
 * the grids' patch count.  PE_ERR_ARG for S outside [1, 2^31 - 1], an unknown mode,
 * padding or rule, or a LINSPACE rule with anything but bilinear, align_corners, border.
 */
typedef enum pe_interp_mode {
    PE_INTERP_BILINEAR = 0,
    PE_INTERP_BICUBIC = 1,
} pe_interp_mode;

typedef enum pe_interp_padding {
    PE_INTERP_BORDER = 0, /* out-of-table taps clamped to the edge (F.interpolate) */
    PE_INTERP_ZEROS = 1,  /* out-of-table taps weigh 0 (F.grid_sample padding_mode="zeros") */
} pe_interp_padding;

typedef enum pe_interp_rule {
    PE_INTERP_RULES_5 = 0,                /* transformers 5.x closed form */
    PE_INTERP_LINSPACE = 1,               /* 4.57, torch.linspace with one rounding */
    PE_INTERP_LINSPACE_TWO_ROUNDINGS = 2, /* 4.57, torch.linspace rounding twice */
} pe_interp_rule;

typedef struct pe_vision_interp {
    int64_t side;                /* S: num_grid_per_side */
    pe_interp_mode mode;
    int align_corners;
    pe_interp_padding padding;
    pe_interp_rule rule;
} pe_vision_interp;

int pe_vision_interpolation(const pe_vision_grids *g, const pe_vision_interp *p, int64_t *indices,
                            float *weights, int64_t patches, int nthreads, pe_pos_error *err);

/*
 * Nearest-neighbour position ids (get_vision_nearest_position_ids, NaViT-style packers such
 * as MiniCPM-V): for images of (h, w) patches (sizes: (n, 2) contiguous, h, w >= 1) and a
 * learned side x side table, one flat table index per patch in raster order, image by
 * image.  Coordinate y/h of row y (fp32 division) falls in bucket
 *     bucket(c) = number of boundaries <= c,
 * the boundaries being torch.arange(1/side, 1.0, 1/side) in fp32 as torch's CPU kernel
 * computes it: with s = 1/side in double, ceil((1 - s) / s) values; value j is
 * fl32(s + s*j) (in double, then rounded), except in the blocks of 16 from the start,
 * each two runs of 8 from a base b = fl32(s + s*j0): fl32(b + k*s), k = 0 .. 7.  Likewise
 * for the columns; the patch gets bucket(y/h) * side + bucket(x/w).
 *   image (2, 3), side 4 (boundaries 0.25 0.5 0.75):  0 1 2 8 9 10.
 * pe_vision_nearest_count gives the patch count (sum of h*w), PE_ERR_GRID with
 * PE_POS_BAD_GRID for a size < 1; out: (total,) int64.  side >= 1 (else PE_ERR_ARG).
 */
int pe_vision_nearest_count(int64_t n, const int64_t *sizes, int64_t *total, pe_pos_error *err);
int pe_vision_nearest_position_ids(int64_t n, const int64_t *sizes, int64_t side, int64_t *out,
                                   int64_t total, int nthreads, pe_pos_error *err);

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
    PE_ISA_BASELINE = 0, /* the target's baseline (x86-64, aarch64 with NEON, ...): the only
                            variant built off x86-64 */
    PE_ISA_AVX2 = 1,     /* AVX2 + FMA + F16C */
    PE_ISA_AVX512 = 2,   /* AVX-512 F/BW/VL/DQ + F16C */
    PE_ISA_AVX512_BF16 = 3, /* the above + AVX512_BF16: bf16 rounded by the hardware (the same
                               bits; software where they would differ) */
} pe_isa;

pe_isa pe_isa_best(void);           /* the best the CPU supports */
pe_isa pe_isa_current(void);        /* the one in use */
int pe_isa_set(pe_isa isa);         /* force one (PE_ERR_ARG if the CPU lacks it) */
const char *pe_isa_name(pe_isa isa);

#ifdef __cplusplus
}
#endif

#endif /* POSENC_H */

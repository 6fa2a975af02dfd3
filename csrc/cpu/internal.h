/* Internal helpers shared by the kernel files: sizes, tuning constants, per-ISA entry points
 * (the per-element conversions and arithmetic are in rope_math.h). */
#ifndef POSENC_INTERNAL_H
#define POSENC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "posenc.h"
#include "rope_math.h"

/* Problems below this many elements run on one thread: waking a team costs more than
 * it saves on a memory-bound pass this small (a decode step, B = 8 and T = 1 with
 * Qwen2-VL-7B's 32 heads x 128, is 2^15 elements), and a busy machine can delay the
 * other threads by far longer than the whole call. */
#define PE_SERIAL_ELEMENTS ((int64_t)1 << 17)

/* A pass on the calling thread takes its scratch from the stack up to this many bytes
 * (a decode step's: 8 tokens of head_dim 128 need 23 KiB), from malloc above: a call that
 * rotates a few rows would otherwise spend a good part of its time allocating. */
#define PE_STACK_SCRATCH ((size_t)32 << 10)

/* Outputs of this many bytes and more (q's and k's together), already in memory, are
 * written with streaming stores, which skip reading each line before overwriting it: they
 * are larger than what stays in a last-level cache anyway (rope.c). */
#define PE_STREAM_BYTES ((uintptr_t)16 << 20)

/* How far ahead of each row the rotation asks for its input, in bytes, where the input is
 * one dense stream (rope.c): the hardware prefetchers alone do not run far enough ahead of
 * rows that take as long to compute as to move (bf16 with AVX2 instructions), and each
 * row's first load then waits on memory.  About a token of Qwen2-VL-7B's 28 q heads. */
#define PE_PREFETCH_AHEAD ((int64_t)8 << 10)

/* Outputs of this many bytes and more are asked to be backed by huge pages (rope.c). */
#define PE_HUGE_PAGE_HINT_BYTES ((uintptr_t)32 << 20)

/* Tokens per tile: the tile's cos/sin rows (fp32) are prepared together, then stay in L1
 * while the tile's rows are rotated.  The table passes (gradients, tables from positions)
 * take their rows this many at a time too. */
#define PE_TOKEN_TILE 16

/* Heads per visit of a token where the heads are outer in memory ((B, H, T, D) inputs,
 * e.g. the query gradient of eager attention): the tile goes this many heads at a time,
 * each token's rows of those heads together, so its tables are read once for them (held in
 * registers where the rows allow: rot_half_rows_pairs) while only this many rows are
 * streamed side by side.
 * One head at a time read each row's tables again, from L1; every head of a token at once
 * (28 + 4 streams for Qwen2-VL-7B) outran the hardware prefetchers.  Measured on an AMD
 * EPYC (Zen 4), bf16 Qwen2-VL-7B at T = 4096: 1.5-2.0x a copy of the bytes with one head
 * at a time and with all of them, 0.8-1.4x with 4 or 8 (docs/benchmarks.md). */
#define PE_OUTER_GROUP 4

/* Tokens per tile of the fused path with the heads inner: its tables are arithmetic, not
 * loads, and small tiles keep that work between the rows' memory traffic. */
#define PE_FUSED_TILE 4

static inline int pe_dtype_valid(pe_dtype t) { return pe_dtype_size(t) != 0; }

/* Slot of rotary channel e (R = rotary width). */
static inline int64_t pe_slot(pe_pairing p, int64_t e, int64_t R) {
    return p == PE_PAIR_HALF ? (e < R / 2 ? e : e - R / 2) : e / 2;
}

/* Address of row (b, t, h) of a (B, T, H, .) view with element strides s, es bytes each. */
static inline const char *pe_row(const void *base, const int64_t s[3], size_t es, int64_t b,
                                 int64_t t, int64_t h) {
    return (const char *)base + (b * s[0] + t * s[1] + h * s[2]) * (int64_t)es;
}

/* Per-call facts shared by every token (built by rope.c): the layout, and what the call
 * reads and writes besides pe_rope_args. */
typedef struct pe_rope_plan {
    int64_t axes;          /* A: 1 or 3 table axes */
    uint8_t *chan_axis;    /* R: axis of channel e */
    int64_t nruns;         /* channels as runs of one axis: [run_start[i], run_start[i+1]) */
    int64_t *run_start;    /* nruns + 1 entries */
    int64_t *slot_pos_off; /* R/2: position offset of slot i's axis */
    uint32_t *axis_sel;    /* 2 R: all ones where channel e reads axis 1, then axis 2 */
    int64_t block;         /* channels per block of block_axes (0: none) */
    uint8_t *block_axes;   /* R / block: the axes block k's channels read (bit a: axis a) */
    uint32_t *block_sel;   /* blocks of at most 32 channels: bit i of entry (a - 1) (R / block
                            * + 1) + k where channel k block + i reads axis a (a = 1, 2) */
    int64_t nfetch;        /* the table bytes a token's rotation reads, as spans from the */
    int64_t *fetch;        /* token's cos (or sin) row: offset, bytes (2 nfetch entries) */
    int64_t tile;          /* tokens per rotation tile */
    int heads_outer;       /* the rotation's rows: heads outer in memory (B, H, T, D) */
    int stream_out[2];     /* q's, k's rows are stored with streaming stores (rope.c) */
    int64_t ahead[2];      /* q's, k's input is prefetched this many bytes ahead (0: not) */
    /* pe_rope_table_grad: the gradients of the forward output */
    const void *grad_q, *grad_k;
    int64_t grad_q_stride[3], grad_k_stride[3];
    pe_dtype grad_dtype;
    /* pe_rope_table_grad (dcos, dsin) and pe_rope_tables (cos, sin): dense outputs */
    void *cos_out, *sin_out;
    pe_dtype out_dtype;
} pe_rope_plan;

/*
 * A tile function does items i0 .. i0+n-1 of a pass (tokens of a rotation, table rows of
 * the other two entry points) with `scratch`, the calling thread's buffer of
 * pe_scratch_bytes; rope.c runs the tiles, on threads or not, for both precisions.
 */
typedef void (*pe_tile_fn)(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0, int64_t n,
                           void *scratch);

/* Scratch of any tile function, in elements of the compute type (at most a double): cos and
 * signed sine rows of a tile, a sine row, the three MRoPE axis rows, an input and an output
 * row; then the R/2 slots' fp32 cos and sin.  (The fp32 core fits two more rows, of cos and
 * sine in channel order, in the room the doubles leave.) */
static inline size_t pe_scratch_bytes(int64_t R, int64_t D, int64_t tile) {
    return (size_t)(2 * tile * R + 4 * R + 2 * D) * sizeof(double) +
           (size_t)(R + 2) * sizeof(float);
}

/* Fused path: scaling * cos and scaling * sin of each frequency slot of token (b, t). */
static inline void pe_rope_slot_sincos(const pe_rope_args *a, const pe_rope_plan *plan, int64_t b,
                                       int64_t t, float *restrict cs, float *restrict sn) {
    const pe_rope_source *src = &a->src;
    const int64_t nslot = a->rot_dim / 2;
    const int64_t *pos = src->pos + (src->pos_batch == 1 ? 0 : b) * src->pos_stride[1] +
                         t * src->pos_stride[2];
    /* The angles first, held in sn: the token's one to three positions as floats, each
     * slot taking its axis' (a select, not a gather, so that the loop vectorizes); then the
     * sine and cosine over them, branch-free, which vectorizes too. */
    const uint8_t *axis = src->axis_of_slot;
    if (!axis) {
        const float p = (float)pos[0];
        for (int64_t i = 0; i < nslot; ++i) sn[i] = PE_FMUL(src->inv_freq[i], p);
    } else {
        const float p0 = (float)pos[0], p1 = (float)pos[src->pos_stride[0]],
                    p2 = (float)pos[2 * src->pos_stride[0]];
        for (int64_t i = 0; i < nslot; ++i)
            sn[i] = PE_FMUL(src->inv_freq[i], axis[i] == 0 ? p0 : axis[i] == 1 ? p1 : p2);
    }
    int any_large = 0;
    for (int64_t i = 0; i < nslot; ++i) {
        const float ang = sn[i];
        pe_sincos_fast(ang, src->scaling, cs + i, sn + i);
        any_large |= !(ang <= PE_SINCOS_FAST_LIMIT && ang >= -PE_SINCOS_FAST_LIMIT);
    }
    if (!any_large) return;
    for (int64_t i = 0; i < nslot; ++i) {
        const float ang = pe_rope_angle(src->inv_freq[i], pos[plan->slot_pos_off[i]]);
        if (!(ang <= PE_SINCOS_FAST_LIMIT && ang >= -PE_SINCOS_FAST_LIMIT))
            pe_sincos_large(ang, src->scaling, cs + i, sn + i);
    }
}

/* The fp32 core's tile functions (rope_f32.h) compiled per instruction set, in
 * rope_<isa>.c: rotation, table-gradient rows, tables from positions.  Arguments are
 * validated by the public entry points in rope.c. */
void pe_rope_rotate_f32_baseline(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                 int64_t n, void *scratch);
void pe_rope_grad_rows_f32_baseline(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                    int64_t n, void *scratch);
void pe_rope_table_rows_f32_baseline(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                     int64_t n, void *scratch);
#ifdef PE_HAVE_X86_VARIANTS
void pe_rope_rotate_f32_avx2(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                             int64_t n, void *scratch);
void pe_rope_grad_rows_f32_avx2(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                int64_t n, void *scratch);
void pe_rope_table_rows_f32_avx2(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                 int64_t n, void *scratch);
void pe_rope_rotate_f32_avx512(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                               int64_t n, void *scratch);
void pe_rope_grad_rows_f32_avx512(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                  int64_t n, void *scratch);
void pe_rope_table_rows_f32_avx512(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                   int64_t n, void *scratch);
/* The AVX-512 and AVX2 rows' bf16 rounding of channel pairs (simd.h bf16_pairs_num), for
 * the tests: dst[2i] the bf16 of even[i], dst[2i+1] that of odd[i], n a multiple of 16,
 * NaN-free values rounded as pe_f32_to_bf16 does; only on a CPU with that variant. */
void pe_bf16_pairs_avx512(uint16_t *dst, const float *even, const float *odd, int64_t n);
void pe_bf16_pairs_avx2(uint16_t *dst, const float *even, const float *odd, int64_t n);
#endif
#ifdef PE_HAVE_AVX512BF16 /* the avx512bf16 variant was built (rope_avx512bf16.c) */
void pe_rope_rotate_f32_avx512bf16(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                   int64_t n, void *scratch);
void pe_rope_grad_rows_f32_avx512bf16(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                      int64_t n, void *scratch);
void pe_rope_table_rows_f32_avx512bf16(const pe_rope_args *a, const pe_rope_plan *p,
                                       int64_t i0, int64_t n, void *scratch);
/* n fp32 values (n a multiple of 16) rounded to bf16 by vcvtneps2bf16: only on a CPU with
 * AVX512_BF16 */
void pe_bf16_round_hw(uint16_t *dst, const float *src, int64_t n);
/* n fp32 dot products of bf16 pairs (n a multiple of 16): dst[i] = x[2i] t[2i] +
 * x[2i+1] t[2i+1] by vdpbf16ps, from zero: only on a CPU with AVX512_BF16 */
void pe_bf16_dot_hw(float *dst, const uint16_t *x, const uint16_t *t, int64_t n);
/* 1 when the CPU's vcvtneps2bf16 rounds every non-denormal class as pe_f32_to_bf16 does
 * and its vdpbf16ps gives the rows' fp32 sums where they use it (rope_avx512bf16.c) */
int pe_bf16_hw_exact(void);
#endif

/* The fp32 core of the fused q/k norm + RoPE (qk_norm_f32.h) per instruction set, in
 * qk_norm_<isa>.c, with a scratch buffer of pe_qk_scratch_bytes per thread; arguments are
 * validated by qk_norm.c.  Forward: tokens i0 .. i0+n-1.  Backward: rows r0 .. r1-1 of q
 * (tensor 0) or k (1) in the order of the walk (pe_qk_plan: the products' order, posenc.h,
 * r0 a multiple of both block sizes of ws; or token by token, whole tiles of tokens that
 * hold whole blocks of each head's rows), whose block sums of the weight-gradient products
 * it writes.  acc_heads: the heads whose block sums one
 * thread keeps at once (the most heads of a tensor walked token by token, else 1). */
static inline size_t pe_qk_scratch_bytes(int64_t R, int64_t D, int64_t acc_heads) {
    return (size_t)(5 * R + (19 + 5 * acc_heads) * D) * sizeof(float); /* qk_scratch */
}

/* Where a backward puts the weight-gradient products of one tensor's N rows: the sums of
 * whole blocks of rows, each from 0.0 in row order (qk_norm.c adds them up in torch's
 * order).  A block size of 0: no column is summed that way. */
typedef struct pe_qk_wsum {
    int64_t rows;        /* N */
    int64_t plain_block; /* rows per block of the plain order (2^p) */
    int64_t lane_block;  /* rows per block of the 4-lane order (4 2^p) */
    int64_t lane_rows;   /* 4 (N / 4): the rows past it are the tail */
    float *plain;        /* (ceil(N / plain_block), D) */
    float *lanes;        /* (ceil(lane_rows / lane_block), 4, D): row i in lane i % 4 */
    float *tail;         /* (N - lane_rows, D): the products themselves */
} pe_qk_wsum;

/* How the q/k norm moves the rows of q (0) and of k (1), decided once per call
 * (qk_norm.c): their input asked for this many bytes ahead (0: not; the forward's), their
 * results (the forward's outputs, the backward's input gradients) stored with streaming
 * stores, and (backward) their rows walked token by token, every head's row of a token in
 * turn, each head's block sums kept apart, instead of in the products' order. */
typedef struct pe_qk_plan {
    int64_t ahead[2];
    int stream[2];
    int by_token[2];
} pe_qk_plan;

#define PE_QK_ENTRIES(isa)                                                                     \
    void pe_qk_norm_rows_f32_##isa(const pe_qk_norm_args *a, const pe_qk_plan *p, int64_t i0,  \
                                   int64_t n, void *scratch);                                  \
    void pe_qk_norm_bwd_f32_##isa(const pe_qk_norm_args *a, const pe_qk_plan *p, int tensor,    \
                                  int64_t r0, int64_t r1, const pe_qk_wsum *ws, void *scratch);
PE_QK_ENTRIES(baseline)
#ifdef PE_HAVE_X86_VARIANTS
PE_QK_ENTRIES(avx2)
PE_QK_ENTRIES(avx512)
#ifdef PE_HAVE_AVX512BF16
PE_QK_ENTRIES(avx512bf16)
#endif
#endif

/* Asks the OS to back [p, p + bytes) with huge pages when it is a large fresh output
 * (rope.c); advisory only. */
void pe_huge_page_hint(const void *p, size_t bytes);

/* 1 when the pages of [p, p + bytes) that a few samples look at are all in memory (rope.c;
 * 0 where that cannot be asked).  Streaming stores go only to such outputs: a fresh output
 * is pages the kernel zeroes into the cache on first touch, which a streaming store then
 * evicts and writes again. */
int pe_pages_resident(const void *p, size_t bytes);

#endif /* POSENC_INTERNAL_H */

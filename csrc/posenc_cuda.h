/*
 * posenc_cuda.h — the RoPE kernels of posenc.h on NVIDIA GPUs.
 *
 * The same operations, argument structs, validation rules and statuses as pe_rope_apply,
 * pe_rope_table_grad and pe_rope_tables in posenc.h (read that header for the math), run
 * on a CUDA stream.  Every call is asynchronous: it validates the arguments on the host,
 * enqueues one kernel on `stream` and returns; no allocation, no synchronization.
 *
 * Pointers.  Tensor data (q/k in and out, cos/sin, pos, inv_freq, gradients, dcos/dsin)
 * are device pointers.  src.axis_of_slot is a HOST array: it is read on the host and handed
 * to the kernel by value.  nthreads is ignored.
 *
 * Limits beyond posenc.h.  rot_dim <= PE_CUDA_MAX_ROT (the per-slot axis map travels in
 * the kernel's parameters) and (q heads + k heads) * head_dim < 2^31 (a token's work is
 * counted in int); past either the call is PE_ERR_ARG.
 *
 * Arithmetic.  Exactly the CPU's: fp32 inside (fp64 when any tensor of the call is fp64),
 * every product and sum rounded on its own (never fused), one rounding to nearest even at
 * the store.  The per-element math, including the fused path's angle
 * fl32(inv_freq * fl32(pos)) and its sine and cosine, is rope_math.h, the header the CPU
 * kernels use; the rounding to bf16 / fp16 is the hardware's conversion (cvt.rn, two values
 * per instruction), which is the CPU's pe_f32_to_bf16 / pe_f32_to_f16 for every value but
 * NaN; a NaN result is stored as the conversion gives it in the 16-byte kernels, with the
 * CPU's encoding in the element-by-element ones.  So every op gives the CPU's bits, except
 * for the payload and sign of a NaN result: NVIDIA's arithmetic returns a canonical NaN
 * where the CPU propagates an input's (a result is NaN exactly where the CPU's is).
 *
 * Parallel layout.  apply: blocks of 256 threads, grid-stride over groups of several
 * tokens.  A token's work is items, one channel chunk (16 bytes, or one element) of up to
 * four heads; a thread's chunk and first head group are fixed for the whole launch.  Per
 * group a thread computes its token's row pointers once; per item it issues every load of
 * the item before it uses any: its heads' q and k (the chunk and, half pairing, its partner
 * R/2 further: up to 128 bytes) and, with tables, the chunk's cos and sin (16-byte loads in
 * the vector variants, the dtype a template parameter, the MRoPE axis from the section
 * bounds: 64 more bytes), with a barrier of the warp after them so that the compiler holds
 * none back: in the machine code of every vector variant (sm_80, sm_90) a group's q/k and
 * table loads, twelve with tables, are one memory trip, in at most 123 registers and no
 * spill (scripts/cuda_sass_check.py fails a vector kernel whose machine code waits for a
 * load before the last q/k or table load is issued).  It then converts the chunk's cos and
 * signed sine one piece (an element pair) at a time, rotates every head of the item with
 * each piece, rounds, and stores each head with 16-byte streaming stores: a piece's q/k
 * words make room for its results, so the registers hold one item's loads.  With positions
 * the threads of each token compute its cos and signed-sine rows into shared memory once
 * (the first item's q/k loads in flight meanwhile; the positions and frequencies are loaded
 * in the same memory trip) and read their pieces after one barrier;
 * with tables nothing is shared and no block barrier is needed.  16-byte accesses when every
 * row (and, with tables, every table row) is 16-byte aligned, all tensors share one dtype,
 * the tables are of that dtype and no chunk straddles two MRoPE sections (else one element
 * at a time); 32-bit offsets inside a token unless a head stride needs more.  No atomics.
 * table_grad: one block per output row (b', t), one thread per channel summing the heads
 * (and the batch when Bc = 1) in the CPU's order, so the result is deterministic and equal
 * to the CPU's; the dtypes of gradients and inputs are template parameters chosen once per
 * launch.  tables: one block per (b, t).  The per-thread code of all three, and their launch
 * loops, are in cuda/rope_kernels.cuh.
 *
 * Statuses: PE_OK, PE_ERR_ARG (as on the CPU, plus the limit above) and PE_ERR_CUDA when the
 * launch fails (pe_cuda_last_error() then names the CUDA error).  The status is the launch's
 * own: an error an earlier, unrelated call left pending in CUDA's error state is neither
 * reported nor cleared.  Errors that happen later on the stream surface in CUDA's own error
 * state, as for any kernel.
 */
#ifndef POSENC_CUDA_H
#define POSENC_CUDA_H

#include <cuda_runtime_api.h>

#include "posenc.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PE_CUDA_MAX_ROT 2048
#define PE_ERR_CUDA (-16) /* the kernel launch failed: see pe_cuda_last_error() */

/* pe_rope_apply on `stream`: q and k rotated (forward or transpose), tables or positions. */
int pe_cuda_rope_apply(const pe_rope_args *a, cudaStream_t stream);

/* pe_rope_table_grad on `stream`: dcos, dsin (A, Bc, T, R), summed in the CPU's order. */
int pe_cuda_rope_table_grad(const pe_rope_args *a, const void *grad_q,
                            const int64_t grad_q_stride[3], const void *grad_k,
                            const int64_t grad_k_stride[3], pe_dtype grad_dtype, void *dcos,
                            void *dsin, cudaStream_t stream);

/* pe_rope_tables on `stream`: cos, sin (B, T, R) from positions. */
int pe_cuda_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin,
                        cudaStream_t stream);

/* The CUDA error message of this thread's last PE_ERR_CUDA ("no error" if none). */
const char *pe_cuda_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* POSENC_CUDA_H */

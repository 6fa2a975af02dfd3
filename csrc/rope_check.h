/* Argument checks of the RoPE entry points (posenc.h), shared by the CPU kernels (rope.c)
 * and the CUDA entry points (posenc_cuda.h) so that both accept exactly the same calls:
 * sizes and options, int64 overflow of every offset, and outputs that overlap an input or
 * each other.  Each returns PE_ERR_ARG, PE_CHECK_EMPTY (valid, nothing to compute) or
 * PE_CHECK_RUN. */
#ifndef POSENC_ROPE_CHECK_H
#define POSENC_ROPE_CHECK_H

#include "posenc.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { PE_CHECK_EMPTY = 0, PE_CHECK_RUN = 1 };

int pe_rope_check_apply(const pe_rope_args *a);
int pe_rope_check_table_grad(const pe_rope_args *a, const void *grad_q,
                             const int64_t grad_q_stride[3], const void *grad_k,
                             const int64_t grad_k_stride[3], pe_dtype grad_dtype,
                             const void *dcos, const void *dsin);
int pe_rope_check_tables(const pe_rope_args *a, pe_dtype out_dtype, const void *cos,
                         const void *sin);

#ifdef __cplusplus
}
#endif

#endif /* POSENC_ROPE_CHECK_H */

// RoPE / MRoPE on CUDA (posenc_cuda.h): the kernels and the host entry points.  The work
// of one thread lives in rope_kernels.cuh; here it is laid out on the grid.
#include <cuda_runtime.h>

#include "rope_kernels.cuh"

namespace pe_cuda {
namespace {

__device__ inline Lane lane() {
    return {threadIdx.x, blockDim.x};
}

// One block per token, grid-stride: the cos and signed-sine rows once, then every head of
// q and k.
template <typename R, typename T, int V> __global__ void rope_apply_kernel(const RopeP p) {
    extern __shared__ __align__(16) unsigned char smem[];
    R *c = reinterpret_cast<R *>(smem), *ss = c + p.R;
    const int64_t ntok = p.B * p.T;
    for (int64_t tok = blockIdx.x; tok < ntok; tok += gridDim.x) {
        const int64_t b = tok / p.T, t = tok - b * p.T;
        __syncthreads(); // the previous token's rows are no longer read
        token_rows<R>(p, b, t, c, ss, lane());
        __syncthreads();
        rotate_token<R, T, V>(p, b, t, c, ss, lane());
    }
}

// One block per output row (b', t), one thread per channel.
template <typename R> __global__ void rope_table_grad_kernel(const GradP gp) {
    const int64_t nrow = gp.p.src.table_batch * gp.p.T;
    for (int64_t row = blockIdx.x; row < nrow; row += gridDim.x)
        table_grad_row<R>(gp, row, lane());
}

// One block per (b, t).
__global__ void rope_tables_kernel(const RopeP p, pe_dtype out_dt, char *cos, char *sin) {
    extern __shared__ __align__(16) unsigned char smem[];
    float *c = reinterpret_cast<float *>(smem), *s = c + p.R;
    const int64_t nrow = p.src.pos_batch * p.T;
    for (int64_t row = blockIdx.x; row < nrow; row += gridDim.x) {
        __syncthreads();
        token_tables<float>(p, row / p.T, row % p.T, c, s, lane());
        __syncthreads();
        store_tables_row(p, row, c, s, out_dt, cos, sin, lane());
    }
}

thread_local cudaError_t last_error = cudaSuccess;

int launched() {
    const cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return PE_OK;
    last_error = err;
    return PE_ERR_CUDA;
}

// Blocks for n independent rows: enough to fill every SM many times over, grid-stride
// beyond that.
unsigned grid_for(int64_t n) {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        sms = 128;
    const int64_t cap = static_cast<int64_t>(sms) * 32;
    return static_cast<unsigned>(n < cap ? n : cap);
}

int status(Work w) {
    return w == Work::BadArg ? PE_ERR_ARG : PE_OK;
}

} // namespace
} // namespace pe_cuda

using namespace pe_cuda;

extern "C" {

const char *pe_cuda_last_error(void) {
    return cudaGetErrorString(last_error);
}

int pe_cuda_rope_apply(const pe_rope_args *a, cudaStream_t stream) {
    const Work w = check_apply(a);
    if (w != Work::Run) return status(w);
    const unsigned grid = grid_for(a->batch * a->seq);
    pe_rope_args pass[2];
    for (int i = 0, n = apply_passes(a, pass); i < n; ++i) {
        const RopeP p = rope_params(&pass[i]);
        with_apply_variant(&pass[i], [&](auto r, auto tx, auto v) {
            using R = typename decltype(r)::type;
            using T = typename decltype(tx)::type;
            const size_t shm = 2 * static_cast<size_t>(p.R) * sizeof(R);
            rope_apply_kernel<R, T, decltype(v)::value><<<grid, kApplyThreads, shm, stream>>>(p);
        });
        if (const int rc = launched()) return rc;
    }
    return PE_OK;
}

int pe_cuda_rope_table_grad(const pe_rope_args *a, const void *grad_q,
                            const int64_t grad_q_stride[3], const void *grad_k,
                            const int64_t grad_k_stride[3], pe_dtype grad_dtype, void *dcos,
                            void *dsin, cudaStream_t stream) {
    const Work w =
        check_table_grad(a, grad_q, grad_q_stride, grad_k, grad_k_stride, grad_dtype, dcos, dsin);
    if (w != Work::Run) return status(w);
    const GradP gp =
        grad_params(a, grad_q, grad_q_stride, grad_k, grad_k_stride, grad_dtype, dcos, dsin);
    const unsigned grid = grid_for(a->src.table_batch * a->seq);
    const unsigned threads =
        a->rot_dim >= 256 ? 256u : static_cast<unsigned>((a->rot_dim + 31) / 32 * 32);
    if (table_grad_f64(a, grad_dtype))
        rope_table_grad_kernel<double><<<grid, threads, 0, stream>>>(gp);
    else
        rope_table_grad_kernel<float><<<grid, threads, 0, stream>>>(gp);
    return launched();
}

int pe_cuda_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin,
                        cudaStream_t stream) {
    const Work w = check_tables(a, out_dtype, cos, sin);
    if (w != Work::Run) return status(w);
    const RopeP p = rope_params(a);
    const size_t shm = 2 * static_cast<size_t>(a->rot_dim) * sizeof(float);
    rope_tables_kernel<<<grid_for(a->src.pos_batch * a->seq), kApplyThreads, shm, stream>>>(
        p, out_dtype, static_cast<char *>(cos), static_cast<char *>(sin));
    return launched();
}

} // extern "C"

// RoPE / MRoPE on CUDA (posenc_cuda.h): the kernels and the host entry points.  The work
// of one thread lives in rope_kernels.cuh; here it is laid out on the grid.
#include <cuda_runtime.h>

#include <atomic>

#include "rope_kernels.cuh"

namespace pe_cuda {
namespace {

__device__ inline Lane lane() {
    return {static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
}

// Phases of `g.tokens` tokens, grid-stride: each thread issues the loads of its item, the
// block writes the tokens' cos and signed-sine rows to shared memory, and after the barrier
// each thread rotates and stores its item (then its token's further items).
template <typename R, typename T, int V, typename Off>
__global__ void __launch_bounds__(kApplyThreads, (apply_min_blocks<T, V, Off>()))
    rope_apply_kernel(const RopeP p, const ApplyGrid g) {
    extern __shared__ __align__(16) unsigned char smem[];
    R *rows = reinterpret_cast<R *>(smem);
    for (int64_t group = blockIdx.x; group < g.groups; group += gridDim.x) {
        ApplyThread<R, T, V, Off> th;
        th.load(p, g, group, lane());
        __syncthreads(); // the previous phase's rows are no longer read
        group_rows<R>(p, g, group, rows, lane());
        __syncthreads();
        th.finish(p, g, rows);
    }
}

// One block per output row (b', t), one thread per channel.
template <typename R, typename G, typename X>
__global__ void rope_table_grad_kernel(const GradP gp) {
    const int64_t nrow = gp.p.src.table_batch * gp.p.T;
    for (int64_t row = blockIdx.x; row < nrow; row += gridDim.x)
        table_grad_row<R, G, X>(gp, row, lane());
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

// Multiprocessors of each device, asked once per device.
constexpr int kMaxDevices = 64;
std::atomic<int> sm_count[kMaxDevices];

int sms_of_current_device() {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 128;
    if (dev < 0 || dev >= kMaxDevices) dev = 0;
    int n = sm_count[dev].load(std::memory_order_relaxed);
    if (n == 0) {
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
            n = 128;
        sm_count[dev].store(n, std::memory_order_relaxed);
    }
    return n;
}

// Blocks for n independent units: `per_sm` waves of every SM at most, grid-stride beyond.
unsigned grid_for(int64_t n, int per_sm) {
    const int64_t cap = static_cast<int64_t>(sms_of_current_device()) * per_sm;
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
    pe_rope_args pass[2];
    for (int i = 0, n = apply_passes(a, pass); i < n; ++i) {
        const RopeP p = rope_params(&pass[i]);
        with_apply_variant(&pass[i], [&](auto r, auto tx, auto v, auto off) {
            using R = typename decltype(r)::type;
            using T = typename decltype(tx)::type;
            using Off = typename decltype(off)::type;
            constexpr int V = decltype(v)::value;
            const ApplyGrid g = apply_grid<R, T, V>(p, kApplyThreads);
            rope_apply_kernel<R, T, V, Off>
                <<<grid_for(g.groups, 4 * apply_min_blocks<T, V, Off>()), kApplyThreads,
                   apply_shared_bytes<R>(g), stream>>>(p, g);
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
    const unsigned grid = grid_for(a->src.table_batch * a->seq, 32);
    const unsigned threads =
        a->rot_dim >= 256 ? 256u : static_cast<unsigned>((a->rot_dim + 31) / 32 * 32);
    with_table_grad_variant(a, grad_dtype, [&](auto r, auto g, auto x) {
        using R = typename decltype(r)::type;
        using G = typename decltype(g)::type;
        using X = typename decltype(x)::type;
        rope_table_grad_kernel<R, G, X><<<grid, threads, 0, stream>>>(gp);
    });
    return launched();
}

int pe_cuda_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin,
                        cudaStream_t stream) {
    const Work w = check_tables(a, out_dtype, cos, sin);
    if (w != Work::Run) return status(w);
    const RopeP p = rope_params(a);
    const size_t shm = 2 * static_cast<size_t>(a->rot_dim) * sizeof(float);
    rope_tables_kernel<<<grid_for(a->src.pos_batch * a->seq, 32), kApplyThreads, shm, stream>>>(
        p, out_dtype, static_cast<char *>(cos), static_cast<char *>(sin));
    return launched();
}

} // extern "C"

// RoPE / MRoPE on CUDA (posenc_cuda.h): the kernels and the host entry points.  The work
// of one thread, and the launch loops, live in rope_kernels.cuh; here they meet the grid.
#include <cuda_runtime.h>

#include <atomic>
#include <utility>

#include "rope_kernels.cuh"

namespace pe_cuda {
namespace {

__device__ inline Lane lane() {
    return {static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
}

// Grid-stride over groups of `g.tokens` tokens.  Tables: each thread reads its chunk's
// cos/sin straight into registers and rotates its heads; nothing is shared, no barrier.
// Positions: each thread issues the loads of its first item, the threads of each token write
// its cos and signed-sine rows to shared memory, and after the barrier each thread rotates
// and stores (the barrier before the rows keeps the previous group's readers).
template <typename R, typename T, int V, typename Off, typename S>
__global__ void __launch_bounds__(kApplyThreads, (apply_min_blocks<R, T, V, S>()))
    rope_apply_kernel(const RopeP p, const ApplyGrid g) {
    extern __shared__ __align__(16) unsigned char smem[];
    ApplyThread<R, T, V, Off, S> th(p, g, blockIdx.x, lane());
    if constexpr (is_positions<S>) {
        for (int64_t group = blockIdx.x; group < g.groups; group += g.grid, th.next_group(g)) {
            R *rows = reinterpret_cast<R *>(smem);
            th.positions_load(p, g);
            __syncthreads(); // the previous group's rows are read
            th.positions_rows(p, g, rows);
            __syncthreads();
            th.positions_finish(p, g, rows);
        }
    } else if (th.active) {
        // no barrier: each thread runs until its own token is past the last (its token
        // only grows), and needs no group counter
        for (; th.busy(p); th.next_group(g))
            th.tables_group(p, g);
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
        token_tables(p, row / p.T, row % p.T, c, s, lane());
        __syncthreads();
        store_tables_row(p, row, c, s, out_dt, cos, sin, lane());
    }
}

thread_local cudaError_t last_error = cudaSuccess;

// One launch of `kernel` on `stream`: PE_OK, or PE_ERR_CUDA with this launch's own error for
// pe_cuda_last_error().  The launch call returns its own error, so an error that an earlier,
// unrelated call left pending in CUDA's error state is neither reported as this launch's nor
// cleared when this launch succeeds (a failed launch clears the state it set).
template <typename... Params, typename... Args>
int launch(void (*kernel)(Params...), unsigned grid, unsigned threads, size_t shared,
           cudaStream_t stream, Args &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = shared;
    cfg.stream = stream;
    const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
    if (err == cudaSuccess) return PE_OK;
    (void)cudaGetLastError();
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

// Blocks for n >= 1 independent units: `per_sm` waves of every SM at most, grid-stride beyond.
unsigned grid_for(int64_t n, int per_sm) {
    const int64_t cap = static_cast<int64_t>(sms_of_current_device()) * per_sm;
    return static_cast<unsigned>(n < cap ? n : cap);
}

} // namespace
} // namespace pe_cuda

using namespace pe_cuda;

extern "C" {

const char *pe_cuda_last_error(void) {
    return cudaGetErrorString(last_error);
}

int pe_cuda_rope_apply(const pe_rope_args *a, cudaStream_t stream) {
    return run_apply(
        a, kApplyThreads, [](int64_t groups, int blocks) { return grid_for(groups, 4 * blocks); },
        [&](auto r, auto tx, auto v, auto off, auto src, const RopeP &p, const ApplyGrid &g) {
            using R = typename decltype(r)::type;
            using T = typename decltype(tx)::type;
            using Off = typename decltype(off)::type;
            using S = typename decltype(src)::type;
            constexpr int V = decltype(v)::value;
            return launch(rope_apply_kernel<R, T, V, Off, S>, static_cast<unsigned>(g.grid),
                          kApplyThreads, apply_shared_bytes<R, S>(g), stream, p, g);
        });
}

int pe_cuda_rope_table_grad(const pe_rope_args *a, const void *grad_q,
                            const int64_t grad_q_stride[3], const void *grad_k,
                            const int64_t grad_k_stride[3], pe_dtype grad_dtype, void *dcos,
                            void *dsin, cudaStream_t stream) {
    return run_table_grad(
        a, grad_q, grad_q_stride, grad_k, grad_k_stride, grad_dtype, dcos, dsin,
        [&](auto r, auto g, auto x, const GradP &gp) {
            using R = typename decltype(r)::type;
            using G = typename decltype(g)::type;
            using X = typename decltype(x)::type;
            const unsigned grid = grid_for(gp.p.src.table_batch * gp.p.T, 32);
            const unsigned threads =
                gp.p.R >= 256 ? 256u : static_cast<unsigned>((gp.p.R + 31) / 32 * 32);
            return launch(rope_table_grad_kernel<R, G, X>, grid, threads, 0, stream, gp);
        });
}

int pe_cuda_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin,
                        cudaStream_t stream) {
    return run_tables(a, out_dtype, cos, sin, [&](const RopeP &p) {
        const size_t shm = 2 * static_cast<size_t>(p.R) * sizeof(float);
        return launch(rope_tables_kernel, grid_for(p.src.pos_batch * p.T, 32), kApplyThreads, shm,
                      stream, p, out_dtype, static_cast<char *>(cos), static_cast<char *>(sin));
    });
}

} // extern "C"

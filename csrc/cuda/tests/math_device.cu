// rope_math.h on the GPU against the same functions on the host: every entry of the math
// sweep (math_sweep.h) must give the same digest.  Needs a CUDA device; exit status 0 when
// all entries agree, 1 on the first mismatch, 2 when CUDA fails.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "math_sweep.h"

__global__ void sweep_kernel(uint64_t *out, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = pe_math_sweep(i);
}

int main() {
    const uint32_t n = PE_SWEEP_N;
    uint64_t *dev = nullptr;
    std::vector<uint64_t> got(n);
    cudaError_t err = cudaMalloc(&dev, n * sizeof(uint64_t));
    if (err == cudaSuccess) {
        sweep_kernel<<<1024, 256>>>(dev, n);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess)
        err = cudaMemcpy(got.data(), dev, n * sizeof(uint64_t), cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) {
        std::fprintf(stderr, "math_device: CUDA error: %s\n", cudaGetErrorString(err));
        return 2;
    }
    cudaFree(dev);
    uint32_t bad = 0;
    for (uint32_t i = 0; i < n; ++i) {
        if (got[i] != pe_math_sweep(i)) {
            if (bad++ < 5)
                std::fprintf(stderr, "math_device: entry %u differs (device vs host)\n", i);
        }
    }
    std::printf("rope_math.h on the GPU vs the host: %u entries, %u differ\n", n, bad);
    return bad ? 1 : 0;
}

// rope_math.h on the GPU against the same functions on the host: every entry of the math
// sweep (math_sweep.h) must give the same digest.  And the kernels' conversions on the GPU,
// the hardware instructions (cvt.rn.bf16x2.f32, cvt.rn.f16x2.f32, cvt.f32.f16), alone and with
// the one-value NaN path, against the CPU's functions (rope_math.h, integer code, run on the GPU too) over all
// 2^32 fp32 bit patterns and all 2^16 fp16 patterns: what the host emulation can only show
// for the instructions' model.  Needs a CUDA device; exit status 0 when everything agrees, 1
// on a mismatch, 2 when CUDA fails.  Build with --fmad=false, as the kernels are.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "../rope_kernels.cuh"
#include "math_sweep.h"

using pe_cuda::Bf16;
using pe_cuda::F16;
using pe_cuda::Unit;

__global__ void sweep_kernel(uint64_t *out, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = pe_math_sweep(i);
}

// Patterns 8 i .. 8 i + 7 through a vector of the kernels (pack) and each through the
// one-value rounding, against the CPU's function: the same bits, and for a NaN the vector a
// NaN (the instruction's), the one value the CPU's encoding.
template <typename T> __device__ unsigned conversion_errors(uint64_t base) {
    using U = Unit<float, T, 8>;
    float x[8];
    for (int k = 0; k < 8; ++k)
        x[k] = pe_bits_f32(static_cast<uint32_t>(base + k));
    const typename U::raw w = U::pack(x);
    unsigned bad = 0;
    for (int k = 0; k < 8; ++k) {
        const bool bf = std::is_same_v<T, Bf16>;
        const uint16_t cpu = bf ? pe_f32_to_bf16(x[k]) : pe_f32_to_f16(x[k]);
        const uint16_t one = bf ? pe_cuda::round_bf16(x[k]) : pe_cuda::round_f16(x[k]);
        const uint16_t vec = static_cast<uint16_t>(w.w[k >> 1] >> (16 * (k & 1)));
        const bool nan = (vec & 0x7fffu) > (bf ? 0x7f80u : 0x7c00u);
        bad += x[k] == x[k] ? vec != cpu : !nan;
        bad += one != cpu;
    }
    return bad;
}

__global__ void conversion_kernel(unsigned long long *bad) {
    unsigned b = 0, h = 0;
    const uint64_t groups = uint64_t{1} << 29, stride = uint64_t{gridDim.x} * blockDim.x;
    for (uint64_t g = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; g < groups; g += stride) {
        b += conversion_errors<Bf16>(8 * g);
        h += conversion_errors<F16>(8 * g);
    }
    if (b) atomicAdd(&bad[0], b);
    if (h) atomicAdd(&bad[1], h);
    if (blockIdx.x == 0) { // fp16 -> fp32: exact; NaN stays NaN
        for (uint32_t u = threadIdx.x; u < 65536; u += blockDim.x) {
            const float cpu = pe_f16_to_f32(static_cast<uint16_t>(u));
            const float dev = pe_cuda::cvt_f32_f16(static_cast<uint16_t>(u));
            const bool ok = cpu != cpu ? dev != dev : pe_f32_bits(cpu) == pe_f32_bits(dev);
            if (!ok) atomicAdd(&bad[2], 1ull);
        }
    }
}

int main() {
    const uint32_t n = PE_SWEEP_N;
    uint64_t *dev = nullptr;
    unsigned long long *bad_dev = nullptr, bad_conv[3] = {0, 0, 0};
    std::vector<uint64_t> got(n);
    cudaError_t err = cudaMalloc(&dev, n * sizeof(uint64_t));
    if (err == cudaSuccess) err = cudaMalloc(&bad_dev, sizeof bad_conv);
    if (err == cudaSuccess) err = cudaMemset(bad_dev, 0, sizeof bad_conv);
    if (err == cudaSuccess) {
        sweep_kernel<<<1024, 256>>>(dev, n);
        conversion_kernel<<<2048, 256>>>(bad_dev);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess)
        err = cudaMemcpy(got.data(), dev, n * sizeof(uint64_t), cudaMemcpyDeviceToHost);
    if (err == cudaSuccess)
        err = cudaMemcpy(bad_conv, bad_dev, sizeof bad_conv, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) {
        std::fprintf(stderr, "math_device: CUDA error: %s\n", cudaGetErrorString(err));
        return 2;
    }
    cudaFree(dev);
    cudaFree(bad_dev);
    uint32_t bad = 0;
    for (uint32_t i = 0; i < n; ++i) {
        if (got[i] != pe_math_sweep(i)) {
            if (bad++ < 5)
                std::fprintf(stderr, "math_device: entry %u differs (device vs host)\n", i);
        }
    }
    std::printf("rope_math.h on the GPU vs the host: %u entries, %u differ\n", n, bad);
    std::printf("the kernels' conversions on the GPU vs the CPU's functions: 2^32 fp32 "
                "patterns to bf16 %llu and to fp16 %llu differ (vector and one value), 2^16 "
                "fp16 to fp32 %llu differ\n",
                bad_conv[0], bad_conv[1], bad_conv[2]);
    return bad || bad_conv[0] || bad_conv[1] || bad_conv[2] ? 1 : 0;
}

// A kernel that breaks every rule of scripts/cuda_sass_check.py, named as a vector apply
// variant so that every rule applies: cuda_compile.sh checks that the checker finds each
// problem (a rule that silently stops applying would pass the real kernels unnoticed).
#include <cuda_runtime.h>

#include <cstdint>

namespace pe_cuda {

struct Bf16 {};
template <typename TT> struct Tables {};
struct RopeP {
    const uint16_t *in, *table;
    uint32_t *out;
    float *f;
    int n;
};
struct ApplyGrid {
    int k;
};

template <typename R, typename T, int V, typename Off, typename S>
__global__ void __launch_bounds__(256, 2) rope_apply_kernel(const RopeP p, const ApplyGrid g) {
    const int i = static_cast<int>(threadIdx.x);
    for (int n = static_cast<int>(blockIdx.x); n < p.n; n += static_cast<int>(gridDim.x)) {
        const uint16_t c = p.table[i + g.k + n]; // a narrow table load
        const uint16_t x = __ldcs(p.in + i + c); // a narrow q/k load at an address that
                                                 // needs c: a second memory trip
        p.out[n * 256 + i] = x + c;              // a narrow store
        float local[64]; // written and read at run-time indices: local memory
        for (int k = 0; k < g.k; ++k)
            local[(k * 7 + i) & 63] = p.f[k];
        float acc = p.f[i];
#pragma unroll
        for (int k = 0; k < 2400; ++k) // past the 16-bit V = 8 instruction budget
            acc = __fmul_rn(acc, 1.0001f);
        p.f[i] = __fmaf_rn(acc, local[g.k & 63], 1.0f); // a fused multiply-add
    }
}

template __global__ void rope_apply_kernel<float, Bf16, 8, int, Tables<Bf16>>(RopeP, ApplyGrid);

} // namespace pe_cuda

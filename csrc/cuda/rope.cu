// RoPE / MRoPE kernels on CUDA: the operations of posenc.h, specified in posenc_cuda.h.
// Host code validates like the CPU entry points (rope.c) and copies every argument the
// kernels need into one parameter struct passed by value.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "math_bridge.cuh"
#include "posenc_cuda.h"

namespace {

constexpr int kMaxSlots = PE_CUDA_MAX_ROT / 2;
constexpr int kApplyThreads = 128;

// ---- dtypes: storage tags and their conversions (one rounding to nearest even) -------

struct Bf16 {};
struct F16 {};

template <typename T> struct Io;
template <> struct Io<float> {
    using storage = float;
    template <typename R> __device__ static R load(float v) { return static_cast<R>(v); }
    template <typename R> __device__ static float store(R v) { return static_cast<float>(v); }
};
template <> struct Io<double> {
    using storage = double;
    template <typename R> __device__ static R load(double v) { return static_cast<R>(v); }
    template <typename R> __device__ static double store(R v) { return static_cast<double>(v); }
};
template <> struct Io<Bf16> {
    using storage = uint16_t;
    template <typename R> __device__ static R load(uint16_t v) {
        return static_cast<R>(pe_cuda::bf16_to_f32(v));
    }
    // fp64 -> bf16 goes through fp32, as on the CPU (the accepted compute type there).
    template <typename R> __device__ static uint16_t store(R v) {
        return pe_cuda::f32_to_bf16(static_cast<float>(v));
    }
};
template <> struct Io<F16> {
    using storage = uint16_t;
    template <typename R> __device__ static R load(uint16_t v) {
        return static_cast<R>(__half2float(__ushort_as_half(v)));
    }
    template <typename R> __device__ static uint16_t store(R v) {
        if constexpr (std::is_same_v<R, double>) return __half_as_ushort(__double2half(v));
        else return __half_as_ushort(__float2half_rn(v));
    }
};

template <typename R> __device__ R load_dyn(const char *base, int64_t i, pe_dtype dt) {
    switch (dt) {
    case PE_FLOAT32: return Io<float>::load<R>(reinterpret_cast<const float *>(base)[i]);
    case PE_FLOAT64: return Io<double>::load<R>(reinterpret_cast<const double *>(base)[i]);
    case PE_BFLOAT16: return Io<Bf16>::load<R>(reinterpret_cast<const uint16_t *>(base)[i]);
    default: return Io<F16>::load<R>(reinterpret_cast<const uint16_t *>(base)[i]);
    }
}

template <typename R> __device__ void store_dyn(char *base, int64_t i, pe_dtype dt, R v) {
    switch (dt) {
    case PE_FLOAT32: reinterpret_cast<float *>(base)[i] = Io<float>::store(v); break;
    case PE_FLOAT64: reinterpret_cast<double *>(base)[i] = Io<double>::store(v); break;
    case PE_BFLOAT16: reinterpret_cast<uint16_t *>(base)[i] = Io<Bf16>::store(v); break;
    default: reinterpret_cast<uint16_t *>(base)[i] = Io<F16>::store(v); break;
    }
}

// Unfused arithmetic whatever the flags: round after the product, then after the sum.
__device__ inline float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float add(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double add(double a, double b) { return __dadd_rn(a, b); }
__device__ inline float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ inline double sub(double a, double b) { return __dsub_rn(a, b); }

// out = x * c + xp * ss, the one formula of every rotated channel (ss: signed sine).
template <typename R> __device__ inline R rot(R x, R c, R xp, R ss) {
    return add(mul(x, c), mul(xp, ss));
}

size_t dtype_size(pe_dtype t) {
    switch (t) {
    case PE_FLOAT32: return 4;
    case PE_FLOAT64: return 8;
    case PE_BFLOAT16:
    case PE_FLOAT16: return 2;
    }
    return 0;
}

// ---- kernel parameters ---------------------------------------------------------------

struct TensorP {
    const char *in;
    char *out;
    int64_t in_s[3], out_s[3]; // b, t, h in elements
    int64_t heads;
    pe_dtype in_dt, out_dt;
};

struct SourceP {
    int positions; // 1: pos + inv_freq, 0: tables
    const char *cos, *sin;
    pe_dtype table_dt;
    int64_t table_batch, table_s[3];
    const int64_t *pos;
    int64_t pos_batch, pos_s[3];
    const float *inv_freq;
    float scaling;
    int axes; // 1 or 3
    uint8_t axis[kMaxSlots];
};

struct RopeP {
    int64_t B, T, D, R;
    int pairing, transpose;
    SourceP src;
    TensorP x[2]; // q, k (k.heads may be 0)
};

__device__ inline int64_t slot_of(int pairing, int64_t e, int64_t R) {
    return pairing == PE_PAIR_HALF ? (e < R / 2 ? e : e - R / 2) : e / 2;
}

// ---- the token's tables: cos and unsigned sin rows in fp32/fp64 shared memory --------

template <typename R>
__device__ void token_tables(const RopeP &p, int64_t b, int64_t t, R *c, R *s) {
    const SourceP &src = p.src;
    const int64_t nslot = p.R / 2;
    if (src.positions) {
        const int64_t *pos = src.pos + (src.pos_batch == 1 ? 0 : b) * src.pos_s[1] + t * src.pos_s[2];
        for (int64_t i = threadIdx.x; i < nslot; i += blockDim.x) {
            float cv, sv;
            const float ang = pe_cuda::angle(src.inv_freq[i], pos[src.axis[i] * src.pos_s[0]]);
            pe_cuda::sincos_scaled(ang, src.scaling, &cv, &sv);
            const int64_t e0 = p.pairing == PE_PAIR_HALF ? i : 2 * i;
            const int64_t e1 = p.pairing == PE_PAIR_HALF ? i + nslot : 2 * i + 1;
            c[e0] = c[e1] = static_cast<R>(cv);
            s[e0] = s[e1] = static_cast<R>(sv);
        }
        return;
    }
    const int64_t off = (src.table_batch == 1 ? 0 : b) * src.table_s[1] + t * src.table_s[2];
    for (int64_t e = threadIdx.x; e < p.R; e += blockDim.x) {
        const int64_t ax = src.axes == 1 ? 0 : src.axis[slot_of(p.pairing, e, p.R)];
        const int64_t i = off + ax * src.table_s[0] + e;
        c[e] = load_dyn<R>(src.cos, i, src.table_dt);
        s[e] = load_dyn<R>(src.sin, i, src.table_dt);
    }
}

// Signed sine: forward ss[e] = sign(e) s[e]; transpose ss[e] = sign(p(e)) s[p(e)].
template <typename R> __device__ void signed_sine(const RopeP &p, const R *s, R *ss) {
    const int64_t Rw = p.R, h = Rw / 2;
    for (int64_t e = threadIdx.x; e < Rw; e += blockDim.x) {
        const bool first = p.pairing == PE_PAIR_HALF ? e < h : (e % 2 == 0);
        const int64_t partner = p.pairing == PE_PAIR_HALF ? (first ? e + h : e - h)
                                                          : (first ? e + 1 : e - 1);
        if (!p.transpose) ss[e] = first ? -s[e] : s[e];
        else ss[e] = first ? s[partner] : -s[partner];
    }
}

// ---- rotation of one token's heads -----------------------------------------------------

template <typename T, int V> struct alignas(sizeof(typename Io<T>::storage) * V) Pack {
    typename Io<T>::storage v[V];
};

// All tensors of the call in T (in and out); V elements per access (16 bytes, or 1).
template <typename R, typename T, int V>
__device__ void rotate_typed(const RopeP &p, const TensorP &x, int64_t b, int64_t t, const R *c,
                             const R *ss) {
    using S = typename Io<T>::storage;
    using P = Pack<T, V>;
    const int64_t Rw = p.R, h = Rw / 2;
    const int64_t rot_items = (p.pairing == PE_PAIR_HALF ? h : Rw) / V;
    const int64_t per_head = rot_items + (p.D - Rw) / V;
    const int64_t n = x.heads * per_head;
    const S *ib = reinterpret_cast<const S *>(x.in) + b * x.in_s[0] + t * x.in_s[1];
    S *ob = reinterpret_cast<S *>(x.out) + b * x.out_s[0] + t * x.out_s[1];
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t hd = i / per_head, j = i - hd * per_head;
        const S *xi = ib + hd * x.in_s[2];
        S *xo = ob + hd * x.out_s[2];
        if (j >= rot_items) { // pass-through channels
            const int64_t e = Rw + (j - rot_items) * V;
            *reinterpret_cast<P *>(xo + e) = *reinterpret_cast<const P *>(xi + e);
            continue;
        }
        const int64_t e = j * V;
        if (p.pairing == PE_PAIR_HALF) {
            const P lo = *reinterpret_cast<const P *>(xi + e);
            const P hi = *reinterpret_cast<const P *>(xi + e + h);
            P olo, ohi;
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const R a = Io<T>::template load<R>(lo.v[k]), z = Io<T>::template load<R>(hi.v[k]);
                olo.v[k] = Io<T>::store(rot(a, c[e + k], z, ss[e + k]));
                ohi.v[k] = Io<T>::store(rot(z, c[e + h + k], a, ss[e + h + k]));
            }
            *reinterpret_cast<P *>(xo + e) = olo;
            *reinterpret_cast<P *>(xo + e + h) = ohi;
        } else if constexpr (V >= 2) {
            const P in = *reinterpret_cast<const P *>(xi + e);
            P out;
#pragma unroll
            for (int k = 0; k < V; k += 2) {
                const R a = Io<T>::template load<R>(in.v[k]);
                const R z = Io<T>::template load<R>(in.v[k + 1]);
                out.v[k] = Io<T>::store(rot(a, c[e + k], z, ss[e + k]));
                out.v[k + 1] = Io<T>::store(rot(z, c[e + k + 1], a, ss[e + k + 1]));
            }
            *reinterpret_cast<P *>(xo + e) = out;
        } else { // adjacent pairs one element at a time
            const int64_t pe = (e % 2 == 0) ? e + 1 : e - 1;
            const R a = Io<T>::template load<R>(xi[e]), z = Io<T>::template load<R>(xi[pe]);
            xo[e] = Io<T>::store(rot(a, c[e], z, ss[e]));
        }
    }
}

__device__ inline size_t dtype_size_dev(pe_dtype t) {
    return t == PE_FLOAT64 ? 8 : t == PE_FLOAT32 ? 4 : 2;
}

// Any dtype in, any dtype out, one element at a time.
template <typename R>
__device__ void rotate_dyn(const RopeP &p, const TensorP &x, int64_t b, int64_t t, const R *c,
                           const R *ss) {
    const int64_t Rw = p.R, D = p.D, h = Rw / 2, n = x.heads * D;
    const size_t ies = dtype_size_dev(x.in_dt), oes = dtype_size_dev(x.out_dt);
    const char *ib = x.in + (b * x.in_s[0] + t * x.in_s[1]) * static_cast<int64_t>(ies);
    char *ob = x.out + (b * x.out_s[0] + t * x.out_s[1]) * static_cast<int64_t>(oes);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t hd = i / D, e = i - hd * D;
        const char *xi = ib + hd * x.in_s[2] * static_cast<int64_t>(ies);
        char *xo = ob + hd * x.out_s[2] * static_cast<int64_t>(oes);
        const R a = load_dyn<R>(xi, e, x.in_dt);
        if (e >= Rw) {
            store_dyn<R>(xo, e, x.out_dt, a);
            continue;
        }
        const int64_t pe = p.pairing == PE_PAIR_HALF ? (e < h ? e + h : e - h)
                                                     : ((e % 2 == 0) ? e + 1 : e - 1);
        store_dyn<R>(xo, e, x.out_dt, rot(a, c[e], load_dyn<R>(xi, pe, x.in_dt), ss[e]));
    }
}

// One block per token, grid-stride; T = void selects the any-dtype rows.
template <typename R, typename T, int V> __global__ void rope_apply_kernel(const RopeP p) {
    extern __shared__ __align__(16) unsigned char smem[];
    R *c = reinterpret_cast<R *>(smem), *ss = c + p.R, *s = ss + p.R;
    const int64_t ntok = p.B * p.T;
    for (int64_t tok = blockIdx.x; tok < ntok; tok += gridDim.x) {
        const int64_t b = tok / p.T, t = tok - b * p.T;
        __syncthreads(); // the previous token's rows are no longer read
        token_tables<R>(p, b, t, c, s);
        __syncthreads();
        signed_sine<R>(p, s, ss);
        __syncthreads();
        for (int w = 0; w < 2; ++w) {
            if (p.x[w].heads == 0) continue;
            if constexpr (std::is_void_v<T>) rotate_dyn<R>(p, p.x[w], b, t, c, ss);
            else rotate_typed<R, T, V>(p, p.x[w], b, t, c, ss);
        }
    }
}

// ---- table gradients: one block per output row (b', t), one thread per channel ----------

struct GradP {
    RopeP p;
    const char *g[2];
    int64_t g_s[2][3];
    pe_dtype g_dt;
    char *dcos, *dsin;
};

template <typename R> __global__ void rope_table_grad_kernel(const GradP gp) {
    const RopeP &p = gp.p;
    const int64_t Bc = p.src.table_batch, T = p.T, Rw = p.R, h = Rw / 2;
    const int64_t A = p.src.axes, nrow = Bc * T;
    for (int64_t row = blockIdx.x; row < nrow; row += gridDim.x) {
        const int64_t bc = row / T, t = row - bc * T;
        const int64_t b0 = Bc == 1 ? 0 : bc, b1 = Bc == 1 ? p.B : bc + 1;
        for (int64_t e = threadIdx.x; e < Rw; e += blockDim.x) {
            const bool first = p.pairing == PE_PAIR_HALF ? e < h : (e % 2 == 0);
            const int64_t pe = p.pairing == PE_PAIR_HALF ? (first ? e + h : e - h)
                                                         : (first ? e + 1 : e - 1);
            R acc_c = 0, acc_s = 0;
            for (int64_t b = b0; b < b1; ++b) {
                for (int w = 0; w < 2; ++w) {
                    const TensorP &x = p.x[w];
                    const size_t xes = dtype_size_dev(x.in_dt), ges = dtype_size_dev(gp.g_dt);
                    for (int64_t hd = 0; hd < x.heads; ++hd) {
                        const char *xr = x.in + (b * x.in_s[0] + t * x.in_s[1] + hd * x.in_s[2]) *
                                                    static_cast<int64_t>(xes);
                        const char *gr = gp.g[w] + (b * gp.g_s[w][0] + t * gp.g_s[w][1] +
                                                    hd * gp.g_s[w][2]) * static_cast<int64_t>(ges);
                        const R g = load_dyn<R>(gr, e, gp.g_dt);
                        acc_c = add(acc_c, mul(g, load_dyn<R>(xr, e, x.in_dt)));
                        const R gx = mul(g, load_dyn<R>(xr, pe, x.in_dt));
                        acc_s = first ? sub(acc_s, gx) : add(acc_s, gx);
                    }
                }
            }
            const int64_t ax_e = A == 1 ? 0 : p.src.axis[slot_of(p.pairing, e, Rw)];
            for (int64_t ax = 0; ax < A; ++ax) {
                const int64_t i = ((ax * Bc + bc) * T + t) * Rw + e;
                const bool mine = ax == ax_e;
                store_dyn<R>(gp.dcos, i, p.src.table_dt, mine ? acc_c : R(0));
                store_dyn<R>(gp.dsin, i, p.src.table_dt, mine ? acc_s : R(0));
            }
        }
    }
}

// ---- tables from positions: one block per (b, t) ---------------------------------------

__global__ void rope_tables_kernel(const RopeP p, pe_dtype out_dt, char *cos, char *sin) {
    extern __shared__ __align__(16) unsigned char smem[];
    float *c = reinterpret_cast<float *>(smem), *s = c + p.R;
    const int64_t nrow = p.src.pos_batch * p.T;
    for (int64_t row = blockIdx.x; row < nrow; row += gridDim.x) {
        const int64_t b = row / p.T, t = row - b * p.T;
        __syncthreads();
        token_tables<float>(p, b, t, c, s);
        __syncthreads();
        for (int64_t e = threadIdx.x; e < p.R; e += blockDim.x) {
            store_dyn<float>(cos, row * p.R + e, out_dt, c[e]);
            store_dyn<float>(sin, row * p.R + e, out_dt, s[e]);
        }
    }
}

// ---- host side --------------------------------------------------------------------------

thread_local cudaError_t last_error = cudaSuccess;

int launched() {
    const cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return PE_OK;
    last_error = err;
    return PE_ERR_CUDA;
}

bool dtype_valid(pe_dtype t) { return dtype_size(t) != 0; }

// The checks of rope.c, plus the width limit of the parameter struct.
bool tensor_ok(const pe_rope_tensor &x, bool empty) {
    if (x.heads == 0) return true;
    return x.heads > 0 && dtype_valid(x.in_dtype) && dtype_valid(x.out_dtype) &&
           (empty || (x.in && x.out));
}

bool sizes_ok(const pe_rope_args *a) {
    if (!a || a->batch < 0 || a->seq < 0 || a->head_dim < 0) return false;
    if (a->rot_dim < 2 || a->rot_dim % 2 || a->rot_dim > a->head_dim) return false;
    if (a->rot_dim > PE_CUDA_MAX_ROT) return false;
    if (a->pairing != PE_PAIR_HALF && a->pairing != PE_PAIR_ADJACENT) return false;
    if (const uint8_t *axis = a->src.axis_of_slot)
        for (int64_t i = 0; i < a->rot_dim / 2; ++i)
            if (axis[i] > 2) return false;
    return true;
}

bool positions_ok(const pe_rope_source &s, int64_t batch) {
    return s.pos && s.inv_freq && (s.pos_batch == 1 || s.pos_batch == batch);
}

bool table_shape_ok(const pe_rope_source &s, int64_t batch) {
    return dtype_valid(s.table_dtype) && (s.table_batch == 1 || s.table_batch == batch);
}

TensorP tensor_params(const pe_rope_tensor &x) {
    TensorP t{};
    t.in = static_cast<const char *>(x.in);
    t.out = static_cast<char *>(x.out);
    for (int i = 0; i < 3; ++i) t.in_s[i] = x.in_stride[i], t.out_s[i] = x.out_stride[i];
    t.heads = x.heads;
    t.in_dt = x.in_dtype;
    t.out_dt = x.out_dtype;
    return t;
}

RopeP rope_params(const pe_rope_args *a) {
    RopeP p{};
    p.B = a->batch;
    p.T = a->seq;
    p.D = a->head_dim;
    p.R = a->rot_dim;
    p.pairing = a->pairing;
    p.transpose = a->transpose;
    const pe_rope_source &s = a->src;
    SourceP &src = p.src;
    src.positions = s.pos != nullptr;
    src.cos = static_cast<const char *>(s.cos);
    src.sin = static_cast<const char *>(s.sin);
    src.table_dt = s.table_dtype;
    src.table_batch = s.table_batch;
    src.pos = s.pos;
    src.pos_batch = s.pos_batch;
    for (int i = 0; i < 3; ++i) src.table_s[i] = s.table_stride[i], src.pos_s[i] = s.pos_stride[i];
    src.inv_freq = s.inv_freq;
    src.scaling = s.scaling;
    src.axes = s.axis_of_slot ? 3 : 1;
    if (s.axis_of_slot) std::memcpy(src.axis, s.axis_of_slot, static_cast<size_t>(a->rot_dim / 2));
    p.x[0] = tensor_params(a->q);
    p.x[1] = tensor_params(a->k);
    return p;
}

// The fp64 core runs when any tensor of the call is fp64 (as on the CPU).
bool wants_f64(const pe_rope_args *a, pe_dtype extra) {
    bool f64 = a->q.in_dtype == PE_FLOAT64 || a->q.out_dtype == PE_FLOAT64 || extra == PE_FLOAT64;
    if (a->k.heads) f64 |= a->k.in_dtype == PE_FLOAT64 || a->k.out_dtype == PE_FLOAT64;
    if (!a->src.pos) f64 |= a->src.table_dtype == PE_FLOAT64;
    return f64;
}

// Blocks for n independent rows: enough to fill every SM several times over, grid-stride
// beyond that.
unsigned grid_for(int64_t n) {
    static thread_local int sms = 0;
    if (sms == 0) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
            sms = 132;
    }
    const int64_t cap = static_cast<int64_t>(sms) * 32;
    return static_cast<unsigned>(n < cap ? n : cap);
}

// 16-byte accesses need every row start and every half (or pass-through) offset aligned.
bool rows_aligned(const pe_rope_args *a, int64_t vec, size_t es) {
    const int64_t R = a->rot_dim, D = a->head_dim;
    if ((a->pairing == PE_PAIR_HALF ? R / 2 : R) % vec || (D - R) % vec) return false;
    const int64_t bytes = vec * static_cast<int64_t>(es);
    const int64_t sizes[3] = {a->batch, a->seq, 0};
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    for (const pe_rope_tensor *x : xs) {
        if (x->heads == 0) continue;
        if (reinterpret_cast<uintptr_t>(x->in) % bytes || reinterpret_cast<uintptr_t>(x->out) % bytes)
            return false;
        for (int d = 0; d < 3; ++d) {
            const int64_t n = d == 2 ? x->heads : sizes[d];
            if (n > 1 && ((x->in_stride[d] * static_cast<int64_t>(es)) % bytes ||
                          (x->out_stride[d] * static_cast<int64_t>(es)) % bytes))
                return false;
        }
    }
    return true;
}

template <typename R, typename T, int V>
void launch_apply(const RopeP &p, int64_t ntok, cudaStream_t stream) {
    const size_t shm = 3 * static_cast<size_t>(p.R) * sizeof(R);
    rope_apply_kernel<R, T, V><<<grid_for(ntok), kApplyThreads, shm, stream>>>(p);
}

// One dtype for every tensor of the call (the common case): its typed rows.
template <typename R, typename T>
void launch_typed(const pe_rope_args *a, const RopeP &p, int64_t ntok, cudaStream_t stream) {
    constexpr size_t es = sizeof(typename Io<T>::storage);
    constexpr int V = static_cast<int>(16 / es);
    if (rows_aligned(a, V, es)) launch_apply<R, T, V>(p, ntok, stream);
    else launch_apply<R, T, 1>(p, ntok, stream);
}

bool uniform_dtype(const pe_rope_args *a, pe_dtype *dt) {
    *dt = a->q.in_dtype;
    if (a->q.out_dtype != *dt) return false;
    return a->k.heads == 0 || (a->k.in_dtype == *dt && a->k.out_dtype == *dt);
}

} // namespace

extern "C" {

const char *pe_cuda_last_error(void) { return cudaGetErrorString(last_error); }

int pe_cuda_rope_apply(const pe_rope_args *a, cudaStream_t stream) {
    if (!sizes_ok(a)) return PE_ERR_ARG;
    const bool empty = a->batch == 0 || a->seq == 0;
    if (!tensor_ok(a->q, empty) || !tensor_ok(a->k, empty)) return PE_ERR_ARG;
    if (empty) return PE_OK;
    const pe_rope_source &s = a->src;
    if (s.pos ? !positions_ok(s, a->batch) : !(s.cos && s.sin && table_shape_ok(s, a->batch)))
        return PE_ERR_ARG;
    const RopeP p = rope_params(a);
    const int64_t ntok = a->batch * a->seq;
    pe_dtype dt;
    const bool uniform = uniform_dtype(a, &dt);
    if (wants_f64(a, PE_FLOAT32)) {
        if (uniform) launch_typed<double, double>(a, p, ntok, stream);
        else launch_apply<double, void, 1>(p, ntok, stream);
    } else if (!uniform) {
        launch_apply<float, void, 1>(p, ntok, stream);
    } else if (dt == PE_FLOAT32) {
        launch_typed<float, float>(a, p, ntok, stream);
    } else if (dt == PE_BFLOAT16) {
        launch_typed<float, Bf16>(a, p, ntok, stream);
    } else {
        launch_typed<float, F16>(a, p, ntok, stream);
    }
    return launched();
}

int pe_cuda_rope_table_grad(const pe_rope_args *a, const void *grad_q,
                            const int64_t grad_q_stride[3], const void *grad_k,
                            const int64_t grad_k_stride[3], pe_dtype grad_dtype, void *dcos,
                            void *dsin, cudaStream_t stream) {
    if (!sizes_ok(a) || a->src.pos || !table_shape_ok(a->src, a->batch) || !dtype_valid(grad_dtype))
        return PE_ERR_ARG;
    const bool no_input = a->batch == 0 || a->seq == 0;
    if (!tensor_ok(a->q, no_input) || !tensor_ok(a->k, no_input)) return PE_ERR_ARG;
    if (!no_input && ((a->q.heads && !grad_q) || (a->k.heads && !grad_k))) return PE_ERR_ARG;
    if (a->src.table_batch == 0 || a->seq == 0) return PE_OK;
    if (!dcos || !dsin) return PE_ERR_ARG;
    GradP gp{};
    gp.p = rope_params(a);
    gp.g[0] = static_cast<const char *>(grad_q);
    gp.g[1] = static_cast<const char *>(grad_k);
    for (int i = 0; i < 3; ++i) {
        gp.g_s[0][i] = a->q.heads ? grad_q_stride[i] : 0;
        gp.g_s[1][i] = a->k.heads ? grad_k_stride[i] : 0;
    }
    gp.g_dt = grad_dtype;
    gp.dcos = static_cast<char *>(dcos);
    gp.dsin = static_cast<char *>(dsin);
    const int64_t nrow = a->src.table_batch * a->seq;
    const unsigned threads = a->rot_dim >= 256 ? 256 : static_cast<unsigned>((a->rot_dim + 31) / 32 * 32);
    if (wants_f64(a, grad_dtype)) rope_table_grad_kernel<double><<<grid_for(nrow), threads, 0, stream>>>(gp);
    else rope_table_grad_kernel<float><<<grid_for(nrow), threads, 0, stream>>>(gp);
    return launched();
}

int pe_cuda_rope_tables(const pe_rope_args *a, pe_dtype out_dtype, void *cos, void *sin,
                        cudaStream_t stream) {
    if (!sizes_ok(a) || !dtype_valid(out_dtype) || a->src.pos_batch < 0) return PE_ERR_ARG;
    if (a->src.pos_batch == 0 || a->seq == 0) return PE_OK;
    if (!positions_ok(a->src, a->batch) || !cos || !sin) return PE_ERR_ARG;
    const RopeP p = rope_params(a);
    const size_t shm = 2 * static_cast<size_t>(a->rot_dim) * sizeof(float);
    rope_tables_kernel<<<grid_for(a->src.pos_batch * a->seq), kApplyThreads, shm, stream>>>(
        p, out_dtype, static_cast<char *>(cos), static_cast<char *>(sin));
    return launched();
}

} // extern "C"

// The bodies of the CUDA RoPE kernels (posenc_cuda.h), written for one thread of a block:
// each function takes the thread's lane (index, count) instead of reading threadIdx/blockDim,
// so the same code runs in the kernels (rope.cu) and, thread by thread, on the host in the
// emulation test (tests/test_emulated.cu), which compares it bit for bit with the CPU.
// What a thread keeps from one group of tokens to the next lives in an object (ApplyThread)
// that the emulation keeps per thread; where a kernel synchronizes its block (the fused
// path's shared rows), the emulation runs every thread through one phase before any starts
// the next.  The host side (checks, parameters, the choice of kernel and the launch loop) is
// at the end, shared by rope.cu and the emulation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cvt_model.h"  // the host model of the conversion instructions
#include "posenc_cuda.h"
#include "rope_check.h" // the argument checks, shared with the CPU entry points
#include "rope_math.h"  // the per-element math, shared with the CPU kernels

namespace pe_cuda {

constexpr int kMaxSlots = PE_CUDA_MAX_ROT / 2;
// apply: threads per block
constexpr int kApplyThreads = 256;

#if defined(__CUDA_ARCH__)
#define PE_UNROLL _Pragma("unroll")
#define PE_NO_UNROLL _Pragma("unroll 1")
#else
#define PE_UNROLL
#define PE_NO_UNROLL
#endif

struct Lane {
    int id, count; // this thread, threads of the block
};

template <typename T> struct Tag {
    using type = T;
};

// ---- dtypes: storage tags and their conversions -------------------------------------------
//
// To bf16 / fp16 the kernels round with the hardware's conversion, two values per
// instruction (cvt.rn.bf16x2.f32, cvt.rn.f16x2.f32), and they widen fp16 with cvt.f32.f16.
// For every value but NaN these give the CPU's pe_f32_to_bf16 / pe_f32_to_f16 /
// pe_f16_to_f32 (rope_math.h): round to nearest even, subnormals kept, overflow to infinity.
// test_emulated.cu compares the instructions' documented semantics (their model,
// cvt_model.h, which the host build runs in their place) with the CPU's functions over all
// 2^32 fp32 bit patterns; math_device.cu compares the instructions themselves on a GPU.  A
// NaN result: one value (the element-by-element variants) is stored with the CPU's encoding
// (pe_bf16_of_nan, pe_f16_of_nan, by a select); a vector stores the instruction's NaN.  NaN
// bits are outside the contract (posenc_cuda.h), and NVIDIA's arithmetic has already made
// any NaN its canonical one; a fix-up in the vectors cost registers and code (two NaN tests
// per element pair, and a rare path that kept values alive across the rotation).

struct Bf16 {};
struct F16 {};

PE_HD uint32_t cvt_bf16x2(float lo, float hi) { // lo in bits 0-15
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t u;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));
    return u;
#elif defined(__CUDA_ARCH__)
    const __nv_bfloat162_raw r = __floats2bfloat162_rn(lo, hi);
    return static_cast<uint32_t>(r.x) | static_cast<uint32_t>(r.y) << 16;
#else
    return static_cast<uint32_t>(cvt_rn_bf16_model(lo)) |
           static_cast<uint32_t>(cvt_rn_bf16_model(hi)) << 16;
#endif
}

PE_HD uint32_t cvt_f16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t u;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));
    return u;
#elif defined(__CUDA_ARCH__)
    const __half2_raw r = __floats2half2_rn(lo, hi);
    return static_cast<uint32_t>(r.x) | static_cast<uint32_t>(r.y) << 16;
#else
    return static_cast<uint32_t>(cvt_rn_f16_model(lo)) |
           static_cast<uint32_t>(cvt_rn_f16_model(hi)) << 16;
#endif
}

PE_HD float cvt_f32_f16(uint16_t h) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    return cvt_f32_f16_model(h);
#endif
}

// One value rounded to bf16 / fp16: the CPU's bits for every input.
PE_HD uint16_t round_bf16(float x) {
    const uint16_t h = static_cast<uint16_t>(cvt_bf16x2(x, 0.0f));
    return x != x ? pe_bf16_of_nan(pe_f32_bits(x)) : h;
}

PE_HD uint16_t round_f16(float x) {
    const uint16_t h = static_cast<uint16_t>(cvt_f16x2(x, 0.0f));
    return x != x ? pe_f16_of_nan(pe_f32_bits(x)) : h;
}

// Whether any lane of the warp (of those here) has p; on the host, the thread's own p.
PE_HD bool warp_any(bool p) {
#if defined(__CUDA_ARCH__)
    return __any_sync(__activemask(), p);
#else
    return p;
#endif
}

// A barrier of the warp's threads that are here (__syncwarp, which orders memory): the
// compilers may move no load or shared-memory read across it.  After an item's loads it
// keeps every load issued before any is used (ptxas would otherwise hold some back to save
// registers, and the thread would wait for memory twice: scripts/cuda_sass_check.py, memory
// trips); between the pieces of an item it keeps each piece's work, and the registers it
// needs, from being started early.  Two instructions (VOTE, WARPSYNC).
PE_HD void warp_fence() {
#if defined(__CUDA_ARCH__)
    __syncwarp(__activemask());
#endif
}

// Element conversions of the element-by-element paths (mixed dtypes, the table ops): the
// CPU's functions, NaN payloads included (a copied channel keeps its bits).
template <typename T> struct Io;
template <> struct Io<float> {
    using storage = float;
    template <typename R> PE_HD static R load(float v) { return static_cast<R>(v); }
    template <typename R> PE_HD static float store(R v) { return static_cast<float>(v); }
};
template <> struct Io<double> {
    using storage = double;
    template <typename R> PE_HD static R load(double v) { return static_cast<R>(v); }
    template <typename R> PE_HD static double store(R v) { return static_cast<double>(v); }
};
template <> struct Io<Bf16> {
    using storage = uint16_t;
    template <typename R> PE_HD static R load(uint16_t v) {
        return static_cast<R>(pe_bf16_to_f32(v));
    }
    template <typename R> PE_HD static uint16_t store(R v) {
        if constexpr (std::is_same_v<R, double>)
            return pe_f64_to_bf16(v);
        else
            return round_bf16(v);
    }
};
template <> struct Io<F16> {
    using storage = uint16_t;
    template <typename R> PE_HD static R load(uint16_t v) {
        return static_cast<R>(pe_f16_to_f32(v));
    }
    template <typename R> PE_HD static uint16_t store(R v) {
        if constexpr (std::is_same_v<R, double>)
            return pe_f64_to_f16(v);
        else
            return round_f16(v);
    }
};

template <typename T> PE_HD constexpr size_t storage_size() {
    if constexpr (std::is_void_v<T>)
        return 0;
    else
        return sizeof(typename Io<T>::storage);
}

template <typename R> PE_HD R load_dyn(const char *base, int64_t i, pe_dtype dt) {
    switch (dt) {
    case PE_FLOAT32: return Io<float>::load<R>(reinterpret_cast<const float *>(base)[i]);
    case PE_FLOAT64: return Io<double>::load<R>(reinterpret_cast<const double *>(base)[i]);
    case PE_BFLOAT16: return Io<Bf16>::load<R>(reinterpret_cast<const uint16_t *>(base)[i]);
    default: return Io<F16>::load<R>(reinterpret_cast<const uint16_t *>(base)[i]);
    }
}

template <typename R> PE_HD void store_dyn(char *base, int64_t i, pe_dtype dt, R v) {
    switch (dt) {
    case PE_FLOAT32: reinterpret_cast<float *>(base)[i] = Io<float>::store(v); break;
    case PE_FLOAT64: reinterpret_cast<double *>(base)[i] = Io<double>::store(v); break;
    case PE_BFLOAT16: reinterpret_cast<uint16_t *>(base)[i] = Io<Bf16>::store(v); break;
    default: reinterpret_cast<uint16_t *>(base)[i] = Io<F16>::store(v); break;
    }
}

// Unfused arithmetic: each product and sum rounded (the _rn intrinsics on the device).
PE_HD float mul(float a, float b) {
    return PE_FMUL(a, b);
}
PE_HD double mul(double a, double b) {
    return PE_DMUL(a, b);
}
PE_HD float add(float a, float b) {
    return PE_FADD(a, b);
}
PE_HD double add(double a, double b) {
    return PE_DADD(a, b);
}
PE_HD float sub(float a, float b) {
    return PE_FADD(a, -b);
}
PE_HD double sub(double a, double b) {
    return PE_DADD(a, -b);
}

// out = x * c + xp * ss, the one formula of every rotated channel (ss: signed sine).
PE_HD float rot(float x, float c, float xp, float ss) {
    return pe_rot_f32(x, c, xp, ss);
}
PE_HD double rot(double x, double c, double xp, double ss) {
    return pe_rot_f64(x, c, xp, ss);
}

// The bytes of {hi, lo} (8 bytes, lo first) that the four nibbles of sel name (prmt).
PE_HD uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t sel) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(lo, hi, sel);
#else
    const uint64_t x = static_cast<uint64_t>(hi) << 32 | lo;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i)
        r |= static_cast<uint32_t>(x >> (8 * ((sel >> (4 * i)) & 7)) & 0xffu) << (8 * i);
    return r;
#endif
}

// ---- 16-byte access: four 32-bit words, loaded and stored whole --------------------------

struct W16 {
    uint32_t w[4];
};

// q and k are read once: a streaming 16-byte load.  The outputs are written once and read
// by the next op, not by this kernel: a streaming 16-byte store.  Tables are read by every
// thread of a token's heads: a cached load.
PE_HD W16 load16_stream(const void *p) {
#if defined(__CUDA_ARCH__)
    const uint4 u = __ldcs(static_cast<const uint4 *>(p));
    return {{u.x, u.y, u.z, u.w}};
#else
    W16 v;
    std::memcpy(&v, p, 16);
    return v;
#endif
}

PE_HD W16 load16(const void *p) {
#if defined(__CUDA_ARCH__)
    const uint4 u = *static_cast<const uint4 *>(p);
    return {{u.x, u.y, u.z, u.w}};
#else
    W16 v;
    std::memcpy(&v, p, 16);
    return v;
#endif
}

PE_HD void store16(void *p, const W16 &v) {
#if defined(__CUDA_ARCH__)
    __stcs(static_cast<uint4 *>(p), make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]));
#else
    std::memcpy(p, &v, 16);
#endif
}

PE_HD double f64_of_words(uint32_t lo, uint32_t hi) {
#if defined(__CUDA_ARCH__)
    return __hiloint2double(static_cast<int>(hi), static_cast<int>(lo));
#else
    const uint64_t u = (static_cast<uint64_t>(hi) << 32) | lo;
    double d;
    std::memcpy(&d, &u, 8);
    return d;
#endif
}

PE_HD uint64_t f64_bits(double d) {
#if defined(__CUDA_ARCH__)
    return static_cast<uint64_t>(__double_as_longlong(d));
#else
    uint64_t u;
    std::memcpy(&u, &d, 8);
    return u;
#endif
}

// n values of R from `row` (shared memory) in 16-byte words, or one 8-byte word for a pair of
// floats, where n * sizeof(R) allows (the caller keeps `row` aligned to that).
template <typename R, int n> PE_HD void read_row(const R *row, R (&out)[n]) {
#if defined(__CUDA_ARCH__)
    if constexpr ((n * sizeof(R)) % 16 == 0) {
        constexpr int per = static_cast<int>(16 / sizeof(R));
PE_UNROLL
        for (int k = 0; k < n; k += per) {
            if constexpr (std::is_same_v<R, float>) {
                const float4 v = *reinterpret_cast<const float4 *>(row + k);
                out[k] = v.x, out[k + 1] = v.y, out[k + 2] = v.z, out[k + 3] = v.w;
            } else {
                const double2 v = *reinterpret_cast<const double2 *>(row + k);
                out[k] = v.x, out[k + 1] = v.y;
            }
        }
    } else if constexpr (n == 2 && std::is_same_v<R, float>) {
        const float2 v = *reinterpret_cast<const float2 *>(row);
        out[0] = v.x, out[1] = v.y;
    } else
#endif
    {
PE_UNROLL
        for (int k = 0; k < n; ++k)
            out[k] = row[k];
    }
}

// How a thread reads and writes V elements of one row.  T: the storage dtype of every
// tensor in and out (void: each tensor its own dtype, one element at a time, V = 1).
// raw: what a load returned (the 16 bytes, one stored element, or for T = void the value
// converted to R); get converts element k of it for the rotation; set rounds the P results
// of elements k.. k+P-1 into a raw (P: 2 in the vectors, an adjacent pair), pack all V;
// partner gives the element an element rotates with.
template <typename R, typename T, int V> struct Unit { // 16 bytes
    using S = typename Io<T>::storage;
    using raw = W16;
    static_assert(V * sizeof(S) == 16, "a vector unit is 16 bytes");
    static constexpr int P = 2;
    PE_HD static raw load(pe_dtype, const char *base, int64_t i) {
        return load16_stream(reinterpret_cast<const S *>(base) + i);
    }
    PE_HD static raw load_table(pe_dtype, const char *base, int64_t i) {
        return load16(reinterpret_cast<const S *>(base) + i);
    }
    PE_HD static void store(pe_dtype, char *base, int64_t i, const raw &v) {
        store16(reinterpret_cast<S *>(base) + i, v);
    }
    PE_HD static R get(const raw &v, int k) {
        if constexpr (std::is_same_v<T, float>)
            return static_cast<R>(pe_bits_f32(v.w[k]));
        else if constexpr (std::is_same_v<T, double>)
            return static_cast<R>(f64_of_words(v.w[2 * k], v.w[2 * k + 1]));
        else if constexpr (std::is_same_v<T, Bf16>) // exact: the bits moved to the top
            return static_cast<R>(
                pe_bits_f32(k & 1 ? v.w[k >> 1] & 0xffff0000u : v.w[k >> 1] << 16));
        else
            return static_cast<R>(cvt_f32_f16(static_cast<uint16_t>(v.w[k >> 1] >> (16 * (k & 1)))));
    }
    PE_HD static void set(raw &v, int k, const R (&x)[P]) { // k even
        if constexpr (std::is_same_v<T, float>) {
            v.w[k] = pe_f32_bits(static_cast<float>(x[0]));
            v.w[k + 1] = pe_f32_bits(static_cast<float>(x[1]));
        } else if constexpr (std::is_same_v<T, double>) {
PE_UNROLL
            for (int i = 0; i < 2; ++i) {
                const uint64_t u = f64_bits(static_cast<double>(x[i]));
                v.w[2 * i] = static_cast<uint32_t>(u);
                v.w[2 * i + 1] = static_cast<uint32_t>(u >> 32);
            }
        } else if constexpr (std::is_same_v<T, Bf16>) {
            v.w[k >> 1] = cvt_bf16x2(x[0], x[1]);
        } else {
            v.w[k >> 1] = cvt_f16x2(x[0], x[1]);
        }
    }
    PE_HD static raw pack(const R (&x)[V]) {
        raw v;
PE_UNROLL
        for (int k = 0; k < V; k += P)
            set(v, k, {x[k], x[k + 1]});
        return v;
    }
    // Element k of the partner chunk pz (step > 0), or the other element of its pair, k^1
    // of v (step = 0: adjacent pairs inside the chunk).  One byte permutation per word,
    // its selector (partner_sel) data rather than a branch: one path for both pairings.
    PE_HD static uint32_t partner_sel(int step) {
        if constexpr (sizeof(S) == 2)
            return step ? 0x7654u : 0x1032u; // pz's word, or v's halves exchanged
        else
            return step ? 0x7654u : 0x3210u; // pz's word, or v's word of element k^1
    }
    PE_HD static R partner(const raw &v, const raw &pz, int k, uint32_t sel) {
        raw w;
        if constexpr (sizeof(S) == 2) {
            w.w[k >> 1] = byte_perm(v.w[k >> 1], pz.w[k >> 1], sel);
        } else if constexpr (sizeof(S) == 4) {
            w.w[k] = byte_perm(v.w[k ^ 1], pz.w[k], sel);
        } else {
            w.w[2 * k] = byte_perm(v.w[2 * (k ^ 1)], pz.w[2 * k], sel);
            w.w[2 * k + 1] = byte_perm(v.w[2 * (k ^ 1) + 1], pz.w[2 * k + 1], sel);
        }
        return get(w, k);
    }
    // v with its pairs' elements exchanged (swap), then the signs of its even and odd
    // elements flipped: exact negation (the CPU's too negates a sine by its sign bit).  Once
    // per item, on the words as loaded.
    PE_HD static raw sign_pairs(const raw &v, bool neg_even, bool neg_odd, bool swap) {
        raw o;
        if constexpr (sizeof(S) == 2) {
            const uint32_t flip = (neg_even ? 0x8000u : 0u) | (neg_odd ? 0x80000000u : 0u);
PE_UNROLL
            for (int k = 0; k < 4; ++k)
                o.w[k] = byte_perm(v.w[k], 0, swap ? 0x1032u : 0x3210u) ^ flip;
        } else {
            constexpr int n = sizeof(S) / 4; // words per element: the sign in its last
            const uint32_t sign = 0x80000000u;
PE_UNROLL
            for (int k = 0; k < 4; ++k) {
                const int e = k / n; // this word's element; the pair's other's word:
                const uint32_t w = swap ? v.w[(e ^ 1) * n + k % n] : v.w[k];
                const bool neg = k % n == n - 1 && (e % 2 ? neg_odd : neg_even);
                o.w[k] = w ^ (neg ? sign : 0u);
            }
        }
        return o;
    }
};

template <typename R, typename T> struct Unit<R, T, 1> { // one element, one dtype
    using S = typename Io<T>::storage;
    using raw = S;
    PE_HD static raw load(pe_dtype, const char *base, int64_t i) {
        return reinterpret_cast<const S *>(base)[i];
    }
    PE_HD static raw load_table(pe_dtype, const char *base, int64_t i) {
        return reinterpret_cast<const S *>(base)[i];
    }
    PE_HD static void store(pe_dtype, char *base, int64_t i, const raw &v) {
        reinterpret_cast<S *>(base)[i] = v;
    }
    PE_HD static R get(const raw &v, int) {
        if constexpr (std::is_same_v<T, F16>)
            return static_cast<R>(cvt_f32_f16(v));
        else
            return Io<T>::template load<R>(v);
    }
    static constexpr int P = 1;
    PE_HD static raw pack(const R (&x)[1]) {
        return Io<T>::store(x[0]);
    }
    PE_HD static void set(raw &v, int, const R (&x)[1]) {
        v = pack(x);
    }
    // one element: adjacent pairs too have a partner element (step 1)
    PE_HD static uint32_t partner_sel(int) {
        return 0;
    }
    PE_HD static R partner(const raw &, const raw &pz, int, uint32_t) {
        return get(pz, 0);
    }
    PE_HD static raw sign_pairs(const raw &v, bool neg, bool, bool) {
        if constexpr (std::is_same_v<S, uint16_t>)
            return neg ? static_cast<uint16_t>(v ^ 0x8000u) : v;
        else
            return neg ? -v : v;
    }
};

template <typename R> struct Unit<R, void, 1> { // one element, any dtype in and out
    using raw = R;
    PE_HD static raw load(const pe_dtype dt, const char *base, int64_t i) {
        return load_dyn<R>(base, i, dt);
    }
    PE_HD static raw load_table(const pe_dtype dt, const char *base, int64_t i) {
        return load_dyn<R>(base, i, dt);
    }
    PE_HD static void store(const pe_dtype dt, char *base, int64_t i, const raw &v) {
        store_dyn<R>(base, i, dt, v);
    }
    PE_HD static R get(const raw &v, int) {
        return v;
    }
    static constexpr int P = 1;
    PE_HD static raw pack(const R (&x)[1]) {
        return x[0];
    }
    PE_HD static void set(raw &v, int, const R (&x)[1]) {
        v = x[0];
    }
    PE_HD static uint32_t partner_sel(int) {
        return 0;
    }
    PE_HD static R partner(const raw &, const raw &pz, int, uint32_t) {
        return pz;
    }
    PE_HD static raw sign_pairs(const raw &v, bool neg, bool, bool) {
        return neg ? -v : v;
    }
};

// Heads one thread carries: their loads are all in flight at once (4 heads x 32 bytes of a
// half-pairing chunk and its partner, with the chunk's 64 bytes of cos and sin), and each
// piece of the chunk's values is converted once for all of them.
constexpr int kHeadsPerThread = 4;

// ---- MRoPE axes: which position axis a frequency slot reads -----------------------------

enum AxisMode : int {
    kAxisNone,        // one axis
    kAxisSections,    // slot i: axis (i >= b1) + (i >= b2)
    kAxisInterleaved, // slot i: 1 if i % 3 == 1 and i < b1, 2 if i % 3 == 2 and i < b2, else 0
    kAxisMap,         // any other map (posenc.h allows one): map[i]
};

// A call's axis map (posenc.h, axis_of_slot) as its section bounds, where it has one of the
// two forms pe_mrope_axis_map builds (b1, b2: 3 s1 and 3 s2 when interleaved), else the map.
struct Axes {
    int mode;
    int b1, b2;
    uint8_t map[kMaxSlots];
};

PE_HD int axis_of(const Axes &a, int i) {
    switch (a.mode) {
    case kAxisSections: return (i >= a.b1) + (i >= a.b2);
    case kAxisInterleaved: {
        const int m = i % 3;
        return m == 1 && i < a.b1 ? 1 : m == 2 && i < a.b2 ? 2 : 0;
    }
    case kAxisMap: return a.map[i];
    default: return 0;
    }
}

// ---- kernel parameters (passed by value) --------------------------------------------------

struct TensorP {
    const char *in;
    char *out;
    int64_t in_s[3], out_s[3]; // b, t, h in elements
    int64_t heads;
    pe_dtype in_dt, out_dt;
};

struct SourceP {
    const char *cos, *sin;
    pe_dtype table_dt;
    int64_t table_batch, table_s[3];
    const int64_t *pos;
    int64_t pos_batch, pos_s[3];
    const float *inv_freq;
    float scaling;
    int axes; // 1 or 3
    Axes ax;  // axis of each frequency slot
};

struct RopeP {
    int64_t B, T, D, R;
    int pairing, transpose;
    SourceP src;
    TensorP x[2]; // q, k (k.heads may be 0)
};

struct GradP {
    RopeP p;
    const char *g[2];
    int64_t g_s[2][3];
    pe_dtype g_dt;
    char *dcos, *dsin;
};

// Where an apply kernel's cos / sin values come from: positions and inv_freq, the angles
// computed once per token into shared memory (Positions); or tables of storage dtype TT
// (TT = void: any dtype, element by element), which each thread reads straight into
// registers, 16 bytes at a time in the vector variants (Tables<TT>).
struct Positions {};
template <typename TT> struct Tables {};
template <typename S> constexpr bool is_positions = std::is_same_v<S, Positions>;

// Blocks of kApplyThreads per SM that an apply kernel's launch bounds promise: 3 caps the
// registers at 65536 / (256 * 3) = 85 per thread (80 usable).  The vector kernels hold a
// chunk's cos and signed-sine values and the 32-byte loads of 4 heads, and the fp64 fused
// kernels their loads across the angles' fp64 arithmetic; they get 2 blocks and 128
// registers: for the vector kernels 512 threads x 128 bytes = 64 KiB of q/k loads in flight
// per SM, twice what 4.3 TB/s over 132 SMs needs at a microsecond of latency.
template <typename R, typename T, int V, typename S> PE_HD constexpr int apply_min_blocks() {
    return V > 1 || (sizeof(R) == 8 && is_positions<S>) ? 2 : 3;
}

PE_HD int64_t slot_of(int pairing, int64_t e, int64_t R) {
    return pairing == PE_PAIR_HALF ? (e < R / 2 ? e : e - R / 2) : e / 2;
}

PE_HD int64_t partner_of(int pairing, int64_t e, int64_t R) {
    if (pairing == PE_PAIR_HALF) return e < R / 2 ? e + R / 2 : e - R / 2;
    return e % 2 == 0 ? e + 1 : e - 1;
}

// sign(e) = -1 on the first channel of each pair
PE_HD bool first_of_pair(int pairing, int64_t e, int64_t R) {
    return pairing == PE_PAIR_HALF ? e < R / 2 : e % 2 == 0;
}

// scaling * cos, scaling * sin of slot i's angle at token (b, t) (fused path): the fast
// reduction, and the exact one (the same result where both apply) on a path the warp takes
// only when one of its lanes has an angle past PE_SINCOS_FAST_LIMIT (or inf or NaN).
PE_HD void slot_sincos(const SourceP &src, int64_t b, int64_t t, int i, float *c, float *s) {
    const int64_t *pos = src.pos + (src.pos_batch == 1 ? 0 : b) * src.pos_s[1] + t * src.pos_s[2];
    const float x = pe_rope_angle(src.inv_freq[i], pos[axis_of(src.ax, i) * src.pos_s[0]]);
    pe_sincos_fast(x, src.scaling, c, s);
    const bool large = !(x <= PE_SINCOS_FAST_LIMIT && x >= -PE_SINCOS_FAST_LIMIT);
    if (warp_any(large) && large) pe_sincos_large(x, src.scaling, c, s);
}

// ---- the token's cos and unsigned sin rows (the tables op) ---------------------------------

PE_HD void token_tables(const RopeP &p, int64_t b, int64_t t, float *c, float *s, Lane l) {
    const int nslot = static_cast<int>(p.R / 2);
    for (int i = l.id; i < nslot; i += l.count) {
        float cv, sv;
        slot_sincos(p.src, b, t, i, &cv, &sv);
        const int e0 = p.pairing == PE_PAIR_HALF ? i : 2 * i;
        const int e1 = p.pairing == PE_PAIR_HALF ? i + nslot : 2 * i + 1;
        c[e0] = c[e1] = cv;
        s[e0] = s[e1] = sv;
    }
}

// ---- apply: how the work of a call is laid out on the block ---------------------------------
//
// A token's work is items: an item is one channel chunk (V elements and, for the half
// pairing, the V partner elements R/2 further; for adjacent pairs with V = 1, one pair) of
// up to four heads (h = r, r + Hs, r + 2 Hs, r + 3 Hs: head group r).  Chunk j of head group
// r is item j + chunks * r.  `lanes` threads per token, `tokens` tokens per block and group
// (one grid-stride step): thread `lane` of a token starts at item `lane` and steps by
// `lanes`, which keeps its chunk (lanes is a multiple of the chunks) unless a head has more
// chunks than the block has threads (then lanes = threads and each thread takes every head
// group of its chunks).  So a thread's chunk j0 and head group r0 are divided out once, and
// it steps j by jstep and r by rstep: no division inside a group.

struct ApplyGrid {
    int rot_items;   // rotated chunks per head
    int chunks;      // all chunks per head: rotated, then pass-through
    int heads, hq;   // q heads + k heads; q heads
    int head_groups; // Hs = ceil(heads / 4)
    int lanes;       // threads per token
    int tokens;      // tokens per group
    int jstep, rstep;
    int step;        // the partner chunk's offset: R/2 (half), 1 (adjacent, V = 1), else 0
    int row_stride;  // positions: elements from a token's cos row to its signed-sine row
    int64_t ntok, groups;
    // the grid: `grid` blocks step `grid * tokens` tokens, (step_b, step_t) as (b, t)
    int64_t grid, T, step_b, step_t;
};

// (b, t) of token `tok`: a 32-bit division when the sizes allow.
PE_HD void split_token(int64_t T, int64_t tok, int64_t *b, int64_t *t) {
    if (T <= UINT32_MAX && tok <= UINT32_MAX) {
        const uint32_t u = static_cast<uint32_t>(tok), T32 = static_cast<uint32_t>(T);
        *b = u / T32;
        *t = u - static_cast<uint32_t>(*b) * T32;
    } else {
        *b = tok / T;
        *t = tok - *b * T;
    }
}

// A thread's chunk: where it starts, and the axis its tables row is read from (every
// element of a vector chunk reads the same axis: with_apply_variant sends calls whose
// sections would split a chunk to the element-by-element variant).
struct Chunk {
    int e;     // first element
    bool pass; // past the rotary width: copied
    int ax;
};

template <int V> PE_HD Chunk chunk_of(const RopeP &p, const ApplyGrid &g, int j) {
    Chunk c{};
    if (j >= g.rot_items) {
        c.e = static_cast<int>(p.R) + (j - g.rot_items) * V;
        c.pass = true;
        return c;
    }
    const bool half = p.pairing == PE_PAIR_HALF;
    c.e = half || V > 1 ? j * V : 2 * j;
    c.ax = axis_of(p.src.ax, half ? c.e : c.e / 2);
    return c;
}

// Where a token's heads start, in and out, and its tables row (element offset, axis 0).
struct Rows {
    const char *in[2];
    char *out[2];
    int64_t table;
};

template <typename T> PE_HD Rows rows_of(const RopeP &p, int64_t b, int64_t t) {
    Rows r{};
PE_UNROLL
    for (int w = 0; w < 2; ++w) {
        const TensorP &x = p.x[w];
        if (!x.heads) continue;
        const size_t ies = std::is_void_v<T> ? pe_dtype_size(x.in_dt) : storage_size<T>();
        const size_t oes = std::is_void_v<T> ? pe_dtype_size(x.out_dt) : storage_size<T>();
        r.in[w] = x.in + static_cast<int64_t>(ies) * (b * x.in_s[0] + t * x.in_s[1]);
        r.out[w] = x.out + static_cast<int64_t>(oes) * (b * x.out_s[0] + t * x.out_s[1]);
    }
    r.table = (p.src.table_batch == 1 ? 0 : b) * p.src.table_s[1] + t * p.src.table_s[2];
    return r;
}

// The cos and signed-sine values of elements k.. k+P-1 of a chunk (P = 2: an adjacent
// pair; 1 in the one-element variants): ca, sa at e+k.. and cz, sz at e+step+k.. (the
// partner chunk; with step = 0 the chunk itself, computed and not stored).  out = x c +
// x_partner ss then reads
//   forward:    ss(e) = -s(e),        ss(e+step) = +s(e+step)
//   transpose:  ss(e) = +s(e+step),   ss(e+step) = -s(e)
// (half pairs, and adjacent pairs one at a time), and for adjacent pairs inside a chunk
// (step = 0; k even is a pair's first, x_partner is x[k^1])
//   forward:    ss[k] = -s[k], ss[k+1] = +s[k+1]
//   transpose:  ss[k] = +s[k+1], ss[k+1] = -s[k]
template <typename R, int P> struct Piece {
    R ca[P], sa[P], cz[P], sz[P];
};

// A chunk's cos and sin as loaded (16 bytes each in the vector variants): cos at e and
// e+step, the sines in the order the signed sines take them (above; with step = 0 the same
// words twice, from the cache).  Loaded apart from their conversion (TableVals) so that a
// thread issues them with its heads' q/k loads and waits for none before all are issued.
template <typename U> struct TableRaw {
    typename U::raw c[2], s[2];
};

template <typename U>
PE_HD TableRaw<U> load_tables(const RopeP &p, const ApplyGrid &g, const Rows &rows,
                              const Chunk &c) {
    const SourceP &src = p.src;
    const int64_t row = rows.table + c.ax * src.table_s[0];
    const int e = c.e, f = c.e + g.step;
    const bool tr = p.transpose;
    TableRaw<U> w;
    w.c[0] = U::load_table(src.table_dt, src.cos, row + e);
    w.c[1] = U::load_table(src.table_dt, src.cos, row + f);
    w.s[0] = U::load_table(src.table_dt, src.sin, row + (tr ? f : e));
    w.s[1] = U::load_table(src.table_dt, src.sin, row + (tr ? e : f));
    return w;
}

// A chunk's pieces from its loaded tables: the sines signed once, on the words (TableVals's
// constructor), then each piece converted when it is rotated (the words of the pieces done
// are free again).
template <typename U, typename R> struct TableVals {
    static constexpr int P = U::P;
    TableRaw<U> w; // the sines signed (and for adjacent pairs ordered) as ss takes them

    PE_HD TableVals(const RopeP &p, const ApplyGrid &g, const TableRaw<U> &loaded) : w(loaded) {
        const bool tr = p.transpose;
        // ss at e + k: -s forward, +s transposed; for adjacent pairs inside the chunk the
        // odd elements the other way and, transposed, each pair's sines exchanged
        w.s[0] = U::sign_pairs(w.s[0], !tr, g.step ? !tr : tr, !g.step && tr);
        w.s[1] = U::sign_pairs(w.s[1], tr, tr, false); // ss at e + step + k
    }

    PE_HD Piece<R, P> operator()(int k) const {
        Piece<R, P> v;
PE_UNROLL
        for (int i = 0; i < P; ++i) {
            v.ca[i] = U::get(w.c[0], k + i);
            v.cz[i] = U::get(w.c[1], k + i);
            v.sa[i] = U::get(w.s[0], k + i);
            v.sz[i] = U::get(w.s[1], k + i);
        }
        return v;
    }
};

// The same pieces from a token's rows in shared memory (already signed: positions_rows).
template <typename R, int P> struct SharedVals {
    const R *c_row, *ss_row;
    int e, f; // the chunk's first element and its partner's

    PE_HD Piece<R, P> operator()(int k) const {
        Piece<R, P> v;
        read_row<R, P>(c_row + e + k, v.ca);
        read_row<R, P>(ss_row + e + k, v.sa);
        read_row<R, P>(c_row + f + k, v.cz);
        read_row<R, P>(ss_row + f + k, v.sz);
        return v;
    }
};

#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDA_ARCH__)
#pragma GCC diagnostic push
// A head's loads and results are read under the conditions they were made under, which
// GCC (the emulation's host build) cannot see; zeroing them first would cost the device an
// instruction for every register.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// ---- one thread of an apply kernel.  Off: the integer type of element offsets inside a
// token (int32_t when every one fits).  Per group: the token's row pointers once; then per
// item of the thread, every load of it issued (its heads' q and k, and with tables its
// chunk's cos and sin), then one piece at a time converted and every head of the item
// rotated with it, then the heads rounded and stored.  So the q/k words of a piece make way
// for its results, and a piece's table values live only while it is rotated: the registers
// hold one item's loads, not its loads and all of its values.

template <typename R, typename T, int V, typename Off, typename S> struct ApplyThread {
    using U = Unit<R, T, V>;
    using raw = typename U::raw;
    static constexpr int NH = kHeadsPerThread, P = U::P;
    // the thread's share of every group: its token, its lane of that token's, its first
    // chunk j0 and head group r0 (the chunk itself, chunk_of(j0), is computed again for each
    // group rather than held in registers)
    int token, j0, r0; // its lane is r0 chunks + j0
    bool active;
    int64_t b, t;     // the token of the current group (b >= B: past the last, or idle)
    raw a[NH]{}, z[NH]{}; // positions: the first item's loads, held across the barrier

    PE_HD ApplyThread(const RopeP &p, const ApplyGrid &g, int64_t block, Lane l) {
        token = l.id / g.lanes;
        const int lane = l.id - token * g.lanes;
        j0 = lane % g.chunks;
        r0 = lane / g.chunks;
        active = token < g.tokens && r0 < g.head_groups;
        split_token(g.T, block * g.tokens + token, &b, &t);
        if (!active) b = p.B; // never busy: one test per group, one register less
    }

    PE_HD bool busy(const RopeP &p) const {
        return b < p.B;
    }

    // the next group of this block: `grid` groups on
    PE_HD void next_group(const ApplyGrid &g) {
        t += g.step_t;
        b += g.step_b;
        if (t >= g.T) t -= g.T, ++b;
    }

    // Head h of the call (< heads): q's head h, or k's head h - hq (w = 1); selects, not an
    // index into the parameters or the rows (which would put them in local memory).  Its
    // element offset, in or out.
    PE_HD static const TensorP &tensor_of(const RopeP &p, const ApplyGrid &g, int h) {
        return p.x[h >= g.hq];
    }
    PE_HD static Off offset_of(const ApplyGrid &g, const Chunk &c, int h, int64_t stride) {
        const Off hh = static_cast<Off>(h >= g.hq ? h - g.hq : h);
        return hh * static_cast<Off>(stride) + c.e;
    }

    // kPair: the partner chunk too, xz (rotated items): at e + step, with step = 0 (adjacent
    // pairs inside the chunk) the chunk again, from the cache.  Unconditional: a load under a
    // predicate would keep its register's old value, and so that register, alive.
    template <bool kPair>
    PE_HD void load_head(const RopeP &p, const ApplyGrid &g, const Rows &rows, const Chunk &c,
                         int h, raw &xa, raw &xz) const {
        const TensorP &x = tensor_of(p, g, h);
        const char *row = h >= g.hq ? rows.in[1] : rows.in[0];
        const Off off = offset_of(g, c, h, x.in_s[2]);
        xa = U::load(x.in_dt, row, off);
        if constexpr (kPair) xz = U::load(x.in_dt, row, off + g.step);
    }

    PE_HD void store_head(const RopeP &p, const ApplyGrid &g, const Rows &rows, const Chunk &c,
                          int h, const raw &wa, const raw &wz) const {
        const TensorP &x = tensor_of(p, g, h);
        char *row = h >= g.hq ? rows.out[1] : rows.out[0];
        const Off off = offset_of(g, c, h, x.out_s[2]);
        U::store(x.out_dt, row, off, wa); // a pass-through chunk: as loaded, the bits themselves
        if (g.step && !c.pass) U::store(x.out_dt, row, off + g.step, wz);
    }

    // the item (chunk c, head group r): heads r, r + Hs, ... below `heads`; in place of the
    // heads past them the last head again (rotated, never stored): no branch, and the loops
    // over a piece's heads need no exit
    template <bool kPair>
    PE_HD void load_heads(const RopeP &p, const ApplyGrid &g, const Rows &rows, const Chunk &c,
                          int r, raw (&xa)[NH], raw (&xz)[NH]) const {
PE_UNROLL
        for (int s = 0; s < NH; ++s) {
            const int h = r + s * g.head_groups;
            load_head<kPair>(p, g, rows, c, h < g.heads ? h : g.heads - 1, xa[s], xz[s]);
        }
    }

    PE_HD void load_item(const RopeP &p, const ApplyGrid &g, const Rows &rows, const Chunk &c,
                         int r, raw (&xa)[NH], raw (&xz)[NH]) const {
        if (c.pass)
            load_heads<false>(p, g, rows, c, r, xa, xz);
        else
            load_heads<true>(p, g, rows, c, r, xa, xz);
    }

    // A pass-through item: its heads stored as loaded (the bits themselves when T is one
    // dtype).
    PE_HD void copy_item(const RopeP &p, const ApplyGrid &g, const Rows &rows, const Chunk &c,
                         int r, const raw (&xa)[NH]) const {
PE_UNROLL
        for (int s = 0; s < NH; ++s) {
            const int h = r + s * g.head_groups;
            if (h >= g.heads) break;
            store_head(p, g, rows, c, h, xa[s], xa[s]);
        }
    }

    // A rotated item: its heads rotated from their loads (xa, and xz: the partner chunks)
    // with the chunk's values vals(k), rounded and stored.
    template <typename Vals>
    PE_HD void rotate_item(const RopeP &p, const ApplyGrid &g, const Rows &rows, const Chunk &c,
                           int r, const raw (&xa)[NH], const raw (&xz)[NH],
                           const Vals &vals) const {
        raw wa[NH], wz[NH];
        const uint32_t sel = U::partner_sel(g.step);
PE_UNROLL
        for (int k = 0; k < V; k += P) {
            if (k) warp_fence(); // one piece at a time
            const Piece<R, P> v = vals(k);
PE_UNROLL
            for (int s = 0; s < NH; ++s) {
                R oa[P], oz[P];
PE_UNROLL
                for (int i = 0; i < P; ++i) {
                    const R x0 = U::get(xa[s], k + i);
                    const R x1 = U::partner(xa[s], xz[s], k + i, sel);
                    oa[i] = rot(x0, v.ca[i], x1, v.sa[i]);
                    oz[i] = rot(x1, v.cz[i], x0, v.sz[i]);
                }
                U::set(wa[s], k, oa); // with step = 0 oz is computed, not stored
                U::set(wz[s], k, oz);
            }
        }
PE_UNROLL
        for (int s = 0; s < NH; ++s) {
            const int h = r + s * g.head_groups;
            if (h >= g.heads) break;
            store_head(p, g, rows, c, h, wa[s], wz[s]);
        }
    }

    // Tables: the whole group, this thread's items (chunk j, head group r), each with its
    // own loads of the tables (a thread with several items reads its chunk's again, from
    // the cache, rather than hold them in registers across its items).
    PE_HD void tables_group(const RopeP &p, const ApplyGrid &g) const {
        if (!busy(p)) return;
        const Rows rows = rows_of<T>(p, b, t);
        Chunk c = chunk_of<V>(p, g, j0);
        for (int j = j0, r = r0;;) {
            raw xa[NH], xz[NH];
            if (c.pass) {
                load_heads<false>(p, g, rows, c, r, xa, xz);
                copy_item(p, g, rows, c, r, xa);
            } else {
                const TableRaw<U> w = load_tables<U>(p, g, rows, c);
                load_heads<true>(p, g, rows, c, r, xa, xz);
                warp_fence(); // every load issued before the first use
                rotate_item(p, g, rows, c, r, xa, xz, TableVals<U, R>(p, g, w));
            }
            if ((r += g.rstep) < g.head_groups) continue;
            if ((j += g.jstep) >= g.chunks) break;
            r = r0;
            c = chunk_of<V>(p, g, j);
        }
    }

    // Positions, phase 1 (before the barrier): the first item's loads.
    PE_HD void positions_load(const RopeP &p, const ApplyGrid &g) {
        if (busy(p)) load_item(p, g, rows_of<T>(p, b, t), chunk_of<V>(p, g, j0), r0, a, z);
    }

    // Positions, phase 2: the thread's share of its token's rows in shared memory, at smem +
    // 2 token row_stride: cos and the signed sine (the forward's ss[e] = sign(e) s[e], the
    // transpose's ss[e] = -sign(e) s[p(e)]) of slots lane, lane + lanes, ... (a slot's two
    // channels are partners).
    PE_HD void positions_rows(const RopeP &p, const ApplyGrid &g, R *smem) const {
        if (!busy(p)) return;
        R *c = smem + 2 * static_cast<int64_t>(token) * g.row_stride, *ss = c + g.row_stride;
        const int nslot = static_cast<int>(p.R / 2);
        for (int i = r0 * g.chunks + j0; i < nslot; i += g.lanes) {
            float cv, sv;
            slot_sincos(p.src, b, t, i, &cv, &sv);
            const int e0 = p.pairing == PE_PAIR_HALF ? i : 2 * i;
            const int e1 = p.pairing == PE_PAIR_HALF ? i + nslot : 2 * i + 1;
            c[e0] = c[e1] = static_cast<R>(cv);
            ss[e0] = p.transpose ? static_cast<R>(sv) : -static_cast<R>(sv);
            ss[e1] = p.transpose ? -static_cast<R>(sv) : static_cast<R>(sv);
        }
    }

    // Positions, phase 3 (after the barrier): the rows' values, every item rotated (the
    // first with the loads of phase 1).
    PE_HD void positions_finish(const RopeP &p, const ApplyGrid &g, const R *smem) {
        if (!busy(p)) return;
        const Rows rows = rows_of<T>(p, b, t);
        const R *c_row = smem + 2 * static_cast<int64_t>(token) * g.row_stride;
        Chunk c = chunk_of<V>(p, g, j0);
        for (int j = j0, r = r0;;) {
            const SharedVals<R, P> vals{c_row, c_row + g.row_stride, c.e, c.e + g.step};
            if (c.pass)
                copy_item(p, g, rows, c, r, a);
            else
                rotate_item(p, g, rows, c, r, a, z, vals);
            if ((r += g.rstep) >= g.head_groups) {
                if ((j += g.jstep) >= g.chunks) break;
                r = r0;
                c = chunk_of<V>(p, g, j);
            }
            load_item(p, g, rows, c, r, a, z);
            warp_fence(); // every load issued before the first use
        }
    }
};

#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDA_ARCH__)
#pragma GCC diagnostic pop
#endif

// ---- table gradients: row (b', t) of dcos/dsin, one lane per channel ---------------------

// One element of a tensor of storage dtype T (void: of dtype dt, chosen at run time).
template <typename R, typename T> PE_HD R load_as(const char *base, int64_t i, pe_dtype dt) {
    if constexpr (std::is_void_v<T>)
        return load_dyn<R>(base, i, dt);
    else
        return Io<T>::template load<R>(reinterpret_cast<const typename Io<T>::storage *>(base)[i]);
}

// Sums in a fixed order (batch, then q heads, then k heads), as the CPU does.  G: the
// gradients' dtype, X: q's and k's (void: any, per tensor), chosen once per launch.
template <typename R, typename G, typename X>
PE_HD void table_grad_row(const GradP &gp, int64_t row, Lane l) {
    const RopeP &p = gp.p;
    const int64_t Bc = p.src.table_batch, T = p.T, Rw = p.R, A = p.src.axes;
    const int64_t bc = row / T, t = row - bc * T;
    const int64_t b0 = Bc == 1 ? 0 : bc, b1 = Bc == 1 ? p.B : bc + 1;
    const int64_t ges = static_cast<int64_t>(pe_dtype_size(gp.g_dt));
    for (int64_t e = l.id; e < Rw; e += l.count) {
        const bool first = first_of_pair(p.pairing, e, Rw);
        const int64_t pe = partner_of(p.pairing, e, Rw);
        R acc_c = 0, acc_s = 0;
        for (int64_t b = b0; b < b1; ++b) {
            for (int w = 0; w < 2; ++w) {
                const TensorP &x = p.x[w];
                const int64_t xes = static_cast<int64_t>(pe_dtype_size(x.in_dt));
                for (int64_t hd = 0; hd < x.heads; ++hd) {
                    const char *xr = x.in + (b * x.in_s[0] + t * x.in_s[1] + hd * x.in_s[2]) * xes;
                    const char *gr =
                        gp.g[w] + (b * gp.g_s[w][0] + t * gp.g_s[w][1] + hd * gp.g_s[w][2]) * ges;
                    const R g = load_as<R, G>(gr, e, gp.g_dt);
                    acc_c = add(acc_c, mul(g, load_as<R, X>(xr, e, x.in_dt)));
                    const R gx = mul(g, load_as<R, X>(xr, pe, x.in_dt));
                    acc_s = first ? sub(acc_s, gx) : add(acc_s, gx);
                }
            }
        }
        const int64_t mine = axis_of(p.src.ax, static_cast<int>(slot_of(p.pairing, e, Rw)));
        for (int64_t ax = 0; ax < A; ++ax) {
            const int64_t i = ((ax * Bc + bc) * T + t) * Rw + e;
            store_dyn<R>(gp.dcos, i, p.src.table_dt, ax == mine ? acc_c : R(0));
            store_dyn<R>(gp.dsin, i, p.src.table_dt, ax == mine ? acc_s : R(0));
        }
    }
}

// ---- tables from positions: store the fp32 rows of (b, t) -----------------------------------

PE_HD void store_tables_row(const RopeP &p, int64_t row, const float *c, const float *s,
                            pe_dtype out_dt, char *cos, char *sin, Lane l) {
    for (int64_t e = l.id; e < p.R; e += l.count) {
        store_dyn<float>(cos, row * p.R + e, out_dt, c[e]);
        store_dyn<float>(sin, row * p.R + e, out_dt, s[e]);
    }
}

// ---- host: parameters and the choice of kernel ----------------------------------------------

inline Axes axes_of(const uint8_t *map, int n) {
    Axes a{};
    if (!map) return a;
    int64_t sec[3] = {0, 0, 0};
    for (int i = 0; i < n; ++i)
        ++sec[map[i]];
    uint8_t built[kMaxSlots];
    for (int interleaved = 0; interleaved < 2; ++interleaved) {
        if (pe_mrope_axis_map(n, sec, interleaved, built) == PE_OK &&
            std::memcmp(built, map, static_cast<size_t>(n)) == 0) {
            a.mode = interleaved ? kAxisInterleaved : kAxisSections;
            a.b1 = static_cast<int>(interleaved ? 3 * sec[1] : sec[0]);
            a.b2 = static_cast<int>(interleaved ? 3 * sec[2] : sec[0] + sec[1]);
            return a;
        }
    }
    a.mode = kAxisMap;
    std::memcpy(a.map, map, static_cast<size_t>(n));
    return a;
}

inline TensorP tensor_params(const pe_rope_tensor &x) {
    TensorP t{};
    t.in = static_cast<const char *>(x.in);
    t.out = static_cast<char *>(x.out);
    for (int i = 0; i < 3; ++i)
        t.in_s[i] = x.in_stride[i], t.out_s[i] = x.out_stride[i];
    t.heads = x.heads;
    t.in_dt = x.in_dtype;
    t.out_dt = x.out_dtype;
    return t;
}

inline RopeP rope_params(const pe_rope_args *a) {
    RopeP p{};
    p.B = a->batch;
    p.T = a->seq;
    p.D = a->head_dim;
    p.R = a->rot_dim;
    p.pairing = a->pairing;
    p.transpose = a->transpose;
    const pe_rope_source &s = a->src;
    SourceP &src = p.src;
    src.cos = static_cast<const char *>(s.cos);
    src.sin = static_cast<const char *>(s.sin);
    src.table_dt = s.table_dtype;
    src.table_batch = s.table_batch;
    src.pos = s.pos;
    src.pos_batch = s.pos_batch;
    for (int i = 0; i < 3; ++i)
        src.table_s[i] = s.table_stride[i], src.pos_s[i] = s.pos_stride[i];
    src.inv_freq = s.inv_freq;
    src.scaling = s.scaling;
    src.axes = s.axis_of_slot ? 3 : 1;
    src.ax = axes_of(s.axis_of_slot, static_cast<int>(a->rot_dim / 2));
    p.x[0] = tensor_params(a->q);
    p.x[1] = tensor_params(a->k);
    return p;
}

// A tensor runs in fp64 when it or the tables are fp64; its result never depends on the
// other tensor's dtype (rope.c).
inline bool runs_f64(const pe_rope_args *a, const pe_rope_tensor &x) {
    return x.heads && (x.in_dtype == PE_FLOAT64 || x.out_dtype == PE_FLOAT64 ||
                       (!a->src.pos && a->src.table_dtype == PE_FLOAT64));
}

// The launches of an apply call: one, or one per tensor when q and k run in different
// precisions (the other tensor's heads set to 0).  Returns how many.
inline int apply_passes(const pe_rope_args *a, pe_rope_args pass[2]) {
    pass[0] = *a;
    if (!a->q.heads || !a->k.heads || runs_f64(a, a->q) == runs_f64(a, a->k)) return 1;
    pass[1] = *a;
    pass[0].k.heads = 0;
    pass[1].q.heads = 0;
    return 2;
}

inline bool table_grad_f64(const pe_rope_args *a, pe_dtype grad_dtype) {
    return grad_dtype == PE_FLOAT64 || a->src.table_dtype == PE_FLOAT64 ||
           (a->q.heads && a->q.in_dtype == PE_FLOAT64) ||
           (a->k.heads && a->k.in_dtype == PE_FLOAT64);
}

// The layout of an apply launch of `threads` threads per block (ApplyGrid) for a call with
// at least one head and one token; set_grid completes it with the launch's blocks.
template <int V> ApplyGrid apply_grid(const RopeP &p, int threads) {
    ApplyGrid g{};
    const int Rw = static_cast<int>(p.R), D = static_cast<int>(p.D);
    const int nh = kHeadsPerThread;
    g.rot_items = p.pairing == PE_PAIR_HALF ? Rw / 2 / V : V == 1 ? Rw / 2 : Rw / V;
    g.chunks = g.rot_items + (D - Rw) / V;
    g.hq = static_cast<int>(p.x[0].heads);
    g.heads = static_cast<int>(p.x[0].heads + p.x[1].heads);
    g.head_groups = (g.heads + nh - 1) / nh;
    const int items = g.chunks * g.head_groups;
    g.lanes = items <= threads    ? items
              : g.chunks <= threads ? threads / g.chunks * g.chunks
                                    : threads;
    g.jstep = g.chunks <= threads ? g.chunks : threads;
    g.step = p.pairing == PE_PAIR_HALF ? Rw / 2 : V == 1 ? 1 : 0;
    g.rstep = g.chunks <= threads ? g.lanes / g.chunks : 1;
    g.ntok = p.B * p.T;
    g.tokens = threads / g.lanes;
    if (g.tokens > g.ntok) g.tokens = static_cast<int>(g.ntok);
    const int align = 4; // 16 bytes of fp32 (and of fp64 at an even count)
    g.row_stride = (Rw + align - 1) / align * align;
    g.groups = (g.ntok + g.tokens - 1) / g.tokens;
    g.T = p.T;
    return g;
}

inline void set_grid(ApplyGrid &g, int64_t grid) {
    g.grid = grid;
    const int64_t step = grid * g.tokens;
    g.step_b = step / g.T;
    g.step_t = step - g.step_b * g.T;
}

template <typename R, typename S> size_t apply_shared_bytes(const ApplyGrid &g) {
    if constexpr (!is_positions<S>) return 0;
    return 2 * static_cast<size_t>(g.tokens) * static_cast<size_t>(g.row_stride) * sizeof(R);
}

// Whether every element offset inside a token, head stride included, fits in int32_t.
inline bool offsets_fit_32(const pe_rope_args *a) {
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    for (const pe_rope_tensor *x : xs) {
        if (x->heads == 0) continue;
        const int64_t s[2] = {x->in_stride[2], x->out_stride[2]};
        for (int64_t st : s)
            if (st < 0 || (x->heads > 1 && st > (INT32_MAX - a->head_dim) / (x->heads - 1)))
                return false;
    }
    return a->head_dim < INT32_MAX;
}

// 16-byte accesses need every row start and every half (or pass-through) offset aligned.
inline bool rows_aligned(const pe_rope_args *a, int64_t vec, int64_t es) {
    const int64_t R = a->rot_dim, D = a->head_dim, bytes = vec * es;
    if ((a->pairing == PE_PAIR_HALF ? R / 2 : R) % vec || (D - R) % vec) return false;
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    for (const pe_rope_tensor *x : xs) {
        if (x->heads == 0) continue;
        if (reinterpret_cast<uintptr_t>(x->in) % bytes ||
            reinterpret_cast<uintptr_t>(x->out) % bytes)
            return false;
        const int64_t sizes[3] = {a->batch, a->seq, x->heads};
        for (int d = 0; d < 3; ++d)
            if (sizes[d] > 1 && ((x->in_stride[d] * es) % bytes || (x->out_stride[d] * es) % bytes))
                return false;
    }
    return true;
}

// The same for the tables' rows (chunk offsets are multiples of vec once rows_aligned).
inline bool tables_aligned(const pe_rope_args *a, int64_t vec, int64_t es) {
    const pe_rope_source &s = a->src;
    const int64_t bytes = vec * es;
    if (reinterpret_cast<uintptr_t>(s.cos) % bytes || reinterpret_cast<uintptr_t>(s.sin) % bytes)
        return false;
    const int64_t sizes[3] = {s.axis_of_slot ? 3 : 1, s.table_batch, a->seq};
    for (int d = 0; d < 3; ++d)
        if (sizes[d] > 1 && (s.table_stride[d] * es) % bytes) return false;
    return true;
}

// Whether some chunk of vec elements would read two MRoPE axes of the tables.
inline bool chunks_split_axes(const pe_rope_args *a, int64_t vec) {
    const uint8_t *map = a->src.axis_of_slot;
    if (!map || vec == 1) return false;
    const int64_t R = a->rot_dim, half = a->pairing == PE_PAIR_HALF;
    for (int64_t e = 0; e < (half ? R / 2 : R); e += vec)
        for (int64_t k = 1; k < vec; ++k)
            if (map[half ? e + k : (e + k) / 2] != map[half ? e : e / 2]) return true;
    return false;
}

// For one pass (apply_passes): calls f(Tag<R>, Tag<T>, integral_constant<V>, Tag<Off>,
// Tag<S>) with the compute type R, the one storage dtype T of every tensor in and out (void:
// mixed), the elements per access V, the type of offsets inside a token and the source
// (Positions, or Tables of T: tables of another dtype run the element-by-element variant, and
// tables not aligned where q and k are, or with MRoPE sections that split a vector chunk, the
// one-element variant).
template <typename F> void with_apply_variant(const pe_rope_args *a, F &&f) {
    const pe_rope_tensor &x = a->q.heads ? a->q : a->k;
    const pe_dtype dt = x.in_dtype;
    const bool uniform = x.out_dtype == dt &&
                         (a->q.heads == 0 || (a->q.in_dtype == dt && a->q.out_dtype == dt)) &&
                         (a->k.heads == 0 || (a->k.in_dtype == dt && a->k.out_dtype == dt));
    const bool narrow = offsets_fit_32(a), positions = a->src.pos != nullptr;
    auto run = [&](auto r, auto tx, auto v) {
        using T = typename decltype(tx)::type;
        auto with_source = [&](auto off) {
            if (positions)
                f(r, tx, v, off, Tag<Positions>{});
            else
                f(r, tx, v, off, Tag<Tables<T>>{});
        };
        if (narrow)
            with_source(Tag<int32_t>{});
        else
            with_source(Tag<int64_t>{});
    };
    auto mixed = [&](auto r) { run(r, Tag<void>{}, std::integral_constant<int, 1>{}); };
    auto typed = [&](auto r, auto tx) {
        using T = typename decltype(tx)::type;
        constexpr int64_t es = static_cast<int64_t>(sizeof(typename Io<T>::storage));
        constexpr int V = static_cast<int>(16 / es);
        if (!positions && a->src.table_dtype != dt) return mixed(r);
        if (rows_aligned(a, V, es) &&
            (positions || (tables_aligned(a, V, es) && !chunks_split_axes(a, V))))
            run(r, tx, std::integral_constant<int, V>{});
        else
            run(r, tx, std::integral_constant<int, 1>{});
    };
    if (runs_f64(a, a->q) || runs_f64(a, a->k)) {
        if (uniform && dt == PE_FLOAT64)
            typed(Tag<double>{}, Tag<double>{});
        else
            mixed(Tag<double>{});
    } else if (!uniform) {
        mixed(Tag<float>{});
    } else if (dt == PE_FLOAT32) {
        typed(Tag<float>{}, Tag<float>{});
    } else if (dt == PE_BFLOAT16) {
        typed(Tag<float>{}, Tag<Bf16>{});
    } else {
        typed(Tag<float>{}, Tag<F16>{});
    }
}

// Calls f(Tag<T>) with the storage type of dtype dt.
template <typename F> void with_dtype(pe_dtype dt, F &&f) {
    switch (dt) {
    case PE_FLOAT32: f(Tag<float>{}); break;
    case PE_FLOAT64: f(Tag<double>{}); break;
    case PE_BFLOAT16: f(Tag<Bf16>{}); break;
    default: f(Tag<F16>{}); break;
    }
}

// For a table-gradient launch: calls f(Tag<R>, Tag<G>, Tag<X>) with the compute type, the
// gradients' storage type and q's and k's (void for both G and X when q and k differ).
template <typename F> void with_table_grad_variant(const pe_rope_args *a, pe_dtype grad_dtype,
                                                   F &&f) {
    const bool same = !a->q.heads || !a->k.heads || a->q.in_dtype == a->k.in_dtype;
    const pe_dtype xdt = a->q.heads ? a->q.in_dtype : a->k.in_dtype;
    auto in_r = [&](auto r) {
        if (!same) return f(r, Tag<void>{}, Tag<void>{});
        with_dtype(grad_dtype, [&](auto g) {
            with_dtype(xdt, [&](auto x) {
                using R = typename decltype(r)::type;
                using G = typename decltype(g)::type;
                using X = typename decltype(x)::type;
                // an fp64 operand makes the sums fp64: no fp32 kernel for it
                if constexpr (std::is_same_v<R, double> ||
                              !(std::is_same_v<G, double> || std::is_same_v<X, double>))
                    f(r, g, x);
            });
        });
    };
    if (table_grad_f64(a, grad_dtype))
        in_r(Tag<double>{});
    else
        in_r(Tag<float>{});
}

// ---- host: argument checks, rope.c's own (rope_check.h) plus the width limit of the
// kernel parameters --------------------------------------------------------------------

// What a call does after its checks.
enum class Work { None, Run, BadArg };

inline Work work_of(int rc) {
    return rc < 0 ? Work::BadArg : rc == PE_CHECK_RUN ? Work::Run : Work::None;
}

inline int status_of(Work w) {
    return w == Work::BadArg ? PE_ERR_ARG : PE_OK;
}

// rot_dim within the axis map; a token's elements, (q heads + k heads) * head_dim, counted
// in int (ApplyGrid).  Negative sizes pass here and fail the shared checks.
inline bool width_ok(const pe_rope_args *a) {
    if (!a) return true;
    if (a->rot_dim > PE_CUDA_MAX_ROT) return false;
    const int64_t hq = a->q.heads > 0 ? a->q.heads : 0, hk = a->k.heads > 0 ? a->k.heads : 0;
    if (hq > INT32_MAX || hk > INT32_MAX || a->head_dim > INT32_MAX) return false;
    return hq + hk == 0 || a->head_dim <= INT32_MAX / (hq + hk);
}

inline Work check_apply(const pe_rope_args *a) {
    return width_ok(a) ? work_of(pe_rope_check_apply(a)) : Work::BadArg;
}

inline Work check_table_grad(const pe_rope_args *a, const void *grad_q, const int64_t gqs[3],
                             const void *grad_k, const int64_t gks[3], pe_dtype grad_dtype,
                             const void *dcos, const void *dsin) {
    if (!width_ok(a)) return Work::BadArg;
    return work_of(
        pe_rope_check_table_grad(a, grad_q, gqs, grad_k, gks, grad_dtype, dcos, dsin));
}

inline Work check_tables(const pe_rope_args *a, pe_dtype out_dtype, const void *cos,
                         const void *sin) {
    return width_ok(a) ? work_of(pe_rope_check_tables(a, out_dtype, cos, sin)) : Work::BadArg;
}

inline GradP grad_params(const pe_rope_args *a, const void *grad_q, const int64_t gqs[3],
                         const void *grad_k, const int64_t gks[3], pe_dtype gdt, void *dcos,
                         void *dsin) {
    GradP gp{};
    gp.p = rope_params(a);
    gp.g[0] = static_cast<const char *>(grad_q);
    gp.g[1] = static_cast<const char *>(grad_k);
    for (int i = 0; i < 3; ++i) {
        gp.g_s[0][i] = gqs ? gqs[i] : 0;
        gp.g_s[1][i] = gks ? gks[i] : 0;
    }
    gp.g_dt = gdt;
    gp.dcos = static_cast<char *>(dcos);
    gp.dsin = static_cast<char *>(dsin);
    return gp;
}

// ---- host: the launch loops of the three entry points, shared by rope.cu (which launches
// the kernels) and the emulation (which runs them on the host).  Each checks the call,
// returns at once when there is nothing to compute, builds the parameters and calls
// launch(...) once per kernel, stopping at the first status it returns.

// apply: launch(Tag<R>, Tag<T>, integral_constant<V>, Tag<Off>, Tag<S>, RopeP, ApplyGrid).
// grid(groups, min_blocks) gives a launch's blocks; `threads` its block size.
template <typename Grid, typename Launch>
int run_apply(const pe_rope_args *a, int threads, Grid &&grid, Launch &&launch) {
    const Work w = check_apply(a);
    if (w != Work::Run) return status_of(w);
    // no head: no work (and no layout: apply_grid divides by a token's items)
    if (a->q.heads == 0 && a->k.heads == 0) return PE_OK;
    pe_rope_args pass[2];
    for (int i = 0, n = apply_passes(a, pass); i < n; ++i) {
        int rc = PE_OK;
        with_apply_variant(&pass[i], [&](auto r, auto tx, auto v, auto off, auto src) {
            using R = typename decltype(r)::type;
            using T = typename decltype(tx)::type;
            using S = typename decltype(src)::type;
            constexpr int V = decltype(v)::value;
            const RopeP p = rope_params(&pass[i]);
            ApplyGrid g = apply_grid<V>(p, threads);
            set_grid(g, grid(g.groups, apply_min_blocks<R, T, V, S>()));
            rc = launch(r, tx, v, off, src, p, g);
        });
        if (rc) return rc;
    }
    return PE_OK;
}

// table_grad: launch(Tag<R>, Tag<G>, Tag<X>, GradP).
template <typename Launch>
int run_table_grad(const pe_rope_args *a, const void *grad_q, const int64_t gqs[3],
                   const void *grad_k, const int64_t gks[3], pe_dtype gdt, void *dcos,
                   void *dsin, Launch &&launch) {
    const Work w = check_table_grad(a, grad_q, gqs, grad_k, gks, gdt, dcos, dsin);
    if (w != Work::Run) return status_of(w);
    const GradP gp = grad_params(a, grad_q, gqs, grad_k, gks, gdt, dcos, dsin);
    int rc = PE_OK;
    with_table_grad_variant(a, gdt, [&](auto r, auto g, auto x) { rc = launch(r, g, x, gp); });
    return rc;
}

// tables: launch(RopeP).
template <typename Launch>
int run_tables(const pe_rope_args *a, pe_dtype out_dtype, const void *cos, const void *sin,
               Launch &&launch) {
    const Work w = check_tables(a, out_dtype, cos, sin);
    if (w != Work::Run) return status_of(w);
    return launch(rope_params(a));
}

} // namespace pe_cuda

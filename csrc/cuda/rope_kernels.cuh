// The bodies of the CUDA RoPE kernels (posenc_cuda.h), written for one thread of a block:
// each phase takes the thread's lane (index, count) instead of reading threadIdx/blockDim,
// so the same code runs in the kernels (rope.cu) and, thread by thread, on the host in the
// emulation test (tests/test_emulated.cu), which compares it bit for bit with the CPU.
// Between phases the kernels synchronize the block; what a thread keeps from one phase to
// the next lives in an object (ApplyThread) that the emulation keeps per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "posenc_cuda.h"
#include "rope_check.h" // the argument checks, shared with the CPU entry points
#include "rope_math.h"  // the per-element math, shared with the CPU kernels

namespace pe_cuda {

constexpr int kMaxSlots = PE_CUDA_MAX_ROT / 2;
// apply: threads per block
constexpr int kApplyThreads = 256;

#if defined(__CUDA_ARCH__)
#define PE_UNROLL _Pragma("unroll")
#else
#define PE_UNROLL
#endif

struct Lane {
    int id, count; // this thread, threads of the block
};

// ---- dtypes: storage tags and their conversions (one rounding to nearest even) ----------

struct Bf16 {};
struct F16 {};

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
            return pe_f32_to_bf16(v);
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
            return pe_f32_to_f16(v);
    }
};

PE_HD size_t dtype_size(pe_dtype t) {
    switch (t) {
    case PE_FLOAT32: return 4;
    case PE_FLOAT64: return 8;
    case PE_BFLOAT16:
    case PE_FLOAT16: return 2;
    }
    return 0;
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

// ---- 16-byte access: four 32-bit words, loaded and stored whole --------------------------

struct W16 {
    uint32_t w[4];
};

// Inputs are read once: a streaming 16-byte load.  Outputs are written once and read by
// the next op, not by this kernel: a streaming 16-byte store.
PE_HD W16 load16(const void *p) {
#if defined(__CUDA_ARCH__)
    const uint4 u = __ldcs(static_cast<const uint4 *>(p));
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

// n values of R from `row` (shared memory), 16 bytes at a time where n * sizeof(R) allows
// (the caller keeps `row` 16-byte aligned then).
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
// raw: what the load returned, as loaded (the 16 bytes, one stored element, or for T =
// void the value converted to R); get/put convert one element of it; outputs start zeroed.
template <typename R, typename T, int V> struct Unit { // 16 bytes
    using S = typename Io<T>::storage;
    using raw = W16;
    static_assert(V * sizeof(S) == 16, "a vector unit is 16 bytes");
    PE_HD static raw load(const pe_dtype, const char *base, int64_t i) {
        return load16(reinterpret_cast<const S *>(base) + i);
    }
    PE_HD static void store(const pe_dtype, char *base, int64_t i, const raw &v) {
        store16(reinterpret_cast<S *>(base) + i, v);
    }
    PE_HD static raw zero() {
        return {{0u, 0u, 0u, 0u}};
    }
    PE_HD static R get(const raw &v, int k) {
        if constexpr (std::is_same_v<T, float>)
            return static_cast<R>(pe_bits_f32(v.w[k]));
        else if constexpr (std::is_same_v<T, double>)
            return static_cast<R>(f64_of_words(v.w[2 * k], v.w[2 * k + 1]));
        else
            return Io<T>::template load<R>(static_cast<uint16_t>(v.w[k >> 1] >> (16 * (k & 1))));
    }
    PE_HD static void put(raw &v, int k, R x) {
        if constexpr (std::is_same_v<T, float>) {
            v.w[k] = pe_f32_bits(Io<float>::store(x));
        } else if constexpr (std::is_same_v<T, double>) {
            const uint64_t u = f64_bits(Io<double>::store(x));
            v.w[2 * k] = static_cast<uint32_t>(u);
            v.w[2 * k + 1] = static_cast<uint32_t>(u >> 32);
        } else {
            v.w[k >> 1] |= static_cast<uint32_t>(Io<T>::store(x)) << (16 * (k & 1));
        }
    }
};

template <typename R, typename T> struct Unit<R, T, 1> { // one element, one dtype
    using S = typename Io<T>::storage;
    using raw = S;
    PE_HD static raw load(const pe_dtype, const char *base, int64_t i) {
        return reinterpret_cast<const S *>(base)[i];
    }
    PE_HD static void store(const pe_dtype, char *base, int64_t i, const raw &v) {
        reinterpret_cast<S *>(base)[i] = v;
    }
    PE_HD static raw zero() {
        return S{};
    }
    PE_HD static R get(const raw &v, int) {
        return Io<T>::template load<R>(v);
    }
    PE_HD static void put(raw &v, int, R x) {
        v = Io<T>::store(x);
    }
};

template <typename R> struct Unit<R, void, 1> { // one element, any dtype in and out
    using raw = R;
    PE_HD static raw load(const pe_dtype dt, const char *base, int64_t i) {
        return load_dyn<R>(base, i, dt);
    }
    PE_HD static void store(const pe_dtype dt, char *base, int64_t i, const raw &v) {
        store_dyn<R>(base, i, dt, v);
    }
    PE_HD static raw zero() {
        return R(0);
    }
    PE_HD static R get(const raw &v, int) {
        return v;
    }
    PE_HD static void put(raw &v, int, R x) {
        v = x;
    }
};

template <typename T> PE_HD constexpr size_t storage_size() {
    if constexpr (std::is_void_v<T>)
        return 0;
    else
        return sizeof(typename Io<T>::storage);
}

// Heads one thread carries through the table barrier: their loads are all in flight at
// once (4 heads x 32 bytes of a half-pairing chunk and its partner), and the chunk's cos
// and signed-sine values stay in registers across them.
constexpr int kHeadsPerThread = 4;

// Blocks of kApplyThreads per SM that an apply kernel's launch bounds promise: 3 caps the
// registers at 65536 / (256 * 3) = 85 per thread (80 usable).  The 16-bit vector kernels
// hold 32 cos and signed-sine values and 4 heads of 16 elements; they get 2 blocks and 128
// registers (spilling at 80 on sm_80): 512 threads x 128 bytes = 64 KiB of loads in flight
// per SM.
template <typename T, int V, typename Off> PE_HD constexpr int apply_min_blocks() {
    return V > 1 && storage_size<T>() == 2 ? 2 : 3;
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
    int positions; // 1: pos + inv_freq, 0: tables
    const char *cos, *sin;
    pe_dtype table_dt;
    int64_t table_batch, table_s[3];
    const int64_t *pos;
    int64_t pos_batch, pos_s[3];
    const float *inv_freq;
    float scaling;
    int axes;                // 1 or 3
    uint8_t axis[kMaxSlots]; // axis of each frequency slot (zeros when axes == 1)
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

// scaling * cos, scaling * sin of slot i's angle at token (b, t) (fused path)
PE_HD void slot_sincos(const SourceP &src, int64_t b, int64_t t, int64_t i, float *c, float *s) {
    const int64_t *pos = src.pos + (src.pos_batch == 1 ? 0 : b) * src.pos_s[1] + t * src.pos_s[2];
    pe_sincos_large(pe_rope_angle(src.inv_freq[i], pos[src.axis[i] * src.pos_s[0]]), src.scaling, c,
                    s); // any angle, the fast range included
}

// ---- the token's cos and unsigned sin rows (the tables op) ---------------------------------

template <typename R>
PE_HD void token_tables(const RopeP &p, int64_t b, int64_t t, R *c, R *s, Lane l) {
    const SourceP &src = p.src;
    const int64_t nslot = p.R / 2;
    if (src.positions) {
        for (int64_t i = l.id; i < nslot; i += l.count) {
            float cv, sv;
            slot_sincos(src, b, t, i, &cv, &sv);
            const int64_t e0 = p.pairing == PE_PAIR_HALF ? i : 2 * i;
            const int64_t e1 = p.pairing == PE_PAIR_HALF ? i + nslot : 2 * i + 1;
            c[e0] = c[e1] = static_cast<R>(cv);
            s[e0] = s[e1] = static_cast<R>(sv);
        }
        return;
    }
    const int64_t off = (src.table_batch == 1 ? 0 : b) * src.table_s[1] + t * src.table_s[2];
    for (int64_t e = l.id; e < p.R; e += l.count) {
        const int64_t i = off + src.axis[slot_of(p.pairing, e, p.R)] * src.table_s[0] + e;
        c[e] = load_dyn<R>(src.cos, i, src.table_dt);
        s[e] = load_dyn<R>(src.sin, i, src.table_dt);
    }
}

// ---- apply: how the work of a call is laid out on the block ---------------------------------
//
// A token's work is items: an item is one channel chunk (V elements and, for the half
// pairing, the V partner elements R/2 further; for adjacent pairs with V = 1, one pair) of
// up to NH heads (h = r, r + Hs, r + 2 Hs, ...).  One thread per item, `lanes` threads per
// token (a multiple of the chunks per head, so a thread keeps its chunk when it loops over
// further items), `tokens` tokens per block and per block-wide phase.

struct ApplyGrid {
    int rot_items;   // rotated chunks per head
    int chunks;      // all chunks per head: rotated, then pass-through
    int heads;       // q heads + k heads
    int head_groups; // Hs = ceil(heads / NH)
    int items;       // per token: chunks * head_groups
    int lanes;       // threads per token
    int tokens;      // tokens of one phase
    int row_stride;  // elements from a token's cos row to its signed-sine row (16-byte multiple)
    int64_t ntok, groups;
};

// (b, t) of token `tok`: a 32-bit division when the sizes allow.
PE_HD void split_token(const RopeP &p, int64_t tok, int64_t *b, int64_t *t) {
    if (p.T <= UINT32_MAX && tok <= UINT32_MAX) {
        const uint32_t u = static_cast<uint32_t>(tok), T = static_cast<uint32_t>(p.T);
        *b = u / T;
        *t = u - static_cast<uint32_t>(*b) * T;
    } else {
        *b = tok / p.T;
        *t = tok - *b * p.T;
    }
}

// ---- the rotation's rows of one phase's tokens: cos and the signed sine of the forward,
// ss[e] = sign(e) s[e], or of the transpose, ss[e] = sign(p(e)) s[p(e)] = -sign(e) s[p(e)].
// A channel and its partner share a frequency slot, hence an axis: each lane writes whole
// entries from the source.  Token i of the phase has its rows at rows + 2 i row_stride.

template <typename R>
PE_HD void group_rows(const RopeP &p, const ApplyGrid &g, int64_t group, R *rows, Lane l) {
    const SourceP &src = p.src;
    const int64_t tok0 = group * g.tokens;
    const int nt = static_cast<int>(g.ntok - tok0 < g.tokens ? g.ntok - tok0 : g.tokens);
    const int R_ = static_cast<int>(p.R), nslot = R_ / 2;
    const int per_token = src.positions ? nslot : R_;
    int cur = -1;
    int64_t b = 0, t = 0;
    for (int f = l.id; f < nt * per_token; f += l.count) {
        const int tl = f / per_token, i = f - tl * per_token;
        if (tl != cur) split_token(p, tok0 + tl, &b, &t), cur = tl;
        R *c = rows + 2 * static_cast<int64_t>(tl) * g.row_stride, *ss = c + g.row_stride;
        if (src.positions) { // one lane per slot: both channels of the slot are partners
            float cv, sv;
            slot_sincos(src, b, t, i, &cv, &sv);
            const int e0 = p.pairing == PE_PAIR_HALF ? i : 2 * i;
            const int e1 = p.pairing == PE_PAIR_HALF ? i + nslot : 2 * i + 1;
            c[e0] = c[e1] = static_cast<R>(cv);
            ss[e0] = p.transpose ? static_cast<R>(sv) : -static_cast<R>(sv);
            ss[e1] = p.transpose ? -static_cast<R>(sv) : static_cast<R>(sv);
            continue;
        }
        const int e = i;
        const int64_t base = (src.table_batch == 1 ? 0 : b) * src.table_s[1] + t * src.table_s[2] +
                             src.axis[slot_of(p.pairing, e, p.R)] * src.table_s[0];
        const bool first = first_of_pair(p.pairing, e, p.R);
        c[e] = load_dyn<R>(src.cos, base + e, src.table_dt);
        const R sv = load_dyn<R>(src.sin, base + (p.transpose ? partner_of(p.pairing, e, p.R) : e),
                                 src.table_dt);
        ss[e] = first != static_cast<bool>(p.transpose) ? -sv : sv;
    }
}

// ---- one thread's items: loads first (phase 1, before the rows exist), then rotation and
// stores (phase 2, after the barrier), then any further items of its token.  Off: the
// integer type of element offsets inside a token (int32_t when every one fits).

template <typename R, typename T, int V, typename Off> struct ApplyThread {
    using U = Unit<R, T, V>;
    using raw = typename U::raw;
    static constexpr int NH = kHeadsPerThread;
    raw a[NH], z[NH]; // the chunk at e and its partner chunk at e + step (paired items)
    int64_t b, t;    // the thread's token
    int lane_token_; // its index in the phase
    int item;        // the item in hand
    bool active;

    struct Where {
        int e, step; // first element; partner offset (0: no partner chunk)
        bool pass;   // pass-through chunk: copied
        int r;       // head group
    };

    PE_HD static Where where(const RopeP &p, const ApplyGrid &g, int item) {
        const int j = item % g.chunks, r = item / g.chunks;
        const int Rw = static_cast<int>(p.R);
        if (j >= g.rot_items) return {Rw + (j - g.rot_items) * V, 0, true, r};
        if (p.pairing == PE_PAIR_HALF) return {j * V, Rw / 2, false, r};
        if (V == 1) return {2 * j, 1, false, r}; // one adjacent pair, element by element
        return {j * V, 0, false, r};             // whole adjacent pairs in one access
    }

    // head h of the call: tensor (q or k) and its own head index
    PE_HD static const TensorP &tensor_of(const RopeP &p, int h, int *hh) {
        const int hq = static_cast<int>(p.x[0].heads);
        *hh = h < hq ? h : h - hq;
        return p.x[h < hq ? 0 : 1];
    }

    PE_HD static const char *in_row(const TensorP &x, int64_t b, int64_t t) {
        const size_t es = std::is_void_v<T> ? dtype_size(x.in_dt) : storage_size<T>();
        return x.in + static_cast<int64_t>(es) * (b * x.in_s[0] + t * x.in_s[1]);
    }
    PE_HD static char *out_row(const TensorP &x, int64_t b, int64_t t) {
        const size_t es = std::is_void_v<T> ? dtype_size(x.out_dt) : storage_size<T>();
        return x.out + static_cast<int64_t>(es) * (b * x.out_s[0] + t * x.out_s[1]);
    }

    PE_HD void load_item(const RopeP &p, const ApplyGrid &g) {
        const Where w = where(p, g, item);
PE_UNROLL
        for (int s = 0; s < NH; ++s) {
            const int h = w.r + s * g.head_groups;
            if (h >= g.heads) break;
            int hh;
            const TensorP &x = tensor_of(p, h, &hh);
            const char *row = in_row(x, b, t);
            const Off off = static_cast<Off>(hh) * static_cast<Off>(x.in_s[2]) + w.e;
            a[s] = U::load(x.in_dt, row, off);
            if (w.step) z[s] = U::load(x.in_dt, row, off + w.step);
        }
    }

    PE_HD void store_item(const RopeP &p, const ApplyGrid &g, const R *rows) {
        const Where w = where(p, g, item);
        const R *c = rows + 2 * static_cast<int64_t>(lane_token_) * g.row_stride;
        const R *ss = c + g.row_stride;
        // the chunk's cos and signed sine, and its partner's
        R ca[V]{}, sa[V]{}, cz[V]{}, sz[V]{};
        if (!w.pass) {
            read_row<R, V>(c + w.e, ca);
            read_row<R, V>(ss + w.e, sa);
            if (w.step) {
                read_row<R, V>(c + w.e + w.step, cz);
                read_row<R, V>(ss + w.e + w.step, sz);
            }
        }
PE_UNROLL
        for (int s = 0; s < NH; ++s) {
            const int h = w.r + s * g.head_groups;
            if (h >= g.heads) break;
            int hh;
            const TensorP &x = tensor_of(p, h, &hh);
            char *row = out_row(x, b, t);
            const Off off = static_cast<Off>(hh) * static_cast<Off>(x.out_s[2]) + w.e;
            if (w.pass) { // as loaded: the bits themselves when T is one dtype
                U::store(x.out_dt, row, off, a[s]);
                continue;
            }
            raw oa = U::zero();
            if (w.step) {
                raw oz = U::zero();
PE_UNROLL
                for (int k = 0; k < V; ++k) {
                    const R xa = U::get(a[s], k), xz = U::get(z[s], k);
                    U::put(oa, k, rot(xa, ca[k], xz, sa[k]));
                    U::put(oz, k, rot(xz, cz[k], xa, sz[k]));
                }
                U::store(x.out_dt, row, off, oa);
                U::store(x.out_dt, row, off + w.step, oz);
            } else {
PE_UNROLL
                for (int k = 0; k < V; k += 2) {
                    const R x0 = U::get(a[s], k), x1 = U::get(a[s], k + 1);
                    U::put(oa, k, rot(x0, ca[k], x1, sa[k]));
                    U::put(oa, k + 1, rot(x1, ca[k + 1], x0, sa[k + 1]));
                }
                U::store(x.out_dt, row, off, oa);
            }
        }
    }

    // Phase 1: the thread's first item of its token, every load issued.
    PE_HD void load(const RopeP &p, const ApplyGrid &g, int64_t group, Lane l) {
        lane_token_ = l.id / g.lanes;
        item = l.id - lane_token_ * g.lanes;
        const int64_t tok = group * g.tokens + lane_token_;
        active = lane_token_ < g.tokens && tok < g.ntok && item < g.items;
        if (!active) return;
        split_token(p, tok, &b, &t);
        load_item(p, g);
    }

    // Phase 2 (after the rows are written): rotate and store, then the token's further
    // items (a stride of `lanes` keeps the thread's chunk).
    PE_HD void finish(const RopeP &p, const ApplyGrid &g, const R *rows) {
        if (!active) return;
        store_item(p, g, rows);
        for (item += g.lanes; item < g.items; item += g.lanes) {
            load_item(p, g);
            store_item(p, g, rows);
        }
    }
};

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
    const int64_t ges = static_cast<int64_t>(dtype_size(gp.g_dt));
    for (int64_t e = l.id; e < Rw; e += l.count) {
        const bool first = first_of_pair(p.pairing, e, Rw);
        const int64_t pe = partner_of(p.pairing, e, Rw);
        R acc_c = 0, acc_s = 0;
        for (int64_t b = b0; b < b1; ++b) {
            for (int w = 0; w < 2; ++w) {
                const TensorP &x = p.x[w];
                const int64_t xes = static_cast<int64_t>(dtype_size(x.in_dt));
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
        const int64_t mine = p.src.axis[slot_of(p.pairing, e, Rw)];
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
    src.positions = s.pos != nullptr;
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
    if (s.axis_of_slot) std::memcpy(src.axis, s.axis_of_slot, static_cast<size_t>(a->rot_dim / 2));
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

template <typename T> struct Tag {
    using type = T;
};

// The layout of an apply launch of `threads` threads per block (ApplyGrid).
template <typename R, typename T, int V> ApplyGrid apply_grid(const RopeP &p, int threads) {
    ApplyGrid g{};
    const int Rw = static_cast<int>(p.R), D = static_cast<int>(p.D);
    const int nh = kHeadsPerThread;
    g.rot_items = p.pairing == PE_PAIR_HALF ? Rw / 2 / V : V == 1 ? Rw / 2 : Rw / V;
    g.chunks = g.rot_items + (D - Rw) / V;
    g.heads = static_cast<int>(p.x[0].heads + p.x[1].heads);
    g.head_groups = (g.heads + nh - 1) / nh;
    g.items = g.chunks * g.head_groups;
    g.lanes = g.items <= threads   ? g.items
              : g.chunks <= threads ? threads / g.chunks * g.chunks
                                    : threads;
    g.ntok = p.B * p.T;
    g.tokens = threads / g.lanes;
    if (g.tokens > g.ntok) g.tokens = static_cast<int>(g.ntok);
    const int align = static_cast<int>(16 / sizeof(R));
    g.row_stride = (Rw + align - 1) / align * align;
    g.groups = (g.ntok + g.tokens - 1) / g.tokens;
    return g;
}

template <typename R> size_t apply_shared_bytes(const ApplyGrid &g) {
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

// For one pass (apply_passes): calls f(Tag<R>, Tag<T>, integral_constant<V>, Tag<Off>) with
// the compute type R, the one storage dtype T of every tensor in and out (void: mixed), the
// elements per access V and the type of offsets inside a token.
template <typename F> void with_apply_variant(const pe_rope_args *a, F &&f) {
    const pe_rope_tensor &x = a->q.heads ? a->q : a->k;
    const pe_dtype dt = x.in_dtype;
    const bool uniform = x.out_dtype == dt &&
                         (a->q.heads == 0 || (a->q.in_dtype == dt && a->q.out_dtype == dt)) &&
                         (a->k.heads == 0 || (a->k.in_dtype == dt && a->k.out_dtype == dt));
    const bool narrow = offsets_fit_32(a);
    auto run = [&](auto r, auto tx, auto v) {
        if (narrow)
            f(r, tx, v, Tag<int32_t>{});
        else
            f(r, tx, v, Tag<int64_t>{});
    };
    auto typed = [&](auto r, auto tx) {
        using T = typename decltype(tx)::type;
        constexpr int V = static_cast<int>(16 / sizeof(typename Io<T>::storage));
        if (rows_aligned(a, V, static_cast<int64_t>(sizeof(typename Io<T>::storage))))
            run(r, tx, std::integral_constant<int, V>{});
        else
            run(r, tx, std::integral_constant<int, 1>{});
    };
    if (runs_f64(a, a->q) || runs_f64(a, a->k)) {
        if (uniform && dt == PE_FLOAT64)
            typed(Tag<double>{}, Tag<double>{});
        else
            run(Tag<double>{}, Tag<void>{}, std::integral_constant<int, 1>{});
    } else if (!uniform) {
        run(Tag<float>{}, Tag<void>{}, std::integral_constant<int, 1>{});
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
        with_dtype(grad_dtype, [&](auto g) { with_dtype(xdt, [&](auto x) { f(r, g, x); }); });
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

} // namespace pe_cuda

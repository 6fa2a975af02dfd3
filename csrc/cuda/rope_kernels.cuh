// The bodies of the CUDA RoPE kernels (posenc_cuda.h), written for one thread of a block:
// each phase takes the thread's lane (index, count) instead of reading threadIdx/blockDim,
// so the same code runs in the kernels (rope.cu) and, thread by thread, on the host in the
// emulation test (tests/test_emulated.cu), which compares it bit for bit with the CPU.
// Between phases the kernels synchronize the block.
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
constexpr int kApplyThreads = 128;

struct Lane {
    int64_t id, count; // this thread, threads of the block
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

// ---- the rotation's rows in one pass: cos and the signed sine of the forward,
// ss[e] = sign(e) s[e], or of the transpose, ss[e] = sign(p(e)) s[p(e)] = -sign(e) s[p(e)].
// A channel and its partner share a frequency slot, hence an axis: each lane writes whole
// entries from the source, and the block synchronizes once before rotating.

template <typename R>
PE_HD void token_rows(const RopeP &p, int64_t b, int64_t t, R *c, R *ss, Lane l) {
    const SourceP &src = p.src;
    const int64_t nslot = p.R / 2;
    if (src.positions) { // one lane per slot: both channels of the slot are partners
        for (int64_t i = l.id; i < nslot; i += l.count) {
            float cv, sv;
            slot_sincos(src, b, t, i, &cv, &sv);
            const int64_t e0 = p.pairing == PE_PAIR_HALF ? i : 2 * i;
            const int64_t e1 = p.pairing == PE_PAIR_HALF ? i + nslot : 2 * i + 1;
            c[e0] = c[e1] = static_cast<R>(cv);
            ss[e0] = p.transpose ? static_cast<R>(sv) : -static_cast<R>(sv);
            ss[e1] = p.transpose ? -static_cast<R>(sv) : static_cast<R>(sv);
        }
        return;
    }
    const int64_t off = (src.table_batch == 1 ? 0 : b) * src.table_s[1] + t * src.table_s[2];
    for (int64_t e = l.id; e < p.R; e += l.count) {
        const int64_t base = off + src.axis[slot_of(p.pairing, e, p.R)] * src.table_s[0];
        const bool first = first_of_pair(p.pairing, e, p.R);
        c[e] = load_dyn<R>(src.cos, base + e, src.table_dt);
        const R sv = load_dyn<R>(src.sin, base + (p.transpose ? partner_of(p.pairing, e, p.R) : e),
                                 src.table_dt);
        ss[e] = first != static_cast<bool>(p.transpose) ? -sv : sv;
    }
}

// ---- rotate every head of one tensor at token (b, t) ------------------------------------

template <typename T, int V> struct alignas(sizeof(typename Io<T>::storage) * V) Pack {
    typename Io<T>::storage v[V];
};

// Every tensor of the call in T (in and out), V elements per access (16 bytes, or 1).
template <typename R, typename T, int V>
PE_HD void rotate_typed(const RopeP &p, const TensorP &x, int64_t b, int64_t t, const R *c,
                        const R *ss, Lane l) {
    using S = typename Io<T>::storage;
    using P = Pack<T, V>;
    const int64_t Rw = p.R, h = Rw / 2;
    const int64_t rot_items = (p.pairing == PE_PAIR_HALF ? h : Rw) / V;
    const int64_t per_head = rot_items + (p.D - Rw) / V;
    const int64_t n = x.heads * per_head;
    const S *ib = reinterpret_cast<const S *>(x.in) + b * x.in_s[0] + t * x.in_s[1];
    S *ob = reinterpret_cast<S *>(x.out) + b * x.out_s[0] + t * x.out_s[1];
    for (int64_t i = l.id; i < n; i += l.count) {
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
            for (int k = 0; k < V; ++k) {
                const R a = Io<T>::template load<R>(lo.v[k]), z = Io<T>::template load<R>(hi.v[k]);
                olo.v[k] = Io<T>::store(rot(a, c[e + k], z, ss[e + k]));
                ohi.v[k] = Io<T>::store(rot(z, c[e + h + k], a, ss[e + h + k]));
            }
            *reinterpret_cast<P *>(xo + e) = olo;
            *reinterpret_cast<P *>(xo + e + h) = ohi;
        } else if constexpr (V >= 2) { // whole adjacent pairs in one access
            const P in = *reinterpret_cast<const P *>(xi + e);
            P out;
            for (int k = 0; k < V; k += 2) {
                const R a = Io<T>::template load<R>(in.v[k]);
                const R z = Io<T>::template load<R>(in.v[k + 1]);
                out.v[k] = Io<T>::store(rot(a, c[e + k], z, ss[e + k]));
                out.v[k + 1] = Io<T>::store(rot(z, c[e + k + 1], a, ss[e + k + 1]));
            }
            *reinterpret_cast<P *>(xo + e) = out;
        } else {
            const R a = Io<T>::template load<R>(xi[e]);
            const R z = Io<T>::template load<R>(xi[partner_of(p.pairing, e, Rw)]);
            xo[e] = Io<T>::store(rot(a, c[e], z, ss[e]));
        }
    }
}

// Any dtype in, any dtype out, one element at a time.
template <typename R>
PE_HD void rotate_dyn(const RopeP &p, const TensorP &x, int64_t b, int64_t t, const R *c,
                      const R *ss, Lane l) {
    const int64_t Rw = p.R, D = p.D, n = x.heads * D;
    const int64_t ies = static_cast<int64_t>(dtype_size(x.in_dt));
    const int64_t oes = static_cast<int64_t>(dtype_size(x.out_dt));
    const char *ib = x.in + (b * x.in_s[0] + t * x.in_s[1]) * ies;
    char *ob = x.out + (b * x.out_s[0] + t * x.out_s[1]) * oes;
    for (int64_t i = l.id; i < n; i += l.count) {
        const int64_t hd = i / D, e = i - hd * D;
        const char *xi = ib + hd * x.in_s[2] * ies;
        char *xo = ob + hd * x.out_s[2] * oes;
        const R a = load_dyn<R>(xi, e, x.in_dt);
        if (e >= Rw) {
            store_dyn<R>(xo, e, x.out_dt, a);
            continue;
        }
        const R z = load_dyn<R>(xi, partner_of(p.pairing, e, Rw), x.in_dt);
        store_dyn<R>(xo, e, x.out_dt, rot(a, c[e], z, ss[e]));
    }
}

// T = void selects the any-dtype rows.
template <typename R, typename T, int V>
PE_HD void rotate_token(const RopeP &p, int64_t b, int64_t t, const R *c, const R *ss, Lane l) {
    for (int w = 0; w < 2; ++w) {
        if (p.x[w].heads == 0) continue;
        if constexpr (std::is_void_v<T>)
            rotate_dyn<R>(p, p.x[w], b, t, c, ss, l);
        else
            rotate_typed<R, T, V>(p, p.x[w], b, t, c, ss, l);
    }
}

// ---- table gradients: row (b', t) of dcos/dsin, one lane per channel ---------------------

// Sums in a fixed order (batch, then q heads, then k heads), as the CPU does.
template <typename R> PE_HD void table_grad_row(const GradP &gp, int64_t row, Lane l) {
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
                    const R g = load_dyn<R>(gr, e, gp.g_dt);
                    acc_c = add(acc_c, mul(g, load_dyn<R>(xr, e, x.in_dt)));
                    const R gx = mul(g, load_dyn<R>(xr, pe, x.in_dt));
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

template <typename T> struct Tag {
    using type = T;
};

// For one pass (apply_passes): calls f(Tag<R>, Tag<T>, integral_constant<V>) with the
// compute type R, the one storage dtype T of every tensor in and out (void: mixed) and the
// elements per access V.
template <typename F> void with_apply_variant(const pe_rope_args *a, F &&f) {
    const pe_rope_tensor &x = a->q.heads ? a->q : a->k;
    const pe_dtype dt = x.in_dtype;
    const bool uniform = x.out_dtype == dt &&
                         (a->q.heads == 0 || (a->q.in_dtype == dt && a->q.out_dtype == dt)) &&
                         (a->k.heads == 0 || (a->k.in_dtype == dt && a->k.out_dtype == dt));
    auto typed = [&](auto r, auto tx) {
        using T = typename decltype(tx)::type;
        constexpr int V = static_cast<int>(16 / sizeof(typename Io<T>::storage));
        if (rows_aligned(a, V, static_cast<int64_t>(sizeof(typename Io<T>::storage))))
            f(r, tx, std::integral_constant<int, V>{});
        else
            f(r, tx, std::integral_constant<int, 1>{});
    };
    if (runs_f64(a, a->q) || runs_f64(a, a->k)) {
        if (uniform && dt == PE_FLOAT64)
            typed(Tag<double>{}, Tag<double>{});
        else
            f(Tag<double>{}, Tag<void>{}, std::integral_constant<int, 1>{});
    } else if (!uniform) {
        f(Tag<float>{}, Tag<void>{}, std::integral_constant<int, 1>{});
    } else if (dt == PE_FLOAT32) {
        typed(Tag<float>{}, Tag<float>{});
    } else if (dt == PE_BFLOAT16) {
        typed(Tag<float>{}, Tag<Bf16>{});
    } else {
        typed(Tag<float>{}, Tag<F16>{});
    }
}

// ---- host: argument checks, rope.c's own (rope_check.h) plus the width limit of the
// kernel parameters --------------------------------------------------------------------

// What a call does after its checks.
enum class Work { None, Run, BadArg };

inline Work work_of(int rc) {
    return rc < 0 ? Work::BadArg : rc == PE_CHECK_RUN ? Work::Run : Work::None;
}

inline bool width_ok(const pe_rope_args *a) {
    return !a || a->rot_dim <= PE_CUDA_MAX_ROT;
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

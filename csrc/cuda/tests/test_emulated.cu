// The CUDA kernels' code run on the host, bit for bit against the CPU kernels.
//
// rope_kernels.cuh holds everything a GPU thread does and the entry points' launch loops;
// this program compiles it with nvcc as host code and runs each launch the way the GPU would:
// blocks one after another (a small grid, so the grid-stride loops wrap), and inside a block
// every thread through one phase before any starts the next (where the kernels synchronize).
// The conversion instructions run as their model (cvt_model.h).  Outputs must equal the CPU's
// (pe_rope_apply, pe_rope_table_grad, pe_rope_tables) byte for byte, untouched bytes
// included (with NaN, infinities and other special inputs: a NaN where the CPU has one);
// argument checks must return the CPU's statuses.  Covers pairings, transpose, tables (plain,
// per-batch, MRoPE sections that split a 16-byte chunk and sections that do not,
// interleaved, an axis map of neither form) and positions, partial rotary, GQA / MQA / no k /
// no q / no heads at all, (B, T, H, D) and (B, H, T, D) layouts, misaligned rows, every
// dtype and mixes, batches and decode steps; the conversions against the CPU's over all
// 2^32 fp32 patterns; and the math header's functions, nvcc host code against C, over a
// sweep of inputs (tests/math_sweep.h).  What this cannot check: the device's own
// arithmetic, instructions and memory system.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../rope_kernels.cuh"
#include "math_sweep.h"

extern "C" uint64_t pe_math_sweep_c(uint32_t i); // math_sweep_c.c, compiled as C

using namespace pe_cuda;

namespace {

constexpr int64_t kGrid = 3; // blocks of the emulated launch (grid-stride wraps)
// threads per block: the kernels' own count (several tokens per phase), and one that is not
// a divisor of any row (a token's items loop, chunk counts that do not fill the block)
constexpr int kApplyBlockSizes[] = {kApplyThreads, 37};
constexpr int kThreads = 37; // table gradients and tables

int failures = 0, checks = 0, vector_runs = 0, wide_runs = 0, positions_runs = 0;
int axis_runs[kAxisMap + 1][2]; // runs per axis form, one-element and vector kernels
void expect(bool ok, const std::string &what);

// ---- emulated launches: the entry points' own launch loops (rope_kernels.cuh), each launch
// run on the host ----------------------------------------------------------------------------

// The apply kernel (rope.cu) on `threads` threads per block and g.grid blocks, one block
// after another.  Tables: each thread's whole group (no barrier).  Positions: per group,
// every thread issues its loads, then every thread writes its token's rows, then every
// thread rotates and stores (the kernel's barriers between them).
template <typename R, typename T, int V, typename Off, typename S>
void emulate_apply(const RopeP &p, const ApplyGrid &g, int threads) {
    expect(g.lanes <= threads && g.tokens >= 1 && g.tokens * g.lanes <= threads &&
               (g.chunks > threads ? g.lanes == threads && g.rstep == 1
                                   : g.lanes % g.chunks == 0 && g.rstep * g.chunks == g.lanes),
           "apply layout: a token's lanes fit the block and keep their chunk");
    std::vector<R> rows(apply_shared_bytes<R, S>(g) / sizeof(R) + 1);
    for (int64_t blk = 0; blk < g.grid; ++blk) {
        std::vector<ApplyThread<R, T, V, Off, S>> th;
        for (int i = 0; i < threads; ++i)
            th.emplace_back(p, g, blk, Lane{i, threads});
        for (int64_t group = blk; group < g.groups; group += g.grid) {
            if constexpr (is_positions<S>) {
                for (auto &x : th)
                    x.positions_load(p, g);
                for (auto &x : th)
                    x.positions_rows(p, g, rows.data());
                for (auto &x : th)
                    x.positions_finish(p, g, rows.data());
            } else {
                for (auto &x : th)
                    if (x.active) x.tables_group(p, g);
            }
            for (auto &x : th)
                x.next_group(g);
        }
    }
}

int emu_rope_apply(const pe_rope_args *a, int threads = kApplyThreads) {
    return run_apply(
        a, threads, [](int64_t groups, int) { return groups < kGrid ? groups : kGrid; },
        [&](auto r, auto tx, auto v, auto off, auto src, const RopeP &p, const ApplyGrid &g) {
            using R = typename decltype(r)::type;
            using T = typename decltype(tx)::type;
            using Off = typename decltype(off)::type;
            using S = typename decltype(src)::type;
            constexpr int V = decltype(v)::value;
            vector_runs += V > 1;
            positions_runs += is_positions<S>;
            ++axis_runs[p.src.ax.mode][V > 1];
            // the odd block size runs with 64-bit offsets inside a token, which real calls
            // need only for head strides past 2^31 elements
            if (threads == kApplyThreads) {
                wide_runs += sizeof(Off) == 8;
                emulate_apply<R, T, V, Off, S>(p, g, threads);
            } else {
                ++wide_runs;
                emulate_apply<R, T, V, int64_t, S>(p, g, threads);
            }
            return PE_OK;
        });
}

int emu_rope_table_grad(const pe_rope_args *a, const void *gq, const int64_t gqs[3], const void *gk,
                        const int64_t gks[3], pe_dtype gdt, void *dcos, void *dsin) {
    return run_table_grad(a, gq, gqs, gk, gks, gdt, dcos, dsin,
                          [&](auto r, auto g, auto x, const GradP &gp) {
                              using R = typename decltype(r)::type;
                              using G = typename decltype(g)::type;
                              using X = typename decltype(x)::type;
                              const int64_t nrow = gp.p.src.table_batch * gp.p.T;
                              for (int64_t blk = 0; blk < kGrid; ++blk)
                                  for (int64_t row = blk; row < nrow; row += kGrid)
                                      for (int i = 0; i < kThreads; ++i)
                                          table_grad_row<R, G, X>(gp, row, {i, kThreads});
                              return PE_OK;
                          });
}

int emu_rope_tables(const pe_rope_args *a, pe_dtype odt, void *cos, void *sin) {
    return run_tables(a, odt, cos, sin, [&](const RopeP &p) {
        std::vector<float> smem(2 * static_cast<size_t>(p.R));
        const int64_t nrow = p.src.pos_batch * p.T;
        for (int64_t blk = 0; blk < kGrid; ++blk)
            for (int64_t row = blk; row < nrow; row += kGrid) {
                for (int i = 0; i < kThreads; ++i)
                    token_tables(p, row / p.T, row % p.T, smem.data(), smem.data() + p.R,
                                 {i, kThreads});
                for (int i = 0; i < kThreads; ++i)
                    store_tables_row(p, row, smem.data(), smem.data() + p.R, odt,
                                     static_cast<char *>(cos), static_cast<char *>(sin),
                                     {i, kThreads});
            }
        return PE_OK;
    });
}

// ---- data ---------------------------------------------------------------------------------

std::mt19937_64 rng(12);

const char *dtype_name(pe_dtype t) {
    switch (t) {
    case PE_FLOAT32: return "f32";
    case PE_FLOAT64: return "f64";
    case PE_BFLOAT16: return "bf16";
    case PE_FLOAT16: return "f16";
    }
    return "?";
}

// n random values in dtype dt, in [-2, 2)
std::vector<char> random_buffer(int64_t n, pe_dtype dt) {
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::vector<char> buf(static_cast<size_t>(n) * pe_dtype_size(dt));
    for (int64_t i = 0; i < n; ++i) {
        const float v = u(rng);
        switch (dt) {
        case PE_FLOAT32: reinterpret_cast<float *>(buf.data())[i] = v; break;
        case PE_FLOAT64:
            reinterpret_cast<double *>(buf.data())[i] = static_cast<double>(v) * (1.0 + 1e-9);
            break;
        case PE_BFLOAT16: reinterpret_cast<uint16_t *>(buf.data())[i] = pe_f32_to_bf16(v); break;
        case PE_FLOAT16: reinterpret_cast<uint16_t *>(buf.data())[i] = Io<F16>::store(v); break;
        }
    }
    return buf;
}

void expect(bool ok, const std::string &what) {
    ++checks;
    if (!ok) {
        ++failures;
        if (failures <= 20) std::fprintf(stderr, "FAIL %s\n", what.c_str());
    }
}

// One tensor (B, T, H, D) in a layout; `shift` elements of offset make its rows misaligned.
struct Tensor {
    std::vector<char> in, out_cpu, out_emu;
    int64_t stride[3];
    pe_dtype in_dt, out_dt;
    int64_t heads;
    int64_t shift;
};

Tensor make_tensor(int64_t B, int64_t T, int64_t H, int64_t D, bool heads_outer, pe_dtype in_dt,
                   pe_dtype out_dt, int64_t shift) {
    Tensor x{};
    x.heads = H;
    x.in_dt = in_dt;
    x.out_dt = out_dt;
    x.shift = shift;
    if (heads_outer)
        x.stride[0] = H * T * D, x.stride[1] = D, x.stride[2] = T * D;
    else
        x.stride[0] = T * H * D, x.stride[1] = H * D, x.stride[2] = D;
    const int64_t n = B * T * H * D + shift;
    x.in = random_buffer(n, in_dt);
    x.out_cpu.assign(static_cast<size_t>(n) * pe_dtype_size(out_dt), '\x5a');
    x.out_emu = x.out_cpu;
    return x;
}

void bind(pe_rope_tensor &dst, Tensor &x, bool emu) {
    dst.in = x.in.data() + x.shift * pe_dtype_size(x.in_dt);
    dst.out = (emu ? x.out_emu : x.out_cpu).data() + x.shift * pe_dtype_size(x.out_dt);
    dst.in_dtype = x.in_dt;
    dst.out_dtype = x.out_dt;
    dst.heads = x.heads;
    for (int i = 0; i < 3; ++i)
        dst.in_stride[i] = dst.out_stride[i] = x.stride[i];
}

// Special values written over every `stride`-th element: NaN of several payloads and both
// signs, infinities, signed zeros, subnormals and the largest finite value (products of
// which overflow).
void put_specials(std::vector<char> &buf, pe_dtype dt, int64_t stride) {
    static const uint64_t f64[] = {0x7ff8000000000001ull, 0xfff4000000000000ull,
                                   0x7ff0000000000000ull, 0xfff0000000000000ull,
                                   0x8000000000000000ull, 0x0000000000000001ull,
                                   0x7fefffffffffffffull};
    static const uint32_t f32[] = {0x7fc00001u, 0xff800001u, 0x7f800000u, 0xff800000u,
                                   0x80000000u, 0x00000001u, 0x7f7fffffu};
    static const uint16_t bf16[] = {0x7fc1u, 0xffa0u, 0x7f80u, 0xff80u, 0x8000u, 0x0001u, 0x7f7fu};
    static const uint16_t f16[] = {0x7e01u, 0xfd00u, 0x7c00u, 0xfc00u, 0x8000u, 0x0001u, 0x7bffu};
    const size_t es = pe_dtype_size(dt), n = buf.size() / es;
    for (size_t i = 0, j = 0; i < n; i += static_cast<size_t>(stride), ++j) {
        char *at = buf.data() + i * es;
        switch (dt) {
        case PE_FLOAT64: std::memcpy(at, &f64[j % 7], 8); break;
        case PE_FLOAT32: std::memcpy(at, &f32[j % 7], 4); break;
        case PE_BFLOAT16: std::memcpy(at, &bf16[j % 7], 2); break;
        case PE_FLOAT16: std::memcpy(at, &f16[j % 7], 2); break;
        }
    }
}

bool is_nan(const char *at, pe_dtype dt) {
    uint64_t u = 0;
    std::memcpy(&u, at, pe_dtype_size(dt));
    switch (dt) {
    case PE_FLOAT64: return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
    case PE_FLOAT32: return (u & 0x7fffffffu) > 0x7f800000u;
    case PE_BFLOAT16: return (u & 0x7fffu) > 0x7f80u;
    default: return (u & 0x7fffu) > 0x7c00u;
    }
}

// The same bits; with `nan_payloads`, a NaN where the CPU has a NaN is enough.
bool same_bits(const std::vector<char> &cpu, const std::vector<char> &emu, pe_dtype dt,
               bool nan_payloads) {
    if (cpu == emu) return true;
    if (!nan_payloads || cpu.size() != emu.size()) return false;
    const size_t es = pe_dtype_size(dt);
    for (size_t i = 0; i + es <= cpu.size(); i += es)
        if (std::memcmp(&cpu[i], &emu[i], es) && !(is_nan(&cpu[i], dt) && is_nan(&emu[i], dt)))
            return false;
    return true;
}

// ---- the case matrix ------------------------------------------------------------------------

// MRoPE sources: sections [s - 2(s/3), s/3, s/3] of the s slots (bounds that split 16-byte
// chunks: the one-element variant), sections on multiples of 8 slots (Qwen2-VL's [16, 24, 24]
// at R = 128: the vector variant), interleaved, and an axis map of neither form.
enum Source {
    TABLES,
    TABLES_PER_BATCH,
    TABLES_SECTIONS,
    TABLES_SECTIONS8,
    TABLES_INTERLEAVED,
    TABLES_MAP,
    POS_2D,
    POS_SECTIONS,
    POS_INTERLEAVED,
    POS_MAP,
};
const char *source_name[] = {"tables",      "tables_per_batch", "tables_sections",
                             "tables_sections8", "tables_interleaved", "tables_map",
                             "pos_2d",      "pos_sections",     "pos_interleaved",
                             "pos_map"};

bool is_tables(Source s) {
    return s <= TABLES_MAP;
}

struct Case {
    int64_t B, T, Hq, Hk, D, R;
    bool heads_outer;
    pe_dtype x_dt, out_dt, table_dt;
    pe_dtype k_dt, k_out_dt; // k's dtypes (q's: x_dt, out_dt)
    Source src;
    pe_pairing pairing;
    int transpose;
    int64_t shift;
    bool specials; // NaN, infinities, signed zeros, subnormals and huge values among the inputs
};

std::string name(const Case &c) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "ROPE(q=%s->%s,k=%s->%s,tab=%s,B=%lld,T=%lld,H=%lld/"
                  "%lld,D=%lld,R=%lld,%s,%s,%s,%s,shift=%lld%s)",
                  dtype_name(c.x_dt), dtype_name(c.out_dt), dtype_name(c.k_dt),
                  dtype_name(c.k_out_dt), dtype_name(c.table_dt), (long long)c.B, (long long)c.T,
                  (long long)c.Hq, (long long)c.Hk, (long long)c.D, (long long)c.R,
                  c.heads_outer ? "bhtd" : "bthd", source_name[c.src],
                  c.pairing == PE_PAIR_HALF ? "half" : "adjacent",
                  c.transpose ? "transpose" : "forward", (long long)c.shift,
                  c.specials ? ",specials" : "");
    return buf;
}

// The angle source of a case; owns the buffers the pointers in src refer to.
struct SourceData {
    std::vector<char> cos, sin;
    std::vector<int64_t> pos;
    std::vector<float> inv_freq;
    std::vector<uint8_t> axis;
};

void make_source(const Case &c, pe_rope_source &src, SourceData &d) {
    const int64_t slots = c.R / 2;
    const bool mrope = c.src != TABLES && c.src != TABLES_PER_BATCH && c.src != POS_2D;
    if (mrope) {
        d.axis.resize(static_cast<size_t>(slots));
        if (c.src == TABLES_MAP || c.src == POS_MAP) {
            for (int64_t i = 0; i < slots; ++i)
                d.axis[i] = static_cast<uint8_t>((i * 5 + i / 7) % 3);
        } else {
            const int64_t hw = c.src == TABLES_SECTIONS8 ? slots * 3 / 8 / 8 * 8 : slots / 3;
            const int64_t sec[3] = {slots - 2 * hw, hw, hw};
            const int interleaved = c.src == TABLES_INTERLEAVED || c.src == POS_INTERLEAVED;
            if (pe_mrope_axis_map(slots, sec, interleaved, d.axis.data()) != PE_OK) std::abort();
        }
        src.axis_of_slot = d.axis.data();
    }
    const int64_t A = mrope ? 3 : 1;
    if (is_tables(c.src)) {
        const int64_t Bc = c.src == TABLES_PER_BATCH ? c.B : 1;
        d.cos = random_buffer(A * Bc * c.T * c.R, c.table_dt);
        d.sin = random_buffer(A * Bc * c.T * c.R, c.table_dt);
        src.cos = d.cos.data();
        src.sin = d.sin.data();
        src.table_dtype = c.table_dt;
        src.table_batch = Bc;
        src.table_stride[0] = mrope ? Bc * c.T * c.R : 0;
        src.table_stride[1] = c.T * c.R;
        src.table_stride[2] = c.R;
        if (c.specials) {
            put_specials(d.cos, c.table_dt, 3);
            put_specials(d.sin, c.table_dt, 5);
        }
        return;
    }
    std::uniform_int_distribution<int64_t> u(0, 40000);
    const int64_t Bp = c.B;
    d.pos.resize(static_cast<size_t>(A * Bp * c.T));
    for (auto &v : d.pos)
        v = u(rng);
    d.pos[0] = 2000000; // beyond the exact reduction: the libm path
    d.inv_freq.resize(static_cast<size_t>(slots));
    for (int64_t i = 0; i < slots; ++i)
        d.inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * i / c.R));
    src.pos = d.pos.data();
    src.pos_batch = Bp;
    src.pos_stride[0] = mrope ? Bp * c.T : 0;
    src.pos_stride[1] = c.T;
    src.pos_stride[2] = 1;
    src.inv_freq = d.inv_freq.data();
    src.scaling = 0.75f;
}

void run_apply(const Case &c) {
    Tensor q = make_tensor(c.B, c.T, c.Hq, c.D, c.heads_outer, c.x_dt, c.out_dt, c.shift);
    Tensor k = make_tensor(c.B, c.T, c.Hk, c.D, c.heads_outer, c.k_dt, c.k_out_dt, 0);
    if (c.specials) {
        put_specials(q.in, c.x_dt, 11);
        put_specials(k.in, c.k_dt, 13);
    }
    SourceData sd;
    pe_rope_args a{};
    a.batch = c.B;
    a.seq = c.T;
    a.head_dim = c.D;
    a.rot_dim = c.R;
    a.pairing = c.pairing;
    a.transpose = c.transpose;
    a.nthreads = 1;
    make_source(c, a.src, sd);
    pe_rope_args e = a;
    bind(a.q, q, false);
    bind(a.k, k, false);
    bind(e.q, q, true);
    bind(e.k, k, true);
    const int rc_cpu = pe_rope_apply(&a);
    const std::string n = name(c);
    const std::vector<char> q_fill = q.out_emu, k_fill = k.out_emu;
    // NaN payloads and signs are not part of the contract: the device's arithmetic and fp16
    // widening give a canonical NaN, and even on one host the operand order of a product
    // decides which NaN it keeps (check_conversions holds the NaN encodings themselves)
    const bool nan_payloads = c.specials;
    for (int threads : kApplyBlockSizes) {
        q.out_emu = q_fill, k.out_emu = k_fill;
        bind(e.q, q, true);
        bind(e.k, k, true);
        const int rc_emu = emu_rope_apply(&e, threads);
        const std::string nt = n + " threads=" + std::to_string(threads);
        expect(rc_cpu == PE_OK && rc_emu == PE_OK, nt + ": status");
        expect(same_bits(q.out_cpu, q.out_emu, c.out_dt, nan_payloads), nt + ": q bits");
        expect(same_bits(k.out_cpu, k.out_emu, c.k_out_dt, nan_payloads), nt + ": k bits");
    }

    if (!is_tables(c.src)) return;
    // table gradients with the same tensors: x = q/k in, g = their outputs
    const int64_t A = a.src.axis_of_slot ? 3 : 1, rows = A * a.src.table_batch * c.T * c.R;
    const size_t tbytes = static_cast<size_t>(rows) * pe_dtype_size(c.table_dt);
    std::vector<char> dc_cpu(tbytes, '\x11'), ds_cpu(tbytes, '\x22'), dc_emu = dc_cpu,
                                                                      ds_emu = ds_cpu;
    const void *gq = q.out_cpu.data() + q.shift * pe_dtype_size(c.out_dt);
    std::vector<char> gk_buf = random_buffer(c.B * c.T * c.Hk * c.D, c.out_dt); // grad dtype is q's
    const void *gk = gk_buf.data();
    const int rg_cpu = pe_rope_table_grad(&a, gq, q.stride, k.heads ? gk : nullptr, k.stride,
                                          c.out_dt, dc_cpu.data(), ds_cpu.data());
    const int rg_emu = emu_rope_table_grad(&e, gq, q.stride, k.heads ? gk : nullptr, k.stride,
                                           c.out_dt, dc_emu.data(), ds_emu.data());
    expect(rg_cpu == PE_OK && rg_emu == PE_OK, n + ": table_grad status");
    expect(same_bits(dc_cpu, dc_emu, c.table_dt, nan_payloads) &&
               same_bits(ds_cpu, ds_emu, c.table_dt, nan_payloads),
           n + ": table_grad bits");
}

void run_tables(int64_t B, int64_t T, int64_t R, Source s, pe_pairing pairing, pe_dtype odt) {
    Case c{};
    c.B = B, c.T = T, c.R = c.D = R, c.src = s, c.pairing = pairing;
    SourceData sd;
    pe_rope_args a{};
    a.batch = B;
    a.seq = T;
    a.head_dim = a.rot_dim = R;
    a.pairing = pairing;
    a.nthreads = 1;
    make_source(c, a.src, sd);
    const size_t bytes = static_cast<size_t>(B * T * R) * pe_dtype_size(odt);
    std::vector<char> c_cpu(bytes, 1), s_cpu(bytes, 2), c_emu = c_cpu, s_emu = s_cpu;
    const int r1 = pe_rope_tables(&a, odt, c_cpu.data(), s_cpu.data());
    const int r2 = emu_rope_tables(&a, odt, c_emu.data(), s_emu.data());
    const std::string n = std::string("TABLES(") + source_name[s] + "," + dtype_name(odt) + "," +
                          (pairing == PE_PAIR_HALF ? "half" : "adjacent") +
                          ",R=" + std::to_string(R) + ")";
    expect(r1 == PE_OK && r2 == PE_OK, n + ": status");
    expect(c_cpu == c_emu && s_cpu == s_emu, n + ": bits");
}

// Invalid arguments: the CPU's status (and PE_ERR_ARG past the CUDA width limit).
void run_checks() {
    std::vector<float> x(64 * 4, 1.0f), o(64 * 4), tab(64, 0.5f);
    pe_rope_args base{};
    base.batch = 1, base.seq = 1, base.head_dim = 64, base.rot_dim = 64;
    base.q = {x.data(), o.data(), PE_FLOAT32, PE_FLOAT32, 1, {64, 64, 64}, {64, 64, 64}};
    base.src.cos = base.src.sin = tab.data();
    base.src.table_dtype = PE_FLOAT32;
    base.src.table_batch = 1;
    base.src.table_stride[1] = base.src.table_stride[2] = 64;
    uint8_t bad_axis[32];
    std::memset(bad_axis, 3, sizeof bad_axis);
    struct Bad {
        const char *what;
        void (*edit)(pe_rope_args &, uint8_t *);
    } bad[] = {
        {"ok", [](pe_rope_args &, uint8_t *) {}},
        {"odd rot_dim", [](pe_rope_args &a, uint8_t *) { a.rot_dim = 63; }},
        {"rot_dim > head_dim", [](pe_rope_args &a, uint8_t *) { a.rot_dim = 66; }},
        {"pairing 7", [](pe_rope_args &a, uint8_t *) { a.pairing = static_cast<pe_pairing>(7); }},
        {"axis 3", [](pe_rope_args &a, uint8_t *m) { a.src.axis_of_slot = m; }},
        {"table batch 2 of 1", [](pe_rope_args &a, uint8_t *) { a.src.table_batch = 2; }},
        {"no sin", [](pe_rope_args &a, uint8_t *) { a.src.sin = nullptr; }},
        {"bad dtype", [](pe_rope_args &a, uint8_t *) { a.q.in_dtype = static_cast<pe_dtype>(9); }},
        {"negative heads", [](pe_rope_args &a, uint8_t *) { a.q.heads = -1; }},
        {"empty batch", [](pe_rope_args &a, uint8_t *) { a.batch = 0; }},
        {"in place (out = in)",
         [](pe_rope_args &a, uint8_t *) { a.q.out = const_cast<void *>(a.q.in); }},
        {"out overlaps the cos table",
         [](pe_rope_args &a, uint8_t *) { a.q.out = const_cast<void *>(a.src.cos); }},
        {"stride overflows int64",
         [](pe_rope_args &a, uint8_t *) {
             a.batch = 2;
             a.src.table_batch = 1;
             a.q.in_stride[0] = INT64_MAX / 2;
         }},
        {"B T H D overflows int64",
         [](pe_rope_args &a, uint8_t *) {
             a.batch = INT64_MAX / 2;
             a.seq = 4;
         }},
        {"positions without inv_freq",
         [](pe_rope_args &a, uint8_t *) {
             static const int64_t pos[1] = {0};
             a.src.pos = pos;
             a.src.pos_batch = 1;
         }},
    };
    for (const Bad &b : bad) {
        pe_rope_args a = base;
        b.edit(a, bad_axis);
        const bool valid = !std::strcmp(b.what, "ok") || !std::strcmp(b.what, "empty batch");
        const int cpu = pe_rope_apply(&a);
        expect(cpu == (valid ? PE_OK : PE_ERR_ARG) && cpu == emu_rope_apply(&a),
               std::string("CHECK apply: ") + b.what);
    }
    std::vector<float> big(4096 * 2, 0.0f), big_o(4096 * 2);
    pe_rope_args w = base;
    w.head_dim = w.rot_dim = PE_CUDA_MAX_ROT + 2;
    w.q = {big.data(), big_o.data(),       PE_FLOAT32,        PE_FLOAT32,
           1,          {4096, 4096, 4096}, {4096, 4096, 4096}};
    expect(emu_rope_apply(&w) == PE_ERR_ARG, "CHECK apply: rot_dim past PE_CUDA_MAX_ROT");
    // a token of 2^31 elements or more: refused before anything is read (the pointers are
    // never dereferenced)
    pe_rope_args huge = base;
    huge.head_dim = (int64_t{1} << 30) + 2;
    huge.rot_dim = 2;
    huge.q.heads = 2;
    for (int i = 0; i < 3; ++i)
        huge.q.in_stride[i] = huge.q.out_stride[i] = huge.head_dim * (i == 2 ? 1 : 2);
    expect(emu_rope_apply(&huge) == PE_ERR_ARG, "CHECK apply: heads * head_dim past int32");
}

// q and k without heads (B T > 0): nothing to rotate, PE_OK at once, nothing written (the
// layout of such a call would divide by zero); and k's heads only.
void run_zero_heads() {
    std::vector<float> tab(2 * 5 * 64, 0.5f);
    pe_rope_args a{};
    a.batch = 2, a.seq = 5, a.head_dim = a.rot_dim = 64;
    a.src.cos = a.src.sin = tab.data();
    a.src.table_dtype = PE_FLOAT32;
    a.src.table_batch = 1;
    a.src.table_stride[1] = 5 * 64, a.src.table_stride[2] = 64;
    a.q = {nullptr, nullptr, PE_BFLOAT16, PE_BFLOAT16, 0, {0, 0, 0}, {0, 0, 0}};
    a.k = a.q;
    for (int threads : kApplyBlockSizes) {
        expect(pe_rope_apply(&a) == PE_OK && emu_rope_apply(&a, threads) == PE_OK,
               "ZERO HEADS: q and k without heads, B T > 0");
        for (pe_pairing pr : {PE_PAIR_HALF, PE_PAIR_ADJACENT}) {
            pe_rope_args f = a;
            f.pairing = pr;
            static const int64_t pos[10] = {0, 1, 2, 3, 4, 0, 1, 2, 3, 4};
            static float inv[32];
            f.src = {};
            f.src.pos = pos, f.src.pos_batch = 2, f.src.pos_stride[1] = 5, f.src.pos_stride[2] = 1;
            f.src.inv_freq = inv;
            expect(emu_rope_apply(&f, threads) == PE_OK, "ZERO HEADS: fused, no heads");
        }
    }
    Case c{};
    c.B = 2, c.T = 5, c.Hq = 0, c.Hk = 3, c.D = c.R = 64, c.src = TABLES;
    c.x_dt = c.out_dt = c.table_dt = c.k_dt = c.k_out_dt = PE_BFLOAT16;
    run_apply(c); // k's heads only
}

// The conversions the kernels use, against the CPU's, over every fp32 bit pattern (and every
// fp16 pattern for the widening).  First the instructions alone: their model (cvt_model.h,
// written from their documented semantics, which the host build runs in their place) and
// NVIDIA's host implementation of the intrinsics (cuda_bf16.h, cuda_fp16.h) equal the CPU's
// functions for every non-NaN input and give a NaN for a NaN.  Then the kernels' own
// conversions: a vector of 8 (Unit::pack) gives the CPU's bits for every input but NaN and a
// NaN for a NaN (the instruction's: NaN bits are outside the contract), one value
// (round_bf16, round_f16, with their NaN path) the CPU's bits for every input.  That the
// device instructions do what they are documented to do is not something a host can show:
// math_device.cu compares them on a GPU.
template <typename T> uint64_t kernel_conversion_errors(int64_t base) {
    using U = Unit<float, T, 8>;
    float x[8];
    for (int k = 0; k < 8; ++k)
        x[k] = pe_bits_f32(static_cast<uint32_t>(base + k));
    const typename U::raw w = U::pack(x);
    uint64_t bad = 0;
    for (int k = 0; k < 8; ++k) {
        const bool bf = std::is_same_v<T, Bf16>;
        const uint16_t cpu = bf ? pe_f32_to_bf16(x[k]) : pe_f32_to_f16(x[k]);
        const uint16_t one = bf ? round_bf16(x[k]) : round_f16(x[k]);
        const uint16_t vec = static_cast<uint16_t>(w.w[k >> 1] >> (16 * (k & 1)));
        const bool nan = (vec & 0x7fffu) > (bf ? 0x7f80u : 0x7c00u);
        bad += (x[k] == x[k] ? vec != cpu : !nan) || one != cpu;
    }
    return bad;
}

void check_conversions() {
    uint64_t bad_bf16 = 0, bad_f16 = 0, nans = 0, bad_kernel = 0;
#pragma omp parallel for reduction(+ : bad_bf16, bad_f16, nans, bad_kernel) schedule(static)
    for (int64_t i = 0; i < (int64_t{1} << 32); ++i) {
        const float f = pe_bits_f32(static_cast<uint32_t>(i));
        if ((i & 7) == 0)
            bad_kernel += kernel_conversion_errors<Bf16>(i) + kernel_conversion_errors<F16>(i);
        const uint16_t cpu_b = pe_f32_to_bf16(f), cpu_h = pe_f32_to_f16(f);
        const uint16_t model_b = cvt_rn_bf16_model(f), model_h = cvt_rn_f16_model(f);
        const uint16_t nv_b = __bfloat16_as_ushort(__float2bfloat16_rn(f));
        const uint16_t nv_h = __half_as_ushort(__float2half_rn(f));
        if (f != f) {
            ++nans;
            const auto nan_b = [](uint16_t h) { return (h & 0x7fffu) > 0x7f80u; };
            const auto nan_h = [](uint16_t h) { return (h & 0x7fffu) > 0x7c00u; };
            bad_bf16 += !(nan_b(cpu_b) && nan_b(model_b) && nan_b(nv_b));
            bad_f16 += !(nan_h(cpu_h) && nan_h(model_h) && nan_h(nv_h));
            continue;
        }
        bad_bf16 += cpu_b != model_b || cpu_b != nv_b;
        bad_f16 += cpu_h != model_h || cpu_h != nv_h;
    }
    expect(nans == (uint64_t{1} << 24) - 2, "conversions: every NaN pattern seen");
    expect(bad_bf16 == 0, "cvt.rn.bf16x2.f32 (model, NVIDIA host) vs pe_f32_to_bf16 over 2^32 "
                          "fp32 patterns: " + std::to_string(bad_bf16) + " differ");
    expect(bad_f16 == 0, "cvt.rn.f16x2.f32 (model, NVIDIA host) vs pe_f32_to_f16 over 2^32 fp32 "
                         "patterns: " + std::to_string(bad_f16) + " differ");
    expect(bad_kernel == 0, "the kernels' bf16/fp16 rounding (vector: NaN for NaN; one value: "
                            "the CPU's NaN too) vs the CPU's over 2^32 fp32 patterns: " +
                                std::to_string(bad_kernel) + " differ");
    int bad_wide = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
        const float cpu = pe_f16_to_f32(static_cast<uint16_t>(h));
        const float model = cvt_f32_f16_model(static_cast<uint16_t>(h));
        const float nv = __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
        if (cpu != cpu)
            bad_wide += model == model || nv == nv;
        else
            bad_wide += pe_f32_bits(cpu) != pe_f32_bits(model) || pe_f32_bits(cpu) != pe_f32_bits(nv);
    }
    expect(bad_wide == 0, "cvt.f32.f16 (model, NVIDIA host) vs pe_f16_to_f32 over 2^16 fp16 "
                          "patterns: " + std::to_string(bad_wide) + " differ");
    std::printf("conversions over all 2^32 fp32 patterns (%llu NaN) and 2^16 fp16: instruction "
                "model and NVIDIA host vs the CPU %llu (bf16), %llu (fp16), %d (fp16 -> fp32) "
                "differ; the kernels' rounding vs the CPU %llu differ\n",
                static_cast<unsigned long long>(nans), static_cast<unsigned long long>(bad_bf16),
                static_cast<unsigned long long>(bad_f16), bad_wide,
                static_cast<unsigned long long>(bad_kernel));
}

} // namespace

int main() {
    const pe_dtype dts[] = {PE_FLOAT32, PE_BFLOAT16, PE_FLOAT16, PE_FLOAT64};
    struct Dims {
        int64_t D, R;
    } dims[] = {{128, 128}, {128, 64}, {80, 80}, {10, 6}};
    struct Heads {
        int64_t q, k;
    } heads[] = {{4, 2}, {3, 1}, {2, 0}};
    for (const Dims &dm : dims)
        for (int src = TABLES; src <= POS_MAP; ++src)
            for (int pairing = 0; pairing < 2; ++pairing)
                for (int transpose = 0; transpose < 2; ++transpose)
                    for (int layout = 0; layout < 2; ++layout)
                        for (const Heads &h : heads)
                            for (int variant = 0; variant < 8; ++variant) {
                                Case c{};
                                c.B = 2, c.T = 5, c.Hq = h.q, c.Hk = h.k, c.D = dm.D, c.R = dm.R;
                                c.heads_outer = layout == 1;
                                c.src = static_cast<Source>(src);
                                c.pairing = static_cast<pe_pairing>(pairing);
                                c.transpose = transpose;
                                // four uniform dtypes, then mixes: bf16 in / fp32 out with
                                // fp32 tables, and fp16 x with fp64 tables (the fp64 core)
                                c.x_dt = c.out_dt = c.table_dt = dts[variant % 4];
                                if (variant == 4)
                                    c.x_dt = PE_BFLOAT16, c.out_dt = c.table_dt = PE_FLOAT32;
                                if (variant == 5)
                                    c.x_dt = c.out_dt = PE_FLOAT16, c.table_dt = PE_FLOAT64;
                                c.k_dt = c.x_dt, c.k_out_dt = c.out_dt;
                                // q and k in different precisions (two passes), and in
                                // different dtypes of one precision
                                if (variant == 6) {
                                    c.x_dt = c.out_dt = PE_FLOAT64, c.table_dt = PE_FLOAT32;
                                    c.k_dt = c.k_out_dt = PE_BFLOAT16;
                                }
                                if (variant == 7) {
                                    c.x_dt = PE_BFLOAT16, c.out_dt = c.table_dt = PE_FLOAT32;
                                    c.k_dt = c.k_out_dt = PE_FLOAT16;
                                }
                                if (variant < 4 && c.x_dt != PE_FLOAT64 && c.table_dt == c.x_dt &&
                                    transpose == 0 && layout == 0)
                                    c.table_dt =
                                        PE_FLOAT32; // HF passes fp32 tables with bf16 q too
                                c.shift = (variant == 1 && h.q == 3) ? 1 : 0;
                                run_apply(c);
                            }
    // longer sequences of real shapes (Qwen2-VL-7B heads, 16-bit tables as the model's
    // dtype): several groups per block, several tokens per group; batches of several rows
    // (the grid steps wrap t into b) and decode steps (T = 1: a step of whole rows)
    struct Long {
        int64_t B, T;
    } longs[] = {{1, 300}, {3, 101}, {64, 1}};
    for (const Long &lg : longs)
        for (int src : {TABLES, TABLES_SECTIONS8, TABLES_INTERLEAVED, POS_SECTIONS})
            for (int pairing = 0; pairing < 2; ++pairing)
                for (pe_dtype dt : {PE_BFLOAT16, PE_FLOAT16, PE_FLOAT32}) {
                    Case c{};
                    c.B = lg.B, c.T = lg.T, c.Hq = 28, c.Hk = 4, c.D = c.R = 128;
                    c.src = static_cast<Source>(src);
                    c.pairing = static_cast<pe_pairing>(pairing);
                    c.transpose = lg.T == 101;
                    c.x_dt = c.out_dt = c.table_dt = c.k_dt = c.k_out_dt = dt;
                    run_apply(c);
                }
    // NaN, infinities, signed zeros, subnormals and overflow among q, k and the tables: the
    // CPU's bits, or a NaN where the CPU has one (run on the host, the NaN path of the
    // vector kernels runs too, and gives the CPU's encodings)
    for (const Dims &dm : {Dims{128, 128}, Dims{80, 80}, Dims{10, 6}})
        for (int src : {TABLES, TABLES_SECTIONS8, POS_SECTIONS})
            for (int pairing = 0; pairing < 2; ++pairing)
                for (int transpose = 0; transpose < 2; ++transpose)
                    for (int variant = 0; variant < 6; ++variant) {
                        Case c{};
                        c.B = 2, c.T = 9, c.Hq = 4, c.Hk = 2, c.D = dm.D, c.R = dm.R;
                        c.src = static_cast<Source>(src);
                        c.pairing = static_cast<pe_pairing>(pairing);
                        c.transpose = transpose;
                        c.x_dt = c.out_dt = c.table_dt = dts[variant % 4];
                        if (variant == 4)
                            c.x_dt = PE_BFLOAT16, c.out_dt = c.table_dt = PE_FLOAT32;
                        if (variant == 5) c.x_dt = c.out_dt = PE_FLOAT16, c.table_dt = PE_FLOAT64;
                        c.k_dt = c.x_dt, c.k_out_dt = c.out_dt;
                        c.specials = true;
                        run_apply(c);
                    }
    run_zero_heads();
    for (int src = POS_2D; src <= POS_MAP; ++src)
        for (int pairing = 0; pairing < 2; ++pairing)
            for (pe_dtype dt : dts)
                run_tables(2, 7, 64, static_cast<Source>(src), static_cast<pe_pairing>(pairing),
                           dt);
    run_checks();
    // rope_math.h compiled by nvcc (host side) against the same header compiled as C
    uint32_t sweep_bad = 0;
    for (uint32_t i = 0; i < PE_SWEEP_N; ++i)
        sweep_bad += pe_math_sweep(i) != pe_math_sweep_c(i);
    expect(sweep_bad == 0, "rope_math.h: nvcc host code and C give the same bits (" +
                               std::to_string(sweep_bad) + " of " + std::to_string(PE_SWEEP_N) +
                               " differ)");
    check_conversions();
    expect(vector_runs > 0, "the 16-byte rows were exercised");
    expect(wide_runs > 0, "the 64-bit offsets were exercised");
    expect(positions_runs > 0, "the fused (positions) kernels were exercised");
    for (int mode = kAxisNone; mode <= kAxisMap; ++mode)
        expect(axis_runs[mode][0] > 0 && axis_runs[mode][1] > 0,
               "every axis form ran in the one-element and the vector kernels, or fell back");
    std::printf(
        "cuda kernels emulated on the host: %d checks, %d failed, %d runs on 16-byte rows, "
        "%d with 64-bit offsets, %d fused\n",
        checks, failures, vector_runs, wide_runs, positions_runs);
    return failures ? 1 : 0;
}

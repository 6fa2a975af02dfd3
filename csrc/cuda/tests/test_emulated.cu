// The CUDA kernels' code run on the host, bit for bit against the CPU kernels.
//
// rope_kernels.cuh holds everything a GPU thread does; this program compiles it with nvcc
// as host code and runs each launch the way the GPU would: blocks one after another (a
// small grid, so the grid-stride loops wrap), and inside a block every thread through one
// phase before any starts the next (where the kernels synchronize).  Outputs must equal
// the CPU's (pe_rope_apply, pe_rope_table_grad, pe_rope_tables) byte for byte, untouched
// bytes included; argument checks must return the CPU's statuses.  Covers pairings,
// transpose, tables (plain, per-batch, MRoPE sections, interleaved) and positions, partial
// rotary, GQA / MQA / no k, (B, T, H, D) and (B, H, T, D) layouts, misaligned rows, every
// dtype and mixes; and the math header's functions, nvcc host code against C, over a sweep
// of inputs (tests/math_sweep.h).  What this cannot check: the device's own arithmetic and memory
// system.
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

int failures = 0, checks = 0, vector_runs = 0, wide_runs = 0;
void expect(bool ok, const std::string &what);

// ---- emulated launches ------------------------------------------------------------------

// The apply kernel (rope.cu) with `threads` threads per block: per phase, every thread
// issues its loads, then every thread writes its share of the rows, then every thread
// rotates and stores (the kernel's barriers between them).
template <typename R, typename T, int V, typename Off>
void emulate_apply(const RopeP &p, int threads) {
    const ApplyGrid g = apply_grid<R, T, V>(p, threads);
    expect(g.lanes <= threads && g.tokens >= 1 && g.tokens * g.lanes <= threads &&
               (g.chunks > threads || g.lanes % g.chunks == 0),
           "apply layout: a token's lanes fit the block and keep their chunk");
    std::vector<R> rows(apply_shared_bytes<R>(g) / sizeof(R));
    std::vector<ApplyThread<R, T, V, Off>> th(static_cast<size_t>(threads));
    for (int64_t blk = 0; blk < kGrid; ++blk)
        for (int64_t group = blk; group < g.groups; group += kGrid) {
            for (int i = 0; i < threads; ++i)
                th[i].load(p, g, group, {i, threads});
            for (int i = 0; i < threads; ++i)
                group_rows<R>(p, g, group, rows.data(), {i, threads});
            for (int i = 0; i < threads; ++i)
                th[i].finish(p, g, rows.data());
        }
}

int status(Work w) {
    return w == Work::BadArg ? PE_ERR_ARG : PE_OK;
}

int emu_rope_apply(const pe_rope_args *a, int threads = kApplyThreads) {
    const Work w = check_apply(a);
    if (w != Work::Run) return status(w);
    pe_rope_args pass[2];
    for (int i = 0, n = apply_passes(a, pass); i < n; ++i) {
        const RopeP p = rope_params(&pass[i]);
        with_apply_variant(&pass[i], [&](auto r, auto tx, auto v, auto off) {
            using R = typename decltype(r)::type;
            using T = typename decltype(tx)::type;
            using Off = typename decltype(off)::type;
            vector_runs += decltype(v)::value > 1;
            // the odd block size runs with 64-bit offsets inside a token, which real
            // calls need only for head strides past 2^31 elements
            if (threads == kApplyThreads) {
                wide_runs += sizeof(Off) == 8;
                emulate_apply<R, T, decltype(v)::value, Off>(p, threads);
            } else {
                ++wide_runs;
                emulate_apply<R, T, decltype(v)::value, int64_t>(p, threads);
            }
        });
    }
    return PE_OK;
}

int emu_rope_table_grad(const pe_rope_args *a, const void *gq, const int64_t gqs[3], const void *gk,
                        const int64_t gks[3], pe_dtype gdt, void *dcos, void *dsin) {
    const Work w = check_table_grad(a, gq, gqs, gk, gks, gdt, dcos, dsin);
    if (w != Work::Run) return status(w);
    const GradP gp = grad_params(a, gq, gqs, gk, gks, gdt, dcos, dsin);
    const int64_t nrow = a->src.table_batch * a->seq;
    for (int64_t blk = 0; blk < kGrid; ++blk)
        for (int64_t row = blk; row < nrow; row += kGrid)
            for (int i = 0; i < kThreads; ++i)
                with_table_grad_variant(a, gdt, [&](auto r, auto g, auto x) {
                    using R = typename decltype(r)::type;
                    using G = typename decltype(g)::type;
                    using X = typename decltype(x)::type;
                    table_grad_row<R, G, X>(gp, row, {i, kThreads});
                });
    return PE_OK;
}

int emu_rope_tables(const pe_rope_args *a, pe_dtype odt, void *cos, void *sin) {
    const Work w = check_tables(a, odt, cos, sin);
    if (w != Work::Run) return status(w);
    const RopeP p = rope_params(a);
    std::vector<float> smem(2 * static_cast<size_t>(p.R));
    const int64_t nrow = p.src.pos_batch * p.T;
    for (int64_t blk = 0; blk < kGrid; ++blk)
        for (int64_t row = blk; row < nrow; row += kGrid) {
            for (int i = 0; i < kThreads; ++i)
                token_tables<float>(p, row / p.T, row % p.T, smem.data(), smem.data() + p.R,
                                    {i, kThreads});
            for (int i = 0; i < kThreads; ++i)
                store_tables_row(p, row, smem.data(), smem.data() + p.R, odt,
                                 static_cast<char *>(cos), static_cast<char *>(sin), {i, kThreads});
        }
    return PE_OK;
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
    std::vector<char> buf(static_cast<size_t>(n) * dtype_size(dt));
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
    x.out_cpu.assign(static_cast<size_t>(n) * dtype_size(out_dt), '\x5a');
    x.out_emu = x.out_cpu;
    return x;
}

void bind(pe_rope_tensor &dst, Tensor &x, bool emu) {
    dst.in = x.in.data() + x.shift * dtype_size(x.in_dt);
    dst.out = (emu ? x.out_emu : x.out_cpu).data() + x.shift * dtype_size(x.out_dt);
    dst.in_dtype = x.in_dt;
    dst.out_dtype = x.out_dt;
    dst.heads = x.heads;
    for (int i = 0; i < 3; ++i)
        dst.in_stride[i] = dst.out_stride[i] = x.stride[i];
}

// ---- the case matrix ------------------------------------------------------------------------

enum Source {
    TABLES,
    TABLES_PER_BATCH,
    TABLES_SECTIONS,
    TABLES_INTERLEAVED,
    POS_2D,
    POS_SECTIONS,
    POS_INTERLEAVED
};
const char *source_name[] = {"tables", "tables_per_batch", "tables_sections", "tables_interleaved",
                             "pos_2d", "pos_sections",     "pos_interleaved"};

struct Case {
    int64_t B, T, Hq, Hk, D, R;
    bool heads_outer;
    pe_dtype x_dt, out_dt, table_dt;
    pe_dtype k_dt, k_out_dt; // k's dtypes (q's: x_dt, out_dt)
    Source src;
    pe_pairing pairing;
    int transpose;
    int64_t shift;
};

std::string name(const Case &c) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "ROPE(q=%s->%s,k=%s->%s,tab=%s,B=%lld,T=%lld,H=%lld/"
                  "%lld,D=%lld,R=%lld,%s,%s,%s,%s,shift=%lld)",
                  dtype_name(c.x_dt), dtype_name(c.out_dt), dtype_name(c.k_dt),
                  dtype_name(c.k_out_dt), dtype_name(c.table_dt), (long long)c.B, (long long)c.T,
                  (long long)c.Hq, (long long)c.Hk, (long long)c.D, (long long)c.R,
                  c.heads_outer ? "bhtd" : "bthd", source_name[c.src],
                  c.pairing == PE_PAIR_HALF ? "half" : "adjacent",
                  c.transpose ? "transpose" : "forward", (long long)c.shift);
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
    const bool mrope = c.src == TABLES_SECTIONS || c.src == TABLES_INTERLEAVED ||
                       c.src == POS_SECTIONS || c.src == POS_INTERLEAVED;
    if (mrope) {
        const int64_t sec[3] = {slots - 2 * (slots / 3), slots / 3, slots / 3};
        d.axis.resize(static_cast<size_t>(slots));
        const int interleaved = c.src == TABLES_INTERLEAVED || c.src == POS_INTERLEAVED;
        if (pe_mrope_axis_map(slots, sec, interleaved, d.axis.data()) != PE_OK) std::abort();
        src.axis_of_slot = d.axis.data();
    }
    const int64_t A = mrope ? 3 : 1;
    if (c.src <= TABLES_INTERLEAVED) {
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
    for (int threads : kApplyBlockSizes) {
        q.out_emu = q_fill, k.out_emu = k_fill;
        bind(e.q, q, true);
        bind(e.k, k, true);
        const int rc_emu = emu_rope_apply(&e, threads);
        const std::string nt = n + " threads=" + std::to_string(threads);
        expect(rc_cpu == PE_OK && rc_emu == PE_OK, nt + ": status");
        expect(q.out_cpu == q.out_emu, nt + ": q bits");
        expect(k.out_cpu == k.out_emu, nt + ": k bits");
    }

    if (c.src > TABLES_INTERLEAVED) return;
    // table gradients with the same tensors: x = q/k in, g = their outputs
    const int64_t A = a.src.axis_of_slot ? 3 : 1, rows = A * a.src.table_batch * c.T * c.R;
    const size_t tbytes = static_cast<size_t>(rows) * dtype_size(c.table_dt);
    std::vector<char> dc_cpu(tbytes, '\x11'), ds_cpu(tbytes, '\x22'), dc_emu = dc_cpu,
                                                                      ds_emu = ds_cpu;
    const void *gq = q.out_cpu.data() + q.shift * dtype_size(c.out_dt);
    std::vector<char> gk_buf = random_buffer(c.B * c.T * c.Hk * c.D, c.out_dt); // grad dtype is q's
    const void *gk = gk_buf.data();
    const int rg_cpu = pe_rope_table_grad(&a, gq, q.stride, k.heads ? gk : nullptr, k.stride,
                                          c.out_dt, dc_cpu.data(), ds_cpu.data());
    const int rg_emu = emu_rope_table_grad(&e, gq, q.stride, k.heads ? gk : nullptr, k.stride,
                                           c.out_dt, dc_emu.data(), ds_emu.data());
    expect(rg_cpu == PE_OK && rg_emu == PE_OK, n + ": table_grad status");
    expect(dc_cpu == dc_emu && ds_cpu == ds_emu, n + ": table_grad bits");
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
    const size_t bytes = static_cast<size_t>(B * T * R) * dtype_size(odt);
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
        for (int src = TABLES; src <= POS_INTERLEAVED; ++src)
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
    // dtype): several phases per block, several tokens per phase
    for (int src : {TABLES, TABLES_SECTIONS, POS_SECTIONS})
        for (int pairing = 0; pairing < 2; ++pairing)
            for (pe_dtype dt : {PE_BFLOAT16, PE_FLOAT16, PE_FLOAT32}) {
                Case c{};
                c.B = 1, c.T = 300, c.Hq = 28, c.Hk = 4, c.D = c.R = 128;
                c.src = static_cast<Source>(src);
                c.pairing = static_cast<pe_pairing>(pairing);
                c.x_dt = c.out_dt = c.table_dt = c.k_dt = c.k_out_dt = dt;
                run_apply(c);
            }
    for (int src = POS_2D; src <= POS_INTERLEAVED; ++src)
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
    expect(vector_runs > 0, "the 16-byte rows were exercised");
    expect(wide_runs > 0, "the 64-bit offsets were exercised");
    std::printf(
        "cuda kernels emulated on the host: %d checks, %d failed, %d runs on 16-byte rows, "
        "%d with 64-bit offsets\n",
        checks, failures, vector_runs, wide_runs);
    return failures ? 1 : 0;
}

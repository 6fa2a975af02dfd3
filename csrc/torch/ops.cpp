// The torch side of posenc: registers the posenc ops, validates the tensors, allocates
// outputs and hands raw pointers, sizes and strides to the C kernels.  It uses only the
// LibTorch stable ABI (stable_support.h), so one binary serves every torch from the target
// version on.  It also defines the posenc_torch._C module with the limited Python C API;
// importing that module runs the registrations below.
//
// Each op: validate -> fill the C argument struct (posenc.h) -> run_* (the one place per
// op that picks the device's kernel) -> check the status.
#include <Python.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>

#include "stable_support.h"
#ifdef POSENC_WITH_CUDA
#include <initializer_list>
#include <utility>

#include <torch/csrc/stable/accelerator.h>

#include "posenc_cuda.h"
#endif

namespace posenc {
namespace {

using TensorPair = std::tuple<Tensor, Tensor>;

#ifdef POSENC_WITH_CUDA
// torch's current stream on the device of `on`: the kernels run in order with the rest of
// the program, and CUDA graphs capture them.
cudaStream_t cuda_stream(const Tensor& on) {
    void* stream = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(
        aoti_torch_get_current_cuda_stream(on.get_device_index(), &stream));
    return static_cast<cudaStream_t>(stream);
}
#endif

// ---- Kernel calls, one per op.  `on` is a tensor of the op, whose device selects the
// kernel: the CUDA kernels for CUDA tensors when they are built in, else the CPU's.

int run_rope_apply([[maybe_unused]] const Tensor& on, const pe_rope_args& a) {
#ifdef POSENC_WITH_CUDA
    if (on.is_cuda()) return pe_cuda_rope_apply(&a, cuda_stream(on));
#endif
    return pe_rope_apply(&a);
}

int run_rope_table_grad([[maybe_unused]] const Tensor& on, const pe_rope_args& a,
                        const void* grad_q, const int64_t grad_q_stride[3], const void* grad_k,
                        const int64_t grad_k_stride[3], pe_dtype grad_dtype, void* dcos,
                        void* dsin) {
#ifdef POSENC_WITH_CUDA
    if (on.is_cuda())
        return pe_cuda_rope_table_grad(&a, grad_q, grad_q_stride, grad_k, grad_k_stride,
                                       grad_dtype, dcos, dsin, cuda_stream(on));
#endif
    return pe_rope_table_grad(&a, grad_q, grad_q_stride, grad_k, grad_k_stride, grad_dtype, dcos,
                              dsin);
}

int run_rope_tables([[maybe_unused]] const Tensor& on, const pe_rope_args& a, pe_dtype dtype,
                    void* cos, void* sin) {
#ifdef POSENC_WITH_CUDA
    if (on.is_cuda()) return pe_cuda_rope_tables(&a, dtype, cos, sin, cuda_stream(on));
#endif
    return pe_rope_tables(&a, dtype, cos, sin);
}

int run_mrope_position_ids([[maybe_unused]] const Tensor& on, const pe_mrope_args& a,
                           int64_t* pos, int64_t* deltas, pe_pos_error* err) {
    return pe_mrope_position_ids(&a, pos, deltas, err);
}

int run_sinusoidal(const Tensor& on, int64_t n, int64_t dim, double base, pe_dtype dtype) {
    return pe_sinusoidal(n, dim, base, dtype, on.mutable_data_ptr(), num_threads());
}

// ---- Checks shared by the ops.

void check_cpu(const Meta& m, const Tensor& t, const char* name) {
#ifdef POSENC_WITH_CUDA
    // only the CUDA entry points pass CUDA tensors (cuda_inputs)
    if (m.device_type == aoti_torch_device_type_cuda()) return;
#endif
    PE_CHECK_VALUE(m.is_cpu(), name, " must be a CPU tensor, got device ", DeviceName{t});
}

void check_cpu(const Tensor& t, const char* name) { check_cpu(Meta(t), t, name); }

void check_status(int rc, const char* op) {
    PE_CHECK(rc != PE_ERR_NOMEM, op, ": out of memory for scratch buffers");
#ifdef POSENC_WITH_CUDA
    PE_CHECK(rc != PE_ERR_CUDA, op, ": CUDA kernel launch failed: ", pe_cuda_last_error());
#endif
    // an argument the C API refuses past the shim's own checks (e.g. the CUDA width limit)
    PE_CHECK_VALUE(rc == PE_OK, op, ": the kernel rejected its arguments (status ", rc, ")");
}

// Where the sequence and head dims of a 4-D q/k are: (batch, seq, heads, head_dim), the ops'
// default, or (batch, heads, seq, head_dim) with heads_first (transformers' layout, read
// without a transposed view).
struct Layout {
    size_t seq, heads;
    const char* text;
};

Layout layout(bool heads_first) {
    return heads_first ? Layout{2, 1, "(batch, heads, seq, head_dim)"}
                       : Layout{1, 2, "(batch, seq, heads, head_dim)"};
}

void fill_strides(int64_t dst[3], const Meta& m, const Layout& L) {  // batch, seq, head
    dst[0] = m.strides[0];
    dst[1] = m.strides[L.seq];
    dst[2] = m.strides[L.heads];
}

// Validates q, k (4-D in layout L) and returns the rotary problem without its angle source;
// `rot_source` names the argument the rotary width comes from.
pe_rope_args problem(const Tensor& q, const Meta& qm, const Tensor& k, const Meta& km,
                     int64_t rot_dim, const char* rot_source, int64_t pairing, bool transpose,
                     const Layout& L) {
    PE_CHECK_VALUE(qm.dim() == 4, "q must be 4-D ", L.text, ", got ", qm.dim(), "-D");
    PE_CHECK_VALUE(km.dim() == 4, "k must be 4-D ", L.text, ", got ", km.dim(), "-D");
    check_cpu(qm, q, "q");
    check_cpu(km, k, "k");
    const IntList qs = qm.sizes, ks = km.sizes;
    PE_CHECK_VALUE(ks[0] == qs[0], "k batch size ", ks[0], " must equal q batch size ", qs[0]);
    PE_CHECK_VALUE(ks[L.seq] == qs[L.seq], "k sequence length ", ks[L.seq],
                   " must equal q sequence length ", qs[L.seq]);
    PE_CHECK_VALUE(ks[3] == qs[3], "k head_dim ", ks[3], " must equal q head_dim ", qs[3]);
    PE_CHECK_VALUE(pairing == PE_PAIR_HALF || pairing == PE_PAIR_ADJACENT,
                   "pairing must be 0 (half) or 1 (adjacent), got ", pairing);
    PE_CHECK_VALUE(rot_dim % 2 == 0 && rot_dim >= 2, "rotary width (", rot_source,
                   ") must be even and >= 2, got ", rot_dim);
    PE_CHECK_VALUE(rot_dim <= qs[3], "rotary width ", rot_dim, " (", rot_source,
                   ") must not exceed head_dim ", qs[3]);
    pe_rope_args a{};
    a.batch = qs[0];
    a.seq = qs[L.seq];
    a.head_dim = qs[3];
    a.rot_dim = rot_dim;
    a.pairing = static_cast<pe_pairing>(pairing);
    a.transpose = transpose ? 1 : 0;
    a.nthreads = num_threads();
    return a;
}

// One rotated tensor: input `in` (already channel-dense, described by im) into `out`, both
// in layout L.
void bind(pe_rope_tensor& dst, const Tensor& in, const Meta& im, const Tensor& out,
          const Meta& om, const char* name, const Layout& L) {
    dst.in = in.const_data_ptr();
    dst.out = out.mutable_data_ptr();
    dst.in_dtype = to_pe_dtype(im.dtype, name);
    dst.out_dtype = to_pe_dtype(om.dtype, name);
    dst.heads = im.sizes[L.heads];
    fill_strides(dst.in_stride, im, L);
    fill_strides(dst.out_stride, om, L);
}

// Section list -> per-slot axis map (empty sections: plain RoPE, no map).  Every entry is
// checked against the slot count before anything is added, so no sum can overflow.
std::vector<uint8_t> axis_map(IntList sections, bool interleaved, int64_t rot_dim) {
    if (sections.empty()) return {};
    PE_CHECK_VALUE(sections.size() == 3, "mrope_section must have 3 entries (T, H, W), got ",
                   sections.size());
    const Shape shown{sections};
    PE_CHECK_VALUE(sections[0] >= 0 && sections[1] >= 0 && sections[2] >= 0,
                   "mrope_section entries must be non-negative, got ", shown);
    const int64_t slots = rot_dim / 2;
    for (int64_t s : sections)
        PE_CHECK_VALUE(s <= slots, "mrope_section ", shown, " must satisfy 2 * sum == ", rot_dim,
                       " (the rotary width), got an entry larger than ", slots);
    const int64_t sum = sections[0] + sections[1] + sections[2];
    PE_CHECK_VALUE(sum == slots, "mrope_section ", shown, " must satisfy 2 * sum == ", rot_dim,
                   " (the rotary width), got 2 * ", sum, " = ", 2 * sum);
    std::vector<uint8_t> map(static_cast<size_t>(slots));
    const std::array<int64_t, 3> s{sections[0], sections[1], sections[2]};
    check_status(pe_mrope_axis_map(slots, s.data(), interleaved ? 1 : 0, map.data()),
                 "mrope_section");
    return map;
}

// cos/sin checks shared by the table ops; returns the table batch.
int64_t check_tables(const Tensor& cos, const Meta& cm, const Tensor& sin, const Meta& sm,
                     int64_t B, int64_t T, bool mrope) {
    check_cpu(cm, cos, "cos");
    check_cpu(sm, sin, "sin");
    PE_CHECK_VALUE(same(sm.sizes, cm.sizes), "sin shape ", Shape{sm.sizes},
                   " must equal cos shape ", Shape{cm.sizes});
    PE_CHECK_TYPE(sm.dtype == cm.dtype, "sin dtype ", scalar_type(sm.dtype),
                  " must equal cos dtype ", scalar_type(cm.dtype));
    const int64_t want = mrope ? 4 : 3;
    PE_CHECK_VALUE(cm.dim() == want, "cos must be ", want, "-D ",
                   mrope ? "(3, batch, seq, rot_dim)" : "(batch, seq, rot_dim)", ", got shape ",
                   Shape{cm.sizes});
    if (mrope)
        PE_CHECK_VALUE(cm.size(0) == 3, "cos for MRoPE must have 3 axes (T, H, W) in dim 0, got ",
                       cm.size(0));
    const int64_t Bc = cm.size(-3);
    PE_CHECK_VALUE(Bc == 1 || Bc == B, "cos batch size ", Bc, " must be 1 or the batch size ", B);
    PE_CHECK_VALUE(cm.size(-2) == T, "cos sequence length ", cm.size(-2),
                   " must equal the sequence length of q ", T);
    return Bc;
}

void set_table_source(pe_rope_source& src, const Tensor& cos, const Meta& cm, const Tensor& sin,
                      int64_t Bc, const std::vector<uint8_t>& map) {
    src.cos = cos.const_data_ptr();
    src.sin = sin.const_data_ptr();
    src.table_dtype = to_pe_dtype(cm.dtype, "cos");
    src.table_batch = Bc;
    src.table_stride[0] = cm.dim() == 4 ? cm.stride(0) : 0;
    src.table_stride[1] = cm.stride(-3);
    src.table_stride[2] = cm.stride(-2);
    src.axis_of_slot = map.empty() ? nullptr : map.data();
}

// A tensor made channel-dense (copied only when needed), with its metadata.
struct Dense {
    Tensor t;
    Meta m;
    Dense(const Tensor& in, const Meta& im)
        : t(channel_contiguous(in, im)), m(im.channel_dense() ? im : Meta(t)) {}
    explicit Dense(const Tensor& in) : Dense(in, Meta(in)) {}
};

// ---- Rotations.

TensorPair rope_cpu(const Tensor& q_in, const Tensor& k_in, const Tensor& cos_in,
                    const Tensor& sin_in, IntList mrope_section, bool interleaved,
                    int64_t pairing, bool transpose, std::optional<ScalarType> q_dtype,
                    std::optional<ScalarType> k_dtype, bool heads_first) {
    const Meta qm(q_in), km(k_in), cm(cos_in), sm(sin_in);
    PE_CHECK_VALUE(cm.dim() >= 1, "cos must have a rotary dimension");
    const Layout L = layout(heads_first);
    pe_rope_args a =
        problem(q_in, qm, k_in, km, cm.size(-1), "the last dim of cos", pairing, transpose, L);
    to_pe_dtype(qm.dtype, "q");
    to_pe_dtype(km.dtype, "k");
    to_pe_dtype(cm.dtype, "cos");
    const bool mrope = !mrope_section.empty();
    const int64_t Bc = check_tables(cos_in, cm, sin_in, sm, a.batch, a.seq, mrope);
    const auto map = axis_map(mrope_section, interleaved, a.rot_dim);

    const Dense q(q_in, qm), k(k_in, km);
    Dense cos(cos_in, cm), sin(sin_in, sm);
    if (!same(sin.m.strides, cos.m.strides)) {
        cos = Dense(torch::stable::contiguous(cos.t));
        sin = Dense(torch::stable::contiguous(sin.t));
    }
    const int32_t qd = q_dtype ? dtype_code(*q_dtype) : result_type(qm.dtype, cm.dtype);
    const int32_t kd = k_dtype ? dtype_code(*k_dtype) : result_type(km.dtype, cm.dtype);
    to_pe_dtype(qd, "q_dtype");
    to_pe_dtype(kd, "k_dtype");
    const Output q_out = transpose ? contiguous_output(qm, qd) : output_like(q_in, qm, qd);
    const Output k_out = transpose ? contiguous_output(km, kd) : output_like(k_in, km, kd);

    set_table_source(a.src, cos.t, cos.m, sin.t, Bc, map);
    bind(a.q, q.t, q.m, q_out.t, q_out.m, "q", L);
    bind(a.k, k.t, k.m, k_out.t, k_out.m, "k", L);
    check_status(run_rope_apply(q_in, a), "posenc::rope");
    return {q_out.t, k_out.t};
}

TensorPair rope_table_grad_cpu(const Tensor& grad_q_in, const Tensor& grad_k_in,
                               const Tensor& q_in, const Tensor& k_in, const Tensor& cos,
                               IntList mrope_section, bool interleaved, int64_t pairing) {
    const Meta qm(q_in), km(k_in), cm(cos), gqm(grad_q_in), gkm(grad_k_in);
    PE_CHECK_VALUE(cm.dim() >= 1, "cos must have a rotary dimension");
    const Layout L = layout(false);
    pe_rope_args a = problem(q_in, qm, k_in, km, cm.size(-1), "the last dim of cos", pairing,
                             false, L);
    const bool mrope = !mrope_section.empty();
    const int64_t Bc = check_tables(cos, cm, cos, cm, a.batch, a.seq, mrope);
    PE_CHECK_VALUE(same(gqm.sizes, qm.sizes), "grad_q shape ", Shape{gqm.sizes},
                   " must equal q shape ", Shape{qm.sizes});
    PE_CHECK_VALUE(same(gkm.sizes, km.sizes), "grad_k shape ", Shape{gkm.sizes},
                   " must equal k shape ", Shape{km.sizes});
    check_cpu(gqm, grad_q_in, "grad_q");
    check_cpu(gkm, grad_k_in, "grad_k");
    const pe_dtype gdt = to_pe_dtype(gqm.dtype, "grad_q");
    to_pe_dtype(gkm.dtype, "grad_k");
    const auto map = axis_map(mrope_section, interleaved, a.rot_dim);

    const Dense q(q_in, qm), k(k_in, km), gq(grad_q_in, gqm);
    const Dense gk = gkm.dtype == gqm.dtype
                         ? Dense(grad_k_in, gkm)
                         : Dense(torch::stable::to(grad_k_in, scalar_type(gqm.dtype)));
    Tensor dcos = empty(cm.sizes, cm.dtype, cm);
    Tensor dsin = empty(cm.sizes, cm.dtype, cm);

    a.src.table_dtype = to_pe_dtype(cm.dtype, "cos");
    a.src.table_batch = Bc;
    a.src.cos = a.src.sin = dcos.const_data_ptr();  // shape only; the kernel writes dcos/dsin
    a.src.axis_of_slot = map.empty() ? nullptr : map.data();
    bind(a.q, q.t, q.m, q.t, q.m, "q", L);
    bind(a.k, k.t, k.m, k.t, k.m, "k", L);
    int64_t gqs[3], gks[3];
    fill_strides(gqs, gq.m, L);
    fill_strides(gks, gk.m, L);
    check_status(run_rope_table_grad(q_in, a, gq.t.const_data_ptr(), gqs, gk.t.const_data_ptr(),
                                     gks, gdt, dcos.mutable_data_ptr(), dsin.mutable_data_ptr()),
                 "posenc::rope_table_grad");
    return {dcos, dsin};
}

// Positions (Bp, T) or (3, Bp, T) and inv_freq (R/2,) as the fused angle source.
struct PositionSource {
    Tensor pos, inv_freq;
    std::vector<uint8_t> map;
};

PositionSource position_source(pe_rope_source& src, const Tensor& position_ids,
                               const Tensor& inv_freq, IntList mrope_section, bool interleaved,
                               double scaling, int64_t B, int64_t T) {
    const Meta pm(position_ids), fm(inv_freq);
    check_cpu(pm, position_ids, "position_ids");
    check_cpu(fm, inv_freq, "inv_freq");
    const DtypeCodes& codes = dtype_codes();
    PE_CHECK_TYPE(pm.dtype == codes.i64 || pm.dtype == codes.i32,
                  "position_ids must be int64 or int32, got ", scalar_type(pm.dtype));
    const int64_t pdim = pm.dim();
    PE_CHECK_VALUE(pdim == 2 || pdim == 3,
                   "position_ids must be (batch, seq) or (3, batch, seq), got shape ",
                   Shape{pm.sizes});
    if (pdim == 3)
        PE_CHECK_VALUE(pm.size(0) == 3,
                       "3-D position_ids must have 3 rows (T, H, W) in dim 0, got shape ",
                       Shape{pm.sizes});
    PE_CHECK_VALUE(pdim == 2 || !mrope_section.empty(), "position_ids of shape ", Shape{pm.sizes},
                   " (3 axes) need mrope_section to pick an axis per frequency");
    PE_CHECK_VALUE(fm.dim() == 1 && fm.size(0) >= 1,
                   "inv_freq must be 1-D with at least one frequency, got shape ", Shape{fm.sizes});
    PE_CHECK_TYPE(fm.dtype == codes.f32 || is_floating(scalar_type(fm.dtype)),
                  "inv_freq must be floating point, got ", scalar_type(fm.dtype));
    const int64_t Bp = pm.size(-2);
    PE_CHECK_VALUE(B < 0 || Bp == 1 || Bp == B, "position_ids batch size ", Bp,
                   " must be 1 or the batch size ", B);
    PE_CHECK_VALUE(T < 0 || pm.size(-1) == T, "position_ids sequence length ", pm.size(-1),
                   " must equal the sequence length of q ", T);
    const int64_t R = 2 * fm.size(0);
    Tensor f = fm.dtype == codes.f32 ? inv_freq : torch::stable::to(inv_freq, ScalarType::Float);
    if (fm.size(0) > 1 && f.stride(0) != 1) f = torch::stable::contiguous(f);
    const bool long_ids = pm.dtype == codes.i64;
    PositionSource ps{long_ids ? position_ids : torch::stable::to(position_ids, ScalarType::Long),
                      f, axis_map(mrope_section, interleaved, R)};
    const Meta lm = long_ids ? pm : Meta(ps.pos);
    const bool three = pdim == 3;
    src.pos = static_cast<const int64_t*>(ps.pos.const_data_ptr());
    src.pos_batch = Bp;
    src.pos_stride[0] = three ? lm.stride(0) : 0;
    src.pos_stride[1] = lm.stride(-2);
    src.pos_stride[2] = lm.stride(-1);
    src.inv_freq = static_cast<const float*>(ps.inv_freq.const_data_ptr());
    src.scaling = static_cast<float>(scaling);
    // 2-D ids: all three axes are the same row, so the axis map changes nothing.
    src.axis_of_slot = (three && !ps.map.empty()) ? ps.map.data() : nullptr;
    return ps;
}

TensorPair rope_fused_cpu(const Tensor& q_in, const Tensor& k_in, const Tensor& position_ids,
                          const Tensor& inv_freq, IntList mrope_section, bool interleaved,
                          double attention_scaling, int64_t pairing, bool transpose,
                          bool heads_first) {
    const Meta qm(q_in), km(k_in);
    const int64_t fdim = inv_freq.dim();
    PE_CHECK_VALUE(fdim == 1, "inv_freq must be 1-D, got shape ", shape(inv_freq));
    const Layout L = layout(heads_first);
    pe_rope_args a = problem(q_in, qm, k_in, km, 2 * inv_freq.size(0), "2 * len(inv_freq)",
                             pairing, transpose, L);
    to_pe_dtype(qm.dtype, "q");
    to_pe_dtype(km.dtype, "k");
    PositionSource ps = position_source(a.src, position_ids, inv_freq, mrope_section, interleaved,
                                        attention_scaling, a.batch, a.seq);
    const Dense q(q_in, qm), k(k_in, km);
    const Output q_out =
        transpose ? contiguous_output(qm, qm.dtype) : output_like(q_in, qm, qm.dtype);
    const Output k_out =
        transpose ? contiguous_output(km, km.dtype) : output_like(k_in, km, km.dtype);
    bind(a.q, q.t, q.m, q_out.t, q_out.m, "q", L);
    bind(a.k, k.t, k.m, k_out.t, k_out.m, "k", L);
    check_status(run_rope_apply(q_in, a), "posenc::rope_fused");
    return {q_out.t, k_out.t};
}

TensorPair rope_tables_cpu(const Tensor& position_ids, const Tensor& inv_freq,
                           IntList mrope_section, bool interleaved, double attention_scaling,
                           int64_t pairing, ScalarType dtype) {
    PE_CHECK_VALUE(pairing == PE_PAIR_HALF || pairing == PE_PAIR_ADJACENT,
                   "pairing must be 0 (half) or 1 (adjacent), got ", pairing);
    pe_rope_args a{};
    PositionSource ps = position_source(a.src, position_ids, inv_freq, mrope_section, interleaved,
                                        attention_scaling, -1, -1);
    a.batch = a.src.pos_batch;
    a.seq = position_ids.size(-1);
    a.rot_dim = a.head_dim = 2 * inv_freq.size(0);
    a.pairing = static_cast<pe_pairing>(pairing);
    a.nthreads = num_threads();
    const pe_dtype odt = to_pe_dtype(dtype, "dtype");
    const std::array<int64_t, 3> sizes{a.batch, a.seq, a.rot_dim};
    Tensor cos = empty(sizes, dtype, position_ids);
    Tensor sin = empty(sizes, dtype, position_ids);
    check_status(run_rope_tables(position_ids, a, odt, cos.mutable_data_ptr(),
                                 sin.mutable_data_ptr()),
                 "posenc::rope_tables");
    return {cos, sin};
}

// ---- Position ids: MRoPE ids (get_rope_index) and vision-tower patch ids.  Integer
// tensors in, int64 out; not differentiable.

const char* const kModelNames[] = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"};

void check_integer(const Tensor& t, const char* name) {
    PE_CHECK_TYPE(is_integral(t.scalar_type()), name,
                   " must be an integer tensor (int64 or int32), got ", t.scalar_type());
}

// (n, 3) integer grids -> contiguous int64.
std::optional<Tensor> grid_tensor(const std::optional<Tensor>& g, const char* name) {
    if (!g.has_value()) return std::nullopt;
    const Tensor& t = *g;
    check_cpu(t, name);
    check_integer(t, name);
    PE_CHECK_VALUE(t.dim() == 2 && t.size(1) == 3, name,
                   " must have shape (num_grids, 3) of (t, h, w) patch counts, got shape ",
                   shape(t));
    Tensor out = converted(t, ScalarType::Long);
    return out.is_contiguous() ? out : torch::stable::contiguous(out);
}

std::string grid_text(const std::optional<Tensor>& grids, int64_t i) {
    if (!grids.has_value() || i < 0 || i >= grids->size(0)) return "?";
    const int64_t* g = grids->const_data_ptr<int64_t>() + 3 * i;
    return cat("(", g[0], ", ", g[1], ", ", g[2], ")");
}

// Turns a pe_pos_error into a ValueError that names the argument at fault.  Grid row g of
// the message is row g + grid_shift of `images` / `videos` (a packed example's own grids
// are numbered from 0).
[[noreturn]] void raise_position_error(const pe_pos_error& e, int rc,
                                       const std::optional<Tensor>& images,
                                       const std::optional<Tensor>& videos, int64_t merge,
                                       int64_t model, bool v5, int64_t grid_shift = 0) {
    const auto grid_text = [grid_shift](const std::optional<Tensor>& grids, int64_t i) {
        return posenc::grid_text(grids, i + grid_shift);
    };
    const char* grid_name = e.video ? "video_grid_thw" : "image_grid_thw";
    const char* token_name = v5 ? (e.video ? "mm_token_type_ids == 2" : "mm_token_type_ids == 1")
                                : (e.video ? "video_token_id" : "image_token_id");
    const char* kind = e.video ? "video" : "image";
    const std::optional<Tensor>& grids = e.video ? videos : images;
    const bool frames = e.video && model == PE_MROPE_QWEN3_VL;
    const std::string where =
        "input_ids[" + std::to_string(e.row) + ", " + std::to_string(e.token) + "]";
    switch (e.problem) {
    case PE_POS_BAD_MASK:
        fail_value("attention_mask[", e.row, ", ", e.token, "] is ", e.found,
                   "; expected 0 or 1");
    case PE_POS_BAD_TYPE:
        fail_value("mm_token_type_ids[", e.row, ", ", e.token, "] is ", e.found,
                   "; expected 0 (text), 1 (image) or 2 (video)");
    case PE_POS_BAD_GRID:
        fail_value(grid_name, "[", e.grid, "] = ", grid_text(grids, e.grid),
                   " is not a valid patch grid: t, h, w must be positive and h, w "
                   "divisible by spatial_merge_size = ", merge,
                   " (grids count patches before merging)");
    case PE_POS_BAD_SECONDS:
        fail_value("second_per_grid_ts[", e.grid, "] (video_grid_thw[", e.grid,
                   "] = ", grid_text(videos, e.grid),
                   ") must be finite, >= 0 and below 2^31, and (t - 1) * second_per_grid_ts * "
                   "tokens_per_second must stay below 2^31");
    case PE_POS_GRID_COUNT:
        fail_value(grid_name, frames ? " describes " : " has ", e.expected,
                   frames ? " frames (Qwen3-VL: the sum of t over its rows; every frame "
                            "is its own vision_start + video tokens run)"
                          : " rows",
                   ", but input_ids has ", e.found, " ", kind, frames ? " frame runs" : "s",
                   " (", v5 ? "runs of " : (e.video ? "a " : "an "), token_name,
                   v5 ? "" : " right after a vision_start_token_id",
                   ", counted over the unmasked tokens of all rows)");
    case PE_POS_NO_GRIDS:
        fail_value(where, " starts ", e.video ? "a video" : "an image", " (", token_name,
                   v5 ? "" : " after vision_start_token_id", "), but image_grid_thw "
                   "and video_grid_thw are both None");
    case PE_POS_SHORT_RUN:
        fail_value(grid_name, "[", e.grid, "] = ", grid_text(grids, e.grid),
                   frames ? " (frame " + std::to_string(e.frame) + ")" : std::string(),
                   " needs ", e.expected, " ", token_name, " tokens (",
                   frames ? "h * w" : "t * h * w", " / spatial_merge_size^2 with "
                   "spatial_merge_size = ", merge, "), but the run that starts at ", where,
                   " has ", e.found);
    case PE_POS_STRAY_TOKEN:
        fail_value(where, " is ", token_name, " but belongs to no ", kind, ": every ", kind,
                   " must be one run of exactly t * h * w / "
                   "spatial_merge_size^2 placeholder tokens",
                   v5 ? "" : " right after a vision_start_token_id", " (the run is longer than its ",
                   grid_name, " row", v5 ? ")" : ", or has no vision start)");
    default:
        check_status(rc, "posenc::mrope_position_ids");
        fail("posenc::mrope_position_ids: invalid arguments");
    }
}

// A (B, L) integer tensor as int64 with unit stride along L.
Tensor row_major_long(const Tensor& t) {
    Tensor out = converted(t, ScalarType::Long);
    if (out.size(1) > 1 && out.stride(1) != 1) out = torch::stable::contiguous(out);
    return out;
}

// Floating masks must hold only 0 and 1 (the int64 conversion would hide 0.5 or NaN).
bool binary_values(const Tensor& m) {
    Tensor d = torch::stable::contiguous(converted(m, ScalarType::Double));
    const double* p = d.const_data_ptr<double>();
    const int64_t n = d.numel();
    for (int64_t i = 0; i < n; ++i)
        if (!(p[i] == 0.0 || p[i] == 1.0)) return false;
    return true;
}

// The checked arguments of the position-id ops as C arguments; the tensors own the memory
// that `a` points into.
struct MropeInputs {
    Tensor input_ids;
    std::optional<Tensor> mask, types, images, videos, seconds;
    pe_mrope_args a;
    bool v5;
};

MropeInputs mrope_inputs(
    const Tensor& input_ids_in, const std::optional<Tensor>& image_grid_thw,
    const std::optional<Tensor>& video_grid_thw, const std::optional<Tensor>& attention_mask,
    const std::optional<Tensor>& second_per_grid_ts, int64_t model, int64_t image_token_id,
    int64_t video_token_id, int64_t vision_start_token_id, int64_t spatial_merge_size,
    double tokens_per_second, const std::optional<Tensor>& mm_token_type_ids, int64_t rules,
    int64_t time_rule) {
    check_cpu(input_ids_in, "input_ids");
    check_integer(input_ids_in, "input_ids");
    PE_CHECK_VALUE(input_ids_in.dim() == 2, "input_ids must be 2-D (batch, seq), got shape ",
                   shape(input_ids_in));
    PE_CHECK_VALUE(model >= 0 && model <= 2,
                   "model must be 0 (qwen2_vl), 1 (qwen2_5_vl) or 2 (qwen3_vl), got ", model);
    PE_CHECK_VALUE(spatial_merge_size >= 1, "spatial_merge_size must be >= 1, got ",
                   spatial_merge_size);
    PE_CHECK_VALUE(rules == PE_MROPE_RULES_4_57 || rules == PE_MROPE_RULES_5,
                   "rules must be 0 (transformers 4.57) or 1 (5.x), got ", rules);
    PE_CHECK_VALUE(time_rule >= PE_TIME_F64 && time_rule <= PE_TIME_F64_INTERVAL,
                   "time_rule must be 0 to 3, got ", time_rule);
    const bool v5 = rules == PE_MROPE_RULES_5;
    PE_CHECK_VALUE(v5 || (image_token_id >= 0 && video_token_id >= 0 && vision_start_token_id >= 0),
                   "image_token_id, video_token_id and vision_start_token_id must be "
                   "non-negative, got ", image_token_id, ", ", video_token_id, ", ",
                   vision_start_token_id);
    PE_CHECK_VALUE(v5 || (image_token_id != video_token_id &&
                           image_token_id != vision_start_token_id &&
                           video_token_id != vision_start_token_id),
                   "image_token_id, video_token_id and vision_start_token_id must be distinct, "
                   "got ", image_token_id, ", ", video_token_id, ", ", vision_start_token_id);
    PE_CHECK_VALUE(model != PE_MROPE_QWEN2_5_VL ||
                       (std::isfinite(tokens_per_second) && tokens_per_second >= 0),
                   "tokens_per_second must be finite and >= 0, got ", tokens_per_second);
    const int64_t B = input_ids_in.size(0), L = input_ids_in.size(1);
    const Tensor input_ids = row_major_long(input_ids_in);

    std::optional<Tensor> mask;
    if (attention_mask.has_value()) {
        const Tensor& m = *attention_mask;
        check_cpu(m, "attention_mask");
        PE_CHECK_VALUE(same(m.sizes(), input_ids_in.sizes()), "attention_mask shape ",
                       shape(m), " must equal input_ids shape ", shape(input_ids_in));
        PE_CHECK_TYPE(!is_complex(m.scalar_type()),
                       "attention_mask must be bool, integer or floating, got ",
                       m.scalar_type());
        if (is_floating(m.scalar_type()))
            PE_CHECK_VALUE(binary_values(m), "attention_mask must hold only 0 and 1");
        mask = row_major_long(m);
    }
    std::optional<Tensor> types;
    if (mm_token_type_ids.has_value() && v5) {
        const Tensor& t = *mm_token_type_ids;
        check_cpu(t, "mm_token_type_ids");
        check_integer(t, "mm_token_type_ids");
        PE_CHECK_VALUE(same(t.sizes(), input_ids_in.sizes()), "mm_token_type_ids shape ",
                       shape(t), " must equal input_ids shape ", shape(input_ids_in));
        types = row_major_long(t);
    }
    const std::optional<Tensor> images = grid_tensor(image_grid_thw, "image_grid_thw");
    const std::optional<Tensor> videos = grid_tensor(video_grid_thw, "video_grid_thw");
    PE_CHECK_TYPE(!v5 || types.has_value() || (!images.has_value() && !videos.has_value()),
                  "mm_token_type_ids is required with grids under the transformers 5.x rules");
    const int64_t n_videos = videos.has_value() ? videos->size(0) : 0;
    std::optional<Tensor> seconds;
    if (second_per_grid_ts.has_value()) {
        const Tensor& s = *second_per_grid_ts;
        PE_CHECK_VALUE(model == PE_MROPE_QWEN2_5_VL,
                       "second_per_grid_ts is only used by qwen2_5_vl, got model ",
                       kModelNames[model]);
        check_cpu(s, "second_per_grid_ts");
        PE_CHECK_TYPE(is_floating(s.scalar_type()) || is_integral(s.scalar_type()),
                       "second_per_grid_ts must be a real tensor, got ", s.scalar_type());
        PE_CHECK_VALUE(s.dim() == 1 && s.size(0) == n_videos,
                       "second_per_grid_ts must have shape (num_videos,) = (", n_videos,
                       ",) to match video_grid_thw, got shape ", shape(s));
        seconds = torch::stable::contiguous(converted(s, ScalarType::Double));
    }

    pe_mrope_args a{};
    a.batch = B;
    a.seq = L;
    a.input_ids = input_ids.const_data_ptr<int64_t>();
    a.ids_row_stride = input_ids.stride(0);
    a.attention_mask = mask.has_value() ? mask->const_data_ptr<int64_t>() : nullptr;
    a.mask_row_stride = mask.has_value() ? mask->stride(0) : 0;
    a.has_grids = images.has_value() || videos.has_value();
    a.image_grid_thw = images.has_value() ? images->const_data_ptr<int64_t>() : nullptr;
    a.n_images = images.has_value() ? images->size(0) : 0;
    a.video_grid_thw = videos.has_value() ? videos->const_data_ptr<int64_t>() : nullptr;
    a.n_videos = n_videos;
    a.second_per_grid_ts = seconds.has_value() ? seconds->const_data_ptr<double>() : nullptr;
    a.model = static_cast<pe_mrope_model>(model);
    a.image_token_id = image_token_id;
    a.video_token_id = video_token_id;
    a.vision_start_token_id = vision_start_token_id;
    a.spatial_merge_size = spatial_merge_size;
    a.tokens_per_second = tokens_per_second;
    a.nthreads = num_threads();
    a.rules = static_cast<pe_mrope_rules>(rules);
    a.mm_token_type_ids = types.has_value() ? types->const_data_ptr<int64_t>() : nullptr;
    a.types_row_stride = types.has_value() ? types->stride(0) : 0;
    a.time_rule = static_cast<pe_mrope_time>(time_rule);
    return {input_ids, mask, types, images, videos, seconds, a, v5};
}

TensorPair mrope_position_ids_cpu(
    const Tensor& input_ids_in, const std::optional<Tensor>& image_grid_thw,
    const std::optional<Tensor>& video_grid_thw, const std::optional<Tensor>& attention_mask,
    const std::optional<Tensor>& second_per_grid_ts, int64_t model, int64_t image_token_id,
    int64_t video_token_id, int64_t vision_start_token_id, int64_t spatial_merge_size,
    double tokens_per_second, const std::optional<Tensor>& mm_token_type_ids, int64_t rules,
    int64_t time_rule) {
    const MropeInputs in = mrope_inputs(
        input_ids_in, image_grid_thw, video_grid_thw, attention_mask, second_per_grid_ts, model,
        image_token_id, video_token_id, vision_start_token_id, spatial_merge_size,
        tokens_per_second, mm_token_type_ids, rules, time_rule);
    const int64_t B = in.a.batch, L = in.a.seq;
    const std::array<int64_t, 3> pos_sizes{3, B, L};
    const std::array<int64_t, 2> delta_sizes{B, 1};
    Tensor pos = empty(pos_sizes, ScalarType::Long, input_ids_in);
    Tensor deltas = empty(delta_sizes, ScalarType::Long, input_ids_in);
    pe_pos_error err{};
    const int rc = run_mrope_position_ids(input_ids_in, in.a, pos.mutable_data_ptr<int64_t>(),
                                          deltas.mutable_data_ptr<int64_t>(), &err);
    if (rc != PE_OK)
        raise_position_error(err, rc, in.images, in.videos, spatial_merge_size, model, in.v5);
    return {pos, deltas};
}

// ---- Packed rows: example_lens (N,) and row_examples (B,) say where the examples lie
// (posenc.h, pe_mrope_packed_position_ids).

// A 1-D integer tensor as contiguous int64.
Tensor lengths_tensor(const Tensor& t, const char* name) {
    check_cpu(t, name);
    check_integer(t, name);
    PE_CHECK_VALUE(t.dim() == 1, name, " must be 1-D, got shape ", shape(t));
    Tensor out = converted(t, ScalarType::Long);
    return out.is_contiguous() ? out : torch::stable::contiguous(out);
}

// Where example e of the packed rows lies, from example_lens and row_examples.
struct Placement {
    int64_t row = -1, start = 0, length = 0;
};

Placement placement(const Tensor& lens, const Tensor& rows, int64_t e) {
    const int64_t* len = lens.const_data_ptr<int64_t>();
    const int64_t* per_row = rows.const_data_ptr<int64_t>();
    Placement p;
    for (int64_t b = 0, first = 0; b < rows.size(0); first += per_row[b++]) {
        if (e >= first + per_row[b]) continue;
        p.row = b;
        for (int64_t k = first; k < e; ++k) p.start += len[k];
        p.length = len[e];
        return p;
    }
    return p;
}

// The example that holds token j of row b, or -1 (padding).
int64_t example_at(const Tensor& lens, const Tensor& rows, int64_t b, int64_t j) {
    const int64_t* len = lens.const_data_ptr<int64_t>();
    const int64_t* per_row = rows.const_data_ptr<int64_t>();
    int64_t e = 0;
    for (int64_t r = 0; r < b; ++r) e += per_row[r];
    for (int64_t k = 0, at = 0; k < per_row[b]; ++k, ++e) {
        if (j < at + len[e]) return e;
        at += len[e];
    }
    return -1;
}

// How the messages of the packed op name the examples: "example e" (e counted across the
// batch), or the caller's own "examples[i]" with example_ids.
struct ExampleNames {
    std::optional<Tensor> ids;  // (N,) contiguous int64
    std::string operator()(int64_t e) const {
        if (!ids.has_value()) return cat("example ", e);
        return cat("examples[", ids->const_data_ptr<int64_t>()[e], "]");
    }
};

// The error of one example that owns its grids (example_grids), as the position walk of
// that example alone reports it: its tokens and grids numbered from 0, a run cut by the
// example's end a run that is short.
[[noreturn]] void raise_owned_error(pe_pos_error e, int rc, const MropeInputs& in,
                                    const Tensor& lens, const Tensor& rows, const Tensor& owned,
                                    const ExampleNames& name, int64_t merge, int64_t model) {
    const Placement at = placement(lens, rows, e.example);
    const int64_t* own = owned.const_data_ptr<int64_t>();
    int64_t first_grid = 0;
    for (int64_t k = 0; k < e.example; ++k) first_grid += own[2 * k + (e.video ? 1 : 0)];
    if (e.token >= 0) e.token -= at.start;
    if (e.row >= 0) e.row = 0;
    if (e.grid >= 0) e.grid -= first_grid;
    if (e.problem == PE_POS_CUT_RUN) e.problem = PE_POS_SHORT_RUN;
    try {
        raise_position_error(e, rc, in.images, in.videos, merge, model, in.v5, first_grid);
    } catch (const std::invalid_argument& ex) {
        fail_value(name(e.example), ": ", value_message(ex));
    }
}

// Turns the error of example e into a ValueError that names it and where it lies.
[[noreturn]] void raise_packed_error(pe_pos_error e, int rc, const MropeInputs& in,
                                     const Tensor& lens, const Tensor& rows,
                                     const std::optional<Tensor>& owned,
                                     const ExampleNames& name, int64_t merge, int64_t model) {
    const int64_t L = in.a.seq;
    if (e.problem == PE_POS_BAD_LENGTH) {
        const std::string who =
            name.ids.has_value() ? cat(name(e.example), " (in row ", e.row, ") has length ")
                                 : cat("example_lens[", e.example, "] (example ", e.example,
                                       ", in row ", e.row, ") is ");
        fail_value(who, e.found, e.found < 0 ? "; lengths must be >= 0"
                                             : cat(" but only ", e.expected, " tokens of the row "
                                                   "are left after the examples before it (L = ",
                                                   L, ")"));
    }
    if (owned.has_value() && e.example < 0 && e.row >= 0 && e.token >= 0)
        e.example = example_at(lens, rows, e.row, e.token);  // a bad mm_token_type_ids value
    if (owned.has_value() && e.example >= 0)
        raise_owned_error(e, rc, in, lens, rows, *owned, name, merge, model);
    if (e.problem == PE_POS_BAD_ARG || e.example < 0) {
        if (e.problem == PE_POS_GRID_COUNT) {
            const char* grid_name = e.video ? "video_grid_thw" : "image_grid_thw";
            fail_value(grid_name, e.video && model == PE_MROPE_QWEN3_VL ? " describes " : " has ",
                       e.expected, e.video && model == PE_MROPE_QWEN3_VL ? " frames" : " rows",
                       ", but the ", lens.size(0), " examples hold only ", e.found,
                       e.video ? " video" : " image",
                       e.video && model == PE_MROPE_QWEN3_VL ? " frame" : "",
                       " runs (grids are taken in example order across the batch)");
        }
        raise_position_error(e, rc, in.images, in.videos, merge, model, in.v5);
    }
    const Placement at = placement(lens, rows, e.example);
    const std::string where = cat(name(e.example), " (row ", at.row, ", input_ids[", at.row, ", ",
                                  at.start, ":", at.start + at.length, "]): ");
    const char* kind = e.video ? "video" : "image";
    const char* grid_name = e.video ? "video_grid_thw" : "image_grid_thw";
    if (e.problem == PE_POS_CUT_RUN)
        fail_value(where, "the ", kind, " run that starts at input_ids[", e.row, ", ", e.token,
                   "] needs ", e.expected, " tokens (", grid_name, "[", e.grid, "] = ",
                   grid_text(e.video ? in.videos : in.images, e.grid),
                   e.frame >= 0 ? cat(", frame ", e.frame) : std::string(), "), ", e.found,
                   " of them in the example, and goes on past its end: a vision run cut by an "
                   "example boundary (are the example lengths right?)");
    if (e.problem == PE_POS_GRID_COUNT)
        fail_value(where, "input_ids[", e.row, ", ", e.token, "] starts ", kind, " run number ",
                   e.found, " of the batch, but ", grid_name, e.video &&
                   model == PE_MROPE_QWEN3_VL ? " describes only " : " has only ", e.expected,
                   e.video && model == PE_MROPE_QWEN3_VL ? " frames" : " rows",
                   " (grids are taken in example order across the batch)");
    try {
        raise_position_error(e, rc, in.images, in.videos, merge, model, in.v5);
    } catch (const std::invalid_argument& ex) {
        fail_value(where, value_message(ex));
    }
}

Tensor mrope_packed_position_ids_cpu(
    const Tensor& input_ids_in, const Tensor& example_lens, const Tensor& row_examples,
    const std::optional<Tensor>& image_grid_thw, const std::optional<Tensor>& video_grid_thw,
    const std::optional<Tensor>& second_per_grid_ts, int64_t model, int64_t image_token_id,
    int64_t video_token_id, int64_t vision_start_token_id, int64_t spatial_merge_size,
    double tokens_per_second, const std::optional<Tensor>& mm_token_type_ids, int64_t rules,
    int64_t time_rule, const std::optional<Tensor>& example_ids,
    const std::optional<Tensor>& example_grids) {
    const MropeInputs in = mrope_inputs(
        input_ids_in, image_grid_thw, video_grid_thw, std::nullopt, second_per_grid_ts, model,
        image_token_id, video_token_id, vision_start_token_id, spatial_merge_size,
        tokens_per_second, mm_token_type_ids, rules, time_rule);
    const int64_t B = in.a.batch, L = in.a.seq;
    const Tensor lens = lengths_tensor(example_lens, "example_lens");
    const Tensor rows = lengths_tensor(row_examples, "row_examples");
    PE_CHECK_VALUE(rows.size(0) == B, "row_examples must have one entry per row of input_ids (",
                   B, "), got shape ", shape(row_examples));
    const int64_t n = lens.size(0);
    int64_t listed = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t k = rows.const_data_ptr<int64_t>()[b];
        PE_CHECK_VALUE(k >= 0 && k <= n - listed, "row_examples must be >= 0 and sum to the ", n,
                       " entries of example_lens; row ", b, " has ", k, " after ", listed);
        listed += k;
    }
    PE_CHECK_VALUE(listed == n, "row_examples sums to ", listed, " but example_lens has ", n,
                   " entries");
    ExampleNames names;
    if (example_ids.has_value()) {
        names.ids = lengths_tensor(*example_ids, "example_ids");
        PE_CHECK_VALUE(names.ids->size(0) == n, "example_ids must have one entry per example (",
                       n, "), got shape ", shape(*example_ids));
    }
    std::optional<Tensor> owned;
    if (example_grids.has_value()) {
        const Tensor& g = *example_grids;
        check_cpu(g, "example_grids");
        check_integer(g, "example_grids");
        PE_CHECK_VALUE(g.dim() == 2 && g.size(0) == n && g.size(1) == 2,
                       "example_grids must have shape (examples, 2) = (", n, ", 2), got shape ",
                       shape(g));
        owned = torch::stable::contiguous(converted(g, ScalarType::Long));
        const int64_t* o = owned->const_data_ptr<int64_t>();
        int64_t images = 0, videos = 0;
        for (int64_t e = 0; e < n; ++e) {
            PE_CHECK_VALUE(o[2 * e] >= 0 && o[2 * e + 1] >= 0, "example_grids[", e,
                           "] must be >= 0, got (", o[2 * e], ", ", o[2 * e + 1], ")");
            images += o[2 * e];
            videos += o[2 * e + 1];
        }
        PE_CHECK_VALUE(images == in.a.n_images && videos == in.a.n_videos,
                       "example_grids sums to (", images, ", ", videos, ") grids, but "
                       "image_grid_thw and video_grid_thw have ", in.a.n_images, " and ",
                       in.a.n_videos, " rows");
    }
    PE_CHECK_VALUE(L == 0 || B <= INT64_MAX / 4 / L, "input_ids is too large: ",
                   shape(input_ids_in));
    const std::array<int64_t, 3> sizes{4, B, L};
    Tensor pos = empty(sizes, ScalarType::Long, input_ids_in);
    pe_pos_error err{};
    const int rc = pe_mrope_packed_position_ids(
        &in.a, n, lens.const_data_ptr<int64_t>(), rows.const_data_ptr<int64_t>(),
        owned.has_value() ? owned->const_data_ptr<int64_t>() : nullptr,
        pos.mutable_data_ptr<int64_t>(), &err);
    if (rc != PE_OK) {
        if (rc == PE_ERR_NOMEM) check_status(rc, "posenc::mrope_packed_position_ids");
        raise_packed_error(err, rc, in, lens, rows, owned, names, spatial_merge_size, model);
    }
    return pos;
}

// ---- Vision towers (posenc.h, "Vision towers"): grids (n, 3) in, index tensors out.

// The checked grids as the C walks take them; the tensors own the memory g points into.
struct VisionGrids {
    Tensor thw;
    std::optional<Tensor> merge;
    pe_vision_grids g{};
};

VisionGrids vision_grids(const Tensor& grid_thw, int64_t spatial_merge_size,
                         const std::optional<Tensor>& merge_sizes = std::nullopt) {
    PE_CHECK_VALUE(spatial_merge_size >= 1, "spatial_merge_size must be >= 1, got ",
                   spatial_merge_size);
    VisionGrids v{*grid_tensor(grid_thw, "grid_thw"), std::nullopt};
    const int64_t n = v.thw.size(0);
    if (merge_sizes.has_value()) {
        v.merge = lengths_tensor(*merge_sizes, "spatial_merge_size");
        PE_CHECK_VALUE(v.merge->size(0) == n, "spatial_merge_size as a tensor must have one "
                       "entry per row of grid_thw (", n, "), got shape ", shape(*merge_sizes));
    }
    v.g.n = n;
    v.g.thw = v.thw.const_data_ptr<int64_t>();
    v.g.merge = v.merge.has_value() ? v.merge->const_data_ptr<int64_t>() : nullptr;
    v.g.merge_size = spatial_merge_size;
    return v;
}

// Turns the failure of a vision walk into a ValueError naming the grid row and what is
// wrong with it; `merge_read`: whether the walk needs h, w divisible by the merge size.
void check_vision(int rc, const pe_pos_error& e, const VisionGrids& v, bool merge_read,
                  const char* op) {
    if (rc == PE_OK) return;
    const std::optional<Tensor> grids = v.thw;
    const int64_t i = e.grid;
    const std::string row = cat("grid_thw[", i, "] = ", grid_text(grids, i));
    const std::string merge_name = v.merge.has_value() ? cat("spatial_merge_size[", i, "]")
                                                        : std::string("spatial_merge_size");
    if (rc == PE_ERR_GRID && e.problem == PE_POS_BAD_MERGE)
        fail_value(merge_name, " is ", e.found, "; merge sizes must be >= 1");
    if (rc == PE_ERR_GRID && e.problem == PE_POS_INT32_OVERFLOW)
        fail_value(row, ": the patches of grid_thw[0..", i, "] pass 2^31 - 1, more than the "
                   "int32 boundaries can count");
    if (rc == PE_ERR_GRID && e.problem == PE_POS_BAD_GRID && i >= 0 && i < v.g.n) {
        const int64_t* r = v.g.thw + 3 * i;
        const int64_t m = v.g.merge ? v.g.merge[i] : v.g.merge_size;
        if (r[0] < 1 || r[1] < 1 || r[2] < 1)
            fail_value(row, " is not a valid patch grid: t, h and w must be positive");
        if (merge_read && (r[1] % m || r[2] % m))
            fail_value(row, " is not a valid patch grid: h and w must be divisible by ",
                       merge_name, " = ", m, " (grids count patches before merging)");
        fail_value(row, ": the patch count of the batch must stay below 2^62");
    }
    check_status(rc, op);
}

Tensor vision_position_ids_cpu(const Tensor& grid_thw, int64_t spatial_merge_size,
                               const std::optional<Tensor>& merge_sizes, bool include_temporal) {
    const VisionGrids v = vision_grids(grid_thw, spatial_merge_size, merge_sizes);
    pe_pos_error err{};
    pe_vision_sizes sizes{};
    check_vision(pe_vision_sizes_of(&v.g, &sizes, &err), err, v, true,
                 "posenc::vision_position_ids");
    const int columns = include_temporal ? 3 : 2;
    const std::array<int64_t, 2> shape{sizes.patches, columns};
    Tensor out = empty(shape, ScalarType::Long, grid_thw,
                       include_temporal ? "the (patches, 3) ids of grid_thw"
                                        : "the (patches, 2) ids of grid_thw");
    check_vision(pe_vision_positions(&v.g, columns, out.mutable_data_ptr<int64_t>(), sizes.patches,
                                     num_threads(), &err),
                 err, v, true, "posenc::vision_position_ids");
    return out;
}

TensorPair vision_cu_seqlens_cpu(const Tensor& grid_thw, bool merge_temporal) {
    const VisionGrids v = vision_grids(grid_thw, 1);
    pe_pos_error err{};
    pe_vision_sizes sizes{};
    check_vision(pe_vision_sizes_of(&v.g, &sizes, &err), err, v, false,
                 "posenc::vision_cu_seqlens");
    const std::array<int64_t, 1> shape{(merge_temporal ? v.g.n : sizes.frames) + 1};
    Tensor cu = empty(shape, ScalarType::Int, grid_thw, "the cu_seqlens of grid_thw");
    Tensor longest = empty(std::array<int64_t, 0>{}, ScalarType::Long, grid_thw);
    check_vision(pe_vision_cu_seqlens(&v.g, merge_temporal ? 1 : 0, cu.mutable_data_ptr<int32_t>(),
                                      shape[0], longest.mutable_data_ptr<int64_t>(), &err),
                 err, v, false, "posenc::vision_cu_seqlens");
    return {cu, longest};
}

TensorPair vision_window_index_cpu(const Tensor& grid_thw, int64_t spatial_merge_size,
                                   int64_t window_size, int64_t patch_size) {
    const VisionGrids v = vision_grids(grid_thw, spatial_merge_size);
    PE_CHECK_VALUE(window_size >= 1, "window_size must be >= 1, got ", window_size);
    PE_CHECK_VALUE(patch_size >= 1, "patch_size must be >= 1, got ", patch_size);
    PE_CHECK_VALUE(window_size / spatial_merge_size / patch_size >= 1, "window_size (",
                   window_size, ") must be at least spatial_merge_size * patch_size (",
                   spatial_merge_size, " * ", patch_size, "): a window must hold a merged token");
    pe_pos_error err{};
    int64_t tokens = 0, windows = 0;
    check_vision(pe_vision_window_sizes(&v.g, window_size, patch_size, &tokens, &windows, &err),
                 err, v, true, "posenc::vision_window_index");
    Tensor index = empty(std::array<int64_t, 1>{tokens}, ScalarType::Long, grid_thw,
                         "the window index of grid_thw");
    Tensor cu = empty(std::array<int64_t, 1>{windows + 1}, ScalarType::Int, grid_thw,
                      "the cu_window_seqlens of grid_thw");
    check_vision(pe_vision_window_index(&v.g, window_size, patch_size,
                                        index.mutable_data_ptr<int64_t>(), tokens,
                                        cu.mutable_data_ptr<int32_t>(), windows, num_threads(),
                                        &err),
                 err, v, true, "posenc::vision_window_index");
    return {index, cu};
}

TensorPair vision_interpolation_cpu(const Tensor& grid_thw, int64_t num_grid_per_side,
                                    int64_t mode, bool align_corners, int64_t spatial_merge_size,
                                    int64_t padding, int64_t rule) {
    const VisionGrids v = vision_grids(grid_thw, spatial_merge_size);
    PE_CHECK_VALUE(num_grid_per_side >= 1 && num_grid_per_side <= INT32_MAX,
                   "num_grid_per_side must be in [1, 2^31 - 1], got ", num_grid_per_side);
    PE_CHECK_VALUE(mode == PE_INTERP_BILINEAR || mode == PE_INTERP_BICUBIC,
                   "mode must be 0 (bilinear) or 1 (bicubic), got ", mode);
    PE_CHECK_VALUE(padding == PE_INTERP_BORDER || padding == PE_INTERP_ZEROS,
                   "padding must be 0 (border) or 1 (zeros), got ", padding);
    PE_CHECK_VALUE(rule >= PE_INTERP_RULES_5 && rule <= PE_INTERP_LINSPACE_TWO_ROUNDINGS,
                   "rule must be 0 (transformers 5.x) or 1, 2 (4.57 linspace), got ", rule);
    PE_CHECK_VALUE(rule == PE_INTERP_RULES_5 ||
                       (mode == PE_INTERP_BILINEAR && align_corners && padding == PE_INTERP_BORDER),
                   "the 4.57 linspace rule is bilinear with align_corners and border padding only");
    pe_pos_error err{};
    pe_vision_sizes sizes{};
    check_vision(pe_vision_sizes_of(&v.g, &sizes, &err), err, v, true,
                 "posenc::vision_interpolation");
    const int64_t taps = mode == PE_INTERP_BILINEAR ? 4 : 16;
    PE_CHECK_VALUE(sizes.patches <= (INT64_C(1) << 62) / taps, "grid_thw has too many patches "
                   "for ", taps, " taps each: ", sizes.patches);
    const std::array<int64_t, 2> shape{sizes.patches, taps};
    Tensor indices = empty(shape, ScalarType::Long, grid_thw, "the interpolation indices");
    Tensor weights = empty(shape, ScalarType::Float, grid_thw, "the interpolation weights");
    pe_vision_interp p{};
    p.side = num_grid_per_side;
    p.mode = static_cast<pe_interp_mode>(mode);
    p.align_corners = align_corners ? 1 : 0;
    p.padding = static_cast<pe_interp_padding>(padding);
    p.rule = static_cast<pe_interp_rule>(rule);
    check_vision(pe_vision_interpolation(&v.g, &p, indices.mutable_data_ptr<int64_t>(),
                                         weights.mutable_data_ptr<float>(), sizes.patches,
                                         num_threads(), &err),
                 err, v, true, "posenc::vision_interpolation");
    return {indices, weights};
}

Tensor vision_nearest_position_ids_cpu(const Tensor& target_sizes, int64_t num_patches_per_side) {
    check_cpu(target_sizes, "target_sizes");
    check_integer(target_sizes, "target_sizes");
    PE_CHECK_VALUE(target_sizes.dim() == 2 && target_sizes.size(1) == 2,
                   "target_sizes must have shape (num_images, 2) of (h, w) patch counts, got "
                   "shape ", shape(target_sizes));
    PE_CHECK_VALUE(num_patches_per_side >= 1 && num_patches_per_side <= INT32_MAX,
                   "num_patches_per_side must be in [1, 2^31 - 1], got ", num_patches_per_side);
    Tensor sizes = converted(target_sizes, ScalarType::Long);
    if (!sizes.is_contiguous()) sizes = torch::stable::contiguous(sizes);
    const int64_t n = sizes.size(0);
    const int64_t* hw = sizes.const_data_ptr<int64_t>();
    pe_pos_error err{};
    int64_t total = 0;
    int rc = pe_vision_nearest_count(n, hw, &total, &err);
    if (rc == PE_ERR_GRID && err.grid >= 0 && err.grid < n)
        fail_value("target_sizes[", err.grid, "] = (", hw[2 * err.grid], ", ",
                   hw[2 * err.grid + 1], ") is not a valid size: h and w must be positive",
                   " and the patch count of the batch below 2^62");
    check_status(rc, "posenc::vision_nearest_position_ids");
    Tensor out = empty(std::array<int64_t, 1>{total}, ScalarType::Long, target_sizes,
                       "the position ids of target_sizes");
    rc = pe_vision_nearest_position_ids(n, hw, num_patches_per_side,
                                        out.mutable_data_ptr<int64_t>(), total, num_threads(),
                                        &err);
    check_status(rc, "posenc::vision_nearest_position_ids");
    return out;
}

// ---- Sinusoidal table.  posenc::sinusoidal has no tensor inputs, so no backend key
// selects a kernel: it is registered under CompositeExplicitAutograd, which also serves
// calls without a key, and it allocates on the CPU.

Tensor sinusoidal_impl(int64_t num_positions, int64_t dim, double base, ScalarType dtype) {
    PE_CHECK_VALUE(num_positions >= 0, "num_positions must be >= 0, got ", num_positions);
    PE_CHECK_VALUE(dim >= 1, "dim must be >= 1, got ", dim);
    PE_CHECK_VALUE(num_positions <= INT64_MAX / dim, "num_positions * dim overflows: ",
                   num_positions, " * ", dim);
    PE_CHECK_VALUE(std::isfinite(base) && base > 0.0, "base must be finite and > 0, got ", base);
    const pe_dtype odt = to_pe_dtype(dtype, "dtype");
    const std::array<int64_t, 2> sizes{num_positions, dim};
    const std::array<int64_t, 2> strides{dim, 1};
    Tensor out = empty_strided(sizes, strides, dtype_code(dtype), aoti_torch_device_type_cpu(), 0,
                               "the (num_positions, dim) table");
    check_status(run_sinusoidal(out, num_positions, dim, base, odt), "posenc::sinusoidal");
    return out;
}

#ifdef POSENC_WITH_CUDA
// ---- CUDA: the rotation ops on the device of their first tensor.  After the device check
// they run the bodies above (named for the CPU, device-neutral but for check_cpu), whose
// run_* calls pick the CUDA kernels; the device guard makes that device current.

using Named = std::pair<const Tensor*, const char*>;

torch::stable::accelerator::DeviceGuard cuda_inputs(std::initializer_list<Named> tensors) {
    const Tensor& first = *tensors.begin()->first;
    const char* first_name = tensors.begin()->second;
    for (const Named& t : tensors)
        PE_CHECK_VALUE(t.first->is_cuda() &&
                           t.first->get_device_index() == first.get_device_index(),
                       t.second, " is on ", DeviceName{*t.first}, " but ", first_name, " is on ",
                       DeviceName{first}, "; all tensors must be on the same device");
    return torch::stable::accelerator::DeviceGuard(first.get_device_index());
}

TensorPair rope_cuda(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                     IntList mrope_section, bool interleaved, int64_t pairing, bool transpose,
                     std::optional<ScalarType> q_dtype, std::optional<ScalarType> k_dtype,
                     bool heads_first) {
    auto guard = cuda_inputs({{&q, "q"}, {&k, "k"}, {&cos, "cos"}, {&sin, "sin"}});
    return rope_cpu(q, k, cos, sin, mrope_section, interleaved, pairing, transpose, q_dtype,
                    k_dtype, heads_first);
}

TensorPair rope_table_grad_cuda(const Tensor& grad_q, const Tensor& grad_k, const Tensor& q,
                                const Tensor& k, const Tensor& cos, IntList mrope_section,
                                bool interleaved, int64_t pairing) {
    auto guard = cuda_inputs(
        {{&grad_q, "grad_q"}, {&grad_k, "grad_k"}, {&q, "q"}, {&k, "k"}, {&cos, "cos"}});
    return rope_table_grad_cpu(grad_q, grad_k, q, k, cos, mrope_section, interleaved, pairing);
}

TensorPair rope_fused_cuda(const Tensor& q, const Tensor& k, const Tensor& position_ids,
                           const Tensor& inv_freq, IntList mrope_section, bool interleaved,
                           double attention_scaling, int64_t pairing, bool transpose,
                           bool heads_first) {
    auto guard = cuda_inputs(
        {{&q, "q"}, {&k, "k"}, {&position_ids, "position_ids"}, {&inv_freq, "inv_freq"}});
    return rope_fused_cpu(q, k, position_ids, inv_freq, mrope_section, interleaved,
                          attention_scaling, pairing, transpose, heads_first);
}

TensorPair rope_tables_cuda(const Tensor& position_ids, const Tensor& inv_freq,
                            IntList mrope_section, bool interleaved, double attention_scaling,
                            int64_t pairing, ScalarType dtype) {
    auto guard = cuda_inputs({{&position_ids, "position_ids"}, {&inv_freq, "inv_freq"}});
    return rope_tables_cpu(position_ids, inv_freq, mrope_section, interleaved, attention_scaling,
                           pairing, dtype);
}
#endif

}  // namespace
}  // namespace posenc

STABLE_TORCH_LIBRARY(posenc, m) {
    m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, int[] mrope_section, bool interleaved, "
          "int pairing, bool transpose, ScalarType? q_dtype=None, ScalarType? k_dtype=None, "
          "bool heads_first=False) -> (Tensor, Tensor)");
    m.def("rope_table_grad(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor cos, "
          "int[] mrope_section, bool interleaved, int pairing) -> (Tensor, Tensor)");
    m.def("rope_fused(Tensor q, Tensor k, Tensor position_ids, Tensor inv_freq, int[] mrope_section, "
          "bool interleaved, float attention_scaling, int pairing, bool transpose, "
          "bool heads_first=False) -> (Tensor, Tensor)");
    m.def("rope_tables(Tensor position_ids, Tensor inv_freq, int[] mrope_section, bool interleaved, "
          "float attention_scaling, int pairing, ScalarType dtype) -> (Tensor, Tensor)");
    m.def("mrope_position_ids(Tensor input_ids, Tensor? image_grid_thw, Tensor? video_grid_thw, "
          "Tensor? attention_mask, Tensor? second_per_grid_ts, int model, int image_token_id, "
          "int video_token_id, int vision_start_token_id, int spatial_merge_size, "
          "float tokens_per_second, Tensor? mm_token_type_ids=None, int rules=0, "
          "int time_rule=0) -> (Tensor, Tensor)");
    m.def("mrope_packed_position_ids(Tensor input_ids, Tensor example_lens, Tensor row_examples, "
          "Tensor? image_grid_thw, Tensor? video_grid_thw, Tensor? second_per_grid_ts, int model, "
          "int image_token_id, int video_token_id, int vision_start_token_id, "
          "int spatial_merge_size, float tokens_per_second, Tensor? mm_token_type_ids, int rules, "
          "int time_rule, Tensor? example_ids=None, Tensor? example_grids=None) -> Tensor");
    m.def("vision_position_ids(Tensor grid_thw, int spatial_merge_size, Tensor? merge_sizes=None, "
          "bool include_temporal=False) -> Tensor");
    m.def("vision_cu_seqlens(Tensor grid_thw, bool merge_temporal=False) -> (Tensor, Tensor)");
    m.def("vision_window_index(Tensor grid_thw, int spatial_merge_size, int window_size, "
          "int patch_size) -> (Tensor, Tensor)");
    m.def("vision_interpolation(Tensor grid_thw, int num_grid_per_side, int mode=0, "
          "bool align_corners=False, int spatial_merge_size=1, int padding=0, int rule=0) "
          "-> (Tensor, Tensor)");
    m.def("vision_nearest_position_ids(Tensor target_sizes, int num_patches_per_side) -> Tensor");
    m.def("sinusoidal(SymInt num_positions, SymInt dim, float base, ScalarType dtype) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(posenc, CPU, m) {
    m.impl("rope", TORCH_BOX(&posenc::rope_cpu));
    m.impl("rope_table_grad", TORCH_BOX(&posenc::rope_table_grad_cpu));
    m.impl("rope_fused", TORCH_BOX(&posenc::rope_fused_cpu));
    m.impl("rope_tables", TORCH_BOX(&posenc::rope_tables_cpu));
    m.impl("mrope_position_ids", TORCH_BOX(&posenc::mrope_position_ids_cpu));
    m.impl("mrope_packed_position_ids", TORCH_BOX(&posenc::mrope_packed_position_ids_cpu));
    m.impl("vision_position_ids", TORCH_BOX(&posenc::vision_position_ids_cpu));
    m.impl("vision_cu_seqlens", TORCH_BOX(&posenc::vision_cu_seqlens_cpu));
    m.impl("vision_window_index", TORCH_BOX(&posenc::vision_window_index_cpu));
    m.impl("vision_interpolation", TORCH_BOX(&posenc::vision_interpolation_cpu));
    m.impl("vision_nearest_position_ids", TORCH_BOX(&posenc::vision_nearest_position_ids_cpu));
}

#ifdef POSENC_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
    m.impl("rope", TORCH_BOX(&posenc::rope_cuda));
    m.impl("rope_table_grad", TORCH_BOX(&posenc::rope_table_grad_cuda));
    m.impl("rope_fused", TORCH_BOX(&posenc::rope_fused_cuda));
    m.impl("rope_tables", TORCH_BOX(&posenc::rope_tables_cuda));
}
#endif

STABLE_TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
    m.impl("sinusoidal", TORCH_BOX(&posenc::sinusoidal_impl));
}

// ---- posenc_torch._C: the module object, plus the SIMD-variant switch used by the tests.

namespace {

PyObject* py_isa(PyObject*, PyObject*) { return PyUnicode_FromString(pe_isa_name(pe_isa_current())); }

PyObject* py_best_isa(PyObject*, PyObject*) { return PyUnicode_FromString(pe_isa_name(pe_isa_best())); }

PyObject* py_set_isa(PyObject*, PyObject* arg) {
    const char* name = PyUnicode_AsUTF8AndSize(arg, nullptr);
    if (!name) return nullptr;
    for (int i = PE_ISA_BASELINE; i <= PE_ISA_AVX512; ++i) {
        if (std::string(name) == pe_isa_name(static_cast<pe_isa>(i))) {
            if (pe_isa_set(static_cast<pe_isa>(i)) != PE_OK) {
                PyErr_Format(PyExc_ValueError, "this CPU does not support the '%s' kernels", name);
                return nullptr;
            }
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "isa must be 'baseline', 'avx2' or 'avx512', got '%s'", name);
    return nullptr;
}

PyObject* py_has_cuda(PyObject*, PyObject*) {
#ifdef POSENC_WITH_CUDA
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

PyMethodDef methods[] = {
    {"has_cuda", py_has_cuda, METH_NOARGS, "Whether the CUDA kernels were built in."},
    {"isa", py_isa, METH_NOARGS, "Name of the SIMD kernel variant in use."},
    {"best_isa", py_best_isa, METH_NOARGS, "Name of the best SIMD variant this CPU supports."},
    {"set_isa", py_set_isa, METH_O, "Force a SIMD variant: 'baseline', 'avx2' or 'avx512'."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "posenc_torch C kernels (torch.ops.posenc).",
                          -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }

// posenc::rope, rope_table_grad, rope_fused and rope_tables: the rotations and their
// tables.  Each op: validate -> fill the C argument struct (posenc.h) -> run_* (the one
// place per op that picks the device's kernel) -> check the status.  The *_impl bodies
// serve both devices; the *_cuda entry points check that every tensor is on one CUDA
// device, make it current and run them.
#include <vector>

#include "shim.h"
#ifdef POSENC_WITH_CUDA
#include <initializer_list>
#include <utility>

#include <torch/csrc/stable/accelerator.h>
#endif

namespace posenc {
namespace {

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
    check_kernel_device(qm, q, "q");
    check_kernel_device(km, k, "k");
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
    check_kernel_device(cm, cos, "cos");
    check_kernel_device(sm, sin, "sin");
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

}  // namespace

// ---- Rotations.

TensorPair rope_impl(const Tensor& q_in, const Tensor& k_in, const Tensor& cos_in,
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

TensorPair rope_table_grad_impl(const Tensor& grad_q_in, const Tensor& grad_k_in,
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
    check_kernel_device(gqm, grad_q_in, "grad_q");
    check_kernel_device(gkm, grad_k_in, "grad_k");
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

namespace {

// Positions (Bp, T) or (3, Bp, T) and inv_freq (R/2,) as the fused angle source.
struct PositionSource {
    Tensor pos, inv_freq;
    std::vector<uint8_t> map;
};

PositionSource position_source(pe_rope_source& src, const Tensor& position_ids,
                               const Tensor& inv_freq, IntList mrope_section, bool interleaved,
                               double scaling, int64_t B, int64_t T) {
    const Meta pm(position_ids), fm(inv_freq);
    check_kernel_device(pm, position_ids, "position_ids");
    check_kernel_device(fm, inv_freq, "inv_freq");
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

}  // namespace

TensorPair rope_fused_impl(const Tensor& q_in, const Tensor& k_in, const Tensor& position_ids,
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

TensorPair rope_tables_impl(const Tensor& position_ids, const Tensor& inv_freq,
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

#ifdef POSENC_WITH_CUDA
// ---- CUDA: the rotation ops on the device of their first tensor.  After the device check
// they run the *_impl bodies above, whose run_* calls pick the CUDA kernels; the device
// guard makes that device current.

namespace {

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

}  // namespace

TensorPair rope_cuda(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                     IntList mrope_section, bool interleaved, int64_t pairing, bool transpose,
                     std::optional<ScalarType> q_dtype, std::optional<ScalarType> k_dtype,
                     bool heads_first) {
    auto guard = cuda_inputs({{&q, "q"}, {&k, "k"}, {&cos, "cos"}, {&sin, "sin"}});
    return rope_impl(q, k, cos, sin, mrope_section, interleaved, pairing, transpose, q_dtype,
                     k_dtype, heads_first);
}

TensorPair rope_table_grad_cuda(const Tensor& grad_q, const Tensor& grad_k, const Tensor& q,
                                const Tensor& k, const Tensor& cos, IntList mrope_section,
                                bool interleaved, int64_t pairing) {
    auto guard = cuda_inputs(
        {{&grad_q, "grad_q"}, {&grad_k, "grad_k"}, {&q, "q"}, {&k, "k"}, {&cos, "cos"}});
    return rope_table_grad_impl(grad_q, grad_k, q, k, cos, mrope_section, interleaved, pairing);
}

TensorPair rope_fused_cuda(const Tensor& q, const Tensor& k, const Tensor& position_ids,
                           const Tensor& inv_freq, IntList mrope_section, bool interleaved,
                           double attention_scaling, int64_t pairing, bool transpose,
                           bool heads_first) {
    auto guard = cuda_inputs(
        {{&q, "q"}, {&k, "k"}, {&position_ids, "position_ids"}, {&inv_freq, "inv_freq"}});
    return rope_fused_impl(q, k, position_ids, inv_freq, mrope_section, interleaved,
                           attention_scaling, pairing, transpose, heads_first);
}

TensorPair rope_tables_cuda(const Tensor& position_ids, const Tensor& inv_freq,
                            IntList mrope_section, bool interleaved, double attention_scaling,
                            int64_t pairing, ScalarType dtype) {
    auto guard = cuda_inputs({{&position_ids, "position_ids"}, {&inv_freq, "inv_freq"}});
    return rope_tables_impl(position_ids, inv_freq, mrope_section, interleaved, attention_scaling,
                            pairing, dtype);
}
#endif

}  // namespace posenc

// The only file that includes torch headers: it registers the posenc ops, validates the
// tensors, allocates outputs and hands raw pointers, sizes and strides to the C kernels.
// It also defines the posenc_torch._C module with the plain Python C API; importing that
// module runs the registrations below.
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/result_type.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "posenc.h"

namespace {

using at::IntArrayRef;
using at::Tensor;
using TensorPair = std::tuple<Tensor, Tensor>;

pe_dtype to_pe_dtype(at::ScalarType s, const char* name) {
    switch (s) {
    case at::kFloat: return PE_FLOAT32;
    case at::kDouble: return PE_FLOAT64;
    case at::kBFloat16: return PE_BFLOAT16;
    case at::kHalf: return PE_FLOAT16;
    default:
        TORCH_CHECK(false, name, " must be float32, float64, bfloat16 or float16, got ", s);
    }
}

pe_dtype to_pe_dtype(const Tensor& t, const char* name) { return to_pe_dtype(t.scalar_type(), name); }

int num_threads() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

void check_cpu(const Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
}

// The kernels need unit stride in the channel dimension; anything else is copied once.
Tensor channel_contiguous(const Tensor& t) {
    return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

void fill_strides(int64_t dst[3], const Tensor& t) {  // t is (B, T, H, D)
    for (int i = 0; i < 3; ++i) dst[i] = t.stride(i);
}

void check_status(int rc, const char* op) {
    TORCH_CHECK(rc != PE_ERR_NOMEM, op, ": out of memory for scratch buffers");
    TORCH_CHECK(rc == PE_OK, op, ": the kernel rejected its arguments (status ", rc, ")");
}

// Validates q, k (B, T, H, D) and returns the rotary problem without its angle source.
pe_rope_args problem(const Tensor& q, const Tensor& k, int64_t rot_dim, int64_t pairing,
                     bool transpose) {
    TORCH_CHECK(q.dim() == 4, "q must be 4-D (batch, seq, heads, head_dim), got ", q.dim(), "-D");
    TORCH_CHECK(k.dim() == 4, "k must be 4-D (batch, seq, heads, head_dim), got ", k.dim(), "-D");
    check_cpu(q, "q");
    check_cpu(k, "k");
    TORCH_CHECK(k.size(0) == q.size(0), "k batch size ", k.size(0), " must equal q batch size ",
                q.size(0));
    TORCH_CHECK(k.size(1) == q.size(1), "k sequence length ", k.size(1),
                " must equal q sequence length ", q.size(1));
    TORCH_CHECK(k.size(3) == q.size(3), "k head_dim ", k.size(3), " must equal q head_dim ",
                q.size(3));
    TORCH_CHECK(pairing == PE_PAIR_HALF || pairing == PE_PAIR_ADJACENT,
                "pairing must be 0 (half) or 1 (adjacent), got ", pairing);
    TORCH_CHECK(rot_dim % 2 == 0 && rot_dim >= 2,
                "rotary width (last dim of cos/sin, or 2 * len(inv_freq)) must be even and >= 2, got ",
                rot_dim);
    TORCH_CHECK(rot_dim <= q.size(3), "rotary width ", rot_dim, " must not exceed head_dim ",
                q.size(3));
    pe_rope_args a{};
    a.batch = q.size(0);
    a.seq = q.size(1);
    a.head_dim = q.size(3);
    a.rot_dim = rot_dim;
    a.pairing = static_cast<pe_pairing>(pairing);
    a.transpose = transpose ? 1 : 0;
    a.nthreads = num_threads();
    return a;
}

void bind(pe_rope_tensor& dst, const Tensor& in, const Tensor& out, const char* name) {
    dst.in = in.const_data_ptr();
    dst.out = out.mutable_data_ptr();
    dst.in_dtype = to_pe_dtype(in, name);
    dst.out_dtype = to_pe_dtype(out, name);
    dst.heads = in.size(2);
    fill_strides(dst.in_stride, in);
    fill_strides(dst.out_stride, out);
}

// Section list -> per-slot axis map (empty sections: plain RoPE, no map).
std::vector<uint8_t> axis_map(IntArrayRef sections, bool interleaved, int64_t rot_dim) {
    if (sections.empty()) return {};
    TORCH_CHECK(sections.size() == 3, "mrope_section must have 3 entries (T, H, W), got ",
                sections.size());
    int64_t sum = sections[0] + sections[1] + sections[2];
    TORCH_CHECK(sections[0] >= 0 && sections[1] >= 0 && sections[2] >= 0,
                "mrope_section entries must be non-negative, got ", sections);
    TORCH_CHECK(2 * sum == rot_dim, "mrope_section ", sections, " must satisfy 2 * sum == ",
                rot_dim, " (the rotary width), got 2 * ", sum, " = ", 2 * sum);
    std::vector<uint8_t> map(static_cast<size_t>(rot_dim / 2));
    const std::array<int64_t, 3> s{sections[0], sections[1], sections[2]};
    check_status(pe_mrope_axis_map(rot_dim / 2, s.data(), interleaved ? 1 : 0, map.data()),
                 "mrope_section");
    return map;
}

// Output of x's shape in dtype, laid out like x (empty_like) when that gives the unit
// channel stride the kernel writes with, else contiguous.  The fake kernels
// (posenc_torch/ops.py, _output_like) follow the same rule.
Tensor output_like(const Tensor& x, at::ScalarType dtype) {
    Tensor out = at::empty_like(x, x.options().dtype(dtype));
    if (out.size(-1) > 1 && out.stride(-1) != 1)
        out = at::empty(x.sizes(), x.options().dtype(dtype));
    return out;
}

// cos/sin checks shared by the table ops; returns the table batch.
int64_t check_tables(const Tensor& cos, const Tensor& sin, int64_t B, int64_t T, bool mrope) {
    check_cpu(cos, "cos");
    check_cpu(sin, "sin");
    TORCH_CHECK(sin.sizes() == cos.sizes(), "sin shape ", sin.sizes(), " must equal cos shape ",
                cos.sizes());
    TORCH_CHECK(sin.scalar_type() == cos.scalar_type(), "sin dtype ", sin.scalar_type(),
                " must equal cos dtype ", cos.scalar_type());
    const int64_t want = mrope ? 4 : 3;
    TORCH_CHECK(cos.dim() == want, "cos must be ", want, "-D ",
                mrope ? "(3, batch, seq, rot_dim)" : "(batch, seq, rot_dim)", ", got shape ",
                cos.sizes());
    if (mrope)
        TORCH_CHECK(cos.size(0) == 3, "cos for MRoPE must have 3 axes (T, H, W) in dim 0, got ",
                    cos.size(0));
    const int64_t Bc = cos.size(-3);
    TORCH_CHECK(Bc == 1 || Bc == B, "cos batch size ", Bc, " must be 1 or the batch size ", B);
    TORCH_CHECK(cos.size(-2) == T, "cos sequence length ", cos.size(-2),
                " must equal the sequence length of q ", T);
    return Bc;
}

void set_table_source(pe_rope_source& src, const Tensor& cos, const Tensor& sin, int64_t Bc,
                      const std::vector<uint8_t>& map) {
    src.cos = cos.const_data_ptr();
    src.sin = sin.const_data_ptr();
    src.table_dtype = to_pe_dtype(cos, "cos");
    src.table_batch = Bc;
    const bool mrope = cos.dim() == 4;
    src.table_stride[0] = mrope ? cos.stride(0) : 0;
    src.table_stride[1] = cos.stride(-3);
    src.table_stride[2] = cos.stride(-2);
    src.axis_of_slot = map.empty() ? nullptr : map.data();
}

TensorPair rope_cpu(const Tensor& q_in, const Tensor& k_in, const Tensor& cos_in,
                    const Tensor& sin_in, IntArrayRef mrope_section, bool interleaved,
                    int64_t pairing, bool transpose, std::optional<at::ScalarType> q_dtype,
                    std::optional<at::ScalarType> k_dtype) {
    TORCH_CHECK(cos_in.dim() >= 1, "cos must have a rotary dimension");
    pe_rope_args a = problem(q_in, k_in, cos_in.size(-1), pairing, transpose);
    const bool mrope = !mrope_section.empty();
    const int64_t Bc = check_tables(cos_in, sin_in, a.batch, a.seq, mrope);
    to_pe_dtype(q_in, "q");
    to_pe_dtype(k_in, "k");
    to_pe_dtype(cos_in, "cos");
    const auto map = axis_map(mrope_section, interleaved, a.rot_dim);

    Tensor q = channel_contiguous(q_in), k = channel_contiguous(k_in);
    Tensor cos = channel_contiguous(cos_in), sin = channel_contiguous(sin_in);
    if (sin.strides() != cos.strides()) sin = sin.contiguous(), cos = cos.contiguous();
    Tensor q_out = output_like(q_in, q_dtype.value_or(at::result_type(q_in, cos_in)));
    Tensor k_out = output_like(k_in, k_dtype.value_or(at::result_type(k_in, cos_in)));
    to_pe_dtype(q_out, "q_dtype");
    to_pe_dtype(k_out, "k_dtype");

    set_table_source(a.src, cos, sin, Bc, map);
    bind(a.q, q, q_out, "q");
    bind(a.k, k, k_out, "k");
    check_status(pe_rope_apply(&a), "posenc::rope");
    return {q_out, k_out};
}

TensorPair rope_table_grad_cpu(const Tensor& grad_q_in, const Tensor& grad_k_in,
                               const Tensor& q_in, const Tensor& k_in, const Tensor& cos,
                               IntArrayRef mrope_section, bool interleaved, int64_t pairing) {
    TORCH_CHECK(cos.dim() >= 1, "cos must have a rotary dimension");
    pe_rope_args a = problem(q_in, k_in, cos.size(-1), pairing, false);
    const bool mrope = !mrope_section.empty();
    const int64_t Bc = check_tables(cos, cos, a.batch, a.seq, mrope);
    TORCH_CHECK(grad_q_in.sizes() == q_in.sizes(), "grad_q shape ", grad_q_in.sizes(),
                " must equal q shape ", q_in.sizes());
    TORCH_CHECK(grad_k_in.sizes() == k_in.sizes(), "grad_k shape ", grad_k_in.sizes(),
                " must equal k shape ", k_in.sizes());
    check_cpu(grad_q_in, "grad_q");
    check_cpu(grad_k_in, "grad_k");
    const pe_dtype gdt = to_pe_dtype(grad_q_in, "grad_q");
    to_pe_dtype(grad_k_in, "grad_k");
    const auto map = axis_map(mrope_section, interleaved, a.rot_dim);

    Tensor q = channel_contiguous(q_in), k = channel_contiguous(k_in);
    Tensor gq = channel_contiguous(grad_q_in);
    Tensor gk = channel_contiguous(grad_k_in.to(grad_q_in.scalar_type()));
    Tensor dcos = at::empty(cos.sizes(), cos.options().memory_format(at::MemoryFormat::Contiguous));
    Tensor dsin = at::empty(cos.sizes(), cos.options().memory_format(at::MemoryFormat::Contiguous));

    a.src.table_dtype = to_pe_dtype(cos, "cos");
    a.src.table_batch = Bc;
    a.src.cos = a.src.sin = dcos.const_data_ptr();  // shape only; the kernel writes dcos/dsin
    a.src.axis_of_slot = map.empty() ? nullptr : map.data();
    bind(a.q, q, q, "q");
    bind(a.k, k, k, "k");
    int64_t gqs[3], gks[3];
    fill_strides(gqs, gq);
    fill_strides(gks, gk);
    check_status(pe_rope_table_grad(&a, gq.const_data_ptr(), gqs, gk.const_data_ptr(), gks, gdt,
                                    dcos.mutable_data_ptr(), dsin.mutable_data_ptr()),
                 "posenc::rope_table_grad");
    return {dcos, dsin};
}

// Positions (Bp, T) or (3, Bp, T) and inv_freq (R/2,) as the fused angle source.
struct PositionSource {
    Tensor pos, inv_freq;
    std::vector<uint8_t> map;
};

PositionSource position_source(pe_rope_source& src, const Tensor& position_ids,
                               const Tensor& inv_freq, IntArrayRef mrope_section,
                               bool interleaved, double scaling, int64_t B, int64_t T) {
    check_cpu(position_ids, "position_ids");
    check_cpu(inv_freq, "inv_freq");
    TORCH_CHECK(position_ids.scalar_type() == at::kLong || position_ids.scalar_type() == at::kInt,
                "position_ids must be int64 or int32, got ", position_ids.scalar_type());
    TORCH_CHECK(position_ids.dim() == 2 || position_ids.dim() == 3,
                "position_ids must be (batch, seq) or (3, batch, seq), got shape ",
                position_ids.sizes());
    if (position_ids.dim() == 3)
        TORCH_CHECK(position_ids.size(0) == 3,
                    "3-D position_ids must have 3 rows (T, H, W) in dim 0, got shape ",
                    position_ids.sizes());
    TORCH_CHECK(position_ids.dim() == 2 || !mrope_section.empty(),
                "position_ids of shape ", position_ids.sizes(),
                " (3 axes) need mrope_section to pick an axis per frequency");
    TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.size(0) >= 1,
                "inv_freq must be 1-D with at least one frequency, got shape ", inv_freq.sizes());
    TORCH_CHECK(at::isFloatingType(inv_freq.scalar_type()), "inv_freq must be floating point, got ",
                inv_freq.scalar_type());
    const int64_t Bp = position_ids.size(-2);
    TORCH_CHECK(B < 0 || Bp == 1 || Bp == B, "position_ids batch size ", Bp,
                " must be 1 or the batch size ", B);
    TORCH_CHECK(T < 0 || position_ids.size(-1) == T, "position_ids sequence length ",
                position_ids.size(-1), " must equal the sequence length of q ", T);
    const int64_t R = 2 * inv_freq.size(0);
    PositionSource ps{position_ids.to(at::kLong), inv_freq.to(at::kFloat).contiguous(),
                      axis_map(mrope_section, interleaved, R)};
    const bool three = ps.pos.dim() == 3;
    src.pos = ps.pos.const_data_ptr<int64_t>();
    src.pos_batch = Bp;
    src.pos_stride[0] = three ? ps.pos.stride(0) : 0;
    src.pos_stride[1] = ps.pos.stride(-2);
    src.pos_stride[2] = ps.pos.stride(-1);
    src.inv_freq = ps.inv_freq.const_data_ptr<float>();
    src.scaling = static_cast<float>(scaling);
    // 2-D ids: all three axes are the same row, so the axis map changes nothing.
    src.axis_of_slot = (three && !ps.map.empty()) ? ps.map.data() : nullptr;
    return ps;
}

TensorPair rope_fused_cpu(const Tensor& q_in, const Tensor& k_in, const Tensor& position_ids,
                          const Tensor& inv_freq, IntArrayRef mrope_section, bool interleaved,
                          double attention_scaling, int64_t pairing, bool transpose) {
    TORCH_CHECK(inv_freq.dim() == 1, "inv_freq must be 1-D, got shape ", inv_freq.sizes());
    pe_rope_args a = problem(q_in, k_in, 2 * inv_freq.size(0), pairing, transpose);
    to_pe_dtype(q_in, "q");
    to_pe_dtype(k_in, "k");
    PositionSource ps = position_source(a.src, position_ids, inv_freq, mrope_section, interleaved,
                                        attention_scaling, a.batch, a.seq);
    Tensor q = channel_contiguous(q_in), k = channel_contiguous(k_in);
    Tensor q_out = output_like(q_in, q_in.scalar_type());
    Tensor k_out = output_like(k_in, k_in.scalar_type());
    bind(a.q, q, q_out, "q");
    bind(a.k, k, k_out, "k");
    check_status(pe_rope_apply(&a), "posenc::rope_fused");
    return {q_out, k_out};
}

TensorPair rope_tables_cpu(const Tensor& position_ids, const Tensor& inv_freq,
                           IntArrayRef mrope_section, bool interleaved, double attention_scaling,
                           int64_t pairing, at::ScalarType dtype) {
    TORCH_CHECK(pairing == PE_PAIR_HALF || pairing == PE_PAIR_ADJACENT,
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
    auto opts = at::TensorOptions().dtype(dtype);
    Tensor cos = at::empty({a.batch, a.seq, a.rot_dim}, opts);
    Tensor sin = at::empty({a.batch, a.seq, a.rot_dim}, opts);
    check_status(pe_rope_tables(&a, odt, cos.mutable_data_ptr(), sin.mutable_data_ptr()),
                 "posenc::rope_tables");
    return {cos, sin};
}

}  // namespace

TORCH_LIBRARY(posenc, m) {
    m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, int[] mrope_section, bool interleaved, "
          "int pairing, bool transpose, ScalarType? q_dtype=None, ScalarType? k_dtype=None) "
          "-> (Tensor, Tensor)");
    m.def("rope_table_grad(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor cos, "
          "int[] mrope_section, bool interleaved, int pairing) -> (Tensor, Tensor)");
    m.def("rope_fused(Tensor q, Tensor k, Tensor position_ids, Tensor inv_freq, int[] mrope_section, "
          "bool interleaved, float attention_scaling, int pairing, bool transpose) -> (Tensor, Tensor)");
    m.def("rope_tables(Tensor position_ids, Tensor inv_freq, int[] mrope_section, bool interleaved, "
          "float attention_scaling, int pairing, ScalarType dtype) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
    m.impl("rope", &rope_cpu);
    m.impl("rope_table_grad", &rope_table_grad_cpu);
    m.impl("rope_fused", &rope_fused_cpu);
    m.impl("rope_tables", &rope_tables_cpu);
}

// ---- posenc::sinusoidal: the absolute (Vaswani) position table.  It has no tensor inputs,
// so no backend key selects a kernel: the implementation is registered under
// CompositeExplicitAutograd, which also serves calls without any dispatch key.

namespace {

Tensor sinusoidal_impl(int64_t num_positions, int64_t dim, double base, at::ScalarType dtype) {
    TORCH_CHECK(num_positions >= 0, "num_positions must be >= 0, got ", num_positions);
    TORCH_CHECK(dim >= 1, "dim must be >= 1, got ", dim);
    TORCH_CHECK(num_positions <= INT64_MAX / dim, "num_positions * dim overflows: ",
                num_positions, " * ", dim);
    TORCH_CHECK(std::isfinite(base) && base > 0.0, "base must be finite and > 0, got ", base);
    const pe_dtype odt = to_pe_dtype(dtype, "dtype");
    Tensor out = at::empty({num_positions, dim}, at::TensorOptions().dtype(dtype));
    check_status(pe_sinusoidal(num_positions, dim, base, odt, out.mutable_data_ptr(),
                               num_threads()),
                 "posenc::sinusoidal");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(posenc, m) {
    m.def("sinusoidal(SymInt num_positions, SymInt dim, float base, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
    m.impl("sinusoidal", &sinusoidal_impl);
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

PyMethodDef methods[] = {
    {"isa", py_isa, METH_NOARGS, "Name of the SIMD kernel variant in use."},
    {"best_isa", py_best_isa, METH_NOARGS, "Name of the best SIMD variant this CPU supports."},
    {"set_isa", py_set_isa, METH_O, "Force a SIMD variant: 'baseline', 'avx2' or 'avx512'."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "posenc_torch C kernels (torch.ops.posenc).",
                          -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }

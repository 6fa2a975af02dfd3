// The posenc op library and the posenc_torch._C module.  The schemas of every op and the
// kernel for each dispatch key are registered here (the bodies are in rope.cpp,
// positions.cpp, vision.cpp, qk_norm.cpp and sinusoidal.cpp); the module is created with
// the limited Python C API, and importing it runs these registrations.  The shim uses only the LibTorch
// stable ABI (stable_support.h), so one binary serves every torch from the target version on.
#include <Python.h>

#include <string>

#include "shim.h"

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
    m.def("qk_norm_rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor q_weight, "
          "Tensor k_weight, float eps, int form, int pairing, int sum_lanes, bool heads_first) "
          "-> (Tensor, Tensor, Tensor, Tensor)");
    m.def("qk_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, Tensor cos, "
          "Tensor sin, Tensor q_weight, Tensor k_weight, Tensor q_rstd, Tensor k_rstd, float eps, "
          "int form, int pairing, int sum_lanes, bool heads_first, Tensor? q_pow=None, "
          "Tensor? k_pow=None) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("sinusoidal(SymInt num_positions, SymInt dim, float base, ScalarType dtype) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(posenc, CPU, m) {
    m.impl("rope", TORCH_BOX(&posenc::rope_impl));
    m.impl("rope_table_grad", TORCH_BOX(&posenc::rope_table_grad_impl));
    m.impl("rope_fused", TORCH_BOX(&posenc::rope_fused_impl));
    m.impl("rope_tables", TORCH_BOX(&posenc::rope_tables_impl));
    m.impl("mrope_position_ids", TORCH_BOX(&posenc::mrope_position_ids_cpu));
    m.impl("mrope_packed_position_ids", TORCH_BOX(&posenc::mrope_packed_position_ids_cpu));
    m.impl("vision_position_ids", TORCH_BOX(&posenc::vision_position_ids_cpu));
    m.impl("vision_cu_seqlens", TORCH_BOX(&posenc::vision_cu_seqlens_cpu));
    m.impl("vision_window_index", TORCH_BOX(&posenc::vision_window_index_cpu));
    m.impl("vision_interpolation", TORCH_BOX(&posenc::vision_interpolation_cpu));
    m.impl("vision_nearest_position_ids", TORCH_BOX(&posenc::vision_nearest_position_ids_cpu));
    m.impl("qk_norm_rope", TORCH_BOX(&posenc::qk_norm_rope_impl));
    m.impl("qk_norm_rope_backward", TORCH_BOX(&posenc::qk_norm_rope_backward_impl));
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
    for (int i = PE_ISA_BASELINE; i <= PE_ISA_AVX512_BF16; ++i) {
        if (std::string(name) == pe_isa_name(static_cast<pe_isa>(i))) {
            if (pe_isa_set(static_cast<pe_isa>(i)) != PE_OK) {
                PyErr_Format(PyExc_ValueError, "this CPU does not support the '%s' kernels", name);
                return nullptr;
            }
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "isa must be 'baseline', 'avx2', 'avx512' or 'avx512bf16', got '%s'", name);
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
    {"set_isa", py_set_isa, METH_O, "Force a SIMD variant: 'baseline', 'avx2', 'avx512' or 'avx512bf16'."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "posenc_torch C kernels (torch.ops.posenc).",
                          -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }

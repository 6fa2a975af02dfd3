// What the files of the shim share: the op bodies that module.cpp registers, the checks
// every op makes, and the checked arguments of the position-id ops that
// position_errors.cpp turns into messages.
//
//   rope.cpp             posenc::rope, rope_table_grad, rope_fused, rope_tables (CPU, CUDA)
//   positions.cpp        posenc::mrope_position_ids, mrope_packed_position_ids
//   position_errors.cpp  the ValueErrors of the position-id walks, in the arguments' names
//   vision.cpp           posenc::vision_* (the vision towers' index tensors)
//   qk_norm.cpp          posenc::qk_norm_rope, qk_norm_rope_backward (CPU)
//   sinusoidal.cpp       posenc::sinusoidal
//   module.cpp           the schemas, the kernels per dispatch key, posenc_torch._C
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "stable_support.h"
#ifdef POSENC_WITH_CUDA
#include "posenc_cuda.h"
#endif

namespace posenc {

using TensorPair = std::tuple<Tensor, Tensor>;

// ---- The op bodies.  The rotation ops' *_impl serve the CPU and, after the device check
// of their *_cuda entry point, CUDA; the *_cpu ones are registered for the CPU only.

TensorPair rope_impl(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                     IntList mrope_section, bool interleaved, int64_t pairing, bool transpose,
                     std::optional<ScalarType> q_dtype, std::optional<ScalarType> k_dtype,
                     bool heads_first);
TensorPair rope_table_grad_impl(const Tensor& grad_q, const Tensor& grad_k, const Tensor& q,
                                const Tensor& k, const Tensor& cos, IntList mrope_section,
                                bool interleaved, int64_t pairing);
TensorPair rope_fused_impl(const Tensor& q, const Tensor& k, const Tensor& position_ids,
                           const Tensor& inv_freq, IntList mrope_section, bool interleaved,
                           double attention_scaling, int64_t pairing, bool transpose,
                           bool heads_first);
TensorPair rope_tables_impl(const Tensor& position_ids, const Tensor& inv_freq,
                            IntList mrope_section, bool interleaved, double attention_scaling,
                            int64_t pairing, ScalarType dtype);
#ifdef POSENC_WITH_CUDA
TensorPair rope_cuda(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                     IntList mrope_section, bool interleaved, int64_t pairing, bool transpose,
                     std::optional<ScalarType> q_dtype, std::optional<ScalarType> k_dtype,
                     bool heads_first);
TensorPair rope_table_grad_cuda(const Tensor& grad_q, const Tensor& grad_k, const Tensor& q,
                                const Tensor& k, const Tensor& cos, IntList mrope_section,
                                bool interleaved, int64_t pairing);
TensorPair rope_fused_cuda(const Tensor& q, const Tensor& k, const Tensor& position_ids,
                           const Tensor& inv_freq, IntList mrope_section, bool interleaved,
                           double attention_scaling, int64_t pairing, bool transpose,
                           bool heads_first);
TensorPair rope_tables_cuda(const Tensor& position_ids, const Tensor& inv_freq,
                            IntList mrope_section, bool interleaved, double attention_scaling,
                            int64_t pairing, ScalarType dtype);
#endif

TensorPair mrope_position_ids_cpu(
    const Tensor& input_ids, const std::optional<Tensor>& image_grid_thw,
    const std::optional<Tensor>& video_grid_thw, const std::optional<Tensor>& attention_mask,
    const std::optional<Tensor>& second_per_grid_ts, int64_t model, int64_t image_token_id,
    int64_t video_token_id, int64_t vision_start_token_id, int64_t spatial_merge_size,
    double tokens_per_second, const std::optional<Tensor>& mm_token_type_ids, int64_t rules,
    int64_t time_rule);
Tensor mrope_packed_position_ids_cpu(
    const Tensor& input_ids, const Tensor& example_lens, const Tensor& row_examples,
    const std::optional<Tensor>& image_grid_thw, const std::optional<Tensor>& video_grid_thw,
    const std::optional<Tensor>& second_per_grid_ts, int64_t model, int64_t image_token_id,
    int64_t video_token_id, int64_t vision_start_token_id, int64_t spatial_merge_size,
    double tokens_per_second, const std::optional<Tensor>& mm_token_type_ids, int64_t rules,
    int64_t time_rule, const std::optional<Tensor>& example_ids,
    const std::optional<Tensor>& example_grids);

Tensor vision_position_ids_cpu(const Tensor& grid_thw, int64_t spatial_merge_size,
                               const std::optional<Tensor>& merge_sizes, bool include_temporal);
TensorPair vision_cu_seqlens_cpu(const Tensor& grid_thw, bool merge_temporal);
TensorPair vision_window_index_cpu(const Tensor& grid_thw, int64_t spatial_merge_size,
                                   int64_t window_size, int64_t patch_size);
TensorPair vision_interpolation_cpu(const Tensor& grid_thw, int64_t num_grid_per_side,
                                    int64_t mode, bool align_corners, int64_t spatial_merge_size,
                                    int64_t padding, int64_t rule);
Tensor vision_nearest_position_ids_cpu(const Tensor& target_sizes, int64_t num_patches_per_side);

Tensor sinusoidal_impl(int64_t num_positions, int64_t dim, double base, ScalarType dtype);

std::tuple<Tensor, Tensor, Tensor, Tensor> qk_norm_rope_impl(
    const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
    const Tensor& q_weight, const Tensor& k_weight, double eps, int64_t form, int64_t pairing,
    int64_t sum_lanes, bool heads_first);
std::tuple<Tensor, Tensor, Tensor, Tensor> qk_norm_rope_backward_impl(
    const Tensor& grad_q, const Tensor& grad_k, const Tensor& q, const Tensor& k,
    const Tensor& cos, const Tensor& sin, const Tensor& q_weight, const Tensor& k_weight,
    const Tensor& q_rstd, const Tensor& k_rstd, double eps, int64_t form, int64_t pairing,
    int64_t sum_lanes, bool heads_first, const std::optional<Tensor>& q_pow,
    const std::optional<Tensor>& k_pow);

// ---- Checks shared by the ops.

// `t` (described by m) is on a device whose kernels are built in: the CPU, or CUDA when
// the CUDA kernels are (only the *_cuda entry points pass CUDA tensors: cuda_inputs).
inline void check_kernel_device(const Meta& m, const Tensor& t, const char* name) {
#ifdef POSENC_WITH_CUDA
    if (m.device_type == aoti_torch_device_type_cuda()) return;
#endif
    PE_CHECK_VALUE(m.is_cpu(), name, " must be a CPU tensor, got device ", DeviceName{t});
}

inline void check_kernel_device(const Tensor& t, const char* name) {
    check_kernel_device(Meta(t), t, name);
}

inline void check_status(int rc, const char* op) {
    PE_CHECK(rc != PE_ERR_NOMEM, op, ": out of memory for scratch buffers");
#ifdef POSENC_WITH_CUDA
    PE_CHECK(rc != PE_ERR_CUDA, op, ": CUDA kernel launch failed: ", pe_cuda_last_error());
#endif
    // an argument the C API refuses past the shim's own checks (e.g. the CUDA width limit)
    PE_CHECK_VALUE(rc == PE_OK, op, ": the kernel rejected its arguments (status ", rc, ")");
}

inline void check_integer(const Tensor& t, const char* name) {
    PE_CHECK_TYPE(is_integral(t.scalar_type()), name,
                   " must be an integer tensor (int64 or int32), got ", t.scalar_type());
}

// (n, 3) integer grids -> contiguous int64.
inline std::optional<Tensor> grid_tensor(const std::optional<Tensor>& g, const char* name) {
    if (!g.has_value()) return std::nullopt;
    const Tensor& t = *g;
    check_kernel_device(t, name);
    check_integer(t, name);
    PE_CHECK_VALUE(t.dim() == 2 && t.size(1) == 3, name,
                   " must have shape (num_grids, 3) of (t, h, w) patch counts, got shape ",
                   shape(t));
    Tensor out = converted(t, ScalarType::Long);
    return out.is_contiguous() ? out : torch::stable::contiguous(out);
}

// Row i of (n, 3) int64 grids as "(t, h, w)", or "?" past its rows.
inline std::string grid_text(const std::optional<Tensor>& grids, int64_t i) {
    if (!grids.has_value() || i < 0 || i >= grids->size(0)) return "?";
    const int64_t* g = grids->const_data_ptr<int64_t>() + 3 * i;
    return cat("(", g[0], ", ", g[1], ", ", g[2], ")");
}

// A 1-D integer tensor as contiguous int64.
inline Tensor lengths_tensor(const Tensor& t, const char* name) {
    check_kernel_device(t, name);
    check_integer(t, name);
    PE_CHECK_VALUE(t.dim() == 1, name, " must be 1-D, got shape ", shape(t));
    Tensor out = converted(t, ScalarType::Long);
    return out.is_contiguous() ? out : torch::stable::contiguous(out);
}

// ---- Position ids: what positions.cpp hands to the messages of position_errors.cpp.

// The checked arguments of the position-id ops as C arguments; the tensors own the memory
// that `a` points into.
struct MropeInputs {
    Tensor input_ids;
    std::optional<Tensor> mask, types, images, videos, seconds;
    pe_mrope_args a;
    bool v5;
};

// How the messages of the packed op name the examples: "example e" (e counted across the
// batch), or the caller's own "examples[i]" with example_ids.
struct ExampleNames {
    std::optional<Tensor> ids;  // (N,) contiguous int64
    std::string operator()(int64_t e) const {
        if (!ids.has_value()) return cat("example ", e);
        return cat("examples[", ids->const_data_ptr<int64_t>()[e], "]");
    }
};

// Turns a pe_pos_error into a ValueError that names the argument at fault.  Grid row g of
// the message is row g + grid_shift of `images` / `videos` (a packed example's own grids
// are numbered from 0).
[[noreturn]] void raise_position_error(const pe_pos_error& e, int rc,
                                       const std::optional<Tensor>& images,
                                       const std::optional<Tensor>& videos, int64_t merge,
                                       int64_t model, bool v5, int64_t grid_shift = 0);

// Turns the error of the packed walk into a ValueError that names the example at fault
// and where it lies (with example_grids, `owned`, as the walk of that example alone
// reports it).  lens, rows: example_lens and row_examples as contiguous int64.
[[noreturn]] void raise_packed_error(pe_pos_error e, int rc, const MropeInputs& in,
                                     const Tensor& lens, const Tensor& rows,
                                     const std::optional<Tensor>& owned,
                                     const ExampleNames& name, int64_t merge, int64_t model);

}  // namespace posenc

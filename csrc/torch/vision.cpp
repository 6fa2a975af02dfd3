// posenc::vision_* : the vision towers' position ids, attention boundaries, window order
// and interpolation taps from the grids (posenc.h, "Vision towers"): grids (n, 3) in,
// index tensors out.
#include <string>

#include "shim.h"

namespace posenc {
namespace {

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

}  // namespace

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
    check_kernel_device(target_sizes, "target_sizes");
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

}  // namespace posenc

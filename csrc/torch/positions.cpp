// posenc::mrope_position_ids and posenc::mrope_packed_position_ids: the MRoPE position
// ids of get_rope_index, for padded batches and for packed rows.  Integer tensors in, int64
// out; not differentiable.  The walks' failures become ValueErrors in position_errors.cpp.
#include <cmath>

#include "shim.h"

namespace posenc {
namespace {

const char* const kModelNames[] = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"};

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

// Checks the arguments of the position-id ops and converts them for the C walk.
MropeInputs mrope_inputs(
    const Tensor& input_ids_in, const std::optional<Tensor>& image_grid_thw,
    const std::optional<Tensor>& video_grid_thw, const std::optional<Tensor>& attention_mask,
    const std::optional<Tensor>& second_per_grid_ts, int64_t model, int64_t image_token_id,
    int64_t video_token_id, int64_t vision_start_token_id, int64_t spatial_merge_size,
    double tokens_per_second, const std::optional<Tensor>& mm_token_type_ids, int64_t rules,
    int64_t time_rule) {
    check_kernel_device(input_ids_in, "input_ids");
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
        check_kernel_device(m, "attention_mask");
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
        check_kernel_device(t, "mm_token_type_ids");
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
        check_kernel_device(s, "second_per_grid_ts");
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

}  // namespace

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
    const int rc = pe_mrope_position_ids(&in.a, pos.mutable_data_ptr<int64_t>(),
                                         deltas.mutable_data_ptr<int64_t>(), &err);
    if (rc != PE_OK)
        raise_position_error(err, rc, in.images, in.videos, spatial_merge_size, model, in.v5);
    return {pos, deltas};
}

// ---- Packed rows: example_lens (N,) and row_examples (B,) say where the examples lie
// (posenc.h, pe_mrope_packed_position_ids).

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
        check_kernel_device(g, "example_grids");
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

}  // namespace posenc

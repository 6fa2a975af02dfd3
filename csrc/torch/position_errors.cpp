// The ValueErrors of the position-id walks: a pe_pos_error (posenc.h) said in the names of
// the op's arguments, and for packed rows in the names of the example at fault and where
// it lies.
#include <stdexcept>
#include <string>

#include "shim.h"

namespace posenc {

[[noreturn]] void raise_position_error(const pe_pos_error& e, int rc,
                                       const std::optional<Tensor>& images,
                                       const std::optional<Tensor>& videos, int64_t merge,
                                       int64_t model, bool v5, int64_t grid_shift) {
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

namespace {

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

}  // namespace

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

}  // namespace posenc

/*
 * Torch-free tests of the position-id kernels: the worked examples of the specification in
 * posenc.h, random batches against literal re-implementations of the token walk (4.57:
 * search for the next placeholder from a cursor; 5.x: groups of equal mm_token_type_ids),
 * threaded against serial, the temporal rules of Qwen2.5-VL, and every kind of bad grid.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "posenc.h"
#include "check.h"

static unsigned rng_state = 4242u;

enum { VS = 151652, VE = 151653, IMG = 151655, VID = 151656, PAD = 151643 };

static unsigned rnd(unsigned n) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return (rng_state >> 8) % n;
}

static pe_mrope_args base_args(pe_mrope_model model, int64_t B, int64_t L, const int64_t *ids) {
    pe_mrope_args a;
    memset(&a, 0, sizeof a);
    a.batch = B;
    a.seq = L;
    a.input_ids = ids;
    a.ids_row_stride = L;
    a.mask_row_stride = L;
    a.has_grids = 1;
    a.model = model;
    a.image_token_id = IMG;
    a.video_token_id = VID;
    a.vision_start_token_id = VS;
    a.spatial_merge_size = 2;
    a.tokens_per_second = 2.0;
    a.nthreads = 1;
    return a;
}

static void expect_row(const char *what, const int64_t *got, const int64_t *want, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if (got[i] != want[i]) {
            CHECK(0, "%s: index %lld is %lld, expected %lld", what, (long long)i,
                  (long long)got[i], (long long)want[i]);
            return;
        }
    }
}

/* ---- worked examples ------------------------------------------------------------------ */

static void example_image(void) {
    const int64_t ids[8] = {1, VS, IMG, IMG, IMG, IMG, VE, 2};
    const int64_t grid[3] = {1, 4, 4};
    const int64_t T[8] = {0, 1, 2, 2, 2, 2, 4, 5}, H[8] = {0, 1, 2, 2, 3, 3, 4, 5},
                  W[8] = {0, 1, 2, 3, 2, 3, 4, 5};
    for (int model = 0; model < 3; ++model) {
        pe_mrope_args a = base_args((pe_mrope_model)model, 1, 8, ids);
        a.image_grid_thw = grid;
        a.n_images = 1;
        int64_t pos[24], delta = 0;
        pe_pos_error e;
        CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_OK, "image example, model %d", model);
        expect_row("image example T", pos, T, 8);
        expect_row("image example H", pos + 8, H, 8);
        expect_row("image example W", pos + 16, W, 8);
        CHECK(delta == -2, "image example delta %lld", (long long)delta);
    }
    /* The same tokens without a vision start: no item, the placeholders are stray. */
    const int64_t ids2[8] = {1, 3, IMG, IMG, IMG, IMG, VE, 2};
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_VL, 1, 8, ids2);
    a.image_grid_thw = grid;
    a.n_images = 1;
    int64_t pos[24], delta;
    pe_pos_error e;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_GRID &&
              e.problem == PE_POS_GRID_COUNT && e.found == 0 && e.expected == 1 && e.video == 0,
          "placeholders without vision start: problem %d", e.problem);
}

static void example_left_padding(void) {
    const int64_t ids[10] = {PAD, PAD, 1, VS, IMG, IMG, IMG, IMG, VE, 2};
    const int64_t mask[10] = {0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    const int64_t grid[3] = {1, 4, 4};
    const int64_t T[10] = {1, 1, 0, 1, 2, 2, 2, 2, 4, 5}, H[10] = {1, 1, 0, 1, 2, 2, 3, 3, 4, 5},
                  W[10] = {1, 1, 0, 1, 2, 3, 2, 3, 4, 5};
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_VL, 1, 10, ids);
    a.attention_mask = mask;
    a.image_grid_thw = grid;
    a.n_images = 1;
    int64_t pos[30], delta;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "left padding");
    expect_row("left padding T", pos, T, 10);
    expect_row("left padding H", pos + 10, H, 10);
    expect_row("left padding W", pos + 20, W, 10);
    CHECK(delta == -4, "left padding delta %lld", (long long)delta);
}

static void example_qwen25_video(void) {
    int64_t ids[16] = {1, VS};
    for (int i = 0; i < 12; ++i) ids[2 + i] = VID;
    ids[14] = VE;
    ids[15] = 2;
    const int64_t grid[3] = {3, 4, 4};
    const double secs[1] = {2.0};
    const int64_t T[16] = {0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 11, 12};
    const int64_t H[16] = {0, 1, 2, 2, 3, 3, 2, 2, 3, 3, 2, 2, 3, 3, 11, 12};
    const int64_t W[16] = {0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 11, 12};
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_5_VL, 1, 16, ids);
    a.video_grid_thw = grid;
    a.n_videos = 1;
    a.second_per_grid_ts = secs;
    int64_t pos[48], delta;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "qwen2.5 video");
    expect_row("qwen2.5 video T", pos, T, 16);
    expect_row("qwen2.5 video H", pos + 16, H, 16);
    expect_row("qwen2.5 video W", pos + 32, W, 16);
    CHECK(delta == -3, "qwen2.5 video delta %lld", (long long)delta);

    /* 0.5 s per grid (4 fps): the fraction is kept, steps trunc(k * 0.5 * 2) = k. */
    const double half[1] = {0.5};
    a.second_per_grid_ts = half;
    const int64_t T2[16] = {0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 6};
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "qwen2.5 video 0.5 s");
    expect_row("qwen2.5 video 0.5 s T", pos, T2, 16);
    CHECK(delta == -9, "qwen2.5 video 0.5 s delta %lld", (long long)delta);
    /* 0.25 s per grid: steps trunc(0.5 k) = 0, 0, 1; the row continues after max(1, 1, 1). */
    const double quarter[1] = {0.25};
    a.second_per_grid_ts = quarter;
    const int64_t T3[16] = {0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 4, 5};
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "qwen2.5 video 0.25 s");
    expect_row("qwen2.5 video 0.25 s T", pos, T3, 16);
    /* No second_per_grid_ts: 1 s per grid. */
    a.second_per_grid_ts = NULL;
    const int64_t T4[16] = {0, 1, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6, 7, 8};
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "qwen2.5 video 1 s");
    expect_row("qwen2.5 video 1 s T", pos, T4, 16);
    /* Qwen2-VL: the plain frame index. */
    a.model = PE_MROPE_QWEN2_VL;
    const int64_t T5[16] = {0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 6};
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "qwen2 video");
    expect_row("qwen2 video T", pos, T5, 16);
}

static void example_qwen3_frames(void) {
    const int64_t ids[18] = {11, 12, 13, VS, VID, VID, VID, VID, VE,
                             14, 15, 16, VS, VID, VID, VID, VID, VE};
    const int64_t grid[3] = {2, 4, 4};
    const int64_t T[18] = {0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8, 9, 10, 11, 11, 11, 11, 13};
    const int64_t H[18] = {0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8, 9, 10, 11, 11, 12, 12, 13};
    const int64_t W[18] = {0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 11, 12, 11, 12, 13};
    pe_mrope_args a = base_args(PE_MROPE_QWEN3_VL, 1, 18, ids);
    a.video_grid_thw = grid;
    a.n_videos = 1;
    int64_t pos[54], delta;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "qwen3 frames");
    expect_row("qwen3 frames T", pos, T, 18);
    expect_row("qwen3 frames H", pos + 18, H, 18);
    expect_row("qwen3 frames W", pos + 36, W, 18);
    CHECK(delta == -4, "qwen3 frames delta %lld", (long long)delta);
    /* Qwen2-VL reads the same grid as one video of 2 frames: 8 tokens in one run. */
    a.model = PE_MROPE_QWEN2_VL;
    pe_pos_error e;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_GRID &&
              e.problem == PE_POS_GRID_COUNT && e.video == 1 && e.found == 2 && e.expected == 1,
          "qwen2 reading per-frame runs: problem %d", e.problem);
}

static void example_no_grids(void) {
    const int64_t ids[2 * 5] = {PAD, PAD, 1, 2, 3, 1, 2, 3, 4, 5};
    const int64_t mask[2 * 5] = {0, 0, 1, 1, 1, 1, 1, 1, 1, 0};
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_VL, 2, 5, ids);
    a.has_grids = 0;
    int64_t pos[30], delta[2];
    CHECK(pe_mrope_position_ids(&a, pos, delta, NULL) == PE_OK, "no grids, no mask");
    const int64_t ar[10] = {0, 1, 2, 3, 4, 0, 1, 2, 3, 4};
    for (int r = 0; r < 3; ++r) expect_row("arange", pos + 10 * r, ar, 10);
    CHECK(delta[0] == 0 && delta[1] == 0, "no mask deltas");
    a.attention_mask = mask;
    CHECK(pe_mrope_position_ids(&a, pos, delta, NULL) == PE_OK, "no grids, mask");
    const int64_t cs[10] = {1, 1, 0, 1, 2, 0, 1, 2, 3, 1};
    for (int r = 0; r < 3; ++r) expect_row("cumsum", pos + 10 * r, cs, 10);
    CHECK(delta[0] == -2 && delta[1] == -1, "mask deltas %lld %lld", (long long)delta[0],
          (long long)delta[1]);
    /* One kept token: the padded slots' 1 is the row maximum (transformers' formula). */
    const int64_t mask1[10] = {0, 0, 0, 0, 1, 0, 0, 0, 0, 0};
    a.attention_mask = mask1;
    CHECK(pe_mrope_position_ids(&a, pos, delta, NULL) == PE_OK, "no grids, sparse mask");
    CHECK(delta[0] == -3 && delta[1] == -3, "sparse mask deltas %lld %lld",
          (long long)delta[0], (long long)delta[1]);
    /* With grids given (empty lists) the same rows walk: delta from kept tokens only. */
    a.has_grids = 1;
    CHECK(pe_mrope_position_ids(&a, pos, delta, NULL) == PE_OK, "empty grids, sparse mask");
    CHECK(delta[0] == -4 && delta[1] == -5, "walk deltas %lld %lld", (long long)delta[0],
          (long long)delta[1]);
    CHECK(pos[4] == 0 && pos[0] == 1 && pos[5] == 1, "walk positions");
    /* Empty batches need no buffers. */
    pe_mrope_args none = base_args(PE_MROPE_QWEN2_VL, 0, 5, NULL);
    CHECK(pe_mrope_position_ids(&none, NULL, NULL, NULL) == PE_OK, "empty batch");
    none = base_args(PE_MROPE_QWEN2_VL, 2, 0, NULL);
    CHECK(pe_mrope_position_ids(&none, NULL, delta, NULL) == PE_OK && delta[0] == 0 &&
              delta[1] == 0, "empty rows");
    /* A vision item without grids is an error. */
    const int64_t ids3[4] = {1, VS, IMG, VE};
    pe_mrope_args b = base_args(PE_MROPE_QWEN3_VL, 1, 4, ids3);
    b.has_grids = 0;
    pe_pos_error e;
    CHECK(pe_mrope_position_ids(&b, pos, delta, &e) == PE_ERR_GRID && e.problem == PE_POS_NO_GRIDS &&
              e.row == 0 && e.token == 2,
          "vision item without grids: problem %d", e.problem);
}

/* ---- transformers 5.x rules ----------------------------------------------------------- */

/* Types as the 5.x processors give them for ids laid out as by the 4.57 processors. */
static void types_of(const int64_t *ids, int64_t n, int64_t *types) {
    for (int64_t i = 0; i < n; ++i) types[i] = ids[i] == IMG ? 1 : ids[i] == VID ? 2 : 0;
}

static pe_mrope_args v5_args(pe_mrope_model model, int64_t B, int64_t L, const int64_t *types) {
    pe_mrope_args a = base_args(model, B, L, NULL);
    a.rules = PE_MROPE_RULES_5;
    a.mm_token_type_ids = types;
    a.types_row_stride = L;
    a.image_token_id = a.video_token_id = a.vision_start_token_id = 0; /* not read */
    return a;
}

static void v5_examples(void) {
    int64_t types[18], pos[54], delta;
    pe_pos_error e;
    /* Example 1 */
    const int64_t ids1[8] = {1, VS, IMG, IMG, IMG, IMG, VE, 2};
    const int64_t grid1[3] = {1, 4, 4};
    const int64_t T1[8] = {0, 1, 2, 2, 2, 2, 4, 5}, H1[8] = {0, 1, 2, 2, 3, 3, 4, 5},
                  W1[8] = {0, 1, 2, 3, 2, 3, 4, 5};
    types_of(ids1, 8, types);
    for (int model = 0; model < 3; ++model) {
        pe_mrope_args a = v5_args((pe_mrope_model)model, 1, 8, types);
        a.image_grid_thw = grid1;
        a.n_images = 1;
        CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_OK, "5.x image, model %d", model);
        expect_row("5.x image T", pos, T1, 8);
        expect_row("5.x image H", pos + 8, H1, 8);
        expect_row("5.x image W", pos + 16, W1, 8);
        CHECK(delta == -2, "5.x image delta %lld", (long long)delta);
    }
    /* Example 4: left padding */
    const int64_t ids4[10] = {PAD, PAD, 1, VS, IMG, IMG, IMG, IMG, VE, 2};
    const int64_t mask4[10] = {0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    const int64_t T4[10] = {0, 0, 0, 1, 2, 2, 2, 2, 4, 5};
    types_of(ids4, 10, types);
    types[0] = 9; /* a masked slot's type is not read */
    pe_mrope_args a = v5_args(PE_MROPE_QWEN2_VL, 1, 10, types);
    a.attention_mask = mask4;
    a.image_grid_thw = grid1;
    a.n_images = 1;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_OK, "5.x left padding %d", e.problem);
    expect_row("5.x left padding T", pos, T4, 10);
    CHECK(delta == -2, "5.x left padding delta %lld", (long long)delta);
    /* Example 5: a video with more frames than rows and columns */
    const int64_t ids5[8] = {1, VS, VID, VID, VID, VID, VE, 2};
    const int64_t grid5[3] = {4, 2, 2};
    const int64_t T5[8] = {0, 1, 2, 3, 4, 5, 3, 4}, H5[8] = {0, 1, 2, 2, 2, 2, 3, 4};
    const int64_t T5old[8] = {0, 1, 2, 3, 4, 5, 6, 7}, H5old[8] = {0, 1, 2, 2, 2, 2, 6, 7};
    types_of(ids5, 8, types);
    a = v5_args(PE_MROPE_QWEN2_VL, 1, 8, types);
    a.video_grid_thw = grid5;
    a.n_videos = 1;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_OK, "5.x video");
    expect_row("5.x video T", pos, T5, 8);
    expect_row("5.x video H", pos + 8, H5, 8);
    expect_row("5.x video W", pos + 16, H5, 8);
    CHECK(delta == -2, "5.x video delta %lld", (long long)delta);
    pe_mrope_args o = base_args(PE_MROPE_QWEN2_VL, 1, 8, ids5);
    o.video_grid_thw = grid5;
    o.n_videos = 1;
    CHECK(pe_mrope_position_ids(&o, pos, &delta, &e) == PE_OK, "4.57 video");
    expect_row("4.57 video T", pos, T5old, 8);
    expect_row("4.57 video H", pos + 8, H5old, 8);
    CHECK(delta == 0, "4.57 video delta %lld", (long long)delta);
    /* Example 2 under 5.x: the text resumes at 2 + max(2, 2) */
    int64_t ids2[16] = {1, VS};
    for (int i = 0; i < 12; ++i) ids2[2 + i] = VID;
    ids2[14] = VE, ids2[15] = 2;
    const int64_t grid2[3] = {3, 4, 4};
    const double secs2[1] = {2.0};
    const int64_t T2[16] = {0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 4, 5};
    types_of(ids2, 16, types);
    for (int rule = 0; rule < 4; ++rule) {
        a = v5_args(PE_MROPE_QWEN2_5_VL, 1, 16, types);
        a.video_grid_thw = grid2;
        a.n_videos = 1;
        a.second_per_grid_ts = secs2;
        a.time_rule = (pe_mrope_time)rule;
        CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_OK, "5.x qwen2.5 video");
        expect_row("5.x qwen2.5 video T", pos, T2, 16);
        CHECK(delta == -5, "5.x qwen2.5 delta %lld", (long long)delta);
    }
    /* Example 3 (Qwen3-VL frames): the same under both rule sets */
    const int64_t ids3[18] = {11, 12, 13, VS, VID, VID, VID, VID, VE,
                              14, 15, 16, VS, VID, VID, VID, VID, VE};
    const int64_t T3[18] = {0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8, 9, 10, 11, 11, 11, 11, 13};
    const int64_t grid3[3] = {2, 4, 4};
    types_of(ids3, 18, types);
    a = v5_args(PE_MROPE_QWEN3_VL, 1, 18, types);
    a.video_grid_thw = grid3;
    a.n_videos = 1;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_OK, "5.x qwen3 frames");
    expect_row("5.x qwen3 frames T", pos, T3, 18);
    CHECK(delta == -4, "5.x qwen3 delta %lld", (long long)delta);
    /* Two images without text between them form one run: the rest of it is stray. */
    const int64_t t2[10] = {0, 1, 1, 1, 1, 1, 1, 1, 1, 0};
    const int64_t g2[6] = {1, 4, 4, 1, 4, 4};
    a = v5_args(PE_MROPE_QWEN2_VL, 1, 10, t2);
    a.image_grid_thw = g2;
    a.n_images = 2;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_GRID &&
              e.problem == PE_POS_GRID_COUNT && e.found == 1 && e.expected == 2,
          "5.x merged runs: problem %d", e.problem);
    a.n_images = 1;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_GRID &&
              e.problem == PE_POS_STRAY_TOKEN && e.token == 5,
          "5.x run longer than grid: problem %d token %lld", e.problem, (long long)e.token);
    /* An image run that turns into a video run is short. */
    const int64_t t3[8] = {0, 1, 1, 2, 2, 0, 0, 0};
    a = v5_args(PE_MROPE_QWEN2_VL, 1, 8, t3);
    a.image_grid_thw = grid1;
    a.n_images = 1;
    const int64_t gv[3] = {1, 2, 4};
    a.video_grid_thw = gv;
    a.n_videos = 1;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_GRID &&
              e.problem == PE_POS_SHORT_RUN && e.token == 1 && e.found == 2,
          "5.x image run cut by a video: problem %d", e.problem);
    /* Bad type values, missing types, no grids */
    const int64_t t4[4] = {0, 3, 0, 0};
    a = v5_args(PE_MROPE_QWEN2_VL, 1, 4, t4);
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_ARG &&
              e.problem == PE_POS_BAD_TYPE && e.token == 1 && e.found == 3,
          "5.x type 3: problem %d", e.problem);
    a.mm_token_type_ids = NULL;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_ARG, "5.x without types");
    a.has_grids = 0; /* without grids the types may be absent: plain positions */
    const int64_t m4[4] = {0, 1, 1, 0};
    a.attention_mask = m4;
    const int64_t P4[4] = {0, 0, 1, 0};
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_OK && delta == 0, "5.x no grids");
    expect_row("5.x no grids", pos, P4, 4);
    const int64_t t5[4] = {0, 1, 0, 0};
    a.mm_token_type_ids = t5;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_GRID &&
              e.problem == PE_POS_NO_GRIDS && e.token == 1, "5.x vision without grids");
    a.rules = (pe_mrope_rules)2;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, &e) == PE_ERR_ARG, "unknown rules");
}

/* Example 6 and the temporal rules against their formulas. */
static void time_rules(void) {
    const int64_t types[10] = {0, 2, 2, 2, 2, 2, 2, 2, 2, 0};
    const int64_t grid[3] = {8, 2, 2};
    int64_t pos[30], delta;
    pe_mrope_args a = v5_args(PE_MROPE_QWEN2_5_VL, 1, 10, types);
    a.video_grid_thw = grid;
    a.n_videos = 1;
    const double half[1] = {0.5}, third[1] = {2.0 / 3.0};
    a.second_per_grid_ts = half;
    const int64_t trunc_half[8] = {0, 0, 0, 0, 0, 0, 0, 0}, keep_half[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const pe_mrope_time rules[4] = {PE_TIME_F64, PE_TIME_TRUNC_SECONDS, PE_TIME_F32,
                                    PE_TIME_F64_INTERVAL};
    for (int r = 0; r < 4; ++r) {
        a.time_rule = rules[r];
        CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "time rule %d", r);
        int64_t want[8];
        for (int k = 0; k < 8; ++k)
            want[k] = 1 + (rules[r] == PE_TIME_TRUNC_SECONDS ? trunc_half[k] : keep_half[k]);
        expect_row("0.5 s per grid", pos + 1, want, 8);
    }
    a.second_per_grid_ts = third;
    a.tokens_per_second = 25;
    const int64_t f32[8] = {0, 16, 33, 50, 66, 83, 100, 116};
    const int64_t f64[8] = {0, 16, 33, 49, 66, 83, 99, 116};
    a.time_rule = PE_TIME_F32;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "f32 2/3");
    int64_t want[8];
    for (int k = 0; k < 8; ++k) want[k] = 1 + f32[k];
    expect_row("f32 25 * 2/3", pos + 1, want, 8);
    CHECK(delta == 1 + 116 + 1 - 10, "f32 delta %lld", (long long)delta);
    a.time_rule = PE_TIME_F64_INTERVAL;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "f64 2/3");
    for (int k = 0; k < 8; ++k) want[k] = 1 + f64[k];
    expect_row("f64 25 * 2/3", pos + 1, want, 8);
    /* int(s) with integral and fractional tokens_per_second (4.57: float32 product) */
    const double s15[1] = {1.5};
    a.second_per_grid_ts = s15;
    a.time_rule = PE_TIME_TRUNC_SECONDS;
    a.tokens_per_second = 3;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "trunc 1.5 s");
    for (int k = 0; k < 8; ++k) want[k] = 1 + 3 * k;
    expect_row("trunc 1.5 s, 3 tokens/s", pos + 1, want, 8);
    a.tokens_per_second = 0.1;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_OK, "trunc 0.1 tokens/s");
    for (int k = 0; k < 8; ++k) want[k] = 1 + (int64_t)((float)k * 0.1f);
    expect_row("trunc 1.5 s, 0.1 tokens/s", pos + 1, want, 8);
    /* tokens_per_second beyond float under F32 is an argument error */
    a.time_rule = PE_TIME_F32;
    a.tokens_per_second = 1e300;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_ERR_ARG, "f32 huge tokens/s");
    a.time_rule = (pe_mrope_time)9;
    a.tokens_per_second = 2;
    CHECK(pe_mrope_position_ids(&a, pos, &delta, NULL) == PE_ERR_ARG, "unknown time rule");
}

/* The 5.x walk as transformers writes it: group the kept types, walk the groups. */
static void reference5(const pe_mrope_args *a, const int64_t *vgrid, const double *secs,
                       int64_t *pos, int64_t *deltas) {
    const int64_t B = a->batch, L = a->seq, m = a->spatial_merge_size;
    int64_t image_index = 0, video_index = 0, video_seconds = 0;
    for (int64_t b = 0; b < B; ++b) {
        for (int r = 0; r < 3; ++r)
            for (int64_t j = 0; j < L; ++j) pos[(r * B + b) * L + j] = 0;
        int64_t cur = 0, top = -1, n = 0, j = 0;
        while (j < L) {
            if (a->attention_mask && a->attention_mask[b * L + j] == 0) { ++j; continue; }
            const int64_t ty = a->mm_token_type_ids[b * L + j];
            /* the group: kept tokens of this type from j on */
            int64_t end = j, count = 0;
            int64_t *slots = malloc(sizeof(int64_t) * (size_t)L);
            while (end < L) {
                if (!a->attention_mask || a->attention_mask[b * L + end] == 1) {
                    if (a->mm_token_type_ids[b * L + end] != ty) break;
                    slots[count++] = end;
                }
                ++end;
            }
            if (ty == 0) {
                for (int64_t i = 0; i < count; ++i)
                    for (int r = 0; r < 3; ++r) pos[(r * B + b) * L + slots[i]] = cur + i;
                if (cur + count - 1 > top) top = cur + count - 1;
                cur += count;
            } else {
                const int64_t *g = ty == 1 ? a->image_grid_thw + 3 * image_index++
                                           : vgrid + 3 * video_index++;
                const double s = (ty == 2 && secs) ? secs[video_seconds] : 1.0;
                video_seconds += ty == 2;
                const int64_t t = g[0], h = g[1] / m, w = g[2] / m;
                int64_t k = 0;
                for (int64_t ti = 0; ti < t; ++ti)
                    for (int64_t hi = 0; hi < h; ++hi)
                        for (int64_t wi = 0; wi < w; ++wi, ++k) {
                            int64_t tv = ti;
                            if (ty == 2 && a->model == PE_MROPE_QWEN2_5_VL) {
                                const float step = (float)a->tokens_per_second * (float)s;
                                tv = (int64_t)((float)ti * step); /* PE_TIME_F32 */
                            }
                            const int64_t p[3] = {cur + tv, cur + hi, cur + wi};
                            for (int r = 0; r < 3; ++r) {
                                pos[(r * B + b) * L + slots[k]] = p[r];
                                if (p[r] > top) top = p[r];
                            }
                        }
                cur += h > w ? h : w;
            }
            n += count;
            free(slots);
            j = end;
        }
        deltas[b] = n ? top + 1 - n : 0;
    }
}

/* ---- reference: the walk as transformers writes it ------------------------------------ */

static int64_t find_from(const int64_t *t, int64_t n, int64_t what, int64_t st) {
    for (int64_t i = st; i < n; ++i)
        if (t[i] == what) return i;
    return -1;
}

/* Valid inputs only; grids already split per frame for Qwen3-VL by the caller. */
static void reference(const pe_mrope_args *a, const int64_t *vgrid, const double *secs,
                      int64_t *pos, int64_t *deltas) {
    const int64_t B = a->batch, L = a->seq, m = a->spatial_merge_size;
    int64_t image_index = 0, video_index = 0;
    int64_t *tok = malloc(sizeof(int64_t) * (size_t)(L + 1));
    int64_t *where = malloc(sizeof(int64_t) * (size_t)(L + 1));
    int64_t *lp = malloc(sizeof(int64_t) * (size_t)(3 * (L + 1)));
    for (int64_t b = 0; b < B; ++b) {
        int64_t n = 0;
        for (int64_t j = 0; j < L; ++j) {
            if (!a->attention_mask || a->attention_mask[b * L + j] == 1) {
                tok[n] = a->input_ids[b * L + j];
                where[n++] = j;
            }
            for (int r = 0; r < 3; ++r) pos[(r * B + b) * L + j] = 1;
        }
        int64_t nimg = 0, nvid = 0;
        for (int64_t i = 0; i + 1 < n; ++i)
            if (tok[i] == VS) nimg += tok[i + 1] == IMG, nvid += tok[i + 1] == VID;
        int64_t st = 0, cnt = 0, last_max = -1;
        const int64_t items = nimg + nvid; /* nimg, nvid count down: the remaining ones */
        for (int64_t k = 0; k < items; ++k) {
            int64_t ei = nimg > 0 ? find_from(tok, n, IMG, st) : n + 1;
            int64_t ev = nvid > 0 ? find_from(tok, n, VID, st) : n + 1;
            int64_t t, h, w, ed;
            double step;
            if (ei < ev) {
                const int64_t *g = a->image_grid_thw + 3 * image_index++;
                t = g[0], h = g[1] / m, w = g[2] / m, ed = ei, --nimg;
                step = a->model == PE_MROPE_QWEN2_5_VL ? 0.0 : 1.0;
            } else {
                const int64_t *g = vgrid + 3 * video_index;
                t = g[0], h = g[1] / m, w = g[2] / m, ed = ev, --nvid;
                step = a->model == PE_MROPE_QWEN2_5_VL
                           ? (secs ? secs[video_index] : 1.0) * a->tokens_per_second : 1.0;
                ++video_index;
            }
            const int64_t st_idx = last_max + 1;
            for (int64_t i = 0; i < ed - st; ++i)
                for (int r = 0; r < 3; ++r) lp[3 * (cnt + i) + r] = st_idx + i;
            cnt += ed - st;
            const int64_t off = st_idx + ed - st;
            last_max = -1;
            for (int64_t ti = 0; ti < t; ++ti)
                for (int64_t hi = 0; hi < h; ++hi)
                    for (int64_t wi = 0; wi < w; ++wi) {
                        const int64_t tv = a->model == PE_MROPE_QWEN2_5_VL
                                               ? (int64_t)((double)ti * step) : ti;
                        lp[3 * cnt] = off + tv;
                        lp[3 * cnt + 1] = off + hi;
                        lp[3 * cnt + 2] = off + wi;
                        for (int r = 0; r < 3; ++r)
                            if (lp[3 * cnt + r] > last_max) last_max = lp[3 * cnt + r];
                        ++cnt;
                    }
            st = ed + t * h * w;
        }
        if (st < n) {
            const int64_t st_idx = last_max + 1;
            for (int64_t i = 0; i < n - st; ++i) {
                for (int r = 0; r < 3; ++r) lp[3 * cnt + r] = st_idx + i;
                ++cnt;
            }
            last_max = st_idx + n - st - 1;
        }
        for (int64_t i = 0; i < n; ++i)
            for (int r = 0; r < 3; ++r) pos[(r * B + b) * L + where[i]] = lp[3 * i + r];
        deltas[b] = last_max + 1 - L;
    }
    free(tok);
    free(where);
    free(lp);
}

typedef struct batch {
    int64_t B, L;
    int64_t *ids, *mask;
    int64_t igrid[3 * 4096], vgrid[3 * 4096], vframes[3 * 16384];
    double secs[4096];
    int64_t ni, nv, nframes;
} batch;

/* Appends to row b at *len (capacity L): text, then an item of the given LLM grid. */
static void put(batch *bt, int64_t b, int64_t *len, int64_t v) {
    if (*len < bt->L) bt->ids[b * bt->L + (*len)++] = v;
}

static int64_t item_len(int64_t t, int64_t h, int64_t w, int64_t m) { return t * (h / m) * (w / m); }

static void random_batch(batch *bt, pe_mrope_model model, int64_t B, int64_t L, int padding) {
    const int64_t m = 2;
    bt->B = B;
    bt->L = L;
    bt->ni = bt->nv = bt->nframes = 0;
    bt->ids = malloc(sizeof(int64_t) * (size_t)(B * L));
    bt->mask = malloc(sizeof(int64_t) * (size_t)(B * L));
    for (int64_t b = 0; b < B; ++b) {
        int64_t len = 0;
        const int64_t used = L - (padding ? (int64_t)rnd((unsigned)(L / 4 + 1)) : 0);
        const int no_vision = rnd(5) == 0;
        while (len < used) {
            const int64_t text = 1 + rnd(6);
            for (int64_t i = 0; i < text && len < used; ++i) put(bt, b, &len, 1000 + rnd(50));
            if (no_vision || len >= used) continue;
            const int video = rnd(2);
            int64_t t = video ? 1 + rnd(4) : (rnd(6) == 0 ? 2 : 1);
            const int64_t h = m * (1 + rnd(4)), w = m * (1 + rnd(4));
            const int qwen3_video = video && model == PE_MROPE_QWEN3_VL;
            const int64_t need = qwen3_video ? t * (item_len(1, h, w, m) + 4)
                                             : item_len(t, h, w, m) + 2;
            if (len + need > used || (video ? bt->nv : bt->ni) >= 4096) continue;
            if (!video) {
                int64_t *g = bt->igrid + 3 * bt->ni++;
                g[0] = t, g[1] = h, g[2] = w;
            } else {
                int64_t *g = bt->vgrid + 3 * bt->nv;
                g[0] = t, g[1] = h, g[2] = w;
                bt->secs[bt->nv++] = (rnd(4) + 1) * 0.5;
            }
            for (int64_t f = 0; f < (qwen3_video ? t : 1); ++f) {
                if (qwen3_video) {
                    int64_t *g = bt->vframes + 3 * bt->nframes++;
                    g[0] = 1, g[1] = h, g[2] = w;
                    put(bt, b, &len, 2000 + f);
                    put(bt, b, &len, 2001 + f);
                }
                put(bt, b, &len, VS);
                const int64_t n = qwen3_video ? item_len(1, h, w, m) : item_len(t, h, w, m);
                for (int64_t i = 0; i < n; ++i) put(bt, b, &len, video ? VID : IMG);
                put(bt, b, &len, VE);
            }
        }
        /* padding: left or right, by row parity */
        const int64_t pad = L - len;
        int64_t *row = bt->ids + b * bt->L, *mrow = bt->mask + b * bt->L;
        if (b % 2 == 0 && pad > 0) {
            memmove(row + pad, row, sizeof(int64_t) * (size_t)len);
            for (int64_t j = 0; j < L; ++j) mrow[j] = j >= pad;
            for (int64_t j = 0; j < pad; ++j) row[j] = PAD;
        } else {
            for (int64_t j = 0; j < L; ++j) mrow[j] = j < len;
            for (int64_t j = len; j < L; ++j) row[j] = PAD;
        }
    }
    if (model != PE_MROPE_QWEN3_VL) {
        memcpy(bt->vframes, bt->vgrid, sizeof(int64_t) * (size_t)(3 * bt->nv));
        bt->nframes = bt->nv;
    }
}

static void random_case(pe_mrope_model model, int64_t B, int64_t L, int padding, int threads,
                        int rules5) {
    batch *bt = malloc(sizeof *bt);
    random_batch(bt, model, B, L, padding);
    int64_t *types = malloc(sizeof(int64_t) * (size_t)(B * L));
    types_of(bt->ids, B * L, types);
    pe_mrope_args a = base_args(model, B, L, bt->ids);
    if (rules5) {
        a = v5_args(model, B, L, types);
        a.time_rule = PE_TIME_F32;
    }
    a.attention_mask = padding ? bt->mask : NULL;
    a.image_grid_thw = bt->igrid;
    a.n_images = bt->ni;
    a.video_grid_thw = bt->vgrid;
    a.n_videos = bt->nv;
    a.second_per_grid_ts = model == PE_MROPE_QWEN2_5_VL ? bt->secs : NULL;
    a.nthreads = threads;
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(3 * B * L));
    int64_t *ref = malloc(sizeof(int64_t) * (size_t)(3 * B * L));
    int64_t *d = malloc(sizeof(int64_t) * (size_t)B), *dref = malloc(sizeof(int64_t) * (size_t)B);
    pe_pos_error e;
    const int rc = pe_mrope_position_ids(&a, pos, d, &e);
    CHECK(rc == PE_OK, "random model %d B %lld L %lld: status %d problem %d row %lld token %lld",
          model, (long long)B, (long long)L, rc, e.problem, (long long)e.row, (long long)e.token);
    if (rc == PE_OK) {
        if (rules5)
            reference5(&a, bt->vframes, a.second_per_grid_ts, ref, dref);
        else
            reference(&a, bt->vframes, a.second_per_grid_ts, ref, dref);
        char what[96];
        snprintf(what, sizeof what, "random model %d B %lld L %lld threads %d rules %d", model,
                 (long long)B, (long long)L, threads, rules5);
        expect_row(what, pos, ref, 3 * B * L);
        expect_row(what, d, dref, B);
    }
    free(pos), free(ref), free(d), free(dref), free(types);
    free(bt->ids), free(bt->mask), free(bt);
}

/* ---- bad grids ------------------------------------------------------------------------ */

static int run_bad(pe_mrope_args *a, int64_t L, pe_pos_error *e) {
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(3 * a->batch * L));
    int64_t *d = malloc(sizeof(int64_t) * (size_t)a->batch);
    const int rc = pe_mrope_position_ids(a, pos, d, e);
    free(pos), free(d);
    return rc;
}

static void bad_grids(void) {
    const int64_t ids[2 * 10] = {1, VS, IMG, IMG, IMG, IMG, VE, 2, 3, 4,
                                 1, VS, VID, VID, VID, VID, VE, VS, IMG, VE};
    int64_t ig[6] = {1, 4, 4, 1, 2, 2}, vg[3] = {1, 4, 4};
    pe_pos_error e;
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_VL, 2, 10, ids);
    a.image_grid_thw = ig;
    a.n_images = 2;
    a.video_grid_thw = vg;
    a.n_videos = 1;
    CHECK(run_bad(&a, 10, &e) == PE_OK, "valid base for bad grids: problem %d", e.problem);

    a.n_images = 1; /* too few image grids */
    CHECK(run_bad(&a, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_GRID_COUNT && !e.video &&
              e.found == 2 && e.expected == 1, "too few grids: problem %d", e.problem);
    a.n_images = 2;
    int64_t ig3[9] = {1, 4, 4, 1, 2, 2, 1, 2, 2};
    a.image_grid_thw = ig3;
    a.n_images = 3; /* too many */
    CHECK(run_bad(&a, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_GRID_COUNT && e.found == 2 &&
              e.expected == 3, "too many grids: problem %d", e.problem);
    a.image_grid_thw = ig;
    a.n_images = 2;

    const int64_t bad_values[][3] = {{0, 4, 4}, {1, -2, 4}, {1, 4, 3}, {1, 5, 4}, {-1, 2, 2}};
    for (int k = 0; k < 5; ++k) {
        int64_t g[6] = {1, 4, 4, 1, 2, 2};
        memcpy(g + 3, bad_values[k], sizeof bad_values[k]);
        a.image_grid_thw = g;
        CHECK(run_bad(&a, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_BAD_GRID && e.grid == 1 &&
                  !e.video, "bad grid value %d: problem %d", k, e.problem);
    }
    int64_t vbad[3] = {1, 4, 5};
    a.image_grid_thw = ig;
    a.video_grid_thw = vbad;
    CHECK(run_bad(&a, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_BAD_GRID && e.grid == 0 &&
              e.video, "bad video grid: problem %d", e.problem);
    a.video_grid_thw = vg;

    /* grid larger than its run: 16 tokens wanted, 4 present (run ends at VE) */
    int64_t big[6] = {1, 8, 8, 1, 2, 2};
    a.image_grid_thw = big;
    CHECK(run_bad(&a, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_SHORT_RUN && e.row == 0 &&
              e.token == 2 && e.grid == 0 && e.expected == 16 && e.found == 4,
          "short run: problem %d row %lld token %lld found %lld", e.problem, (long long)e.row,
          (long long)e.token, (long long)e.found);
    /* the row ends inside the run */
    {
        const int64_t short_ids[4] = {1, VS, IMG, IMG};
        pe_mrope_args r = base_args(PE_MROPE_QWEN2_VL, 1, 4, short_ids);
        r.image_grid_thw = ig;
        r.n_images = 1;
        CHECK(run_bad(&r, 4, &e) == PE_ERR_GRID && e.problem == PE_POS_SHORT_RUN && e.token == 2 &&
                  e.expected == 4 && e.found == 2, "row ends in the run: problem %d", e.problem);
    }
    /* a run shorter than its grid in the second row */
    int64_t big2[6] = {1, 4, 4, 1, 4, 2};
    a.image_grid_thw = big2;
    CHECK(run_bad(&a, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_SHORT_RUN && e.row == 1 &&
              e.token == 8 && e.grid == 1 && e.expected == 2 && e.found == 1,
          "short run, row 1: problem %d", e.problem);
    /* grid smaller than its run: the rest of the run is stray */
    int64_t small[6] = {1, 2, 4, 1, 2, 2};
    a.image_grid_thw = small;
    CHECK(run_bad(&a, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_STRAY_TOKEN && e.row == 0 &&
              e.token == 4 && !e.video, "long run: problem %d token %lld", e.problem,
          (long long)e.token);
    /* a huge grid (product overflows) is a short run, not an overflow */
    int64_t huge[6] = {INT64_MAX / 2, 1LL << 40, 1LL << 40, 1, 2, 2};
    a.image_grid_thw = huge;
    CHECK(run_bad(&a, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_SHORT_RUN && e.grid == 0,
          "huge grid: problem %d", e.problem);
    a.image_grid_thw = ig;

    /* a placeholder without vision start after valid items */
    const int64_t stray[10] = {1, VS, IMG, IMG, IMG, IMG, VE, IMG, 3, 4};
    pe_mrope_args s = base_args(PE_MROPE_QWEN2_VL, 1, 10, stray);
    s.image_grid_thw = ig;
    s.n_images = 1;
    CHECK(run_bad(&s, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_STRAY_TOKEN && e.token == 7,
          "stray placeholder: problem %d", e.problem);
    /* ... and before the item (transformers would start the image there) */
    const int64_t stray2[10] = {IMG, VS, IMG, IMG, IMG, IMG, VE, 2, 3, 4};
    s.input_ids = stray2;
    CHECK(run_bad(&s, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_STRAY_TOKEN && e.token == 0,
          "stray placeholder first: problem %d", e.problem);

    /* Qwen3-VL: frames counted against the vision starts */
    const int64_t q3[10] = {1, VS, VID, VID, VID, VID, VE, 2, 3, 4};
    pe_mrope_args q = base_args(PE_MROPE_QWEN3_VL, 1, 10, q3);
    int64_t two_frames[3] = {2, 4, 4};
    q.video_grid_thw = two_frames;
    q.n_videos = 1;
    CHECK(run_bad(&q, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_GRID_COUNT && e.video &&
              e.found == 1 && e.expected == 2, "qwen3 frames count: problem %d", e.problem);
    int64_t frame_bad[6] = {1, 2, 2, 1, 4, 4};
    q.video_grid_thw = frame_bad;
    q.n_videos = 2;
    const int64_t q3b[10] = {1, VS, VID, VE, VS, VID, VID, VID, 2, 3};
    q.input_ids = q3b;
    CHECK(run_bad(&q, 10, &e) == PE_ERR_GRID && e.problem == PE_POS_SHORT_RUN && e.grid == 1 &&
              e.frame == 0 && e.expected == 4 && e.found == 3,
          "qwen3 short frame: problem %d grid %lld frame %lld", e.problem, (long long)e.grid,
          (long long)e.frame);

    /* Qwen2.5-VL seconds */
    const int64_t v25[8] = {1, VS, VID, VID, VID, VID, VE, 2};
    pe_mrope_args v = base_args(PE_MROPE_QWEN2_5_VL, 1, 8, v25);
    int64_t vg2[3] = {4, 2, 2};
    v.video_grid_thw = vg2;
    v.n_videos = 1;
    const double neg[1] = {-0.5}, huge_s[1] = {1e12};
    v.second_per_grid_ts = neg;
    CHECK(run_bad(&v, 8, &e) == PE_ERR_GRID && e.problem == PE_POS_BAD_SECONDS && e.grid == 0,
          "negative seconds: problem %d", e.problem);
    v.second_per_grid_ts = huge_s;
    CHECK(run_bad(&v, 8, &e) == PE_ERR_GRID && e.problem == PE_POS_BAD_SECONDS,
          "huge seconds: problem %d", e.problem);
    v.second_per_grid_ts = NULL;
    CHECK(run_bad(&v, 8, &e) == PE_OK, "4 frames of 1 token: problem %d", e.problem);

    /* bad arguments */
    pe_mrope_args z = base_args(PE_MROPE_QWEN2_VL, 1, 8, v25);
    z.video_token_id = IMG;
    CHECK(run_bad(&z, 8, &e) == PE_ERR_ARG && e.problem == PE_POS_BAD_ARG, "equal token ids");
    z = base_args(PE_MROPE_QWEN2_VL, 1, 8, v25);
    z.spatial_merge_size = 0;
    CHECK(run_bad(&z, 8, &e) == PE_ERR_ARG, "merge size 0");
    z = base_args((pe_mrope_model)7, 1, 8, v25);
    CHECK(run_bad(&z, 8, &e) == PE_ERR_ARG, "unknown model");
    z = base_args(PE_MROPE_QWEN2_VL, 1, 8, v25);
    z.image_token_id = -5;
    CHECK(run_bad(&z, 8, &e) == PE_ERR_ARG, "negative token id");
    z = base_args(PE_MROPE_QWEN2_VL, 1, 8, v25);
    const int64_t mask2[8] = {1, 1, 2, 1, 1, 1, 1, 1};
    z.attention_mask = mask2;
    CHECK(run_bad(&z, 8, &e) == PE_ERR_ARG && e.problem == PE_POS_BAD_MASK && e.token == 2 &&
              e.found == 2, "mask value 2: problem %d", e.problem);
    z = base_args(PE_MROPE_QWEN2_5_VL, 1, 8, v25);
    z.tokens_per_second = -1;
    CHECK(run_bad(&z, 8, &e) == PE_ERR_ARG, "negative tokens_per_second");
}

/* Errors in several rows of a threaded run: the lowest row is reported. */
static void threaded_errors(void) {
    const int64_t B = 8, L = 40000;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(B * L));
    int64_t grids[3 * 8];
    for (int64_t b = 0; b < B; ++b) {
        int64_t *row = ids + b * L;
        for (int64_t j = 0; j < L; ++j) row[j] = 1000 + j % 7;
        row[100] = VS;
        for (int64_t j = 101; j < 105; ++j) row[j] = IMG;
        row[105] = VE;
        grids[3 * b] = 1, grids[3 * b + 1] = 4, grids[3 * b + 2] = 4;
    }
    ids[6 * L + 4000] = IMG; /* stray in row 6 */
    ids[3 * L + 104] = 7;    /* short run in row 3 */
    ids[5 * L + 50] = VID;   /* stray in row 5 */
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_VL, B, L, ids);
    a.image_grid_thw = grids;
    a.n_images = B;
    a.nthreads = 4;
    pe_pos_error e;
    CHECK(run_bad(&a, L, &e) == PE_ERR_GRID && e.problem == PE_POS_SHORT_RUN && e.row == 3 &&
              e.token == 101 && e.grid == 3 && e.found == 3,
          "threaded errors: problem %d row %lld", e.problem, (long long)e.row);
    ids[3 * L + 104] = IMG;
    CHECK(run_bad(&a, L, &e) == PE_ERR_GRID && e.problem == PE_POS_STRAY_TOKEN && e.row == 5 &&
              e.token == 50 && e.video, "threaded errors 2: problem %d row %lld", e.problem,
          (long long)e.row);
    free(ids);
}

/* ---- vision tower ids ----------------------------------------------------------------- */

/* The patch count of grids (n, 3) with one merge size m, or the (negative) status. */
static int64_t vision_count(int64_t n, const int64_t *thw, int64_t m, pe_pos_error *e) {
    const pe_vision_grids g = {n, thw, NULL, m};
    pe_vision_sizes s;
    const int rc = pe_vision_sizes_of(&g, &s, e);
    return rc == PE_OK ? s.patches : rc;
}

/* The (row, col) ids of grids (n, 3) with one merge size m, as the shim asks for them. */
static int vision_positions(int64_t n, const int64_t *thw, int64_t m, int64_t total, int64_t *out,
                            int nthreads, pe_pos_error *e) {
    const pe_vision_grids g = {n, thw, NULL, m};
    return pe_vision_positions(&g, 2, out, total, nthreads, e);
}

static void vision_ids(void) {
    const int64_t grids[6] = {1, 4, 4, 2, 2, 4};
    int64_t total = vision_count(2, grids, 2, NULL);
    CHECK(total == 32, "vision count %lld", (long long)total);
    int64_t out[64];
    CHECK(vision_positions(2, grids, 2, total, out, 1, NULL) == PE_OK, "vision ids");
    const int64_t first[32] = {0, 0, 0, 1, 1, 0, 1, 1, 0, 2, 0, 3, 1, 2, 1, 3,
                               2, 0, 2, 1, 3, 0, 3, 1, 2, 2, 2, 3, 3, 2, 3, 3};
    const int64_t second[16] = {0, 0, 0, 1, 1, 0, 1, 1, 0, 2, 0, 3, 1, 2, 1, 3};
    expect_row("vision (1,4,4)", out, first, 32);
    expect_row("vision (2,2,4) frame 0", out + 32, second, 16);
    expect_row("vision (2,2,4) frame 1", out + 48, second, 16);

    /* A larger list, threaded, against the window formula. */
    int64_t g[3 * 40];
    int64_t n = 0;
    for (int i = 0; i < 40; ++i) {
        g[3 * i] = 1 + rnd(3);
        g[3 * i + 1] = 2 * (1 + rnd(20));
        g[3 * i + 2] = 2 * (1 + rnd(20));
    }
    g[3 * 7] = 4, g[3 * 7 + 1] = 256, g[3 * 7 + 2] = 256; /* 2^18 patches: threads run */
    n = vision_count(40, g, 2, NULL);
    CHECK(n > 0, "vision count (random)");
    int64_t *o = malloc(sizeof(int64_t) * (size_t)(2 * n));
    CHECK(vision_positions(40, g, 2, n, o, 4, NULL) == PE_OK, "vision ids (random)");
    int64_t k = 0;
    int bad = 0;
    for (int i = 0; i < 40; ++i) {
        const int64_t t = g[3 * i], h = g[3 * i + 1], w = g[3 * i + 2], wm = w / 2;
        for (int64_t f = 0; f < t; ++f)
            for (int64_t p = 0; p < h * w; ++p, ++k) {
                const int64_t win = p / 4, in = p % 4;
                const int64_t row = (win / wm) * 2 + in / 2, col = (win % wm) * 2 + in % 2;
                bad += o[2 * k] != row || o[2 * k + 1] != col;
            }
    }
    CHECK(k == n && bad == 0, "vision ids vs formula: %d wrong", bad);
    free(o);

    pe_pos_error e;
    const int64_t badg[6] = {1, 4, 4, 1, 3, 4};
    CHECK(vision_count(2, badg, 2, &e) == PE_ERR_GRID && e.problem == PE_POS_BAD_GRID &&
              e.grid == 1, "vision bad grid");
    const int64_t zero[3] = {0, 4, 4};
    CHECK(vision_count(1, zero, 2, &e) == PE_ERR_GRID, "vision zero grid");
    const int64_t huge[3] = {1LL << 40, 1LL << 40, 1LL << 40};
    CHECK(vision_count(1, huge, 2, &e) == PE_ERR_GRID, "vision huge grid");
    CHECK(vision_positions(2, grids, 2, 31, out, 1, &e) == PE_ERR_ARG, "vision wrong total");
    CHECK(vision_count(2, grids, 0, &e) == PE_ERR_GRID && e.problem == PE_POS_BAD_MERGE &&
              e.grid == 0, "vision merge 0");
    CHECK(vision_count(0, NULL, 2, &e) == 0, "vision empty");
}

/* ---- packed rows ---------------------------------------------------------------------- */

static int run_owned(pe_mrope_args *a, int64_t n, const int64_t *lens, const int64_t *per_row,
                     const int64_t *owned, pe_pos_error *e) {
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(4 * a->batch * a->seq + 1));
    const int rc = pe_mrope_packed_position_ids(a, n, lens, per_row, owned, pos, e);
    free(pos);
    return rc;
}

static int run_packed(pe_mrope_args *a, int64_t n, const int64_t *lens, const int64_t *per_row,
                      pe_pos_error *e) {
    return run_owned(a, n, lens, per_row, NULL, e);
}

/* Spec example 1 then a one-token example and a text-only one in row 0, padding after;
 * row 1: one example cut short by padding. */
static void packed_example(void) {
    enum { L = 14 };
    const int64_t ids[2 * L] = {1, VS, IMG, IMG, IMG, IMG, VE, 2, 7, 8, 9, PAD, PAD, PAD,
                                3, 4, 5, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD};
    const int64_t grid[3] = {1, 4, 4}, lens[4] = {8, 1, 2, 3}, per_row[2] = {3, 1};
    const int64_t owned_grids[8] = {1, 0, 0, 0, 0, 0, 0, 0};
    const int64_t text[L] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, 0, 1, 2};
    const int64_t T[L] = {0, 1, 2, 2, 2, 2, 4, 5, 0, 0, 1, 0, 1, 2},
                  H[L] = {0, 1, 2, 2, 3, 3, 4, 5, 0, 0, 1, 0, 1, 2},
                  W[L] = {0, 1, 2, 3, 2, 3, 4, 5, 0, 0, 1, 0, 1, 2};
    const int64_t row1[L] = {0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    int64_t types[2 * L];
    types_of(ids, 2 * L, types);
    for (int rules5 = 0; rules5 < 4; ++rules5) { /* 2, 3: the same with example_grids */
        const int64_t *owned = rules5 >= 2 ? owned_grids : NULL;
        for (int model = 0; model < 3; ++model) {
            pe_mrope_args a = rules5 % 2 ? v5_args((pe_mrope_model)model, 2, L, types)
                                         : base_args((pe_mrope_model)model, 2, L, ids);
            a.image_grid_thw = grid;
            a.n_images = 1;
            int64_t pos[4 * 2 * L];
            pe_pos_error e;
            CHECK(pe_mrope_packed_position_ids(&a, 4, lens, per_row, owned, pos, &e) == PE_OK,
                  "packed example, model %d rules %d: problem %d", model, rules5, e.problem);
            expect_row("packed example text", pos, text, L);
            expect_row("packed example T", pos + 2 * L, T, L);
            expect_row("packed example H", pos + 4 * L, H, L);
            expect_row("packed example W", pos + 6 * L, W, L);
            for (int r = 0; r < 4; ++r)
                expect_row("packed example row 1", pos + (2 * r + 1) * L, row1, L);
        }
    }
    /* no grids: text positions per example; a row without examples is all padding */
    const int64_t text_ids[2 * L] = {0};
    const int64_t lens2[2] = {5, 9}, per_row2[2] = {2, 0};
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_VL, 2, L, text_ids);
    a.has_grids = 0;
    int64_t pos[4 * 2 * L];
    pe_pos_error e;
    CHECK(pe_mrope_packed_position_ids(&a, 2, lens2, per_row2, NULL, pos, &e) == PE_OK,
          "packed text");
    const int64_t want[L] = {0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8};
    const int64_t pad_row[L] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    for (int r = 0; r < 4; ++r) {
        expect_row("packed text row 0", pos + 2 * r * L, want, L);
        expect_row("packed text row 1", pos + (2 * r + 1) * L, pad_row, L);
    }
}

typedef struct packed_case {
    int64_t B, L, n;
    int64_t *ids, *types, *lens, *per_row, *igrid, *vgrid, *owned;
    double *secs;
    int64_t ni, nv;
} packed_case;

/* Random examples (random_batch rows of random length), packed first-fit into B rows of L
 * tokens.  Each example's own ids come from pe_mrope_position_ids on it alone into want. */
static void packed_random(pe_mrope_model model, int rules5, int64_t B, int64_t L, int threads) {
    packed_case pc = {.B = B, .L = L};
    pc.ids = calloc((size_t)(B * L), sizeof(int64_t));
    pc.types = calloc((size_t)(B * L), sizeof(int64_t));
    pc.lens = malloc(sizeof(int64_t) * (size_t)(B * L));
    pc.per_row = calloc((size_t)B, sizeof(int64_t));
    pc.owned = malloc(sizeof(int64_t) * (size_t)(2 * B * L));
    pc.igrid = malloc(sizeof(int64_t) * 3 * 4096);
    pc.vgrid = malloc(sizeof(int64_t) * 3 * 4096);
    pc.secs = malloc(sizeof(double) * 4096);
    int64_t *want = malloc(sizeof(int64_t) * (size_t)(4 * B * L));
    batch *bt = malloc(sizeof *bt);
    for (int64_t b = 0; b < B; ++b) {
        int64_t used = 0;
        /* leave some rows with padding after their last example */
        const int64_t room = L - (b % 2 ? (int64_t)rnd((unsigned)(L / 8 + 1)) : 0);
        while (used < room && pc.ni < 4000 && pc.nv < 4000) {
            const int64_t left = room - used;
            const unsigned most = (unsigned)(left < 300 ? left : 300);
            const int64_t len = rnd(4) == 0 ? 1 : 1 + (int64_t)rnd(most);
            random_batch(bt, model, 1, len, 0);
            int64_t *row_types = malloc(sizeof(int64_t) * (size_t)len);
            types_of(bt->ids, len, row_types);
            pe_mrope_args a = rules5 ? v5_args(model, 1, len, row_types)
                                     : base_args(model, 1, len, bt->ids);
            if (rules5) a.time_rule = PE_TIME_F32;
            a.image_grid_thw = bt->igrid;
            a.n_images = bt->ni;
            a.video_grid_thw = bt->vgrid;
            a.n_videos = bt->nv;
            a.second_per_grid_ts = model == PE_MROPE_QWEN2_5_VL ? bt->secs : NULL;
            int64_t *alone = malloc(sizeof(int64_t) * (size_t)(3 * len)), delta;
            pe_pos_error e;
            CHECK(pe_mrope_position_ids(&a, alone, &delta, &e) == PE_OK, "example alone");
            for (int64_t j = 0; j < len; ++j) {
                want[b * L + used + j] = j;
                for (int r = 0; r < 3; ++r)
                    want[((r + 1) * B + b) * L + used + j] = alone[r * len + j];
            }
            memcpy(pc.ids + b * L + used, bt->ids, sizeof(int64_t) * (size_t)len);
            memcpy(pc.types + b * L + used, row_types, sizeof(int64_t) * (size_t)len);
            memcpy(pc.igrid + 3 * pc.ni, bt->igrid, sizeof(int64_t) * (size_t)(3 * bt->ni));
            memcpy(pc.vgrid + 3 * pc.nv, bt->vgrid, sizeof(int64_t) * (size_t)(3 * bt->nv));
            memcpy(pc.secs + pc.nv, bt->secs, sizeof(double) * (size_t)bt->nv);
            pc.ni += bt->ni;
            pc.nv += bt->nv;
            pc.owned[2 * pc.n] = bt->ni;
            pc.owned[2 * pc.n + 1] = bt->nv;
            pc.lens[pc.n++] = len;
            pc.per_row[b] += 1;
            used += len;
            free(alone), free(row_types), free(bt->ids), free(bt->mask);
        }
        for (int64_t j = used; j < L; ++j) {
            pc.ids[b * L + j] = PAD;
            for (int r = 0; r < 4; ++r) want[(r * B + b) * L + j] = j - used;
        }
    }
    pe_mrope_args a = rules5 ? v5_args(model, B, L, pc.types) : base_args(model, B, L, pc.ids);
    if (rules5) a.time_rule = PE_TIME_F32;
    a.image_grid_thw = pc.igrid;
    a.n_images = pc.ni;
    a.video_grid_thw = pc.vgrid;
    a.n_videos = pc.nv;
    a.second_per_grid_ts = model == PE_MROPE_QWEN2_5_VL ? pc.secs : NULL;
    a.nthreads = threads;
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(4 * B * L));
    pe_pos_error e;
    for (int own = 0; own < 2; ++own) {
        const int rc = pe_mrope_packed_position_ids(&a, pc.n, pc.lens, pc.per_row,
                                                    own ? pc.owned : NULL, pos, &e);
        CHECK(rc == PE_OK, "packed random model %d rules %d owned %d: status %d problem %d "
              "example %lld", model, rules5, own, rc, e.problem, (long long)e.example);
        char what[112];
        snprintf(what, sizeof what, "packed random model %d rules %d owned %d B %lld L %lld "
                 "threads %d", model, rules5, own, (long long)B, (long long)L, threads);
        if (rc == PE_OK) expect_row(what, pos, want, 4 * B * L);
    }
    free(pos), free(want), free(bt);
    free(pc.ids), free(pc.types), free(pc.lens), free(pc.per_row), free(pc.igrid), free(pc.vgrid),
        free(pc.secs), free(pc.owned);
}

static void packed_bad(void) {
    enum { L = 12 };
    /* row 0: [x VS I I | I I VE y] + [z]: the image run is cut by the first boundary */
    const int64_t ids[L] = {1, VS, IMG, IMG, IMG, IMG, VE, 2, 3, PAD, PAD, PAD};
    const int64_t grid[3] = {1, 4, 4};
    int64_t types[L];
    types_of(ids, L, types);
    pe_pos_error e;
    for (int rules5 = 0; rules5 < 2; ++rules5) {
        pe_mrope_args a = rules5 ? v5_args(PE_MROPE_QWEN2_VL, 1, L, types)
                                 : base_args(PE_MROPE_QWEN2_VL, 1, L, ids);
        a.image_grid_thw = grid;
        a.n_images = 1;
        const int64_t one = 1, two = 2, three = 3;
        const int64_t cut[3] = {4, 4, 1};
        CHECK(run_packed(&a, 3, cut, &three, &e) == PE_ERR_GRID && e.problem == PE_POS_CUT_RUN &&
                  e.example == 0 && e.row == 0 && e.token == 2 && e.expected == 4 && e.found == 2,
              "cut run, rules %d: problem %d example %lld", rules5, e.problem,
              (long long)e.example);
        /* the last example ends inside the run, padding follows */
        const int64_t short_len[1] = {4};
        CHECK(run_packed(&a, 1, short_len, &one, &e) == PE_ERR_GRID &&
                  e.problem == PE_POS_CUT_RUN && e.example == 0,
              "run cut by the end of the last example: problem %d", e.problem);
        /* lengths: over the row, negative, more examples than listed */
        const int64_t over[2] = {8, 5}, neg[2] = {8, -1};
        CHECK(run_packed(&a, 2, over, &two, &e) == PE_ERR_ARG && e.problem == PE_POS_BAD_LENGTH &&
                  e.example == 1 && e.row == 0 && e.expected == 4 && e.found == 5,
              "length over the row: problem %d", e.problem);
        CHECK(run_packed(&a, 2, neg, &two, &e) == PE_ERR_ARG && e.problem == PE_POS_BAD_LENGTH &&
                  e.example == 1 && e.found == -1, "negative length");
        CHECK(run_packed(&a, 2, over, &one, &e) == PE_ERR_ARG && e.problem == PE_POS_BAD_ARG,
              "row_examples not summing to n_examples");
        const int64_t minus = -1;
        CHECK(run_packed(&a, 0, over, &minus, &e) == PE_ERR_ARG, "negative row_examples");
        /* a mask is not allowed */
        const int64_t mask[L] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
        a.attention_mask = mask;
        const int64_t ok[2] = {8, 1};
        CHECK(run_packed(&a, 2, ok, &two, &e) == PE_ERR_ARG, "mask with packed rows");
        a.attention_mask = NULL;
        CHECK(run_packed(&a, 2, ok, &two, &e) == PE_OK, "the same without a mask");
        /* a second example holding another image: no grid left for it */
        const int64_t ids2[L] = {1, VS, IMG, IMG, IMG, IMG, VE, VS, IMG, IMG, IMG, IMG};
        int64_t types2[L];
        types_of(ids2, L, types2);
        a.input_ids = ids2;
        if (rules5) a.mm_token_type_ids = types2;
        const int64_t split[2] = {7, 5};
        CHECK(run_packed(&a, 2, split, &two, &e) == PE_ERR_GRID && e.problem == PE_POS_GRID_COUNT &&
                  e.example == 1 && e.token == 8 && e.expected == 1 && e.found == 2,
              "grids run out in example 1, rules %d: problem %d example %lld token %lld", rules5,
              e.problem, (long long)e.example, (long long)e.token);
        /* two grids, one image: left over after the last example */
        const int64_t grids2[6] = {1, 4, 4, 1, 4, 4};
        a.input_ids = ids;
        if (rules5) a.mm_token_type_ids = types;
        a.image_grid_thw = grids2;
        a.n_images = 2;
        CHECK(run_packed(&a, 2, ok, &two, &e) == PE_ERR_GRID && e.problem == PE_POS_GRID_COUNT &&
                  e.example == -1 && e.expected == 2 && e.found == 1, "grids left over");
        /* a run longer than its grid in example 1 (two examples: the error names the second) */
        const int64_t grid_small[6] = {1, 4, 4, 1, 2, 4};
        a.image_grid_thw = grid_small;
        a.input_ids = ids2;
        if (rules5) a.mm_token_type_ids = types2;
        CHECK(run_packed(&a, 2, split, &two, &e) == PE_ERR_GRID && e.example == 1 &&
                  e.problem == PE_POS_STRAY_TOKEN, "long run in example 1: problem %d example %lld",
              e.problem, (long long)e.example);
    }
    /* with example_grids every example owns its grids */
    for (int rules5 = 0; rules5 < 2; ++rules5) {
        /* [x VS I I I I VE] [VS I I I I] */
        const int64_t ids2[L] = {1, VS, IMG, IMG, IMG, IMG, VE, VS, IMG, IMG, IMG, IMG};
        int64_t types2[L];
        types_of(ids2, L, types2);
        pe_mrope_args a = rules5 ? v5_args(PE_MROPE_QWEN2_VL, 1, L, types2)
                                 : base_args(PE_MROPE_QWEN2_VL, 1, L, ids2);
        const int64_t split[2] = {7, 5}, two = 2;
        /* example 0 brings two grids for its one image, example 1 one for its image: the
         * walk without ownership gives example 1 the second grid of example 0 */
        const int64_t grids3[9] = {1, 4, 4, 1, 2, 4, 1, 4, 4};
        a.image_grid_thw = grids3;
        a.n_images = 3;
        const int64_t owned[4] = {2, 0, 1, 0};
        CHECK(run_owned(&a, 2, split, &two, owned, &e) == PE_ERR_GRID &&
                  e.problem == PE_POS_GRID_COUNT && e.example == 0 && e.video == 0 &&
                  e.found == 1 && e.expected == 2,
              "owned grids: example 0 has a grid too many: problem %d example %lld", e.problem,
              (long long)e.example);
        CHECK(run_packed(&a, 2, split, &two, &e) == PE_ERR_GRID && e.example == 1,
              "without ownership the shifted grid lands on example 1: example %lld",
              (long long)e.example);
        /* a bad grid value is named with its owner */
        const int64_t grids_bad[6] = {1, 4, 4, 1, 3, 4};
        a.image_grid_thw = grids_bad;
        a.n_images = 2;
        const int64_t owned2[4] = {1, 0, 1, 0};
        CHECK(run_owned(&a, 2, split, &two, owned2, &e) == PE_ERR_GRID &&
                  e.problem == PE_POS_BAD_GRID && e.grid == 1 && e.example == 1,
              "bad grid owner: problem %d example %lld", e.problem, (long long)e.example);
        /* counts that do not add up to the grids, or negative */
        const int64_t owned_sum[4] = {1, 0, 0, 0}, owned_neg[4] = {3, 0, -1, 0};
        CHECK(run_owned(&a, 2, split, &two, owned_sum, &e) == PE_ERR_ARG &&
                  e.problem == PE_POS_BAD_ARG, "owned grids not summing to n_images");
        CHECK(run_owned(&a, 2, split, &two, owned_neg, &e) == PE_ERR_ARG, "negative owned grids");
        /* an example with fewer images than grids, the next with more: the first is named,
         * although both counts add up */
        const int64_t split2[2] = {2, 10}, owned3[4] = {1, 0, 1, 0};
        a.image_grid_thw = grids3;
        CHECK(run_owned(&a, 2, split2, &two, owned3, &e) == PE_ERR_GRID &&
                  e.problem == PE_POS_GRID_COUNT && e.example == 0 && e.found == 0 &&
                  e.expected == 1, "owned: example 0 without its image: example %lld found %lld",
              (long long)e.example, (long long)e.found);
    }
    /* Qwen3-VL: a video of two frames owned by an example holding one frame run */
    {
        const int64_t ids3[L] = {1, VS, VID, VID, VE, 2, VS, VID, VID, VE, 3, 4};
        pe_mrope_args a = base_args(PE_MROPE_QWEN3_VL, 1, L, ids3);
        const int64_t vgrid[3] = {2, 2, 4}, lens[2] = {5, 7}, owned[4] = {0, 1, 0, 0}, two = 2;
        a.video_grid_thw = vgrid;
        a.n_videos = 1;
        CHECK(run_owned(&a, 2, lens, &two, owned, &e) == PE_ERR_GRID &&
                  e.problem == PE_POS_GRID_COUNT && e.example == 0 && e.video == 1 &&
                  e.found == 1 && e.expected == 2,
              "owned frames: problem %d example %lld found %lld expected %lld", e.problem,
              (long long)e.example, (long long)e.found, (long long)e.expected);
        const int64_t one[2] = {12, 0};
        CHECK(run_owned(&a, 2, one, &two, owned, &e) == PE_OK, "owned frames in one example");
    }
    /* no grids but an image in example 1 */
    const int64_t ids3[L] = {1, 2, 3, VS, IMG, VE, 4, 5, 6, 7, 8, 9};
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_VL, 1, L, ids3);
    a.has_grids = 0;
    const int64_t lens[2] = {3, 9}, two = 2;
    CHECK(run_packed(&a, 2, lens, &two, &e) == PE_ERR_GRID && e.problem == PE_POS_NO_GRIDS &&
              e.example == 1 && e.token == 4, "no grids: problem %d", e.problem);
}

/* Many examples on 4 threads, several of them bad: the lowest example is reported. */
static void packed_threaded_errors(void) {
    enum { B = 4, L = 1 << 16, N = 512 };
    int64_t *ids = malloc(sizeof(int64_t) * B * L);
    int64_t lens[N], per_row[B];
    for (int64_t i = 0; i < (int64_t)B * L; ++i) ids[i] = 1;
    for (int b = 0; b < B; ++b) per_row[b] = N / B;
    for (int i = 0; i < N; ++i) lens[i] = L / (N / B);
    /* examples 300 and 400 start with a stray placeholder */
    for (int bad = 300; bad <= 400; bad += 100) {
        const int64_t b = bad / (N / B), k = bad % (N / B);
        ids[b * L + k * lens[0]] = IMG;
    }
    pe_mrope_args a = base_args(PE_MROPE_QWEN2_VL, B, L, ids);
    const int64_t grid[3] = {1, 2, 2};
    a.image_grid_thw = grid;
    a.n_images = 0;
    a.nthreads = 4;
    pe_pos_error e;
    for (int rep = 0; rep < 5; ++rep)
        CHECK(run_packed(&a, N, lens, per_row, &e) == PE_ERR_GRID && e.example == 300 &&
                  e.problem == PE_POS_STRAY_TOKEN, "threaded packed error: example %lld problem %d",
              (long long)e.example, e.problem);
    free(ids);
}

int main(void) {
    example_image();
    example_left_padding();
    example_qwen25_video();
    example_qwen3_frames();
    example_no_grids();
    bad_grids();
    threaded_errors();
    vision_ids();
    v5_examples();
    time_rules();
    for (int rules5 = 0; rules5 < 2; ++rules5) {
        for (int model = 0; model < 3; ++model) {
            for (int rep = 0; rep < 4; ++rep) {
                random_case((pe_mrope_model)model, 1 + rnd(4), 20 + rnd(200), rep % 2, 1, rules5);
                random_case((pe_mrope_model)model, 3, 64, 1, 1, rules5);
            }
            /* large enough for the threaded path; threaded and serial must both match */
            random_case((pe_mrope_model)model, 8, 40000, 1, 4, rules5);
            random_case((pe_mrope_model)model, 8, 6000, 0, 1, rules5);
        }
    }
    packed_example();
    packed_bad();
    packed_threaded_errors();
    for (int rules5 = 0; rules5 < 2; ++rules5) {
        for (int model = 0; model < 3; ++model) {
            packed_random((pe_mrope_model)model, rules5, 1 + rnd(3), 200 + rnd(600), 1);
            packed_random((pe_mrope_model)model, rules5, 4, 1 << 16, 4);
        }
    }
    return check_report("test_positions");
}

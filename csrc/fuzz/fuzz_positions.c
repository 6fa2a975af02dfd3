/*
 * libFuzzer harness for the position walk (pe_mrope_position_ids) and the vision tower ids
 * (pe_vision_sizes_of / pe_vision_positions with one merge size), and the packed-row walk
 * (pe_mrope_packed_position_ids), through the public API only, built
 * with ASan + UBSan.  The input bytes build token streams of text, vision-start tokens and
 * placeholder runs that usually match their grids (and sometimes do not: short or long
 * runs, stray placeholders, bad grids), padding with or without a mask, for each model.
 *
 * Every call returns a documented status.  On success the ids obey the rules of posenc.h:
 * masked slots are 1; a kept text token has T = H = W = one more than the largest position
 * before it in its row; deltas[b] = largest position + 1 - L.  Vision ids lie inside their
 * grid and each (row, col) of a grid appears t times.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "posenc.h"

enum { TEXT = 11, VSTART = 20, VEND = 21, IMAGE = 30, VIDEO = 31, MAX_L = 96, MAX_B = 3, MAX_G = 8 };

typedef struct stream {
    int64_t ids[MAX_B][MAX_L], len[MAX_B];
    int64_t images[MAX_G][3], videos[MAX_G][3];
    int64_t n_images, n_videos;
} stream;

static void push(stream *s, int64_t b, int64_t id) {
    if (s->len[b] < MAX_L) s->ids[b][s->len[b]++] = id;
}

/* A grid (t, h, w) with h, w multiples of m, now and then a broken one. */
static void grid(fuzz_bytes *in, int64_t m, int video, int64_t g[3]) {
    g[0] = video ? 1 + fuzz_below(in, 3) : 1;
    g[1] = m * (1 + fuzz_below(in, 3));
    g[2] = m * (1 + fuzz_below(in, 3));
    switch (fuzz_below(in, 24)) {
    case 0: g[fuzz_below(in, 3)] = 0; break;
    case 1: g[1] += 1; break;
    case 2: g[fuzz_below(in, 3)] = -(int64_t)fuzz_below(in, 3) - 1; break;
    default: break;
    }
}

/* Placeholder run of one item; `skew` shortens or lengthens it now and then. */
static void run(stream *s, fuzz_bytes *in, int64_t b, int64_t id, int64_t n) {
    const unsigned skew = fuzz_below(in, 16);
    if (skew == 0) n -= 1;
    if (skew == 1) n += 1;
    for (int64_t i = 0; i < n && i < MAX_L; ++i) push(s, b, id);
}

static void build_row(stream *s, fuzz_bytes *in, int64_t b, int64_t m, pe_mrope_model model) {
    const unsigned items = fuzz_below(in, 6);
    for (unsigned k = 0; k < items && s->len[b] < MAX_L; ++k) {
        for (unsigned t = fuzz_below(in, 4); t; --t) push(s, b, TEXT);
        const unsigned what = fuzz_below(in, 8);
        if (what <= 2 && s->n_images < MAX_G) { /* image */
            int64_t *g = s->images[s->n_images++];
            grid(in, m, 0, g);
            push(s, b, VSTART);
            run(s, in, b, IMAGE, g[0] * (g[1] / m) * (g[2] / m));
            push(s, b, VEND);
        } else if (what <= 4 && s->n_videos < MAX_G) { /* video */
            int64_t *g = s->videos[s->n_videos++];
            grid(in, m, 1, g);
            const int64_t per = (g[1] / m) * (g[2] / m);
            if (model == PE_MROPE_QWEN3_VL) { /* one start token and run per frame */
                for (int64_t f = 0; f < g[0] && f < 8; ++f) {
                    push(s, b, TEXT);
                    push(s, b, VSTART);
                    run(s, in, b, VIDEO, per);
                    push(s, b, VEND);
                }
            } else {
                push(s, b, VSTART);
                run(s, in, b, VIDEO, g[0] * per);
                push(s, b, VEND);
            }
        } else if (what == 5) { /* a stray placeholder */
            push(s, b, fuzz_below(in, 2) ? IMAGE : VIDEO);
        } else {
            push(s, b, fuzz_below(in, 2) ? VSTART : VEND);
        }
    }
}

static void check_ids(const stream *s, const pe_mrope_args *a, const int64_t *mask,
                      const int64_t *pos, const int64_t *deltas) {
    const int64_t B = a->batch, L = a->seq;
    for (int64_t b = 0; b < B; ++b) {
        int64_t next = 0, any_masked = 0;
        for (int64_t i = 0; i < L; ++i) {
            const int64_t t = pos[b * L + i], h = pos[(B + b) * L + i], w = pos[(2 * B + b) * L + i];
            if (mask && mask[b * L + i] == 0) {
                REQUIRE(t == 1 && h == 1 && w == 1);
                any_masked = 1;
                continue;
            }
            const int64_t id = s->ids[b][i];
            if (id != IMAGE && id != VIDEO) REQUIRE(t == next && h == next && w == next);
            REQUIRE(t >= 0 && h >= 0 && w >= 0);
            const int64_t top = t > h ? (t > w ? t : w) : (h > w ? h : w);
            if (top + 1 > next) next = top + 1;
        }
        if (!a->has_grids && mask && any_masked && next < 2) next = 2; /* masked slots hold 1 */
        REQUIRE(deltas[b] == next - L);
    }
}

static void fuzz_walk(fuzz_bytes *in) {
    stream s;
    memset(&s, 0, sizeof s);
    const pe_mrope_model model = (pe_mrope_model)fuzz_below(in, 3);
    const int64_t m = 1 + fuzz_below(in, 3);
    const int64_t B = 1 + fuzz_below(in, MAX_B);
    for (int64_t b = 0; b < B; ++b) build_row(&s, in, b, m, model);
    int64_t L = 0;
    for (int64_t b = 0; b < B; ++b)
        if (s.len[b] > L) L = s.len[b];
    /* pad on the left or the right, with a mask or without */
    const int use_mask = (int)fuzz_below(in, 2), left = (int)fuzz_below(in, 2);
    int64_t ids[MAX_B * MAX_L], mask[MAX_B * MAX_L];
    for (int64_t b = 0; b < B; ++b) {
        const int64_t pad = L - s.len[b];
        for (int64_t i = 0; i < L; ++i) {
            const int64_t j = left ? i - pad : i;
            const int kept = j >= 0 && j < s.len[b];
            ids[b * L + i] = kept ? s.ids[b][j] : TEXT;
            mask[b * L + i] = kept;
        }
        if (left) { /* the checker reads ids in padded order */
            int64_t row[MAX_L];
            for (int64_t i = 0; i < L; ++i) row[i] = ids[b * L + i];
            memcpy(s.ids[b], row, sizeof(int64_t) * (size_t)L);
        }
    }
    double seconds[MAX_G];
    for (int i = 0; i < MAX_G; ++i) seconds[i] = 0.5 * fuzz_below(in, 5);
    if (fuzz_below(in, 16) == 0) seconds[0] = -1.0;
    const int has_grids = fuzz_below(in, 8) != 0;
    const pe_mrope_args a = {
        .batch = B,
        .seq = L,
        .input_ids = ids,
        .ids_row_stride = L,
        .attention_mask = use_mask ? mask : NULL,
        .mask_row_stride = L,
        .has_grids = has_grids,
        .image_grid_thw = has_grids && s.n_images ? &s.images[0][0] : NULL,
        .n_images = has_grids ? s.n_images : 0,
        .video_grid_thw = has_grids && s.n_videos ? &s.videos[0][0] : NULL,
        .n_videos = has_grids ? s.n_videos : 0,
        .second_per_grid_ts = model == PE_MROPE_QWEN2_5_VL && fuzz_below(in, 2) ? seconds : NULL,
        .model = model,
        .image_token_id = IMAGE,
        .video_token_id = VIDEO,
        .vision_start_token_id = VSTART,
        .spatial_merge_size = m,
        .tokens_per_second = fuzz_below(in, 2) ? 2.0 : 25.0,
        .nthreads = 1 + (int)fuzz_below(in, 2),
    };
    int64_t pos[3 * MAX_B * MAX_L + 1], deltas[MAX_B];
    pe_pos_error err;
    memset(&err, 0, sizeof err);
    const int rc = pe_mrope_position_ids(&a, pos, deltas, &err);
    REQUIRE(rc == PE_OK || rc == PE_ERR_ARG || rc == PE_ERR_GRID);
    if (rc != PE_OK) {
        REQUIRE(err.problem != PE_POS_NONE);
        return;
    }
    check_ids(&s, &a, use_mask ? mask : NULL, pos, deltas);
}

/* Packed rows: the rows of build_row cut into examples of fuzzed lengths (some cutting a
 * run, running past the row or negative), with or without the grids each example owns.
 * On success: row 0 counts 0.. in every example and in the padding, rows 1-3 of the
 * padding too, and inside an example the 4.57 rules of check_ids hold with positions
 * restarting at the example. */
static void fuzz_packed(fuzz_bytes *in) {
    stream s;
    memset(&s, 0, sizeof s);
    const pe_mrope_model model = (pe_mrope_model)fuzz_below(in, 3);
    const int64_t m = 1 + fuzz_below(in, 3);
    const int64_t B = 1 + fuzz_below(in, MAX_B);
    for (int64_t b = 0; b < B; ++b) build_row(&s, in, b, m, model);
    int64_t L = 0;
    for (int64_t b = 0; b < B; ++b)
        if (s.len[b] > L) L = s.len[b];
    int64_t ids[MAX_B * MAX_L], lens[MAX_B * MAX_L], per_row[MAX_B];
    int64_t n = 0;
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < L; ++i) ids[b * L + i] = i < s.len[b] ? s.ids[b][i] : TEXT;
        int64_t used = 0;
        per_row[b] = 0;
        while (used < s.len[b] && fuzz_below(in, 8) != 0) {
            int64_t len = 1 + fuzz_below(in, 24);
            if (fuzz_below(in, 32) == 0) len = -len;
            if (len > 0 && used + len > s.len[b] && fuzz_below(in, 4)) len = s.len[b] - used;
            lens[n++] = len;
            ++per_row[b];
            used += len > 0 ? len : 0;
        }
    }
    double seconds[MAX_G];
    for (int i = 0; i < MAX_G; ++i) seconds[i] = 0.5 * fuzz_below(in, 5);
    const int has_grids = fuzz_below(in, 8) != 0;
    const pe_mrope_args a = {
        .batch = B,
        .seq = L,
        .input_ids = ids,
        .ids_row_stride = L,
        .mask_row_stride = L,
        .has_grids = has_grids,
        .image_grid_thw = has_grids && s.n_images ? &s.images[0][0] : NULL,
        .n_images = has_grids ? s.n_images : 0,
        .video_grid_thw = has_grids && s.n_videos ? &s.videos[0][0] : NULL,
        .n_videos = has_grids ? s.n_videos : 0,
        .second_per_grid_ts = model == PE_MROPE_QWEN2_5_VL && fuzz_below(in, 2) ? seconds : NULL,
        .model = model,
        .image_token_id = IMAGE,
        .video_token_id = VIDEO,
        .vision_start_token_id = VSTART,
        .spatial_merge_size = m,
        .tokens_per_second = 2.0,
        .nthreads = 1 + (int)fuzz_below(in, 2),
    };
    /* the grids each example owns: none (NULL), or a fuzzed split of the grid counts that
     * may not add up */
    int64_t owned[2 * MAX_B * MAX_L];
    const int with_owned = fuzz_below(in, 2);
    for (int64_t e = 0, left[2] = {a.n_images, a.n_videos}; with_owned && e < n; ++e)
        for (int k = 0; k < 2; ++k) {
            const int64_t take = e + 1 == n && fuzz_below(in, 4) ? left[k] : fuzz_below(in, 3);
            owned[2 * e + k] = take;
            left[k] -= take;
        }
    int64_t pos[4 * MAX_B * MAX_L + 1];
    pe_pos_error err;
    memset(&err, 0, sizeof err);
    const int rc =
        pe_mrope_packed_position_ids(&a, n, lens, per_row, with_owned ? owned : NULL, pos, &err);
    REQUIRE(rc == PE_OK || rc == PE_ERR_ARG || rc == PE_ERR_GRID);
    if (rc != PE_OK) {
        REQUIRE(err.problem != PE_POS_NONE);
        REQUIRE(err.example >= -1 && err.example < n);
        return;
    }
    const int64_t BL = B * L;
    for (int64_t b = 0, e = 0; b < B; ++b) {
        int64_t start = 0;
        for (int64_t k = 0; k < per_row[b]; ++k, ++e) {
            int64_t next = 0;
            for (int64_t i = start; i < start + lens[e]; ++i) {
                const int64_t t = pos[BL + b * L + i], h = pos[2 * BL + b * L + i],
                              w = pos[3 * BL + b * L + i];
                REQUIRE(pos[b * L + i] == i - start);
                const int64_t id = ids[b * L + i];
                if (id != IMAGE && id != VIDEO) REQUIRE(t == next && h == next && w == next);
                REQUIRE(t >= 0 && h >= 0 && w >= 0);
                const int64_t top = t > h ? (t > w ? t : w) : (h > w ? h : w);
                if (top + 1 > next) next = top + 1;
            }
            start += lens[e];
        }
        for (int64_t i = start; i < L; ++i)
            for (int r = 0; r < 4; ++r) REQUIRE(pos[r * BL + b * L + i] == i - start);
    }
}

static void fuzz_vision(fuzz_bytes *in) {
    int64_t grids[MAX_G][3];
    const int64_t n = fuzz_below(in, 5), m = 1 + fuzz_below(in, 3);
    for (int64_t g = 0; g < n; ++g) grid(in, m, 1, grids[g]);
    pe_pos_error err;
    const pe_vision_grids vg = {n, n ? &grids[0][0] : NULL, NULL, m};
    pe_vision_sizes sizes;
    int rc = pe_vision_sizes_of(&vg, &sizes, &err);
    REQUIRE(rc == PE_OK || rc == PE_ERR_GRID || rc == PE_ERR_ARG);
    if (rc != PE_OK) return;
    const int64_t total = sizes.patches;
    int64_t expect = 0;
    for (int64_t g = 0; g < n; ++g) expect += grids[g][0] * grids[g][1] * grids[g][2];
    REQUIRE(total == expect);
    int64_t *out = malloc((size_t)(2 * total + 1) * sizeof(int64_t));
    rc = pe_vision_positions(&vg, 2, out, total, 1 + (int)fuzz_below(in, 2), &err);
    REQUIRE(rc == PE_OK);
    REQUIRE(pe_vision_positions(&vg, 2, out, total + 1, 1, &err) != PE_OK);
    const int64_t *o = out;
    for (int64_t g = 0; g < n; ++g) {
        const int64_t t = grids[g][0], h = grids[g][1], w = grids[g][2];
        int count[6 * 6];
        memset(count, 0, sizeof count);
        for (int64_t i = 0; i < t * h * w; ++i, o += 2) {
            REQUIRE(o[0] >= 0 && o[0] < h && o[1] >= 0 && o[1] < w);
            if (h <= 6 && w <= 6) ++count[o[0] * 6 + o[1]];
        }
        for (int64_t r = 0; r < h && h <= 6 && w <= 6; ++r)
            for (int64_t c = 0; c < w; ++c) REQUIRE(count[r * 6 + c] == t);
    }
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_bytes in = {data, size};
    const unsigned what = fuzz_below(&in, 4);
    if (what == 0) fuzz_vision(&in);
    else if (what == 1) fuzz_packed(&in);
    else fuzz_walk(&in);
    return 0;
}

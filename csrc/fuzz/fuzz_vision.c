/*
 * libFuzzer harness for the vision-tower walks (posenc.h, "Vision towers"), through the
 * public API only, built with ASan + UBSan.  The input bytes make a batch of grids (now and
 * then a broken one: a zero, a negative value, a side the merge size does not divide), one
 * merge size or one per grid, and the options of each walk (some out of range).
 *
 * Every call returns a documented status.  On success: every frame's (row, col) ids are a
 * permutation of its grid; the boundaries grow from 0 to the patch count; the window index
 * is a permutation of the merged tokens; taps lie inside the table and a bilinear resample
 * with border padding weighs 1 in all; nearest ids lie inside the table.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "posenc.h"

enum { MAX_G = 6 };

static void check_positions(const pe_vision_grids *g, const pe_vision_sizes *s) {
    const int columns = 2 + (int)(s->patches % 2);
    int64_t *out = malloc(sizeof(int64_t) * (size_t)(columns * s->patches + 1));
    REQUIRE(pe_vision_positions(g, columns, out, s->patches, 1 + (int)(s->patches % 3), NULL) ==
            PE_OK);
    int64_t k = 0;
    for (int64_t i = 0; i < g->n; ++i) {
        const int64_t t = g->thw[3 * i], h = g->thw[3 * i + 1], w = g->thw[3 * i + 2];
        unsigned char *seen = calloc((size_t)(h * w), 1);
        for (int64_t f = 0; f < t; ++f) {
            memset(seen, 0, (size_t)(h * w));
            for (int64_t p = 0; p < h * w; ++p, ++k) {
                const int64_t *at = out + columns * k + (columns - 2);
                REQUIRE(at[0] >= 0 && at[0] < h && at[1] >= 0 && at[1] < w);
                REQUIRE(columns == 2 || at[-1] == f);
                REQUIRE(!seen[at[0] * w + at[1]]);
                seen[at[0] * w + at[1]] = 1;
            }
        }
        free(seen);
    }
    REQUIRE(k == s->patches);
    free(out);
}

static void check_cu(const pe_vision_grids *g, const pe_vision_sizes *s, int merge_temporal) {
    const int64_t n_cu = (merge_temporal ? g->n : s->frames) + 1;
    int32_t *cu = malloc(sizeof(int32_t) * (size_t)n_cu);
    int64_t longest = -1;
    const int rc = pe_vision_cu_seqlens(g, merge_temporal, cu, n_cu, &longest, NULL);
    REQUIRE(rc == PE_OK || (rc == PE_ERR_GRID && s->patches > INT32_MAX));
    if (rc == PE_OK) {
        REQUIRE(cu[0] == 0 && cu[n_cu - 1] == s->patches && longest >= 0);
        for (int64_t k = 1; k < n_cu; ++k)
            REQUIRE(cu[k] > cu[k - 1] && cu[k] - cu[k - 1] <= longest);
    }
    free(cu);
}

static void check_windows(const pe_vision_grids *g, const pe_vision_sizes *s, fuzz_bytes *in) {
    const int64_t window = fuzz_below(in, 64), patch = fuzz_below(in, 5);
    int64_t tokens, windows;
    const int rc = pe_vision_window_sizes(g, window, patch, &tokens, &windows, NULL);
    if (rc != PE_OK) {
        REQUIRE(rc == PE_ERR_ARG || rc == PE_ERR_GRID);
        return;
    }
    REQUIRE(tokens == s->tokens);
    int64_t *index = malloc(sizeof(int64_t) * (size_t)(tokens + 1));
    int32_t *cu = malloc(sizeof(int32_t) * (size_t)(windows + 1));
    REQUIRE(pe_vision_window_index(g, window, patch, index, tokens, cu, windows, 2, NULL) ==
            PE_OK);
    unsigned char *seen = calloc((size_t)tokens + 1, 1);
    for (int64_t k = 0; k < tokens; ++k) {
        REQUIRE(index[k] >= 0 && index[k] < tokens && !seen[index[k]]);
        seen[index[k]] = 1;
    }
    REQUIRE(cu[0] == 0 && cu[windows] == s->patches);
    for (int64_t k = 1; k <= windows; ++k) REQUIRE(cu[k] > cu[k - 1]);
    free(seen);
    free(index);
    free(cu);
}

static void check_interpolation(const pe_vision_grids *g, const pe_vision_sizes *s,
                                fuzz_bytes *in) {
    pe_vision_interp p;
    p.side = (int64_t)fuzz_below(in, 40) - 1;
    p.mode = (pe_interp_mode)fuzz_below(in, 3);
    p.align_corners = (int)fuzz_below(in, 2);
    p.padding = (pe_interp_padding)fuzz_below(in, 3);
    p.rule = (pe_interp_rule)(fuzz_below(in, 4) == 0 ? fuzz_below(in, 4) : 0);
    const int64_t taps = p.mode == PE_INTERP_BICUBIC ? 16 : 4;
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(taps * s->patches + 1));
    float *w = malloc(sizeof(float) * (size_t)(taps * s->patches + 1));
    const int rc = pe_vision_interpolation(g, &p, idx, w, s->patches, 2, NULL);
    const int valid = p.side >= 1 && (unsigned)p.mode <= 1 && (unsigned)p.padding <= 1 &&
                      ((unsigned)p.rule == 0 ||
                       ((unsigned)p.rule <= 2 && p.mode == PE_INTERP_BILINEAR && p.align_corners &&
                        p.padding == PE_INTERP_BORDER));
    REQUIRE(valid ? rc == PE_OK : rc == PE_ERR_ARG);
    if (rc == PE_OK) {
        for (int64_t k = 0; k < taps * s->patches; ++k)
            REQUIRE(idx[k] >= 0 && idx[k] < p.side * p.side && isfinite(w[k]));
        if (p.mode == PE_INTERP_BILINEAR && p.padding == PE_INTERP_BORDER)
            for (int64_t q = 0; q < s->patches; ++q)
                REQUIRE(fabsf(w[4 * q] + w[4 * q + 1] + w[4 * q + 2] + w[4 * q + 3] - 1.0f) <
                        1e-5f);
    }
    free(idx);
    free(w);
}

static void check_nearest(const pe_vision_grids *g, fuzz_bytes *in) {
    int64_t sizes[2 * MAX_G], total = 0;
    for (int64_t i = 0; i < g->n; ++i) {
        sizes[2 * i] = g->thw[3 * i + 1];
        sizes[2 * i + 1] = g->thw[3 * i + 2];
    }
    const int64_t side = (int64_t)fuzz_below(in, 70) - 1;
    REQUIRE(pe_vision_nearest_count(g->n, sizes, &total, NULL) == PE_OK);
    int64_t *out = malloc(sizeof(int64_t) * (size_t)(total + 1));
    const int rc = pe_vision_nearest_position_ids(g->n, sizes, side, out, total, 2, NULL);
    REQUIRE(side >= 1 ? rc == PE_OK : rc == PE_ERR_ARG);
    for (int64_t k = 0; rc == PE_OK && k < total; ++k) REQUIRE(out[k] >= 0 && out[k] < side * side);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_bytes in = {data, size};
    int64_t thw[3 * MAX_G], merges[MAX_G];
    const int64_t n = fuzz_below(&in, MAX_G + 1);
    const int per_grid = (int)fuzz_below(&in, 2);
    const int64_t merge = 1 + fuzz_below(&in, 4);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t m = per_grid ? 1 + fuzz_below(&in, 4) : merge;
        merges[i] = fuzz_below(&in, 32) == 0 ? 0 : m;
        thw[3 * i] = 1 + fuzz_below(&in, 3);
        thw[3 * i + 1] = m * (1 + fuzz_below(&in, 12));
        thw[3 * i + 2] = m * (1 + fuzz_below(&in, 12));
        switch (fuzz_below(&in, 24)) {
        case 0: thw[3 * i + fuzz_below(&in, 3)] = 0; break;
        case 1: thw[3 * i + 1] += 1; break;
        case 2: thw[3 * i + fuzz_below(&in, 3)] = -(int64_t)fuzz_below(&in, 3) - 1; break;
        default: break;
        }
    }
    const pe_vision_grids g = {n, thw, per_grid ? merges : NULL, merge};
    pe_vision_sizes s;
    pe_pos_error e;
    const int rc = pe_vision_sizes_of(&g, &s, &e);
    if (rc != PE_OK) {
        REQUIRE(rc == PE_ERR_GRID && e.grid >= 0 && e.grid < n &&
                (e.problem == PE_POS_BAD_GRID || e.problem == PE_POS_BAD_MERGE));
        /* every walk that reads merge sizes refuses the same batch */
        int64_t one;
        REQUIRE(pe_vision_positions(&g, 2, &one, 0, 1, NULL) == PE_ERR_GRID);
        return 0;
    }
    check_positions(&g, &s);
    check_cu(&g, &s, 0);
    check_cu(&g, &s, 1);
    check_windows(&g, &s, &in);
    check_interpolation(&g, &s, &in);
    check_nearest(&g, &in);
    return 0;
}

/*
 * Torch-free tests of the vision-tower walks (vision.c): the worked examples of posenc.h,
 * random batches against literal re-implementations (the window order by padding the LLM
 * grid and dropping repeated boundaries, as transformers does; the patch order from its
 * closed form), threaded against serial, and every kind of bad grid or argument.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "posenc.h"

static unsigned rng_state = 2525u;

static unsigned rnd(unsigned n) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return (rng_state >> 8) % n;
}

static pe_vision_grids grids_of(int64_t n, const int64_t *thw, int64_t m) {
    pe_vision_grids g = {n, thw, NULL, m};
    return g;
}

static int same_i64(const int64_t *a, const int64_t *b, int64_t n) {
    return n == 0 || memcmp(a, b, sizeof(int64_t) * (size_t)n) == 0;
}

/* ---- position ids --------------------------------------------------------------------- */

static void positions_examples(void) {
    const int64_t thw[6] = {1, 4, 4, 2, 2, 4};
    pe_vision_grids g = grids_of(2, thw, 2);
    pe_vision_sizes s;
    CHECK(pe_vision_sizes_of(&g, &s, NULL) == PE_OK && s.patches == 32 && s.frames == 3 &&
              s.tokens == 8, "sizes %lld %lld %lld", (long long)s.patches, (long long)s.frames,
          (long long)s.tokens);
    int64_t two[64], three[96];
    CHECK(pe_vision_positions(&g, 2, two, 32, 1, NULL) == PE_OK, "positions, 2 columns");
    const int64_t first[32] = {0, 0, 0, 1, 1, 0, 1, 1, 0, 2, 0, 3, 1, 2, 1, 3,
                               2, 0, 2, 1, 3, 0, 3, 1, 2, 2, 2, 3, 3, 2, 3, 3};
    const int64_t frame[16] = {0, 0, 0, 1, 1, 0, 1, 1, 0, 2, 0, 3, 1, 2, 1, 3};
    CHECK(same_i64(two, first, 32) && same_i64(two + 32, frame, 16) &&
              same_i64(two + 48, frame, 16), "positions (1,4,4), (2,2,4)");
    CHECK(pe_vision_positions(&g, 3, three, 32, 1, NULL) == PE_OK, "positions, 3 columns");
    int bad = 0;
    for (int64_t k = 0; k < 32; ++k) {
        const int64_t f = k < 16 ? 0 : k < 24 ? 0 : 1;
        bad += three[3 * k] != f || three[3 * k + 1] != two[2 * k] ||
               three[3 * k + 2] != two[2 * k + 1];
    }
    CHECK(bad == 0, "3 columns = frame, then the 2 columns (%d wrong)", bad);

    /* per-grid merge sizes: the first grid in raster order, the second in 2 x 2 blocks */
    const int64_t merges[2] = {1, 2};
    const int64_t raster[2 * 16] = {0, 0, 0, 1, 0, 2, 0, 3, 1, 0, 1, 1, 1, 2, 1, 3,
                                    2, 0, 2, 1, 2, 2, 2, 3, 3, 0, 3, 1, 3, 2, 3, 3};
    g.merge = merges;
    CHECK(pe_vision_positions(&g, 2, two, 32, 1, NULL) == PE_OK && same_i64(two, raster, 32) &&
              same_i64(two + 32, frame, 16), "per-grid merge sizes");
}

/* Random batches: the closed form of the patch order, threads against one thread. */
static void positions_random(void) {
    enum { N = 48 };
    int64_t thw[3 * N], merge[N];
    for (int i = 0; i < N; ++i) {
        merge[i] = 1 + rnd(4);
        thw[3 * i] = 1 + rnd(4);
        thw[3 * i + 1] = merge[i] * (1 + rnd(24));
        thw[3 * i + 2] = merge[i] * (1 + rnd(24));
    }
    /* past 2^18 patches: threads run */
    merge[5] = 2, thw[3 * 5] = 3, thw[3 * 5 + 1] = 256, thw[3 * 5 + 2] = 384;
    pe_vision_grids g = {N, thw, merge, 0};
    pe_vision_sizes s;
    CHECK(pe_vision_sizes_of(&g, &s, NULL) == PE_OK, "random sizes");
    for (int columns = 2; columns <= 3; ++columns) {
        int64_t *one = malloc(sizeof(int64_t) * (size_t)(columns * s.patches));
        int64_t *many = malloc(sizeof(int64_t) * (size_t)(columns * s.patches));
        CHECK(pe_vision_positions(&g, columns, one, s.patches, 1, NULL) == PE_OK &&
                  pe_vision_positions(&g, columns, many, s.patches, 4, NULL) == PE_OK,
              "random positions");
        CHECK(same_i64(one, many, columns * s.patches), "threads change the positions");
        int64_t k = 0;
        int bad = 0;
        for (int i = 0; i < N; ++i) {
            const int64_t t = thw[3 * i], h = thw[3 * i + 1], w = thw[3 * i + 2], m = merge[i];
            for (int64_t f = 0; f < t; ++f)
                for (int64_t p = 0; p < h * w; ++p, ++k) {
                    const int64_t block = p / (m * m), in = p % (m * m);
                    const int64_t row = block / (w / m) * m + in / m;
                    const int64_t col = block % (w / m) * m + in % m;
                    const int64_t *at = one + columns * k;
                    bad += columns == 3 ? at[0] != f || at[1] != row || at[2] != col
                                        : at[0] != row || at[1] != col;
                }
        }
        CHECK(bad == 0 && k == s.patches, "positions vs closed form (%d columns): %d wrong",
              columns, bad);
        free(one);
        free(many);
    }
}

/* ---- attention boundaries ------------------------------------------------------------- */

static void cu_seqlens(void) {
    const int64_t thw[6] = {2, 4, 4, 1, 2, 6};
    const pe_vision_grids g = grids_of(2, thw, 1);
    int32_t cu[4];
    int64_t longest = -1;
    CHECK(pe_vision_cu_seqlens(&g, 0, cu, 4, &longest, NULL) == PE_OK && cu[0] == 0 &&
              cu[1] == 16 && cu[2] == 32 && cu[3] == 44 && longest == 16, "per frame");
    CHECK(pe_vision_cu_seqlens(&g, 1, cu, 3, &longest, NULL) == PE_OK && cu[0] == 0 &&
              cu[1] == 32 && cu[2] == 44 && longest == 32, "per clip");
    CHECK(pe_vision_cu_seqlens(&g, 0, cu, 3, &longest, NULL) == PE_ERR_ARG, "wrong n_cu");
    /* merge sizes are not read: a grid not divisible by 2 is fine here */
    const int64_t odd[3] = {1, 3, 5};
    const pe_vision_grids h = grids_of(1, odd, 2);
    CHECK(pe_vision_cu_seqlens(&h, 0, cu, 2, &longest, NULL) == PE_OK && cu[1] == 15,
          "merge not read");
    const pe_vision_grids none = grids_of(0, NULL, 1);
    CHECK(pe_vision_cu_seqlens(&none, 0, cu, 1, &longest, NULL) == PE_OK && cu[0] == 0 &&
              longest == 0, "no grids");
    /* past int32: the row where the running sum passes 2^31 - 1 */
    const int64_t big[9] = {1, 2, 2, 1, 32768, 32768, 1, 32768, 32768};
    const pe_vision_grids b = grids_of(3, big, 1);
    int32_t cu4[4];
    pe_pos_error e;
    CHECK(pe_vision_cu_seqlens(&b, 1, cu4, 4, &longest, &e) == PE_ERR_GRID &&
              e.problem == PE_POS_INT32_OVERFLOW && e.grid == 2, "int32 overflow at row %lld",
          (long long)e.grid);
}

/* ---- window order --------------------------------------------------------------------- */

/* transformers' way: pad the LLM grid with -1 to whole windows plus one more row and column
 * of windows, read window by window, drop the padding and the repeated boundaries. */
static void window_reference(const int64_t *thw, int64_t n, int64_t m, int64_t ws,
                             int64_t *index, int32_t *cu, int64_t *n_index, int64_t *n_cu) {
    int64_t k = 0, c = 0, base = 0;
    int64_t last = 0;
    cu[c++] = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t t = thw[3 * i], lh = thw[3 * i + 1] / m, lw = thw[3 * i + 2] / m;
        const int64_t ph = lh + ws - lh % ws, pw = lw + ws - lw % ws;
        for (int64_t f = 0; f < t; ++f)
            for (int64_t wr = 0; wr < ph / ws; ++wr)
                for (int64_t wc = 0; wc < pw / ws; ++wc) {
                    int64_t count = 0;
                    for (int64_t r = wr * ws; r < (wr + 1) * ws; ++r)
                        for (int64_t q = wc * ws; q < (wc + 1) * ws; ++q)
                            if (r < lh && q < lw) {
                                index[k++] = base + f * lh * lw + r * lw + q;
                                ++count;
                            }
                    const int64_t next = last + count * m * m;
                    if (next != last) cu[c++] = (int32_t)next; /* unique_consecutive */
                    last = next;
                }
        base += t * lh * lw;
    }
    *n_index = k;
    *n_cu = c;
}

static void windows(void) {
    const int64_t one[3] = {1, 8, 12};
    pe_vision_grids g = grids_of(1, one, 2);
    int64_t tokens = 0, nw = 0, index[64];
    int32_t cu[8];
    CHECK(pe_vision_window_sizes(&g, 112, 14, &tokens, &nw, NULL) == PE_OK && tokens == 24 &&
              nw == 2, "window sizes %lld %lld", (long long)tokens, (long long)nw);
    const int64_t want[24] = {0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15, 18, 19, 20, 21,
                              4, 5, 10, 11, 16, 17, 22, 23};
    CHECK(pe_vision_window_index(&g, 112, 14, index, 24, cu, 2, 1, NULL) == PE_OK &&
              same_i64(index, want, 24) && cu[0] == 0 && cu[1] == 64 && cu[2] == 96,
          "window example 1");
    const int64_t two[6] = {1, 8, 8, 2, 4, 6};
    g = grids_of(2, two, 2);
    CHECK(pe_vision_window_sizes(&g, 112, 14, &tokens, &nw, NULL) == PE_OK && tokens == 28 &&
              nw == 3, "window sizes, example 2");
    int bad = 0;
    CHECK(pe_vision_window_index(&g, 112, 14, index, 28, cu, 3, 1, NULL) == PE_OK,
          "window example 2");
    for (int64_t k = 0; k < 28; ++k) bad += index[k] != k;
    CHECK(bad == 0 && cu[0] == 0 && cu[1] == 64 && cu[2] == 88 && cu[3] == 112,
          "window example 2 values");
    pe_pos_error e;
    CHECK(pe_vision_window_sizes(&g, 27, 14, &tokens, &nw, &e) == PE_ERR_ARG &&
              e.problem == PE_POS_BAD_ARG, "window side 0");
    CHECK(pe_vision_window_index(&g, 112, 14, index, 27, cu, 3, 1, &e) == PE_ERR_ARG,
          "wrong token count");
}

static void windows_random(void) {
    for (int trial = 0; trial < 300; ++trial) {
        const int64_t n = 1 + rnd(6), m = 1 + rnd(3), patch = 1 + rnd(3);
        const int64_t window = m * patch * (1 + rnd(5)) + rnd(m * patch);
        int64_t thw[18];
        for (int64_t i = 0; i < n; ++i) {
            thw[3 * i] = 1 + rnd(3);
            thw[3 * i + 1] = m * (1 + rnd(13));
            thw[3 * i + 2] = m * (1 + rnd(13));
        }
        const pe_vision_grids g = grids_of(n, thw, m);
        int64_t tokens, nw;
        if (pe_vision_window_sizes(&g, window, patch, &tokens, &nw, NULL) != PE_OK) {
            CHECK(0, "window sizes, trial %d", trial);
            continue;
        }
        int64_t *index = malloc(sizeof(int64_t) * (size_t)tokens);
        int64_t *ref = malloc(sizeof(int64_t) * (size_t)tokens);
        int32_t *cu = malloc(sizeof(int32_t) * (size_t)(nw + 1));
        int32_t *ref_cu = malloc(sizeof(int32_t) * (size_t)(4 * tokens + 8));
        int64_t n_ref, n_ref_cu;
        window_reference(thw, n, m, window / m / patch, ref, ref_cu, &n_ref, &n_ref_cu);
        CHECK(pe_vision_window_index(&g, window, patch, index, tokens, cu, nw, 1 + rnd(4), NULL) ==
                  PE_OK, "window index, trial %d", trial);
        CHECK(n_ref == tokens && same_i64(index, ref, tokens), "window index vs padded, trial %d",
              trial);
        CHECK(n_ref_cu == nw + 1 && memcmp(cu, ref_cu, sizeof(int32_t) * (size_t)(nw + 1)) == 0,
              "cu_window vs padded, trial %d", trial);
        free(index);
        free(ref);
        free(cu);
        free(ref_cu);
    }
}

/* ---- interpolation -------------------------------------------------------------------- */

static int same_f32(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

static void interpolation_example(void) {
    const int64_t thw[3] = {1, 2, 3};
    const pe_vision_grids g = grids_of(1, thw, 1);
    pe_vision_interp p = {2, PE_INTERP_BILINEAR, 0, PE_INTERP_BORDER, PE_INTERP_RULES_5};
    int64_t idx[24];
    float w[24];
    CHECK(pe_vision_interpolation(&g, &p, idx, w, 6, 1, NULL) == PE_OK, "interpolation");
    /* fp32 as transformers rounds it: src = ((0 + 0.5) * 2) / 3 - 0.5 */
    const float src0 = (0.5f * 2.0f) / 3.0f - 0.5f, f0 = floorf(src0);
    const float w00 = 1.0f - fabsf((src0 - f0) - 0.0f), w01 = 1.0f - fabsf((src0 - f0) - 1.0f);
    const int64_t i0[4] = {0, 0, 2, 2}, i1[4] = {0, 1, 2, 3}, i5[4] = {3, 3, 3, 3};
    const float v0[4] = {w00, w01, 0.0f, 0.0f}, v1[4] = {0.5f, 0.5f, 0.0f, 0.0f};
    CHECK(same_i64(idx, i0, 4) && same_f32(w, v0, 4), "patch (0,0): %g %g", w[0], w[1]);
    CHECK(w[0] == 0.16666663f && w[1] == 0.83333337f, "patch (0,0) in fp32: %.9g %.9g", w[0],
          w[1]);
    CHECK(same_i64(idx + 4, i1, 4) && same_f32(w + 4, v1, 4), "patch (0,1)");
    CHECK(same_i64(idx + 20, i5, 4) && w[20] == 0.83333337f && w[21] == 0.16666663f,
          "patch (1,2)");
    p.padding = PE_INTERP_ZEROS;
    CHECK(pe_vision_interpolation(&g, &p, idx, w, 6, 1, NULL) == PE_OK && w[0] == 0.0f &&
              w[1] == 0.83333337f && same_i64(idx, i0, 4), "zeros padding");
}

/* Properties over random grids and every flag: taps inside the table, weights of a
 * bilinear border resample summing to 1, threads = serial, frames repeated. */
static void interpolation_random(void) {
    for (int trial = 0; trial < 200; ++trial) {
        const int64_t n = 1 + rnd(5), m = 1 + rnd(2);
        int64_t thw[15];
        for (int64_t i = 0; i < n; ++i) {
            thw[3 * i] = 1 + rnd(3);
            thw[3 * i + 1] = m * (1 + rnd(20));
            thw[3 * i + 2] = m * (1 + rnd(20));
        }
        const int big = trial % 50 == 1; /* 2^18 patches: threads run */
        if (big) thw[0] = 1, thw[1] = 512, thw[2] = 512;
        const pe_vision_grids g = grids_of(n, thw, m);
        pe_vision_sizes s;
        pe_vision_sizes_of(&g, &s, NULL);
        pe_vision_interp p = {1 + rnd(50), rnd(2) ? PE_INTERP_BICUBIC : PE_INTERP_BILINEAR,
                              (int)rnd(2), rnd(2) ? PE_INTERP_ZEROS : PE_INTERP_BORDER,
                              PE_INTERP_RULES_5};
        if (big) p.mode = PE_INTERP_BILINEAR;
        if (trial % 4 == 0) {
            p.mode = PE_INTERP_BILINEAR;
            p.align_corners = 1;
            p.padding = PE_INTERP_BORDER;
            p.rule = trial % 8 ? PE_INTERP_LINSPACE : PE_INTERP_LINSPACE_TWO_ROUNDINGS;
        }
        const int64_t taps = p.mode == PE_INTERP_BILINEAR ? 4 : 16, size = s.patches * taps;
        int64_t *idx = malloc(sizeof(int64_t) * (size_t)size);
        int64_t *idx2 = malloc(sizeof(int64_t) * (size_t)size);
        float *w = malloc(sizeof(float) * (size_t)size), *w2 = malloc(sizeof(float) * (size_t)size);
        CHECK(pe_vision_interpolation(&g, &p, idx, w, s.patches, 1, NULL) == PE_OK &&
                  pe_vision_interpolation(&g, &p, idx2, w2, s.patches, 3, NULL) == PE_OK,
              "interpolation, trial %d", trial);
        CHECK(same_i64(idx, idx2, size) && same_f32(w, w2, size), "threads, trial %d", trial);
        int bad = 0;
        for (int64_t k = 0; k < size; ++k) bad += idx[k] < 0 || idx[k] >= p.side * p.side;
        if (p.mode == PE_INTERP_BILINEAR && p.padding == PE_INTERP_BORDER)
            for (int64_t q = 0; q < s.patches; ++q) {
                const float *v = w + 4 * q;
                bad += fabsf(v[0] + v[1] + v[2] + v[3] - 1.0f) > 1e-5f;
            }
        int64_t at = 0; /* every frame after the first repeats it */
        for (int64_t i = 0; i < n; ++i) {
            const int64_t frame = thw[3 * i + 1] * thw[3 * i + 2] * taps;
            for (int64_t f = 1; f < thw[3 * i]; ++f)
                bad += !same_i64(idx + at, idx + at + f * frame, frame) ||
                       !same_f32(w + at, w + at + f * frame, frame);
            at += thw[3 * i] * frame;
        }
        CHECK(bad == 0, "interpolation properties, trial %d: %d wrong", trial, bad);
        free(idx);
        free(idx2);
        free(w);
        free(w2);
    }
}

/* 4.57's torch.linspace, on its own: side 2 over 10 rows puts row 6 at 1 - 3 * (1/9). */
static void interpolation_linspace(void) {
    const int64_t thw[3] = {1, 10, 1};
    const pe_vision_grids g = grids_of(1, thw, 1);
    pe_vision_interp p = {2, PE_INTERP_BILINEAR, 1, PE_INTERP_BORDER, PE_INTERP_LINSPACE};
    int64_t idx[40];
    float w[40], w2[40];
    CHECK(pe_vision_interpolation(&g, &p, idx, w, 10, 1, NULL) == PE_OK, "linspace");
    p.rule = PE_INTERP_LINSPACE_TWO_ROUNDINGS;
    CHECK(pe_vision_interpolation(&g, &p, idx, w2, 10, 1, NULL) == PE_OK, "linspace, two");
    /* row 6: src 0.6666667 (one rounding) or 0.6666666 (two); the weight of tap 1 is src */
    CHECK(w[4 * 6 + 2] == 0.6666667f && w2[4 * 6 + 2] == 0.6666666f, "row 6: %.9g %.9g",
          w[4 * 6 + 2], w2[4 * 6 + 2]);
    p.mode = PE_INTERP_BICUBIC;
    CHECK(pe_vision_interpolation(&g, &p, idx, w, 10, 1, NULL) == PE_ERR_ARG,
          "linspace is bilinear only");
}

/* ---- nearest-neighbour ids ------------------------------------------------------------ */

static void nearest(void) {
    const int64_t sizes[2] = {2, 3};
    int64_t total = 0, out[6];
    CHECK(pe_vision_nearest_count(1, sizes, &total, NULL) == PE_OK && total == 6, "count");
    const int64_t want[6] = {0, 1, 2, 8, 9, 10};
    CHECK(pe_vision_nearest_position_ids(1, sizes, 4, out, 6, 1, NULL) == PE_OK &&
              same_i64(out, want, 6), "nearest example");
    const int64_t one[2] = {3, 1};
    CHECK(pe_vision_nearest_position_ids(1, one, 1, out, 3, 1, NULL) == PE_OK && out[0] == 0 &&
              out[1] == 0 && out[2] == 0, "side 1");
    pe_pos_error e;
    const int64_t bad[4] = {2, 2, 0, 3};
    CHECK(pe_vision_nearest_count(2, bad, &total, &e) == PE_ERR_GRID &&
              e.problem == PE_POS_BAD_GRID && e.grid == 1, "nearest bad size");
    CHECK(pe_vision_nearest_position_ids(1, sizes, 0, out, 6, 1, &e) == PE_ERR_ARG, "side 0");
}

/* ---- bad grids and arguments ---------------------------------------------------------- */

static void errors(void) {
    pe_pos_error e;
    pe_vision_sizes s;
    int64_t out[64];
    const int64_t cases[][6] = {
        {1, 4, 4, 1, 4, 3},   /* w not divisible by 2 */
        {1, 4, 4, 0, 4, 4},   /* t = 0 */
        {1, 4, 4, 1, -2, 4},  /* negative */
    };
    for (int c = 0; c < 3; ++c) {
        const pe_vision_grids g = grids_of(2, cases[c], 2);
        CHECK(pe_vision_sizes_of(&g, &s, &e) == PE_ERR_GRID && e.problem == PE_POS_BAD_GRID &&
                  e.grid == 1, "bad grid case %d", c);
        CHECK(pe_vision_positions(&g, 2, out, 32, 1, &e) == PE_ERR_GRID && e.grid == 1,
              "positions, bad grid case %d", c);
    }
    const int64_t thw[6] = {1, 4, 4, 1, 4, 4};
    const int64_t merges[2] = {2, 0};
    pe_vision_grids g = {2, thw, merges, 0};
    CHECK(pe_vision_sizes_of(&g, &s, &e) == PE_ERR_GRID && e.problem == PE_POS_BAD_MERGE &&
              e.grid == 1 && e.found == 0, "bad merge size");
    g.merge = NULL;
    g.merge_size = 2;
    CHECK(pe_vision_positions(&g, 4, out, 32, 1, &e) == PE_ERR_ARG, "columns 4");
    CHECK(pe_vision_positions(&g, 2, out, 31, 1, &e) == PE_ERR_ARG, "wrong patch count");
    CHECK(pe_vision_positions(&g, 2, NULL, 32, 1, &e) == PE_ERR_ARG, "NULL out");
    CHECK(pe_vision_sizes_of(NULL, &s, &e) == PE_ERR_ARG, "NULL grids");
    g.n = -1;
    CHECK(pe_vision_sizes_of(&g, &s, &e) == PE_ERR_ARG, "negative n");
    const int64_t huge[3] = {1LL << 40, 1LL << 40, 1LL << 40};
    g = grids_of(1, huge, 1);
    CHECK(pe_vision_sizes_of(&g, &s, &e) == PE_ERR_GRID && e.grid == 0, "huge grid");
    const pe_vision_grids ok = grids_of(2, thw, 2);
    pe_vision_interp p = {0, PE_INTERP_BILINEAR, 1, PE_INTERP_BORDER, PE_INTERP_RULES_5};
    float w[128];
    CHECK(pe_vision_interpolation(&ok, &p, out, w, 32, 1, &e) == PE_ERR_ARG, "side 0");
    p.side = 4;
    p.mode = (pe_interp_mode)7;
    CHECK(pe_vision_interpolation(&ok, &p, out, w, 32, 1, &e) == PE_ERR_ARG, "mode 7");
    p.mode = PE_INTERP_BILINEAR;
    p.padding = (pe_interp_padding)3;
    CHECK(pe_vision_interpolation(&ok, &p, out, w, 32, 1, &e) == PE_ERR_ARG, "padding 3");
    p.padding = PE_INTERP_BORDER;
    p.rule = (pe_interp_rule)9;
    CHECK(pe_vision_interpolation(&ok, &p, out, w, 32, 1, &e) == PE_ERR_ARG, "rule 9");
    p.rule = PE_INTERP_RULES_5;
    int64_t tokens, nw;
    CHECK(pe_vision_window_sizes(&ok, 0, 14, &tokens, &nw, &e) == PE_ERR_ARG, "window 0");
    CHECK(pe_vision_window_sizes(&ok, 112, 0, &tokens, &nw, &e) == PE_ERR_ARG, "patch 0");
    /* empty batches */
    const pe_vision_grids none = grids_of(0, NULL, 2);
    CHECK(pe_vision_positions(&none, 2, NULL, 0, 1, NULL) == PE_OK, "empty positions");
    int32_t cu[1] = {7};
    CHECK(pe_vision_window_sizes(&none, 112, 14, &tokens, &nw, NULL) == PE_OK && tokens == 0 &&
              nw == 0 && pe_vision_window_index(&none, 112, 14, NULL, 0, cu, 0, 1, NULL) == PE_OK &&
              cu[0] == 0, "empty windows");
    CHECK(pe_vision_interpolation(&none, &p, NULL, NULL, 0, 1, NULL) == PE_OK, "empty taps");
}

int main(void) {
    positions_examples();
    positions_random();
    cu_seqlens();
    windows();
    windows_random();
    interpolation_example();
    interpolation_random();
    interpolation_linspace();
    nearest();
    errors();
    return check_report("test_vision");
}

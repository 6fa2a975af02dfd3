/* Vision towers: patch position ids, attention boundaries, window order, interpolation taps
 * and nearest-neighbour ids, from the patch grids.  Specification in posenc.h.
 *
 * The fp32 arithmetic of the interpolation weights must round exactly as transformers'
 * torch expression does: one rounding per operation, in its order, never contracted into a
 * fused multiply-add (meson.build compiles the kernels with -ffp-contract=off); the one
 * fused operation, torch.linspace's, is an explicit fmaf. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* A per-patch walk costs about a nanosecond per patch (every frame after a grid's first is
 * a copy), so below 2^18 patches a call is a few hundred microseconds: less than what a
 * thread team can cost to wake on a busy machine. */
#define PE_VISION_SERIAL_PATCHES ((int64_t)1 << 18)

/* Sums over the batch stay below this, far from int64 overflow in any product below. */
#define PE_VISION_MAX_TOTAL ((int64_t)1 << 62)

static void set_error(pe_pos_error *err, pe_pos_problem problem, int64_t grid) {
    if (!err) return;
    memset(err, 0, sizeof *err);
    err->problem = problem;
    err->frame = err->row = err->token = err->example = -1;
    err->grid = grid;
}

static int bad_arg(pe_pos_error *err) {
    set_error(err, PE_POS_BAD_ARG, -1);
    return PE_ERR_ARG;
}

static int64_t merge_of(const pe_vision_grids *g, int64_t i) {
    return g->merge ? g->merge[i] : g->merge_size;
}

/* Checks grid i: values >= 1 and, with use_merge, h and w divisible by a merge size >= 1.
 * Adds its patches, frames and merged tokens to s (sums bounded by PE_VISION_MAX_TOTAL). */
static int check_grid(const pe_vision_grids *g, int64_t i, int use_merge, pe_vision_sizes *s,
                      pe_pos_error *err) {
    const int64_t *r = g->thw + 3 * i;
    const int64_t t = r[0], h = r[1], w = r[2];
    const int64_t m = use_merge ? merge_of(g, i) : 1;
    if (m < 1) {
        set_error(err, PE_POS_BAD_MERGE, i);
        if (err) err->found = m;
        return PE_ERR_GRID;
    }
    int64_t hw, patches;
    if (t < 1 || h < 1 || w < 1 || h % m || w % m || __builtin_mul_overflow(h, w, &hw) ||
        __builtin_mul_overflow(t, hw, &patches) || patches >= PE_VISION_MAX_TOTAL - s->patches) {
        set_error(err, PE_POS_BAD_GRID, i);
        return PE_ERR_GRID;
    }
    s->patches += patches;
    s->frames += t;
    s->tokens += t * (h / m) * (w / m);
    return PE_OK;
}

static int check_grids(const pe_vision_grids *g, int use_merge, pe_vision_sizes *s,
                       pe_pos_error *err) {
    memset(s, 0, sizeof *s);
    set_error(err, PE_POS_NONE, -1);
    if (!g || g->n < 0 || (g->n > 0 && !g->thw)) return bad_arg(err);
    for (int64_t i = 0; i < g->n; ++i) {
        const int rc = check_grid(g, i, use_merge, s, err);
        if (rc != PE_OK) return rc;
    }
    return PE_OK;
}

int pe_vision_sizes_of(const pe_vision_grids *g, pe_vision_sizes *sizes, pe_pos_error *err) {
    if (!sizes) return bad_arg(err);
    return check_grids(g, 1, sizes, err);
}

/* Start of each grid's rows in a per-patch output (n + 1 entries: patch prefix sums), or
 * NULL when out of memory. */
static int64_t *patch_offsets(const pe_vision_grids *g) {
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(g->n + 1));
    if (!off) return NULL;
    off[0] = 0;
    for (int64_t i = 0; i < g->n; ++i) {
        const int64_t *r = g->thw + 3 * i;
        off[i + 1] = off[i] + r[0] * r[1] * r[2];
    }
    return off;
}

static int walk_threads(int nthreads, int64_t n_grids, int64_t patches) {
    if (nthreads <= 1 || n_grids <= 1 || patches < PE_VISION_SERIAL_PATCHES) return 1;
    return nthreads < n_grids ? nthreads : (int)n_grids;
}

/* Frame f >= 1 of a grid: a copy of frame 0 (`frame` elements of `size` bytes each). */
static void repeat_frames(void *dst, int64_t t, int64_t frame, size_t size) {
    const size_t bytes = (size_t)frame * size;
    for (int64_t f = 1; f < t; ++f) memcpy((char *)dst + (size_t)f * bytes, dst, bytes);
}

/* ---- position ids --------------------------------------------------------------------- */

/* One frame (h, w) in patch order, `columns` int64 per patch; column 0 of a 3-column frame
 * is left for the caller. */
static void position_frame(int64_t h, int64_t w, int64_t m, int columns, int64_t *out) {
    int64_t *p = out + (columns - 2);
    for (int64_t bh = 0; bh < h / m; ++bh)
        for (int64_t bw = 0; bw < w / m; ++bw)
            for (int64_t ih = 0; ih < m; ++ih)
                for (int64_t iw = 0; iw < m; ++iw, p += columns) {
                    p[0] = bh * m + ih;
                    p[1] = bw * m + iw;
                }
}

int pe_vision_positions(const pe_vision_grids *g, int columns, int64_t *out, int64_t patches,
                        int nthreads, pe_pos_error *err) {
    pe_vision_sizes s;
    const int rc = check_grids(g, 1, &s, err);
    if (rc != PE_OK) return rc;
    if ((columns != 2 && columns != 3) || s.patches != patches || (patches > 0 && !out))
        return bad_arg(err);
    if (g->n == 0) return PE_OK;
    int64_t *off = patch_offsets(g);
    if (!off) return PE_ERR_NOMEM;
    const int nt = walk_threads(nthreads, g->n, patches);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int64_t i = 0; i < g->n; ++i) {
        const int64_t t = g->thw[3 * i], h = g->thw[3 * i + 1], w = g->thw[3 * i + 2];
        int64_t *dst = out + columns * off[i];
        position_frame(h, w, merge_of(g, i), columns, dst);
        if (columns == 2) {
            repeat_frames(dst, t, 2 * h * w, sizeof(int64_t));
            continue;
        }
        for (int64_t f = 0; f < t; ++f) {
            int64_t *frame = dst + 3 * f * h * w;
            if (f > 0) memcpy(frame, dst, sizeof(int64_t) * (size_t)(3 * h * w));
            for (int64_t k = 0; k < h * w; ++k) frame[3 * k] = f;
        }
    }
    free(off);
    return PE_OK;
}

/* ---- attention boundaries ------------------------------------------------------------- */

int pe_vision_cu_seqlens(const pe_vision_grids *g, int merge_temporal, int32_t *cu, int64_t n_cu,
                         int64_t *max_seqlen, pe_pos_error *err) {
    pe_vision_sizes s;
    const int rc = check_grids(g, 0, &s, err);
    if (rc != PE_OK) return rc;
    const int64_t want = (merge_temporal ? g->n : s.frames) + 1;
    if (n_cu != want || !cu || !max_seqlen) return bad_arg(err);
    int64_t sum = 0, longest = 0, k = 0;
    cu[k++] = 0;
    for (int64_t i = 0; i < g->n; ++i) {
        const int64_t t = g->thw[3 * i], hw = g->thw[3 * i + 1] * g->thw[3 * i + 2];
        const int64_t len = merge_temporal ? t * hw : hw, segments = merge_temporal ? 1 : t;
        if (len > INT32_MAX || segments > (INT32_MAX - sum) / len) {
            set_error(err, PE_POS_INT32_OVERFLOW, i);
            return PE_ERR_GRID;
        }
        for (int64_t f = 0; f < segments; ++f) {
            sum += len;
            cu[k++] = (int32_t)sum;
        }
        if (len > longest) longest = len;
    }
    *max_seqlen = longest;
    return PE_OK;
}

/* ---- window order --------------------------------------------------------------------- */

static int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

/* Window side (in merged tokens) of grid i, or 0 when it has none. */
static int64_t window_side(const pe_vision_grids *g, int64_t i, int64_t window_size,
                           int64_t patch_size) {
    return window_size / merge_of(g, i) / patch_size;
}

int pe_vision_window_sizes(const pe_vision_grids *g, int64_t window_size, int64_t patch_size,
                           int64_t *tokens, int64_t *windows, pe_pos_error *err) {
    pe_vision_sizes s;
    if (window_size < 1 || patch_size < 1 || !tokens || !windows) return bad_arg(err);
    const int rc = check_grids(g, 1, &s, err);
    if (rc != PE_OK) return rc;
    int64_t nw = 0;
    for (int64_t i = 0; i < g->n; ++i) {
        const int64_t ws = window_side(g, i, window_size, patch_size);
        if (ws < 1) return bad_arg(err);
        const int64_t m = merge_of(g, i), *r = g->thw + 3 * i;
        nw += r[0] * ceil_div(r[1] / m, ws) * ceil_div(r[2] / m, ws);
    }
    if (s.patches > INT32_MAX) {
        /* the grid where the running patch count passes int32 */
        int64_t sum = 0, i = 0;
        for (; i < g->n; ++i) {
            sum += g->thw[3 * i] * g->thw[3 * i + 1] * g->thw[3 * i + 2];
            if (sum > INT32_MAX) break;
        }
        set_error(err, PE_POS_INT32_OVERFLOW, i);
        return PE_ERR_GRID;
    }
    *tokens = s.tokens;
    *windows = nw;
    return PE_OK;
}

/* Grid i's window order: tokens numbered from `base`, `next` its patch boundaries from
 * `start` (patches before it). */
static void window_grid(const pe_vision_grids *g, int64_t i, int64_t ws, int64_t base,
                        int64_t start, int64_t *index, int32_t *next) {
    const int64_t m = merge_of(g, i), t = g->thw[3 * i];
    const int64_t lh = g->thw[3 * i + 1] / m, lw = g->thw[3 * i + 2] / m;
    int64_t at = start;
    for (int64_t f = 0; f < t; ++f) {
        const int64_t frame = base + f * lh * lw;
        for (int64_t r0 = 0; r0 < lh; r0 += ws)
            for (int64_t c0 = 0; c0 < lw; c0 += ws) {
                const int64_t r1 = r0 + ws < lh ? r0 + ws : lh, c1 = c0 + ws < lw ? c0 + ws : lw;
                for (int64_t r = r0; r < r1; ++r)
                    for (int64_t c = c0; c < c1; ++c) *index++ = frame + r * lw + c;
                at += (r1 - r0) * (c1 - c0) * m * m;
                *next++ = (int32_t)at;
            }
    }
}

int pe_vision_window_index(const pe_vision_grids *g, int64_t window_size, int64_t patch_size,
                           int64_t *index, int64_t tokens, int32_t *cu_window, int64_t windows,
                           int nthreads, pe_pos_error *err) {
    int64_t want_tokens, want_windows;
    const int rc = pe_vision_window_sizes(g, window_size, patch_size, &want_tokens, &want_windows,
                                          err);
    if (rc != PE_OK) return rc;
    if (tokens != want_tokens || windows != want_windows || (tokens > 0 && !index) || !cu_window)
        return bad_arg(err);
    cu_window[0] = 0;
    if (g->n == 0) return PE_OK;
    /* per grid: first token, first window, patches before it */
    int64_t *off = malloc(sizeof(int64_t) * 3 * (size_t)(g->n + 1));
    if (!off) return PE_ERR_NOMEM;
    off[0] = off[1] = off[2] = 0;
    for (int64_t i = 0; i < g->n; ++i) {
        const int64_t m = merge_of(g, i), *r = g->thw + 3 * i;
        const int64_t ws = window_side(g, i, window_size, patch_size);
        off[3 * i + 3] = off[3 * i] + r[0] * (r[1] / m) * (r[2] / m);
        off[3 * i + 4] = off[3 * i + 1] + r[0] * ceil_div(r[1] / m, ws) * ceil_div(r[2] / m, ws);
        off[3 * i + 5] = off[3 * i + 2] + r[0] * r[1] * r[2];
    }
    const int nt = walk_threads(nthreads, g->n, off[3 * g->n + 2]);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int64_t i = 0; i < g->n; ++i)
        window_grid(g, i, window_side(g, i, window_size, patch_size), off[3 * i],
                    off[3 * i + 2], index + off[3 * i], cu_window + 1 + off[3 * i + 1]);
    free(off);
    return PE_OK;
}

/* ---- interpolation taps --------------------------------------------------------------- */

/* The taps and weights of one axis of length L at every target 0 .. L-1 (n per target),
 * transformers 5.x's closed form. */
static void axis_rules_5(const pe_vision_interp *p, int64_t L, int n, int64_t *tap,
                         float *weight) {
    const int64_t S = p->side;
    const float side = (float)S, last = (float)(S - 1);
    const float denom = (float)(L - 1 > 1 ? L - 1 : 1), length = (float)L;
    const int64_t first = n == 2 ? 0 : -1;
    for (int64_t x = 0; x < L; ++x) {
        const float fx = (float)x;
        const float src =
            p->align_corners ? (fx * last) / denom : ((fx + 0.5f) * side) / length - 0.5f;
        const float f = floorf(src);
        const float frac = src - f;
        for (int j = 0; j < n; ++j) {
            const int64_t o = first + j, raw = (int64_t)f + o;
            const float d = fabsf(frac - (float)o);
            float w;
            if (p->mode == PE_INTERP_BILINEAR) {
                w = 1.0f - d;
                w = w < 0.0f ? 0.0f : w;
            } else if (d <= 1.0f) {
                w = (1.25f * d - 2.25f) * d * d + 1.0f;
            } else {
                w = ((-0.75f * d - -3.75f) * d + -6.0f) * d - -3.0f;
            }
            if (p->padding == PE_INTERP_ZEROS) w = w * (raw >= 0 && raw <= S - 1 ? 1.0f : 0.0f);
            tap[x * n + j] = raw < 0 ? 0 : raw > S - 1 ? S - 1 : raw;
            weight[x * n + j] = w;
        }
    }
}

/* transformers 4.57 (Qwen3-VL's fast_pos_embed_interpolate): torch.linspace(0, S-1, L). */
static void axis_linspace(const pe_vision_interp *p, int64_t L, int64_t *tap, float *weight) {
    const int64_t S = p->side;
    const float end = (float)(S - 1);
    const float step = L > 1 ? end / (float)(L - 1) : 0.0f;
    for (int64_t x = 0; x < L; ++x) {
        float src;
        if (L == 1 || x < L / 2) {
            src = step * (float)x;
        } else if (p->rule == PE_INTERP_LINSPACE) {
            src = fmaf(-step, (float)(L - 1 - x), end);
        } else {
            src = end - step * (float)(L - 1 - x);
        }
        const int64_t f = (int64_t)src;
        const float d = src - (float)f;
        tap[2 * x] = f;
        tap[2 * x + 1] = f + 1 < S - 1 ? f + 1 : S - 1;
        weight[2 * x] = 1.0f - d;
        weight[2 * x + 1] = d;
    }
}

static void axis_taps(const pe_vision_interp *p, int64_t L, int n, int64_t *tap, float *weight) {
    if (p->rule == PE_INTERP_RULES_5)
        axis_rules_5(p, L, n, tap, weight);
    else
        axis_linspace(p, L, tap, weight);
}

/* Bytes of interp_grid's scratch for a grid of h + w = sides: the per-axis taps and weights
 * (n per row and column), then each spread over the n*n taps of a patch. */
static size_t interp_scratch_bytes(int64_t sides, int n) {
    return (size_t)sides * (size_t)(n + n * n) * (sizeof(int64_t) + sizeof(float));
}

/* One frame in patch order, `taps` (4 or 16, a constant where it is inlined) per patch: tap
 * k of the patch at (row, col) is rows[row*taps + k] + cols[col*taps + k] and its weight
 * urow[row*taps + k] * vcol[col*taps + k], one fp32 multiply. */
static inline void interp_frame(int64_t h, int64_t w, int64_t m, int64_t taps,
                                const int64_t *restrict rows, const float *restrict urow,
                                const int64_t *restrict cols, const float *restrict vcol,
                                int64_t *restrict indices, float *restrict weights) {
    for (int64_t bh = 0; bh < h / m; ++bh)
        for (int64_t ih = 0; ih < m; ++ih) {
            const int64_t row = bh * m + ih;
            const int64_t *a = rows + row * taps;
            const float *u = urow + row * taps;
            const int64_t first = (bh * (w / m) * m + ih) * m; /* patch (row, 0) */
            for (int64_t bw = 0; bw < w / m; ++bw)
                for (int64_t iw = 0; iw < m; ++iw) {
                    const int64_t col = bw * m + iw, k = first + bw * m * m + iw;
                    const int64_t *b = cols + col * taps;
                    const float *v = vcol + col * taps;
                    int64_t *ip = indices + k * taps;
                    float *wp = weights + k * taps;
                    for (int64_t j = 0; j < taps; ++j) {
                        ip[j] = a[j] + b[j];
                        wp[j] = u[j] * v[j];
                    }
                }
        }
}

/* Grid i into its rows of indices / weights, with `scratch` of interp_scratch_bytes. */
static void interp_grid(const pe_vision_grids *g, int64_t i, const pe_vision_interp *p, int n,
                        void *scratch, int64_t *indices, float *weights) {
    const int64_t t = g->thw[3 * i], h = g->thw[3 * i + 1], w = g->thw[3 * i + 2];
    const int64_t m = merge_of(g, i), S = p->side, taps = (int64_t)n * n;
    int64_t *htap = scratch, *wtap = htap + h * n, *rows = wtap + w * n, *cols = rows + h * taps;
    float *hwt = (float *)(cols + w * taps), *wwt = hwt + h * n, *urow = wwt + w * n;
    float *vcol = urow + h * taps;
    axis_taps(p, h, n, htap, hwt);
    axis_taps(p, w, n, wtap, wwt);
    /* tap k = r*n + c of a patch: row part r, column part c */
    for (int64_t y = 0; y < h; ++y)
        for (int64_t k = 0; k < taps; ++k) {
            rows[y * taps + k] = htap[y * n + k / n] * S;
            urow[y * taps + k] = hwt[y * n + k / n];
        }
    for (int64_t x = 0; x < w; ++x)
        for (int64_t k = 0; k < taps; ++k) {
            cols[x * taps + k] = wtap[x * n + k % n];
            vcol[x * taps + k] = wwt[x * n + k % n];
        }
    if (taps == 4)
        interp_frame(h, w, m, 4, rows, urow, cols, vcol, indices, weights);
    else
        interp_frame(h, w, m, 16, rows, urow, cols, vcol, indices, weights);
    repeat_frames(indices, t, h * w * taps, sizeof(int64_t));
    repeat_frames(weights, t, h * w * taps, sizeof(float));
}

int pe_vision_interpolation(const pe_vision_grids *g, const pe_vision_interp *p, int64_t *indices,
                            float *weights, int64_t patches, int nthreads, pe_pos_error *err) {
    if (!p || p->side < 1 || p->side > INT32_MAX ||
        (p->mode != PE_INTERP_BILINEAR && p->mode != PE_INTERP_BICUBIC) ||
        (p->padding != PE_INTERP_BORDER && p->padding != PE_INTERP_ZEROS))
        return bad_arg(err);
    if (p->rule != PE_INTERP_RULES_5 &&
        (p->rule != PE_INTERP_LINSPACE && p->rule != PE_INTERP_LINSPACE_TWO_ROUNDINGS))
        return bad_arg(err);
    if (p->rule != PE_INTERP_RULES_5 &&
        (p->mode != PE_INTERP_BILINEAR || !p->align_corners || p->padding != PE_INTERP_BORDER))
        return bad_arg(err);
    pe_vision_sizes s;
    const int rc = check_grids(g, 1, &s, err);
    if (rc != PE_OK) return rc;
    const int n = p->mode == PE_INTERP_BILINEAR ? 2 : 4;
    if (s.patches != patches || (patches > 0 && (!indices || !weights))) return bad_arg(err);
    if (s.patches > PE_VISION_MAX_TOTAL / (n * n)) return bad_arg(err);
    if (g->n == 0) return PE_OK;
    int64_t *off = patch_offsets(g);
    if (!off) return PE_ERR_NOMEM;
    int64_t longest = 0; /* the most rows + columns of a grid: the scratch size */
    for (int64_t i = 0; i < g->n; ++i) {
        const int64_t sides = g->thw[3 * i + 1] + g->thw[3 * i + 2];
        if (sides > longest) longest = sides;
    }
    const size_t scratch_bytes = interp_scratch_bytes(longest, n);
    const int nt = walk_threads(nthreads, g->n, patches);
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        void *scratch = malloc(scratch_bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < g->n; ++i) {
            if (!scratch) continue;
            const int64_t at = off[i] * n * n;
            interp_grid(g, i, p, n, scratch, indices + at, weights + at);
        }
        free(scratch);
    }
    free(off);
    return failed ? PE_ERR_NOMEM : PE_OK;
}

/* ---- nearest-neighbour ids ------------------------------------------------------------ */

int pe_vision_nearest_count(int64_t n, const int64_t *sizes, int64_t *total, pe_pos_error *err) {
    set_error(err, PE_POS_NONE, -1);
    if (n < 0 || (n > 0 && !sizes) || !total) return bad_arg(err);
    int64_t sum = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t h = sizes[2 * i], w = sizes[2 * i + 1];
        int64_t hw;
        if (h < 1 || w < 1 || __builtin_mul_overflow(h, w, &hw) ||
            hw >= PE_VISION_MAX_TOTAL - sum) {
            set_error(err, PE_POS_BAD_GRID, i);
            return PE_ERR_GRID;
        }
        sum += hw;
    }
    *total = sum;
    return PE_OK;
}

/* Bucket of every coordinate y / L, y = 0 .. L-1, against the sorted boundaries. */
static void nearest_axis(int64_t L, const float *bound, int64_t nb, int64_t *bucket) {
    int64_t k = 0;
    const float length = (float)L;
    for (int64_t y = 0; y < L; ++y) {
        const float c = (float)y / length;
        while (k < nb && bound[k] <= c) ++k; /* c grows with y */
        bucket[y] = k;
    }
}

/* torch.arange(start, ., step) in fp32 as torch's CPU kernel computes it: blocks of 16
 * values as two vectors of 8, each from a base fl32(start + step * j) plus k * step in
 * double, then the values left one by one as fl32(start + step * j). */
static void arange_f32(double start, double step, int64_t count, float *out) {
    int64_t j = 0;
    for (; j + 16 <= count; j += 16)
        for (int64_t v = j; v < j + 16; v += 8) {
            const float base = (float)(start + step * (double)v);
            for (int k = 0; k < 8; ++k) out[v + k] = (float)((double)base + (double)k * step);
        }
    for (; j < count; ++j) out[j] = (float)(start + step * (double)j);
}

int pe_vision_nearest_position_ids(int64_t n, const int64_t *sizes, int64_t side, int64_t *out,
                                   int64_t total, int nthreads, pe_pos_error *err) {
    int64_t want;
    if (side < 1 || side > INT32_MAX) return bad_arg(err);
    const int rc = pe_vision_nearest_count(n, sizes, &want, err);
    if (rc != PE_OK) return rc;
    if (want != total || (total > 0 && !out)) return bad_arg(err);
    if (n == 0) return PE_OK;
    const double step = 1.0 / (double)side;
    const double count = ceil((1.0 - step) / step);
    const int64_t nb = count > 0 ? (int64_t)count : 0;
    int64_t longest = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t sides = sizes[2 * i] + sizes[2 * i + 1];
        if (sides > longest) longest = sides;
    }
    float *bound = malloc(sizeof(float) * (size_t)(nb > 0 ? nb : 1));
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!bound || !off) {
        free(bound);
        free(off);
        return PE_ERR_NOMEM;
    }
    arange_f32(step, step, nb, bound);
    off[0] = 0;
    for (int64_t i = 0; i < n; ++i) off[i + 1] = off[i] + sizes[2 * i] * sizes[2 * i + 1];
    const int nt = walk_threads(nthreads, n, total);
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int64_t *bucket = malloc(sizeof(int64_t) * (size_t)longest);
        if (!bucket) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) {
            if (!bucket) continue;
            const int64_t h = sizes[2 * i], w = sizes[2 * i + 1];
            int64_t *hb = bucket, *wb = bucket + h, *dst = out + off[i];
            nearest_axis(h, bound, nb, hb);
            nearest_axis(w, bound, nb, wb);
            for (int64_t y = 0; y < h; ++y)
                for (int64_t x = 0; x < w; ++x) *dst++ = hb[y] * side + wb[x];
        }
        free(bucket);
    }
    free(bound);
    free(off);
    return failed ? PE_ERR_NOMEM : PE_OK;
}

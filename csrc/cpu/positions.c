/* Position ids: multimodal RoPE ids for the decoder (get_rope_index) and the vision
 * tower's (row, col) patch ids.  Specification in posenc.h. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Position ids cost about a nanosecond per token serially; a parallel region only pays off
 * (and is only worth its wake-up risk on a busy machine) for batches well past that. */
#define PE_POSITIONS_SERIAL_TOKENS ((int64_t)1 << 18)

/* Largest temporal index a Qwen2.5-VL video may reach (keeps every sum far from overflow). */
#define PE_MAX_TIME_INDEX (((int64_t)1 << 31) - 1)

static void set_error(pe_pos_error *err, pe_pos_problem problem) {
    if (!err) return;
    memset(err, 0, sizeof *err);
    err->problem = problem;
    err->grid = err->frame = err->row = err->token = -1;
}

/* ---- grids ---------------------------------------------------------------------------- */

/* Checks one (t, h, w) grid row: positive values, h and w divisible by m.  *tokens gets
 * t*(h/m)*(w/m), or INT64_MAX when that overflows (it then fits in no row). */
static int grid_ok(const int64_t *g, int64_t m, int64_t *tokens) {
    const int64_t t = g[0], h = g[1], w = g[2];
    if (t <= 0 || h <= 0 || w <= 0 || h % m || w % m) return 0;
    int64_t hw;
    if (__builtin_mul_overflow(h / m, w / m, &hw) || __builtin_mul_overflow(t, hw, tokens))
        *tokens = INT64_MAX;
    return 1;
}

static int check_grids(const int64_t *grids, int64_t n, int64_t m, int video, pe_pos_error *err) {
    for (int64_t i = 0; i < n; ++i) {
        int64_t tokens;
        if (!grid_ok(grids + 3 * i, m, &tokens)) {
            set_error(err, PE_POS_BAD_GRID);
            if (err) err->video = video, err->grid = i;
            return 0;
        }
    }
    return 1;
}

/* ---- decoder position ids ------------------------------------------------------------- */

/* Temporal index of frame k of a Qwen2.5-VL video (time rules in posenc.h).  The seconds
 * were checked by seconds_ok, so every conversion below is in range. */
static int64_t video_time(pe_mrope_time rule, double s, double tps, int64_t k) {
    if (k == 0) return 0;
    switch (rule) {
    case PE_TIME_TRUNC_SECONDS: {
        const int64_t ks = k * (int64_t)s;
        if (ks == 0) return 0;
        /* ks >= 1 here, so tps <= 2^31 (seconds_ok): the casts are in range */
        if (tps == (double)(int64_t)tps) return ks * (int64_t)tps;
        return (int64_t)((float)ks * (float)tps);
    }
    case PE_TIME_F32: {
        const float step = (float)tps * (float)s;
        return (int64_t)((float)k * step);
    }
    case PE_TIME_F64_INTERVAL: return (int64_t)((double)k * (tps * s));
    default: return (int64_t)((double)k * s * tps);
    }
}

/* Whether video time step s gives acceptable temporal indices for t frames (Qwen2.5-VL). */
static int seconds_ok(double s, double tps, int64_t t) {
    if (!isfinite(s) || s < 0 || s > (double)PE_MAX_TIME_INDEX) return 0;
    const double last = (double)(t - 1) * s * tps;
    return isfinite(last) && last <= (double)PE_MAX_TIME_INDEX;
}

enum { TIME_FRAME, TIME_ZERO, TIME_VIDEO };

/* One vision item being walked: its grid, temporal step and the counters of the token
 * that comes next. */
typedef struct item {
    int64_t placeholder;       /* 4.57: its token id; 5.x: its type (1 or 2) */
    int64_t t, hm, wm, n;      /* LLM grid and its token count */
    int time_kind;
    double seconds;
    int64_t base;              /* `next` when the item started */
    int64_t ti, hi, wi, tval;  /* counters of the next token, tval = tidx(ti) */
    int64_t left;              /* tokens still to come */
} item;

typedef struct walk_ctx {
    const pe_mrope_args *a;
    const int64_t *frame_start; /* Qwen3-VL: n_videos + 1 prefix sums of t */
    int64_t *pos;               /* (3, B, L) */
    int64_t *deltas;
} walk_ctx;

static int64_t time_index(const walk_ctx *c, const item *it, int64_t ti) {
    switch (it->time_kind) {
    case TIME_FRAME: return ti;
    case TIME_ZERO: return 0;
    default: return video_time(c->a->time_rule, it->seconds, c->a->tokens_per_second, ti);
    }
}

static int is_kept(const int64_t *mask, int64_t j) { return !mask || mask[j] == 1; }

static int v5(const pe_mrope_args *a) { return a->rules == PE_MROPE_RULES_5; }

/* What kept token j of a row starts or continues: 0 text, 1 image, 2 video.  `start` is set
 * where an item may begin (4.57: a placeholder after a vision start; 5.x: a vision type
 * after a token of another type).  prev is the state of the previous kept token. */
static int token_kind(const pe_mrope_args *a, const int64_t *ids, const int64_t *types, int64_t j,
                      int64_t *prev, int *start) {
    if (v5(a)) {
        const int64_t ty = types[j];
        *start = ty != 0 && ty != *prev;
        *prev = ty;
        return (int)ty;
    }
    const int64_t tok = ids[j];
    const int kind = tok == a->image_token_id ? 1 : tok == a->video_token_id ? 2 : 0;
    *start = kind != 0 && *prev == a->vision_start_token_id;
    *prev = tok;
    return kind;
}

static const int64_t *row_of(const int64_t *p, int64_t stride, int64_t b) {
    return p ? p + b * stride : NULL;
}

/* Counts the vision items of row b. */
static void count_row(const pe_mrope_args *a, int64_t b, int64_t *images, int64_t *videos) {
    const int64_t *ids = row_of(a->input_ids, a->ids_row_stride, b);
    const int64_t *types = row_of(a->mm_token_type_ids, a->types_row_stride, b);
    const int64_t *mask = row_of(a->attention_mask, a->mask_row_stride, b);
    int64_t ni = 0, nv = 0, prev = -1;
    for (int64_t j = 0; j < a->seq; ++j) {
        if (!is_kept(mask, j)) continue;
        int start;
        const int kind = token_kind(a, ids, types, j, &prev, &start);
        if (start) {
            ni += kind == 1;
            nv += kind == 2;
        }
    }
    *images = ni;
    *videos = nv;
}

/* Sets up the item of the given kind (1 image, 2 video) with grid index / video frame. */
static void start_item(const walk_ctx *c, item *it, int kind, int64_t index, int64_t next) {
    const pe_mrope_args *a = c->a;
    const int64_t m = a->spatial_merge_size;
    const int video = kind == 2;
    int64_t t, h, w;
    it->time_kind = TIME_FRAME;
    it->seconds = 1.0;
    it->placeholder = v5(a) ? kind : video ? a->video_token_id : a->image_token_id;
    if (!video) {
        const int64_t *g = a->image_grid_thw + 3 * index;
        t = g[0], h = g[1], w = g[2];
        if (a->model == PE_MROPE_QWEN2_5_VL && !v5(a)) it->time_kind = TIME_ZERO;
    } else if (a->model == PE_MROPE_QWEN3_VL) {
        /* index is the global frame number; find its video */
        int64_t lo = 0, hi = a->n_videos - 1;
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo + 1) / 2;
            if (c->frame_start[mid] <= index) lo = mid; else hi = mid - 1;
        }
        const int64_t *g = a->video_grid_thw + 3 * lo;
        t = 1, h = g[1], w = g[2];
    } else {
        const int64_t *g = a->video_grid_thw + 3 * index;
        t = g[0], h = g[1], w = g[2];
        if (a->model == PE_MROPE_QWEN2_5_VL) {
            it->time_kind = TIME_VIDEO;
            if (a->second_per_grid_ts) it->seconds = a->second_per_grid_ts[index];
        }
    }
    it->t = t;
    it->hm = h / m;
    it->wm = w / m;
    int64_t hw; /* t*(h/m)*(w/m), or INT64_MAX (no row is that long) */
    if (__builtin_mul_overflow(it->hm, it->wm, &hw) || __builtin_mul_overflow(t, hw, &it->n))
        it->n = INT64_MAX;
    it->base = next;
    it->ti = it->hi = it->wi = 0;
    it->tval = time_index(c, it, 0);
    it->left = it->n;
}

static void item_error(const walk_ctx *c, pe_pos_error *e, pe_pos_problem p, int video,
                       int64_t index, int64_t b, int64_t j) {
    set_error(e, p);
    e->video = video;
    e->row = b;
    e->token = j;
    if (index >= 0 && video && c->a->model == PE_MROPE_QWEN3_VL) {
        int64_t v = 0;
        while (v + 1 < c->a->n_videos && c->frame_start[v + 1] <= index) ++v;
        e->grid = v;
        e->frame = index - c->frame_start[v];
    } else {
        e->grid = index;
    }
}

/* Walks row b; grids of this row start at image img0 and video (or frame) vid0.  Returns
 * 0 and fills *e on a mismatch. */
static int walk_row(const walk_ctx *c, int64_t b, int64_t img0, int64_t vid0, pe_pos_error *e) {
    const pe_mrope_args *a = c->a;
    const int64_t L = a->seq, BL = a->batch * L;
    const int64_t *ids = row_of(a->input_ids, a->ids_row_stride, b);
    const int64_t *types = row_of(a->mm_token_type_ids, a->types_row_stride, b);
    const int64_t *mask = row_of(a->attention_mask, a->mask_row_stride, b);
    const int64_t pad = v5(a) ? 0 : 1;
    int64_t *pt = c->pos + b * L, *ph = pt + BL, *pw = ph + BL;
    int64_t next = 0, top = -1, kept = 0, img = img0, vid = vid0, prev = -1;
    item it = {0};
    int64_t item_token = -1, item_index = -1;
    int item_video = 0;

    for (int64_t j = 0; j < L; ++j) {
        if (!is_kept(mask, j)) {
            pt[j] = ph[j] = pw[j] = pad;
            continue;
        }
        ++kept;
        int start;
        const int kind = token_kind(a, ids, types, j, &prev, &start);
        if (it.left == 0 && start) {
            item_video = kind == 2;
            item_index = item_video ? vid++ : img++;
            item_token = j;
            start_item(c, &it, kind, item_index, next);
        }
        if (it.left > 0) {
            if ((v5(a) ? kind : ids[j]) != it.placeholder) {
                item_error(c, e, PE_POS_SHORT_RUN, item_video, item_index, b, item_token);
                e->expected = it.n;
                e->found = it.n - it.left;
                return 0;
            }
            pt[j] = it.base + it.tval;
            ph[j] = it.base + it.hi;
            pw[j] = it.base + it.wi;
            if (--it.left == 0) {
                int64_t ext = time_index(c, &it, it.t - 1);
                if (it.hm - 1 > ext) ext = it.hm - 1;
                if (it.wm - 1 > ext) ext = it.wm - 1;
                if (it.base + ext > top) top = it.base + ext;
                next = it.base + (v5(a) ? (it.hm > it.wm ? it.hm : it.wm) : ext + 1);
            } else if (++it.wi == it.wm) {
                it.wi = 0;
                if (++it.hi == it.hm) {
                    it.hi = 0;
                    it.tval = time_index(c, &it, ++it.ti);
                }
            }
        } else if (kind != 0) {
            item_error(c, e, PE_POS_STRAY_TOKEN, kind == 2, -1, b, j);
            return 0;
        } else {
            if (next > top) top = next;
            pt[j] = ph[j] = pw[j] = next++;
        }
    }
    if (it.left > 0) {
        item_error(c, e, PE_POS_SHORT_RUN, item_video, item_index, b, item_token);
        e->expected = it.n;
        e->found = it.n - it.left;
        return 0;
    }
    c->deltas[b] = v5(a) ? (kept ? top + 1 - kept : 0) : next - L;
    return 1;
}

/* transformers' branch without grids: cumsum(mask) - 1, or arange. */
static int plain_row(const walk_ctx *c, int64_t b, pe_pos_error *e) {
    const pe_mrope_args *a = c->a;
    const int64_t L = a->seq, BL = a->batch * L;
    const int64_t *ids = row_of(a->input_ids, a->ids_row_stride, b);
    const int64_t *types = row_of(a->mm_token_type_ids, a->types_row_stride, b);
    const int64_t *mask = row_of(a->attention_mask, a->mask_row_stride, b);
    const int64_t pad = v5(a) ? 0 : 1;
    int64_t *pt = c->pos + b * L, *ph = pt + BL, *pw = ph + BL;
    int64_t next = 0, top = -1, prev = -1;
    for (int64_t j = 0; j < L; ++j) {
        int64_t p = pad;
        if (is_kept(mask, j)) {
            int start = 0;
            const int kind = (v5(a) && !types) ? 0 : token_kind(a, ids, types, j, &prev, &start);
            if (kind != 0 && (start || v5(a))) {
                set_error(e, PE_POS_NO_GRIDS);
                e->video = kind == 2;
                e->row = b;
                e->token = j;
                return 0;
            }
            p = next++;
        }
        pt[j] = ph[j] = pw[j] = p;
        if (p > top) top = p;
    }
    c->deltas[b] = (mask && !v5(a)) ? top + 1 - L : 0;
    return 1;
}

static int args_valid(const pe_mrope_args *a, int64_t *position_ids, int64_t *deltas) {
    if (!a || a->batch < 0 || a->seq < 0) return 0;
    if (a->rules != PE_MROPE_RULES_4_57 && a->rules != PE_MROPE_RULES_5) return 0;
    const int need_ids = !v5(a), need_types = v5(a) && a->has_grids;
    if (a->batch > 0 && a->seq > 0 &&
        ((need_ids && !a->input_ids) || (need_types && !a->mm_token_type_ids) || !position_ids))
        return 0;
    if (a->batch > 0 && !deltas) return 0;
    if (a->batch > INT64_MAX / 3 / (a->seq > 0 ? a->seq : 1)) return 0;
    if (a->model != PE_MROPE_QWEN2_VL && a->model != PE_MROPE_QWEN2_5_VL &&
        a->model != PE_MROPE_QWEN3_VL)
        return 0;
    if (a->spatial_merge_size < 1) return 0;
    if (!v5(a)) {
        if (a->image_token_id < 0 || a->video_token_id < 0 || a->vision_start_token_id < 0)
            return 0;
        if (a->image_token_id == a->video_token_id ||
            a->image_token_id == a->vision_start_token_id ||
            a->video_token_id == a->vision_start_token_id)
            return 0;
    }
    if (a->n_images < 0 || a->n_videos < 0) return 0;
    if ((a->n_images > 0 && !a->image_grid_thw) || (a->n_videos > 0 && !a->video_grid_thw))
        return 0;
    if (!a->has_grids && (a->n_images > 0 || a->n_videos > 0)) return 0;
    if (a->time_rule != PE_TIME_F64 && a->time_rule != PE_TIME_TRUNC_SECONDS &&
        a->time_rule != PE_TIME_F32 && a->time_rule != PE_TIME_F64_INTERVAL)
        return 0;
    if (a->model == PE_MROPE_QWEN2_5_VL &&
        (!isfinite(a->tokens_per_second) || a->tokens_per_second < 0 ||
         (a->time_rule == PE_TIME_F32 && a->tokens_per_second > FLT_MAX)))
        return 0;
    return 1;
}

/* Checks every mask value and (5.x) every kept token type; 0 on the first bad one. */
static int values_valid(const pe_mrope_args *a, pe_pos_error *err) {
    for (int64_t b = 0; b < a->batch; ++b) {
        const int64_t *mask = row_of(a->attention_mask, a->mask_row_stride, b);
        const int64_t *types = v5(a) ? row_of(a->mm_token_type_ids, a->types_row_stride, b) : NULL;
        for (int64_t j = 0; j < a->seq; ++j) {
            if (mask && mask[j] != 0 && mask[j] != 1) {
                set_error(err, PE_POS_BAD_MASK);
                if (err) err->row = b, err->token = j, err->found = mask[j];
                return 0;
            }
            if (types && is_kept(mask, j) && (types[j] < 0 || types[j] > 2)) {
                set_error(err, PE_POS_BAD_TYPE);
                if (err) err->row = b, err->token = j, err->found = types[j];
                return 0;
            }
        }
    }
    return 1;
}

/* Keeps the error of the lowest batch row. */
static void keep_first(pe_pos_error *dst, int *have, const pe_pos_error *src) {
    if (!*have || src->row < dst->row) {
        *dst = *src;
        *have = 1;
    }
}

static int run_threads(const pe_mrope_args *a) {
    if (a->nthreads <= 1 || a->batch < 2 || a->batch * a->seq < PE_POSITIONS_SERIAL_TOKENS) return 1;
    return a->nthreads < a->batch ? a->nthreads : (int)a->batch;
}

int pe_mrope_position_ids(const pe_mrope_args *a, int64_t *position_ids, int64_t *deltas,
                          pe_pos_error *err) {
    set_error(err, PE_POS_NONE);
    if (!args_valid(a, position_ids, deltas)) {
        set_error(err, PE_POS_BAD_ARG);
        return PE_ERR_ARG;
    }
    if (!values_valid(a, err)) return PE_ERR_ARG;
    const int64_t B = a->batch, m = a->spatial_merge_size;
    walk_ctx c = {a, NULL, position_ids, deltas};
    const int nt = run_threads(a);
    pe_pos_error first;
    int have = 0;
    set_error(&first, PE_POS_NONE);

    if (!a->has_grids) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
        for (int64_t b = 0; b < B; ++b) {
            pe_pos_error e;
            if (!plain_row(&c, b, &e)) {
#pragma omp critical(pe_positions_error)
                keep_first(&first, &have, &e);
            }
        }
        if (have) {
            if (err) *err = first;
            return PE_ERR_GRID;
        }
        return PE_OK;
    }

    if (!check_grids(a->image_grid_thw, a->n_images, m, 0, err) ||
        !check_grids(a->video_grid_thw, a->n_videos, m, 1, err))
        return PE_ERR_GRID;
    if (a->model == PE_MROPE_QWEN2_5_VL) {
        for (int64_t v = 0; v < a->n_videos; ++v) {
            const double s = a->second_per_grid_ts ? a->second_per_grid_ts[v] : 1.0;
            if (!seconds_ok(s, a->tokens_per_second, a->video_grid_thw[3 * v])) {
                set_error(err, PE_POS_BAD_SECONDS);
                if (err) err->video = 1, err->grid = v;
                return PE_ERR_GRID;
            }
        }
    }

    /* counts[b] = images of rows < b, counts[B + 1 + b] = videos (frames) of rows < b */
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)(2 * (B + 1) + a->n_videos + 1));
    if (!counts) {
        set_error(err, PE_POS_NONE);
        return PE_ERR_NOMEM;
    }
    int64_t *img_start = counts, *vid_start = counts + B + 1, *frame_start = vid_start + B + 1;
    frame_start[0] = 0;
    int64_t n_video_items = a->n_videos;
    if (a->model == PE_MROPE_QWEN3_VL) {
        for (int64_t v = 0; v < a->n_videos; ++v) {
            if (__builtin_add_overflow(frame_start[v], a->video_grid_thw[3 * v],
                                       &frame_start[v + 1])) {
                /* more frames than int64 counts: they cannot all have tokens */
                set_error(err, PE_POS_GRID_COUNT);
                if (err) err->video = 1, err->expected = INT64_MAX, err->found = -1;
                free(counts);
                return PE_ERR_GRID;
            }
        }
        n_video_items = frame_start[a->n_videos];
        c.frame_start = frame_start;
    }

#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t b = 0; b < B; ++b) count_row(a, b, &img_start[b + 1], &vid_start[b + 1]);
    img_start[0] = vid_start[0] = 0;
    for (int64_t b = 0; b < B; ++b) {
        img_start[b + 1] += img_start[b];
        vid_start[b + 1] += vid_start[b];
    }
    int status = PE_OK;
    if (img_start[B] != a->n_images || vid_start[B] != n_video_items) {
        const int video = img_start[B] == a->n_images;
        set_error(err, PE_POS_GRID_COUNT);
        if (err) {
            err->video = video;
            err->found = video ? vid_start[B] : img_start[B];
            err->expected = video ? n_video_items : a->n_images;
        }
        status = PE_ERR_GRID;
    } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
        for (int64_t b = 0; b < B; ++b) {
            pe_pos_error e;
            if (!walk_row(&c, b, img_start[b], vid_start[b], &e)) {
#pragma omp critical(pe_positions_error)
                keep_first(&first, &have, &e);
            }
        }
        if (have) {
            if (err) *err = first;
            status = PE_ERR_GRID;
        }
    }
    free(counts);
    return status;
}

/* ---- vision tower positions ----------------------------------------------------------- */

int pe_vision_position_count(int64_t n_grids, const int64_t *grid_thw, int64_t spatial_merge_size,
                             int64_t *total, pe_pos_error *err) {
    set_error(err, PE_POS_NONE);
    if (n_grids < 0 || (n_grids > 0 && !grid_thw) || spatial_merge_size < 1 || !total) {
        set_error(err, PE_POS_BAD_ARG);
        return PE_ERR_ARG;
    }
    int64_t sum = 0;
    for (int64_t i = 0; i < n_grids; ++i) {
        const int64_t *g = grid_thw + 3 * i;
        int64_t merged, hw, patches;
        if (!grid_ok(g, spatial_merge_size, &merged) || __builtin_mul_overflow(g[1], g[2], &hw) ||
            __builtin_mul_overflow(g[0], hw, &patches) || patches > INT64_MAX / 4 - sum) {
            set_error(err, PE_POS_BAD_GRID);
            if (err) err->grid = i;
            return PE_ERR_GRID;
        }
        sum += patches;
    }
    *total = sum;
    return PE_OK;
}

/* One frame of grid (h, w) in merge-window order. */
static void vision_frame(int64_t h, int64_t w, int64_t m, int64_t *out) {
    int64_t k = 0;
    for (int64_t bh = 0; bh < h / m; ++bh)
        for (int64_t bw = 0; bw < w / m; ++bw)
            for (int64_t ih = 0; ih < m; ++ih)
                for (int64_t iw = 0; iw < m; ++iw) {
                    out[2 * k] = bh * m + ih;
                    out[2 * k + 1] = bw * m + iw;
                    ++k;
                }
}

int pe_vision_position_ids(int64_t n_grids, const int64_t *grid_thw, int64_t spatial_merge_size,
                           int64_t total, int64_t *out, int nthreads, pe_pos_error *err) {
    int64_t want;
    const int rc = pe_vision_position_count(n_grids, grid_thw, spatial_merge_size, &want, err);
    if (rc != PE_OK) return rc;
    if (want != total || (total > 0 && !out)) {
        set_error(err, PE_POS_BAD_ARG);
        return PE_ERR_ARG;
    }
    if (n_grids == 0) return PE_OK;
    int64_t *offset = malloc(sizeof(int64_t) * (size_t)(n_grids + 1));
    if (!offset) return PE_ERR_NOMEM;
    offset[0] = 0;
    for (int64_t i = 0; i < n_grids; ++i)
        offset[i + 1] = offset[i] + grid_thw[3 * i] * grid_thw[3 * i + 1] * grid_thw[3 * i + 2];
    const int nt = (nthreads > 1 && n_grids > 1 && total >= PE_POSITIONS_SERIAL_TOKENS)
                       ? (nthreads < n_grids ? nthreads : (int)n_grids) : 1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int64_t i = 0; i < n_grids; ++i) {
        const int64_t t = grid_thw[3 * i], h = grid_thw[3 * i + 1], w = grid_thw[3 * i + 2];
        int64_t *dst = out + 2 * offset[i];
        vision_frame(h, w, spatial_merge_size, dst);
        const size_t frame = sizeof(int64_t) * (size_t)(2 * h * w);
        for (int64_t f = 1; f < t; ++f) memcpy((char *)dst + (size_t)f * frame, dst, frame);
    }
    free(offset);
    return PE_OK;
}

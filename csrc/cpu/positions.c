/* Position ids: multimodal RoPE ids for the decoder (get_rope_index).  Specification in
 * posenc.h; the vision towers' ids are in vision.c. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Position ids cost a few nanoseconds per token serially (4-5 ns with grids, measured), so a
 * batch of 2^16 tokens is a few hundred microseconds of work: from there a parallel region
 * is worth its wake-up cost (and its risk on a busy machine). */
#define PE_POSITIONS_SERIAL_TOKENS ((int64_t)1 << 16)

/* Largest temporal index a Qwen2.5-VL video may reach (keeps every sum far from overflow). */
#define PE_MAX_TIME_INDEX (((int64_t)1 << 31) - 1)

static void set_error(pe_pos_error *err, pe_pos_problem problem) {
    if (!err) return;
    memset(err, 0, sizeof *err);
    err->problem = problem;
    err->grid = err->frame = err->row = err->token = err->example = -1;
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
    int64_t *pos;               /* rows T, H, W of (B, L), axis_stride apart */
    int64_t *deltas;
    int64_t axis_stride;
    int64_t n_video_items;      /* videos, or (Qwen3-VL) frames */
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

/* Counts the vision items in tokens [j0, j1) of row b. */
static void count_span(const pe_mrope_args *a, int64_t b, int64_t j0, int64_t j1, int64_t *images,
                       int64_t *videos) {
    const int64_t *ids = row_of(a->input_ids, a->ids_row_stride, b);
    const int64_t *types = row_of(a->mm_token_type_ids, a->types_row_stride, b);
    const int64_t *mask = row_of(a->attention_mask, a->mask_row_stride, b);
    int64_t ni = 0, nv = 0, prev = -1;
    for (int64_t j = j0; j < j1; ++j) {
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

/* Walks tokens [j0, j1) of row b as one sequence whose positions start at 0; its items
 * take the grids from image img0 and video (or frame) vid0 on.  *end gets next, top and
 * kept tokens after the span.  Returns 0 and fills *e on a mismatch. */
static int walk_span(const walk_ctx *c, int64_t b, int64_t j0, int64_t j1, int64_t img0,
                     int64_t vid0, int64_t end[3], pe_pos_error *e) {
    const pe_mrope_args *a = c->a;
    const int64_t L = a->seq;
    const int64_t *ids = row_of(a->input_ids, a->ids_row_stride, b);
    const int64_t *types = row_of(a->mm_token_type_ids, a->types_row_stride, b);
    const int64_t *mask = row_of(a->attention_mask, a->mask_row_stride, b);
    const int64_t pad = v5(a) ? 0 : 1;
    /* (no output when the rows are empty: no arithmetic on a NULL pointer) */
    int64_t *pt = c->pos ? c->pos + b * L : NULL;
    int64_t *ph = pt ? pt + c->axis_stride : NULL, *pw = ph ? ph + c->axis_stride : NULL;
    int64_t next = 0, top = -1, kept = 0, img = img0, vid = vid0, prev = -1;
    item it = {0};
    int64_t item_token = -1, item_index = -1;
    int item_video = 0;

    for (int64_t j = j0; j < j1; ++j) {
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
            const int64_t have = item_video ? c->n_video_items : a->n_images;
            if (item_index >= have) { /* only when the caller did not count first */
                item_error(c, e, PE_POS_GRID_COUNT, item_video, -1, b, j);
                e->expected = have;
                e->found = item_index + 1;
                return 0;
            }
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
        /* the next token of the row going on with the run: a run cut at j1 */
        const int cut = j1 < L && (v5(a) ? types[j1] : ids[j1]) == it.placeholder;
        item_error(c, e, cut ? PE_POS_CUT_RUN : PE_POS_SHORT_RUN, item_video, item_index, b,
                   item_token);
        e->expected = it.n;
        e->found = it.n - it.left;
        return 0;
    }
    end[0] = next, end[1] = top, end[2] = kept;
    return 1;
}

/* Walks row b; grids of this row start at image img0 and video (or frame) vid0. */
static int walk_row(const walk_ctx *c, int64_t b, int64_t img0, int64_t vid0, pe_pos_error *e) {
    int64_t end[3];
    if (!walk_span(c, b, 0, c->a->seq, img0, vid0, end, e)) return 0;
    const int64_t next = end[0], top = end[1], kept = end[2];
    c->deltas[b] = v5(c->a) ? (kept ? top + 1 - kept : 0) : next - c->a->seq;
    return 1;
}

/* transformers' branch without grids over tokens [j0, j1) of row b: cumsum(mask) - 1, or
 * arange.  *top gets the largest position written. */
static int plain_span(const walk_ctx *c, int64_t b, int64_t j0, int64_t j1, int64_t *top_out,
                      pe_pos_error *e) {
    const pe_mrope_args *a = c->a;
    const int64_t L = a->seq;
    const int64_t *ids = row_of(a->input_ids, a->ids_row_stride, b);
    const int64_t *types = row_of(a->mm_token_type_ids, a->types_row_stride, b);
    const int64_t *mask = row_of(a->attention_mask, a->mask_row_stride, b);
    const int64_t pad = v5(a) ? 0 : 1;
    /* (no output when the rows are empty: no arithmetic on a NULL pointer) */
    int64_t *pt = c->pos ? c->pos + b * L : NULL;
    int64_t *ph = pt ? pt + c->axis_stride : NULL, *pw = ph ? ph + c->axis_stride : NULL;
    int64_t next = 0, top = -1, prev = -1;
    for (int64_t j = j0; j < j1; ++j) {
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
    *top_out = top;
    return 1;
}

static int plain_row(const walk_ctx *c, int64_t b, pe_pos_error *e) {
    int64_t top;
    if (!plain_span(c, b, 0, c->a->seq, &top, e)) return 0;
    c->deltas[b] = (c->a->attention_mask && !v5(c->a)) ? top + 1 - c->a->seq : 0;
    return 1;
}

static int args_valid(const pe_mrope_args *a, const int64_t *position_ids) {
    if (!a || a->batch < 0 || a->seq < 0) return 0;
    if (a->rules != PE_MROPE_RULES_4_57 && a->rules != PE_MROPE_RULES_5) return 0;
    const int need_ids = !v5(a), need_types = v5(a) && a->has_grids;
    if (a->batch > 0 && a->seq > 0 &&
        ((need_ids && !a->input_ids) || (need_types && !a->mm_token_type_ids) || !position_ids))
        return 0;
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

/* Checks the grids and Qwen2.5-VL's seconds; for Qwen3-VL fills frame_start (n_videos + 1
 * prefix sums of t) and points c at it.  Sets c->n_video_items. */
static int grids_valid(walk_ctx *c, int64_t *frame_start, pe_pos_error *err) {
    const pe_mrope_args *a = c->a;
    const int64_t m = a->spatial_merge_size;
    if (!check_grids(a->image_grid_thw, a->n_images, m, 0, err) ||
        !check_grids(a->video_grid_thw, a->n_videos, m, 1, err))
        return 0;
    if (a->model == PE_MROPE_QWEN2_5_VL) {
        for (int64_t v = 0; v < a->n_videos; ++v) {
            const double s = a->second_per_grid_ts ? a->second_per_grid_ts[v] : 1.0;
            if (!seconds_ok(s, a->tokens_per_second, a->video_grid_thw[3 * v])) {
                set_error(err, PE_POS_BAD_SECONDS);
                if (err) err->video = 1, err->grid = v;
                return 0;
            }
        }
    }
    c->n_video_items = a->n_videos;
    if (a->model == PE_MROPE_QWEN3_VL) {
        frame_start[0] = 0;
        for (int64_t v = 0; v < a->n_videos; ++v) {
            if (__builtin_add_overflow(frame_start[v], a->video_grid_thw[3 * v],
                                       &frame_start[v + 1])) {
                /* more frames than int64 counts: they cannot all have tokens */
                set_error(err, PE_POS_GRID_COUNT);
                if (err) err->video = 1, err->expected = INT64_MAX, err->found = -1;
                return 0;
            }
        }
        c->frame_start = frame_start;
        c->n_video_items = frame_start[a->n_videos];
    }
    return 1;
}

static int run_threads(const pe_mrope_args *a) {
    if (a->nthreads <= 1 || a->batch < 2 || a->batch * a->seq < PE_POSITIONS_SERIAL_TOKENS) return 1;
    return a->nthreads < a->batch ? a->nthreads : (int)a->batch;
}

int pe_mrope_position_ids(const pe_mrope_args *a, int64_t *position_ids, int64_t *deltas,
                          pe_pos_error *err) {
    set_error(err, PE_POS_NONE);
    if (!args_valid(a, position_ids) || (a->batch > 0 && !deltas)) {
        set_error(err, PE_POS_BAD_ARG);
        return PE_ERR_ARG;
    }
    if (!values_valid(a, err)) return PE_ERR_ARG;
    const int64_t B = a->batch;
    walk_ctx c = {a, NULL, position_ids, deltas, a->batch * a->seq, a->n_videos};
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

    /* counts[b] = images of rows < b, counts[B + 1 + b] = videos (frames) of rows < b */
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)(2 * (B + 1) + a->n_videos + 1));
    if (!counts) {
        set_error(err, PE_POS_NONE);
        return PE_ERR_NOMEM;
    }
    int64_t *img_start = counts, *vid_start = counts + B + 1, *frame_start = vid_start + B + 1;
    if (!grids_valid(&c, frame_start, err)) {
        free(counts);
        return PE_ERR_GRID;
    }
    const int64_t n_video_items = c.n_video_items;

#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t b = 0; b < B; ++b)
        count_span(a, b, 0, a->seq, &img_start[b + 1], &vid_start[b + 1]);
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

/* ---- packed rows ---------------------------------------------------------------------- */

/* Keeps the error of the lowest example. */
static void keep_first_example(pe_pos_error *dst, int *have, const pe_pos_error *src) {
    if (!*have || src->example < dst->example) {
        *dst = *src;
        *have = 1;
    }
}

static int packed_args_valid(const pe_mrope_args *a, int64_t n_examples,
                             const int64_t *example_lens, const int64_t *row_examples,
                             const int64_t *example_grids, const int64_t *position_ids) {
    if (!args_valid(a, position_ids) || a->attention_mask || n_examples < 0) return 0;
    if ((a->batch > 0 && !row_examples) || (n_examples > 0 && !example_lens)) return 0;
    if (a->seq > 0 && a->batch > INT64_MAX / 4 / a->seq) return 0;
    int64_t total = 0;
    for (int64_t b = 0; b < a->batch; ++b) {
        if (row_examples[b] < 0 || row_examples[b] > n_examples - total) return 0;
        total += row_examples[b];
    }
    if (total != n_examples) return 0;
    if (!example_grids) return 1;
    int64_t images = 0, videos = 0;
    for (int64_t e = 0; e < n_examples; ++e) {
        const int64_t ni = example_grids[2 * e], nv = example_grids[2 * e + 1];
        if (ni < 0 || nv < 0 || ni > a->n_images - images || nv > a->n_videos - videos) return 0;
        images += ni;
        videos += nv;
    }
    return images == a->n_images && videos == a->n_videos;
}

/* The example that owns grid g of the kind (0 images, 1 videos) by example_grids. */
static int64_t grid_owner(const int64_t *example_grids, int64_t n_examples, int video, int64_t g) {
    for (int64_t e = 0, seen = 0; e < n_examples; ++e) {
        seen += example_grids[2 * e + video];
        if (g < seen) return e;
    }
    return -1;
}

int pe_mrope_packed_position_ids(const pe_mrope_args *a, int64_t n_examples,
                                 const int64_t *example_lens, const int64_t *row_examples,
                                 const int64_t *example_grids, int64_t *position_ids,
                                 pe_pos_error *err) {
    set_error(err, PE_POS_NONE);
    if (!packed_args_valid(a, n_examples, example_lens, row_examples, example_grids,
                           position_ids)) {
        set_error(err, PE_POS_BAD_ARG);
        return PE_ERR_ARG;
    }
    const int64_t B = a->batch, L = a->seq, BL = B * L, N = n_examples;
    /* where example e lies (row, first token); items of the examples before e (images,
     * videos or frames); Qwen3-VL frame sums */
    int64_t *buf = malloc(sizeof(int64_t) * (size_t)(4 * N + 2 + a->n_videos + 1));
    if (!buf) return PE_ERR_NOMEM;
    int64_t *ex_row = buf, *ex_start = ex_row + N, *img_start = ex_start + N;
    int64_t *vid_start = img_start + N + 1, *frame_start = vid_start + N + 1;
    int status = PE_OK;

    for (int64_t b = 0, e = 0; b < B && status == PE_OK; ++b) {
        int64_t used = 0;
        for (int64_t k = 0; k < row_examples[b]; ++k, ++e) {
            if (example_lens[e] < 0 || example_lens[e] > L - used) {
                set_error(err, PE_POS_BAD_LENGTH);
                if (err) err->row = b, err->example = e, err->expected = L - used,
                         err->found = example_lens[e];
                status = PE_ERR_ARG;
                break;
            }
            ex_row[e] = b;
            ex_start[e] = used;
            used += example_lens[e];
        }
        for (int64_t j = used; j < L; ++j) /* padding: one more text-only sequence */
            for (int r = 0; r < 4; ++r) position_ids[r * BL + b * L + j] = j - used;
    }
    if (status == PE_OK && !values_valid(a, err)) status = PE_ERR_ARG;
    walk_ctx c = {a, NULL, position_ids + BL, NULL, BL, a->n_videos};
    if (status == PE_OK && a->has_grids && !grids_valid(&c, frame_start, err)) {
        status = PE_ERR_GRID;
        if (err && example_grids && err->grid >= 0)
            err->example = grid_owner(example_grids, N, err->video, err->grid);
    }
    if (status != PE_OK) {
        free(buf);
        return status;
    }

    const int nt = (a->nthreads > 1 && N > 1 && BL >= PE_POSITIONS_SERIAL_TOKENS)
                       ? (a->nthreads < N ? a->nthreads : (int)N) : 1;
    pe_pos_error first;
    int have = 0;
    set_error(&first, PE_POS_NONE);
    img_start[0] = vid_start[0] = 0;
    if (a->has_grids) {
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
        for (int64_t e = 0; e < N; ++e)
            count_span(a, ex_row[e], ex_start[e], ex_start[e] + example_lens[e], &img_start[e + 1],
                       &vid_start[e + 1]);
        /* with example_grids, each example's items must match its own grids (frames) */
        for (int64_t e = 0, vg = 0; example_grids && e < N && !have; ++e) {
            const int64_t own_images = example_grids[2 * e], own_videos = example_grids[2 * e + 1];
            const int64_t own_items = a->model == PE_MROPE_QWEN3_VL
                                          ? frame_start[vg + own_videos] - frame_start[vg]
                                          : own_videos;
            vg += own_videos;
            const int video = img_start[e + 1] == own_images;
            if (video && vid_start[e + 1] == own_items) continue;
            set_error(&first, PE_POS_GRID_COUNT);
            first.example = e;
            first.row = ex_row[e];
            first.video = video;
            first.found = video ? vid_start[e + 1] : img_start[e + 1];
            first.expected = video ? own_items : own_images;
            have = 1;
        }
        for (int64_t e = 0; e < N; ++e) {
            img_start[e + 1] += img_start[e];
            vid_start[e + 1] += vid_start[e];
        }
    }
    /* With counts that disagree with the grids, a serial walk finds the first example at
     * fault (walk_span stops where the grids run out).  An example whose own grids
     * disagree stops everything before the walk. */
    const int counted = !a->has_grids ||
                        (img_start[N] == a->n_images && vid_start[N] == c.n_video_items);
    const int64_t walked = have ? 0 : N;
#pragma omp parallel for num_threads(counted ? nt : 1) schedule(dynamic, 1) if (counted && nt > 1)
    for (int64_t e = 0; e < walked; ++e) {
        if (!counted && have) continue;
        const int64_t b = ex_row[e], j0 = ex_start[e], j1 = j0 + example_lens[e];
        for (int64_t j = j0; j < j1; ++j) position_ids[b * L + j] = j - j0;
        pe_pos_error pe;
        int64_t end[3];
        const int ok = a->has_grids ? walk_span(&c, b, j0, j1, img_start[e], vid_start[e], end, &pe)
                                    : plain_span(&c, b, j0, j1, &end[1], &pe);
        if (!ok) {
            pe.example = e;
#pragma omp critical(pe_positions_error)
            keep_first_example(&first, &have, &pe);
        }
    }
    if (have) {
        if (err) *err = first;
        status = PE_ERR_GRID;
    } else if (!counted) {
        const int video = img_start[N] == a->n_images;
        set_error(err, PE_POS_GRID_COUNT);
        if (err) {
            err->video = video;
            err->found = video ? vid_start[N] : img_start[N];
            err->expected = video ? c.n_video_items : a->n_images;
        }
        status = PE_ERR_GRID;
    }
    free(buf);
    return status;
}

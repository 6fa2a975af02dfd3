/*
 * The fp32 RoPE core: forward / transpose, table gradients and tables from positions, for
 * 16-bit and fp32 tensors with fp32 tables or positions.  Everything here is static and
 * inlined into the three tile functions of each rope_<isa>.c, which compile this file with
 * their instruction set: the compiler's target macros (__AVX512F__, __AVX2__) pick the
 * vector rows of simd.h, and the baseline build keeps the scalar code (the auto-vectorizer
 * handles the simple loops).  rope.c runs the tiles over threads (one driver for both
 * precisions).  Per-element arithmetic comes from rope_math.h; no fused multiply-add
 * anywhere (-ffp-contract=off, explicit multiply then add).
 */
#ifndef POSENC_ROPE_F32_H
#define POSENC_ROPE_F32_H

#include "simd.h"

/* How a tile's rows are done (rope_f32_rotate): stores, the NaN rounding of bf16 rows,
 * prefetching. */
typedef struct row_mode {
    int stream;     /* whole vectors go out with streaming stores */
    int nan_tables; /* the tile's tables hold a NaN (bf16 pair rows, rot_half_row_pairs) */
    int64_t ahead;  /* the bytes this far past each row's input are asked for (0: none) */
    int dot_tables; /* the tile's tables pass bf16_dot_tables (PE_BF16_HW, rot_half_rows_dot) */
} row_mode;

/* Asks for the `bytes` of input `ahead` bytes past the row at x (see PE_PREFETCH_AHEAD). */
PE_INLINE void prefetch_ahead(const char *x, int64_t bytes, int64_t ahead) {
    if (!ahead) return;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(x + ahead + b);
}

/* out[e] = x[e] c[e] + x[e+h] ss[e],  out[e+h] = x[e+h] c[e+h] + x[e] ss[e+h], channels e
 * from e0 on (those before e0 are done); whole vectors with streaming stores if `stream`. */
PE_INLINE void rot_half_row(const char *restrict x, char *restrict o, const float *restrict c,
                            const float *restrict ss, int64_t h, pe_dtype dt, int64_t e0,
                            row_mode m) {
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2, hb = h * es;
    const int stream = m.stream;
    int64_t e = e0;
    if (e0 == 0) prefetch_ahead(x, 2 * hb, m.ahead);
#ifdef PE_VW
    for (; e + PE_VW <= h; e += PE_VW) {
        const pe_vf x0 = vx_load(x + e * es, dt), x1 = vx_load(x + e * es + hb, dt);
        const pe_vf o0 = vf_rot(x0, vf_load(c + e), x1, vf_load(ss + e));
        const pe_vf o1 = vf_rot(x1, vf_load(c + e + h), x0, vf_load(ss + e + h));
        if (stream) {
            vx_stream(o + e * es, o0, dt);
            vx_stream(o + e * es + hb, o1, dt);
        } else {
            vx_store(o + e * es, o0, dt);
            vx_store(o + e * es + hb, o1, dt);
        }
    }
#else
    (void)stream;
#endif
#ifdef PE_VTAIL
    if (e < h) {
        const int64_t n = h - e;
        const pe_vf x0 = vx_load_n(x + e * es, dt, n), x1 = vx_load_n(x + e * es + hb, dt, n);
        vx_store_n(o + e * es, vf_rot(x0, vf_load_n(c + e, n), x1, vf_load_n(ss + e, n)), dt, n);
        vx_store_n(o + e * es + hb,
                   vf_rot(x1, vf_load_n(c + e + h, n), x0, vf_load_n(ss + e + h, n)), dt, n);
        return;
    }
#endif
    for (; e < h; ++e) {
        const float x0 = sx_load(x + e * es, dt), x1 = sx_load(x + e * es + hb, dt);
        sx_store(o + e * es, pe_rot_f32(x0, c[e], x1, ss[e]), dt);
        sx_store(o + e * es + hb, pe_rot_f32(x1, c[e + h], x0, ss[e + h]), dt);
    }
}

#if PE_VW == 16
/* rot_half_row of the nh heads of a token, h = nv PE_VW (nv = 2 or 4: head_dim 64 or 128),
 * with the token's tables read once, into registers (2 nv vectors of each): a row then
 * loads only its own values (fp32: 1 KiB of tables for 512 bytes of input at head_dim
 * 128, read from L1 per row before). */
PE_INLINE void rot_half_rows_held(const char *x, int64_t xs, char *o, int64_t os, int64_t nh,
                                  const float *c, const float *ss, pe_dtype dt, row_mode m,
                                  int nv) {
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2, h = nv * PE_VW, hb = h * es;
    pe_vf tc[8], ts[8]; /* channel i PE_VW .. of the first half, then of the second */
    for (int i = 0; i < 2 * nv; ++i) {
        tc[i] = vf_load(c + i * PE_VW);
        ts[i] = vf_load(ss + i * PE_VW);
    }
    for (int64_t hd = 0; hd < nh; ++hd) {
        const char *xr = x + hd * xs * es;
        char *orow = o + hd * os * es;
        prefetch_ahead(xr, 2 * hb, m.ahead);
        for (int i = 0; i < nv; ++i) {
            const int64_t at = i * PE_VW * es;
            const pe_vf x0 = vx_load(xr + at, dt), x1 = vx_load(xr + at + hb, dt);
            const pe_vf o0 = vf_rot(x0, tc[i], x1, ts[i]);
            const pe_vf o1 = vf_rot(x1, tc[i + nv], x0, ts[i + nv]);
            if (m.stream) {
                vx_stream(orow + at, o0, dt);
                vx_stream(orow + at + hb, o1, dt);
            } else {
                vx_store(orow + at, o0, dt);
                vx_store(orow + at + hb, o1, dt);
            }
        }
    }
}
#endif

/*
 * Streaming (non-temporal) stores only where rope.c asks for them (`stream`): large outputs
 * whose pages are already in memory, where they spare reading each line before it is
 * overwritten.  A fresh output is pages the kernel zeroes into the cache on first touch; a
 * streaming store then evicts each of those lines and writes it again (AVX-512, bf16,
 * Qwen2-VL-7B at T = 8192: 48 ms with streaming stores against 33 ms without).
 */
PE_INLINE void rot_half_rows(const char *x, int64_t xs, char *o, int64_t os, int64_t nh,
                             const float *c, const float *ss, int64_t h, pe_dtype dt,
                             row_mode m) {
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2;
#if PE_VW == 16
    if (nh > 1 && (h == 4 * PE_VW || h == 2 * PE_VW)) {
        if (h == 4 * PE_VW) rot_half_rows_held(x, xs, o, os, nh, c, ss, dt, m, 4);
        else rot_half_rows_held(x, xs, o, os, nh, c, ss, dt, m, 2);
        return;
    }
#endif
    for (int64_t hd = 0; hd < nh; ++hd)
        rot_half_row(x + hd * xs * es, o + hd * os * es, c, ss, h, dt, 0, m);
}

#ifdef PE_BF16_BLOCK
/* The tables of the block at channel e, in pair order: the cos and the signed sine of the
 * even and the odd channels of the first half (c0e ... s0o), then of the second. */
typedef struct {
    pe_vf c0e, c0o, s0e, s0o, c1e, c1o, s1e, s1o;
} pair_tables;

PE_INLINE pair_tables pair_tables_load(const float *c, const float *ss, int64_t h, int64_t e) {
    const float *c0 = c + e, *s0 = ss + e, *c1 = c + h + e, *s1 = ss + h + e;
    const pair_tables t = {vf_load(c0), vf_load(c0 + PE_VW), vf_load(s0), vf_load(s0 + PE_VW),
                           vf_load(c1), vf_load(c1 + PE_VW), vf_load(s1), vf_load(s1 + PE_VW)};
    return t;
}

/* The four rotated vectors of the block at channel e of both halves: the even and the odd
 * channels of the first half (o[0], o[1]), then of the second (o[2], o[3]); the tables
 * from t, or, with t NULL, read from c and ss (as operands of the products). */
PE_INLINE void rot_pair_block(const char *restrict x, const pair_tables *t,
                              const float *restrict c, const float *restrict ss, int64_t h,
                              int64_t e, pe_vf o[4]) {
    const pe_vi u0 = vi_load(x + 2 * e), u1 = vi_load(x + 2 * (h + e));
    const pe_vf x0e = bf16_even(u0), x0o = bf16_odd(u0);
    const pe_vf x1e = bf16_even(u1), x1o = bf16_odd(u1);
    if (t) {
        o[0] = vf_rot(x0e, t->c0e, x1e, t->s0e);
        o[1] = vf_rot(x0o, t->c0o, x1o, t->s0o);
        o[2] = vf_rot(x1e, t->c1e, x0e, t->s1e);
        o[3] = vf_rot(x1o, t->c1o, x0o, t->s1o);
        return;
    }
    const float *c0 = c + e, *s0 = ss + e, *c1 = c + h + e, *s1 = ss + h + e;
    o[0] = vf_rot(x0e, vf_load(c0), x1e, vf_load(s0));
    o[1] = vf_rot(x0o, vf_load(c0 + PE_VW), x1o, vf_load(s0 + PE_VW));
    o[2] = vf_rot(x1e, vf_load(c1), x0e, vf_load(s1));
    o[3] = vf_rot(x1o, vf_load(c1 + PE_VW), x0o, vf_load(s1 + PE_VW));
}

/* rot_half_row for bf16 with the tables in pair order: whole blocks as pairs, then the tail
 * (natural order) as before.  The blocks round as numbers (bf16_pairs_num), which is the
 * NaN rounding too for every NaN whose low 16 bits are zero: the sum of two products is a
 * quiet NaN carrying an operand's payload, or the default NaN, and a bf16 row has zero low
 * bits.  So with NaN-free tables (m.nan_tables == 0, checked per tile) nothing more is
 * needed; otherwise a row with a NaN (one check per row, not a branch per block) is done
 * again with the NaN rounding.  With the hardware rounding (PE_BF16_HW) NaNs need nothing,
 * and a row with an fp32 denormal among its results is done again in software (looked for
 * only in the blocks whose rounded results hold a zero, as every denormal's do). */
PE_INLINE void rot_half_row_pairs(const char *restrict x, char *restrict o,
                                  const float *restrict c, const float *restrict ss,
                                  int64_t h, row_mode m, const pair_tables *tab) {
    const int stream = m.stream;
    int64_t e = 0;
    pe_vf nan = vf_zero();
    prefetch_ahead(x, 4 * h, m.ahead);
#ifdef PE_BF16_HW
    __mmask16 denormal = 0;
#endif
    for (; e + PE_BF16_BLOCK <= h; e += PE_BF16_BLOCK) {
        pe_vf v[4];
        rot_pair_block(x, tab ? &tab[e / PE_BF16_BLOCK] : NULL, c, ss, h, e, v);
#ifdef PE_BF16_HW /* NaNs round as in software; denormals do not (simd.h) */
        const pe_vi r0 = bf16_pairs_hw(v[0], v[1]), r1 = bf16_pairs_hw(v[2], v[3]);
        if (__builtin_expect(bf16_any_zero(r0, r1), 0))
            denormal = bf16_denormals(denormal, v[0], v[1], v[2], v[3]);
#else
        if (m.nan_tables) nan = vf_nan_lanes(nan, v[0], v[1], v[2], v[3]);
        const pe_vi r0 = bf16_pairs_num(v[0], v[1]), r1 = bf16_pairs_num(v[2], v[3]);
#endif
        if (stream) {
            vi_stream(o + 2 * e, r0);
            vi_stream(o + 2 * (h + e), r1);
        } else {
            vi_store(o + 2 * e, r0);
            vi_store(o + 2 * (h + e), r1);
        }
    }
#ifdef PE_BF16_HW
    (void)nan;
    if (__builtin_expect(denormal != 0, 0)) {
#else
    if (m.nan_tables && __builtin_expect(vf_any(nan), 0)) {
#endif
        if (stream) _mm_sfence(); /* the streamed blocks land before their plain rewrite */
        for (int64_t f = 0; f < e; f += PE_BF16_BLOCK) {
            pe_vf v[4];
            rot_pair_block(x, NULL, c, ss, h, f, v);
            vi_store(o + 2 * f, bf16_join(bf16_round_hi(v[0]), bf16_round_hi(v[1])));
            vi_store(o + 2 * (h + f), bf16_join(bf16_round_hi(v[2]), bf16_round_hi(v[3])));
        }
    }
    if (e < h) rot_half_row(x, o, c, ss, h, PE_BFLOAT16, e, m);
}

/* The nh heads of a token with their tables read once, into registers (tab), where the
 * rows are one or two blocks per half: 8 or 16 vectors of the 32 AVX-512 has.  A row then
 * loads only its own values; read per row, the tables were 1 KiB from L1 besides the row's
 * 256 bytes at head_dim 128 (docs/benchmarks.md, "The rotation on Zen 4"). */
#if PE_VW == 16
#define PE_PAIR_TABLES_HELD 2
PE_INLINE void rot_half_rows_pairs_held(const char *x, int64_t xs, char *o, int64_t os,
                                        int64_t nh, const float *c, const float *ss, int64_t h,
                                        row_mode m) {
    pair_tables tab[PE_PAIR_TABLES_HELD];
    for (int64_t k = 0; k < h / PE_BF16_BLOCK; ++k)
        tab[k] = pair_tables_load(c, ss, h, k * PE_BF16_BLOCK);
    for (int64_t hd = 0; hd < nh; ++hd)
        rot_half_row_pairs(x + hd * xs * 2, o + hd * os * 2, c, ss, h, m, tab);
}
#endif

#ifdef PE_BF16_HW
/* The nh heads of a token by dot products of bf16 pairs (simd.h, bf16_dot_block), rows of
 * one or two blocks per half with tables that pass bf16_dot_tables: the token's table pairs
 * are made once, into registers (4 or 8 vectors), and a row holding a result that
 * bf16_dot_good leaves out is done again by rot_half_row_pairs.  A block is then 2 word
 * permutations, 4 dot products and 2 conversions, against 4 widenings, 12 multiplies and
 * adds and 2 conversions and permutations (rot_pair_block, bf16_pairs_hw). */
PE_INLINE void rot_half_rows_dot(const char *x, int64_t xs, char *o, int64_t os, int64_t nh,
                                 const float *c, const float *ss, int64_t h, row_mode m) {
    pe_vi a[2 * PE_PAIR_TABLES_HELD], b[2 * PE_PAIR_TABLES_HELD];
    for (int64_t k = 0; k < h / PE_BF16_BLOCK; ++k) {
        const int64_t e = k * PE_BF16_BLOCK;
        bf16_dot_pairs(c + e, ss + e, &a[2 * k], &a[2 * k + 1]);
        bf16_dot_pairs(ss + h + e, c + h + e, &b[2 * k], &b[2 * k + 1]);
    }
    for (int64_t hd = 0; hd < nh; ++hd) {
        const char *xr = x + hd * xs * 2;
        char *orow = o + hd * os * 2;
        __mmask32 good = ~(__mmask32)0;
        prefetch_ahead(xr, 4 * h, m.ahead);
        for (int64_t k = 0; k < h / PE_BF16_BLOCK; ++k) {
            const int64_t e = k * PE_BF16_BLOCK;
            pe_vi r0, r1;
            bf16_dot_block(vi_load(xr + 2 * e), vi_load(xr + 2 * (h + e)), &a[2 * k],
                           &b[2 * k], &r0, &r1);
            good = bf16_dot_good(bf16_dot_good(good, r0), r1);
            if (m.stream) {
                vi_stream(orow + 2 * e, r0);
                vi_stream(orow + 2 * (h + e), r1);
            } else {
                vi_store(orow + 2 * e, r0);
                vi_store(orow + 2 * (h + e), r1);
            }
        }
        if (__builtin_expect(good != ~(__mmask32)0, 0)) {
            if (m.stream) _mm_sfence(); /* as in rot_half_row_pairs */
            rot_half_row_pairs(xr, orow, c, ss, h, m, NULL);
        }
    }
}
#endif

PE_INLINE void rot_half_rows_pairs(const char *x, int64_t xs, char *o, int64_t os, int64_t nh,
                                   const float *c, const float *ss, int64_t h, row_mode m) {
#ifdef PE_BF16_HW
    if (m.dot_tables && nh > 1 && h == 2 * PE_BF16_BLOCK) {
        rot_half_rows_dot(x, xs, o, os, nh, c, ss, 2 * PE_BF16_BLOCK, m);
        return;
    }
    if (m.dot_tables && nh > 1 && h == PE_BF16_BLOCK) {
        rot_half_rows_dot(x, xs, o, os, nh, c, ss, PE_BF16_BLOCK, m);
        return;
    }
#endif
#ifdef PE_PAIR_TABLES_HELD
    if (nh > 1 && h == 2 * PE_BF16_BLOCK) {
        rot_half_rows_pairs_held(x, xs, o, os, nh, c, ss, 2 * PE_BF16_BLOCK, m);
        return;
    }
    if (nh > 1 && h == PE_BF16_BLOCK) {
        rot_half_rows_pairs_held(x, xs, o, os, nh, c, ss, PE_BF16_BLOCK, m);
        return;
    }
#endif
    for (int64_t hd = 0; hd < nh; ++hd)
        rot_half_row_pairs(x + hd * xs * 2, o + hd * os * 2, c, ss, h, m, NULL);
}

/* A row of R = 2h table values from channel order into pair order. */
PE_INLINE void pair_order(float *restrict dst, const float *restrict src, int64_t h) {
    const int64_t whole = h - h % PE_BF16_BLOCK;
    for (int64_t base = 0; base < 2 * h; base += h) {
        pair_order_blocks(dst + base, src + base, whole);
        for (int64_t b = whole; b < h; ++b) dst[base + b] = src[base + b];
    }
}

/* A block's 2 PE_VW values in channel order (a first) into *v0, *v1, in pair order or as
 * they are. */
PE_INLINE void block_order(pe_vf a, pe_vf b, int pairs, pe_vf *v0, pe_vf *v1) {
    if (pairs) {
        vf_deinterleave(a, b, v0, v1);
    } else {
        *v0 = a;
        *v1 = b;
    }
}

/* The 2 PE_VW values of dtype dt at p as two fp32 vectors, in pair order or in channel
 * order. */
PE_INLINE void load_block(const char *p, pe_dtype dt, int pairs, pe_vf *v0, pe_vf *v1) {
    if (dt == PE_BFLOAT16 && pairs) {
        const pe_vi u = vi_load(p);
        *v0 = bf16_even(u);
        *v1 = bf16_odd(u);
        return;
    }
    const int64_t es = dt == PE_FLOAT32 ? 4 : 2;
    block_order(vx_load(p, dt), vx_load(p + PE_VW * es, dt), pairs, v0, v1);
}
#endif

/* Rotates the nh heads of one token (head strides xs, os in elements) if the fast rows
 * cover the dtype; returns 1 if so.  head_dim 128 (h = 64) gets a fully unrolled copy.  bf16
 * rows of at least a block per half read the tables in pair order (pairs_rows). */
PE_INLINE int rot_half_heads(const void *in, int64_t xs, void *out, int64_t os, int64_t nh,
                             pe_dtype dt, const float *c, const float *ss, int64_t R,
                             row_mode m) {
    const char *x = (const char *)in;
    char *o = (char *)out;
    const int64_t h = R / 2;
    switch (dt) {
    case PE_FLOAT32:
        if (h == 64) rot_half_rows(x, xs, o, os, nh, c, ss, 64, PE_FLOAT32, m);
        else rot_half_rows(x, xs, o, os, nh, c, ss, h, PE_FLOAT32, m);
        return 1;
    case PE_BFLOAT16:
#ifdef PE_BF16_BLOCK
        if (h == 64) rot_half_rows_pairs(x, xs, o, os, nh, c, ss, 64, m);
        else if (h >= PE_BF16_BLOCK) rot_half_rows_pairs(x, xs, o, os, nh, c, ss, h, m);
        else rot_half_rows(x, xs, o, os, nh, c, ss, h, PE_BFLOAT16, m);
#else
        if (h == 64) rot_half_rows(x, xs, o, os, nh, c, ss, 64, PE_BFLOAT16, m);
        else rot_half_rows(x, xs, o, os, nh, c, ss, h, PE_BFLOAT16, m);
#endif
        return 1;
    case PE_FLOAT16:
        if (h == 64) rot_half_rows(x, xs, o, os, nh, c, ss, 64, PE_FLOAT16, m);
        else rot_half_rows(x, xs, o, os, nh, c, ss, h, PE_FLOAT16, m);
        return 1;
    default:
        return 0;
    }
}

/* ---- fp32 core ---------------------------------------------------------------------- */

/*
 * out[e] = x[e] * c[e] + x[p(e)] * ss[e] over the R rotary channels, where ss already holds
 * the signed sine of the forward or of the transpose.
 */
PE_INLINE void rotate_row(const float *restrict x, float *restrict o, const float *restrict c,
                              const float *restrict ss, int64_t R, pe_pairing pairing) {
    if (pairing == PE_PAIR_HALF) {
        const int64_t h = R / 2;
        for (int64_t e = 0; e < h; ++e) o[e] = pe_rot_f32(x[e], c[e], x[e + h], ss[e]);
        for (int64_t e = h; e < R; ++e) o[e] = pe_rot_f32(x[e], c[e], x[e - h], ss[e]);
    } else {
        for (int64_t e = 0; e < R; e += 2) {
            o[e] = pe_rot_f32(x[e], c[e], x[e + 1], ss[e]);
            o[e + 1] = pe_rot_f32(x[e + 1], c[e + 1], x[e], ss[e + 1]);
        }
    }
}

/*
 * Signed sine for the row: forward ss[e] = sign(e) s[e]; transpose ss[e] = sign(p(e)) s[p(e)].
 * s is overwritten.
 */
PE_INLINE void sign_sine(float *restrict s, float *restrict ss, int64_t R,
                                 pe_pairing pairing, int transpose) {
    if (pairing == PE_PAIR_HALF) {
        const int64_t h = R / 2;
        if (!transpose) {
            for (int64_t e = 0; e < h; ++e) ss[e] = -s[e];
            for (int64_t e = h; e < R; ++e) ss[e] = s[e];
        } else {
            for (int64_t e = 0; e < h; ++e) ss[e] = s[e + h];
            for (int64_t e = h; e < R; ++e) ss[e] = -s[e - h];
        }
    } else {
        for (int64_t e = 0; e < R; e += 2) {
            float s0 = s[e], s1 = s[e + 1];
            ss[e] = transpose ? s1 : -s0;
            ss[e + 1] = transpose ? -s0 : s1;
        }
    }
}

/* cos and unsigned sin of token (b, t) into c[R], s[R]. */
PE_INLINE void token_tables(const pe_rope_args *a, const pe_rope_plan *plan, int64_t b, int64_t t,
                             float *restrict c, float *restrict s, float *restrict rows,
                             float *restrict scratch) {
    const pe_rope_source *src = &a->src;
    const int64_t R = a->rot_dim;
    if (src->pos) {
        const int64_t nslot = R / 2;
        float *cs = scratch, *sn = scratch + nslot;
        pe_rope_slot_sincos(a, plan, b, t, cs, sn);
        if (a->pairing == PE_PAIR_HALF) {
            for (int64_t i = 0; i < nslot; ++i) {
                c[i] = c[i + nslot] = cs[i];
                s[i] = s[i + nslot] = sn[i];
            }
        } else {
            for (int64_t i = 0; i < nslot; ++i) {
                c[2 * i] = c[2 * i + 1] = cs[i];
                s[2 * i] = s[2 * i + 1] = sn[i];
            }
        }
        return;
    }
    const size_t es = pe_dtype_size(src->table_dtype);
    const int64_t off = (src->table_batch == 1 ? 0 : b) * src->table_stride[1] +
                        t * src->table_stride[2];
    const char *cb = (const char *)src->cos + off * (int64_t)es;
    const char *sb = (const char *)src->sin + off * (int64_t)es;
    if (plan->axes == 1) {
        load_row(c, cb, src->table_dtype, R);
        load_row(s, sb, src->table_dtype, R);
        return;
    }
    const int64_t axis_bytes = src->table_stride[0] * (int64_t)es;
    if (plan->nruns <= 8) {
        /* MRoPE sections: a few runs of channels that share an axis, one load each */
        for (int64_t i = 0; i < plan->nruns; ++i) {
            const int64_t e0 = plan->run_start[i], n = plan->run_start[i + 1] - e0;
            const int64_t o = plan->chan_axis[e0] * axis_bytes + e0 * (int64_t)es;
            load_row(c + e0, cb + o, src->table_dtype, n);
            load_row(s + e0, sb + o, src->table_dtype, n);
        }
        return;
    }
    /* interleaved MRoPE: load the rows of all axes, then channel e takes its axis' value */
    for (int pass = 0; pass < 2; ++pass) {
        const char *base = pass ? sb : cb;
        float *dst = pass ? s : c;
        for (int64_t ax = 0; ax < plan->axes; ++ax)
            load_row(rows + ax * R, base + ax * axis_bytes, src->table_dtype, R);
        for (int64_t e = 0; e < R; ++e) dst[e] = rows[plan->chan_axis[e] * R + e];
    }
}

/* Rotate one row through fp32 scratch rows: any 16-bit or fp32 dtype in and out. */
PE_INLINE void rotate_general(const pe_rope_tensor *x, const void *in, void *out,
                               const float *restrict c, const float *restrict ss,
                               float *restrict xbuf, float *restrict obuf, int64_t R,
                               pe_pairing pairing) {
    const float *xr = (const float *)in;
    if (x->in_dtype != PE_FLOAT32) {
        load_row(xbuf, in, x->in_dtype, R);
        xr = xbuf;
    }
    const int native_out = x->out_dtype == PE_FLOAT32;
    float *orow = native_out ? (float *)out : obuf;
    rotate_row(xr, orow, c, ss, R, pairing);
    if (!native_out) store_row(out, obuf, x->out_dtype, R);
}

/* Rotate heads h0 .. h1-1 of one tensor for token (b, t). */
PE_INLINE void token_heads(const pe_rope_args *a, const pe_rope_tensor *x, int64_t b, int64_t t,
                           int64_t h0, int64_t h1, const float *restrict c,
                           const float *restrict ss, float *restrict xbuf, float *restrict obuf,
                           row_mode m) {
    if (h1 <= h0) return;
    const int64_t R = a->rot_dim, D = a->head_dim;
    const size_t ies = pe_dtype_size(x->in_dtype), oes = pe_dtype_size(x->out_dtype);
    const int same = x->in_dtype == x->out_dtype;
    const char *ib = pe_row(x->in, x->in_stride, ies, b, t, h0);
    char *ob = (char *)pe_row(x->out, x->out_stride, oes, b, t, h0);
    const int done = same && a->pairing == PE_PAIR_HALF &&
                     rot_half_heads(ib, x->in_stride[2], ob, x->out_stride[2], h1 - h0,
                                    x->in_dtype, c, ss, R, m);
    if (done && D == R) return;
    for (int64_t h = 0; h < h1 - h0; ++h) {
        const void *in = ib + h * x->in_stride[2] * (int64_t)ies;
        void *out = ob + h * x->out_stride[2] * (int64_t)oes;
        if (!done) rotate_general(x, in, out, c, ss, xbuf, obuf, R, a->pairing);
        if (D > R) { /* pass-through channels */
            if (same) {
                memcpy((char *)out + R * (int64_t)oes, (const char *)in + R * (int64_t)ies,
                       (size_t)(D - R) * oes);
            } else {
                load_row(xbuf, (const char *)in + R * (int64_t)ies, x->in_dtype, D - R);
                store_row((char *)out + R * (int64_t)oes, xbuf, x->out_dtype, D - R);
            }
        }
    }
}

/* 1 when x's rows are the bf16 fast rows that read the tables in pair order
 * (rot_half_heads). */
PE_INLINE int pairs_rows(const pe_rope_args *a, const pe_rope_tensor *x) {
#ifdef PE_BF16_BLOCK
    return a->pairing == PE_PAIR_HALF && x->in_dtype == PE_BFLOAT16 &&
           x->out_dtype == PE_BFLOAT16 && a->rot_dim / 2 >= PE_BF16_BLOCK;
#else
    (void)a;
    (void)x;
    return 0;
#endif
}

/* cos and signed sine of the n tokens of a tile from flat index i0, in channel order or
 * (pairs) in pair order; cn, sn are two scratch rows. */
PE_INLINE void tile_tables(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0, int64_t n,
                           float *restrict c, float *restrict ss, float *restrict s,
                           float *restrict rows, float *restrict slots, float *restrict cn,
                           float *restrict sn, int pairs) {
    const int64_t T = a->seq, R = a->rot_dim;
    for (int64_t j = 0; j < n; ++j) {
        float *cj = c + j * R, *ssj = ss + j * R;
        token_tables(a, p, (i0 + j) / T, (i0 + j) % T, pairs ? cn : cj, s, rows, slots);
        sign_sine(s, pairs ? sn : ssj, R, a->pairing, a->transpose);
#ifdef PE_BF16_BLOCK
        if (pairs) {
            pair_order(cj, cn, R / 2);
            pair_order(ssj, sn, R / 2);
        }
#endif
    }
}

/* Asks for the table values of token i (flat index) ahead of their use.  The rotation of
 * a tile fetches the next tile's this way: the hardware prefetchers do not follow the
 * short runs read from 3 axes, and a table load that misses would hold up the tile.  The
 * lines asked for are the plan's spans (plan_fetch in rope.c). */
PE_INLINE void prefetch_span(const char *p, int64_t bytes) {
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(p + x);
    __builtin_prefetch(p + bytes - 1);
}

PE_INLINE void prefetch_tables(const pe_rope_args *a, const pe_rope_plan *p, int64_t i) {
    const pe_rope_source *src = &a->src;
    if (src->pos || i >= a->batch * a->seq) return;
    const int64_t T = a->seq, es = (int64_t)pe_dtype_size(src->table_dtype);
    const int64_t off = ((src->table_batch == 1 ? 0 : i / T) * src->table_stride[1] +
                         i % T * src->table_stride[2]) * es;
    const char *cb = (const char *)src->cos + off, *sb = (const char *)src->sin + off;
    for (int64_t f = 0; f < p->nfetch; ++f) {
        prefetch_span(cb + p->fetch[2 * f], p->fetch[2 * f + 1]);
        prefetch_span(sb + p->fetch[2 * f], p->fetch[2 * f + 1]);
    }
}

#ifdef PE_BF16_BLOCK
/* Block k of a table row (axis rows ax * axis_bytes apart) as two vectors: the block of
 * the lowest axis it reads, then the channels of the others blended in.  AVX-512 blends
 * the values as they are in memory, by the plan's bits (block_sel), and widens the block
 * once: one load and one masked blend for each further axis. */
PE_INLINE void table_block(const char *row, int64_t axis_bytes, pe_dtype dt, int pairs,
                           const pe_rope_plan *p, int64_t R, int64_t k, pe_vf *v0, pe_vf *v1) {
    const int64_t es = (int64_t)pe_dtype_size(dt), e = k * PE_BF16_BLOCK;
    const unsigned used = p->block_axes[k];
    const int lo = used & 1u ? 0 : used & 2u ? 1 : 2;
#if PE_VW == 16
    if (used != 1u << lo) {
        const char *at = row + e * es;
        const uint32_t *bits = p->block_sel + k;
        const int64_t sel_stride = R / PE_BF16_BLOCK + 1;
        pe_vf a, b;
        if (dt == PE_FLOAT32) {
            a = vf_load((const float *)(at + lo * axis_bytes));
            b = vf_load((const float *)(at + lo * axis_bytes) + PE_VW);
            for (int ax = lo + 1; ax < 3; ++ax) {
                if (!(used & (1u << ax))) continue;
                const uint32_t m = bits[(ax - 1) * sel_stride];
                const float *src = (const float *)(at + ax * axis_bytes);
                a = _mm512_mask_blend_ps((__mmask16)m, a, vf_load(src));
                b = _mm512_mask_blend_ps((__mmask16)(m >> 16), b, vf_load(src + PE_VW));
            }
        } else { /* 16-bit tables: the block's 32 values are one vector */
            pe_vi u = vi_load(at + lo * axis_bytes);
            for (int ax = lo + 1; ax < 3; ++ax)
                if (used & (1u << ax))
                    u = _mm512_mask_blend_epi16((__mmask32)bits[(ax - 1) * sel_stride], u,
                                                vi_load(at + ax * axis_bytes));
            if (dt == PE_BFLOAT16 && pairs) {
                *v0 = bf16_even(u);
                *v1 = bf16_odd(u);
                return;
            }
            a = vx_widen16(_mm512_castsi512_si256(u), dt);
            b = vx_widen16(_mm512_extracti64x4_epi64(u, 1), dt);
        }
        block_order(a, b, pairs, v0, v1);
        return;
    }
#endif
    load_block(row + lo * axis_bytes + e * es, dt, pairs, v0, v1);
    for (int ax = lo + 1; ax < 3; ++ax) {
        if (!(used & (1u << ax))) continue;
        pe_vf b0, b1, m0, m1;
        load_block(row + ax * axis_bytes + e * es, dt, pairs, &b0, &b1);
        load_block((const char *)(p->axis_sel + (ax - 1) * R + e), PE_FLOAT32, pairs,
                         &m0, &m1);
        *v0 = vf_select(*v0, b0, m0);
        *v1 = vf_select(*v1, b1, m1);
    }
}

/* cos and signed sine of one token's block pair (k in the first half, k + nb in the
 * second): c0, c1, s0, s1 are the cos and sine of the first and the second block. */
PE_INLINE void store_block_pair(float *restrict c, float *restrict ss, int64_t h, int64_t e,
                                const pe_vf c0[2], const pe_vf c1[2], const pe_vf s0[2],
                                const pe_vf s1[2], int transpose) {
    for (int i = 0; i < 2; ++i) {
        vx_store((char *)(c + e + i * PE_VW), c0[i], PE_FLOAT32);
        vx_store((char *)(c + h + e + i * PE_VW), c1[i], PE_FLOAT32);
        /* forward ss = -s, s by half; transpose ss[e] = s[e + h], ss[e + h] = -s[e] */
        vx_store((char *)(ss + e + i * PE_VW), transpose ? s1[i] : vf_neg(s0[i]), PE_FLOAT32);
        vx_store((char *)(ss + h + e + i * PE_VW), transpose ? vf_neg(s0[i]) : s1[i],
                 PE_FLOAT32);
    }
}

/*
 * tile_tables for half pairing with h a multiple of 2 PE_VW and tables of a dtype the
 * vector loads read: each block of channels goes from the tables (or the slots' sine and
 * cosine) straight into the rotation's order and signs, with no row in between.
 */
PE_INLINE void tile_tables_blocks(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                  int64_t n, float *restrict c, float *restrict ss,
                                  float *restrict slots, int pairs) {
    const pe_rope_source *src = &a->src;
    const int64_t T = a->seq, R = a->rot_dim, h = R / 2, nb = h / PE_BF16_BLOCK;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t b = (i0 + j) / T, t = (i0 + j) % T;
        float *cj = c + j * R, *ssj = ss + j * R;
        if (src->pos) {
            float *cs = slots, *sn = slots + h;
            pe_rope_slot_sincos(a, p, b, t, cs, sn);
            for (int64_t k = 0; k < nb; ++k) {
                const int64_t e = k * PE_BF16_BLOCK;
                pe_vf cv[2], sv[2];
                load_block((const char *)(cs + e), PE_FLOAT32, pairs, &cv[0], &cv[1]);
                load_block((const char *)(sn + e), PE_FLOAT32, pairs, &sv[0], &sv[1]);
                store_block_pair(cj, ssj, h, e, cv, cv, sv, sv, a->transpose);
            }
            continue;
        }
        const pe_dtype dt = src->table_dtype;
        const int64_t es = (int64_t)pe_dtype_size(dt), axis_bytes = src->table_stride[0] * es;
        const int64_t off = ((src->table_batch == 1 ? 0 : b) * src->table_stride[1] +
                             t * src->table_stride[2]) * es;
        const char *cb = (const char *)src->cos + off, *sb = (const char *)src->sin + off;
        for (int64_t k = 0; k < nb; ++k) {
            pe_vf c0[2], c1[2], s0[2], s1[2];
            table_block(cb, axis_bytes, dt, pairs, p, R, k, &c0[0], &c0[1]);
            table_block(cb, axis_bytes, dt, pairs, p, R, k + nb, &c1[0], &c1[1]);
            table_block(sb, axis_bytes, dt, pairs, p, R, k, &s0[0], &s0[1]);
            table_block(sb, axis_bytes, dt, pairs, p, R, k + nb, &s1[0], &s1[1]);
            store_block_pair(cj, ssj, h, k * PE_BF16_BLOCK, c0, c1, s0, s1, a->transpose);
        }
    }
}
#endif

/* 1 when tile_tables_blocks can prepare the tables (the plan's blocks are this build's). */
PE_INLINE int table_blocks(const pe_rope_args *a, const pe_rope_plan *p) {
#ifdef PE_BF16_BLOCK
    const pe_dtype dt = a->src.table_dtype;
    return a->pairing == PE_PAIR_HALF && p->block == PE_BF16_BLOCK &&
           (a->rot_dim / 2) % PE_BF16_BLOCK == 0 &&
           (a->src.pos || dt == PE_FLOAT32 || dt == PE_BFLOAT16 || dt == PE_FLOAT16);
#else
    (void)a;
    (void)p;
    return 0;
#endif
}

/*
 * Tile of n consecutive tokens (flat index i0 = b*T + t; p->tile tokens at most): the
 * tokens' tables are prepared first, all together (their loads overlap one another instead
 * of each waiting in front of its token's rows), then the rows are rotated.  With the heads
 * inner in memory the tokens go in order, all heads of a token at once; with the heads
 * outer ((B, H, T, D) tensors, e.g. gradients coming back from attention) the tile is
 * rotated head by head, so the rows of each head, adjacent in memory, are visited in order.
 */
PE_INLINE void rope_f32_rotate(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                               int64_t n, void *scratch) {
    const int64_t T = a->seq, R = a->rot_dim, D = a->head_dim;
    float *c = (float *)scratch, *ss = c + p->tile * R, *s = ss + p->tile * R;
    float *xb = s + R, *ob = xb + D, *rows = ob + D, *slots = rows + 3 * R;
    float *cn = slots + R, *sn = cn + R;
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    const int blocks = table_blocks(a, p);
    (void)blocks;
    int order = -1; /* the order the tile's tables are in: none yet */
    int fetch = 1;  /* the next tile's tables are still to be asked for */
    row_mode m = {0, 1, 0, 0};
    for (int w = 0; w < 2; ++w) {
        const int64_t H = xs[w]->heads, step = p->heads_outer ? PE_OUTER_GROUP : H;
        if (!H) continue;
        const int pairs = pairs_rows(a, xs[w]);
        if (pairs != order) {
#ifdef PE_BF16_BLOCK
            if (blocks)
                tile_tables_blocks(a, p, i0, n, c, ss, slots, pairs);
            else
#endif
                tile_tables(a, p, i0, n, c, ss, s, rows, slots, cn, sn, pairs);
#ifdef PE_BF16_HW /* NaN need no scan: the hardware rounds them as the software does */
            m.dot_tables = pairs && (R == 2 * PE_BF16_BLOCK || R == 4 * PE_BF16_BLOCK) &&
                           bf16_dot_tables(c, n * R) && bf16_dot_tables(ss, n * R);
#else
            m.nan_tables = pairs && (any_nan(c, n * R) || any_nan(ss, n * R));
#endif
        }
        order = pairs;
        m.stream = p->stream_out[w];
        m.ahead = p->ahead[w];
        for (int64_t h = 0; h < H; h += step)
            for (int64_t j = 0; j < n; ++j) {
                if (fetch && h == 0) prefetch_tables(a, p, i0 + p->tile + j);
                token_heads(a, xs[w], (i0 + j) / T, (i0 + j) % T, h,
                            h + step < H ? h + step : H, c + j * R, ss + j * R, xb, ob, m);
            }
        fetch = 0;
    }
#ifdef PE_VW
    if (p->stream_out[0] || p->stream_out[1]) _mm_sfence(); /* before the pass is done */
#endif
}

/* Accumulate g[e] x[e] and g[e] sign(e) x[p(e)] of every head of one tensor at (b, t). */
PE_INLINE void accumulate_heads(const pe_rope_args *a, const pe_rope_tensor *x, const void *g,
                                const int64_t gs[3], pe_dtype gdt, int64_t b, int64_t t,
                                float *restrict acc_c, float *restrict acc_s,
                                float *restrict xb, float *restrict gb) {
    const int64_t R = a->rot_dim, h2 = R / 2;
    const size_t xes = pe_dtype_size(x->in_dtype), ges = pe_dtype_size(gdt);
    for (int64_t h = 0; h < x->heads; ++h) {
        load_row(xb, pe_row(x->in, x->in_stride, xes, b, t, h), x->in_dtype, R);
        load_row(gb, pe_row(g, gs, ges, b, t, h), gdt, R);
        for (int64_t e = 0; e < R; ++e) acc_c[e] += gb[e] * xb[e];
        if (a->pairing == PE_PAIR_HALF) {
            for (int64_t e = 0; e < h2; ++e) acc_s[e] -= gb[e] * xb[e + h2];
            for (int64_t e = h2; e < R; ++e) acc_s[e] += gb[e] * xb[e - h2];
        } else {
            for (int64_t e = 0; e < R; e += 2) {
                acc_s[e] -= gb[e] * xb[e + 1];
                acc_s[e + 1] += gb[e + 1] * xb[e];
            }
        }
    }
}

#ifdef PE_VW
/* The inverse of load_block for fp32 values: 2 PE_VW floats at dst, in channel order, from
 * two vectors in pair order or in channel order. */
PE_INLINE void store_block(float *dst, pe_vf v0, pe_vf v1, int pairs) {
    if (pairs) { /* interleave the even (v0) and the odd (v1) channels */
#if PE_VW == 16
        const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                             15, 31);
        const pe_vf a = _mm512_permutex2var_ps(v0, lo, v1), b = _mm512_permutex2var_ps(v0, hi, v1);
#else
        const __m256 l = _mm256_unpacklo_ps(v0, v1), h = _mm256_unpackhi_ps(v0, v1);
        const pe_vf a = _mm256_permute2f128_ps(l, h, 0x20), b = _mm256_permute2f128_ps(l, h, 0x31);
#endif
        v0 = a;
        v1 = b;
    }
    vx_store((char *)dst, v0, PE_FLOAT32);
    vx_store((char *)(dst + PE_VW), v1, PE_FLOAT32);
}

/* One block of accumulate_blocks: c[i] += g[i] x[i], and s[i] -= g[i] x[i + 2] (first
 * half) or += g[i] x[i - 2] (second half), four vectors each, kept in memory (L1). */
PE_INLINE void accumulate_block(float *restrict c, float *restrict s, const pe_vf x[4],
                                const pe_vf g[4]) {
    for (int i = 0; i < 4; ++i)
        vx_store((char *)(c + i * PE_VW), vf_add(vf_load(c + i * PE_VW), vf_mul(g[i], x[i])),
                 PE_FLOAT32);
    for (int i = 0; i < 4; ++i) {
        const pe_vf gx = vf_mul(g[i], x[i ^ 2]), acc = vf_load(s + i * PE_VW);
        vx_store((char *)(s + i * PE_VW), i < 2 ? vf_sub(acc, gx) : vf_add(acc, gx), PE_FLOAT32);
    }
}

/*
 * acc_c, acc_s of one table row (rows of batch b0 .. b1-1 at t), half pairing, q, k and the
 * gradients all of dtype dt, h a multiple of 2 PE_VW: each head's row read once, in order,
 * a block of channels of both halves at a time, into sums kept block by block in bc, bs
 * (R floats of scratch each); the same sums, in the same order, as accumulate_heads, with
 * no conversion through scratch rows.  (Sums in registers, block by block over all heads,
 * read each row in four strided passes: 1.5-2x slower from memory with AVX2.)
 */
PE_INLINE void accumulate_blocks(const pe_rope_args *a, const pe_rope_plan *p, int64_t b0,
                                 int64_t b1, int64_t t, pe_dtype dt, float *restrict acc_c,
                                 float *restrict acc_s, float *restrict bc, float *restrict bs) {
    const int64_t h = a->rot_dim / 2, es = dt == PE_FLOAT32 ? 4 : 2, bw = 2 * PE_VW;
    const int pairs = dt == PE_BFLOAT16;
    const pe_rope_tensor *xs[2] = {&a->q, &a->k};
    const void *gs[2] = {p->grad_q, p->grad_k};
    const int64_t *gst[2] = {p->grad_q_stride, p->grad_k_stride};
    for (int64_t i = 0; i < 2 * h; ++i) bc[i] = bs[i] = 0.0f;
    for (int64_t b = b0; b < b1; ++b)
        for (int w = 0; w < 2; ++w)
            for (int64_t hd = 0; hd < xs[w]->heads; ++hd) {
                const char *xr = pe_row(xs[w]->in, xs[w]->in_stride, es, b, t, hd);
                const char *gr = pe_row(gs[w], gst[w], es, b, t, hd);
                for (int64_t e = 0; e < h; e += bw) {
                    pe_vf x[4], g[4];
                    load_block(xr + e * es, dt, pairs, &x[0], &x[1]);
                    load_block(xr + (h + e) * es, dt, pairs, &x[2], &x[3]);
                    load_block(gr + e * es, dt, pairs, &g[0], &g[1]);
                    load_block(gr + (h + e) * es, dt, pairs, &g[2], &g[3]);
                    accumulate_block(bc + 2 * e, bs + 2 * e, x, g);
                }
            }
    for (int64_t e = 0; e < h; e += bw) { /* block order (and pair order) to channel order */
        const float *c = bc + 2 * e, *s = bs + 2 * e;
        store_block(acc_c + e, vf_load(c), vf_load(c + PE_VW), pairs);
        store_block(acc_c + h + e, vf_load(c + 2 * PE_VW), vf_load(c + 3 * PE_VW), pairs);
        store_block(acc_s + e, vf_load(s), vf_load(s + PE_VW), pairs);
        store_block(acc_s + h + e, vf_load(s + 2 * PE_VW), vf_load(s + 3 * PE_VW), pairs);
    }
}
#endif

/* 1 when a table-gradient row can run accumulate_blocks. */
PE_INLINE int grad_blocks(const pe_rope_args *a, const pe_rope_plan *p) {
#ifdef PE_VW
    const pe_dtype dt = p->grad_dtype;
    return a->pairing == PE_PAIR_HALF && (a->rot_dim / 2) % (2 * PE_VW) == 0 &&
           (dt == PE_FLOAT32 || dt == PE_BFLOAT16 || dt == PE_FLOAT16) &&
           (!a->q.heads || a->q.in_dtype == dt) && (!a->k.heads || a->k.in_dtype == dt);
#else
    (void)a;
    (void)p;
    return 0;
#endif
}

/* Table-gradient rows i0 .. i0+n-1 (row i = bc*T + t of the (Bc, T) tables). */
PE_INLINE void rope_f32_grad_rows(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                  int64_t n, void *scratch) {
    const int64_t B = a->batch, T = a->seq, R = a->rot_dim, Bc = a->src.table_batch;
    const size_t oes = pe_dtype_size(p->out_dtype);
    float *acc_c = (float *)scratch, *acc_s = acc_c + R, *xb = acc_s + R, *gb = xb + R;
    float *ob = gb + R;
#ifdef PE_VW
    const int blocks = grad_blocks(a, p);
#endif
    for (int64_t i = i0; i < i0 + n; ++i) {
        const int64_t bc = i / T, t = i % T;
        const int64_t b0 = Bc == 1 ? 0 : bc, b1 = Bc == 1 ? B : bc + 1;
#ifdef PE_VW
        if (blocks) { /* one loop per dtype; xb, gb hold the sums */
            if (p->grad_dtype == PE_BFLOAT16)
                accumulate_blocks(a, p, b0, b1, t, PE_BFLOAT16, acc_c, acc_s, xb, gb);
            else if (p->grad_dtype == PE_FLOAT16)
                accumulate_blocks(a, p, b0, b1, t, PE_FLOAT16, acc_c, acc_s, xb, gb);
            else
                accumulate_blocks(a, p, b0, b1, t, PE_FLOAT32, acc_c, acc_s, xb, gb);
        } else
#endif
        {
            for (int64_t e = 0; e < R; ++e) acc_c[e] = acc_s[e] = 0;
            for (int64_t b = b0; b < b1; ++b) {
                accumulate_heads(a, &a->q, p->grad_q, p->grad_q_stride, p->grad_dtype, b, t,
                                 acc_c, acc_s, xb, gb);
                accumulate_heads(a, &a->k, p->grad_k, p->grad_k_stride, p->grad_dtype, b, t,
                                 acc_c, acc_s, xb, gb);
            }
        }
        for (int64_t ax = 0; ax < p->axes; ++ax) {
            const int64_t off = ((ax * Bc + bc) * T + t) * R * (int64_t)oes;
            for (int pass = 0; pass < 2; ++pass) {
                const float *acc = pass ? acc_s : acc_c;
                char *dst = (char *)(pass ? p->sin_out : p->cos_out) + off;
                if (p->axes == 1) {
                    store_row(dst, acc, p->out_dtype, R);
                    continue;
                }
                int64_t e = 0;
#ifdef PE_VW
                if (p->out_dtype != PE_FLOAT64) /* acc where the channel reads axis ax, else 0 */
                    for (const uint32_t *m = p->axis_sel; e + PE_VW <= R; e += PE_VW) {
                        const pe_vf m1 = vf_load((const float *)m + e);
                        const pe_vf m2 = vf_load((const float *)m + R + e);
                        const pe_vf v = vf_load(acc + e);
                        vx_store(dst + e * (int64_t)oes,
                                 ax == 0   ? vf_andnot(vf_or(m1, m2), v)
                                 : ax == 1 ? vf_and(m1, v)
                                           : vf_and(m2, v),
                                 p->out_dtype);
                    }
#endif
                for (int64_t f = e; f < R; ++f) ob[f - e] = p->chan_axis[f] == ax ? acc[f] : 0.0f;
                store_row(dst + e * (int64_t)oes, ob, p->out_dtype, R - e);
            }
        }
    }
}

/* Rows i0 .. i0+n-1 of the (Bp, T, R) tables from positions: fp32 angles and sin/cos, one
 * rounding. */
PE_INLINE void rope_f32_table_rows(const pe_rope_args *a, const pe_rope_plan *p, int64_t i0,
                                   int64_t n, void *scratch) {
    const int64_t T = a->seq, R = a->rot_dim;
    const size_t oes = pe_dtype_size(p->out_dtype);
    float *c = (float *)scratch, *s = c + R, *slots = s + R;
    for (int64_t i = i0; i < i0 + n; ++i) {
        token_tables(a, p, i / T, i % T, c, s, NULL, slots);
        store_row((char *)p->cos_out + i * R * (int64_t)oes, c, p->out_dtype, R);
        store_row((char *)p->sin_out + i * R * (int64_t)oes, s, p->out_dtype, R);
    }
}

#endif /* POSENC_ROPE_F32_H */

/*
 * The rotary kernel alone (pe_rope_apply), without torch, against memcpy of the same bytes:
 * ns per (token, head) row on Qwen2-VL-7B shapes (28 q heads, 4 kv heads, head_dim 128,
 * MRoPE sections [16, 24, 24] with 4.x tables (3, 1, T, 128) of cosines and sines in q's
 * dtype), q and k as transformers' (B, H, T, D) views of the projection, B = 1, the same
 * outputs every call (no page faults).  Each round calls the kernel, then copies q and k
 * into buffers of their own; it prints the best time of each and the median of the
 * per-round ratios.
 *
 * Where q and k fit in a cache (T = 512 is 8 MiB in bf16), memcpy moves them about as fast
 * as a host whose memory keeps up would, so the ratio there says what the kernel costs when
 * memory is not what bounds it (docs/benchmarks.md, "The rotation where memory keeps up").
 * The backward (transpose = 1) writes contiguous (B, H, T, D) gradients, as the autograd
 * formula's call does.  The output hash must not change between two builds that claim the
 * same bits.
 *
 *   cc -O2 -fopenmp -Icsrc -Icsrc/cpu scripts/rope_op.c <builddir>/libposenc_kernels.a \
 *      -lm -o rope_op
 *   ./rope_op [T=512] [reps=300] [isa=-1: the best; 0 baseline .. 3 avx512bf16] [bf16=1]
 *             [transpose=0]
 *
 * One thread (memcpy has one).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "posenc.h"
#include "timing.h"

enum { HQ = 28, HK = 4, D = 128 };

static int cmp_double(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

int main(int argc, char **argv) {
    const int T = argc > 1 ? atoi(argv[1]) : 512, reps = argc > 2 ? atoi(argv[2]) : 300;
    const int isa = argc > 3 ? atoi(argv[3]) : -1, bf16 = argc > 4 ? atoi(argv[4]) : 1;
    const int transpose = argc > 5 ? atoi(argv[5]) : 0;
    if (T < 1 || reps < 1) return 2;
    if (isa >= 0 && pe_isa_set((pe_isa)isa) != PE_OK) return 1;
    const size_t es = bf16 ? 2 : 4, n[2] = {(size_t)T * HQ * D, (size_t)T * HK * D};
    const size_t ntab = 3 * (size_t)T * D;
    const int heads[2] = {HQ, HK};
    const pe_dtype dt = bf16 ? PE_BFLOAT16 : PE_FLOAT32;
    void *c = aligned_alloc(64, ntab * es), *s = aligned_alloc(64, ntab * es);
    void *in[2], *out[2], *copy[2];
    for (int ax = 0; ax < 3; ++ax) { /* each axis's positions: t, t + 7, t + 13 */
        const size_t at = (size_t)ax * T * D * es;
        fill_tables((char *)c + at, (char *)s + at, (size_t)T, D, bf16, 7 * ax - (ax == 2));
    }
    uint8_t axis_of_slot[D / 2]; /* sections [16, 24, 24] */
    for (int i = 0; i < D / 2; ++i) axis_of_slot[i] = (uint8_t)(i < 16 ? 0 : i < 40 ? 1 : 2);
    pe_rope_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.seq = T, a.head_dim = D, a.rot_dim = D, a.pairing = PE_PAIR_HALF;
    a.transpose = transpose, a.nthreads = 1;
    a.src.cos = c, a.src.sin = s, a.src.table_dtype = dt, a.src.table_batch = 1;
    a.src.table_stride[0] = (int64_t)T * D, a.src.table_stride[1] = (int64_t)T * D;
    a.src.table_stride[2] = D, a.src.axis_of_slot = axis_of_slot;
    pe_rope_tensor *ts[2] = {&a.q, &a.k};
    for (int j = 0; j < 2; ++j) {
        const int64_t H = heads[j];
        in[j] = aligned_alloc(64, n[j] * es), out[j] = aligned_alloc(64, n[j] * es);
        copy[j] = aligned_alloc(64, n[j] * es);
        fill(in[j], n[j], bf16, j ? 104729 : 7919, 1e-3f);
        memset(out[j], 0, n[j] * es), memset(copy[j], 0, n[j] * es);
        pe_rope_tensor *x = ts[j];
        x->in = in[j], x->out = out[j], x->in_dtype = x->out_dtype = dt, x->heads = H;
        /* strides (b, t, h): the projection's layout in, and out unless transposed */
        const int64_t hf[3] = {(int64_t)T * H * D, H * D, D};
        const int64_t outer[3] = {(int64_t)T * H * D, D, (int64_t)T * D};
        memcpy(x->in_stride, hf, sizeof hf);
        memcpy(x->out_stride, transpose ? outer : hf, sizeof hf);
    }
    double *ratio = malloc((size_t)reps * sizeof *ratio), best = 1e9, best_copy = 1e9;
    if (!ratio || pe_rope_apply(&a) != PE_OK) return 1;
    for (int r = 0; r < reps; ++r) {
        const double t0 = now();
        if (pe_rope_apply(&a) != PE_OK) return 1;
        const double t1 = now();
        memcpy(copy[0], in[0], n[0] * es);
        memcpy(copy[1], in[1], n[1] * es);
        const double t2 = now();
        ratio[r] = (t1 - t0) / (t2 - t1);
        if (t1 - t0 < best) best = t1 - t0;
        if (t2 - t1 < best_copy) best_copy = t2 - t1;
    }
    qsort(ratio, (size_t)reps, sizeof *ratio, cmp_double);
    unsigned long long hash = 0;
    for (int j = 0; j < 2; ++j)
        for (size_t i = 0; i < n[j] * es; ++i) hash = hash * 31 + ((unsigned char *)out[j])[i];
    const double rows = (double)T * (HQ + HK), bytes = 2.0 * (double)(n[0] + n[1]) * (double)es;
    printf("%s %s %s T=%d: %.2f ns/row, memcpy %.2f ns/row (%.1f GB/s), best %.2fx,"
           " median of %d rounds %.2fx memcpy, output hash %016llx\n",
           bf16 ? "bf16" : "fp32", transpose ? "backward" : "forward",
           pe_isa_name(pe_isa_current()), T, best * 1e9 / rows, best_copy * 1e9 / rows,
           bytes / best_copy / 1e9, best / best_copy, reps, ratio[reps / 2], hash);
    for (int j = 0; j < 2; ++j) free(in[j]), free(out[j]), free(copy[j]);
    free(c), free(s), free(ratio);
    return 0;
}

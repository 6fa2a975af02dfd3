/*
 * The q/k norm + RoPE kernel alone (pe_qk_norm_rope / _backward), without torch: ns per
 * (token, head) row on Qwen3-VL-8B text-attention shapes (32 q heads, 8 kv heads, head_dim
 * 128, full rotary, the weight form), q and k as transformers' (B, H, T, D) views of the
 * projection, 1 thread, the same outputs every call (no page faults), best of `reps`; the
 * rows of T = 64 tokens stay in L2, so this is the kernel's own speed.  Prints a hash of
 * the outputs (and of the weight gradients in the backward), which must not change between
 * two builds that claim the same bits.
 *
 *   cc -O2 -fopenmp -Icsrc -Icsrc/cpu scripts/qk_norm_rows.c <builddir>/libposenc_kernels.a \
 *      -lm -o qk_norm_rows
 *   ./qk_norm_rows [T=64] [reps=300] [isa=-1: the best; 0 baseline .. 3 avx512bf16]
 *                  [backward=0] [form=0]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "posenc.h"
#include "timing.h"

enum { HQ = 32, HK = 8, D = 128, R = 128 };

int main(int argc, char **argv) {
    const int T = argc > 1 ? atoi(argv[1]) : 64, reps = argc > 2 ? atoi(argv[2]) : 300;
    const int isa = argc > 3 ? atoi(argv[3]) : -1, backward = argc > 4 ? atoi(argv[4]) : 0;
    const int form = argc > 5 ? atoi(argv[5]) : 0;
    if (isa >= 0 && pe_isa_set((pe_isa)isa) != PE_OK) return 1;
    for (int bf16 = 0; bf16 < 2; ++bf16) {
        const size_t es = bf16 ? 2 : 4, n[2] = {(size_t)T * HQ * D, (size_t)T * HK * D};
        const int heads[2] = {HQ, HK};
        void *c = malloc((size_t)T * R * es), *s = malloc((size_t)T * R * es);
        void *w = malloc(D * es), *buf[2][6], *wgrad[2];
        fill_tables(c, s, (size_t)T, R, bf16, 0);
        fill(w, D, bf16, 1, 0.f);
        pe_qk_norm_args a = {0};
        a.batch = 1, a.seq = T, a.head_dim = D, a.rot_dim = R, a.pairing = PE_PAIR_HALF;
        a.form = (pe_norm_form)form, a.dtype = bf16 ? PE_BFLOAT16 : PE_FLOAT32;
        a.eps = 1e-6, a.sum_lanes = 8, a.cos = c, a.sin = s, a.table_batch = 1;
        a.table_stride[0] = (int64_t)T * R, a.table_stride[1] = R, a.nthreads = 1;
        a.sum_threads = 1;
        pe_qk_norm_tensor *ts[2] = {&a.q, &a.k};
        for (int j = 0; j < 2; ++j) {
            /* x, out, grad, wprod (fp32 at most), rstd, ms_pow */
            const size_t rows = (size_t)T * heads[j];
            buf[j][0] = malloc(n[j] * es), buf[j][1] = malloc(n[j] * es);
            buf[j][2] = malloc(n[j] * es), buf[j][3] = malloc(n[j] * 4);
            buf[j][4] = malloc(rows * 4), buf[j][5] = malloc(rows * 4);
            wgrad[j] = malloc(D * 4);
            fill(buf[j][0], n[j], bf16, 7919, 0.f);
            fill(buf[j][2], n[j], bf16, 104729, 0.f);
            for (size_t i = 0; i < rows; ++i) ((float *)buf[j][5])[i] = 0.5f;
            pe_qk_norm_tensor *x = ts[j];
            const int64_t H = heads[j];
            const int64_t st[3] = {(int64_t)T * H * D, H * D, D}, rst[3] = {(int64_t)T * H, 1, T};
            x->heads = H, x->x = buf[j][0], x->weight = w, x->out = buf[j][1];
            x->grad = buf[j][2], x->wprod = buf[j][3], x->rstd = buf[j][4];
            x->ms_pow = buf[j][5], x->wgrad = wgrad[j];
            memcpy(x->x_stride, st, sizeof st), memcpy(x->out_stride, st, sizeof st);
            memcpy(x->grad_stride, st, sizeof st), memcpy(x->wprod_stride, st, sizeof st);
            memcpy(x->rstd_stride, rst, sizeof rst), memcpy(x->ms_pow_stride, rst, sizeof rst);
        }
        if (pe_qk_norm_rope(&a) != PE_OK) return 1;
        double best = 1e9;
        for (int r = 0; r < reps; ++r) {
            const double t0 = now();
            if ((backward ? pe_qk_norm_rope_backward(&a) : pe_qk_norm_rope(&a)) != PE_OK)
                return 1;
            const double t1 = now();
            if (t1 - t0 < best) best = t1 - t0;
        }
        unsigned long long hash = 0;
        for (int j = 0; j < 2; ++j)
            for (size_t i = 0; i < n[j] * es; ++i)
                hash = hash * 31 + ((unsigned char *)buf[j][1])[i];
        for (int j = 0; backward && j < 2; ++j) /* and the weight gradients */
            for (size_t i = 0; i < D * es; ++i) hash = hash * 31 + ((unsigned char *)wgrad[j])[i];
        printf("%s %s %s: %.2f ns/row (best of %d), output hash %016llx\n",
               bf16 ? "bf16" : "fp32", backward ? "backward" : "forward",
               pe_isa_name(pe_isa_current()), best * 1e9 / (T * (HQ + HK)), reps, hash);
        for (int j = 0; j < 2; ++j)
            for (int i = 0; i < 6; ++i) free(buf[j][i]);
        free(wgrad[0]), free(wgrad[1]);
        free(c), free(s), free(w);
    }
    return 0;
}

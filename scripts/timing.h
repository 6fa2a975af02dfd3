/*
 * What the torch-free kernel timers of scripts/ (qk_norm_rows.c, rope_op.c) share: a
 * monotonic clock, deterministic input values and rotary tables.
 */
#ifndef POSENC_SCRIPTS_TIMING_H
#define POSENC_SCRIPTS_TIMING_H

#include <math.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* n values (i mul mod 2001 - 1000) / 300 + offset: in [-3.3, 3.3] + offset, no denormals
 * (offset 0 gives zeros too), as fp32 or as the bf16 high halves */
static void fill(void *p, size_t n, int bf16, unsigned mul, float offset) {
    for (size_t i = 0; i < n; ++i) {
        const float f = (float)((int)(i * mul % 2001) - 1000) / 300.f + offset;
        if (!bf16) {
            ((float *)p)[i] = f;
            continue;
        }
        unsigned u;
        memcpy(&u, &f, 4);
        ((unsigned short *)p)[i] = (unsigned short)(u >> 16);
    }
}

/* Rotary tables of `rows` positions from `first` on, rows of n: cos and sin of position
 * times base^(-i / (n/2)) for the i-th channel of either half (base 10^6, Qwen2-VL's and
 * Qwen3-VL's), as fp32 or as the bf16 high halves. */
static void fill_tables(void *c, void *s, size_t rows, int n, int bf16, int first) {
    for (size_t t = 0; t < rows; ++t)
        for (int j = 0; j < n; ++j) {
            const double f = pow(1e6, -(double)(j % (n / 2)) / (n / 2));
            const double a = (double)(first + (int)t) * f;
            const float v[2] = {(float)cos(a), (float)sin(a)};
            for (int k = 0; k < 2; ++k) {
                void *p = k ? s : c;
                if (!bf16) {
                    ((float *)p)[t * n + j] = v[k];
                    continue;
                }
                unsigned u;
                memcpy(&u, &v[k], 4);
                ((unsigned short *)p)[t * n + j] = (unsigned short)(u >> 16);
            }
        }
}

#endif /* POSENC_SCRIPTS_TIMING_H */

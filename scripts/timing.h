/*
 * What the torch-free kernel timers of scripts/ (qk_norm_rows.c, rope_op.c) share: a
 * monotonic clock and deterministic input values.
 */
#ifndef POSENC_SCRIPTS_TIMING_H
#define POSENC_SCRIPTS_TIMING_H

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

#endif /* POSENC_SCRIPTS_TIMING_H */

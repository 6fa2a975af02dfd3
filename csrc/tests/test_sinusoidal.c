/*
 * Torch-free tests of pe_sinusoidal against the formula in posenc.h (fp64 libm), the
 * worked example d = 4, pos = 1, odd dims, every dtype, threads and bad arguments.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "posenc.h"
#include "check.h"


static double reference(int64_t p, int64_t j, int64_t dim, double base) {
    const double angle = (double)p / pow(base, (double)(2 * (j / 2)) / (double)dim);
    return (j & 1) ? cos(angle) : sin(angle);
}

static double get(const void *t, pe_dtype dt, int64_t i) {
    switch (dt) {
    case PE_FLOAT32: return ((const float *)t)[i];
    case PE_FLOAT64: return ((const double *)t)[i];
    case PE_BFLOAT16: return pe_bf16_to_f32(((const uint16_t *)t)[i]);
    case PE_FLOAT16: return pe_f16_to_f32(((const uint16_t *)t)[i]);
    }
    return NAN;
}

/* Every element equals the reference rounded as specified: fp64 exactly, fp32 once, 16-bit
 * from the fp32 value. */
static void table_case(int64_t n, int64_t dim, double base, pe_dtype dt, int nthreads) {
    void *out = malloc((size_t)(n * dim) * pe_dtype_size(dt) + 1);
    CHECK(pe_sinusoidal(n, dim, base, dt, out, nthreads) == PE_OK, "n=%ld dim=%ld", (long)n,
          (long)dim);
    int64_t bad = 0;
    for (int64_t p = 0; p < n; ++p)
        for (int64_t j = 0; j < dim; ++j) {
            const double r = reference(p, j, dim, base);
            double want = (float)r;
            if (dt == PE_FLOAT64) want = r;
            if (dt == PE_BFLOAT16) want = pe_bf16_to_f32(pe_f32_to_bf16((float)r));
            if (dt == PE_FLOAT16) want = pe_f16_to_f32(pe_f32_to_f16((float)r));
            bad += get(out, dt, p * dim + j) != want;
        }
    CHECK(bad == 0, "n=%ld dim=%ld base=%g dtype=%d threads=%d: %ld elements differ", (long)n,
          (long)dim, base, dt, nthreads, (long)bad);
    free(out);
}

static void worked_example(void) {
    /* d = 4, pos = 1: [sin 1, cos 1, sin 0.01, cos 0.01] */
    double t[2 * 4];
    CHECK(pe_sinusoidal(2, 4, 10000.0, PE_FLOAT64, t, 1) == PE_OK, "example");
    const double want[4] = {0.8414709848078965, 0.5403023058681398, 0.009999833334166664,
                            0.9999500004166653};
    for (int j = 0; j < 4; ++j) {
        CHECK(fabs(t[4 + j] - want[j]) < 1e-15, "example column %d: %.17g", j, t[4 + j]);
        CHECK(t[j] == (j & 1 ? 1.0 : 0.0), "position 0 column %d: %g", j, t[j]);
    }
}

static void odd_dim(void) {
    /* dim 5: columns sin, cos, sin, cos, sin; the last uses exponent 4/5 */
    float t[3 * 5];
    CHECK(pe_sinusoidal(3, 5, 10000.0, PE_FLOAT32, t, 1) == PE_OK, "odd dim");
    CHECK(t[2 * 5 + 4] == (float)sin(2.0 / pow(10000.0, 4.0 / 5.0)), "odd dim last column");
    float one[4];
    CHECK(pe_sinusoidal(4, 1, 10000.0, PE_FLOAT32, one, 1) == PE_OK, "dim 1");
    CHECK(one[3] == (float)sin(3.0), "dim 1 is sin(p)");
}

static void bad_args(void) {
    float t[4];
    CHECK(pe_sinusoidal(-1, 4, 10000.0, PE_FLOAT32, t, 1) == PE_ERR_ARG, "negative positions");
    CHECK(pe_sinusoidal(1, 0, 10000.0, PE_FLOAT32, t, 1) == PE_ERR_ARG, "dim 0");
    CHECK(pe_sinusoidal(1, 4, 0.0, PE_FLOAT32, t, 1) == PE_ERR_ARG, "base 0");
    CHECK(pe_sinusoidal(1, 4, -2.0, PE_FLOAT32, t, 1) == PE_ERR_ARG, "negative base");
    CHECK(pe_sinusoidal(1, 4, NAN, PE_FLOAT32, t, 1) == PE_ERR_ARG, "NaN base");
    CHECK(pe_sinusoidal(1, 4, INFINITY, PE_FLOAT32, t, 1) == PE_ERR_ARG, "infinite base");
    CHECK(pe_sinusoidal(1, 4, 10000.0, (pe_dtype)9, t, 1) == PE_ERR_ARG, "bad dtype");
    CHECK(pe_sinusoidal(1, 4, 10000.0, PE_FLOAT32, NULL, 1) == PE_ERR_ARG, "NULL out");
    CHECK(pe_sinusoidal(INT64_MAX / 2, 4, 10000.0, PE_FLOAT32, t, 1) == PE_ERR_ARG, "overflow");
    CHECK(pe_sinusoidal(0, 4, 10000.0, PE_FLOAT32, NULL, 1) == PE_OK, "empty table");
}

int main(void) {
    const pe_dtype dts[4] = {PE_FLOAT32, PE_FLOAT64, PE_BFLOAT16, PE_FLOAT16};
    for (int d = 0; d < 4; ++d) {
        table_case(50, 16, 10000.0, dts[d], 1);
        table_case(7, 9, 500.0, dts[d], 2);
    }
    table_case(600, 128, 10000.0, PE_FLOAT32, 2); /* threaded */
    table_case(300, 77, 1e6, PE_FLOAT32, 2);
    worked_example();
    odd_dim();
    bad_args();
    return check_report("test_sinusoidal");
}

/*
 * Sinusoidal absolute position encoding (see posenc.h).  Scalar fp64 libm arithmetic: the
 * table is built once per model, and matching transformers' fp64 recipe matters more than
 * speed here.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

/* Store one fp64 value as dt: through fp32 for every dtype but fp64 (see posenc.h). */
static void store_value(void *row, int64_t j, pe_dtype dt, double v) {
    const float f = (float)v;
    switch (dt) {
    case PE_FLOAT32: ((float *)row)[j] = f; break;
    case PE_FLOAT64: ((double *)row)[j] = v; break;
    case PE_BFLOAT16: ((uint16_t *)row)[j] = pe_f32_to_bf16(f); break;
    case PE_FLOAT16: ((uint16_t *)row)[j] = pe_f32_to_f16(f); break;
    }
}

int pe_sinusoidal(int64_t num_positions, int64_t dim, double base, pe_dtype out_dtype,
                  void *out, int nthreads) {
    if (num_positions < 0 || dim < 1 || !pe_dtype_valid(out_dtype)) return PE_ERR_ARG;
    if (!(base > 0.0) || !isfinite(base)) return PE_ERR_ARG;
    if (num_positions > INT64_MAX / dim) return PE_ERR_ARG;
    if (num_positions == 0) return PE_OK;
    if (!out) return PE_ERR_ARG;

    /* denominator of each column pair: base^(2i / dim), i = j / 2 */
    const int64_t npair = (dim + 1) / 2;
    double *denom = (double *)malloc((size_t)npair * sizeof(double));
    if (!denom) return PE_ERR_NOMEM;
    for (int64_t i = 0; i < npair; ++i) denom[i] = pow(base, (double)(2 * i) / (double)dim);

    const size_t es = pe_dtype_size(out_dtype);
    const int nt = (nthreads > 1 && num_positions * dim >= PE_SERIAL_ELEMENTS) ? nthreads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t p = 0; p < num_positions; ++p) {
        void *row = (char *)out + p * dim * (int64_t)es;
        for (int64_t j = 0; j < dim; ++j) {
            const double angle = (double)p / denom[j / 2];
            store_value(row, j, out_dtype, (j & 1) ? cos(angle) : sin(angle));
        }
    }
    free(denom);
    return PE_OK;
}

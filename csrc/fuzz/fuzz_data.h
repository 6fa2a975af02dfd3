/* Tensor data of the harnesses that fill and read tensors of every dtype (fuzz_rope.c,
 * fuzz_qk_norm.c): element i of a buffer as a double, and the values they are filled with. */
#ifndef POSENC_FUZZ_DATA_H
#define POSENC_FUZZ_DATA_H

#include <math.h>

#include "fuzz_util.h"
#include "posenc.h"
#include "rope_math.h"

static const pe_dtype dtypes[4] = {PE_FLOAT32, PE_FLOAT64, PE_BFLOAT16, PE_FLOAT16};

static inline size_t dsize(pe_dtype t) { return t == PE_FLOAT64 ? 8 : t == PE_FLOAT32 ? 4 : 2; }

/* p[i] = v, rounded to dt once */
static inline void put(void *p, pe_dtype dt, int64_t i, double v) {
    switch (dt) {
    case PE_FLOAT32: ((float *)p)[i] = (float)v; break;
    case PE_FLOAT64: ((double *)p)[i] = v; break;
    case PE_BFLOAT16: ((uint16_t *)p)[i] = pe_f64_to_bf16(v); break;
    case PE_FLOAT16: ((uint16_t *)p)[i] = pe_f64_to_f16(v); break;
    }
}

static inline double get(const void *p, pe_dtype dt, int64_t i) {
    switch (dt) {
    case PE_FLOAT32: return ((const float *)p)[i];
    case PE_FLOAT64: return ((const double *)p)[i];
    case PE_BFLOAT16: return pe_bf16_to_f32(((const uint16_t *)p)[i]);
    case PE_FLOAT16: return pe_f16_to_f32(((const uint16_t *)p)[i]);
    }
    return 0;
}

/* Mostly values in [-2, 2]; now and then a special one. */
static inline double value(uint64_t *s) {
    const uint64_t r = fuzz_next(s);
    switch (r % 61) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return -1e30;
    case 3: return 7e4; /* past fp16's range */
    case 4: return 1e-40; /* fp32 subnormal */
    case 5: return -0.0;
    default: return ((double)(r >> 11) / 9007199254740992.0) * 4.0 - 2.0;
    }
}

#endif

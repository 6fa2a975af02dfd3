/* The math sweep compiled as C by the CPU kernels' compiler (see math_sweep.h). */
#include "math_sweep.h"

uint64_t pe_math_sweep_c(uint32_t i) {
    return pe_math_sweep(i);
}

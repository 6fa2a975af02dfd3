// posenc::sinusoidal: the sinusoidal absolute position table (posenc.h, pe_sinusoidal).
// The op has no tensor inputs, so no backend key selects a kernel: it is registered under
// CompositeExplicitAutograd, which also serves calls without a key, and it allocates on
// the CPU.
#include <cmath>

#include "shim.h"

namespace posenc {

Tensor sinusoidal_impl(int64_t num_positions, int64_t dim, double base, ScalarType dtype) {
    PE_CHECK_VALUE(num_positions >= 0, "num_positions must be >= 0, got ", num_positions);
    PE_CHECK_VALUE(dim >= 1, "dim must be >= 1, got ", dim);
    PE_CHECK_VALUE(num_positions <= INT64_MAX / dim, "num_positions * dim overflows: ",
                   num_positions, " * ", dim);
    PE_CHECK_VALUE(std::isfinite(base) && base > 0.0, "base must be finite and > 0, got ", base);
    const pe_dtype odt = to_pe_dtype(dtype, "dtype");
    const std::array<int64_t, 2> sizes{num_positions, dim};
    const std::array<int64_t, 2> strides{dim, 1};
    Tensor out = empty_strided(sizes, strides, dtype_code(dtype), aoti_torch_device_type_cpu(), 0,
                               "the (num_positions, dim) table");
    const int rc =
        pe_sinusoidal(num_positions, dim, base, odt, out.mutable_data_ptr(), num_threads());
    check_status(rc, "posenc::sinusoidal");
    return out;
}

}  // namespace posenc

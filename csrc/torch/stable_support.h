// What the posenc shim needs from torch, on top of the LibTorch stable ABI only: checks
// that raise with a plain message, dtype and layout rules that the stable surface does
// not offer (result_type, empty_like's layout), and output allocation.  Everything here
// is header-only C++ over torch/csrc/stable and torch/headeronly, so the binary depends on
// nothing but the stable C shim of libtorch (TORCH_TARGET_VERSION, set by the build).
#pragma once

#ifndef TORCH_TARGET_VERSION
#error "build with -DTORCH_TARGET_VERSION=<the oldest torch to support> (see meson.build)"
#endif

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/shim_utils.h>

// torch 2.13 added STABLE_TORCH_ERROR_CODE_CHECK, which for a 2.11 target is
// TORCH_ERROR_CODE_CHECK; torch 2.11 and 2.12 have only the latter.
#ifndef STABLE_TORCH_ERROR_CODE_CHECK
#define STABLE_TORCH_ERROR_CODE_CHECK(call) TORCH_ERROR_CODE_CHECK(call)
#endif

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "posenc.h"

namespace posenc {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;
using IntList = torch::headeronly::IntHeaderOnlyArrayRef;

// ---- Errors.  Every check belongs to one class of the error policy (README, "Errors"):
//   PE_CHECK_TYPE   a wrong dtype                          message "TypeError: ..."
//   PE_CHECK_VALUE  a wrong shape, size, section or value  message "ValueError: ..."
//   PE_CHECK        allocation, threads, device failures   message without a tag
// The tag at the start of the message is how the shim states the class: the exception type
// that reaches Python is torch's to choose (std::invalid_argument, thrown for both tagged
// kinds, was a ValueError up to torch 2.14; torch 2.15 delivers every shim failure as a
// RuntimeError, std::runtime_error always was one).  The public Python functions raise the
// class the tag names (posenc_torch/_checks.py, op_error) without checking anything again.

inline constexpr const char* kTypeErrorTag = "TypeError: ";
inline constexpr const char* kValueErrorTag = "ValueError: ";

template <class... Args>
std::string cat(const Args&... args) {
    std::ostringstream s;
    (s << ... << args);
    return s.str();
}

template <class... Args>
[[noreturn]] __attribute__((cold, noinline)) void fail(const Args&... args) {
    throw std::runtime_error(cat(args...));
}

template <class... Args>
[[noreturn]] __attribute__((cold, noinline)) void fail_value(const Args&... args) {
    throw std::invalid_argument(cat(kValueErrorTag, args...));
}

template <class... Args>
[[noreturn]] __attribute__((cold, noinline)) void fail_type(const Args&... args) {
    throw std::invalid_argument(cat(kTypeErrorTag, args...));
}

// The message of a value failure (fail_value) without its tag, for a check that catches
// one to say where it happened and throws it again with fail_value.
inline std::string value_message(const std::invalid_argument& e) {
    const std::string message = e.what();
    const std::string tag = kValueErrorTag;
    return message.compare(0, tag.size(), tag) == 0 ? message.substr(tag.size()) : message;
}

// The message arguments are evaluated only when the check fails.
#define PE_CHECK(cond, ...)                                                    \
    do {                                                                       \
        if (__builtin_expect(!(cond), 0)) ::posenc::fail(__VA_ARGS__);         \
    } while (0)
#define PE_CHECK_VALUE(cond, ...)                                              \
    do {                                                                       \
        if (__builtin_expect(!(cond), 0)) ::posenc::fail_value(__VA_ARGS__);   \
    } while (0)
#define PE_CHECK_TYPE(cond, ...)                                               \
    do {                                                                       \
        if (__builtin_expect(!(cond), 0)) ::posenc::fail_type(__VA_ARGS__);    \
    } while (0)

// ---- Printing, as torch prints these in its own messages: [2, 3, 4], Float, cpu, cuda:0.

struct Shape {
    IntList v;
};
inline std::ostream& operator<<(std::ostream& s, Shape x) {
    s << '[';
    for (size_t i = 0; i < x.v.size(); ++i) s << (i ? ", " : "") << x.v[i];
    return s << ']';
}
inline Shape shape(const Tensor& t) { return {t.sizes()}; }

struct DeviceName {
    const Tensor& t;
};
inline std::ostream& operator<<(std::ostream& s, DeviceName d) {
    using torch::headeronly::DeviceType;
    const torch::stable::Device dev = d.t.device();
    switch (dev.type()) {
    case DeviceType::CPU: s << "cpu"; break;
    case DeviceType::CUDA: s << "cuda"; break;
    case DeviceType::HIP: s << "hip"; break;
    case DeviceType::XPU: s << "xpu"; break;
    case DeviceType::MPS: s << "mps"; break;
    case DeviceType::Meta: s << "meta"; break;
    case DeviceType::PrivateUse1: s << "privateuseone"; break;
    default: s << "device type " << static_cast<int>(dev.type()); break;
    }
    if (dev.has_index()) s << ':' << static_cast<int>(dev.index());
    return s;
}

// ---- Dtypes.  The C shim names dtypes by int32 codes that only libtorch knows, and
// Tensor::scalar_type() finds the ScalarType of a code by a chain of calls into libtorch.
// The ops compare codes instead, read once per process; ScalarType serves messages and
// the dtype arguments of the schemas.

struct DtypeCodes {
    int32_t f32, f64, bf16, f16, i64, i32;
};

inline const DtypeCodes& dtype_codes() {
    static const DtypeCodes c{aoti_torch_dtype_float32(), aoti_torch_dtype_float64(),
                              aoti_torch_dtype_bfloat16(), aoti_torch_dtype_float16(),
                              aoti_torch_dtype_int64(),   aoti_torch_dtype_int32()};
    return c;
}

inline int32_t dtype_code(ScalarType s) {
    return torch::stable::detail::to<int32_t>(torch::stable::detail::from(s));
}

inline ScalarType scalar_type(int32_t code) {
    return torch::stable::detail::to<ScalarType>(torch::stable::detail::from(code));
}

inline bool is_floating(ScalarType s) {
    switch (s) {
    case ScalarType::Half: case ScalarType::Float: case ScalarType::Double:
    case ScalarType::BFloat16: case ScalarType::Float8_e5m2: case ScalarType::Float8_e4m3fn:
    case ScalarType::Float8_e5m2fnuz: case ScalarType::Float8_e4m3fnuz:
    case ScalarType::Float8_e8m0fnu:
        return true;
    default: return false;
    }
}

inline bool is_integral(ScalarType s) {  // bool excluded
    switch (s) {
    case ScalarType::Byte: case ScalarType::Char: case ScalarType::Short: case ScalarType::Int:
    case ScalarType::Long: case ScalarType::UInt16: case ScalarType::UInt32:
    case ScalarType::UInt64:
        return true;
    default: return false;
    }
}

inline bool is_complex(ScalarType s) {
    return s == ScalarType::ComplexHalf || s == ScalarType::ComplexFloat ||
           s == ScalarType::ComplexDouble;
}

[[noreturn]] inline void fail_dtype(const char* name, ScalarType s) {
    fail_type(name, " must be float32, float64, bfloat16 or float16, got ", s);
}

inline pe_dtype to_pe_dtype(int32_t code, const char* name) {
    const DtypeCodes& c = dtype_codes();
    if (code == c.f32) return PE_FLOAT32;
    if (code == c.bf16) return PE_BFLOAT16;
    if (code == c.f16) return PE_FLOAT16;
    if (code == c.f64) return PE_FLOAT64;
    fail_dtype(name, scalar_type(code));
}

inline pe_dtype to_pe_dtype(ScalarType s, const char* name) {
    switch (s) {
    case ScalarType::Float: return PE_FLOAT32;
    case ScalarType::Double: return PE_FLOAT64;
    case ScalarType::BFloat16: return PE_BFLOAT16;
    case ScalarType::Half: return PE_FLOAT16;
    default: fail_dtype(name, s);
    }
}

// torch.result_type of two tensors of dimension >= 1 whose dtypes are kernel dtypes
// (to_pe_dtype accepted both): the wider one, and float32 for bfloat16 with float16.
inline int32_t result_type(int32_t a, int32_t b) {
    const DtypeCodes& c = dtype_codes();
    if (a == b) return a;
    if (a == c.f64 || b == c.f64) return c.f64;
    return c.f32;
}

// ---- Tensor metadata, read with one call per field (every Tensor accessor is a call
// into libtorch; the rotation ops run once per decode step and read each tensor once).
struct Meta {
    IntList sizes, strides;
    int32_t dtype;  // C shim code
    int32_t device_type, device_index;

    explicit Meta(const Tensor& t) {
        AtenTensorHandle h = t.get();
        int64_t *sz = nullptr, *st = nullptr, dim = 0;
        STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(h, &dim));
        STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(h, &sz));
        STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(h, &st));
        STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(h, &dtype));
        STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(h, &device_type));
        STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(h, &device_index));
        sizes = IntList(sz, static_cast<size_t>(dim));
        strides = IntList(st, static_cast<size_t>(dim));
    }
    int64_t dim() const { return static_cast<int64_t>(sizes.size()); }
    int64_t size(int64_t d) const { return sizes[static_cast<size_t>(d < 0 ? d + dim() : d)]; }
    int64_t stride(int64_t d) const {
        return strides[static_cast<size_t>(d < 0 ? d + dim() : d)];
    }
    bool is_cpu() const {
        static const int32_t cpu = aoti_torch_device_type_cpu();
        return device_type == cpu;
    }
    // Unit stride in the channel (last) dimension: what the kernels read and write.
    bool channel_dense() const { return size(-1) <= 1 || stride(-1) == 1; }
};

// ---- Threads: torch's intra-op count, one inside a parallel region (torch's OpenMP pool
// is the runtime the kernels use too).
inline int num_threads() {
    return omp_in_parallel() ? 1 : static_cast<int>(torch::stable::get_num_threads());
}

// ---- Layout and allocation.

inline bool same(IntList a, IntList b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

// The kernels need unit stride in the channel dimension; anything else is copied once.
inline Tensor channel_contiguous(const Tensor& t, const Meta& m) {
    return m.channel_dense() ? t : torch::stable::contiguous(t);
}

inline Tensor converted(const Tensor& t, ScalarType dtype) {
    return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}

// c10's is_non_overlapping_and_dense: some permutation of the dims is contiguous.
inline bool non_overlapping_and_dense(IntList sizes, IntList strides) {
    const size_t n = sizes.size();
    if (n == 1) return sizes[0] < 2 || strides[0] == 1;
    std::array<size_t, 16> perm{};
    if (n > perm.size()) return false;  // not decided here: the caller asks torch
    for (size_t i = 0; i < n; ++i) perm[i] = i;
    std::sort(perm.begin(), perm.begin() + n, [&](size_t a, size_t b) {
        if (sizes[a] < 2) return false;
        if (sizes[b] < 2) return true;
        return strides[a] < strides[b];
    });
    int64_t want = 1;
    for (size_t i = 0; i < n; ++i) {
        if (sizes[perm[i]] < 2) return true;
        if (strides[perm[i]] != want) return false;
        want *= sizes[perm[i]];
    }
    return true;
}

// A new tensor; `what` names it in the RuntimeError of a failed allocation (the C shim's
// own message names its source line, not the argument that asked for the size).
inline Tensor empty_strided(IntList sizes, IntList strides, int32_t dtype, int32_t device_type,
                            int32_t device_index, const char* what = "an output") {
    AtenTensorHandle h = nullptr;
    if (aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(),
                                 strides.data(), dtype, device_type, device_index,
                                 &h) != AOTI_TORCH_SUCCESS) {
        int64_t elements = 1;
        bool overflow = false;
        for (int64_t n : sizes) overflow |= __builtin_mul_overflow(elements, n, &elements);
        if (overflow) fail("could not allocate ", what, " of shape ", Shape{sizes});
        fail("could not allocate ", what, " of shape ", Shape{sizes}, " (", elements,
             " elements)");
    }
    return Tensor(h);
}

// Dense row-major tensor in dtype (a C shim code) on the device of `on`.
inline Tensor empty(IntList sizes, int32_t dtype, const Meta& on,
                    const char* what = "an output") {
    std::array<int64_t, 8> strides{};
    PE_CHECK(sizes.size() <= strides.size(), "posenc: too many dimensions");
    int64_t s = 1;
    for (size_t i = sizes.size(); i-- > 0;) {
        strides[i] = s;
        s *= std::max<int64_t>(sizes[i], 1);
    }
    return empty_strided(sizes, IntList(strides.data(), sizes.size()), dtype, on.device_type,
                         on.device_index, what);
}

inline Tensor empty(IntList sizes, ScalarType dtype, const Tensor& on,
                    const char* what = "an output") {
    return empty(sizes, dtype_code(dtype), Meta(on), what);
}

// A new tensor and its metadata.
struct Output {
    Tensor t;
    Meta m;
};

// empty_like(x) in dtype, asked from torch (for inputs that are not non-overlapping and
// dense, where torch's choice of layout is not reproduced here).
inline Tensor torch_empty_like(const Tensor& x, int32_t dtype) {
    std::array<StableIValue, 6> stack{
        torch::stable::detail::from(x),
        torch::stable::detail::from(std::optional<ScalarType>(scalar_type(dtype))),
        torch::stable::detail::from(std::nullopt),
        torch::stable::detail::from(std::nullopt),
        torch::stable::detail::from(std::nullopt),
        torch::stable::detail::from(std::nullopt)};
    STABLE_TORCH_ERROR_CODE_CHECK(
        torch_call_dispatcher("aten::empty_like", "", stack.data(), TORCH_ABI_VERSION));
    return torch::stable::detail::to<Tensor>(stack[0]);
}

// Output of x's shape in dtype, laid out as empty_like(x) lays it out (x's own strides
// when x is non-overlapping and dense) when that gives the unit channel stride the kernels
// write with, else contiguous.  The fake kernels (posenc_torch/ops.py, _output_like)
// follow the same rule.
inline Output output_like(const Tensor& x, const Meta& m, int32_t dtype) {
    if (non_overlapping_and_dense(m.sizes, m.strides)) {
        if (m.channel_dense()) {
            Meta om = m;  // same sizes and strides as x (which outlives the op call)
            om.dtype = dtype;
            return {empty_strided(m.sizes, m.strides, dtype, m.device_type, m.device_index), om};
        }
    } else {
        Tensor out = torch_empty_like(x, dtype);
        Meta om(out);
        if (om.channel_dense()) return {out, om};
    }
    Tensor out = empty(m.sizes, dtype, m);
    return {out, Meta(out)};
}

// Output of the backward (transpose) pass: contiguous in x's shape, the layout in which
// autograd of transformers' expressions returns the gradients of q and k whatever the
// incoming gradient's layout, so that what consumes them (a per-head norm's weight
// gradient, say) sums in the same order.  The kernels write it directly: no copy after.
inline Output contiguous_output(const Meta& m, int32_t dtype) {
    Tensor out = empty(m.sizes, dtype, m);
    return {out, Meta(out)};
}

}  // namespace posenc

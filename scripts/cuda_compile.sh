#!/usr/bin/env bash
# Compile every CUDA source (csrc/cuda/*.cu) with this machine's nvcc for each GPU
# architecture, warnings and register spills as errors, so the GPU code keeps compiling on
# machines without a GPU (CI).  Then check the kernels' machine code (registers, stores,
# spills, no fused or fast math: scripts/cuda_sass_check.py) and run the kernels' code on
# the host against the CPU kernels (csrc/cuda/tests/test_emulated.cu, linked with the C
# kernels of builddir-c).  Without nvcc it says so loudly and exits 0.
#   GPU_ARCHS="80 90" (default)   NVCC=/path/to/nvcc (default: nvcc on PATH)
#   PYTHON=python3 (runs the machine-code check)
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${NVCC:-$(command -v nvcc || true)}
if [[ -z "$nvcc" ]]; then
    echo "************************************************************************" >&2
    echo "*** cuda-compile SKIPPED: nvcc not found; csrc/cuda was NOT compiled ***" >&2
    echo "************************************************************************" >&2
    exit 0
fi
meson=${MESON:-meson}
archs=${GPU_ARCHS:-80 90}
out=builddir-cuda
mkdir -p "$out"
flags=(-std=c++17 -O3 --fmad=false -Icsrc -Xcompiler -Wall,-Wextra,-Werror,-ffp-contract=off
       -Werror all-warnings -Xptxas -warn-spills)
echo "cuda-compile: $("$nvcc" --version | tail -n 2 | head -n 1)"
for src in csrc/cuda/*.cu csrc/cuda/tests/math_device.cu; do
    for arch in $archs; do
        obj="$out/$(basename "$src" .cu).sm_$arch.o"
        # with the PTX too: it carries the launch bounds the machine-code check reads
        "$nvcc" "${flags[@]}" -gencode "arch=compute_$arch,code=[sm_$arch,compute_$arch]" \
            -c "$src" -o "$obj"
        echo "  $src -> sm_$arch ok"
    done
done
objs=()
for arch in $archs; do objs+=("$out/rope.sm_$arch.o"); done
"${PYTHON:-python3}" scripts/cuda_sass_check.py "${objs[@]}"

# The kernels' per-thread code on the host, bit for bit against the CPU kernels.
[[ -f builddir-c/build.ninja ]] || "$meson" setup builddir-c -Dpython_extension=false >/dev/null
"$meson" compile -C builddir-c posenc_kernels >/dev/null 2>&1 ||
    "$meson" compile -C builddir-c posenc_kernels # again, to show why it failed
"$nvcc" "${flags[@]}" -Icsrc/cuda -gencode "arch=compute_${archs##* },code=sm_${archs##* }" \
    -c csrc/cuda/tests/test_emulated.cu -o "$out/test_emulated.o"
"${CC:-cc}" -std=c17 -O2 -ffp-contract=off -Wall -Wextra -Werror -Icsrc -c \
    csrc/cuda/tests/math_sweep_c.c -o "$out/math_sweep_c.o"
"${CXX:-c++}" "$out/test_emulated.o" "$out/math_sweep_c.o" builddir-c/libposenc_kernels.a \
    -fopenmp -lm -L"$(python3 scripts/cuda_libdir.py "$nvcc")" \
    "$(python3 scripts/cuda_libdir.py --link "$nvcc")" -o "$out/test_emulated"
"$out/test_emulated"

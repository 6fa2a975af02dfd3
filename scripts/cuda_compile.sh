#!/usr/bin/env bash
# Compile every CUDA source (csrc/cuda/*.cu) with this machine's nvcc for each GPU
# architecture, warnings and register spills as errors, so the GPU code keeps compiling on
# machines without a GPU (CI).  Then check the kernels' machine code (registers, load and
# store widths, spills, no fused or fast math, memory trips, instruction counts and budgets,
# and the H200 estimate:
# scripts/cuda_sass_check.py, whose rules are first shown to fire on a deliberately bad
# kernel, csrc/cuda/tests/sass_bad.cu) and run the kernels' code on the host against the CPU
# kernels (csrc/cuda/tests/test_emulated.cu, linked with the C kernels of KERNELS_BUILD; it
# also compares the conversions over all 2^32 fp32 patterns).  Without nvcc it says so loudly
# and exits 0.
#   GPU_ARCHS="80 90" (default)   NVCC=/path/to/nvcc (default: nvcc on PATH)
#   KERNELS_BUILD=dir: a meson build of this tree (default: builddir-c, a torch-free one set
#   up when missing; make passes the wheel's, build)
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
py=${PYTHON:-python3}
archs=${GPU_ARCHS:-80 90}
out=builddir-cuda
mkdir -p "$out"
# shellcheck disable=SC2054 # -Xcompiler takes one comma-separated argument
flags=(-std=c++17 -O3 --fmad=false -Icsrc -Xcompiler -Wall,-Wextra,-Werror,-ffp-contract=off
       -Werror all-warnings -Xptxas -warn-spills)
echo "cuda-compile: $("$nvcc" --version | tail -n 2 | head -n 1)"
pids=()
for src in csrc/cuda/*.cu csrc/cuda/tests/math_device.cu; do
    for arch in $archs; do
        obj="$out/$(basename "$src" .cu).sm_$arch.o"
        # with the PTX too: it carries the launch bounds the machine-code check reads
        "$nvcc" "${flags[@]}" -gencode "arch=compute_$arch,code=[sm_$arch,compute_$arch]" \
            -c "$src" -o "$obj" && echo "  $src -> sm_$arch ok" &
        pids+=($!)
    done
done
for pid in "${pids[@]}"; do wait "$pid"; done

# The checker's rules fire on a kernel that breaks each of them.
last=${archs##* }
"$nvcc" -std=c++17 -O3 -Icsrc -gencode "arch=compute_$last,code=[sm_$last,compute_$last]" \
    -c csrc/cuda/tests/sass_bad.cu -o "$out/sass_bad.sm_$last.o"
if "$py" scripts/cuda_sass_check.py "$out/sass_bad.sm_$last.o" >"$out/sass_bad.log" 2>&1; then
    cat "$out/sass_bad.log"
    echo "cuda-compile: the machine-code check passed a kernel that breaks its rules" >&2
    exit 1
fi
for rule in "local memory" "stores narrower than 128" "q/k loads narrower than 128" \
    "table loads narrower than 128" "fused multiply-add" "dependent memory trip" \
    "instruction budget"; do
    grep -q "FAIL $rule" "$out/sass_bad.log" ||
        { cat "$out/sass_bad.log"; echo "cuda-compile: rule not applied: $rule" >&2; exit 1; }
done
echo "  the machine-code check finds every planted problem (csrc/cuda/tests/sass_bad.cu)"

objs=()
for arch in $archs; do objs+=("$out/rope.sm_$arch.o"); done
"$py" scripts/cuda_sass_check.py --json "$out/sass.json" "${objs[@]}"
# tests/cuda_variants.py (what the GPU tests and the sanitizer run) names every kernel there is
"$py" - "$out/sass.json" <<'EOF'
import json, sys
sys.path.insert(0, "tests")
import cuda_variants
built = {cuda_variants.normalize(k["name"]) for ks in json.load(open(sys.argv[1])).values()
         for k in ks}
listed = {name for name, _, _ in cuda_variants.every_variant()}
if built != listed:
    sys.exit(f"tests/cuda_variants.py and the kernels disagree: built, not listed "
             f"{sorted(built - listed)}; listed, not built {sorted(listed - built)}")
print(f"  tests/cuda_variants.py lists the {len(built)} kernels built")
EOF

# The kernels' per-thread code on the host, bit for bit against the CPU kernels.
kernels=${KERNELS_BUILD:-builddir-c}
[[ -f "$kernels/build.ninja" ]] || "$meson" setup "$kernels" -Dpython_extension=false >/dev/null
"$meson" compile -C "$kernels" posenc_kernels >/dev/null 2>&1 ||
    "$meson" compile -C "$kernels" posenc_kernels # again, to show why it failed
"$nvcc" "${flags[@]}" -Xcompiler -fopenmp -Icsrc/cuda \
    -gencode "arch=compute_$last,code=sm_$last" \
    -c csrc/cuda/tests/test_emulated.cu -o "$out/test_emulated.o"
"${CC:-cc}" -std=c17 -O2 -ffp-contract=off -Wall -Wextra -Werror -Icsrc -c \
    csrc/cuda/tests/math_sweep_c.c -o "$out/math_sweep_c.o"
"${CXX:-c++}" "$out/test_emulated.o" "$out/math_sweep_c.o" "$kernels/libposenc_kernels.a" \
    -fopenmp -lm -L"$("$py" scripts/cuda_libdir.py "$nvcc")" \
    "$("$py" scripts/cuda_libdir.py --link "$nvcc")" -o "$out/test_emulated"
"$out/test_emulated"

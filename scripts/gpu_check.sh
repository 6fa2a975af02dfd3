#!/usr/bin/env bash
# The GPU check in one command, for a machine with an NVIDIA GPU, nvcc, and a Python with
# torch (a CUDA build), transformers, meson and ninja; no network and no meson-python needed.
#
#   scripts/gpu_check.sh [OUTDIR]        (or: make gpu-check)
#
# 1. records the machine (GPU, driver, nvcc, torch, transformers);
# 2. builds posenc_torch against this machine's torch with the CUDA kernels (plain meson
#    build in builddir-gpu, for this GPU's architecture) and stages the package with the
#    built _C next to it (nothing is installed);
# 3. runs csrc/cuda/tests/math_device.cu (rope_math.h on the GPU vs the host, bit for bit),
#    tests/test_cuda.py, and benchmarks/bench_cuda.py.
# Everything goes to OUTDIR (default: $OUT if set, else ./gpu-check-out): summary.txt,
# gpu_check.log, pytest-junit.xml, cuda-<suite>.json, cuda-<suite>.md, plots-cuda-<suite>.tar.gz.
# Without a CUDA device it still builds (steps 1-2), then stops with exit status 2.
# Exit status: 0 all passed, 1 a step failed, 2 no CUDA device.
#   PYTHON=python3  SUITE=quick|full|smoke  GPU_ARCHS="90" (default: this GPU's)
#   WHEELS=dir: extra wheels to put on the path first (default ./.whl when it has any)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$(mkdir -p "${1:-${OUT:-gpu-check-out}}" && cd "${1:-${OUT:-gpu-check-out}}" && pwd)
py=${PYTHON:-python3}
# a relative PYTHON path made absolute: some steps run from other directories
[[ $py == */* && $py != /* ]] && py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")
suite=${SUITE:-quick}
log="$out/gpu_check.log"
summary="$out/summary.txt"
: >"$log"
: >"$summary"
exec > >(tee -a "$log") 2>&1
failed=0

note() { echo "$*" | tee -a "$summary"; }
# step NAME COMMAND...: runs it, records ok / FAILED (exit status) in the summary
step() {
    local name=$1
    shift
    echo "==== $name: $*"
    if "$@"; then note "ok      $name"; else note "FAILED  $name (exit status $?)"; failed=1; fi
}

echo "==== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
command -v nvcc >/dev/null && nvcc --version | tail -n 2 | head -n 1 || echo "nvcc: not found"
"$py" - <<'EOF' || { note "FAILED  python: torch does not import"; exit 1; }
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "CUDA", torch.version.cuda)
try:
    import transformers
    print("transformers", transformers.__version__)
except ImportError as exc:
    print("transformers: not importable:", exc)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
EOF
has_gpu=$("$py" -c "import torch; print(int(torch.cuda.is_available()))")
# this GPU's compute capability (sm_90 when there is none: the build still runs)
archs=${GPU_ARCHS:-$("$py" -c "import torch
c = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
print(f'{c[0]}{c[1]}')")}
meson=("$py" -m mesonbuild.mesonmain)

# ---- build against this torch, CUDA kernels required, and stage the package
build() {
    rm -rf builddir-gpu
    "${meson[@]}" setup builddir-gpu -Dbuildtype=release -Dcuda=enabled \
        "-Dgpu_archs=$(echo "$archs" | tr ' ' ',')" &&
        "${meson[@]}" compile -C builddir-gpu
}
stage() {
    local pkg=builddir-gpu/stage/posenc_torch
    rm -rf builddir-gpu/stage && mkdir -p "$pkg" &&
        cp posenc_torch/*.py "$pkg/" &&
        cp builddir-gpu/_C*.so "$pkg/" &&
        (cd builddir-gpu && PYTHONPATH="$root/builddir-gpu/stage" "$py" -c "import posenc_torch as p
assert p._C.has_cuda(), 'built without CUDA kernels'
print('staged', p.__file__)")
}
# Optional extra packages as wheels (e.g. Liger-Kernel for the benchmark, on a machine
# without network): every *.whl in $WHEELS (default ./.whl) goes on the path, no deps.
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
    step "extra wheels from $wheels" "$py" -m pip install -q --no-index --no-deps --no-compile \
        --upgrade --target builddir-gpu-site "$wheels"/*.whl
    export PYTHONPATH="$root/builddir-gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
step "build (meson, cuda enabled, sm_$archs)" build
step "stage the package" stage
export PYTHONPATH="$root/builddir-gpu/stage${PYTHONPATH:+:$PYTHONPATH}"

if [[ "$has_gpu" != 1 ]]; then
    note "STOPPED no CUDA device: built and staged, but the GPU tests and benchmark need a GPU"
    exit 2
fi

# ---- on the GPU
math_device() {
    nvcc -std=c++17 -O2 -Icsrc -gencode "arch=compute_${archs%% *},code=sm_${archs%% *}" \
        csrc/cuda/tests/math_device.cu -o builddir-gpu/math_device && builddir-gpu/math_device
}
step "rope_math.h device vs host (math_device)" math_device
# from tests/ (as make pytest does), so the staged package is imported, not the sources
gpu_tests() {
    (cd tests && "$py" -m pytest -q -rs -p no:cacheprovider test_cuda.py \
        --junitxml="$out/pytest-junit.xml")
}
step "tests/test_cuda.py" gpu_tests
bench() {
    (cd benchmarks && "$py" bench_cuda.py --suite "$suite" --out "$out") >"$out/cuda-$suite.md" &&
        tar -czf "$out/plots-cuda-$suite.tar.gz" -C "$out" "plots-cuda-$suite" &&
        rm -rf "$out/plots-cuda-$suite" && cat "$out/cuda-$suite.md"
}
step "benchmarks/bench_cuda.py --suite $suite" bench

echo "==== summary ($out)"
cat "$summary"
exit $failed

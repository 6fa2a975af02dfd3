#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, nvcc, and a Python with torch (a CUDA
# build), transformers, meson and ninja; no network and no meson-python needed.  In phases,
# each short enough for one 10-minute call, that resume from what an earlier call left
# (the build in builddir-gpu, the results in OUTDIR):
#
#   scripts/gpu_check.sh PHASE [OUTDIR]      (or: make gpu-check PHASE=...)
#
#   preflight  nvcc, the CUDA runtime library (a toolkit's libcudart.so or pip's
#              libcudart.so.N), Python.h, torch and its CUDA version, the GPU; fails with
#              the reason when something the build needs is missing
#   build      builds posenc_torch against this torch with the CUDA kernels (plain meson
#              build in builddir-gpu, for this GPU's architecture) and stages the package
#              with the built _C next to it (nothing is installed)
#   math       csrc/cuda/tests/math_device.cu: rope_math.h on the GPU vs the host, bit for bit
#   tests      tests/test_cuda.py
#   sanitize   tests/test_cuda.py under compute-sanitizer (memcheck), when it is installed
#   bench      benchmarks/run.py --device cuda --topics gpu (results written after every
#              case, so a run cut short keeps what it measured)
#   all        every phase in order (may take longer than 10 minutes)
#
# Each phase appends one line to OUTDIR/summary.txt (ok / FAILED / STOPPED, with its
# duration) and writes OUTDIR/<phase>.log; tests: pytest-junit.xml; bench: <suite>.json,
# <suite>.csv, plots-<suite>/ (in OUTDIR/bench).  OUTDIR: $OUT if set, else ./gpu-check-out.
# Exit status: 0 passed, 1 failed, 2 needs a CUDA device and there is none.
#   PYTHON=python3  SUITE=quick|full|smoke  GPU_ARCHS="90" (default: this GPU's)
#   WHEELS=dir: extra wheels to put on the path first (default ./.whl when it has any)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
phase=${1:-}
case "$phase" in
preflight | build | math | tests | sanitize | bench | all) ;;
*)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 1
    ;;
esac
out=$(mkdir -p "${2:-${OUT:-gpu-check-out}}" && cd "${2:-${OUT:-gpu-check-out}}" && pwd)
py=${PYTHON:-python3}
# a relative PYTHON path made absolute: some steps run from other directories
[[ $py == */* && $py != /* ]] && py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")
suite=${SUITE:-quick}
summary="$out/summary.txt"
touch "$summary"

note() { echo "$*" | tee -a "$summary"; }

# ---- preflight: what the build and the GPU phases need
preflight() {
    local bad=0 nvcc
    nvcc=$(command -v nvcc || true)
    if [[ -z "$nvcc" ]]; then
        echo "MISSING nvcc: not on PATH (install the CUDA toolkit, or pip install" \
            "nvidia-cuda-nvcc and put its bin/ on PATH); the build needs it"
        bad=1
    else
        echo "nvcc: $nvcc ($("$nvcc" --version | tail -n 2 | head -n 1))"
        if lib=$("$py" scripts/cuda_libdir.py "$nvcc") &&
            link=$("$py" scripts/cuda_libdir.py --link "$nvcc"); then
            echo "CUDA runtime: $lib ($link)"
        else
            echo "MISSING the CUDA runtime library (libcudart.so or libcudart.so.N)"
            bad=1
        fi
    fi
    "$py" - <<'EOF' || bad=1
import os, platform, sysconfig, sys
inc = sysconfig.get_paths()["include"]
ok = os.path.exists(os.path.join(inc, "Python.h"))
print("python", platform.python_version(), "Python.h:", inc if ok else f"MISSING in {inc}")
try:
    import torch
except ImportError as exc:
    sys.exit(f"MISSING torch: {exc}")
print("torch", torch.__version__, "CUDA", torch.version.cuda)
if not torch.version.cuda:
    ok = False
    print("MISSING a CUDA build of torch (this one is CPU-only)")
from importlib import metadata
for mod, dist in (("transformers", "transformers"), ("mesonbuild", "meson"), ("ninja", "ninja")):
    try:
        __import__(mod)
        print(dist, metadata.version(dist))
    except ImportError as exc:
        ok = False
        print(f"MISSING {dist}: {exc}")
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
sys.exit(0 if ok else 1)
EOF
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    else
        echo "nvidia-smi: not found"
    fi
    command -v compute-sanitizer >/dev/null && echo "compute-sanitizer: $(command -v compute-sanitizer)" ||
        echo "compute-sanitizer: not found (the sanitize phase will be skipped)"
    return $bad
}

has_gpu() { "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; }

# this GPU's compute capability (sm_90 when there is none: the build still runs)
archs() {
    echo "${GPU_ARCHS:-$("$py" -c "import torch
c = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
print(f'{c[0]}{c[1]}')")}"
}

# ---- build against this torch, CUDA kernels required, and stage the package
build() {
    local pkg=builddir-gpu/stage/posenc_torch
    rm -rf builddir-gpu &&
        "$py" -m mesonbuild.mesonmain setup builddir-gpu -Dbuildtype=release -Dcuda=enabled \
            "-Dgpu_archs=$(archs | tr ' ' ',')" &&
        "$py" -m mesonbuild.mesonmain compile -C builddir-gpu &&
        mkdir -p "$pkg" && cp posenc_torch/*.py "$pkg/" && cp builddir-gpu/_C*.so "$pkg/" &&
        (cd builddir-gpu && PYTHONPATH="$root/builddir-gpu/stage" "$py" -c "import posenc_torch as p
assert p._C.has_cuda(), 'built without CUDA kernels'
print('staged', p.__file__)")
}

staged() {
    if [[ ! -d builddir-gpu/stage/posenc_torch ]]; then
        echo "no staged build in builddir-gpu: run the build phase first"
        return 1
    fi
    export PYTHONPATH="$root/builddir-gpu/stage${PYTHONPATH:+:$PYTHONPATH}"
    # Optional extra packages as wheels (e.g. Liger-Kernel for the benchmark, on a machine
    # without network): every *.whl in $WHEELS (default ./.whl) goes on the path, no deps.
    local wheels=${WHEELS:-.whl}
    if compgen -G "$wheels/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade \
            --target builddir-gpu-site "$wheels"/*.whl || return 1
        export PYTHONPATH="$root/builddir-gpu-site:$PYTHONPATH"
    fi
}

math() {
    local a
    a=$(archs)
    nvcc -std=c++17 -O2 -Icsrc -gencode "arch=compute_${a%% *},code=sm_${a%% *}" \
        csrc/cuda/tests/math_device.cu -o builddir-gpu/math_device && builddir-gpu/math_device
}

# from tests/ (as make pytest does), so the staged package is imported, not the sources
tests() {
    (cd tests && "$py" -m pytest -q -rs -p no:cacheprovider test_cuda.py \
        --junitxml="$out/pytest-junit.xml")
}

sanitize() {
    (cd tests && compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 20 \
        "$py" -m pytest -q -rs -p no:cacheprovider test_cuda.py -k "not 2_pow_31")
}

bench() {
    "$py" benchmarks/run.py "--$suite" --device cuda --topics gpu --out "$out/bench"
}

# run_phase NAME: the phase with its log, duration and summary line; 0 ok, 1 failed, 2 no GPU
run_phase() {
    local name=$1 rc start
    start=$(date +%s)
    echo "==== $name ($(date -u +%H:%M:%S) UTC)"
    case $name in
    preflight) preflight ;;
    build) build ;;
    *)
        staged || { note "FAILED  $name: no staged build (run the build phase first)"; return 1; }
        if ! has_gpu; then
            note "STOPPED $name: no CUDA device"
            return 2
        fi
        if [[ $name == sanitize ]] && ! command -v compute-sanitizer >/dev/null; then
            note "SKIPPED sanitize: compute-sanitizer not found"
            return 0
        fi
        $name
        ;;
    esac > >(tee "$out/$name.log") 2>&1
    rc=$?
    local took=$(($(date +%s) - start))
    if ((rc == 0)); then note "ok      $name (${took} s)"; else note "FAILED  $name (exit status $rc, ${took} s)"; fi
    ((rc == 0))
}

if [[ $phase == all ]]; then
    status=0
    for p in preflight build math tests sanitize bench; do
        run_phase "$p"
        rc=$?
        ((rc == 2)) && exit 2
        ((rc != 0)) && status=1
        [[ $p == preflight || $p == build ]] && ((rc != 0)) && break
    done
    echo "==== summary ($out)"
    cat "$summary"
    exit $status
fi
run_phase "$phase"

#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, nvcc, and a Python with torch (a CUDA
# build), transformers, meson and ninja; no network and no meson-python needed.
#
#   scripts/gpu_check.sh PHASE [OUTDIR]      (or: make gpu-check PHASE=...)
#
#   first      preflight, build, math and tests, one after the other, within FIRST_BUDGET
#              seconds (default 400: with the last phase's stop, under 7 minutes); the
#              first thing to run
#   bench      benchmarks/run.py --quick --device cuda --topics gpu: posenc and the two
#              memory floors at T = 4096 and 32768, forward and backward, each with its GPU
#              time alone (kernel_ms, L2 flushed between replays); builds first when
#              builddir-gpu has no build; within BENCH_BUDGET seconds (default 220: under 4
#              minutes)
#   preflight  nvcc (PATH, then /usr/local/cuda/bin, then the toolkit beside the CUDA build
#              of torch), the CUDA runtime library, the C/C++ compilers, Python.h, torch and
#              its CUDA version, transformers, meson, ninja, pytest, the GPU,
#              compute-sanitizer; fails with the reason when something the build needs is
#              missing
#   build      builds posenc_torch against this torch with the CUDA kernels (plain meson
#              build in builddir-gpu, for this GPU's architecture) and stages it as it is
#              installed (scripts/gpu_stage.sh: meson install into builddir-gpu/stage, every
#              module checked there and imported from it; nothing is installed)
#   math       csrc/cuda/tests/math_device.cu, built with --fmad=false as the kernels are:
#              rope_math.h on the GPU vs the host, and the kernels' bf16/fp16 conversions
#              (the hardware instructions, the one-value NaN path) vs the CPU's over all
#              2^32 fp32 patterns
#   tests      tests/test_cuda.py from the stage: pytest -v (each test's name as it starts,
#              its result as it ends), every result and its time appended to tests.txt as
#              the test ends (tests/progress_log.py), the slowest 15 at the end
#   sanitize   tests/cuda_variants.py (every kernel instantiation once, then a 5,000-token
#              case) under compute-sanitizer: memcheck with torch's caching allocator off
#              (PYTORCH_NO_CUDA_MEMORY_CACHING=1, so an overrun meets the end of its own
#              allocation), then racecheck on the kernels that share memory; SKIPPED, with
#              the sanitizer's own words, where it refuses the device
#   all        every phase in order (longer than one call)
#
# OUTDIR ($OUT if set, else ./gpu-check-out) gets few files, written as the run goes (a
# call of the GPU machine returns at most 8): summary.txt first (the run's start, then a
# line per phase: ok / FAILED / STOPPED / SKIPPED with its duration, appended as each ends;
# the phases left when preflight or build fails, SKIPPED on one line); first.log or
# bench.log (everything the phases print, in order, each phase headed by its start time, so
# a run cut short shows where it stopped; a phase run alone writes PHASE.log); the results
# in one file: tests.txt (tests) or quick.json (bench, rewritten after every case; quick.csv
# is the same table, written at the end).  The summary is printed last as well.
# Exit status: 0 passed, 1 failed, 2 needs a CUDA device and there is none.
#   PYTHON=python3  SUITE=quick|full|smoke  GPU_ARCHS="90" (default: this GPU's)
#   WHEELS=dir: extra wheels to put on the path first (default ./.whl when it has any)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
self=$root/scripts/gpu_check.sh
phase=${1:-}
case "$phase" in
preflight | build | math | tests | sanitize | bench | first | all) ;;
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
export PYTHONUNBUFFERED=1 # logs as they happen

note() { echo "$*" | tee -a "$summary"; }

# nvcc: on PATH, else the toolkit's usual place, else the toolkit beside the CUDA build of
# torch (the CUDA_HOME torch was built to use, or the nvidia-* wheels in its site-packages).
find_nvcc() {
    if command -v nvcc; then return 0; fi
    if [[ -x /usr/local/cuda/bin/nvcc ]]; then echo /usr/local/cuda/bin/nvcc; return 0; fi
    "$py" - 2>/dev/null <<'EOF'
import glob, os, sys
import torch
cands = []
try:
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME:
        cands.append(os.path.join(CUDA_HOME, "bin", "nvcc"))
except Exception:  # noqa: BLE001
    pass
site = os.path.dirname(os.path.dirname(torch.__file__))
cands += sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", "nvcc")))
cands += sorted(glob.glob(os.path.join(site, "nvidia", "bin", "nvcc")))
for c in cands:
    if os.access(c, os.X_OK):
        print(c)
        sys.exit(0)
sys.exit(1)
EOF
}

nvcc_path=$(find_nvcc || true)
# meson finds nvcc on PATH; ninja may live beside this Python only
[[ -n $nvcc_path ]] && PATH="$(dirname "$nvcc_path"):$PATH"
PATH="$(dirname "$(command -v "$py" || echo "$py")"):$PATH"
export PATH

# ---- preflight: what the build and the GPU phases need
preflight() {
    local bad=0
    if [[ -z $nvcc_path ]]; then
        echo "MISSING nvcc: not on PATH, not in /usr/local/cuda/bin, not beside torch" \
            "(install the CUDA toolkit, or pip install nvidia-cuda-nvcc); the build needs it"
        bad=1
    else
        echo "nvcc: $nvcc_path ($("$nvcc_path" --version | tail -n 2 | head -n 1))"
        if lib=$("$py" scripts/cuda_libdir.py "$nvcc_path") &&
            link=$("$py" scripts/cuda_libdir.py --link "$nvcc_path"); then
            echo "CUDA runtime: $lib ($link)"
        else
            echo "MISSING the CUDA runtime library (libcudart.so or libcudart.so.N)"
            bad=1
        fi
    fi
    "$py" - <<'EOF' || bad=1
import os, platform, shutil, sysconfig, sys
inc = sysconfig.get_paths()["include"]
ok = os.path.exists(os.path.join(inc, "Python.h"))
print("python", platform.python_version(), sys.executable, "Python.h:",
      inc if ok else f"MISSING in {inc}")
try:
    import torch
except ImportError as exc:
    sys.exit(f"MISSING torch: {exc}")
print("torch", torch.__version__, "CUDA", torch.version.cuda)
if not torch.version.cuda:
    ok = False
    print("MISSING a CUDA build of torch (this one is CPU-only)")
from importlib import metadata
for mod, dist in (("transformers", "transformers"), ("mesonbuild", "meson"), ("ninja", "ninja"),
                  ("pytest", "pytest")):
    try:
        __import__(mod)
        print(dist, metadata.version(dist))
    except ImportError as exc:
        ok = False
        print(f"MISSING {dist}: {exc}")
print("ninja program:", shutil.which("ninja") or "MISSING (not on PATH)")
ok = ok and shutil.which("ninja") is not None
for cc in ("cc", "c++"):  # meson's C and C++ compilers (the C kernels, the shim)
    print(f"{cc}:", shutil.which(cc) or "MISSING (not on PATH)")
    ok = ok and shutil.which(cc) is not None
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
sys.exit(0 if ok else 1)
EOF
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    else
        echo "nvidia-smi: not found"
    fi
    if command -v compute-sanitizer >/dev/null; then
        echo "compute-sanitizer: $(command -v compute-sanitizer)"
    else
        echo "compute-sanitizer: not found (the sanitize phase will be skipped)"
    fi
    echo "cores: $(nproc)"
    return $bad
}

has_gpu() { "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; }

# this GPU's compute capability (sm_90 when there is none: the build still runs)
archs() {
    echo "${GPU_ARCHS:-$("$py" -c "import torch
c = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
print(f'{c[0]}{c[1]}')")}"
}

# ---- build against this torch, CUDA kernels required, and stage the package as installed
build() {
    [[ -n $nvcc_path ]] || { echo "no nvcc (see preflight)"; return 1; }
    rm -rf builddir-gpu &&
        "$py" -m mesonbuild.mesonmain setup builddir-gpu -Dbuildtype=release -Dcuda=enabled \
            "-Dgpu_archs=$(archs | tr ' ' ',')" &&
        "$py" -m mesonbuild.mesonmain compile -C builddir-gpu &&
        PYTHON="$py" bash scripts/gpu_stage.sh builddir-gpu builddir-gpu/stage &&
        (cd builddir-gpu && PYTHONPATH="$root/builddir-gpu/stage" "$py" -c "import posenc_torch as p
assert p._C.has_cuda(), 'built without CUDA kernels'")
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
    "$nvcc_path" -std=c++17 -O3 --fmad=false -Icsrc \
        -gencode "arch=compute_${a%% *},code=sm_${a%% *}" \
        csrc/cuda/tests/math_device.cu -o builddir-gpu/math_device && builddir-gpu/math_device
}

# from tests/ (as make pytest does), so the staged package is imported, not the sources;
# tests.txt gets each result as its test ends (tests/progress_log.py)
tests() {
    local timeout=()
    "$py" -c "import pytest_timeout" 2>/dev/null && timeout=(--timeout 240)
    (cd tests && POSENC_PROGRESS_LOG="$out/tests.txt" "$py" -m pytest -v -rs \
        -p no:cacheprovider -p progress_log --durations=15 "${timeout[@]}" test_cuda.py)
}

# compute-sanitizer on a one-allocation program first: where it refuses the device, its own
# words are the reason the phase is skipped.
sanitizer_refusal() {
    local probe
    probe=$(compute-sanitizer --tool memcheck --error-exitcode 1 "$py" -c \
        "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" 2>&1)
    local rc=$?
    if grep -qiE "not supported|error 999|unknown error|failed to initialize" <<<"$probe" ||
        ((rc != 0)); then
        grep -iE "not supported|error|failed" <<<"$probe" | head -n 2 | sed 's/^=* *//' |
            tr '\n' ' '
        [[ -n $probe ]] || echo "compute-sanitizer exited with status $rc"
        return 0
    fi
    return 1
}

sanitize() {
    local why
    if why=$(sanitizer_refusal); then
        echo "compute-sanitizer refused the device: $why"
        return 3
    fi
    echo "== memcheck, caching allocator off: every kernel instantiation, a 5,000-token case"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
        --print-limit 20 "$py" tests/cuda_variants.py || return 1
    echo "== racecheck: the kernels with shared memory, the 5,000-token case"
    compute-sanitizer --tool racecheck --error-exitcode 1 --print-limit 20 "$py" \
        tests/cuda_variants.py --shared-only
}

# the results in OUTDIR itself: <suite>.json (rewritten after every case) and .csv, no
# plots (draw them later from the JSON: benchmarks/plot.py)
bench() {
    "$py" benchmarks/run.py "--$suite" --device cuda --topics gpu --no-plots --out "$out"
}

# run_phase NAME: the phase with its log, duration and summary line; 0 ok, 1 failed, 2 no
# GPU, 3 skipped
run_phase() {
    local name=$1 rc start last
    start=$(date +%s)
    last=$(mktemp) # the phase's output, for the reason a skipped phase gives last
    echo "==== $name ($(date -u +%H:%M:%S) UTC)"
    (
        case $name in
        preflight) preflight ;;
        build) build ;;
        *)
            if [[ $name == bench && ! -d builddir-gpu/stage/posenc_torch ]]; then
                echo "no staged build: building first"
                build || exit 1
            fi
            staged || exit 1
            if ! has_gpu; then
                echo "no CUDA device"
                exit 2
            fi
            if [[ $name == sanitize ]] && ! command -v compute-sanitizer >/dev/null; then
                echo "compute-sanitizer not found"
                exit 3
            fi
            $name
            ;;
        esac
    ) 2>&1 | tee "$last" | if [[ -n ${GPU_CHECK_CHILD:-} ]]; then cat; else tee "$out/$name.log"; fi
    rc=${PIPESTATUS[0]}
    local took=$(($(date +%s) - start))
    case $rc in
    0) note "ok      $name (${took} s)" ;;
    2) note "STOPPED $name: no CUDA device (${took} s)" ;;
    3) note "SKIPPED $name: $(tail -n 1 "$last") (${took} s)" ;;
    *) note "FAILED  $name (exit status $rc, ${took} s)" ;;
    esac
    rm -f "$last"
    return "$rc"
}

# phases PHASE... under BUDGET seconds in all: each a child of this script under `timeout`
# (so one that hangs is stopped and the next still runs), its output into OUT/<log>.log
phases() {
    local budget=$1 log=$2 status=0 start rc left p
    shift 2
    start=$(date +%s)
    : >"$out/$log.log"
    note "$log: $* within $budget s, started $(date -u +%H:%M:%S) UTC"
    while (($#)); do
        p=$1
        shift
        left=$((budget - ($(date +%s) - start)))
        if ((left <= 5)); then
            note "STOPPED $p: not started, the $budget s budget of $phase is spent"
            status=1
            continue
        fi
        GPU_CHECK_CHILD=1 timeout --kill-after=10 "$left" bash "$self" "$p" "$out" 2>&1 |
            tee -a "$out/$log.log"
        rc=${PIPESTATUS[0]}
        if ((rc == 124 || rc == 137)); then
            note "STOPPED $p: cut off at the $budget s budget of $phase"
            status=1
        elif ((rc == 2)); then
            return 2
        elif ((rc != 0 && rc != 3)); then
            status=1
            if [[ $p == preflight || $p == build ]] && (($#)); then
                note "SKIPPED $*: $p failed"
                break
            fi
        fi
    done
    echo "==== summary ($out)" | tee -a "$out/$log.log"
    tee -a "$out/$log.log" <"$summary"
    return $status
}

case $phase in
first) phases "${FIRST_BUDGET:-400}" first preflight build math tests ;;
all) phases "${ALL_BUDGET:-3600}" all preflight build math tests sanitize bench ;;
bench)
    if [[ -n ${GPU_CHECK_CHILD:-} ]]; then
        run_phase bench
    else
        phases "${BENCH_BUDGET:-220}" bench bench
    fi
    ;;
*) run_phase "$phase" ;;
esac

#!/usr/bin/env bash
# Stage a Meson build of posenc_torch as the package is installed: what `meson install`
# puts in site-packages (the modules meson.build installs, every subpackage, the built _C),
# moved to STAGE/posenc_torch, so that PYTHONPATH=STAGE imports the package as a wheel would
# give it.  Then check that every module of the source tree is there and that the package
# and each of its modules import from the stage (torch and transformers from PYTHON).
#
#   scripts/gpu_stage.sh BUILDDIR STAGE      PYTHON=python3 (runs meson and the import)
#
# scripts/gpu_check.sh stages its CUDA build with this; tests/test_gpu_stage.py stages the
# CPU build of `make wheel` (build/) with it and collects tests/test_cuda.py from the stage.
set -euo pipefail
[[ $# -eq 2 ]] || { sed -n '2,/^set -eu/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$1" && pwd)
mkdir -p "$2"
stage=$(cd "$2" && pwd)
py=${PYTHON:-python3}
# a relative PYTHON path made absolute: the import check runs in STAGE
[[ $py == */* && $py != /* ]] && py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")

# meson install into a scratch root, then the one package directory it holds
dest="$stage/.install"
rm -rf "$dest" "$stage/posenc_torch"
"$py" -m mesonbuild.mesonmain install -C "$build" --destdir "$dest" --no-rebuild --quiet
mapfile -t inits < <(find "$dest" -path '*/posenc_torch/__init__.py')
if [[ ${#inits[@]} -ne 1 ]]; then
    echo "gpu_stage: expected one installed posenc_torch/__init__.py under $dest, found" \
        "${#inits[@]}" >&2
    exit 1
fi
mv "$(dirname "${inits[0]}")" "$stage/posenc_torch"
rm -rf "$dest"

# every module of the source tree installed (a module missing from meson.build's install
# lists would be missing from the wheel too)
missing=()
while IFS= read -r f; do
    [[ -f "$stage/$f" ]] || missing+=("$f")
done < <(cd "$root" && find posenc_torch -name '*.py' -not -path '*/__pycache__/*' | sort)
if ((${#missing[@]})); then
    echo "gpu_stage: not installed by meson.build: ${missing[*]}" >&2
    exit 1
fi
compgen -G "$stage/posenc_torch/_C*.so" >/dev/null ||
    { echo "gpu_stage: no built _C in $stage/posenc_torch" >&2; exit 1; }

# from the stage itself (not the source tree): the package and each of its modules
cd "$stage"
PYTHONPATH="$stage" "$py" - "$stage" <<'EOF'
import importlib, os, pkgutil, sys
stage = sys.argv[1]
import posenc_torch
import posenc_torch.hf
names = ["posenc_torch"] + [m.name for m in pkgutil.walk_packages(posenc_torch.__path__,
                                                                  "posenc_torch.")]
for name in names:
    if name.endswith(".__main__"):
        continue  # a command's entry point: importing it runs the command
    mod = importlib.import_module(name)
    where = os.path.realpath(getattr(mod, "__file__", "") or "")
    if not where.startswith(os.path.realpath(stage) + os.sep):
        sys.exit(f"gpu_stage: {name} imported from {where}, not from the stage {stage}")
print(f"staged {len(names)} modules of posenc_torch in {stage} (_C: "
      f"{'with' if posenc_torch._C.has_cuda() else 'without'} the CUDA kernels)")
EOF

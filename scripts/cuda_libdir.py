"""Find the CUDA runtime library (libcudart) that belongs to an nvcc.

    python scripts/cuda_libdir.py NVCC          the directory of libcudart
    python scripts/cuda_libdir.py --link NVCC   the linker argument: -lcudart, or
                                                -l:libcudart.so.N where only the versioned
                                                library exists (pip-installed CUDA)

nvcc on PATH is often a wrapper script or a symlink, so its own location says nothing; its
dry run prints the library search path it would link with.  A toolkit ships libcudart.so;
the NVIDIA wheels (nvidia-cuda-runtime, in site-packages/nvidia/*/lib) ship only
libcudart.so.N, and are searched after the dry run's directories.
"""

from __future__ import annotations

import re
import site
import subprocess
import sys
from pathlib import Path


def _candidates(nvcc: str) -> list[Path]:
    run = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
                         capture_output=True, text=True, check=True)
    dirs: list[Path] = []
    for line in (run.stdout + run.stderr).splitlines():
        if line.startswith("#$ LIBRARIES="):
            dirs += [Path(d) for d in re.findall(r'-L"?([^"\s]+)', line)]
    for sp in [*site.getsitepackages(), site.getusersitepackages()]:
        dirs += sorted(Path(sp).glob("nvidia/*/lib"))
    return [d for d in dirs if d.name != "stubs"]


def cudart(nvcc: str) -> tuple[Path, str]:
    """(directory, file name) of the runtime library: the unversioned one if any."""
    for d in _candidates(nvcc):
        if (d / "libcudart.so").exists():
            return d.resolve(), "libcudart.so"
        versioned = sorted(d.glob("libcudart.so.[0-9]*"), key=lambda p: len(p.name))
        if versioned:
            return d.resolve(), versioned[0].name
    raise SystemExit(f"cannot find libcudart.so or libcudart.so.N for {nvcc} (its dry run's "
                     "library path, then the nvidia-* wheels in site-packages)")


if __name__ == "__main__":
    args = sys.argv[1:]
    link = bool(args) and args[0] == "--link"
    if link:
        args = args[1:]
    if len(args) != 1:
        raise SystemExit("usage: cuda_libdir.py [--link] NVCC")
    where, name = cudart(args[0])
    if not link:
        print(where)
    else:
        print("-lcudart" if name == "libcudart.so" else f"-l:{name}")

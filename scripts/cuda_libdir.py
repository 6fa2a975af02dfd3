"""Print the directory of libcudart that belongs to an nvcc (argument: the nvcc path).

nvcc on PATH is often a wrapper script or a symlink, so its own location says nothing;
its dry run prints the library search path it would link with.
"""

import re
import subprocess
import sys
from pathlib import Path


def cuda_libdir(nvcc: str) -> Path:
    run = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
                         capture_output=True, text=True, check=True)
    for line in (run.stdout + run.stderr).splitlines():
        if line.startswith("#$ LIBRARIES="):
            dirs = [Path(d) for d in re.findall(r'-L"?([^"\s]+)', line)]
            for d in dirs:
                if d.name != "stubs" and (d / "libcudart.so").exists():
                    return d.resolve()
    raise SystemExit(f"cannot find libcudart.so in the dry run of {nvcc}")


if __name__ == "__main__":
    print(cuda_libdir(sys.argv[1]))

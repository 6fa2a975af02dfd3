"""Check the compiled CUDA kernels (csrc/cuda/rope.cu) in their machine code, no GPU needed.

    python scripts/cuda_sass_check.py [--cuobjdump PATH] OBJECT...

Each OBJECT is rope.cu compiled for one architecture with its PTX embedded (cuda_compile.sh
builds builddir-cuda/rope.sm_XX.o so).  For every posenc kernel it reads the register and
stack use (cuobjdump -res-usage), the launch bounds (the PTX's .maxntid / .minnctapersm) and
the SASS, prints one line per kernel, and fails (exit status 1) when:

- a kernel has a stack frame or local memory (LDL/STL: spills, or arrays indexed at run time);
- a kernel uses more registers than its launch bounds allow (65536 / (threads * blocks));
- a vector variant of the apply kernel (16-byte rows) stores anything but 128-bit words;
- any kernel has a fused multiply-add (FFMA, DFMA, HFMA2 other than the register-zeroing
  HFMA2.MMA idiom), a flush-to-zero operation (.FTZ; F2I aside) or a fast-math unit
  instruction (MUFU other than MUFU.RCP: integer division uses both): the per-element math
  must be the CPU's, rounded op by op.

cuobjdump comes from --cuobjdump, $CUOBJDUMP, the directory of nvcc, PATH, or the
nvidia-cuda-cuobjdump wheel in .venv/cuda-tools (make cuda-compile installs it there).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGISTERS_PER_SM = 65536


@dataclass
class Kernel:
    mangled: str
    name: str = ""
    regs: int = 0
    stack: int = 0
    local: int = 0
    max_threads: int | None = None
    min_blocks: int | None = None
    ops: collections.Counter = field(default_factory=collections.Counter)
    bad: list[str] = field(default_factory=list)

    @property
    def vector_apply(self) -> bool:
        m = re.search(r"rope_apply_kernel<([^>]*)>", self.name)
        return bool(m) and int(m.group(1).split(",")[2]) > 1

    def stores(self) -> dict[str, int]:
        return {op: n for op, n in sorted(self.ops.items()) if op.startswith("STG")}


def find_cuobjdump(given: str | None) -> str:
    candidates = [given, os.environ.get("CUOBJDUMP")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent / "cuobjdump"))
    candidates.append(shutil.which("cuobjdump"))
    wheels = ROOT / ".venv" / "cuda-tools" / "nvidia"
    candidates += [str(p) for p in wheels.glob("*/bin/cuobjdump")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise SystemExit("cuda_sass_check: no cuobjdump (install the nvidia-cuda-cuobjdump wheel, "
                     "requirements-cuda-tools.txt, or set CUOBJDUMP)")


def run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def demangle(names: list[str]) -> dict[str, str]:
    if not names or not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return {n: re.sub(r"\(anonymous namespace\)::|pe_cuda::", "", d) for n, d in zip(names, out)}


def read_kernels(obj: Path, cuobjdump: str) -> dict[str, Kernel]:
    kernels: dict[str, Kernel] = {}
    res = run(cuobjdump, "-res-usage", str(obj))
    usage = r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)"
    for m in re.finditer(usage, res):
        kernels[m.group(1)] = Kernel(m.group(1), regs=int(m.group(2)), stack=int(m.group(3)),
                                     local=int(m.group(4)))
    ptx = run(cuobjdump, "-ptx", str(obj))
    for m in re.finditer(r"\.entry\s+(\S+)\(([^)]*)\)\s*([^{]*)\{", ptx):
        k = kernels.get(m.group(1))
        if k is None:
            continue
        if t := re.search(r"\.maxntid\s+(\d+)", m.group(3)):
            k.max_threads = int(t.group(1))
        if b := re.search(r"\.minnctapersm\s+(\d+)", m.group(3)):
            k.min_blocks = int(b.group(1))
    cur = None
    for line in run(cuobjdump, "-sass", str(obj)).splitlines():
        if f := re.search(r"Function : (\S+)", line):
            cur = kernels.get(f.group(1))
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if cur is None or not ins:
            continue
        op, args = ins.group(1), ins.group(2)
        cur.ops[op] += 1
        base = op.split(".")[0]
        if base in ("FFMA", "DFMA", "FFMA32I") or (base == "HFMA2" and not (
                op == "HFMA2.MMA" and re.search(r"-RZ,\s*RZ", args))):
            cur.bad.append(f"fused multiply-add {op}{args}")
        elif ".FTZ" in op and base != "F2I":  # F2I.FTZ: integer division's reciprocal
            cur.bad.append(f"flush-to-zero {op}")
        elif base == "MUFU" and op != "MUFU.RCP":
            cur.bad.append(f"fast-math unit {op}")
        elif base in ("LDL", "STL"):
            cur.bad.append(f"local memory {op}")
    names = demangle(list(kernels))
    for k in kernels.values():
        k.name = names[k.mangled]
    return kernels


def check(kernel: Kernel) -> list[str]:
    errors = list(dict.fromkeys(kernel.bad))
    if kernel.stack or kernel.local:
        errors.append(f"stack frame {kernel.stack} B, local memory {kernel.local} B")
    if kernel.max_threads:
        limit = REGISTERS_PER_SM // (kernel.max_threads * (kernel.min_blocks or 1))
        limit = min(255, limit // 8 * 8)
        if kernel.regs > limit:
            errors.append(f"{kernel.regs} registers, launch bounds allow {limit}")
    if kernel.vector_apply:
        narrow = {op: n for op, n in kernel.stores().items() if not op.endswith("128")}
        if narrow:
            errors.append(f"stores narrower than 128 bits in a vector variant: {narrow}")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("objects", nargs="+", type=Path)
    ap.add_argument("--cuobjdump")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump)
    failed = 0
    for obj in args.objects:
        kernels = read_kernels(obj, cuobjdump)
        if not kernels:
            print(f"cuda_sass_check: no kernels found in {obj}", file=sys.stderr)
            return 1
        print(f"{obj.name}: {len(kernels)} kernels (registers, launch bounds "
              "threads x blocks per SM, global stores)")
        for k in sorted(kernels.values(), key=lambda k: k.name):
            bounds = f"{k.max_threads}x{k.min_blocks or 1}" if k.max_threads else "-"
            stores = " ".join(f"{op}:{n}" for op, n in k.stores().items())
            print(f"  {k.regs:3d} regs  {bounds:>7}  {k.name}  [{stores}]")
            for e in check(k):
                print(f"    FAIL {e}")
                failed += 1
    print(f"cuda_sass_check: {'FAILED, ' + str(failed) + ' problems' if failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

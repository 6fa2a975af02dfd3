"""Count the frames from ``posenc_torch.apply_rotary_pos_emb`` to the inner rotation loop.

A decode-sized call (Qwen2-VL-7B heads 28/4, head_dim 128, B=8, T=1, bf16, q and k the
transposed views transformers passes) runs in a child interpreter under gdb, once under
``torch.no_grad()`` and once with autograd recording.  gdb stops at the fp32 core's tile
function of the kernel variant in use, ``pe_rope_rotate_f32_<isa>`` (the row loops of
csrc/cpu/rope_f32.h are inlined into it), and prints the backtrace: the project's native
frames are those in posenc_torch's ``_C.abi3.so``.  The project's Python frames are read
by the child itself when it calls into the ``posenc::rope`` operator (a ``sys.setprofile``
hook on that C call): the frames whose code is in the posenc_torch package.

    python scripts/count_frames.py            # the CPU's best kernel variant
    python scripts/count_frames.py --isa avx2 --threads 2

Needs gdb.  Prints both stacks and the counts; exits 1 if a breakpoint was never reached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys
from pathlib import Path
import torch
import posenc_torch as pt

isa, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
pt.set_kernel_isa(isa)
package = str(Path(pt.__file__).resolve().parent)
B, T, Hq, Hk, D = 8, 1, 28, 4, 128


def python_frames(frame):
    out = []
    while frame is not None:
        path = str(Path(frame.f_code.co_filename).resolve())
        if path.startswith(package):
            out.append(f"{Path(path).name}:{frame.f_code.co_name}")
        frame = frame.f_back
    return out


stacks = []


def hook(frame, event, arg):
    # the C call made by torch's OpOverload.__call__ for posenc::rope enters the operator
    if event == "c_call" and frame.f_code.co_name == "__call__" and \
            "posenc.rope.default" in str(frame.f_locals.get("self", "")):
        stacks.append(python_frames(frame))


for grad in (False, True):
    qp = torch.randn(B, T, Hq * D).bfloat16().requires_grad_(grad)
    kp = torch.randn(B, T, Hk * D).bfloat16().requires_grad_(grad)
    q, k = qp.view(B, T, Hq, D).transpose(1, 2), kp.view(B, T, Hk, D).transpose(1, 2)
    cos, sin = torch.randn(B, T, D).bfloat16(), torch.randn(B, T, D).bfloat16()
    with torch.set_grad_enabled(grad):
        print("@@CALL", "grad" if grad else "no grad", flush=True)
        sys.setprofile(hook)
        pt.apply_rotary_pos_emb(q, k, cos, sin)
        sys.setprofile(None)
print("@@PYTHON", json.dumps(stacks), flush=True)
"""


def _function(frame: str) -> str:
    """The function of a gdb backtrace line, shortened (C++ template arguments dropped)."""
    name = re.sub(r"^#\d+\s+(0x[0-9a-f]+ in )?", "", frame).split(" from /")[0]
    name = name.replace("(anonymous namespace)", "{anonymous}")
    name = re.sub(r" ?\(.*$", "", name)  # argument list, "()" when there is no debug info
    while "<" in name:  # innermost template argument lists first
        shorter = re.sub(r"<[^<>]*>", "", name)
        if shorter == name:
            break
        name = shorter
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", help="kernel variant (baseline, avx2, avx512); default: the best")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the child")
    ap.add_argument("--symbol", help="break here instead of pe_rope_rotate_f32_<isa>")
    opts = ap.parse_args()
    if shutil.which("gdb") is None:
        print("count_frames.py needs gdb", file=sys.stderr)
        return 2
    import posenc_torch

    isa = opts.isa or posenc_torch._C.best_isa()
    symbol = opts.symbol or f"pe_rope_rotate_f32_{isa}"
    commands = (f"set pagination off\nset confirm off\nset breakpoint pending on\n"
                f"break {symbol}\ncommands\nbt\ncontinue\nend\nrun\n")
    with tempfile.TemporaryDirectory() as tmp:
        child, script = os.path.join(tmp, "child.py"), os.path.join(tmp, "commands.gdb")
        with open(child, "w") as f:
            f.write(CHILD)
        with open(script, "w") as f:
            f.write(commands)
        gdb = ["gdb", "-batch", "-nx", "-x", script, "--args", sys.executable, child, isa,
               str(opts.threads)]
        env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads))
        out = subprocess.run(gdb, capture_output=True, text=True, env=env, timeout=600).stdout

    python = next((json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
                   if line.startswith("@@PYTHON")), None)
    calls = re.split(r"^@@CALL ", out, flags=re.M)[1:]
    if python is None or len(calls) != 2:
        print(out[-4000:])
        print("the child did not finish both calls", file=sys.stderr)
        return 1
    ok = True
    for i, text in enumerate(calls):
        label = text.split("\n", 1)[0]
        # the first stop of the call (a decode step stops once per token): frames #0, #1, ...
        first = re.search(r"^#0 .*?(?=^[^#]|\Z)", text, flags=re.M | re.S)
        lines = re.findall(r"^#\d+ .*$", first.group(0) if first else "", flags=re.M)
        native = [_function(line) for line in lines if "_C.abi3.so" in line]
        # frames of other libraries between the project's (libgomp's GOMP_parallel, ...)
        ours = [j for j, line in enumerate(lines) if "_C.abi3.so" in line]
        between = lines[ours[0]:ours[-1]] if ours else []
        foreign = [_function(line) for line in between if "_C.abi3.so" not in line]
        if not native:
            print(f"{label}: the breakpoint at {symbol} was not reached")
            ok = False
            continue
        # innermost first, as gdb and Python list them; the op boundary between the two
        py = python[i]
        print(f"{label} ({isa}, {opts.threads} thread(s)): {len(py)} Python + {len(native)} "
              f"native = {len(py) + len(native)} frames of the project")
        print("  native (gdb):", " <- ".join(native))
        if foreign:
            print("  and between them, of other libraries:", ", ".join(foreign))
        print("  Python:      ", " <- ".join(py))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Instructions per element of the RoPE row loops, counted from the machine code.

Compiles scripts/loop_probe.c (one head row of head_dim 128, fp32 and bf16) with each x86
variant's flags from meson.build, disassembles the probe functions with objdump, counts
their instructions on the path to the first return (the loops are fully unrolled for
h = 64: the count is one row's, the constants set up once per row included; the rare redo
of a row with a NaN or a denormal sits after that return) and, where llvm-mca is installed, asks it for the
row's throughput in cycles on a model CPU.  Prints a Markdown table.

    python scripts/loop_insns.py [--cc gcc] [--mcpu sapphirerapids]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["-O3", "-std=c17", "-w", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
          "-DPE_HAVE_X86_VARIANTS"]
# the variants' flags, as in meson.build
VARIANTS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-mprefer-vector-width=512"],
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                   "-mfma", "-mf16c", "-mprefer-vector-width=512"],
}
ROWS = {"fp32": ("probe_fp32_row", 4), "bf16": ("probe_bf16_row", 2)}  # bytes per value
ELEMS = 128  # one row of head_dim 128


def functions(obj: str) -> dict[str, list[str]]:
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], check=True,
                          capture_output=True, text=True).stdout
    out: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(\w+)>:$", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name and re.match(r"^\s+[0-9a-f]+:\t", line):
            insn = line.split("\t", 1)[1].strip()
            if insn and not insn.startswith(("nop", "xchg   %ax,%ax", "cs nop", "data16")):
                out[name].append(insn)
    # the hot path: up to the first return (the rare redo of a row, NaN or denormal, is
    # placed after it)
    for name, insns in out.items():
        rets = [i for i, x in enumerate(insns) if x.startswith("ret")]
        if rets:
            out[name] = insns[:rets[0] + 1]
    return out


def mca_cycles(insns: list[str], mcpu: str) -> float | None:
    if not shutil.which("llvm-mca"):
        return None
    body = [i for i in insns if not i.startswith(("ret", "vzeroupper", "j"))]
    res = subprocess.run(["llvm-mca", f"-mcpu={mcpu}", "-iterations=200"],
                         input="\n".join(body) + "\n", capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", res.stdout)
    return int(m.group(1)) / 200 if m and res.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", default=os.environ.get("CC", "gcc"))
    ap.add_argument("--mcpu", default="sapphirerapids")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args()
    inc = ["-I" + os.path.join(ROOT, "csrc"), "-I" + os.path.join(ROOT, "csrc", "cpu")]
    print(f"| variant | row | instructions / row of {ELEMS} | per element | "
          f"llvm-mca cycles / row ({args.mcpu}) | bytes / cycle |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for var in args.variants:
            obj = os.path.join(tmp, var + ".o")
            cmd = [args.cc, *COMMON, *VARIANTS[var], *inc, "-c",
                   os.path.join(ROOT, "scripts", "loop_probe.c"), "-o", obj]
            if subprocess.run(cmd).returncode:
                print(f"| {var} | (does not compile with {args.cc}) | | | | |")
                continue
            fns = functions(obj)
            for row, (fn, es) in ROWS.items():
                insns = fns.get(fn, [])
                cyc = mca_cycles(insns, args.mcpu)
                bpc = f"{2 * es * ELEMS / cyc:.1f}" if cyc else "-"
                print(f"| {var} | {row} | {len(insns)} | {len(insns) / ELEMS:.2f} | "
                      f"{cyc if cyc is not None else '-'} | {bpc} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Instructions per element of the RoPE row loops, counted from the machine code.

Compiles scripts/loop_probe.c (one head row of head_dim 128, fp32 and bf16, and the bf16
rows of a token's 32 heads) with each x86 variant's flags from meson.build, disassembles
the probe functions with objdump, counts their instructions on the path to the first
return (the loops are fully unrolled for h = 64: the count is one row's, the constants set
up once per row included; the rare redo of a row with a NaN or a denormal sits after that
return; for the heads, the body of the loop over the heads, which is one row's) and, where
llvm-mca is installed, asks it for the row's throughput in cycles on a model CPU.  Prints a
Markdown table.

    python scripts/loop_insns.py [--cc gcc] [--mcpu sapphirerapids] [--time]

--time also runs each loop on this CPU with its rows in L1 (ns per row; the rows' own
speed, no memory traffic).
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
# the /proc/cpuinfo flags each variant needs to run (--time)
NEEDS = {"avx2": {"avx2", "fma", "f16c"},
         "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
         "avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma",
                        "f16c"}}
# name: (probe function, bytes per value, rows per call)
ROWS = {"fp32": ("probe_fp32_row", 4, 1), "bf16": ("probe_bf16_row", 2, 1),
        "bf16, 32 heads": ("probe_bf16_heads", 2, 32),
        "bf16, 32 heads, dot products": ("probe_bf16_heads_dot", 2, 32)}
# rows only some variants have (the others run the row above them)
ONLY = {"bf16, 32 heads, dot products": {"avx512bf16"}}
ELEMS = 128  # one row of head_dim 128


def functions(obj: str) -> dict[str, list[tuple[int, str]]]:
    """Each function's instructions (address, text) on the path to its first return."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], check=True,
                          capture_output=True, text=True).stdout
    out: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(\w+)>:$", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = re.match(r"^\s+([0-9a-f]+):\t(.*)$", line)
        if name and m:
            insn = m.group(2).strip()
            if insn and not insn.startswith(("nop", "xchg   %ax,%ax", "cs nop", "data16")):
                out[name].append((int(m.group(1), 16), insn))
    # the hot path: up to the first return (the rare redo of a row, NaN or denormal, is
    # placed after it)
    for name, insns in out.items():
        rets = [i for i, (_, x) in enumerate(insns) if x.startswith("ret")]
        if rets:
            out[name] = insns[:rets[0] + 1]
    return out


def loop_body(insns: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The loop closed by the last backward jump before the return, from the jump's target
    to the jump (the heads probe's loop over its rows: one row)."""
    addrs = [a for a, _ in insns]
    for i in range(len(insns) - 1, -1, -1):
        m = re.match(r"^j\w+\s+([0-9a-f]+)", insns[i][1])
        if m and int(m.group(1), 16) < addrs[i] and int(m.group(1), 16) in addrs:
            return insns[addrs.index(int(m.group(1), 16)):i + 1]
    return insns


def mca_cycles(insns: list[str], mcpu: str) -> float | None:
    if not shutil.which("llvm-mca"):
        return None
    body = [i for i in insns if not i.startswith(("ret", "vzeroupper", "j"))]
    res = subprocess.run(["llvm-mca", f"-mcpu={mcpu}", "-iterations=200"],
                         input="\n".join(body) + "\n", capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", res.stdout)
    return int(m.group(1)) / 200 if m and res.returncode == 0 else None


TIMER = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
%(decls)s
typedef void (*row_fn)(const char *, char *, const float *, const float *);
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(void) {
    /* 32 head rows of 128 channels, in L1: the loops' own speed, no memory */
    static float x[32 * 128] __attribute__((aligned(64)));
    static float o[32 * 128 + 256] __attribute__((aligned(64)));
    static float c[128] __attribute__((aligned(64))), s[128] __attribute__((aligned(64)));
    /* numbers in [1, 2) both as fp32 and as the bf16 pairs of the bf16 rows (each 16-bit half
     * a bf16 in [1, 2): no zero, denormal or NaN in any row or result) */
    for (int i = 0; i < 32 * 128; ++i) {
        const uint32_t u = (0x3f80u | (i * 37u & 0x7fu)) << 16 | 0x3f80u | (i * 101u & 0x7fu);
        memcpy(&x[i], &u, 4);
    }
    for (int i = 0; i < 128; ++i) { c[i] = 0.5f + (float)i / 1024; s[i] = 0.25f; }
    const char *names[] = {%(names)s};
    row_fn fns[] = {%(fns)s};
    const int es[] = {%(es)s};
    const int rows[] = {%(rows)s}; /* head rows one call does */
    enum { N = sizeof fns / sizeof *fns };
    double best[N];
    for (int v = 0; v < N; ++v) best[v] = 1e9;
    for (int r = 0; r < 30; ++r) /* rounds: every loop once per round, the best kept */
        for (int v = 0; v < N; ++v) {
            const double t0 = now();
            for (int k = 0; k < 4000; ++k)
                for (int h = 0; h < 32; h += rows[v])
                    fns[v]((const char *)x + h * 128 * es[v],
                           (char *)(o + 64) + h * 128 * es[v], c, s);
            const double t = (now() - t0) / (4000.0 * 32);
            if (t < best[v]) best[v] = t;
        }
    for (int v = 0; v < N; ++v) printf("%%s %%.2f\n", names[v], best[v] * 1e9);
    return 0;
}
"""


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def time_rows(cc: str, variants: list[str], inc: list[str], tmp: str) -> dict[str, float]:
    """ns per row of each variant's loops (those this CPU runs), L1-resident, best of 30
    interleaved rounds."""
    flags = cpu_flags()
    variants = [v for v in variants if NEEDS[v] <= flags]
    if not variants:
        return {}
    objs, decls, names, fns, es, per_call = [], [], [], [], [], []
    for var in variants:
        obj = os.path.join(tmp, var + "_t.o")
        ren = [f"-D{fn}={fn}_{var}" for fn, _, _ in ROWS.values()]
        cmd = [cc, *COMMON, *VARIANTS[var], *inc, *ren, "-c",
               os.path.join(ROOT, "scripts", "loop_probe.c"), "-o", obj]
        if subprocess.run(cmd).returncode:
            continue
        objs.append(obj)
        for row, (fn, size, rows) in ROWS.items():
            if var not in ONLY.get(row, {var}):
                continue
            decls.append(f"void {fn}_{var}(const char *, char *, const float *, const float *);")
            names.append(f'"{var}/{row}"')
            fns.append(f"{fn}_{var}")
            es.append(str(size))
            per_call.append(str(rows))
    src = os.path.join(tmp, "timer.c")
    with open(src, "w") as f:
        f.write(TIMER % {"decls": "\n".join(decls), "names": ", ".join(names),
                         "fns": ", ".join(fns), "es": ", ".join(es),
                         "rows": ", ".join(per_call)})
    exe = os.path.join(tmp, "timer")
    subprocess.run([cc, "-O2", src, *objs, "-o", exe], check=True)
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in out.splitlines()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", default=os.environ.get("CC", "gcc"))
    ap.add_argument("--mcpu", default="sapphirerapids")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--time", action="store_true",
                    help="also run each loop in L1 (the variants this CPU has)")
    args = ap.parse_args()
    inc = ["-I" + os.path.join(ROOT, "csrc"), "-I" + os.path.join(ROOT, "csrc", "cpu")]
    print(f"| variant | row | instructions / row of {ELEMS} | per element | "
          f"llvm-mca cycles / row ({args.mcpu}) | bytes / cycle | ns / row |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        ns = time_rows(args.cc, args.variants, inc, tmp) if args.time else {}
        for var in args.variants:
            obj = os.path.join(tmp, var + ".o")
            cmd = [args.cc, *COMMON, *VARIANTS[var], *inc, "-c",
                   os.path.join(ROOT, "scripts", "loop_probe.c"), "-o", obj]
            if subprocess.run(cmd).returncode:
                print(f"| {var} | (does not compile with {args.cc}) | | | | | |")
                continue
            fns = functions(obj)
            for row, (fn, es, rows) in ROWS.items():
                if var not in ONLY.get(row, {var}):
                    continue
                code = fns.get(fn, [])
                insns = [x for _, x in (loop_body(code) if rows > 1 else code)]
                cyc = mca_cycles(insns, args.mcpu)
                bpc = f"{2 * es * ELEMS / cyc:.1f}" if cyc else "-"
                t = ns.get(f"{var}/{row}")
                print(f"| {var} | {row} | {len(insns)} | {len(insns) / ELEMS:.2f} | "
                      f"{cyc if cyc is not None else '-'} | {bpc} | "
                      f"{f'{t:.1f}' if t is not None else '-'} |")
    if ns:
        print("\nns / row: on this CPU with the rows in L1, best of 30 interleaved rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check the compiled CUDA kernels (csrc/cuda/rope.cu) in their machine code, no GPU needed.

    python scripts/cuda_sass_check.py [--cuobjdump PATH] [--json FILE] OBJECT...

Each OBJECT is rope.cu compiled for one architecture with its PTX embedded (cuda_compile.sh
builds builddir-cuda/rope.sm_XX.o so).  For every posenc kernel it reads the register and
stack use (cuobjdump -res-usage), the launch bounds (the PTX's .maxntid / .minnctapersm) and
the SASS, prints one line per kernel, and fails (exit status 1) when:

- a kernel name cannot be demangled (c++filt, from binutils, is required: the rules below
  read the template arguments);
- a kernel has a stack frame or local memory (LDL/STL: spills, or arrays indexed at run time);
- a kernel uses more registers than its launch bounds allow (65536 / (threads * blocks));
- a vector variant of the apply kernel (16-byte rows) stores anything but 128-bit words, or
  loads q and k (its streaming loads) in anything but 128-bit words, or, with tables of its
  own dtype, loads them in anything but 128-bit words;
- any kernel has a fused multiply-add (FFMA, DFMA, HFMA2 other than the register-zeroing
  HFMA2.MMA idiom), a flush-to-zero operation (.FTZ; F2I aside) or a fast-math unit
  instruction (MUFU other than MUFU.RCP: integer division uses both): the per-element math
  must be the CPU's, rounded op by op;
- an apply kernel has no FMUL or DMUL (the rotation was compiled away);
- a vector variant of the apply kernel uses a loaded value before its group's last q/k or
  table load is issued (a dependent memory trip, below);
- an instruction budget is exceeded (every 16-bit V = 8 apply kernel: BUDGET_16BIT_V8), or a
  vector apply variant is estimated to be bound by instruction issue rather than memory on an
  H200 (see below).

Per apply kernel it also prints the instruction counts: the whole kernel (every SASS
instruction, as cuobjdump lists it) and an estimate of one group (one iteration of the
grid-stride loop) for the benchmark's shape, Qwen2-VL-7B (28 q + 4 k heads, head_dim 128,
half pairing, T = 32768): the instructions a thread issues per group are the longest path
through the loop's body, each inner loop's body counted once and the branches on a warp
vote (the rare NaN and large-angle paths) left out, times the items each thread holds (for
the one-element variants, an upper bound); the rotate-and-store path is that path from its
first FMUL/DMUL after the last barrier on (rotation, rounding, NaN test, addresses,
stores), per element its unpredicated stores write.  Per SM, issue takes warps *
instructions / (4 schedulers * 1.98 GHz) and memory bytes / (4.3 TB/s measured copy / 132
SMs).  Issue at most ISSUE_SHARE of the memory time leaves the kernel memory-bound even at
that issue efficiency.

Memory trips: on the group path up to its first global store (the first item's loads and
their uses), a load's result is waited for where an instruction first reads one of its
registers; each load issued after such a wait starts another round trip to memory.  One
trip is the rule for the vector variants (q/k and table loads; with positions, their pos and
inv_freq loads follow the q/k loads and may come after a wait).  With B blocks resident per
SM (by registers) and `trips` trips per group, the kernel stays at copy speed while the
loaded memory latency is below (B * memory time - issue time) / trips per group: printed as
the latency bound.  --json writes every kernel's figures.

cuobjdump comes from --cuobjdump, $CUOBJDUMP, the directory of nvcc, PATH, or the
nvidia-cuda-cuobjdump wheel in .venv/cuda-tools (make cuda-compile installs it there).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGISTERS_PER_SM = 65536

# H200 (SXM): the figures of the estimate
SMS = 132
CLOCK_HZ = 1.98e9
SCHEDULERS = 4
COPY_BYTES_PER_S = 4.3e12  # device-to-device copy, bytes read + written
ISSUE_SHARE = 0.5

# The benchmark's shape: Qwen2-VL-7B text attention, one sequence of T tokens.
BENCH = {"hq": 28, "hk": 4, "d": 128, "r": 128, "t": 32768}
THREADS, HEADS_PER_THREAD = 256, 4

STORAGE = {"float": 4, "double": 8, "Bf16": 2, "F16": 2}

# The most SASS instructions of a 16-bit V = 8 apply kernel (bf16 and fp16, 32- and 64-bit
# offsets, tables and positions): 60% of the 3,808 of the bf16 tables kernel before the
# conversions were the hardware's and the tables were read straight into registers.
BUDGET_16BIT_V8 = 2300
THREADS_PER_SM = 2048

CONTROL = ("BRA", "BRX", "JMX", "JMP", "EXIT", "RET", "KILL")


@dataclass
class Ins:
    addr: int
    pred: str  # guard predicate ("" when none), e.g. "!P0" or "UP1"
    op: str
    args: str

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


@dataclass
class Kernel:
    mangled: str
    name: str = ""
    regs: int = 0
    stack: int = 0
    local: int = 0
    max_threads: int | None = None
    min_blocks: int | None = None
    code: list[Ins] = field(default_factory=list)
    ops: collections.Counter = field(default_factory=collections.Counter)
    bad: list[str] = field(default_factory=list)

    @property
    def args(self) -> list[str]:
        """Template arguments of the kernel, as demangled."""
        m = re.search(r"<(.*)>\s*\(", self.name)
        if not m:
            return []
        return _split_top_level(m.group(1), "<", ">")

    @property
    def is_apply(self) -> bool:
        return "rope_apply_kernel<" in self.name

    @property
    def vector(self) -> int:
        return int(self.args[2]) if self.is_apply else 0

    @property
    def storage(self) -> int | None:
        return STORAGE.get(self.args[1]) if self.is_apply else None

    @property
    def own_dtype_tables(self) -> bool:
        return self.is_apply and len(self.args) > 4 and self.args[4] == f"Tables<{self.args[1]}>"

    def count(self, prefix: str) -> dict[str, int]:
        return {op: n for op, n in sorted(self.ops.items()) if op.startswith(prefix)}


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
    """Readable names; fails rather than guessing when c++filt is missing or gives none."""
    cxxfilt = shutil.which(os.environ.get("CXXFILT") or "c++filt")
    if not cxxfilt:
        raise SystemExit("cuda_sass_check: c++filt not found (binutils; or set CXXFILT): the "
                         "checks read the kernels' template arguments from their demangled names")
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    if len(out) != len(names):
        raise SystemExit(f"cuda_sass_check: {cxxfilt} returned {len(out)} names for {len(names)}")
    result = {}
    for n, d in zip(names, out):
        if d == n and n.startswith("_Z"):
            raise SystemExit(f"cuda_sass_check: {cxxfilt} could not demangle {n}")
        result[n] = re.sub(r"\(anonymous namespace\)::|pe_cuda::", "", d)
    return result


INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@(!?U?P\w+)\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


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
        ins = INS.search(line)
        if cur is None or not ins:
            continue
        i = Ins(int(ins.group(1), 16), ins.group(2) or "", ins.group(3), ins.group(4))
        cur.code.append(i)
        op, args, base = i.op, i.args, i.base
        cur.ops[op] += 1
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


# ---- control flow -----------------------------------------------------------------------

def _target(i: Ins) -> int | None:
    m = re.search(r"0x([0-9a-f]+)\s*$", i.args.strip())
    return int(m.group(1), 16) if m and i.base in ("BRA", "CALL", "JMP") else None


def _conditional(i: Ins) -> bool:
    # a guard, a predicate operand (BRA P1, target / BRA.U !UP0, target) or a divergence test
    return bool(i.pred) or ".DIV" in i.op or bool(re.match(r"\s*!?U?P\d", i.args))


def _guard(i: Ins) -> str | None:
    if i.pred:
        return i.pred.lstrip("!")
    m = re.match(r"\s*!?(U?P\d+)", i.args)
    return m.group(1) if m else None


@dataclass
class Block:
    start: int
    code: list[Ins]
    succ: list[tuple[int, bool]] = field(default_factory=list)  # (start, cold)


def _subroutines(code: list[Ins]) -> set[int]:
    """Targets of CALL that are subroutines (placed after the kernel's last EXIT: integer
    division); a CALL into the body is a jump (the compiler's loop exits on sm_80)."""
    last_exit = max((i.addr for i in code if i.base == "EXIT"), default=-1)
    return {t for i in code if i.base == "CALL" and (t := _target(i)) is not None and t > last_exit}


def blocks_of(code: list[Ins]) -> dict[int, Block]:
    subs = _subroutines(code)
    jumps = {i.addr for i in code if i.base == "CALL" and _target(i) not in subs}
    leaders = {code[0].addr} if code else set()
    for n, i in enumerate(code):
        t = _target(i)
        if t is not None:
            leaders.add(t)
        if (i.base in CONTROL or i.addr in jumps) and n + 1 < len(code):
            leaders.add(code[n + 1].addr)
    blocks: dict[int, Block] = {}
    cur: list[Ins] = []
    for i in code:
        if i.addr in leaders and cur:
            blocks[cur[0].addr] = Block(cur[0].addr, cur)
            cur = []
        cur.append(i)
    if cur:
        blocks[cur[0].addr] = Block(cur[0].addr, cur)
    starts = sorted(blocks)
    index = {i.addr: n for n, i in enumerate(code)}
    for n, s in enumerate(starts):
        b = blocks[s]
        last = b.code[-1]
        nxt = starts[n + 1] if n + 1 < len(starts) else None
        t = _target(last)
        jump = last.base == "BRA" or last.addr in jumps
        # a branch on a warp vote (the rare NaN path): the edge into the rare side is cold
        vote = jump and _vote_guarded(code, index[last.addr])
        negated = (last.pred or last.args.strip()).startswith("!")
        if jump and t is not None:
            b.succ.append((t, vote and not negated))
        falls = (last.base not in CONTROL and not jump) or _conditional(last)
        if falls and nxt is not None and last.base != "RET":
            b.succ.append((nxt, vote and negated))
    return blocks


def _vote_guarded(code: list[Ins], n: int) -> bool:
    """Instruction n, a branch, tests a warp vote's predicate: written by a VOTE, or by a
    predicate operation (PLOP3) of one, within the 64 instructions before it."""
    g = _guard(code[n])

    def from_vote(pred: str | None, n: int, depth: int) -> bool:
        if not pred or pred == "PT":
            return False
        for m in range(n - 1, max(-1, n - 65), -1):
            i = code[m]
            args = [a.strip().lstrip("!") for a in i.args.split(",")]
            if pred in args[:2]:
                if i.base in ("VOTE", "VOTEU"):
                    return True
                return depth > 0 and i.base in ("PLOP3", "UPLOP3") and any(
                    from_vote(a, m, depth - 1) for a in args[2:] if re.fullmatch(r"U?P\d", a))
        return False

    return from_vote(g, n, 2)


def call_costs(code: list[Ins]) -> dict[int, int]:
    """Instructions from each subroutine's start to its RET (64-bit division)."""
    by_addr = {i.addr: n for n, i in enumerate(code)}
    costs = {}
    for t in _subroutines(code):
        if t in by_addr:
            n = by_addr[t]
            while n < len(code) and code[n].base != "RET":
                n += 1
            costs[t] = n - by_addr[t] + 1
    return costs


def group_path(k: Kernel) -> list[Block] | None:
    """Longest path through the grid-stride loop's body (inner loop bodies once, vote-guarded
    branches left out): the blocks a thread runs per group of the benchmark shape."""
    blocks = blocks_of(k.code)
    calls = call_costs(k.code)
    preds: dict[int, list[int]] = collections.defaultdict(list)
    back = []
    for s, b in blocks.items():
        for t, _ in b.succ:
            preds[t].append(s)
            if t <= s:
                back.append((s, t))
    if not back:
        return None
    latch, head = max(back, key=lambda e: e[0] - e[1])  # the outermost loop
    body, todo = {head, latch}, [latch]
    while todo:  # its natural loop: what reaches the latch without passing the head
        for p in preds[todo.pop()]:
            if p not in body:
                body.add(p)
                todo.append(p)

    def weight(b: Block) -> int:
        return len(b.code) + sum(calls.get(_target(i), 0) for i in b.code if i.base == "CALL")

    def forward(s: int) -> list[int]:
        """Successors of s in the acyclic order: forward edges, and an inner loop's back edge
        replaced by its header's exits past s (a loop tested at the top leaves there)."""
        out = []
        for t, cold in blocks[s].succ:
            if cold:
                continue
            if t > s:
                out.append(t)
            elif t != head:
                out += [x for x, c in blocks[t].succ if not c and x > s]
        return [t for t in out if t in body]

    best, prev = {head: weight(blocks[head])}, {}
    for s in sorted(body):  # forward edges go to higher addresses: a topological order
        if s not in best:
            continue
        for t in forward(s):
            if best[s] + weight(blocks[t]) > best.get(t, 0):
                best[t] = best[s] + weight(blocks[t])
                prev[t] = s
    if latch not in best:
        return None
    path = [latch]
    while path[-1] in prev:
        path.append(prev[path[-1]])
    return [blocks[s] for s in reversed(path)]


def path_length(k: Kernel, path: list[Block]) -> int:
    calls = call_costs(k.code)
    return sum(len(b.code) + sum(calls.get(_target(i), 0) for i in b.code if i.base == "CALL")
               for b in path)


def stored_elements(k: Kernel, code: list[Ins]) -> int:
    """Elements the global stores of `code` write: the unpredicated ones, and the 128-bit
    ones (a vector's partner chunk is stored under a predicate: whether it has one)."""
    es, n = k.storage or 1, 0
    for i in code:
        if i.base == "STG" and (not i.pred or i.op.endswith(".128")):
            m = re.search(r"\.(64|128)$", i.op)
            width = int(m.group(1)) // 8 if m else (2 if ".U16" in i.op else 4)
            n += max(1, width // es)
    return n


def rotate_path(k: Kernel) -> tuple[int, int] | None:
    """(instructions, elements stored) of the group path from its first rotation (the first
    block with an FMUL or DMUL after the last barrier) on: rotation, rounding, NaN test,
    addresses and stores."""
    path = group_path(k)
    if not path:
        return None
    bar = max((n for n, b in enumerate(path) if any(i.base == "BAR" for i in b.code)), default=0)
    first = next((n for n, b in enumerate(path)
                  if n >= bar and any(i.base in ("FMUL", "DMUL") for i in b.code)), None)
    if first is None:
        return None
    tail = path[first:]
    stored = stored_elements(k, [i for b in tail for i in b.code])
    return (path_length(k, tail), stored) if stored else None


# ---- memory trips --------------------------------------------------------------------------
#
# A load's result is waited for where an instruction first reads one of its registers.  A
# load issued after such a wait cannot be in flight with the loads before it: the group
# makes another round trip to memory.  The trips of a group are counted on its path (above)
# up to its first global store, where its first item's loads and their uses are.

# instructions whose first register operand is read, not written
NO_DEST = {"ST", "STG", "STS", "STL", "RED", "BRA", "BRX", "JMX", "JMP", "RET", "CALL",
           "WARPSYNC", "BSYNC", "BSSY", "EXIT", "BAR", "NOP"}
REG = re.compile(r"(?<![A-Za-z0-9_])R(\d+)(\.64)?")


def _split_top_level(text: str, opening: str, closing: str) -> list[str]:
    """``text`` split at the commas outside ``opening``...``closing`` brackets, each piece
    stripped (the last one too, even when empty)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == opening
        depth -= ch == closing
        cur += ch
    return [*out, cur.strip()]


def _operands(args: str) -> list[str]:
    out = _split_top_level(args, "[", "]")
    return out if out[-1] else out[:-1]


def _regs(operand: str, pairs: bool) -> set[int]:
    """The registers an operand names (R2.64, and with `pairs` every register, is two)."""
    out = set()
    for m in REG.finditer(operand):
        n = int(m.group(1))
        out.update((n, n + 1) if m.group(2) or pairs else (n,))
    return out


def _written(i: Ins) -> set[int]:
    ops = _operands(i.args)
    if i.base in NO_DEST or not ops or not REG.match(ops[0]):
        return set()
    n = int(REG.match(ops[0]).group(1))
    if i.base == "LDG":
        m = re.search(r"\.(64|128)$", i.op)
        return set(range(n, n + (int(m.group(1)) // 32 if m else 1)))
    wide = i.base.startswith("D") or ".WIDE" in i.op or ".64" in i.op or ".F64" in i.op
    return {n, n + 1} if wide else {n}


def _read(i: Ins) -> set[int]:
    ops = _operands(i.args)
    if not (i.base in NO_DEST or not ops or not REG.match(ops[0])):
        ops = ops[1:]
    pairs = i.base.startswith("D")
    return set().union(*(_regs(o, pairs) for o in ops)) if ops else set()


@dataclass
class Trips:
    trips: int        # batches of loads, each issued after a wait for an earlier one
    loads: int        # global loads of the group up to its first store
    first_wait: int   # loads issued before the first wait
    late: list[str]   # q/k and table loads issued after a wait (as written in the SASS)


def _group_load(k: Kernel, i: Ins) -> bool:
    """A q/k load (streaming) or, in a tables variant, a table load."""
    return ".EF" in i.op or (len(k.args) > 4 and k.args[4].startswith("Tables<"))


def trips(k: Kernel) -> Trips | None:
    """The memory trips of the group path up to its first global store."""
    path = group_path(k)
    if not path:
        return None
    code = [i for b in path for i in b.code]
    end = next((n for n, i in enumerate(code) if i.base == "STG"), len(code))
    pending: set[int] = set()
    count = loads = 0
    first_wait = None
    waited = True  # the first load starts the first trip
    late = []
    for i in code[:end]:
        read = _read(i)
        if pending & read:
            pending -= read
            waited = True
            if first_wait is None:
                first_wait = loads
        if i.base != "LDG":
            pending -= _written(i)
            continue
        loads += 1
        if waited:
            count += 1
            waited = False
        if first_wait is not None and _group_load(k, i):
            late.append(f"{i.op}{i.args}".strip())
        pending |= _written(i)
    return Trips(count, loads, loads if first_wait is None else first_wait, late)


# ---- the estimate ---------------------------------------------------------------------------

@dataclass
class Estimate:
    instr: int          # per thread and group, all its items
    warps: int          # per group
    tokens: int         # per group
    issue_us: float     # per group
    memory_us: float    # per group
    call_issue_ms: float
    call_memory_ms: float
    blocks: int = 0     # resident per SM (by registers)
    trips: int = 0      # memory trips per group
    latency_us: float = 0.0  # the loaded latency up to which the group stays at copy speed

    @property
    def share(self) -> float:
        return self.issue_us / self.memory_us


def blocks_per_sm(k: Kernel) -> int:
    """Blocks of the launch's THREADS resident per SM, as registers allow (allocated per
    thread in multiples of 8)."""
    regs = max(8, -(-k.regs // 8) * 8)
    return max(1, min(THREADS_PER_SM // THREADS, REGISTERS_PER_SM // (regs * THREADS)))


def estimate(k: Kernel) -> Estimate | None:
    es, v = k.storage, k.vector
    blocks = group_path(k)
    if es is None or blocks is None:
        return None
    path = path_length(k, blocks)
    s = BENCH
    heads, d, r = s["hq"] + s["hk"], s["d"], s["r"]
    rot_items = r // 2 // v
    chunks = rot_items + (d - r) // v
    items = chunks * math.ceil(heads / HEADS_PER_THREAD)
    lanes = items if items <= THREADS else (THREADS // chunks * chunks if chunks <= THREADS
                                            else THREADS)
    tokens = THREADS // lanes
    per_thread = math.ceil(items / lanes)
    warps = math.ceil(tokens * lanes / 32)
    source = k.args[4] if len(k.args) > 4 else "Tables<" + k.args[1] + ">"
    tes = STORAGE.get(source[7:-1].strip(), es) if source.startswith("Tables<") else 0
    token_bytes = heads * d * es * 2 + (2 * r * tes if tes else 3 * 8)
    issue = warps * path * per_thread / (SCHEDULERS * CLOCK_HZ)
    memory = tokens * token_bytes / (COPY_BYTES_PER_S / SMS)
    groups = s["t"] / tokens
    blocks, tr = blocks_per_sm(k), trips(k)
    n = tr.trips if tr and tr.trips else 1
    return Estimate(path * per_thread, warps, tokens, issue * 1e6, memory * 1e6,
                    groups / SMS * issue * 1e3, s["t"] * token_bytes / COPY_BYTES_PER_S * 1e3,
                    blocks, n, (blocks * memory - issue) / n * 1e6)


def check(kernel: Kernel, arch: str) -> list[str]:
    errors = list(dict.fromkeys(kernel.bad))
    if kernel.stack or kernel.local:
        errors.append(f"stack frame {kernel.stack} B, local memory {kernel.local} B")
    if kernel.max_threads:
        limit = REGISTERS_PER_SM // (kernel.max_threads * (kernel.min_blocks or 1))
        limit = min(255, limit // 8 * 8)
        if kernel.regs > limit:
            errors.append(f"{kernel.regs} registers, launch bounds allow {limit}")
    if kernel.is_apply and not any(i.base in ("FMUL", "DMUL") for i in kernel.code):
        errors.append("no FMUL or DMUL: the rotation is missing")
    if kernel.is_apply and kernel.vector > 1:
        narrow = {op: n for op, n in kernel.count("STG").items() if not op.endswith("128")}
        if narrow:
            errors.append(f"stores narrower than 128 bits in a vector variant: {narrow}")
        streaming = {op: n for op, n in kernel.count("LDG").items() if ".EF" in op}
        if not streaming:
            errors.append("no streaming (q/k) loads found in a vector variant")
        narrow = {op: n for op, n in streaming.items() if not op.endswith("128")}
        if narrow:
            errors.append(f"q/k loads narrower than 128 bits in a vector variant: {narrow}")
        if kernel.own_dtype_tables:
            narrow = {op: n for op, n in kernel.count("LDG").items() if not op.endswith("128")}
            if narrow:
                errors.append(f"table loads narrower than 128 bits with tables of the "
                              f"kernel's dtype: {narrow}")
        tr = trips(kernel)
        if tr and tr.late:
            errors.append(f"dependent memory trip: a loaded value is used before the group's "
                          f"last q/k or table load is issued ({tr.trips} trips; issued after "
                          f"a wait: {'; '.join(tr.late[:3])})")
        est = estimate(kernel)
        if est and est.share > ISSUE_SHARE:
            errors.append(f"estimated issue time {est.issue_us:.2f} us per group is "
                          f"{est.share:.0%} of the memory time {est.memory_us:.2f} us "
                          f"(at most {ISSUE_SHARE:.0%}): bound by instruction issue")
    if kernel.is_apply and kernel.storage == 2 and kernel.vector == 8 and \
            len(kernel.code) > BUDGET_16BIT_V8:
        errors.append(f"instruction budget: {len(kernel.code)} instructions, at most "
                      f"{BUDGET_16BIT_V8}")
    return errors


def summary(k: Kernel) -> dict:
    out = {"name": k.name, "regs": k.regs, "instructions": len(k.code),
           "stores": k.count("STG"), "loads": k.count("LDG")}
    if k.is_apply:
        rp = rotate_path(k)
        if rp:
            out["rotate_path"] = {"instructions": rp[0], "elements": rp[1],
                                  "per_element": round(rp[0] / rp[1], 2)}
        tr = trips(k)
        if tr:
            out["trips"] = {"trips": tr.trips, "loads": tr.loads,
                            "before_first_wait": tr.first_wait}
        est = estimate(k)
        if est:
            out["group"] = {"instructions_per_thread": est.instr, "warps": est.warps,
                            "tokens": est.tokens, "issue_us": round(est.issue_us, 3),
                            "memory_us": round(est.memory_us, 3),
                            "issue_share": round(est.share, 3),
                            "t32768_issue_ms": round(est.call_issue_ms, 4),
                            "t32768_memory_ms": round(est.call_memory_ms, 4),
                            "blocks_per_sm": est.blocks,
                            "latency_bound_us": round(est.latency_us, 2)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("objects", nargs="+", type=Path)
    ap.add_argument("--cuobjdump")
    ap.add_argument("--json", type=Path, help="write every kernel's figures to this file")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump)
    failed = 0
    record = {}
    for obj in args.objects:
        arch = m.group(0) if (m := re.search(r"sm_\d+", obj.name)) else obj.stem
        kernels = read_kernels(obj, cuobjdump)
        if not kernels:
            print(f"cuda_sass_check: no kernels found in {obj}", file=sys.stderr)
            return 1
        print(f"{obj.name}: {len(kernels)} kernels (registers, launch bounds threads x blocks "
              "per SM, SASS instructions, global stores)")
        for k in sorted(kernels.values(), key=lambda k: k.name):
            bounds = f"{k.max_threads}x{k.min_blocks or 1}" if k.max_threads else "-"
            stores = " ".join(f"{op}:{n}" for op, n in k.count("STG").items())
            print(f"  {k.regs:3d} regs  {bounds:>7}  {len(k.code):5d} ins  {k.name}  [{stores}]")
            info = summary(k)
            if "rotate_path" in info:
                rp = info["rotate_path"]
                print(f"        rotate-and-store: {rp['instructions']} instructions for "
                      f"{rp['elements']} elements, {rp['per_element']} per element")
            if "group" in info:
                g = info["group"]
                print(f"        group of {g['tokens']} tokens ({g['warps']} warps): "
                      f"{g['instructions_per_thread']} instructions per thread, issue "
                      f"{g['issue_us']:.2f} us vs memory {g['memory_us']:.2f} us per SM "
                      f"({g['issue_share']:.0%}); T=32768: {g['t32768_issue_ms']:.3f} ms issue, "
                      f"{g['t32768_memory_ms']:.3f} ms memory")
            if "trips" in info and k.vector > 1:
                t = info["trips"]
                line = (f"        memory: {t['loads']} loads in {t['trips']} trip"
                        f"{'s' if t['trips'] > 1 else ''} ({t['before_first_wait']} issued "
                        f"before the first wait)")
                if "group" in info:
                    g = info["group"]
                    line += (f"; {g['blocks_per_sm']} blocks per SM: copy speed while the "
                             f"loaded latency is under {g['latency_bound_us']:.2f} us")
                print(line)
            record.setdefault(arch, []).append(info)
            for e in check(k, arch):
                print(f"    FAIL {e}")
                failed += 1
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"cuda_sass_check: {'FAILED, ' + str(failed) + ' problems' if failed else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

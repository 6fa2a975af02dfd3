"""The shared benchmark harness: model shapes, cases, methods, timing, verification, reports.

Every ``bench_<topic>.py`` builds its inputs, describes what each method does as a
:class:`Workload`, and hands the methods of one case to :func:`run_case`, which

1. derives the timed callable for the mode (forward, backward, forward+backward),
2. calls it once and records that first call separately (for ``torch.compile`` methods it
   holds the compilation, which is therefore never part of a timing),
3. checks the output of that call against the reference (transformers' own eager result)
   and refuses to time a method whose output is wrong,
4. warms up and times the methods in alternating rounds: blocks of calls timed with
   ``torch.utils.benchmark.Timer`` on CPU (at the run's thread count), CUDA events on a GPU,
5. returns one :class:`Result` per method: median, p10/p90, IQR and minimum of the samples,
   and the paired (round-by-round) median ratios to the copy floor and to posenc_torch.

Why rounds: the machines this runs on are often shared.  Timing method A for a second and
then method B for a second lets a burst of someone else's work land on one of them only;
alternating blocks spreads it over all, and the per-round ratios cancel most of it.

Timing of the modes (what each number means):

- ``fwd``: the method's forward under ``torch.no_grad()`` (inference; nothing is saved).
- ``bwd``: one forward with autograd recording is run outside the timing; the timed call is
  ``torch.autograd.grad(outputs, (q, k), grad_outputs, retain_graph=True)`` on that graph, so
  only the backward pass is timed.  Gradients are taken with respect to the (B, H, T, D)
  views of q and k that the rotation receives, so the projection's reshape is not included.
- ``fwdbwd``: forward with autograd recording plus that backward, both timed together.

Two memory floors are timed in every case, on the same tensors in the same layout (q, k for
the forward, the two incoming gradients for the backward, all four for forward+backward):

- "copy" (the *clone* floor): ``q.clone(); k.clone()`` — allocates its outputs, as every
  method does.  On a CPU a fresh large allocation is served by new pages that fault on first
  touch, so this floor includes the allocator's page-fault cost, which varies with the
  allocator's state (the same clone can take 4x longer in one process than in another).
- "copy_into" (the *copy_* floor): ``q_out.copy_(q); k_out.copy_(k)`` into tensors allocated
  once beforehand — the bandwidth limit, without allocation.

Ratio columns name their floor: ``x clone`` (``ratio_to_copy``) and ``x copy_``
(``ratio_to_copy_into``).  GB/s counts the floor's bytes (read the inputs, write the
outputs; cos/sin tables, positions and temporaries are not counted), so GB/s is comparable
between methods.

A topic module (``bench_<topic>.py``) depends on this harness only, never on run.py or on
another topic's private names, and provides:

- ``TOPIC``: its name in ``run.py --topics``; ``PARTS``: ``{part: transformers major}``
  (each part runs in its own process, under that transformers version);
- ``plan(opts) -> [(Case, method names)]``: what ``run(opts, rep)`` will report, in order;
- ``run(opts, rep)``: builds inputs, calls :func:`run_case` per case, ``rep.add`` per result;
- ``if __name__ == "__main__": sys.exit(H.worker_main(sys.modules[__name__]))``.

run.py imports the topic modules listed in its ``TOPICS`` and runs their parts as workers.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

MODES = ("fwd", "bwd", "fwdbwd")
MODE_LABEL = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Relative tolerance of the pre-timing check: max |out - ref| / max |ref|.  A method that
# computes the rotation wrongly is off by O(1); rounding differences between correct
# implementations (one rounding vs HF eager's three, cos/sin kept in fp32) stay far below.
VERIFY_TOL = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 5e-3}

PROGRESS_MARK = "@@progress "


# ---------------------------------------------------------------------------------------
# The one table of model shapes.


@dataclass(frozen=True)
class Model:
    """Attention shapes of a real model (only what the rotary step sees)."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...] | None = None
    interleaved: bool = False
    note: str = ""


MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        Model("Llama-3-8B", 32, 8, 128, 500000.0, note="text RoPE"),
        Model("Qwen2-VL-7B", 28, 4, 128, 1000000.0, (16, 24, 24),
              note="MRoPE in sections; Qwen2.5-VL-7B has the same text shapes"),
        Model("Qwen3-VL-8B", 32, 8, 128, 5000000.0, (24, 20, 20), interleaved=True,
              note="interleaved MRoPE"),
        Model("Qwen2-VL-ViT", 16, 16, 80, 10000.0,
              note="vision tower: (patches, heads, 80), apply_rotary_pos_emb_vision"),
        Model("Qwen3-Next-80B-A3B", 16, 2, 256, 10000000.0,
              note="the Qwen3.5 / Qwen3-Next attention: (1 + w) q/k norm, rotary 64 of 256"),
        Model("Gemma-3-12B", 16, 8, 256, 1000000.0, note="(1 + w) q/k norm"),
    )
}

SEQ_FULL = (1024, 2048, 4096, 8192, 16384, 32768)
DECODE_BATCH = 8
BOTH = ("fp32", "bf16")


@dataclass(frozen=True)
class Sweep:
    """One line of a topic's plan: these sequence lengths x dtypes x modes for one model."""

    model: str
    batch: int
    seqs: tuple[int, ...]
    dtypes: tuple[str, ...] = BOTH
    modes: tuple[str, ...] = ("fwd", "bwd", "fwdbwd")
    op: str = ""

    def groups(self):
        """(op, model, batch, seq, dtype, modes) per input group, dtype-major."""
        return [(self.op, self.model, self.batch, t, dt, self.modes)
                for dt in self.dtypes for t in self.seqs]


def expand(sweeps: Sequence[Sweep], seqs: Sequence[int] | None = None):
    """The input groups of a plan; ``seqs`` (``run.py --seq``) replaces the sequence
    lengths of every sweep except the decode steps (T = 1)."""
    if seqs:
        sweeps = [s if s.seqs == (1,) else dataclasses.replace(s, seqs=tuple(seqs))
                  for s in sweeps]
    return [g for s in sweeps for g in s.groups()]


def decode(model: str, dtypes: tuple[str, ...] = BOTH, op: str = "") -> Sweep:
    """The decode step: B=8, T=1, forward only."""
    return Sweep(model, DECODE_BATCH, (1,), dtypes, ("fwd",), op)


# ---------------------------------------------------------------------------------------
# Cases, methods, results.


@dataclass(frozen=True)
class Case:
    """One measured configuration.

    ``name`` reads like ``MROPE(Qwen2-VL-7B,B=1,T=4096,bf16,fwd,thr=2)``.
    """

    topic: str
    op: str
    model: str
    batch: int
    seq: int
    dtype: str
    mode: str
    threads: int
    device: str = "cpu"
    extra: str = ""

    @property
    def name(self) -> str:
        extra = f",{self.extra}" if self.extra else ""
        return (f"{self.op.upper()}({self.model},B={self.batch},T={self.seq}{extra},"
                f"{self.dtype},{self.mode},thr={self.threads})")


@dataclass(frozen=True)
class Method:
    """A way of computing an op.  ``role``: "posenc" (ours), "peer" or "floor" (copy)."""

    name: str
    label: str
    role: str
    needs_cuda: bool = False


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("posenc", "posenc_torch", "posenc"),
        Method("posenc_fused", "posenc_torch apply_rope (fused, positions in)", "posenc"),
        Method("posenc_tables", "posenc_torch compute_mrope_cos_sin + apply", "posenc"),
        Method("hf_eager", "transformers eager", "peer"),
        Method("hf_compile", "torch.compile(transformers)", "peer"),
        Method("liger", "Liger-Kernel", "peer", needs_cuda=True),
        Method("posenc_op", "torch.ops.posenc.rope alone (dispatcher call)", "posenc"),
        Method("hf_norm_posenc_rotary", "transformers q/k norm + posenc_torch rotary", "peer"),
        Method("posenc_unfused", "posenc_torch.hf.patch(fuse_qk_norm=False): transformers' "
               "q/k norm + posenc_torch rotary in the layer", "peer"),
        Method("copy", "clone q,k (allocating floor)", "floor"),
        Method("copy_into", "copy_ into preallocated q,k (bandwidth floor)", "floor"),
    )
}
FLOORS = ("copy", "copy_into")


def posenc_has_cuda() -> bool:
    """Whether the installed posenc_torch has its CUDA kernels."""
    import posenc_torch

    return bool(posenc_torch._C.has_cuda())


def method_unavailable(method: Method, device: str) -> str | None:
    """Why ``method`` cannot run on ``device`` (None when it can)."""
    if method.needs_cuda and device != "cuda":
        return "Liger-Kernel is Triton (GPU) code; skipped on a CPU run"
    if method.role == "posenc" and device == "cuda" and not posenc_has_cuda():
        return ("posenc_torch was built without its CUDA kernels (meson -Dcuda=enabled; "
                "scripts/gpu_check.sh build)")
    if method.name == "liger":
        try:
            import liger_kernel  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
            return f"Liger-Kernel is not importable ({type(exc).__name__}: {exc})"
    return None


@dataclass
class Workload:
    """What one method does on one case's inputs.

    ``forward`` runs the method and returns its outputs.  ``wrt``/``grad_outputs`` define the
    backward (gradients of ``forward``'s outputs with respect to ``wrt``).  ``timed`` replaces
    the derived callable for some modes (used by "copy").  ``verify=False`` skips the output
    check (only for the copy floor, which does not compute the op).
    """

    forward: Callable[[], Sequence[torch.Tensor]] | None = None
    wrt: Sequence[torch.Tensor] = ()
    grad_outputs: Sequence[torch.Tensor] = ()
    timed: dict[str, Callable[[], object]] = field(default_factory=dict)
    verify: bool = True
    compiled: bool = False


@dataclass
class Result:
    """What one method measured on one case: a row of the results file (``to_dict``: the
    case's fields, then these; the case's fields also read as attributes, ``r.seq``)."""

    case: Case
    method: str
    status: str  # "ok", "skipped", "failed"
    reason: str = ""
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    iqr_ms: float | None = None
    min_ms: float | None = None
    samples: int = 0
    floor_bytes: int | None = None
    gbps: float | None = None
    first_call_s: float | None = None
    max_rel_err: float | None = None
    transformers: str = ""
    ratio_to_copy: float | None = None       # time / clone-floor time (paired)
    posenc_speedup: float | None = None
    ratio_to_copy_into: float | None = None  # time / copy_-floor time (paired)
    kernel_ms: float | None = None  # GPU time of one call alone (CUDA-graph replay)
    saved_bytes_per_element: float | None = None  # kept for backward per q/k element (qknorm)
    # time / copy_-floor time, single calls back to back per round (measure_pairs; median)
    ratio_pair_copy_into: float | None = None

    @classmethod
    def for_case(cls, case: Case, method: str, status: str, **kw) -> Result:
        return cls(case, method, status, **kw)

    @property
    def case_key(self) -> tuple:
        return dataclasses.astuple(self.case)

    @staticmethod
    def row_fields() -> list[str]:
        """The columns of a results row, in order."""
        return ([f.name for f in dataclasses.fields(Case)] +
                [f.name for f in dataclasses.fields(Result) if f.name != "case"])

    def to_dict(self) -> dict:
        """The flat row written to the results files."""
        row = dataclasses.asdict(self.case)
        row.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                   if f.name != "case")
        return row

    @classmethod
    def from_dict(cls, row: dict) -> Result:
        case = Case(**{f.name: row[f.name] for f in dataclasses.fields(Case) if f.name in row})
        rest = {f.name: row[f.name] for f in dataclasses.fields(cls)
                if f.name != "case" and f.name in row}
        return cls(case, **rest)


def _case_attribute(name: str) -> property:
    return property(lambda self: getattr(self.case, name), doc=f"the case's {name}")


for _name in (f.name for f in dataclasses.fields(Case)):
    setattr(Result, _name, _case_attribute(_name))


# ---------------------------------------------------------------------------------------
# Inputs as transformers makes them.


def qk_as_hf(batch: int, seq: int, model: Model, dtype: torch.dtype, device: str = "cpu",
             requires_grad: bool = True, generator: torch.Generator | None = None):
    """q (B, Hq, T, D) and k (B, Hkv, T, D) as HF attention passes them.

    The projection outputs (B, T, H*D) are viewed as (B, T, H, D) and transposed, so q and k
    are non-contiguous views.  Returns ``(q_proj, k_proj, q, k)``; the projections are the
    leaves (requiring grad when asked), q and k are the views the rotation gets.
    """
    d = model.head_dim
    q_proj = torch.randn(batch, seq, model.heads * d, generator=generator).to(device, dtype)
    k_proj = torch.randn(batch, seq, model.kv_heads * d, generator=generator).to(device, dtype)
    q_proj.requires_grad_(requires_grad)
    k_proj.requires_grad_(requires_grad)
    q = q_proj.view(batch, seq, model.heads, d).transpose(1, 2)
    k = k_proj.view(batch, seq, model.kv_heads, d).transpose(1, 2)
    return q_proj, k_proj, q, k


def floor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the copy floor: read every tensor once and write it once."""
    return 2 * sum(t.numel() * t.element_size() for t in tensors)


def rope_tables(model: Model, t: int, dtype: torch.dtype, rotary: int | None = None):
    """(1, T, R) RoPE tables of positions 0..T-1 in ``dtype``, as the rotary modules give
    them; R is ``rotary`` (a partial rotary) or the head dim."""
    r = rotary or model.head_dim
    inv_freq = 1.0 / model.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def saved_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor):
        st = x.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(seen.values())


def copy_workload(fwd_in: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  preallocated: bool = False) -> Workload:
    """A memory floor: copy the same tensors in the same layout, into fresh tensors
    (``clone``, the "copy" floor) or into tensors allocated once here (``copy_``, the
    "copy_into" floor)."""
    if preallocated:
        outs = {id(t): torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                for t in (*fwd_in, *grads)}

        def copy(ts):
            with torch.no_grad():
                return tuple(outs[id(t)].copy_(t) for t in ts)
    else:
        def copy(ts):
            with torch.no_grad():
                return tuple(t.clone() for t in ts)

    return Workload(timed={"fwd": lambda: copy(fwd_in), "bwd": lambda: copy(grads),
                           "fwdbwd": lambda: copy((*fwd_in, *grads))}, verify=False)


def floor_workload(name: str, fwd_in: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor]) -> Workload:
    """The workload of floor method ``name`` ("copy" or "copy_into")."""
    if name not in FLOORS:
        raise KeyError(name)
    return copy_workload(fwd_in, grads, preallocated=name == "copy_into")


def compile_fn(fn: Callable, **kw) -> Callable:
    """``torch.compile`` with a clean Dynamo cache, so every case compiles once from scratch
    for its own static shapes (no accumulated guards, no automatic dynamic shapes)."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, **kw)


def configure_dynamo() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))


# ---------------------------------------------------------------------------------------
# Timing.


@dataclass(frozen=True)
class TimingPolicy:
    min_run_time: float = 0.2  # seconds of timed calls per method and case, at least
    min_rounds: int = 5        # at least this many samples (rounds) per method
    max_time: float = 30.0     # stop adding rounds for a case past this (very slow methods)
    block_time: float = 0.01   # a sample times enough calls to take about this long
    warmup: int = 2            # calls after the first (compile) call, before timing
    pair_rounds: int = 0       # rounds of single calls, copy_ and each method back to back
                               # (measure_pairs; the floor topic), 0: none


QUICK = TimingPolicy()
FULL = TimingPolicy(min_run_time=1.0, min_rounds=10, max_time=90.0, warmup=3)
SMOKE = TimingPolicy(min_run_time=0.0, min_rounds=3, max_time=2.0, block_time=0.001, warmup=1)
POLICIES = {"quick": QUICK, "full": FULL, "smoke": SMOKE}
#: pair_rounds of each suite where a topic asks for paired calls (Options.paired)
PAIR_ROUNDS = {"quick": 40, "full": 100, "smoke": 3}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Sampler:
    """Times blocks of ``number`` calls of one callable.

    CPU: ``torch.utils.benchmark.Timer`` with the run's thread count (Timer's own default is
    one thread).  CUDA: CUDA events around the block, after a synchronize.
    """

    def __init__(self, fn: Callable[[], object], device: str, block_time: float):
        self.fn, self.device = fn, device
        if device != "cuda":
            from torch.utils.benchmark import Timer
            self.timer = Timer(stmt="fn()", globals={"fn": fn},
                               num_threads=torch.get_num_threads())
        t0 = time.perf_counter()
        fn()
        _sync(device)
        once = max(time.perf_counter() - t0, 1e-7)
        self.number = max(1, min(10000, int(block_time / once)))

    def sample(self) -> float:
        """Seconds per call, averaged over one block."""
        if self.device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(self.number):
                self.fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / self.number
        return self.timer.timeit(self.number).mean


def measure_interleaved(fns: dict[str, Callable[[], object]], device: str,
                        policy: TimingPolicy) -> dict[str, list[float]]:
    """Seconds per call for each callable, one sample per round.

    The methods of a case are timed in alternation (round r times every method once, in a
    rotating order), so a change in background load hits all of them alike, and ratios
    between methods can be taken round by round (paired), which is what the report does.
    """
    samplers = {name: Sampler(fn, device, policy.block_time) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    t0 = time.perf_counter()
    rounds = 0
    while True:
        shift = rounds % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            samples[name].append(samplers[name].sample())
        rounds += 1
        spent = min((sum(v) * samplers[n].number for n, v in samples.items()), default=0.0)
        elapsed = time.perf_counter() - t0
        if rounds >= policy.min_rounds and spent >= policy.min_run_time:
            break
        if rounds >= 3 and elapsed > policy.max_time:
            break
    return samples


def measure_pairs(fn: Callable[[], object], floor_fn: Callable[[], object], device: str,
                  rounds: int, times: list[tuple[float, float]] | None = None) -> list[float]:
    """fn's time over floor_fn's, one ratio per round: each round times one call of each,
    back to back (floor first in even rounds, fn first in odd ones), so both see the same
    memory bandwidth however it moves on a shared host; the median of these ratios is what
    the floor check reads.  ``times``, if given, gets each round's (fn, floor_fn) seconds."""
    ratios = []
    for r in range(rounds):
        took = {}
        for which in ((floor_fn, fn) if r % 2 == 0 else (fn, floor_fn)):
            _sync(device)
            t0 = time.perf_counter()
            which()
            _sync(device)
            took[which] = time.perf_counter() - t0
        ratios.append(took[fn] / took[floor_fn])
        if times is not None:
            times.append((took[fn], took[floor_fn]))
    return ratios


def _quantile(sorted_x: Sequence[float], q: float) -> float:
    if len(sorted_x) == 1:
        return sorted_x[0]
    pos = q * (len(sorted_x) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_x[lo] + (sorted_x[hi] - sorted_x[lo]) * (pos - lo)


def summarize(samples: Sequence[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_ms": statistics.median(s) * 1e3,
        "p10_ms": _quantile(s, 0.10) * 1e3,
        "p90_ms": _quantile(s, 0.90) * 1e3,
        "iqr_ms": (_quantile(s, 0.75) - _quantile(s, 0.25)) * 1e3,
        "min_ms": s[0] * 1e3,
    }


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median over rounds of num[r] / den[r]."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


# ---------------------------------------------------------------------------------------
# Verification.


def _as_tensors(out) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(out)


def max_rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| over all output tensors (inf on a shape mismatch)."""
    outs, refs = _as_tensors(out), _as_tensors(ref)
    if len(outs) != len(refs):
        return math.inf
    worst = 0.0
    for o, r in zip(outs, refs, strict=True):
        if o.shape != r.shape:
            return math.inf
        r64, o64 = r.detach().double(), o.detach().double()
        scale = r64.abs().max().item() if r64.numel() else 0.0
        diff = (o64 - r64).abs().max().item() if r64.numel() else 0.0
        if not math.isfinite(diff):
            return math.inf
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def outputs_equal(out, ref) -> bool:
    """Equal shapes and values (integer results may differ in integer dtype)."""
    outs, refs = _as_tensors(out), _as_tensors(ref)
    if len(outs) != len(refs):
        return False
    for o, r in zip(outs, refs, strict=True):
        if o.shape != r.shape or o.is_floating_point() != r.is_floating_point():
            return False
        if not torch.equal(o.to(r.dtype) if o.dtype != r.dtype else o, r):
            return False
    return True


# ---------------------------------------------------------------------------------------
# Running one method on one case.


def timed_callable(work: Workload, mode: str) -> Callable[[], object]:
    """The callable that ``mode`` times (see the module docstring)."""
    if mode in work.timed:
        return work.timed[mode]
    if work.forward is None:
        raise ValueError(f"workload has no forward and no timed callable for {mode!r}")
    fwd = work.forward
    if mode == "fwd":
        def run_fwd():
            with torch.no_grad():
                return fwd()
        return run_fwd
    wrt, grads = tuple(work.wrt), tuple(work.grad_outputs)
    if mode == "bwd":
        outs = fwd()

        def run_bwd():
            return torch.autograd.grad(outs, wrt, grads, retain_graph=True)
        return run_bwd
    if mode == "fwdbwd":
        def run_fwdbwd():
            return torch.autograd.grad(fwd(), wrt, grads)
        return run_fwdbwd
    raise ValueError(f"unknown mode {mode!r}")


def run_case(case: Case, method_names: Sequence[str], build: Callable[[str], Workload],
             reference, policy: TimingPolicy, *, exact: bool = False, floor: int | None = None,
             transformers_version: str = "") -> list[Result]:
    """Build, check and time every method of one case.

    ``build(name)`` returns the method's :class:`Workload`.  ``reference`` is the expected
    output of the mode's callable (forward outputs for "fwd", gradients of (q, k) for "bwd"
    and "fwdbwd"); ``exact=True`` demands equal values, otherwise the relative tolerance
    ``VERIFY_TOL`` applies.  A method is timed only after its first call passed that check;
    the first call's duration is kept as ``first_call_s`` for compiled methods (it holds the
    compilation, which is never part of a timing).  The checked methods are then timed
    together, interleaved (see :func:`measure_interleaved`).
    """
    common = {"floor_bytes": floor, "transformers": transformers_version}
    results: dict[str, Result] = {}
    ready: dict[str, Callable[[], object]] = {}
    extra: dict[str, dict] = {}
    for name in method_names:
        method = METHODS[name]
        why = method_unavailable(method, case.device)
        if why:
            results[name] = Result.for_case(case, name, "skipped", reason=why, **common)
            continue
        try:
            t0 = time.perf_counter()
            work = build(name)
            fn = timed_callable(work, case.mode)
            out = fn()
            _sync(case.device)
            first = time.perf_counter() - t0
        except NotImplementedError as exc:
            results[name] = Result.for_case(case, name, "skipped", reason=str(exc), **common)
            continue
        except Exception as exc:  # noqa: BLE001 - a method that raises is reported, not fatal
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            results[name] = Result.for_case(case, name, "failed", reason=reason, **common)
            continue
        err = None
        if work.verify:
            if reference is None:
                results[name] = Result.for_case(case, name, "failed", **common,
                                                reason="no reference output to check against")
                continue
            if exact:
                if not outputs_equal(out, reference):
                    results[name] = Result.for_case(
                        case, name, "failed", **common,
                        reason="output differs from the reference (exact comparison); not timed")
                    continue
                err = 0.0
            else:
                err = max_rel_err(out, reference)
                tol = VERIFY_TOL[case.dtype]
                if not err <= tol:
                    results[name] = Result.for_case(
                        case, name, "failed", max_rel_err=err, **common,
                        reason=f"output differs from the reference: max rel err {err:.3g} > "
                               f"{tol:g}; not timed")
                    continue
        del out
        for _ in range(policy.warmup):
            fn()
        _sync(case.device)
        ready[name] = fn
        extra[name] = {"first_call_s": first if work.compiled else None, "max_rel_err": err}

    samples = measure_interleaved(ready, case.device, policy) if ready else {}
    ours = next((m for m in sorted(samples, key=lambda m: PRIMARY.get(m, 9)) if m in PRIMARY),
                None)
    for name, xs in samples.items():
        stats = summarize(xs)
        gbps = floor / (stats["median_ms"] * 1e-3) / 1e9 if floor else None
        r = Result.for_case(case, name, "ok", samples=len(xs), gbps=gbps, **stats,
                            **extra[name], **common)
        if "copy" in samples:
            r.ratio_to_copy = paired_ratio(xs, samples["copy"])
        if "copy_into" in samples:
            r.ratio_to_copy_into = paired_ratio(xs, samples["copy_into"])
        if ours is not None and METHODS[name].role != "posenc":
            r.posenc_speedup = paired_ratio(xs, samples[ours])
        if policy.pair_rounds and "copy_into" in ready and METHODS[name].role != "floor":
            r.ratio_pair_copy_into = statistics.median(
                measure_pairs(ready[name], ready["copy_into"], case.device, policy.pair_rounds))
        results[name] = r
    return [results[name] for name in method_names]


# ---------------------------------------------------------------------------------------
# Machine and versions (no host name).


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: Environment variable through which run.py's ``--isa`` reaches its workers.
ISA_ENV = "POSENC_BENCH_ISA"
HOST_KIND = {"avx512bf16": "AVX-512", "avx512": "AVX-512",
             "avx2": "AVX2-only", "baseline": "no AVX2"}


def apply_isa(isa: str | None = None) -> None:
    """Force posenc_torch's SIMD variant ``isa`` (default: from ISA_ENV; "best" or unset:
    the best the CPU has).  A variant the CPU lacks is a ValueError from set_kernel_isa."""
    isa = isa if isa is not None else os.environ.get(ISA_ENV, "best")
    import posenc_torch
    posenc_torch.set_kernel_isa(None if isa in ("", "best") else isa)


def kernel_info() -> dict:
    """Which kernel variant runs (``posenc_isa``), the best this CPU has, and so the kind of
    host: "AVX-512" (the AVX2 variant can still be forced there), "AVX2-only" or "no AVX2"."""
    try:
        import posenc_torch
        current = posenc_torch.kernel_isa()
        posenc_torch.set_kernel_isa(None)
        best = posenc_torch.kernel_isa()
        posenc_torch.set_kernel_isa(current)
    except Exception as exc:  # noqa: BLE001
        return {"posenc_isa": f"unavailable ({exc})"}
    return {"posenc_isa": current, "posenc_best_isa": best,
            "host_kind": HOST_KIND.get(best, best), "isa_forced": current != best}


def machine_info(device: str = "cpu") -> dict:
    info = {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": device,
    }
    info.update(kernel_info())
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions() -> dict:
    out = {"torch": torch.__version__}
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        out["transformers"] = None
    try:
        import posenc_torch
        out["posenc_torch"] = posenc_torch.__version__
    except Exception:  # noqa: BLE001
        out["posenc_torch"] = None
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version
        out["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        out["liger_kernel"] = None
    return out


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


# ---------------------------------------------------------------------------------------
# The worker side of a topic script: run one part, report progress, write results.


@dataclass
class Options:
    """What a topic script's worker gets from the driver."""

    part: str
    suite: str  # "quick", "full" or "smoke" (tiny sizes, for the harness's own test)
    threads: int
    device: str
    out: str | None
    seqs: tuple[int, ...] | None = None  # run.py --seq: sequence lengths instead of the plan's
    paired: bool = False  # also time single calls against copy_ per round (pair_rounds)

    @property
    def policy(self) -> TimingPolicy:
        policy = POLICIES[self.suite]
        if self.paired:
            policy = dataclasses.replace(policy, pair_rounds=PAIR_ROUNDS[self.suite])
        return policy


class Reporter:
    """Collects results; tells the driver (or the terminal) about progress."""

    def __init__(self, total: int, to_driver: bool):
        self.total, self.done, self.to_driver = total, 0, to_driver
        self.results: list[Result] = []
        self.bar = None if to_driver else ProgressBar(total)

    def add(self, result: Result, label: str = "") -> None:
        self.results.append(result)
        self.done += 1
        if self.to_driver:  # the result itself goes along: the driver saves it at once
            print(PROGRESS_MARK + json.dumps({"done": 1, "label": label,
                                              "result": result.to_dict()}), flush=True)
        else:
            self.bar.advance(1, label)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def worker_main(topic_module, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bench_<topic>.py``.

    With ``--part P`` (how run.py calls it) run that part in this process and write the
    results JSON; without it, run the whole topic through the driver (run.py).
    """
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--part" not in argv and not any(a.startswith("--part=") for a in argv):
        # The driver runs the topic's parts (each in its own process, with its own
        # transformers); it is started as a program, so the harness never imports it.
        import subprocess
        driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
        return subprocess.call([sys.executable, driver, "--topics", topic_module.TOPIC, *argv])
    p = argparse.ArgumentParser(description=topic_module.__doc__.splitlines()[0])
    p.add_argument("--part", help="run one part in this process (used by run.py)")
    p.add_argument("--suite", choices=tuple(POLICIES), default="quick")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--results-json", help="where the worker writes its results")
    p.add_argument("--seq", default=None, help="comma-separated sequence lengths (run.py --seq)")
    args = p.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    apply_isa()
    configure_dynamo()
    seqs = tuple(int(t) for t in args.seq.split(",")) if args.seq else None
    opts = Options(args.part, args.suite, threads, args.device, args.results_json, seqs)
    plan = topic_module.plan(opts)
    reporter = Reporter(sum(len(ms) for _, ms in plan), to_driver=args.results_json is not None)
    topic_module.run(opts, reporter)
    reporter.close()
    payload = {"results": [r.to_dict() for r in reporter.results], **kernel_info(),
               "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if args.results_json:
        with open(args.results_json, "w") as f:
            json.dump(payload, f)
    else:
        print(format_table(reporter.results))
    return 0


# ---------------------------------------------------------------------------------------
# Progress bar (stderr) and the table.


class ProgressBar:
    """A one-line progress bar on stderr; plain periodic lines when stderr is not a terminal."""

    def __init__(self, total: int, width: int = 28, stream=None):
        self.total = max(total, 1)
        self.done = 0
        self.width = width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self._last_line = 0.0
        self._last_pct = -1

    def _elapsed(self) -> str:
        s = int(time.perf_counter() - self.start)
        return f"{s // 60:02d}:{s % 60:02d}"

    def advance(self, n: int = 1, label: str = "") -> None:
        self.done = min(self.done + n, self.total)
        frac = self.done / self.total
        if self.tty:
            fill = int(frac * self.width)
            bar = "#" * fill + "-" * (self.width - fill)
            text = f"\r[{bar}] {self.done}/{self.total} {frac:4.0%} {self._elapsed()} {label}"
            cols = 120
            self.stream.write(text[:cols].ljust(cols))
            self.stream.flush()
        else:
            pct = int(frac * 10) * 10
            now = time.perf_counter()
            if pct != self._last_pct or now - self._last_line > 30:
                self._last_pct, self._last_line = pct, now
                self.stream.write(f"progress {self.done}/{self.total} ({frac:.0%}) "
                                  f"{self._elapsed()} {label}\n")
                self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line above the bar."""
        if self.tty:
            self.stream.write("\r" + " " * 120 + "\r")
        self.stream.write(text.rstrip("\n") + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def group_by_case(results: Iterable[Result]) -> dict[tuple, list[Result]]:
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        groups.setdefault(r.case_key, []).append(r)
    return groups


PRIMARY = {"posenc_fused": 0, "posenc": 1, "posenc_tables": 2}


def derive_ratios(results: list[Result]) -> None:
    """Fill ``ratio_to_copy`` / ``posenc_speedup`` where a run did not (unpaired medians)."""
    for rows in group_by_case(results).values():
        ok = {r.method: r for r in rows if r.status == "ok"}
        copy, copy_into = ok.get("copy"), ok.get("copy_into")
        ours = [ok[m] for m in sorted(ok, key=lambda m: PRIMARY.get(m, 9)) if m in PRIMARY]
        for r in rows:
            if r.status != "ok":
                continue
            if copy is not None and r.ratio_to_copy is None:
                r.ratio_to_copy = r.median_ms / copy.median_ms
            if copy_into is not None and r.ratio_to_copy_into is None:
                r.ratio_to_copy_into = r.median_ms / copy_into.median_ms
            if ours and METHODS[r.method].role != "posenc" and r.posenc_speedup is None:
                r.posenc_speedup = r.median_ms / ours[0].median_ms


def format_table(results: list[Result]) -> str:
    """The stdout table: one block per case, one line per method."""
    derive_ratios(results)
    head = (f"{'method':<15} {'median ms':>10} {'p10-p90 ms':>19} {'GB/s':>7} "
            f"{'x clone':>7} {'x copy_':>7} {'posenc faster':>13} {'1st call s':>10}  note")
    lines: list[str] = []
    for key, rows in group_by_case(results).items():
        r0 = rows[0]
        lines.append("")
        hf = f"  [transformers {r0.transformers}]" if r0.transformers else ""
        lines.append(f"== {Case(*key).name}{hf}")
        lines.append(head)
        for r in sorted(rows, key=lambda r: (METHODS[r.method].role != "posenc", r.method)):
            if r.status == "ok":
                spread = f"{r.p10_ms:.3f}-{r.p90_ms:.3f}"
                speed = f"{r.posenc_speedup:.2f}x" if r.posenc_speedup else ""
                lines.append(
                    f"{r.method:<15} {r.median_ms:>10.3f} {spread:>19} {_fmt(r.gbps, '.1f'):>7} "
                    f"{_fmt(r.ratio_to_copy, '.2f'):>7} {_fmt(r.ratio_to_copy_into, '.2f'):>7} "
                    f"{speed:>13} "
                    f"{_fmt(r.first_call_s, '.2f'):>10}"
                    + (f"  GPU {r.kernel_ms:.4f} ms a call alone" if r.kernel_ms else ""))
            else:
                lines.append(f"{r.method:<15} {r.status.upper():>10}  {r.reason}")
    return "\n".join(lines)


def results_from_dicts(rows: Iterable[dict]) -> list[Result]:
    return [Result.from_dict(row) for row in rows]


def inplace_copies(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Separate q, k for a method that writes into its inputs (same strides, own memory).

    They are non-leaf views of fresh leaves, so autograd allows the in-place writes.
    """
    def one(x):
        leaf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
        leaf.copy_(x.detach())
        if not x.requires_grad:
            return leaf
        return leaf.requires_grad_().clone()  # clone keeps the strides
    return one(q), one(k)

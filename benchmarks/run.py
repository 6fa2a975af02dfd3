"""Run the benchmark suite: posenc_torch against transformers eager, torch.compile of the
transformers functions, Liger-Kernel (GPU only) and the copy floor.

    python benchmarks/run.py                      # --quick: about 19 minutes on 2 cores
    python benchmarks/run.py --full               # the whole sequence sweep, 1 and all threads
    python benchmarks/run.py --topics rope,mrope --threads 1,all --out /tmp/bench

Each (topic, part, thread count) runs in its own Python process: the thread count is fixed
before torch starts any work, and the parts compared against transformers 4.57.6 get the
.venv/hf4 overlay first on PYTHONPATH (see bench_mrope.py).  The driver shows one progress
bar on stderr, prints the table and the target check on stdout, writes
``<out>/<suite>.json`` and ``<out>/<suite>.csv`` and draws the plots from the JSON with
plot.py into ``<out>/plots-<suite>/``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_floor  # noqa: E402
import bench_gpu  # noqa: E402
import bench_layer  # noqa: E402
import bench_mrope  # noqa: E402
import bench_overhead  # noqa: E402
import bench_packing  # noqa: E402
import bench_positions  # noqa: E402
import bench_qk_attention  # noqa: E402
import bench_qk_norm  # noqa: E402
import bench_rope  # noqa: E402
import bench_rotary_step  # noqa: E402
import bench_vision  # noqa: E402
import harness as H  # noqa: E402

# The topic registry: one module per topic (the interface is in harness.py's docstring).
TOPICS = {m.TOPIC: m for m in (
    bench_rope,
    bench_mrope,
    bench_positions,
    bench_rotary_step,
    bench_qk_norm,
    bench_qk_attention,
    bench_overhead,
    bench_layer,
    bench_packing,
    bench_vision,
    bench_floor,
    bench_gpu,
)}
DEFAULT_THREADS = {"quick": "all", "full": "1,all", "smoke": "all"}


def hf4_overlay() -> Path | None:
    """Where transformers 4.57.6 is installed as an overlay (POSENC_HF4 or .venv/hf4)."""
    env = os.environ.get("POSENC_HF4")
    path = Path(env) if env else ROOT / ".venv" / "hf4"
    return path if (path / "transformers").is_dir() else None


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def parse_threads(text: str) -> list[int]:
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        n = usable_cores() if item == "all" else int(item)
        if n < 1:
            raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {item!r}")
        if n not in out:
            out.append(n)
    return out


@dataclasses.dataclass
class Unit:
    """One worker process: a part of a topic at one thread count."""

    module: object
    part: str
    transformers_major: int
    threads: int
    planned: list  # [(Case, method names)]

    @property
    def size(self) -> int:
        return sum(len(ms) for _, ms in self.planned)

    @property
    def label(self) -> str:
        return f"{self.module.TOPIC}/{self.part} thr={self.threads}"


def _worker_env(unit: Unit, overlay: Path | None) -> dict:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and (overlay is None or Path(p).resolve() != overlay.resolve())]
    if unit.transformers_major == 4 and overlay is not None:
        paths.insert(0, str(overlay))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(unit.threads)
    env.update(getattr(unit.module, "WORKER_ENV", {}))  # e.g. the floor topic's allocator
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _unit_failed(unit: Unit, status: str, reason: str) -> list[H.Result]:
    return [H.Result.for_case(case, m, status, reason=reason)
            for case, methods in unit.planned for m in methods]


def run_unit(unit: Unit, suite: str, device: str, bar: H.ProgressBar,
             overlay: Path | None, seqs: tuple[int, ...] | None = None,
             on_result=lambda r: None) -> list[H.Result]:
    """Run one worker; ``on_result`` gets each result as the worker reports it (so that a
    run cut short keeps every finished case)."""
    if unit.transformers_major == 4 and overlay is None:
        bar.advance(unit.size, unit.label)
        return _unit_failed(unit, "skipped", "transformers 4.57.6 overlay not found "
                            "(.venv/hf4, made by `make venv`; or set POSENC_HF4)")
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "results.json"
        cmd = [sys.executable, str(Path(unit.module.__file__).resolve()), "--part", unit.part,
               "--suite", suite, "--threads", str(unit.threads), "--device", device,
               "--results-json", str(out_json)]
        if seqs:
            cmd += ["--seq", ",".join(map(str, seqs))]
        proc = subprocess.Popen(cmd, env=_worker_env(unit, overlay), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=tmp)
        tail: list[str] = []
        reported = 0
        got: list[H.Result] = []
        for line in proc.stdout:
            if line.startswith(H.PROGRESS_MARK):
                info = json.loads(line[len(H.PROGRESS_MARK):])
                reported += info["done"]
                if "result" in info:
                    got += H.results_from_dicts([info["result"]])
                    on_result(got[-1])
                bar.advance(info["done"], info.get("label", ""))
            elif line.strip():
                tail = (tail + [line.rstrip()])[-12:]
                bar.message(f"[{unit.label}] {line.rstrip()}")
        code = proc.wait()
        if code != 0 or not out_json.exists():
            bar.advance(max(unit.size - reported, 0), unit.label)
            last = next((t for t in reversed(tail) if t.strip()), "no output")
            done = {(r.case_key, r.method) for r in got}
            return got + [r for r in _unit_failed(unit, "failed",
                                                  f"worker exited with code {code}: {last}")
                          if (r.case_key, r.method) not in done]
        payload = json.loads(out_json.read_text())
        return H.results_from_dicts(payload["results"])


# ---------------------------------------------------------------------------------------
# Targets.  Speed is never a unit test; the suite reports whether these hold.


def _ok(results, **match) -> list[H.Result]:
    return [r for r in results if r.status == "ok" and all(
        (v(getattr(r, k)) if callable(v) else getattr(r, k) == v) for k, v in match.items())]


def _target(name: str, rows: list[tuple[str, float | None]], bound: float, kind: str) -> dict:
    """``kind`` "max": every value <= bound; "min": every value >= bound."""
    values = [(label, v) for label, v in rows if v is not None]
    if not values:
        return {"target": name, "status": "NOT RUN", "detail": [],
                "note": "no measured rows for this target in this run"}
    good = all((v <= bound) if kind == "max" else (v >= bound) for _, v in values)
    return {"target": name, "status": "PASS" if good else "MISS",
            "detail": [f"{label}: {v:.2f}" for label, v in values]}


@dataclasses.dataclass(frozen=True)
class Target:
    """One speed target: which rows it reads (``select``: Result fields and the value or
    predicate each must match; the run's thread count is added), the value of each row
    (a Result attribute, or "us": the median in microseconds), the bound and its kind
    ("max": every value <= bound; "min": every value >= bound), and each row's label."""

    name: str
    select: dict
    value: str
    bound: float
    kind: str
    label: str = "T={seq} {dtype} {mode}"


_LONG = lambda t: t >= 4096  # noqa: E731
_FWD_OR_BWD = lambda m: m in ("fwd", "bwd")  # noqa: E731
_QWEN = {"model": "Qwen2-VL-7B", "seq": _LONG, "device": "cpu", "batch": 1}

# The project's speed targets (for the 2-core CPU, all threads).
TARGETS = (
    Target("1. Qwen2-VL-7B MRoPE apply, T>=4096: forward and backward each <= 1.3x the clone "
           "floor (allocating, like the method)",
           {**_QWEN, "op": "mrope", "method": "posenc", "mode": _FWD_OR_BWD},
           "ratio_to_copy", 1.3, "max"),
    Target("1b. (same bound, fused apply_rope; for information) forward and backward <= 1.3x "
           "the clone floor",
           {**_QWEN, "op": "mrope_fused", "method": "posenc_fused", "mode": _FWD_OR_BWD},
           "ratio_to_copy", 1.3, "max"),
    Target("1c. (for information) the rows of 1. against the copy_ floor (preallocated "
           "outputs: the bandwidth limit without page faults) <= 1.3x",
           {**_QWEN, "op": "mrope", "method": "posenc", "mode": _FWD_OR_BWD},
           "ratio_to_copy_into", 1.3, "max"),
    Target("2a. Qwen2-VL-7B MRoPE apply, T>=4096: forward+backward >= 5x faster than HF eager",
           {**_QWEN, "op": "mrope", "method": "hf_eager", "mode": "fwdbwd"},
           "posenc_speedup", 5.0, "min"),
    Target("2b. ... and >= 1.5x faster than torch.compile of HF",
           {**_QWEN, "op": "mrope", "method": "hf_compile", "mode": "fwdbwd"},
           "posenc_speedup", 1.5, "min"),
    Target("3. fused positions -> rotated q,k (Qwen2-VL-7B, T>=4096, forward) >= 3x faster "
           "than compiled HF rotary module + apply",
           {**_QWEN, "op": "mrope_fused", "method": "hf_compile", "mode": "fwd"},
           "posenc_speedup", 3.0, "min"),
    Target("4. compute_mrope_position_ids >= 30x faster than HF get_rope_index (B=8, L=8192)",
           {"op": "mrope_position_ids", "batch": 8, "seq": 8192, "method": "hf_eager"},
           "posenc_speedup", 30.0, "min", label="B={batch} L={seq}"),
    Target("6. compute_packed_mrope_position_ids (64 examples, rows of <= 64k tokens) >= 30x "
           "faster than the per-example loop over HF get_rope_index",
           {"op": "packed_position_ids", "method": "hf_eager",
            "extra": lambda e: e.startswith("examples=64,")},
           "posenc_speedup", 30.0, "min", label="B={batch} L={seq} {transformers}"),
    Target("5a. decode call (Qwen2-VL-7B heads, B=8, T=1, bf16, no grad): apply_rotary_pos_emb "
           "<= 8 us a call (absolute time, no floor)",
           {"op": "rope_call", "extra": "no grad", "method": "posenc"},
           "us", 8.0, "max", label="thr={threads}"),
    Target("5b. decode call (Qwen2-VL-7B heads, B=8, T=1, bf16, grad recording): "
           "apply_rotary_pos_emb <= 12 us a call (absolute time, no floor)",
           {"op": "rope_call", "extra": "grad recording", "method": "posenc"},
           "us", 12.0, "max", label="thr={threads}"),
    Target("7. vision towers: position ids + attention seqlens + window index + interpolation "
           "taps (posenc_torch.vision) >= 30x faster than transformers 5.x's vision_utils, "
           "each batch",
           {"op": "vision_all", "method": "hf_eager",
            "extra": lambda e: e.endswith(",transformers5")},
           "posenc_speedup", 30.0, "min", label="{extra}"),
    Target("7b. (for information) the same against transformers 4.57.6's methods (rot_pos_emb, "
           "get_window_index, fast_pos_embed_interpolate, forward's cu_seqlens) >= 30x",
           {"op": "vision_all", "method": "hf_eager",
            "extra": lambda e: e.endswith(",transformers4")},
           "posenc_speedup", 30.0, "min", label="{extra}"),
    Target("8a. q/k norm + rotary (apply_qk_norm_rope), T>=4096: forward <= 1.3x the clone "
           "floor of q and k",
           {"op": "qk_norm_rope", "seq": _LONG, "device": "cpu", "method": "posenc",
            "mode": "fwd"},
           "ratio_to_copy", 1.3, "max", label="{model} T={seq} {dtype}"),
    Target("8b. q/k norm + rotary, T>=4096: forward+backward >= 10x faster than transformers "
           "eager",
           {"op": "qk_norm_rope", "seq": _LONG, "method": "hf_eager", "mode": "fwdbwd"},
           "posenc_speedup", 10.0, "min", label="{model} T={seq} {dtype}"),
    Target("8c. ... >= 4x faster than transformers' norm + posenc rotary",
           {"op": "qk_norm_rope", "seq": _LONG, "method": "hf_norm_posenc_rotary",
            "mode": "fwdbwd"},
           "posenc_speedup", 4.0, "min", label="{model} T={seq} {dtype}"),
    Target("8d. ... >= 2x faster than torch.compile of transformers' norm + rotary",
           {"op": "qk_norm_rope", "seq": _LONG, "method": "hf_compile", "mode": "fwdbwd"},
           "posenc_speedup", 2.0, "min", label="{model} T={seq} {dtype}"),
    Target("8e. q/k norm + rotary: bytes saved for backward per q/k element in bf16 <= 2.5",
           {"op": "qk_norm_rope", "method": "posenc", "mode": "fwdbwd", "dtype": "bf16"},
           "saved_bytes_per_element", 2.5, "max", label="{model} T={seq}"),
    Target("9a. patched Qwen3-VL attention, q/k norm + rotary (the fused forward), T>=4096: "
           ">= 3x faster than patch(fuse_qk_norm=False)",
           {"op": "qk_attention_prologue", "seq": _LONG, "method": "posenc_unfused"},
           "posenc_speedup", 3.0, "min", label="T={seq} {dtype} {mode}"),
    Target("9b. ... faster than torch.compile of the unpatched layer",
           {"op": "qk_attention_prologue", "seq": _LONG, "method": "hf_compile"},
           "posenc_speedup", 1.0, "min", label="T={seq} {dtype} {mode}"),
    Target("9c. ... bytes saved for backward per q/k element in bf16 <= 2.5",
           {"op": "qk_attention_prologue", "method": "posenc", "mode": "fwdbwd",
            "dtype": "bf16"},
           "saved_bytes_per_element", 2.5, "max", label="T={seq}"),
)


def evaluate_targets(results: list[H.Result], threads: int,
                     targets: Sequence[Target] = TARGETS) -> list[dict]:
    out = []
    for t in targets:
        rows = _ok(results, threads=threads, **t.select)
        values = [(t.label.format(**r.to_dict()),
                   r.median_ms * 1e3 if t.value == "us" else getattr(r, t.value)) for r in rows]
        out.append(_target(t.name, values, t.bound, t.kind))
    return out


def format_targets(targets: list[dict], threads: int, cores: int) -> str:
    lines = ["", f"Targets (checked at {threads} threads on a {cores}-core CPU; the targets "
                 "are stated for the 2-core development CPU):"]
    for t in targets:
        lines.append(f"  [{t['status']:>7}] {t['target']}")
        if t["detail"]:
            lines.append("            " + "; ".join(t["detail"]))
        if t.get("note"):
            lines.append(f"            {t['note']}")
    return "\n".join(lines)


# The memory-floor check (the floor topic, bench_floor.py): every posenc kernel variant at
# <= 1.3x a preallocated copy_ of the same bytes, fp32 and bf16, forward and backward, long
# sequences, with allocation taken out; printed per variant and thread count with the kind
# of host.
FLOOR_BOUND = 1.3
FLOOR_OPS = {"mrope": ("posenc", "apply", True), "mrope_fused": ("posenc_fused", "fused", False)}
FLOOR_NEEDED = [(dt, mode) for dt in ("fp32", "bf16") for mode in ("fwd", "bwd")]
_QWEN_ANY_BATCH = {k: v for k, v in _QWEN.items() if k != "batch"}


def floor_check(results: list[H.Result], threads: Sequence[int]) -> list[dict]:
    """Per kernel variant (the case's ``extra``) and thread count: each Qwen2-VL-7B row of
    the floor topic (apply: the target; fused apply_rope: for information) at T >= 4096,
    forward or backward, with its ratios to both floors, and the verdict: PASS when every
    fp32 and bf16 forward and backward apply row is at most FLOOR_BOUND x copy_, NOT RUN when
    one of them was not measured (a variant this CPU lacks: skipped, with the reason)."""
    out = []
    floor_rows = [r for r in results if r.topic == "floor"]
    variants = [v for v in dict.fromkeys(r.extra for r in floor_rows)]
    for isa in variants:
        for n in threads:
            rows, missing = [], set(FLOOR_NEEDED)
            for op, (method, kind, required) in FLOOR_OPS.items():
                for r in _ok(floor_rows, extra=isa, threads=n, op=op, method=method,
                             mode=_FWD_OR_BWD, **_QWEN_ANY_BATCH):
                    # single calls back to back with copy_ where measured, else the blocks'
                    pair = r.ratio_pair_copy_into
                    ratio = pair if pair is not None else r.ratio_to_copy_into
                    good = ratio is not None and ratio <= FLOOR_BOUND
                    rows.append({"label": f"B={r.batch} T={r.seq} {r.dtype} {r.mode} {kind}",
                                 "x_copy_": ratio, "x_clone": r.ratio_to_copy,
                                 "x_copy_blocks": r.ratio_to_copy_into, "x_copy_pair": pair,
                                 "ms": r.median_ms, "required": required,
                                 "status": "PASS" if good else "MISS"})
                    if required:
                        missing.discard((r.dtype, r.mode))
            skipped = sorted({r.reason for r in floor_rows
                              if r.extra == isa and r.threads == n and r.status == "skipped"})
            misses = [row["label"] for row in rows if row["required"] and row["status"] != "PASS"]
            status = "NOT RUN" if missing else "MISS" if misses else "PASS"
            out.append({"isa": isa, "threads": n, "status": status, "rows": rows,
                        "misses": misses, "skipped": skipped,
                        "not_run": [f"{dt} {mode}" for dt, mode in sorted(missing)]})
    return out


def _fmt_ratio(v: float | None) -> str:
    return f"{v:5.2f}" if v is not None else "    -"


def format_floor_check(checks: list[dict], machine: dict) -> str:
    kind = machine.get("host_kind", "unknown")
    lines = ["", f"Floor check (the floor topic, allocation taken out) on an {kind} host: "
                 f"target <= {FLOOR_BOUND}x copy_ for fp32 and bf16, forward and backward, "
                 "T >= 4096, per kernel variant (Qwen2-VL-7B MRoPE apply; the fused "
                 "apply_rope rows are for information); x copy_ is the median of per-round "
                 "ratios of single calls back to back with copy_, (blocks ...) that of the "
                 "interleaved blocks:"]
    if not checks:
        lines.append("  NOT RUN: the floor topic was not part of this run")
    for c in checks:
        isa = c["isa"]
        for row in c["rows"]:
            tag = row["status"] if row["required"] else "info"
            blocks = (f" (blocks {_fmt_ratio(row['x_copy_blocks'])})"
                      if row.get("x_copy_pair") is not None else "")
            lines.append(f"  {isa:>6} thr={c['threads']} [{tag:>4}] {row['label']:<28} "
                         f"{_fmt_ratio(row['x_copy_'])} x copy_{blocks} "
                         f"{_fmt_ratio(row['x_clone'])} x clone")
        if c["skipped"]:
            why = "skipped: " + "; ".join(c["skipped"])
        elif c["not_run"]:
            why = "not measured: " + ", ".join(c["not_run"])
        elif c["misses"]:
            why = "above the bound: " + "; ".join(c["misses"])
        else:
            why = "every fp32 and bf16 forward and backward row is within the bound"
        lines.append(f"  {isa:>6} thr={c['threads']} => {c['status']} ({isa} kernels on an "
                     f"{kind} host): {why}")
    return "\n".join(lines)


def format_summary(results: list[H.Result]) -> str:
    """One line per case: our time, ratio to copy and speed-up over each peer."""
    lines = ["", "Summary (paired medians; 'x clone' / 'x copy_' = posenc time / the clone or "
                 "copy_ floor's time; 'x eager' = HF eager time / posenc time, etc.):",
             f"{'op':<19}{'model':<14}{'B':>3}{'T':>7} {'dtype':<6}{'mode':<7}{'thr':>3} "
             f"{'method':<14}{'ms':>9}{'x clone':>8}{'x copy_':>8}{'x eager':>9}"
             f"{'x compile':>10}{'x liger':>8}"]
    for key, rows in H.group_by_case(results).items():
        case = H.Case(*key)
        ok = {r.method: r for r in rows if r.status == "ok"}
        ours = next((ok[m] for m in sorted(ok, key=lambda m: H.PRIMARY.get(m, 9))
                     if m in H.PRIMARY), None)
        if ours is None:
            why = next((r.reason for r in rows if r.method.startswith("posenc")), "")
            lines.append(f"{case.op:<19}{case.model:<14}{case.batch:>3}{case.seq:>7} "
                         f"{case.dtype:<6}{case.mode:<7}{case.threads:>3}  posenc not timed: "
                         f"{why[:70]}")
            continue

        def sp(name):
            r = ok.get(name)
            return f"{r.posenc_speedup:.2f}" if r and r.posenc_speedup else "-"

        ratio = f"{ours.ratio_to_copy:.2f}" if ours.ratio_to_copy else "-"
        ratio_into = f"{ours.ratio_to_copy_into:.2f}" if ours.ratio_to_copy_into else "-"
        lines.append(f"{case.op:<19}{case.model:<14}{case.batch:>3}{case.seq:>7} "
                     f"{case.dtype:<6}{case.mode:<7}{case.threads:>3} {ours.method:<14}"
                     f"{ours.median_ms:>9.3f}{ratio:>8}{ratio_into:>8}{sp('hf_eager'):>9}"
                     f"{sp('hf_compile'):>10}{sp('liger'):>8}  {case.extra}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------


def write_csv(path: Path, results: list[H.Result]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=H.Result.row_fields())
        w.writeheader()
        for r in results:
            w.writerow(r.to_dict())


def _overlay_version(overlay: Path | None) -> str | None:
    if overlay is None:
        return None
    found = sorted(overlay.glob("transformers-*.dist-info"))
    return found[0].name[len("transformers-"):-len(".dist-info")] if found else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="suite", action="store_const", const="quick",
                   help="a small subset, a few minutes on 2 cores (default)")
    g.add_argument("--full", dest="suite", action="store_const", const="full",
                   help="the whole sweep: T = 1k..32k, fp32 and bf16")
    p.add_argument("--topics", default=None,
                   help=f"comma-separated subset of {','.join(TOPICS)} (default: every topic "
                        "for the device: gpu only with --device cuda)")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread counts, 'all' = every usable core "
                        f"(default: {DEFAULT_THREADS['quick']} for --quick, "
                        f"{DEFAULT_THREADS['full']} for --full)")
    p.add_argument("--out", default=str(HERE / "results"),
                   help="directory for <suite>.json/.csv and the plots (default: %(default)s)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu (default), or cuda (posenc_torch's CUDA kernels when the build "
                        "has them, else its rows are skipped with that reason)")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNG plots")
    p.add_argument("--isa", default="best",
                   choices=("best", "avx512bf16", "avx512", "avx2", "baseline"),
                   help="posenc_torch's SIMD kernel variant in every worker (set_kernel_isa): "
                        "the best this CPU has (default), or one it also has, e.g. avx2 on "
                        "an AVX-512 host")
    p.add_argument("--seq", default=None,
                   help="comma-separated sequence lengths replacing the suite's (decode steps "
                        "and position-id cases stay); results go to <suite>-T<seqs>.json")
    g.add_argument("--smoke", dest="suite", action="store_const", const="smoke",
                   help=argparse.SUPPRESS)  # tiny sizes, for tests/test_benchmarks.py
    p.set_defaults(suite="quick")
    args = p.parse_args(argv)

    if args.topics is None:
        topics = [t for t, m in TOPICS.items()
                  if args.device in getattr(m, "DEVICES", ("cpu", "cuda"))]
    else:
        topics = [t.strip() for t in args.topics.split(",") if t.strip()]
    unknown = [t for t in topics if t not in TOPICS]
    if unknown:
        p.error(f"unknown topic(s) {unknown}; choose from {list(TOPICS)}")
    threads = parse_threads(args.threads or DEFAULT_THREADS[args.suite])
    seqs = tuple(int(t) for t in args.seq.split(",")) if args.seq else None
    run_name = args.suite + (f"-T{'_'.join(map(str, seqs))}" if seqs else "")
    overlay = hf4_overlay()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    units = []
    for topic in topics:
        module = TOPICS[topic]
        for part, major in module.PARTS.items():
            for n in threads:
                opts = H.Options(part, args.suite, n, args.device, None, seqs)
                units.append(Unit(module, part, major, n, module.plan(opts)))

    try:  # the driver records the variant the workers will run (they force it the same way)
        H.apply_isa(args.isa)
    except ValueError as exc:
        p.error(f"--isa {args.isa}: {exc}")
    os.environ[H.ISA_ENV] = args.isa
    started = H.now_iso()
    machine = H.machine_info(args.device)
    t0 = time.perf_counter()
    bar = H.ProgressBar(sum(u.size for u in units))
    bar.message(f"posenc_torch benchmarks ({args.suite}): topics {','.join(topics)}, threads "
                f"{threads}, {sum(u.size for u in units)} measurements in {len(units)} workers")
    versions = H.versions()
    versions["transformers_4_overlay"] = _overlay_version(overlay)
    json_path = out_dir / f"{run_name}.json"

    floor: list[dict] = []

    def write(results: list[H.Result], targets: list[dict] | None) -> None:
        """The results file; written after every case (``complete`` false until the end),
        so a run cut short keeps what it measured."""
        payload = {
            "suite": args.suite,
            "command": "benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": started,
            "wall_s": round(time.perf_counter() - t0, 1),
            "complete": targets is not None,
            "machine": machine,
            "threads": threads,
            "versions": versions,
            "timing": {
                "policy": dataclasses.asdict(H.FULL if args.suite == "full" else H.QUICK),
                "method": H.__doc__,
            },
            "models": {name: dataclasses.asdict(m) for name, m in H.MODELS.items()},
            "targets": targets or [],
            "floor_check": floor,
            "results": [r.to_dict() for r in results],
        }
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        tmp.replace(json_path)

    results: list[H.Result] = []
    for unit in units:
        so_far = list(results)

        def saved(r: H.Result, so_far=so_far) -> None:
            so_far.append(r)
            write(so_far, None)

        results.extend(run_unit(unit, args.suite, args.device, bar, overlay, seqs, saved))
        write(results, None)
    bar.close()
    H.derive_ratios(results)

    top = max(threads)
    targets = evaluate_targets(results, top)
    floor.extend(floor_check(results, threads))
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    write(results, targets)
    write_csv(out_dir / f"{run_name}.csv", results)

    print(H.format_table(results))
    print(format_summary(results))
    print(format_targets(targets, top, machine["usable_cores"]))
    print(format_floor_check(floor, machine))
    load = machine.get("load_average"), machine.get("load_average_end")
    forced = " (forced with --isa)" if machine.get("isa_forced") else ""
    print(f"\nMachine: {machine['cpu']}, {machine['usable_cores']} cores, "
          f"{machine.get('host_kind')} host, posenc kernel variant {machine['posenc_isa']}"
          f"{forced}; load average at start/end {load[0]} / {load[1]} (a load above the core "
          "count means other work shared the CPU: expect noise).")
    print(f"Results: {json_path} and {json_path.with_suffix('.csv')}")

    if not args.no_plots:
        try:
            import plot
            made = plot.main([str(json_path)])
            print(f"Plots: {made}")
        except ImportError as exc:
            print(f"Plots not drawn: {exc} (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
